"""Tensor parallelism with torch.distributed: each rank holds its shard and all-reduces the
row-parallel outputs (gloo on the CPU, NCCL on GPUs)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi_perf.errors import TraceError, is_out_of_memory

if TYPE_CHECKING:   # (the model chooses Triton's interpreter: not where threads are counted)
    from kimi_perf.decode.config import K3Config
    from kimi_perf.decode.model import K3Model
    from kimi_perf.decode.weights import Weights


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place (one collective launch, no copy); on gloo, whose
    builds do not all reduce bf16 or fp16, those through an fp32 copy (a float64 keeps its
    own precision)."""
    if dist.get_backend() == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
        y = x.float()
        dist.all_reduce(y)
        return x.copy_(y)
    dist.all_reduce(x)
    return x


def rank_model(full: Weights, c: K3Config, rank: int, dtype: torch.dtype,
               device: str = "cpu", decode_backend: str = "auto", **options) -> K3Model:
    """This rank's model of either path (``c`` is the full config; it is sharded here);
    ``options``: ``build_model``'s, the path's own (``capture.path_options``)."""
    from kimi_perf.decode.specialized import build_model
    from kimi_perf.decode.weights import shard

    tp = dist.get_world_size()
    sharded = c.shard(tp)
    return build_model(sharded, shard(full, sharded, rank), decode_backend, dtype=dtype,
                       device=device, all_reduce=all_reduce_sum if tp > 1 else None, **options)


def rank_threads(world: int) -> int:
    """The threads each of ``world`` CPU ranks runs with: an equal share of this process's."""
    return max(1, torch.get_num_threads() // world)


def _worker(rank: int, world: int, init_file: str, fn: Callable, args: tuple,
            out_dir: str, threads: int, parent: int) -> None:
    _die_with(parent)
    # the ranks share this machine's cores: each one with all of them, they time each
    # other's contention (a TP 2 step four times as long on two cores)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        result = fn(rank, *args)
        # (a rank that left first fails another still connecting: "connection closed by peer")
        dist.barrier()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException as exc:
        _save_failure(out_dir, rank, exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_cpu_ranks(world: int, fn: Callable, *args) -> list:
    """Run ``fn(rank, *args)`` in ``world`` gloo processes; return each rank's result.

    ``fn`` must be importable (a module-level function) since the ranks are spawned; each
    rank gets an equal share of this process's threads (``torch.get_num_threads``). Where
    this process stops first (Ctrl-C, SIGTERM to it alone), the ranks are stopped with it:
    left running, they would hold its exit until they had done all their work; SIGKILLed,
    the ranks are killed with it and its temporary directory removed. A rank that
    raises a ``TraceError`` or runs out of memory raises it here too, as if this process had
    (the CLI's one-line errors), and so does one killed (a ``TraceError`` saying by what);
    any other failure is torch's, with the rank's traceback.
    """
    with _rank_directory() as tmp:
        init_file = os.path.join(tmp, "init")
        threads = rank_threads(world)
        ranks = mp.start_processes(
            _worker, args=(world, init_file, fn, args, tmp, threads, os.getpid()),
            nprocs=world, join=False)
        try:
            with _quiet_spawn_log():  # its warning that it stops the other ranks
                while not ranks.join():
                    pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            # (torch has stopped the others, with SIGTERM)
            exit_codes = [p.exitcode for p in ranks.processes]
            _stop(ranks.processes)
            _raise_rank_failure(Path(tmp), exc.error_index, exit_codes,
                                [p.pid for p in ranks.processes])
            if isinstance(exc, mp.ProcessExitedException):   # (nothing raised to say)
                raise TraceError(None, f"TP rank {exc.error_index} exited: exit code "
                                       f"{exc.exit_code}") from None
            raise
        except BaseException:
            _stop(ranks.processes)
            raise
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


def _die_with(parent: int) -> None:
    """SIGKILL this rank when the process that started it ends, however it ends (torch asks
    for a SIGINT, which a rank waiting in gloo's rendezvous, holding the GIL, never handles:
    it would wait out gloo's 30 minutes). Linux only."""
    if sys.platform != "linux":
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:   # (it ended before the request was made)
        os._exit(1)


# Reads its stdin, which only this process holds open, to its end: that comes when this
# process closes it or ends, however (a SIGKILL too). Nothing said first: it was killed, and
# the ranks' directory is removed (again while a rank dying yet writes into it).
_REMOVER = """
import os, shutil, sys, time
if not sys.stdin.buffer.read():
    for _ in range(20):
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        if not os.path.exists(sys.argv[1]):
            break
        time.sleep(0.1)
"""


@contextlib.contextmanager
def _rank_directory():
    """A temporary directory for the ranks, removed on the way out, and where this process
    is SIGKILLed while the ranks run (nothing of it runs then) by a process of its own
    session, which a signal to this process's group does not reach either."""
    directory = tempfile.mkdtemp(prefix="kimi-perf-tp-")
    remover = None
    try:
        remover = subprocess.Popen([sys.executable, "-I", "-c", _REMOVER, directory],
                                   stdin=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if remover is not None:
            with contextlib.suppress(BrokenPipeError):   # (a remover gone: nothing to tell)
                remover.stdin.write(b"removed")
                remover.stdin.close()
            remover.wait()


@contextlib.contextmanager
def _quiet_spawn_log():
    log = logging.getLogger("torch.multiprocessing.spawn")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _save_failure(out_dir: str, rank: int, exc: BaseException) -> None:
    """What the parent re-raises, and when the rank failed: a ``TraceError``'s file and
    problem, an allocation failure's message, or any other failure's traceback (exceptions
    themselves do not all pickle: TraceError's do not)."""
    if isinstance(exc, TraceError):
        failure = ("TraceError", exc.path, exc.problem)
    elif is_out_of_memory(exc):
        failure = ("MemoryError", None, str(exc).strip())
    else:
        failure = ("other", None, traceback.format_exc())
    # (whole or not at all: torch may stop this rank while it writes, another rank's failure
    # seen first)
    saving = Path(out_dir) / f"rank{rank}.failure.pt.saving"
    torch.save((time.monotonic(), *failure), saving)
    saving.replace(saving.with_suffix(""))


def _raise_rank_failure(tmp: Path, first: int, exit_codes: list[int | None],
                        pids: list[int]) -> None:
    """Raise what stopped the ranks, where it is not what torch raised (``first``: the rank
    torch saw fail first, which may have failed for another's sake: its rendezvous or
    collective with a rank that had ended, "connection closed by peer"). A rank killed by a
    signal (another's SIGTERM aside: torch stops the others with it), else the rank that
    failed first: its ``TraceError`` or allocation failure, or any other failure as torch
    would have raised it of that rank."""
    for rank, code in enumerate(exit_codes):
        if code is not None and code < 0 and (rank == first or -code != signal.SIGTERM):
            name = (signal.Signals(-code).name if -code in signal.valid_signals()
                    else f"signal {-code}")
            hint = (" (the out-of-memory killer sends it where memory runs out)"
                    if name == "SIGKILL" else "")
            raise TraceError(None, f"TP rank {rank} exited: killed by {name}{hint}") from None
    failures = [(*torch.load(file), rank) for rank in range(len(exit_codes))
                if (file := tmp / f"rank{rank}.failure.pt").exists()]
    if not failures:
        return
    _, kind, path, said, rank = min(failures, key=lambda failure: failure[0])
    if kind == "TraceError":
        raise TraceError(path, said) from None
    if kind == "MemoryError":
        raise MemoryError(f"TP rank {rank}: {said}") from None
    if rank != first:
        raise mp.ProcessRaisedException(
            f"\n\n-- Process {rank} terminated with the following error:\n{said}", rank,
            pids[rank]) from None


def _stop(processes: list, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL for a rank still alive after ``grace_s``."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join()
