"""Range nesting and containment against a brute-force reference on random traces."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf.nesting import containing, nest_ranges, range_groups, thread_keys
from kimi_perf.trace import PUSHPOP, STARTEND, Ranges


def make_ranges(rows: list[tuple[int, int, int, int]]) -> Ranges:
    """rows: (tid, start, end, style)."""
    n = len(rows)
    tid = np.array([r[0] for r in rows], np.int64)
    ranges = Ranges.from_columns({
        "name": np.zeros(n), "domain": np.zeros(n),
        "start": np.array([r[1] for r in rows], np.int64),
        "end": np.array([r[2] for r in rows], np.int64), "pid": np.ones(n), "tid": tid,
        "device": np.full(n, -1), "stream": np.full(n, -1),
        "style": np.array([r[3] for r in rows])}, n)
    nest_ranges(ranges)
    return ranges


def brute_force(ranges: Ranges, tids, starts, ends) -> set[tuple[int, int]]:
    return {(r, p) for r in range(len(ranges)) for p in range(len(tids))
            if ranges.tid[r] == tids[p] and ranges.start[r] <= starts[p]
            and ends[p] <= ranges.end[r]}


def nested_ranges(draw, tid: int, lo: int, hi: int, depth: int) -> list:
    """Push/pop ranges: properly nested by construction."""
    out = []
    t = lo
    while t < hi and len(out) < 6:
        s = draw(st.integers(t, hi))
        e = draw(st.integers(s, hi))
        out.append((tid, s, e, PUSHPOP))
        if depth < 3 and e > s:
            out += nested_ranges(draw, tid, s, e, depth + 1)
        t = e + draw(st.integers(0, 3))
        if draw(st.booleans()):
            break
    return out


@st.composite
def traces(draw):
    rows = []
    for tid in (1, 2):
        rows += nested_ranges(draw, tid, 0, 60, 0)
        # Start/end ranges overlap anything, nesting or not.
        for _ in range(draw(st.integers(0, 4))):
            s = draw(st.integers(0, 60))
            rows.append((tid, s, draw(st.integers(s, 60)), STARTEND))
    n_points = draw(st.integers(1, 25))
    tids = [draw(st.sampled_from([1, 2])) for _ in range(n_points)]
    starts = [draw(st.integers(0, 60)) for _ in range(n_points)]
    ends = [s + draw(st.integers(0, 8)) for s in starts]
    return rows, tids, starts, ends


@settings(max_examples=300, deadline=None)
@given(traces())
def test_containing_equals_brute_force(case):
    rows, tids, starts, ends = case
    if not rows:
        return
    ranges = make_ranges(rows)
    tids_a = np.array(tids, np.int64)
    got_r, got_p = containing(ranges, range_groups(ranges), thread_keys(np.ones_like(tids_a),
                              tids_a), np.array(starts, np.int64), np.array(ends, np.int64))
    got = set(zip(got_r.tolist(), got_p.tolist(), strict=True))
    assert len(got) == len(got_r), "a pair came out twice"
    assert got == brute_force(ranges, tids, starts, ends)


@settings(max_examples=200, deadline=None)
@given(traces())
def test_lanes_nest_properly(case):
    rows, *_ = case
    if not rows:
        return
    ranges = make_ranges(rows)
    for i in range(len(ranges)):
        p = ranges.parent[i]
        if p < 0:
            assert ranges.depth[i] == 0
            continue
        assert ranges.lane[p] == ranges.lane[i] and ranges.tid[p] == ranges.tid[i]
        assert ranges.start[p] <= ranges.start[i] and ranges.end[i] <= ranges.end[p]
        assert ranges.depth[i] == ranges.depth[p] + 1
    # Within a lane and thread, any two ranges are nested or disjoint.
    for i in range(len(ranges)):
        for j in range(len(ranges)):
            if i == j or ranges.lane[i] != ranges.lane[j] or ranges.tid[i] != ranges.tid[j]:
                continue
            a, b = (ranges.start[i], ranges.end[i]), (ranges.start[j], ranges.end[j])
            nested = (a[0] <= b[0] and b[1] <= a[1]) or (b[0] <= a[0] and a[1] <= b[1])
            assert nested or a[1] <= b[0] or b[1] <= a[0]


@settings(max_examples=300, deadline=None)
@given(traces(), st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(0, 60),
                                    st.integers(1, 30)), max_size=2))
def test_nesting_equals_the_lane_loop_over_every_range(case, backwards):
    """The vectorized route and the loop it leaves the overlapping busy blocks to give what
    the lane loop gives run over every range of every thread, ranges that end before they
    start (an export's bad row) included."""
    from kimi_perf.nesting import _nest_in_lanes

    rows, *_ = case
    rows = rows + [(tid, s, s - back, PUSHPOP) for tid, s, back in backwards]
    if not rows:
        return
    ranges = make_ranges(rows)
    reference = make_ranges(rows)
    reference.depth[:], reference.parent[:], reference.lane[:] = 0, -1, 0
    groups = range_groups(reference)
    _nest_in_lanes(reference, np.lexsort((-reference.end, reference.start, groups)), groups)
    for column in ("depth", "parent", "lane"):
        assert getattr(ranges, column).tolist() == getattr(reference, column).tolist(), column


def test_one_range_that_overlaps_in_part_sends_its_block_alone_to_the_loop(monkeypatch):
    """A child that ends just after its parent (float rounding at epoch-µs times): the
    loop sees that busy block, not the thread's every range."""
    import kimi_perf.nesting as nesting

    seen = []
    loop = nesting._nest_in_lanes
    monkeypatch.setattr(nesting, "_nest_in_lanes",
                        lambda ranges, order, groups: (seen.append(len(order)),
                                                       loop(ranges, order, groups)))
    rows = [(1, 100 * i, 100 * i + 50, PUSHPOP) for i in range(1000)]
    rows += [(1, 100 * i + 10, 100 * i + 20, PUSHPOP) for i in range(1000)]
    rows.append((1, 510, 551, PUSHPOP))         # in block 5, past its parent's end
    ranges = make_ranges(rows)
    assert seen == [3]
    assert ranges.lane[-1] == 1 and ranges.lane[:-1].tolist() == [0] * 2000
    assert ranges.parent[1005] == 5 and ranges.depth[1005] == 1


def test_push_pop_ranges_use_one_lane():
    ranges = make_ranges([(1, 0, 100, PUSHPOP), (1, 10, 50, PUSHPOP), (1, 20, 30, PUSHPOP),
                          (1, 60, 90, PUSHPOP)])
    assert ranges.lane.tolist() == [0, 0, 0, 0]
    assert ranges.depth.tolist() == [0, 1, 2, 1]
    assert ranges.parent.tolist() == [-1, 0, 1, 0]


def test_overlapping_start_end_ranges_get_their_own_lane():
    ranges = make_ranges([(1, 0, 50, STARTEND), (1, 40, 90, STARTEND)])
    assert sorted(ranges.lane.tolist()) == [0, 1]


@pytest.mark.parametrize(("pid", "tid"), [(1, 5 + 2**31), (7 + 2**30, 5), (1, 5 + 2**40)])
def test_threads_whose_ids_differ_above_the_key_s_bits_are_not_one(tmp_path, pid, tid):
    """Thread keys packed pid and tid into 30 + 31 bits: a kernel launched from tid 5 + 2^31
    fell in a range of tid 5 (ranges listed it there, breakdown counted it in the step).
    Ids that do not fit are hashed as a pair, the same in every array."""
    from kimi_perf import range_kernel_summary, read_trace

    def call(p, t, ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": p,
                "tid": t, "ts": ts, "dur": 5, "args": {"correlation": corr}}

    def kernel(name, ts, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts,
                "dur": 3, "args": {"correlation": corr, "device": 0, "stream": 7}}

    events = [{"ph": "X", "cat": "user_annotation", "name": "decode_step[0]", "pid": 1,
               "tid": 5, "ts": 100, "dur": 100},
              call(1, 5, 110, 1), call(pid, tid, 120, 2),
              kernel("in_range", 130, 1), kernel("other_thread", 141, 2)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = {r.kernel: r.range for r in range_kernel_summary(read_trace(path))}
    assert rows == {"in_range": "decode_step[0]", "other_thread": None}
    keys = thread_keys(np.array([1, 1, pid, pid]), np.array([5, 5, tid, tid]))
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]
    assert keys.min() >= 0 and keys.max() < 1 << 62   # (below the streams' keys)


def test_gpu_ranges_of_one_stream_id_on_two_devices_are_two_lanes():
    """Kineto's GPU-side annotations on stream 7 of devices 0 and 16 (two nodes of eight and
    more GPUs in one trace) are two groups: one would nest the two devices' ranges together;
    CPU ranges keep their threads' keys."""
    from kimi_perf.trace import GPU_RANGE

    n = 3
    ranges = Ranges.from_columns({
        "name": np.zeros(n), "domain": np.zeros(n), "start": np.array([0, 0, 0], np.int64),
        "end": np.array([10, 10, 10], np.int64), "pid": np.ones(n),
        "tid": np.array([-1, -1, 5], np.int64), "device": np.array([0, 16, -1]),
        "stream": np.array([7, 7, -1]), "style": np.array([GPU_RANGE, GPU_RANGE, PUSHPOP])}, n)
    keys = range_groups(ranges)
    assert len(set(keys.tolist())) == 3 and (keys >= 0).all()
    assert keys[2] == thread_keys(np.array([1]), np.array([5]))[0]


def test_a_point_of_no_known_process_or_thread_is_in_no_thread():
    """A kernel whose launching process the trace lacks (pid -1, a Kineto kernel of no
    launch) is in no thread's ranges, whatever its tid says; so is one of no thread."""
    keys = thread_keys(np.array([-1, 1, 1]), np.array([5, -1, 5]))
    assert keys[:2].tolist() == [-2, -2] and keys[2] >= 0
