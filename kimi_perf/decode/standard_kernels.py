"""The standard path as vLLM runs it on a GPU: one kernel per step of its sequence.

``K3Model`` writes vLLM's standard decode sequence as PyTorch ops, and documents it; on a GPU
each of its fused ops (the attention residuals, ``fused_kda_decode``, top-k, ...) would then
launch a dozen small kernels, and the comparison with the specialized path would be against
PyTorch's eager overhead rather than vLLM's kernels. Here every step is one launch, with the
same names: GEMMs and bmms as cuBLAS calls, vLLM's fused ops as Triton kernels from
``kernels/`` that fuse what vLLM's fuse and no more. Per KDA layer, at TP 1::

    attn_res_pre         attn_res (the same kernel as the specialized path: vLLM's is fused)
    in_proj_qkvgfab      GEMM
    f_b_proj             GEMM
    fused_kda_decode     kda_decode with the f_b projection given (conv, gates, recurrence,
                         gated RMSNorm)
    o_proj               GEMM
    attn_res_post        attn_res
    router_gemm          skinny_linear, fp32 out (vLLM's router GEMM writes fp32)
    latent_down_proj     GEMM
    topk                 router_topk
    moe_fc1_situ         moe_fc1_situ (routed by topk)
    moe_fc2              moe_fc2 (every slot on its own)
    moe_finalize         moe_finalize: the weighted sum over the slots
    shared_gate_up       GEMM
    shared_situ_and_mul  situ_and_mul
    shared_down          GEMM
    latent_rmsnorm       rms_norm
    latent_up_proj       GEMM
    moe_add              add

18 launches, as ``K3Model`` annotates; with TP > 1 o_proj's all-reduce, the latent's (vLLM
fuses it with the latent RMSNorm in FlashInfer; here they are two launches) and the shared
experts' add three. A gated-MLA layer replaces the four KDA launches with
fused_qkv_a_proj, g_proj (GEMMs), fused_q_kv_rmsnorm (rms_norm of q_c and kv_c in one launch),
q_b_proj (GEMM), bmm_w_uk (bmm), q_concat_kv_cache_insert (mla_concat_insert), mla_decode
(mla_attention, as the specialized path; when it splits the cache positions, as at small
batches on a GPU, mla_decode_combine follows, as FlashMLA's second launch), bmm_w_uv (bmm),
gate_sigmoid_mul, o_proj (GEMM): 24 launches, 25 where the attention is split (on a GPU at
K3 TP8 shapes up to batch 64: ``kernels.mla_attention.mla_splits``).
"""

from __future__ import annotations

import torch

from kimi_perf.decode.kernel_path import KernelPathModel
from kimi_perf.decode.model import DecodeState
from kimi_perf.decode.weights import layer_prefix
from kimi_perf_kernels.gate_sigmoid_mul import gate_sigmoid_mul
from kimi_perf_kernels.mla_attention import mla_attention, mla_combine
from kimi_perf_kernels.mla_concat_insert import mla_concat_insert
from kimi_perf_kernels.moe_experts import moe_fc1_situ, moe_fc2, moe_finalize
from kimi_perf_kernels.rms_norm import rms_norm
from kimi_perf_kernels.router_topk import router_topk
from kimi_perf_kernels.situ_and_mul import situ_and_mul
from kimi_perf_kernels.skinny_linear import skinny_linear


class StandardKernelsModel(KernelPathModel):
    def kda_layer(self, i: int, x: torch.Tensor, state: DecodeState, B: int, T: int,
                  verify: bool) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        proj = c.kda_heads_local * c.kda_head_dim
        self.launch("in_proj_qkvgfab")
        z = x @ self.packed[i]["in_proj"].T
        self.launch("f_b_proj")
        f = z[:, 4 * proj: 4 * proj + c.f_rank] @ self.w[a + "f_b_proj.weight"].T
        self.launch("fused_kda_decode")
        o = self.fused_kda_decode(i, z, state, B, T, verify, f=f.view(B, T, proj))
        self.launch("o_proj")
        out = o.view(B * T, proj) @ self.w[a + "o_proj.weight"].T
        return self._all_reduce(out)

    def mla_layer(self, i: int, x: torch.Tensor, state: DecodeState, positions: torch.Tensor,
                  T: int) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        p = self.packed[i]
        M, H = x.shape[0], c.mla_heads_local
        lora_end = c.q_lora + c.kv_lora
        self.launch("fused_qkv_a_proj")
        qkv_a = x @ p["qkv_a"].T
        self.launch("g_proj")  # on vLLM's aux stream
        gate = x @ self.w[a + "g_proj.weight"].T
        self.launch("fused_q_kv_rmsnorm")
        q_c, kv_c = rms_norm(qkv_a[:, : c.q_lora], self.w[a + "q_a_layernorm.weight"],
                             c.rms_eps, second=(qkv_a[:, c.q_lora: lora_end],
                                                self.w[a + "kv_a_layernorm.weight"]))
        self.launch("q_b_proj")
        q = q_c @ self.w[a + "q_b_proj.weight"].T                       # [M, H·(nope+rope)]
        self.launch("bmm_w_uk")
        q_nope = q.view(M, H, c.qk_nope + c.qk_rope)[..., : c.qk_nope].transpose(0, 1)
        ql = torch.bmm(q_nope, p["w_uk"])                                 # [H, M, kv_lora]
        self.launch("q_concat_kv_cache_insert")
        qhat = mla_concat_insert(ql, q, kv_c, qkv_a[:, lora_end:], state.kv[i], positions, T,
                                 state.kv_scale, c.qk_nope, q_scale=state.q_scale)
        self.launch("mla_decode")
        splits = self.mla_splits_for(x.shape[0] // T, T, state, i)
        parts, lse = mla_attention(qhat, state.kv[i], positions, T, c.kv_lora, state.kv_scale,
                                   (c.qk_nope + c.qk_rope) ** -0.5, splits,
                                   q_scale=state.q_scale, dtype=self.dtype)
        if lse is None:
            o_lat = parts[0]
        else:  # FlashMLA's second launch
            self.launch("mla_decode_combine")
            o_lat = mla_combine(parts, lse, self.dtype)
        self.launch("bmm_w_uv")
        o = torch.bmm(o_lat.transpose(0, 1), p["w_uv"])                   # [H, M, v]
        self.launch("gate_sigmoid_mul")
        o = gate_sigmoid_mul(o, gate)
        self.launch("o_proj")
        out = o @ self.w[a + "o_proj.weight"].T
        return self._all_reduce(out)

    def dense_mlp(self, h: torch.Tensor) -> tuple[torch.Tensor, None]:
        c = self.c
        self.launch("dense_gate_up")
        gate_up = h @ self.packed[0]["gate_up"].T
        self.launch("dense_situ_and_mul")
        act = situ_and_mul(gate_up, (c.situ_beta, c.situ_beta_linear))
        self.launch("dense_down")
        out = act @ self.w[layer_prefix(0) + "mlp.down_proj.weight"].T
        return self._all_reduce(out), None

    def moe(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        m = layer_prefix(i) + "mlp."
        p = self.packed[i]
        situ = (c.situ_beta, c.situ_beta_linear)
        self.launch("router_gemm")
        logits = skinny_linear(h, self.w[m + "gate.weight"], out_dtype=torch.float32)
        self.launch("latent_down_proj")  # on vLLM's aux stream, beside the router
        latent = h @ self.w[m + "routed_expert_down_proj.weight"].T
        self.launch("topk")
        ids, weights = router_topk(logits, self.w[m + "gate.e_score_correction_bias"], c.top_k,
                                   c.routed_scale)
        self.launch("moe_fc1_situ")
        act = moe_fc1_situ(latent, self.expert_weights(i, "w13"), ids, situ)
        self.launch("moe_fc2")
        per_slot = moe_fc2(act, self.expert_weights(i, "w2"), ids)       # [M, k, latent]
        self.launch("moe_finalize")
        routed = moe_finalize(per_slot, weights, self.dtype)
        self.launch("shared_gate_up")
        gate_up = h @ p["shared_gate_up"].T
        self.launch("shared_situ_and_mul")
        shared_act = situ_and_mul(gate_up, situ)
        self.launch("shared_down")
        shared = shared_act @ self.w[m + "shared_experts.down_proj.weight"].T
        routed = self._all_reduce(routed, "latent_all_reduce")
        self.launch("latent_rmsnorm")
        routed = rms_norm(routed, self.w[m + "routed_expert_norm.weight"], c.rms_eps)
        self.launch("latent_up_proj")
        up = routed @ self.w[m + "routed_expert_up_proj.weight"].T
        shared = self._all_reduce(shared, "shared_all_reduce")
        self.launch("moe_add")
        return up + shared, ids

    def lm_head(self, out: torch.Tensor) -> torch.Tensor:
        self.launch("final_norm")
        out = rms_norm(out, self.w["model.norm.weight"], self.c.rms_eps)
        self.launch("lm_head")
        return skinny_linear(out, self.w["lm_head.weight"], out_dtype=torch.float32)
