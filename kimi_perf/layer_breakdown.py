"""Per-step and per-layer kernel counts and times, per kernel class; medians per layer type.

The JSON form (``Breakdown.to_json``) is versioned (``"schema": 1``) and documented in
docs/reference.md; new keys may be added within a schema version, existing ones keep their meaning.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import re
import shlex
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import numpy as np

from kimi_perf.classify import (
    Rule,
    default_rules_said,
    layout_rules_said,
    load_rules,
    rules_said,
)
from kimi_perf.errors import NoGpuWork, NoStepsMatched, TraceError
from kimi_perf.graphs import capture_count, graph_replays
from kimi_perf.layers import (
    GpuOps,
    Step,
    find_layers,
    find_steps,
    layer_cycle,
    layer_like_ranges,
    outermost_names,
    outermost_ranges,
    pass_cuts,
    ranges_named,
    step_phase,
    steps_of_phase,
)
from kimi_perf.memory import release_free_memory
from kimi_perf.nesting import range_groups
from kimi_perf.text import counted
from kimi_perf.trace import GPU_RANGE, Trace

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA = 1
_BATCH_ROWS = 1 << 16


@dataclass(repr=False)
class Breakdown:
    """One trace's steps, layers and layer types (``breakdown()``; the reference's ``breakdown``
    section documents every key). ``steps``: a dict per step (kernels, µs, per kernel class);
    ``layers``: a dict per layer (``layer_column`` gives one figure of every layer as a numpy
    column); ``layer_types``: per type its median layer and typical layer; ``source``: what
    was read and how steps were found; ``timeline``: one step, op by op."""

    source: dict[str, Any]
    steps: list[dict[str, Any]]
    layers: Sequence[dict[str, Any]]     # a list, or LayerRows (the same dicts, built on read)
    layer_types: list[dict[str, Any]]
    timeline: dict[str, Any] | None = None  # one step, op by op (see _timeline)

    def __repr__(self) -> str:
        file = Path(self.source["file"]).name + ": " if self.source.get("file") else ""
        types = ", ".join(f"{t.get('type')} ×{t.get('layers', '?')}" for t in self.layer_types)
        return (f"Breakdown({file}{counted(len(self.steps), 'step')}, "
                f"{counted(len(self.layers), 'layer')}"
                f"{' (' + types + ')' if types else ''}, counting {self.unit})")

    @property
    def unit(self) -> str:
        """What the figures count: GPU kernels, or on a CPU run the launches the decode paths
        annotate ("ops")."""
        return "ops" if self.source.get("ops") == "cpu-ops" else "kernels"

    def layers_table(self) -> pa.Table:
        """Its layers, a row each, as an Arrow table, for a notebook (``.to_pandas()``):
        ``LAYER_COLUMNS``, ``type``, and per kernel class ``kernels:<class>`` and ``us:<class>``
        (0 where a layer ran none). The same of a breakdown made here and of one read from
        JSON; made here, from its columns, with no dict built per layer."""
        import pyarrow as pa

        layers = self.layers
        if isinstance(layers, LayerRows):
            columns = {name: layer_column(layers, name) for name in LAYER_COLUMNS}
            types, codes = layers.types, layers.type_code
            ran = layers.class_kernels.any(axis=0)   # (classes no layer ran: as JSON keeps)
            classes = [c for c, r in zip(layers.labels, ran.tolist(), strict=True) if r]
            kernels, us = layers.class_kernels[:, ran], layers.class_us[:, ran]
        else:
            columns = {name: layer_column(layers, name) for name in LAYER_COLUMNS}
            types = list(dict.fromkeys(r["type"] for r in layers))
            codes = np.array([types.index(r["type"]) for r in layers], np.int32)
            classes = sorted({c for r in layers for c in (r.get("classes") or {})})
            ran = [[(r.get("classes") or {}).get(c) or {} for c in classes] for r in layers]
            kernels = np.array([[c.get("kernels", 0) for c in row] for row in ran],
                               np.int64).reshape(len(layers), len(classes))
            us = np.array([[c.get("us", 0.0) for c in row] for row in ran],
                          np.float64).reshape(len(layers), len(classes))
        type_column = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()),
                                                     pa.array(types, pa.string()))
        counts = {"step", "device", "index", "kernels"}
        return pa.table({**{k: np.asarray(columns[k], np.int64) for k in ("step", "device",
                                                                            "index")},
                         "type": type_column,
                         **{k: np.asarray(columns[k], np.int64 if k in counts else np.float64)
                            for k in LAYER_COLUMNS[3:]},
                         **{f"kernels:{c}": np.asarray(kernels[:, i], np.int64)
                            for i, c in enumerate(classes)},
                         **{f"us:{c}": np.asarray(us[:, i], np.float64)
                            for i, c in enumerate(classes)}})

    def to_json(self, lazy_layers: bool = False) -> dict[str, Any]:
        """The breakdown as JSON's values; ``lazy_layers``: the layers as held (``LayerRows``,
        which ``json_text`` writes a chunk of rows at a time), not as a list of dicts."""
        doc = {"schema": SCHEMA, "source": self.source, "steps": self.steps,
               "layers": self.layers if lazy_layers else list(self.layers),
               "layer_types": self.layer_types}
        if self.timeline is not None:
            doc["timeline"] = self.timeline
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any], file: str | Path = "breakdown",
                  where: str = "") -> Breakdown:
        """The breakdown a parsed breakdown JSON holds (``to_json``'s, ``breakdown --format
        json``'s), checked as the gate and the report read it: a field missing or of another
        kind is a TraceError naming ``file`` (where the JSON came from) and the field, after
        ``where`` (its place in the file: ``paths.standard.``). ``load_breakdown`` and
        ``load_run`` read files."""
        # (runs reads breakdowns: not imported with this module)
        from kimi_perf.runs import checked_breakdown

        if isinstance(doc, str | bytes | PurePath):
            raise TypeError(f"doc: a breakdown's parsed JSON (a dict), not a "
                            f"{type(doc).__name__}: load_breakdown(file) reads a file")
        if not isinstance(doc, dict) or type(doc.get("schema")) is not int \
                or doc["schema"] != SCHEMA:
            raise TraceError(file, f"not a kimi-perf breakdown of schema {SCHEMA}")
        if "source" not in doc and isinstance(doc.get("paths"), dict):
            raise TraceError(file, "a run's breakdown.json, a breakdown per decode path: read "
                                   "one with from_json(doc['paths'][path]), or all with "
                                   "kimi_perf.runs.load_run")
        try:
            b = cls(source=doc["source"], steps=doc["steps"], layers=doc["layers"],
                    layer_types=doc["layer_types"], timeline=doc.get("timeline"))
        except KeyError as exc:
            raise TraceError(file, f"breakdown lacks {exc.args[0]!r}") from None
        return checked_breakdown(b, Path(file), where)


def units_word(units) -> str:
    """The word for what several breakdowns count: "kernels", "ops", or "kernels or ops"."""
    return " or ".join(sorted(set(units))) or "kernels"


def phase_note(b: Breakdown) -> str | None:
    """What a breakdown says of its steps' phases: the steps --phase left out, that its
    medians are over steps of several phases, or that no step is a decode step; None where
    none is so."""
    left_out = b.source.get("steps_left_out") or {}
    counts = Counter(s.get("phase") or "unknown" for s in b.steps)
    if left_out:
        kept = ", ".join(f"{n} {phase}" for phase, n in counts.most_common())
        gone = ", ".join(f"{n} {phase}" for phase, n in left_out.items())
        return f"steps: {kept} kept; {gone} left out (--phase all keeps every step)"
    if len(counts) == 1 and set(counts) & {"prefill", "mixed"}:
        ((phase, n),) = counts.items()
        return f"steps: {n} {phase}: every step prefills, so these are not decode figures"
    if len(counts) < 2:
        return None
    said = ", ".join(f"{n} {phase}" for phase, n in counts.most_common())
    keep = ("--phase decode keeps the decode steps" if "decode" in counts
            else "--phase " + " or ".join(p for p in counts if p != "unknown")
            + " keeps one phase")
    return f"steps: {said}; the medians are over all of them ({keep})"


@dataclass
class SegmentFigures:
    """Counts and µs of many segments (sets of GPU ops) at once, in ns and per class: summed
    op time, span (first start to last end), and gap (span minus the time at least one op
    runs).

    Figures are numpy arrays with one entry (row) per segment, int64 but for ``class_us``;
    ``class_*`` are [segment, class code] matrices.
    """

    kernels: np.ndarray
    kernel_ns: np.ndarray
    span_ns: np.ndarray
    busy_ns: np.ndarray
    class_kernels: np.ndarray
    class_ns: np.ndarray
    class_us: np.ndarray     # class_ns as stats() rounds it; 0.0 where a class has no op

    @classmethod
    def of(cls, ops: GpuOps, segments: list[np.ndarray], classes: np.ndarray,
           labels: list[str]) -> SegmentFigures:
        n_cls = max(len(labels), int(classes.max()) + 1 if len(classes) else 0)
        lengths = np.fromiter((len(rows) for rows in segments), np.int64, len(segments))
        # Consecutive segments in batches of about _BATCH_ROWS rows (a longer one alone):
        # bounded temporaries whatever the trace size.
        batch = np.cumsum(lengths) // _BATCH_ROWS
        cuts = [0, *(np.flatnonzero(batch[1:] != batch[:-1]) + 1).tolist(), len(segments)]
        parts = [cls._batch(ops, segments[a:b], lengths[a:b], classes, n_cls)
                 for a, b in itertools.pairwise(cuts)]
        return cls(*(np.concatenate(columns) for columns in zip(*(
            (p.kernels, p.kernel_ns, p.span_ns, p.busy_ns, p.class_kernels, p.class_ns,
             p.class_us) for p in parts), strict=True)))

    @classmethod
    def _batch(cls, ops: GpuOps, segments: list[np.ndarray], lengths: np.ndarray,
               classes: np.ndarray, n_cls: int) -> SegmentFigures:
        n_seg = len(segments)
        rows = (np.concatenate(segments).astype(np.int64, copy=False) if n_seg
                else np.empty(0, np.int64))
        seg = np.repeat(np.arange(n_seg, dtype=np.int64), lengths)
        start, end = ops.start[rows], ops.end[rows]
        dur = end - start
        # Row offset of each non-empty segment: ``reduceat`` over these is per segment.
        nonempty = np.flatnonzero(lengths)
        first = (np.cumsum(lengths) - lengths)[nonempty]
        kernel_ns = np.zeros(n_seg, np.int64)
        span_ns = np.zeros(n_seg, np.int64)
        if len(first):
            kernel_ns[nonempty] = np.add.reduceat(dur, first)
            span_ns[nonempty] = np.maximum.reduceat(end, first) - np.minimum.reduceat(start, first)
        busy_ns = np.zeros(n_seg, np.int64)
        busy_ns[nonempty] = _segmented_union_length(start, end, seg, first)
        key = seg * n_cls + classes[rows]
        class_kernels = np.bincount(key, minlength=n_seg * n_cls).reshape(n_seg, n_cls)
        class_ns = _bincount_int(key, dur, n_seg * n_cls).reshape(n_seg, n_cls)
        class_us = np.zeros(class_ns.shape, np.float64)
        present = class_kernels > 0
        class_us[present] = _us_array(class_ns[present])
        return cls(kernels=lengths, kernel_ns=kernel_ns, span_ns=span_ns, busy_ns=busy_ns,
                   class_kernels=class_kernels, class_ns=class_ns, class_us=class_us)

    def stats(self, labels: list[str], heads: list[dict[str, Any]] | None = None
              ) -> list[dict[str, Any]]:
        """Dicts of a segment's figures (classes sorted by label) for the first segments: one per
        head, each added to its head's keys (all segments without heads)."""
        n = len(self.kernels) if heads is None else len(heads)
        rows = heads if heads is not None else [{} for _ in range(n)]
        by_label = sorted(range(len(labels)), key=labels.__getitem__)
        counts = self.class_kernels[:n, by_label]
        us = self.class_us[:n, by_label]
        seg_idx, col = np.nonzero(counts)
        per_class: list[dict[str, Any]] = [{} for _ in range(n)]
        sorted_labels = [labels[c] for c in by_label]
        for s, c, k, u in zip(seg_idx.tolist(), col.tolist(), counts[seg_idx, col].tolist(),
                              us[seg_idx, col].tolist(), strict=True):
            per_class[s][sorted_labels[c]] = {"kernels": k, "us": u}
        for row, k, ku, su, gu, pc in zip(
                rows, self.kernels[:n].tolist(), _us_array(self.kernel_ns[:n]).tolist(),
                _us_array(self.span_ns[:n]).tolist(),
                _us_array(self.span_ns[:n] - self.busy_ns[:n]).tolist(), per_class,
                strict=True):
            row.update(kernels=k, kernel_us=ku, span_us=su, gap_us=gu, classes=pc)
        return rows

    def briefs(self, first: int) -> list[dict[str, Any]]:
        """``kernels``, ``kernel_us`` and ``span_us`` of the segments from ``first`` on."""
        return [{"kernels": k, "kernel_us": ku, "span_us": su} for k, ku, su in zip(
            self.kernels[first:].tolist(), _us_array(self.kernel_ns[first:]).tolist(),
            _us_array(self.span_ns[first:]).tolist(), strict=True)]


class LayerRows(Sequence[dict[str, Any]]):
    """A breakdown's per-layer rows, held as columns and built as dicts when read.

    As dicts, 40k layers take about 90 MB (2 kB each), more than the trace they came from; as
    columns, a few MB. Reading a row (indexing, iterating) builds exactly the dict
    ``SegmentFigures.stats`` gives: its head (step, device, index, type), then the figures.
    """

    _CHUNK = 4096   # rows converted to Python values at a time when iterating

    def __init__(self, heads: list[tuple[int, int, int, str]], figures: SegmentFigures,
                 first: int, labels: list[str]):
        n = len(heads)
        types: dict[str, int] = {}
        # (the layer's index in its step not as ``index``: a sequence's method of that name)
        self.step, self.device, self.layer_index = (
            np.array([h[i] for h in heads], np.int64) for i in range(3))
        self.type_code = np.array([types.setdefault(h[3], len(types)) for h in heads],
                                  np.int32)
        self.types = list(types)
        rows = slice(first, first + n)
        by_label = sorted(range(len(labels)), key=labels.__getitem__)
        self.labels = [labels[c] for c in by_label]
        self.kernels = figures.kernels[rows]
        self.kernel_us = _us_array(figures.kernel_ns[rows])
        self.span_us = _us_array(figures.span_ns[rows])
        self.gap_us = _us_array(figures.span_ns[rows] - figures.busy_ns[rows])
        self.class_kernels = figures.class_kernels[rows][:, by_label]
        self.class_us = figures.class_us[rows][:, by_label]

    def __len__(self) -> int:
        return len(self.kernels)

    def __repr__(self) -> str:
        return f"LayerRows({len(self)} layers of types {', '.join(self.types) or 'none'})"

    def __getitem__(self, i):
        if isinstance(i, slice):   # as a list slices (a slice's stop of -1 would not)
            return list(self._rows(np.arange(len(self))[i]))
        if isinstance(i, str):   # (a row's field: layer_column gives a column)
            raise TypeError(f"layers[{i!r}]: the layers are rows, indexed by number "
                            "(layer_column(layers, NAME) gives a figure's column)")
        try:
            i = range(len(self))[i]   # negative indices
        except IndexError:
            raise IndexError(f"layer {i} of {len(self)}: out of range") from None
        return next(self._rows(slice(i, i + 1)))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for lo in range(0, len(self), self._CHUNK):
            yield from self._rows(slice(lo, min(lo + self._CHUNK, len(self))))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other,
                                                                        strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def _rows(self, sel: slice | np.ndarray) -> Iterator[dict[str, Any]]:
        counts, us = self.class_kernels[sel].tolist(), self.class_us[sel].tolist()
        for step, device, index, t, k, ku, su, gu, cnt, u in zip(
                self.step[sel].tolist(), self.device[sel].tolist(), self.layer_index[sel].tolist(),
                self.type_code[sel].tolist(), self.kernels[sel].tolist(),
                self.kernel_us[sel].tolist(), self.span_us[sel].tolist(),
                self.gap_us[sel].tolist(), counts, us, strict=True):
            yield {"step": step, "device": device, "index": index, "type": self.types[t],
                   "kernels": k, "kernel_us": ku, "span_us": su, "gap_us": gu,
                   "classes": {label: {"kernels": c, "us": x}
                               for label, c, x in zip(self.labels, cnt, u, strict=True) if c}}


LAYER_COLUMNS = ("step", "device", "index", "kernels", "kernel_us", "span_us", "gap_us")


def layer_column(layers: Sequence[dict[str, Any]], name: str, layer_type: str | None = None
                 ) -> np.ndarray:
    """One figure of every layer (``LAYER_COLUMNS``), or of the layers of one type, in order:
    the column itself for ``LayerRows``, with no dict built per layer; else from the rows (a
    breakdown read from JSON), of the same dtype, but float with NaN where a row lacks the
    figure; empty for a type no layer has."""
    if isinstance(layers, Breakdown):
        raise TypeError("layer_column takes a breakdown's layers (b.layers), not the Breakdown")
    if name not in LAYER_COLUMNS:
        raise ValueError(f"no layer column {name!r} (one of {', '.join(LAYER_COLUMNS)})")
    if isinstance(layers, LayerRows):
        values = getattr(layers, "layer_index" if name == "index" else name)
        if layer_type is None:
            view = values.view()
            view.flags.writeable = False    # the breakdown's own column: read, not written
            return view
        code = layers.types.index(layer_type) if layer_type in layers.types else -1
        return values[layers.type_code == code]
    values = [r.get(name) for r in layers if layer_type is None or r["type"] == layer_type]
    counts = name in ("step", "device", "index", "kernels")   # as LayerRows holds them
    return np.array(values, np.int64 if counts and None not in values else np.float64)


def class_column(layers: Sequence[dict[str, Any]], kernel_class: str, layer_type: str
                 ) -> np.ndarray:
    """The µs of one kernel class in every layer of a type, in order (as ``layer_column``
    gives a figure), 0.0 where a layer ran none of it."""
    if isinstance(layers, LayerRows):
        code = layers.types.index(layer_type) if layer_type in layers.types else -1
        of_type = layers.type_code == code
        if kernel_class not in layers.labels:
            return np.zeros(int(of_type.sum()), np.float64)
        return layers.class_us[of_type, layers.labels.index(kernel_class)].astype(np.float64)
    return np.array([float(((r.get("classes") or {}).get(kernel_class) or {}).get("us", 0.0))
                     for r in layers if r["type"] == layer_type], np.float64)


def layer_classes(layers: Sequence[dict[str, Any]], layer_type: str) -> list[str]:
    """The kernel classes the layers of a type ran, sorted."""
    if isinstance(layers, LayerRows):
        code = layers.types.index(layer_type) if layer_type in layers.types else -1
        ran = layers.class_kernels[layers.type_code == code].any(axis=0)
        return [label for label, r in zip(layers.labels, ran.tolist(), strict=True) if r]
    return sorted({c for r in layers if r["type"] == layer_type
                   for c, v in (r.get("classes") or {}).items() if v.get("kernels")})


def layer_of_type(layers: Sequence[dict[str, Any]], layer_type: str, n: int) -> dict[str, Any]:
    """The ``n``-th layer of a type, in order (as ``layer_column`` gives its figures), built as
    one row."""
    if isinstance(layers, LayerRows):
        code = layers.types.index(layer_type)
        return layers[int(np.flatnonzero(layers.type_code == code)[n])]
    return next(itertools.islice((r for r in layers if r["type"] == layer_type), n, None))


def _bincount_int(key: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Exact int64 sums of ``values`` per ``key`` in [0, n)."""
    if len(values) == 0 or float(np.abs(values.astype(np.float64)).sum()) < 2.0 ** 52:
        # Every partial sum is an integer below 2**53: float64 adds them exactly.
        return np.bincount(key, weights=values, minlength=n).astype(np.int64)
    order = np.argsort(key, kind="stable")
    k = key[order]
    cut = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    out = np.zeros(n, np.int64)
    out[k[cut]] = np.add.reduceat(values[order], cut)
    return out


def _segmented_union_length(start: np.ndarray, end: np.ndarray, seg: np.ndarray,
                            first: np.ndarray) -> np.ndarray:
    """``_union_length`` of each run of rows with one ``seg`` value (runs start at ``first``,
    segment numbers ascend): one pass for all segments."""
    if len(first) == 0:
        return np.empty(0, np.int64)
    if ((start[1:] < start[:-1]) & (seg[1:] == seg[:-1])).any():
        order = np.lexsort((start, seg))     # stable: ties keep their order
        start, end = start[order], end[order]
    # Shift each segment into its own band of values, above every earlier segment's, so that
    # one running maximum over all rows restarts at each segment.
    lo = np.minimum.reduceat(np.minimum(start, end), first)
    hi = np.maximum.reduceat(np.maximum(start, end), first)
    width = hi.astype(np.float64) - lo.astype(np.float64) + 1
    bounds = np.r_[first, len(start)]
    if width.sum() >= 2.0 ** 61:      # bands would overflow int64: one segment at a time
        return np.array([_union_length(start[a:b], end[a:b])
                         for a, b in itertools.pairwise(bounds.tolist())], np.int64)
    width = hi - lo + 1
    run = np.repeat(np.arange(len(first)), np.diff(bounds))
    base, lo = (np.cumsum(width) - width)[run], lo[run]
    running_end = np.maximum.accumulate((end - lo) + base)
    new_block = np.r_[True, ((start - lo) + base)[1:] > running_end[:-1]]
    block = np.flatnonzero(new_block)
    block_len = np.maximum.reduceat(end, block) - start[block]
    # Every segment's first row starts a block.
    return np.add.reduceat(block_len, np.searchsorted(block, first))


def _union_length(start: np.ndarray, end: np.ndarray) -> int:
    """Total length of the union of intervals (overlapping streams count once)."""
    if len(start) == 0:
        return 0
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    running_end = np.maximum.accumulate(e)
    # A new busy block starts where an op starts after everything before it has ended.
    new_block = np.flatnonzero(np.r_[True, s[1:] > running_end[:-1]])
    block_end = np.maximum.reduceat(e, new_block)
    return int((block_end - s[new_block]).sum())


def _us(ns) -> float:
    return round(float(ns) / 1000.0, 3)


def _us_array(ns: np.ndarray) -> np.ndarray:
    """``_us`` of every element of an int64 array, as a float64 array.

    ``round(x, 3)`` is the double nearest to x rounded to 3 decimals. For x = ns / 1000 with
    |x| < 2**42 (half an ulp < 0.0005) that decimal is ns / 1000 exactly, whose nearest double
    is x itself: rounding changes nothing. Larger values take Python's ``round``.
    """
    us = np.asarray(ns, np.int64) / 1000.0
    big = np.flatnonzero(np.abs(us) >= 2.0 ** 41)
    if len(big):
        flat = us.reshape(-1)
        flat[big] = [round(x, 3) for x in flat[big].tolist()]
    return us


def breakdown_of_file(path: str | Path, capture: str | Path | None = None, layers: str = "auto",
                      rules: list[Rule] | str | Path | None = None,
                      step_regex: str | None = None, phase: str = "auto") -> Breakdown:
    """``breakdown`` (its options) of the trace ``path`` holds, joined by its graph
    ``capture`` (``read_trace``); an option that selects nothing is said of ``path`` itself,
    not of the file its trace came from (a .kptrace's)."""
    from kimi_perf.readers import read_trace

    try:
        return breakdown(read_trace(path, capture=capture), layers=layers, rules=rules,
                         step_regex=step_regex, phase=phase)
    except (NoStepsMatched, NoGpuWork) as exc:
        raise type(exc)(path, exc.problem) from None


@contextlib.contextmanager
def _said_untimed_ranges(trace: Trace) -> Iterator[None]:
    """A step or layer asked for and not found says so of the trace's ranges without a time
    (left out on reading: a step range among them would be why)."""
    try:
        yield
    except NoStepsMatched as exc:
        if not (untimed := trace.meta.get("untimed_ranges")):
            raise
        raise NoStepsMatched(exc.path, f"{exc.problem} ({counted(untimed, 'range')} without a "
                                       "time, a missing or negative dur, left out)") from None


def breakdown(trace: Trace, layers: str = "auto", rules: list[Rule] | str | Path | None = None,
              step_regex: str | None = None, phase: str = "auto") -> Breakdown:
    """Steps, layers and layer types of ``trace`` (``breakdown`` in docs/reference.md).

    ``layers``: how layers are found (``auto``: per-layer ranges when the trace has them,
    else the repeating kernel pattern; ``nvtx``, ``nvtx:REGEX``: ranges only; ``repeat``);
    ``rules``: kernel classes (``load_rules``' list, or a TOML file of rules to put before the
    defaults; a class of one's own relabels the figures, not the layers: ``GpuOps``);
    ``step_regex``: the ranges that are steps (default: the step names of
    ``kimi_perf.layers.STEP_PATTERNS``, else graph launches or forward passes); ``phase``:
    which steps count (``kimi_perf.layers.steps_of_phase``; by default the decode steps of a
    trace whose steps are decode and prefill or mixed). The steps left out are counted per
    phase in ``source["steps_left_out"]``."""
    if not isinstance(trace, Trace):
        raise TypeError(f"breakdown takes a Trace (read_trace(path)), not {type(trace).__name__}"
                        + ("; breakdown_of_file(path) reads and breaks down a file"
                           if isinstance(trace, str | Path) else ""))
    if not isinstance(layers, str):
        raise TypeError(f"layers: auto, repeat, nvtx or nvtx:REGEX, not {layers!r}")
    if isinstance(rules, str | Path):
        rules = load_rules(rules)
    elif rules is not None and not (isinstance(rules, list)
                                    and all(isinstance(r, Rule) for r in rules)):
        raise TypeError(f"rules: load_rules' list, or a TOML file's path, not {rules!r}")
    ops = GpuOps.of(trace, rules)
    if not len(ops):
        raise NoGpuWork(trace.meta.get("file"), _no_gpu_work_problem(trace))
    release_free_memory()
    with _said_untimed_ranges(trace):
        steps = find_steps(trace, ops, step_regex)
    labels, ops_kind = ops.class_labels, ops.kind
    # No step range and no graph launch: each device is one step. Say which ranges could be.
    found_by = steps[0].found_by if steps else None
    repeating = repeating_ranges(trace) if found_by == "device" else []
    outside_steps = _outside_steps(trace, ops, steps)
    replays = (graph_replays(trace, ops.api, ops.scope_api) if ops_kind == "gpu"
               else {"ops": 0})
    # a profile of graph captures alone (vLLM profiles its capture at start-up apart from
    # the decode steps that replay it): what it is, for --capture
    captures = (capture_count(trace) if ops_kind == "gpu" and not replays["ops"]
                and not trace.meta.get("captures") else 0)
    with _said_untimed_ranges(trace):
        steps, left_out = steps_of_phase(steps, phase, trace.meta.get("file"))
    enclosing = _enclosing_steps(steps)
    release_free_memory()
    with _said_untimed_ranges(trace):
        cut = find_layers(trace, ops, steps, layers)
    # ranges named like layers, but not as the default pattern spells them: why none was taken
    layer_like = (layer_like_ranges(trace) if layers == "auto"
                  and not any(step.layer_source == "nvtx" for step in steps) else None)
    if cut:   # parts of the forward passes the trace begins or ends within: in no step
        rows = np.concatenate([part.ops for part in cut])
        outside_steps["ops"] += len(rows)
        outside_steps["kernel_us"] = round(outside_steps["kernel_us"] + _us(
            int((ops.end[rows] - ops.start[rows]).sum())), 3)
        outside_steps["partial_passes"] = {"parts": len(cut), "ops": len(rows)}
    pass_ranges = []
    if any(step.found_by == "pass" for step in steps):   # the forward passes a device ran
        found_by = "pass"
        pass_ranges = _pass_ranges(trace, ops, steps)
    holding_passes = _steps_holding_passes(ops, steps)
    all_layers = [(step, layer) for step in steps for layer in step.layers]
    # Segments: every step, every layer, then the steps' prologues and epilogues.
    segments = [step.ops for step in steps] + [layer.ops for _, layer in all_layers]
    segments += [step.prologue for step in steps] + [step.epilogue for step in steps]
    figures = SegmentFigures.of(ops, segments, ops.kernel_class, labels)
    n_steps, n_layers = len(steps), len(all_layers)
    step_heads = [{"index": step.index, "device": step.device, "pid": step.pid,
                   "name": step.name, "phase": step_phase(step.name),
                   "layer_source": step.layer_source,
                   "layers": len(step.layers), "other_thread_ops": step.other_thread_ops}
                  for step in steps]
    other_thread_ops = sum(step.other_thread_ops for step in steps)
    layer_heads = [(step.index, step.device, layer.index, layer.type)
                   for step, layer in all_layers]
    typical = _typical_layers(trace, ops, steps)
    timeline = _timeline(trace, ops, steps)
    del ops, steps, all_layers, segments
    release_free_memory()
    step_rows = figures.stats(labels, step_heads)
    briefs = figures.briefs(n_steps + n_layers)
    for row, prologue, epilogue in zip(step_rows, briefs[:n_steps], briefs[n_steps:],
                                       strict=True):
        row.update(prologue=prologue, epilogue=epilogue)
    layer_rows = LayerRows(layer_heads, figures, n_steps, labels)
    # On a CPU an op's time is the host's (Python, the interpreter), whose noise alone splits
    # layers in two: only GPU kernels' times say the layers do different work.
    layer_types = _layer_types(layer_rows, typical,
                               two_groups(layer_rows) if ops_kind == "gpu" else {})
    return Breakdown(source={**_source(trace), "ops": ops_kind,
                             "outside_steps": outside_steps,
                             "other_thread_ops": other_thread_ops,
                             "steps_left_out": left_out, "steps_found_by": found_by,
                             **({"graph_replays": replays} if replays["ops"] else {}),
                             **({"graph_captures": captures} if captures else {}),
                             "repeating_ranges": repeating,
                             **({"pass_ranges": pass_ranges} if pass_ranges else {}),
                             **({"steps_holding_passes": holding_passes}
                                if holding_passes else {}),
                             "enclosing_steps": enclosing,
                             **({"layer_like_ranges": layer_like} if layer_like else {}),
                             # (what the gate tells two breakdowns apart by)
                             "breakdown_options": {
                                 "layers": layers, "steps": step_regex, "phase": phase,
                                 "rules": rules_said(rules),
                                 "layout_rules": layout_rules_said(rules),
                                 "default_rules": default_rules_said()}},
                     steps=step_rows,
                     layers=layer_rows, layer_types=layer_types, timeline=timeline)


def _no_gpu_work_problem(trace: Trace) -> str:
    """Why a trace has nothing to break down, and what it does hold: an empty table would
    pass for a result (a profile that recorded no GPU activity)."""
    untimed = trace.meta.get("untimed") or {}
    untimed = untimed.get("kernels", 0) + untimed.get("memops", 0)
    held = [f"{counted(untimed, 'GPU op')} without a time"] if untimed else []
    held += [counted(n, what) for n, what in ((len(trace.ranges), "range"),
                                               (len(trace.api), "API call")) if n]
    nsys = "Nsight" in str(trace.meta.get("tool") or "")
    return ("no GPU work in this trace: no kernel or memcpy/memset, and no op: ranges of a "
            "decode run on a CPU; nothing to break down (it holds "
            + (", ".join(held) or "no range or API call either"
               + (": profiled without -t cuda,nvtx?" if nsys else "")) + ")")


def _outside_steps(trace: Trace, ops: GpuOps, steps: list[Step]) -> dict[str, Any]:
    """The work no step holds (launched outside the step ranges, or with no launch in the
    trace), reported, never silently dropped: its ops, µs, and the outermost ranges it was
    launched in."""
    outside = np.ones(len(ops), bool)
    for step in steps:
        outside[step.ops] = False
    launched = np.flatnonzero(outside & (ops.api >= 0))
    found = {"ops": int(outside.sum()),
             "kernel_us": _us(int((ops.end[outside] - ops.start[outside]).sum())),
             "unlaunched": int((outside & (ops.api < 0)).sum()),
             "in_ranges": outermost_ranges(trace, ops, launched)}
    if during := _launched_during_overlapping_steps(trace, ops, steps, launched):
        found["during_overlapping_steps"] = during
    return found


def _launched_during_overlapping_steps(trace: Trace, ops: GpuOps, steps: list[Step],
                                       launched: np.ndarray) -> int:
    """Of the ops outside every step, those launched (by another thread: a step holds its own
    thread's) while a step range of their process was open: left out because that process's
    step ranges overlap, so that no one step's window is theirs (``layers``' rule)."""
    rows = np.unique([s.range_row for s in steps if s.range_row >= 0]).astype(np.int64)
    if not len(rows) or not len(launched):
        return 0
    r, count = trace.ranges, 0
    for pid in np.unique(r.pid[rows]).tolist():
        mine = rows[r.pid[rows] == pid]
        mine = mine[np.argsort(r.start[mine], kind="stable")]
        reach = np.maximum.accumulate(r.end[mine])   # (the latest end open by each start)
        theirs = launched[ops.pid[launched] == pid]
        start, end = ops.launch_start[theirs], ops.launch_end[theirs]   # (a CPU op's own)
        at = np.searchsorted(r.start[mine], start, side="right") - 1
        count += int(((at >= 0) & (reach[np.maximum(at, 0)] >= end)).sum())
    return count


def _enclosing_steps(steps: list[Step]) -> list[dict[str, Any]]:
    """Step ranges around other step ranges, one entry per range (a step per device it ran
    on), with the ops they hold between the inner ones."""
    enclosing: dict[int, dict[str, Any]] = {}
    for s in steps:
        if s.encloses:
            enclosing.setdefault(s.range_row, {"step": s.name, "index": s.index,
                                               "device": s.device, "encloses": s.encloses,
                                               "ops": 0})["ops"] += len(s.ops)
    return list(enclosing.values())


def _steps_holding_passes(ops: GpuOps, steps: list[Step]) -> list[dict[str, Any]]:
    """Step ranges around several forward passes (a benchmark's whole loop): the user's
    steps, whose passes show in their layer types (the one that ends a pass holds the LM
    head)."""
    return [{"step": step.name, "layers": cycle.period, "passes": passes}
            for step in steps if step.found_by == "range" and step.layer_source == "repeat"
            and (cycle := layer_cycle(ops, step)) is not None
            and (passes := sum(pass_cuts(ops, step, cycle)[1])) > 1]


def _layer_types(layer_rows: LayerRows, typical: dict[str, dict],
                 groups: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each layer type's medians, with its kernel pattern, its typical layer and, where its
    layers split in two by their time, the two groups."""
    layer_types = _layer_type_medians(layer_rows)
    for t in layer_types:
        layer = typical.get(t["type"], {})
        if "pattern" in layer:
            t["pattern"] = layer.pop("pattern")
        if layer:
            t["typical_layer"] = layer
        if groups.get(t["type"]):
            t["two_groups"] = groups[t["type"]]
    return layer_types


def _pass_ranges(trace: Trace, ops: GpuOps, passes: list[Step]) -> list[dict[str, Any]]:
    """Where forward passes found without a step range ran, where they ran in different
    ranges (a warm-up pass, model loading in the first pass's prologue): per set of range
    names (every number in them folded: ``iteration 7`` is each pass's own), its passes and
    the first one's ops per range; nothing where all ran alike."""
    rows = [step.ops[ops.api[step.ops] >= 0] for step in passes]
    codes = outermost_names(trace, ops, np.concatenate(rows) if rows else np.empty(0, int))
    groups: dict[tuple, dict[str, Any]] = {}
    for step, mine in zip(passes, np.split(codes, np.cumsum([len(r) for r in rows])[:-1]),
                          strict=True):
        ranges = ranges_named(trace, mine)
        key = tuple(sorted(re.sub(r"\d+", "#", str(r["range"])) for r in ranges))
        groups.setdefault(key, {"steps": [], "in_ranges": ranges})["steps"].append(step.name)
    return list(groups.values()) if len(groups) > 1 else []


def repeating_ranges(trace: Trace, most: int = 3) -> list[dict[str, Any]]:
    """The annotation ranges that ran more than once and hold a quarter of the kernels or
    more, the most kernels first: what ``--steps REGEX`` could make the steps of a trace whose
    steps the defaults do not find (a training loop's ``Forward``). Ranges inside layers
    (``computing softmax``) hold too few; the profiler's operator ranges (``cpu_op:``) are
    no steps."""
    from kimi_perf.attribution import range_kernel_columns

    # per range name: its most instances on one thread and style, and all its kernels (from
    # the summary's columns: a name per range, as emit_nvtx gives them, is millions of rows)
    summary = range_kernel_columns(trace)
    named = summary.range >= 0
    codes, row_code = np.unique(summary.range[named], return_inverse=True)
    instances = np.zeros(len(codes), np.int64)
    np.maximum.at(instances, row_code, summary.range_instances[named])
    kernels = np.bincount(row_code, summary.kernel_instances[named], minlength=len(codes))
    found: dict[str, list[int]] = {}
    for code, n, k in zip(codes.tolist(), instances.tolist(), kernels.tolist(), strict=True):
        name = trace.strings[code]
        if not name.startswith("cpu_op:"):   # (one name, one code: merged all the same)
            was = found.setdefault(name, [0, 0])
            found[name] = [max(was[0], n), was[1] + int(k)]
    outer = _outermost_instances(trace, [name for name, (n, _) in found.items() if n >= 2])
    found = {name: (outer.get(name, n), k) for name, (n, k) in found.items()}
    ranked = sorted(((n, k, name) for name, (n, k) in found.items()
                     if n >= 2 and 4 * k >= len(trace.kernels)), key=lambda x: (-x[1], x[2]))
    return [{"range": name, "instances": n, "kernels": k} for n, k, name in ranked[:most]]


def _outermost_instances(trace: Trace, names: list[str]) -> Counter:
    """How many times each range name ran, not counting an instance inside another of its
    name on its thread (a model's ``forward`` range opened again by a wrapper within it): as
    steps, nested ones are one step, not two. Names the trace's ranges lack are left out."""
    wanted = set(names)
    code_of = {code: name for code, name in enumerate(trace.strings) if name in wanted}
    r = trace.ranges
    # (a profiler's GPU-side copy of a range, on its stream, is no instance: attribution
    # counts the CPU ranges alone)
    rows = np.flatnonzero(np.isin(r.name, list(code_of)) & (r.style != GPU_RANGE))
    out: Counter = Counter()
    if not len(rows):
        return out
    keys = range_groups(r)[rows]
    order = np.lexsort((-r.end[rows], r.start[rows], keys, r.name[rows]))
    rows, keys = rows[order], keys[order]
    cuts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1])
                                | (r.name[rows][1:] != r.name[rows][:-1]), True])
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        ends = r.end[rows[lo:hi]]
        # in start order, a range that ends by the latest end before it lies inside that one
        inside = ends[1:] <= np.maximum.accumulate(ends)[:-1]
        out[code_of[int(r.name[rows[lo]])]] += hi - lo - int(inside.sum())
    return out


# Ops a timeline holds at most: a decode step of ~100 layers is a few thousand; a training
# step's or a profiler window's hundreds of thousands would make a report of tens of MB that
# a browser struggles to draw.
TIMELINE_OPS = 10_000


def _timeline(trace: Trace, ops: GpuOps, steps) -> dict[str, Any] | None:
    """One step to draw op by op (the report's timeline), so that drawing needs no trace: of
    the steps with layers, the one of median span; its prologue, layers, epilogue and the
    ops that ran between its layers (in no layer: another thread's, say), each op as
    [index into ``names``, class, µs from the step's first op, µs]. Of a step of more than
    ``TIMELINE_OPS`` ops, the first so many (``ops_left_out``: how many more).

    Where no step has layers (a trace of other work: training, a benchmark), of all the steps
    the one of median span, its first ``TIMELINE_OPS`` ops a segment per stream in the order
    the streams start (``by_stream``): what overlapped what."""
    with_layers = [s for s in steps if s.layers]
    candidates = with_layers or [s for s in steps if len(s.ops)]
    if not candidates:
        return None
    spans = [int(ops.end[s.ops].max() - ops.start[s.ops].min()) for s in candidates]
    step = candidates[int(np.argsort(spans, kind="stable")[len(spans) // 2])]
    t0 = ops.start[step.ops].min()
    if with_layers:
        parts = _layer_parts(step)
        room, left_out = TIMELINE_OPS, 0
        for i, (label, rows) in enumerate(parts):
            left_out += max(0, len(rows) - room)
            parts[i] = (label, rows[:room])
            room -= len(parts[i][1])
    else:
        rows = step.ops[:TIMELINE_OPS]   # (in GPU start order: the first in time)
        left_out = len(step.ops) - len(rows)
        parts = _stream_parts(ops, rows)
    codes = np.unique(np.concatenate([ops.name[rows] for _, rows in parts]))
    segments = []
    for label, rows in parts:
        if not len(rows):
            continue
        names = np.searchsorted(codes, ops.name[rows]).tolist()
        classes = [ops.class_labels[c] for c in ops.kernel_class[rows].tolist()]
        starts = _us_array(ops.start[rows] - t0).tolist()
        durations = _us_array(ops.end[rows] - ops.start[rows]).tolist()
        segments.append({"label": label, "ops": [
            list(op) for op in zip(names, classes, starts, durations, strict=True)]})
    return {"step": step.name, "names": [trace.strings[c] for c in codes.tolist()],
            "segments": segments, **({"ops_left_out": left_out} if left_out else {}),
            **({} if with_layers else {"by_stream": True})}


def _layer_parts(step) -> list[tuple[str, np.ndarray]]:
    """A step's rows by segment: prologue, each layer, epilogue, and the ops between its
    layers (in none of them)."""
    parts = [("prologue", step.prologue)] + [
        (f"layer {layer.index} ({layer.type})", layer.ops) for layer in step.layers]
    between = step.ops[~np.isin(step.ops, np.concatenate([rows for _, rows in parts]
                                                          + [step.epilogue]))]
    return [*parts, ("epilogue", step.epilogue), ("between layers", between)]


def _stream_parts(ops: GpuOps, rows: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """``rows`` (of one step: one device; in start order) by stream, the streams in the order
    of their first op (of processes sharing the device, by process and stream: each has its
    own stream 7); CPU ops (no stream) as one segment."""
    if ops.kind != "gpu":
        return [("ops", rows)]
    pids = ops.pid[rows].astype(np.int64)
    several = len(np.unique(pids)) > 1
    keys = np.stack([pids, ops.stream[rows]], axis=1)
    lanes, first, of_row = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    of_row = of_row.ravel()
    return [((f"pid {pid} " if several else "")
             + (f"stream {stream}" if stream >= 0 else "no stream"), rows[of_row == lane])
            for lane in np.argsort(first).tolist() for pid, stream in [lanes[lane].tolist()]]


def _typical_layers(trace: Trace, ops: GpuOps, steps) -> dict[str, dict[str, Any]]:
    """Per layer type, its typical layer: the kernel sequence most of its layers ran, each
    kernel with its median µs over the layers that ran exactly that sequence (how a layer's
    time splits, kernel by kernel: the view that proves a fusion).

    For a type lettered by its kernel sequence (found by the repeating kernel pattern, or of
    ranges that name no type) also ``pattern``, a digest of that sequence: the letters (A, B,
    ...) follow the order of first appearance, so two traces' "A" are the same layer only when
    their digests agree (``compare``, ``gate``). The pattern's digest is of the sequence's
    least rotation: a pattern that cut the same cycle of kernels at another kernel (the layers
    start at the attention in one trace, at a norm in the other) found the same layer; ranges'
    is of the sequence as it ran (its order a change of the layer's)."""
    sequences: dict[str, list[bytes]] = {}   # the name codes' bytes: 4-8 B per op
    layer_ops: dict[str, list[np.ndarray]] = {}
    lettered: dict[str, bool] = {}   # each lettered type: whether the pattern cut it
    for step in steps:
        for layer in step.layers:
            sequences.setdefault(layer.type, []).append(ops.name[layer.ops].tobytes())
            layer_ops.setdefault(layer.type, []).append(layer.ops)
            if layer.lettered:
                lettered[layer.type] = (lettered.get(layer.type, False)
                                        or step.layer_source == "repeat")
    out = {}
    for t, keys in sequences.items():
        typical, count = Counter(keys).most_common(1)[0]
        rows = np.stack([r for k, r in zip(keys, layer_ops[t], strict=True) if k == typical])
        durations = ops.end[rows] - ops.start[rows]
        median_ns = np.median(durations, axis=0)
        names = np.frombuffer(typical, ops.name.dtype).tolist()
        classes = ops.kernel_class[rows[0]].tolist()
        out[t] = {"layers": count, "kernels": [
            {"name": trace.strings[n], "class": ops.class_labels[c], "us": _us(int(ns))}
            for n, c, ns in zip(names, classes, median_ns.round().tolist(), strict=True)]}
        if ops.kind == "gpu":   # (a CPU op's time spreads with the host's load)
            for kernel, spread in zip(out[t]["kernels"], kernel_spreads(durations),
                                      strict=True):
                if spread is not None:
                    kernel["spread_us"] = spread
        if t in lettered:
            cycle = [trace.strings[n] for n in names]
            start = least_rotation(cycle) if lettered[t] else 0   # (ranges: as it ran)
            out[t]["pattern"] = hashlib.sha1("\0".join(cycle[start:] + cycle[:start]).encode(),
                                             usedforsecurity=False).hexdigest()[:12]
    return out


# A GPU kernel whose time over the layers of its type spreads this much (its 90th percentile
# over its 10th), by a µs or more, does different work in different layers (sliding-window and
# full attention): one median does not describe it.
SPREAD = 1.5
SPREAD_MIN_LAYERS = 4


def kernel_spreads(durations: np.ndarray) -> list[list[float] | None]:
    """Per kernel (a column of ``durations`` [layers, kernels], ns), its [10th, 90th]
    percentile µs over the layers where they spread SPREAD-fold or more, else None."""
    if len(durations) < SPREAD_MIN_LAYERS:
        return [None] * durations.shape[1]
    low, high = np.percentile(durations, [10, 90], axis=0)
    wide = (high >= SPREAD * low) & (high - low >= 1000)
    return [[_us(round(lo)), _us(round(hi))] if w else None
            for lo, hi, w in zip(low.tolist(), high.tolist(), wide.tolist(), strict=True)]


SPREAD_NOTE = ("(a-b): the 10th to 90th percentile of a GPU kernel's µs over the layers, where "
               "it spreads 1.5-fold or more: its work varies from layer to layer "
               "(sliding-window against full attention, MoE experts as routing loads them), "
               "and one median does not describe it")


def spread_text(kernel: dict) -> str:
    """A typical layer's kernel's µs: its median, with its spread where it has one."""
    spread = kernel.get("spread_us")
    return f"{kernel['us']:.1f}" + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")


def least_rotation(names: list[str]) -> int:
    """Where the least rotation of a sequence starts (each candidate begins with its least
    name, so few are compared)."""
    low = min(names)
    return min((r for r, name in enumerate(names) if name == low),
               key=lambda r: names[r:] + names[:r])


def _layer_type_medians(rows: LayerRows) -> list[dict]:
    """Per layer type, the median of each figure over all its layers in all steps (of the
    rows' rounded values), one numpy median per column (the tests hold it to medians of the
    rows as dicts)."""
    columns = {"kernels": rows.kernels, "kernel_us": rows.kernel_us, "span_us": rows.span_us,
               "gap_us": rows.gap_us}
    out = []
    for t, kind in enumerate(rows.types):
        sel = rows.type_code == t
        counts, us = rows.class_kernels[sel], rows.class_us[sel]
        present = np.flatnonzero(counts.any(axis=0)).tolist()
        out.append({
            "type": kind, "layers": int(sel.sum()),
            **{key: _median(col[sel]) for key, col in columns.items()},
            "classes": {rows.labels[c]: {"kernels": _median(counts[:, c]),
                                         "us": _median(us[:, c])} for c in present},
        })
    return out


# Classes whose µs measure waiting as much as work: a collective's kernel spins until every
# rank arrives, so its time splits by rank skew, not by what the layer does.
_WAITING_CLASSES = ("communication",)


def two_groups(rows: LayerRows, min_ratio: float = 1.5, min_share: float = 0.25,
               min_of_span: float = 0.02) -> dict[str, list[dict[str, Any]]]:
    """Per layer type, the kernel classes whose µs fall in two groups by layer: layers that
    run the same kernels for different work, such as sliding-window and full attention
    alternating. Each layer's value is its median over the steps; sorted, the widest relative
    gap splits them, and counts where the upper group's smallest is ``min_ratio`` times the
    lower's largest, each group holds ``min_share`` of the layers and two at least, and the
    groups' medians differ by ``min_of_span`` of the type's median span at least (so that a
    1 µs kernel doubling says nothing). Kernel time only: a span also holds the host's stalls,
    and a collective's time its wait for the other ranks. ``median_between``: whether the
    type's median falls between the groups (is of neither)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for code, kind in enumerate(rows.types):
        sel = np.flatnonzero(rows.type_code == code)
        index, where = np.unique(rows.layer_index[sel], return_inverse=True)
        if len(index) < 4:
            continue
        order = np.argsort(where, kind="stable")
        cuts = np.flatnonzero(np.diff(where[order])) + 1
        span = float(np.median(rows.span_us[sel]))
        found = []
        for c, figure in enumerate(rows.labels):
            values = rows.class_us[sel, c]
            if figure in _WAITING_CLASSES or not rows.class_kernels[sel, c].any():
                continue
            per_layer = np.array([np.median(v) for v in np.split(values[order], cuts)])
            ranked = np.argsort(per_layer, kind="stable")
            v = per_layer[ranked]
            lo_n = max(2, int(np.ceil(min_share * len(v))))
            candidates = np.arange(lo_n, len(v) - lo_n + 1)  # the first index of the upper
            if not len(candidates) or v[candidates - 1].min() <= 0:
                continue
            gaps = v[candidates] / v[candidates - 1]
            best = int(candidates[np.argmax(gaps)])
            low, high = np.median(v[:best]), np.median(v[best:])
            if gaps.max() < min_ratio or high - low < min_of_span * span:
                continue
            median = float(np.median(values))
            # (each layer's count its median over the steps, the lower of two middle ones:
            # one step's extra kernel makes no layer of another kind, of two steps too)
            counts = np.array([np.percentile(n, 50, method="lower") for n in np.split(
                rows.class_kernels[sel, c][order], cuts)])
            found.append({"figure": figure, "low_us": _us_round(low),
                          "high_us": _us_round(high), "low_layers": best,
                          "high_layers": sorted(index[ranked[best:]].tolist()),
                          "median_between": bool(v[best - 1] < median < v[best]),
                          # (a type of other layers: ranges of two kinds under one name)
                          "kernels": [int(counts.min()), int(counts.max())]})
        out[kind] = sorted(found, key=lambda g: g["low_us"] - g["high_us"])
    return out


def _between_layers(b: Breakdown) -> int:
    """Ops of steps that have layers in none of them, nor in the step's prologue or epilogue,
    nor launched from another thread: work between two layers."""
    in_layers: Counter = Counter()
    kernels = layer_column(b.layers, "kernels")
    if len(kernels):
        pairs, which = np.unique(np.stack([layer_column(b.layers, "step"),
                                           layer_column(b.layers, "device")], axis=1),
                                 axis=0, return_inverse=True)
        sums = np.bincount(which.ravel(), weights=kernels, minlength=len(pairs))
        in_layers.update({(s, d): int(n) for (s, d), n in zip(pairs.tolist(), sums.tolist(),
                                                               strict=True)})
    return int(sum(max(0, s["kernels"] - s["prologue"]["kernels"] - s["epilogue"]["kernels"]
                       - in_layers[(s["index"], s["device"])] - (s.get("other_thread_ops") or 0))
                   for s in b.steps if s.get("layers") and "prologue" in s))


# The share of the steps' GPU time in copies and fills above which the notes say so.
COPIES_NOTED = 0.25


def layers_text(step: dict) -> str:
    """A step's layers and how they were found: "24 (ranges)" (NVTX ranges, or the
    record_function ranges of a PyTorch-profiler trace), "24 (repeat)"; of a breakdown stored
    before steps said how, or how many, what it has ("24", "-")."""
    count = step.get("layers")
    source = {"nvtx": "ranges"}.get(step.get("layer_source"), step.get("layer_source"))
    return ("-" if count is None else str(count)) + (f" ({source})" if source else "")


def step_part_text(step: dict, part: str) -> str:
    """A step's ``prologue`` or ``epilogue`` as tables show it: "kernels / span µs" ("-" of
    a breakdown stored before steps held them)."""
    p = step.get(part)
    return f"{p['kernels']} / {p['span_us']:.1f}" if isinstance(p, dict) else "-"


def replay_note(replays: dict, captures: list[str]) -> str:
    """What a breakdown says of the GPU ops graph launches ran: how many were placed where
    their capture launched them (joined from ``captures``: files, with ``--capture``), and
    how many where the graph launch was, for want of their capture."""
    placed, ops = replays.get("placed_at_capture", 0), replays["ops"]
    joined = f" (joined from {', '.join(captures)})" if captures else ""
    if placed == ops:
        return (f"{ops} GPU ops replayed from CUDA/HIP graphs are placed in the ranges open "
                f"where their capture launched them{joined}")
    said = (f"{placed} of {ops} GPU ops replayed from CUDA/HIP graphs are placed in the ranges "
            f"open where their capture launched them{joined}; the other {ops - placed}"
            ) if placed else f"{ops} GPU ops replayed from CUDA/HIP graphs"
    where = "in this trace or the captures joined" if captures else "in this trace"
    said += (f" have no capture {where} to place them in the ranges open then: they count "
             "where their graph launch ran (layers found by the kernels' repeating pattern "
             "are still found)")
    if captures:
        return said
    return (f"{said}. Where the capture ran inside per-layer ranges and was profiled apart, "
            "--capture joins it (breakdown's, convert's or trace --from's; convert --capture "
            "saves the pair as one .kptrace, which compare, gate and report read)")


def step_notes(b: Breakdown) -> list[str]:
    """What a reader of a breakdown's numbers must know about its steps, one sentence each:
    what they count in (work from other threads, between annotated layers, mostly copies and
    fills), what they leave out (work in no step, partial passes at the trace's edges, GPU work
    without a time), how they were found (passes in different ranges, a range holding several
    passes) and their phases (``phase_note``)."""
    src = b.source
    work = "GPU ops" if src.get("ops") == "gpu" else "ops"
    notes = [] if b.steps else [f"no {'GPU work' if work == 'GPU ops' else 'ops'} in this "
                                "trace"]
    if src.get("other_thread_ops"):
        notes.append(f"{src['other_thread_ops']} {work} launched from another thread while a "
                     "step's range was open are counted in that step (in no layer)")
    if replays := src.get("graph_replays"):
        notes.append(replay_note(replays, src.get("captures") or []))
    if captures := src.get("graph_captures"):
        notes.append(f"records {counted(captures, 'graph capture')} and replays none: a "
                     "profile of the captures, its kernels the runs around them; "
                     "--capture joins it to the trace that replays the graphs, placing their "
                     "kernels")
    notes += filter(None, (_outside_steps_note(b, work), _copies_note(b, work)))
    if between := _between_layers(b):
        notes.append(f"{between} {work} of steps with layers ran between their layers, in no "
                     "layer and neither before the first nor after the last (counted in their "
                     "step)")
    if untimed := src.get("untimed"):
        notes.append(f"{untimed.get('kernels', 0)} kernels and {untimed.get('memops', 0)} "
                     "memory operations without a time (CUPTI's start and end 0 for work it "
                     "could not time, or a corrupt record) are left out")
    if untimed_ranges := src.get("untimed_ranges"):
        notes.append(f"{counted(untimed_ranges, 'range')} without a time (a missing or "
                     "negative dur) left out: no step or layer is one of them")
    if duplicates := src.get("duplicates"):
        notes.append(f"{duplicates.get('kernels', 0)} kernels and "
                     f"{duplicates.get('memops', 0)} memory operations that repeat another "
                     "exactly (same name, times, device, stream and correlation) are left "
                     "out: the work ran once")
    if b.steps and all(s.get("layer_source") == "none" for s in b.steps):
        notes.append("no layers found: no range the default layer pattern matches (--layers "
                     "nvtx:REGEX takes ranges of your own) and no step repeats a kernel "
                     "pattern; the figures are of whole steps")
    elif bare := [s for s in b.steps if s.get("layer_source") == "none"]:
        # (eager steps with layer ranges, graph replays without: the types are of the first)
        names = [s.get("name") or f"step {s.get('index')}" for s in bare]
        shown = ", ".join(map(str, names[:3])) + (", …" if len(names) > 3 else "")
        notes.append(f"{len(bare)} of {counted(len(b.steps), 'step')} "
                     f"{'holds' if len(bare) == 1 else 'hold'} no layers ({shown}): "
                     f"{'its' if len(bare) == 1 else 'their'} work is in no layer type, and "
                     "the per-type figures are of the other steps' layers alone")
    if like := src.get("layer_like_ranges"):
        shown = ", ".join(f"'{name}'" for name in like["names"])
        more = ", …" if like["count"] > len(like["names"]) else ""
        found = ("so the layers are the kernel pattern's" if any(
            s.get("layer_source") == "repeat" for s in b.steps) else "so no layer was taken")
        notes.append(f"{counted(like['count'], 'range name')} like a layer's ({shown}{more}) "
                     "but not as the default layer pattern spells them (layer[3](kda), "
                     "layers.3, DecoderLayer_3, in that case; a type of letters, digits, _ and "
                     f"-), {found}: --layers 'nvtx:REGEX' takes the ranges (its groups 'index' "
                     "and 'type' their index and type)")
    if found := _steps_found_note(b):
        notes.append(found)
    if holding := src.get("steps_holding_passes"):
        named = sorted({(h["step"], h["passes"], h["layers"]) for h in holding})
        shown = ", ".join(f"'{n}' {k} passes of {layers} layers" for n, k, layers in named[:3])
        notes.append(f"steps that hold several forward passes ({shown}"
                     f"{', …' if len(named) > 3 else ''}): the layer type that ends (or "
                     "begins) a pass also holds the work between two passes (final norm, LM "
                     "head, embedding); a range around each pass, taken by --steps, makes "
                     "each pass a step")
    if passes := src.get("pass_ranges"):
        def who(steps: list[str]) -> str:
            return ", ".join(steps[:3]) + (f", … ({len(steps)} passes)" if len(steps) > 3
                                           else "")
        notes.append("the passes ran in different ranges: " + "; ".join(
            f"{who(g['steps'])} in " + ", ".join(
                ("no range" if r["range"] is None else f"'{r['range']}'")
                + (f" {r['ops']}" if len(g["steps"]) == 1 else "") for r in g["in_ranges"])
            for g in passes[:3]) + ("; …" if len(passes) > 3 else ""))
    if enclosing := _enclosing_note(b, work):
        notes.append(enclosing)
    if phases := phase_note(b):
        notes.append(phases)
    return notes


def _outside_steps_note(b: Breakdown, work: str) -> str | None:
    """The work in no step, and why: launched outside every step's range, with no launch to
    place it by, or in a pass the trace cuts."""
    outside = b.source.get("outside_steps") or {}
    if not outside.get("ops"):
        return None
    # breakdowns stored before "unlaunched" was counted said "launched" of all
    unlaunched = outside.get("unlaunched", 0)
    partial = outside.get("partial_passes") or {}
    launched = outside["ops"] - unlaunched - partial.get("ops", 0)
    ranges = outside.get("in_ranges") or []
    named = ", ".join(f"'{r['range']}' {r['ops']}" for r in ranges
                      if r.get("range") is not None)
    unnamed = sum(r["ops"] for r in ranges if r.get("range") is None)
    where = "; ".join(filter(None, [named and f"in {named}",
                                    unnamed and f"in no range {unnamed}"]))
    where = f" ({where})" if where else ""
    outside_ranges = "launched outside every step's range"
    if during := outside.get("during_overlapping_steps"):
        # (by another thread while a step was open: not outside every step's range)
        outside_ranges = "launched outside their own threads' step ranges"
        where += (f", {during} of them while another thread's step range was open (the "
                  "process's step ranges overlap, so that no one step is theirs)")
    if not unlaunched:
        why = outside_ranges + where
    elif not launched:
        why = "the trace holds no launch to place them by"
    else:
        why = (f"{launched} {outside_ranges}{where}, {unlaunched} with no launch in the "
               "trace")
    if partial:
        cut = (f"{partial['ops']} in the parts of {partial['parts']} forward passes the "
               "trace begins or ends within" if partial["parts"] > 1 else
               f"{partial['ops']} in the part of a forward pass the trace begins or ends "
               "within")
        why = cut if not launched and not unlaunched else f"{cut}; {why}"
    return (f"{outside['ops']} more {work if outside['ops'] != 1 else work[:-1]} "
            f"({outside['kernel_us']:.1f} µs) ran in no step: {why}")


def _copies_note(b: Breakdown, work: str) -> str | None:
    """Where copies and fills are a large share of the steps' kernel µs, how large."""
    copies = [(s.get("classes") or {}).get("memcpy") or {} for s in b.steps]
    copy_us, kernel_us = sum(c.get("us", 0) for c in copies), sum(s["kernel_us"] for s in b.steps)
    copy_ops = sum(c.get("kernels", 0) for c in copies)
    if work != "GPU ops" or not copy_ops:
        return None
    if not (kernel_us and copy_us >= COPIES_NOTED * kernel_us):   # a count, not a share
        return (f"the kernel columns count memcpy and memset operations with the kernels: "
                f"{copy_ops} of the steps' {sum(s['kernels'] for s in b.steps)} ops "
                f"({_share_text(copy_us, kernel_us)} of their kernel µs), class memcpy")
    # the steps that hold the most of it, each with its share of its own kernel µs (model
    # loading in one step's prologue is not every step's); those mostly of other work aside
    most = sorted(((us, s) for c, s in zip(copies, b.steps, strict=True)
                   if (us := c.get("us", 0)) >= COPIES_NOTED * s["kernel_us"] > 0),
                  key=lambda us_step: -us_step[0])
    shares = ", ".join(f"{s.get('name') or s['index']} ({us / s['kernel_us']:.0%}"
                       + (" of its kernel µs)" if i == 0 else ")")
                       for i, (us, s) in enumerate(most[:3]))
    return (f"{copy_us / kernel_us:.0%} of the steps' kernel µs is copies and fills "
            f"({copy_ops} of {sum(s['kernels'] for s in b.steps)} ops, class memcpy"
            + (f"; most in {shares}"
               f"{', …' if len(most) > 3 else ''}" if shares else "")
            + "): the kernel columns count memcpy and memset operations with the kernels")


def _share_text(part: float, whole: float) -> str:
    share = part / whole if whole else 0.0
    return f"{share:.0%}" if share >= 0.01 or share == 0 else "under 1%"


def _steps_found_note(b: Breakdown) -> str | None:
    """How steps were found where no step range the defaults know was: each device one
    step, or its forward passes; and the repeating ranges --steps could take."""
    src = b.source
    if src.get("steps_found_by") not in ("device", "pass"):
        return None
    repeating = src.get("repeating_ranges") or []
    # (kernels as ranges counts them: the steps' columns add copies and fills)
    named = ", ".join(f"'{r['range']}' ×{r['instances']} ({r['kernels']} kernels, copies and "
                      "fills aside)" for r in repeating)
    first = f"--steps {shlex.quote('^' + re.escape(repeating[0]['range']) + '$')}" \
        if repeating else ""
    if src["steps_found_by"] == "device":
        steps = "each device is one step" + (
            " (each process, on a device processes share)"
            if any(" pid " in str(s.get("name")) for s in b.steps) else "")
    else:
        periods = sorted({s["layers"] for s in b.steps if isinstance(s.get("layers"), int)})
        every = "".join(f"{_ordinal(n)} or " for n in periods)
        steps = (f"the steps are each device's forward passes, found where every "
                 f"{every.removesuffix('or ')}layer also ran the work between two passes "
                 "(final norm, LM head, embedding)")
    # (a range of such a name may be there, on a thread that launched nothing: not a step)
    return ("no step range the defaults know (decode_step, step, vLLM's execute_…, "
            "a layerwise NVTX root module, ProfilerStep#) around launches of GPU work, and "
            "no graph launches: "
            + steps + (
                f"; ranges that repeat: {named}: {first} takes "
                f"{'the first' if len(repeating) > 1 else 'them'} as the steps "
                "(--steps is a regex searched anywhere in a name; ^…$ matches the "
                "name alone)"
                if repeating else " (--steps REGEX takes ranges of your own)"))


def _enclosing_note(b: Breakdown, work: str) -> str | None:
    """Steps that are ranges around other step ranges: what they count."""
    enclosing = b.source.get("enclosing_steps") or []
    if not enclosing:
        return None
    names = sorted({e["step"] for e in enclosing})
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (", …" if len(names) > 3 else "")
    return (f"{counted(len(enclosing), 'step')} ({shown}) "
            f"{'are ranges' if len(enclosing) > 1 else 'is a range'} holding "
            f"{sum(e['encloses'] for e in enclosing)} other step ranges: "
            f"{'each' if len(enclosing) > 1 else 'it'} counts only the "
            f"{sum(e['ops'] for e in enclosing)} {work} between them (its span, "
            "first to last, takes in theirs: its gap is mostly their time); a "
            "--steps regex that matches only the inner ranges (^NAME$) leaves "
            f"{'them' if len(enclosing) > 1 else 'it'} out")


def note_lines(breakdowns: dict[str, Breakdown]) -> list[str]:
    """What each breakdown says under its figures, after its label: of its steps
    (``step_notes``) and its layer types (``layer_notes``)."""
    return [f"{label}: {note}" for label, b in breakdowns.items()
            for note in [*step_notes(b), *layer_notes(b)]]


def layer_notes(b: Breakdown) -> list[str]:
    """What a breakdown says of its layer types: their two groups, single-layer types."""
    notes = [two_groups_note(t["type"], g) for t in b.layer_types
             for g in t.get("two_groups") or []]
    if lone := lone_types_note(b):
        notes.append(lone)
    if outsized := outsized_types_note(b):
        notes.append(outsized)
    return notes


OUTSIZED = 10   # a pattern type this many times a median layer's kernels is no layer


def pattern_found(b: Breakdown) -> bool:
    """Whether its types that keep a kernel sequence (``pattern``) may have been found by the
    repeating kernel pattern: a step found its layers so, or the steps do not say (stored
    before they did); not where every layer is a range (those of ranges that name no type
    are lettered by their kernels too)."""
    said = {s.get("layer_source") for s in b.steps}
    return "repeat" in said or "nvtx" not in said


def outsized_types_note(b: Breakdown) -> str | None:
    """Where the kernel pattern found types whose layers hold OUTSIZED times the kernels of
    a median layer or more (1,735 against 22 in a training window): stretches of work it did
    not cut into layers, which its figures would pass off as layers."""
    kernels = layer_column(b.layers, "kernels")
    if not len(kernels) or not pattern_found(b):
        return None
    median = float(np.median(kernels))
    big = [t for t in b.layer_types
           if t.get("pattern") and median and t["kernels"] >= OUTSIZED * median]
    if not big:
        return None
    said = ", ".join(f"{t['type']} ({counted(t['layers'], 'layer')} of {t['kernels']:g})"
                     for t in big[:4]) + (", …" if len(big) > 4 else "")
    return (f"types found by the kernel pattern hold {OUTSIZED}× the kernels of a median "
            f"layer ({median:g}) or more: {said}: stretches of work the pattern did not cut "
            "into layers, not layers (--steps REGEX on a range that repeats, a forward pass, "
            "gives steps whose layers repeat)")


def lone_types_note(b: Breakdown) -> str | None:
    """Where the kernel pattern found types of one layer each in a breakdown of several
    steps (a training step's kernels vary from one step to the next): say that their
    figures are of single layers, not medians; in one step whose every type is so, that
    nothing repeated (its "layers" may be two passes of a model: a warm-up and a timed one)."""
    if not pattern_found(b):
        return None
    pattern = [t["type"] for t in b.layer_types if t.get("pattern")]
    lone = [t["type"] for t in b.layer_types if t.get("pattern") and t["layers"] == 1]
    if len(lone) < 2 or (len(b.steps) < 2 and lone != pattern):
        return None
    named = ", ".join(lone[:6]) + (", …" if len(lone) > 6 else "")
    if len(b.steps) < 2:
        return (f"the {len(lone)} types found by the kernel pattern ({named}) hold one layer "
                "each: nothing repeated in the step, so these layers may be whole passes or "
                "phases of the work, not a model's layers (per-layer ranges: --layers "
                "nvtx:REGEX)")
    return (f"{len(lone)} types found by the kernel pattern ({named}) hold one layer each in "
            f"{len(b.steps)} steps: no layer repeats across the steps, so their figures are "
            "of single layers (per-layer ranges give steadier layers: --layers nvtx:REGEX)")


def two_groups_note(kind: str, group: dict[str, Any]) -> str:
    """One ``two_groups`` finding in words."""
    high = group["high_layers"]
    steps = {b - a for a, b in itertools.pairwise(high)}
    which = ", ".join(map(str, high[:4])) + (", …" if len(high) > 4 else "")
    if len(high) > 2 and len(steps) == 1 and (step := steps.pop()) > 1:
        which += f": every {_ordinal(step)}"
    neither = "the median is of neither; " if group.get("median_between") else ""
    fewest, most = group.get("kernels") or (None, None)
    why = ("the same kernels doing different work, such as sliding-window and full attention"
           if fewest == most else f"its layers run {fewest} to {most} of these kernels: "
           "other work, such as layers of two kinds under one type")
    return (f"{kind or '-'}: {group['figure']} µs in two groups by layer: "
            f"{group['low_us']:.1f} µs in {group['low_layers']} layers, "
            f"{group['high_us']:.1f} µs in {len(high)} (layers {which}); {neither}{why}")


def _ordinal(n: int) -> str:
    return f"{n}" + ("th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th"))


def _us_round(v) -> float:
    return round(float(v), 3)


def _median(values) -> float:
    return round(float(np.median(values)), 3) if len(values) else 0.0


def _source(trace: Trace) -> dict:
    """Where the figures come from: the file, its format and tool, the GPUs the trace
    describes (``gpus``: a trace's GPU table may list devices that ran nothing) and those that
    ran its kernels (``gpus_ran``, as described where they are); ``captures``, the files of
    graph captures joined to it, where there were; ``converted_from``: of a ``.kptrace``, the
    trace it was saved from."""
    meta = trace.meta
    described = {g.get("device"): g for g in meta.get("gpus", [])}
    ran = [described.get(d) or {"device": d, "name": None, "sm_count": None}
           for d in np.unique(trace.kernels.device).tolist()]
    return {"file": meta.get("file"),
            **({"converted_from": meta["converted_from"]} if meta.get("converted_from") else {}),
            "format": meta.get("format"), "tool": meta.get("tool"),
            "schema": meta.get("schema"), "gpus": meta.get("gpus", []), "gpus_ran": ran,
            "kernels": len(trace.kernels), "memops": len(trace.memops),
            "ranges": len(trace.ranges),
            **{key: meta[key] for key in ("untimed", "untimed_ranges", "duplicates")
               if meta.get(key)},
            **({"captures": meta["captures"]} if meta.get("captures") else {})}
