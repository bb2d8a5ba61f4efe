import pytest
import torch

from kimi_perf_kernels.moe_experts import (
    moe_experts_reference,
    moe_fc2_combine,
    moe_route_fc1_situ,
)
from kimi_perf_kernels.router_topk import router_topk_reference
from tests.kernels.util import assert_close_bf16, poison


@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 8, 2, 48, 64), (4, 16, 4, 64, 100), (2, 6, 6, 32, 128)])
def test_moe_experts_match_reference(m, experts, k, inter, latent):
    gen = torch.Generator().manual_seed(m * 7 + experts)
    x = torch.randn(m, latent, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = (torch.randn(experts, latent, inter, generator=gen) / inter**0.5).bfloat16()
    logits = torch.randn(m, experts + 3, generator=gen)[:, :experts]  # the router GEMV's view
    bias = 0.2 * torch.randn(experts, generator=gen)
    want_ids, want_weights = router_topk_reference(logits, bias, k, scale=2.0)
    want_act, want_out = moe_experts_reference(x, w13, w2, want_ids, want_weights, (4.0, 25.0))
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    out = torch.empty(m, latent)
    poison(act, out)
    _, ids, weights = moe_route_fc1_situ(x, w13, logits, bias, k, 2.0, (4.0, 25.0), out=act)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    assert_close_bf16(act, want_act, ulps=2)
    moe_fc2_combine(want_act, w2, ids, weights, out=out)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
