"""``read_trace(path)``: any supported trace file -> ``Trace``, chosen by content, not name."""

from __future__ import annotations

import gzip
import shutil
import stat
import tempfile
import zlib
from pathlib import Path

from kimi_perf.errors import COMMAND_LINE, TraceError, input_stat, path_argument
from kimi_perf.memory import release_free_memory
from kimi_perf.nesting import nest_ranges
from kimi_perf.readers.kineto import GZIP_MAGIC, UTF8_BOM, read_kineto_json
from kimi_perf.readers.nsys import (
    NSYS_REPORT_MAGIC,
    NSYS_REPORTS,
    SQLITE_MAGIC,
    read_nsys_rep,
    read_nsys_sqlite,
)
from kimi_perf.trace import (
    ARROW_MAGIC,
    JSON_HEAD,
    KIMI_PERF_JSON,
    Trace,
    file_identity,
    kimi_perf_head,
    kimi_perf_head_read,
    meta_problem,
)

__all__ = ["read_trace"]


def read_trace(path: str | Path, capture: str | Path | None = None) -> Trace:
    """Read an nsys SQLite export, an ``.nsys-rep``, a Kineto JSON(.gz) or a saved ``.kptrace``.

    ``capture``: a trace of the same process that recorded the CUDA/HIP graph captures
    ``path`` replays, read and joined to it (``graphs.with_capture``), so that the replayed
    kernels fall in the ranges open at capture.

    Raises ``TraceError`` (one line: file and problem) for anything it cannot read.
    """
    path = path_argument(path, "path")
    if capture is not None:
        from kimi_perf.graphs import with_capture

        capture = path_argument(capture, "capture")
        return with_capture(read_trace(path), read_trace(capture), path, capture)
    if stat.S_ISDIR(input_stat(path).st_mode):
        if (path / "breakdown.json").exists():
            raise TraceError(path, "a kimi-perf run directory, not a trace file (" + (
                "`kimi-perf info` names" if COMMAND_LINE.get() else
                "kimi_perf.runs.load_paths reads its breakdowns; its run.json names")
                + " the traces it holds or was made from)")
        raise TraceError(path, "is a directory, not a trace file, and not a kimi-perf run "
                               "(no breakdown.json in it)")
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise TraceError(path, f"cannot read ({exc.strerror or exc})") from None
    if not head:
        raise TraceError(path, "empty file")
    if KIMI_PERF_JSON.match(head):
        raise TraceError(path, "a kimi-perf breakdown JSON, not a trace (breakdown, compare, "
                               "gate and report read it)")
    if head.startswith(SQLITE_MAGIC):
        reader = read_nsys_sqlite
    elif head.startswith(ARROW_MAGIC):
        reader = Trace.load
    elif head.startswith(GZIP_MAGIC):
        reader = _gzipped_reader(path)
    elif _json_start(head) in (b"{", b"["):
        reader = read_kineto_json
    elif path.suffix in NSYS_REPORTS or head.startswith(NSYS_REPORT_MAGIC):   # nsys reads it
        reader = read_nsys_rep
    elif head.isspace() and (first := _first_non_blank(path)) in (b"", b"{", b"["):
        if not first:
            raise TraceError(path, "holds only blanks (spaces and line breaks)")
        reader = read_kineto_json   # JSON after more blanks than the head holds
    else:
        raise TraceError(path, "unknown format: expected an nsys SQLite export, an .nsys-rep, "
                               "a Kineto JSON trace (.json/.json.gz) or a .kptrace")
    try:
        trace = reader(path)
        if reader != Trace.load:   # (a bound method: equal, never the same object)
            # which file this is, kept when it is saved as a .kptrace: a directory holding
            # both reads the capture once (a .kptrace keeps its source's)
            if (identity := file_identity(path)) is not None:
                trace.meta["source_identity"] = identity
            release_free_memory()   # the reader's temporaries: see kimi_perf/memory.py
            nest_ranges(trace.ranges)
            trace.tidy_strings()
            release_free_memory()   # and the nesting's
    except TraceError:
        raise
    except MemoryError:
        raise TraceError(path, "out of memory reading it (a size in it that is corrupt, or a "
                               "trace too large for this machine's memory)") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError,
            UnicodeError, RecursionError) as exc:
        # Malformed content that no specific check caught still gets the one-line contract.
        raise TraceError(path, f"malformed trace ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})"
                         ) from None
    if problem := meta_problem(trace.meta):    # what the analyses would trip on, far away
        raise TraceError(path, f"malformed trace metadata: {problem}")
    return trace


def _json_start(head: bytes) -> bytes:
    """The first character of a JSON text's first bytes, past a BOM and blanks."""
    return head.removeprefix(UTF8_BOM).lstrip()[:1]


def _first_non_blank(path: Path) -> bytes:
    """The file's first byte that is not whitespace (b"" where it is all whitespace), read a
    MB at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if rest := chunk.lstrip():
                return rest[:1]
    return b""


def _gzipped_reader(path: Path):
    """The reader of what a gzip file holds, by its first bytes: an nsys export or Kineto
    JSON (also where they cannot be read: the Kineto reader then says why the gzip is bad)."""
    try:
        with gzip.open(path, "rb") as f:
            inner = f.read(64)
            if (ours := kimi_perf_head(inner)) is None:   # (its keys moved, or a trace's)
                inner += f.read(JSON_HEAD)
                ours = kimi_perf_head_read(inner)
    except (OSError, EOFError, zlib.error):
        return read_kineto_json
    if inner.startswith(SQLITE_MAGIC):
        return _read_gzipped_sqlite
    if inner.startswith(ARROW_MAGIC):
        raise TraceError(path, "a gzipped .kptrace: gunzip it (a .kptrace is compressed "
                               "within)")
    if ours:
        raise TraceError(path, "a gzipped kimi-perf breakdown JSON: gunzip it (breakdown, "
                               "compare, gate and report read it)")
    if _json_start(inner) not in (b"", b"{", b"["):   # (b"": blanks past what was read)
        raise TraceError(path, "unknown format inside the gzip: expected an nsys SQLite "
                               "export or a Kineto JSON trace")
    return read_kineto_json


def _read_gzipped_sqlite(path: Path) -> Trace:
    """An nsys SQLite export gzipped, as exports are shared: decompressed into a temporary
    file (SQLite reads files) and read as the export; errors name the gzip file."""
    with tempfile.TemporaryDirectory(prefix="kimi-perf-") as tmp:
        plain = Path(tmp) / "export.sqlite"
        try:
            with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise TraceError(path, f"truncated or corrupt gzip ({exc})") from None
        except OSError as exc:
            raise TraceError(path, f"cannot decompress it into {tmp} ({exc.strerror or exc})"
                             ) from None
        try:
            trace = read_nsys_sqlite(plain)
        except TraceError as exc:
            raise TraceError(path, exc.problem) from None
    trace.meta["file"] = str(path)
    return trace
