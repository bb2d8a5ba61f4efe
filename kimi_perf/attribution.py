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

from kimi_perf.nesting import containing, range_groups, thread_keys
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
    k = trace.kernels
    launched = k.api >= 0
    api_row = np.where(launched, k.api, 0)
    starts = np.where(launched, trace.api.start[api_row] if len(trace.api) else 0, 0)
    ends = np.where(launched, trace.api.end[api_row] if len(trace.api) else 0, 0)
    keys = thread_keys(k.pid, np.where(launched, k.tid, -1))
    rkeys = range_groups(trace.ranges)
    rkeys[trace.ranges.style == GPU_RANGE] = -1
    return containing(trace.ranges, rkeys, keys, starts, ends)


def range_kernel_summary(trace: Trace) -> list[RangeKernelRow]:
    """One row per (range name, style, pid, tid, kernel name), ordered as nsys orders them."""
    k = trace.kernels
    r = trace.ranges
    range_rows, kernel_rows = kernel_launch_pairs(trace)
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
    # nsys: ORDER BY range name (NULL first), pid, tid, total time descending.
    rows.sort(key=lambda row: (row.range is not None, row.range or "", row.pid or -1,
                               row.tid or -1, -row.total_ns, row.kernel))
    return rows
