import pytest
import torch

from kimi_perf_kernels.moe_experts import moe_experts_reference
from kimi_perf_kernels.moe_grouped_fc1 import expert_slots_reference, moe_grouped_fc1_situ
from kimi_perf_kernels.router_topk import router_topk_reference
from kimi_perf_kernels.skinny_linear import skinny_linear_reference
from tests.kernels.util import assert_close_bf16, poison


# (experts picked by one slot or none, by 35 tokens: chunks of slots; 1,024 slots: ids
# scanned in several passes; intermediates and latents no multiple of a GPU's tiles)
@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 16, 4, 48, 100), (5, 8, 2, 160, 64), (70, 6, 3, 40, 72),
                          (64, 40, 16, 32, 96)])
def test_grouped_fc1_matches_reference(m, experts, k, inter, latent, tiles):
    gen = torch.Generator().manual_seed(m + experts)
    x = torch.randn(m, latent, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = torch.zeros(experts, latent, inter).bfloat16()      # FC2 is not this kernel's
    logits = torch.randn(m, experts, generator=gen)
    ids, weights = router_topk_reference(logits, torch.zeros(experts), k)
    want, _ = moe_experts_reference(x, w13, w2, ids, weights, (4.0, 25.0))
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    poison(act)
    _, slots = moe_grouped_fc1_situ(x, w13, ids, (4.0, 25.0), out=act)
    assert_close_bf16(act, want, ulps=2)
    # each expert's slots, in order, for FC2 (entries past the count are not read)
    lists, counts = expert_slots_reference(ids, experts)
    assert torch.equal(slots.counts, counts)
    for e in range(experts):
        assert torch.equal(slots.lists[e, : counts[e]], lists[e, : counts[e]])
    assert counts.max() > 1 or m == 1        # the cases group slots, or pick each once


def test_shared_experts_ride_in_the_grouped_launch(tiles):
    gen = torch.Generator().manual_seed(3)
    m, experts, k, inter, latent, hidden, shared_inter = 6, 12, 3, 40, 72, 96, 80
    x = torch.randn(m, latent, generator=gen)
    h = torch.randn(m, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w_gate_up = (torch.randn(2 * shared_inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    ids, weights = router_topk_reference(torch.randn(m, experts, generator=gen),
                                         torch.zeros(experts), k)
    want, _ = moe_experts_reference(x, w13, torch.zeros(experts, latent, inter).bfloat16(),
                                    ids, weights, (4.0, 25.0))
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    shared_act = torch.empty(m, shared_inter, dtype=torch.bfloat16)
    poison(act, shared_act)
    moe_grouped_fc1_situ(x, w13, ids, (4.0, 25.0), out=act, shared=(h, w_gate_up, shared_act))
    assert_close_bf16(act, want, ulps=2)
    assert_close_bf16(shared_act, skinny_linear_reference(h, w_gate_up, situ=(4.0, 25.0)),
                      ulps=2)


def test_what_would_read_or_write_out_of_bounds_is_refused():
    x, w13 = torch.randn(2, 8), torch.randn(4, 16, 8).bfloat16()
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous int32"):
        moe_grouped_fc1_situ(x, w13, ids.long(), (4.0, 25.0))
    with pytest.raises(ValueError, match=r"latent \(3, 8\) .* do not fit 2 tokens"):
        moe_grouped_fc1_situ(torch.randn(3, 8), w13, ids, (4.0, 25.0))
    with pytest.raises(ValueError, match="do not fit"):
        moe_grouped_fc1_situ(torch.randn(2, 6), w13, ids, (4.0, 25.0))
    with pytest.raises(ValueError, match="out must be"):
        moe_grouped_fc1_situ(x, w13, ids, (4.0, 25.0), out=torch.empty(2, 2, 4))
