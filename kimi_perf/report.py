"""HTML layer-timeline report (plotly) for one or more breakdowns of traces.

Per trace: the timeline of one decode step (its median-span step), one row per layer, every
kernel a bar coloured by class; then per layer type the median µs by kernel class, all traces
side by side; then the comparison table. Every name from a trace is HTML-escaped: kernel names
carry ``<`` and ``>``.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kimi_perf.breakdown import Breakdown
from kimi_perf.compare import compare
from kimi_perf.layers import segment
from kimi_perf.trace import Trace, atomic_write_text

CLASS_COLOURS = {
    "gemm": "#4c78a8", "attention": "#f58518", "moe": "#54a24b", "router": "#b279a2",
    "norm": "#eeca3b", "rope": "#9d755d", "elementwise": "#bab0ac", "communication": "#e45756",
    "memcpy": "#72b7b2", "other": "#7f7f7f",
}


def _timeline(fig: go.Figure, row: int, trace: Trace, label: str) -> None:
    ops, steps = segment(trace)
    steps = [s for s in steps if s.layers]
    if not steps:
        return
    spans = [int(ops.end[s.ops].max() - ops.start[s.ops].min()) for s in steps]
    step = steps[int(np.argsort(spans)[len(spans) // 2])]
    t0 = int(ops.start[step.ops].min())
    segments = [("prologue", step.prologue)] + [
        (f"layer {layer.index} ({layer.type})", layer.ops) for layer in step.layers] + [
        ("epilogue", step.epilogue)]
    bars: dict[str, dict[str, list]] = {}
    for name, rows in segments:
        for r in rows.tolist():
            cls = ops.class_labels[ops.kernel_class[r]]
            bar = bars.setdefault(cls, {"y": [], "base": [], "x": [], "text": []})
            start_us = (int(ops.start[r]) - t0) / 1e3
            dur_us = (int(ops.end[r]) - int(ops.start[r])) / 1e3
            bar["y"].append(html.escape(name))
            bar["base"].append(start_us)
            bar["x"].append(max(dur_us, 1e-3))
            bar["text"].append(f"{html.escape(trace.strings[ops.name[r]][:200])}<br>"
                               f"{cls}, {dur_us:.2f} µs at {start_us:.2f} µs")
    for cls, bar in sorted(bars.items()):
        fig.add_trace(go.Bar(orientation="h", name=cls, legendgroup=cls, showlegend=row == 1,
                             marker_color=CLASS_COLOURS.get(cls, "#333333"), y=bar["y"],
                             base=bar["base"], x=bar["x"], hovertext=bar["text"],
                             hoverinfo="text"), row=row, col=1)
    fig.update_yaxes(autorange="reversed", title_text=html.escape(label), row=row, col=1)
    fig.update_xaxes(title_text=f"µs into {html.escape(step.name)} (median-span step)",
                     row=row, col=1)


def _class_bars(breakdowns: dict[str, Breakdown]) -> go.Figure:
    fig = go.Figure()
    classes = sorted({c for b in breakdowns.values() for t in b.layer_types
                      for c in t["classes"]})
    for cls in classes:
        x, y = [], []
        for label, b in breakdowns.items():
            for t in b.layer_types:
                x.append(f"{html.escape(t['type'] or '-')}<br>{html.escape(label)}")
                y.append(t["classes"].get(cls, {}).get("us", 0.0))
        fig.add_trace(go.Bar(name=cls, x=x, y=y, marker_color=CLASS_COLOURS.get(cls)))
    fig.update_layout(barmode="stack", title="Median µs per layer, by kernel class",
                      yaxis_title="µs")
    return fig


def _comparison_html(breakdowns: dict[str, Breakdown]) -> str:
    """The first trace against each of the others, per layer type; and the work of each
    trace that fell in no step."""
    labels = list(breakdowns)
    e = html.escape
    parts = []
    for label in labels:
        outside = breakdowns[label].source.get("outside_steps") or {}
        if outside.get("ops"):
            parts.append(f"<p>{e(label)}: {outside['ops']} more ops ({outside['kernel_us']:.1f}"
                         " µs) ran in no step: launched outside the step ranges or from "
                         "another thread.</p>")
    a = labels[0] if labels else None

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    for b in labels[1:]:
        rows = compare(breakdowns[a], breakdowns[b])
        head = (f"<tr><th>layer type</th><th>{e(a)} kernels</th><th>{e(a)} µs</th>"
                f"<th>{e(b)} kernels</th><th>{e(b)} µs</th><th>µs ratio</th></tr>")
        body = "".join(
            f"<tr><td>{e(r.type or '-')}{' *' if r.pattern_differs else ''}</td>"
            f"<td>{fmt(r.kernels_a, '.3g')}</td>"
            f"<td>{fmt(r.span_us_a, '.1f')}</td><td>{fmt(r.kernels_b, '.3g')}</td>"
            f"<td>{fmt(r.span_us_b, '.1f')}</td><td>{fmt(r.span_ratio, '.2f')}</td></tr>"
            for r in rows)
        note = (f"<p>* found by the repeating kernel pattern, with another kernel sequence in "
                f"{e(b)}: the letter may name another layer there.</p>"
                if any(r.pattern_differs for r in rows) else "")
        parts.append(f"<h2>Per layer type: {e(a)} vs {e(b)}</h2>"
                     f"<table border=1 cellpadding=4>{head}{body}</table>{note}")
    return "".join(parts)


def write_report(path: str | Path, traces: dict[str, Trace],
                 breakdowns: dict[str, Breakdown], title: str,
                 self_contained: bool = False) -> Path:
    """One HTML file (written atomically); plotly.js from its CDN unless ``self_contained``."""
    path = Path(path)
    # A row of about 16 px per layer, so that every layer keeps its label.
    rows_px = [120 + 16 * max((len(s.layers) for s in segment(t)[1]), default=0)
               for t in traces.values()]
    timelines = make_subplots(rows=len(traces), cols=1, vertical_spacing=0.3 / len(traces),
                              row_heights=rows_px,
                              subplot_titles=[html.escape(t) for t in traces])
    for row, (label, trace) in enumerate(traces.items(), start=1):
        _timeline(timelines, row, trace, label)
    timelines.update_layout(barmode="overlay", height=sum(rows_px) + 150,
                            title="One decode step per trace, a row per layer")
    plotly_js = True if self_contained else "cdn"
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title></head><body><h1>{html.escape(title)}</h1>",
             _comparison_html(breakdowns),
             timelines.to_html(full_html=False, include_plotlyjs=plotly_js),
             _class_bars(breakdowns).to_html(full_html=False, include_plotlyjs=False),
             "</body></html>"]
    atomic_write_text(path, "\n".join(parts))
    return path
