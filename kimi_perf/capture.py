"""``kimi-perf trace``: run both decode paths under a profiler and break each down per layer.

One run writes one directory: per path the raw trace (Kineto ``.json.gz``, one per rank with
TP: ``.rank<r>.trace.json.gz``; with the nsys backend ``.nsys-rep`` and its ``.sqlite``
export), the normalised trace (``.kptrace``), and for the run ``run.json`` (what ran, where,
with which versions), ``breakdown.json`` (``{"schema": 1, "run": ..., "paths": {path:
<breakdown JSON>}}``) and the HTML report (``report.html``).

``--from`` skips the capture and analyses existing traces (nsys or Kineto, ours or vLLM's)
into the same files and table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import gzip
import importlib.metadata
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_perf import __version__
from kimi_perf.decode.fallbacks import (
    every_decode_step_fell_back,
    fell_back_text,
    paths_that_fell_back,
    summarise,
)
from kimi_perf.errors import TraceError, argument, path_argument, path_list, stat_problem
from kimi_perf.layer_breakdown import Breakdown, breakdown, breakdown_of_file
from kimi_perf.memory import address_space_capped
from kimi_perf.readers import read_trace
from kimi_perf.readers.nsys import has_nvtx_ranges, nsys_cli, nsys_failure, nsys_reason
from kimi_perf.runs import missing_rank_labels, same_capture, trace_files, trace_labels
from kimi_perf.text import also_as
from kimi_perf.trace import (
    atomic_write,
    atomic_write_text,
    json_text,
)

PATH_BACKENDS = {"standard": "auto", "specialized": "latency_specialized"}


@dataclass
class TraceRequest:
    preset: str
    n_layers: int | None
    batch: int
    context: int
    steps: int
    warmup: int
    tp: int = 1
    paths: tuple[str, ...] = ("standard", "specialized")
    graphs: bool = False
    backend: str = "torch"
    kv_cache: str = "bf16"
    experts: str = "bf16"           # the routed experts' storage: bf16 or mxfp4
    spec_tokens: int = 0            # speculative decoding: each step verifies 1+k tokens
    seed: int = 0
    out_dir: Path = Path("traces/runs")
    plotly_js: str = "inline"       # the report's plotly.js: inline, cdn or a .js path
    # the specialized path's opt-ins (SpecializedModel): L2 prefetch of o_proj's weights, and
    # from this many tokens a step on, the routed experts grouped by expert; programmatic
    # dependent launch
    l2_prefetch: bool = False
    group_experts_from: int | None = None
    pdl: bool = False


def path_options(req: TraceRequest, path: str) -> dict:
    """``build_model``'s options of the request for ``path``: the experts' storage (every
    path) and the specialized path's opt-ins (the standard path has none)."""
    if PATH_BACKENDS[path] != "latency_specialized":
        return {"experts": req.experts}
    return {"experts": req.experts, "l2_prefetch": req.l2_prefetch,
            "group_experts_from": req.group_experts_from, "pdl": req.pdl}


def default_request(on_gpu: bool) -> TraceRequest:
    """The embedded default: the tiny preset on a CPU, four k3-tp8 layers on a GPU (40
    steps: the gate's permutation test of the steps' mean span finds every fourth step 60%
    slower in 40 a side, p under 0.001; in 20 a side p is at most about C(20,5) / C(40,5) =
    0.024, the share of splits that put the 5 slow steps on one side, under alpha 0.01 only
    where the noise ranks this split high among those: found 7 to 11 times in 20)."""
    if on_gpu:
        return TraceRequest(preset="k3-tp8", n_layers=4, batch=1, context=512, steps=40,
                            warmup=3)
    return TraceRequest(preset="tiny", n_layers=None, batch=2, context=8, steps=3, warmup=1)


def command_line(req: TraceRequest) -> str:
    """The ``kimi-perf trace`` command that makes this request on any machine: every option
    given, none left to the CPU or GPU default."""
    args = ["kimi-perf", "trace", "--preset", req.preset]
    if req.n_layers is not None:
        args += ["--layers", str(req.n_layers)]
    args += ["--batch", str(req.batch), "--context", str(req.context), "--steps",
             str(req.steps), "--warmup", str(req.warmup), "--tp", str(req.tp),
             "--paths", ",".join(req.paths), "--graphs" if req.graphs else "--no-graphs",
             "--backend", req.backend, "--kv-cache", req.kv_cache, "--experts", req.experts,
             "--spec-tokens",
             str(req.spec_tokens), "--seed", str(req.seed), "--out", str(req.out_dir),
             "--plotly-js", req.plotly_js]
    if req.l2_prefetch:
        args.append("--l2-prefetch")
    if req.group_experts_from is not None:
        args += ["--group-experts-from", str(req.group_experts_from)]
    if req.pdl:
        args.append("--pdl")
    return shlex.join(args)


def environment(device: str, tp: int = 1) -> dict[str, Any]:
    """What ran the capture: device, versions, platform, GPUs, driver, commit, and
    ``cpu_threads``, the threads torch ran with in each profiled process (a CPU run's times
    depend on them: each TP rank's share)."""
    import torch

    from kimi_perf.decode.tp import rank_threads

    env: dict[str, Any] = {"device": device, "python": platform.python_version(),
                           "torch": torch.__version__, "kimi_perf": __version__,
                           "platform": platform.platform(), "cpu_threads": rank_threads(tp)}
    # triton's version without importing it (the interpreter is chosen before that), from
    # whichever distribution installs it (triton, pytorch-triton, pytorch-triton-rocm)
    try:
        env["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        dists = importlib.metadata.packages_distributions().get("triton") or []
        env["triton"] = importlib.metadata.version(dists[0]) if dists else None
    if device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
        env["driver"] = _driver_version()
    else:
        env.update(gpus=[], cuda=None, driver=None)
    env["git_commit"] = git_commit()
    return env


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def git_commit(checkout: Path | None = None) -> str | None:
    """The commit of kimi-perf's checkout (or of ``checkout``), ``+uncommitted`` after it when
    tracked files differ from it (the code that ran is not that commit's);
    ``KIMI_PERF_GIT_COMMIT`` where the code runs from a copy of the working tree without its
    .git (the lent GPU machine: scripts/gpu-check.sh sets it, marked the same way)."""
    if commit := os.environ.get("KIMI_PERF_GIT_COMMIT"):
        return commit
    here = str(checkout or Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        # status, not diff: told no optional locks, it leaves the index as it is (diff
        # rewrites it under a lock, which fails a commit made meanwhile in the checkout)
        status = subprocess.run(["git", "--no-optional-locks", "-C", here, "status",
                                 "--porcelain", "--untracked-files=no"], capture_output=True)
        clean = status.returncode == 0 and not status.stdout.strip()
    except OSError:  # no git at all
        return None
    return head.stdout.strip() + ("" if clean else "+uncommitted")


def _out_dir_problem(out_dir: Path, exc: OSError) -> str:
    """Why ``--out`` could not be made (``exc``, from its ``mkdir``), in words: the first
    part of it that is no directory (a file, a symlink loop, a symlink to nothing: mkdir says
    "File exists" of them), else mkdir's own reason."""
    for part in (*reversed(out_dir.parents), out_dir):
        try:
            if stat.S_ISDIR(part.stat().st_mode):
                continue
            what = "not a directory"
        except OSError as inner:
            if inner.errno not in (errno.ENOENT, errno.ELOOP) or not part.is_symlink():
                break   # (missing, mkdir makes it; or mkdir's reason says it)
            what = stat_problem(part, inner)
        return what if part == out_dir else f"{part} is {what}"
    return f"cannot create it ({exc.strerror or exc})"


@contextlib.contextmanager
def run_directory(out_dir: Path, label: str):
    """A new run directory, filled under a hidden name (``.NAME.partial``, which reserves NAME:
    two runs of one second never clash) and renamed into place when complete: a failed run
    leaves nothing behind (nor the folders made for ``out_dir``), and one killed outright
    (SIGKILL, the out-of-memory killer) its hidden partial alone, never a directory that
    passes for a finished run (``traces/runs/*/``)."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]   # (deepest first)

    def remove_made() -> None:   # (what this run made, where still empty)
        for empty in made:
            with contextlib.suppress(OSError):
                empty.rmdir()

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_made()   # (a name too long for the last folder: its parents were made)
        raise TraceError(out_dir, f"{argument('--out', 'out_dir')}: "
                                  f"{_out_dir_problem(out_dir, exc)}") from None
    for n in itertools.count(1):
        final = out_dir / (f"{stamp}-{label}" + (f"-{n}" if n > 1 else ""))
        partial = out_dir / f".{final.name}.partial"
        if final.exists() or final.is_symlink():
            continue
        try:
            partial.mkdir()   # (exclusive: the reservation)
        except FileExistsError:
            continue
        except OSError as exc:   # (--out is a directory here: made, or there already)
            remove_made()
            raise TraceError(out_dir, f"{argument('--out', 'out_dir')}: cannot create a run "
                                      f"directory in it ({exc.strerror or exc})") from None
        # (a run of the name that renamed its partial into place after the look above)
        if not (final.exists() or final.is_symlink()):
            break
        partial.rmdir()
    try:
        yield partial, final
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        remove_made()
        raise
    if final.exists() or final.is_symlink():   # (a rename would replace an empty directory)
        raise TraceError(final, f"made by other hands during the run: the run is kept in "
                                f"{partial}")
    try:
        partial.rename(final)
    except OSError as exc:   # (the name made by other hands meanwhile: the run is kept)
        raise TraceError(final, f"cannot take the run's name ({exc.strerror or exc}): the run "
                                f"is kept in {partial}") from None


def capture(req: TraceRequest, progress=None) -> tuple[Path, dict[str, Breakdown], dict]:
    """Capture every requested path; returns the run directory, breakdowns and run.json.

    ``progress(description, units)`` is called as work completes: a path's prefill and each
    of its decode steps are one unit each (``work_units(req)`` in all).
    """
    import torch

    from kimi_perf.decode import choose_triton_backend
    from kimi_perf.decode.config import preset, resharded
    from kimi_perf.decode.weights import weight_bytes

    choose_triton_backend()   # before the profiler or anything else imports triton
    if req.tp != 1 and (torch.cuda.is_available() or req.backend != "torch"):
        raise TraceError(None, f"{argument('--tp', 'tp')} > 1 captures CPU ranks over gloo "
                               "with the torch backend; GPU ranks (NCCL) and nsys are not "
                               "supported yet")
    if req.backend == "nsys":
        nsys_binary()  # fail before any work when there is none
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if req.graphs and not on_gpu:
        raise TraceError(None, f"{argument('--graphs', 'graphs')} needs a GPU: CUDA graphs "
                               "capture GPU work")
    unknown = [p for p in req.paths if p not in PATH_BACKENDS]
    if not req.paths:
        raise TraceError(None, f"{argument('--paths', 'paths')} names no path (choose from "
                               f"{', '.join(PATH_BACKENDS)})")
    if unknown:
        raise TraceError(None, f"{argument('--paths', 'paths')}: unknown path(s) "
                               f"{', '.join(unknown)} (choose from {', '.join(PATH_BACKENDS)})")
    config = preset(req.preset, n_layers=req.n_layers)
    if req.tp != 1 and config.tp != 1:   # one rank's shapes, sharded again: before any work
        raise TraceError(None, resharded(req.preset, config, req.tp))
    if req.tp != 1:
        try:
            config.shard(req.tp)   # each rank shards it again: refused here, before any work
        except ValueError as exc:
            raise TraceError(None, f"{req.preset}: {exc}") from None
    # TP ranks on a CPU: the parent holds the whole checkpoint while the ranks, between them,
    # hold it sharded and packed (reasoned from the one-process figure, not measured)
    # (MXFP4 experts: the kernel path also packs them as codes and scales, at most 0.27 of a
    # bf16 weight's bytes: reasoned, as if every weight were an expert's)
    per_byte = MEMORY_PER_WEIGHT_BYTE + (0.27 if req.experts == "mxfp4" else 0)
    need_of = (lambda c: (1 + per_byte) * weight_bytes(c)) if req.tp > 1 else (
        lambda c: per_byte * weight_bytes(c))
    # (under --tp the parent holds the whole checkpoint: one rank's shapes run without it)
    alone = (f"run one rank's shapes alone ({argument('--preset', 'preset')} k3-tp8 or "
             f"k3-tp16, without {argument('--tp', 'tp')})" if req.tp > 1 else None)
    if problem := memory_problem(config, req.preset, device, need_of=need_of,
                                 holding="with the ranks' sharded, packed copies"
                                 if req.tp > 1 else "with the model's packed copy",
                                 otherwise=alone):
        raise TraceError(None, problem)
    if problem := decode_memory_problem(
            decode_bytes(req, config, activations=device == "cpu"), need_of(config), device,
            f"batch {req.batch}, context {req.context}, {req.warmup} + {req.steps} steps"):
        raise TraceError(None, problem)
    with run_directory(req.out_dir, f"{req.preset}-b{req.batch}") as (run_dir, final):
        # (the nsys backend's processes run under nsys, which maps more than it uses)
        cap = (available_memory(device) if device == "cpu" and req.backend == "torch"
               else None)
        with address_space_capped(cap):
            run_info, results = _capture_all(req, config, device, run_dir, final, progress)
    return final, results, run_info


# A model in memory holds its weights about twice: the checkpoint drawn, and the paths' packed
# copies (stacked experts, joined projections). Measured: k3-tp16 with 2 layers, 8.7 GB of
# weights, peaked at 19.3 GB capturing the standard path on a CPU (2026-12-02).
MEMORY_PER_WEIGHT_BYTE = 2


def memory_problem(config, preset_name: str, device: str, need_of=None,
                   holding: str = "with the model's packed copy",
                   otherwise: str | None = None) -> str | None:
    """Why a model of ``config`` cannot fit in the memory free for it (the GPU's, or the
    machine's), said before any work rather than by the out-of-memory killer; None where it
    fits or the free memory is unknown. ``need_of(config)``: the bytes a run of it holds
    (``holding`` says what they are; by default a capture's, the weights twice over);
    ``otherwise``: what to take where even two layers do not fit."""
    from kimi_perf.decode.weights import weight_bytes

    need_of = need_of or (lambda c: MEMORY_PER_WEIGHT_BYTE * weight_bytes(c))
    need = need_of(config)
    free = available_memory(device)
    if free is None or need <= free:
        return None
    least = need_of(dataclasses.replace(config, n_layers=2))
    instead = (f"take fewer {argument('--layers', 'n_layers')} (2 need about {_size(least)})"
               if least <= free else otherwise or (
                   f"take one rank's shapes ({argument('--preset', 'preset')} k3-tp8 or k3-tp16)"
                                  if config.tp == 1
                                  else "take a smaller preset, or a machine with more memory"))
    return (f"{preset_name} with {config.n_layers} layers: {_size(weight_bytes(config))} of "
            f"weights, about {_size(need)} {holding}, and "
            f"{'the GPU' if device == 'cuda' else 'this machine'} has {_size(free)} free: "
            f"{instead}")


def decode_bytes(req: TraceRequest, config, activations: bool = True) -> int:
    """About what a capture holds beside its weights at its largest, over its TP ranks: each
    rank's decode state (the caches, for the prompt and every step: ``DecodeState.bytes_of``)
    and its prefill (``prefill_bytes``; ``activations``: with its activations), or with CUDA
    graphs the state twice (``GraphedDecodeStep`` saves it while warming up)."""
    from kimi_perf.decode.harness import cache_tokens
    from kimi_perf.decode.model import DecodeState

    rank = config.shard(req.tp) if req.tp > 1 else config
    tokens = cache_tokens(req.context, req.warmup + req.steps, req.spec_tokens, req.graphs)
    state = DecodeState.bytes_of(rank, req.batch, tokens, 1 if req.kv_cache == "fp8" else 2, 2,
                                 1 + req.spec_tokens if req.spec_tokens else 0)
    prefill = prefill_bytes(rank, req.batch, req.context, 1 + req.spec_tokens, activations)
    # CUDA graphs: after the prefill, the graph's warm-up saves a copy of the whole state
    return req.tp * max(state + prefill, 2 * state if req.graphs else 0)


def prefill_bytes(config, batch: int, prompt: int, step_tokens: int = 1,
                  activations: bool = True, whole: bool = False) -> int:
    """About what the standard path's prefill of ``batch`` prompts of ``prompt`` tokens holds
    at its peak beside the caches: a gated-MLA layer's attention over the prompt (fp32
    scores for each head, three times over as masked and softmaxed, and the fp32 copy of the
    cache) and, with ``activations``, its activations (``forward_bytes``; a decode step's of
    ``step_tokens`` a sequence where that is more: fitted on the CPU, whose out-of-memory
    killer they are checked against; a GPU's out of memory is an error said in one line).
    The prompts go through ``prefill_rows`` sequences at a time, as the harness takes them
    (``whole``: all at once, as validate's prefill)."""
    from kimi_perf.decode.harness import prefill_rows
    from kimi_perf.decode.model import forward_bytes

    b, t = batch if whole else prefill_rows(batch, prompt), prompt
    has_mla = any(config.is_mla(i) for i in range(config.n_layers))
    scores = b * t * (t * (3 * 4 * config.mla_heads_local + 2) + 4 * config.kv_cache_dim) \
        if has_mla else 0
    return scores + (forward_bytes(config, max(b * t, batch * step_tokens)) if activations
                     else 0)


def decode_memory_problem(need: int, weights: int, device: str, sizes: str,
                          smaller: str = "batch, context or step count") -> str | None:
    """Why a run's caches and activations (``need`` bytes) cannot fit beside its weights,
    said before any work: a cache too large for the machine fills its memory page by page
    until the out-of-memory killer ends the process, with no error to say so. ``sizes``:
    the run's sizes, as the message names them; ``smaller``: what to make smaller."""
    free = available_memory(device)
    if free is None or weights + need <= free:
        return None
    return (f"out of memory for {sizes}: the KV caches and the prompt's activations take "
            f"about {_size(need)} beside about {_size(weights)} for the weights, and "
            f"{'the GPU' if device == 'cuda' else 'this machine'} has {_size(free)} free: "
            f"take a smaller {smaller}")


def _size(n: int) -> str:
    """``n`` bytes in decimal units to a decimal, in the unit whose figure stays under 1000 once
    rounded (999,999,999 bytes is 1.0 GB, not 1000.0 MB); TB past that."""
    for unit, scale in (("MB", 1e6), ("GB", 1e9)):
        if round(n / scale, 1) < 1000:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e12:,.1f} TB"


def available_memory(device: str) -> int | None:
    """Bytes free for a model on ``device``: the GPU's free memory, or the machine's
    available memory (Linux's MemAvailable, and below it what a container's cgroup limit
    leaves); None where unknown."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    free = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):   # cgroup v2; "max": no limit
        group = Path("/sys/fs/cgroup")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((group / "memory.current").read_text())
            free = left if free is None else min(free, left)
    return free


def _capture_all(req: TraceRequest, config, device: str, run_dir: Path, final: Path,
                 progress) -> tuple[dict, dict[str, Breakdown]]:
    from kimi_perf.decode.floors import Storage, floors
    from kimi_perf.decode.weights import random_weights

    run_info: dict[str, Any] = {
        "command": command_line(req), "request": _jsonable(dataclasses.asdict(req)),
        "preset": req.preset, "n_layers": config.n_layers, "config_hash": config.fingerprint(),
        "batch": req.batch, "tp": req.tp,
        # the TP whose one rank's shapes ran: a preset's own (k3-tp8 in one process), or --tp
        "rank_shapes_tp": max(config.tp, req.tp),
        "context": req.context, "decode_steps": req.steps,
        "warmup_steps": req.warmup, "spec_tokens": req.spec_tokens,
        "date": dt.datetime.now(dt.UTC).isoformat(),
        "environment": environment(device, req.tp), "paths": {},
        # what a layer of one rank must move at least, and its time at an H200's bandwidth:
        # the floor a GPU run's per-layer µs are held against (kimi-perf floors), its
        # attention over the cache the median profiled step reads at least: the prompt, a
        # token of each step before it (a verify step keeps 1 to 1+k), its own 1+k
        "floors": floors(config.shard(req.tp) if req.tp > 1 else config, req.batch,
                         req.context + req.warmup + req.steps // 2 + 1 + req.spec_tokens,
                         Storage(experts=req.experts, kv_cache=req.kv_cache),
                         tokens=1 + req.spec_tokens,
                         layer_types=tuple(t for t in ("kda", "mla", "dense")
                                           if t in config.layer_types())),
    }
    # The nsys backend draws the weights in each profiled process, from the same seed.
    weights = random_weights(config, seed=req.seed, device=device, experts=req.experts) \
        if req.backend == "torch" else None
    results: dict[str, Breakdown] = {}
    for path in req.paths:
        def done(units: int = 1, path: str = path) -> None:
            if progress:
                progress(f"{path}: prefill, {req.warmup} warm-up and {req.steps} "
                         f"{step_kind(req)} steps", units)
        done(0)
        if req.backend == "nsys":
            metrics, trace_file = _capture_path_nsys(path, req, device, run_dir)
            done(1 + req.warmup + req.steps)
        elif req.tp > 1:
            metrics, trace_file = _capture_path_ranks(path, config, weights, req, run_dir)
            done(1 + req.warmup + req.steps)
        else:
            from kimi_perf.decode.specialized import build_model

            model = build_model(config, weights, PATH_BACKENDS[path], device=device,
                                **path_options(req, path))
            trace_file = run_dir / f"{path}.trace.json.gz"
            metrics = _profile(model, req, device, trace_file, done)
            del model    # (its packed weights: not held while the next path's are made)
        try:
            trace = read_trace(trace_file)
            # where the trace will be (the run directory is filled under a temporary name),
            # from any directory: as its saved copy and its breakdown name it
            trace.meta["file"] = str(final.resolve() / trace_file.name)
            trace.save(run_dir / f"{path}.kptrace")
            results[path] = breakdown(trace)
        except TraceError as exc:   # (its file goes with the run: named as the path's)
            if exc.path is None or Path(exc.path).parent not in (run_dir, final.resolve()):
                raise
            raise TraceError(None, f"the {path} path's {Path(exc.path).name} (removed with the "
                                   f"unfinished run): {exc.problem}") from None
        del trace
        run_info["paths"][path] = metrics
    _write_outputs(run_dir, final, run_info, results,
                   f"kimi-perf trace: {req.preset}, {config.n_layers} layers, batch {req.batch} "
                   f"on {device}", req.plotly_js)
    return run_info, results


def step_kind(req: TraceRequest) -> str:
    """What a decode step of the request is: "decode", or "verify (1+k tokens)"."""
    return f"verify (1+{req.spec_tokens} tokens)" if req.spec_tokens else "decode"


def work_units(req: TraceRequest) -> int:
    return len(req.paths) * (1 + req.warmup + req.steps)


def _profile(model, req: TraceRequest, device: str, out: Path, done=None, ready=None) -> dict:
    """Prefill, warm-up and decode steps under the PyTorch profiler; the Kineto trace of the
    decode steps goes to ``out``. ``ready``: called once the profiler runs, before the
    prefill's timer starts (TP ranks meet there: a rank's time to first token would count
    the others' start-up otherwise)."""
    import torch

    from kimi_perf.decode.harness import run_decode
    from kimi_perf.decode.model import FP8

    # Without GPU kernels, the CPU trace counts the launches the paths annotate.
    model.annotate_ops = device == "cpu"
    gen = torch.Generator().manual_seed(req.seed + 1)
    prompt = torch.randint(0, model.c.vocab, (req.batch, req.context), generator=gen)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = profiler_schedule(req.warmup, req.steps, req.graphs)
    with _native_stderr_filtered(), torch.profiler.profile(activities=activities,
                                                            schedule=schedule) as prof:

        def after_step() -> None:
            prof.step()
            if done:
                done()
        if ready:
            ready()
        run = run_decode(model, prompt, steps=req.steps, warmup=req.warmup,
                         kv_dtype=FP8 if req.kv_cache == "fp8" else None,
                         after_step=after_step, cuda_graphs=req.graphs,
                         spec_tokens=req.spec_tokens, seed=req.seed)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        packed = gzip.compress(raw.read_bytes(), 6)
        atomic_write(out, lambda f: f.write(packed))
    fallbacks = list(getattr(model, "fallbacks", []))
    if not times_unprofiled(device):
        return _metrics(req, device, run.prefill_s, run.step_s[req.warmup:],
                        decode_tokens(run, req.warmup), fallbacks, type(model).__name__,
                        logits_finite=run.logits_finite)
    # CUPTI costs time per kernel, most on the path with the most kernels: the metrics come
    # from the same run again (prompt, drafts and acceptance too) with no profiler attached.
    again = run_decode(model, prompt, steps=req.steps, warmup=req.warmup,
                       kv_dtype=FP8 if req.kv_cache == "fp8" else None,
                       cuda_graphs=req.graphs, spec_tokens=req.spec_tokens, seed=req.seed)
    metrics = _metrics(req, device, again.prefill_s, again.step_s[req.warmup:],
                       decode_tokens(again, req.warmup), fallbacks, type(model).__name__,
                       timed="without a profiler: the profiled run's steps, run again",
                       logits_finite=run.logits_finite and again.logits_finite)
    metrics["profiled_step_latency_s"] = statistics.median(run.step_s[req.warmup:])
    return metrics


def times_unprofiled(device: str) -> bool:
    """Whether the decode metrics come from a second run without the profiler: on a GPU,
    where the profiler's cost per kernel would skew the paths' comparison (a CPU run's times
    are not a speed figure either way)."""
    return device == "cuda"


def decode_tokens(run, warmup: int) -> list[int]:
    """Tokens each profiled step produced over the batch: one per sequence, or with
    speculative decoding the tokens the sequences accepted."""
    profiled = run.tokens[:, warmup:]
    if run.accepted_counts:
        return profiled.sum(0).tolist()
    return [profiled.shape[0]] * profiled.shape[1]


def profiler_schedule(warmup: int, steps: int, graphs: bool):
    """Step 0 of the schedule is the prefill, then the warm-up steps, then the decode steps.

    Eager, only the decode steps are recorded. With CUDA graphs everything after the prefill
    is, the capture included (``run_decode`` captures after the prefill's step): its launches,
    inside the layer ranges, are what the replayed kernels map back to (``kimi_perf.graphs``);
    steps are the decode_step ranges either way.
    """
    import warnings

    import torch

    if graphs:
        return torch.profiler.schedule(wait=0, warmup=1, active=warmup + steps, repeat=1)
    with warnings.catch_warnings():   # --warmup 0 asks for none: torch need not warn of it
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        return torch.profiler.schedule(wait=1, warmup=warmup, active=steps, repeat=1)


def _capture_path_ranks(path: str, config, weights, req: TraceRequest, run_dir: Path
                        ) -> tuple[dict, Path]:
    """One process per TP rank (gloo), each profiling its shard; rank 0's trace is the one
    broken down, every rank's raw trace is kept."""
    from kimi_perf.decode.tp import run_on_cpu_ranks

    per_rank = run_on_cpu_ranks(req.tp, _rank_profile, weights, config, req, path,
                                str(run_dir))
    metrics = dict(per_rank[0])
    metrics["ranks"] = per_rank
    return metrics, run_dir / f"{path}.rank0.trace.json.gz"


def _rank_profile(rank: int, weights, config, req: TraceRequest, path: str, run_dir: str
                  ) -> dict:
    import torch

    from kimi_perf.decode.tp import rank_model

    model = rank_model(weights, config, rank, torch.bfloat16,
                       decode_backend=PATH_BACKENDS[path], **path_options(req, path))
    return _profile(model, req, "cpu", Path(run_dir) / f"{path}.rank{rank}.trace.json.gz",
                    ready=torch.distributed.barrier)


@contextlib.contextmanager
def _native_stderr_filtered():
    """libkineto writes "USDT: ... profiler_start/stop" lines straight to file descriptor 2,
    through any progress bar: hold fd 2 in a temporary file while profiling, then pass on
    every other line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(("USDT:", "INFO:")):
                    sys.stderr.write(line)


def _metrics(req: TraceRequest, device: str, prefill_s: float, steps: list[float],
             tokens: list[int], fallbacks: list[str], model: str, timed: str | None = None,
             logits_finite: bool | None = None) -> dict:
    """The decode metrics of one path, each on its own; ``tokens``: what each step produced
    over the batch (with speculative decoding, the accepted tokens); ``logits_finite``:
    the last step's logits all finite (``DecodeRun.logits_finite``)."""
    speculative = {"speculative": {
        "spec_tokens": req.spec_tokens,
        "accepted_tokens_per_step": round(sum(tokens) / len(tokens) / req.batch, 3),
        "acceptance": "synthetic: 1..1+k tokens per sequence, uniform, seeded"},
    } if req.spec_tokens else {}
    # (a kernel path that took none of the run's steps: its figures are the standard path's)
    every_step_fell_back = every_decode_step_fell_back(fallbacks, req.steps)
    return {
        "decode_tokens_per_s": sum(tokens) / sum(steps),
        "time_to_first_token_s": prefill_s,
        "step_latency_s": {"median": statistics.median(steps), "min": min(steps),
                           "max": max(steps)},
        "timed": (timed or f"under the profiler ({req.backend})") + (
            "" if device != "cpu"
            else "; on a CPU: not a speed figure" if model == "K3Model" or every_step_fell_back
            else "; on a CPU, Triton's interpreter running the kernels: not a speed figure"),
        "fallbacks": summarise(fallbacks),
        "every_step_fell_back": every_step_fell_back,
        # K3Model / StandardKernelsModel: the standard path's PyTorch ops or one kernel a step
        "model": model,
        "ops": "gpu kernels" if device == "cuda" else "cpu: annotated launches",
        "logits_finite": logits_finite,
        **speculative,
    }


def nsys_binary() -> str:
    nsys = nsys_cli()
    if not nsys:
        raise TraceError(None, f"{argument('--backend', 'backend', 'nsys')} needs the Nsight "
                               "Systems CLI: put nsys on PATH or set KIMI_PERF_NSYS "
                               "(scripts/install-nsys.sh installs one on Debian)")
    return nsys


# seconds nsys has, once told to stop, to stop the process it profiles and write its report
NSYS_STOP_S = 60


NSYS_LOCK = Path(tempfile.gettempdir()) / "kimi-perf-nsys.lock"


@contextlib.contextmanager
def one_nsys_capture_at_a_time(lock: Path | None = None):
    """Held while ``nsys profile`` or its export runs, so that a second capture on this
    machine waits: two profiles at once share nsys's session manager, and now and then one
    fails to import its own capture (it leaves a ``.qdstrm`` and no report). Other users'
    captures take turns too (the file is opened to read); unlocked where it can be neither
    made nor read."""
    import fcntl

    lock = lock or NSYS_LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)   # (flock needs no write)
    except OSError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"kimi-perf: waiting for another nsys capture on this machine to end "
                      f"(it holds {lock})", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _run_nsys(step: list[str]) -> subprocess.CompletedProcess:
    """An nsys command to its end. Where this process stops first (Ctrl-C, SIGTERM to it
    alone), nsys is sent SIGINT, which stops the process it profiles and writes its report:
    killed, nsys would die alone, as its launcher has put that process in a session of its
    own (SIGKILL only after NSYS_STOP_S, or a second signal; the worker then stops itself
    once this process has exited, ``worker.stop_when_gone``). nsys runs in a process group
    of its own, so that the SIGINT it gets is this one alone (a terminal's Ctrl-C and then
    ours would be two)."""
    with subprocess.Popen(step, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", process_group=0) as nsys:
        try:
            out, err = nsys.communicate()
        except BaseException:
            nsys.send_signal(signal.SIGINT)
            print(f"kimi-perf: stopping nsys and the process it profiles (at most "
                  f"{NSYS_STOP_S} s; a second signal kills nsys at once)", file=sys.stderr)
            try:
                nsys.communicate(timeout=NSYS_STOP_S)
            except BaseException:   # (not stopped in time, or a second signal)
                nsys.kill()
            raise
    return subprocess.CompletedProcess(step, nsys.returncode, out, err)


def nsys_profile_command(req: TraceRequest, path: str, device: str, run_dir: Path
                         ) -> list[str]:
    """``nsys profile`` running one path in ``kimi_perf.decode.worker``, its report
    ``run_dir/PATH.nsys-rep``; the worker writes its metrics to ``run_dir/.PATH.metrics.json``
    and stops once this process has exited."""
    request = {"preset": req.preset, "n_layers": req.n_layers, "seed": req.seed,
               "batch": req.batch, "context": req.context, "steps": req.steps,
               "warmup": req.warmup, "kv_cache": req.kv_cache, "graphs": req.graphs,
               "spec_tokens": req.spec_tokens, "options": path_options(req, path)}
    traced = "nvtx,cuda" if device == "cuda" else "nvtx"
    return [nsys_binary(), "profile", f"--trace={traced}", "--sample=none", "--cpuctxsw=none",
            "--force-overwrite=true", "-o", str(run_dir / path)] + (
        ["--cuda-graph-trace=node"] if req.graphs else []) + [
        sys.executable, "-m", "kimi_perf.decode.worker", json.dumps(request), path,
        str(run_dir / f".{path}.metrics.json"), str(os.getpid())]


def _capture_path_nsys(path: str, req: TraceRequest, device: str, run_dir: Path
                       ) -> tuple[dict, Path]:
    """The path in its own process under ``nsys profile`` (NVTX, and CUDA on a GPU), then
    ``nsys export`` to SQLite, which the trace core reads."""
    cmd = nsys_profile_command(req, path, device, run_dir)
    nsys, rep = cmd[0], run_dir / f"{path}.nsys-rep"
    sqlite = run_dir / f"{path}.sqlite"
    metrics_file = run_dir / f".{path}.metrics.json"
    for step in (cmd, [nsys, "export", "--type", "sqlite", "--force-overwrite=true", "-o",
                       str(sqlite), str(rep)]):
        with one_nsys_capture_at_a_time():
            result = _run_nsys(step)
        if result.returncode != 0:
            if "Traceback (most recent call last)" in (result.stderr or ""):
                # a bug, not bad input: what the profiled program printed, then the line
                print(result.stderr.rstrip(), file=sys.stderr)
            raise TraceError(None, f"the {path} path: {nsys_failure(result)}")
        if step is not cmd:
            continue
        if not metrics_file.exists():   # (nsys exited 0 all the same)
            raise TraceError(None, f"nsys profile ended before the {path} path had run its "
                                   "steps (the profiled process was stopped, or never started)")
        if not rep.exists():
            why = nsys_reason(result)
            raise TraceError(None, f"the {path} path: {nsys} profile exited 0 but wrote no "
                                   f"report" + (f" ({why})" if why else ""))
    if not sqlite.exists():
        raise TraceError(None, f"the {path} path: {nsys} export exited 0 but wrote no SQLite "
                               "export")
    worker = json.loads(metrics_file.read_text())
    metrics_file.unlink()
    if not has_nvtx_ranges(sqlite):
        raise TraceError(None, f"the {path} path: nsys recorded none of its NVTX ranges"
                               + _nvtx_hint(worker["nvtx"]))
    return _metrics(req, device, worker["prefill_s"], worker["step_s"], worker["tokens"],
                    worker["fallbacks"], worker["model"],
                    logits_finite=worker["logits_finite"]), sqlite


def _nvtx_hint(binding: str) -> str:
    """Why nsys heard no range from the ``nvtx`` package release that recorded them (the
    worker names it; on a GPU, torch's binding)."""
    try:
        release = tuple(int(part) for part in binding.split(".")[:3])
    except ValueError:   # (torch.cuda.nvtx, or a release the worker could not name)
        return ""
    if release >= (0, 2, 12):
        return (f" (nvtx {binding} is installed: from 0.2.12 the nvtx package switches itself "
                "off under nsys 2023.4, docs/nsys-on-a-cpu.md; pip install nvtx==0.2.11)")
    return f" (nvtx {binding} is installed; kimi-perf is tested with 0.2.11)" \
        if release != (0, 2, 11) else ""


def run_document(run_dir: Path, results: dict[str, Breakdown], run_info: dict,
                 lazy_layers: bool = False) -> dict:
    """What ``kimi-perf trace --format json`` prints of a ``capture`` or ``analyse``: the run,
    each path's (or trace's) breakdown, and the first set against each of the others; of
    three or more, also every one in one overview, as the table shows them (a row per device
    of a trace of several); of fewer, each trace of several devices its own
    (``device_overviews``); which ranks' traces are missing, where some are
    (``missing_rank_labels``) (``lazy_layers``: see ``Breakdown.to_json``)."""
    from kimi_perf.comparison import (
        Comparison,
        device_overviews,
        overview,
        overview_json,
    )

    first, *others = results
    fell_back = paths_that_fell_back(run_info)
    comparisons = []
    for other in others:
        c = Comparison.of(results[first], results[other], first, other,
                          [fell_back_text(p, why) for p, why in fell_back.items()
                           if p in (first, other)])
        comparisons.append({"a": first, "b": other, "rows": [r.to_json() for r in c.rows],
                            "notes": c.notes, **({"fell_back": c.fell_back} if c.fell_back
                                                 else {})})
    doc = {"schema": 1, "run_dir": str(run_dir), "run": run_info,
           "paths": {k: b.to_json(lazy_layers) for k, b in results.items()},
           "comparisons": comparisons}
    if missing := missing_rank_labels(list(results)):   # (a job's folder, a rank's trace gone)
        doc["ranks_missing"] = missing
    if len(results) >= 3:
        doc["overview"] = overview_json(overview(results))
    if devices := device_overviews(results):   # (one file of a TP job: which rank is slow)
        doc["devices"] = {label: overview_json(rows) for label, rows in devices.items()}
    return doc


def analyse(files: list[str | Path], out_dir: str | Path, layers: str = "auto",
            phase: str = "auto", rules: str | Path | None = None,
            plotly_js: str | Path = "inline",
            step_regex: str | None = None, captures: list[str | Path] | None = None
            ) -> tuple[Path, dict[str, Breakdown], dict]:
    """``--from``: breakdowns of existing traces, labelled by file name (``rules``: a TOML
    file of extra kernel-class rules; ``captures``: one for each trace, as ``--capture``
    gives them, the graph captures saved apart from it, see ``read_trace``). Paths may be
    given as strings, a list of them: the run directory, its ``breakdown.json``, ``run.json``
    and report, is made in ``out_dir``; returned with the breakdowns by label and the run
    information (as ``run.json`` holds it)."""
    from kimi_perf.classify import load_rules
    from kimi_perf.report import check_plotly_js

    files = path_list(files, "files", "traces")
    check_plotly_js(plotly_js)   # (before any trace is broken down)
    out_dir, plotly_js = path_argument(out_dir, "out_dir"), str(plotly_js)
    if captures is None:   # (a directory: its traces, as trace --from takes them)
        files = trace_files(files)
    if not files:
        raise ValueError("files: one trace or more, not an empty list")
    seen: dict[str, Path] = {}
    for file in files:   # (a trace against itself: every ratio 1.00, no comparison)
        if (twin := seen.setdefault(os.path.realpath(file), file)) is not file:
            raise TraceError(file, f"given twice{also_as(file, twin)}: each trace once")
    if (again := same_capture(files)) is not None:
        raise TraceError(again[0], f"given twice ({again[1]}): each capture once")
    if captures is not None and (len(captures) != len(files) or None in captures):
        raise TraceError(None, f"captures: one file for each of the {len(files)} traces, "
                               f"in their order: not {captures!r}")
    captures = None if captures is None else [Path(c) for c in captures]
    rules = None if rules is None else Path(rules)

    loaded = load_rules(rules)
    results: dict[str, Breakdown] = {}
    paired = captures or [None] * len(files)
    for f, c, label in zip(files, paired, trace_labels(files), strict=True):
        results[label] = breakdown_of_file(f, c, layers=layers, phase=phase, rules=loaded,
                                           step_regex=step_regex)
    command = ["kimi-perf", "trace", *(a for f in files for a in ("--from", str(f))),
               *(a for c in captures or () for a in ("--capture", str(c))),
               *(("--layers", layers) if layers != "auto" else ()),
               *(("--steps", step_regex) if step_regex is not None else ()),
               *(("--phase", phase) if phase != "auto" else ()),
               *(("--rules", str(rules)) if rules is not None else ()), "--out", str(out_dir),
               *(("--plotly-js", plotly_js) if plotly_js != "inline" else ())]
    run_info = {"command": shlex.join(command), "files": [],
                "date": dt.datetime.now(dt.UTC).isoformat(), "kimi_perf": __version__,
                "git_commit": git_commit()}
    with run_directory(out_dir, "from") as (run_dir, final):
        # relative to the run directory: read from any directory, and still found when the
        # run and its traces move together (a repository that keeps both)
        run_info["files"] = [os.path.relpath(f.resolve(), final.resolve()) for f in files]
        if captures:
            run_info["captures"] = [os.path.relpath(c.resolve(), final.resolve())
                                    for c in captures]
        for b, file, capture_file in zip(results.values(), run_info["files"],
                                         run_info.get("captures") or paired, strict=True):
            # (the breakdowns name them so too: not relative to where trace ran)
            b.source["file"] = file
            if capture_file is not None and b.source.get("captures"):
                b.source["captures"] = [capture_file]
        _write_outputs(run_dir, final, run_info, results,
                       "kimi-perf: " + ", ".join(f.name for f in files), plotly_js)
    return final, results, run_info


def _write_outputs(run_dir: Path, final: Path, run_info: dict, results: dict[str, Breakdown],
                   title: str, plotly_js: str) -> None:
    from kimi_perf.report import write_report

    run_info["report"] = "report.html"     # relative to the run directory, as its traces
    # (a plotly.min.js of the user's is referred to from run_dir's sibling final alike)
    write_report(run_dir / "report.html", results, title, run_info, plotly_js)
    atomic_write_text(run_dir / "run.json", json_text(run_info))
    doc = {"schema": 1, "run": run_info,
           "paths": {k: b.to_json(lazy_layers=True) for k, b in results.items()}}
    atomic_write_text(run_dir / "breakdown.json", json_text(doc))


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


