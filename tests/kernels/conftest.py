"""Kernel tests run Triton's interpreter on the CPU: it must be chosen before triton loads."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
