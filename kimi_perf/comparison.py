"""Two breakdowns side by side per layer type: kernels, µs and their ratio."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimi_perf.decode.fallbacks import fell_back_text, paths_that_fell_back
from kimi_perf.errors import TraceError, argument, path_argument
from kimi_perf.layer_breakdown import (
    Breakdown,
    LayerRows,
    layer_column,
    note_lines,
    units_word,
)
from kimi_perf.runs import (
    captured_differently,
    captured_path,
    load_paths,
    no_run,
    one_path,
    run_differences,
    run_name,
    same_capture,
    trace_labels,
    without_shared_date,
)
from kimi_perf.stats import can_reach, u_test
from kimi_perf.text import distinct_words, header_labels
from kimi_perf.trace import Trace

ALL_LAYERS = "all layers (mean)"
WHOLE_STEP = "whole step (median)"   # every kernel of a step, whatever its layers

# Said under a comparison whose sides are timed apart (``ComparisonRow.timed_alike``).
UNLIKE_TIMES = ("no µs ratio between a CPU run's ops and a GPU trace's kernels: host time "
                "against GPU time")


@dataclass
class ComparisonRow:
    type: str
    layers_a: int
    kernels_a: float | None
    kernel_us_a: float | None
    span_us_a: float | None
    layers_b: int
    kernels_b: float | None
    kernel_us_b: float | None
    span_us_b: float | None
    # A type found by the repeating pattern in both, with another kernel sequence in B: its
    # letter may name another layer there (letters follow the order of first appearance).
    pattern_differs: bool = False
    # A letter paired by name with a type that keeps no kernel sequence (layers of ranges
    # lettered by their kernels, or a breakdown stored before sequences were kept): the same
    # letter, not shown to be the same layer.
    by_letter: bool = False
    type_b: str | None = None   # B's name of the type, where it differs (``pair_layer_types``)
    name_a: str | None = None   # the type's name in A and in B (None: that side has none)
    name_b: str | None = None
    # False for a CPU run's ops against a GPU trace's kernels: host time against GPU time
    # has no ratio worth printing (their counts still compare: one op per kernel).
    timed_alike: bool = True
    # False for the mean layer of steps cut into other numbers of layers (an eager trace's
    # ranges against a graph's kernel pattern): not the same unit, no ratio; and for whole
    # steps that ran other work (``steps_of_other_work``)
    same_layers: bool = True
    steps_a: int | None = None   # the whole step's row: the steps its medians are over (a
    steps_b: int | None = None   # TP job's: each device's step one)
    step_devices_a: int = 1      # and the devices they ran on
    step_devices_b: int = 1
    steps_even_a: bool = True    # (each device as many steps)
    steps_even_b: bool = True
    # A side whose every step fell back ran the standard path's ops under its own name: its
    # figures stand, but a ratio would credit (or blame) the path for work it never ran.
    fell_back: bool = False

    @property
    def marked(self) -> bool:
        """Whether the tables mark the row * (it may pair another layer)."""
        return self.pattern_differs or self.by_letter

    @property
    def label(self) -> str:
        """The type as the tables name it: "A", or "A = B" where B names it otherwise."""
        return (self.type or "-") + (f" = {self.type_b}" if self.type_b else "")

    def layers_text(self, side: str) -> str:
        """A side's layers as a table shows them: a type's, over all the steps; the whole
        step's, the median step's ("8 a step")."""
        n = self.layers_a if side == "a" else self.layers_b
        return f"{n:g} a step" if self.type == WHOLE_STEP and n else str(n)

    @property
    def span_ratio(self) -> float | None:
        """A's layer time over B's: above 1 means B is faster."""
        if (self.span_us_a is None or not self.span_us_b or not self.timed_alike
                or not self.same_layers or self.fell_back):
            return None
        return _significant(self.span_us_a / self.span_us_b)

    @property
    def kernel_us_ratio(self) -> float | None:
        """A's kernel time over B's: its kernels' µs summed (the span less the idle time
        between them, or more than the span where streams overlap)."""
        if (self.kernel_us_a is None or not self.kernel_us_b or not self.timed_alike
                or not self.same_layers or self.fell_back):
            return None
        return _significant(self.kernel_us_a / self.kernel_us_b)

    @property
    def kernel_ratio(self) -> float | None:
        if (self.kernels_a is None or not self.kernels_b or not self.same_layers
                or self.fell_back):
            return None
        return _significant(self.kernels_a / self.kernels_b)

    def to_json(self) -> dict:
        def us(v: float | None) -> float | None:   # (a median of two steps: 299255.18149999995)
            return None if v is None else round(v, 3)
        sides = [{"layers": layers, "kernels": kernels, "kernel_us": us(kernel_us),
                  "span_us": us(span_us), **({"steps": steps} if steps is not None else {}),
                  **({"step_devices": devices} if devices > 1 else {})}
                 for layers, kernels, kernel_us, span_us, steps, devices in (
                     (self.layers_a, self.kernels_a, self.kernel_us_a, self.span_us_a,
                      self.steps_a, self.step_devices_a),
                     (self.layers_b, self.kernels_b, self.kernel_us_b, self.span_us_b,
                      self.steps_b, self.step_devices_b))]
        return {"type": self.type, "type_b": self.type_b, "a": sides[0], "b": sides[1],
                "span_ratio": self.span_ratio, "kernel_us_ratio": self.kernel_us_ratio,
                "kernel_ratio": self.kernel_ratio,
                "pattern_differs": self.pattern_differs, "paired_by_letter": self.by_letter,
                "same_layers": self.same_layers}


def _significant(v: float) -> float:
    """A ratio to 4 significant digits (0.002674, not 0.003: a CPU run's interpreted path
    is hundreds of times slower)."""
    return float(f"{v:.4g}")


def layers_per_step(b: Breakdown) -> float | None:
    """The median step's layer count (None: no steps, or a step that does not say)."""
    return _median_layers(b.steps)


def _median_layers(steps: list[dict]) -> float | None:
    counts = [s.get("layers") for s in steps]
    if not counts or None in counts:
        return None
    return float(np.median(counts))


def unequal_windows(a: Breakdown, b: Breakdown) -> tuple[float, float] | None:
    """Each side's layers a step, where whole steps do not compare: a step that is all of a
    device's work (no step range, no graph launch, no forward pass found) is the profiler's
    window, and windows that hold different numbers of layers ran different work (a 300 ms
    window of 17 layers against one of 15: their kernels a step differ by the cut alone).
    Their layers still compare."""
    if not (a.source.get("steps_found_by") == b.source.get("steps_found_by") == "device"):
        return None
    layers = layers_per_step(a), layers_per_step(b)
    return None if None in layers or layers[0] == layers[1] else layers


def layer_sources(b: Breakdown) -> list[str]:
    """Where a breakdown's steps found their layers (``nvtx``, ``repeat``; ``none`` where no
    step found any); empty where its steps do not say (stored before they did)."""
    said = {s["layer_source"] for s in b.steps if isinstance(s.get("layer_source"), str)}
    return sorted(said - {"none"}) or sorted(said)


def steps_of_other_work(breakdowns: list[Breakdown]) -> bool:
    """Whether the breakdowns' whole steps ran other work, so that they have no ratio or
    spread: their steps hold other numbers of layers, and either each device is one step on
    every side (profiler windows cut elsewhere, ``unequal_windows``), or on one side, holding
    more layers than the other's steps (a window of many forward passes against one), or
    every layer is a range on every side (models of other depths: a run of 4 layers is no 2x
    leaner than one of 8). Layers found by the kernel pattern on any side may be cut
    otherwise (a graph's pattern taking two eager layers as one): those steps compare. Layer
    types compare either way."""
    return _other_work([layers_per_step(b) for b in breakdowns],
                       [b.source.get("steps_found_by") == "device" for b in breakdowns],
                       [layer_sources(b) == ["nvtx"] for b in breakdowns])


def _other_work(layers: list[float | None], windows: list[bool], ranges: list[bool]) -> bool:
    """``steps_of_other_work``'s rule, of each side's layers a step and whether its steps are
    profiler windows and its layers ranges."""
    if None in layers or len(set(layers)) < 2:
        return False
    # a window against steps found otherwise holding fewer layers than it: many passes, or
    # one and more (fewer: a graph's pattern may take two eager layers as one)
    return (all(windows) or all(ranges)
            or any(w and n > min(layers) for w, n in zip(windows, layers, strict=True)))


def two_breakdowns(what: str, a: object, b: object) -> None:
    """A TypeError, saying what goes there, where ``what`` (a function) is given other than
    two Breakdowns: files, traces, a run's breakdowns by path."""
    if isinstance(a, Breakdown) and isinstance(b, Breakdown):
        return
    def given(kind) -> bool:
        return isinstance(a, kind) or isinstance(b, kind)

    hint = ("compare_files takes files" if given(str | os.PathLike) else
            "breakdown(trace) breaks a trace down" if given(Trace) else
            "of a run's breakdowns by path (load_run's), give one: runs['specialized']"
            if given(dict) else "")
    raise TypeError(f"{what} takes two Breakdowns (breakdown(trace), load_breakdown(file)), "
                    f"not {type(a).__name__} and {type(b).__name__}" + (f": {hint}" if hint
                                                                         else ""))


def compare(a: Breakdown, b: Breakdown, fell_back: bool = False) -> list[ComparisonRow]:
    """Rows for each pair of layer types (``pair_layer_types``; A's order first), then all
    layers' mean (no ratios where the steps hold other numbers of layers: other cuts) and the
    whole step's medians (every kernel of a step, however its layers were found; no ratios
    where the steps hold other numbers of layers: other work). ``fell_back``: a side is a
    decode path whose every step fell back to the standard path (no ratios)."""
    two_breakdowns("compare", a, b)
    types_a = {t["type"]: t for t in a.layer_types}
    types_b = {t["type"]: t for t in b.layer_types}
    rows = []
    for name_a, name_b in pair_layer_types(a, b):
        label = pair_label(name_a, name_b, a)
        row = _row(label, types_a.get(name_a), types_b.get(name_b))
        row.name_a, row.name_b = name_a, name_b
        if name_b is not None and name_b != label:
            row.type_b = name_b
        rows.append(row)
    if a.layers or b.layers:
        mean = _row(ALL_LAYERS, _mean(a), _mean(b))
        mean.same_layers = layers_per_step(a) == layers_per_step(b)
        rows.append(mean)
    if a.steps or b.steps:
        step = _row(WHOLE_STEP, _whole_step(a), _whole_step(b))
        step.steps_a, step.steps_b = len(a.steps) or None, len(b.steps) or None
        # (steps that do not all say their device: counted as steps alone)
        (step.step_devices_a, step.steps_even_a), (step.step_devices_b, step.steps_even_b) = (
            (1, True) if None in each else (max(1, len(each)), len(set(each.values())) <= 1)
            for each in (Counter(s.get("device") for s in x.steps) for x in (a, b)))
        step.same_layers = not steps_of_other_work([a, b])
        rows.append(step)
    for row in rows:
        row.timed_alike = a.unit == b.unit
        row.fell_back = fell_back
    return rows


def pair_types(types_a: list[dict], types_b: list[dict]
               ) -> list[tuple[int | None, int | None]]:
    """Two lists of layer types (``layer_types`` entries) paired, as positions in each (None
    for a type one side lacks), A's order first, then B's unpaired types.

    Types named by ranges pair by name. Types lettered by their kernel sequence (by the
    repeating kernel pattern, or of ranges that name no type: letters in order of first
    appearance, each with its sequence's digest) pair by digest, whatever
    their letters (a type B finds first takes the letter A there); the ones left over pair by
    their kernels per class (``leftover_pairs``), as ``patterns_differ`` then says. A side
    without any digest (a breakdown stored before there were digests) pairs by name
    throughout."""
    digests = [[t.get("pattern") for t in types] for types in (types_a, types_b)]
    by_digest = all(any(d is not None for d in side) for side in digests)
    da, db = digests if by_digest else ([None] * len(types_a), [None] * len(types_b))
    name_b = {t["type"]: j for j, t in enumerate(types_b) if db[j] is None}
    pairs: dict[int, int | None] = {}
    left_b = [j for j in range(len(types_b)) if db[j] is not None]
    for i, t in enumerate(types_a):
        if da[i] is None:
            pairs[i] = name_b.get(t["type"])
        elif (same := next((j for j in left_b if db[j] == da[i]), None)) is not None:
            pairs[i] = same
            left_b.remove(same)
    left_a = [i for i in range(len(types_a)) if i not in pairs]
    for i, j in leftover_pairs([types_a[i] for i in left_a], [types_b[j] for j in left_b]):
        pairs[left_a[i]] = left_b[j]
    paired = set(pairs.values())
    return ([(i, pairs.get(i)) for i in range(len(types_a))]
            + [(None, j) for j in range(len(types_b)) if j not in paired])


def class_distance(a: dict, b: dict) -> float:
    """How far two layer types' mixes of kernels per class lie apart: the total variation
    distance of their shares, 0 (the same mix) to 1 (no class in common), so that a fused
    layer (fewer kernels, in about the same shares) lies close to its unfused form; plus a
    tenth of how many times larger one is (the log of the ratio of their kernels), so that a
    small fragment of a similar mix does not outbid a layer of about its size whose mix
    moved. 0 where one has no classes (a breakdown stored before there were)."""
    ca, cb = a.get("classes") or {}, b.get("classes") or {}
    count = {side: {c: v["kernels"] for c, v in classes.items()}
             for side, classes in (("a", ca), ("b", cb))}
    total_a, total_b = sum(count["a"].values()), sum(count["b"].values())
    if not ca or not cb or not total_a or not total_b:
        return 0.0
    shares = sum(abs(count["a"].get(c, 0) / total_a - count["b"].get(c, 0) / total_b)
                 for c in set(ca) | set(cb)) / 2
    return shares + 0.1 * abs(math.log(total_a / total_b))


def name_overlap(a: dict, b: dict) -> float:
    """How many kernel names two layer types' typical layers share, 0 to 1 (the Jaccard
    index of their multisets): a fused layer keeps some of its unfused form's kernels (its
    attention kernel: sliding-window or full), which tells two layers of one class mix apart.
    0 where either has no typical layer."""
    names = [Counter(k["name"] for k in (t.get("typical_layer") or {}).get("kernels") or [])
             for t in (a, b)]
    union = sum((names[0] | names[1]).values())
    return sum((names[0] & names[1]).values()) / union if union else 0.0


def leftover_pairs(types_a: list[dict], types_b: list[dict]) -> list[tuple[int, int]]:
    """Pattern types whose sequences differ, paired so that the kernel mixes paired lie
    closest in all (an optimal assignment of ``class_distance``; a hundredth of how few kernel
    names they share, ``name_overlap``, decides between mixes alike), ties in order. A layer a
    fused path cut to fewer kernels keeps its mix of classes closer to its own unfused form
    than to another layer's; when one side has a type more (a warm-up layer, say), order
    alone would shift every pair after it."""
    if not types_a or not types_b:
        return []
    from scipy.optimize import linear_sum_assignment

    cost = np.array([[class_distance(a, b) + 0.01 * (1 - name_overlap(a, b)) for b in types_b]
                     for a in types_a])
    # Equal distances pair in order: a nudge far below any real difference of the distances.
    rank = np.abs(np.arange(len(types_a))[:, None] - np.arange(len(types_b))[None, :])
    rows, cols = linear_sum_assignment(cost + 1e-9 * rank)
    return sorted(zip(rows.tolist(), cols.tolist(), strict=True))


def pair_layer_types(a: Breakdown | None, b: Breakdown | None
                     ) -> list[tuple[str | None, str | None]]:
    """``pair_types`` of two breakdowns, as (A's name, B's name)."""
    types_a = a.layer_types if a is not None else []
    types_b = b.layer_types if b is not None else []
    return [(None if i is None else types_a[i]["type"], None if j is None else types_b[j]["type"])
            for i, j in pair_types(types_a, types_b)]


def aligned_types(breakdowns: dict[str, Breakdown]) -> list[dict[str, str]]:
    """The layer types of several breakdowns, aligned: one dict per type, label -> that
    breakdown's name of it (no entry where it has none). The first breakdown's types come
    first; each later one's are paired (``pair_types``) with every type found so far, each
    represented by the first breakdown that has it, so a type that only later ones have is
    one row for all of them."""
    rows: list[dict[str, str]] = []
    found: list[dict] = []      # each row's type, as the first breakdown that has it has it
    row_of_digest: dict[str, int] = {}   # every digest any breakdown gave a row
    for label, b in breakdowns.items():
        # a pattern type whose kernel sequence a row already holds joins it, whichever
        # breakdown brought the sequence (the row's first type may be an unrelated trace's,
        # paired with it by its mix of kernels)
        joined = {j: row_of_digest[t["pattern"]] for j, t in enumerate(b.layer_types)
                  if t.get("pattern") in row_of_digest}
        joined = {j: i for j, i in joined.items() if list(joined.values()).count(i) == 1}
        rest_rows = [i for i in range(len(rows)) if i not in joined.values()]
        rest = [j for j in range(len(b.layer_types)) if j not in joined]
        paired = list(joined.items()) + [
            (rest[j], None if i is None else rest_rows[i])
            for i, j in pair_types([found[i] for i in rest_rows],
                                   [b.layer_types[j] for j in rest]) if j is not None]
        for j, i in sorted(paired):
            if i is None:
                rows.append({})
                found.append(b.layer_types[j])
                i = len(rows) - 1
            rows[i][label] = b.layer_types[j]["type"]
            if b.layer_types[j].get("pattern"):
                row_of_digest.setdefault(b.layer_types[j]["pattern"], i)
    return rows


def pair_label(name_a: str | None, name_b: str | None, a: Breakdown | None) -> str:
    """A pair's name: A's; for a type only B has, B's, or "-" where A names another type so."""
    if name_a is not None:
        return name_a
    return "-" if a is not None and any(t["type"] == name_b for t in a.layer_types) else name_b


def _row(name: str, ta: dict | None, tb: dict | None) -> ComparisonRow:
    def pick(t, key):
        return t[key] if t else None
    patterns = ((ta or {}).get("pattern"), (tb or {}).get("pattern"))
    row = ComparisonRow(name, ta["layers"] if ta else 0, pick(ta, "kernels"),
                        pick(ta, "kernel_us"), pick(ta, "span_us"),
                        tb["layers"] if tb else 0, pick(tb, "kernels"), pick(tb, "kernel_us"),
                        pick(tb, "span_us"), patterns_differ(patterns))
    row.by_letter = ta is not None and tb is not None and paired_by_letter(patterns)
    return row


def paired_by_letter(patterns) -> bool:
    """Whether types of one letter were paired though some keep a kernel sequence and others
    none (``ComparisonRow.by_letter``)."""
    held = set(patterns)
    return None in held and len(held) > 1


# How two traces' layer types were paired, for the notes under a comparison.
PAIRING = ("types lettered by their kernel sequence (the repeating kernel pattern's, or ranges' "
           "that name no type) pair by it; those left over by their mix of kernels per class, "
           "marked * where the sequences differ")


def ratio_note(rows: list[ComparisonRow], label_a: str, label_b: str,
               units: str = "kernels") -> str:
    """What a comparison's ratios and its last row are, said where they are read
    (``units``: what the two sides count, ``units_word``)."""
    if any(r.fell_back for r in rows):
        return ("no ratios: a path fell back to the standard path on every step (as its "
                "warning says), so its figures are the standard path's ops, not its kernels'")
    mean = next((r for r in rows if r.label == ALL_LAYERS), None)
    step = next((r for r in rows if r.label == WHOLE_STEP), None)
    return (f"ratios: {label_a} over {label_b}, above 1 where {label_b} takes less"
            + ("" if mean is None else "; all layers: the mean over every layer, a slow "
               "outlier included" if mean.same_layers else "; all layers: no ratio, as the "
               "steps hold other numbers of layers (cut otherwise: a mean layer is another "
               "unit on each side)")
            + ("" if step is None else f"; whole step: the median step{_of_steps(step)}, "
               f"all its {units}" if step.same_layers else f"; whole step: no ratio, as the "
               f"steps hold {step.layers_a:g} and {step.layers_b:g} layers: other work (models "
               "of other depths, each layer a range; or a profiler window, cut anywhere)"))


def _of_steps(step: ComparisonRow) -> str:
    """How many steps each side's whole-step medians are over, where the sides differ (a TP
    job's: each device's step one, "12 steps × 4 devices", not 48 steps)."""
    sides = [(steps or 0, devices, even) for steps, devices, even in (
        (step.steps_a, step.step_devices_a, step.steps_even_a),
        (step.steps_b, step.step_devices_b, step.steps_even_b))]
    if sides[0] == sides[1]:
        return ""
    if sides[0][1] == sides[1][1] == 1:
        return f" (of {sides[0][0]} and of {sides[1][0]} steps)"
    a, b = (f"{steps} steps" if devices == 1 else
            f"{steps // devices} steps × {devices} devices" if even else
            f"{steps} steps of {devices} devices" for steps, devices, even in sides)
    return f" (of {a} and of {b})"


def pairing_note(rows: list[ComparisonRow], label_a: str, label_b: str) -> str | None:
    """What "X = Y" and "- = Y" in a comparison's rows mean, each told with its first such
    row (the letters of a template could be types of either side); None when no row has
    them."""
    paired = next((r for r in rows if r.type_b and r.name_a is not None), None)
    alone = next((r for r in rows if r.type_b and r.name_a is None), None)
    said = []
    if paired is not None:
        said.append(f"{paired.name_a} = {paired.type_b}: the type {label_a} calls "
                    f"{paired.name_a}, {label_b} calls {paired.type_b} ({PAIRING})")
    if alone is not None:
        said.append(f"- = {alone.type_b}: a type only {label_b} has, which it calls "
                    f"{alone.type_b} ({label_a}'s {alone.type_b} is another)")
    return "; ".join(said) or None


# what the comparison tables' layers columns count (their other columns are medians)
LAYERS_COLUMN = ("layers: how many of the type all the steps profiled hold (say, one in each of 3 "
                 "steps: 3); the step row's, how many one step holds")


def comparison_notes(rows: list[ComparisonRow], label_a: str, label_b: str,
                     unit: str = "kernels", unit_b: str | None = None) -> list[str]:
    """What a comparison's table says under it: its ratios, what its layers columns count, its
    pairings, its marks."""
    notes = [ratio_note(rows, label_a, label_b, units_word([unit, unit_b or unit])),
             LAYERS_COLUMN]
    if paired := pairing_note(rows, label_a, label_b):
        notes.append(paired)
    if any(r.pattern_differs for r in rows):
        notes.append(f"* lettered by its kernel sequence, with another kernel sequence in "
                     f"{label_b}: it may be another layer there")
    if lettered := [r.label for r in rows if r.by_letter]:
        notes.append(f"* {', '.join(lettered)}: paired by letter alone, one side keeping no "
                     "kernel sequence (a breakdown stored before sequences were kept): it may "
                     "be another layer there")
    if unit == (unit_b or unit) == "kernels" and (idle := idle_note(rows)):
        notes.append(idle)   # (a CPU run's ops: its spans hold the host's work between them)
    if unit != (unit_b or unit):
        notes.append(UNLIKE_TIMES)
    return notes


# how far (as a ratio) a row's span ratio may lie from its kernel-time ratio before the note
# says that the idle time between kernels made the difference
IDLE_APART = 1.05


def idle_note(rows: list[ComparisonRow], most: int = 3) -> str | None:
    """The rows whose µs ratio (of spans) lies IDLE_APART or more from the ratio of their
    kernels' time: the difference is idle time between kernels (launch gaps, a sync), which
    the spans hold and the kernels' µs do not. Not rows whose kernels overlap on a side (their
    µs add up past the span: streams at once), where the spans' difference is not idle time
    alone."""
    apart = [r for r in rows if r.span_ratio and r.kernel_us_ratio
             and r.kernel_us_a <= r.span_us_a and r.kernel_us_b <= r.span_us_b
             and max(r.span_ratio / r.kernel_us_ratio,
                     r.kernel_us_ratio / r.span_ratio) >= IDLE_APART]
    if not apart:
        return None
    said = "; ".join(f"{r.label}: {r.span_ratio:.3g}, kernel µs {r.kernel_us_ratio:.3g}"
                     for r in apart[:most]) + ("; …" if len(apart) > most else "")
    return ("µs ratios the kernels' time does not explain (the rest is idle time between "
            f"kernels: launch gaps, syncs), against the ratio of kernel µs: {said}")


def rotation(a: list[str], b: list[str]) -> int | None:
    """How many kernels later in the same cycle b starts than a: r with b == a[r:] + a[:r]
    (0: the same sequence); None where b is no rotation of a. Two typical layers of one cycle
    cut at different kernels are the same layer (their digests agree)."""
    n = len(a)
    if n != len(b) or Counter(a) != Counter(b):
        return None
    return 0 if not n else next((r for r in range(n) if a[r] == b[0] and a[r:] == b[: n - r]
                 and a[:r] == b[n - r:]), None)


def aligned_typical(typical: dict[str, dict | None]
                    ) -> tuple[dict[str, dict | None], dict[str, int]]:
    """Typical layers side by side (``typical_layer`` per label), each that is a rotation of
    the first one's shown from the first one's first kernel, so that its rows pair the same
    kernels; and per label so shown, how many kernels later its layers start."""
    first = next((t for t in typical.values() if t), None)
    if first is None:
        return typical, {}
    names = [k["name"] for k in first["kernels"]]
    out, shifts = {}, {}
    for label, t in typical.items():
        r = rotation(names, [k["name"] for k in t["kernels"]]) if t and t is not first else 0
        if r:
            n = len(names)
            out[label] = {**t, "kernels": t["kernels"][n - r:] + t["kernels"][: n - r]}
            shifts[label] = r
        else:
            out[label] = t
    return out, shifts


def rotation_notes(shifts: dict[str, int], typical: dict[str, dict | None],
                   unit: str) -> list[str]:
    """What ``compare.aligned_typical`` did: a side's layers cut the same cycle of kernels
    elsewhere, so its rows are shown from the first side's first kernel."""
    first = next((label for label, t in typical.items() if t), "")
    return [f"{label}: the same layer with its boundary {r} {unit} later in the cycle (at "
            f"{first}'s #{r + 1}); its rows are shown in {first}'s order"
            for label, r in shifts.items()]


def patterns_differ(patterns) -> bool:
    """Whether a layer type that the repeating kernel pattern found (a digest of its kernel
    sequence per trace; None where ranges named it) ran other sequences in some traces: its
    letter (in order of first appearance) may name different layers there."""
    return len(set(patterns) - {None}) > 1


def compute_units(tool: str | None) -> str:
    """What a trace's GPUs count as ``sm_count``: an AMD GPU's compute units (a ROCm trace,
    its tool said so by the reader) or NVIDIA's streaming multiprocessors."""
    return "CUs" if tool and "ROCm" in tool else "SMs"


def gpu_kinds(gpus: list[dict]) -> Counter:
    """How many GPUs of each (name, SM count): what tells two traces' GPUs apart."""
    return Counter((g.get("name") or ("unnamed GPU" if g.get("sm_count") else
                                      "GPU not described in the trace"), g.get("sm_count"))
                   for g in gpus)


def gpus_differ(a: list[dict], b: list[dict]) -> bool:
    """Whether two traces' GPUs (``gpus_ran``) are known to differ in kind or number: compared
    by what both traces describe of every GPU (its name, its SM count), by their number alone
    where they share neither. What a trace does not describe is no difference."""
    said = [f for f in ("name", "sm_count") if all(g.get(f) for g in (*a, *b))]
    return (Counter(tuple(g.get(f) for f in said) for g in a)
            != Counter(tuple(g.get(f) for f in said) for g in b))


def gpus_text(gpus: list[dict], tool: str | None = None) -> str:
    """The GPUs that ran a trace's kernels in a few words: "8 × NVIDIA A100 (108 SMs)"
    (CUs for a ROCm trace: ``tool``)."""
    return ", ".join(f"{n} × {name}" + (f" ({sms} {compute_units(tool)})" if sms else "")
                     for (name, sms), n in gpu_kinds(gpus).items()) or "no GPU"


def sides_notes(a: Breakdown, b: Breakdown, label_a: str, label_b: str) -> list[str]:
    """What a comparison's two sides are, where it changes how to read its µs: GPUs of
    another kind (from the kernels each trace ran; or not known to be alike, where a trace
    does not describe its GPUs), steps of other phases (decode against
    prefill or mixed steps), a CPU run's ops, or a side's layers on several devices."""
    notes = []
    ran = [(x.source or {}).get("gpus_ran") or [] for x in (a, b)]
    if all(ran) and gpu_kinds(ran[0]) != gpu_kinds(ran[1]):
        said = [gpus_text(g, (x.source or {}).get("tool")) for g, x in zip(ran, (a, b),
                                                                           strict=True)]
        notes.append(f"{label_a} ran on {said[0]}, {label_b} on {said[1]}: "
                     + ("their µs differ for that alone" if gpus_differ(*ran) else
                        "whether their GPUs are alike is not known"))
    phases = [sorted({s.get("phase") for s in x.steps} - {None, "unknown"}) for x in (a, b)]
    if all(phases) and phases[0] != phases[1]:
        notes.append(f"{label_a}'s steps are {'/'.join(phases[0])}, {label_b}'s "
                     f"{'/'.join(phases[1])}: their µs differ for that alone")
    on_cpu = [label for label, x in ((label_a, a), (label_b, b)) if x.unit == "ops"]
    if on_cpu:
        interpreted = (" (a specialized path's kernels ran in Triton's interpreter)"
                       if any(x.unit == "ops" and _ran_fused_launches(x) for x in (a, b))
                       else "")
        notes.append(f"{' and '.join(on_cpu)}: a CPU run's µs are CPU time, noisy and no speed "
                     f"figure{interpreted}; its ops are the launches each path annotates, one "
                     "per kernel a GPU runs")
    for label, x in ((label_a, a), (label_b, b)):
        if len(devices := layer_devices(x)) >= 2:   # (one file of a whole TP job)
            notes.append(f"{label}'s layers ran on {len(devices)} devices: its figures are "
                         "medians over all of them (each device's: its table of every "
                         "device)")
    return notes


def _ran_fused_launches(b: Breakdown) -> bool:
    """Whether a CPU run's typical layers hold a launch only the specialized path makes."""
    from kimi_perf.decode.fusions import SPECIALIZED_LAUNCHES, STANDARD_LAUNCHES

    fused = SPECIALIZED_LAUNCHES - STANDARD_LAUNCHES
    return any(k["name"] in fused for t in b.layer_types
               for k in (t.get("typical_layer") or {}).get("kernels", []))


def _whole_step(b: Breakdown) -> dict | None:
    """The medians over the steps, its "layers" the median step's (0 where steps do not
    say)."""
    if not b.steps:
        return None
    layers = layers_per_step(b) or 0
    return {"layers": int(layers) if float(layers).is_integer() else layers,
            **{k: float(np.median([s[k] for s in b.steps]))
               for k in ("kernels", "kernel_us", "span_us")}}


def _mean(b: Breakdown) -> dict | None:
    if not b.layers:
        return None
    n = len(b.layers)
    return {"layers": n,
            **{k: round(sum(layer_column(b.layers, k).tolist()) / n, 3)
               for k in ("kernels", "kernel_us", "span_us")}}


@dataclass
class OverviewRow:
    """One trace among several: its median step span, and per layer type its median
    kernels and span (None where it has no layer of that type)."""

    label: str
    steps: int
    step_us: float | None
    types: dict[str, tuple[float, float] | None]
    patterns: dict[str, str | None]   # a type lettered by its kernel sequence: its digest
    unit: str = "kernels"             # "ops" for a CPU run (``Breakdown.unit``)
    names: dict[str, str | None] = dataclasses.field(default_factory=dict)  # its own names
    layers: float | None = None       # the median step's layers (``layers_per_step``)
    windows: bool = False             # its steps each device's work (profiler windows)
    ranges: bool = False              # its layers all ranges
    trace: str = ""                   # the trace's label (``label``: with its device's)
    device: int | None = None         # the device of a trace of several, or None
    # the spans the medians are of, by column (None: the steps'), which ``spreads`` tests: a
    # type's layers' each step's mean, and one by one (``span_samples``)
    samples: dict[str | None, tuple[np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)


def differing_patterns(rows: list[OverviewRow]) -> list[str]:
    """Types lettered by their kernel sequence whose kernel sequence differs between
    traces, or that some traces keep none of (``paired_by_letter``): their letter may name
    different layers; and types named by ranges whose layers run other numbers of kernels in
    different traces (a decode path's ``kda`` beside another's: other work under one name)."""
    types = rows[0].types if rows else {}
    return [t for t in types
            if patterns_differ(held := [r.patterns[t] for r in rows if r.types[t]])
            or paired_by_letter(held) or t in counts_differ(rows)]


# More than how many times the kernels of one type's median layer in another trace, and two
# more at least, make other work: ranks of one run differ by a kernel at most (a median between two
# counts, a copy); two decode paths' dense layers by 11 against 9
OTHER_WORK_KERNELS = 1.15


def counts_differ(rows: list[OverviewRow]) -> list[str]:
    """Types named by ranges (no kernel pattern kept) whose median layers run more than
    ``OTHER_WORK_KERNELS`` times as many kernels in one trace as in another, and two more at
    least: other work under one name (two decode paths' ``kda``), where a TP run's ranks run
    about as many."""
    out = []
    for t in rows[0].types if rows else {}:
        counts = [r.types[t][0] for r in rows if r.types[t]]
        if counts and not any(r.patterns[t] for r in rows if r.types[t]) \
                and max(counts) - min(counts) >= 2 \
                and max(counts) > OTHER_WORK_KERNELS * min(counts):
            out.append(t)
    return out


def differing_note(rows: list[OverviewRow]) -> str | None:
    """What the ``*`` of ``differing_patterns`` means for the types it marks, or None."""
    differ = differing_patterns(rows)
    named = [t for t in differ if t in counts_differ(rows)]
    said = []
    if len(named) < len(differ):
        said.append("lettered by their kernel sequence, with other kernel sequences in "
                    "some traces (or none kept: paired by letter alone): the letter may name "
                    "different layers")
    if named:
        unit = units_word(r.unit for r in rows)
        where = "on some devices" if of_devices(rows) else "in some traces"
        said.append(f"{', '.join(named)}: named alike by ranges, whose layers run other "
                    f"numbers of {unit} {where}: other work under one name")
    return "* " + "; ".join(said) + " (no spread)" if said else None


def overview(breakdowns: dict[str, Breakdown], tested: bool = True) -> list[OverviewRow]:
    """Every trace in one table, a row each, the layer types as the first trace names them
    (``aligned_types``; then the types only others have): the view of a TP run's ranks
    (which rank is slow, and in what). A trace whose layers ran on several devices (one nsys
    file of a whole TP job) is a row per device (``device_figures``), labelled ``device N``
    where it is the only trace: its medians over all of them would mix the ranks.
    ``tested``: each row keeps the spans its layer types' medians are of, which ``spreads``
    tests (not where no spread is drawn: the decode paths of several runs)."""
    columns: dict[str, dict[str, str]] = {}
    for names_of in aligned_types(breakdowns):
        column = next(iter(names_of.values()))
        while column in columns:
            column += "'"
        columns[column] = names_of
    rows = []
    for label, b in breakdowns.items():
        names = {column: names_of.get(label) for column, names_of in columns.items()}
        patterns = {t["type"]: t.get("pattern") for t in b.layer_types}
        parts = device_figures(b) or {None: (b.steps, {
            t["type"]: (t["kernels"], t["span_us"]) for t in b.layer_types})}
        samples = span_samples(b, list(parts)) if tested else {d: {} for d in parts}
        for device, (steps, figures) in parts.items():
            spans = [s["span_us"] for s in steps]
            shown = (label if device is None else f"device {device}" if len(breakdowns) == 1
                     else f"{label} device {device}")
            rows.append(OverviewRow(
                shown, len(spans), statistics.median(spans) if spans else None,
                {column: figures.get(name) for column, name in names.items()},
                {column: patterns.get(name) for column, name in names.items()}, b.unit, names,
                _median_layers(steps),
                b.source.get("steps_found_by") == "device", layer_sources(b) == ["nvtx"],
                label, device,
                ({None: (np.array(spans, float), np.empty(0))} if tested else {}) | {
                    column: samples[device][name] for column, name in names.items()
                    if name in samples[device]}))
    return rows


def span_samples(b: Breakdown, devices: list[int | None]
                 ) -> dict[int | None, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Per device (None: every device's) and layer type, its layers' spans: each step's mean
    (the layers of a step share its noise: a clock, a busy neighbour) and one by one. Each
    column read once, whatever the devices and types (a breakdown read from JSON holds its
    layers as dicts)."""
    layers = b.layers
    kinds = (np.array(layers.types, object)[layers.type_code] if isinstance(layers, LayerRows)
             else np.array([r["type"] for r in layers], object))
    device, step, span = (layer_column(layers, c) for c in ("device", "step", "span_us"))
    out: dict[int | None, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for d in devices:
        on = np.ones(span.size, bool) if d is None else device == d
        out[d] = {}
        for t in b.layer_types:
            mine = on & (kinds == t["type"])
            stepped = mine & ~np.isnan(step) if step.dtype.kind == "f" else mine   # (said)
            _, of_step = np.unique(step[stepped], return_inverse=True)
            counts = np.bincount(of_step)
            out[d][t["type"]] = (np.bincount(of_step, span[stepped])[counts > 0]
                                 / counts[counts > 0], span[mine])
    return out


def device_figures(b: Breakdown) -> dict[int, tuple[list[dict], dict[str, tuple[float, float]]]]:
    """Where a breakdown's layers ran on two devices or more: per device, its steps and per
    layer type the median kernels and span of its layers there (as ``layer_types`` takes
    them over all); empty for a breakdown whose layers ran on one device, or that has none
    (a device that ran no layer, a peer copy's, is no rank of the model's: left out)."""
    devices = layer_devices(b)
    if len(devices) < 2:
        return {}
    out: dict[int, tuple[list[dict], dict[str, tuple[float, float]]]] = {
        d: ([s for s in b.steps if s["device"] == d], {}) for d in devices}
    for t in b.layer_types:
        on = layer_column(b.layers, "device", t["type"])
        kernels = layer_column(b.layers, "kernels", t["type"])
        spans = layer_column(b.layers, "span_us", t["type"])
        for d in devices:
            if (here := on == d).any():
                out[d][1][t["type"]] = (round(float(np.median(kernels[here])), 3),
                                        round(float(np.median(spans[here])), 3))
    return out


STEPS_UNLIKE = ("no spread of whole steps: the traces' steps hold other numbers of layers "
                "(models of other depths, each layer a range, or of no layer alike; or a "
                "profiler window, cut anywhere), or layers of one name that run other numbers "
                "of kernels or ops")
# (one trace's devices: one job's)
DEVICE_STEPS_UNLIKE = ("no spread of whole steps: the devices' steps hold other numbers of "
                       "layers (pipeline stages, each device's own layers; or each device's "
                       "work a step, the profiler's window, cut anywhere), or layers of one "
                       "name that run other numbers of kernels or ops")


def of_devices(rows: list[OverviewRow]) -> bool:
    """Whether the rows are one trace's devices (``overview`` of a trace of several)."""
    return bool(rows) and len({r.trace for r in rows}) == 1 and rows[0].device is not None


def steps_unlike_note(rows: list[OverviewRow]) -> str:
    """Why there is no spread of the rows' whole steps (``steps_unlike``), as said of traces
    or of one trace's devices."""
    return DEVICE_STEPS_UNLIKE if of_devices(rows) else STEPS_UNLIKE


def layer_devices(b: Breakdown) -> list[int]:
    """The devices a breakdown's layers ran on, in order (a stored layer without its device
    counts none)."""
    column = layer_column(b.layers, "device")
    return [int(d) for d in np.unique(column[~np.isnan(column)] if column.dtype.kind == "f"
                                      else column)]


def device_overviews(breakdowns: dict[str, Breakdown]) -> dict[str, list[OverviewRow]]:
    """Of one trace or two (a before/after pair of TP jobs, each one file), each whose layers
    ran on several devices: its devices' rows (``overview``), spread among themselves, which
    rank is slow (a spread over both jobs' devices would be the pair's difference); three or
    more have one ``overview``, a row per device of those."""
    if len(breakdowns) >= 3:
        return {}
    return {label: overview({label: b}) for label, b in breakdowns.items()
            if len(layer_devices(b)) >= 2}


def steps_unlike(rows: list[OverviewRow]) -> bool:
    """Whether the traces' whole steps ran other work (``steps_of_other_work``'s rule; and
    steps of other numbers of layers where no layer type runs the same kernels in two
    traces: other models, whatever cut their layers): no spread of them (a TP run's ranks
    hold as many layers, of the same kernels)."""
    steps = [r for r in rows if r.step_us is not None]
    if _other_work([r.layers for r in steps], [r.windows for r in steps],
                   [r.ranges for r in steps]) or counts_differ(rows):
        return True
    def alike(layer_type: str) -> bool:   # the same kernels in two traces at least
        held = Counter(r.patterns.get(layer_type) for r in rows if r.types[layer_type])
        return any(n >= 2 for n in held.values())   # (None: named by ranges, alike by name)

    return (not any(alike(t) for t in (rows[0].types if rows else ()))
            and None not in {r.layers for r in steps} and len({r.layers for r in steps}) > 1)


def overview_json(rows: list[OverviewRow]) -> dict:
    """What ``overview_table`` shows, as JSON: a row per trace, or per device of a trace of
    several (``label``; ``trace``, ``device``: whose; each column's type by that trace's own
    name), per layer type (``null``: the step) the spread, slowest over fastest
    median span, with the slowest trace, and the types marked ``*`` (``differing_patterns``),
    which have no spread."""
    return {"rows": [{"label": r.label, "trace": r.trace, "device": r.device, "steps": r.steps,
                      "step_us": None if r.step_us is None else round(r.step_us, 3),
                      "types": {column: None if v is None else
                                {"kernels": v[0], "span_us": v[1], "name": r.names.get(column),
                                 "pattern": r.patterns.get(column)}
                                for column, v in r.types.items()}} for r in rows],
            "spreads": [{"type": s.type, "fastest_us": s.fastest, "slowest_us": s.slowest,
                         "ratio": s.ratio, "slowest": s.slowest_label, "p_value": s.p_value,
                         "alpha": s.alpha, "tested_over": s.tested_over}
                        for s in spreads(rows)],
            "patterns_differ": differing_patterns(rows)}


def renamed_columns(rows: list[OverviewRow], most: int = 4) -> str | None:
    """Where a trace names a column's type otherwise (its letter paired to another's by the
    kernel sequence, or primed: taken by an earlier trace's type), what it calls it."""
    said = []
    for column in rows[0].types if rows else {}:
        others = list(dict.fromkeys(f"{r.names[column]} in {r.trace or r.label}" for r in rows
                                    if r.names.get(column) not in (None, column)))
        if others:
            said.append(f"{column} is {', '.join(others)}")
    if not said:
        return None
    return ("columns name a type as the first trace that has it does: "
            + "; ".join(said[:most]) + ("; …" if len(said) > most else ""))


# the chance that ``spreads`` names a slowest trace where the rows' spans differ by noise
# alone (divided among the ordered pairs of rows: the slowest and fastest of 16 ranks are the
# farthest apart of 240, the test's direction picked from the data too)
STRAGGLER_ALPHA = 0.01


@dataclass
class Spread:
    """A layer type's (or the step's: type None) median span across traces, and the slowest
    trace (the first of equals; None where the ratio shows as 1.00, or where its spans are
    not above the fastest's beyond noise: ``p_value``, of a one-sided U test of them, not
    below ``alpha``; None where the test could not reach it, too few spans)."""

    type: str | None
    fastest: float
    slowest: float
    slowest_label: str | None
    p_value: float | None = None
    alpha: float | None = None
    tested_over: str | None = None   # "steps" (each step's mean), or "layers" (too few steps)

    @property
    def ratio(self) -> float | None:
        return round(self.slowest / self.fastest, 3) if self.fastest else None

    @property
    def noise(self) -> bool:
        """Whether the slowest's spans were tested and are not above the fastest's."""
        return self.p_value is not None and self.p_value >= self.alpha


def spreads(rows: list[OverviewRow]) -> list[Spread]:
    """Per layer type and for the step, the fastest and slowest trace's median span. None
    among CPU runs and GPU traces together: their µs differ a thousandfold; none for a type
    whose kernel sequence differs between traces, which may be different layers; none for
    the step where the steps hold other numbers of layers (``steps_unlike``)."""
    if len({r.unit for r in rows}) > 1:
        return []
    unlike = set(differing_patterns(rows))
    out = []
    for layer_type in [*([] if steps_unlike(rows) else [None]),
                       *(t for t in (rows[0].types if rows else ()) if t not in unlike)]:
        values = [(r.step_us if layer_type is None else r.types[layer_type][1], r)
                  for r in rows
                  if (r.step_us if layer_type is None else r.types[layer_type]) is not None]
        if len(values) >= 2:
            fast, fastest = min(values, key=lambda v: v[0])
            slow, slowest = max(values, key=lambda v: v[0])   # the first of equals
            spread = Spread(layer_type, fast, slow, slowest.label if slow > fast else None)
            if spread.ratio is not None and f"{spread.ratio:.2f}" == "1.00":
                spread.slowest_label = None   # (two ranks 0.1% apart: noise, no straggler)
            elif spread.slowest_label is not None:   # (a fastest median of 0 µs too)
                _test_slowest(spread, slowest.samples.get(layer_type),
                              fastest.samples.get(layer_type), len(values))
            out.append(spread)
    return out


def _test_slowest(spread: Spread, slow: tuple[np.ndarray, np.ndarray] | None,
                  fast: tuple[np.ndarray, np.ndarray] | None, rows: int) -> None:
    """The slowest trace named only where its spans are above the fastest's beyond noise:
    a one-sided U test of its steps' (each step's mean of the type's layers) against the
    fastest's, or of their layers' where too few steps reach alpha, where a test of so many
    can say. Alpha: ``STRAGGLER_ALPHA`` over the ordered pairs of rows (which is slowest
    and which fastest is picked from the data, and so is the test's direction)."""
    alpha = STRAGGLER_ALPHA / math.perm(rows, 2)
    if slow is None or fast is None:
        return
    for over, mine, theirs in zip(("steps", "layers"), slow, fast, strict=True):
        if can_reach(mine.size, theirs.size, alpha):
            spread.p_value, spread.alpha = u_test(mine, theirs, worse=True), alpha
            spread.tested_over = over
            if spread.noise:
                spread.slowest_label = None
            return


def noise_note(spread: list[Spread]) -> str | None:
    """The spreads whose slowest was not named as its spans are within noise of the
    fastest's, said with their p."""
    noisy = [s for s in spread if s.noise]
    if not noisy:
        return None
    return ("no slowest named where its spans are within noise of the fastest's (one-sided U "
            f"test, α {STRAGGLER_ALPHA} shared among the ordered pairs of rows): "
            + ", ".join(
                f"{'step' if s.type is None else s.type} "
                + (f"{ratio_text(s.ratio)}×" if s.ratio is not None else "from a median of 0")
                + f" (p {s.p_value:.2g} over {s.tested_over})" for s in noisy))


def overview_notes(rows: list[OverviewRow], spread: list[Spread],
                   named: dict[str, str] | None = None, most: int = 4,
                   of_paths: bool = False) -> list[str]:
    """What the table of ``overview``'s rows says under it, a line each: which row was
    slowest in what (``named``: a row's name where it is shown otherwise), the spreads
    within noise, the types marked * and the columns renamed (``most`` of them), why there
    is no spread where there is none (``of_paths``: the rows are the decode paths of runs,
    which have none)."""
    named = named or {}
    notes = (["no spread or slowest trace: these include the decode paths of runs, compared "
              "pair by pair below"] if of_paths else
             [f"slowest: {named.get(label, label)} ({why})"
              for label, why in straggler_evidence(spread).items()])
    if not of_paths and (noisy := noise_note(spread)):
        notes.append(noisy)
    if said := differing_note(rows):
        notes.append(said)
    if renamed := renamed_columns(rows, most):
        notes.append(renamed)
    if of_paths:
        return notes
    if len({r.unit for r in rows}) > 1:
        notes.append("no spread between CPU runs and GPU traces: their µs differ a "
                     "thousandfold")
    elif steps_unlike(rows):
        notes.append(steps_unlike_note(rows))
    return notes


def stragglers(spread: list[Spread]) -> dict[str, list[str]]:
    """Each slowest trace and what it was slowest in ("step", layer types)."""
    out: dict[str, list[str]] = {}
    for s in spread:
        if s.slowest_label is not None:
            out.setdefault(s.slowest_label, []).append("step" if s.type is None else s.type)
    return out


def straggler_evidence(spread: list[Spread]) -> dict[str, str]:
    """Each slowest trace and what it was slowest in, as its line says it: the columns
    tested with the p of their test against the fastest (``mla p 0.003 over steps``), then
    those too few spans could test, named by the ratio alone."""
    tested: dict[str, list[str]] = {}
    untested: dict[str, list[str]] = {}
    for s in spread:
        if s.slowest_label is not None:
            what = "step" if s.type is None else s.type
            if s.p_value is not None:
                tested.setdefault(s.slowest_label, []).append(
                    f"{what} p {s.p_value:.2g} over {s.tested_over}")
            else:
                untested.setdefault(s.slowest_label, []).append(what)
    return {label: "; ".join([*tested.get(label, []), *(
        [f"{', '.join(untested[label])} by the ratio alone: too few spans to test"]
        if label in untested else [])])
        for label in stragglers(spread)}


def count_text(count: float | None) -> str:
    """A count of kernels or ops: whole as it is (never 2.18e+03), a median's half or a mean
    with one decimal."""
    if count is None:
        return "-"
    return f"{count:.0f}" if float(count).is_integer() else f"{count:.1f}"


def ratio_text(v: float | None) -> str:
    """A ratio to two decimals, or to two significant digits below 0.1 (a CPU run's fused
    path in Triton's interpreter is hundreds of times slower: 0.0041, not 0.00); from 100 on
    to its four significant digits (28,160, not 28160.00: ``_significant`` kept four)."""
    if v is None:
        return "-"
    v = float(f"{v:.4g}")   # (99.999 read 100.00, 999.96 1000.0)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}" if v == 0 or abs(v) >= 0.1 else f"{v:#.2g}"


@dataclass(repr=False)
class TypePair:
    """One pair of layer types of a comparison: its label, A's type and B's (None where that
    side has none) and, where A and B are the two decode paths (their launches annotated),
    the fusion ledger: (whether A is the specialized one, its rows, the standard launches no
    row took)."""

    label: str
    a: dict | None
    b: dict | None
    ledger: tuple[bool, list, list[str]] | None = None

    def __repr__(self) -> str:   # not the typical layers the types hold
        def side(t: dict | None) -> str:
            return "-" if t is None else f"{t.get('type')} ×{t.get('layers', '?')}"
        return (f"TypePair({self.label!r}: {side(self.a)} vs {side(self.b)}"
                + (f", ledger of {len(self.ledger[1])} launches" if self.ledger else "") + ")")

    def typical_json(self) -> dict:
        """A's and B's typical layers: B's in A's order where it is the same cycle of kernels
        cut elsewhere, with ``rotation``, how many kernels later B's layers start."""
        shown, shifts = aligned_typical({"a": (self.a or {}).get("typical_layer"),
                                         "b": (self.b or {}).get("typical_layer")})
        return {**shown, **({"rotation": shifts["b"]} if "b" in shifts else {})}

    def ledger_json(self, name_a: str, name_b: str) -> dict | None:
        if self.ledger is None:
            return None
        swapped, rows, left = self.ledger
        return {"standard": name_b if swapped else name_a,
                "specialized": name_a if swapped else name_b,
                # (a ratio the other way round from the comparison's where A is specialized)
                "ratio_of": "replaced_us / us",
                "launches": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows],
                "unmatched_standard": left}


def type_pairs(a: Breakdown, b: Breakdown, rows: list[ComparisonRow] | None = None
               ) -> list[TypePair]:
    """The pairs ``compare`` makes, each with both types and its fusion ledger, if any."""
    from kimi_perf.decode.fusions import ledger_of

    two_breakdowns("type_pairs", a, b)
    types_a = {t["type"]: t for t in a.layer_types}
    types_b = {t["type"]: t for t in b.layer_types}
    pairs = []
    for r in rows if rows is not None else compare(a, b):
        if r.name_a is None and r.name_b is None:
            continue    # all layers' mean
        ta, tb = types_a.get(r.name_a), types_b.get(r.name_b)
        pairs.append(TypePair(r.label, ta, tb, ledger_of(
            *[((t or {}).get("typical_layer") or {}).get("kernels") or [] for t in (ta, tb)])))
    return pairs


def comparison_doc(a: Breakdown, b: Breakdown, name_a: str, name_b: str,
                   kernels: bool = False, rows: list[ComparisonRow] | None = None) -> dict:
    """The figures of ``kimi-perf compare --format json`` (``Comparison.to_json`` adds its
    notes, and how the sides fell back or were captured): the rows (``compare``'s, unless
    given); with ``kernels`` each pair's typical layers and, where A and B are the two decode paths,
    ``fusions``: per layer type the fusion ledger."""
    rows = rows if rows is not None else compare(a, b)
    doc: dict = {"schema": 1, "a": name_a, "b": name_b,
                 "units": {"a": a.unit, "b": b.unit},   # (a CPU run's: ops, CPU time)
                 "rows": [r.to_json() for r in rows]}
    if kernels:
        pairs = type_pairs(a, b, rows)
        doc["typical_layers"] = {p.label: p.typical_json() for p in pairs}
        fusions = {p.label: p.ledger_json(name_a, name_b) for p in pairs if p.ledger}
        if fusions:
            doc["fusions"] = fusions
    return doc


@dataclass
class Comparison:
    """Two breakdowns side by side, with all ``kimi-perf compare`` says of them: ``rows``
    (``compare``), ``side_notes`` (each side's steps and layers, the sides' GPUs or CPU time,
    how two captures were made differently), ``fell_back`` (a path whose every step fell back
    ran the standard path's ops under its own name), ``run_differences`` (of two captures;
    None where the sides are not two captures) and ``labels_said`` (which file each label
    shortened from a file name is)."""

    a: Breakdown
    b: Breakdown
    label_a: str
    label_b: str
    rows: list[ComparisonRow]
    side_notes: list[str]
    fell_back: list[str] = dataclasses.field(default_factory=list)
    run_differences: list[str] | None = None
    labels_said: str | None = None
    inputs: tuple[str, str] | None = None   # what each side is: its file, or run (path)

    @classmethod
    def of(cls, a: Breakdown, b: Breakdown, label_a: str = "A", label_b: str = "B",
           fell_back: list[str] = (), run_differences: list[str] | None = None,
           labels_said: str | None = None) -> Comparison:
        """The comparison of two breakdowns as ``compare`` prints it: its rows (``compare``),
        labelled ``label_a`` and ``label_b``, and the notes under its table (what each side
        counts, GPUs of another kind, ``run_differences``: how two captures were made unlike;
        ``fell_back``: the lines of paths that fell back, kept apart; ``labels_said``: which
        file a short label is)."""
        two_breakdowns("Comparison.of", a, b)
        notes = [*note_lines({label_a: a, label_b: b}), *sides_notes(a, b, label_a, label_b),
                 *([captured_differently(label_a, label_b, run_differences)]
                   if run_differences else [])]
        return cls(a, b, label_a, label_b, compare(a, b, fell_back=bool(fell_back)), notes,
                   list(fell_back), run_differences, labels_said)

    @property
    def table_notes(self) -> list[str]:
        """What the table says under it: its ratios, its pairings, its marks."""
        return comparison_notes(self.rows, self.label_a, self.label_b, self.a.unit, self.b.unit)

    @property
    def notes(self) -> list[str]:
        return [*self.table_notes, *self.side_notes]

    def to_json(self, kernels: bool = False) -> dict:
        """``kimi-perf compare --format json`` (``kernels``: see ``comparison_doc``)."""
        doc = comparison_doc(self.a, self.b, self.label_a, self.label_b, kernels, self.rows)
        if self.run_differences is not None:
            doc["run_differences"] = self.run_differences
        if self.fell_back:
            doc["fell_back"] = self.fell_back
        if self.inputs is not None:
            doc["inputs"] = dict(zip(("a", "b"), self.inputs, strict=True))
        if devices := self.devices:
            doc["devices"] = {label: overview_json(rows) for label, rows in devices.items()}
        doc["notes"] = self.notes
        return doc

    @property
    def devices(self) -> dict[str, list[OverviewRow]]:
        """Each side whose layers ran on several devices (one file of a TP job): its devices'
        rows, spread among themselves (``device_overviews``), by its label."""
        return device_overviews({self.label_a: self.a, self.label_b: self.b})

    def __repr__(self) -> str:
        return f"Comparison({self.label_a!r} vs {self.label_b!r}, {len(self.rows)} rows)"


def compare_files(a: str | Path, b: str | Path | None = None, path_name: str | None = None,
                  labels: tuple[str, str] | None = None, short_labels: bool = False,
                  phase: str = "auto", **breakdown_options) -> Comparison:
    """``kimi-perf compare A [B]`` as a call. ``a`` and ``b``: traces, breakdown JSON files or
    ``kimi-perf trace`` runs (``path_name`` picks a run's decode path); ``a`` alone, a run:
    its first two paths. Traces are broken down over the steps of ``phase`` and as
    ``breakdown_options`` say (``layers``, ``step_regex``, ``rules``). Labels: ``labels``,
    else the file names (``short_labels``: without the words both share, as the table
    shows them) or a run's path names."""
    if labels is not None and not (isinstance(labels, list | tuple)
                                   and all(isinstance(label, str) for label in labels)):
        raise TypeError(f"labels: a tuple of two names, not {type(labels).__name__} "
                        f"{labels!r}")
    if labels is not None and (len(labels) != 2 or not all(labels)
                               or labels[0] == labels[1]):
        raise ValueError(f"labels: 2 distinct names, not {labels!r}")
    a, b = path_argument(a, "a"), None if b is None else path_argument(b, "b")
    labels_said = None
    names = trace_labels([a] if b is None else [a, b])
    runs_a, run_a = load_paths(a, names[0], phase, **breakdown_options)
    if b is None:
        if not run_a or len(runs_a) < 2:
            raise TraceError(a, "compare takes two traces, or one run of two decode paths"
                             + (f": this run holds the {next(iter(runs_a))} path alone"
                                if run_a else ""))
        if path_name is not None:
            raise TraceError(None, f"{argument('--path', 'path_name')} picks a decode path from "
                                   "each of two runs; one run is compared path against path")
        (name_a, ba), (name_b, bb) = list(runs_a.items())[:2]
        run_b = run_a
    else:
        runs_b, run_b = load_paths(b, names[1], phase, **breakdown_options)
        if path_name is not None and run_a is None and run_b is None:
            raise no_run([a, b])
        if path_name is None and run_a is not None and run_b is not None:
            # a run of one path against a run that holds it too: that path, the one to compare
            alone = [next(iter(r)) for r in (runs_a, runs_b) if len(r) == 1]
            if alone and alone[0] in runs_a and alone[0] in runs_b:
                path_name = alone[0]
        if path_name is None and (run_a is None) != (run_b is None):
            # a run's trace (RUN/specialized.kptrace) against a run: the path it captured
            traced, runs = (a, runs_b) if run_a is None else (b, runs_a)
            if (held := captured_path(traced)) in runs:
                path_name = held
        (name_a, ba), (name_b, bb) = (
            one_path(f, runs, path_name) if run is not None else next(iter(runs.items()))
            for f, runs, run in ((a, runs_a, run_a), (b, runs_b, run_b)))
    # a path that fell back on every step ran the standard path's ops under its own name
    fell_back = [paths_that_fell_back((run or {}).get("run")).get(name)
                 for run, name in ((run_a, name_a), (run_b, name_b))]
    # what each side is, where its label is a number: its name, file, or run and path
    whole = ([name_a, name_b] if b is None else
             [str(f) if run is None else f"{f} ({name})"
              for f, run, name in ((a, run_a, name_a), (b, run_b, name_b))])
    inputs = (f"{a} ({name_a})", f"{a} ({name_b})") if b is None else tuple(whole)
    itself = b is not None and (run_a is None or name_a == name_b) and _one_file(a, b)
    if b is not None and name_a == name_b and run_a and run_b:  # one path of two runs
        run_names = [run_name(f) for f in (a, b)]
        if short_labels and labels is None and (
                shown := distinct_words(without_shared_date(run_names))) != run_names:
            # run names that differ by their time alone: the time in the headers
            labels_said = f"{shown[0]}: {a}; {shown[1]}: {b}"
            run_names = shown
        name_a, name_b = (f"{run}:{name_a}" for run in run_names)
    if b is None and short_labels and labels is None and (
            shown := distinct_words([name_a, name_b])) != [name_a, name_b]:
        # a trace --from run's paths are its traces' names: shown as its table shows them
        labels_said = f"{shown[0]}: {name_a}; {shown[1]}: {name_b}"
        name_a, name_b = shown
    two_captures = b is not None and bool(run_a) and bool(run_b)   # (not one run's two paths)
    if labels is not None:
        name_a, name_b = labels
    elif name_a == name_b:
        name_b += "'"
    if short_labels and labels is None and b is not None and not (run_a or run_b):
        # two files' names: the words they share left out, and which file each label is
        # said apart
        shown = distinct_words([name_a, name_b])
        if shown != [name_a, name_b]:
            labels_said = f"{shown[0]}: {a}; {shown[1]}: {b}"
            name_a, name_b = shown
    if short_labels and labels is None and (
            numbered := header_labels([name_a, name_b])) == ["#1", "#2"]:
        # still too long for the headers, or one name twice
        labels_said = f"#1: {whole[0]}; #2: {whole[1]}"
        name_a, name_b = numbered
    compared = Comparison.of(
        ba, bb, name_a, name_b,
        [fell_back_text(name, reason) for name, reason
         in zip((name_a, name_b), fell_back, strict=True) if reason is not None],
        run_differences(run_a, run_b) if two_captures else None, labels_said)
    compared.inputs = inputs
    if b is None and len(runs_a) > 2:   # (a --from run of three traces or more)
        compared.side_notes.insert(0, f"{a} holds {len(runs_a)} paths: compared are its first "
                                      f"two, {', '.join(list(runs_a)[2:5])}"
                                      f"{', …' if len(runs_a) > 5 else ''} left out (its report "
                                      "sets the first against each of the others)")
    # a --tp run's breakdowns are its rank 0's (as its table and report say)
    ranks = [f"{label} is rank 0's of TP {tp}" for label, run in (
        (compared.label_a, run_a), (compared.label_b, run_b)) if (tp := (
            (run or {}).get("run") or {}).get("tp")) and type(tp) is int and tp > 1]
    if ranks:
        compared.side_notes.append(("; ".join(dict.fromkeys(ranks)) if b is not None or
                                    len(ranks) < 2 else
                                    f"both are rank 0's of TP {run_a['run']['tp']}")
                                   + " (every rank's trace: PATH.rankN.trace.json.gz, "
                                   "trace --from sets them side by side)")
    if itself:   # (every ratio 1: a slip, most likely)
        compared.side_notes.insert(0, f"{compared.label_a} and {compared.label_b} are one "
                                      f"file ({a}): compared with itself")
    elif b is not None and not (run_a or run_b) and (twin := same_capture([a, b])):
        compared.side_notes.insert(0, f"{compared.label_a} and {compared.label_b} are one "
                                      f"capture ({twin[0].name}: {twin[1]}): compared with "
                                      "itself")
    return compared


def _one_file(a: Path, b: Path) -> bool:
    """Whether two inputs are one file (a run directory: its breakdown.json), by any name."""
    read = [f / "breakdown.json" if f.is_dir() else f for f in (a, b)]
    try:
        return os.path.samefile(*read)
    except OSError:
        return False
