"""Helpers for kernel tests: poisoned outputs and bf16-aware tolerances.

A kernel that sums in another order than its reference, or rounds an intermediate it re-reads
(a prefix, a split's partial result), moves what follows by about an ulp of the row's scale:
an element near 0 may be many of its own ulps off. Each element is therefore allowed a few
bf16 ulps of max(|element|, row RMS); and, so that a kernel off by a percent everywhere
(a wrong scale, a missed term) cannot hide inside that, almost every element must be within
one ulp of its own value (the launchers round to nearest even, as a GPU and PyTorch do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BF16_EPS = 2.0**-7  # spacing of bf16 just above 1.0 (8 significant bits)
# A kernel that rounds an operand of its tensor-core dot to bf16, as a GPU takes it
# (``kimi_perf_kernels.common.mma``), where no reference can round alike (the softmax's P
# before P · V, rounded after each block's running max: skinny_linear's x · norm has a
# reference that rounds it, ``dot_dtype``), is that much off the fp32 reference: up to 14% of
# these tests' elements fall more than one ulp of their own value off (none past 1.2 ulps of
# the row's scale); a kernel a percent off everywhere would put nearly all of them there.
ROUNDED_OPERAND = 0.25


def poison(*tensors: torch.Tensor) -> None:
    """Fill buffers a kernel should overwrite with NaN, so a missed store cannot pass."""
    for t in tensors:
        t.fill_(float("nan"))


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 2.0,
                      beyond_own_ulp: float = 0.005) -> None:
    """Every element within ``ulps`` of max(|element|, row RMS); at most a share
    ``beyond_own_ulp`` of them more than one bf16 ulp of their own value off."""
    a, e = actual.float(), expected.float()
    assert a.shape == e.shape, (a.shape, e.shape)
    assert not torch.isnan(a).any(), "NaN in kernel output (an element was never written)"
    # (a NaN in the reference would make its row's tolerance NaN, and the row pass unchecked)
    assert torch.isfinite(e).all(), "the reference holds NaN or infinity"
    row_rms = e.pow(2).mean(-1, keepdim=True).sqrt() if e.dim() else e.abs()
    tol = ulps * BF16_EPS * torch.maximum(e.abs(), row_rms).clamp_min(1e-6)
    bad = (a - e).abs() > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements differ; worst "
                           f"{float(((a - e).abs() / tol)[bad].max()):.2f}× the tolerance")
    beyond = ((a - e).abs() > BF16_EPS * e.abs()).float().mean()
    assert beyond <= beyond_own_ulp, (f"{float(beyond):.2%} of the elements are more than one "
                                      f"bf16 ulp of their own value off (at most "
                                      f"{beyond_own_ulp:.2%})")


def assert_close_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """e4m3 values as the reference rounds them: bit for bit but for a rare value whose
    input summed in another order (one bf16 ulp off, then one fp8 step at most)."""
    assert actual.dtype == expected.dtype == torch.float8_e4m3fn, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not torch.isnan(actual.float()).any(), "NaN in kernel output"
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0.13, atol=2e-3)
    differ = actual.view(torch.uint8) != expected.view(torch.uint8)
    assert differ.float().mean() <= 0.005, f"{int(differ.sum())} of {differ.numel()} differ"


@contextlib.contextmanager
def program_order(reverse: bool) -> Iterator[None]:
    """Within it, the interpreter runs a grid's programs last to first (``reverse``) or
    first to last, whatever order was set outside. It runs them one at a time in grid order,
    where a GPU runs them in any order and at once: a kernel whose programs share memory
    (one writes what another reads) must give the same result in both orders, or one program
    depends on running before another."""
    from triton.runtime.interpreter import InterpreterBuilder

    def backward(self, x, y, z):
        gx, gy, gz = self.grid_dim
        _FORWARD(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)

    before = InterpreterBuilder.set_grid_idx
    InterpreterBuilder.set_grid_idx = backward if reverse else _FORWARD
    try:
        yield
    finally:
        InterpreterBuilder.set_grid_idx = before


def _grid_order():
    from triton.runtime.interpreter import InterpreterBuilder

    return InterpreterBuilder.set_grid_idx


_FORWARD = _grid_order()


class RecordingGemv:
    """A stand-in for the CuTe DSL GEMV's launcher (which needs a GPU): builds for the given
    (N, K) shapes at 1-4 tokens, computed by the reference, calls recorded."""

    def __init__(self, shapes: dict[str, tuple[int, int]]):
        self.builds = {(m, n, k): None for n, k in shapes.values() for m in range(1, 5)}
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, x, w):
        from kimi_perf_kernels.skinny_linear import skinny_linear_reference

        self.calls.append((x.shape[0], *w.shape))
        return skinny_linear_reference(x, w).to(x.dtype)
