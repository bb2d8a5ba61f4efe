"""Compile every kernel ahead of time for Hopper (sm_90a) without a GPU; report registers and
spills from ``ptxas -v``.

    python -m kimi_perf_kernels.aot [--json FILE]

Each Triton kernel is compiled at the configurations the decode paths launch for the K3 TP8 rank
shapes, with the alignment the JIT sees at launch (16-byte aligned pointers, row strides that
are multiples of 16), and the hot kernels (the skinny linears, the KDA decode, the fused MoE
launches, the attention residuals) also with their integer arguments' K3 values specialised
as the JIT specialises them (a 1 becomes a constant, a multiple of 16 is known to be one:
vectorised loads, a loop with a trip count it knows), so registers and spills are those of
the kernels a GPU runs. Then every
configuration the two kernel paths launch on the ``tiny`` preset (``launched_builds``: the
dtypes, flags and split counts a run meets, the float32 of the GPU check's correctness run
among them), since a configuration first compiled on the GPU may not compile at all. Exit code
1 if a kernel fails to compile or spills registers, if a K3 build of a kernel that streams
weights or the cache has no asynchronous copy in flight (``not_pipelined``), or if ptxas warns
of a performance loss in a build other than those known to have one (``KNOWN_SLOW``, each
listed with its warning). Must run without ``TRITON_INTERPRET`` (the interpreter replaces the
JIT that compiles: refused). A kernel that takes part in programmatic dependent
launch is built without it and with it (``pdl_variants``), and each build's PTX is checked:
with PDL, nothing touches global memory before ``griddepcontrol.wait``, which is in the entry
block; without, no ``griddepcontrol`` at all (``check_grid_dependency``). The CuTe DSL kernels
(``cute_gemv``) follow, compiled with fake tensors for sm_90a by CuTe DSL's own toolchain, at
every (M, N, K) whose cubin the GPU check launches.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)

# A K3 TP8 rank: hidden 7168; the MoE's latent 3584, router 896 experts (one pass writes both:
# rows of 4480), experts' intermediate 384, the shared experts' 768; the KDA's 12 heads of 128
# (1536 wide), its input projection 6288 rows; 8 attention-residual blocks.
HIDDEN, LATENT, INTER, SHARED_INTER, KDA_PROJ, IN_PROJ = 7168, 3584, 384, 768, 1536, 6288
QKV_A = 1536 + 512 + 64   # the standard path's row of q_lora + kv_lora + rope


@dataclass
class Build:
    label: str
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    divisible: list[str] | None = None   # arguments known divisible by 16 (default: _aligned)
    ints: dict[str, int] | None = None   # integer arguments' values, specialised as the JIT does


def builds() -> list[Build]:
    """Every kernel at the configurations the decode paths launch for a K3 TP8 rank, each way
    it launches with respect to PDL (``pdl_variants``), then the linears built with PDL and
    their weights prefetched before the wait."""
    linears, prefetching = _skinny_linear_builds()
    out = [*_attn_res_builds(), *linears, *_kda_builds(), *_expert_builds(),
           *_norm_and_elementwise_builds(), *_mla_builds()]
    return [variant for build in out for variant in pdl_variants(build)] + prefetching


def _moe_ints(m: int, situ: bool, mxfp4: bool, consts: dict) -> dict[str, int]:
    """The routed experts' FC1 (``situ``) or FC2 integer arguments at these shapes, as
    the specialized path passes them (the latent and router logits one fp32 row of 4480,
    FC2's routed latent beside the shared experts' output); the shared experts' where
    ``consts`` has them."""
    from kimi_perf_kernels import skinny_linear

    rows, cols = (2 * INTER, LATENT) if situ else (LATENT, INTER)
    per_value = 0.5 if mxfp4 else 1   # (MXFP4: a byte of codes per two values)
    ints = {"M": m, "INTER": INTER, "stride_we": int(rows * cols * per_value),
            "stride_wn": int(cols * per_value), "stride_se": rows * cols // 32 if mxfp4 else 0,
            "stride_sn": cols // 32 if mxfp4 else 0}
    if not consts["SHARED"]:   # the standard path's: a row of its own, no shared experts
        return ints | ({"KDIM": LATENT, "stride_x": LATENT} if situ
                       else {"N": LATENT, "stride_out": LATENT}) | dict.fromkeys(
            ("S_N", "S_K", "stride_sx", "stride_sw", "stride_sout", "SHARED_PROGRAMS"), 0)
    ints |= ({"KDIM": LATENT, "stride_x": 896 + LATENT} if situ
             else {"N": LATENT, "stride_out": LATENT + HIDDEN})
    s_n, s_k = (SHARED_INTER, HIDDEN) if situ else (HIDDEN, SHARED_INTER)
    return ints | {"S_N": s_n, "S_K": s_k, "stride_sx": s_k, "stride_sw": s_k,
                   "stride_sout": SHARED_INTER if situ else LATENT + HIDDEN,
                   "SHARED_PROGRAMS": skinny_linear.tiles(m, s_n, consts["S_BLOCK_M"],
                                                          consts["S_BLOCK_N"])}


def _attn_res_builds() -> list[Build]:
    from kimi_perf_kernels import attn_res

    return [
        Build("attn_res h7168", attn_res.attn_res_kernel,
              {"prefix_ptr": "*bf16", "delta_ptr": "*bf16", "blocks_ptr": "*bf16",
               "qk_ptr": "*fp32", "norm_ptr": "*fp32", "out_ptr": "*bf16", "hidden": "i32",
               "n_blocks": "i32", "write_idx": "i32", "stride_prefix": "i32",
               "stride_delta": "i32", "stride_blocks_m": "i32", "stride_blocks_s": "i32",
               "stride_out": "i32", "eps": "fp32", "HAS_DELTA": "constexpr",
               "RESET": "constexpr", "HAS_NORM": "constexpr", "BLOCK_H": "constexpr"},
              {"HAS_DELTA": True, "RESET": False, "HAS_NORM": True, "BLOCK_H": 8192,
               "RNE": False}, 8,
              ints={"hidden": HIDDEN, "n_blocks": 3, "write_idx": -1,
                    "stride_prefix": HIDDEN, "stride_delta": HIDDEN,
                    "stride_blocks_m": 8 * HIDDEN, "stride_blocks_s": HIDDEN,
                    "stride_out": HIDDEN}),
    ]


def _skinny_linear_builds() -> tuple[list[Build], list[Build]]:
    """The skinny linears (GEMV and GEMM tiles), and each also with PDL and its first weights
    read into L2 before the wait, as the GPU check runs it."""
    from kimi_perf_kernels import skinny_linear

    out = []
    prefetching = []   # (built with PDL only: the prefetch comes before its wait)
    linear_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "norm_ptr": "*fp32", "res_ptr": "*bf16",
                  "out_ptr": "*bf16", "M": "i32", "N_OUT": "i32", "K": "i32",
                  "stride_xm": "i32", "stride_wn": "i32", "stride_rm": "i32",
                  "stride_om": "i32", "eps": "fp32"}
    flags = ["NORM", "SITU", "RESIDUAL", "USE_DOT", "DOT_FP32", "RNE", "BETA", "BETA_LINEAR",
             "BLOCK_M", "BLOCK_N", "BLOCK_K", "PREFETCH_K", "LINE"]
    sig = {**linear_sig, **{f: "constexpr" for f in flags}}
    # (label, tokens, SiTU, RMSNorm, residual, output columns, K): the KDA input projection,
    # the latent up-projection (norm and the shared experts' output added), the shared
    # experts' gate/up
    for label, m, situ, norm, residual, n_out, k in (
            ("gemv M=1 in_proj", 1, False, False, False, IN_PROJ, HIDDEN),
            ("gemv M=4 in_proj", 4, False, False, False, IN_PROJ, HIDDEN),
            ("gemv M=4 latent_up rmsnorm+residual", 4, False, True, True, HIDDEN, LATENT),
            ("gemv M=4 shared gate/up situ", 4, True, False, False, SHARED_INTER, HIDDEN),
            ("gemm M=16 in_proj", 16, False, False, False, IN_PROJ, HIDDEN),
            ("gemm M=64 latent_up rmsnorm+residual", 64, False, True, True, HIDDEN, LATENT),
            ("gemm M=64 shared gate/up situ", 64, True, False, False, SHARED_INTER, HIDDEN)):
        block_m, block_n, block_k, warps = skinny_linear.launch_config(m, situ=situ)
        consts = {"NORM": norm, "SITU": situ, "RESIDUAL": residual,
                  "USE_DOT": m > skinny_linear.GEMV_MAX_M, "DOT_FP32": False, "RNE": False,
                  "BETA": 4.0, "BETA_LINEAR": 25.0, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "BLOCK_K": block_k, "PREFETCH_K": 0, "LINE": 64}
        ints = {"M": m, "N_OUT": n_out, "K": k, "stride_xm": k, "stride_wn": k,
                "stride_rm": n_out if residual else 0, "stride_om": n_out}
        out.append(Build(f"skinny_linear {label}", skinny_linear.skinny_linear_kernel, sig,
                         consts, warps, ints=ints))
        # and with PDL, its first weights read into L2 before the wait, as the GPU check runs it
        prefetch = skinny_linear.prefetch_columns(skinny_linear.CHECKED_PREFETCH_BYTES, k,
                                                  n_out, block_n, 2, situ)
        prefetching.append(Build(f"skinny_linear {label} PDL prefetch {prefetch}",
                         skinny_linear.skinny_linear_kernel,
                         {**sig, "PDL": "constexpr"},
                         {**consts, "PDL": True, "PREFETCH_K": prefetch}, warps,
                         ints=ints))
    return out, prefetching


def _kda_builds() -> list[Build]:
    import torch

    from kimi_perf_kernels import kda_decode

    out = []
    kda_types = {"z_ptr": "*bf16", "wfb_ptr": "*bf16", "conv_ptr": "*bf16",
                 "out_ptr": "*bf16", "inputs_ptr": "*bf16", "arrivals_ptr": "*i32",
                 "pending_ptr": "*i32", "half_ptr": "*i32", "eps": "fp32",
                 "lower_bound": "fp32", "f_ptr": "*bf16"}
    # batch 1 and 64, and batch 1 after a verify step (its accepted positions replayed first);
    # verify steps of 1+3 tokens at batch 1, 8 and 64 and of 1+7 at 64; the standard path's
    # (f_b projected before, in bf16; in fp32 as the GPU check's split stress gives it);
    # each split as on an H200
    for batch, tokens, f_type, replay in (
            (1, 1, None, False), (64, 1, None, False), (1, 1, None, True), (64, 1, None, True),
            (1, 4, None, True), (8, 4, None, True), (64, 4, None, True), (64, 8, None, True),
            (64, 4, "bf16", True), (1, 1, "bf16", False), (64, 1, "fp32", True),
            (64, 4, "fp32", True)):
        f_given = f_type is not None
        splits = kda_decode.kda_splits(batch * 12, 128, torch.device("cpu"), tokens)
        tiles = kda_decode.kda_tiles(128, 128, splits)
        consts = {"D": 128, "F_RANK": 128, **tiles, "T_PAD": kda_decode.kda_token_rows(tokens),
                  "F_GIVEN": f_given, "REPLAY": replay, "RECORD": tokens > 1,
                  "DOT_FP32": False, "RNE": False}
        tag = (f" batch {batch}" + (f" verify 1+{tokens - 1}" if tokens > 1 else "")
               + (" replay" if replay and tokens == 1 else "")
               + (f" f given ({f_type})" if f_given else ""))
        f_row = KDA_PROJ if f_given else IN_PROJ
        out.append(Build(f"kda_decode d128{tag} split {splits}",
                         kda_decode.kda_decode_kernel,
                         _signature(kda_decode.kda_decode_kernel,
                                    {**kda_types, "f_ptr": f"*{f_type or 'bf16'}"}, consts),
                         consts,
                         kda_decode.kda_warps(tiles["BV"]),
                         ints={"B": batch, "T": tokens, "H": 12, "T_REC": 8,
                               "stride_zb": tokens * IN_PROJ, "stride_zt": IN_PROJ,
                               "stride_fb": tokens * f_row, "stride_ft": f_row,
                               "stride_ob": tokens * KDA_PROJ, "stride_ot": KDA_PROJ,
                               "g_col": 3 * KDA_PROJ, "fa_col": 4 * KDA_PROJ,
                               "b_col": 4 * KDA_PROJ + 128}))
    return out


def _expert_builds() -> list[Build]:
    """The routed experts (with the shared experts beside them, and the standard path's), the
    grouped ones, the finalize and the router's top-k."""
    from kimi_perf_kernels import (
        moe_experts,
        moe_grouped_fc1,
        moe_grouped_fc2,
        router_topk,
        skinny_linear,
    )

    out = []
    routed_types = {"w13_ptr": "*bf16", "ids_ptr": "*i32", "lists_ptr": "*i32",
                    "counts_ptr": "*i32", "act_ptr": "*bf16", "scale": "fp32",
                    "x_ptr": "*bf16", "sx_ptr": "*bf16", "sw_ptr": "*bf16",
                    "sout_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16"}
    # with the shared experts' tiles (GEMV at M <= 4, tl.dot above; M > 64 takes more row
    # tiles of the same size); without them and routing, the standard path's FC1 and
    # per-slot FC2; on bf16 experts and on MXFP4's codes and scales
    for mxfp4, (m, shared) in itertools.product(
            (False, True), ((1, True), (4, True), (64, True), (1, False))):
        tags = {True: f"+shared M={m}", False: f"standard M={m}"}
        for kernel, situ in ((moe_experts.moe_route_fc1_situ_kernel, True),
                             (moe_experts.moe_fc2_combine_kernel, False)):
            consts = {"SHARED": False, "S_USE_DOT": False, "DOT_FP32": False, "S_BLOCK_M": 1,
                      "S_BLOCK_N": 1, "S_BLOCK_K": 1}
            if shared:
                block_m, block_n, block_k = moe_experts.shared_tile(m, situ)
                consts = {"SHARED": True, "S_USE_DOT": m > skinny_linear.GEMV_MAX_M,
                          "DOT_FP32": False, "S_BLOCK_M": block_m, "S_BLOCK_N": block_n,
                          "S_BLOCK_K": block_k}
            block_n, block_k = moe_experts.routed_blocks(mxfp4)
            consts.update(BLOCK_N=block_n, BLOCK_K=block_k, RNE=False, MXFP4=mxfp4)
            if situ:
                consts.update(TOP_K=16, BLOCK_E=1024, BETA=4.0, BETA_LINEAR=25.0, ROUTE=shared)
            else:
                consts.update(TOP_K=16 if shared else 1, WEIGHTED=shared)
            # the specialized path's: the latent and the router logits are one fp32 row of
            # 4480 (router_latent_down), FC2 writes the routed latent and the shared experts'
            # output side by side (rows of 3584 + 7168)
            weight = "w13" if situ else "w2"
            types = {**routed_types, "x_ptr": "*fp32" if shared else "*bf16",
                     "sout_ptr": "*bf16" if situ else "*fp32",
                     "out_ptr": "*fp32" if shared else "*bf16",
                     f"{weight}_ptr": "*u8" if mxfp4 else "*bf16",
                     f"{weight}s_ptr": "*u8" if mxfp4 else "*bf16"}
            # (the standard FC2 takes each of a token's 16 slots as a token of one slot; its
            # FC1 reads a bf16 latent of its own and no logits)
            ints = _moe_ints(m if shared or situ else 16 * m, situ, mxfp4, consts)
            if situ:
                ints |= {"E": 896, "stride_l": 896 + LATENT} if shared else {"E": 0, "stride_l": 0}
            label = "moe_route_fc1_situ E896 k16 I384" if situ else "moe_fc2_combine N3584 I384"
            label += " MXFP4" if mxfp4 else ""
            out.append(Build(f"{label} {tags[shared]}", kernel,
                             _signature(kernel, types, consts), consts, 8, ints=ints))
    # the grouped FC1 and FC2 (opt-in); 512: a verify step of 64 × 8; on MXFP4 at batch 64
    for mxfp4, m in ((False, 16), (False, 64), (False, 512), (True, 64)):
        routed_n, routed_k = moe_experts.routed_blocks(mxfp4)
        tag = " MXFP4" if mxfp4 else ""
        block_m, block_n, block_k = moe_experts.shared_tile(m, True)
        consts = {"TOP_K": 16, "BETA": 4.0, "BETA_LINEAR": 25.0,
                  "BLOCK_S": min(16 * m, moe_grouped_fc1.SCAN),
                  "BLOCK_T": moe_grouped_fc1.BLOCK_T, "BLOCK_N": routed_n, "BLOCK_K": routed_k,
                  "RNE": False, "MXFP4": mxfp4, "SHARED": True,
                  "S_USE_DOT": m > skinny_linear.GEMV_MAX_M, "DOT_FP32": False,
                  "S_BLOCK_M": block_m, "S_BLOCK_N": block_n, "S_BLOCK_K": block_k}
        kernel = moe_grouped_fc1.moe_grouped_fc1_situ_kernel
        weight = {"w13_ptr": "*u8", "w13s_ptr": "*u8"} if mxfp4 else {"w13s_ptr": "*bf16"}
        out.append(Build(f"moe_grouped_fc1_situ E896 k16 I384{tag} +shared M={m}", kernel,
                         _signature(kernel, {**routed_types, "x_ptr": "*fp32", **weight},
                                    consts), consts, 8,
                         ints=_moe_ints(m, True, mxfp4, consts) | {"SLOTS": 16 * m}))
        block_m, block_n, block_k = moe_experts.shared_tile(m, False)
        consts = {"TOP_K": 16, "BLOCK_T": moe_grouped_fc1.BLOCK_T,
                  "BLOCK_N": moe_grouped_fc2.BLOCK_N,
                  "BLOCK_K": moe_grouped_fc2.MXFP4_BLOCK_K if mxfp4 else routed_k,
                  "RNE": False, "MXFP4": mxfp4, "SHARED": True,
                  "S_USE_DOT": m > skinny_linear.GEMV_MAX_M, "DOT_FP32": False,
                  "S_BLOCK_M": block_m, "S_BLOCK_N": block_n, "S_BLOCK_K": block_k}
        kernel = moe_grouped_fc2.moe_grouped_fc2_kernel
        weight = {"w2_ptr": "*u8", "w2s_ptr": "*u8"} if mxfp4 else {"w2s_ptr": "*bf16"}
        out.append(Build(f"moe_grouped_fc2 N3584 I384{tag} +shared M={m}", kernel,
                         _signature(kernel, {**routed_types, "out_ptr": "*fp32",
                                             "sout_ptr": "*fp32", **weight}, consts),
                         consts, 8, ints=_moe_ints(m, False, mxfp4, consts)))
    consts = {"TOP_K": 16, "BLOCK_N": 1024, "RNE": False}
    out.append(Build("moe_finalize k16 N3584", moe_experts.moe_finalize_kernel,
                     _signature(moe_experts.moe_finalize_kernel,
                                {"per_slot_ptr": "*bf16", "out_ptr": "*bf16"}, consts), consts,
                     ints={"N": LATENT}))
    for zero in (False, True):   # True: zeroing the grouped FC2's rows (opt-in)
        consts = {"K": 16, "BLOCK_E": 1024, "ZERO": zero, "BLOCK_Z": 1024}
        # the standard path's logits a row of their own; the grouped path's beside the latent,
        # its routed latent (zeroed) beside the shared experts' output
        ints = ({"E": 896, "stride_l": 896 + LATENT, "ZERO_N": LATENT,
                 "stride_zero": LATENT + HIDDEN} if zero
                else {"E": 896, "stride_l": 896, "ZERO_N": 0, "stride_zero": 0})
        out.append(Build(f"router_topk E896 k16{' +zero' if zero else ''}",
                         router_topk.router_topk_kernel,
                         _signature(router_topk.router_topk_kernel,
                                    {"ids_ptr": "*i32", "scale": "fp32"}, consts), consts,
                         ints=ints))
    return out


def _norm_and_elementwise_builds() -> list[Build]:
    from kimi_perf_kernels import gate_sigmoid_mul, l2_prefetch, rms_norm, situ_and_mul

    out = []
    # q_lora and kv_lora (the standard path's, of one row of q_lora + kv_lora + rope); the
    # latent; hidden (final norm)
    for width, ints in ((2048, {"N": 1536, "stride_x": QKV_A, "stride_out": 1536, "N2": 512,
                                "stride_x2": QKV_A, "stride_out2": 512}),
                        (4096, dict.fromkeys(("N", "stride_x", "stride_out", "N2", "stride_x2",
                                              "stride_out2"), LATENT)),
                        (8192, dict.fromkeys(("N", "stride_x", "stride_out", "N2", "stride_x2",
                                              "stride_out2"), HIDDEN))):
        consts = {"BLOCK": width, "RNE": False}
        out.append(Build(f"rms_norm {width}", rms_norm.rms_norm_kernel,
                         _signature(rms_norm.rms_norm_kernel,
                                    {"x_ptr": "*bf16", "x2_ptr": "*bf16", "out_ptr": "*bf16",
                                     "out2_ptr": "*bf16", "eps": "fp32"}, consts),
                         consts, 8, ints=ints))
    consts = {"BLOCK": l2_prefetch.BLOCK}
    out.append(Build("l2_prefetch", l2_prefetch.l2_prefetch_kernel,
                     _signature(l2_prefetch.l2_prefetch_kernel, {"ptr": "*bf16"}, consts),
                     consts, 8, ints={"n": HIDDEN * KDA_PROJ,   # (o_proj's weights)
                                      "per_program": l2_prefetch.per_program(HIDDEN * KDA_PROJ)}))
    consts = {"BETA": 4.0, "BETA_LINEAR": 25.0, "BLOCK": 1024, "RNE": False}
    out.append(Build("situ_and_mul", situ_and_mul.situ_and_mul_kernel,
                     _signature(situ_and_mul.situ_and_mul_kernel,
                                {"x_ptr": "*bf16", "out_ptr": "*bf16"}, consts), consts,
                     ints={"INTER": SHARED_INTER, "stride_x": 2 * SHARED_INTER,
                           "stride_out": SHARED_INTER}))
    consts = {"BLOCK_V": 128, "RNE": False}
    out.append(Build("gate_sigmoid_mul V128", gate_sigmoid_mul.gate_sigmoid_mul_kernel,
                     _signature(gate_sigmoid_mul.gate_sigmoid_mul_kernel,
                                {"o_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16"},
                                consts), consts, 1,
                     ints={"V": 128, "stride_oh": 128, "stride_om": 128,   # (batch 1)
                           "stride_g": 12 * 128, "stride_out": 12 * 128}))
    return out


def _mla_builds() -> list[Build]:
    """The gated MLA's kernels: the absorbed query and cache insert, the standard path's
    concat insert, the attention at each split count and row block, the combine and the
    up-projection with its gate."""
    from kimi_perf_kernels import (
        mla_absorb_insert,
        mla_attention,
        mla_concat_insert,
        mla_uv_gate,
    )

    out = []
    bf16 = {"q_ptr": "*bf16", "wuk_ptr": "*bf16", "qhat_ptr": "*bf16", "kv_ptr": "*bf16",
            "olat_ptr": "*bf16", "wuv_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16",
            "pos_ptr": "*i64", "kv_scale": "fp32", "q_scale": "fp32", "eps": "fp32",
            "sm_scale": "fp32"}
    # MLA at batch 1 (a verify step of 1+3 tokens: 32 rows), 12 heads, a cache of 4096
    # positions of 576; the specialized path's q_lora, latent KV and gate one row of 3648
    cache_strides = {"stride_cache_b": 4096 * 576, "stride_cache_s": 576}
    qkv_a_g = 1536 + 576 + 12 * 128
    for cache in ("bf16", "fp8e4nv"):   # (an fp8 cache takes an fp8 q̂)
        consts = {"NOPE": 128, "ROPE": 64, "LORA": 512,
                  "BLOCK_M": mla_absorb_insert.BLOCK_M, "BLOCK_L": 64, "BLOCK_ROPE": 64,
                  "FP8": cache != "bf16", "DOT_FP32": False, "RNE": False}
        out.append(Build(f"mla_absorb_insert {cache} cache",
                         mla_absorb_insert.mla_absorb_insert_kernel,
                         _signature(mla_absorb_insert.mla_absorb_insert_kernel,
                                    {**bf16, "cache_ptr": f"*{cache}", "qhat_ptr": f"*{cache}"},
                                    consts), consts,
                         ints={"M": 1, "H": 12, "T": 1, "stride_q": 12 * 192,
                               "stride_kv": qkv_a_g, "S": 4096, **cache_strides}))
        consts = {"NOPE": 128, "ROPE": 64, "LORA": 512, "BLOCK_ROPE": 64,
                  "FP8": cache != "bf16", "RNE": False}
        out.append(Build(f"mla_concat_insert {cache} cache",
                         mla_concat_insert.mla_concat_insert_kernel,
                         _signature(mla_concat_insert.mla_concat_insert_kernel,
                                    {"ql_ptr": "*bf16", "q_ptr": "*bf16", "kv_ptr": "*bf16",
                                     "kpe_ptr": "*bf16", "cache_ptr": f"*{cache}",
                                     "pos_ptr": "*i64", "qhat_ptr": f"*{cache}",
                                     "kv_scale": "fp32", "q_scale": "fp32"}, consts), consts,
                         ints={"H": 12, "T": 1, "stride_ql_h": 512, "stride_ql_m": 512,
                               "stride_q": 12 * 192, "stride_kv": 512, "stride_kpe": QKV_A,
                               "S": 4096, **cache_strides}))
        # row blocks of 16 (decode) and 32 (a verify step's tokens x heads)
        for splits, rb in itertools.product((1, mla_attention.MAX_SPLITS), (16, 32)):
            consts = {"LORA": 512, "ROPE": 64, "BLOCK_ROPE": 64, "RB": rb, "BLOCK_S": 32,
                      "SPLITS": splits, "FP8": cache != "bf16", "DOT_FP32": False,
                      "RNE": False}
            types = {**bf16, "cache_ptr": f"*{cache}", "qhat_ptr": f"*{cache}",
                     "out_ptr": "*bf16" if splits == 1 else "*fp32"}
            tokens = 1 if rb == 16 else 4
            out.append(Build(f"mla_attention {cache} cache, {splits} split(s), {rb} rows",
                             mla_attention.mla_attention_kernel,
                             _signature(mla_attention.mla_attention_kernel, types, consts),
                             consts, 8,
                             ints={"M": tokens, "H": 12, "T": tokens, **cache_strides}))
    most = mla_attention.MAX_SPLITS
    consts = {"LORA": 512, "SPLITS": most, "BLOCK_SPLITS": most, "RNE": False}
    out.append(Build(f"mla_combine {most} splits", mla_attention.mla_combine_kernel,
                     _signature(mla_attention.mla_combine_kernel, {"out_ptr": "*bf16"}, consts),
                     consts, ints={"M": 1, "H": 12}))
    for splits in (1, 2, 4, most):
        consts = {"LORA": 512, "V": 128, "BLOCK_V": 64, "BLOCK_L": 64, "SPLITS": splits,
                  "BLOCK_M": mla_uv_gate.merge_block(splits) if splits > 1
                  else mla_uv_gate.BLOCK_M, "BLOCK_SPLITS": triton.next_power_of_2(splits),
                  "DOT_FP32": False, "RNE": False}
        types = {**bf16, "olat_ptr": "*bf16" if splits == 1 else "*fp32"}
        out.append(Build(f"mla_uv_gate {splits} split(s)", mla_uv_gate.mla_uv_gate_kernel,
                         _signature(mla_uv_gate.mla_uv_gate_kernel, types, consts), consts,
                         ints={"M": 1, "H": 12, "stride_g": qkv_a_g, "stride_out": 12 * 128}))
    return out


# Constexprs the launchers set from INTERPRETED (kernels/common.py): a GPU compiles them False
INTERPRETER_FLAGS = ("DOT_FP32", "RNE")


def record_launches(out: Path) -> None:
    """Under the interpreter (TRITON_INTERPRET=1): run the tiny preset through both kernel
    paths with a GPU's tiles, and write every launch's kernel, argument types, constexprs and
    warps to ``out``. The steps a run meets: a prefill, a decode step with the attention split
    over positions and one without, a speculative verify of 4 tokens with its rollback, and a
    batch of 5 (past the GEMV's tokens: the GEMM tiles); in float32 (the GPU check's
    correctness run) and bf16 with a bf16 or fp8 cache; the specialized path also with PDL
    and the weight prefetch the GPU check runs. The kernels are not run."""
    import torch
    import triton.runtime.interpreter as interpreter
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from kimi_perf.decode.config import preset
    from kimi_perf.decode.validate import make_path
    from kimi_perf.decode.weights import random_weights
    from kimi_perf_kernels import common
    from kimi_perf_kernels.skinny_linear import CHECKED_PREFETCH_BYTES

    # Launches as a GPU makes them: the interpreter, which has no inline assembly, otherwise
    # reads no weights ahead (``weight_prefetch_bytes``). Nothing is run.
    common.INTERPRETED = False
    launches = []

    def recording_run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args, strict=False)) | kwargs
        params = inspect.signature(self.fn).parameters
        signature, constexprs, divisible = {}, {}, []
        for name in self.arg_names:
            value = bound[name]
            if "constexpr" in str(params[name].annotation):
                signature[name], constexprs[name] = "constexpr", value
                continue
            # The JIT's own specialization: its type, None and ints equal to 1 made
            # constexprs, "D" for a pointer or int divisible by 16
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = key
            elif key == "D":
                divisible.append(name)
        launches.append({"module": self.fn.__module__, "kernel": self.fn.__name__,
                         "signature": signature, "constexprs": constexprs,
                         "divisible": divisible, "num_warps": kwargs.get("num_warps", 4),
                         "pdl": bool(kwargs.get("launch_pdl"))})
        # Recorded, not run: which kernels launch, and how, does not depend on the values
        # (outputs stay uninitialised; nothing reads them as data but the next launches).

    interpreter.InterpretedFunction.run = recording_run
    c = preset("tiny", n_layers=4)
    weights = random_weights(c, seed=5)
    tokens = torch.randint(0, c.vocab, (5, 10), generator=torch.Generator().manual_seed(1))
    with common.gpu_tiles():
        for dtype, cache in ((torch.float32, None), (torch.bfloat16, None),
                             (torch.bfloat16, torch.float8_e4m3fn)):
            for path in ("specialized", "standard_kernels", "specialized+pdl+prefetch"):
                model = make_path(path.partition("+")[0], c, weights, dtype)
                model.pdl = path.endswith("prefetch")
                model.pdl_prefetch_bytes = CHECKED_PREFETCH_BYTES if model.pdl else 0
                state = model.new_state(2, 16, kv_dtype=cache, max_verify=4)
                model.forward(tokens[:2, :3], state)
                model.attention_splits = 3
                model.forward(tokens[:2, 3:4], state)
                model.attention_splits = None
                model.forward(tokens[:2, 4:5], state)
                model.forward(tokens[:2, 5:9], state, verify=True)
                state.accept(torch.tensor([2, 4]))
                model.forward(tokens[:2, 9:10], state)   # the accepted positions replayed
                model.group_experts_from = 5   # the specialized path's opt-in: routing first
                five = model.new_state(5, 4, kv_dtype=cache)
                model.forward(tokens[:, :1], five)
                model.forward(tokens[:, 1:2], five)
    out.write_text(json.dumps(launches))


def launched_builds() -> list[Build]:
    """One build per distinct configuration ``record_launches`` saw, each way for a PDL kernel
    (in a subprocess: the recording needs the interpreter, the compiling must not have it)."""
    with tempfile.TemporaryDirectory() as tmp:
        recorded = Path(tmp) / "launches.json"
        subprocess.run([sys.executable, "-m", "kimi_perf_kernels.aot", "--record",
                        str(recorded)], env={**os.environ, "TRITON_INTERPRET": "1"},
                       check=True)
        return builds_of(json.loads(recorded.read_text()))


def builds_of(launches: list[dict]) -> list[Build]:
    """The builds of recorded launches: one per distinct configuration, for a PDL kernel each
    way it launched: with PDL when it only ever launched with it (the weight prefetch before
    the wait), else both (the paths launch it with PDL too, under ``programmatic_launch``)."""
    builds: dict[str, Build] = {}
    only_pdl: dict[str, bool] = {}
    for launch in launches:
        # (the PDL constexpr as the interpreter ran it, always off; its launch flag is set)
        constexprs = {name: False if name in INTERPRETER_FLAGS else value
                      for name, value in launch["constexprs"].items() if name != "PDL"}
        pointers = sorted({t[1:] for t in launch["signature"].values() if t[0] == "*"})
        flags = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                         for k, v in constexprs.items()
                         if k not in INTERPRETER_FLAGS and v is not None)
        odd = [n for n, t in launch["signature"].items()
               if t != "constexpr" and t[0] in "*i" and n not in launch["divisible"]]
        unaligned = f" (not /16: {', '.join(odd)})" if odd else ""
        label = (f"{launch['kernel'].removesuffix('_kernel')} tiny ({','.join(pointers)}) "
                 f"{flags}{unaligned}")
        key = json.dumps([label, launch["signature"], launch["divisible"],
                          launch["num_warps"]])
        fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        builds.setdefault(key, Build(label, fn, launch["signature"], constexprs,
                                     launch["num_warps"], launch["divisible"]))
        only_pdl[key] = only_pdl.get(key, True) and launch["pdl"]
    return [variant for key, build in builds.items()
            for variant in pdl_variants(build, (True,) if only_pdl[key] else (False, True))]


def pdl_variants(build: Build, ways: tuple[bool, ...] = (False, True)) -> list[Build]:
    """A kernel that takes part in programmatic dependent launch, built as the paths launch it
    without PDL and as they launch it with (``programmatic_launch``), of those ``ways``; one
    that does not (the side stream's ``l2_prefetch``), as it is."""
    if "PDL" not in build.fn.arg_names:
        return [build]
    return [replace(build, label=build.label + (" PDL" if pdl else ""),
                    signature={**build.signature, "PDL": "constexpr"},
                    constexprs={**build.constexprs, "PDL": pdl}) for pdl in ways]


def _signature(kernel, types: dict[str, str], constexprs: dict[str, object]
               ) -> dict[str, str]:
    """Kernel arguments in order: constexprs, the given types, else fp32 pointers and i32."""
    return {name: "constexpr" if name in constexprs else
            types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
            for name in kernel.arg_names}


def _ptxas() -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(bundled) if bundled.exists() else "ptxas"


def _aligned(build: Build) -> dict:
    """What the JIT assumes at launch here: pointers from torch are 16-byte aligned, and K3's
    row strides are multiples of 16 (7168, 3584, 6288, 4480, ...); vectorised loads follow."""
    names = build.fn.arg_names
    return {(names.index(name),): [["tt.divisibility", 16]]
            for name, ty in build.signature.items()
            if ty.startswith("*") or (name.startswith("stride") and ty == "i32")}


def _specialised(build: Build) -> tuple[dict[str, str], dict[str, object], dict]:
    """The build's signature, constexprs and attributes with its ``ints`` specialised by the
    JIT's own rule (``native_specialize_impl``: a 1 is a constexpr, a multiple of 16 "D")."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    names = build.fn.arg_names
    attrs = _aligned(build) if build.divisible is None else {
        (names.index(name),): [["tt.divisibility", 16]] for name in build.divisible}
    signature, constexprs = dict(build.signature), dict(build.constexprs)
    for name, value in (build.ints or {}).items():
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = key
        if key == "D":
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        else:
            attrs.pop((names.index(name),), None)
    return signature, constexprs, attrs


def compile_build(build: Build):
    """The build compiled for sm_90a (Triton's kernel: ``.asm["ptx"]``, its metadata)."""
    signature, constexprs, attrs = _specialised(build)
    src = ASTSource(fn=build.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": build.num_warps})


# ptxas -v's "Potential Performance Loss" notes, e.g. (C7515): wgmma serialized.
_PERF_WARNING = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*?)"
                           r"(?: in the function '[^']*')?\s*$", re.M)


def performance_warnings(ptxas_output: str) -> list[str]:
    """ptxas's performance-loss warnings, one line each: "C7515: wgmma.mma_async ..."."""
    return [f"{code}: {text}" for code, text in _PERF_WARNING.findall(ptxas_output)]


def compile_one(build: Build) -> dict:
    kernel = compile_build(build)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        result = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o",
                                 str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    info = result.stderr + result.stdout
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed for {build.label}: {info.strip()[-500:]}")
    pdl = bool(build.constexprs.get("PDL"))
    check_grid_dependency(build.label, kernel.asm["ptx"], pdl)
    regs = re.search(r"Used (\d+) registers", info)
    spill_st = re.search(r"(\d+) bytes spill stores", info)
    spill_ld = re.search(r"(\d+) bytes spill loads", info)
    return {"kernel": build.label, "num_warps": build.num_warps, "pdl": pdl,
            "registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill_st.group(1)) if spill_st else 0,
            "spill_loads": int(spill_ld.group(1)) if spill_ld else 0,
            "smem_bytes": kernel.metadata.shared,   # Triton's dynamic shared memory
            "async_copies": async_copies(kernel.asm["ptx"]),
            "ptxas_warnings": performance_warnings(info),
            "cubin_bytes": len(kernel.asm["cubin"])}


# The kernels whose K3 loops stream weights or the latent cache (kda_decode's f_b weights, but
# where the f_b projection is given: " f given "). The tiny preset's builds are left out: one K
# step, nothing to keep in flight.
STREAMING = {"attn_res", "skinny_linear", "kda_decode", "moe_route_fc1_situ", "moe_fc2_combine",
             "moe_grouped_fc1_situ", "moe_grouped_fc2", "mla_attention", "mla_uv_gate"}


def streams_at_k3(label: str) -> bool:
    return (label.split()[0] in STREAMING and " tiny " not in label
            and " f given " not in label)


def not_pipelined(rows: list[dict]) -> list[str]:
    """The K3 builds of a streaming kernel with no asynchronous copy in flight: a loop that
    waits out one load's latency after another's."""
    return [r["kernel"] for r in rows if streams_at_k3(r["kernel"]) and r["async_copies"] == 0]


# Builds ptxas warns of a performance loss in, and why; any other warning fails the check.
# The skinny linear's GEMM with its RMSNorm: ptxas serialises its wgmmas (C7515, "non wgmma
# instructions defining accumulator registers"); only the builds with the norm warn, so the
# cause is inferred to be x scaled by the norm weight in registers each K step. Scaling W's
# tile instead (no warning) costs 40 more registers: which is faster is for a GPU to say.
KNOWN_SLOW = {"skinny_linear gemm": ("rmsnorm", "C7515")}


def unexpected_slow(rows: list[dict]) -> list[str]:
    """The builds with a ptxas performance warning ``KNOWN_SLOW`` does not expect."""
    def known(label: str, warning: str) -> bool:
        return any(label.startswith(prefix) and word in label
                   and warning.startswith(code)
                   for prefix, (word, code) in KNOWN_SLOW.items())
    return [f"{r['kernel']}: {w}" for r in rows for w in r.get("ptxas_warnings", ())
            if not known(r["kernel"], w)]


def async_copies(ptx: str) -> int:
    """The global -> shared copies in a kernel's PTX that are issued ahead of their use
    (``cp.async``, a TMA's ``cp.async.bulk``): the loads a pipelined loop keeps in flight.
    A loop that waits for each load before the next shows none."""
    return len(re.findall(r"^\s*(?:@\S+\s+)?cp\.async\.(?:ca|cg|bulk)\b", ptx, re.M))


# PTX memory instructions. Before a PDL kernel's wait only their forms in another state space
# (.param, .shared, .local, .const) may appear: ``.global`` or a generic address (no space
# named) may reach what the kernel before it writes. Async copies' group bookkeeping touches
# no memory, nor does a prefetch into L2 (no register gets data; L2 is where writes meet,
# whereas a line prefetched into L1 could be stale there).
MEMORY_OPS = {"ld", "ldu", "st", "atom", "red", "cp", "prefetch", "prefetchu", "multimem",
              "tensormap", "discard", "applypriority"}
OTHER_SPACES = {"param", "shared", "local", "const"}
NO_ACCESS = {"commit_group", "wait_group", "wait_all"}


def touches_global_memory(line: str) -> bool:
    """Whether a PTX line is an instruction that may read or write global memory."""
    words = line.split()
    if words and words[0].startswith("@"):      # a predicate
        words = words[1:]
    if not words:
        return False
    parts = words[0].rstrip(";").split(".")
    if parts[0] not in MEMORY_OPS or NO_ACCESS & set(parts):
        return False
    if parts[0] == "prefetch" and any(part.startswith("L2") for part in parts):
        return False
    spaces = {part.split("::")[0] for part in parts[1:]}
    return "global" in spaces or not spaces & OTHER_SPACES


def check_grid_dependency(label: str, ptx: str, pdl: bool) -> None:
    """A PDL kernel may run beside the kernel before it until its ``griddepcontrol.wait``:
    nothing may read or write global memory before that (the entry block runs first, so a
    global access above the wait in the PTX's text runs before it), and it must let the next
    launch start. A kernel built without PDL has neither instruction."""
    lines = ptx.splitlines()
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    launches = any("griddepcontrol.launch_dependents" in line for line in lines)
    if not pdl:
        if waits or launches:
            raise RuntimeError(f"{label}: griddepcontrol in a kernel built without PDL")
        return
    if not waits or not launches:
        raise RuntimeError(f"{label}: built with PDL but its PTX lacks griddepcontrol."
                           f"{'wait' if not waits else 'launch_dependents'}")
    if any(re.match(r"^\$L__BB", line) for line in lines[: waits[0]]):
        raise RuntimeError(f"{label}: griddepcontrol.wait is not in the entry block")
    early = [line.strip() for line in lines[: waits[0]] if touches_global_memory(line)]
    if early:
        raise RuntimeError(f"{label}: global memory touched before griddepcontrol.wait: "
                           f"{early[0]}")


def cute_dsl_rows(failed: list[str]) -> list[dict]:
    """The CuTe DSL kernels (``cute_gemv``) at the K3 TP8 projections, at every token count
    the GPU check's cubins are built for, compiled by CuTe DSL's own ptxas; skipped with a
    note where CuTe DSL is not installed (a failure with ``KIMI_PERF_NO_SKIPS``, as in CI)."""
    from kimi_perf_kernels.cute_gemv import CUBIN_MS, compile_gemv, decode_shapes

    if importlib.util.find_spec("cutlass") is None:
        note = "CuTe DSL is not installed (the cute extra): its kernels were not compiled"
        if os.environ.get("KIMI_PERF_NO_SKIPS"):
            failed.append(note)
        else:
            print(note)
        return []
    rows = []
    for name, (n, k) in decode_shapes("k3-tp8").items():
        for m in CUBIN_MS:
            label = f"cute_gemv {name} M={m}"
            try:
                c = compile_gemv(m, n, k)
            except Exception as exc:
                failed.append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            rows.append({"kernel": label, "num_warps": c.plan.warps, "registers": c.registers,
                         "spill_stores": c.spill_stores, "spill_loads": c.spill_loads,
                         "smem_bytes": c.plan.smem_bytes, "async_copies": async_copies(c.ptx),
                         "ptxas_warnings": c.ptxas_warnings, "cubin_bytes": len(c.cubin)})
    return rows


def sources_digest() -> str:
    """A digest of what decides the table: the kernels and the decode paths that launch
    them (their source files), so that a table read later is known to be of these."""
    import hashlib

    import kimi_perf.decode

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(kimi_perf.decode.__file__).parent):
        for file in sorted(package.glob("*.py")):
            digest.update(f"{package.name}/{file.name}\0".encode() + file.read_bytes())
    return digest.hexdigest()


def read_table(path: Path) -> dict:
    """The table that ``--json`` wrote to path, known to be of these sources: one compiled
    from other kernels or decode paths (a stale file named by hand) is a ValueError."""
    doc = json.loads(Path(path).read_text())
    if doc.get("sources") != sources_digest():
        raise ValueError(f"{path}: a table of other kernel sources (compile it again)")
    return doc


def json_file_problem(text: str) -> str | None:
    """Why --json cannot be written (checked before the minutes of compiling), or None."""
    from kimi_perf.errors import TraceError
    from kimi_perf.trace import check_not_read_only

    path = Path(text)
    if not text or text.endswith("/") or path.is_dir():
        return "a directory, not a file"
    if not path.parent.is_dir():
        return f"no folder {str(path.parent)!r}"
    if not os.access(path.parent, os.W_OK):   # (the file is made beside, then renamed)
        return f"no file can be made in {str(path.parent)!r}"
    try:
        check_not_read_only(path)
    except TraceError as exc:
        return str(exc).partition(": ")[2]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--json", help="write the table as JSON here")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)  # launched_builds' run
    args = parser.parse_args(argv)
    if args.record:
        record_launches(args.record)
        return 0
    problem = None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        problem = ("TRITON_INTERPRET is set: the interpreter replaces the compiler (run it "
                   "with env -u TRITON_INTERPRET)")
    elif args.json is not None and (why := json_file_problem(args.json)):
        problem = f"--json {args.json!r}: {why}"
    if problem:
        print(f"kimi_perf_kernels.aot: {problem}", file=sys.stderr)
        return 2
    rows, failed = [], []
    try:
        launched = launched_builds()
    except subprocess.CalledProcessError as exc:   # its traceback went to stderr
        launched = []
        failed.append(f"recording the decode paths' launches: exit code {exc.returncode}")
    for build in builds() + launched:
        try:
            rows.append(compile_one(build))
        except Exception as exc:  # report every kernel, then fail
            failed.append(f"{build.label}: {type(exc).__name__}: {str(exc)[:300]}")
    rows += cute_dsl_rows(failed)
    print(f"{'warps':>5s} {'regs':>5s} {'spill st/ld':>12s} {'smem':>7s}  kernel")
    for r in rows:
        print(f"{r['num_warps']:5d} {r['registers']:5d} {r['spill_stores']:>5d}/"
              f"{r['spill_loads']:<6d} {r['smem_bytes']:7d}  {r['kernel']}")
    spills = [r["kernel"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    unpipelined, slow = not_pipelined(rows), unexpected_slow(rows)
    for r in rows:
        for warning in r["ptxas_warnings"]:
            line = f"{r['kernel']}: {warning}"
            print(f"{'SLOW' if line in slow else 'slow (known)'} {line}")
    for f in failed:
        print(f"FAILED {f}")
    for label in spills:
        print(f"SPILLS {label}")
    for label in unpipelined:
        print(f"NOT PIPELINED {label}: streams at K3 with no cp.async in flight")
    if args.json is not None:   # (whole or not at all: a temporary file, renamed)
        from kimi_perf.trace import atomic_write_text

        atomic_write_text(args.json, json.dumps({"target": "sm_90a", "triton":
                                                  triton.__version__,
                                                  "sources": sources_digest(),
                                                  "kernels": rows}, indent=1) + "\n")
    warned = sum(bool(r["ptxas_warnings"]) for r in rows)
    print(f"{len(rows)} compiled, {len(failed)} failed, {len(spills)} spilling, "
          f"{len(unpipelined)} not pipelined, {warned} with a ptxas performance warning "
          f"({len(slow)} not known)")
    return 1 if failed or spills or unpipelined or slow else 0


if __name__ == "__main__":
    sys.exit(main())
