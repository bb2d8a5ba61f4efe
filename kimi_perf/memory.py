"""Hand freed heap memory back to the operating system between the trace core's phases.

glibc keeps the memory numpy frees for later allocations, and after a large temporary it also
raises its mmap threshold, so later arrays of that size come from the heap too. After a phase
that made large temporaries (reading, attribution), tens of MB sit free in the heap while the
next phase's Python objects (breakdown rows, which come from their own arenas) take new
memory: the peak RSS grows by what nothing uses. ``malloc_trim(0)`` returns every free page of
the heap, not only its top. Where the C library is not glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):   # no C library by that name, or no glibc
        return None


def release_free_memory() -> None:
    """Return the heap's free pages to the OS (a few ms; the memory is still reusable)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
