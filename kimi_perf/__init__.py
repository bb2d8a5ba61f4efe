"""kimi-perf: per-layer kernel counts and µs from nsys and PyTorch-profiler traces.

Library entry points (the CLI is a thin layer over these)::

    from kimi_perf import read_trace, breakdown, compare, range_kernel_summary
    trace = read_trace("decode.sqlite")          # or .nsys-rep, Kineto .json(.gz), .kptrace
    b = breakdown(trace)                          # steps, layers, per-type medians
    b = breakdown_of_file("decode.sqlite")        # the same, read and broken down at once
"""

from kimi_perf.attribution import range_kernel_summary
from kimi_perf.comparison import compare
from kimi_perf.errors import TraceError
from kimi_perf.layer_breakdown import Breakdown, breakdown, breakdown_of_file
from kimi_perf.readers import read_trace
from kimi_perf.trace import Trace

__all__ = ["Breakdown", "Trace", "TraceError", "breakdown", "breakdown_of_file", "compare",
           "range_kernel_summary", "read_trace"]
__version__ = "0.1.0"
