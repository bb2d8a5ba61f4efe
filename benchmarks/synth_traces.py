"""Synthetic LLM-decode traces for the benchmarks: an nsys SQLite export and a Kineto JSON.

Both files describe the same kind of run: a hybrid MoE model (Kimi-Linear-like: three KDA
layers per MLA layer) decoding on one GPU of a TP=2 group. Each ``decode_step[i]`` range holds
an embedding prologue, ``layer[j](kda)`` / ``layer[j](mla)`` ranges with a few nested sub-ranges
(``attention``, ``moe``, ``moe.experts``...), and a sampling epilogue; every kernel is launched by
a runtime call (``cudaLaunchKernel``, or ``cuLaunchKernel`` for Triton kernels) inside those
ranges, and the step ends with a ``cudaStreamSynchronize``.

Every step has the same kernel sequence, so the timeline is computed on ``(steps, kernels per
step)`` arrays: CPU slots by a row-wise cumulative sum, GPU kernels by the max-plus recurrence
``start_i = max(launch_i, end_{i-1} + gap)`` solved with ``np.maximum.accumulate``. Only the
final text/row serialization walks events one by one (inside C-level ``%`` formatting and
``executemany``). Files are written to a temporary name and renamed, so a file that exists is
complete and can be reused.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import platform
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

# Bump when the generated content changes, so stale files in the work dir are not reused.
GENERATOR_VERSION = 2   # 2: the Kineto file gzipped at level 9, as the profiler writes it

PID = 2468200          # the decode process; its main thread launches everything
TID = PID
DEVICE = 0
# nsys serializes ids as (vmId << 48) | (pid << 24) | tid; real exports carry vmId 1.
GLOBAL_PID = (1 << 48) | (PID << 24)
GLOBAL_TID = GLOBAL_PID | TID

# CPU-side costs (ns): NVTX push/pop, Python + dispatcher work before a launch, work after it.
PUSH_NS, POP_NS = 900, 700
PRE_LAUNCH_NS, POST_LAUNCH_NS, LAUNCH_API_NS = 7_000, 900, 4_200
LAUNCH_LATENCY_NS, KERNEL_GAP_NS = 2_500, 1_100
HOST_STEP_GAP_NS = (40_000, 120_000)   # scheduler + sampling between steps


@dataclass(frozen=True)
class KernelSpec:
    """One kernel as the profilers name it, and how it is launched."""

    name: str                  # demangled name (nsys demangledName, Kineto name)
    short: str                 # nsys shortName
    mean_us: float
    ops: tuple[str, ...]       # PyTorch cpu_op stack around the launch, outer first
    driver: bool = False       # Triton: cuLaunchKernel (driver API) instead of cudaLaunchKernel
    grid: tuple[int, int, int] = (132, 1, 1)
    block: tuple[int, int, int] = (256, 1, 1)
    regs: int = 64
    smem: int = 0
    sigma: float = 0.10        # lognormal spread of the duration


def _triton(name: str, mean_us: float, op: str, grid: tuple[int, int, int] = (64, 1, 1),
            sigma: float = 0.10) -> KernelSpec:
    return KernelSpec(name, name, mean_us, (op,), driver=True, grid=grid, block=(128, 1, 1),
                      regs=40, smem=16_384, sigma=sigma)


BF16 = "c10::BFloat16"
SPECS: dict[str, KernelSpec] = {
    "embedding": KernelSpec(
        "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, "
        "unsigned int, 2, 2, -2>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, "
        "at::cuda::detail::TensorInfo<c10::BFloat16 const, unsigned int>, "
        "at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, long)",
        "indexSelectSmallIndex", 3.0, ("aten::embedding", "aten::index_select"),
        grid=(32, 1, 1), block=(128, 1, 1), regs=32),
    "add_rms_norm": KernelSpec(
        f"void vllm::fused_add_rms_norm_kernel<{BF16}, 8>({BF16}*, {BF16}*, {BF16} const*, "
        "float, int, int)", "fused_add_rms_norm_kernel", 3.2, ("_C::fused_add_rms_norm",),
        grid=(32, 1, 1), block=(1024, 1, 1), regs=32),
    "rms_norm": KernelSpec(
        f"void vllm::rms_norm_kernel<{BF16}>({BF16}*, {BF16} const*, {BF16} const*, float, "
        "int, int)", "rms_norm_kernel", 2.6, ("_C::rms_norm",), grid=(32, 1, 1),
        block=(1024, 1, 1), regs=30),
    "kda_qkv_gemm": KernelSpec(
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT",
        12.5, ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "kda_gate_gemm": KernelSpec(
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_"
        "align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "Kernel2", 5.8, ("aten::linear", "aten::mm"), regs=128, smem=32_768, block=(128, 1, 1)),
    "conv1d": _triton("_causal_conv1d_update_kernel", 2.9, "vllm::causal_conv1d_update"),
    "kda_gate": _triton("fused_kda_gate_kernel", 2.7, "vllm::fused_kda_gate"),
    "kda_recurrent": _triton("fused_recurrent_kda_fwd_kernel", 8.5, "vllm::kda_attention",
                             grid=(32, 16, 1), sigma=0.15),
    "kda_onorm": _triton("layer_norm_gated_fwd_kernel", 3.1, "vllm::fused_rms_norm_gated"),
    "o_proj": KernelSpec(
        "nvjet_tst_128x8_64x12_4x1_v_bz_TNT", "nvjet_tst_128x8_64x12_4x1_v_bz_TNT", 8.8,
        ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "allreduce_nccl": KernelSpec(
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 14.0, ("c10d::allreduce_",),
        grid=(2, 1, 1), block=(640, 1, 1), regs=96, sigma=0.25),
    "allreduce_custom": KernelSpec(
        "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, "
        "vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)",
        "cross_device_reduce_1stage", 6.5, ("_C_custom_ar::all_reduce",), grid=(36, 1, 1),
        block=(512, 1, 1), regs=40, sigma=0.2),
    "router_gemm": KernelSpec(
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, "
        "4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<"
        "__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
        "cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(cublasGemvParamsEx<int, "
        "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<"
        "__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float>, float, "
        "float)", "gemv2T_kernel_val", 4.1, ("aten::linear", "aten::mm"), regs=72),
    "grouped_topk": KernelSpec(
        "void vllm::moe::grouped_topk_fused_kernel<float>(float*, float*, int*, float const*, "
        "long, long, long, long, long, bool, double)", "grouped_topk_fused_kernel", 3.6,
        ("_moe_C::grouped_topk",), grid=(32, 1, 1), block=(32, 1, 1), regs=56),
    "moe_align": KernelSpec(
        "void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*, int*, int*, int, "
        "int, int, unsigned long, int*)", "moe_align_block_size_kernel", 3.3,
        ("_moe_C::moe_align_block_size",), grid=(1, 1, 1), block=(1024, 1, 1), regs=32),
    "fused_moe_w13": _triton("fused_moe_kernel", 24.0, "vllm::outplace_fused_experts",
                             grid=(256, 1, 1), sigma=0.25),
    "silu_mul": KernelSpec(
        f"void vllm::act_and_mul_kernel<{BF16}, &(({BF16} vllm::silu_kernel<{BF16}>({BF16} "
        f"const&))), true>({BF16}*, {BF16} const*, int)", "act_and_mul_kernel", 2.4,
        ("_C::silu_and_mul",), grid=(256, 1, 1), block=(1024, 1, 1), regs=26),
    "fused_moe_w2": _triton("fused_moe_kernel", 17.0, "vllm::outplace_fused_experts",
                            grid=(128, 1, 1), sigma=0.25),
    "moe_sum": KernelSpec(
        f"void vllm::moe::moe_sum_kernel<{BF16}, 8>({BF16}*, {BF16} const*, int)",
        "moe_sum_kernel", 2.8, ("_moe_C::moe_sum",), grid=(32, 1, 1), block=(1024, 1, 1),
        regs=28),
    "shared_gate_up": KernelSpec(
        "nvjet_tst_64x8_64x16_2x1_v_bz_TNN", "nvjet_tst_64x8_64x16_2x1_v_bz_TNN", 7.6,
        ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "shared_down": KernelSpec(
        "nvjet_tst_64x8_64x16_1x2_h_bz_TNT", "nvjet_tst_64x8_64x16_1x2_h_bz_TNT", 5.9,
        ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "mla_qkv_a_gemm": KernelSpec(
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 8.1,
        ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "q_b_gemm": KernelSpec(
        "nvjet_tst_64x8_64x16_2x1_v_bz_TNT", "nvjet_tst_64x8_64x16_2x1_v_bz_TNT", 7.2,
        ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "uk_bmm": KernelSpec(
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_"
        "align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)",
        "Kernel2", 5.0, ("aten::bmm",), regs=230, smem=81_920, block=(128, 1, 1)),
    "concat_and_cache_mla": KernelSpec(
        "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, "
        "(vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*, "
        "__nv_bfloat16*, long const*, int, int, int, int, int, int, float const*)",
        "concat_and_cache_mla_kernel", 2.7, ("_C_cache_ops::concat_and_cache_mla",),
        grid=(32, 1, 1), block=(512, 1, 1), regs=30),
    "flash_mla": KernelSpec(
        "void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, "
        "cutlass::bfloat16_t, 512>, true>(Flash_fwd_mla_params)",
        "flash_fwd_splitkv_mla_kernel", 21.0, ("_flashmla_C::fwd_kvcache_mla",),
        grid=(132, 1, 1), block=(256, 1, 1), regs=255, smem=230_400, sigma=0.3),
    "flash_mla_combine": KernelSpec(
        "void flash::flash_fwd_splitkv_mla_combine_kernel<cutlass::bfloat16_t, float, 512, 64>"
        "(Flash_fwd_mla_params)", "flash_fwd_splitkv_mla_combine_kernel", 3.4,
        ("_flashmla_C::fwd_kvcache_mla",), grid=(32, 16, 1), block=(128, 1, 1), regs=80),
    "uv_bmm": KernelSpec(
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_"
        "align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8::Params)",
        "Kernel2", 4.8, ("aten::bmm",), regs=230, smem=81_920, block=(128, 1, 1)),
    "lm_head_gemm": KernelSpec(
        "nvjet_tst_192x8_64x8_2x1_v_bz_TNT", "nvjet_tst_192x8_64x8_2x1_v_bz_TNT", 95.0,
        ("aten::linear", "aten::mm"), regs=168, smem=196_608, block=(384, 1, 1)),
    "allgather_nccl": KernelSpec(
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL", 22.0, ("c10d::_allgather_base_",), grid=(2, 1, 1),
        block=(640, 1, 1), regs=96, sigma=0.25),
    "argmax": KernelSpec(
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
        "at::native::ArgMaxOps<float>, unsigned int, long, 4> >(at::native::ReduceOp<float, "
        "at::native::ArgMaxOps<float>, unsigned int, long, 4>)", "reduce_kernel", 6.3,
        ("aten::argmax",), grid=(32, 1, 1), block=(512, 1, 1), regs=40),
    "copy": KernelSpec(
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<long>, "
        "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<long>, "
        "at::detail::Array<char*, 3>)", "vectorized_elementwise_kernel", 1.9,
        ("aten::add_",), grid=(1, 1, 1), block=(128, 1, 1), regs=24),
}

# Layer bodies (kernel keys in launch order) and their candidate sub-ranges
# (name, first slot, last slot), most important first: a layer gets the first m of them,
# m chosen to reach the requested range count. Candidates nest properly in any prefix.
MOE = ["add_rms_norm", "router_gemm", "grouped_topk", "moe_align", "fused_moe_w13", "silu_mul",
       "fused_moe_w2", "moe_sum", "shared_gate_up", "silu_mul", "shared_down",
       "allreduce_custom"]
LAYERS: dict[str, tuple[list[str], list[tuple[str, int, int]]]] = {
    "kda": (
        ["add_rms_norm", "kda_qkv_gemm", "kda_gate_gemm", "conv1d", "conv1d", "conv1d",
         "kda_gate", "kda_recurrent", "kda_onorm", "o_proj", "allreduce_nccl", *MOE],
        [("attention", 0, 10), ("moe", 11, 22), ("moe.experts", 14, 18),
         ("moe.shared_expert", 19, 21), ("moe.router", 12, 13), ("attention.kda", 3, 8),
         ("attention.qkv_proj", 1, 2), ("attention.o_proj", 9, 10)]),
    "mla": (
        ["add_rms_norm", "mla_qkv_a_gemm", "rms_norm", "rms_norm", "q_b_gemm", "uk_bmm",
         "concat_and_cache_mla", "flash_mla", "flash_mla_combine", "uv_bmm", "o_proj",
         "allreduce_nccl", *MOE],
        [("attention", 0, 11), ("moe", 12, 23), ("moe.experts", 15, 19),
         ("moe.shared_expert", 20, 22), ("moe.router", 13, 14), ("attention.mla", 5, 9),
         ("attention.qkv_proj", 1, 4), ("attention.o_proj", 10, 11)]),
}
PROLOGUE = ["embedding"]
EPILOGUE = ["rms_norm", "lm_head_gemm", "allgather_nccl", "argmax", "copy"]
LAYER_PATTERN = ("kda", "kda", "kda", "mla")   # Kimi Linear's 3:1 KDA:MLA hybrid
LAYERS_PER_STEP = 48


@dataclass
class DecodeRun:
    """Columns of one synthetic run (absolute ns). Ranges are sorted by (step, start)."""

    specs: list[KernelSpec]
    layers_per_step: int
    steps: int
    per_step: int                 # kernels per step
    kernel_spec: np.ndarray       # index into specs, per kernel
    k_start: np.ndarray
    k_end: np.ndarray
    api_start: np.ndarray         # the launch call of each kernel
    api_end: np.ndarray
    corr: np.ndarray
    op_lo: np.ndarray             # CPU window the cpu_ops around the launch may use
    op_hi: np.ndarray
    range_names: list[str]
    r_name: np.ndarray            # index into range_names
    r_start: np.ndarray
    r_end: np.ndarray
    r_depth: np.ndarray
    r_step: np.ndarray
    sync_start: np.ndarray        # one cudaStreamSynchronize per step
    sync_end: np.ndarray
    sync_corr: np.ndarray

    @property
    def kernels(self) -> int:
        return len(self.k_start)

    @property
    def ranges(self) -> int:
        return len(self.r_start)


def _step_template(layers_per_step: int) -> tuple[list[str], list[tuple[int, int, str]]]:
    """Kernel keys of one step, and (first slot, index, type) of each of its layers."""
    keys = list(PROLOGUE)
    layers = []
    for j in range(layers_per_step):
        kind = LAYER_PATTERN[j % len(LAYER_PATTERN)]
        layers.append((len(keys), j, kind))
        keys += LAYERS[kind][0]
    keys += EPILOGUE
    return keys, layers


def build_run(kernels: int, ranges: int, layers_per_step: int = LAYERS_PER_STEP,
              seed: int = 0, t0_ns: int = 5_000_000_000) -> DecodeRun:
    """Lay out at least ``kernels`` kernels in whole decode steps, with about ``ranges`` ranges."""
    rng = np.random.default_rng(seed)
    keys, layer_slots = _step_template(layers_per_step)
    names = sorted(SPECS)
    spec_of_key = {k: i for i, k in enumerate(names)}
    specs = [SPECS[k] for k in names]
    per_step = len(keys)
    steps = max(1, math.ceil(kernels / per_step))
    n = steps * per_step
    step_codes = np.array([spec_of_key[k] for k in keys], np.int16)
    kspec = np.tile(step_codes, steps)

    # -- ranges: (first kernel, last kernel, depth, name) ---------------------------------------
    range_names = [f"decode_step[{i}]" for i in range(steps)]
    layer_name0 = len(range_names)
    range_names += [f"layer[{j}]({kind})" for _, j, kind in layer_slots]
    cand_names = sorted({c[0] for body in LAYERS.values() for c in body[1]})
    cand_name0 = len(range_names)
    range_names += cand_names
    step_ids = np.arange(steps, dtype=np.int64)
    first = [step_ids * per_step]
    last = [step_ids * per_step + per_step - 1]
    depth = [np.zeros(steps, np.int8)]
    rname = [step_ids.astype(np.int32)]
    layer_first = np.array([s for s, _, _ in layer_slots], np.int64)
    layer_len = np.array([len(LAYERS[kind][0]) for _, _, kind in layer_slots], np.int64)
    layer_kind = np.array([list(LAYERS).index(kind) for _, _, kind in layer_slots], np.int8)
    g_first = (step_ids[:, None] * per_step + layer_first[None, :]).ravel()
    g_len = np.tile(layer_len, steps)
    g_kind = np.tile(layer_kind, steps)
    total_layers = len(g_first)
    first.append(g_first)
    last.append(g_first + g_len - 1)
    depth.append(np.ones(total_layers, np.int8))
    rname.append(np.tile(np.arange(layers_per_step, dtype=np.int32) + layer_name0, steps))
    # Spread the remaining range budget evenly over the layers as sub-ranges.
    budget = max(0, ranges - steps - total_layers)
    g = np.arange(total_layers, dtype=np.int64)
    subs = (g + 1) * budget // total_layers - g * budget // total_layers
    for kind_index, (_, cands) in enumerate(LAYERS.values()):
        for c, (cname, lo, hi) in enumerate(cands):
            sel = (g_kind == kind_index) & (subs > c)
            first.append(g_first[sel] + lo)
            last.append(g_first[sel] + hi)
            # attention/moe sit right under the layer; dotted names one level deeper.
            depth.append(np.full(int(sel.sum()), 3 if "." in cname else 2, np.int8))
            rname.append(np.full(int(sel.sum()), cand_name0 + cand_names.index(cname),
                                 np.int32))
    r_first, r_last = np.concatenate(first), np.concatenate(last)
    r_depth, r_name = np.concatenate(depth), np.concatenate(rname)
    is_step = r_depth == 0

    # -- CPU timeline: per kernel, [pushes][pre][launch call][post][pops] -----------------------
    npush = np.bincount(r_first, minlength=n)
    npop = np.bincount(r_last[~is_step], minlength=n)   # the step pops after its sync call
    pre = rng.integers(PRE_LAUNCH_NS // 2, PRE_LAUNCH_NS * 3 // 2, n)
    api = (LAUNCH_API_NS * rng.lognormal(0.0, 0.2, n)).astype(np.int64)
    post = rng.integers(POST_LAUNCH_NS // 2, POST_LAUNCH_NS * 3 // 2, n)
    slot = npush * PUSH_NS + pre + api + post + npop * POP_NS
    slot2 = slot.reshape(steps, per_step)
    slot_start = (np.cumsum(slot2, axis=1) - slot2).ravel()     # relative to the step start
    op_lo = slot_start + npush * PUSH_NS
    api_start = op_lo + pre
    api_end = api_start + api
    op_hi = api_end + post

    # -- GPU timeline: start_i = max(launch_i + latency, end_{i-1} + gap), per step -------------
    mean = np.array([s.mean_us * 1000.0 for s in specs])[kspec]
    sigma = np.array([s.sigma for s in specs])[kspec]
    dur = np.maximum(1000, (mean * rng.lognormal(0.0, sigma))).astype(np.int64)
    gap = KERNEL_GAP_NS + rng.integers(0, 400, n)
    ready = api_start + LAUNCH_LATENCY_NS + rng.integers(0, 800, n)
    cost = (dur + gap).reshape(steps, per_step)
    cum = np.cumsum(cost, axis=1)
    head = np.maximum.accumulate(ready.reshape(steps, per_step) - (cum - cost), axis=1)
    k_end_rel = (head + cum).ravel() - gap
    k_start_rel = k_end_rel - dur

    # -- steps: sync on the GPU, pop the step range, host gap; then absolute times -----------------
    cpu_end = (slot_start + slot).reshape(steps, per_step)[:, -1]
    gpu_end = k_end_rel.reshape(steps, per_step)[:, -1]
    sync_start_rel = cpu_end
    sync_end_rel = np.maximum(gpu_end + 1_500, sync_start_rel + 2_000)
    step_end_rel = sync_end_rel + POP_NS
    step_len = step_end_rel + rng.integers(*HOST_STEP_GAP_NS, steps)
    step_base = t0_ns + np.concatenate([[0], np.cumsum(step_len)[:-1]])
    kbase = np.repeat(step_base, per_step)

    # Range times: pushes in depth order at their first kernel, pops innermost first.
    order = np.lexsort((r_depth, r_first))
    fs = r_first[order]
    rank = np.arange(len(fs)) - np.searchsorted(fs, fs, side="left")
    r_start = np.empty(len(r_first), np.int64)
    r_start[order] = slot_start[fs] + rank * PUSH_NS
    order = np.lexsort((-r_depth.astype(np.int64), r_last))
    ls = r_last[order]
    rank = np.arange(len(ls)) - np.searchsorted(ls, ls, side="left")
    r_end = np.empty(len(r_last), np.int64)
    r_end[order] = op_hi[ls] + (rank + 1) * POP_NS
    r_step = r_first // per_step
    r_end[is_step] = step_end_rel
    r_start += step_base[r_step]
    r_end += step_base[r_step]
    sort = np.lexsort((-r_end, r_start, r_step))

    # Correlation ids in launch order; each step's sync call takes the next one.
    corr2 = np.arange(steps * (per_step + 1), dtype=np.int64).reshape(steps, per_step + 1)
    corr2 += 1_000
    return DecodeRun(
        specs=specs, layers_per_step=layers_per_step, steps=steps, per_step=per_step,
        kernel_spec=kspec, k_start=k_start_rel + kbase, k_end=k_end_rel + kbase,
        api_start=api_start + kbase, api_end=api_end + kbase,
        corr=corr2[:, :per_step].ravel(), op_lo=op_lo + kbase, op_hi=op_hi + kbase,
        range_names=range_names, r_name=r_name[sort], r_start=r_start[sort],
        r_end=r_end[sort], r_depth=r_depth[sort], r_step=r_step[sort],
        sync_start=sync_start_rel + step_base, sync_end=sync_end_rel + step_base,
        sync_corr=corr2[:, per_step])


# -- shared file plumbing ----------------------------------------------------------------------

def positive_int(text: str) -> int:
    """An argparse type: a count of one or more (a trace of -5 kernels was generated)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def work_dir(text: str) -> Path:
    """An argparse type: a folder the traces go in (made where missing), not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return path


def banner(title: str, versions: str) -> str:
    """A benchmark's first line (rich markup): what, when, on which machine (its CPU model,
    the cores this process may use, its memory), with what, at which commit of kimi-perf."""
    from kimi_perf.capture import git_commit

    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count())
    return (f"[bold]{title}[/] {stamp} — {platform.system()} {platform.machine()} "
            f"({_cpu_model()}), {cores} cores, {_memory_gib()}, Python "
            f"{platform.python_version()}, {versions}, kimi-perf {git_commit() or '?'}")


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what platform says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU model unknown"


def _memory_gib() -> str:
    """The machine's memory (Linux's /proc/meminfo), or "memory unknown"."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "memory unknown"


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a temporary file beside ``path``, then rename: an existing file is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sidecar(path: Path) -> Path:
    # Not ".json": HTA takes every *.json / *.gz in a trace directory for a trace.
    return path.with_name(path.name + ".meta")


def read_sidecar(path: Path) -> dict[str, Any] | None:
    """Counts recorded when ``path`` was generated, or None when it must be (re)generated."""
    meta = sidecar(path)
    if not (path.exists() and meta.exists()):
        return None
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("generator") == GENERATOR_VERSION else None


@dataclass(frozen=True)
class Generated:
    path: Path
    info: dict[str, Any]      # counts and sizes (the sidecar)
    seconds: float | None     # generation time; None when an existing file was reused


def _tag(kernels: int, ranges: int, layers_per_step: int, seed: int) -> str:
    """File-name part that changes whenever the content would."""
    return f"k{kernels}_r{ranges}_L{layers_per_step}_s{seed}_g{GENERATOR_VERSION}"


def ensure_nsys(out: Path, kernels: int, ranges: int, layers_per_step: int = LAYERS_PER_STEP,
                seed: int = 0) -> Generated:
    """The synthetic nsys export for these sizes, generated unless already in ``out``."""
    path = out / f"decode_{_tag(kernels, ranges, layers_per_step, seed)}.sqlite"
    return _ensure(path, lambda: write_nsys_sqlite(
        build_run(kernels, ranges, layers_per_step, seed), path))


def ensure_kineto(out: Path, kernels: int, ranges: int, layers_per_step: int = LAYERS_PER_STEP,
                  seed: int = 1) -> Generated:
    """The synthetic Kineto trace for these sizes, alone in its own directory (HTA loads a
    directory)."""
    folder = out / f"kineto_{_tag(kernels, ranges, layers_per_step, seed)}"
    path = folder / "decode_rank0.pt.trace.json.gz"
    return _ensure(path, lambda: write_kineto_json(
        build_run(kernels, ranges, layers_per_step, seed), path))


def _ensure(path: Path, generate: Callable[[], None]) -> Generated:
    info = read_sidecar(path)
    if info is not None:
        return Generated(path, info, None)
    started = time.perf_counter()
    generate()
    seconds = time.perf_counter() - started
    info = read_sidecar(path)
    assert info is not None, f"generation of {path} left no sidecar"
    return Generated(path, info, seconds)


def _summary(run: DecodeRun, **extra: Any) -> dict[str, Any]:
    return {"generator": GENERATOR_VERSION, "kernels": run.kernels, "ranges": run.ranges,
            "steps": run.steps, "layers": run.steps * run.layers_per_step,
            "kernels_per_step": run.per_step, "layers_per_step": run.layers_per_step,
            "kernel_ns": int((run.k_end - run.k_start).sum()), **extra}


# -- nsys SQLite export -------------------------------------------------------------------------

NSYS_TABLES = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT);
CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name TEXT);
CREATE TABLE ThreadNames (nameId INTEGER NOT NULL, priority INTEGER, globalTid INTEGER);
CREATE TABLE TARGET_INFO_GPU (vmId INTEGER NOT NULL, id INTEGER NOT NULL, name TEXT,
    busLocation TEXT, isDiscrete INTEGER, l2CacheSize INTEGER, totalMemory INTEGER,
    memoryBandwidth INTEGER, clockRate INTEGER, smCount INTEGER, pwGpuId INTEGER, uuid TEXT,
    luid INTEGER, chipName TEXT, cuDevice INTEGER, ctxswDevPath TEXT, ctrlDevPath TEXT,
    revision INTEGER, nodeMask INTEGER, constantMemory INTEGER, maxIPC INTEGER,
    maxRegistersPerBlock INTEGER, maxShmemPerBlock INTEGER, maxShmemPerBlockOptin INTEGER,
    maxShmemPerSm INTEGER, maxRegistersPerSm INTEGER, threadsPerWarp INTEGER,
    asyncEngines INTEGER, maxWarpsPerSm INTEGER, maxBlocksPerSm INTEGER,
    maxThreadsPerBlock INTEGER, maxBlockDimX INTEGER, maxBlockDimY INTEGER,
    maxBlockDimZ INTEGER, maxGridDimX INTEGER, maxGridDimY INTEGER, maxGridDimZ INTEGER,
    computeMajor INTEGER, computeMinor INTEGER, smMajor INTEGER, smMinor INTEGER);
CREATE TABLE ENUM_NSYS_EVENT_CLASS (id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
    eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER,
    nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
    streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
    demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER,
    launchType INTEGER, cacheConfig INTEGER, registersPerThread INTEGER NOT NULL,
    gridX INTEGER NOT NULL, gridY INTEGER NOT NULL, gridZ INTEGER NOT NULL,
    blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL,
    staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL,
    localMemoryPerThread INTEGER NOT NULL, localMemoryTotal INTEGER NOT NULL,
    gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER, graphNodeId INTEGER,
    sharedMemoryLimitConfig INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER,
    int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData TEXT);
"""

NSYS_VERSION, NSYS_SCHEMA = "2024.6.2.225", "3.16.1"
NVTX_PUSHPOP = 59


def _mangled(short: str) -> str:
    return f"_Z{len(short)}{short}v" if not short.startswith("_") else short


def write_nsys_sqlite(run: DecodeRun, path: Path) -> None:
    """Write ``run`` as ``nsys export --type sqlite`` would (schema 3.16, one process)."""
    def write(tmp: Path) -> None:
        conn = sqlite3.connect(tmp)
        try:
            # A throwaway file: no journal, no fsync; one transaction.
            conn.execute("PRAGMA journal_mode=OFF")
            conn.execute("PRAGMA synchronous=OFF")
            conn.executescript(NSYS_TABLES)
            _fill_nsys(conn, run)
            conn.commit()
        finally:
            conn.close()

    _write_atomically(path, write)
    sidecar(path).write_text(json.dumps(_summary(run, file_bytes=path.stat().st_size)))


def _fill_nsys(conn: sqlite3.Connection, run: DecodeRun) -> None:
    strings: dict[str, int] = {}

    def sid(value: str) -> int:
        return strings.setdefault(value, len(strings))

    for fixed in ("[Unknown]", "[kernel.kallsyms]", "[Max depth]"):
        sid(fixed)
    demangled = np.array([sid(s.name) for s in run.specs], np.int64)
    short = np.array([sid(s.short) for s in run.specs], np.int64)
    mangled = np.array([sid(_mangled(s.short)) for s in run.specs], np.int64)
    launch_rt, launch_drv = sid("cudaLaunchKernel_v7000"), sid("cuLaunchKernel")
    sync_name = sid("cudaStreamSynchronize_v3020")
    thread_name = sid("python3")

    meta = {
        "EXPORT_PRODUCT_NAME": "NVIDIA Nsight Systems", "EXPORT_PRODUCT_VERSION": NSYS_VERSION,
        "EXPORT_PRODUCT_DATE": "2024.6", "EXPORT_SCHEMA_VERSION": NSYS_SCHEMA,
        "EXPORT_SCHEMA_VERSION_MAJOR": "3", "EXPORT_SCHEMA_VERSION_MINOR": "16",
        "EXPORT_SCHEMA_VERSION_MICRO": "1", "EXPORT_PLATFORM": "linux-desktop",
        "EXPORT_ARCH": "x64", "EXPORT_PARAM_INPUT_FILE": "decode.nsys-rep",
        "EXPORT_PARAM_OUTPUT_FILE": "decode.sqlite", "EXPORT_PARAM_LAZY": "true",
        "EXPORT_PARAM_TIME_NORMALIZE": "false",
    }
    conn.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)", meta.items())
    conn.executemany("INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES (?, ?, ?)", [
        (0, "TRACE_PROCESS_EVENT_CUDA_RUNTIME", "CUDA runtime"),
        (1, "TRACE_PROCESS_EVENT_CUDA_DRIVER", "CUDA driver")])
    conn.execute("INSERT INTO PROCESSES VALUES (?, ?, ?)", (GLOBAL_PID, PID, "python3"))
    conn.execute("INSERT INTO ThreadNames VALUES (?, ?, ?)", (thread_name, 20, GLOBAL_TID))
    gpu = [1 << 48, DEVICE, "NVIDIA H200", "0000:18:00.0", 1, 62_914_560, 150_117_761_024,
           4_800_000_000_000, 1_980_000_000, 132, 0, "8e2c7a3e-6f5d-4b61-9a0e-3c2d1f0b9a77", 0,
           "GH100", 0, "", "", 161, 0, 65_536, 4, 65_536, 49_152, 232_448, 233_472, 65_536, 32,
           4, 64, 32, 1024, 1024, 1024, 64, 2_147_483_647, 65_535, 65_535, 9, 0, 9, 0]
    conn.execute(f"INSERT INTO TARGET_INFO_GPU VALUES ({', '.join('?' * len(gpu))})", gpu)

    # Runtime calls: every launch, then the per-step syncs (row order does not matter).
    is_driver = np.array([s.driver for s in run.specs])[run.kernel_spec]
    name_id = np.where(is_driver, launch_drv, launch_rt)
    n, steps = run.kernels, run.steps
    conn.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?, ?, 0, NULL)",
        zip(np.concatenate([run.api_start, run.sync_start]).tolist(),
            np.concatenate([run.api_end, run.sync_end]).tolist(),
            np.concatenate([is_driver.astype(np.int64), np.zeros(steps, np.int64)]).tolist(),
            repeat(GLOBAL_TID),
            np.concatenate([run.corr, run.sync_corr]).tolist(),
            np.concatenate([name_id, np.full(steps, sync_name)]).tolist(), strict=False))

    ks = run.kernel_spec
    grid = np.array([s.grid for s in run.specs], np.int64)[ks]
    block = np.array([s.block for s in run.specs], np.int64)[ks]
    conn.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 0, 7, ?, ?, ?, ?, ?, 1, 1, "
        "?, ?, ?, ?, ?, ?, ?, ?, 0, 0, 205258752, ?, 32768, NULL, 0)",
        zip(run.k_start.tolist(), run.k_end.tolist(), run.corr.tolist(), repeat(GLOBAL_PID),
            demangled[ks].tolist(), short[ks].tolist(), mangled[ks].tolist(),
            np.array([s.regs for s in run.specs])[ks].tolist(),
            grid[:, 0].tolist(), grid[:, 1].tolist(), grid[:, 2].tolist(),
            block[:, 0].tolist(), block[:, 1].tolist(), block[:, 2].tolist(),
            np.array([s.smem for s in run.specs])[ks].tolist(),
            range(1, n + 1), strict=False))

    # torch.cuda.nvtx.range_push: nvtxRangePushA, so the name is in `text`, not `textId`.
    names = np.array(run.range_names, dtype=object)[run.r_name]
    conn.executemany(
        "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
        f"VALUES (?, ?, {NVTX_PUSHPOP}, ?, ?, 0)",
        zip(run.r_start.tolist(), run.r_end.tolist(), names.tolist(), repeat(GLOBAL_TID),
            strict=False))
    conn.executemany("INSERT INTO StringIds VALUES (?, ?)",
                     ((i, s) for s, i in strings.items()))


# -- Kineto (PyTorch profiler) Chrome-trace JSON -------------------------------------------------

# Kineto's "ts" are µs on the profiler's clock (large, with fractional ns); the run's ns are
# shifted onto such a clock.
KINETO_CLOCK_NS = 4_458_671_000_000_000
KINETO_HEADER = """{
  "schemaVersion": 1,
  "deviceProperties": [
    {
      "id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150117761024,
      "computeMajor": 9, "computeMinor": 0,
      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,
      "regsPerBlock": 65536, "warpSize": 32,
      "sharedMemPerBlock": 49152, "numSms": 132,
      "sharedMemPerMultiprocessor": 233472
    }
  ],
  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2, "pg_count": 1},
  "record_shapes": 0,
  "with_stack": 0,
  "cupti_version": 24,
  "cuda_runtime_version": 12080,
  "cuda_driver_version": 12080,
  "trace_id": "5B7C2E0A9D4F4C1E8A6B3D2F1E0C9B8A",
  "traceEvents": [
  {
    "name": "process_name", "ph": "M", "ts": %(t0)s, "pid": %(pid)d, "tid": 0,
    "args": {
      "name": "python3"
    }
  },
  {
    "name": "thread_name", "ph": "M", "ts": %(t0)s, "pid": %(pid)d, "tid": %(tid)d,
    "args": {
      "name": "thread %(tid)d (python3)"
    }
  },
  {
    "name": "process_name", "ph": "M", "ts": %(t0)s, "pid": 0, "tid": 0,
    "args": {
      "name": "python3"
    }
  },
  {
    "name": "process_labels", "ph": "M", "ts": %(t0)s, "pid": 0, "tid": 0,
    "args": {
      "labels": "GPU 0"
    }
  },
  {
    "name": "thread_name", "ph": "M", "ts": %(t0)s, "pid": 0, "tid": 7,
    "args": {
      "name": "stream 7 "
    }
  }"""
KINETO_FOOTER = """,
  {
    "ph": "X", "cat": "Trace", "ts": %(t0)s, "dur": %(span)s,
    "pid": "Spans", "tid": "PyTorch Profiler",
    "name": "PyTorch Profiler (0)",
    "args": {
      "Op count": 0
    }
  },
  {
    "name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g",
    "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": %(t0)s
  },
  {
    "name": "Record Window End", "ph": "i", "s": "g",
    "pid": "", "tid": "", "ts": %(t1)s
  }
  ],
  "traceName": "/tmp/decode_rank0.pt.trace.json",
  "displayTimeUnit": "ms",
  "baseTimeNanoseconds": 1759300000000000000
}
"""
# Event templates, laid out as Kineto writes them. Times are "%d.%03d" µs (exact ns).
_T = '"ts": %d.%03d, "dur": %d.%03d,'
CPU_EVENT = (',\n  {\n    "ph": "X", "cat": "%s", "name": "%s", "pid": ' + str(PID)
             + ', "tid": ' + str(TID) + ',\n    ' + _T + '\n    "args": {\n      '
             '"External id": %d, "Ev Idx": %d\n    }\n  }')
RUNTIME_EVENT = (',\n  {\n    "ph": "X", "cat": "%s", "name": "%s", "pid": ' + str(PID)
                 + ', "tid": ' + str(TID) + ',\n    ' + _T + '\n    "args": {\n      '
                 '"External id": %d,      "cbid": %d, "correlation": %d\n    }\n  }')
FLOW_START = (',\n  {\n    "ph": "s", "id": %d, "pid": ' + str(PID) + ', "tid": ' + str(TID)
              + ', "ts": %d.%03d,\n    "cat": "ac2g", "name": "ac2g"\n  }')
FLOW_END = (',\n  {\n    "ph": "f", "id": %d, "pid": 0, "tid": 7, "ts": %d.%03d,\n    '
            '"cat": "ac2g", "name": "ac2g", "bp": "e"\n  }')
KERNEL_EVENT = (',\n  {\n    "ph": "X", "cat": "kernel", "name": "%s", "pid": 0, "tid": 7,\n'
                '    ' + _T + '\n    "args": {\n      "External id": %d,      "queued": 0, '
                '"device": 0, "context": 1,      "stream": 7, "correlation": %d,%s\n    }\n  }')


def _kernel_args_tail(spec: KernelSpec) -> str:
    threads = spec.block[0] * spec.block[1] * spec.block[2]
    blocks = spec.grid[0] * spec.grid[1] * spec.grid[2]
    occupancy = min(100, round(100 * threads * max(1, blocks // 132) / 2048))
    return (f'      "registers per thread": {spec.regs},      "shared memory": {spec.smem},'
            f'      "blocks per SM": {blocks / 132:.6f},      '
            f'"warps per SM": {blocks * threads / 32 / 132:.6f},      '
            f'"grid": [{", ".join(map(str, spec.grid))}],      '
            f'"block": [{", ".join(map(str, spec.block))}],      '
            f'"est. achieved occupancy %": {occupancy}')


def _us(ns: np.ndarray) -> tuple[list[int], list[int]]:
    """ns -> (whole µs, ns remainder) for "%d.%03d"."""
    return (ns // 1000).tolist(), (ns % 1000).tolist()


def _times(start: np.ndarray, end: np.ndarray) -> tuple[list[int], ...]:
    """Kineto "ts" and "dur" fields of events (run ns), split for "%d.%03d"."""
    return (*_us(start + KINETO_CLOCK_NS), *_us(end - start))


def _cpu_ops(run: DecodeRun) -> tuple[np.ndarray, ...]:
    """cpu_op events around each launch: (kernel, level, name code, start, end, op names)."""
    op_names = sorted({op for s in run.specs for op in s.ops})
    code = {op: i for i, op in enumerate(op_names)}
    depth = np.array([len(s.ops) for s in run.specs], np.int64)[run.kernel_spec]
    kernel = np.repeat(np.arange(run.kernels), depth)
    level = np.arange(len(kernel)) - np.repeat(np.cumsum(depth) - depth, depth)
    table = np.full((len(run.specs), 2), -1, np.int64)
    for i, s in enumerate(run.specs):
        table[i, :len(s.ops)] = [code[o] for o in s.ops]
    name = table[run.kernel_spec[kernel], level]
    # The outer op starts first and ends last; both wrap the launch call.
    lo, hi = run.op_lo[kernel], run.op_hi[kernel]
    a0, a1 = run.api_start[kernel], run.api_end[kernel]
    start = lo + (a0 - lo) * (1 + 3 * level) // 10
    end = hi - (hi - a1) * (1 + 3 * level) // 10
    return kernel, level, name, start, end, np.array(op_names, dtype=object)


def kineto_event_count(run: DecodeRun) -> dict[str, int]:
    ops = int(sum(len(run.specs[i].ops) * c for i, c in
                  enumerate(np.bincount(run.kernel_spec, minlength=len(run.specs)))))
    counts = {"kernel": run.kernels, "cuda_runtime": run.kernels + run.steps,
              "ac2g": 2 * run.kernels, "cpu_op": ops, "user_annotation": run.ranges}
    counts["total"] = sum(counts.values()) + 8   # metadata, span and instant events
    return counts


def _kineto_chunks(run: DecodeRun, steps_per_chunk: int) -> Iterator[str]:
    """The events, a few steps at a time: CPU events in time order (parents first), then the
    GPU's kernels each followed by its flow end."""
    specs = run.specs
    kname = np.array([json.dumps(s.name)[1:-1] for s in specs], dtype=object)
    ktail = np.array([_kernel_args_tail(s) for s in specs], dtype=object)
    is_driver = np.array([s.driver for s in specs])[run.kernel_spec]
    op_kernel, _, op_name, op_start, op_end, op_names = _cpu_ops(run)
    # External ids: each annotation and op takes one; a launch and its kernel take their
    # innermost op's (Kineto links them that way).
    first_op = np.searchsorted(op_kernel, np.arange(run.kernels))
    op_count = np.bincount(op_kernel, minlength=run.kernels)
    range_names = np.array([json.dumps(s)[1:-1] for s in run.range_names], dtype=object)
    for s0 in range(0, run.steps, steps_per_chunk):
        s1 = min(run.steps, s0 + steps_per_chunk)
        k0, k1 = s0 * run.per_step, s1 * run.per_step
        r0, r1 = (int(x) for x in np.searchsorted(run.r_step, [s0, s1]))
        o0, o1 = (int(x) for x in np.searchsorted(op_kernel, [k0, k1]))
        ext_ann = 1_000_000 + o0 + r0     # unique across chunks
        ext_op = ext_ann + (r1 - r0)
        cpu: list[list[str]] = []
        keys: list[np.ndarray] = []

        rs, re_ = run.r_start[r0:r1], run.r_end[r0:r1]
        ids = range(ext_ann, ext_op)
        cpu.append([CPU_EVENT % t for t in zip(
            repeat("user_annotation"), range_names[run.r_name[r0:r1]].tolist(),
            *_times(rs, re_), ids, ids, strict=False)])
        keys.append(_sort_key(rs, re_, 0))

        os_, oe = op_start[o0:o1], op_end[o0:o1]
        ids = range(ext_op, ext_op + (o1 - o0))
        cpu.append([CPU_EVENT % t for t in zip(
            repeat("cpu_op"), op_names[op_name[o0:o1]].tolist(), *_times(os_, oe), ids, ids,
            strict=False)])
        keys.append(_sort_key(os_, oe, 1))

        kext = (ext_op + first_op[k0:k1] - o0 + op_count[k0:k1] - 1).tolist()
        corr = run.corr[k0:k1].tolist()
        drv = is_driver[k0:k1]
        a0, a1 = run.api_start[k0:k1], run.api_end[k0:k1]
        api_times = _times(a0, a1)
        cpu.append([RUNTIME_EVENT % t for t in zip(
            np.where(drv, "cuda_driver", "cuda_runtime").tolist(),
            np.where(drv, "cuLaunchKernel", "cudaLaunchKernel").tolist(), *api_times, kext,
            np.where(drv, 307, 211).tolist(), corr, strict=False)])
        keys.append(_sort_key(a0, a1, 2))
        cpu.append([FLOW_START % t for t in zip(corr, *api_times[:2], strict=False)])
        keys.append(_sort_key(a0, a1, 3))

        ss, se = run.sync_start[s0:s1], run.sync_end[s0:s1]
        cpu.append([RUNTIME_EVENT % t for t in zip(
            repeat("cuda_runtime"), repeat("cudaStreamSynchronize"), *_times(ss, se),
            repeat(0), repeat(226), run.sync_corr[s0:s1].tolist(), strict=False)])
        keys.append(_sort_key(ss, se, 2))

        flat = [s for part in cpu for s in part]
        key = np.concatenate(keys, axis=1)
        yield "".join([flat[i] for i in np.lexsort(key[::-1]).tolist()])
        del flat, cpu

        ks, ke = run.k_start[k0:k1], run.k_end[k0:k1]
        spec = run.kernel_spec[k0:k1]
        k_times = _times(ks, ke)
        kernels = [KERNEL_EVENT % t for t in zip(kname[spec].tolist(), *k_times, kext, corr,
                                                  ktail[spec].tolist(), strict=False)]
        flows = [FLOW_END % t for t in zip(corr, *k_times[:2], strict=False)]
        yield "".join([x for pair in zip(kernels, flows, strict=True) for x in pair])


def _sort_key(start: np.ndarray, end: np.ndarray, rank: int) -> np.ndarray:
    """Rows (start, -duration, kind rank): a parent sorts before what it contains."""
    return np.stack([start, start - end, np.full(len(start), rank, np.int64)])


def write_kineto_json(run: DecodeRun, path: Path, compresslevel: int = 9,
                      steps_per_chunk: int = 32) -> None:
    """Write ``run`` as a gzipped PyTorch-profiler trace (what ``export_chrome_trace`` writes).

    Level 9, as the profiler writes it (``gzip.open``'s default): the file's size is what a
    reader's memory is measured against, and level 1 makes it half as large again.
    """
    def fmt(ns: int) -> str:
        return f"{ns // 1000}.{ns % 1000:03d}"

    t0 = int(min(run.r_start.min(), run.api_start.min())) - 10_000 + KINETO_CLOCK_NS
    t1 = int(max(run.k_end.max(), run.sync_end.max())) + 10_000 + KINETO_CLOCK_NS
    raw = 0

    def write(tmp: Path) -> None:
        nonlocal raw
        with gzip.open(tmp, "wb", compresslevel=compresslevel) as f:
            for text in (KINETO_HEADER % {"t0": fmt(t0), "pid": PID, "tid": TID},
                         *_kineto_chunks(run, steps_per_chunk),
                         KINETO_FOOTER % {"t0": fmt(t0), "t1": fmt(t1),
                                          "span": fmt(t1 - t0)}):
                data = text.encode()
                raw += len(data)
                f.write(data)

    _write_atomically(path, write)
    sidecar(path).write_text(json.dumps(_summary(
        run, file_bytes=path.stat().st_size, raw_bytes=raw, events=kineto_event_count(run))))
