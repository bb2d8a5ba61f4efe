"""Regression gate: a run against a stored baseline, per decode path and layer type.

Kernels per layer are deterministic: a layer type's median or largest count growing fails
the gate (``kernels`` checks both: one layer with one more kernel is caught; where the run
profiled more steps, a larger largest is ``changed``, as work every few steps may fall in
its window alone). Times are not: a time regresses when its median (of every layer of the
type in every profiled step) rises by more than ``rel_tol`` and ``abs_tol_us`` *and* a
one-sided Mann-Whitney U test gives p < ``alpha``; a rise that noise explains passes. The
test's samples are steps: of a layer type, each step's mean layer over all its GPUs (the
layers of one step share its clocks and host, and its GPUs its collectives' waits, so they
are not independent samples: pooled, noise common to a step would pass for a regression);
of ``step``, every step (its GPUs' mean), whose kernels also count those outside every
layer. Each kernel class's µs in a type's layers (``class_us``) is checked with
``kernel_us``, as it is, the classes sharing ``alpha``: a small kernel twice as slow, or one
class's rise hidden by another's fall, leaves the layer's µs within tolerance; so is the one
layer (by its index in a step) whose median rose most (``layer_kernel_us``), tested at
``alpha`` over the layers compared. A job whose layers ran on several devices (a TP job's
one trace) has them pooled in those figures, where one slow rank of eight hides: each device
is checked on its own too (``kernel_us_device``, ``span_us_device``, the devices sharing
``alpha``; ``_device_checks``). Whole steps' span is also checked by its mean
(``span_us_mean``, with ``span_us``), which decode tokens/s follow: medians are robust to a
slow step, and so blind to a slowdown of fewer than half the steps (every fourth one stalls);
the mean fails where it rose beyond the tolerances and a one-sided permutation test of the
difference of means gives p < ``alpha``, and, outlier-prone, is not checked without steps
enough for that test. With too few steps for the test to reach ``alpha`` it
takes the layers themselves, whose p-value is then optimistic; with too few of those too
(fewer than ``min_samples`` a side, or 1 / C(n+m, n) >= alpha), the thresholds decide
alone. Where the baseline keeps the spread of several runs of its code (``run_spread``:
``spread_of_runs``), a time past all that is tested against that spread too (noise a run's
steps share: its clocks, its host), and passes within it (``_within_spread``). A layer type
or path the baseline has and the run lacks fails too (the analysis lost it); one the run adds
is reported. Layers a step (in all, and of each type) must match: a
layer lost or added is other work, whose figures would pass for a change of speed; a count
that differs fails, but not where it says nothing of the work: the pattern typed as many
layers a step otherwise, the steps are profiler windows, or the models differ in depth.

Layer types lettered by their kernel sequence (found by the repeating kernel pattern, or of
ranges that name no type: letters in order of first appearance) are paired by their kernel
sequence (its digest), whatever their letters; the types
left over are paired by their mix of kernels per class (``kimi_perf.comparison.pair_layer_types``,
as ``compare`` pairs them). A sequence is a cycle (its digest is of its least rotation): the
same kernels cut at another kernel are the same layer, checked as usual (a block's span and
kernel µs do not depend on where it is cut). A pair whose sequences differ is noted
(``pattern``: ``changed``).
Where the kernels such pairs' typical layers lost are exactly the ones the others gained, the
pattern has started the layers elsewhere (a kernel moved from one letter to the next), so their
checks are shown as ``changed`` and do not fail; the whole steps, checked as ever, catch a
kernel added or a step slowed. So is a type the run lacks while its steps hold as many layers as
the baseline's, or that held no more layers than steps. Any other change of kernels (another GEMM
kernel picked, one unfused into two) is checked as usual. Whole steps that are each device's
work on both sides (no step range, graph launch or forward pass found) are the profiler's
windows: holding different numbers of layers, they ran different work, and their checks are
``changed``.

A layer type's regression or improvement says which kernels are behind it (``detail``), from
the typical layers of both (the kernel sequence most layers of the type ran, with median µs
per kernel): for kernel counts the kernels added and removed, for times the (at most three)
launches whose µs moved most that way, new or lost ones by all their µs, and the typical
layer's total change; for a span also the change of the median idle time between its kernels.

A run and a baseline are what ``kimi_perf.runs`` loads: a ``kimi-perf trace`` run (its
directory or its ``breakdown.json``), a breakdown JSON or any trace. Baselines are kept under
``traces/baselines/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import numbers
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kimi_perf.comparison import (
    aligned_typical,
    gpus_differ,
    gpus_text,
    layer_devices,
    layer_sources,
    layers_per_step,
    pair_label,
    pair_layer_types,
    patterns_differ,
    rotation,
    unequal_windows,
)
from kimi_perf.decode.fallbacks import fell_back_text, paths_that_fell_back
from kimi_perf.errors import TraceError, argument, path_argument, path_list
from kimi_perf.layer_breakdown import (
    Breakdown,
    class_column,
    layer_classes,
    layer_column,
    layer_of_type,
    note_lines,
    pattern_found,
)
from kimi_perf.layers import decode_requests
from kimi_perf.runs import (
    SPREAD_FEWEST_RUNS,
    SPREAD_METRICS,
    TRACE,
    captured_path,
    captured_run,
    check_breakdown_options,
    check_storable,
    is_figure,
    is_stored,
    load_run,
    no_run,
    one_path,
    run_differences,
    run_spread_problem,
    store_baseline,
    stored_tolerances_problem,
)
from kimi_perf.stats import can_reach, u_test
from kimi_perf.text import also_as

METRICS = ("kernels", "kernel_us", "span_us")
STEP = "step"  # the pseudo layer type of whole decode steps
# the checks of each device of a job of several (kernel_us's and span_us's, device by device)
DEVICE_METRICS = ("kernel_us_device", "span_us_device")
# the checks of times (class_us and layer_kernel_us: kernel_us's, by class and by layer)
TIMES = ("kernel_us", "span_us", "class_us", "layer_kernel_us", "span_us_mean", *DEVICE_METRICS)
# the permutation test's resamples where the splits of the steps are more (seeded: a gate
# gives one answer for one input), at least 20 / alpha (its smallest p is 1 / (resamples + 1))
# up to a most; and how many values it draws at once (memory: 2,000 steps a side drew 1.9 GB)
MEAN_TEST_RESAMPLES = 20_000
MEAN_TEST_MOST_RESAMPLES = 2_000_000
MEAN_TEST_BATCH_VALUES = 4_000_000


@dataclass(frozen=True)
class Tolerances:
    """When a time regresses: its median rises by more than ``rel_tol`` and ``abs_tol_us``
    and the Mann-Whitney U test gives p < ``alpha`` (with ``min_samples`` a side; see the
    module doc); whole steps' mean span likewise, by a permutation test. ``metrics``:
    which of ``METRICS`` to check (a tuple, or a comma-separated string); None, the default,
    checks all of them (``checked``), except on a path whose two sides are CPU runs: its
    ops alone, as its times are CPU time, which moves by more than any tolerance between two
    runs of the same code (``cpu_times``: whether they are checked; naming the metrics
    checks a CPU run's times too)."""

    rel_tol: float = 0.05
    alpha: float = 0.01
    min_samples: int = 5
    metrics: tuple[str, ...] | None = None
    # a rise of a time by this much or less passes whatever its ratio (a figure near 0: a
    # kernel under a µs, a trace in whole µs)
    abs_tol_us: float = 1.0

    @property
    def checked(self) -> tuple[str, ...]:
        return METRICS if self.metrics is None else self.metrics

    @property
    def cpu_times(self) -> bool:
        return self.metrics is not None

    def __post_init__(self) -> None:
        metrics = self.metrics
        if isinstance(metrics, str):
            named = tuple(m.strip() for m in metrics.split(","))
            if any(named) and not all(named):   # (a stray comma: a name left out?)
                raise ValueError(f"metrics: names between commas, none empty (not {metrics!r})")
            metrics = tuple(filter(None, named))
        if metrics is not None:
            object.__setattr__(self, "metrics", tuple(dict.fromkeys(metrics)))  # each once
        unknown = [str(m) for m in self.checked if m not in METRICS]
        if unknown or not self.checked:
            raise ValueError(f"metrics: choose from {', '.join(METRICS)}, one or more (not "
                             + (", ".join(unknown) + ")" if unknown else "an empty list)"))
        for name in ("rel_tol", "abs_tol_us", "alpha"):
            if not isinstance(value := getattr(self, name), numbers.Real) \
                    or isinstance(value, bool):
                raise TypeError(f"{name}: a number, not {type(value).__name__} {value!r}")
            if type(value) not in (int, float):   # (numpy's: JSON takes Python's)
                object.__setattr__(self, name, float(value))
        if not (math.isfinite(self.rel_tol) and self.rel_tol >= 0):
            raise ValueError(f"rel_tol: a finite number ≥ 0 (not {self.rel_tol})")
        if not (math.isfinite(self.abs_tol_us) and self.abs_tol_us >= 0):
            raise ValueError(f"abs_tol_us: a finite number ≥ 0 (not {self.abs_tol_us})")
        if not 0 < self.alpha < 1:   # (0 or 1: a test that always, or never, passes)
            raise ValueError(f"alpha: a probability in (0, 1) (not {self.alpha})")
        if type(self.min_samples) is not int or self.min_samples < 2:   # (a test of one: none)
            raise ValueError(f"min_samples: an integer ≥ 2 (not {self.min_samples!r})")


# The statuses of a check that fail the gate.
FAILING = ("regression", "missing", "differs", "fell back", "not finite", "captured differently",
           "broken down differently")


@dataclass
class Check:
    path: str
    layer_type: str
    metric: str
    baseline: float | None
    current: float | None
    change: float | None      # current / baseline - 1
    p_value: float | None     # one-sided, in the direction of the change: Mann-Whitney U
                              # (span_us_mean: a permutation test of the means)
    status: str               # ok, regression, improvement, noise, missing, new, changed,
                              # differs (layers a step), fell back (every step of the run's
                              # path: the baseline's not), not finite (the run's logits),
                              # captured differently, broken down differently (strict)
    detail: str | None = None  # the kernels behind a regression or improvement
    run_layer_type: str | None = None  # the run's name of the type, where it differs
    tested_over: str | None = None   # the test's samples: "steps", or "layers" (too few steps)
    kernel_class: str | None = None  # metric class_us: the class whose kernel µs it checks
    layer_index: int | None = None   # metric layer_kernel_us: the layer (its index in a step)
    alpha: float | None = None       # the test's alpha, where it is not --alpha (divided among
                                     # the classes, the layers, or the devices, of a type)
    device: int | None = None        # a device's check: the run's device its figures are of
    baseline_device: int | None = None   # and the baseline's paired with it (None: a device
                                         # of one side alone, its layers lost or new)
    others: list[Check] = field(default_factory=list)   # a device's check shown for its type's:
                                                        # the other devices' (``_shown_devices``)

    @property
    def fails(self) -> bool:
        return self.status in FAILING

    def to_json(self) -> dict:
        """The check as JSON, with whether it ``fails``, without its ``others``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "others"} | {"fails": self.fails}


@dataclass(repr=False)
class GateResult:
    """Every check (``checks``), those that fail (``failures``) and whether none does
    (``ok``). ``run_differences``: how the captures behind the two sides differ (TP 1 vs 2,
    or steps of other phases: their figures differ for that alone; None from ``gate`` alone,
    which has no run information to compare); ``breakdown_differences``: how their steps and
    layers were found otherwise (another --steps regex that found other ranges, say; also set
    by ``gate_files``); ``fell_back``: the warnings of paths of either side whose every step
    fell back to the standard path's ops (a run's path that did where the baseline's did not
    fails a check too), and their names (``paths_fell_back``); ``cpu_time_metrics``: the
    checked times that are CPU time (a run on a CPU: noisy and no speed figure), and
    ``cpu_times_left_out``: the times of CPU runs left unchecked (``Tolerances.cpu_times``)."""

    checks: list[Check]
    tolerances: Tolerances
    run_differences: list[str] | None = None   # set by gate_files, which has the run docs
    breakdown_differences: list[str] = field(default_factory=list)   # and this
    fell_back: list[str] = field(default_factory=list)   # and this
    paths_fell_back: set[str] = field(default_factory=set)   # (either side's) and this
    cpu_time_metrics: list[str] = field(default_factory=list)
    cpu_times_left_out: list[str] = field(default_factory=list)
    op_paths: list[str] = field(default_factory=list)   # paths of CPU runs: ops, not kernels
    # the settings the baseline kept (gate --update stored them), where they were used
    stored_tolerances: dict = field(default_factory=dict)
    spread_runs: int = 0   # the runs whose spread the baseline keeps (gate --update
                           # --spread-from), where it has one
    # the types (path and type) whose times have no check of each device: too few steps a
    # device for the test at alpha over their devices, and how many devices
    devices_untimed: dict[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:   # not every check: a table or to_json shows them
        failing = Counter(c.status for c in self.failures)
        return (f"GateResult({'ok' if self.ok else 'FAIL'}, {len(self.checks)} checks"
                + "".join(f", {n} {status}" + ("s" if n > 1 and status == "regression" else "")
                          for status, n in failing.items()) + ")")

    def metric_name(self, check: Check) -> str:
        """A check's metric as tables say it: a CPU run's kernels are the ops it annotates;
        a class's kernel µs names the class (``kernel_us (attention)``)."""
        if check.kernel_class is not None:
            return f"kernel_us ({check.kernel_class})"
        if check.layer_index is not None:
            return f"kernel_us (layer {check.layer_index})"
        if check.metric == "span_us_mean":
            return "span_us (mean)"
        if check.metric in DEVICE_METRICS:
            device = check.device if check.device is not None else check.baseline_device
            return f"{check.metric.removesuffix('_device')} (device {device})"
        return (check.metric.replace("kernels", "ops") if check.path in self.op_paths
                else check.metric)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.fails]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        """The verdict as JSON: ``ok``, how many checks ``failed`` and every check, each with
        whether it ``fails`` (the statuses that do are ``FAILING``)."""
        doc = {"schema": 1, "ok": self.ok, "failed": len(self.failures),
               "tolerances": asdict(self.tolerances),
               "checks": [c.to_json() | {"others": [o.to_json() for o in c.others]}
                          for c in self.checks],
               "devices_untimed": self.devices_untimed}
        if self.run_differences is not None:
            doc["run_differences"] = self.run_differences
        if self.stored_tolerances:
            doc["stored_tolerances"] = self.stored_tolerances
        if self.spread_runs:
            doc["spread_runs"] = self.spread_runs
        return doc | {"breakdown_differences": self.breakdown_differences,
                      "fell_back": self.fell_back, "cpu_time_metrics": self.cpu_time_metrics,
                      "cpu_times_left_out": self.cpu_times_left_out}


@dataclass(repr=False)
class GatedRun:
    """What ``gate_files`` read and found: the result, the breakdowns per decode path of both
    sides, the document a baseline of the run holds, the file the baseline came from (None
    for a trace, which ``store_baseline`` cannot replace), and the baseline and run as
    given. ``render.gate_text`` and ``render.gate_document`` say it as the command does."""

    result: GateResult
    baseline: dict[str, Breakdown]
    current: dict[str, Breakdown]
    run_doc: dict
    baseline_file: Path | None
    files: tuple[Path, Path]

    def notes(self) -> dict[str, list[str]]:
        """What each side's breakdowns say of themselves (mixed steps, replayed graphs, ...),
        by side: ``baseline`` and ``run``."""
        return {side: note_lines({f"{side} {p}": b for p, b in runs.items()})
                for side, runs in (("baseline", self.baseline), ("run", self.current))}

    def __repr__(self) -> str:   # not the breakdowns and run document it holds
        return (f"GatedRun({self.result!r}, baseline {list(self.baseline)}"
                + (f" from {self.baseline_file}" if self.baseline_file else "")
                + f", current {list(self.current)})")


def gate_files(baseline: str | Path, run: str | Path,
               tolerances: Tolerances | Mapping[str, Any] | None = None,
               path_name: str | None = None, phase: str = "auto",
               loaded: dict[Path, tuple] | None = None, strict: bool = False,
               **breakdown_options) -> GatedRun:
    """``gate`` over what two files hold (each a run directory, its ``breakdown.json``, a
    breakdown JSON or a trace, traces broken down over the steps of ``phase``, and as
    ``breakdown_options`` say: ``layers``, ``step_regex``, ``rules``); ``path_name``: check
    that decode path alone (a trace on either side stands for it), as ``compare_files`` and
    ``load_breakdown`` take it. A run's trace stands for the path it captured; another trace
    against a run of several paths needs ``path_name``: which one would it stand for?
    ``loaded``: what ``load_run`` gave for either file already (a trace is not read twice).
    ``strict``: captures made differently (``run_differences``) or broken down differently
    (``breakdown_differences``) fail too, as a nightly job against the wrong baseline should.
    ``tolerances``: a ``Tolerances``, or a dict of its fields (``{"rel_tol": 0.1}``); None:
    those the baseline keeps (``update_baseline`` with tolerances stores them), else the
    defaults."""
    check_breakdown_options(breakdown_options)
    baseline, run = path_argument(baseline, "baseline"), path_argument(run, "run")
    given = dict(tolerances) if isinstance(tolerances, Mapping) else None
    tolerances = _tolerances_of(baseline, tolerances)
    loaded = loaded or {}
    current, run_doc, run_file = loaded.get(run) or load_run(run, phase, **breakdown_options)
    base, base_doc, base_file = (loaded.get(baseline)
                                 or load_run(baseline, phase, **breakdown_options))
    # the settings the baseline keeps (the verdict says them, and which were given over
    # them); none where a Tolerances was given: it is used as it is
    stored = ({} if tolerances is not None and given is None else
              dict(base_doc.get("gate_tolerances") or {}))
    base_keys = set(base)
    if tolerances is None:
        tolerances = kept_tolerances(baseline, base_doc)
    paths_differ = []
    held = [captured_path(file) if set(runs) == {TRACE} else None
            for file, runs in ((baseline, base), (run, current))]
    if path_name is None:
        # a run's trace (RUN/specialized.kptrace: its name and run.json say which path it
        # captured) against a run stands for that path, as --path would name it; against a
        # run of one other path, for that one, and the paths captured differ
        for captured, other in ((held[0], current), (held[1], base)):
            if captured is not None and set(other) != {TRACE}:
                path_name = (captured if captured in other
                        else next(iter(other)) if len(other) == 1 else None)
        if None not in held and held[0] != held[1]:   # (two runs' traces of other paths)
            paths_differ = [f"decode path {held[0]} vs {held[1]}"]
    whole = {baseline: base, run: current}   # (before --path takes one path of each)
    if path_name is not None:
        if set(base) == set(current) == {TRACE}:
            raise no_run([baseline, run])
        # a run's trace of another path (specialized.kptrace --path standard: a typo in a
        # nightly job) is a capture of other work
        named = [captured or (path_name if set(runs) != {TRACE} else None)
                 for captured, runs in zip(held, (base, current), strict=True)]
        if None not in named and named[0] != named[1]:
            paths_differ = [f"decode path {named[0]} vs {named[1]}"]
        base = ({path_name: base[TRACE]} if set(base) == {TRACE}
                else dict([one_path(baseline, base, path_name, "path_name")]))
        # a path of the baseline's that the run lost fails as missing, as it does where no
        # --path is given (a name that only a plain trace stood for is a typo: said)
        current = ({path_name: current[TRACE]} if set(current) == {TRACE}
                   else {} if path_name not in current and (path_name in whole[baseline]
                                                            or held[0] == path_name)
                   else dict([one_path(run, current, path_name, "path_name")]))
    for file, runs, what in ((baseline, base, "nothing to check a run against"),
                             (run, current, "nothing to check against the baseline")):
        if not has_work(whole[file]):   # (a run that lost every layer would fail as "missing")
            raise TraceError(file, f"holds no steps and no layers: {what} (a capture "
                                   "without GPU work?)")
        if empty := [p for p, b in runs.items() if not (b.steps or b.layers)]:
            # (its capture failed, not its layers: as for a side with nothing at all)
            raise TraceError(file, f"its path {empty[0]} holds no steps and no layers: "
                                   f"{what} there (a capture without GPU work?)")
    for file, runs, other in ((baseline, base, current), (run, current, base)):
        if set(other) == {TRACE} and len(runs) > 1:
            raise TraceError(file, f"holds the paths {', '.join(runs)}: choose the one the "
                                   f"other side stands for with {argument('--path', 'path_name')}")
    # (a baseline stored from a trace keys its figures so, whatever --path named)
    result, devices = _device_by_device(
        base, current, tolerances,
        base_doc.get("run_spread") if isinstance(base_doc, dict) else None,
        TRACE if base_keys == {TRACE} else None)
    result.stored_tolerances = stored
    # how each side was captured: a trace in a run directory as its run.json says (compared
    # alone: the documents, what --update stores, stay load_run's)
    base_info, run_info = (_trace_info(file, runs) or doc if json_file is None else doc
                           for file, json_file, doc, runs in (
                               (baseline, base_file, base_doc, base),
                               (run, run_file, run_doc, current)))
    # two captures whose run information records other GPUs say so (run_differences); the
    # kernels' GPUs are compared otherwise (the same names, other SM counts: a MIG slice)
    recorded = [env.get("gpus") if isinstance(env := (d.get("run") or {}).get("environment")
                                                      if isinstance(d, dict) else None, dict)
                else None for d in (base_info, run_info)]
    gpus_said = None not in recorded and recorded[0] != recorded[1]
    # (a CPU run's threads move its times alone: where only its ops are gated, they pass)
    result.run_differences = (paths_differ
                              + run_differences(base_info, run_info,
                                                cpu_times=bool(result.cpu_time_metrics),
                                                # (a trace is one path, whatever its run's)
                                                paths=path_name is None and None not in (
                                                    base_file, run_file))
                              + phase_differences(base, current)
                              + request_differences(base, current)
                              + unit_differences(base, current)
                              + ([] if gpus_said else gpu_differences(base, current))
                              + settings_unknown(base_info, run_info,
                                                 (base_file is None, run_file is None)))
    depths = [(d.get("run") or {}).get("n_layers") if isinstance(d, dict) else None
              for d in (base_info, run_info)]   # (load_run checked that "run" is an object)
    if None not in depths and depths[0] != depths[1]:
        # a step of a model of another depth is other work, of other layers; its layers still
        # compare
        for check in result.checks:
            if (check.layer_type == STEP or check.metric == "layers") and check.status not in (
                    "new", "missing") and not (check.layer_type != STEP
                                               and check.metric == "layers"
                                               and check.baseline == check.current):
                # (a path the run lacks is no other work; a type's count alike is alike)
                check.status = "changed"
                check.detail = (f"models of {depths[0]} and {depths[1]} layers: a step is "
                                "other work")
            elif (check.status in ("new", "missing") and check.layer_type != STEP
                  and check.path in base and check.path in current
                  and not _model_holds(run_info if check.status == "missing" else base_info,
                                       check.layer_type)):
                # a layer type one depth has and the other not (2 layers: no KDA layer)
                lacking = "run" if check.status == "missing" else "baseline"
                check.detail = (f"models of {depths[0]} and {depths[1]} layers: the "
                                f"{lacking}'s has no {check.layer_type} layer")
                check.status = "changed"
    _check_fallbacks(result, base_info, run_info, base, current)   # (whatever the depths)
    result.checks = _shown_devices(result.checks, devices)   # (each status final)
    result.breakdown_differences = breakdown_differences(base, current)
    if strict and result.run_differences:
        result.checks.append(Check("run", "capture", "capture", None, None, None, None,
                                   "captured differently", "; ".join(result.run_differences)))
    if strict and result.breakdown_differences:
        result.checks.append(Check("run", "breakdown", "breakdown", None, None, None, None,
                                   "broken down differently",
                                   "; ".join(result.breakdown_differences)))
    return GatedRun(result, base, current, run_doc, base_file, (baseline, run))


def _trace_info(file: Path, runs: dict[str, Breakdown]) -> dict | None:
    """The run information of a trace in a run directory (``captured_run``); where the trace
    is keyed as a trace (no --path), its path's metrics keyed so too, so that what its run
    says of that path (every step fell back, logits not finite) is matched to it."""
    info = captured_run(file)
    if info is None or set(runs) != {TRACE}:
        return info
    paths = info["run"].get("paths")
    held = captured_path(file)
    return {"run": {**info["run"], "paths": {TRACE: paths[held]} if isinstance(paths, dict)
                                                                   and held in paths else {}}}


def kept_tolerances(baseline: str | Path, doc: object) -> Tolerances:
    """The tolerances a baseline's document keeps (``gate_tolerances``, checked by
    ``load_run``), over the defaults; a setting out of range (a metric's name) is the
    baseline's problem."""
    kept = (doc.get("gate_tolerances") if isinstance(doc, dict) else None) or {}
    try:
        return Tolerances(**kept)
    except ValueError as exc:
        raise TraceError(baseline, f"gate_tolerances.{exc}") from None


def baseline_tolerances(baseline: str | Path) -> dict:
    """The settings a baseline file keeps (``gate_tolerances``), read leniently: {} where it
    keeps none, is no stored baseline or cannot be read (``gate_files`` says why)."""
    kept = _stored_doc(baseline).get("gate_tolerances")
    return kept if isinstance(kept, dict) and not stored_tolerances_problem(kept) else {}


def baseline_spread_runs(baseline: str | Path) -> int:
    """How many runs' spread a baseline file keeps (``run_spread``), read leniently: 0 where
    it keeps none, is no stored baseline or cannot be read."""
    spread = _stored_doc(baseline).get("run_spread")
    return len(spread["runs"]) if spread and not run_spread_problem(spread) else 0


def _stored_doc(baseline: str | Path) -> dict:
    """A stored baseline's document, or {} (none there, not one, unreadable)."""
    path = Path(baseline)
    path = path / "breakdown.json" if path.is_dir() else path
    if not is_stored(path):
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def tolerance_settings(tolerances: Tolerances) -> dict:
    """What a baseline keeps of the tolerances (``gate_tolerances``): the gate's options
    (``min_samples``, the library's alone, is not kept)."""
    return {"rel_tol": float(tolerances.rel_tol), "abs_tol_us": float(tolerances.abs_tol_us),
            "alpha": float(tolerances.alpha),
            **({"metrics": ",".join(tolerances.metrics)} if tolerances.metrics else {})}


def tolerances_over(baseline: str | Path, settings: Mapping[str, Any]) -> Tolerances:
    """``settings`` (``rel_tol``, ``abs_tol_us``, ``alpha``, ``metrics``, ``min_samples``)
    over those the baseline keeps (``gate --update`` stored them), over the defaults: what
    ``kimi-perf gate``'s options make of them (``--rel-tol 0.1`` keeps the baseline's
    metrics). A setting out of range is a ValueError naming it."""
    if unknown := sorted(set(settings) - {f.name for f in dataclasses.fields(Tolerances)}):
        raise TypeError(f"tolerances: no setting {', '.join(map(repr, unknown))} (one of "
                        f"{', '.join(f.name for f in dataclasses.fields(Tolerances))})")
    kept = baseline_tolerances(baseline)   # (no settings given: the baseline's, as None)
    if kept:   # (a setting the gate cannot use is the baseline's, named)
        kept_tolerances(baseline, {"gate_tolerances": kept})
    Tolerances(**settings)   # (the settings' own problem said as theirs)
    return Tolerances(**{**kept, **settings})


def _tolerances_of(baseline: Path, tolerances: object) -> Tolerances | None:
    """``gate_files``' and ``update_baseline``'s ``tolerances``: a Tolerances as given (every
    setting), a dict of settings over the baseline's (``tolerances_over``), or None."""
    if isinstance(tolerances, Mapping):
        return tolerances_over(baseline, tolerances)
    if tolerances is not None and not isinstance(tolerances, Tolerances):
        # (a rel_tol given in its place, say)
        raise TypeError(f"tolerances: a Tolerances or a dict of settings, not "
                        f"{type(tolerances).__name__} ({tolerances!r}): Tolerances(rel_tol=..., "
                        "alpha=..., metrics=...), or {'rel_tol': 0.1} over the baseline's")
    return tolerances


def _model_holds(doc: dict, layer_type: str) -> bool:
    """Whether the model a capture ran (its run information's preset and depth) holds layers
    of ``layer_type``; True where that cannot be told (a lost layer type is then missing)."""
    from kimi_perf.decode.config import preset

    run = doc.get("run") or {}
    try:
        return layer_type in preset(run["preset"], n_layers=run["n_layers"]).layer_types()
    except (KeyError, TypeError, ValueError):
        return True


def update_baseline(baseline: str | Path, run: str | Path,
                    tolerances: Tolerances | Mapping[str, Any] | None = None, phase: str = "auto",
                    strict: bool = False, spread_from: Sequence[str | Path] = (),
                    **breakdown_options) -> tuple[GatedRun | None, str]:
    """``gate --update``: the run gated against the baseline JSON ``baseline`` (as
    ``gate_files`` does), then stored there whatever the verdict, and the gate's result with
    ``"updated"`` (with ``strict``, a run captured or broken down differently is not stored:
    ``"not updated"``); or, where there is nothing to gate against (no file yet, or a stored
    baseline without steps or layers), stored unchecked: (None, ``"created"`` or
    ``"replaced"``). A trace, a file that is not a kimi-perf baseline, a run with no work, or
    sides the gate could only pair with a path are refused before anything is written.

    ``tolerances`` given are stored with the run (``gate_tolerances``): the gates against it
    use them unless given others; None: those the baseline kept, kept again (none: the
    defaults, nothing stored). ``spread_from``: other runs of the run's code (four or more),
    whose spread with it is stored (``run_spread``: ``spread_of_runs``); without them, a
    spread the baseline kept goes (it was of other runs' code)."""
    baseline, run = path_argument(baseline, "baseline"), path_argument(run, "run")
    tolerances = _tolerances_of(baseline, tolerances)
    if baseline.exists() and not is_stored(baseline):
        update = argument("--update", "update_baseline")
        raise TraceError(baseline, f"{update} replaces a baseline JSON, not a directory"
                         if baseline.is_dir() else
                         f"{update} replaces a baseline JSON, not a trace"
                         if baseline.suffix != ".json" else
                         f"not a kimi-perf baseline (a breakdown JSON) for {update} to "
                         "replace: remove it first to store the run there")
    check_storable(baseline)
    loaded: dict[Path, tuple] = {}
    runs, run_doc, _ = loaded[run] = load_run(run, phase, **breakdown_options)
    if not has_work(runs):
        raise TraceError(run, "holds no steps and no layers: nothing to store as a baseline")
    for other in path_list(spread_from or (), "spread_from", "runs"):
        # (its file, not its bytes: a run it was stored from may well be one of these runs)
        if os.path.realpath(other) == os.path.realpath(baseline):
            raise TraceError(other, "is the baseline: a run of the code it replaces, not of "
                                    f"{run}'s")
    spread = (spread_of_runs(run, spread_from, tolerances, phase, loaded, **breakdown_options)
              if spread_from else None)   # (before anything is written)
    if not baseline.exists():
        store_baseline(baseline, _keeping(run_doc, tolerances, None, spread))
        return None, "created"
    try:
        base_runs, base_doc, base_file = loaded[baseline] = load_run(baseline, phase,
                                                                     **breakdown_options)
        if tolerances is None:   # (checked before anything is written)
            kept_tolerances(baseline, base_doc)
    except TraceError as exc:   # (a baseline edited since, say)
        raise TraceError(baseline, f"{exc.problem}: {argument('--update', 'update_baseline')} "
                                   "gates against it first; remove it to store the run "
                                   "there") from None
    # a stored baseline with nothing to check (which gate refuses) is replaced unchecked
    if base_file is not None and not has_work(base_runs):
        store_baseline(base_file, _keeping(run_doc, tolerances, base_doc, spread))
        return None, "replaced"
    if TRACE in (*base_runs, *runs) and len(base_runs) + len(runs) > 2:
        # (gate would ask for a path, which --update does not take: it stores the whole run)
        raise TraceError(baseline, f"holds {_holds(base_runs)}, and {run} holds "
                                   f"{_holds(runs)}: the gate that "
                                   f"{argument('--update', 'update_baseline')} makes first "
                                   "cannot pair them; " + (
                                       "remove the baseline to store the run there"
                                       if set(base_runs) == {TRACE} else
                                       "give the run's directory to replace every path, "
                                       "or keep the trace's in a new file"))
    gated = gate_files(baseline, run, tolerances, None, phase, loaded, strict,
                       **breakdown_options)
    if strict and (gated.result.run_differences or gated.result.breakdown_differences):
        # (--strict: a run of another capture is no baseline of this job; kept as it was)
        return gated, "not updated"
    store_baseline(gated.baseline_file, _keeping(gated.run_doc, tolerances, base_doc, spread))
    return gated, "updated"


def _keeping(run_doc: dict, tolerances: Tolerances | None, base_doc: object,
             spread: dict | None) -> dict:
    """The run's document to store, with the tolerances given (or the old baseline's) and
    the spread of its runs, if any."""
    kept = (tolerance_settings(tolerances) if tolerances is not None
            else base_doc.get("gate_tolerances") if isinstance(base_doc, dict) else None)
    # (a run that was itself a baseline: its settings and spread are not this baseline's)
    doc = {key: value for key, value in run_doc.items()
           if key not in ("gate_tolerances", "run_spread")}
    return doc | ({"gate_tolerances": kept} if kept else {}) | (
        {"run_spread": spread} if spread else {})


def spread_of_runs(run: str | Path, others: Sequence[str | Path],
                   tolerances: Tolerances | None = None, phase: str = "auto",
                   loaded: dict[Path, tuple] | None = None, **breakdown_options) -> dict:
    """What a baseline keeps of how much its times move run to run (``run_spread``): each
    time figure the gate checks (``SPREAD_METRICS``: a layer type's and a step's medians,
    each kernel class's and each layer's kernel µs, the steps' mean span; and each device's
    medians of a job of several, ``SPREAD_DEVICE_METRICS``) as ``run`` and each
    of ``others`` (runs of the same code, captured alike: ``SPREAD_FEWEST_RUNS`` in all at
    least) have it, as gating each against ``run`` finds and pairs it. A gate within one
    run's steps cannot see such noise (a GPU's clocks, the host, where the memory landed:
    each run's steps share it); ``gate_files`` then tests a time against the spread too
    (``_within_spread``). A run of other work (a kernel more, a layer type lost, every step
    fallen back, captured or broken down otherwise) is refused, named, as is one given twice
    (a directory and its breakdown.json, a copy). Figures not every run has are left out."""
    run, others = Path(run), path_list(others, "others", "runs")
    if len(others) + 1 < SPREAD_FEWEST_RUNS:
        raise TraceError(None, f"the spread of runs takes {SPREAD_FEWEST_RUNS - 1} runs or "
                               f"more besides {run} (at alpha 0.01, three runs pass a run 8 sd "
                               "off their mean, four one 5 sd off)")
    for i, other in enumerate(others):
        if (twin := next((o for o in (run, *others[:i]) if _same_run(o, other)), None)):
            raise TraceError(other, f"given twice{also_as(other, twin)}: the same run twice is no "
                                    "spread")
    # every time, CPU time too (what is checked is the gate's choice, later)
    tolerances = dataclasses.replace(tolerances or Tolerances(), metrics=METRICS)
    loaded = {} if loaded is None else loaded
    figures: dict[tuple, list[float]] = {}
    for other in others:
        for file in (run, other):   # (each read once: gate_files takes them from here)
            if file not in loaded:
                loaded[file] = load_run(file, phase, **breakdown_options)
        runs, more = loaded[run][0], loaded[other][0]
        if TRACE in (*runs, *more) and len(runs) + len(more) > 2:
            raise TraceError(other, f"holds {_holds(more)}, and {run} {_holds(runs)}: runs "
                                    "of one code hold the same paths")
        gated = gate_files(run, other, tolerances, None, phase, loaded, strict=True,
                           **breakdown_options)
        result = gated.result
        if differences := (result.run_differences or []) + result.breakdown_differences:
            raise TraceError(other, f"captured or broken down otherwise than {run} "
                                    f"({'; '.join(differences)}): no run of its code")
        # (each device's too: a device new behind the one shown for its type's devices)
        other_work = [f"{c.path} {c.layer_type} {result.metric_name(c)}: {c.status}"
                      + (f" ({c.detail})" if c.detail else "")
                      for c in (d for shown in result.checks for d in (shown, *shown.others))
                      if c.status not in ("ok", "noise")
                      and not (c.metric in TIMES and c.status in ("regression", "improvement"))]
        if other_work:
            raise TraceError(other, f"not a run of {run}'s work ({other_work[0]}): its times "
                                    f"say nothing of how {run}'s times move")
        for c in result.checks:
            if (c.metric in SPREAD_METRICS and c.layer_index is None
                    and None not in (c.baseline, c.current)):
                figures.setdefault((c.path, c.layer_type, c.metric, c.kernel_class, None, None),
                                   [c.baseline]).append(c.current)
        # each layer's (layer_kernel_us checks the one that rose most, whichever it is), of
        # the types as the gate paired them (their letters may differ)
        run_type = {(c.path, c.layer_type): c.run_layer_type or c.layer_type
                    for c in result.checks if c.metric == "kernel_us" and c.layer_type != STEP
                    and c.kernel_class is None and c.layer_index is None}
        for path, base_b, cur_b in _paired(gated.baseline, gated.current):
            if not all(_says_where(b) for b in (base_b, cur_b)):
                continue
            for (check_path, layer_type), named in run_type.items():
                if check_path != path:
                    continue
                theirs = _by_index(cur_b, named)
                for index, samples in _by_index(base_b, layer_type).items():
                    if index in theirs:
                        figures.setdefault(
                            (path, layer_type, "layer_kernel_us", None, index, None),
                            [float(np.median(samples))]).append(float(np.median(theirs[index])))
            # each device's, of a job of several (its checks test the one that moved most)
            types = [(t, named) for (p, t), named in run_type.items() if p == path]
            devices = device_pairs(base_b, cur_b)
            for (layer_type, named), metric in itertools.product(
                    [*types, (STEP, STEP)], ("kernel_us", "span_us")):
                ours = _by_device(base_b, layer_type, metric) if devices else {}
                theirs = _by_device(cur_b, named, metric) if devices else {}
                for base_device, cur_device in devices:
                    if base_device in ours and cur_device in theirs:
                        figures.setdefault(
                            (path, layer_type, f"{metric}_device", None, None, base_device),
                            [float(np.median(ours[base_device][0]))]).append(
                            float(np.median(theirs[cur_device][0])))
    _no_twins([run, *others], [v for v in figures.values() if len(v) == len(others) + 1])
    return {"runs": [str(run), *map(str, others)],
            "figures": [{"path": path, "layer_type": layer_type, "metric": metric,
                         **({"kernel_class": kernel_class} if kernel_class is not None else {}),
                         **({"layer_index": index} if index is not None else {}),
                         **({"device": device} if device is not None else {}),
                         "values": values}
                        for (path, layer_type, metric, kernel_class, index, device), values
                        in figures.items() if len(values) == len(others) + 1]}


def _no_twins(names: list[Path], values: list[list[float]]) -> None:
    """Two runs whose every figure agrees to the last digit are one run given twice under
    other names (a run directory and its trace, a breakdown of it, a gzipped or re-indented
    copy): runs of a GPU, or of a CPU, never agree so (``_same_run`` catches the same file
    and byte-identical copies before anything is read)."""
    if not values:
        return
    for j, later in enumerate(names):
        for i in range(j):
            if all(v[i] == v[j] for v in values):
                raise TraceError(later, f"has {names[i]}'s times to the last digit in every "
                                        f"one of its {len(values)} figures: one run given "
                                        "twice, under another name, is no spread")


def _same_run(a: Path, b: Path) -> bool:
    """Whether two names are one run: the file read (a run directory's breakdown.json,
    through links), or a copy of it (its bytes, read only where the sizes agree: a trace may
    be gigabytes)."""
    a, b = (p / "breakdown.json" if p.is_dir() else p for p in (a, b))
    try:
        if os.path.samefile(a, b):
            return True
        if a.stat().st_size != b.stat().st_size:
            return False
        return _file_digest(a) == _file_digest(b)
    except OSError:   # (load_run says why)
        return False


def _file_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _within_spread(result: GateResult, spread: dict, path: str | None) -> None:
    """A time check that regressed (or improved) against the baseline, tested against the
    spread of the baseline's runs too: one-sided, a t prediction interval for one more run
    (the run's figure against the runs' mean, ``sd · sqrt(1 + 1/n)``, n - 1 degrees of
    freedom); p ≥ the check's alpha: noise. A kernel class's or a layer's figure is tested as
    its share of its type's kernel µs (in each run and in this one): the factor a run's noise
    moves all of a run's kernels by cancels, where the class's or layer's alpha (a share of
    ``alpha``) would leave a wide interval of few runs wider still. A device's figure is
    tested against its device's runs as it is and as its share of the type's figure over all
    devices (its median over the pooled median), and is noise within both: a run's noise
    moves every device (its clocks, its host) and cancels in the share, where a straggler's
    share moves (over two devices, by half its slowdown, and the other's noise with it); a
    spread stored without them (before the gate checked each device) lends its pooled
    figure, scaled to the device's.
    ``path``: the one the stored figures are keyed by (a baseline of one trace's), else each
    check's own."""

    figures = {(f["path"], f["layer_type"], f["metric"], f.get("kernel_class"),
                f.get("layer_index"), f.get("device")): np.asarray(f["values"], dtype=float)
               for f in spread["figures"]}
    result.spread_runs = len(spread["runs"])
    # (where a device's figure is not kept: lent its type's over all devices, said so)
    lent = ("of the runs' figure over all devices, scaled to this device's: "
            + ("the spread keeps no figure of this device's" if any(
                "device" in f for f in spread["figures"]) else "the baseline keeps no spread of "
               "each device's (gate --update --spread-from again keeps it)"))
    pooled_now = {(c.path, c.layer_type, c.metric): c.current for c in result.checks
                  if c.metric in ("kernel_us", "span_us") and c.kernel_class is None
                  and c.layer_index is None}
    type_us = {(path, layer_type): us for (path, layer_type, metric), us in pooled_now.items()
               if metric == "kernel_us"}
    for c in result.checks:
        if c.status not in ("regression", "improvement") or c.current is None:
            continue
        key = (path or c.path, c.layer_type, c.metric, c.kernel_class, c.layer_index,
               c.baseline_device)
        runs, scaled = figures.get(key), False
        if runs is None and c.metric in DEVICE_METRICS and c.baseline:
            pooled = figures.get((key[0], c.layer_type, c.metric.removesuffix("_device"), None,
                                  None, None))
            if pooled is not None and pooled[0] > 0:   # (pooled[0]: the stored run's)
                runs, scaled = pooled * (c.baseline / pooled[0]), True
        if runs is None:
            continue
        # (the tests, each of runs, this run's figure and what it is of: a share, or itself)
        tests: list[tuple[np.ndarray, float, str | None]] = [(runs, c.current, None)]
        if c.metric in ("class_us", "layer_kernel_us"):
            whole = figures.get((key[0], c.layer_type, "kernel_us", None, None, None))
            if whole is None or not type_us.get((c.path, c.layer_type)) or not np.all(whole > 0):
                continue
            current = c.current / type_us[c.path, c.layer_type]
            tests = [(runs / whole, current, f"of its share of the {c.layer_type} layers' "
                                             f"kernel µs: {current:.4g}, ")]
        elif c.metric in DEVICE_METRICS and not scaled:
            # its share too: past either fails (a share over two devices moves by half a
            # straggler's slowdown, and with the other's noise; a run's clocks move the figure)
            metric = c.metric.removesuffix("_device")
            whole = figures.get((key[0], c.layer_type, metric, None, None, None))
            if whole is not None and pooled_now.get((c.path, c.layer_type, metric)) and np.all(
                    whole > 0):
                current = c.current / pooled_now[c.path, c.layer_type, metric]
                tests.append((runs / whole, current, f"of its share of the {c.layer_type} "
                                                     f"{metric} over all devices: {current:.4g}, "))
        tested = [(_spread_p(r, x, c.status == "regression"), r, share) for r, x, share in tests]
        if any(p is None for p, _, _ in tested):
            continue   # (runs that agree to the last digit, and a figure past them)
        p_value, runs, share = min(tested, key=lambda t: t[0])
        c.p_value, c.tested_over = p_value, "runs"
        if c.p_value >= (c.alpha or result.tolerances.alpha):
            c.status = "noise"
            c.detail = (f"within the spread of the baseline's {runs.size} runs ("
                        + (f"{share}the runs' " if share else "")
                        + f"mean {np.mean(runs):.4g}, sd {np.std(runs, ddof=1):.2g})"
                        + (f"; {lent}" if scaled else ""))
        elif scaled:
            c.detail = lent + (f"; {c.detail}" if c.detail else "")


def _spread_p(runs: np.ndarray, current: float, worse: bool) -> float | None:
    """One-sided p of a t prediction interval for one run more: ``current`` against the runs'
    mean, ``sd · sqrt(1 + 1/n)``, n - 1 degrees of freedom. Runs that agree to the last digit
    (a type's one class: a share of 1): 1 where this run's figure is the same (its type's
    check decides), None where it is not (past them)."""
    from scipy.stats import t as t_dist

    mean, sd = float(np.mean(runs)), float(np.std(runs, ddof=1))
    if not sd > 0:
        return 1.0 if math.isclose(current, mean, rel_tol=1e-9) else None
    score = (current - mean) / (sd * math.sqrt(1 + 1 / runs.size))
    return float(t_dist.sf(score, runs.size - 1) if worse else t_dist.cdf(score, runs.size - 1))


def _holds(runs: dict) -> str:
    """What a side of the gate holds, in words: one trace's breakdown, or a run's paths."""
    return ("one trace's breakdown" if set(runs) == {TRACE}
            else f"the paths {', '.join(runs)}")


def _check_fallbacks(result: GateResult, base_doc: object, run_doc: object,
                     base: dict[str, Breakdown], current: dict[str, Breakdown]) -> None:
    """Paths whose every step fell back ran the standard path's ops under their own name:
    said of either side, and a failure where the run's did and the baseline's did not."""
    base_fb, run_fb = (paths_that_fell_back(d.get("run") if isinstance(d, dict) else None)
                       for d in (base_doc, run_doc))
    for side, fell, paths in (("baseline", base_fb, base), ("run", run_fb, current)):
        result.fell_back += [f"the {side}'s {fell_back_text(p, fell[p])}" for p in paths
                             if p in fell]
        result.paths_fell_back |= {p for p in paths if p in fell}
    for path, _, _ in _paired(base, current):   # (a plain trace stands for the run's path)
        run_path = path if path in current else next(iter(current))
        if run_path in run_fb and path not in base_fb:
            result.checks.append(Check(
                path, STEP, "decode path", None, None, None, None, "fell back",
                f"every step ran the standard path's PyTorch ops ({run_fb[run_path]}); the "
                "baseline's ran its own"))
    # a path that computed NaN (its run.json says; the trace alone cannot) fails, whatever
    # its speed
    metrics = ((run_doc.get("run") or {}).get("paths") or {}) if isinstance(run_doc, dict) \
        else {}
    for path in current:
        if (metrics.get(path) or {}).get("logits_finite") is False:
            result.checks.append(Check(
                path, STEP, "decode path", None, None, None, None, "not finite",
                "the last decode step's logits were not all finite (NaN or infinity)"))


def has_work(runs: dict[str, Breakdown]) -> bool:
    """Whether any decode path holds a step or a layer: something to check."""
    return any(b.steps or b.layers for b in runs.values())


def settings_unknown(base_doc: object, run_doc: object, traces: tuple[bool, bool]
                     ) -> list[str]:
    """Where one side records how it was captured (a capture's preset, batch and TP) and the
    other does not: what no gate could compare, a difference under --strict, as a nightly
    job given the wrong file is. A baseline that is a stored breakdown without them
    (``traces``: which sides are traces given as they are) is kept so on purpose, and a run
    of ``trace --from`` records none (its run information is the traces it read). The GPUs
    are compared all the same, where both sides' traces name theirs (``gpu_differences``)."""
    said = [isinstance(d, dict) and isinstance(d.get("run"), dict) and "preset" in d["run"]
            for d in (base_doc, run_doc)]
    if said[0] == said[1] or (said[1] and not traces[0]):
        return []
    lacking = "run" if said[0] else "baseline"
    side = 1 if said[0] else 0
    doc = (base_doc, run_doc)[side]
    what = ("traces analysed with trace --from" if isinstance(doc, dict)
            and isinstance(doc.get("run"), dict) else "a trace of its own" if traces[side]
            else "a breakdown of its own")
    return [f"the {lacking} records no capture settings ({what}): preset, batch and TP not "
            "compared"]


def request_differences(baseline: dict[str, Breakdown], current: dict[str, Breakdown]
                        ) -> list[str]:
    """Where the steps of a path name other numbers of decode requests on the two sides, the
    largest count a side's steps name, its batch before any request finished (vLLM's
    annotation: "decode requests a step 32 vs 64", another batch; requests that finished
    within the window are no difference), as ``phase_differences`` compares their phases."""
    out = []
    for path, base, cur in _paired(baseline, current):
        batches = [max((n for s in b.steps if (n := decode_requests(s.get("name") or ""))),
                       default=None) for b in (base, cur)]
        if None not in batches and batches[0] != batches[1]:
            out.append(("" if path == TRACE else f"{path}: ")
                       + f"decode requests a step {batches[0]} vs {batches[1]}")
    return out


def phase_differences(baseline: dict[str, Breakdown], current: dict[str, Breakdown]
                      ) -> list[str]:
    """Where the steps of a decode path are of other phases on the two sides ("steps decode
    vs mixed": other work, whose kernels and µs differ for that alone). Paths pair as
    ``gate`` pairs them; a side whose steps name no phase (a profiler's own step ranges)
    says nothing of its work, and is no difference."""
    out = []
    for path, base, cur in _paired(baseline, current):
        phases = [{s.get("phase") for s in b.steps} - {None, "unknown"} for b in (base, cur)]
        if all(phases) and phases[0] != phases[1]:
            out.append(("" if path == TRACE else f"{path}: ")
                       + f"steps {'/'.join(sorted(phases[0]))} vs {'/'.join(sorted(phases[1]))}")
    return out


STEPS_FOUND_BY = {"range": "step ranges", "graph": "graph launches",
                  "pass": "forward passes", "device": "each device's window"}
LAYERS_FROM = {"nvtx": "ranges", "repeat": "the repeating kernel pattern"}


def breakdown_differences(baseline: dict[str, Breakdown], current: dict[str, Breakdown]
                          ) -> list[str]:
    """Where a decode path's steps or layers were found otherwise on the two sides: by other
    means (``steps found by step ranges vs each device's window``, ``layers from ranges vs the
    repeating kernel pattern``), or by another option (``--steps``, ``--layers nvtx:REGEX``,
    ``--phase``) that found other ranges (other step names, other layer types or counts a
    step, steps of other phases: a regex spelled otherwise that finds the same is no
    difference), or, where the repeating kernel pattern cut the layers (it reads the shipped
    classes, which a rule naming one moves), other such rules. How steps and layers
    were found the sources always say; the options, where both breakdowns record them
    (``source.breakdown_options``)."""
    out = []
    for path, base, cur in _paired(baseline, current):
        found = []
        by = [b.source.get("steps_found_by") for b in (base, cur)]
        options = [b.source.get("breakdown_options") or {} for b in (base, cur)]
        if None not in by and by[0] != by[1]:
            found.append("steps found by " + " vs ".join(STEPS_FOUND_BY.get(f, f) for f in by))
        elif by[0] == "range" and all(options) and _step_names(base) != _step_names(cur):
            found += _asked("--steps", *(o.get("steps") for o in options))
        sources = [layer_sources(b) for b in (base, cur)]
        if all(sources) and sources[0] != sources[1]:
            found.append(_layers_found_by(sources))
        elif sources[0] == ["nvtx"] and all(options) and _layers_found(base) != _layers_found(cur):
            found += _asked("--layers", *(o.get("layers") for o in options))
        if all(options) and phase_differences({path: base}, {path: cur}):
            found += _asked("--phase", *(o.get("phase") for o in options))
        if all(options) and "repeat" in (*sources[0], *sources[1]):
            # (the rules that may move the pattern's cuts: those naming a shipped class;
            # all of them, as a breakdown stored before it recorded those says them)
            key = "layout_rules" if all("layout_rules" in o for o in options) else "rules"
            found += _asked("kernel-class rules", *(o.get(key) for o in options))
            found += _asked("default kernel-class rules (another version's)",
                            *(o.get("default_rules") for o in options))
        if found:
            out.append(("" if path == TRACE else f"{path}: ") + "; ".join(found))
    return out


def _layers_found_by(sources: list[list[str]]) -> str:
    """How two sides found their layers (``layer_sources``: ``none``, a side that found
    none), said: "layers from ranges vs the repeating kernel pattern", "no layers found vs
    layers from ranges"."""
    said = [None if side == ["none"] else " and ".join(LAYERS_FROM.get(x, str(x)) for x in side)
            for side in sources]
    if None not in said:
        return "layers from " + " vs ".join(said)
    return " vs ".join("no layers found" if x is None else f"layers from {x}" for x in said)


def _step_names(b: Breakdown) -> set[str]:
    """The names of a breakdown's step ranges, their numbers folded (``decode_step[#]``)."""
    return {re.sub(r"\d+", "#", s["name"]) for s in b.steps if isinstance(s.get("name"), str)}


def _layers_found(b: Breakdown) -> tuple[set[str], float | None]:
    """What a breakdown's layer ranges found: the layer types, and layers a step."""
    return {t["type"] for t in b.layer_types}, layers_per_step(b)


def _asked(what: str, base: str | None, cur: str | None) -> list[str]:
    """``what`` as the two sides asked for it (None: the default), where they differ; a
    regex as typed, in quotes."""
    if base == cur:
        return []
    return [f"{what} " + " vs ".join("the default" if r is None else f"'{r}'"
                                     for r in (base, cur))]


def broken_down_differently(a: str, b: str, differences: list[str]) -> str:
    """The line that says how two breakdowns found their steps and layers otherwise."""
    return (f"{a} and {b} were broken down differently: {'; '.join(differences)}: their steps "
            "and layers are other cuts, and their kernels and µs may differ for that alone")


def unit_differences(baseline: dict[str, Breakdown], current: dict[str, Breakdown]
                     ) -> list[str]:
    """Where one side of a decode path counts a CPU run's ops and the other a GPU's kernels:
    host time against GPU time (``gate`` calls no time of theirs a regression or an
    improvement); their counts compare where the ops are the launches a GPU makes (the
    kernel paths' annotations)."""
    counted = {"ops": "a CPU run's ops", "kernels": "GPU kernels"}
    return [("" if path == TRACE else f"{path}: ")
            + f"{counted[base.unit]} vs {counted[cur.unit]}"
            for path, base, cur in _paired(baseline, current) if base.unit != cur.unit]


def gpu_differences(baseline: dict[str, Breakdown], current: dict[str, Breakdown]
                    ) -> list[str]:
    """Where a decode path's kernels ran on GPUs of another kind on the two sides, from the
    traces themselves (``source.gpus_ran``): a trace has no run information to say it, and
    its µs differ for that alone. A GPU a trace does not describe is no difference
    (``gpus_differ``)."""
    out = []
    for path, base, cur in _paired(baseline, current):
        ran = [b.source.get("gpus_ran") for b in (base, cur)]
        if all(ran) and gpus_differ(*ran):
            said = [gpus_text(g, b.source.get("tool")) for g, b in zip(ran, (base, cur),
                                                                       strict=True)]
            out.append(("" if path == TRACE else f"{path}: ") + f"ran on {said[0]} vs {said[1]}")
    return out


def _paired(baseline: dict[str, Breakdown], current: dict[str, Breakdown]
            ) -> list[tuple[str, Breakdown, Breakdown]]:
    """(path, baseline's, run's) of the paths both sides have, paired as ``gate`` pairs them
    (a plain trace against one path)."""
    if len(baseline) == 1 and len(current) == 1 and TRACE in (*baseline, *current):
        return [(next(iter(baseline)), *baseline.values(), *current.values())]
    return [(p, baseline[p], current[p]) for p in baseline if p in current]


def gate(baseline: dict[str, Breakdown], current: dict[str, Breakdown],
         tolerances: Tolerances = Tolerances(), run_spread: dict | None = None,
         spread_path: str | None = None) -> GateResult:
    """Every (path, layer type, metric) of the baseline checked against the run. A baseline
    without steps or layers has nothing to check: a ValueError. The breakdowns alone: what
    the runs' information says (``gate_files``: how each was captured, models of other
    depths, which steps fell back) is not read, so two models of other depths differ here
    in their layers a step, where ``gate_files`` says they are other models. ``run_spread``:
    the spread of the baseline's runs (``spread_of_runs``), a time past the tolerances
    tested against it too; ``spread_path``: the path its figures are keyed by, where it is
    not each check's own (``TRACE``: a baseline of one trace's)."""
    result, devices = _device_by_device(baseline, current, tolerances, run_spread, spread_path)
    result.checks = _shown_devices(result.checks, devices)
    return result


def _device_by_device(baseline: dict[str, Breakdown], current: dict[str, Breakdown],
                      tolerances: Tolerances, run_spread: dict | None, spread_path: str | None
                      ) -> tuple[GateResult, dict[str, list[tuple[int | None, int | None]]]]:
    """``gate``'s checks, each device's its own (not yet folded into one a type, as
    ``_shown_devices`` does, once every status is final), and each path's device pairs."""
    for side, runs in (("baseline", baseline), ("current", current)):
        if not (isinstance(runs, dict) and all(isinstance(b, Breakdown)
                                               for b in runs.values())):
            raise TypeError(f"{side}: Breakdowns by path ({{'standard': breakdown}}, as "
                            f"load_run gives them), not {type(runs).__name__}: gate_files "
                            "takes files")
    if not isinstance(tolerances, Tolerances):   # (a rel_tol given in its place, say)
        raise TypeError(f"tolerances: a Tolerances, not {type(tolerances).__name__} "
                        f"({tolerances!r}): Tolerances(rel_tol=..., alpha=..., metrics=...)")
    if not has_work(baseline):
        raise ValueError("the baseline holds no steps and no layers: nothing to check")
    if run_spread is not None and not isinstance(run_spread, dict):
        raise TypeError(f"run_spread: a baseline's run_spread (a dict), not "
                        f"{type(run_spread).__name__}")
    if problem := run_spread_problem(run_spread):
        raise ValueError(problem)
    if len(baseline) == 1 and len(current) == 1 and TRACE in (*baseline, *current):
        # a plain trace against one path: compare them, whatever the name
        current = {next(iter(baseline)): next(iter(current.values()))}
    checks: list[Check] = []
    paired_devices: dict[str, list[tuple[int | None, int | None]]] = {}
    untimed: dict[str, int] = {}
    op_paths = [p for p in dict.fromkeys([*baseline, *current])
                if all(b.unit == "ops" for b in (baseline.get(p), current.get(p)) if b)]
    # the one rule for CPU time (Tolerances.cpu_times): a path of CPU runs alone is checked on
    # its ops unless the metrics were named
    ops_alone = [] if tolerances.cpu_times else op_paths
    times = [m for m in tolerances.checked if m != "kernels"]
    for path in [*baseline, *(p for p in current if p not in baseline)]:
        base, cur = baseline.get(path), current.get(path)
        metrics = ("kernels",) if path in ops_alone else tolerances.checked
        pairs = pair_layer_types(base, cur)
        # CPU ops against GPU kernels: host time against GPU time
        unlike_times = base is not None and cur is not None and base.unit != cur.unit
        moved = _moved(base, cur, pairs)
        # (compare's other half of the rule, every layer a range and other counts, is no
        # waiver here: a layer whose range is gone is the regression `layers` is for; depths
        # are waived where run.json says them, in gate_files)
        windows = _unequal_windows(base, cur)
        devices = paired_devices[path] = device_pairs(base, cur)
        for base_type, cur_type in [*pairs, (STEP, STEP)]:
            label = pair_label(base_type, cur_type, base)
            shifted = base_type in moved or (base_type == STEP and windows is not None)
            found: list[Check] = []
            if None not in (base_type, cur_type) and (
                    swap := _kernels_changed(base, base_type, cur, cur_type)):
                found.append(Check(path, label, "pattern", None, None, None, None, "changed",
                                   None if swap is True else swap))
            layers = _layers_check(path, label, base, base_type, cur, cur_type)
            if layers is not None:
                if windows is not None and layers.status == "differs":   # (other work)
                    layers.status = "changed"
                    layers.detail = windows if base_type == STEP else _window_holds(
                        layers, unequal_windows(base, cur))
                found.append(layers)
            for metric in metrics:
                # (steps count kernels too: those outside every layer, a step's prologue and
                # epilogue, are in no layer type)
                base_s = _samples(base, base_type, metric)
                cur_s = _samples(cur, cur_type, metric)
                if base_type == STEP and base_s is None and cur_s is None:
                    continue  # neither side found steps
                if metric == "kernels":
                    found += [_kernel_count_check(path, label, "kernels", base_s, cur_s,
                                                  np.median),
                              _largest(path, label, base, cur, base_s, cur_s)]
                else:
                    base_steps = _step_means(base_s, _step_groups(base, base_type))
                    cur_steps = _step_means(cur_s, _step_groups(cur, cur_type))
                    found.append(_time_check(path, label, metric, base_s, cur_s, tolerances,
                                             base_steps, cur_steps))
                    if devices and None not in (base_type, cur_type):
                        each, timed = _device_checks(
                            path, label, metric, base, base_type, cur, cur_type, tolerances,
                            devices, not _testable(base_steps, cur_steps, tolerances))
                        found += each
                        if not timed:
                            untimed[f"{path} {label}"] = len(devices)
                    if metric == "span_us" and base_type == STEP and (mean := _mean_check(
                            path, label, _each_step(base, base_s), _each_step(cur, cur_s),
                            tolerances)):
                        found.append(mean)
                    if metric == "kernel_us" and base_type != STEP:
                        found += _class_times(path, label, base, base_type, cur, cur_type,
                                              tolerances)
                        found += _layer_time(path, label, base, base_type, cur, cur_type,
                                             tolerances)
            why_moved = _moved_why(base, base_type, cur_type) if base_type in moved else None
            for check in found:
                if unlike_times and check.metric in TIMES and check.status in (
                        "regression", "improvement", "noise"):
                    check.status = "changed"
                if check.status in ("regression", "improvement") and (
                        check.metric in DEVICE_METRICS):   # (``_shown_devices`` says its own)
                    check.detail = windows if base_type == STEP else None
                elif check.status in ("regression", "improvement"):
                    check.detail = (windows if base_type == STEP and windows is not None
                                    else _step_behind(check, base, cur, pairs)
                                    if base_type == STEP
                                    else _behind(check, base, cur, base_type, cur_type))
                elif (check.status == "new" and check.metric == "kernels" and base_type is None
                      and cur_type not in (None, STEP)):
                    check.detail = _nearest_type(base, cur, cur_type)
                if shifted and check.status in ("regression", "improvement", "missing",
                                                "differs"):
                    check.status = "changed"
                elif base_type == STEP and windows is not None and check.status in (
                        "ok", "noise"):   # (a window's span is the window's, whatever ran)
                    check.status, check.detail = "changed", windows
                if cur_type not in (None, label):
                    check.run_layer_type = cur_type
            # why, once a type: on its first check changed (its pattern's, where it has one)
            if why_moved is not None and (first := next(
                    (c for c in found if c.status == "changed"), None)) is not None:
                first.detail = why_moved + (f"; {first.detail}" if first.detail else "")
            if base_type == STEP and layers is not None and layers.status == "differs":
                # a step that lost (gained) layers is other work: not faster (slower) for it;
                # the layers' check fails
                for check in found:
                    if check.status in ("regression", "improvement"):
                        check.status = "changed"
                        check.detail = f"{layers.detail}: other work" + (
                            f"; {check.detail}" if check.detail else "")
            checks += found
    # a path with a CPU side whose times were checked (a CPU run against a GPU's, say)
    cpu_checked = any(p not in ops_alone
                      and any(b.unit == "ops" for b in (baseline.get(p), current.get(p)) if b)
                      for p in dict.fromkeys([*baseline, *current]))
    # (a path one side lacks is missing or new, whatever its unit: no times left out)
    left_out = any(p in baseline and p in current for p in ops_alone)
    result = GateResult(checks, tolerances, op_paths=op_paths,
                        cpu_time_metrics=times if cpu_checked else [],
                        cpu_times_left_out=times if left_out else [])
    if run_spread:
        _within_spread(result, run_spread, spread_path)
    result.devices_untimed = untimed
    return result, paired_devices


def _digest(b: Breakdown | None, layer_type: str | None) -> str | None:
    return ((_layer_type(b, layer_type) if b else None) or {}).get("pattern")


def _moved(base: Breakdown | None, cur: Breakdown | None,
           pairs: list[tuple[str | None, str | None]]) -> set[str]:
    """The baseline's pattern types whose checks only say that the pattern split the steps
    elsewhere (see the module doc): of the pairs whose kernel sequences differ, the kernels
    their typical layers lost are the ones the others gained (a kernel moved from one letter
    to the next); a pattern type the run lacks, while the run has pattern types, where the
    run's steps hold as many layers as the baseline's or it held no more layers than steps."""
    if base is None or cur is None or not any(map(pattern_found, (base, cur))):
        return set()   # (ranges cut both sides' layers: no kernel moved by a pattern)
    # (a digest stored before digests were of the least rotation may differ for the same
    # cycle cut elsewhere: such a pair is the same layer, its checks stand)
    changed = [(b, c) for b, c in pairs if b is not None and c is not None
               and _digest(base, b) is not None
               and _digest(cur, c) not in (None, _digest(base, b))
               and not _rotated(base, b, cur, c)]
    lost: Counter = Counter()
    gained: Counter = Counter()
    for b, c in changed:
        kb, kc = _typical(base, b), _typical(cur, c)
        if kb is None or kc is None:
            return set()   # an older breakdown: nothing to tell a move by
        names_b, names_c = Counter(k["name"] for k in kb), Counter(k["name"] for k in kc)
        lost += names_b - names_c
        gained += names_c - names_b
    moved = {b for b, _ in changed} if lost and lost == gained else set()
    # (a run whose ranges cut its layers lost what it lacks: no pattern found it elsewhere)
    if pattern_found(cur) and any(_digest(cur, t["type"]) is not None for t in cur.layer_types):
        per_step = layers_per_step(base)
        same_layers = per_step is not None and per_step == layers_per_step(cur)
        for b, c in pairs:
            t = _layer_type(base, b)
            if (c is None and t is not None and t.get("pattern") is not None
                    and (same_layers or t["layers"] <= len(base.steps))):
                moved.add(b)
    return moved


def _moved_why(base: Breakdown, base_type: str, cur_type: str | None) -> str:
    """Why a pattern type's checks are ``changed`` (``_moved``), in words."""
    if cur_type is not None:
        return ("the kernel pattern started its layers elsewhere: the kernels this type's "
                "typical layer lost, others gained")
    held = (_layer_type(base, base_type) or {}).get("layers", 0)
    return ("the kernel pattern found none in the run, " + (
        "whose steps hold as many layers: its layers went to other types"
        if held > len(base.steps) else "where the baseline held no more of them than steps: "
        "an edge of the pattern"))


def _unequal_windows(base: Breakdown | None, cur: Breakdown | None) -> str | None:
    """Why whole steps do not compare, where they do not (``unequal_windows``)."""
    layers = None if base is None or cur is None else unequal_windows(base, cur)
    if layers is None:
        return None
    return (f"each device is one step, the profiler's window: {layers[0]:g} layers a step in "
            f"the baseline, {layers[1]:g} in the run")


def _window_holds(layers: Check, in_all: tuple[float, float]) -> str:
    """A layer type's ``layers`` check where the profiler's windows hold other work: its own
    count a step on each side, with the windows' layers in all."""
    return (f"each device is one step, the profiler's window: {layers.baseline:g} of these a "
            f"step in the baseline, {layers.current:g} in the run ({in_all[0]:g} and "
            f"{in_all[1]:g} layers in all)")


def _rotated(base: Breakdown, base_type: str, cur: Breakdown, cur_type: str) -> bool:
    """Whether the run's typical layer is the baseline's, cut at the same kernel or another
    (a digest stored before digests were of the least rotation differs for either)."""
    kernels = [((_layer_type(b, t) or {}).get("typical_layer") or {}).get("kernels")
               for b, t in ((base, base_type), (cur, cur_type))]
    return None not in kernels and rotation(*([k["name"] for k in side]
                                              for side in kernels)) is not None


def _layer_type(b: Breakdown, name: str | None) -> dict | None:
    return next((t for t in b.layer_types if t["type"] == name), None)


def _typical(b: Breakdown | None, layer_type: str | None) -> list[dict] | None:
    """A layer type's typical kernels (None: a step, or a breakdown of an older kimi-perf)."""
    t = next((t for t in b.layer_types if t["type"] == layer_type), None) if b else None
    return ((t or {}).get("typical_layer") or {}).get("kernels")


def _classes_behind(check: Check, base: Breakdown, cur: Breakdown, base_type: str,
                    cur_type: str) -> str | None:
    """In which kernel classes a type's layers grew or shrank, where their typical layers ran
    the same kernels: for ``kernels_max``, the run's largest layer (named) against the
    baseline's ("the largest layer (step 2, layer 5): memcpy +1"); for ``kernels``, the
    medians per class over the type's layers ("median per layer: norm +0.5")."""
    if check.metric == "kernels_max":
        if not all(_says_where(b) for b in (base, cur)):
            return None
        rows = [layer_of_type(b.layers, t, int(np.argmax(layer_column(b.layers, "kernels", t))))
                for b, t in ((base, base_type), (cur, cur_type))]
        classes = [r.get("classes") for r in rows]
        where = (f"the largest layer (step {rows[1]['step']}, layer {rows[1]['index']}"
                 + (f", device {rows[1]['device']}" if rows[1]["device"] > 0 else "") + ")")
    else:
        classes = [(_layer_type(b, t) or {}).get("classes") for b, t in ((base, base_type),
                                                                        (cur, cur_type))]
        where = "median per layer"
    counts = [Counter({c: v["kernels"] for c, v in (side or {}).items()}) for side in classes]
    moved = [(c, counts[1][c] - counts[0][c]) for c in dict.fromkeys([*counts[0], *counts[1]])
             if counts[1][c] != counts[0][c]]
    return f"{where}: " + ", ".join(f"{c} {d:+g}" for c, d in moved) if moved else None


def _kernels_changed(base: Breakdown, base_type: str, cur: Breakdown, cur_type: str
                     ) -> str | bool:
    """Whether a pair's typical layers ran other kernels: for types the pattern found, their
    digests differ; for types ranges cut (named, or lettered), their kernel sequences do
    (another GEMM kernel picked, the same count: a swap no count check sees; the same kernels
    in another order). What changed (``_swapped``) where both typical layers are stored;
    True where only the digests say so; False: the same."""
    digests = [_digest(base, base_type), _digest(cur, cur_type)]
    kb, kc = _typical(base, base_type), _typical(cur, cur_type)
    # both sides' layers cut by ranges: the sequence as it ran, its order too (a digest is of
    # a cycle; and one side's may predate digests of ranges' letters)
    ranges = None not in (base, cur) and not (pattern_found(base) or pattern_found(cur))
    if patterns_differ(digests) and (kb is None or kc is None):
        return True
    if patterns_differ(digests) and not ranges:   # (the same cycle where digests predate
        return _swapped(kb, aligned_typical({"base": {"kernels": kb}, "cur": {   # rotations)
            "kernels": kc}})[0]["cur"]["kernels"]) or False
    if (digests != [None, None] and not ranges) or kb is None or kc is None:
        return False
    return _swapped(kb, kc) or False


def _swapped(kb: list[dict], kc: list[dict]) -> str | None:
    """The kernels a typical layer gained and lost ("added x ×2; removed y"), or that it ran
    the same ones in another order; None for the same sequence."""
    from kimi_perf.names import short_names

    nb, nc = Counter(k["name"] for k in kb), Counter(k["name"] for k in kc)
    added, removed = nc - nb, nb - nc
    # shortened together: two variants of one template read apart (``…~a089``, ``…~1387``)
    short = dict(zip([*added, *removed], short_names([*added, *removed], 50), strict=True))
    parts = [f"{sign} " + ", ".join(short[n] + (f" ×{count}" if count > 1 else "")
                                    for n, count in diff.items())
             for sign, diff in (("added", added), ("removed", removed)) if diff]
    if parts:
        return "; ".join(parts)
    return ("the same kernels in another order"
            if [k["name"] for k in kb] != [k["name"] for k in kc] else None)


def _behind(check: Check, base: Breakdown | None, cur: Breakdown | None,
            base_type: str | None, cur_type: str | None) -> str | None:
    """The kernels behind a layer type's change, from both typical layers: for counts, those
    added and removed; for times, the (at most three) launches whose µs moved most in the
    change's direction (the i-th launch of a name matched with the i-th; one that only one side
    has moves by all its µs: new or gone), and how much the typical layer moved in all."""
    from kimi_perf.names import short_names

    if check.layer_index is not None:   # one layer, not the typical one: its classes
        return _layer_classes_behind(check, base, cur, base_type, cur_type)
    kb, kc = _typical(base, base_type), _typical(cur, cur_type)
    if kb is not None and kc is not None:
        # the same layer cut at another kernel: its launches paired from the baseline's first
        kc = aligned_typical({"base": {"kernels": kb},
                              "cur": {"kernels": kc}})[0]["cur"]["kernels"]
        if check.kernel_class is not None:   # (class_us: that class's launches alone)
            kb, kc = ([k for k in kernels if k.get("class") == check.kernel_class]
                      for kernels in (kb, kc))
    if check.metric.startswith("kernels"):
        if kb is not None and kc is not None and (
                Counter(k["name"] for k in kb) != Counter(k["name"] for k in kc)):
            return _swapped(kb, kc)
        # the typical layers ran the same kernels (or are not stored): in which classes
        return _classes_behind(check, base, cur, base_type, cur_type)
    if kb is None or kc is None:
        return None

    def by_launch(kernels: list[dict]) -> dict[tuple[str, int], float]:
        seen: Counter = Counter()
        out = {}
        for k in kernels:
            out[(k["name"], seen[k["name"]])] = k["us"]
            seen[k["name"]] += 1
        return out
    ub, uc = by_launch(kb), by_launch(kc)
    # every launch of either side: one only the run has counts whole, as does one it lost
    moves = [(uc.get(key, 0.0) - ub.get(key, 0.0), key, key not in ub, key not in uc)
             for key in {**ub, **uc}]
    sign = 1 if check.status == "regression" else -1  # times: a regression is slower
    # (a move that prints as 0.0 is float rounding, not a move; a launch new or gone is)
    moved = sorted((m for m in moves if m[0] * sign > 0 and (abs(m[0]) >= 0.05 or m[2] or m[3])),
                   key=lambda m: -abs(m[0]))[:3]
    # a name the layer launches more than once is told apart by its launch: "#2" its second
    repeated = {name for name, i in {**ub, **uc} if i > 0}
    names = [name + (f" #{i + 1}" if full in repeated else "")
             for name, (full, i) in zip(short_names([m[1][0] for m in moved], 50),
                                        (m[1] for m in moved), strict=True)]
    parts = [", ".join(f"{name} {delta:+.1f} µs" + (" (new)" if new else " (gone)" if gone
                                                    else "")
                       for name, (delta, _, new, gone) in zip(names, moved, strict=True))]
    of = f"'s {check.kernel_class}" if check.kernel_class else ""
    parts.append(f"typical layer{of} {sum(uc.values()) - sum(ub.values()):+.1f} µs in all")
    if check.metric == "span_us":
        # a span is its kernels and the idle time between them: say which moved
        gaps = [layer_column(b.layers, "gap_us", t).astype(np.float64)
                for b, t in ((base, base_type), (cur, cur_type))]
        if all(len(g) and np.isfinite(g).all() for g in gaps):
            parts.append(f"idle between {cur.unit} "
                         f"{np.median(gaps[1]) - np.median(gaps[0]):+.1f} µs (median)")
    return "; ".join(filter(None, parts)) if moved or check.metric == "span_us" else None


def _layer_classes_behind(check: Check, base: Breakdown, cur: Breakdown, base_type: str,
                          cur_type: str) -> str | None:
    """In which kernel classes one layer (``check.layer_index``) moved: the (at most three)
    whose median µs over the steps moved most in the change's direction."""
    medians = []
    for b, t in ((base, base_type), (cur, cur_type)):
        mine = layer_column(b.layers, "index", t) == check.layer_index
        medians.append({c: float(np.median(class_column(b.layers, c, t)[mine]))
                        for c in layer_classes(b.layers, t)})
    sign = 1 if check.status == "regression" else -1
    moves = sorted(((medians[1].get(c, 0.0) - medians[0].get(c, 0.0), c)
                    for c in dict.fromkeys([*medians[0], *medians[1]])),
                   key=lambda m: -m[0] * sign)
    moved = [f"{c} {d:+.1f} µs" for d, c in moves[:3] if d * sign > 0]
    return f"its classes (medians over the steps): {', '.join(moved)}" if moved else None


def _step_behind(check: Check, base: Breakdown, cur: Breakdown,
                 pairs: list[tuple[str | None, str | None]]) -> str | None:
    """Where a whole step's change lies, by part (its prologue, epilogue, the layers of each
    type and what lies between them): the medians of each part over the steps (for
    ``span_us_mean``, the means; for ``kernels_max``, the parts of the largest step), the (at
    most three) that moved most in the change's direction, and beside them a part that moved
    the other way by as much as the step (which the change's net alone would hide: 434 → 423
    kernels as B layers -216 and A layers +204). A part a side holds in some of its steps only
    says in how many (its median over the steps is no step's)."""
    metric = check.metric.removesuffix("_max").removesuffix("_mean")
    if not all(_says_where(b) for b in (base, cur)) or not (base.layer_types
                                                             or cur.layer_types):
        return None   # (no layers: the step is one part, the check itself)
    largest = check.metric.endswith("_max")
    average = np.mean if check.metric.endswith("_mean") else np.median
    sides, partial = [], {}
    for b, names in ((base, {t: t for t, _ in pairs if t is not None}),
                     (cur, {c: _run_type_label(t, c, base) for t, c in pairs if c is not None})):
        parts = _step_parts(b, metric, names)
        pick = int(np.argmax([s[metric] for s in b.steps]))
        sides.append({part: float(v[pick] if largest else average(v))
                      for part, v in parts.items()})
        for part, v in parts.items():
            if not largest and part.endswith(" layers") and 0 < (held := int(np.count_nonzero(
                    v))) < len(v):
                partial.setdefault(part, []).append(
                    f"{held} of {len(v)} steps{' in the run' if b is cur else ''}")
    moves = [(sides[1].get(part, 0.0) - sides[0].get(part, 0.0), part)
             for part in dict.fromkeys([*sides[0], *sides[1]])]
    sign = 1 if check.status == "regression" else -1   # (kernels and µs alike: more is worse)
    net = abs((check.current or 0.0) - (check.baseline or 0.0))
    # (a move that prints as 0.0 is float rounding, not a move)
    moved = sorted((m for m in moves if m[0] * sign >= 0.05), key=lambda m: -abs(m[0]))[:3]
    if not moved:
        return None
    against = [m for m in moves if -m[0] * sign >= max(net, 0.05)]
    shown = sorted([*moved, *sorted(against, key=lambda m: -abs(m[0]))[:1]],
                   key=lambda m: -abs(m[0]))
    unit = f" {cur.unit}" if metric == "kernels" else " µs"
    named = _step_kernels_swapped(base, cur, largest) if metric == "kernels" else None
    return ((f"in its layers: {named}; " if named else "")
            + ("the largest step: " if largest else
               f"per step ({'means' if average is np.mean else 'medians'}): ")
            + ", ".join(f"{part} {delta:+.{1 if metric != 'kernels' or delta % 1 else 0}f}"
                        + unit + (f" (in {', '.join(partial[part])})" if part in partial
                                  else "") for delta, part in shown))


def _nearest_type(base: Breakdown | None, cur: Breakdown, cur_type: str) -> str | None:
    """A layer type only the run has, against the baseline's type whose typical layer runs
    the kernels most like its own ("the baseline's A, added x"): a kernel added to some
    layers makes them a type of their own. None where no typical layers are stored, or where
    the nearest shares no more than half of the kernels of the larger (a new type)."""
    kc = _typical(cur, cur_type)
    if base is None or kc is None:
        return None
    names = Counter(k["name"] for k in kc)
    apart = []
    for t in base.layer_types:
        if (kb := _typical(base, t["type"])) is not None:
            theirs = Counter(k["name"] for k in kb)
            apart.append((sum(((names - theirs) + (theirs - names)).values()), t["type"], kb))
    if not apart:
        return None
    distance, nearest, kb = min(apart, key=lambda a: a[0])
    shared = (len(kc) + len(kb) - distance) // 2
    if 2 * shared <= max(len(kc), len(kb)):
        return None   # most of one is not the other's: a type of its own
    return f"the baseline's {nearest}, {_swapped(kb, kc) or 'the same kernels'}"


# kernel names a step's layers may have gained or lost for the gate to name them: more is other
# work (a step of prefill against one of decode), which the parts of the step say better
STEP_KERNELS_NAMED = 3


def _step_kernels_swapped(base: Breakdown, cur: Breakdown, largest: bool) -> str | None:
    """The kernels a step's layers gained and lost ("added x ×4"), each side's step taken as
    its typical layers times the layers of each type a step holds (the median step's counts,
    or the largest step's): a kernel added to some layers only makes them a layer type of
    their own, so that no type's count names it. None where a type has no typical layer
    stored, or the two sides' steps run the same kernels, or more than
    ``STEP_KERNELS_NAMED`` kernel names differ."""
    sides = []
    for b in (base, cur):
        pick = int(np.argmax([s["kernels"] for s in b.steps]))
        names: Counter = Counter()
        in_layers = np.zeros(len(b.steps))   # each step's kernels in its layers
        for t in b.layer_types:
            typical = _typical(b, t["type"])
            if typical is None:
                return None
            at = _step_of_each_layer(b, t["type"])
            held = at >= 0
            per_step = np.bincount(at[held], minlength=len(b.steps))
            in_layers += np.bincount(at[held], weights=layer_column(
                b.layers, "kernels", t["type"])[held].astype(np.float64), minlength=len(b.steps))
            layers = float(per_step[pick] if largest else np.median(per_step))
            if not layers.is_integer():
                return None   # (a type in half the steps: no step holds the median's)
            for k in typical:
                names[k["name"]] += int(layers)
        # the typical layers must make the step's layers' kernels, as counted: else layers of
        # a type run other kernels (some with an extra one), and the names would miscount
        if sum(names.values()) != (in_layers[pick] if largest else np.median(in_layers)):
            return None
        sides.append(names)
    added, removed = sides[1] - sides[0], sides[0] - sides[1]
    if not 0 < len(added) + len(removed) <= STEP_KERNELS_NAMED:
        return None   # the same kernels, or other work altogether (prefill against decode)
    return _swapped([{"name": n} for n in sides[0].elements()],
                    [{"name": n} for n in sides[1].elements()])


def _run_type_label(base_type: str | None, cur_type: str, base: Breakdown) -> str:
    """A run's layer type as a pair names it; one only the run has whose letter the baseline
    gives another type (``-`` in the tables) by its own name, marked as the run's."""
    label = pair_label(base_type, cur_type, base)
    return f"the run's {cur_type}" if label == "-" else label


def _step_parts(b: Breakdown, metric: str, names: dict[str, str]) -> dict[str, np.ndarray]:
    """Each step's ``metric`` by part, in the order of ``b.steps``: its prologue and epilogue
    (where stored), the layers of each type (named as ``names`` maps the types: a pair's one
    name), and the rest: where the prologue and epilogue are stored, what lies between the
    layers (kernels; of a span, idle time or other work), else all outside the layers."""
    parts: dict[str, np.ndarray] = {}
    for end in ("prologue", "epilogue"):   # (their kernel µs where stored: not always)
        values = [(s.get(end) or {}).get(metric) for s in b.steps]   # (in memory: none)
        if all(is_figure(v) for v in values):
            parts[end] = np.array(values, np.float64)
    for t in b.layer_types:
        at = _step_of_each_layer(b, t["type"])
        held = at >= 0
        parts[f"{names.get(t['type'], t['type'])} layers"] = np.bincount(
            at[held], weights=layer_column(b.layers, metric, t["type"])[held].astype(np.float64),
            minlength=len(b.steps))
    totals = np.array([s[metric] for s in b.steps], np.float64)
    # the rest: beside prologue and epilogue, what lies between the layers (their kernels, or
    # the idle time of a span); without them, all that lies outside the layers
    rest = (("between layers (idle, or other work)" if metric == "span_us" else
             "between layers") if "prologue" in parts else "outside the layers")
    parts[rest] = totals - sum(parts.values())
    return parts


def _layers_check(path: str, label: str, base: Breakdown | None, base_type: str | None,
                  cur: Breakdown | None, cur_type: str | None) -> Check | None:
    """Layers a step (the median step's; of a layer type, those of the type), where both
    sides have them: a layer lost or added is other work, whose steps' and layers' figures
    would otherwise pass for a change of speed (a lost layer as an improvement)."""
    if (base_type, cur_type) == (None, None) or (base, cur) == (None, None):
        return None
    if base is None or cur is None:
        # a path one side lacks: its layers a step, missing or new as its other figures are
        # (a JUnit case that fails, rather than one that vanishes from the report)
        b, t = (base, base_type) if cur is None else (cur, cur_type)
        had = layers_per_step(b) if t == STEP else _type_per_step(b, t)
        if not had:
            return None
        return (Check(path, label, "layers", had, None, None, None, "missing") if cur is None
                else Check(path, label, "layers", None, had, None, None, "new"))
    if None in (base_type, cur_type):
        # a type one side lacks: its layers a step, missing or new (with its kernels')
        had = _type_per_step(base, base_type) if cur_type is None else _type_per_step(
            cur, cur_type)
        if not had or not (layers_per_step(base) and layers_per_step(cur)):
            return None   # (in fewer than half the steps, or steps that do not say)
        return (Check(path, label, "layers", had, 0.0, -1.0, None, "missing") if cur_type is None
                else Check(path, label, "layers", 0.0, had, None, None, "new"))
    counts = [layers_per_step(b) if t == STEP else _type_per_step(b, t)
              for b, t in ((base, base_type), (cur, cur_type))]
    if None in counts:
        return None
    b, c = counts
    if b == c:
        # (the median over every device's steps: one rank of four that lost a layer a step
        # moves it not at all)
        return _device_layers_check(path, label, base, base_type, cur, cur_type, b) or Check(
            path, label, "layers", b, c, 0.0, None, "ok")
    if base_type != STEP and (_digest(base, base_type) or _digest(cur, cur_type)) and (
            layers_per_step(base) == layers_per_step(cur) is not None):
        # a type the kernel pattern found: the steps hold as many layers, typed otherwise
        # (an edge layer of a letter of its own on one side, of a commoner one on the other)
        return Check(path, label, "layers", b, c, _change(b, c), None, "changed",
                     "the pattern typed the steps' layers otherwise: as many a step")
    # (the devices that changed, where others did not: the median over every device's steps
    # of two, one of which lost a layer, is a half that no step holds)
    changed, pairs = _device_layer_changes(base, base_type, cur, cur_type)
    devices = (" (" + ", ".join(f"device {d}: {x:g} -> {y:g}" for _, d, x, y in changed) + ")"
               if changed and len(changed) < pairs else "")
    return Check(path, label, "layers", b, c, _change(b, c), None, "differs",
                 f"{b:g} layers a step in the baseline, {c:g} in the run{devices}")


def _device_layers_check(path: str, label: str, base: Breakdown, base_type: str,
                         cur: Breakdown, cur_type: str, whole: float) -> Check | None:
    """A device of a job of several whose steps hold other numbers of layers (of the type)
    than its pair's: ``differs``, the first such device (None where none does)."""
    changed, _ = _device_layer_changes(base, base_type, cur, cur_type)
    if not changed:
        return None
    base_device, cur_device, x, y = changed[0]
    return Check(path, label, "layers", x, y, _change(x, y), None, "differs",
                 f"device {cur_device}: {x:g} layers a step in the baseline, {y:g} in the run "
                 f"(the median step of every device: {whole:g} in both)",
                 device=cur_device, baseline_device=base_device)


def _device_layer_changes(base: Breakdown, base_type: str, cur: Breakdown, cur_type: str
                          ) -> tuple[list[tuple[int, int, float, float]], int]:
    """Each device pair of a job whose steps hold other numbers of layers (of the type) on
    the two sides, as (baseline's device, run's device, layers a step in each), but where the
    pattern typed the device's layers otherwise, as many a step; and how many pairs there
    are."""
    pairs = [(b, c) for b, c in device_pairs(base, cur) if None not in (b, c)]
    if not pairs:
        return [], 0
    ours, theirs = _device_layer_counts(base, base_type), _device_layer_counts(cur, cur_type)
    steps = ((_device_layer_counts(base, STEP), _device_layer_counts(cur, STEP))
             if base_type != STEP and (_digest(base, base_type) or _digest(cur, cur_type))
             else None)
    changed = []
    for base_device, cur_device in pairs:
        x, y = ours.get(base_device), theirs.get(cur_device)
        if None in (x, y) or x == y or (steps and steps[0].get(base_device) == steps[1].get(
                cur_device) is not None):
            continue
        changed.append((base_device, cur_device, x, y))
    return changed, len(pairs)


def _device_layer_counts(b: Breakdown, layer_type: str) -> dict[int, float]:
    """Each device's median step's count of layers (of the type; of ``STEP``, all); empty
    where a step does not say its count."""
    device = np.array([s["device"] for s in b.steps], np.int64)
    if layer_type == STEP:
        if any(s.get("layers") is None for s in b.steps):
            return {}
        counts = np.array([s["layers"] for s in b.steps], np.float64)
    else:
        at = _step_of_each_layer(b, layer_type)
        counts = np.bincount(at[at >= 0], minlength=len(b.steps)).astype(np.float64)
    return {int(d): float(np.median(counts[device == d])) for d in np.unique(device)}


def _type_per_step(b: Breakdown, layer_type: str) -> float | None:
    """The median step's count of layers of the type (None: no steps, or layers and steps
    that do not say where they ran: a breakdown built in memory without it)."""
    if not b.steps or not _says_where(b):
        return None
    at = _step_of_each_layer(b, layer_type)
    return float(np.median(np.bincount(at[at >= 0], minlength=len(b.steps))))


def _step_of_each_layer(b: Breakdown, layer_type: str) -> np.ndarray:
    """Each layer of the type's step, as its position in ``b.steps`` (-1: a step not there);
    the breakdown must say where its layers ran (``_says_where``)."""
    position = {(s["index"], s["device"]): i for i, s in enumerate(b.steps)}
    return np.array([position.get(key, -1) for key in zip(
        layer_column(b.layers, "step", layer_type).tolist(),
        layer_column(b.layers, "device", layer_type).tolist(), strict=True)], np.int64)


def _says_where(b: Breakdown) -> bool:
    """Whether a breakdown's layers and steps say where they ran (a breakdown built in memory
    may not): the step and device of each."""
    return all(isinstance(r.get(key), int) for r in b.layers[:1] for key in ("step", "device")
               ) and all(isinstance(s.get(key), int) for s in b.steps[:1]
                         for key in ("index", "device"))


def _samples(b: Breakdown | None, layer_type: str | None, metric: str) -> np.ndarray | None:
    if b is None or layer_type is None:
        return None
    if layer_type == STEP:
        values = np.array([r[metric] for r in b.steps], dtype=np.float64)
    else:
        values = layer_column(b.layers, metric, layer_type).astype(np.float64)
    return values if values.size else None


def _lacking(path: str, layer_type: str, metric: str, base: np.ndarray | None,
             cur: np.ndarray | None, stat=np.median) -> Check | None:
    if base is not None and cur is not None:
        return None
    return Check(path, layer_type, metric, None if base is None else float(stat(base)),
                 None if cur is None else float(stat(cur)), None, None,
                 "missing" if cur is None else "new")


def _change(b: float, c: float) -> float | None:
    return c / b - 1 if b else (0.0 if c == b else None)


def _largest(path: str, layer_type: str, base: Breakdown | None, cur: Breakdown | None,
             base_s: np.ndarray | None, cur_s: np.ndarray | None) -> Check:
    """``kernels_max``: the largest count. Where the run profiled more steps than the
    baseline, a larger one says nothing of the work (what runs every few steps, a cache
    flush, may fall in the longer window alone): ``changed``, not a regression; the medians
    still compare. (A shorter run's larger count is a regression.)"""
    check = _kernel_count_check(path, layer_type, "kernels_max", base_s, cur_s, np.max)
    windows = [len(b.steps) for b in (base, cur) if b is not None]
    if check.status == "regression" and len(windows) == 2 and windows[1] > windows[0]:
        check.status = "changed"
        check.detail = (f"the largest of {windows[0]} steps in the baseline, of {windows[1]} in "
                        "the run: work every few steps may fall in one window alone")
    return check


def _step_groups(b: Breakdown | None, layer_type: str | None) -> np.ndarray | None:
    """Which step each of a type's layers (or, for ``step``, each step row) is of, as group
    numbers 0..n-1: the test's samples are steps, all GPUs of one together (they share its
    host and its collectives' waits, so they are not independent samples either). None where
    the rows do not say their step."""
    if b is None or layer_type is None or not _says_where(b):
        return None
    if layer_type == STEP:
        step = np.array([s["index"] for s in b.steps], np.int64)
    else:
        step = layer_column(b.layers, "step", layer_type)
    return np.unique(step, return_inverse=True)[1].ravel() if step.size else None


def _step_means(values: np.ndarray | None, groups: np.ndarray | None) -> np.ndarray | None:
    """``values`` (a type's layers', or the step rows', in order) averaged per step."""
    if values is None or groups is None or not values.size:
        return None
    return np.bincount(groups, weights=values) / np.bincount(groups)


def _each_step(b: Breakdown | None, rows: np.ndarray | None) -> np.ndarray | None:
    """The step rows' values (``rows``) one per step, its GPUs' mean (the rows as they are
    where they do not say their step)."""
    means = _step_means(rows, _step_groups(b, STEP))
    return rows if means is None else means


def _rules_differ(base: Breakdown, cur: Breakdown) -> bool:
    """Whether the two sides' kernel classes came from other rules (extra ``--rules``, or
    another version's defaults), where both recorded theirs: a class holds other kernels."""
    options = [b.source.get("breakdown_options") for b in (base, cur)]
    return all(options) and any(options[0].get(k) != options[1].get(k)
                                for k in ("rules", "default_rules"))


def _class_times(path: str, label: str, base: Breakdown | None, base_type: str | None,
                 cur: Breakdown | None, cur_type: str | None, tol: Tolerances) -> list[Check]:
    """``class_us``: the kernel µs of each kernel class either side's layers of the type ran
    (0 in a layer without it), checked as ``kernel_us`` is: a small kernel twice as slow is
    a few percent of its layer, and one class's rise can hide behind another's fall."""
    if None in (base, cur, base_type, cur_type):
        return []
    classes = list(dict.fromkeys([*layer_classes(base.layers, base_type),
                                  *layer_classes(cur.layers, cur_type)]))
    if not classes:
        return []
    # one test a class: the type's classes share --alpha (a family of tests, as the layers)
    lowered = dataclasses.replace(tol, alpha=tol.alpha / len(classes))
    groups = [_step_groups(b, t) for b, t in ((base, base_type), (cur, cur_type))]
    other_rules = _rules_differ(base, cur)
    checks = []
    for kernel_class in classes:
        samples = [class_column(b.layers, kernel_class, t)
                   for b, t in ((base, base_type), (cur, cur_type))]
        if not all(v.size for v in samples):
            continue
        check = _time_check(path, label, "class_us", *samples, lowered,
                            *(_step_means(v, g) for v, g in zip(samples, groups, strict=True)))
        check.kernel_class = kernel_class
        check.alpha = lowered.alpha if len(classes) > 1 else None
        if other_rules and check.status in ("regression", "improvement", "noise"):
            check.status = "changed"
            check.detail = "other kernel-class rules: a class holds other kernels on each side"
        checks.append(check)
    return checks


def _layer_time(path: str, label: str, base: Breakdown | None, base_type: str | None,
                cur: Breakdown | None, cur_type: str | None, tol: Tolerances) -> list[Check]:
    """``layer_kernel_us``: the layer of the type (by its index in a step, held by both sides)
    whose median kernel µs over the steps rose most, tested over its steps at ``alpha``
    divided by the layers compared (the largest of many rises is chosen, not drawn). One
    layer of many twice as slow moves the type's median not at all. No check where the steps
    are too few for that test: the largest of many noisy ratios would pass for a regression."""
    if None in (base, cur, base_type, cur_type) or not all(_says_where(b) for b in (base, cur)):
        return []
    groups = [_by_index(b, t) for b, t in ((base, base_type), (cur, cur_type))]
    shared = sorted(groups[0].keys() & groups[1].keys())
    if len(shared) < 2:   # (one layer a step: the type's own check is this one)
        return []
    lowered = dataclasses.replace(tol, alpha=tol.alpha / len(shared))
    by_index = [[g[i] for i in shared] for g in groups]
    if not all(_testable(b, c, lowered) for b, c in zip(*by_index, strict=True)):
        return []
    rises = [float(np.median(c) - np.median(b)) for b, c in zip(*by_index, strict=True)]
    worst = int(np.argmax(rises))
    check = _time_check(path, label, "layer_kernel_us", by_index[0][worst],
                        by_index[1][worst], lowered)
    if rises[worst] <= 0:   # (the layer that rose most did not rise: none did; no test)
        check.status, check.p_value, check.tested_over = "ok", None, None
    check.layer_index, check.alpha = shared[worst], lowered.alpha
    if check.tested_over is not None:
        check.tested_over = "steps"   # (one layer a step: its samples are steps)
    return [check]


def _by_index(b: Breakdown, layer_type: str) -> dict[int, np.ndarray]:
    """Each layer index's kernel µs, one sample a step (its GPUs' mean), in step order."""
    index = layer_column(b.layers, "index", layer_type)
    step = layer_column(b.layers, "step", layer_type)
    if not index.size:
        return {}
    step = step - step.min()
    keys, inverse = np.unique(index * (int(step.max()) + 1) + step, return_inverse=True)
    inverse = inverse.ravel()
    us = layer_column(b.layers, "kernel_us", layer_type).astype(np.float64)
    means = np.bincount(inverse, weights=us) / np.bincount(inverse)
    of_index = keys // (int(step.max()) + 1)     # (keys sorted: by index, then step)
    heads, starts = np.unique(of_index, return_index=True)
    return dict(zip(heads.tolist(), np.split(means, starts[1:]), strict=True))


def device_pairs(base: Breakdown | None, cur: Breakdown | None
                 ) -> list[tuple[int | None, int | None]]:
    """The devices of a job of several (a TP job's one trace) whose layers ran there, where
    either side's ran on two or more and both say where: the baseline's and the run's paired
    in order of their ids (their ranks) where they are as many or on GPUs none of the other
    side's (a TP-4 job on GPUs 4-7 against one on 0-3, or of one GPU), else by id; a device
    of one side alone paired with None (a rank whose layers were lost, down to one); none
    otherwise."""
    if base is None or cur is None or not (_says_where(base) and _says_where(cur)):
        return []
    ours, theirs = layer_devices(base), layer_devices(cur)
    if max(len(ours), len(theirs)) < 2 or min(len(ours), len(theirs)) < 1:
        return []
    if len(ours) == len(theirs) or not set(ours) & set(theirs):
        return list(itertools.zip_longest(ours, theirs))
    return [(d if d in ours else None, d if d in theirs else None)
            for d in sorted({*ours, *theirs})]


def _by_device(b: Breakdown, layer_type: str, metric: str
               ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A type's (or the steps') figures on each device, and their mean per step there (what
    the test takes, as ``_step_means``)."""
    if layer_type == STEP:
        device = np.array([s["device"] for s in b.steps], np.float64)
        values = np.array([s[metric] for s in b.steps], np.float64)
        step = np.arange(len(b.steps))
    else:
        device = layer_column(b.layers, "device", layer_type).astype(np.float64)
        values = layer_column(b.layers, metric, layer_type).astype(np.float64)
        step = layer_column(b.layers, "step", layer_type)
    out = {}
    for d in np.unique(device[~np.isnan(device)]):   # (a stored row may lack its device)
        here = device == d
        out[int(d)] = (values[here], _step_means(
            values[here], np.unique(step[here], return_inverse=True)[1].ravel()))
    return out


def _device_checks(path: str, label: str, metric: str, base: Breakdown, base_type: str,
                   cur: Breakdown, cur_type: str, tol: Tolerances,
                   devices: list[tuple[int | None, int | None]], by_layers: bool
                   ) -> tuple[list[Check], bool]:
    """``METRIC_device``: each device's figures against its pair's (``device_pairs``), tested
    as ``_time_check`` tests the whole's, at ``alpha`` shared among the devices: one rank of
    eight slower by a fifth moves the figures over all of them by little or nothing. A device
    that ran the type on one side alone is ``missing`` (``new``), whatever its steps. The
    times of none where a device's steps are too few for the test at that alpha
    (``by_layers``, where the whole's are too: its layers), as the largest of several ratios no
    test decides would pass for a regression (``_shown_devices`` keeps each lost and one of
    the others). And whether the times were checked (False: devices on both sides whose steps
    are too few)."""
    shared = dataclasses.replace(tol, alpha=tol.alpha / len(devices))
    ours, theirs = _by_device(base, base_type, metric), _by_device(cur, cur_type, metric)
    pairs = [(b, c, ours.get(b, (None, None)), theirs.get(c, (None, None))) for b, c in devices]
    both = [(mine, other) for *_, mine, other in pairs
            if mine[0] is not None and other[0] is not None]
    timed = all(_testable(mine[1], other[1], shared)
                or (by_layers and _testable(mine[0], other[0], shared)) for mine, other in both)
    checks = []
    for base_device, cur_device, (base_s, base_steps), (cur_s, cur_steps) in pairs:
        if (base_s is None and cur_s is None) or (
                not timed and base_s is not None and cur_s is not None):
            continue
        check = _time_check(path, label, f"{metric}_device", base_s, cur_s, shared, base_steps,
                            cur_steps)
        check.device, check.baseline_device, check.alpha = cur_device, base_device, shared.alpha
        checks.append(check)
    return checks, timed or not both


# which device's check a type's shows: the first status of these there is, else the device
# whose figure moved most
DEVICE_SHOWN = ("regression", "new", "improvement")


def _shown_devices(checks: list[Check],
                   devices: dict[str, list[tuple[int | None, int | None]]]) -> list[Check]:
    """Each (path, type, metric)'s device checks, in the place of the first: each device
    the run lost its own (a rank lost is a failure of its own: a row, a headline item, a
    JUnit case), the others as one: the device that regressed most, else new, improved most,
    else moved most (tested against the spread first, where the baseline keeps one), its
    detail saying its rank, how the others' medians moved and which others regressed and so
    on, its ``others`` their checks."""
    groups: dict[tuple[str, str, str], list[Check]] = {}
    for c in checks:
        if c.metric in DEVICE_METRICS:
            groups.setdefault((c.path, c.layer_type, c.metric), []).append(c)
    out = []
    for c in checks:
        if c.metric not in DEVICE_METRICS:
            out.append(c)
        elif (group := groups.pop((c.path, c.layer_type, c.metric), None)) is not None:
            for lost in (d for d in group if d.status == "missing"):
                lost.detail = _device_said(lost, devices[c.path]) + " ran none of these in the run"
                out.append(lost)
            if ran := [d for d in group if d.status != "missing"]:
                out.append(_shown_device(ran, devices[c.path]))
    return out


def _device_said(check: Check, devices: list[tuple[int | None, int | None]]) -> str:
    """``device 6, rank 2 of 4``: a device check's device and, where they differ, its rank:
    its place among its side's devices (the run's, or the baseline's for one the run lost;
    pairs by id are the union of both sides')."""
    device = check.device if check.device is not None else check.baseline_device
    side = [pair[check.device is not None] for pair in devices
            if pair[check.device is not None] is not None]
    rank = side.index(device)
    return (f"device {device} of {len(side)}" if device == rank
            else f"device {device}, rank {rank} of {len(side)}") + (
        f" (the baseline's device {check.baseline_device})"
        if None not in (check.device, check.baseline_device)
        and check.device != check.baseline_device else "")


def _shown_device(group: list[Check], devices: list[tuple[int | None, int | None]]
                  ) -> Check:
    def rise(c: Check) -> float:
        return math.inf if c.change is None else c.change

    shown = next((pick(at, key=rise) for status in DEVICE_SHOWN
                  if (at := [c for c in group if c.status == status])
                  for pick in [min if status == "improvement" else max]),
                 None) or max(group, key=lambda c: abs(rise(c)))
    said = _device_said(shown, devices)
    if shown.status == "new":
        said += " ran none of these in the baseline"
    if moved := [c.change for c in group if c is not shown and c.change is not None]:
        low, high = (f"{x:+.1%}".replace("-0.0%", "+0.0%") for x in (min(moved), max(moved)))
        said += f"; the others' medians moved {low}" + (f" to {high}" if high != low else "")
    for status in DEVICE_SHOWN:   # (the others the one shown stands for)
        if also := [c.device for c in group if c is not shown and c.status == status]:
            said += f"; {status} too: device{'s' if len(also) > 1 else ''} " + ", ".join(
                map(str, also))
    shown.detail = said + (f"; {shown.detail}" if shown.detail else "")
    shown.others = [c for c in group if c is not shown]
    return shown


def _kernel_count_check(path: str, layer_type: str, metric: str, base: np.ndarray | None,
                        cur: np.ndarray | None, stat) -> Check:
    if (lacking := _lacking(path, layer_type, metric, base, cur, stat)) is not None:
        return lacking
    b, c = float(stat(base)), float(stat(cur))
    status = "regression" if c > b else "improvement" if c < b else "ok"
    return Check(path, layer_type, metric, b, c, _change(b, c), None, status)


def _testable(base: np.ndarray | None, cur: np.ndarray | None, tol: Tolerances) -> bool:
    """Whether the exact test can reach ``alpha``: its smallest p (all of one side above
    all of the other) is 1 / C(n+m, n)."""
    if base is None or cur is None or min(base.size, cur.size) < tol.min_samples:
        return False
    return can_reach(base.size, cur.size, tol.alpha)


def _mean_check(path: str, layer_type: str, base: np.ndarray | None, cur: np.ndarray | None,
                tol: Tolerances) -> Check | None:
    """``span_us_mean``: the mean of the steps' spans (``base``, ``cur``: each step's, its
    GPUs' mean). A regression where it rose by more than the tolerances and a one-sided
    permutation test of the difference of means gives p < ``alpha``; None without steps
    enough for that test (one stalled step in few would fail on its ratio alone), or where
    the splits of the steps are too many to take all and ``alpha`` too small for the
    resamples to reach."""
    if not _testable(base, cur, tol):
        return None
    resamples = max(MEAN_TEST_RESAMPLES, math.ceil(20 / tol.alpha))
    splits = math.lgamma(base.size + cur.size + 1) - math.lgamma(base.size + 1) \
        - math.lgamma(cur.size + 1)
    if resamples > MEAN_TEST_MOST_RESAMPLES and splits > math.log(MEAN_TEST_MOST_RESAMPLES):
        return None
    b, c = float(np.mean(base)), float(np.mean(cur))
    change = _change(b, c)
    if abs(c - b) <= max(tol.rel_tol * b, tol.abs_tol_us):
        return Check(path, layer_type, "span_us_mean", b, c, change, None, "ok")
    from scipy.stats import permutation_test

    worse = c > b
    p_value = float(permutation_test(
        (cur, base), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
        vectorized=True, n_resamples=resamples,
        batch=max(1, MEAN_TEST_BATCH_VALUES // (base.size + cur.size)),
        alternative="greater" if worse else "less", rng=np.random.default_rng(0)).pvalue)
    status = "noise" if p_value >= tol.alpha else "regression" if worse else "improvement"
    return Check(path, layer_type, "span_us_mean", b, c, change, p_value, status,
                 tested_over="steps")


def _time_check(path: str, layer_type: str, metric: str, base: np.ndarray | None,
                cur: np.ndarray | None, tol: Tolerances, base_steps: np.ndarray | None = None,
                cur_steps: np.ndarray | None = None) -> Check:
    """``base``/``cur``: the samples whose medians are compared (a type's layers, or the
    steps); ``base_steps``/``cur_steps``: a type's mean layer per step, what the test takes
    where there are steps enough."""
    if (lacking := _lacking(path, layer_type, metric, base, cur)) is not None:
        return lacking
    b, c = float(np.median(base)), float(np.median(cur))
    change = _change(b, c)
    if abs(c - b) <= max(tol.rel_tol * b, tol.abs_tol_us):
        return Check(path, layer_type, metric, b, c, change, None, "ok")
    worse = c > b
    p_value = over = None
    samples = ((base_steps, cur_steps, "steps") if _testable(base_steps, cur_steps, tol)
               else (base, cur, "steps" if layer_type == STEP else "layers"))
    if _testable(samples[0], samples[1], tol):
        test_base, test_cur, over = samples
        p_value = u_test(test_cur, test_base, worse)
        if p_value >= tol.alpha:
            return Check(path, layer_type, metric, b, c, change, p_value, "noise",
                         tested_over=over)
    return Check(path, layer_type, metric, b, c, change, p_value,
                 "regression" if worse else "improvement", tested_over=over)
