"""The forward calls a kernel-built path left to the standard path's PyTorch ops, as a run
reports them (no torch: the capture's metrics and ``validate`` both read them).

A path records one entry per call it did not take, ``"NAME: REASON"``. NAME is the caller's
name for the call (``K3Model.call_name``): the harness names a call by its trace range
(``prefill``, ``warmup_step[i]``, ``decode_step[i]``, ``graph_capture``) or ``graph_warmup[i]``
for the eager runs before a capture, so that a fallback can be found in the trace.
"""

from __future__ import annotations

import re

_INDEXED = re.compile(r"^(?P<range>.+)\[(?P<index>\d+)\]$")


def summarise(fallbacks: list[str]) -> list[str]:
    """The entries with runs of one reason over consecutive calls of one range merged:
    ``decode_step[0]`` … ``decode_step[99]`` of "batch 80 > 64" is one entry,
    ``decode_step[0..99]: batch 80 > 64``."""
    merged: list[tuple[str, int | None, int | None, str]] = []  # range, first, last, reason
    for entry in fallbacks:
        name, _, reason = entry.partition(": ")
        m = _INDEXED.match(name)
        where, index = (m["range"], int(m["index"])) if m else (name, None)
        if merged and index is None and merged[-1] == (where, None, None, reason):
            continue   # (one call in parts: a prefill, a chunk of sequences at a time)
        if merged and index is not None:
            last_where, first, last, last_reason = merged[-1]
            if (last_where, last_reason) == (where, reason) and last == index - 1:
                merged[-1] = (where, first, index, reason)
                continue
        merged.append((where, index, index, reason))
    return [f"{where}{_indices(first, last)}: {reason}" for where, first, last, reason in merged]


def _indices(first: int | None, last: int | None) -> str:
    return "" if first is None else f"[{first}]" if first == last else f"[{first}..{last}]"


def every_decode_step_fell_back(fallbacks: list[str], steps: int) -> bool:
    """Whether none of a run's ``steps`` decode steps ran the path's kernels: each
    ``decode_step[i]`` fell back, or the CUDA graph every step replays was captured from a
    fallback."""
    names = {entry.partition(": ")[0] for entry in fallbacks}
    return "graph_capture" in names or (
        steps > 0 and all(f"decode_step[{i}]" in names for i in range(steps)))


def paths_that_fell_back(run: object) -> dict[str, str]:
    """Of a run's information (``run.json``, or ``run`` in its breakdown.json), each decode
    path whose every step fell back to the standard path's PyTorch ops, with what it said
    of the last ("batch 80 > 64"): its figures are the standard path's, not its own."""
    paths = run.get("paths") if isinstance(run, dict) else None
    out = {}
    for path, metrics in (paths if isinstance(paths, dict) else {}).items():
        if isinstance(metrics, dict) and metrics.get("every_step_fell_back") is True:
            said = metrics.get("fallbacks")
            out[path] = (str(said[-1]).partition(": ")[2] if isinstance(said, list) and said
                         else "")
    return out


def fell_back_text(path: str, reason: str) -> str:
    """The warning every output of a run gives for a path ``paths_that_fell_back`` names."""
    return (f"{path}: every step fell back to the standard path's PyTorch ops"
            + (f" ({reason})" if reason else "")
            + ": its figures are the standard path's, not its own kernels'")
