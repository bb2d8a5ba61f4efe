"""Smoke test for the benchmarks: both scripts run end to end on tiny traces (--quick, a few
seconds in all) and print their tables. HTA is never run here (--skip-hta)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, out: Path, *options: str, returncode: int = 0) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--skip-hta", "--out", str(out),
         *options], capture_output=True, text=True, timeout=120)
    assert proc.returncode == returncode, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One work dir for both scripts: the second reuses the nsys trace the first generated.
    return tmp_path_factory.mktemp("bench-out")


def test_bench_trace_core_quick(out: Path) -> None:
    text = _run("bench_trace_core.py", out)
    assert "kernels/s" in text
    # The synthetic traces read back as generated: steps, layers, no kernel outside a range.
    assert text.count("as generated") == 2, text
    assert "not measured (--skip-hta)" in text


def test_bench_trace_core_fails_a_trace_read_otherwise_than_generated(out: Path,
                                                                      tmp_path: Path) -> None:
    """The sanity check is the run's verdict: a trace read back otherwise than its generator
    wrote it (here, its total kernel time) exits 1 and says what differs (it printed the
    counts that matched, and exited 0). Two rounds: medians, and the verdicts say so."""
    _run("bench_trace_core.py", out)
    for meta in out.glob("*.meta"):
        (tmp_path / meta.name).write_text(meta.read_text())
        trace = meta.with_suffix("")
        (tmp_path / trace.name).symlink_to(trace)
    sqlite_meta = next(tmp_path.glob("*.sqlite.meta"))
    info = json.loads(sqlite_meta.read_text())
    info["kernel_ns"] += 1
    sqlite_meta.write_text(json.dumps(info))
    text = " ".join(_run("bench_trace_core.py", tmp_path, "--repeat", "2",
                         returncode=1).split())   # (lines wrapped at 132 columns)
    assert f"read otherwise than generated: {info['kernel_ns'] - 1:,} ns of kernel time, " \
           f"not {info['kernel_ns']:,}" in text
    assert text.count("as generated") == 1 and "medians of 2 rounds" in text
    assert "target (all 2 rounds)" in text and "(rounds " in text


def test_bench_trace_core_verdicts_say_how_many_rounds_met_the_target() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_trace_core as core
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert core.verdict([2.9], lambda x: x < 3) == "[green]meets target[/]"
    assert core.verdict([3.1, 2.9, 3.0], lambda x: x < 3) == \
        "[yellow]meets target in 1 of 3 rounds[/]"
    assert core.verdict([3.1, 3.2], lambda x: x < 3) == "[red]misses target[/] (all 2 rounds)"
    rounds = [{"phases": {"read": t, "breakdown": b}, "rss_base": 4, "rss_read": 5, "rss_peak": p}
              for t, b, p in ((1.0, 9.0, 10), (3.0, 1.0, 30), (2.0, 1.0, 20))]
    got = core.medians(rounds)
    assert got["phases"] == {"read": 2.0, "breakdown": 1.0} and got["rss_peak"] == 20
    # the median of the rounds' totals (10, 4, 3), not the phases' medians summed (3)
    assert core.total(got) == 4.0 and got["rounds"] == rounds and got["rss_base"] == 4
    assert core.medians([*rounds, {"error": "exit 1"}]) == {"error": "exit 1"}


@pytest.mark.parametrize("script", ["bench_trace_core.py", "bench_trace_io.py"])
@pytest.mark.parametrize("option, said", [("--kernels=0", "0 is not 1 or more"),
                                          ("--repeat=-1", "-1 is not 1 or more"),
                                          ("--layers=x", "'x' is not a whole number"),
                                          ("--out=FILE", "is a file, not a folder")])
def test_benchmarks_refuse_bad_options(script: str, option: str, said: str,
                                       tmp_path: Path) -> None:
    """A count under 1 generated a trace of -5 kernels and read it back "as generated"; an
    --out that is a file, a repeat of 0: tracebacks."""
    (tmp_path / "FILE").write_text("")
    option = option.replace("FILE", str(tmp_path / "FILE"))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), option],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert said in proc.stderr.splitlines()[-1]


def test_bench_trace_io_quick(out: Path) -> None:
    text = _run("bench_trace_io.py", out)
    assert "kernels/s" in text
    for label in ("Arrow IPC (project)", "Parquet (zstd)", "numpy .npz"):
        assert label in text


def test_gpu_decode_check_plumbing_on_the_cpu(tmp_path):
    """The one-call GPU check, run with tiny shapes on this CPU: it must get to its summary."""
    import json

    # a budget no CPU's pace can spend: every section runs (the budget's skips: below)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_decode_check.py"), "--smoke",
                           "--budget-s", "1e6", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == []
    assert all(r["ok"] for r in results["correctness"].values())
    assert results["seconds_before_start"] == 0    # (no GPU_CHECK_STARTED: run directly)
    assert {"specialized+grouped", "specialized+pdl", "specialized+pdl+prefetch",
            "standard+mxfp4", "specialized+mxfp4", "specialized+grouped+mxfp4"} <= set(
        results["correctness"])
    split = results["correctness"]["kda_decode split"]   # the arrival protocol, launched again
    assert split["launches"] == 4 and split["arrivals_left"] == 0 and split["conv_state_exact"]
    speed = results["speed"]
    assert set(speed) == {"standard b1", "specialized b1", "specialized+l2 b1", "standard b2",
                          "specialized b2", "specialized+grouped b2"}
    grouped = {t["type"]: t["kernels"] for t in speed["specialized+grouped b2"]["layer_types"]}
    assert grouped == {"dense": 7, "kda": 10, "mla": 13}    # routing in a launch of its own
    prefetch = {t["type"]: t["kernels"] for t in speed["specialized+l2 b1"]["layer_types"]}
    assert prefetch == {"dense": 8, "kda": 10, "mla": 13}
    kernels = {t["type"]: t["kernels"] for t in speed["specialized b1"]["layer_types"]}
    assert kernels == {"dense": 7, "kda": 9, "mla": 12}
    # on this CPU the standard path runs its PyTorch ops; a GPU runs StandardKernelsModel
    assert speed["standard b1"]["model"] == "K3Model"
    # both paths first, the opt-ins after (their correctness checked between)
    assert list(speed)[:4] == ["standard b1", "specialized b1", "standard b2", "specialized b2"]
    assert all(r["logits_finite"] for r in speed.values())
    assert speed["standard b1"]["tokens"] == speed["specialized b1"]["tokens"]
    # each run's first decode step against the standard path's first run at its batch
    assert "first_step_vs_standard" not in speed["standard b1"]
    first_steps = [r["first_step_vs_standard"] for k, r in speed.items()
                   if not k.startswith("standard ")]
    bound = _gpu_check().FIRST_STEP_BOUND
    assert len(first_steps) == 4 and all(0 <= d <= bound for d in first_steps)
    assert max(first_steps) > 0   # bf16 sums in another order: not bitwise the same
    assert len(speed["standard b2"]["tokens"]) == 2
    assert "| run | model | layer type |" in proc.stdout
    assert "| standard vs specialized | b1 | kda | 18 vs 9 |" in proc.stdout  # side by side
    assert "| specialized vs specialized+l2 | b1 | kda | 9 vs 10 |" in proc.stdout
    assert "| specialized vs specialized+grouped | b2 | mla | 12 vs 13 |" in proc.stdout
    assert results["skipped"] == []
    assert results["gemv"] == {"skipped": "no GPU"}   # CuTe DSL cubins launch on a GPU only
    assert "GEMV side by side: skipped (no GPU)" in proc.stdout
    job = results["main_job"]["eager"]        # kimi-perf trace, as a user runs it
    assert job["returncode"] == 0 and set(job["decode_tokens_per_s"]) == {"standard",
                                                                          "specialized"}
    assert "  decode tokens/s: standard " in proc.stdout
    spec = results["main_job"]["spec3"]       # and with speculative verify steps
    assert spec["returncode"] == 0 and "--spec-tokens 3" in spec["command"]
    assert {t["type"]: t["kernels"] for t in spec["layer_types"]["specialized"]} == kernels
    assert "  decode tokens/s (accepted tokens, synthetic acceptance): standard " in proc.stdout
    assert {t["type"]: t["kernels"] for t in job["layer_types"]["specialized"]} == kernels
    mxfp4 = results["main_job"]["mxfp4"]      # and on K3's MXFP4 experts: the same launches
    assert mxfp4["returncode"] == 0 and "--experts mxfp4" in mxfp4["command"]
    assert {t["type"]: t["kernels"] for t in mxfp4["layer_types"]["specialized"]} == kernels
    # What the device call returns: at most 8 files of 16 MiB, so the traces and the run
    # directories come packed, in parts.
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["evidence.tar.gz.part0", "results.json", "summary.md"]
    assert results["evidence"]["parts"] == 1 and "evidence: " in proc.stdout
    import tarfile

    with tarfile.open(tmp_path / "evidence.tar.gz.part0") as tar:
        names = tar.getnames()
    # packed the most wanted first (a cut archive loses the end): the speed runs' traces in
    # the order they ran, then the main job's run directories, their normalised traces last
    assert names[:len(speed)] == [f"evidence/{r['trace']}" for r in speed.values()]
    assert names.index(f"evidence/{speed['specialized+l2 b1']['trace']}") < min(
        i for i, n in enumerate(names) if n.startswith("evidence/runs/"))
    kptrace = [i for i, n in enumerate(names) if n.endswith(".kptrace")]
    assert kptrace and min(kptrace) > max(i for i, n in enumerate(names)
                                          if not n.endswith(".kptrace"))
    runs = [n for n in names if n.startswith("evidence/runs/") and n.endswith("/report.html")]
    assert len(runs) == 3


def test_gpu_check_skips_what_its_budget_cannot_fit(tmp_path):
    """With too little time for the speed runs the check skips them and the opt-ins' checks,
    says so, and still runs what fits (the main job), instead of being killed with nothing
    written. The budget's clock is held at a time left (this machine's pace would otherwise
    decide what fits)."""
    import json

    check = _gpu_check()
    left = check.RESERVE_AFTER_SPEED_S - 10        # under what a speed run or the GEMVs keep
    assert left > check.MIN_MAIN_JOB_S + check.BUDGET_MARGIN_S   # a main-job run fits
    held = (f"import runpy, sys; sys.argv = sys.argv[1:]; g = runpy.run_path(sys.argv[0]); "
            f"g['Budget'].left = lambda self: {left}; sys.exit(g['main']())")
    proc = subprocess.run([sys.executable, "-c", held, str(BENCHMARKS / "gpu_decode_check.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["speed"] == {} and "gemv" not in results
    # both paths' checks are not budgeted (a path is checked before it is timed), nor the
    # kernels' against their references
    assert set(results["correctness"]) == {
        "standard", "specialized", "kda_decode split", "mla_attention bf16 cache",
        "mla_attention fp8 cache", "skinny_linear gemm rmsnorm+residual"}
    assert all(r["ok"] for r in results["correctness"].values())
    skipped = [s.split(":")[0] for s in results["skipped"]]
    assert skipped == ["standard b1", "specialized b1", "standard b2", "specialized b2",
                       *(f"correctness {name}" for name in check.OPT_IN_CHECKS),
                       "specialized+l2 b1", "specialized+grouped b2", "gemv"]
    assert list(results["main_job"]) == [key for key, _ in check.SMOKE_MAIN_JOB_MODES]
    assert all(r["returncode"] == 0 for r in results["main_job"].values())
    summary = (tmp_path / "summary.md").read_text()
    assert f"skipped standard b1: {left} s left of the budget" in summary
    assert "skipped correctness specialized+pdl: " in summary and summary in proc.stdout


def test_gpu_check_main_job_gives_each_run_the_time_left(monkeypatch, tmp_path):
    """Each ``kimi-perf trace`` run may take all the time left (a share of it would have
    killed two runs of 80 s in 140 s), and the next begins only where the time left fits one
    as long as the last: here, on a clock each run advances by its (made-up) seconds."""
    import json

    check = _gpu_check()
    now = [0.0]
    budget = check.Budget(150 + check.BUDGET_MARGIN_S, clock=lambda: now[0])
    took = {"graphs": 80.0, "graphs spec3": 65.0}
    timeouts = []

    def trace(args, timeout, **_):
        key = next(k for k, options in check.MAIN_JOB_MODES if args[10:] == options)
        timeouts.append(timeout)
        now[0] += took[key]
        doc = {"run_dir": f"runs/{key}", "paths": {}, "run": {"paths": {}}}
        return subprocess.CompletedProcess(args, 0, json.dumps(doc), "")

    monkeypatch.setattr(check.subprocess, "run", trace)
    runs: dict = {}
    check.main_job(tmp_path, False, budget, runs, lambda: None)
    assert list(runs) == ["graphs"] and timeouts == [150]
    assert runs["graphs"]["seconds"] == 80.0
    assert [s.split(":")[0] for s in budget.skipped] == [
        f"kimi-perf trace ({key})" for key, _ in check.MAIN_JOB_MODES[1:]]
    assert budget.skipped[0].endswith("80 s left of the budget, 90 s needed")
    # with the time for two: the second given what the first left
    now[0] = 0.0
    budget = check.Budget(170 + check.BUDGET_MARGIN_S, clock=lambda: now[0])
    timeouts.clear()
    runs = {}
    took["graphs"] = 60.0
    check.main_job(tmp_path, False, budget, runs, lambda: None)
    assert list(runs) == ["graphs", "graphs spec3"] and timeouts == [170, 110]


def test_gpu_check_admits_the_paths_a_pair_at_a_time(monkeypatch, tmp_path):
    """Both paths' runs at a batch and mode are admitted together: where the time left fits
    one run but not two, neither runs (the standard path's alone compared with nothing, and
    its time went to no comparison); batch 1 first, under graphs and then eagerly. Here on a
    clock each run advances by 30 s, every other section taking none."""
    import argparse
    import time
    import types

    import torch

    check = _gpu_check()
    now = [0.0]
    ran = []

    def speed(path, c, weights_of, batch, context, warmup, steps, device, out, bandwidth,
              graphs, gemv=None, control=False):
        now[0] += 30
        ran.append(f"{path} b{batch}{' graphs' if graphs else ''}")
        return {"first_step_logits": torch.ones(3), "logits_finite": True,
                "replayed_kernels_mapped_to_capture": 1}

    for name, value in {
            "speed": speed, "environment": lambda device: {}, "device_facts": lambda *a: {},
            "copy_bandwidth": lambda *a: 1e12, "kernel_references": lambda *a, **k: {},
            "correctness": lambda device, steps, names, allows=lambda n: True: {
                n: {"ok": True, "max_rel_err": 0.0} for n in names if allows(n)},
            "kda_split_stress": lambda *a, **k: {"ok": True, "max_rel_err": 0.0},
            "gemv_side_by_side": lambda *a: {"skipped": "stand-in"},
            "main_job": lambda *a: None, "save": lambda *a: None,
            "render_summary": lambda results: ""}.items():
        monkeypatch.setattr(check, name, value)
    # the sections' own clock too (a run's seconds decide what fits after it)
    monkeypatch.setattr(check, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], perf_counter=lambda: now[0], time=time.time))
    # the first pair fits, then 160 s are left: one run (30 + 115 kept) would fit, two not
    left = 30 + check.RESERVE_AFTER_SPEED_S + 15
    budget = check.Budget(60 + left, clock=lambda: now[0])
    args = argparse.Namespace(smoke=False, layers=5, context=64, steps=2, warmup=1,
                              cubins=None, out=tmp_path)
    results = {"errors": [], "warnings": [], "skipped": budget.skipped}
    assert check.run_sections(args, budget, results, tmp_path, "cuda", 0.0) == 0
    assert ran[:2] == ["standard b1 graphs", "specialized b1 graphs"]
    assert not any(key.startswith(("standard", "specialized ")) for key in ran[2:])
    assert results["skipped"][:2] == [
        f"standard b1: {left:.0f} s left of the budget, "
        f"{2 * 30 + check.RESERVE_AFTER_SPEED_S:.0f} s needed",
        "specialized b1: skipped with standard b1, beside which it runs"]
    assert [s.split(":")[0] for s in results["skipped"][2:6]] == [
        "standard b64 graphs", "specialized b64 graphs", "standard b64", "specialized b64"]
    assert ran[2:] == ["specialized+l2 b1 graphs"]   # (the opt-ins, each beside a run made)


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  BENCHMARKS / "gpu_decode_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_gpu_check_runs_the_specialized_path_with_the_opt_in_gemv(tmp_path):
    """``specialized+cute``: the GPU check's run of the specialized path with the CuTe DSL
    GEMV, here with a stand-in for its launcher."""
    pytest.importorskip("torch")
    from kimi_perf.decode.config import preset
    from kimi_perf.decode.weights import random_weights
    from kimi_perf_kernels.cute_gemv import decode_shapes
    from tests.kernels.util import RecordingGemv

    c = preset("tiny", n_layers=2)
    gemv = RecordingGemv(decode_shapes(c))
    r = _gpu_check().speed("specialized+cute", c, lambda: random_weights(c, seed=1), 1, 4, 1,
                           1, "cpu", tmp_path, 1e11, False, gemv=gemv)
    assert r["model"] == "SpecializedModel" and gemv.calls
    # layer 0 (KDA, dense MLP) and the last, gated MLA: the launches of the path without it
    assert {t["type"]: t["kernels"] for t in r["layer_types"]} == {"dense": 7, "mla": 12}
    assert (tmp_path / "specialized+cute_b1.trace.json.gz").exists()


def test_gpu_check_summary_puts_the_gemvs_side_by_side():
    """The GEMV table of the GPU check's summary, from a results document shaped as the GPU
    writes it (one implementation failed on one build)."""
    check = _gpu_check()
    build = {"name": "o_proj", "m": 1, "n": 7168, "k": 1536, "rows": 8, "warps": 6,
             "registers": 48, "floor_us": 4.6, "cute_us": 6.0, "triton_us": 9.0,
             "cublas_us": 7.5, "cute_err": 1e-3, "triton_err": 2e-3, "cublas_err": 1e-3}
    failed = {**build, "m": 4, "cute_error": "CUDADriverError: launch failed"}
    del failed["cute_us"], failed["cute_err"]
    results = {"date": "2026-11-30", "environment": {"gpus": ["NVIDIA H200"], "torch": "2.11"},
               "copy_bandwidth_Bps": 4.3e12, "errors": [],
               "gemv": {"l2_bytes": 52428800, "builds": [build, failed]}}
    text = check.render_summary(results)
    good = {f"{lb}_{what}": value for lb in ("cute", "triton", "cublas")
            for what, value in (("err", 3e-3), ("max_err", 8e-3), ("graph_err", 8e-3))}
    good.update(build)
    assert check.gemv_errors({"builds": [good]}) == []
    bad = {**good, "cute_max_err": 0.05, "triton_graph_err": 0.5, "cublas_us": 1.0}
    del bad["cute_us"]
    bad["cute_error"] = "CUDADriverError: launch failed"
    errors = check.gemv_errors({"builds": [{**good, "cute_max_err": 0.05},
                                           {**good, "triton_graph_err": 0.5},
                                           {**good, "cublas_us": 1.0}, bad]})
    where = [f"gemv o_proj M=1 {lb}" for lb in ("cute", "triton")]
    assert [e.split(": ")[0] for e in errors] == where + where
    assert "timed graph" in errors[1]
    # a time under the floor may be weights read in part from L2: a warning, for each
    assert check.gemv_warnings({"builds": [{**good, "cublas_us": 1.0}, bad]}) == [
        "gemv o_proj M=1 cublas: 1.00 µs is under 0.7x the memory floor 4.60 µs"] * 2
    assert "| o_proj | 1 | 7168×1536 | 6.00 | 9.00 | 7.50 | 4.60 | 1.50 | 1.25 | " \
           "1.0e-03 / 2.0e-03 |" in text
    assert "| o_proj | 4 | 7168×1536 | failed | 9.00 | 7.50 | 4.60 | - | - | - / 2.0e-03 |" \
        in text


def test_gpu_check_evidence_comes_back_in_parts(tmp_path, monkeypatch):
    """Larger evidence is cut into parts under the device's file size; the parts join into
    the tarball again, stale parts of an earlier save go, and past the parts the device
    returns the archive is cut there, and flagged."""
    import io
    import os
    import tarfile

    check = _gpu_check()
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "runs").mkdir(parents=True)
    blob = os.urandom(3 << 20)                     # incompressible: about 3 MiB packed
    (work / "runs" / "trace.bin").write_bytes(blob)
    out.mkdir()
    (out / "evidence.tar.gz.part9").write_bytes(b"stale")
    monkeypatch.setattr(check, "EVIDENCE_PART_BYTES", 1 << 20)
    monkeypatch.setattr(check, "render_summary", lambda results: "")
    results = {"errors": []}
    check.save(results, out, work)
    parts = sorted(out.glob("evidence.tar.gz.part*"), key=lambda p: int(p.name[20:]))
    assert len(parts) == results["evidence"]["parts"] == 4
    assert all(p.stat().st_size <= 1 << 20 for p in parts)
    joined = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        assert tar.extractfile("evidence/runs/trace.bin").read() == blob
    assert "warning" not in results["evidence"]
    monkeypatch.setattr(check, "EVIDENCE_PARTS", 3)
    check.save(results, out, work)
    assert "4 parts made, 3 kept" in results["evidence"]["warning"]
    assert len(list(out.glob("evidence.tar.gz.part*"))) == results["evidence"]["parts"] == 3


def test_gpu_check_summary_sets_each_fused_launch_against_what_it_replaced():
    """The per-launch µs of an eager GPU run (a CPU has no kernels to time per launch, so the
    figures are made up here): each specialized launch beside the standard launches whose
    work it does."""
    launch = {"floor_us": None, "floor_fraction": None, "ranges": 4}
    standard = {n: {**launch, "us_per_launch": us} for n, us in
                (("f_b_proj", 3.0), ("fused_kda_decode", 9.0), ("o_proj", 5.0))}
    specialized = {n: {**launch, "us_per_launch": us} for n, us in
                   (("fused_kda_decode", 8.0), ("o_proj", 5.0))}
    run = {"layer_types": [], "step_s": [0.01], "layer_sources": ["nvtx"], "model": "m",
           "replayed_kernels_mapped_to_capture": 0}
    results = {"environment": {"torch": "t"}, "date": "d", "copy_bandwidth_Bps": 4e12,
               "errors": [], "speed": {"standard b1": {**run, "launches": standard},
                                       "specialized b1": {**run, "launches": specialized}}}
    summary = _gpu_check().render_summary(results)
    assert "specialized b1: each launch against the standard launches it replaces" in summary
    assert "| fused_kda_decode | 8.00 | f_b_proj + fused_kda_decode | 12.00 | 1.50 |" in summary
    assert "| o_proj | 5.00 | o_proj | 5.00 | 1.00 |" in summary
    # an opt-in's run against the standard run of its batch: the grouped FC1 and its routing
    moe = {n: {**launch, "us_per_launch": us} for n, us in
           (("topk", 2.0), ("moe_fc1_situ", 30.0), ("shared_gate_up", 6.0),
            ("shared_situ_and_mul", 2.0), ("moe_fc2", 15.0), ("moe_finalize", 1.0),
            ("shared_down", 3.0))}
    grouped = {n: {**launch, "us_per_launch": us} for n, us in
               (("router_topk", 2.0), ("moe_grouped_fc1_situ_shared_gate_up", 20.0),
                ("moe_grouped_fc2_shared_down", 10.0))}
    results["speed"] = {"standard b64": {**run, "launches": moe},
                        "specialized+grouped b64": {**run, "launches": grouped}}
    summary = _gpu_check().render_summary(results)
    assert "specialized+grouped b64: each launch against the standard" in summary
    assert ("| moe_grouped_fc1_situ_shared_gate_up | 20.00 | moe_fc1_situ + shared_gate_up + "
            "shared_situ_and_mul | 38.00 | 1.90 |") in summary
    assert "| router_topk | 2.00 | topk | 2.00 | 1.00 |" in summary
    assert ("| moe_grouped_fc2_shared_down | 10.00 | moe_fc2 + moe_finalize + shared_down | "
            "19.00 | 1.90 |") in summary


def test_gpu_check_summary_sets_unprofiled_graph_steps_side_by_side():
    """Graph runs time their steps again without the profiler (CUPTI's cost per kernel falls
    on the path with more kernels): both times shown, the ratio from the unprofiled ones, and
    a GEMV under the floor a warning, not an error."""
    check = _gpu_check()
    run = {"layer_types": [], "layer_sources": ["nvtx"], "model": "m",
           "replayed_kernels_mapped_to_capture": 9}
    results = {"environment": {"torch": "t"}, "date": "d", "copy_bandwidth_Bps": 4e12,
               "errors": [], "speed": {
                   "standard b1 graphs": {**run, "step_s": [0.004, 0.005, 0.006],
                                          "unprofiled_step_s": [0.003, 0.003, 0.004],
                                          "unprofiled_before_any_profiler_step_s": [0.0025]},
                   "specialized b1 graphs": {**run, "step_s": [0.003],
                                             "unprofiled_step_s": [0.002],
                                             "first_step_vs_standard": 0.0123},
                   "standard b1": {**run, "step_s": [0.01], "first_step_vs_standard": 0.0},
                   "specialized b1": {**run, "step_s": [0.008],
                                      "first_step_vs_standard": 0.9}}}
    gemv = {"builds": [{"name": "o_proj", "m": 1, "floor_us": 10.0, "cute_us": 6.0,
                        "triton_us": 9.0, "cublas_us": 11.0}]}
    results["warnings"] = check.gemv_warnings(gemv)
    assert results["warnings"] == ["gemv o_proj M=1 cute: 6.00 µs is under 0.7x the memory "
                                   "floor 10.00 µs"]
    summary = check.render_summary(results)
    assert "| standard b1 graphs | 5.000 | 3.000 | 333 | nvtx | 9 | - |" in summary
    assert "| specialized b1 graphs | 3.000 | 2.000 | 500 | nvtx | 9 | 1.2e-02 |" in summary
    assert "| standard b1 | 10.000 | - | - | nvtx | 9 | 0.0e+00 |" in summary
    assert "| specialized b1 | 8.000 | - | - | nvtx | 9 | 9.0e-01 FAIL |" in summary
    assert ("| standard vs specialized | b1 graphs | 3.000 (3.000-4.000) | 2.000 (2.000-2.000) "
            "| 1.50 | - |") in summary
    assert ("CUPTI control, standard b1 graphs: unprofiled step 2.500 ms before the process's "
            "first profiler session, 3.000 ms after its own (ratio 1.20: over 5% apart: a "
            "cost left behind, or noise;" in summary)   # (near 1 it says no cost is left)
    assert "warning: gemv o_proj M=1 cute" in summary and "error(s)" not in summary


def test_gpu_check_lets_no_nan_pass_and_says_a_failed_check_first():
    """NaN never passes a bound (``NaN > bound`` is False, and ``max`` passes over a NaN that
    does not come first); a failed correctness check heads the summary; the unprofiled step
    times of every pair run side by side, with their spread and the tokens they share."""
    check = _gpu_check()
    nan = float("nan")
    assert max([1e-4, nan, 2e-4]) == 2e-4 and math.isnan(check.worst([1e-4, nan, 2e-4]))
    assert check.worst([1e-4, 2e-4]) == 2e-4
    good = {"name": "o_proj", "m": 1, "n": 64, "k": 64, "floor_us": 1.0}
    for label in ("triton", "cublas"):       # no cubins: the CuTe DSL GEMV did not run
        good |= {f"{label}_err": 1e-3, f"{label}_max_err": 1e-3, f"{label}_graph_err": 1e-3,
                 f"{label}_us": 2.0}
    assert check.gemv_errors({"builds": [good]}) == []
    for key in ("triton_err", "triton_max_err", "triton_graph_err"):
        assert [e.split(":")[0] for e in check.gemv_errors({"builds": [{**good, key: nan}]})
                ] == ["gemv o_proj M=1 triton"], key
    step = {"layer_types": [{"type": "kda", "layers": 2, "kernels": 9, "kernel_us": 50.0,
                             "span_us": 60.0}], "model": "SpecializedModel",
            "step_s": [0.002] * 3, "layer_sources": ["nvtx"],
            "replayed_kernels_mapped_to_capture": 40}
    speed = {"standard b1 graphs": {**step, "unprofiled_step_s": [0.004, 0.005, 0.0042],
                                    "tokens": [[1, 2, 3]]},
             "specialized b1 graphs": {**step, "unprofiled_step_s": [0.002, 0.0021, 0.003],
                                       "tokens": [[1, 2, 4]]},
             "specialized+pdl b1 graphs": {**step, "unprofiled_step_s": [0.0019] * 3}}
    results = {"date": "2026-12-03", "environment": {"gpus": ["NVIDIA H200"], "torch": "2.11"},
               "copy_bandwidth_Bps": 4.3e12, "errors": [], "speed": speed,
               "correctness": {"standard": {"max_rel_err": 1e-6, "ok": True},
                               "specialized+pdl": {"max_rel_err": nan, "ok": False}}}
    text = check.render_summary(results)
    assert text.splitlines()[1].startswith("**CORRECTNESS FAILED: specialized+pdl**")
    assert "| standard vs specialized | b1 graphs | 4.200 (4.000-5.000) | 2.100 (2.000-3.000) " \
           "| 2.00 | 2/3 |" in text
    assert "| specialized vs specialized+pdl | b1 graphs | 2.100 (2.000-3.000) | " \
           "1.900 (1.900-1.900) | 1.11 | - |" in text


def test_gpu_check_a_check_that_raises_fails_alone():
    """A correctness check that raises (an opt-in that does not compile, say) is a failed
    check with its error, and the others still run and count."""
    pytest.importorskip("torch")
    check = _gpu_check()
    out = check.correctness("cpu", 1, names=("nosuch", "standard"))
    assert out["standard"]["ok"] and out["standard"]["max_rel_err"] == 0
    assert not out["nosuch"]["ok"] and math.isnan(out["nosuch"]["max_rel_err"])
    assert out["nosuch"]["error"] == "KeyError: 'nosuch'"
    skipped = check.correctness("cpu", 1, names=("standard",), allows=lambda name: False)
    assert skipped == {}


def test_the_gpu_check_counts_a_launch_s_calls_and_weighs_its_floor_by_them():
    """A launch's µs a call are its kernels' time over its ``op:`` ranges (a launch that runs
    one kernel in KDA layers and another in MLA layers: not over the ranges of the commoner
    kernel), and its floor is the call-weighted mean of its layer types' bytes."""
    pytest.importorskip("torch")
    from kimi_perf.decode.config import preset
    from kimi_perf.decode.floors import launch_bytes
    from tests.synth import TraceBuilder

    check = _gpu_check()
    b = TraceBuilder()
    for kind in ("kda", "kda", "kda", "mla"):
        start, end = b.sequence([f"gemm_o_proj_{kind}"])
        b.range("op:o_proj", start - 5, end)
    start, end = b.sequence(["norm", "gemm"])
    b.range("op:final", start - 5, end)
    assert check.op_calls(b.build()) == {"o_proj": 4, "final": 1}
    c = preset("tiny")
    layers = [c.layer_type(i) for i in range(c.n_layers)]
    per_type = {t: launch_bytes(c, t, 2, 16).get("o_proj") for t in set(layers)}
    want = sum(per_type[t] for t in layers) / len(layers)
    assert len(set(per_type.values())) > 1   # (else the weighting would not show)
    assert check.launch_floors_bytes(c, 2, 16)["o_proj"] == pytest.approx(want)


def test_gpu_check_says_a_main_job_run_whose_output_is_unreadable(monkeypatch, tmp_path):
    """A ``kimi-perf trace`` run that exits 0 and prints nothing, or what is not its JSON,
    is an error of the check (it passed as a run without tokens/s), and a run that could not
    be started says so; the others still run."""
    check = _gpu_check()
    printed = iter(["", "not json", '{"run_dir": "runs/x", "paths": {}, "run": {"paths": {}}}'])

    def trace(args, **_):
        return subprocess.CompletedProcess(args, 0, next(printed), "the stderr tail")

    monkeypatch.setattr(check.subprocess, "run", trace)
    monkeypatch.setattr(check, "MAIN_JOB_MODES", check.MAIN_JOB_MODES[:3])
    runs: dict = {}
    check.main_job(tmp_path, False, check.Budget(3000), runs, lambda: None)
    errors = [check.main_job_error(key, r) for key, r in runs.items()
              if r["returncode"] != 0 or "unreadable" in r]
    first, second = (key for key, _ in check.MAIN_JOB_MODES[:2])
    assert [e.split(",")[0] for e in errors] == [f"kimi-perf trace ({first}) exited 0",
                                                 f"kimi-perf trace ({second}) exited 0"]
    assert "it printed no JSON on stdout" in errors[0] and "JSONDecodeError" in errors[1]
    assert all(e.endswith("stderr: the stderr tail") for e in errors)
    assert check.main_job_error("eager", {"returncode": None, "unreadable": "OSError"}) \
        .startswith("kimi-perf trace (eager) could not be started, its output unreadable")
    assert check.main_job_error("eager", {"returncode": None, "timed_out": True,
                                          "stderr_tail": "timed out: after 90 s"}) == \
        "kimi-perf trace (eager) timed out; stderr: timed out: after 90 s"
    results = {"date": "2026-12-05", "environment": {"torch": "2.11"},
               "copy_bandwidth_Bps": 4.3e12, "errors": errors, "main_job": runs}
    assert f"kimi-perf trace ({first}): exit 0, its output unreadable" in \
        check.render_summary(results)


def test_gpu_check_heads_its_summary_with_a_stress_check_that_raised(monkeypatch, tmp_path):
    """The KDA split stress check raising is a failed check (it was an error at the end of
    the summary, and no progress line), saved before the speed runs."""
    pytest.importorskip("torch")
    check = _gpu_check()

    def raises(*_, **__):
        raise RuntimeError("no such tile")

    def stop(*_, **__):
        raise SystemExit("stopped after the checks")

    monkeypatch.setattr(check, "kda_split_stress", raises)
    monkeypatch.setattr(check, "correctness", lambda *_, **__: {})
    monkeypatch.setattr(check, "preset", stop)
    monkeypatch.setattr(check, "copy_bandwidth", lambda *_: 1e12)
    results = {"date": "2026-12-05", "errors": [], "warnings": [], "skipped": []}
    args = check.argparse.Namespace(smoke=True, out=tmp_path / "out", cubins=None)
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit):
        check.run_sections(args, check.Budget(300), results, tmp_path, "cpu", 0.0)
    split = results["correctness"]["kda_decode split"]
    assert not split["ok"] and split["error"] == "RuntimeError: no such tile"
    assert check.render_summary(results).splitlines()[1].startswith(
        "**CORRECTNESS FAILED: kda_decode split**")
    saved = (tmp_path / "out" / "results.json").read_text()
    assert '"kda_decode split"' in saved


def test_gpu_check_flags_a_cubin_that_spills_beside_its_time():
    """A CuTe DSL cubin that ptxas said spills or loses performance travels to the GPU and is
    timed: its time is marked in the GEMV table and the warnings say why."""
    check = _gpu_check()
    row = {"name": "o_proj", "m": 2, "n": 64, "k": 64, "floor_us": 1.0, "cute_us": 2.0,
           "triton_us": 3.0, "spill_stores": 16, "spill_loads": 8,
           "ptxas_warnings": ["C7515: wgmma serialized"]}
    assert check.gemv_warnings({"builds": [row]}) == [
        "gemv o_proj M=2 cute: its cubin spills (16 B stored, 8 B loaded)",
        "gemv o_proj M=2 cute: ptxas: C7515: wgmma serialized"]
    clean = {**row, "spill_stores": 0, "spill_loads": 0, "ptxas_warnings": []}
    assert check.gemv_warnings({"builds": [clean]}) == []
    results = {"date": "2026-12-05", "environment": {"torch": "2.11"},
               "copy_bandwidth_Bps": 4.3e12, "errors": [], "gemv": {"builds": [row]}}
    assert "| o_proj | 2 | 64×64 | 2.00 (see warnings) | 3.00 |" in check.render_summary(results)


@pytest.mark.parametrize("argv, env, message", [
    (["--out", "FILE"], {}, "--out"),
    (["--out", "DIR", "--smoke"], {"GPU_CHECK_STARTED": "yesterday"}, "GPU_CHECK_STARTED"),
])
def test_gpu_check_refuses_bad_arguments_in_a_line(tmp_path, argv, env, message):
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a in ("FILE", "DIR") else a for a in argv]
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_decode_check.py"), *argv],
                          capture_output=True, text=True, env={**os.environ, **env},
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_gpu_check_sets_the_shared_kernels_against_their_references(monkeypatch):
    """The kernels both paths share (attention, the merge, the GEMM with its norm), each
    against its float32 reference: in the interpreter here, on a GPU's tensor cores there,
    which comparing the paths cannot check; a kernel 5% off fails."""
    pytest.importorskip("torch")
    check = _gpu_check()
    got = check.kernel_references("cpu", smoke=True)
    assert set(got) == {"mla_attention bf16 cache", "mla_attention fp8 cache",
                        "skinny_linear gemm rmsnorm+residual"}
    assert all(r["ok"] and r["max_rel_err"] < 5e-3 for r in got.values()), got
    assert got["mla_attention fp8 cache"]["splits"] == 3
    import kimi_perf_kernels.mla_uv_gate as uv

    real = uv.mla_uv_gate
    monkeypatch.setattr(uv, "mla_uv_gate", lambda *a, **k: real(*a, **k) * 1.05)
    off = check.kernel_references("cpu", smoke=True)
    assert [name for name, r in off.items() if not r["ok"]] == [
        "mla_attention bf16 cache", "mla_attention fp8 cache"]
