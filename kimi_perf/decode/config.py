"""Kimi-K3-style model configuration and presets (no torch import: the CLI lists presets)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from kimi_perf.errors import argument


@dataclass(frozen=True)
class K3Config:
    """Model dimensions; ``tp`` > 1 describes one tensor-parallel rank's shard of them."""

    hidden: int = 7168
    n_layers: int = 93
    vocab: int = 163840
    rms_eps: float = 1e-5
    # Gated MLA at every 4th layer (1-indexed 4, 8, ..., 92) and at the last layer.
    full_attn_every: int = 4
    # KDA
    kda_heads: int = 96
    kda_head_dim: int = 128
    conv_size: int = 4
    gate_lower_bound: float = -5.0
    f_rank: int = 128                 # f_a / f_b low-rank gate projection
    # Gated MLA
    mla_heads: int = 96
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    # Latent MoE
    n_experts: int = 896
    top_k: int = 16
    moe_intermediate: int = 3072
    latent: int = 3584
    shared_intermediate: int = 6144   # the 2 shared experts, fused
    routed_scale: float = 1.0
    dense_intermediate: int = 33792   # layer 0
    situ_beta: float = 4.0
    situ_beta_linear: float = 25.0
    # Attention residuals
    attn_res_block: int = 12
    tp: int = 1

    def __post_init__(self) -> None:
        # Layer 0 is KDA attention and the dense MLP (``dense``); the last layer is gated MLA.
        if self.n_layers < 2:
            raise ValueError(f"n_layers: 2 or more (layer 0 has the dense MLP, the last is "
                             f"gated MLA), not {self.n_layers}")
        if self.full_attn_every < 2:    # (at 1, layer 0 would be gated MLA too)
            raise ValueError(f"full_attn_every: 2 or more (gated MLA at every n-th layer; "
                             f"layer 0 is KDA with the dense MLP), not {self.full_attn_every}")
        check_tp(self.tp)

    def layer_types(self) -> list[str]:
        """The layer types the model holds, in order of first appearance."""
        return list(dict.fromkeys(self.layer_type(i) for i in range(self.n_layers)))

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) % self.full_attn_every == 0 or layer == self.n_layers - 1

    def layer_type(self, layer: int) -> str:
        """``kda`` or ``mla``; ``dense`` for layer 0, whose MLP is dense instead of the MoE:
        a kernel sequence of its own (its attention is a KDA layer's)."""
        if layer == 0:
            return "dense"
        return "mla" if self.is_mla(layer) else "kda"

    # Per-rank shapes: attention heads and MLP intermediates are sharded; the router, the
    # latent down/up projections and the MLA down projections are replicated (as in vLLM).
    @property
    def kda_heads_local(self) -> int:
        return self.kda_heads // self.tp

    @property
    def mla_heads_local(self) -> int:
        return self.mla_heads // self.tp

    @property
    def moe_intermediate_local(self) -> int:
        return self.moe_intermediate // self.tp

    @property
    def shared_intermediate_local(self) -> int:
        return self.shared_intermediate // self.tp

    @property
    def dense_intermediate_local(self) -> int:
        return self.dense_intermediate // self.tp

    @property
    def in_proj_rows(self) -> int:
        """Rows of one rank's packed KDA projection: q, k, v, g (sharded), f_a (replicated),
        b (sharded), padded to a multiple of 16 as vLLM pads it (6288 at TP8)."""
        rows = 4 * self.kda_heads_local * self.kda_head_dim + self.f_rank + self.kda_heads_local
        return rows + (-rows) % 16

    @property
    def kv_cache_dim(self) -> int:
        return self.kv_lora + self.qk_rope

    def shard(self, tp: int) -> K3Config:
        check_tp(tp)
        for name, size in (("kda_heads", self.kda_heads), ("mla_heads", self.mla_heads),
                           ("moe_intermediate", self.moe_intermediate),
                           ("shared_intermediate", self.shared_intermediate),
                           ("dense_intermediate", self.dense_intermediate)):
            if size % tp:
                raise ValueError(f"TP {tp} does not divide the model: {name}={size} does not "
                                 f"split over {tp} ranks")
        return dataclasses.replace(self, tp=tp)

    def fingerprint(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp: 1 or more ranks, not {tp}")


# Values per E8M0 scale of MXFP4 (``kimi_perf_kernels.mxfp4.GROUP``; here without torch, for
# the floors).
MXFP4_GROUP = 32


def mxfp4_problem(c: K3Config) -> str | None:
    """Why a rank of ``c`` cannot hold its routed experts as MXFP4, or None: each expert
    matrix's input (the latent for W1/W3, the rank's share of the intermediate for W2) must
    be whole groups of 32."""
    for what, k in (("latent", c.latent), ("routed experts' intermediate per rank",
                                           c.moe_intermediate_local)):
        if k % MXFP4_GROUP:
            return (f"MXFP4 experts need their inputs in groups of {MXFP4_GROUP}: the {what} "
                    f"is {k}" + (f" (at TP {c.tp})" if c.tp > 1 else ""))
    return None


TINY = K3Config(
    hidden=256, n_layers=8, vocab=512, kda_heads=4, kda_head_dim=32, f_rank=16,
    mla_heads=4, q_lora=64, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16,
    n_experts=16, top_k=4, moe_intermediate=64, latent=128, shared_intermediate=128,
    dense_intermediate=512, attn_res_block=3,
)

PRESETS: dict[str, K3Config] = {
    "k3": K3Config(),
    "k3-tp8": K3Config().shard(8),
    "k3-tp16": K3Config().shard(16),
    "tiny": TINY,
}


def preset(name: str, n_layers: int | None = None, tp: int | None = None) -> K3Config:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    config = PRESETS[name]
    if tp is not None:
        check_tp(tp)
    if n_layers is not None:
        config = dataclasses.replace(config, n_layers=n_layers)
    if tp is not None and tp != config.tp:
        if config.tp != 1:
            raise ValueError(resharded(name, config, tp))
        config = config.shard(tp)
    return config


def resharded(name: str, config: K3Config, tp: int) -> str:
    """Why a preset of one rank's shapes takes no other TP: another TP is another sharding
    of the whole model (``--preset k3 --tp N``), where it divides the model."""
    try:
        dataclasses.replace(config, tp=1).shard(tp)
    except ValueError as exc:
        return f"{name} is already sharded over {config.tp} ranks, and {exc}"
    return (f"{name} is already sharded over {config.tp} ranks: for TP {tp} use "
            f"{argument('--preset', 'preset', 'k3')} {argument('--tp', 'tp', tp)}")
