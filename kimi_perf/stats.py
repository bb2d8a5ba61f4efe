"""The rank test the gate and the overview decide with: one-sided Mann-Whitney U, exact
where it is cheap (ties included), and whether a test of so many values can reach an alpha."""

from __future__ import annotations

import math

import numpy as np

# the work (values counted × the smaller sample × rank sums) up to which the U test is exact, ties
# or not: 0.2 s; past it (noise of 80 steps a side) scipy's normal approximation, good there
EXACT_TEST_WORK = 200_000_000


def can_reach(n: int, m: int, alpha: float) -> bool:
    """Whether a rank test of ``n`` values against ``m`` can reach ``alpha``: its smallest p
    (all of one side above all of the other) is 1 / C(n+m, n)."""
    # (in logs: C(n+m, n) of 10^5 layers a side has 60k digits)
    return math.lgamma(n + m + 1) - math.lgamma(n + 1) - math.lgamma(m + 1) > -math.log(alpha)


def u_test(cur: np.ndarray, base: np.ndarray, worse: bool) -> float:
    """The one-sided Mann-Whitney U test's p, exact where its work is at most
    ``EXACT_TEST_WORK``, ties included. scipy is exact only without ties and for eight values
    a side at most; its normal approximation, taken wherever two values tie (figures in whole
    µs often do), is far off in the tail a gate decides on: six steps a side all above the
    other side's read p 0.0025 where the exact p is 1/924, and eight a side 0.00047 where it
    is 1/12,870, so at α 0.00025 no rise could fail; three against 300, 6,700 times too
    large. The exact p counts, over every split of the pooled values, the splits whose
    smaller sample's rank sum is as extreme as the one observed (midranks doubled: integers),
    a value at a time, as a knapsack; only sums up to the observed one (the tail is turned
    to low sums): a clear regression costs little."""
    from scipy.stats import mannwhitneyu, rankdata

    ranks = np.rint(2 * rankdata(np.concatenate([cur, base]))).astype(np.int64)
    cur_smaller = cur.size <= base.size
    if cur_smaller == worse:   # (evidence in high sums of the smaller: reversed, low ones)
        ranks = 2 * (ranks.size + 1) - ranks
    smaller = ranks[:cur.size] if cur_smaller else ranks[cur.size:]
    k, observed = smaller.size, int(smaller.sum())
    counted = ranks[ranks <= observed]   # (a value ranked past the sum is in no such subset)
    if counted.size * k * (observed + 1) > EXACT_TEST_WORK:
        return float(mannwhitneyu(cur, base, alternative="greater" if worse else "less",
                                  method="asymptotic").pvalue)
    # ways[j, s]: the subsets of j values seen so far whose doubled ranks sum to s
    ways = np.zeros((k + 1, observed + 1))
    ways[0, 0] = 1.0
    for rank in counted:
        ways[1:, rank:] += ways[:-1, :observed + 1 - rank]   # (numpy: as if copied first)
    # (in logs: the splits of 100 values among 48,800 are past a float; math.log takes the int)
    return min(1.0, math.exp(math.log(float(ways[k].sum()))
                             - math.log(math.comb(ranks.size, k))))
