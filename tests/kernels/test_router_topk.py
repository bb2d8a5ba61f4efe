import pytest
import torch

from kimi_perf_kernels.router_topk import router_topk, router_topk_reference
from tests.kernels.util import poison


@pytest.mark.parametrize(("m", "e", "k"), [(1, 16, 4), (5, 896, 16), (3, 100, 8)])
def test_router_topk_matches_reference(m, e, k):
    gen = torch.Generator().manual_seed(m + e + k)
    logits = torch.randn(m, e + 7, generator=gen)[:, :e]   # a strided view, like the GEMV's
    bias = 0.3 * torch.randn(e, generator=gen)
    ids = torch.full((m, k), -1, dtype=torch.int32)
    weights = torch.empty(m, k)
    poison(weights)
    router_topk(logits, bias, k, scale=2.5, ids=ids, weights=weights)
    want_ids, want_weights = router_topk_reference(logits, bias, k, scale=2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((m,), 2.5), rtol=1e-5, atol=1e-5)
