"""What kimi-perf reads as breakdowns, for every command and for notebooks alike.

A run is what ``kimi-perf trace`` writes (its directory, or the ``breakdown.json`` in it, one
breakdown per decode path), a breakdown JSON of one trace (``breakdown --format json``), or
any trace the readers take (one path named ``trace``, broken down as ``breakdown`` does).
A baseline is the same document, kept as a JSON of its own. A stored breakdown is checked
field by field as it is read, so that an edited or truncated file is one error naming it, not
a traceback from the gate or the report. The run information a run carries (its run.json)
says how it was captured; ``run_differences`` says how two captures differ.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from kimi_perf.errors import (
    COMMAND_LINE,
    TraceError,
    argument,
    path_argument,
    path_list,
    stat_problem,
)
from kimi_perf.layer_breakdown import Breakdown, breakdown_of_file, layer_column
from kimi_perf.names import primed
from kimi_perf.readers.nsys import NSYS_REPORTS, is_stale_export
from kimi_perf.text import counted
from kimi_perf.trace import (
    ARROW_MAGIC,
    JSON_HEAD,
    atomic_write_text,
    check_not_read_only,
    file_identity,
    is_int64,
    json_text,
    kimi_perf_head,
    kimi_perf_head_read,
    kptrace_sources,
    printable,
)

TRACE = "trace"  # the one path of a breakdown that is not a kimi-perf trace run
# the figures every layer type of a stored breakdown holds
LAYER_TYPE_FIGURES = ("kernels", "kernel_us", "span_us", "gap_us")


def one_path(file: Path, runs: dict[str, Breakdown], name: str | None,
             parameter: str = "path_name") -> tuple[str, Breakdown]:
    """A run's decode path ``name`` (None: its only one), or an error naming the paths (and
    the argument that picks one, ``--path`` or the call's ``parameter``)."""
    if name is None and len(runs) == 1:
        return next(iter(runs.items()))
    if name is None:
        raise TraceError(file, f"holds the paths {', '.join(runs)}: choose one with "
                               f"{argument('--path', parameter)}")
    if name not in runs:
        raise TraceError(file, f"has no path {name!r} (it has {', '.join(runs)})")
    return name, runs[name]


def check_storable(file: str | Path) -> None:
    """Refuse a baseline file ``store_baseline`` must not write: not a .json file, a
    kimi-perf run directory's breakdown.json (or the directory), whose run.json, traces and
    report would then describe another run than it, or a file made read-only."""
    file = Path(file)
    if file.is_dir() and (file / "breakdown.json").exists():
        file = file / "breakdown.json"
    if file.is_dir() or file.suffix != ".json":
        raise TraceError(file, "a baseline is a .json file")
    if is_run_breakdown(file):
        raise TraceError(file, "is a kimi-perf run directory's: its run.json and traces would "
                               "no longer match it; keep a baseline as a JSON of its own (a "
                               "copy of the run's breakdown.json)")
    check_not_read_only(file)   # (before the run is read and gated: minutes, for a trace)


def store_baseline(file: str | Path, run_doc: dict) -> None:
    """Write a run's document (``load_run``'s second value, ``GatedRun.run_doc``) as the
    baseline JSON ``file`` (``check_storable``), whole or not at all."""
    if not (isinstance(run_doc, dict) and (
            (isinstance(run_doc.get("paths"), dict) and "run" in run_doc)
            or "layer_types" in run_doc)):
        said = ("load_run's first value (the breakdowns by path): its second is the document"
                if isinstance(run_doc, dict) and run_doc
                and all(isinstance(v, Breakdown) for v in run_doc.values())
                else f"a {type(run_doc).__name__} of another shape")
        raise TypeError(f"run_doc: a run's document (load_run(run)[1], GatedRun.run_doc), not "
                        f"{said}")
    file = path_argument(file, "file")
    check_storable(file)
    atomic_write_text(Path(file), json_text(run_doc))


def load_run(path: str | Path, phase: str = "auto", **breakdown_options
             ) -> tuple[dict[str, Breakdown], dict, Path | None]:
    """The breakdowns per decode path of a run (see the module doc), the JSON document that
    stores them (what a baseline file holds), and the JSON file they came from (None for a
    trace, broken down over the steps of ``phase``, and as ``breakdown_options`` say:
    ``layers``, ``step_regex``, ``rules``, as ``breakdown`` takes them). A trace's document
    holds its layers as columns (``LayerRows``): ``json_text`` writes it as it would the list
    of dicts, without building them all at once."""
    check_breakdown_options(breakdown_options)
    path = path_argument(path, "path")
    of_run = path.is_dir()
    if of_run:
        path = path / "breakdown.json"
        if not path.exists():
            raise TraceError(path.parent, "not a kimi-perf run directory (no breakdown.json)")
    # a run's breakdown.json is ours whatever it holds: one replaced by other JSON ([], say)
    # is a broken run, not a trace without GPU work
    of_run = of_run or is_run_breakdown(path)
    if of_run and not path.is_file():
        raise TraceError(path, "not a kimi-perf run breakdown (not a regular file)")
    if of_run or (path.suffix == ".json" and is_kimi_perf_json(path)):
        try:
            doc = json.loads(path.read_text(encoding="utf-8-sig"))   # a BOM, if any
        except FileNotFoundError:
            raise TraceError(path, "no such file") from None
        except OSError as exc:
            raise TraceError(path, f"cannot read ({exc.strerror or exc})") from None
        except (ValueError, RecursionError) as exc:
            why = ("a number of more than 4,300 digits" if "integer string conversion"
                   in str(exc) else str(exc))   # (Python's words say how to lift its limit)
            raise TraceError(path, f"not JSON that can be read ({why})") from None
        if isinstance(doc, dict) and (problem := stored_tolerances_problem(
                doc.get("gate_tolerances")) or run_spread_problem(doc.get("run_spread"))):
            raise TraceError(path, problem)
        if isinstance(doc, dict) and isinstance(doc.get("paths"), dict) and doc["paths"]:
            if "schema" not in doc:
                raise TraceError(path, "a kimi-perf run breakdown without its 'schema' (1)")
            if type(doc["schema"]) is not int or doc["schema"] != 1:
                raise TraceError(path, "not a kimi-perf run breakdown of schema 1")
            if "run" not in doc:   # (kimi-perf trace writes it: how the run was captured)
                raise TraceError(path, "a run breakdown without its run information ('run': "
                                       "what its run.json holds), which the gate checks")
            if problem := run_info_problem(doc["run"]):
                raise TraceError(path, problem)
            return {name: Breakdown.from_json(b, path, f"paths.{name}.")
                    for name, b in doc["paths"].items()}, doc, path
        if isinstance(doc, dict) and "layer_types" in doc:
            return {TRACE: Breakdown.from_json(doc, path)}, doc, path
        if of_run:
            raise TraceError(path, "not a kimi-perf run breakdown (JSON of another shape: "
                                   "not {schema: 1, paths: {path: breakdown}})")
        raise TraceError(path, "neither a kimi-perf run breakdown nor a breakdown JSON")
    b = breakdown_of_file(path, phase=phase, **breakdown_options)
    return {TRACE: b}, b.to_json(lazy_layers=True), None


# What load_run passes to breakdown for a trace (how ``breakdown`` breaks it down).
BREAKDOWN_OPTIONS = {"layers", "step_regex", "rules"}


def check_breakdown_options(options: dict) -> None:
    """Refuse an option ``breakdown`` does not take: a stored breakdown reads none of them,
    so a misspelt one (``layres=``) would pass unnoticed where the input is JSON."""
    if unknown := sorted(set(options) - BREAKDOWN_OPTIONS):
        raise TypeError(f"unknown breakdown option {', '.join(unknown)} (one of "
                        f"{', '.join(sorted(BREAKDOWN_OPTIONS))})"
                        + ("; path_name picks the decode path" if "path" in unknown else ""))


# The gate's settings a baseline keeps (``gate --update`` with them given): its options
STORED_TOLERANCES = ("rel_tol", "abs_tol_us", "alpha", "metrics")


def stored_tolerances_problem(value: object) -> str | None:
    """Why a baseline's ``gate_tolerances`` cannot be read, or None (absent: None too)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - set(STORED_TOLERANCES):
        return (f"gate_tolerances is not an object of {', '.join(STORED_TOLERANCES)} (the "
                "gate's settings gate --update stored)")
    for key in ("rel_tol", "abs_tol_us"):
        if key in value and not (is_finite_number(value[key]) and value[key] >= 0):
            return f"gate_tolerances.{key} is not a finite number >= 0"
    if "alpha" in value and not (is_finite_number(value["alpha"]) and 0 < value["alpha"] < 1):
        return "gate_tolerances.alpha is not a probability in (0, 1)"
    if "metrics" in value and not isinstance(value["metrics"], str):
        return "gate_tolerances.metrics is not a text (kernels,kernel_us,span_us)"
    return None


# The times a baseline keeps the spread of, run to run (``gate --update --spread-from``):
# a layer type's and a step's medians, each class's and each layer's kernel µs, the steps'
# mean span
SPREAD_METRICS = ("kernel_us", "span_us", "class_us", "layer_kernel_us", "span_us_mean")
# each device's medians of a job of several (the gate's per-device checks), by the stored
# run's device
SPREAD_DEVICE_METRICS = ("kernel_us_device", "span_us_device")
SPREAD_FEWEST_RUNS = 5   # the stored run and four more: at alpha 0.01, three runs pass a run
                         # 8 sd off their mean, four one 5 sd off


def run_spread_problem(value: object) -> str | None:
    """Why a baseline's ``run_spread`` cannot be read, or None (absent: None too)."""
    if value is None:
        return None
    if not (isinstance(value, dict) and isinstance(runs := value.get("runs"), list)
            and len(runs) >= SPREAD_FEWEST_RUNS and all(isinstance(r, str) for r in runs)
            and isinstance(figures := value.get("figures"), list)):
        return (f"run_spread is not an object of runs (the names of {SPREAD_FEWEST_RUNS} or "
                "more) and figures (what gate --update --spread-from stored)")
    keys = set()
    for i, f in enumerate(figures):
        if not (isinstance(f, dict) and set(f) <= {"path", "layer_type", "metric",
                                                   "kernel_class", "layer_index", "device",
                                                   "values"}
                and all(isinstance(f.get(k), str) for k in ("path", "layer_type"))
                and f.get("metric") in (*SPREAD_METRICS, *SPREAD_DEVICE_METRICS)
                # (a class's name for class_us alone, a layer's index for layer_kernel_us)
                and isinstance(f.get("kernel_class", ""), str)
                and ("kernel_class" in f) == (f["metric"] == "class_us")
                and type(f.get("layer_index", 0)) is int
                and ("layer_index" in f) == (f["metric"] == "layer_kernel_us")
                and type(f.get("device", 0)) is int
                and ("device" in f) == (f["metric"] in SPREAD_DEVICE_METRICS)
                and isinstance(values := f.get("values"), list) and len(values) == len(runs)
                and all(is_finite_number(v) for v in values)):
            return (f"run_spread.figures[{i}] is not an object of a path, layer_type, metric "
                    f"({', '.join((*SPREAD_METRICS, *SPREAD_DEVICE_METRICS))}; a "
                    "kernel_class for class_us, a layer_index for layer_kernel_us, a device "
                    "for a device's) and a finite value for each of its "
                    f"{len(runs)} runs")
        key = tuple(f.get(k) for k in ("path", "layer_type", "metric", "kernel_class",
                                       "layer_index", "device"))
        if key in keys:
            return f"run_spread.figures[{i}] is a figure of an earlier one's again"
        keys.add(key)
    return None


def run_info_problem(run: object) -> str | None:
    """Why a run's information (``run`` in a run's breakdown.json or a baseline: what its
    run.json holds) cannot be read by the gate, compare and the report, or None."""
    if not isinstance(run, dict):
        return "'run' is not an object"
    for key in ("environment", "request", "paths", "floors"):
        if run.get(key) is not None and not isinstance(run[key], dict):
            return f"run.{key} is not an object"
    for keys, kind in RUN_SETTING_KINDS.items():
        value = run
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and not kind[0](value):
            return f"run.{'.'.join(keys)} is not {kind[1]}"
    gpus = (run.get("environment") or {}).get("gpus")
    if gpus is not None and not (isinstance(gpus, list)
                                 and all(isinstance(g, str) for g in gpus)):
        return "run.environment.gpus is not a list of names"
    for name, m in (run.get("paths") or {}).items():
        if not isinstance(m, dict):
            return f"run.paths.{name} is not an object"
        latency = m.get("step_latency_s")
        if not (isinstance(latency, dict) and all(is_finite_number(v) for v in (
                m.get("decode_tokens_per_s"), m.get("time_to_first_token_s"),
                latency.get("median"), latency.get("min"), latency.get("max")))):
            return f"run.paths.{name}: its decode metrics are not numbers"
        if not isinstance(m.get("timed", ""), str):
            return f"run.paths.{name}.timed is not a text"
        fallbacks = m.get("fallbacks") or []
        if not (isinstance(fallbacks, list) and all(isinstance(f, str) for f in fallbacks)):
            return f"run.paths.{name}.fallbacks is not a list of the steps that fell back"
        if not (m.get("logits_finite") is None or isinstance(m["logits_finite"], bool)):
            return f"run.paths.{name}.logits_finite is not true, false or null"
        if not isinstance(m.get("every_step_fell_back", False), bool):
            return f"run.paths.{name}.every_step_fell_back is not true or false"
    floors = run.get("floors")
    if floors is not None and not (
            is_finite_number(floors.get("bandwidth_Bps"))
            and isinstance(floors.get("layer_types"), dict)
            and all(isinstance(v, dict) and is_finite_number(v.get("floor_us"))
                    for v in floors["layer_types"].values())):
        return "run.floors is not {bandwidth_Bps, layer_types: {type: {floor_us}}}"
    return None


def _count(value) -> bool:
    return type(value) is int and value >= 0


def _text(value) -> bool:
    return isinstance(value, str)


# What each setting ``run_differences`` compares must be, where a run records it: a count
# stored as "two" would compare unlike every number and pass for a difference of capture.
RUN_SETTING_KINDS = {
    **{keys: (_count, "a whole number, 0 or more") for keys in (
        ("n_layers",), ("batch",), ("tp",), ("context",), ("warmup_steps",), ("spec_tokens",),
        ("request", "seed"), ("environment", "cpu_threads"))},
    **{keys: (_text, "a text") for keys in (
        ("preset",), ("config_hash",), ("request", "kv_cache"), ("request", "experts"),
        ("request", "backend"), ("environment", "device"))},
    ("request", "graphs"): (lambda v: isinstance(v, bool), "true or false"),
    ("request", "paths"): (lambda v: isinstance(v, list) and all(map(_text, v)),
                           "a list of path names"),
}


def is_run_breakdown(path: str | Path) -> bool:
    """Whether ``path`` is a kimi-perf run directory's breakdown.json (beside the run.json
    ``kimi-perf trace`` wrote), which must be a kimi-perf document whatever its first bytes:
    no trace is stored under that name there."""
    path = Path(path)
    return path.name == "breakdown.json" and is_kimi_perf_run_json(path.parent / "run.json")


def is_kimi_perf_run_json(path: str | Path) -> bool:
    """Whether ``path`` is a run.json that ``kimi-perf trace`` wrote (it begins with the
    command that made the run), not any file of that name."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return re.match(rb'\s*\{\s*"command"\s*:', f.read(64)) is not None
    except OSError:
        return False


def captured_path(trace_file: str | Path) -> str | None:
    """The decode path a trace in a ``kimi-perf trace`` run directory holds, told by its name
    (``specialized.kptrace``, ``standard.rank0.trace.json.gz``: a path the run captured, then
    a dot), or None for any other file."""
    trace_file = Path(trace_file)
    run_json = trace_file.parent / "run.json"
    if not (trace_file.is_file() and is_kimi_perf_run_json(run_json)):
        return None
    try:
        paths = (json.loads(run_json.read_text(encoding="utf-8")).get("request") or {}).get(
            "paths")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    name = trace_file.name.split(".", 1)[0]
    return name if isinstance(paths, list) and name in paths else None


def captured_run(trace_file: str | Path) -> dict | None:
    """A document holding the run information (``{"run": ...}``, as a run's breakdown.json
    holds it) of the ``kimi-perf trace`` run whose directory holds the trace of one of its
    paths (``captured_path``); None for any other file."""
    if captured_path(trace_file) is None:
        return None
    try:
        info = json.loads((Path(trace_file).parent / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return {"run": info} if isinstance(info, dict) and not run_info_problem(info) else None


def is_kimi_perf_json(path: str | Path) -> bool:
    """Whether a JSON file is one of ours (a breakdown or a run's breakdowns: they begin with
    ``"schema"``, or, their keys moved, with another of theirs and no Kineto key after it),
    told from its first bytes, so that a large JSON trace is not parsed twice (a Kineto trace
    begins with ``"schemaVersion"`` or ``"traceEvents"``, if with an object)."""
    path = Path(path)
    if not path.is_file():      # a pipe would be read in part (and wait for a writer)
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(256)
            if (ours := kimi_perf_head(head)) is None:   # (its keys moved, or a trace's)
                ours = kimi_perf_head_read(head + f.read(JSON_HEAD))
    except OSError:
        return False
    return ours


def is_finite_number(v) -> bool:
    """A JSON number of a figure: not a bool, not inf or nan, not an integer beyond a float."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:   # an integer literal too large for a float
        return False


def is_figure(v) -> bool:
    """A count or a time of a breakdown: a finite number, not below 0."""
    return is_finite_number(v) and v >= 0


def _is_count(v) -> bool:
    return is_int64(v) and v >= 0


# What each row of a stored breakdown's lists must hold, field by field: (field, kind, the
# value of a field left out: None where it must be there). KINDS: what a kind is, in words.
_KINDS = {"count": "a count (an integer >= 0)", "count?": "a count or null",
          "integer": "an integer", "figure": "a finite number >= 0", "name": "a name",
          "name?": "a name or null", "classes": "{class: {kernels, us}} of numbers >= 0",
          "part": "{kernels, span_us} of numbers >= 0"}
RowFields = tuple[tuple[str, str, str | None], ...]
_ROW_FIELDS: RowFields = (
    ("kernels", "count", None), ("kernel_us", "figure", None), ("span_us", "figure", None),
    ("gap_us", "figure", None), ("classes", "classes", None), ("index", "integer", None),
    ("device", "integer", None))
_LAYER_TYPE_FIELDS: RowFields = (("type", "name", None),)
_LAYER_FIELDS: RowFields = (("type", "name", None), ("step", "integer", None), *_ROW_FIELDS)
_STEP_FIELDS: RowFields = (
    *_ROW_FIELDS, ("phase", "name?", None), ("layers", "count?", None), ("name", "name", ""),
    ("layer_source", "name", ""), ("other_thread_ops", "count?", None),
    ("prologue", "part", None), ("epilogue", "part", None))


def _column_ok(kind: str, values: list) -> bool:
    """Whether every value of a field is of its kind (``_KINDS``): checked a column at a time
    by its types and extremes, with no call per value but for the nested kinds."""
    types = set(map(type, values))   # (bool is a type of its own: no count, no figure)
    if kind in ("name", "name?"):
        return types <= ({str, type(None)} if kind == "name?" else {str})
    if kind in ("count", "count?", "integer"):
        if not types <= ({int, type(None)} if kind == "count?" else {int}):
            return False
        numbers = [v for v in values if v is not None]
        least = 0 if kind != "integer" else -(2**63)
        return not numbers or (min(numbers) >= least and max(numbers) < 2**63)
    if kind == "figure":
        if not types <= {int, float}:
            return False
        try:
            column = np.array(values, np.float64)
        except OverflowError:    # an integer literal beyond a float
            return False
        return bool(np.isfinite(column).all() and (column >= 0).all())
    if kind == "classes":   # every class of every row, as columns of their own
        if not set(map(type, values)) <= {dict}:
            return False
        entries = [c for classes in values for c in classes.values()]
        return set(map(type, entries)) <= {dict} and all(
            _column_ok("figure", [c.get(figure) for c in entries]) for figure in ("kernels", "us"))
    return all(isinstance(v, dict) and _is_count(v.get("kernels"))   # a step's part
               and is_figure(v.get("span_us"))
               and ("kernel_us" not in v or is_figure(v["kernel_us"])) for v in values)


def _rows_problem(b: Breakdown, where: str = "") -> str | None:
    """The first row of a stored breakdown's layer_types, layers or steps that lacks a field
    the gate, compare or the report reads, or holds one of another kind, as
    "{where}steps[3].kernels is -5, not a count", or None. Each field is checked a whole
    column at a time (40,000 layers in a blink); only a column found bad is gone through
    value by value, for its first bad row."""
    for name, rows, fields in (("layer_types", b.layer_types, _LAYER_TYPE_FIELDS),
                               ("layers", b.layers, _LAYER_FIELDS),
                               ("steps", b.steps, _STEP_FIELDS)):
        if not isinstance(rows, list):
            return f"{where}{name} is {_json_kind(rows)}, not a list"
        if not set(map(type, rows)) <= {dict}:
            i = next(i for i, r in enumerate(rows) if not isinstance(r, dict))
            return f"{where}{name}[{i}] is {_json_kind(rows[i])}, not an object"
        columns = {key: [r.get(key, absent) for r in rows] for key, _, absent in fields}
        bad = [(key, kind) for key, kind, _ in fields if not _column_ok(kind, columns[key])]
        if not bad:
            continue
        # the first row with a bad field, and its first bad field, in the order listed
        i = min(_first_bad(kind, columns[key]) for key, kind in bad)
        key, kind = next((key, kind) for key, kind in bad
                         if not _column_ok(kind, [columns[key][i]]))
        if key not in rows[i]:
            return f"{where}{name}[{i}] lacks {key} ({_KINDS[kind]})"
        return f"{where}{name}[{i}].{key}{_inner_problem(key, rows[i][key], _KINDS[kind])}"
    return None


def _first_bad(kind: str, values: list) -> int:
    """The index of the first value not of its kind in a column that holds one, found by
    halving (a column check or two dozen, rather than a call per value)."""
    good, bad = 0, len(values)    # values[:good] are all of the kind; values[:bad] are not
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _column_ok(kind, values[:middle]) else (good, middle)
    return good


def _json_kind(value: object) -> str:
    """A JSON value in a few words for an error: a number or literal as written (cut short),
    anything else by its kind (a name from the file could hold anything)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= 24 else text[:23] + "…"
    return ("a string" if isinstance(value, str) else "a list" if isinstance(value, list)
            else "an object")


def _inner_problem(key: str, value: object, what: str) -> str:
    """What is wrong with a row's field, from just after its name: within classes, a
    prologue or an epilogue, the entry and figure that is wrong (``['gemm'].us is -5.0, not
    ...``), else the field as a whole (`` is "5", not a count``)."""
    figures = {"classes": (("kernels", "figure"), ("us", "figure")),   # (a median's kernels)
               "prologue": (("kernels", "count"), ("span_us", "figure")),
               "epilogue": (("kernels", "count"), ("span_us", "figure"))}.get(key)
    if figures is None or not isinstance(value, dict):
        return f" is {_json_kind(value)}, not {what}"
    entries = list(value.items()) if key == "classes" else [(None, value)]
    for label, entry in entries:
        at = f"[{label!r}]" if label is not None else ""
        if not isinstance(entry, dict):
            return f"{at} is {_json_kind(entry)}, not {{{', '.join(f for f, _ in figures)}}}"
        for figure, kind in figures:
            if figure not in entry:
                return f"{at} lacks {figure} ({_KINDS[kind]})"
            if not _column_ok(kind, [entry[figure]]):
                return f"{at}.{figure} is {_json_kind(entry[figure])}, not {_KINDS[kind]}"
        if key != "classes" and "kernel_us" in entry and not is_figure(entry["kernel_us"]):
            return f".kernel_us is {_json_kind(entry['kernel_us'])}, not {_KINDS['figure']}"
    return f" is {_json_kind(value)}, not {what}"


def _source_problem(source) -> str | None:
    """The first field of ``source`` that the tables and the report print and that is not
    what they expect, as "source.FIELD is not WHAT", or None."""
    if not isinstance(source, dict):
        return "source is not an object"

    def listed(key: str, item) -> bool:
        value = source.get(key)
        return value is None or (isinstance(value, list)
                                 and all(isinstance(v, dict) and item(v) for v in value))

    def counts(key: str) -> bool:
        value = source.get(key)
        return value is None or (isinstance(value, dict) and all(
            isinstance(k, str) and _is_count(n) for k, n in value.items()))

    outside = source.get("outside_steps")

    def gpu_list(key: str) -> bool:
        gpus = source.get(key)
        return gpus is None or (isinstance(gpus, list) and all(
            isinstance(g, dict) and (g.get("name") is None or isinstance(g["name"], str))
            and (g.get("sm_count") is None or _is_count(g["sm_count"])) for g in gpus))

    fields = [
        *((key, "a string", source.get(key) is None or isinstance(source[key], str))
          for key in ("ops", "file", "tool", "format", "steps_found_by")),
        ("repeating_ranges", "[{range, instances, kernels}]", listed(
            "repeating_ranges", lambda r: isinstance(r.get("range"), str)
            and _is_count(r.get("instances")) and _is_count(r.get("kernels")))),
        ("enclosing_steps", "[{step, encloses, ops}]", listed(
            "enclosing_steps", lambda e: isinstance(e.get("step"), str)
            and _is_count(e.get("encloses")) and _is_count(e.get("ops")))),
        ("pass_ranges", "[{steps, in_ranges}]", listed(
            "pass_ranges", lambda g: isinstance(g.get("steps"), list)
            and all(isinstance(n, str) for n in g["steps"]) and _in_ranges_ok(g.get("in_ranges")))),
        ("layer_like_ranges", "{names: [string], count}", (
            like := source.get("layer_like_ranges")) is None or (
            isinstance(like, dict) and _is_count(like.get("count"))
            and isinstance(like.get("names"), list)
            and all(isinstance(n, str) for n in like["names"]))),
        ("steps_holding_passes", "[{step, passes, layers}]", listed(
            "steps_holding_passes", lambda h: isinstance(h.get("step"), str)
            and _is_count(h.get("passes")) and _is_count(h.get("layers")))),
        *((key, "a count", source.get(key) is None or _is_count(source[key]))
          for key in ("other_thread_ops", "graph_captures", "kernels", "memops", "ranges")),
        ("schema", "a string or an integer", source.get("schema") is None
         or isinstance(source["schema"], str) or _is_count(source["schema"])),
        ("steps_left_out", "{phase: count}", counts("steps_left_out")),
        ("untimed", "{kernels, memops} as counts", counts("untimed")),
        ("untimed_ranges", "a count", source.get("untimed_ranges") is None
         or _is_count(source["untimed_ranges"])),
        ("duplicates", "{kernels, memops} as counts", counts("duplicates")),
        ("outside_steps", "{ops, kernel_us, unlaunched, during_overlapping_steps, in_ranges, "
         "partial_passes: {parts, ops}}",
         outside is None or (isinstance(outside, dict) and _is_count(outside.get("ops"))
                             and is_figure(outside.get("kernel_us"))
                             and _is_count(outside.get("unlaunched", 0))
                             and _is_count(outside.get("during_overlapping_steps", 0))
                             and outside.get("during_overlapping_steps", 0) <= outside["ops"]
                             and _partial_ok(outside.get("partial_passes"))
                             and _in_ranges_ok(outside.get("in_ranges") or []))),
        ("breakdown_options",
         "{layers, steps, phase, rules, layout_rules, default_rules} as strings or null",
         source.get("breakdown_options") is None or (
             isinstance(source["breakdown_options"], dict)
             and all(v is None or isinstance(v, str)
                     for v in source["breakdown_options"].values()))),
        ("gpus", "[{name, sm_count}]", gpu_list("gpus")),
        ("gpus_ran", "[{name, sm_count}]", gpu_list("gpus_ran")),
        ("captures", "a list of file names", source.get("captures") is None or (
            isinstance(source["captures"], list)
            and all(isinstance(c, str) for c in source["captures"]))),
        ("graph_replays", "{ops, placed_at_capture} as counts", source.get("graph_replays")
         is None or (isinstance(source["graph_replays"], dict)
                     and _is_count(source["graph_replays"].get("ops"))
                     and _is_count(source["graph_replays"].get("placed_at_capture", 0)))),
    ]
    return next((f"source.{key} is not {what}" for key, what, ok in fields if not ok), None)


def _partial_ok(partial) -> bool:
    return partial is None or (isinstance(partial, dict) and _is_count(partial.get("parts"))
                               and _is_count(partial.get("ops")))


def _in_ranges_ok(in_ranges) -> bool:
    return isinstance(in_ranges, list) and all(
        isinstance(r, dict) and "range" in r and (r["range"] is None or isinstance(r["range"], str))
        and _is_count(r.get("ops")) for r in in_ranges)


def checked_breakdown(b: Breakdown, path: Path, where: str = "") -> Breakdown:
    """A breakdown read from JSON, with the fields the gate and the report read; ``where``:
    the breakdown's place in the file (``paths.standard.``), which a bad row's error names."""
    if problem := _source_problem(b.source):
        raise TraceError(path, problem)
    if problem := _rows_problem(b, where):
        raise TraceError(path, problem)
    if problem := _disagreement(b, where):
        raise TraceError(path, problem)
    for t in b.layer_types:
        if not _layer_type_figures_ok(t):
            raise TraceError(path, f"layer type {t['type']!r}: not {{layers, kernels, "
                                   "kernel_us, span_us, gap_us, classes: {class: {kernels, "
                                   "us}}} as numbers, and a pattern digest")
        groups = t.get("two_groups")
        if groups is not None and not (isinstance(groups, list) and all(
                isinstance(g, dict) and isinstance(g.get("figure"), str)
                and is_figure(g.get("low_us")) and is_figure(g.get("high_us"))
                and _is_count(g.get("low_layers")) and isinstance(g.get("high_layers"), list)
                and all(_is_count(i) for i in g["high_layers"])
                and isinstance(g.get("median_between", False), bool)
                and (g.get("kernels") is None or (
                    isinstance(g["kernels"], list) and len(g["kernels"]) == 2
                    and all(_is_count(k) for k in g["kernels"])
                    and g["kernels"][0] <= g["kernels"][1])) for g in groups)):
            raise TraceError(path, f"layer type {t['type']!r}: two_groups is not [{{figure, "
                                   "low_us, high_us, low_layers, high_layers: [index], "
                                   "kernels: [fewest, most]}]")
        typical = t.get("typical_layer")
        if typical is not None and not (
                isinstance(typical, dict) and _is_count(typical.get("layers"))
                and isinstance(typical.get("kernels"), list)
                and all(isinstance(k, dict) and isinstance(k.get("name"), str)
                        and isinstance(k.get("class"), str)
                        and is_figure(k.get("us"))
                        and (k.get("spread_us") is None or (
                            isinstance(k["spread_us"], list) and len(k["spread_us"]) == 2
                            and all(map(is_figure, k["spread_us"]))))
                        for k in typical["kernels"])):
            raise TraceError(path, f"layer type {t['type']!r}: typical_layer is not "
                                   "{layers, kernels: [{name, class, us, spread_us?}]}")
    if b.timeline is not None and not _timeline_ok(b.timeline):
        raise TraceError(path, "timeline is not {step, names, segments: [{label, ops: "
                               "[[name index, class, start µs, µs]]}], ops_left_out?, "
                               "by_stream?}")
    return b


def _disagreement(b: Breakdown, where: str = "") -> str | None:
    """Where a stored breakdown's summaries disagree with the rows they summarise (an edited
    or mixed file: compare reads a layer type's summary, the gate its layers): a layer type
    per type of the layers, its layer count and median kernels theirs, every layer's step
    among the steps, and a step's layer count its layers'. ``where``: as for
    ``checked_breakdown``."""
    types = Counter(r["type"] for r in b.layers)
    stated = [t["type"] for t in b.layer_types]
    if sorted(stated) != sorted(types):
        return (f"its layer types ({', '.join(stated) or 'none'}) are not those of its layers "
                f"({', '.join(types) or 'none'})")
    for t in b.layer_types:
        kernels = layer_column(b.layers, "kernels", t["type"])
        if t.get("layers") != types[t["type"]] or (
                is_figure(t.get("kernels")) and t["kernels"] != float(np.median(kernels))):
            return (f"layer type {t['type']!r} says {t.get('layers')} layers of median "
                    f"{t.get('kernels')} kernels; its layers are {types[t['type']]} of median "
                    f"{float(np.median(kernels)):g}")
    if stray := _stray_layer(b, where):
        return stray
    per_step = Counter((r["step"], r["device"]) for r in b.layers)
    for s in b.steps:
        held = per_step[(s.get("index"), s.get("device"))]
        if s.get("layers") is not None and s["layers"] != held:
            return f"step {s.get('index')} says {s['layers']} layers; {held} layers are in it"
    return None


def _stray_layer(b: Breakdown, where: str = "") -> str | None:
    """The first layer whose step (and device) is none of the breakdown's steps, said, or
    None: every layer is cut from a step, so a layer without its step is an edited file (its
    steps emptied, say), whose steps the gate would check as nothing."""
    steps, devices = layer_column(b.layers, "step"), layer_column(b.layers, "device")
    if not len(steps):
        return None
    # (step, device) pairs, each with its first layer: a few per step, whatever the layers
    pairs, first = np.unique(np.stack([steps, devices], axis=1), axis=0, return_index=True)
    held = {(s.get("index"), s.get("device")) for s in b.steps}
    stray = [(i, s, d) for (s, d), i in zip(pairs.tolist(), first.tolist(), strict=True)
             if (s, d) not in held]
    if not stray:
        return None
    i, step, device = min(stray)
    return (f"{where}layers[{i}] is of step {step} on device {device}, which is none of its "
            f"{counted(len(b.steps), 'step')}")


def _classes_ok(classes) -> bool:
    return isinstance(classes, dict) and all(
        isinstance(c, dict) and is_figure(c.get("kernels"))
        and is_figure(c.get("us")) for c in classes.values())


def _layer_type_figures_ok(t: dict) -> bool:
    return (_is_count(t.get("layers"))
            and all(is_figure(t.get(m)) for m in LAYER_TYPE_FIGURES)
            and _classes_ok(t.get("classes"))
            and (t.get("pattern") is None or isinstance(t["pattern"], str)))


def _timeline_ok(timeline) -> bool:
    if not isinstance(timeline, dict):
        return False
    names, segments = timeline.get("names"), timeline.get("segments")
    if not (isinstance(timeline.get("step"), str) and isinstance(names, list)
            and _is_count(timeline.get("ops_left_out", 0))
            and isinstance(timeline.get("by_stream", False), bool)
            and all(isinstance(n, str) for n in names) and isinstance(segments, list)):
        return False
    return all(isinstance(seg, dict) and isinstance(seg.get("label"), str)
               and isinstance(seg.get("ops"), list)
               and all(isinstance(op, list) and len(op) == 4 and isinstance(op[0], int)
                       and not isinstance(op[0], bool) and 0 <= op[0] < len(names)
                       and isinstance(op[1], str) and is_finite_number(op[2])
                       and is_finite_number(op[3])
                       for op in seg["ops"])
               for seg in segments)


# What makes two captures comparable: the model, the step's shape and how it ran.
RUN_SETTINGS = (("preset", ("preset",)), ("layers", ("n_layers",)),
                ("model config", ("config_hash",)), ("batch", ("batch",)), ("TP", ("tp",)),
                ("context", ("context",)), ("warm-up steps", ("warmup_steps",)),
                ("seed", ("request", "seed")), ("draft tokens", ("spec_tokens",)),
                ("KV cache", ("request", "kv_cache")), ("experts", ("request", "experts")),
                ("CUDA graphs", ("request", "graphs")),
                ("profiler", ("request", "backend")), ("device", ("environment", "device")),
                ("GPUs", ("environment", "gpus")),
                ("CPU threads", ("environment", "cpu_threads")))

# Settings that move a CPU run's figures alone (a GPU's kernels do not wait on host threads).
CPU_SETTINGS = {("environment", "cpu_threads")}


# What a capture made before a setting was recorded ran with.
BEFORE_SETTING = {("spec_tokens",): 0, ("request", "experts"): "bf16"}


def run_differences(baseline_doc: dict, run_doc: dict, cpu_times: bool = True,
                    paths: bool = False) -> list[str]:
    """How the captures behind a baseline and a run differ ("TP 1 vs 2"), from their run
    information; nothing where either side has none (a trace, a breakdown JSON). Kernels
    and µs of unlike runs differ for reasons no regression explains. ``cpu_times``: whether
    the times of CPU runs are read, else the settings that move those alone (``CPU_SETTINGS``)
    are not compared; ``paths``: whether the decode paths captured are (the whole runs are
    compared, not a path of each)."""
    runs = [d.get("run") if isinstance(d, dict) else None for d in (baseline_doc, run_doc)]
    if not all(isinstance(r, dict) for r in runs):
        return []

    def setting(run: dict, keys: tuple[str, ...]):
        for key in keys:
            run = run.get(key) if isinstance(run, dict) else None
        return run

    out = []
    on_cpu = all(setting(r, ("environment", "device")) == "cpu" for r in runs)
    for label, keys in RUN_SETTINGS:
        if keys in CPU_SETTINGS and not (on_cpu and cpu_times):
            continue
        # a capture made before speculative decoding (MXFP4 experts) was has no
        # "spec_tokens" ("experts"): it made none (bf16 ones)
        base, cur = (setting(r, keys) if setting(r, keys) is not None or "preset" not in r
                     else BEFORE_SETTING.get(keys) for r in runs)
        if base is not None and cur is not None and base != cur:
            out.append(f"{label} {_setting_text(base)} vs {_setting_text(cur)}")
    paths_run = [setting(r, ("request", "paths")) for r in runs]
    if paths and None not in paths_run and sorted(paths_run[0]) != sorted(paths_run[1]):
        # (paired by name: their order is no difference)
        out.append(f"decode paths {_setting_text(paths_run[0])} vs "
                   f"{_setting_text(paths_run[1])}")
    if all("preset" in r for r in runs):   # two captures: their specialized path's opt-ins
        for label, key in OPT_INS:         # (off where a capture predates the option)
            base, cur = (_opt_in_text(setting(r, ("request", key))) for r in runs)
            if base != cur:
                out.append(f"{label} {base} vs {cur}")
    return out


def captured_differently(a: str, b: str, differences: list[str]) -> str:
    """The line that says how two captures were made differently (``run_differences``)."""
    return (f"{a} and {b} were captured differently: {'; '.join(differences)}: their kernels "
            "and µs may differ for that alone")


OPT_INS = (("L2 prefetch", "l2_prefetch"), ("experts grouped from", "group_experts_from"),
           ("PDL", "pdl"))


def _opt_in_text(value) -> str:
    return "off" if value is None or value is False else "on" if value is True else str(value)


def _setting_text(value) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def is_stored(path: str | Path) -> bool:
    """A kimi-perf run directory or JSON file (a stored breakdown), not a trace (nor a
    directory of traces); a run directory's breakdown.json whatever it holds (``load_run``
    refuses one that is not ours)."""
    path = Path(path)
    return ((path / "breakdown.json").exists() if path.is_dir()
            else is_run_breakdown(path)
            or (path.suffix == ".json" and is_kimi_perf_json(path)))


def stored_breakdowns(path: str | Path) -> tuple[dict[str, Breakdown], dict | None]:
    """What a kimi-perf run directory or JSON file holds, read once: its breakdowns and, for
    a run of decode paths, the document holding them; ({}, None) for anything else (a
    trace)."""
    if not is_stored(path):
        return {}, None
    runs, doc, _ = load_run(path)
    return runs, doc if "paths" in doc else None


def load_paths(path: str | Path, label: str = TRACE, phase: str = "auto", **breakdown_options
               ) -> tuple[dict[str, Breakdown], dict | None]:
    """A ``kimi-perf trace`` run's breakdowns per decode path and the document holding them;
    or the one breakdown of a breakdown JSON or a trace (broken down over the steps of
    ``phase``, as ``breakdown_options`` say), named ``label``, and None."""
    check_breakdown_options(breakdown_options)
    path = path_argument(path, "path")
    runs, run_doc = stored_breakdowns(path)
    if run_doc is not None:
        return runs, run_doc
    b = next(iter(runs.values())) if runs else breakdown_of_file(path, phase=phase,
                                                                 **breakdown_options)
    return {label: b}, None


def load_breakdown(path: str | Path, path_name: str | None = None, phase: str = "auto",
                   capture: str | Path | None = None, **breakdown_options) -> Breakdown:
    """One breakdown: a run's decode path ``path_name`` (None: its only one), a breakdown
    JSON's, or a trace's, broken down over the steps of ``phase`` and as ``breakdown_options``
    say (``capture``: its graph captures saved apart, see ``read_trace``)."""
    check_breakdown_options(breakdown_options)
    path = path_argument(path, "path")
    runs, run_doc = stored_breakdowns(path)
    if path_name is not None and run_doc is None:
        raise no_run([path])
    if capture is not None and runs:
        raise TraceError(None, f"{argument('--capture', 'capture')} joins a trace's graph "
                               f"captures, and {path} is a stored breakdown")
    if run_doc is not None:
        return one_path(path, runs, path_name)[1]
    if runs:
        return next(iter(runs.values()))
    return breakdown_of_file(path, capture, phase=phase, **breakdown_options)


def no_run(files: list[Path], parameter: str = "path_name") -> TraceError:
    """The error for a decode path asked (by ``--path``, or the call's ``parameter``) of
    inputs none of which is a kimi-perf run."""
    said = (f"{files[0]} is not one" if len(files) == 1
            else f"neither {files[0]} nor {files[1]} is one" if len(files) == 2
            else "no input is one")
    return TraceError(None, f"{argument('--path', parameter)} picks a decode path of a kimi-perf "
                            f"run: {said}")


_RUN_DATE = re.compile(r"^\d{8}T(?=\d{6}Z)")   # a run directory's date (trace's UTC stamp)


def without_shared_date(names: list[str]) -> list[str]:
    """Run names without the date of their time stamps where all are of one day
    (``20261205T023819Z-tiny-b2``: ``023819Z-tiny-b2``), short enough for a column header
    beside a path's name."""
    dates = {m.group() if (m := _RUN_DATE.match(n)) else None for n in names}
    if len(names) < 2 or len(dates) != 1 or None in dates:   # (one name: nothing to set apart)
        return names
    return [n[len(next(iter(dates))):] for n in names]


def run_name(path: str | Path) -> str:
    """A run's name: its directory's (for a run's breakdown.json, the directory holding it);
    for a run kept as a JSON of its own (a baseline), the file's name without ``.json``."""
    path = Path(path)
    if path.is_dir() or path.name == "breakdown.json":
        return printable(Path(os.path.abspath(path if path.is_dir() else path.parent)).name
                         or str(path))
    return trace_label(path)


TRACE_SUFFIXES = (".pt.trace.json.gz", ".trace.json.gz", ".json.gz", ".pt.trace.json",
                  ".trace.json", ".json", ".sqlite", ".sqlite.gz", ".nsys-rep", ".qdrep",
                  ".kptrace")


def trace_label(path: str | Path) -> str:
    """A trace's file name without its trace suffix (``wan2.1_after.sqlite``:
    ``wan2.1_after``), its control characters written out (``printable``)."""
    name = Path(path).name
    for suffix in TRACE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return printable(name[: -len(suffix)])
    return printable(name)


def trace_labels(paths: list[str | Path]) -> list[str]:
    """``trace_label`` of each path, distinct: where file names repeat (rank0/trace.json,
    rank1/trace.json) the folder holding each comes first (rank0/trace), two or three where
    one does not tell them apart (run_a/rank0/trace, run_b/rank0/trace), and what still
    repeats gets primes (trace, trace')."""
    paths = [Path(p) for p in paths]
    names = [trace_label(p) for p in paths]
    folders = [Path(os.path.abspath(p)).parent.parts for p in paths]
    labels = names
    for depth in (1, 2, 3):
        repeated = {label for label in labels if labels.count(label) > 1}
        if depth > 1:   # a folder more only where the folders differ (not one file twice)
            repeated = {label for label in repeated if len(
                {f for f, other in zip(folders, labels, strict=True) if other == label}) > 1}
        labels = ["/".join([*map(printable, folder[-depth:]), name]) if label in repeated
                  else label
                  for folder, name, label in zip(folders, names, labels, strict=True)]
    return primed(labels)


_RANK = re.compile(r"(?i)(?<![a-z])rank[_-]?(\d+)")


def missing_ranks(labels: list[str]) -> dict[tuple[str, str], list[int]]:
    """Where traces named by rank (``rank0``, ``standard.rank1``, ``trace_rank-3``) skip one
    or more rank numbers (0 to the highest given, per name otherwise alike): per name, the
    words before and after its rank number, the numbers missing; empty where none is missing
    or a name has no rank."""
    groups: dict[tuple[str, str], set[int]] = {}
    for label in labels:
        if (m := _RANK.search(label)) is None:
            return {}
        groups.setdefault((label[:m.start(1)], label[m.end(1):]), set()).add(int(m[1]))
    return {name: gone for name, ranks in groups.items()
            # (a number that big names no rank of a job)
            if (gone := sorted(set(range(max(ranks) + 1)) - ranks)) and max(ranks) < 4096}


def ranks_missing(labels: list[str]) -> str | None:
    """``missing_ranks`` as a line (a rank whose trace went missing would otherwise pass
    unsaid), or None."""
    said = [f"{head}{{{', '.join(map(str, gone[:5])) + (', …' if len(gone) > 5 else '')}}}"
            f"{tail}" for (head, tail), gone in missing_ranks(labels).items()]
    return (f"ranks missing among the traces: {'; '.join(said)} (of 0 to the highest given)"
            if said else None)


def missing_rank_labels(labels: list[str]) -> list[str]:
    """The labels the traces of ``missing_ranks`` would have had (``rank1``)."""
    return [f"{head}{rank}{tail}" for (head, tail), gone in missing_ranks(labels).items()
            for rank in gone]


def _partials_said(path: Path) -> str:
    """What the hidden partials of runs in a folder are (``capture.run_directory``): finished
    runs kept there, their names taken meanwhile (said first: not to be removed), and runs
    being written or killed before they finished."""
    partials = sorted(d for d in path.iterdir() if d.is_dir() and d.name.startswith(".")
                      and d.name.endswith(".partial"))
    finished = [d.name for d in partials if (d / "breakdown.json").is_file()]
    unfinished = [d.name for d in partials if d.name not in finished]

    def named(names: list[str]) -> str:
        return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    one = len(finished) == 1
    return (f"; {named(finished)}: {'a finished run' if one else 'finished runs'} kept there, "
            f"{'its name' if one else 'their names'} taken meanwhile (give "
            f"{'it a name of its' if one else 'them names of their'} own)" if finished
            else "") + (
        f"; {named(unfinished)}: " + ("a run being written, or killed before it finished "
                                      "(then remove it)" if len(unfinished) == 1 else
                                      "runs being written, or killed before they finished "
                                      "(then remove them)") if unfinished else "")


def _json_not_a_trace(path: Path) -> str | None:
    """Why a JSON file (gzipped or not) is no trace, where it is an object whose head names
    no Kineto key: a profiler's directory often holds other JSON (a config, a summary) beside
    its traces, or a short JSON value (a status, a count). A list is Chrome's bare event
    list; anything else under a JSON name is read, by its content (an nsys export named
    .json), or said by the reader (a rank's trace written over with garbage: an error, not a
    rank left out). An empty one is a trace
    cut short where its name says trace (gzipped, or ``*.trace.json``: a rank that crashed
    before writing, which the reader says), else left out as empty (a summary not written),
    unless ``trace_files`` finds it named as a trace beside it is."""
    if not path.name.endswith((".json", ".json.gz")):
        return None
    try:
        with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
            head = f.read(JSON_HEAD)
    except (OSError, EOFError, zlib.error):
        return None   # unreadable: the reader says why
    whole = len(head) < JSON_HEAD
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head and not whole:   # (more blanks than the head holds: the reader looks on)
        return None
    if not head:
        return None if path.name.endswith((".gz", ".trace.json")) else "an empty file"
    if head.startswith(ARROW_MAGIC):
        return "a .kptrace under a JSON name: name it *.kptrace"
    if head.startswith(b"{"):
        return None if b'"traceEvents"' in head or b'"schemaVersion"' in head else (
            "JSON that is not a trace")
    if head.startswith(b"[") or not whole:
        return None
    try:   # (a short file: a status "done", a count)
        json.loads(head)
    except ValueError:   # (not UTF-8 either)
        return None
    return "JSON that is not a trace"


def _report_cmd(args: str) -> str:
    """What draws kimi-perf runs: the command on the command line, the call elsewhere."""
    return f"kimi-perf report{args}" if COMMAND_LINE.get() else "report_inputs"


def _digitless(label: str) -> str:
    """A trace's label without its digits: the shape that a job's ranks share (rank0,
    rank12; worker_3.1733)."""
    return re.sub(r"\d+", "", label)


def _not_a_file(path: Path) -> str:
    """Why a name in a traces directory is no file to read: a dangling symlink, a symlink
    loop, or something else than a file (a FIFO, socket, device or directory)."""
    try:
        path.stat()
    except OSError as exc:
        return stat_problem(path, exc)
    return "not a regular file"


def same_capture(files: list[Path]) -> tuple[Path, str] | None:
    """The first of ``files`` that is a capture another of them holds already, and why (a
    .kptrace and the trace it was saved from, another .kptrace of that trace, an .nsys-rep
    and the export nsys left beside it, not older than it, a copy of another: the same size
    and ends, ``file_identity``, which no two ranks' traces share): as a directory's traces
    are told apart (``trace_files``), for traces given one by one."""
    found = [Path(f) for f in files]
    copies = _saved_beside(found)
    bytes_of: dict[tuple, Path] = {}
    for f in found:
        if (made := file_identity(f)) is not None:
            first = bytes_of.setdefault((made["size"], made["digest"]), f)
            if first != f:
                copies.setdefault(f, f"a copy of {first.name}" if first.name != f.name
                                  else f"a copy of {first}")
    for f in found:
        if f.suffix not in NSYS_REPORTS:
            continue
        for export in (f.with_suffix(".sqlite"), f.with_suffix(".sqlite.gz")):
            if export in found and not is_stale_export(export, f):
                later = export if found.index(export) > found.index(f) else f
                copies.setdefault(later, f"the export of {f.name}" if later == export
                                  else f"the report exported as {export.name}")
    later = [f for f in found if f in copies]
    return (later[0], copies[later[0]]) if later else None


def _saved_beside(found: list[Path]) -> dict[Path, str]:
    """Of a directory's trace files, those a ``.kptrace`` beside them holds already, each with
    why (a capture read twice would count as two ranks): the trace it was saved from (and
    that trace's nsys export, where it was an .nsys-rep), the graph captures joined to it, and
    another ``.kptrace`` of the same source. Told by the identities the ``.kptrace`` keeps
    (``file_identity``: a moved or copied directory still matches; a new export under the old
    name does not)."""
    held: dict[tuple, tuple[Path, str]] = {}   # what each .kptrace holds: how, and which
    out: dict[Path, str] = {}
    for f in (f for f in found if f.suffix == ".kptrace"):
        source, captures = kptrace_sources(f)
        if source is not None and _key(source) in held:
            out[f] = f"the same capture as {held[_key(source)][0].name}"
            continue
        for identity, how in ((source, "saved as"), *((c, "joined into") for c in captures)):
            if identity is not None:
                held.setdefault(_key(identity), (f, how))
    if not held:   # (no .kptrace, or none that says what it holds: nothing to stat)
        return out
    named = {key[:2] for key in held}   # (a file is hashed only where a name and size match)
    for f in found:
        if f.suffix == ".kptrace" or f in out or (f.name, _size(f)) not in named:
            continue
        if (identity := file_identity(f)) is None or _key(identity) not in held:
            continue
        kptrace, how = held[_key(identity)]
        out[f] = (f"{how} {kptrace.name} beside it" if kptrace.parent == f.parent
                  else f"{how} {kptrace}")
        if f.suffix in NSYS_REPORTS:   # its export too, where nsys left it beside it
            for export in (f.with_suffix(".sqlite"), f.with_suffix(".sqlite.gz")):
                if export in found:
                    out[export] = f"the export of {f.name}, saved as {kptrace.name}"
    return out


def _size(f: Path) -> int | None:
    try:
        return f.stat().st_size
    except OSError:
        return None


def _key(identity: dict) -> tuple:
    return identity["name"], identity["size"], identity["digest"]


def trace_files(paths: list[str | Path], keep_runs: bool = False,
                left_out: list[tuple[Path, str]] | None = None) -> list[Path]:
    """``paths`` with each directory replaced by the trace files in it, in natural order
    (rank2 before rank10): a profiler's output directory, one trace per rank or worker, as
    vLLM's and SGLang's profilers write them. Left out (each with why, added to
    ``left_out``): breakdown JSON files, other JSON that is no trace, and a name of a trace's
    that is no regular file (a FIFO, a symlink loop or to nothing), and a trace beside the
    ``.kptrace`` saved from it (the same capture); an .nsys-rep beside its SQLite export is
    too, silently (its export is the same capture), or the export where it is older than the
    report (an earlier capture's). A directory where
    nothing is left says what was left out. A kimi-perf run directory is not a directory of
    traces: an error, or with ``keep_runs`` kept as it is (``kimi-perf report`` draws it)."""
    def natural(p: Path) -> list:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]

    out: list[Path] = []
    for path in path_list(paths, "paths", "traces and folders"):
        if not path.is_dir():
            out.append(path)
            continue
        if (path / "breakdown.json").exists():
            if keep_runs:
                out.append(path)
                continue
            raise TraceError(path, "a kimi-perf run directory, not a directory of traces: "
                                   f"{_report_cmd('')} draws it (or give its traces one by one, "
                                   "a TP run's ranks side by side)")
        if is_kimi_perf_run_json(path / "run.json"):
            raise TraceError(path, "a kimi-perf run directory without its breakdown.json (a "
                                   "capture that did not finish, or a file removed since)")
        entries = [f for f in path.iterdir() if f.name.endswith(TRACE_SUFFIXES)]
        unread = [(f, _not_a_file(f)) for f in entries if not f.is_file()]
        # (a breakdown, or another command's JSON: validate's, floors'; all begin "schema")
        stored = [(f, "kimi-perf's own JSON") for f in entries
                  if f.is_file() and is_kimi_perf_json(f)]
        named = sorted((f for f in entries if f.is_file() and not is_kimi_perf_json(f)),
                       key=natural)
        other = {f: why for f in named if (why := _json_not_a_trace(f)) is not None}
        # an empty JSON named as a JSON trace beside it is (rank1.json by rank0.json.gz),
        # numbered as the ranks are: a rank that crashed before writing, read (the reader
        # says so), not left out as a summary
        shapes = {_digitless(trace_label(f)) for f in named
                  if f not in other and f.name.endswith((".json", ".json.gz"))}
        for f in [f for f, why in other.items() if why == "an empty file"]:
            if re.search(r"\d", f.name) and _digitless(trace_label(f)) in shapes:
                del other[f]
        found = [f for f in named if f not in other]
        passed = sorted([*stored, *other.items(), *unread], key=lambda entry: natural(entry[0]))
        if not found:
            # (traces/runs: its runs are folders of their own, given each, DIR/*/; so are a
            # job's ranks, a folder each)
            folders = [d for d in path.iterdir() if d.is_dir() and not d.name.startswith(".")]
            runs = sum((d / "breakdown.json").is_file() for d in folders)
            ranks = [d.name for d in sorted(folders, key=natural)
                     if not (d / "breakdown.json").is_file()
                     and any(f.name.endswith(TRACE_SUFFIXES) for f in d.iterdir())]
            draws = _report_cmd(" " + str(path / "*") + "/") + " draws"
            raise TraceError(path, "holds no trace files (" + ", ".join(
                f"*{s}" for s in TRACE_SUFFIXES[2:]) + ")" + (
                "; left out: " + ", ".join(f"{f.name} ({why})" for f, why in passed)
                if passed else "") + (
                f"; it holds {runs} kimi-perf run director{'y' if runs == 1 else 'ies'}: "
                + (f"give {'it' if runs == 1 else 'them'} ({path / '*'}/)" if keep_runs
                   else f"{draws} {'it' if runs == 1 else 'them'}") if runs else "") + (
                f"; its folders {', '.join(ranks[:3])}{', ...' if len(ranks) > 3 else ''} "
                "hold traces: give each" if ranks and not runs else "") + (
                _partials_said(path)))
        copies = _saved_beside(found)
        # a report nsys has exported (``nsys stats`` leaves X.sqlite beside X.nsys-rep) is
        # one capture: its export is read, and the report is not read again; an export
        # older than its report is an earlier capture's (``nsys profile -f true`` again):
        # the report is read (exported again), as ``nsys stats`` does
        exports = {f.name.removesuffix(".gz").removesuffix(".sqlite"): f for f in found
                   if f.name.endswith((".sqlite", ".sqlite.gz"))}
        reports = {f: exports[f.stem] for f in found
                   if f.suffix in NSYS_REPORTS and f.stem in exports}
        stale = {export: f"older than {report.name}, an earlier capture's export: the "
                         "report is read"
                 for report, export in reports.items()
                 if report not in copies and export not in copies
                 and is_stale_export(export, report)}
        exported = {report for report, export in reports.items() if export not in stale}
        if left_out is not None:
            left_out += passed + sorted([*copies.items(), *stale.items()],
                                        key=lambda entry: natural(entry[0]))
        out += [f for f in found if f not in exported and f not in stale and f not in copies]
    return out
