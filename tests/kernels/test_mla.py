"""The three MLA decode kernels against their references."""

import math

import pytest
import torch

from kimi_perf_kernels.mla_absorb_insert import mla_absorb_insert, mla_absorb_insert_reference
from kimi_perf_kernels.mla_attention import (
    mla_attention,
    mla_attention_reference,
    mla_combine,
    mla_splits,
)
from kimi_perf_kernels.mla_concat_insert import mla_concat_insert, mla_concat_insert_reference
from kimi_perf_kernels.mla_uv_gate import mla_uv_gate, mla_uv_gate_reference
from tests.kernels.util import ROUNDED_OPERAND, assert_close_bf16, assert_close_fp8, poison
from tests.poisoning import UNPOISONED_EMPTY

FP8 = torch.float8_e4m3fn


def assert_cache_rows_equal(cache: torch.Tensor, want: torch.Tensor, positions: torch.Tensor,
                            tokens: int) -> None:
    """Cache rows as the reference writes them: the latent normed, rounded to bf16, then
    (fp8) scaled, clamped to ±448 and rounded to nearest even; bit for bit but for a rare
    value whose norm sums in another order (one bf16 ulp, then at most one fp8 step). Every
    other row is as it was, bit for bit."""
    seq = torch.arange(len(positions)) // tokens
    untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
    untouched[seq, positions] = False
    bits = torch.uint8 if cache.dtype == FP8 else torch.int16
    assert torch.equal(cache.view(bits)[untouched], want.view(bits)[untouched]), \
        "a cache row no token writes changed"
    assert_close_q(cache[seq, positions], want[seq, positions])


def assert_close_q(got: torch.Tensor, want: torch.Tensor) -> None:
    """q̂ or cache rows: fp8 within one step of the reference's rounding, rarely off by it;
    bf16 within 2 ulps, rarely off at all (two sums of one row in another order)."""
    if want.dtype == FP8:
        assert_close_fp8(got, want)
    else:
        assert_close_bf16(got, want, ulps=2)
        assert (got != want).float().mean() <= 0.005


# lora 128: two latent tiles of a GPU's 64 (BLOCK_L), and 40 positions two of its 32
# (BLOCK_S); the last, a K3 TP8 rank's: 12 heads, kv_lora 512 and rope 64 (a rope tile of its
# own, unmasked: q̂ rows of 576)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize(("batch", "tokens", "heads", "lora", "rope"),
                         [(1, 1, 4, 32, 8), (3, 1, 20, 32, 8), (2, 3, 4, 32, 8),
                          (2, 2, 4, 128, 8), (1, 1, 12, 512, 64)])
def test_absorb_insert_and_attention(cache_dtype, batch, tokens, heads, lora, rope, tiles):
    gen = torch.Generator().manual_seed(batch * 10 + tokens + heads)
    nope, seq = 16, 40
    M = batch * tokens
    q = torch.randn(M, heads * (nope + rope), generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / nope**0.5).bfloat16()
    kv = torch.randn(M, lora + rope, generator=gen).bfloat16()
    kv_norm = 1 + 0.1 * torch.randn(lora, generator=gen)
    history = torch.randint(5, 30, (batch,), generator=gen)
    positions = (history[:, None] + torch.arange(tokens)).reshape(M)
    cache = (torch.randn(batch, seq, lora + rope, generator=gen) * 0.5).to(cache_dtype)
    # an fp8 cache takes an fp8 q̂, each with a scale of its own
    scale, q_scale = (0.5, 0.25) if cache_dtype == FP8 else (1.0, 1.0)
    cache_ref = cache.clone()
    qhat_ref = mla_absorb_insert_reference(q, w_uk, kv, kv_norm, cache_ref, positions, tokens,
                                           scale, 1e-5, q_scale)
    assert qhat_ref.dtype == (FP8 if cache_dtype == FP8 else torch.bfloat16)
    qhat = torch.empty_like(qhat_ref)
    poison(qhat)
    mla_absorb_insert(q, w_uk, kv, kv_norm, cache, positions, tokens, scale, 1e-5, qhat=qhat,
                      q_scale=q_scale)
    assert_close_q(qhat, qhat_ref)
    assert_cache_rows_equal(cache, cache_ref, positions, tokens)

    sm_scale = (nope + rope) ** -0.5
    want = mla_attention_reference(qhat_ref, cache_ref, positions, tokens, scale, sm_scale,
                                   lora, q_scale, torch.bfloat16)
    parts, lse = mla_attention(qhat_ref, cache_ref, positions, tokens, lora, scale, sm_scale,
                               q_scale=q_scale, dtype=torch.bfloat16)
    assert lse is None and parts.shape == (1, M, heads, lora) and parts.dtype == torch.bfloat16
    assert_close_bf16(parts[0], want, ulps=2, beyond_own_ulp=ROUNDED_OPERAND)
    if cache_dtype == FP8:   # the scales count: q̂'s values are a quarter of what they stand for
        unscaled = mla_attention_reference(qhat_ref, cache_ref, positions, tokens, scale,
                                           sm_scale, lora, 1.0, torch.bfloat16)
        assert (unscaled.float() - want.float()).abs().max() > 0.05


def test_fp8_cache_rows_saturate_at_448():
    """A latent beyond e4m3's range (a small scale) is stored as ±448, as the reference
    stores it, not as e4m3fnuz's 240 or a NaN."""
    gen = torch.Generator().manual_seed(3)
    heads, nope, rope, lora, M = 2, 16, 8, 32, 2
    q = torch.randn(M, heads * (nope + rope), generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / nope**0.5).bfloat16()
    kv = torch.randn(M, lora + rope, generator=gen).bfloat16()
    kv_norm = 1 + 0.1 * torch.randn(lora, generator=gen)
    positions = torch.tensor([3, 7])
    cache = torch.randn(M, 10, lora + rope, generator=gen).to(FP8)   # rows not written: kept
    cache_ref = cache.clone()
    scale = 1 / 400      # normed latents of about ±1-3 -> ±400-1200
    mla_absorb_insert_reference(q, w_uk, kv, kv_norm, cache_ref, positions, 1, scale, 1e-5)
    mla_absorb_insert(q, w_uk, kv, kv_norm, cache, positions, 1, scale, 1e-5)
    rows = cache[torch.arange(M), positions].float()
    assert (rows.abs() == 448).sum() >= 10 and rows.abs().max() == 448
    assert_cache_rows_equal(cache, cache_ref, positions, 1)


# each sequence's second token at row 6 of 6: sequence 0's would land in sequence 1's first
# row, sequence 1's in the row after the tensor; or each one's first token at -1, vLLM's
# padding slot: sequence 1's would land in sequence 0's last row, sequence 0's before the
# tensor
@pytest.mark.parametrize(("positions", "held"), [([5, 6, 5, 6], 5), ([-1, 0, -1, 0], 0)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_positions_outside_the_cache_write_nothing_else(cache_dtype, positions, held, tiles):
    """A graph-safe step does not check the lengths on the host: a token at a position past
    its cache's last row, or at a negative one, writes nothing, neither a neighbouring
    sequence's row nor outside the tensor, in either path's insert (the specialized
    ``mla_absorb_insert``, the standard ``mla_concat_insert``); the rows the cache holds are
    written as the references write them."""
    gen = torch.Generator().manual_seed(8)
    heads, nope, rope, lora, S, batch, tokens = 4, 16, 8, 32, 6, 2, 2
    M = batch * tokens
    q = torch.randn(M, heads * (nope + rope), generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / nope**0.5).bfloat16()
    kv = torch.randn(M, lora + rope, generator=gen).bfloat16()
    kv_norm = 1 + 0.1 * torch.randn(lora, generator=gen)
    ql = torch.randn(heads, M, lora, generator=gen).bfloat16()
    positions = torch.tensor(positions)
    written = torch.zeros(batch, S, dtype=torch.bool)
    written[[0, 1], [held, held]] = True       # the rows of the tokens the cache holds
    scale = 0.5 if cache_dtype == FP8 else 1.0
    bits = torch.uint8 if cache_dtype == FP8 else torch.int16
    for insert, reference in (
            (lambda c: mla_absorb_insert(q, w_uk, kv, kv_norm, c, positions, tokens, scale,
                                         1e-5),
             lambda c: mla_absorb_insert_reference(q, w_uk, kv, kv_norm, c, positions, tokens,
                                                   scale, 1e-5)),
            (lambda c: mla_concat_insert(ql, q, kv[:, :lora], kv[:, lora:], c, positions,
                                         tokens, scale, nope),
             lambda c: mla_concat_insert_reference(ql, q, kv[:, :lora], kv[:, lora:], c,
                                                   positions, tokens, scale, nope))):
        # one tensor holding both caches and a row before and after them: what an overrun
        # would write
        store = (torch.randn(batch * S + 2, lora + rope, generator=gen) * 0.5).to(cache_dtype)
        cache = store[1: batch * S + 1].view(batch, S, lora + rope)
        before = store.clone()
        insert(cache)
        want = before[1: batch * S + 1].view(batch, S, lora + rope).clone()
        reference(want)
        for outside in (0, -1):   # before and past the tensor
            assert torch.equal(store[outside].view(bits), before[outside].view(bits))
        assert torch.equal(cache.view(bits)[~written], want.view(bits)[~written])
        assert_close_q(cache[written], want[written])


def test_tiles_that_cannot_be_whole_are_refused():
    """The MLA kernels' tiles are unmasked: a nope, kv_lora or v that is no power of two
    (K3's 128, 512, 128 are) is refused in one line, not read past nor left to Triton's
    compiler."""
    q, kv = torch.zeros(1, 2 * (24 + 8)).bfloat16(), torch.zeros(1, 32 + 8).bfloat16()
    cache = torch.zeros(1, 4, 32 + 8).bfloat16()
    with pytest.raises(ValueError, match="nope 24 and kv_lora 32 must be powers of two"):
        mla_absorb_insert(q, torch.zeros(2, 24, 32).bfloat16(), kv, torch.ones(32), cache,
                          torch.tensor([0]), 1, 1.0, 1e-5)
    with pytest.raises(ValueError, match="kv_lora 32 and v 40 must be powers of two"):
        mla_uv_gate(torch.zeros(1, 2, 32).bfloat16(), torch.zeros(2, 32, 40).bfloat16(),
                    torch.zeros(1, 80).bfloat16())
    wide = torch.zeros(1, 4, 48 + 8).bfloat16()          # kv_lora 48, rope 8
    with pytest.raises(ValueError, match=r"^mla_attention: kv_lora 48 must be a power of two "
                                         r"\(whole tiles, unmasked\)$"):
        mla_attention(torch.zeros(1, 2, 48 + 8).bfloat16(), wide, torch.tensor([0]), 1, 48,
                      1.0, 0.1)
    with pytest.raises(ValueError, match="mla_combine: kv_lora 48 must be a power of two"):
        mla_combine(torch.zeros(2, 1, 2, 48), torch.zeros(2, 1, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="mla_concat_insert: kv_lora 48 must be a power"):
        mla_concat_insert(torch.zeros(2, 1, 48).bfloat16(), torch.zeros(1, 2 * (16 + 8))
                          .bfloat16(), torch.zeros(1, 48).bfloat16(),
                          torch.zeros(1, 8).bfloat16(), wide, torch.tensor([0]), 1, 1.0, 16)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("lora", [32, 128])
def test_attention_split_over_positions(splits, lora, tiles):
    """Flash-decoding: each split's partial output and log-sum-exp, merged by mla_combine
    and inside mla_uv_gate, equal one pass; splits past a short token's positions are empty
    and weigh nothing."""
    gen = torch.Generator().manual_seed(splits)
    batch, tokens, heads, rope, seq = 2, 2, 20, 8, 300
    M = batch * tokens
    qhat = torch.randn(M, heads, lora + rope, generator=gen).bfloat16()
    cache = (torch.randn(batch, seq, lora + rope, generator=gen) * 0.5).bfloat16()
    positions = torch.tensor([3, 4, 250, 251])        # the first sequence leaves splits empty
    sm_scale = (16 + rope) ** -0.5
    want = mla_attention_reference(qhat, cache, positions, tokens, 1.0, sm_scale, lora)
    parts, lse = mla_attention(qhat, cache, positions, tokens, lora, 1.0, sm_scale, splits)
    assert parts.shape == (splits, M, heads, lora) and parts.dtype == torch.float32
    assert torch.isinf(lse[-1, :2]).all() and torch.isfinite(lse[0]).all()
    merged = _check_split_attention(parts, lse, want)
    v = 16
    w_uv = (torch.randn(heads, lora, v, generator=gen) / lora**0.5).bfloat16()
    gate = torch.randn(M, heads * v, generator=gen).bfloat16()
    out = torch.empty(M, heads * v, dtype=torch.bfloat16)
    poison(out)
    mla_uv_gate(parts, w_uv, gate, out=out, lse=lse)
    # the kernel merges in fp32 and rounds once, after w_uv: so does the reference, of the
    # same partials (merged rounded to bf16 first, it was 3 ulps apart, and 20% of the
    # outputs past one of their own allowed, which a merge weighted by lse rounded to bf16
    # passed: the attention's rounding is checked apart, above)
    assert_close_bf16(out, mla_uv_gate_reference(merged, w_uv, gate).bfloat16())


def _check_split_attention(parts: torch.Tensor, lse: torch.Tensor,
                           want: torch.Tensor) -> torch.Tensor:
    """Split partials against the one-pass reference: their merge (fp32, by PyTorch) within
    the GPU's rounding of P (``ROUNDED_OPERAND``), and ``mla_combine``'s merge of the same
    partials as tight as one rounding (a merge weighted wrong hides within the former).
    Returns the fp32 merge."""
    merged = (torch.softmax(lse, dim=0)[..., None] * parts).sum(0)
    assert_close_bf16(merged, want, ulps=2, beyond_own_ulp=ROUNDED_OPERAND)
    assert_close_bf16(mla_combine(parts, lse, torch.bfloat16), merged.bfloat16(), ulps=2)
    return merged


@pytest.mark.parametrize("splits", [1, 3])
def test_an_fp8_cache_split_over_positions(splits, tiles):
    """What a GPU launches at batch 1 with an fp8 cache: the positions split, each split's
    log-sum-exp taken of scores scaled by q̂'s and the cache's scales (a scale left out of
    one would weigh the splits wrongly)."""
    gen = torch.Generator().manual_seed(1)
    batch, tokens, heads, lora, rope, seq = 2, 2, 12, 64, 8, 300
    M = batch * tokens
    qhat = (torch.randn(M, heads, lora + rope, generator=gen) * 4).to(FP8)
    cache = (torch.randn(batch, seq, lora + rope, generator=gen) * 2).to(FP8)
    positions = torch.tensor([3, 4, 250, 251])
    want = mla_attention_reference(qhat, cache, positions, tokens, 0.5, 0.1, lora, 0.25,
                                   torch.float32)
    parts, lse = mla_attention(qhat, cache, positions, tokens, lora, 0.5, 0.1, splits,
                               q_scale=0.25, dtype=torch.bfloat16)
    if splits == 1:
        assert_close_bf16(parts[0], want.bfloat16(), beyond_own_ulp=ROUNDED_OPERAND)
    else:
        _check_split_attention(parts, lse, want.bfloat16())


def test_splits_fill_the_gpu_and_stay_one_on_a_cpu(monkeypatch):
    """On an H200 (132 SMs): programs = sequences x ceil(tokens x heads / row block) (16 rows
    up to 16, else 32); splits = SMs over them, at most 64, each of 256 positions or more; a
    step that fills the SMs alone takes one."""
    assert mla_splits(1, 1, 12, 4096, torch.device("cpu")) == 1
    h200 = type("Properties", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    cuda = torch.device("cuda")
    worked_by_hand = {(1, 1, 12, 4096): 16,    # 4096 positions: 16 chunks of 256
                      (1, 1, 12, 32768): 64,   # 132 programs' worth: capped at 64
                      (10, 1, 12, 4096): 13,   # 132 // 10
                      (1, 1, 12, 512): 2,      # 512 positions: two of 256
                      (1, 1, 12, 500): 1,      # fewer than two chunks of 256
                      (16, 8, 12, 4096): 2,    # 96 rows a sequence, 3 blocks: 132 // 48
                      (16, 4, 6, 4096): 8,     # 24 rows, one block of 32: 132 // 16
                      (64, 1, 64, 4096): 1}    # 128 programs fill the SMs alone
    assert {shape: mla_splits(*shape, cuda) for shape in worked_by_hand} == worked_by_hand


@pytest.mark.parametrize("splits", [1, 5])
def test_verify_step_reads_the_cache_once_per_row_block(splits, monkeypatch, tiles):
    """A verify step of 8 tokens x 12 heads (K3 TP8): a program per 32 (token, head) rows of
    a sequence, so 3 per sequence read its cache where a program per token would take 8; each
    row still sees only its own token's positions. Split in 5 chunks of the positions its
    block's last token sees, a row's partial is empty (0, lse -inf, not NaN) exactly where
    its chunk starts past the row's own position or past the block's end."""
    from kimi_perf_kernels import mla_attention as module
    from kimi_perf_kernels.common import interpreter_tiles
    from kimi_perf_kernels.mla_attention import mla_row_block

    grids = []
    kernel = module.mla_attention_kernel
    monkeypatch.setattr(module, "mla_attention_kernel", type("Recorder", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    gen = torch.Generator().manual_seed(8)
    batch, tokens, heads, lora, rope = 2, 8, 12, 32, 8
    M = batch * tokens
    qhat = torch.randn(M, heads, lora + rope, generator=gen).bfloat16()
    cache = (torch.randn(batch, 80, lora + rope, generator=gen) * 0.5).bfloat16()
    positions = (torch.tensor([61, 20])[:, None] + torch.arange(tokens)).reshape(M)
    want = mla_attention_reference(qhat, cache, positions, tokens, 1.0, 0.2, lora)
    parts, lse = mla_attention(qhat, cache, positions, tokens, lora, 1.0, 0.2, splits)
    assert grids == [(batch, 3, splits)]
    assert not parts.isnan().any()
    if splits == 1:
        assert_close_bf16(parts[0], want, ulps=2, beyond_own_ulp=ROUNDED_OPERAND)
        return
    block_s, rb = 64 if interpreter_tiles() else 32, mla_row_block(tokens * heads)
    seen = torch.zeros(splits, M, heads, dtype=torch.bool)
    for b in range(batch):
        n_pos = (positions[b * tokens:(b + 1) * tokens] + 1).repeat_interleave(heads)
        for r0 in range(0, tokens * heads, rb):
            last = int(n_pos[r0: r0 + rb].max())
            chunk = math.ceil(math.ceil(last / splits) / block_s) * block_s
            for j in range(splits):
                for r in range(r0, min(r0 + rb, tokens * heads)):
                    seen[j, b * tokens + r // heads, r % heads] = (
                        j * chunk < min(last, int(n_pos[r])))
    assert seen.any(0).all() and not seen.all()        # empty partials occur, never all
    assert torch.equal(torch.isfinite(lse), seen)
    assert (parts[~seen] == 0).all()
    _check_split_attention(parts, lse, want)


def test_weights_read_once_per_block_of_16_tokens(monkeypatch, tiles):
    """33 tokens: three blocks of 16 (the last of one), each program reading its head's
    W_UK / W_UV columns once for the block; both kernels against their references, the
    merge of split partials included."""
    from kimi_perf_kernels import mla_absorb_insert as absorb_module
    from kimi_perf_kernels import mla_uv_gate as uv_module
    from kimi_perf_kernels.common import interpreter_tiles

    grids = {}
    for module, name in ((absorb_module, "mla_absorb_insert_kernel"),
                         (uv_module, "mla_uv_gate_kernel")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, type("Recorder", (), {
            "__getitem__": lambda self, grid, k=kernel, n=name: grids.setdefault(n, grid)
            and k[grid]})())
    gen = torch.Generator().manual_seed(33)
    M, heads, nope, rope, lora, v = 33, 3, 16, 8, 128, 128
    q = torch.randn(M, heads * (nope + rope), generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / nope**0.5).bfloat16()
    kv = torch.randn(M, lora + rope, generator=gen).bfloat16()
    kv_norm = 1 + 0.1 * torch.randn(lora, generator=gen)
    positions = torch.arange(M)
    cache = torch.zeros(1, M, lora + rope).bfloat16()
    cache_ref = cache.clone()
    qhat_ref = mla_absorb_insert_reference(q, w_uk, kv, kv_norm, cache_ref, positions, M, 1.0,
                                           1e-5)
    qhat = torch.empty_like(qhat_ref)
    poison(qhat)
    mla_absorb_insert(q, w_uk, kv, kv_norm, cache, positions, M, 1.0, 1e-5, qhat=qhat)
    assert_close_bf16(qhat, qhat_ref, ulps=2)
    assert_cache_rows_equal(cache, cache_ref, positions, M)
    gpu = not interpreter_tiles()
    assert grids["mla_absorb_insert_kernel"] == (3, heads * (2 if gpu else 1) + 1)
    lse = torch.randn(2, M, heads, generator=gen)
    lse[1, :5] = -float("inf")                      # a split these rows' tokens never reached
    _check_uv_gate_merge(lse, lora, v, gen)
    assert grids["mla_uv_gate_kernel"] == (3, heads, 2 if gpu else 1)


def _check_uv_gate_merge(lse: torch.Tensor, lora: int, v: int, gen: torch.Generator) -> None:
    """mla_uv_gate of random split partials with these log-sum-exps [splits, M, heads]
    against the reference of the partials merged first."""
    splits, M, heads = lse.shape
    parts = torch.randn(splits, M, heads, lora, generator=gen)
    w_uv = (torch.randn(heads, lora, v, generator=gen) / lora**0.5).bfloat16()
    gate = torch.randn(M, heads * v, generator=gen).bfloat16()
    out = torch.empty(M, heads * v, dtype=torch.bfloat16)
    poison(out)
    mla_uv_gate(parts, w_uv, gate, out=out, lse=lse)
    merged = (torch.softmax(lse, dim=0)[..., None] * parts).sum(0)   # (fp32, as the kernel)
    assert_close_bf16(out, mla_uv_gate_reference(merged, w_uv, gate).bfloat16())


@pytest.mark.parametrize("splits, tokens", [(3, 20), (40, 2), (64, 1)])
def test_uv_gate_merges_any_number_of_splits(splits, tokens, tiles):
    """Split partials go through the dot as (split, token) rows, at most 64 a program: 16
    tokens of 3 splits (padded to 4), one token of 40 (padded to 64) or of 64. Empty splits
    (lse -inf) weigh nothing; the merge equals merging first."""
    from kimi_perf_kernels.mla_uv_gate import merge_block

    assert [merge_block(n) for n in (2, 3, 4, 5, 16, 40, 64)] == [16, 16, 16, 8, 4, 1, 1]
    gen = torch.Generator().manual_seed(splits)
    lse = 4 * torch.randn(splits, tokens, 3, generator=gen)
    lse[splits // 2:, 0] = -float("inf")            # the first token's later splits: empty
    _check_uv_gate_merge(lse, 128, 128, gen)


def test_a_token_with_every_split_empty_merges_to_zero(tiles):
    """No decode token sees no position (its own is in a split), but should one, both merges
    give it 0 rather than NaN, and its neighbours are untouched."""
    gen = torch.Generator().manual_seed(7)
    splits, M, heads, lora, v = 3, 2, 4, 32, 16
    parts = torch.randn(splits, M, heads, lora, generator=gen)
    lse = torch.randn(splits, M, heads, generator=gen)
    lse[:, 1] = -float("inf")
    parts[:, 1] = 0.0                                   # an empty split's partial, as written
    merged = mla_combine(parts, lse, torch.bfloat16)
    assert torch.equal(merged[1], torch.zeros_like(merged[1]))
    assert_close_bf16(merged[0], (torch.softmax(lse[:, 0], 0)[..., None] * parts[:, 0]).sum(0)
                      .bfloat16(), ulps=2)
    w_uv = (torch.randn(heads, lora, v, generator=gen) / lora**0.5).bfloat16()
    gate = torch.randn(M, heads * v, generator=gen).bfloat16()
    out = torch.empty(M, heads * v, dtype=torch.bfloat16)
    poison(out)
    mla_uv_gate(parts, w_uv, gate, out=out, lse=lse)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


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


def test_caches_beyond_int32_offsets():
    """Three long caches side by side: the third sequence's rows lie past 2^31 values (64
    sequences of 64k tokens reach that), while the batch stride still fits an int32; its rows
    are written and read where they are, not 2^32 values off (an int32 product wraps)."""
    gen = torch.Generator().manual_seed(5)
    heads, nope, rope, lora, batch = 4, 16, 8, 32, 3
    width = lora + rope
    stride = 2**30 + 64
    # only the rows touched are ever paged in: the rest of the 2 GiB stays virtual (not
    # poisoned, which would write it all; the rows used are written below)
    storage = UNPOISONED_EMPTY(2 * stride + 8 * width, dtype=torch.uint8).view(FP8)
    cache = storage.as_strided((batch, 8, width), (stride, width, 1))
    start = (torch.randn(batch, 8, width, generator=gen) * 0.5).to(FP8)
    cache.copy_(start)
    q = torch.randn(batch, heads * (nope + rope), generator=gen).bfloat16()
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / nope**0.5).bfloat16()
    kv = torch.randn(batch, width, generator=gen).bfloat16()
    kv_norm = 1 + 0.1 * torch.randn(lora, generator=gen)
    positions = torch.tensor([6, 3, 7])
    cache_ref = start.clone()
    qhat_ref = mla_absorb_insert_reference(q, w_uk, kv, kv_norm, cache_ref, positions, 1, 0.5,
                                           1e-5)
    qhat = mla_absorb_insert(q, w_uk, kv, kv_norm, cache, positions, 1, 0.5, 1e-5)
    assert_close_q(qhat, qhat_ref)
    assert_cache_rows_equal(cache.clone(), cache_ref, positions, 1)
    want = mla_attention_reference(qhat_ref, cache_ref, positions, 1, 0.5, 0.1, lora,
                                   dtype=torch.bfloat16)
    parts, _ = mla_attention(qhat_ref, cache, positions, 1, lora, 0.5, 0.1, dtype=torch.bfloat16)
    assert_close_bf16(parts[0], want, ulps=2, beyond_own_ulp=ROUNDED_OPERAND)


def test_attention_takes_an_fp8_query_with_an_fp8_cache_only():
    """vLLM's policy: an fp8 cache, an fp8 q̂; a bf16 q̂ over an fp8 cache (or the reverse)
    is refused, as is an fp8 q̂ without the output's dtype (the output is not fp8)."""
    qhat = torch.randn(2, 4, 40).bfloat16()
    cache = torch.randn(2, 10, 40).to(FP8)
    positions = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="an fp8 cache takes an fp8 q̂"):
        mla_attention(qhat, cache, positions, 1, 32, 1.0, 0.1)
    with pytest.raises(ValueError, match="an fp8 cache takes an fp8 q̂"):
        mla_attention(qhat.to(FP8), cache.bfloat16(), positions, 1, 32, 1.0, 0.1)
    with pytest.raises(ValueError, match="needs the output's dtype"):
        mla_attention(qhat.to(FP8), cache, positions, 1, 32, 1.0, 0.1)
    with pytest.raises(ValueError, match=r"q̂ of torch\.bfloat16 for a torch\.float8_e4m3fn"):
        mla_absorb_insert(torch.randn(2, 4 * 24).bfloat16(), torch.randn(4, 16, 32).bfloat16(),
                          torch.randn(2, 40).bfloat16(), torch.ones(32), cache, positions, 1,
                          1.0, 1e-5, qhat=qhat)
