"""Breakdown figures, JSON shape, comparison, and kernel classes."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimi_perf import breakdown, compare, read_trace
from kimi_perf.classify import (
    Rule,
    classify,
    classify_name,
    default_rules,
    default_rules_said,
    layout_class_name,
    load_rules,
    rules_said,
)
from kimi_perf.errors import NoGpuWork, TraceError
from kimi_perf.layer_breakdown import (
    Breakdown,
    _union_length,
    breakdown_of_file,
    layer_column,
)
from kimi_perf.trace import Trace
from tests.conftest import KINETO, NSYS, REPO
from tests.synth import TraceBuilder
from tests.test_layers import KDA, MLA, k3_like, nvtx_decode_trace


def test_union_length_counts_overlap_once():
    start = np.array([0, 5, 20, 21, 40])
    end = np.array([10, 8, 30, 25, 41])
    assert _union_length(start, end) == 10 + 10 + 1


def test_breakdown_json_shape_and_figures():
    trace = nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=8).build()
    doc = breakdown(trace).to_json()
    assert doc["schema"] == 1
    assert set(doc) == {"schema", "source", "steps", "layers", "layer_types", "timeline"}
    assert len(doc["steps"]) == 2 and len(doc["layers"]) == 16
    layer = doc["layers"][0]
    assert set(layer) >= {"step", "index", "type", "kernels", "kernel_us", "span_us", "gap_us",
                          "classes"}
    # The synthetic kernels run 1000 ns each with 100 ns between them.
    assert layer["kernels"] == len(KDA)
    assert layer["kernel_us"] == pytest.approx(len(KDA) * 1.0)
    assert layer["span_us"] == pytest.approx(len(KDA) * 1.1 - 0.1)
    assert layer["gap_us"] == pytest.approx((len(KDA) - 1) * 0.1)
    assert sum(c["kernels"] for c in layer["classes"].values()) == layer["kernels"]
    types = {t["type"]: t for t in doc["layer_types"]}
    assert types["kda"]["layers"] == 12 and types["mla"]["layers"] == 4
    assert types["kda"]["kernels"] == len(KDA) and types["mla"]["kernels"] == len(MLA)
    assert types["mla"]["classes"]["attention"]["kernels"] == 1  # mla_decode
    # Two attention-residual mixes (they end in an RMSNorm) and three RMSNorms.
    assert types["mla"]["classes"]["norm"]["kernels"] == 5
    step = doc["steps"][0]
    assert step["layers"] == 8 and step["prologue"]["kernels"] == 1
    assert step["kernels"] == 8 * len(KDA) - 2 * len(KDA) + 2 * len(MLA) + 2


def test_a_trace_without_gpu_work_is_an_error_saying_what_it_holds(tmp_path):
    """No kernel, memcpy/memset or op: range: nothing to break down (a profile that recorded
    no GPU activity), said with what the trace does hold, not an empty table that passes for
    a result. Work without a time counts as none, and is named."""
    b = TraceBuilder()
    b.range("decode_step[0]", 0, 500)
    b.call("cudaLaunchKernel", 10, 20)
    trace = b.build()
    with pytest.raises(NoGpuWork, match=r"no GPU work in this trace: .* \(it holds 1 range, "
                       r"1 API call\)$"):
        breakdown(trace)
    trace.meta["untimed"] = {"kernels": 2, "memops": 1}
    with pytest.raises(NoGpuWork, match=r"\(it holds 3 GPU ops without a time, 1 range"):
        breakdown(trace)
    # A decode run on a CPU has no GPU work but its op: ranges: those are broken down.
    b.range("op:rms_norm", 100, 200)
    assert breakdown(b.build()).source["ops"] == "cpu-ops"
    path = tmp_path / "nothing.json"
    path.write_text('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", '
                    '"pid": 1, "tid": 1, "ts": 1, "dur": 2}]}')
    with pytest.raises(NoGpuWork, match=r"\(it holds 1 range\)$") as raised:
        breakdown_of_file(path)
    assert raised.value.path == str(path)


def test_compare_matches_types_and_computes_ratios():
    a = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=1).build())
    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=1).build())
    for layer in b.layers:  # pretend B halves every layer's time
        layer["span_us"] /= 2
    b.layer_types[0]["span_us"] /= 2
    rows = {r.type: r for r in compare(a, b)}
    assert rows["kda"].span_ratio == pytest.approx(2.0, rel=1e-3)
    assert rows["kda"].kernel_ratio == 1.0
    assert rows["mla"].span_ratio == pytest.approx(1.0)
    assert rows["all layers (mean)"].layers_a == 8


def test_compare_adds_whole_steps_and_no_mean_layer_of_other_cuts():
    """Steps cut into 8 layers on one side (ranges) and 4 (each two of the other's, by the
    kernel pattern, as a graph's may be) on the other: the mean layer is another unit on each
    side, so its row has no ratios and no headline; the whole step's row compares them as
    they are. Ratios keep four significant digits (a CPU run's interpreted path: 0.002674,
    not 0.003)."""
    from kimi_perf.comparison import ALL_LAYERS, WHOLE_STEP, ratio_note, sides_notes
    from kimi_perf.render import comparison_headline

    a = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=3).build())
    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=3).build())
    for step in b.steps:
        step["layers"], step["layer_source"] = 4, "repeat"
    rows = {r.type: r for r in compare(a, b)}
    assert rows[ALL_LAYERS].span_ratio is None and rows[ALL_LAYERS].kernel_ratio is None
    step = rows[WHOLE_STEP]
    assert (step.steps_a, step.span_ratio, step.kernel_ratio) == (3, 1.0, 1.0)
    assert (step.layers_a, step.layers_b) == (8, 4)     # the median step's layers
    # shown as such beside the types' rows, which count the layers of all the steps
    assert (step.layers_text("a"), rows["kda"].layers_text("a")) == ("8 a step", "18")
    assert step.to_json()["a"]["steps"] == 3 and not rows[ALL_LAYERS].to_json()["same_layers"]
    assert step.span_us_a == pytest.approx(float(np.median([s["span_us"] for s in a.steps])))
    headline = comparison_headline(list(rows.values()), "A", "B")
    assert ALL_LAYERS not in headline and WHOLE_STEP in headline
    same = {r.type: r for r in compare(a, a)}
    assert same[ALL_LAYERS].span_ratio == 1.0
    # the median step, not the mean: one slow step of three moves the mean alone
    slow = copy.deepcopy(a)
    for s, span in zip(slow.steps, (100.0, 100.0, 400.0), strict=True):
        s["span_us"] = span
    assert {r.type: r for r in compare(slow, a)}[WHOLE_STEP].span_us_a == 100.0
    # every layer a range on both sides, 8 a step against 4: models of other depths, whose
    # steps ran other work (a run of 4 layers is no 2x leaner than one of 8)
    for step in b.steps:
        step["layer_source"] = "nvtx"
    deeper = compare(a, b)
    step = next(r for r in deeper if r.type == WHOLE_STEP)
    assert step.span_ratio is None and step.kernel_ratio is None
    assert step.to_json()["same_layers"] is False
    assert "whole step: no ratio, as the steps hold 8 and 4 layers: other work (models of " \
        "other depths" in ratio_note(deeper, "A", "B")
    for layer in b.layers:
        layer["span_us"] *= 373.94
    b.layer_types[0]["span_us"] *= 373.94
    assert {r.type: r for r in compare(a, b)}["kda"].span_ratio == pytest.approx(1 / 373.94,
                                                                              rel=1e-3)
    assert len(str({r.type: r for r in compare(a, b)}["kda"].span_ratio)) >= 7   # 0.002674
    # sides of other GPUs are said; so is a CPU run's
    a.source["gpus_ran"] = [{"device": 0, "name": "NVIDIA A100", "sm_count": 108}]
    b.source["gpus_ran"] = [{"device": 0, "name": "AMD MI300X", "sm_count": 304}]
    assert sides_notes(a, b, "A", "B") == [
        "A ran on 1 × NVIDIA A100 (108 SMs), B on 1 × AMD MI300X (304 SMs): their µs differ "
        "for that alone"]
    b.source["tool"] = "PyTorch profiler (Kineto, ROCm)"   # an AMD GPU's are compute units
    assert sides_notes(a, b, "A", "B")[0].startswith(
        "A ran on 1 × NVIDIA A100 (108 SMs), B on 1 × AMD MI300X (304 CUs)")
    # the same GPUs, one side's tool said otherwise (stored before ROCm was told): alike
    a.source["gpus_ran"] = b.source["gpus_ran"]
    assert sides_notes(a, b, "A", "B") == []
    assert sides_notes(a, a, "A", "A'") == []


def _layer_type(name: str, digest: str, kernels: list[tuple[str, str]]) -> dict:
    classes = Counter(cls for _, cls in kernels)
    return {"type": name, "pattern": digest,
            "classes": {c: {"kernels": n, "us": float(n)} for c, n in classes.items()},
            "typical_layer": {"kernels": [{"name": k, "class": c, "us": 1.0}
                                          for k, c in kernels]}}


def test_pattern_types_of_one_class_mix_pair_by_the_kernels_they_share():
    """Sliding-window and full-attention layers, unfused and fused, the fused trace meeting
    the full-attention layer first: by class mix alone the two pairings tie exactly, and
    order would pair sliding with full. The kernel names each fused layer kept from its
    unfused form (its attention kernels) pair them right, whichever comes first."""
    from kimi_perf.comparison import pair_types

    tail = [("o_proj_gemm", "gemm"), ("rms_norm_kernel", "norm"), ("router_gemm", "router")]
    unfused = [("rms_norm_kernel", "norm"), ("qkv_gemm_kernel", "gemm"),
               ("rotary_embedding_kernel", "rope")]
    moe = [("topk_softmax", "router"), ("fused_moe_gemm1", "moe"),
           ("silu_and_mul", "elementwise"), ("fused_moe_gemm2", "moe")]
    sliding = [("flash_attn_sliding", "attention")]
    full = [("flash_attn_full_split", "attention"), ("flash_attn_reduce", "attention")]
    standard = [_layer_type("A", "s1", unfused + sliding + tail + moe),
                _layer_type("B", "s2", unfused + full + tail + moe)]
    fused_head, fused_moe = [("fused_rms_qkv_rope_gemm", "rope")], [("fused_moe", "moe")]
    fused = [_layer_type("A", "f1", fused_head + full + tail + fused_moe),
             _layer_type("B", "f2", fused_head + sliding + tail + fused_moe)]
    assert pair_types(standard, fused) == [(0, 1), (1, 0)]
    assert pair_types(standard, fused[::-1]) == [(0, 0), (1, 1)]


def test_one_odd_rank_is_still_a_straggler():
    """Steps of other numbers of layers, found by the kernel pattern, compare where a layer
    type runs the same kernels in two traces at least (a TP run's ranks, one cut otherwise,
    and slow: named); not where no type does (other models: no step spread)."""
    from kimi_perf.comparison import OverviewRow, spreads, steps_unlike, stragglers

    def ranks(digest_of) -> list[OverviewRow]:
        return [OverviewRow(f"rank{i}", 10, 5000.0 * (1.5 if i == 7 else 1), {"A": (12, 100.0)},
                            {"A": digest_of(i)}, layers=48.0 if i == 7 else 24.0)
                for i in range(8)]

    one_odd = ranks(lambda i: "odd" if i == 7 else "same")
    assert not steps_unlike(one_odd)
    assert stragglers(spreads(one_odd)) == {"rank7": ["step"]}
    all_unlike = ranks(lambda i: f"model{i}")
    assert steps_unlike(all_unlike) and spreads(all_unlike) == []


def test_layers_of_one_name_running_other_kernels_have_no_spread():
    """Two ranks of each of the two decode paths in one overview: their kda layers, named by
    ranges alike, run 21 ops against 11: other work under one name, marked and given no
    spread (it read "slowest / fastest 94.76x", the specialized path's rank 1 the
    straggler); nor are their whole steps spread."""
    from kimi_perf.comparison import (
        OverviewRow,
        counts_differ,
        differing_note,
        spreads,
        steps_unlike,
    )

    rows = [OverviewRow(f"{path}.rank{r}", 3, step * (1 + r / 100), {"kda": (ops, us)},
                        {"kda": None}, unit="ops", layers=8.0)
            for path, step, ops, us in (("standard", 54519.9, 21, 7033.6),
                                        ("specialized", 4784088.3, 11, 657659.2))
            for r in (0, 1)]
    assert counts_differ(rows) == ["kda"] and steps_unlike(rows) and spreads(rows) == []
    assert differing_note(rows) == (
        "* kda: named alike by ranges, whose layers run other numbers of ops in some "
        "traces: other work under one name (no spread)")
    same = rows[:2]   # one path's ranks: alike, spread
    assert counts_differ(same) == [] and differing_note(same) is None
    assert {s.type for s in spreads(same)} == {None, "kda"}
    # ranks of one run whose medians differ by a kernel or a half: still alike
    same[1].types["kda"] = (22.5, 7040.0)
    assert counts_differ(same) == [] and {s.type for s in spreads(same)} == {None, "kda"}
    # two decode paths' dense layers, 11 ops against 9: other work (its spread read 56x)
    same[0].types["kda"], same[1].types["kda"] = (11, 4324.0), (9, 241485.8)
    assert counts_differ(same) == ["kda"] and spreads(same) == []
    assert "whose layers run other numbers of ops" in differing_note(same)
    # 7 against 6: past the ratio, but one kernel: alike (an NCCL kernel more, say)
    same[0].types["kda"], same[1].types["kda"] = (7, 4324.0), (6, 4330.0)
    assert counts_differ(same) == [] and "kda" in {s.type for s in spreads(same)}


def test_overview_of_several_traces_names_the_slowest():
    """A TP run's ranks in one table: per layer type the median span of each, and the
    slowest over the fastest (here rank 1's MLA layers take 1.5 times as long)."""
    from kimi_perf.comparison import (
        differing_patterns,
        overview,
        overview_notes,
        spreads,
        stragglers,
    )

    ranks = {}
    for rank, mla_scale in ((0, 1.0), (1, 1.5), (2, 1.0)):
        b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=3).build())
        for t in b.layer_types:
            if t["type"] == "mla":
                t["span_us"] *= mla_scale
        # (and its layers' spans, that the spread's test reads)
        b.layers.span_us[b.layers.type_code == b.layers.types.index("mla")] *= mla_scale
        for step in b.steps:
            step["span_us"] += rank
        ranks[f"rank{rank}"] = b
    rows = overview(ranks)
    assert [r.label for r in rows] == ["rank0", "rank1", "rank2"]
    assert list(rows[0].types) == ["kda", "mla"] and rows[0].steps == 3
    assert rows[1].types["mla"][1] == pytest.approx(1.5 * rows[0].types["mla"][1])
    assert rows[2].step_us == pytest.approx(rows[0].step_us + 2)
    spread = {s.type: s for s in spreads(rows)}
    assert spread["mla"].slowest_label == "rank1" and spread["mla"].ratio == 1.5
    assert spread["kda"].ratio == 1.0 and spread["kda"].slowest_label is None  # all equal
    assert spread[None].slowest_label == "rank2"
    assert stragglers(list(spread.values())) == {"rank2": ["step"], "rank1": ["mla"]}
    # the line under the table gives each the p of its test, or says none could be made
    assert spread["mla"].tested_over == "layers" and spread[None].p_value is None
    p = f"{spread['mla'].p_value:.2g}"
    assert overview_notes(rows, list(spread.values()))[:2] == [
        "slowest: rank2 (step by the ratio alone: too few spans to test)",
        f"slowest: rank1 (mla p {p} over layers)"]
    assert differing_patterns(rows) == []
    for rank, digest in ((0, "a1"), (1, "b2"), (2, "a1")):  # as if found by the pattern
        ranks[f"rank{rank}"].layer_types[0]["pattern"] = digest
    assert differing_patterns(overview(ranks)) == ["kda"]
    # no spread between a CPU run and GPU traces
    ranks["rank1"].source["ops"] = "cpu-ops"
    assert spreads(overview(ranks)) == []
    from kimi_perf.render import overview_table, tables_text

    assert "no spread between CPU runs and GPU traces" in " ".join(
        tables_text([overview_table(overview(ranks))]).split())
    ranks["rank1"].source["ops"] = "gpu"
    # a trace without a type is left out of that type's spread
    del ranks["rank1"].layer_types[1]
    rows = overview(ranks)
    assert rows[1].types["mla"] is None
    assert {s.type: s for s in spreads(rows)}["mla"].slowest_label != "rank1"
    # steps of other numbers of layers (another model's trace among them) have no spread of
    # whole steps, and the table says why; the layer types keep theirs
    for step in ranks["rank2"].steps:
        step["layers"] = 24
    rows = overview(ranks)
    assert [s.type for s in spreads(rows)] == ["mla"]   # (kda: patterns differ, above)
    from kimi_perf.comparison import STEPS_UNLIKE, overview_json

    assert STEPS_UNLIKE in " ".join(tables_text([overview_table(rows)]).split())
    assert all(round(r["step_us"], 3) == r["step_us"] for r in overview_json(rows)["rows"])
    # as compare has it: layers the kernel pattern found on one side may be cut otherwise (a
    # graph's pattern taking two eager layers as one), and those steps keep their spread
    for step in ranks["rank2"].steps:
        step["layer_source"] = "repeat"
    assert [s.type for s in spreads(overview(ranks))] == [None, "mla"]
    assert compare(ranks["rank0"], ranks["rank2"])[-1].same_layers


def test_overview_columns_say_what_each_trace_calls_their_types(tmp_path):
    """Three traces of the Wan2.1 fixtures: the inference trace's types pair with the
    training traces' under other letters, and its unpaired B takes a primed column; the
    table says which is which."""
    from kimi_perf.comparison import overview, renamed_columns
    from kimi_perf.render import overview_table, tables_text

    names = ("train_2xh100_before", "train_2xh100_after", "t2v_inference_2xh100_1s")
    rows = overview({n: breakdown(read_trace(NSYS / f"nsysai_fastvideo_wan2.1_{n}.sqlite"))
                     for n in names})
    # each trace's two devices a row (torchrun's two ranks in one file)
    assert [r.label for r in rows] == [f"{n} device {d}" for n in names for d in (0, 1)]
    assert [(r.trace, r.device) for r in rows] == [(n, d) for n in names for d in (0, 1)]
    assert list(rows[0].types) == ["A", "B", "C", "B'"]
    assert [rows[4].names[c] for c in rows[0].types] == ["A", "C", "D", "B"]
    note = renamed_columns(rows, most=6)
    assert note == ("columns name a type as the first trace that has it does: B is C in "
                    "t2v_inference_2xh100_1s; C is D in t2v_inference_2xh100_1s; B' is B in "
                    "t2v_inference_2xh100_1s")
    assert note in " ".join(tables_text([overview_table(rows)]).split())
    assert renamed_columns(rows, most=2).endswith("; …")
    from kimi_perf.report import write_report

    report = write_report(   # the report names them all
        tmp_path / "r.html", {n: breakdown(read_trace(
        NSYS / f"nsysai_fastvideo_wan2.1_{n}.sqlite")) for n in names}, "t",
        plotly_js="cdn").read_text()
    assert "<p>Columns name a type as the first trace that has it does: B is C in " in report
    assert "B&#x27; is B in t2v_inference_2xh100_1s.</p>" in report


# what the table of two_device_trace's devices says under it (three steps a side: too few
# to test)
DEVICE_1_SLOWEST = "slowest: device 1 (step, mla by the ratio alone: too few spans to test)"


def two_device_trace(slow_mla: float = 2.0, layers: tuple[int, int] = (4, 4),
                     scale=lambda device, step, layer: 1.0, steps: int = 3) -> Trace:
    """Two ranks of a TP job in one file (as ``nsys profile torchrun`` writes it): process 1
    on device 0, process 2 on device 1, each ``steps`` decode steps of ``layers`` layers with
    ranges; device 1 runs its MLA kernels ``slow_mla`` times as long; each layer's kernels
    ``scale`` times as long too (by device, step and layer)."""
    b = TraceBuilder()
    for device, pid in ((0, 1), (1, 2)):
        for s in range(steps):
            step_start = b.clock
            for i, kernels in enumerate(k3_like(layers[device])):
                kind = "mla" if "mla_decode" in kernels else "kda"
                first = b.clock
                for name in kernels:
                    us = 1000 * (slow_mla if device == 1 and kind == "mla" else 1) * scale(
                        device, s, i)
                    t = b.clock
                    b.launch(name, t, t + 50, t + 200, t + 200 + int(us), pid=pid, tid=pid,
                             device=device)
                    b.clock += int(us) + 100
                b.range(f"layer[{i}]({kind})", first - 10, b.clock, pid=pid, tid=pid)
            b.range(f"decode_step[{s}]", step_start - 20, b.clock, pid=pid, tid=pid)
            b.clock += 5000
    return b.build()


def test_breakdown_json_of_a_tp_job_holds_its_devices(tmp_path):
    """``breakdown --format json`` of one file of a two-rank job holds the table of every
    device (which rank is slowest) beside the pooled figures, as the table format shows it;
    the file still reads back as a breakdown (the gate's baseline); one device: no key."""
    from click.testing import CliRunner

    from kimi_perf.cli import main
    from kimi_perf.layer_breakdown import Breakdown

    job = tmp_path / "job.kptrace"
    two_device_trace(slow_mla=2.0).save(job)
    out = CliRunner().invoke(main, ["breakdown", str(job), "--format", "json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert [r["label"] for r in doc["devices"]["rows"]] == ["device 0", "device 1"]
    assert [s["slowest"] for s in doc["devices"]["spreads"]][:1] == ["device 1"]
    assert len(Breakdown.from_json(doc).steps) == 6
    single = tmp_path / "one.kptrace"
    nvtx_decode_trace("layer[{i}]({kind})").build().save(single)
    assert "devices" not in json.loads(CliRunner().invoke(
        main, ["breakdown", str(single), "--format", "json"]).output)


def test_compare_counts_a_tp_jobs_steps_a_device_each():
    """A two-rank job's three steps against one rank's: the whole step's medians are over
    each device's steps (six against three), said as 3 steps × 2 devices, not 6 steps."""
    from kimi_perf.comparison import WHOLE_STEP, ratio_note

    job = breakdown(two_device_trace(slow_mla=1.0))
    rank = copy.deepcopy(job)
    rank.steps = [s for s in rank.steps if s["device"] == 0]
    rank.layers = [r for r in rank.layers if r["device"] == 0]
    rows = compare(job, rank)
    step = next(r for r in rows if r.type == WHOLE_STEP)
    assert (step.steps_a, step.step_devices_a, step.steps_b, step.step_devices_b) == (6, 2, 3, 1)
    assert "the median step (of 3 steps × 2 devices and of 3 steps)" in ratio_note(rows, "A", "B")
    assert (step.to_json()["a"]["step_devices"], "step_devices" in step.to_json()["b"]) == (
        2, False)
    assert "(of" not in ratio_note(compare(job, job), "A", "B")
    # a window cut short on one rank (3 steps and 1): not "2 steps × 2 devices"
    short = copy.deepcopy(job)
    short.steps = [s for s in short.steps if s["device"] == 0 or s["index"] == 0]
    assert "(of 4 steps of 2 devices and of 3 steps)" in ratio_note(compare(short, rank), "A",
                                                                    "B")
    # steps that do not all say their device: counted as steps
    unsaid = copy.deepcopy(job)
    unsaid.steps.append({k: v for k, v in unsaid.steps[0].items() if k != "device"})
    assert "(of 7 and of 3 steps)" in ratio_note(compare(unsaid, rank), "A", "B")


def test_a_trace_of_two_devices_is_a_row_per_device():
    """One file of a two-rank job whose rank 1 runs its MLA layers twice as long: its
    medians over both devices mix the ranks (a 1.5x MLA, no straggler); a row per device
    names device 1 the slowest in mla and the step, the figures those of each device's own
    layers; the terminal's tables, the report and the run's JSON show it."""
    from kimi_perf.comparison import device_figures, overview, overview_json, spreads
    from kimi_perf.render import breakdown_tables, overview_table, tables_text

    b = breakdown(two_device_trace())
    assert sorted({s["device"] for s in b.steps}) == [0, 1] and len(b.steps) == 6
    figures = device_figures(b)
    assert list(figures) == [0, 1]
    for device, (steps, per_type) in figures.items():
        assert [s["device"] for s in steps] == [device] * 3
        for t in ("kda", "mla"):   # each device's own layers' medians, from the rows
            mine = [r for r in b.layers if r["device"] == device and r["type"] == t]
            assert per_type[t] == (pytest.approx(np.median([r["kernels"] for r in mine])),
                                   pytest.approx(np.median([r["span_us"] for r in mine])))
    mla_ratio = figures[1][1]["mla"][1] / figures[0][1]["mla"][1]   # (the gaps not doubled)
    assert mla_ratio == pytest.approx(2.0, rel=0.06)
    whole = next(t for t in b.layer_types if t["type"] == "mla")   # the ranks mixed
    assert whole["span_us"] == pytest.approx((figures[0][1]["mla"][1]
                                              + figures[1][1]["mla"][1]) / 2)
    rows = overview({"job": b})
    assert [(r.label, r.trace, r.device, r.steps) for r in rows] == [
        ("device 0", "job", 0, 3), ("device 1", "job", 1, 3)]
    spread = {s.type: s for s in spreads(rows)}
    assert spread["mla"].slowest_label == "device 1"
    assert spread["mla"].ratio == pytest.approx(mla_ratio, abs=0.001)
    assert spread[None].slowest_label == "device 1" and spread["kda"].ratio == 1.0
    assert device_figures(breakdown(nvtx_decode_trace("layer[{i}]({kind})").build())) == {}
    text = " ".join(tables_text(breakdown_tables(b)).split())
    assert "Every device (medians; µs = span, layer kernels in brackets)" in text
    assert DEVICE_1_SLOWEST in text
    json_rows = overview_json(rows)["rows"]
    assert [(r["label"], r["trace"], r["device"]) for r in json_rows] == [
        ("device 0", "job", 0), ("device 1", "job", 1)]
    # read back from JSON (layers a list of dicts): the same rows
    again = Breakdown.from_json(json.loads(json.dumps(b.to_json())))
    assert overview({"job": again}) == rows
    # a device that ran no layer (a peer copy's, a stray kernel) is no rank: no row of its own
    stray = nvtx_decode_trace("layer[{i}]({kind})")
    stray.launch("peer_copy_kernel", 10, 20, 30, 40, device=1)
    lone = breakdown(stray.build())
    assert {s["device"] for s in lone.steps} == {0, 1} and device_figures(lone) == {}
    assert [r.device for r in overview({"one": lone, "two": lone, "three": lone})] == [None] * 3
    # one trace's devices whose steps hold other layers: said of devices, not of traces
    from kimi_perf.comparison import DEVICE_STEPS_UNLIKE

    uneven = overview({"job": breakdown(two_device_trace(layers=(4, 8)))})
    assert [r.layers for r in uneven] == [4, 8] and None not in {s.type for s in spreads(uneven)}
    assert DEVICE_STEPS_UNLIKE in " ".join(tables_text([overview_table(uneven)]).split())
    # several traces: a row per device of the one that has several
    others = overview({"one": breakdown(nvtx_decode_trace("layer[{i}]({kind})").build()),
                       "job": b, "two": breakdown(nvtx_decode_trace("layer[{i}]({kind})")
                                                  .build())})
    assert [r.label for r in others] == ["one", "job device 0", "job device 1", "two"]
    assert [r.device for r in others] == [None, 0, 1, None]


def test_a_slowest_within_noise_is_not_named(tmp_path):
    """Two ranks whose layers' spans spread ±20% and one runs 2% longer: its KDA and MLA
    medians 1.02× (it named it the slowest on noise); a one-sided U test of its layers'
    spans against the fastest's (three steps too few to test) says noise, p 0.07 and 0.2
    at α 0.005 (0.01 over the two ordered pairs): no slowest, said with its p in the table,
    the report and JSON. Its three steps, too few to test, are named as before, and 30%
    longer layers are named beyond noise."""
    from html import escape as html_escape

    from kimi_perf.capture import analyse
    from kimi_perf.comparison import STRAGGLER_ALPHA, overview, overview_json, spreads
    from kimi_perf.render import overview_table, tables_text

    levels = [0.8, 0.9, 1.0, 1.1, 1.2]

    def job(slower: float) -> Trace:
        return two_device_trace(1.0, (16, 16), lambda device, step, layer: levels[
            (step * 16 + layer) % 5] * (slower if device else 1))

    rows = overview({"job": breakdown(job(1.02))})
    assert [tuple(a.size for a in r.samples["kda"]) for r in rows] == [(3, 36), (3, 36)]
    spread = {s.type: s for s in spreads(rows)}
    assert [(t, f"{spread[t].ratio:.2f}", spread[t].slowest_label, spread[t].tested_over)
            for t in spread] == [(None, "1.02", "device 1", None),
                                 ("kda", "1.02", None, "layers"), ("mla", "1.02", None, "layers")]
    assert spread[None].p_value is None   # (3 steps against 3: no test reaches α)
    assert spread["kda"].p_value == pytest.approx(0.0698, abs=1e-4) and spread["kda"].noise
    assert spread["mla"].p_value == pytest.approx(0.199, abs=1e-3)
    said = (f"no slowest named where its spans are within noise of the fastest's (one-sided U "
            f"test, α {STRAGGLER_ALPHA} shared among the ordered pairs of rows): kda 1.02× (p "
            "0.07 "
            "over layers), mla 1.02× (p 0.2 over layers)")
    text = " ".join(tables_text([overview_table(rows)]).split())
    assert "slowest: device 1 (step by the ratio alone: too few spans to test)" in text
    assert said in text
    assert [(s["type"], s["slowest"], s["alpha"], s["tested_over"])
            for s in overview_json(rows)["spreads"]] == [
        (None, "device 1", None, None), ("kda", None, 0.005, "layers"),
        ("mla", None, 0.005, "layers")]
    trace_file = tmp_path / "job.kptrace"
    job(1.02).save(trace_file)
    run_dir, _, run_info = analyse([trace_file], tmp_path / "runs", plotly_js="cdn")
    html = (run_dir / run_info["report"]).read_text()
    assert f"<p>{html_escape(said[0].upper() + said[1:])}.</p>" in html
    # 30% longer: beyond noise, named
    slow = {s.type: s for s in spreads(overview({"job": breakdown(job(1.3))}))}
    assert [slow[t].slowest_label for t in slow] == ["device 1"] * 3
    assert slow["kda"].p_value < 1e-8 and not slow["kda"].noise


def test_a_slowest_is_tested_over_its_steps_where_they_are_enough():
    """Twelve steps a device, each step's layers sharing that step's noise (±3%, a clock):
    the layers of one step are no independent samples. Device 1 is 1.5% slower by chance;
    over its 96 layers the U test reads p 0.001, a straggler; over its 12 steps (each step's
    mean of a type's layers), p 0.12: noise, no slowest."""
    from kimi_perf.comparison import overview, spreads
    from kimi_perf.stats import u_test

    noise = 1 + 0.03 * np.random.default_rng(1).standard_normal((2, 12))
    rows = overview({"job": breakdown(two_device_trace(
        1.0, (8, 8), lambda device, step, layer: noise[device, step], steps=12))})
    spread = {s.type: s for s in spreads(rows)}
    assert [(f"{s.ratio:.3f}", s.slowest_label, s.tested_over) for s in spread.values()] == [
        ("1.015", None, "steps")] * 3
    assert spread["kda"].p_value == pytest.approx(0.118, abs=1e-3)
    slow, fast = sorted(rows, key=lambda r: -r.types["kda"][1])
    assert u_test(slow.samples["kda"][1], fast.samples["kda"][1], True) < spread["kda"].alpha


def test_a_spread_from_a_zero_median_is_tested_too():
    """A type whose fastest median is 0 µs (whole µs, a tiny kernel): no ratio, and its
    slowest still tested (where it was named on noise, and the note's ratio a TypeError);
    its layers with no step (a breakdown built in code) count among its layers, not as one
    step of their own."""
    from kimi_perf.comparison import OverviewRow, noise_note, span_samples, spreads

    rows = [OverviewRow(f"rank{i}", 3, None, {"A": (1, float(i))}, {"A": "same"},
                        samples={"A": (np.zeros(3), np.array([0.0] * 10 + [1.0] * 10))})
            for i in (0, 1)]
    (spread,) = spreads(rows)
    assert (spread.ratio, spread.slowest_label, spread.tested_over) == (None, None, "layers")
    assert noise_note([spread]).endswith(
        f"A from a median of 0 (p {spread.p_value:.2g} over layers)")
    # (beyond noise: named, no ratio)
    for i, row in enumerate(rows):
        row.samples["A"] = (np.zeros(3) + i, np.full(20, float(i)))
    (named,) = spreads(rows)
    assert (named.ratio, named.slowest_label) == (None, "rank1")
    assert named.p_value < named.alpha and noise_note([named]) is None
    b = Breakdown(source={}, steps=[], layers=[
        {"type": "A", "step": s, "device": 0, "span_us": float(s)} for s in (0, 0, 1, 1)] + [
        {"type": "A", "device": 0, "span_us": 9.0}], layer_types=[{"type": "A"}])
    by_step, by_layer = span_samples(b, [0])[0]["A"]
    assert by_step.tolist() == [0.0, 1.0] and by_layer.tolist() == [0, 0, 1, 1, 9]


def test_a_trace_of_two_devices_gets_its_device_table_in_the_report_and_the_run(tmp_path):
    """``trace --from`` one file of two devices: the report's table of every device, the run
    JSON's overview, the terminal's table."""
    from click.testing import CliRunner

    from kimi_perf.capture import analyse, run_document
    from kimi_perf.cli import main

    trace = two_device_trace()
    b = breakdown(trace)
    trace_file = tmp_path / "job.kptrace"
    trace.save(trace_file)
    run_dir, results, run_info = analyse([trace_file], tmp_path / "runs", plotly_js="cdn")
    html = (run_dir / run_info["report"]).read_text()
    assert "<h2>Every device (medians; µs = span, layer kernels in brackets)</h2>" in html
    assert "<tr><th>device</th>" in html and f"<p>S{DEVICE_1_SLOWEST[1:]}.</p>" in html
    doc = run_document(run_dir, results, run_info)
    assert [r["label"] for r in doc["devices"]["job"]["rows"]] == ["device 0", "device 1"]
    assert "overview" not in doc
    assert b.steps == results["job"].steps
    out = CliRunner().invoke(main, ["trace", "--from", str(trace_file), "-o",
                                    str(tmp_path / "cli")])
    assert out.exit_code == 0, out.output
    assert DEVICE_1_SLOWEST in " ".join(out.output.split())


def test_two_traces_of_two_devices_each_get_the_table_of_every_device(tmp_path):
    """A before/after pair of whole TP jobs (each one file of two devices), the after's rank 1
    slow in MLA: the terminal shows the pair's table and then each job's devices, spread
    among themselves (one table of both jobs' devices named the after's rank the slowest by
    the pair's difference alone); the JSON and the report hold them; compare says that each
    side's figures pool its devices."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    before, after = tmp_path / "before.kptrace", tmp_path / "after.kptrace"
    two_device_trace(slow_mla=1.0).save(before)
    two_device_trace(slow_mla=2.0).save(after)
    out = CliRunner().invoke(main, ["trace", "--from", str(before), "--from", str(after), "-o",
                                    str(tmp_path / "runs")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert (text.index("Per layer type: before vs after") < text.index("Every device of before")
            < text.index("Every device of after") and "Every trace" not in text)
    assert text.count("slowest: ") == 1 and DEVICE_1_SLOWEST in text
    assert "before's layers ran on 2 devices: its figures are medians over all of them" in text
    (run_dir,) = (tmp_path / "runs").iterdir()
    page = (run_dir / "report.html").read_text()
    assert "<h2>Every device of before (" in page and "<h2>Every device of after (" in page
    assert page.count("<p>Slowest: ") == 1
    doc = json.loads(CliRunner().invoke(main, [
        "trace", "--from", str(before), "--from", str(after), "-o", str(tmp_path / "json"),
        "--format", "json"]).output)
    assert list(doc["devices"]) == ["before", "after"] and "overview" not in doc
    assert [s["slowest"] for s in doc["devices"]["after"]["spreads"]] == [
        "device 1", None, "device 1"]
    assert {s["slowest"] for s in doc["devices"]["before"]["spreads"]} == {None}
    compared = CliRunner().invoke(main, ["compare", str(before), str(after)])
    said = " ".join(compared.output.split())
    assert ("after's layers ran on 2 devices: its figures are medians over all of them (each "
            "device's: its table of every device)") in said
    # compare shows each job's devices too, after the pair's table, as trace --from does
    assert (said.index("Per layer type: before vs after") < said.index("Every device of before")
            < said.index("Every device of after") and DEVICE_1_SLOWEST in said)
    from kimi_perf.comparison import compare_files, overview_json

    c = compare_files(before, after)
    compared = json.loads(CliRunner().invoke(main, ["compare", str(before), str(after),
                                                    "--format", "json"]).output)
    assert compared["devices"] == {label: json.loads(json.dumps(overview_json(rows)))
                                   for label, rows in c.devices.items()}
    assert compared["devices"]["after"] == doc["devices"]["after"]
    # one device each: no such table, no such note
    one = tmp_path / "one.kptrace"
    nvtx_decode_trace("layer[{i}]({kind})").build().save(one)
    other = tmp_path / "other.kptrace"
    nvtx_decode_trace("layer[{i}]({kind})", steps=3).build().save(other)
    plain = CliRunner().invoke(main, ["trace", "--from", str(one), "--from", str(other), "-o",
                                      str(tmp_path / "plain")])
    assert plain.exit_code == 0 and "Every" not in plain.output
    single = CliRunner().invoke(main, ["compare", str(one), str(other)])
    assert single.exit_code == 0 and "devices" not in single.output
    assert "devices" not in json.loads(CliRunner().invoke(main, [
        "compare", str(one), str(other), "--format", "json"]).output)


def test_a_spread_of_equals_names_no_slowest():
    """Two ranks 0.4% apart show 1.00x: neither is the slowest (it named one on noise), nor at
    0.5% (shown 1.00x too); 0.6% apart shows 1.01x, and names it."""
    from kimi_perf.comparison import OverviewRow, spreads

    def rows(slower: float) -> list[OverviewRow]:
        return [OverviewRow(f"rank{i}", 3, 1000.0 * (slower if i else 1), {"A": (5, 100.0)},
                            {"A": "same"}, layers=4.0) for i in (0, 1)]

    assert [s.slowest_label for s in spreads(rows(1.004))] == [None, None]
    assert [s.slowest_label for s in spreads(rows(1.005))] == [None, None]   # (shows 1.00)
    assert [s.slowest_label for s in spreads(rows(1.006))] == ["rank1", None]
    assert f"{spreads(rows(1.006))[0].ratio:.2f}" == "1.01"


def test_the_comparison_legend_says_what_a_type_only_the_other_side_has_is():
    """Training against inference (the Wan2.1 fixtures): inference's B pairs with none of
    training's types, whose own B is another layer: "- = B", said in the legend."""
    from kimi_perf.comparison import compare, pairing_note

    a, b = (breakdown(read_trace(NSYS / f"nsysai_fastvideo_wan2.1_{n}.sqlite"))
            for n in ("train_2xh100_before", "t2v_inference_2xh100_1s"))
    rows = compare(a, b)
    assert [r.label for r in rows][:4] == ["A", "B = C", "C = D", "- = B"]
    note = pairing_note(rows, "x", "y")
    assert note.startswith("B = C: the type x calls B, y calls C (types lettered")
    assert note.endswith("; - = B: a type only y has, which it calls B (x's B is another)")


def _vllm_phases_trace() -> TraceBuilder:
    """Three steps in vLLM's annotation: decode, mixed (longer kernels), decode."""
    b = TraceBuilder()
    for name, duration in (("execute_context_0(0)_generation_8(8)", 1000),
                           ("execute_context_1(77)_generation_7(7)", 9000),
                           ("execute_context_0(0)_generation_8(8)", 1000)):
        start, _ = b.sequence(["embedding", "gemm", "lm_head"], duration=duration)
        b.range(name, start - 10, b.clock)
        b.clock += 2000
    return b


def test_decode_steps_are_kept_when_others_are_prefill_or_mixed(tmp_path):
    """By default a trace whose steps are decode and mixed (or prefill) is broken down over
    its decode steps; the steps left out are counted per phase and said under the table."""
    from kimi_perf.render import breakdown_tables, tables_text
    from kimi_perf.report import write_report

    result = breakdown(_vllm_phases_trace().build())
    assert [s["phase"] for s in result.steps] == ["decode", "decode"]
    assert [s["kernel_us"] for s in result.steps] == [3.0, 3.0]
    assert result.source["steps_left_out"] == {"mixed": 1}
    assert result.source["outside_steps"]["ops"] == 0  # a left-out step's ops are not "outside"
    text = " ".join(tables_text(breakdown_tables(result)).split())
    assert "steps: 2 decode kept; 1 mixed left out (--phase all keeps every step)" in text
    html = write_report(tmp_path / "r.html", {"vllm": result}, "t", plotly_js="cdn").read_text()
    assert "vllm: steps: 2 decode kept; 1 mixed left out" in html
    every = breakdown(_vllm_phases_trace().build(), phase="all")
    assert [s["phase"] for s in every.steps] == ["decode", "mixed", "decode"]
    assert [s["kernel_us"] for s in every.steps] == [3.0, 27.0, 3.0]
    assert every.source["steps_left_out"] == {}
    text = " ".join(tables_text(breakdown_tables(every)).split())
    assert ("steps: 2 decode, 1 mixed; the medians are over all of them (--phase decode keeps "
            "the decode steps)") in text
    (mixed,) = breakdown(_vllm_phases_trace().build(), phase="mixed").steps
    assert mixed["kernel_us"] == 27.0


def test_a_phase_no_step_has_is_one_line(tmp_path):
    from click.testing import CliRunner

    from kimi_perf.cli import main

    trace = tmp_path / "vllm.kptrace"
    _vllm_phases_trace().build().save(trace)
    result = CliRunner().invoke(main, ["breakdown", str(trace), "--phase", "prefill"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert (f"{trace}: --phase prefill: no prefill step among the 3 steps found "
            "(2 decode, 1 mixed)" in result.output)
    profiler = TraceBuilder()
    start, _ = profiler.sequence(["gemm"])
    profiler.range("ProfilerStep#4", start - 10, profiler.clock)
    with pytest.raises(TraceError, match=r"no decode step among the 1 step found \(1 unknown\): "
                                         r"their names \(such as 'ProfilerStep#4'\) do not say"):
        breakdown(profiler.build(), phase="decode")
    # without a phase in their names, auto and all keep every step
    assert len(breakdown(profiler.build()).steps) == 1


def test_phase_hints_at_the_edges():
    """Prefill and mixed steps only: the hint names the phases there are. No steps at all:
    said as such."""
    from kimi_perf.layer_breakdown import phase_note
    from kimi_perf.layers import steps_of_phase

    b = TraceBuilder()
    for name in ("execute_context_1(77)_generation_0(0)", "execute_context_1(9)_generation_7(7)"):
        start, _ = b.sequence(["embedding", "gemm"])
        b.range(name, start - 10, b.clock)
        b.clock += 2000
    note = phase_note(breakdown(b.build()))
    assert note == ("steps: 1 prefill, 1 mixed; the medians are over all of them (--phase "
                    "prefill or mixed keeps one phase)")
    with pytest.raises(TraceError, match="phase='decode': the trace has no steps"):
        steps_of_phase([], "decode", "t")
    assert steps_of_phase([], "auto") == ([], {})


def test_every_command_that_breaks_traces_down_takes_the_phase(tmp_path):
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main

    trace = tmp_path / "vllm.kptrace"
    _vllm_phases_trace().build().save(trace)

    def run(*args):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result.output

    doc = json.loads(run("breakdown", trace, "--phase", "all", "--format", "json"))
    assert len(doc["steps"]) == 3
    run("trace", "--from", trace, "--phase", "mixed", "--out", tmp_path / "runs")
    (run_dir,) = (tmp_path / "runs").iterdir()
    stored = json.loads((run_dir / "breakdown.json").read_text())
    assert [s["phase"] for s in stored["paths"]["vllm"]["steps"]] == ["mixed"]
    assert stored["paths"]["vllm"]["source"]["steps_left_out"] == {"decode": 2}
    assert " --phase mixed --out " in stored["run"]["command"]
    run("report", trace, "--phase", "all", "-o", tmp_path / "r.html", "--plotly-js", "cdn")
    assert "the medians are over all of them" in (tmp_path / "r.html").read_text()
    failed = CliRunner().invoke(main, ["compare", str(trace), str(trace), "--phase", "prefill"])
    assert failed.exit_code == 2 and "no prefill step among the 3 steps found" in failed.output


def test_vllm_decode_breakdown():
    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    (step,) = b.steps
    assert step["layers"] == 24 and step["layer_source"] == "repeat"
    types = {t["type"]: t for t in b.layer_types}
    assert set(types) == {"A", "B"} and types["A"]["layers"] == types["B"]["layers"] == 12
    assert types["B"]["kernels"] == types["A"]["kernels"] + 1  # 3d attention + reduce_segments
    for t in types.values():
        assert t["classes"]["moe"]["kernels"] == 4 and t["classes"]["router"]["kernels"] == 4
        assert t["classes"]["norm"]["kernels"] == 2
    total = step["prologue"]["kernels"] + step["epilogue"]["kernels"] + sum(
        layer["kernels"] for layer in b.layers)
    assert total == step["kernels"]


@pytest.mark.parametrize(("name", "cls"), [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "communication"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>", "communication"),
    ("[CUDA memcpy Host-to-Device]", "memcpy"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("_topk_forward", "router"),
    ("fused_moe_kernel", "moe"),
    ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu", "moe"),
    ("kernel_unified_attention_3d", "attention"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("fused_recurrent_kda_fwd_kernel", "attention"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm"),
    ("final_norm", "norm"),                       # the decode paths' own, by name
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rope"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT32x32x256_MI16x16x1", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "elementwise"),
    ("my_custom_thing", "other"),
    # FlashInfer's kernels beside its attention (SGLang's defaults), by module
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "norm"),
    ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u>", "rope"),
    ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &silu>", "elementwise"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u>", "elementwise"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<PosEncodingMode(0)>", "attention"),
    # Triton's decode and extend attention (SGLang, vLLM's TRITON_MLA), TensorRT-LLM's XQA
    ("_fwd_grouped_kernel_stage1", "attention"), ("_fwd_kernel_stage2", "attention"),
    ("_fwd_grouped_kernel_stage1_rope", "attention"), ("_fwd_kernel", "attention"),
    ("void xqa::kernel_mha<__nv_bfloat16>", "attention"),
    # Inductor's fused RMSNorm; routing and grouped GEMMs of MoE launches
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
    ("moe_fused_gate_kernel<float, 256>", "router"),
    ("count_and_sort_expert_tokens_kernel<int>", "router"),
    ("void deep_gemm::fp8_gemm_kernel<7168u, 4096u, 128u, (deep_gemm::GemmType)1>", "moe"),
    ("void deep_gemm::fp8_gemm_kernel<7168u, 4096u, 128u, (deep_gemm::GemmType)0>", "gemm"),
    ("void deep_gemm::fp8_gemm_kernel<7168u, 4096u, 128u, (deep_gemm::GemmType)3>", "moe"),
    ("void deep_gemm::sm90_m_grouped_fp8_gemm_masked_1d2d_impl<128u>", "moe"),
    ("num_grouped_tokens_kernel", "other"),        # (no m_grouped inside a word)
    ("_fwd_kernel_alibi", "attention"),
    ("triton_per_fused__to_copy_abs_add_amax_clamp_div_mean_mul_pow_reciprocal_1", "norm"),
    # convolutions (the fixtures' AlexNet and Wan2.1): cuDNN's engines, implicit GEMMs and
    # layout transforms; not a convert, a causal conv1d (attention), an Inductor pointwise
    ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int, int)", "conv"),
    ("void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int)", "conv"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw", "conv"),
    ("cudnn_infer_volta_scudnn_128x64_relu_small_nn_v1", "conv"),
    ("void cutlass_cudnn_infer::Kernel<cutlass_tensorop_s1688dgrad_optimized_tf32>", "conv"),
    ("void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true>", "conv"),
    ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>", "conv"),
    ("void at::native::im2col_kernel<float>", "conv"),
    ("triton_tem_fused_convolution_0", "conv"),
    ("triton_poi_fused_convolution_relu_0", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::convert_kernel>",
     "elementwise"),
    ("void causal_conv1d_update_kernel<128, 4>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>", "norm"),
    # an LSTM's cell names cuDNN's RNN mode, not a convolution
    ("void elemWiseRNNcell<float, float, float, (cudnnRNNMode_t)2, (cudnnRNNBiasMode_t)2>"
     "(int, int, int, int, int, bool, float const*, float*)", "other"),
    ("void LSTM_elementWise_fp<float, float, float>(int, int, int, int, float const*)",
     "elementwise"),
    # LayerNorm's backward, pooling, nvFuser's pointwise and persistent kernels
    ("void at::native::GammaBetaBackwardCUDAKernel<float, float>(long, long)", "norm"),
    ("void at::native::max_pool_forward_nchw<float, float>(int, float const*)", "elementwise"),
    ("void at::native::adaptive_average_pool<float>(float const*, float*)", "elementwise"),
    ("<unnamed>::nvfuser_pointwise_f0_c1_r0_g0(<unnamed>::Tensor<float, 2, 2>)", "elementwise"),
    ("<unnamed>::nvfuser_inner_persistent_f1_c1_r0_g2(<unnamed>::Tensor<float, 2, 2>)",
     "elementwise"),
    # a radix sort or scan stays other (a sampler's top-p as often as a router's)
    ("void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<long, int>>", "other"),
    ("void cub::DeviceScanKernel<cub::AgentScanPolicy<128, 15, int>>", "other"),
])
def test_default_kernel_classes(name, cls):
    assert classify_name(name, default_rules()) == cls


def test_user_rules_come_first(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nclass = "kda"\npattern = "kda"\n')
    loaded = load_rules(rules)
    assert classify_name("fused_recurrent_kda_fwd_kernel", loaded) == "kda"
    codes, labels = classify(np.array([0, 1, 0]), ["kda_decode", "nccl_allreduce"], loaded)
    assert [labels[c] for c in codes] == ["kda", "communication", "kda"]


@pytest.mark.parametrize(("text", "said"), [
    ("not toml [", "invalid TOML"), ("[[rule]]\nclass = 'x'\n", "needs string 'class'"),
    ("[[rule]]\nclass = 'x'\npattern = '('\n", "bad regex"),
    ("x = 1\n", "unknown table or key 'x'"),
    ("[[rules]]\nclass = 'x'\npattern = 'y'\n", "unknown table or key 'rules'"),
    ("[[rule]]\nclass = 'x'\npattern = 'y'\nbogus = 1\n", "unknown key 'bogus'"),
    ("[[rule]]\nclass = 'x'\npattern = ''\n", "empty 'class' or 'pattern'"),
    ("[[rule]]\nclass = ' '\npattern = 'y'\n", "empty 'class' or 'pattern'"),
    ("[[rule]]\nclass = 'a;b'\npattern = 'y'\n", "class 'a;b' holds ';', which the CSV"),
    ("[[rule]]\nclass = 'x=1/2'\npattern = 'y'\n", "holds '/', which the CSV's classes"),
    ("[[rule]]\nclass = 'x'\npattern = 'a?'\n", "pattern 'a?' matches an empty name, so "
                                                 "every kernel"),
    ("[[rule]]\nclass = 'x'\npattern = '.*'\n", "matches an empty name")])
def test_bad_rules_files_are_named(tmp_path, text, said):
    """A rules file with anything but rules of a class and a pattern (a misspelt table or
    key would silently do nothing; an empty pattern would match every kernel) is an error
    naming the file."""
    rules = tmp_path / "rules.toml"
    rules.write_text(text)
    with pytest.raises(TraceError, match=r"rules\.toml: .*" + re.escape(said)):
        load_rules(rules)


@pytest.mark.parametrize("name", ["tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz",
                                  "hta_trace_diff_test_v100_rank1_cudagraph.json.gz"])
def test_layer_rows_read_as_the_dicts_the_figures_give(name):
    """Layers are kept as columns and built as dicts on read: the same dicts, in every way of
    reading them, as ``SegmentFigures.stats`` builds, and their medians as
    ``layer_type_medians`` computes from those dicts."""
    import json

    from kimi_perf.layer_breakdown import LayerRows, SegmentFigures
    from tests.synth import segment
    from tests.test_core_regressions import layer_type_medians

    trace = read_trace(KINETO / name)
    ops, steps = segment(trace)
    layers = [(s, layer) for s in steps for layer in s.layers]
    assert layers, "the fixture must have layers"
    figures = SegmentFigures.of(ops, [layer.ops for _, layer in layers], ops.kernel_class,
                                ops.class_labels)
    heads = [(s.index, s.device, layer.index, layer.type) for s, layer in layers]
    want = figures.stats(ops.class_labels, [{"step": a, "device": b, "index": c, "type": d}
                                            for a, b, c, d in heads])
    rows = LayerRows(heads, figures, 0, ops.class_labels)
    assert len(rows) == len(want) and list(rows) == want and rows == want
    assert rows[-1] == want[-1] and rows[1:4] == want[1:4] and rows[::5] == want[::5]
    for backwards in (slice(None, None, -1), slice(3, None, -1), slice(-2, 0, -3),
                      slice(5, 1, -1), slice(None, -len(want) - 5, -2)):
        assert rows[backwards] == want[backwards], backwards   # to the start, too
    with pytest.raises(IndexError):
        rows[len(want)]
    b = breakdown(trace)
    assert b.layers == want
    # the breakdown adds each type's typical layer, the digest of the kernel sequence of
    # types found by the pattern, and the two groups its layers fall in, if they do
    assert [{k: v for k, v in t.items() if k not in ("pattern", "typical_layer", "two_groups")}
            for t in b.layer_types] == layer_type_medians(want)
    if all(s.layer_source == "repeat" for s in steps):
        assert all(len(t["pattern"]) == 12 for t in b.layer_types)
    assert json.loads(json.dumps(b.to_json()))["layers"] == want
    # a column straight from the columns, as from the dicts (a breakdown read from JSON)
    from kimi_perf.layer_breakdown import LAYER_COLUMNS, layer_column

    for column in LAYER_COLUMNS:
        for layer_type in (None, *(t["type"] for t in b.layer_types), "no such type"):
            from_dicts = [r[column] for r in want if layer_type in (None, r["type"])]
            assert layer_column(rows, column, layer_type).tolist() == from_dicts
            assert layer_column(want, column, layer_type).tolist() == from_dicts
            assert layer_column(want, column).dtype == layer_column(rows, column).dtype
    with pytest.raises(ValueError, match="read-only"):
        layer_column(rows, "span_us")[0] = 0.0


def test_typical_layer_is_the_most_common_sequence_with_median_times():
    """Each layer type's typical layer: the kernel sequence most of its layers ran (layer 0's
    variant norm is the odd one out), each kernel's median µs over those layers only: 1 µs,
    where the mean would be 2 µs and the median over all KDA layers (with layer 0's 10-40
    µs) 4 µs."""
    b = TraceBuilder()
    for s, duration in enumerate([1000, 1000, 4000]):
        step_start = b.clock
        for i, kernels in enumerate(k3_like(4)):
            kind = "mla" if "mla_decode" in kernels else "kda"
            start, end = b.sequence(kernels, duration=duration * (10 if i == 0 else 1))
            b.range(f"layer[{i}]({kind})", start - 10, end)
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    types = {t["type"]: t for t in breakdown(b.build()).layer_types}
    kda, mla = types["kda"]["typical_layer"], types["mla"]["typical_layer"]
    assert types["kda"]["layers"] == 9 and kda["layers"] == 6  # all but the three layer 0s
    assert [k["name"] for k in kda["kernels"]] == KDA
    assert [k["name"] for k in mla["kernels"]] == MLA and mla["layers"] == 3
    assert {k["us"] for k in kda["kernels"]} == {1.0} == {k["us"] for k in mla["kernels"]}
    assert [k["class"] for k in kda["kernels"]][4:7] == ["attention", "gemm", "communication"]
    assert "pattern" not in types["kda"]  # types named by ranges need no digest


def test_timeline_is_the_median_span_step_op_by_op():
    """The report draws one step from the breakdown alone: the step of median span, each op
    with its name, class, start and length in µs, layer by layer."""
    b = TraceBuilder()
    for s, duration in enumerate([1000, 3000, 2000]):
        step_start = b.clock
        b.sequence(["embedding"], duration=duration)
        for i, kernels in enumerate(k3_like(4)):
            kind = "mla" if "mla_decode" in kernels else "kda"
            start, end = b.sequence(kernels, duration=duration)
            b.range(f"layer[{i}]({kind})", start - 10, end)
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    result = breakdown(b.build())
    timeline = result.timeline
    assert timeline["step"] == "decode_step[2]"  # spans 1000, 3000, 2000 ns per op
    assert [seg["label"] for seg in timeline["segments"]] == [
        "prologue", "layer 0 (kda)", "layer 1 (kda)", "layer 2 (kda)", "layer 3 (mla)"]
    layer1 = timeline["segments"][2]["ops"]
    assert [timeline["names"][op[0]] for op in layer1] == KDA
    assert [op[3] for op in layer1] == [2.0] * len(KDA)
    assert layer1[0][2] == (1 + len(KDA)) * 2.1  # the prologue and layer 0 before it
    assert layer1[4][1] == "attention"
    again = type(result).from_json(result.to_json())
    assert again.timeline == timeline


def test_the_timeline_step_holds_every_op_of_its_step():
    """Work between the layers (of the step's other threads: 5,866 of 7,622 ops here) is
    drawn too, on a row of its own, or the timeline's gaps read as an idle GPU."""
    trace = read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite")
    b = breakdown(trace, layers="nvtx:^scaled dot product attention$")
    timeline = b.timeline
    step = next(s for s in b.steps if s["name"] == timeline["step"])
    segments = {seg["label"]: len(seg["ops"]) for seg in timeline["segments"]}
    assert sum(segments.values()) + timeline.get("ops_left_out", 0) == step["kernels"]
    assert segments["between layers"] == 5866
    assert list(segments)[-2:] == ["epilogue", "between layers"]


def test_a_long_step_draws_its_first_ops_and_says_how_many_more(monkeypatch, tmp_path):
    """A step of more ops than a report can draw (a training step, a profiler's window):
    the timeline keeps the first TIMELINE_OPS, cut inside a layer where it falls, names only
    what it keeps, and the report says how many it left out."""
    from kimi_perf import layer_breakdown
    from kimi_perf.report import write_report

    trace = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")
    whole = breakdown(trace).timeline
    total = sum(len(seg["ops"]) for seg in whole["segments"])
    monkeypatch.setattr(layer_breakdown, "TIMELINE_OPS", 30)
    cut = breakdown(trace).timeline
    kept = [seg["ops"] for seg in cut["segments"]]
    assert sum(map(len, kept)) == 30 and cut["ops_left_out"] == total - 30
    assert [len(k) for k in kept] == [11, 16, 3]             # prologue, layer 0, 3 of layer 1
    for part, seg in zip(kept, whole["segments"], strict=False):   # the same ops, named anew
        assert [(cut["names"][n], *rest) for n, *rest in part] == [
            (whole["names"][n], *rest) for n, *rest in seg["ops"][:len(part)]]
    assert len(cut["names"]) == len({op[0] for ops in kept for op in ops})
    assert "ops_left_out" not in whole
    b = breakdown(trace)
    text = write_report(tmp_path / "r.html", {"vllm": b}, "t", plotly_js="cdn").read_text()
    assert f"vllm: the step's first 30 ops are drawn, its {total - 30:,} more are left out" \
        in text


def test_plot_text_escapes_what_plotly_reads_and_keeps_quotes(tmp_path):
    """Names in the plots (hover text, axis and panel titles) are escaped for plotly, which
    reads <br> and &lt; but shows &quot; as it is: a quote stays a quote, a < cannot open a
    tag, in the plots as in the tables."""
    from kimi_perf.report import write_report

    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x"
                                      ".json.gz"))
    label = 'run "a" <b>'
    text = write_report(tmp_path / "r.html", {label: b}, "t", plotly_js="cdn").read_text()
    head, plots = text.split("<script", 1)
    assert plots.count('run \\"a\\" &lt;b&gt;"') >= 3 and "&quot;" not in plots
    assert "<th>trace run &quot;a&quot; &lt;b&gt;</th>" in head   # HTML proper: all escaped


def test_library_calls_given_what_they_cannot_take_say_so(tmp_path):
    """From a notebook: a bad regex is a ValueError naming the argument (not re.error from
    deep inside), a path where a Trace goes a TypeError naming what reads it, and analyse
    takes paths as strings, as read_trace does. A Trace is equal only to itself (numpy
    columns compared element-wise have no one truth value)."""
    from kimi_perf.capture import analyse

    path = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
    trace = read_trace(path)
    with pytest.raises(ValueError, match=r"step_regex: bad regex '\('"):
        breakdown(trace, step_regex="(")
    with pytest.raises(ValueError, match=r"layer regex: bad regex '\('"):
        breakdown(trace, layers="nvtx:(")
    with pytest.raises(TypeError, match=r"read_trace\(path\).*breakdown_of_file"):
        breakdown(str(path))
    run_dir, results, _ = analyse([str(path)], str(tmp_path), plotly_js="cdn")
    assert list(results) == [path.name.removesuffix(".json.gz")] and run_dir.parent == tmp_path
    again = read_trace(path)
    assert trace == trace and trace != again and again in [trace, again]
    assert trace.kernels == trace.kernels and trace.kernels != again.kernels


def test_typical_layer_of_a_real_trace_and_its_pattern_digest():
    trace = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")
    types = {t["type"]: t for t in breakdown(trace).layer_types}
    a = types["A"]["typical_layer"]
    assert a["layers"] == 11 and len(a["kernels"]) == 17 and types["A"]["pattern"]
    assert a["kernels"][14]["name"] == "_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu"
    assert a["kernels"][14]["class"] == "moe" and 100 < a["kernels"][14]["us"] < 200


def test_ratios_keep_two_significant_digits_below_a_tenth():
    from kimi_perf.comparison import ratio_text

    assert [ratio_text(v) for v in (None, 0, 2.004, 0.1, 0.0041, -0.05)] == [
        "-", "0.00", "2.00", "0.10", "0.0041", "-0.050"]
    # its trailing zero kept: 0.01 would read as exactly a hundredth
    assert [ratio_text(v) for v in (0.0103, 0.004963, 0.001963)] == ["0.010", "0.0050", "0.0020"]
    # a ratio kept to four significant digits shows them, no more (28160.00 read as exact)
    assert [ratio_text(v) for v in (28160.0, 1203.0, 123.4, 99.5, 99.999, 999.96)] == [
        "28,160", "1,203", "123.4", "99.50", "100.0", "1,000"]


def test_kernel_counts_read_whole_or_to_one_decimal():
    """Medians are whole or halves, means anything: one decimal for both, never 3
    significant digits (a 2180-kernel layer read 2.18e+03; a 38.985 mean read 39 beside
    39.2)."""
    from kimi_perf.comparison import count_text

    assert [count_text(v) for v in (None, 3, 2180.0, 12.5, 38.985, 39.25)] == [
        "-", "3", "2180", "12.5", "39.0", "39.2"]


def test_a_cpu_run_steps_device_is_the_cpu():
    import json

    from kimi_perf.layer_breakdown import Breakdown
    from kimi_perf.render import breakdown_tables, tables_text
    from tests.test_gate import BASELINE

    doc = json.loads(BASELINE.read_text())["paths"]["specialized"]
    b = Breakdown.from_json(doc)
    assert b.unit == "ops" and {s["device"] for s in b.steps} == {-1}
    steps_table = tables_text(breakdown_tables(b)[:1])
    assert " cpu " in steps_table and " -1 " not in steps_table


def _alternating_attention(slow_us: int, steps: int = 2, layers: int = 8,
                           layer_ranges: bool = True) -> TraceBuilder:
    """Layers of one kernel sequence, each in a layer[i] range; the attention kernel of every
    odd layer takes ``slow_us`` instead of 100 µs (sliding-window and full attention)."""
    b = TraceBuilder()
    for step in range(steps):
        step_start = b.clock
        for i in range(layers):
            start = b.clock
            b.sequence(["rmsnorm"], duration=10_000)
            b.sequence(["flash_attention"], duration=(slow_us if i % 2 else 100) * 1000)
            b.sequence(["gemm_o_proj", "fused_moe_kernel"], duration=200_000)
            if layer_ranges:
                b.range(f"layer[{i}]", start - 5, b.clock)
        b.range(f"decode_step[{step}]", step_start - 10, b.clock)
        b.clock += 5000
    return b


def test_cpu_ops_are_never_said_to_fall_in_two_groups():
    """The same alternating layers as CPU ops (a decode run on a CPU, its annotated
    launches): an op's time there is the host's, so two groups say nothing of the work."""
    b = TraceBuilder()
    for step in range(2):
        step_start = b.clock
        for i in range(8):
            start = b.clock
            for op, us in (("rmsnorm", 10), ("flash_attention", 200 if i % 2 else 100),
                           ("gemm_o_proj", 200)):
                b.range(f"op:{op}", b.clock, b.clock + us * 1000)
                b.clock += us * 1000 + 100
            b.range(f"layer[{i}]", start - 5, b.clock)
        b.range(f"decode_step[{step}]", step_start - 10, b.clock)
        b.clock += 5000
    cpu = breakdown(b.build())
    assert cpu.unit == "ops" and len(cpu.layers) == 16
    assert "two_groups" not in cpu.layer_types[0]
    assert "two_groups" in breakdown(_alternating_attention(slow_us=200).build()).layer_types[0]


def test_a_layer_type_whose_layers_fall_in_two_groups_says_so(tmp_path):
    """GPT-OSS alternates sliding-window and full attention with the same kernels: one type
    whose attention median matches no layer. The breakdown finds the two groups, says which
    layers are the slower ones, in the table and the report."""
    from kimi_perf.layer_breakdown import two_groups_note
    from kimi_perf.render import breakdown_tables, tables_text
    from kimi_perf.report import write_report

    b = breakdown(_alternating_attention(slow_us=200).build())
    (t,) = b.layer_types
    assert t["classes"]["attention"]["us"] == 150.0      # the median: of neither group
    (group,) = t["two_groups"]
    assert group == {"figure": "attention", "low_us": 100.0, "high_us": 200.0,
                     "low_layers": 4, "high_layers": [1, 3, 5, 7], "median_between": True,
                     "kernels": [1, 1]}
    note = two_groups_note(t["type"], group)
    assert note == ("A: attention µs in two groups by layer: 100.0 µs in 4 layers, 200.0 µs in "
                    "4 (layers 1, 3, 5, 7: every 2nd); the median is of neither; the same "
                    "kernels doing different work, such as sliding-window and full attention")
    # layers that run other counts of the class's kernels are not said to run the same ones
    # (a type of ranges of two names: softmax and attention scores)
    assert two_groups_note(t["type"], {**group, "kernels": [3, 5]}).endswith(
        "the median is of neither; its layers run 3 to 5 of these kernels: other work, such "
        "as layers of two kinds under one type")
    assert note in " ".join(tables_text(breakdown_tables(b)).split())
    html = write_report(tmp_path / "r.html", {"x": b}, "t", plotly_js="cdn").read_text()
    assert "attention µs in two groups by layer" in html
    # the same time everywhere, or a difference too small against the layer: nothing to say
    assert "two_groups" not in breakdown(_alternating_attention(100).build()).layer_types[0]
    assert "two_groups" not in breakdown(_alternating_attention(105).build()).layer_types[0]


def test_two_groups_count_each_layers_kernels_as_its_median_over_the_steps():
    """A layer that runs one kernel more in one step of two is no layer of another kind: its
    count is the lower of its two middle ones (1.5, rounded out, said "1 to 2")."""
    from types import SimpleNamespace

    from kimi_perf.layer_breakdown import two_groups

    n = 8   # layers, alternating 10 and 30 µs of attention, in 2 steps
    index = np.tile(np.arange(n), 2)
    kernels = np.ones((2 * n, 1), np.int64)
    kernels[3, 0] = 2   # layer 3, step 0: a kernel more
    rows = SimpleNamespace(types=["A"], type_code=np.zeros(2 * n, np.int64), layer_index=index,
                           span_us=np.full(2 * n, 100.0), labels=["attention"],
                           class_us=np.where(index % 2, 30.0, 10.0)[:, None],
                           class_kernels=kernels)
    (group,) = two_groups(rows)["A"]
    assert group["high_layers"] == [1, 3, 5, 7] and group["kernels"] == [1, 1]
    kernels[3 + n, 0] = 2   # in both steps: its count is 2
    assert two_groups(rows)["A"][0]["kernels"] == [1, 2]


def test_no_two_groups_of_a_difference_small_against_the_layer():
    """Attention at 1 and 2 µs by layer (twice over: past the ratio) in layers of 410 µs:
    a microsecond is under 2% of the layer, nothing to say; at 10 and 20 µs, two groups."""
    from types import SimpleNamespace

    from kimi_perf.layer_breakdown import two_groups

    n = 8
    index = np.tile(np.arange(n), 2)

    def rows(low: float) -> SimpleNamespace:
        return SimpleNamespace(types=["A"], type_code=np.zeros(2 * n, np.int64),
                               layer_index=index, span_us=np.full(2 * n, 410.0),
                               labels=["attention"],
                               class_us=np.where(index % 2, 2 * low, low)[:, None],
                               class_kernels=np.ones((2 * n, 1), np.int64))
    assert two_groups(rows(1.0)) == {"A": []}
    (group,) = two_groups(rows(10.0))["A"]
    assert (group["low_us"], group["high_us"]) == (10.0, 20.0)


def test_two_groups_of_real_vllm_prefill_layers():
    mixed = KINETO / "tracelens_vllm_gptoss20b_prefilldecode_piecewise_mi300x.json.gz"
    (t,) = breakdown(read_trace(mixed)).layer_types
    (group,) = t["two_groups"]
    assert group["figure"] == "attention" and group["high_layers"] == list(range(1, 24, 2))
    assert 150 < group["low_us"] < 165 and 310 < group["high_us"] < 335


@pytest.mark.parametrize("trace", [
    # one warm-up layer whose span holds a long host stall; kernel time is as the others'
    "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite",
    # spans that differ by host stalls alone
    "hta_v100_ddp_rank1_19k_kernels.json.gz",
    # NCCL kernels waiting for the other rank every 4th layer
    "nsysai_fastvideo_wan2.1_train_2xh100_after.sqlite"])
def test_no_two_groups_where_only_waiting_differs(trace):
    path = (NSYS if trace.endswith(".sqlite") else KINETO) / trace
    assert not [t["two_groups"] for t in breakdown(read_trace(path)).layer_types
                if "two_groups" in t]


def test_pattern_types_of_one_layer_each_are_said_to_be_single_layers():
    """A training trace whose steps' kernels vary: of its 12 layers (two a step, so each is
    a step's first or last) those within two kernels of each other share a type, and 5 types
    are left of one layer each, whose "medians" are single layers: the table says so."""
    from kimi_perf.layer_breakdown import lone_types_note

    b = breakdown(read_trace(KINETO / "hta_trace_diff_test_v100_rank1_cudagraph.json.gz"))
    assert len(b.steps) == 6 and [t["layers"] for t in b.layer_types] == [1, 1, 3, 4, 1, 1, 1]
    note = lone_types_note(b)
    assert note.startswith("5 types found by the kernel pattern (A, B, E, F, G) hold one layer "
                           "each in 6 steps")
    # layers that the pattern finds repeating say nothing of the kind
    repeated = breakdown(_alternating_attention(200, layer_ranges=False).build())
    assert [(t["layers"], len(t["pattern"])) for t in repeated.layer_types] == [(16, 12)]
    assert lone_types_note(repeated) is None
    # one step whose every pattern type holds one layer: nothing repeated (AlexNet's warm-up
    # pass and timed pass, 38 and 40 kernels, read as two "layers" without a word)
    alexnet = breakdown(read_trace(KINETO / "hta_a100_alexnet_cuda_sync.json.gz"))
    assert len(alexnet.steps) == 1 and [t["layers"] for t in alexnet.layer_types] == [1, 1]
    assert lone_types_note(alexnet).startswith(
        "the 2 types found by the kernel pattern (A, B) hold one layer each: nothing repeated "
        "in the step, so these layers may be whole passes")


def test_compare_pairs_pattern_types_by_their_kernels_whatever_their_letters(tmp_path):
    """The same trace with its letters swapped (as when another trace finds the other layer
    first): compare pairs A with B and B with A, as the gate does, and says so."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main
    from kimi_perf.layer_breakdown import Breakdown
    from kimi_perf.render import comparison_table, tables_text

    vllm = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
    doc = breakdown(read_trace(vllm)).to_json()
    swapped = json.loads(json.dumps(doc).replace('"type": "A"', '"type": "X"')
                         .replace('"type": "B"', '"type": "A"')
                         .replace('"type": "X"', '"type": "B"'))
    a, b = Breakdown.from_json(doc), Breakdown.from_json(swapped)
    rows = compare(a, b)
    assert [(r.label, r.span_ratio, r.pattern_differs) for r in rows[:2]] == [
        ("A = B", 1.0, False), ("B = A", 1.0, False)]
    text = tables_text([comparison_table(rows, "x", "y")])
    assert "A = B" in text and ("the type x calls A, y calls B (types lettered by their kernel "
                                "sequence (the repeating kernel pattern's, or ranges' that name "
                                "no type) pair by it; those left over by their mix of kernels "
                                "per class, marked * where the sequences differ)"
                                ) in " ".join(text.split())
    # the legend names a pair the table has, not letters that may be either side's types
    renamed = Breakdown.from_json(json.loads(json.dumps(doc).replace('"type": "A"',
                                                                     '"type": "E"')))
    text = " ".join(tables_text([comparison_table(compare(a, renamed), "x", "y")]).split())
    assert "A = E: the type x calls A, y calls E (types lettered" in text and "A = B" not in text
    (tmp_path / "b.json").write_text(json.dumps(swapped))
    out = CliRunner().invoke(main, ["compare", str(vllm), str(tmp_path / "b.json"),
                                    "--kernels", "--format", "json"]).output
    typical = json.loads(out)["typical_layers"]
    assert typical["A = B"]["a"] == typical["A = B"]["b"]
    from kimi_perf.report import write_report

    html = write_report(tmp_path / "r.html", {"x": a, "y": b}, "t", plotly_js="cdn").read_text()
    assert html.count("<h3>Typical ") == 2
    assert "Typical A layer (y calls it B)" in html and "Typical B layer (y calls it A)" in html
    from kimi_perf.comparison import overview

    rows = overview({"x": a, "y": b, "z": a})
    assert list(rows[0].types) == ["A", "B"] and rows[1].types == rows[0].types


def _types(*specs) -> Breakdown:
    """A breakdown of layer types only, two like layers each: (name, digest or None, kernels,
    span µs[, kernels per class]) each."""
    layers = [{"step": 0, "device": 0, "index": 2 * i + j, "type": name, "kernels": k,
               "kernel_us": us, "span_us": us, "gap_us": 0.0, "classes": {}}
              for i, (name, _, k, us, *_) in enumerate(specs) for j in range(2)]
    kernels, us = (sum(r[key] for r in layers) for key in ("kernels", "span_us"))
    step = {"index": 0, "device": 0, "name": "decode_step[0]", "phase": "decode",
            "layers": len(layers), "kernels": kernels, "kernel_us": us, "span_us": us,
            "gap_us": 0.0, "classes": {}, "layer_source": "pattern",
            "prologue": {"kernels": 0, "span_us": 0.0}, "epilogue": {"kernels": 0, "span_us": 0.0}}
    return Breakdown(source={}, steps=[step], layers=layers, layer_types=[
        {"type": name, "layers": 2, "kernels": k, "kernel_us": us, "span_us": us,
         "gap_us": 0.0,
         "classes": {c: {"kernels": n, "us": 1.0} for c, n in (classes[0] if classes else {})
                     .items()},
         "typical_layer": {"layers": 2, "kernels": [{"name": f"{name}{digest}", "class": "x",
                                                     "us": us}]},
         **({"pattern": digest} if digest else {})} for name, digest, k, us, *classes in specs])


def test_leftover_pattern_types_pair_by_their_mix_of_kernels():
    """Fused layers (other sequences, fewer kernels) after a warm-up type that only B has:
    each unfused layer pairs with the fused layer of its mix of classes, not the warm-up
    (order alone would pair A with the warm-up and B with A's fused form)."""
    from kimi_perf.comparison import leftover_pairs, pair_layer_types

    attention = {"gemm": 6, "attention": 2, "norm": 3}
    mlp = {"gemm": 4, "moe": 5, "norm": 2}
    a = _types(("A", "d1", 11, 50.0, attention), ("B", "d2", 11, 40.0, mlp))
    b = _types(("A", "w", 30, 900.0, {"memory": 30}),
               ("B", "f1", 5, 30.0, {"gemm": 3, "attention": 1, "norm": 1}),
               ("C", "f2", 6, 25.0, {"gemm": 2, "moe": 3, "norm": 1}))
    assert pair_layer_types(a, b) == [("A", "B"), ("B", "C"), (None, "A")]
    rows = compare(a, b)
    assert [(r.label, r.span_ratio, r.pattern_differs) for r in rows[:3]] == [
        ("A = B", round(50 / 30, 3), True), ("B = C", 1.6, True), ("- = A", None, False)]
    # without classes to tell them apart (an older breakdown), leftovers pair in order
    plain = [dict(t, classes={}) for t in b.layer_types]
    assert leftover_pairs(a.layer_types, plain) == [(0, 0), (1, 1)]
    # a small fragment of about the same mix (a layer cut at the trace's edge) does not take
    # the place of the layer of its size whose mix moved
    layer = _types(("A", "a", 40, 9.0, {"gemm": 30, "norm": 6, "elementwise": 4}))
    other = _types(("A", "f", 4, 1.0, {"gemm": 3, "norm": 1}),
                   ("B", "m", 40, 9.0, {"gemm": 24, "norm": 10, "elementwise": 6}))
    assert pair_layer_types(layer, other) == [("A", "B"), (None, "A")]


def test_a_kernel_sequence_joins_the_column_any_trace_gave_it():
    """An unrelated first trace's type takes a later trace's by their mix of kernels; a third
    trace with that later one's kernel sequence joins the same column, not the first trace's
    other type (wan2.1 before and after, behind a trace of another model)."""
    from kimi_perf.comparison import aligned_types

    other = _types(("A", "x1", 10, 2500.0, {"gemm": 10}), ("B", "x2", 10, 900.0, {"norm": 10}))
    # before's B is nearer other's B, which before's A (its very mix) takes
    before = _types(("A", "w124", 10, 19000.0, {"norm": 10}),
                    ("B", "w157", 10, 16700.0, {"norm": 8, "gemm": 2}))
    after = _types(("A", "w157", 10, 19000.0, {"norm": 8, "gemm": 2}))
    rows = aligned_types({"other": other, "before": before, "after": after})
    assert {"before": "B", "after": "A"}.items() <= next(
        r for r in rows if "after" in r).items()


def test_types_only_later_traces_have_are_one_column(tmp_path):
    """A type the first trace lacks but two others have (by name, or by kernel sequence) is
    one row of the alignment, not one per trace."""
    from kimi_perf.comparison import aligned_types, overview

    r0 = _types(("mlp", None, 5, 10.0))
    r1 = _types(("mlp", None, 5, 10.0), ("kda", None, 9, 20.0), ("A", "d1", 3, 5.0))
    r2 = _types(("kda", None, 9, 21.0), ("mlp", None, 5, 11.0), ("B", "d1", 3, 6.0))
    assert aligned_types({"r0": r0, "r1": r1, "r2": r2}) == [
        {"r0": "mlp", "r1": "mlp", "r2": "mlp"}, {"r1": "kda", "r2": "kda"},
        {"r1": "A", "r2": "B"}]
    rows = overview({"r0": r0, "r1": r1, "r2": r2})
    assert list(rows[0].types) == ["mlp", "kda", "A"]
    assert rows[2].types["A"] == (3, 6.0) and rows[0].types["kda"] is None
    from kimi_perf.report import write_report

    html = write_report(tmp_path / "r.html", {"r0": r0, "r1": r1, "r2": r2}, "t",
                        plotly_js="cdn").read_text()
    assert "Typical kda layer (only in r1, r2)" in html
    assert "Typical A layer (only in r1, r2; r2 calls it B)" in html
    # a type the first holds but not every trace: said too, and the table's columns are of
    # the traces that hold it (each label heads a column once per table)
    r3 = _types(("kda", None, 9, 20.0))
    html = write_report(tmp_path / "r3.html", {"r0": r0, "r1": r1, "r2": r2, "r3": r3}, "t",
                        plotly_js="cdn").read_text()
    assert "Typical mlp layer (only in r0, r1, r2)" in html
    table = html.split("Typical mlp layer", 1)[1].split("</table>", 1)[0]
    assert [f"<th>{r} " in table for r in ("r0", "r1", "r2", "r3")] == [True, True, True, False]


def test_a_type_only_a_has_shows_none_of_bs(tmp_path):
    """A's A and B against B's A, which has A's B's kernels: the pair is B = A, and A's A
    has no counterpart, in the table, the typical layers and the JSON."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main

    a = _types(("A", "d1", 3, 5.0), ("B", "d2", 4, 7.0))
    b = _types(("A", "d2", 4, 7.5))
    rows = compare(a, b)
    assert [(r.label, r.name_a, r.name_b) for r in rows[:2]] == [
        ("A", "A", None), ("B = A", "B", "A")]
    for name, doc in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc.to_json()))
    out = CliRunner().invoke(main, ["compare", str(tmp_path / "a.json"),
                                    str(tmp_path / "b.json"), "--kernels", "--format", "json"])
    typical = json.loads(out.output)["typical_layers"]
    assert typical["A"]["b"] is None and typical["B = A"]["b"]["kernels"][0]["name"] == "Ad2"


def test_breakdowns_stored_before_digests_pair_by_name():
    """An older stored breakdown has letters without digests: against a new one, by name."""
    from kimi_perf.comparison import pair_layer_types

    old = _types(("A", None, 3, 5.0), ("B", None, 4, 7.0))
    new = _types(("A", "d1", 3, 5.0), ("B", "d2", 4, 7.0))
    assert pair_layer_types(old, new) == [("A", "A"), ("B", "B")]


def test_a_letter_paired_with_a_type_that_keeps_no_sequence_is_marked():
    """A breakdown stored before kernel sequences were kept: its A pairs by letter with the
    other side's pattern type A, another model's layer of twice the kernels, marked * (it read
    1.33x unmarked), in the table, the notes and the summary line; types of kept sequences
    alike stay unmarked."""
    from kimi_perf.comparison import comparison_notes
    from kimi_perf.render import comparison_headline

    ranges = _types(("A", None, 11, 1919.3))
    pattern = _types(("A", "d1", 22, 1447.1))
    rows = compare(ranges, pattern)
    assert rows[0].label == "A" and rows[0].marked and rows[0].by_letter
    assert not rows[0].pattern_differs   # (no sequence of A's to differ)
    assert rows[0].to_json()["paired_by_letter"] is True
    notes = comparison_notes(rows, "A", "B")
    assert "* A: paired by letter alone, one side keeping no kernel sequence (a breakdown " \
        "stored before sequences were kept): it may be another layer there" in notes
    assert not any(n.startswith("* lettered by its kernel sequence") for n in notes)
    assert comparison_headline(rows, "A", "B").startswith("A *: 11 kernels")
    assert not compare(pattern, _types(("A", "d1", 22, 1400.0)))[0].marked
    assert not compare(ranges, _types(("A", None, 11, 1900.0)))[0].marked
    # in the table of every trace too (three traces)
    from kimi_perf.comparison import differing_patterns, overview

    assert differing_patterns(overview({"a": pattern, "b": ranges, "c": pattern})) == ["A"]
    assert differing_patterns(overview({"a": pattern, "b": pattern, "c": pattern})) == []



ATTENTION_LAYER = ["rms_norm", "qkv_gemm", "flash_attn_fwd", "o_proj_gemm"]
MOE_LAYER = ["rms_norm", "topk_router", "fused_moe_kernel", "moe_combine"]


def _untyped_layers(kinds: list[list[str]], steps: int = 3) -> Breakdown:
    """Steps of layer ranges that name no type (``layer[3]``), each running its kernels
    (an MoE layer's four times as long as an attention layer's)."""
    b = TraceBuilder()
    for s in range(steps):
        step_start = b.clock
        for i, kernels in enumerate(kinds):
            start, end = b.sequence(kernels, duration=4000 if "fused_moe_kernel" in kernels
                                    else 1000)
            b.range(f"layer[{i}]", start - 10, end)
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    return breakdown(b.build())


def test_layer_ranges_that_name_no_type_pair_by_their_kernel_sequence_not_their_letter():
    """Layer ranges that name no type (layer[3]; vLLM's layerwise module ranges) are lettered
    by their kernels in order of first appearance: two traces that meet their attention and
    MoE layers in another order pair like with like by their sequences' digests (A paired with
    A set an attention layer against an MoE one, 0.23x, unmarked); a sequence that changed (a
    norm fused into the GEMM) is marked *. No note of the kernel pattern's is said of them,
    nor does the gate take their kernels for moved by the pattern."""
    from kimi_perf.gate import _moved
    from kimi_perf.layer_breakdown import lone_types_note, outsized_types_note

    a = _untyped_layers([ATTENTION_LAYER, MOE_LAYER] * 2)
    assert [t["type"] for t in a.layer_types] == ["A", "B"]
    assert all(t["pattern"] for t in a.layer_types)
    rows = compare(a, _untyped_layers([MOE_LAYER, ATTENTION_LAYER] * 2))
    assert [(r.label, r.span_ratio, r.marked) for r in rows[:2]] == [
        ("A = B", 1.0, False), ("B = A", 1.0, False)]
    fused = compare(a, _untyped_layers([["fused_norm_qkv_gemm", *ATTENTION_LAYER[2:]],
                                        MOE_LAYER] * 2))
    assert [(r.label, r.pattern_differs, r.marked) for r in fused[:2]] == [
        ("A", True, True), ("B", False, False)]
    # one step of two types of one layer each; one type 10x the other's kernels
    assert lone_types_note(_untyped_layers([ATTENTION_LAYER, MOE_LAYER], steps=1)) is None
    assert outsized_types_note(_untyped_layers([ATTENTION_LAYER] * 3 + [MOE_LAYER * 10])) \
        is None
    # the norm moved from the MoE layer's range to the end of the attention layer's: a change
    # of the ranges, not of where a pattern cut
    moved = _untyped_layers([[*ATTENTION_LAYER, "rms_norm"], MOE_LAYER[1:]] * 2)
    assert _moved(a, moved, [("A", "A"), ("B", "B")]) == set()


def test_work_in_no_step_says_whether_it_was_launched_outside_or_never_seen_launched():
    """A CUDA-graph trace whose replayed kernels have no launch record: they are in no step,
    and the note says the trace cannot place them, not that they were launched elsewhere."""
    import gzip

    from kimi_perf.layer_breakdown import step_notes

    path = KINETO / "hta_trace_diff_test_v100_rank1_cudagraph.json.gz"
    # from the JSON itself: GPU ops whose correlation no runtime call holds (614, 56517 µs)
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    launches = {e["args"].get("correlation") for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    unlaunched = [e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy",
                                                               "gpu_memset")
                  and e.get("args", {}).get("correlation") not in launches]
    b = breakdown(read_trace(path))
    outside = b.source["outside_steps"]
    assert outside["ops"] == outside["unlaunched"] == len(unlaunched) > 0
    assert f"{len(unlaunched)} more GPU ops ({sum(unlaunched):.1f} µs) ran in no step: the " \
           "trace holds no launch to place them by" in step_notes(b)
    b.source["outside_steps"] = {"ops": 10, "kernel_us": 1.0, "unlaunched": 4}
    assert "10 more GPU ops (1.0 µs) ran in no step: 6 launched outside every step's range, 4 " \
           "with no launch in the trace" in step_notes(b)
    del b.source["outside_steps"]["unlaunched"]          # stored before it was counted
    assert "10 more GPU ops (1.0 µs) ran in no step: launched outside every step's range" \
        in step_notes(b)


def test_steps_without_layers_say_why():
    """Neither a layer range nor a repeating kernel pattern in any step: the '0 (none)' in
    the layers column comes with the reason and what to do; a trace with layers says
    nothing of it."""
    from kimi_perf.layer_breakdown import step_notes

    none = breakdown(read_trace(KINETO / "hta_a100_80gb_rank0_cudagraph_triton.json.gz"))
    assert {s["layer_source"] for s in none.steps} == {"none"}
    said = [n for n in step_notes(none) if n.startswith("no layers found")]
    assert said and "--layers nvtx:REGEX" in said[0]
    vllm = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x"
                                         ".json.gz"))
    assert not [n for n in step_notes(vllm) if n.startswith("no layers found")]


def test_the_layers_column_says_ranges_of_nvtx_and_record_function_layers_alike(tmp_path):
    """Layers from ranges read "(ranges)", a PyTorch-profiler trace's record_function ranges
    as an nsys trace's NVTX ranges (not "(nvtx)" of a trace that has no NVTX)."""
    from kimi_perf.layer_breakdown import layers_text

    def annotation(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur,
                "pid": 1, "tid": 1}
    events = [annotation("ProfilerStep#1", 0, 100)]
    for i in range(2):
        events += [annotation(f"layer[{i}]", 10 + 40 * i, 30),
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                    "ts": 12 + 40 * i, "dur": 2, "pid": 1, "tid": 1,
                    "args": {"correlation": i + 1}},
                   {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 15 + 40 * i, "dur": 5,
                    "pid": 0, "tid": 7, "args": {"device": 0, "stream": 7,
                                                 "correlation": i + 1}}]
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"traceEvents": events}))
    kineto = breakdown(read_trace(path))
    assert [(s["layers"], s["layer_source"]) for s in kineto.steps] == [(2, "nvtx")]
    assert layers_text(kineto.steps[0]) == "2 (ranges)"
    assert layers_text({"layers": 24, "layer_source": "repeat"}) == "24 (repeat)"
    assert layers_text({"layers": 3}) == "3" and layers_text({}) == "-"


def test_work_in_no_step_names_where_it_ran_in_no_range_too():
    """A benchmark whose steps are its 'Forward' ranges: of the work outside them, 659 ops
    ran in its 'Run Benchmark' range and 7,235 (the backward passes' autograd thread) in no
    range at all; the note accounts for every one."""
    import sqlite3

    from kimi_perf.layer_breakdown import step_notes

    path = NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"
    # from the export itself: each GPU op's launch, outside every 'Forward' range of its
    # thread, by the outermost range of that thread around it
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        outside = dict((name, (ops, ns)) for name, ops, ns in db.execute("""
            WITH ops AS (
              SELECT start, end, correlationId, globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL
              UNION ALL SELECT start, end, correlationId, globalPid
                FROM CUPTI_ACTIVITY_KIND_MEMCPY
              UNION ALL SELECT start, end, correlationId, globalPid
                FROM CUPTI_ACTIVITY_KIND_MEMSET),
            launched AS (
              SELECT o.end - o.start AS ns, r.start AS t, r.globalTid AS tid FROM ops o
              JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = o.correlationId
               AND r.globalTid / 16777216 = o.globalPid / 16777216),
            ranges AS (
              SELECT COALESCE(n.text, s.value) AS name, n.start, n.end, n.globalTid
              FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId
              WHERE n.eventType = 59)
            SELECT (SELECT name FROM ranges g WHERE g.globalTid = l.tid AND g.start <= l.t
                    AND l.t <= g.end ORDER BY g.start LIMIT 1), COUNT(*), SUM(ns)
            FROM launched l WHERE NOT EXISTS (
              SELECT 1 FROM ranges g WHERE g.name = 'Forward' AND g.globalTid = l.tid
              AND g.start <= l.t AND l.t <= g.end)
            GROUP BY 1"""))
    assert set(outside) == {"Run Benchmark", None}
    ops = sum(n for n, _ in outside.values())
    us = sum(ns for _, ns in outside.values()) / 1000
    b = breakdown(read_trace(path), step_regex="^Forward$")
    assert (f"{ops} more GPU ops ({us:.1f} µs) ran in no step: launched outside every step's "
            f"range (in 'Run Benchmark' {outside['Run Benchmark'][0]}; in no range "
            f"{outside[None][0]})") in step_notes(b)


def test_a_step_range_holding_other_step_ranges_is_said():
    """--steps Forward also matches the benchmark's 'Benchmark Forward Only', which holds ten
    of the 'Forward' ranges: a step of the 20 kernels between them, said in a note; the
    anchored regex the note suggests leaves it out."""
    from kimi_perf.layer_breakdown import step_notes

    trace = read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite")
    loose = breakdown(trace, step_regex="Forward")
    assert len(loose.steps) == 16
    assert loose.source["enclosing_steps"] == [
        {"step": "Benchmark Forward Only", "index": 5, "device": 0, "encloses": 10, "ops": 20}]
    assert any(n.startswith("1 step ('Benchmark Forward Only') is a range holding 10 other "
                            "step ranges: it counts only the 20 GPU ops between them (its "
                            "span, first to last, takes in theirs")
               for n in step_notes(loose))
    anchored = breakdown(trace, step_regex="^Forward$")
    assert len(anchored.steps) == 15 and anchored.source["enclosing_steps"] == []
    assert not any("other step ranges" in n for n in step_notes(anchored))


def test_an_enclosing_step_on_two_devices_is_one_note():
    """An outer range the step regex matches, holding two inner step ranges and launching on
    two GPUs after them: one step per device, one entry of what it holds (its ops on both
    devices)."""
    b = TraceBuilder()
    b.clock = 1000
    outer_start = b.clock
    for i in range(2):
        start = b.clock
        b.sequence(["gemm_a", "gemm_b"])
        b.range(f"Forward {i}", start - 5, b.clock)
        b.clock += 500
        t = b.clock                                  # after each inner range, on GPU i
        b.launch("gemm_other", t, t + 50, t + 200, t + 1200, device=i)
        b.clock += 2000
    b.range("Benchmark Forward", outer_start - 10, b.clock)
    got = breakdown(b.build(), step_regex="Forward")
    assert sorted(s["name"] for s in got.steps) == [
        "Benchmark Forward", "Benchmark Forward", "Forward 0", "Forward 1"]
    (entry,) = got.source["enclosing_steps"]
    assert (entry["step"], entry["encloses"], entry["ops"]) == ("Benchmark Forward", 2, 2)


def test_stretches_the_pattern_did_not_cut_are_said_not_to_be_layers():
    """jsun's one window (each device one step): the pattern's D holds 1,735 kernels and E
    1,513 a layer, where a median layer holds about 20: whole stretches of a training step,
    which the notes say are no layers; cut by its forward passes, no type is outsized, nor
    in the vLLM decode step, whose two layer types are real layers."""
    from kimi_perf.layer_breakdown import OUTSIZED, layer_notes

    path = NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"
    jsun = breakdown(read_trace(path))
    median = float(np.median(layer_column(jsun.layers, "kernels")))
    big = [t["type"] for t in jsun.layer_types if t["kernels"] >= OUTSIZED * median]
    assert big == ["D", "E"]
    (note,) = [n for n in layer_notes(jsun) if "stretches of work" in n]
    assert note.startswith(f"types found by the kernel pattern hold 10× the kernels of a "
                           f"median layer ({median:g}) or more: D (1 layer of 1735), E (4 "
                           "layers of 1513)")
    forward = breakdown(read_trace(path), step_regex="^Forward$")
    vllm = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x"
                                         ".json.gz"))
    for b in (forward, vllm):
        assert b.layers and not any("stretches of work" in n for n in layer_notes(b))


def test_a_kernel_whose_time_spreads_over_the_layers_shows_its_spread():
    """GPT-OSS's attention in a mixed step: 12 layers at about 130 µs (sliding window) and 12
    at about 300 (full): the typical layer's median (288) is of the upper group alone, so its
    10th and 90th percentile come with it, in the table and the report; a steady kernel, a
    spread under a µs, or under 4 layers gets none."""
    from rich.console import Console

    from kimi_perf import render
    from kimi_perf.layer_breakdown import SPREAD_NOTE, kernel_spreads
    from kimi_perf.render import typical_layer_table
    from kimi_perf.trace import json_text

    # (the last kernel 1.6x as long in half the layers, but 0.6 µs longer: under a µs)
    ns = np.array([[1000, 130_000, 5000, 1000, 1000]] * 12
                  + [[1000, 300_000, 5000, 1400, 1600]] * 12)
    assert kernel_spreads(ns) == [None, [130.0, 300.0], None, None, None]
    assert kernel_spreads(ns[:, :4] * 2)[3] is None and kernel_spreads(ns * 2)[4] == [2.0, 3.2]
    assert kernel_spreads(ns[10:13]) == [None] * 5
    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_prefilldecode_piecewise_mi300x"
                                      ".json.gz"))
    (t,) = b.layer_types
    kernels = t["typical_layer"]["kernels"]
    (attention,) = [k for k in kernels if k["name"] == "kernel_unified_attention_2d"]
    low, high = attention["spread_us"]
    assert low < 140 < 280 < attention["us"] <= high < 320
    assert "spread_us" not in kernels[0]   # the first norm: steady
    buf = io.StringIO()
    render.print_tables([typical_layer_table("A", {"": t})], Console(file=buf, width=200))
    text = " ".join(buf.getvalue().split())
    assert f"{attention['us']:.1f} ({low:.1f}-{high:.1f})" in text
    assert " ".join(SPREAD_NOTE.split()) in text
    again = Breakdown.from_json(json.loads(json_text(b.to_json())))   # kept as stored
    assert again.layer_types[0]["typical_layer"]["kernels"] == kernels


def test_a_profile_of_graph_captures_alone_says_what_it_is():
    """vLLM's capture profiled apart: 1 capture, no replay, said (for --capture); the decode
    trace that replays it, a training window whose last launches ran nothing (no capture
    begun: the profiler's edge) and the replay joined by its capture say nothing of it."""
    from kimi_perf.layer_breakdown import step_notes

    capture = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_capture_bs32_mi300x.json.gz"
    alone = breakdown(read_trace(capture))
    assert alone.source["graph_captures"] == 1
    assert any(n.startswith("records 1 graph capture and replays none") and "--capture joins"
               in n for n in step_notes(alone))
    replay = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
    for trace in (read_trace(replay), read_trace(replay, capture=capture),
                  read_trace(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite")):
        b = breakdown(trace)
        assert "graph_captures" not in b.source
        assert not any("replays none" in n for n in step_notes(b))


def test_steps_per_device_name_the_ranges_that_could_be_the_steps():
    """A training trace without a step range the defaults know: each device is one step, and
    the note names the repeating range that holds most kernels (not the ranges inside
    layers, which hold a few each), for --steps; a vLLM trace's steps are its ranges."""
    from kimi_perf.layer_breakdown import step_notes

    jsun = breakdown(read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"))
    assert jsun.source["steps_found_by"] == "device"
    assert jsun.source["repeating_ranges"] == [
        {"range": "Forward", "instances": 15, "kernels": 10380}]
    assert any("each device is one step; ranges that repeat: 'Forward' ×15 (10380 kernels, "
               "copies and fills aside): --steps '^Forward$' takes them as the steps" in n
               for n in step_notes(jsun))
    # the steps it makes count the copies and fills too: 10380 kernels and 540 of those
    steps = breakdown(read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3"
                                 ".sqlite"), step_regex="^Forward$").steps
    assert len(steps) == 15 and sum(s["kernels"] for s in steps) == 10380 + 540
    # the benchmark's 'measure|forward' and 'warmup|forward' each ran twice, but each time
    # within itself (a wrapper's range around the model's of one name): once each, no steps
    # a ProfilerStep#1 on a thread that launched nothing (its duration 13 s) is no step
    example = breakdown(read_trace(KINETO / "hta_a100_triton_example.json.gz"))
    assert example.source["steps_found_by"] == "device" and any(
        "ProfilerStep#) around launches of GPU work, and no graph launches: each device is "
        "one step" in n for n in step_notes(example))
    alexnet = breakdown(read_trace(KINETO / "hta_a100_alexnet_cuda_sync.json.gz"))
    assert alexnet.source["repeating_ranges"] == []
    assert not any("ranges that repeat" in n for n in step_notes(alexnet))
    inner = breakdown(read_trace(
        NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite"))
    assert inner.source["repeating_ranges"] == []      # 'computing softmax' ×128 is no step
    assert any(n.endswith("(final norm, LM head, embedding) (--steps REGEX takes ranges of "
                          "your own)") for n in step_notes(inner))
    vllm = breakdown(read_trace(
        KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    assert vllm.source["steps_found_by"] == "range" and vllm.source["repeating_ranges"] == []
    assert not any("each device is one step" in n for n in step_notes(vllm))


def test_a_range_nested_in_one_of_its_name_is_no_second_instance():
    """'forward' twice on one thread, the first holding another 'forward' (a wrapper's
    range around the model's), and twice on a second thread, one of them at the time of
    the first thread's second (nesting is per thread): 4 instances, not 5; a range that
    only overlaps one of its name still counts."""
    from kimi_perf.layer_breakdown import repeating_ranges
    from kimi_perf.trace import GPU_RANGE

    b = TraceBuilder()
    spans = []
    for tid in (1, 1, 2):
        start = b.clock
        b.sequence(["gemm", "add"], tid=tid)
        b.range("forward", start, b.clock, tid=tid)
        spans.append((start, b.clock))
    b.range("forward", spans[0][0] + 1, spans[0][1] - 1, tid=1)   # the wrapper's, inside
    b.range("forward", spans[1][0] + 1, spans[1][1] - 1, tid=2)   # another thread's: apart
    (row,) = repeating_ranges(b.build())
    assert row["range"] == "forward" and row["instances"] == 4
    b.range("forward", spans[2][1] - 10, spans[2][1] + 10, tid=2)  # overlaps one's end
    (row,) = repeating_ranges(b.build())
    assert row["instances"] == 5
    # a profiler's GPU-side copies of the ranges (Kineto's gpu_user_annotation) are none
    for start, end in spans:
        b.range("forward", start + 200, end + 200, style=GPU_RANGE)
    (row,) = repeating_ranges(b.build())
    assert row["instances"] == 5


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=12), st.integers(0, 11))
def test_rotations_against_brute_force(cycle, shift):
    """least_rotation starts the least rotation; rotation finds b as a cut r later (the
    first such r), None for anything else; aligned_typical shows b in a's order."""
    from kimi_perf.comparison import aligned_typical, rotation
    from kimi_perf.layer_breakdown import least_rotation

    n = len(cycle)
    rotations = [cycle[r:] + cycle[:r] for r in range(n)]
    assert rotations[least_rotation(cycle)] == min(rotations)
    r = shift % n
    b = cycle[r:] + cycle[:r]
    found = rotation(cycle, b)
    assert found == next(s for s in range(n) if rotations[s] == b)
    assert rotation(cycle, b[:-1]) is None and rotation(cycle, [*b, "a"]) is None
    if "c" in cycle:
        assert rotation(cycle, [x if x != "c" else "d" for x in b]) is None
    kernels = [{"name": x, "us": float(i)} for i, x in enumerate(b)]
    typical = {"A": {"kernels": [{"name": x, "us": 0.0} for x in cycle]},
               "B": {"kernels": kernels, "layers": 3}}
    shown, shifts = aligned_typical(typical)
    assert [k["name"] for k in shown["B"]["kernels"]] == cycle and shown["B"]["layers"] == 3
    assert sorted(k["us"] for k in shown["B"]["kernels"]) == [float(i) for i in range(n)]
    assert shifts == ({"B": found} if found else {}) and shown["A"] is typical["A"]


def test_two_empty_sequences_are_the_same_not_rotations_of_nothing():
    """Two empty kernel sequences are the same sequence (0), as its docstring says; an empty
    one against one kernel is no rotation."""
    from kimi_perf.comparison import rotation

    assert rotation([], []) == 0 and rotation([], ["a"]) is None and rotation(["a"], []) is None


def test_a_cycle_cut_elsewhere_is_the_same_layer_type():
    """The two windows of a real before/after pair cut the same DiT block 8 kernels apart
    (its >1 ms attention kernel is #8 of the block before, #157 of 157 after): one digest, and
    the tables show the run's block in the baseline's order, saying so."""
    from kimi_perf.comparison import aligned_typical, rotation
    from kimi_perf.render import typical_layer_table

    before, after = (breakdown(read_trace(NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{x}"
                                                 ".sqlite")) for x in ("before", "after"))
    ta, tb = (next(t for t in b.layer_types if t["type"] == "A") for b in (before, after))
    names = [[k["name"] for k in t["typical_layer"]["kernels"]] for t in (ta, tb)]
    assert names[0] != names[1] and rotation(*names) == 8
    assert ta["pattern"] == tb["pattern"]
    flash = [next(i for i, k in enumerate(t["typical_layer"]["kernels"]) if k["us"] > 1000)
             for t in (ta, tb)]
    assert flash == [7, 156]
    table = typical_layer_table("A", {"before": ta, "after": tb})
    assert ("after: the same layer with its boundary 8 kernels later in the cycle (at "
            "before's #9); its rows are shown in before's order") in table.caption
    shown = aligned_typical({"before": ta["typical_layer"],
                                     "after": tb["typical_layer"]})[0]
    assert [k["name"] for k in shown["after"]["kernels"]] == names[0]
    assert shown["after"]["kernels"][7]["us"] > 1000


def test_steps_mostly_copies_are_said():
    """A 2-GPU inference window that is mostly host-to-device copies: per device 463 of its
    2,184 ops are memcpy/memset (SQLite: CUPTI_ACTIVITY_KIND_MEMCPY and _MEMSET rows), and
    they take 98% of the time the kernel columns sum; a note says the columns hold them."""
    import sqlite3

    from kimi_perf.layer_breakdown import step_notes

    path = NSYS / "nsysai_fastvideo_wan2.1_t2v_inference_2xh100_1s.sqlite"
    with sqlite3.connect(path) as db:
        counts = {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                  for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                            "CUPTI_ACTIVITY_KIND_MEMSET")
                  if db.execute("SELECT count(*) FROM sqlite_master WHERE name = ?",
                                (t,)).fetchone()[0]}
    memops = counts["CUPTI_ACTIVITY_KIND_MEMCPY"] + counts.get("CUPTI_ACTIVITY_KIND_MEMSET", 0)
    b = breakdown(read_trace(path))
    # every op of the window is in its device's step: the export's kernels and memops
    assert sum(s["kernels"] for s in b.steps) == sum(counts.values())
    assert memops == 926 and sum(counts.values()) == 4368   # (the figures the note says)
    assert ("98% of the steps' kernel µs is copies and fills (926 of 4368 ops, class memcpy; "
            "most in device 0 (98% of its kernel µs), device 1 (98%)): the kernel columns count "
            "memcpy and memset operations with the kernels") in step_notes(b)
    vllm = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x"
                                         ".json.gz"))
    assert not any("copies and fills" in n for n in step_notes(vllm))
    # a few copies, a small share: counted all the same, and said (info counts them apart:
    # 425 kernels and 9 memcpy/memset ops; the steps' column 434)
    summary = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x"
                                  ".json.gz").summary()
    assert (summary["kernels"], summary["memops"]) == (425, 9)
    assert ("the kernel columns count memcpy and memset operations with the kernels: 9 of the "
            "steps' 434 ops (under 1% of their kernel µs), class memcpy") in step_notes(vllm)


def test_a_trace_and_its_breakdown_show_as_one_line_each():
    # A notebook shows what it holds, not the string table (thousands of names) or every
    # layer's dict.
    trace = read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite")
    text = repr(trace)
    assert text == ("Trace(zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite, "
                    "nsys-sqlite, NVIDIA Nsight Systems 2024.6.2.225: 7,328 kernels, 294 memops, "
                    "516 ranges, 9,493 API calls, GPUs: NVIDIA A100-SXM4-80GB)")
    assert repr(trace.kernels) == "Kernels(7,328 rows)"
    b = breakdown(trace)
    assert repr(b) == ("Breakdown(zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2"
                       ".sqlite: 4 steps, 128 layers (A ×128), counting kernels)")
    assert repr(b.layers) == "LayerRows(128 layers of types A)"
    many = read_trace(KINETO / "hta_a100_alexnet_cuda_sync.json.gz")
    assert repr(many).endswith("GPUs: 8× NVIDIA A100-PG509-200)")
    unnamed = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")
    assert repr(unnamed).endswith("GPUs: 8× unnamed)")   # (ROCm's, by SM count alone)
    sparse = Breakdown(source={}, steps=[], layers=[], layer_types=[{"type": "A"}])
    assert repr(sparse) == "Breakdown(0 steps, 0 layers (A ×?), counting kernels)"
    one = Breakdown(source={}, steps=[{}], layers=[{}], layer_types=[])
    assert repr(one) == "Breakdown(1 step, 1 layer, counting kernels)"


def test_a_run_document_read_as_one_breakdown_says_how_to_read_it(tmp_path):
    doc = {"schema": 1, "run": {}, "paths": {"standard": {}, "specialized": {}}}
    with pytest.raises(TraceError, match=r"a run's breakdown.json.*doc\['paths'\]\[path\]"):
        Breakdown.from_json(doc, tmp_path / "breakdown.json")


def test_no_name_the_package_exports_hides_one_of_its_modules():
    # `import kimi_perf.X as m` gives the package's attribute X: were X also a function, the
    # module (and what only it holds) would be out of reach that way.
    import pkgutil

    import kimi_perf

    modules = {m.name for m in pkgutil.iter_modules(kimi_perf.__path__)}
    assert {"layer_breakdown", "comparison"} <= modules
    assert not modules & set(kimi_perf.__all__)


def test_rules_may_be_given_as_their_toml_file(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nclass = "mine"\npattern = "gemv|gemm|matmul|Kernel"\n')
    trace = read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite")
    by_file, by_list = (breakdown(trace, rules=r) for r in (rules, load_rules(rules)))
    assert by_file.to_json() == by_list.to_json()
    assert "mine" in by_file.layer_types[0]["classes"]


@pytest.mark.parametrize(("trace", "pattern"), [
    ("examples/vllm_gptoss20b_decode_fullgraph_mi300x.json.gz", "attn|attention|fmha|flash"),
    ("nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite", "flash")])
def test_a_class_of_ones_own_relabels_kernels_and_leaves_the_layers_alone(tmp_path, trace,
                                                                         pattern):
    """A rule naming a class of its own (the reference's ``kda``) moves the attention kernels out of
    "attention": the repeating pattern's cuts, which look for attention, stay where the
    shipped classes put them (they halved the example's 24 layers into 12, and cut the wan
    training step's 157-kernel layer into fragments)."""
    rules = tmp_path / "rules.toml"
    rules.write_text(f'[[rule]]\nclass = "mine"\npattern = "{pattern}"\n')
    source = REPO / "kimi_perf" / trace if trace.startswith("examples") else NSYS / trace
    plain, own = (breakdown(read_trace(source), rules=r) for r in (None, rules))
    shape = [(t["type"], t["layers"], t["kernels"], t["span_us"]) for t in plain.layer_types]
    assert shape == [(t["type"], t["layers"], t["kernels"], t["span_us"])
                     for t in own.layer_types]
    assert all("attention" in t["classes"] for t in plain.layer_types)
    for before, after in zip(plain.layer_types, own.layer_types, strict=True):
        assert after["classes"]["mine"]["us"] > 0
        assert after["classes"].get("attention", {}).get("kernels", 0) < before["classes"][
            "attention"]["kernels"]


def test_a_rule_naming_a_shipped_class_reaches_the_layer_finder(tmp_path):
    """A kernel no default rule knows, said by a user's rule to attend, attends for the layer
    finder too; one relabelled to a class of one's own keeps its shipped class there."""
    from kimi_perf.classify import layout_class_name

    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nclass = "attention"\npattern = "my_fused_op"\n'
                     '[[rule]]\nclass = "kda"\npattern = "kda"\n')
    loaded = load_rules(rules)
    assert classify_name("my_fused_op_kernel", default_rules()) == "other"
    assert layout_class_name("my_fused_op_kernel", loaded) == "attention"
    assert classify_name("fused_recurrent_kda_fwd_kernel", loaded) == "kda"
    assert layout_class_name("fused_recurrent_kda_fwd_kernel", loaded) == "attention"
    assert layout_class_name("nccl_allreduce", loaded) == "communication"
    # a list of one's own (the library's rules=[...]), without the defaults: a kernel none
    # of it matches keeps its shipped class there, not "other"
    from kimi_perf.classify import Rule, layout_rules_said, rules_said

    custom = [Rule("mine", re.compile("gemm"))]
    assert classify_name("flash_fwd_kernel", custom) == "other"
    assert layout_class_name("flash_fwd_kernel", custom) == "attention"
    assert layout_class_name("gemm_qkv", custom) == "gemm"
    # what the gate compares: the extra rules that may move cuts (naming a shipped class)
    rules.write_text('[[rule]]\nclass = "kda"\npattern = "kda"\n')
    own = load_rules(rules)
    assert layout_rules_said(own) == "default" != rules_said(own)
    rules.write_text('[[rule]]\nclass = "attention"\npattern = "my_fused_op"\n')
    assert layout_rules_said(loaded) == rules_said(load_rules(rules)) != "default"
    assert layout_rules_said(custom) == rules_said(custom) != "default"


def test_json_text_is_json_dumps_text_and_escapes_what_json_escapes():
    """The JSON writer (msgspec under the hood) gives json.dumps(indent=1)'s text for what
    breakdowns hold, escapes names that are not ASCII as json does, and takes a str subclass
    (torch's version) as json does."""
    import json

    from kimi_perf.trace import json_text

    class Version(str):
        pass

    doc = {"schema": 1, "rows": [{"name": "void k<float>(int)", "us": 12.5, "n": 3,
                                  "none": None, "ok": True, "empty": [], "map": {}}],
           "version": Version("2.13.0+cpu"), "big": 2**70}
    assert json_text(doc) == json.dumps(doc, indent=1) + "\n"
    named = {"name": "k\u202eevil", "unit": "µs", "emoji \U0001f600": ["é"]}
    assert json_text(named) == json.dumps(named, indent=1) + "\n"
    assert "\\u202e" in json_text(named) and "\\ud83d\\ude00" in json_text(named)
    others = {"float64": np.float64(1.5), "by number": {1: "a", 2: "b"}}
    assert json_text(others) == json.dumps(others, indent=1) + "\n"
    assert json.loads(json_text({"x": 1e-7})) == {"x": 1e-7}
    assert json.loads(json_text({"x": float("nan")})) == {"x": None}   # valid JSON
    with pytest.raises(TypeError):
        json_text({"path": object()})


def test_a_log_softmax_is_no_attention_and_a_sort_no_router():
    """A training loss's log-softmax (jsun's cunn_SoftMaxForward with LogSoftMax's epilogue)
    is elementwise and its sort is other; an attention softmax (Wan2.1's eager DiT
    attention) stays attention."""
    from kimi_perf.classify import classify, load_rules

    names = ["void at::native::<unnamed>::cunn_SoftMaxForwardSmem<(int)4, float, float, "
             "float, at::native::<unnamed>::LogSoftMaxForwardEpilogue>(T4 *, const T2 *, T3)",
             "void at::native::<unnamed>::nll_loss_forward_reduce_cuda_kernel_2d<float, float, "
             "long>(T1 *, T1 *, const T1 *, const T2 *, const T1 *, bool, long, long, long)",
             "void at_cuda_detail::cub::DeviceRadixSortSingleTileKernel<at_cuda_detail::cub::"
             "DeviceRadixSortPolicy<long, long, int>::Policy900, false, long, long, int>",
             "void <unnamed>::softmax_warp_forward<float, float, float, (int)6, (bool)0, "
             "(bool)0>(T2 *, const T1 *, int, int, int, const bool *, int, bool)"]
    classes, labels = classify(np.arange(len(names)), names, load_rules())
    assert [labels[c] for c in classes] == ["elementwise", "elementwise", "other", "attention"]


def test_recommender_and_conv_kernels_are_no_moe_and_no_gemm():
    """Words inside other names: fbgemm_gpu's kernels (its namespace holds "gemm") are not
    GEMMs, nor is an embedding bag that takes fbgemm_gpu::FixedDivisor; its permutes of
    sparse features (pooled embeddings: no pooling) and a cutlass convolution's Permute
    iterators are no MoE token permute, which vLLM's, SGLang's and TransformerEngine's still
    are (the convolution is conv). TensorRT-LLM's MoE finalize is no routing, and DeepEP's
    dispatch is communication."""
    from kimi_perf.classify import classify, load_rules

    names = {
        "void fbgemm_gpu::_offsets_range_cuda_kernel<long>(long, long, long const*, long*)":
            "other",
        "void split_embedding_codegen_forward_unweighted_kernel<float, float, float, false, "
        "long, 1ul, 16ul>(at::GenericPackedTensorAccessor<float, 1ul, at::RestrictPtrTraits, "
        "long>, fbgemm_gpu::FixedDivisor)": "elementwise",
        "void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*, int const*, "
        "int*)": "other",
        "void permute_pooled_embs_kernel<float>(float const*, long const*, long const*, long "
        "const*, float*, long, long, long)": "other",
        "_ZN19cutlass_cudnn_train6KernelINS_4conv6kernel23ImplicitGemmConvolutionINS1_11thread"
        "block22ImplicitGemmMultistageINS_4gemm9GemmShapeILi128ELi128ELi32EEENS4_20Permute"
        "EEEEEvNT_6ParamsE": "conv",
        "void vllm::moe::moe_permute_kernel<c10::BFloat16>(c10::BFloat16 const*)": "moe",
        "_permute_tokens_kernel": "moe",
        "ep_unpermute_kernel": "moe",
        "_permute_kernel": "moe", "_unpermute_bwd_with_merging_probs_kernel": "moe",  # TE's
        "unpermute_kernel": "other",              # llm.c's attention backward: no MoE
        "void tensorrt_llm::kernels::expandInputRowsKernel<__nv_bfloat16>(int)": "moe",
        "void tensorrt_llm::kernels::finalizeMoeRoutingKernel<float>(int)": "moe",
        "pre_reorder_triton_kernel": "moe", "post_reorder_triton_kernel": "moe",  # SGLang's
        "void deep_ep::intranode::dispatch<8, 768>(int4*)": "communication",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn>("
        "Params)": "gemm",
    }
    classes, labels = classify(np.arange(len(names)), list(names), load_rules())
    assert [labels[c] for c in classes] == list(names.values())


def test_the_report_lists_the_steps_of_a_trace_without_layers(tmp_path):
    """A trace where no layer is found still has its figures in the report: its first steps,
    each as breakdown's table has it, and their median; the steps past those are counted."""
    from kimi_perf.report import write_report

    b = TraceBuilder()
    for i in range(23):
        start = b.clock
        b.sequence(["gemm_a", "<elementwise>"], duration=1000 + 100 * (i % 3))
        b.range(f"decode_step[{i}]", start, b.clock)
    result = breakdown(b.build())
    assert not result.layer_types and len(result.steps) == 23
    page = write_report(tmp_path / "r.html", {"synthetic": result}, "t",
                        plotly_js="cdn").read_text()
    steps = page[page.index("<h2>Steps</h2>"):]
    assert steps.count("<td class=name>decode_step[") == 20
    assert "<td class=name>decode_step[19]</td>" in steps and "decode_step[20]" not in steps
    assert "median of 23 steps (each column's own)</th><td>2</td><td>2.2</td>" in steps
    assert "and 3 more steps (kimi-perf breakdown lists them)." in steps


@pytest.mark.parametrize("stored", [False, True])
def test_layers_are_written_to_json_in_chunks_as_the_whole_document(stored):
    """`breakdown --format json` and a run's breakdown.json write the layers a chunk at a
    time (a million-kernel trace's layers as dicts all at once would take some 90 MB): the
    text is exactly the document's, at any chunk size and depth, from columns or from a
    stored list, names beyond ASCII escaped as in the whole."""
    from kimi_perf.render import breakdown_json
    from kimi_perf.trace import json_text

    b = breakdown(read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"))
    if stored:   # layers a list of dicts, one type named beyond ASCII
        doc = json.loads(json_text(b.to_json()))
        renamed = doc["layers"][0]["type"]
        for row in doc["layers"] + doc["layer_types"]:
            if row["type"] == renamed:
                row["type"] = "attn\u202e·層"
        b = Breakdown.from_json(doc)
    whole = json_text(b.to_json())
    assert len(b.layers) > 300 and breakdown_json(b) == whole
    nested = {"run": {"x": 1}, "paths": {"a": b.to_json(), "b": [list(b.layers), [], [0, 1]]}}
    for chunk in (1, 7, 64, len(b.layers) - 1, len(b.layers)):
        assert json_text(b.to_json(lazy_layers=True), chunk=chunk) == whole
        lazy = {"run": {"x": 1}, "paths": {"a": b.to_json(lazy_layers=True),
                                           "b": [b.layers, range(0), range(2)]}}
        assert json_text(lazy, chunk=chunk) == json_text(nested)
    assert json.loads(whole)["layers"] == list(b.layers)
    # a document json's encoder takes (keys that are numbers) is chunked alike
    assert json_text({1: b.layers}, chunk=5) == json_text({1: list(b.layers)})


def _report_figures(text: str) -> list[dict]:
    """The plotly figures of a report (cdn plotly.js): each ``Plotly.newPlot`` call's data
    and layout, read back as JSON."""
    decoder = json.JSONDecoder()
    figures = []
    for call in text.split("Plotly.newPlot(")[1:]:
        rest = call.split(",", 1)[1].lstrip()           # (the div's id first)
        data, end = decoder.raw_decode(rest)
        layout, _ = decoder.raw_decode(rest[end:].lstrip(", \n"))
        figures.append({"data": data, "layout": layout})
    return figures


def test_report_timelines_draw_a_bounded_number_of_bars_in_step_order(monkeypatch, tmp_path):
    """Many traces in one report (a TP run's ranks) share REPORT_TIMELINE_OPS bars, each its
    step's first ops, and the note says how many more; each panel's rows are in the step's
    order (the prologue first), a class enters the legend once, in the first panel that has
    it, and panels that count alike share one time axis, so that bars compare."""
    from kimi_perf import report

    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    total = sum(len(seg["ops"]) for seg in b.timeline["segments"])
    monkeypatch.setattr(report, "REPORT_TIMELINE_OPS", 300)
    ranks = {f"rank{r}": b for r in range(3)}
    text = report.write_report(tmp_path / "r.html", ranks, "t", plotly_js="cdn").read_text()
    timelines = _report_figures(text)[0]
    bars = sum(len(trace["x"]) for trace in timelines["data"])
    assert bars == 300 == 3 * 100
    for r in range(3):
        assert f"rank{r}: the step's first 100 ops are drawn, its {total - 100:,} more are " \
               "left out" in text
    layout = timelines["layout"]
    rows = layout["yaxis"]["categoryarray"]
    lengths = np.cumsum([len(seg["ops"]) for seg in b.timeline["segments"]])
    assert rows[:3] == ["prologue", "layer 0 (A)", "layer 1 (B)"]
    assert len(rows) == np.searchsorted(lengths, 100) + 1     # (the last one cut)
    assert layout["yaxis2"]["categoryarray"] == rows
    legend = [trace["name"] for trace in timelines["data"] if trace.get("showlegend", True)]
    assert sorted(legend) == sorted({trace["name"] for trace in timelines["data"]})
    assert layout["xaxis2"]["matches"] == layout["xaxis3"]["matches"] == "x"
    # a panel whose classes the first lacks still names them in the legend
    cpu = breakdown(read_trace(KINETO / "hta_trace_diff_test_v100_rank1_cudagraph.json.gz"))
    monkeypatch.setattr(report, "REPORT_TIMELINE_OPS", 20_000)
    two = report.write_report(tmp_path / "two.html", {"vllm": b, "other": cpu}, "t",
                              plotly_js="cdn").read_text()
    data = _report_figures(two)[0]["data"]
    shown = [(t["name"], t["yaxis"]) for t in data if t.get("showlegend", True)]
    assert sorted(name for name, _ in shown) == sorted({t["name"] for t in data})
    assert {t["name"] for t in data if t["yaxis"] == "y2"} - {
        t["name"] for t in data if t["yaxis"] == "y"} == {name for name, y in shown if y == "y2"}
    assert {name for name, y in shown if y == "y2"}   # (the case: classes the first lacks)
    # a step 10x as long or short as the first's gets an axis of its own, and shares it with
    # the steps that last alike (a 13 s window squashed a 0.3 ms decode step to 0.002%)
    long_step = copy.deepcopy(b)
    for seg in long_step.timeline["segments"]:
        seg["ops"] = [[op, cls, 100 * start, 100 * dur] for op, cls, start, dur in seg["ops"]]
    mixed = {"decode": b, "window": long_step, "decode2": b, "window2": long_step}
    layout = _report_figures(report.write_report(tmp_path / "m.html", mixed, "t",
                                                 plotly_js="cdn").read_text())[0]["layout"]
    assert "matches" not in layout["xaxis2"] and layout["xaxis3"]["matches"] == "x"
    assert layout["xaxis4"]["matches"] == "x2"
    # a group is its smallest and largest within 10x, whatever came first
    assert report.alike_groups({"a": 1.0, "b": 9.0, "c": 0.11, "d": 0.0, "e": 0.0}) == [
        ["a", "b"], ["c"], ["d", "e"]]
    # so in the class chart: layers 100x as long are a panel of their own
    for t in long_step.layer_types:
        for figures in t["classes"].values():
            figures["us"] *= 100
    fig = report._class_bars(mixed)
    assert [a.text for a in fig.layout.annotations] == [
        "GPU traces", "GPU traces on a scale of their own (10x apart): window, window2"]
    assert {trace.xaxis for trace in fig.data if any("window" in x for x in trace.x)} == {"x2"}
    # a trace of no layers has no bars: no panel of its own "10x apart" (an empty half chart)
    layerless = breakdown(read_trace(KINETO / "hta_v100_ddp_rank1_19k_kernels.json.gz"))
    assert not layerless.layer_types
    fig = report._class_bars({"decode": b, "training": layerless})
    assert not fig.layout.annotations and {trace.xaxis for trace in fig.data} == {"x"}


def test_a_reports_spread_across_traces_is_left_out_only_when_said_to_be_of_paths(
        tmp_path, monkeypatch):
    """A library caller drawing ranks with pairs of its own keeps the spread and slowest rank
    (the pairs choose comparisons, not what the traces are); ``of_paths`` leaves them out."""
    from kimi_perf.report import write_report

    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    ranks = {f"rank{r}": b for r in range(3)}
    pairs = [("rank0", "rank1"), ("rank0", "rank2"), ("rank1", "rank2")]
    own = write_report(tmp_path / "r.html", ranks, "t", plotly_js="cdn",
                       pairs=pairs).read_text()
    assert "<th>slowest / fastest</th>" in own and "No spread or slowest" not in own
    assert own.count("<h2>Per layer type: rank") == 3
    # no spread drawn: none tested, nor the spans it would test read
    from kimi_perf import comparison
    from kimi_perf import report as report_module

    def untested(*args):
        raise AssertionError("span samples read for the decode paths of runs")

    monkeypatch.setattr(comparison, "span_samples", untested)
    monkeypatch.setattr(report_module, "spreads", untested)
    paths = write_report(tmp_path / "p.html", ranks, "t", plotly_js="cdn", pairs=pairs,
                         of_paths=True).read_text()
    assert "slowest / fastest" not in paths
    assert "No spread or slowest trace: these include the decode paths of runs" in paths
    assert all(not row.samples for row in comparison.overview(ranks, tested=False))


def test_report_headers_drop_the_words_every_label_shares_and_say_what_each_is(tmp_path):
    """Two traces named alike: each comparison and typical-layer header names them by the
    words that tell them apart (a whole file name fills three columns), and a line says
    which file each short name is; labels that share no words are left as they are."""
    from kimi_perf.report import write_report

    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    long = {"vllm_gptoss_decode_before_mi300x": b, "vllm_gptoss_decode_after_mi300x": b}
    page = write_report(tmp_path / "r.html", long, "t", plotly_js="cdn").read_text()
    said = ("<p>before: vllm_gptoss_decode_before_mi300x; "
            "after: vllm_gptoss_decode_after_mi300x</p>")
    assert "<h2>Per layer type: before vs after (medians; µs = layer span)</h2>" + said in page
    assert "<th>before layers</th>" in page and "<th>after µs</th>" in page
    assert "<th>before kernel</th><th>class</th>" in page and page.count(said) == 2
    plain = write_report(tmp_path / "p.html", {"base": b, "new": b}, "t",
                         plotly_js="cdn").read_text()
    assert "<th>base layers</th>" in plain and not re.search(r"<p>base: [^<]*; new: ", plain)


def test_a_typical_layer_of_thousands_is_cut_in_the_report(tmp_path):
    """A type the repeating pattern cut from stretches of unlike work holds thousands of
    kernels: the report lists its first TYPICAL_ROWS and says how many more (a megabyte of
    table otherwise); its totals still count them all."""
    from kimi_perf.report import TYPICAL_ROWS, write_report

    b = breakdown(read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"))
    longest = max(len(t["typical_layer"]["kernels"]) for t in b.layer_types)
    assert longest > TYPICAL_ROWS
    text = write_report(tmp_path / "r.html", {"jsun": b}, "t", plotly_js="cdn").read_text()
    assert f"… {longest - TYPICAL_ROWS:,} more (kimi-perf breakdown --kernels lists them all" \
        in text
    assert f"<td>{TYPICAL_ROWS}</td>" in text and f"<td>{TYPICAL_ROWS + 1}</td>" not in text
    assert f"<th colspan=2>{longest} kernels," in text


def test_report_labels_and_titles_write_control_characters_out(tmp_path):
    """A file name holding a right-to-left override (or the Arabic letter mark) labels its
    trace with the character written out, as a trace's own names are, in the title and
    the tables alike; a report of no layer types draws no empty class chart."""
    from kimi_perf.report import write_report
    from kimi_perf.runs import trace_labels

    assert trace_labels([tmp_path / "x\u202ey.json.gz", tmp_path / "a\u061cb.sqlite"]) == [
        "x\\u202ey", "a\\u061cb"]
    b = breakdown(read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"))
    text = write_report(tmp_path / "r.html", {"x\u202ey": b}, "kimi-perf: x\u202ey.json",
                        plotly_js="cdn").read_text()
    assert "\u202e" not in text and "<title>kimi-perf: x\\u202ey.json</title>" in text
    # the run's own rows too: the file a trace --from read, and the command that named it
    # (the label was written out, the file and the command were not)
    import shutil

    from click.testing import CliRunner

    from kimi_perf.cli import main

    weird = tmp_path / "weird"
    weird.mkdir()
    shutil.copy(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz",
                weird / "a\u202eb\nc.json.gz")
    done = CliRunner().invoke(main, ["trace", "--from", str(weird), "--out",
                                     str(tmp_path / "runs"), "--plotly-js", "cdn"])
    assert done.exit_code == 0, done.output
    page = next((tmp_path / "runs").glob("*/report.html")).read_text()
    assert "\u202e" not in page and "a\\u202eb\\x0ac.json.gz" in page
    # and a stored run's own texts (a baseline is a file of another's): its model, what was
    # timed, its fallbacks
    doc = json.loads((REPO / "traces" / "baselines" / "tiny-cpu.json").read_text())
    doc["run"]["paths"]["specialized"].update(model="Spec\u202eM", timed="all\u202e steps",
                                               fallbacks=["decode_step[0]: \u202e<x>"])
    # (and a path's name, which the first-call caveat names: "st\u202ed")
    doc["paths"]["st\u202ed"] = doc["paths"].pop("standard")
    doc["run"]["paths"]["st\u202ed"] = doc["run"]["paths"].pop("standard")
    doc["run"]["request"]["paths"][0] = "st\u202ed"
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps(doc))
    drawn = CliRunner().invoke(main, ["report", str(stored), "-o", str(tmp_path / "s.html"),
                                      "--plotly-js", "cdn"])
    assert drawn.exit_code == 0, drawn.output
    page = (tmp_path / "s.html").read_text()
    assert "\u202e" not in page and "Spec\\u202eM" in page and "\\u202e&lt;x&gt;" in page
    none = breakdown(read_trace(KINETO / "hta_a100_80gb_rank0_cudagraph_triton.json.gz"))
    assert not none.layer_types and none.timeline["by_stream"]
    layerless = write_report(tmp_path / "l.html", {"t": none}, "t", plotly_js="cdn").read_text()
    assert len(_report_figures(layerless)) == 1          # the timeline, no class chart
    # a breakdown stored without a timeline (an older kimi-perf's): no empty timeline either,
    # and no plotly.js, with nothing to draw
    none.timeline = None
    empty = write_report(tmp_path / "e.html", {"t": none}, "t", plotly_js="cdn").read_text()
    assert len(_report_figures(empty)) == 0 and "plot.ly" not in empty
    assert "t: no timeline in this breakdown (stored without one: an older kimi-perf drew " \
        "steps with layers only)." in empty


def test_a_step_without_layers_is_drawn_a_row_per_stream(tmp_path):
    """A trace where no layer is found (training, NCCL next to compute) still gets its
    timeline: the median-span step, a row per stream in the order the streams start (the
    collectives' stream beside the compute's shows what overlapped), every op of the step."""
    from kimi_perf.report import write_report

    b = breakdown(read_trace(KINETO / "hta_a100_nccl_ddp_gpu_user_annotation.json.gz"))
    timeline = b.timeline
    assert not b.layer_types and timeline["by_stream"]
    step = next(s for s in b.steps if s["name"] == timeline["step"])
    spans = sorted(s["span_us"] for s in b.steps)
    assert step["span_us"] == spans[len(spans) // 2]
    segments = {seg["label"]: seg["ops"] for seg in timeline["segments"]}
    assert list(segments) == ["stream 7", "stream 40"]
    assert sum(map(len, segments.values())) == step["kernels"]
    assert {timeline["names"][op[0]][:5] for op in segments["stream 40"]} == {"ncclK"}
    for ops in segments.values():                  # each row in time order, from the step's start
        assert [op[2] for op in ops] == sorted(op[2] for op in ops)
    assert min(op[2] for ops in segments.values() for op in ops) == 0
    text = write_report(tmp_path / "r.html", {"ddp": b}, "t", plotly_js="cdn").read_text()
    assert "no layer found: a row per stream" in text and "no timeline" not in text


def test_a_report_short_of_bars_draws_a_layerless_steps_first_ops_in_time(tmp_path):
    """A report of several traces draws each step's first ops: a step's layers in turn, but
    its streams side by side, so that a stream starting late in the step still has its row
    (spending the bars stream by stream drew one stream and no row for the NCCL one)."""
    from kimi_perf.report import _first_ops

    by_stream = {"by_stream": True, "segments": [
        {"label": "stream 7", "ops": [[0, "gemm", 0.0, 5.0], [0, "gemm", 6.0, 5.0],
                                      [0, "gemm", 12.0, 5.0]]},
        {"label": "stream 14", "ops": [[1, "communication", 1.0, 20.0],
                                       [1, "communication", 6.0, 1.0]]}]}
    gemms, nccl = (seg["ops"] for seg in by_stream["segments"])
    assert _first_ops(by_stream, 2) == [gemms[:1], nccl[:1]]
    assert _first_ops(by_stream, 3) == [gemms[:2], nccl[:1]]   # (of two at 6 µs, the first)
    assert _first_ops(by_stream, 4) == [gemms[:2], nccl]
    assert _first_ops(by_stream, 9) == [seg["ops"] for seg in by_stream["segments"]]
    layers = {"segments": by_stream["segments"]}      # a step's layers: in turn
    assert _first_ops(layers, 4) == [by_stream["segments"][0]["ops"],
                                     by_stream["segments"][1]["ops"][:1]]
    # a trace's NCCL stream starts 181 ms into a step of 4,458 ops: drawn among 4,000
    from kimi_perf.report import write_report

    b = breakdown(read_trace(KINETO / "hta_v100_ddp_rank1_19k_kernels.json.gz"))
    rows = [seg["label"] for seg in b.timeline["segments"]]
    assert rows == ["stream 7", "stream 14"]
    kept = _first_ops(b.timeline, 4000)
    assert sum(map(len, kept)) == 4000 and all(kept)
    latest = max(op[2] for ops in kept for op in ops)
    assert all(op[2] >= latest for seg in b.timeline["segments"] for op in seg["ops"]
               if op not in kept[b.timeline["segments"].index(seg)])
    # five of it in one report: 4,000 bars each, the NCCL stream's row in every panel
    text = write_report(tmp_path / "r.html", {f"rank{i}": b for i in range(5)}, "t",
                        plotly_js="cdn").read_text()
    assert text.count('"stream 14"') >= 5


def test_processes_sharing_a_device_have_a_row_per_stream_each():
    """Two processes on one GPU (no step range) are a step each, each its own stream 7: the
    timeline's step (of median span) draws its own process's row, not one row of both."""
    b = TraceBuilder()
    b.launch("gemm_a", 0, 10, 100, 300, pid=1)
    b.launch("gemm_b", 20, 30, 150, 400, pid=2)
    b.launch("gemm_c", 40, 50, 420, 700, pid=1)
    broken_down = breakdown(b.build())
    assert [(s["name"], s["kernels"]) for s in broken_down.steps] == [
        ("device 0 pid 1", 2), ("device 0 pid 2", 1)]
    timeline = broken_down.timeline
    rows = {seg["label"]: [timeline["names"][op[0]] for op in seg["ops"]]
            for seg in timeline["segments"]}
    assert rows == {"stream 7": ["gemm_a", "gemm_c"]}


def test_an_older_kinetos_stream_lanes_are_their_streams(tmp_path):
    """An older Kineto names a kernel's lane "tid": "stream 7" where its args hold no stream:
    that is stream 7 (a made-up id would label the timeline's row "stream 536870912"); a
    kernel of no stream at all is drawn as such."""
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 5, "pid": 0,
               **({"tid": tid} if tid is not None else {}), "args": {"device": 0}}
              for name, ts, tid in (("gemm", 10, "stream 7"), ("copy", 12, " stream 13 "),
                                    ("norm", 20, "stream 7"), ("odd", 30, None))]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = read_trace(path)
    assert trace.kernels.stream.tolist() == [7, 13, 7, -1]
    timeline = breakdown(trace).timeline
    assert [seg["label"] for seg in timeline["segments"]] == ["stream 7", "stream 13",
                                                              "no stream"]


def test_a_layerless_steps_streams_are_drawn_in_the_order_they_start():
    """The rows follow the streams' first ops, not their ids (a copy stream that starts the
    step is its first row), and each row holds its own stream's ops only."""
    b = TraceBuilder()
    b.launch("copy_a", 0, 10, 100, 160, stream=13)
    b.launch("gemm_b", 20, 30, 150, 400, stream=7)
    b.launch("gemm_c", 40, 50, 420, 700, stream=7)
    b.launch("copy_d", 60, 70, 710, 760, stream=13)
    b.range("step", 0, 80)
    timeline = breakdown(b.build(), step_regex="^step$").timeline
    rows = {seg["label"]: [(timeline["names"][op[0]], op[2]) for op in seg["ops"]]
            for seg in timeline["segments"]}
    assert timeline["by_stream"] and list(rows) == ["stream 13", "stream 7"]
    assert rows == {"stream 13": [("copy_a", 0.0), ("copy_d", 0.61)],
                    "stream 7": [("gemm_b", 0.05), ("gemm_c", 0.32)]}


def test_processes_sharing_a_device_are_steps_of_their_own(tmp_path):
    """Two processes' work on one GPU (a real two-rank trace with its second rank moved onto
    device 0): a step each, each with its 17 layers, as on two devices; one step of both
    interleaved held 5,299 kernels in a span shorter than their time, and no layer."""
    import shutil
    import sqlite3

    from kimi_perf.layer_breakdown import step_notes

    shared = tmp_path / "shared.sqlite"
    shutil.copyfile(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite", shared)
    shared.chmod(0o644)
    with contextlib.closing(sqlite3.connect(shared)) as db, db:
        for table in ("KERNEL", "MEMCPY", "MEMSET"):
            db.execute(f"UPDATE CUPTI_ACTIVITY_KIND_{table} SET deviceId = 0")
    apart = breakdown(read_trace(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite"))
    b = breakdown(read_trace(shared))
    assert [(s["device"], s["index"]) for s in b.steps] == [(0, 0), (0, 1)]
    assert sorted(s["name"].split(" pid ")[1] for s in b.steps) == sorted(
        str(s["pid"]) for s in apart.steps)
    assert sorted(s["kernels"] for s in b.steps) == sorted(s["kernels"] for s in apart.steps)
    assert [s["layers"] for s in b.steps] == [17, 17]
    assert all(s["span_us"] >= s["kernel_us"] for s in b.steps)
    assert any("each device is one step (each process, on a device processes share)" in n
               for n in step_notes(b))
    assert not any("(each process" in n for n in step_notes(apart))


def test_passes_of_processes_sharing_a_device_are_numbered_apart():
    """Each process's forward passes on a device they share: steps numbered apart on the
    device (both numbered from 0, their layers were each other's, and the breakdown's JSON
    no longer read back); kernels whose process the trace lacks (pid -1, launched before the
    window) stay with the device's process, not a step of their own."""
    import json

    from kimi_perf import Breakdown
    from kimi_perf.trace import json_text

    llama = ["rmsnorm", "gemm_qkv", "rope", "flash_fwd", "gemm_o", "add_rmsnorm", "gemm_up",
             "silu_mul", "gemm_down"]
    b = TraceBuilder()

    def run(names, pid):
        for name in names:
            t = b.clock
            b.launch(name, t, t + 50, t + 200, t + 1200, pid=pid)
            b.clock += 1100
    for pid in (1, 2):
        run(["memcpy_weights_h2d"] * 3, pid)
        for _ in range(3):
            for part in (["embedding"], *[llama] * 8,
                         ["add_rmsnorm", "gemm_lm_head", "argmax", "copy_tokens"]):
                run(part, pid)
            b.clock += 20_000
    passes = breakdown(b.build())
    assert [(s["name"], s["index"], s["layers"]) for s in passes.steps] == [
        (f"device 0 pid {pid} pass {k}", 3 * (pid - 1) + k, 8) for pid in (1, 2)
        for k in range(3)]
    assert Breakdown.from_json(json.loads(json_text(passes.to_json()))).steps == passes.steps
    orphans = TraceBuilder()
    orphans.sequence(llama * 8)
    for kernel in orphans.kernels[:2]:
        kernel["pid"] = -1
    steps = breakdown(orphans.build()).steps
    assert [(s["name"], s["kernels"], s["layers"]) for s in steps] == [("device 0", 72, 8)]
    assert steps[0]["pid"] == orphans.kernels[2]["pid"] != -1   # (its process: not -1)


def test_work_of_no_known_process_goes_with_one_process_of_a_device_they_share():
    """Two processes on one device, and two kernels whose process the trace lacks (the first
    process's first two): those go with the process that ran the most, once: the steps hold
    the trace's 108 kernels (each process's step counting them was 38 + 72; the first
    process's, 36 + 72)."""
    llama = ["rmsnorm", "gemm_qkv", "rope", "flash_fwd", "gemm_o", "add_rmsnorm", "gemm_up",
             "silu_mul", "gemm_down"]
    b = TraceBuilder()
    for names, pid in ((llama * 4, 1), (llama * 8, 2)):
        for name in names:
            t = b.clock
            b.launch(name, t, t + 50, t + 200, t + 1200, pid=pid)
            b.clock += 1100
    for kernel in b.kernels[:2]:
        kernel["pid"] = -1
    steps = breakdown(b.build()).steps
    assert {s["name"]: s["kernels"] for s in steps} == {"device 0 pid 1": 34,
                                                        "device 0 pid 2": 74}


def test_a_stored_breakdowns_names_are_escaped_in_every_html_cell(tmp_path):
    """A stored breakdown (edited, or of an untrusted trace) whose step range holds a
    <script> and whose kernel holds a quote and an attribute: the report's steps table and the
    typical layer's hover title hold them as text, never as markup."""
    from kimi_perf.report import write_report

    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2).build())
    b.steps[0]["name"] = "decode_step<script>alert(1)</script>"
    b.layer_types[0]["typical_layer"]["kernels"][0]["name"] = 'gemm" onmouseover="alert(2)'
    html = write_report(tmp_path / "r.html", {"x": b}, "t", plotly_js="cdn").read_text()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html
    assert '" onmouseover="alert(2)' not in html and "&quot; onmouseover=&quot;alert(2)" in html


def test_breakdown_csv_rows_are_the_layers_figures_in_the_headers_order():
    """Each CSV row holds its layer's figures under their own headers (kernel µs before span
    µs, as the header says), the classes as class=kernels/µs."""
    import csv

    from kimi_perf.render import breakdown_csv

    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2).build())
    rows = list(csv.DictReader(io.StringIO(breakdown_csv(b))))
    assert len(rows) == len(b.layers)
    for row, layer in zip(rows, b.layers, strict=True):
        assert layer["kernel_us"] != layer["span_us"]
        assert (int(row["step"]), int(row["layer"]), row["type"], int(row["kernels"]),
                float(row["kernel_us"]), float(row["span_us"]), float(row["gap_us"])) == (
            layer["step"], layer["index"], layer["type"], layer["kernels"],
            layer["kernel_us"], layer["span_us"], layer["gap_us"])
        assert row["classes"] == ";".join(f"{c}={v['kernels']}/{v['us']}"
                                          for c, v in layer["classes"].items())


# -- what the rules' digests say, and how a user's rule reaches the layer finder -------------


def _digest_of(said: str) -> str:
    return said[said.index("(") + 1: -1]


def test_rules_said_names_a_list_of_ones_own_custom_and_counts_the_extra_rules():
    defaults = default_rules()
    mine = [Rule("mine", re.compile("gemm", re.IGNORECASE))]
    two = [Rule("mine", re.compile("gemm", re.IGNORECASE)),
           Rule("kda", re.compile("kda", re.IGNORECASE))]
    assert rules_said(mine).startswith("custom (sha256:")
    assert rules_said([*two, *defaults]).startswith("2 extra (sha256:")
    assert rules_said([*mine, *defaults]).startswith("1 extra (sha256:")


def test_the_extra_rules_digest_is_of_the_extra_rules_alone():
    """'N extra (sha256:…)' digests the rules put before the defaults: the same file gives
    the same digest whatever the version's defaults (so equal to the digest of those rules
    as a list of one's own)."""
    extra = [Rule("mine", re.compile("gemm", re.IGNORECASE))]
    assert _digest_of(rules_said([*extra, *default_rules()])) == _digest_of(rules_said(extra))


@pytest.mark.parametrize("other", [
    Rule("gemm", re.compile("my_op")),                    # case-sensitive, as a library list may be
    Rule("norm", re.compile("my_op", re.IGNORECASE)),     # another class
    Rule("gemm", re.compile("my_op2", re.IGNORECASE)),    # another pattern
])
def test_the_rules_digest_tells_class_pattern_and_flags_apart(other):
    one = Rule("gemm", re.compile("my_op", re.IGNORECASE))
    assert rules_said([one]) != rules_said([other])


def test_the_default_rules_digest_covers_every_shipped_rule():
    defaults = default_rules()
    assert default_rules_said() != _digest_of(rules_said(defaults[1:]))
    assert default_rules_said() != _digest_of(rules_said(defaults[:-1]))


def test_a_users_rule_saying_other_reaches_the_layer_finder():
    """'other' is a shipped class: a user's rule that says a kernel the defaults call
    attention is other moves it for the layer finder too."""
    rules = [Rule("other", re.compile("flash_fwd", re.IGNORECASE)), *default_rules()]
    assert layout_class_name("flash_fwd_kernel", default_rules()) == "attention"
    assert layout_class_name("flash_fwd_kernel", rules) == "other"


def test_a_users_rule_reaches_the_layer_finder_anywhere_in_the_name():
    """Rules search the name (as classify_name does), not match at its start."""
    rules = [Rule("attention", re.compile("custom_mixer", re.IGNORECASE)), *default_rules()]
    assert layout_class_name("zz_custom_mixer_op", default_rules()) != "attention"
    assert layout_class_name("zz_custom_mixer_op", rules) == "attention"


def test_an_empty_rule_list_in_a_file_is_an_error(tmp_path):
    """'rule = []' adds nothing: a file that means to add rules and adds none is refused."""
    path = tmp_path / "rules.toml"
    path.write_text("rule = []\n")
    with pytest.raises(TraceError, match=r"no \[\[rule\]\] entries"):
        load_rules(path)


def test_a_rules_class_has_its_control_characters_written_out(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[[rule]]\nclass = "a\\u001b[31mb"\npattern = "my_op"\n')
    (rule, *_) = load_rules(path)
    assert rule.cls == "a\\x1b[31mb"


def test_compare_ratios_are_a_over_b_and_a_cpu_run_keeps_only_its_counts():
    """12 kernels in 60 µs against 8 in 30: each ratio is A's over B's (1.5 kernels, 2.0 µs);
    against a CPU run's ops the µs ratios go (host time against GPU time), the count ratio
    stays; the rows hold their µs to three decimals."""
    from kimi_perf.comparison import ALL_LAYERS

    a = _types(("A", "d1", 12, 60.0))
    b = _types(("A", "d1", 8, 30.0))
    (row, *_) = compare(a, b)
    assert (row.kernel_ratio, row.span_ratio, row.kernel_us_ratio) == (1.5, 2.0, 2.0)
    cpu = copy.deepcopy(b)
    cpu.source["ops"] = "cpu-ops"
    for row in compare(a, cpu):
        assert (row.kernel_ratio, row.span_ratio, row.kernel_us_ratio) == (1.5, None, None)
        assert row.to_json()["kernel_us_ratio"] is None
    odd = compare(_types(("A", "d1", 3, 1234.5678)), b)
    assert (odd[0].to_json()["a"]["span_us"], odd[0].to_json()["a"]["kernel_us"]) == (
        1234.568, 1234.568)
    mean = next(r for r in odd if r.type == ALL_LAYERS)   # the mean layer's too
    assert (mean.span_us_a, mean.kernel_us_a) == (1234.568, 1234.568)


def test_a_whole_step_whose_steps_do_not_say_their_layers_shows_no_layers_a_step():
    """Steps stored without their layer count: the whole step's row shows 0 (no "0 a
    step"); the other side's, "2 a step"."""
    from kimi_perf.comparison import WHOLE_STEP

    a = _types(("A", "d1", 12, 60.0))
    unsaid = copy.deepcopy(a)
    for step in unsaid.steps:
        del step["layers"]
    step = next(r for r in compare(unsaid, a) if r.type == WHOLE_STEP)
    assert (step.layers_text("a"), step.layers_text("b")) == ("0", "2 a step")


def test_types_only_b_has_follow_in_bs_order():
    """Types by ranges that only B has come after A's, in B's order."""
    from kimi_perf.comparison import pair_layer_types

    one = _types(("mlp", None, 5, 10.0))
    three = _types(("mlp", None, 5, 10.0), ("kda", None, 9, 20.0), ("dense", None, 4, 8.0))
    assert pair_layer_types(one, three) == [("mlp", "mlp"), (None, "kda"), (None, "dense")]

def test_the_legend_of_a_type_only_b_has_alone():
    """A range type X of A's finds no range type in B, whose pattern type X pairs with
    nothing: "- = X" is the only renamed row, and the legend says that alone (no "None = X")."""
    from kimi_perf.comparison import pairing_note

    a = _types(("X", None, 3, 5.0), ("W", "d8", 4, 7.0))
    b = _types(("X", "d9", 3, 5.0), ("W", "d8", 4, 7.0))
    rows = compare(a, b)
    assert [r.label for r in rows[:3]] == ["X", "W", "- = X"]
    assert pairing_note(rows, "x", "y") == (
        "- = X: a type only y has, which it calls X (x's X is another)")


def test_idle_note_at_its_threshold_and_past_its_most_rows():
    """A span ratio exactly IDLE_APART from the kernel time's is said; three rows apart are
    all said, with no "…" (a fourth would be); a row whose A kernels overlap past its span
    (streams at once) is not idle time."""
    from kimi_perf.comparison import ComparisonRow, idle_note

    edge = ComparisonRow("E", 1, 10, 50.0, 105.0, 1, 10, 50.0, 100.0)
    assert idle_note([edge]).endswith("E: 1.05, kernel µs 1")
    rows = [ComparisonRow(t, 1, 10, 80.0, 100.0, 1, 10, 80.0, span_b)
            for t, span_b in (("A", 120.0), ("B", 125.0), ("C", 130.0), ("D", 135.0))]
    assert idle_note(rows[:3]).endswith("A: 0.833, kernel µs 1; B: 0.8, kernel µs 1; C: 0.769, "
                                        "kernel µs 1")
    assert idle_note(rows).endswith("C: 0.769, kernel µs 1; …")
    overlapping = ComparisonRow("O", 1, 10, 150.0, 100.0, 1, 10, 80.0, 120.0)
    assert idle_note([overlapping]) is None


def test_two_tp_jobs_of_other_step_counts_are_said_per_device():
    """Two jobs of two devices, 3 steps each against 2: "3 steps × 2 devices and 2 steps × 2
    devices", not 6 and 4 steps."""
    from kimi_perf.comparison import ratio_note

    three, two = (breakdown(two_device_trace(slow_mla=1.0, steps=n)) for n in (3, 2))
    assert ("the median step (of 3 steps × 2 devices and of 2 steps × 2 devices)"
            in ratio_note(compare(three, two), "A", "B"))


def test_sides_notes_say_nothing_of_what_a_side_does_not_say():
    """One side whose GPUs are not recorded, or whose steps' phase is unknown, is no side of
    another GPU or phase."""
    from kimi_perf.comparison import sides_notes

    plain = breakdown(nvtx_decode_trace("layer[{i}]({kind})").build())
    a, b = copy.deepcopy(plain), copy.deepcopy(plain)
    a.source["gpus_ran"] = [{"device": 0, "name": "NVIDIA A100", "sm_count": 108}]
    b.source.pop("gpus_ran", None)
    assert sides_notes(a, b, "A", "B") == []
    for step in b.steps:
        step["phase"] = "unknown"
    assert sides_notes(plain, b, "A", "B") == []


def test_the_first_of_equally_slowest_traces_is_named():
    """Two of three traces equally slowest: the first of them is named (Spread's rule)."""
    from kimi_perf.comparison import OverviewRow, spreads

    rows = [OverviewRow(f"rank{i}", 3, span, {}, {}, layers=4.0)
            for i, span in enumerate((100.0, 150.0, 150.0))]
    assert [(s.type, s.slowest_label, s.ratio) for s in spreads(rows)] == [(None, "rank1", 1.5)]


def test_a_trace_of_two_devices_among_two_traces_is_labelled_with_its_name():
    """Two traces, one of two devices: its rows are "job device N" (not "device N", which
    names one trace's devices); three traces get no table of each one's devices (their
    overview has a row per device already)."""
    from kimi_perf.comparison import device_overviews, overview

    plain = breakdown(nvtx_decode_trace("layer[{i}]({kind})").build())
    job = breakdown(two_device_trace(slow_mla=1.0))
    assert [r.label for r in overview({"one": plain, "job": job})] == [
        "one", "job device 0", "job device 1"]
    assert device_overviews({"one": plain, "job": job, "two": plain}) == {}
    assert list(device_overviews({"one": plain, "job": job})) == ["job"]


def test_a_step_that_found_no_layer_leaves_the_others_ranges():
    """One step of three found no layer (``none``): the breakdown's layers are still ranges,
    and its 8 layers a step against 4 ranges' are still other work (models of other depths:
    no whole-step ratio); every step none: ``none``."""
    from kimi_perf.comparison import layer_sources, steps_of_other_work

    a = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=3).build())
    b = copy.deepcopy(a)
    for step in b.steps:
        step["layers"] = 4
    a.steps[0]["layer_source"] = "none"
    assert layer_sources(a) == ["nvtx"] and steps_of_other_work([a, b])
    for step in a.steps:
        step["layer_source"] = "none"
    assert layer_sources(a) == ["none"]


def test_two_types_whose_sequences_share_a_column_do_not_both_join_it():
    """The second trace's type joined the first's by its mix of kernels; a third trace holds
    both kernel sequences, as two types: one column cannot take both (the one would hide the
    other), so each is paired anew: its own sequence's type takes the column, the other one
    a column of its own."""
    from kimi_perf.comparison import aligned_types

    one = _types(("X", "d1", 10, 100.0, {"gemm": 10}))
    two = _types(("Y", "d2", 10, 100.0, {"gemm": 9, "norm": 1}))
    three = _types(("P", "d1", 10, 100.0, {"gemm": 10}),
                   ("Q", "d2", 10, 100.0, {"gemm": 9, "norm": 1}))
    assert aligned_types({"one": one, "two": two, "three": three}) == [
        {"one": "X", "two": "Y", "three": "P"}, {"three": "Q"}]
    # a fourth trace of that sequence joins the column that took it first
    four = _types(("R", "d2", 10, 100.0, {"gemm": 9, "norm": 1}))
    assert aligned_types({"one": one, "two": two, "three": three, "four": four}) == [
        {"one": "X", "two": "Y", "three": "P", "four": "R"}, {"three": "Q"}]


def test_renamed_columns_end_in_an_ellipsis_only_past_their_most():
    """Two columns renamed and room for two: both said, no "…"; room for one: "…"."""
    from kimi_perf.comparison import OverviewRow, renamed_columns

    rows = [OverviewRow(label, 3, 100.0, {"A": (1, 1.0), "B": (1, 1.0)}, {"A": None, "B": None},
                        names=names)
            for label, names in (("t1", {"A": "A", "B": "B"}), ("t2", {"A": "C", "B": "D"}))]
    assert renamed_columns(rows, most=2) == (
        "columns name a type as the first trace that has it does: A is C in t2; B is D in t2")
    assert renamed_columns(rows, most=1).endswith("A is C in t2; …")


def test_class_distance_runs_from_the_same_mix_to_no_class_in_common():
    """0 for the same mix, 1 for no class in common, half of that for half the kernels moved;
    the same mix at twice the size a tenth of log 2 apart."""
    from kimi_perf.comparison import class_distance

    def mix(kernels: int, classes: dict) -> dict:
        return _types(("A", "d", kernels, 1.0, classes)).layer_types[0]

    gemm, norm = mix(10, {"gemm": 10}), mix(10, {"norm": 10})
    half, twice = mix(10, {"gemm": 5, "norm": 5}), mix(20, {"gemm": 10, "norm": 10})
    assert (class_distance(gemm, gemm), class_distance(gemm, norm),
            class_distance(gemm, half)) == (0.0, 1.0, 0.5)
    assert class_distance(half, twice) == pytest.approx(0.1 * np.log(2))


def test_layers_of_one_name_differ_past_the_ratio_not_at_it():
    """20 kernels against 23 (exactly ``OTHER_WORK_KERNELS`` times as many, three more) are
    alike; against 24, other work under one name."""
    from kimi_perf.comparison import OverviewRow, counts_differ

    def rows(*counts) -> list[OverviewRow]:
        return [OverviewRow(f"rank{i}", 3, 100.0, {"kda": (n, 10.0)}, {"kda": None})
                for i, n in enumerate(counts)]

    assert counts_differ(rows(20, 23)) == [] and counts_differ(rows(20, 24)) == ["kda"]


def test_overview_json_holds_step_spans_to_three_decimals():
    """A median step of 1234.56789 µs (a median of two steps: a half ns) reads 1234.568."""
    from kimi_perf.comparison import OverviewRow, overview_json

    rows = [OverviewRow(f"rank{i}", 2, 1234.56789 + i, {}, {}) for i in (0, 1)]
    assert [r["step_us"] for r in overview_json(rows)["rows"]] == [1234.568, 1235.568]


def _decode_with_two_kernel_edges(steps: int = 2) -> Trace:
    """Decode steps of 4 annotated layers whose prologue and epilogue are two kernels each,
    1000 ns apiece with 100 ns between them: an edge's kernel µs (2.0) is not its span (2.1)."""
    b = TraceBuilder()
    for s in range(steps):
        step_start = b.clock
        b.sequence(["embedding", "embedding_scale"])
        for i, kernels in enumerate(k3_like(4)):
            kind = "mla" if "mla_decode" in kernels else "kda"
            start, end = b.sequence(kernels)
            b.range(f"layer[{i}]({kind})", start - 10, end)
        b.sequence(["final_rmsnorm", "gemm_lm_head"])
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    return b.build()


def test_a_steps_prologue_and_epilogue_count_their_kernels_time_not_their_span():
    """A step's ``prologue`` and ``epilogue`` hold their kernels, their kernels' summed µs
    and their span, each its own figure: two 1 µs kernels 0.1 µs apart are 2.0 kernel µs
    over a 2.1 µs span."""
    b = breakdown(_decode_with_two_kernel_edges())
    for step in b.steps:
        for part in ("prologue", "epilogue"):
            assert step[part] == {"kernels": 2, "kernel_us": 2.0, "span_us": 2.1}, part


def test_steps_and_layers_list_their_kernel_classes_in_label_order():
    """Each step's and each layer's ``classes`` are keyed in label order (as the JSON writes
    them and the tables read them), whatever order the classes were first met in the trace
    (here: elementwise, norm, gemm, attention, ...)."""
    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=8).build())
    for row in [*b.steps, *b.layers]:
        assert list(row["classes"]) == sorted(row["classes"]) and len(row["classes"]) > 2
    doc = json.loads(json.dumps(b.to_json()))
    assert [list(s["classes"]) for s in doc["steps"]] == [sorted(s["classes"])
                                                           for s in b.steps]


def test_layer_rows_compare_unequal_to_a_list_of_another_length():
    """A breakdown's layers (columns read as rows) equal a list of the same dicts, and are
    unequal, not an error, to one row short or one row more."""
    layers = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=1).build()).layers
    rows = list(layers)
    assert layers == rows
    assert (layers == rows[:-1]) is False and layers != rows[:-1]
    assert layers != [*rows, rows[0]]


def test_a_kernel_class_column_of_a_type_no_layer_has_is_empty():
    """``class_column`` of a layer type the breakdown lacks is empty, of its layers as held
    and as read back from JSON alike, not the µs of another type's layers; a class a type
    never ran is 0.0 in each of its layers."""
    from kimi_perf.layer_breakdown import class_column

    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=8).build())
    read = Breakdown.from_json(json.loads(json.dumps(b.to_json())))
    for layers in (b.layers, read.layers):
        assert class_column(layers, "attention", "no such type").tolist() == []
        assert class_column(layers, "attention", "mla").tolist() == [1.0] * 4
        assert class_column(layers, "no such class", "kda").tolist() == [0.0] * 12


def test_two_groups_name_a_period_only_of_three_evenly_spaced_slower_layers_or_more():
    """Two slower layers are evenly spaced whatever they are: the note names their layers
    and no period ("every 4th") that two cannot show; three or more evenly spaced name it,
    and three unevenly spaced do not."""
    from kimi_perf.layer_breakdown import two_groups_note

    group = {"figure": "attention", "low_us": 100.0, "high_us": 200.0, "low_layers": 6,
             "high_layers": [3, 7], "median_between": False, "kernels": [1, 1]}
    assert "(layers 3, 7);" in two_groups_note("A", group)
    assert "(layers 3, 7, 11: every 4th);" in two_groups_note(
        "A", {**group, "high_layers": [3, 7, 11]})
    assert "(layers 3, 7, 12);" in two_groups_note("A", {**group, "high_layers": [3, 7, 12]})


def test_the_word_for_what_several_breakdowns_count_is_one_spelling_whatever_their_order():
    """Breakdowns of GPU kernels and of a CPU run's ops, in either order, are said to count
    "kernels or ops", one spelling (the words sorted, not as a set happens to hold them);
    none at all count kernels."""
    from kimi_perf.layer_breakdown import units_word

    assert units_word(["ops", "kernels", "ops"]) == units_word(["kernels", "ops"]) == \
        "kernels or ops"
    assert units_word(["ops"]) == "ops" and units_word([]) == "kernels"
    words = ["zeta", "ops", "alpha", "kernels", "mu", "beta"]
    assert units_word(words) == " or ".join(sorted(words))


def test_repeating_ranges_rank_by_kernels_then_name_from_a_quarter_of_the_kernels_up():
    """The ranges ``--steps`` could take: those of two instances or more holding a quarter of
    the trace's 24 kernels or more (6: exactly a quarter counts), the most kernels first,
    ties by name (alpha's 3 instances do not put it after beta's 2), the first three; a
    single range ('once', 12 kernels) and the profiler's operator ranges are none."""
    from kimi_perf.layer_breakdown import repeating_ranges

    b = TraceBuilder()
    for _ in range(2):
        start = b.clock
        first_three = b.sequence(["gemm_a", "gemm_b", "add"])
        b.sequence(["gemm_c", "gemm_d", "add"])
        b.range("forward", start - 20, b.clock + 20)
        b.range("cpu_op: aten::linear", start - 10, b.clock + 10)
        b.range("delta", start - 5, first_three[1] - 1)
        b.clock += 1000
    start = b.clock
    for _ in range(3):
        first, last = b.sequence(["rmsnorm", "add"])
        b.range("alpha", first - 5, last - 1)
    for _ in range(2):
        first, last = b.sequence(["gemm_e", "silu", "add"])
        b.range("beta", first - 5, last - 1)
    b.range("once", start - 30, b.clock + 30)
    trace = b.build()
    assert len(trace.kernels) == 24
    assert repeating_ranges(trace) == [{"range": "forward", "instances": 2, "kernels": 12},
                                       {"range": "alpha", "instances": 3, "kernels": 6},
                                       {"range": "beta", "instances": 2, "kernels": 6}]
    assert [r["range"] for r in repeating_ranges(trace, most=10)] == [
        "forward", "alpha", "beta", "delta"]


def test_a_range_nested_in_one_of_its_name_sharing_its_start_or_end_is_no_instance():
    """A wrapper's 'forward' around the model's, the two opened or closed at the same time
    (clocks of a µs make that common): one instance each time, not two, whichever edge
    they share."""
    from kimi_perf.layer_breakdown import repeating_ranges

    b = TraceBuilder()
    start = b.clock
    b.sequence(["gemm", "add"])
    b.range("forward", start - 10, b.clock)
    b.range("forward", start - 5, b.clock)          # inside, the same end
    b.clock += 1000
    start = b.clock
    b.sequence(["gemm", "add"])
    b.range("forward", start - 10, b.clock)
    b.range("forward", start - 10, b.clock - 500)   # inside, the same start
    (row,) = repeating_ranges(b.build())
    assert row == {"range": "forward", "instances": 2, "kernels": 4}


def test_a_kernel_spread_counts_from_its_bounds_inclusive():
    """A spread is shown from SPREAD_MIN_LAYERS layers on (4, not 5), from a 90th percentile
    of exactly 1.5 times the 10th, and from a difference of exactly a µs: each bound counts
    in; a hair under the ratio does not."""
    from kimi_perf.layer_breakdown import SPREAD, SPREAD_MIN_LAYERS, kernel_spreads

    assert (SPREAD, SPREAD_MIN_LAYERS) == (1.5, 4)
    # 4 layers: the 10th percentile is the lower pair's, the 90th the upper pair's
    ns = np.array([[2000, 2000, 1000]] * 2 + [[3000, 2999, 1000]] * 2)
    assert kernel_spreads(ns) == [[2.0, 3.0], None, None]
    assert kernel_spreads(ns[1:]) == [None] * 3          # 3 layers: too few


def _attention_slower_in(slow: set[int], layers: int = 4, slow_us: int = 300,
                         router_in: frozenset[int] = frozenset(),
                         slow_router_us: int = 50, name: str = "layer[{i}]") -> Trace:
    """Two steps of ``layers`` layer ranges (``name``) of one kernel sequence whose attention
    takes ``slow_us`` in the layers ``slow`` and 100 µs in the others; the layers ``router_in``
    also run a router kernel of 50 µs (``slow_router_us`` in the layers ``slow``)."""
    b = TraceBuilder()
    for step in range(2):
        step_start = b.clock
        for i in range(layers):
            start = b.clock
            b.sequence(["rmsnorm"], duration=10_000)
            b.sequence(["flash_attention"], duration=(slow_us if i in slow else 100) * 1000)
            if i in router_in:
                b.sequence(["topk_softmax"],
                           duration=(slow_router_us if i in slow else 50) * 1000)
            b.sequence(["gemm_o_proj", "fused_moe_kernel"], duration=200_000)
            b.range(name.format(i=i), start - 5, b.clock)
        b.range(f"decode_step[{step}]", step_start - 10, b.clock)
        b.clock += 5000
    return b.build()


def test_one_odd_layer_of_four_is_no_group_of_its_own():
    """Four layers, the last one's attention three times the others': each group must hold
    two layers at least, so one odd layer makes no two groups (it is an outlier, not layers
    of another kind); two of the four do."""
    (t,) = breakdown(_attention_slower_in({3})).layer_types
    assert t["layers"] == 8 and "two_groups" not in t
    (t,) = breakdown(_attention_slower_in({1, 3})).layer_types
    assert [(g["figure"], g["low_layers"], g["high_layers"]) for g in t["two_groups"]] == [
        ("attention", 2, [1, 3])]


def test_two_groups_from_exactly_the_ratio_and_a_median_at_a_groups_edge_is_of_it():
    """Attention of 150 µs in half the layers and 100 in the others is exactly 1.5 times:
    two groups. Three slower layers of eight put the type's median (100 µs) at the lower
    group's largest: of that group, not between the groups. A class only some layers of one
    named type run (0 µs in the others) makes no group of zeros."""
    (t,) = breakdown(_attention_slower_in({1, 3, 5, 7}, layers=8, slow_us=150)).layer_types
    assert [(g["figure"], g["low_us"], g["high_us"]) for g in t["two_groups"]] == [
        ("attention", 100.0, 150.0)]
    (t,) = breakdown(_attention_slower_in({1, 3, 5}, layers=8, slow_us=200)).layer_types
    (group,) = t["two_groups"]
    assert t["classes"]["attention"]["us"] == group["low_us"] == 100.0
    assert group["high_layers"] == [1, 3, 5] and group["median_between"] is False
    (t,) = breakdown(_attention_slower_in(set(), layers=8, router_in=frozenset({1, 3, 5, 7}),
                                          name="layer[{i}](kda)")).layer_types
    assert t["classes"]["router"]["kernels"] == 0.5 and "two_groups" not in t


def test_two_groups_of_several_classes_list_the_widest_apart_first():
    """The slower layers' attention 200 µs above the others' and their router 100 µs above:
    both classes fall in two groups, the attention's (the wider apart) first."""
    trace = _attention_slower_in({1, 3, 5, 7}, layers=8, router_in=frozenset(range(8)),
                                 slow_router_us=150)
    (t,) = breakdown(trace).layer_types
    assert [(g["figure"], g["low_us"], g["high_us"]) for g in t["two_groups"]] == [
        ("attention", 100.0, 300.0), ("router", 50.0, 150.0)]


def test_work_in_no_step_names_the_range_of_the_traces_first_launch():
    """A warm-up kernel before the first step, launched by the trace's first API call (row
    0 of its calls), in a 'warmup' range: counted in no step and said to have been launched
    in 'warmup', as any other launch is."""
    from kimi_perf.layer_breakdown import step_notes

    b = TraceBuilder()
    start = b.clock
    b.sequence(["warmup_gemm"])
    b.range("warmup", start - 5, b.clock)
    b.clock += 5000
    for step in range(2):
        step_start = b.clock
        b.sequence(["embedding"])
        for i, kernels in enumerate(k3_like(4)):
            first, last = b.sequence(kernels)
            b.range(f"layer[{i}]", first - 10, last)
        b.range(f"decode_step[{step}]", step_start - 20, b.clock)
        b.clock += 5000
    result = breakdown(b.build())
    assert result.source["outside_steps"] == {"ops": 1, "kernel_us": 1.0, "unlaunched": 0,
                                              "in_ranges": [{"range": "warmup", "ops": 1}]}
    assert "1 more GPU op (1.0 µs) ran in no step: launched outside every step's range (in " \
           "'warmup' 1)" in step_notes(result)


def test_a_layer_ranges_pattern_digest_is_of_its_kernels_as_they_ran():
    """Layer ranges that name no type are lettered by their kernel sequence, and their
    ``pattern`` digests it as it ran (rmsnorm first: a reordering is a change of the layer),
    not its least rotation, which the repeating pattern's types take (it starts at
    flash_attention)."""
    import hashlib

    (t,) = breakdown(_attention_slower_in(set())).layer_types
    ran = ["rmsnorm", "flash_attention", "gemm_o_proj", "fused_moe_kernel"]
    assert [k["name"] for k in t["typical_layer"]["kernels"]] == ran

    def digest(names: list[str]) -> str:
        return hashlib.sha1("\0".join(names).encode(), usedforsecurity=False).hexdigest()[:12]

    assert t["pattern"] == digest(ran) != digest([*ran[1:], ran[0]])


def test_the_classes_layers_ran_leave_out_a_class_of_no_kernels_in_rows_read_as_dicts():
    """Layer rows read back as dicts (a stored breakdown's) that give a class with no kernels
    (0 kernels, 0 µs): the layers did not run it, and the classes they ran are those of the
    rows as held."""
    from kimi_perf.layer_breakdown import layer_classes

    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=4).build())
    kind = b.layer_types[0]["type"]
    rows = copy.deepcopy(list(b.layers))
    rows[0]["classes"]["never_ran"] = {"kernels": 0, "us": 0.0}
    assert "never_ran" not in layer_classes(rows, kind)
    assert layer_classes(rows, kind) == layer_classes(b.layers, kind) != []


def test_a_range_name_the_strings_hold_twice_repeats_only_as_one_name_would():
    """A trace whose string table holds 'Forward' twice (a hand-built trace's), one range of
    each spelling on its own thread: as one name, it ran once per thread, no repeating range
    (as two ranges of one code on two threads are not)."""
    from kimi_perf.layer_breakdown import repeating_ranges

    b = TraceBuilder()
    for tid in (1, 2):
        start, end = b.sequence(["gemm", "norm"] * 4, tid=tid)
        b.range("Forward", start, end, tid=tid)
    trace = b.build()
    assert repeating_ranges(trace) == []
    trace.strings = [*trace.strings, "Forward"]
    trace.ranges.name[np.flatnonzero(trace.ranges.tid == 2)] = len(trace.strings) - 1
    assert repeating_ranges(trace) == []


def test_a_kernel_spread_is_its_10th_to_90th_percentile_over_the_layers():
    """11 layers whose kernel takes 10, 20, ... 110 µs: its spread is the 10th percentile (20)
    to the 90th (100), as SPREAD_NOTE says, not the quartiles (35 to 85)."""
    from kimi_perf.layer_breakdown import SPREAD_NOTE, kernel_spreads

    assert "the 10th to 90th percentile" in SPREAD_NOTE
    assert kernel_spreads(np.arange(1, 12)[:, None] * 10_000) == [[20.0, 100.0]]


def test_a_step_without_layers_draws_exactly_its_first_timeline_ops(monkeypatch):
    """A step of 12 kernels in no layer, drawn by stream with TIMELINE_OPS at 5: its first 5
    ops are drawn (all 5, not one fewer), and the 7 more are said to be left out."""
    from kimi_perf import layer_breakdown

    b = TraceBuilder()
    start, end = b.sequence([f"kernel_{i}" for i in range(12)])
    b.range("decode_step[0]", start - 10, end)
    monkeypatch.setattr(layer_breakdown, "TIMELINE_OPS", 5)
    timeline = breakdown(b.build()).timeline
    assert timeline["by_stream"] and timeline["ops_left_out"] == 7
    (segment,) = timeline["segments"]
    assert [timeline["names"][op[0]] for op in segment["ops"]] == [
        f"kernel_{i}" for i in range(5)]


def test_a_breakdown_stored_before_steps_said_how_they_found_layers_may_be_the_patterns():
    """Layer ranges that name no type are no kernel pattern's, so its note of outsized types
    is not said of them; the same breakdown with its steps' layer_source dropped (stored
    before steps said it) may have been found by the pattern, and the note is said."""
    from kimi_perf.layer_breakdown import outsized_types_note, pattern_found

    b = _untyped_layers([ATTENTION_LAYER] * 3 + [MOE_LAYER * 10])
    assert not pattern_found(b) and outsized_types_note(b) is None
    for step in b.steps:
        del step["layer_source"]
    assert pattern_found(b) and outsized_types_note(b) is not None


def test_a_straggler_s_line_gives_tested_columns_first_then_those_untested():
    """Under a table of traces, each slowest trace in the order its first column names it:
    the columns tested against the fastest with their p, then those too few spans could
    test, together, by the ratio alone; a trace slowest in nothing is not named."""
    from kimi_perf.comparison import Spread, straggler_evidence

    spread = [Spread(None, 10.0, 12.0, "rank3"),
              Spread("kda", 5.0, 9.0, "rank1", p_value=0.0012, alpha=0.05, tested_over="steps"),
              Spread("mla", 4.0, 6.0, "rank3", p_value=0.031, alpha=0.05, tested_over="layers"),
              Spread("moe", 3.0, 3.3, "rank3"),
              Spread("dense", 2.0, 2.0, None)]
    assert straggler_evidence(spread) == {
        "rank3": "mla p 0.031 over layers; step, moe by the ratio alone: too few spans to test",
        "rank1": "kda p 0.0012 over steps"}
    assert list(straggler_evidence(spread)) == ["rank3", "rank1"]
    assert straggler_evidence(spread[-1:]) == {}


def test_comparison_headline_says_one_kernel_and_names_b_s_unit_only_where_it_differs():
    """The headline's count reads "1 kernel", not "1 kernels"; B's count carries its unit only
    where B counts another thing (a CPU run's ops), not where it was given as A's own."""
    from kimi_perf.comparison import ComparisonRow
    from kimi_perf.render import comparison_headline

    rows = [ComparisonRow(type="lm_head", layers_a=1, kernels_a=1, kernel_us_a=2.0,
                          span_us_a=2.5, layers_b=1, kernels_b=1, kernel_us_b=1.0,
                          span_us_b=1.25),
            ComparisonRow(type="mla", layers_a=4, kernels_a=12, kernel_us_a=20.0,
                          span_us_a=25.0, layers_b=4, kernels_b=9, kernel_us_b=10.0,
                          span_us_b=12.5)]
    alike = ("lm_head: 1 kernel / 2.5 µs (A) vs 1 / 1.2 µs (B)\n"
             "mla: 12 kernels / 25.0 µs (A) vs 9 / 12.5 µs (B)")
    assert comparison_headline(rows, "A", "B") == alike
    assert comparison_headline(rows, "A", "B", "kernels", "kernels") == alike
    assert comparison_headline(rows, "A", "B", "kernels", "ops") == (
        "lm_head: 1 kernel / 2.5 µs (A) vs 1 ops / 1.2 µs (B)\n"
        "mla: 12 kernels / 25.0 µs (A) vs 9 ops / 12.5 µs (B)")


def test_a_typical_layer_table_counts_its_kernels_and_says_which_side_has_no_such_layer():
    """Under a typical layer's table: how many kernels it runs and their medians summed, how
    many of the type's layers ran exactly that sequence; side by side, each side named, and
    a side without the type says so."""
    from kimi_perf.render import typical_layer_table

    b = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=8).build())
    mla = next(t for t in b.layer_types if t["type"] == "mla")
    assert len(mla["typical_layer"]["kernels"]) == len(MLA) == 16
    assert typical_layer_table("mla", {"": mla}).caption == (
        "16 kernels, 16.0 µs, their medians summed; 4 of 4 mla layers ran exactly this "
        "sequence")
    table = typical_layer_table("mla", {"a": mla, "b": None})
    assert table.caption == ("a: 16 kernels, 16.0 µs, their medians summed; 4 of 4 mla layers "
                             "ran exactly this sequence\nb: no mla layer")
    assert table.row_count == 16


def test_every_name_a_report_takes_from_a_trace_is_escaped_wherever_it_is_shown(tmp_path):
    """Kernel, range and trace names holding <, >, & and quotes are escaped in the page's
    tables (a quote too inside the title attribute a typical layer's kernel shows on hover),
    and for plotly, which reads HTML tags in its text: the hover text of a kernel's bar, the
    timeline's axis titles and the class chart's categories; none is written raw."""
    from kimi_perf.report import write_report

    b = TraceBuilder()
    for s in range(3):
        start = b.clock
        b.sequence(["embedding"])
        for i in range(2):
            first, last = b.sequence(["gemm<a&b>", 'void k<"q">(int)'], duration=1000 + 100 * s)
            b.range(f"layer[{i}](kda)", first - 10, last)
        b.range(f"decode_step<{s}>", start - 20, b.clock)
        b.clock += 5000
    result = breakdown(b.build(), step_regex=r"decode_step<\d+>")
    text = write_report(tmp_path / "r.html", {"a<b>": result, "c&d": result}, "t",
                        plotly_js="cdn").read_text()
    for raw in ("gemm<a", 'k<"q">', "decode_step<", "a<b>", "c&d"):
        assert raw not in text, raw
    assert "<h3>a&lt;b&gt;</h3>" in text and "<h3>c&amp;d</h3>" in text
    assert text.count("<td class=name>decode_step&lt;0&gt;</td>") == 2
    assert '<td class=name title="gemm&lt;a&amp;b&gt;">gemm&lt;a&amp;b&gt;</td>' in text
    assert ('<td class=name title="void k&lt;&quot;q&quot;&gt;(int)">k&lt;&quot;q&quot;&gt;'
            "</td>") in text   # (the short name in the cell, the whole one on hover)
    timelines, classes = _report_figures(text)
    gemm = next(t for t in timelines["data"] if t["name"] == "gemm")
    assert gemm["hovertext"][0] == "gemm&lt;a&amp;b&gt;<br>gemm, 1.10 µs at 1.10 µs"
    assert timelines["layout"]["yaxis"]["title"]["text"] == "a&lt;b&gt;"
    assert timelines["layout"]["xaxis"]["title"]["text"] == ("µs into decode_step&lt;1&gt; "
                                                             "(median-span step)")
    assert classes["data"][0]["x"] == ["kda<br>a&lt;b&gt;", "kda<br>c&amp;d"]


def test_timelines_exactly_shared_axis_spans_apart_still_share_an_axis():
    """Sizes SHARED_AXIS_SPANS apart exactly are alike (within the factor, not past it); one
    past the factor of the group's smallest starts a group of its own."""
    from kimi_perf.report import SHARED_AXIS_SPANS, alike_groups

    assert SHARED_AXIS_SPANS == 10.0
    assert alike_groups({"a": 1.0, "b": 10.0, "c": 10.5}) == [["a", "b"], ["c"]]
    assert alike_groups({"b": 10.0, "a": 1.0, "c": 0.5}) == [["b", "a"], ["c"]]


def test_a_layer_type_named_with_markup_is_escaped_in_every_table_of_the_report(tmp_path):
    """A stored breakdown edited by hand may name a layer type with <, > and &: it is escaped
    in one trace's table of its types, in the comparison of two, in the typical layer's
    heading, in the overview of three and in the class chart's categories."""
    from kimi_perf.report import write_report

    doc = breakdown(nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=8).build()).to_json()
    b = Breakdown.from_json(json.loads(json.dumps(doc).replace('"mla"', '"mla<&>"')))
    assert [t["type"] for t in b.layer_types] == ["kda", "mla<&>"]
    pages = [write_report(tmp_path / f"{n}.html", {label: b for label in "xyz"[:n]}, "t",
                          plotly_js="cdn").read_text() for n in (1, 2, 3)]
    for page in pages:
        assert "mla<" not in page
    one, two, three = pages
    assert "<tr><td>mla&lt;&amp;&gt;</td>" in one and "<tr><td>mla&lt;&amp;&gt;</td>" in two
    assert "<h3>Typical mla&lt;&amp;&gt; layer: kernels in order, median µs</h3>" in two
    assert "<th>mla&lt;&amp;&gt; µs</th>" in three
    assert _report_figures(two)[1]["data"][0]["x"] == ["kda<br>x", "mla&lt;&amp;&gt;<br>x",
                                                      "kda<br>y", "mla&lt;&amp;&gt;<br>y"]
