"""The three MLA decode kernels against their references."""

import pytest
import torch

from kimi_perf_kernels.mla_absorb_insert import mla_absorb_insert, mla_absorb_insert_reference
from kimi_perf_kernels.mla_attention import mla_attention, mla_attention_reference
from kimi_perf_kernels.mla_uv_gate import mla_uv_gate, mla_uv_gate_reference
from tests.kernels.util import assert_close_bf16, poison

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize(("batch", "tokens", "heads"), [(1, 1, 4), (3, 1, 20), (2, 3, 4)])
def test_absorb_insert_and_attention(cache_dtype, batch, tokens, heads):
    gen = torch.Generator().manual_seed(batch * 10 + tokens + heads)
    nope, rope, lora, seq = 16, 8, 32, 40
    M = batch * tokens
    q = torch.randn(M, heads * (nope + rope), generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / nope**0.5).bfloat16()
    kv = torch.randn(M, lora + rope, generator=gen).bfloat16()
    kv_norm = 1 + 0.1 * torch.randn(lora, generator=gen)
    history = torch.randint(5, 30, (batch,), generator=gen)
    positions = (history[:, None] + torch.arange(tokens)).reshape(M)
    cache = (torch.randn(batch, seq, lora + rope, generator=gen) * 0.5).to(cache_dtype)
    scale = 0.5 if cache_dtype == FP8 else 1.0
    cache_ref = cache.clone()
    qhat_ref = mla_absorb_insert_reference(q, w_uk, kv, kv_norm, cache_ref, positions, tokens,
                                           scale, 1e-5)
    qhat = torch.empty_like(qhat_ref)
    poison(qhat)
    mla_absorb_insert(q, w_uk, kv, kv_norm, cache, positions, tokens, scale, 1e-5, qhat=qhat)
    assert_close_bf16(qhat, qhat_ref, ulps=2)
    if cache_dtype == FP8:  # one fp8 step: the latent is rounded to bf16, then to fp8
        torch.testing.assert_close(cache.float(), cache_ref.float(), rtol=0.13, atol=2e-3)
    else:
        assert_close_bf16(cache, cache_ref, ulps=2)

    sm_scale = (nope + rope) ** -0.5
    want = mla_attention_reference(qhat_ref, cache_ref, positions, tokens, scale, sm_scale,
                                   lora)
    out = torch.empty(M, heads, lora, dtype=torch.bfloat16)
    poison(out)
    mla_attention(qhat_ref, cache_ref, positions, tokens, lora, scale, sm_scale, out=out)
    assert_close_bf16(out, want, ulps=2)


def test_uv_gate():
    gen = torch.Generator().manual_seed(3)
    M, H, lora, v = 3, 5, 32, 16
    o_lat = torch.randn(M, H, lora, generator=gen).bfloat16()
    w_uv = (torch.randn(H, lora, v, generator=gen) / lora**0.5).bfloat16()
    gate = torch.randn(M, H * v + 7, generator=gen).bfloat16()[:, 3: 3 + H * v]
    out = torch.empty(M, H * v, dtype=torch.bfloat16)
    poison(out)
    mla_uv_gate(o_lat, w_uv, gate, out=out)
    assert_close_bf16(out, mla_uv_gate_reference(o_lat, w_uv, gate), ulps=2)
