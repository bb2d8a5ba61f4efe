"""Skinny linear layers for decode: y[M, N] = x[M, K] · W[N, K]ᵀ with M (tokens) small.

Decode GEMMs are memory-bound: the kernel's job is to stream W once at full bandwidth. Each
program owns BLOCK_N output columns and walks K in BLOCK_K steps, for all M rows up to
MAX_BLOCK_M, so every weight byte is read from HBM once (more rows take more row tiles of the
same columns, which read the block of W again, from L2). A program's loads of one step do not
wait for the step before: the K loop is software-pipelined (``STAGES`` tiles of W in flight per
program, cp.async on Hopper), since with one 16-byte load per thread a step, a few hundred
programs keep too few bytes in flight to cover HBM's latency. Two variants with one contract:

- ``gemv`` (M ≤ 4): multiply-accumulate on CUDA cores, products summed elementwise and reduced
  over K once, after the loop (a step is loads and FMAs: no shuffles, no barriers); no
  tensor-core tile to waste on three empty rows.
- ``gemm`` (M > 4): ``tl.dot`` tiles with M padded to a 16-row tensor-core tile; the row tiles
  of one column block are neighbouring programs, so a verify step's many row tiles find that
  block of W in L2 rather than streaming it from HBM once each.

Fusions, chosen by constexpr flags:

- RMSNorm: x times the norm weight goes into the products while its sum of squares
  accumulates beside them, and each row is scaled by its 1/rms after the loop (one pass: no
  prologue over x before W's first load).
- SiTU gate/up epilogue: W stacks gate rows over up rows; a program accumulates both halves
  of its column block and writes ``SiTU(gate, up)`` (N/2 columns), as a fused MLP up-proj.
- residual-add epilogue: y + r.

With programmatic dependent launch (``kimi_perf_kernels.common.programmatic_launch``) a
program may also read the first ``PREFETCH_K`` columns of its rows of W into L2 before it
waits for the kernel before it (``prefetch_columns`` shares a budget of bytes out): W is
nothing that kernel writes, and it streams while that kernel, latency-bound, runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import (
    INTERPRETED,
    after_previous_kernel,
    cast,
    check_layout,
    interpreter_tiles,
    launch_options,
    mma,
    prefetch_l2,
    weight_prefetch_bytes,
)

GEMV_MAX_M = 4
STAGES = tl.constexpr(4)   # K steps in flight per program (tl.range's software pipeline)
MAX_BLOCK_M = 64
# The weight prefetch before a PDL wait that the GPU check runs (and ``aot`` compiles): about
# what HBM streams while a latency-bound kernel of a few microseconds runs before the GEMV.
CHECKED_PREFETCH_BYTES = 8 << 20


@triton.jit
def situ_activation(gate, up, BETA: tl.constexpr, BETA_LINEAR: tl.constexpr):
    # tanh(x) = 2σ(2x) - 1 (no libdevice in the interpreter)
    t_gate = 2.0 * tl.sigmoid(2.0 * gate / BETA) - 1.0
    t_up = 2.0 * tl.sigmoid(2.0 * up / BETA_LINEAR) - 1.0
    return (BETA * t_gate * tl.sigmoid(gate)) * (BETA_LINEAR * t_up)


@triton.jit
def linear_tile(pid, x_ptr, w_ptr, norm_ptr, res_ptr, out_ptr, M, N_OUT, K, stride_xm,
                stride_wn, stride_rm, stride_om, eps, NORM: tl.constexpr, SITU: tl.constexpr,
                RESIDUAL: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                RNE: tl.constexpr, BETA: tl.constexpr, BETA_LINEAR: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile ``pid`` of the output: BLOCK_N columns of BLOCK_M rows (row tiles first, then
    column tiles: one row tile unless a verify step brings more than BLOCK_M tokens, and then
    the programs that read one block of W run side by side). The body of
    ``skinny_linear_kernel``, also run by kernels that fuse a skinny linear beside their own
    work (``moe_experts``)."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    rows = (pid % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N_OUT
    ks = tl.arange(0, BLOCK_K)
    # RMSNorm in the same pass: y[m] = 1/rms[m] · Σ_k (x · norm)[m, k] w[k]. The GEMM sums
    # per K step (sq1, acc); the GEMV keeps products elementwise and reduces them after the
    # loop (sq2, acc3). (A constexpr branch is all Triton traces: each sum exists only where
    # its variant runs.)
    if USE_DOT:
        sq1 = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if SITU:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        sq2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        if SITU:
            acc3_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + ks
        k_ok = kk < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            if USE_DOT:
                sq1 += tl.sum(x * x, axis=1)
            else:
                sq2 += x * x
            nw = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = x * nw[None, :]
        w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if SITU:
            w_up = tl.load(w_ptr + (cols[:, None] + N_OUT) * stride_wn + kk[None, :],
                           mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            # the tensor cores take the weights' dtype: x · norm is rounded to it here,
            # before 1/rms (applied to the sums): a rounding of the size the standard
            # path's bf16 RMSNorm output has, not of the same values; the GEMV keeps fp32
            xb = cast(x, w.dtype, RNE)
            acc = mma(xb, tl.trans(w), acc, DOT_FP32)
            if SITU:
                acc_up = mma(xb, tl.trans(w_up), acc_up, DOT_FP32)
        else:
            acc3 += x[:, None, :] * w.to(tl.float32)[None, :, :]
            if SITU:
                acc3_up += x[:, None, :] * w_up.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
        if SITU:
            acc_up = tl.sum(acc3_up, axis=2)
    if NORM:
        if not USE_DOT:
            sq1 = tl.sum(sq2, axis=1)
        inv_rms = 1.0 / tl.sqrt(sq1 / K + eps)
        acc = acc * inv_rms[:, None]
        if SITU:
            acc_up = acc_up * inv_rms[:, None]
    if SITU:
        acc = situ_activation(acc, acc_up, BETA, BETA_LINEAR)
    if RESIDUAL:
        acc += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :],
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             cast(acc, out_ptr.dtype.element_ty, RNE), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def skinny_linear_kernel(x_ptr, w_ptr, norm_ptr, res_ptr, out_ptr, M, N_OUT, K,
                         stride_xm, stride_wn, stride_rm, stride_om, eps,
                         NORM: tl.constexpr, SITU: tl.constexpr, RESIDUAL: tl.constexpr,
                         USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, RNE: tl.constexpr,
                         BETA: tl.constexpr, BETA_LINEAR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0,
                         LINE: tl.constexpr = 64):
    if PREFETCH_K > 0:
        # Before the PDL wait, while the kernel before runs: the first PREFETCH_K columns of
        # this program's rows of W into L2, a LINE of elements (128 bytes) a pointer. The row
        # tiles of one column block share them: the first one reads them.
        row_tiles = tl.cdiv(M, BLOCK_M)
        pid = tl.program_id(0)
        cols = (pid // row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        lines = tl.arange(0, PREFETCH_K // LINE) * LINE
        ok = (cols[:, None] < N_OUT) & (lines[None, :] < K) & (pid % row_tiles == 0)
        prefetch_l2(tl.where(ok, w_ptr + cols[:, None] * stride_wn + lines[None, :], w_ptr))
        if SITU:
            prefetch_l2(tl.where(ok, w_ptr + (cols[:, None] + N_OUT) * stride_wn
                                 + lines[None, :], w_ptr))
    after_previous_kernel(PDL)
    linear_tile(tl.program_id(0), x_ptr, w_ptr, norm_ptr, res_ptr, out_ptr, M, N_OUT, K,
                stride_xm, stride_wn, stride_rm, stride_om, eps, NORM, SITU, RESIDUAL, USE_DOT,
                DOT_FP32, RNE, BETA, BETA_LINEAR, BLOCK_M, BLOCK_N, BLOCK_K)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, situ: tuple[float, float] | None = None,
                  out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  eps: float = 1e-5) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] (or [M, N/2] with ``situ=(beta, beta_linear)``)."""
    M, K = x.shape
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"skinny_linear: w {tuple(w.shape)} for x {tuple(x.shape)} (w [N, K])")
    if situ and w.shape[0] % 2:
        raise ValueError(f"skinny_linear: SiTU takes w's gate and up rows, an even number, not "
                         f"{w.shape[0]}")
    n_out = w.shape[0] // 2 if situ else w.shape[0]
    check_layout("skinny_linear", {"norm": norm},
                 {"x": x, "w": w, "residual": residual, "out": out},
                 {"norm": (K,), "residual": (M, n_out), "out": (M, n_out)})
    if out is None:
        out = torch.empty(M, n_out, dtype=out_dtype or x.dtype, device=x.device)
    use_dot = M > GEMV_MAX_M
    block_m, block_n, block_k, warps = launch_config(M, interpreter_tiles(), situ is not None)
    beta, beta_linear = situ or (1.0, 1.0)
    grid = (tiles(M, n_out, block_m, block_n),)
    skinny_linear_kernel[grid](
        x, w, norm if norm is not None else x, residual if residual is not None else out, out,
        M, n_out, K, x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        NORM=norm is not None, SITU=situ is not None, RESIDUAL=residual is not None,
        USE_DOT=use_dot, DOT_FP32=INTERPRETED, RNE=INTERPRETED, BETA=beta,
        BETA_LINEAR=beta_linear,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        PREFETCH_K=prefetch_columns(weight_prefetch_bytes(), K, n_out, block_n,
                                    w.element_size(), situ is not None),
        LINE=128 // w.element_size(), **launch_options())
    return out


def prefetch_columns(budget: int, k: int, n_out: int, block_n: int, element_size: int,
                     situ: bool) -> int:
    """How many of its first columns of W each program reads into L2 before its PDL wait
    (``PREFETCH_K``): the launch's ``budget`` of bytes shared out over its column blocks, in
    whole 128-byte lines and a power of two of them (a Triton range), at most K rounded up to
    a power of two (the columns past K masked)."""
    rows = triton.cdiv(n_out, block_n) * block_n * (2 if situ else 1)
    columns = min(budget // (rows * element_size), triton.next_power_of_2(k))
    lines = columns * element_size // 128
    return 0 if lines <= 0 else (1 << (lines.bit_length() - 1)) * 128 // element_size


def launch_config(m: int, interpreted: bool = False, situ: bool = False
                  ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): tiles that keep 4 stages of W in flight
    without spilling on sm_90a (``python -m kimi_perf_kernels.aot`` checks them: the GEMV
    about 110 registers at 4 tokens, its elementwise sums [BLOCK_M, BLOCK_N, BLOCK_K] the
    most of them, so with SiTU's two weight tiles it takes half the K step); rows beyond
    MAX_BLOCK_M (a verify step of a large batch) take more row tiles. 32 columns a program
    give K3 TP8's projections grids of one to two programs an SM (o_proj's 7168 columns 224
    programs, the KDA input projection's 6288 197, on H200's 132 SMs): chosen for registers
    and a full grid, not yet tuned on a GPU (the GPU check's per-launch µs against the
    memory floors says where they fall short). The interpreter pays per program and per op,
    not per element: it gets big column tiles."""
    block_m = triton.next_power_of_2(m) if m <= GEMV_MAX_M else \
        min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    if interpreted:
        return block_m, 256, 256, 4
    if m <= GEMV_MAX_M:
        return block_m, 32, 64 if situ else 128, 8
    return block_m, 32, 128, 4


def tiles(m: int, n_out: int, block_m: int, block_n: int) -> int:
    """Programs ``linear_tile`` takes for an [m, n_out] output."""
    return triton.cdiv(n_out, block_n) * triton.cdiv(m, block_m)


def skinny_linear_reference(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
                            residual: torch.Tensor | None = None,
                            situ: tuple[float, float] | None = None,
                            out_dtype: torch.dtype | None = None, eps: float = 1e-5,
                            dot_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dot_dtype``: the dtype the tensor cores take x · norm in, as the GEMM (past
    GEMV_MAX_M rows) does: rounded to w's before 1/rms, which it applies to the sums; None
    keeps fp32 throughout, as the GEMV does."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) if norm is not None else 1.0
    if norm is not None:
        xf = xf * norm.float()
    if dot_dtype is not None:
        xf = xf.to(dot_dtype).float()
    y = (xf @ w.float().T) * rstd
    if situ is not None:
        beta, beta_linear = situ
        gate, up = y.chunk(2, dim=-1)
        y = (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
            beta_linear * torch.tanh(up / beta_linear))
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype or x.dtype)
