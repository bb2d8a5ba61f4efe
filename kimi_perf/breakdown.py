"""Per-step and per-layer kernel counts and times, per kernel class; medians per layer type.

The JSON form (``Breakdown.to_json``) is versioned (``"schema": 1``) and documented in the
README; new keys may be added within a schema version, existing ones keep their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kimi_perf.classify import Rule
from kimi_perf.layers import GpuOps, Step, segment
from kimi_perf.trace import Trace

SCHEMA = 1


@dataclass
class Breakdown:
    source: dict[str, Any]
    steps: list[dict[str, Any]]
    layers: list[dict[str, Any]]
    layer_types: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "source": self.source, "steps": self.steps,
                "layers": self.layers, "layer_types": self.layer_types}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str | Path = "breakdown") -> Breakdown:
        from kimi_perf.errors import TraceError

        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise TraceError(path, f"not a kimi-perf breakdown of schema {SCHEMA}")
        try:
            return cls(source=doc["source"], steps=doc["steps"], layers=doc["layers"],
                       layer_types=doc["layer_types"])
        except KeyError as exc:
            raise TraceError(path, f"breakdown lacks {exc.args[0]!r}") from None


def segment_stats(ops: GpuOps, rows: np.ndarray, classes: np.ndarray, labels: list[str]
                  ) -> dict[str, Any]:
    """Counts and µs for a set of GPU ops: summed op time, span (first start to last end),
    and gap (span minus the time at least one op runs)."""
    if len(rows) == 0:
        return {"kernels": 0, "kernel_us": 0.0, "span_us": 0.0, "gap_us": 0.0, "classes": {}}
    start, end = ops.start[rows], ops.end[rows]
    span = int(end.max() - start.min())
    busy = _union_length(start, end)
    cls = classes[rows]
    dur = end - start
    per_class = {}
    for c in np.unique(cls).tolist():
        sel = cls == c
        per_class[labels[c]] = {"kernels": int(sel.sum()), "us": _us(dur[sel].sum())}
    return {"kernels": len(rows), "kernel_us": _us(dur.sum()), "span_us": _us(span),
            "gap_us": _us(span - busy), "classes": dict(sorted(per_class.items()))}


def _union_length(start: np.ndarray, end: np.ndarray) -> int:
    """Total length of the union of intervals (overlapping streams count once)."""
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    running_end = np.maximum.accumulate(e)
    # A new busy block starts where an op starts after everything before it has ended.
    new_block = np.r_[True, s[1:] > running_end[:-1]]
    block_id = np.cumsum(new_block) - 1
    block_start = s[new_block]
    block_end = np.zeros(len(block_start), np.int64)
    np.maximum.at(block_end, block_id, e)
    return int((block_end - block_start).sum())


def _us(ns) -> float:
    return round(float(ns) / 1000.0, 3)


def breakdown(trace: Trace, layers: str = "auto", rules: list[Rule] | None = None,
              step_regex: str | None = None) -> Breakdown:
    ops, steps = segment(trace, layers=layers, step_regex=step_regex, rules=rules)
    classes, labels = ops.kernel_class, ops.class_labels
    step_rows, layer_rows = [], []
    for step in steps:
        step_rows.append(_step_json(ops, step, classes, labels))
        for layer in step.layers:
            stats = segment_stats(ops, layer.ops, classes, labels)
            layer_rows.append({"step": step.index, "device": step.device, "index": layer.index,
                               "type": layer.type, **stats})
    return Breakdown(source=_source(trace), steps=step_rows, layers=layer_rows,
                     layer_types=layer_type_medians(layer_rows))


def _step_json(ops: GpuOps, step: Step, classes: np.ndarray, labels: list[str]) -> dict:
    stats = segment_stats(ops, step.ops, classes, labels)
    return {
        "index": step.index, "device": step.device, "pid": step.pid, "name": step.name,
        "layer_source": step.layer_source, "layers": len(step.layers), **stats,
        "prologue": _brief(segment_stats(ops, step.prologue, classes, labels)),
        "epilogue": _brief(segment_stats(ops, step.epilogue, classes, labels)),
    }


def _brief(stats: dict) -> dict:
    return {k: stats[k] for k in ("kernels", "kernel_us", "span_us")}


def layer_type_medians(layer_rows: list[dict]) -> list[dict]:
    """Per layer type, the median of each figure over all its layers in all steps."""
    by_type: dict[str, list[dict]] = {}
    for row in layer_rows:
        by_type.setdefault(row["type"], []).append(row)
    out = []
    for kind, rows in by_type.items():
        classes = sorted({c for r in rows for c in r["classes"]})
        out.append({
            "type": kind, "layers": len(rows),
            "kernels": _median([r["kernels"] for r in rows]),
            "kernel_us": _median([r["kernel_us"] for r in rows]),
            "span_us": _median([r["span_us"] for r in rows]),
            "gap_us": _median([r["gap_us"] for r in rows]),
            "classes": {c: {"kernels": _median([r["classes"].get(c, {}).get("kernels", 0)
                                                for r in rows]),
                            "us": _median([r["classes"].get(c, {}).get("us", 0.0)
                                           for r in rows])} for c in classes},
        })
    return out


def _median(values: list[float]) -> float:
    return round(float(np.median(values)), 3) if values else 0.0


def _source(trace: Trace) -> dict:
    meta = trace.meta
    return {"file": meta.get("file"), "format": meta.get("format"), "tool": meta.get("tool"),
            "schema": meta.get("schema"), "gpus": meta.get("gpus", []),
            "kernels": len(trace.kernels), "memops": len(trace.memops),
            "ranges": len(trace.ranges)}
