"""Two breakdowns side by side per layer type: kernels, µs and their ratio."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kimi_perf.breakdown import Breakdown

ALL_LAYERS = "all layers (mean)"


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
    type_b: str | None = None   # B's name of the type, where it differs (``pair_layer_types``)

    @property
    def label(self) -> str:
        """The type as the tables name it: "A", or "A = B" where B names it otherwise."""
        return (self.type or "-") + (f" = {self.type_b}" if self.type_b else "")

    @property
    def span_ratio(self) -> float | None:
        """A's layer time over B's: above 1 means B is faster."""
        if self.span_us_a is None or not self.span_us_b:
            return None
        return round(self.span_us_a / self.span_us_b, 3)

    @property
    def kernel_ratio(self) -> float | None:
        if self.kernels_a is None or not self.kernels_b:
            return None
        return round(self.kernels_a / self.kernels_b, 3)

    def to_json(self) -> dict:
        return {"type": self.type, "type_b": self.type_b,
                "a": {"layers": self.layers_a, "kernels": self.kernels_a,
                      "kernel_us": self.kernel_us_a, "span_us": self.span_us_a},
                "b": {"layers": self.layers_b, "kernels": self.kernels_b,
                      "kernel_us": self.kernel_us_b, "span_us": self.span_us_b},
                "span_ratio": self.span_ratio, "kernel_ratio": self.kernel_ratio,
                "pattern_differs": self.pattern_differs}


def compare(a: Breakdown, b: Breakdown) -> list[ComparisonRow]:
    """Rows for each pair of layer types (``pair_layer_types``; A's order first), then all
    layers' mean."""
    types_a = {t["type"]: t for t in a.layer_types}
    types_b = {t["type"]: t for t in b.layer_types}
    rows = []
    for name_a, name_b in pair_layer_types(a, b):
        label = pair_label(name_a, name_b, a)
        row = _row(label, types_a.get(name_a), types_b.get(name_b))
        if name_b is not None and name_b != label:
            row.type_b = name_b
        rows.append(row)
    if a.layers or b.layers:
        rows.append(_row(ALL_LAYERS, _mean(a), _mean(b)))
    return rows


def pair_layer_types(a: Breakdown | None, b: Breakdown | None
                     ) -> list[tuple[str | None, str | None]]:
    """The layer types of two breakdowns, paired: (A's name, B's name), None for a type one
    side lacks. Types named by ranges pair by name. Types found by the repeating kernel
    pattern (letters in order of first appearance) pair by their kernel sequence's digest,
    whatever their letters (a type B finds first takes the letter A there); the ones left
    over pair in order, as ``patterns_differ`` then says."""
    def kinds(x: Breakdown | None) -> tuple[list[str], dict[str, str]]:
        types = x.layer_types if x is not None else []
        return ([t["type"] for t in types],
                {t["type"]: t["pattern"] for t in types if t.get("pattern") is not None})
    names_a, digest_a = kinds(a)
    names_b, digest_b = kinds(b)
    pairs: dict[str, str | None] = {}
    left_b = [t for t in names_b if t in digest_b]
    for t in names_a:
        if t not in digest_a:
            pairs[t] = t if t in names_b and t not in digest_b else None
        elif (same := next((u for u in left_b if digest_b[u] == digest_a[t]), None)) is not None:
            pairs[t] = same
            left_b.remove(same)
    for t, u in zip([t for t in names_a if t not in pairs], list(left_b), strict=False):
        pairs[t] = u
        left_b.remove(u)
    paired = set(pairs.values())
    return ([(t, pairs.get(t)) for t in names_a]
            + [(None, u) for u in names_b if u not in paired])


def aligned_types(breakdowns: dict[str, Breakdown]) -> list[dict[str, str]]:
    """Each layer type of the first breakdown with what each other one calls it (paired with
    the first by ``pair_layer_types``), then the types only another has: one dict per type,
    label -> that breakdown's name of it (no entry where it has none)."""
    labels = list(breakdowns)
    if not labels:
        return []
    first = breakdowns[labels[0]]
    rows: list[dict[str, str]] = [{labels[0]: t["type"]} for t in first.layer_types]
    row_of = {t["type"]: row for t, row in zip(first.layer_types, rows, strict=True)}
    for label in labels[1:]:
        for name_a, name_b in pair_layer_types(first, breakdowns[label]):
            if name_b is None:
                continue
            if name_a is not None:
                row_of[name_a][label] = name_b
            else:
                rows.append({label: name_b})
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
    return ComparisonRow(name, ta["layers"] if ta else 0, pick(ta, "kernels"),
                         pick(ta, "kernel_us"), pick(ta, "span_us"),
                         tb["layers"] if tb else 0, pick(tb, "kernels"), pick(tb, "kernel_us"),
                         pick(tb, "span_us"), patterns_differ(patterns))


def patterns_differ(patterns) -> bool:
    """Whether a layer type that the repeating kernel pattern found (a digest of its kernel
    sequence per trace; None where ranges named it) ran other sequences in some traces: its
    letter (in order of first appearance) may name different layers there."""
    return len(set(patterns) - {None}) > 1


def _mean(b: Breakdown) -> dict | None:
    if not b.layers:
        return None
    n = len(b.layers)
    return {"layers": n,
            **{k: round(sum(layer[k] for layer in b.layers) / n, 3)
               for k in ("kernels", "kernel_us", "span_us")}}


@dataclass
class OverviewRow:
    """One trace among several: its median step span, and per layer type its median
    kernels and span (None where it has no layer of that type)."""

    label: str
    steps: int
    step_us: float | None
    types: dict[str, tuple[float, float] | None]
    patterns: dict[str, str | None]   # a type found by the kernel pattern: its digest


def differing_patterns(rows: list[OverviewRow]) -> list[str]:
    """Types found by the repeating kernel pattern whose kernel sequence differs between
    traces: their letter may name different layers."""
    types = rows[0].types if rows else {}
    return [t for t in types if patterns_differ(r.patterns[t] for r in rows if r.types[t])]


def overview(breakdowns: dict[str, Breakdown]) -> list[OverviewRow]:
    """Every trace in one table, a row each, the layer types as the first trace names them
    (``aligned_types``; then the types only others have): the view of a TP run's ranks
    (which rank is slow, and in what)."""
    columns: dict[str, dict[str, str]] = {}
    for names_of in aligned_types(breakdowns):
        column = next(iter(names_of.values()))
        while column in columns:
            column += "'"
        columns[column] = names_of
    rows = []
    for label, b in breakdowns.items():
        by_type = {t["type"]: t for t in b.layer_types}
        spans = [s["span_us"] for s in b.steps]
        step_us = statistics.median(spans) if spans else None
        mine = {column: by_type.get(names_of.get(label)) for column, names_of in columns.items()}
        rows.append(OverviewRow(label, len(spans), step_us, {
            column: (t["kernels"], t["span_us"]) if t else None for column, t in mine.items()},
            {column: (t or {}).get("pattern") for column, t in mine.items()}))
    return rows


@dataclass
class Spread:
    """A layer type's (or the step's: type None) median span across traces, and the slowest
    trace (the first of equals; None when all are equal)."""

    type: str | None
    fastest: float
    slowest: float
    slowest_label: str | None

    @property
    def ratio(self) -> float | None:
        return round(self.slowest / self.fastest, 3) if self.fastest else None


def spreads(rows: list[OverviewRow]) -> list[Spread]:
    """Per layer type and for the step, the fastest and slowest trace's median span."""
    out = []
    for layer_type in [None, *(rows[0].types if rows else ())]:
        values = [(r.step_us if layer_type is None else r.types[layer_type][1], r.label)
                  for r in rows
                  if (r.step_us if layer_type is None else r.types[layer_type]) is not None]
        if len(values) >= 2:
            fast = min(v for v, _ in values)
            slow, label = max(values, key=lambda v: v[0])   # the first of equals
            out.append(Spread(layer_type, fast, slow, label if slow > fast else None))
    return out


def stragglers(spread: list[Spread]) -> dict[str, list[str]]:
    """Each slowest trace and what it was slowest in ("step", layer types)."""
    out: dict[str, list[str]] = {}
    for s in spread:
        if s.slowest_label is not None:
            out.setdefault(s.slowest_label, []).append("step" if s.type is None else s.type)
    return out


def ratio_text(v: float | None) -> str:
    """A ratio to two decimals, or to two significant digits below 0.1 (a CPU run's fused
    path in Triton's interpreter is hundreds of times slower: 0.0041, not 0.00)."""
    return "-" if v is None else f"{v:.2f}" if v == 0 or abs(v) >= 0.1 else f"{v:.2g}"
