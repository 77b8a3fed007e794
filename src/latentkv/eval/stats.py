"""Confidence intervals for the quality evaluation: Wilson for accuracies, bootstrap for the rest.

Wilson score interval (a proportion k/n, e.g. multiple-choice accuracy, items independent):

    p = k/n, centre = (p + z^2/2n) / (1 + z^2/n),
    half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2)

Bootstrap over units (perplexity, KL divergence, top-1 agreement): tokens inside a window are
correlated, so the resampled unit is a whole window, never a single token. Each window
contributes sums (e.g. of NLL) and a token count; a statistic is a ratio of summed sums to
summed counts over the resampled windows. Every statistic of one run is computed from the same
resampled index sets, which makes the tier-vs-f32 differences paired. Intervals are percentile
intervals of the resampled statistic.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of the proportion k/n (95% at the default z)."""
    if n <= 0:
        raise ValueError(f"a proportion needs n >= 1 (got {n})")
    if not 0 <= k <= n:
        raise ValueError(f"successes must be in 0..n (got {k} of {n})")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at k = 0 (k = n) the bound is exactly 0 (1); the formula only rounds to it
    lo = 0.0 if k == 0 else centre - half
    hi = 1.0 if k == n else centre + half
    return lo, hi


def resample_indices(n_units: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n_units] unit indices drawn with replacement (fixed seed: reproducible)."""
    if n_units < 1 or resamples < 1:
        raise ValueError(f"bootstrap needs units and resamples (got {n_units}, {resamples})")
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_units, size=(resamples, n_units))


def resampled_ratio(sums: np.ndarray, counts: np.ndarray, index: np.ndarray) -> np.ndarray:
    """sum(sums[idx]) / sum(counts[idx]) for each row of index [B, W]; sums, counts [W] -> [B]."""
    return sums[index].sum(axis=1) / counts[index].sum(axis=1)


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap samples [B]."""
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return float(lo), float(hi)


def bootstrap_mean_interval(
    values: np.ndarray, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of independent values [N]."""
    values = np.asarray(values, dtype=np.float64)
    index = resample_indices(len(values), resamples, seed)
    return percentile_interval(values[index].mean(axis=1), level)
