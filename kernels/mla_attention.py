"""M5: absorbed MLA decode attention over the latent cache (multi-query: one latent head),
split over the cache positions when a step has too few tokens to fill the GPU.

Grid (sequences, row blocks, splits). Every head of every token of a sequence attends to the
same cache rows, so a program takes a block of RB rows, the sequence's (token, head) pairs
flattened as FlashMLA packs them (row t·H + h: q̂'s own layout), and streams its share of the
cache once for all of them: per BLOCK_S positions, scores = q̂_lat · kv_latᵀ + q̂_pe · kv_peᵀ
(the 576-wide dot split at the kv_lora / rope boundary), an online softmax, and
acc += p · kv_lat. A row sees the cache up to its own token's position, so a speculative
verify step of 1+k tokens is causal within the step and still reads the cache once per row
block, not once per token (K3 TP8: 12 heads, one block of 16 rows at decode; 8 tokens x 12
heads = 96 rows, three blocks of 32, where a program per token would read it eight times).
An fp8 cache's rows go to the tensor cores as they are (e4m3 values are exact in bf16) and its
per-tensor scale multiplies the scores and the output instead: no fp32 copy of each tile. So
does the fp8 q̂ an fp8 cache comes with (vLLM's policy), whose scale multiplies the scores.

At batch 1 a single program would stream the whole cache on one SM. So the positions are split
(flash-decoding): split j takes the j-th of ``splits`` equal chunks of the positions the
block's last token sees (computed on the device from the positions, so a CUDA graph replays it
at any length) and writes its normalised partial output and log-sum-exp per row; rows of
earlier tokens see a prefix of those chunks. ``combine_splits`` merges them, weighted by
exp(lse_j - max lse). With one split the kernel writes the output itself. The merge runs in
``mla_combine`` (the standard path: FlashMLA's second launch) or in the specialized path's
``mla_uv_gate``, after its dot (the product is linear in the output).
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
    interpreter_tiles,
    launch_options,
    mma,
)
from kimi_perf_kernels.mla_concat_insert import check_cache


@triton.jit
def mla_attention_kernel(qhat_ptr, cache_ptr, pos_ptr, out_ptr, lse_ptr, M, H, T,
                         stride_cache_b, stride_cache_s, kv_scale, q_scale, sm_scale,
                         LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_ROPE: tl.constexpr,
                         RB: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
                         FP8: tl.constexpr, DOT_FP32: tl.constexpr, RNE: tl.constexpr,
                         PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    b = tl.program_id(0)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)      # t·H + h within the sequence
    split = tl.program_id(2)
    row_ok = rows < T * H
    flat = b * T * H + rows                                 # m·H + h: q̂'s and out's row
    lo = tl.arange(0, LORA)
    r = tl.arange(0, BLOCK_ROPE)
    r_ok = r < ROPE
    q_row = qhat_ptr + flat[:, None] * (LORA + ROPE)
    q_lat = tl.load(q_row + lo[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + LORA + r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if FP8:  # an fp8 q̂, exact in bf16 like the cache's rows
        q_lat = q_lat.to(tl.bfloat16)
        q_pe = q_pe.to(tl.bfloat16)
    # positions each row sees: its token's position + 1 (a padding row sees none)
    n_pos = tl.load(pos_ptr + b * T + rows // H, mask=row_ok, other=-1) + 1
    n_last = tl.max(n_pos, axis=0)
    chunk = tl.cdiv(tl.cdiv(n_last, SPLITS), BLOCK_S) * BLOCK_S
    start = split * chunk
    end = tl.minimum(start + chunk, n_last)
    if FP8:
        sm_scale = sm_scale * kv_scale * q_scale
    # int64: a batch of long caches spans more than 2^31 values (64 x 64k x 576)
    base = cache_ptr + b.to(tl.int64) * stride_cache_b
    running_max = tl.full([RB], -float("inf"), tl.float32)
    total = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, LORA], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < end
        kv = tl.load(base + s[:, None] * stride_cache_s + lo[None, :], mask=s_ok[:, None],
                     other=0.0)
        pe = tl.load(base + s[:, None] * stride_cache_s + LORA + r[None, :],
                     mask=s_ok[:, None] & r_ok[None, :], other=0.0)
        if FP8:  # e4m3 is exact in bf16, for the tensor cores; the scale comes after
            kv = kv.to(tl.bfloat16)
            pe = pe.to(tl.bfloat16)
        scores = mma(q_pe, tl.trans(pe), mma(q_lat, tl.trans(kv), None, DOT_FP32), DOT_FP32)
        seen = s_ok[None, :] & (s[None, :] < n_pos[:, None])
        scores = tl.where(seen, scores * sm_scale, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # a row that has seen no position yet (an earlier token of a verify step, in a later
        # chunk) keeps max -inf: shift by 0 there, so its exps are 0 and not NaN
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        rescale = tl.exp(running_max - shift)
        p = tl.exp(scores - shift[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        # P in the cache's dtype (bf16: rounded; an fp32 cache's, tf32)
        acc = mma(cast(p, kv.dtype, RNE), kv, acc * rescale[:, None], DOT_FP32)
        running_max = new_max
    # a split a row does not reach (a short cache, an earlier token) contributes nothing:
    # output 0, lse -inf
    if FP8:
        acc = acc * kv_scale
    out = acc / tl.maximum(total, 1e-30)[:, None]
    row = split * M * H + flat
    tl.store(out_ptr + row[:, None] * LORA + lo[None, :],
             cast(out, out_ptr.dtype.element_ty, RNE), mask=row_ok[:, None])
    if SPLITS > 1:
        lse = tl.where(total > 0, running_max + tl.log(tl.maximum(total, 1e-30)),
                       -float("inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def combine_splits(parts_ptr, lse_ptr, m, h, M, H, ls, LORA: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """Head h of token m, output columns ``ls``: Σ_j w_j · part_j, w_j ∝ exp(lse_j)."""
    j = tl.arange(0, BLOCK_SPLITS)
    j_ok = j < SPLITS
    rows = (j * M + m) * H + h
    lse = tl.load(lse_ptr + rows, mask=j_ok, other=-float("inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(top == -float("inf"), 0.0, top))
    total = tl.sum(w, axis=0)
    w = w / tl.where(total > 0, total, 1.0)     # a token with no position: 0, as mla_uv_gate
    part = tl.load(parts_ptr + rows[:, None] * LORA + ls[None, :], mask=j_ok[:, None],
                   other=0.0)
    return tl.sum(w[:, None] * part, axis=0)


@triton.jit
def mla_combine_kernel(parts_ptr, lse_ptr, out_ptr, M, H, LORA: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, RNE: tl.constexpr,
                       PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    m = tl.program_id(0)
    h = tl.program_id(1)
    ls = tl.arange(0, LORA)
    o = combine_splits(parts_ptr, lse_ptr, m, h, M, H, ls, LORA, SPLITS, BLOCK_SPLITS)
    tl.store(out_ptr + (m * H + h) * LORA + ls, cast(o, out_ptr.dtype.element_ty, RNE))


# Up to 64 splits: a batch of 1 at 32k positions takes 64 programs (16 are too few to stream
# 37 MB of cache at full bandwidth); one split per 256 positions of the cache's capacity at
# most, so that a split's partial output (a head's 512 fp32 values, written and read back)
# stays small next to what it reads once the cache is full. The count is fixed by shapes (a
# CUDA graph keeps it); each split takes an equal share of the positions present, rounded up
# to whole blocks of BLOCK_S, so the last splits may be left none (fewer positions than
# SPLITS blocks; 161 in 5 splits of 2 blocks): they read nothing and write a zero partial
# and an lse of -inf.
MAX_SPLITS = 64
MIN_SPLIT_POSITIONS = 256


def mla_row_block(rows: int) -> int:
    """(token, head) rows a program takes, of a sequence's ``rows``: 16 hold a decode step's
    heads (K3: 12 at TP8, 6 at TP16); a verify step's go 32 at a time (the fp32 accumulator,
    32 x 512, stays in registers)."""
    return 16 if rows <= 16 else 32


def mla_splits(batch: int, tokens: int, heads: int, capacity: int,
               device: torch.device) -> int:
    """Position splits for a step of ``batch`` sequences of ``tokens`` each: enough programs
    to give every SM one, at most one per 256 positions of the cache's ``capacity``; 1 on a
    CPU. Depends on shapes only, so a CUDA graph keeps it."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = tokens * heads
    programs = batch * triton.cdiv(rows, mla_row_block(rows))
    return max(1, min(MAX_SPLITS, sms // programs, capacity // MIN_SPLIT_POSITIONS))


def mla_attention(qhat: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                  tokens_per_seq: int, kv_lora: int, kv_scale: float, sm_scale: float,
                  splits: int = 1, q_scale: float = 1.0, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q̂ [M, H, kv_lora+rope], cache [B, S, kv_lora+rope], positions [M] -> (parts
    [splits, M, H, kv_lora], lse [splits, M, H] fp32). With one split parts[0] is the output
    (in ``dtype``: the model's, which an fp8 q̂ needs said; else q̂'s) and lse is None; with
    more, parts are fp32 partial outputs for ``mla_combine`` (or ``mla_uv_gate``) to merge. An
    fp8 cache takes an fp8 q̂ (its values times ``q_scale``), a bf16 cache a bf16 one.

    Every position must be inside the cache (< S): a row reads positions 0 to its own, with
    no clamp at S (the inserts drop a row past S, but a clamp here costs the fp8 cache's
    32-row tile, at 255 registers, its last ones: it spills). On the host, the model refuses
    an eager step the cache cannot hold (``positions``), and ``GraphedDecodeStep`` a
    replay."""
    M, H, width = qhat.shape
    fp8 = cache.dtype == torch.float8_e4m3fn
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"mla_attention: {splits} splits (1 to {MAX_SPLITS})")
    if not 0 < kv_lora < width:
        raise ValueError(f"mla_attention: kv_lora {kv_lora} must be below q̂'s {width} "
                         "columns (kv_lora + rope)")
    check_whole_tiles("mla_attention", kv_lora=kv_lora)
    check_cache("mla_attention", cache, positions, M, tokens_per_seq, width, {"qhat": qhat})
    if fp8 != (qhat.dtype == torch.float8_e4m3fn):
        raise ValueError(f"mla_attention: a {qhat.dtype} q̂ for a {cache.dtype} cache (an fp8 "
                         "cache takes an fp8 q̂, any other cache one in the model's dtype)")
    dtype = dtype or qhat.dtype
    if dtype == torch.float8_e4m3fn:
        raise ValueError("mla_attention: an fp8 q̂ needs the output's dtype")
    parts = torch.empty(splits, M, H, kv_lora, dtype=dtype if splits == 1 else torch.float32,
                        device=qhat.device)
    lse = torch.empty(splits, M, H, dtype=torch.float32, device=qhat.device) \
        if splits > 1 else None
    rope = width - kv_lora
    rows = tokens_per_seq * H
    rb = mla_row_block(rows)
    # BLOCK_S 32 positions a pass: the one size at which all eight sm_90a builds (bf16 or fp8
    # cache, 16 or 32 rows, 1 or 64 splits) spill nothing (ptxas, K3 TP8): 64 spills the fp8
    # 32-row tile and 16 the bf16 16-row one.
    mla_attention_kernel[(M // tokens_per_seq, triton.cdiv(rows, rb), splits)](
        qhat, cache, positions, parts, lse if lse is not None else parts, M, H, tokens_per_seq,
        cache.stride(0), cache.stride(1), kv_scale if fp8 else 1.0, q_scale if fp8 else 1.0,
        sm_scale, LORA=kv_lora, ROPE=rope, BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        RB=rb, BLOCK_S=64 if interpreter_tiles() else 32, SPLITS=splits, FP8=fp8,
        DOT_FP32=INTERPRETED, RNE=INTERPRETED, num_warps=8, **launch_options())
    return parts, lse


def mla_combine(parts: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Split partial outputs [splits, M, H, kv_lora] -> [M, H, kv_lora] in ``dtype``."""
    splits, M, H, lora = parts.shape
    check_whole_tiles("mla_combine", kv_lora=lora)
    check_layout("mla_combine", {"parts": parts, "lse": lse}, {}, {"lse": (splits, M, H)},
                 {"parts": (torch.float32,), "lse": (torch.float32,)})
    out = torch.empty(M, H, lora, dtype=dtype, device=parts.device)
    mla_combine_kernel[(M, H)](parts, lse, out, M, H, LORA=lora, SPLITS=splits,
                               BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)),
                               RNE=INTERPRETED, num_warps=4, **launch_options())
    return out


def mla_attention_reference(qhat, cache, positions, tokens_per_seq, kv_scale, sm_scale, lora,
                            q_scale=1.0, dtype=None):
    M, H, _ = qhat.shape
    out = torch.empty(M, H, lora, dtype=dtype or qhat.dtype)
    fp8 = cache.dtype == torch.float8_e4m3fn
    scale, q_scale = (kv_scale, q_scale) if fp8 else (1.0, 1.0)
    for m in range(M):
        kv = cache[m // tokens_per_seq, : int(positions[m]) + 1].float() * scale
        scores = qhat[m].float() * q_scale @ kv.T * sm_scale
        out[m] = (torch.softmax(scores, dim=-1) @ kv[:, :lora]).to(out.dtype)
    return out
