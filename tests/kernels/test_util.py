"""The tolerance every bf16 kernel test uses: what it lets through and what it does not."""

import pytest
import torch

from tests.kernels.util import assert_close_bf16


def test_bf16_tolerance_fails_a_kernel_off_by_a_percent_and_passes_rounding():
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(64, 512, generator=gen)
    assert_close_bf16(want.bfloat16(), want)                 # rounding to bf16: half an ulp
    assert_close_bf16((want * 1.003).bfloat16(), want)       # under an ulp everywhere
    with pytest.raises(AssertionError, match="more than one bf16 ulp of their own value"):
        assert_close_bf16((want * 1.01).bfloat16(), want)    # a percent: over an ulp
    with pytest.raises(AssertionError, match="elements differ"):
        assert_close_bf16((want * 1.05).bfloat16(), want)    # beyond the row's scale too
    near_zero = want.clone()
    near_zero[:, 0] += 0.01                                  # a few elements far off
    with pytest.raises(AssertionError, match="elements differ"):
        assert_close_bf16(near_zero.bfloat16(), want, ulps=0.5)
    missed = want.bfloat16()
    missed[3, 7] = float("nan")
    with pytest.raises(AssertionError, match="never written"):
        assert_close_bf16(missed, want)
