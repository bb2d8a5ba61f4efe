from __future__ import annotations

import os

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
