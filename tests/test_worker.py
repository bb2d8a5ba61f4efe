"""The process ``kimi-perf trace --backend nsys`` has nsys profile (``kimi_perf.decode.worker``):
that it stops once the kimi-perf that asked for it has exited. No torch needed: the watch
starts before the worker imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _has_pidfd() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        return False
    return True


WATCHING_WORKER = """
import sys, time
from kimi_perf.decode.worker import stop_when_gone
stop_when_gone(int(sys.argv[1]))
print("watching", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not _has_pidfd(), reason="no pidfd (Linux before 5.3): the worker keeps "
                                              "no watch")
@pytest.mark.parametrize("asker_end, stderr", [
    ("reaped", "read"), ("unreaped", "read"),
    ("reaped", "closed")])   # (its print fails: a pipe no one reads; it exits all the same)
def test_the_nsys_worker_stops_once_kimi_perf_has_exited(asker_end, stderr):
    """The process nsys profiles, in a session of its own, watches the kimi-perf that asked
    for it and exits once that has, reaped or not yet, whatever becomes of its stderr."""
    asker = subprocess.Popen(["sleep", "600"])
    worker = subprocess.Popen([sys.executable, "-c", WATCHING_WORKER, str(asker.pid)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, cwd=Path(__file__).parent.parent)
    try:
        assert worker.stdout.readline() == "watching\n"
        if stderr == "closed":
            worker.stderr.close()
        asker.kill()
        if asker_end == "reaped":
            asker.wait()
        assert worker.wait(timeout=30) == 1
        if stderr == "read":
            assert worker.stderr.read().endswith(f"kimi-perf (process {asker.pid}) that asked "
                                                 "for this run has exited: stopping\n")
    finally:
        for process in (asker, worker):
            process.kill()
            process.wait()
