"""S7, grouped by expert: the routed experts' gate/up + SiTU, each picked expert's weights
streamed once for all the tokens that picked it.

``moe_route_fc1_situ`` streams an expert's W13 once per (token, slot) that picks it: right
at batch 1, where every slot is another expert, but at batch 64 × top-16 the 1,024 slots pick
about 613 distinct experts of 896 (K3), and 40% of what it streams it has streamed before.
Here the routing comes first (``router_topk``, its own launch: a token's top-k needs its whole
row of router logits), and then one program per (expert, intermediate block):

- it scans the step's M × top_k expert ids (int32, from L2: 1,024 at batch 64, 8,192 in a
  verify step of 64 × 8 tokens; SCAN = 256 at a time) for its expert, and leaves after that
  scan if no slot picked it (most programs at small batches: the grid is E wide, so that it
  never depends on the routing and a CUDA graph keeps it);
- the slots that did, in order, are taken BLOCK_T at a time: slot r of a chunk is the one
  whose running count of hits is r ([BLOCK_T, SCAN] comparisons in registers). An expert
  picked by more than BLOCK_T tokens scans the ids again and streams its weights again per
  chunk (about 1.7 tokens an expert at batch 64 × top-16 of 896: rare);
- per K step it loads the expert's gate and up tiles [BLOCK_N, BLOCK_K] once and takes each of
  the chunk's tokens' products with them in fp32, one token at a time: exact fp32 like the
  per-slot kernel, with a GEMV's registers (no tensor cores, which a memory-bound step of one
  or two tokens per expert would not keep busy).

The weights may be MXFP4, as in ``moe_route_fc1_situ`` (decoded as they stream, the tile's
even and odd columns against each token's even and odd values). The shared experts' gate/up +
SiTU ride in the same grid, as in ``moe_route_fc1_situ`` (their tiles first). The K loop
keeps STAGES weight tiles in flight (``tl.range``: Triton pipelines a loop with no dot in it
only when asked). On sm_90a it takes 100-106 registers a thread at 8 warps on bf16 experts,
200 on MXFP4 ones (``kimi_perf_kernels.aot``), where the per-slot kernel takes 64 and 126.
The first column block's program of each expert also writes the expert's slots and their
count (``ExpertSlots``), so that FC2 (``moe_grouped_fc2``: E × 28 programs at K3 TP8 shapes)
reads its expert's slots instead of scanning the ids again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, after_previous_kernel, cast, launch_options
from kimi_perf_kernels.moe_experts import (
    Experts,
    Shared,
    expert_args,
    expert_strides,
    routed_blocks,
    shared_launch,
)
from kimi_perf_kernels.mxfp4 import Mxfp4, mxfp4_pairs
from kimi_perf_kernels.skinny_linear import STAGES, linear_tile, situ_activation

BLOCK_T = 4   # the slots of one expert taken at a time
SCAN = 256    # expert ids scanned at a time


class ExpertSlots(NamedTuple):
    """Which slots (flat indices into the step's [M, top_k] expert ids) picked each expert,
    in order: ``lists`` [E, M] int32 (row e's first ``counts[e]`` entries), ``counts`` [E]."""

    lists: torch.Tensor
    counts: torch.Tensor


@triton.jit
def _expert_slots(expert, r0, ids_ptr, SLOTS, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr):
    """The slots of ranks r0 .. r0 + BLOCK_T - 1 among those that picked ``expert`` (0 past
    the last), and how many picked it: the ids scanned BLOCK_S at a time, a hit's rank its
    running count."""
    r = r0 + tl.arange(0, BLOCK_T)
    s = tl.arange(0, BLOCK_S)
    slot = tl.zeros([BLOCK_T], tl.int32)
    seen = 0
    for s0 in range(0, SLOTS, BLOCK_S):
        hit = (tl.load(ids_ptr + s0 + s, mask=s0 + s < SLOTS, other=-1) == expert).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - 1
        picked = (hit[None, :] > 0) & (rank[None, :] == r[:, None])
        slot += tl.sum(tl.where(picked, s0 + s[None, :], 0), axis=1)
        seen += tl.sum(hit, axis=0)
    return slot, seen


@triton.jit
def _grouped_fc1_tile(expert, block, x_ptr, w13_ptr, w13s_ptr, ids_ptr, act_ptr, lists_ptr,
                      counts_ptr, M, SLOTS, INTER, KDIM, stride_x, stride_we, stride_wn,
                      stride_se, stride_sn, TOP_K: tl.constexpr, BETA: tl.constexpr,
                      BETA_LINEAR: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE: tl.constexpr,
                      MXFP4: tl.constexpr):
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    w = w13_ptr + expert.to(tl.int64) * stride_we
    ws = w13s_ptr + expert.to(tl.int64) * stride_se
    HALF: tl.constexpr = BLOCK_K // 2
    j = tl.arange(0, HALF)
    r = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    r0 = 0
    slot, count = _expert_slots(expert, r0, ids_ptr, SLOTS, BLOCK_S, BLOCK_T)
    if block == 0:   # the expert's slots, for FC2 (a token picks an expert once: M at most)
        tl.store(counts_ptr + expert, count)
    while r0 < count:                          # never, where no slot picked the expert
        t_ok = r0 + r < count
        if block == 0:
            tl.store(lists_ptr + expert.to(tl.int64) * M + r0 + r, slot, mask=t_ok)
        token = (slot // TOP_K).to(tl.int64)
        gate = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k0 in tl.range(0, KDIM, BLOCK_K, num_stages=STAGES):   # tiles in flight
            if MXFP4:   # even and odd columns, against each token's even and odd values
                g_even, g_odd = mxfp4_pairs(w, ws, n, n_ok, k0, KDIM, stride_wn, stride_sn,
                                            HALF)
                u_even, u_odd = mxfp4_pairs(w, ws, n + INTER, n_ok, k0, KDIM, stride_wn,
                                            stride_sn, HALF)
                kk = k0 + 2 * j
                k_ok = kk < KDIM
            else:
                kk = k0 + ks
                k_ok = kk < KDIM
                m = n_ok[:, None] & k_ok[None, :]
                wg = tl.load(w + n[:, None] * stride_wn + kk[None, :], mask=m, other=0.0)
                wu = tl.load(w + (n[:, None] + INTER) * stride_wn + kk[None, :], mask=m,
                             other=0.0)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            # the tiles once, for each of the chunk's tokens: a GEMV's registers per token,
            # not a [BLOCK_T, BLOCK_N, BLOCK_K] product's
            for t in tl.static_range(BLOCK_T):
                row = tl.sum(tl.where(r == t, token, 0), axis=0)
                ok = tl.sum(tl.where(r == t, t_ok.to(tl.int32), 0), axis=0) > 0
                x = tl.load(x_ptr + row * stride_x + kk, mask=k_ok & ok, other=0.0)
                x = x.to(tl.float32)
                if MXFP4:
                    x_odd = tl.load(x_ptr + row * stride_x + kk + 1, mask=k_ok & ok,
                                    other=0.0).to(tl.float32)
                    g = tl.sum(g_even * x[None, :] + g_odd * x_odd[None, :], axis=1)
                    u = tl.sum(u_even * x[None, :] + u_odd * x_odd[None, :], axis=1)
                else:
                    g = tl.sum(wg * x[None, :], axis=1)
                    u = tl.sum(wu * x[None, :], axis=1)
                gate += tl.where(r[:, None] == t, g[None, :], 0.0)
                up += tl.where(r[:, None] == t, u[None, :], 0.0)
        act = situ_activation(gate, up, BETA, BETA_LINEAR)
        tl.store(act_ptr + slot.to(tl.int64)[:, None] * INTER + n[None, :],
                 cast(act, act_ptr.dtype.element_ty, RNE), mask=t_ok[:, None] & n_ok[None, :])
        r0 += BLOCK_T
        if r0 < count:   # the next chunk's slots (after the last, no scan more)
            slot, count = _expert_slots(expert, r0, ids_ptr, SLOTS, BLOCK_S, BLOCK_T)


@triton.jit
def moe_grouped_fc1_situ_kernel(x_ptr, w13_ptr, w13s_ptr, ids_ptr, act_ptr, lists_ptr,
                                counts_ptr, M, SLOTS, INTER, KDIM, stride_x, stride_we,
                                stride_wn, stride_se, stride_sn, sx_ptr, sw_ptr, sout_ptr, S_N,
                                S_K, stride_sx, stride_sw, stride_sout, SHARED_PROGRAMS,
                                TOP_K: tl.constexpr, BETA: tl.constexpr,
                                BETA_LINEAR: tl.constexpr, BLOCK_S: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, RNE: tl.constexpr, MXFP4: tl.constexpr,
                                SHARED: tl.constexpr, S_USE_DOT: tl.constexpr,
                                DOT_FP32: tl.constexpr, S_BLOCK_M: tl.constexpr,
                                S_BLOCK_N: tl.constexpr, S_BLOCK_K: tl.constexpr,
                                PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    pid = tl.program_id(0) - SHARED_PROGRAMS   # the shared experts' tiles first
    blocks = tl.cdiv(INTER, BLOCK_N)
    if pid >= 0:
        _grouped_fc1_tile(pid // blocks, pid % blocks, x_ptr, w13_ptr, w13s_ptr, ids_ptr,
                          act_ptr, lists_ptr, counts_ptr, M, SLOTS, INTER, KDIM, stride_x,
                          stride_we, stride_wn, stride_se, stride_sn, TOP_K, BETA, BETA_LINEAR,
                          BLOCK_S, BLOCK_T, BLOCK_N, BLOCK_K, RNE, MXFP4)
    elif SHARED:
        linear_tile(tl.program_id(0), sx_ptr, sw_ptr, sx_ptr, sout_ptr, sout_ptr, M, S_N, S_K,
                    stride_sx, stride_sw, 0, stride_sout, 0.0, False, True, False, S_USE_DOT,
                    DOT_FP32, RNE, BETA, BETA_LINEAR, S_BLOCK_M, S_BLOCK_N, S_BLOCK_K)


def moe_grouped_fc1_situ(x: torch.Tensor, w13: Experts, ids: torch.Tensor,
                         situ: tuple[float, float], out: torch.Tensor | None = None,
                         shared: Shared | None = None
                         ) -> tuple[torch.Tensor, ExpertSlots]:
    """x [M, K] (latent), w13 [E, 2I, K] (or MXFP4), ids [M, top_k] int32 (``router_topk``:
    k distinct experts in [0, E) a token, unchecked, as ``moe_experts`` says; an expert twice
    would count a token twice, past its list's M slots)
    -> (act [M, top_k, I] in w13's dtype, as ``moe_route_fc1_situ`` makes it, and each
    expert's slots for ``moe_grouped_fc2``); ``shared`` as there."""
    M, top_k = ids.shape
    n_experts, two_i, kdim = w13.shape
    inter = two_i // 2
    mxfp4 = isinstance(w13, Mxfp4)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError("moe_grouped_fc1_situ: the expert ids must be contiguous int32")
    if two_i % 2:
        raise ValueError(f"moe_grouped_fc1_situ: w13's {two_i} rows do not split into gate "
                         "and up halves")
    if x.shape != (M, kdim) or x.stride(1) != 1 or (not mxfp4 and w13.stride(2) != 1):
        raise ValueError(f"moe_grouped_fc1_situ: latent {tuple(x.shape)} and experts "
                         f"{tuple(w13.shape)} do not fit {M} tokens (rows contiguous)")
    if out is None:
        out = torch.empty(M, top_k, inter, dtype=w13.dtype, device=x.device)
    if out.shape != (M, top_k, inter) or not out.is_contiguous():
        raise ValueError(f"moe_grouped_fc1_situ: out must be a contiguous {(M, top_k, inter)}")
    slots = ExpertSlots(torch.empty(n_experts, M, dtype=torch.int32, device=x.device),
                        torch.empty(n_experts, dtype=torch.int32, device=x.device))
    block_n, block_k = routed_blocks(mxfp4)
    shared_args, shared_consts = shared_launch(shared, M, situ=True)
    grid = (n_experts * triton.cdiv(inter, block_n) + shared_args[-1],)
    codes, scales = expert_args(w13, "moe_grouped_fc1_situ")
    moe_grouped_fc1_situ_kernel[grid](
        x, codes, scales, ids, out, slots.lists, slots.counts, M, M * top_k, inter, kdim,
        x.stride(0), *expert_strides(w13),
        *shared_args, TOP_K=top_k, BETA=situ[0], BETA_LINEAR=situ[1],
        BLOCK_S=min(triton.next_power_of_2(M * top_k), SCAN), BLOCK_T=BLOCK_T, BLOCK_N=block_n,
        BLOCK_K=block_k, RNE=INTERPRETED, MXFP4=mxfp4, **shared_consts, num_warps=8,
        **launch_options())
    return out, slots


def expert_slots_reference(ids: torch.Tensor, n_experts: int) -> ExpertSlots:
    """Each expert's slots (flat indices into ids [M, top_k]) in order, and their count; the
    rows' entries past the count are not defined (here 0)."""
    M = ids.shape[0]
    flat = ids.flatten().long()
    lists = torch.zeros(n_experts, M, dtype=torch.int32)
    counts = torch.bincount(flat, minlength=n_experts).to(torch.int32)
    for e in range(n_experts):
        picked = torch.nonzero(flat == e).flatten()
        lists[e, : len(picked)] = picked.to(torch.int32)
    return ExpertSlots(lists, counts)
