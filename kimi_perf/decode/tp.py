"""Tensor parallelism with torch.distributed: each rank holds its shard and all-reduces the
row-parallel outputs (gloo on the CPU, NCCL on GPUs)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
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
    """Sum over the ranks, in place (one collective launch, no copy); gloo lacks bf16
    reductions, so there it reduces an fp32 copy."""
    if dist.get_backend() == "gloo" and x.dtype != torch.float32:
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
            out_dir: str, threads: int) -> None:
    # the ranks share this machine's cores: each one with all of them, they time each
    # other's contention (a TP 2 step four times as long on two cores)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.save(fn(rank, *args), Path(out_dir) / f"rank{rank}.pt")
    except BaseException as exc:
        _save_failure(out_dir, rank, exc)
        raise
    finally:
        dist.destroy_process_group()


def run_on_cpu_ranks(world: int, fn: Callable, *args) -> list:
    """Run ``fn(rank, *args)`` in ``world`` gloo processes; return each rank's result.

    ``fn`` must be importable (a module-level function) since the ranks are spawned; each
    rank gets an equal share of this process's threads (``torch.get_num_threads``). Where
    this process stops first (Ctrl-C, SIGTERM to it alone), the ranks are stopped with it:
    left running, they would hold its exit until they had done all their work. A rank that
    raises a ``TraceError`` or runs out of memory raises it here too, as if this process had
    (the CLI's one-line errors), and so does one killed (a ``TraceError`` saying by what);
    any other failure is torch's, with the rank's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="kimi-perf-tp-") as tmp:
        init_file = os.path.join(tmp, "init")
        threads = rank_threads(world)
        ranks = mp.start_processes(_worker, args=(world, init_file, fn, args, tmp, threads),
                                   nprocs=world, join=False)
        try:
            with _quiet_spawn_log():  # its warning that it stops the other ranks
                while not ranks.join():
                    pass
        except mp.ProcessRaisedException as exc:
            _stop(ranks.processes)
            _raise_rank_failure(Path(tmp), exc.error_index)
            raise
        except mp.ProcessExitedException as exc:   # (a signal: nothing raised to say)
            _stop(ranks.processes)
            how = (f"killed by {exc.signal_name}" + (
                " (the out-of-memory killer sends it where memory runs out)"
                if exc.signal_name == "SIGKILL" else "") if exc.signal_name
                else f"exit code {exc.exit_code}")
            raise TraceError(None, f"TP rank {exc.error_index} exited: {how}") from None
        except BaseException:
            _stop(ranks.processes)
            raise
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


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
    """What the parent re-raises: a ``TraceError``'s file and problem, or an allocation
    failure's message (exceptions themselves do not all pickle: TraceError's do not)."""
    if isinstance(exc, TraceError):
        failure = ("TraceError", exc.path, exc.problem)
    elif is_out_of_memory(exc):
        failure = ("MemoryError", None, str(exc).strip())
    else:
        return
    torch.save(failure, Path(out_dir) / f"rank{rank}.failure.pt")


def _raise_rank_failure(tmp: Path, rank: int) -> None:
    failure_file = tmp / f"rank{rank}.failure.pt"
    if not failure_file.exists():
        return
    kind, path, said = torch.load(failure_file)
    if kind == "TraceError":
        raise TraceError(path, said) from None
    raise MemoryError(f"TP rank {rank}: {said}") from None


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
