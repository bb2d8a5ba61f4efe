import pytest
import torch

from kimi_perf_kernels.skinny_linear import skinny_linear, skinny_linear_reference
from tests.kernels.util import assert_close_bf16, poison

SITU = (4.0, 25.0)


# K 600: three K steps of the interpreter's 256 (and ten of a GPU's 64, or 19 of its 32)
@pytest.mark.parametrize("m", [1, 3, 8, 20, 70])   # GEMV, GEMM, and two row tiles (> 64)
@pytest.mark.parametrize(("n", "k"), [(96, 200), (257, 64), (40, 600)])
@pytest.mark.parametrize("fusion", ["plain", "norm", "situ", "residual", "fp32_out"])
def test_skinny_linear_matches_reference(m, n, k, fusion, tiles):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    rows = 2 * n if fusion == "situ" else n
    w = (torch.randn(rows, k, generator=gen) / k**0.5).bfloat16()
    kwargs = {}
    if fusion == "norm":
        kwargs["norm"] = 1 + 0.1 * torch.randn(k, generator=gen)
    if fusion == "situ":
        kwargs["situ"] = SITU
    if fusion == "residual":
        kwargs["residual"] = torch.randn(m, n, generator=gen).bfloat16()
    out_dtype = torch.float32 if fusion == "fp32_out" else torch.bfloat16
    out = torch.empty(m, n, dtype=out_dtype)
    poison(out)
    skinny_linear(x, w, out=out, **kwargs)
    expected = skinny_linear_reference(x, w, out_dtype=out_dtype, **kwargs)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    else:
        assert_close_bf16(out, expected, ulps=2)
