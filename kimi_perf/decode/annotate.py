"""Ranges around steps, layers and launches: for the PyTorch profiler (``record_function``)
and, through NVTX, for Nsight Systems."""

from __future__ import annotations

import contextlib

import torch


def nvtx_range_functions():
    """(push, pop) for NVTX ranges Nsight Systems records: torch's binding on a GPU build, else
    the ``nvtx`` package (pinned to 0.2.11: later versions switch themselves off under nsys
    2023.4, see docs/nsys-on-a-cpu.md), else None."""
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.push_range, nvtx.pop_range


NVTX = nvtx_range_functions()


@contextlib.contextmanager
def annotate(name: str):
    """A range visible to the PyTorch profiler and, through NVTX, to Nsight Systems."""
    if NVTX:
        NVTX[0](name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if NVTX:
            NVTX[1]()
