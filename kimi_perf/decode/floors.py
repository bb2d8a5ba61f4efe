"""Memory floors of a decode step, per layer and per launch: the bytes it must move at least,
over a memory bandwidth (no torch needed).

Decode at batch 1-64 is memory-bound by 10-20x, so a layer cannot beat the time its bytes take
to stream at the GPU's copy bandwidth. The method is the design note's (k3-decode.md, section
4):

- weights are read once per step, the batch shares them; the routed experts read are the
  expected distinct set under uniform top-k, E·(1 - (1 - k/E)^B);
- the KDA state is read and written (fp32), as is the conv state (bf16); the gated-MLA layer
  reads its latent cache (every sequence's ``context`` positions);
- a speculative verify step of T tokens per sequence (``tokens``) routes B·T tokens; its
  KDA states are read and written once, as a decode step's, and it writes what a rollback
  to the accepted prefix needs of its T positions (per head a key, a decay and a correction
  vector, fp32, and the conv inputs), which the next step reads back (all T, at most); the
  cache is still read once per sequence;
- W_UK / W_UV and the router stay bf16 whatever the other weights' dtype (as vLLM keeps them);
- the attention residuals (a few hidden-size vectors per layer: about 1% of a TP8 layer at
  batch 64, 2% at TP16) and the activations are left out, and so are the small weights of a
  KDA layer and the norms (conv weights, dt_bias, A_log, norm weights, the router's
  correction bias: about 4% of fused_kda_decode at TP8, batch 1).

Bytes are given per launch of the latency-specialized path (``launch_bytes``), so that a
measured launch can be set against its floor; a layer's floor is the sum over its launches.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_perf.decode.config import K3Config, mxfp4_problem

# Bytes per parameter; MXFP4: a 4-bit value plus an 8-bit scale per 32.
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp4": 0.5 + 1 / 32}
H200_COPY_BANDWIDTH = 4.3e12  # bytes/s, the design note's measured device-to-device copy
# The most ``kimi-perf floors`` takes: well past any decode step, and small enough that every
# figure stays finite and every byte count below 2^53 (a float's integers, no rounding noise).
MAX_BATCH = 2**16
MAX_CONTEXT = 2**24
MAX_SPEC_TOKENS = 31     # (as validate takes)
MAX_BANDWIDTH_TBPS = 1000.0


@dataclass(frozen=True)
class Storage:
    """How the weights and the cache are stored: non-expert weights, routed and shared
    experts, latent KV cache."""
    weights: str = "bf16"
    experts: str = "bf16"
    kv_cache: str = "bf16"

    def __post_init__(self):
        for field, value, allowed in (("weights", self.weights, DTYPE_BYTES),
                                      ("experts", self.experts, DTYPE_BYTES),
                                      ("kv_cache", self.kv_cache, ("bf16", "fp8"))):
            if value not in allowed:
                raise ValueError(f"{field} must be one of {', '.join(allowed)}, not {value!r}")


def expected_experts(c: K3Config, batch: int) -> float:
    """Distinct routed experts a step of ``batch`` tokens touches under uniform top-k."""
    return c.n_experts * (1 - (1 - c.top_k / c.n_experts) ** batch)


def launch_bytes(c: K3Config, layer_type: str, batch: int, context: int,
                 storage: Storage = Storage(), tokens: int = 1) -> dict[str, float]:
    """Bytes each launch of the specialized path must move at least, for one layer of
    ``layer_type`` (``kda``, ``mla`` or ``dense``: layer 0's attention is KDA, its MLP dense)
    of the rank whose shapes ``c`` has, in a step of ``tokens`` per sequence."""
    w, e = DTYPE_BYTES[storage.weights], DTYPE_BYTES[storage.experts]
    bf16, fp32 = 2.0, 4.0
    h = c.hidden
    out: dict[str, float] = {}
    if layer_type in ("kda", "dense"):
        hd = c.kda_heads_local * c.kda_head_dim
        states = c.kda_heads_local * c.kda_head_dim ** 2 * fp32 + 3 * hd * (c.conv_size - 1) * bf16
        # a verify step's records of its positions, written, and read by the next step
        records = 0 if tokens == 1 else 2 * tokens * (3 * hd * fp32 + 3 * hd * bf16)
        out["in_proj"] = c.in_proj_rows * h * w
        out["fused_kda_decode"] = hd * c.f_rank * w + batch * (2 * states + records)
        out["o_proj"] = h * hd * w
    elif layer_type == "mla":
        hm = c.mla_heads_local
        out["qkv_a_g_proj"] = (c.q_lora + c.kv_cache_dim + hm * c.v_head) * h * w
        out["q_b_proj"] = hm * (c.qk_nope + c.qk_rope) * c.q_lora * w
        out["bmm_w_uk_cache_insert"] = hm * c.qk_nope * c.kv_lora * bf16
        out["mla_decode"] = batch * context * c.kv_cache_dim * DTYPE_BYTES[storage.kv_cache]
        out["bmm_w_uv_gate"] = hm * c.kv_lora * c.v_head * bf16
        out["o_proj"] = h * hm * c.v_head * w
    else:
        raise ValueError(f"layer type must be kda, mla or dense, not {layer_type!r}")
    if layer_type == "dense":
        inter = c.dense_intermediate_local
        out["dense_gate_up_situ"] = 2 * inter * h * w
        out["dense_down"] = inter * h * w
        return out
    experts, inter, shared = expected_experts(c, batch * tokens), c.moe_intermediate_local, \
        c.shared_intermediate_local
    out["router_latent_down"] = c.n_experts * h * bf16 + c.latent * h * w
    # the shared experts are stored as the other non-expert weights
    out["moe_fc1_situ_shared_gate_up"] = experts * 2 * inter * c.latent * e + 2 * shared * h * w
    out["moe_fc2_combine_shared_down"] = experts * c.latent * inter * e + h * shared * w
    out["latent_up_proj"] = h * c.latent * w
    return out


# Launches of the specialized path's opt-ins that move another launch's bytes (the grouped
# FC1 and FC2 read the expected distinct experts, as the floors of S7 and S8 assume).
SAME_BYTES = {"moe_grouped_fc1_situ_shared_gate_up": "moe_fc1_situ_shared_gate_up",
              "moe_grouped_fc2_shared_down": "moe_fc2_combine_shared_down"}


def floors(c: K3Config, batch: int, context: int, storage: Storage = Storage(),
           bandwidth: float = H200_COPY_BANDWIDTH, tokens: int = 1,
           layer_types: tuple[str, ...] = ("kda", "mla", "dense")) -> dict:
    """Per layer type (``dense``: layer 0, KDA attention and the dense MLP; those of
    ``layer_types``): bytes and floor µs per launch and in all, for steps of ``tokens`` per
    sequence (1+k for a speculative verify); what ``kimi-perf floors`` prints."""
    if tokens < 1:
        raise ValueError(f"a step holds at least one token per sequence, not {tokens}")
    # the floors of experts no rank can store (as trace and validate refuse them)
    if storage.experts == "mxfp4" and (problem := mxfp4_problem(c)):
        raise ValueError(f"storage.experts='mxfp4': {problem}")
    out = {"schema": 1, "config_hash": c.fingerprint(), "tp": c.tp, "batch": batch,
           "tokens": tokens, "context": context, "storage": storage.__dict__,
           "bandwidth_Bps": bandwidth,
           # (to 6 decimals: past them, the float's rounding noise)
           "expected_experts": round(expected_experts(c, batch * tokens), 6),
           "layer_types": {}}
    for t in layer_types:
        # whole bytes: the experts' are an expectation (a float, with its rounding noise)
        launches = {name: round(b) for name, b in
                    launch_bytes(c, t, batch, context, storage, tokens).items()}
        total = sum(launches.values())
        out["layer_types"][t] = {
            "launches": {name: {"bytes": b, "floor_us": round(b / bandwidth * 1e6, 3)}
                         for name, b in launches.items()},
            "bytes": total, "floor_us": round(total / bandwidth * 1e6, 3)}
    return out
