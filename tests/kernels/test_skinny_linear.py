import pytest
import torch

from kimi_perf_kernels.skinny_linear import GEMV_MAX_M, skinny_linear, skinny_linear_reference
from tests.kernels.util import assert_close_bf16, poison

SITU = (4.0, 25.0)


# K 600: three K steps of the interpreter's 256 (and five of a GPU's 128, or ten of its 64
# with SiTU)
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
    # (the GEMM rounds x · norm to bf16 for its dot, as the reference does with dot_dtype)
    expected = skinny_linear_reference(x, w, out_dtype=out_dtype, **kwargs,
                                       dot_dtype=w.dtype if m > GEMV_MAX_M else None)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    else:
        assert_close_bf16(out, expected, ulps=2)


@pytest.mark.parametrize("m", [1, 3, 8, 70])
def test_the_latent_up_projection_as_the_path_launches_it(m, tiles):
    """The MoE's latent tail (``latent_up_proj``): fp32 routed rows and fp32 shared rows, two
    column slices of one buffer (FC2's, all-reduced as one), normed, up-projected and added
    in one launch, out in bf16."""
    gen = torch.Generator().manual_seed(m)
    k, n = 96, 200
    moe_out = torch.randn(m, k + n, generator=gen)
    routed, shared = moe_out[:, :k], moe_out[:, k:]
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    norm = 1 + 0.1 * torch.randn(k, generator=gen)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    poison(out)
    skinny_linear(routed, w, norm=norm, residual=shared, out=out)
    expected = skinny_linear_reference(routed, w, norm=norm, residual=shared,
                                       out_dtype=torch.bfloat16,
                                       dot_dtype=w.dtype if m > GEMV_MAX_M else None)
    assert_close_bf16(out, expected, ulps=2)


def test_the_weight_prefetch_before_a_pdl_wait_shares_its_budget_in_whole_lines():
    """``PREFETCH_K``: the budget over the launch's rows of W (padded to whole column blocks;
    SiTU's gate and up rows both), in 128-byte lines, rounded down to a power of two of them,
    never past the next power of two of K (the lines beyond K are masked); none for a budget
    short of a line a row."""
    from kimi_perf_kernels.skinny_linear import CHECKED_PREFETCH_BYTES, prefetch_columns

    budget = CHECKED_PREFETCH_BYTES      # 8 MB
    assert prefetch_columns(0, 7168, 6288, 32, 2, False) == 0
    # K3 TP8 o_proj (7168 x 1536): 585 columns fit, 9 lines, 8 of them: 7.3 MB
    assert prefetch_columns(budget, 1536, 7168, 32, 2, False) == 512
    assert prefetch_columns(budget, 7168, 768, 32, 2, True) == 2048     # shared gate/up
    assert prefetch_columns(budget, 7168, 768, 32, 2, False) == 4096
    assert prefetch_columns(1 << 40, 7168, 6288, 32, 2, False) == 8192
    assert prefetch_columns(budget, 64, 16, 32, 4, False) == 64          # all of K, fp32 lines
    assert prefetch_columns(63 * 32 * 2, 7168, 32, 32, 2, False) == 0    # under a line a row
    for given, k, n, situ in ((budget, 1536, 7168, False), (3 << 20, 7168, 6288, True)):
        columns = prefetch_columns(given, k, n, 32, 2, situ)
        assert columns % 64 == 0 and (columns // 64) & (columns // 64 - 1) == 0
        assert columns * 2 * 32 * -(-n // 32) * (2 if situ else 1) <= given
