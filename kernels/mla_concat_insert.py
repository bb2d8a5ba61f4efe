"""The standard path's ``q_concat_kv_cache_insert`` (vLLM's
``fused_mla_decode_q_concat_kv_cache_insert``): after the bmm with W_UK, q̂ = [q_nope·W_UK |
q_pe] per head, and the token's normed latent [kv_c | k_pe] written into the cache at its
position, in one launch. An fp8 cache takes an fp8 q̂, as vLLM's does ("fp8 cache -> fp8
query"): each quantised with its own per-tensor scale (the cache's ``kv_scale``, the query's
``q_scale``; vLLM's are 1 unless a checkpoint gives them).

Grid (tokens, heads + 1): programs h < H copy one head's q̂ row, the last one writes the
cache row; a position past the cache's S rows is not written (a graph-safe step cannot check
the lengths on the host, and the row would be the next sequence's, or past the tensor). The
specialized path does this inside ``mla_absorb_insert`` with the bmm and the kv RMSNorm; here
both arrive computed.
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
    check_whole_tiles,
    launch_options,
)


@triton.jit
def mla_concat_insert_kernel(ql_ptr, q_ptr, kv_ptr, kpe_ptr, cache_ptr, pos_ptr, qhat_ptr, H,
                             T, S, stride_ql_h, stride_ql_m, stride_q, stride_kv, stride_kpe,
                             stride_cache_b, stride_cache_s, kv_scale, q_scale,
                             NOPE: tl.constexpr, ROPE: tl.constexpr, LORA: tl.constexpr,
                             BLOCK_ROPE: tl.constexpr, FP8: tl.constexpr, RNE: tl.constexpr,
                             PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    m = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.arange(0, LORA)
    r = tl.arange(0, BLOCK_ROPE)
    r_ok = r < ROPE
    if h < H:
        qhat = qhat_ptr + (m * H + h) * (LORA + ROPE)
        ql = tl.load(ql_ptr + h * stride_ql_h + m * stride_ql_m + lo)
        tl.store(qhat + lo, quantised(ql, q_scale, qhat_ptr.dtype.element_ty, FP8, RNE))
        q_pe = tl.load(q_ptr + m * stride_q + h * (NOPE + ROPE) + NOPE + r, mask=r_ok)
        tl.store(qhat + LORA + r, quantised(q_pe, q_scale, qhat_ptr.dtype.element_ty, FP8, RNE),
                 mask=r_ok)
    else:
        kv = tl.load(kv_ptr + m * stride_kv + lo).to(tl.float32)
        k_pe = tl.load(kpe_ptr + m * stride_kpe + r, mask=r_ok, other=0.0).to(tl.float32)
        write_cache_row(cache_ptr, pos_ptr, m, T, S, stride_cache_b, stride_cache_s, kv, k_pe,
                        kv_scale, LORA, BLOCK_ROPE, ROPE, FP8, RNE)


@triton.jit
def quantised(x, scale, dtype: tl.constexpr, FP8: tl.constexpr, RNE: tl.constexpr):
    """``x`` in ``dtype``; for fp8, x / scale clamped to e4m3's ±448 (no NaN, no fnuz 240)."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    return cast(x, dtype, RNE)


@triton.jit
def write_cache_row(cache_ptr, pos_ptr, m, T, S, stride_cache_b, stride_cache_s, kv, k_pe,
                    kv_scale, LORA: tl.constexpr, BLOCK_ROPE: tl.constexpr,
                    ROPE: tl.constexpr, FP8: tl.constexpr, RNE: tl.constexpr):
    """Token m's latent [kv (LORA) | k_pe (ROPE)], fp32, into its cache row at its position,
    where that is one of the cache's S rows (a negative one, vLLM's padding slot, writes
    nothing, as the attention reads nothing for it); an fp8 cache stores value / kv_scale,
    clamped to e4m3's ±448."""
    lo = tl.arange(0, LORA)
    r = tl.arange(0, BLOCK_ROPE)
    pos = tl.load(pos_ptr + m).to(tl.int64)
    held = (pos >= 0) & (pos < S)
    slot = cache_ptr + (m // T).to(tl.int64) * stride_cache_b + pos * stride_cache_s
    dtype: tl.constexpr = cache_ptr.dtype.element_ty
    tl.store(slot + lo, quantised(kv, kv_scale, dtype, FP8, RNE), mask=held)
    tl.store(slot + LORA + r, quantised(k_pe, kv_scale, dtype, FP8, RNE),
             mask=held & (r < ROPE))


def check_cache(what: str, cache: torch.Tensor, positions: torch.Tensor, tokens: int,
                tokens_per_seq: int, width: int, whole: dict | None = None,
                rows: dict | None = None, shapes: dict | None = None) -> None:
    """The latent cache [B, S, width] and the ``tokens`` positions a kernel reads or writes
    it at: a row of B for each sequence of ``tokens_per_seq`` tokens (fewer would be written
    past the cache's end), rows contiguous, positions packed integers; checked with the
    kernel's other tensors (``whole``, ``rows``, ``shapes``: as ``check_layout`` takes
    them)."""
    if tokens_per_seq < 1 or tokens % tokens_per_seq:
        raise ValueError(f"{what}: {tokens} tokens are not sequences of {tokens_per_seq}")
    if cache.dim() != 3 or cache.shape[2] != width or cache.shape[0] < tokens // tokens_per_seq:
        raise ValueError(f"{what}: cache {list(cache.shape)} is not [B >= "
                         f"{tokens // tokens_per_seq} sequences, S, {width}]")
    check_layout(what, {"positions": positions, **(whole or {})},
                 {"cache": cache, **(rows or {})}, {"positions": (tokens,), **(shapes or {})},
                 # (fp8 is e4m3, scaled: another fp8 would be stored unscaled, kv_scale unseen)
                 {"positions": (torch.int32, torch.int64),
                  "cache": (torch.bfloat16, torch.float32, torch.float8_e4m3fn)})


def mla_concat_insert(ql: torch.Tensor, q: torch.Tensor, kv_c: torch.Tensor,
                      k_pe: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                      tokens_per_seq: int, kv_scale: float, nope: int,
                      q_scale: float = 1.0) -> torch.Tensor:
    """ql [H, M, kv_lora] (the bmm's head-major output), q [M, H·(nope+rope)] (for q_pe),
    kv_c [M, kv_lora] (normed), k_pe [M, rope]; writes cache [B, S, kv_lora+rope] at
    ``positions`` [M] (those below S) -> q̂ [M, H, kv_lora+rope] (fp8, / ``q_scale``, for an
    fp8 cache)."""
    H, M, lora = ql.shape
    rope = k_pe.shape[1]
    if cache.shape[-1] != lora + rope or q.shape != (M, H * (nope + rope)):
        raise ValueError(f"mla_concat_insert: q̂ parts {tuple(ql.shape)}, q "
                         f"{tuple(q.shape)} and cache {tuple(cache.shape)} do not fit")
    check_whole_tiles("mla_concat_insert", kv_lora=lora)
    check_cache("mla_concat_insert", cache, positions, M, tokens_per_seq, lora + rope, {},
                {"ql": ql, "q": q, "kv_c": kv_c, "k_pe": k_pe},
                {"kv_c": (M, lora), "k_pe": (M, rope)})
    fp8 = cache.dtype == torch.float8_e4m3fn
    qhat = torch.empty(M, H, lora + rope, dtype=cache.dtype if fp8 else q.dtype,
                       device=q.device)
    mla_concat_insert_kernel[(M, H + 1)](
        ql, q, kv_c, k_pe, cache, positions, qhat, H, tokens_per_seq, cache.shape[1],
        ql.stride(0),
        ql.stride(1), q.stride(0), kv_c.stride(0), k_pe.stride(0), cache.stride(0),
        cache.stride(1), kv_scale, q_scale, NOPE=nope, ROPE=rope, LORA=lora,
        BLOCK_ROPE=triton.next_power_of_2(rope), FP8=fp8, RNE=INTERPRETED, num_warps=4,
        **launch_options())
    return qhat


def quantised_reference(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``quantised``: x in ``dtype``, for fp8 x / scale clamped to ±448 first."""
    if dtype == torch.float8_e4m3fn:
        x = (x.float() / scale).clamp(-448, 448)
    return x.to(dtype)


def mla_concat_insert_reference(ql, q, kv_c, k_pe, cache, positions, tokens_per_seq,
                                kv_scale, nope, q_scale=1.0):
    H, M, _ = ql.shape
    rope = k_pe.shape[1]
    q_pe = q.view(M, H, nope + rope)[..., nope:]
    fp8 = cache.dtype == torch.float8_e4m3fn
    qhat = quantised_reference(torch.cat([ql.transpose(0, 1), q_pe], dim=-1), q_scale,
                               cache.dtype if fp8 else q.dtype)
    entry = quantised_reference(torch.cat([kv_c, k_pe], dim=-1), kv_scale, cache.dtype)
    held = (positions >= 0) & (positions < cache.shape[1])
    cache[(torch.arange(M, device=cache.device) // tokens_per_seq)[held],
          positions[held]] = entry[held]
    return qhat
