import pytest
import torch

from kimi_perf_kernels.moe_experts import moe_experts_reference
from kimi_perf_kernels.moe_grouped_fc1 import expert_slots_reference
from kimi_perf_kernels.moe_grouped_fc2 import moe_grouped_fc2, moe_grouped_fc2_reference
from kimi_perf_kernels.router_topk import router_topk, router_topk_reference
from kimi_perf_kernels.skinny_linear import skinny_linear_reference
from tests.kernels.util import poison


# (experts picked by one slot or none, by 35 tokens: chunks of slots; 1,024 slots: ids
# scanned in several passes; widths no multiple of a GPU's tiles, 300: three column blocks
# of a GPU's 128)
@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 16, 4, 48, 100), (5, 8, 2, 160, 64), (70, 6, 3, 40, 72),
                          (64, 40, 16, 32, 96), (3, 8, 4, 48, 300)])
def test_grouped_fc2_matches_reference(m, experts, k, inter, latent, tiles):
    """The routing launch zeroes the rows (poisoned here) that each expert's share is then
    added into."""
    gen = torch.Generator().manual_seed(m + experts)
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = (torch.randn(experts, latent, inter, generator=gen) / inter**0.5).bfloat16()
    logits = torch.randn(m, experts, generator=gen)
    bias = 0.2 * torch.randn(experts, generator=gen)
    want_ids, want_weights = router_topk_reference(logits, bias, k, scale=2.0)
    act, want = moe_experts_reference(torch.randn(m, latent, generator=gen), w13, w2, want_ids,
                                      want_weights, (4.0, 25.0))
    out = torch.empty(m, latent)
    poison(out)
    ids, weights = router_topk(logits, bias, k, 2.0, zero=out)
    assert torch.equal(ids, want_ids) and (out == 0).all()
    lists, counts = expert_slots_reference(ids, experts)
    for e, n in enumerate(counts.tolist()):
        lists[e, n:] = -(2**31)      # past each count: poison, which FC2 must not read
    moe_grouped_fc2(act, w2, (lists, counts), weights, out)
    grouped = moe_grouped_fc2_reference(act, w2, expert_slots_reference(ids, experts), weights)
    torch.testing.assert_close(out, grouped, rtol=1e-5, atol=1e-5)   # its own math, grouped
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-5)  # = the per-slot combine


def test_shared_experts_ride_in_the_grouped_launch(tiles):
    gen = torch.Generator().manual_seed(4)
    m, experts, k, inter, latent, hidden, shared_inter = 6, 12, 3, 40, 72, 96, 80
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = (torch.randn(experts, latent, inter, generator=gen) / inter**0.5).bfloat16()
    w_down = (torch.randn(hidden, shared_inter, generator=gen) / shared_inter**0.5).bfloat16()
    shared_act = torch.randn(m, shared_inter, generator=gen).bfloat16()
    ids, weights = router_topk_reference(torch.randn(m, experts, generator=gen),
                                         torch.zeros(experts), k)
    act, want = moe_experts_reference(torch.randn(m, latent, generator=gen), w13, w2, ids,
                                      weights, (4.0, 25.0))
    both = torch.empty(m, latent + hidden)   # routed and shared side by side, as in the path
    poison(both)
    both[:, :latent] = 0
    moe_grouped_fc2(act, w2, expert_slots_reference(ids, experts), weights, both[:, :latent],
                    shared=(shared_act, w_down, both[:, latent:]))
    torch.testing.assert_close(both[:, :latent], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[:, latent:], skinny_linear_reference(
        shared_act, w_down, out_dtype=torch.float32), rtol=1e-4, atol=1e-4)


def test_what_would_read_or_write_out_of_bounds_is_refused():
    act, w2 = torch.randn(2, 2, 4).bfloat16(), torch.randn(3, 8, 4).bfloat16()
    slots = expert_slots_reference(torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), 3)
    weights = torch.ones(2, 2)
    with pytest.raises(ValueError, match="the slots of 3 experts"):
        moe_grouped_fc2(act, w2, (slots.lists[:, :1], slots.counts), weights, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="does not fit"):
        moe_grouped_fc2(act, torch.randn(3, 8, 5).bfloat16(), slots, weights, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="out must be fp32"):
        moe_grouped_fc2(act, w2, slots, weights, torch.zeros(2, 8).bfloat16())
    with pytest.raises(ValueError, match="zero must be"):
        router_topk(torch.randn(2, 3), torch.zeros(3), 2, zero=torch.zeros(3, 8))
