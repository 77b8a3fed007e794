"""Intervals against hand-computed values and known coverage: Wilson, percentile bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pytest

from latentkv.eval import stats


def test_wilson_matches_a_hand_computed_interval():
    # k = 8, n = 10, z = 1.96: p = 0.8, z^2 = 3.8416
    # centre = (0.8 + 3.8416/20) / (1 + 3.8416/10) = 0.99208 / 1.38416 = 0.716738
    # half   = 1.96 / 1.38416 * sqrt(0.016 + 3.8416/400) = 1.416021 * 0.160050 = 0.226634
    lo, hi = stats.wilson_interval(8, 10, z=1.96)
    assert lo == pytest.approx(0.490157, abs=1e-5)
    assert hi == pytest.approx(0.943319, abs=1e-5)


def test_wilson_default_is_95_percent_and_handles_the_edges():
    assert stats.wilson_interval(8, 10) == pytest.approx(stats.wilson_interval(8, 10, z=1.96), abs=1e-4)
    lo, hi = stats.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(3.8415 / (10 + 3.8415), abs=1e-4)  # k=0: z^2 / (n + z^2)
    lo, hi = stats.wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(10 / (10 + 3.8415), abs=1e-4)
    lo, hi = stats.wilson_interval(50, 100)
    assert (lo + hi) / 2 == pytest.approx(0.5) and 0.40 < lo < 0.41  # symmetric about 1/2


@pytest.mark.parametrize("k, n", [(1, 0), (-1, 5), (6, 5)])
def test_wilson_rejects_impossible_counts(k, n):
    with pytest.raises(ValueError):
        stats.wilson_interval(k, n)


def test_wilson_covers_the_true_proportion_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    p, n, trials = 0.3, 80, 2000
    ks = rng.binomial(n, p, size=trials)
    covered = sum(lo <= p <= hi for lo, hi in (stats.wilson_interval(int(k), n) for k in ks))
    assert 0.92 <= covered / trials <= 0.98


def test_bootstrap_interval_contains_the_true_mean_on_synthetic_data():
    values = np.random.default_rng(3).normal(loc=2.5, scale=1.0, size=200)
    lo, hi = stats.bootstrap_mean_interval(values, resamples=2000, seed=0)
    assert lo < 2.5 < hi
    # close to the normal-theory interval mean +- 1.96 s / sqrt(n)
    half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))
    assert (hi - lo) == pytest.approx(2 * half, rel=0.15)


def test_bootstrap_coverage_is_near_95_percent():
    rng = np.random.default_rng(7)
    datasets, covered = 300, 0
    for seed in range(datasets):
        values = rng.exponential(scale=1.0, size=60)  # skewed, true mean 1
        lo, hi = stats.bootstrap_mean_interval(values, resamples=500, seed=seed)
        covered += lo <= 1.0 <= hi
    assert 0.88 <= covered / datasets <= 0.99


def test_resampled_ratio_is_the_pooled_ratio_of_each_resample():
    sums, counts = np.array([1.0, 4.0, 9.0]), np.array([1.0, 2.0, 3.0])
    index = stats.resample_indices(3, 5, seed=0)
    expected = [sum(sums[i] for i in row) / sum(counts[i] for i in row) for row in index]
    np.testing.assert_allclose(stats.resampled_ratio(sums, counts, index), expected)
    assert index.shape == (5, 3) and index.min() >= 0 and index.max() <= 2
    np.testing.assert_array_equal(index, stats.resample_indices(3, 5, seed=0))  # reproducible


def test_percentile_interval_of_known_samples():
    lo, hi = stats.percentile_interval(np.arange(1001, dtype=float))
    assert (lo, hi) == pytest.approx((25.0, 975.0))
