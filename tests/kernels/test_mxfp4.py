"""MXFP4 weights: the decode of codes and scales, and the routed experts' kernels on them."""

import pytest
import torch

from kimi_perf_kernels.moe_experts import (
    moe_experts_reference,
    moe_fc1_situ,
    moe_fc2,
    moe_fc2_combine,
    moe_route_fc1_situ,
)
from kimi_perf_kernels.mxfp4 import E2M1, GROUP, Mxfp4, dequantize, quantize
from kimi_perf_kernels.router_topk import router_topk_reference
from tests.kernels.util import assert_close_bf16, poison


def test_quantize_rounds_to_e2m1_times_a_power_of_two():
    """Every E2M1 value, signs and scales: a group whose largest magnitude is 6·2^s keeps
    its values exactly; others round to the nearest code; the codes pack low nibble first."""
    values = torch.cat([E2M1, E2M1.flip(0)])                        # 32 values: one group
    w = torch.stack([values * 4.0, values / 8.0, values * 2.0**-20])  # scales 2^2, 2^-3, 2^-20
    q = quantize(w)
    assert q.packed.shape == (3, 16) and q.scale.shape == (3, 1)
    assert q.scale[:, 0].tolist() == [127 + 2, 127 - 3, 127 - 20]
    torch.testing.assert_close(dequantize(q), w, rtol=0, atol=0)
    assert q.packed[0, 0] == 0x10            # codes 0 (0.0) then 1 (0.5), low nibble first
    off = torch.tensor([[5.2, -0.7, 2.4, 0.26] + [0.0] * 28])      # 6.0 sets the scale 1
    off[0, 4] = 6.0
    assert dequantize(quantize(off))[0, :5].tolist() == [6.0, -0.5, 2.0, 0.5, 6.0]
    with pytest.raises(ValueError, match="not groups of 32"):
        quantize(torch.randn(2, 40))


def _experts(gen, experts: int, rows: int, cols: int) -> Mxfp4:
    return quantize((torch.randn(experts, rows, cols, generator=gen) / cols**0.5).bfloat16())


# latent 96 and 160: K loops of 3 and 2 GPU tiles of 64 (MXFP4's tiles are 128 deep: the
# last one partly past K); intermediates of 32 and 96
@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 8, 2, 32, 64), (3, 12, 4, 96, 160), (2, 6, 3, 64, 96)])
def test_routed_experts_on_mxfp4_match_the_reference(m, experts, k, inter, latent, tiles):
    """The fused route + FC1 + SiTU and FC2 + weighted sum, and the standard path's FC1 and
    per-slot FC2, on MXFP4 weights: as the reference computes them on their values."""
    gen = torch.Generator().manual_seed(m * 11 + experts)
    x = torch.randn(m, latent, generator=gen)
    w13 = _experts(gen, experts, 2 * inter, latent)
    w2 = _experts(gen, experts, latent, inter)
    assert w13.dtype == torch.bfloat16 and w13.shape == (experts, 2 * inter, latent)
    logits = torch.randn(m, experts, generator=gen)
    bias = 0.2 * torch.randn(experts, generator=gen)
    situ = (4.0, 25.0)
    want_ids, want_weights = router_topk_reference(logits, bias, k, scale=2.0)
    want_act, want_out = moe_experts_reference(x, w13, w2, want_ids, want_weights, situ)
    # the reference on the dequantized values is the bf16 kernels' reference: same math
    bf16_act, bf16_out = moe_experts_reference(x, dequantize(w13).bfloat16(),
                                               dequantize(w2).bfloat16(), want_ids,
                                               want_weights, situ)
    assert torch.equal(want_act, bf16_act) and torch.equal(want_out, bf16_out)
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    out = torch.empty(m, latent)
    poison(act, out)
    _, ids, weights = moe_route_fc1_situ(x, w13, logits, bias, k, 2.0, situ, out=act)
    assert torch.equal(ids, want_ids)
    assert_close_bf16(act, want_act, ulps=2)
    moe_fc2_combine(want_act, w2, ids, weights, out=out)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    # the standard path's launches: FC1 routed by an earlier top-k, FC2 slot by slot
    assert_close_bf16(moe_fc1_situ(x.bfloat16(), w13, ids, situ), moe_experts_reference(
        x.bfloat16(), w13, w2, ids, weights, situ)[0], ulps=2)
    per_slot = moe_fc2(want_act, w2, ids)
    want_slots = torch.einsum("mkni,mki->mkn", dequantize(w2)[ids.long()],
                              want_act.float()).bfloat16()
    assert_close_bf16(per_slot, want_slots, ulps=2)


def test_mxfp4_weights_that_do_not_fit_are_refused():
    gen = torch.Generator().manual_seed(1)
    w13 = _experts(gen, 4, 16, 64)
    x, logits, bias = torch.randn(2, 64), torch.randn(2, 4), torch.zeros(4)
    wrong = Mxfp4(w13.packed, w13.scale[..., :1])                  # a scale per 64 values
    with pytest.raises(ValueError, match="FC1: MXFP4 weights need"):
        moe_route_fc1_situ(x, wrong, logits, bias, 2, 1.0, (4.0, 25.0))
    with pytest.raises(ValueError, match="FC1: MXFP4 weights need"):
        moe_route_fc1_situ(x, Mxfp4(w13.packed.int(), w13.scale), logits, bias, 2, 1.0,
                           (4.0, 25.0))
    # 48 columns: a group of 32 and a short one, which the kernels' masks do not cover
    short = Mxfp4(w13.packed[..., : 48 // 2].contiguous(), w13.scale[..., : 48 // GROUP + 1])
    with pytest.raises(ValueError, match=r"K a multiple of 32"):
        moe_fc2(torch.zeros(2, 2, 48, dtype=torch.bfloat16), short, torch.zeros(2, 2,
                                                                              dtype=torch.int32))


# (35 tokens of 6 experts: chunks of an expert's slots; latent 160: MXFP4's 128-deep tiles
# over a K tail)
@pytest.mark.parametrize(("m", "experts", "k", "inter", "latent"),
                         [(1, 8, 2, 32, 64), (35, 6, 3, 64, 160)])
def test_grouped_experts_on_mxfp4_match_the_reference(m, experts, k, inter, latent, tiles):
    """The grouped FC1 + SiTU and FC2 (opt-in, larger batches) on MXFP4 weights: as the
    reference computes them on their values."""
    from kimi_perf_kernels.moe_grouped_fc1 import moe_grouped_fc1_situ
    from kimi_perf_kernels.moe_grouped_fc2 import moe_grouped_fc2

    gen = torch.Generator().manual_seed(m + experts)
    x = torch.randn(m, latent, generator=gen)
    w13 = _experts(gen, experts, 2 * inter, latent)
    w2 = _experts(gen, experts, latent, inter)
    ids, weights = router_topk_reference(torch.randn(m, experts, generator=gen),
                                         torch.zeros(experts), k)
    situ = (4.0, 25.0)
    want_act, want_out = moe_experts_reference(x, w13, w2, ids, weights, situ)
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    poison(act)
    _, slots = moe_grouped_fc1_situ(x, w13, ids, situ, out=act)
    assert_close_bf16(act, want_act, ulps=2)
    out = torch.zeros(m, latent)
    moe_grouped_fc2(want_act, w2, slots, weights, out)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
