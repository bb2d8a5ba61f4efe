"""The host wrappers refuse what their kernels would read wrong: a strided view of a tensor
indexed by its elements, a tensor shorter (or longer) than the kernel reads, a dtype it does not
take, tensors on two devices. Each case below was read wrong without a word before it was
refused: past a tensor's end, or another view's elements."""

from __future__ import annotations

import pytest
import torch

from kimi_perf_kernels.attn_res import attn_res
from kimi_perf_kernels.common import check_layout
from kimi_perf_kernels.gate_sigmoid_mul import gate_sigmoid_mul
from kimi_perf_kernels.kda_decode import kda_decode
from kimi_perf_kernels.l2_prefetch import l2_prefetch
from kimi_perf_kernels.mla_absorb_insert import mla_absorb_insert
from kimi_perf_kernels.mla_attention import mla_attention, mla_combine
from kimi_perf_kernels.mla_concat_insert import mla_concat_insert
from kimi_perf_kernels.mla_uv_gate import mla_uv_gate
from kimi_perf_kernels.moe_experts import (
    moe_fc1_situ,
    moe_fc2_combine,
    moe_finalize,
    moe_route_fc1_situ,
)
from kimi_perf_kernels.moe_grouped_fc1 import ExpertSlots
from kimi_perf_kernels.moe_grouped_fc2 import moe_grouped_fc2
from kimi_perf_kernels.rms_norm import rms_norm
from kimi_perf_kernels.router_topk import router_topk
from kimi_perf_kernels.skinny_linear import skinny_linear
from tests.kernels.test_kda_decode import inputs as kda_inputs


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as every other element of a buffer twice as wide."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def transposed_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, its last two dimensions laid out the other way round."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


M, E, K, INTER, N, TOP_K = 2, 8, 32, 16, 16, 2
B, T, H, LORA, NOPE, ROPE, S = 1, 2, 2, 32, 16, 8, 10
W = LORA + ROPE
SITU = (2.0, 3.0)


def _moe():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * INTER, K, generator=gen) / 6).bfloat16()
    w2 = (torch.randn(E, N, INTER, generator=gen) / 4).bfloat16()
    logits = torch.randn(M, E, generator=gen)
    bias = 0.1 * torch.randn(E, generator=gen)
    ids, weights = router_topk(logits, bias, TOP_K)
    act = moe_fc1_situ(x, w13, ids, SITU)
    return dict(x=x, w13=w13, w2=w2, logits=logits, bias=bias, ids=ids, weights=weights,
                act=act)


def _mla():
    gen = torch.Generator().manual_seed(1)
    return dict(q=torch.randn(M, H * (NOPE + ROPE), generator=gen).bfloat16(),
                w_uk=(torch.randn(H, NOPE, LORA, generator=gen) / 4).bfloat16(),
                kv=torch.randn(M, W, generator=gen).bfloat16(),
                kv_norm=1 + 0.1 * torch.randn(LORA, generator=gen),
                cache=(0.5 * torch.randn(B, S, W, generator=gen)).bfloat16(),
                positions=torch.tensor([3, 4]),
                qhat=torch.randn(M, H, W, generator=gen).bfloat16(),
                ql=torch.randn(H, M, LORA, generator=gen).bfloat16(),
                parts=torch.randn(2, M, H, LORA, generator=gen),
                lse=torch.randn(2, M, H, generator=gen),
                w_uv=(torch.randn(H, LORA, 16, generator=gen) / 6).bfloat16(),
                gate=torch.randn(M, H * 16, generator=gen).bfloat16())


def _absorb(t, **changed):
    a = {**{k: t[k] for k in ("q", "w_uk", "kv", "kv_norm", "positions")},
         "cache": t["cache"].clone(), **changed}   # (a view given is kept as it is)
    return mla_absorb_insert(a["q"], a["w_uk"], a["kv"], a["kv_norm"], a["cache"],
                             a["positions"], changed.pop("tokens_per_seq", T), 1.0, 1e-5,
                             qhat=changed.get("qhat"))


def _concat(t, **changed):
    a = {"kv_c": t["kv"][:, :LORA], "k_pe": t["kv"][:, LORA:], "positions": t["positions"],
         **changed}
    return mla_concat_insert(t["ql"], t["q"], a["kv_c"], a["k_pe"], t["cache"].clone(),
                             a["positions"], T, 1.0, NOPE)


def _attention(t, **changed):
    a = {"qhat": t["qhat"], "cache": t["cache"], "positions": t["positions"], **changed}
    return mla_attention(a["qhat"], a["cache"], a["positions"], T, LORA, 1.0, 0.2)


def _kda(**changed):
    z, params, conv_state, state = kda_inputs(1, 1, 2, 16, 16, 0)
    a = {"z": z, "conv_state": conv_state, "state": state, **params}
    for name, make in changed.items():
        a[name] = make(a[name]) if callable(make) else make
    return kda_decode(**a)


MOE = _moe()
MLA = _mla()

# (what is wrong, the call, the words of the refusal)
CASES = [
    ("rms_norm weight[::2]",
     lambda: rms_norm(torch.randn(3, 32), strided(torch.randn(32)), 1e-6), "weight must be"),
    ("router_topk bias[::2]",
     lambda: router_topk(MOE["logits"], strided(MOE["bias"]), TOP_K), "bias must be"),
    ("router_topk bias [E/2]",
     lambda: router_topk(MOE["logits"], MOE["bias"][:4], TOP_K), "bias is [4], not [8]"),
    ("l2_prefetch checksums[::2]",
     lambda: l2_prefetch(torch.randn(64), strided(torch.zeros(128))), "checksums must be"),
    ("l2_prefetch checksums [64]",
     lambda: l2_prefetch(torch.randn(64), torch.zeros(64)), "checksums is [64], not [128]"),
    ("l2_prefetch checksums bf16",
     lambda: l2_prefetch(torch.randn(64), torch.zeros(128, dtype=torch.bfloat16)),
     "checksums is torch.bfloat16, not torch.float32"),
    ("attn_res norm [h/2]",
     lambda: attn_res(torch.randn(M, 32), None, torch.randn(M, 3, 32), 2, -1, torch.randn(32),
                      torch.randn(16), 1e-6), "norm is [16], not [32]"),
    ("attn_res qk [h/2]",
     lambda: attn_res(torch.randn(M, 32), None, torch.randn(M, 3, 32), 2, -1, torch.randn(16),
                      None, 1e-6), "qk is [16], not [32]"),
    ("attn_res writing a block it reads",
     lambda: attn_res(torch.randn(M, 32), None, torch.randn(M, 3, 32), 2, 1,
                      torch.randn(32), None, 1e-6), "block 1 is written and among the 2 read"),
    ("mla_attention fp8 e5m2 cache (kv_scale unseen)",
     lambda: _attention(MLA, cache=MLA["cache"].to(torch.float8_e5m2)),
     "cache is torch.float8_e5m2, not torch.bfloat16 or torch.float32 or "
     "torch.float8_e4m3fn"),
    ("mla_absorb_insert fp16 cache",
     lambda: _absorb(MLA, cache=MLA["cache"].half()), "cache is torch.float16, not"),
    ("attn_res blocks 4-D",
     lambda: attn_res(torch.randn(M, 32), None, torch.randn(M, 3, 32, 1), 2, -1,
                      torch.randn(32), None, 1e-6), "is not [M, S, h]"),
    ("skinny_linear norm [K/2]",
     lambda: skinny_linear(torch.randn(M, 32), torch.randn(16, 32), norm=torch.randn(16)),
     "norm is [16], not [32]"),
    ("skinny_linear residual [1, N]",
     lambda: skinny_linear(torch.randn(M, 32), torch.randn(16, 32),
                           residual=torch.randn(1, 16)), "residual is [1, 16], not [2, 16]"),
    ("skinny_linear out [M, N/2]",
     lambda: skinny_linear(torch.randn(M, 32), torch.randn(16, 32), out=torch.empty(M, 8)),
     "out is [2, 8], not [2, 16]"),
    ("mla_absorb_insert q[:, ::2]", lambda: _absorb(MLA, q=strided(MLA["q"])),
     "q must have contiguous rows"),
    ("mla_absorb_insert w_uk transposed",
     lambda: _absorb(MLA, w_uk=transposed_view(MLA["w_uk"])), "w_uk must be contiguous"),
    ("mla_absorb_insert kv[:, ::2]", lambda: _absorb(MLA, kv=strided(MLA["kv"])),
     "kv must have contiguous rows"),
    ("mla_absorb_insert kv_norm[::2]", lambda: _absorb(MLA, kv_norm=strided(MLA["kv_norm"])),
     "kv_norm must be contiguous"),
    ("mla_absorb_insert cache[..., ::2]", lambda: _absorb(MLA, cache=strided(MLA["cache"])),
     "cache must have contiguous rows"),
    ("mla_absorb_insert positions[::2]",
     lambda: _absorb(MLA, positions=strided(MLA["positions"])), "positions must be"),
    ("mla_absorb_insert positions fp32",
     lambda: _absorb(MLA, positions=MLA["positions"].float()), "positions is torch.float32"),
    ("mla_absorb_insert qhat not packed",
     lambda: _absorb(MLA, qhat=torch.zeros(M, H, W + 8).bfloat16()[..., :W]),
     "qhat must be contiguous"),
    ("mla_absorb_insert a sequence a token, one cache row",
     lambda: _absorb(MLA, tokens_per_seq=1), "cache [1, 10, 40] is not [B >= 2 sequences"),
    ("mla_concat_insert positions[::2]",
     lambda: _concat(MLA, positions=strided(MLA["positions"])), "positions must be"),
    ("mla_concat_insert kv_c [M, lora/2]",
     lambda: _concat(MLA, kv_c=MLA["kv"][:, :LORA // 2]), "kv_c is [2, 16], not [2, 32]"),
    ("mla_attention qhat not packed",
     lambda: _attention(MLA, qhat=torch.zeros(M, H, W + 8).bfloat16()[..., :W]),
     "qhat must be contiguous"),
    ("mla_attention cache[..., ::2]", lambda: _attention(MLA, cache=strided(MLA["cache"])),
     "cache must have contiguous rows"),
    ("mla_attention positions [M - 1]",
     lambda: _attention(MLA, positions=MLA["positions"][:1]), "positions is [1], not [2]"),
    ("mla_combine parts[..., ::2]",
     lambda: mla_combine(strided(MLA["parts"]), MLA["lse"], torch.float32),
     "parts must be contiguous"),
    ("mla_combine lse[..., ::2]",
     lambda: mla_combine(MLA["parts"], strided(MLA["lse"]), torch.float32),
     "lse must be contiguous"),
    ("mla_combine lse of one split",
     lambda: mla_combine(MLA["parts"], MLA["lse"][:1], torch.float32),
     "lse is [1, 2, 2], not [2, 2, 2]"),
    ("mla_uv_gate split partials without lse",
     lambda: mla_uv_gate(MLA["parts"], MLA["w_uv"], MLA["gate"], dtype=torch.float32),
     "is not [M, H, kv_lora]"),
    ("mla_uv_gate lse of one split",
     lambda: mla_uv_gate(MLA["parts"], MLA["w_uv"], MLA["gate"], lse=MLA["lse"][:1],
                         dtype=torch.float32), "lse is [1, 2, 2], not [2, 2, 2]"),
    ("mla_uv_gate out [M, H*v/2]",
     lambda: mla_uv_gate(MLA["parts"], MLA["w_uv"], MLA["gate"], lse=MLA["lse"],
                         out=torch.empty(M, 16)), "out is [2, 16], not [2, 32]"),
    ("kda_decode dt_bias[::2]", lambda: _kda(dt_bias=strided), "dt_bias must be contiguous"),
    ("kda_decode a_log[::2]", lambda: _kda(a_log=strided), "a_log must be contiguous"),
    ("kda_decode o_norm[::2]", lambda: _kda(o_norm=strided), "o_norm must be contiguous"),
    ("kda_decode conv_w strided", lambda: _kda(conv_w=strided), "conv_w must be contiguous"),
    ("kda_decode w_fb transposed", lambda: _kda(w_fb=transposed_view),
     "w_fb must be contiguous"),
    ("kda_decode a_log [H + 1]", lambda: _kda(a_log=lambda t: torch.randn(3)),
     "a_log is [3], not [2]"),
    ("kda_decode out[..., ::2]",
     lambda: _kda(out=strided(torch.zeros(1, 1, 32).bfloat16())), "out must have contiguous"),
    ("kda_decode out [B, T, Hd/2]", lambda: _kda(out=torch.zeros(1, 1, 16).bfloat16()),
     "out is [1, 1, 16], not [1, 1, 32]"),
    ("kda_decode z narrower than its parts", lambda: _kda(z=lambda z: z[..., :96]),
     "z's 96 columns cannot hold"),
    ("kda_decode bf16 state", lambda: _kda(state=lambda s: s.bfloat16()),
     "state is torch.bfloat16, not torch.float32"),
    ("kda_decode state of one head", lambda: _kda(state=lambda s: s[:, :1].contiguous()),
     "state is [1, 1, 16, 16], not [1, 2, 16, 16]"),
    ("moe_route_fc1_situ bias[::2]",
     lambda: moe_route_fc1_situ(MOE["x"], MOE["w13"], MOE["logits"], strided(MOE["bias"]),
                                TOP_K, 1.0, SITU), "bias must be contiguous"),
    ("moe_route_fc1_situ bias [E/2]",
     lambda: moe_route_fc1_situ(MOE["x"], MOE["w13"], MOE["logits"], MOE["bias"][:4], TOP_K,
                                1.0, SITU), "bias is [4], not [8]"),
    ("moe_route_fc1_situ w13[..., ::2]",
     lambda: moe_route_fc1_situ(MOE["x"], strided(MOE["w13"]), MOE["logits"], MOE["bias"],
                                TOP_K, 1.0, SITU), "w13 must have contiguous rows"),
    ("moe_fc1_situ x [M, K/2]",
     lambda: moe_fc1_situ(MOE["x"][:, :K // 2], MOE["w13"], MOE["ids"], SITU),
     "x is [2, 16], not [2, 32]"),
    ("moe_fc1_situ ids of one token",
     lambda: moe_fc1_situ(MOE["x"], MOE["w13"], MOE["ids"][:1], SITU), "ids is [1, 2]"),
    ("moe_fc1_situ out [M, k, I/2]",
     lambda: moe_fc1_situ(MOE["x"], MOE["w13"], MOE["ids"], SITU,
                          out=torch.empty(M, TOP_K, INTER // 2).bfloat16()), "act is [2, 2, 8]"),
    ("moe_fc2_combine w2[..., ::2]",
     lambda: moe_fc2_combine(MOE["act"], strided(MOE["w2"]), MOE["ids"], MOE["weights"]),
     "w2 must have contiguous rows"),
    ("moe_fc2_combine act of I/2",
     lambda: moe_fc2_combine(MOE["act"][..., :INTER // 2].contiguous(), MOE["w2"], MOE["ids"],
                             MOE["weights"]), "for act of 8 columns"),
    ("moe_fc2_combine out [M, N/2]",
     lambda: moe_fc2_combine(MOE["act"], MOE["w2"], MOE["ids"], MOE["weights"],
                             out=torch.empty(M, N // 2)), "out is [2, 8], not [2, 16]"),
    ("moe_finalize weights of one token",
     lambda: moe_finalize(torch.randn(M, TOP_K, N), MOE["weights"][:1].contiguous(),
                          torch.float32), "weights is [1, 2], not [2, 2]"),
    ("moe_grouped_fc2 counts[::2]",
     lambda: moe_grouped_fc2(MOE["act"], MOE["w2"],
                             ExpertSlots(torch.zeros(E, M, dtype=torch.int32),
                                         strided(torch.zeros(E, dtype=torch.int32))),
                             MOE["weights"], torch.zeros(M, N)), "the slots of 8 experts"),
]


@pytest.mark.parametrize(("call", "said"), [(call, said) for _, call, said in CASES],
                         ids=[name for name, _, _ in CASES])
def test_a_layout_the_kernel_would_read_wrong_is_refused(call, said):
    with pytest.raises(ValueError, match="^.*" + said.replace("[", r"\[").replace("(", r"\(")):
        call()


def test_tensors_on_two_devices_are_refused():
    """A kernel reads every pointer on its launch's device: one tensor elsewhere is another
    device's address (the meta device stands in for a GPU here), whichever of the wrapper's
    tensors it is."""
    with pytest.raises(ValueError, match=r"rms_norm: x is on cpu, the others on meta: all "):
        rms_norm(torch.randn(2, 4), torch.empty(4, device="meta"), 1e-6)
    for changed in ({"qhat": MLA["qhat"].to("meta")}, {"cache": MLA["cache"].to("meta")},
                    {"positions": MLA["positions"].to("meta")}):
        with pytest.raises(ValueError, match=r"mla_attention: .* all must be on one device"):
            _attention(MLA, **changed)
    with pytest.raises(ValueError, match=r"kda_decode: f is on meta, the others on cpu"):
        _kda(f=torch.empty(1, 1, 32, device="meta"))
    # (a standard-path kernel that checked its shapes alone)
    with pytest.raises(ValueError, match=r"gate_sigmoid_mul: gate is on meta"):
        gate_sigmoid_mul(torch.randn(2, 3, 8), torch.empty(3, 16, device="meta"))


def test_a_shape_of_no_tensor_given_is_a_mistake_of_the_wrapper():
    """A misspelt name in ``shapes`` or ``dtypes`` would check nothing without a word."""
    with pytest.raises(TypeError, match="check_layout: rms_norm names no tensor 'wieght'"):
        check_layout("rms_norm", {"weight": torch.randn(4)}, {}, {"wieght": (4,)})
