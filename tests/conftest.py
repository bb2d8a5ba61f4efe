from __future__ import annotations

import os
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
