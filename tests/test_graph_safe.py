"""Both decode paths can be captured as a CUDA graph: a graph-safe step never waits on the
device and updates the decode state in place. The capture itself needs a GPU
(``benchmarks/gpu_decode_check.py`` replays it there); these are its preconditions, on a CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

# fresh buffers start poisoned: a path that reads one before writing it cannot pass on the
# zeros fresh memory often holds (tests/poisoning.py)
pytestmark = pytest.mark.usefixtures("poisoned_empty")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kimi_perf.capture import profiler_schedule  # noqa: E402
from kimi_perf.decode.config import preset  # noqa: E402
from kimi_perf.decode.harness import run_decode, state_tensors  # noqa: E402
from kimi_perf.decode.model import _expert_matmul, _gathered_expert_matmul  # noqa: E402
from kimi_perf.decode.specialized import build_model  # noqa: E402
from kimi_perf.decode.validate import make_path, rel_err  # noqa: E402
from kimi_perf.decode.weights import random_weights  # noqa: E402
from kimi_perf.readers import read_trace  # noqa: E402

SMALL = preset("tiny", n_layers=4)
# standard_kernels: the standard path as a GPU runs it, one kernel per step; and the
# specialized path's opt-ins, L2 prefetch and the experts grouped by expert
PATHS = ["standard", "standard_kernels", "specialized", "specialized+l2",
         "specialized+grouped"]

# Ops whose result the host must read (a device-to-host wait): .item(), int(t), bool(t),
# data-dependent shapes.
HOST_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
              torch.ops.aten.masked_select.default}


class HostSyncGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNCS:
            raise AssertionError(f"host sync in a graph-safe step: {func}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def weights():
    return random_weights(SMALL, seed=11)


def _prefilled(path: str, weights, batch: int = 2):
    base, _, option = path.partition("+")
    model = make_path(base, SMALL, weights, torch.float32)
    model.l2_prefetch = option == "l2"
    model.group_experts_from = 1 if option == "grouped" else None
    state = model.new_state(batch, 12, max_verify=4)
    prompt = torch.randint(0, SMALL.vocab, (batch, 3), generator=torch.Generator().manual_seed(4))
    model.forward(prompt, state)
    return model, state


@pytest.mark.parametrize("path", PATHS)
def test_graph_safe_steps_do_not_sync_and_update_state_in_place(path, weights):
    model, state = _prefilled(path, weights)
    eager, eager_state = _prefilled(path, weights)
    addresses = [t.data_ptr() for t in state_tensors(state)]
    tokens = torch.tensor([[7], [9]])
    model.graph_safe = True
    for _ in range(3):
        with HostSyncGuard():
            got = model.forward(tokens, state)
        want = eager.forward(tokens, eager_state)
        assert rel_err(got, want.double()) < 1e-5
        tokens = want[:, -1].argmax(-1, keepdim=True)
    assert [t.data_ptr() for t in state_tensors(state)] == addresses
    for mine, theirs in zip(state_tensors(state), state_tensors(eager_state), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    # The guard can fail: an eager step reads the cache length on the host.
    model.graph_safe = False
    with pytest.raises(AssertionError, match="host sync"), HostSyncGuard():
        model.forward(tokens, state)


@pytest.mark.parametrize("path", PATHS)
def test_graph_safe_verify_step_and_rollback(path, weights):
    """A speculative verify step (what a graphed speculative run_decode replays), then the eager
    acceptance: no host sync in the step, the state where it was, as eager leaves it."""
    model, state = _prefilled(path, weights, batch=3)
    eager, eager_state = _prefilled(path, weights, batch=3)
    addresses = [t.data_ptr() for t in state_tensors(state)]
    draft = torch.randint(0, SMALL.vocab, (3, 4), generator=torch.Generator().manual_seed(8))
    accepted = torch.tensor([1, 3, 4])
    model.graph_safe = True
    with HostSyncGuard():
        got = model.forward(draft, state, verify=True)
    state.accept(accepted)
    want = eager.forward(draft, eager_state, verify=True)
    eager_state.accept(accepted)
    assert rel_err(got, want.double()) < 1e-5
    assert [t.data_ptr() for t in state_tensors(state)] == addresses
    for mine, theirs in zip(state_tensors(state), state_tensors(eager_state), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert state.lengths.tolist() == [4, 6, 7]


def test_standard_step_is_free_of_data_dependent_ops():
    """Under FakeTensorMode nothing has values: any op that needs one (a host sync, a
    data-dependent shape) raises. bf16, the dtype the GPU's grouped GEMM runs in."""
    model = build_model(SMALL, random_weights(SMALL, seed=2), "auto", dtype=torch.bfloat16)
    state = model.new_state(2, 12)
    tokens = torch.tensor([[3], [5]])
    model.graph_safe = True
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = model.forward(tokens, state)
    assert tuple(logits.shape) == (2, 1, SMALL.vocab)
    model.graph_safe = False
    with pytest.raises(Exception, match="local_scalar_dense"), \
            FakeTensorMode(allow_non_fake_inputs=True):
        model.forward(tokens, state)


def test_cuda_graphs_refuse_a_cpu_model(weights):
    model = build_model(SMALL, weights, "auto", dtype=torch.float32)
    prompt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="CUDA device"):
        run_decode(model, prompt, steps=1, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA device"):
        run_decode(model, prompt, steps=1, spec_tokens=3, cuda_graphs=True)


def test_a_replay_that_would_pass_the_cache_is_refused_on_the_host():
    """The graph cannot read the lengths: the replayer counts its own replays (a verify
    step's full width each) from the length at capture, and refuses the one that would write
    past the cache, before it replays (here without a GPU: the replay itself is not reached)."""
    from kimi_perf.decode.harness import GraphedDecodeStep

    step = GraphedDecodeStep.__new__(GraphedDecodeStep)   # (its capture needs a GPU)
    step.capacity, step.furthest, step.tokens_per_step = 12, 4, 4
    replayed = []
    step.tokens = torch.zeros(1, 4, dtype=torch.long)
    step.graph = type("Graph", (), {"replay": lambda self: replayed.append(1)})()
    step.state, step.verify_tokens, step.logits = type("State", (), {})(), 4, "logits"
    assert step(torch.ones(1, 4, dtype=torch.long)) == "logits"    # 4 + 4 <= 12
    assert step(torch.ones(1, 4, dtype=torch.long)) == "logits"    # 8 + 4 <= 12
    with pytest.raises(ValueError, match="KV cache holds 12 tokens; this replay needs up to 16"):
        step(torch.ones(1, 4, dtype=torch.long))
    assert len(replayed) == 2


def test_both_expert_matmuls_agree():
    """The grouped GEMM (bf16 on a GPU, any dtype here) and the per-row gather that CUDA
    graphs of other dtypes use on a GPU compute the same products."""
    gen = torch.Generator().manual_seed(3)
    experts = torch.sort(torch.randint(0, 5, (11,), generator=gen)).values
    group_ends = torch.bincount(experts, minlength=5).cumsum(0).to(torch.int32)
    x, w = torch.randn(11, 16, generator=gen), torch.randn(5, 24, 16, generator=gen)
    want = torch.stack([w[e] @ row for e, row in zip(experts.tolist(), x, strict=True)])
    torch.testing.assert_close(_expert_matmul(x, w, group_ends, experts), want)
    torch.testing.assert_close(_gathered_expert_matmul(x, w, experts), want)


def test_a_graphed_profile_holds_the_capture(weights, monkeypatch, tmp_path):
    """The replayed kernels find their layers through the capture's launches, so the profile
    of a graphed run must hold the capture: run_decode captures after the prefill's profiler
    step and profiler_schedule records from there. A CPU stand-in for the graph opens the
    ranges a capture does."""
    from kimi_perf.decode import harness
    from kimi_perf.decode.annotate import annotate

    class EagerStandIn:
        def __init__(self, model, state, batch, layer_hook=None, tokens_per_step=1):
            self.model, self.state = model, state
            with annotate("graph_capture"):
                for i in range(model.c.n_layers):
                    with layer_hook(i):
                        pass

        def __call__(self, tokens):
            return self.model.forward(tokens, self.state)

    monkeypatch.setattr(harness, "GraphedDecodeStep", EagerStandIn)
    model = build_model(SMALL, weights, "auto", dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=profiler_schedule(1, 2, graphs=True)) as prof:
        run_decode(model, torch.zeros(1, 3, dtype=torch.long), steps=2, warmup=1,
                   cuda_graphs=True, after_step=prof.step)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    trace = read_trace(tmp_path / "t.json")
    names = [trace.strings[c] for c in trace.ranges.name]
    assert names.count("graph_capture") == 1
    assert names.count("layer[0](dense)") == 1 and "decode_step[1]" in names
    assert "prefill" not in names



def test_replays_tell_the_state_that_a_verify_step_awaits_accept():
    """A replayed verify step runs no Python of the model's: the replayer itself sets the
    state's verify and pending token counts to the captured step's (1+k), which ``accept``
    then checks the counts against and folds."""
    from kimi_perf.decode.harness import GraphedDecodeStep

    step = GraphedDecodeStep.__new__(GraphedDecodeStep)   # (its capture needs a GPU)
    step.capacity, step.furthest, step.tokens_per_step = None, 3, 4
    step.tokens = torch.zeros(2, 4, dtype=torch.long)
    step.graph = type("Graph", (), {"replay": lambda self: None})()
    step.state = type("State", (), {"verify_tokens": 0, "pending_tokens": 0})()
    step.verify_tokens, step.logits = 4, "logits"
    assert step(torch.ones(2, 4, dtype=torch.long)) == "logits"
    assert (step.state.verify_tokens, step.state.pending_tokens) == (4, 4)
    assert torch.equal(step.tokens, torch.ones(2, 4, dtype=torch.long)) and step.furthest == 7


def test_a_graphed_run_s_cache_holds_the_eager_warm_up_runs():
    """With CUDA graphs the cache holds GRAPH_WARMUP_RUNS steps more, each 1+k tokens a
    sequence: the eager warm-up runs before the capture write it (and the capture's memory
    check sizes it so)."""
    from kimi_perf.decode.harness import GRAPH_WARMUP_RUNS, cache_tokens

    assert GRAPH_WARMUP_RUNS == 2
    assert cache_tokens(10, 3, 0, False) == 13 and cache_tokens(10, 3, 0, True) == 15
    assert cache_tokens(10, 3, 2, False) == 19 and cache_tokens(10, 3, 2, True) == 25



def test_state_tensors_are_every_tensor_of_the_state(weights):
    """``state_tensors`` lists every tensor a step updates in place, once each (a graphed
    step's warm-up runs are undone through it before the capture, and the graph-safe checks
    compare states through it): each tensor of the state, the lengths, and a verify step's
    pending counts and the half of its records too."""
    import dataclasses

    _, state = _prefilled("standard", weights)
    listed = state_tensors(state)
    held = [t for f in dataclasses.fields(state) for v in [getattr(state, f.name)]
            for t in (v.values() if isinstance(v, dict) else [v]) if isinstance(t, torch.Tensor)]
    # (3 KDA layers' states, conv windows, records and inputs; a gated-MLA layer's cache;
    # the lengths; the pending counts and the half)
    assert len({id(t) for t in listed}) == len(listed) == len(held) == 4 * 3 + 1 + 1 + 2
    assert {id(t) for t in listed} == {id(t) for t in held}


def test_a_graphed_run_keeps_a_copy_of_its_first_logits(weights, monkeypatch):
    """A graph's logits are one output buffer that each replay writes again: the first
    step's logits a run keeps are a copy, those of the first step, not the last step's. A CPU
    stand-in for the graph returns one buffer, as a replay does."""
    from kimi_perf.decode import harness

    class OneOutputBuffer:
        def __init__(self, model, state, batch, layer_hook=None, tokens_per_step=1):
            self.model, self.state, self.logits = model, state, None

        def __call__(self, tokens):
            logits = self.model.forward(tokens, self.state)
            if self.logits is None:
                self.logits = logits
            else:
                self.logits.copy_(logits)
            return self.logits

    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    eager = run_decode(make_path("standard", SMALL, weights, torch.float32), prompt, steps=2,
                       keep_first_logits=True)
    monkeypatch.setattr(harness, "GraphedDecodeStep", OneOutputBuffer)
    graphed = run_decode(make_path("standard", SMALL, weights, torch.float32), prompt,
                         steps=2, keep_first_logits=True, cuda_graphs=True)
    assert torch.equal(graphed.tokens, eager.tokens)
    assert torch.equal(graphed.first_logits, eager.first_logits)
