"""Kernels replayed from a CUDA/HIP graph, mapped back to the launches that captured them."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from kimi_perf.graphs import capture_launches
from kimi_perf.layers import segment
from kimi_perf.readers import read_trace
from tests.conftest import FIXTURES
from tests.synth import TraceBuilder

KINETO = FIXTURES / "kineto"
CAPTURE = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_capture_bs32_mi300x.json.gz"
REPLAY = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"


@pytest.fixture(scope="module")
def vllm_capture_then_replay(tmp_path_factory):
    """vLLM's capture of its batch-32 decode graph and a replay of it: one process, one clock,
    two files. Joined into one trace, as a profile spanning both would be."""
    capture, replay = (json.loads(gzip.decompress(p.read_bytes())) for p in (CAPTURE, REPLAY))
    replay["traceEvents"] = capture["traceEvents"] + replay["traceEvents"]
    path = tmp_path_factory.mktemp("graphs") / "capture_and_replay.json.gz"
    path.write_bytes(gzip.compress(json.dumps(replay).encode(), 1))
    names = {e["args"]["correlation"]: e["args"]["kernel"] for e in capture["traceEvents"]
             if e.get("cat") == "cuda_runtime" and "kernel" in e.get("args", {})}
    return read_trace(path), names


def test_every_replayed_kernel_maps_to_the_launch_that_captured_it(vllm_capture_then_replay):
    trace, launch_kernel = vllm_capture_then_replay
    captured = capture_launches(trace)
    replayed = np.flatnonzero(captured >= 0)
    assert len(replayed) == 421  # the whole graph; the 11 eager kernels map to nothing
    # ROCm's launch records name the kernel they launch: each mapping names the same one.
    for k in replayed.tolist():
        corr = int(trace.api.correlation[captured[k]])
        assert launch_kernel[corr] == trace.strings[trace.kernels.name[k]]


def test_replayed_kernels_land_in_the_capture_ranges(vllm_capture_then_replay):
    """vLLM's piecewise regions (``## Call CompiledFxGraph <hash> ##``, one per span between
    attention ops: 25 around GPT-OSS's 24 attention layers) exist only at capture; through the
    mapping the replay fills them, and the 23 regions of the repeated middle piece get the
    same kernels."""
    trace, _ = vllm_capture_then_replay
    ops, steps = segment(trace, layers=r"nvtx:^## Call CompiledFxGraph (?P<type>\w+) ##$")
    (step,) = [s for s in steps if s.layers]
    assert len(step.layers) == 25
    middle = [layer for layer in step.layers if layer.type.startswith("f4ii")]
    assert len(middle) == 23
    assert len({tuple(ops.name[layer.ops].tolist()) for layer in middle}) == 1
    assert len(middle[0].ops) > 10


def _captured_decode(replay_order: list[str] | None = None, captured: int = 4) -> TraceBuilder:
    """One capture of two layers (kernels A, B each) inside layer ranges, then two replays
    of the graph inside decode_step ranges."""
    b = TraceBuilder()
    b.range("graph_capture", 0, 1000)
    b.call("cudaStreamBeginCapture", 5, 6)
    b.range("layer[0](x)", 10, 400)
    b.range("layer[1](x)", 500, 900)
    for t in (20, 30, 520, 530)[:captured]:
        b.call("cudaLaunchKernel", t, t + 5)
    b.call("cudaStreamEndCapture", 950, 960)
    order = replay_order or ["A", "B", "A", "B"]
    for step, t0 in enumerate((2000, 3000)):
        b.range(f"decode_step[{step}]", t0, t0 + 900)
        for j, name in enumerate(order):
            start = t0 + 100 + 50 * j
            b.launch(name, t0 + 10, t0 + 20, start, start + 40, correlation=10_000 + step,
                     api_name="cudaGraphLaunch")
    return b


def test_synthetic_capture_gives_replayed_steps_their_layers():
    # Within layer 0 the two kernels ran on parallel branches and started in swapped order.
    trace = _captured_decode(["B", "A", "A", "B"]).build()
    ops, steps = segment(trace)
    assert [s.name for s in steps] == ["decode_step[0]", "decode_step[1]"]
    for step in steps:
        assert step.layer_source == "nvtx"
        assert [(layer.index, layer.type) for layer in step.layers] == [(0, "x"), (1, "x")]
        for layer in step.layers:
            assert sorted(trace.strings[c] for c in ops.name[layer.ops]) == ["A", "B"]


@pytest.mark.parametrize("captured", [3, 0])
def test_no_mapping_when_the_capture_does_not_match(captured):
    """A capture of another size (or none in the trace) maps nothing; the layers then come
    from elsewhere (here: none, two kernels per step are no pattern)."""
    trace = _captured_decode(captured=captured).build()
    assert (capture_launches(trace) == -1).all()
    _, steps = segment(trace)
    assert all(s.layer_source != "nvtx" for s in steps)


def _captured_with_copies(copies_at: tuple[int, ...] = (540,), replayed: int = 1,
                          begin_end: bool = True) -> TraceBuilder:
    """_captured_decode's capture with cudaMemcpyAsync calls (a ``copy_``) captured too, and
    its replays running the copies as memcpy nodes after the kernels of their layer."""
    b = TraceBuilder()
    if begin_end:
        b.call("cudaStreamBeginCapture", 5, 6)
    b.range("layer[0](x)", 10, 400)
    b.range("layer[1](x)", 500, 900)
    for t in (20, 30, 520, 530):
        b.call("cudaLaunchKernel", t, t + 5)
    for t in copies_at:
        b.call("cudaMemcpyAsync", t, t + 5)
    if begin_end:
        b.call("cudaStreamEndCapture", 950, 960)
    for step, t0 in enumerate((2000, 3000)):
        b.range(f"decode_step[{step}]", t0, t0 + 900)
        for j, name in enumerate(["A", "B", "A", "B"]):
            start = t0 + 100 + 50 * j
            b.launch(name, t0 + 10, t0 + 20, start, start + 40, correlation=10_000 + step,
                     api_name="cudaGraphLaunch")
        for j in range(replayed):
            b.memop("[CUDA memcpy Device-to-Device]", t0 + 400 + 50 * j, t0 + 420 + 50 * j,
                    correlation=10_000 + step)
    return b


@pytest.mark.parametrize("copies_at, begin_end", [((540,), True), ((525,), False),
                                                  ((15,), True)])
def test_replayed_copies_land_in_the_layer_that_captured_them(copies_at, begin_end):
    """A memcpy node of a graph maps to the cudaMemcpyAsync that captured it, and so lands in
    the layer open then, with the layer's kernels; a copy before the first kernel launch or
    after the last is found between Begin- and EndCapture; without those calls, only copies
    between the first and last launch are."""
    trace = _captured_with_copies(copies_at, begin_end=begin_end).build()
    ops, steps = segment(trace)
    layer = 0 if copies_at == (15,) else 1
    for step in steps:
        names = [sorted(trace.strings[c] for c in ops.name[x.ops]) for x in step.layers]
        assert names[layer] == ["A", "B", "[CUDA memcpy Device-to-Device]"]
        assert names[1 - layer] == ["A", "B"]


@pytest.mark.parametrize("case", ["count differs", "outside the capture"])
def test_copies_that_do_not_match_the_capture_map_nothing(case):
    """Two memcpy nodes against one captured call, or a copy captured before the first launch
    with no BeginCapture to bound it: the copies stay in their step, in no layer; the kernels
    keep their mapping."""
    b = (_captured_with_copies(replayed=2) if case == "count differs"
         else _captured_with_copies((15,), begin_end=False))
    trace = b.build()
    ops, steps = segment(trace)
    for step in steps:
        assert [sorted(trace.strings[c] for c in ops.name[x.ops]) for x in step.layers] \
            == [["A", "B"], ["A", "B"]]
        copies = [r for r in step.ops.tolist() if trace.strings[ops.name[r]].startswith("[CUDA")]
        assert len(copies) == (2 if case == "count differs" else 1)
