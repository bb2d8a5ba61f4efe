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
