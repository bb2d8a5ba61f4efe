"""The three MLA decode kernels against their references."""

import pytest
import torch

from kimi_perf_kernels.mla_absorb_insert import mla_absorb_insert, mla_absorb_insert_reference
from kimi_perf_kernels.mla_attention import (
    mla_attention,
    mla_attention_reference,
    mla_combine,
    mla_splits,
)
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
    parts, lse = mla_attention(qhat_ref, cache_ref, positions, tokens, lora, scale, sm_scale)
    assert lse is None and parts.shape == (1, M, heads, lora)
    assert_close_bf16(parts[0], want, ulps=2)


@pytest.mark.parametrize("splits", [2, 5])
def test_attention_split_over_positions(splits):
    """Flash-decoding: each split's partial output and log-sum-exp, merged by mla_combine
    and inside mla_uv_gate, equal one pass; splits past a short token's positions are empty
    and weigh nothing."""
    gen = torch.Generator().manual_seed(splits)
    batch, tokens, heads, rope, lora, seq = 2, 2, 20, 8, 32, 300
    M = batch * tokens
    qhat = torch.randn(M, heads, lora + rope, generator=gen).bfloat16()
    cache = (torch.randn(batch, seq, lora + rope, generator=gen) * 0.5).bfloat16()
    positions = torch.tensor([3, 4, 250, 251])        # the first sequence leaves splits empty
    sm_scale = (16 + rope) ** -0.5
    want = mla_attention_reference(qhat, cache, positions, tokens, 1.0, sm_scale, lora)
    parts, lse = mla_attention(qhat, cache, positions, tokens, lora, 1.0, sm_scale, splits)
    assert parts.shape == (splits, M, heads, lora) and parts.dtype == torch.float32
    assert torch.isinf(lse[-1, :2]).all() and torch.isfinite(lse[0]).all()
    assert_close_bf16(mla_combine(parts, lse, torch.bfloat16), want, ulps=2)
    v = 16
    w_uv = (torch.randn(heads, lora, v, generator=gen) / lora**0.5).bfloat16()
    gate = torch.randn(M, heads * v, generator=gen).bfloat16()
    out = torch.empty(M, heads * v, dtype=torch.bfloat16)
    poison(out)
    mla_uv_gate(parts, w_uv, gate, out=out, lse=lse)
    assert_close_bf16(out, mla_uv_gate_reference(want, w_uv, gate), ulps=3)


def test_splits_fill_the_gpu_and_stay_one_on_a_cpu():
    assert mla_splits(1, 12, 4096, torch.device("cpu")) == 1


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
