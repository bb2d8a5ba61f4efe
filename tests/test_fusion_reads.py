"""The fusion ledger held to what the launches read, an independent check of
``kimi_perf/decode/fusions.py``: in one step of each path, every weight and every piece of
decode state is traced to the launches whose arguments hold it (or a tensor the path packed
from it). A fused launch must read what the standard launches it replaces read there, and
nothing the ledger puts elsewhere. A test of the names alone cannot see a fusion that reads
weights or state filed under the wrong launch; this one can. The standard launches that read
neither (``READ_NOTHING``: the activations' SiTU, the MoE's finalize and add, the MLA output
gate and split merge) it cannot place: only the names test holds those."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from kimi_perf.decode.config import preset  # noqa: E402
from kimi_perf.decode.fusions import REPLACES, SHARED_WITH  # noqa: E402
from kimi_perf.decode.validate import make_path  # noqa: E402
from kimi_perf.decode.weights import random_weights  # noqa: E402
from tests.poisoning import poison_fresh_buffers  # noqa: E402

SMALL = preset("tiny", n_layers=4)     # layer 0 dense, 1-2 KDA, 3 gated MLA
BEFORE = "(before the first launch)"   # the embedding lookup, on both paths
# standard launches whose arguments hold no weight and no state: this check cannot place them
READ_NOTHING = {"dense_situ_and_mul", "shared_situ_and_mul", "moe_finalize", "moe_add",
                "gate_sigmoid_mul", "mla_decode_combine"}
# what a model holds NaN in before any weight is poisoned (a buffer made empty): untraced
UNTRACED = {"model.prefetch_checksums"}
# kv_b_proj's rows per head, which the paths split into W_UK and W_UV: a source each
KV_B_ROWS = {"(W_UK rows)": slice(0, SMALL.qk_nope), "(W_UV rows)": slice(SMALL.qk_nope, None)}


@pytest.fixture(scope="module")
def weights():
    return random_weights(SMALL, seed=3)


def _sources(weights) -> dict[str, list[tuple[str, slice | None]]]:
    """Each source and what it is: weights, each whole or (kv_b_proj) some rows per head. A
    layer's routed experts are one source (the paths stack them); kv_b_proj's W_UK rows and
    W_UV rows two (the paths split them apart, for two launches)."""
    out = defaultdict(list)
    for name in weights:
        if name.endswith("kv_b_proj.weight"):
            for part, rows in KV_B_ROWS.items():
                out[f"{name} {part}"].append((name, rows))
        else:
            out[re.sub(r"experts\.\d+\.", "experts.*.", name)].append((name, None))
    return out


def _poisoned(weights, parts: list[tuple[str, slice | None]]) -> dict:
    """The weights with one source's values NaN."""
    out = dict(weights)
    for name, rows in parts:
        w = weights[name].clone()
        if rows is None:
            w.fill_(float("nan"))
        else:
            w.view(SMALL.mla_heads_local, SMALL.qk_nope + SMALL.v_head, -1)[:, rows] = float("nan")
        out[name] = w
    return out


def _held_tensors(obj, where: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a model or decode state holds, by where: attributes, dicts, lists."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif depth < 5 and isinstance(obj, dict):
        for k, v in obj.items():
            yield from _held_tensors(v, f"{where}[{k!r}]", depth + 1)
    elif depth < 5 and isinstance(obj, list | tuple):
        for k, v in enumerate(obj):
            yield from _held_tensors(v, f"{where}[{k}]", depth + 1)
    elif depth < 5 and type(obj).__module__.startswith("kimi_perf") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from _held_tensors(v, f"{where}.{k}", depth + 1)


def _storages(obj, where: str) -> dict[int, tuple[str, torch.Tensor]]:
    """Each storage the object holds once, under the first place that holds it, as a flat
    tensor of all of it (a kernel given a view may read any of it)."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in _held_tensors(obj, where):
        storage = t.untyped_storage()
        if storage.data_ptr() not in out:
            out[storage.data_ptr()] = name, t.new_empty(0).set_(storage)
    return out


def _made_from(make, weights) -> dict[str, set[str]]:
    """Which sources each of a model's storages is made from: each source's weights set to
    NaN in turn, a model built from them, the storages that then hold a NaN noted. Packing,
    slicing, casts and products (the attention residuals' folded query) all carry the NaN."""
    made_from: dict[str, set[str]] = defaultdict(set)
    with pytest.MonkeyPatch.context() as patch:
        # buffers a model makes empty hold NaN from the start, in every build: not made from
        # any weight, and untraced (a packed weight padded so would lose its reads: say so)
        poison_fresh_buffers(patch)
        empty = {where for where, flat in _storages(make(weights), "model").values()
                 if _holds_nan(flat)}
        assert empty <= UNTRACED, f"holding NaN before any weight is poisoned: {empty}"
        for source, parts in _sources(weights).items():
            for where, flat in _storages(make(_poisoned(weights, parts)), "model").values():
                if where not in empty and _holds_nan(flat):
                    made_from[where].add(source)
    return made_from


def _holds_nan(t: torch.Tensor) -> bool:
    return t.is_floating_point() and bool(torch.isnan(t).any())


class _LaunchReads(TorchDispatchMode):
    """Which sources each launch's PyTorch ops and Triton kernels take as arguments, by
    (layer, launch): the launch is the one the model last announced."""

    def __init__(self, model, held: dict[int, set[str]]):
        super().__init__()
        self.model, self.held = model, held
        self.reads: dict[tuple[int, str], set[str]] = defaultdict(set)

    def note(self, args) -> None:
        where = self.model.launches[-1] if self.model.launches else (-1, BEFORE)
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor):
                self.reads[where] |= self.held.get(t.untyped_storage().data_ptr(), set())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.note((args, kwargs))
        return func(*args, **(kwargs or {}))


def launch_reads(path: str, weights, verify: bool = False, splits: int | None = None
                 ) -> dict[tuple[int, str], set[str]]:
    """(layer, launch) -> the weights (by ``_sources``) and decode state (``state.kv[3]``)
    its arguments hold, in one decode step of batch 2 after a prompt (or, after a prompt and
    a verify step whose tokens were partly accepted, a verify step of 1 + 3 tokens).
    ``splits``: the MLA attention's splits over the positions (1 on a CPU by default)."""
    base, _, option = path.partition("+")

    def make(w):
        model = make_path(base, SMALL, w, torch.float32)
        model.l2_prefetch = option == "l2"
        model.group_experts_from = 1 if option == "grouped" else None
        model.attention_splits = splits
        return model

    made_from = _made_from(make, weights)
    model = make(weights)
    held = {ptr: made_from[where] for ptr, (where, _) in _storages(model, "model").items()
            if made_from.get(where)}
    state = model.new_state(2, 12, max_verify=4 if verify else 0)
    held |= {ptr: {where} for ptr, (where, _) in _storages(state, "state").items()}
    tokens = torch.randint(0, SMALL.vocab, (2, 11), generator=torch.Generator().manual_seed(2))
    model.forward(tokens[:, :3], state)
    if verify:     # accepted positions pending: the recorded step folds them in first
        model.forward(tokens[:, 3:7], state, verify=True)
        state.accept(torch.tensor([2, 3]))
    model.launches = []
    mode = _LaunchReads(model, held)
    run = interpreter.InterpretedFunction.run

    def noted_run(kernel, *args, **kwargs):
        mode.note((args, kwargs))
        return run(kernel, *args, **kwargs)

    interpreter.InterpretedFunction.run = noted_run
    try:
        with mode:
            model.forward(tokens[:, 7:11] if verify else tokens[:, 3:4], state, verify=verify)
    finally:
        interpreter.InterpretedFunction.run = run
    return dict(mode.reads)


def ledger_problems(standard: dict, specialized: dict, replaces=REPLACES,
                    shared_with=SHARED_WITH) -> list[str]:
    """Each source of each layer, its readers on the two paths: every standard launch that
    reads it must have its fused launch among the specialized readers (the launch whose
    ``replaces`` names it, or one it shares its work with), and every specialized reader
    must be such a launch of one of the standard readers."""
    problems = []
    layers = {layer for layer, _ in standard} | {layer for layer, _ in specialized}
    for layer in sorted(layers):
        present = {name for at, name in specialized if at == layer}

        def readers(reads, source, layer=layer):
            return {name for (at, name), srcs in reads.items() if at == layer and source in srcs}

        def fused(standard_launch: str, present=present) -> set[str]:
            return ({x for x in present if standard_launch in replaces.get(x, (x,))}
                    | set(shared_with.get(standard_launch, ())))

        sources = {s for (at, _), srcs in [*standard.items(), *specialized.items()]
                   if at == layer for s in srcs}
        for source in sorted(sources):
            ys, xs = readers(standard, source), readers(specialized, source)
            unpaired = ([f"standard {y}" for y in sorted(ys) if not fused(y) & xs]
                        + [f"specialized {x}" for x in sorted(xs)
                           if not any(x in fused(y) for y in ys)])
            if unpaired:
                problems.append(f"layer {layer}: {source} is read by {sorted(ys)} (standard) "
                                f"and {sorted(xs)} (specialized); the ledger pairs no reader "
                                f"of the other path with {', '.join(unpaired)}")
    return problems


@pytest.fixture(scope="module")
def standard_reads(weights):
    return launch_reads("standard", weights)


def _sources_read(reads: dict) -> set[str]:
    return {s for srcs in reads.values() for s in srcs}


def _all_traced(reads: dict, weights) -> None:
    """Every source and every layer's cache or state was traced to a launch (the check is
    not empty), and the standard launches that read nothing are the ones expected."""
    read = _sources_read(reads)
    assert set(_sources(weights)) <= read, set(_sources(weights)) - read
    for layer in range(SMALL.n_layers):
        assert (f"state.kv[{layer}]" if SMALL.is_mla(layer) else f"state.kda[{layer}]") in read
    names = {name for _, name in reads}
    read_nothing = {n for n in names if not any(srcs for (_, m), srcs in reads.items() if m == n)}
    assert read_nothing <= READ_NOTHING, read_nothing - READ_NOTHING


@pytest.mark.parametrize("path", ["specialized", "specialized+grouped"])
def test_each_fused_launch_reads_what_the_launches_it_replaces_read(weights, standard_reads,
                                                                    path):
    """The default path and the experts grouped by expert (its routing in a launch of its
    own), against the standard path: weight by weight, state by state."""
    specialized = launch_reads(path, weights)
    assert ledger_problems(standard_reads, specialized) == []
    # every weight was traced to a launch on both paths, and the caches and states too
    _all_traced(standard_reads, weights)
    _all_traced(specialized, weights)
    assert _sources_read(specialized) == _sources_read(standard_reads)
    assert all(specialized.values())   # every fused launch reads some weight or state


def test_the_ledger_holds_for_the_one_kernel_per_step_standard_path(weights):
    """``standard_kernels`` (the standard path as a GPU runs it, its MLA splits merged in a
    launch of their own) against the specialized path: the same check."""
    standard = launch_reads("standard_kernels", weights, splits=2)
    specialized = launch_reads("specialized", weights, splits=2)
    assert ledger_problems(standard, specialized) == []
    _all_traced(standard, weights)
    _all_traced(specialized, weights)
    assert any(name == "mla_decode_combine" for _, name in standard)


def test_a_verify_step_reads_alike(weights):
    """A verify step of 1 + 3 tokens: the KDA's records for the rollback go with
    fused_kda_decode on both paths."""
    standard = launch_reads("standard", weights, verify=True)
    specialized = launch_reads("specialized", weights, verify=True)
    assert ledger_problems(standard, specialized) == []
    _all_traced(standard, weights)
    _all_traced(specialized, weights)
    kda = {s for (at, name), srcs in specialized.items() if at == 1
           and name == "fused_kda_decode" for s in srcs}
    assert {"state.records[1]", "state.inputs[1]"} <= kda


def test_the_l2_prefetch_reads_what_o_proj_then_streams(weights, standard_reads):
    """``l2_prefetch`` replaces no launch: it reads, on the side stream, the weights of the
    layer's o_proj and nothing else; the other launches keep their pairing."""
    specialized = launch_reads("specialized+l2", weights)
    prefetches = {at: srcs for (at, name), srcs in specialized.items() if name == "l2_prefetch"}
    assert sorted(prefetches) == list(range(SMALL.n_layers))
    for layer, srcs in prefetches.items():
        prefix = f"model.layers.{layer}.self_attn."
        assert srcs == {prefix + "o_proj.weight"} == specialized[layer, "o_proj"]
    rest = {k: v for k, v in specialized.items() if k[1] != "l2_prefetch"}
    assert ledger_problems(standard_reads, rest) == []
    _all_traced(rest, weights)


def test_a_fusion_filed_under_the_wrong_launch_is_caught(weights, standard_reads):
    """The check can fail: the ledger with g_proj's work moved from qkv_a_g_proj (where the
    kernel does it) to q_b_proj, or without the cache insert's share of the q/kv RMSNorm."""
    specialized = launch_reads("specialized", weights)
    moved = dict(REPLACES, qkv_a_g_proj=("fused_qkv_a_proj",),
                 q_b_proj=("fused_q_kv_rmsnorm", "q_b_proj", "g_proj"))
    problems = ledger_problems(standard_reads, specialized, replaces=moved)
    assert problems and all("g_proj.weight" in p for p in problems), problems
    unshared = ledger_problems(standard_reads, specialized, shared_with={})
    assert len(unshared) == 1 and "kv_a_layernorm" in unshared[0], unshared
    # W_UK's and W_UV's launches swapped: both read kv_b_proj, but not the same rows of it
    swapped = dict(REPLACES, bmm_w_uk_cache_insert=("bmm_w_uv", "q_concat_kv_cache_insert"),
                   bmm_w_uv_gate=("mla_decode_combine", "bmm_w_uk", "gate_sigmoid_mul"))
    problems = ledger_problems(standard_reads, specialized, replaces=swapped)
    assert problems and all("kv_b_proj.weight (W_U" in p for p in problems), problems
