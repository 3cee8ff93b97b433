"""One-shot releases of statistics: Gaussian, Laplace, randomized response (SPEC s9).

Each mechanism returns a :class:`Release`: the noisy value, its noise scale
and a :class:`~numpyro_dp.ledger.LedgerEntry` in the conventions of the
MCMC kernels, so that a release and a DP-MCMC run can be charged to one
budget (``release.charge_to(ledger)``, then ``PrivateMCMC(..., ledger=ledger)``).
Inference on the release (e.g. NumPyro's NUTS on a noise-aware model) is
post-processing and costs nothing more.

Sensitivities are taken from explicit a-priori bounds and the neighbourhood
relation (SPEC s0): a bound computed from the data would itself depend on the
rows it is meant to hide, so :func:`clip_rows` refuses one that equals the
data's own extreme.  The noise is ordinary floating-point noise (drawn in
float32 by JAX, added in float64); like every such implementation it carries
the low-order-bit caveat of Mironov (2012).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import dp_accounting as dpa
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_dp.accounting import (
    calibrate_noise_multiplier,
    check_budget,
    check_neighbourhood,
    sensitivity_factor,
)
from numpyro_dp.ledger import LedgerEntry, PrivacyLedger


class Release(NamedTuple):
    """A privatised statistic.

    Attributes
    ----------
    value : ndarray
        The released (noisy) value: public.
    scale : float
        Noise standard deviation (Gaussian), Laplace scale ``b``, or the
        randomized-response noise parameter ``p``.
    entry : LedgerEntry
        Its privacy cost, one release (``phase="release"``).
    neighbourhood : str
        The neighbourhood its sensitivity was computed for.
    """

    value: np.ndarray
    scale: float
    entry: LedgerEntry
    neighbourhood: str

    def charge_to(self, ledger: PrivacyLedger) -> None:
        """Charge this release to ``ledger`` (e.g. one shared with a PrivateMCMC).

        Raises :class:`~numpyro_dp.PrivacyBudgetError` if the ledger's budget
        cannot pay for it: the value must then not be published.
        """
        charge(ledger, self.entry, self.neighbourhood)


def charge(ledger: PrivacyLedger, entry: LedgerEntry, neighbourhood: str) -> None:
    """Charge ``entry`` to ``ledger`` after checking that the neighbourhoods agree."""
    if ledger.neighbourhood != neighbourhood:
        raise ValueError(
            f"The release was calibrated for the {neighbourhood!r} neighbourhood but "
            f"the ledger is kept under {ledger.neighbourhood!r}; release again with "
            "the ledger's neighbourhood (its sensitivity differs)."
        )
    ledger.charge(entry)


def release_entry(name: str, event: dpa.DpEvent) -> LedgerEntry:
    """Ledger entry of one one-shot release."""
    return LedgerEntry(name, "release", 1, 1, event)


# ------------------------------------------------------------ sensitivities
def check_bound(name: str, bound) -> float:
    """An a-priori bound: one finite number > 0 fixed before seeing the data."""
    if np.ndim(bound) != 0:
        raise ValueError(
            f"{name} must be a single number fixed before seeing the data (a "
            "measurement range, a codebook limit), not an array."
        )
    bound = float(bound)
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"{name}={bound} must be a finite number > 0.")
    return bound


def sum_sensitivity(bound: float, neighbourhood: str = "substitute") -> float:
    """Sensitivity of a sum of rows each of norm <= ``bound`` (2 bound or bound)."""
    return sensitivity_factor(neighbourhood) * check_bound("bound", bound)


def gram_sensitivity(x_bound: float, neighbourhood: str = "substitute") -> float:
    """l2-sensitivity of the upper triangle of ``X^T X`` for rows with ``||x|| <= x_bound``.

    Add/remove: ``||ut(x x^T)|| <= ||x x^T||_F = ||x||^2``.  Substitute:
    ``||x x^T - x' x'^T||_F^2 = ||x||^4 + ||x'||^4 - 2 (x.x')^2 <= 2 x_bound^4``.
    """
    b2 = check_bound("x_bound", x_bound) ** 2
    return b2 * (math.sqrt(2.0) if check_neighbourhood(neighbourhood) == "substitute" else 1.0)


def clip_rows(x, bound: float, clip: bool, name: str = "x") -> np.ndarray:
    """Rows of ``x`` (one scalar or vector per row) bounded in l2 norm by ``bound``.

    Rows beyond the bound are projected onto it only when ``clip=True``; the
    projection is part of the mechanism and keeps its sensitivity valid.
    A bound equal to the data's own largest norm is refused: it was computed
    from the data, so the noise scale would reveal the most extreme row.
    """
    bound = check_bound(f"{name}_bound", bound)
    x = np.asarray(x, np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} holds NaN or inf; remove or impute them first.")
    norms = np.abs(x) if x.ndim == 1 else np.linalg.norm(x.reshape(len(x), -1), axis=1)
    largest = float(norms.max(initial=0.0))
    if math.isclose(bound, largest, rel_tol=1e-9):
        raise ValueError(
            f"{name}_bound equals the largest norm in the data: a bound computed from "
            "the data makes the sensitivity, hence the noise, depend on the rows it "
            "should hide (the guarantee no longer holds). Fix it from public knowledge "
            "(measurement ranges, a codebook, a published scale) and clip=True."
        )
    if largest > bound:
        if not clip:
            raise ValueError(
                f"Some rows of {name} exceed {name}_bound={bound}: pass clip=True to "
                "project them onto the bound (part of the mechanism), or state a larger "
                "a-priori bound."
            )
        scale = np.minimum(1.0, bound / np.maximum(norms, 1e-300))
        x = x * (scale if x.ndim == 1 else scale.reshape((-1,) + (1,) * (x.ndim - 1)))
    return x


# ------------------------------------------------------------- calibration
def gaussian_sigma(
    epsilon: float, delta: float, sensitivity: float = 1.0, method: str = "analytic"
) -> float:
    """Noise standard deviation of a Gaussian mechanism for (epsilon, delta)-DP.

    Parameters
    ----------
    epsilon, delta : float
        Target budget.
    sensitivity : float
        l2-sensitivity under the chosen neighbourhood.
    method : {"analytic", "classic"}
        ``"analytic"``: the smallest sigma (to 1e-6, rounded up) with
        delta(eps) <= delta for the exact Gaussian privacy curve (Balle & Wang
        2018, via this library's accountant).  ``"classic"``: Dwork & Roth's
        ``sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon``, valid for
        epsilon < 1 only and always larger.
    """
    check_budget(epsilon, delta)
    if delta is None:
        raise ValueError("A Gaussian mechanism needs delta > 0, e.g. delta = 0.1 / n.")
    sensitivity = check_bound("sensitivity", sensitivity)
    if method == "classic":
        if epsilon >= 1:
            raise ValueError(
                f"The classic Gaussian calibration holds only for epsilon < 1 (got "
                f"{epsilon}); use method='analytic'."
            )
        return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
    if method != "analytic":
        raise ValueError(f"method={method!r}; use 'analytic' or 'classic'.")
    z = calibrate_noise_multiplier(dpa.GaussianDpEvent, epsilon, delta)
    return z * sensitivity


def _budget_or_noise(epsilon, noise, noise_name):
    if (noise is None) == (epsilon is None):
        raise ValueError(f"Pass either epsilon (to calibrate) or {noise_name}, not both.")


# --------------------------------------------------------------- mechanisms
def gaussian_mechanism(
    rng_key,
    value,
    sensitivity: float,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    method: str = "analytic",
    neighbourhood: str = "substitute",
    name: str = "GaussianMechanism",
) -> Release:
    """Release ``value + N(0, sigma^2 I)``.

    ``sensitivity`` is the l2-sensitivity of ``value`` under ``neighbourhood``
    (see :func:`sum_sensitivity`).  Either ``epsilon`` and ``delta`` (sigma
    calibrated by ``method``) or ``noise_multiplier = sigma / sensitivity``.
    """
    check_neighbourhood(neighbourhood)
    _budget_or_noise(epsilon, noise_multiplier, "noise_multiplier")
    sensitivity = check_bound("sensitivity", sensitivity)
    if epsilon is not None:
        sigma = gaussian_sigma(epsilon, delta, sensitivity, method)
    else:
        sigma = check_bound("noise_multiplier", noise_multiplier) * sensitivity
    value = np.asarray(value, np.float64)
    noise = np.asarray(random.normal(rng_key, value.shape), np.float64)
    entry = release_entry(name, dpa.GaussianDpEvent(sigma / sensitivity))
    return Release(value + sigma * noise, sigma, entry, neighbourhood)


def symmetric_gaussian_noise(rng_key, d: int) -> np.ndarray:
    """Symmetric ``d x d`` matrix whose upper triangle (with diagonal) is iid N(0, 1)."""
    upper = jnp.triu(random.normal(rng_key, (d, d)))
    return np.asarray(upper + jnp.triu(upper, 1).T, np.float64)


def gram_mechanism(
    rng_key,
    x,
    x_bound: float,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    neighbourhood: str = "substitute",
    clip: bool = False,
) -> Release:
    """Release ``X^T X + sigma M`` with ``M`` symmetric, upper triangle iid N(0, 1).

    The released quantity is the upper triangle (the rest is its mirror), with
    sensitivity :func:`gram_sensitivity`; sigma is calibrated analytically.
    The release need not be positive semi-definite.
    """
    x = clip_rows(x, x_bound, clip)
    delta_s = gram_sensitivity(x_bound, neighbourhood)
    _budget_or_noise(epsilon, noise_multiplier, "noise_multiplier")
    if epsilon is not None:
        sigma = gaussian_sigma(epsilon, delta, delta_s)
    else:
        sigma = check_bound("noise_multiplier", noise_multiplier) * delta_s
    gram = x.T @ x + sigma * symmetric_gaussian_noise(rng_key, x.shape[1])
    entry = release_entry("GramMechanism", dpa.GaussianDpEvent(sigma / delta_s))
    return Release(gram, sigma, entry, neighbourhood)


def laplace_mechanism(
    rng_key,
    value,
    l1_sensitivity: float,
    *,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    neighbourhood: str = "substitute",
) -> Release:
    """Release ``value + Laplace(0, b)`` coordinatewise: epsilon-DP with ``b = Delta_1 / epsilon``.

    ``l1_sensitivity`` is taken under ``neighbourhood``;
    ``noise_multiplier = b / l1_sensitivity``.
    """
    check_neighbourhood(neighbourhood)
    _budget_or_noise(epsilon, noise_multiplier, "noise_multiplier")
    l1_sensitivity = check_bound("l1_sensitivity", l1_sensitivity)
    if epsilon is not None:
        check_budget(epsilon, None)
        noise_multiplier = 1.0 / epsilon
    b = check_bound("noise_multiplier", noise_multiplier) * l1_sensitivity
    value = np.asarray(value, np.float64)
    noise = np.asarray(random.laplace(rng_key, value.shape), np.float64)
    entry = release_entry("LaplaceMechanism", dpa.LaplaceDpEvent(b / l1_sensitivity))
    return Release(value + b * noise, b, entry, neighbourhood)


def randomized_response(
    rng_key,
    values,
    num_buckets: int,
    *,
    epsilon: float | None = None,
    noise_parameter: float | None = None,
) -> Release:
    """Randomized response on each row's category in ``{0, ..., num_buckets - 1}``.

    Each row keeps its value with probability ``1 - p`` and is otherwise
    replaced by a uniform draw, so ``epsilon = ln(1 + k (1 - p) / p)`` and
    ``p = k / (e^epsilon + k - 1)``.  A row only moves its own output, so the
    whole vector costs one release.  Substitute neighbourhood only: under
    add/remove the number of outputs would itself reveal the change.
    """
    if not (isinstance(num_buckets, (int, np.integer)) and num_buckets >= 2):
        raise ValueError(f"num_buckets={num_buckets!r} must be an integer >= 2.")
    _budget_or_noise(epsilon, noise_parameter, "noise_parameter")
    if epsilon is not None:
        check_budget(epsilon, None)
        noise_parameter = num_buckets / (math.expm1(epsilon) + num_buckets)
    if not 0 < noise_parameter <= 1:
        raise ValueError(f"noise_parameter={noise_parameter} must lie in (0, 1].")
    values = np.asarray(values)
    if not (np.issubdtype(values.dtype, np.integer) and values.min(initial=0) >= 0
            and values.max(initial=0) < num_buckets):
        raise ValueError(
            f"values must be integers in 0..{num_buckets - 1} (category codes)."
        )
    k_flip, k_draw = random.split(rng_key)
    flip = np.asarray(random.uniform(k_flip, values.shape)) < noise_parameter
    draw = np.asarray(random.randint(k_draw, values.shape, 0, num_buckets))
    entry = release_entry(
        "RandomizedResponse", dpa.RandomizedResponseDpEvent(noise_parameter, num_buckets)
    )
    return Release(np.where(flip, draw, values), noise_parameter, entry, "substitute")
