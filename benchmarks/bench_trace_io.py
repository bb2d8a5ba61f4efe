"""Save/reload formats for a kimi-perf ``Trace``: Arrow IPC (``Trace.save``) vs Parquet vs .npz.

    python benchmarks/bench_trace_io.py             # the 1M-kernel synthetic nsys trace
    python benchmarks/bench_trace_io.py --quick

The trace is the synthetic nsys export of bench_trace_core.py (same sizes, same work dir, reused),
read once with ``read_trace``. Every format stores the same columns (four tables, the string
table, the metadata) and must load back equal. Times are the median (and range) of
``--repeat`` runs on a file that is in the page cache; "load + scan" also touches every value,
which a memory-mapped load otherwise defers. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import synth_traces
from rich.console import Console
from rich.table import Table

from kimi_perf.readers import read_trace
from kimi_perf.trace import TABLES, Trace

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "bench-out"

Columns = dict[str, np.ndarray]   # "kernels.start" -> values, ...


def trace_columns(trace: Trace) -> Columns:
    return {f"{name}.{col}": values for name in TABLES
            for col, values in getattr(trace, name).columns().items()}


def _strings_blob(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The string table as UTF-8 bytes + offsets: storable without pickle."""
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    offsets[1:] = np.cumsum([len(b) for b in encoded])
    return np.frombuffer(b"".join(encoded), np.uint8), offsets


def _strings_from_blob(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    data = blob.tobytes()
    bounds = offsets.tolist()
    return [data[a:b].decode() for a, b in pairwise(bounds)]


# -- formats: write(trace, path) and load(path) -> (columns, strings, meta) -----------------------

Loaded = tuple[Columns, list[str], dict[str, Any]]


def arrow_write(trace: Trace, path: Path) -> None:
    trace.save(path)


def arrow_load(path: Path) -> Loaded:
    trace = Trace.load(path)
    return trace_columns(trace), trace.strings, trace.meta


def arrow_plain_write(trace: Trace, path: Path) -> None:
    """Trace.save's layout with uncompressed buffers (what it wrote before zstd)."""
    arrays, names = [], []
    for name, values in trace_columns(trace).items():
        names.append(name)
        arrays.append(pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()),
                                                    pa.array(values)))
    names.append("strings")
    strings = pa.array(trace.strings, type=pa.large_string())
    arrays.append(pa.LargeListArray.from_arrays(pa.array([0, len(strings)], pa.int64()),
                                                strings))
    table = pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(
        {"meta": json.dumps(trace.meta)})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def arrow_plain_load(path: Path) -> Loaded:
    """A zero-copy memory map, unchecked."""
    with pa.memory_map(str(path), "r") as source:
        table = pa.ipc.open_file(source).read_all()
    columns = {name: table.column(name).chunk(0).values.to_numpy(zero_copy_only=False)
               for name in table.column_names if name != "strings"}
    strings = table.column("strings").chunk(0).values.to_pylist()
    return columns, strings, json.loads(table.schema.metadata[b"meta"])


def parquet_write(trace: Trace, path: Path) -> None:
    """One Parquet file per table (Parquet has no tables of different lengths in one file)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in TABLES:
        columns = getattr(trace, name).columns()
        pq.write_table(pa.table({c: pa.array(v) for c, v in columns.items()}),
                       path / f"{name}.parquet", compression="zstd")
    table = pa.table({"value": pa.array(trace.strings, pa.large_string())})
    table = table.replace_schema_metadata({"meta": json.dumps(trace.meta)})
    pq.write_table(table, path / "strings.parquet", compression="zstd")


def parquet_load(path: Path) -> Loaded:
    columns = {}
    for name in TABLES:
        table = pq.read_table(path / f"{name}.parquet")
        for col in table.column_names:
            columns[f"{name}.{col}"] = table.column(col).to_numpy()
    table = pq.read_table(path / "strings.parquet")
    return (columns, table.column("value").to_pylist(),
            json.loads(table.schema.metadata[b"meta"]))


def _npz_arrays(trace: Trace) -> dict[str, np.ndarray]:
    blob, offsets = _strings_blob(trace.strings)
    meta = np.frombuffer(json.dumps(trace.meta).encode(), np.uint8)
    return {**trace_columns(trace), "strings.blob": blob, "strings.offsets": offsets,
            "meta": meta}


def npz_write(trace: Trace, path: Path) -> None:
    np.savez(path, **_npz_arrays(trace))


def npz_compressed_write(trace: Trace, path: Path) -> None:
    np.savez_compressed(path, **_npz_arrays(trace))


def npz_load(path: Path) -> Loaded:
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}   # np.load is lazy: read them all
    strings = _strings_from_blob(arrays.pop("strings.blob"), arrays.pop("strings.offsets"))
    meta = json.loads(arrays.pop("meta").tobytes())
    return arrays, strings, meta


@dataclass(frozen=True)
class Format:
    label: str
    suffix: str
    write: Callable[[Trace, Path], None]
    load: Callable[[Path], Loaded]
    note: str = ""


FORMATS = [
    Format("Arrow IPC (project)", ".kptrace", arrow_write, arrow_load,
           "Trace.save: zstd, checked"),
    Format("Arrow IPC, plain", ".plain.arrow", arrow_plain_write, arrow_plain_load,
           "zero-copy, unchecked"),
    Format("Parquet (zstd)", ".parquet.d", parquet_write, parquet_load, "a file per table"),
    Format("numpy .npz", ".npz", npz_write, npz_load, "np.savez"),
    Format("numpy .npz (deflate)", ".z.npz", npz_compressed_write, npz_load,
           "np.savez_compressed"),
]


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir())
    return path.stat().st_size


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _scan(columns: Columns) -> int:
    """Touch every value (sums wrap around harmlessly)."""
    return sum(int(v.sum(dtype=np.int64)) for v in columns.values())


def _check(trace: Trace, loaded: Loaded, label: str) -> None:
    columns, strings, meta = loaded
    expected = trace_columns(trace)
    bad = [k for k, v in expected.items()
           if k not in columns or columns[k].dtype != v.dtype or not np.array_equal(columns[k], v)]
    # (Trace.load names the file it read, keeps the one the trace was saved from, and marks
    # it read from a .kptrace)
    saved_from = {k: v for k, v in meta.items() if k not in ("file", "converted_from",
                                                             "kptrace")}
    if meta.get("converted_from", meta.get("file")) != trace.meta.get("file"):
        bad.append("meta.file")
    if bad or strings != trace.strings or saved_from != {
            k: v for k, v in trace.meta.items() if k != "file"}:
        raise SystemExit(f"{label}: reloaded trace differs ({', '.join(bad) or 'strings/meta'})")


def _load_and_scan(load: Callable[[], Loaded], repeat: int) -> tuple[list[float], list[float]]:
    """The loads and the loads + scans of the same repetitions (after one untimed load, so
    that no side is timed cold), in seconds."""
    load()
    loads, scans = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        columns = load()[0]
        loaded = time.perf_counter()
        _scan(columns)
        scans.append(time.perf_counter() - started)
        loads.append(loaded - started)
    return loads, scans


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    """``fn``'s seconds in each of ``repeat`` runs, and its last result."""
    times, result = [], None
    for _ in range(repeat):
        result = None   # (the last result freed before the next is made: one in memory)
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return times, result


def _ms(times: list[float], spread: bool = False) -> str:
    """The median in milliseconds; ``spread``: the runs' range too, where there are several."""
    said = f"{statistics.median(times) * 1e3:,.1f}"
    return said + (f" ({min(times) * 1e3:,.1f}–{max(times) * 1e3:,.1f})"
                   if spread and len(times) > 1 else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    positive = synth_traces.positive_int
    p.add_argument("--kernels", type=positive, default=None,
                   help="kernels in the synthetic nsys trace (default 1,000,000; --quick: 20,000)")
    p.add_argument("--ranges", type=positive, default=None,
                   help="NVTX ranges in it (default 150,000; --quick: 3,000)")
    p.add_argument("--layers", type=positive, default=synth_traces.LAYERS_PER_STEP,
                   help="layers per decode step")
    p.add_argument("--out", type=synth_traces.work_dir, default=DEFAULT_OUT,
                   help="work dir (traces are reused)")
    p.add_argument("--repeat", type=positive, default=None,
                   help="runs per measurement: their median and range (default 5; --quick: "
                        "2)")
    p.add_argument("--quick", action="store_true",
                   help="small default sizes, two runs each: a smoke test")
    p.add_argument("--skip-hta", action="store_true",
                   help="accepted for symmetry with bench_trace_core.py (no HTA here)")
    args = p.parse_args(argv)
    # Explicit values win over --quick's.
    if args.kernels is None:
        args.kernels = 20_000 if args.quick else 1_000_000
    if args.ranges is None:
        args.ranges = 3_000 if args.quick else 150_000
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)
    console.print(synth_traces.banner("kimi-perf trace save/reload benchmark",
                                      f"numpy {np.__version__}, pyarrow {pa.__version__}"))
    out = args.out.resolve()
    with console.status("generating / reusing the synthetic nsys trace..."):
        source = synth_traces.ensure_nsys(out, args.kernels, args.ranges, args.layers)
    read_trace(source.path)   # (untimed: the file into the page cache, as the others' are)
    reads, trace = _timed(lambda: read_trace(source.path), args.repeat)
    read_s = statistics.median(reads)
    n = len(trace.kernels)
    rows = sum(len(getattr(trace, name)) for name in TABLES)
    console.print(f"source: {source.path.name} ({source.info['file_bytes'] / 1e6:,.1f} MB), "
                  f"{n:,} kernels, {len(trace.api):,} API calls, {len(trace.ranges):,} ranges, "
                  f"{len(trace.strings):,} strings; read_trace {_ms(reads, True)} ms "
                  f"({n / read_s:,.0f} kernels/s)")

    io_dir = out / "trace-io"
    io_dir.mkdir(parents=True, exist_ok=True)
    table = Table(title=f"Trace save / reload ({rows:,} rows in 4 tables; ms, the median of "
                        f"{args.repeat} runs, and for load + scan their range)",
                  title_justify="left")
    for col in ("format", "size", "vs Arrow", "write", "load", "load + scan", "kernels/s",
                "vs read_trace", "note"):
        table.add_column(col, justify="left" if col in ("format", "note") else "right")
    arrow_size = None
    for fmt in FORMATS:
        path = io_dir / f"trace{fmt.suffix}"
        _remove(path)
        writes, _ = _timed(lambda fmt=fmt, path=path: fmt.write(trace, path), args.repeat)
        size = _size(path)
        arrow_size = arrow_size or size
        _check(trace, fmt.load(path), fmt.label)
        loads, scans = _load_and_scan(lambda fmt=fmt, path=path: fmt.load(path), args.repeat)
        scan_s = statistics.median(scans)
        table.add_row(fmt.label, f"{size / 1e6:,.1f} MB", f"{size / arrow_size:.2f}×",
                      _ms(writes), _ms(loads), _ms(scans, True), f"{n / scan_s:,.0f}",
                      f"{read_s / scan_s:,.0f}× faster", fmt.note)
        _remove(path)
    console.print(table)
    console.print("[dim]kernels/s = kernels / (load + scan); vs read_trace = reading the nsys "
                  "SQLite export again instead (medians of each). Every format reloads equal to "
                  "the original.[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
