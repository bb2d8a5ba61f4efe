"""Kernels attributed to the ranges open at their launch, exactly as NVIDIA's ``nsys stats``
report ``nvtx_kern_sum`` does.

A kernel belongs to every CPU range (push/pop or start/end, of any domain) on the thread that
launched it whose [start, end] contains the launching API call's [start, end]. Kernels in no
range are summarised under an empty range name, like nsys does. Two deliberate differences,
both where nsys counts a kernel's time twice beside a count of one kernel: nsys joins kernels
to *every* API row with the same correlation id, so old exports with duplicate "backtrace"
rows double-count kernel time (the reader drops those rows first); and it sums a kernel's
time once per range that holds it, so ranges nested in ranges of the same name (a PyTorch op
calling itself, ``aten::sum`` in ``aten::sum``) count it once per level (here: once a row).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, fields

import numpy as np

from kimi_perf.memory import release_free_memory
from kimi_perf.nesting import containing, containing_chunks, range_groups, thread_keys
from kimi_perf.trace import GPU_RANGE, STYLE_NAMES, Trace, index_dtype


@dataclass
class RangeKernelRow:
    range: str | None
    style: str | None
    pid: int | None
    tid: int | None
    range_instances: int
    kernel_instances: int
    total_ns: int
    avg_ns: float
    min_ns: int
    max_ns: int
    stddev_ns: float     # the sample standard deviation (n - 1), as nsys's; 0 for one kernel
    kernel: str


@dataclass
class RangeKernelColumns:
    """``range_kernel_summary``'s rows as columns: string codes for the range and kernel
    names, -1 where a kernel is in no range (range, style) or has no launching thread (pid,
    tid). Columns, not a Python object per row: a trace whose every range has a name of its
    own (``emit_nvtx``'s ``aten::mm, op_id = N``) has millions of rows."""

    range: np.ndarray
    style: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    kernel: np.ndarray
    range_instances: np.ndarray
    kernel_instances: np.ndarray
    total_ns: np.ndarray
    avg_ns: np.ndarray       # float64, as stddev_ns
    min_ns: np.ndarray
    max_ns: np.ndarray
    stddev_ns: np.ndarray

    def __len__(self) -> int:
        return len(self.kernel)

    def taken(self, rows: np.ndarray) -> RangeKernelColumns:
        return RangeKernelColumns(*(getattr(self, f.name)[rows] for f in fields(self)))

    @classmethod
    def joined(cls, parts: list[RangeKernelColumns]) -> RangeKernelColumns:
        return cls(*(np.concatenate([np.empty(0, _FLOAT_FIELDS.get(f.name, np.int64))]
                                    + [getattr(p, f.name) for p in parts]
                                    ).astype(_FLOAT_FIELDS.get(f.name, np.int64))
                     for f in fields(cls)))


_FLOAT_FIELDS = {"avg_ns": np.float64, "stddev_ns": np.float64}


def kernel_launch_pairs(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(range row, kernel row) for every CPU range containing a kernel's launch call."""
    return containing(trace.ranges, *_launch_points(trace))


class _LaunchTimes:
    """A kernel's launch call start (or end) by kernel row, 0 for a kernel without one: read
    through the API table as indexed (``times[rows]``), never held for every kernel."""

    def __init__(self, trace: Trace, column: str):
        self.api_row = trace.kernels.api
        self.times = getattr(trace.api, column)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        api_row = self.api_row[rows]
        if not len(self.times):
            return np.zeros(len(api_row), np.int64)
        launched = api_row >= 0
        return np.where(launched, self.times[np.where(launched, api_row, 0)], 0)


def _launch_points(trace: Trace) -> tuple:
    """``containing``'s arguments after the ranges: CPU range keys, and per kernel its
    thread key and launch call's [start, end]."""
    k = trace.kernels
    keys = thread_keys(k.pid, np.where(k.api >= 0, k.tid, -1))
    rkeys = range_groups(trace.ranges)
    rkeys[trace.ranges.style == GPU_RANGE] = -1
    return rkeys, keys, _LaunchTimes(trace, "start"), _LaunchTimes(trace, "end")


def range_kernel_summary(trace: Trace) -> list[RangeKernelRow]:
    """One row per (range name, style, pid, tid, kernel name), ordered as nsys orders them
    (``range_kernel_columns`` in that order, as rows)."""
    if not isinstance(trace, Trace):
        raise TypeError(f"range_kernel_summary takes a Trace (read_trace(path)), not "
                        f"{type(trace).__name__}")
    columns = range_kernel_columns(trace)
    return _rows(trace, columns.taken(_nsys_order(trace, columns)))


def range_kernel_columns(trace: Trace) -> RangeKernelColumns:
    """One row per (range name, style, pid, tid, kernel name), as columns: the kernels in no
    range first, then the ranges' rows.

    Output rows are codes (range group, kernel name), numbered in that order. ``containing``
    streams the (range, kernel) pairs in chunks that hold every pair of their kernels; each
    chunk is reduced at once: its distinct (code, kernel) keys give each code's distinct
    kernels and the figures of their durations (a kernel inside two nested ranges of one
    group counts once; nsys sums its time once per range, twice, beside a count of one);
    its distinct (range, kernel name) keys count each code's ranges, once the range can come
    in no later chunk (until then the key is carried). Per-code figures and the keys of the
    few ranges that span chunks outlive a chunk, never all the pairs (so no median, which
    would need every duration of a code at once).
    """
    k = trace.kernels
    r = trace.ranges
    n_k, n_r = len(k), len(r)
    if n_k == 0:
        return RangeKernelColumns.joined([])
    kernel_names, name_id = np.unique(k.name, return_inverse=True)
    name_id = name_id.astype(index_dtype(n_k))
    n_names = len(kernel_names)
    # Range groups over (name, style, pid, tid), numbered in that order (int64 where used).
    range_gid, range_fields = _group_ids((r.name, r.style, r.pid, r.tid))
    n_gid = len(range_fields[0])
    range_gid = range_gid.astype(index_dtype(n_gid))
    if n_gid * n_names * n_k >= 1 << 62 or n_r * n_names >= 1 << 62:
        return _summary_by_lexsort(trace, *kernel_launch_pairs(trace))

    in_range = np.zeros(n_k, bool)
    stats, range_sums = [], []
    carried = np.empty(0, np.int64)    # (range, kernel name) keys of ranges still open
    for range_rows, kernel_rows, later_end in containing_chunks(r, *_launch_points(trace)):
        # A pair's pid and tid are its kernel's; groups take its range's. They agree unless
        # masked thread keys collided (ids beyond 30/31 bits): then take the general route.
        if ((r.pid[range_rows] != k.pid[kernel_rows]).any()
                or (r.tid[range_rows] != k.tid[kernel_rows]).any()):
            return _summary_by_lexsort(trace, *kernel_launch_pairs(trace))
        in_range[kernel_rows] = True
        names = name_id[kernel_rows]
        key = np.sort((range_gid[range_rows].astype(np.int64) * n_names + names) * n_k
                      + kernel_rows)
        code, kernel = np.divmod(_distinct(key), n_k)   # (sorted by code, as stats take)
        stats.append(_kernel_stats(code, k.end[kernel] - k.start[kernel]))
        if len(stats) == _MERGE_EVERY:   # (a code recurs in chunk after chunk: held once)
            stats = [_merged_stats(stats)]
        del key, code, kernel
        key = _distinct(np.concatenate([carried, range_rows * n_names + names]))
        done = r.end[key // n_names] < later_end
        range_sums.append(_range_counts(key[done], range_gid, n_names))
        carried = key[~done]
        del names, key, done
    range_sums.append(_range_counts(carried, range_gid, n_names))
    del carried

    # Kernels in no range form rows with an empty range name and style, grouped by the
    # launching thread (pid and tid -1 for a kernel without a launch call); they sort first.
    lone = np.flatnonzero(~in_range)
    launched = k.api[lone] >= 0
    lone_gid, lone_fields = _group_ids((np.where(launched, k.pid[lone], -1),
                                        np.where(launched, k.tid[lone], -1)))
    lone_code = lone_gid * n_names + name_id[lone]
    by_code = np.argsort(lone_code, kind="stable")
    lone_groups = _groups(_kernel_stats(lone_code[by_code], (k.end - k.start)[lone[by_code]]),
                          n_names, kernel_names)
    none = np.full(len(lone_fields[0]), -1)
    alone = _columns(lone_groups, [none, none, *lone_fields])
    del lone, launched, lone_gid, lone_code, by_code, in_range, name_id

    groups = _groups(_merged_stats(stats), n_names, kernel_names)
    code, ranges = _merge_sums(range_sums, 1)
    groups.range_instances[np.searchsorted(groups.code, code)] = ranges
    del range_gid
    release_free_memory()   # the chunks' memory: see memory.py
    return RangeKernelColumns.joined([alone, _columns(groups, range_fields)])


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


# (codes ascending, then per code the sum of each of some columns)
_Sums = tuple[np.ndarray, ...]


def _sums_by_code(code: np.ndarray, *columns: np.ndarray) -> _Sums:
    """Exact int64 sums of each column per run of equal, ascending ``code``."""
    if len(code) == 0:
        return (np.empty(0, np.int64),) * (1 + len(columns))
    first = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    return (code[first], *(np.add.reduceat(c.astype(np.int64, copy=False), first)
                           for c in columns))


def _merge_sums(parts: list[_Sums], n_columns: int) -> _Sums:
    """Several chunks' ``_sums_by_code`` (of the same columns) as one: a code may recur."""
    if not parts:
        return (np.empty(0, np.int64),) * (1 + n_columns)
    code, *columns = (np.concatenate(column) for column in zip(*parts, strict=True))
    parts.clear()
    order = np.argsort(code, kind="stable")
    return _sums_by_code(code[order], *(c[order] for c in columns))


def _range_counts(keys: np.ndarray, range_gid: np.ndarray, n_names: int) -> _Sums:
    """Ranges per code, from distinct (range row * n_names + kernel name) keys."""
    code = np.sort(range_gid[keys // n_names].astype(np.int64) * n_names + keys % n_names)
    return _sums_by_code(code, np.ones(len(code), np.int64))


# chunks' figures held apart before they are merged into one
_MERGE_EVERY = 16


@dataclass
class _KernelStats:
    """Per code (ascending), of its distinct kernels: the count and the figures of their
    durations, as nsys's nvtx_kern_sum reports them (``spread``: the sum of squared
    deviations from the mean, which chunks merge exactly; ``stddev`` is the sample one)."""

    code: np.ndarray
    count: np.ndarray
    total: np.ndarray
    min: np.ndarray
    max: np.ndarray
    spread: np.ndarray

    @property
    def avg(self) -> np.ndarray:
        return self.total / np.maximum(self.count, 1)

    @property
    def stddev(self) -> np.ndarray:   # (n - 1, as nsys's; 0 for one kernel)
        return np.sqrt(self.spread / np.maximum(self.count - 1, 1))


def _kernel_stats(code: np.ndarray, duration: np.ndarray) -> _KernelStats:
    """The figures of each run of equal, ascending ``code`` (a duration per kernel)."""
    if len(code) == 0:
        empty_i = np.empty(0, np.int64)
        return _KernelStats(empty_i, empty_i, empty_i, empty_i, empty_i, np.empty(0))
    duration = duration.astype(np.int64, copy=False)
    first = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    count = np.diff(np.r_[first, len(code)])
    total = np.add.reduceat(duration, first)
    # (about each run's mean: no cancellation, as a sum of squares would have)
    spread = np.add.reduceat((duration - np.repeat(total / count, count)) ** 2, first)
    return _KernelStats(code[first].astype(np.int64), count, total,
                        np.minimum.reduceat(duration, first),
                        np.maximum.reduceat(duration, first), spread)


def _merged_stats(parts: list[_KernelStats]) -> _KernelStats:
    """Several chunks' figures as one (a code may recur): counts, sums and ends add up or
    reduce; spreads merge as Chan et al. merge them, each part's about its own mean plus
    its count times its mean's squared distance from the whole's."""
    code, count, total, low, high, spread = (
        np.concatenate([np.empty(0, np.int64), *(getattr(p, f) for p in parts)])
        for f in ("code", "count", "total", "min", "max", "spread"))
    parts.clear()
    if not len(code):
        return _kernel_stats(code, code)
    order = np.argsort(code, kind="stable")
    code, count, total, low, high, spread = (c[order] for c in (code, count, total, low, high,
                                                                 spread))
    first = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    whole_count = np.add.reduceat(count, first)
    whole_total = np.add.reduceat(total, first)
    whole_mean = np.repeat(whole_total / whole_count, np.diff(np.r_[first, len(code)]))
    spread = np.add.reduceat(spread + count * (total / count - whole_mean) ** 2, first)
    return _KernelStats(code[first], whole_count, whole_total, np.minimum.reduceat(low, first),
                        np.maximum.reduceat(high, first), spread)


@dataclass
class _Groups:
    """Output rows in (group id, kernel name) order and their figures."""

    code: np.ndarray              # group id * n_names + kernel name id, ascending
    gid: np.ndarray
    kernel_name: np.ndarray       # string code
    stats: _KernelStats
    range_instances: np.ndarray


def _groups(stats: _KernelStats, n_names: int, kernel_names: np.ndarray) -> _Groups:
    gid, name = np.divmod(stats.code, n_names)
    return _Groups(code=stats.code, gid=gid, kernel_name=kernel_names[name], stats=stats,
                   range_instances=np.zeros(len(stats.code), np.int64))


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, ascending (``np.unique`` hashes integers first: much slower)."""
    values = np.sort(values)
    return values[np.r_[True, values[1:] != values[:-1]]] if len(values) else values


def _columns(groups: _Groups, group_fields: list[np.ndarray]) -> RangeKernelColumns:
    """The groups' rows: their (range name, style, pid, tid) fields and figures."""
    st = groups.stats
    return RangeKernelColumns(*(c[groups.gid] for c in group_fields), groups.kernel_name,
                              groups.range_instances, st.count, st.total, st.avg, st.min,
                              st.max, st.stddev)


def _rows(trace: Trace, columns: RangeKernelColumns) -> list[RangeKernelRow]:
    strings = trace.strings
    rows = []
    collecting = gc.isenabled()
    gc.disable()     # (a row is no cycle: the collector's passes over millions are waste)
    try:
        for n, s, p, t, kn, ri, ki, total, avg, low, high, sd in zip(
                *(getattr(columns, f.name).tolist() for f in fields(columns)), strict=True):
            rows.append(RangeKernelRow(
                range=strings[n] if n >= 0 else None,
                style=STYLE_NAMES.get(s) if s >= 0 else None,
                pid=p if p >= 0 else None, tid=t if t >= 0 else None,
                range_instances=ri, kernel_instances=ki, total_ns=total, avg_ns=avg,
                min_ns=low, max_ns=high, stddev_ns=sd, kernel=strings[kn]))
    finally:
        if collecting:
            gc.enable()
    return rows


def _string_rank(trace: Trace, codes: np.ndarray) -> np.ndarray:
    """Each code's place among the codes' strings in Python's order (-1 stays -1)."""
    present = np.unique(codes[codes >= 0])
    by_text = sorted(range(len(present)), key=lambda i: trace.strings[present[i]])
    rank = np.empty(len(present), np.int64)
    rank[by_text] = np.arange(len(present))
    return np.where(codes >= 0, rank[np.searchsorted(present, np.maximum(codes, 0))]
                    if len(present) else -1, -1)


def _nsys_order(trace: Trace, columns: RangeKernelColumns) -> np.ndarray:
    """Rows in nsys's order: by range name (NULL first), pid, tid (NULL, or 0, as -1), total
    time descending, kernel name; equal rows as they came."""
    c = columns
    return np.lexsort((_string_rank(trace, c.kernel), -c.total_ns,
                       np.where(c.tid == 0, -1, c.tid), np.where(c.pid == 0, -1, c.pid),
                       _string_rank(trace, c.range), c.range >= 0))


def _summary_by_lexsort(trace: Trace, range_rows: np.ndarray, kernel_rows: np.ndarray
                        ) -> RangeKernelColumns:
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
    new_range = boundary.copy()
    new_range[1:] |= ranges_sorted[1:] != ranges_sorted[:-1]
    range_instances = np.bincount(group, weights=new_range & (ranges_sorted >= 0),
                                  minlength=n_groups)
    # Pairs are sorted by kernel within (group, range); count distinct kernels per group.
    ksort = np.lexsort((kernels_sorted, group))
    kg, kk = group[ksort], kernels_sorted[ksort]
    new_kernel = np.ones(len(ksort), bool)
    new_kernel[1:] = (kg[1:] != kg[:-1]) | (kk[1:] != kk[:-1])
    st = _kernel_stats(kg[new_kernel], duration[kk[new_kernel]])

    first = np.flatnonzero(boundary)
    return RangeKernelColumns(*(c[first] for c in cols), range_instances.astype(np.int64),
                              st.count, st.total, st.avg, st.min, st.max, st.stddev)
