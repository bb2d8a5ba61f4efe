import os

import pytest
import torch

from kimi_perf_kernels.common import gpu_tiles
from tests.kernels.util import program_order

_EMPTY, _EMPTY_LIKE = torch.empty, torch.empty_like


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    """What ``torch.empty`` gives, filled with what no kernel writes: NaN, an integer's most
    negative value (an index far out of range), True."""
    with torch.no_grad():
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).min if t.dtype.is_signed else torch.iinfo(t.dtype).max)
    return t


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every buffer made with ``torch.empty``/``empty_like`` (the kernels' own outputs and
    scratch among them) starts poisoned, so an element a kernel never writes, or a buffer
    read before it is written, cannot pass as the zeros fresh memory often holds."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poisoned(_EMPTY(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poisoned(_EMPTY_LIKE(*a, **k)))


@pytest.fixture(params=["whole", "gpu"])
def tiles(request):
    """Launch with the interpreter's whole-dimension tiles (every tile loop runs once), or
    with a GPU's (the loops run over several tiles, as they do there)."""
    if request.param == "gpu":
        with gpu_tiles():
            yield request.param
    else:
        yield request.param


@pytest.fixture(autouse=True)
def programs_ordered():
    """KIMI_PERF_PROGRAMS_REVERSED=1 runs every grid's programs last to first (CI runs the
    kernel tests in both orders): a kernel whose programs share memory must not depend on
    the interpreter's grid order."""
    with program_order(reverse=os.environ.get("KIMI_PERF_PROGRAMS_REVERSED") == "1"):
        yield
