"""The latency-specialized decode path against the standard path and the reference."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

# fresh buffers start poisoned: a path that reads one before writing it cannot pass on the
# zeros fresh memory often holds (tests/poisoning.py)
pytestmark = pytest.mark.usefixtures("poisoned_empty")

from kimi_perf.decode.config import preset  # noqa: E402
from kimi_perf.decode.model import K3Model  # noqa: E402
from kimi_perf.decode.specialized import SpecializedModel, build_model  # noqa: E402
from kimi_perf.decode.standard_kernels import StandardKernelsModel  # noqa: E402
from kimi_perf.decode.validate import make_path, rel_err, validate  # noqa: E402
from kimi_perf.decode.weights import random_weights  # noqa: E402
from kimi_perf.trace import Trace  # noqa: E402
from tests.kernels.util import RecordingGemv  # noqa: E402

# Four layers keep the structure (dense layer 0, KDA layers, MLA last, a residual block
# boundary at 3) at a quarter of the interpreter time.
SMALL = preset("tiny", n_layers=4)


def test_fresh_buffers_start_poisoned_in_the_paths_tests():
    """What the paths allocate fresh (torch.empty, empty_strided, Tensor.new_empty) is poison
    here, as in the kernel tests: a buffer read before it is written cannot pass as zeros."""
    assert torch.isnan(torch.empty(3)).all() and torch.isnan(torch.ones(2).new_empty(4)).all()
    assert torch.isnan(torch.empty_strided((2, 2), (1, 2))).all()
    assert (torch.zeros(1, dtype=torch.int64).new_empty(2) == torch.iinfo(torch.int64).min).all()


@pytest.fixture(scope="module")
def weights():
    return random_weights(SMALL, seed=5)


KERNEL_PATHS = ["specialized", "standard_kernels"]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(("batch", "splits"), [(1, None), (8, None), (2, 3)])
def test_kernel_paths_equal_standard_in_float32(weights, path, batch, splits):
    """The specialized path, and the standard path one kernel per step, against the standard
    path's PyTorch ops, over many decode steps; also with the MLA attention split over the
    cache positions, as a GPU splits it at small batches."""
    std = K3Model(SMALL, weights, dtype=torch.float32)
    fast = make_path(path, SMALL, weights, torch.float32)
    fast.attention_splits = splits
    fast.l2_prefetch = splits is not None  # a read of o_proj's weights changes nothing
    s_std, s_fast = std.new_state(batch, 16), fast.new_state(batch, 16)
    tokens = torch.randint(0, SMALL.vocab, (batch, 9), generator=torch.Generator()
                           .manual_seed(batch))
    std.forward(tokens[:, :3], s_std)
    fast.forward(tokens[:, :3], s_fast)        # prefill: falls back to the standard path
    assert fast.fallbacks == ["call 0: a prompt of 3 tokens"]
    for t in range(3, 9):
        want = std.forward(tokens[:, t: t + 1], s_std)
        got = fast.forward(tokens[:, t: t + 1], s_fast)
        assert rel_err(got, want.double()) < 1e-4
    for i in s_std.kda:
        torch.testing.assert_close(s_fast.kda[i], s_std.kda[i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s_fast.conv[i], s_std.conv[i])
    assert len(fast.fallbacks) == 1


def test_grouped_experts_equal_standard_from_their_batch_on(weights):
    """``group_experts_from``: steps of that many tokens or more route first and stream each
    picked expert once (a decode step of 8, a verify step of 8 × 4); smaller steps keep the
    per-slot kernel. The same results as the standard path's, step after step."""
    std = K3Model(SMALL, weights, dtype=torch.float32)
    fast = SpecializedModel(SMALL, weights, dtype=torch.float32, group_experts_from=8)
    batch = 8
    s_std, s_fast = (m.new_state(batch, 24, max_verify=4) for m in (std, fast))
    tokens = torch.randint(0, SMALL.vocab, (batch, 16), generator=torch.Generator()
                           .manual_seed(30))
    std.forward(tokens[:, :3], s_std)
    fast.forward(tokens[:, :3], s_fast)
    for t in range(3, 7):
        fast.launches = []
        want = std.forward(tokens[:, t: t + 1], s_std)
        got = fast.forward(tokens[:, t: t + 1], s_fast)
        assert rel_err(got, want.double()) < 1e-4
        assert [n for i, n in fast.launches if i == 1].count("router_topk") == 1
    accepted = torch.tensor([1, 4, 2, 3, 4, 1, 2, 4])
    outs = []
    for model, state in ((std, s_std), (fast, s_fast)):
        verify = model.forward(tokens[:, 7:11], state, verify=True)
        state.accept(accepted)
        outs.append((verify, model.forward(tokens[:, 11:12], state)))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert rel_err(got, want.double()) < 1e-4
    small = fast.new_state(2, 8)     # 2 tokens a step: under 8, the per-slot kernel
    fast.forward(tokens[:2, :3], small)
    fast.launches = []
    fast.forward(tokens[:2, 3:4], small)
    assert "router_topk" not in [n for _, n in fast.launches]
    assert len(fast.fallbacks) == 2      # the two prefills, nothing else


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_paths_verify_step_and_rollback(weights, path):
    batch, k = 3, 3
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(0, SMALL.vocab, (batch, 4), generator=gen)
    draft = torch.randint(0, SMALL.vocab, (batch, 1 + k), generator=gen)
    nxt = torch.randint(0, SMALL.vocab, (batch, 1), generator=gen)
    accepted = [torch.tensor([1, 2, 4]), torch.tensor([3, 4, 1])]
    outs = []
    for model in (K3Model(SMALL, weights, dtype=torch.float32),
                  make_path(path, SMALL, weights, torch.float32)):
        state = model.new_state(batch, 16, max_verify=1 + k)
        model.forward(prompt, state)
        verify = model.forward(draft, state, verify=True)
        state.accept(accepted[0])
        again = model.forward(draft.flip(1), state, verify=True)  # replays the first's
        state.accept(accepted[1])
        outs.append((verify, again, model.forward(nxt, state), state))
    (*std_logits, st_std), (*fast_logits, st_fast) = outs
    for got, want in zip(fast_logits, std_logits, strict=True):
        assert rel_err(got, want.double()) < 1e-4
    assert torch.equal(st_std.lengths, st_fast.lengths)
    for i in st_std.kda:
        assert rel_err(st_fast.kda[i], st_std.kda[i].double()) < 1e-4


def test_plain_projections_take_the_opt_in_gemv_where_it_has_a_build(weights):
    """``SpecializedModel(gemv=...)`` (the CuTe DSL GEMV on a GPU) takes in_proj,
    qkv_a_g_proj and o_proj at 1-4 tokens, nothing else, with the same launches and result;
    a verify step of more tokens keeps the Triton GEMM."""
    from kimi_perf_kernels.cute_gemv import decode_shapes

    shapes = decode_shapes(SMALL)
    gemv = RecordingGemv(shapes)
    plain, routed = (SpecializedModel(SMALL, weights, dtype=torch.float32, gemv=g)
                     for g in (None, gemv))
    tokens = torch.randint(0, SMALL.vocab, (2, 6), generator=torch.Generator().manual_seed(8))
    states = [m.new_state(2, 12, max_verify=4) for m in (plain, routed)]
    for m, st in zip((plain, routed), states, strict=True):
        m.forward(tokens[:, :3], st)
        m.launches = []
    assert gemv.calls == []  # the prefill takes the standard path
    for t in (3, 4):
        want, got = (m.forward(tokens[:, t: t + 1], st)
                     for m, st in zip((plain, routed), states, strict=True))
        assert rel_err(got, want.double()) < 1e-5
    assert routed.launches == plain.launches
    assert set(gemv.calls) == {(2, n, k) for n, k in shapes.values()}
    n_kda, n_mla = (sum(SMALL.is_mla(i) == mla for i in range(SMALL.n_layers))
                    for mla in (False, True))
    assert len(gemv.calls) == 2 * (2 * n_kda + 2 * n_mla)   # 2 steps, 2 per layer
    gemv.calls.clear()
    routed.forward(tokens[:, 2:6], states[1], verify=True)   # 2 × 4 tokens
    assert gemv.calls == []


def _tp_kernel_path(rank: int, path: str, weights, dtype=torch.float32, sent=None, batch=2,
                    steps=2):
    import torch.distributed as dist

    from kimi_perf.decode.tp import all_reduce_sum
    from kimi_perf.decode.weights import shard

    sharded = SMALL.shard(dist.get_world_size())
    base, _, option = path.partition("+")
    model = make_path(base, sharded, shard(weights, sharded, rank), dtype)
    model.group_experts_from = 1 if option == "grouped" else None
    model.all_reduce = all_reduce_sum
    if sent is not None:   # what each all-reduce sends: (dtype, elements)
        def recorded(x):
            sent.append((x.dtype, x.numel()))
            return all_reduce_sum(x)
        model.all_reduce = recorded
    state = model.new_state(batch, 3 + steps)
    tokens = _tp_tokens(batch, steps)
    model.forward(tokens[:, :3], state)
    if sent is not None:
        sent.clear()        # the prefill's, the standard path's: the decode steps' from here
    model.launches = []
    logits = [model.forward(tokens[:, 3:4], state)[:, -1]]
    launches = list(model.launches)
    model.launches = None
    logits += [model.forward(tokens[:, t: t + 1], state)[:, -1] for t in range(4, 3 + steps)]
    return torch.stack(logits), launches


def _tp_tokens(batch: int, steps: int) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab, (batch, 3 + steps),
                         generator=torch.Generator().manual_seed(6 + batch))


def _tp1_logits(weights, batch: int, steps: int) -> torch.Tensor:
    """The standard path's logits on one rank, for the runs of _tp_kernel_path."""
    single = K3Model(SMALL, weights, dtype=torch.float32)
    state = single.new_state(batch, 3 + steps)
    tokens = _tp_tokens(batch, steps)
    single.forward(tokens[:, :3], state)
    return torch.stack([single.forward(tokens[:, t: t + 1], state)[:, -1]
                        for t in range(3, 3 + steps)])


@pytest.mark.parametrize(("path", "kda", "mla"), [("specialized", 11, 14),
                                                  ("specialized+grouped", 12, 15),
                                                  ("standard_kernels", 21, 27)])
def test_kernel_paths_tp2_match_tp1(weights, path, kda, mla):
    from kimi_perf.decode.tp import run_on_cpu_ranks

    results = run_on_cpu_ranks(2, _tp_kernel_path, path, weights)
    want = _tp1_logits(weights, 2, 2)
    for got, _ in results:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    launches = results[0][1]
    per_layer = {i: sum(1 for layer, _ in launches if layer == i) for i in range(4)}
    # Specialized: 9 and 12 launches plus o_proj's all-reduce and one for the MoE, within the
    # 13 per KDA layer and 15 per gated-MLA layer the plan allows (grouped: one more, the
    # routing). Standard: 18 and 24 plus three all-reduces.
    assert (per_layer[1], per_layer[3]) == (kda, mla)


@pytest.mark.parametrize("batch", [1, 8])
def test_specialized_tp2_over_many_steps_at_batch_1_and_8(weights, batch):
    from kimi_perf.decode.tp import run_on_cpu_ranks

    steps = 6
    results = run_on_cpu_ranks(2, _tp_kernel_path, "specialized", weights, torch.float32,
                               None, batch, steps)
    want = _tp1_logits(weights, batch, steps)
    assert want.shape[:2] == (steps, batch)
    for got, _ in results:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _tp_bf16(rank: int, path: str, weights):
    sent: list = []
    logits, _ = _tp_kernel_path(rank, path, weights, torch.bfloat16, sent)
    return logits.float(), sent


def test_specialized_tp2_in_bf16_sends_what_the_standard_path_sends(weights):
    """In bf16 under TP the specialized path's one MoE all-reduce sends the routed latent and
    the shared output in bf16, as the standard path's two do (not fp32: half the bytes), and
    its logits agree with the standard path's within bf16's error."""
    from kimi_perf.decode.tp import run_on_cpu_ranks

    (fast, fast_sent), _ = run_on_cpu_ranks(2, _tp_bf16, "specialized", weights)
    (slow, slow_sent), _ = run_on_cpu_ranks(2, _tp_bf16, "standard_kernels", weights)
    assert {dtype for dtype, _ in fast_sent} == {dtype for dtype, _ in slow_sent} == {
        torch.bfloat16}
    assert sum(n for _, n in fast_sent) == sum(n for _, n in slow_sent)
    rel = (fast - slow).norm() / slow.norm()
    assert rel < 0.03, rel
    # grouped, the experts' shares are added into an fp32 buffer, which the MoE all-reduce
    # sends as it is (o_proj's stays bf16)
    (grouped, grouped_sent), _ = run_on_cpu_ranks(2, _tp_bf16, "specialized+grouped", weights)
    moe = 2 * (SMALL.latent + SMALL.hidden)        # a decode step's MoE buffer: 2 tokens
    assert [n for _, n in grouped_sent] == [n for _, n in fast_sent]
    assert [dtype for dtype, _ in grouped_sent] == [
        torch.float32 if n == moe else dtype for dtype, n in fast_sent]
    assert sum(n == moe for _, n in fast_sent) == 2 * 3   # 2 steps × 3 MoE layers
    assert (grouped - slow).norm() / slow.norm() < 0.03


def readme_launches() -> dict[str, dict[str, int]]:
    """The README's table of launches per layer: per layer type, per column (``standard, TP
    1``, ...), the count it states."""
    from tests.conftest import REPO

    table = (REPO / "README.md").read_text().split("\n| layer | standard, TP 1 |", 1)[1]
    rows = [line.strip("|").split("|") for line in ("| layer | standard, TP 1 |" + table)
            .split("\n\n", 1)[0].splitlines()]
    header = [cell.strip() for cell in rows[0]]
    return {row[0].split("`")[1]: {h: int(cell) for h, cell in zip(header[1:], row[1:],
                                                                      strict=True)}
            for row in rows[2:]}


def test_the_readme_s_launch_table_is_read_whole():
    """(What the two tests below hold the README's table to.)"""
    assert readme_launches() == {
        "kda": {"standard, TP 1": 18, "specialized, TP 1": 9,
                "standard, TP > 1": 21, "specialized, TP > 1": 11},
        "mla": {"standard, TP 1": 24, "specialized, TP 1": 12,
                "standard, TP > 1": 27, "specialized, TP > 1": 14},
        "dense": {"standard, TP 1": 9, "specialized, TP 1": 7,
                  "standard, TP > 1": 11, "specialized, TP > 1": 9}}


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_validate_every_path_in_bf16(kv_cache):
    """Against the float64 reference within bf16's bounds: both paths, and the standard one
    as a GPU runs it (one kernel per step), with a bf16 and an fp8 latent cache."""
    result = validate("tiny", ("standard", "standard_kernels", "specialized"), steps=4,
                      batch=2, n_layers=4, kv_cache=kv_cache)
    assert result["ok"], result["failures"]
    assert result["paths"]["standard_kernels"]["layer_types"]["mla"]["launches"] == 24
    fast = result["paths"]["specialized"]
    # the ceiling is 13 and 15; the reference states what the path launches
    assert fast["layer_types"]["kda"]["launches"] == 9
    assert fast["layer_types"]["mla"]["launches"] == 12
    assert result["paths"]["standard"]["layer_types"]["kda"]["launches"] == 18
    assert fast["fallbacks"] == ["prefill: a prompt of 4 tokens"]
    # the README's table says what each path launches at TP 1
    assert {kind: {f"{path}, TP 1": result["paths"][path]["layer_types"][kind]["launches"]
                   for path in ("standard", "specialized")} for kind in ("kda", "mla", "dense")
            } == {kind: {column: n for column, n in said.items() if column.endswith("TP 1")}
                  for kind, said in readme_launches().items()}


def test_mxfp4_experts_stream_as_mxfp4_and_compute_the_same_math(monkeypatch):
    """``experts="mxfp4"``: the routed experts hold MXFP4 values, both kernel paths' expert
    launches take them as codes and scales, and in float32 both match the float64 reference
    on those values within the float32 bound (the math itself)."""
    import kimi_perf_kernels.moe_experts as moe_experts

    taken = []
    expert_args = moe_experts.expert_args
    monkeypatch.setattr(moe_experts, "expert_args",
                        lambda w, what: taken.append((type(w).__name__, what))
                        or expert_args(w, what))
    result = validate("tiny", ("standard_kernels", "specialized"), steps=2, batch=2,
                      n_layers=4, dtype="float32", experts="mxfp4")
    assert result["ok"], result["failures"]
    assert result["experts"] == "mxfp4" and result["bounds"]["layer"] == 1e-4
    # 3 MoE layers (all but the dense layer 0) x 2 decode steps x 2 paths, FC1 and FC2 each
    assert sorted(set(taken)) == [("Mxfp4", "FC1"), ("Mxfp4", "FC2")] and len(taken) == 24


def test_mxfp4_experts_are_refused_where_they_cannot_be(weights):
    """Weights whose experts MXFP4 cannot hold, an unknown storage, and a rank whose expert
    matrices are not whole groups of 32 are refused by name; the grouped experts stream the
    MXFP4 experts as the per-slot ones do."""
    from kimi_perf.decode.weights import mxfp4_experts, shard

    with pytest.raises(ValueError, match="hold values MXFP4 cannot"):
        build_model(SMALL, weights, "latency_specialized", experts="mxfp4")
    with pytest.raises(ValueError, match="experts: bf16 or mxfp4, not 'fp8'"):
        build_model(SMALL, weights, experts="fp8")
    with pytest.raises(ValueError, match="experts: bf16 or mxfp4, not 'fp8'"):
        random_weights(SMALL, experts="fp8")
    rounded = mxfp4_experts(weights)
    with pytest.raises(ValueError, match=r"intermediate per rank is 16 \(at TP 4\)"):
        build_model(SMALL.shard(4), shard(rounded, SMALL.shard(4), 0), "latency_specialized",
                    experts="mxfp4")
    fast = build_model(SMALL, rounded, "latency_specialized", experts="mxfp4")
    packed = fast.expert_weights(1, "w13")
    assert packed.packed.numel() * 4 == fast.packed[1]["w13"].numel() * 2   # 4 bits a value
    plain = build_model(SMALL, rounded, "latency_specialized")    # bf16 experts: the stack
    assert plain.expert_weights(1, "w13") is plain.packed[1]["w13"]


def _held_bytes(held: object, storages: dict[int, int] | None = None) -> int:
    """The bytes of every tensor storage reachable from ``held`` (a model's attributes, its
    dicts and lists), each storage once however many views of it there are."""
    storages = {} if storages is None else storages
    if isinstance(held, torch.Tensor):
        storage = held.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    elif isinstance(held, dict):
        for value in held.values():
            _held_bytes(value, storages)
    elif isinstance(held, list | tuple):
        for value in held:
            _held_bytes(value, storages)
    elif hasattr(held, "__dict__") and not isinstance(held, type):
        _held_bytes(vars(held), storages)
    return sum(storages.values())


@pytest.mark.parametrize(("backend", "options"), [("auto", {"standard_ops": "torch"}),
                                                  ("auto", {"standard_ops": "kernels"}),
                                                  ("latency_specialized", {})])
def test_every_path_holds_its_weights_once(backend, options):
    """A weight packed with others for one launch (in_proj's six, q_a with kv_a and the MLA
    gate, the router with the latent down-projection, gate with up) is held there alone: the
    ops that read it apart (the fallback's) read a view of its rows, and a weight read only
    as another layout (kv_b_proj as W_UK and W_UV, the conv taps) is not kept beside it. Kept
    twice, they took 31-37% more than the checkpoint here."""
    from kimi_perf.decode.weights import weight_bytes

    model = build_model(SMALL, random_weights(SMALL, seed=5), backend, **options)
    checkpoint = weight_bytes(SMALL)
    assert checkpoint <= _held_bytes(model) <= 1.01 * checkpoint
    layer = model.packed[1]["in_proj"]      # a view, not a copy, and of the right rows
    q_rows = model.w["model.layers.1.self_attn.q_proj.weight"]
    assert q_rows.untyped_storage().data_ptr() == layer.untyped_storage().data_ptr()
    assert torch.equal(q_rows, random_weights(SMALL, seed=5)[
        "model.layers.1.self_attn.q_proj.weight"])


def test_build_model_refuses_an_option_its_path_does_not_take(weights):
    """The specialized path's opt-ins given to the standard path, or the standard path's
    ops to the specialized one, are refused by name, not dropped: a notebook asking for
    PDL would otherwise measure the standard path as if it had it."""
    for given, named in (({"pdl": True}, "pdl"), ({"l2_prefetch": True}, "l2_prefetch"),
                         ({"group_experts_from": 4}, "group_experts_from"),
                         ({"pdl": True, "l2_prefetch": True}, "l2_prefetch, pdl")):
        with pytest.raises(ValueError, match=f"^{named}: the latency-specialized path's "):
            build_model(SMALL, weights, **given)
    with pytest.raises(ValueError, match="standard_ops chooses how the standard path"):
        build_model(SMALL, weights, "latency_specialized", standard_ops="torch")
    assert build_model(SMALL, weights, pdl=False).__class__.__name__ == "K3Model"


def test_validate_specialized_verify_steps():
    """Speculative verify steps of 1+3 tokens through the fused kernels, rolled back to a
    per-sequence accepted prefix, against the float64 reference; a verify of 1+8 tokens is
    past the kernels and falls back, and says so: a path whose every decode step fell back
    checked none of its kernels, a failure."""
    result = validate("tiny", ("specialized",), steps=2, batch=2, n_layers=4, spec_tokens=3)
    assert result["ok"], result["failures"]
    fast = result["paths"]["specialized"]
    assert fast["fallbacks"] == ["prefill: a prompt of 4 tokens"]
    assert fast["layer_types"]["kda"]["launches"] == 9   # a verify step launches as decode
    too_long = validate("tiny", ("specialized",), steps=1, batch=1, n_layers=4, spec_tokens=8)
    assert too_long["paths"]["specialized"]["fallbacks"][1:] == [
        "decode_step[0]: verify of 9 tokens > 8"]
    assert not too_long["ok"] and too_long["failures"] == [
        "specialized: every decode step fell back to the standard path's PyTorch ops (verify "
        "of 9 tokens > 8): none of its kernels was checked"]
    # the standard path takes every step: nothing of it falls back
    assert validate("tiny", ("standard",), steps=1, batch=1, n_layers=4, spec_tokens=8)["ok"]


def test_fallbacks_and_backend_selection(weights):
    assert type(build_model(SMALL, weights)) is K3Model
    fast = build_model(SMALL, weights, "latency_specialized", dtype=torch.float32)
    assert isinstance(fast, SpecializedModel)
    assert fast.unsupported(torch.zeros(65, 1, dtype=torch.long), False) == "batch 65 > 64"
    assert fast.unsupported(torch.zeros(2, 9, dtype=torch.long), True) == (
        "verify of 9 tokens > 8")
    assert fast.unsupported(torch.zeros(2, 1, dtype=torch.long), False) is None
    with pytest.raises(ValueError, match="decode_backend"):
        build_model(SMALL, weights, "fast")
    # the standard path one kernel per step: a GPU's default, asked for here
    assert isinstance(build_model(SMALL, weights, standard_ops="kernels"),
                      StandardKernelsModel)
    with pytest.raises(ValueError, match="standard_ops"):
        build_model(SMALL, weights, standard_ops="eager")


def test_pdl_is_refused_where_it_is_set_on_a_gpu_before_sm90(weights, monkeypatch):
    """PDL needs sm_90: asked for on an older GPU, the model refuses when it is set, once,
    not on every step; on a CPU (the interpreter) it is taken as a flag."""
    fast = build_model(SMALL, weights, "latency_specialized", dtype=torch.float32, pdl=True)
    assert fast.pdl
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device: asked.append(device) or (8, 0))
    fast.device = torch.device("cuda", 0)   # (only the setter reads it)
    with pytest.raises(ValueError, match="sm_90"):
        fast.pdl = True
    fast.pdl = False
    assert asked == [torch.device("cuda", 0)] and not fast.pdl
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    fast.pdl = True
    assert fast.pdl


def test_the_interpreter_is_chosen_by_what_runs_the_model_alone():
    """Without TRITON_INTERPRET set: the analysis' use of the decode package (floors, the
    fusion ledger) loads no torch; importing the model, or a capture, chooses Triton's
    interpreter on a CPU before triton is imported, and the capture's version record does
    not import it first."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import os, sys\n"
        "from kimi_perf.decode.floors import floors\n"
        "from kimi_perf.decode.fusions import ledger_of\n"
        "import kimi_perf.report, kimi_perf.cli\n"
        "assert 'torch' not in sys.modules, 'torch loaded by the analysis'\n"
        "from kimi_perf.capture import environment\n"
        "environment('cpu')\n"
        "assert 'triton' not in sys.modules and 'TRITON_INTERPRET' not in os.environ\n"
        "from kimi_perf.decode.specialized import build_model\n"
        "assert os.environ['TRITON_INTERPRET'] == '1'\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_every_kernel_compiles_for_sm90a_without_spills(tmp_path):
    """The CI compile check: Triton -> PTX -> ptxas for sm_90a, registers and spills. CI runs
    it before the tests and names its table in KIMI_PERF_AOT_JSON (minutes of compiling, not
    done twice), a table of these sources (a stale one fails); elsewhere the test runs it."""
    from kimi_perf_kernels.aot import read_table

    out = Path(os.environ.get("KIMI_PERF_AOT_JSON", tmp_path / "sm90a.json"))
    if "KIMI_PERF_AOT_JSON" not in os.environ:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, "-m", "kimi_perf_kernels.aot", "--json",
                               str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = read_table(out)   # (KIMI_PERF_AOT_JSON of other sources: unset it to compile)
    names = {k["kernel"].split()[0] for k in doc["kernels"]}
    assert names >= {"attn_res", "skinny_linear", "kda_decode", "moe_route_fc1_situ",
                     "moe_fc2_combine", "mla_absorb_insert", "mla_attention", "mla_uv_gate"}
    for k in doc["kernels"]:
        assert k["spill_stores"] == 0 and k["registers"] <= 255 and k["cubin_bytes"] > 0
    # Every K3 loop that streams weights or the cache keeps loads in flight (cp.async): a loop
    # without them waits out one load's latency after another's. mla_uv_gate's merge looped
    # over the splits before its dot so, and the grouped experts' K loops, which Triton
    # pipelines only when asked (no dot in them), did, unseen while their K3 builds lacked
    # the integer arguments the JIT specialises (a K not known a multiple of 16).
    # The command fails on such a loop itself (aot.not_pipelined); here, that it saw them all.
    from kimi_perf_kernels.aot import STREAMING, streams_at_k3

    streaming = [k for k in doc["kernels"] if streams_at_k3(k["kernel"])]
    assert {k["kernel"].split()[0] for k in streaming} == STREAMING
    assert any(k["kernel"].startswith("mla_uv_gate 64 split") for k in streaming)
    assert [k["kernel"] for k in streaming if k["async_copies"] == 0] == []
    # and every configuration the kernel paths launch, in each dtype a run uses: an fp32
    # cache's attention (the GPU check's float32 run) once failed to compile on a GPU only
    launched = [k["kernel"] for k in doc["kernels"] if " tiny " in k["kernel"]]
    assert len(launched) >= 70 and any(k.startswith("mla_attention tiny (fp32,i64)")
                                       for k in launched)
    assert {k.split()[0] for k in launched} >= names - {"cute_gemv", "l2_prefetch"}
    # the weight prefetch before the PDL wait, as the GPU check's PDL runs launch it
    prefetching = [k for k in launched if re.search(r" PREFETCH_K=[1-9]", k)]
    assert prefetching and all(k.endswith(" PDL") for k in prefetching)


def test_a_compile_table_of_other_sources_is_refused(tmp_path):
    """CI's table is read only when these sources made it: one of other kernels (a file named
    in KIMI_PERF_AOT_JSON by hand, left from before an edit) would pass stale registers."""
    import json

    from kimi_perf_kernels.aot import read_table, sources_digest

    table = {"target": "sm_90a", "sources": sources_digest(), "kernels": []}
    current, stale = tmp_path / "current.json", tmp_path / "stale.json"
    current.write_text(json.dumps(table))
    stale.write_text(json.dumps(table | {"sources": "0" * 64}))
    assert read_table(current) == table
    with pytest.raises(ValueError, match=r"stale\.json: a table of other kernel sources"):
        read_table(stale)


def test_trace_command_captures_both_paths(tmp_path):
    """The main job end to end on this CPU: both paths profiled, per-layer launches from the
    traces themselves, one run directory with everything in it."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main

    result = CliRunner().invoke(main, ["trace", "--layers", "4", "--steps", "2", "--warmup",
                                       "1", "--context", "3", "--out", str(tmp_path),
                                       "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    run_dir = tmp_path / doc["run_dir"].split("/")[-1]
    (compared,) = doc["comparisons"]   # the JSON holds what the table shows
    assert doc["schema"] == 1 and (compared["a"], compared["b"]) == ("standard", "specialized")
    ratios = {r["type"]: r["kernel_ratio"] for r in compared["rows"]}
    assert (ratios["kda"], ratios["mla"]) == (2.0, 2.0)
    assert compared["notes"][0].startswith("ratios: standard over specialized")
    assert any("a CPU run's µs are CPU time" in note for note in compared["notes"])
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == ["breakdown.json", "report.html", "run.json", "specialized.kptrace",
                     "specialized.trace.json.gz", "standard.kptrace", "standard.trace.json.gz"]
    report = (run_dir / "report.html").read_text()
    assert "layer 3 (mla)" in report and "in_proj" in report
    # what ran, each path's decode metrics, launches called ops (a CPU has no kernels), and
    # each typical layer op by op; plotly.js inline, so that the file opens offline
    assert "<th>preset</th><td>tiny, 4 layers" in report and "<h2>Decode metrics</h2>" in report
    assert "<td>specialized</td><td>SpecializedModel</td>" in report
    assert "Run on a CPU, with no GPU kernels" in report and "<th>standard ops</th>" in report
    assert "the first path's time to first token (standard) is the process's first forward " \
           "pass" in report
    assert "Typical kda layer: ops in order" in report and "kernels in order" not in report
    assert ">fused_kda_decode</td><td>attention</td>" in report
    assert "Fusions, launch by launch" in report and ">f_b_proj + fused_kda_decode</td>" in report
    assert 'src="https://cdn.plot.ly' not in report and "Plotly.newPlot" in report
    saved = json.loads((run_dir / "breakdown.json").read_text())
    assert saved["schema"] == 1 and set(saved["paths"]) == {"standard", "specialized"}
    run = json.loads((run_dir / "run.json").read_text())
    assert run["preset"] == "tiny" and run["n_layers"] == 4 and run["environment"]["torch"]
    assert run["environment"]["cpu_threads"] == torch.get_num_threads()
    assert run["tp"] == run["rank_shapes_tp"] == 1
    assert run["report"] == "report.html"        # relative to the run directory, as its traces
    from kimi_perf.decode.floors import floors  # the floors of the run's shapes, recorded

    # (over the cache the median profiled step reads: the prompt, the steps to it, its own)
    read = run["context"] + run["warmup_steps"] + run["decode_steps"] // 2 + 1
    assert run["floors"] == json.loads(json.dumps(floors(SMALL, run["batch"], read)))
    for path, launches in (("standard", {"kda": 18, "mla": 24}),
                           ("specialized", {"kda": 9, "mla": 12})):
        types = {t["type"]: t for t in saved["paths"][path]["layer_types"]}
        assert {k: types[k]["kernels"] for k in launches} == launches
        # the trace where it is once the run directory has its name, as its saved copy says
        where = str(run_dir / f"{path}.trace.json.gz")
        assert saved["paths"][path]["source"]["file"] == where
        saved_meta = Trace.load(run_dir / f"{path}.kptrace").meta
        assert (saved_meta["file"], saved_meta["converted_from"]) == (
            str(run_dir / f"{path}.kptrace"), where)
        steps = saved["paths"][path]["steps"]
        assert [s["name"] for s in steps] == ["decode_step[0]", "decode_step[1]"]
        assert all(s["layers"] == 4 and s["layer_source"] == "nvtx" for s in steps)
    assert run["paths"]["specialized"]["fallbacks"] == ["prefill: a prompt of 3 tokens"]
    assert [m["logits_finite"] for m in run["paths"].values()] == [True, True]
    # a CPU run has no GPU kernels for ranges to attribute: it says so, and where they are
    ranges = CliRunner().invoke(main, ["ranges", str(run_dir / "standard.trace.json.gz")])
    assert ranges.exit_code == 0 and ("no GPU kernels in this trace (a CPU run: its launches "
                                      "are its op: ranges") in " ".join(ranges.output.split())
    # --from reads the traces back into the same report.
    again = CliRunner().invoke(main, ["trace", "--from", str(run_dir / "standard.kptrace"),
                                      "--from", str(run_dir / "specialized.trace.json.gz"),
                                      "--out", str(tmp_path), "--format", "json"])
    assert again.exit_code == 0, again.output
    read_back = json.loads(again.output)["paths"]
    assert list(read_back) == ["standard", "specialized"]
    for path, b in read_back.items():   # the same layers, kernels and µs as the capture saw
        kept = saved["paths"][path]
        assert b["layer_types"] == kept["layer_types"] and b["steps"] == kept["steps"]


def test_trace_command_with_speculative_decoding(tmp_path):
    """--spec-tokens 3: every profiled step a verify of 1+3 tokens per sequence, both paths
    (the specialized one through its kernels: only the prefill falls back), the same launches
    per layer as a decode step, decode tokens/s over the accepted tokens, and floors of the
    verify step's shape."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main
    from kimi_perf.decode.floors import floors

    result = CliRunner().invoke(main, ["trace", "--layers", "4", "--steps", "2", "--warmup",
                                       "0", "--context", "3", "--batch", "2",
                                       "--spec-tokens", "3", "--out", str(tmp_path),
                                       "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    run = doc["run"]
    assert run["spec_tokens"] == 3 and "--spec-tokens 3" in run["command"]
    # the median of 2 verify steps of 4 tokens reads at least the prompt's 3, a token kept
    # of the step before it, and its own 4
    assert run["floors"] == json.loads(json.dumps(floors(SMALL, 2, 3 + 1 + 4, tokens=4)))
    for path, launches in (("standard", {"kda": 18, "mla": 24}),
                           ("specialized", {"kda": 9, "mla": 12})):
        types = {t["type"]: t for t in doc["paths"][path]["layer_types"]}
        assert {k: types[k]["kernels"] for k in launches} == launches
        assert [s["name"] for s in doc["paths"][path]["steps"]] == ["decode_step[0]",
                                                                   "decode_step[1]"]
        metrics = run["paths"][path]
        spec = metrics["speculative"]
        assert spec["spec_tokens"] == 3 and 1 <= spec["accepted_tokens_per_step"] <= 4
        # tokens/s counts the accepted tokens of both sequences (two steps: their median is
        # their mean); accepted_tokens_per_step is per sequence
        assert metrics["decode_tokens_per_s"] == pytest.approx(
            2 * 2 * spec["accepted_tokens_per_step"] / (2 * metrics["step_latency_s"]["median"]),
            rel=1e-9)
    # the same drafts and acceptance for both paths
    assert run["paths"]["standard"]["speculative"] == run["paths"]["specialized"]["speculative"]
    assert run["paths"]["specialized"]["fallbacks"] == ["prefill: a prompt of 3 tokens"]
    report = (tmp_path / doc["run_dir"].split("/")[-1] / "report.html").read_text()
    assert "each a speculative verify of 1+3 tokens per sequence" in report
    assert "Accepted per sequence per step: standard" in report


def test_report_escapes_names_and_is_written_whole(tmp_path):
    from kimi_perf import TraceError, breakdown, read_trace
    from kimi_perf.report import write_report
    from tests.conftest import KINETO

    trace = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")
    out = write_report(tmp_path / "r.html",
                       {"vllm <a>": breakdown(trace), "again": breakdown(trace)},
                       "t <script>")
    text = out.read_text()
    assert "unrolled_elementwise_kernel&lt;at::native::" in text
    assert "unrolled_elementwise_kernel<at::native::" not in text
    assert "<script>alert" not in text and "t &lt;script&gt;" in text and "vllm &lt;a&gt;" in text
    assert "layer 23 (B)" in text and "plotly" in text
    # per layer type side by side, each side's layer count beside its medians
    assert "<th>vllm &lt;a&gt; layers</th><th>vllm &lt;a&gt; kernels</th>" in text
    assert "<tr><td>A</td><td>12</td><td>17</td><td>423.5</td><td>12</td><td>17</td>" in text
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]
    assert (out.stat().st_mode & 0o777) != 0o600
    # the typical layers side by side: short names in the cells, the whole name on hover,
    # both escaped
    assert "<th>vllm &lt;a&gt; kernel</th>" in text and "Typical A layer" in text
    assert ('<td class=name title="void ck_tile::kentry&lt;1, ck_tile::Rmsnorm2dFwd&lt;'
            'ck_tile::Rmsnorm2dFwdPipelineOnePass&lt;' in text)
    assert ">ck_tile::kentry&lt;1, ck_tile::Rmsnorm2dFwd&lt;…&gt;" in text
    small = write_report(tmp_path / "cdn.html", {"a": breakdown(trace)}, "t",
                         plotly_js="cdn")
    # one trace: its own figures per layer type, nothing to compare it with
    assert "<h2>Per layer type: a (medians over layers and steps)</h2>" in small.read_text()
    assert "<tr><td>A</td><td>12</td><td>17</td>" in small.read_text()
    assert 'src="https://cdn.plot.ly' in small.read_text()
    assert small.stat().st_size < out.stat().st_size / 5
    # a plotly.min.js of one's own, given from here (as --plotly-js): referred to from the
    # report's directory; a missing one refused
    js = tmp_path / "js" / "plotly.min.js"
    js.parent.mkdir()
    js.write_text("// plotly")
    (tmp_path / "reports").mkdir()
    shared = write_report(tmp_path / "reports" / "shared.html", {"a": breakdown(trace)}, "t",
                          plotly_js=str(js))
    assert '<script charset="utf-8" src="../js/plotly.min.js">' in shared.read_text()
    as_path = write_report(tmp_path / "reports" / "path.html", {"a": breakdown(trace)}, "t",
                           plotly_js=js)   # (a Path, as the reference has it)
    assert '<script charset="utf-8" src="../js/plotly.min.js">' in as_path.read_text()
    with pytest.raises(ValueError, match=r"plotly_js: inline, cdn or a path ending in \.js, not "
                                         "'cdn'"):   # (a Path is a file's: not the mode)
        write_report(tmp_path / "cdn.html", {"a": breakdown(trace)}, "t", plotly_js=Path("cdn"))
    with pytest.raises(TraceError, match="plotly_js: no such file"):
        write_report(tmp_path / "none.html", {"a": breakdown(trace)}, "t",
                     plotly_js=str(tmp_path / "none.js"))
    with pytest.raises(ValueError, match="no breakdowns to draw"):
        write_report(tmp_path / "none.html", {}, "t")
    assert not (tmp_path / "none.html").exists()
    with pytest.raises(ValueError, match=r"inline, cdn or a path ending in \.js"):
        write_report(tmp_path / "bad.html", {"a": breakdown(trace)}, "t",
                     plotly_js="nowhere")
    assert not (tmp_path / "bad.html").exists()


@pytest.mark.parametrize("args", [["--paths", "fast"], ["--preset", "k4"],
                                  ["--from", "/nonexistent/trace.json"], ["--graphs"],
                                  ["--tp", "3"], ["--layers", "1"]])
def test_trace_bad_input_leaves_nothing(tmp_path, args):
    proc = subprocess.run([sys.executable, "-m", "kimi_perf", "trace", "--out", str(tmp_path),
                           "--layers", "4", "--steps", "1", "--warmup", "0", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi-perf: error: "), proc.stderr
    assert list(tmp_path.iterdir()) == []


NSYS = os.environ.get("KIMI_PERF_NSYS") or shutil.which("nsys")


@pytest.mark.skipif(NSYS is None, reason="no Nsight Systems CLI (scripts/install-nsys.sh)")
def test_trace_with_the_nsys_backend(tmp_path):
    """nsys profile -> NVTX ranges -> SQLite export -> the same per-layer launches."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main

    result = CliRunner().invoke(main, ["trace", "--backend", "nsys", "--layers", "4",
                                       "--steps", "2", "--warmup", "1", "--context", "3",
                                       "--out", str(tmp_path), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)   # (stderr may say it waited for another nsys capture)
    run_dir = tmp_path / doc["run_dir"].split("/")[-1]
    names = {p.name for p in run_dir.iterdir()}
    assert {"standard.nsys-rep", "standard.sqlite", "specialized.nsys-rep",
            "specialized.sqlite", "report.html"} <= names
    for path, launches in (("standard", {"kda": 18, "mla": 24}),
                           ("specialized", {"kda": 9, "mla": 12})):
        bd = doc["paths"][path]
        assert bd["source"]["format"] == "nsys-sqlite"
        types = {t["type"]: t for t in bd["layer_types"]}
        assert {k: types[k]["kernels"] for k in launches} == launches
        # Warm-up steps are not steps; only the profiled decode steps are. The ops outside
        # them say where they ran: the prompt and the warm-up step.
        assert [s["name"] for s in bd["steps"]] == ["decode_step[0]", "decode_step[1]"]
        assert {r["range"] for r in bd["source"]["outside_steps"]["in_ranges"]} == {
            "prefill", "warmup_step[…]"}
        assert doc["run"]["paths"][path]["logits_finite"] is True   # (from the worker)


def _processes_naming(*texts: str) -> list[int]:
    """The processes whose command line holds each of ``texts``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and all(text in (proc / "cmdline").read_bytes().decode(
                    errors="replace") for text in texts):
                found.append(int(proc.name))
        except OSError:   # (ended meanwhile)
            continue
    return found


def _python_running_the_worker(run_dir: Path) -> bool:
    """Whether the worker of a run in ``run_dir`` is Python now: nsys's process names the
    worker too, and so does its child until it has exec'd Python (signals sent then reach
    no worker)."""
    for pid in _processes_naming(str(run_dir), "kimi_perf.decode.worker"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:   # (ended meanwhile)
            continue
        if argv[0] == sys.executable and argv[1:3] == ["-m", "kimi_perf.decode.worker"]:
            return True
    return False


def _wait_for(condition, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# What nsys profile does with the process it profiles: its launcher puts it in a session of
# its own (so that killing nsys leaves it running), and SIGINT to nsys stops it.
FAKE_NSYS = """
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
signal.signal(signal.SIGINT, lambda signum, frame: child.terminate())
open(sys.argv[2], "w").write(str(child.pid))
child.wait()
"""


def _kill(pids) -> None:
    """What a failed test left running (a 2-core CI machine would carry it to the end)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

STOPPED_CAPTURE = """
import signal, sys
from kimi_perf.capture import _run_nsys

def stop(signum, frame):
    raise SystemExit(143)

signal.signal(signal.SIGTERM, stop)
_run_nsys([sys.executable, sys.argv[1], "profile", sys.argv[2]])
"""


def test_nsys_stopped_with_kimi_perf_stops_the_process_it_profiles(tmp_path):
    """SIGTERM to kimi-perf alone while nsys profiles a path: nsys is told to stop (SIGINT),
    which stops the profiled process; killed instead, nsys would leave it running on."""
    fake = tmp_path / "nsys.py"
    fake.write_text(FAKE_NSYS)
    pid_file = tmp_path / "profiled.pid"
    parent = subprocess.Popen([sys.executable, "-c", STOPPED_CAPTURE, str(fake), str(pid_file)],
                              cwd=Path(__file__).parent.parent)
    try:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60)
        profiled = int(pid_file.read_text())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 143
        assert _wait_for(lambda: not Path(f"/proc/{profiled}").exists(), 30), \
            "the profiled process outlived kimi-perf"
    finally:
        parent.kill()
        parent.wait()
        if pid_file.exists() and pid_file.read_text():
            _kill([int(pid_file.read_text())])


@pytest.fixture
def own_nsys_lock(tmp_path_factory, monkeypatch) -> None:
    """A fake nsys's capture waits for no real one that another test worker runs (nor says
    it waits, in the one line its test expects)."""
    monkeypatch.setattr("kimi_perf.capture.NSYS_LOCK",
                        tmp_path_factory.mktemp("lock") / "nsys.lock")


@pytest.mark.usefixtures("own_nsys_lock")
def test_an_nsys_that_ran_no_steps_is_a_one_line_error(tmp_path, monkeypatch):
    """nsys exiting 0 without the path having run (its process stopped by a signal nsys
    passed on, or an nsys that ran nothing): said so, not a missing temporary file."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    monkeypatch.setenv("KIMI_PERF_NSYS", shutil.which("true"))
    result = CliRunner().invoke(main, ["trace", "--backend", "nsys", "--layers", "2",
                                       "--steps", "1", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "kimi-perf: error: nsys profile ended before the standard path had run its steps (the "
        "profiled process was stopped, or never started)"]
    assert list(tmp_path.iterdir()) == []


# An nsys whose profiled program ran (its metrics written as the worker writes them, with
# the nvtx release it names) and whose export holds no NVTX range, or is no database; or
# whose program was killed (nsys exits 128 + 9), as the out-of-memory killer would; or that
# could not import its capture and exited 0 all the same, as nsys 2023.4 did beside another.
FAILING_NSYS = """#!{python}
import json, sqlite3, sys
args = sys.argv[1:]
if "{how}" == "killed" and args[0] == "profile":
    sys.exit(137)
if args[0] == "profile":
    if "{how}" == "unimported":
        sys.stderr.write("Importer error status: Importation failed.\\nImport Failed with "
                         "unexpected exception: main.cpp(34)\\nError {{\\n  Type: "
                         "RuntimeError\\n  SubError {{\\n    Type: InvalidArgument\\n")
        open(args[args.index("-o") + 1] + ".qdstrm", "w").write("capture")
    else:
        open(args[args.index("-o") + 1] + ".nsys-rep", "w").write("report")
    json.dump({{"prefill_s": 0.1, "step_s": [0.1], "tokens": [2], "fallbacks": [],
               "model": "K3Model", "logits_finite": True, "nvtx": "0.2.12"}},
              open(args[-2], "w"))
elif "{how}" == "garbage":
    open(args[args.index("-o") + 1], "w").write("not an export")
else:
    sqlite3.connect(args[args.index("-o") + 1]).execute("CREATE TABLE StringIds(id, value)")
"""


@pytest.mark.parametrize("how, said", [
    ("rangeless", "the standard path: nsys recorded none of its NVTX ranges (nvtx 0.2.12 is "
                  "installed: from 0.2.12 the nvtx package switches itself off under nsys "
                  "2023.4, docs/nsys-on-a-cpu.md; pip install nvtx==0.2.11)"),
    ("killed", "the standard path: {nsys} profile exited 137: the profiled program was killed "
               "by SIGKILL (the out-of-memory killer sends it where memory runs out)"),
    ("garbage", "the standard path's standard.sqlite (removed with the unfinished run): unknown "
                "format: "),
    ("unimported", "the standard path: {nsys} profile exited 0 but wrote no report (Importer "
                   "error status: Importation failed.)")])
@pytest.mark.usefixtures("own_nsys_lock")
def test_a_failed_nsys_capture_says_why_and_leaves_nothing(tmp_path, monkeypatch, how, said):
    """A capture whose process was killed, whose NVTX ranges nsys did not hear (an nvtx
    release that switches itself off), that nsys wrote no report of, or whose export is
    unreadable (named as the path's: the file goes with the run): one line that says so, and
    no run directory, nor the folders made for --out."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    fake = tmp_path / "nsys"
    fake.write_text(FAILING_NSYS.format(python=sys.executable, how=how))
    fake.chmod(0o755)
    monkeypatch.setenv("KIMI_PERF_NSYS", str(fake))
    out = tmp_path / "made" / "runs"
    result = CliRunner().invoke(main, ["trace", "--backend", "nsys", "--layers", "2",
                                       "--steps", "1", "--paths", "standard", "--out", str(out)])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith("kimi-perf: error: " + said.format(nsys=fake)), line
    assert sorted(tmp_path.iterdir()) == [fake]


def test_a_second_nsys_profile_waits_for_the_first_and_says_so(tmp_path, capfd):
    """Two nsys profiles at once share nsys's session manager, and one of them now and then
    fails to import its capture: a second capture waits for the lock the first holds, and
    says why it waits; it runs at once when the first is done, and unlocked where the lock
    file cannot be made."""
    import fcntl
    import threading

    from kimi_perf.capture import one_nsys_capture_at_a_time

    lock = tmp_path / "nsys.lock"
    entered = threading.Event()

    def second() -> None:
        with one_nsys_capture_at_a_time(lock):
            entered.set()

    with one_nsys_capture_at_a_time(lock):
        waiting = threading.Thread(target=second)
        waiting.start()
        assert not entered.wait(0.5)   # (held: the second waits)
        assert capfd.readouterr().err == (
            f"kimi-perf: waiting for another nsys capture on this machine to end (it holds "
            f"{lock})\n")
    assert entered.wait(10)
    waiting.join()
    with open(lock) as f:   # (released by both: free to take)
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with one_nsys_capture_at_a_time(lock):   # (free: no wait, nothing said)
        pass
    with one_nsys_capture_at_a_time(tmp_path / "no-such-folder" / "nsys.lock"):
        pass
    assert capfd.readouterr().err == ""


@pytest.mark.skipif(NSYS is None, reason="no Nsight Systems CLI (scripts/install-nsys.sh)")
@pytest.mark.parametrize("stop, code, said", [
    ("SIGTERM to kimi-perf", 143, "kimi-perf: terminated"),
    ("Ctrl-C", 130, "kimi-perf: interrupted")])
def test_a_stopped_nsys_capture_leaves_no_process_and_no_run(tmp_path, stop, code, said):
    """The same with the real nsys: `kimi-perf trace --backend nsys` stopped while a path
    runs, by SIGTERM to it alone or by a terminal's Ctrl-C (SIGINT to its process group),
    exits as stopped, its run directory removed, and no process of it runs on."""
    out = tmp_path / "runs"
    trace = _nsys_capture_running(out)
    try:
        if stop == "Ctrl-C":
            os.killpg(trace.pid, signal.SIGINT)
        else:
            trace.send_signal(signal.SIGTERM)
        assert trace.wait(timeout=120) == code
        assert trace.stderr.read().strip().splitlines()[-1] == said
        assert _wait_for(lambda: not _processes_naming(str(out)), 60), _commands(out)
        assert not out.exists()   # (nor the folder made for it)
    finally:
        trace.kill()
        trace.wait()
        _kill(_processes_naming(str(out)))


@pytest.mark.skipif(NSYS is None, reason="no Nsight Systems CLI (scripts/install-nsys.sh)")
def test_a_killed_nsys_capture_leaves_no_process(tmp_path):
    """kimi-perf SIGKILLed while nsys profiles a path (or killing an nsys that would not
    stop): the profiled process, in a session of its own, sees kimi-perf gone and stops
    itself, and nsys ends with it."""
    out = tmp_path / "runs"
    trace = _nsys_capture_running(out)
    try:
        trace.kill()
        assert trace.wait(timeout=60) == -signal.SIGKILL
        assert _wait_for(lambda: not _processes_naming(str(out)), 60), _commands(out)
    finally:
        trace.stderr.close()
        _kill(_processes_naming(str(out)))


@pytest.mark.skipif(NSYS is None, reason="no Nsight Systems CLI (scripts/install-nsys.sh)")
def test_nsys_s_sigint_ends_the_worker_whatever_it_is_doing(tmp_path, monkeypatch):
    """What kimi-perf sends nsys to stop it, SIGINT, ends the worker nsys profiles and then
    nsys (130: its program ended by SIGINT), while the worker imports torch, builds its model
    or runs its steps. A worker that took it as Python's KeyboardInterrupt ended too slowly
    for nsys, which mostly left before it (0), the worker still running."""
    from kimi_perf.capture import default_request, nsys_profile_command

    monkeypatch.setenv("KIMI_PERF_NSYS", NSYS)
    request = dataclasses.replace(default_request(on_gpu=False), n_layers=2, steps=100000)
    ended = {}
    for after_s in (0.0, 0.5, 1.0, 2.0, 3.0, 5.0):   # (from the worker's start)
        command = nsys_profile_command(request, "specialized", "cpu", tmp_path)
        nsys = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                process_group=0)
        try:   # (before, nsys is starting: SIGINT ends it, there being nothing to stop)
            assert _wait_for(lambda: _python_running_the_worker(tmp_path), 60)
            time.sleep(after_s)
            nsys.send_signal(signal.SIGINT)
            code = nsys.wait(timeout=30)
            ended[after_s] = (code, "worker on" if _processes_naming(
                str(tmp_path), "kimi_perf.decode.worker") else "worker gone")
        except subprocess.TimeoutExpired:
            ended[after_s] = "nsys on"
        finally:
            nsys.kill()
            nsys.wait()
            _kill(_processes_naming(str(tmp_path)))
    assert ended == dict.fromkeys(ended, (128 + signal.SIGINT, "worker gone"))


def _nsys_capture_running(out: Path) -> subprocess.Popen:
    """`kimi-perf trace --backend nsys` with steps for hours, once nsys profile and the
    process it profiles both run (both name the worker and its metrics file, in the run
    directory being written)."""
    trace = subprocess.Popen(
        [sys.executable, "-m", "kimi_perf", "trace", "--backend", "nsys", "--layers", "2",
         "--steps", "100000", "--out", str(out)], cwd=Path(__file__).parent.parent,
        env={**os.environ, "KIMI_PERF_NSYS": NSYS}, stderr=subprocess.PIPE, text=True,
        process_group=0)   # (a group of its own, as a terminal's foreground job)
    running = _wait_for(lambda: trace.poll() is not None or len(_processes_naming(
        str(out), "kimi_perf.decode.worker")) >= 2, 300)
    if not running or trace.poll() is not None:   # (not after 300 s, or kimi-perf exited)
        why = f"kimi-perf exited {trace.returncode}" if running else "after 300 s"
        trace.kill()
        trace.wait()
        _kill(_processes_naming(str(out)))
        pytest.fail(f"no nsys capture running ({why}): {trace.stderr.read()[-2000:]}")
    return trace


def _commands(out: Path) -> list[bytes]:
    """The command lines of the processes still naming ``out``, for a failed assertion."""
    said = []
    for pid in _processes_naming(str(out)):
        with contextlib.suppress(OSError):   # (ended meanwhile)
            said.append(Path(f"/proc/{pid}/cmdline").read_bytes()[:200])
    return said

def test_trace_with_two_tp_ranks(tmp_path):
    """--tp 2: a gloo process per rank, each profiled; rank 0's trace shows the all-reduces."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main

    result = CliRunner().invoke(main, ["trace", "--tp", "2", "--layers", "4", "--steps", "1",
                                       "--warmup", "1", "--context", "3", "--out",
                                       str(tmp_path), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    run_dir = tmp_path / doc["run_dir"].split("/")[-1]
    names = {p.name for p in run_dir.iterdir()}
    assert {f"{p}.rank{r}.trace.json.gz" for p in ("standard", "specialized")
            for r in (0, 1)} <= names
    assert doc["run"]["tp"] == 2 and len(doc["run"]["paths"]["standard"]["ranks"]) == 2
    assert doc["run"]["environment"]["cpu_threads"] == max(1, torch.get_num_threads() // 2)
    said = readme_launches()   # the README's table, TP > 1
    for path, launches, collectives in (("standard", {"kda": 21, "mla": 27, "dense": 11}, 3),
                                        ("specialized", {"kda": 11, "mla": 14, "dense": 9}, 2)):
        types = {t["type"]: t for t in doc["paths"][path]["layer_types"]}
        assert {k: types[k]["kernels"] for k in launches} == launches
        assert {k: said[k][f"{path}, TP > 1"] for k in launches} == launches
        assert types["kda"]["classes"]["communication"]["kernels"] == collectives


# aten ops that launch no kernel on a GPU: allocations and views.
NO_KERNEL = {getattr(torch.ops.aten, name) for name in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
    "_unsafe_view", "slice", "select", "as_strided", "t", "transpose", "permute", "expand",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "detach", "alias",
    "_reshape_alias", "lift_fresh")}


@pytest.mark.parametrize(("path", "batch", "tokens_per_seq", "splits"),
                         [("specialized", 2, 1, None), ("specialized", 1, 4, 3),
                          ("specialized+l2", 2, 1, None), ("specialized+grouped", 3, 4, None),
                          ("specialized+pdl", 1, 4, 3),
                          ("standard_kernels", 2, 1, None), ("standard_kernels", 1, 4, 3)])
def test_annotated_launches_are_the_launches(weights, path, batch, tokens_per_seq, splits,
                                             monkeypatch):
    """Per layer, a kernel path's ``launch`` annotations (what the CPU table and ``validate``
    count) are exactly the kernels a GPU would run: one Triton kernel, one cuBLAS call (mm,
    bmm) or one elementwise op each, and the collectives; nothing in between that launches a
    kernel of its own (a copy, a cat, a cast). The specialized path launches Triton kernels
    only. An identity all-reduce stands in for TP's, so its neighbours are checked too."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    model = make_path(path.partition("+")[0], SMALL, weights, torch.float32)
    model.l2_prefetch = path.endswith("+l2")          # one launch more per layer
    model.group_experts_from = 1 if path.endswith("+grouped") else None   # and per MoE
    model.pdl = path.endswith("+pdl")                 # none more: every launch flagged
    model.pdl_prefetch_bytes = 8 << 20 if model.pdl else 0   # (the interpreter: none read)
    model.attention_splits = splits  # 3: the standard path adds FlashMLA's combine launch
    state = model.new_state(batch, 16, max_verify=tokens_per_seq)
    prompt = torch.randint(0, SMALL.vocab, (batch, 3), generator=torch.Generator().manual_seed(9))
    model.forward(prompt, state)
    actual: list[tuple[int, str]] = []
    in_kernel = []
    launch_flags: dict[str, set[tuple[bool, bool]]] = {}   # kernel: (launch_pdl, PDL)

    def all_reduce(x):
        actual.append((model.layer, "all_reduce"))
        return x

    model.all_reduce = all_reduce
    launch_grid = interpreter.GridExecutor.__call__

    def counted_launch(self, *args, **kwargs):
        actual.append((model.layer, self.fn.__name__))
        launch_flags.setdefault(self.fn.__name__, set()).add(
            (kwargs.get("launch_pdl", False), kwargs.get("PDL", False)))
        in_kernel.append(True)
        try:
            return launch_grid(self, *args, **kwargs)
        finally:
            in_kernel.pop()

    class TorchKernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not in_kernel and func.overloadpacket not in NO_KERNEL:
                actual.append((model.layer, f"aten.{func.overloadpacket.__name__}"))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted_launch)
    model.launches = []
    tokens = torch.randint(0, SMALL.vocab, (batch, tokens_per_seq))
    with TorchKernels():
        model.forward(tokens, state, verify=tokens_per_seq > 1)
    assert not model.fallbacks[1:]
    for layer in range(SMALL.n_layers):
        annotated = [name for i, name in model.launches if i == layer]
        ran = [name for i, name in actual if i == layer]
        torch_ops = [name for name in ran if name.startswith("aten.")]
        if path.startswith("specialized"):
            assert not torch_ops, (layer, ran)
            assert ran.count("l2_prefetch_kernel") == model.l2_prefetch
            grouped = path.endswith("+grouped") and layer > 0     # layer 0: a dense MLP
            assert ran.count("moe_grouped_fc1_situ_kernel") == grouped
            assert ran.count("moe_grouped_fc2_kernel") == grouped
            assert ran.count("router_topk_kernel") == grouped
        else:
            assert set(torch_ops) <= {"aten.mm", "aten.bmm", "aten.add"}, (layer, ran)
        assert len(ran) == len(annotated), (layer, annotated, ran)
        if path == "standard_kernels" and SMALL.is_mla(layer):
            assert ("mla_decode_combine" in annotated) == (splits is not None)
        assert ran.count("all_reduce") == sum("all_reduce" in name for name in annotated)
    # PDL (the interpreter leaves griddepcontrol out: PDL stays False) on every launch of the
    # path's stream; the L2 prefetch, on a stream of its own, never takes part
    assert {k: v for k, v in launch_flags.items() if k != "l2_prefetch_kernel"} == \
        {k: {(model.pdl, False)} for k in launch_flags if k != "l2_prefetch_kernel"}
    assert launch_flags.get("l2_prefetch_kernel", {(False, False)}) == {(False, False)}


def test_a_path_whose_every_step_fell_back_is_said_to_have(weights):
    """A kernel path that took none of a run's decode steps (a batch over 64): the harness
    names each call it left to the standard path's ops by its trace range, the metrics merge
    a run of them into one entry, say that every step fell back and do not call the timing
    the interpreter's kernels; a path that took some steps does not."""
    from kimi_perf.capture import TraceRequest, _metrics
    from kimi_perf.decode.harness import run_decode

    fast = SpecializedModel(SMALL, weights, dtype=torch.float32)
    run_decode(fast, torch.zeros(65, 2, dtype=torch.long), steps=3, warmup=1)
    assert fast.fallbacks == ["prefill: batch 65 > 64", "warmup_step[0]: batch 65 > 64",
                              *(f"decode_step[{i}]: batch 65 > 64" for i in range(3))]
    req = TraceRequest("tiny", 2, batch=65, context=2, steps=3, warmup=1)
    whole = _metrics(req, "cpu", 0.1, [0.2] * 3, [65] * 3, fast.fallbacks, "SpecializedModel")
    assert whole["every_step_fell_back"] and "interpreter" not in whole["timed"]
    assert whole["fallbacks"] == ["prefill: batch 65 > 64", "warmup_step[0]: batch 65 > 64",
                                  "decode_step[0..2]: batch 65 > 64"]
    some = _metrics(req, "cpu", 0.1, [0.2] * 3, [65] * 3, fast.fallbacks[:-1],
                    "SpecializedModel")
    assert not some["every_step_fell_back"] and "interpreter" in some["timed"]
    # a CUDA graph captured from a fallback: every step replays it
    graphed = ["graph_warmup[0]: batch 65 > 64", "graph_warmup[1]: batch 65 > 64",
               "graph_capture: batch 65 > 64"]
    assert _metrics(req, "cuda", 0.1, [0.2] * 3, [65] * 3, graphed,
                    "SpecializedModel")["every_step_fell_back"]
    standard = _metrics(req, "cpu", 0.1, [0.2] * 3, [65] * 3, [], "K3Model")
    assert not standard["every_step_fell_back"]


def test_fallbacks_merge_only_runs_of_one_reason_over_consecutive_calls():
    from kimi_perf.decode.fallbacks import every_decode_step_fell_back, summarise

    calls = ["prefill: a prompt of 3 tokens", "decode_step[0]: batch 65 > 64",
             "decode_step[1]: batch 65 > 64", "decode_step[2]: verify of 9 tokens > 8",
             "decode_step[4]: verify of 9 tokens > 8", "decode_step[5]: verify of 9 tokens > 8",
             "call 7: batch 65 > 64"]
    assert summarise(calls) == ["prefill: a prompt of 3 tokens",
                                "decode_step[0..1]: batch 65 > 64",
                                "decode_step[2]: verify of 9 tokens > 8",
                                "decode_step[4..5]: verify of 9 tokens > 8",
                                "call 7: batch 65 > 64"]
    assert not every_decode_step_fell_back(calls, 6)      # decode_step[3] ran the kernels
    assert every_decode_step_fell_back(calls, 3)
    assert not every_decode_step_fell_back(calls[:1], 0)


def test_trace_metrics_on_a_gpu_come_from_a_run_without_the_profiler(tmp_path, monkeypatch):
    """On a GPU the decode metrics come from the profiled steps run again unprofiled (the
    profiler's cost per kernel would favour the path with fewer): the same drafts and
    acceptance, the fallbacks said once, the profiled step time kept beside them. Made to
    happen here on the CPU."""
    import json

    from click.testing import CliRunner

    from kimi_perf import capture
    from kimi_perf.cli import main

    args = ["trace", "--layers", "4", "--steps", "1", "--warmup", "0", "--context", "3",
            "--batch", "2", "--spec-tokens", "3", "--paths", "specialized", "--format", "json"]
    plain = json.loads(CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a")]).output)
    monkeypatch.setattr(capture, "times_unprofiled", lambda device: True)
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output)["run"]["paths"]["specialized"]
    before = plain["run"]["paths"]["specialized"]
    assert metrics["timed"].startswith("without a profiler: the profiled run's steps, run again")
    assert before["timed"] == ("under the profiler (torch); on a CPU, Triton's interpreter "
                               "running the kernels: not a speed figure")
    standard = capture._metrics(capture.default_request(False), "cpu", 0.5, [0.1], [2], [],
                                "K3Model")   # PyTorch ops: no interpreter to speak of
    assert standard["timed"] == "under the profiler (torch); on a CPU: not a speed figure"
    assert "profiled_step_latency_s" in metrics and "profiled_step_latency_s" not in before
    assert metrics["speculative"] == before["speculative"]
    assert metrics["fallbacks"] == before["fallbacks"] == ["prefill: a prompt of 3 tokens"]


def test_trace_runs_the_specialized_path_s_opt_ins(tmp_path):
    """`kimi-perf trace --l2-prefetch --group-experts-from N --pdl`: the specialized path
    with all three, its launches counted as run, the options in run.json's command and
    request; with --from they are refused (nothing is captured)."""
    import json

    from click.testing import CliRunner

    from kimi_perf.cli import main

    args = ["trace", "--layers", "4", "--steps", "1", "--warmup", "0", "--context", "3",
            "--batch", "2", "--paths", "specialized", "--format", "json", "--out",
            str(tmp_path), "--l2-prefetch", "--group-experts-from", "2", "--pdl", "--seed", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    kernels = {t["type"]: t["kernels"] for t in doc["paths"]["specialized"]["layer_types"]}
    assert kernels == {"dense": 8, "kda": 11, "mla": 14}   # 7, 9, 12 + prefetch + routing
    run = doc["run"]
    assert run["command"].endswith("--l2-prefetch --group-experts-from 2 --pdl")
    assert run["request"]["l2_prefetch"] and run["request"]["group_experts_from"] == 2
    assert run["request"]["pdl"] and run["request"]["seed"] == 3 and "--seed 3 " in run["command"]
    refused = CliRunner().invoke(main, ["trace", "--from", str(tmp_path), "--l2-prefetch"])
    assert refused.exit_code == 2 and "--l2-prefetch sets up a capture" in refused.output
    alone = CliRunner().invoke(main, ["trace", "--paths", "standard", "--group-experts-from",
                                      "4"])   # would be recorded, and change nothing
    assert alone.exit_code == 2 and alone.output.count("\n") == 1
    assert "--group-experts-from: options of the specialized path, which --paths standard " \
           "leaves out" in alone.output


def test_trace_command_prints_the_table_metrics_and_where_the_run_is(tmp_path):
    """The terminal end of the main job: the side-by-side table, each path's decode metrics,
    what a CPU run's ops are (and whose time to first token is the process's first forward pass),
    and the run directory and report it wrote."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    result = CliRunner().invoke(main, ["trace", "--layers", "4", "--steps", "1", "--warmup",
                                       "0", "--context", "3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "kda: 18 ops / " in text and "vs 9 / " in text and "(specialized)" in text
    assert ("Run on a CPU, with no GPU kernels: 'ops' are the launches each path annotates "
            "(one per kernel it would run on a GPU), timed on the CPU; the first path's time "
            "to first token (standard) is the process's first forward pass, first-call costs "
            "and all, so compare it across runs of one path.") in text
    assert "standard: " in text and " decode tokens/s (the profiled steps' tokens" in text
    (run_dir,) = tmp_path.iterdir()
    assert f"run directory: {run_dir}" in text
    assert f"report: {run_dir.resolve() / 'report.html'}" in text


def test_trace_fails_a_path_whose_logits_are_not_finite(tmp_path, monkeypatch):
    """A path computing NaN still gets its figures written (evidence), but the run says so,
    in the terminal, run.json and the report, and exits 1: argmax makes a token of NaN too,
    so tokens/s alone would not show it. Here the specialized path's runs are made to."""
    import json

    from click.testing import CliRunner

    import kimi_perf.decode.harness as harness
    from kimi_perf.cli import main

    real = harness.run_decode

    def run_decode(model, *args, **kwargs):
        run = real(model, *args, **kwargs)
        if type(model).__name__ == "SpecializedModel":
            run.logits_finite = False
        return run

    monkeypatch.setattr(harness, "run_decode", run_decode)
    result = CliRunner().invoke(main, ["trace", "--layers", "2", "--steps", "1", "--warmup",
                                       "0", "--context", "3", "--out", str(tmp_path)])
    assert result.exit_code == 1
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    assert result.output.splitlines()[-1] == (
        f"kimi-perf: {run_dir}: the last decode step's logits of specialized are not all "
        "finite (NaN or infinity): its figures measure a path that computes no usable output")
    run = json.loads((run_dir / "run.json").read_text())
    assert {p: m["logits_finite"] for p, m in run["paths"].items()} == {
        "standard": True, "specialized": False}
    assert "logits of specialized are not all finite" in (run_dir / "report.html").read_text()


def test_each_path_is_built_with_its_own_options():
    """build_model's options for a path: the experts' storage for both, and the specialized
    path's three opt-ins, each as requested, for it alone."""
    from kimi_perf.capture import TraceRequest, path_options

    req = TraceRequest("tiny", None, batch=2, context=8, steps=3, warmup=1, experts="mxfp4",
                       l2_prefetch=False, group_experts_from=16, pdl=True)
    assert path_options(req, "standard") == {"experts": "mxfp4"}
    assert path_options(req, "specialized") == {"experts": "mxfp4", "l2_prefetch": False,
                                                "group_experts_from": 16, "pdl": True}


def test_nsys_profiles_each_path_with_its_request(tmp_path, monkeypatch):
    """The nsys command for a path: CUDA traced beside NVTX on a GPU alone, graphs traced
    node by node when the run uses them, and the worker given the request's every size, the
    path's own options, its metrics file and this process to outlive."""
    import json

    from kimi_perf.capture import TraceRequest, nsys_profile_command

    nsys = shutil.which("true")
    monkeypatch.setenv("KIMI_PERF_NSYS", nsys)
    req = TraceRequest("k3-tp8", 4, batch=3, context=64, steps=5, warmup=2, graphs=True,
                       backend="nsys", kv_cache="fp8", spec_tokens=2, seed=7, pdl=True)
    command = nsys_profile_command(req, "specialized", "cuda", tmp_path)
    assert command[:9] == [nsys, "profile", "--trace=nvtx,cuda", "--sample=none",
                           "--cpuctxsw=none", "--force-overwrite=true", "-o",
                           str(tmp_path / "specialized"), "--cuda-graph-trace=node"]
    assert command[9:12] == [sys.executable, "-m", "kimi_perf.decode.worker"]
    assert json.loads(command[12]) == {
        "preset": "k3-tp8", "n_layers": 4, "seed": 7, "batch": 3, "context": 64, "steps": 5,
        "warmup": 2, "kv_cache": "fp8", "graphs": True, "spec_tokens": 2,
        "options": {"experts": "bf16", "l2_prefetch": False, "group_experts_from": None,
                    "pdl": True}}
    assert command[13:] == ["specialized", str(tmp_path / ".specialized.metrics.json"),
                            str(os.getpid())]
    eager = nsys_profile_command(dataclasses.replace(req, graphs=False), "standard", "cpu",
                                 tmp_path)
    assert eager[2] == "--trace=nvtx" and "--cuda-graph-trace=node" not in eager
    assert json.loads(eager[-4])["options"] == {"experts": "bf16"}


def test_an_nvtx_release_that_nsys_did_not_hear_is_named():
    """Why nsys heard no NVTX range, by the nvtx release the worker names: from 0.2.12 the
    package switches itself off under nsys; another than 0.2.11 is untested; 0.2.11, or
    torch's binding (a GPU's), has nothing to add."""
    from kimi_perf.capture import _nvtx_hint

    assert _nvtx_hint("0.2.13") == (
        " (nvtx 0.2.13 is installed: from 0.2.12 the nvtx package switches itself off under "
        "nsys 2023.4, docs/nsys-on-a-cpu.md; pip install nvtx==0.2.11)")
    assert _nvtx_hint("0.2.10") == " (nvtx 0.2.10 is installed; kimi-perf is tested with 0.2.11)"
    assert _nvtx_hint("0.2.11") == _nvtx_hint("torch.cuda.nvtx") == ""


def test_a_capture_reports_each_unit_of_its_work(tmp_path):
    """capture's progress: a path's prefill and each warm-up and decode step one unit,
    work_units in all, each said with what the path runs (a verify step with speculative
    decoding)."""
    from kimi_perf.capture import TraceRequest, capture, step_kind, work_units

    req = TraceRequest("tiny", 2, batch=2, context=3, steps=2, warmup=1, paths=("standard",),
                       out_dir=tmp_path)
    said = []
    capture(req, lambda description, units: said.append((description, units)))
    assert sum(units for _, units in said) == work_units(req) == 1 + 1 + 2
    assert {d for d, _ in said} == {"standard: prefill, 1 warm-up and 2 decode steps"}
    assert work_units(dataclasses.replace(req, paths=("standard", "specialized"))) == 8
    assert step_kind(dataclasses.replace(req, spec_tokens=3)) == "verify (1+3 tokens)"


def test_a_run_records_the_threads_each_rank_ran_with(monkeypatch):
    """run.json's environment on a CPU: the threads torch ran with in each profiled process,
    an equal share of this process's for each TP rank, and no GPU, CUDA or driver."""
    from kimi_perf.capture import environment

    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    env = environment("cpu", 4)
    assert env["cpu_threads"] == 2 and environment("cpu")["cpu_threads"] == 8
    assert (env["device"], env["gpus"], env["cuda"], env["driver"]) == ("cpu", [], None, None)


# Two layers (KDA with the dense MLP, then gated MLA with the MoE): every kind of launch, at
# half the interpreter time of SMALL's four.
TWO = preset("tiny", n_layers=2)


@pytest.fixture(scope="module")
def two_weights():
    return random_weights(TWO, seed=7)


def test_the_kernels_take_steps_up_to_their_limits_and_no_further(weights):
    """The limits are inclusive: a decode step of batch 64 and a verify step of 8 tokens a
    sequence are the kernels' (64 and 8 are what the kernels are built for; one less would
    send those steps to the PyTorch ops unsaid); a step of 2 tokens that is no verify step is
    a prompt, said by its length; the batch is said before the tokens."""
    fast = SpecializedModel(SMALL, weights, dtype=torch.float32)

    def ids(b: int, t: int) -> torch.Tensor:
        return torch.zeros(b, t, dtype=torch.long)

    assert fast.unsupported(ids(64, 1), False) is None
    assert fast.unsupported(ids(64, 8), True) is None
    assert fast.unsupported(ids(1, 2), True) is None
    assert fast.unsupported(ids(1, 2), False) == "a prompt of 2 tokens"
    assert fast.unsupported(ids(65, 1), True) == "batch 65 > 64"
    assert fast.unsupported(ids(65, 9), True) == "batch 65 > 64"
    assert fast.unsupported(ids(64, 9), True) == "verify of 9 tokens > 8"


def test_a_fallback_is_named_by_its_call_s_number_counting_the_kernels_steps(two_weights):
    """Without the harness's range names, a fallback says which call of the model it was:
    calls are counted whichever path took them (call 1, a decode step, ran the kernels), so
    the second prompt is call 2, not another call 0 or 1."""
    fast = SpecializedModel(TWO, two_weights, dtype=torch.float32)
    state = fast.new_state(1, 8)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    fast.forward(tokens[:, :2], state)
    fast.forward(tokens[:, 2:3], state)
    fast.forward(tokens[:, 3:5], state)
    assert fast.fallbacks == ["call 0: a prompt of 2 tokens", "call 2: a prompt of 2 tokens"]
    assert fast.calls == 3 and state.lengths.tolist() == [5]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_verify_step_past_what_its_state_was_made_for_is_refused(two_weights, path):
    """A verify step within the kernels' 8 tokens but longer than the state's ``max_verify``
    is refused by the kernel path as by the standard one, before any work: the state records
    only ``max_verify`` positions a layer, and the rollback would read past them."""
    model = make_path(path, TWO, two_weights, torch.float32)
    state = model.new_state(1, 12, max_verify=2)
    model.forward(torch.tensor([[1, 2]]), state)
    with pytest.raises(ValueError, match=r"a verify step of 3 tokens .* takes 2$"):
        model.forward(torch.tensor([[3, 4, 5]]), state, verify=True)
    assert state.lengths.tolist() == [2] and model.fallbacks == ["call 0: a prompt of 2 tokens"]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_the_mla_splits_are_asked_for_the_step_s_sequences_and_tokens(two_weights, path,
                                                                        monkeypatch):
    """With no ``attention_splits`` set, the split count comes from ``mla_splits`` (a GPU's
    SMs against the programs: one per sequence per block of its tokens' heads), asked for
    the step's batch and tokens a sequence (not its B·T rows) and the cache's capacity; a
    CPU's answer is 1 whatever it is asked, so only the asking shows it."""
    import kimi_perf.decode.kernel_path as kernel_path

    asked = []
    monkeypatch.setattr(kernel_path, "mla_splits", lambda *args: asked.append(args) or 1)
    model = make_path(path, TWO, two_weights, torch.float32)
    state = model.new_state(2, 10, max_verify=3)
    model.forward(torch.tensor([[1, 2], [3, 4]]), state)
    model.forward(torch.tensor([[5, 6, 7], [8, 9, 10]]), state, verify=True)
    assert asked == [(2, 3, TWO.mla_heads_local, 10, model.device)]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_mla_splits_that_each_hold_positions_merge_to_the_standard_output(two_weights, path):
    """The split attention's merge itself: past 64 positions (the interpreter's block of
    positions: each split takes whole blocks) both of 2 splits hold some, so the partials must
    be merged by their log-sum-exps; at the other tests' lengths every position falls in split
    0 and the others are empty, which a path that read split 0 alone would pass."""
    std = K3Model(TWO, two_weights, dtype=torch.float32)
    fast = make_path(path, TWO, two_weights, torch.float32)
    fast.attention_splits = 2
    tokens = torch.randint(0, TWO.vocab, (1, 101), generator=torch.Generator().manual_seed(3))
    states = [m.new_state(1, 101) for m in (std, fast)]
    for m, st in zip((std, fast), states, strict=True):
        m.forward(tokens[:, :100], st, last_logits=True)
    want, got = (m.forward(tokens[:, 100:], st) for m, st in zip((std, fast), states,
                                                                 strict=True))
    assert rel_err(got, want.double()) < 1e-4
    assert fast.fallbacks == ["call 0: a prompt of 100 tokens"]


def test_pdl_and_its_prefetch_bytes_reach_every_kernel_step(two_weights, monkeypatch):
    """``SpecializedModel(pdl=True, pdl_prefetch_bytes=n)``: each step the kernels take runs
    inside ``programmatic_launch(True, n)`` (what flags every launch and has the skinny
    linears read n bytes of their weights into L2 first; the interpreter reads none, so only
    the call shows it); a step that falls back, none."""
    import kimi_perf.decode.kernel_path as kernel_path

    entered = []
    real = kernel_path.programmatic_launch
    monkeypatch.setattr(kernel_path, "programmatic_launch",
                        lambda *args: entered.append(args) or real(*args))
    fast = SpecializedModel(TWO, two_weights, dtype=torch.float32, pdl=True,
                            pdl_prefetch_bytes=4096)
    state = fast.new_state(1, 8)
    fast.forward(torch.tensor([[1, 2]]), state)
    assert entered == []
    fast.forward(torch.tensor([[3]]), state)
    assert entered == [(True, 4096)]


def test_experts_grouped_from_1_on_are_the_specialized_path_s_alone(weights):
    """``group_experts_from`` is refused by the standard path whatever count it names, 0
    included (a count the specialized path refuses too, but here the option itself is the
    error: it is not the standard path's); the specialized path takes 1, the smallest count
    (every step grouped), as it is given."""
    for given in (0, 1):
        with pytest.raises(ValueError, match=r"^group_experts_from: the latency-specialized "):
            build_model(SMALL, weights, group_experts_from=given)
    assert build_model(SMALL, weights, "latency_specialized",
                       group_experts_from=1).group_experts_from == 1


def test_each_kernel_path_launches_its_steps_in_order(two_weights):
    """A decode step's launches under TP (an identity all-reduce), in order and by name, per
    layer and after the last: the specialized path's as its plan lists them (S1-S12, M2-M7),
    the one-kernel-per-step standard path's as the standard path's ops annotate them (the
    same names: the CPU table and the GPU's rows line up by them)."""
    expected = {
        0: ["attn_res_pre", "in_proj", "fused_kda_decode", "o_proj", "all_reduce",
            "attn_res_post", "dense_gate_up_situ", "dense_down", "all_reduce"],
        1: ["attn_res_pre", "qkv_a_g_proj", "q_b_proj", "bmm_w_uk_cache_insert", "mla_decode",
            "bmm_w_uv_gate", "o_proj", "all_reduce", "attn_res_post", "router_latent_down",
            "moe_fc1_situ_shared_gate_up", "moe_fc2_combine_shared_down", "moe_all_reduce",
            "latent_up_proj"],
        2: ["attn_res_final", "lm_head"]}
    launched = {}
    for path in ("standard", "standard_kernels", "specialized"):
        model = make_path(path, TWO, two_weights, torch.float32)
        model.all_reduce = lambda x: x
        state = model.new_state(1, 4)
        model.forward(torch.tensor([[1, 2]]), state)
        model.launches = []
        model.forward(torch.tensor([[3]]), state)
        launched[path] = {i: [n for at, n in model.launches if at == i] for i in range(3)}
    assert launched["specialized"] == expected
    assert launched["standard_kernels"] == launched["standard"]
    assert launched["standard"][1][-6:] == ["shared_down", "latent_all_reduce", "latent_rmsnorm",
                                            "latent_up_proj", "shared_all_reduce", "moe_add"]
    assert launched["standard"][2] == ["attn_res_final", "final_norm", "lm_head"]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_only_the_standard_kernels_hand_the_kda_kernel_their_f_b_projection(two_weights, path,
                                                                          monkeypatch):
    """The one-kernel-per-step standard path runs f_b_proj as a GEMM of its own (vLLM's) and
    hands its output to the KDA kernel; the specialized path lets the kernel project f itself
    (its S3 fusion). Either way the result is the same, so only the call shows a standard
    path that computed f twice and measured the fusion as its own."""
    import kimi_perf.decode.kernel_path as kernel_path

    given = []
    real = kernel_path.kda_decode
    monkeypatch.setattr(kernel_path, "kda_decode", lambda *args, f=None, **kwargs: (
        given.append(None if f is None else tuple(f.shape)) or real(*args, f=f, **kwargs)))
    model = make_path(path, TWO, two_weights, torch.float32)
    state = model.new_state(2, 4)
    model.forward(torch.tensor([[1, 2], [3, 4]]), state)
    model.forward(torch.tensor([[5], [6]]), state)
    proj = TWO.kda_heads_local * TWO.kda_head_dim
    assert given == [(2, 1, proj) if path == "standard_kernels" else None]


def test_the_l2_prefetch_forks_before_the_attention_and_joins_after_o_proj(two_weights,
                                                                          monkeypatch):
    """On a GPU the prefetch of o_proj's weights runs on a second stream: forked from the
    path's stream after the launch before the attention (in_proj, M4), joined after o_proj,
    so that neither the attention nor o_proj waits for it. Streams stand in for a GPU's
    here; each fork and join is noted among the launches, and so is each plain projection's
    run ("ran": the join must come after o_proj's kernel, not only its annotation)."""
    fast = SpecializedModel(TWO, two_weights, dtype=torch.float32, l2_prefetch=True)
    plain_linear = fast.plain_linear
    fast.plain_linear = lambda x, w: (plain_linear(x, w), fast.launches.append(
        (fast.layer, "ran")))[0]

    class Stream:
        def wait_stream(self, other):
            fast.launches.append((fast.layer, "join" if self is main else "fork"))

    main = Stream()
    fast.side_stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    state = fast.new_state(1, 4)
    fast.forward(torch.tensor([[1, 2]]), state)
    fast.launches = []
    fast.forward(torch.tensor([[3]]), state)
    layers = [[n for at, n in fast.launches if at == i] for i in range(2)]
    assert layers[0][:10] == ["attn_res_pre", "in_proj", "ran", "l2_prefetch", "fork",
                              "fused_kda_decode", "o_proj", "ran", "join", "attn_res_post"]
    assert layers[1][:13] == ["attn_res_pre", "qkv_a_g_proj", "ran", "q_b_proj",
                              "bmm_w_uk_cache_insert", "l2_prefetch", "fork", "mla_decode",
                              "bmm_w_uv_gate", "o_proj", "ran", "join", "attn_res_post"]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_an_fp8_cache_s_q_scale_is_taken_where_q_hat_is_made_and_read(two_weights, path):
    """An fp8 latent cache whose q̂ has a scale of its own (``q_scale``, a checkpoint's; 1 in
    the other tests, where leaving it out anywhere changes nothing): the kernel that writes q̂
    stores its values / q_scale and the attention multiplies them back, as the standard path's
    ops do, so the logits match the standard path's on the same fp8 state."""
    std = K3Model(TWO, two_weights, dtype=torch.float32)
    fast = make_path(path, TWO, two_weights, torch.float32)
    states = [m.new_state(2, 4, kv_dtype=torch.float8_e4m3fn, kv_scale=0.5, q_scale=4.0)
              for m in (std, fast)]
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for m, st in zip((std, fast), states, strict=True):
        m.forward(tokens[:, :2], st)
    want, got = (m.forward(tokens[:, 2:], st) for m, st in zip((std, fast), states,
                                                               strict=True))
    assert rel_err(got, want.double()) < 1e-3


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_bf16_model_s_kernel_steps_give_float32_logits(two_weights, path):
    """The LM head writes fp32 logits whatever the model's dtype, as the standard path's
    ops do (bf16 logits keep 8 bits of a logit: the sampling and the checks against the
    reference would read rounded values); the prefill, which falls back, alike."""
    model = make_path(path, TWO, two_weights, torch.bfloat16)
    state = model.new_state(1, 4)
    prefill = model.forward(torch.tensor([[1, 2]]), state)
    step = model.forward(torch.tensor([[3]]), state)
    assert (prefill.dtype, step.dtype, step.shape) == (torch.float32, torch.float32,
                                                       (1, 1, TWO.vocab))
