"""One columnar trace model that every reader produces and every analyzer consumes.

Each table is a dataclass of equal-length numpy columns; names are int32 codes into
``Trace.strings`` so that grouping by name is an integer operation. Times are int64 ns on the
trace's own clock. ``-1`` means "unknown" in integer id columns. Id and row-index columns
(``Table.compact``) are int32 where every value fits and int64 otherwise: readers compact them,
since most ids of most traces fit and that halves their memory; code that
reads them takes either width (and widens before shifting or multiplying).

A trace saves to and loads from one Arrow IPC file (``.kptrace``): one row whose columns are
``large_list`` arrays, so tables of different lengths share a file, their buffers compressed
with zstd (a fifth of the size; a load decompresses and checks every value anyway), and a
CRC-32 of the values in its metadata (``benchmarks/bench_trace_io.py`` compares it with
uncompressed Arrow, Parquet and ``.npz``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import stat
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from kimi_perf.errors import TraceError, printable
from kimi_perf.text import counted

# pyarrow is imported where used (save, load): it costs ~25 MB of RSS that reading never needs.
if TYPE_CHECKING:
    import pyarrow as pa

ARROW_MAGIC = b"ARROW1"   # how an Arrow IPC file (a .kptrace) begins and ends
# 2: the header's checksum covers its metadata too (``meta_crc32``); 1 is still read
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)

# Range styles.
PUSHPOP, STARTEND, GPU_RANGE = 0, 1, 2
STYLE_NAMES = {PUSHPOP: "PushPop", STARTEND: "StartEnd", GPU_RANGE: "GPU"}

# The ranges that annotate a launch of the decode paths (``op:in_proj``): a CPU run's ops.
OP_RANGE = re.compile(r"^op:")

# API call kinds.
RUNTIME, DRIVER, OTHER_API = 0, 1, 2


@dataclass(eq=False)
class Table:
    """Equal-length numpy columns. Subclasses declare the columns and their dtypes. Equal
    only to itself (as a file object is): comparing columns is ``np.array_equal``'s."""

    dtypes: ClassVar[dict[str, str]] = {}
    # Integer columns that ``compact`` narrows to int32 where every value fits (``dtypes``
    # gives their widest type).
    compact_columns: ClassVar[tuple[str, ...]] = ()

    def __len__(self) -> int:
        first = next(iter(self.dtypes))
        return len(getattr(self, first))

    @classmethod
    def empty(cls) -> Self:
        return cls(**{name: np.empty(0, dtype) for name, dtype in cls.dtypes.items()})

    @classmethod
    def from_columns(cls, columns: dict[str, Any], n: int, keep_int32: bool = False) -> Self:
        """Build from a partial dict of columns; missing id columns are -1 (or 0 for counts).
        With ``keep_int32``, columns ``compact`` may narrow stay int32 when they come so (not
        for columns that are still to be filled with wider values)."""
        out = {}
        for name, dtype in cls.dtypes.items():
            value = columns.get(name)
            if (keep_int32 and name in cls.compact_columns and isinstance(value, np.ndarray)
                    and value.dtype == np.int32):
                out[name] = np.ascontiguousarray(value)
            elif value is not None:
                out[name] = _fitting(value, dtype, f"{cls.__name__}.{name}")
            else:
                narrow = keep_int32 and name in cls.compact_columns
                out[name] = np.full(n, -1, dtype=np.int32 if narrow else dtype)
        table = cls(**out)
        table.check()
        return table

    def check(self) -> None:
        n = len(self)
        for name in self.dtypes:
            if len(getattr(self, name)) != n:
                rows = len(getattr(self, name))
                raise ValueError(f"{type(self).__name__}.{name} has {rows} rows, not {n}")

    def __repr__(self) -> str:    # not every value of every column
        return f"{type(self).__name__}({counted(len(self), 'row')})"

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.dtypes}

    def compact(self) -> Self:
        """Narrow ``compact_columns`` to int32 where their values allow; returns self."""
        for name in self.compact_columns:
            setattr(self, name, compact_ints(getattr(self, name)))
        return self


_INT32 = np.iinfo(np.int32)


def compact_ints(values: np.ndarray) -> np.ndarray:
    """``values`` as int32 when every one fits, else unchanged."""
    if values.dtype == np.int32:
        return values
    if len(values) and (values.min() < _INT32.min or values.max() > _INT32.max):
        return values
    return values.astype(np.int32)


def index_dtype(n: int) -> type[np.integer]:
    """The compact dtype of row indices (and -1) into a table of ``n`` rows."""
    return np.int32 if n <= _INT32.max else np.int64


@dataclass(repr=False, eq=False)
class Kernels(Table):
    """GPU kernels. ``tid`` and ``api`` (row in ``Trace.api``) come from the launch join."""

    name: np.ndarray
    start: np.ndarray
    end: np.ndarray
    device: np.ndarray
    stream: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    correlation: np.ndarray
    graph_id: np.ndarray
    graph_node_id: np.ndarray
    api: np.ndarray
    dtypes: ClassVar[dict[str, str]] = {
        "name": "int32", "start": "int64", "end": "int64", "device": "int32", "stream": "int64",
        "pid": "int64", "tid": "int64", "correlation": "int64", "graph_id": "int64",
        "graph_node_id": "int64", "api": "int64",
    }
    compact_columns = ("stream", "pid", "tid", "correlation", "graph_id", "graph_node_id", "api")


@dataclass(repr=False, eq=False)
class MemOps(Table):
    """memcpy / memset on the GPU; ``name`` reads like nsys's ("[CUDA memcpy Host-to-Device]")."""

    name: np.ndarray
    start: np.ndarray
    end: np.ndarray
    device: np.ndarray
    stream: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    correlation: np.ndarray
    bytes: np.ndarray
    api: np.ndarray
    dtypes: ClassVar[dict[str, str]] = {
        "name": "int32", "start": "int64", "end": "int64", "device": "int32", "stream": "int64",
        "pid": "int64", "tid": "int64", "correlation": "int64", "bytes": "int64", "api": "int64",
    }
    compact_columns = ("stream", "pid", "tid", "correlation", "api")


@dataclass(repr=False, eq=False)
class Ranges(Table):
    """NVTX ranges and profiler annotations.

    ``name`` is qualified as nsys prints it (``Domain:name`` outside the default domain).
    CPU ranges have a thread (``tid``) and ``device == -1``; GPU-side annotations
    (Kineto ``gpu_user_annotation``) have a device and stream instead and ``tid == -1``.
    ``depth``/``parent`` give the nesting on the thread (``parent`` is a row index); ranges
    that overlap without nesting (possible for start/end ranges) go to separate ``lane``s,
    each of which nests properly.
    """

    name: np.ndarray
    domain: np.ndarray
    start: np.ndarray
    end: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    device: np.ndarray
    stream: np.ndarray
    style: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    lane: np.ndarray
    dtypes: ClassVar[dict[str, str]] = {
        "name": "int32", "domain": "int32", "start": "int64", "end": "int64", "pid": "int64",
        "tid": "int64", "device": "int32", "stream": "int64", "style": "int8", "depth": "int32",
        "parent": "int64", "lane": "int32",
    }
    compact_columns = ("pid", "tid", "stream", "parent")


@dataclass(repr=False, eq=False)
class ApiCalls(Table):
    """CUDA/HIP runtime and driver API calls (launches among them), by thread."""

    name: np.ndarray
    start: np.ndarray
    end: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    correlation: np.ndarray
    kind: np.ndarray
    dtypes: ClassVar[dict[str, str]] = {
        "name": "int32", "start": "int64", "end": "int64", "pid": "int64", "tid": "int64",
        "correlation": "int64", "kind": "int8",
    }
    compact_columns = ("pid", "tid", "correlation")


TABLES: dict[str, type[Table]] = {
    "kernels": Kernels, "memops": MemOps, "ranges": Ranges, "api": ApiCalls,
}


@dataclass(repr=False, eq=False)
class Trace:
    """A whole trace: four tables, the string table they index, and metadata. Equal only to
    itself (``==`` and ``in`` do not compare its columns).

    ``meta`` keys: ``format`` (``nsys-sqlite`` | ``kineto-json``), ``tool`` (profiler and
    version), ``schema`` (export schema version, when known), ``file``, ``gpus`` (list of
    ``{"device", "name", "sm_count"}``), ``processes`` (list of ``{"pid", "name"}``);
    where they apply: ``kptrace`` (read from a ``.kptrace``; ``converted_from``, the trace
    that was saved from), ``exported_by_nsys`` (an ``.nsys-rep`` read through nsys's SQLite
    export), ``untimed`` (``{"kernels", "memops"}``: GPU work the trace holds without
    a usable time, left out of the tables), ``untimed_ranges`` (a count: ranges a Kineto trace
    holds with a missing or negative ``dur``, left out), ``duplicates`` (GPU work a Kineto trace
    holds twice, exact repeats left out); from a Kineto trace's ``distributedInfo``,
    ``rank`` and ``world_size``; ``captures``, the files of graph captures joined to it
    (``graphs.with_capture``) and ``replay_rows``, the rows of each table that are the
    replay's own.
    """

    strings: list[str]
    kernels: Kernels
    memops: MemOps = field(default_factory=MemOps.empty)
    ranges: Ranges = field(default_factory=Ranges.empty)
    api: ApiCalls = field(default_factory=ApiCalls.empty)
    meta: dict[str, Any] = field(default_factory=dict)
    # names_matching's masks, by pattern, with the string table they were made of
    _masks: dict = field(default_factory=dict, init=False, compare=False)

    def __repr__(self) -> str:
        """What it holds, in one line: not its strings or its metadata's process list."""
        meta = self.meta
        what = ", ".join(str(meta[k]) for k in ("format", "tool") if meta.get(k))
        names = Counter(str(g.get("name") or "unnamed") for g in meta.get("gpus") or [])
        gpus = ", ".join(f"{n}× {name}" if n > 1 else name for name, n in names.items())
        return (f"Trace({Path(meta['file']).name + ', ' if meta.get('file') else ''}{what}: "
                f"{counted(len(self.kernels), 'kernel')}, {counted(len(self.memops), 'memop')}, "
                f"{counted(len(self.ranges), 'range')}, {counted(len(self.api), 'API call')}"
                f"{', GPUs: ' + gpus if gpus else ''})")

    def summary(self) -> dict[str, Any]:
        """What ``kimi-perf info`` prints: format, tool and schema (and ``captures``, the
        files of graph captures joined to it, and ``replay``, what the replay alone holds:
        its events and span; ``kptrace``, whether it was read from a ``.kptrace``, and
        ``converted_from``, the trace that was saved from; ``exported_by_nsys``, whether it
        is an ``.nsys-rep`` read through the SQLite export nsys made of it, or saved from
        one); events of each kind (and GPU work left out for want of a time, or as an exact
        repeat); the span from the first event to the last (ns, None without events); each
        process with GPU work or API calls, the most kernels first
        (``kernels_without_process``: GPU work the trace names no process for); each GPU the
        trace describes or its kernels ran on (``name`` None where undescribed);
        ``annotated_ops``: its ``op:`` ranges, the launches a CPU run of the decode paths
        annotates (what breakdown counts where a trace has no GPU work). A process's
        ``name`` is the one the trace gives it (nsys's), else None. ``kernel_ns``: the
        kernels' time added up; ``streams``: the GPU streams its GPU work ran on (by device);
        ``graph_launches``: its CUDA/HIP graph launch calls, ``graph_kernels``: the kernels
        they launched (replayed from graphs). ``kernels_without_process``: kernels whose
        launching call the trace does not hold, so no process to name (of a Kineto trace;
        nsys names each kernel's process); ``unlaunched_kernels``: kernels whose launching
        call the trace does not hold (launched before the profile began, or by a graph launch
        it lacks)."""
        from kimi_perf.graphs import GRAPH_LAUNCH

        m = self.meta
        span = self.span()
        replay = m.get("replay_rows")

        def per(column: np.ndarray) -> dict[int, int]:
            values, counts = np.unique(column, return_counts=True)
            return dict(zip(values.tolist(), counts.tolist(), strict=True))

        kernels, api = per(self.kernels.pid), per(self.api.pid)
        graph_calls = self.names_matching(GRAPH_LAUNCH)[self.api.name]
        launched = self.kernels.api >= 0
        pids = {p for p in (*kernels, *api, *per(self.memops.pid)) if p >= 0}
        ran = per(self.kernels.device)
        described = {gpu.get("device"): gpu for gpu in m.get("gpus", [])}
        named = {p["pid"]: p["name"] for p in m.get("processes", [])
                 if isinstance(p.get("name"), str) and p["name"]}
        return {
            "format": m.get("format"), "tool": m.get("tool"), "schema": m.get("schema"),
            "captures": m.get("captures", []), "kptrace": m.get("kptrace", False),
            "converted_from": m.get("converted_from"),
            "exported_by_nsys": m.get("exported_by_nsys", False),
            # a replay joined by its captures' profile: what the replay alone holds
            "replay": None if replay is None else {
                "kernels": replay["kernels"], "memops": replay["memops"],
                "ranges": replay["ranges"], "api_calls": replay["api"],
                "span_ns": (lambda s: s[1] - s[0] if s else None)(self.span(replay)),
                "gpu_span_ns": self.gpu_span_ns(replay),
                "kernel_ns": int((self.kernels.end[:replay["kernels"]]
                                  - self.kernels.start[:replay["kernels"]]).sum())},
            "kernels": len(self.kernels), "memops": len(self.memops),
            "ranges": len(self.ranges), "api_calls": len(self.api),
            "annotated_ops": len(self.annotated_ops()),
            # (counts where there are none too: a reader of ["untimed"]["kernels"] gets 0)
            **{key: {"kernels": 0, "memops": 0, **(m.get(key) or {})}
               for key in ("untimed", "duplicates")},
            "untimed_ranges": m.get("untimed_ranges", 0),
            "span_ns": span[1] - span[0] if span else None,
            "gpu_span_ns": self.gpu_span_ns(),
            "kernel_ns": int((self.kernels.end - self.kernels.start).sum()),
            "streams": self._streams(),
            "graph_launches": int(graph_calls.sum()),
            "graph_kernels": int(graph_calls[self.kernels.api[launched]].sum())
            if len(graph_calls) else 0,
            "processes": [{"pid": p, "name": named.get(p), "kernels": kernels.get(p, 0),
                           "api_calls": api.get(p, 0)}
                          for p in sorted(pids, key=lambda p: (-kernels.get(p, 0), p))],
            "kernels_without_process": kernels.get(-1, 0),
            "unlaunched_kernels": int((~launched).sum()),
            "gpus": [{"device": d, "name": described.get(d, {}).get("name"),
                      "described": d in described,
                      "sm_count": described.get(d, {}).get("sm_count"),
                      "kernels": ran.get(d, 0)}
                     for d in sorted(set(described) | set(ran), key=lambda d: (d is None, d))],
        }

    def _streams(self) -> int:
        """The streams its GPU work ran on: by process, device and stream (each process has
        its own stream 7), a kernel of no known process on a stream a process has counted
        with that one."""
        gpu = (self.kernels, self.memops)
        lanes = np.stack([np.concatenate([t.pid for t in gpu]).astype(np.int64),
                          np.concatenate([t.device for t in gpu]).astype(np.int64),
                          np.concatenate([t.stream for t in gpu])], axis=1)
        known = np.unique(lanes[lanes[:, 0] >= 0], axis=0)
        unowned = np.unique(lanes[lanes[:, 0] < 0][:, 1:], axis=0)
        held = {tuple(lane) for lane in known[:, 1:].tolist()}
        return len(known) + sum(tuple(lane) not in held for lane in unowned.tolist())

    def span(self, rows: dict[str, int] | None = None) -> tuple[int, int] | None:
        """The first start and the last end of its events (ns), or of the first ``rows`` of
        each table (``meta["replay_rows"]``: a replay's own, before a capture joined it);
        None without events."""
        parts = [getattr(self, t) for t in TABLES]
        starts_ends = [(t.start[:n], t.end[:n]) for t, n in zip(
            parts, [len(t) if rows is None else rows[name] for name, t in zip(
                TABLES, parts, strict=True)], strict=True) if n]
        if not starts_ends:
            return None
        return (min(int(start.min()) for start, _ in starts_ends),
                max(int(end.max()) for _, end in starts_ends))

    def to_arrow(self, table: str) -> pa.Table:
        """One of its tables (``kernels``, ``memops``, ``ranges``, ``api``) as an Arrow table,
        for a notebook (``.to_pandas()``, with pandas installed): its columns as they are,
        ``name`` (and a range's ``domain``) decoded: a dictionary of the strings the column
        uses (no string copied per event; a pandas categorical, whose groupby lists no name
        of another table's)."""
        import pyarrow as pa

        if table not in TABLES:
            raise ValueError(f"no table {table!r} (one of {', '.join(TABLES)})")
        columns = getattr(self, table).columns()

        def decoded(codes: np.ndarray) -> pa.DictionaryArray:
            used, indices = np.unique(codes, return_inverse=True)
            names = pa.array([self.strings[c] for c in used.tolist()], pa.large_string())
            return pa.DictionaryArray.from_arrays(pa.array(indices.astype(np.int32)), names)
        return pa.table({col: decoded(values) if col in ("name", "domain") else values
                         for col, values in columns.items()})

    def gpu_span_ns(self, rows: dict[str, int] | None = None) -> int | None:
        """From the first GPU op's start to the last one's end (kernels and memcpy/memset):
        of a trace whose CPU events reach far beyond its GPU work (an annotation left open
        for seconds), the part that matters; of the first ``rows`` of each table (a replay's
        own, as ``span``); None without GPU work."""
        ops = [(t.start[:n], t.end[:n]) for t, n in (
            (t, len(t) if rows is None else rows[name])
            for name, t in (("kernels", self.kernels), ("memops", self.memops))) if n]
        if not ops:
            return None
        return (max(int(end.max()) for _, end in ops) - min(int(start.min()) for start, _ in ops))

    def annotated_ops(self) -> np.ndarray:
        """Rows of its ``op:`` ranges on a CPU thread: the launches a CPU run of the decode
        paths annotates, which breakdown counts where the trace holds no GPU work (no kernel
        and no memop)."""
        return np.flatnonzero(self.names_matching(OP_RANGE)[self.ranges.name]
                              & (self.ranges.tid >= 0))

    def names_matching(self, pattern) -> np.ndarray:
        """Boolean mask over string codes: which strings match a compiled regex (search).
        Read-only, and kept: the analysis asks for a few patterns, each several times, and a
        trace with a name per range holds millions of strings."""
        key = (pattern.pattern, pattern.flags)
        made = self._masks.get(key)
        if made is not None and made[0] is self.strings and len(made[1]) == len(self.strings):
            return made[1]
        mask = np.fromiter((pattern.search(s) is not None for s in self.strings), bool,
                           count=len(self.strings))
        mask.flags.writeable = False
        self._masks[key] = (self.strings, mask)
        return mask

    def save(self, path: str | Path) -> None:
        """Write atomically to one Arrow IPC file (see module docstring), named ``*.kptrace``
        (directories are searched for that name; Arrow under a trace's name is read as no
        trace), and not over the trace it was read from."""
        import pyarrow as pa

        if not str(path).endswith(".kptrace"):
            raise ValueError(f"{path}: a .kptrace file (Arrow) is named so")
        if not (target := os.path.realpath(path)).endswith(".kptrace"):
            raise TraceError(path, f"a symlink to {target}, which is not named .kptrace: "
                                   "saving through it would write there")
        source = [self.meta.get(key) for key in ("file", "converted_from", "captures")]
        for read in filter(None, [*source[:2], *(source[2] or ())]):
            with contextlib.suppress(OSError, TypeError):
                if os.path.samefile(path, read):
                    raise TraceError(path, "a trace this one was read from" + (
                        f" ({read})" if str(read) != str(path) else "") + ": saving over it "
                        "would destroy it")

        arrays, names = [], []
        for table_name in TABLES:
            for col, values in getattr(self, table_name).columns().items():
                names.append(f"{table_name}.{col}")
                arrays.append(_one_row_list(pa.array(values)))
        names.append("strings")
        arrays.append(_one_row_list(pa.array(self.strings, type=pa.large_string())))
        table = pa.Table.from_arrays(arrays, names=names)
        # the traces it was read from, as paths from anywhere: the file is read from elsewhere
        def from_root(file: object) -> object:
            return (os.path.abspath(file) if isinstance(file, str) and os.path.exists(file)
                    else file)

        meta = {**self.meta, **{key: from_root(self.meta[key]) for key in (
            "file", "converted_from") if key in self.meta}}
        if isinstance(meta.get("captures"), list):
            meta["captures"] = [from_root(c) for c in meta["captures"]]
        header = {"version": FORMAT_VERSION, "meta": meta, "crc32": _checksum(table),
                  "meta_crc32": _meta_checksum(meta)}
        table = table.replace_schema_metadata({"kimi_perf": json.dumps(header)})
        atomic_write(path, lambda f: _write_ipc(f, table))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        import pyarrow as pa

        try:
            with pa.memory_map(str(path), "r") as source:
                table = pa.ipc.open_file(source).read_all()
            # every offset and length checked before a value is read: a corrupt one would
            # read out of bounds
            table.validate(full=True)
        except (pa.ArrowException, OSError) as exc:
            if _lacks_its_end(path):   # (Arrow says "Not an Arrow file" of a cut one)
                raise TraceError(path, "truncated: an Arrow file that lacks its end (a copy "
                                       "or download cut short?)") from None
            raise TraceError(path, f"not a readable kimi-perf trace ({_first_line(exc)})") from None
        raw = (table.schema.metadata or {}).get(b"kimi_perf")
        if raw is None:
            raise TraceError(path, "Arrow file without kimi-perf metadata")
        if (batches := {c.num_chunks for c in table.columns}) != {1}:
            # (the columns are read, and checksummed, from one record batch)
            raise TraceError(path, f"corrupt: {max(batches, default=0)} record batches, where "
                                   "kimi-perf writes one")
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:   # JSONDecodeError is a ValueError
            raise TraceError(path, f"corrupt kimi-perf metadata ({_first_line(exc)})") from None
        if not isinstance(header, dict):
            raise TraceError(path, "corrupt kimi-perf metadata (not an object)")
        version = header.get("version")
        if type(version) is not int:   # (true and 1.0 are no version)
            raise TraceError(path, "corrupt kimi-perf metadata (" + (
                f"its format version is {json.dumps(version)}, not a whole number)"
                if "version" in header else "no format version)"))
        if version not in READ_VERSIONS:
            raise TraceError(path, f"kimi-perf trace format {version} is not supported (this "
                                   f"version reads {' and '.join(map(str, READ_VERSIONS))})")
        meta = header.get("meta")
        if not isinstance(meta, dict):
            raise TraceError(path, "kimi-perf trace without its metadata")
        # from version 2 on, the columns' checksum and the metadata's are there (files of
        # version 1 were saved for a while without the columns')
        for key, crc in (("crc32", lambda: _checksum(table)),
                         ("meta_crc32", lambda: _meta_checksum(meta))):
            if key not in header:
                if version == 1:
                    continue
                raise TraceError(path, f"corrupt kimi-perf metadata (no checksum {key})")
            if header[key] != crc():
                raise TraceError(path, "corrupt: its " + ("contents" if key == "crc32" else
                                                          "metadata") + " do not match their "
                                       "checksum")
        if problem := meta_problem(meta):
            raise TraceError(path, f"corrupt metadata: {problem}")

        def column(name: str) -> pa.Array:
            if name not in table.column_names:
                raise TraceError(path, f"kimi-perf trace lacks column {name!r}")
            return table.column(name).chunk(0).values

        tables = {}
        for table_name, kind in TABLES.items():
            cols = {}
            for c, dtype in kind.dtypes.items():
                values = column(f"{table_name}.{c}")
                if values.null_count or not (
                        values.type == pa.from_numpy_dtype(np.dtype(dtype))
                        or (c in kind.compact_columns and values.type == pa.int32())):
                    raise TraceError(path, f"corrupt: column {table_name}.{c} holds "
                                           f"{values.type} with {values.null_count} nulls")
                cols[c] = values.to_numpy(zero_copy_only=False)
            tables[table_name] = kind(**cols)
            try:
                tables[table_name].check()
            except ValueError as exc:
                raise TraceError(path, f"corrupt: {exc}") from None
        strings = column("strings").to_pylist()
        # the file read is this one; the trace it was saved from (its format's) is kept
        if meta.get("file") not in (None, str(path)) and meta.get("converted_from") is None:
            meta["converted_from"] = meta["file"]
        meta["file"] = str(path)
        meta["kptrace"] = True
        trace = cls(strings=strings, meta=meta, **tables)
        if problem := trace.reference_problem():
            raise TraceError(path, f"corrupt: {problem}")
        for name in ("kernels", "memops"):   # (the readers keep no other: "untimed")
            work = getattr(trace, name)
            if (untimed := int((work.end < work.start).sum())):
                raise TraceError(path, f"corrupt: {counted(untimed, name[:-1])} with an "
                                       "end before the start")
        trace.tidy_strings()   # a file saved before readers tidied them
        return trace

    def joined(self, other: Trace) -> Trace:
        """This trace and ``other``, recorded on the same clock, as one trace: ``other``'s
        rows after these in each table, its names coded in one string table with these, its
        launch and parent rows renumbered. The metadata is this trace's, with ``other``'s GPUs
        and processes added. Ranges that nest across the two need ``nest_ranges`` again."""
        from kimi_perf.strings import StringTable

        table = StringTable()
        mine_coded, theirs_coded = (np.array(table.extend(t.strings), np.int32)
                                    for t in (self, other))
        shift = {"api": len(self.api), "parent": len(self.ranges)}
        tables = {}
        for table_name, kind in TABLES.items():
            mine, theirs = getattr(self, table_name), getattr(other, table_name)
            columns = {}
            for col, values in theirs.columns().items():
                first = getattr(mine, col)
                if col in ("name", "domain"):
                    first, values = mine_coded[first], theirs_coded[values]
                elif col in shift:
                    values = np.where(values >= 0, values.astype(np.int64) + shift[col], -1)
                columns[col] = np.concatenate([first, values]).astype(kind.dtypes[col],
                                                                      copy=False)
            tables[table_name] = kind(**columns).compact()
        meta = json.loads(json.dumps(self.meta))   # a copy, nothing of it shared
        for key, id_key in (("gpus", "device"), ("processes", "pid")):
            known = {entry.get(id_key) for entry in meta.get(key, [])}
            added = [e for e in other.meta.get(key, []) if e.get(id_key) not in known]
            if added:
                meta[key] = meta.get(key, []) + json.loads(json.dumps(added))
        none = {"kernels": 0, "memops": 0}
        for key in ("untimed", "duplicates"):
            if key in self.meta or key in other.meta:
                meta[key] = {k: self.meta.get(key, none)[k] + other.meta.get(key, none)[k]
                             for k in none}
        if ranges := self.meta.get("untimed_ranges", 0) + other.meta.get("untimed_ranges", 0):
            meta["untimed_ranges"] = ranges
        return Trace(strings=table.values, meta=meta, **tables)

    def tidy_strings(self) -> None:
        """Keep only the strings a table names, each safe to print. An nsys export's StringIds
        also holds what the profiled process ran with (its environment and command line:
        tokens, keys), which no analysis reads and which a saved ``.kptrace`` or a notebook's
        output must not carry. A control character in a name, or in a GPU's name (an escape
        sequence a terminal would obey), is written out as ``\\x1b``."""
        columns = [(table, name) for table in (self.kernels, self.memops, self.ranges, self.api)
                   for name in ("name", "domain") if hasattr(table, name)]
        used = np.zeros(len(self.strings), bool)
        for table, name in columns:
            used[getattr(table, name)] = True
        if not used.all():
            new_code = (np.cumsum(used) - 1).astype(np.int32)
            for table, name in columns:
                setattr(table, name, new_code[getattr(table, name)])
            self.strings = [s for s, keep in zip(self.strings, used.tolist(), strict=True)
                            if keep]
        self.strings = [printable(s) for s in self.strings]
        for described in [*(self.meta.get("gpus") or []), *(self.meta.get("processes") or [])]:
            if isinstance(described.get("name"), str):
                described["name"] = printable(described["name"])

    def reference_problem(self) -> str | None:
        """What points outside the trace, if anything: a name not among the strings, a launch
        or parent range not among the rows (-1, unknown, aside), a replay's rows
        (``meta["replay_rows"]``) past a table's."""
        replay = self.meta.get("replay_rows")
        for table_name in TABLES if replay is not None else ():
            if replay[table_name] > len(getattr(self, table_name)):
                return (f"replay_rows: {replay[table_name]} {table_name}, of "
                        f"{len(getattr(self, table_name))}")
        bounds = {"name": (0, len(self.strings)), "domain": (0, len(self.strings)),
                  "api": (-1, len(self.api)), "parent": (-1, len(self.ranges))}
        for table_name in TABLES:
            table = getattr(self, table_name)
            for col, (lo, hi) in bounds.items():
                values = getattr(table, col, None)
                if values is not None and len(values) and not (
                        lo <= values.min() and values.max() < hi):
                    return f"{table_name}.{col} refers outside [{lo}, {hi})"
        return None


def file_identity(path: str | Path) -> dict | None:
    """What tells a trace file from another of its name: its name, size and a digest of its
    first and last 64 KiB (a copy or a move keeps them; a new export under the old name
    does not); None where it is no regular file or cannot be read."""
    import hashlib

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):   # (a FIFO would wait for a writer)
            return None
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.blake2b(f.read(IDENTITY_BYTES), digest_size=16)
            f.seek(max(size - IDENTITY_BYTES, 0))
            digest.update(f.read(IDENTITY_BYTES))
    except OSError:
        return None
    return {"name": Path(path).name, "size": size, "digest": digest.hexdigest()}


IDENTITY_BYTES = 64 << 10


def kptrace_sources(path: str | Path) -> tuple[dict | None, list[dict]]:
    """The identities (``file_identity``) of the trace a ``.kptrace`` was saved from and of
    the graph captures joined to it, read from its header alone (its ``source_identity`` and
    ``capture_identities``); none where it has none (saved before they were kept) or cannot
    be read (``Trace.load`` then says why)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path), "r") as source:
            raw = (pa.ipc.open_file(source).schema.metadata or {}).get(b"kimi_perf")
        meta = json.loads(raw).get("meta") if raw is not None else None
    except (pa.ArrowException, OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None, []
    if not isinstance(meta, dict):
        return None, []
    captures = meta.get("capture_identities")
    return (meta.get("source_identity") if _is_identity(meta.get("source_identity")) else None,
            [c for c in captures if _is_identity(c)] if isinstance(captures, list) else [])


def _is_identity(made: object) -> bool:
    """Whether a header's identity has the shape ``file_identity`` gives (one edited by hand
    is no identity, and no error)."""
    return (isinstance(made, dict) and isinstance(made.get("name"), str)
            and is_int64(made.get("size")) and isinstance(made.get("digest"), str))


def is_int64(v: object) -> bool:
    """A JSON integer (not a bool) that an int64 column holds: ids, indices and counts that
    metadata and stored breakdowns carry."""
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def meta_problem(meta: dict) -> str | None:
    """What is wrong with the types of a trace's ``meta`` (the keys analyses read), if anything:
    a reader or a saved file that gave another type would fail far from here."""
    gpus, processes = meta.get("gpus", []), meta.get("processes", [])
    if not (isinstance(gpus, list) and all(
            isinstance(g, dict) and is_int64(g.get("device")) and isinstance(g.get("name"), str)
            and (g.get("sm_count") is None or is_int64(g["sm_count"])) for g in gpus)):
        return "gpus is not a list of {device: int, name: str, sm_count: int or null}"
    if not (isinstance(processes, list) and all(
            isinstance(p, dict) and is_int64(p.get("pid")) for p in processes)):
        return "processes is not a list of {pid: int, name}"
    if not (is_int64(meta.get("untimed_ranges", 0)) and meta.get("untimed_ranges", 0) >= 0):
        return "untimed_ranges is not a count"
    for key in ("untimed", "duplicates"):
        counts = meta.get(key, {"kernels": 0, "memops": 0})
        if not (isinstance(counts, dict) and all(
                is_int64(counts.get(k)) and counts[k] >= 0 for k in ("kernels", "memops"))):
            return f"{key} is not {{kernels: count, memops: count}}"
    replay = meta.get("replay_rows")
    if replay is not None and not (isinstance(replay, dict) and all(
            is_int64(replay.get(t)) and replay[t] >= 0 for t in TABLES)):
        return f"replay_rows is not {{{', '.join(f'{t}: count' for t in TABLES)}}}"
    captures = meta.get("captures", [])
    if not (isinstance(captures, list) and all(isinstance(c, str) for c in captures)):
        return "captures is not a list of file names"
    for key in ("format", "tool", "file", "converted_from"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"{key} is not a string"
    for key in ("kptrace", "exported_by_nsys"):
        if not isinstance(meta.get(key, False), bool):
            return f"{key} is not true or false"
    schema = meta.get("schema")   # (nsys: "3.25.0"; Kineto: "1", its schemaVersion)
    if schema is not None and not isinstance(schema, str) and not is_int64(schema):
        return "schema is not a string or an integer"
    for key in ("rank", "world_size"):
        if meta.get(key) is not None and not is_int64(meta[key]):
            return f"{key} is not an integer"
    return None


def _lacks_its_end(path: str | Path) -> bool:
    """Whether a file begins as an Arrow IPC file does (``ARROW1``) but does not end so."""
    try:
        with open(path, "rb") as f:
            if f.read(len(ARROW_MAGIC)) != ARROW_MAGIC:
                return False
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - len(ARROW_MAGIC), 0))
            return f.read() != ARROW_MAGIC
    except OSError:
        return False


def _checksum(table: pa.Table) -> int:
    """CRC-32 of a saved trace's values: each column's values in order (little-endian, as
    the file holds them), and for the strings their offsets (from 0) and bytes."""
    crc = 0
    for name in table.column_names:
        values = table.column(name).chunk(0).values
        if name == "strings":
            bufs = values.buffers()
            offsets = np.frombuffer(bufs[1], np.int64)[values.offset: values.offset
                                                        + len(values) + 1]
            crc = zlib.crc32((offsets - offsets[0]).astype("<i8", copy=False), crc)
            if bufs[2] is not None:
                crc = zlib.crc32(memoryview(bufs[2])[offsets[0]: offsets[-1]], crc)
        else:
            column = values.to_numpy(zero_copy_only=False)
            crc = zlib.crc32(column.astype(column.dtype.newbyteorder("<"), copy=False), crc)
    return crc


def _meta_checksum(meta: dict) -> int:
    """CRC-32 of a saved trace's metadata as it reads back (JSON's: its keys texts, then
    sorted, so that the order a reader keeps them in does not matter)."""
    return zlib.crc32(json.dumps(json.loads(json.dumps(meta)), sort_keys=True).encode())


def _fitting(values, dtype: str, column: str) -> np.ndarray:
    """``values`` as ``dtype``, refusing integers it cannot hold (a cast would wrap them: a
    GPU id of 99999999999 would read as GPU 1215752191)."""
    target = np.dtype(dtype)
    if not isinstance(values, np.ndarray) and target.kind == "i":
        values = _int_list(values, dtype, column)
    values = np.asarray(values)
    if (values.dtype.kind in "iu" and target.kind == "i" and len(values)
            and (values.dtype.itemsize > target.itemsize or values.dtype.kind == "u")):
        limits = np.iinfo(target)
        if values.min() < limits.min or values.max() > limits.max:
            beyond = values[(values < limits.min) | (values > limits.max)][0]
            raise ValueError(f"{column} holds {beyond}, beyond {dtype}")
    return np.ascontiguousarray(values, dtype=target)


def _int_list(values, dtype: str, column: str) -> np.ndarray:
    """A list of plain values (a reader's replayed events) for an integer column. An integer
    beyond int64 makes numpy take the whole list as floats or objects, which a cast would
    wrap (2^63 read as -2^31, with a warning) or fail on without naming the column; so would
    a None. Such values are refused here, by column."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iub":
        return arr
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    for value in values:    # (only where some value is not an int64 integer)
        if isinstance(value, int | np.integer):
            if lo <= value <= hi:
                continue
            whole = True
        else:
            # a JSON integer beyond int64 may come decoded as a float (-2^63 too, rounded)
            whole = isinstance(value, float) and value.is_integer()
            if whole and lo < value < 2**63:
                continue
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ValueError(f"{column} holds {shown}, "
                         + (f"beyond {dtype}" if whole else "not an integer"))
    return arr.astype(np.int64)   # every value a whole number inside int64: exact


def _one_row_list(values: pa.Array) -> pa.Array:
    import pyarrow as pa

    offsets = pa.array([0, len(values)], type=pa.int64())
    return pa.LargeListArray.from_arrays(offsets, values)


def _write_ipc(f, table: pa.Table) -> None:
    import pyarrow as pa

    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(f, table.schema, options=options) as writer:
        writer.write_table(table)


# kimi-perf's own JSON (a breakdown, or a run's breakdowns) begins with "schema"; a Kineto
# trace with "schemaVersion" or "traceEvents", if with an object
KIMI_PERF_JSON = re.compile(rb'(?:\xef\xbb\xbf)?\s*\{\s*"schema"\s*:')
# ... or, its keys sorted or moved (a baseline edited, json.dump(sort_keys=True)), with
# another of its keys, where no Kineto key follows (``kimi_perf_head``)
KIMI_PERF_JSON_MOVED = re.compile(
    rb'(?:\xef\xbb\xbf)?\s*\{\s*"(?:comparisons|gate_tolerances|layer_types|layers|overview|paths'
    rb'|run|run_dir|run_spread|source|steps|timeline)"\s*:')


def kimi_perf_head(head: bytes) -> bool | None:
    """Whether a JSON file's first bytes are kimi-perf's own JSON: True, False, or None
    where its keys were moved and the first 64 KiB must say whether a Kineto key follows
    (``KIMI_PERF_JSON_MOVED``; read them, then ``kimi_perf_head_read``)."""
    if KIMI_PERF_JSON.match(head):
        return True
    return None if KIMI_PERF_JSON_MOVED.match(head) else False


def kimi_perf_head_read(head: bytes) -> bool:
    """``kimi_perf_head`` of the first 64 KiB of a file whose keys were moved: ours where no
    Kineto key is among them ({"run": "nightly", "traceEvents": ...} is a trace)."""
    return b'"traceEvents"' not in head and b'"schemaVersion"' not in head


# How far into a JSON file its keys are looked for: ours (kimi_perf_head_read), or a Kineto
# trace's (the profiler writes its schema first), so that other JSON beside traces in a
# directory is told apart
JSON_HEAD = 1 << 16


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class WholeWrites(io.RawIOBase):
    """A file descriptor as a binary file whose every write is whole: a write into a pipe
    that its reader closes mid-way (`| head`) returns short, and Python's buffered files drop
    what is left without an error (the output cut, exit 0); here the write after the short
    one fails (BrokenPipeError: exit 141). The descriptor stays open."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        whole = memoryview(data).cast("B")
        left = whole
        while left:
            left = left[os.write(self._fd, left):]
        return len(whole)


def whole_stdout() -> WholeWrites | None:
    """Stdout as ``WholeWrites``, what Python buffered for it flushed first; None where
    stdout has no descriptor (a test's captured output), for the caller to write as usual."""
    sys.stdout.flush()
    try:
        return WholeWrites(sys.stdout.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def atomic_write(path: str | Path, write) -> None:
    """Call ``write(binary_file)`` on a temporary file beside ``path``, then rename it over,
    so that a failure leaves no partial file. A symlink is written through (its target
    replaced), an existing file keeps its permissions (one read-only is refused), and what is
    not a regular file (a device such as /dev/null, a pipe, /dev/stdout) is written into
    directly; ``-`` is stdout."""
    if str(path) == "-":
        out = whole_stdout() or sys.stdout.buffer
        write(out)
        out.flush()
        return
    given = Path(path)
    if (fd := named_descriptor(given)) is not None:
        # (a shell's `>> log`: the file behind it is written at its end, never replaced)
        _write_into(given, write, fd)
        return
    try:
        st = given.stat()          # through links: /dev/stdout is one to a pipe, say
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise TraceError(given, "cannot write: " + (
            "a symlink loop" if exc.errno == errno.ELOOP else exc.strerror or str(exc))) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise TraceError(given, "cannot write: it is a directory")
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    check_not_read_only(given)
    if st is not None and not stat.S_ISREG(st.st_mode):
        _write_into(given, write)
        return
    try:
        # a short temporary name: the target's may already be as long as names go
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:32]}.", suffix=".tmp",
                                   dir=target.parent or ".")
    except OSError as exc:
        # the file itself may exist (/proc/version): the new one is made beside it first
        raise TraceError(given, f"cannot write: no new file can be made in {target.parent} "
                                f"({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        # mkstemp's 0600 is for the temporary file only
        os.chmod(tmp, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~current_umask())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise TraceError(given, f"cannot write: {exc.strerror or exc}") from None
        raise


def _write_into(given: Path, write, fd: int | None = None) -> None:
    """Write into what is open at ``fd``, or into ``given`` opened (a pipe, a device), as it
    stands: nothing made beside it, nothing replaced."""
    try:
        if fd is not None:
            write(WholeWrites(fd))
        else:
            with open(given, "wb", buffering=0) as f:
                write(WholeWrites(f.fileno()))
    except BrokenPipeError:   # (-o /dev/stdout | head: the reader left, as for stdout)
        raise
    except OverflowError:   # (/dev/fd/99999999999999999999)
        raise TraceError(given, "cannot write: no such descriptor") from None
    except OSError as exc:
        raise TraceError(given, f"cannot write: {exc.strerror or exc}") from None


_DESCRIPTOR = re.compile(
    r"/dev/(?:std(?P<std>out|err)|fd/(?P<fd>\d+))"
    r"|/proc/(?:self|thread-self|(?P<pid>\d+)(?:/task/\d+)?)/fd/(?P<proc>\d+)")


def named_descriptor(path: str | Path) -> int | None:
    """The open file descriptor of this process a path names (/dev/stdout, /dev/fd/3,
    /proc/self/fd/1, /proc/thread-self/fd/1, or /proc/PID/fd/1 and /proc/PID/task/TID/fd/1
    of its own PID, as those resolve), or None: written into as it is open, not reopened
    (which truncates a shell's `>> log`) nor replaced (the log's earlier lines lost)."""
    if (m := _DESCRIPTOR.fullmatch(str(path))) is None:
        return None
    if m["pid"] is not None and int(m["pid"]) != os.getpid():   # (another's: a file)
        return None
    return {"out": 1, "err": 2}[m["std"]] if m["std"] else int(m["fd"] or m["proc"])


def check_not_read_only(path: Path) -> None:
    """Refuse an existing regular file made read-only, or one this user may not write: a
    rename would replace it all the same (the directory is what it needs; root writes
    anything). A descriptor's name (``/dev/stdout``, ``named_descriptor``) is what a shell
    opened: written into as it is."""
    if named_descriptor(path) is not None:
        return
    try:
        st = path.stat()
    except OSError:
        return   # (none yet: made anew)
    if not stat.S_ISREG(st.st_mode):
        return
    mode = f"mode {stat.S_IMODE(st.st_mode):o}"
    if not st.st_mode & 0o222:
        raise TraceError(path, f"cannot write: it is read-only ({mode})")
    if not os.access(path, os.W_OK):
        raise TraceError(path, f"cannot write: not writable by this user ({mode}, owner uid "
                               f"{st.st_uid})")


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def json_text(value: Any, chunk: int = 4096) -> str:
    """``json.dumps(value, indent=1)`` and a newline, encoded by msgspec: json's ``indent``
    takes its pure-Python encoder, seconds and twice the memory for the 43k layers of a
    1M-kernel trace's breakdown. Characters beyond ASCII are escaped as json escapes them (a
    name with a bidirectional override stays visible). Where msgspec writes otherwise:
    numbers in exponent form (``1e-7`` for ``1e-07``: they read back the same), and NaN or
    infinity, which it writes as ``null`` (valid JSON, where json writes the invalid ``NaN``).
    What msgspec does not take (a dict keyed by numbers) goes to json.

    A sequence that is no list or tuple (a breakdown's ``LayerRows``, whose rows are built
    as dicts when read) is written as a list, ``chunk`` items at a time: the text is the
    same, and its items never all exist as Python objects at once."""
    import msgspec

    lazy: list[Sequence] = []
    slot = f"\x00kimi-perf:{os.getpid()}:{id(lazy)}:"   # (no string of a trace holds it)

    def hook(item: Any) -> Any:
        if isinstance(item, Sequence) and not isinstance(item, str | bytes):
            lazy.append(item)
            return f"{slot}{len(lazy) - 1}"
        return _builtin_subclass(item)

    try:
        raw = msgspec.json.encode(value, enc_hook=hook)
    except TypeError:
        del lazy[:]
        text = json.dumps(value, indent=1, default=hook)
    else:
        text = msgspec.json.format(raw, indent=1).decode()
        if not text.isascii():   # (only strings hold such characters: escaped in place)
            text = _NOT_ASCII.sub(_json_escape, text)
    if not lazy:
        return text + "\n"
    parts, done = [], 0
    for match in re.finditer(re.escape(json.dumps(slot)[:-1]) + r'(\d+)"', text):
        line = text.rfind("\n", 0, match.start()) + 1
        indent = len(text[line:match.start()]) - len(text[line:match.start()].lstrip(" "))
        parts += [text[done:match.start()], *_list_text(lazy[int(match[1])], indent, chunk)]
        done = match.end()
    return "".join([*parts, text[done:], "\n"])


def _list_text(items: Sequence, indent: int, chunk: int) -> list[str]:
    """A sequence as ``json_text`` writes a list at a line of ``indent`` spaces, in pieces
    encoded ``chunk`` items at a time."""
    if not len(items):
        return ["[]"]
    parts = ["[\n"]
    for lo in range(0, len(items), chunk):
        # a list's items at the top level are one space in: ``indent`` more in place
        body = json_text(list(items[lo:lo + chunk]), chunk)[2:-3]
        parts += [",\n" if lo else "", " " * indent, body.replace("\n", "\n" + " " * indent)]
    return [*parts, "\n", " " * indent, "]"]


_NOT_ASCII = re.compile(r"[^\x00-\x7f]")


def _json_escape(match: re.Match) -> str:
    """A character beyond ASCII as json writes it: ``\\uXXXX``, a surrogate pair beyond the
    Basic Multilingual Plane."""
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 | code >> 10:04x}\\u{0xDC00 | code & 0x3FF:04x}"


def _builtin_subclass(value: Any) -> Any:
    """What json takes and msgspec does not: subclasses of str, int and float (torch's
    TorchVersion, numpy's float64)."""
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

