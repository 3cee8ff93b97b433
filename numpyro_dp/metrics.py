"""Distances between samples, for checking kernels against exact posteriors (SPEC s8)."""

from __future__ import annotations

import numpy as np


def _sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(
        (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T, 0.0
    )


def mmd(x, y, rng: np.random.Generator | int = 0, bandwidth: float | None = None) -> float:
    """Maximum mean discrepancy with a Gaussian RBF kernel (SPEC s8).

    The bandwidth is the median distance between the points of a 500-point
    resample (with replacement) of both samples; MMD^2 is the unbiased
    U-statistic and ``sqrt(max(MMD^2, 0))`` is returned.

    Parameters
    ----------
    x, y : array, shape (n, d) or (n,)
        The two samples.
    rng : numpy Generator or int
        Randomness for the bandwidth resample.
    bandwidth : float, optional
        Use this kernel width instead of the median heuristic.
    """
    rng = np.random.default_rng(rng)
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    if bandwidth is None:
        both = np.concatenate([x, y])
        sub = both[rng.integers(0, len(both), 500)]
        d = np.sqrt(_sq_dists(sub, sub))
        bandwidth = float(np.median(d[np.triu_indices(len(sub), 1)]))
    gamma = 1.0 / (2.0 * bandwidth**2)
    kxx = np.exp(-gamma * _sq_dists(x, x))
    kyy = np.exp(-gamma * _sq_dists(y, y))
    kxy = np.exp(-gamma * _sq_dists(x, y))
    n, m = len(x), len(y)
    mmd2 = (
        (kxx.sum() - np.trace(kxx)) / (n * (n - 1))
        + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
        - 2.0 * kxy.mean()
    )
    return float(np.sqrt(max(mmd2, 0.0)))
