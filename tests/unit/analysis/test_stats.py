"""Statistics for learning claims, checked against values computed another way."""

import math

import numpy as np
import pytest

from tosca_mlmt.analysis.stats import bootstrap_mean, mcnemar, paired_bootstrap, wilson


def test_wilson_matches_the_closed_form_and_behaves_at_the_edges():
    lo, hi = wilson(30, 100)
    assert lo == pytest.approx(0.2189, abs=1e-4) and hi == pytest.approx(0.3958, abs=1e-4)  # textbook values
    assert wilson(0, 20)[0] == 0.0 and wilson(20, 20)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


def test_mcnemar_exact_p_value():
    a = np.array([1] * 9 + [0] * 1 + [1] * 40 + [0] * 50)  # 9 a-only, 1 b-only discordant pairs
    b = np.array([0] * 9 + [1] * 1 + [1] * 40 + [0] * 50)
    r = mcnemar(a, b)
    assert (r["a_only"], r["b_only"]) == (9, 1)
    assert r["p"] == pytest.approx(2 * (1 + 10) / 2**10)  # 2 * P(Bin(10, .5) <= 1)
    assert mcnemar(a, a)["p"] == 1.0


def test_paired_bootstrap_centres_on_the_mean_and_widens_with_noise():
    rng = np.random.default_rng(1)
    a = (rng.random((3, 400)) < 0.6).astype(float)
    b = (rng.random((3, 400)) < 0.4).astype(float)
    d = paired_bootstrap(a, b, n_boot=500)
    assert d["mean"] == pytest.approx(a.mean() - b.mean())
    assert d["lo"] < d["mean"] < d["hi"] and d["lo"] > 0  # a 20-point gap on 1200 pairs is resolved
    same = paired_bootstrap(a, a, n_boot=200)
    assert same["mean"] == same["lo"] == same["hi"] == 0.0  # pairing removes all noise from a - a
    small = paired_bootstrap(a[:, :20], b[:, :20], n_boot=500)
    assert small["hi"] - small["lo"] > d["hi"] - d["lo"]  # 20 problems decide less than 400
    # one seed, a single-level bootstrap: the interval is close to the normal approximation
    one = paired_bootstrap(a[:1], n_boot=2000)
    p = a[0].mean()
    assert one["hi"] - one["lo"] == pytest.approx(2 * 1.96 * math.sqrt(p * (1 - p) / 400), rel=0.15)


def _binomial_quantile(n: int, p: float, q: float) -> float:
    """Smallest k / n with P(Binomial(n, p) <= k) >= q, from the exact pmf."""
    cdf = 0.0
    for k in range(n + 1):
        cdf += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if cdf >= q - 1e-12:
            return k / n
    return 1.0


def test_bootstrap_mean_matches_the_exact_binomial_resampling_distribution():
    # Resampling n 0/1 values with k ones draws Binomial(n, k/n) ones: the bootstrap interval of
    # the mean is that distribution's 2.5 % and 97.5 % quantiles over n (within one step of 1/n).
    x = np.array([1.0] * 13 + [0.0] * 27)
    mean, lo, hi = bootstrap_mean(x, n_boot=20000, seed=3)
    assert mean == pytest.approx(13 / 40)
    assert lo == pytest.approx(_binomial_quantile(40, 13 / 40, 0.025), abs=1 / 40 + 1e-9)
    assert hi == pytest.approx(_binomial_quantile(40, 13 / 40, 0.975), abs=1 / 40 + 1e-9)
    # clusters of 5 identical values (5 samples of one problem, all right or all wrong) resample like
    # 12 independent values: the interval is Binomial(12, 5/12)'s, far wider than 60 values would give
    groups = np.repeat(np.arange(12), 5)
    y = np.repeat([1.0] * 5 + [0.0] * 7, 5)
    mean, lo, hi = bootstrap_mean(y, groups, n_boot=20000, seed=4)
    assert mean == pytest.approx(5 / 12)
    assert lo == pytest.approx(_binomial_quantile(12, 5 / 12, 0.025), abs=1 / 12 + 1e-9)
    assert hi == pytest.approx(_binomial_quantile(12, 5 / 12, 0.975), abs=1 / 12 + 1e-9)
    flat = bootstrap_mean(y, n_boot=20000, seed=4)
    assert flat[2] - flat[1] < hi - lo
    assert bootstrap_mean(np.ones(7)) == (1.0, 1.0, 1.0)
    assert all(math.isnan(v) for v in bootstrap_mean([]))


def _fact_outcomes(per_fact, size):
    """[1, facts x size] outcomes where every problem of a fact shares its fact's outcome, and the fact names."""
    x = np.repeat(np.asarray(per_fact, dtype=float), size)[None, :]
    return x, np.repeat(np.arange(len(per_fact)), size)


def test_fact_clustered_interval_is_the_bootstrap_over_facts_and_wider():
    """All problems of a fact share an outcome: resampling problems treats 300 phrasings as 300 draws, while
    only 12 facts were drawn. With equal-sized facts the clustered interval is exactly the problem-level
    bootstrap over one column per fact (same seed, same draws); it is wider than the per-problem one."""
    a_fact, b_fact = [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    a, facts = _fact_outcomes(a_fact, 25)
    b, _ = _fact_outcomes(b_fact, 25)
    # a second seed with other outcomes per fact (reversed blocks: still constant within each fact's positions)
    a2, b2 = np.vstack([a, a[:, ::-1]]), np.vstack([b, b[:, ::-1]])
    for x, y in ((a, b), (a2, b2)):
        clustered = paired_bootstrap(x, y, groups=facts)
        per_problem = paired_bootstrap(x, y)
        assert clustered["clusters"] == 12 and clustered["mean"] == per_problem["mean"]
        assert clustered["hi"] - clustered["lo"] > 2 * (per_problem["hi"] - per_problem["lo"])
    one_row = paired_bootstrap(np.array([a_fact], float), np.array([b_fact], float))
    clustered = paired_bootstrap(a, b, groups=facts)
    assert (clustered["lo"], clustered["hi"]) == pytest.approx((one_row["lo"], one_row["hi"]), abs=1e-12)
    # a problem per cluster is the per-problem bootstrap itself
    own = paired_bootstrap(a2, b2, groups=np.arange(a2.shape[1]))
    assert (own["lo"], own["hi"]) == (paired_bootstrap(a2, b2)["lo"], paired_bootstrap(a2, b2)["hi"])


def test_fact_clustered_interval_matches_the_exact_resampling_distribution():
    """Facts of unequal sizes (a replicate's mean is its drawn problems' mean, not a mean of fact means):
    enumerate all 5^5 equally likely draws of 5 facts and take the exact 2.5 / 97.5 % quantiles (neighbouring
    atoms near the lower one lie 0.011 apart: the tolerance tells them apart)."""
    import itertools

    sizes, outcome = [1, 2, 3, 4, 5], [1.0, 0.0, 1.0, 1.0, 0.0]
    x = np.concatenate([[o] * n for o, n in zip(outcome, sizes)])[None, :]
    groups = np.concatenate([[f"fact{k}"] * n for k, n in enumerate(sizes)])
    draws = np.array([sum(outcome[k] * sizes[k] for k in d) / sum(sizes[k] for k in d)
                      for d in itertools.product(range(5), repeat=5)])
    lo, hi = np.quantile(draws, [0.025, 0.975], method="inverted_cdf")
    got = paired_bootstrap(x, groups=groups, n_boot=20_000, seed=3)
    assert got["mean"] == pytest.approx(8 / 15) and 0.05 < lo < 0.1
    assert got["lo"] == pytest.approx(lo, abs=0.005) and got["hi"] == pytest.approx(hi, abs=0.005)
    with pytest.raises(ValueError, match="groups"):
        paired_bootstrap(x, groups=groups[:-1])
