"""Graph replays back to their capture: which API call put each replayed kernel into its graph.

Profiler ranges do not survive CUDA/HIP graph replay: every kernel of a replayed step shares
the one graph launch, which lies in the step's range but in no layer's. The capture, though,
ran on a CPU thread inside the ranges open then (``layer[3](kda)``, vLLM's piecewise
``## Call CompiledFxGraph ##``), and each kernel launch it made became a node instead of
running. Mapping a replayed kernel to the launch call that captured it lets range-based
analyses (per-layer attribution) place it as if it had been launched eagerly there.

The mapping is by order. On a thread, a run of consecutive kernel launches that ran nothing
(no kernel joined to them), broken by any launch that did run and by ``*StreamBeginCapture``,
is one capture. A graph launch takes the latest capture of its process, ended before it, that
made exactly as many launches as its replay ran kernels (a piecewise graph skips the captures
of other pieces): the i-th kernel to start maps to the i-th launch.
Kernels on parallel branches of a graph may start in another order than they were captured,
but not across a join, so the layer a kernel lands in holds whenever layers end in a join.
Captures the trace does not hold (profiling began after them) map nothing. A profile of the
capture saved apart from the replay's (vLLM profiles its graph capture at start-up into files
of its own) joins the replay's trace first: ``with_capture``.

A graph's memcpy and memset nodes (``cudaMemcpyAsync`` of a ``copy_``, ``cudaMemsetAsync``)
map the same way once its kernels have: the memory calls that ran nothing on the capturing
thread, between the capture's ``*StreamBeginCapture`` and ``*StreamEndCapture`` (or, where the
trace lacks them, between its first and last kernel launch), the i-th to start to the i-th
call, where their counts agree.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kimi_perf.errors import TraceError, argument
from kimi_perf.nesting import nest_ranges
from kimi_perf.trace import TABLES, Trace

GRAPH_LAUNCH = re.compile(r"^(cuda|hip|cu)GraphLaunch")
KERNEL_LAUNCH = re.compile(r"^(?:cuda|hip|cu)\w*Launch\w*Kernel")
BEGIN_CAPTURE = re.compile(r"^(?:cuda|hip|cu)StreamBeginCapture")
END_CAPTURE = re.compile(r"^(?:cuda|hip|cu)StreamEndCapture")
MEMORY_CALL = re.compile(r"^(?:cuda|hip|cu)Mem(?:cpy|set)\w*Async")


def capture_launches(trace: Trace) -> np.ndarray:
    """Per kernel, the row in ``trace.api`` of the launch that captured it into its graph,
    or -1 (not replayed from a graph, or its capture is not in the trace)."""
    k, api = trace.kernels, trace.api
    out = np.full(len(k), -1, np.int64)
    if len(k) == 0 or len(api) == 0:
        return out
    from_graph = _graph_kernels(trace)
    if len(from_graph) == 0:
        return out
    runs = _captures(trace)
    if not runs:
        return out
    flat = np.concatenate(runs)
    run_len = np.array([len(r) for r in runs], np.int64)
    run_first = np.r_[0, np.cumsum(run_len)[:-1]]
    run_pid = api.pid[flat[run_first]].astype(np.int64)
    run_end = api.end[flat[run_first + run_len - 1]]
    # Replayed kernels grouped by graph launch, each group in GPU start order.
    order = from_graph[np.lexsort((k.start[from_graph], k.api[from_graph]))]
    graph_of = k.api[order]
    cuts = np.flatnonzero(np.r_[True, graph_of[1:] != graph_of[:-1], True])
    lo, size = cuts[:-1], np.diff(cuts)
    launch = graph_of[lo]
    fit = _latest_captures(run_pid, run_end, run_len, api.pid[launch].astype(np.int64),
                           api.start[launch], size)
    # Kernel i of a launch is launch call i of its capture.
    matched = np.repeat(fit, size)
    within = np.arange(len(order)) - np.repeat(lo, size)
    keep = matched >= 0
    out[order[keep]] = flat[run_first[matched[keep]] + within[keep]]
    return out


def _latest_captures(run_pid: np.ndarray, run_end: np.ndarray, run_len: np.ndarray,
                     launch_pid: np.ndarray, launch_start: np.ndarray, size: np.ndarray
                     ) -> np.ndarray:
    """Per graph launch, its capture (a run's index, or -1): the latest run of its process
    that ended before it and launched as many kernels as it ran (the first of equals). For
    every launch at once: runs sorted by kind (process, length) and end, each launch's (kind,
    start) placed among them (vLLM's piecewise graphs: thousands of captures, hundreds of
    thousands of launches)."""
    pids = np.unique(np.r_[run_pid, launch_pid])
    span = int(max(run_len.max(), size.max())) + 1
    kinds, kind = np.unique(np.searchsorted(pids, run_pid) * span + run_len,
                            return_inverse=True)
    wanted = np.searchsorted(pids, launch_pid) * span + size
    at = np.minimum(np.searchsorted(kinds, wanted), len(kinds) - 1)
    ends = np.unique(run_end)
    key = kind.ravel() * (len(ends) + 1) + np.searchsorted(ends, run_end) + 1
    by_key = np.argsort(key, kind="stable")
    sorted_key = key[by_key]
    query = at * (len(ends) + 1) + np.searchsorted(ends, launch_start, side="right")
    pos = np.searchsorted(sorted_key, query, side="right") - 1
    found = (kinds[at] == wanted) & (pos >= 0)
    pos = np.maximum(pos, 0)
    found &= sorted_key[pos] // (len(ends) + 1) == at        # (not a run of a lesser kind)
    first = np.searchsorted(sorted_key, sorted_key[pos], side="left")
    return np.where(found, by_key[first], -1)


def with_capture(replay: Trace, capture: Trace, replay_file: str | Path | None = None,
                 capture_file: str | Path | None = None) -> Trace:
    """``replay`` joined by ``capture``, a profile of the same process, on the same clock,
    that recorded the graph captures ``replay`` launches: their launch calls and the ranges
    open around them then, which place the replayed kernels (the capture's own kernels, the
    warm-up runs before it, come along and fall outside the replay's steps). A replay joined
    already may be joined again, by captures of other graphs; ``meta["captures"]`` lists the
    files. ``TraceError`` (naming the file) where the pair cannot be joined: ``replay``
    launches no graph, ``capture`` records none or holds the same API calls as ``replay``
    (the same profile twice), or no capture in it matches a graph launch of ``replay`` that
    earlier captures left unmatched. The files named are ``replay_file`` and
    ``capture_file``, by default the traces' own."""
    replay_file = replay_file if replay_file is not None else replay.meta.get("file")
    capture_file = capture_file if capture_file is not None else capture.meta.get("file")
    if not len(_graph_kernels(replay)):
        swapped = (" but records graph captures: the capture, given as the trace? (the "
                   f"trace is the replay, {argument('--capture', 'capture')} its capture)"
                   if _captures(replay) else
                   ": there is no graph replay for a capture to place")
        raise TraceError(replay_file, "runs no kernel from a graph launch" + swapped)
    if not _captures(capture):
        raise TraceError(capture_file, "records no graph capture (no kernel launch in it that "
                                       "ran nothing)")
    if (pid := _same_calls(replay, capture)) is not None:
        raise TraceError(capture_file, f"holds the same API calls as "
                                       f"{Path(str(replay_file)).name} (process {pid}): the "
                                       "same profile twice, not a capture profiled apart")
    joined = replay.joined(capture)
    nest_ranges(joined.ranges)
    mapped_before = int((capture_launches(replay) >= 0).sum()) if _captures(replay) else 0
    if int((capture_launches(joined) >= 0).sum()) <= mapped_before:
        raise TraceError(capture_file, "no graph capture in it matches a graph launch of "
                                       f"{Path(str(replay_file)).name} (one of the same "
                                       "process, ended before the launch, that launched as "
                                       "many kernels as the replay ran)")
    joined.meta["captures"] = [*replay.meta.get("captures", []), str(capture_file)]
    if capture.meta.get("source_identity") is not None:   # (a directory reads it once)
        joined.meta["capture_identities"] = [*replay.meta.get("capture_identities", []),
                                             capture.meta["source_identity"]]
    # the replay's own rows come first in each table: what info tells apart
    joined.meta["replay_rows"] = replay.meta.get("replay_rows") or {
        name: len(getattr(replay, name)) for name in TABLES}
    return joined


def graph_replays(trace: Trace, api: np.ndarray, scope_api: np.ndarray) -> dict[str, int]:
    """Of the ops a breakdown counts (their launch rows ``api``, and ``scope_api``: where
    ranges are looked up for them, the capturing call for a replayed op that maps to one):
    how many a graph launch ran (``ops``) and how many of those map to their capture
    (``placed_at_capture``)."""
    launched = api >= 0
    replayed = np.zeros(len(api), bool)
    replayed[launched] = trace.names_matching(GRAPH_LAUNCH)[trace.api.name[api[launched]]]
    return {"ops": int(replayed.sum()),
            "placed_at_capture": int((replayed & (scope_api != api)).sum())}


def _graph_kernels(trace: Trace) -> np.ndarray:
    """The kernels run by a graph launch (rows)."""
    k = trace.kernels
    launched = np.flatnonzero(k.api >= 0)
    return launched[trace.names_matching(GRAPH_LAUNCH)[trace.api.name[k.api[launched]]]]


def _same_calls(a: Trace, b: Trace) -> int | None:
    """The process of an API call both traces hold (one thread, one start), if any."""
    common = np.intersect1d(a.api.start, b.api.start)
    if not len(common):
        return None
    rows = np.flatnonzero(np.isin(a.api.start, common))
    held = set(zip(a.api.pid[rows].tolist(), a.api.tid[rows].tolist(),
                   a.api.start[rows].tolist(), strict=True))
    rows = np.flatnonzero(np.isin(b.api.start, common))
    for call in zip(b.api.pid[rows].tolist(), b.api.tid[rows].tolist(),
                    b.api.start[rows].tolist(), strict=True):
        if call in held:
            return call[0]
    return None


def capture_memory_calls(trace: Trace, kernel_captures: np.ndarray) -> np.ndarray:
    """Per memop, the row in ``trace.api`` of the memory call that captured it into its graph,
    or -1; ``kernel_captures``: ``capture_launches(trace)``."""
    m, k, api = trace.memops, trace.kernels, trace.api
    out = np.full(len(m), -1, np.int64)
    if len(m) == 0 or not (kernel_captures >= 0).any():
        return out
    is_graph = trace.names_matching(GRAPH_LAUNCH)[api.name]
    launched = np.flatnonzero(m.api >= 0)
    from_graph = launched[is_graph[m.api[launched]]]
    if len(from_graph) == 0:
        return out
    ran = _calls_that_ran(trace)
    calls = _by_thread(trace, np.flatnonzero(trace.names_matching(MEMORY_CALL)[api.name]
                                             & ~ran))
    begins = _by_thread(trace, np.flatnonzero(trace.names_matching(BEGIN_CAPTURE)[api.name]))
    ends = _by_thread(trace, np.flatnonzero(trace.names_matching(END_CAPTURE)[api.name]))
    # Per graph launch, the capture its kernels mapped to: its first and last launch rows.
    mapped = np.flatnonzero(kernel_captures >= 0)
    graph_of, rows = k.api[mapped], kernel_captures[mapped]
    by_start = np.lexsort((api.start[rows], graph_of))
    graph_of, rows = graph_of[by_start], rows[by_start]
    heads = np.flatnonzero(np.r_[True, graph_of[1:] != graph_of[:-1]])
    tails = np.r_[heads[1:], len(rows)] - 1
    first = dict(zip(graph_of[heads].tolist(), rows[heads].tolist(), strict=True))
    last = dict(zip(graph_of[heads].tolist(), rows[tails].tolist(), strict=True))
    order = from_graph[np.lexsort((m.start[from_graph], m.api[from_graph]))]
    graph_of = m.api[order]
    cuts = np.flatnonzero(np.r_[True, graph_of[1:] != graph_of[:-1], True])
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        g = int(graph_of[lo])
        if g not in first:
            continue
        thread = (int(api.pid[first[g]]), int(api.tid[first[g]]))
        lo_t, hi_t = int(api.start[first[g]]), int(api.end[last[g]])
        starts, rows = begins.get(thread, _NONE)
        before = np.searchsorted(starts, lo_t, side="right") - 1
        if before >= 0:
            lo_t = int(starts[before])
        starts, rows = ends.get(thread, _NONE)
        after = np.searchsorted(starts, hi_t, side="left")
        if after < len(starts):
            hi_t = int(api.end[rows[after]])
        starts, rows = calls.get(thread, _NONE)
        inside = rows[np.searchsorted(starts, lo_t, side="left"):
                      np.searchsorted(starts, hi_t, side="right")]
        if len(inside) == hi - lo:
            out[order[lo:hi]] = inside
    return out


_NONE = (np.empty(0, np.int64), np.empty(0, np.int64))


def _calls_that_ran(trace: Trace) -> np.ndarray:
    """Per API call: whether a kernel or memop joined to it ran (a captured call ran none)."""
    ran = np.zeros(len(trace.api), bool)
    for table in (trace.kernels, trace.memops):
        ran[table.api[table.api >= 0]] = True
    return ran


def _by_thread(trace: Trace, rows: np.ndarray) -> dict[tuple[int, int], tuple[np.ndarray,
                                                                            np.ndarray]]:
    """API rows per (pid, tid): their start times, ascending, and the rows in that order."""
    api = trace.api
    if len(rows) == 0:
        return {}
    rows = rows[np.lexsort((api.start[rows], api.tid[rows], api.pid[rows]))]
    pid, tid = api.pid[rows], api.tid[rows]
    cuts = np.flatnonzero(np.r_[True, (pid[1:] != pid[:-1]) | (tid[1:] != tid[:-1]), True])
    return {(int(pid[a]), int(tid[a])): (api.start[rows[a:b]], rows[a:b])
            for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True) if b > a}


def capture_count(trace: Trace) -> int:
    """How many graph captures the trace records: runs of launches that ran nothing, in a
    trace that began a capture (elsewhere such launches are a profiler window's edge)."""
    if not trace.names_matching(BEGIN_CAPTURE)[trace.api.name].any():
        return 0
    return len(_captures(trace))


def _captures(trace: Trace) -> list[np.ndarray]:
    """Runs of kernel launches that ran nothing, per thread, in time order (API rows)."""
    api = trace.api
    is_launch = trace.names_matching(KERNEL_LAUNCH)[api.name]
    is_begin = trace.names_matching(BEGIN_CAPTURE)[api.name]
    rows = np.flatnonzero(is_launch | is_begin)
    if len(rows) == 0:
        return []
    ran = _calls_that_ran(trace)
    rows = rows[np.lexsort((api.start[rows], api.tid[rows], api.pid[rows]))]
    idle = is_launch[rows] & ~ran[rows]
    same_thread = np.r_[False, (api.pid[rows][1:] == api.pid[rows][:-1])
                        & (api.tid[rows][1:] == api.tid[rows][:-1])]
    continues = idle & same_thread & np.r_[False, idle[:-1]]
    run_id = np.cumsum(~continues)
    rows, run_id = rows[idle], run_id[idle]
    if len(rows) == 0:
        return []
    cuts = np.flatnonzero(np.r_[True, run_id[1:] != run_id[:-1], True])
    return [rows[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True)]
