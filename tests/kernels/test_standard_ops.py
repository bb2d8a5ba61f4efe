"""The standard path's single-kernel ops (vLLM's separate fused ops) against their references."""

import pytest
import torch

from kimi_perf_kernels.gate_sigmoid_mul import gate_sigmoid_mul, gate_sigmoid_mul_reference
from kimi_perf_kernels.mla_concat_insert import mla_concat_insert, mla_concat_insert_reference
from kimi_perf_kernels.moe_experts import (
    moe_experts_reference,
    moe_fc1_situ,
    moe_fc2,
    moe_finalize,
)
from kimi_perf_kernels.rms_norm import rms_norm, rms_norm_reference
from kimi_perf_kernels.situ_and_mul import situ_and_mul, situ_and_mul_reference
from tests.kernels.util import assert_close_bf16, poison


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_rms_norm_one_and_two_tensors(out_dtype):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 200, generator=gen).bfloat16()
    qkv = torch.randn(3, 96 + 40 + 8, generator=gen)          # q_c | kv_c | k_pe, fp32
    w1, w2 = torch.randn(200, generator=gen), torch.randn(40, generator=gen)
    got = rms_norm(wide, w1, 1e-5)
    assert_close_bf16(got, rms_norm_reference(wide, w1, 1e-5), ulps=1)
    q_w = torch.randn(96, generator=gen)
    q, kv = rms_norm(qkv[:, :96], q_w, 1e-5, out_dtype, second=(qkv[:, 96:136], w2))
    want_q = rms_norm_reference(qkv[:, :96], q_w, 1e-5, out_dtype)
    want_kv = rms_norm_reference(qkv[:, 96:136], w2, 1e-5, out_dtype)
    assert q.dtype == want_q.dtype and kv.dtype == want_kv.dtype
    if out_dtype is None:
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kv, want_kv, rtol=1e-5, atol=1e-6)
    else:
        assert_close_bf16(q, want_q, ulps=1)
        assert_close_bf16(kv, want_kv, ulps=1)
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(wide, torch.ones(5), 1e-5)


@pytest.mark.parametrize("inter", [300, 1100])
def test_situ_and_mul(tiles, inter):
    # 1100 columns: a second, partial column block at a GPU's tiles (1024)
    gen = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(5, 2 * inter, generator=gen)).bfloat16()
    assert_close_bf16(situ_and_mul(gate_up, (4.0, 25.0)),
                      situ_and_mul_reference(gate_up, (4.0, 25.0)), ulps=1)


def test_moe_finalize_over_several_column_blocks(tiles):
    gen = torch.Generator().manual_seed(9)
    per_slot = torch.randn(3, 4, 1100, generator=gen).bfloat16()
    weights = torch.rand(3, 4, generator=gen)
    want = (per_slot.float() * weights[..., None]).sum(1)
    assert_close_bf16(moe_finalize(per_slot, weights, torch.bfloat16), want, ulps=1)


@pytest.mark.parametrize("v", [40, 128])    # no power of two; K3's heads of 128
def test_gate_sigmoid_mul_reads_head_major(v):
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(6, 4, v, generator=gen).bfloat16()     # [H, M, V]
    gate = torch.randn(4, 6 * v, generator=gen).bfloat16()
    out = gate_sigmoid_mul(o, gate)
    assert_close_bf16(out, gate_sigmoid_mul_reference(o, gate), ulps=1)
    with pytest.raises(ValueError, match="gate_sigmoid_mul"):
        gate_sigmoid_mul(o, gate[:, :-1])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_concat_insert(cache_dtype):
    gen = torch.Generator().manual_seed(4)
    B, T, H, nope, rope, lora, S = 2, 3, 5, 16, 8, 32, 10
    M = B * T
    ql = torch.randn(H, M, lora, generator=gen).bfloat16()
    q = torch.randn(M, H * (nope + rope), generator=gen).bfloat16()
    qkv = torch.randn(M, 50 + lora + rope, generator=gen).bfloat16()  # kv_c, k_pe: views
    kv_c, k_pe = qkv[:, 50: 50 + lora], qkv[:, 50 + lora:]
    positions = torch.tensor([4, 5, 6, 0, 1, 2])
    qkv[:3, 50] = 30.0                     # beyond ±448 once divided by the scale: saturates
    qkv[3:, -1] = -30.0
    ql[1, :2, 7] = 10.0                    # so do q̂'s (an fp8 cache takes an fp8 q̂)
    q[4, nope] = -10.0
    got_cache = torch.randn(B, S, lora + rope, generator=gen).to(cache_dtype)  # rows not written
    want_cache = got_cache.clone()
    got = mla_concat_insert(ql, q, kv_c, k_pe, got_cache, positions, T, 0.05, nope,
                            q_scale=0.02)
    want = mla_concat_insert_reference(ql, q, kv_c, k_pe, want_cache, positions, T, 0.05, nope,
                                       q_scale=0.02)
    fp8 = cache_dtype == torch.float8_e4m3fn
    assert got.dtype == want.dtype == (cache_dtype if fp8 else torch.bfloat16)
    # bit for bit (the interpreter's rounding is emulated; nothing is summed)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    if fp8:
        assert got_cache.float().abs().max() == 448 and (got_cache.float().abs() == 448).sum() >= 6
        assert (got.float().abs() == 448).sum() == 3
        # the rest: q̂ / 0.02 within e4m3's rounding (half a step: 2^-4 relative, or 2^-10
        # absolute among the subnormals)
        stored, meant = got[:, :, :lora].float(), ql.transpose(0, 1).float() / 0.02
        kept = meant.abs() < 448
        assert ((stored - meant).abs()[kept] <= (meant.abs() / 16).clamp_min(2**-10)[kept]).all()
    else:
        assert torch.equal(got[:, :, :lora], ql.transpose(0, 1))   # bf16: copied as it is
    assert got_cache.float().abs().sum() > 0


def test_moe_fc1_with_given_ids_and_fc2_per_slot():
    gen = torch.Generator().manual_seed(5)
    m, experts, k, inter, latent = 3, 7, 2, 24, 40
    x = torch.randn(m, latent, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, latent, generator=gen) / latent**0.5).bfloat16()
    w2 = (torch.randn(experts, latent, inter, generator=gen) / inter**0.5).bfloat16()
    ids = torch.tensor([[3, 0], [6, 3], [1, 2]], dtype=torch.int32)
    ones = torch.ones(m, k)
    want_act, _ = moe_experts_reference(x, w13, w2, ids, ones, (4.0, 25.0))
    act = torch.empty(m, k, inter, dtype=torch.bfloat16)
    poison(act)
    moe_fc1_situ(x, w13, ids, (4.0, 25.0), out=act)
    assert_close_bf16(act, want_act, ulps=2)
    per_slot = moe_fc2(want_act, w2, ids)
    assert per_slot.dtype == torch.bfloat16
    for slot in range(k):  # each slot alone: a one-hot weight
        only = torch.nn.functional.one_hot(torch.full((m,), slot), k).float()
        _, want = moe_experts_reference(x, w13, w2, ids, only, (4.0, 25.0))
        assert_close_bf16(per_slot[:, slot], want, ulps=1)
    weights = torch.rand(m, k, generator=gen)
    want = (per_slot.float() * weights[..., None]).sum(1)
    assert_close_bf16(moe_finalize(per_slot, weights, torch.bfloat16), want, ulps=1)
