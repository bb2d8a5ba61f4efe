"""HTML layer-timeline report (plotly) for one or more breakdowns of traces.

In order: what ran (the run's request, machine and versions; the traces for ``--from``), the
decode metrics of each path, the first trace against each other per layer type, each layer
type's typical layer kernel by kernel, side by side; then per trace the timeline of one decode
step (its median-span step), one row per layer, every kernel a bar coloured by class; and per
layer type the median µs by kernel class. One file that opens offline (plotly.js inline unless
asked otherwise). Every name from a trace is HTML-escaped: kernel names carry ``<`` and ``>``.
"""

from __future__ import annotations

import html
import os
import stat
import textwrap
import urllib.parse
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kimi_perf.comparison import (
    OverviewRow,
    aligned_types,
    aligned_typical,
    compare,
    comparison_notes,
    count_text,
    device_overviews,
    differing_patterns,
    gpus_text,
    of_devices,
    overview,
    overview_notes,
    patterns_differ,
    ratio_text,
    rotation_notes,
    sides_notes,
    spreads,
    type_pairs,
)
from kimi_perf.decode.fallbacks import fell_back_text, paths_that_fell_back
from kimi_perf.errors import TraceError, argument, path_argument, path_list, stat_problem
from kimi_perf.layer_breakdown import (
    SPREAD_NOTE,
    Breakdown,
    layer_notes,
    layers_text,
    spread_text,
    step_notes,
    step_part_text,
    units_word,
)
from kimi_perf.names import demangle, primed, short_names
from kimi_perf.runs import (
    captured_differently,
    is_finite_number,
    is_stored,
    load_paths,
    no_run,
    one_path,
    ranks_missing,
    run_differences,
    run_name,
    trace_files,
    trace_labels,
    without_shared_date,
)
from kimi_perf.text import counted, header_labels
from kimi_perf.trace import atomic_write_text, printable

CLASS_COLOURS = {
    "gemm": "#4c78a8", "attention": "#f58518", "moe": "#54a24b", "router": "#b279a2",
    "norm": "#eeca3b", "rope": "#9d755d", "elementwise": "#bab0ac", "communication": "#e45756",
    "memcpy": "#72b7b2", "conv": "#ff9da6", "other": "#7f7f7f",
}


def _plotly_text(name: str) -> str:
    """A name for plotly's text, which reads a few HTML tags and entities: ``<``, ``>`` and
    ``&`` escaped, quotes left as they are (plotly would show ``&quot;`` as it is)."""
    return _escaped(name, quote=False)


# Bars in all the report's timelines: plotly draws each as an SVG element, and a browser
# crawls past some tens of thousands (eight ranks of 10,000 ops each were 33 MB of JSON)
REPORT_TIMELINE_OPS = 20_000


def _timeline(fig: go.Figure, row: int, timeline: dict | None, label: str, most: int,
              in_legend: set[str]) -> int:
    """The breakdown's timeline step: a row per layer in time order (where no layer was
    found, a row per stream), every op a bar coloured by class; its first ``most`` ops. A
    class enters the legend once, in the first row that has it (``in_legend``: those already
    in). Returns the ops drawn."""
    if not timeline:
        return 0
    # a template's arguments tell its kernels apart (the functor of an elementwise kernel):
    # kept to 400 characters, in lines of 100, so that a hover box stays on the screen
    readable = ["<br>".join(_plotly_text(line) for line in textwrap.wrap(name, 100))
                for name in short_names(timeline["names"], 400)]
    bars: dict[str, dict[str, list]] = {}
    rows: list[str] = []
    drawn = 0
    seen: Counter = Counter()
    for segment, ops in zip(timeline["segments"], _first_ops(timeline, most), strict=True):
        if not ops:
            continue
        drawn += len(ops)
        # a row per segment: a label a step holds again (a second forward pass with the same
        # ranges) gets its ordinal, or plotly would stack both on one row
        seen[segment["label"]] += 1
        name = _plotly_text(segment["label"] + (f" #{seen[segment['label']]}"
                                                if seen[segment["label"]] > 1 else ""))
        rows.append(name)
        for op, cls, start_us, dur_us in ops:
            bar = bars.setdefault(cls, {"y": [], "base": [], "x": [], "text": []})
            bar["y"].append(name)
            bar["base"].append(start_us)
            bar["x"].append(max(dur_us, 1e-3))
            bar["text"].append(f"{readable[op]}<br>"
                               f"{_plotly_text(cls)}, {dur_us:.2f} µs at {start_us:.2f} µs")
    for cls, bar in sorted(bars.items()):
        fig.add_trace(go.Bar(orientation="h", name=_plotly_text(cls), legendgroup=cls,
                             showlegend=cls not in in_legend,
                             marker_color=CLASS_COLOURS.get(cls, "#333333"),
                             y=bar["y"], base=bar["base"], x=bar["x"], hovertext=bar["text"],
                             hoverinfo="text"), row=row, col=1)
        in_legend.add(cls)
    # rows in the step's order (plotly's own: as the first class's bars name them)
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=rows,
                     title_text=_plotly_text(label), row=row, col=1)
    how = "; no layer found: a row per stream" if timeline.get("by_stream") else ""
    fig.update_xaxes(title_text=f"µs into {_plotly_text(timeline['step'])} (median-span step"
                                f"{how})", row=row, col=1)
    return drawn


# Timelines share a time axis where their steps' extents are within this factor of each other.
SHARED_AXIS_SPANS = 10.0


def alike_groups(sizes: dict[str, float]) -> list[list[str]]:
    """The labels in groups whose sizes are all within ``SHARED_AXIS_SPANS`` of each other
    (the smallest and the largest of a group, not each against its first: 1, 9 and 0.11
    would be one group), in order of first appearance; a size of 0 with those of 0."""
    groups: list[tuple[float, float, list[str]]] = []
    for label, size in sizes.items():
        for i, (low, high, labels) in enumerate(groups):
            lo, hi = min(low, size), max(high, size)
            if (hi == 0) or (lo > 0 and hi / lo <= SHARED_AXIS_SPANS):
                groups[i] = (lo, hi, [*labels, label])
                break
        else:
            groups.append((size, size, [label]))
    return [labels for _, _, labels in groups]


def _timeline_extent(timeline: dict) -> float:
    """Where a drawn step's last op ends (µs from its start)."""
    return max((op[2] + op[3] for seg in timeline["segments"] for op in seg["ops"]),
               default=0.0)


def _first_ops(timeline: dict, most: int) -> list[list]:
    """Of each segment, the ops among the timeline's first ``most``: its segments in turn
    (a step's layers follow one another), or where they are streams (``by_stream``), which
    run side by side, the first in time, whatever their stream."""
    segments = [seg["ops"] for seg in timeline["segments"]]
    if not timeline.get("by_stream"):
        kept = []
        for ops in segments:
            kept.append(ops[:max(most, 0)])
            most -= len(kept[-1])
        return kept
    starts = np.concatenate([np.array([op[2] for op in ops], float) for ops in segments]
                            + [np.empty(0)])
    if len(starts) <= most:
        return segments
    if most <= 0:
        return [[] for _ in segments]
    cut = np.sort(starts)[most - 1]
    # every op that starts before the cut, then of those at it as many as leave room (each
    # row stays in time order: its ops at the cut come after those before it)
    kept = [[op for op in ops if op[2] < cut] for ops in segments]
    room = most - sum(map(len, kept))
    for ops, held in zip(segments, kept, strict=True):
        at = [op for op in ops if op[2] == cut][:room]
        room -= len(at)
        held += at
    return kept


def _class_bars(breakdowns: dict[str, Breakdown]) -> go.Figure:
    """Median µs per layer type by kernel class, stacked. GPU traces whose layers take alike
    (the largest type's µs within ``SHARED_AXIS_SPANS`` of each other) share a panel; each
    CPU run's path gets one of its own: a CPU's µs and a GPU's differ a thousandfold, and a
    path in Triton's interpreter takes hundreds of times a PyTorch path's CPU time, so that
    on one axis the other's bars would not show (nor a 58 µs decode layer's beside a 5 ms
    training block's)."""
    groups = alike_groups({
        label: max((sum(c["us"] for c in t["classes"].values()) for t in b.layer_types),
                   default=0.0)
        for label, b in breakdowns.items() if b.unit == "kernels" and b.layer_types})
    panels = {("GPU traces" if i == 0 else f"GPU traces on a scale of their own "
               f"({SHARED_AXIS_SPANS:g}x apart): {', '.join(labels)}"): labels
              for i, labels in enumerate(groups)}
    panels |= {f"CPU run: {label} (CPU time)": [label]   # (a trace of no layers: no bars)
               for label, b in breakdowns.items() if b.unit != "kernels" and b.layer_types}
    titles = [_plotly_text(title) for title in panels]
    rows = len(panels) or 1
    # a gap of PANEL_GAP px between panels of PANEL_PX each, in the figure's fractions (a
    # fraction of its own grew with the panels, past what plotly allows at 8 of them)
    fig = make_subplots(rows=rows, cols=1, vertical_spacing=PANEL_GAP / (PANEL_PX * rows),
                        subplot_titles=titles if len(panels) > 1 or "GPU traces" not in panels
                        else None)
    classes = sorted({c for b in breakdowns.values() for t in b.layer_types
                      for c in t["classes"]})
    for row, labels in enumerate(panels.values(), start=1):
        for cls in classes:
            x, y = [], []
            for label in labels:
                for t in breakdowns[label].layer_types:
                    x.append(f"{_plotly_text(t['type'] or '-')}<br>{_plotly_text(label)}")
                    y.append(t["classes"].get(cls, {}).get("us", 0.0))
            fig.add_trace(go.Bar(name=_plotly_text(cls), x=x, y=y, legendgroup=cls,
                                 showlegend=row == 1, marker_color=CLASS_COLOURS.get(cls)),
                          row=row, col=1)
        fig.update_yaxes(title_text="µs", row=row, col=1)
    fig.update_layout(barmode="stack", title="Median µs per layer, by kernel class",
                      height=PANEL_PX * rows)
    return fig


PANEL_PX, PANEL_GAP = 450, 100   # the class chart's height a panel, and the gap between two


def _units(breakdowns: dict[str, Breakdown]) -> str:
    """The word for what several traces count: "kernels", "ops", or both."""
    return units_word(b.unit for b in breakdowns.values())


def report_pairs(breakdowns: dict[str, Breakdown],
                 pairs: Sequence[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """The comparisons a report draws: ``pairs`` where given (``ReportInputs.pairs``), else
    the first trace against each of the others."""
    if pairs is not None:
        return list(pairs)
    labels = list(breakdowns)
    return [(labels[0], other) for other in labels[1:]]


def _short_labels(labels: list[str], labelled: bool = False) -> dict[str, str]:
    """Each label as the tables' headers show it: without the words all of a report's labels
    share, or numbered where one is still long (``header_labels``: each name fills three
    columns), one name for a trace in every table that sets traces side by side (sections of
    one trace, or prose, name it in full); runs of one day without their date
    (``without_shared_date``). A label alone is kept whole, and so are labels of the
    user's own (``--labels``: as compare keeps them)."""
    if len(labels) < 2 or labelled:
        return dict(zip(labels, labels, strict=True))
    return dict(zip(labels, header_labels(without_shared_date(labels)), strict=True))


def _said(short: dict[str, str], labels: list[str]) -> str:
    """A line saying which trace each of ``labels``' short names is (none where no name was
    shortened)."""
    said = "; ".join(f"{short[label]}: {label}" for label in labels if short[label] != label)
    return f"<p>{_escaped(said)}</p>" if said else ""


def _comparison_html(breakdowns: dict[str, Breakdown], pairs: list[tuple[str, str]],
                     fell_back: Collection[str] = (), short: dict[str, str] | None = None
                     ) -> str:
    """Each pair of traces (``report_pairs``), per layer type; and the work of each trace
    that fell in no step."""
    labels = list(breakdowns)
    unit = {label: b.unit for label, b in breakdowns.items()}
    short = short or _short_labels(labels)
    e = _escaped
    parts = []
    for label in labels:
        b = breakdowns[label]
        parts += [f"<p>{e(label)}: {e(note)}.</p>" for note in [*step_notes(b), *layer_notes(b)]]
    a = labels[0] if labels else None
    if len(labels) == 1 and breakdowns[a].layer_types:  # nothing to compare with: its figures
        body = "".join(
            f"<tr><td>{e(t['type'] or '-')}</td><td>{t['layers']}</td>"
            f"<td>{count_text(t['kernels'])}</td><td>{t['kernel_us']:.1f}</td>"
            f"<td>{t['span_us']:.1f}</td><td>{t['gap_us']:.1f}</td></tr>"
            for t in breakdowns[a].layer_types)
        parts.append(f"<h2>Per layer type: {e(a)} (medians over layers and steps)</h2>"
                     f"<table><tr><th>layer type</th><th>layers (all steps)</th>"
                     f"<th>{unit[a]}</th><th>{unit[a][:-1]} µs</th><th>span µs</th>"
                     "<th>gap µs</th></tr>"
                     f"{body}</table>")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    for label_a, label_b in pairs:
        rows = compare(breakdowns[label_a], breakdowns[label_b],
                       fell_back=label_a in fell_back or label_b in fell_back)
        counted = unit[label_a] if unit[label_a] == unit[label_b] else "count"
        a, b, said = short[label_a], short[label_b], _said(short, [label_a, label_b])
        head = (f"<tr><th>layer type</th><th>{e(a)} layers</th><th>{e(a)} {unit[label_a]}</th>"
                f"<th>{e(a)} µs</th><th>{e(b)} layers</th><th>{e(b)} {unit[label_b]}</th>"
                f"<th>{e(b)} µs</th><th>µs ratio</th>"
                f"<th>{counted} ratio</th></tr>")
        body = "".join(
            f"<tr><td>{e(r.label)}{' *' if r.marked else ''}</td>"
            f"<td>{r.layers_text('a')}</td><td>{count_text(r.kernels_a)}</td>"
            f"<td>{fmt(r.span_us_a, '.1f')}</td><td>{r.layers_text('b')}</td>"
            f"<td>{count_text(r.kernels_b)}</td>"
            f"<td>{fmt(r.span_us_b, '.1f')}</td><td>{ratio_text(r.span_ratio)}</td>"
            f"<td>{ratio_text(r.kernel_ratio)}</td></tr>"
            for r in rows)
        note = "".join(f"<p>{e(line)}.</p>" for line in [
            *comparison_notes(rows, a, b, unit[label_a], unit[label_b]),
            *sides_notes(breakdowns[label_a], breakdowns[label_b], a, b)])
        parts.append(f"<h2>Per layer type: {e(a)} vs {e(b)} (medians; µs = layer span)</h2>"
                     f"{said}<table>{head}{body}</table>{note}")
    return "".join(parts)


STEP_ROWS = 20   # steps listed per trace; the rest are counted (kimi-perf breakdown lists all)


def _steps_html(breakdowns: dict[str, Breakdown]) -> str:
    """Each trace's steps, as breakdown's steps table has them (its first STEP_ROWS), with
    their median: a trace where no layer was found still has its figures here."""
    e = _escaped
    parts = []
    for label, b in breakdowns.items():
        if not b.steps:
            continue
        unit = b.unit
        rows = "".join(
            f"<tr><td>{s['index']}</td><td class=name>{_shown(s.get('name') or '')}</td>"
            f"<td>{'cpu' if unit == 'ops' and s['device'] < 0 else s['device']}</td>"
            f"<td>{e(layers_text(s))}</td><td>{s['kernels']}</td>"
            f"<td>{s['kernel_us']:.1f}</td><td>{s['span_us']:.1f}</td>"
            f"<td>{s['gap_us']:.1f}</td>"
            + "".join(f"<td>{step_part_text(s, part)}</td>" for part in ("prologue",
                                                                          "epilogue"))
            + "</tr>" for s in b.steps[:STEP_ROWS])
        median = {k: float(np.median([s[k] for s in b.steps]))
                  for k in ("kernels", "kernel_us", "span_us", "gap_us")}
        # (each column's own median: they need not add up, as a step's figures do)
        rows += (f"<tr><th colspan=4>median of {counted(len(b.steps), 'step')} (each "
                 "column's own)</th>"
                 f"<td>{count_text(median['kernels'])}</td><td>{median['kernel_us']:.1f}</td>"
                 f"<td>{median['span_us']:.1f}</td><td>{median['gap_us']:.1f}</td>"
                 "<td></td><td></td></tr>")
        more = len(b.steps) - STEP_ROWS
        parts.append(f"<h3>{e(label)}</h3><table><tr><th>step</th><th>range</th>"
                     f"<th>device</th><th>layers</th><th>{unit}</th><th>{unit[:-1]} µs</th>"
                     f"<th>span µs</th><th>gap µs</th><th>prologue {unit} / span µs</th>"
                     f"<th>epilogue {unit} / span µs</th></tr>{rows}</table>"
                     + (f"<p>and {more} more steps (kimi-perf breakdown lists them).</p>"
                        if more > 0 else ""))
    return ("<h2>Steps</h2><p>A step's prologue: its kernels before its first layer (and "
            "their span), its epilogue: those after its last (the logits, a sampler); gap µs: "
            "the idle time between its kernels.</p>" + "".join(parts) if parts else "")


def _overview_html(breakdowns: dict[str, Breakdown], of_paths: bool = False,
                   short: dict[str, str] | None = None) -> str:
    """Three traces or more (a TP run's ranks, say): every one in one table (``overview``; a
    row per device of a trace of several), with the spread of each layer type's span and the
    slowest trace; ``of_paths``: the traces are the decode paths of several runs, whose spread
    would set one path against another (no spread). Of fewer, each trace of several devices
    gets its own table of them (``device_overviews``)."""
    short = short or _short_labels(list(breakdowns))   # (as the tables below name them)
    if len(breakdowns) >= 3:
        return _overview_rows_html(overview(breakdowns, tested=not of_paths), breakdowns,
                                   short, of_paths)
    return "".join(_overview_rows_html(rows, {label: breakdowns[label]}, short, of=(
        short[label] if len(breakdowns) > 1 else None))
        for label, rows in device_overviews(breakdowns).items())


def _overview_rows_html(rows: list[OverviewRow], breakdowns: dict[str, Breakdown],
                        short: dict[str, str], of_paths: bool = False, of: str | None = None
                        ) -> str:
    """``overview``'s rows of ``breakdowns`` as a table, with its notes (``of``: the trace
    whose devices they are, where the title names it)."""
    e = _escaped
    devices = of_devices(rows)
    # each row's name: its trace's short name (and its device); one trace's rows are devices
    named = {r.label: r.label if devices else short[r.trace] + (
        "" if r.device is None else f" device {r.device}") for r in rows}
    what = "device" if devices else "trace"
    types = list(rows[0].types)
    differ = differing_patterns(rows)
    spread = {} if of_paths else {s.type: s for s in spreads(rows)}
    head = f"<tr><th>{what}</th><th>steps</th><th>step µs</th>" + "".join(
        f"<th>{e(t or '-')}{' *' if t in differ else ''} µs</th>" for t in types) + "</tr>"
    body = "".join(
        f"<tr><td>{e(named[r.label])}</td><td>{r.steps}</td>"
        f"<td>{'-' if r.step_us is None else f'{r.step_us:.1f}'}</td>" + "".join(
            f"<td>{v[1]:.1f} ({count_text(v[0])})</td>" if v else "<td>-</td>"
            for v in r.types.values()) + "</tr>" for r in rows)
    foot = "" if of_paths else "<tr><th>slowest / fastest</th><th></th>" + "".join(
        f"<th>{ratio_text(spread[t].ratio)}×</th>" if t in spread and spread[t].ratio
        else "<th>-</th>" for t in [None, *types]) + "</tr>"
    note = "".join(f"<p>{e(said[0].upper() + said[1:])}.</p>" for said in overview_notes(
        rows, list(spread.values()), named, len(types), of_paths))
    if not devices:
        note = _said(short, list(breakdowns)) + note
    title = f"Every {what}" + (f" of {e(of)}" if of else "")
    return (f"<h2>{title} (medians; µs = span, layer {_units(breakdowns)} in brackets)"
            f"</h2><table>{head}{body}{foot}</table>{note}")


# rows of a typical layer's table (a type the repeating pattern cut from stretches of
# unlike work can hold thousands: a megabyte of table no one reads)
TYPICAL_ROWS = 300


def _typical_html(breakdowns: dict[str, Breakdown], short: dict[str, str] | None = None
                  ) -> str:
    """Per layer type, its typical layer in every trace side by side: kernels in order, each
    with its class and median µs (the full name on hover)."""
    unit = {label: b.unit for label, b in breakdowns.items()}
    e = _escaped
    short = short or _short_labels(list(breakdowns))
    parts = []
    for names_of in aligned_types(breakdowns):   # paired as compare and the gate pair them
        # the traces that hold the type, alone (with many traces, a type two hold had a
        # column triplet for each, empty)
        sides = {label: next((t for t in b.layer_types if t["type"] == names_of.get(label)),
                             None) for label, b in breakdowns.items() if label in names_of}
        layer_type = next(iter(names_of.values()))
        called = "; ".join(f"{short[label]} calls it {name}"
                           for label, name in names_of.items() if name != layer_type)
        if len(names_of) < len(breakdowns):   # a type not every trace holds
            held = [short[label] for label in breakdowns if label in names_of]
            called = "; ".join(filter(None, [f"only in {', '.join(held)}", called]))
        typical, shifts = aligned_typical({label: (t or {}).get("typical_layer")
                                           for label, t in sides.items()})
        if not any(typical.values()):
            continue
        head = "<tr><th>#</th>" + "".join(
            f"<th>{e(short[label])} {unit[label][:-1]}</th><th>class</th><th>µs</th>"
            for label in sides
        ) + "</tr>"
        whole = {label: demangle([k["name"] for k in t["kernels"]]) if t else []
                 for label, t in typical.items()}
        names = {label: short_names(w, 100) for label, w in whole.items()}  # demangled once
        rows = []
        longest = max(len(n) for n in names.values())
        for i in range(min(longest, TYPICAL_ROWS)):
            cells = [f"<td>{i + 1}</td>"]
            for label, t in typical.items():
                if t and i < len(t["kernels"]):
                    k = t["kernels"][i]
                    cells.append(f"<td class=name title=\"{e(whole[label][i])}\">"
                                 f"{e(names[label][i])}</td><td>{e(k['class'])}</td>"
                                 f"<td>{spread_text(k)}</td>")
                else:
                    cells.append("<td></td><td></td><td></td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        if longest > TYPICAL_ROWS:   # (a "layer" of thousands: a stretch, not a layer)
            rows.append(f"<tr><td colspan={1 + 3 * len(typical)}>… {longest - TYPICAL_ROWS:,} "
                        "more (kimi-perf breakdown --kernels lists them all; the totals "
                        "below count them)</td></tr>")
        foot = "<tr><th></th>" + "".join(
            f"<th colspan=2>{len(t['kernels'])} {unit[label]}, {t['layers']} of "
            f"{counted(sides[label]['layers'], 'layer')} ran "
            "exactly these</th>"
            f"<th>{sum(k['us'] for k in t['kernels']):.1f} µs, medians summed</th>" if t else
            "<th colspan=3></th>" for label, t in typical.items()) + "</tr>"
        spread = any("spread_us" in k for t in typical.values() if t for k in t["kernels"])
        differ = "".join(f"<p>{e(note)}.</p>" for note in [
            *rotation_notes(shifts, typical, _units(breakdowns)),
            *([SPREAD_NOTE] if spread else [])])
        if patterns_differ((t or {}).get("pattern") for t in sides.values()):
            differ += (f"<p>* {e(layer_type)} was lettered by its kernel sequence, with "
                       "other kernel sequences: the letter may name different layers.</p>")
        parts.append(f"<h3>Typical {e(layer_type)} layer{f' ({e(called)})' if called else ''}: "
                     f"{_units(breakdowns)} in order, median µs</h3><table>{head}"
                     f"{''.join(rows)}{foot}</table>{differ}")
    if not parts:
        return ""
    heading = {"kernels": "Kernel by kernel", "ops": "Op by op"}.get(
        _units(breakdowns), "Kernel by kernel (op by op on a CPU)")
    return (f"<h2>{heading}</h2><p>Each layer type's typical layer: the sequence of "
            f"{_units(breakdowns)} most of its layers ran, each with its median µs over those "
            "layers (hover a name for the whole of it).</p>"
            + _said(short, list(breakdowns)) + "".join(parts))


def _fusions_html(breakdowns: dict[str, Breakdown], pairs: list[tuple[str, str]]) -> str:
    """Where a pair of traces (``report_pairs``) is the two decode paths of this repository
    (their launches annotated: a CPU run, say), each fused launch against the standard
    launches whose work it does, per layer type (``kimi_perf.decode.fusions``), paired as
    compare pairs them."""
    e = _escaped
    parts = []
    on_cpu = False
    for first, other in pairs:
        for pair in type_pairs(breakdowns[first], breakdowns[other]):
            if pair.a is None or pair.ledger is None:
                continue
            t = pair.a
            on_cpu |= "ops" in (breakdowns[first].unit, breakdowns[other].unit)
            swapped, rows, left = pair.ledger
            standard, specialized = (other, first) if swapped else (first, other)
            body = "".join(
                f"<tr><td class=name>{e(r.launch)}</td><td>{r.us:.1f}</td>"
                f"<td class=name>{e(' + '.join(r.replaces) or '(new work)')}</td>"
                f"<td>{r.replaced_us:.1f}</td>"
                f"<td>{ratio_text(r.ratio)}</td></tr>" for r in rows)
            total = (f"<tr><th>{len(rows)} launches</th><th>{sum(r.us for r in rows):.1f}</th>"
                     f"<th>{sum(len(r.replaces) for r in rows)} launches</th>"
                     f"<th>{sum(r.replaced_us for r in rows):.1f}</th><th></th></tr>")
            unplaced = (f"<p>{e(standard)} launches no {e(specialized)} launch took: "
                        f"{e(', '.join(left))}</p>" if left else "")
            parts.append(f"<h3>{e(t['type'])}: each {e(specialized)} launch against the "
                         f"{e(standard)} launches it replaces</h3><table><tr><th>"
                         f"{e(specialized)} launch</th><th>µs</th><th>replaces ({e(standard)})"
                         "</th><th>their µs</th><th>ratio</th></tr>"
                         f"{body}{total}</table>{unplaced}")
    if not parts:
        return ""
    return ("<h2>Fusions, launch by launch</h2><p>Median µs in each path's typical layer; "
            "ratio: what was replaced over what replaced it (above 1: the fusion is faster)."
            "</p>" + ("<p class=warn>On a CPU run these µs are CPU time, and the specialized "
                      "path's launches ran in Triton's interpreter, hundreds of times slower "
                      "than a GPU runs them: the ratios are no speed figure; the tables say "
                      "which launches replace which.</p>" if on_cpu else "")
            + "".join(parts))


def _capture_items(run: dict) -> list[tuple[str, object]]:
    """What a capture ran, as (what, value) rows: the request and the machine (nothing for
    a run of traces analysed, ``trace --from``). A value of None: not recorded."""
    env = run.get("environment") or {}
    items: list[tuple[str, object]] = []
    if "preset" in run:
        request = run.get("request") or {}
        items += [("preset", f"{run['preset']}, {run.get('n_layers')} layers (config "
                             f"{run.get('config_hash')})"),
                  ("batch", run.get("batch")),
                  ("TP", f"{run.get('tp')}"
                   + (f" (one rank of TP {shapes}'s shapes)"
                      if (shapes := run.get("rank_shapes_tp", run.get("tp"))) != run.get("tp")
                      else "")),
                  ("context", _tokens(run.get("context"))),
                  ("decode steps", f"{run.get('decode_steps')} profiled after "
                                   f"{run.get('warmup_steps')} warm-up"
                                   + (f"; each a speculative verify of 1+{k} tokens per "
                                      "sequence" if (k := run.get("spec_tokens")) else "")),
                  ("seed", request.get("seed")),
                  ("CUDA graphs", "on" if request.get("graphs") else "off"),
                  ("profiler", request.get("backend")), ("KV cache", request.get("kv_cache")),
                  ("experts", request.get("experts", "bf16"))]
        opt_ins = [name for name, on in (
            ("L2 prefetch of o_proj's weights", request.get("l2_prefetch")),
            (f"experts grouped from {_tokens(request.get('group_experts_from'))}",
             request.get("group_experts_from") is not None),
            ("programmatic dependent launch", request.get("pdl"))) if on]
        # (its opt-ins where it ran, and is drawn: else none to say)
        if "specialized" in (run.get("paths_drawn") or request.get("paths") or ["specialized"]):
            items.append(("specialized path's opt-ins", ", ".join(opt_ins) or "none"))
        gpus = env.get("gpus") or []
        items += [("device", ", ".join(gpus) if gpus else env.get("device")),
                  ("CPU threads", None if gpus else env.get("cpu_threads")),
                  ("driver, CUDA", f"{env.get('driver')}, {env.get('cuda')}" if gpus else None),
                  ("python, torch, triton", f"{env.get('python')}, {env.get('torch')}, "
                                            f"{env.get('triton')}")]
    return items


def _tokens(n: object) -> str:
    return counted(n, "token") if isinstance(n, int) else f"{n} tokens"


def capture_said(run: dict) -> str | None:
    """How a capture was made, on one line (what the report's first table says but the seed
    and the versions); None for a run of traces analysed (``trace --from``)."""
    shown = [(what, v) for what, v in _capture_items(run) if v is not None and what not in (
        "seed", "driver, CUDA", "python, torch, triton")]
    return "; ".join(f"{what} {v}" for what, v in shown) or None


def _escaped(text: str, quote: bool = True) -> str:
    """Text of a trace's, a run's or a file's in the page: escaped, its control characters
    written out (a right-to-left override in a stored baseline's text would reorder the
    page's)."""
    return html.escape(printable(text), quote=quote)


def _shown(value: object) -> str:
    """A value from a trace or a run (a range's name, a file's, the command) in a cell:
    escaped, its control characters written out (a newline or a right-to-left override in a
    file name would break or reorder the page's text)."""
    return _escaped(str(value))


def _version_items(run: dict) -> list[tuple[str, object]]:
    env = run.get("environment") or {}
    commit = env.get("git_commit") or run.get("git_commit")
    version = env.get("kimi_perf") or run.get("kimi_perf")
    return [("kimi-perf", f"{version}" + (f", commit {commit}" if commit else "")
             if version else None),
            ("date", run.get("date")), ("command", run.get("command"))]


def _runs_html(runs: list[tuple[str, dict]]) -> str:
    """Several runs drawn together (a baseline and tonight's run): what each ran, a column
    each, and how each was captured unlike the first (``runs.run_differences``)."""
    if len(runs) < 2:
        return ""
    e = _escaped
    # (the same run twice: told apart as the drawn labels are)
    runs = list(zip(primed([name for name, _ in runs]), (r for _, r in runs), strict=True))
    columns = [dict(_capture_items(r) + _version_items(r)) for _, r in runs]
    rows = [k for k in dict.fromkeys(k for c in columns for k in c)
            if any(c.get(k) is not None for c in columns)]
    # a row whose values differ in bold (the date and command of two runs always do)
    body = "".join(
        f"<tr{' class=differs' if len({str(c.get(k)) for c in columns}) > 1 else ''}>"
        f"<th>{e(k)}</th>" + "".join(
            f"<td>{_shown(c[k]) if c.get(k) is not None else '-'}</td>" for c in columns)
        + "</tr>" for k in rows)
    (first, first_run), *others = runs
    notes = "".join(
        f"<p class=note>{e(captured_differently(first, name, found))}.</p>"
        for name, r in others
        if (found := run_differences({"run": first_run}, {"run": r},
                                     paths="paths_drawn" not in r)))
    # each run's decode metrics, path by path (a baseline's tokens/s beside tonight's)
    measured = "".join(
        f"<tr><td>{e(name)}</td><td>{e(str(path))}</td>"
        f"<td>{m['decode_tokens_per_s']:.1f}</td>"
        f"<td>{m['time_to_first_token_s'] * 1e3:.1f}</td>"
        f"<td>{m['step_latency_s']['median'] * 1e3:.2f}</td>"
        f"<td>{e(str(m.get('timed') or '-'))}</td>"
        f"<td>{e('; '.join(m.get('fallbacks') or []) or '-')}</td></tr>"
        for name, r in runs for path, m in (r.get("paths") or {}).items())
    # whose time to first token is a process's first forward pass: a run each, or once
    # where every run says the same
    first = {name: said for name, r in runs if (said := first_forward_text(r))}
    first_said = ([f"In each run, {next(iter(first.values()))}"]
                  if len(first) == len(runs) and len(set(first.values())) == 1
                  else [f"{name}: {said}" for name, said in first.items()])
    metrics = ("<h3>Decode metrics</h3><table><tr><th>run</th><th>path</th>"
               "<th>decode tokens/s</th><th>time to first token, ms</th>"
               "<th>step, ms (median)</th><th>timed</th><th>calls that fell back</th></tr>"
               f"{measured}</table>" + "".join(f"<p class=note>{e(said, quote=False)}.</p>"
                                              for said in first_said)
               if measured else "")
    return ("<h2>Runs</h2><table class=info><tr><th></th>"
            + "".join(f"<th>{e(name)}</th>" for name, _ in runs)
            + f"</tr>{body}</table>{notes}{metrics}")


def _run_html(run: dict | None, breakdowns: dict[str, Breakdown]) -> str:
    """What ran and where: the request, the machine and the versions of a capture; of
    traces analysed (``--from``, a report of traces or stored breakdowns), each trace and the
    GPUs that ran its kernels. Then each path's decode metrics, and a CPU run's caveat."""
    e = _escaped
    run = run or {}
    env = run.get("environment") or {}
    items = _capture_items(run)
    # traces analysed, not captured (trace --from, or a report of traces and breakdowns)
    for label, b in breakdowns.items() if "preset" not in run else ():
        src = b.source
        # (a breakdown stored before gpus_ran was recorded: the GPUs its trace described)
        gpus = (f"ran on {gpus_text(src['gpus_ran'], src.get('tool'))}"
                if src.get("gpus_ran") is not None
                else f"GPUs described: {gpus_text(src.get('gpus') or [], src.get('tool'))}")
        # (a trace --from run's files: from its run directory, as its run.json has them)
        where = ", from the run directory" if run.get("files") else ""
        items.append((f"trace {label}", f"{src.get('file')} ({src.get('tool')} "
                                        f"{src.get('format')}{where}; {gpus})"
                      + "".join(f", joined by the graph captures of {c}"
                                for c in src.get("captures") or [])))
    items += _version_items(run)
    parts = ["<table class=info>" + "".join(
        f"<tr><th>{e(k)}</th><td>{_shown(v)}</td></tr>" for k, v in items if v is not None)
        + "</table>"]
    metrics = run.get("paths") or {}
    if metrics:
        rows = "".join(
            f"<tr><td>{e(path)}</td><td>{e(str(m.get('model')))}</td>"
            f"<td>{m['decode_tokens_per_s']:.1f}</td>"
            f"<td>{m['time_to_first_token_s'] * 1e3:.1f}</td>"
            f"<td>{m['step_latency_s']['median'] * 1e3:.2f}</td>"
            f"<td>{m['step_latency_s']['min'] * 1e3:.2f} / "
            f"{m['step_latency_s']['max'] * 1e3:.2f}</td>"
            f"<td>{e('; '.join(m.get('fallbacks') or []) or '-')}</td></tr>"
            for path, m in metrics.items())
        # how each path was timed: once where they were timed alike
        timed = ([m.get("timed", "") for m in metrics.values()][:1]
                 if len({m.get("timed", "") for m in metrics.values()}) == 1
                 else [f"{path}: {m.get('timed', '')}" for path, m in metrics.items()])
        parts.append("<h2>Decode metrics</h2><table><tr><th>path</th><th>model</th>"
                     "<th>decode tokens/s</th><th>time to first token, ms</th>"
                     "<th>step, ms (median)</th><th>step, ms (min / max)</th>"
                     f"<th>calls that fell back</th></tr>{rows}</table>"
                     f"<p>Timed {e('; '.join(timed))}. Decode tokens/s excludes the prompt: the "
                     "profiled steps' tokens over their summed time, so a slow step weighs in "
                     "it as it does in a user's wait, where the median step does not; each "
                     "metric stands on its own.</p>")
        accepted = {path: m["speculative"] for path, m in metrics.items()
                    if isinstance(m.get("speculative"), dict)}
        if accepted:
            per_path = ", ".join(f"{e(path)} {e(str(v.get('accepted_tokens_per_step')))}"
                                 for path, v in accepted.items())
            parts.append("<p>Speculative decoding with synthetic drafts: each step verifies "
                         "1+k tokens per sequence and accepts a seeded random 1..1+k of them "
                         "(not a draft model's acceptance: uniform, a mean of 1 + k/2; 1 "
                         "is no draft accepted), and drafting costs nothing here; decode "
                         "tokens/s counts the accepted tokens. Accepted per sequence per "
                         f"step: {per_path}.</p>")
    if said := ranks_text(run):
        parts.append(f"<p class=note>{e(said, quote=False)}.</p>")
    floors = run.get("floors")
    if floors and env.get("gpus"):
        per_type = ", ".join(f"{e(t)} {v['floor_us']:.1f} µs"
                             for t, v in floors["layer_types"].items())
        parts.append(f"<p>Memory floor per layer (what one layer must read at "
                     f"{floors['bandwidth_Bps'] / 1e12:.1f} TB/s; kimi-perf floors): "
                     f"{per_type}.</p>")
    fell_back = paths_that_fell_back(run)
    parts += [f"<p class=warn>{e(fell_back_text(path, reason))}.</p>"
              for path, reason in fell_back.items()]
    parts += [f"<p class=warn>The last decode step's logits of {e(path)} are not all finite "
              "(NaN or infinity): its figures measure a path that computes no usable "
              "output.</p>" for path, m in metrics.items()
              if isinstance(m, dict) and m.get("logits_finite") is False]
    on_cpu = [label for label, b in breakdowns.items() if b.unit == "ops"]
    if on_cpu:
        interpreted = ("; the specialized path's Triton kernels ran in Triton's interpreter, "
                       "so its µs are not a speed figure"
                       if "specialized" in metrics and "specialized" not in fell_back else "")
        which = "Run" if len(on_cpu) == len(breakdowns) else e(", ".join(on_cpu)) + " ran"
        first = (f"; {_escaped(said, quote=False)}" if (said := first_forward_text(run))
                 else "")
        parts.append(f"<p class=note>{which} on a CPU, with no GPU kernels: <b>ops</b> are the "
                     "launches each path annotates (one per kernel it would run on a GPU), "
                     f"timed on the CPU{interpreted}{first}.</p>")
    return "".join(parts)


def first_forward_text(run: dict) -> str | None:
    """Whose time to first token is a process's first forward pass, first-call costs and
    all: each path's under nsys (a process each) or TP (processes of its ranks), else the
    first path's. None without decode metrics, or of a GPU run with the torch backend, whose
    metrics come from the profiled steps run again, the prefill with them."""
    metrics = run.get("paths") or {}
    if not metrics:
        return None
    nsys = (run.get("request") or {}).get("backend") == "nsys"
    if (run.get("environment") or {}).get("device") != "cpu" and not nsys:
        return None   # (a GPU's metrics: the profiled steps run again, the prefill with them)
    if nsys:
        return ("each path ran in a process of its own under nsys, so its time to first token "
                "is that process's first forward pass, first-call costs and all")
    if isinstance(tp := run.get("tp"), int) and tp > 1:
        return (f"each path ran in {tp} processes of its own (its TP ranks), so its time to "
                "first token is their first forward pass, first-call costs and all")
    # (the run's first path as it ran, whatever --path drew: another's is no first call, and
    # a run whose first path is not drawn has none to say)
    ran = (run.get("request") or {}).get("paths")
    first = ran[0] if isinstance(ran, list) and ran else next(iter(metrics))
    if first not in metrics:
        return None
    return (f"the first path's time to first token ({first}) is the process's first forward "
            "pass, first-call costs and all, so compare it across runs of one path")


def ranks_text(run: dict) -> str | None:
    """Whose figures a TP run shows (rank 0's), where every rank's are, and each path's
    slowest rank, at whose pace the group moves (None for a run of one rank)."""
    tp = run.get("tp")
    if not (isinstance(tp, int) and tp > 1):
        return None
    slowest = []
    for path, m in (run.get("paths") or {}).items():
        ranks = m.get("ranks") if isinstance(m, dict) else None
        medians = [(r.get("step_latency_s") or {}).get("median") if isinstance(r, dict)
                   else None for r in (ranks if isinstance(ranks, list) else [])]
        if len(medians) > 1 and all(is_finite_number(v) for v in medians):  # (as stored)
            worst = max(range(len(medians)), key=medians.__getitem__)
            slowest.append(f"{path} rank {worst}, {medians[worst] * 1e3:.1f} ms" + (
                f" (rank 0: {medians[0] * 1e3:.1f} ms)" if worst else ""))
    return (f"TP {tp}: the tables and metrics are rank 0's (its trace broken down); every "
            "rank's decode metrics are in run.json (paths.PATH.ranks), its trace in "
            "PATH.rankN.trace.json.gz, and its collectives' µs count its wait for the others"
            + (f"; the slowest rank's median step: {'; '.join(slowest)}" if slowest else ""))


# Tables wider than the window scroll inside themselves; long names wrap anywhere.
STYLE = ("<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;"
         "margin:.5em 0 1.5em;display:block;max-width:100%;overflow-x:auto}"
         "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}"
         "td.name{overflow-wrap:anywhere;min-width:12em}"
         "td.name,table.info td,table.info th{text-align:left}"
         "p.note{background:#fff6d5;padding:.5em}p.warn{background:#ffd9d9;padding:.5em;"
         "font-weight:bold}tr.differs td{font-weight:bold}</style>")
PLOTLY_JS = ("inline", "cdn")


def _no_plotly_html(plotly_js: str) -> str:
    """A line the page shows where plotly.js, which it refers to, did not load (offline, or
    a copy moved away): its charts would be blank frames, unexplained."""
    where = "plotly's CDN" if plotly_js == "cdn" else plotly_js
    return ("<p class=warn id=no-plotly hidden>The charts above are blank: plotly.js did not "
            f"load from {_escaped(where)} (offline?). A report rendered without --plotly-js "
            "carries it and opens offline.</p><script>if (typeof Plotly === 'undefined') "
            "document.getElementById('no-plotly').hidden = false;</script>")


def check_plotly_js(plotly_js: object) -> None:
    """A TypeError or ValueError where ``plotly_js`` is not inline, cdn, a URL, or a path
    ending in .js (a ``Path`` is a file's, even one named cdn)."""
    if not isinstance(plotly_js, str | Path):
        raise TypeError(f"plotly_js: inline, cdn, a URL or a .js path, not {plotly_js!r}")
    if ((isinstance(plotly_js, Path) or plotly_js not in PLOTLY_JS)
            and not str(plotly_js).endswith(".js")):
        raise ValueError(f"plotly_js: inline, cdn or a path ending in .js, not "
                         f"{str(plotly_js)!r}")


def plotly_js_for(value: str, report_dir: Path) -> str:
    """``--plotly-js`` as a report in ``report_dir`` refers to it: a local file relative to
    that directory (so that the report and the file can move together), checked to exist."""
    if value in PLOTLY_JS or "://" in value:
        return value
    try:
        mode = Path(value).stat().st_mode
    except OSError as exc:
        raise TraceError(Path(value), f"{argument('--plotly-js', 'plotly_js')}: "
                                      f"{stat_problem(Path(value), exc)}") from None
    if not stat.S_ISREG(mode):
        raise TraceError(Path(value), f"{argument('--plotly-js', 'plotly_js')}: " + (
            "a directory, not a file" if stat.S_ISDIR(mode) else "not a regular file"))
    # As a URL path: a directory named 'a"b' must not end the src attribute.
    return urllib.parse.quote(os.path.relpath(Path(value).resolve(),
                                              Path(report_dir).resolve()))


def _missing_timelines_html(breakdowns: dict[str, Breakdown], drawn: dict[str, int]) -> str:
    """Which traces' panels stay empty (a stored breakdown without its timeline: written by
    an older kimi-perf, which drew steps with layers only, or edited), and which show only the
    first ops of their step (``drawn``: how many, of each; the breakdown stores a step's
    first ``TIMELINE_OPS``, and the report draws ``REPORT_TIMELINE_OPS`` in all)."""
    lines = [f"{_escaped(label)}: no timeline in this breakdown (stored without one"
             + ("" if b.layers else ": an older kimi-perf drew steps with layers only") + ")"
             for label, b in breakdowns.items() if not b.timeline]
    lines += [f"{_escaped(label)}: the step's first {drawn[label]:,} ops are drawn, its "
              f"{left:,} more are left out"
              for label, b in breakdowns.items() if b.timeline
              for left in [b.timeline.get("ops_left_out", 0) + sum(
                  len(seg["ops"]) for seg in b.timeline["segments"]) - drawn[label]] if left]
    return f"<p class=note>{'; '.join(lines)}.</p>" if lines else ""


@dataclass
class ReportInputs:
    """What ``kimi-perf report`` draws of its inputs: ``breakdowns`` by label (a run's decode
    paths by name, or ``RUN:path`` of several inputs), ``run`` (one run's run.json, of the
    path ``--path`` picked alone), ``runs`` (of several runs: each one's name and run.json)
    and ``fell_back`` (label: why, of drawn paths whose every step fell back, when drawn from
    several inputs; one run's own says so itself); ``no_ratios``: the labels of every drawn
    path whose every step fell back, one run's own too (their comparisons get no ratio);
    ``pairs``: the comparisons to draw, where not the first against each other
    (``input_pairs``); ``run_labels``: of each of ``runs``, the labels of its paths drawn
    (a run of one drawn path takes that path's label when relabelled); ``of_paths``: the
    breakdowns include different decode paths of runs (no spread is drawn across them)."""

    breakdowns: dict[str, Breakdown]
    run: dict | None = None
    runs: list[tuple[str, dict]] = field(default_factory=list)
    fell_back: dict[str, str] = field(default_factory=dict)
    no_ratios: set[str] = field(default_factory=set)
    pairs: list[tuple[str, str]] | None = None
    run_labels: list[list[str]] = field(default_factory=list)
    of_paths: bool = False
    labelled: bool = False   # relabelled: the user's own labels (kept whole in the tables)

    def __repr__(self) -> str:   # (a line in a notebook, not every breakdown it holds)
        runs = f", {len(self.runs)} runs" if self.runs else ""
        return f"ReportInputs({', '.join(self.breakdowns) or 'nothing'}{runs})"

    def relabelled(self, labels: list[str]) -> ReportInputs:
        """The same inputs under ``labels``, one for each breakdown, in order."""
        if len(labels) != len(self.breakdowns) or len(set(labels)) != len(labels):
            raise ValueError(f"labels: {len(self.breakdowns)} distinct names, not {labels!r}")
        renamed = dict(zip(self.breakdowns, labels, strict=True))
        run_labels = (self.run_labels if len(self.run_labels) == len(self.runs)
                      else [[] for _ in self.runs])   # (inputs made by hand: names kept)
        runs = [(renamed[drawn[0]] if len(drawn) == 1 else name, info)
                for (name, info), drawn in zip(self.runs, run_labels, strict=True)]
        return ReportInputs(dict(zip(labels, self.breakdowns.values(), strict=True)),
                            self.run, runs,
                            {renamed[label]: why for label, why in self.fell_back.items()},
                            {renamed[label] for label in self.no_ratios},
                            None if self.pairs is None
                            else [(renamed[a], renamed[b]) for a, b in self.pairs],
                            [[renamed[label] for label in drawn] for drawn in run_labels],
                            self.of_paths, labelled=True)

    def write(self, path: str | Path, title: str, *, plotly_js: str | Path = "inline",
              run: dict | None = None) -> Path:
        """``write_report`` of these inputs: what to compare, fell-back paths without a
        ratio, no spread across decode paths (``run``: drawn in place of ``self.run``; the
        command gives one saying how the report was made where ``self.run`` is None)."""
        return write_report(path, self.breakdowns, title, self.run if run is None else run,
                            plotly_js, self.runs, self.fell_back, self.no_ratios, self.pairs,
                            self.of_paths, self.labelled)

    def captured_differently(self) -> list[str]:
        """How each run after the first was captured differently from it, a line each."""
        first = self.runs[0] if self.runs else None
        return [captured_differently(first[0], name, found) for name, info in self.runs[1:]
                if (found := run_differences({"run": first[1]}, {"run": info},
                                             paths="paths_drawn" not in info))]


def report_inputs(inputs: list[str | Path], path_name: str | None = None,
                  phase: str = "auto", **breakdown_options) -> ReportInputs:
    """Traces, breakdown JSON files or ``kimi-perf trace`` runs, as ``kimi-perf report`` draws
    them (``path_name``: each run's path of that name alone); traces broken down over the
    steps of ``phase`` and as ``breakdown_options`` say (``layers``, ``step_regex``,
    ``rules``); a directory of traces stands for them (``trace_files``)."""
    inputs = trace_files(path_list(inputs, "inputs", "files"), keep_runs=True)
    # stored inputs first: a path that no run has is said before any trace is broken down
    labels_of = trace_labels(inputs)
    loaded = {i: load_paths(f, labels_of[i], phase, **breakdown_options)
              for i, f in enumerate(inputs) if is_stored(f)}
    if path_name is not None and not any(doc is not None for _, doc in loaded.values()):
        raise no_run(inputs)
    got = ReportInputs({})
    drawn: list[dict[str, str]] = []   # of each input: its paths' labels by name
    # runs of one name (a copy elsewhere: two nights' runs/<same stamp>) named by their path
    # (one file twice keeps its name, primed)
    names = [run_name(f) for f in inputs]
    real = [os.path.realpath(f) for f in inputs]
    names = [printable(str(f)) if len({r for r, m in zip(real, names, strict=True) if m == n})
             > 1 else n for f, n in zip(inputs, names, strict=True)]
    for i, file in enumerate(inputs):
        runs, run_doc = (loaded.get(i)
                         or load_paths(file, labels_of[i], phase, **breakdown_options))
        info = run_doc.get("run") if run_doc is not None else None
        if run_doc is not None and path_name is not None:
            runs = dict([one_path(file, runs, path_name)])
        fell = paths_that_fell_back(info)
        drawn.append({})
        for name, b in runs.items():
            label = f"{names[i]}:{name}" if run_doc and len(inputs) > 1 else name
            while label in got.breakdowns:
                label += "'"
            got.breakdowns[label] = b
            drawn[-1][name] = label
            if name in fell:
                got.no_ratios.add(label)
                if len(inputs) > 1:   # (one run says its own)
                    got.fell_back[label] = fell[name]
        if info is not None and len(inputs) > 1:   # (checked as it was read)
            # the drawn path's metrics alone; ``paths_drawn``: the runs' other paths, not
            # drawn, are no difference between them (what ran, and in which order, is kept)
            # (a run stored without request.paths ran its paths in their stored order)
            request = info.get("request") or {}
            got.runs.append((names[i], info if path_name is None else {
                **info, "paths": {p: m for p, m in (info.get("paths") or {}).items()
                                  if p == path_name}, "paths_drawn": [path_name],
                "request": {**request, "paths": request.get("paths")
                            or list(info.get("paths") or {})}}))
            got.run_labels.append(list(drawn[-1].values()))
        if info is not None and len(inputs) == 1:  # the run's own: what ran
            got.run = info if path_name is None else {**info, "paths": {   # that path's alone
                p: m for p, m in (info.get("paths") or {}).items() if p == path_name}}
    got.pairs = input_pairs(drawn)
    got.of_paths = len(drawn) > 1 and any(len(paths) > 1 for paths in drawn)
    return got


def input_pairs(drawn: list[dict[str, str]]) -> list[tuple[str, str]] | None:
    """The comparisons of several inputs of which one holds more than a path (``drawn``: of
    each input, its paths' labels by path name): each input's first path against its
    others (a run's standard path against its specialized one), and each path against the
    same path of the first input that has it (the baseline's specialized path against the
    run's); each path of an input that shares no path with an earlier one (a trace, beside
    runs) against the first of all.
    None (the first against each other) where every input holds one path."""
    if len(drawn) < 2 or all(len(paths) < 2 for paths in drawn):
        return None
    first = next(iter(drawn[0].values()))
    pairs, earlier = [], {}
    for i, paths in enumerate(drawn):
        labels = list(paths.values())
        pairs += [(labels[0], other) for other in labels[1:]]
        if i and not any(name in earlier for name in paths):   # (a trace beside runs, say)
            pairs += [(first, label) for label in labels]
        for name, label in paths.items():
            if name in earlier:
                pairs.append((earlier[name], label))
            earlier.setdefault(name, label)
    return pairs


def write_report(path: str | Path, breakdowns: dict[str, Breakdown], title: str,
                 run: dict | None = None, plotly_js: str | Path = "inline",
                 runs: list[tuple[str, dict]] = (), fell_back: dict[str, str] | None = None,
                 no_ratios: Collection[str] = (),
                 pairs: Sequence[tuple[str, str]] | None = None, of_paths: bool = False,
                 labelled: bool = False) -> Path:
    """One HTML file (written atomically) from breakdowns alone (their ``timeline`` is drawn).
    ``run``: the run.json of a capture or ``--from``. ``plotly_js``: ``inline`` (the file
    opens offline; about 5 MB), ``cdn``, a URL, or the path (from here) of a
    ``plotly.min.js``, which the report refers to relative to itself (``plotly_js_for``).
    ``runs``: the run information of several runs drawn together, as (name, run.json);
    ``fell_back``: label: why, of the paths drawn from several inputs whose every step fell
    back, said first (``run``'s own are said from it); neither gets a ratio, nor do the
    labels of ``no_ratios`` (a run's own paths that fell back, under labels of its own).
    ``pairs``: the comparisons to draw, by label (default: the first against each other);
    ``of_paths``: the breakdowns include different decode paths of runs, so no spread nor
    slowest trace is drawn across them (``ReportInputs.of_paths``); ``labelled``: the labels
    are the user's own, kept whole in the tables (``--labels``)."""
    if not isinstance(breakdowns, dict):
        raise TypeError(f"breakdowns: Breakdowns by label ({{'a': breakdown}}), not "
                        f"{type(breakdowns).__name__}: report_inputs(files).write draws files")
    if wrong := next((v for v in breakdowns.values() if not isinstance(v, Breakdown)), None):
        raise TypeError(f"breakdowns: Breakdowns by label, not a {type(wrong).__name__} "
                        "(breakdown(trace) breaks a trace down)")
    check_plotly_js(plotly_js)
    plotly_js = str(plotly_js)   # (a Path ends in .js: never read as inline or cdn)
    if not breakdowns:
        raise ValueError("write_report: no breakdowns to draw")
    path = path_argument(path, "path")
    if not isinstance(title, str):
        raise TypeError(f"title: the page's title (a str), not {type(title).__name__}")
    plotly_js = plotly_js_for(plotly_js, path.parent)
    # labels and titles from file names: their control characters written out, as a trace's
    # names are when read (a right-to-left override would reorder the page's text)
    title = printable(title)
    pairs = [(printable(a), printable(b)) for a, b in report_pairs(breakdowns, pairs)]
    breakdowns = {printable(label): b for label, b in breakdowns.items()}
    if unknown := {label for pair in pairs for label in pair} - set(breakdowns):
        raise ValueError(f"pairs: no breakdown is labelled {', '.join(sorted(unknown))}")
    runs = [(printable(name), r) for name, r in runs]
    fell_back = {printable(label): why for label, why in (fell_back or {}).items()}
    fallen = {*fell_back, *map(printable, [*no_ratios, *paths_that_fell_back(run)])}
    # A row of about 16 px per layer, so that every layer keeps its label.
    rows_px = [120 + 16 * len((b.timeline or {}).get("segments", ()))
               for b in breakdowns.values()]
    timelines = make_subplots(rows=len(breakdowns), cols=1,
                              vertical_spacing=0.3 / len(breakdowns), row_heights=rows_px,
                              subplot_titles=[_plotly_text(t) for t in breakdowns])
    drawn_with = [b for b in breakdowns.values() if b.timeline]
    most = REPORT_TIMELINE_OPS // max(len(drawn_with), 1)
    in_legend: set[str] = set()
    drawn = {label: _timeline(timelines, row, b.timeline, label, most, in_legend)
             for row, (label, b) in enumerate(breakdowns.items(), start=1)}
    # one time axis for GPU traces' layers whose steps last alike: bars compare (a CPU run's
    # rows keep their own: CPU time, and its specialized path's is the interpreter's; so does
    # a step of other work, drawn by stream, and steps 10x apart: a 13 s window would squash
    # a 0.3 ms decode step)
    row_of = {label: row for row, label in enumerate(breakdowns, start=1)}
    for labels in alike_groups({
            label: _timeline_extent(b.timeline) for label, b in breakdowns.items()
            if b.timeline and b.unit == "kernels" and not b.timeline.get("by_stream")}):
        first = row_of[labels[0]]
        for label in labels[1:]:
            timelines.update_xaxes(matches=f"x{first if first > 1 else ''}",
                                   row=row_of[label], col=1)
    timelines.update_layout(barmode="overlay", height=sum(rows_px) + 150,
                            title="One step of each path or trace (of its steps with layers, "
                                  "the one of median span), a row per layer (per stream where "
                                  "no layer was found)")
    include = {"inline": True, "cdn": "cdn"}.get(plotly_js, plotly_js)
    # (a chart with nothing to draw would be an empty frame: left out; plotly.js comes with
    # the first chart drawn)
    figures = [figure for figure, drawing in (
        (timelines, any(drawn.values())),
        (_class_bars(breakdowns), any(b.layer_types for b in breakdowns.values())))
        if drawing]
    charts = [figure.to_html(full_html=False, include_plotlyjs=include if i == 0 else False)
              for i, figure in enumerate(figures)]
    short = _short_labels(list(breakdowns), labelled)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_escaped(title)}"
             f"</title>{STYLE}</head><body><h1>{_escaped(title)}</h1>",
             _run_html(run, breakdowns),
             "".join(f"<p class=warn>{_escaped(fell_back_text(label, why))}.</p>"
                     for label, why in fell_back.items()),
             # (a job's folder of rank traces, one gone)
             "".join(f"<p class=warn>{_escaped(missing)}.</p>"
                     for missing in [ranks_missing(list(breakdowns))] if missing),
             _runs_html(list(runs)),
             _overview_html(breakdowns, of_paths, short),
             _comparison_html(breakdowns, pairs, fallen, short),
             _steps_html(breakdowns),
             _typical_html(breakdowns, short),
             _fusions_html(breakdowns, pairs),
             "<h2>Timelines</h2>",
             _missing_timelines_html(breakdowns, drawn),
             *charts,
             *([] if include is True or not charts else [_no_plotly_html(plotly_js)]),
             "</body></html>"]
    atomic_write_text(path, "\n".join(parts))
    return path
