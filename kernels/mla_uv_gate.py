"""M6: MLA value up-projection and sigmoid output gate in one kernel.

Grid (token blocks, heads, v blocks): for the BLOCK_M tokens of a block, ``o[h] = o_lat[h] ·
W_UV[h]`` ([BLOCK_M, kv_lora] × [kv_lora, BLOCK_V], a tensor-core dot tiled over kv_lora)
times ``σ(g[h])``, the gated-MLA output gate, written straight into the o_proj input. So a
head's W_UV is read once per block of 16 tokens, not once per token, and a batch of 1 has 24
programs at K3 TP8 (12 heads × 2 blocks of 64 values), not 12.

When the attention was split over the cache positions, the splits' partial outputs are merged
here, at no launch of their own. The product is linear in o_lat, so the partials go through
the dot as rows of their own, (split, token) pairs, and their products are merged after it,
weighted by exp(lse_j - max lse): each o_lat tile is one load feeding the dot, which Triton
pipelines as it does the single split's. (A merge before the dot, a loop over the splits per
tile, put one load's latency after another: 8 x 64 of them at 64 splits.) A program then
takes fewer tokens, 64 pairs at most: one token of 64 splits, 16 tokens of 4.
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

BLOCK_M = 16   # tokens a program takes: the tensor cores' smallest tile
PAIRS = 64     # (split, token) rows of a program's dot when it merges split partials


def merge_block(splits: int) -> int:
    """Tokens a program takes when it merges ``splits`` partial outputs: 16, or fewer where
    the splits (padded to a power of two) times 16 would pass 64 rows (a batch of 1 at 64
    splits: one token, its 64 partials the dot's rows)."""
    return max(1, min(BLOCK_M, PAIRS // triton.next_power_of_2(splits)))


@triton.jit
def mla_uv_gate_kernel(olat_ptr, lse_ptr, wuv_ptr, g_ptr, out_ptr, M, H, stride_g, stride_out,
                       LORA: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, RNE: tl.constexpr,
                       PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    h = tl.program_id(1)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    # The dot's rows: (split j, token) pairs, j-major; one split: the tokens themselves.
    p = tl.arange(0, BLOCK_SPLITS * BLOCK_M)
    j = p // BLOCK_M
    pair_token = tl.program_id(0) * BLOCK_M + p % BLOCK_M
    pair_ok = (j < SPLITS) & (pair_token < M)
    line = (j * M + pair_token) * H + h     # the pair's row of o_lat (and of lse)
    acc = tl.zeros([BLOCK_SPLITS * BLOCK_M, BLOCK_V], tl.float32)
    for l0 in range(0, LORA, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        o = tl.load(olat_ptr + line[:, None] * LORA + ls[None, :], mask=pair_ok[:, None],
                    other=0.0)
        w = tl.load(wuv_ptr + (h * LORA + ls[:, None]) * V + v[None, :])
        acc = mma(o, w.to(o.dtype), acc, DOT_FP32)   # bf16 o_lat, or fp32 partials (tf32)
    if SPLITS > 1:
        # o · W_UV is linear in o: the partials' products, weighted by exp(lse_j - max lse)
        # and summed over the splits, are the merged o_lat's product.
        lse = tl.reshape(tl.load(lse_ptr + line, mask=pair_ok, other=-float("inf")),
                         [BLOCK_SPLITS, BLOCK_M])
        top = tl.max(lse, axis=0)
        weight = tl.exp(lse - tl.where(top == -float("inf"), 0.0, top)[None, :])
        total = tl.sum(weight, axis=0)
        weight = weight / tl.where(total > 0, total, 1.0)[None, :]   # no row: no weight
        acc = tl.sum(tl.reshape(acc, [BLOCK_SPLITS, BLOCK_M, BLOCK_V]) * weight[:, :, None],
                     axis=0)
    gate = tl.load(g_ptr + rows[:, None] * stride_g + h * V + v[None, :], mask=row_ok[:, None],
                   other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + h * V + v[None, :],
             cast(acc * tl.sigmoid(gate), out_ptr.dtype.element_ty, RNE), mask=row_ok[:, None])


def mla_uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """o_lat [M, H, kv_lora], w_uv [H, kv_lora, v], gate [M, H*v] -> [M, H*v] (in o_lat's
    dtype, or ``dtype``). Or o_lat = ``mla_attention``'s split partials [splits, M, H,
    kv_lora] with their ``lse``, merged on the way out."""
    if o_lat.dim() != (3 if lse is None else 4):
        raise ValueError(f"mla_uv_gate: o_lat {tuple(o_lat.shape)} is not [M, H, kv_lora]"
                         + (" (lse given: [splits, M, H, kv_lora])" if lse is not None else ""))
    splits = o_lat.shape[0] if lse is not None else 1
    M, H, lora = o_lat.shape[-3:]
    v = w_uv.shape[-1]
    check_whole_tiles("mla_uv_gate", kv_lora=lora, v=v)
    if tuple(w_uv.shape) != (H, lora, v) or tuple(gate.shape) != (M, H * v):
        raise ValueError(f"mla_uv_gate: w_uv {tuple(w_uv.shape)} and gate {tuple(gate.shape)} "
                         f"for o_lat of {M} rows, {H} heads, kv_lora {lora}")
    check_layout("mla_uv_gate", {"o_lat": o_lat, "w_uv": w_uv, "lse": lse},
                 {"gate": gate, "out": out}, {"lse": (splits, M, H), "out": (M, H * v)},
                 {"lse": (torch.float32,)})
    if out is None:
        out = torch.empty(M, H * v, dtype=dtype or o_lat.dtype, device=o_lat.device)
    block_v = v if interpreter_tiles() else min(64, v)
    block_m = merge_block(splits) if splits > 1 else BLOCK_M
    # BLOCK_L 64 of K3's 512 latent columns a pass: with 4 or more splits the partials' and
    # W_UV's tiles take 80 KiB of shared memory on sm_90a, two programs an SM; 128 takes 160.
    mla_uv_gate_kernel[(triton.cdiv(M, block_m), H, triton.cdiv(v, block_v))](
        o_lat, lse if lse is not None else o_lat, w_uv, gate, out, M, H, gate.stride(0),
        out.stride(0), LORA=lora, V=v, BLOCK_M=block_m, BLOCK_V=block_v,
        BLOCK_L=lora if interpreter_tiles() else min(64, lora), SPLITS=splits,
        BLOCK_SPLITS=triton.next_power_of_2(splits), DOT_FP32=INTERPRETED, RNE=INTERPRETED,
        num_warps=4, **launch_options())
    return out


def mla_uv_gate_reference(o_lat, w_uv, gate):
    M = o_lat.shape[0]
    o = torch.einsum("mhl,hlv->mhv", o_lat.float(), w_uv.float()).reshape(M, -1)
    return (o * torch.sigmoid(gate.float())).to(o_lat.dtype)
