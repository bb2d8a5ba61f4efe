"""M6: MLA value up-projection and sigmoid output gate in one kernel.

Grid (tokens, heads): ``o[h] = o_lat[h] · W_UV[h]`` ([kv_lora] × [kv_lora, v], tiled over
kv_lora) times ``σ(g[h])``, the gated-MLA output gate, written straight into the o_proj input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast


@triton.jit
def mla_uv_gate_kernel(olat_ptr, wuv_ptr, g_ptr, out_ptr, H, stride_g, stride_out,
                       LORA: tl.constexpr, V: tl.constexpr, BLOCK_L: tl.constexpr,
                       RNE: tl.constexpr):
    m = tl.program_id(0)
    h = tl.program_id(1)
    v = tl.arange(0, V)
    acc = tl.zeros([V], tl.float32)
    for l0 in range(0, LORA, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        o = tl.load(olat_ptr + (m * H + h) * LORA + ls).to(tl.float32)
        w = tl.load(wuv_ptr + (h * LORA + ls[:, None]) * V + v[None, :]).to(tl.float32)
        acc += tl.sum(o[:, None] * w, axis=0)
    gate = tl.load(g_ptr + m * stride_g + h * V + v).to(tl.float32)
    tl.store(out_ptr + m * stride_out + h * V + v,
             cast(acc * tl.sigmoid(gate), out_ptr.dtype.element_ty, RNE))


def mla_uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """o_lat [M, H, kv_lora], w_uv [H, kv_lora, v], gate [M, H*v] -> [M, H*v]."""
    M, H, lora = o_lat.shape
    v = w_uv.shape[-1]
    if out is None:
        out = torch.empty(M, H * v, dtype=o_lat.dtype, device=o_lat.device)
    mla_uv_gate_kernel[(M, H)](o_lat, w_uv, gate, out, H, gate.stride(0), out.stride(0),
                               LORA=lora, V=v, BLOCK_L=lora if INTERPRETED else min(64, lora),
                               RNE=INTERPRETED, num_warps=4)
    return out


def mla_uv_gate_reference(o_lat, w_uv, gate):
    M = o_lat.shape[0]
    o = torch.einsum("mhl,hlv->mhv", o_lat.float(), w_uv.float()).reshape(M, -1)
    return (o * torch.sigmoid(gate.float())).to(o_lat.dtype)
