"""S8, grouped by expert: the routed experts' down-projection, each picked expert's W2
streamed once for all the tokens that picked it, its weighted share added into each token's
row.

The companion of ``moe_grouped_fc1`` (whose docstring explains the grid: a program per (expert,
column block), an expert's slots taken BLOCK_T at a time); it reads each expert's slots from
the lists FC1 wrote (``ExpertSlots``) rather than scanning the step's expert ids again. Per
K step a program loads the expert's W2 tile [BLOCK_N, BLOCK_K] once and takes each of the
chunk's slots' products with it in fp32; then each slot's routing weight times its product
is added into its token's row of ``out`` with an fp32 atomic add, since a token's top_k
shares come from as many programs (no two from one program: a token picks an expert once).
``out`` must hold zeros first: ``router_topk(..., zero=out)`` writes them in the routing
launch. The order of a row's additions follows the programs' order on the GPU, so the sum's
last bits vary from run to run (the per-slot ``moe_fc2_combine`` sums a token's slots in
registers, in slot order: bit for bit the same every run).

The weights may be MXFP4, decoded as they stream (``kimi_perf_kernels.mxfp4``). The shared
experts' down-projection rides in the same grid, as in ``moe_fc2_combine``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels import moe_experts
from kimi_perf_kernels.common import (
    INTERPRETED,
    after_previous_kernel,
    interpreter_tiles,
    launch_options,
)
from kimi_perf_kernels.moe_grouped_fc1 import BLOCK_T, ExpertSlots
from kimi_perf_kernels.mxfp4 import Mxfp4, dequantize, mxfp4_pairs
from kimi_perf_kernels.skinny_linear import STAGES, linear_tile

# Columns a program takes on a GPU: a [128, BLOCK_K] tile of W2 a K step (128 registers on
# sm_90a, STAGES tiles in flight), so that K3's grid is 896 experts × 28 programs, not × 112
# (of which the experts no token picked, a third at batch 64, exit at once) and a program
# streams 96 KB, not 24 KB.
BLOCK_N = 128
# MXFP4's K step: its tiles decoded as even and odd halves in fp32, a [128, 128] step spills
# on sm_90a; [128, 64] (32 bytes of codes a row) does not
MXFP4_BLOCK_K = 64


@triton.jit
def _grouped_fc2_tile(expert, block, act_ptr, w2_ptr, w2s_ptr, lists_ptr, counts_ptr,
                      weights_ptr, out_ptr, M, INTER, N, stride_we, stride_wn, stride_se,
                      stride_sn, stride_out, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w = w2_ptr + expert.to(tl.int64) * stride_we
    ws = w2s_ptr + expert.to(tl.int64) * stride_se
    HALF: tl.constexpr = BLOCK_K // 2
    j = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    count = tl.load(counts_ptr + expert)
    for r0 in range(0, count, BLOCK_T):        # no iteration where no slot picked the expert
        t_ok = r0 + r < count
        slot = tl.load(lists_ptr + expert.to(tl.int64) * M + r0 + r, mask=t_ok, other=0)
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k0 in tl.range(0, INTER, BLOCK_K, num_stages=STAGES):   # tiles in flight
            if MXFP4:   # even and odd columns, against each slot's even and odd activations
                w_even, w_odd = mxfp4_pairs(w, ws, n, n_ok, k0, INTER, stride_wn, stride_sn,
                                            HALF)
                kk = k0 + 2 * j
                k_ok = kk < INTER
            else:
                kk = k0 + ks
                k_ok = kk < INTER
                wt = tl.load(w + n[:, None] * stride_wn + kk[None, :],
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            for t in tl.static_range(BLOCK_T):   # the tile once, for each slot of the chunk
                slot_t = tl.sum(tl.where(r == t, slot, 0), axis=0).to(tl.int64)
                ok = tl.sum(tl.where(r == t, t_ok.to(tl.int32), 0), axis=0) > 0
                a = tl.load(act_ptr + slot_t * INTER + kk, mask=k_ok & ok,
                            other=0.0).to(tl.float32)
                if MXFP4:
                    a_odd = tl.load(act_ptr + slot_t * INTER + kk + 1, mask=k_ok & ok,
                                    other=0.0).to(tl.float32)
                    dot = tl.sum(w_even * a[None, :] + w_odd * a_odd[None, :], axis=1)
                else:
                    dot = tl.sum(wt * a[None, :], axis=1)
                acc += tl.where(r[:, None] == t, dot[None, :], 0.0)
        weight = tl.load(weights_ptr + slot, mask=t_ok, other=0.0)
        token = (slot // TOP_K).to(tl.int64)
        # relaxed: the only order needed is the launch's, after the routing's zeros
        tl.atomic_add(out_ptr + token[:, None] * stride_out + n[None, :],
                      acc * weight[:, None], mask=t_ok[:, None] & n_ok[None, :], sem="relaxed")


@triton.jit
def moe_grouped_fc2_kernel(act_ptr, w2_ptr, w2s_ptr, lists_ptr, counts_ptr, weights_ptr,
                           out_ptr, M, INTER, N, stride_we, stride_wn, stride_se, stride_sn,
                           stride_out, sx_ptr, sw_ptr, sout_ptr, S_N, S_K, stride_sx,
                           stride_sw, stride_sout, SHARED_PROGRAMS, TOP_K: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, RNE: tl.constexpr, MXFP4: tl.constexpr,
                           SHARED: tl.constexpr, S_USE_DOT: tl.constexpr,
                           DOT_FP32: tl.constexpr, S_BLOCK_M: tl.constexpr,
                           S_BLOCK_N: tl.constexpr, S_BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    pid = tl.program_id(0) - SHARED_PROGRAMS   # the shared experts' tiles first
    blocks = tl.cdiv(N, BLOCK_N)
    if pid >= 0:
        _grouped_fc2_tile(pid // blocks, pid % blocks, act_ptr, w2_ptr, w2s_ptr, lists_ptr,
                          counts_ptr, weights_ptr, out_ptr, M, INTER, N, stride_we, stride_wn,
                          stride_se, stride_sn, stride_out, TOP_K, BLOCK_T, BLOCK_N, BLOCK_K,
                          MXFP4)
    elif SHARED:  # the shared experts' down-projection
        linear_tile(tl.program_id(0), sx_ptr, sw_ptr, sx_ptr, sout_ptr, sout_ptr, M, S_N, S_K,
                    stride_sx, stride_sw, 0, stride_sout, 0.0, False, False, False, S_USE_DOT,
                    DOT_FP32, RNE, 1.0, 1.0, S_BLOCK_M, S_BLOCK_N, S_BLOCK_K)


def moe_grouped_fc2(act: torch.Tensor, w2: moe_experts.Experts, slots: ExpertSlots,
                    weights: torch.Tensor, out: torch.Tensor,
                    shared: moe_experts.Shared | None = None
                    ) -> torch.Tensor:
    """act [M, top_k, I] and each expert's slots (``moe_grouped_fc1_situ``), w2 [E, N, I]
    (or MXFP4), weights [M, top_k] (``router_topk``) -> out [M, N] fp32 += Σ_slot weight ·
    W2[e] act (``out`` zeroed first: ``router_topk``'s ``zero``); ``shared`` as in
    ``moe_fc2_combine``."""
    M, top_k, inter = act.shape
    n_experts, n, _ = w2.shape
    mxfp4 = isinstance(w2, Mxfp4)
    lists, counts = slots
    if lists.shape != (n_experts, M) or counts.shape != (n_experts,) \
            or lists.dtype != torch.int32 or counts.dtype != torch.int32 \
            or not lists.is_contiguous() or not counts.is_contiguous() \
            or weights.shape != (M, top_k) or not weights.is_contiguous():
        raise ValueError(f"moe_grouped_fc2: the slots of {n_experts} experts ([E, {M}] and "
                         f"[E] int32) and contiguous weights [{M}, {top_k}]")
    if not act.is_contiguous() or w2.shape[2] != inter or (not mxfp4 and w2.stride(2) != 1):
        raise ValueError(f"moe_grouped_fc2: act {tuple(act.shape)} (contiguous) does not fit "
                         f"the experts {tuple(w2.shape)}")
    if out.dtype != torch.float32 or out.shape != (M, n) or out.stride(1) != 1:
        raise ValueError(f"moe_grouped_fc2: out must be fp32 [{M}, {n}], rows contiguous")
    block_n, block_k = moe_experts.routed_blocks(mxfp4)
    if not interpreter_tiles():
        block_n, block_k = BLOCK_N, MXFP4_BLOCK_K if mxfp4 else block_k
    shared_args, shared_consts = moe_experts.shared_launch(shared, M, situ=False)
    grid = (n_experts * triton.cdiv(n, block_n) + shared_args[-1],)
    codes, scales = moe_experts.expert_args(w2, "moe_grouped_fc2")
    moe_grouped_fc2_kernel[grid](
        act, codes, scales, lists, counts, weights, out, M, inter, n,
        *moe_experts.expert_strides(w2), out.stride(0), *shared_args, TOP_K=top_k,
        BLOCK_T=BLOCK_T, BLOCK_N=block_n, BLOCK_K=block_k, RNE=INTERPRETED, MXFP4=mxfp4,
        **shared_consts, num_warps=8, **launch_options())
    return out


def moe_grouped_fc2_reference(act: torch.Tensor, w2: moe_experts.Experts, slots: ExpertSlots,
                              weights: torch.Tensor) -> torch.Tensor:
    """``moe_grouped_fc2``'s math as it groups it, in fp32: for each expert, each slot that
    picked it adds its weight times W2[e] act[slot] into its token's row (``slot // top_k``).
    Summing by expert, it is the per-slot combine (``moe_experts_reference``) by another
    route: the two agree to rounding."""
    M, top_k, inter = act.shape
    w2 = dequantize(w2) if isinstance(w2, Mxfp4) else w2
    flat_act, flat_weights = act.reshape(M * top_k, inter).float(), weights.reshape(-1).float()
    out = torch.zeros(M, w2.shape[1])
    for e, count in enumerate(slots.counts.tolist()):
        picked = slots.lists[e, :count].long()
        out.index_add_(0, picked // top_k,
                       flat_weights[picked, None] * (flat_act[picked] @ w2[e].float().T))
    return out
