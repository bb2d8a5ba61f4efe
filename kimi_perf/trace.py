"""One columnar trace model that every reader produces and every analyzer consumes.

Each table is a dataclass of equal-length numpy columns; names are int32 codes into
``Trace.strings`` so that grouping by name is an integer operation. Times are int64 ns on the
trace's own clock. ``-1`` means "unknown" in integer id columns. Id and row-index columns
(``Table.compact``) are int32 where every value fits and int64 otherwise: readers compact them
(``Trace.compact``), since most ids of most traces fit and that halves their memory; code that
reads them takes either width (and widens before shifting or multiplying).

A trace saves to and loads from one Arrow IPC file (``.kptrace``): one row whose columns are
``large_list`` arrays, so tables of different lengths share a file and load without a copy
(``benchmarks/bench_trace_io.py`` compares it with Parquet and ``.npz``).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from kimi_perf.errors import TraceError

# pyarrow is imported where used (save, load): it costs ~25 MB of RSS that reading never needs.
if TYPE_CHECKING:
    import pyarrow as pa

FORMAT_VERSION = 1

# Range styles.
PUSHPOP, STARTEND, GPU_RANGE = 0, 1, 2
STYLE_NAMES = {PUSHPOP: "PushPop", STARTEND: "StartEnd", GPU_RANGE: "GPU"}

# API call kinds.
RUNTIME, DRIVER, OTHER_API = 0, 1, 2


@dataclass
class Table:
    """Equal-length numpy columns. Subclasses declare the columns and their dtypes."""

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
                out[name] = np.ascontiguousarray(value, dtype=dtype)
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


@dataclass
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


@dataclass
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


@dataclass
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


@dataclass
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


@dataclass
class Trace:
    """A whole trace: four tables, the string table they index, and metadata.

    ``meta`` keys: ``format`` (``nsys-sqlite`` | ``kineto-json``), ``tool`` (profiler and
    version), ``schema`` (export schema version, when known), ``file``, ``gpus`` (list of
    ``{"device", "name", "sm_count"}``), ``processes`` (list of ``{"pid", "name"}``).
    """

    strings: list[str]
    kernels: Kernels
    memops: MemOps = field(default_factory=MemOps.empty)
    ranges: Ranges = field(default_factory=Ranges.empty)
    api: ApiCalls = field(default_factory=ApiCalls.empty)
    meta: dict[str, Any] = field(default_factory=dict)

    def compact(self) -> Self:
        """``Table.compact`` on every table; returns self."""
        for table_name in TABLES:
            getattr(self, table_name).compact()
        return self

    def names_matching(self, pattern) -> np.ndarray:
        """Boolean mask over string codes: which strings match a compiled regex (search)."""
        return np.fromiter((pattern.search(s) is not None for s in self.strings), bool,
                           count=len(self.strings))

    def save(self, path: str | Path) -> None:
        """Write atomically to one Arrow IPC file (see module docstring)."""
        import pyarrow as pa

        arrays, names = [], []
        for table_name in TABLES:
            for col, values in getattr(self, table_name).columns().items():
                names.append(f"{table_name}.{col}")
                arrays.append(_one_row_list(pa.array(values)))
        names.append("strings")
        arrays.append(_one_row_list(pa.array(self.strings, type=pa.large_string())))
        metadata = {"kimi_perf": json.dumps({"version": FORMAT_VERSION, "meta": self.meta})}
        table = pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(metadata)
        atomic_write(path, lambda f: _write_ipc(f, table))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        import pyarrow as pa

        try:
            with pa.memory_map(str(path), "r") as source:
                table = pa.ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise TraceError(path, f"not a readable kimi-perf trace ({_first_line(exc)})") from None
        raw = (table.schema.metadata or {}).get(b"kimi_perf")
        if raw is None:
            raise TraceError(path, "Arrow file without kimi-perf metadata")
        header = json.loads(raw)
        if header.get("version") != FORMAT_VERSION:
            raise TraceError(path, f"kimi-perf trace format {header.get('version')} is not "
                                   f"supported (this version reads {FORMAT_VERSION})")

        def column(name: str) -> pa.Array:
            if name not in table.column_names:
                raise TraceError(path, f"kimi-perf trace lacks column {name!r}")
            return table.column(name).chunk(0).values

        tables = {}
        for table_name, kind in TABLES.items():
            cols = {c: column(f"{table_name}.{c}").to_numpy(zero_copy_only=False)
                    for c in kind.dtypes}
            tables[table_name] = kind(**cols)
        strings = column("strings").to_pylist()
        return cls(strings=strings, meta=header["meta"], **tables)


def _one_row_list(values: pa.Array) -> pa.Array:
    import pyarrow as pa

    offsets = pa.array([0, len(values)], type=pa.int64())
    return pa.LargeListArray.from_arrays(offsets, values)


def _write_ipc(f, table: pa.Table) -> None:
    import pyarrow as pa

    with pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def atomic_write(path: str | Path, write) -> None:
    """Call ``write(binary_file)`` on a temporary file beside ``path``, then rename it over."""
    from kimi_perf.errors import TraceError

    path = Path(path)
    if path.is_dir():
        raise TraceError(path, "cannot write: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                   dir=path.parent or ".")
    except OSError as exc:
        raise TraceError(path, f"cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 is for the temporary file only
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise TraceError(path, f"cannot write: {exc.strerror or exc}") from None
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))

