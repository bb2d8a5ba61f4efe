"""The whole GPU check of the two decode paths, in one call (for the lent H200).

    python benchmarks/gpu_decode_check.py --out "$OUT"      # on the GPU machine
    python benchmarks/gpu_decode_check.py --smoke --out DIR   # the same plumbing on a CPU

1. Environment: GPU, driver, CUDA, torch, triton, date.
2. Ceilings: device-to-device copy bandwidth (bytes read + written, median of repeats).
3. Correctness on the GPU: both paths on the tiny preset in float32 against the standard path
   on the CPU (Triton's float32 dots use tf32 on the GPU: bound 3e-3; NaN never passes),
   logits every step, launched eagerly and replayed from a CUDA graph (decode steps, and
   speculative verify steps with their rollback); and ``kda_decode`` split over programs at
   K3 TP8 shapes, batch 64, launched 100 times on one arrivals buffer against its reference
   (the arrival protocol, which the interpreter cannot race). The opt-ins (grouped experts,
   PDL, MXFP4 experts: both paths' expert kernels stream the codes and scales) are checked
   the same way after the headline speed runs, before their own. A failed check is an error
   of the run, and the summary's first line.
4. Speed: both paths on k3-tp8 shapes (5 layers: dense, 2 KDA + MoE, 2 gated MLA) at batch 1
   and 64, eager and with CUDA graphs, profiled after warm-up. Per layer type: kernels, kernel
   µs, span µs (under graphs the replayed kernels map back to their capture inside the layer
   ranges: ``kimi_perf.graphs``), and each graph run's steps timed again without the
   profiler (CUPTI's cost per kernel would favour the path with fewer; 30 steps at least,
   their spread the noise), for the paths and each opt-in against the path without it; the
   greedy tokens of the paths side by side, the last logits finite, and each run's first
   decode step's logits against the standard path's first run at its batch (same weights,
   prompt and prefill: the paths checked at shapes no reference affords; over
   ``FIRST_STEP_BOUND`` is an error); per launch of both
   eager paths, its kernels' µs, and for
   the specialized path against the bytes it must move over the measured bandwidth (its
   memory floor). On a GPU the standard path is ``StandardKernelsModel``, one kernel per
   step of vLLM's sequence (the summary names the model class of each run). At batch 1 the
   specialized path also runs with its opt-in L2 prefetch (``specialized+l2``), and at batch
   64 with its routed experts grouped by expert (``specialized+grouped``); under graphs, at
   both batches, with programmatic dependent launch (``specialized+pdl``), and with it and
   the skinny linears' weight prefetch before the wait (``specialized+pdl+prefetch``,
   ``CHECKED_PREFETCH_BYTES``); each side by side with it without. Both paths run first,
   under graphs and then eagerly, the opt-ins after.
5. CuTe DSL against Triton: the CuTe DSL GEMV (``kernels/cute_gemv.py``; its cubins are built
   for sm_90a before the call, since the DSL itself cannot travel) beside the Triton GEMV and
   cuBLAS on the K3 TP8 projections at 1-4 tokens: errors against a float32 product and µs per
   launch, each replayed from a CUDA graph over weight copies that overflow L2 (after the
   speed runs: a kernel's first GPU run must not cost them; without the cubins, Triton and
   cuBLAS still, on the same shapes). Where the CuTe DSL GEMV passes,
   the specialized path runs again at batch 1 with it (``specialized+cute``), side by side.
6. The main job as a user runs it: ``kimi-perf trace`` with its GPU defaults, ``--graphs``,
   ``--graphs --spec-tokens 3`` (speculative verify steps of 4 tokens, as vLLM's reported
   tokens/s were measured with speculative decoding), ``--graphs --experts mxfp4`` (K3's own
   MXFP4 experts) and eager, in that order, each given the time left, the next begun where
   that fits one as long as the last (a minute at least); its per-layer table and run
   directory kept.

Writes ``results.json``, ``summary.md`` (after every section: a run killed at the device
call's limit keeps what it measured) under ``--out``, and the evidence behind them (the Kineto
traces, the main job's run directories) as ``evidence.tar.gz.part0``, ``part1``, ... (at most
four parts of 15 MiB, also rewritten after every section and every main-job run: the device
returns at most 8 files, 64 MiB together; a larger archive is cut, the least wanted last,
with a warning; ``cat evidence.tar.gz.part* | tar xz`` unpacks them); prints the summary last.
Sections that would not fit the wall-clock budget (``--budget-s``, counted from
``GPU_CHECK_STARTED``, which ``scripts/gpu-check.sh`` sets as the call begins) are skipped
and listed, the headline first. A hang, or the call's end, leaves the stacks in the log
(faulthandler). Every number is measured in this one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import faulthandler
import gzip
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from kimi_perf.attribution import range_kernel_summary
from kimi_perf.capture import environment, profiler_schedule
from kimi_perf.decode.config import K3Config, preset
from kimi_perf.decode.fallbacks import summarise
from kimi_perf.decode.floors import SAME_BYTES, launch_bytes
from kimi_perf.decode.fusions import fusion_ledger
from kimi_perf.decode.harness import GraphedDecodeStep, run_decode
from kimi_perf.decode.model import K3Model
from kimi_perf.decode.specialized import SpecializedModel, build_model
from kimi_perf.decode.validate import rel_err
from kimi_perf.decode.weights import random_weights
from kimi_perf.graphs import capture_launches
from kimi_perf.layer_breakdown import breakdown
from kimi_perf.readers import read_trace
from kimi_perf_kernels.skinny_linear import CHECKED_PREFETCH_BYTES

PATHS = {"standard": "auto", "specialized": "latency_specialized"}
# bf16 outputs of float32 sums (about 2^-9 relative each): the norm-relative error, and the
# largest error over the largest reference value, which a few wrong outputs cannot hide under
GEMV_REL_ERR, GEMV_MAX_ERR = 1e-2, 2e-2
# What the GEMVs and one main-job run need at least, a margin for writing the results, and
# the seconds kept for what follows the speed runs: the GEMVs, then one main-job run (its
# --graphs run; the others where time is left: the speed runs measure what they would again).
GEMV_S, MIN_MAIN_JOB_S, BUDGET_MARGIN_S = 45, 60, 10
# how far apart the unprofiled step times before and after a profiler session may be for the
# summary to call CUPTI's cost gone
CUPTI_TOLERANCE = 0.05
MAIN_JOB_KEPT_S = MIN_MAIN_JOB_S + BUDGET_MARGIN_S
RESERVE_AFTER_SPEED_S = GEMV_S + MAIN_JOB_KEPT_S
# Steps timed without the profiler (replays of a graph: cheap, and the spread a noise estimate)
UNPROFILED_STEPS = 30
# A speed run's first decode step against the standard path's at its batch (the same weights,
# prompt and prefill), each run on its own: two bf16 paths each within 0.11 of the float64
# reference's logits, end to end, are within twice that of each other after one step. 0.11:
# validate's logits drift at the tiny preset's 8 layers, 0.066 at worst over 16 steps (seeds
# 0-11), with room; drift grows with the depth, and the check runs 5 layers by default (a
# deeper --layers may need more)
FIRST_STEP_BOUND = 2 * 0.11
# The device call returns at most 8 files of 16 MiB, 64 MiB together, from $OUT:
# results.json, summary.md, the log, and the evidence in parts (what does not fit is cut).
EVIDENCE_PART_BYTES, EVIDENCE_PARTS = 15 << 20, 4


def copy_bandwidth(device: str, mib: int, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy (median)."""
    src = torch.randn(mib * 1024 * 1024 // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[2:])


def worst(errors: list[float]) -> float:
    """The largest error, NaN where any is one (``max`` passes over a NaN that does not
    come first, and ``NaN > bound`` is False: NaN must never pass)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


# The checks of ``correctness``: both paths first; the opt-ins (the specialized path's grouped
# experts, its kernels launched with PDL, both paths' expert kernels on MXFP4 experts) after
# the headline speed runs, before their own
BASE_CHECKS = tuple(PATHS)
OPT_IN_CHECKS = ("specialized+grouped", "specialized+pdl", "specialized+pdl+prefetch",
                 "standard+mxfp4", "specialized+mxfp4", "specialized+grouped+mxfp4")


def correctness(device: str, steps: int, names=BASE_CHECKS, allows=lambda name: True) -> dict:
    """``names`` (``BASE_CHECKS``, ``OPT_IN_CHECKS``), each as ``allows(name)`` says, on the
    GPU against the standard path on the CPU, tiny preset, float32. A check that raises
    fails alone (its error kept), the others still run."""
    c = preset("tiny", n_layers=4)
    tokens = torch.randint(0, c.vocab, (2, 4 + steps), generator=torch.Generator()
                           .manual_seed(12))
    by_experts: dict = {}   # the weights, their reference on the CPU, and its logits

    def reference(experts: str) -> tuple:
        if experts not in by_experts:    # (made when first asked: a check skipped costs none)
            weights = random_weights(c, seed=11, experts=experts)
            ref = K3Model(c, weights, dtype=torch.float32)
            ref_state = ref.new_state(2, 4 + steps)
            want = [ref.forward(tokens[:, :4], ref_state)[:, -1]]
            want += [ref.forward(tokens[:, t: t + 1], ref_state)[:, -1]
                     for t in range(4, 4 + steps)]
            by_experts[experts] = weights, ref, want
        return by_experts[experts]

    out = {}
    for name in names:
        if not allows(name):
            continue
        try:
            out[name] = check_path(name, c, tokens, steps, device, reference)
        except Exception as exc:
            print(f"correctness {name}: {traceback.format_exc()}", file=sys.stderr)
            out[name] = {"max_rel_err": math.nan, "ok": False,
                         "error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def check_path(name: str, c: K3Config, tokens: torch.Tensor, steps: int, device: str,
               reference) -> dict:
    """One of ``correctness``'s checks: ``name``'s path (and opt-ins) against
    ``reference(experts)``'s logits, eager and (on a GPU) replayed from graphs."""
    base, *options = name.split("+")
    experts = "mxfp4" if "mxfp4" in options else "bf16"
    weights, ref, want = reference(experts)
    model = build_model(c, weights, PATHS[base], dtype=torch.float32, device=device,
                        experts=experts)
    if "grouped" in options:   # the opt-in grouped experts, on every step
        model.group_experts_from = 1
    model.pdl = "pdl" in options
    model.pdl_prefetch_bytes = CHECKED_PREFETCH_BYTES if "prefetch" in options else 0
    state = model.new_state(2, 4 + steps)
    got = [model.forward(tokens[:, :4].to(device), state)[:, -1]]
    got += [model.forward(tokens[:, t: t + 1].to(device), state)[:, -1]
            for t in range(4, 4 + steps)]
    errors = [rel_err(g.cpu(), w.double()) for g, w in zip(got, want, strict=True)]
    if device == "cuda":  # the same steps replayed from one captured graph
        state = model.new_state(2, 4 + steps)
        model.forward(tokens[:, :4].to(device), state)
        graphed = GraphedDecodeStep(model, state, batch=2)
        errors += [rel_err(graphed(tokens[:, t: t + 1].to(device))[:, -1].cpu(),
                           want[t - 3].double()) for t in range(4, 4 + steps)]
        errors += graphed_verify_errors(model, ref, tokens[:, :4], device)
    err = worst(errors)
    return {"max_rel_err": err, "ok": err < 3e-3}    # (NaN and infinity fail)


def kda_split_stress(device: str, smoke: bool) -> dict:
    """``kda_decode`` split over programs as on this GPU, launched again and again on one
    arrivals buffer (decode and verify steps, the fused and the standard path's variant; each
    verify step followed by a random acceptance that the next launch replays): each launch
    against ``kda_decode_reference`` in float32, the counters left at 0. A race in the
    arrival protocol or the records' halves would show here, where the interpreter runs
    programs in turn."""
    from kimi_perf_kernels.kda_decode import (
        KdaRecords,
        kda_decode,
        kda_decode_reference,
        kda_splits,
    )

    # K3 at TP8 (12 heads of 128, f_rank 128) at batch 64; tiny shapes split 4 ways on a CPU
    batch, heads, d, f_rank, launches = (2, 2, 16, 16, 2) if smoke else (64, 12, 128, 128, 50)
    gen = torch.Generator(device=device).manual_seed(14)
    proj = heads * d
    rows = 4 * proj + f_rank + heads
    rows += (-rows) % 16
    params = dict(heads=heads, head_dim=d, f_rank=f_rank, eps=1e-5, lower_bound=-5.0,
                  w_fb=(torch.randn(proj, f_rank, generator=gen, device=device)
                        / f_rank**0.5).bfloat16(),
                  dt_bias=0.5 * torch.randn(proj, generator=gen, device=device),
                  a_log=torch.rand(heads, generator=gen, device=device) * 2 - 1,
                  conv_w=torch.randn(3 * proj, 4, generator=gen, device=device) / 2,
                  o_norm=1 + 0.1 * torch.randn(d, generator=gen, device=device))
    arrivals = torch.zeros(batch * heads, dtype=torch.int32, device=device)
    errors, conv_exact = [], True
    for tokens in (1, 4):
        splits = 4 if smoke else kda_splits(batch * heads, d, torch.device(device), tokens)
        conv = torch.randn(batch, 3 * proj, 3, generator=gen, device=device).bfloat16()
        state = torch.randn(batch, heads, d, d, generator=gen, device=device) * 0.1
        conv_ref, state_ref = conv.clone(), state.clone()
        records = KdaRecords.empty(batch, heads, d, 4, conv.dtype, device)
        records_ref = KdaRecords(*(t.clone() for t in records))
        for i in range(launches):
            z = torch.randn(batch, tokens, rows, generator=gen, device=device).bfloat16()
            f_given = i % 2 == 1
            f = (z[..., 4 * proj: 4 * proj + f_rank].float() @ params["w_fb"].float().T
                 if f_given else None)
            verify = tokens > 1
            want = kda_decode_reference(z, conv_state=conv_ref, state=state_ref,
                                        records=records_ref, record=verify, **params)
            got = kda_decode(z, conv_state=conv, state=state, f=f, arrivals=arrivals,
                             splits=splits, records=records, record=verify, **params)
            errors += [rel_err(got.float().cpu(), want.double().cpu()),
                       rel_err(state.cpu(), state_ref.double().cpu()),
                       rel_err(records.records.cpu(), records_ref.records.double().cpu())]
            conv_exact &= bool(torch.equal(conv, conv_ref)
                               and torch.equal(records.inputs, records_ref.inputs))
            accepted = torch.randint(1, tokens + 1, (batch,), generator=gen, device=device)
            for r in (records, records_ref):       # as DecodeState.advance and accept do
                if verify:
                    r.half.bitwise_xor_(1)
                    r.pending.copy_(accepted)
                else:
                    r.pending.zero_()
    left = int(arrivals.count_nonzero())
    err = worst(errors)
    return {"max_rel_err": err, "launches": 2 * launches, "conv_state_exact": conv_exact,
            "arrivals_left": left, "ok": err < 1e-2 and conv_exact and left == 0}


# A bf16 kernel's output against its float32 reference, norm-relative (its inputs the same)
KERNEL_REL_ERR = 1e-2


def kernel_references(device: str, smoke: bool) -> dict[str, dict]:
    """The kernels whose numerics on a GPU the interpreter never runs (its dots take fp32;
    a GPU's tensor cores take bf16 or fp8 operands): ``mla_attention`` over a bf16 and an fp8
    cache, split as this GPU splits a batch of 1 and merged by ``mla_uv_gate``, and the
    skinny linear's GEMM with its RMSNorm and residual (wgmma, x·norm rounded to bf16), at K3
    TP8 shapes (tiny with --smoke), each against its reference in float32 on the CPU. The
    two paths share these kernels: comparing the paths cannot see an error of theirs."""
    from kimi_perf_kernels.mla_attention import (
        mla_attention,
        mla_attention_reference,
        mla_splits,
    )
    from kimi_perf_kernels.mla_uv_gate import mla_uv_gate, mla_uv_gate_reference
    from kimi_perf_kernels.skinny_linear import skinny_linear

    gen = torch.Generator(device=device).manual_seed(21)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * scale

    heads, lora, rope, v, seq = (2, 32, 8, 16, 40) if smoke else (12, 512, 64, 128, 4096)
    out = {}
    for name, fp8 in (("mla_attention bf16 cache", False), ("mla_attention fp8 cache", True)):
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        scale, q_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
        qhat = randn(1, heads, lora + rope, scale=4 if fp8 else 1).to(dtype)
        cache = randn(1, seq, lora + rope, scale=2 if fp8 else 0.5).to(dtype)
        positions = torch.full((1,), seq - 1, device=device)
        sm_scale = (128 + rope) ** -0.5
        # (on a CPU one split: three, so that the merge of --smoke runs too)
        splits = 3 if smoke else mla_splits(1, 1, heads, seq, torch.device(device))
        parts, lse = mla_attention(qhat, cache, positions, 1, lora, scale, sm_scale, splits,
                                   q_scale=q_scale, dtype=torch.bfloat16)
        w_uv = randn(heads, lora, v, scale=lora ** -0.5).bfloat16()
        gate = randn(1, heads * v).bfloat16()
        got = mla_uv_gate(parts if lse is not None else parts[0], w_uv, gate, lse=lse,
                          dtype=torch.bfloat16)
        merged = mla_attention_reference(qhat.cpu(), cache.cpu(), positions.cpu(), 1, scale,
                                         sm_scale, lora, q_scale, torch.float32)
        want = mla_uv_gate_reference(merged, w_uv.cpu(), gate.cpu())
        err = rel_err(got.float().cpu(), want.double())
        out[name] = {"max_rel_err": err, "splits": splits, "ok": err < KERNEL_REL_ERR}
    m, n, k = (8, 64, 128) if smoke else (64, 7168, 3584)   # (latent_up at a verify's 64)
    x, w = randn(m, k).bfloat16(), randn(n, k, scale=k ** -0.5).bfloat16()
    norm, residual = 1 + 0.1 * randn(k), randn(m, n).bfloat16()
    got = skinny_linear(x, w, norm=norm, residual=residual)
    xf = x.float().cpu()
    want = ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.cpu())
            @ w.float().cpu().T + residual.float().cpu())
    err = rel_err(got.float().cpu(), want.double())
    out["skinny_linear gemm rmsnorm+residual"] = {"max_rel_err": err,
                                                   "ok": err < KERNEL_REL_ERR}
    return out


def graphed_verify_errors(model: K3Model, ref: K3Model, prompt: torch.Tensor, device: str
                          ) -> list[float]:
    """Two speculative verify steps of 4 tokens, each replayed from one captured graph and
    followed by an eager acceptance, against the same steps of ``ref`` on the CPU."""
    drafts = torch.randint(0, model.c.vocab, (2, 8), generator=torch.Generator().manual_seed(13))
    accepted = [torch.tensor([1, 3]), torch.tensor([4, 2])]
    ref_state = ref.new_state(2, 12, max_verify=4)
    ref.forward(prompt, ref_state)
    state = model.new_state(2, 20, max_verify=4)
    model.forward(prompt.to(device), state)
    graphed = GraphedDecodeStep(model, state, batch=2, tokens_per_step=4)
    errors = []
    for i, acc in enumerate(accepted):
        want = ref.forward(drafts[:, 4 * i: 4 * i + 4], ref_state, verify=True)
        ref_state.accept(acc)
        got = graphed(drafts[:, 4 * i: 4 * i + 4].to(device))
        state.accept(acc.to(device))
        errors.append(rel_err(got.cpu(), want.double()))
    return errors


def gemv_side_by_side(device: str, cubins: Path | None, bandwidth: float) -> dict:
    """The CuTe DSL GEMV's cubins, the Triton GEMV (``skinny_linear``) and cuBLAS on the same
    operands: errors against a float32 product (eager, and the timed graph's output) and µs
    per launch (a CUDA graph of back-to-back launches cycling over weight copies that together
    exceed L2 three times, so that W streams from HBM as in a decode step)."""
    if device != "cuda":
        return {"skipped": "no GPU"}
    from kimi_perf_kernels.cute_gemv import CubinGemv, decode_shapes
    from kimi_perf_kernels.skinny_linear import skinny_linear

    cute, result = None, {"cute": "no cubins: `bash scripts/gpu-check.sh fetch` builds them"}
    if cubins is not None and (cubins / "manifest.json").exists():
        try:
            loaded = CubinGemv(cubins)
            builds = sorted((mnk, entry) for mnk, (entry, _) in loaded.builds.items())
            cute, result = loaded, {"cute": True}   # (set once its builds are read)
        except Exception as exc:   # (CuPy, or a cubin no driver here loads)
            result = {"cute": f"the cubins did not load: {type(exc).__name__}: {exc}"[:500]}
    if cute is None:   # Triton and cuBLAS still, on the shapes the cubins would have had
        builds = sorted(((m, n, k), {"name": name})
                        for name, (n, k) in decode_shapes("k3-tp8").items() for m in range(1, 5))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for (m, n, k), entry in builds:
        copies = max(2, math.ceil(3 * l2 / (n * k * 2)))
        ws = [(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
              for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = x.float() @ ws[0].float().T
        impls = {"cute": lambda w, y, x=x: cute(x, w, y),
                 "triton": lambda w, y, x=x: skinny_linear(x, w, out=y),
                 "cublas": lambda w, y, x=x: torch.matmul(x, w.T, out=y)}
        if cute is None:
            del impls["cute"]
        def errors(y: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
            """(norm-relative error, largest error over the largest reference value)"""
            diff = (y.double() - want.double()).cpu()
            return (rel_err(y.float().cpu(), want.double().cpu()),
                    float(diff.abs().max() / want.double().abs().max().cpu()))

        row = {"name": entry["name"], "m": m, "n": n, "k": k,
               **{key: entry[key] for key in ("rows", "warps", "registers", "loaded",
                                              "spill_stores", "spill_loads", "ptxas_warnings")
                  if key in entry},
               "floor_us": n * k * 2 / bandwidth * 1e6}
        for label, fn in impls.items():
            try:
                # poisoned: an output the kernel leaves unwritten is an error, not an old value
                y = torch.full((m, n), math.nan, device="cuda", dtype=torch.bfloat16)
                fn(ws[0], y)
                torch.cuda.synchronize()
                row[f"{label}_err"], row[f"{label}_max_err"] = errors(y, want)
                launches = copies * max(1, 24 // copies)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(launches):
                        fn(ws[i % copies], y)
                times = []
                for _ in range(12):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / launches)
                row[f"{label}_us"] = statistics.median(times[2:])
                # the graph computed what it was timed for: its last launch's product
                y.fill_(math.nan)
                graph.replay()
                torch.cuda.synchronize()
                last = x.float() @ ws[(launches - 1) % copies].float().T
                row[f"{label}_graph_err"] = worst(list(errors(y, last)))
                del graph
            except Exception as exc:  # the other kernels' numbers still count
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        del ws
        torch.cuda.empty_cache()
    return result | {"l2_bytes": l2, "builds": rows}


def gemv_errors(gemv: dict) -> list[str]:
    """A failed launch or an error over the bounds (eager or replayed) is an error of the
    check (a time under the memory floor is a warning: ``gemv_warnings``)."""
    out = []
    for r in gemv.get("builds", []):
        for label in ("cute", "triton", "cublas"):
            where = f"gemv {r['name']} M={r['m']} {label}"
            if f"{label}_err" not in r and f"{label}_error" not in r:
                continue     # not run (no cubins for the CuTe DSL GEMV)
            if f"{label}_error" in r:
                out.append(f"{where}: {r[label + '_error']}")
                continue
            # "not <=": a NaN error fails too
            if not (r[f"{label}_err"] <= GEMV_REL_ERR and r[f"{label}_max_err"] <= GEMV_MAX_ERR):
                out.append(f"{where}: rel err {r[label + '_err']:.2e} (norm), "
                           f"{r[label + '_max_err']:.2e} (max) > {GEMV_REL_ERR} / "
                           f"{GEMV_MAX_ERR}")
            if not r[f"{label}_graph_err"] <= GEMV_MAX_ERR:
                out.append(f"{where}: the timed graph's output is off by "
                           f"{r[label + '_graph_err']:.2e}")
    return out


def gemv_warnings(gemv: dict) -> list[str]:
    """Times well under the memory floor: a graph that did not run the kernel, or weights
    read in part from L2 (the floor is a copy's read + write bandwidth, a GEMV only reads);
    and a cubin that ptxas said spills or loses performance (it travels all the same: its
    time is measured beside the others)."""
    floors = [f"gemv {r['name']} M={r['m']} {label}: {r[label + '_us']:.2f} µs is under 0.7x "
              f"the memory floor {r['floor_us']:.2f} µs"
              for r in gemv.get("builds", []) for label in ("cute", "triton", "cublas")
              if f"{label}_us" in r and r[f"{label}_us"] < 0.7 * r["floor_us"]]
    builds = [f"gemv {r['name']} M={r['m']} cute: {note}" for r in gemv.get("builds", [])
              for note in _cubin_notes(r)]
    return floors + builds


def _cubin_notes(row: dict) -> list[str]:
    """What ptxas said of a CuTe DSL cubin's build that its time should be read with."""
    spills = (row.get("spill_stores") or 0, row.get("spill_loads") or 0)
    return ([f"its cubin spills ({spills[0]} B stored, {spills[1]} B loaded)"] if any(spills)
            else []) + [f"ptxas: {w}" for w in row.get("ptxas_warnings") or ()]


def launch_floors_bytes(c: K3Config, batch: int, context: int) -> dict[str, float]:
    """Bytes each specialized launch must move at least (``kimi_perf.decode.floors``; experts
    in bf16, as this model stores them), a call on average: a launch name that layer types
    share (o_proj) weighs each type's bytes by its layers, as its measured µs a call are the
    mean over every call."""
    layers = Counter(c.layer_type(i) for i in range(c.n_layers))
    total: dict[str, float] = {}
    calls: Counter = Counter()
    for layer_type, n in layers.items():
        for name, b in launch_bytes(c, layer_type, batch, context).items():
            total[name] = total.get(name, 0.0) + n * b
            calls[name] += n
    out = {name: total[name] / calls[name] for name in total}
    return out | {alias: out[name] for alias, name in SAME_BYTES.items() if name in out}


def op_calls(trace) -> Counter:
    """How many times each ``op:NAME`` range ran (its calls), by NAME: a launch's kernels
    per call are its kernels' time over these (``range_kernel_summary`` counts the ranges
    that ran each kernel, which for a launch of two kernels by layer type is neither)."""
    rows = trace.annotated_ops()
    return Counter(trace.strings[code][3:] for code in trace.ranges.name[rows].tolist())


def speed(path: str, c: K3Config, weights_of, batch: int, context: int, warmup: int,
          steps: int, device: str, out: Path, bandwidth: float, graphs: bool, gemv=None,
          control: bool = False) -> dict:
    """One path's run under the profiler, and for graphs its steps again without it.
    ``weights_of()``: the weights, drawn again for each run (the same seed: the same values)
    and let go once the model has packed its copy, so that one copy is held while the run
    goes (two held throughout, the batch-64 prefill's activations beside them would not fit
    an H100). ``control``: also before it, as the process's first profiler session has not
    yet begun (CUPTI may stay loaded after a session: the two unprofiled times tell whether
    it costs)."""
    base, _, option = path.partition("+")
    weights = weights_of()
    model = build_model(c, weights, PATHS[base], device=device)
    del weights
    # the specialized path's opt-ins: L2 prefetch, grouped experts, PDL, the CuTe DSL GEMV
    model.l2_prefetch = option == "l2"
    model.pdl = option.startswith("pdl")
    model.pdl_prefetch_bytes = CHECKED_PREFETCH_BYTES if option.endswith("prefetch") else 0
    model.group_experts_from = 1 if option == "grouped" else None
    if option == "cute":
        model.gemv = gemv
    # Eager runs: per-launch ranges attribute kernels to their launch (graphs replay none).
    model.annotate_ops = not graphs
    prompt = torch.randint(0, c.vocab, (batch, context), generator=torch.Generator()
                           .manual_seed(batch))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    before = run_decode(model, prompt, steps=max(steps, UNPROFILED_STEPS), warmup=warmup,
                        cuda_graphs=True) if graphs and control else None
    schedule = profiler_schedule(warmup, steps, graphs)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        run = run_decode(model, prompt, steps=steps, warmup=warmup, after_step=prof.step,
                         cuda_graphs=graphs, keep_first_logits=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(raw))
        trace_file = out / f"{path}_b{batch}{'_graphs' if graphs else ''}.trace.json.gz"
        trace_file.write_bytes(gzip.compress(raw.read_bytes(), 6))
    trace = read_trace(trace_file)
    b = breakdown(trace)
    result = {"trace": trace_file.name, "layer_types": b.layer_types,
              "step_s": run.step_s[warmup:],
              # greedy tokens (the paths' side by side: same weights, same prompt) and whether
              # the last logits were finite (argmax makes a token of NaN too)
              "tokens": run.tokens[:, warmup:].tolist(), "logits_finite": run.logits_finite,
              # (a tensor: ``speed_runs`` takes it out, and compares it with the standard's)
              "first_step_logits": run.first_logits,
              "fallbacks": summarise(getattr(model, "fallbacks", [])),
              # "nvtx" under graphs: the replayed kernels found their capture's layer ranges
              "layer_sources": sorted({s["layer_source"] for s in b.steps}),
              "replayed_kernels_mapped_to_capture": int((capture_launches(trace) >= 0).sum())}
    result["model"] = type(model).__name__
    if not graphs:  # per launch, both paths; memory floors for the specialized one
        floors = (launch_floors_bytes(c, batch, context) if isinstance(model, SpecializedModel)
                  else {})
        calls = op_calls(trace)
        per_launch: dict[str, dict] = {}
        for row in range_kernel_summary(trace):
            if not row.range or not row.range.startswith("op:"):
                continue
            name = row.range[3:]
            entry = per_launch.setdefault(name, {"kernel_ns": 0, "ranges": calls[name]})
            entry["kernel_ns"] += row.total_ns
        for name, entry in per_launch.items():
            per_call = entry["kernel_ns"] / max(entry["ranges"], 1) / 1e3
            floor = floors[name] / bandwidth * 1e6 if name in floors else None
            entry.update(us_per_launch=per_call, floor_us=floor,
                         floor_fraction=floor / per_call if floor and per_call else None)
        result["launches"] = per_launch
    else:
        # The same steps again without the profiler: CUPTI traces every replayed kernel, a
        # cost per kernel that falls hardest on the path with more of them. Host time per
        # step, the device synchronised after each, as ``step_s``.
        again = run_decode(model, prompt, steps=max(steps, UNPROFILED_STEPS), warmup=warmup,
                           cuda_graphs=True)
        result["unprofiled_step_s"] = again.step_s[warmup:]
        result["logits_finite"] = run.logits_finite and again.logits_finite
        if before is not None:
            result["unprofiled_before_any_profiler_step_s"] = before.step_s[warmup:]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


class Budget:
    """The check's wall-clock budget (a device call is killed at its limit, with whatever
    is left unsaved): sections that would not fit are skipped, and say so. ``spent``: what
    the call spent before this process could start counting (installing, importing)."""

    def __init__(self, seconds: float, spent: float = 0.0, clock=time.monotonic):
        self.clock = clock
        self.end = clock() + seconds - spent
        self.skipped: list[str] = []
        self.skipped_keys: set[str] = set()   # (what ``skipped`` names, as given)

    def left(self) -> float:
        return self.end - self.clock()

    def allows(self, what: str, need: float) -> bool:
        if self.left() >= need:
            return True
        self.skip(what, f"{max(self.left(), 0):.0f} s left of the budget, {need:.0f} s needed")
        return False

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        self.skipped_keys.add(what)


# The main job's runs, the most wanted first (those the time left cannot fit are skipped):
# (name, options). Speculative verify steps are how vLLM's tokens/s were measured; eager
# repeats what the speed runs measured eagerly, so it comes last.
MAIN_JOB_MODES = (("graphs", ["--graphs"]), ("graphs spec3", ["--graphs", "--spec-tokens", "3"]),
                  ("graphs mxfp4", ["--graphs", "--experts", "mxfp4"]),   # K3's own storage
                  ("eager", []))
SMOKE_MAIN_JOB_MODES = (("eager", []), ("spec3", ["--spec-tokens", "3"]),
                        ("mxfp4", ["--experts", "mxfp4"]))


def main_job(out: Path, smoke: bool, budget: Budget, runs: dict, saved) -> None:
    """``kimi-perf trace`` end to end, as a user runs it (smoke: small CPU runs), into
    ``runs``: ``MAIN_JOB_MODES`` in turn, each given all the time left (a share would kill
    every run that needs more than it), the next begun only where the time left fits one as
    long as the last (``MIN_MAIN_JOB_S`` at least); ``saved()`` after each, so that a run
    killed or gone wrong loses no other's results."""
    need = MIN_MAIN_JOB_S
    for key, options in SMOKE_MAIN_JOB_MODES if smoke else MAIN_JOB_MODES:
        if not budget.allows(f"kimi-perf trace ({key})", need + BUDGET_MARGIN_S):
            continue
        args = [sys.executable, "-m", "kimi_perf", "trace", "--out", str(out / "runs"),
                "--plotly-js", "cdn", "--format", "json", *options]
        args += ["--layers", "4", "--steps", "1", "--warmup", "0"] if smoke else []
        run = runs[key] = {"command": " ".join(args[1:]), "returncode": None}
        began = budget.clock()
        try:
            proc = subprocess.run(args, capture_output=True, text=True,
                                  timeout=max(1.0, budget.left() - BUDGET_MARGIN_S))
            run.update(returncode=proc.returncode, stderr_tail=proc.stderr[-3000:])
            # (exit 1: a path's logits not finite, or its every step fell back: the run is
            # written all the same)
            if proc.returncode in (0, 1):
                if not proc.stdout.strip():
                    raise ValueError("it printed no JSON on stdout")
                doc = json.loads(proc.stdout)
                run["run_dir"] = doc["run_dir"]
                run["layer_types"] = {path: r["layer_types"] for path, r in doc["paths"].items()}
                run["decode_tokens_per_s"] = {path: m["decode_tokens_per_s"]
                                              for path, m in doc["run"]["paths"].items()}
        except subprocess.TimeoutExpired as exc:
            run["timed_out"] = True
            run["stderr_tail"] = f"timed out: {exc}"
        except Exception:   # its output unreadable: said, and the other runs go on
            run["unreadable"] = traceback.format_exc()[-3000:]
        run["seconds"] = budget.clock() - began
        need = max(MIN_MAIN_JOB_S, run["seconds"])
        saved()


def main_job_error(key: str, run: dict) -> str:
    """A run that failed, or whose result could not be read (exit 0 all the same)."""
    what = ("timed out" if run.get("timed_out") else "could not be started"
            if run["returncode"] is None else f"exited {run['returncode']}")
    if "unreadable" in run:
        what += f", its output unreadable: {run['unreadable']}"
    return f"kimi-perf trace ({key}) {what}; stderr: {run.get('stderr_tail', '')}"


def evidence_files(work: Path, results: dict) -> list[Path]:
    """What ``work`` holds, in the order it is packed, the most wanted first (an archive over
    the parts the device returns is cut at its end): the speed runs' traces in the order they
    ran (the headline first), the main job's run directories in theirs, the rest, and last
    the normalised traces (``.kptrace``: remade from the raw ones by reading them). Hidden
    names are left out: a run killed at its limit leaves its unfinished directory so."""
    files = sorted(p for p in work.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(work).parts))
    order = [r["trace"] for r in results.get("speed", {}).values() if "trace" in r]
    order += [Path(r["run_dir"]).name for r in results.get("main_job", {}).values()
              if r.get("run_dir")]

    def rank(p: Path) -> tuple[int, int]:
        rel = p.relative_to(work).parts
        at = next((i for i, name in enumerate(order) if name in rel), len(order))
        return (p.suffix == ".kptrace", at)
    return sorted(files, key=rank)      # (stable: by name within a rank)


def save(results: dict, out: Path, work: Path) -> None:
    """results.json and summary.md as far as the check got (a killed run still leaves its
    sections), and the evidence so far (``work``: traces and run directories) packed."""
    with tempfile.TemporaryFile() as packed:  # not under out: a kill leaves no partial file
        with tarfile.open(fileobj=packed, mode="w:gz", compresslevel=1) as tar:
            for file in evidence_files(work, results):
                tar.add(file, arcname=f"evidence/{file.relative_to(work)}")
        packed.seek(0)
        data = packed.read()
    parts = range(0, max(len(data), 1), EVIDENCE_PART_BYTES)
    kept = min(len(parts), EVIDENCE_PARTS)
    for i, at in enumerate(parts[:kept]):   # each part replaced whole: a kill leaves old or new
        _replace(out / f"evidence.tar.gz.part{i}", data[at:at + EVIDENCE_PART_BYTES])
    for old in out.glob("evidence.tar.gz.part*"):
        if int(old.name.removeprefix("evidence.tar.gz.part")) >= kept:
            old.unlink()
    results["evidence"] = {"bytes": len(data), "parts": kept}
    if len(parts) > EVIDENCE_PARTS:
        results["evidence"]["warning"] = (
            f"{len(parts)} parts made, {EVIDENCE_PARTS} kept (the device returns no more "
            "besides the results and the log): the archive is cut, tar xz reads it up to there")
    _replace(out / "results.json", (json.dumps(results, indent=1, default=str) + "\n").encode())
    _replace(out / "summary.md", render_summary(results).encode())


# Temporary files under --out, three folders down: the device returns no file that deep, so
# one a kill leaves there is not a ninth file, nor one over the 64 MiB
UNRETURNED = Path(".partial", "not", "returned")


def _replace(path: Path, data: bytes) -> None:
    """Write a temporary file, then rename it over ``path``: a run killed meanwhile leaves
    the old file whole."""
    tmp = path.parent / UNRETURNED / path.name
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def progress(what: str, started: float) -> None:
    """One line per section on stderr, as it ends: a run killed at the device call's limit
    shows in its output how far it got."""
    print(f"[gpu-check {time.monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="where the traces and run directories go "
                        "before they are packed into --out (default: a new temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cubins", type=Path, help="cute_gemv's cubins and manifest")
    # 330 s: a device call of about 6 minutes, so that a session's 15 minutes of device time
    # (the machine's start counted) leave room to run it again
    parser.add_argument("--budget-s", type=float, default=330,
                        help="wall-clock budget: later sections are skipped rather than killed")
    args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is a file, not a folder")
    # the device call's clock began before this process's (wheels installed, torch imported)
    started_at = os.environ.get("GPU_CHECK_STARTED") or str(time.time())
    try:
        spent = time.time() - float(started_at)
    except ValueError:
        parser.error(f"GPU_CHECK_STARTED={started_at!r}: not seconds since the epoch "
                     "(scripts/gpu-check.sh sets it: date +%s.%N)")
    budget = Budget(args.budget_s, spent=spent)
    # a hang or a kill at the device call's limit still leaves where it was in the log
    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, chain=True)
    faulthandler.dump_traceback_later(max(1.0, budget.left() + BUDGET_MARGIN_S), exit=False)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if not args.smoke and device != "cuda":
        print("no GPU: run with --smoke for the CPU plumbing check", file=sys.stderr)
        return 2
    results: dict = {"date": dt.datetime.now(dt.UTC).isoformat(), "environment": {},
                     "errors": [], "warnings": [], "skipped": budget.skipped,
                     "seconds_before_start": round(spent, 1)}
    try:
        return run_sections(args, budget, results, work, device, started)
    except Exception:   # (a section's own failures are caught in it: this is the check's)
        results["errors"].append(f"the check stopped: {traceback.format_exc()}")
        print(results["errors"][-1], file=sys.stderr)
        with contextlib.suppress(Exception):   # results.json first: the summary may not render
            save(results, args.out, work)
        return 1


def run_sections(args: argparse.Namespace, budget: Budget, results: dict, work: Path,
                 device: str, started: float) -> int:
    """Every section in turn, ``results`` saved after each: the environment, copy bandwidth,
    correctness, the speed runs and opt-ins, the GEMV side by side and the main job."""
    results["environment"] = environment(device) | device_facts(device, args.cubins)
    results["copy_bandwidth_Bps"] = bandwidth = copy_bandwidth(device, 16 if args.smoke
                                                               else 2048)
    save(results, args.out, work)
    progress(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", started)
    checks = results["correctness"] = {}
    check_steps = 2 if args.smoke else 6

    def check(names, allows=lambda name: True) -> None:
        try:
            checks.update(correctness(device, check_steps, names, allows))
        except Exception:  # keep going: the speed runs are evidence of their own
            results["errors"].append(traceback.format_exc())
            print(results["errors"][-1], file=sys.stderr)
        save(results, args.out, work)
        progress(f"correctness: {checks}", started)

    check(BASE_CHECKS)
    try:
        checks["kda_decode split"] = kda_split_stress(device, smoke=args.smoke)
    except Exception as exc:   # a check that did not run did not pass: it heads the summary
        checks["kda_decode split"] = {"max_rel_err": math.nan, "ok": False,
                                      "error": f"{type(exc).__name__}: {exc}"}
        results["errors"].append(f"kda_decode split: {traceback.format_exc()}")
        print(results["errors"][-1], file=sys.stderr)
    save(results, args.out, work)
    progress(f"kda_decode split: {checks['kda_decode split']}", started)
    try:
        checks.update(kernel_references(device, smoke=args.smoke))
    except Exception as exc:   # (did not run: did not pass)
        checks["kernel references"] = {"max_rel_err": math.nan, "ok": False,
                                       "error": f"{type(exc).__name__}: {exc}"}
        results["errors"].append(f"kernel references: {traceback.format_exc()}")
        print(results["errors"][-1], file=sys.stderr)
    save(results, args.out, work)
    progress("kernel references: " + ", ".join(
        f"{name} {r['max_rel_err']:.2e}" for name, r in checks.items()
        if name.startswith(("mla_attention", "skinny_linear", "kernel references"))), started)
    if args.smoke:
        c, batches, context, steps, warmup = preset("tiny", n_layers=4), (1, 2), 4, 1, 1
    else:
        c = preset("k3-tp8", n_layers=args.layers)
        batches, context, steps, warmup = (1, 64), args.context, args.steps, args.warmup
    def weights() -> dict:   # (each speed run's own: see speed)
        return random_weights(c, seed=0, device=device)

    results["config"] = {"preset": "tiny" if args.smoke else "k3-tp8",
                         "n_layers": c.n_layers, "hash": c.fingerprint(), "context": context,
                         "steps": steps, "warmup": warmup}
    results["speed"] = {}
    standard_first_step: dict[int, torch.Tensor] = {}   # per batch, its first run's
    took: list[float] = []    # each speed run's seconds: the next is admitted by their median
    # (runs that failed fast say nothing of how long one takes)

    def typical() -> float:
        return statistics.median(took) if took else 0.0

    def speed_runs(runs: list[tuple[str, int, bool]], gemv=None, together: int = 1) -> None:
        """``runs`` in turn, ``together`` at a time (a side-by-side pair: one run alone
        compares with nothing): a group begun only where all its runs would fit, and the
        rest of one whose run did not fit skipped with it."""
        keys = [f"{path} b{batch}{' graphs' if graphs else ''}" for path, batch, graphs in runs]
        for n, ((path, batch, graphs), key) in enumerate(zip(runs, keys, strict=True)):
            first = n - n % together
            if first < n and keys[first] in budget.skipped_keys:
                budget.skip(key, f"skipped with {keys[first]}, beside which it runs")
                continue
            group = min(first + together, len(runs)) - n   # (this run and those after it)
            if not budget.allows(key, group * typical() + RESERVE_AFTER_SPEED_S):
                continue
            section = time.monotonic()
            try:
                r = results["speed"][key] = speed(path, c, weights, batch, context, warmup,
                                                  steps, device, work, bandwidth, graphs,
                                                  gemv=gemv, control=not results["speed"])
                first = r.pop("first_step_logits")
                if path == "standard" and batch not in standard_first_step:
                    standard_first_step[batch] = first
                elif (want := standard_first_step.get(batch)) is not None:
                    diff = r["first_step_vs_standard"] = rel_err(first, want.double())
                    if not diff <= FIRST_STEP_BOUND:    # (NaN fails)
                        results["errors"].append(
                            f"{key}: its first decode step's logits differ from the standard "
                            f"path's by {diff:.3g} (bound {FIRST_STEP_BOUND:g})")
                if r["logits_finite"] is False:
                    results["errors"].append(f"{key}: the last decode step's logits are not "
                                             "all finite")
                if graphs and device == "cuda" and not r["replayed_kernels_mapped_to_capture"]:
                    results["warnings"].append(
                        f"{key}: no replayed kernel mapped back to its capture (its layers "
                        "are found by their pattern, not the ranges)")
            except Exception:
                results["errors"].append(f"{key}: {traceback.format_exc()}")
                print(results["errors"][-1], file=sys.stderr)
            seconds = time.monotonic() - section
            if key in results["speed"]:
                took.append(seconds)
            save(results, args.out, work)
            progress(f"speed {key}: {seconds:.1f} s", started)

    # The headline first, a pair at a time (both paths, side by side): batch 1 (the reported
    # 13 kernels / 69 µs against 23 / 130 µs were of batch 1) under CUDA graphs, then eager
    # (per launch and memory floors), then batch 64 alike. Then the opt-ins, checked first:
    # at batch 1, where GEMVs stream weights, the L2 prefetch; at 64, where tokens share
    # experts, the grouped experts; under graphs (whose replay launches as fast as the GPU
    # takes them) PDL, and PDL with the weight prefetch before its wait.
    modes = (True, False) if device == "cuda" else (False,)
    speed_runs([(path, batch, graphs) for batch in batches for graphs in modes
                for path in PATHS], together=len(PATHS))
    check(OPT_IN_CHECKS, lambda name: budget.allows(
        f"correctness {name}", typical() + RESERVE_AFTER_SPEED_S))
    speed_runs([(path, batch, graphs) for graphs in modes for batch in batches
                for path in (["specialized+l2" if batch == 1 else "specialized+grouped"]
                             + (["specialized+pdl", "specialized+pdl+prefetch"] if graphs
                                else []))])
    results["errors"] += [f"correctness {name}: " + (r.get("error") or
                                                      f"max rel err {r['max_rel_err']:.2e}")
                          for name, r in checks.items() if not r["ok"]]
    # After the speed runs: a fault in a kernel that has never run on a GPU before would
    # poison this process's CUDA context (the main job runs in processes of its own).
    gemv_ok = False
    try:
        if budget.allows("gemv", GEMV_S + MAIN_JOB_KEPT_S):
            results["gemv"] = gemv_side_by_side(device, args.cubins, bandwidth)
            errors = gemv_errors(results["gemv"])
            results["errors"] += errors
            results["warnings"] += gemv_warnings(results["gemv"])
            gemv_ok = results["gemv"].get("cute") is True and not any(
                " cute:" in e for e in errors)
    except Exception:
        results["errors"].append(f"gemv: {traceback.format_exc()}")
        print(results["errors"][-1], file=sys.stderr)
    save(results, args.out, work)
    progress("gemv side by side", started)
    if gemv_ok:  # then the specialized path with it, at batch 1, side by side
        from kimi_perf_kernels.cute_gemv import CubinGemv

        speed_runs([("specialized+cute", 1, graphs) for graphs in (True, False)],
                   gemv=CubinGemv(args.cubins))
    # the main job's processes need the GPU memory (a fault of a kernel above leaves this
    # process's CUDA context unusable, not theirs)
    try:
        if device == "cuda":
            torch.cuda.empty_cache()
    except Exception:
        results["errors"].append(f"freeing GPU memory: {traceback.format_exc()}")
    results["main_job"] = {}
    def saved() -> None:
        save(results, args.out, work)
        progress(f"kimi-perf trace: {list(results['main_job'])}", started)

    main_job(work, args.smoke, budget, results["main_job"], saved)
    results["errors"] += [main_job_error(key, r) for key, r in results["main_job"].items()
                          if r["returncode"] != 0 or "unreadable" in r]
    save(results, args.out, work)
    shutil.rmtree(args.out / UNRETURNED.parts[0], ignore_errors=True)
    faulthandler.cancel_dump_traceback_later()
    print(render_summary(results))
    return 1 if results["errors"] else 0


def device_facts(device: str, cubins: Path | None) -> dict:
    """What the GPU is beyond its name (read, never set): multiprocessors, L2, memory, the
    clocks and performance state it ran at, and the versions of what else ran there."""
    from importlib import metadata

    facts: dict = {}
    for package in ("numpy", "cupy-cuda13x", "cupy-cuda12x"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            facts[package] = metadata.version(package)
    if cubins is not None and (cubins / "manifest.json").exists():
        facts["cute_gemv_cubins"] = {k: v for k, v in json.loads(
            (cubins / "manifest.json").read_text()).items() if k != "kernels"}
    if device != "cuda":
        return facts
    p = torch.cuda.get_device_properties(0)
    facts.update(sm_count=p.multi_processor_count, l2_bytes=p.L2_cache_size,
                 memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
    query = "clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,pstate,power.limit"
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            facts["nvidia_smi"] = dict(zip(query.split(","), (
                v.strip() for v in smi.stdout.splitlines()[0].split(",")), strict=False))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return facts


# The runs put side by side (A vs B): the paths, and each opt-in against the path without it
PAIRS = (("standard", "specialized"), ("specialized", "specialized+l2"),
         ("specialized", "specialized+grouped"), ("specialized", "specialized+pdl"),
         ("specialized+pdl", "specialized+pdl+prefetch"), ("specialized", "specialized+cute"))


def side_by_side(speed: dict) -> list[tuple[str, str, str, dict, dict]]:
    """(A, B, run, A's results, B's) for each of ``PAIRS`` that both ran in ``run`` (a batch,
    eager or under graphs)."""
    out = []
    for a, b in PAIRS:
        for key, ra in speed.items():
            run = key[len(a) + 1:]
            if key.startswith(a + " ") and (rb := speed.get(f"{b} {run}")) is not None:
                out.append((a, b, run, ra, rb))
    return out


def tokens_alike(ra: dict, rb: dict) -> str:
    """How many greedy tokens two runs of the same weights and prompt share, step by step
    (bf16 sums in another order may part them where two logits nearly tie)."""
    ta, tb = ra.get("tokens"), rb.get("tokens")
    if not ta or not tb or len(ta) != len(tb):
        return "-"
    pairs = [(x, y) for row_a, row_b in zip(ta, tb, strict=True)
             for x, y in zip(row_a, row_b, strict=False)]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def _first_step(diff: float | None) -> str:
    if diff is None:
        return "-"
    return f"{diff:.1e}" + ("" if diff <= FIRST_STEP_BOUND else " FAIL")


def render_summary(results: dict) -> str:
    env = results["environment"]
    lines = [f"# Decode paths on {', '.join(env.get('gpus') or ['CPU'])}",
             f"{results['date']}; torch {env['torch']}, triton {env.get('triton')}, CUDA "
             f"{env.get('cuda')}, driver {env.get('driver')}; commit {env.get('git_commit')}",
             f"copy bandwidth (read + write): {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s",
             ""]
    for name, r in (results.get("correctness") or {}).items():
        lines.append(f"correctness {name}: max rel err {r['max_rel_err']:.2e} "
                     f"{'ok' if r['ok'] else 'FAIL'}")
    lines += ["", "| run | model | layer type | layers | kernels | kernel µs | span µs |",
              "|---|---|---|---:|---:|---:|---:|"]
    failed = [name for name, r in (results.get("correctness") or {}).items() if not r["ok"]]
    if failed:
        lines[1:1] = [f"**CORRECTNESS FAILED: {', '.join(failed)}**: the speed figures of a "
                      "path that computes otherwise measure nothing worth having"]
    for key, r in results.get("speed", {}).items():
        for t in r["layer_types"]:
            lines.append(f"| {key} | {r['model']} | {t['type']} | {t['layers']} | "
                         f"{t['kernels']:g} | {t['kernel_us']:.1f} | {t['span_us']:.1f} |")
    lines += ["", "Per layer type, measured side by side in this run (ratio: A over B):", "",
              "| A vs B | run | layer type | kernels | span µs | kernels ratio | span ratio |",
              "|---|---|---|---:|---:|---:|---:|"]
    speed = results.get("speed", {})
    for a, b, run, ra, rb in side_by_side(speed):
        b_types = {t["type"]: t for t in rb["layer_types"]}
        for t in ra["layer_types"]:
            u = b_types.get(t["type"])
            if u is None or not u["kernels"] or not u["span_us"]:
                continue
            lines.append(f"| {a} vs {b} | {run} | {t['type']} | {t['kernels']:g} vs "
                         f"{u['kernels']:g} | {t['span_us']:.1f} vs {u['span_us']:.1f} | "
                         f"{t['kernels'] / u['kernels']:.2f} | "
                         f"{t['span_us'] / u['span_us']:.2f} |")
    lines += ["", "Decode step, median host time with the device synchronised (profiled: under "
              "CUPTI, every launch of an eager run in a range of its own; unprofiled: the "
              "graph runs again without the profiler); first step vs standard: the first "
              "decode step's logits against the standard path's first run at that batch "
              f"(norm-relative; same weights, prompt and prefill; bound {FIRST_STEP_BOUND:g}):",
              "", "| run | step ms, profiled | step ms, unprofiled | decode tokens/s, unprofiled | "
              "layers from | kernels mapped to a capture | first step vs standard |",
              "|---|---:|---:|---:|---|---:|---:|"]
    for key, r in results.get("speed", {}).items():
        step = statistics.median(r["step_s"])
        batch = int(key.split(" b")[1].split()[0])
        clean = statistics.median(r["unprofiled_step_s"]) if r.get("unprofiled_step_s") \
            else None
        lines.append(f"| {key} | {step * 1e3:.3f} | "
                     f"{'-' if clean is None else f'{clean * 1e3:.3f}'} | "
                     f"{'-' if clean is None else f'{batch / clean:,.0f}'} | "
                     f"{', '.join(r['layer_sources'])} | "
                     f"{r['replayed_kernels_mapped_to_capture']:,} | "
                     f"{_first_step(r.get('first_step_vs_standard'))} |")
    unprofiled = [(a, b, run, ra, rb) for a, b, run, ra, rb in side_by_side(speed)
                  if ra.get("unprofiled_step_s") and rb.get("unprofiled_step_s")]
    for key, r in speed.items():
        if r.get("unprofiled_before_any_profiler_step_s"):
            first, later = (statistics.median(r[k]) for k in (
                "unprofiled_before_any_profiler_step_s", "unprofiled_step_s"))
            ratio = later / first
            apart = f"{CUPTI_TOLERANCE:.0%}"
            verdict = (f"within {apart}: no cost left behind"
                       if abs(ratio - 1) <= CUPTI_TOLERANCE
                       else f"over {apart} apart: a cost left behind, or noise; the unprofiled "
                       "step times after a profiler session may be off by as much")
            lines += ["", f"CUPTI control, {key}: unprofiled step {first * 1e3:.3f} ms before "
                      f"the process's first profiler session, {later * 1e3:.3f} ms after its "
                      f"own (ratio {ratio:.2f}: {verdict})"]
    if unprofiled:
        lines += ["", "Unprofiled decode step side by side, this run's graphs replayed without "
                  "the profiler (ms: median, and min-max over the steps, the noise; ratio: A "
                  "over B of the medians; tokens: greedy tokens alike, of the profiled steps):",
                  "", "| A vs B | run | A ms | B ms | ratio | tokens alike |",
                  "|---|---|---:|---:|---:|---:|"]
        for a, b, run, ra, rb in unprofiled:
            sa, sb = (statistics.median(r["unprofiled_step_s"]) for r in (ra, rb))
            spread = [f"{statistics.median(r['unprofiled_step_s']) * 1e3:.3f} "
                      f"({min(r['unprofiled_step_s']) * 1e3:.3f}-"
                      f"{max(r['unprofiled_step_s']) * 1e3:.3f})" for r in (ra, rb)]
            lines.append(f"| {a} vs {b} | {run} | {spread[0]} | {spread[1]} | {sa / sb:.2f} | "
                         f"{tokens_alike(ra, rb)} |")
    for key, r in results.get("speed", {}).items():
        if "launches" not in r:
            continue
        lines += ["", f"{key}: per launch", "| launch | µs | floor µs | floor / µs |",
                  "|---|---:|---:|---:|"]
        for name, e in sorted(r["launches"].items()):
            frac = e["floor_fraction"]
            floor = e["floor_us"]
            lines.append(f"| {name} | {e['us_per_launch']:.2f} | "
                         f"{'-' if floor is None else f'{floor:.2f}'} | "
                         f"{'-' if frac is None else f'{frac:.2f}'} |")
    for key, r in results.get("speed", {}).items():  # the fusions, launch by launch
        path, _, run = key.partition(" ")   # "specialized+grouped", "b64"
        other = results["speed"].get(f"standard {run}")
        if not path.startswith("specialized") or "launches" not in r or not other \
                or "launches" not in other:
            continue
        ledger = fusion_ledger(*([{"name": n, "us": e["us_per_launch"]}
                                  for n, e in x["launches"].items()] for x in (other, r)))
        if ledger is None:
            continue
        rows, left = ledger
        lines += ["", f"{key}: each launch against the standard launches it replaces (µs per "
                  "launch; ratio: replaced over replacing, above 1: the fusion is faster)", "",
                  "| launch | µs | replaces | their µs | ratio |", "|---|---:|---|---:|---:|"]
        lines += [f"| {x.launch} | {x.us:.2f} | {' + '.join(x.replaces) or '(new work)'} | "
                  f"{x.replaced_us:.2f} | {'-' if x.ratio is None else f'{x.ratio:.2f}'} |"
                  for x in rows]
        if left:
            lines.append(f"standard launches no specialized launch took: {', '.join(left)}")
    gemv = results.get("gemv") or {}
    if "builds" in gemv:
        lines += ["", "GEMV side by side (µs per launch from graphs; ratio: Triton or cuBLAS "
                  "over CuTe DSL; err: norm-relative error against float32):", "",
                  "| projection | M | N×K | CuTe DSL µs | Triton µs | cuBLAS µs | floor µs | "
                  "Triton / CuTe | cuBLAS / CuTe | err CuTe / Triton |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in gemv["builds"]:
            def us(label: str, r: dict = r) -> str:
                if label + "_us" in r:
                    marked = label == "cute" and _cubin_notes(r)
                    return f"{r[label + '_us']:.2f}" + (" (see warnings)" if marked else "")
                return "failed" if label + "_error" in r else "-"

            def ratio(label: str, r: dict = r) -> str:
                if label + "_us" not in r or "cute_us" not in r:
                    return "-"
                return f"{r[label + '_us'] / r['cute_us']:.2f}"

            errs = " / ".join(f"{r[f'{lb}_err']:.1e}" if f"{lb}_err" in r else "-"
                              for lb in ("cute", "triton"))
            lines.append(f"| {r['name']} | {r['m']} | {r['n']}×{r['k']} | {us('cute')} | "
                         f"{us('triton')} | {us('cublas')} | {r['floor_us']:.2f} | "
                         f"{ratio('triton')} | {ratio('cublas')} | {errs} |")
    elif gemv:
        lines += ["", f"GEMV side by side: skipped ({gemv.get('skipped')})"]
    for key, r in results.get("main_job", {}).items():
        lines += ["", f"kimi-perf trace ({key}): exit {r['returncode']}"
                  + (", its output unreadable" if "unreadable" in r else "")]
        if r.get("decode_tokens_per_s"):
            accepted = " (accepted tokens, synthetic acceptance)" if "spec" in key else ""
            lines += [f"  decode tokens/s{accepted}: " + ", ".join(
                f"{path} {v:.1f}" for path, v in r["decode_tokens_per_s"].items())]
        for path, types in (r.get("layer_types") or {}).items():
            lines += [f"  {path} {t['type']}: {t['kernels']:g} kernels, {t['kernel_us']:.1f} µs"
                      for t in types]
    lines += [f"skipped {what}" for what in results.get("skipped", [])]
    evidence = results.get("evidence")
    if evidence:
        lines += ["", f"evidence: {evidence['bytes'] / 2**20:.1f} MiB in {evidence['parts']} "
                  "part(s), evidence.tar.gz.part* (cat them | tar xz)"
                  + (f"; WARNING: {evidence['warning']}" if "warning" in evidence else "")]
    lines += [f"warning: {w}" for w in results.get("warnings", [])]
    if results["errors"]:
        lines += ["", f"{len(results['errors'])} error(s): see results.json"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
