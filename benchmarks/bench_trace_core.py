"""Time kimi-perf's trace core on large synthetic decode traces, and HTA on the same Kineto file.

    python benchmarks/bench_trace_core.py                 # 1M-kernel nsys + 2.7M-event Kineto
    python benchmarks/bench_trace_core.py --quick --skip-hta

Phases per tool, each tool in a fresh subprocess (so peak RSS is that tool's alone), the tools
in turn ``--repeat`` times (side by side: each round runs every tool once); the tables show
medians, and a target's verdict says in how many rounds it was met:
kimi-perf ``read_trace`` -> ``range_kernel_summary`` -> ``breakdown`` on the nsys SQLite export
and on the Kineto JSON; HTA ``TraceAnalysis(trace_dir=...)`` -> ``get_gpu_kernel_breakdown`` on
the same Kineto JSON. Generated traces are kept in ``--out`` and reused. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import synth_traces
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "bench-out"
SPEED_TARGET = 10.0     # HTA time / kimi-perf time on the same Kineto trace
MEMORY_TARGET = 3.0     # kimi-perf peak RSS / trace file size

# (tool, trace label, trace, worker result: the rounds' medians, "rounds" each round's)
Run = tuple[str, str, synth_traces.Generated, dict[str, Any]]


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One tool's rounds as one result: each phase's, the total's and each RSS's median, every
    round kept (``rounds``) for the verdicts; the first error if any round failed. The total is
    the median of the rounds' totals, not a sum of the phases' medians (a round slow in one
    phase and another slow in the next would hide in those)."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    result = dict(rounds[0])
    result["phases"] = {phase: statistics.median(r["phases"][phase] for r in rounds)
                        for phase in rounds[0]["phases"]}
    result["total"] = statistics.median(total(r) for r in rounds)
    for key in ("rss_base", "rss_read", "rss_peak"):
        result[key] = statistics.median(r[key] for r in rounds)
    result["rounds"] = rounds
    return result


def total(result: dict[str, Any]) -> float:
    """A round's seconds over its phases, or the rounds' median (``medians``)."""
    return result["total"] if "total" in result else sum(result["phases"].values())


def verdict(values: list[float], meets: Callable[[float], bool]) -> str:
    """The target met in every round, in none, or in some (and then how many)."""
    met = sum(map(meets, values))
    if met == len(values):
        return "[green]meets target[/]" + (f" (all {met} rounds)" if met > 1 else "")
    if met == 0:
        return "[red]misses target[/]" + (f" (all {len(values)} rounds)" if len(values) > 1
                                          else "")
    return f"[yellow]meets target in {met} of {len(values)} rounds[/]"


def spread(values: list[float], unit: str = "×") -> str:
    return (f" (rounds {min(values):.2f}–{max(values):.2f}{unit})" if len(values) > 1 else "")


def run_worker(kind: str, path: Path) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its result comes back through a file."""
    with tempfile.TemporaryDirectory(prefix="kimi-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE / "trace_core_worker.py"), kind, str(path),
               str(result)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
        if proc.returncode != 0 or not result.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            return {"error": f"exit {proc.returncode}: " + "\n".join(tail)}
        return json.loads(result.read_text())


# -- main ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    positive = synth_traces.positive_int
    p.add_argument("--kernels", type=positive, default=None,
                   help="kernels in the nsys trace, rounded up to whole decode steps "
                        "(default 1,000,000; --quick: 20,000)")
    p.add_argument("--ranges", type=positive, default=None,
                   help="NVTX ranges in the nsys trace: steps + layers + sub-ranges "
                        "(default 150,000; --quick: 3,000)")
    p.add_argument("--kineto-kernels", type=positive, default=None,
                   help="kernels in the Kineto trace (default: half of --kernels, which gives "
                        "about 5.4 events per kernel)")
    p.add_argument("--layers", type=positive, default=synth_traces.LAYERS_PER_STEP,
                   help="layers per decode step")
    p.add_argument("--out", type=synth_traces.work_dir, default=DEFAULT_OUT,
                   help="work dir for generated traces (reused when sizes match)")
    p.add_argument("--repeat", type=positive, default=None,
                   help="rounds, each running every tool once: medians shown, each target's "
                        "verdict over every round (default 3; --quick: 1)")
    p.add_argument("--skip-hta", action="store_true", help="do not run HTA")
    p.add_argument("--quick", action="store_true",
                   help="small default sizes that run in seconds: a smoke test")
    args = p.parse_args(argv)
    # Explicit sizes win over --quick's.
    if args.kernels is None:
        args.kernels = 20_000 if args.quick else 1_000_000
    if args.ranges is None:
        args.ranges = 3_000 if args.quick else 150_000
    if args.kineto_kernels is None:
        args.kineto_kernels = max(1, args.kernels // 2)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    return args


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 132)
    console.print(synth_traces.banner(
        "kimi-perf trace-core benchmark",
        f"kimi-perf {_version('kimi-perf')}, HTA {_version('HolisticTraceAnalysis')}, "
        f"pandas {_version('pandas')}"))

    # Generation runs here, before any measurement, never beside one.
    out = args.out.resolve()
    kineto_ranges = max(1, args.ranges * args.kineto_kernels // max(1, args.kernels))
    with console.status("generating / reusing synthetic traces..."):
        nsys = synth_traces.ensure_nsys(out, args.kernels, args.ranges, args.layers)
        kineto = synth_traces.ensure_kineto(out, args.kineto_kernels, kineto_ranges,
                                            args.layers)
    show_traces(console, out, nsys, kineto)

    tools = [(tool, label, gen) for tool, label, gen in (
        ("kimi", "nsys SQLite", nsys), ("kimi", "Kineto JSON.gz", kineto),
        ("hta", "Kineto JSON.gz", kineto)) if not (tool == "hta" and args.skip_hta)]
    rounds: list[list[dict[str, Any]]] = [[] for _ in tools]
    for i in range(args.repeat):
        for (tool, label, gen), results in zip(tools, rounds, strict=True):
            name = "kimi-perf" if tool == "kimi" else "HTA"
            with console.status(f"round {i + 1} of {args.repeat}: {name} on {label}..."):
                results.append(run_worker(tool, gen.path))
    runs: list[Run] = [("kimi-perf" if tool == "kimi" else "HTA", label, gen, medians(results))
                       for (tool, label, gen), results in zip(tools, rounds, strict=True)]
    show_timings(console, runs, args.repeat)
    failed = [r for r in runs if "error" in r[3]]
    for name, label, _, result in failed:
        console.print(f"[red]{name} on {label} failed[/] {result['error']}")
    show_ratios(console, runs, nsys, kineto, skip_hta=args.skip_hta)
    wrong = show_sanity(console, runs, nsys, kineto)
    return 1 if failed or wrong else 0


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def show_traces(console: Console, out: Path, nsys: synth_traces.Generated,
                kineto: synth_traces.Generated) -> None:
    table = Table(title=f"Synthetic decode traces (in {out})", title_justify="left")
    for col in ("trace", "kernels", "ranges", "events", "steps × layers", "file size",
                "uncompressed", "generated in"):
        table.add_column(col, justify="left" if col == "trace" else "right")
    traces = (("nsys SQLite", nsys), ("Kineto JSON.gz", kineto))
    for label, gen in traces:
        info = gen.info
        events = info.get("events", {}).get("total")
        table.add_row(
            label, f"{info['kernels']:,}", f"{info['ranges']:,}",
            f"{events:,}" if events else "—",
            f"{info['steps']:,} × {info['layers_per_step']}", _mb(info["file_bytes"]),
            _mb(info["raw_bytes"]) if "raw_bytes" in info else "—",
            f"{gen.seconds:.1f} s" if gen.seconds is not None else "reused")
    console.print(table)
    for label, gen in traces:
        console.print(f"[dim]  {label}: {gen.path.relative_to(out)}[/]")
    console.print("[dim]ranges: NVTX push/pop ranges (nsys) or user_annotation events (Kineto): "
                  r"decode_step\[i] > layer\[j](kda|mla) > attention/moe > ...; events: all "
                  "traceEvents (kernel, cuda_runtime/cuda_driver, ac2g flows, cpu_op, "
                  "user_annotation).[/]")


def show_timings(console: Console, runs: list[Run], repeat: int) -> None:
    table = Table(title="Timings (s; each tool in a fresh subprocess"
                  + (f"; medians of {repeat} rounds)" if repeat > 1 else ")"),
                  title_justify="left")
    for col in ("tool", "trace", "read", "attribute", "breakdown", "total", "kernels/s",
                "RSS before", "RSS after read", "peak RSS", "peak / file"):
        table.add_column(col, justify="left" if col in ("tool", "trace") else "right")
    for name, label, gen, result in runs:
        if "error" in result:
            table.add_row(name, label, "[red]failed[/]", *[""] * 8)
            continue
        phases = result["phases"]
        size = gen.info["file_bytes"]
        ratio = f"{result['rss_peak'] / size:.2f}×"
        table.add_row(
            name, label, f"{phases['read']:.2f}",
            f"{phases['attribute']:.2f}" if "attribute" in phases else "—",
            f"{phases['breakdown']:.2f}", f"[bold]{total(result):.2f}[/]",
            f"{result['kernels'] / total(result):,.0f}", _mb(result["rss_base"]),
            _mb(result["rss_read"]), _mb(result["rss_peak"]), ratio)
    console.print(table)
    console.print("[dim]read: read_trace (kimi-perf) or TraceAnalysis(trace_dir) (HTA); "
                  "attribute: range_kernel_summary (nsys-exact kernel→range projection); "
                  "breakdown: breakdown() (steps, layers, classes) or "
                  "get_gpu_kernel_breakdown(visualize=False); total: the median of the rounds' "
                  "totals. kernels/s = kernels / total. RSS = high-water mark (VmHWM) of the "
                  "worker, interpreter and imports included (before: the tool imported, nothing "
                  "read; after read: before attribute).[/]")


def show_ratios(console: Console, runs: list[Run], nsys: synth_traces.Generated,
                kineto: synth_traces.Generated, skip_hta: bool) -> None:
    by = {(name, label): result for name, label, _, result in runs if "error" not in result}
    kimi_nsys = by.get(("kimi-perf", "nsys SQLite"))
    kimi_kineto = by.get(("kimi-perf", "Kineto JSON.gz"))
    hta = by.get(("HTA", "Kineto JSON.gz"))

    console.print("[bold]Ratios[/]" + (" (of the medians; the verdicts over each round's ratio)"
                                       if len(next(iter(by.values()), {}).get("rounds", ())) > 1
                                       else ""))
    if hta and kimi_kineto:
        speed = total(hta) / total(kimi_kineto)
        # each round's ratio of the two runs side by side in it
        speeds = [total(h) / total(k) for h, k in zip(hta["rounds"], kimi_kineto["rounds"],
                                                         strict=True)]
        console.print(f"  HTA / kimi-perf, Kineto trace, total time: [bold]{speed:.1f}×[/] "
                      f"({total(hta):.1f} s / {total(kimi_kineto):.1f} s; target ≥ "
                      f"{SPEED_TARGET:.0f}×){spread(speeds)} "
                      f"{verdict(speeds, lambda x: x >= SPEED_TARGET)}")
        read = hta["phases"]["read"] / kimi_kineto["phases"]["read"]
        console.print(f"  HTA load / kimi-perf read, Kineto trace: {read:.1f}×")
        console.print(f"  HTA / kimi-perf peak RSS, Kineto trace: "
                      f"{hta['rss_peak'] / kimi_kineto['rss_peak']:.1f}×")
    elif skip_hta:
        console.print("  HTA / kimi-perf: [dim]not measured (--skip-hta)[/]")
    else:
        console.print("  HTA / kimi-perf: [red]not measured (HTA failed or is not installed: "
                      "pip install HolisticTraceAnalysis 'pandas<3')[/]")
    for label, result, gen in (("nsys SQLite", kimi_nsys, nsys),
                               ("Kineto JSON.gz", kimi_kineto, kineto)):
        if result is None:
            continue
        size = gen.info["file_bytes"]
        mem = result["rss_peak"] / size
        mems = [r["rss_peak"] / size for r in result["rounds"]]
        line = (f"  kimi-perf peak RSS / file size, {label}: [bold]{mem:.2f}×[/] "
                f"({_mb(result['rss_peak'])} / {_mb(size)}; target < {MEMORY_TARGET:.0f}×)"
                f"{spread(mems)} {verdict(mems, lambda x: x < MEMORY_TARGET)}")
        # what the read, attribution and breakdown took, the interpreter and imports aside
        line += (f"; {(result['rss_peak'] - result['rss_base']) / size:.2f}× of it above the "
                 f"{_mb(result['rss_base'])} held before the read")
        if "raw_bytes" in gen.info:
            line += f"; {result['rss_peak'] / gen.info['raw_bytes']:.2f}× the uncompressed JSON"
        console.print(line)


# What kimi-perf must read back of a synthetic trace: (result key, generator key, said as)
READ_BACK = (("kernels", "kernels", "kernels"), ("steps", "steps", "steps"),
             ("layers", "layers", "layers"), ("kernel_ns", "kernel_ns", "ns of kernel time"),
             ("outside_ranges", None, "kernels outside every range"))


def misread(result: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """What kimi-perf read otherwise than the generator wrote, each as "X things, not Y"."""
    return [f"{result[key]:,} {said}, not {info[wrote] if wrote else 0:,}"
            for key, wrote, said in READ_BACK
            if result[key] != (info[wrote] if wrote else 0)]


def show_sanity(console: Console, runs: list[Run], nsys: synth_traces.Generated,
                kineto: synth_traces.Generated) -> bool:
    """Each trace as kimi-perf read it against what was generated (every round's reading
    alike): whether any differs."""
    by = {(name, label): result for name, label, _, result in runs if "error" not in result}
    console.print("[bold]Sanity[/]")
    wrong = False
    for label, gen in (("nsys SQLite", nsys), ("Kineto JSON.gz", kineto)):
        result = by.get(("kimi-perf", label))
        if result is None:
            continue
        differ = sorted({m for r in result["rounds"] for m in misread(r, gen.info)})
        wrong = wrong or bool(differ)
        console.print(
            f"  kimi-perf, {label}: {result['kernels']:,} kernels, {result['steps']:,} steps, "
            f"{result['layers']:,} layers ({'/'.join(result['layer_types'])}), "
            f"{result['outside_ranges']} kernels outside every range — "
            + ("[green]as generated[/]" if not differ else
               f"[red]read otherwise than generated: {'; '.join(differ)}[/]"))
    hta = by.get(("HTA", "Kineto JSON.gz"))
    if hta:
        console.print(f"  HTA, Kineto JSON.gz: {hta['kernels']:,} GPU events of "
                      f"{hta['events']:,} rows; kernel types {', '.join(hta['kernel_types'])}")
    return wrong


if __name__ == "__main__":
    sys.exit(main())
