"""S1: attention-residual mix + RMSNorm in one kernel (one program per token).

Per token row: fold the previous sub-layer output into the running prefix (or reset the prefix
to it at a block boundary), write the prefix into the block buffer when asked, then a softmax
over depth: every source (completed blocks, then the prefix) gets the logit
``(norm_w * proj_w) · v · rsqrt(mean(v²) + eps)``; the mix ``Σ softmax · v`` is RMS-normed.

Tiling: a whole hidden row (BLOCK_H ≥ hidden, a power of two) lives in registers; sources are
read once each in an online softmax, so the kernel reads ≤ 9 source rows and the delta, and
writes up to 3 (prefix, block buffer, output). The
completed blocks are read in a software-pipelined loop (``STAGES`` rows in flight): the next
sources' rows load while one is reduced, not one memory round trip per source. (The block a
call writes is never among those it reads: it is the next one.)
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
    launch_options,
)

STAGES = tl.constexpr(4)


@triton.jit
def _mix_in(v, qk, mix, total, running_max, hidden, eps):
    """One source ``v`` folded into the online softmax: its logit, the running max, the
    rescaled mix and sum of weights."""
    logit = tl.sum(qk * v, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / hidden + eps)
    new_max = tl.maximum(running_max, logit)
    scale = tl.exp(running_max - new_max)
    weight = tl.exp(logit - new_max)
    return mix * scale + weight * v, total * scale + weight, new_max


@triton.jit
def attn_res_kernel(prefix_ptr, delta_ptr, blocks_ptr, qk_ptr, norm_ptr, out_ptr,
                    hidden, n_blocks, write_idx, stride_prefix, stride_delta, stride_blocks_m,
                    stride_blocks_s, stride_out, eps,
                    HAS_DELTA: tl.constexpr, RESET: tl.constexpr, HAS_NORM: tl.constexpr,
                    BLOCK_H: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    p = tl.load(prefix_ptr + row * stride_prefix + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
        p = d if RESET else p + d
        p = cast(p, prefix_ptr.dtype.element_ty, RNE)
        tl.store(prefix_ptr + row * stride_prefix + offs, p, mask=mask)
        p = p.to(tl.float32)
    if write_idx >= 0:
        tl.store(blocks_ptr + row * stride_blocks_m + write_idx * stride_blocks_s + offs,
                 cast(p, blocks_ptr.dtype.element_ty, RNE), mask=mask)
    qk = tl.load(qk_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Online softmax over the sources: blocks 0..n_blocks-1, then the prefix.
    running_max = -float("inf")
    total = 0.0
    mix = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in tl.range(0, n_blocks, num_stages=STAGES):
        v = tl.load(blocks_ptr + row * stride_blocks_m + s * stride_blocks_s + offs,
                    mask=mask, other=0.0).to(tl.float32)
        mix, total, running_max = _mix_in(v, qk, mix, total, running_max, hidden, eps)
    mix, total, running_max = _mix_in(p, qk, mix, total, running_max, hidden, eps)
    mix = mix / total
    if HAS_NORM:
        w = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mix = mix / tl.sqrt(tl.sum(mix * mix, axis=0) / hidden + eps) * w
    tl.store(out_ptr + row * stride_out + offs, cast(mix, out_ptr.dtype.element_ty, RNE),
             mask=mask)


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
             n_blocks: int, write_idx: int, qk: torch.Tensor, norm: torch.Tensor | None,
             eps: float, reset: bool = False) -> torch.Tensor:
    """prefix [M, h] (updated in place), delta [M, h] or None, blocks [M, S, h] (written in
    place at ``write_idx`` >= 0), qk = norm_w * proj_w [h] fp32, norm [h] or None."""
    M, hidden = prefix.shape
    if write_idx >= blocks.shape[1] or n_blocks > blocks.shape[1]:
        raise ValueError(f"attn_res: blocks {n_blocks} (writing {write_idx}) of "
                         f"{blocks.shape[1]}")
    if 0 <= write_idx < n_blocks:   # (its programs would read a block others are writing)
        raise ValueError(f"attn_res: block {write_idx} is written and among the {n_blocks} "
                         "read: a call writes the block after those it reads")
    if blocks.shape[::2] != (M, hidden) or (delta is not None and delta.shape != prefix.shape):
        raise ValueError(f"attn_res: blocks {tuple(blocks.shape)} and delta "
                         f"{None if delta is None else tuple(delta.shape)} for a prefix "
                         f"{tuple(prefix.shape)}")
    if blocks.dim() != 3:
        raise ValueError(f"attn_res: blocks {tuple(blocks.shape)} is not [M, S, h]")
    check_layout("attn_res", {"qk": qk, "norm": norm},
                 {"prefix": prefix, "delta": delta, "blocks": blocks},
                 {"qk": (hidden,), "norm": (hidden,)})
    out = torch.empty_like(prefix)
    delta_arg = delta if delta is not None else prefix
    attn_res_kernel[(M,)](
        prefix, delta_arg, blocks, qk, norm if norm is not None else qk, out, hidden, n_blocks,
        write_idx, prefix.stride(0), delta_arg.stride(0), blocks.stride(0), blocks.stride(1),
        out.stride(0), eps, HAS_DELTA=delta is not None, RESET=reset,
        HAS_NORM=norm is not None, BLOCK_H=triton.next_power_of_2(hidden), RNE=INTERPRETED,
        num_warps=8 if hidden > 2048 else 4, **launch_options())
    return out


def attn_res_reference(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                       n_blocks: int, write_idx: int, qk: torch.Tensor,
                       norm: torch.Tensor | None, eps: float, reset: bool = False
                       ) -> torch.Tensor:
    """The same contract in PyTorch (also updates ``prefix`` and ``blocks`` in place)."""
    if delta is not None:
        new = delta.float() if reset else prefix.float() + delta.float()
        prefix.copy_(new.to(prefix.dtype))
    if write_idx >= 0:
        blocks[:, write_idx] = prefix.to(blocks.dtype)
    v = torch.cat([blocks[:, :n_blocks], prefix[:, None]], dim=1).float()     # [M, S, h]
    logits = (v * qk.float()).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
    mix = (torch.softmax(logits, dim=-1)[..., None] * v).sum(1)
    if norm is not None:
        mix = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + eps) * norm.float()
    return mix.to(prefix.dtype)
