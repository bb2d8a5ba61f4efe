"""Terminal tables (rich), CSV and JSON text for the analyses."""

from __future__ import annotations

import csv
import decimal
import heapq
import io
import math
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table as RichTable
from rich.text import Text

from kimi_perf.attribution import RangeKernelRow
from kimi_perf.comparison import (
    ComparisonRow,
    OverviewRow,
    aligned_typical,
    comparison_notes,
    count_text,
    device_overviews,
    differing_patterns,
    of_devices,
    overview_json,
    overview_notes,
    patterns_differ,
    ratio_text,
    rotation_notes,
    spreads,
)
from kimi_perf.gate import (
    DEVICE_METRICS,
    TIMES,
    Check,
    GatedRun,
    GateResult,
    Tolerances,
    broken_down_differently,
    tolerance_settings,
)
from kimi_perf.layer_breakdown import (
    SPREAD_NOTE,
    Breakdown,
    layer_notes,
    layers_text,
    spread_text,
    step_notes,
    step_part_text,
)
from kimi_perf.names import short_names
from kimi_perf.runs import captured_differently
from kimi_perf.text import counted
from kimi_perf.trace import json_text, printable


class _Console(Console):
    """Rich's console, but a reader that went away (`| head`) is the command's to handle
    (rich exits 1, which ``gate`` gives a regression)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def console(stderr: bool = False) -> Console:
    """Rich's console for our output: no markup, since kernel and range names hold brackets
    (``[lambda(int) (instance 1)]``) that rich would take for markup and drop; and wide enough
    that a table piped to a file or a CI log keeps every column (rich would otherwise lay it
    out in 80 columns)."""
    out = _Console(stderr=stderr, markup=False)
    if not out.is_terminal and _columns() is None:
        out = _Console(stderr=stderr, markup=False, width=200)
    elif out.width < 1:   # COLUMNS=0, which rich takes as it says: nothing would be printed
        out = _Console(stderr=stderr, markup=False, width=80)
    return out


def _columns() -> int | None:
    """COLUMNS where it is a width (0 too, laid out 80 wide); None where it is unset or no
    number (``abc``, ``-5``: rich takes those as 80, where output piped is 200 wide)."""
    given = os.environ.get("COLUMNS", "").strip()
    return int(given) if given.isascii() and given.isdigit() else None


HEADER_FOLDS = (12, 8, 6)   # widths a number column's header is folded to, in turn
# Table layouts in the order preferred: (boxed; text columns whole or folded to TEXT_ROOM;
# a number column's cells whole or broken at spaces; its header whole, broken at spaces or
# folded). Names whole come before borders, and numbers whole before headers whole.
LAYOUTS = [(True, "whole", "whole", "whole"), (True, "whole", "whole", "words"),
           (False, "whole", "whole", "words"),
           (True, "folded", "whole", "whole"), (True, "folded", "whole", "words"),
           *((False, "folded", cells, header) for cells in ("whole", "words")
             for header in ("words", *HEADER_FOLDS))]

# For a table read for its names: where they must fold, numbers first break at their spaces
# (where those do not fit, neither would the same layouts with numbers whole)
NAMES_FIRST_LAYOUTS = [*(layout for layout in LAYOUTS if layout[1] == "whole"),
                       *((boxed, "folded", "words", header) for boxed in (True, False)
                         for header in ("whole", "words", *HEADER_FOLDS))]


class Table(RichTable):
    """A rich table laid out so that no number breaks. Number (right-justified) columns are
    as wide as their widest cell; text columns whole where they fit, else folded. With less
    room the table gives up, in turn (``LAYOUTS``): borders and padding, whole names, whole
    header words, whole cells of several numbers ("2 / 2775.0" breaks at its spaces). Where
    none of that fits, each row is printed as a record, a line per column (as psql's expanded
    display), rather than folding "10717.7" into "10717." over "7"."""

    TEXT_ROOM = 12   # the width a text column is folded to
    SHORT_TEXT = 16  # a text column no wider keeps its width where others fold (a class)

    def __init__(self, *headers, title: str | None = None, names_first: bool = False,
                 **kwargs):
        # the notes under a table read as text, from the left (centred, each line of a
        # several-line note began elsewhere)
        kwargs.setdefault("caption_justify", "left")
        super().__init__(*headers, title=None if title is None else printable(title),
                         **kwargs)
        # names_first: a kernel's name is what a typical layer's table is read for
        self.layouts = NAMES_FIRST_LAYOUTS if names_first else LAYOUTS

    # (titles and cells may hold a file's name or a rule's class, whose control characters
    # a terminal would act on: written out, as a trace's own names are as it is read)

    def add_row(self, *cells, **kwargs) -> None:
        super().add_row(*(printable(c) if isinstance(c, str) else c for c in cells), **kwargs)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.update(max_width=1 << 20)
        texts: list[dict] = []     # a text column's width, whole or folded
        numbers: dict[int, dict] = {}   # a number column's width by (cells, header)
        for i, col in enumerate(self.columns):
            head = Measurement.get(console, wide, col.header)
            cells = [Measurement.get(console, wide, cell) for cell in col.cells]
            whole = max([1, *(m.maximum for m in cells)])
            if col.justify != "right":
                whole = max(whole, head.minimum)
                # (folded: a short one, a class, keeps its width: the room is the names')
                texts.append({"whole": whole, "folded": whole if whole <= self.SHORT_TEXT
                              else self.TEXT_ROOM})
                continue
            cell_width = {"whole": whole, "words": max([1, *(m.minimum for m in cells)])}
            head_width = {"whole": head.maximum, "words": head.minimum,
                          **{fold: min(head.minimum, fold) for fold in HEADER_FOLDS}}
            numbers[i] = {(c, h): max(cw, hw) for c, cw in cell_width.items()
                          for h, hw in head_width.items()}
        n = len(self.columns)
        for boxed, text, cells, header in self.layouts:
            width = (sum(w[text] for w in texts) + sum(w[cells, header] for w in numbers.values())
                     + (3 * n + 1 if boxed else n - 1))
            if width <= options.max_width:
                break
        else:
            yield from self._records(console, options)
            return
        saved = [col.width for col in self.columns]
        style = self.box, self.show_edge, self.padding, self.pad_edge
        for i, width in numbers.items():
            self.columns[i].width = width[cells, header]
        if text == "folded":   # the room left to the long names: short ones keep their width
            for col, w in zip((c for i, c in enumerate(self.columns) if i not in numbers),
                              texts, strict=True):
                if w["whole"] == w["folded"]:
                    col.width = w["whole"]
        if not boxed:
            self.box, self.show_edge, self.padding, self.pad_edge = (box.SIMPLE_HEAD, False,
                                                                     (0, 0), False)
        try:
            yield from self._titled(console, options)
        finally:
            self.box, self.show_edge, self.padding, self.pad_edge = style
            for col, width in zip(self.columns, saved, strict=True):
                col.width = width

    def _titled(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The table under its title: centred over it where the title fits its width (as rich
        lays it out); a title wider than the table is wrapped at the output's width instead,
        from the left, at its spaces: rich folds it to the table's width, a trace's path in
        it broken mid-name (``...nsys2022.2.1.s`` over ``qlite``)."""
        title, self.title = self.title, None
        try:
            lines = list(Segment.split_lines(super().__rich_console__(console, options)))
        finally:
            self.title = title
        if title is not None:
            width = max((Segment.get_line_length(line) for line in lines), default=0)
            fits = cell_len(str(title)) <= width
            yield from console.render(
                Text(str(title), style="table.title", justify="center" if fits else "default"),
                options.update(width=width) if fits else options)
        for line in lines:
            yield from line
            yield Segment.line()

    def _records(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.title:
            yield Text(str(self.title), style="table.title", justify="center")
        records = RichTable.grid(padding=(0, 1))
        records.add_column(style="table.header", overflow="fold")
        records.add_column(overflow="fold")
        cells = [list(col.cells) for col in self.columns]
        for i in range(self.row_count):
            if i:
                records.add_row()
            for col, column_cells in zip(self.columns, cells, strict=True):
                records.add_row(col.header, column_cells[i])
        yield records
        if self.caption:
            yield Text(str(self.caption), style="table.caption", justify="left")


def _table(title: str, columns: list[str], left: tuple[str, ...] = ()) -> Table:
    """Columns right-justified but for ``left``; a cell too wide for a narrow terminal folds
    onto the next line rather than losing digits to an ellipsis."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return table


# nvtx_kern_sum's columns, in its order, but its median (see attribution.py)
RANGES_HEADER = ["range", "style", "pid", "tid", "range_instances", "kernel_instances",
                 "total_ns", "avg_ns", "min_ns", "max_ns", "stddev_ns", "kernel"]


def _csv(header: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def _blank(value) -> Any:
    return "" if value is None else value


def ranges_csv(rows: list[RangeKernelRow]) -> str:
    return _csv(RANGES_HEADER, [[_blank(r.range), _blank(r.style), _blank(r.pid),
                                 _blank(r.tid), r.range_instances, r.kernel_instances,
                                 r.total_ns, _tenth(r.avg_ns), r.min_ns, r.max_ns,
                                 _tenth(r.stddev_ns), r.kernel] for r in rows])


def _tenth(value: float) -> str:
    """To a tenth, as nsys's reports round (SQLite's ``round(x, 1)``): the float's shortest
    decimal, half away from zero; 195711 / 60 is 3261.9, where ``f"{x:.1f}"`` rounds the
    binary value just under 3261.85 down."""
    return str(decimal.Decimal(repr(value)).quantize(decimal.Decimal("0.1"),
                                                      decimal.ROUND_HALF_UP))


def ranges_json(rows: list[RangeKernelRow], file: str | None = None) -> str:
    """The rows; ``unlaunched_kernels``: kernels whose launch call the trace lacks (their
    rows have no range and no pid: the ranges open at their launch are unknown); ``file``:
    the trace's."""
    unlaunched = sum(r.kernel_instances for r in rows if r.range is None and r.pid is None)
    return json_text({"schema": 1, **({"file": file} if file is not None else {}),
                      "unlaunched_kernels": unlaunched, "rows": [r.__dict__ for r in rows]})


RANGES_TABLE_ROWS = 100


def ranges_table(rows: list[RangeKernelRow], limit: int = RANGES_TABLE_ROWS,
                 file: str | None = None) -> Table:
    """The rows with the most kernel time (all of them: ``--format csv`` or ``json``; a
    terminal table of tens of thousands of rows takes rich seconds and nobody reads it).
    Kernel names as ``breakdown --kernels`` shows them (demangled, shortened); the CSV and
    JSON keep the trace's, as ``nsys stats`` prints them. ``file``: the trace's, in the
    title. A range without a name reads "(unnamed)", not "(none)" (in no range); a style
    column where the rows shown are of more than one (a PushPop and a StartEnd range of one
    name on one thread are rows apart)."""
    shown = heapq.nlargest(limit, rows, key=lambda r: r.total_ns)
    styles = len({r.style for r in shown if r.style is not None}) > 1
    table = _table("Kernels by range" + (f": {file}" if file is not None else "")
                   + " (as nsys stats --report nvtx_kern_sum)",
                   ["range", *(["style"] if styles else []), "pid", "tid", "ranges",
                    "kernels", "total µs", "avg µs", "max µs", "kernel"],
                   left=("range", "style", "pid", "tid", "kernel"))
    for r, kernel in zip(shown, short_names([r.kernel for r in shown], 60), strict=True):
        name = ("(unnamed)" if r.range == "" else r.range if r.range is not None
                else "(none)" if r.pid is not None else UNLAUNCHED)
        table.add_row(name, *([r.style or ""] if styles else []),
                      str(_blank(r.pid)), str(_blank(r.tid)),
                      str(r.range_instances), str(r.kernel_instances),
                      f"{r.total_ns / 1000:.1f}", f"{r.avg_ns / 1000:.2f}",
                      f"{r.max_ns / 1000:.2f}", kernel)
    notes = []
    if len(shown) < len(rows):
        notes.append(f"the {len(shown)} of {len(rows):,} rows with the most kernel time "
                     "(--top N); --format csv or json for all")
    if unlaunched := sum(r.kernel_instances for r in rows if r.range is None and r.pid is None):
        notes.append(unlaunched_note(unlaunched))
    table.caption = "\n".join(notes) or None
    return table


# the range of kernels whose launch call the trace lacks (CSV and JSON: no range, no pid)
UNLAUNCHED = "(launch not in trace)"


def unlaunched_note(kernels: int) -> str:
    return (f"{counted(kernels, 'kernel')} whose launch call the trace does not hold (launched "
            "before the profile began, or by a CUDA graph whose launch it lacks): the ranges "
            f"open at their launch are unknown, so they are listed as {UNLAUNCHED}, not as "
            "outside every range")


def breakdown_json(b: Breakdown) -> str:
    """The breakdown's JSON and, of one trace of a TP job, its devices' table (``devices``:
    each device's figures and which rank is slowest, as the table's ``Every device``)."""
    doc = b.to_json(lazy_layers=True)
    if devices := device_overviews({"trace": b}):
        doc["devices"] = overview_json(devices["trace"])
    return json_text(doc)


BREAKDOWN_HEADER = ["step", "device", "layer", "type", "kernels", "kernel_us", "span_us",
                    "gap_us", "classes"]


def breakdown_csv(b: Breakdown) -> str:
    rows = []
    for layer in b.layers:
        classes = ";".join(f"{c}={v['kernels']}/{v['us']}" for c, v in layer["classes"].items())
        rows.append([layer["step"], layer["device"], layer["index"], layer["type"],
                     layer["kernels"], layer["kernel_us"], layer["span_us"], layer["gap_us"],
                     classes])
    return _csv(BREAKDOWN_HEADER, rows)


def breakdown_tables(b: Breakdown) -> list[Table]:
    src = b.source
    unit = b.unit
    steps = _table(f"Steps: {src.get('file')} ({src.get('tool')})",
                   ["step", "range", "device", "layers", unit, f"{unit[:-1]} µs", "span µs",
                    "gap µs", f"prologue {unit} / span µs", f"epilogue {unit} / span µs"],
                   left=("range",))
    for s in b.steps:
        device = "cpu" if b.unit == "ops" and s["device"] < 0 else str(s["device"])
        steps.add_row(str(s["index"]), s.get("name", ""), device,
                      layers_text(s),
                      str(s["kernels"]), f"{s['kernel_us']:.1f}", f"{s['span_us']:.1f}",
                      f"{s['gap_us']:.1f}",
                      step_part_text(s, "prologue"), step_part_text(s, "epilogue"))
    steps.caption = "\n".join(step_notes(b)) or None
    tables = [steps]
    if not b.layer_types:
        return tables
    types = _table("Per layer type: median over layers and steps",
                   ["type", "layers", unit, f"{unit[:-1]} µs", "span µs", "gap µs"],
                   left=("type",))
    for t in b.layer_types:
        types.add_row(t["type"] or "-", str(t["layers"]), count_text(t["kernels"]),
                      f"{t['kernel_us']:.1f}", f"{t['span_us']:.1f}", f"{t['gap_us']:.1f}")
    types.caption = "\n".join(["layers: how many of the type all the steps profiled hold",
                               *layer_notes(b)])
    tables.append(types)
    classes = _table(f"Per layer type and kernel class: median {unit} / µs",
                     ["class", *(t["type"] or "-" for t in b.layer_types)], left=("class",))
    for c in sorted({c for t in b.layer_types for c in t["classes"]}):
        cells = (t["classes"].get(c) for t in b.layer_types)
        classes.add_row(c, *(f"{count_text(x['kernels'])} / {x['us']:.1f}" if x else ""
                             for x in cells))
    tables.append(classes)
    if devices := device_overviews({"trace": b}):   # (one file of a TP job: which rank is slow)
        tables.append(overview_table(devices["trace"], unit))
    return tables


def typical_layer_table(layer_type: str, sides: dict[str, dict | None],
                        unit: str = "kernels") -> Table:
    """The typical layer of one type (``layer_types[i]["typical_layer"]``) in one or more
    breakdowns, side by side: its kernels in launch order with their median µs."""
    typical, shifts = aligned_typical({label: (t or {}).get("typical_layer")
                                       for label, t in sides.items()})
    width = 80 if len(sides) == 1 else 60
    table = Table(title=f"Typical {layer_type} layer: {unit} in order, median µs",
                  names_first=True)
    table.add_column("#", justify="right")
    for label in sides:
        table.add_column(label if len(sides) > 1 else unit[:-1], overflow="fold")
        table.add_column("class", overflow="fold")
        table.add_column("µs", justify="right")
    names = {label: short_names([k["name"] for k in t["kernels"]], width) if t else []
             for label, t in typical.items()}
    for i in range(max(len(n) for n in names.values())):
        cells = [str(i + 1)]
        for label, t in typical.items():
            if t and i < len(t["kernels"]):
                cells += [names[label][i], t["kernels"][i]["class"],
                          spread_text(t["kernels"][i])]
            else:
                cells += ["", "", ""]
        table.add_row(*cells)
    notes = []
    for label, t in typical.items():
        who = f"{label}: " if len(sides) > 1 else ""
        if t:
            notes.append(f"{who}{len(t['kernels'])} {unit}, "
                         f"{sum(k['us'] for k in t['kernels']):.1f} µs, their medians summed; "
                         f"{t['layers']} of "
                         f"{counted(sides[label]['layers'], layer_type + ' layer')} ran "
                         "exactly this sequence")
        elif sides[label]:
            notes.append(f"{who}not in this breakdown (written by an older kimi-perf: "
                         "analyse its trace again)")
        else:
            notes.append(f"{who}no {layer_type} layer")
    notes += rotation_notes(shifts, typical, unit)
    if any("spread_us" in k for t in typical.values() if t for k in t["kernels"]):
        notes.append(SPREAD_NOTE)
    if patterns_differ((t or {}).get("pattern") for t in sides.values()):
        notes.append(f"* {layer_type} was lettered by its kernel sequence, with other "
                     "kernel sequences: the letter may name different layers")
    table.caption = "\n".join(notes)
    return table


def fusion_table(layer_type: str, standard: str, specialized: str, rows: list,
                 left: list[str], on_cpu: bool = False, specialized_first: bool = False
                 ) -> Table:
    """``kimi_perf.decode.fusions.fusion_ledger``'s rows: each launch of the specialized path
    against the standard launches whose work it does (``on_cpu``: a CPU run's, whose µs are
    host time and the interpreter's: its ratios are no speed figure). Its ratio is always
    what was replaced over what replaced it; ``specialized_first``: the comparison above it
    has the specialized path as A, its ratios the other way round, which the note says."""
    table = _table(f"{layer_type}: each {specialized} launch against the {standard} launches "
                   "it replaces (each launch's median µs: their sums are no layer's span)",
                   [f"{specialized} launch", "µs", f"replaces ({standard})", "their µs",
                    "ratio"], left=(f"{specialized} launch", f"replaces ({standard})"))
    for r in rows:
        table.add_row(r.launch, f"{r.us:.1f}", " + ".join(r.replaces) or "(new work)",
                      f"{r.replaced_us:.1f}", ratio_text(r.ratio))
    replaced = sum(len(r.replaces) for r in rows)
    notes = [f"{len(rows)} launches for {replaced}: {sum(r.us for r in rows):.1f} µs for "
             f"{sum(r.replaced_us for r in rows):.1f} µs; ratio: their µs over its, " + (
                 f"{standard} over {specialized} (the other way round from the ratios above), "
                 if specialized_first else "") + (
                 "above 1 where the launch takes less (a CPU run: its µs are CPU time, the "
                 "specialized launches in Triton's interpreter, so the ratios are no speed "
                 "figure; the rows say which launches replace which)" if on_cpu
                 else "above 1: the fusion is faster")]
    if left:
        notes.append(f"{standard} launches no {specialized} launch took: {', '.join(left)}")
    table.caption = "\n".join(notes)
    return table


def comparison_table(rows: list[ComparisonRow], label_a: str, label_b: str,
                     unit: str = "kernels", unit_b: str | None = None) -> Table:
    """``unit``: what A counts (kernels, or ops for a CPU run); ``unit_b``: B's, if other."""
    unit_b = unit_b or unit
    table = _table(f"Per layer type: {label_a} vs {label_b} (medians; µs = layer span)",
                   ["layer type", f"{label_a} layers", f"{label_a} {unit}", f"{label_a} µs",
                    f"{label_b} layers", f"{label_b} {unit_b}", f"{label_b} µs", "µs ratio",
                    f"{unit if unit == unit_b else 'count'} ratio"], left=("layer type",))

    def fmt(v, spec=".1f"):
        return "-" if v is None else format(v, spec)
    for r in rows:
        table.add_row(r.label + (" *" if r.marked else ""), r.layers_text("a"),
                      count_text(r.kernels_a), fmt(r.span_us_a),
                      r.layers_text("b"), count_text(r.kernels_b), fmt(r.span_us_b),
                      ratio_text(r.span_ratio), ratio_text(r.kernel_ratio))
    table.caption = "\n".join(comparison_notes(rows, label_a, label_b, unit, unit_b))
    return table


def comparison_headline(rows: list[ComparisonRow], label_a: str, label_b: str,
                        unit: str = "kernels", unit_b: str | None = None) -> str:
    """The one-line summary: '23 kernels / 130 µs vs 13 / 69 µs' per layer type (none of a
    path that fell back on every step: both sides would be the standard path's)."""
    other = "" if unit_b in (None, unit) else f" {unit_b}"
    parts = []
    for r in rows:
        if r.kernels_a is None or r.kernels_b is None or not r.same_layers or r.fell_back:
            continue
        mark = " *" if r.marked else ""
        said = unit[:-1] if r.kernels_a == 1 else unit   # (1 kernel, not 1 kernels)
        parts.append(f"{r.label}{mark}: {count_text(r.kernels_a)} {said} / {r.span_us_a:.1f} µs "
                     f"({label_a}) vs {count_text(r.kernels_b)}{other} / {r.span_us_b:.1f} µs "
                     f"({label_b})")
    return "\n".join(parts)


def overview_table(rows: list[OverviewRow], unit: str = "kernels", of: str | None = None
                   ) -> Table:
    """Several traces (a TP run's ranks, say), or one trace's devices (``of``: which trace,
    where the title names it), a row each (``overview``): the median step span and each layer
    type's median layer span and count; then the spread, slowest over fastest, and (below)
    which was slowest."""
    types = list(rows[0].types) if rows else []
    differ = differing_patterns(rows)
    what = "device" if of_devices(rows) else "trace"
    table = _table(f"Every {what}{f' of {of}' if of else ''} (medians; µs = span, layer "
                   f"{unit} in brackets)",
                   [what, "steps", "step µs",
                    *(f"{t or '-'}{' *' if t in differ else ''} µs" for t in types)],
                   left=(what,))
    for r in rows:
        cells = [f"{v[1]:.1f} ({count_text(v[0])})" if v else "-" for v in r.types.values()]
        table.add_row(r.label, str(r.steps), "-" if r.step_us is None else f"{r.step_us:.1f}",
                      *cells)
    spread = {s.type: s for s in spreads(rows)}
    table.add_row("slowest / fastest", "", *(
        f"{ratio_text(spread[t].ratio)}×" if t in spread and spread[t].ratio else "-"
        for t in [None, *types]), style="bold")
    table.caption = "\n".join(overview_notes(rows, list(spread.values())))
    return table


def print_tables(tables: list[Table | str], out: Console | None = None) -> None:
    out = out or console()
    for t in tables:
        # (a note's file names and labels with their control characters written out, as the
        # tables' are; its own line breaks kept)
        out.print("\n".join(map(printable, t.split("\n"))) if isinstance(t, str) else t)


def tables_text(tables: list[Table | str]) -> str:
    """The tables as plain text (``-o`` with the table format), as wide as output piped is."""
    buf = io.StringIO()
    width = _columns() or (200 if _columns() is None else 80)
    print_tables(tables, Console(file=buf, width=width, markup=False, color_system=None,
                                 highlight=False))
    return buf.getvalue()


def validation_table(result: dict) -> Table:
    bounds = result["bounds"]
    k = result.get("spec_tokens", 0)
    n = result["steps"]
    steps = (f"{counted(n, 'verify step')} of 1+{k} tokens" if k
             else counted(n, "decode step"))
    table = _table(f"Decode paths vs float64 reference: preset {result['preset']}, "
                   f"{counted(result['n_layers'], 'layer')}, {result['dtype']}, "
                   f"{result['kv_cache']} KV cache, {result['experts']} experts, batch "
                   f"{result['batch']}, {steps}",
                   ["path", "layer type", "max error", "bound", "one sequence", "bound",
                    "drift", "launches/layer"],
                   left=("path", "layer type"))
    for path, r in result["paths"].items():
        for kind, v in r["layer_types"].items():
            table.add_row(path, kind, f"{v['max_rel_err']:.3g}", f"{v['bound']:.3g}",
                          f"{v['sequence_max_rel_err']:.3g}", f"{v['sequence_bound']:.3g}",
                          f"{v['drift_max_rel_err']:.3g}", str(v["launches"]))
        table.add_row(path, "logits", f"{r['logits_max_rel_err']:.3g}",
                      f"{bounds['logits']:.3g}", f"{r['logits_sequence_max_rel_err']:.3g}",
                      f"{bounds['logits_sequence']:.3g}",
                      f"{r['logits_drift_max_rel_err']:.3g}", "")
        invalid = r["routing_invalid"]
        table.add_row(path, "routing gap", f"{r['routing_max_gap']:.3g}",
                      f"{bounds['routing_gap']:.3g}",
                      f"{invalid} invalid (an expert twice, or none such)" if invalid else "",
                      "", "", "")
    notes = ["max error: relative, ‖out − ref‖ / ‖ref‖ over the batch, of each layer given the "
             "path's own inputs (the reference goes on from the path's outputs), at the decode "
             "steps; one sequence: the same of each sequence alone, at the prompt's positions "
             "too (its bound looser: one sequence's rounding has a long tail); drift: the "
             "batch's of the path and the reference each run on its own, rounding grown "
             "through the depth (not bounded: random weights amplify it); routing gap: how far "
             "below its own k-th best score the reference found the path's top-k choice (k "
             "distinct experts asked of each)"]
    notes += [f"{path} fell back to the standard path's PyTorch ops: "
              f"{'; '.join(r['fallbacks'])}"
              for path, r in result["paths"].items() if r.get("fallbacks")]
    table.caption = "\n".join(notes)
    return table


GATE_STYLES = {"regression": "bold red", "missing": "bold red", "fell back": "bold red",
               "not finite": "bold red",
               "differs": "bold red", "captured differently": "bold red",
               "broken down differently": "bold red",
               "improvement": "green",
               "noise": "yellow", "new": "cyan", "changed": "yellow"}
GATE_HEADLINE_ITEMS = 5


def _value(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _change(v: float | None) -> str:
    """A relative change: to 0.1%, and a small one that is not nothing to two digits (one
    kernel more of a step of 4,000 is +0.025%, not +0.0%), down to 0.001%."""
    if v is None:
        return "-"
    if 0 < abs(v) < 1e-5:
        return f"{'+' if v > 0 else '-'}<0.001%"
    return f"{v * 100:+.2g}%" if 0 < abs(v) < 0.0005 else f"{v:+.1%}"


def gate_table(result: GateResult, show_all: bool = False) -> Table:
    """The gate's checks (all of them, or those that are not plain ok)."""
    tol = result.tolerances
    times = any(c.metric in TIMES for c in result.checks)
    table = _table("Regression gate: medians, baseline vs run" + (
                   f" (time: > {tol.rel_tol:.0%} and {tol.abs_tol_us:g} µs, and Mann-Whitney "
                   f"p < {tol.alpha:g}; for a step's mean span, a permutation test's p)"
                   if times else " (launches only)"),
                   ["path", "layer", "metric", "baseline", "run", "change", "p", "status",
                    "behind it"],
                   left=("path", "layer", "metric", "status", "behind it"))

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for c in result.checks:
        if c.status == "ok" and not show_all:
            continue
        style = GATE_STYLES.get(c.status, "")
        layer = c.layer_type + (f" (run: {c.run_layer_type})" if c.run_layer_type else "")
        table.add_row(c.path, layer, result.metric_name(c), _value(c.baseline),
                      _value(c.current),
                      _change(c.change), fmt(c.p_value, ".2g")
                      # (too few steps: the layers tested, an optimistic p)
                      + (f" ({c.tested_over})" if c.tested_over in ("layers", "runs")
                         else "")
                      # (a family's test: --alpha shared among a type's classes or layers)
                      + (f" (α {c.alpha:.2g})" if c.alpha is not None and c.p_value is not None
                         else ""),
                      Text(c.status, style=style), c.detail or "")
    shown = [c for c in result.checks if show_all or c.status != "ok"]
    notes = []
    if untested := sum(c.metric in TIMES and c.status in ("regression", "improvement")
                       and c.p_value is None for c in shown):
        notes.append(f"p -: {untested} time check{'s' if untested > 1 else ''} with too few "
                     f"samples for the test to reach α {tol.alpha:g} (fewer than "
                     f"{tol.min_samples} steps and layers a side, or 1 / C(n+m, n) ≥ α): the "
                     "thresholds decided alone; profile more steps")
    if any(c.tested_over == "layers" for c in shown):
        notes.append("(layers): too few steps for the test, the layers tested: an optimistic "
                     "p (the layers of a step share its noise)")
    if any(c.tested_over == "runs" for c in shown):
        notes.append(f"(runs): the run's figure tested against the spread of the baseline's "
                     f"{result.spread_runs} runs (a t prediction interval for one run more)")
    if notes:
        table.caption = "\n".join(notes)
    return table


# characters of a check's detail the headline keeps (the table has it whole): a line a CI
# log or a mail can show, where a detail may list every kernel two traces do not share
GATE_HEADLINE_DETAIL = 100


def _clipped(text: str) -> str:
    text = printable(text)   # (as written: an escape is 4 characters of the 100)
    return text if len(text) <= GATE_HEADLINE_DETAIL else (
        text[:GATE_HEADLINE_DETAIL - 1].rstrip(" ,;") + "…")


def gate_headline(result: GateResult) -> str:
    if result.ok:
        return f"gate: pass ({len(result.checks)} checks)"
    # how the sides differ first: it explains the rest, and a long list would cut it off;
    # each device's last (where the whole regressed, its devices did too)
    failures = sorted(result.failures, key=lambda c: (c.status not in (
        "captured differently", "broken down differently"), c.metric in DEVICE_METRICS))
    # a layer type the run lost fails each of its checks: one item, naming them; a path it
    # lost (each of its checks missing) one item, naming its types
    lost_paths = {c.path for c in failures if c.status == "missing"} - {
        c.path for c in result.checks if c.status != "missing"}
    lost: dict[tuple[str, str], list[Check]] = {}
    # a device that lost layers (a rank lost: each type's figures of it): one item, naming them
    devices_lost: dict[tuple[str, int | None], list[Check]] = {}
    items: list[str | tuple[str, str] | tuple[str, int | None]] = []
    for c in failures:
        if c.status == "missing" and c.metric in DEVICE_METRICS:
            # (named as the table names it: the run's device, where the run has it)
            where = (c.path, c.device if c.device is not None else c.baseline_device)
            if where not in devices_lost:
                items.append(where)
            devices_lost.setdefault(where, []).append(c)
        elif c.status == "missing" and c.path in lost_paths:
            if (c.path, "") not in lost:
                items.append((c.path, ""))
            lost.setdefault((c.path, ""), []).append(c)
        elif c.status == "missing":
            if (c.path, c.layer_type) not in lost:
                items.append((c.path, c.layer_type))
            lost.setdefault((c.path, c.layer_type), []).append(c)
        else:
            items.append(f"{c.path}: {_clipped(c.detail)}" if c.status in ("fell back",
                                                                         "not finite") else
                         _clipped(str(c.detail)) if c.status in ("captured differently",
                                                                 "broken down differently")
                         else f"{c.path} {c.layer_type} {result.metric_name(c)} "
                         f"{_value(c.baseline)} -> {_value(c.current)}"
                         + (f" ({_clipped(c.detail)})" if c.detail else ""))
    said_items = [item if isinstance(item, str) else
                  _device_lost(item, devices_lost[item]) if item in devices_lost else
                  f"the path {item[0]} missing from the run (its "
                  + ", ".join(dict.fromkeys(c.layer_type for c in lost[item])) + ")"
                  if not item[1] else
                  f"{item[0]} {item[1]} missing from the run ("
                  + ", ".join(result.metric_name(c) for c in lost[item])
                  + "".join(f"; {_clipped(c.detail)}" for c in lost[item][:1] if c.detail)
                  + ")" for item in items]
    worst = "; ".join(said_items[:GATE_HEADLINE_ITEMS])
    more = len(said_items) - GATE_HEADLINE_ITEMS
    counts = Counter(c.status for c in failures)
    # (what is missing: each type or path lost, and each device that lost a type)
    missing = len(lost) + len(devices_lost)
    said = ", ".join(f"{n} layer count{' differs' if n == 1 else 's differ'}"
                     if status == "differs" else "the captures differ"
                     if status == "captured differently" else "the breakdowns differ"
                     if status == "broken down differently" else
                     f"{missing} missing" + (f" ({n} checks)" if n > missing else "")
                     if status == "missing" else
                     f"{n} {status}" + ("s" if n > 1 and status == "regression" else "")
                     + (" on every step" if status == "fell back" else "")
                     for status, n in sorted(counts.items(), reverse=True))
    # sides captured or broken down differently fail nothing without --strict, yet explain
    # what did fail (decode steps against mixed ones: "regressions"): said with the counts
    unlike = [*(result.run_differences or []), *result.breakdown_differences]
    if unlike and not {"captured differently", "broken down differently"} & set(counts):
        said += f" (the sides differ: {_clipped('; '.join(unlike))})"
    # (a layer type's name from a stored breakdown edited by hand may hold control
    # characters: written out, as the table's cells are)
    return printable(f"gate: FAIL, {said}: {worst}"
                     + (f"; and {more} more (the table lists {'it' if more == 1 else 'them'})"
                        if more > 0 else ""))


def _device_lost(where: tuple[str, int | None], checks: list[Check]) -> str:
    """A device of the baseline's that ran none of some layers in the run, in words."""
    types = [t for t in dict.fromkeys(c.layer_type for c in checks) if t != "step"]
    return (f"{where[0]} device {where[1]}: "
            # (its steps lost too: the rank's every layer)
            + ("no layers" if any(c.layer_type == "step" for c in checks)
               else f"no {', '.join(types)} layers")
            + " in the run (" + ", ".join(f"{c.layer_type} {c.metric.removesuffix('_device')}"
                                          for c in checks) + ")")


def gate_said(gated: GatedRun, show_all: bool = False) -> list[tuple[Table | str, str | None]]:
    """The table verdict but its last line (``gate_headline``): the checks (``show_all``:
    those that passed as well), each side's notes and how the sides differ, each with its
    style, as ``kimi-perf gate`` prints them."""
    result = gated.result
    notes = gated.notes()
    said: list[tuple[Table | str, str | None]] = []   # what to print, each with its style
    table = gate_table(result, show_all)
    if table.row_count:
        said.append((table, None))
    said += [(line, None) for lines in notes.values() for line in lines]
    if untimed := result.devices_untimed:
        said.append(("no check of each device's times for " + ", ".join(
            f"{where} ({n} devices)" for where, n in untimed.items()) + ": too few steps a "
            "device for the test at --alpha over the devices (profile more steps)", "yellow"))
    if result.run_differences:
        said.append((captured_differently("the baseline", "the run",
                                                   result.run_differences), "bold yellow"))
    if result.breakdown_differences:
        said.append((broken_down_differently("the baseline", "the run",
                                             result.breakdown_differences), "bold yellow"))
    said += [(line, "bold yellow") for line in result.fell_back]
    if result.cpu_time_metrics:
        interpreted = (" (the specialized path in Triton's interpreter)"
                       if "specialized" in result.op_paths
                       and "specialized" not in result.paths_fell_back else "")
        said.append((f"{', '.join(result.cpu_time_metrics)} of a CPU run are CPU time"
                     f"{interpreted}, noisy and no speed figure: --metrics kernels gates the "
                     "launches alone", "yellow"))
    if result.stored_tolerances:
        kept = tolerances_kept(result)
        settings = tolerance_settings(result.tolerances)   # (those in force)
        said.append((printable(
            "tolerances the baseline keeps (gate --update stored them): "
            + ", ".join(f"{key} {kept[key]}" + ("" if settings.get(key) == kept[key] else
                                                f" ({settings.get(key, 'none')} given)")
                        for key in result.stored_tolerances if key in kept)
            + " (--rel-tol, --abs-tol, --alpha, --metrics given override them)"), None))
    # (with no time checked, --metrics kernels, the spread is of nothing the gate checked)
    if result.spread_runs and any("_us" in c.metric for c in result.checks):
        within = sum(c.tested_over == "runs" and c.status == "noise" for c in result.checks)
        said.append((f"the baseline keeps the spread of its {result.spread_runs} runs (gate "
                     "--update --spread-from): a time past the tolerances and its steps' test "
                     "is tested against that spread too, where it holds the figure"
                     + (f" ({within} within it: noise)" if within else ""), None))
    if result.cpu_times_left_out:
        named = ",".join(result.tolerances.checked)
        said.append((f"{', '.join(result.cpu_times_left_out)} of CPU runs not checked (CPU "
                     f"time, noisy and no speed figure): --metrics {named} checks them",
                     "yellow"))
    return said


def gate_text(gated: GatedRun, show_all: bool = False) -> str:
    """The verdict as text, its headline last: what ``kimi-perf gate -o FILE`` writes (but
    its last newline), and the output of ``--junit``'s suite."""
    return tables_text([part for part, _ in gate_said(gated, show_all)]) + gate_headline(
        gated.result)


def gate_document(gated: GatedRun) -> dict[str, Any]:
    """The verdict as ``kimi-perf gate --format json`` prints it: ``GateResult.to_json``,
    its headline, the files as given and each side's notes."""
    return gated.result.to_json() | {"headline": gate_headline(gated.result),
                                     "baseline_file": str(gated.files[0]),
                                     "run_file": str(gated.files[1]), "notes": gated.notes()}


# What XML 1.0 cannot hold once ``printable`` has written out the control characters: lone
# surrogates and the two non-characters (a name decoded from a broken trace may hold them)
NOT_XML = re.compile("[\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: object) -> str:
    """``text`` as XML can hold it, its line breaks kept (a verdict is lines)."""
    return NOT_XML.sub(lambda m: f"\\u{ord(m.group()):04x}",
                       "\n".join(map(printable, str(text).split("\n"))))


def tolerances_kept(result: GateResult) -> dict:
    """The settings the baseline keeps, each as the gate reads it (a metrics list
    normalised)."""
    return tolerance_settings(Tolerances(**result.stored_tolerances))


def kept_in_force(result: GateResult) -> list[str]:
    """The settings the baseline keeps that no option given overrode: those it set."""
    kept, settings = tolerances_kept(result), tolerance_settings(result.tolerances)
    return [key for key in result.stored_tolerances if key in kept
            and settings.get(key) == kept[key]]


def gate_junit(result: GateResult, files: tuple[str, str], verdict: str) -> str:
    """The verdict as JUnit XML, which CI servers (Jenkins, GitLab, GitHub's test reporters)
    show as tests: a test case per check, ``PATH.LAYER_TYPE`` its class and the metric its
    name (the same every night, so that a server follows a check's history); a failing check
    is a ``failure`` of its status, with what is behind it; a check that passes with a status
    other than ok (noise, improvement, new, changed) says it in the case's output. The files
    and tolerances are the suite's properties, ``verdict`` (the table as text) its output.
    A gate of no checks (``--update`` with nothing to gate against: the run stored) is one
    passing case, ``baseline.stored``: CI servers fail a report of no tests."""
    failures = len(result.failures)
    tests = str(max(len(result.checks), 1))
    suites = ET.Element("testsuites", name="kimi-perf gate", tests=tests,
                        failures=str(failures), errors="0")
    suite = ET.SubElement(suites, "testsuite", name="kimi-perf gate", tests=tests,
                          failures=str(failures), errors="0", skipped="0", time="0")
    properties = ET.SubElement(suite, "properties")
    tol = result.tolerances
    said = {"baseline": files[0], "run": files[1], **asdict(tol),
            "metrics": ",".join(tol.checked) if tol.metrics is not None
            else "default (kernels alone where both sides are CPU runs)"}
    if kept := kept_in_force(result):   # (those of the settings above the baseline set)
        said["kept_by_baseline"] = ",".join(kept)
    if result.spread_runs:
        said["spread_runs"] = result.spread_runs
    for name, value in said.items():
        ET.SubElement(properties, "property", name=name, value=_xml_text(value))
    named: Counter = Counter()
    for c in result.checks:
        # (a dot splits a class name into packages: the path's and the type's are one each)
        where = ".".join(part.replace(".", "_") for part in (c.path, c.layer_type))
        # (a device's check named alike whichever device it shows: a server follows it)
        # (a device lost its own case, named for it; the others one, whichever it shows; the
        # layer that rose most alike, whichever layer it is tonight)
        name = (f"{c.metric.removesuffix('_device')} (each device)"
                if c.metric in DEVICE_METRICS and c.status != "missing"
                else "kernel_us (each layer)" if c.metric == "layer_kernel_us"
                else result.metric_name(c) + (f" ({c.status})" if c.metric == "decode path"
                                              else ""))
        named[where, name] += 1
        if named[where, name] > 1:   # (types only the run has, say, all named "-")
            name = f"{name} #{named[where, name]}"
        case = ET.SubElement(suite, "testcase", classname=_xml_text(where),
                             name=_xml_text(name), time="0")
        extras = [text for text in (
            c.metric == "layer_kernel_us" and f"layer {c.layer_index}",
            c.change is not None and _change(c.change),
            # (as the table says it: what was tested, at which alpha)
            c.p_value is not None and f"p {c.p_value:.2g}" + (
                f" ({c.tested_over})" if c.tested_over in ("layers", "runs") else "") + (
                f" (α {c.alpha:.2g})" if c.alpha is not None else ""),
            c.run_layer_type and f"the run's type {c.run_layer_type}") if text]
        line = c.status + (f": {_value(c.baseline)} -> {_value(c.current)}"
                           if (c.baseline, c.current) != (None, None) else "") + (
            f" ({', '.join(extras)})" if extras else "")
        if c.fails:
            failure = ET.SubElement(case, "failure", type=_xml_text(c.status),
                                    message=_xml_text(line))
            failure.text = _xml_text(c.detail or line)
        elif c.status != "ok":
            ET.SubElement(case, "system-out").text = _xml_text(
                line + (f"; {c.detail}" if c.detail else ""))
    if not result.checks:
        stored = ET.SubElement(suite, "testcase", classname="baseline", name="stored",
                               time="0")
        ET.SubElement(stored, "system-out").text = _xml_text(verdict)
    ET.SubElement(suite, "system-out").text = _xml_text(verdict)
    ET.indent(suites, space=" ")
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def floors_table(doc: dict) -> Table:
    st = doc["storage"]
    tokens = doc.get("tokens", 1)
    verify = f" verifying {tokens} tokens each" if tokens > 1 else ""
    table = _table(f"Memory floors per layer: {doc['preset']} (TP {doc['tp']}), batch "
                   f"{doc['batch']}{verify}, context {doc['context']}, weights {st['weights']}, "
                   f"experts {st['experts']}, KV {st['kv_cache']}, "
                   f"{doc['bandwidth_Bps'] / 1e12:g} TB/s",
                   ["layer", "launch", "MB", "floor µs"], left=("layer", "launch"))
    def figure(v: float) -> str:   # (a small model's launches: 0.0041 MB, not 0.00)
        return (f"{v:,.2f}" if v == 0 or abs(v) >= 0.1
                else f"{v:.{1 - math.floor(math.log10(abs(v)))}f}")   # (two digits: 0.010)

    def floor_us(held: dict) -> float:   # (the JSON's is rounded to the ns: 0.003)
        return held["bytes"] / doc["bandwidth_Bps"] * 1e6

    for kind, t in doc["layer_types"].items():
        for name, launch in t["launches"].items():
            table.add_row(kind, name, figure(launch["bytes"] / 1e6), figure(floor_us(launch)))
        table.add_row(kind, Text("all", style="bold"), figure(t["bytes"] / 1e6),
                      Text(figure(floor_us(t)), style="bold"), end_section=True)
    table.caption = (f"MB: 10^6 bytes one rank reads or writes a step at least (its TP "
                     f"{doc['tp']} shard); floor µs: those bytes at {doc['bandwidth_Bps'] / 1e12:g}"
                     " TB/s; the two attention-residual launches a layer (a few hidden-size "
                     "vectors) left out\n"
                     f"routed experts read per step: {doc['expected_experts']:g} (the distinct "
                     "experts of uniform top-k); dense: layer 0 (KDA + dense MLP)")
    return table


def floors_headline(doc: dict) -> str:
    return "floor per layer: " + ", ".join(
        f"{kind} {t['floor_us']:.1f} µs ({t['bytes'] / 1e6:,.1f} MB)"
        for kind, t in doc["layer_types"].items())
