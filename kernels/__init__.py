"""Triton kernels of the latency-specialized decode path (installed as ``kimi_perf_kernels``).

One kernel per module, beside the PyTorch reference it is tested against
(``tests/kernels/``). On a CPU they run under ``TRITON_INTERPRET=1`` (set before triton is
imported); ``kimi_perf_kernels.aot`` compiles every one for sm_90a without a GPU.
"""
