import pytest
import torch

from kimi_perf_kernels.moe_experts import moe_experts_reference, moe_fc1_situ, moe_fc2_combine
from tests.kernels.util import assert_close_bf16, poison


@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 8, 2, 48, 64), (4, 16, 4, 64, 100), (2, 6, 6, 32, 128)])
def test_moe_experts_match_reference(m, experts, k, inter, latent):
    gen = torch.Generator().manual_seed(m * 7 + experts)
    x = torch.randn(m, latent, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = (torch.randn(experts, latent, inter, generator=gen) / inter**0.5).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(m)]).int()
    weights = torch.softmax(torch.randn(m, k, generator=gen), -1)
    want_act, want_out = moe_experts_reference(x, w13, w2, ids, weights, (4.0, 25.0))
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    out = torch.empty(m, latent)
    poison(act, out)
    moe_fc1_situ(x, w13, ids, (4.0, 25.0), out=act)
    assert_close_bf16(act, want_act, ulps=2)
    moe_fc2_combine(want_act, w2, ids, weights, out=out)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
