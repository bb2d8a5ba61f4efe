"""Interning table that readers fill: string -> int32 code, shared by all name columns."""

from __future__ import annotations


class StringTable:
    def __init__(self) -> None:
        self.values: list[str] = []
        self._codes: dict[str, int] = {}

    def code(self, value: str) -> int:
        code = self._codes.get(value)
        if code is None:
            code = len(self.values)
            self._codes[value] = code
            self.values.append(value)
        return code

    def extend(self, values: list[str]) -> list[int]:
        """Codes for many values at once (duplicates share a code)."""
        return [self.code(v) for v in values]
