"""Kernels of the decode paths (installed as ``kimi_perf_kernels``): Triton, and one CuTe DSL
candidate (``cute_gemv``).

One decode step's kernel per module, beside the PyTorch reference it is tested against
(``tests/kernels/``); where the standard path runs that step as vLLM's separate launches
(the routed experts' finalize, FlashMLA's combine of the attention's splits), those kernels
sit beside it. On a CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set before
triton is imported); ``kimi_perf_kernels.aot`` compiles every kernel for sm_90a without a GPU.
CuTe DSL kernels cannot run on a CPU: their tests read the sm_90a build, and the GPU check
runs them.
"""
