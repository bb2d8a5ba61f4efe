"""M5: absorbed MLA decode attention over the latent cache (multi-query: one latent head).

Grid (tokens, head blocks). Every head of a token attends to the same cache rows, so a program
takes a block of HB heads and streams the cache once for all of them: per BLOCK_S positions,
scores = q̂_lat · kv_latᵀ + q̂_pe · kv_peᵀ (the 576-wide dot split at the kv_lora / rope
boundary), an online softmax, and acc += p · kv_lat. A token sees the cache up to its own
position (causal within a verify step). fp8 caches are dequantised with the per-tensor scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast


@triton.jit
def mla_attention_kernel(qhat_ptr, cache_ptr, pos_ptr, out_ptr, H, T, stride_cache_b,
                         stride_cache_s, kv_scale, sm_scale, LORA: tl.constexpr,
                         ROPE: tl.constexpr, BLOCK_ROPE: tl.constexpr, HB: tl.constexpr,
                         BLOCK_S: tl.constexpr, FP8: tl.constexpr, DOT_FP32: tl.constexpr,
                         RNE: tl.constexpr):
    m = tl.program_id(0)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = heads < H
    lo = tl.arange(0, LORA)
    r = tl.arange(0, BLOCK_ROPE)
    r_ok = r < ROPE
    q_row = qhat_ptr + (m * H + heads[:, None]) * (LORA + ROPE)
    q_lat = tl.load(q_row + lo[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + LORA + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    last = tl.load(pos_ptr + m)
    base = cache_ptr + (m // T) * stride_cache_b
    running_max = tl.full([HB], -float("inf"), tl.float32)
    total = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, LORA], tl.float32)
    for s0 in range(0, last + 1, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s <= last
        kv = tl.load(base + s[:, None] * stride_cache_s + lo[None, :], mask=s_ok[:, None],
                     other=0.0)
        pe = tl.load(base + s[:, None] * stride_cache_s + LORA + r[None, :],
                     mask=s_ok[:, None] & r_ok[None, :], other=0.0)
        if FP8:  # dequantise to bf16 for the tensor cores
            kv = (kv.to(tl.float32) * kv_scale).to(tl.bfloat16)
            pe = (pe.to(tl.float32) * kv_scale).to(tl.bfloat16)
        if DOT_FP32:
            kv = kv.to(tl.float32)
            scores = tl.dot(q_lat, tl.trans(kv), input_precision="ieee") + tl.dot(
                q_pe, tl.trans(pe.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_pe, tl.trans(pe))
        scores = tl.where(s_ok[None, :], scores * sm_scale, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * rescale[:, None] + tl.dot(p, kv, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(tl.bfloat16), kv)
        running_max = new_max
    out = acc / total[:, None]
    tl.store(out_ptr + (m * H + heads[:, None]) * LORA + lo[None, :],
             cast(out, out_ptr.dtype.element_ty, RNE), mask=h_ok[:, None])


def mla_attention(qhat: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                  tokens_per_seq: int, kv_lora: int, kv_scale: float, sm_scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q̂ [M, H, kv_lora+rope], cache [B, S, kv_lora+rope], positions [M] -> [M, H, kv_lora]."""
    M, H, width = qhat.shape
    if out is None:
        out = torch.empty(M, H, kv_lora, dtype=qhat.dtype, device=qhat.device)
    hb = 16
    rope = width - kv_lora
    scale = kv_scale if cache.dtype == torch.float8_e4m3fn else 1.0
    mla_attention_kernel[(M, triton.cdiv(H, hb))](
        qhat, cache, positions, out, H, tokens_per_seq, cache.stride(0), cache.stride(1),
        scale, sm_scale, LORA=kv_lora, ROPE=rope,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)), HB=hb,
        BLOCK_S=64 if INTERPRETED else 32, FP8=cache.dtype == torch.float8_e4m3fn,
        DOT_FP32=INTERPRETED, RNE=INTERPRETED, num_warps=8)
    return out


def mla_attention_reference(qhat, cache, positions, tokens_per_seq, kv_scale, sm_scale, lora):
    M, H, _ = qhat.shape
    out = torch.empty(M, H, lora, dtype=qhat.dtype)
    scale = kv_scale if cache.dtype == torch.float8_e4m3fn else 1.0
    for m in range(M):
        kv = cache[m // tokens_per_seq, : int(positions[m]) + 1].float() * scale
        scores = qhat[m].float() @ kv.T * sm_scale
        out[m] = (torch.softmax(scores, dim=-1) @ kv[:, :lora]).to(qhat.dtype)
    return out
