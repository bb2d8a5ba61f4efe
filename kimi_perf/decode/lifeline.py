"""A process kimi-perf started that stops itself once kimi-perf has exited: where kimi-perf is
killed outright (SIGKILL), nothing else stops it, and it would run all its steps."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable


def stop_when_gone(pid: int, leaving: Callable[[], None] | None = None) -> None:
    """Exit once process ``pid`` (the kimi-perf that started this one) has. The process nsys
    profiles (``worker``): nsys's launcher puts it in a session of its own, so that nothing
    else stops it where kimi-perf is killed, or kills an nsys that would not stop (its steps
    could run for hours); a CPU TP rank (``tp``): a kimi-perf killed outright (SIGKILL)
    cannot stop it. ``leaving``: what to tidy first (what kimi-perf would have removed).
    Called before torch is imported where it can be (seconds in which the pid could be
    another's); no watch where the kernel has no pidfd (Linux before 5.3)."""
    try:
        gone = os.pidfd_open(pid)
    except ProcessLookupError:
        gone = None
    except (OSError, AttributeError):
        return

    def watch() -> None:
        if gone is not None:   # (readable once the process has exited, reaped or not)
            select.select([gone], [], [])
        with contextlib.suppress(OSError):   # (stderr a pipe no one reads now)
            print(f"kimi-perf (process {pid}) that asked for this run has exited: stopping",
                  file=sys.stderr, flush=True)
        if leaving is not None:
            with contextlib.suppress(Exception):
                leaving()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="stop-when-kimi-perf-is-gone").start()
