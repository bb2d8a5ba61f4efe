"""Fresh buffers poisoned: what ``torch.empty`` and its kin give starts as what no kernel or
op writes, so an element never written, or a buffer read before it is written, cannot pass
as the zeros fresh memory often holds. Kernel tests poison every test; the decode paths'
tests take it as the ``poisoned_empty`` fixture (tests/conftest.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

# the unpoisoned originals, for a buffer a test needs left virtual (a 2 GiB cache it touches
# a few rows of)
UNPOISONED_EMPTY, _EMPTY_LIKE, _EMPTY_STRIDED = torch.empty, torch.empty_like, torch.empty_strided
_NEW_EMPTY = torch.Tensor.new_empty


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with what nothing writes: NaN, an integer's most negative value (an index
    far out of range; unsigned: its largest), True. Out of sight of any dispatch mode (a
    test's record of the ops a step runs)."""
    with torch.no_grad(), _disable_current_modes():
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).min if t.dtype.is_signed else torch.iinfo(t.dtype).max)
    return t


def poison_fresh_buffers(monkeypatch) -> None:
    """Within a test: ``torch.empty``, ``empty_like``, ``empty_strided`` and
    ``Tensor.new_empty`` give poisoned buffers."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(UNPOISONED_EMPTY(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(_EMPTY_LIKE(*a, **k)))
    monkeypatch.setattr(torch, "empty_strided",
                        lambda *a, **k: poisoned(_EMPTY_STRIDED(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *a, **k: poisoned(_NEW_EMPTY(self, *a, **k)))
