"""Steps and layers: from per-layer ranges, and from the repeating kernel pattern."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf import breakdown, read_trace
from kimi_perf.classify import classify, load_rules
from kimi_perf.errors import TraceError
from kimi_perf.layers import (
    DEFAULT_LAYER_PATTERN,
    attending,
    find_repeats,
    generic_ops,
    step_phase,
)
from tests.conftest import KINETO, NSYS
from tests.synth import TraceBuilder, segment

KDA = ["attn_res_mix", "rmsnorm", "gemm_in_proj", "gemm_fb", "kda_conv_recurrent_norm",
       "gemm_o_proj", "nccl_allreduce", "attn_res_mix", "rmsnorm", "gemm_router",
       "moe_latent_down", "topk", "moe_experts", "moe_shared", "moe_latent_up"]
MLA = ["attn_res_mix", "rmsnorm", "gemm_qkv_a", "rmsnorm_q", "gemm_q_b", "mla_decode",
       "gemm_o_proj", "nccl_allreduce", "attn_res_mix", "rmsnorm", "gemm_router",
       "moe_latent_down", "topk", "moe_experts", "moe_shared", "moe_latent_up"]


def k3_like(layers: int) -> list[list[str]]:
    """3 KDA layers per MLA layer, and the last layer MLA; layer 0 runs a variant norm."""
    out = []
    for i in range(layers):
        kinds = MLA if (i % 4 == 3 or i == layers - 1) else KDA
        out.append(list(kinds))
    out[0][1] = "rms_norm_plain"
    return out


def test_vllm_full_graph_decode_step_is_24_layers():
    trace = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")
    ops, steps = segment(trace)
    (step,) = steps
    assert step.layer_source == "repeat" and len(step.layers) == 24
    names = np.array(trace.strings, dtype=object)
    # GPT-OSS alternates two attention variants: two layer types, 12 layers each.
    types = [layer.type for layer in step.layers]
    assert types == ["A", "B"] * 12
    for layer in step.layers:
        assert "Rmsnorm2dFwd" in names[ops.name[layer.ops[0]]]  # each layer opens with its norm
        assert "finalize_matmul_scatter" in names[ops.name[layer.ops[-1]]]
    assert any("unified_attention_2d" in names[ops.name[i]] for i in step.layers[0].ops)
    assert any("unified_attention_3d" in names[ops.name[i]] for i in step.layers[1].ops)
    prologue = names[ops.name[step.prologue]].tolist()
    assert prologue[-1] == "triton_poi_fused_0"
    assert "Rmsnorm2dFwd" in names[ops.name[step.epilogue[0]]]  # the final norm
    covered = len(step.prologue) + len(step.epilogue) + sum(len(x.ops) for x in step.layers)
    assert covered == len(step.ops)


@pytest.mark.parametrize("n_layers", [4, 8, 13, 26, 93])
def test_repeats_find_k3_layers_exactly(n_layers):
    layers = k3_like(n_layers)
    prologue = ["embedding", "copy_block_states"]
    epilogue = ["attn_res_mix", "rmsnorm", "gemm_lm_head", "argmax"]
    sequence = prologue + [k for layer in layers for k in layer] + epilogue
    strings = sorted(set(sequence))
    seq = np.array([strings.index(n) for n in sequence])
    classes, labels = classify(seq, strings, load_rules())
    attention = attending(classes, labels)                 # as breakdown() passes it
    assert attention.any()
    split = find_repeats(seq, classes, attention)
    assert split is not None
    lengths = [len(x) for x in layers]
    expected_starts = len(prologue) + np.r_[0, np.cumsum(lengths)[:-1]]
    np.testing.assert_array_equal(split.starts, expected_starts)
    np.testing.assert_array_equal(split.ends, expected_starts + lengths)


UNFUSED_NORM = ["pow", "mean", "add_eps", "rsqrt", "mul", "mul_weight"]


def _codes(sequence: list[str]) -> np.ndarray:
    strings = sorted(set(sequence))
    return np.array([strings.index(n) for n in sequence])


@pytest.mark.parametrize("n_layers", [3, 8, 24])
def test_repeats_take_an_unfused_norm_twice_a_layer_for_part_of_a_layer(n_layers):
    """Eager RMSNorm (six kernels) runs twice a layer and once more as the final norm: its
    2L+1 occurrences outnumber the three kernels that run once a layer, yet the layers are
    the L that attend between each two of their anchors, not the 2L+1 halves, half of which
    do not."""
    layer = [*UNFUSED_NORM, "gemm", "gemm", "gemm", "rope", "flash_fwd", "gemm", "add",
             *UNFUSED_NORM, "gemm_up", "silu", "mul", "gemm_down", "add"]
    sequence = ["embedding", *(layer * n_layers), *UNFUSED_NORM, "gemm_lm_head"]
    attention = np.array([n == "flash_fwd" for n in sequence])
    split = find_repeats(_codes(sequence), attention=attention)
    assert split is not None
    np.testing.assert_array_equal(split.starts, 1 + len(layer) * np.arange(n_layers))
    np.testing.assert_array_equal(split.ends, split.starts + len(layer))


@pytest.mark.parametrize("n_layers", [3, 12])
def test_an_eager_layer_begins_at_its_norm_not_at_the_residual_add_before_it(n_layers):
    """An eager model's kernels are elementwise but for its GEMMs and attention. Layer 0's
    head (its norm) follows the embedding's gather; by class alone the residual add that
    ends each layer matches that gather too, and every layer would begin one kernel early
    (the one before it ending without its add). Elementwise kernels match by name: each
    layer begins at its norm."""
    norm = ["vectorized_pow", "reduce_kernel_mean", "vectorized_add", "vectorized_rsqrt",
            "elementwise_mul", "elementwise_mul_weight"]         # as PyTorch's kernels read
    layer = [*norm, "gemm_qkv", "flash_fwd", "gemm_o", "residual_add", *norm, "gemm_up",
             "silu", "gemm_down", "residual_add"]
    sequence = ["index_select_gather", *(layer * n_layers), *norm, "gemm_lm_head"]
    strings = sorted(set(sequence))
    seq = np.array([strings.index(n) for n in sequence])
    classes, labels = classify(seq, strings, load_rules())
    assert {labels[c] for c in classes} == {"elementwise", "gemm", "attention"}
    starts = 1 + len(layer) * np.arange(n_layers)
    split = find_repeats(seq, classes, attending(classes, labels),
                         generic=generic_ops(classes, labels))
    np.testing.assert_array_equal(split.starts, starts)
    np.testing.assert_array_equal(split.ends, starts + len(layer))
    by_class = find_repeats(seq, classes, attending(classes, labels))
    np.testing.assert_array_equal(by_class.starts[1:], starts[1:] - 1)


@pytest.mark.parametrize("n_layers", [3, 8, 32])
def test_a_layer_whose_gemms_share_one_kernel_ends_at_its_last_gemm(n_layers):
    """An eager Llama at batch 1: its four projections run one cuBLAS GEMV kernel, so the
    layers' cores run from the norm to the activation, and between two cores lies the down
    projection alone, which the prologue (the embedding's gather) does not end with: no
    head of the next layer, but the tail of this one. Each layer began one GEMV early (8 of
    9 kernels in layer 0, the last layer's GEMV taken into the epilogue)."""
    layer = ["rms_norm_kernel", "gemv2T_kernel_val", "rotary_embedding_kernel",
             "flash_fwd_splitkv_kernel", "gemv2T_kernel_val", "fused_add_rms_norm_kernel",
             "gemv2T_kernel_val", "act_and_mul_kernel", "gemv2T_kernel_val"]
    sequence = ["embedding_gather_kernel", *(layer * n_layers), "fused_add_rms_norm_kernel",
                "gemm_lm_head", "argmax_kernel"]
    strings = sorted(set(sequence))
    seq = np.array([strings.index(n) for n in sequence])
    classes, labels = classify(seq, strings, load_rules())
    split = find_repeats(seq, classes, attending(classes, labels),
                         generic=generic_ops(classes, labels))
    starts = 1 + len(layer) * np.arange(n_layers)
    np.testing.assert_array_equal(split.starts, starts)
    np.testing.assert_array_equal(split.ends, starts + len(layer))


def test_a_window_that_begins_at_layer_0_s_core_keeps_the_layers_heads():
    """A profiler window cut after layer 0's norm: no prologue to tell a head by, and an
    epilogue that begins with the next layer's norm. Each later layer still begins at its
    norm (the gap is the next layer's head, not this one's tail)."""
    norm = ["fused_add_rms_norm_kernel"]
    layer = [*norm, "gemm_qkv", "rotary_embedding_kernel", "flash_fwd_kernel", "gemm_o",
             "fused_add_rms_norm_kernel", "gemm_gate_up", "act_and_mul_kernel", "gemm_down"]
    sequence = layer[1:] + layer * 3 + norm
    strings = sorted(set(sequence))
    seq = np.array([strings.index(n) for n in sequence])
    classes, labels = classify(seq, strings, load_rules())
    split = find_repeats(seq, classes, attending(classes, labels),
                         generic=generic_ops(classes, labels))
    later = len(layer) - 1 + len(layer) * np.arange(3)
    np.testing.assert_array_equal(split.starts[1:], later)
    assert [sequence[i] for i in split.starts[1:]] == norm * 3


@pytest.mark.parametrize("n_layers", [3, 8, 24])
@pytest.mark.parametrize("router", [["softmax_warp_forward", "gatherTopK"],
                                    ["gatherTopK", "softmax_warp_forward"]])
def test_an_eager_moe_router_softmax_does_not_attend(n_layers, router):
    """HF-style eager MoE: the router's softmax (an attention-class name) runs right before
    its top-k (Mixtral) or right after it (GPT-OSS). It routes: the unfused norms' halves
    still lack attention in every other one, so the layers are the L, not the 2L+1 halves."""
    layer = [*UNFUSED_NORM, "gemm", "gemm", "gemm", "rotary", "flash_fwd", "gemm", "add",
             *UNFUSED_NORM, "gemm_router", *router,
             "index_put", "gemm_expert_up", "silu", "mul", "gemm_expert_down", "index_add",
             "add"]
    sequence = ["embedding", *(layer * n_layers), *UNFUSED_NORM, "gemm_lm_head"]
    strings = sorted(set(sequence))
    seq = np.array([strings.index(n) for n in sequence])
    classes, labels = classify(seq, strings, load_rules())
    softmax = classes[sequence.index("softmax_warp_forward")]
    assert labels[softmax] == "attention" and labels[classes[sequence.index("gatherTopK")]] \
        == "router"
    split = find_repeats(seq, classes, attending(classes, labels))
    assert split is not None
    # L layers of the layer's length (where the residual add between two layers is cut is
    # a matter of convention: here before it)
    assert len(split.starts) == n_layers
    np.testing.assert_array_equal(split.ends - split.starts, len(layer))
    assert split.starts[0] <= 1 and (np.diff(split.starts) == len(layer)).all()
    # by class alone, the softmax attends in every half, and the 2L+1 halves win
    halves = find_repeats(seq, classes, classes == labels.index("attention"))
    assert halves is not None and len(halves.starts) == 2 * n_layers + 1


@pytest.mark.parametrize("n_layers", [23, 24])
@pytest.mark.parametrize("known", [True, False])
def test_repeats_keep_layers_that_alternate_two_kinds(n_layers, known):
    """Sliding-window and full-attention layers in turn: kernels of one kind run about L/2
    times, the shared ones L times (twice per pair, and once more where L is odd): the
    layers are the L, not pairs, with or without the attention kernels known."""
    shared = ["norm", "qkv", "o_proj", "router", "experts"]
    kinds = [[*shared[:2], "swa_prep", "swa_attn", *shared[2:]],
             [*shared[:2], "fa_prep", "fa_attn", *shared[2:]]]
    sequence = ["embedding", *(k for i in range(n_layers) for k in kinds[i % 2]),
                "norm", "lm_head"]
    attention = np.array([n.endswith("_attn") for n in sequence]) if known else None
    split = find_repeats(_codes(sequence), attention=attention)
    assert split is not None
    np.testing.assert_array_equal(split.starts, 1 + 7 * np.arange(n_layers))


def _ops_from_one_long_op_to_the_next(path) -> int:
    """The most common count of GPU ops on a device from one op of over 1 ms (a DiT block's
    self-attention) to the next, read with SQL: a block's ops."""
    import contextlib
    import sqlite3
    from collections import Counter

    ops = " UNION ALL ".join(f"SELECT deviceId, start, end FROM CUPTI_ACTIVITY_KIND_{kind}"
                             for kind in ("KERNEL", "MEMCPY", "MEMSET"))
    counts: Counter = Counter()
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        for (device,) in db.execute(f"SELECT DISTINCT deviceId FROM ({ops})").fetchall():
            long_ops = np.flatnonzero([ns > 1_000_000 for (ns,) in db.execute(
                f"SELECT end - start FROM ({ops}) WHERE deviceId = ? ORDER BY start",
                (device,))])
            counts.update(np.diff(long_ops).tolist())
    return counts.most_common(1)[0][0]


def test_repeats_take_a_dit_block_for_one_layer_and_leave_iterations_alone():
    """Real training traces without step ranges. Wan2.1's DiT block runs its anchors four
    times (self-attention, cross-attention, FFN parts): one layer of 157 kernels, the same in
    both windows. jsun's five training iterations hold 75 of the finer units each: too many
    for parts of a layer, so the iterations are not taken for layers."""
    for window in ("before", "after"):
        path = NSYS / f"nsysai_fastvideo_wan2.1_train_2xh100_{window}.sqlite"
        typical = max(breakdown(read_trace(path)).layer_types, key=lambda t: t["layers"])
        assert typical["kernels"] == _ops_from_one_long_op_to_the_next(path) == 157
        assert typical["layers"] >= 30
    jsun = read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite")
    assert [s["layers"] for s in breakdown(jsun).steps] == [375]


def test_repeats_need_a_pattern():
    assert find_repeats(np.arange(50)) is None
    assert find_repeats(np.array([1, 2, 3])) is None


def nvtx_decode_trace(layer_name: str, steps: int = 2, n_layers: int = 8) -> TraceBuilder:
    b = TraceBuilder()
    for s in range(steps):
        step_start = b.clock
        b.sequence(["embedding"])
        for i, kernels in enumerate(k3_like(n_layers)):
            kind = "mla" if "mla_decode" in kernels else "kda"
            start, end = b.sequence(kernels)
            b.range(layer_name.format(i=i, kind=kind), start - 10, end)
        b.sequence(["gemm_lm_head"])
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    return b


@pytest.mark.parametrize("spelling", ["layer[{i}]({kind})", "layer[{i}] {kind}",
                                      "layer[{i}]:{kind}"])
def test_layers_from_nvtx_ranges_with_types(spelling):
    trace = nvtx_decode_trace(spelling).build()
    _, steps = segment(trace)
    assert [s.name for s in steps] == ["decode_step[0]", "decode_step[1]"]
    for step in steps:
        assert step.layer_source == "nvtx"
        assert [x.index for x in step.layers] == list(range(8))
        assert [x.type for x in step.layers] == ["kda", "kda", "kda", "mla"] * 2
        assert [len(x.ops) for x in step.layers] == [len(k) for k in k3_like(8)]
        assert len(step.prologue) == 1 and len(step.epilogue) == 1


def test_a_step_without_layer_ranges_leaves_the_others_theirs():
    """A warm-up step run before the layer ranges were on: it has no layers from ranges,
    and the annotated steps after it keep theirs (not the repeating pattern's)."""
    b = TraceBuilder()
    for s in range(3):
        step_start = b.clock
        b.sequence(["embedding"])
        for i, kernels in enumerate(k3_like(8)):
            start, end = b.sequence(kernels)
            if s:
                b.range(f"layer[{i}]({'mla' if 'mla_decode' in kernels else 'kda'})",
                        start - 10, end)
        b.sequence(["gemm_lm_head"])
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    _, steps = segment(b.build())
    assert [(s.name, s.layer_source, len(s.layers)) for s in steps] == [
        ("decode_step[0]", "none", 0), ("decode_step[1]", "nvtx", 8),
        ("decode_step[2]", "nvtx", 8)]
    # and says so: the per-type figures are of the other steps (it was a "(none)" in the
    # steps table alone, as eager steps with layer ranges and graph replays without would be)
    from kimi_perf.layer_breakdown import breakdown, step_notes

    assert ("1 of 3 steps holds no layers (decode_step[0]): its work is in no layer type, "
            "and the per-type figures are of the other steps' layers alone"
            in step_notes(breakdown(b.build())))


@pytest.mark.parametrize("spelling", ["layers.{i}", "model.layers.{i}", "layer_{i}",
                                      "DecoderLayer_{i}", "LlamaDecoderLayer_{i}"])
def test_default_layer_pattern_spellings_get_types_from_kernels(spelling):
    trace = nvtx_decode_trace(spelling, steps=1).build()
    _, (step,) = segment(trace)
    assert step.layer_source == "nvtx"
    types = [x.type for x in step.layers]
    assert types[:4] == ["A", "A", "A", "B"] and types[7] == "B"


def _layer_types(steps_of_layers: list[list[list[str]]]) -> list[list[str]]:
    """The types ``segment`` gives untyped layers: each step a decode_step range of layer[i]
    ranges, each layer its kernels in sequence."""
    b = TraceBuilder()
    for s, layers in enumerate(steps_of_layers):
        step_start = b.clock
        for i, kernels in enumerate(layers):
            start, end = b.sequence(kernels)
            b.range(f"layer[{i}]", start - 10, end)
        b.range(f"decode_step[{s}]", step_start - 20, b.clock)
        b.clock += 5000
    _, steps = segment(b.build())
    return [[x.type for x in step.layers] for step in steps]


def test_only_first_or_last_layers_that_differ_by_a_kernel_or_two_fold_into_a_type():
    """Untyped layers: layer 0's plain norm is a variant of the KDA type; a last MLA layer is
    a type of its own even when most of its kernels are the KDA layer's (here 5 shared MoE
    kernels make them 80% alike), and even though it runs once per step."""
    moe = [f"moe_{k}" for k in range(5)]
    step = [kernels + moe for kernels in k3_like(4)]
    assert _layer_types([step] * 3) == [["A", "A", "A", "B"]] * 3


def test_a_warm_up_steps_first_layer_is_a_variant_of_the_later_first_layers_type():
    """Every step's first layer runs the embedding and a dense MLP (a type of its own); the
    first step's also a copy (a warm-up's): a variant of that type, not a type of the warm-up
    alone leading the tables (the Athrun fixture's pass 0)."""
    inner = ["norm", "qkv", "attn", "o_proj", "norm", "gate_up", "act", "down"]
    first = ["embedding", "norm", "qkv", "attn", "o_proj", "norm", "dense_gate_up",
             "dense_act", "dense_down", "dense_add"]
    step = [first, inner, inner, inner]
    warm_up = [["memcpy_warm_up", *first], inner, inner, inner]
    assert _layer_types([warm_up, step, step]) == [["A", "B", "B", "B"]] * 3


def test_a_warm_up_steps_first_layer_joins_a_first_layer_that_is_a_variant():
    """The later steps' first layer is a variant of the inner layers' type (an embedding and
    a plain norm: two kernels off); the warm-up step's, a copy more, is three off the inner
    layers' but one off theirs: of their type too. A last layer as near to it is not: the
    other end of a step is another place."""
    inner = ["norm", "qkv", "attn", "o_proj", "norm", "gate_up", "act", "down"]
    first = ["embedding", "plain_norm", *inner[1:]]
    # one kernel off the warm-up's first layer, and as near to it as the later first layers
    last = ["copy", "embedding", "plain_norm", *inner[1:7], "lm_head"]
    step = [first, inner, inner, inner, last]
    warm_up = [["copy", *first], inner, inner, inner, last]
    assert _layer_types([warm_up, step, step]) == [["A", "A", "A", "A", "B"]] * 3


def test_a_first_layer_as_common_as_the_inner_layer_it_varies():
    """Three layers a step: the first layer's sequence (a plain norm) is as common as the one
    inner layer's it is a variant of, so it is grouped before that one is: still its type."""
    inner = ["fused_add_norm", "qkv", "attn", "o_proj", "gate_up", "act", "down"]
    first = ["plain_norm", *inner[1:]]
    last = ["fused_add_norm", "qkv", "attn", "o_proj", "final_norm", "lm_head", "sample",
            "copy"]
    assert _layer_types([[first, inner, last]] * 2) == [["A", "A", "B"]] * 2


@pytest.mark.parametrize("name", ["layers.3.mlp", "layer[3].attn", "player_3", "layer",
                                  "model.layers.3.self_attn.o_proj"])
def test_default_layer_pattern_rejects_sub_ranges(name):
    assert re.search(DEFAULT_LAYER_PATTERN, name) is None


def _marker(path: str, **fields) -> str:
    """A layerwise NVTX marker as vLLM's, SGLang's and TensorRT-LLM's hooks name it."""
    return str({"Module": path, **fields})


@pytest.mark.parametrize("annotation", ["execute_context_0(0)_generation_32(32)",
                                        "execute_32_context_0(sq0sk0)_generation_32(sq32sk9)",
                                        "execute_new_0_cached_32"])
def test_vllm_step_annotations_of_each_version_are_steps(annotation):
    """vLLM annotates each step inside the profiler's ProfilerStep#N, which also spans the
    scheduling between steps: the annotation is the step."""
    b = TraceBuilder()
    for s in range(2):
        profiler_step = b.clock
        b.clock += 3000  # scheduling: the ProfilerStep holds it, the annotation does not
        start, _ = b.sequence(["embedding", "gemm", "lm_head"])
        b.range(annotation, start - 10, b.clock)
        b.clock += 2000
        b.range(f"ProfilerStep#{s}", profiler_step, b.clock)
    _, steps = segment(b.build())
    assert [s.name for s in steps] == [annotation] * 2


@pytest.mark.parametrize("name, phase", [
    ("execute_context_0(0)_generation_32(32)", "decode"),
    ("execute_context_1(512)_generation_0(0)", "prefill"),
    ("execute_8192_context_9(sq8155sk8430)_generation_37(sq37sk34489)", "mixed"),
    ("execute_32_context_0(sq0sk0)_generation_32(sq32sk55086)", "decode"),
    ("execute_context_0(0)_generation_0(0)", None),
    # older builds: new requests prefill; running ones decode or continue a chunked prefill
    ("execute_new_0_cached_32", None), ("execute_new_2_cached_0", "prefill"),
    ("execute_new_1_cached_31", "mixed"),
    ("decode_step[3]", "decode"), ("ProfilerStep#2", None)])
def test_step_phase_from_the_step_name(name, phase):
    assert step_phase(name) == phase


@pytest.mark.parametrize("root", ["top", "model", "KimiK3ForCausalLM"])
def test_layerwise_nvtx_markers_of_serving_engines(root):
    """Every module's forward gets a marker (the root's is the forward pass, so the step);
    vLLM also pushes and pops an empty "output" marker after each module. The root is named
    "top" (TensorRT-LLM), "model" (SGLang) or after the model's class (vLLM)."""
    b = TraceBuilder()
    n_layers = 8
    for _ in range(2):
        step_start = b.clock
        start, end = b.sequence(["embedding"])
        b.range(_marker(f"{root}.model.embed_tokens", Inputs=[[1]]), start - 5, end)
        for i, kernels in enumerate(k3_like(n_layers)):
            start, end = b.sequence(kernels)
            layer = f"{root}.model.layers.{i}"
            b.range(_marker(layer, Inputs=[[1, 7168]], TrainableParams={}), start - 10, end)
            b.range(_marker(layer + ".self_attn", Inputs=[[1, 7168]]), start - 5,
                    start + 6 * 1100)
            b.range(_marker(layer + ".mlp.experts", StaticParams={"in_features": 7168}),
                    end - 3 * 1100, end - 5)
            b.range(_marker(layer, Outputs=[[1, 7168]]), end + 1, end + 2)
        b.sequence(["gemm_lm_head"])
        b.range(_marker(root, input_ids=[[1]], positions=[[1]]), step_start - 20, b.clock)
        b.range(_marker(root, Outputs=[[1, 7168]]), b.clock + 1, b.clock + 2)
        b.clock += 5000
    _, steps = segment(b.build())
    assert len(steps) == 2
    for step in steps:
        assert step.name.startswith(f"{{'Module': '{root}', 'input_ids'")
        assert step.layer_source == "nvtx"
        assert [x.index for x in step.layers] == list(range(n_layers))
        assert [len(x.ops) for x in step.layers] == [len(k) for k in k3_like(n_layers)]
        assert [x.type for x in step.layers][:4] == ["A", "A", "A", "B"]
        assert len(step.prologue) == 1 and len(step.epilogue) == 1


def test_module_calls_of_the_pytorch_profiler_are_layers():
    """"nn.Module: <Class>_<n>" numbers the modules of each class, so with a dense first layer
    of its own class the numbers are not the layers': the layer's place is its index."""
    b = TraceBuilder()
    step_start = b.clock
    b.sequence(["embedding"])
    for i, kernels in enumerate(k3_like(8)):
        start, end = b.sequence(kernels)
        name = "nn.Module: KimiDenseDecoderLayer_0" if i == 0 else \
            f"nn.Module: KimiK3DecoderLayer_{i - 1}"
        b.range(name, start - 10, end)
        b.range(f"nn.Module: Linear_{i}", start - 5, start + 1100)
    b.sequence(["gemm_lm_head"])
    b.range("ProfilerStep#4", step_start - 20, b.clock)
    _, (step,) = segment(b.build())
    assert step.layer_source == "nvtx"
    assert [x.index for x in step.layers] == list(range(8))
    assert [len(x.ops) for x in step.layers] == [len(k) for k in k3_like(8)]


@pytest.mark.parametrize("name", [
    "{'Module': 'top.model.layers.3.self_attn', 'Inputs': [[1, 7168]]}",
    "{'Module': 'top.model.layers.3.mlp.experts'}", "{'Module': 'top.model', 'Inputs': []}",
    "nn.Module: Linear_3", "nn.Module: KimiK3DecoderLayer", "nn.Module: DecoderLayerNorm_3"])
def test_default_layer_pattern_rejects_sub_modules(name):
    assert re.search(DEFAULT_LAYER_PATTERN, name) is None


def test_nvtx_regex_option_and_repeat_fallback():
    trace = nvtx_decode_trace("blk{i}-{kind}", steps=1).build()
    _, (step,) = segment(trace, layers=r"nvtx:^blk(?P<index>\d+)-(?P<type>\w+)$")
    assert [x.type for x in step.layers][:4] == ["kda", "kda", "kda", "mla"]
    # Unknown spelling under auto: no layer ranges match, the kernel pattern still finds 8.
    _, (step,) = segment(trace, layers="auto")
    assert step.layer_source == "repeat" and len(step.layers) == 8


@pytest.mark.parametrize("spelling", ["Layer {i} ({kind})", "layer[{i}]({kind}.attn)",
                                      "layer[{i}](a<b>&c)", "decoderlayer_{i}"])
def test_ranges_named_like_layers_in_another_spelling_are_said(spelling):
    """Layer ranges the default pattern does not take (another case, a type of other
    characters) leave the layers to the kernel pattern: the breakdown names them and says
    --layers nvtx:REGEX takes them; sub-modules and other names are not said."""
    from kimi_perf.layer_breakdown import step_notes
    from kimi_perf.runs import _source_problem

    b = breakdown(nvtx_decode_trace(spelling, steps=2).build())
    assert {s["layer_source"] for s in b.steps} == {"repeat"}
    like = b.source["layer_like_ranges"]
    assert like["count"] == 8 and len(like["names"]) == 3   # 8 layers' names, 3 shown
    assert set(like["names"]) <= {spelling.format(i=i, kind=k) for i in range(8)
                                  for k in ("kda", "mla")}
    said = next(n for n in step_notes(b) if "range names like a layer's" in n)
    assert said.startswith(f"8 range names like a layer's ('{like['names'][0]}'")
    assert "--layers 'nvtx:REGEX' takes the ranges" in said
    assert _source_problem(b.source) is None   # (stored, it reads back)
    assert _source_problem({**b.source, "layer_like_ranges": {"names": [1], "count": 8}})
    from kimi_perf.layers import LAYER_LIKE

    for name in ("model.layers.12.mlp", "blocks.10.attn", "encoder.layer.11.output",
                 "Layer3Norm", "layer_1_norm"):     # sub-modules and other names: not said
        assert LAYER_LIKE.search(name) is None, name
    for other in ("blk{i}-{kind}", "model.layers.{i}.mlp", "layer[{i}]({kind})"):
        assert "layer_like_ranges" not in breakdown(
            nvtx_decode_trace(other, steps=1).build()).source, other


def test_kernels_named_like_layers_are_not_said_as_ranges():
    """Only range names are read as layer-like: a kernel named "Layer_3" is no range, and the
    trace's strings (mostly kernel names) are not all run through LAYER_LIKE."""
    from kimi_perf.layers import LAYER_LIKE, layer_like_ranges

    b = nvtx_decode_trace("blk{i}-{kind}", steps=1)
    b.sequence(["Layer_3", "DecoderLayer 4"])
    trace = b.build()
    assert layer_like_ranges(trace) is None
    assert not any(key[0] == LAYER_LIKE.pattern for key in trace._masks)
    b.range("Layer 9", b.clock - 10, b.clock)
    assert layer_like_ranges(b.build()) == {"names": ["Layer 9"], "count": 1}


def test_graph_launches_become_steps():
    b = TraceBuilder()
    seq = [k for layer in k3_like(4) for k in layer]
    for step in range(3):
        t = b.clock
        for j, name in enumerate(seq):
            b.launch(name, t, t + 40, t + 100 + j * 1000, t + 100 + j * 1000 + 900,
                     correlation=1000 + step, api_name="cudaGraphLaunch")
        b.clock += len(seq) * 1000 + 5000
    _, steps = segment(b.build())
    assert [s.name for s in steps] == ["cudaGraphLaunch"] * 3
    assert [len(s.layers) for s in steps] == [4, 4, 4]


def _steps_with_a_second_thread(overlap: bool = False) -> TraceBuilder:
    """Two decode steps annotated on thread 1, each also running two kernels launched from
    thread 2 in its window; with ``overlap``, the step ranges overlap."""
    b = nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=4)
    for r in b.ranges:
        if overlap and b.strings.values[r["name"]] == "decode_step[0]":
            r["end"] += 10_000   # into the next step's range
    for step in range(2):
        r = next(r for r in b.ranges if b.strings.values[r["name"]] == f"decode_step[{step}]")
        t = r["start"] + 30
        for j, name in enumerate(["side_a", "side_b"]):
            b.launch(name, t + 10 * j, t + 10 * j + 5, t + 40 + 10 * j, t + 45 + 10 * j, tid=2)
    return b


def test_work_launched_from_another_thread_is_counted_in_the_step_window():
    trace = _steps_with_a_second_thread().build()
    ops, steps = segment(trace)
    assert [s.other_thread_ops for s in steps] == [2, 2]
    for step in steps:
        names = [trace.strings[c] for c in ops.name[step.ops]]
        assert names.count("side_a") == names.count("side_b") == 1
        assert step.layer_source == "nvtx" and len(step.layers) == 4
        in_layers = {trace.strings[c] for x in step.layers for c in ops.name[x.ops]}
        assert not {"side_a", "side_b"} & in_layers
    # The layers by the repeating pattern come from the step thread's own kernels alone.
    _, repeated = segment(trace, layers="repeat")
    assert [len(s.layers) for s in repeated] == [len(s.layers) for s in steps]
    b = breakdown(trace)
    assert b.source["other_thread_ops"] == 4 and b.source["outside_steps"]["ops"] == 0


def test_overlapping_step_ranges_borrow_nothing():
    trace = _steps_with_a_second_thread(overlap=True).build()
    _, steps = segment(trace)
    assert all(s.other_thread_ops == 0 for s in steps)
    outside = breakdown(trace).source["outside_steps"]
    assert outside["ops"] == 4
    # and says why: not "launched outside every step's range", which they were not
    assert outside["during_overlapping_steps"] == 4
    from kimi_perf.layer_breakdown import step_notes

    (note,) = [n for n in step_notes(breakdown(trace)) if "ran in no step" in n]
    assert note.endswith("ran in no step: launched outside their own threads' step ranges "
                         "(in no range 4), 4 of them while another thread's step range was "
                         "open (the process's step ranges overlap, so that no one step is "
                         "theirs)")
    assert "during_overlapping_steps" not in breakdown(
        _steps_with_a_second_thread().build()).source["outside_steps"]


NSYS_CLI = os.environ.get("KIMI_PERF_NSYS") or shutil.which("nsys")

_MARKED_FORWARD = """
import time
import nvtx

def marker(path, **fields):  # as vLLM's PytHooks names a module's range
    return str({"Module": path, **fields})

for step in range(2):
    nvtx.push_range(marker("KimiK3ForCausalLM", input_ids=[[1]], positions=[[1]]))
    nvtx.push_range("op:embedding"); time.sleep(1e-4); nvtx.pop_range()
    for i in range(4):
        layer = f"KimiK3ForCausalLM.model.layers.{i}"
        nvtx.push_range(marker(layer, Inputs=[[1, 7168]]))
        nvtx.push_range(marker(layer + ".self_attn", Inputs=[[1, 7168]]))
        for op in (["op:qkv", "op:mla", "op:o_proj", "op:gate"] if i == 3 else
                   ["op:in_proj", "op:kda", "op:o_proj"]):
            nvtx.push_range(op); time.sleep(1e-4); nvtx.pop_range()
        nvtx.pop_range()
        nvtx.pop_range()
        nvtx.push_range(marker(layer, Outputs=[[1, 7168]])); nvtx.pop_range()
    nvtx.push_range("op:lm_head"); time.sleep(1e-4); nvtx.pop_range()
    nvtx.pop_range()
"""


@pytest.mark.skipif(NSYS_CLI is None or importlib.util.find_spec("nvtx") is None,
                    reason="needs the Nsight Systems CLI and the nvtx package")
def test_layerwise_markers_through_a_real_nsys_capture(tmp_path, monkeypatch):
    """vLLM-style markers recorded by `nsys profile` and exported to SQLite as nsys stores
    them: steps from the root module's marker, layers from the layers' (CPU ops stand in for
    kernels)."""
    script = tmp_path / "forward.py"
    script.write_text(_MARKED_FORWARD)
    from kimi_perf.capture import one_nsys_capture_at_a_time

    rep, db = tmp_path / "forward.nsys-rep", tmp_path / "forward.sqlite"
    for cmd in ([NSYS_CLI, "profile", "--trace=nvtx", "--sample=none", "--cpuctxsw=none",
                 "--force-overwrite=true", "-o", str(rep), sys.executable, str(script)],
                [NSYS_CLI, "export", "--type", "sqlite", "--force-overwrite=true", "-o",
                 str(db), str(rep)]):
        with one_nsys_capture_at_a_time():   # (as kimi-perf's own captures, in other workers)
            ran = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
    b = breakdown(read_trace(db))
    assert [s["name"] for s in b.steps] == [
        "{'Module': 'KimiK3ForCausalLM', 'input_ids': [[1]], 'positions': [[1]]}"] * 2
    assert [s["layers"] for s in b.steps] == [4, 4]
    assert [row["index"] for row in b.layers] == [0, 1, 2, 3] * 2
    assert {t["type"]: (t["layers"], t["kernels"]) for t in b.layer_types} == {
        "A": (6, 3), "B": (2, 4)}
    # the report itself, exported with the CLI that KIMI_PERF_NSYS names (none on PATH)
    monkeypatch.setenv("PATH", os.defpath)
    monkeypatch.setenv("KIMI_PERF_NSYS", NSYS_CLI)
    assert breakdown(read_trace(rep)).layers == b.layers


# -- forward passes --------------------------------------------------------------------------

LLAMA = ["rmsnorm", "gemm_qkv", "rope", "flash_fwd", "gemm_o", "add_rmsnorm", "gemm_up",
         "silu_mul", "gemm_down"]
LM_HEAD = ["add_rmsnorm", "gemm_lm_head", "argmax", "copy_tokens"]


def _passes(layers: list[list[str]], passes: int, prologue: list[str], epilogue: list[str]
            ) -> TraceBuilder:
    """A model run ``passes`` times, with no step range: a benchmark's forward passes."""
    b = TraceBuilder()
    b.sequence(["memcpy_weights_h2d"] * 3)
    for _ in range(passes):
        for part in (prologue, *layers, epilogue):
            b.sequence(part)
        b.clock += 20_000
    return b


@pytest.mark.parametrize(("model", "passes"), [("llama", 2), ("llama", 4), ("k3", 3)])
def test_a_device_that_ran_the_model_several_times_has_a_step_per_forward_pass(model, passes,
                                                                               tmp_path):
    """No step range, no graph launch: the forward passes are the steps, each with its
    embedding for prologue and its final norm and LM head for epilogue, where the layer
    types show them (one layer in every pass that also ran the work between two)."""
    from kimi_perf.layer_breakdown import step_notes

    layers = [LLAMA] * 8 if model == "llama" else k3_like(12)
    prologue, epilogue = ["embedding"], LM_HEAD
    trace = _passes(layers, passes, prologue, epilogue).build()
    ops, steps = segment(trace)
    names = np.array(trace.strings, dtype=object)
    assert [s.name for s in steps] == [f"device 0 pass {k}" for k in range(passes)]
    for k, step in enumerate(steps):
        assert step.found_by == "pass" and len(step.layers) == len(layers)
        first = ["memcpy_weights_h2d"] * 3 if k == 0 else []
        assert names[ops.name[step.prologue]].tolist() == first + prologue
        assert names[ops.name[step.epilogue]].tolist() == epilogue
        for layer, kernels in zip(step.layers, layers, strict=True):
            assert names[ops.name[layer.ops]].tolist() == kernels
    b = breakdown(trace)
    assert b.source["steps_found_by"] == "pass" and len(b.steps) == passes
    assert any(f"the steps are each device's forward passes, found where every "
               f"{len(layers)}th layer also ran the work between two passes" in n
               for n in step_notes(b))
    # no name says a pass's phase: --phase says so, not "no decode step among the 1 step"
    with pytest.raises(TraceError, match=r"phase='decode': the trace has no step ranges or graph "
                                         r"launches \(each device's work is one step, cut into "
                                         r"forward passes where its layers repeat\), so no step "
                                         r"says its phase; phase='all' takes every step$"):
        breakdown(trace, phase="decode")
    from click.testing import CliRunner

    from kimi_perf.cli import main

    trace.save(tmp_path / "passes.kptrace")   # (the command line says its option)
    said = CliRunner().invoke(main, ["breakdown", str(tmp_path / "passes.kptrace"), "--phase",
                                     "decode"])
    assert said.exit_code == 2 and said.output.endswith(
        "so no step says its phase; --phase all takes every step\n"), said.output


MOE = [*LLAMA[:6], "gemm_router", "topk", "moe_experts", *LLAMA[6:]]
ONCE = [*LLAMA[:5], "memset_workspace", "cache_resize_copy", "fill", *LLAMA[5:]]
MAMBA = ["rmsnorm", "gemm_in_proj", "causal_conv1d_fwd", "selective_scan_fwd", "gemm_out_proj"]


@pytest.mark.parametrize("layers", [
    k3_like(48),                                      # hybrid: every 4th layer MLA
    [LLAMA, MOE] * 12,                                # MoE every other layer
    [LLAMA, LLAMA, LLAMA, MOE] * 6,                   # ... or every 4th
    ([MAMBA] * 5 + [[*MAMBA, *LLAMA]]) * 6,           # a shared block every 6th layer
    [LLAMA] * 16 + [ONCE] + [LLAMA] * 15,             # one layer halfway ran 3 more once
    [LLAMA] * 24])
def test_layers_that_differ_in_turn_are_no_forward_passes(layers):
    """One pass of a hybrid model (the MLA layer runs other attention kernels, not a KDA
    layer's and more), of MoE and dense layers in turn or a shared block every so many
    layers (whose layers do run the others' and more, in cycles shorter than a model), or of
    a model one of whose layers ran three kernels more once: one step, all its layers."""
    trace = _passes(layers, 1, ["embedding"], LM_HEAD).build()
    _, (step,) = segment(trace)
    assert step.found_by == "device" and len(step.layers) == len(layers)


def test_real_benchmarks_forward_passes_are_their_steps():
    """Two benchmark scripts that time a model's forward pass with no range around each:
    zx3xyy's 2.7B model (one warm-up and three timed passes of 32 layers) and Athrun's
    (five passes of 12 layers); the embedding begins each pass, the final norm (six
    elementwise kernels) and LM head end it. Both models are all elementwise kernels and
    GEMMs: a layer begins at its norm, not at the residual add that ends the one before
    (which by class alone matches the embedding's gather), so every layer is one type."""
    from kimi_perf.layer_breakdown import step_notes

    zx = breakdown(read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024"
                                     ".6.2.sqlite"))
    assert [(s["name"], s["layers"], s["epilogue"]["kernels"]) for s in zx.steps] == [
        (f"device 0 pass {k}", 32, 7) for k in range(4)]
    assert [s["prologue"]["kernels"] for s in zx.steps][1:] == [1, 1, 1]   # the embedding
    assert [(t["type"], t["layers"], t["kernels"]) for t in zx.layer_types] == [("A", 128, 57)]
    # Pass 0 is the warm-up, with the model's loading (its weights' copies) in its prologue:
    # the ranges say so (as nsys's NVTX projection does: init_model 292 ops, warmup 1832).
    assert zx.source["pass_ranges"] == [
        {"steps": ["device 0 pass 0"], "in_ranges": [
            {"range": "warmup", "ops": 1832}, {"range": "init_model", "ops": 292},
            {"range": "generate_data", "ops": 2}]},
        {"steps": [f"device 0 pass {k}" for k in (1, 2, 3)],
         "in_ranges": [{"range": "benchmark_loop", "ops": 1832}]}]   # 32 x 57 + 8
    assert ("the passes ran in different ranges: device 0 pass 0 in 'warmup' 1832, "
            "'init_model' 292, 'generate_data' 2; device 0 pass 1, device 0 pass 2, device 0 "
            "pass 3 in 'benchmark_loop'") in step_notes(zx)
    athrun = breakdown(read_trace(NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1"
                                         ".sqlite"))
    assert [(s["layers"], s["prologue"]["kernels"], s["epilogue"]["kernels"])
            for s in athrun.steps] == [(12, 114, 10)] + [(12, 1, 10)] * 4
    assert [(t["type"], t["layers"], t["kernels"]) for t in athrun.layer_types] == [
        ("A", 60, 76)]
    assert "pass_ranges" not in athrun.source    # all five ran alike


def test_a_step_range_around_several_passes_says_so():
    """zx3xyy's benchmark loop taken as the step (--steps ^benchmark_loop$) holds its three
    timed passes: the user's step stands, and a note says why its layer types A (the
    embedding + the 1st layer: 58 kernels) and C (32nd layer + final norm + LM head: 64)
    differ from B (57)."""
    from kimi_perf.layer_breakdown import step_notes

    b = breakdown(read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024"
                                    ".6.2.sqlite"), step_regex="^benchmark_loop$")
    assert [(s["name"], s["layers"]) for s in b.steps] == [("benchmark_loop", 96)]
    assert [(t["type"], t["layers"], t["kernels"]) for t in b.layer_types] == [
        ("A", 3, 58), ("B", 90, 57), ("C", 3, 64)]
    assert b.source["steps_holding_passes"] == [{"step": "benchmark_loop", "passes": 3,
                                                 "layers": 32}]
    assert any(n.startswith("steps that hold several forward passes ('benchmark_loop' 3 "
                            "passes of 32 layers)") for n in step_notes(b))
    whole = breakdown(read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__"
                                        "nsys2024.6.2.sqlite"), step_regex="^warmup$")
    assert "steps_holding_passes" not in whole.source     # one pass: nothing to say


def test_passes_each_in_a_numbered_range_ran_alike():
    """A warm-up pass, then passes each in its own 'iteration N' range: the iterations ran
    alike (numbers are folded), and only the warm-up is told apart; a long list of passes is
    cut short in the note."""
    from kimi_perf.layer_breakdown import step_notes

    b = TraceBuilder()
    for k in range(8):
        start = b.clock
        for part in (["embedding"], *[LLAMA] * 8, LM_HEAD):
            b.sequence(part)
        b.range("warmup" if k == 0 else f"iteration {k}", start - 10, b.clock)
        b.clock += 20_000
    result = breakdown(b.build())
    assert len(result.steps) == 8 and result.source["steps_found_by"] == "pass"
    groups = result.source["pass_ranges"]
    assert [len(g["steps"]) for g in groups] == [1, 7]
    assert groups[0]["in_ranges"][0]["range"] == "warmup"
    assert ("the passes ran in different ranges: device 0 pass 0 in 'warmup' "
            in " ".join(step_notes(result)))
    assert ("device 0 pass 1, device 0 pass 2, device 0 pass 3, … (7 passes) in 'iteration 1'"
            in " ".join(step_notes(result)))


def test_two_devices_that_ran_other_passes_say_each():
    """One device ran its 8-layer model three times, the other its 12-layer model twice:
    each device's passes are its steps, and the note names both cycles."""
    from kimi_perf.layer_breakdown import step_notes

    b = TraceBuilder()
    for device, layers, passes in ((0, 8, 3), (1, 12, 2)):
        b.clock = 0
        for _ in range(passes):
            for part in (["embedding"], *[LLAMA] * layers, LM_HEAD):
                b.sequence(part, device=device)
            b.clock += 20_000
    result = breakdown(b.build())
    assert [(s["device"], s["name"], s["layers"]) for s in result.steps] == [
        (0, f"device 0 pass {k}", 8) for k in range(3)] + [
        (1, f"device 1 pass {k}", 12) for k in range(2)]
    assert result.source["steps_found_by"] == "pass"
    assert any("found where every 8th or 12th layer also ran" in n for n in step_notes(result))


def test_work_between_annotated_layers_is_said():
    """Layer ranges that leave kernels between two layers (an all-reduce outside the
    per-layer range, say): those kernels are in the step and in no layer, and a note counts
    them; without such work there is no note."""
    from kimi_perf.layer_breakdown import step_notes

    def trace(between: list[str]):
        b = TraceBuilder()
        step_start = b.clock
        b.sequence(["embedding"])
        for i, kernels in enumerate(k3_like(4)):
            start, end = b.sequence(kernels)
            b.range(f"layer[{i}](kda)", start - 10, end)
            if i < 3:
                b.sequence(between)
        b.sequence(["gemm_lm_head"])
        b.range("decode_step[0]", step_start - 20, b.clock)
        return b.build()

    noted = breakdown(trace(["allreduce_a", "allreduce_b"]))
    assert noted.steps[0]["kernels"] == 1 + sum(map(len, k3_like(4))) + 6 + 1
    assert ("6 GPU ops of steps with layers ran between their layers, in no layer and neither "
            "before the first nor after the last (counted in their step)") in step_notes(noted)
    assert not any("between their layers" in n for n in step_notes(breakdown(trace([]))))


def _window(trace, first: float, last: float):
    """The trace as a profiler that recorded only from the kernel at fraction ``first`` of
    them to the one at ``last`` (by start) would have it: GPU work outside left out."""
    from kimi_perf.trace import Kernels, MemOps, Trace

    order = np.sort(trace.kernels.start)
    t0, t1 = order[int(first * (len(order) - 1))], order[int(last * (len(order) - 1))] + 1

    def cut(table, kind):
        keep = (table.start >= t0) & (table.start < t1)
        return kind.from_columns({c: v[keep] for c, v in table.columns().items()},
                                 int(keep.sum()))
    return Trace(strings=trace.strings, kernels=cut(trace.kernels, Kernels),
                 memops=cut(trace.memops, MemOps), ranges=trace.ranges, api=trace.api,
                 meta=dict(trace.meta))


@pytest.mark.parametrize(("first", "last", "passes"), [(0.1, 0.97, 2), (0.05, 0.9, 2),
                                                       (0.15, 1.0, 3), (0.3, 0.9, 0),
                                                       (0.45, 0.8, 0)])
def test_a_trace_that_begins_and_ends_within_passes_keeps_its_whole_ones(first, last, passes):
    """zx3xyy's benchmark as a time-window capture would record it, beginning and ending
    within a forward pass (and within a layer): the whole passes in the window are steps,
    each as the whole trace has it (the embedding, 32 layers of 57 kernels, the final norm
    and LM head's 7 as its epilogue: 1,832 kernels), and the parts of passes at the window's
    edges are in no step, counted and said. A window of one whole pass shows no two passes to
    agree on what a pass is: it stays one step, as it was before passes were found in cut
    traces."""
    from kimi_perf.layer_breakdown import step_notes

    full = read_trace(NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite")
    window = _window(full, first, last)
    b = breakdown(window)
    if not passes:
        assert b.source["steps_found_by"] == "device" and len(b.steps) == 1
        return
    assert b.source["steps_found_by"] == "pass"
    assert [(s["layers"], s["kernels"], s["prologue"]["kernels"], s["epilogue"]["kernels"])
            for s in b.steps] == [(32, 1832, 1, 7)] * passes
    assert [(t["type"], t["kernels"]) for t in b.layer_types] == [("A", 57)]
    partial = b.source["outside_steps"]["partial_passes"]
    assert partial["ops"] + passes * 1832 == len(window.kernels) + len(window.memops)
    assert (f"{partial['ops']} more GPU ops") in " ".join(step_notes(b))
    assert (("in the parts of 2 forward passes the trace begins or ends within"
             if partial["parts"] == 2 else "in the part of a forward pass the trace begins or "
             "ends within") in " ".join(step_notes(b)))


@pytest.mark.parametrize(("begin", "end"), [(17, 32), (42, 76), (8, 48), (47, 12), (60, 8),
                                            (30, 40), (0, 28), (26, 0)])
def test_synthetic_passes_cut_within_a_layer(begin, end):
    """Five passes of 8 layers (embedding, 9 kernels a layer, a 4-kernel LM head: 77), the
    first ``begin`` and last ``end`` kernels not recorded: the passes left whole are steps
    of 8 layers and 77 kernels, the rest in no step."""
    seq = (["embedding"] + LLAMA * 8 + LM_HEAD) * 5
    b = TraceBuilder()
    b.sequence(seq[begin: len(seq) - end])
    result = breakdown(b.build())
    whole = 5 - (begin > 1) - (end > 4)   # (the embedding or the LM head alone lost: whole)
    assert [(s["layers"], s["kernels"]) for s in result.steps] == [(8, 77)] * whole
    assert [(t["type"], t["kernels"]) for t in result.layer_types] == [("A", 9)]
    outside = result.source["outside_steps"]
    assert outside["ops"] == len(seq) - begin - end - 77 * whole


@pytest.mark.parametrize(("begin", "end"), [(47, 70), (2, 30), (150, 97), (5, 146)])
def test_a_part_of_a_layer_at_the_edge_is_not_taken_for_a_layer_type(begin, end):
    """Four passes of 32 layers cut a kernel or more into a layer: the part of a layer at
    the trace's edge is a type of its own, which the joining layer must not be compared
    with; the two whole passes between the cuts are the steps. Both ends cut: the work
    between passes (LM head and embedding, 5 kernels) counts before each pass's layers."""
    seq = (["embedding"] + LLAMA * 32 + LM_HEAD) * 4
    b = TraceBuilder()
    b.sequence(seq[begin: len(seq) - end])
    result = breakdown(b.build())
    assert [(s["layers"], s["kernels"], s["prologue"]["kernels"], s["epilogue"]["kernels"])
            for s in result.steps] == [(32, 293, 5, 0)] * 2
    assert [(t["type"], t["kernels"]) for t in result.layer_types] == [("A", 9)]


def test_most_cuts_of_a_pass_read_as_its_whole_passes():
    """Every other kernel as the first recorded, every fourth as the last: 780 windows of the
    five passes above. None reads wrong: every op is in a step or counted in no step, and the
    steps are the passes (8 layers each; no whole pass lost, an edge pass that lost no more
    than a variant's kernels at the trace's edge kept as one) or, where the cut leaves the
    layer pattern no single joining type or the passes found do not agree, one step per
    device. Of them, 590 read as their whole passes exactly, with one layer type of 9
    kernels (before parts of passes were told apart, 11 did): a ratchet, which a change
    that reads fewer fails, and one that reads more raises."""
    seq = (["embedding"] + LLAMA * 8 + LM_HEAD) * 5
    read_right = 0
    for begin in range(0, 77, 2):
        for end in range(0, 77, 4):
            b = TraceBuilder()
            b.sequence(seq[begin: len(seq) - end])
            result = breakdown(b.build())
            window = (begin, end, result.source["steps_found_by"], len(result.steps))
            whole = 5 - (begin > 1) - (end > 4)   # (as test_synthetic_passes_cut_within_...)
            assert sum(s["kernels"] for s in result.steps) + result.source["outside_steps"][
                "ops"] == len(seq) - begin - end, window
            if result.source["steps_found_by"] == "device":
                assert len(result.steps) == 1, window
                continue
            assert result.source["steps_found_by"] == "pass", window
            assert all(s["layers"] == 8 for s in result.steps), window
            assert whole <= len(result.steps) <= whole + 2, window
            read_right += (len(result.steps) == whole and [
                (t["layers"] % 8, t["kernels"]) for t in result.layer_types] == [(0, 9)])
    assert read_right >= 590


def _types_pair_by_pair(steps: list[list[tuple]], most: int) -> list[list[str]]:
    """``assign_types`` as first written, a pair of sequences at a time (quadratic in the
    sequences of an eager MoE, each expert's GEMM of its own variant): the reference."""
    from collections import Counter

    from kimi_perf.layers import _type_label

    def difference(a, b):
        ca, cb = Counter(a), Counter(b)
        return max(sum((ca - cb).values()), sum((cb - ca).values()))

    inner, places, flat = {}, {}, []
    for layers in steps:
        for i, sig in enumerate(layers):
            flat.append(sig)
            if 0 < i < len(layers) - 1:
                inner.setdefault(sig)
            for place, at in (("first", i == 0), ("last", i == len(layers) - 1)):
                if at:
                    places.setdefault(sig, set()).add(place)
    counts, group, edges = Counter(flat), {}, []
    for sig in sorted(dict.fromkeys(flat), key=lambda s: -counts[s]):
        group[sig] = sig
        if sig in inner:
            continue
        same_place = [e for e in edges if places[e] & places[sig]]
        for candidates in (list(inner), same_place):
            if candidates:
                closest = min(candidates, key=lambda c: difference(sig, c))
                if difference(sig, closest) <= most:
                    group[sig] = group.get(closest, closest)
                    break
        edges.append(sig)
    labels: dict = {}
    return [[labels.setdefault(group[sig], _type_label(len(labels))) for sig in layers]
            for layers in steps]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=7).map(tuple),
                         min_size=1, max_size=6), min_size=1, max_size=5),
       st.integers(0, 3))
def test_layer_types_by_sequence_as_pair_by_pair(steps, most):
    """The vectorized nearest sequence (``_Nearest``) types every layer as comparing the
    sequences a pair at a time does, ties to the first in order included."""
    from kimi_perf.layers import Layer, Step, assign_types

    names, built, at = [], [], 0
    for s, layers in enumerate(steps):
        step_layers = []
        for i, sig in enumerate(layers):
            step_layers.append(Layer(index=i, ops=np.arange(at, at + len(sig))))
            names += sig
            at += len(sig)
        built.append(Step(index=s, device=0, pid=1, name=f"s{s}", ops=np.arange(0),
                          layers=step_layers))

    class Ops:
        name = np.array(names, np.int64)

    assign_types(Ops(), built, max_variation=most)
    got = [[layer.type for layer in step.layers] for step in built]
    assert got == _types_pair_by_pair(steps, most)


# -- edges a mutation audit found unheld ----------------------------------------------------


def test_layer_type_labels_stay_distinct_past_z():
    """A model of more than 26 layer types (an eager MoE's per-expert variants) names the
    27th and later T26, T27...: never a letter again, which would merge two types' figures."""
    from kimi_perf.layers import _type_label

    labels = [_type_label(i) for i in range(60)]
    assert labels[:3] == ["A", "B", "C"] and labels[25] == "Z" and labels[26] == "T26"
    assert len(set(labels)) == 60


def test_graph_launches_make_the_steps_only_where_they_carry_nearly_all_the_work():
    """Two graph launches of three kernels each, and four eager kernels besides: graphs carry
    6 of 10 ops, far from nearly all, so the steps are not the graph launches (each would
    leave the eager work out) but the device's work, one step."""
    from kimi_perf.layers import GpuOps, find_steps

    b = TraceBuilder()
    t = 0
    for g in range(2):
        corr = 100 + g
        for i in range(3):
            b.launch(f"graph_k{i}", t, t + 50, t + 200 + 300 * i, t + 400 + 300 * i,
                     correlation=corr, api_name="cudaGraphLaunch")
        t += 2000
    for i in range(4):
        b.launch(f"eager_k{i}", t, t + 50, t + 200, t + 400)
        t += 1000
    trace = b.build()
    ops = GpuOps.of(trace)
    steps = find_steps(trace, ops)
    assert [s.found_by for s in steps] == ["device"] and len(steps[0].ops) == 10


def test_back_to_back_step_ranges_still_take_another_threads_launches():
    """Step ranges of thread 1 that touch (one ends where the next begins) do not overlap:
    a kernel that thread 2 launches within the first is that step's, borrowed."""
    from kimi_perf.layers import GpuOps, find_steps

    b = TraceBuilder()
    b.range("decode_step[0]", 0, 10_000)
    b.range("decode_step[1]", 10_000, 20_000)
    b.launch("gemm_a", 100, 150, 300, 500, tid=1)
    b.launch("gemm_b", 2_000, 2_050, 2_300, 2_500, tid=2)       # thread 2, in step 0
    b.launch("gemm_a", 10_100, 10_150, 10_300, 10_500, tid=1)
    trace = b.build()
    ops = GpuOps.of(trace)
    steps = find_steps(trace, ops)
    assert [(s.name, len(s.ops), s.other_thread_ops) for s in steps] == [
        ("decode_step[0]", 2, 1), ("decode_step[1]", 1, 0)]


def test_another_threads_launch_on_a_step_ranges_edges_is_that_steps():
    """A launch from thread 2 that begins exactly where a step range begins, or ends exactly
    where one ends, lies within it (a range's ends are inclusive, as for the step's own
    thread)."""
    from kimi_perf.layers import GpuOps, find_steps

    b = TraceBuilder()
    b.range("decode_step[0]", 0, 10_000)
    b.range("decode_step[1]", 12_000, 20_000)
    b.launch("gemm_a", 100, 150, 300, 500, tid=1)
    b.launch("gemm_b", 9_950, 10_000, 10_100, 10_300, tid=2)    # ends as step 0 ends
    b.launch("gemm_a", 12_100, 12_150, 12_300, 12_500, tid=1)
    b.launch("gemm_c", 12_000, 12_050, 12_600, 12_800, tid=2)    # begins as step 1 begins
    trace = b.build()
    ops = GpuOps.of(trace)
    steps = find_steps(trace, ops)
    assert [(s.name, len(s.ops), s.other_thread_ops) for s in steps] == [
        ("decode_step[0]", 2, 1), ("decode_step[1]", 2, 1)]


def test_layer_ranges_give_their_own_layer_numbers():
    """A pipeline stage's layers 30 and 31, from ranges that number them: indices 30 and 31,
    not their places 0 and 1 in the step."""
    b = TraceBuilder()
    b.range("decode_step[0]", 0, 10_000)
    b.range("layers.30", 100, 4_000)
    b.range("layers.31", 5_000, 9_000)
    b.launch("gemm_a", 200, 250, 300, 500)
    b.launch("gemm_b", 300, 350, 600, 800)
    b.launch("gemm_a", 5_100, 5_150, 5_300, 5_500)
    b.launch("gemm_b", 5_200, 5_250, 5_600, 5_800)
    _, (step,) = segment(b.build())
    assert step.layer_source == "nvtx" and [layer.index for layer in step.layers] == [30, 31]


def test_a_step_range_ending_with_the_one_it_encloses_encloses_it():
    """'Forward outer' holds 'Forward' whole, both ending at once: it encloses one step
    range (and holds only its own op outside it)."""
    from kimi_perf.layers import GpuOps, find_steps

    b = TraceBuilder()
    b.range("Forward outer", 0, 10_000)
    b.range("Forward", 1_000, 10_000)
    b.launch("gemm_a", 100, 150, 300, 500)
    b.launch("gemm_b", 2_000, 2_050, 2_300, 2_500)
    trace = b.build()
    ops = GpuOps.of(trace)
    steps = find_steps(trace, ops, "^Forward")
    assert [(s.name, s.encloses) for s in steps] == [("Forward outer", 1), ("Forward", 0)]


def test_step_numbers_fold_in_both_spellings():
    """Where ops were launched is counted by range name with step numbers folded, both
    ``[N]`` and ``#N``: ProfilerStep#3 and #4 are one place, not one each."""
    from kimi_perf.layers import fold_numbers

    assert fold_numbers("ProfilerStep#12") == fold_numbers("ProfilerStep#3") == "ProfilerStep#…"
    assert fold_numbers("warmup_step[7]") == "warmup_step[…]"


def test_launches_on_the_edges_of_overlapping_step_ranges_were_during_them():
    """Overlapping step ranges, and two more launches of another thread: one that begins
    exactly as the first step range opens, one that returns exactly as the last closes.
    Both ran while a step range was open (the ranges' edges count in), and are said so with
    the others."""
    b = _steps_with_a_second_thread(overlap=True)
    steps = [r for r in b.ranges if b.strings.values[r["name"]].startswith("decode_step")]
    opened, closed = min(r["start"] for r in steps), max(r["end"] for r in steps)
    b.launch("side_c", opened, opened + 5, opened + 40, opened + 45, tid=2)
    b.launch("side_d", closed - 5, closed, closed + 40, closed + 45, tid=2)
    outside = breakdown(b.build()).source["outside_steps"]
    assert outside["ops"] == outside["during_overlapping_steps"] == 6


def test_a_step_range_around_one_whole_pass_and_parts_of_two_holds_no_several_passes():
    """A step range that begins and ends within a forward pass (three passes of 8 layers,
    the first and last 40 kernels outside it): it holds one whole pass between two parts,
    so nothing says it holds several passes."""
    seq = (["embedding"] + LLAMA * 8 + LM_HEAD) * 3
    b = TraceBuilder()
    start, end = b.sequence(seq[40: len(seq) - 40])
    b.range("loop", start, end)
    result = breakdown(b.build(), step_regex="^loop$")
    assert [(s["name"], s["layers"]) for s in result.steps] == [("loop", 16)]
    assert "steps_holding_passes" not in result.source


def test_work_of_cut_passes_alone_is_said_to_be_in_them_only():
    """Five passes the trace begins and ends within (the first 17 and last 32 kernels not
    recorded): the 105 ops in no step are all in the cut passes, and the note says only
    that, not that some were launched outside every step's range."""
    from kimi_perf.layer_breakdown import step_notes

    seq = (["embedding"] + LLAMA * 8 + LM_HEAD) * 5
    b = TraceBuilder()
    b.sequence(seq[17: len(seq) - 32])
    result = breakdown(b.build())
    assert result.source["outside_steps"]["partial_passes"] == {"parts": 2, "ops": 105}
    assert "105 more GPU ops (105.0 µs) ran in no step: 105 in the parts of 2 forward passes " \
           "the trace begins or ends within" in step_notes(result)


def test_a_launch_after_a_nested_step_range_closes_within_the_one_around_it_was_during_it():
    """Step range 0 runs on past step range 1, which it holds; another thread launches a
    kernel in step 1's range, and one after step 1's range closes while step 0's is still
    open: both were launched while a step range was open."""
    b = nvtx_decode_trace("layer[{i}]({kind})", steps=2, n_layers=4)
    ranges = {b.strings.values[r["name"]]: r for r in b.ranges}
    outer, inner = ranges["decode_step[0]"], ranges["decode_step[1]"]
    outer["end"] = inner["end"] + 10_000
    for t in (inner["start"] + 30, inner["end"] + 100):
        b.launch("side", t, t + 5, t + 40, t + 45, tid=2)
    outside = breakdown(b.build()).source["outside_steps"]
    assert outside["ops"] == outside["during_overlapping_steps"] == 2
