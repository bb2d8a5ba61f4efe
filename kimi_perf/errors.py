"""The one error type that the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from pathlib import Path


class TraceError(Exception):
    """A trace (or rules/baseline file) that cannot be read: names the file and the problem."""

    MAX_PROBLEM = 300

    def __init__(self, path: str | Path | None, problem: str):
        self.path = str(path) if path is not None else None
        # One line, always: library messages (SQLite, JSON) may quote multi-line text.
        problem = " ".join(problem.split())
        if len(problem) > self.MAX_PROBLEM:
            problem = problem[: self.MAX_PROBLEM - 1] + "…"
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class NoStepsMatched(TraceError):
    """An explicit step regex that matches no range holding GPU work."""
