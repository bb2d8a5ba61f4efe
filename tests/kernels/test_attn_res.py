import pytest
import torch

from kimi_perf_kernels.attn_res import attn_res, attn_res_reference
from tests.kernels.util import assert_close_bf16

CASES = [  # (rows, hidden, blocks written, write index, has delta, reset, has norm)
    (1, 256, 0, 0, False, False, True),     # layer 0: the prefix is the embedding
    (3, 256, 2, -1, True, False, True),
    (2, 300, 3, 2, True, False, True),      # hidden not a power of two
    (4, 512, 1, -1, True, True, True),      # block boundary: the prefix resets
    (2, 7168, 8, -1, True, False, False),   # K3 width, final mix without a norm
]


@pytest.mark.parametrize(("rows", "hidden", "n_blocks", "write", "has_delta", "reset",
                          "has_norm"), CASES)
def test_attn_res_matches_reference(rows, hidden, n_blocks, write, has_delta, reset,
                                    has_norm):
    gen = torch.Generator().manual_seed(hidden + rows)
    prefix = torch.randn(rows, hidden, generator=gen).bfloat16()
    delta = torch.randn(rows, hidden, generator=gen).bfloat16() if has_delta else None
    blocks = torch.randn(rows, 9, hidden, generator=gen).bfloat16()
    qk = torch.randn(hidden, generator=gen) / hidden**0.5
    norm = 1 + 0.1 * torch.randn(hidden, generator=gen) if has_norm else None
    n = n_blocks if write < 0 else write
    p_ref, b_ref = prefix.clone(), blocks.clone()
    expected = attn_res_reference(p_ref, delta, b_ref, n, write, qk, norm, 1e-5, reset)
    out = attn_res(prefix, delta, blocks, n, write, qk, norm, 1e-5, reset)
    assert_close_bf16(out, expected, ulps=4)
    assert_close_bf16(prefix, p_ref, ulps=1)
    assert_close_bf16(blocks, b_ref, ulps=1)
