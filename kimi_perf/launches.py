"""Join GPU work to the API call that launched it: (process, correlation id) -> API row."""

from __future__ import annotations

import numpy as np

from kimi_perf.trace import ApiCalls

_CORR_BITS = 40


def pair_keys(pid: np.ndarray, corr: np.ndarray, pid_codes: np.ndarray) -> np.ndarray:
    """One int64 key per (pid, correlation); ``pid_codes`` is the sorted set of pids in use."""
    code = np.searchsorted(pid_codes, pid).astype(np.int64)
    return (code << _CORR_BITS) | (corr.astype(np.int64) & ((1 << _CORR_BITS) - 1))


def find_launches(api: ApiCalls, pid: np.ndarray, corr: np.ndarray) -> np.ndarray:
    """Row in ``api`` with the same pid and correlation for each (pid, corr), or -1.

    Where an API table holds several rows for one correlation, the first row wins; readers drop
    duplicates they know to be spurious before this (nsys "backtrace" rows).
    """
    out = np.full(len(pid), -1, dtype=np.int64)
    if len(api) == 0 or len(pid) == 0:
        return out
    pid_codes = np.unique(np.concatenate([api.pid, pid]))
    api_keys = pair_keys(api.pid, api.correlation, pid_codes)
    order = np.argsort(api_keys, kind="stable")
    sorted_keys = api_keys[order]
    del api_keys
    keys = pair_keys(pid, corr, pid_codes)
    pos = np.searchsorted(sorted_keys, keys)
    hit = pos < len(sorted_keys)
    np.minimum(pos, len(sorted_keys) - 1, out=pos)
    hit &= (sorted_keys[pos] == keys) & (corr >= 0)
    out[hit] = order[pos[hit]]
    return out
