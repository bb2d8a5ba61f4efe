"""Kernel names as a reader wants them in a table: demangled, without ``void`` and the argument
list, nested template arguments folded until the name fits.

Only for display: breakdowns, JSON and the HTML report's hover text keep the names as the
trace has them.
"""

from __future__ import annotations

import re
import shutil
import subprocess

# The innermost template argument list: no angle brackets inside (folded ones are \0).
_INNERMOST_TEMPLATE = re.compile(r"<[^<>]*>")


def demangle(names: list[str]) -> list[str]:
    """Itanium-mangled names (``_ZN...``, as AMD's and some CUDA traces carry them) demangled
    by binutils' ``c++filt`` (one call for all; it knows newer manglings, such as ``DF16b``,
    than the C++ runtime's demangler); the others, and all where ``c++filt`` is missing or
    fails, as they are."""
    mangled = sorted({n for n in names if n.startswith("_Z") and "\n" not in n})
    tool = shutil.which("c++filt")
    if not mangled or tool is None:
        return list(names)
    try:
        done = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True,
                              text=True, errors="replace", timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return list(names)
    lines = done.stdout.splitlines()
    if len(lines) != len(mangled):
        return list(names)
    readable = dict(zip(mangled, lines, strict=True))
    return [readable.get(n, n) for n in names]


def short_names(names: list[str], width: int = 80) -> list[str]:
    """Each name demangled, without a leading ``void `` and its argument list; then, while it
    is wider than ``width``, its innermost template arguments folded to ``<…>``; finally cut
    with an ellipsis."""
    return [_shorten(n, width) for n in demangle(names)]


def _shorten(name: str, width: int) -> str:
    name = _without_arguments(name.removeprefix("void "))
    while _width(name) > width:
        folded = _INNERMOST_TEMPLATE.sub("\0", name)
        if folded == name:
            break
        name = folded
    name = name.replace("\0", "<…>")
    return name if len(name) <= width else name[: width - 1] + "…"


def _width(name: str) -> int:
    return len(name) + 2 * name.count("\0")


def _without_arguments(name: str) -> str:
    """``f<T>(int, float)`` -> ``f<T>``: the parenthesised list that closes the name, found by
    matching parentheses from the end (template arguments may hold parentheses too)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i].rstrip() or name
    return name
