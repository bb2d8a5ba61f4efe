import pytest
import torch

from kimi_perf_kernels.moe_experts import (
    moe_experts_reference,
    moe_fc1_situ,
    moe_fc2_combine,
    moe_finalize,
    moe_route_fc1_situ,
)
from kimi_perf_kernels.router_topk import router_topk_reference
from kimi_perf_kernels.skinny_linear import skinny_linear_reference
from tests.kernels.util import assert_close_bf16, poison


# (the last: FC2's K loop over an intermediate of 160, three K steps of a GPU's 64)
@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 8, 2, 48, 64), (4, 16, 4, 64, 100), (2, 6, 6, 32, 128),
                          (2, 6, 3, 160, 96)])
def test_moe_experts_match_reference(m, experts, k, inter, latent, tiles):
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


@pytest.mark.parametrize("m", [2, 6, 70])  # the shared tiles' GEMV, tl.dot, two row tiles
def test_shared_experts_ride_in_the_routed_launches(m, tiles):
    """The shared experts' gate/up + SiTU (beside FC1) and down-projection (beside FC2) are
    skinny linears over their own inputs; the routed outputs stay as they are alone."""
    gen = torch.Generator().manual_seed(50 + m)
    experts, k, inter, latent, hidden, shared_inter = 12, 3, 40, 72, 96, 80
    x = torch.randn(m, latent, generator=gen)
    h = torch.randn(m, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = (torch.randn(experts, latent, inter, generator=gen) / inter**0.5).bfloat16()
    w_gate_up = (torch.randn(2 * shared_inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    w_down = (torch.randn(hidden, shared_inter, generator=gen) / shared_inter**0.5).bfloat16()
    logits = torch.randn(m, experts, generator=gen)
    bias = 0.2 * torch.randn(experts, generator=gen)
    situ = (4.0, 25.0)
    ids, weights = router_topk_reference(logits, bias, k, scale=2.0)
    want_act, want_out = moe_experts_reference(x, w13, w2, ids, weights, situ)
    want_shared_act = skinny_linear_reference(h, w_gate_up, situ=situ)
    want_shared = skinny_linear_reference(want_shared_act, w_down, out_dtype=torch.float32)

    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    shared_act = torch.empty(m, shared_inter, dtype=torch.bfloat16)
    both = torch.empty(m, latent + hidden)  # routed and shared side by side, as under TP
    poison(act, shared_act, both)
    _, got_ids, got_weights = moe_route_fc1_situ(x, w13, logits, bias, k, 2.0, situ, out=act,
                                                 shared=(h, w_gate_up, shared_act))
    assert torch.equal(got_ids, ids)
    assert_close_bf16(act, want_act, ulps=2)
    assert_close_bf16(shared_act, want_shared_act, ulps=2)
    moe_fc2_combine(want_act, w2, got_ids, got_weights, out=both[:, :latent],
                    shared=(want_shared_act, w_down, both[:, latent:]))
    torch.testing.assert_close(both[:, :latent], want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[:, latent:], want_shared, rtol=1e-4, atol=1e-4)


def test_shared_experts_that_do_not_fit_are_refused():
    x = torch.randn(2, 8)
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    logits, bias = torch.randn(2, 4), torch.zeros(4)
    with pytest.raises(ValueError, match="shared experts"):
        moe_route_fc1_situ(x, w13, logits, bias, 2, 1.0, (4.0, 25.0),
                           shared=(torch.randn(3, 8), torch.randn(10, 8), torch.empty(3, 5)))
    act, ids, weights = moe_route_fc1_situ(x, w13, logits, bias, 2, 1.0, (4.0, 25.0))
    with pytest.raises(ValueError, match="shared experts"):
        moe_fc2_combine(act, w2, ids, weights,
                        shared=(torch.randn(2, 6), torch.randn(8, 5), torch.empty(2, 8)))


def test_layouts_the_per_slot_kernels_would_misread_are_refused():
    """The per-slot kernels index ids, act, weights and per-slot outputs by their element and
    x, the logits and FC2's output by a row stride: a transposed or strided view of them is
    refused, not read wrong."""
    x = torch.randn(2, 8)
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    logits, bias = torch.randn(2, 4), torch.zeros(4)
    act, ids, weights = moe_route_fc1_situ(x, w13, logits, bias, 2, 1.0, (4.0, 25.0))
    with pytest.raises(ValueError, match="FC1: router logits must have contiguous rows"):
        moe_route_fc1_situ(x, w13, logits.t().contiguous().t(), bias, 2, 1.0, (4.0, 25.0))
    with pytest.raises(ValueError, match="FC1: ids must be contiguous"):
        moe_fc1_situ(x, w13, ids.t().contiguous().t(), (4.0, 25.0))
    with pytest.raises(ValueError, match="FC1: act must be contiguous"):
        moe_fc1_situ(x, w13, ids, (4.0, 25.0), out=torch.empty(2, 8, 4)[:, ::2])
    with pytest.raises(ValueError, match="FC2: act must be contiguous"):
        moe_fc2_combine(act.transpose(0, 1).contiguous().transpose(0, 1), w2, ids, weights)
    with pytest.raises(ValueError, match="FC2: weights must be contiguous"):
        moe_fc2_combine(act, w2, ids, weights.t().contiguous().t())
    with pytest.raises(ValueError, match="FC2: out must have contiguous rows"):
        moe_fc2_combine(act, w2, ids, weights, out=torch.empty(8, 2).t())
    with pytest.raises(ValueError, match="moe_finalize: per-slot outputs must be contiguous"):
        moe_finalize(torch.randn(2, 8, 2).transpose(1, 2), weights, torch.float32)
