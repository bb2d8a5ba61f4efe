"""Graph replays back to their capture: which API call put each replayed kernel into its graph.

Profiler ranges do not survive CUDA/HIP graph replay: every kernel of a replayed step shares
the one graph launch, which lies in the step's range but in no layer's. The capture, though,
ran on a CPU thread inside the ranges open then (``layer[3](kda)``, vLLM's piecewise
``## Call CompiledFxGraph ##``), and each kernel launch it made became a node instead of
running. Mapping a replayed kernel to the launch call that captured it lets range-based
analyses (per-layer attribution) place it as if it had been launched eagerly there.

The mapping is by order. On a thread, a run of consecutive kernel launches that ran nothing
(no kernel joined to them), broken by any launch that did run and by ``*StreamBeginCapture``,
is one capture. A graph launch whose replay ran exactly as many kernels as the latest earlier
capture of its process takes that capture: the i-th kernel to start maps to the i-th launch.
Kernels on parallel branches of a graph may start in another order than they were captured,
but not across a join, so the layer a kernel lands in holds whenever layers end in a join.
Captures the trace does not hold (profiling began after them) map nothing.
"""

from __future__ import annotations

import re

import numpy as np

from kimi_perf.trace import Trace

GRAPH_LAUNCH = re.compile(r"^(cuda|hip|cu)GraphLaunch")
KERNEL_LAUNCH = re.compile(r"^(?:cuda|hip|cu)\w*Launch\w*Kernel")
BEGIN_CAPTURE = re.compile(r"^(?:cuda|hip|cu)StreamBeginCapture")


def capture_launches(trace: Trace) -> np.ndarray:
    """Per kernel, the row in ``trace.api`` of the launch that captured it into its graph,
    or -1 (not replayed from a graph, or its capture is not in the trace)."""
    k, api = trace.kernels, trace.api
    out = np.full(len(k), -1, np.int64)
    if len(k) == 0 or len(api) == 0:
        return out
    launched = np.flatnonzero(k.api >= 0)
    from_graph = launched[trace.names_matching(GRAPH_LAUNCH)[api.name[k.api[launched]]]]
    if len(from_graph) == 0:
        return out
    runs = _captures(trace)
    if not runs:
        return out
    run_pid = np.array([int(api.pid[r[0]]) for r in runs])
    run_end = np.array([int(api.end[r[-1]]) for r in runs])
    run_len = np.array([len(r) for r in runs])
    # Replayed kernels grouped by graph launch, each group in GPU start order.
    order = from_graph[np.lexsort((k.start[from_graph], k.api[from_graph]))]
    graph_of = k.api[order]
    cuts = np.flatnonzero(np.r_[True, graph_of[1:] != graph_of[:-1], True])
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        g = int(graph_of[lo])
        fits = np.flatnonzero((run_pid == api.pid[g]) & (run_end <= api.start[g])
                              & (run_len == hi - lo))
        if len(fits):
            out[order[lo:hi]] = runs[int(fits[np.argmax(run_end[fits])])]
    return out


def _captures(trace: Trace) -> list[np.ndarray]:
    """Runs of kernel launches that ran nothing, per thread, in time order (API rows)."""
    api = trace.api
    is_launch = trace.names_matching(KERNEL_LAUNCH)[api.name]
    is_begin = trace.names_matching(BEGIN_CAPTURE)[api.name]
    rows = np.flatnonzero(is_launch | is_begin)
    if len(rows) == 0:
        return []
    ran = np.zeros(len(api), bool)
    for table in (trace.kernels, trace.memops):
        ran[table.api[table.api >= 0]] = True
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
