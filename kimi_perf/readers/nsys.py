"""Nsight Systems SQLite exports (``nsys export --type sqlite``), schemas 2.9 to 3.25.

Columns are selected by name, so added columns in newer exports are ignored; any table may be
missing (a lazy export, a run without CUDA or NVTX) and then reads as empty. Integer columns
come back from SQLite as one comma-separated text per column (``group_concat``), which numpy
parses in C rather than one Python object per event. Where that text cannot carry the values
exactly (a non-integer value, a table too big for one SQLite string) the rows are fetched in
blocks into numpy arrays instead. Names stored as plain text rather than string ids (kernel
names in some exports, NVTX ranges without a registered string) are read row by row.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np

from kimi_perf.errors import TraceError
from kimi_perf.launches import find_launches
from kimi_perf.strings import StringTable
from kimi_perf.trace import (
    DRIVER,
    OTHER_API,
    PUSHPOP,
    RUNTIME,
    STARTEND,
    ApiCalls,
    Kernels,
    MemOps,
    Ranges,
    Table,
    Trace,
)

SQLITE_MAGIC = b"SQLite format 3\x00"
KNOWN_SCHEMA_MAJORS = (2, 3)

# NVTX event types (ENUM_NSYS_EVENT_TYPE): push/pop and start/end ranges, their NVTXT variants,
# and domain creation.
NVTX_PUSHPOP, NVTX_STARTEND, NVTXT_PUSHPOP, NVTXT_STARTEND, NVTX_DOMAIN_CREATE = 59, 60, 70, 71, 75
# CUPTI_ACTIVITY_KIND_RUNTIME.eventClass of the "CUDA backtrace" rows that old exports add
# beside the real API call, with the same correlation id.
BACKTRACE_EVENT_CLASS = 67

MEMCPY_KINDS = {
    0: "Unknown", 1: "Host-to-Device", 2: "Device-to-Host", 3: "Host-to-Array",
    4: "Array-to-Host", 5: "Array-to-Array", 6: "Array-to-Device", 7: "Device-to-Array",
    8: "Device-to-Device", 9: "Host-to-Host", 10: "Peer-to-Peer",
    11: "Unified Host-to-Device", 12: "Unified Device-to-Host", 13: "Unified Device-to-Device",
}

# an nsys report's suffixes (.qdrep: its name before nsys 2021.4), which nsys alone reads,
# and how a report begins (nsys reads it under any name)
NSYS_REPORTS = (".nsys-rep", ".qdrep")
NSYS_REPORT_MAGIC = b"NVIDIA Tegra Profiler Report"

_FETCH_BLOCK = 1 << 16
_TEXT_SEPARATOR = 0x1F    # ASCII unit separator: joins a text column's values
_INT_LITERAL = re.compile(r"-?\d{1,18}")
_INT64_MIN, _INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def read_nsys_sqlite(path: str | Path) -> Trace:
    path = Path(path)
    with open(path, "rb") as f:
        header = f.read(100)
    if header[:16] != SQLITE_MAGIC:
        raise TraceError(path, "not an SQLite file")
    if (expected := _sqlite_size(header)) and path.stat().st_size < expected:
        # SQLite reads the pages that are there and answers from them: a file cut short
        # would read as a trace with its last rows missing
        raise TraceError(path, f"truncated or corrupt: its header says {expected} bytes, the "
                               f"file holds {path.stat().st_size}")
    try:
        # a URI with the path percent-encoded: '%41', '#' or '?' in a name would open another
        # file
        conn = sqlite3.connect(path.absolute().as_uri() + "?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as exc:
        raise TraceError(path, f"cannot open SQLite file ({exc})") from None
    # nsys copies environment and paths verbatim; they need not be UTF-8.
    conn.text_factory = _decode_text
    try:
        return _NsysReader(conn, path).read()
    except sqlite3.DatabaseError as exc:
        raise TraceError(path, f"corrupt or truncated SQLite file ({exc})") from None
    finally:
        conn.close()


# No clock a trace holds reaches 2^62 ns (146 years): a time there is corrupt, and sums of
# such times would wrap around int64.
_LAST_TIME_NS = 1 << 62


def _timed(gpu_work: Table) -> tuple[Table, int]:
    """GPU work without a time left out, and how much: CUPTI records a kernel it could not
    time with start and end 0; a NULL (read as -1), an end before the start or a time past
    ``_LAST_TIME_NS`` is no time either. Placed at 0, such a kernel would stretch its step
    over the whole session."""
    untimed = ((gpu_work.start < 0) | (gpu_work.end < gpu_work.start)
               | (gpu_work.end >= _LAST_TIME_NS)
               | ((gpu_work.start == 0) & (gpu_work.end == 0)))
    if not untimed.any():
        return gpu_work, 0
    kept = {name: values[~untimed] for name, values in gpu_work.columns().items()}
    return type(gpu_work).from_columns(kept, int((~untimed).sum())), int(untimed.sum())


def _sqlite_size(header: bytes) -> int | None:
    """The database size an SQLite header states (page size × page count), where it states
    one that holds: its "version-valid-for" number equals its change counter."""
    if len(header) < 100 or header[92:96] != header[24:28]:
        return None
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    return page_size * int.from_bytes(header[28:32], "big") or None


def nsys_cli() -> str | None:
    """The Nsight Systems CLI: ``KIMI_PERF_NSYS`` (a path, or a command name looked up on
    PATH), else ``nsys`` on PATH, else None. A ``KIMI_PERF_NSYS`` that names no program is an
    error, not a fallback."""
    given = os.environ.get("KIMI_PERF_NSYS")
    if not given:
        return shutil.which("nsys")
    if os.path.isfile(given) and os.access(given, os.X_OK):
        return given
    if os.sep not in given and (found := shutil.which(given)) is not None:
        return found
    raise TraceError(None, f"KIMI_PERF_NSYS={given}: not an executable file"
                           + ("" if os.sep in given else " (nor a command on PATH)"))


ERROR_WORDS = re.compile(r"error|unrecogni[sz]ed|invalid|unknown|cannot|failed|lost",
                         re.IGNORECASE)
# lines that point at a reason elsewhere: nsys's "Please refer to the troubleshooting section
# of the docs:" and the address under it
POINTERS = re.compile(r"please refer to|https?://", re.IGNORECASE)
UNEXPECTED = re.compile(r"unexpected exception", re.IGNORECASE)


def nsys_failure(result: subprocess.CompletedProcess) -> str:
    """Why an nsys command failed, in a line: the command that ran, its exit code and
    ``nsys_reason``."""
    why = nsys_reason(result)
    return f"{result.args[0]} {result.args[1]} exited {result.returncode}" + (
        f": {why}" if why else "")


def nsys_reason(result: subprocess.CompletedProcess) -> str:
    """What an nsys command said went wrong: the profiled program killed by a signal (nsys
    exits 128 + its number), the exception the profiled Python program raised, or nsys's
    own last complaint (an option this release lacks, its usage lines left out; an import
    that failed, not the exception dump under it); '' where it said nothing."""
    code = result.returncode
    lines = [line.rstrip() for line in (result.stderr or "").splitlines() if line.strip()]
    if not lines:   # (some releases print their errors with the progress, on stdout)
        lines = [line.rstrip() for line in (result.stdout or "").splitlines()
                 if ERROR_WORDS.search(line)]
    tracebacks = [i for i, line in enumerate(lines)
                  if line.startswith("Traceback (most recent call last)")]
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        whose = "it was" if code < 0 else "the profiled program was"
        why = f"{whose} killed by {name}" + (
            " (the out-of-memory killer sends it where memory runs out)"
            if number == signal.SIGKILL else "")
    elif tracebacks:   # the exception's line: the first not indented after the frames
        raised = [line for line in lines[tracebacks[-1] + 1:] if not line[0].isspace()]
        why = "the profiled program raised " + (raised[0] if raised else "an exception")
    else:
        said = [line.strip() for line in lines
                if not line.startswith(("Try '", "usage:")) and not POINTERS.match(line.strip())]
        # nsys's dump of an exception it did not expect (C++ types, source paths) follows
        # what it was doing when it failed: that is the reason
        dump = next((i for i, line in enumerate(said) if UNEXPECTED.search(line)), None)
        said = said[:dump] if dump else said
        errors = [line for line in said if ERROR_WORDS.search(line)]
        why = (errors or said or [""])[-1]
    return why


def export_nsys_rep(path: str | Path, out_dir: str | Path) -> Path:
    """Export an ``.nsys-rep`` to SQLite with the ``nsys`` CLI (``nsys_cli``)."""
    path = Path(path)
    try:
        nsys = nsys_cli()
    except TraceError as exc:
        raise TraceError(path, f"cannot export: {exc.problem}") from None
    if nsys is None:
        raise TraceError(path, "reading an Nsight Systems report needs the Nsight Systems CLI "
                               "('nsys') on PATH or in KIMI_PERF_NSYS; install it, or run "
                               "'nsys export --type sqlite' where it is installed and pass the "
                               ".sqlite file" + _stale_export_note(path))
    out = Path(out_dir) / (path.stem + ".sqlite")
    cmd = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
           "--output", str(out), str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if result.returncode != 0:
        raise TraceError(path, nsys_failure(result))
    if not out.exists():
        raise TraceError(path, f"{nsys} export exited 0 but wrote no SQLite export")
    return out


def has_nvtx_ranges(export: str | Path) -> bool:
    """Whether an nsys SQLite export holds an NVTX range (push/pop or start/end); True where
    it cannot be asked (no database: its reader says what the file is)."""
    uri = Path(export).absolute().as_uri() + "?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
            tables = {row[0] for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
            return "NVTX_EVENTS" in tables and conn.execute(
                "SELECT 1 FROM NVTX_EVENTS WHERE eventType IN (?, ?, ?, ?) LIMIT 1",
                (NVTX_PUSHPOP, NVTX_STARTEND, NVTXT_PUSHPOP, NVTXT_STARTEND),
            ).fetchone() is not None
    except sqlite3.DatabaseError:
        return True


# How much older than its report an export beside it may be and still be its export: a
# folder copied without its times (cp -r) writes the two a moment apart, in either order;
# an earlier capture's export is older by at least the minutes of a capture.
EXPORT_AGE_SLACK_S = 2.0


def is_stale_export(export: Path, report: Path) -> bool:
    """An export older than the report beside it: an earlier capture's (``nsys profile -f
    true`` again), which ``nsys stats`` exports anew rather than read."""
    return export.stat().st_mtime + EXPORT_AGE_SLACK_S < report.stat().st_mtime


def fresh_export(report: Path) -> Path | None:
    """The SQLite export nsys leaves beside a report (``X.sqlite`` beside ``X.nsys-rep``, as
    ``nsys stats`` writes it), where it is not stale (``is_stale_export``): what ``nsys
    stats`` reads instead of exporting again."""
    if report.suffix not in NSYS_REPORTS:
        return None
    export = report.with_suffix(".sqlite")
    try:
        return None if is_stale_export(export, report) else export
    except OSError:
        return None


def _stale_export_note(report: Path) -> str:
    export = report.with_suffix(".sqlite")
    if report.suffix not in NSYS_REPORTS or not export.is_file():
        return ""
    return (f" ({export.name} beside it is older than the report, an earlier capture's "
            "export: pass it to read that)")


def read_nsys_rep(path: str | Path) -> Trace:
    """An nsys report: the SQLite export beside it where that is its own (``fresh_export``),
    else exported by nsys into a temporary directory and read; errors name the report."""
    path = Path(path)
    if (export := fresh_export(path)) is not None:
        try:
            trace = read_nsys_sqlite(export)
        except TraceError as exc:
            raise TraceError(path, f"its SQLite export beside it, {export.name}: "
                                   f"{exc.problem}") from None
        trace.meta["file"] = str(path)
        trace.meta["exported_by_nsys"] = True
        return trace
    with tempfile.TemporaryDirectory(prefix="kimi-perf-") as tmp:
        exported = export_nsys_rep(path, tmp)
        try:
            trace = read_nsys_sqlite(exported)
        except TraceError as exc:
            raise TraceError(path, f"its SQLite export: {exc.problem}") from None
    trace.meta["file"] = str(path)
    trace.meta["exported_by_nsys"] = True   # (kept by a .kptrace saved from it)
    return trace


class _NsysReader:
    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        self.tables = {r[0] for r in rows}
        self.columns: dict[str, set[str]] = {}

    def read(self) -> Trace:
        meta = self._export_meta()
        if "StringIds" not in self.tables:
            raise TraceError(self.path, "not an Nsight Systems export (no StringIds table)")
        self.strings = StringTable()
        self._load_string_ids()
        # Each table is compacted as soon as it is complete: the next one is read beside it.
        api = self._api_calls().compact()
        kernels, untimed_kernels = _timed(self._kernels())
        memops, untimed_memops = _timed(self._memops())
        for gpu_work in (kernels, memops):
            gpu_work.api = find_launches(api, gpu_work.pid, gpu_work.correlation)
            hit = gpu_work.api >= 0
            gpu_work.tid[hit] = api.tid[gpu_work.api[hit]]
            gpu_work.compact()
        ranges = self._ranges().compact()
        meta.update(gpus=self._gpus(), processes=self._processes(), file=str(self.path))
        if untimed_kernels or untimed_memops:
            meta["untimed"] = {"kernels": untimed_kernels, "memops": untimed_memops}
        return Trace(strings=self.strings.values, kernels=kernels, memops=memops,
                     ranges=ranges, api=api, meta=meta)

    # -- helpers -------------------------------------------------------------------------

    def _cols(self, table: str) -> set[str]:
        if table not in self.columns:
            info = self.conn.execute(f"PRAGMA table_info('{table}')").fetchall()
            self.columns[table] = {r[1] for r in info}
        return self.columns[table]

    def _require(self, table: str, needed: list[str]) -> None:
        missing = [c for c in needed if c not in self._cols(table)]
        if missing:
            raise TraceError(self.path, f"table {table} lacks column(s) {', '.join(missing)} "
                                        f"(export schema {self.schema or 'unknown'})")

    def _int_columns(self, table: str, exprs: dict[str, str], where: str = "") -> dict:
        """Fetch integer expressions as int64 numpy columns (NULL -> -1)."""
        columns = self._int_columns_as_text(table, exprs, where)
        if columns is None:
            columns = self._int_columns_by_rows(table, exprs, where)
        return columns

    def _int_columns_as_text(self, table: str, exprs: dict[str, str], where: str
                             ) -> dict | None:
        """``_int_columns`` through one ``group_concat`` text per column, parsed by numpy;
        None where that cannot give the exact answer (then read the rows)."""
        constants = {name: -1 if e == "NULL" else int(e) for name, e in exprs.items()
                     if e == "NULL" or _INT_LITERAL.fullmatch(e)}
        queried = [name for name in exprs if name not in constants]
        select = "".join(f", group_concat(coalesce({exprs[name]}, -1))" for name in queried)
        try:
            # Text results skip the connection's decoding: they are ASCII digits or go unused.
            self.conn.text_factory = bytes
            row = list(self.conn.execute(f"SELECT count(*){select} FROM {table} {where}")
                       .fetchone())
        except sqlite3.DataError:    # a text over SQLite's length limit (about 50M rows)
            return None
        finally:
            self.conn.text_factory = _decode_text
        n = row.pop(0)
        columns = {name: np.full(n, value, np.int64) for name, value in constants.items()}
        for name in queried:
            values = _parse_int_list(row.pop(0), n)
            if values is None:
                return None
            columns[name] = values
        return {name: columns[name] for name in exprs}

    def _int_columns_by_rows(self, table: str, exprs: dict[str, str], where: str) -> dict:
        # numpy cuts a REAL to an integer (230.9 to 230, another row's id): refused as text is
        fractional = " OR ".join(f"(typeof({e}) = 'real' AND {e} <> CAST({e} AS INTEGER))"
                                 for e in exprs.values())
        if self.conn.execute(f"SELECT 1 FROM {table} {where} "
                             f"{'AND' if where else 'WHERE'} ({fractional}) LIMIT 1").fetchone():
            raise TraceError(self.path, f"table {table} holds non-integer values where "
                                        "integers are expected")
        select = ", ".join(f"coalesce({e}, -1)" for e in exprs.values())
        cursor = self.conn.execute(f"SELECT {select} FROM {table} {where}")
        blocks = []
        while rows := cursor.fetchmany(_FETCH_BLOCK):
            try:
                blocks.append(np.array(rows, dtype=np.int64))
            except (TypeError, ValueError, OverflowError):
                raise TraceError(self.path, f"table {table} holds non-integer values where "
                                            "integers are expected") from None
        data = np.concatenate(blocks) if blocks else np.empty((0, len(exprs)), np.int64)
        return {name: data[:, i] for i, name in enumerate(exprs)}

    def _load_string_ids(self) -> None:
        self._require("StringIds", ["id", "value"])
        ids, values = [], []
        for sid, value in self.conn.execute("SELECT id, value FROM StringIds"):
            ids.append(sid)
            values.append(value if isinstance(value, str) else str(value))
        ids_arr = np.array(ids, dtype=np.int64)
        if len(ids_arr) and ids_arr.min() < 0:
            raise TraceError(self.path, "StringIds holds negative ids")
        codes = np.asarray(self.strings.extend(values), np.int32)
        self._code_by_id: dict[int, int] | None = None
        # nsys numbers its strings from 0: a table indexed by id. An export trimmed to the
        # strings it uses keeps ids in the millions for a hundred strings: searched instead.
        self.id_to_code = self.string_ids = self.string_codes = None
        if not len(ids_arr) or ids_arr.max() < 4 * len(ids_arr) + (1 << 16):
            self.id_to_code = np.full(int(ids_arr.max()) + 1 if len(ids_arr) else 0, -1,
                                      np.int32)
            self.id_to_code[ids_arr] = codes           # an id given twice: the last holds
        else:
            order = np.argsort(ids_arr, kind="stable")
            last = np.r_[ids_arr[order][1:] != ids_arr[order][:-1], True]
            self.string_ids, self.string_codes = ids_arr[order][last], codes[order][last]

    def _codes_of(self, ids: np.ndarray) -> np.ndarray:
        """StringIds ids -> our codes, -1 for an id StringIds lacks."""
        ids = np.asarray(ids, np.int64)
        if self.id_to_code is not None:
            known = (ids >= 0) & (ids < len(self.id_to_code))
            codes = np.full(len(ids), -1, np.int32)
            codes[known] = self.id_to_code[ids[known]]
            return codes
        at = np.minimum(np.searchsorted(self.string_ids, ids), len(self.string_ids) - 1)
        return np.where(self.string_ids[at] == ids, self.string_codes[at], -1).astype(np.int32)

    def _code_of(self, sid) -> int:
        """One StringIds id -> our code, -1 for an id StringIds lacks (row-by-row readers)."""
        if not isinstance(sid, int):
            return -1
        if self.id_to_code is not None:
            return int(self.id_to_code[sid]) if 0 <= sid < len(self.id_to_code) else -1
        if self._code_by_id is None:
            self._code_by_id = dict(zip(self.string_ids.tolist(), self.string_codes.tolist(),
                                        strict=True))
        return self._code_by_id.get(sid, -1)

    def _name_codes(self, ids: np.ndarray) -> np.ndarray:
        """String-id column -> our codes (an id missing from StringIds reads as '<unknown>')."""
        codes = self._codes_of(ids)
        codes[codes < 0] = self.strings.code("<unknown>")
        return codes

    def _text_or_id_column(self, table: str, column: str) -> np.ndarray:
        """A name column that holds either StringIds ids or plain text, row by row (an id
        missing from StringIds, or none, reads as '<unknown>', as in a column of ids)."""
        unknown = self.strings.code("<unknown>")
        codes = []
        for (value,) in self.conn.execute(f"SELECT {column} FROM {table}"):
            if isinstance(value, int):
                code = self._code_of(value)
                codes.append(unknown if code < 0 else code)
            elif value is None:
                codes.append(unknown)
            else:
                codes.append(self.strings.code(str(value)))
        return np.array(codes, dtype=np.int32)

    # -- metadata ------------------------------------------------------------------------

    def _export_meta(self) -> dict:
        meta_table = next((t for t in ("META_DATA_EXPORT", "EXPORT_META_DATA")
                           if t in self.tables), None)
        values = {}
        if meta_table:
            values = dict(self.conn.execute(f"SELECT name, value FROM {meta_table}").fetchall())
        self.schema = values.get("EXPORT_SCHEMA_VERSION")
        if meta_table is None and not any(t.startswith("CUPTI_ACTIVITY") for t in self.tables):
            raise TraceError(self.path, "not an Nsight Systems export (no export metadata "
                                        "and no CUPTI tables)")
        if self.schema:
            try:
                major = int(str(self.schema).split(".")[0])
            except ValueError:
                raise TraceError(self.path, f"unreadable export schema version "
                                            f"{self.schema!r}") from None
            if major not in KNOWN_SCHEMA_MAJORS:
                raise TraceError(self.path, f"nsys export schema {self.schema} is not supported "
                                            "(kimi-perf reads schemas 2.x and 3.x)")
        product = values.get("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems")
        version = values.get("EXPORT_PRODUCT_VERSION", "unknown")
        return {"format": "nsys-sqlite", "tool": f"{product} {version}", "schema": self.schema}

    def _gpus(self) -> list[dict]:
        gpus: dict[int, dict] = {}
        if "TARGET_INFO_GPU" in self.tables:
            cols = self._cols("TARGET_INFO_GPU")
            sm = "smCount" if "smCount" in cols else "NULL"
            for gid, name, sms in self.conn.execute(
                    f"SELECT id, name, {sm} FROM TARGET_INFO_GPU"):
                gpus[gid] = {"device": gid, "name": name or "", "sm_count": sms}
        if "TARGET_INFO_CUDA_DEVICE" in self.tables and {
                "cudaId", "numMultiprocessors"} <= self._cols("TARGET_INFO_CUDA_DEVICE"):
            for cid, sms in self.conn.execute(
                    "SELECT cudaId, numMultiprocessors FROM TARGET_INFO_CUDA_DEVICE"):
                gpus.setdefault(cid, {"device": cid, "name": "", "sm_count": sms})
                gpus[cid]["sm_count"] = gpus[cid]["sm_count"] or sms
        return [gpus[k] for k in sorted(gpus)]

    def _processes(self) -> list[dict]:
        if "PROCESSES" in self.tables and {"pid", "name"} <= self._cols("PROCESSES"):
            rows = self.conn.execute("SELECT pid, name FROM PROCESSES ORDER BY pid").fetchall()
            return [{"pid": pid, "name": name or ""} for pid, name in rows]
        return []

    # -- event tables --------------------------------------------------------------------

    def _api_calls(self) -> ApiCalls:
        table = "CUPTI_ACTIVITY_KIND_RUNTIME"
        if table not in self.tables:
            return ApiCalls.empty()
        self._require(table, ["start", "end", "globalTid", "correlationId", "nameId"])
        has_class = "eventClass" in self._cols(table)
        c = self._int_columns(table, {
            "start": "start", "end": "end", "gtid": "globalTid", "corr": "correlationId",
            "name": "nameId", "cls": "eventClass" if has_class else "0"})
        pid, tid = _split_global_tid(c["gtid"])
        # Old exports repeat an API call as a "backtrace" row with the same correlation id:
        # keep one row per (process, correlation), the real call when there is one.
        keep = _first_per_key(pid, c["corr"], prefer=c["cls"] != BACKTRACE_EVENT_CLASS)
        names = self._name_codes(c["name"][keep])
        api = ApiCalls.from_columns({
            "name": names, "start": c["start"][keep], "end": c["end"][keep], "pid": pid[keep],
            "tid": tid[keep], "correlation": c["corr"][keep],
            "kind": self._api_kinds(names)}, len(names))
        return api

    def _api_kinds(self, names: np.ndarray) -> np.ndarray:
        if len(names) == 0:
            return np.empty(0, np.int8)
        kinds = np.zeros(len(self.strings.values), np.int8)
        for u in np.flatnonzero(np.bincount(names, minlength=len(kinds))).tolist():
            kinds[u] = _api_kind(self.strings.values[u])
        return kinds[names]

    def _kernels(self) -> Kernels:
        table = "CUPTI_ACTIVITY_KIND_KERNEL"
        if table not in self.tables:
            return Kernels.empty()
        cols = self._cols(table)
        self._require(table, ["start", "end", "deviceId", "streamId", "correlationId",
                              "globalPid"])
        name_col = next((n for n in ("demangledName", "shortName", "name") if n in cols), None)
        if name_col is None:
            raise TraceError(self.path, f"table {table} has no kernel name column")
        exprs = {"start": "start", "end": "end", "device": "deviceId", "stream": "streamId",
                 "corr": "correlationId", "gpid": "globalPid",
                 "graph_id": "graphId" if "graphId" in cols else "NULL",
                 "graph_node_id": "graphNodeId" if "graphNodeId" in cols else "NULL"}
        if self._column_is_text(table, name_col):
            c = self._int_columns(table, exprs)
            names = self._text_or_id_column(table, name_col)
        else:
            c = self._int_columns(table, {**exprs, "name": name_col})
            names = self._name_codes(c["name"])
        pid, _ = _split_global_tid(c["gpid"])
        n = len(names)
        return Kernels.from_columns({
            "name": names, "start": c["start"], "end": c["end"], "device": c["device"],
            "stream": c["stream"], "pid": pid, "correlation": c["corr"],
            "graph_id": c["graph_id"], "graph_node_id": c["graph_node_id"]}, n)

    def _column_is_text(self, table: str, column: str) -> bool:
        row = self.conn.execute(
            f"SELECT typeof({column}) FROM {table} WHERE {column} IS NOT NULL LIMIT 1").fetchone()
        return row is not None and row[0] == "text"

    def _memops(self) -> MemOps:
        parts = []
        for table, is_copy in (("CUPTI_ACTIVITY_KIND_MEMCPY", True),
                               ("CUPTI_ACTIVITY_KIND_MEMSET", False)):
            if table not in self.tables:
                continue
            self._require(table, ["start", "end", "deviceId", "streamId", "correlationId",
                                  "globalPid", "bytes"])
            c = self._int_columns(table, {
                "start": "start", "end": "end", "device": "deviceId", "stream": "streamId",
                "corr": "correlationId", "gpid": "globalPid", "bytes": "bytes",
                "kind": "copyKind" if is_copy and "copyKind" in self._cols(table) else "0"})
            if is_copy:
                labels = {k: f"[CUDA memcpy {v}]" for k, v in MEMCPY_KINDS.items()}
                names = np.array([self.strings.code(labels.get(int(k), "[CUDA memcpy Unknown]"))
                                  for k in np.unique(c["kind"])], np.int32)
                names = names[np.searchsorted(np.unique(c["kind"]), c["kind"])]
            else:
                names = np.full(len(c["start"]), self.strings.code("[CUDA memset]"), np.int32)
            pid, _ = _split_global_tid(c["gpid"])
            parts.append(MemOps.from_columns({
                "name": names, "start": c["start"], "end": c["end"], "device": c["device"],
                "stream": c["stream"], "pid": pid, "correlation": c["corr"],
                "bytes": c["bytes"]}, len(names)))
        if not parts:
            return MemOps.empty()
        merged = {k: np.concatenate([getattr(p, k) for p in parts]) for k in MemOps.dtypes}
        return MemOps(**merged)

    def _ranges(self) -> Ranges:
        table = "NVTX_EVENTS"
        if table not in self.tables:
            return Ranges.empty()
        cols = self._cols(table)
        self._require(table, ["start", "end", "eventType", "globalTid"])
        range_types = (NVTX_PUSHPOP, NVTX_STARTEND, NVTXT_PUSHPOP, NVTXT_STARTEND)
        where = f"WHERE eventType IN {range_types}"
        c = self._int_columns(table, {
            "start": "start", "end": "end", "type": "eventType", "gtid": "globalTid",
            "end_gtid": "endGlobalTid" if "endGlobalTid" in cols else "NULL",
            "domain": "domainId" if "domainId" in cols else "0"}, where)
        n = len(c["start"])
        texts = self._nvtx_texts(table, cols, where)
        # An unterminated range runs to the last NVTX timestamp (as nsys stats does).
        unended = c["end"] < 0
        if unended.any():
            # (max over a column skips NULLs; with no end at all, the last start is it)
            last_start, last_end = self.conn.execute(
                f"SELECT max(start), max(end) FROM {table} {where}").fetchone()
            last = max(t for t in (last_start, last_end) if t is not None)
            c["end"] = np.where(unended, last, c["end"])
        pid, tid = _split_global_tid(c["gtid"])
        # A start/end range that ends on another thread cannot hold that thread's launches.
        tid = np.where(c["end_gtid"] >= 0, -1, tid)
        domain_names = self._nvtx_domains(table, cols)
        empty = self.strings.code("")
        domain_codes = np.full(n, empty, np.int32)
        names = texts.copy()
        for (domain_id, process_bits), label in domain_names.items():
            sel = (c["domain"] == domain_id) & ((c["gtid"] & 0x0000FFFFFF000000) == process_bits)
            if not sel.any():
                continue
            domain_codes[sel] = self.strings.code(label)
            uniq, inv = np.unique(texts[sel], return_inverse=True)
            qualified = np.array([self.strings.code(f"{label}:{self.strings.values[u]}"
                                                    if u >= 0 else f"{label}:")
                                  for u in uniq], np.int32)
            names[sel] = qualified[inv]
        names[names < 0] = empty
        style = np.where(np.isin(c["type"], (NVTX_PUSHPOP, NVTXT_PUSHPOP)), PUSHPOP, STARTEND)
        return Ranges.from_columns({
            "name": names, "domain": domain_codes, "start": c["start"], "end": c["end"],
            "pid": pid, "tid": tid, "device": np.full(n, -1), "stream": np.full(n, -1),
            "style": style}, n)

    def _nvtx_texts(self, table: str, cols: set[str], where: str) -> np.ndarray:
        """Range names: the registered string (textId) when set, else the plain text."""
        if "textId" in cols:
            ids = self._int_columns_as_text(table, {"id": "textId"}, where)
            if ids is None:     # textIds that are not all integers: row by row
                return self._nvtx_texts_by_rows(table, cols, where)
            ids = ids["id"]
        else:
            (n,) = self.conn.execute(f"SELECT count(*) FROM {table} {where}").fetchone()
            ids = np.full(n, -1, np.int64)
        codes = self._codes_of(ids)
        plain = np.flatnonzero(codes < 0)
        if len(plain) == 0 or "text" not in cols:
            return codes
        # The plain texts of the rows without a registered string; intern each distinct text
        # once, in order of first appearance (the codes row-by-row interning would give).
        texts = self._texts_joined(table, "text", where, len(codes))
        if texts is not None:
            texts = [texts[i] for i in plain.tolist()] if len(plain) < len(codes) else texts
        else:
            values = self.conn.execute(f"SELECT text FROM {table} {where}").fetchall()
            texts = [None if values[i][0] is None else str(values[i][0]) for i in plain.tolist()]
        code_of = {value: -1 if value is None else self.strings.code(value)
                   for value in dict.fromkeys(texts)}
        codes[plain] = [code_of[value] for value in texts]
        return codes

    def _texts_joined(self, table: str, column: str, where: str, n: int) -> list[str] | None:
        """A text column's ``n`` values through one ``group_concat``, split on a control
        character; None where that cannot be exact (NULLs, a value holding that character,
        a value that is not text)."""
        try:
            self.conn.text_factory = bytes
            count, non_text, joined = self.conn.execute(
                f"SELECT count({column}), sum(typeof({column}) != 'text'), "
                f"group_concat({column}, char({_TEXT_SEPARATOR})) FROM {table} {where}"
            ).fetchone()
        except sqlite3.DataError:    # over SQLite's length limit
            return None
        finally:
            self.conn.text_factory = _decode_text
        if n == 0 or count != n or non_text:
            return None
        try:
            # Valid UTF-8 splits at an ASCII byte into valid UTF-8: decode once, then split.
            parts = joined.decode("utf-8").split(chr(_TEXT_SEPARATOR))
        except UnicodeDecodeError:
            parts = [_decode_text(p) for p in joined.split(bytes([_TEXT_SEPARATOR]))]
        return parts if len(parts) == n else None

    def _nvtx_texts_by_rows(self, table: str, cols: set[str], where: str) -> np.ndarray:
        text = "text" if "text" in cols else "NULL"
        text_id = "textId" if "textId" in cols else "NULL"
        codes = []
        for tid_value, value in self.conn.execute(f"SELECT {text_id}, {text} FROM {table} "
                                                  f"{where}"):
            if (code := self._code_of(tid_value)) >= 0:
                codes.append(code)
            elif value is not None:
                codes.append(self.strings.code(str(value)))
            else:
                codes.append(-1)
        return np.array(codes, dtype=np.int32)

    def _nvtx_domains(self, table: str, cols: set[str]) -> dict[tuple[int, int], str]:
        if "domainId" not in cols:
            return {}
        text = "text" if "text" in cols else "NULL"
        text_id = "textId" if "textId" in cols else "NULL"
        rows = self.conn.execute(
            f"SELECT domainId, globalTid, {text}, {text_id}, min(start) FROM {table} "
            f"WHERE eventType = {NVTX_DOMAIN_CREATE} GROUP BY domainId, globalTid").fetchall()
        domains = {}
        for domain_id, gtid, value, text_id_value in (r[:4] for r in rows):
            if value is None and (code := self._code_of(text_id_value)) >= 0:
                value = self.strings.values[code]
            if value is None or domain_id is None or gtid is None:
                continue
            domains[(domain_id, gtid & 0x0000FFFFFF000000)] = str(value)
        return domains


def _decode_text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def _parse_int_list(text: bytes | None, n: int) -> np.ndarray | None:
    """``n`` comma-separated integers (as SQLite writes them) -> int64 array.

    None unless that is certainly what the text holds, each value as ``int()`` reads it: only
    digits, commas and minus signs (no other text, reals or blanks, which numpy reads as 0),
    all of it parsed, ``n`` numbers (a text value with a comma), one minus per negative number
    (a lone "-" reads as 0), and neither int64 extreme (numpy saturates longer numbers).
    """
    if n == 0:
        return np.empty(0, np.int64)
    if text is None:
        return None
    minus = text.translate(None, b"0123456789,")    # what is left: minus signs, or worse
    if minus.strip(b"-"):
        return None
    try:
        with warnings.catch_warnings():
            # numpy < 2.3 warns (and stops) where newer ones raise.
            warnings.simplefilter("error", DeprecationWarning)
            values = np.fromstring(text, dtype=np.int64, sep=",")
    except (ValueError, DeprecationWarning):
        return None
    if len(values) != n or values.min() == _INT64_MIN or values.max() == _INT64_MAX:
        return None
    if len(minus) != np.count_nonzero(values < 0):
        return None
    return values


def _split_global_tid(gtid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """nsys globalTid/globalPid -> (pid, tid) as nsys stats prints them."""
    pid = np.where(gtid >= 0, (gtid >> 24) & 0xFFFFFF, -1)
    tid = np.where(gtid >= 0, gtid & 0xFFFFFF, -1)
    return pid, tid


def _first_per_key(pid: np.ndarray, corr: np.ndarray, prefer: np.ndarray) -> np.ndarray:
    """Indices (in original order) keeping one row per (pid, corr), preferred rows first."""
    if len(pid) == 0:
        return np.empty(0, np.int64)
    # Usually no two rows share a (pid, corr): then every row stays. One sort of a packed key
    # tells (pids are 24-bit, correlation ids rarely pass 32).
    if pid.min() >= 0 and pid.max() < 1 << 24 and corr.min() >= 0 and corr.max() < 1 << 38:
        key = np.sort(pid << 38 | corr)
        if (key[1:] != key[:-1]).all():
            return np.arange(len(pid), dtype=np.int64)
    order = np.lexsort((~prefer, corr, pid))
    p, c = pid[order], corr[order]
    first = np.ones(len(order), bool)
    first[1:] = (p[1:] != p[:-1]) | (c[1:] != c[:-1])
    return np.sort(order[first])


def _api_kind(name: str) -> int:
    if name.startswith(("cuda", "hip")):
        return RUNTIME
    if name.startswith("cu"):
        return DRIVER
    return OTHER_API
