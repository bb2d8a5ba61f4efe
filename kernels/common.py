"""Helpers shared by the kernels (device functions, not kernels)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter (TRITON_INTERPRET=1, the CPU) differs from a GPU in ways the kernels
# work around: bf16 tl.dot is wrong there (products are taken in fp32); fp32 -> bf16
# conversion truncates where a GPU rounds to nearest even; fp32 -> fp8 e4m3 rounding drops
# the carry into the exponent (-1.97 becomes -1.0). Both conversions are emulated: the value
# is first rounded to nearest even in fp32 bits, so the conversion itself is exact.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def cast(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even into bf16 even under the interpreter."""
    if EMULATE_RNE and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    if EMULATE_RNE and dtype == tl.float8e4nv:  # 3 mantissa bits (normal range)
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
