"""Counts in words, for tables, notes and errors."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 step', '2 steps', '1,832 kernels' (``plural`` where it is not ``noun`` + 's')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
