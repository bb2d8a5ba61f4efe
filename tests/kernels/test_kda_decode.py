import pytest
import torch

from kimi_perf_kernels.kda_decode import kda_decode, kda_decode_reference
from tests.kernels.util import assert_close_bf16, poison


def inputs(batch, tokens, heads, d, f_rank, seed):
    gen = torch.Generator().manual_seed(seed)
    proj = heads * d
    rows = 4 * proj + f_rank + heads
    rows += (-rows) % 16
    z = torch.randn(batch, tokens, rows, generator=gen).bfloat16()
    params = dict(
        heads=heads, head_dim=d, f_rank=f_rank,
        w_fb=(torch.randn(proj, f_rank, generator=gen) / f_rank**0.5).bfloat16(),
        dt_bias=0.5 * torch.randn(proj, generator=gen),
        a_log=torch.rand(heads, generator=gen) * 2 - 1,
        conv_w=torch.randn(3 * proj, 4, generator=gen) / 2,
        o_norm=1 + 0.1 * torch.randn(d, generator=gen),
        eps=1e-5, lower_bound=-5.0)
    conv_state = torch.randn(batch, 3 * proj, 3, generator=gen).bfloat16()
    state = torch.randn(batch, heads, d, d, generator=gen) * 0.1
    return z, params, conv_state, state


# (the last: two value tiles and two f_b tiles a head with a GPU's tiles, BV 32, F_BLOCK 16)
@pytest.mark.parametrize(("batch", "tokens", "heads", "d", "f_rank"),
                         [(1, 1, 2, 16, 16), (3, 1, 4, 32, 16), (2, 4, 2, 16, 32),
                          (2, 2, 2, 64, 32)])
def test_kda_decode_matches_reference(batch, tokens, heads, d, f_rank, tiles):
    z, params, conv_state, state = inputs(batch, tokens, heads, d, f_rank, batch + tokens)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    expected = kda_decode_reference(z, conv_state=conv_ref, state=state_ref, **params)
    out = torch.empty(batch, tokens, heads * d, dtype=torch.bfloat16)
    poison(out)
    kda_decode(z, conv_state=conv_state, state=state, out=out, **params)
    assert_close_bf16(out, expected, ulps=4)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=0)


def test_kda_verify_mode_writes_every_position():
    batch, tokens, heads, d, f_rank = 2, 4, 2, 16, 16
    z, params, conv_state, state = inputs(batch, tokens, heads, d, f_rank, 7)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    _, states_ref, convs_ref = kda_decode_reference(z, conv_state=conv_ref, state=state_ref,
                                                    checkpoint=True, **params)
    _, states, convs = kda_decode(z, conv_state=conv_state, state=state, checkpoint=True,
                                  **params)
    torch.testing.assert_close(states, states_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(convs, convs_ref, rtol=0, atol=0)
    torch.testing.assert_close(states[-1], state, rtol=0, atol=0)


def test_kda_decode_with_the_f_b_projection_given():
    """The standard path's variant: f = f_a · W_fbᵀ arrives from its own GEMM (fp32 here, so
    it equals the fused projection up to summation order)."""
    batch, tokens, heads, d, f_rank = 2, 2, 2, 16, 16
    z, params, conv_state, state = inputs(batch, tokens, heads, d, f_rank, 9)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    expected = kda_decode_reference(z, conv_state=conv_ref, state=state_ref, **params)
    proj = heads * d
    f = z[..., 4 * proj: 4 * proj + f_rank].float() @ params["w_fb"].float().T
    out = torch.empty(batch, tokens, proj, dtype=torch.bfloat16)
    poison(out)
    kda_decode(z, conv_state=conv_state, state=state, out=out, f=f,
               **{**params, "w_fb": torch.full_like(params["w_fb"], float("nan"))})
    assert_close_bf16(out, expected, ulps=4)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="kda_decode: f"):
        kda_decode(z, conv_state=conv_state, state=state, f=f[:, :1], **params)
