"""M6: MLA value up-projection and sigmoid output gate in one kernel.

Grid (token blocks, heads, v blocks): for the BLOCK_M tokens of a block, ``o[h] = o_lat[h] ·
W_UV[h]`` ([BLOCK_M, kv_lora] × [kv_lora, BLOCK_V], a tensor-core dot tiled over kv_lora)
times ``σ(g[h])``, the gated-MLA output gate, written straight into the o_proj input. So a
head's W_UV is read once per block of 16 tokens, not once per token, and a batch of 1 has 24
programs at K3 TP8 (12 heads × 2 blocks of 64 values), not 12. When the attention was split
over the cache positions, each o_lat tile is first merged from the splits' partial outputs,
weighted by exp(lse_j - max lse) (the weights found once, before the tiles): the merge costs
no launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import (
    INTERPRETED,
    after_previous_kernel,
    cast,
    interpreter_tiles,
    launch_options,
)

BLOCK_M = 16   # tokens a program takes: the tensor cores' smallest tile


@triton.jit
def mla_uv_gate_kernel(olat_ptr, lse_ptr, wuv_ptr, g_ptr, out_ptr, M, H, stride_g, stride_out,
                       LORA: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, SPLITS: tl.constexpr,
                       DOT_FP32: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    h = tl.program_id(1)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    if SPLITS > 1:   # each row's merge: the largest lse and the sum of the splits' weights
        top = tl.full([BLOCK_M], -float("inf"), tl.float32)
        for j in range(0, SPLITS):
            top = tl.maximum(top, tl.load(lse_ptr + (j * M + rows) * H + h, mask=row_ok,
                                          other=0.0))
        total = tl.zeros([BLOCK_M], tl.float32)
        for j in range(0, SPLITS):
            total += tl.exp(tl.load(lse_ptr + (j * M + rows) * H + h, mask=row_ok,
                                    other=0.0) - top)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for l0 in range(0, LORA, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        if SPLITS > 1:
            o = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
            for j in range(0, SPLITS):
                row = (j * M + rows) * H + h
                weight = tl.exp(tl.load(lse_ptr + row, mask=row_ok, other=0.0) - top) / total
                o += weight[:, None] * tl.load(olat_ptr + row[:, None] * LORA + ls[None, :],
                                               mask=row_ok[:, None], other=0.0)
        else:
            o = tl.load(olat_ptr + (rows[:, None] * H + h) * LORA + ls[None, :],
                        mask=row_ok[:, None], other=0.0)
        w = tl.load(wuv_ptr + (h * LORA + ls[:, None]) * V + v[None, :])
        if DOT_FP32:
            acc += tl.dot(o.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(o.to(w.dtype), w)    # bf16 products (the merged o_lat rounded, as
                                               # the standard path's combine rounds it)
    gate = tl.load(g_ptr + rows[:, None] * stride_g + h * V + v[None, :], mask=row_ok[:, None],
                   other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + h * V + v[None, :],
             cast(acc * tl.sigmoid(gate), out_ptr.dtype.element_ty, RNE), mask=row_ok[:, None])


def mla_uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """o_lat [M, H, kv_lora], w_uv [H, kv_lora, v], gate [M, H*v] -> [M, H*v] (in o_lat's
    dtype, or ``dtype``). Or o_lat = ``mla_attention``'s split partials [splits, M, H,
    kv_lora] with their ``lse``, merged on the way in."""
    splits = o_lat.shape[0] if lse is not None else 1
    M, H, lora = o_lat.shape[-3:]
    v = w_uv.shape[-1]
    if out is None:
        out = torch.empty(M, H * v, dtype=dtype or o_lat.dtype, device=o_lat.device)
    block_v = v if interpreter_tiles() else min(64, v)
    mla_uv_gate_kernel[(triton.cdiv(M, BLOCK_M), H, triton.cdiv(v, block_v))](
        o_lat, lse if lse is not None else o_lat, w_uv, gate, out, M, H, gate.stride(0),
        out.stride(0), LORA=lora, V=v, BLOCK_M=BLOCK_M, BLOCK_V=block_v,
        BLOCK_L=lora if interpreter_tiles() else min(64, lora), SPLITS=splits,
        DOT_FP32=INTERPRETED, RNE=INTERPRETED, num_warps=4, **launch_options())
    return out


def mla_uv_gate_reference(o_lat, w_uv, gate):
    M = o_lat.shape[0]
    o = torch.einsum("mhl,hlv->mhv", o_lat.float(), w_uv.float()).reshape(M, -1)
    return (o * torch.sigmoid(gate.float())).to(o_lat.dtype)
