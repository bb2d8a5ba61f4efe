"""Kernel-to-range projection, exactly as NVIDIA's ``nsys stats`` report ``nvtx_kern_sum``.

A kernel belongs to every CPU range (push/pop or start/end, of any domain) on the thread that
launched it whose [start, end] contains the launching API call's [start, end]. Kernels in no
range are summarised under an empty range name, like nsys does. The one deliberate difference:
nsys joins kernels to *every* API row with the same correlation id, so old exports with
duplicate "backtrace" rows double-count kernel time; the reader drops those rows first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kimi_perf.nesting import containing, containing_chunks, range_groups, thread_keys
from kimi_perf.trace import GPU_RANGE, STYLE_NAMES, Trace


@dataclass
class RangeKernelRow:
    range: str | None
    style: str | None
    pid: int | None
    tid: int | None
    range_instances: int
    kernel_instances: int
    total_ns: int
    kernel: str


def kernel_launch_pairs(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(range row, kernel row) for every CPU range containing a kernel's launch call."""
    return containing(trace.ranges, *_launch_points(trace))


def _launch_points(trace: Trace) -> tuple[np.ndarray, ...]:
    """``containing``'s arguments after the ranges: CPU range keys, and per kernel its
    thread key and launch call's [start, end]."""
    k = trace.kernels
    launched = k.api >= 0
    api_row = np.where(launched, k.api, 0)
    starts = np.where(launched, trace.api.start[api_row] if len(trace.api) else 0, 0)
    ends = np.where(launched, trace.api.end[api_row] if len(trace.api) else 0, 0)
    keys = thread_keys(k.pid, np.where(launched, k.tid, -1))
    rkeys = range_groups(trace.ranges)
    rkeys[trace.ranges.style == GPU_RANGE] = -1
    return rkeys, keys, starts, ends


def range_kernel_summary(trace: Trace) -> list[RangeKernelRow]:
    """One row per (range name, style, pid, tid, kernel name), ordered as nsys orders them.

    Each (range, kernel) pair becomes one int64 key, (range group, kernel rank by name): sorted,
    those line the pairs up in (group, kernel name, kernel) order, so each output row is a run
    of keys. A second key, (range group, kernel name, range), counts the distinct ranges. The
    pairs are reduced to these keys as ``containing`` streams them.
    """
    k = trace.kernels
    r = trace.ranges
    n_k, n_r = len(k), len(r)
    if n_k == 0:
        return []
    ranks = _KernelRanks.of(k.name, k.end - k.start)
    n_names = ranks.n_names
    # Range groups over (name, style, pid, tid), numbered in that order.
    range_gid, range_fields = _group_ids((r.name, r.style, r.pid, r.tid))
    n_gid = len(range_fields[0])
    if n_gid * n_k >= 1 << 62 or n_gid * n_names * max(n_r, 1) >= 1 << 62:
        return _summary_by_lexsort(trace, *kernel_launch_pairs(trace))

    in_range = np.zeros(n_k, bool)
    pair_keys, range_keys = [], []
    for range_rows, kernel_rows in containing_chunks(r, *_launch_points(trace)):
        # A pair's pid and tid are its kernel's; groups take its range's. They agree unless
        # masked thread keys collided (ids beyond 30/31 bits): then take the general route.
        if ((r.pid[range_rows] != k.pid[kernel_rows]).any()
                or (r.tid[range_rows] != k.tid[kernel_rows]).any()):
            return _summary_by_lexsort(trace, *kernel_launch_pairs(trace))
        in_range[kernel_rows] = True
        gid = range_gid[range_rows]
        pair_keys.append(gid * n_k + ranks.rank[kernel_rows])
        range_keys.append((gid * n_names + ranks.name_id[kernel_rows]) * n_r + range_rows)

    # Kernels in no range form rows with an empty range name and style, grouped by the
    # launching thread (pid and tid -1 for a kernel without a launch call); they sort first.
    lone = np.flatnonzero(~in_range)
    launched = k.api[lone] >= 0
    lone_gid, lone_fields = _group_ids((np.where(launched, k.pid[lone], -1),
                                        np.where(launched, k.tid[lone], -1)))
    none = np.full(len(lone_fields[0]), -1)
    lone_groups = ranks.groups([lone_gid * n_k + ranks.rank[lone]])
    rows = _summary_rows(trace, lone_groups, [none, none, *lone_fields])
    del lone, launched, lone_gid, in_range
    groups = ranks.groups(pair_keys)
    groups.range_instances = _distinct_per_group(range_keys, n_r, groups.code)
    rows += _summary_rows(trace, groups, range_fields)
    return _nsys_order(rows)


def _group_ids(columns: tuple[np.ndarray, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Dense ids of the distinct rows of ``columns``, numbered in lexicographic order, and
    each id's values."""
    order = np.lexsort(columns[::-1])
    new = np.zeros(len(order), bool)
    new[:1] = True
    for c in columns:
        c = c[order]
        new[1:] |= c[1:] != c[:-1]
    ids = np.empty(len(order), np.int64)
    ids[order] = np.cumsum(new) - 1
    first = order[new]
    return ids, [c[first] for c in columns]


# Sorted keys are reduced in slices of this many: bounded temporaries.
_SLICE = 1 << 18


@dataclass
class _Groups:
    """Output rows in (group id, kernel name) order and their figures."""

    code: np.ndarray              # group id * n_names + kernel name id, ascending
    gid: np.ndarray
    kernel_name: np.ndarray       # string code
    total_ns: np.ndarray
    kernel_instances: np.ndarray
    range_instances: np.ndarray


@dataclass
class _KernelRanks:
    """Kernels ranked by (name, row), with dense name ids and durations by rank."""

    rank: np.ndarray              # per kernel row
    name_id: np.ndarray           # per kernel row: dense, in name-code order
    n_names: int
    name_by_rank: np.ndarray
    code_by_rank: np.ndarray
    duration_by_rank: np.ndarray

    @classmethod
    def of(cls, names: np.ndarray, duration: np.ndarray) -> _KernelRanks:
        n = len(names)
        by_name = np.argsort(names, kind="stable")
        rank = np.empty(n, np.int64)
        rank[by_name] = np.arange(n)
        code_by_rank = names[by_name]
        name_by_rank = np.cumsum(np.r_[True, code_by_rank[1:] != code_by_rank[:-1]]) - 1
        name_id = np.empty(n, np.int64)
        name_id[by_name] = name_by_rank
        return cls(rank=rank, name_id=name_id, n_names=int(name_by_rank[-1]) + 1 if n else 0,
                   name_by_rank=name_by_rank, code_by_rank=code_by_rank,
                   duration_by_rank=duration[by_name])

    def groups(self, parts: list[np.ndarray]) -> _Groups:
        """Reduce pair keys (group id * n kernels + kernel rank) to (group, kernel name) rows:
        total duration and distinct kernels of each."""
        key = np.concatenate(parts) if parts else np.empty(0, np.int64)
        parts.clear()
        key.sort()
        n_k = len(self.rank)
        starts, codes, gids, ranks, ns_before, kernels_before = [], [], [], [], [], []
        ns_total = kernels_total = 0
        prev_code = prev_key = -1
        for lo in range(0, len(key), _SLICE):
            sl = key[lo:lo + _SLICE]
            gid, rank = np.divmod(sl, n_k)
            code = gid * self.n_names + self.name_by_rank[rank]
            new_group = np.r_[code[0] != prev_code, code[1:] != code[:-1]]
            new_kernel = np.r_[sl[0] != prev_key, sl[1:] != sl[:-1]]
            ns = self.duration_by_rank[rank]
            ns_cum = np.cumsum(ns) + ns_total
            kernels_cum = np.cumsum(new_kernel) + kernels_total
            at = np.flatnonzero(new_group)
            starts.append(at + lo)
            codes.append(code[at])
            gids.append(gid[at])
            ranks.append(rank[at])
            # Running totals just before each group begins.
            ns_before.append(ns_cum[at] - ns[at])
            kernels_before.append(kernels_cum[at] - new_kernel[at])
            ns_total, kernels_total = int(ns_cum[-1]), int(kernels_cum[-1])
            prev_code, prev_key = int(code[-1]), int(sl[-1])
        cat = _concatenate
        first_rank = cat(ranks)
        return _Groups(code=cat(codes), gid=cat(gids), kernel_name=self.code_by_rank[first_rank],
                       total_ns=np.diff(np.r_[cat(ns_before), ns_total]),
                       kernel_instances=np.diff(np.r_[cat(kernels_before), kernels_total]),
                       range_instances=np.zeros(len(first_rank), np.int64))


def _distinct_per_group(parts: list[np.ndarray], n: int, group_codes: np.ndarray
                        ) -> np.ndarray:
    """How many distinct keys (group code * n + item) each group code has, for the sorted
    ``group_codes`` (every key's group among them)."""
    out = np.zeros(len(group_codes), np.int64)
    key = np.concatenate(parts) if parts else np.empty(0, np.int64)
    parts.clear()
    key.sort()
    codes, distinct_before = [], []
    distinct_total = 0
    prev_code = prev_key = -1
    for lo in range(0, len(key), _SLICE):
        sl = key[lo:lo + _SLICE]
        code = sl // n
        new_group = np.r_[code[0] != prev_code, code[1:] != code[:-1]]
        new_item = np.r_[sl[0] != prev_key, sl[1:] != sl[:-1]]
        cum = np.cumsum(new_item) + distinct_total
        at = np.flatnonzero(new_group)
        codes.append(code[at])
        distinct_before.append(cum[at] - new_item[at])
        distinct_total = int(cum[-1])
        prev_code, prev_key = int(code[-1]), int(sl[-1])
    if codes:
        out[np.searchsorted(group_codes, _concatenate(codes))] = np.diff(
            np.r_[_concatenate(distinct_before), distinct_total])
    return out


def _concatenate(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _summary_rows(trace: Trace, groups: _Groups, fields: list[np.ndarray]
                  ) -> list[RangeKernelRow]:
    strings = trace.strings
    columns = [c[groups.gid].tolist() for c in fields]
    rows = []
    for n, s, p, t, kn, ri, ki, total in zip(
            *columns, groups.kernel_name.tolist(), groups.range_instances.tolist(),
            groups.kernel_instances.tolist(), groups.total_ns.tolist(), strict=True):
        rows.append(RangeKernelRow(
            range=strings[n] if n >= 0 else None,
            style=STYLE_NAMES.get(s) if s >= 0 else None,
            pid=p if p >= 0 else None, tid=t if t >= 0 else None,
            range_instances=ri, kernel_instances=ki, total_ns=total, kernel=strings[kn]))
    return rows


def _nsys_order(rows: list[RangeKernelRow]) -> list[RangeKernelRow]:
    # nsys: ORDER BY range name (NULL first), pid, tid, total time descending.
    rows.sort(key=lambda row: (row.range is not None, row.range or "", row.pid or -1,
                               row.tid or -1, -row.total_ns, row.kernel))
    return rows


def _summary_by_lexsort(trace: Trace, range_rows: np.ndarray, kernel_rows: np.ndarray
                        ) -> list[RangeKernelRow]:
    """``range_kernel_summary`` with one lexsort over every (range, kernel) pair's columns:
    slower, no assumptions (the reference for the fast route)."""
    k = trace.kernels
    r = trace.ranges
    duration = k.end - k.start

    # Kernels in no range form rows with an empty range (range row -1).
    in_range = np.zeros(len(k), bool)
    in_range[kernel_rows] = True
    lone = np.flatnonzero(~in_range)
    all_ranges = np.concatenate([range_rows, np.full(len(lone), -1)])
    all_kernels = np.concatenate([kernel_rows, lone])

    has_range = all_ranges >= 0
    safe = np.maximum(all_ranges, 0)
    name = np.where(has_range, r.name[safe] if len(r) else -1, -1)
    style = np.where(has_range, r.style[safe] if len(r) else -1, -1)
    launched = k.api[all_kernels] >= 0
    pid = np.where(launched, k.pid[all_kernels], -1)
    tid = np.where(launched, k.tid[all_kernels], -1)
    kname = k.name[all_kernels]

    order = np.lexsort((all_kernels, all_ranges, kname, tid, pid, style, name))
    cols = [c[order] for c in (name, style, pid, tid, kname)]
    ranges_sorted, kernels_sorted = all_ranges[order], all_kernels[order]
    boundary = np.zeros(len(order), bool)
    if len(order):
        boundary[0] = True
    for c in cols:
        boundary[1:] |= c[1:] != c[:-1]
    group = np.cumsum(boundary) - 1
    n_groups = int(group[-1]) + 1 if len(group) else 0
    totals = np.bincount(group, weights=duration[kernels_sorted], minlength=n_groups)
    new_range = boundary.copy()
    new_range[1:] |= ranges_sorted[1:] != ranges_sorted[:-1]
    range_instances = np.bincount(group, weights=new_range & (ranges_sorted >= 0),
                                  minlength=n_groups)
    # Pairs are sorted by kernel within (group, range); count distinct kernels per group.
    ksort = np.lexsort((kernels_sorted, group))
    kg, kk = group[ksort], kernels_sorted[ksort]
    new_kernel = np.ones(len(ksort), bool)
    new_kernel[1:] = (kg[1:] != kg[:-1]) | (kk[1:] != kk[:-1])
    kernel_instances = np.bincount(kg, weights=new_kernel, minlength=n_groups)

    strings = trace.strings
    first = np.flatnonzero(boundary)
    rows = []
    for g, i in enumerate(first.tolist()):
        n, s, p, t, kn = (int(c[i]) for c in cols)
        rows.append(RangeKernelRow(
            range=strings[n] if n >= 0 else None,
            style=STYLE_NAMES.get(s) if s >= 0 else None,
            pid=p if p >= 0 else None, tid=t if t >= 0 else None,
            range_instances=int(range_instances[g]), kernel_instances=int(kernel_instances[g]),
            total_ns=int(totals[g]), kernel=strings[kn]))
    return _nsys_order(rows)
