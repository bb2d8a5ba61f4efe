"""MXFP4 weights (OCP microscaling FP4, as K3's checkpoint stores its routed experts): each
value a 4-bit E2M1 code, two a byte (low nibble first: the even column), and one E8M0 scale
(2^(s-127)) per 32 consecutive values along a row: the experts' kernels stream 0.53 bytes a
weight where bf16 takes 2.

Hopper has no FP4 tensor cores, so the routed experts' GEMVs decode in registers (W4A16): a
tile's bytes come in as [rows, columns / 2], and ``mxfp4_pairs`` returns its even and odd
columns as fp32, exact (every E2M1 value times a power of two is an fp32); the caller takes
its activations at the even and odd columns to match, so nothing is interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GROUP = 32          # values per E8M0 scale
GROUP_BYTES = tl.constexpr(GROUP // 2)   # bytes of codes per scale, for the kernels
# E2M1 code -> value (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@dataclass(frozen=True)
class Mxfp4:
    """Stacked MXFP4 matrices: ``packed`` [..., N, K / 2] uint8, ``scale`` [..., N, K / 32]
    uint8. ``shape`` is the logical one, [..., N, K]; ``dtype`` the one the model computes in
    (a kernel's output from them comes in it)."""

    packed: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self) -> torch.Size:
        return torch.Size([*self.packed.shape[:-1], 2 * self.packed.shape[-1]])

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def check(self, what: str) -> None:
        """A ValueError unless the two parts fit: uint8, rows contiguous, a scale per 32."""
        k = self.shape[-1]
        if (self.packed.dtype != torch.uint8 or self.scale.dtype != torch.uint8
                or k % GROUP or self.scale.shape != (*self.packed.shape[:-1], k // GROUP)
                or self.packed.stride(-1) != 1 or self.scale.stride(-1) != 1):
            raise ValueError(f"{what}: MXFP4 weights need uint8 codes [..., N, K/2] and "
                             f"scales [..., N, K/32] with K a multiple of {GROUP}, rows "
                             f"contiguous (codes {tuple(self.packed.shape)} "
                             f"{self.packed.dtype}, scales {tuple(self.scale.shape)} "
                             f"{self.scale.dtype})")


@triton.jit
def e2m1(code):
    """4-bit E2M1 codes (in the low bits of an integer) -> fp32."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    # exponent 0: subnormal (0 or 0.5); else (1 + m/2) · 2^(e-1)
    magnitude = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * ((1 << e) // 2).to(tl.float32))
    return tl.where((c & 8) != 0, -magnitude, magnitude)


@triton.jit
def mxfp4_pairs(packed_ptr, scale_ptr, rows, rows_ok, k0, KDIM, stride_row, stride_scale_row,
                HALF: tl.constexpr):
    """Of rows ``rows`` of an MXFP4 matrix of KDIM columns, the tile of columns
    [k0, k0 + 2·HALF) (k0 even) as its even and odd columns, each [rows, HALF] fp32; columns
    past KDIM are 0."""
    j = k0 // 2 + tl.arange(0, HALF)       # byte columns
    ok = rows_ok[:, None] & (j[None, :] < KDIM // 2)
    codes = tl.load(packed_ptr + rows[:, None] * stride_row + j[None, :], mask=ok, other=0)
    s = tl.load(scale_ptr + rows[:, None] * stride_scale_row + j[None, :] // GROUP_BYTES,
                mask=ok, other=127)
    # E8M0 -> fp32 by its bits: 2^(s-127) is an fp32 with exponent field s (s = 0, 2^-127,
    # reads as 0; no checkpoint scales a group of weights that small)
    factor = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return e2m1(codes & 0xF) * factor, e2m1(codes >> 4) * factor


def dequantize(w: Mxfp4) -> torch.Tensor:
    """The fp32 values of ``w`` (the kernels' reference)."""
    codes = torch.stack([w.packed & 0x0F, w.packed >> 4], dim=-1).flatten(-2).long()
    values = E2M1.to(w.device)[codes]
    factors = torch.pow(2.0, w.scale.float() - 127.0).repeat_interleave(GROUP, dim=-1)
    return values * factors   # (whole groups: ``Mxfp4.check`` refuses any other K)


def quantize(w: torch.Tensor) -> Mxfp4:
    """``w`` [..., N, K] rounded to MXFP4 (``dtype``: w's): per group of 32 the power-of-two
    scale that puts its largest magnitude at or below E2M1's 6, then each value to the
    nearest E2M1 code."""
    *lead, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"MXFP4: {k} columns are not groups of {GROUP}")
    groups = w.float().reshape(*lead, n, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    # the nearest magnitude's code (a tie to the smaller): the midpoints between them bound it
    magnitudes = E2M1[:8].to(w.device)
    code = torch.bucketize(scaled.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2).to(torch.uint8)
    code = (code | ((scaled < 0).to(torch.uint8) << 3)).reshape(*lead, n, k)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return Mxfp4(packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous(),
                 w.dtype if w.dtype.is_floating_point else torch.bfloat16)
