"""What the kernels share: device functions (casts, the PDL wait, the interpreter's
workarounds), the host's launch switches (``gpu_tiles``, ``programmatic_launch``) and its
check of the layouts the kernels read (``check_layout``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

# Triton's interpreter (TRITON_INTERPRET=1, the CPU) differs from a GPU in ways the kernels
# work around: bf16 tl.dot is wrong there (products are taken in fp32); fp32 -> bf16
# conversion truncates where a GPU rounds to nearest even; fp32 -> fp8 e4m3 rounding drops
# the carry into the exponent (-1.97 becomes -1.0) and truncates subnormals. Both conversions
# are emulated: the value is first rounded to nearest even in fp32, so the conversion itself
# is exact.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# The interpreter pays per program and per op, not per element, so launchers give it whole
# dimensions as tiles: every tile loop runs once. ``gpu_tiles()`` makes them take a GPU's
# tiles instead, so that a test runs each loop over several tiles as a GPU does.
_gpu_tiles = False


def interpreter_tiles() -> bool:
    """Whether launchers pick the interpreter's whole-dimension tiles rather than a GPU's."""
    return INTERPRETED and not _gpu_tiles


@contextlib.contextmanager
def gpu_tiles() -> Iterator[None]:
    """Within it, launchers under the interpreter pick the tiles they pick on a GPU."""
    global _gpu_tiles
    before, _gpu_tiles = _gpu_tiles, True
    try:
        yield
    finally:
        _gpu_tiles = before


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
# kernel before it on the stream still runs, once every program of that one has passed its
# ``gdc_launch_dependents``; it waits (``gdc_wait``) before it touches memory. What that buys
# at decode's batch sizes: the next launch's setup and its programs' start overlap the tail
# of the one before, not one gap per launch (about a microsecond each, 9 to 12 a layer).
_pdl = False
_prefetch_bytes = 0


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True, prefetch_bytes: int = 0) -> Iterator[None]:
    """Within it, the decode paths' kernels launch with PDL (the interpreter has no
    ``griddepcontrol``: there the kernels take the launch flag and leave the instructions
    out). ``prefetch_bytes``: what each skinny linear may read of its weights into L2 before
    its wait, while the kernel before it runs (``weight_prefetch_bytes``)."""
    global _pdl, _prefetch_bytes
    before = _pdl, _prefetch_bytes
    _pdl, _prefetch_bytes = enabled, prefetch_bytes if enabled else 0
    try:
        yield
    finally:
        _pdl, _prefetch_bytes = before


def launch_options() -> dict[str, bool]:
    """The launch keywords of every kernel that takes part in PDL: its ``PDL`` constexpr and
    Triton's ``launch_pdl`` flag."""
    return {"PDL": _pdl and not INTERPRETED, "launch_pdl": _pdl}


def weight_prefetch_bytes() -> int:
    """How much of its weights a launch may read into L2 before its PDL wait: weights are
    nothing the kernel before it writes (0 outside ``programmatic_launch``, and under the
    interpreter, which has no inline assembly)."""
    return 0 if INTERPRETED else _prefetch_bytes


def check_layout(what: str, whole: dict[str, torch.Tensor | None],
                 rows: dict[str, torch.Tensor | None],
                 shapes: dict[str, tuple[int, ...]] | None = None,
                 dtypes: dict[str, tuple[torch.dtype, ...]] | None = None) -> None:
    """Kernels index ``whole`` tensors by their element and ``rows`` by a row stride with
    contiguous columns, each tensor of the shape (``shapes``) and dtype (``dtypes``) the
    kernel reads, all on one device: anything else would be read wrong (past a tensor's end,
    a strided view's other elements), not refused, so it is refused here, on the host. (Each
    eager launch pays this: a few µs of Python, no allocation.)"""
    device = None
    for kind, tensors in (("be contiguous", whole), ("have contiguous rows", rows)):
        for name, t in tensors.items():
            if t is None:
                continue
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{what}: {name} is on {t.device}, the others on {device}: "
                                 "all must be on one device")
            if not (t.is_contiguous() if tensors is whole else t.stride(-1) == 1):
                raise ValueError(f"{what}: {name} must {kind}")
    for checks in (shapes or {}, dtypes or {}):
        for name in checks:
            if name not in whole and name not in rows:   # (a misspelt name checks nothing)
                raise TypeError(f"check_layout: {what} names no tensor {name!r}")
    for name, shape in (shapes or {}).items():
        t = whole.get(name) if name in whole else rows.get(name)
        if t is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{what}: {name} is {list(t.shape)}, not {list(shape)}")
    for name, kinds in (dtypes or {}).items():
        t = whole.get(name) if name in whole else rows.get(name)
        if t is not None and t.dtype not in kinds:
            raise ValueError(f"{what}: {name} is {t.dtype}, not "
                             f"{' or '.join(map(str, kinds))}")


def check_whole_tiles(what: str, **sizes: int) -> None:
    """Sizes a kernel tiles with ``tl.arange(0, SIZE)``, unmasked, must be powers of two:
    refused on the host, in one line, rather than failing Triton's compile (or, masked
    nowhere, read past)."""
    if not all(n > 0 and n & (n - 1) == 0 for n in sizes.values()):
        said = " and ".join(f"{name} {n}" for name, n in sizes.items())
        must = "must be powers of two" if len(sizes) > 1 else "must be a power of two"
        raise ValueError(f"{what}: {said} {must} (whole tiles, unmasked)")


@triton.jit
def after_previous_kernel(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait until the kernel before it has finished and its
    writes are visible (nothing before this reads or writes global memory, ``aot`` checks the
    PTX; only ``prefetch_l2`` of weights, which no kernel writes, may come first), then let
    the next kernel launch. Its programs then start beside this one's, and
    wait here in turn: two kernels resident at a time, never a chain of them."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """The 128-byte line of each pointer read into L2 (``evict_last``), into no register: no
    data to wait for, and none that a later load could find stale in L1 (L2 is where the
    GPU's writes meet)."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cast(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even into bf16 and fp8 e4m3 (subnormals too) even
    under the interpreter, whose own casts do not."""
    if EMULATE_RNE and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    if EMULATE_RNE and dtype == tl.float8e4nv:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)   # normal range: 3 mantissa bits
        normal = (bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000
        # below 2^-6, subnormal: multiples of 2^-9, the magnitude rounded to nearest even by
        # adding and taking away 1.5 * 2^23 (where fp32 holds no fraction), the sign kept
        magnitude = (tl.abs(x) * 512.0 + 12582912.0 - 12582912.0) / 512.0
        subnormal = magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def mma(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a · b on the tensor cores, a and b in the dtype they take (bf16: products exact
    in fp32; fp32 operands: tf32). Under the interpreter (``DOT_FP32``), whose bf16 dot is
    wrong, the same operands' products in fp32: the callers round their operands (``cast``)
    as on a GPU either way, so the tests check that rounding too; only tf32's is not."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def stable_sigmoid(x):
    """1 / (1 + e^-x) from e^-|x|, which cannot overflow: a long-memory decay gate's argument
    runs to -100 and beyond, where e^-x is inf (the interpreter warns of it)."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
