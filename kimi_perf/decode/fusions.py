"""Which standard-path launches each launch of the specialized path replaces (no torch).

The two paths compute the same math; the specialized one in fewer, fused launches
(``specialized.py``'s docstring walks through them). ``REPLACES`` names, per fused launch, the
standard launches (``model.py`` / ``standard_kernels.py``) whose work it does; those in
``SAME`` the two paths make one for one (``o_proj``, ``attn_res_pre``, the all-reduce after
o_proj); ``SHARED_WITH``, where a second fused launch does part of a standard one's work.
``tests/test_fusion_reads.py`` holds the map to what the launches read. ``fusion_ledger``
sets the two paths' typical layers side by side that way: each fused launch's µs against the
µs of what it replaced, which is where a fusion shows what it bought, launch by launch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

REPLACES: dict[str, tuple[str, ...]] = {
    # KDA attention
    "in_proj": ("in_proj_qkvgfab",),
    "fused_kda_decode": ("f_b_proj", "fused_kda_decode"),
    # gated MLA: the q/kv RMSNorm goes to q_b_proj's prologue and the cache insert; the merge
    # of the attention splits to bmm_w_uv_gate
    "qkv_a_g_proj": ("fused_qkv_a_proj", "g_proj"),
    "q_b_proj": ("fused_q_kv_rmsnorm", "q_b_proj"),
    "bmm_w_uk_cache_insert": ("bmm_w_uk", "q_concat_kv_cache_insert"),
    "bmm_w_uv_gate": ("mla_decode_combine", "bmm_w_uv", "gate_sigmoid_mul"),
    # layer 0's dense MLP
    "dense_gate_up_situ": ("dense_gate_up", "dense_situ_and_mul"),
    # latent MoE: the shared experts ride in the routed experts' grids
    "router_latent_down": ("router_gemm", "latent_down_proj"),
    "moe_fc1_situ_shared_gate_up": ("topk", "moe_fc1_situ", "shared_gate_up",
                                    "shared_situ_and_mul"),
    "moe_fc2_combine_shared_down": ("moe_fc2", "moe_finalize", "shared_down"),
    # opt-in (group_experts_from): routing in a launch of its own, then S7 and S8 grouped by
    # expert
    "router_topk": ("topk",),
    "moe_grouped_fc1_situ_shared_gate_up": ("moe_fc1_situ", "shared_gate_up",
                                            "shared_situ_and_mul"),
    "moe_grouped_fc2_shared_down": ("moe_fc2", "moe_finalize", "shared_down"),
    "moe_all_reduce": ("latent_all_reduce", "shared_all_reduce"),
    "latent_up_proj": ("latent_rmsnorm", "latent_up_proj", "moe_add"),
    "lm_head": ("final_norm", "lm_head"),
    # opt-in, on a second stream: new work, replacing none
    "l2_prefetch": (),
}
# An opt-in's launches, and the default launch whose work they do between them instead.
STANDS_IN_FOR = {"router_topk": "moe_fc1_situ_shared_gate_up",
                 "moe_grouped_fc1_situ_shared_gate_up": "moe_fc1_situ_shared_gate_up",
                 "moe_grouped_fc2_shared_down": "moe_fc2_combine_shared_down"}
# Standard launches whose work a second fused launch does part of; the ledger counts each with
# the launch that replaces it: the kv half of the q/kv RMSNorm runs in the cache insert.
SHARED_WITH = {"fused_q_kv_rmsnorm": ("bmm_w_uk_cache_insert",)}
# Launches both paths make, one for one.
SAME = ("attn_res_pre", "attn_res_post", "attn_res_final", "o_proj", "all_reduce",
        "mla_decode", "dense_down")
SPECIALIZED_LAUNCHES = frozenset(REPLACES) | frozenset(SAME)
STANDARD_LAUNCHES = frozenset(n for names in REPLACES.values() for n in names) | frozenset(SAME)


@dataclass
class LedgerRow:
    launch: str                  # the specialized path's launch
    us: float                    # its median µs in the typical layer
    replaces: list[str]          # the standard launches whose work it does
    replaced_us: float           # their µs in the standard path's typical layer

    @property
    def ratio(self) -> float | None:
        """What it replaced over what it takes: above 1, the fusion is faster (to 4
        significant digits, as compare's ratios: a CPU run's interpreted launch is hundreds of
        times slower)."""
        return (float(f"{self.replaced_us / self.us:.4g}") if self.us and self.replaces
                else None)


def fusion_ledger(standard: list[dict], specialized: list[dict]
                  ) -> tuple[list[LedgerRow], list[str]] | None:
    """One layer type's typical layers (``typical_layer["kernels"]``: name, us) of the two
    paths, launch by launch: a row per specialized launch, and the standard launches no row
    took (one name per launch, in order). None when either is empty, or the names are not
    the two paths' launch names (a GPU trace without launch annotations names kernels
    instead)."""
    if (not specialized or not standard
            or any(k["name"] not in SPECIALIZED_LAUNCHES for k in specialized)
            or any(k["name"] not in STANDARD_LAUNCHES for k in standard)):
        return None
    # Each standard launch is taken once, a name's launches in order: under TP a layer makes
    # two all_reduce launches, which the specialized path's two take first to first.
    waiting: dict[str, deque[int]] = defaultdict(deque)
    for i, k in enumerate(standard):
        waiting[k["name"]].append(i)
    rows = []
    for k in specialized:
        taken = [waiting[n].popleft() for n in REPLACES.get(k["name"], (k["name"],))
                 if waiting[n]]
        rows.append(LedgerRow(k["name"], k["us"], [standard[i]["name"] for i in taken],
                              round(sum(standard[i]["us"] for i in taken), 3)))
    left = sorted(i for queue in waiting.values() for i in queue)
    return rows, [standard[i]["name"] for i in left]


def ledger_of(a: list[dict], b: list[dict]
              ) -> tuple[bool, list[LedgerRow], list[str]] | None:
    """``fusion_ledger`` of two typical layers in whichever order they come: (whether ``a``
    is the specialized one, rows, standard launches no row took), or None."""
    for swapped, (standard, specialized) in ((False, (a, b)), (True, (b, a))):
        ledger = fusion_ledger(standard, specialized)
        if ledger is not None:
            return swapped, *ledger
    return None
