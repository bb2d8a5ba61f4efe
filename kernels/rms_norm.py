"""RMSNorm of rows, one or two tensors in one launch: the standard path's separate norms
(vLLM's ``fused_q_kv_rmsnorm`` takes the gated MLA's q_c and kv_c together; the latent
RMSNorm of the MoE tail takes one).

Grid (rows, tensors): a program normalises one row of one tensor, the whole row in one block
(≤ 8192 values: the hidden size is the widest), in fp32, written in the output's dtype.
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
def _norm_row(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, RNE: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / N + eps) * w
    tl.store(out_ptr + offs, cast(y, out_ptr.dtype.element_ty, RNE), mask=ok)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, x2_ptr, w2_ptr, out2_ptr,
                    N2, stride_x2, stride_out2, eps, BLOCK: tl.constexpr, RNE: tl.constexpr,
                    PDL: tl.constexpr = False):
    after_previous_kernel(PDL)
    row = tl.program_id(0)
    if tl.program_id(1) == 0:
        _norm_row(x_ptr + row * stride_x, w_ptr, out_ptr + row * stride_out, N, eps, BLOCK,
                  RNE)
    else:
        _norm_row(x2_ptr + row * stride_x2, w2_ptr, out2_ptr + row * stride_out2, N2, eps,
                  BLOCK, RNE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None,
             second: tuple[torch.Tensor, torch.Tensor] | None = None):
    """x [M, N] (rows may be strided) -> RMSNorm(x) · weight in ``out_dtype`` (x's dtype by
    default). ``second=(x2 [M, N2], weight2)`` normalises a second tensor in the same launch;
    then both outputs are returned."""
    tensors = [(x, weight)] + ([second] if second is not None else [])
    outs = []
    for t, w in tensors:
        if t.dim() != 2 or t.stride(1) != 1 or w.shape != (t.shape[1],):
            raise ValueError(f"rms_norm needs rows [M, N] with contiguous columns and a "
                             f"weight [N]; got {tuple(t.shape)} and {tuple(w.shape)}")
        if t.shape[0] != x.shape[0]:
            raise ValueError("rms_norm: both tensors need the same number of rows")
        outs.append(torch.empty(t.shape, dtype=out_dtype or t.dtype, device=t.device))
    (x2, w2), out2 = (tensors[-1], outs[-1])
    check_layout("rms_norm", {"weight": weight, "weight2": w2}, {"x": x, "x2": x2})
    rms_norm_kernel[(x.shape[0], len(tensors))](
        x, weight, outs[0], x.shape[1], x.stride(0), outs[0].stride(0), x2, w2, out2,
        x2.shape[1], x2.stride(0), out2.stride(0), eps,
        BLOCK=triton.next_power_of_2(max(t.shape[1] for t, _ in tensors)), RNE=INTERPRETED,
        num_warps=8 if max(t.shape[1] for t, _ in tensors) > 2048 else 4, **launch_options())
    return (outs[0], outs[1]) if second is not None else outs[0]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(out_dtype or x.dtype)
