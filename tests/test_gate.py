"""The regression gate: synthetic breakdowns with known changes, the CLI's exit codes, and
this repository's own CPU baseline (traces/baselines/tiny-cpu.json)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf import render
from kimi_perf.classify import Rule, load_rules
from kimi_perf.cli import EXAMPLE_TRACE, main
from kimi_perf.errors import TraceError
from kimi_perf.gate import Tolerances, gate, gate_files, spread_of_runs, update_baseline
from kimi_perf.layer_breakdown import Breakdown, breakdown
from kimi_perf.readers import read_trace
from kimi_perf.render import gate_headline
from kimi_perf.runs import load_run, run_differences, run_spread_problem
from kimi_perf.trace import Trace, json_text
from tests.conftest import KINETO, NSYS, REPO
from tests.synth import TraceBuilder
from tests.test_layers import k3_like, nvtx_decode_trace

BASELINE = REPO / "traces" / "baselines" / "tiny-cpu.json"


def _breakdown(kernels: dict[str, int], us: dict[str, np.ndarray]) -> Breakdown:
    """Layers of each type with the given kernel count and per-layer µs samples."""
    layers, steps = [], []
    for layer_type, samples in us.items():
        layers += [{"type": layer_type, "kernels": kernels[layer_type], "kernel_us": float(v),
                    "span_us": float(v) * 1.01} for v in samples]
    for i in range(4):
        total = sum(float(np.median(v)) for v in us.values())
        steps.append({"index": i, "kernels": sum(kernels.values()), "kernel_us": total,
                      "span_us": total})
    return Breakdown(source={}, steps=steps, layers=layers,
                     layer_types=[{"type": t} for t in us])


def _run(kernels, us):
    return {"specialized": _breakdown(kernels, us)}


RNG = np.random.default_rng(0)
KDA = RNG.normal(60.0, 1.5, 40)
MLA = RNG.normal(80.0, 2.0, 12)


def statuses(result) -> dict[tuple[str, str], str]:
    return {(c.layer_type, c.metric): c.status for c in result.checks}


def test_same_run_passes():
    run = _run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    result = gate(run, run)
    assert result.ok and {c.status for c in result.checks} == {"ok"}
    # kernels (median and largest), kernel_us, span_us per type, and per step
    assert len(result.checks) == 2 * 4 + 4


def test_a_cpu_runs_times_are_left_out_unless_named():
    """Two CPU runs of the same code differ in CPU time by more than any tolerance: by
    default their ops alone are checked (a slower CPU run passes, an op more fails), and
    naming the metrics checks the times too. A GPU run's times are checked by default."""
    def cpu(kernels, us):
        run = _run(kernels, us)
        run["specialized"].source["ops"] = "cpu-ops"
        return run

    base = cpu({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    slower = cpu({"kda": 9, "mla": 12}, {"kda": KDA * 1.5, "mla": MLA})
    result = gate(base, slower)
    assert result.ok and {c.metric for c in result.checks} == {"kernels", "kernels_max"}
    assert result.cpu_times_left_out == ["kernel_us", "span_us"]
    assert result.cpu_time_metrics == [] and "launches only" in render.gate_table(result).title
    more = gate(base, cpu({"kda": 10, "mla": 12}, {"kda": KDA, "mla": MLA}))
    assert statuses(more)[("kda", "kernels")] == "regression" and not more.ok
    named = gate(base, slower, Tolerances(metrics="kernels,kernel_us,span_us"))
    assert statuses(named)[("kda", "kernel_us")] == "regression" and not named.ok
    assert named.cpu_time_metrics == ["kernel_us", "span_us"] and not named.cpu_times_left_out
    gpu = gate(_run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA}),
               _run({"kda": 9, "mla": 12}, {"kda": KDA * 1.5, "mla": MLA}))
    assert statuses(gpu)[("kda", "kernel_us")] == "regression" and not gpu.cpu_times_left_out
    # a path the run lacks is missing, not a CPU run whose times were left out
    lost = gate(base, {"standard": slower["specialized"]})
    assert lost.cpu_times_left_out == [] and not lost.ok
    # the default is no metrics named: kept so through replace() and a JSON round trip
    import dataclasses

    tol = dataclasses.replace(Tolerances(), alpha=0.001)
    assert not tol.cpu_times and tol.checked == ("kernels", "kernel_us", "span_us")
    assert Tolerances(**result.to_json()["tolerances"]) == Tolerances()
    assert result.to_json()["tolerances"]["metrics"] is None


def test_a_launch_outside_every_layer_fails_at_the_step():
    """A kernel added to a step's prologue or epilogue is in no layer type: the step's kernel
    count catches it."""
    base = _run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    run = _run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    for step in run["specialized"].steps:
        step["kernels"] += 1
    result = gate(base, run)
    assert [(c.layer_type, c.metric) for c in result.failures] == [("step", "kernels"),
                                                                   ("step", "kernels_max")]


def test_an_automatic_layer_type_with_another_kernel_sequence_is_noted():
    """Letters (A, B, ...) of types found by the repeating pattern follow the order of first
    appearance: where the kernel sequences behind a letter differ, the gate says so."""
    base = _run({"A": 9}, {"A": KDA})
    run = _run({"A": 9}, {"A": KDA})
    base["specialized"].layer_types[0]["pattern"] = "0123456789ab"
    run["specialized"].layer_types[0]["pattern"] = "ba9876543210"
    result = gate(base, run)
    assert result.ok and statuses(result)[("A", "pattern")] == "changed"
    run["specialized"].layer_types[0]["pattern"] = "0123456789ab"
    assert ("A", "pattern") not in statuses(gate(base, run))


def _automatic(kernels, us, digests, names=None):
    """Types found by the kernel pattern: each with its digest, its layer count, and a
    typical layer of ``names[type]`` (default: kernels named after the digest)."""
    run = _run(kernels, us)
    b = run["specialized"]
    for t in b.layer_types:
        kind = t["type"]
        sequence = (names or {}).get(kind) or [f"{digests[kind]}.{i}" for i in range(kernels[kind])]
        t.update(pattern=digests[kind], layers=sum(r["type"] == kind for r in b.layers),
                 typical_layer={"layers": 1, "kernels": [
                     {"name": n, "class": "gemm", "us": 1.0} for n in sequence]})
    return run


def test_automatic_layer_types_pair_by_their_kernel_sequence_whatever_their_letters():
    """A type the run finds first takes the letter A: the baseline's A is compared with the
    run's type of the same kernel sequence, here B, and a slower one still fails."""
    base = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p-kda", "B": "p-mla"})
    run = _automatic({"A": 4, "B": 9, "C": 12}, {"A": KDA / 10, "B": KDA, "C": MLA * 1.5},
                     {"A": "p-new", "B": "p-kda", "C": "p-mla"})
    result = gate(base, run)
    by_check = {(c.layer_type, c.metric): c for c in result.checks}
    assert by_check[("A", "kernels")].status == "ok"
    assert by_check[("A", "kernels")].run_layer_type == "B"
    assert [(c.layer_type, c.run_layer_type, c.metric) for c in result.failures
            if c.layer_type != "step"] == [("B", "C", "kernel_us"), ("B", "C", "span_us")]
    assert by_check[("A", "kernels")].current == 9 and ("A", "pattern") not in by_check
    new = [c for c in result.checks if c.status == "new"]
    assert {(c.layer_type, c.run_layer_type) for c in new} == {("-", "A")}
    table = render.tables_text([render.gate_table(result)])
    assert "B (run: C)" in table and "- (run: A)" in table


KERNELS = [f"k{i}" for i in range(21)]


def test_a_changed_automatic_layer_type_does_not_fail_but_its_steps_do():
    """Where the pattern splits a step elsewhere, kernels move from one letter to another
    (what A gains, B loses): those checks are shown as changed, not failed; a type of at most
    one layer a step that the run lacks too. The steps still fail on more kernels."""
    base = _automatic({"A": 9, "B": 12, "C": 3}, {"A": KDA, "B": MLA, "C": KDA[:4]},
                      {"A": "p1", "B": "p2", "C": "p3"},
                      {"A": KERNELS[:9], "B": KERNELS[9:], "C": ["c0", "c1", "c2"]})
    run = _automatic({"A": 12, "B": 9}, {"A": KDA * 2, "B": MLA / 2}, {"A": "p4", "B": "p5"},
                     {"A": KERNELS[:12], "B": KERNELS[12:]})
    result = gate(base, run)
    assert result.ok
    assert {(c.layer_type, c.metric, c.status) for c in result.checks
            if c.layer_type != "step" and c.status != "ok"} >= {
        ("A", "pattern", "changed"), ("A", "kernels", "changed"), ("A", "kernel_us", "changed"),
        ("C", "kernels", "changed")}
    # why, said once a type (its first check)
    said = [(c.layer_type, c.detail) for c in result.checks
            if c.detail and c.detail.startswith("the kernel pattern")]
    assert said == [(t, why) for t, why in (
        ("A", "the kernel pattern started its layers elsewhere: the kernels this type's typical "
              "layer lost, others gained; added k9, k10, k11"),
        ("B", "the kernel pattern started its layers elsewhere: the kernels this type's typical "
              "layer lost, others gained; removed k9, k10, k11"),
        ("C", "the kernel pattern found none in the run, where the baseline held no more of "
              "them than steps: an edge of the pattern"))]
    # one kernel each way, as many kernels at the same speed: only the pattern checks change,
    # and say why
    swapped = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p3", "B": "p4"},
                         {"A": [*KERNELS[:8], "k9"], "B": ["k8", *KERNELS[10:]]})
    base_ab = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p1", "B": "p2"},
                         {"A": KERNELS[:9], "B": KERNELS[9:]})
    assert [(c.layer_type, c.detail) for c in gate(base_ab, swapped).checks
            if c.status == "changed"] == [
        (t, "the kernel pattern started its layers elsewhere: the kernels this type's typical "
            f"layer lost, others gained; {said}")
        for t, said in (("A", "added k9; removed k8"), ("B", "added k8; removed k9"))]
    # a type of two layers a step the run lacks, its steps holding as many layers: changed too
    two_a_step = _automatic({"A": 9, "B": 12, "C": 3}, {"A": KDA, "B": MLA, "C": KDA[:8]},
                            {"A": "p1", "B": "p2", "C": "p3"},
                            {"A": KERNELS[:9], "B": KERNELS[9:], "C": ["c0", "c1", "c2"]})
    others = _automatic({"A": 12, "B": 9}, {"A": KDA, "B": KDA[:20]}, {"A": "p1", "B": "p2"},
                        {"A": KERNELS[:9], "B": KERNELS[9:]})
    for side in (two_a_step, others):
        for step in side["specialized"].steps:
            step["layers"] = 15
    first = next(c for c in gate(two_a_step, others).checks if c.layer_type == "C")
    assert (first.status, first.detail) == ("changed", "the kernel pattern found none in the "
                                            "run, whose steps hold as many layers: its layers "
                                            "went to other types")
    for step in run["specialized"].steps:
        step["kernels"] = 9 + 12 + 3 + 1   # one more than the baseline's steps
    assert [(c.layer_type, c.metric) for c in gate(base, run).failures] == [
        ("step", "kernels"), ("step", "kernels_max")]
    # a run that lost its layers altogether has lost them: that fails
    run["specialized"].layer_types, run["specialized"].layers = [], []
    assert {c.layer_type for c in gate(base, run).failures} >= {"A", "B", "C"}


def test_kernels_that_did_not_just_move_between_letters_fail():
    """A unfused into two kernels (and twice as slow) while B fused two into one: the step
    keeps its kernel count, but what A gained is not what B lost, so A fails."""
    base = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p1", "B": "p2"},
                      {"A": KERNELS[:9], "B": KERNELS[9:]})
    run = _automatic({"A": 10, "B": 11}, {"A": KDA * 2, "B": MLA}, {"A": "p3", "B": "p4"},
                     {"A": [*KERNELS[:8], "k8a", "k8b"], "B": ["k9_10", *KERNELS[11:]]})
    failed = {(c.layer_type, c.metric) for c in gate(base, run).failures}
    assert {("A", "kernels"), ("A", "kernel_us")} <= failed


def test_an_automatic_layer_type_with_another_kernel_of_one_count_still_fails():
    """Another kernel picked for a layer (an autotuner's other GEMM): a new digest but the
    same kernel count, so no boundary moved: a slower layer fails as ever."""
    base = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p1", "B": "p2"})
    run = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA * 1.09}, {"A": "p1", "B": "p3"})
    result = gate(base, run)
    assert statuses(result)[("B", "pattern")] == "changed"
    assert [(c.layer_type, c.metric) for c in result.failures
            if c.layer_type != "step"] == [("B", "kernel_us"), ("B", "span_us")]


def test_reordered_kernels_of_a_slower_layer_type_still_fail():
    """The same kernels in another order (a new digest, but no kernel gained or lost): no
    boundary moved, so a layer type 30% slower fails as ever rather than show as changed."""
    base = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p1", "B": "p2"},
                      {"A": KERNELS[:9], "B": KERNELS[9:]})
    swapped = [KERNELS[1], KERNELS[0], *KERNELS[2:9]]
    run = _automatic({"A": 9, "B": 12}, {"A": KDA * 1.3, "B": MLA}, {"A": "p3", "B": "p2"},
                     {"A": swapped, "B": KERNELS[9:]})
    result = gate(base, run)
    assert statuses(result)[("A", "pattern")] == "changed"
    assert not result.ok
    assert [(c.layer_type, c.metric, c.status) for c in result.failures
            if c.layer_type != "step"] == [("A", "kernel_us", "regression"),
                                           ("A", "span_us", "regression")]


def test_the_relative_threshold_is_where_it_says():
    """40 layers a side, every one slower by the same factor: 4.9% passes (under the
    threshold, no test needed), 5.1% fails (past it, and the U test finds the shift)."""
    base = _run({"kda": 9}, {"kda": KDA})
    for factor, status in ((1.049, "ok"), (1.051, "regression")):
        result = gate(base, _run({"kda": 9}, {"kda": KDA * factor}))
        assert statuses(result)[("kda", "kernel_us")] == status, factor
    wider = gate(base, _run({"kda": 9}, {"kda": KDA * 1.051}), Tolerances(rel_tol=0.052))
    assert statuses(wider)[("kda", "kernel_us")] == "ok"


def test_an_automatic_layer_type_lost_with_layers_fails():
    """A pattern type of several layers a step that the run lacks, with fewer layers per
    step in the run: lost, not relabelled."""
    base = _automatic({"A": 9, "B": 12}, {"A": KDA, "B": MLA}, {"A": "p1", "B": "p2"})
    run = _automatic({"A": 9}, {"A": KDA}, {"A": "p1"})
    for b, layers in ((base, 13), (run, 10)):
        for step in b["specialized"].steps:
            step["layers"] = layers
    assert {(c.layer_type, c.status) for c in gate(base, run).failures} >= {("B", "missing")}
    for step in run["specialized"].steps:
        step["layers"] = 13   # as many layers: B's went to A under the pattern's new split
    assert ("B", "missing") not in {(c.layer_type, c.status) for c in gate(base, run).checks}


def _in_steps(run: dict, layers_a_step: int) -> None:
    """Place the synthetic layers in four steps of one device, as a breakdown does, each
    step of the same work (its kernels, its µs)."""
    b = run["specialized"]
    seen: dict[str, int] = {}
    for row in b.layers:
        i = seen.get(row["type"], 0)
        seen[row["type"]] = i + 1
        row["step"], row["device"] = i % 4, 0
    for step in b.steps:
        step.update(device=0, layers=layers_a_step, kernels=27, kernel_us=180.0, span_us=181.0)


def test_layers_the_pattern_types_otherwise_are_no_failure():
    """An edge layer that is a letter of its own in the baseline and of the commoner letter in
    the run (or the reverse): the steps hold as many layers, so the letter that gained or lost
    it is changed, not a failure; a step that lost a layer still fails."""
    base = _automatic({"A": 9, "B": 9}, {"A": KDA[:8], "B": KDA[8:12]}, {"A": "p1", "B": "p2"})
    run = _automatic({"A": 9}, {"A": KDA[:12]}, {"A": "p1"})
    _in_steps(base, 3)
    _in_steps(run, 3)
    for x, y in ((base, run), (run, base)):
        result = gate(x, y)
        assert result.ok, result.failures
        (a,) = [c for c in result.checks if (c.layer_type, c.metric) == ("A", "layers")]
        assert a.status == "changed" and "as many a step" in a.detail
    _in_steps(run, 2)       # (two layers a step hold its twelve: one lost a step)
    assert {(c.layer_type, c.metric) for c in gate(base, run).failures} >= {("step", "layers")}


def test_gate_of_a_real_before_and_after_pair_with_blocks_cut_elsewhere():
    """Two training traces whose windows cut the DiT blocks elsewhere: the blocks (A) hold
    the same cycle of kernels, begun 8 kernels apart, so they are the same layer and checked
    as such: a block spans 13.8% more (16,724 -> 19,030 µs; the spacing of its >1 ms attention
    kernels says the same: 16.7 -> 19.0 ms), with its kernels' µs flat and the rise idle time
    between them. That fails. The edge blocks (B, C: one each) are the baseline's only: the
    pattern's split, changed. Each device is one step, the profiler's window of about 299 ms,
    holding 17 blocks before and 15 after: their kernels do not compare, changed too (they
    read as a 10.7% "improvement")."""
    before, after = (NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}.sqlite"
                     for x in ("before", "after"))
    result = CliRunner().invoke(main, ["gate", str(before), str(after), "--format", "json"])
    assert result.exit_code == 1, result.output
    checks = {(c["layer_type"], c["metric"]): c for c in json.loads(result.output)["checks"]}
    assert [k for k, c in checks.items() if c["status"] == "regression"] == [
        ("A", "span_us"), ("A", "span_us_device")]
    # each of the two devices is slower: the one slower most shown, the other's rise said
    device = checks[("A", "span_us_device")]
    assert (device["device"], device["baseline_device"]) == (0, 0) and device["change"] > 0.13
    assert re.fullmatch(r"device 0 of 2; the others' medians moved \+1\d\.\d%; regression "
                        "too: device 1", device["detail"])
    span = checks[("A", "span_us")]
    # against the export itself: the median spacing of the blocks' >1 ms attention kernels
    spacing = [_long_kernel_spacing_us(trace) for trace in (before, after)]
    assert spacing[1] / spacing[0] > 1.08
    for stored, apart in zip((span["baseline"], span["current"]), spacing, strict=True):
        assert abs(stored / apart - 1) < 0.05, (stored, apart)
    assert span["p_value"] < 1e-5 and "idle between kernels +" in span["detail"]
    assert "pattern" not in {m for t, m in checks if t == "A"}   # the same cycle
    assert checks[("A", "kernel_us")]["status"] == "ok"
    assert {t for (t, _), c in checks.items() if c["status"] == "changed"} == {"A", "B", "C",
                                                                            "step"}
    assert checks[("step", "kernels")]["detail"] == (
        "each device is one step, the profiler's window: 17 layers a step in the baseline, 15 "
        "in the run")
    # windows of other work: their layers a step do not compare either, the blocks' included
    # (each row says its own count), nor does any step check: a window's span is the window's
    assert checks[("A", "layers")]["status"] == checks[("step", "layers")]["status"] == "changed"
    assert checks[("A", "layers")]["detail"] == (
        "each device is one step, the profiler's window: 16 of these a step in the baseline, 15 "
        "in the run (17 and 15 layers in all)")
    assert {c["status"] for (t, _), c in checks.items() if t == "step"} == {"changed"}
    assert abs(checks[("step", "span_us")]["change"]) < 1e-4   # (299,255 against 299,260 µs)
    back = CliRunner().invoke(main, ["gate", str(after), str(before)])
    assert back.exit_code == 0, back.output


def test_gate_writes_its_verdict_to_a_file_or_nothing(tmp_path):
    """`gate -o FILE`: the verdict a CI job keeps, the JSON or the table as text, written
    whole (exit 1 on a regression all the same); where the gate cannot run (exit 2), no file,
    not an empty one for the job to choke on."""
    before, after = (NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}.sqlite"
                     for x in ("before", "after"))
    out = tmp_path / "gate.json"
    result = CliRunner().invoke(main, ["gate", str(before), str(after), "--format", "json",
                                       "-o", str(out)])
    # stdout empty; the log still gets the verdict's last line, and where the rest is
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("gate: FAIL, 2 regressions: trace A span_us 16,724 -> "
                                    "19,030") and result.stderr.endswith(f" (in {out})\n")
    said = CliRunner().invoke(main, ["gate", str(before), str(after), "--format", "json"])
    doc = json.loads(out.read_text())
    assert doc == json.loads(said.output)
    # what a CI job reads without knowing the statuses: which checks fail, and what was gated
    assert doc["failed"] == sum(c["fails"] for c in doc["checks"]) == 2
    assert [c["status"] for c in doc["checks"] if c["fails"]] == ["regression"] * 2
    assert doc["headline"] == result.stderr.removesuffix(f" (in {out})\n")
    assert (doc["baseline_file"], doc["run_file"]) == (str(before), str(after))
    text = tmp_path / "gate.txt"
    result = CliRunner().invoke(main, ["gate", str(before), str(after), "-o", str(text)])
    assert result.exit_code == 1 and result.stdout == ""
    # a file that cannot be written: said, and no verdict line naming it
    unwritable = CliRunner().invoke(main, ["gate", str(before), str(after), "-o",
                                           "/proc/gate.json"])
    assert unwritable.exit_code == 2 and "gate:" not in unwritable.stderr, unwritable.stderr
    lines = text.read_text().splitlines()
    assert lines[-1].startswith("gate: FAIL, 2 regressions") and any(
        "span_us" in line for line in lines)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    missing = tmp_path / "never.json"
    result = CliRunner().invoke(main, ["gate", str(broken), str(after), "--format", "json",
                                       "-o", str(missing)])
    assert result.exit_code == 2 and not missing.exists()
    # last night's verdict is not left for the job to read as tonight's, whatever stopped
    # the gate: an input, or an option
    for args in ([str(before), str(broken)], [str(before), str(tmp_path / "gone.sqlite")],
                 [str(before), str(after), "--metrics", "bogus"],
                 [str(BASELINE), str(BASELINE), "--layers", "8"]):
        assert out.is_file()
        result = CliRunner().invoke(main, ["gate", *args, "--format", "json", "-o", str(out)])
        assert result.exit_code == 2 and not out.exists(), result.output
        CliRunner().invoke(main, ["gate", str(before), str(after), "-o", str(out)])
    # the table's verdict line is one line, however long, in the file and on stdout
    assert lines[-1] == doc["headline"] and len(lines[-1]) > 100
    said = CliRunner().invoke(main, ["gate", str(before), str(after)], env={"COLUMNS": "60"})
    assert said.stdout.splitlines()[-1] == lines[-1]
    result = CliRunner().invoke(main, ["gate", str(before), str(after), "-o", str(before),
                                       "--format", "json"])   # (a trace's name: never -o)
    assert result.exit_code == 2 and "a trace's name, not what this command writes" in \
        result.output
    # with --update: -o checked before the baseline is stored (not the baseline itself, not
    # into a folder that is not there); a baseline created says so in the verdict file too
    stored = tmp_path / "base.json"
    result = CliRunner().invoke(main, ["gate", "--update", str(stored), str(BASELINE), "-o",
                                       str(stored), "--format", "json"])
    assert result.exit_code == 2 and "is the baseline" in result.output
    assert not stored.exists()
    result = CliRunner().invoke(main, ["gate", "--update", str(stored), str(BASELINE), "-o",
                                       str(tmp_path / "nowhere" / "gate.txt")])
    assert result.exit_code == 2 and "no such directory" in result.output
    assert not stored.exists()
    verdict = tmp_path / "verdict.txt"
    result = CliRunner().invoke(main, ["gate", "--update", str(stored), str(BASELINE), "-o",
                                       str(verdict)])
    assert result.exit_code == 0 and stored.exists()
    assert verdict.read_text() == f"baseline {stored} created from {BASELINE}\n"
    # and stderr says where the verdict went, as a gate's line does
    assert result.stderr == f"baseline {stored} created from {BASELINE} (in {verdict})\n"


def test_gate_writes_junit_for_a_ci_servers_test_report(tmp_path):
    """`--junit FILE`: a test case per check (PATH.TYPE and the metric, unique, so that a CI
    server follows each check night to night), the failing ones failures of their status
    with what is behind them, the files and tolerances as properties and the whole table as
    the suite's output; written beside the usual verdict (exit 1 all the same), removed
    where the gate cannot run, and never over an input or -o's file."""
    import xml.etree.ElementTree as ET

    before, after = (NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}.sqlite"
                     for x in ("before", "after"))
    junit, out = tmp_path / "gate.xml", tmp_path / "gate.json"
    result = CliRunner().invoke(main, ["gate", str(before), str(after), "--junit", str(junit),
                                       "--format", "json", "-o", str(out)])
    assert result.exit_code == 1, result.output
    doc = json.loads(out.read_text())
    suites = ET.parse(junit).getroot()
    (suite,) = suites.findall("testsuite")
    cases = suite.findall("testcase")
    assert suites.get("tests") == suite.get("tests") == str(len(doc["checks"])) == str(len(cases))
    assert suites.get("failures") == suite.get("failures") == str(doc["failed"]) == "2"
    names = [(case.get("classname"), case.get("name")) for case in cases]
    assert len(set(names)) == len(names) and ("trace.A", "kernel_us (gemm)") in names
    failed = [(case.get("classname"), case.get("name"), case.find("failure"))
              for case in cases if case.find("failure") is not None]
    ((where, metric, failure), (_, each_device, _)) = failed
    assert each_device == "span_us (each device)"   # (device 0's, named alike every night)
    check = next(c for c in doc["checks"] if c["fails"])
    assert (where, metric) == (f"{check['path']}.{check['layer_type']}", check["metric"])
    assert failure.get("type") == "regression" and failure.text == check["detail"]
    assert failure.get("message").startswith("regression: 16,724 -> 19,030 (+13.8%, p ")
    # a check that passes with news (noise, changed) says so in its own output
    noisy = next(case for case in cases if case.get("name") == "kernel_us (communication)")
    assert noisy.find("system-out").text.startswith("noise: 434.7 -> 396.8 (-8.7%, p 0.64")
    plain = next(case for case in cases if case.get("name") == "kernel_us (gemm)")
    assert len(plain) == 0
    said = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert (said["baseline"], said["run"], said["rel_tol"]) == (str(before), str(after), "0.05")
    assert suite.find("system-out").text.splitlines()[-1] == doc["headline"]
    # the gate cannot run: last night's XML goes, as -o's verdict does
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    result = CliRunner().invoke(main, ["gate", str(before), str(broken), "--junit", str(junit)])
    assert result.exit_code == 2 and not junit.exists()
    both = str(tmp_path / "verdict.txt")
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nclass = "mine"\npattern = "gemm"\n')
    for args, problem in (([str(before), str(after), "-o", both, "--junit", both],
                           "is -o's file too"),
                          ([str(before), str(after), "--junit", str(before)],
                           "a trace's name, not what --junit writes"),
                          ([str(before), str(after), "--rules", str(rules), "--junit",
                            str(rules)], "is an input of this command"),
                          ([str(before), str(after), "--junit", "-"], "not - (-o - is"),
                          ([str(before), str(after), "--junit", str(tmp_path / "no" / "x.xml")],
                           "no such directory")):
        result = CliRunner().invoke(main, ["gate", *args])
        assert result.exit_code == 2 and problem in result.output, result.output
    assert before.is_file()
    # a first run: stored, a suite of no checks that says so
    stored = tmp_path / "base.json"
    result = CliRunner().invoke(main, ["gate", "--update", str(stored), str(BASELINE),
                                       "--junit", str(junit)])
    assert result.exit_code == 0 and stored.exists()
    suite = ET.parse(junit).getroot().find("testsuite")
    # (one passing case: a CI server fails a report of no tests)
    (case,) = suite.findall("testcase")
    said = f"baseline {stored} created from {BASELINE}"
    assert (case.get("classname"), case.get("name"), suite.get("tests")) == (
        "baseline", "stored", "1")
    assert case.find("system-out").text == suite.find("system-out").text == said
    # a verdict file that cannot be written stops the gate before --update stores anything,
    # and an earlier verdict beside it goes, whichever file stopped it
    stored_bytes = stored.read_bytes()
    (tmp_path / "dir").mkdir()
    for args, problem in ((["--junit", str(tmp_path / "dir")], "it is a directory"),
                          (["-o", str(tmp_path / "dir"), "--junit", str(junit)],
                           "it is a directory"),
                          (["-o", str(tmp_path / "no" / "g.json"), "--junit", str(junit)],
                           "no such directory")):
        junit.write_text("last night's")
        result = CliRunner().invoke(main, ["gate", "--update", str(stored), str(after),
                                           *args])
        assert result.exit_code == 2 and problem in result.output, result.output
        assert stored.read_bytes() == stored_bytes and (tmp_path / "dir").is_dir()
        assert junit.exists() == (str(junit) not in args)   # (removed where it was given)
    link = tmp_path / "link.txt"
    link.symlink_to(junit)
    result = CliRunner().invoke(main, ["gate", str(stored), str(BASELINE), "-o", str(link),
                                       "--junit", str(junit)])
    assert result.exit_code == 2 and "is -o's file too" in result.output
    for update in ([], ["--update"]):   # gated, and gated then stored
        junit.unlink(missing_ok=True)
        result = CliRunner().invoke(main, ["gate", *update, str(stored), str(BASELINE),
                                           "--junit", str(junit)])
        assert result.exit_code == 0, result.output
        suite = ET.parse(junit).getroot().find("testsuite")
        assert int(suite.get("tests")) > 0 and suite.get("failures") == "0"


def test_a_baseline_keeps_the_tolerances_it_was_stored_with(tmp_path):
    """`gate --update` with tolerances stores them with the run: the nightly gates against it
    use them without repeating the options (a job that forgot --rel-tol 0.2 failed), an
    option given overrides its own setting alone, a later --update keeps them, and the
    verdict says which it used; what a baseline keeps is checked as it is read."""
    before, after = (NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}.sqlite"
                     for x in ("before", "after"))
    stored = tmp_path / "base.json"
    made = CliRunner().invoke(main, ["gate", "--update", str(stored), str(before),
                                     "--rel-tol", "0.2"])
    assert made.exit_code == 0, made.output
    kept = {"rel_tol": 0.2, "abs_tol_us": 1.0, "alpha": 0.01}
    assert json.loads(stored.read_text())["gate_tolerances"] == kept
    # the +13.8% span that fails at 5% passes at the 20% the baseline keeps
    said = CliRunner().invoke(main, ["gate", str(stored), str(after)])
    assert said.exit_code == 0, said.output
    text = " ".join(said.output.split())
    assert "tolerances the baseline keeps (gate --update stored them): rel_tol 0.2, " \
        "abs_tol_us 1.0, alpha 0.01 (--rel-tol, --abs-tol, --alpha, --metrics given " \
        "override them)" in text
    assert "(time: > 20% and 1 µs" in text
    strict = CliRunner().invoke(main, ["gate", str(stored), str(after), "--rel-tol", "0.05",
                                       "--format", "json"])
    doc = json.loads(strict.output)
    assert strict.exit_code == 1 and doc["tolerances"]["rel_tol"] == 0.05
    assert doc["stored_tolerances"] == kept   # all it keeps, those given over them too
    overridden = CliRunner().invoke(main, ["gate", str(stored), str(after), "--rel-tol", "0.05",
                                           "--abs-tol", "2", "--alpha", "0.05"])
    assert "tolerances the baseline keeps (gate --update stored them): rel_tol 0.2 (0.05 " \
        "given), abs_tol_us 1.0 (2.0 given), alpha 0.01 (0.05 given)" in " ".join(
            overridden.output.split())
    plain = json.loads(CliRunner().invoke(main, ["gate", str(stored), str(after), "--format",
                                                 "json"]).output)
    assert plain["stored_tolerances"] == kept and plain["tolerances"]["rel_tol"] == 0.2
    # --update keeps them (and stores an option given over them)
    assert CliRunner().invoke(main, ["gate", "--update", str(stored), str(before)]
                              ).exit_code == 0
    assert json.loads(stored.read_text())["gate_tolerances"] == kept
    assert CliRunner().invoke(main, ["gate", "--update", str(stored), str(before), "--metrics",
                                     "kernels"]).exit_code == 0
    assert json.loads(stored.read_text())["gate_tolerances"] == {**kept, "metrics": "kernels"}
    # the library alike: None, the baseline's
    assert gate_files(stored, after).result.tolerances == Tolerances(0.2, metrics="kernels")
    assert gate_files(stored, after, Tolerances()).result.stored_tolerances == {}
    # a baseline that keeps what the gate cannot use is refused, named
    doc = json.loads(stored.read_text())
    for bad, problem in (({"rel_tol": "high"}, "gate_tolerances.rel_tol is not a finite "
                                              "number >= 0"),
                         ({"alpha": 1.0}, "gate_tolerances.alpha is not a probability"),
                         ({"speed": 1}, "gate_tolerances is not an object of rel_tol"),
                         ({"metrics": "kernels,latency"}, "gate_tolerances.metrics: choose "
                                                          "from kernels")):
        (tmp_path / "bad.json").write_text(json.dumps({**doc, "gate_tolerances": bad}))
        for options in ([], ["--rel-tol", "0.1"]):   # (the baseline's, whatever was given)
            result = CliRunner().invoke(main, ["gate", str(tmp_path / "bad.json"), str(after),
                                               *options])
            assert result.exit_code == 2 and result.output.startswith(
                f"kimi-perf: error: {tmp_path / 'bad.json'}: {problem}"), result.output
    # what a first run stores is what its verdict says; the note writes a setting as the
    # gate read it (a name with a control character in it: written out, or normalised)
    first = CliRunner().invoke(main, ["gate", "--update", str(tmp_path / "new.json"), str(before),
                                      "--rel-tol", "0.3", "--format", "json"])
    said = json.loads(first.stdout)
    assert said["tolerances"]["rel_tol"] == 0.3 and said["stored_tolerances"]["rel_tol"] == 0.3
    (tmp_path / "odd.json").write_text(json.dumps({**doc, "gate_tolerances": {
        "metrics": "\u0085kernels\x1f"}}))
    odd = CliRunner().invoke(main, ["gate", str(tmp_path / "odd.json"), str(after)])
    assert "\x1f" not in odd.output and "\u0085" not in odd.output
    assert "(gate --update stored them): metrics kernels (--rel-tol" in " ".join(
        odd.output.split())
    import xml.etree.ElementTree as ET

    junit = tmp_path / "g.xml"
    CliRunner().invoke(main, ["gate", str(stored), str(after), "--rel-tol", "0.1", "--junit",
                              str(junit)])
    properties = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    assert properties["kept_by_baseline"] == "abs_tol_us,alpha,metrics"
    assert properties["rel_tol"] == "0.1"


def test_the_verdict_s_line_writes_a_layer_type_s_control_characters_out():
    """A layer type named with an escape sequence (a stored breakdown edited by hand: the
    readers write a trace's out as they read it) is written out in the FAIL line too, as in
    the table's cells, not sent to the terminal or the CI log to act on."""
    from kimi_perf.gate import GatedRun
    from kimi_perf.render import gate_document, gate_headline, gate_text

    odd = "k\x1b[2Jda\x01"
    base = _run({odd: 9, "mla": 12}, {odd: KDA, "mla": MLA})
    run = _run({odd: 10, "mla": 12}, {odd: KDA, "mla": MLA})
    gated = GatedRun(gate(base, run), base, run, {}, None, (Path("b.json"), Path("r.json")))
    headline = gate_headline(gated.result)
    assert headline.startswith("gate: FAIL") and "k\\x1b[2Jda\\x01" in headline
    for said in (headline, gate_text(gated), gate_document(gated)["headline"]):
        assert "\x1b" not in said and "\x01" not in said


def test_the_fail_line_says_the_sides_differ_where_that_fails_nothing():
    """Without --strict, decode steps gated against mixed ones fail as regressions, and how
    the sides differ (which explains them) was a line above the table alone: the FAIL line,
    all a CI log's reader may see, says it with its counts. Under --strict it is a failure
    of its own, said first, not twice."""
    decode = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
    mixed = KINETO / "tracelens_vllm_gptoss20b_prefilldecode_piecewise_mi300x.json.gz"
    lax = CliRunner().invoke(main, ["gate", str(decode), str(mixed)])
    headline = lax.output.strip().splitlines()[-1]
    assert lax.exit_code == 1 and re.match(
        r"gate: FAIL, \d+ regressions \(the sides differ: steps decode vs mixed; decode "
        r"requests a step 32 vs 37\): trace ", headline), headline
    strict = CliRunner().invoke(main, ["gate", str(decode), str(mixed), "--strict"])
    headline = strict.output.strip().splitlines()[-1]
    assert headline.count("steps decode vs mixed") == 1 and "the sides differ" not in headline
    assert CliRunner().invoke(main, ["gate", str(decode), str(decode)]).output.strip(
        ).splitlines()[-1].startswith("gate: pass")


def test_a_gpu_trace_that_lost_a_layer_type_says_it_once():
    """The reference's line: a GPU trace's lost type fails its layers, both kernel counts and
    both times, one item of the verdict naming the five."""
    from kimi_perf.layer_breakdown import Breakdown
    from kimi_perf.readers import read_trace

    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    doc = json.loads(json.dumps(b.to_json()))
    _drop_layer_type(doc, "B")
    result = gate({"specialized": b}, {"specialized": Breakdown.from_json(doc)})
    assert gate_headline(result) == (
        "gate: FAIL, 1 missing (5 checks), 1 layer count differs: specialized B missing from "
        "the run (layers, kernels, kernels_max, kernel_us, span_us); specialized step layers "
        "24 -> 12 (24 layers a step in the baseline, 12 in the run)")


def test_junit_holds_any_name_as_well_formed_xml():
    """Kernel names reach the XML: markup is escaped, and what XML 1.0 cannot hold (an
    escape sequence, a lone surrogate from a broken trace) is written out."""
    import xml.etree.ElementTree as ET

    from kimi_perf.gate import Check, GateResult

    name = "void f<int, (b)0>() & \x1b[31m red \ud800 \u202e"
    checks = [Check("standard", "kda", "kernel_us", 10.0, 20.0, 1.0, 0.001, "regression",
                    detail=f"{name} +10 µs"),
              Check("standard", name, "kernels", 3, 3, 0.0, None, "ok")]
    # (a path that fell back and computed NaN: two checks of one metric, told apart by
    # status; a dot in a type's name is no package of its own)
    checks += [Check("specialized", "step", "decode path", None, None, None, None, status)
               for status in ("fell back", "not finite")]
    checks += [Check("specialized", "model.layers.0", "kernels", 3, 3, 0.0, None, "ok")] * 2
    text = render.gate_junit(GateResult(checks, Tolerances()), ("a<b>.json", "run"), name)
    root = ET.fromstring(text.encode())
    failure = root.find(".//failure")
    written = "void f<int, (b)0>() & \\x1b[31m red \\ud800 \\u202e"
    assert failure.text == f"{written} +10 µs"
    assert root.findall(".//testcase")[1].get("classname") == f"standard.{written}"
    assert root.find(".//property").get("value") == "a<b>.json"
    assert root.find("testsuite/system-out").text == written
    assert [(case.get("classname"), case.get("name"))
            for case in root.findall(".//testcase")[2:]] == [
        ("specialized.step", "decode path (fell back)"),
        ("specialized.step", "decode path (not finite)"),
        ("specialized.model_layers_0", "kernels"), ("specialized.model_layers_0", "kernels #2")]


def _long_kernel_spacing_us(path) -> float:
    """The median time from one kernel of over 1 ms to the next on its device, from the
    SQLite export directly."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = np.array(db.execute("SELECT deviceId, start FROM CUPTI_ACTIVITY_KIND_KERNEL "
                                   "WHERE end - start > 1000000 ORDER BY deviceId, start"
                                   ).fetchall())
    gaps = [np.diff(rows[rows[:, 0] == device, 1]) for device in np.unique(rows[:, 0])]
    return float(np.median(np.concatenate(gaps))) / 1000


def test_a_cycle_cut_elsewhere_is_the_same_layer_under_an_older_digest():
    """A baseline stored when a digest was of the sequence as cut (not its least rotation)
    differs in digest from the run's for the same block: its typical layer says it is the
    same layer, so its checks stand rather than being excused as kernels that moved between
    letters, and its pattern is not called changed."""
    before, after = (load_run(NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}.sqlite")[0]
                     for x in ("before", "after"))
    next(t for t in before["trace"].layer_types if t["type"] == "A")["pattern"] = "0123456789ab"
    checks = {(c.layer_type, c.metric): c.status for c in gate(before, after).checks}
    assert ("A", "pattern") not in checks and checks[("A", "span_us")] == "regression"


def test_an_older_digest_of_the_same_cut_still_checks_the_layer():
    """The same cut (rotation 0) under a digest stored the older way: the layer is the same
    (no kernel moved between letters), so a 30% slower A fails rather than passing as
    changed."""
    base = load_run(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite")[0]
    run = {"trace": Breakdown.from_json(json.loads(json.dumps(base["trace"].to_json())))}
    next(t for t in base["trace"].layer_types if t["type"] == "A")["pattern"] = "0123456789ab"
    for row in run["trace"].layers:
        if row["type"] == "A":
            row["span_us"] *= 1.3
    checks = {(c.layer_type, c.metric): c.status for c in gate(base, run).checks}
    assert checks[("A", "span_us")] == "regression" and ("A", "pattern") not in checks


def test_step_windows_compare_only_when_both_sides_are_whole_devices():
    """Whole-device steps holding 17 and 15 layers are not compared; a run whose steps are
    ranges is (the windows' note would misname its steps: its steps lost layers, other
    work), and so is a side whose steps do not say how many layers they hold."""
    before, after = (load_run(NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}.sqlite")[0]
                     for x in ("before", "after"))

    def step_checks():
        return {c.metric: c for c in gate(before, after).checks if c.layer_type == "step"}

    def step_statuses():
        return {metric: c.status for metric, c in step_checks().items()}
    assert step_statuses()["kernels"] == "changed"
    assert "window" in step_checks()["kernels"].detail
    after["trace"].source["steps_found_by"] = "range"
    assert step_statuses() | {"layers": "differs"} == step_statuses()
    assert step_checks()["kernels"].detail.startswith(
        "17 layers a step in the baseline, 15 in the run: other work; per step (medians): ")
    assert step_statuses()["kernels"] == "changed"
    after["trace"].source["steps_found_by"] = "device"
    for step in after["trace"].steps:
        step["layers"] = None
    assert step_statuses()["kernels"] == "improvement"


def test_stored_layers_of_steps_not_held_are_refused(tmp_path):
    """A baseline whose steps were emptied, its layers kept: the gate would check its layers
    and no step, and breakdown print "no ops" above them; both refuse it (exit 2)."""
    doc = json.loads(BASELINE.read_text())
    doc["paths"]["standard"]["steps"] = []
    bad = tmp_path / "steps_empty.json"
    bad.write_text(json.dumps(doc))
    runner = CliRunner()
    for args in (["gate", bad, BASELINE], ["gate", BASELINE, bad],
                 ["breakdown", bad, "--path", "standard"]):
        result = runner.invoke(main, [str(a) for a in args])
        assert result.exit_code == 2, result.output
        assert result.output == (f"kimi-perf: error: {bad}: paths.standard.layers[0] is of "
                                 "step 0 on device -1, which is none of its 0 steps\n")


def test_a_bad_row_among_many_is_named(tmp_path):
    """The rows of a long stored breakdown are checked a column at a time; a bad one is
    named by its list, index and field, wherever it is, the first of several."""
    doc = json.loads(BASELINE.read_text())["paths"]["standard"]
    steps, layers = doc["steps"], doc["layers"]
    copies = 1700    # 40,800 layers
    doc["steps"] = [{**s, "index": s["index"] + 3 * k} for k in range(copies) for s in steps]
    doc["layers"] = [{**r, "step": r["step"] + 3 * k} for k in range(copies) for r in layers]
    for t in doc["layer_types"]:
        t["layers"] *= copies
    file = tmp_path / "long.json"

    def problem() -> str:
        file.write_text(json.dumps(doc))
        with pytest.raises(TraceError) as caught:
            load_run(file)
        return caught.value.problem

    last = len(doc["layers"]) - 1
    assert last == 40_799
    doc["layers"][last] = {**doc["layers"][last], "gap_us": float("nan")}
    assert problem() == f"layers[{last}].gap_us is nan, not a finite number >= 0"
    doc["layers"][last - 1] = {**doc["layers"][last - 1], "type": 5}
    assert problem() == f"layers[{last - 1}].type is 5, not a name"   # the first bad row
    doc["layers"][last - 1]["type"] = "kda"
    doc["layers"][last]["gap_us"] = 1.0
    doc["steps"][-1] = {**doc["steps"][-1], "epilogue": {"kernels": 1.5, "span_us": 1.0}}
    assert problem() == (f"steps[{len(doc['steps']) - 1}].epilogue.kernels is 1.5, not a "
                         "count (an integer >= 0)")


def test_a_stored_step_without_a_count_of_other_threads_work_is_one_line(tmp_path):
    doc = json.loads(json.dumps(load_run(EXAMPLE_TRACE)[0]["trace"].to_json()))
    doc["steps"][0]["other_thread_ops"] = None   # a count, or absent: null read as absent
    (tmp_path / "ok.json").write_text(json.dumps(doc))
    doc["steps"][0]["other_thread_ops"] = "x"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    runner = CliRunner()
    assert runner.invoke(main, ["breakdown", str(tmp_path / "ok.json")]).exit_code == 0
    for command in (["breakdown"], ["gate", str(tmp_path / "ok.json")], ["compare",
                                                                          str(EXAMPLE_TRACE)]):
        result = runner.invoke(main, [*command, str(tmp_path / "bad.json")])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert "steps[0].other_thread_ops is a string, not a count or null" in result.output


def test_a_stored_count_of_partial_passes_is_checked(tmp_path):
    doc = json.loads(json.dumps(load_run(EXAMPLE_TRACE)[0]["trace"].to_json()))
    doc["source"]["outside_steps"]["partial_passes"] = {"parts": 2, "ops": "many"}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["breakdown", str(tmp_path / "bad.json")])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "partial_passes: {parts, ops}" in result.output


def test_gate_one_path_of_a_run_against_one_trace(tmp_path):
    """--path checks one decode path; a single breakdown (or trace) on either side stands for
    it. Without --path, which path it stands for is asked, not failed as missing."""
    one = tmp_path / "specialized.json"
    one.write_text(json.dumps(json.loads(BASELINE.read_text())["paths"]["specialized"]))
    runner = CliRunner()
    whole = runner.invoke(main, ["gate", str(BASELINE), str(one), "--format", "json"])
    assert whole.exit_code == 2 and whole.output.count("\n") == 1   # not a fake regression
    assert (f"{BASELINE}: holds the paths standard, specialized: choose the one the other "
            "side stands for with --path") in whole.output
    picked = runner.invoke(main, ["gate", str(BASELINE), str(one), "--path", "specialized",
                                  "--format", "json"])
    assert picked.exit_code == 0, picked.output
    assert {c["path"] for c in json.loads(picked.output)["checks"]} == {"specialized"}
    lacking = runner.invoke(main, ["gate", str(BASELINE), str(one), "--path", "fused"])
    assert lacking.exit_code == 2 and lacking.output.count("\n") == 1
    assert f"{BASELINE}: has no path 'fused' (it has standard, specialized)" in lacking.output
    update = runner.invoke(main, ["gate", str(one), str(one), "--path", "x", "--update"])
    assert update.exit_code == 2 and "--update stores the whole run" in update.output


def test_a_runs_trace_stands_for_its_path_and_a_path_the_run_lost_fails(tmp_path):
    """A run's trace against a baseline of several paths is the path it captured (its name
    and run.json say which: `--path` need not repeat it); any other trace still asks. With
    --path, a path of the baseline's that the run lost fails as missing, as without --path
    (it stopped the gate, exit 2, no verdict written); a name no side has is still refused."""
    from kimi_perf.layer_breakdown import breakdown_of_file

    trace = NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"command": "kimi-perf trace", "request": {
        "paths": ["standard", "specialized"]}}))
    (run_dir / "specialized.sqlite").symlink_to(trace)
    stored = breakdown_of_file(trace).to_json()
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"schema": 1, "run": {}, "paths": {"standard": stored,
                                                                  "specialized": stored}}))
    gated = gate_files(base, run_dir / "specialized.sqlite", Tolerances(metrics="kernels"))
    assert gated.result.ok and {c.path for c in gated.result.checks} == {"specialized"}
    with pytest.raises(TraceError, match="choose the one the other side stands for"):
        gate_files(base, trace, Tolerances(metrics="kernels"))
    from kimi_perf import compare_files

    # (compare pairs it so too)
    assert compare_files(base, run_dir / "specialized.sqlite").to_json()["inputs"]["a"] == (
        f"{base} (specialized)")
    # against a run of another single path it stands for that one, and the paths differ (it
    # passed as the standard path, --strict too); a run's two traces of other paths likewise
    standard_only = tmp_path / "standard.json"
    standard_only.write_text(json.dumps({"schema": 1, "run": {}, "paths": {"standard": stored}}))
    other = gate_files(standard_only, run_dir / "specialized.sqlite",
                       Tolerances(metrics="kernels"), strict=True).result
    assert [(c.status, c.detail) for c in other.failures] == [
        ("captured differently", "decode path standard vs specialized")]
    (run_dir / "standard.sqlite").symlink_to(trace)
    assert gate_files(run_dir / "standard.sqlite", run_dir / "specialized.sqlite",
                      Tolerances(metrics="kernels")).result.run_differences == [
        "decode path standard vs specialized"]
    # --path: a run's trace as the baseline holds its path, which a run that lost it fails
    lost_path = gate_files(run_dir / "specialized.sqlite", standard_only,
                           Tolerances(metrics="kernels"), path_name="specialized").result
    assert {(c.path, c.status) for c in lost_path.failures} == {("specialized", "missing")}

    doc = json.loads(BASELINE.read_text())
    del doc["paths"]["specialized"]
    lost = tmp_path / "lost.json"
    lost.write_text(json.dumps(doc))
    verdict = tmp_path / "verdict.json"
    result = CliRunner().invoke(main, ["gate", str(BASELINE), str(lost), "--path",
                                       "specialized", "-o", str(verdict)])
    assert result.exit_code == 1, result.output
    checks = json.loads(verdict.read_text())["checks"]
    assert {(c["path"], c["status"]) for c in checks} == {("specialized", "missing")}
    # its layers a step too, as a type lost is (a JUnit case of the path's failed, not gone)
    assert {c["layer_type"] for c in checks if c["metric"] == "layers"} == {
        "dense", "kda", "mla", "step"}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc["paths"]["standard"]))
    typo = CliRunner().invoke(main, ["gate", str(plain), str(lost), "--path", "fused"])
    assert typo.exit_code == 2 and typo.output == (
        f"kimi-perf: error: {lost}: has no path 'fused' (it has standard)\n")


def test_a_gate_that_cannot_run_removes_a_verdict_only_where_it_would_write_one(tmp_path):
    """The verdict a gate that cannot run removes is the file it would have replaced: a
    symlink's target (the link kept), never a pipe or device (/dev/null, which root could
    unlink) nor a file made read-only (refused, then deleted all the same)."""
    import os
    import stat

    missing = str(tmp_path / "no-baseline.json")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = CliRunner().invoke(main, ["gate", missing, str(BASELINE), "-o", str(fifo)])
    assert result.exit_code == 2 and stat.S_ISFIFO(fifo.lstat().st_mode)
    kept = tmp_path / "kept.json"
    kept.write_text("last night's")
    kept.chmod(0o444)
    result = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "-o", str(kept)])
    assert result.exit_code == 2 and "it is read-only" in result.output
    assert kept.read_text() == "last night's"
    target, link = tmp_path / "target.xml", tmp_path / "link.xml"
    target.write_text("last night's")
    link.symlink_to(target)
    result = CliRunner().invoke(main, ["gate", missing, str(BASELINE), "--junit", str(link)])
    assert result.exit_code == 2 and link.is_symlink() and not target.exists()
    # a link's `..` through a linked folder: the file the verdict went to, not a name's
    # neighbour (out -> real/sub, out/v.txt -> ../v.txt: real/v.txt)
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "out").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "real" / "sub" / "v.txt").symlink_to(Path("..") / "v.txt")
    decoy = tmp_path / "v.txt"
    decoy.write_text("not a verdict")
    written = tmp_path / "out" / "v.txt"
    assert CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "-o",
                                     str(written)]).exit_code == 0
    assert (tmp_path / "real" / "v.txt").is_file()
    assert CliRunner().invoke(main, ["gate", missing, str(BASELINE), "-o",
                                     str(written)]).exit_code == 2
    assert not (tmp_path / "real" / "v.txt").exists() and decoy.read_text() == "not a verdict"
    # a file under /dev that is a file (/dev/shm): removed as any other, and kept as any
    # other where it was made read-only
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        shm = Path(f"/dev/shm/kimi-perf-test-{os.getpid()}.txt")
        shm.write_text("last night's")
        try:
            CliRunner().invoke(main, ["gate", missing, str(BASELINE), "-o", str(shm)])
            assert not shm.exists()
            shm.write_text("last night's")
            shm.chmod(0o444)
            CliRunner().invoke(main, ["gate", missing, str(BASELINE), "-o", str(shm)])
            assert shm.read_text() == "last night's"
        finally:
            shm.unlink(missing_ok=True)


@pytest.mark.parametrize(("signum", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_gate_stopped_or_killed_leaves_no_verdict(tmp_path, monkeypatch, signum, code):
    """Last night's verdict is gone while the gate runs, so that one killed (SIGKILL, the
    out-of-memory killer: nothing runs on the way out) leaves none; one stopped (a CI job's
    timeout, Ctrl-C) removes what it had written too (the JUnit file is written first: it
    would pass for tonight's beside last night's table)."""
    import signal

    import kimi_perf.gate

    output, junit = tmp_path / "gate.json", tmp_path / "gate.xml"
    seen = []

    def gate_files(*args, **kwargs):
        seen.append((output.exists(), junit.exists()))
        return real(*args, **kwargs)

    real = kimi_perf.gate.gate_files
    monkeypatch.setattr(kimi_perf.gate, "gate_files", gate_files)
    args = ["gate", str(BASELINE), str(BASELINE), "-o", str(output), "--junit", str(junit)]
    output.write_text("last night's")
    junit.write_text("last night's")
    assert CliRunner().invoke(main, args).exit_code == 0
    assert seen == [(False, False)] and output.exists() and junit.exists()

    def killed(*args, **kwargs):
        junit.write_text("tonight's, alone")
        signal.raise_signal(getattr(signal, signum))   # (this thread's: see test_cli's)

    monkeypatch.setattr(kimi_perf.render, "gate_text", killed)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code and not output.exists() and not junit.exists()


def test_a_verdict_to_dev_stdout_goes_into_the_log_a_shell_opened(tmp_path):
    """`gate ... -o /dev/stdout >> ci.log`: the verdict is written at the log's end (it
    replaced the log), and a gate that cannot run leaves the log alone (it deleted it); so
    with /proc/self/fd/1 and /proc/thread-self/fd/1."""
    import os
    import subprocess
    import sys

    for name in ("/dev/stdout", "/proc/self/fd/1", "/proc/thread-self/fd/1"):
        log = tmp_path / "ci.log"
        log.write_text("an earlier step's line\n")
        for baseline, code in ((BASELINE, 0), (tmp_path / "none.json", 2)):
            with open(log, "ab") as appended:
                done = subprocess.run([sys.executable, "-m", "kimi_perf", "gate", str(baseline),
                                       str(BASELINE), "-o", name], stdout=appended,
                                      stderr=subprocess.PIPE, text=True)
            assert done.returncode == code, (name, done.stderr)
            assert log.read_text().startswith("an earlier step's line\n"), name
            assert log.read_text().endswith("\ngate: pass (24 checks)\n"), name
    # another process's descriptor is a file of its own, not this one's
    from kimi_perf.trace import named_descriptor

    assert [named_descriptor(n) for n in ("/dev/stderr", "/dev/fd/7", f"/proc/{os.getpid()}"
                                          "/task/9/fd/3", "/proc/1/fd/1", "/dev/fdx")] == [
        2, 7, 3, None if os.getpid() != 1 else 1, None]


def test_a_descriptor_that_is_none_is_a_one_line_error(tmp_path):
    """-o /dev/fd/N of no descriptor (N past any integer the system takes): a one-line
    error, exit 2 (an OverflowError's traceback, and the gate's exit 1, a regression)."""
    for command in (["info", str(EXAMPLE_TRACE)], ["gate", str(BASELINE), str(BASELINE)]):
        result = CliRunner().invoke(main, [*command, "-o", "/dev/fd/99999999999999999999"])
        assert result.exit_code == 2 and result.output == (
            "kimi-perf: error: /dev/fd/99999999999999999999: cannot write: no such "
            "descriptor\n"), result.output


def test_the_verdict_files_are_named_for_what_they_hold(tmp_path):
    """--junit refuses the names -o refuses (a run's report or trace: it replaced them) and
    a .json or .csv; -o refuses .xml, which --junit writes (-o gate.xml wrote the table)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.html").write_text("the run's report")
    for option, name, said in (
            ("--junit", run_dir / "report.html", "a report (kimi-perf report writes one)"),
            ("--junit", tmp_path / "t.kptrace", "a .kptrace (kimi-perf convert writes one)"),
            ("--junit", tmp_path / "t.sqlite", "a trace's name"),
            ("--junit", tmp_path / "g.json", "a .json")):
        result = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), option,
                                           str(name)])
        assert result.exit_code == 2 and result.output == (
            f"kimi-perf: error: --junit {name}: {said}, not what --junit writes (XML): name "
            "the file otherwise (see main gate --help)\n")
    assert (run_dir / "report.html").read_text() == "the run's report"
    result = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "-o",
                                       str(tmp_path / "g.xml")])
    assert result.exit_code == 2 and result.output == (
        f"kimi-perf: error: -o {tmp_path / 'g.xml'}: -o writes the table or the JSON; "
        "--junit writes the XML\n")
    assert not list(tmp_path.glob("*.*"))


def test_a_runs_run_json_given_as_a_trace_says_to_give_the_run(tmp_path):
    """A run's run.json in place of the run (an easy slip: it is the file with the run in its
    name) is named as what it is, not as a breakdown that lost its 'schema'."""
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps(json.loads(BASELINE.read_text())["run"], indent=1))
    for command in (["info"], ["breakdown"], ["report", "-o", str(tmp_path / "r.html")]):
        result = CliRunner().invoke(main, [*command, str(run_json)])
        assert result.exit_code == 2 and result.output == (
            f"kimi-perf: error: {run_json}: a kimi-perf run's run.json, not a trace: give its "
            "run directory\n"), command
    assert not (tmp_path / "r.html").exists()


def test_a_baseline_whose_keys_were_sorted_is_still_a_baseline(tmp_path):
    """A baseline edited and dumped with its keys sorted (`schema` no longer first) is read
    as a baseline, not as a trace ("not a Chrome/Kineto trace"); one whose `schema` was lost
    says so."""
    doc = json.loads(BASELINE.read_text())
    resorted = tmp_path / "sorted.json"
    resorted.write_text(json.dumps(doc, sort_keys=True, indent=1))
    assert gate_files(resorted, BASELINE, Tolerances(metrics="kernels")).result.ok
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc["paths"]["standard"], sort_keys=True))
    assert set(load_run(plain)[0]) == {"trace"}
    del doc["schema"]
    lost = tmp_path / "lost.json"
    lost.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"a kimi-perf run breakdown without its 'schema' \(1\)"):
        load_run(lost)
    moved = tmp_path / "moved.json"   # (its keys in another order, its schema kept)
    moved.write_text(json.dumps({"steps": [], **doc["paths"]["standard"]}))
    assert set(load_run(moved)[0]) == {"trace"}
    lost_plain = tmp_path / "lost_plain.json"
    lost_plain.write_text(json.dumps({k: v for k, v in doc["paths"]["standard"].items()
                                      if k != "schema"}))
    with pytest.raises(TraceError, match="not a kimi-perf breakdown of schema 1"):
        load_run(lost_plain)
    # a Kineto trace that begins with a key of ours is still a trace
    import gzip

    from kimi_perf.readers import read_trace

    trace_doc = json.loads(gzip.decompress(EXAMPLE_TRACE.read_bytes()))
    for key in ("run", "paths", "steps"):
        kineto = tmp_path / f"{key}.json"
        kineto.write_text(json.dumps({key: "nightly-42", **trace_doc}))
        assert set(load_run(kineto)[0]) == {"trace"} and load_run(kineto)[2] is None
    with pytest.raises(TraceError, match="a kimi-perf breakdown JSON, not a trace"):
        read_trace(resorted)
    zipped = tmp_path / "sorted.json.gz"
    zipped.write_bytes(gzip.compress(resorted.read_bytes()))
    with pytest.raises(TraceError, match="a gzipped kimi-perf breakdown JSON: gunzip it"):
        read_trace(zipped)
    # a run's document as trace --format json prints it, its keys sorted, is one too
    document = tmp_path / "document.json"
    document.write_text(json.dumps({**json.loads(BASELINE.read_text()), "run_dir": "x",
                                    "comparisons": []}, sort_keys=True))
    assert next(iter(json.loads(document.read_text()))) == "comparisons"
    assert gate_files(document, BASELINE, Tolerances(metrics="kernels")).result.ok


def test_gate_breaks_traces_down_over_the_phase_it_is_given(tmp_path):
    """Traces given to the gate take --phase (and say which steps they left out); stored
    breakdowns do not; --path needs a run on one side; a BOM before a stored JSON is fine."""
    from tests.test_breakdown import _vllm_phases_trace

    trace = tmp_path / "vllm.kptrace"
    _vllm_phases_trace().build().save(trace)
    runner = CliRunner()
    out = runner.invoke(main, ["gate", str(trace), str(trace)])
    assert out.exit_code == 0, out.output
    assert "baseline trace: steps: 2 decode kept; 1 mixed left out" in out.output
    every = runner.invoke(main, ["gate", str(trace), str(trace), "--phase", "all", "--format",
                                 "json"])
    (step_kernels,) = [c for c in json.loads(every.output)["checks"]
                       if c["layer_type"] == "step" and c["metric"] == "kernels"]
    assert step_kernels["baseline"] == 3
    stored = runner.invoke(main, ["gate", str(BASELINE), str(BASELINE), "--phase", "all"])
    assert stored.exit_code == 2 and "--phase applies to traces" in stored.output
    plain = runner.invoke(main, ["gate", str(trace), str(trace), "--path", "standard"])
    assert plain.exit_code == 2 and "neither" in plain.output
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + BASELINE.read_bytes())
    assert runner.invoke(main, ["gate", str(bom), str(BASELINE)]).exit_code == 0
    # a phase the trace lacks: said of the file given (a .kptrace's trace came from another)
    none = runner.invoke(main, ["gate", str(trace), str(trace), "--phase", "prefill"])
    assert none.exit_code == 2
    assert none.output.startswith(f"kimi-perf: error: {trace}: --phase prefill: no prefill")


def test_gate_breaks_traces_down_as_breakdown_does(tmp_path):
    """--steps, --layers and --rules break the traces given to the gate down as they do for
    `breakdown` (a benchmark whose steps are its own ranges); stored breakdowns take none."""
    jsun = NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"
    runner = CliRunner()
    out = runner.invoke(main, ["gate", str(jsun), str(jsun), "--steps", "^Forward$", "--format",
                               "json", "--all"])
    assert out.exit_code == 0, out.output
    checks = {(c["layer_type"], c["metric"]): c for c in json.loads(out.output)["checks"]}
    assert checks["A", "kernels"]["baseline"] == 60 and checks["step", "kernels"]["baseline"] \
        == 728
    rules = tmp_path / "rules.toml"
    rules.write_text("[[rule]]\nclass = 'mine'\npattern = 'gemm|gemv'\n")
    mine = runner.invoke(main, ["gate", str(jsun), str(jsun), "--steps", "^Forward$",
                                "--rules", str(rules), "--layers", "repeat"])
    assert mine.exit_code == 0, mine.output
    from kimi_perf.classify import load_rules
    from kimi_perf.gate import gate_files

    gated = gate_files(jsun, jsun, step_regex="^Forward$", rules=load_rules(rules))
    (layer_type,) = gated.baseline["trace"].layer_types
    assert "mine" in layer_type["classes"] and "gemm" not in layer_type["classes"]
    none = runner.invoke(main, ["gate", str(jsun), str(jsun), "--steps", "^Nothing$"])
    assert none.exit_code == 2 and "no range matching --steps '^Nothing$'" in none.output
    for option in (["--steps", "x"], ["--layers", "repeat"], ["--rules", str(rules)]):
        stored = runner.invoke(main, ["gate", str(BASELINE), str(BASELINE), *option])
        assert stored.exit_code == 2 and f"{option[0]} applies to traces" in stored.output


def test_one_more_kernel_fails_and_one_fewer_is_an_improvement():
    base = _run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    run = _run({"kda": 10, "mla": 11}, {"kda": KDA, "mla": MLA})
    result = gate(base, run)
    s = statuses(result)
    assert s[("kda", "kernels")] == "regression" and s[("mla", "kernels")] == "improvement"
    assert [(c.layer_type, c.metric) for c in result.failures] == [("kda", "kernels"),
                                                                   ("kda", "kernels_max")]
    # one layer of eight with one kernel more: the median hides it, the largest does not
    kda = {"kda": KDA[:8]}
    one_more = _run({"kda": 9}, kda)
    one_more["specialized"].layers[3]["kernels"] = 10
    s = statuses(gate(_run({"kda": 9}, kda), one_more))
    assert s[("kda", "kernels")] == "ok" and s[("kda", "kernels_max")] == "regression"


def _typical(run, layer_type: str, kernels: list[tuple[str, float]]) -> None:
    t = next(t for t in run["specialized"].layer_types if t["type"] == layer_type)
    t["typical_layer"] = {"layers": 40, "kernels": [{"name": n, "class": "other", "us": us}
                                                    for n, us in kernels]}


def test_a_change_names_the_kernels_behind_it():
    """From the typical layers: the kernels a count regression added (and removed), and the
    launches whose µs moved most the way the layer's time did (the i-th launch of a name
    matched with the i-th, and named "#i" where the layer launches the name more than once; a
    new one by all its µs), with the layer's total; without typical layers, no detail."""
    base = _run({"kda": 4}, {"kda": KDA})
    _typical(base, "kda", [("norm", 5.0), ("void gemm<float>(int)", 10.0), ("kda", 20.0),
                           ("void gemm<float>(int)", 25.0)])
    run = _run({"kda": 5}, {"kda": KDA * 1.3})
    _typical(run, "kda", [("norm", 4.0), ("void gemm<float>(int)", 10.5), ("kda", 30.0),
                          ("copy", 1.0), ("void gemm<float>(int)", 33.0)])
    by = {c.metric: c for c in gate(base, run).checks if c.layer_type == "kda"}
    assert by["kernels"].status == "regression" and by["kernels"].detail == "added copy"
    assert by["kernel_us"].status == "regression"
    assert by["kernel_us"].detail == ("kda +10.0 µs, gemm<float> #2 +8.0 µs, copy +1.0 µs "
                                      "(new); typical layer +18.5 µs in all")
    back = {c.metric: c for c in gate(run, base).checks if c.layer_type == "kda"}
    assert back["kernels"].detail == "removed copy" and back["kernel_us"].status \
        == "improvement"
    assert back["kernel_us"].detail == ("kda -10.0 µs, gemm<float> #2 -8.0 µs, copy -1.0 µs "
                                        "(gone); typical layer -18.5 µs in all")
    assert "(added copy)" in gate_headline(gate(base, run))
    # a detail naming many launches is cut short in the headline (one line for a CI log);
    # the table keeps it whole
    many = _run({"kda": 5}, {"kda": KDA * 1.3})
    _typical(many, "kda", [(f"void fused_kernel_{i}<float, 128>(int)", 3.0) for i in range(40)])
    failed = gate(base, many)
    detail = next(c.detail for c in failed.checks if c.metric == "kernels")
    assert len(detail) > 1000 and detail.startswith("added ")
    headline = gate_headline(failed)
    assert f"({detail[:60]}" in headline and detail not in headline and "…)" in headline
    assert len(headline) < 800   # five checks at most, each detail under 100 characters
    plain = _run({"kda": 5}, {"kda": KDA * 1.3})      # no typical layers: nothing to name
    assert all(c.detail is None for c in gate(base, plain).checks)


def _run_from(tmp_path: Path, trace: Path) -> Path:
    """The run directory `kimi-perf trace --from TRACE` writes."""
    out = tmp_path / "runs"
    result = CliRunner().invoke(main, ["trace", "--from", str(trace), "--out", str(out)])
    assert result.exit_code == 0, result.output
    (run,) = out.iterdir()
    return run


def test_traces_of_other_gpus_are_said_to_be_captured_differently(tmp_path):
    """A trace carries no run information, but its kernels say which GPUs ran them: an A100
    baseline against a V100 run differs for that alone, which the gate says (and --strict
    fails by itself), as compare does; and a side where no layers were found is said so."""
    control = KINETO / "hta_trace_diff_control_a100_rank3.json.gz"
    test = KINETO / "hta_trace_diff_test_v100_rank1_cudagraph.json.gz"
    ran = ("ran on 1 × NVIDIA A100-PG509-200 (108 SMs) vs 1 × Tesla V100-SXM2-16GB (80 SMs)")
    text = " ".join(CliRunner().invoke(main, ["gate", str(control), str(test)]).output.split())
    assert f"the baseline and the run were captured differently: {ran}" in text
    assert ("broken down differently: no layers found vs layers from the repeating kernel "
            "pattern") in text
    strict = CliRunner().invoke(main, ["gate", str(control), str(test), "--strict",
                                       "--format", "json"])
    doc = json.loads(strict.output)
    assert strict.exit_code == 1 and doc["run_differences"] == [ran]
    assert "captured differently" in [c["status"] for c in doc["checks"] if c["path"] == "run"]
    same = json.loads(CliRunner().invoke(main, ["gate", str(control), str(control),
                                                "--format", "json"]).output)
    assert same["run_differences"] == [] and same["breakdown_differences"] == []
    # two captures whose run information names their GPUs: said once, from it (not again
    # from their kernels); one that does not name them: from the kernels
    docs = []
    for name in ("H100", "H200"):
        doc = json.loads(BASELINE.read_text())
        doc["run"]["environment"]["gpus"] = [name]
        for b in doc["paths"].values():
            b["source"]["gpus_ran"] = [{"device": 0, "name": name, "sm_count": 132}]
        docs.append(tmp_path / f"{name}.json")
        docs[-1].write_text(json.dumps(doc))
    said = gate_files(docs[0], docs[1], Tolerances(metrics="kernels")).result.run_differences
    assert said == ["GPUs H100 vs H200"]
    # the same names recorded, other GPUs ran the kernels (a MIG slice's SMs, say): from them
    doc = json.loads(docs[1].read_text())
    doc["run"]["environment"]["gpus"] = ["H100"]
    docs[1].write_text(json.dumps(doc))
    said = gate_files(docs[0], docs[1], Tolerances(metrics="kernels")).result.run_differences
    assert said == [f"{p}: ran on 1 × H100 (132 SMs) vs 1 × H200 (132 SMs)"
                    for p in ("standard", "specialized")]
    doc = json.loads(docs[0].read_text())
    del doc["run"]["environment"]["gpus"]
    docs[0].write_text(json.dumps(doc))
    said = gate_files(docs[0], docs[1], Tolerances(metrics="kernels")).result.run_differences
    assert said == [f"{p}: ran on 1 × H100 (132 SMs) vs 1 × H200 (132 SMs)"
                    for p in ("standard", "specialized")]


def test_a_gpu_one_trace_does_not_describe_is_no_difference_of_the_runs(tmp_path):
    """A trace naming its GPU against one whose GPU the trace does not describe (no name, no
    SM count): the gate finds no difference (``--strict`` would fail on a guess), and compare
    says the GPUs are not known to be alike rather than that their µs differ for it. What both
    describe still tells GPUs apart: SM counts where one is unnamed, their number where
    neither is described."""
    from kimi_perf.comparison import gpus_differ, sides_notes

    a100, h100 = {"name": "NVIDIA A100", "sm_count": 108}, {"name": "NVIDIA H100"}
    bare, unnamed = {}, {"sm_count": 304}
    assert not gpus_differ([a100], [bare]) and not gpus_differ([bare], [bare])
    assert not gpus_differ([{**h100, "sm_count": 132}], [h100])
    assert gpus_differ([a100], [h100]) and gpus_differ([unnamed], [a100])
    assert gpus_differ([bare], [bare, bare]) and gpus_differ([a100], [a100, a100])
    docs = []
    for name, gpu in (("named", a100), ("bare", bare)):
        doc = json.loads(BASELINE.read_text())
        doc["run"]["environment"].pop("gpus", None)
        for b in doc["paths"].values():
            b["source"]["gpus_ran"] = [{"device": 0, **gpu}]
        docs.append(tmp_path / f"{name}.json")
        docs[-1].write_text(json.dumps(doc))
    assert gate_files(docs[0], docs[1], Tolerances(metrics="kernels")).result \
        .run_differences == []
    named, described_not = (Breakdown.from_json(json.loads(d.read_text())["paths"]["standard"])
                            for d in docs)
    assert sides_notes(named, described_not, "A", "B")[0] == (
        "A ran on 1 × NVIDIA A100 (108 SMs), B on 1 × GPU not described in the trace: whether "
        "their GPUs are alike is not known")
    other = copy.deepcopy(named)
    other.source["gpus_ran"] = [{"device": 0, **unnamed}]
    assert sides_notes(named, other, "A", "B")[0].endswith("their µs differ for that alone")


def test_cpu_runs_with_other_thread_counts_are_said_to_be_captured_differently(tmp_path):
    """A CPU run's times depend on the threads torch ran with (a TP rank's share of them):
    two CPU runs that differ in them are said to; GPU runs are not (their kernels do not
    wait on host threads), nor a capture that predates the record."""
    def run(device: str, threads: int | None) -> dict:
        doc = json.loads(BASELINE.read_text())
        doc["run"]["environment"]["device"] = device
        doc["run"]["environment"].pop("cpu_threads", None)
        if threads is not None:
            doc["run"]["environment"]["cpu_threads"] = threads
        return doc

    assert run_differences(run("cpu", 2), run("cpu", 1)) == ["CPU threads 2 vs 1"]
    assert run_differences(run("cpu", 2), run("cpu", 2)) == []
    assert run_differences(run("cpu", None), run("cpu", 1)) == []
    assert run_differences(run("cuda", 16), run("cuda", 8)) == []
    assert run_differences(run("cpu", 2), run("cpu", 1), cpu_times=False) == []
    # the gate of a CPU run's ops alone (its default): threads move no op, and --strict
    # passes; where its times are checked too, they are captured differently
    docs = [tmp_path / "base.json", tmp_path / "run.json"]
    for doc, threads in zip(docs, (4, 2), strict=True):
        doc.write_text(json.dumps(run("cpu", threads)))
    ops_only = gate_files(*docs, strict=True).result
    assert ops_only.ok and ops_only.run_differences == [] and ops_only.cpu_times_left_out
    timed = gate_files(*docs, Tolerances(metrics="kernels,kernel_us"), strict=True).result
    assert timed.run_differences == ["CPU threads 4 vs 2"]
    assert "captured differently" in {c.status for c in timed.failures}


def _drop_layer_type(b: dict, layer_type: str) -> list[dict]:
    """A stored breakdown ``b`` (its JSON) as if its steps had not run the type's layers:
    their rows, types and share of each step gone. Returns the rows dropped."""
    dropped = [r for r in b["layers"] if r["type"] == layer_type]
    b["layers"] = [r for r in b["layers"] if r["type"] != layer_type]
    b["layer_types"] = [t for t in b["layer_types"] if t["type"] != layer_type]
    for step in b["steps"]:
        gone = [r for r in dropped if r["step"] == step["index"]]
        step["layers"] -= len(gone)
        step["kernels"] -= sum(r["kernels"] for r in gone)
        step["span_us"] -= sum(r["span_us"] for r in gone)
    return dropped


def test_a_layer_type_dropped_from_every_step_is_missing_not_a_faster_step(tmp_path):
    """A run whose steps lost every gated-MLA layer: the type's kernels and layers a step
    are missing (failures), and the steps' fewer kernels and µs are other work, no
    improvement."""
    doc = json.loads(BASELINE.read_text())
    dropped = _drop_layer_type(doc["paths"]["specialized"], "mla")
    (short := tmp_path / "no_mla.json").write_text(json.dumps(doc))
    result = gate_files(BASELINE, short, Tolerances(metrics="kernels,span_us")).result
    checks = {(c.layer_type, c.metric): c for c in result.checks if c.path == "specialized"}
    mla = [r["step"] for r in dropped]
    assert (checks[("mla", "layers")].status, checks[("mla", "layers")].baseline) == (
        "missing", max(mla.count(s) for s in set(mla)))
    assert checks[("mla", "kernels")].status == "missing"
    assert checks[("step", "layers")].status == "differs"
    # the lost type is one item of the verdict's line, its checks named (not four of five)
    assert gate_headline(result) == (
        "gate: FAIL, 1 missing (4 checks), 1 layer count differs: specialized mla missing from "
        "the run (layers, ops, ops_max, span_us); specialized step layers 8 -> 6 (8 layers a "
        "step in the baseline, 6 in the run)")
    for metric in ("kernels", "span_us"):
        assert checks[("step", metric)].status == "changed"
        assert "other work" in checks[("step", metric)].detail


def test_a_step_s_change_is_explained_both_ways_and_parts_of_some_steps_say_so():
    """A step of 434 kernels against one of 423 (vLLM decode against prefill + decode): its
    B layers lost 216, its A layers gained 204; both said, not -216 as if it explained -11.
    A layer type the run holds in some of its steps only says in how many (its median over
    the steps is no step's)."""
    decode, mixed = (KINETO / f"tracelens_vllm_gptoss20b_{x}_mi300x.json.gz"
                     for x in ("decode_fullgraph", "prefilldecode_piecewise"))
    checks = {c.metric: c for c in gate_files(decode, mixed).result.checks
              if c.layer_type == "step"}
    assert (checks["kernels"].baseline, checks["kernels"].current) == (434, 423)
    assert checks["kernels"].detail == ("per step (medians): B layers -216 kernels, "
                                        "A layers +204 kernels")
    control = KINETO / "hta_trace_diff_control_a100_rank3.json.gz"
    test = KINETO / "hta_trace_diff_test_v100_rank1_cudagraph.json.gz"
    checks = {c.metric: c for c in gate_files(control, test).result.checks
              if c.layer_type == "step"}
    assert checks["kernels"].status == "changed"   # (steps of 0 and 2 layers: other work)
    assert checks["kernels"].detail.startswith(
        "0 layers a step in the baseline, 2 in the run: other work; per step (medians): D "
        "layers +458 kernels (in 4 of 6 steps in the run), C layers +252.5 kernels (in 3 of 6 "
        "steps in the run)")
    assert "steps in the run" not in checks["kernels_max"].detail   # (one step's own parts)


def test_a_baseline_with_nothing_to_check_is_refused(tmp_path):
    """A baseline captured without GPU work (nsys -t nvtx) would pass every run with 0
    checks, a nightly gate that never fails: it is refused, by the library and the CLI."""
    empty = NSYS / "IhorAtlanov-assignment2-systems__result__nsys2025.6.1_NO_CUDA.sqlite"
    hollow = tmp_path / "hollow.json"   # stored by hand, or before breakdown refused one
    hollow.write_text(json.dumps({"schema": 1, "source": {}, "steps": [], "layers": [],
                                  "layer_types": []}))
    result = CliRunner().invoke(main, ["gate", str(hollow), str(BASELINE), "--path",
                                       "specialized"])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"{hollow}: holds no steps and no layers: nothing to check" in result.output
    with pytest.raises(ValueError, match="nothing to check"):
        gate({"trace": Breakdown(source={}, steps=[], layers=[], layer_types=[])},
             _run({"kda": 4}, {"kda": KDA}))
    # nor does a run without GPU work fail as every layer type "missing": a trace without
    # any has nothing to break down (nor does `trace --from` make a run of one), on either side
    nothing = tmp_path / "nothing.json"
    nothing.write_text("[]")   # (a Chrome trace of no events)
    for trace in (empty, nothing):
        for args in ([BASELINE, trace], [trace, BASELINE], [trace, trace]):
            result = CliRunner().invoke(main, ["gate", *map(str, args)])
            assert result.exit_code == 2 and result.output.startswith(
                f"kimi-perf: error: {trace}: no GPU work in this trace"), result.output
    # nor is a breakdown stored without steps a run to check
    result = CliRunner().invoke(main, ["gate", str(BASELINE), str(hollow), "--path",
                                       "specialized"])
    assert result.exit_code == 2 and result.output == (
        f"kimi-perf: error: {hollow}: holds no steps and no layers: nothing to check against "
        "the baseline (a capture without GPU work?)\n")
    # --update replaces a stored baseline that holds nothing, and stores no such run
    stored = tmp_path / "empty.json"
    assert CliRunner().invoke(main, ["gate", str(stored), str(empty), "--update"]).exit_code == 2
    assert not stored.exists()
    stored.write_text(json.dumps({"schema": 1, "source": {}, "steps": [], "layers": [],
                                  "layer_types": []}))
    replaced = CliRunner().invoke(main, ["gate", str(stored), str(BASELINE), "--update"])
    assert replaced.exit_code == 0 and "replaced" in replaced.output
    assert CliRunner().invoke(main, ["gate", str(stored), str(BASELINE)]).exit_code == 0
    # one path of a run that recorded nothing: its capture failed, not its layers
    doc = json.loads(BASELINE.read_text())
    doc["paths"]["specialized"].update(steps=[], layers=[], layer_types=[])
    one_empty = tmp_path / "one-empty.json"
    one_empty.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["gate", str(BASELINE), str(one_empty)])
    assert result.exit_code == 2 and result.output == (
        f"kimi-perf: error: {one_empty}: its path specialized holds no steps and no layers: "
        "nothing to check against the baseline there (a capture without GPU work?)\n")


def test_steps_of_another_phase_are_a_difference_of_the_runs():
    """A decode baseline against a run whose step prefills too: other work, said as a run
    difference (with --metrics kernels its checks would otherwise pass unremarked)."""
    from kimi_perf.gate import gate_files

    decode, mixed = (KINETO / f"tracelens_vllm_gptoss20b_{x}_mi300x.json.gz"
                     for x in ("decode_fullgraph", "prefilldecode_piecewise"))
    gated = gate_files(decode, mixed, Tolerances(metrics="kernels"))
    assert gated.result.run_differences == ["steps decode vs mixed",
                                            "decode requests a step 32 vs 37"]
    assert gate_files(decode, decode).result.run_differences == []
    # steps that name no phase (a profiler's own) say nothing of the work: no difference
    unnamed = KINETO / "hta_a100_alexnet_cuda_sync.json.gz"
    assert gate_files(decode, unnamed, Tolerances(metrics="kernels")).result \
        .run_differences == ["ran on 1 × unnamed GPU (304 CUs) vs 1 × NVIDIA A100-PG509-200 "
                             "(108 SMs)"]   # (an MI300X against an A100: that alone)


def test_a_cpu_run_s_ops_against_gpu_kernels_times_nothing_and_counts_launches():
    """A CPU baseline (ops, host time) against a GPU run (kernels): its times are ``changed``,
    never a regression or an improvement, and the difference is said; its counts are
    checked, the kernel paths' ops being the launches a GPU makes."""
    from kimi_perf.gate import gate_files

    cpu = _run({"kda": 9, "mla": 12}, {"kda": KDA * 1000, "mla": MLA * 1000})
    for b in cpu.values():
        b.source["ops"] = "cpu-ops"
    gpu = _run({"kda": 10, "mla": 12}, {"kda": KDA, "mla": MLA})
    for base, run in ((cpu, gpu), (gpu, cpu)):
        checks = {(c.layer_type, c.metric): c for c in gate(base, run).checks}
        assert {c.status for (_, m), c in checks.items() if m.endswith("_us")} == {"changed"}
        assert checks["kda", "kernels"].status == (
            "regression" if base is cpu else "improvement")
        assert checks["mla", "kernels"].status == "ok"
    alike = gate(cpu, cpu).checks
    assert {c.status for c in alike} == {"ok"}
    # this repository's CPU baseline against a GPU trace (another model: its times unlike)
    trace = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
    gated = gate_files(BASELINE, trace, path_name="specialized")
    assert gated.result.run_differences == [
        "specialized: a CPU run's ops vs GPU kernels",
        "the run records no capture settings (a trace of its own): preset, "
        "batch and TP not compared"]
    assert {c.status for c in gated.result.checks if c.layer_type == "step"
            and c.metric.endswith("_us")} == {"changed"}
    assert gate_files(trace, trace).result.run_differences == []


def test_a_real_slowdown_fails_noise_and_small_changes_pass():
    base = _run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    slower = _run({"kda": 9, "mla": 12}, {"kda": KDA * 1.2, "mla": MLA * 1.03})
    s = statuses(gate(base, slower))
    assert s[("kda", "kernel_us")] == "regression"       # +20%, 40 samples a side
    assert s[("mla", "kernel_us")] == "ok"               # +3% is within the 5% tolerance
    # +10% in the median, but samples that spread over ±50%: the test cannot tell it from noise
    wide = RNG.normal(60.0, 30.0, 8)
    noisy = gate(_run({"kda": 9}, {"kda": wide}), _run({"kda": 9}, {"kda": wide[::-1] * 1.1}))
    layer = [c for c in noisy.checks if c.metric.endswith("_us") and c.layer_type == "kda"]
    assert {c.status for c in layer} == {"noise"} and min(c.p_value for c in layer) > 0.01


def test_few_samples_fall_back_to_the_threshold_and_faster_is_not_a_failure():
    base = _run({"kda": 9}, {"kda": np.array([60.0, 61.0])})
    s = statuses(gate(base, _run({"kda": 9}, {"kda": np.array([70.0, 71.0])})))
    assert s[("kda", "kernel_us")] == "regression"
    faster = gate(base, _run({"kda": 9}, {"kda": np.array([40.0, 41.0])}))
    assert faster.ok and statuses(faster)[("kda", "kernel_us")] == "improvement"


def test_a_layer_type_or_path_the_run_lost_fails():
    base = _run({"kda": 9, "mla": 12}, {"kda": KDA, "mla": MLA})
    lost = gate(base, _run({"kda": 9}, {"kda": KDA}))
    assert {c.status for c in lost.failures} == {"missing"}
    assert {c.layer_type for c in lost.failures} == {"mla"}
    two = {**base, "standard": _breakdown({"kda": 18}, {"kda": KDA})}
    lost_path = gate(two, base)                       # the run lacks the standard path
    assert not lost_path.ok and {c.path for c in lost_path.failures} == {"standard"}
    # the verdict's line says the path once, not an item per layer type and its steps
    assert gate_headline(lost_path).startswith(
        "gate: FAIL, 1 missing (8 checks): the path standard missing from the run (its kda, "
        "step)"), gate_headline(lost_path)
    new = gate(base, two)                             # the run adds one: reported, passes
    assert new.ok and {c.status for c in new.checks if c.path == "standard"} == {"new"}


def test_a_layer_lost_from_every_step_fails_rather_than_speeding_it_up(tmp_path):
    """A decode path that skips a layer: its steps' kernels and µs fall, as a faster path's
    would; its layers a step (8 -> 7, kda 5 -> 4) fail the gate, and the CLI says so."""
    from click.testing import CliRunner

    from kimi_perf.cli import main
    from kimi_perf.gate import gate_files

    doc = json.loads(BASELINE.read_text())
    path = doc["paths"]["specialized"]
    lost = [r for r in path["layers"] if r["type"] == "kda" and r["index"] == 5]
    kernels = lost[0]["kernels"]
    path["layers"] = [r for r in path["layers"] if r not in lost]
    for step in path["steps"]:
        step["layers"] -= 1
        step["kernels"] -= kernels
    kda = next(t for t in path["layer_types"] if t["type"] == "kda")
    kda["layers"] -= len(lost)
    short = tmp_path / "short.json"
    short.write_text(json.dumps(doc))
    result = gate_files(BASELINE, short, Tolerances(metrics="kernels")).result
    assert [(c.path, c.layer_type, c.metric, c.baseline, c.current) for c in result.failures] \
        == [("specialized", "kda", "layers", 5, 4), ("specialized", "step", "layers", 8, 7)]
    assert {c.status for c in result.failures} == {"differs"}
    steps = {c.metric: c.status for c in result.checks
             if c.path == "specialized" and c.layer_type == "step"}
    assert steps["kernels"] == "changed"   # (no improvement: other work; it alone would pass)
    out = CliRunner().invoke(main, ["gate", str(BASELINE), str(short), "--metrics", "kernels"])
    assert out.exit_code == 1
    assert "gate: FAIL, 2 layer counts differ: specialized kda layers 5 -> 4" in " ".join(
        out.output.split())
    # the same layers a step pass
    assert gate_files(BASELINE, BASELINE, Tolerances(metrics="kernels")).result.ok


def test_too_few_samples_for_alpha_fall_back_to_the_threshold():
    """5 samples a side: the exact test's smallest p is 1/252 > 0.001, so at alpha 0.001 it
    could never fail anything; the threshold decides instead, and the table says so under
    its header's promise of a test."""
    from kimi_perf.render import gate_table

    base = _run({"kda": 9}, {"kda": KDA[:5]})
    slower = _run({"kda": 9}, {"kda": KDA[:5] * 1.5})
    result = gate(base, slower, Tolerances(alpha=0.001))
    check = next(c for c in result.checks if c.metric == "kernel_us" and c.layer_type == "kda")
    assert check.status == "regression" and check.p_value is None
    untested = sum(c.p_value is None and c.status == "regression" for c in result.checks
                   if c.metric != "kernels")
    assert gate_table(result).caption.startswith(
        f"p -: {untested} time checks with too few samples for the test to reach α 0.001")
    # 40 layers a side in 4 steps: the layers are tested (said), the 4 steps are not
    tested = gate(_run({"kda": 9}, {"kda": KDA}), _run({"kda": 9}, {"kda": KDA * 1.5}))
    kda = next(c for c in tested.checks if c.metric == "kernel_us" and c.layer_type == "kda")
    assert kda.tested_over == "layers" and kda.p_value is not None
    assert gate_table(tested).caption.split("\n") == [
        "p -: 2 time checks with too few samples for the test to reach α 0.01 (fewer than 5 "
        "steps and layers a side, or 1 / C(n+m, n) ≥ α): the thresholds decided alone; "
        "profile more steps",
        "(layers): too few steps for the test, the layers tested: an optimistic p (the layers "
        "of a step share its noise)"]


def _stepped(us_per_step: np.ndarray, layers_a_step: int, kernels: int = 9) -> dict:
    """One kda layer type: ``layers_a_step`` layers in each of ``len(us_per_step)`` steps,
    each layer's kernel µs its step's figure times a per-layer jitter of 1%."""
    rng = np.random.default_rng(len(us_per_step) * 7 + layers_a_step)
    layers = [{"type": "kda", "step": i, "device": 0, "index": j, "kernels": kernels,
               "kernel_us": float(v * rng.normal(1.0, 0.01)), "span_us": float(v)}
              for i, v in enumerate(us_per_step) for j in range(layers_a_step)]
    steps = [{"index": i, "device": 0, "layers": layers_a_step, "kernels": kernels
              * layers_a_step, "kernel_us": float(v) * layers_a_step,
              "span_us": float(v) * layers_a_step} for i, v in enumerate(us_per_step)]
    return {"specialized": Breakdown(source={}, steps=steps, layers=layers,
                                     layer_types=[{"type": "kda"}])}


def test_the_test_takes_steps_not_the_layers_they_share():
    """The layers of one step share its clocks and host: noise common to a step moves them
    all. 10 steps of 12 layers a side, steps spread over ±9%, the run's 6% slower: pooled,
    120 layers a side read it as far beyond chance; over the steps it is noise. A rise of
    20% in every step is a regression, tested over the steps."""
    from scipy.stats import mannwhitneyu

    per_step = 60.0 * np.array([0.92, 0.95, 0.97, 0.99, 1.0, 1.01, 1.03, 1.05, 1.07, 1.10])
    base = _stepped(per_step, 12)
    for factor, status in ((1.06, "noise"), (1.2, "regression")):
        run = _stepped(per_step[::-1] * factor, 12)
        check = next(c for c in gate(base, run).checks
                     if c.layer_type == "kda" and c.metric == "kernel_us")
        assert (check.status, check.tested_over) == (status, "steps"), factor
        assert check.change > 0.05
    pooled = [np.array([r["kernel_us"] for r in b["specialized"].layers])
              for b in (base, _stepped(per_step[::-1] * 1.06, 12))]
    assert mannwhitneyu(pooled[1], pooled[0], alternative="greater").pvalue < 1e-6
    # where steps are too few for the test, the layers are tested (optimistic, said so)
    few = gate(_stepped(per_step[:3], 12), _stepped(per_step[:3] * 1.2, 12))
    check = next(c for c in few.checks if c.layer_type == "kda" and c.metric == "kernel_us")
    assert (check.status, check.tested_over) == ("regression", "layers")


def test_steps_built_in_memory_without_where_they_ran_gate_without_their_counts():
    """A breakdown built in a notebook may leave out the steps' index and device: the
    layers-a-step check is then left out (no count), not a KeyError."""
    per_step = 60.0 * np.ones(10)
    base, run = _stepped(per_step, 12), _stepped(per_step * 1.2, 12)
    for b in (base, run):
        for step in b["specialized"].steps:
            del step["index"], step["device"]
    checks = {(c.layer_type, c.metric): c for c in gate(base, run).checks}
    assert ("kda", "layers") not in checks
    assert checks[("kda", "kernel_us")].status == "regression"


def test_the_gpus_of_one_step_are_one_sample():
    """A TP step on 2 GPUs: both share its host and its collectives' waits, so a step is one
    sample however many GPUs ran it (its layers' mean over both): the 6% rise of steps
    spreading ±9% is noise here as on one GPU, where 2 samples a step would call it a
    regression. The whole step's check takes one sample a step too."""
    per_step = 60.0 * np.array([0.92, 0.95, 0.97, 0.99, 1.0, 1.01, 1.03, 1.05, 1.07, 1.10])

    def on_two_gpus(values: np.ndarray) -> dict:
        run = _stepped(values, 12)
        b = run["specialized"]
        b.layers.extend([{**r, "device": 1} for r in b.layers])
        b.steps.extend([{**s, "device": 1} for s in b.steps])
        return run

    base = on_two_gpus(per_step)
    checks = {(c.layer_type, c.metric): c for c in gate(base, on_two_gpus(
        per_step[::-1] * 1.06)).checks}
    for key in (("kda", "kernel_us"), ("step", "kernel_us")):
        assert (checks[key].status, checks[key].tested_over) == ("noise", "steps"), key
    from kimi_perf.gate import _step_groups, _step_means

    means = _step_means(np.array([r["kernel_us"] for r in base["specialized"].layers]),
                        _step_groups(base["specialized"], "kda"))
    assert means.shape == (10,)


def test_a_slowdown_of_every_fourth_step_fails_by_the_steps_mean():
    """Medians are robust to a slow step, and so blind to a slowdown of fewer than half the
    steps: every fourth step 60% slower leaves the median step where it was and decode
    tokens/s 13% lower. The steps' mean span (``span_us_mean``, with ``span_us``) catches it,
    by a permutation test over the steps; one stalled step of 40, however long, is noise;
    without steps enough for the test there is no such check."""
    rng = np.random.default_rng(3)
    base_steps, run_steps = (60.0 * rng.normal(1.0, 0.02, 40) for _ in range(2))
    base = _stepped(base_steps, 12)
    slow = run_steps.copy()
    slow[::4] *= 1.6
    result = gate(base, _stepped(slow, 12))
    checks = {(c.layer_type, c.metric): c for c in result.checks}
    assert checks["step", "span_us"].status == "ok"
    assert checks["step", "span_us"].change < 0.02
    mean = checks["step", "span_us_mean"]
    assert (mean.status, mean.tested_over) == ("regression", "steps")
    assert mean.p_value < 1e-3 and 0.13 < mean.change < 0.17
    assert mean.baseline == pytest.approx(12 * base_steps.mean())
    assert mean.detail.startswith("per step (means): kda layers +") and "idle" not in mean.detail
    assert result.metric_name(mean) == "span_us (mean)" and not result.ok
    # the same p on the same input (the test's resamples are seeded)
    assert next(c for c in gate(base, _stepped(slow, 12)).checks
                if c.metric == "span_us_mean").p_value == mean.p_value
    # the GPU default's profiled steps are enough to find it; 10 a side were not, 20 a side
    # were half the time
    from kimi_perf.capture import default_request

    n = default_request(True).steps
    by_steps = {}
    for steps in (10, n):
        short = slow[:steps]
        by_steps[steps] = next(c for c in gate(_stepped(base_steps[:steps], 12),
                                               _stepped(short, 12)).checks
                               if c.metric == "span_us_mean")
    assert by_steps[n].status == "regression" and by_steps[10].status == "noise"
    # and not by one seed's luck: every seed of 10 (at 20 a side, 3 of these 10 were found)
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        drawn, slowed = (60.0 * rng.normal(1.0, 0.02, n) for _ in range(2))
        slowed[::4] *= 1.6
        assert next(c for c in gate(_stepped(drawn, 12), _stepped(slowed, 12)).checks
                    if c.metric == "span_us_mean").status == "regression", seed
    stalled = run_steps.copy()
    stalled[7] *= 20
    stall = next(c for c in gate(base, _stepped(stalled, 12)).checks
                 if c.metric == "span_us_mean")
    assert stall.change > 0.4 and stall.status == "noise" and stall.p_value > 0.3
    same = next(c for c in gate(base, _stepped(run_steps, 12)).checks
                if c.metric == "span_us_mean")
    assert same.status == "ok"
    few = gate(_stepped(base_steps[:4], 12), _stepped(slow[:4] * 2, 12))
    assert "span_us_mean" not in {c.metric for c in few.checks}
    only_kernels = gate(base, _stepped(slow, 12), Tolerances(metrics="kernels,kernel_us"))
    assert "span_us_mean" not in {c.metric for c in only_kernels.checks}
    # the other way, an improvement
    back = next(c for c in gate(_stepped(slow, 12), base).checks if c.metric == "span_us_mean")
    assert back.status == "improvement" and back.p_value < 1e-3 and back.change < -0.1
    # a step on two GPUs is one sample, their mean: the same verdict and p as on one
    two = [_stepped(v, 12) for v in (base_steps, slow)]
    for run in two:
        b = run["specialized"]
        b.steps.extend([{**step, "device": 1} for step in b.steps])
        b.layers.extend([{**layer, "device": 1} for layer in b.layers])
    on_two = next(c for c in gate(*two).checks if c.metric == "span_us_mean")
    assert (on_two.status, on_two.p_value) == ("regression", mean.p_value)
    # an alpha the resamples cannot reach (their smallest p is 1 / (resamples + 1)): more
    # resamples, up to 2 million; below that, no such check
    tiny = next(c for c in gate(base, _stepped(run_steps * 2, 12), Tolerances(alpha=1e-5)).checks
                if c.metric == "span_us_mean")
    assert tiny.status == "regression" and tiny.p_value < 1e-5
    assert "span_us_mean" not in {c.metric for c in gate(
        base, _stepped(run_steps * 2, 12), Tolerances(alpha=1e-7)).checks}


def test_a_class_of_other_rules_is_changed_and_a_family_shares_alpha():
    """Kernel classes from other rules (a --rules file on one side) hold other kernels: a
    class's checks are changed, not a regression. The classes of a type share --alpha (the
    table says the α each was tested at)."""
    base, run = _with_classes(20.0, 60.0), _with_classes(40.0, 40.0)
    for b, rules in ((base, None), (run, "1 extra (sha256:abc)")):
        b["specialized"].source["breakdown_options"] = {"rules": rules, "default_rules": "x"}
    attention = next(c for c in gate(base, run).checks if c.kernel_class == "attention")
    assert attention.status == "changed" and "other kernel-class rules" in attention.detail
    base["specialized"].source["breakdown_options"]["rules"] = "1 extra (sha256:abc)"
    result = gate(base, run)
    attention = next(c for c in result.checks if c.kernel_class == "attention")
    assert attention.status == "regression" and attention.alpha == pytest.approx(0.01 / 3)
    assert "(α 0.0033)" in render.tables_text([render.gate_table(result)])


def test_a_rise_of_a_microsecond_or_less_is_no_regression():
    """Figures near 0 (a kernel under a µs, a trace in whole µs): 0.4 -> 1.2 µs is +200% but
    under the 1 µs absolute tolerance; --abs-tol 0 gates the ratio alone."""
    steps = np.full(10, 0.4)
    base, run = _stepped(steps, 4), _stepped(steps * 3, 4)
    check = next(c for c in gate(base, run).checks
                 if c.layer_type == "kda" and c.metric == "span_us")
    assert check.status == "ok" and check.change == pytest.approx(2.0)
    strict = gate(base, run, Tolerances(abs_tol_us=0.0))
    assert statuses(strict)[("kda", "span_us")] == "regression"
    with pytest.raises(ValueError, match="abs_tol_us"):
        Tolerances(abs_tol_us=-1.0)
    out = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "--abs-tol", "nan"])
    assert out.exit_code == 2 and "'nan' is not a finite number" in out.output


def test_the_largest_count_of_windows_of_unequal_steps_is_no_regression():
    """Work every 8th step (a copy in one layer, at step 8 here): a window of 10 steps holds
    it, one of 5 does not. The largest counts differ for that alone (changed, said why);
    windows of equal steps still fail on it, and the medians compare as ever."""
    def periodic(steps: int, extra: bool = True) -> dict:
        run = _stepped(np.full(steps, 60.0), 4)
        if extra and steps > 8:
            run["specialized"].layers[8 * 4]["kernels"] += 1   # step 8's first layer
        return run

    base, run = periodic(5), periodic(10)
    checks = {c.metric: c for c in gate(base, run).checks if c.layer_type == "kda"}
    assert checks["kernels_max"].status == "changed"
    assert "of 5 steps in the baseline, of 10 in the run" in checks["kernels_max"].detail
    assert checks["kernels"].status == "ok"
    assert statuses(gate(periodic(10, extra=False), run))[("kda", "kernels_max")] == \
        "regression"
    assert statuses(gate(periodic(9), run))[("kda", "kernels_max")] == "ok"
    # a shorter run's larger count is no window's doing: a regression
    assert statuses(gate(periodic(20, extra=False), run))[("kda", "kernels_max")] == \
        "regression"


def _with_classes(attention_us: float, moe_us: float, steps: int = 10) -> dict:
    """One kda type of 4 layers a step, 10 steps: an attention and a MoE kernel (1% jitter
    per step), a norm of 2 µs; each layer's kernel µs is the sum of its classes."""
    rng = np.random.default_rng(5)   # the same jitter for every figure
    layers = []
    for i in range(steps):
        jitter = rng.normal(1.0, 0.01)
        for j in range(4):
            classes = {"attention": {"kernels": 1, "us": attention_us * jitter},
                       "moe": {"kernels": 1, "us": moe_us * jitter},
                       "norm": {"kernels": 1, "us": 2.0}}
            total = sum(c["us"] for c in classes.values())
            layers.append({"type": "kda", "step": i, "device": 0, "index": j, "kernels": 3,
                           "kernel_us": total, "span_us": total + 1, "classes": classes})
    per_step = [sum(r["kernel_us"] for r in layers if r["step"] == i) for i in range(steps)]
    steps_rows = [{"index": i, "device": 0, "layers": 4, "kernels": 12, "kernel_us": v,
                   "span_us": v + 4} for i, v in enumerate(per_step)]
    return {"specialized": Breakdown(source={}, steps=steps_rows, layers=layers,
                                     layer_types=[{"type": "kda"}])}


def test_a_class_that_slowed_fails_though_its_layer_did_not():
    """Attention twice as slow, hidden by a MoE as much faster: the layer's kernel µs is
    the same, the class's fails (kernel_us (attention), tested over the steps); the MoE's
    is an improvement. A class's checks come with kernel_us (not with --metrics kernels),
    and a class that moved by a µs or less passes."""
    base, run = _with_classes(20.0, 60.0), _with_classes(40.0, 40.0)
    result = gate(base, run)
    by = {(c.metric, c.kernel_class): c for c in result.checks if c.layer_type == "kda"}
    assert by[("kernel_us", None)].status == "ok"
    attention = by[("class_us", "attention")]
    assert (attention.status, attention.tested_over) == ("regression", "steps")
    assert attention.change == pytest.approx(1.0, abs=0.05)
    assert by[("class_us", "moe")].status == "improvement"
    assert by[("class_us", "norm")].status == "ok"
    assert result.metric_name(attention) == "kernel_us (attention)"
    assert "specialized kda kernel_us (attention) 19.99 -> 39.97" in gate_headline(result)
    assert not any(c.metric == "class_us" for c in gate(base, run, Tolerances(
        metrics="kernels")).checks)
    assert gate(base, _with_classes(20.9, 60.0)).ok     # +0.9 µs: within --abs-tol
    # behind it: the class's own launches, and its part of the typical layer
    for b, (att, moe) in ((base, (20.0, 60.0)), (run, (40.0, 40.0))):
        b["specialized"].layer_types[0]["typical_layer"] = {"layers": 40, "kernels": [
            {"name": "kda_decode", "class": "attention", "us": att},
            {"name": "moe_fc1", "class": "moe", "us": moe},
            {"name": "rms_norm", "class": "norm", "us": 2.0}]}
    attention = next(c for c in gate(base, run).checks if c.kernel_class == "attention")
    assert attention.detail == ("kda_decode +20.0 µs; typical layer's attention +20.0 µs in "
                                "all")


def _layers_noisy(seed: int, steps: int = 10, slow: dict[int, float] | None = None) -> dict:
    """12 kda layers a step, each layer's µs 60 with 5% noise of its own; ``slow``: a factor
    for some layers (by index)."""
    rng = np.random.default_rng(seed)
    layers = [{"type": "kda", "step": i, "device": 0, "index": j, "kernels": 3,
               "kernel_us": (us := 60.0 * rng.normal(1.0, 0.05) * (slow or {}).get(j, 1.0)),
               "span_us": us + 1,
               "classes": {"attention": {"kernels": 1, "us": us - 40.0},
                           "moe": {"kernels": 2, "us": 40.0}}}
              for i in range(steps) for j in range(12)]
    rows = [{"index": i, "device": 0, "layers": 12, "kernels": 36,
             "kernel_us": (v := sum(r["kernel_us"] for r in layers if r["step"] == i)),
             "span_us": v + 12} for i in range(steps)]
    return {"specialized": Breakdown(source={}, steps=rows, layers=layers,
                                     layer_types=[{"type": "kda"}])}


def test_one_layer_of_many_twice_as_slow_fails_as_that_layer():
    """Layer 5 of 12 twice as slow in every step: the type's median does not move, the layer
    does (kernel_us (layer 5), its classes behind it). Of the same work with noise of its
    own per layer, the largest of 12 rises is tested at alpha / 12: no false alarm over 30
    reruns. With 3 steps a side there is no such check (the largest of many noisy ratios)."""
    base = _layers_noisy(0)
    result = gate(base, _layers_noisy(1, slow={5: 2.0}))
    by = {c.metric: c for c in result.checks if c.layer_type == "kda"}
    assert by["kernel_us"].status == "ok"
    layer = by["layer_kernel_us"]
    assert (layer.status, layer.layer_index, layer.tested_over) == ("regression", 5, "steps")
    assert layer.change == pytest.approx(1.0, abs=0.1) and layer.p_value < 0.01 / 12
    assert result.metric_name(layer) == "kernel_us (layer 5)"
    assert layer.detail.startswith("its classes (medians over the steps): attention +")
    assert not any(gate(base, _layers_noisy(seed)).failures for seed in range(2, 32))
    few = gate(_layers_noisy(0, steps=3), _layers_noisy(1, steps=3, slow={5: 2.0}))
    assert not any(c.metric == "layer_kernel_us" for c in few.checks)
    # a type of one layer a step: its own check is that layer's
    one = {"specialized": _with_classes(20.0, 60.0)["specialized"]}
    for r in one["specialized"].layers:
        r["index"] = 0
    assert not any(c.metric == "layer_kernel_us" for c in gate(one, one).checks)
    assert layer.alpha == pytest.approx(0.01 / 12)
    # every layer faster: the one that "rose most" fell, no test made of it (its p was
    # shown beside "ok": 0.0011, the test of a fall)
    faster = gate(base, _layers_noisy(1, slow=dict.fromkeys(range(12), 0.5)))
    fell = next(c for c in faster.checks if c.metric == "layer_kernel_us")
    assert (fell.status, fell.p_value, fell.tested_over) == ("ok", None, None)


def test_paths_are_matched_by_name_and_steps_only_when_found():
    std = {"standard": _breakdown({"kda": 18}, {"kda": KDA})}
    fast = _run({"kda": 9}, {"kda": KDA})
    result = gate(std, fast)          # not compared with each other: one lost, one new
    assert {(c.path, c.status) for c in result.checks} == {("standard", "missing"),
                                                          ("specialized", "new")}
    plain = {"trace": _breakdown({"kda": 9}, {"kda": KDA})}
    assert gate(fast, plain).ok       # a trace takes the one path's place
    no_steps = _run({"kda": 9}, {"kda": KDA})
    no_steps["specialized"].steps = []
    assert gate(no_steps, no_steps).ok and all(c.layer_type != "step"
                                               for c in gate(no_steps, no_steps).checks)


def test_tolerances_are_checked_when_made():
    with pytest.raises(ValueError, match=r"choose from kernels, kernel_us, span_us, one or "
                                         r"more \(not flops\)"):
        Tolerances(metrics="kernels,flops")    # the unknown one named, not the good one
    for empty in ((), "", " , "):
        with pytest.raises(ValueError, match=r"\(not an empty list\)"):
            Tolerances(metrics=empty)
    for stray in ("kernels,", "kernels,,span_us", ", kernels"):
        with pytest.raises(ValueError, match=r"names between commas, none empty \(not '"):
            Tolerances(metrics=stray)
    # (alpha 0 or 1: a test that never, or always, rejects; 0 would leave the threshold alone,
    # stricter than a small alpha, not laxer)
    for bad in ({"rel_tol": -0.1}, {"rel_tol": float("nan")}, {"alpha": 1.5}, {"alpha": 0},
                {"alpha": 1}):
        with pytest.raises(ValueError):
            Tolerances(**bad)
    # a notebook's "kernels,span_us" is the CLI's --metrics: a tuple, not its letters; each
    # metric once, however often named
    assert Tolerances(metrics="kernels, span_us").metrics == ("kernels", "span_us")
    assert Tolerances(metrics="kernels,span_us,kernels").metrics == ("kernels", "span_us")
    for alpha in ("0", "1"):
        result = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "--alpha",
                                           alpha])
        assert result.exit_code == 2 and "--alpha" in result.output


def test_cli_exit_codes_and_update(tmp_path):
    trace = EXAMPLE_TRACE  # vLLM decode steps, layers found by their repeating pattern
    runner = CliRunner()
    result = runner.invoke(main, ["gate", str(trace), str(trace)])
    assert result.exit_code == 0 and "gate: pass" in result.output
    # a baseline with one kernel fewer per layer than the trace has
    runs, stored, _ = load_run(trace)
    # the layers are held as columns (LayerRows), and written as the whole list would be
    text = json_text(stored)
    assert text == json_text(runs["trace"].to_json())
    doc = json.loads(text)
    assert len(doc["layers"]) == len(runs["trace"].layers) > 0
    for t in doc["layer_types"]:
        t["kernels"] -= 1
    for row in doc["layers"]:
        row["kernels"] -= 1
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps(doc))
    result = runner.invoke(main, ["gate", str(baseline), str(trace), "--format", "json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert not report["ok"] and {c["metric"] for c in report["checks"]
                                 if c["status"] == "regression"} == {"kernels", "kernels_max"}
    result = runner.invoke(main, ["gate", str(baseline), str(trace), "--update", "--format",
                                  "json"])
    assert result.exit_code == 0       # the failed gate printed, and the baseline replaced
    report = json.loads(result.output[: result.output.rindex("}") + 1])
    assert not report["ok"] and report["updated"] == str(baseline)
    assert runner.invoke(main, ["gate", str(baseline), str(trace)]).exit_code == 0
    created = tmp_path / "new" / "base.json"
    created.parent.mkdir()
    made = runner.invoke(main, ["gate", str(created), str(trace), "--update", "--format",
                                "json"])
    assert made.exit_code == 0       # nothing to gate against: stored, and said in JSON too
    said = json.loads(made.output[: made.output.rindex("}") + 1])
    assert said["ok"] and said["checks"] == [] and said["updated"] == str(created)
    assert said["headline"] == f"baseline {created} created from {trace}" and said["failed"] == 0
    assert runner.invoke(main, ["gate", str(created), str(trace)]).exit_code == 0
    # a baseline edited since (its summaries not its rows'): said, with what to do
    edited = json.loads(created.read_text())
    edited["layer_types"][0]["layers"] += 1
    created.write_text(json.dumps(edited))
    refused = runner.invoke(main, ["gate", str(created), str(trace), "--update"])
    assert refused.exit_code == 2 and "--update gates against it first; remove it to store " \
        "the run there" in refused.output
    created.unlink()
    assert runner.invoke(main, ["gate", str(created), str(trace), "--update"]).exit_code == 0
    result = runner.invoke(main, ["gate", str(trace), str(baseline), "--update"])
    assert result.exit_code == 2 and "not a trace" in result.output
    (tmp_path / "other.json").write_text("{}")     # JSON of another kind: not replaced
    result = runner.invoke(main, ["gate", str(tmp_path / "other.json"), str(trace),
                                  "--update"])
    assert result.exit_code == 2 and "other.json: not a kimi-perf baseline (a breakdown " \
        "JSON) for --update to replace: remove it first" in result.output
    assert (tmp_path / "other.json").read_text() == "{}"
    (tmp_path / "broken.json").write_text('{"schema": 1, "paths"')
    result = runner.invoke(main, ["gate", str(tmp_path / "broken.json"), str(trace)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "broken.json: not JSON" in result.output
    # JSON that Python's decoder refuses other than as a syntax error
    for name, text in (("huge.json", '{"schema": 1, "x": ' + "9" * 5000 + "}"),
                       ("deep.json", '{"schema": 1, "paths": ' + "[" * 100000 + "]" * 100000
                        + "}")):
        (tmp_path / name).write_text(text)
        for command in (["gate", str(tmp_path / name), str(trace)],
                        ["report", str(tmp_path / name), "-o", str(tmp_path / "r.html")]):
            result = runner.invoke(main, command)
            assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
            assert f"{name}: not JSON that can be read" in result.output
    assert not (tmp_path / "r.html").exists()
    result = runner.invoke(main, ["gate", str(trace), str(trace), "--metrics", "flops"])
    assert result.exit_code == 2 and "--metrics" in result.output


def test_update_keeps_a_read_only_baseline(tmp_path):
    """A baseline made read-only (kept by hand, say) is refused before any work, not replaced."""
    kept = tmp_path / "kept.json"
    shutil.copy(BASELINE, kept)
    kept.chmod(0o444)
    result = CliRunner().invoke(main, ["gate", str(kept), str(BASELINE), "--update",
                                       "--metrics", "kernels"])
    assert result.exit_code == 2 and result.output == (
        f"kimi-perf: error: {kept}: cannot write: it is read-only (mode 444)\n")
    assert kept.read_text() == BASELINE.read_text()


def test_update_reads_each_file_once(tmp_path, monkeypatch):
    """``gate --update`` checks the run it then stores: the trace is read and broken down
    once, not once to see that it holds work and again to gate it."""
    import kimi_perf.gate as gate_module

    reads: list[Path] = []
    real = gate_module.load_run
    monkeypatch.setattr(gate_module, "load_run",
                        lambda path, phase="auto", **options: reads.append(Path(path))
                        or real(path, phase, **options))
    baseline = tmp_path / "base.json"
    baseline.write_text(json_text(real(EXAMPLE_TRACE)[1]))
    result = CliRunner().invoke(main, ["gate", str(baseline), str(EXAMPLE_TRACE), "--update"])
    assert result.exit_code == 0 and "updated from" in result.output
    assert sorted(map(str, reads)) == sorted([str(baseline), str(EXAMPLE_TRACE)])


def test_this_repository_keeps_its_launch_counts(tmp_path):
    """Nightly-CI use on this CPU: a fresh `kimi-perf trace` has the launches per layer that
    the committed baseline has (the µs of a CPU run are not a speed figure: by default the
    gate checks its ops alone)."""
    pytest.importorskip("torch")
    runner = CliRunner()
    result = runner.invoke(main, ["trace", "--layers", "4", "--steps", "1", "--warmup", "0",
                                  "--context", "3", "--out", str(tmp_path), "--format",
                                  "json"])
    assert result.exit_code == 0, result.output
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    result = runner.invoke(main, ["gate", str(BASELINE), str(run_dir), "--all"])
    assert result.exit_code == 0, result.output
    assert "kernel_us, span_us of CPU runs not checked" in result.output
    # median and largest kernels and layers a step, 2 paths × (3 layer types + the steps)
    assert "gate: pass (24 checks)" in result.output
    assert "baseline vs run (launches only)" in result.output   # no time criterion
    # the same run against a baseline from before the shared experts joined the routed
    # experts' launches (two more per layer): an improvement; the reverse fails
    old = tmp_path / "old.json"
    shutil.copy(BASELINE, old)
    doc = json.loads(old.read_text())
    for t in doc["paths"]["specialized"]["layer_types"]:
        t["kernels"] += 2
    for row in doc["paths"]["specialized"]["layers"]:
        row["kernels"] += 2
    old.write_text(json.dumps(doc))
    assert runner.invoke(main, ["gate", str(old), str(run_dir), "--metrics",
                                "kernels"]).exit_code == 0
    result = runner.invoke(main, ["gate", str(run_dir / "breakdown.json"), str(old),
                                  "--metrics", "kernels"])
    assert result.exit_code == 1 and "specialized kda ops 9 -> 11" in " ".join(
        result.output.split())
    # --update on a run directory would leave its run.json and traces another run's: refused
    kept = (run_dir / "breakdown.json").read_text()
    for baseline in (run_dir, run_dir / "breakdown.json"):
        result = runner.invoke(main, ["gate", str(baseline), str(old), "--update"])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert "is a kimi-perf run directory's: its run.json and traces" in result.output
    assert (run_dir / "breakdown.json").read_text() == kept
    # a copy of it is a baseline of its own; storing a failing run says so
    copy = tmp_path / "copy.json"
    shutil.copy(run_dir / "breakdown.json", copy)
    result = runner.invoke(main, ["gate", str(copy), str(old), "--update", "--metrics",
                                  "kernels"])
    assert result.exit_code == 0 and json.loads(copy.read_text()) == {
        **doc, "gate_tolerances": {"rel_tol": 0.05, "abs_tol_us": 1.0, "alpha": 0.01,
                                   "metrics": "kernels"}}   # (with the tolerances given)
    assert "(what the gate above failed is now the baseline)" in result.output


def test_a_directory_without_a_run_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["gate", str(tmp_path), str(BASELINE)])
    assert result.exit_code == 2 and "no breakdown.json" in result.output
    assert Path(BASELINE).exists()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_fuzzed_baselines_give_one_line_errors(data):
    """A baseline cut short or with a field changed: the gate runs, or exits 2 with one line
    naming the file, never a traceback."""
    text = BASELINE.read_text()
    doc = json.loads(text)
    junk = st.sampled_from([None, "9", [], {}, True, -1, 1.5, 1e300, 10**6, 10**400])
    what = data.draw(st.sampled_from(["cut", "layer", "step", "type", "source", "timeline",
                                      "run"]))
    if what == "cut":
        mutated = text[: data.draw(st.integers(0, len(text) - 1))]
    else:
        path = doc["paths"]["specialized"]
        if what == "layer":
            row = data.draw(st.sampled_from(path["layers"]))
            row[data.draw(st.sampled_from(["type", "kernels", "kernel_us", "span_us", "gap_us",
                                           "index", "step", "device"]))] = data.draw(junk)
        elif what == "step":
            row = data.draw(st.sampled_from(path["steps"]))
            key = data.draw(st.sampled_from(["index", "device", "name", "layers", "gap_us",
                                             "layer_source", "prologue", "epilogue"]))
            row[key] = data.draw(st.one_of(junk, st.just({"kernels": "1", "span_us": 2.0})))
        elif what == "type":
            layer_type = data.draw(st.sampled_from(path["layer_types"]))
            layer_type[data.draw(st.sampled_from(["layers", "kernels", "gap_us", "pattern",
                                                  "classes", "two_groups"]))] = data.draw(
                st.one_of(junk, st.just([{"figure": "attention", "low_us": 1.0,
                                          "high_us": 2.0, "low_layers": 2,
                                          "high_layers": [1, "<b>"]}])))
        elif what == "source":
            key = data.draw(st.sampled_from(["source", "ops", "outside_steps",
                                             "other_thread_ops", "gpus", "file",
                                             "steps_left_out"]))
            if key == "source":
                path["source"] = data.draw(junk)
            else:
                path["source"][key] = data.draw(st.one_of(junk, st.just("<b>x</b>"),
                                                          st.just({"prefill": -2})))
        elif what == "timeline":
            op = data.draw(st.sampled_from(data.draw(st.sampled_from(
                path["timeline"]["segments"]))["ops"]))
            op[data.draw(st.integers(0, 3))] = data.draw(junk)
        elif data.draw(st.booleans()):   # the run's information, or a field of it
            key = data.draw(st.sampled_from([None, "n_layers", "tp", "request", "environment",
                                             "paths", "floors"]))
            if key is None:
                doc["run"] = data.draw(junk)
            else:
                doc["run"][key] = data.draw(junk)
        else:
            metrics = doc["run"]["paths"]["standard"]
            key = data.draw(st.sampled_from(["decode_tokens_per_s", "step_latency_s",
                                             "fallbacks", "timed"]))
            metrics[key] = data.draw(junk)
        mutated = json.dumps(doc)
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "base.json"
        bad.write_text(mutated)
        report = Path(tmp) / "r.html"
        for args in (["gate", bad, BASELINE], ["breakdown", bad, "--path", "specialized"],
                     ["report", bad, "-o", report]):
            result = CliRunner().invoke(main, [str(a) for a in args])
            assert result.exception is None or isinstance(result.exception, SystemExit)
            if result.exit_code == 2:
                assert result.output.count("\n") == 1 and "base.json" in result.output
        assert report.exists() == (result.exit_code == 0)


@pytest.mark.parametrize("typical", [{"layers": 3}, "x", {"layers": 3, "kernels": [
    {"name": "k", "class": "gemm", "us": "1"}]}, {"layers": 3, "kernels": [{"name": 5}]},
    *({"layers": 3, "kernels": [{"name": "k", "class": "gemm", "us": 1.0, "spread_us": bad}]}
      for bad in ("x", [1.0], [1.0, "2"], [1.0, -2.0]))])
def test_a_malformed_typical_layer_is_one_line(tmp_path, typical):
    doc = json.loads(BASELINE.read_text())
    (kda,) = [t for t in doc["paths"]["specialized"]["layer_types"] if t["type"] == "kda"]
    kda["typical_layer"] = typical
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for args in (["gate", bad, BASELINE], ["compare", bad, "--kernels"],
                 ["compare", BASELINE, bad, "--path", "specialized", "--kernels"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert "bad.json: layer type 'kda': typical_layer is not" in result.output


@pytest.mark.parametrize(("key", "value"), [
    ("enclosing_steps", [{"step": "s", "encloses": "2", "ops": 3}]),
    ("enclosing_steps", {"step": "s"}), ("enclosing_steps", [{"step": 1, "encloses": 2,
                                                               "ops": 3}]),
    ("outside_steps", {"ops": 3, "kernel_us": 1.0, "in_ranges": [{"range": 1, "ops": 3}]}),
    ("outside_steps", {"ops": 3, "kernel_us": 1.0, "in_ranges": "prefill"}),
    ("outside_steps", {"ops": 3, "kernel_us": 1.0, "in_ranges": [{"ops": 3}]}),
    ("gpus", [{"name": 5, "sm_count": 132}]), ("untimed", {"kernels": -1, "memops": 0}),
    ("untimed_ranges", -2),
    ("duplicates", {"kernels": "2", "memops": 0}),
    ("steps_holding_passes", [{"step": "s", "passes": 2}]), ("tool", 3),
    ("captures", [1, 2]), ("graph_replays", {"placed_at_capture": 1}),
    ("graph_replays", "x"), ("graph_captures", "many"), ("graph_captures", [1]),
    ("breakdown_options", {"steps": 5}),
    ("breakdown_options", ["auto"])])
def test_malformed_step_notes_are_one_line(tmp_path, key, value):
    doc = json.loads(BASELINE.read_text())
    doc["paths"]["specialized"]["source"][key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for args in (["gate", bad, BASELINE], ["breakdown", bad]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert f"bad.json: source.{key} is not " in result.output   # the field named


@pytest.mark.parametrize("where, key, value", [
    ("layer_types", "kernels", "x"), ("layer_types", "span_us", None),
    ("layer_types", "layers", "3"), ("layer_types", "gap_us", float("inf")),
    ("layer_types", "classes", {"gemm": {"kernels": 1}}), ("layers", "classes", []),
    ("steps", "phase", ["decode"]), ("layer_types", "two_groups", [{"figure": "x"}]),
    ("steps", "layers", "x"), ("steps", "gap_us", "x"), ("steps", "prologue", 0),
    ("steps", "epilogue", {"kernels": 1, "span_us": None}), ("steps", "index", "x"),
    ("steps", "device", None), ("steps", "layer_source", {}), ("layers", "gap_us", []),
    ("layers", "index", 1.5), ("layers", "step", None), ("layers", "kernels", 1e300),
    ("layers", "kernels", 1.5), ("steps", "kernels", 2.5)])
def test_malformed_stored_figures_are_one_line_for_every_command(tmp_path, where, key, value):
    """Every command that reads a stored breakdown checks the figures it prints first."""
    doc = json.loads(BASELINE.read_text())
    doc["paths"]["specialized"][where][0][key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for args in (["gate", bad, BASELINE], ["compare", bad], ["breakdown", bad],
                 ["report", bad, "-o", tmp_path / "r.html"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2 and result.output.count("\n") == 1, (args, result.output)
        assert "bad.json" in result.output
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("run", [[1, 2], "tiny", 3])
def test_run_information_not_an_object_is_one_line_for_every_command(tmp_path, run):
    doc = json.loads(BASELINE.read_text())
    doc["run"] = run
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for args in (["gate", bad, BASELINE], ["gate", BASELINE, bad], ["compare", bad, BASELINE],
                 ["breakdown", bad], ["report", bad, "-o", tmp_path / "r.html"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2, (args, result.output)
        assert result.output == "kimi-perf: error: " + str(bad) + ": 'run' is not an object\n"


def test_stored_steps_without_their_optional_fields_serve_every_command(tmp_path):
    """A step stored before its name, how its layers were found, its phase or its other
    threads' work were recorded (all optional to the checks): every command prints it."""
    doc = json.loads(BASELINE.read_text())
    for step in doc["paths"]["specialized"]["steps"]:
        for key in ("name", "layer_source", "layers", "phase", "other_thread_ops"):
            step.pop(key, None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    for args in (["gate", old, BASELINE], ["compare", old], ["breakdown", old, "--path",
                                                             "specialized"],
                 ["report", old, "-o", tmp_path / "r.html"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        # (CliRunner keeps a crash's traceback out of the output: its exception says it)
        assert result.exception is None or isinstance(result.exception, SystemExit), args
        assert result.exit_code == 0, (args, result.output)   # (the same figures)
    assert "<h2>Steps</h2>" in (tmp_path / "r.html").read_text()


def test_gate_says_when_baseline_and_run_were_captured_differently(tmp_path):
    """A run at TP 2 and batch 1 against the TP 1, batch 2 baseline: its all-reduces are no
    regression of the code, and the gate says what differs (text and JSON). A CPU run's µs
    are CPU time: left unchecked by default, and said to be CPU time where named."""
    doc = json.loads(BASELINE.read_text())
    doc["run"]["tp"], doc["run"]["batch"] = 2, 1
    doc["run"]["request"]["graphs"] = True
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    out = CliRunner().invoke(main, ["gate", str(BASELINE), str(other), "--format", "json"])
    assert json.loads(out.output)["run_differences"] == [
        "batch 2 vs 1", "TP 1 vs 2", "CUDA graphs off vs on"]
    text = " ".join(CliRunner().invoke(main, ["gate", str(BASELINE), str(other)]).output.split())
    assert ("the baseline and the run were captured differently: batch 2 vs 1; TP 1 vs 2; "
            "CUDA graphs off vs on") in text
    assert ("kernel_us, span_us of CPU runs not checked (CPU time, noisy and no speed figure): "
            "--metrics kernels,kernel_us,span_us checks them") in text
    named = " ".join(CliRunner().invoke(main, ["gate", str(BASELINE), str(other), "--metrics",
                                               "kernels,kernel_us,span_us"]).output.split())
    assert "kernel_us, span_us of a CPU run are CPU time" in named
    assert "not checked" not in named
    same = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "--metrics",
                                     "kernels"])
    assert same.exit_code == 0 and "captured differently" not in same.output
    assert "of a CPU run are CPU time" not in same.output
    bare = CliRunner().invoke(main, ["gate", str(BASELINE), str(BASELINE), "--format", "json"])
    assert json.loads(bare.output)["run_differences"] == []
    # a trace --from run records no capture settings: nothing to set against them
    from kimi_perf.runs import run_differences

    analysed = {"run": {"command": "kimi-perf trace --from x", "files": ["x.sqlite"]}}
    spec = json.loads(BASELINE.read_text())
    spec["run"]["spec_tokens"] = 3
    assert run_differences(analysed, spec) == []
    old = json.loads(BASELINE.read_text())
    old["run"].pop("spec_tokens", None)       # a capture from before speculative decoding
    assert run_differences(old, spec) == ["draft tokens 0 vs 3"]
    # the specialized path's opt-ins change its launches: a capture from before them had none
    grouped = json.loads(BASELINE.read_text())
    grouped["run"]["request"].update(group_experts_from=16, l2_prefetch=True)
    assert run_differences(old, grouped) == ["L2 prefetch off vs on",
                                             "experts grouped from off vs 16"]
    # other weights and routing, or fewer warm-up steps before the profiled ones
    reseeded = json.loads(BASELINE.read_text())
    reseeded["run"]["request"]["seed"] = 3
    reseeded["run"]["warmup_steps"] = 0
    assert run_differences(spec, reseeded) == ["warm-up steps 1 vs 0", "seed 0 vs 3",
                                               "draft tokens 3 vs 0"]
    unseeded = json.loads(BASELINE.read_text())
    del unseeded["run"]["request"]["seed"]      # a capture from before --seed: not known
    assert run_differences(unseeded, reseeded) == ["warm-up steps 1 vs 0"]
    assert run_differences(grouped, grouped) == []


def test_strict_fails_captures_made_differently(tmp_path):
    """--strict: a run captured otherwise than its baseline (another batch, say) fails, where
    without it the line under the table says so and the checks decide."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    doc = json.loads(BASELINE.read_text())
    doc["run"]["batch"] = 3
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    runner = CliRunner()
    lax = runner.invoke(main, ["gate", str(BASELINE), str(other), "--metrics", "kernels"])
    assert lax.exit_code == 0 and "captured differently: batch 2 vs 3" in lax.output
    strict = runner.invoke(main, ["gate", str(BASELINE), str(other), "--metrics", "kernels",
                                  "--strict", "--format", "json"])
    assert strict.exit_code == 1
    (failed,) = [c for c in json.loads(strict.output)["checks"] if c["status"] != "ok"]
    assert (failed["status"], failed["detail"]) == ("captured differently", "batch 2 vs 3")
    said = runner.invoke(main, ["gate", str(BASELINE), str(other), "--strict"])
    assert "gate: FAIL, the captures differ: batch 2 vs 3" in " ".join(said.output.split())
    # with regressions too, how the captures differ leads the list: it explains them
    for step in doc["paths"]["specialized"]["steps"]:
        step["kernels"] += 1     # a launch outside every layer
    other.write_text(json.dumps(doc))
    said = runner.invoke(main, ["gate", str(BASELINE), str(other), "--strict", "--metrics",
                                "kernels"])
    assert said.exit_code == 1 and ("gate: FAIL, 2 regressions, the captures differ: batch 2 "
                                    "vs 3; specialized step ops") in " ".join(said.output.split())
    assert runner.invoke(main, ["gate", str(BASELINE), str(BASELINE), "--strict"]).exit_code == 0


def test_strict_fails_a_run_of_other_paths_or_a_trace_of_another_path(tmp_path):
    """The paths captured are part of the capture: a run of the standard path alone against
    a baseline of both says so (a missing path explained), and fails with --strict, as does a
    run of both against a baseline of one; a run's trace of one path given for another with
    --path (specialized.kptrace --path standard: a typo in a nightly job) is said likewise."""
    from kimi_perf.gate import gate_files
    from kimi_perf.layer_breakdown import breakdown_of_file
    from kimi_perf.runs import captured_path

    doc = json.loads(BASELINE.read_text())
    doc["run"]["request"]["paths"] = ["standard"]
    del doc["paths"]["specialized"]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(doc))
    lax = gate_files(BASELINE, one, Tolerances(metrics="kernels")).result
    assert lax.run_differences == ["decode paths standard, specialized vs standard"]
    assert {(c.path, c.status) for c in lax.failures} == {("specialized", "missing")}
    strict = gate_files(one, BASELINE, Tolerances(metrics="kernels"), strict=True).result
    assert [(c.status, c.detail) for c in strict.failures] == [
        ("captured differently", "decode paths standard vs standard, specialized")]
    # one path of each: the paths beside it are no difference
    assert gate_files(BASELINE, one, Tolerances(metrics="kernels"), path_name="standard",
                      strict=True).result.ok

    trace = NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"command": "kimi-perf trace", "request": {
        "paths": ["standard", "specialized"]}}))
    for name in ("standard", "specialized"):
        (run_dir / f"{name}.sqlite").symlink_to(trace)
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"schema": 1, "run": {}, "paths": {
        "standard": breakdown_of_file(trace).to_json()}}))
    assert [captured_path(run_dir / f"{n}.sqlite") for n in ("standard", "specialized")] == [
        "standard", "specialized"]
    assert captured_path(trace) is None and captured_path(run_dir / "run.json") is None
    right = gate_files(base, run_dir / "standard.sqlite", path_name="standard", strict=True).result
    assert right.ok and right.run_differences == []
    wrong = gate_files(base, run_dir / "specialized.sqlite", path_name="standard", strict=True)
    assert [(c.status, c.detail) for c in wrong.result.failures] == [
        ("captured differently", "decode path standard vs specialized")]


def test_a_trace_in_a_run_directory_brings_what_its_run_says_of_its_path(tmp_path):
    """A run's trace gated without --path (keyed as a trace) is still its path: where its
    run.json says that path fell back on every step, or computed logits not finite, the gate
    fails it as it fails the run; what the run says of its other path is not its."""
    trace = NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    info = json.loads(BASELINE.read_text())["run"]
    info["paths"]["standard"]["logits_finite"] = False
    info["paths"]["specialized"].update(every_step_fell_back=True,
                                        fallbacks=["decode_step[0..7]: batch 65 > 64"])
    (run_dir / "run.json").write_text(json.dumps(info))
    for name in ("standard", "specialized"):
        (run_dir / f"{name}.sqlite").symlink_to(trace)
    tolerances = Tolerances(metrics="kernels")
    fell = gate_files(trace, run_dir / "specialized.sqlite", tolerances).result
    assert [(c.path, c.status) for c in fell.failures] == [("trace", "fell back")]
    assert fell.fell_back == ["the run's trace: every step fell back to the standard path's "
                              "PyTorch ops (batch 65 > 64): its figures are the standard "
                              "path's, not its own kernels'"]
    nan = gate_files(trace, run_dir / "standard.sqlite", tolerances).result
    assert [(c.path, c.status) for c in nan.failures] == [("trace", "not finite")]
    assert gate_files(trace, trace, tolerances).result.ok   # (a trace of no run: nothing)


def test_a_run_breakdown_checks_its_run_information(tmp_path):
    """A run's settings are what the gate compares: a count stored as a word, or a run
    breakdown without its run information, is refused by name, not compared as unlike
    (or left unchecked, a --strict job passing against a baseline it cannot check)."""
    from kimi_perf.runs import load_run

    for edit, said in ((lambda r: r.update(tp="two"), "run.tp is not a whole number, 0 or more"),
                       (lambda r: r.update(batch=True),
                        "run.batch is not a whole number, 0 or more"),
                       (lambda r: r["request"].update(seed=-1),   # (said: -1 is a whole number)
                        "run.request.seed is not a whole number, 0 or more"),
                       (lambda r: r.update(preset=8), "run.preset is not a text"),
                       (lambda r: r["request"].update(graphs="no"),
                        "run.request.graphs is not true or false"),
                       (lambda r: r["request"].update(paths="standard"),
                        "run.request.paths is not a list of path names")):
        doc = json.loads(BASELINE.read_text())
        edit(doc["run"])
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(TraceError) as caught:
            load_run(bad)
        assert str(caught.value) == f"{bad}: {said}"
    doc = json.loads(BASELINE.read_text())
    del doc["run"]
    bad.write_text(json.dumps(doc))
    said = CliRunner().invoke(main, ["gate", str(bad), str(BASELINE), "--strict"])
    assert said.exit_code == 2 and said.output.strip() == (
        f"kimi-perf: error: {bad}: a run breakdown without its run information ('run': what its "
        "run.json holds), which the gate checks")


def test_update_strict_keeps_a_baseline_of_another_capture(tmp_path):
    """gate --update --strict: a run captured otherwise is not stored over the baseline
    (exit 1, said), where --update alone stores it whatever the verdict."""
    doc = json.loads(BASELINE.read_text())
    doc["run"]["tp"] = 2
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    stored = tmp_path / "baseline.json"
    shutil.copy(BASELINE, stored)
    before = stored.read_bytes()
    strict = CliRunner().invoke(main, ["gate", "--update", "--strict", str(stored), str(other),
                                       "--metrics", "kernels"])
    assert strict.exit_code == 1 and stored.read_bytes() == before
    assert strict.stderr.strip() == (f"baseline {stored} not updated from {other}: captured "
                                     "or broken down differently (--strict)")
    said = CliRunner().invoke(main, ["gate", "--update", "--strict", str(stored), str(other),
                                     "--metrics", "kernels", "--format", "json"])
    doc = json.loads(said.stdout)
    assert said.exit_code == 1 and doc["updated"] is None and not doc["ok"]
    assert stored.read_bytes() == before
    lax = CliRunner().invoke(main, ["gate", "--update", str(stored), str(other), "--metrics",
                                    "kernels", "--format", "json"])
    assert lax.exit_code == 0 and json.loads(stored.read_text())["run"]["tp"] == 2
    assert json.loads(lax.stdout)["updated"] == str(stored)


def test_steps_of_a_model_of_another_depth_are_other_work(tmp_path):
    """A run of half the layers: its steps are other work (no improvement, no regression),
    said so; its layer types still compare, and a layer that gained a launch still fails."""
    from kimi_perf.gate import gate_files

    doc = json.loads(BASELINE.read_text())
    doc["run"]["n_layers"] = 4
    path = doc["paths"]["specialized"]
    for step in path["steps"]:
        step["kernels"] //= 2
    for item in (*path["layers"], *path["layer_types"]):   # (the summary as the layers)
        if item["type"] == "kda":
            item["kernels"] += 1
    shallow = tmp_path / "shallow.json"
    shallow.write_text(json.dumps(doc))
    result = gate_files(BASELINE, shallow, Tolerances(metrics="kernels")).result
    steps = [c for c in result.checks if c.layer_type == "step"]
    assert {c.status for c in steps} == {"changed"} and steps[0].detail == (
        "models of 8 and 4 layers: a step is other work")
    assert {(c.path, c.metric) for c in result.failures} == {
        ("specialized", "kernels"), ("specialized", "kernels_max")}
    assert all(c.layer_type == "kda" for c in result.failures)
    assert "layers 8 vs 4" in result.run_differences
    # a type of as many layers a step in both (layer 0's dense MLP) is no other work
    dense = next(c for c in result.checks if (c.path, c.layer_type, c.metric) == (
        "specialized", "dense", "layers"))
    assert (dense.baseline, dense.current, dense.status) == (1, 1, "ok")
    # a model of 2 layers has no KDA layer: no layer type "missing" from it, but changed
    doc = json.loads(BASELINE.read_text())
    for path in doc["paths"].values():
        path["layers"] = [x for x in path["layers"] if x["type"] != "kda"]
        path["layer_types"] = [t for t in path["layer_types"] if t["type"] != "kda"]
        for step in path["steps"]:
            step["layers"] = sum(x["step"] == step["index"] for x in path["layers"])
    two = tmp_path / "two.json"
    two.write_text(json.dumps(doc | {"run": doc["run"] | {"n_layers": 2}}))
    for base, run, lacking in ((BASELINE, two, "run"), (two, BASELINE, "baseline")):
        result = gate_files(base, run, Tolerances(metrics="kernels")).result
        kda = [c for c in result.checks if c.layer_type == "kda"]
        assert kda and {(c.status, c.detail) for c in kda} == {
            ("changed", f"models of {8 if lacking == 'run' else 2} and "
                        f"{2 if lacking == 'run' else 8} layers: the {lacking}'s has no kda "
                        "layer")}
        assert result.ok
    # but a model of 16 layers holds KDA layers: lost ones are missing, whatever the depths
    sixteen = tmp_path / "sixteen.json"
    sixteen.write_text(json.dumps(doc | {"run": doc["run"] | {"n_layers": 16}}))
    result = gate_files(BASELINE, sixteen, Tolerances(metrics="kernels")).result
    assert {c.status for c in result.checks if c.layer_type == "kda"} == {"missing"}
    assert not result.ok


def test_a_path_the_run_lacks_is_missing_whatever_the_models_depth(tmp_path):
    """Other depth makes a step other work, not a path that is not there: its checks stay
    missing (and fail), and the CPU-time note names no path that was not checked."""
    from click.testing import CliRunner

    from kimi_perf.cli import main
    from kimi_perf.gate import gate_files

    doc = json.loads(BASELINE.read_text())
    doc["run"]["n_layers"] = 4
    del doc["paths"]["specialized"]
    doc["run"]["paths"].pop("specialized", None)
    alone = tmp_path / "standard_only.json"
    alone.write_text(json.dumps(doc))
    result = gate_files(BASELINE, alone, Tolerances(metrics="kernels")).result
    lost = {c.status for c in result.checks if c.path == "specialized"}
    assert lost == {"missing"} and not result.ok
    out = CliRunner().invoke(main, ["gate", str(alone), str(alone)])
    assert out.exit_code == 0 and "CPU time, noisy" in out.output
    assert "interpreter" not in out.output           # only the standard path was checked


def test_gate_files_is_the_cli_gate_as_a_library_call(tmp_path):
    from kimi_perf.errors import TraceError
    from kimi_perf.gate import gate_files
    from kimi_perf.runs import store_baseline

    gated = gate_files(BASELINE, BASELINE)
    assert gated.result.ok and set(gated.baseline) == {"standard", "specialized"}
    assert gated.result.run_differences == []   # compared: none
    alone = gate(gated.baseline, gated.current)
    assert alone.run_differences is None and "run_differences" not in alone.to_json()
    # the stored baseline is a CPU run: its times are CPU time, left out unless named
    assert gated.result.cpu_time_metrics == [] and not gated.result.tolerances.cpu_times
    assert gated.result.to_json()["cpu_times_left_out"] == ["kernel_us", "span_us"]
    named = gate_files(BASELINE, BASELINE, Tolerances(metrics="kernels,kernel_us,span_us"))
    assert named.result.to_json()["cpu_time_metrics"] == ["kernel_us", "span_us"]
    assert named.result.cpu_times_left_out == []
    assert gated.baseline_file == BASELINE and gated.run_doc["paths"]
    only = gate_files(BASELINE, BASELINE, Tolerances(metrics="kernels"), path_name="standard")
    assert {c.path for c in only.result.checks} == {"standard"}
    assert only.result.cpu_time_metrics == []
    with pytest.raises(TraceError, match="holds the paths standard, specialized: choose"):
        gate_files(EXAMPLE_TRACE, BASELINE)
    with pytest.raises(TraceError, match=r"neither .* nor .* is one"):
        gate_files(EXAMPLE_TRACE, EXAMPLE_TRACE, path_name="standard")
    changed = json.loads(BASELINE.read_text())
    changed["run"]["batch"] += 1
    store_baseline(tmp_path / "b.json", changed)
    assert gate_files(tmp_path / "b.json", BASELINE).result.run_differences == [
        f"batch {changed['run']['batch']} vs {changed['run']['batch'] - 1}"]
    with pytest.raises(TraceError, match=r"a baseline is a \.json file"):
        store_baseline(tmp_path / "b.txt", changed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]


def test_compare_and_report_say_when_two_runs_were_captured_differently(tmp_path):
    """Two captures set side by side (compare A B, report A B ...): how each run was made
    unlike the first, in the table's notes, the JSON and the HTML report (and on stderr);
    nothing for like runs, nor for one run's two paths."""
    doc = json.loads(BASELINE.read_text())
    doc["run"]["batch"] = 64
    doc["run"]["request"]["kv_cache"] = "fp8"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    said = "captured differently: batch 2 vs 64; KV cache bf16 vs fp8"
    args = ["compare", str(BASELINE), str(other), "--path", "specialized"]
    text = " ".join(CliRunner().invoke(main, args).output.split())
    assert f"tiny-cpu:specialized and other:specialized were {said}" in text
    as_json = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).output)
    assert as_json["run_differences"] == ["batch 2 vs 64", "KV cache bf16 vs fp8"]
    like = CliRunner().invoke(main, ["compare", str(BASELINE), str(BASELINE), "--path",
                                     "specialized", "--format", "json"])
    assert json.loads(like.output)["run_differences"] == []
    # a capture that predates --experts ran bf16 experts
    before = json.loads(BASELINE.read_text())
    del before["run"]["request"]["experts"]
    mxfp4 = json.loads(BASELINE.read_text())
    mxfp4["run"]["request"]["experts"] = "mxfp4"
    assert run_differences(before, mxfp4) == ["experts bf16 vs mxfp4"]
    mxfp4["run"]["request"]["experts"] = "bf16"
    assert run_differences(before, mxfp4) == []
    one = CliRunner().invoke(main, ["compare", str(BASELINE), "--format", "json"])
    assert "run_differences" not in json.loads(one.output)
    html_file = tmp_path / "r.html"
    third = tmp_path / "third.json"
    third.write_text(BASELINE.read_text())
    result = CliRunner().invoke(main, ["report", str(BASELINE), str(other), str(third),
                                       "--path", "specialized", "-o", str(html_file)])
    assert result.exit_code == 0, result.output
    assert f"tiny-cpu and other were {said}" in " ".join(result.output.split())
    report = html_file.read_text()
    assert f"<p class=note>tiny-cpu and other were {said}: their kernels" in report
    assert "tiny-cpu and third" not in report     # captured alike
    # what each run ran, a column each; the rows that differ in bold, none left all blank
    assert ("<h2>Runs</h2><table class=info><tr><th></th><th>tiny-cpu</th><th>other</th>"
            "<th>third</th></tr>") in report
    assert ("<tr class=differs><th>batch</th><td>2</td><td>64</td><td>2</td></tr>"
            "<tr><th>TP</th><td>1</td><td>1</td><td>1</td></tr>"
            "<tr><th>context</th><td>8 tokens</td>") in report
    assert "<tr><th>decode steps</th><td>3 profiled after 1 warm-up</td>" in report
    assert "driver, CUDA" not in report          # CPU runs: no driver to show
    assert "<tr><th>seed</th><td>0</td><td>0</td><td>0</td></tr>" in report
    twice = CliRunner().invoke(main, ["report", str(BASELINE), str(BASELINE), "--path",
                                      "specialized", "-o", str(html_file)])
    assert twice.exit_code == 0 and ("<th>tiny-cpu</th><th>tiny-cpu&#x27;</th>"
                                     in html_file.read_text())
    alone = CliRunner().invoke(main, ["report", str(other), "-o", str(html_file)])
    assert alone.exit_code == 0 and "<h2>Runs</h2>" not in html_file.read_text()
    # run information edited by hand: one line naming the field, from every command (a
    # request that is no object would hide how the captures differ)
    doc["run"]["request"] = "x"
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(doc))
    for command in (["compare", str(BASELINE), str(odd), "--path", "specialized"],
                    ["gate", str(BASELINE), str(odd), "--metrics", "kernels"],
                    ["report", str(odd), "-o", str(html_file)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2 and result.output == (
            f"kimi-perf: error: {odd}: run.request is not an object\n")


def test_results_read_short_in_a_notebook():
    """A gate's result and a comparison's type pairs print a line, not the breakdowns and
    typical layers they hold (152 kB for two wan2.1 traces)."""
    from kimi_perf.comparison import type_pairs
    from kimi_perf.gate import gate_files

    before, after = (NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{n}.sqlite"
                     for n in ("before", "after"))
    gated = gate_files(before, after)
    assert not gated.result.ok
    assert len(gated.result.failures) == 2   # (the blocks' span, and device 0's)
    assert repr(gated.result) == (f"GateResult(FAIL, {len(gated.result.checks)} checks, "
                                  "2 regressions)")
    assert repr(gated) == f"GatedRun({gated.result!r}, baseline ['trace'], current ['trace'])"
    stored = gate_files(BASELINE, BASELINE)
    assert repr(stored).startswith("GatedRun(GateResult(ok, ") and str(BASELINE) in repr(stored)
    b = Breakdown.from_json(json.loads(BASELINE.read_text())["paths"]["standard"])
    pairs = type_pairs(b, b)
    assert repr(pairs[0]).startswith(f"TypePair('{pairs[0].label}': ") and len(repr(pairs)) < 200


def test_gate_says_when_the_sides_were_broken_down_differently(tmp_path):
    """The same trace broken down by other options: other ranges as steps, other layer ranges
    (half the layers a step), the repeating pattern's layers for the ranges' (every type
    "missing"), other kernel-class rules under the pattern (which reads classes). The gate
    says how (JSON `breakdown_differences`), and --strict fails on it alone. Options that find
    the same (a regex spelled otherwise, rules where ranges cut the layers) say nothing."""
    built = nvtx_decode_trace("layer[{i}]({kind})", steps=3)
    for r in list(built.ranges):   # each step also inside a range of the benchmark's loop
        if built.strings.values[r["name"]].startswith("decode_step"):
            built.range("iteration", r["start"] - 5, r["end"] + 5)
    trace = built.build()

    def stored(name: str, **options) -> Path:
        file = tmp_path / f"{name}.json"
        file.write_text(json_text(breakdown(trace, **options).to_json()))
        return file

    by_ranges, by_pattern = stored("ranges"), stored("pattern", layers="repeat")
    # a rule naming a shipped class may move the pattern's cuts; one of a class of one's own
    # relabels kernels alone (the class checks say so), no cut
    extra = [Rule("attention", re.compile("embedding")), *load_rules()]
    own = [Rule("embedding", re.compile("embedding")), *load_rules()]
    cases = {(by_ranges, by_pattern): "layers from ranges vs the repeating kernel pattern",
             (by_ranges, stored("loop", step_regex="^iteration$")):
             "--steps the default vs '^iteration$'",
             (by_ranges, stored("half", layers=r"nvtx:layer\[[0-3]\]")):
             r"--layers 'auto' vs 'nvtx:layer\[[0-3]\]'",
             (by_pattern, stored("rules", layers="repeat", rules=extra)):
             "kernel-class rules 'default' vs '1 extra (sha256:"}
    for (base, run), said in cases.items():
        args = ["gate", str(base), str(run), "--metrics", "kernels"]
        text = CliRunner().invoke(main, args).output
        assert (f"the baseline and the run were broken down differently: {said}"
                in " ".join(text.split())), text
        strict = CliRunner().invoke(main, [*args, "--strict", "--format", "json"])
        doc = json.loads(strict.output)
        assert strict.exit_code == 1 and doc["breakdown_differences"][0].startswith(said)
        assert [c["status"] for c in doc["checks"] if c["path"] == "run"] == [
            "broken down differently"]
    for base, run in ((by_ranges, stored("again")),
                      (by_ranges, stored("spelled", step_regex=r"decode_step\[\d+\]")),
                      (by_ranges, stored("nvtx", layers=r"nvtx:^layer\[(?P<index>\d+)\]"
                                                        r"\((?P<type>\w+)\)$")),
                      (by_ranges, stored("ranges_rules", rules=extra)),
                      (by_pattern, stored("own_rules", layers="repeat", rules=own))):
        same = CliRunner().invoke(main, ["gate", str(base), str(run), "--strict", "--format",
                                         "json"])
        assert same.exit_code == 0, (run, same.output)
        assert json.loads(same.output)["breakdown_differences"] == []


def test_a_kernel_swapped_in_a_named_layer_type_is_said(tmp_path, monkeypatch):
    """Layer types named by ranges have no pattern digest: another kernel picked for one (as
    many launches, the same speed) passes every check, and is said (pattern: changed, with
    the kernels gained and lost), in the table as in JSON."""
    from tests import test_layers

    def stored(name: str) -> Path:
        file = tmp_path / f"{name}.json"
        trace = nvtx_decode_trace("layer[{i}]({kind})", steps=3).build()
        file.write_text(json_text(breakdown(trace).to_json()))
        return file

    base, again = stored("base"), stored("again")
    monkeypatch.setattr(test_layers, "KDA", [
        "gemm_fb_splitk" if k == "gemm_fb" else k for k in test_layers.KDA])
    run = stored("run")
    result = CliRunner().invoke(main, ["gate", str(base), str(run), "--format", "json"])
    doc = json.loads(result.output)
    assert result.exit_code == 0 and doc["ok"]
    assert [(c["layer_type"], c["metric"], c["status"], c["detail"]) for c in doc["checks"]
            if c["status"] != "ok"] == [("kda", "pattern", "changed",
                                         "added gemm_fb_splitk; removed gemm_fb")]
    text = CliRunner().invoke(main, ["gate", str(base), str(run)]).output
    assert "changed" in text and "added gemm_fb_splitk; removed gemm_fb" in " ".join(
        text.split())
    same = CliRunner().invoke(main, ["gate", str(base), str(again), "--format", "json"])
    assert not [c for c in json.loads(same.output)["checks"] if c["metric"] == "pattern"]


def test_one_layer_and_one_step_grown_say_where(tmp_path):
    """One KDA layer of one step launches one op more: its typical layer is the same, so the
    largest layer says where it grew and in which class; the step's +1 of 78 says which part
    of the largest step grew, and its change is not rounded to +0.0%."""
    doc = json.loads(BASELINE.read_text())
    spec = doc["paths"]["specialized"]
    layer = next(r for r in spec["layers"] if r["type"] == "kda" and r["step"] == 1)
    layer["kernels"] += 1
    layer["classes"]["norm"]["kernels"] += 1
    next(s for s in spec["steps"] if s["index"] == 1)["kernels"] += 1
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    result = gate_files(BASELINE, run, Tolerances(metrics="kernels"),
                        path_name="specialized").result
    grown = {(c.layer_type, c.metric): c for c in result.failures}
    assert set(grown) == {("kda", "kernels_max"), ("step", "kernels_max")}
    assert grown["kda", "kernels_max"].detail == (
        f"the largest layer (step 1, layer {layer['index']}): norm +1")
    assert grown["step", "kernels_max"].detail == "the largest step: kda layers +1 ops"
    assert render.gate_table(result).row_count == 2
    assert render._change(grown["step", "kernels_max"].change) == "+1.3%"   # 79 of 78
    assert render._change(1 / 4010) == "+0.025%" and render._change(0.0) == "+0.0%"
    assert render._change(1e-7) == "+<0.001%" and render._change(-2e-5) == "-0.002%"


def test_update_over_a_baseline_of_another_shape_says_what_to_do(tmp_path):
    """A baseline of one trace's breakdown and a run of two paths (or the other way): the
    gate --update makes first cannot pair them, and --path (which the gate's error would ask
    for) is no answer to --update; it says to remove the baseline, and keeps it."""
    trace_baseline = tmp_path / "one.json"
    trace_baseline.write_text(json_text(
        breakdown(nvtx_decode_trace("layer[{i}]({kind})").build()).to_json()))
    run_baseline = tmp_path / "two.json"
    shutil.copy(BASELINE, run_baseline)
    for baseline, run, holds, advice in (
            (trace_baseline, BASELINE, "one trace's breakdown, and {run} holds the paths "
                                       "standard, specialized",
             "remove the baseline to store the run there"),
            (run_baseline, trace_baseline, "the paths standard, specialized, and {run} holds "
                                           "one trace's breakdown",
             "give the run's directory to replace every path, or keep the trace's in a new "
             "file")):
        before = baseline.read_text()
        result = CliRunner().invoke(main, ["gate", str(baseline), str(run), "--update"])
        assert result.exit_code == 2 and result.output == (
            f"kimi-perf: error: {baseline}: holds {holds.format(run=run)}: the gate that --update "
            f"makes first cannot pair them; {advice}\n")
        assert baseline.read_text() == before


def test_a_slower_step_says_which_part_of_it(tmp_path):
    """Each step's epilogue (the LM head after the last layer) 30% of a step slower: the
    step's span regresses, and its detail places the change in the epilogue, not the
    layers."""
    doc = json.loads(BASELINE.read_text())
    for step in doc["paths"]["specialized"]["steps"]:
        grown = round(step["span_us"] * 0.3, 3)
        step["span_us"] += grown
        step["epilogue"]["span_us"] += grown
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    result = gate_files(BASELINE, run, Tolerances(metrics="span_us"),
                        path_name="specialized").result
    (check,) = result.failures
    assert (check.layer_type, check.metric, check.status) == ("step", "span_us", "regression")
    assert check.detail.startswith("per step (medians): epilogue +")
    assert "layers" not in check.detail


def test_a_grown_median_says_its_classes_and_a_swap_reads_apart():
    """Half the KDA layers launch one norm more: the median grows by half a kernel, and its
    detail is the medians per class (the typical layers ran the same kernels). Two variants
    of one long template, swapped, are shortened together, so that they read apart."""
    from kimi_perf.gate import _swapped

    base = load_run(BASELINE)[0]
    run = load_run(BASELINE)[0]
    spec = run["specialized"]
    kda = [r for r in spec.layers if r["type"] == "kda"]
    for row in kda[: len(kda) // 2 + 1]:
        row["kernels"] += 1
        row["classes"]["norm"]["kernels"] += 1
    summary = next(t for t in spec.layer_types if t["type"] == "kda")
    summary["classes"]["norm"]["kernels"] += 1   # (the median layer's, as breakdown keeps it)
    checks = {(c.path, c.layer_type, c.metric): c for c in gate(base, run).failures}
    assert checks["specialized", "kda", "kernels"].detail == "median per layer: norm +1"
    template = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_{}_nn_align8>"
    before, after = ({"name": template.format(tile), "class": "gemm", "us": 1.0}
                     for tile in ("64x64_64x4", "128x64_64x3"))
    added, removed = _swapped([before], [after]).removeprefix("added ").split("; removed ")
    assert added.startswith("cutlass::Kernel2<…>~") and added != removed   # (each alone: same)


def test_a_launch_between_layers_is_placed_there(tmp_path):
    """One op more in every step, in no layer and not in its prologue or epilogue: the step's
    detail places it between the layers."""
    doc = json.loads(BASELINE.read_text())
    for step in doc["paths"]["specialized"]["steps"]:
        step["kernels"] += 1
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    result = gate_files(BASELINE, run, Tolerances(metrics="kernels"),
                        path_name="specialized").result
    assert [c.detail for c in result.failures] == ["per step (medians): between layers +1 ops",
                                                   "the largest step: between layers +1 ops"]


def test_layers_of_ranges_that_name_no_type_are_gated_as_they_ran():
    """Ranges that name no type letter their layers by kernel sequence, each with the digest
    of its sequence as it ran: the gate flags the same kernels in another order and another
    GEMM picked (against a baseline stored before those layers kept digests too), and a
    run whose ranges cut its layers lost a type the baseline's pattern found: missing, not
    waived as the pattern's cut."""
    from kimi_perf.gate import TRACE
    from tests.test_breakdown import ATTENTION_LAYER, MOE_LAYER, _untyped_layers
    from tests.test_layers import KDA, k3_like

    def pattern_checks(base: Breakdown, run: Breakdown) -> list[tuple]:
        return [(c.layer_type, c.status, c.detail) for c in gate({TRACE: base}, {TRACE: run}).checks
                if c.metric == "pattern"]

    base = _untyped_layers([ATTENTION_LAYER, MOE_LAYER] * 2)
    rotated = _untyped_layers([ATTENTION_LAYER[1:] + ATTENTION_LAYER[:1], MOE_LAYER] * 2)
    assert pattern_checks(base, rotated) == [("A", "changed",
                                              "the same kernels in another order")]
    swapped = _untyped_layers([["rms_norm", "qkv_gemm_v2", *ATTENTION_LAYER[2:]],
                               MOE_LAYER] * 2)
    old = Breakdown.from_json(json.loads(json.dumps(base.to_json())))
    for t in old.layer_types:
        del t["pattern"]   # (as stored before ranges' letters kept their sequences)
    for stored in (base, old):
        assert pattern_checks(stored, swapped) == [
            ("A", "changed", "added qkv_gemm_v2; removed qkv_gemm")]
    found_by_pattern = breakdown(_k3_without_ranges(k3_like(16)))
    lost = gate({TRACE: found_by_pattern}, {TRACE: _untyped_layers([list(KDA)] * 16, steps=4)})
    assert {(c.layer_type, c.status) for c in lost.failures} >= {("B", "missing")}


def _k3_without_ranges(layers: list[list[str]], steps: int = 4):
    """Steps of K3-like layers in no layer range: the repeating pattern finds them."""
    b = TraceBuilder()
    for s in range(steps):
        start = b.clock
        for kernels in layers:
            b.sequence(kernels)
        b.range(f"decode_step[{s}]", start - 20, b.clock)
        b.clock += 5000
    return b.build()


def test_a_step_span_that_grew_is_placed_between_layers_or_not_at_all():
    """A span's rest between layers is idle time or other work, not idle time alone; where
    neither side found layers, the step is one part, and no part is named (it named the
    kernels' own growth "idle between")."""
    import copy

    doc = json.loads(BASELINE.read_text())
    for step in doc["paths"]["specialized"]["steps"]:
        step["span_us"] *= 1.5
    slower = Breakdown.from_json(doc["paths"]["specialized"])
    base = load_run(BASELINE)[0]["specialized"]
    timed = Tolerances(metrics="kernels,kernel_us,span_us")   # (a CPU run's µs too)
    (span,) = [c for c in gate({"p": base}, {"p": slower}, timed).failures
               if c.metric == "span_us" and c.layer_type == "step"]
    assert span.detail.startswith("per step (medians): between layers (idle, or other work) +")
    layerless = [copy.deepcopy(b) for b in (base, slower)]
    for b in layerless:
        b.layers, b.layer_types = [], []
    (span,) = [c for c in gate({"p": layerless[0]}, {"p": layerless[1]}, timed).failures
               if c.metric == "span_us"]
    assert span.detail is None and span.status == "regression"


def test_a_kernel_added_to_some_layers_is_named(tmp_path):
    """A kernel added to every other layer makes those layers a type of their own, which
    the baseline lacks: no type's count names the kernel. The new type says which of the
    baseline's it is like and what it added, and the step's kernels say what its layers
    gained in all (typical layers times the layers a step holds)."""
    from tests.synth import TraceBuilder

    layer = ["rmsnorm", "gemm_qkv", "attention", "gemm_o", "rmsnorm", "gemm_up", "silu_mul",
             "gemm_down"]

    def stored(name: str, extra_in, kernels=lambda i: layer, typed: str = "") -> Path:
        b = TraceBuilder()
        for s in range(4):
            step_start = b.clock
            for i in range(8):
                start, end = b.sequence(kernels(i) + (["extra_kernel"] if extra_in(i) else []))
                b.range(f"layer[{i}]{typed}", start - 10, end)
            b.range(f"decode_step[{s}]", step_start - 20, b.clock)
            b.clock += 5000
        file = tmp_path / f"{name}.json"
        file.write_text(json_text(breakdown(b.build()).to_json()))
        return file

    base = stored("base", lambda i: False)
    for run, added in ((stored("odd", lambda i: i % 2), "added extra_kernel ×4"),
                       (stored("third", lambda i: i == 3), "added extra_kernel")):
        result = gate_files(base, run, Tolerances(metrics="kernels")).result
        checks = {(c.layer_type, c.metric): c for c in result.checks}
        new = [c for c in result.checks if c.status == "new" and c.metric == "kernels"]
        assert [c.detail for c in new] == ["the baseline's A, added extra_kernel"], run
        step = checks["step", "kernels"]
        assert step.status == "regression"
        assert step.detail.startswith(f"in its layers: {added}; per step (medians): "), (
            step.detail)
        assert checks["step", "kernels_max"].detail.startswith(
            f"in its layers: {added}; the largest step: ")
        assert f"(in its layers: {added};" in gate_headline(result)
    # where the steps' layers run the same kernels, nothing is named
    again = gate_files(base, stored("again", lambda i: False)).result
    assert again.ok and all(c.detail is None for c in again.checks if c.layer_type == "step")
    # a new type that shares a kernel or two with the baseline's is no variant of one
    moe = ["rmsnorm", "router", "moe_up", "moe_act", "moe_down", "moe_combine"]
    other = stored("moe", lambda i: False, lambda i: moe if i % 2 else layer)
    assert [c.detail for c in gate_files(base, other, Tolerances(metrics="kernels")
                                         ).result.checks
            if c.status == "new" and c.metric == "kernels"] == [None]
    # layers of one type that run other kernels (3 of 8 with one more, then 5 of 8): the
    # typical layers do not make the step's kernels, so no names are counted off them
    three, five = (stored(f"named{n}", lambda i, n=n: i < n, typed="(attn)") for n in (3, 5))
    step = next(c for c in gate_files(three, five, Tolerances(metrics="kernels")).result.checks
                if (c.layer_type, c.metric) == ("step", "kernels"))
    assert step.status == "regression" and step.detail == (
        "per step (medians): attn layers +2 kernels")


def test_strict_fails_where_one_side_records_no_capture_settings_or_another_batch(tmp_path):
    """A run's baseline against a bare trace (a nightly job given the wrong file) cannot
    compare preset, batch or TP: a difference, a failure under --strict. A trace in a run
    directory was captured as its run.json says; vLLM's step annotation says its decode
    requests a step (another batch: a difference). A baseline stored from a `trace --from`
    run records no capture either (its run.json names the traces it read): the same trace
    against it passes --strict."""
    import gzip

    from click.testing import CliRunner

    trace = tmp_path / "bare.sqlite"
    shutil.copy(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite", trace)
    run_doc = json.loads(BASELINE.read_text())
    (base := tmp_path / "base.json").write_text(json.dumps(
        run_doc | {"paths": {"standard": load_run(trace)[0]["trace"].to_json()}}))
    unknown = ("the run records no capture settings (a trace of its own): "
               "preset, batch and TP not compared")
    lax = gate_files(base, trace, path_name="standard").result
    assert lax.ok and lax.run_differences == [unknown]
    strict = gate_files(base, trace, path_name="standard", strict=True).result
    assert [(c.status, c.detail) for c in strict.failures] == [("captured differently",
                                                                 unknown)]
    out = CliRunner().invoke(main, ["gate", str(base), str(trace), "--path", "standard",
                                    "--strict"])
    assert out.exit_code == 1 and "captured differently" in out.output
    # the same trace in a run directory whose run.json says batch 4
    (run_dir := tmp_path / "run").mkdir()
    (run_dir / "run.json").write_text(json.dumps(
        run_doc["run"] | {"batch": 4}))
    shutil.copy(trace, run_dir / "standard.sqlite")
    in_run = gate_files(base, run_dir / "standard.sqlite", path_name="standard").result
    assert in_run.run_differences == [f"batch {run_doc['run']['batch']} vs 4"]
    # a baseline stored from that trace keeps its breakdown (not the run.json compared), and
    # a stored breakdown without settings is no difference: the next night passes --strict
    stored = tmp_path / "stored.json"
    for _ in range(2):
        out = CliRunner().invoke(main, ["gate", "--update", str(stored),
                                        str(run_dir / "standard.sqlite")])
        assert out.exit_code == 0, out.output
    assert "layer_types" in json.loads(stored.read_text())
    out = CliRunner().invoke(main, ["gate", str(stored), str(run_dir / "standard.sqlite"),
                                    "--strict"])
    assert out.exit_code == 0, out.output
    # (a stored breakdown given as the run, where the baseline records its settings, is not)
    assert gate_files(base, stored, path_name="standard").result.run_differences == [
        unknown.replace("a trace of its own", "a breakdown of its own")]
    # a baseline stored from a `trace --from` run of the trace: the next night's trace passes
    assert CliRunner().invoke(main, ["trace", "--from", str(trace), "--out",
                                     str(tmp_path / "analysed")]).exit_code == 0
    (analysed,) = (tmp_path / "analysed").iterdir()
    from_run = tmp_path / "from_run.json"
    out = CliRunner().invoke(main, ["gate", "--update", str(from_run), str(analysed)])
    assert out.exit_code == 0, out.output
    for baseline in (from_run, analysed):
        out = CliRunner().invoke(main, ["gate", str(baseline), str(trace), "--strict"])
        assert out.exit_code == 0 and "captured differently" not in out.output, out.output
    # (and against a capture's baseline, it says what it is)
    assert gate_files(base, analysed, path_name="standard").result.run_differences == [
        unknown.replace("a trace of its own", "traces analysed with trace --from")]
    # a trace is one path: the other paths its run captured are no difference
    one_path = json.loads(base.read_text())
    one_path["run"]["request"]["paths"] = ["standard"]
    (single := tmp_path / "single.json").write_text(json.dumps(one_path))
    assert not any("decode paths" in d for d in gate_files(
        single, run_dir / "standard.sqlite").result.run_differences)
    # -o on the run.json read beside a trace is refused, not overwritten (nor removed)
    out = CliRunner().invoke(main, ["gate", str(tmp_path / "none.json"),
                                    str(run_dir / "standard.sqlite"), "-o",
                                    str(run_dir / "run.json")])
    assert out.exit_code == 2 and "is an input of this command" in out.output
    assert (run_dir / "run.json").is_file()
    # vLLM's annotation: 32 decode requests a step against 64
    with gzip.open(EXAMPLE_TRACE, "rt") as f:
        text = f.read()
    (b64 := tmp_path / "b64.json").write_text(text.replace("generation_32(", "generation_64("))
    assert gate_files(EXAMPLE_TRACE, b64).result.run_differences == [
        "decode requests a step 32 vs 64"]
    # the count most steps name: a request that finished within the window is no difference
    from kimi_perf.gate import request_differences

    def steps(*counts):
        return {"trace": Breakdown(source={}, layers=[], layer_types=[], steps=[
            {"name": f"execute_context_0(0)_generation_{n}({n})"} for n in counts])}
    assert request_differences(steps(32, 32, 31), steps(32, 32)) == []
    assert request_differences(steps(32, 32, 31, 31, 31), steps(32, 32, 32, 31, 31)) == []
    assert request_differences(steps(32, 32, 31), steps(64, 64, 32)) == [
        "decode requests a step 32 vs 64"]
    assert gate_files(EXAMPLE_TRACE, EXAMPLE_TRACE).result.run_differences == []


def test_the_json_verdict_keeps_what_each_side_says_of_itself():
    """`--format json` keeps the notes the table prints under it (a mixed step's figures are
    no decode figures, graph replays, ...), each side's apart."""
    mixed = KINETO / "tracelens_vllm_gptoss20b_prefilldecode_piecewise_mi300x.json.gz"
    table = CliRunner().invoke(main, ["gate", str(mixed), str(mixed)]).stdout
    doc = json.loads(CliRunner().invoke(main, ["gate", str(mixed), str(mixed), "--format",
                                               "json"]).stdout)
    assert set(doc["notes"]) == {"baseline", "run"}
    assert doc["notes"]["run"] and any("mixed" in line for line in doc["notes"]["run"])
    for line in doc["notes"]["baseline"] + doc["notes"]["run"]:
        assert " ".join(line.split()) in " ".join(table.split())


def test_a_missing_baseline_is_named_as_the_baseline(tmp_path):
    """A first nightly run without a baseline is told it is the baseline that is missing and
    how to store one, not "no such file" of an unnamed input."""
    result = CliRunner().invoke(main, ["gate", str(tmp_path / "base.json"), str(BASELINE)])
    assert result.exit_code == 2 and result.output == (
        f"kimi-perf: error: {tmp_path / 'base.json'}: no such baseline (a first run stores "
        "one: kimi-perf gate --update BASELINE RUN)\n")


def _scaled(row: dict, factor: float) -> None:
    """Every time of a stored step or layer row times ``factor`` (its classes' µs too)."""
    for key, value in row.items():
        if key.endswith("_us") and isinstance(value, float | int):
            row[key] = value * factor
        elif key == "classes":
            for figures in value.values():
                figures["us"] *= factor
        elif isinstance(value, dict):
            _scaled(value, factor)


def _nightly_runs(tmp_path: Path, factors: dict[str, float], n_layers: int = 8,
                  slower_layer: float = 1.0) -> None:
    """Breakdown JSONs ``NAME.json`` of one decode trace (12 steps) as runs of the same code
    on a noisy machine: each run's times ``factors[NAME]`` times the trace's (its clocks, its
    host), each step's 1% of its own more, each layer's 0.3%; the first layer of each step
    ``slower_layer`` times slower still."""
    doc = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=12, n_layers=n_layers)
                    .build()).to_json()
    rng = np.random.default_rng(7)
    for name, factor in factors.items():
        run = json.loads(json.dumps(doc))
        per_step = factor * rng.normal(1.0, 0.01, len(run["steps"]))
        for row in run["steps"]:
            _scaled(row, per_step[row["index"]])
        for row in run["layers"]:   # (and each layer by 0.3% of its own)
            _scaled(row, per_step[row["step"]] * rng.normal(1.0, 0.003)
                    * (slower_layer if row["index"] == 0 else 1))
        (tmp_path / f"{name}.json").write_text(json.dumps(run))


def test_a_baseline_keeps_the_spread_of_several_runs_and_passes_a_run_within_it(tmp_path):
    """Runs of one code move by a few % run to run (clocks, the host): every step of a run
    shares it, so the test over one run's steps reads a +7% run as a regression far beyond
    chance. `gate --update --spread-from` stores the spread of several runs; a later run
    within it is noise (tested against it, said so), one past it still fails, and so does a
    kernel more, which no spread explains."""
    _nightly_runs(tmp_path, {"r1": 1.0, "r2": 1.04, "r3": 0.97, "r4": 1.06, "r5": 0.99,
                             "night": 1.07, "slow": 1.3})
    files = {name: str(tmp_path / f"{name}.json") for name in
             ("r1", "r2", "r3", "r4", "r5", "night", "slow")}
    one, spread = tmp_path / "one.json", tmp_path / "spread.json"
    assert CliRunner().invoke(main, ["gate", "--update", str(one), files["r1"]]).exit_code == 0
    alone = CliRunner().invoke(main, ["gate", str(one), files["night"], "--format", "json"])
    assert alone.exit_code == 1 and "spread_runs" not in json.loads(alone.stdout)
    stored = CliRunner().invoke(main, ["gate", "--update", str(spread), files["r1"],
                                       *(x for r in ("r2", "r3", "r4", "r5")
                                         for x in ("--spread-from", files[r]))])
    assert stored.exit_code == 0, stored.output
    assert stored.stderr.strip() == f"baseline {spread} created from {files['r1']} with the " \
                                    "spread of 5 runs"
    kept = json.loads(spread.read_text())["run_spread"]
    assert kept["runs"] == [files[r] for r in ("r1", "r2", "r3", "r4", "r5")]
    # a baseline stored from that one without --spread-from keeps no spread: those runs
    # were of the code it held, not of this one's
    again = tmp_path / "again.json"
    assert CliRunner().invoke(main, ["gate", "--update", str(again), str(spread)]
                              ).exit_code == 0
    assert "run_spread" not in json.loads(again.read_text())
    figures = {(f["layer_type"], f["metric"], f.get("kernel_class"), f.get("layer_index")):
               f["values"] for f in kept["figures"]}
    # the stored run's figure first: the step's median span as the gate of r1 has it
    step_span = figures["step", "span_us", None, None]
    assert step_span[0] == pytest.approx(np.median(
        [s["span_us"] for s in json.loads(Path(files["r1"]).read_text())["steps"]]))
    assert len(step_span) == 5 and np.std(step_span) / np.mean(step_span) > 0.02
    assert ("kda", "class_us", "moe", None) in figures and ("mla", "layer_kernel_us", None,
                                                            3) in figures
    night = CliRunner().invoke(main, ["gate", str(spread), files["night"], "--format",
                                      "json"])
    doc = json.loads(night.stdout)
    assert night.exit_code == 0 and doc["ok"] and doc["spread_runs"] == 5, night.output
    moved = [c for c in doc["checks"] if c["tested_over"] == "runs"]
    assert moved and {c["status"] for c in moved} == {"noise"}
    assert all(c["p_value"] >= 0.01 and c["change"] > 0.05 for c in moved)
    assert {(c["layer_type"], c["metric"]) for c in moved} >= {("kda", "kernel_us"),
                                                              ("step", "span_us_mean")}
    assert "within the spread of the baseline's 5 runs (mean" in moved[0]["detail"]
    table = CliRunner().invoke(main, ["gate", str(spread), files["night"], "--all"])
    text = " ".join(table.output.split())
    assert "(runs)" in text and "the baseline keeps the spread of its 5 runs (gate --update " \
        "--spread-from): a time past the tolerances and its steps' test is tested against that " \
        "spread too, where it holds the figure (" in text
    # (with no time checked, no spread is said: it was of nothing the gate checked)
    kernels = CliRunner().invoke(main, ["gate", str(spread), files["night"], "--metrics",
                                        "kernels"])
    assert kernels.exit_code == 0 and "spread" not in kernels.output, kernels.output
    slow = CliRunner().invoke(main, ["gate", str(spread), files["slow"], "--format", "json",
                                     "--junit", str(tmp_path / "g.xml")])
    doc = json.loads(slow.stdout)
    assert slow.exit_code == 1
    failed = {(c["layer_type"], c["metric"]) for c in doc["checks"] if c["fails"]}
    assert {("kda", "kernel_us"), ("step", "span_us"), ("mla", "span_us")} <= failed
    # (every kernel 30% slower: each class's and layer's share of its type's µs is as ever)
    assert not {("kda", "class_us"), ("mla", "layer_kernel_us")} & failed
    assert all(c["tested_over"] == "runs" and c["p_value"] < 0.01 for c in doc["checks"]
               if c["fails"])
    import xml.etree.ElementTree as ET

    properties = {p.get("name"): p.get("value")
                  for p in ET.parse(tmp_path / "g.xml").iter("property")}
    assert properties["spread_runs"] == "5"
    # the library alike; a later --update without --spread-from keeps no spread (of other
    # runs' code)
    assert gate_files(spread, files["night"]).result.ok
    assert not gate_files(one, files["night"]).result.ok
    # one layer 30% slower in a run within the spread fails: a class's or a layer's figure is
    # tested as its share of its type's µs, which a run's noise does not move
    _nightly_runs(tmp_path, {"layer0": 1.02}, slower_layer=1.3)
    layer = gate_files(spread, tmp_path / "layer0.json").result
    failed = {(c.layer_type, c.metric, c.layer_index): c for c in layer.failures}
    check = failed["kda", "layer_kernel_us", 0]
    assert (check.tested_over, check.change > 0.25) == ("runs", True)
    # JUnit names the check alike whichever layer rose most (a server follows its history
    # night to night), its message the layer
    import xml.etree.ElementTree as ET

    from kimi_perf.render import gate_junit

    cases = ET.fromstring(gate_junit(layer, ("b", "r"), "v")).iter("testcase")
    (case,) = [c for c in cases if c.get("name") == "kernel_us (each layer)"
               and c.get("classname") == "trace.kda"]
    assert case.find("failure").get("message").startswith("regression: ")
    assert "(layer 0, +" in case.find("failure").get("message")
    assert ("kda", "kernel_us", None) not in failed   # (a type of 6 layers: +5%, noise)
    # a later --update without --spread-from keeps no spread (of other runs' code), and says so
    dropped = CliRunner().invoke(main, ["gate", "--update", str(spread), files["r2"]])
    assert dropped.exit_code == 0 and "run_spread" not in json.loads(spread.read_text())
    assert "(the spread of 5 runs it kept is not kept: it was of the old code's runs; " \
        "--spread-from stores a new one)" in " ".join(dropped.stderr.split())


def test_the_spread_of_runs_takes_runs_of_the_same_work_alone(tmp_path):
    """What --spread-from refuses, one line and nothing written: without --update, fewer than
    four runs, a run given twice (or a copy), a run of other work (layers a step lost), the
    baseline's own file (not a run it was stored from); a stored spread that cannot be read
    is named."""
    _nightly_runs(tmp_path, {"r1": 1.0, "r2": 1.02, "r3": 0.99, "r4": 1.01, "r5": 0.98})
    _nightly_runs(tmp_path, {"shallow": 1.0}, n_layers=4)
    r1, r2, r3, r4, r5, shallow = (str(tmp_path / f"{n}.json")
                                   for n in ("r1", "r2", "r3", "r4", "r5", "shallow"))
    shutil.copy(r2, tmp_path / "copy.json")
    for name in ("r1", "r2"):
        again = json.dumps(json.loads((tmp_path / f"{name}.json").read_text()), indent=2)
        (tmp_path / f"{name}.again.json").write_text(again)
    base = tmp_path / "base.json"

    def spread(*runs):
        return [x for r in runs for x in ("--spread-from", r)]

    for args, said in (
            ([str(base), r1, *spread(r2, r3, r4, r5)], "--spread-from goes with --update"),
            (["--update", str(base), r1, *spread(r2, r3, r4)],
             "the spread of runs takes 4 runs or more besides"),
            (["--update", str(base), r1, *spread(r2, r3, r4, r2)],
             f"{r2}: given twice: the same run twice"),
            (["--update", str(base), r1, *spread(r2, r3, r4, r1)],
             f"{r1}: given twice: the same run twice"),
            (["--update", str(base), r1, *spread(r2, r3, r4, str(tmp_path / "copy.json"))],
             f"{tmp_path / 'copy.json'}: given twice (also as {r2})"),
            # the same run under another name: re-indented (not a copy of its bytes), or r1
            # itself so (the run the spread is of)
            (["--update", str(base), r1, *spread(r2, r3, r4, str(tmp_path / "r2.again.json"))],
             f"{tmp_path / 'r2.again.json'}: has {r2}'s times to the last digit in every one "
             "of its "),
            (["--update", str(base), r1, *spread(r2, r3, r4, str(tmp_path / "r1.again.json"))],
             f"{tmp_path / 'r1.again.json'}: has {r1}'s times"),
            (["--update", str(base), r1, *spread(r2, r3, r4, shallow)],
             f"{shallow}: not a run of {r1}'s work (trace ")):
        result = CliRunner().invoke(main, ["gate", *args])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
        assert said in result.output, result.output
        assert not base.exists()
    with pytest.raises(TypeError, match="spread_from: a list of runs, not one str"):
        update_baseline(base, r1, spread_from=r2)
    assert CliRunner().invoke(main, ["gate", "--update", str(base), r1,
                                     *spread(r2, r3, r4, r5)]).exit_code == 0
    # the baseline's own file among the runs: a run of the code it replaces; a run it was
    # stored from (the same bytes) is a run of this code
    assert CliRunner().invoke(main, ["gate", "--update", str(base), r2,
                                     *spread(r1, r3, r4, r5)]).exit_code == 0
    kept = base.read_bytes()
    again = CliRunner().invoke(main, ["gate", "--update", str(base), r2,
                                      *spread(r3, r4, r5, str(base))])
    assert again.exit_code == 2 and f"{base}: is the baseline" in again.output
    assert base.read_bytes() == kept
    doc = json.loads(base.read_text())
    for bad, problem in (({"runs": ["a", "b"], "figures": []}, "run_spread is not an object "
                                                                "of runs"),
                         ({**doc["run_spread"], "figures": [{"path": "trace"}]},
                          "run_spread.figures[0] is not an object of a path"),
                         ({**doc["run_spread"], "figures": [{
                             **doc["run_spread"]["figures"][0], "values": [1.0, 2.0]}]},
                          "a finite value for each of its 5 runs"),
                         ({**doc["run_spread"], "figures": [{
                             **doc["run_spread"]["figures"][0], "layer_index": 2}]},
                          "a layer_index for layer_kernel_us"),
                         ({**doc["run_spread"], "figures": doc["run_spread"]["figures"][:1] * 2},
                          "run_spread.figures[1] is a figure of an earlier one's again")):
        (tmp_path / "bad.json").write_text(json.dumps({**doc, "run_spread": bad}))
        result = CliRunner().invoke(main, ["gate", str(tmp_path / "bad.json"), r2])
        assert result.exit_code == 2 and result.output.startswith(
            f"kimi-perf: error: {tmp_path / 'bad.json'}: run_spread") and problem in \
            result.output and len(result.output.splitlines()) == 1, result.output


def tp_job_trace(seed: int, factor: float = 1.0, slow: dict[int, float] | None = None,
                 devices: int = 4, first_device: int = 0, steps: int = 12) -> Trace:
    """One file of a TP job (as ``nsys profile torchrun`` writes it): a process per device,
    each ``steps`` decode steps of 4 layers with ranges, each step's kernels 1% of noise of
    their own; every kernel ``factor`` times as long (a run's clocks), those of each rank in
    ``slow`` (a device's index among the job's) its factor more (a straggler)."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    for rank in range(devices):
        device, pid = first_device + rank, rank + 1
        for s in range(steps):
            step_start, noise = b.clock, rng.normal(1.0, 0.01)
            for i, kernels in enumerate(k3_like(4)):
                first = b.clock
                for name in kernels:
                    us = 1000 * factor * noise * (slow or {}).get(rank, 1.0)
                    t = b.clock
                    b.launch(name, t, t + 50, t + 200, t + 200 + int(us), pid=pid, tid=pid,
                             device=device)
                    b.clock += int(us) + 100
                b.range(f"layer[{i}]({'mla' if 'mla_decode' in kernels else 'kda'})",
                        first - 10, b.clock, pid=pid, tid=pid)
            b.range(f"decode_step[{s}]", step_start - 20, b.clock, pid=pid, tid=pid)
            b.clock += 5000
    return b.build()


def test_one_slow_rank_of_a_tp_job_fails_the_gate_where_the_medians_of_all_pass(tmp_path):
    """A TP job's one trace: every figure pools its devices (a step's mean layer over its
    GPUs), so one rank of four 20% slower moves the medians by nothing and the step's mean
    by 5%: the pooled checks pass. Each device checked on its own (at alpha / 4) fails that
    rank, named; a job alike passes; devices of other ids pair by rank."""

    from kimi_perf.render import gate_junit, gate_table, tables_text

    base = breakdown(tp_job_trace(0))
    slow = breakdown(tp_job_trace(1, slow={2: 1.2}))
    result = gate({"trace": base}, {"trace": slow})
    checks = {(c.layer_type, c.metric): c for c in result.checks}
    for layer_type in ("kda", "mla", "step"):
        assert checks[layer_type, "span_us"].status == "ok"
        device = checks[layer_type, "span_us_device"]
        assert device.status == "regression" and (device.device, device.baseline_device) == (2, 2)
        assert device.alpha == pytest.approx(0.01 / 4) and device.p_value < device.alpha
        assert device.change == pytest.approx(0.2, abs=0.02)
        assert device.detail.startswith("device 2 of 4; the others' medians moved ")
        assert result.metric_name(device) == "span_us (device 2)"
    assert checks["kda", "kernel_us_device"].status == "regression"
    # the figures and the test are the device's own: its layers' median, its steps' means
    mine = [[r for r in b.layers if r["device"] == 2 and r["type"] == "kda"]
            for b in (base, slow)]
    kda = checks["kda", "span_us_device"]
    assert (kda.baseline, kda.current) == tuple(
        pytest.approx(np.median([r["span_us"] for r in rows])) for rows in mine)
    means = [[np.mean([r["span_us"] for r in rows if r["step"] == s])
              for s in sorted({r["step"] for r in rows})] for rows in mine]
    # (every step of the run's device slower than every one of the baseline's: exact p, one
    # split of all C(n+m, n))
    assert min(means[1]) > max(means[0])
    assert kda.p_value == pytest.approx(1 / math.comb(len(means[0]) + len(means[1]),
                                                      len(means[0])))
    assert not result.ok and {c.metric for c in result.failures} == {"kernel_us_device",
                                                                      "span_us_device"}
    text = " ".join(tables_text([gate_table(result)]).split())
    assert "span_us (device 2)" in text and "│ regression │ device 2 of 4;" in text
    assert "kda span_us (device 2)" in gate_headline(result)
    # JUnit names the check alike whichever device it shows (a server follows its history)
    junit = gate_junit(result, ("a", "b"), "")
    assert 'name="span_us (each device)"' in junit and "(device 2)" not in junit.split(
        "<system-out>")[0].split("<testcase")[-1]
    doc = result.to_json()
    assert {(c["device"], c["baseline_device"]) for c in doc["checks"]
            if c["metric"] == "span_us_device"} == {(2, 2)}
    # a job alike passes: each device's check shows the one that moved most, ok
    same = gate({"trace": base}, {"trace": breakdown(tp_job_trace(1))})
    assert same.ok and {c.status for c in same.checks if c.metric in (
        "span_us_device", "kernel_us_device")} <= {"ok", "noise"}
    # one faster rank: an improvement, that rank's
    fast = gate({"trace": base}, {"trace": breakdown(tp_job_trace(1, slow={1: 0.8}))})
    assert {(c.status, c.device) for c in fast.checks if c.metric == "span_us_device"} == {
        ("improvement", 1)}
    # the run's job on GPUs 4..7: paired by rank, the baseline's device said
    moved = gate({"trace": base}, {"trace": breakdown(tp_job_trace(1, slow={2: 1.2},
                                                                   first_device=4))})
    kda = next(c for c in moved.checks if (c.layer_type, c.metric) == ("kda", "span_us_device"))
    assert (kda.device, kda.baseline_device, kda.status) == (6, 2, "regression")
    assert kda.detail.startswith("device 6, rank 2 of 4 (the baseline's device 2); the "
                                 "others'")
    # a job of four against one device: the three others missing, each its own check (a new
    # device each the other way round, shown as one); both of one device: no device checks
    lone = breakdown(tp_job_trace(1, devices=1))
    for pair, said in (((base, lone), {("missing", None, 1), ("missing", None, 2),
                                       ("missing", None, 3), ("ok", 0, 0)}),
                       ((lone, base), {("new", 1, None)}), ((lone, lone), set())):
        checks = [c for c in gate({"trace": pair[0]}, {"trace": pair[1]}).checks
                  if c.metric in ("span_us_device", "kernel_us_device")]
        assert {(c.status, c.device, c.baseline_device) for c in checks} == said
        assert all(c.detail == f"device {c.baseline_device} of 4 ran none of these in the run"
                   if c.status == "missing" else c.status == "ok"
                   or c.detail.endswith("new too: devices 2, 3") for c in checks)
    # a job of one device on another GPU (5): its rank 0, the others missing, all timed
    other_gpu = gate({"trace": base}, {"trace": breakdown(tp_job_trace(1, devices=1,
                                                                       first_device=5))})
    shown = [c for c in other_gpu.checks if c.metric == "span_us_device"]
    assert {(c.status, c.device, c.baseline_device) for c in shown} == {
        ("missing", None, 1), ("missing", None, 2), ("missing", None, 3), ("ok", 5, 0)}
    assert other_gpu.devices_untimed == {}
    # stored (layers a list of dicts, read back) alike
    again = Breakdown.from_json(json.loads(json.dumps(slow.to_json())))
    assert [(c.metric, c.device, c.status) for c in gate({"trace": base},
                                                         {"trace": again}).checks] == [
        (c.metric, c.device, c.status) for c in result.checks]


def test_a_tp_jobs_spread_of_runs_keeps_each_devices_figures(tmp_path):
    """A baseline of a TP job stored with the spread of its runs keeps each device's medians
    (by the stored run's device): a night whose every rank is 7% slower (its clocks) is
    within the spread, device checks too; one whose rank 3 is 30% slower fails on it, and so
    does one whose rank 3 is 12% slower: within its own runs' spread of clocks (±4%), past that
    of its share of the figure over all devices, which the clocks move not at all."""
    files = {}
    for name, seed, factor, slow in (("r1", 0, 1.0, None), ("r2", 1, 1.04, None),
                                     ("r3", 2, 0.97, None), ("r4", 3, 1.06, None),
                                     ("r5", 4, 0.99, None), ("night", 5, 1.07, None),
                                     ("slow", 6, 1.0, {3: 1.3}), ("rank", 7, 1.0, {3: 1.12})):
        files[name] = tmp_path / f"{name}.kptrace"
        tp_job_trace(seed, factor, slow).save(files[name])
    spread = spread_of_runs(files["r1"], [files[r] for r in ("r2", "r3", "r4", "r5")])
    devices = {(f["layer_type"], f["metric"], f["device"]): f["values"]
               for f in spread["figures"] if "device" in f}
    assert set(devices) == {(t, m, d) for t in ("kda", "mla", "step")
                            for m in ("kernel_us_device", "span_us_device") for d in range(4)}
    r1 = breakdown(read_trace(files["r1"]))
    assert devices["mla", "span_us_device", 3][0] == pytest.approx(np.median(
        [r["span_us"] for r in r1.layers if r["device"] == 3 and r["type"] == "mla"]))
    assert run_spread_problem(spread) is None
    baseline = tmp_path / "base.json"
    update_baseline(baseline, files["r1"], spread_from=[files[r] for r in ("r2", "r3", "r4",
                                                                          "r5")])
    assert json.loads(baseline.read_text())["run_spread"]["figures"] == spread["figures"]
    night = gate_files(baseline, files["night"]).result
    assert night.ok, night
    within = [c for c in night.checks if c.metric == "span_us_device" and c.tested_over == "runs"]
    assert within and {c.status for c in within} == {"noise"}
    slow = gate_files(baseline, files["slow"]).result
    assert {(c.layer_type, c.metric, c.device) for c in slow.failures} >= {
        ("mla", "span_us_device", 3), ("step", "span_us_device", 3)}
    rank = gate_files(baseline, files["rank"]).result
    kda = next(c for c in rank.checks if (c.layer_type, c.metric) == ("kda", "span_us_device"))
    assert (kda.status, kda.device, kda.tested_over) == ("regression", 3, "runs")
    from kimi_perf.gate import _spread_p

    runs = np.array(devices["kda", "span_us_device", 3])
    assert _spread_p(runs, kda.current, True) > kda.alpha > kda.p_value   # (its share's p)
    # a run of one device more is other work, though its type's devices show a slow rank (of
    # breakdowns that do not say their GPUs: no capture that differs says it first)
    steady = [100.0, 100.5, 101.0, 101.5, 102.0, 102.5]
    runs = [tmp_path / f"{name}.json" for name in ("j1", "j2", "j3", "j4", "extra")]
    loaded = {f: (_job_of_steps({d: [v * (1 + i / 100) for v in steady] for d in range(4)}),
                  {}, None) for i, f in enumerate(runs[:4])}
    loaded[runs[4]] = (_job_of_steps({d: [v * 1.3 for v in steady] if d == 1 else steady
                                      for d in range(5)}), {}, None)
    with pytest.raises(TraceError, match=r"not a run of .*'s work \(trace \w+ \w+_us \(device "
                                         r"4\): new"):
        spread_of_runs(runs[0], runs[1:], loaded=loaded)
    # a device's figure without its device (or a device on another figure) is refused
    for figure in ({"path": "trace", "layer_type": "mla", "metric": "span_us_device",
                    "values": [1.0] * 5},
                   {"path": "trace", "layer_type": "mla", "metric": "span_us", "device": 0,
                    "values": [1.0] * 5}):
        assert run_spread_problem({"runs": list("abcde"), "figures": [figure]}).startswith(
            "run_spread.figures[0] is not an object of a path")


def _job_of_steps(device_steps: dict[int, list[float]],
                  layers_a_step: int | dict[int, int] = 1) -> dict[str, Breakdown]:
    """A job of ``layers_a_step`` kda layers a step on each device (or by device), each
    step's figures given by device (its layers' 0.1% apart)."""
    held = {d: layers_a_step if isinstance(layers_a_step, int) else layers_a_step[d]
            for d in device_steps}
    layers = [{"type": "kda", "step": s, "device": d, "index": i, "kernels": 9,
               "kernel_us": v * (1 + i / 1000), "span_us": v * (1 + i / 1000)}
              for d, values in device_steps.items() for s, v in enumerate(values)
              for i in range(held[d])]
    steps = [{"index": s, "device": d, "layers": held[d], "kernels": 9 * held[d],
              "kernel_us": v * held[d], "span_us": v * held[d]}
             for d, values in device_steps.items() for s, v in enumerate(values)]
    return {"trace": Breakdown(source={}, steps=steps, layers=layers,
                               layer_types=[{"type": "kda"}])}


def test_a_model_of_another_depth_makes_every_devices_step_other_work(tmp_path):
    """Runs of 8 and 4 layers: a step is other work, for each device as for the whole; the
    devices behind the check shown (its ``others``) say so too, not the regression their
    steps' times would be."""
    files = [tmp_path / "base.json", tmp_path / "run.json"]
    steady = [100.0, 100.5, 101.0, 101.5, 102.0, 102.5]
    slow = [130.0, 131.0, 132.0, 133.0, 134.0, 135.0]
    loaded = {files[0]: (_job_of_steps({d: steady for d in range(4)}), {"run": {"n_layers": 8}},
                         None),
              files[1]: (_job_of_steps({0: steady, 1: slow, 2: [v + 10 for v in slow],
                                        3: steady}), {"run": {"n_layers": 4}}, None)}
    result = gate_files(*files, loaded=loaded).result
    steps = [c for c in result.checks if (c.layer_type, c.metric) == ("step", "span_us_device")]
    assert [(d.device, d.status) for c in steps for d in (c, *c.others)] == [
        (2, "changed"), (0, "changed"), (1, "changed"), (3, "changed")]
    # (the one shown still says which device it is, and how the others moved)
    assert [c.detail for c in steps] == [
        "device 2 of 4; the others' medians moved +0.0% to +30.9%; models of 8 and 4 layers: "
        "a step is other work"]
    # (a check that passes stands for none that fails: the one shown is the worst)
    assert not [o for c in result.to_json()["checks"] if not c["fails"] for o in c["others"]
                if o["fails"]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=7),
       st.lists(st.integers(0, 6), min_size=2, max_size=7), st.booleans())
def test_the_u_test_is_exact_ties_and_all(cur, base, worse):
    """Its p is the share of all splits of the pooled values whose U is as extreme as the
    one observed (midranks where values tie), counted here split by split."""
    from itertools import combinations

    from scipy.stats import rankdata

    from kimi_perf.stats import u_test

    pooled = np.array(cur + base, dtype=float)
    ranks = rankdata(pooled)
    observed = ranks[:len(cur)].sum()
    sums = np.array([ranks[list(split)].sum() for split in combinations(range(pooled.size),
                                                                         len(cur))])
    as_extreme = sums >= observed - 1e-9 if worse else sums <= observed + 1e-9
    assert u_test(pooled[:len(cur)], pooled[len(cur):], worse) == pytest.approx(
        as_extreme.mean(), rel=1e-12)


def test_the_u_test_reaches_alpha_where_its_approximation_cannot():
    """Eight steps a side, all of one above the other's, two tied: the exact p is 1/12,870;
    scipy's normal approximation (which it takes where values tie) reads 0.00047, so at α
    0.00025 (0.001 over four devices) a rank's every step slower could never fail. Three
    against 300: exact 1/C(303, 3), the approximation 0.0015. Past the exact test's work
    (150 steps a side) the approximation, good there."""
    from scipy.stats import mannwhitneyu

    from kimi_perf.stats import u_test

    steady = [100.0, 100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 106.0]
    slower = [120.0, 120.0, 121.0, 122.0, 123.0, 124.0, 125.0, 126.0]
    assert mannwhitneyu(slower, steady, alternative="greater").pvalue > 0.00025
    result = gate(_job_of_steps({d: steady for d in range(4)}),
                  _job_of_steps({d: slower if d == 1 else steady for d in range(4)}),
                  Tolerances(alpha=0.001))
    (check,) = [c for c in result.checks if (c.layer_type, c.metric)
                == ("kda", "span_us_device")]
    assert check.p_value == pytest.approx(1 / 12_870) and check.status == "regression"
    few, many = np.array([1.0, 1.0, 2.0]), np.arange(300.0) + 10
    assert u_test(many, few, True) == u_test(few, many, False) == pytest.approx(
        1 / 4_590_551, rel=1e-9, abs=0)
    assert u_test(few, many, True) == pytest.approx(1.0)
    # three against 100,000, above all but one: 7 of the C(100003, 3) splits sum their ranks
    # as high (from the top: 2+3+4 at most 9), counting only the values ranked that high
    huge = np.arange(100_000.0)
    # 100 layers below 48,800 whole-µs ones of three values: one split of C(48900, 100),
    # past a float (1e311)
    tied = np.repeat([100.0, 101.0, 102.0], [16_000, 16_400, 16_400])
    assert u_test(np.linspace(89.0, 91.0, 100), tied, False) == pytest.approx(
        1 / math.comb(48_900, 100), rel=1e-9, abs=0)   # (approx's own 1e-12 takes any p)
    assert u_test(np.array([99_998.5, 99_998.6, 99_998.7]), huge, True) == pytest.approx(
        7 / math.comb(100_003, 3), rel=1e-9, abs=0)
    rng = np.random.default_rng(0)
    base, cur = rng.normal(100, 1, 150), rng.normal(100.3, 1, 150)
    assert u_test(cur, base, True) == mannwhitneyu(cur, base, alternative="greater",
                                                    method="asymptotic").pvalue


def test_each_device_is_tested_at_alpha_shared_among_the_devices():
    """Device 1's six steps 20% slower but two of them below the baseline's slowest: the
    exact Mann-Whitney p is 4/924 (0.0043). Of two devices (α 0.005 each) a regression; of
    four (α 0.0025) noise: the largest of more devices' rises is picked, not drawn. Five
    steps a side cannot reach α/4 (1/252): no device checks, as a ratio no test decides
    would pass for a regression; a device that lost its layers is missing."""
    steady = [100.0, 101.0, 102.0, 103.0, 104.0, 122.5]
    slower = [120.0, 121.0, 123.0, 124.0, 125.0, 126.0]
    for devices, status in ((2, "regression"), (4, "noise")):
        base = _job_of_steps({d: steady for d in range(devices)})
        run = _job_of_steps({d: slower if d == 1 else steady for d in range(devices)})
        result = gate(base, run)
        (check,) = [c for c in result.checks if (c.layer_type, c.metric)
                    == ("kda", "span_us_device")]
        assert check.p_value == pytest.approx(4 / 924) and check.alpha == 0.01 / devices
        assert (check.status, check.device, check.tested_over) == (status, 1, "steps")
        assert check.change == pytest.approx(123.5 / 102.5 - 1)
    # figures that tie (a trace in whole µs): the test still exact, not scipy's normal
    # approximation (p 0.0025 for six steps a side all above the other side's, exact 1/924)
    tied = gate(_job_of_steps({d: [100.0, 100.0, 102.0, 103.0, 104.0, 105.0] for d in range(2)}),
                _job_of_steps({0: [100.0, 100.0, 102.0, 103.0, 104.0, 105.0],
                               1: [120.0, 120.0, 121.0, 123.0, 124.0, 125.0]}))
    (check,) = [c for c in tied.checks if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert check.p_value == pytest.approx(1 / 924) and check.status == "regression"
    few = gate(_job_of_steps({d: steady[:5] for d in range(4)}),
               _job_of_steps({d: slower[:5] if d == 1 else steady[:5] for d in range(4)}))
    assert not [c for c in few.checks if c.metric in ("span_us_device", "kernel_us_device")]
    assert few.devices_untimed == {"trace kda": 4, "trace step": 4}   # (said: profile more)
    assert few.to_json()["devices_untimed"] == {"trace kda": 4, "trace step": 4}
    from kimi_perf.gate import GatedRun
    from kimi_perf.render import gate_text

    said = " ".join(gate_text(GatedRun(few, {}, {}, {}, None, (Path("a"), Path("b")))).split())
    assert ("no check of each device's times for trace kda (4 devices), trace step (4 devices): "
            "too few steps a device for the test at --alpha over the devices (profile more "
            "steps)") in said
    lost = _job_of_steps({d: steady for d in range(4)})["trace"]
    lost.layers = [r for r in lost.layers if r["device"] != 3] + [
        {"type": "mla", "step": s, "device": 3, "index": 0, "kernels": 9, "kernel_us": 1.0,
         "span_us": 1.0} for s in range(6)]   # (the rank ran other layers: still 4 devices)
    result = gate(_job_of_steps({d: steady for d in range(4)}), {"trace": lost})
    check, ran = [c for c in result.checks if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert (check.status, check.device, check.current) == ("missing", 3, None) and check.fails
    assert check.detail == "device 3 of 4 ran none of these in the run"
    # (the devices that ran it: one check, as ever)
    assert ran.status == "ok" and [o.device for o in ran.others] == [1, 2]
    # the headline says the device lost them, not the type (the others still run it)
    headline = gate_headline(result)
    assert headline.startswith("gate: FAIL, 1 missing (2 checks), 1 layer count differs: trace "
                               "kda layers 1 -> 0 (device 3: 1 layers a step in the baseline, 0 i")
    assert headline.endswith("; trace device 3: no kda layers in the run (kda kernel_us, kda "
                             "span_us)")
    # whatever its steps: five a side, too few to time the devices, still say it
    few_lost = {"trace": copy.deepcopy(lost)}
    few_lost["trace"].layers = [r for r in lost.layers if r["step"] < 5]
    few_lost["trace"].steps = [r for r in lost.steps if r["index"] < 5]
    assert {(c.layer_type, c.metric, c.status, c.device) for c in gate(
        _job_of_steps({d: steady[:5] for d in range(4)}), few_lost).checks
        if c.metric.endswith("_device")} == {("kda", "kernel_us_device", "missing", 3),
                                             ("kda", "span_us_device", "missing", 3)}
    # a device lost and one that regressed: each a failure of its own, both in the headline
    slow_lost = copy.deepcopy(lost)
    for r in slow_lost.layers:
        if r["device"] == 1 and r["type"] == "kda":
            r["span_us"] = r["kernel_us"] = r["span_us"] * 1.3
    both = gate(_job_of_steps({d: steady for d in range(4)}), {"trace": slow_lost})
    assert [(c.status, c.device, c.baseline_device) for c in both.checks
            if (c.layer_type, c.metric) == ("kda", "span_us_device")] == [
        ("missing", 3, 3), ("regression", 1, 1)]
    assert "trace kda span_us (device 1) 102.5 -> 133.2" in gate_headline(both)
    # a rank whose layers were all lost (4 devices to 3): paired by id, the fourth missing
    three = gate(_job_of_steps({d: steady for d in range(4)}),
                 _job_of_steps({d: steady for d in range(3)}))
    assert {(c.layer_type, c.metric, c.device, c.baseline_device) for c in three.failures} == {
        (t, m, None, 3) for t in ("kda", "step") for m in ("kernel_us_device",
                                                            "span_us_device")}
    assert gate_headline(three) == ("gate: FAIL, 1 missing (4 checks): trace device 3: no "
                                    "layers in the run (kda kernel_us, kda span_us, step "
                                    "kernel_us, step span_us)")
    # two ranks lost (4 devices to 2): each its own checks and headline item; JSON holds every
    # device's check (those of the devices that ran it in the one shown for them)
    two = gate(_job_of_steps({d: steady for d in range(4)}),
               _job_of_steps({d: steady for d in range(2)}))
    assert gate_headline(two) == (
        "gate: FAIL, 2 missing (8 checks): trace device 2: no layers in the run (kda kernel_us, "
        "kda span_us, step kernel_us, step span_us); trace device 3: no layers in the run (kda "
        "kernel_us, kda span_us, step kernel_us, step span_us)")
    doc = two.to_json()
    assert doc["failed"] == 8 == len(two.failures)
    assert [(c["device"], c["baseline_device"], c["status"], c["fails"],
             [(o["device"], o["status"]) for o in c["others"]]) for c in doc["checks"]
            if (c["layer_type"], c["metric"]) == ("kda", "span_us_device")] == [
        (None, 2, "missing", True, []), (None, 3, "missing", True, []),
        (0, 0, "ok", False, [(1, "ok")])]
    # (each of the others as a check is, its fails said, no list of its own)
    assert [set(o) for c in doc["checks"] for o in c["others"]] == [
        set(doc["checks"][0]) - {"others"}] * sum(len(c["others"]) for c in doc["checks"])
    from kimi_perf.render import gate_junit

    junit = gate_junit(two, ("a", "b"), "")
    assert junit.count('name="span_us (device 2)"') == junit.count(
        'name="span_us (device 3)"') == 2 and 'failures="8"' in junit
    # a job of three on other GPUs (4 to 6): its ranks in order, the fourth lost, not seven
    # devices each missing or new; a rank is its place among its side's devices
    slowest = [130.0, 131.0, 132.0, 133.0, 134.0, 135.0]
    moved = gate(_job_of_steps({d: steady for d in range(4)}),
                 _job_of_steps({d: slowest if d == 5 else steady for d in range(4, 7)}))
    lost_one, shown = [c for c in moved.checks
                       if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert (lost_one.status, lost_one.baseline_device, lost_one.device) == ("missing", 3, None)
    assert (shown.status, shown.baseline_device, shown.device) == ("regression", 1, 5)
    assert [(o.baseline_device, o.device, o.status) for o in shown.others] == [
        (0, 4, "ok"), (2, 6, "ok")]
    assert shown.detail.startswith("device 5, rank 1 of 3 (the baseline's device 1); the "
                                   "others' medians moved +0.0%")
    assert gate_headline(moved) == (
        "gate: FAIL, 4 regressions, 1 missing (4 checks): trace device 3: no layers in the run "
        "(kda kernel_us, kda span_us, step kernel_us, step span_us); " + "; ".join(
            f"trace {t} {m} (device 5) 102.5 -> 132.5 (device 5, rank 1 of 3 (the baseline's "
            "device 1); the others' medians moved +0.0%)" for t in ("kda", "step")
            for m in ("kernel_us", "span_us")))
    # the run on GPUs 4 to 7, its rank 3 (device 7) lost its kda layers: named device 7 in the
    # headline as in the table, the baseline's device said
    elsewhere = _job_of_steps({d: steady for d in range(4, 8)})["trace"]
    elsewhere.layers = [r for r in elsewhere.layers if r["device"] != 7] + [
        {"type": "mla", "step": s, "device": 7, "index": 0, "kernels": 9, "kernel_us": 1.0,
         "span_us": 1.0} for s in range(6)]
    far = gate(_job_of_steps({d: steady for d in range(4)}), {"trace": elsewhere})
    lost_far = next(c for c in far.checks if (c.layer_type, c.metric, c.status)
                    == ("kda", "span_us_device", "missing"))
    assert (far.metric_name(lost_far), lost_far.detail) == (
        "span_us (device 7)", "device 7, rank 3 of 4 (the baseline's device 3) ran none of these "
                              "in the run")
    assert gate_headline(far).endswith("; trace device 7: no kda layers in the run (kda "
                                       "kernel_us, kda span_us)")
    # one more: new, said (no failure)
    five = gate(_job_of_steps({d: steady for d in range(4)}),
                _job_of_steps({d: steady for d in range(5)}))
    assert five.ok and {(c.status, c.device, c.baseline_device) for c in five.checks
                        if c.metric == "span_us_device"} == {("new", 4, None)}
    # too few steps a side for the whole's test (two): its devices' layers are tested, as its own
    windows = gate(_job_of_steps({d: [100.0, 101.0] for d in range(4)}, layers_a_step=8),
                   _job_of_steps({d: [120.0, 121.0] if d == 2 else [100.0, 101.0]
                                  for d in range(4)}, layers_a_step=8))
    (check,) = [c for c in windows.checks if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert (check.status, check.device, check.tested_over) == ("regression", 2, "layers")
    assert check.p_value < 0.0025 == check.alpha
    # JUnit says the p as the table does: its samples the layers, at α over the devices
    from kimi_perf.render import gate_junit

    assert re.search(r'message="regression: [\d,.]+ -&gt; [\d,.]+ \(\+[\d.]+%, p [\d.e-]+ '
                     r'\(layers\) \(α 0.0025\)\)"', gate_junit(windows, ("a", "b"), ""))
    # a spread that is none: said, as a baseline's would be
    with pytest.raises(TypeError, match="run_spread: a baseline's run_spread"):
        gate(_job_of_steps({0: steady, 1: steady}), _job_of_steps({0: steady, 1: steady}),
             run_spread=[])
    with pytest.raises(ValueError, match="run_spread is not an object of runs"):
        gate(_job_of_steps({0: steady, 1: steady}), _job_of_steps({0: steady, 1: steady}),
             run_spread={"runs": ["a"]})


def test_a_device_past_its_own_spread_fails_though_another_moved_more_within_its(tmp_path):
    """Rank 0 of four moves from run to run by ±10% on its own, the others not at all: a
    night with rank 0 12% slower and rank 1 10% slower has rank 0 within its spread and rank
    1 far past its own. Each device is tested against its spread before one is shown: rank 1
    fails. So it does of two devices, whose share of the figure over both moves by half a
    straggler's slowdown, and with the other's noise: its own figure is past its runs. A
    spread stored before the gate checked each device lends its figure over all devices,
    scaled, said so; a run on other GPUs is tested against the spread of the baseline's
    device it pairs with."""
    files = {}
    for name, seed, factor, slow in (
            ("r1", 0, 1.0, {0: 1.0}), ("r2", 1, 1.0, {0: 0.92}), ("r3", 2, 1.0, {0: 1.1}),
            ("r4", 3, 1.0, {0: 0.95}), ("r5", 4, 1.0, {0: 1.06}),
            ("night", 5, 1.0, {0: 1.12, 1: 1.10}), ("clocks", 6, 1.07, None)):
        files[name] = tmp_path / f"{name}.kptrace"
        tp_job_trace(seed, factor, slow=slow).save(files[name])
    baseline = tmp_path / "base.json"
    update_baseline(baseline, files["r1"], spread_from=[files[r] for r in ("r2", "r3", "r4",
                                                                          "r5")])
    night = gate_files(baseline, files["night"]).result
    shown = {(c.layer_type, c.metric): c for c in night.checks if c.metric == "span_us_device"}
    for layer_type in ("kda", "step"):
        check = shown[layer_type, "span_us_device"]
        assert (check.status, check.device, check.tested_over) == ("regression", 1, "runs")
        assert check.p_value < check.alpha == 0.01 / 4
    assert {c.metric for c in night.failures} <= {"span_us_device", "kernel_us_device"}
    pair = {}
    for name, seed, slow in (("p1", 0, {0: 1.0}), ("p2", 1, {0: 0.92}), ("p3", 2, {0: 1.1}),
                             ("p4", 3, {0: 0.95}), ("p5", 4, {0: 1.06}), ("pn", 5, {1: 1.2})):
        pair[name] = tmp_path / f"{name}.kptrace"
        tp_job_trace(seed, slow=slow, devices=2).save(pair[name])
    two = tmp_path / "two.json"
    update_baseline(two, pair["p1"], spread_from=[pair[r] for r in ("p2", "p3", "p4", "p5")])
    slow_rank = [c for c in gate_files(two, pair["pn"]).result.failures
                 if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert [(c.device, c.tested_over) for c in slow_rank] == [(1, "runs")]
    # a spread stored without each device's figures: the pooled one's, scaled to the device
    doc = json.loads(baseline.read_text())
    doc["run_spread"]["figures"] = [f for f in doc["run_spread"]["figures"] if "device" not in f]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    lent = [c for c in gate_files(old, files["clocks"]).result.checks
            if c.metric == "span_us_device" and c.tested_over == "runs"]
    assert lent and all("of the runs' figure over all devices, scaled to this device's: the "
                        "baseline keeps no spread of each device's (gate --update --spread-from "
                        "again keeps it)" in c.detail for c in lent)
    # the night's job on GPUs 4 to 7: each tested against its baseline device's spread
    files["moved"] = tmp_path / "moved.kptrace"
    tp_job_trace(5, slow={0: 1.12, 1: 1.10}, first_device=4).save(files["moved"])
    moved = gate_files(baseline, files["moved"]).result
    assert {(c.layer_type, c.metric, c.device, c.baseline_device) for c in moved.failures} >= {
        ("kda", "span_us_device", 5, 1)}
    assert all("scaled" not in (c.detail or "") for c in moved.checks)


def test_a_rank_that_lost_a_layer_a_step_is_other_work():
    """One rank of four whose steps hold 2 layers where the baseline's held 3: the median
    step over every device still holds 3, and the rank's steps read 33% faster. Its layers a
    step differ, said of it, and its steps' times are other work (changed), not an
    improvement."""
    steps = [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    base = _job_of_steps({d: steps for d in range(4)}, layers_a_step=3)
    run = _job_of_steps({d: steps for d in range(4)}, layers_a_step={0: 3, 1: 3, 2: 2, 3: 3})
    result = gate(base, run)
    checks = {(c.layer_type, c.metric): c for c in result.checks}
    for layer_type in ("kda", "step"):
        layers = checks[layer_type, "layers"]
        assert (layers.baseline, layers.current, layers.status) == (3, 2, "differs")
        assert (layers.device, layers.baseline_device) == (2, 2)
        assert layers.detail == ("device 2: 3 layers a step in the baseline, 2 in the run (the "
                                 "median step of every device: 3 in both)")
    device_step = checks["step", "span_us_device"]
    assert device_step.status == "changed" and device_step.device == 2
    assert device_step.change == pytest.approx(-1 / 3, abs=0.01)
    assert "other work" in device_step.detail
    assert not gate(base, _job_of_steps({d: steps for d in range(4)}, layers_a_step=3)).failures
    # one of two: the median over every device's steps moves by a half that no step holds;
    # the rank that lost it is said beside it
    pair = _job_of_steps({d: steps for d in range(2)}, layers_a_step=3)
    lost = _job_of_steps({d: steps for d in range(2)}, layers_a_step={0: 3, 1: 2})
    layers = next(c for c in gate(pair, lost).checks if (c.layer_type, c.metric) == (
        "kda", "layers"))
    assert (layers.baseline, layers.current, layers.status) == (3, 2.5, "differs")
    assert layers.detail == ("3 layers a step in the baseline, 2.5 in the run (device 1: 3 -> "
                             "2)")
    both = _job_of_steps({d: steps for d in range(2)}, layers_a_step=2)   # (each: the whole)
    assert next(c for c in gate(pair, both).checks if (c.layer_type, c.metric) == (
        "kda", "layers")).detail == "3 layers a step in the baseline, 2 in the run"


def test_five_samples_a_side_are_enough_for_the_test():
    """``min_samples`` (5) a side is where the U test starts: a median up 8% that the test
    finds no more than noise (p about 0.3) is noise there, not a regression by the threshold
    alone; with 4 a side the threshold decides."""
    from kimi_perf.gate import _time_check

    base = np.array([100.0, 101.0, 102.0, 103.0, 104.0])
    cur = np.array([110.0, 111.0, 99.0, 112.0, 100.0])
    check = _time_check("standard", "step", "span_us", base, cur, Tolerances(), base, cur)
    assert check.status == "noise" and 0.2 < check.p_value < 0.5
    fewer = _time_check("standard", "step", "span_us", base[:4], cur[:4], Tolerances(),
                        base[:4], cur[:4])   # (medians 101.5 and 110.5: 8.9% up)
    assert fewer.p_value is None and fewer.status == "regression"


def test_among_devices_that_all_improved_the_most_improved_is_shown():
    """A TP job whose every device improved (5%, 30%, 10%): the row names the device that
    improved most, with its figure, not the least."""
    from kimi_perf.gate import Check, _shown_device

    group = []
    for device, change in ((0, -0.05), (1, -0.30), (2, -0.10)):
        check = Check("standard", "kda", "span_us_device", 100.0, 100 * (1 + change), change,
                      0.001, "improvement")
        check.device = check.baseline_device = device
        group.append(check)
    shown = _shown_device(group, [(0, 0), (1, 1), (2, 2)])
    assert shown.device == 1 and shown.change == -0.30


def test_a_figure_against_a_spread_of_runs_takes_the_prediction_interval():
    """A run's figure against the baseline's five runs is tested as a new draw of them (the
    t statistic over sd·sqrt(1 + 1/n), not sd alone): 116 against 100, 104, 97, 106 and 99
    is p 0.011, noise at alpha 0.01 (0.008 without the factor: a regression)."""
    from kimi_perf.gate import _spread_p

    p = _spread_p(np.array([100.0, 104.0, 97.0, 106.0, 99.0]), 116.0, True)
    assert p == pytest.approx(0.0109, abs=2e-4)


def test_stored_tolerances_may_be_zero_and_a_spread_holds_five_runs():
    """A baseline stored with --rel-tol 0 --abs-tol 0 (settings the gate takes) is read back;
    a stored spread of four runs is not a spread the gate keeps (five at least)."""
    from kimi_perf.runs import stored_tolerances_problem

    assert stored_tolerances_problem({"rel_tol": 0, "abs_tol_us": 0}) is None
    assert stored_tolerances_problem({"rel_tol": -0.1}) is not None
    figures = [{"path": "trace", "layer_type": "step", "metric": "span_us",
                "values": [100.0, 104.0, 97.0, 106.0, 99.0]}]
    five = {"runs": ["r1", "r2", "r3", "r4", "r5"], "figures": figures}
    assert run_spread_problem(five) is None
    four = {"runs": five["runs"][:4], "figures": [figures[0] | {"values": [100.0, 104.0, 97.0,
                                                                           106.0]}]}
    assert run_spread_problem(four) is not None


def test_the_gate_headline_names_five_items_and_clips_a_long_detail():
    """The FAIL line names the first five regressions and counts the rest; a detail is cut
    at 100 characters (a list of new kernels runs to hundreds)."""
    from kimi_perf.gate import Check, GateResult
    from kimi_perf.render import gate_headline

    checks = [Check("trace", f"t{i}", "kernel_us", 100.0, 150.0, 0.5, 0.001, "regression")
              for i in range(8)]
    headline = gate_headline(GateResult(checks, Tolerances()))
    assert headline.count(" -> 150") == 5 and headline.endswith(
        "and 3 more (the table lists them)")
    detail = "kernels only the run has: " + ", ".join(f"fused_kernel_{i}" for i in range(10))
    long = gate_headline(GateResult([Check("trace", "kda", "kernels", 20.0, 30.0, 0.5, None,
                                           "regression", detail)], Tolerances()))
    shown = long[long.index("(") + 1:long.rindex(")")]
    assert len(detail) > 180 and shown.endswith("…") and len(shown) == 100
    assert detail.startswith(shown[:-1])


def test_another_phase_that_kept_other_steps_is_a_breakdown_difference():
    """One side kept its decode steps (--phase decode), the other every step (--phase all),
    a prefill among them: the gate says the sides were broken down otherwise."""
    from kimi_perf.gate import breakdown_differences

    decode = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=4).build())
    every = copy.deepcopy(decode)
    decode.source["breakdown_options"]["phase"] = "decode"
    every.source["breakdown_options"]["phase"] = "all"
    for s in decode.steps:
        s["phase"] = "decode"
    for i, s in enumerate(every.steps):
        s["phase"] = "prefill" if i == 0 else "decode"
    assert breakdown_differences({"trace": decode}, {"trace": every}) == [
        "--phase 'decode' vs 'all'"]
    assert breakdown_differences({"trace": decode}, {"trace": decode}) == []


def test_the_u_test_is_exact_at_sixty_steps_a_side():
    """Sixty steps a side, no ties, a modest shift: the work (about 5e7) is within
    EXACT_TEST_WORK, so its p is the exact one scipy counts, not the normal approximation
    (which differs in the third digit here: a gate at α near p would decide otherwise).
    Compared with abs=0: pytest.approx's default 1e-12 would pass any tiny p."""
    from scipy.stats import mannwhitneyu

    from kimi_perf.stats import u_test

    rng = np.random.default_rng(3)
    base = rng.permutation(np.arange(0.0, 120.0, 2.0))       # distinct values: no ties
    cur = rng.permutation(np.arange(1.0, 121.0, 2.0)) + 8.5
    assert len(np.unique(np.r_[cur, base])) == 120
    for worse, side in ((True, "greater"), (False, "less")):
        exact = mannwhitneyu(cur, base, alternative=side, method="exact").pvalue
        approx = mannwhitneyu(cur, base, alternative=side, method="asymptotic").pvalue
        assert exact != pytest.approx(approx, rel=1e-4, abs=0)   # (the two do differ)
        assert u_test(cur, base, worse) == pytest.approx(exact, rel=1e-9, abs=0)


def test_the_u_test_of_one_value_counts_its_own_rank():
    """One step against four, above all of them: one split in five is as extreme, p 1/5
    (the single value's rank equals the observed sum: it must be counted)."""
    from kimi_perf.stats import u_test

    assert u_test(np.array([5.0]), np.array([1.0, 2.0, 3.0, 4.0]), True) == pytest.approx(0.2)
    assert u_test(np.array([0.0]), np.array([1.0, 2.0, 3.0, 4.0]), False) == pytest.approx(0.2)


def _cut(found_by: str | None, layer_source: str | None, options: dict | None,
         phase: str = "decode", name: str = "decode_step[{i}]") -> Breakdown:
    """A job of one device, six steps of one kda layer, as a breakdown says it found them:
    ``found_by`` its steps (``source.steps_found_by``), ``layer_source`` its layers (each
    step's), ``options`` its ``source.breakdown_options``; None: not said (an older one)."""
    b = _job_of_steps({0: [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]})["trace"]
    for i, s in enumerate(b.steps):
        s.update(name=name.format(i=i), phase=phase)
        if layer_source is not None:
            s["layer_source"] = layer_source
    if found_by is not None:
        b.source["steps_found_by"] = found_by
    if options is not None:
        b.source["breakdown_options"] = options
    return b


def test_how_each_side_was_broken_down_is_a_difference_only_where_it_found_other_cuts(
        tmp_path):
    """What ``breakdown_differences`` and ``phase_differences`` hold to: a side that does not
    say how it found its steps or layers (stored before it did), or whose steps name no phase
    ("unknown" included), is no difference; --steps given where the steps were not ranges
    (graph launches found them on both sides), and --phase that kept the same phases, found
    no other cuts; a baseline stored before it recorded its pattern's own rules
    (``layout_rules``) compares by all its rules; another version's default rules under the
    pattern are a difference. And without --strict a difference is said, failing nothing."""
    from kimi_perf.gate import breakdown_differences, phase_differences

    def differ(base: Breakdown, run: Breakdown) -> list[str]:
        return breakdown_differences({"trace": base}, {"trace": run})

    opts = {"layers": "auto", "steps": None, "phase": "auto", "rules": "default",
            "layout_rules": "default", "default_rules": "sha256:aaaa"}
    ranges = _cut("range", "nvtx", opts)
    assert differ(ranges, ranges) == []
    # (a side that does not say how it found its steps, or its layers)
    assert differ(_cut(None, "nvtx", opts), ranges) == []
    assert differ(_cut("range", None, opts), ranges) == []
    # (--steps where graph launches found the steps on both sides: no other ranges)
    graphs = _cut("graph", "nvtx", opts | {"steps": "^iteration$"}, name="graph[{i}]")
    assert differ(_cut("graph", "nvtx", opts), graphs) == []
    # (--phase decode that kept what auto kept)
    assert differ(ranges, _cut("range", "nvtx", opts | {"phase": "decode"})) == []
    # (steps whose phase is unknown name none: no difference of phases, either way)
    unknown = _cut("range", "nvtx", opts, phase="unknown")
    assert phase_differences({"trace": unknown}, {"trace": ranges}) == []
    assert differ(unknown, ranges) == []
    # under the pattern: an older side without layout_rules compares by its rules
    pattern = _cut("range", "repeat", opts)
    older = _cut("range", "repeat", {k: v for k, v in opts.items() if k != "layout_rules"})
    assert differ(older, pattern) == []
    assert differ(pattern, _cut("range", "repeat", opts | {"default_rules": "sha256:bbbb"})) == [
        "default kernel-class rules (another version's) 'sha256:aaaa' vs 'sha256:bbbb'"]
    # other means of finding the steps: said, failing only under --strict
    files = [tmp_path / "base.json", tmp_path / "run.json"]
    loaded = {files[0]: ({"trace": ranges}, {}, None),
              files[1]: ({"trace": _cut("graph", "nvtx", opts)}, {}, None)}
    lax = gate_files(*files, loaded=loaded).result
    assert lax.breakdown_differences == ["steps found by step ranges vs graph launches"]
    assert lax.ok and "broken down differently" not in {c.status for c in lax.checks}
    strict = gate_files(*files, loaded=loaded, strict=True).result
    assert [c.status for c in strict.failures] == ["broken down differently"]


def test_windows_of_unequal_layers_make_every_step_check_changed():
    """Each device one step, the profiler's window (a TP job of six, no step range found):
    windows of 3 layers against windows of 2 ran other work, so every whole-step check is
    ``changed``, the layer count too (no ``differs`` that fails), and a span that moved
    within noise as well (the window's span is the window's, whatever ran); the gate
    passes."""
    base = _job_of_steps({d: [100.0 + d] for d in range(6)}, layers_a_step=3)["trace"]
    run = _job_of_steps({d: [100.0 + d] for d in range(6)}, layers_a_step=2)["trace"]
    # (the run's windows' spans: +8% at the median, yet interleaved with the baseline's
    # 300 to 315: noise, were they compared)
    for step, span in zip(run.steps, (290.0, 295.0, 330.0, 335.0, 340.0, 345.0), strict=True):
        step["span_us"] = span
    for b in (base, run):
        b.source["steps_found_by"] = "device"
    result = gate({"trace": base}, {"trace": run})
    steps = {c.metric: c for c in result.checks if c.layer_type == "step"
             and c.metric not in ("kernel_us_device", "span_us_device")}
    assert {m: c.status for m, c in steps.items()} == {
        m: "changed" for m in ("layers", "kernels", "kernels_max", "kernel_us", "span_us")}
    assert (steps["layers"].baseline, steps["layers"].current) == (3, 2)
    assert steps["span_us"].detail == ("each device is one step, the profiler's window: 3 "
                                       "layers a step in the baseline, 2 in the run")
    assert result.ok


def test_devices_take_their_layers_only_where_the_whole_takes_its_layers():
    """Four devices of five steps each, three layers a step: the whole's test takes its
    five steps a side (1/252 reaches alpha 0.01), so each device's test takes its steps too,
    and five cannot reach alpha / 4: no device checks (said), though each device's fifteen
    layers a side could: layers a step share its noise, and their p would be optimistic."""
    steady = [100.0, 101.0, 102.0, 103.0, 104.0]
    slower = [120.0, 121.0, 123.0, 124.0, 125.0]
    result = gate(_job_of_steps({d: steady for d in range(4)}, layers_a_step=3),
                  _job_of_steps({d: slower if d == 1 else steady for d in range(4)},
                                layers_a_step=3))
    assert not [c for c in result.checks if c.metric in ("span_us_device", "kernel_us_device")]
    assert result.devices_untimed == {"trace kda": 4, "trace step": 4}


def test_a_path_the_run_lacks_stays_missing_where_the_run_s_model_lacks_its_type(tmp_path):
    """A run of a model of 2 layers (no KDA layer) that lost the specialized path: a layer
    type the shallower model lacks is ``changed`` only on a path both sides hold; the lost
    path's kda checks stay missing, and fail."""
    doc = json.loads(BASELINE.read_text())
    del doc["paths"]["specialized"]
    doc["run"]["paths"].pop("specialized", None)
    doc["run"]["n_layers"] = 2
    alone = tmp_path / "two_standard_only.json"
    alone.write_text(json.dumps(doc))
    result = gate_files(BASELINE, alone, Tolerances(metrics="kernels")).result
    lost = [c for c in result.checks if c.path == "specialized" and c.layer_type == "kda"]
    assert lost and {c.status for c in lost} == {"missing"} and not result.ok


def _typed_job(types_of: dict[int, str], devices: int = 4, steps: int = 6) -> Breakdown:
    """A job of ``devices`` devices, ``steps`` steps each, whose steps hold the layers
    ``types_of`` types on device 1 and ``AAB`` on the others, types A and B found by the
    kernel pattern (their digests)."""
    layers, rows = [], []
    for d in range(devices):
        kinds = types_of.get(d, "AAB")
        for s in range(steps):
            layers += [{"type": t, "step": s, "device": d, "index": i, "kernels": 9,
                        "kernel_us": 100.0 + s, "span_us": 101.0 + s}
                       for i, t in enumerate(kinds)]
            rows.append({"index": s, "device": d, "layers": len(kinds), "kernels": 9 * len(kinds),
                         "kernel_us": 300.0 + s, "span_us": 303.0 + s})
    return Breakdown(source={}, steps=rows, layers=layers,
                     layer_types=[{"type": "A", "pattern": "a"}, {"type": "B", "pattern": "b"}])


def test_a_device_whose_layers_the_pattern_typed_otherwise_is_no_other_work():
    """One rank of four whose steps the kernel pattern typed ABB where the baseline's were
    AAB: as many layers a step on that device, typed otherwise, is no layer count that
    differs (each type's median over every device's steps is unchanged)."""
    result = gate({"trace": _typed_job({})}, {"trace": _typed_job({1: "ABB"})})
    layers = {c.layer_type: c for c in result.checks if c.metric == "layers"}
    assert {t: c.status for t, c in layers.items()} == {"A": "ok", "B": "ok", "step": "ok"}
    assert layers["A"].device is None and result.ok


def test_a_device_s_layers_a_step_are_its_median_step_s():
    """A device's layers a step are its median step's: one of its six steps that ended
    with the profiler's window holding 2 of 3 is no layer lost; two of three rows of that
    step less leave every median as it was, and the gate passes."""
    base = _job_of_steps({d: [100.0 + s for s in range(6)] for d in range(2)}, layers_a_step=3)
    run = copy.deepcopy(base)
    cut = run["trace"]
    cut.layers = [r for r in cut.layers if (r["device"], r["step"], r["index"]) != (1, 5, 2)]
    next(s for s in cut.steps if (s["device"], s["index"]) == (1, 5))["layers"] = 2
    result = gate(base, run)
    layers = {c.layer_type: c for c in result.checks if c.metric == "layers"}
    assert {t: (c.baseline, c.current, c.status) for t, c in layers.items()} == {
        "kda": (3, 3, "ok"), "step": (3, 3, "ok")}
    assert result.ok


def test_no_layer_count_where_the_steps_do_not_say_theirs():
    """Steps that do not say how many layers they hold (a breakdown of an older kimi-perf):
    a layer type the run lacks has its kernels and times missing, and no count a step of
    its own, missing or new, made up of steps that say nothing."""
    base = _job_of_steps({d: [100.0 + s for s in range(6)] for d in range(2)})
    run = copy.deepcopy(base)
    for r in run["trace"].layers:
        r["type"] = "mla"
    run["trace"].layer_types = [{"type": "mla"}]
    for b in (base, run):
        for s in b["trace"].steps:
            del s["layers"]
    result = gate(base, run)
    assert "layers" not in {c.metric for c in result.checks}
    assert {c.metric for c in result.checks if c.layer_type == "kda"} >= {"kernels", "kernel_us"}
    assert {c.status for c in result.checks if c.layer_type == "kda"} == {"missing"}


def test_classes_of_another_version_s_default_rules_are_changed_and_one_class_has_alpha():
    """Kernel classes from another version's default rules (``default_rules``, the same
    --rules on both sides) hold other kernels too: a class's checks are changed, not a
    regression. A type of one class tests it at --alpha itself: no α of its own (JSON
    ``alpha`` null, as for every check tested at --alpha)."""
    base, run = _with_classes(20.0, 60.0), _with_classes(40.0, 40.0)
    for b, defaults in ((base, "sha256:aaaa"), (run, "sha256:bbbb")):
        b["specialized"].source["breakdown_options"] = {"rules": "default",
                                                        "default_rules": defaults}
    attention = next(c for c in gate(base, run).checks if c.kernel_class == "attention")
    assert attention.status == "changed" and "other kernel-class rules" in attention.detail
    one = [_with_classes(us, 0.0) for us in (20.0, 40.0)]
    for b in one:
        for r in b["specialized"].layers:
            r["classes"] = {"attention": r["classes"]["attention"]}
    (alone,) = [c for c in gate(*one).checks if c.metric == "class_us"]
    assert alone.kernel_class == "attention" and alone.alpha is None


def test_no_layer_check_where_one_layer_s_steps_are_too_few():
    """Layers by index of 12 a step over 10 steps, but layer 11 held in 3 steps alone, and
    twice as slow there: the layer that rose most has too few steps for the test at alpha
    over the layers, so there is no such check (the largest of many noisy ratios, decided
    by the thresholds alone, would pass for a regression), and the gate passes."""
    base, run = _layers_noisy(0), _layers_noisy(1, slow={11: 2.0})
    for b in (base, run):
        kept = b["specialized"].layers = [r for r in b["specialized"].layers
                                          if r["index"] != 11 or r["step"] < 3]
        for row in b["specialized"].steps:   # (each step its layers', as kept)
            row["kernel_us"] = sum(r["kernel_us"] for r in kept if r["step"] == row["index"])
            row["span_us"] = row["kernel_us"] + 12
    result = gate(base, run)
    assert not [c for c in result.checks if c.metric == "layer_kernel_us"]
    assert result.ok


def test_devices_pair_by_rank_where_as_many_else_by_id():
    """Four devices against four on GPUs 2 to 5 (some of them the baseline's): as many on
    both sides, paired by rank (their order), none lost; three of four, device 1's layers
    lost: paired by id, device 1 missing (not device 3, which the order would leave
    over)."""
    steps = [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    base = _job_of_steps({d: steps for d in range(4)})
    moved = gate(base, _job_of_steps({d: steps for d in range(2, 6)}))
    shown = [c for c in moved.checks if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert [c.status for c in shown] == ["ok"]
    assert sorted((o.baseline_device, o.device) for c in shown for o in (c, *c.others)) == [
        (0, 2), (1, 3), (2, 4), (3, 5)]
    assert moved.ok
    lost = gate(base, _job_of_steps({d: steps for d in (0, 2, 3)}))
    devices = [(c.status, c.baseline_device, c.device) for c in lost.checks
               if (c.layer_type, c.metric) == ("kda", "span_us_device")]
    assert devices[0] == ("missing", 1, None) and len(devices) == 2
    assert sorted((o.baseline_device, o.device) for c in lost.checks
                  if (c.layer_type, c.metric) == ("kda", "span_us_device") and c.status != "missing"
                  for o in (c, *c.others)) == [(0, 0), (2, 2), (3, 3)]


def test_no_device_times_where_one_device_s_steps_are_too_few():
    """Two devices, the second in three of the six steps alone, 15% slower there: device 0's
    six steps a side could be tested at alpha / 2, device 1's three cannot, so neither
    device's times are checked (said), as a ratio no test decides would pass for a
    regression; the pooled figures, within the tolerance, pass."""
    steady = [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    result = gate(_job_of_steps({0: steady, 1: steady[:3]}),
                  _job_of_steps({0: steady, 1: [115.0, 116.0, 117.0]}))
    assert not [c for c in result.checks if c.metric in ("span_us_device", "kernel_us_device")
                and c.status != "missing"]
    assert result.devices_untimed == {"trace kda": 2, "trace step": 2}
    assert result.ok


def test_a_device_that_regressed_is_shown_before_a_new_one_and_a_new_one_before_a_faster():
    """A job of two devices against one of three (a device new): the type's device checks
    show the one that regressed, not the new one, so that the gate fails on it (the others
    stand behind it, and pass nothing of their own); where the device that moved improved,
    the new device is shown, said new."""
    steady = [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    base = _job_of_steps({0: steady, 1: steady})
    for factor, status in ((1.2, "regression"), (0.8, "new")):
        run = _job_of_steps({0: steady, 1: [v * factor for v in steady], 2: steady})
        result = gate(base, run)
        (shown,) = [c for c in result.checks if (c.layer_type, c.metric) == ("kda",
                                                                             "span_us_device")]
        assert shown.status == status and shown.device == (1 if status == "regression" else 2)
        assert sorted(o.status for o in shown.others) == (
            ["new", "ok"] if status == "regression" else ["improvement", "ok"])
        assert result.ok == (status != "regression")


def test_a_device_that_rose_from_nothing_is_shown_as_the_largest_rise():
    """Two devices that regressed, one from 0 µs (a ratio of no number: its change None)
    and one by 20%: the row shows the one that rose from nothing, as the largest rise."""
    from kimi_perf.gate import Check, _shown_device

    group = []
    for device, (before, after) in enumerate(((100.0, 120.0), (0.0, 30.0))):
        check = Check("standard", "kda", "span_us_device", before, after,
                      after / before - 1 if before else None, 0.001, "regression")
        check.device = check.baseline_device = device
        group.append(check)
    shown = _shown_device(group, [(0, 0), (1, 1)])
    assert shown.device == 1 and shown.change is None
    assert [o.device for o in shown.others] == [0]


def test_a_test_takes_two_samples_a_side_at_least():
    """``min_samples`` below 2 would test one value against another: refused, named."""
    for few in (1, 0):
        with pytest.raises(ValueError, match=r"min_samples: an integer ≥ 2"):
            Tolerances(min_samples=few)
    assert Tolerances(min_samples=2).min_samples == 2


def test_a_rise_of_exactly_the_tolerance_passes_and_a_p_of_exactly_alpha_is_noise():
    """A time fails where it rose by *more* than --rel-tol and --abs-tol and the test gives
    p *under* --alpha: a median (or the steps' mean) up by exactly 1 µs (--abs-tol), or by
    exactly 5% (--rel-tol), passes as ok, untested; five steps a side of which one of the
    baseline's is above one of the run's give an exact p of 2/252, which at alpha 2/252 is
    noise, for the medians' U test as for the means' permutation test."""
    from kimi_perf.gate import _mean_check, _time_check

    for before, after in ((10.0, 11.0), (100.0, 105.0)):
        base, cur = np.full(10, before), np.full(10, after)
        check = _time_check("standard", "step", "span_us", base, cur, Tolerances(), base, cur)
        assert (check.status, check.p_value) == ("ok", None)
        mean = _mean_check("standard", "step", base, cur, Tolerances())
        assert (mean.status, mean.p_value) == ("ok", None)
    base, cur = np.array([1.0, 2.0, 3.0, 4.0, 6.0]), np.array([5.0, 7.0, 8.0, 9.0, 10.0])
    tol = Tolerances(alpha=2 / 252)
    check = _time_check("standard", "step", "span_us", base, cur, tol, base, cur)
    assert (check.status, check.p_value) == ("noise", 2 / 252)
    mean = _mean_check("standard", "step", base + 10, cur + 10, tol)
    assert (mean.status, mean.p_value) == ("noise", 2 / 252)


def test_too_few_samples_on_either_side_leave_the_thresholds_alone():
    """Four steps in the baseline against forty in the run: the test needs ``min_samples``
    (5) on each side, so the thresholds decide alone (no p, nothing tested over), however
    many steps the run has; a step's rows (a device each) stand in for too few steps as
    steps, not layers."""
    from kimi_perf.gate import _time_check

    rng = np.random.default_rng(3)
    base, cur = 100 + rng.normal(0, 3, 4), 108 + rng.normal(0, 3, 40)
    check = _time_check("standard", "kda", "span_us", base, cur, Tolerances(), base, cur)
    assert (check.status, check.p_value, check.tested_over) == ("regression", None, None)
    # (a TP job's three steps a side: too few as steps; its twelve rows a side are tested)
    rows = [100 + rng.normal(0, 1, 12), 120 + rng.normal(0, 1, 12)]
    step = _time_check("standard", "step", "span_us", *rows, Tolerances(), rows[0][:3],
                       rows[1][:3])
    assert (step.status, step.tested_over) == ("regression", "steps") and step.p_value < 0.01


def test_a_pattern_type_s_other_count_where_the_steps_hold_other_counts_differs():
    """Types the kernel pattern found are waived (``changed``) where their counts a step
    differ while the steps hold as many layers (typed otherwise); where a step holds a layer
    more as well, the type's count differs, and fails."""
    result = gate({"trace": _typed_job({}, devices=1)},
                  {"trace": _typed_job({0: "AAAB"}, devices=1)})
    layers = {c.layer_type: c for c in result.checks if c.metric == "layers"}
    assert {t: (c.baseline, c.current, c.status) for t, c in layers.items()} == {
        "A": (2, 3, "differs"), "B": (1, 1, "ok"), "step": (3, 4, "differs")}


def test_a_plain_trace_against_a_run_s_path_is_compared_as_that_path():
    """A plain trace (keyed ``trace``) against a run of one path: the two are paired for the
    differences the gate says, as for its checks (steps of another phase, another unit)."""
    from kimi_perf.gate import phase_differences, unit_differences

    decode = _job_of_steps({0: [100.0 + s for s in range(6)]})["trace"]
    mixed = copy.deepcopy(decode)
    for b, phase in ((decode, "decode"), (mixed, "mixed")):
        for s in b.steps:
            s["phase"] = phase
    assert phase_differences({"trace": decode}, {"standard": mixed}) == ["steps decode vs mixed"]
    ops = copy.deepcopy(decode)
    ops.source["ops"] = "cpu-ops"
    assert unit_differences({"standard": ops}, {"trace": decode}) == [
        "standard: a CPU run's ops vs GPU kernels"]


def test_a_class_the_baseline_never_ran_has_no_ratio():
    """A kernel class at 0 µs in every baseline layer and 40 µs in the run's: its change is
    no number (JSON null, the table's ``-``), not 0%, and it regressed."""
    attention = next(c for c in gate(_with_classes(0.0, 60.0), _with_classes(40.0, 60.0)).checks
                     if c.kernel_class == "attention")
    assert (attention.baseline, attention.status, attention.change) == (0.0, "regression", None)


def test_a_type_whose_kernels_moved_to_another_letter_has_its_count_changed_too():
    """The kernel pattern cut the run's layers elsewhere (k3 moved from B's typical layer to
    A's: what A gained, B lost) and typed a step's layers AAAB where the baseline's were
    AAB: A's count a step is other work of the pattern's, ``changed`` like its other checks,
    not a count that ``differs``; the step, a layer more, still differs."""
    def typed(kinds: str, sequences: dict[str, list[str]], digests: dict[str, str]) -> dict:
        b = _typed_job({0: kinds}, devices=1)
        for t in b.layer_types:
            t.update(pattern=digests[t["type"]], layers=sum(
                r["type"] == t["type"] for r in b.layers), typical_layer={"layers": 1, "kernels": [
                    {"name": n, "class": "gemm", "us": 1.0} for n in sequences[t["type"]]]})
        return {"trace": b}

    base = typed("AAB", {"A": ["k0", "k1", "k2"], "B": ["k3", "k4", "k5"]}, {"A": "a", "B": "b"})
    run = typed("AAAB", {"A": ["k0", "k1", "k2", "k3"], "B": ["k4", "k5"]}, {"A": "c", "B": "d"})
    layers = {c.layer_type: c for c in gate(base, run).checks if c.metric == "layers"}
    assert {t: (c.baseline, c.current, c.status) for t, c in layers.items()} == {
        "A": (2, 3, "changed"), "B": (1, 1, "ok"), "step": (3, 4, "differs")}


def test_a_read_only_baseline_is_refused_before_the_run_is_read(tmp_path):
    """``gate --update`` refuses a read-only baseline before it reads the run (a trace's
    breakdown takes minutes, and then nowhere to store it): the error names the baseline,
    though the run given is no JSON at all."""
    kept = tmp_path / "kept.json"
    shutil.copy(BASELINE, kept)
    kept.chmod(0o444)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    result = CliRunner().invoke(main, ["gate", "--update", str(kept), str(broken)])
    assert result.exit_code == 2 and result.output == (
        f"kimi-perf: error: {kept}: cannot write: it is read-only (mode 444)\n")
    assert kept.read_text() == BASELINE.read_text()


def test_a_check_s_figures_and_changes_are_written_as_the_table_shows_them():
    """A figure of a thousand or more is whole, with thousands separated (1,000, not 1000 nor
    1e+03), a smaller one to four significant digits; a change to a tenth of a percent, a
    smaller one that is not nothing to two digits, and one below 0.001% as such, with its
    sign."""
    from kimi_perf.render import _change, _value

    assert [_value(v) for v in (None, 1000.0, 999.94, 12345.6, 0.000123456)] == [
        "-", "1,000", "999.9", "12,346", "0.0001235"]
    assert [_change(v) for v in (None, 0.0, 3e-6, -3e-6, 0.00025, -0.00025, 0.0005, -0.5)] == [
        "-", "+0.0%", "+<0.001%", "-<0.001%", "+0.025%", "-0.025%", "+0.1%", "-50.0%"]


def test_the_gate_table_says_what_each_p_was_tested_over_and_at_which_alpha(
        monkeypatch):
    """A check's p says what was tested where it was not the steps: "(runs)" against the
    baseline's spread of runs, "(layers)" where too few steps; a family's alpha after it; a
    note for each under the table; a plain ok check is left out but with show_all."""
    from kimi_perf.gate import Check, GateResult
    from kimi_perf.render import gate_table, tables_text

    checks = [Check("trace", "kda", "span_us", 100.0, 130.0, 0.3, 0.004, "regression",
                    detail="gemm +30.0 µs", tested_over="runs"),
              Check("trace", "mla", "span_us", 200.0, 230.0, 0.15, 0.02, "regression",
                    tested_over="layers", alpha=0.025),
              Check("trace", "step", "kernels", 10.0, 10.0, 0.0, None, "ok")]
    result = GateResult(checks, Tolerances(), spread_runs=3)
    monkeypatch.delenv("COLUMNS", raising=False)   # (as piped: the table boxed, whole)

    def rows(table):
        return [[c.strip() for c in line.split("│")[1:-1]]
                for line in tables_text([table]).splitlines() if line.startswith("│")]

    assert rows(gate_table(result)) == [
        ["trace", "kda", "span_us", "100", "130", "+30.0%", "0.004 (runs)", "regression",
         "gemm +30.0 µs"],
        ["trace", "mla", "span_us", "200", "230", "+15.0%", "0.02 (layers) (α 0.025)",
         "regression", ""]]
    assert gate_table(result).caption == (
        "(layers): too few steps for the test, the layers tested: an optimistic p (the layers "
        "of a step share its noise)\n(runs): the run's figure tested against the spread of "
        "the baseline's 3 runs (a t prediction interval for one run more)")
    assert rows(gate_table(result, show_all=True))[2][:8] == [
        "trace", "step", "kernels", "10", "10", "+0.0%", "-", "ok"]
