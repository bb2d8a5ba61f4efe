"""The float64 reference: the model's math written plainly, one token at a time.

Independent of the decode paths on purpose: no packed projections, no absorbed MLA (attention
runs over decompressed keys and values), no fused kernels, no bf16 rounding, full (TP=1)
weights. ``kimi-perf validate`` and the tests compare every path against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kimi_perf.decode.config import K3Config
from kimi_perf.decode.weights import Weights, layer_prefix

F64 = torch.float64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_linear: float
         ) -> torch.Tensor:
    """SiTU: beta·tanh(gate/beta)·σ(gate) times beta_linear·tanh(up/beta_linear)."""
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
        beta_linear * torch.tanh(up / beta_linear))


def attn_res_mix(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Depth attention over block states and the running prefix ([B, hidden] each)."""
    v = torch.stack(sources)                                   # [S, B, h]
    logits = (rms_norm(v, norm_w, eps) * proj_w.reshape(-1)).sum(-1)   # [S, B]
    p = torch.softmax(logits, dim=0)
    return (p[..., None] * v).sum(0)


@dataclass
class Observer:
    """What a forward pass saw: per layer, the attention and MLP outputs and the routing
    (the paths record [B, T, ...] for their T positions, the reference [B, ...])."""

    attn_out: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_out: dict[int, torch.Tensor] = field(default_factory=dict)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    # Reference only, when it follows a path's routing, per sequence of its batch: how far
    # below its own k-th best biased score the path's choice fell (0 where they agree), and
    # whether the choice was no top-k at all (1: an expert twice, or one that does not exist;
    # the reference routes those its own way).
    routing_gap: dict[int, list[float]] = field(default_factory=dict)
    routing_invalid: dict[int, list[int]] = field(default_factory=dict)

    def record(self, layer: int, attn_out: torch.Tensor, mlp_out: torch.Tensor,
               experts: torch.Tensor | None, batch: int, tokens: int) -> None:
        """A path's outputs for one layer, as [B, T, ...] whatever layout the path keeps."""
        self.attn_out[layer] = attn_out.float().reshape(batch, tokens, -1)
        self.mlp_out[layer] = mlp_out.float().reshape(batch, tokens, -1)
        if experts is not None:
            self.experts[layer] = experts.reshape(batch, tokens, -1).long()


class ReferenceModel:
    """Float64 decode for a batch of B sequences, one token position per ``step``."""

    def __init__(self, c: K3Config, weights: Weights, batch: int):
        if c.tp != 1:
            raise ValueError("the reference runs the full model (tp=1)")
        self.c = c
        self.w = {k: v.to(F64) for k, v in weights.items()}
        self.batch = batch
        d, hk = c.kda_head_dim, c.kda_heads
        self.kda_state = {i: torch.zeros(batch, hk, d, d, dtype=F64)
                          for i in range(c.n_layers) if not c.is_mla(i)}
        self.conv_history = {i: torch.zeros(batch, 3 * hk * d, c.conv_size - 1, dtype=F64)
                             for i in self.kda_state}
        self.kv_cache = {i: torch.zeros(batch, 0, c.kv_cache_dim, dtype=F64)
                         for i in range(c.n_layers) if c.is_mla(i)}

    def snapshot(self) -> tuple[dict, dict, dict]:
        """The decode state, to ``restore`` after a rejected draft. Shallow copies suffice:
        ``step`` rebinds the state's tensors and never writes one in place."""
        return dict(self.kda_state), dict(self.conv_history), dict(self.kv_cache)

    def restore(self, saved: tuple[dict, dict, dict]) -> None:
        self.kda_state, self.conv_history, self.kv_cache = (dict(d) for d in saved)

    def W(self, name: str) -> torch.Tensor:
        return self.w[name]

    def step(self, tokens: torch.Tensor, observer: Observer | None = None,
             routing: dict[int, torch.Tensor] | None = None,
             follow: Observer | None = None) -> torch.Tensor:
        """Logits [B, vocab] for one new token per sequence ([B] ids).

        ``routing`` (layer -> [B, top_k] expert ids) makes the reference use a path's expert
        choice: top-k is discrete, and a near tie that bf16 rounding tips the other way would
        otherwise swamp every later comparison. How far the path's choice is from the
        reference's own is recorded in ``observer.routing_gap``.

        ``follow`` (a path's attention and MLP outputs per layer, [B, hidden]) makes the
        reference go on from the path's outputs rather than its own after each layer: every
        layer then sees the path's inputs, and what ``observer`` records is that layer's own
        error, not the rounding of the layers below it grown through the depth.
        """
        c, eps = self.c, self.c.rms_eps
        prefix = self.W("model.embed_tokens.weight")[tokens]
        blocks: list[torch.Tensor] = []
        delta = None
        for i in range(c.n_layers):
            p = layer_prefix(i)
            if delta is not None:
                prefix = prefix + delta
            boundary = i % c.attn_res_block == 0
            if boundary:
                blocks.append(prefix)
            n_done = math.ceil(i / c.attn_res_block)
            x = attn_res_mix([*blocks[:n_done], prefix], self.W(p + "self_attention_res_norm"
                             ".weight"), self.W(p + "self_attention_res_proj.weight"), eps)
            x = rms_norm(x, self.W(p + "input_layernorm.weight"), eps)
            a = self._mla(i, x) if c.is_mla(i) else self._kda(i, x)
            if observer is not None:
                observer.attn_out[i] = a
            if follow is not None:
                a = follow.attn_out[i].to(F64)
            prefix = a if boundary else prefix + a
            n_done = math.ceil(i / c.attn_res_block) + int(boundary)
            h = attn_res_mix([*blocks[:n_done], prefix], self.W(p + "mlp_res_norm.weight"),
                             self.W(p + "mlp_res_proj.weight"), eps)
            h = rms_norm(h, self.W(p + "post_attention_layernorm.weight"), eps)
            forced = routing.get(i) if routing else None
            m, chosen, gap, invalid = self._dense(h) if i == 0 else self._moe(i, h, forced)
            if observer is not None:
                observer.mlp_out[i] = m
                if chosen is not None:
                    observer.experts[i] = chosen
                    observer.routing_gap[i] = gap
                    observer.routing_invalid[i] = invalid
            delta = m if follow is None else follow.mlp_out[i].to(F64)
        prefix = prefix + delta
        out = attn_res_mix([*blocks, prefix], self.W("model.output_attn_res_norm.weight"),
                           self.W("model.output_attn_res_proj.weight"), eps)
        out = rms_norm(out, self.W("model.norm.weight"), eps)
        return out @ self.W("lm_head.weight").T

    # -- KDA ------------------------------------------------------------------------------

    def _kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        B, H, d = self.batch, c.kda_heads, c.kda_head_dim
        q, k, v = (x @ self.W(a + f"{n}_proj.weight").T for n in "qkv")
        raw = torch.cat([q, k, v], dim=-1)                            # [B, 3Hd] pre-conv
        taps = torch.cat([self.W(a + f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"])
        window = torch.cat([self.conv_history[i], raw[..., None]], dim=-1)   # oldest first
        self.conv_history[i] = window[..., 1:]
        mixed = torch.nn.functional.silu((window * taps).sum(-1))
        q, k, v = (t.reshape(B, H, d) for t in mixed.split(H * d, dim=-1))
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        f = (x @ self.W(a + "f_a_proj.weight").T) @ self.W(a + "f_b_proj.weight").T
        f = (f + self.W(a + "dt_bias")).reshape(B, H, d)
        A = torch.exp(self.W(a + "A_log"))[None, :, None]
        gate = c.gate_lower_bound * torch.sigmoid(A * f)               # log-decay in (lb, 0)
        beta = torch.sigmoid(x @ self.W(a + "b_proj.weight").T)        # [B, H]
        S = self.kda_state[i]                                          # [B, H, V, K]
        S = S * torch.exp(gate)[:, :, None, :]
        u = beta[..., None] * (v - torch.einsum("bhvk,bhk->bhv", S, k))
        S = S + u[..., None] * k[:, :, None, :]
        self.kda_state[i] = S
        o = torch.einsum("bhvk,bhk->bhv", S, q)
        g = (x @ self.W(a + "g_proj.weight").T).reshape(B, H, d)
        o = rms_norm(o, self.W(a + "o_norm.weight"), c.rms_eps) * torch.sigmoid(g)
        return o.reshape(B, H * d) @ self.W(a + "o_proj.weight").T

    # -- gated MLA (decompressed form) ------------------------------------------------------

    def _mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        B, H = self.batch, c.mla_heads
        q_c = rms_norm(x @ self.W(a + "q_a_proj.weight").T, self.W(a + "q_a_layernorm.weight"),
                       c.rms_eps)
        kv = x @ self.W(a + "kv_a_proj_with_mqa.weight").T
        kv_c = rms_norm(kv[:, : c.kv_lora], self.W(a + "kv_a_layernorm.weight"), c.rms_eps)
        entry = torch.cat([kv_c, kv[:, c.kv_lora:]], dim=-1)
        self.kv_cache[i] = torch.cat([self.kv_cache[i], entry[:, None]], dim=1)
        cache = self.kv_cache[i]                                       # [B, T, 576]
        q = (q_c @ self.W(a + "q_b_proj.weight").T).reshape(B, H, c.qk_nope + c.qk_rope)
        q_nope, q_pe = q.split([c.qk_nope, c.qk_rope], dim=-1)
        kv_b = self.W(a + "kv_b_proj.weight").reshape(H, c.qk_nope + c.v_head, c.kv_lora)
        keys = torch.einsum("hnl,btl->bthn", kv_b[:, : c.qk_nope], cache[..., : c.kv_lora])
        values = torch.einsum("hvl,btl->bthv", kv_b[:, c.qk_nope:], cache[..., : c.kv_lora])
        k_pe = cache[..., c.kv_lora:]                                  # shared by all heads
        scores = (torch.einsum("bhn,bthn->bht", q_nope, keys)
                  + torch.einsum("bhr,btr->bht", q_pe, k_pe)) * (c.qk_nope + c.qk_rope) ** -0.5
        o = torch.einsum("bht,bthv->bhv", torch.softmax(scores, dim=-1), values)
        o = o.reshape(B, H * c.v_head) * torch.sigmoid(x @ self.W(a + "g_proj.weight").T)
        return o @ self.W(a + "o_proj.weight").T

    # -- MLPs -----------------------------------------------------------------------------

    def _dense(self, h: torch.Tensor) -> tuple[torch.Tensor, None, list[float], list[int]]:
        m = layer_prefix(0) + "mlp."
        c = self.c
        act = situ(h @ self.W(m + "gate_proj.weight").T, h @ self.W(m + "up_proj.weight").T,
                   c.situ_beta, c.situ_beta_linear)
        return act @ self.W(m + "down_proj.weight").T, None, [], []

    def _moe(self, i: int, h: torch.Tensor, forced: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, list[float], list[int]]:
        """The MoE's output, the experts it used, and per sequence the gap of a forced choice
        and whether it was no top-k (``Observer.routing_gap``, ``routing_invalid``)."""
        c = self.c
        m = layer_prefix(i) + "mlp."
        scores = torch.sigmoid(h @ self.W(m + "gate.weight").T)            # [B, E]
        biased = scores + self.W(m + "gate.e_score_correction_bias")
        chosen = torch.topk(biased, c.top_k, dim=-1).indices
        gap, invalid = [0.0] * self.batch, [0] * self.batch
        if forced is not None:
            # k distinct experts that exist, each within the gap of the reference's k-th best
            # score, are its top-k up to near ties; one expert k times passed the gap alone
            forced = forced.long()
            valid = (((forced >= 0) & (forced < c.n_experts)).all(-1)
                     & (forced.sort(-1).values.diff(dim=-1) != 0).all(-1))
            invalid = (~valid).long().tolist()
            forced = torch.where(valid[:, None], forced, chosen)
            kth = biased.gather(-1, chosen).min(-1).values
            gap = (kth - biased.gather(-1, forced).min(-1).values).clamp(min=0).tolist()
            chosen = forced
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * c.routed_scale
        latent = h @ self.W(m + "routed_expert_down_proj.weight").T       # [B, latent]
        routed = torch.zeros_like(latent)
        for b in range(self.batch):
            for slot in range(c.top_k):
                e = int(chosen[b, slot])
                w1 = self.W(m + f"experts.{e}.w1.weight")
                w3 = self.W(m + f"experts.{e}.w3.weight")
                w2 = self.W(m + f"experts.{e}.w2.weight")
                act = situ(w1 @ latent[b], w3 @ latent[b], c.situ_beta, c.situ_beta_linear)
                routed[b] += weights[b, slot] * (w2 @ act)
        routed = rms_norm(routed, self.W(m + "routed_expert_norm.weight"), c.rms_eps)
        up = routed @ self.W(m + "routed_expert_up_proj.weight").T
        s = m + "shared_experts."
        shared = situ(h @ self.W(s + "gate_proj.weight").T, h @ self.W(s + "up_proj.weight").T,
                      c.situ_beta, c.situ_beta_linear) @ self.W(s + "down_proj.weight").T
        return up + shared, chosen, gap, invalid
