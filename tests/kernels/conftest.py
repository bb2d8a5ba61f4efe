import os

import pytest

from kimi_perf_kernels.common import gpu_tiles
from tests.kernels.util import program_order
from tests.poisoning import poison_fresh_buffers


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every buffer a kernel test makes fresh (the kernels' own outputs and scratch among
    them) starts poisoned (``tests.poisoning``)."""
    poison_fresh_buffers(monkeypatch)


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
