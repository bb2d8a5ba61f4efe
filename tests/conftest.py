from __future__ import annotations

import os
import signal
import warnings

# Triton kernels run in Triton's interpreter on this CPU; it must be chosen before triton
# is imported (kernel tests, the specialized path).
os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("KIMI_PERF_FIXTURES", REPO.parent / "shared" / "fixtures"))
NSYS = FIXTURES / "nsys"
KINETO = FIXTURES / "kineto"
DATA = Path(__file__).resolve().parent / "data"

# pytest-xdist's workers (pytest -n 2) start with COLUMNS=80 and LINES=24 set, whatever the
# terminal: the tables the tests read would be laid out 80 wide, not as kimi-perf lays out
# output piped to a file. The workers get the environment the tests were started with.
_TERMINAL = ("COLUMNS", "LINES")
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in _TERMINAL:
        _started = os.environ.get(f"KIMI_PERF_TESTS_{_name}")
        if _started == "-":
            os.environ.pop(_name, None)
        elif _started is not None:
            os.environ[_name] = _started
else:
    os.environ.update({f"KIMI_PERF_TESTS_{name}": os.environ.get(name, "-")
                       for name in _TERMINAL})

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A run started in the background of a script (`pytest ... &`) inherits SIGINT ignored, and
# Python then leaves it so: the tests of what Ctrl-C and SIGTERM do would see a command that
# ignores them. They run with the handlers an interactive run has.
for _number, _handler in ((signal.SIGINT, signal.default_int_handler),
                          (signal.SIGTERM, signal.SIG_DFL)):
    if signal.getsignal(_number) is signal.SIG_IGN:
        signal.signal(_number, _handler)
_HANDLERS = {number: signal.getsignal(number) for number in _SIGNALS}


def _ignored_or_blocked() -> list[str]:
    """SIGINT and SIGTERM as the kernel has them for this thread, where they are ignored (a
    library's own sigaction, which ``signal.getsignal`` does not see) or blocked; Linux only."""
    status = Path("/proc/thread-self/status")
    if not status.exists():
        return []
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    return [f"{signal.Signals(number).name} {how}" for field, how in (("SigIgn", "ignored"),
                                                                     ("SigBlk", "blocked"))
            for number in _SIGNALS if int(fields[field], 16) >> (number - 1) & 1
            and not (how == "ignored" and _HANDLERS[number] is signal.SIG_IGN)]


def _restore_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    for number, handler in _HANDLERS.items():
        if handler is not None:   # (None: a handler not set from Python)
            signal.signal(number, handler)


@pytest.fixture(autouse=True)
def signal_handlers_left_as_found():
    """A test (or the code it runs) that leaves a SIGINT or SIGTERM handler changed fails: the
    tests after it on the same process would run under it (a Ctrl-C ignored, its subprocesses
    ignoring it too), passing or failing by the order the tests ran in. One that leaves them
    ignored or blocked where Python cannot see it (a library's own sigaction or mask) is
    warned of, and they are restored."""
    if _ignored_or_blocked():
        _restore_signals()
    yield
    changed = {signal.Signals(n).name: signal.getsignal(n) for n in _SIGNALS
               if signal.getsignal(n) is not _HANDLERS[n]}
    unseen = _ignored_or_blocked()
    _restore_signals()
    assert not changed, f"signal handlers left changed: {changed}"
    if unseen:
        warnings.warn(f"the test left {', '.join(unseen)}", stacklevel=1)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Fresh buffers start poisoned within the test (``tests.poisoning``; torch is imported
    only where a test asks for it)."""
    from tests.poisoning import poison_fresh_buffers

    poison_fresh_buffers(monkeypatch)


def rank_copy(source: Path, target: Path, rank: int) -> Path:
    """A gzipped ``source`` trace as another rank's capture of the same work: a plain copy is
    the same capture (its bytes; --from refuses it), so it is gzipped again with another
    timestamp in its header."""
    import gzip

    target.write_bytes(gzip.compress(gzip.decompress(source.read_bytes()), mtime=rank + 1))
    return target


def nsys_fixtures() -> list[Path]:
    return sorted(NSYS.glob("*.sqlite"))


def kineto_fixtures() -> list[Path]:
    return sorted(KINETO.glob("*.json.gz"))


def pytest_sessionfinish(session, exitstatus):
    """With KIMI_PERF_NO_SKIPS set (CI, where everything the tests need is installed), a
    skipped test fails the run: a tool that failed to install must not pass as green."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("KIMI_PERF_NO_SKIPS") and skipped and exitstatus == 0:
        reporter.write("\n")
        reporter.write_line(f"KIMI_PERF_NO_SKIPS: {len(skipped)} test(s) skipped", red=True)
        session.exitstatus = 1
