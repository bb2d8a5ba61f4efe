"""SiTU(gate) · up on a GEMM's [gate | up] output: the standard path's separate activation
kernel after the (shared or dense) experts' gate/up GEMM (vLLM's ``situ_and_mul``).

Grid (rows, column blocks); SiTU(g, u) = β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin), in fp32.
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
from kimi_perf_kernels.skinny_linear import situ_activation


@triton.jit
def situ_and_mul_kernel(x_ptr, out_ptr, INTER, stride_x, stride_out, BETA: tl.constexpr,
                        BETA_LINEAR: tl.constexpr, BLOCK: tl.constexpr, RNE: tl.constexpr,
                        PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    act = situ_activation(gate, up, BETA, BETA_LINEAR)
    tl.store(out_ptr + row * stride_out + cols, cast(act, out_ptr.dtype.element_ty, RNE),
             mask=ok)


def situ_and_mul(gate_up: torch.Tensor, situ: tuple[float, float]) -> torch.Tensor:
    """gate_up [M, 2I] -> [M, I] in gate_up's dtype."""
    M, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"situ_and_mul needs [M, 2I] with contiguous columns, got "
                         f"{tuple(gate_up.shape)}")
    inter = two_i // 2
    out = torch.empty(M, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 4096 if interpreter_tiles() else 1024
    situ_and_mul_kernel[(M, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BETA=situ[0],
        BETA_LINEAR=situ[1], BLOCK=block, RNE=INTERPRETED, num_warps=4, **launch_options())
    return out


def situ_and_mul_reference(gate_up: torch.Tensor, situ: tuple[float, float]) -> torch.Tensor:
    beta, beta_linear = situ
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
        beta_linear * torch.tanh(up / beta_linear))
    return act.to(gate_up.dtype)
