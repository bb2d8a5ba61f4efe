"""Regressions and fast-route equivalence for the trace core: containment with excluded ranges,
vectorized nesting, busy time, per-segment figures, the kernel-range summary, the nsys reader's
integer columns and NVTX texts."""

from __future__ import annotations

import copy
import dataclasses
import platform
import re
import sqlite3
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf import breakdown, layer_breakdown, nesting, read_trace
from kimi_perf.attribution import _summary_by_lexsort, kernel_launch_pairs, range_kernel_summary
from kimi_perf.errors import TraceError
from kimi_perf.launches import find_launches
from kimi_perf.layer_breakdown import (
    SegmentFigures,
    _bincount_int,
    _median,
    _union_length,
    _us,
    _us_array,
)
from kimi_perf.nesting import (
    _nest_in_lanes,
    containing,
    nearest_valid_ancestor,
    range_groups,
    thread_keys,
)
from kimi_perf.readers.nsys import _decode_text, _first_per_key, _NsysReader
from kimi_perf.strings import StringTable
from kimi_perf.trace import GPU_RANGE, PUSHPOP, STARTEND, TABLES, ApiCalls, Trace, compact_ints
from tests.conftest import kineto_fixtures, nsys_fixtures
from tests.synth import TraceBuilder
from tests.test_layers import nvtx_decode_trace
from tests.test_nesting import brute_force, make_ranges, traces

# -- containing with excluded ranges -------------------------------------------------------------


def _points(tids, starts, ends):
    t = np.array(tids, np.int64)
    return thread_keys(np.ones_like(t), t), np.array(starts, np.int64), np.array(ends, np.int64)


def test_excluded_parent_does_not_hide_outer_range():
    # A ⊃ B ⊃ C on one thread; B excluded (as find_steps / layers_from_ranges filter ranges).
    ranges = make_ranges([(1, 0, 100, PUSHPOP), (1, 10, 90, PUSHPOP), (1, 20, 30, PUSHPOP)])
    keys = range_groups(ranges)
    keys[1] = -1
    got_r, got_p = containing(ranges, keys, *_points([1], [40], [41]))
    assert got_r.tolist() == [0] and got_p.tolist() == [0]
    # Inside C too: C and A, never B.
    got_r, _ = containing(ranges, keys, *_points([1], [21], [22]))
    assert sorted(got_r.tolist()) == [0, 2]


def test_nearest_valid_ancestor_skips_runs_of_excluded_ranges():
    parent = np.array([-1, 0, 1, 2, 3, 4, 0])
    valid = np.array([True, False, False, True, False, False, False])
    assert nearest_valid_ancestor(parent, valid, np.arange(7)).tolist() == [
        -1, 0, 0, 0, 3, 3, 0]
    assert nearest_valid_ancestor(parent, valid, np.array([5, 3])).tolist() == [3, 0]


def test_zero_length_point_where_one_range_ends_and_the_next_begins():
    # [0,1] and [1,2] touch inside [0,60]: the point [1,1] lies in all three.
    ranges = make_ranges([(1, 0, 60, PUSHPOP), (1, 1, 2, PUSHPOP), (1, 2, 2, PUSHPOP),
                          (1, 0, 1, STARTEND)])
    got_r, _ = containing(ranges, range_groups(ranges), *_points([1], [1], [1]))
    assert sorted(got_r.tolist()) == [0, 1, 3]


@settings(max_examples=300, deadline=None)
@given(traces(), st.randoms(use_true_random=False))
def test_containing_with_exclusions_equals_brute_force(case, rnd):
    rows, tids, starts, ends = case
    if not rows:
        return
    ranges = make_ranges(rows)
    keep = np.array([rnd.random() < 0.6 for _ in rows])
    keys = np.where(keep, range_groups(ranges), -1)
    got_r, got_p = containing(ranges, keys, *_points(tids, starts, ends))
    got = set(zip(got_r.tolist(), got_p.tolist(), strict=True))
    assert len(got) == len(got_r), "a pair came out twice"
    assert got == {(r, p) for r, p in brute_force(ranges, tids, starts, ends) if keep[r]}


# -- nest_ranges: vectorized route vs the lane loop ----------------------------------------------


def _nest_by_loop(ranges):
    groups = range_groups(ranges)
    order = np.lexsort((-ranges.end, ranges.start, groups))
    ranges.depth = np.zeros(len(ranges), np.int32)
    ranges.parent = np.full(len(ranges), -1, np.int64)
    ranges.lane = np.zeros(len(ranges), np.int32)
    _nest_in_lanes(ranges, order, groups)
    return ranges.depth.tolist(), ranges.parent.tolist(), ranges.lane.tolist()


def _nest_both(rows):
    ranges = make_ranges(rows)
    fast = ranges.depth.tolist(), ranges.parent.tolist(), ranges.lane.tolist()
    return fast, _nest_by_loop(ranges)


@settings(max_examples=300, deadline=None)
@given(traces())
def test_nest_ranges_equals_lane_loop(case):
    rows, *_ = case
    if rows:
        fast, loop = _nest_both(rows)
        assert fast == loop


@pytest.mark.parametrize("rows", [
    # Touching siblings, zero-length ranges at edges, duplicates.
    [(1, 0, 10, PUSHPOP), (1, 10, 20, PUSHPOP), (1, 20, 20, PUSHPOP), (1, 20, 20, PUSHPOP),
     (1, 10, 10, PUSHPOP), (1, 0, 10, PUSHPOP), (1, 5, 10, PUSHPOP)],
    # A deep chain and a long flat run.
    [(1, i, 1000 - i, PUSHPOP) for i in range(300)] + [(2, 2 * i, 2 * i + 1, PUSHPOP)
                                                        for i in range(500)],
    # Deep chains closed by one range: within the pointer-jumping rounds, and past them.
    [(1, i, 1000 - i, PUSHPOP) for i in range(300)] + [(1, 1000, 1001, PUSHPOP)],
    [(1, i, 5000 - i, PUSHPOP) for i in range(1500)] + [(1, 5000, 5001, PUSHPOP),
                                                         (1, 5001, 5002, PUSHPOP)],
    # Thread 1 nests; thread 2 overlaps (lanes); thread 3 ends before it starts.
    [(1, 0, 100, PUSHPOP), (1, 10, 20, PUSHPOP), (2, 0, 50, STARTEND), (2, 40, 90, STARTEND),
     (2, 45, 60, STARTEND), (3, 10, 5, STARTEND), (3, 0, 20, PUSHPOP)],
])
def test_nest_ranges_edge_cases(rows):
    fast, loop = _nest_both(rows)
    assert fast == loop


def _fixtures(nsys: slice = slice(None), kineto: slice = slice(None)) -> list[Path]:
    """Those of the nsys and Kineto fixtures, never none of either (a loop over none
    would check nothing)."""
    nsys_files, kineto_files = nsys_fixtures()[nsys], kineto_fixtures()[kineto]
    assert nsys_files and kineto_files, "fixtures missing: see tests/conftest.py"
    return nsys_files + kineto_files


def test_nest_ranges_on_fixtures_equals_lane_loop():
    for path in _fixtures():
        ranges = read_trace(path).ranges
        fast = ranges.depth.tolist(), ranges.parent.tolist(), ranges.lane.tolist()
        assert fast == _nest_by_loop(ranges), path.name


# -- busy time and per-segment figures -----------------------------------------------------------


def _union_reference(start, end):
    order = np.argsort(start, kind="stable")
    total, cur_s, cur_e = 0, None, None
    for s, e in zip(start[order].tolist(), end[order].tolist(), strict=True):
        if cur_s is None or s > cur_e:
            if cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_s is not None else 0)


def test_union_length_with_negative_times():
    start = np.array([-100, -95, -80, -79, -60])
    end = np.array([-90, -92, -70, -75, -59])
    assert _union_length(start, end) == 10 + 10 + 1
    # Far below zero, as clocks with an arbitrary origin give.
    big = -(10 ** 14)
    assert _union_length(start + big, end + big) == 21
    assert _union_length(np.array([-5]), np.array([-2])) == 3


def test_union_length_of_intervals_in_any_order():
    """Intervals given out of start order (ops of several streams) union as in order: a
    later one that starts first still covers what it covers."""
    rng = np.random.default_rng(3)
    start = np.array([40, 20, 0, 21, 5])
    end = np.array([41, 30, 10, 25, 8])
    assert _union_length(start, end) == 10 + 10 + 1
    for _ in range(20):
        order = rng.permutation(len(start))
        assert _union_length(start[order], end[order]) == 21


def _segment_stats_reference(start, end, rows, classes, labels):
    """The per-segment implementation ``breakdown`` used before it was vectorized."""
    if len(rows) == 0:
        return {"kernels": 0, "kernel_us": 0.0, "span_us": 0.0, "gap_us": 0.0, "classes": {}}
    s, e = start[rows], end[rows]
    span = int(e.max() - s.min())
    busy = _union_reference(s, e)
    cls = classes[rows]
    dur = e - s
    per_class = {}
    for c in np.unique(cls).tolist():
        sel = cls == c
        per_class[labels[c]] = {"kernels": int(sel.sum()), "us": _us(dur[sel].sum())}
    return {"kernels": len(rows), "kernel_us": _us(dur.sum()), "span_us": _us(span),
            "gap_us": _us(span - busy), "classes": dict(sorted(per_class.items()))}


def _ops(start, end, classes, labels):
    """What the segment figures read of ``GpuOps``."""
    return SimpleNamespace(start=start, end=end, kernel_class=classes, class_labels=labels)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2 ** 32), st.sampled_from([0, -(10 ** 14), 10 ** 15, 2 ** 62]),
       st.sampled_from([1 << 16, 7, 1]))
def test_segment_figures_equal_per_segment_reference(seed, origin, batch_rows):
    # batch_rows: segments are summed in batches of about that many rows (a real decode
    # trace has more rows than one batch; these have at most 60)
    with mock.patch.object(layer_breakdown, "_BATCH_ROWS", batch_rows):
        _segment_figures_equal_per_segment_reference(seed, origin)


def _segment_figures_equal_per_segment_reference(seed, origin):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 60))
    start = origin + rng.integers(-50, 500, n)
    end = start + rng.integers(0, 80, n)
    labels = ["zeta", "alpha", "moe", "gemm"]
    classes = rng.integers(0, len(labels), n).astype(np.int32)
    segments = []
    for _ in range(int(rng.integers(0, 8))):
        rows = rng.choice(n, int(rng.integers(0, n + 1)), replace=False) if n else \
            np.empty(0, np.int64)
        if rng.random() < 0.5:
            rows = rows[np.argsort(start[rows], kind="stable")]
        segments.append(rows.astype(np.int64))
    ops = _ops(start, end, classes, labels)
    got = SegmentFigures.of(ops, segments, classes, labels).stats(labels)
    assert got == [_segment_stats_reference(start, end, rows, classes, labels)
                   for rows in segments]
    for rows in segments:   # one at a time, as many
        assert SegmentFigures.of(ops, [rows], classes, labels).stats(labels)[0] == \
            _segment_stats_reference(start, end, rows, classes, labels)


def test_segment_figures_fall_back_for_huge_spans():
    start = np.array([-(2 ** 62), 0, 2 ** 61, 5, 6])
    end = np.array([-(2 ** 62) + 10, 10, 2 ** 61 + 3, 7, 8])
    labels = ["a"]
    classes = np.zeros(5, np.int32)
    segments = [np.arange(3), np.array([3, 4]), np.array([4])]
    got = SegmentFigures.of(_ops(start, end, classes, labels), segments, classes,
                            labels).busy_ns.tolist()
    assert got == [_union_reference(start[s], end[s]) for s in segments]


def test_exact_sums_per_key_past_what_float64_adds_exactly():
    rng = np.random.default_rng(1)
    key = rng.integers(0, 5, 400)
    values = rng.integers(2 ** 50, 2 ** 55, 400)   # sums past 2**53: the int64 fallback
    want = [sum(v for k, v in zip(key.tolist(), values.tolist(), strict=True) if k == i)
            for i in range(6)]
    assert _bincount_int(key, values, 6).tolist() == want


def test_us_array_rounds_like_us():
    rng = np.random.default_rng(0)
    for scale in (10, 10 ** 9, 10 ** 15, 2 ** 62):
        ns = rng.integers(-scale, scale, 5000)
        assert _us_array(ns).tolist() == [_us(v) for v in ns.tolist()]


def layer_type_medians(layer_rows: list[dict]) -> list[dict]:
    """Per layer type, the median of each figure over all its layers in all steps, from the
    rows as dicts: the reference of the breakdown's medians, taken from its columns."""
    by_type: dict[str, list[dict]] = {}
    for row in layer_rows:
        by_type.setdefault(row["type"], []).append(row)
    out = []
    for kind, rows in by_type.items():
        classes = sorted({c for r in rows for c in r["classes"]})
        out.append({
            "type": kind, "layers": len(rows),
            "kernels": _median([r["kernels"] for r in rows]),
            "kernel_us": _median([r["kernel_us"] for r in rows]),
            "span_us": _median([r["span_us"] for r in rows]),
            "gap_us": _median([r["gap_us"] for r in rows]),
            "classes": {c: {"kernels": _median([r["classes"].get(c, {}).get("kernels", 0)
                                                for r in rows]),
                            "us": _median([r["classes"].get(c, {}).get("us", 0.0)
                                           for r in rows])} for c in classes},
        })
    return out


def test_breakdown_layer_type_medians_match_the_dict_version():
    traces_ = [nvtx_decode_trace("layer[{i}]({kind})", steps=3, n_layers=8).build()]
    traces_ += [read_trace(p) for p in kineto_fixtures()[:4]]
    for trace in traces_:
        b = breakdown(trace)
        assert [{k: v for k, v in t.items() if k not in ("pattern", "typical_layer")}
                for t in b.layer_types] == layer_type_medians(b.layers)


# -- range_kernel_summary: grouped sort vs the reference lexsort ---------------------------------


def _rows(rows):
    """Rows to compare: exact, but the mean and deviation, which two routes sum in other
    orders (equal to their last few bits)."""
    return [tuple(pytest.approx(v, rel=1e-12) if isinstance(v, float) else v
                  for v in dataclasses.astuple(r)) for r in rows]


def _reference_summary(trace):
    """The lexsort route's rows in nsys's order, sorted by Python on their strings."""
    from kimi_perf import attribution

    rows = attribution._rows(trace, _summary_by_lexsort(trace, *kernel_launch_pairs(trace)))
    rows.sort(key=lambda row: (row.range is not None, row.range or "", row.pid or -1,
                               row.tid or -1, -row.total_ns, row.kernel))
    return rows


def _containment_by_brute_force(trace) -> tuple[Counter, Counter]:
    """Per (range name, kernel name), of every kernel with a launch call and every CPU range
    of the launching thread that contains the call, one at a time: the distinct kernels
    and their ns (a kernel in two ranges of one name counts once)."""
    k, api, r = trace.kernels, trace.api, trace.ranges
    cpu = r.style != GPU_RANGE
    kernels, ns = Counter(), Counter()
    for i in np.flatnonzero(k.api >= 0).tolist():
        call = k.api[i]
        inside = cpu & (r.pid == k.pid[i]) & (r.tid == k.tid[i]) \
            & (r.start <= api.start[call]) & (api.end[call] <= r.end)
        kernel = trace.strings[k.name[i]]
        names = [trace.strings[c] for c in r.name[inside].tolist()]
        for name in set(names):
            kernels[(name, kernel)] += 1
            ns[(name, kernel)] += int(k.end[i] - k.start[i])
    return kernels, ns


def test_range_kernel_summary_equals_brute_force_containment_on_kineto_fixtures():
    """Not the production route against another of its own: the Kineto fixtures' ranges
    (user annotations, CPU ops, nn.Module calls) tested against every launch call, one
    pair at a time."""
    checked = 0
    for path in kineto_fixtures():
        trace = read_trace(path)
        kernels, ns = Counter(), Counter()
        for row in range_kernel_summary(trace):
            if row.range is not None:   # (a kernel in no range: nothing to contain it)
                kernels[(row.range, row.kernel)] += row.kernel_instances
                ns[(row.range, row.kernel)] += row.total_ns
        want_kernels, want_ns = _containment_by_brute_force(trace)
        assert kernels == want_kernels and ns == want_ns, path.name
        checked += len(want_kernels)
    assert checked > 1000


def test_range_kernel_summary_equals_reference_on_fixtures():
    for path in _fixtures():
        trace = read_trace(path)
        got = range_kernel_summary(trace)
        assert _rows(got) == _rows(_reference_summary(trace))
        # plain Python values (JSON writes them), floats only where nsys prints a fraction
        assert all(type(v) in ((float,) if f in ("avg_ns", "stddev_ns")
                               else (int, str, type(None)))
                   for r in got for f, v in dataclasses.asdict(r).items())


@st.composite
def launch_traces(draw):
    b = TraceBuilder()
    names = ["fwd", "layer", "attn", "moe"]
    for tid in (1, 2):
        t = 0
        for _ in range(draw(st.integers(0, 6))):
            s = t + draw(st.integers(0, 30))
            e = s + draw(st.integers(0, 200))
            style = draw(st.sampled_from([PUSHPOP, STARTEND]))
            b.range(draw(st.sampled_from(names)), s, e, tid=tid, style=style)
            if draw(st.booleans()):        # a nested range, maybe with the same name
                b.range(draw(st.sampled_from(names)), s + draw(st.integers(0, 5)),
                        e - draw(st.integers(0, 5)), tid=tid)
            t = s + draw(st.integers(0, 100))
    for _ in range(draw(st.integers(0, 30))):
        s = draw(st.integers(0, 400))
        tid = draw(st.sampled_from([1, 2, 3]))
        b.launch(draw(st.sampled_from(["gemm", "norm", "topk"])), s, s + draw(st.integers(0, 9)),
                 1000 + s, 1000 + s + draw(st.integers(0, 50)), tid=tid)
    trace = b.build()
    # Some kernels lose their launch (no API row): empty range, no pid/tid.
    lost = np.array([draw(st.booleans()) and draw(st.booleans())
                     for _ in range(len(trace.kernels))], bool)
    trace.kernels.api[lost] = -1
    trace.kernels.tid[lost] = -1
    return trace


@settings(max_examples=200, deadline=None)
@given(launch_traces())
def test_range_kernel_summary_equals_reference(trace):
    got = range_kernel_summary(trace)
    assert _rows(got) == _rows(_reference_summary(trace))
    # In chunks of two kernels, ranges span chunks: their keys are carried until they end.
    with mock.patch.object(nesting, "_POINT_CHUNK", 2):
        assert _rows(range_kernel_summary(trace)) == _rows(got)


def test_range_kernel_summary_in_small_chunks_on_fixtures(monkeypatch):
    monkeypatch.setattr(nesting, "_POINT_CHUNK", 97)
    for path in _fixtures(slice(4), slice(4)):
        trace = read_trace(path)
        got = range_kernel_summary(trace)
        assert _rows(got) == _rows(_reference_summary(trace))


def test_range_kernel_summary_counts_nested_same_name_ranges():
    """A kernel inside two nested ranges of one name is one kernel of the row, and its time
    counts once (nsys's nvtx_kern_sum sums it once per range: 10 + 10 + 30 beside a count of
    2 kernels, a total no kernel ran)."""
    b = TraceBuilder()
    b.range("fwd", 0, 100)
    b.range("fwd", 10, 90)      # nested, same name: 2 range instances, 1 kernel instance each
    b.range("fwd", 200, 300)
    b.launch("gemm", 20, 30, 1000, 1010)
    b.launch("gemm", 210, 220, 2000, 2030)
    b.launch("gemm", 400, 410, 3000, 3005)  # outside every range
    rows = {(r.range, r.kernel): r for r in range_kernel_summary(b.build())}
    fwd = rows[("fwd", "gemm")]
    assert (fwd.range_instances, fwd.kernel_instances, fwd.total_ns) == (3, 2, 10 + 30)
    # the figures of its two kernels' durations, 10 and 30 (the sample deviation: n - 1)
    assert (fwd.avg_ns, fwd.min_ns, fwd.max_ns) == (20.0, 10, 30)
    assert fwd.stddev_ns == pytest.approx(200 ** 0.5)
    from kimi_perf import attribution

    trace = b.build()
    reference = attribution._rows(trace, _summary_by_lexsort(trace, *kernel_launch_pairs(trace)))
    assert {(r.range, r.kernel): r.total_ns for r in reference}[("fwd", "gemm")] == 40
    lone = rows[(None, "gemm")]
    assert (lone.range_instances, lone.kernel_instances, lone.total_ns) == (0, 1, 5)


# -- compact id columns: int32 where the values fit; either width reads and analyses alike ------


def test_compact_ints_narrows_only_what_fits():
    fits = compact_ints(np.array([-(2**31), -1, 2**31 - 1], np.int64))
    assert fits.dtype == np.int32 and fits.tolist() == [-(2**31), -1, 2**31 - 1]
    for wide in (np.array([0, 2**31], np.int64), np.array([-(2**31) - 1, 0], np.int64)):
        assert compact_ints(wide) is wide
    assert compact_ints(np.empty(0, np.int64)).dtype == np.int32


def test_index_dtype_is_int32_up_to_the_rows_int32_indexes():
    """Row indices (and -1) into a table of up to 2^31 - 1 rows are int32, past it int64:
    the boundary ``index_dtype`` states (every index of such a table, 2^31 - 2 at most, fits)."""
    from kimi_perf.trace import index_dtype

    assert index_dtype(0) is np.int32 and index_dtype(2**31 - 1) is np.int32
    assert index_dtype(2**31) is np.int64


def test_columns_refuse_integers_their_dtype_cannot_hold():
    """A column built from values its dtype cannot hold is refused by name, never wrapped or
    cut by the cast: an unsigned 2^63 (numpy's type of a list holding it alone) is no int64,
    nor is 2^63 as a float (the float next below it, 2^63 - 1024, is), nor 2.5 (not cut to
    2); an int64 below int32's least (-2^31 - 1) is no GPU id. int64's own least value,
    beside a whole float (a JSON reader's list of mixed numbers), is kept exactly. Columns
    not given are -1, int32 where ``keep_int32`` asks for compact ones."""
    from kimi_perf.trace import Kernels

    for columns, said in (({"stream": [2**63]}, "Kernels.stream holds 9223372036854775808, "
                                                 "beyond int64"),
                          ({"stream": np.array([2**63], np.uint64)},
                           "Kernels.stream holds 9223372036854775808, beyond int64"),
                          ({"stream": [1, float(2**63)]},   # (a JSON 2^63 as a float)
                           "Kernels.stream holds 9.22337e+18, beyond int64"),
                          ({"stream": [1, 2.5]}, "Kernels.stream holds 2.5, not an integer"),
                          ({"device": np.array([0, -(2**31) - 1], np.int64)},
                           "Kernels.device holds -2147483649, beyond int32")):
        n = len(next(iter(columns.values())))
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            Kernels.from_columns(columns, n)
    kept = Kernels.from_columns({"stream": [-(2**63), 2.0]}, 2)
    assert kept.stream.dtype == np.int64 and kept.stream.tolist() == [-(2**63), 2]
    below = Kernels.from_columns({"stream": [1, float(2**63 - 1024)]}, 2)
    assert below.stream.tolist() == [1, 2**63 - 1024]
    # columns not given are -1, int32 where compact may narrow them and keep_int32 asks it
    for keep, width in ((True, np.int32), (False, np.int64)):
        missing = Kernels.from_columns({"start": np.array([5, 6])}, 2, keep_int32=keep)
        assert missing.tid.dtype == width and missing.tid.tolist() == [-1, -1]
        assert missing.start.dtype == np.int64 and missing.device.dtype == np.int32


def test_joined_renumbers_rows_and_adds_up_metadata():
    """``Trace.joined``: the other trace's launch rows after this one's 3 API calls (its row 0
    too, no unknown), its parent rows after this one's 2 ranges, -1 kept; its GPU and process
    not listed twice where both describe them, a new one added; untimed work, exact repeats
    and untimed ranges added up from both."""
    from tests.synth import TraceBuilder

    first, second = TraceBuilder(), TraceBuilder()
    first.range("outer", 0, 1000)
    first.range("inner", 10, 500)
    first.call("cudaStreamSynchronize", 1, 2)
    first.call("cudaStreamSynchronize", 3, 4)
    first.launch("a", 20, 30, 100, 200)
    second.launch("b", 10_020, 10_030, 10_100, 10_200)
    second.call("cudaStreamSynchronize", 10_040, 10_050)
    second.range("outer", 10_000, 11_000)
    second.range("inner", 10_010, 10_500)
    mine, theirs = first.build(), second.build()
    mine.meta |= {"gpus": [{"device": 0, "name": "G", "sm_count": 1}],
                  "processes": [{"pid": 1, "name": "python"}],
                  "untimed": {"kernels": 1, "memops": 0}, "untimed_ranges": 2}
    theirs.meta |= {"gpus": [{"device": 0, "name": "G", "sm_count": 1},
                             {"device": 1, "name": "G", "sm_count": 1}],
                    "processes": [{"pid": 1, "name": "python"}],
                    "untimed": {"kernels": 2, "memops": 3}, "duplicates": {"kernels": 4,
                                                                           "memops": 0},
                    "untimed_ranges": 5}
    joined = mine.joined(theirs)
    assert joined.kernels.api.tolist() == [2, 3]
    assert joined.ranges.parent.tolist() == [-1, 0, -1, 2]
    assert [joined.strings[n] for n in joined.kernels.name.tolist()] == ["a", "b"]
    assert [g["device"] for g in joined.meta["gpus"]] == [0, 1]
    assert joined.meta["processes"] == [{"pid": 1, "name": "python"}]
    assert joined.meta["untimed"] == {"kernels": 3, "memops": 3}
    assert joined.meta["duplicates"] == {"kernels": 4, "memops": 0}
    assert joined.meta["untimed_ranges"] == 7


def test_file_identity_reads_the_whole_last_64_kib(tmp_path):
    """A trace file's identity digests its first and last 64 KiB: two files of 200 KiB that
    differ only in the first byte of the last 64 KiB are told apart (and by nothing else)."""
    from kimi_perf.trace import IDENTITY_BYTES, file_identity

    size = 200 << 10
    one, other = bytearray(size), bytearray(size)
    other[size - IDENTITY_BYTES] = 1
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "t.json").write_bytes(bytes(one))
    (tmp_path / "b" / "t.json").write_bytes(bytes(other))
    a, b = (file_identity(tmp_path / d / "t.json") for d in "ab")
    assert a["name"] == b["name"] and a["size"] == b["size"] == size
    assert a["digest"] != b["digest"]


def _widened(trace: Trace) -> Trace:
    """The trace with every compacted column int64 again, as traces were (and as the traces
    saved then load)."""
    wide = copy.deepcopy(trace)
    for table_name in TABLES:
        table = getattr(wide, table_name)
        for col in table.compact_columns:
            setattr(table, col, getattr(table, col).astype(np.int64))
    return wide


def test_compact_and_wide_traces_save_load_and_analyse_alike(tmp_path):
    for path in _fixtures(slice(-1, None), slice(1)):
        trace = read_trace(path)
        assert trace.kernels.correlation.dtype == np.int32
        assert trace.ranges.parent.dtype == np.int32
        wide = _widened(trace)
        trace.save(tmp_path / "compact.kptrace")
        wide.save(tmp_path / "wide.kptrace")
        loaded = Trace.load(tmp_path / "compact.kptrace")
        loaded_wide = Trace.load(tmp_path / "wide.kptrace")
        assert loaded.kernels.correlation.dtype == np.int32
        assert loaded_wide.kernels.correlation.dtype == np.int64
        summary, figures = _rows(range_kernel_summary(trace)), breakdown(trace).to_json()
        for other in (wide, loaded, loaded_wide):
            assert _rows(range_kernel_summary(other)) == summary
            got = breakdown(other).to_json()
            if other is not wide:   # a saved trace names the file read, and whence it came
                got["source"] = {**got["source"], "file": figures["source"]["file"]}
                assert got["source"].pop("converted_from") == str(path)
            assert got == figures


def test_release_free_memory_trims_the_heap_and_is_harmless(monkeypatch):
    from kimi_perf import memory

    if platform.libc_ver()[0] == "glibc":
        assert memory._malloc_trim() is not None
    block = np.ones(1 << 20)
    del block
    memory.release_free_memory()       # nothing changes but the RSS
    trace = read_trace(nsys_fixtures()[-1])
    memory.release_free_memory()
    assert len(trace.kernels) == 7328
    # what it asks of the C library: every free page (pad 0), not only the heap's top
    calls: list[int] = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: calls.append)
    memory.release_free_memory()
    assert calls == [0]
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)    # no glibc: nothing to do
    memory.release_free_memory()


# -- nsys reader: integer columns as text, NVTX texts --------------------------------------------

WEIRD_VALUES = [" ", "\t", "-", "--5", "5-3", "\t5", "5\n", "", "1e3", "0x1f", "١٢", " 12",
                "+7", "-0", "007", "99999999999999999999", "9223372036854775807", 1.5, 5.0,
                1e30, b"ab", b"12", "1,2", None, -1, 2 ** 63 - 1, -(2 ** 63), "nan", "5 5",
                "1_000", 12345678901234]


def _reader(rows, affinity="INTEGER"):
    conn = sqlite3.connect(":memory:")
    conn.text_factory = _decode_text
    conn.execute(f"CREATE TABLE t (a {affinity}, b {affinity})")
    conn.executemany("INSERT INTO t VALUES (?, ?)", rows)
    reader = _NsysReader(conn, Path("test.sqlite"))
    reader.schema = None
    return reader


def _read(fetch):
    try:
        cols = fetch("t", {"a": "a", "b": "b", "none": "NULL", "zero": "0", "neg": "-3"}, "")
    except TraceError:
        return "TraceError"
    return {k: v.tolist() for k, v in cols.items()}


@pytest.mark.parametrize("affinity", ["INTEGER", ""])
@pytest.mark.parametrize("value", WEIRD_VALUES)
def test_int_columns_equal_row_by_row_read(value, affinity):
    reader = _reader([(1, 2), (value, 3), (-4, None)], affinity)
    assert _read(reader._int_columns) == _read(reader._int_columns_by_rows)


def test_int_columns_text_route_is_taken_and_handles_empty_tables():
    reader = _reader([(i, None if i % 3 else -i) for i in range(1000)])
    fast = reader._int_columns_as_text("t", {"a": "a", "b": "b"}, "")
    assert fast is not None and fast["a"].tolist() == list(range(1000))
    assert fast["b"].tolist() == [-i if i % 3 == 0 else -1 for i in range(1000)]
    empty = reader._int_columns("t", {"a": "a", "k": "NULL"}, "WHERE a < 0")
    assert empty["a"].dtype == np.int64 and len(empty["a"]) == 0 and len(empty["k"]) == 0
    with pytest.raises(TraceError, match="non-integer"):
        _reader([(1, 2), ("x", 3)])._int_columns("t", {"a": "a"}, "")


def test_int_columns_fall_back_past_sqlite_length_limit():
    reader = _reader([(123456789, 1)] * 1000)
    reader.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1000)
    assert reader._int_columns_as_text("t", {"a": "a"}, "") is None
    assert reader._int_columns("t", {"a": "a"}, "")["a"].tolist() == [123456789] * 1000


def _nvtx_reader(rows, columns=("textId", "text")):
    conn = sqlite3.connect(":memory:")
    conn.text_factory = _decode_text
    conn.execute(f"CREATE TABLE NVTX_EVENTS (eventType INTEGER, {', '.join(columns)})")
    conn.executemany(f"INSERT INTO NVTX_EVENTS VALUES ({', '.join('?' * (len(columns) + 1))})",
                     rows)
    reader = _NsysReader(conn, Path("test.sqlite"))
    reader.strings = StringTable()
    reader.strings.extend(["x", "registered a", "registered b"])
    reader.id_to_code = np.array([-1, 1, 2, -1, 0], np.int32)
    return reader


@pytest.mark.parametrize("columns", [("textId", "text"), ("text",), ("textId",)])
def test_nvtx_texts_equal_row_by_row_read(columns):
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(400):
        text_id = rng.choice([None, 1, 2, 0, 3, 4, 99, -5])
        text = rng.choice([None, "alpha", "beta", "", "x", "alpha"]) if rng.random() < 0.9 \
            else int(rng.integers(0, 3))
        row = {"textId": None if text_id is None else int(text_id), "text": text}
        rows.append((int(rng.choice([59, 60, 75])), *(row[c] for c in columns)))
    where = "WHERE eventType IN (59, 60)"
    fast, slow = _nvtx_reader(rows, columns), _nvtx_reader(rows, columns)
    cols = set(columns)
    assert fast._nvtx_texts("NVTX_EVENTS", cols, where).tolist() == \
        slow._nvtx_texts_by_rows("NVTX_EVENTS", cols, where).tolist()
    assert fast.strings.values == slow.strings.values    # same codes, interned in one order


@pytest.mark.parametrize("texts", [
    ["alpha", "beta", "alpha", "", "ünïcode ✓"],        # all text: one group_concat
    ["a\x1fb", "c", "a"],                               # holds the separator
    ["x", None, "y"],                                   # a NULL
    ["ok", b"bad \xe2\x82 bytes", "ok", b"\xff"],       # invalid UTF-8 stored as TEXT
])
def test_nvtx_plain_texts_equal_row_by_row_read(texts):
    rows = [(59, None, t) for t in texts]
    fast, slow = _nvtx_reader(rows), _nvtx_reader(rows)
    for reader in (fast, slow):    # the bytes become TEXT that is not UTF-8
        reader.conn.execute("UPDATE NVTX_EVENTS SET text = CAST(text AS TEXT)")
    where = "WHERE eventType = 59"
    got = fast._nvtx_texts("NVTX_EVENTS", {"textId", "text"}, where)
    assert got.tolist() == slow._nvtx_texts_by_rows("NVTX_EVENTS", {"textId", "text"},
                                                     where).tolist()
    assert fast.strings.values == slow.strings.values


def test_nvtx_texts_fall_back_for_text_ids():
    rows = [(59, "1", "a"), (59, "zz", "b"), (59, None, "c")]
    fast, slow = _nvtx_reader(rows), _nvtx_reader(rows)
    where = "WHERE eventType = 59"
    assert fast._nvtx_texts("NVTX_EVENTS", {"textId", "text"}, where).tolist() == \
        slow._nvtx_texts_by_rows("NVTX_EVENTS", {"textId", "text"}, where).tolist()


def _first_per_key_reference(pid, corr, prefer):
    order = np.lexsort((~prefer, corr, pid))
    p, c = pid[order], corr[order]
    first = np.ones(len(order), bool)
    first[1:] = (p[1:] != p[:-1]) | (c[1:] != c[:-1])
    return np.sort(order[first])


@pytest.mark.parametrize("seed", range(6))
def test_first_per_key_equals_reference(seed):
    rng = np.random.default_rng(seed)
    n = 500
    pid = rng.integers(0, 3, n) if seed != 5 else rng.integers(-1, 2 ** 30, n)
    corr = rng.permutation(n) if seed % 2 else rng.integers(0, 200, n)
    prefer = rng.random(n) < 0.7
    assert _first_per_key(pid, corr, prefer).tolist() == \
        _first_per_key_reference(pid, corr, prefer).tolist()


def test_name_masks_are_made_once_per_string_table():
    """names_matching keeps each pattern's mask (read-only) while the string table is the
    one it was made of; a table grown or replaced since gets a new one."""
    import re

    b = TraceBuilder()
    b.range("decode_step[0]", 0, 10)
    trace = b.build()
    pattern = re.compile(r"^decode_step\[")
    mask = trace.names_matching(pattern)
    assert mask is trace.names_matching(pattern) and not mask.flags.writeable
    trace.strings.append("decode_step[1]")
    grown = trace.names_matching(pattern)
    assert len(grown) == len(trace.strings) and grown[-1]
    trace.strings = list(trace.strings)
    assert trace.names_matching(pattern) is not grown


def test_gpu_work_without_a_correlation_joins_no_api_call():
    """A kernel or copy of no correlation (-1) is launched by no call, not by a call of no
    correlation either (a synchronize's row); one of a correlation finds its call."""
    from kimi_perf.launches import find_launches
    from kimi_perf.trace import ApiCalls

    api = ApiCalls(name=np.array([0, 1], np.int32), start=np.array([10, 20]),
                   end=np.array([15, 25]), pid=np.array([7, 7]), tid=np.array([70, 70]),
                   correlation=np.array([-1, 5]), kind=np.array([0, 0], np.int8))
    assert find_launches(api, np.array([7, 7]), np.array([-1, 5])).tolist() == [-1, 1]


def _api_calls(pids: list[int], correlations) -> ApiCalls:
    n = len(pids)
    return ApiCalls(name=np.zeros(n, np.int32), start=np.arange(n) * 10,
                    end=np.arange(n) * 10 + 5, pid=np.array(pids), tid=np.array(pids) * 10,
                    correlation=np.array(correlations), kind=np.zeros(n, np.int8))


def test_of_duplicate_correlations_the_first_call_launches():
    """Every correlation twice (old nsys exports' backtrace rows), over enough rows that an
    unstable sort would pick either: each kernel finds the first row of its correlation."""
    api = _api_calls([7] * 1000, np.r_[np.arange(500), np.arange(500)])
    assert find_launches(api, np.full(500, 7), np.arange(500)).tolist() == list(range(500))


def test_gpu_work_of_a_process_without_calls_joins_no_other_process_call():
    """Process 5's kernel (its API calls not recorded) never joins process 9's call of the
    same correlation; process 9's does."""
    api = _api_calls([9], [42])
    assert find_launches(api, np.array([5, 9]), np.array([42, 42])).tolist() == [-1, 0]


def test_correlation_ids_past_2_to_the_20_stay_apart():
    """Long traces count correlations into the millions and past 2^32: ids that agree in their
    low bits are still other calls."""
    ids = [5, 5 + 2**20, 5 + 2**32]
    found = find_launches(_api_calls([7, 7, 7], ids), np.array([7, 7, 7]), np.array(ids[::-1]))
    assert found.tolist() == [2, 1, 0]


def test_a_launch_call_that_outlasts_its_range_is_not_in_it():
    """nsys's rule: a range holds a kernel whose launch call lies wholly inside it."""
    b = TraceBuilder()
    b.range("fwd", 0, 100)
    b.launch("gemm", 95, 105, 1000, 1010)      # the call ends after the range does
    b.launch("gemm", 20, 30, 2000, 2030)
    rows = {(r.range, r.kernel): r.kernel_instances for r in range_kernel_summary(b.build())}
    assert rows == {("fwd", "gemm"): 1, (None, "gemm"): 1}


def test_range_kernel_rows_order_pid_0_as_nsys_orders_null():
    """nsys sorts a pid (or tid) of 0 as NULL: a lone kernel of pid 0 and one of no launch
    call tie there, and the one of more time comes first (``ranges`` keeps nsys's order)."""
    b = TraceBuilder()
    b.launch("long", 20, 30, 1000, 1900, pid=0, tid=0)
    b.kernels.append(dict(name=b.strings.code("short"), start=2000, end=2010, device=0,
                          stream=7, pid=3, correlation=999))    # no call of its correlation
    assert [r.kernel for r in range_kernel_summary(b.build())] == ["long", "short"]


def test_a_pid_and_tid_of_0_are_ids_not_none():
    b = TraceBuilder()
    b.range("fwd", 0, 100, pid=0, tid=0)
    b.launch("gemm", 20, 30, 1000, 1010, pid=0, tid=0)
    (row,) = range_kernel_summary(b.build())
    assert (row.range, row.pid, row.tid) == ("fwd", 0, 0)


def test_segment_figures_of_huge_spans_together_past_int64_fall_back():
    """Two segments each spanning most of int64, and a small one: their bands together pass
    what int64 holds, so each segment's busy time is taken alone, as the reference's."""
    start = np.array([-(2 ** 62), 0, 2 ** 61, -(2 ** 62), 2 ** 61, 5])
    end = np.array([-(2 ** 62) + 10, 10, 2 ** 61 + 3, -(2 ** 62) + 7, 2 ** 61 + 9, 8])
    labels = ["a"]
    classes = np.zeros(6, np.int32)
    segments = [np.arange(3), np.arange(3, 5), np.array([1, 5])]
    got = SegmentFigures.of(_ops(start, end, classes, labels), segments, classes,
                            labels).busy_ns.tolist()
    assert got == [_union_reference(start[s], end[s]) for s in segments] == [23, 16, 10]
