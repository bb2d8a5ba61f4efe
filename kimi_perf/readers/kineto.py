"""PyTorch profiler (Kineto) Chrome-trace JSON, plain or gzipped, CUDA or ROCm.

Timestamps are µs: integers in old traces, floats with fractional ns in new ones; both become
int64 ns. A kernel links to its launching API call by ``args.correlation``; under a CUDA/HIP
graph every replayed kernel shares the graph launch's correlation.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import numpy as np

from kimi_perf.errors import TraceError
from kimi_perf.launches import find_launches
from kimi_perf.strings import StringTable
from kimi_perf.trace import (
    DRIVER,
    GPU_RANGE,
    PUSHPOP,
    RUNTIME,
    ApiCalls,
    Kernels,
    MemOps,
    Ranges,
    Trace,
)

try:
    import orjson

    _loads = orjson.loads
    _JSON_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError, ValueError)
except ImportError:  # pragma: no cover - orjson is a dependency; stdlib json still works
    _loads = json.loads
    _JSON_ERRORS = (ValueError,)

GZIP_MAGIC = b"\x1f\x8b"

_API_CATEGORIES = {"cuda_runtime": RUNTIME, "hip_runtime": RUNTIME, "cuda_driver": DRIVER,
                   "hip_driver": DRIVER}
# CPU ranges: profiler annotations (record_function, ProfilerStep#N) in the default domain,
# and operator events under a "cpu_op" domain so that kernels can be attributed to ops too.
_CPU_RANGE_DOMAINS = {"user_annotation": "", "cpu_op": "cpu_op"}


def read_kineto_json(path: str | Path) -> Trace:
    path = Path(path)
    doc = _load_json(path)
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
        if not isinstance(events, list):
            raise TraceError(path, "JSON without a 'traceEvents' list: not a Chrome/Kineto trace")
    elif isinstance(doc, list):
        events, doc = doc, {}
    else:
        raise TraceError(path, "JSON is neither a trace object nor an event list")
    builder = _Builder(path)
    builder.add_events(events)
    trace = builder.finish()
    trace.meta.update(_metadata(doc, path))
    return trace


def _load_json(path: Path):
    try:
        raw = path.read_bytes()
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(path, f"cannot decompress ({exc})") from None
    if not raw.strip():
        raise TraceError(path, "empty file")
    try:
        return _loads(raw)
    except _JSON_ERRORS as exc:
        raise TraceError(path, f"invalid or truncated JSON ({str(exc).splitlines()[0]})") from None


class _Builder:
    """Collects columns in lists during the one pass over the events, then makes arrays."""

    def __init__(self, path: Path):
        self.path = path
        self.strings = StringTable()
        self.ids: dict[object, int] = {}
        self.k = {c: [] for c in ("name", "ts", "dur", "device", "stream", "pid", "corr")}
        self.m = {c: [] for c in ("name", "ts", "dur", "device", "stream", "pid", "corr",
                                  "bytes")}
        self.a = {c: [] for c in ("name", "ts", "dur", "pid", "tid", "corr", "kind")}
        self.r = {c: [] for c in ("name", "domain", "ts", "dur", "pid", "tid", "device",
                                  "stream", "style")}

    def _id(self, value) -> int:
        """pid/tid/device/stream may be ints, numeric strings or labels."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lstrip("-").isdigit():
            return int(value)
        if value is None:
            return -1
        # Labels such as "stream 7 (graph)": a stable synthetic id per label.
        return self.ids.setdefault(value, (1 << 29) + len(self.ids))

    def add_events(self, events: list) -> None:
        code = self.strings.code
        for i, e in enumerate(events):
            if not isinstance(e, dict) or e.get("ph") != "X":
                continue
            cat = e.get("cat")
            try:
                if cat == "kernel":
                    args = e.get("args") or {}
                    self._gpu(self.k, e, args)
                elif cat in ("gpu_memcpy", "gpu_memset"):
                    args = e.get("args") or {}
                    self._gpu(self.m, e, args)
                    self.m["bytes"].append(int(args.get("bytes", -1) or -1))
                elif cat in _API_CATEGORIES:
                    args = e.get("args") or {}
                    a = self.a
                    a["name"].append(code(str(e.get("name", ""))))
                    a["ts"].append(e["ts"])
                    a["dur"].append(e.get("dur", 0))
                    a["pid"].append(self._id(e.get("pid")))
                    a["tid"].append(self._id(e.get("tid")))
                    a["corr"].append(int(args.get("correlation", -1)))
                    a["kind"].append(_API_CATEGORIES[cat])
                elif cat in _CPU_RANGE_DOMAINS or cat == "gpu_user_annotation":
                    r = self.r
                    domain = _CPU_RANGE_DOMAINS.get(cat, "")
                    name = str(e.get("name", ""))
                    r["name"].append(code(f"{domain}:{name}" if domain else name))
                    r["domain"].append(code(domain))
                    r["ts"].append(e["ts"])
                    r["dur"].append(e.get("dur", 0))
                    if cat == "gpu_user_annotation":
                        args = e.get("args") or {}
                        r["pid"].append(self._id(e.get("pid")))
                        r["tid"].append(-1)
                        r["device"].append(self._id(args.get("device", e.get("pid"))))
                        r["stream"].append(self._id(args.get("stream", e.get("tid"))))
                        r["style"].append(GPU_RANGE)
                    else:
                        r["pid"].append(self._id(e.get("pid")))
                        r["tid"].append(self._id(e.get("tid")))
                        r["device"].append(-1)
                        r["stream"].append(-1)
                        r["style"].append(PUSHPOP)
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(self.path, f"event {i} ({cat}) is malformed: "
                                            f"{type(exc).__name__} {exc}") from None

    def _gpu(self, cols: dict, e: dict, args: dict) -> None:
        cols["name"].append(self.strings.code(str(e.get("name", ""))))
        cols["ts"].append(e["ts"])
        cols["dur"].append(e.get("dur", 0))
        cols["device"].append(self._id(args.get("device", e.get("pid"))))
        cols["stream"].append(self._id(args.get("stream", e.get("tid"))))
        cols["pid"].append(-1)  # the launching process comes from the API join below
        cols["corr"].append(int(args.get("correlation", -1)))

    def finish(self) -> Trace:
        times = {name: self._floats(cols) for name, cols in
                 (("a", self.a), ("k", self.k), ("m", self.m), ("r", self.r))}
        firsts = [ts[0] for ts, _ in times.values() if len(ts)]
        base = int(min(firsts)) if firsts else 0
        ns = {name: _to_ns(ts, dur, base) for name, (ts, dur) in times.items()}
        api = ApiCalls.from_columns({
            "name": self.a["name"], **ns["a"], "pid": self.a["pid"],
            "tid": self.a["tid"], "correlation": self.a["corr"], "kind": self.a["kind"]},
            len(self.a["name"]))
        kernels = Kernels.from_columns({
            "name": self.k["name"], **ns["k"], "device": self.k["device"],
            "stream": self.k["stream"], "pid": self.k["pid"], "correlation": self.k["corr"]},
            len(self.k["name"]))
        memops = MemOps.from_columns({
            "name": self.m["name"], **ns["m"], "device": self.m["device"],
            "stream": self.m["stream"], "pid": self.m["pid"], "correlation": self.m["corr"],
            "bytes": self.m["bytes"]}, len(self.m["name"]))
        ranges = Ranges.from_columns({
            "name": self.r["name"], "domain": self.r["domain"], **ns["r"],
            "pid": self.r["pid"], "tid": self.r["tid"], "device": self.r["device"],
            "stream": self.r["stream"], "style": self.r["style"]}, len(self.r["name"]))
        for gpu_work in (kernels, memops):
            _link_by_correlation(api, gpu_work)
        return Trace(strings=self.strings.values, kernels=kernels, memops=memops,
                     ranges=ranges, api=api, meta={"format": "kineto-json"})

    def _floats(self, cols: dict) -> tuple[np.ndarray, np.ndarray]:
        try:
            ts = np.asarray(cols["ts"], dtype=np.float64)
            dur = np.asarray(cols["dur"], dtype=np.float64)
        except (TypeError, ValueError):
            raise TraceError(self.path, "non-numeric 'ts' or 'dur' in events") from None
        if not (np.isfinite(ts).all() and np.isfinite(dur).all()):
            raise TraceError(self.path, "non-finite 'ts' or 'dur' in events")
        # Keep every ns value (and differences of them) well inside int64.
        if len(ts) and max(np.abs(ts).max(), np.abs(dur).max()) > 2**61 / 1000:
            raise TraceError(self.path, "'ts' or 'dur' out of range")
        return ts, dur


def _to_ns(ts: np.ndarray, dur: np.ndarray, base: int) -> dict[str, np.ndarray]:
    """µs (int or float) -> int64 ns, exact for integers and to the ns for floats: offsets
    from a common integer base keep float64 precise at epoch-sized timestamps."""
    start = np.rint((ts - base) * 1000.0).astype(np.int64) + base * 1000
    end = start + np.rint(np.maximum(dur, 0) * 1000.0).astype(np.int64)
    return {"start": start, "end": end}


def _link_by_correlation(api: ApiCalls, gpu_work) -> None:
    """Kineto GPU events carry no process id: the correlation id alone names the launch."""
    pid_any = np.zeros(len(gpu_work), np.int64)
    found = find_launches(_with_zero_pid(api), pid_any, gpu_work.correlation)
    gpu_work.api = found
    hit = found >= 0
    gpu_work.pid[hit] = api.pid[found[hit]]
    gpu_work.tid[hit] = api.tid[found[hit]]


def _with_zero_pid(api: ApiCalls) -> ApiCalls:
    cols = api.columns()
    cols["pid"] = np.zeros(len(api), np.int64)
    return ApiCalls(**cols)


def _metadata(doc: dict, path: Path) -> dict:
    gpus = []
    for prop in doc.get("deviceProperties") or []:
        if isinstance(prop, dict):
            gpus.append({"device": prop.get("id"), "name": prop.get("name") or "",
                         "sm_count": prop.get("numSms")})
    rocm = "roctracer_version" in doc or "hip_runtime_version" in doc
    schema = doc.get("schemaVersion")
    meta = {
        "tool": "PyTorch profiler (Kineto" + (", ROCm" if rocm else "") + ")",
        "schema": str(schema) if schema is not None else None,
        "file": str(path), "gpus": gpus, "processes": [],
    }
    dist = doc.get("distributedInfo")
    if isinstance(dist, dict) and "rank" in dist:
        meta["rank"] = dist.get("rank")
        meta["world_size"] = dist.get("world_size")
    return meta
