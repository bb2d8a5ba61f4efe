"""S6: router top-k — sigmoid scores, correction bias for the choice, top-k, renormalised
weights, in one kernel (one program per token).

All E expert scores of a token fit in registers (E = 896 → a 1024-wide block); the k winners
are taken by k rounds of argmax-and-mask, which yields them in descending order of biased
score, as ``torch.topk`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, stride_l, scale,
                       K: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    scores = tl.sigmoid(tl.load(logits_ptr + row * stride_l + e, mask=valid, other=0.0))
    biased = tl.where(valid, scores + tl.load(bias_ptr + e, mask=valid, other=0.0),
                      -float("inf"))
    total = 0.0
    for j in tl.static_range(K):
        best = tl.argmax(biased, axis=0)
        chosen = e == best
        weight = tl.sum(tl.where(chosen, scores, 0.0), axis=0)
        tl.store(ids_ptr + row * K + j, best.to(tl.int32))
        tl.store(weights_ptr + row * K + j, weight)
        total += weight
        biased = tl.where(chosen, -float("inf"), biased)
    k = tl.arange(0, K)
    w = tl.load(weights_ptr + row * K + k)
    tl.store(weights_ptr + row * K + k, w / total * scale)


def router_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float = 1.0,
                ids: torch.Tensor | None = None, weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] (fp32, any row stride) -> expert ids [M, k] int32, weights [M, k] fp32."""
    M, E = logits.shape
    if ids is None:
        ids = torch.empty(M, k, dtype=torch.int32, device=logits.device)
    if weights is None:
        weights = torch.empty(M, k, dtype=torch.float32, device=logits.device)
    router_topk_kernel[(M,)](logits, bias, ids, weights, E, logits.stride(0), scale, K=k,
                             BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return ids, weights


def router_topk_reference(logits: torch.Tensor, bias: torch.Tensor, k: int,
                          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + bias, k, dim=-1).indices
    weights = scores.gather(-1, ids)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True) * scale
