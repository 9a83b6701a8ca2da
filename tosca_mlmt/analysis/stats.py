"""Statistics for learning claims: paired bootstrap over seeds x problems, McNemar, Wilson, and
the (clustered) bootstrap interval of a mean that the report's accuracy bands use.

Every method is evaluated on the same test problems with the same seeds, so comparisons are
paired: ``correct[s, i]`` is 1 when seed s's run got problem i right. Resampling seeds and
problems (a two-level bootstrap) gives intervals that include both sources of noise: the
training randomness (seeds) and which problems happen to be in the test set.
"""

from __future__ import annotations

import math

import numpy as np


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a proportion k / n (sensible at 0 and n, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_bootstrap(a: np.ndarray, b: np.ndarray | None = None, n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95, groups=None) -> dict[str, float]:
    """Mean of ``a`` (or of ``a - b`` when ``b`` is given) with a two-level bootstrap interval.

    a, b: [S seeds, N problems] arrays of per-problem outcomes (0/1 or any score), paired by
    position. Each replicate draws S seeds with replacement, then N problems with replacement
    (the same problems for every seed drawn, keeping the pairing), and takes the mean.

    ``groups`` [N] (optional) names each problem's cluster, e.g. arith's fact: problems of one fact
    in other phrasings are not independent draws, so a replicate draws G clusters (of the G distinct
    names) with replacement and takes all their problems; the result then holds ``clusters``: G.
    No groups is ``groups = arange(N)``: one problem per cluster gives the same interval exactly only
    when the names sort in problem order (clusters are indexed by sorted name, so other names permute
    which problem each draw picks: the same distribution, other replicates)."""
    x = np.asarray(a, dtype=float) - (0.0 if b is None else np.asarray(b, dtype=float))
    if x.ndim != 2:
        raise ValueError(f"expected [seeds, problems], got shape {x.shape}")
    S, N = x.shape
    # no groups: every problem its own cluster, the same draws and replicate means as a per-problem bootstrap
    sums, counts = _cluster_totals(x, groups)  # [S, G], [G]
    G = len(counts)
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for r in range(n_boot):
        rows = rng.integers(0, S, S)
        cl = rng.integers(0, G, G)
        means[r] = sums[np.ix_(rows, cl)].sum() / (S * counts[cl].sum())
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    out = {"mean": float(x.mean()), "lo": float(lo), "hi": float(hi), "seeds": S, "problems": N}
    return out if groups is None else {**out, "clusters": G}


def _cluster_totals(x: np.ndarray, groups) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of ``x`` [..., N] ([..., G], clusters in sorted name order) and cluster sizes [G];
    ``groups`` [N] names each value's cluster, None = each value its own (the sums are then ``x`` itself)."""
    N = x.shape[-1]
    groups = np.arange(N) if groups is None else np.asarray(groups)
    if groups.shape != (N,):
        raise ValueError(f"groups: expected one name per value ({N}), got shape {groups.shape}")
    _, inv = np.unique(groups, return_inverse=True)
    G = int(inv.max()) + 1 if N else 0
    flat = x.reshape(math.prod(x.shape[:-1]), N)
    sums = np.array([np.bincount(inv, weights=row, minlength=G) for row in flat]).reshape(*x.shape[:-1], G)
    return sums, np.bincount(inv, minlength=G).astype(float)


def mcnemar(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Exact two-sided McNemar test on paired 0/1 outcomes [N]: only discordant pairs count.

    n01 = a wrong & b right, n10 = a right & b wrong; under H0 each discordant pair is a fair coin,
    so p = P(Binomial(n01 + n10, 1/2) at least as extreme as observed)."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    n10, n01 = int((a & ~b).sum()), int((~a & b).sum())
    n = n10 + n01
    k = min(n10, n01)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n if n else 1.0
    return {"a_only": n10, "b_only": n01, "p": min(1.0, 2 * tail)}


def bootstrap_mean(values, groups=None, n_boot: int = 2000, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float, float]:
    """Mean of ``values`` [N] with a percentile-bootstrap interval: (mean, lo, hi).

    ``groups`` [N] (optional) names the cluster of each value, e.g. the problem an episode was
    sampled for: samples of one problem are not independent, so whole clusters are resampled and
    each replicate is sum(values) / count over the drawn clusters. Without groups every value is
    its own cluster (the ordinary bootstrap). An empty input gives (nan, nan, nan)."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"expected a 1-d array, got shape {x.shape}")
    if not len(x):
        return (math.nan, math.nan, math.nan)
    sums, counts = _cluster_totals(x, groups)
    rng = np.random.default_rng(seed)
    # all replicates at once: n_boot x G indices (G is at most a few thousand problems here)
    idx = rng.integers(0, len(sums), (n_boot, len(sums)))
    means = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return (float(x.mean()), float(lo), float(hi))
