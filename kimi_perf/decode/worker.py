"""One decode path run for ``kimi-perf trace --backend nsys``, inside ``nsys profile``.

    python -m kimi_perf.decode.worker REQUEST_JSON PATH METRICS_JSON KIMI_PERF_PID
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import select
import signal
import sys
import threading


def nvtx_release() -> str:
    try:
        return importlib.metadata.version("nvtx")
    except importlib.metadata.PackageNotFoundError:   # (imported from a folder of its own)
        return "unknown"


def stop_when_gone(pid: int) -> None:
    """Exit once process ``pid`` (the kimi-perf that asked for this run) has: nsys's launcher
    puts this process in a session of its own, so that nothing else stops it where kimi-perf
    is killed, or kills an nsys that would not stop (its steps could run for hours). Started
    before torch is imported (seconds in which the pid could be another's); no watch where the
    kernel has no pidfd (Linux before 5.3)."""
    try:
        gone = os.pidfd_open(pid)
    except ProcessLookupError:
        gone = None
    except (OSError, AttributeError):
        return

    def watch() -> None:
        if gone is not None:   # (readable once the process has exited, reaped or not)
            select.select([gone], [], [])
        with contextlib.suppress(OSError):   # (stderr a pipe no one reads now)
            print(f"kimi-perf (process {pid}) that asked for this run has exited: stopping",
                  file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="stop-when-kimi-perf-is-gone").start()


def main(argv: list[str]) -> int:
    request, path, metrics_out = json.loads(argv[0]), argv[1], argv[2]
    # nsys stops the process it profiles with SIGINT and waits for it a moment: taken as
    # Python's KeyboardInterrupt, this process (torch imported) ended too slowly: nsys left
    # first (exit 0) and it outlived nsys; the default action ends it at once
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    stop_when_gone(int(argv[3]))
    import torch

    from kimi_perf.capture import PATH_BACKENDS, decode_tokens
    from kimi_perf.decode.annotate import NVTX
    from kimi_perf.decode.config import preset
    from kimi_perf.decode.harness import run_decode
    from kimi_perf.decode.model import FP8
    from kimi_perf.decode.specialized import build_model
    from kimi_perf.decode.weights import random_weights

    if NVTX is None:
        print("no NVTX binding: on a CPU, pip install nvtx==0.2.11", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = preset(request["preset"], n_layers=request["n_layers"])
    options = request["options"]    # (capture.path_options: this path's)
    weights = random_weights(config, seed=request["seed"], device=device,
                             experts=options["experts"])
    model = build_model(config, weights, PATH_BACKENDS[path], device=device, **options)
    model.annotate_ops = device == "cpu"
    gen = torch.Generator().manual_seed(request["seed"] + 1)
    prompt = torch.randint(0, config.vocab, (request["batch"], request["context"]),
                           generator=gen)
    run = run_decode(model, prompt, steps=request["steps"], warmup=request["warmup"],
                     kv_dtype=FP8 if request["kv_cache"] == "fp8" else None,
                     cuda_graphs=request["graphs"], spec_tokens=request["spec_tokens"],
                     seed=request["seed"])
    steps = run.step_s[request["warmup"]:]
    with open(metrics_out, "w") as f:
        json.dump({"prefill_s": run.prefill_s, "step_s": steps,
                   "tokens": decode_tokens(run, request["warmup"]),
                   "fallbacks": list(getattr(model, "fallbacks", [])),
                   "model": type(model).__name__, "logits_finite": run.logits_finite,
                   # what recorded the ranges: a release of the nvtx package that nsys may
                   # not hear (docs/nsys-on-a-cpu.md)
                   "nvtx": "torch.cuda.nvtx" if device == "cuda" else nvtx_release()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
