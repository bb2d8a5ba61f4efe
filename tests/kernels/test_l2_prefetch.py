import torch

from kimi_perf_kernels.l2_prefetch import PROGRAMS, l2_prefetch
from tests.kernels.util import poison


def test_every_element_is_read_once():
    """The checksums add up to the tensor's sum: each element read by exactly one program
    (a size that is no multiple of the block or of the program count)."""
    w = torch.arange(1, 50_001, dtype=torch.float32).bfloat16().reshape(250, 200)
    checksums = torch.empty(PROGRAMS)
    poison(checksums)
    l2_prefetch(w, checksums)
    torch.testing.assert_close(checksums.double().sum(), w.double().sum(), rtol=1e-6, atol=0)
    small = torch.ones(7, dtype=torch.bfloat16)
    assert float(l2_prefetch(small).sum()) == 7.0        # most programs find nothing to read
