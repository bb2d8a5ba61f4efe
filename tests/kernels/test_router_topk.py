import pytest
import torch

from kimi_perf_kernels.router_topk import router_topk, router_topk_reference

# router_topk ranks a token's experts with ``_rank_experts``, a program per token: the ranking
# the routed experts' first kernel runs in its prologue (``routed_slot``, a program per
# (token, slot): tested through moe_route_fc1_situ in test_moe_experts.py).


@pytest.mark.parametrize(("m", "e", "k"), [(1, 16, 4), (1, 896, 6), (3, 100, 16), (2, 16, 1),
                                          (1, 1, 1), (2, 9, 7), (2, 896, 16)])   # (K3: 16 of 896)
def test_router_topk_matches_reference(m, e, k):
    gen = torch.Generator().manual_seed(m + e + k)
    logits = torch.randn(m, e + 7, generator=gen)[:, :e]   # a strided view, like the GEMV's
    # (E = 896 on one token only: the interpreter ranks 1024 lanes per program slowly.)
    bias = 0.3 * torch.randn(e, generator=gen)
    ids, weights = router_topk(logits, bias, k, scale=2.5)
    want_ids, want_weights = router_topk_reference(logits, bias, k, scale=2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((m,), 2.5), rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lower_expert_and_negative_scores_rank_right():
    """Equal biased scores rank by expert id; a large negative bias sinks an expert (the
    int64 keys must order negative floats correctly too)."""
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0.0, -5.0, 0.0, 0.2, -3.0, 0.0, -5.0, 0.1])
    ids, weights = router_topk(logits, bias, 8)
    assert ids[0].tolist() == [3, 7, 0, 2, 5, 4, 1, 6]
    torch.testing.assert_close(weights, torch.full((1, 8), 1 / 8))
