"""Closed forms of the Gaussian mechanism in the ``mu``-GDP parametrisation.

A release with noise multiplier ``z`` (noise sd over l2-sensitivity) is
``mu``-GDP with ``mu = 1 / z`` (Dong, Roth & Su 2022); its exact
``delta(epsilon)`` is Balle & Wang's (2018, Thm 8).  The zCDP and RDP
conversions are loose and serve as cross-checks only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from dp_accounting import gaussian_mechanism
from scipy.special import log_ndtr


def gaussian_log_delta(epsilon: float, mu: float) -> float:
    """log delta(eps) of a mu-GDP Gaussian mechanism (Balle & Wang 2018, tight).

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), evaluated in
    log space so that it stays accurate for eps up to ~1e8.
    """
    if mu == 0:
        return -math.inf
    a = float(log_ndtr(-epsilon / mu + mu / 2))
    b = epsilon + float(log_ndtr(-epsilon / mu - mu / 2))
    return a + math.log1p(-math.exp(b - a)) if b < a else -math.inf


def gaussian_epsilon(mu: float, delta: float, *, rounding: str = "up") -> float:
    """Smallest epsilon at which a mu-GDP mechanism is (eps, delta)-DP.

    ``rounding="up"`` (the default, what is charged) never returns less than
    the exact figure; ``"down"`` never more (a lower bound, for refusing).
    """
    if rounding not in ("up", "down"):
        raise ValueError(f"rounding={rounding!r}; use 'up' or 'down'.")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    eps = gaussian_mechanism.get_epsilon_gaussian(1.0 / mu, delta)
    # gaussian_log_delta is off by up to ~2e-13 / mu + 3e-17 * eps in log delta
    # (cancellation between its two terms; measured against 80-digit mpmath for
    # mu in [1e-9, 1e6]).  Aim past log(delta) by >= 40x that, so that the
    # exact delta(eps) is on the side asked for: never above delta when rounding
    # up, above it (so the exact epsilon lies higher) when rounding down.
    margin = 1e-11 / mu + 1e-15 * eps + 1e-12
    step = 1e-12 * (1.0 + eps)
    if rounding == "up":
        while gaussian_log_delta(eps, mu) > math.log(delta) - margin:  # brentq may land below
            eps += step
            step *= 2
        return float(eps)
    while eps > 0 and gaussian_log_delta(eps, mu) < math.log(delta) + margin:
        eps -= step
        step *= 2
    return max(0.0, float(eps))


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """Loose (eps, delta) of rho-zCDP: rho + 2 sqrt(rho ln(1/delta)). Cross-check only."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def epsilon_to_zcdp(epsilon: float, delta: float) -> float:
    """Inverse of :func:`zcdp_to_epsilon`."""
    ld = math.log(1.0 / delta)
    return (math.sqrt(epsilon + ld) - math.sqrt(ld)) ** 2


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    """Classic conversion min_a eps_RDP(a) + ln(1/delta) / (a - 1). Cross-check only."""
    orders, rdp = np.asarray(orders, float), np.asarray(rdp, float)
    return float(np.min(rdp + math.log(1.0 / delta) / (orders - 1.0)))

