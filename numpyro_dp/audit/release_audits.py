"""White-box audits of the library's releases, drawn many times on two neighbours.

:func:`clipped_sum_release` (the Gaussian release of a clipped sum) and
:func:`batch_llr_release` (DPMinibatchPenalty's batch statistic): the realised
sensitivity and noise give the release's Gaussian ``mu`` and its epsilon,
against the accountant's; :func:`barker_test`, DP Barker's accept test on a
fixed batch.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from numpyro_dp.accounting import epsilon_spent, sensitivity_factor
from numpyro_dp.accounting.gaussian import gaussian_epsilon
from numpyro_dp.audit.bounds import (
    AuditResult,
    check_confidence,
    epsilon_lower_bound,
)
from numpyro_dp.kernels import barker, penalty, ratios
from numpyro_dp.primitives import clipping, release
from numpyro_dp.primitives.rounding import exact_sum
from numpyro_dp.primitives.secret import noise_key, run_secret


def clipped_sum_release(
    rows: Any,
    neighbour_rows: Any,
    *,
    row_bound: float,
    noise_multiplier: float,
    delta: float,
    neighbourhood: str = "substitute",
    num_draws: int = 20_000,
    confidence: float = 0.95,
    seed: int = 0,
    reproducible_noise: bool = False,
) -> AuditResult:
    """White-box audit of the Gaussian release of a sum of clipped rows.

    Clips every row as the kernels do (:func:`~numpyro_dp.kernels.ratios.clip_ratios`
    for scalar rows, :func:`~numpyro_dp.primitives.clipping.clip_weights` for
    vectors), sums, and releases
    through :func:`~numpyro_dp.primitives.release.release_clipped_sum` ``num_draws``
    times for each set of rows.  Along the difference of the two exact sums
    the releases are ``sum + N(0, sigma^2)``: the realised sensitivity
    ``Delta`` and a ``confidence`` upper bound on ``sigma`` (chi-square) give a
    lower bound on ``mu = Delta / sigma`` and so on epsilon (Dong, Roth & Su
    2022), against the accountant's epsilon for ``noise_multiplier``.  It
    assumes Gaussian noise, which is what the code draws.

    Parameters
    ----------
    rows, neighbour_rows : array of shape (n,) or (n, d)
        Per-row contributions (log-likelihood ratios or gradients) of two
        neighbouring data sets, before clipping.
    row_bound : float
        The clip.
    noise_multiplier : float
        The ``z`` the accountant charges.
    seed : int
        The draws' public keys.
    reproducible_noise : bool
        Derive the noise from ``seed`` (tests; warns), as ``PrivateMCMC`` does.
    """
    check_confidence(confidence, delta)
    factor = sensitivity_factor(neighbourhood)
    sides = []
    for raw in (rows, neighbour_rows):
        clipped, bound = _clip_rows(jnp.asarray(raw), row_bound)
        total = exact_sum(clipped, bound)

        def draw(key, total=total, n=clipped.shape[0], bound=bound):
            return release.release_clipped_sum(key, total, n, bound,
                                               noise_multiplier=noise_multiplier,
                                               sensitivity_factor=factor)[0]

        exact = np.asarray(total[0], np.float64) + np.asarray(total[1], np.float64)
        sides.append((draw, exact))
    return _white_box(sides, factor * row_bound, noise_multiplier, delta, neighbourhood,
                      num_draws, confidence, seed, reproducible_noise)


def batch_llr_release(
    ratios: Any,
    neighbour_ratios: Any,
    *,
    clip: float,
    scale: float,
    noise_multiplier: float,
    delta: float,
    num_draws: int = 20_000,
    confidence: float = 0.95,
    seed: int = 0,
    reproducible_noise: bool = False,
) -> AuditResult:
    """White-box audit of DPMinibatchPenalty's release, as :func:`clipped_sum_release`.

    ``ratios`` and ``neighbour_ratios`` are the log-likelihood ratios of one
    batch of ``b`` rows that differ in one row (``"substitute"``), before
    clipping to ``clip``; ``scale = n T / b``.  The release is the batch's
    ``lambda* - sigma_b^2 / 2`` plus Gaussian noise
    (:func:`~numpyro_dp.kernels.penalty.release_batch_llr`).  The claim is one
    such release with noise multiplier ``z``, before any amplification by the
    sampling of the batch (the batch is fixed here).
    """
    check_confidence(confidence, delta)
    factor = sensitivity_factor("substitute")
    sides = []
    for raw in (ratios, neighbour_ratios):
        r = jnp.asarray(raw)

        def draw(key, r=r):
            return penalty.release_batch_llr(key, r, clip, scale,
                                             noise_multiplier=noise_multiplier,
                                             sensitivity_factor=factor)[0]

        sides.append((draw, np.asarray(penalty.batch_llr(r, clip, scale, factor)[0],
                                       np.float64)))
    b = np.shape(ratios)[0]
    nominal = factor * (scale * clip + (b - 1) / b * scale**2 * clip**2)
    return _white_box(sides, nominal, noise_multiplier, delta, "substitute", num_draws,
                      confidence, seed, reproducible_noise)


def barker_test(
    ratios: Any,
    neighbour_ratios: Any,
    *,
    n0: float,
    delta: float,
    num_draws: int = 20_000,
    confidence: float = 0.95,
    seed: int = 0,
    reproducible_noise: bool = False,
) -> AuditResult:
    """White-box audit of one DP Barker test on a fixed batch (Heikkilä et al. 2019).

    ``ratios`` and ``neighbour_ratios``: the ``b`` log-likelihood ratios of one
    batch on two data sets that differ in one row, before the clip
    ``sqrt(b) / n0``.  The test's decision is drawn ``num_draws`` times on
    each, and :func:`epsilon_lower_bound` bounds epsilon from how often it
    accepts (the canary should raise the ratio on ``ratios``).  The claim is
    one test before any amplification by the sampling of the batch.
    """
    check_confidence(confidence, delta)
    secret = run_secret(jax.random.PRNGKey(seed), reproducible_noise, "this audit")
    correction = barker.load_correction()
    decisions = []
    for side, raw in enumerate((ratios, neighbour_ratios)):
        r = jnp.asarray(raw)
        lam, var_b = barker.barker_statistics(r, barker.barker_clip(r.shape[0], n0, r.dtype), n0)
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), side), num_draws)
        accept = jax.vmap(lambda key, lam=lam, var_b=var_b: barker.barker_decision(
            noise_key(secret, key), lam, var_b, correction))(keys)
        decisions.append(np.asarray(accept, np.float64))
    b = np.shape(ratios)[0]
    claimed = epsilon_spent(barker.BarkerDpEvent(b), delta)
    bound = epsilon_lower_bound(*decisions, delta=delta, confidence=confidence)
    return AuditResult("white-box", claimed, delta, bound, confidence, num_draws,
                       f"accepted {decisions[0].mean():.3f} with the canary, "
                       f"{decisions[1].mean():.3f} without")


def _white_box(sides, nominal, noise_multiplier, delta, neighbourhood, num_draws, confidence,
               seed, reproducible_noise) -> AuditResult:
    """``mu`` of a Gaussian release from its draws on two neighbours, and its epsilon.

    ``sides``: ``(draw(key) -> release, exact value)`` per data set.  Along the
    difference of the exact values the releases are ``value + N(0, sigma^2)``:
    the realised sensitivity and a ``confidence`` upper bound on ``sigma``
    (chi-square) give a lower bound on ``mu``.
    """
    secret = run_secret(jax.random.PRNGKey(seed), reproducible_noise, "this audit")
    releases, exact = [], []
    for side, (draw, value) in enumerate(sides):
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), side), num_draws)
        released = jax.vmap(lambda key, draw=draw: draw(noise_key(secret, key)))(keys)
        releases.append(np.asarray(released, np.float64).reshape(num_draws, -1))
        exact.append(np.asarray(value, np.float64).reshape(-1))
    difference = exact[0] - exact[1]
    realised = float(np.linalg.norm(difference))
    direction = difference / realised if realised > 0 else np.eye(len(difference))[0]
    noise = np.concatenate([(r - v) @ direction for r, v in zip(releases, exact, strict=True)])
    dof = len(noise)
    sigma_hat = float(np.sqrt(np.mean(noise**2)))
    sigma_upper = sigma_hat * math.sqrt(dof / stats.chi2.ppf(1 - confidence, dof))
    mu_lower = realised / sigma_upper
    bound = gaussian_epsilon(mu_lower, delta) if mu_lower > 0 else 0.0
    claimed = epsilon_spent(dpa.GaussianDpEvent(noise_multiplier), delta, neighbourhood)
    details = (f"noise sd / nominal sensitivity = {sigma_hat / nominal:.4g} (z = "
               f"{noise_multiplier:g}); realised sensitivity / nominal = "
               f"{realised / nominal:.4g}")
    return AuditResult("white-box", claimed, delta, max(bound, 0.0), confidence, num_draws,
                       details)


def _clip_rows(rows: jax.Array, clip: float) -> tuple[jax.Array, float]:
    """Rows clipped as the kernels clip them, and the bound on their norms."""
    if rows.ndim == 1:
        return ratios.clip_ratios(rows, clip), clip
    weights = clipping.clip_weights(jnp.linalg.norm(rows, axis=1), clip)
    return rows * weights[:, None], clipping.vector_clip_bound(clip, rows.shape[1], rows.dtype)
