"""Warm the L2 cache with the weights of the next launch, from a second stream, while a
latency-bound kernel leaves HBM idle.

Decode at small batch alternates bandwidth-bound GEMVs with kernels that barely touch HBM: the
KDA recurrence reads and writes its state (786 KB at K3 TP8, batch 1), the MLA attention the
latent cache.
H200's L2 holds 50 MB, and o_proj's weights at K3 TP8 are 22 MB: read into L2 beside the
recurrence (``evict_last``: the last lines L2 gives up; ptxas refuses it together with the
L2-only ``.cg``), o_proj then streams them from L2 instead of HBM. The design plan puts the
same prefetch beside the TP all-reduce.

Grid: PROGRAMS programs, each reading a contiguous span in BLOCK-element steps (8 KB of bf16
per program and step, about 1 MB in flight: what HBM needs to stream near its bandwidth). The
kernel beside it is no few-SM kernel (the KDA decode runs 96 programs at batch 1 on H200's
132 SMs), so the two share SMs; whether the prefetch pays anyway is what the GPU check
measures (it is opt-in until then). The loaded values are summed into one checksum per
program: a load whose value is never used would be removed by the compiler, and the
checksums let a test prove that every byte was read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import check_layout

PROGRAMS = 128
BLOCK = 4096


def per_program(n: int) -> int:
    """Elements each program reads (the last ones fewer): whole blocks."""
    return triton.cdiv(triton.cdiv(n, PROGRAMS), BLOCK) * BLOCK


@triton.jit
def l2_prefetch_kernel(ptr, n, per_program, checksum_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program   # (a tensor of 2^31 elements or more)
    end = tl.minimum(start + per_program, n)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(start, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(ptr + offs, mask=offs < end, other=0.0, eviction_policy="evict_last")
        acc += x.to(tl.float32)
    tl.store(checksum_ptr + pid, tl.sum(acc, axis=0))


def l2_prefetch(weight: torch.Tensor, checksums: torch.Tensor | None = None) -> torch.Tensor:
    """Read ``weight`` (contiguous) through L2; returns the per-program checksums [PROGRAMS]
    (their sum is the sum of ``weight``'s elements)."""
    if checksums is None:
        checksums = torch.empty(PROGRAMS, dtype=torch.float32, device=weight.device)
    check_layout("l2_prefetch", {"weight": weight, "checksums": checksums}, {},
                 {"checksums": (PROGRAMS,)}, {"checksums": (torch.float32,)})
    n = weight.numel()
    l2_prefetch_kernel[(PROGRAMS,)](weight, n, per_program(n), checksums, BLOCK=BLOCK,
                                    num_warps=8)
    return checksums
