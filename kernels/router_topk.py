"""S6: router top-k — sigmoid scores, correction bias for the choice, top-k, renormalised
weights — as a device function that the routed experts' first kernel runs in its prologue
(``moe_experts.moe_route_fc1_situ``), so routing costs no launch of its own. The standard
path launches it on its own (``router_topk``, vLLM's grouped top-k kernel), and so does the
specialized path where it groups the experts by expert (``moe_grouped_fc1``), which needs
every token's routing first.

All E expert scores of a token fit in one block (E = 896 → 1024 lanes). Each biased score
becomes an int64 key whose high half orders like the float and whose low half breaks ties
toward the lower expert id (as an argmax would), so the rank-r key names the r-th expert, in
``torch.topk``'s descending order. Only the first K ranks are used: a bitonic top-k
(``tl.topk``: full merge stages up to K, then halving max-merges) ranks them, not a full sort
of all 1,024 lanes, which the routed experts' every program would pay before its first
weight load. The top-k weights sum over the
lanes at or above the k-th key, so every slot renormalises without seeing the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from kimi_perf_kernels.common import after_previous_kernel, check_layout, launch_options


@constexpr_function
def _ranks(k, lanes):
    """Ranks ``tl.topk`` keeps for a top-``k``: a power of two, at least 2 (a top-1 reduces
    to a scalar it cannot shape), at most the lanes."""
    return min(lanes, max(2, triton.next_power_of_2(k)))


@triton.jit
def _rank_experts(logits_ptr, bias_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr):
    """(ranks 0 .. ``_ranks(K)`` - 1, sigmoid scores by expert, int64 keys of
    those ranks (descending), Σ of the top-k scores) of one token's router logits."""
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    scores = tl.sigmoid(tl.load(logits_ptr + e, mask=valid, other=0.0))
    biased = tl.where(valid, scores + tl.load(bias_ptr + e, mask=valid, other=0.0),
                      -float("inf"))
    bits = biased.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)          # int order == float order
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    ranked = tl.topk(keys, _ranks(K, BLOCK_E))
    r = tl.arange(0, _ranks(K, BLOCK_E))
    kth = tl.sum(tl.where(r == K - 1, ranked, 0), axis=0)
    total = tl.sum(tl.where(keys >= kth, scores, 0.0), axis=0)
    return r, scores, ranked, total


@triton.jit
def routed_slot(logits_ptr, bias_ptr, E, rank, scale, K: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's router logits at ``logits_ptr`` -> (expert of the ``rank``-th slot, its
    renormalised weight ``scale · s_e / Σ_top-k s``)."""
    r, scores, ranked, total = _rank_experts(logits_ptr, bias_ptr, E, K, BLOCK_E)
    key = tl.sum(tl.where(r == rank, ranked, 0), axis=0)
    expert = BLOCK_E - 1 - (key & 0xFFFFFFFF).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    weight = tl.sum(tl.where(e == expert, scores, 0.0), axis=0)
    return expert, weight / total * scale


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, zero_ptr, E, stride_l,
                       scale, ZERO_N, stride_zero, K: tl.constexpr, BLOCK_E: tl.constexpr,
                       ZERO: tl.constexpr, BLOCK_Z: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: its top K ranks' experts and weights; with
    ZERO, also the token's row of the buffer the routed experts will add into."""
    after_previous_kernel(PDL)
    token = tl.program_id(0)
    row = logits_ptr + token * stride_l
    r, _, ranked, total = _rank_experts(row, bias_ptr, E, K, BLOCK_E)
    experts = BLOCK_E - 1 - (ranked & 0xFFFFFFFF).to(tl.int32)
    top = r < K
    weights = tl.sigmoid(tl.load(row + experts, mask=top, other=0.0))
    tl.store(ids_ptr + token * K + r, experts, mask=top)
    tl.store(weights_ptr + token * K + r, weights / total * scale, mask=top)
    if ZERO:
        z = tl.arange(0, BLOCK_Z)
        for z0 in range(0, ZERO_N, BLOCK_Z):
            tl.store(zero_ptr + token.to(tl.int64) * stride_zero + z0 + z,
                     tl.zeros([BLOCK_Z], zero_ptr.dtype.element_ty), mask=z0 + z < ZERO_N)


def router_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float = 1.0,
                zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's contract in one launch, a program per token. ``zero`` [M, N]: rows
    zeroed in the same launch (the grouped FC2 adds each expert's share into them)."""
    M, n_experts = logits.shape
    if not 1 <= k <= n_experts or logits.stride(1) != 1:
        raise ValueError(f"router_topk: top-{k} of {n_experts} experts, contiguous rows")
    if zero is not None and (zero.shape[0] != M or zero.stride(1) != 1):
        raise ValueError(f"router_topk: zero must be [{M}, N] with contiguous rows")
    check_layout("router_topk", {"bias": bias}, {"logits": logits, "zero": zero},
                 {"bias": (n_experts,)})
    ids = torch.empty(M, k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(M, k, dtype=torch.float32, device=logits.device)
    router_topk_kernel[(M,)](logits, bias, ids, weights, zero, n_experts, logits.stride(0),
                             scale, 0 if zero is None else zero.shape[1],
                             0 if zero is None else zero.stride(0), K=k,
                             BLOCK_E=block_e(n_experts), ZERO=zero is not None,
                             BLOCK_Z=1024, num_warps=4, **launch_options())
    return ids, weights


def router_topk_reference(logits: torch.Tensor, bias: torch.Tensor, k: int,
                          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> expert ids [M, k] int32 (descending biased score), weights [M, k]."""
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + bias, k, dim=-1).indices
    weights = scores.gather(-1, ids)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True) * scale


def block_e(n_experts: int) -> int:
    return triton.next_power_of_2(n_experts)
