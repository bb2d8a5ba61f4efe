"""The kernels' conversions round as a GPU does, under the interpreter too."""

import pytest
import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast, sigmoid


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, EMULATE_RNE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, cast(x, out_ptr.dtype.element_ty, EMULATE_RNE), mask=offs < n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cast_rounds_to_nearest_even_as_torch_does(dtype):
    """Every magnitude fp8 e4m3 holds, subnormals (below 2^-6) included, the carry into the
    exponent (-1.97 -> -2), and ties: the same bits as torch's conversion."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-12, 8.7, 4096, base=2)
    x = magnitudes * torch.randn(4096, generator=gen).sign()
    ties = torch.tensor([1.0625, 1.1875, 3 / 1024, 5 / 1024, 2.5 / 512, -1.97, 0.0])
    x = torch.cat([x, ties, -ties])
    out = torch.empty(len(x), dtype=dtype)
    _cast_kernel[(triton.cdiv(len(x), 256),)](x, out, len(x), EMULATE_RNE=INTERPRETED,
                                               BLOCK=256)
    want = x.to(dtype)
    assert torch.equal(out.view(torch.uint8 if dtype.itemsize == 1 else torch.int16),
                       want.view(torch.uint8 if dtype.itemsize == 1 else torch.int16))


@triton.jit
def _sigmoid_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, sigmoid(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_sigmoid_is_exact_far_out_and_never_overflows():
    import warnings

    x = torch.cat([torch.linspace(-200, 200, 4001), torch.tensor([-1e30, 1e30, 0.0])])
    out = torch.empty_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # numpy's overflow warning, under the interpreter
        _sigmoid_kernel[(triton.cdiv(len(x), 512),)](x, out, len(x), BLOCK=512)
    torch.testing.assert_close(out, torch.sigmoid(x), rtol=3e-7, atol=1e-30)   # 2 ulps


def test_fresh_buffers_start_poisoned_in_kernel_tests():
    """tests/kernels/conftest.py: what torch.empty gives a kernel's launcher is poison, so a
    missed store fails the comparison with the reference rather than leave a zero."""
    assert torch.isnan(torch.empty(3, 4)).all()
    assert torch.isnan(torch.empty_like(torch.ones(2), dtype=torch.bfloat16)).all()
    assert (torch.empty(5, dtype=torch.int32) == torch.iinfo(torch.int32).min).all()
    assert torch.empty(2, dtype=torch.bool).all()
