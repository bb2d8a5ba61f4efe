import pytest
import torch

from kimi_perf_kernels.l2_prefetch import BLOCK, PROGRAMS, l2_prefetch, per_program
from tests.kernels.util import poison


@pytest.mark.parametrize("n", [50_000, PROGRAMS * BLOCK * 3 + 123])
def test_each_program_reads_its_span_once(n):
    """Each program's checksum is the sum of its own span: every element read by exactly one
    program, once (sizes no multiple of the block or of the program count; the larger one
    gives each program several blocks, as a K3 o_proj gives it 21)."""
    # values 1-7 in a cycle that no block's length divides: a block read twice in place of
    # its neighbour changes the sum, and every partial sum is exact in fp32
    w = (torch.arange(n) % 7 + 1).bfloat16()
    checksums = torch.empty(PROGRAMS)
    poison(checksums)
    l2_prefetch(w, checksums)
    span = per_program(n)
    assert span > BLOCK or n == 50_000
    want = [w[p * span:(p + 1) * span].double().sum() for p in range(PROGRAMS)]
    assert checksums.double().tolist() == [float(v) for v in want]
    small = torch.ones(7, dtype=torch.bfloat16)
    assert float(l2_prefetch(small).sum()) == 7.0        # most programs find nothing to read
