"""S6 + S7 + S8: routing and the routed experts of the latent MoE, for decode-sized batches,
with the shared experts computed in the same two launches.

- ``moe_route_fc1_situ``: for every (token, slot), routes first (the slot's expert e and
  weight from the token's router logits: ``router_topk.routed_slot``), then act =
  SiTU(W1[e] · x, W3[e] · x); W13 stacks W1 over W3 per expert. One program per (slot,
  intermediate block) reads the matching gate and up rows of one expert once. Every program
  ranks the token's E scores itself (a top-k of E values in registers, next to
  2 · BLOCK_N · K weights streamed): cheaper than a launch of its own. The first block of each
  slot writes the slot's expert and weight for the next kernel.
- ``moe_fc2_combine``: latent[m] = Σ_slot weight · W2[e] · act[m, slot]; one program per
  (token, latent block) loops over the token's k slots, so the weighted sum never leaves
  registers (no per-slot output, no separate finalize kernel).

Both stream expert weights once per (token, slot): right for decode where batch × top-k is
small next to the expert count. The weights may be MXFP4 (as K3's checkpoint stores them):
0.53 bytes a weight, decoded in registers (``kimi_perf_kernels.mxfp4``). The grouped variant,
which reads each picked expert once for all its tokens (``moe_grouped_fc1``, ``moe_grouped_fc2``),
is opt-in for larger batches until a GPU run shows where it pays.

Shared experts ride along (``shared=(input, weight, output)``): the grid grows by the column
tiles of a skinny linear (``skinny_linear.linear_tile``), the shared gate/up + SiTU over h
beside FC1 and the shared down-projection beside FC2. Their tiles take the grid's first
program ids, so they start in the first wave and run beside the routed ones, as a second
stream would run them, without the stream's fork and join and without two launches of their
own.

Expert ids (``ids``, or what ``moe_route_fc1_situ`` writes) are a token's top-k: k distinct
experts in [0, E), as ``router_topk`` gives them. They are not checked (a check would read
them back from the device, which a CUDA graph forbids): an id past E reads another tensor's
memory (`kimi-perf validate` fails a path whose top-k is not one, ``routing_invalid``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import (
    INTERPRETED,
    after_previous_kernel,
    cast,
    check_layout,
    interpreter_tiles,
    launch_options,
)
from kimi_perf_kernels.mxfp4 import Mxfp4, dequantize, mxfp4_pairs
from kimi_perf_kernels.router_topk import block_e, routed_slot
from kimi_perf_kernels.skinny_linear import (
    GEMV_MAX_M,
    STAGES,
    launch_config,
    linear_tile,
    situ_activation,
    tiles,
)

# (input [M, K], weight [N, K] (gate rows over up rows for FC1), output [M, N or N/2])
Shared = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Routed experts' weights: [E, N, K] in the model's dtype, or MXFP4 codes and scales
# (``kimi_perf_kernels.mxfp4``), decoded in registers as they stream.
Experts = torch.Tensor | Mxfp4


@triton.jit
def _routed_fc1_tile(slot, block, x_ptr, w13_ptr, w13s_ptr, logits_ptr, bias_ptr, ids_ptr,
                     weights_ptr, act_ptr, INTER, KDIM, E, stride_x, stride_l, stride_we,
                     stride_wn, stride_se, stride_sn, scale, TOP_K: tl.constexpr,
                     BLOCK_E: tl.constexpr, BETA: tl.constexpr, BETA_LINEAR: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE: tl.constexpr,
                     ROUTE: tl.constexpr, MXFP4: tl.constexpr):
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    token = slot // TOP_K
    if ROUTE:
        expert, weight = routed_slot(logits_ptr + token * stride_l, bias_ptr, E, slot % TOP_K,
                                     scale, TOP_K, BLOCK_E)
        if block == 0:
            tl.store(ids_ptr + slot, expert)
            tl.store(weights_ptr + slot, weight)
    else:  # routed by an earlier launch
        expert = tl.load(ids_ptr + slot)
    w = w13_ptr + expert.to(tl.int64) * stride_we
    if MXFP4:  # codes and scales: even and odd columns against x's even and odd values
        ws = w13s_ptr + expert.to(tl.int64) * stride_se
        HALF: tl.constexpr = BLOCK_K // 2
        gate2 = tl.zeros([BLOCK_N, HALF], tl.float32)
        up2 = tl.zeros([BLOCK_N, HALF], tl.float32)
        for k0 in tl.range(0, KDIM, BLOCK_K, num_stages=STAGES):
            kk = k0 + 2 * tl.arange(0, HALF)
            x_even = tl.load(x_ptr + token * stride_x + kk, mask=kk < KDIM,
                             other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + token * stride_x + kk + 1, mask=kk < KDIM,
                            other=0.0).to(tl.float32)
            g_even, g_odd = mxfp4_pairs(w, ws, n, n_ok, k0, KDIM, stride_wn, stride_sn, HALF)
            u_even, u_odd = mxfp4_pairs(w, ws, n + INTER, n_ok, k0, KDIM, stride_wn,
                                        stride_sn, HALF)
            gate2 += g_even * x_even[None, :] + g_odd * x_odd[None, :]
            up2 += u_even * x_even[None, :] + u_odd * x_odd[None, :]
    else:
        ks = tl.arange(0, BLOCK_K)
        # as the skinny GEMV: STAGES weight tiles in flight, products summed elementwise and
        # reduced over K once, after the loop
        gate2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        up2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, KDIM, BLOCK_K, num_stages=STAGES):
            kk = k0 + ks
            k_ok = kk < KDIM
            x = tl.load(x_ptr + token * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
            m = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w + n[:, None] * stride_wn + kk[None, :], mask=m, other=0.0)
            wu = tl.load(w + (n[:, None] + INTER) * stride_wn + kk[None, :], mask=m, other=0.0)
            gate2 += wg.to(tl.float32) * x[None, :]
            up2 += wu.to(tl.float32) * x[None, :]
    gate = tl.sum(gate2, axis=1)
    up = tl.sum(up2, axis=1)
    act = situ_activation(gate, up, BETA, BETA_LINEAR)
    tl.store(act_ptr + slot * INTER + n, cast(act, act_ptr.dtype.element_ty, RNE), mask=n_ok)


@triton.jit
def moe_route_fc1_situ_kernel(x_ptr, w13_ptr, w13s_ptr, logits_ptr, bias_ptr, ids_ptr,
                              weights_ptr, act_ptr, M, INTER, KDIM, E, stride_x, stride_l,
                              stride_we, stride_wn, stride_se, stride_sn, scale, sx_ptr, sw_ptr,
                              sout_ptr, S_N, S_K, stride_sx, stride_sw, stride_sout,
                              SHARED_PROGRAMS, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                              BETA: tl.constexpr, BETA_LINEAR: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE: tl.constexpr,
                              ROUTE: tl.constexpr, MXFP4: tl.constexpr, SHARED: tl.constexpr,
                              S_USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                              S_BLOCK_M: tl.constexpr, S_BLOCK_N: tl.constexpr,
                              S_BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    # The shared experts' tiles take the first program ids: the block scheduler starts them
    # with the first wave of routed tiles rather than after all of them.
    after_previous_kernel(PDL)
    pid = tl.program_id(0) - SHARED_PROGRAMS
    blocks = tl.cdiv(INTER, BLOCK_N)
    if pid >= 0:
        _routed_fc1_tile(pid // blocks, pid % blocks, x_ptr, w13_ptr, w13s_ptr, logits_ptr,
                         bias_ptr, ids_ptr, weights_ptr, act_ptr, INTER, KDIM, E, stride_x,
                         stride_l, stride_we, stride_wn, stride_se, stride_sn, scale, TOP_K,
                         BLOCK_E, BETA, BETA_LINEAR, BLOCK_N, BLOCK_K, RNE, ROUTE, MXFP4)
    elif SHARED:  # the shared experts' gate/up + SiTU over h
        linear_tile(tl.program_id(0), sx_ptr, sw_ptr, sx_ptr, sout_ptr, sout_ptr, M, S_N, S_K,
                    stride_sx, stride_sw, 0, stride_sout, 0.0, False, True, False, S_USE_DOT,
                    DOT_FP32, RNE, BETA, BETA_LINEAR, S_BLOCK_M, S_BLOCK_N, S_BLOCK_K)


@triton.jit
def _routed_fc2_tile(token, block, act_ptr, w2_ptr, w2s_ptr, ids_ptr, weights_ptr, out_ptr,
                     INTER, N, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                     TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     RNE: tl.constexpr, WEIGHTED: tl.constexpr, MXFP4: tl.constexpr):
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # the (slot, K step) loops as one pipelined loop: the next slot's expert tile loads while
    # this one is used; the slot's routing weight scales its activations, products are summed
    # elementwise and reduced once
    k_steps = tl.cdiv(INTER, BLOCK_K)
    if MXFP4:  # codes and scales: even and odd columns against the even and odd activations
        HALF: tl.constexpr = BLOCK_K // 2
        acc2 = tl.zeros([BLOCK_N, HALF], tl.float32)
        for it in tl.range(0, TOP_K * k_steps, num_stages=STAGES):
            slot = token * TOP_K + it // k_steps
            k0 = (it % k_steps) * BLOCK_K
            kk = k0 + 2 * tl.arange(0, HALF)
            expert = tl.load(ids_ptr + slot).to(tl.int64)
            a_even = tl.load(act_ptr + slot * INTER + kk, mask=kk < INTER,
                             other=0.0).to(tl.float32)
            a_odd = tl.load(act_ptr + slot * INTER + kk + 1, mask=kk < INTER,
                            other=0.0).to(tl.float32)
            if WEIGHTED:
                weight = tl.load(weights_ptr + slot)
                a_even = a_even * weight
                a_odd = a_odd * weight
            w_even, w_odd = mxfp4_pairs(w2_ptr + expert * stride_we,
                                        w2s_ptr + expert * stride_se, n, n_ok, k0, INTER,
                                        stride_wn, stride_sn, HALF)
            acc2 += w_even * a_even[None, :] + w_odd * a_odd[None, :]
    else:
        ks = tl.arange(0, BLOCK_K)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for it in tl.range(0, TOP_K * k_steps, num_stages=STAGES):
            slot = token * TOP_K + it // k_steps
            kk = (it % k_steps) * BLOCK_K + ks
            k_ok = kk < INTER
            expert = tl.load(ids_ptr + slot).to(tl.int64)
            a = tl.load(act_ptr + slot * INTER + kk, mask=k_ok, other=0.0).to(tl.float32)
            if WEIGHTED:
                a = a * tl.load(weights_ptr + slot)
            wt = tl.load(w2_ptr + expert * stride_we + n[:, None] * stride_wn + kk[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += wt.to(tl.float32) * a[None, :]
    acc = tl.sum(acc2, axis=1)
    tl.store(out_ptr + token * stride_out + n, cast(acc, out_ptr.dtype.element_ty, RNE),
             mask=n_ok)


@triton.jit
def moe_fc2_combine_kernel(act_ptr, w2_ptr, w2s_ptr, ids_ptr, weights_ptr, out_ptr, M, INTER,
                           N, stride_we, stride_wn, stride_se, stride_sn, stride_out, sx_ptr,
                           sw_ptr, sout_ptr, S_N, S_K, stride_sx, stride_sw, stride_sout,
                           SHARED_PROGRAMS, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, RNE: tl.constexpr, WEIGHTED: tl.constexpr,
                           MXFP4: tl.constexpr, SHARED: tl.constexpr, S_USE_DOT: tl.constexpr,
                           DOT_FP32: tl.constexpr, S_BLOCK_M: tl.constexpr,
                           S_BLOCK_N: tl.constexpr, S_BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    pid = tl.program_id(0) - SHARED_PROGRAMS   # shared tiles first, as in FC1
    blocks = tl.cdiv(N, BLOCK_N)
    if pid >= 0:
        _routed_fc2_tile(pid // blocks, pid % blocks, act_ptr, w2_ptr, w2s_ptr, ids_ptr,
                         weights_ptr, out_ptr, INTER, N, stride_we, stride_wn, stride_se,
                         stride_sn, stride_out, TOP_K, BLOCK_N, BLOCK_K, RNE, WEIGHTED, MXFP4)
    elif SHARED:  # the shared experts' down-projection
        linear_tile(tl.program_id(0), sx_ptr, sw_ptr, sx_ptr, sout_ptr, sout_ptr, M, S_N, S_K,
                    stride_sx, stride_sw, 0, stride_sout, 0.0, False, False, False, S_USE_DOT,
                    DOT_FP32, RNE, 1.0, 1.0, S_BLOCK_M, S_BLOCK_N, S_BLOCK_K)


def routed_blocks(mxfp4: bool = False) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the routed tiles: MXFP4's twice as deep, so that a row of a
    tile is 64 bytes of codes (bf16's is 128). BLOCK_N 32 for the grid at batch 1 (K3 TP8):
    FC1's 16 slots × 384 / 32 = 192 programs for H200's 132 SMs, where 64 would leave SMs
    idle (96). FC2 takes the same size untuned (3584 / 32 = 112 programs beside the shared
    experts' tiles): no size from 16 to 64 spills on sm_90a, so only a GPU sweep can settle
    it."""
    if interpreter_tiles():
        return 256, 256
    return (32, 128) if mxfp4 else (32, 64)


def shared_tile(m: int, situ: bool, interpreted: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the shared experts' tiles: the skinny linear's (the
    GEMV with SiTU at half the K step), but the GEMM's BLOCK_N 64 × BLOCK_K 32 (the fused
    kernel's shared memory is the largest of its branches', and its routed tiles need
    little)."""
    block_m, block_n, block_k, _ = launch_config(m, interpreted, situ)
    if m > GEMV_MAX_M and not interpreted:
        block_n, block_k = 64, 32
    return block_m, block_n, block_k


def shared_launch(shared: Shared | None, m: int, situ: bool) -> tuple[list, dict]:
    """The shared experts' kernel arguments (their program count last) and constexprs."""
    if shared is None:  # fixed constexprs: no recompile per batch size
        return [None, None, None, 0, 0, 0, 0, 0, 0], {
            "SHARED": False, "S_USE_DOT": False, "DOT_FP32": INTERPRETED, "S_BLOCK_M": 1,
            "S_BLOCK_N": 1, "S_BLOCK_K": 1}
    block_m, block_n, block_k = shared_tile(m, situ, interpreter_tiles())
    consts = {"SHARED": True, "S_USE_DOT": m > GEMV_MAX_M, "DOT_FP32": INTERPRETED,
              "S_BLOCK_M": block_m, "S_BLOCK_N": block_n, "S_BLOCK_K": block_k}
    x, w, out = shared
    n_out = w.shape[0] // 2 if situ else w.shape[0]
    if x.shape[0] != m or out.shape != (m, n_out) or w.shape[1] != x.shape[1]:
        raise ValueError(f"shared experts: input {tuple(x.shape)}, weight {tuple(w.shape)} "
                         f"and output {tuple(out.shape)} do not fit {m} tokens")
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("shared experts: rows must be contiguous")
    programs = tiles(m, n_out, block_m, block_n)
    args = [x, w, out, n_out, x.shape[1], x.stride(0), w.stride(0), out.stride(0), programs]
    return args, consts


def moe_route_fc1_situ(x: torch.Tensor, w13: Experts, logits: torch.Tensor,
                       bias: torch.Tensor, top_k: int, scale: float, situ: tuple[float, float],
                       out: torch.Tensor | None = None, shared: Shared | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (latent), w13 [E, 2I, K], router logits [M, E] (fp32, any row stride), bias
    [E] -> (act [M, top_k, I], expert ids [M, top_k] int32, weights [M, top_k] fp32).

    ``shared=(h [M, H], W [2S, H] gate over up, out [M, S])``: also out = SiTU(h · W_gateᵀ,
    h · W_upᵀ), in the same launch."""
    M, n_experts = logits.shape
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k {top_k} must be between 1 and the {n_experts} experts")
    ids = torch.empty(M, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    act = _fc1(x, w13, ids, top_k, situ, out, shared, logits, bias, weights, scale)
    return act, ids, weights


def moe_fc1_situ(x: torch.Tensor, w13: Experts, ids: torch.Tensor,
                 situ: tuple[float, float], out: torch.Tensor | None = None) -> torch.Tensor:
    """The standard path's FC1 + SiTU, routed by an earlier launch (``router_topk``): x [M, K],
    w13 [E, 2I, K], ids [M, top_k] -> act [M, top_k, I]."""
    return _fc1(x, w13, ids, ids.shape[1], situ, out)


def _fc1(x, w13, ids, top_k, situ, out, shared=None, logits=None, bias=None, weights=None,
         scale=1.0) -> torch.Tensor:
    M = x.shape[0]
    n_experts, two_i, kdim = w13.shape
    inter = two_i // 2
    if two_i % 2:
        raise ValueError(f"routed experts' FC1: w13's {two_i} rows do not split into gate "
                         "and up halves")
    if out is None:
        out = torch.empty(M, top_k, inter, dtype=w13.dtype, device=x.device)
    check_layout("routed experts' FC1", {"ids": ids, "act": out, "weights": weights,
                                         "bias": bias},
                 {"x": x, "router logits": logits, "w13": _plain(w13)},
                 {"x": (M, kdim), "router logits": (M, n_experts), "bias": (n_experts,),
                  "ids": (M, top_k), "weights": (M, top_k), "act": (M, top_k, inter)},
                 {"ids": (torch.int32,), "weights": (torch.float32,)})
    route = logits is not None
    block_n, block_k = routed_blocks(isinstance(w13, Mxfp4))
    shared_args, shared_consts = shared_launch(shared, M, situ=True)
    grid = (M * top_k * triton.cdiv(inter, block_n) + shared_args[-1],)
    moe_route_fc1_situ_kernel[grid](
        x, *expert_args(w13, "FC1"), logits, bias, ids, weights, out, M, inter, kdim,
        logits.shape[1] if route else 0, x.stride(0), logits.stride(0) if route else 0,
        *expert_strides(w13), scale, *shared_args, TOP_K=top_k,
        BLOCK_E=block_e(logits.shape[1]) if route else 16, BETA=situ[0], BETA_LINEAR=situ[1],
        BLOCK_N=block_n, BLOCK_K=block_k, RNE=INTERPRETED, ROUTE=route,
        MXFP4=isinstance(w13, Mxfp4), **shared_consts, num_warps=8, **launch_options())
    return out


def _plain(w: Experts) -> torch.Tensor | None:
    """Experts' weights as a tensor whose layout ``check_layout`` checks (MXFP4's: ``check``)."""
    return None if isinstance(w, Mxfp4) else w


def expert_args(w: Experts, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' two weight pointers: MXFP4's codes and scales, or the weights twice."""
    if isinstance(w, Mxfp4):
        w.check(what)
        return w.packed, w.scale
    return w, w


def expert_strides(w: Experts) -> tuple[int, int, int, int]:
    """(expert, row) strides of the weights (of MXFP4's codes), then of MXFP4's scales."""
    if isinstance(w, Mxfp4):
        return (w.packed.stride(0), w.packed.stride(1), w.scale.stride(0), w.scale.stride(1))
    return w.stride(0), w.stride(1), 0, 0


def moe_fc2_combine(act: torch.Tensor, w2: Experts, ids: torch.Tensor,
                    weights: torch.Tensor, out: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32, shared: Shared | None = None
                    ) -> torch.Tensor:
    """act [M, top_k, I], w2 [E, N, I] -> [M, N] = Σ_slot weight · W2[e] act.

    ``shared=(act_s [M, S], W_down [H, S], out [M, H])``: also out = act_s · W_downᵀ, in the
    same launch."""
    M = act.shape[0]
    if out is None:
        out = torch.empty(M, w2.shape[1], dtype=out_dtype, device=act.device)
    _fc2(act, w2, ids, weights, out, shared)
    return out


def moe_fc2(act: torch.Tensor, w2: Experts, ids: torch.Tensor) -> torch.Tensor:
    """The standard path's FC2, every slot on its own (``moe_finalize`` sums them):
    act [M, top_k, I], w2 [E, N, I], ids [M, top_k] -> [M, top_k, N] in act's dtype."""
    M, top_k, inter = act.shape
    out = torch.empty(M, top_k, w2.shape[1], dtype=act.dtype, device=act.device)
    # each slot as a token with one unweighted slot
    _fc2(act.view(M * top_k, 1, inter), w2, ids.view(M * top_k, 1), None,
         out.view(M * top_k, -1))
    return out


@triton.jit
def moe_finalize_kernel(per_slot_ptr, weights_ptr, out_ptr, N, TOP_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    token = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(0, TOP_K):
        slot = token * TOP_K + j
        acc += tl.load(weights_ptr + slot) * tl.load(per_slot_ptr + slot * N + n, mask=ok,
                                                     other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + n, cast(acc, out_ptr.dtype.element_ty, RNE), mask=ok)


def moe_finalize(per_slot: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
                 ) -> torch.Tensor:
    """The standard path's weighted sum over the slots (vLLM's ``moe_sum``): per_slot
    [M, top_k, N], weights [M, top_k] fp32 -> [M, N] in ``dtype``, summed in fp32."""
    M, top_k, n = per_slot.shape
    check_layout("moe_finalize", {"per-slot outputs": per_slot, "weights": weights}, {},
                 {"weights": (M, top_k)}, {"weights": (torch.float32,)})
    out = torch.empty(M, n, dtype=dtype, device=per_slot.device)
    block = 4096 if interpreter_tiles() else 1024
    moe_finalize_kernel[(M, triton.cdiv(n, block))](per_slot, weights, out, n, TOP_K=top_k,
                                                    BLOCK_N=block, RNE=INTERPRETED,
                                                    num_warps=4, **launch_options())
    return out


def _fc2(act, w2, ids, weights, out, shared=None) -> None:
    M, top_k, inter = act.shape
    n = w2.shape[1]
    if w2.shape[2] != inter:
        raise ValueError(f"routed experts' FC2: w2 {tuple(w2.shape)} for act of {inter} "
                         "columns")
    check_layout("routed experts' FC2", {"act": act, "ids": ids, "weights": weights},
                 {"out": out, "w2": _plain(w2)},
                 {"ids": (M, top_k), "weights": (M, top_k), "out": (M, n)},
                 {"ids": (torch.int32,), "weights": (torch.float32,)})
    block_n, block_k = routed_blocks(isinstance(w2, Mxfp4))
    shared_args, shared_consts = shared_launch(shared, M, situ=False)
    grid = (M * triton.cdiv(n, block_n) + shared_args[-1],)
    moe_fc2_combine_kernel[grid](
        act, *expert_args(w2, "FC2"), ids, weights, out, M, inter, n, *expert_strides(w2),
        out.stride(0), *shared_args, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k,
        RNE=INTERPRETED, WEIGHTED=weights is not None, MXFP4=isinstance(w2, Mxfp4),
        **shared_consts, num_warps=8, **launch_options())


def moe_experts_reference(x: torch.Tensor, w13: Experts, w2: Experts, ids: torch.Tensor,
                          weights: torch.Tensor, situ: tuple[float, float]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [M, top_k, I] in w13's dtype, combined [M, N] fp32)."""
    beta, beta_linear = situ
    act_dtype = w13.dtype
    if isinstance(w13, Mxfp4):
        w13, w2 = dequantize(w13), dequantize(w2)
    w = w13[ids.long()].float()                                   # [M, k, 2I, K]
    gu = torch.einsum("mkni,mi->mkn", w, x.float())
    gate, up = gu.chunk(2, dim=-1)
    act = (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
        beta_linear * torch.tanh(up / beta_linear))
    act = act.to(act_dtype)
    per_slot = torch.einsum("mkni,mki->mkn", w2[ids.long()].float(), act.float())
    return act, (per_slot * weights[..., None]).sum(1)
