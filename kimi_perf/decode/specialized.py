"""The latency-specialized decode path (``decode_backend: latency_specialized``).

Same math and weights as the standard path, fewer and fused kernels (``kernels/``, installed
as ``kimi_perf_kernels``). Per KDA layer, at TP 1 (TP > 1 adds the all-reduces)::

    S1  attn_res_pre          fold + block write + depth mix + input RMSNorm
    S2  in_proj               skinny GEMV (M <= 4) or GEMM (larger M)
    S3  fused_kda_decode      f_b projection, gates, conv4, L2 norm, recurrence, gated norm
    S4  o_proj
    S1' attn_res_post         prefix update + mix + post-attention RMSNorm
    S5  router_latent_down    one pass over h for [W_gate; W_down] (fp32 out)
    S7  moe_fc1_situ_shared_gate_up
                              top-k routing in the prologue (S6: sigmoid + bias + top-k +
                              renormalise), then the routed experts' gate/up + SiTU; in the
                              same grid, the shared experts' gate/up + SiTU over h (S9)
    S8  moe_fc2_combine_shared_down
                              routed experts' down + weighted sum over the k slots; in the
                              same grid, the shared experts' down-projection (S10)
    S12 latent_up_proj        routed RMSNorm (in the GEMV's pass) + up-projection +
                              shared add

9 launches where the standard path makes 18. The shared experts need no stream of their own:
their tiles share the routed experts' two grids and run beside them. With TP > 1 two
all-reduces follow (o_proj's, and one, in place, for the routed latent and the shared
experts, which FC2 writes side by side): 11 against 21; fusing them into the GEMMs needs a GPU
collective (symmetric memory) and is not done yet. Per gated-MLA layer (12 against 24 at TP 1,
14 against 27 with TP)::

    S1  attn_res_pre
    M2  qkv_a_g_proj          one pass over x for [W_q_a; W_kv_a; W_g]
    M3  q_b_proj              q_a RMSNorm in the GEMV's pass (1/rms after the loop)
    M4  bmm_w_uk_cache_insert q_nope · W_UK per head; kv RMSNorm into the cache (an fp8
                              cache: the entry and q̂ both fp8)
    M5  mla_decode            all heads of a token over the latent cache, online softmax,
                              split over the positions when the batch is small
    M6  bmm_w_uv_gate         o_lat · W_UV per head (the splits' partials merged after the
                              dot), times σ(g)
    M7  o_proj
    S1' attn_res_post, then the MoE launches above (S5-S12)

With ``l2_prefetch`` (opt-in until a GPU run shows it pays) each layer adds one launch on a
second stream: o_proj's weights read into L2 beside S3 (KDA) or M5-M6 (MLA), so that o_proj
streams them from L2 (``kernels/l2_prefetch.py``); the join comes after o_proj, which never
waits for it: 10 / 13 launches, 12 / 15 with TP.

With ``group_experts_from=n`` (opt-in until a GPU run shows from which batch it pays), a step
of n tokens or more routes in a launch of its own (``router_topk``, which also zeroes the
routed latent) and runs S7 and S8 grouped by expert (``moe_grouped_fc1_situ_shared_gate_up``,
``moe_grouped_fc2_shared_down``): each picked expert's weights streamed once for all the
tokens that picked it, where S7 and S8 stream them once per (token, slot), and each expert's
weighted share added into its tokens' rows (fp32 atomics: the last bits of the sum vary from
run to run). At batch 64 × top-16 that is about 613 experts' weights where S7 and S8 read
1,024: 10 / 13 launches per layer, 12 / 15 with TP (whose MoE all-reduce then sends fp32).

With ``pdl`` (opt-in until a GPU run shows it pays) every launch above uses programmatic
dependent launch (sm_90+): a kernel's programs start while the one before still runs and wait
for it on their first instruction (``kernels/common.py``), so that the launch gaps between a
layer's 9 to 12 kernels overlap their predecessors' tails. No launch more. With
``pdl_prefetch_bytes`` too, each skinny linear (S2, S4, S5, S12, M2, M3, M7) first reads up to
that many bytes of its weights into L2, before it waits: weights stream while the kernel
before it, latency-bound, leaves HBM idle.

With ``gemv`` (opt-in, GPU only: the CuTe DSL GEMV's cubins, ``kernels/cute_gemv.py``) the
plain projections (in_proj, qkv_a_g_proj, o_proj) at 1-4 tokens take that GEMV in place of
the Triton one, wherever it has a build for the shape: the same launches.

It applies to pure decode steps (batch 1-64, one token each) and to speculative verify steps
(1+k tokens, k <= 7). Anything else, prefill included, falls back to the standard path, and
``fallbacks`` says which calls did and why.
"""

from __future__ import annotations

import torch

from kimi_perf.decode.config import K3Config
from kimi_perf.decode.kernel_path import KernelPathModel
from kimi_perf.decode.model import DecodeState, K3Model
from kimi_perf.decode.standard_kernels import StandardKernelsModel
from kimi_perf.decode.weights import Weights, layer_prefix
from kimi_perf_kernels.l2_prefetch import PROGRAMS, l2_prefetch
from kimi_perf_kernels.mla_absorb_insert import mla_absorb_insert
from kimi_perf_kernels.mla_attention import mla_attention
from kimi_perf_kernels.mla_uv_gate import mla_uv_gate
from kimi_perf_kernels.moe_experts import moe_fc2_combine, moe_route_fc1_situ
from kimi_perf_kernels.moe_grouped_fc1 import moe_grouped_fc1_situ
from kimi_perf_kernels.moe_grouped_fc2 import moe_grouped_fc2
from kimi_perf_kernels.router_topk import router_topk
from kimi_perf_kernels.skinny_linear import skinny_linear


class SpecializedModel(KernelPathModel):
    def __init__(self, c: K3Config, weights: Weights, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", all_reduce=None, l2_prefetch: bool = False,
                 gemv=None, group_experts_from: int | None = None, pdl: bool = False,
                 pdl_prefetch_bytes: int = 0, experts: str = "bf16"):
        if group_experts_from is not None and group_experts_from < 1:
            raise ValueError(f"group_experts_from: a token count of 1 or more (from that "
                             f"many tokens a step on, the routed experts run grouped by "
                             f"expert), not {group_experts_from}")
        super().__init__(c, weights, dtype=dtype, device=device, all_reduce=all_reduce,
                         experts=experts)
        # Opt-in until a GPU run shows it pays (benchmarks/gpu_decode_check.py measures both):
        # every kernel launched with programmatic dependent launch (sm_90+), so that the next
        # launch's start overlaps the tail of the one before (kernels/common.py); with
        # ``pdl_prefetch_bytes``, each skinny linear also reads up to that many bytes of its
        # weights into L2 before it waits (kernels/skinny_linear.py).
        self.pdl = pdl
        self.pdl_prefetch_bytes = pdl_prefetch_bytes
        # Opt-in until a GPU run shows where it pays: from this many tokens a step on, route
        # in a launch of its own and stream each picked expert's W13 and W2 once for all its
        # tokens (kernels/moe_grouped_fc1.py, moe_grouped_fc2.py), one launch more per MoE
        # layer.
        self.group_experts_from = group_experts_from
        # Opt-in, on a GPU, until a GPU run shows it beats the Triton GEMV: another GEMV for
        # the plain projections (kimi_perf_kernels.cute_gemv.CubinGemv, the CuTe DSL one),
        # used wherever it has a build for the shape (``builds``: (M, N, K) keys).
        self.gemv = gemv
        # Opt-in until a GPU run shows it pays (benchmarks/gpu_decode_check.py measures both):
        # o_proj's weights read into L2 on a second stream beside the layer's latency-bound
        # attention kernels (kernels/l2_prefetch.py), one launch more per layer.
        self.l2_prefetch = l2_prefetch
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.prefetch_checksums = torch.empty(PROGRAMS, dtype=torch.float32, device=self.device)
        for i in range(c.n_layers):
            p = layer_prefix(i)
            packed = self.packed[i]
            if c.is_mla(i):
                a = p + "self_attn."
                packed["qkv_a_g"] = self.pack_rows([a + "q_a_proj.weight",
                                                    a + "kv_a_proj_with_mqa.weight",
                                                    a + "g_proj.weight"])
                packed["qkv_a"] = packed["qkv_a_g"][: len(packed["qkv_a"])]
            if i > 0:
                m = p + "mlp."
                packed["router_down"] = self.pack_rows([m + "gate.weight",
                                                        m + "routed_expert_down_proj.weight"])

    def lm_head(self, out: torch.Tensor) -> torch.Tensor:
        self.launch("lm_head")  # the final RMSNorm rides in the GEMV's pass
        return skinny_linear(out, self.w["lm_head.weight"], norm=self.w["model.norm.weight"],
                             out_dtype=torch.float32, eps=self.c.rms_eps)

    def kda_layer(self, i: int, x: torch.Tensor, state: DecodeState, B: int, T: int,
                  verify: bool) -> torch.Tensor:
        a = layer_prefix(i) + "self_attn."
        self.launch("in_proj")
        z = self.plain_linear(x, self.packed[i]["in_proj"])
        self.start_prefetch(self.w[a + "o_proj.weight"])
        self.launch("fused_kda_decode")
        o = self.fused_kda_decode(i, z, state, B, T, verify)
        self.launch("o_proj")
        out = self.plain_linear(o.view(B * T, -1), self.w[a + "o_proj.weight"])
        self.join_prefetch()
        return self._all_reduce(out)

    def mla_layer(self, i: int, x: torch.Tensor, state: DecodeState, positions: torch.Tensor,
                  T: int) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        p = self.packed[i]
        kv_end = c.q_lora + c.kv_cache_dim
        self.launch("qkv_a_g_proj")
        z = self.plain_linear(x, p["qkv_a_g"])
        q_c, kv, gate = z[:, : c.q_lora], z[:, c.q_lora: kv_end], z[:, kv_end:]
        self.launch("q_b_proj")
        q = skinny_linear(q_c, self.w[a + "q_b_proj.weight"],
                          norm=self.w[a + "q_a_layernorm.weight"], eps=c.rms_eps)
        self.launch("bmm_w_uk_cache_insert")
        cache = state.kv[i]
        qhat = mla_absorb_insert(q, p["w_uk"], kv, self.w[a + "kv_a_layernorm.weight"], cache,
                                 positions, T, state.kv_scale, c.rms_eps,
                                 q_scale=state.q_scale)
        self.start_prefetch(self.w[a + "o_proj.weight"])
        self.launch("mla_decode")
        splits = self.mla_splits_for(x.shape[0] // T, T, state, i)
        parts, lse = mla_attention(qhat, cache, positions, T, c.kv_lora, state.kv_scale,
                                   (c.qk_nope + c.qk_rope) ** -0.5, splits,
                                   q_scale=state.q_scale, dtype=self.dtype)
        self.launch("bmm_w_uv_gate")  # merges the splits too
        o = mla_uv_gate(parts if lse is not None else parts[0], p["w_uv"], gate, lse=lse,
                        dtype=self.dtype)
        self.launch("o_proj")
        out = self.plain_linear(o, self.w[a + "o_proj.weight"])
        self.join_prefetch()
        return self._all_reduce(out)

    def dense_mlp(self, h: torch.Tensor) -> tuple[torch.Tensor, None]:
        c = self.c
        m = layer_prefix(0) + "mlp."
        self.launch("dense_gate_up_situ")
        act = skinny_linear(h, self.packed[0]["gate_up"],
                            situ=(c.situ_beta, c.situ_beta_linear))
        self.launch("dense_down")
        out = skinny_linear(act, self.w[m + "down_proj.weight"])
        return self._all_reduce(out), None

    def moe(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        m = layer_prefix(i) + "mlp."
        p = self.packed[i]
        situ = (c.situ_beta, c.situ_beta_linear)
        grouped = self.group_experts_from is not None and h.shape[0] >= self.group_experts_from
        # The routed latent and the shared experts' output side by side, so that one
        # all-reduce sums both under TP and the tail reads both from where FC2 wrote them. In
        # fp32 on one rank; under TP in the model's dtype, as the standard path's two
        # all-reduces send them: half the bytes on the wire (grouped, fp32 throughout: the
        # experts' shares are added into it).
        acc = torch.float32 if self.all_reduce is None or grouped else self.dtype
        moe_out = h.new_empty(h.shape[0], c.latent + c.hidden, dtype=acc)
        routed, shared = moe_out[:, : c.latent], moe_out[:, c.latent:]
        self.launch("router_latent_down")
        both = skinny_linear(h, p["router_down"], out_dtype=torch.float32)
        logits, latent = both[:, : c.n_experts], both[:, c.n_experts:]
        shared_act = h.new_empty(h.shape[0], p["shared_gate_up"].shape[0] // 2)
        bias = self.w[m + "gate.e_score_correction_bias"]
        shared_fc1 = (h, p["shared_gate_up"], shared_act)
        shared_fc2 = (shared_act, self.w[m + "shared_experts.down_proj.weight"], shared)
        if grouped:   # routing first, then each picked expert streamed once for its tokens
            self.launch("router_topk")
            ids, weights = router_topk(logits, bias, c.top_k, c.routed_scale, zero=routed)
            self.launch("moe_grouped_fc1_situ_shared_gate_up")
            act, slots = moe_grouped_fc1_situ(latent, self.expert_weights(i, "w13"), ids,
                                              situ, shared=shared_fc1)
            self.launch("moe_grouped_fc2_shared_down")
            moe_grouped_fc2(act, self.expert_weights(i, "w2"), slots, weights, routed,
                            shared=shared_fc2)
        else:
            self.launch("moe_fc1_situ_shared_gate_up")
            act, ids, weights = moe_route_fc1_situ(latent, self.expert_weights(i, "w13"),
                                                   logits, bias, c.top_k, c.routed_scale, situ,
                                                   shared=shared_fc1)
            self.launch("moe_fc2_combine_shared_down")
            moe_fc2_combine(act, self.expert_weights(i, "w2"), ids, weights, out=routed,
                            shared=shared_fc2)
        if self.all_reduce is not None:
            moe_out = self._all_reduce(moe_out, "moe_all_reduce")
            routed, shared = moe_out[:, : c.latent], moe_out[:, c.latent:]
        self.launch("latent_up_proj")
        out = skinny_linear(routed, self.w[m + "routed_expert_up_proj.weight"],
                            norm=self.w[m + "routed_expert_norm.weight"], residual=shared,
                            out_dtype=self.dtype, eps=c.rms_eps)
        return out, ids


    def plain_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The projections without fusions (in_proj, qkv_a_g_proj, o_proj): the Triton
        GEMV / GEMM, or ``gemv`` where it has a build for (M, N, K)."""
        if self.gemv is not None and (x.shape[0], *w.shape) in self.gemv.builds:
            return self.gemv(x, w)
        return skinny_linear(x, w)

    def start_prefetch(self, weight: torch.Tensor) -> None:
        """With ``l2_prefetch``: ``weight`` read into L2 on the side stream from here on (a
        fork; on a CPU it simply runs now). ``join_prefetch`` joins it after the launch that
        reads the weight, so that launch never waits for the prefetch to finish."""
        if not self.l2_prefetch:
            return
        self.launch("l2_prefetch")
        if self.side_stream is None:
            l2_prefetch(weight, self.prefetch_checksums)
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            l2_prefetch(weight, self.prefetch_checksums)

    def join_prefetch(self) -> None:
        if self.l2_prefetch and self.side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)


def build_model(c: K3Config, weights: Weights, decode_backend: str = "auto",
                dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                all_reduce=None, standard_ops: str | None = None, l2_prefetch: bool = False,
                group_experts_from: int | None = None, pdl: bool = False,
                experts: str = "bf16") -> K3Model:
    """``auto`` keeps the standard path; ``latency_specialized`` selects the fused one, with
    its opt-ins ``l2_prefetch``, ``group_experts_from`` and ``pdl`` (``SpecializedModel``; the
    standard path has none). ``experts="mxfp4"``: the kernel paths' expert launches stream
    the routed experts as MXFP4; the PyTorch ops compute on the same values (the weights must
    hold MXFP4 values, ``mxfp4_experts``: every path refuses others).

    ``standard_ops``: how the standard path runs its decode steps: ``kernels``, one kernel per
    step as vLLM launches them (``StandardKernelsModel``; the default on a GPU), or ``torch``,
    PyTorch ops (the default on a CPU, where Triton runs in its interpreter). An option the
    chosen path does not take is a ValueError (not ignored)."""
    if decode_backend == "latency_specialized" and standard_ops is not None:
        raise ValueError("standard_ops chooses how the standard path (decode_backend='auto') "
                         "runs; the latency-specialized path has its own kernels")
    if decode_backend == "latency_specialized":
        return SpecializedModel(c, weights, dtype=dtype, device=device, all_reduce=all_reduce,
                                l2_prefetch=l2_prefetch, group_experts_from=group_experts_from,
                                pdl=pdl, experts=experts)
    if decode_backend != "auto":
        raise ValueError(f"decode_backend must be auto or latency_specialized, not "
                         f"{decode_backend!r}")
    opted = [name for name, given in (("l2_prefetch", l2_prefetch), ("pdl", pdl),
                                      ("group_experts_from", group_experts_from is not None))
             if given]
    if opted:
        raise ValueError(f"{', '.join(opted)}: the latency-specialized path's opt-ins "
                         "(decode_backend='latency_specialized'); the standard path has none")
    if standard_ops is None:
        standard_ops = "kernels" if torch.device(device).type == "cuda" else "torch"
    if standard_ops == "kernels":
        return StandardKernelsModel(c, weights, dtype=dtype, device=device,
                                    all_reduce=all_reduce, experts=experts)
    if standard_ops != "torch":
        raise ValueError(f"standard_ops must be kernels or torch, not {standard_ops!r}")
    return K3Model(c, weights, dtype=dtype, device=device, all_reduce=all_reduce,
                   experts=experts)
