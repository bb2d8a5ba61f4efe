"""M4: MLA query absorption and latent-cache insert in one launch.

Grid (token blocks, heads × kv_lora blocks + 1). Program (i, p < H · L, L = kv_lora / BLOCK_L
blocks: 8 at K3) absorbs head h = p // L's no-position query into the latent space for the
BLOCK_M tokens of block i, one kv_lora block (p mod L) of BLOCK_L columns:
``ql = q_nope · W_UK[h][:, block]`` ([BLOCK_M, nope] × [nope, BLOCK_L], a tensor-core dot),
and writes that part of ``q̂ = [ql | q_pe]`` (its first block also q_pe).
So a head's W_UK is read once per block of 16 tokens, not once per token (at batch 64: 6 MB
from L2 rather than 100 MB), and a batch of 1 has 96 absorbing programs at K3 TP8 (12 heads
× 8 blocks), not 12. Program (i, H · L) normalises its tokens' latent KV (RMSNorm of the kv_lora
part, the rope part as is), quantises it to fp8 with the per-tensor scale when the cache is
fp8, and stores it at each token's position (one of the cache's S rows: past them or at a
negative one, nothing; see ``write_cache_row``). An fp8 cache takes an fp8 q̂ (with its own
scale), as the standard path's ``mla_concat_insert`` writes it: ql rounded to bf16 first, as
the standard path's bmm leaves it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import (
    INTERPRETED,
    after_previous_kernel,
    cast,
    check_whole_tiles,
    interpreter_tiles,
    launch_options,
    mma,
)
from kimi_perf_kernels.mla_concat_insert import (
    check_cache,
    quantised,
    quantised_reference,
    write_cache_row,
)

BLOCK_M = 16   # tokens a program takes: the tensor cores' smallest tile


@triton.jit
def mla_absorb_insert_kernel(q_ptr, wuk_ptr, qhat_ptr, kv_ptr, kv_norm_ptr, cache_ptr, pos_ptr,
                             M, H, T, S, stride_q, stride_kv, stride_cache_b, stride_cache_s,
                             kv_scale, q_scale, eps, NOPE: tl.constexpr, ROPE: tl.constexpr,
                             LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
                             BLOCK_ROPE: tl.constexpr, FP8: tl.constexpr,
                             DOT_FP32: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    p = tl.program_id(1)
    l_blocks: tl.constexpr = LORA // BLOCK_L
    r = tl.arange(0, BLOCK_ROPE)
    r_ok = r < ROPE
    if p < H * l_blocks:
        h = p // l_blocks
        ls = (p % l_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
        n = tl.arange(0, NOPE)
        q_rows = q_ptr + rows[:, None] * stride_q + h * (NOPE + ROPE)
        q_nope = tl.load(q_rows + n[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(wuk_ptr + (h * NOPE + n[:, None]) * LORA + ls[None, :])
        ql = mma(q_nope, w, None, DOT_FP32)      # bf16 products, summed in fp32
        qhat = qhat_ptr + (rows[:, None] * H + h) * (LORA + ROPE)
        ql = cast(ql, q_ptr.dtype.element_ty, RNE)
        tl.store(qhat + ls[None, :], quantised(ql, q_scale, qhat_ptr.dtype.element_ty, FP8, RNE),
                 mask=row_ok[:, None])
        if p % l_blocks == 0:
            both = row_ok[:, None] & r_ok[None, :]
            q_pe = tl.load(q_rows + NOPE + r[None, :], mask=both, other=0.0)
            tl.store(qhat + LORA + r[None, :],
                     quantised(q_pe, q_scale, qhat_ptr.dtype.element_ty, FP8, RNE), mask=both)
    else:
        lo = tl.arange(0, LORA)
        for i in range(0, BLOCK_M):
            m = tl.program_id(0) * BLOCK_M + i
            if m < M:
                kv_row = kv_ptr + m * stride_kv
                kv = tl.load(kv_row + lo).to(tl.float32)
                kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) / LORA + eps) * tl.load(
                    kv_norm_ptr + lo)
                kv = cast(kv, kv_ptr.dtype.element_ty, RNE).to(tl.float32)  # the bf16 latent
                k_pe = tl.load(kv_row + LORA + r, mask=r_ok, other=0.0).to(tl.float32)
                write_cache_row(cache_ptr, pos_ptr, m, T, S, stride_cache_b, stride_cache_s,
                                kv, k_pe, kv_scale, LORA, BLOCK_ROPE, ROPE, FP8, RNE)


def mla_absorb_insert(q: torch.Tensor, w_uk: torch.Tensor, kv: torch.Tensor,
                      kv_norm: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                      tokens_per_seq: int, kv_scale: float, eps: float,
                      qhat: torch.Tensor | None = None, q_scale: float = 1.0) -> torch.Tensor:
    """q [M, H*(nope+rope)], w_uk [H, nope, kv_lora], kv [M, kv_lora+rope] (un-normed),
    cache [B, S, kv_lora+rope] (written at ``positions`` [M], those below S) -> q̂ [M, H,
    kv_lora+rope] (fp8, / ``q_scale``, for an fp8 cache)."""
    M = q.shape[0]
    H, nope, lora = w_uk.shape
    rope = cache.shape[-1] - lora
    check_whole_tiles("mla_absorb_insert", nope=nope, kv_lora=lora)
    fp8 = cache.dtype == torch.float8_e4m3fn
    if qhat is None:
        qhat = torch.empty(M, H, lora + rope, dtype=cache.dtype if fp8 else q.dtype,
                           device=q.device)
    elif qhat.dtype != (cache.dtype if fp8 else q.dtype):
        raise ValueError(f"mla_absorb_insert: q̂ of {qhat.dtype} for a {cache.dtype} cache")
    check_cache("mla_absorb_insert", cache, positions, M, tokens_per_seq, lora + rope,
                {"w_uk": w_uk, "kv_norm": kv_norm, "qhat": qhat}, {"q": q, "kv": kv},
                {"q": (M, H * (nope + rope)), "kv": (M, lora + rope), "kv_norm": (lora,),
                 "qhat": (M, H, lora + rope)})
    block_l = lora if interpreter_tiles() else min(64, lora)
    mla_absorb_insert_kernel[(triton.cdiv(M, BLOCK_M), H * (lora // block_l) + 1)](
        q, w_uk, qhat, kv, kv_norm, cache, positions, M, H, tokens_per_seq, cache.shape[1],
        q.stride(0),
        kv.stride(0), cache.stride(0), cache.stride(1), kv_scale, q_scale, eps, NOPE=nope,
        ROPE=rope, LORA=lora, BLOCK_M=BLOCK_M, BLOCK_L=block_l,
        BLOCK_ROPE=triton.next_power_of_2(rope), FP8=fp8, DOT_FP32=INTERPRETED, RNE=INTERPRETED,
        num_warps=4, **launch_options())
    return qhat


def mla_absorb_insert_reference(q, w_uk, kv, kv_norm, cache, positions, tokens_per_seq,
                                kv_scale, eps, q_scale=1.0):
    M = q.shape[0]
    H, nope, lora = w_uk.shape
    rope = cache.shape[-1] - lora
    qh = q.view(M, H, nope + rope)
    ql = torch.einsum("mhn,hnl->mhl", qh[..., :nope].float(), w_uk.float()).to(q.dtype)
    fp8 = cache.dtype == torch.float8_e4m3fn
    qhat = quantised_reference(torch.cat([ql, qh[..., nope:]], dim=-1), q_scale,
                               cache.dtype if fp8 else q.dtype)
    kv_c = kv[:, :lora].float()
    kv_c = (kv_c * torch.rsqrt(kv_c.pow(2).mean(-1, keepdim=True) + eps) * kv_norm).to(kv.dtype)
    held = (positions >= 0) & (positions < cache.shape[1])
    batch = torch.arange(M, device=q.device) // tokens_per_seq
    cache[batch[held], positions[held]] = quantised_reference(
        torch.cat([kv_c, kv[:, lora:]], dim=-1), kv_scale, cache.dtype)[held]
    return qhat
