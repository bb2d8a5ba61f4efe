"""kimi-perf: per-layer kernel counts and µs from nsys and PyTorch-profiler traces.

Library entry points (the CLI is a thin layer over these)::

    from kimi_perf import (breakdown, breakdown_of_file, compare_files, load_breakdown,
                           read_trace)
    trace = read_trace("decode.sqlite")          # or .nsys-rep, Kineto .json(.gz), .kptrace
    b = breakdown(trace)                          # steps, layers, per-type medians
    b = breakdown_of_file("decode.sqlite")        # the same, read and broken down at once
    b = load_breakdown("traces/runs/<run>", "specialized")   # a trace, breakdown or run's path
    compare_files("a.sqlite", "b.sqlite").to_json()          # `kimi-perf compare`, as a call
"""

from kimi_perf.attribution import range_kernel_summary
from kimi_perf.comparison import compare, compare_files
from kimi_perf.errors import TraceError
from kimi_perf.layer_breakdown import Breakdown, breakdown, breakdown_of_file
from kimi_perf.readers import read_trace
from kimi_perf.runs import load_breakdown
from kimi_perf.trace import Trace

__all__ = ["Breakdown", "Trace", "TraceError", "breakdown", "breakdown_of_file", "compare",
           "compare_files", "load_breakdown", "range_kernel_summary", "read_trace"]
__version__ = "0.1.0"
