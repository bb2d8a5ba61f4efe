"""Memory: hand freed heap memory back to the operating system between the trace core's
phases, and cap a CPU run's address space at what the machine has free.

glibc keeps the memory numpy frees for later allocations, and after a large temporary it also
raises its mmap threshold, so later arrays of that size come from the heap too. After a phase
that made large temporaries (reading, attribution), tens of MB sit free in the heap while the
next phase's Python objects (breakdown rows, which come from their own arenas) take new
memory: the peak RSS grows by what nothing uses. ``malloc_trim(0)`` returns every free page of
the heap, not only its top. Where the C library is not glibc this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator


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


# Address space a thread maps but does not use: glibc's malloc arena (64 MiB reserved) and its
# stack (8 MiB). torch starts its intra-op and inter-op threads, up to one each a core, lazily:
# inside a capped run, so the cap leaves room for them.
THREAD_RESERVE = 72 << 20


@contextlib.contextmanager
def address_space_capped(free: int | None) -> Iterator[None]:
    """While the block runs, this process's address space (and that of a process it starts
    then, each its own) is capped at what it maps now, plus ``free`` bytes (the memory free
    for it), plus what threads reserve (``THREAD_RESERVE``, two a core): a CPU run that
    outgrows the machine then fails an allocation, which is said in one line, where the
    out-of-memory killer would end it without a word (the estimates checked before a run
    are about). Nothing where ``free`` is None or this is no Linux; never for CUDA, which
    maps far more address space than it uses."""
    try:
        import resource
    except ImportError:   # (no such module off Unix)
        resource = None
    mapped = _mapped_bytes()
    if resource is None or free is None or mapped is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + free + 2 * (os.cpu_count() or 1) * THREAD_RESERVE
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _mapped_bytes() -> int | None:
    """The process's address space now (VmSize), or None where /proc does not say."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return None
