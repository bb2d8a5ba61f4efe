import torch

from kimi_perf_kernels.l2_prefetch import PROGRAMS, l2_prefetch
from tests.kernels.util import poison


def test_every_element_is_read_once():
    """The checksums add up to the tensor's sum: each element read by exactly one program
    (a size that is no multiple of the block or of the program count)."""
    # values 1-7: every partial sum is exact in fp32, so one element missed or read twice
    # changes the total
    w = (torch.arange(50_000) % 7 + 1).bfloat16().reshape(250, 200)
    checksums = torch.empty(PROGRAMS)
    poison(checksums)
    l2_prefetch(w, checksums)
    assert checksums.double().sum() == w.double().sum()
    small = torch.ones(7, dtype=torch.bfloat16)
    assert float(l2_prefetch(small).sum()) == 7.0        # most programs find nothing to read
