"""Small synthetic traces for tests: build a Trace from plain Python lists."""

from __future__ import annotations

import numpy as np

from kimi_perf.classify import Rule
from kimi_perf.layers import GpuOps, Step, find_layers, find_steps, steps_of_phase
from kimi_perf.nesting import nest_ranges
from kimi_perf.strings import StringTable
from kimi_perf.trace import PUSHPOP, ApiCalls, Kernels, MemOps, Ranges, Trace


class TraceBuilder:
    """Kernels launched by API calls on CPU threads, inside ranges on those threads."""

    def __init__(self) -> None:
        self.strings = StringTable()
        self.kernels: list[dict] = []
        self.memops: list[dict] = []
        self.api: list[dict] = []
        self.ranges: list[dict] = []
        self.clock = 0

    def range(self, name: str, start: int, end: int, pid: int = 1, tid: int = 1,
              style: int = PUSHPOP) -> None:
        self.ranges.append(dict(name=self.strings.code(name), domain=self.strings.code(""),
                                start=start, end=end, pid=pid, tid=tid, device=-1, stream=-1,
                                style=style))

    def launch(self, kernel: str, api_start: int, api_end: int, gpu_start: int, gpu_end: int,
               pid: int = 1, tid: int = 1, device: int = 0, correlation: int | None = None,
               api_name: str = "cudaLaunchKernel", stream: int = 7) -> None:
        corr = correlation if correlation is not None else len(self.api) + 1
        if correlation is None or not any(a["correlation"] == corr for a in self.api):
            self.api.append(dict(name=self.strings.code(api_name), start=api_start,
                                 end=api_end, pid=pid, tid=tid, correlation=corr, kind=0))
        self.kernels.append(dict(name=self.strings.code(kernel), start=gpu_start, end=gpu_end,
                                 device=device, stream=stream, pid=pid, correlation=corr))

    def memop(self, name: str, gpu_start: int, gpu_end: int, correlation: int, pid: int = 1,
              device: int = 0) -> None:
        """A memcpy or memset run by the API call of ``correlation`` (a graph launch's, say)."""
        self.memops.append(dict(name=self.strings.code(name), start=gpu_start, end=gpu_end,
                                device=device, stream=7, pid=pid, tid=-1,
                                correlation=correlation, bytes=4096))

    def call(self, api_name: str, start: int, end: int, pid: int = 1, tid: int = 1) -> None:
        """An API call that launched no GPU work (a launch during graph capture, a sync)."""
        self.api.append(dict(name=self.strings.code(api_name), start=start, end=end, pid=pid,
                             tid=tid, correlation=len(self.api) + 1, kind=0))

    def sequence(self, names: list[str], duration: int = 1000, gap: int = 100,
                 tid: int = 1, device: int = 0) -> tuple[int, int]:
        """Launch kernels back to back; returns the (start, end) of their API calls."""
        first = self.clock
        for name in names:
            t = self.clock
            self.launch(name, t, t + 50, t + 200, t + 200 + duration, tid=tid, device=device)
            self.clock += duration + gap
        return first, self.clock

    def build(self) -> Trace:
        def table(kind, rows):
            if not rows:
                return kind.empty()
            cols = {k: np.array([r[k] for r in rows]) for k in rows[0]}
            return kind.from_columns(cols, len(rows))

        api = table(ApiCalls, self.api)
        kernels = table(Kernels, self.kernels)
        memops = table(MemOps, self.memops)
        ranges = table(Ranges, self.ranges)
        trace = Trace(strings=self.strings.values, kernels=kernels, memops=memops,
                      ranges=ranges, api=api,
                      meta={"format": "synthetic", "tool": "tests", "file": "synthetic"})
        from kimi_perf.launches import find_launches

        for gpu_work in (kernels, memops):
            gpu_work.api = find_launches(api, gpu_work.pid, gpu_work.correlation)
            hit = gpu_work.api >= 0
            gpu_work.tid[hit] = api.tid[gpu_work.api[hit]]
        nest_ranges(trace.ranges)
        return trace


def segment(trace: Trace, layers: str = "auto", step_regex: str | None = None,
            rules: list[Rule] | None = None, phase: str = "auto") -> tuple[GpuOps, list[Step]]:
    """Steps (of ``phase``) with their layers, as ``breakdown`` finds them before it sums
    them up: for tests that look at the steps and layers themselves."""
    ops = GpuOps.of(trace, rules)
    steps, _ = steps_of_phase(find_steps(trace, ops, step_regex), phase,
                              trace.meta.get("file"))
    find_layers(trace, ops, steps, layers)
    return ops, steps
