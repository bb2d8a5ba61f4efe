"""Kernel names as a reader wants them in a table: demangled, without ``void`` and the argument
list, nested template arguments folded until the name fits.

Only for display: breakdowns and their JSON keep the names as the trace has them; the HTML
report's hover text shows them demangled.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from collections import defaultdict

# The innermost template argument list: no angle brackets inside (folded ones are \0).
_INNERMOST_TEMPLATE = re.compile(r"<[^<>]*>")


def demangle(names: list[str]) -> list[str]:
    """Itanium-mangled names (``_ZN...``, as AMD's and some CUDA traces carry them) demangled
    by binutils' ``c++filt`` (one call for all; it knows newer manglings, such as ``DF16b``,
    than the C++ runtime's demangler); the others, and all where ``c++filt`` is missing or
    fails, as they are."""
    # c++filt reads one name per line: a name that would not stay one line is left alone
    mangled = sorted({n for n in names if n.startswith("_Z") and len(n.splitlines()) == 1})
    tool = shutil.which("c++filt")
    if not mangled or tool is None:
        return list(names)
    try:
        done = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True,
                              text=True, errors="replace", timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return list(names)
    lines = done.stdout.split("\n")[:-1]
    if len(lines) != len(mangled):
        return list(names)
    readable = dict(zip(mangled, lines, strict=True))
    return [readable.get(n, n) for n in names]


def short_names(names: list[str], width: int = 80) -> list[str]:
    """Each name demangled, without a leading ``void `` and its argument list; then, while it
    is wider than ``width``, its innermost template arguments folded to ``<…>``; finally cut
    in the middle (its head and its tail kept). Different names that would read the same end
    in a digest of the whole name instead (``…~3f2a``)."""
    full = demangle(names)
    short = [_shorten(n, width) for n in full]
    originals: dict[str, set[str]] = defaultdict(set)
    for name, cut in zip(full, short, strict=True):
        originals[cut].add(name)
    return [cut if len(originals[cut]) == 1 else _cut(cut, width - 5) + "~" + hashlib.sha1(
        name.encode(), usedforsecurity=False).hexdigest()[:4]
        for name, cut in zip(full, short, strict=True)]


def _shorten(name: str, width: int) -> str:
    name = _without_arguments(name.removeprefix("void "))
    while _width(name) > width:
        folded = _INNERMOST_TEMPLATE.sub("\0", name)
        if folded == name:
            break
        name = folded
    return _cut(name.replace("\0", "<…>"), width)


def _cut(name: str, width: int) -> str:
    """At most ``width`` characters: the head and the tail, an ellipsis between."""
    if len(name) <= width:
        return name
    tail = (width - 1) * 2 // 5
    return name[: width - 1 - tail] + "…" + name[len(name) - tail:]


def _width(name: str) -> int:
    return len(name) + 2 * name.count("\0")


_CLONE = re.compile(r" \[clone [^\]]*\]$")


def _without_arguments(name: str) -> str:
    """``f<T>(int, float)`` -> ``f<T>``: the parenthesised list that closes the name (and a
    compiler's ``[clone .part.0]`` after it), found by matching parentheses from the end
    (template arguments may hold parentheses too). Only a list that follows the name
    directly: ``Memcpy HtoD (Pinned -> Device)`` keeps its words."""
    bare = _CLONE.sub("", name)
    if not bare.endswith(")"):
        return name
    depth = 0
    for i in range(len(bare) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(bare[i], 0)
        if depth == 0:
            return bare[:i] if i > 0 and not bare[i - 1].isspace() else name
    return name
