from __future__ import annotations

import os

# Triton kernels run in Triton's interpreter on this CPU; it must be chosen before triton
# is imported (kernel tests, the specialized path).
os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("KIMI_PERF_FIXTURES", REPO.parent / "shared" / "fixtures"))
NSYS = FIXTURES / "nsys"
KINETO = FIXTURES / "kineto"
DATA = Path(__file__).resolve().parent / "data"


def nsys_fixtures() -> list[Path]:
    return sorted(NSYS.glob("*.sqlite"))


def kineto_fixtures() -> list[Path]:
    return sorted(KINETO.glob("*.json.gz"))
