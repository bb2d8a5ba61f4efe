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


def primed(labels: list[str]) -> list[str]:
    """``labels`` made distinct for a table's columns: a label that repeats an earlier one gets
    primes (trace, trace', trace'')."""
    out: list[str] = []
    for label in labels:
        while label in out:
            label += "'"
        out.append(label)
    return out


def short_names(names: list[str], width: int = 80) -> list[str]:
    """Each name demangled, without a leading ``void `` and its argument list; then, while it
    is wider than ``width``, its innermost template arguments folded to ``<…>`` (keeping the
    operation they name: ``<…MulFunctor>``); finally cut
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
    return _cut(_fold_templates(_without_arguments(name.removeprefix("void ")), width), width)


def _fold_templates(name: str, width: int) -> str:
    """The innermost template argument lists folded to ``<…>`` (``_folded``), a level at a
    time (a list's level is one more than its highest inner list's), until the name is at
    most ``width`` wide or nothing is left to fold. One pass: what folding a level saves is
    known from each list of that level alone, since its inner lists are folded by then (a
    level more where the operations ``_folded`` keeps make it too wide). A ``<`` or ``>``
    that closes no list (``operator<``) is a character like any other."""
    lists: list[tuple[int, int, int]] = []  # (open, close, level)
    saved_at_level: list[int] = [0]
    # each open list: its position, its inner lists' highest level, their length, their count
    open_lists: list[list[int]] = []
    for i, char in enumerate(name):
        if char == "<":
            open_lists.append([i, 0, 0, 0])
        elif char == ">" and open_lists:
            start, inner_level, inner_length, inner_count = open_lists.pop()
            level, length = inner_level + 1, i - start + 1
            lists.append((start, i, level))
            if level == len(saved_at_level):
                saved_at_level.append(0)
            # its inner lists are `<…>` by now; it becomes `<…>` itself
            saved_at_level[level] += length - inner_length + 3 * inner_count - 3
            if open_lists:
                outer = open_lists[-1]
                outer[1] = max(outer[1], level)
                outer[2] += length
                outer[3] += 1
    level, over = 0, len(name) - width
    while over > 0 and level + 1 < len(saved_at_level):
        level += 1
        over -= saved_at_level[level]
    lists.sort()
    folded = _fold_to(name, lists, level)
    # (the operations kept make a fold longer than `<…>`: a level more where it is too wide)
    while len(folded) > width and level + 1 < len(saved_at_level):
        level += 1
        folded = _fold_to(name, lists, level)
    return folded


def _fold_to(name: str, lists: list[tuple[int, int, int]], level: int) -> str:
    """``name`` with its template argument lists up to ``level`` folded (``lists`` sorted)."""
    parts, end = [], 0
    for start, close, list_level in lists:
        if list_level <= level and start >= end:  # outermost of those folded
            parts += [name[end:start], _folded(name[start: close + 1])]
            end = close + 1
    return "".join(parts) + name[end:]


# What an argument list says a kernel does, where its name does not (PyTorch's elementwise
# and reduce kernels, ck_tile's kentry): its last functor, op or pass (MulFunctor,
# CUDAFunctorOnOther_add, sum_functor, MeanOps, Rmsnorm2dFwd) or the kernel function a lambda
# is scoped in (silu_kernel), kept when the list is folded; not CUTLASS's operator class nor
# the ReduceOp that wraps every reduction's ops
_OPERATION = re.compile(r"\b(?!OpClass|ReduceOp\b)[A-Za-z]\w*?(?:[Ff]unctor\w*|Ops?|Fwd|Bwd)\b"
                        r"|\b\w+_kernel(?:_cuda)?(?=\()")


def _folded(arguments: str) -> str:
    said = _OPERATION.findall(arguments)
    return f"<…{said[-1]}>" if said else "<…>"


def _cut(name: str, width: int) -> str:
    """At most ``width`` characters: the head and the tail, an ellipsis between."""
    if len(name) <= width:
        return name
    tail = (width - 1) * 2 // 5
    return name[: width - 1 - tail] + "…" + name[len(name) - tail:]


_CLONE = re.compile(r"( \[clone [^\]]*\])+$")   # (GCC stacks them: .isra.0 then .cold)


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
