"""Kernels replayed from a CUDA/HIP graph, mapped back to the launches that captured them."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf.errors import TraceError
from kimi_perf.graphs import capture_launches, capture_memory_calls, with_capture
from kimi_perf.readers import read_trace
from tests.conftest import FIXTURES
from tests.synth import TraceBuilder, segment

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


def test_a_capture_saved_apart_joins_its_replay(vllm_capture_then_replay):
    """``read_trace(replay, capture=...)``, on the two files vLLM saved, gives what one
    profile spanning both gives: every kernel in the same piecewise region."""
    whole, _ = vllm_capture_then_replay
    joined = read_trace(REPLAY, capture=CAPTURE)
    assert joined.meta["captures"] == [str(CAPTURE)] and joined.meta["file"] == str(REPLAY)
    assert len(joined.kernels) == len(whole.kernels) and len(joined.api) == len(whole.api)
    assert (capture_launches(joined) >= 0).sum() == 421
    regions = r"nvtx:^## Call CompiledFxGraph (?P<type>\w+) ##$"

    def kernels_per_region(trace):
        ops, steps = segment(trace, layers=regions)
        (step,) = [s for s in steps if s.layers]
        return [(layer.type, sorted(zip(ops.start[layer.ops].tolist(),
                                        (trace.strings[c] for c in ops.name[layer.ops]),
                                        strict=True)))
                for layer in step.layers]

    assert len(kernels_per_region(joined)) == 25
    assert kernels_per_region(joined) == kernels_per_region(whole)


def test_a_joined_trace_keeps_each_names_code_and_row(vllm_capture_then_replay):
    """``Trace.joined``: a name both traces hold has one code; launches and parents point at
    the rows they pointed at before; the tables keep their dtypes."""
    replay, capture = read_trace(REPLAY), read_trace(CAPTURE)
    joined = replay.joined(capture)
    assert len(set(joined.strings)) == len(joined.strings)
    assert joined.reference_problem() is None
    for table_name in ("kernels", "memops", "ranges", "api"):
        first, second, both = (getattr(t, table_name) for t in (replay, capture, joined))
        assert len(both) == len(first) + len(second)
        names = [joined.strings[c] for c in both.name.tolist()]
        assert names == ([replay.strings[c] for c in first.name.tolist()]
                         + [capture.strings[c] for c in second.name.tolist()])
        assert (both.start == np.r_[first.start, second.start]).all()
    for table_name in ("kernels", "memops"):
        first, second, both = (getattr(t, table_name) for t in (replay, capture, joined))
        theirs = both.api[len(first):]
        assert (theirs == np.where(second.api >= 0, second.api + len(replay.api), -1)).all()
        assert (joined.api.correlation[theirs[theirs >= 0]]
                == capture.api.correlation[second.api[second.api >= 0]]).all()
    assert joined.kernels.start.dtype == np.int64 and joined.kernels.name.dtype == np.int32


def _capture_of_two_layers(b: TraceBuilder, captured: int = 4, pid: int = 1) -> None:
    """A capture of two layers (kernels A, B each, launched at capture time into the graph)
    inside layer ranges."""
    b.range("graph_capture", 0, 1000, pid=pid)
    b.call("cudaStreamBeginCapture", 5, 6, pid=pid)
    b.range("layer[0](x)", 10, 400, pid=pid)
    b.range("layer[1](x)", 500, 900, pid=pid)
    for t in (20, 30, 520, 530)[:captured]:
        b.call("cudaLaunchKernel", t, t + 5, pid=pid)
    b.call("cudaStreamEndCapture", 950, 960, pid=pid)


def _replays(b: TraceBuilder, order: list[str], steps: tuple[int, ...] = (2000, 3000)) -> None:
    """Replays of the graph inside decode_step ranges."""
    for step, t0 in enumerate(steps):
        b.range(f"decode_step[{step}]", t0, t0 + 900)
        for j, name in enumerate(order):
            start = t0 + 100 + 50 * j
            b.launch(name, t0 + 10, t0 + 20, start, start + 40, correlation=10_000 + step,
                     api_name="cudaGraphLaunch")


@pytest.mark.parametrize("saved", ["in one trace", "apart"])
def test_synthetic_capture_gives_replayed_steps_their_layers(saved):
    # Within layer 0 the two kernels ran on parallel branches and started in swapped order.
    if saved == "in one trace":
        trace = _captured_decode(["B", "A", "A", "B"]).build()
    else:
        capture, replay = TraceBuilder(), TraceBuilder()
        _capture_of_two_layers(capture)
        _replays(replay, ["B", "A", "A", "B"])
        trace = with_capture(replay.build(), capture.build())
    ops, steps = segment(trace)
    assert [s.name for s in steps] == ["decode_step[0]", "decode_step[1]"]
    for step in steps:
        assert step.layer_source == "nvtx"
        assert [(layer.index, layer.type) for layer in step.layers] == [(0, "x"), (1, "x")]
        for layer in step.layers:
            assert sorted(trace.strings[c] for c in ops.name[layer.ops]) == ["A", "B"]


@pytest.mark.parametrize("case, blamed, problem", [
    ("no replay", "replay", "runs no kernel from a graph launch"),
    ("no capture", "capture", "records no graph capture"),
    ("another size", "capture", "no graph capture in it matches a graph launch of replay"),
    ("another process", "capture", "no graph capture in it matches"),
    ("after the replay", "capture", "no graph capture in it matches"),
    ("the same profile twice", "capture", "holds the same API calls as replay (process 1)"),
    ("swapped", "replay", "runs no kernel from a graph launch but records graph captures"),
])
def test_a_capture_that_cannot_join_is_one_error_naming_its_file(case, blamed, problem):
    capture, replay = TraceBuilder(), TraceBuilder()
    if case == "the same profile twice":
        for b in (capture, replay):
            _capture_of_two_layers(b)
            _replays(b, ["A", "B", "A", "B"])
    else:
        if case != "no capture":
            _capture_of_two_layers(capture, captured=3 if case == "another size" else 4,
                                   pid=2 if case == "another process" else 1)
        if case == "no replay":
            replay.sequence(["A", "B"])
        else:
            _replays(replay, ["A", "B", "A", "B"],
                     steps=(-9000, -8000) if case == "after the replay" else (2000, 3000))
    if case == "swapped":
        capture, replay = replay, capture
    traces = {"replay": replay.build(), "capture": capture.build()}
    for name, trace in traces.items():
        trace.meta["file"] = name
    with pytest.raises(TraceError) as err:
        with_capture(traces["replay"], traces["capture"])
    assert err.value.path == blamed and problem in err.value.problem


@pytest.mark.parametrize("order", ["first graph first", "second graph first"])
def test_captures_of_two_graphs_in_two_files_join_one_after_the_other(order):
    """A decode graph of four kernels and another of two, captured into files of their own:
    joined in either order, every replayed kernel lands in its layer, and the trace names
    both files."""
    first, second, replay = TraceBuilder(), TraceBuilder(), TraceBuilder()
    _capture_of_two_layers(first)
    second.call("cudaStreamBeginCapture", 1005, 1006)
    second.range("layer[0](y)", 1010, 1400)
    for t in (1020, 1030):
        second.call("cudaLaunchKernel", t, t + 5)
    second.call("cudaStreamEndCapture", 1450, 1460)
    _replays(replay, ["A", "B", "A", "B"])
    replay.range("decode_step[2]", 4000, 4900)
    for j, name in enumerate(["C", "D"]):
        replay.launch(name, 4010, 4020, 4100 + 50 * j, 4140 + 50 * j, correlation=10_002,
                      api_name="cudaGraphLaunch")
    captures = {"first": first.build(), "second": second.build()}
    for name, trace in captures.items():
        trace.meta["file"] = name
    names = ["first", "second"] if order == "first graph first" else ["second", "first"]
    trace = replay.build()
    for name in names:
        trace = with_capture(trace, captures[name])
    assert trace.meta["captures"] == names
    ops, steps = segment(trace)
    assert [[(layer.type, sorted(trace.strings[c] for c in ops.name[layer.ops]))
             for layer in step.layers] for step in steps] == \
        [[("x", ["A", "B"]), ("x", ["A", "B"])]] * 2 + [[("y", ["C", "D"])]]


def _captured_decode(replay_order: list[str] | None = None, captured: int = 4) -> TraceBuilder:
    """One capture of two layers, then two replays of the graph, in one trace."""
    b = TraceBuilder()
    _capture_of_two_layers(b, captured)
    _replays(b, replay_order or ["A", "B", "A", "B"])
    return b


@pytest.mark.parametrize("captured", [3, 0])
def test_no_mapping_when_the_capture_does_not_match(captured):
    """A capture of another size (or none in the trace) maps nothing; the layers then come
    from elsewhere (here: the repeating kernel pattern, A B twice a step)."""
    trace = _captured_decode(captured=captured).build()
    assert (capture_launches(trace) == -1).all()
    _, steps = segment(trace)
    assert [s.name for s in steps] == ["decode_step[0]", "decode_step[1]"]
    assert [(s.layer_source, len(s.layers)) for s in steps] == [("repeat", 2)] * 2


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
    assert [s.name for s in steps] == ["decode_step[0]", "decode_step[1]"]
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
    assert [s.name for s in steps] == ["decode_step[0]", "decode_step[1]"]
    for step in steps:
        assert [sorted(trace.strings[c] for c in ops.name[x.ops]) for x in step.layers] \
            == [["A", "B"], ["A", "B"]]
        copies = [r for r in step.ops.tolist() if trace.strings[ops.name[r]].startswith("[CUDA")]
        assert len(copies) == (2 if case == "count differs" else 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 40), st.integers(1, 4)),
                min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(1, 3), st.integers(0, 50), st.integers(1, 4)),
                min_size=1, max_size=12))
def test_each_launch_finds_its_capture_as_one_at_a_time(runs, launches):
    """The captures of every graph launch found at once equal those found a launch at a
    time: the latest capture of its process ended by its start, of as many kernels (the
    first of equals, where captures end together)."""
    from kimi_perf.graphs import _latest_captures

    run_pid, run_end, run_len = (np.array(c, np.int64) for c in zip(*runs, strict=True))
    pid, start, size = (np.array(c, np.int64) for c in zip(*launches, strict=True))
    want = []
    for p, t, n in launches:
        fits = np.flatnonzero((run_pid == p) & (run_end <= t) & (run_len == n))
        want.append(int(fits[np.argmax(run_end[fits])]) if len(fits) else -1)
    assert _latest_captures(run_pid, run_end, run_len, pid, start, size).tolist() == want


def test_the_replay_note_says_what_a_capture_would_change():
    """Replays none of whose captures is in the trace: where they count, and how a capture
    profiled apart joins; some left unplaced by the captures already joined: said of those,
    not advised again."""
    from kimi_perf.layer_breakdown import replay_note

    alone = replay_note({"ops": 10, "placed_at_capture": 0}, [])
    assert alone.startswith("10 GPU ops replayed from CUDA/HIP graphs have no capture in this "
                            "trace to place them") and "--capture joins it" in alone
    joined = replay_note({"ops": 10, "placed_at_capture": 4}, ["cap.json"])
    assert joined == ("4 of 10 GPU ops replayed from CUDA/HIP graphs are placed in the ranges "
                      "open where their capture launched them (joined from cap.json); the "
                      "other 6 have no capture in this trace or the captures joined to place "
                      "them in the ranges open then: they count where their graph launch ran "
                      "(layers found by the kernels' repeating pattern are still found)")


def test_the_replay_note_says_all_are_placed_only_when_every_one_is():
    """Every replayed op placed at its capture: said in one sentence; one op short of all:
    said as the part it is, the one left counting where its graph launch ran."""
    from kimi_perf.layer_breakdown import replay_note

    assert replay_note({"ops": 10, "placed_at_capture": 10}, ["cap.json"]) == (
        "10 GPU ops replayed from CUDA/HIP graphs are placed in the ranges open where their "
        "capture launched them (joined from cap.json)")
    short = replay_note({"ops": 10, "placed_at_capture": 9}, ["cap.json"])
    assert short.startswith("9 of 10 GPU ops replayed") and "the other 1 have no capture" in short


# -- what a capture maps, whatever the trace's row order and threads ------------------------


def _launch_of(trace) -> dict[int, int]:
    """Each kernel's GPU start: the start of the launch call that captured it (-1: none)."""
    found = capture_launches(trace)
    return {int(trace.kernels.start[i]): (int(trace.api.start[c]) if c >= 0 else -1)
            for i, c in enumerate(found.tolist())}


def _copy_calls_of(trace) -> dict[int, int]:
    """Each copy's GPU start: the start of the memory call that captured it (-1: none)."""
    found = capture_memory_calls(trace, capture_launches(trace))
    return {int(trace.memops.start[i]): (int(trace.api.start[c]) if c >= 0 else -1)
            for i, c in enumerate(found.tolist())}


def _shuffled(b: TraceBuilder, seed: int) -> TraceBuilder:
    """The builder's rows in another order (they join by correlation, not by position)."""
    rng = random.Random(seed)
    for rows in (b.api, b.kernels, b.memops, b.ranges):
        rng.shuffle(rows)
    return b


def test_graphs_launched_through_the_driver_api_map_to_their_capture():
    b = TraceBuilder()
    _capture_of_two_layers(b)
    for j, name in enumerate("ABAB"):
        b.launch(name, 2010, 2020, 2100 + 50 * j, 2140 + 50 * j, correlation=10_000,
                 api_name="cuGraphLaunch")
    assert _launch_of(b.build()) == {2100: 20, 2150: 30, 2200: 520, 2250: 530}


def test_a_capture_still_running_captured_no_graph_launched_meanwhile():
    """Thread 2 replays a graph of four kernels (captured before the profile) while thread 1
    is still capturing four launches: that capture ends after the replay began, so it is not
    the replay's."""
    b = TraceBuilder()
    _capture_of_two_layers(b)                     # launches at 20..535 on thread 1
    for j, name in enumerate("ABAB"):
        b.launch(name, 100, 110, 200 + 50 * j, 240 + 50 * j, tid=2, correlation=10_000,
                 api_name="cudaGraphLaunch")
    assert (capture_launches(b.build()) == -1).all()


def test_parallel_graph_branches_map_by_start_not_end():
    """A (captured first) starts first and ends after B: the order of starts pairs them."""
    b = TraceBuilder()
    _capture_of_two_layers(b)
    for name, start, end in [("A", 2100, 2300), ("B", 2150, 2200), ("A", 2400, 2440),
                             ("B", 2450, 2490)]:
        b.launch(name, 2010, 2020, start, end, correlation=10_000, api_name="cudaGraphLaunch")
    assert _launch_of(b.build()) == {2100: 20, 2150: 30, 2400: 520, 2450: 530}


@pytest.mark.parametrize("seed", range(8))
def test_replayed_kernels_map_whatever_the_row_order(seed):
    """Readers keep rows in file order, and a joined trace puts the capture's rows after the
    replay's: one trace's rows shuffled map the same."""
    b = TraceBuilder()
    _capture_of_two_layers(b)
    _replays(b, ["A", "B", "A", "B"])
    want = _launch_of(b.build())
    assert -1 not in want.values()
    assert _launch_of(_shuffled(b, seed).build()) == want


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("copies_at", "begin_end"), [((540, 560), True), ((525,), False)])
def test_replayed_copies_map_whatever_the_row_order(seed, copies_at, begin_end):
    b = _captured_with_copies(copies_at, replayed=len(copies_at), begin_end=begin_end)
    want = _copy_calls_of(b.build())
    assert -1 not in want.values()
    assert _copy_calls_of(_shuffled(b, seed).build()) == want


def test_an_idle_launch_on_another_thread_does_not_lengthen_a_capture():
    """A launch that ran nothing on thread 2 (its kernel before the profile began) sorts right
    after thread 1's capture: the capture keeps its four launches, and every kernel maps."""
    b = TraceBuilder()
    _capture_of_two_layers(b)
    _replays(b, ["A", "B", "A", "B"])
    b.call("cudaLaunchKernel", 0, 3, tid=2)
    assert -1 not in _launch_of(b.build()).values()


def test_an_eager_copy_inside_a_capture_is_no_captured_one():
    """A cudaMemcpyAsync that ran (its copy is in the trace: another stream, relaxed capture
    mode) is no node of the graph: the captured call's replayed copies still map to it."""
    b = _captured_with_copies((540,))
    b.api.append(dict(name=b.strings.code("cudaMemcpyAsync"), start=600, end=605, pid=1,
                      tid=1, correlation=77, kind=0))
    b.memop("[CUDA memcpy Host-to-Device]", 610, 620, correlation=77)
    trace = b.build()
    found = capture_memory_calls(trace, capture_launches(trace))
    replayed = trace.memops.start >= 2000
    assert trace.api.start[found[replayed]].tolist() == [540, 540]


def test_copies_map_only_where_captured_and_replayed_counts_agree():
    """One copy replayed against two captured memory calls: which one it is, nothing says."""
    trace = _captured_with_copies((540, 560), replayed=1).build()
    assert (capture_memory_calls(trace, capture_launches(trace)) == -1).all()


def test_a_call_at_the_same_ns_on_another_thread_is_no_same_profile():
    """The capture file's call starts at the replay's graph launch's nanosecond, on another
    thread: two profiles, joined (not refused as one given twice)."""
    capture, replay = TraceBuilder(), TraceBuilder()
    _capture_of_two_layers(capture)
    _replays(replay, ["A", "B", "A", "B"])
    capture.call("cudaStreamSynchronize", 2010, 2012, tid=9)
    joined = with_capture(replay.build(), capture.build())
    assert (capture_launches(joined) >= 0).sum() == 8


def test_joined_twice_the_replay_rows_stay_the_replays():
    """Two captures joined one after the other: ``replay_rows`` (what ``info`` counts as the
    replay alone) stays the replay's, not the replay's and the first capture's."""
    first, second, replay = TraceBuilder(), TraceBuilder(), TraceBuilder()
    _capture_of_two_layers(first)
    second.call("cudaStreamBeginCapture", 1005, 1006)
    for t in (1020, 1030):
        second.call("cudaLaunchKernel", t, t + 5)
    second.call("cudaStreamEndCapture", 1450, 1460)
    _replays(replay, ["A", "B", "A", "B"])
    for j, name in enumerate(["C", "D"]):
        replay.launch(name, 4010, 4020, 4100 + 50 * j, 4140 + 50 * j, correlation=10_002,
                      api_name="cudaGraphLaunch")
    alone = replay.build()
    trace = with_capture(with_capture(alone, first.build()), second.build())
    assert trace.meta["replay_rows"]["kernels"] == len(alone.kernels)
    assert trace.meta["replay_rows"]["api"] == len(alone.api)


def test_a_trace_that_captures_a_graph_and_replays_it_is_no_profile_of_captures_alone():
    """A capture and the decode steps that replay it, in one trace: the replays are placed
    by the capture, and nothing says the trace records captures and replays none."""
    from kimi_perf import breakdown
    from kimi_perf.layer_breakdown import step_notes

    b = breakdown(_captured_decode().build())
    assert b.source["graph_replays"] == {"ops": 8, "placed_at_capture": 8}
    assert "graph_captures" not in b.source
    assert not any("replays none" in n for n in step_notes(b))
