"""The gated MLA's output gate on its own: out[m, h·V + v] = o[h, m, v] · σ(g[m, h·V + v]),
after the standard path's bmm with W_UV (vLLM's compiled ``_gate_sigmoid_mul``). The bmm
leaves o head-major ([H, M, V]); this kernel reads it so and writes the token-major rows the
o_proj GEMM reads.

Grid (tokens, heads): one program per head of a token, V (128) values.
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


@triton.jit
def gate_sigmoid_mul_kernel(o_ptr, g_ptr, out_ptr, V, stride_oh, stride_om, stride_g,
                            stride_out, BLOCK_V: tl.constexpr, RNE: tl.constexpr,
                            PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    m = tl.program_id(0)
    h = tl.program_id(1)
    v = tl.arange(0, BLOCK_V)
    ok = v < V
    o = tl.load(o_ptr + h * stride_oh + m * stride_om + v, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + m * stride_g + h * V + v, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_out + h * V + v,
             cast(o * tl.sigmoid(g), out_ptr.dtype.element_ty, RNE), mask=ok)


def gate_sigmoid_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [H, M, V] (head-major, rows contiguous), gate [M, H·V] -> [M, H·V] in o's dtype."""
    H, M, V = o.shape
    if gate.shape != (M, H * V) or o.stride(2) != 1 or gate.stride(1) != 1:
        raise ValueError(f"gate_sigmoid_mul: o {tuple(o.shape)} and gate "
                         f"{tuple(gate.shape)} do not fit")
    check_layout("gate_sigmoid_mul", {}, {"o": o, "gate": gate})   # (one device)
    out = torch.empty(M, H * V, dtype=o.dtype, device=o.device)
    gate_sigmoid_mul_kernel[(M, H)](
        o, gate, out, V, o.stride(0), o.stride(1), gate.stride(0), out.stride(0),
        BLOCK_V=triton.next_power_of_2(V), RNE=INTERPRETED, num_warps=1, **launch_options())
    return out


def gate_sigmoid_mul_reference(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    H, M, V = o.shape
    rows = o.transpose(0, 1).reshape(M, H * V).float()
    return (rows * torch.sigmoid(gate.float())).to(o.dtype)
