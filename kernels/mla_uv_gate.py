"""M6: MLA value up-projection and sigmoid output gate in one kernel.

Grid (tokens, heads): ``o[h] = o_lat[h] · W_UV[h]`` ([kv_lora] × [kv_lora, v], tiled over
kv_lora) times ``σ(g[h])``, the gated-MLA output gate, written straight into the o_proj input.
When the attention was split over the cache positions, each o_lat tile is first merged from
the splits' partial outputs (``mla_attention.combine_splits``): the merge costs no launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast, interpreter_tiles
from kimi_perf_kernels.mla_attention import combine_splits


@triton.jit
def mla_uv_gate_kernel(olat_ptr, lse_ptr, wuv_ptr, g_ptr, out_ptr, M, H, stride_g, stride_out,
                       LORA: tl.constexpr, V: tl.constexpr, BLOCK_L: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, RNE: tl.constexpr):
    m = tl.program_id(0)
    h = tl.program_id(1)
    v = tl.arange(0, V)
    acc = tl.zeros([V], tl.float32)
    for l0 in range(0, LORA, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        if SPLITS > 1:
            o = combine_splits(olat_ptr, lse_ptr, m, h, M, H, ls, LORA, SPLITS, BLOCK_SPLITS)
        else:
            o = tl.load(olat_ptr + (m * H + h) * LORA + ls).to(tl.float32)
        w = tl.load(wuv_ptr + (h * LORA + ls[:, None]) * V + v[None, :]).to(tl.float32)
        acc += tl.sum(o[:, None] * w, axis=0)
    gate = tl.load(g_ptr + m * stride_g + h * V + v).to(tl.float32)
    tl.store(out_ptr + m * stride_out + h * V + v,
             cast(acc * tl.sigmoid(gate), out_ptr.dtype.element_ty, RNE))


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
    mla_uv_gate_kernel[(M, H)](o_lat, lse if lse is not None else o_lat, w_uv, gate, out, M, H,
                               gate.stride(0), out.stride(0), LORA=lora, V=v, SPLITS=splits,
                               BLOCK_L=lora if interpreter_tiles() else min(64, lora),
                               BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)),
                               RNE=INTERPRETED, num_warps=4)
    return out


def mla_uv_gate_reference(o_lat, w_uv, gate):
    M = o_lat.shape[0]
    o = torch.einsum("mhl,hlv->mhv", o_lat.float(), w_uv.float()).reshape(M, -1)
    return (o * torch.sigmoid(gate.float())).to(o_lat.dtype)
