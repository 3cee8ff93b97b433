"""One-shot releases of statistics: Gaussian, Laplace, randomized response, ``X^T X``.

Each mechanism returns a :class:`Release`: the noisy value, its noise scale
and a :class:`~numpyro_dp.accounting.entry.LedgerEntry` in the conventions of the
MCMC kernels, so that a release and a DP-MCMC run can be charged to one
budget: pass ``ledger=`` (the entry is charged before any noise is drawn),
then ``PrivateMCMC(..., ledger=ledger)``.  Inference on the release (e.g.
NumPyro's NUTS on a noise-aware model) is post-processing and costs nothing
more.

Sensitivities are taken from explicit a-priori bounds and the neighbourhood
relation.  A mechanism never looks at the rows to decide whether to run: rows
beyond their bound are projected onto it (:func:`clip_rows`, part of every
mechanism that takes rows), a category code outside the codebook is reported
as the nearest code (:func:`randomized_response`), and an error names public
facts only (shapes, dtypes, arguments).  The one exception is NaN or inf,
which lie outside every data domain: they are refused before anything is
charged, and that refusal says that some row holds one (clean the data before
a private analysis).  A bound computed from the data is the caller's
responsibility: it makes the noise scale a statistic of the rows.

Floating point (Mironov 2012).  Every release goes through :func:`secret_release`
and a :class:`~numpyro_dp.primitives.release.GridPlan`:

* the noise key is :func:`~numpyro_dp.primitives.secret.noise_key` of a fresh 64-bit
  secret from the operating system at the user's (public) key, so the key
  does not determine the noise (``reproducible_noise=True``: tests only);
* the statistic is computed in float64 whatever JAX's global setting, sums
  over rows as float64 products of blocks of rows added in double-word
  arithmetic (:mod:`~numpyro_dp.releases.row_products`), and the charged
  sensitivity covers the value *as computed*: twice the computation's error
  bound and the rounding to the release grid are added to the stated
  sensitivity before the noise is scaled to it (the release gate,
  :func:`~numpyro_dp.primitives.release.grid_plan`), so the ledger's noise
  multiplier is exactly what the accountant charges;
* the noise is added by :func:`~numpyro_dp.primitives.rounding.grid_release`: the
  statistic is rounded to a power-of-two grid, noise rounded to the same grid
  is added in exact integer arithmetic, and the result is rounded to a cell
  of about sigma / 2^8, so the low-order bits of a release carry no trace of
  the value (Mironov 2012).

What remains: the sampler is an inverse-CDF normal (or Laplace) of a 64-bit
uniform, so each output cell's probability follows the continuous
distribution only up to a discretisation residual of about 1e-8 relative per
cell in float64 (tails beyond 9 sigma are missing), which the accountant
does not charge; the error bound of the float64 block products assumes a
standard dot-product kernel (any summation order, no fast approximate
arithmetic); and a value handed in already computed
(:func:`gaussian_mechanism`, :func:`laplace_mechanism`) is private only if
its sensitivity, as computed by the caller, is the one stated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import random

from numpyro_dp.accounting import (
    calibrate_gaussian,
    check_budget,
    check_delta_for_rows,
    check_neighbourhood,
    sensitivity_factor,
)
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.accounting.ledger import PrivacyLedger
from numpyro_dp.model.units import ROW, Units, UnitsError, bound_and_label, holder_units
from numpyro_dp.primitives.release import GridPlan, grid_plan
from numpyro_dp.primitives.secret import noise_key, run_secret
from numpyro_dp.releases.row_products import (
    computed_bound,
    row_product_error,
    row_product_sum,
    symmetric_from_upper,
    upper_triangle,
)

T = TypeVar("T")


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

    def likelihood(self, statistic) -> dist.Distribution:
        """The release's law given the true ``statistic``: observe it in a model.

        ``numpyro.sample("y", release.likelihood(S), obs=release.value)`` makes
        a NumPyro model noise-aware: ``S`` is the statistic as the model
        computes it from latent data or parameters (for an additive statistic,
        its central-limit normal), and NUTS (Gaussian noise) or
        :class:`~numpyro_dp.PMMH` / :class:`~numpyro_dp.MHAAR` (Laplace noise,
        with ``S`` a latent site) then sample the posterior given the release,
        at no further cost.  Normal or Laplace with this release's scale,
        independent per coordinate (the grid the release is rounded to is
        finer than the noise by far, and ignored).
        """
        event = self.entry.per_iteration
        additive = self.entry.kernel not in ("GramMechanism", "adaSSP")
        if not additive or not isinstance(event, (dpa.GaussianDpEvent, dpa.LaplaceDpEvent)):
            raise ValueError(
                f"A {self.entry.kernel} release is not a statistic plus independent noise; "
                "for X^T X (GramMechanism) and adaSSP use ndp.linreg's models, for "
                "randomized response the flip law of each released bit."
            )
        family = dist.Normal if isinstance(event, dpa.GaussianDpEvent) else dist.Laplace
        shape = np.shape(self.value)
        law = family(statistic, self.scale)
        law = law.expand(jnp.broadcast_shapes(law.batch_shape, shape))
        return law.to_event(len(shape))


def charge(ledger: PrivacyLedger, entry: LedgerEntry, neighbourhood: str) -> None:
    """Charge ``entry`` to ``ledger`` after checking that the neighbourhoods agree."""
    if ledger.neighbourhood != neighbourhood:
        raise ValueError(
            f"The release was calibrated for the {neighbourhood!r} neighbourhood but "
            f"the ledger is kept under {ledger.neighbourhood!r}; release again with "
            "the ledger's neighbourhood (its sensitivity differs)."
        )
    ledger.charge(entry)


def release_entry(name: str, event: dpa.DpEvent, reproducible_noise: bool = False,
                  privacy_unit: str = ROW) -> LedgerEntry:
    """Ledger entry of one one-shot release (``reproducible_noise``: see :func:`secret_release`;
    ``privacy_unit``: what it protects, ``"row"`` or a :class:`~numpyro_dp.model.units.Units`
    label)."""
    return LedgerEntry(name, "release", 1, 1, event, reproducible_noise=bool(reproducible_noise),
                       privacy_unit=privacy_unit)


def secret_release(
    rng_key,
    entry: LedgerEntry,
    neighbourhood: str,
    draw: Callable[[jax.Array], T],
    *,
    ledger: PrivacyLedger | None = None,
    what: str = "this release",
) -> T:
    """Charge a release, then compute it from a secret noise key, in float64.

    Every mechanism of this module and of :mod:`numpyro_dp.releases.linreg_release`
    releases through here.

    Parameters
    ----------
    rng_key : jax.random key
        The user's key: public.  The noise key is
        ``noise_key(run_secret(rng_key, entry.reproducible_noise), rng_key)``, a
        fresh OS secret unless the entry records reproducible (test-only) noise.
    entry : LedgerEntry
        The release's cost.
    neighbourhood : str
        The neighbourhood its sensitivity was computed for.
    draw : callable
        ``draw(key)`` computes the statistic and returns the release (host
        arrays); it runs under ``jax.enable_x64(True)``, after the charge.
    ledger : PrivacyLedger, optional
        Charged with ``entry`` before the secret is drawn and ``draw`` runs: a
        :class:`~numpyro_dp.PrivacyBudgetError` leaves nothing computed.
    what : str
        Named in the reproducible-noise warning.
    """
    if ledger is not None:
        charge(ledger, entry, neighbourhood)
    secret = run_secret(rng_key, entry.reproducible_noise, what)
    with jax.enable_x64(True):
        return draw(noise_key(jnp.asarray(secret), rng_key))


# ------------------------------------------------------------ sensitivities
def release_units(privacy_unit, holder_rows: list[int], several: bool,
                  max_rows_per_unit: int | None, neighbourhood: str) -> Units | None:
    """The privacy units of a release's rows (:func:`~numpyro_dp.model.units.holder_units`),
    or None for a guarantee per row.

    Substitute neighbourhood only: under add/remove these releases keep the number
    of rows private, and the unit ids (and the ledger's fingerprint of them) would
    publish it.  With substitute the ids are public, like n.
    """
    if privacy_unit is None:
        if max_rows_per_unit is not None:
            raise UnitsError("max_rows_per_unit bounds the rows of a privacy unit: pass "
                             "privacy_unit= (one unit id per row) with it.")
        return None
    if check_neighbourhood(neighbourhood) == "add_remove":
        raise UnitsError(
            "privacy_unit needs neighbourhood='substitute' here: the unit ids fix the number "
            "of rows and units, which this release keeps private under add/remove, and the "
            "ledger's label of the units (a fingerprint of the ids) would publish them. With "
            "substitute the ids are public, like n."
        )
    return holder_units(privacy_unit, holder_rows, several, max_rows_per_unit)


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


def clip_rows(x, bound: float, name: str = "x") -> np.ndarray:
    """Rows of ``x`` (one scalar or vector per row) projected onto the l2 ball of radius ``bound``.

    A row of norm above ``bound`` is scaled onto it; the others are unchanged.
    The projection is part of the mechanism (its sensitivity assumes it), so
    it is applied to every row whatever the data hold and never raises on a
    row's value: an error or a warning that depended on whether some row
    exceeds the bound would tell the rows apart for free.  ``bound`` must be
    fixed without looking at the data (a measurement range, a codebook limit,
    a published scale).  Non-finite values are refused (:func:`check_finite`).
    """
    bound = check_bound(f"{name}_bound", bound)
    x = check_finite(np.asarray(x, np.float64), name)
    norms = np.abs(x) if x.ndim == 1 else np.linalg.norm(x.reshape(len(x), -1), axis=1)
    scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))
    return x * (scale if x.ndim == 1 else scale.reshape((-1,) + (1,) * (x.ndim - 1)))


def check_finite(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` if it holds no NaN or inf; otherwise a refusal that names the array only.

    NaN and inf lie outside every data domain, so no bound or projection can
    make them private.  The refusal comes before anything is charged and is
    not private: it says that some row holds one (never which, or how many).
    """
    if not np.all(np.isfinite(x)):
        raise ValueError(
            f"{name} holds NaN or inf, which lie outside the data domain: remove or impute "
            "those rows before a private analysis (an imputation fitted on the private "
            "rows must be privatised itself). This refusal is not private: it tells "
            "whoever sees it that some row holds NaN or inf."
        )
    return x


def planned_rows(num_rows: int, neighbourhood: str, max_rows: int | None) -> int:
    """The row count that a release's noise and grid are sized for: public facts only.

    Under ``"substitute"`` the number of rows ``n`` is public (a neighbour has
    as many), so the release is sized for ``n``; ``max_rows``, if given, must
    be at least ``n``.  Under ``"add_remove"`` ``n`` is what a neighbour
    changes, so nothing published may depend on it: the release is sized for
    ``max_rows``, a public upper bound on the rows (e.g. the population a
    sample is drawn from), which is then required.  A data set with more rows
    than ``max_rows`` lies outside the stated domain and is refused (a
    refusal that says so, and nothing more).
    """
    check_neighbourhood(neighbourhood)
    if max_rows is not None and not (isinstance(max_rows, (int, np.integer)) and max_rows >= 1):
        raise ValueError(f"max_rows={max_rows!r} must be a positive integer.")
    if neighbourhood == "add_remove" and max_rows is None:
        raise ValueError(
            "Under neighbourhood='add_remove' the number of rows is private (it is what a "
            "neighbour changes), so the noise cannot be sized for it: pass max_rows=, a "
            "public upper bound on the rows (of each holder), fixed without looking at the "
            "data, e.g. the size of the population they are drawn from."
        )
    if max_rows is not None and num_rows > max_rows:
        raise ValueError(
            f"The data have more rows than max_rows={max_rows}: raise max_rows to a public "
            "bound that holds (the release is sized for it)."
        )
    return int(max_rows) if neighbourhood == "add_remove" else int(num_rows)


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
    z = calibrate_gaussian(epsilon, delta)
    return z * sensitivity


def _budget_or_noise(epsilon, noise, noise_name):
    if (noise is None) == (epsilon is None):
        raise ValueError(f"Pass either epsilon (to calibrate) or {noise_name}, not both.")


def gaussian_noise_multiplier(
    epsilon: float | None,
    delta: float | None,
    noise_multiplier: float | None,
    method: str = "analytic",
) -> float:
    """``z = sigma / Delta``: calibrated to (epsilon, delta) by ``method``, or the one given."""
    _budget_or_noise(epsilon, noise_multiplier, "noise_multiplier")
    if epsilon is not None:
        return gaussian_sigma(epsilon, delta, 1.0, method)
    return check_bound("noise_multiplier", noise_multiplier)


def gram_plan(
    noise_multiplier: float, num_rows: int, d: int, x_bound: float, neighbourhood: str,
    max_rows_per_unit: int = 1,
) -> GridPlan:
    """:class:`GridPlan` of the upper triangle of ``X^T X``
    (:func:`~numpyro_dp.releases.row_products.row_product_sum`) for n rows.

    With privacy units of at most ``max_rows_per_unit = m`` rows the sensitivity is
    ``m`` times a row's (:func:`~numpyro_dp.releases.linreg_release.linreg_sensitivity`
    derives it); the error bound stays the one of n rows.
    """
    bx = computed_bound(x_bound, d)
    return grid_plan(
        noise_multiplier, max_rows_per_unit * gram_sensitivity(bx, neighbourhood),
        d * (d + 1) // 2,
        magnitude=num_rows * bx**2, error=row_product_error(num_rows, bx, bx, d * d),
    )


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
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> Release:
    """Release ``value + N(0, sigma^2 I)``, on a grid of about ``sigma / 2^8``.

    Parameters
    ----------
    rng_key : jax.random key
        Public; the noise comes from a fresh OS secret (:func:`secret_release`).
    value : array_like
        The statistic, finite, computed by the caller.
    sensitivity : float
        l2-sensitivity of ``value`` *as the caller computes it* under
        ``neighbourhood`` (see :func:`sum_sensitivity`); the rounding to the
        release grid is added to it.
    epsilon, delta : float, optional
        Budget; sigma is calibrated by ``method`` (``"analytic"`` or ``"classic"``).
    noise_multiplier : float, optional
        ``sigma / sensitivity``, instead of a budget.
    neighbourhood : {"substitute", "add_remove"}
    name : str
        The ledger entry's name.
    ledger : PrivacyLedger, optional
        Charged before any noise is drawn (see :func:`secret_release`).
    reproducible_noise : bool
        Tests only: the noise is a function of ``rng_key``; warns and is
        recorded in the entry.
    """
    check_neighbourhood(neighbourhood)
    sensitivity = check_bound("sensitivity", sensitivity)
    z = gaussian_noise_multiplier(epsilon, delta, noise_multiplier, method)
    value = check_finite(np.asarray(value, np.float64), "value")
    plan = grid_plan(z, sensitivity, value.size)
    entry = release_entry(name, dpa.GaussianDpEvent(z), reproducible_noise)
    released = secret_release(
        rng_key, entry, neighbourhood, lambda key: plan.release(key, value),
        ledger=ledger, what="gaussian_mechanism",
    )
    return Release(released, plan.scale, entry, neighbourhood)


def gram_mechanism(
    rng_key,
    x,
    x_bound: float,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    neighbourhood: str = "substitute",
    max_rows: int | None = None,
    privacy_unit=None,
    max_rows_per_unit: int | None = None,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> Release:
    """Release ``X^T X + sigma M`` with ``M`` symmetric, upper triangle iid N(0, 1).

    Rows are projected onto the ball of radius ``x_bound`` (:func:`clip_rows`).
    The released quantity is the upper triangle (the rest is its mirror),
    computed by :func:`~numpyro_dp.releases.row_products.row_product_sum`, with sensitivity
    :func:`gram_sensitivity` plus its computation and grid rounding
    (:func:`gram_plan`); sigma is calibrated analytically.  The release need
    not be positive semi-definite.  ``max_rows`` (required under
    ``"add_remove"``, where n is private) and the ``delta`` check: see
    :func:`planned_rows`.  ``ledger`` and ``reproducible_noise`` as in
    :func:`gaussian_mechanism`.  ``privacy_unit`` (one id per row) and
    ``max_rows_per_unit``: the guarantee is for one unit with all its rows, the
    sensitivity ``max_rows_per_unit`` times a row's (default: the largest unit,
    public with the ids), ``delta`` below one over the number of units;
    substitute neighbourhood only (:func:`release_units`).
    """
    if np.ndim(x) != 2:
        raise ValueError(f"x must be an (n, d) array of rows; got shape {np.shape(x)}.")
    n, d = np.shape(x)
    units = release_units(privacy_unit, [n], False, max_rows_per_unit, neighbourhood)
    rows = planned_rows(n, neighbourhood, max_rows)
    check_delta_for_rows(delta, rows if units is None else units.num_units)
    x = clip_rows(x, x_bound)
    z = gaussian_noise_multiplier(epsilon, delta, noise_multiplier)
    m, label = bound_and_label(units)
    plan = gram_plan(z, rows, d, x_bound, neighbourhood, m)
    entry = release_entry("GramMechanism", dpa.GaussianDpEvent(z), reproducible_noise, label)

    def draw(key):
        upper = plan.release(key, *upper_triangle(row_product_sum(x, x)))
        return symmetric_from_upper(upper, d)

    gram = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger,
                          what="gram_mechanism")
    return Release(gram, plan.scale, entry, neighbourhood)


def laplace_mechanism(
    rng_key,
    value,
    l1_sensitivity: float,
    *,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    neighbourhood: str = "substitute",
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> Release:
    """Release ``value + Laplace(0, b)`` coordinatewise: epsilon-DP with ``b = Delta_1 / epsilon``.

    ``l1_sensitivity`` is taken under ``neighbourhood`` for ``value`` as the
    caller computes it; the rounding to the release grid is added to it.
    ``noise_multiplier = b / Delta_1``.  ``ledger`` and ``reproducible_noise``
    as in :func:`gaussian_mechanism`.
    """
    check_neighbourhood(neighbourhood)
    _budget_or_noise(epsilon, noise_multiplier, "noise_multiplier")
    l1_sensitivity = check_bound("l1_sensitivity", l1_sensitivity)
    if epsilon is not None:
        check_budget(epsilon, None)
        noise_multiplier = 1.0 / epsilon
    z = check_bound("noise_multiplier", noise_multiplier)
    value = check_finite(np.asarray(value, np.float64), "value")
    plan = grid_plan(z, l1_sensitivity, value.size, noise="laplace")
    entry = release_entry("LaplaceMechanism", dpa.LaplaceDpEvent(z), reproducible_noise)
    released = secret_release(
        rng_key, entry, neighbourhood, lambda key: plan.release(key, value),
        ledger=ledger, what="laplace_mechanism",
    )
    return Release(released, plan.scale, entry, neighbourhood)


def randomized_response(
    rng_key,
    values,
    num_buckets: int,
    *,
    epsilon: float | None = None,
    noise_parameter: float | None = None,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> Release:
    """Randomized response on each row's category in ``{0, ..., num_buckets - 1}``.

    A code below 0 or above ``num_buckets - 1`` is reported as 0 or
    ``num_buckets - 1`` (never refused: a refusal would reveal the largest
    code).  Each row keeps its value with probability ``1 - p`` and is otherwise
    replaced by a uniform draw, so ``epsilon = ln(1 + k (1 - p) / p)`` and
    ``p = k / (e^epsilon + k - 1)``.  A row only moves its own output, so the
    whole vector costs one release.  Substitute neighbourhood only: under
    add/remove the number of outputs would itself reveal the change.

    The coins come from the secret noise key; a row is replaced when a 32-bit
    uniform integer is below ``ceil(p 2^32)``, so the replacement probability
    is at least ``p`` (the private side).  The uniform category is a 64-bit
    uniform reduced modulo ``k`` (JAX's ``randint``): its probabilities are
    off by at most ``k 2^-64`` relative, which is not charged.  ``ledger`` and
    ``reproducible_noise`` as in :func:`gaussian_mechanism`.
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
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"values must be integer category codes in 0..{num_buckets - 1}; got dtype "
            f"{values.dtype}. Encode the categories as integers first."
        )
    # A code outside the codebook is reported as the nearest code (a public rule, the
    # projection of the other mechanisms): refusing it would reveal the largest code.
    values = np.clip(values, 0, num_buckets - 1)
    threshold = math.ceil(noise_parameter * 2.0**32)  # exact: p 2^32 is a scaling
    entry = release_entry(
        "RandomizedResponse", dpa.RandomizedResponseDpEvent(noise_parameter, num_buckets),
        reproducible_noise,
    )

    def draw(key):
        k_flip, k_draw = random.split(key)
        coins = random.bits(k_flip, values.shape, jnp.uint32).astype(jnp.uint64)
        flip = np.asarray(coins < jnp.uint64(threshold))
        other = np.asarray(random.randint(k_draw, values.shape, 0, num_buckets))
        return np.where(flip, other, values)

    released = secret_release(rng_key, entry, "substitute", draw, ledger=ledger,
                              what="randomized_response")
    return Release(released, noise_parameter, entry, "substitute")
