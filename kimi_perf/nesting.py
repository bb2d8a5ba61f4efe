"""Range nesting and interval containment: which ranges contain which points.

Ranges on one thread (or one GPU stream) form a forest when they nest properly, as push/pop
ranges always do. Start/end ranges may overlap without nesting; those go to extra *lanes*, each
of which is a proper forest. Within a lane, the ranges that contain an interval [s, e] are the
ancestors-or-self of the last range starting at or before s, from the innermost one that ends
at or after e: so one ``searchsorted`` and a short walk up the parents find them all, with no
per-event Python. (Siblings may touch: where one ends at s and the next starts there, a
zero-length [s, s] lies in both, so the ranges starting before s come from a second walk, up
from the last range starting before s.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kimi_perf.memory import release_free_memory
from kimi_perf.trace import GPU_RANGE, Ranges, index_dtype


def range_groups(ranges: Ranges) -> np.ndarray:
    """One int64 key per range: its thread (CPU ranges) or its GPU stream; -1 for neither."""
    gpu = ranges.style == GPU_RANGE
    cpu = ~gpu & (ranges.tid >= 0)
    if cpu.all():  # the common case, without gathering pid and tid first
        return _thread_key(ranges.pid, ranges.tid)
    keys = np.full(len(ranges), -1, np.int64)
    keys[cpu] = _thread_key(ranges.pid[cpu], ranges.tid[cpu])
    keys[gpu] = _stream_key(ranges.device[gpu], ranges.stream[gpu])
    return keys


def _thread_key(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """pid << 31 | tid where both fit (pid below 2^30, tid below 2^31: below 2^61), else a
    61-bit hash of the pair with bit 61 set: a key of each pair alone, whichever arrays it
    comes in (ranges, kernels), so that threads whose ids differ above those bits are never
    one (masked, tid 5 and 5 + 2^31 were); stream keys set bit 62."""
    # In place: one int64 temporary besides the result, for arrays of every range or kernel.
    key = pid.astype(np.int64)
    key &= 0x3FFFFFFF
    key <<= 31
    low = tid.astype(np.int64)
    low &= 0x7FFFFFFF
    key |= low
    wide = (pid < 0) | (pid > 0x3FFFFFFF) | (tid < 0) | (tid > 0x7FFFFFFF)
    if wide.any():
        key[wide] = _pair_hash(pid[wide], tid[wide])
    return key


def _pair_hash(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """splitmix64 of (pid, tid), its top 61 bits with bit 61 set (2^61 to 2^62 - 1)."""
    with np.errstate(over="ignore"):
        x = pid.astype(np.int64).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= tid.astype(np.int64).view(np.uint64)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x ^= x >> np.uint64(shift)
            x *= np.uint64(factor)
        x ^= x >> np.uint64(31)
    return ((x >> np.uint64(3)) | np.uint64(1 << 61)).view(np.int64)


def _stream_key(device: np.ndarray, stream: np.ndarray) -> np.ndarray:
    return (1 << 62) | (device.astype(np.int64) & 0xFFFF) << 40 | (stream.astype(np.int64)
                                                                     & 0xFFFFFFFFFF)


def thread_keys(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Group keys for points launched by CPU threads (matches ``range_groups``)."""
    keys = _thread_key(pid, tid)
    keys[(tid < 0) | (pid < 0)] = -2
    return keys


def nest_ranges(ranges: Ranges) -> None:
    """Fill ``depth``, ``parent`` and ``lane`` in place.

    Per group (thread or stream), in (start, -end) order, each range goes on top of the first
    lane whose open ranges, once those that ended before it started are closed, leave one that
    holds it on top (or none): a stack per lane. Ranges that all nest (push/pop ranges always
    do) take a vectorized route to the same result; the busy blocks that do not run that
    loop.
    """
    n = len(ranges)
    ranges.depth = np.zeros(n, np.int32)
    ranges.parent = np.full(n, -1, index_dtype(n))
    ranges.lane = np.zeros(n, np.int32)
    if n == 0:
        return
    index = index_dtype(n)
    groups = range_groups(ranges)
    if groups[0] >= 0 and (groups == groups[0]).all():
        # One thread holds every range (a common Kineto trace): no group key to sort by.
        del groups
        order = np.lexsort((-ranges.end, ranges.start)).astype(index)
        group_id = None
    else:
        order = np.lexsort((-ranges.end, ranges.start, groups)).astype(index)
        sorted_groups = groups[order]
        keep = sorted_groups >= 0
        order, sorted_groups = order[keep], sorted_groups[keep]
        del groups, keep  # the rare slow groups recompute theirs: the fast route needs memory
        # Dense group ids (0, 1, ...) along ``order``.
        new_group = np.r_[True, sorted_groups[1:] != sorted_groups[:-1]]
        del sorted_groups
        group_id = np.cumsum(new_group, dtype=index) - 1
        del new_group
    release_free_memory()   # the sort's temporaries, before the nesting's (see memory.py)
    slow = _nest_nested_groups(ranges, order, group_id)
    if len(slow):
        _nest_in_lanes(ranges, slow, range_groups(ranges))


# Pointer-jumping rounds before a group is left to the lane loop. A round costs little once few
# ranges are left; a range closing a chain of n open ranges needs up to about n rounds.
_MAX_ROUNDS = 1024


def _nest_nested_groups(ranges: Ranges, order: np.ndarray, group_id: np.ndarray | None
                        ) -> np.ndarray:
    """Nest the groups where every range fits one lane; return the rows (in ``order``) of the
    other groups, untouched. ``group_id``: each position's dense group id, None for one group
    (no array at all where one thread holds every range).

    In one lane, sorted by (start, -end), a range's parent is the nearest earlier range that
    ends no earlier than it (its previous greater-or-equal end). The lane loop agrees exactly
    when every range starts no earlier than its previous sibling ends: then placing it closes
    just the ranges above that parent. A group where that fails (partial overlaps) or where a
    range ends before it starts goes back to the loop.
    """
    m = len(order)
    if m == 0:
        return order
    index = index_dtype(m)        # positions in ``order``: int32 halves the temporaries
    # Times are read through ``order`` a chunk at a time, not copied in that order.
    start, end = ranges.start, ranges.end
    # Previous greater-or-equal end within the group, by pointer jumping: every range strictly
    # between ``cand[i]`` and i ends before i does, so a candidate that does too hands over its
    # own candidate.
    cand = np.arange(-1, m - 1, dtype=index)
    if group_id is not None:
        cand[np.r_[True, group_id[1:] != group_id[:-1]]] = -1
    pge = np.full(m, -1, index)
    todo = np.flatnonzero(cand >= 0).astype(index)
    for _ in range(_MAX_ROUNDS):
        if len(todo) == 0:
            break
        c = cand[todo]
        found = _compare_chunked(end, c, todo, through=order)
        pge[todo[found]] = c[found]
        todo, c = todo[~found], c[~found]
        cand[todo] = cand[c]
        todo = todo[cand[todo] >= 0]
    del cand
    bad = np.zeros(m, bool)
    bad[todo] = True               # still unresolved (very deep nesting): leave it to the loop
    bad |= (end < start)[order]
    # Siblings (same parent, or roots of one group) in order: each starts after the last ends.
    sibling_key = np.where(pge >= 0, pge, -1 if group_id is None else -1 - group_id)
    by_parent = np.argsort(sibling_key, kind="stable").astype(index)
    k = sibling_key[by_parent]
    del sibling_key
    overlap = k[1:] == k[:-1]
    del k
    overlap &= ~_compare_chunked(start, by_parent[1:], by_parent[:-1], end, through=order)
    bad[by_parent[1:][overlap]] = True
    del start, end, by_parent, overlap
    fast = None                    # None: every range nests
    if bad.any():
        fast = _outside_bad_blocks(ranges, order, group_id, bad)
        pge[~fast] = -1            # the loop's blocks: no parent or depth from here
    del bad
    # Parents, a chunk at a time; ``pge`` is then the depth's pointer, moved in place.
    for lo in range(0, m, _COMPARE_CHUNK):
        parent, rows = pge[lo:lo + _COMPARE_CHUNK], order[lo:lo + _COMPARE_CHUNK]
        if fast is not None:
            keep = fast[lo:lo + _COMPARE_CHUNK]
            parent, rows = parent[keep], rows[keep]
        ranges.parent[rows] = np.where(parent >= 0, order[np.maximum(parent, 0)], -1)
    # Depth by pointer doubling: ``up`` is an ancestor ``dist`` levels above.
    up = pge
    dist = (up >= 0).astype(np.int32)
    # A chunk at a time, in place: a jump that reads an ancestor already moved this round
    # lands higher, with its distance, which is as right.
    climbing = True
    while climbing:
        climbing = False
        for lo in range(0, m, _COMPARE_CHUNK):
            climb = np.flatnonzero(up[lo:lo + _COMPARE_CHUNK] >= 0) + lo
            if len(climb):
                climbing = True
                above = up[climb]
                dist[climb] += dist[above]
                up[climb] = up[above]
    del up, pge
    if fast is None:
        ranges.depth[order] = dist
        return order[:0]
    ranges.depth[order[fast]] = dist[fast]
    return order[~fast]


_COMPARE_CHUNK = 1 << 16


def _outside_bad_blocks(ranges: Ranges, order: np.ndarray, group_id: np.ndarray | None,
                        bad: np.ndarray) -> np.ndarray:
    """Which positions of ``order`` lie in no busy block that holds a ``bad`` one. A group's
    ranges, in (start, -end) order, split into busy blocks where a range starts after every
    earlier range of the group has ended: no range of one block holds one of another, and
    the lane loop, every lane closed there, places a block as if it were alone. So one range
    that overlaps its sibling in part (a child that ends a float's rounding after its
    parent) sends its block to the loop, not its whole thread."""
    m = len(order)
    fast = np.ones(m, bool)
    if group_id is None:
        spans = [(0, m)]
    else:   # (dense ids along ``order``: group g's first position is the g-th start)
        firsts = np.flatnonzero(np.r_[True, group_id[1:] != group_id[:-1]])
        lasts = np.r_[firsts[1:], m]
        held = np.unique(group_id[bad])
        spans = zip(firsts[held].tolist(), lasts[held].tolist(), strict=True)
    for lo, hi in spans:
        rows = order[lo:hi]
        start, end = ranges.start[rows], ranges.end[rows]
        # (a range that ends before it starts may nest under an earlier one: no block begins
        # where one to come ends by the reach of those before)
        low = np.minimum.accumulate(np.minimum(start, end)[::-1])[::-1]
        reach = np.maximum.accumulate(end)
        block = np.cumsum(np.r_[True, low[1:] > reach[:-1]])
        fast[lo:hi] = ~np.isin(block, block[bad[lo:hi]])
    return fast


def _compare_chunked(a: np.ndarray, i: np.ndarray, j: np.ndarray,
                     b: np.ndarray | None = None, through: np.ndarray | None = None
                     ) -> np.ndarray:
    """``a[through[i]] >= b[through[j]]`` (``b`` defaults to ``a``; no ``through``: ``a[i]``),
    gathering a chunk at a time: the full gathers would be two int64 copies of the largest
    arrays at once."""
    b = a if b is None else b
    out = np.empty(len(i), bool)
    for lo in range(0, len(i), _COMPARE_CHUNK):
        ii, jj = i[lo:lo + _COMPARE_CHUNK], j[lo:lo + _COMPARE_CHUNK]
        if through is not None:
            ii, jj = through[ii], through[jj]
        np.greater_equal(a[ii], b[jj], out=out[lo:lo + _COMPARE_CHUNK])
    return out


def _nest_in_lanes(ranges: Ranges, order: np.ndarray, groups: np.ndarray) -> None:
    """The lane loop over ``order`` (rows sorted by group, start, -end), its stacks of
    positions in ``order``: only those rows become Python values."""
    rows = order.tolist()
    starts = ranges.start[order].tolist()
    ends = ranges.end[order].tolist()
    group_list = groups[order].tolist()
    depth = ranges.depth
    parent = ranges.parent
    lane_of = ranges.lane
    current_group = None
    lanes: list[list[int]] = []
    for p, i in enumerate(rows):
        g = group_list[p]
        if g < 0:
            continue
        if g != current_group:
            current_group, lanes = g, []
        s, e = starts[p], ends[p]
        placed = False
        for lane_index, stack in enumerate(lanes):
            # Close ranges that ended before this one started (they cannot contain it).
            while stack and ends[stack[-1]] <= s and not (starts[stack[-1]] <= s
                                                          and e <= ends[stack[-1]]):
                stack.pop()
            if not placed and (not stack or e <= ends[stack[-1]]):
                parent[i] = rows[stack[-1]] if stack else -1
                depth[i] = len(stack)
                lane_of[i] = lane_index
                stack.append(p)
                placed = True
        if not placed:
            lane_of[i] = len(lanes)
            lanes.append([p])


def nearest_valid_ancestor(parent: np.ndarray, valid: np.ndarray, rows: np.ndarray
                           ) -> np.ndarray:
    """For ``rows``, each one's nearest proper ancestor with ``valid`` set (-1 for none).

    One level up per round, for the rows still below an excluded ancestor only: as many
    rounds as the longest run of excluded ancestors (nesting is shallow), and memory of the
    size of ``rows``, however many ranges the trace holds.
    """
    up = parent[rows].astype(index_dtype(len(parent)))
    todo = np.flatnonzero(up >= 0)
    todo = todo[~valid[up[todo]]]
    while len(todo):
        up[todo] = parent[up[todo]]
        todo = todo[up[todo] >= 0]
        todo = todo[~valid[up[todo]]]
    return up


def _same_start_or_none(pos: np.ndarray, starts: np.ndarray, start: np.ndarray) -> np.ndarray:
    """``pos`` where that range starts at ``start``, else -1 (``pos`` -1 stays -1)."""
    ok = pos >= 0
    ok[ok] = starts[pos[ok]] == start[ok]
    return np.where(ok, pos, -1)


def containing(ranges: Ranges, range_keys: np.ndarray, point_keys: np.ndarray,
               point_start: np.ndarray, point_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (range row, point row) pairs where the range contains the point's [start, end].

    Ranges and points match on their group keys (``range_groups`` / ``thread_keys`` /
    GPU-range keys); a range with key -1 is left out. Containment is closed:
    ``range.start <= start`` and ``end <= range.end``. Within a lane, a point's pair with a
    range comes after its pairs with the ranges inside that one.
    """
    chunks = list(containing_chunks(ranges, range_keys, point_keys, point_start, point_end))
    if not chunks:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    range_rows = np.concatenate([r for r, _, _ in chunks])
    point_rows = np.concatenate([p for _, p, _ in chunks])
    return range_rows, point_rows


def innermost_containing(ranges: Ranges, range_keys: np.ndarray, point_keys: np.ndarray,
                         point_start: np.ndarray, point_end: np.ndarray, rank: np.ndarray
                         ) -> np.ndarray:
    """Per point, the containing range (as ``containing`` pairs them) of highest ``rank``
    (``ranges.depth``: the innermost; ``ranges.start``: the latest), the first in pair order
    on a tie; -1 where none. Reduced chunk by chunk, never holding all the pairs."""
    owner = np.full(len(point_keys), -1, index_dtype(len(ranges)))
    for rows, points, _ in containing_chunks(ranges, range_keys, point_keys, point_start,
                                             point_end):
        order = np.lexsort((-rank[rows], points))
        points, rows = points[order], rows[order]
        first = np.r_[True, points[1:] != points[:-1]]
        owner[points[first]] = rows[first]
    return owner


NEVER = int(np.iinfo(np.int64).max)

# Points handled at once: bounds the temporaries (a dozen arrays of this length, and the
# points' pairs).
_POINT_CHUNK = 1 << 13


def containing_chunks(ranges: Ranges, range_keys: np.ndarray, point_keys: np.ndarray,
                      point_start: np.ndarray, point_end: np.ndarray
                      ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """``containing``'s pairs as a stream of (range rows, point rows, later end) chunks, for
    consumers that reduce them as they come instead of holding all pairs.

    Each chunk holds every pair of its points (with all lanes of their group), so that a
    consumer can also reduce over a point's ranges. ``later end`` is the earliest end of the
    points still to come that could share a range with this chunk's (``NEVER`` if none): a
    range that ends before it is in no later chunk.
    """
    valid = range_keys >= 0
    if not valid.any() or len(point_keys) == 0:
        return
    # Sort ranges by (group, lane, start, -end); each (group, lane) block is one proper forest.
    index = index_dtype(len(ranges))
    # Only the included ranges are sorted: steps and layers match a few of many ranges.
    if valid.all():
        order = np.lexsort((-ranges.end, ranges.start, ranges.lane, range_keys)).astype(index)
    else:
        order = np.flatnonzero(valid).astype(index)
        order = order[np.lexsort((-ranges.end[order], ranges.start[order],
                                  ranges.lane[order], range_keys[order]))]
    rk = range_keys[order]
    del range_keys  # the generator holds the only reference: free it for the chunks
    rl = ranges.lane[order]
    block_start = np.flatnonzero(np.r_[True, (rk[1:] != rk[:-1]) | (rl[1:] != rl[:-1])])
    block_end = np.r_[block_start[1:], len(order)]
    block_key = rk[block_start]
    del rk, rl
    # Local position of every range in the sorted order, to follow parents within it. An
    # excluded range (key -1) is not in that order: skip it to its nearest included ancestor.
    position = np.full(len(ranges), -1, index)
    position[order] = np.arange(len(order), dtype=index)
    parent = nearest_valid_ancestor(ranges.parent, valid, order)
    parent_pos = np.where(parent >= 0, position[np.maximum(parent, 0)], -1).astype(index)
    del valid, position, parent
    starts = ranges.start[order]
    ends = ranges.end   # read through ``order`` where used: a copy would be 8 bytes a range

    point_order = np.argsort(point_keys, kind="stable").astype(index_dtype(len(point_keys)))
    sorted_point_keys = point_keys[point_order]
    del point_keys
    release_free_memory()   # the sorts' temporaries, before the chunks (see memory.py)
    # A group's lanes are consecutive blocks; each chunk of its points meets all of them.
    group_start = np.flatnonzero(np.r_[True, block_key[1:] != block_key[:-1]])
    group_end = np.r_[group_start[1:], len(block_key)]
    for g_lo, g_hi in zip(group_start.tolist(), group_end.tolist(), strict=True):
        key = int(block_key[g_lo])
        p_lo, p_hi = np.searchsorted(sorted_point_keys, [key, key + 1]).tolist()
        if p_lo == p_hi:
            continue
        blocks = list(zip(block_start[g_lo:g_hi].tolist(), block_end[g_lo:g_hi].tolist(),
                          strict=True))
        chunk_lo = list(range(p_lo, p_hi, _POINT_CHUNK))
        # Earliest end among the points after each chunk (the group's others meet no range).
        chunk_min = np.minimum.reduceat(point_end[point_order[p_lo:p_hi]],
                                        np.array(chunk_lo) - p_lo)
        later = np.r_[np.minimum.accumulate(chunk_min[::-1])[::-1][1:], NEVER].tolist()
        for c_lo, later_end in zip(chunk_lo, later, strict=True):
            points = point_order[c_lo:min(c_lo + _POINT_CHUNK, p_hi)]
            ps, pe = point_start[points], point_end[points]
            pairs = [pair for lo, hi in blocks for pair in
                     _block_pairs(points, ps, pe, lo, hi, order, starts, ends, parent_pos)]
            if pairs:
                yield (np.concatenate([r for r, _ in pairs]),
                       np.concatenate([p for _, p in pairs]), later_end)


def _block_pairs(points: np.ndarray, ps: np.ndarray, pe: np.ndarray, lo: int, hi: int,
                 order: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 parent_pos: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The pairs of some points with the ranges of one block (sorted positions lo..hi).
    ``starts`` is by sorted position, ``ends`` by range row."""
    # The containers that start before a point are the ancestors (from the innermost one that
    # ends late enough) of the last range starting before it; those that start with it, of the
    # last range starting at or before it. The two differ only for a point where a range
    # begins: for a zero-length one, a range ending there holds it too.
    last_before = np.searchsorted(starts[lo:hi], ps, side="left") - 1 + lo
    last_at = np.searchsorted(starts[lo:hi], ps, side="right") - 1 + lo
    same = np.flatnonzero(last_at > last_before)
    for first, members, same_start in ((last_at[same], same, True),
                                       (last_before, np.arange(len(points)), False)):
        cur, p_start, p_end = first.copy(), ps[members], pe[members]
        # Up to the innermost container, moving only the points still outside their range.
        walk = np.flatnonzero(cur >= lo)
        while len(walk):
            c = cur[walk]
            outside = ends[order[c]] < p_end[walk]
            walk, c = walk[outside], parent_pos[c[outside]]
            if same_start:      # ranges that start before the point: the other pass's
                c = _same_start_or_none(c, starts, p_start[walk])
            cur[walk] = c
            walk = walk[c >= 0]
        # Every ancestor of the innermost container contains the point too.
        keep = cur >= lo
        cur, members, p_start = cur[keep], members[keep], p_start[keep]
        while len(cur):
            yield order[cur], points[members]
            cur = parent_pos[cur]
            if same_start:
                cur = _same_start_or_none(cur, starts, p_start)
            keep = cur >= 0
            cur, members, p_start = cur[keep], members[keep], p_start[keep]
