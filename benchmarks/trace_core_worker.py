"""One measurement of ``bench_trace_core.py``, in a fresh interpreter that imports only what
the measured tool needs (the benchmark's own table printing and trace generator stay out of
the peak RSS).

    python trace_core_worker.py kimi|hta TRACE RESULT_JSON
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _peak_rss() -> int:
    """This process's RSS high-water mark in bytes.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so a worker would inherit the
    high-water mark of the parent that spawned it (e.g. after generating a trace). VmHWM
    belongs to the worker's own address space.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# -- workers: run in a fresh interpreter, write one JSON result -----------------------------------

def work_kimi(path: Path) -> dict[str, Any]:
    from kimi_perf.attribution import range_kernel_summary
    from kimi_perf.layer_breakdown import breakdown
    from kimi_perf.readers import read_trace

    base = _peak_rss()
    t0 = time.perf_counter()
    trace = read_trace(path)
    t1 = time.perf_counter()
    rss_read = _peak_rss()
    rows = range_kernel_summary(trace)
    t2 = time.perf_counter()
    result = breakdown(trace)
    t3 = time.perf_counter()
    return {
        "phases": {"read": t1 - t0, "attribute": t2 - t1, "breakdown": t3 - t2},
        "rss_base": base, "rss_read": rss_read, "rss_peak": _peak_rss(),
        "kernels": len(trace.kernels), "ranges": len(trace.ranges),
        "summary_rows": len(rows),
        "outside_ranges": sum(r.kernel_instances for r in rows if r.range is None),
        "steps": len(result.steps), "layers": len(result.layers),
        "layer_types": sorted({row["type"] for row in result.layers}),
        "kernel_ns": int((trace.kernels.end - trace.kernels.start).sum()),
    }


def work_hta(path: Path) -> dict[str, Any]:
    import logging
    import warnings

    from hta.trace_analysis import TraceAnalysis

    # HTA logs each parse step and pandas warns about its dtype handling: not what we time.
    logging.getLogger("hta").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    base = _peak_rss()
    t0 = time.perf_counter()
    analyzer = TraceAnalysis(trace_dir=str(path.parent))
    t1 = time.perf_counter()
    rss_read = _peak_rss()
    kernel_types, _ = analyzer.get_gpu_kernel_breakdown(visualize=False)
    t2 = time.perf_counter()
    df = analyzer.t.get_trace(0)
    return {
        "phases": {"read": t1 - t0, "breakdown": t2 - t1},
        "rss_base": base, "rss_read": rss_read, "rss_peak": _peak_rss(),
        "kernels": int((df["stream"] >= 0).sum()), "events": len(df),
        "kernel_types": kernel_types["kernel_type"].tolist(),
    }


WORKERS = {"kimi": work_kimi, "hta": work_hta}


def main(argv: list[str]) -> int:
    kind, trace, result = argv
    Path(result).write_text(json.dumps(WORKERS[kind](Path(trace))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
