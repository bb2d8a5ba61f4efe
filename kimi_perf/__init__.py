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

import importlib

TYPE_CHECKING = False   # (typing's own: importing typing takes most of this file's time)

# each name from its module when first used: the command's entry point imports this package
# before it can say an interruption as a command does (kimi_perf.__main__)
_EXPORTS = {"range_kernel_summary": "attribution", "compare": "comparison",
            "compare_files": "comparison", "TraceError": "errors", "NoGpuWork": "errors",
            "NoStepsMatched": "errors", "Breakdown": "layer_breakdown",
            "breakdown": "layer_breakdown", "breakdown_of_file": "layer_breakdown",
            "read_trace": "readers", "load_breakdown": "runs", "Trace": "trace"}

if TYPE_CHECKING:
    from kimi_perf.attribution import range_kernel_summary
    from kimi_perf.comparison import compare, compare_files
    from kimi_perf.errors import NoGpuWork, NoStepsMatched, TraceError
    from kimi_perf.layer_breakdown import Breakdown, breakdown, breakdown_of_file
    from kimi_perf.readers import read_trace
    from kimi_perf.runs import load_breakdown
    from kimi_perf.trace import Trace

__all__ = ["Breakdown", "NoGpuWork", "NoStepsMatched", "Trace", "TraceError", "breakdown",
           "breakdown_of_file", "compare", "compare_files", "load_breakdown",
           "range_kernel_summary", "read_trace"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """An export, or a module of the package (``kimi_perf.runs`` after ``import kimi_perf``,
    as before the exports were imported when first used)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"kimi_perf.{_EXPORTS[name]}"), name)
    elif name.isidentifier() and not name.startswith("_") and _module_named(name):
        value = importlib.import_module(f"kimi_perf.{name}")
    else:
        raise AttributeError(f"module 'kimi_perf' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The exports and the package's modules (``kimi_perf.runs``, ``kimi_perf.gate``, ...),
    for completion: not what this file imports for itself."""
    import pkgutil

    return sorted({*__all__, "__version__",
                   *(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))})


def _module_named(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"kimi_perf.{name}") is not None
