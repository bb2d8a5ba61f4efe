"""The one error type that the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from pathlib import Path


class TraceError(Exception):
    """A trace (or rules/baseline file) that cannot be read: names the file and the problem."""

    def __init__(self, path: str | Path | None, problem: str):
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)
