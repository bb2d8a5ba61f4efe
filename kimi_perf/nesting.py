"""Range nesting and interval containment: which ranges contain which points.

Ranges on one thread (or one GPU stream) form a forest when they nest properly, as push/pop
ranges always do. Start/end ranges may overlap without nesting; those go to extra *lanes*, each
of which is a proper forest. Within a lane, the ranges that contain an interval [s, e] are the
ancestors-or-self of the last range starting at or before s, from the innermost one that ends
at or after e: so one ``searchsorted`` and a short walk up the parents find them all, with no
per-event Python.
"""

from __future__ import annotations

import numpy as np

from kimi_perf.trace import GPU_RANGE, Ranges


def range_groups(ranges: Ranges) -> np.ndarray:
    """One int64 key per range: its thread (CPU ranges) or its GPU stream; -1 for neither."""
    gpu = ranges.style == GPU_RANGE
    keys = np.full(len(ranges), -1, np.int64)
    cpu = ~gpu & (ranges.tid >= 0)
    keys[cpu] = _thread_key(ranges.pid[cpu], ranges.tid[cpu])
    keys[gpu] = _stream_key(ranges.device[gpu], ranges.stream[gpu])
    return keys


def _thread_key(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    return (pid.astype(np.int64) & 0x3FFFFFFF) << 31 | (tid.astype(np.int64) & 0x7FFFFFFF)


def _stream_key(device: np.ndarray, stream: np.ndarray) -> np.ndarray:
    return (1 << 62) | (device.astype(np.int64) & 0xFFFF) << 40 | (stream.astype(np.int64)
                                                                     & 0xFFFFFFFFFF)


def thread_keys(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Group keys for points launched by CPU threads (matches ``range_groups``)."""
    keys = _thread_key(pid, tid)
    keys[(tid < 0) | (pid < 0)] = -2
    return keys


def stream_keys(device: np.ndarray, stream: np.ndarray) -> np.ndarray:
    """Group keys for points on GPU streams (matches GPU ranges in ``range_groups``)."""
    return _stream_key(device, stream)


def nest_ranges(ranges: Ranges) -> None:
    """Fill ``depth``, ``parent`` and ``lane`` in place."""
    n = len(ranges)
    ranges.depth = np.zeros(n, np.int32)
    ranges.parent = np.full(n, -1, np.int64)
    ranges.lane = np.zeros(n, np.int32)
    if n == 0:
        return
    groups = range_groups(ranges)
    order = np.lexsort((-ranges.end, ranges.start, groups))
    starts = ranges.start.tolist()
    ends = ranges.end.tolist()
    group_list = groups.tolist()
    depth = ranges.depth
    parent = ranges.parent
    lane_of = ranges.lane
    current_group = None
    lanes: list[list[int]] = []
    for i in order.tolist():
        g = group_list[i]
        if g < 0:
            continue
        if g != current_group:
            current_group, lanes = g, []
        s, e = starts[i], ends[i]
        placed = False
        for lane_index, stack in enumerate(lanes):
            # Close ranges that ended before this one started (they cannot contain it).
            while stack and ends[stack[-1]] <= s and not (starts[stack[-1]] <= s
                                                          and e <= ends[stack[-1]]):
                stack.pop()
            if not placed and (not stack or e <= ends[stack[-1]]):
                parent[i] = stack[-1] if stack else -1
                depth[i] = len(stack)
                lane_of[i] = lane_index
                stack.append(i)
                placed = True
        if not placed:
            lane_of[i] = len(lanes)
            lanes.append([i])


def containing(ranges: Ranges, range_keys: np.ndarray, point_keys: np.ndarray,
               point_start: np.ndarray, point_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (range row, point row) pairs where the range contains the point's [start, end].

    Ranges and points match on their group keys (``range_groups`` / ``thread_keys`` /
    ``stream_keys``). Containment is closed: ``range.start <= start`` and ``end <= range.end``.
    """
    out_r: list[np.ndarray] = []
    out_p: list[np.ndarray] = []
    valid = range_keys >= 0
    if not valid.any() or len(point_keys) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    # Sort ranges by (group, lane, start, -end); each (group, lane) block is one proper forest.
    lane_key = range_keys * 0 + ranges.lane
    order = np.lexsort((-ranges.end, ranges.start, lane_key, range_keys))
    order = order[valid[order]]
    rk = range_keys[order]
    rl = ranges.lane[order]
    block_start = np.flatnonzero(np.r_[True, (rk[1:] != rk[:-1]) | (rl[1:] != rl[:-1])])
    block_end = np.r_[block_start[1:], len(order)]
    # Local position of every range in the sorted order, to follow parents within it.
    position = np.full(len(ranges), -1, np.int64)
    position[order] = np.arange(len(order))
    parent_pos = np.where(ranges.parent[order] >= 0, position[ranges.parent[order]], -1)
    starts = ranges.start[order]
    ends = ranges.end[order]

    point_order = np.argsort(point_keys, kind="stable")
    sorted_point_keys = point_keys[point_order]
    for lo, hi in zip(block_start.tolist(), block_end.tolist(), strict=True):
        key = rk[lo]
        p_lo, p_hi = np.searchsorted(sorted_point_keys, [key, key + 1])
        if p_lo == p_hi:
            continue
        points = point_order[p_lo:p_hi]
        ps, pe = point_start[points], point_end[points]
        cur = np.searchsorted(starts[lo:hi], ps, side="right") - 1
        cur = np.where(cur >= 0, cur + lo, -1)
        # Walk up from the last range that started before the point to the innermost container.
        while True:
            open_ = cur >= 0
            outside = open_ & (ends[np.maximum(cur, 0)] < pe)
            if not outside.any():
                break
            cur[outside] = parent_pos[cur[outside]]
        # Every ancestor of the innermost container contains the point too.
        while (alive := cur >= 0).any():
            out_r.append(order[cur[alive]])
            out_p.append(points[alive])
            cur = np.where(alive, parent_pos[np.maximum(cur, 0)], -1)
    if not out_r:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(out_r), np.concatenate(out_p)
