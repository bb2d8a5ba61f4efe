"""The Kimi-K3-style decode model (needs torch: ``pip install 'kimi-perf[model]'``).

``config`` (no torch) holds the presets; ``weights`` draws or loads a checkpoint; ``model`` is
the standard decode path as PyTorch ops, ``standard_kernels`` the same path one kernel per
step (as a GPU runs it); ``specialized`` the latency-specialized one (``kernel_path``: what
the two kernel-built paths share); ``reference`` the float64 math all are checked against;
``harness`` runs prompt + decode steps with per-step and per-layer ranges; ``tp`` runs ranks
with torch.distributed; ``validate`` drives ``kimi-perf validate``.
"""

import os
import sys


def interpreter_problem(cuda: bool) -> str | None:
    """Why the decode paths cannot run: without a GPU their Triton kernels need Triton's
    interpreter, which TRITON_INTERPRET set to another value refuses (said before any work,
    not as an ImportError after the standard path ran)."""
    interpret = os.environ.get("TRITON_INTERPRET")
    if cuda or interpret in (None, "1"):
        return None
    return (f"TRITON_INTERPRET={interpret}: without a GPU the decode paths' kernels run in "
            "Triton's interpreter: unset it, or set it to 1")


def choose_triton_backend() -> None:
    """Without a GPU, the Triton kernels of the specialized path run in Triton's interpreter,
    which must be chosen before anything (torch.profiler included) imports triton. Called on
    importing ``model``, which everything that runs the model imports, not on importing this
    package: ``config``, ``floors`` and ``fusions`` serve the analysis without loading
    torch."""
    if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
