"""DP Bayesian linear regression from released sufficient statistics.

Alparslan, Yildirim & Birbil (2023); Alparslan (2023), s5.2.  Each of J data holders
releases, once, ``S_hat_j = X_j^T X_j + sigma M_j`` (``M_j`` symmetric, upper
triangle iid N(0, 1)) and ``z_hat_j = X_j^T y_j + sigma v_j`` by one Gaussian
mechanism on the joint vector.  Everything after the release is
post-processing and costs no budget:

* :func:`fit` runs NumPyro's NUTS on a noise-aware model, ``"fixedS"``
  (:func:`fixed_s_model`, ``S_j`` fixed at the nearest PSD matrix to
  ``S_hat_j``) or ``"normalX"`` (:func:`normal_x_model`, ``x ~ N(0, Sigma_x)``
  and ``S_j`` latent);
* :func:`fast_posterior`: the closed-form "Bayes-fixedS-fast" posterior;
* :func:`adassp`: the adaSSP baseline (Wang 2018), a release of its own.

The model is ``y_i = x_i^T theta + e_i``, ``e_i ~ N(0, sigma_y^2)``, without
intercept (append a constant column inside the bound if one is wanted),
``theta ~ N(m, C)``, ``sigma_y^2 ~ IG(a, b)``, and, given the holder's true
``S_j``, ``z_hat_j ~ N(S_j theta, sigma_y^2 S_j + sigma^2 I)``.

Precision: the releases follow :mod:`numpyro_dp.releases.mechanisms` :
secret noise, statistics computed in float64 (blockwise products summed in
double-word arithmetic) with their error bounds and the grid rounding charged,
noise added on a grid.  The NUTS models run in JAX's default dtype.  ``S_j``
grows like ``n_j``, so for n around 1e5 and more float32 loses about 7 of ~12
significant digits in ``z_hat - S theta``; enable float64
(``jax.config.update("jax_enable_x64", True)``) when the noise is small
relative to ``S``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import dp_accounting as dpa
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints
from numpyro.infer import MCMC, NUTS, init_to_value
from scipy.stats import norm

from numpyro_dp.accounting import (
    calibrate_noise_multiplier,
    check_delta_for_rows,
    check_neighbourhood,
)
from numpyro_dp.accounting.ledger import LedgerEntry, PrivacyLedger
from numpyro_dp.releases.mechanisms import (
    U64,
    GridPlan,
    Release,
    charge,
    check_bound,
    clip_rows,
    computed_bound,
    gaussian_noise_multiplier,
    gram_plan,
    gram_sensitivity,
    grid_plan,
    planned_rows,
    release_entry,
    row_product_error,
    row_product_sum,
    secret_release,
    sum_sensitivity,
    symmetric_from_upper,
    upper_triangle,
)

# ------------------------------------------------------------------ release
#: Under ``"add_remove"`` each holder's row count is private and is released
#: with its statistics: every row adds ``COUNT_WEIGHT`` times the statistics'
#: sensitivity to one more coordinate, so the noise grows by a factor
#: ``sqrt(1 + COUNT_WEIGHT^2)`` (3% at 1/4) and the count's noise is about
#: ``noise_multiplier / COUNT_WEIGHT`` rows.
COUNT_WEIGHT = 0.25


def linreg_sensitivity(x_bound: float, y_bound: float, neighbourhood: str = "substitute") -> float:
    """l2-sensitivity of ``(upper triangle of X^T X, X^T y)``.

    Rows with ``||x|| <= x_bound`` and ``|y| <= y_bound``.  Add/remove:
    ``sqrt(x_bound^4 + x_bound^2 y_bound^2)`` (Alparslan 2023, eq. 5.12).
    Substitute: ``sqrt(2 x_bound^4 + 4 x_bound^2 y_bound^2)`` (see
    :func:`~numpyro_dp.releases.mechanisms.gram_sensitivity`; the ``X^T y`` part
    doubles), below the factor 2 of the triangle inequality.  Holders hold
    disjoint rows, so a row moves one holder's statistics only.
    """
    bx, by = check_bound("x_bound", x_bound), check_bound("y_bound", y_bound)
    z_part = sum_sensitivity(bx * by, neighbourhood)
    return math.sqrt(gram_sensitivity(bx, neighbourhood) ** 2 + z_part**2)


def count_weight(x_bound: float, y_bound: float, neighbourhood: str) -> float:
    """What one row adds to the released count coordinate: 0 (none) under ``"substitute"``,
    where the counts are public, else :data:`COUNT_WEIGHT` times the statistics' sensitivity."""
    if check_neighbourhood(neighbourhood) == "substitute":
        return 0.0
    return COUNT_WEIGHT * linreg_sensitivity(x_bound, y_bound, neighbourhood)


def linreg_plan(
    noise_multiplier: float,
    num_rows: int,
    d: int,
    x_bound: float,
    y_bound: float,
    neighbourhood: str,
) -> GridPlan:
    """:class:`~numpyro_dp.releases.mechanisms.GridPlan` of one holder's :func:`linreg_statistic`.

    ``num_rows`` is what the release is sized for
    (:func:`~numpyro_dp.releases.mechanisms.planned_rows`: n, or the public
    ``max_rows`` under add/remove).  Sensitivity :func:`linreg_sensitivity` at
    the bounds as computed, joined under add/remove by the count coordinate
    (:func:`count_weight`), plus the error bounds of both sums
    (:func:`~numpyro_dp.releases.mechanisms.row_product_error`), the count's
    rounding and the grid rounding.
    """
    bx, by = computed_bound(x_bound, d), computed_bound(y_bound, 1)
    w = count_weight(bx, by, neighbourhood)
    error = (row_product_error(num_rows, bx, bx, d * d) + row_product_error(num_rows, bx, by, d)
             + U64 * w * num_rows)
    sensitivity = math.hypot(linreg_sensitivity(bx, by, neighbourhood), w)
    return grid_plan(
        noise_multiplier, sensitivity, d * (d + 3) // 2 + (w > 0),
        magnitude=num_rows * max(bx * max(bx, by), w), error=error,
    )


def xty_statistic(X, y) -> tuple:
    """``X^T y`` as computed for a release: a double-word pair of shape (d,)."""
    hi, lo = row_product_sum(X, y[:, None])
    return hi[:, 0], lo[:, 0]


def linreg_statistic(X, y, weight: float = 0.0) -> tuple:
    """``(upper triangle of X^T X, X^T y)`` as computed for a release: a double-word pair.

    With ``weight > 0`` the row count times ``weight`` is appended (add/remove,
    :func:`count_weight`).  Call under ``jax.enable_x64(True)``.
    """
    (s_hi, s_lo), (z_hi, z_lo) = upper_triangle(row_product_sum(X, X)), xty_statistic(X, y)
    parts_hi, parts_lo = [s_hi, z_hi], [s_lo, z_lo]
    if weight > 0:
        parts_hi.append(jnp.array([weight * len(X)], jnp.float64))
        parts_lo.append(jnp.zeros(1, jnp.float64))
    return jnp.concatenate(parts_hi), jnp.concatenate(parts_lo)


def holder_rows(X, y) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each data holder's rows ``(X_j, y_j)``: one pair of arrays, or one sequence of each.

    Holders are the user's own split of the rows (each holds its rows; no row
    moves between holders when another is added or removed).  Shapes are
    checked (public); a holder may hold no rows.
    """
    several = isinstance(X, (list, tuple))
    if several != isinstance(y, (list, tuple)) or (several and len(X) != len(y)):
        raise ValueError(
            "Pass X and y both as arrays (one data holder) or both as lists with one array "
            "per holder, e.g. X=[X1, X2], y=[y1, y2]."
        )
    pairs = list(zip(X, y, strict=True)) if several else [(X, y)]
    if not pairs:
        raise ValueError("No data holder given: pass at least one (X_j, y_j).")
    out = []
    d = np.shape(pairs[0][0])[-1] if np.ndim(pairs[0][0]) == 2 else None
    for j, (Xj, yj) in enumerate(pairs):
        Xj, yj = np.asarray(Xj, np.float64), np.asarray(yj, np.float64)
        if Xj.ndim != 2 or Xj.shape[1] != d or yj.shape != (len(Xj),):
            # Under add/remove a holder's row count is private: the message names the
            # other dimensions only.
            raise ValueError(
                f"Holder {j}: X must be (n_j, d) with the same d for every holder and y "
                f"(n_j,) with as many rows; got X with {Xj.ndim} axes and columns "
                f"{Xj.shape[1:]}, y with {yj.ndim} axes."
            )
        out.append((Xj, yj))
    return out


class LinRegRelease(NamedTuple):
    """Released statistics of J data holders (all fields public).

    Attributes
    ----------
    S_hat : ndarray (J, d, d)
        Noisy ``X_j^T X_j`` (symmetric, not necessarily PSD).
    z_hat : ndarray (J, d)
        Noisy ``X_j^T y_j``.
    n_rows : ndarray (J,)
        Rows per holder: exact under ``"substitute"`` (public), released with
        noise (about ``noise_multiplier / COUNT_WEIGHT`` rows, floored at 0)
        under ``"add_remove"``, where they are private.
    sigma : float
        Noise standard deviation of every released coordinate.
    x_bound, y_bound : float
        The a-priori bounds used.
    entry : LedgerEntry
        The cost: one Gaussian release (holders hold disjoint rows, so their
        releases compose in parallel).
    neighbourhood : str
    """

    S_hat: np.ndarray
    z_hat: np.ndarray
    n_rows: np.ndarray
    sigma: float
    x_bound: float
    y_bound: float
    entry: LedgerEntry
    neighbourhood: str

    def charge_to(self, ledger: PrivacyLedger) -> None:
        """Charge this release to ``ledger`` after the fact (kept for compatibility).

        As :meth:`numpyro_dp.releases.mechanisms.Release.charge_to`: a refused charge
        raises :class:`~numpyro_dp.PrivacyBudgetError` and the statistics must
        be discarded unpublished; ``release_linreg_stats(..., ledger=)`` charges
        before any noise is drawn instead.
        """
        charge(ledger, self.entry, self.neighbourhood)


def _holders_plan_rows(holders, neighbourhood, max_rows, delta) -> int:
    """The per-holder row count the releases are sized for, after the ``delta`` check
    against every row of every holder (n, or ``J max_rows`` under add/remove)."""
    rows = planned_rows(max(len(Xj) for Xj, _ in holders), neighbourhood, max_rows)
    total = (sum(len(Xj) for Xj, _ in holders) if neighbourhood == "substitute"
             else len(holders) * rows)
    check_delta_for_rows(delta, total)
    return rows


def release_linreg_stats(
    rng_key,
    X,
    y,
    *,
    x_bound: float,
    y_bound: float,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    neighbourhood: str = "substitute",
    max_rows: int | None = None,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> LinRegRelease:
    """Release ``(S_hat_j, z_hat_j)`` for each data holder's rows.

    Parameters
    ----------
    rng_key : jax.random key
        Public; the noise comes from a fresh OS secret.
    X, y : array (n, d) and (n,), or lists of them
        One data holder's rows, or one array per holder (``X=[X1, X2, X3]``,
        ``y=[y1, y2, y3]``; :func:`holder_rows`).  Each holder would run this on
        its own rows; the lists simulate J holders with the same noise scale.
    x_bound, y_bound : float
        A-priori bounds on ``||x||`` and ``|y|``, fixed without looking at the
        data.  Rows beyond them are projected onto them
        (:func:`~numpyro_dp.releases.mechanisms.clip_rows`).
    epsilon, delta, noise_multiplier : float, optional
        The budget (noise calibrated analytically, Balle & Wang 2018), or the
        noise multiplier.  ``delta`` must be below ``1 / n`` (all holders' rows;
        under add/remove ``1 / (J max_rows)``).
    neighbourhood : {"substitute", "add_remove"}
        Under add/remove the row counts are private: the release is sized for
        ``max_rows`` (required) and each holder's count is released with noise
        in the same Gaussian release (:data:`COUNT_WEIGHT`), so nothing
        published depends on n except through the noise.
    max_rows : int, optional
        A public upper bound on each holder's rows
        (:func:`~numpyro_dp.releases.mechanisms.planned_rows`).
    ledger, reproducible_noise :
        As in :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism`.

    The noise covers :func:`linreg_sensitivity` plus the computation's error
    bounds and the grid rounding (:func:`linreg_plan`); one Gaussian event,
    since a row moves one holder's statistics only.
    """
    holders = holder_rows(X, y)
    rows = _holders_plan_rows(holders, neighbourhood, max_rows, delta)
    holders = [(clip_rows(Xj, x_bound, "x"), clip_rows(yj, y_bound, "y")) for Xj, yj in holders]
    z = gaussian_noise_multiplier(epsilon, delta, noise_multiplier)
    d = holders[0][0].shape[1]
    plan = linreg_plan(z, rows, d, x_bound, y_bound, neighbourhood)
    weight = count_weight(computed_bound(x_bound, d), computed_bound(y_bound, 1), neighbourhood)
    entry = release_entry("LinRegStats", dpa.GaussianDpEvent(z), reproducible_noise)
    k = d * (d + 1) // 2

    def draw(key):
        stats = np.stack([plan.release(random.fold_in(key, j), *linreg_statistic(Xj, yj, weight))
                          for j, (Xj, yj) in enumerate(holders)])
        return np.stack([symmetric_from_upper(s[:k], d) for s in stats]), stats[:, k:]

    S_hat, rest = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger,
                                 what="release_linreg_stats")
    if weight > 0:
        n_rows = np.maximum(rest[:, d] / weight, 0.0)
    else:
        n_rows = np.array([len(Xj) for Xj, _ in holders])
    return LinRegRelease(S_hat, rest[:, :d], n_rows, float(plan.scale), float(x_bound),
                         float(y_bound), entry, neighbourhood)


# -------------------------------------------------------------------- prior
class LinRegPrior(NamedTuple):
    """Hyperparameters: ``theta ~ N(mean, cov)``, ``sigma_y^2 ~ IG(a, b)``,
    ``Sigma_x ~ IW(iw_scale, iw_df)`` (normalX only)."""

    mean: np.ndarray
    cov: np.ndarray
    a: float
    b: float
    iw_scale: np.ndarray
    iw_df: float

    @classmethod
    def default(cls, d: int) -> LinRegPrior:
        """Alparslan (2023), s7.2: a = 20, b = 0.5, m = 0, C = (a - 1) / b I, IW(I, d + 1)."""
        a, b = 20.0, 0.5
        return cls(np.zeros(d), (a - 1) / b * np.eye(d), a, b, np.eye(d), d + 1.0)


def nearest_psd(S_hat) -> np.ndarray:
    """Nearest PSD matrix in Frobenius norm (Higham 1988): negative eigenvalues set to 0."""
    S_hat = np.asarray(S_hat, np.float64)
    sym = (S_hat + np.swapaxes(S_hat, -1, -2)) / 2
    w, V = np.linalg.eigh(sym)
    return (V * np.maximum(w, 0.0)[..., None, :]) @ np.swapaxes(V, -1, -2)


def _check_stats(S, z_hat, psd: bool):
    S, z_hat = np.asarray(S, np.float64), np.asarray(z_hat, np.float64)
    if S.ndim != 3 or S.shape[1] != S.shape[2] or z_hat.shape != S.shape[:2]:
        raise ValueError(
            f"Expected S of shape (J, d, d) and z_hat (J, d); got {S.shape} and {z_hat.shape}."
        )
    if not np.allclose(S, np.swapaxes(S, 1, 2), rtol=1e-10, atol=0):
        raise ValueError("S_hat must be symmetric (a released X^T X is mirrored).")
    if psd and np.linalg.eigvalsh(S).min() < -1e-9 * np.abs(S).max():
        raise ValueError(
            "fixedS needs positive semi-definite S_j, and this S is not (a noisy "
            "release S_hat rarely is): pass nearest_psd(S_hat), or use method='normalX', "
            "which treats the true S_j as latent."
        )


# ------------------------------------------------------------------- models
def _observe_z(S, z_hat, sigma_z, theta, sigma_y2):
    d = S.shape[-1]
    cov = sigma_y2 * S + sigma_z**2 * jnp.eye(d)
    with numpyro.plate("holders", S.shape[0]):
        numpyro.sample("z_hat", dist.MultivariateNormal(S @ theta, covariance_matrix=cov),
                       obs=z_hat)


def _theta_sigma(prior: LinRegPrior, sigma_y2):
    theta = numpyro.sample("theta", dist.MultivariateNormal(prior.mean, prior.cov))
    if sigma_y2 is None:
        sigma_y2 = numpyro.sample("sigma_y2", dist.InverseGamma(prior.a, prior.b))
    return theta, sigma_y2


def fixed_s_model(S, z_hat, sigma_z, prior: LinRegPrior, sigma_y2=None):
    """MCMC-fixedS (Alparslan 2023, Alg. 17) as a NumPyro model.

    ``S`` (J, d, d) is PSD, e.g. :func:`nearest_psd` of the release;
    ``z_hat_j ~ N(S_j theta, sigma_y2 S_j + sigma_z^2 I)`` with ``z_j``
    integrated out.  A fixed ``sigma_y2`` replaces its IG prior.
    """
    if isinstance(S, np.ndarray):
        _check_stats(S, z_hat, psd=True)
    theta, sigma_y2 = _theta_sigma(prior, sigma_y2)
    _observe_z(S, z_hat, sigma_z, theta, sigma_y2)


def normal_x_model(S_hat, z_hat, n_rows, sigma, prior: LinRegPrior, sigma_y2=None):
    """MCMC-normalX (Alparslan 2023, Alg. 16) as a NumPyro model.

    ``x ~ N(0, Sigma_x)``, ``Sigma_x ~ IW(iw_scale, iw_df)``, so
    ``S_j | Sigma_x ~ Wishart(n_j, Sigma_x)``; the upper triangle of ``S_hat_j``
    is ``N(S_j, sigma^2)``.  ``Sigma_x`` is integrated out in closed form
    (Wishart-inverse-Wishart conjugacy), which leaves the joint posterior of
    ``(theta, sigma_y2, S)`` unchanged and removes its correlation with S:
    ``log p(S_1:J) = sum_j (n_j - d - 1)/2 log|S_j| - (df + n)/2 log|Lambda + sum_j S_j|``
    up to a constant.
    """
    J, d = S_hat.shape[0], S_hat.shape[-1]
    n = float(np.sum(n_rows))
    S = numpyro.sample("S", dist.ImproperUniform(constraints.positive_definite, (J,), (d, d)))
    logdet = jnp.linalg.slogdet(S)[1]
    numpyro.factor("S_marginal", jnp.sum((jnp.asarray(n_rows) - d - 1) / 2 * logdet)
                   - (prior.iw_df + n) / 2 * jnp.linalg.slogdet(prior.iw_scale + S.sum(0))[1])
    iu = np.triu_indices(d)
    with numpyro.plate("holders_S", J):
        numpyro.sample("S_hat", dist.Normal(S[:, iu[0], iu[1]], sigma).to_event(1),
                       obs=S_hat[:, iu[0], iu[1]])
    theta, sigma_y2 = _theta_sigma(prior, sigma_y2)
    _observe_z(S, z_hat, sigma, theta, sigma_y2)


def fit(
    rng_key,
    release: LinRegRelease,
    method: str = "fixedS",
    prior: LinRegPrior | None = None,
    *,
    num_warmup: int = 1000,
    num_samples: int = 1000,
    num_chains: int = 1,
    sigma_y2: float | None = None,
    progress_bar: bool = False,
) -> MCMC:
    """Run NumPyro's NUTS on the noise-aware model; post-processing, no budget spent.

    Returns the run :class:`numpyro.infer.MCMC` (``get_samples()``: ``theta``,
    ``sigma_y2`` and, for normalX, ``S``; ``arviz.from_numpyro`` works).
    Chains start from the fast estimate and ``nearest_psd(S_hat)``, both
    functions of the release only.
    """
    d = release.S_hat.shape[-1]
    prior = LinRegPrior.default(d) if prior is None else prior
    _check_stats(release.S_hat, release.z_hat, psd=False)
    S_psd = nearest_psd(release.S_hat)
    init = {"theta": fast_posterior(release, prior, sigma_y2).mean}
    if method == "fixedS":
        model, args = fixed_s_model, (S_psd, release.z_hat, release.sigma, prior, sigma_y2)
    elif method == "normalX":
        # start S strictly inside the cone: eigenvalues at least the noise scale
        w, V = np.linalg.eigh(S_psd)
        init["S"] = (V * np.maximum(w, release.sigma)[..., None, :]) @ np.swapaxes(V, 1, 2)
        model = normal_x_model
        args = (release.S_hat, release.z_hat, release.n_rows, release.sigma, prior, sigma_y2)
    else:
        raise ValueError(f"method={method!r}; use 'fixedS' or 'normalX'.")
    kernel = NUTS(model, dense_mass=True,
                  init_strategy=init_to_value(values=init))
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                progress_bar=progress_bar, chain_method="sequential")
    mcmc.run(rng_key, *args)
    return mcmc


# ------------------------------------------------------------- closed forms
class GaussianPosterior(NamedTuple):
    """``theta ~ N(mean, cov)`` with the noise variance ``sigma_y2`` fixed."""

    mean: np.ndarray
    cov: np.ndarray
    sigma_y2: float

    def sample(self, rng_key, num_samples: int) -> np.ndarray:
        """Exact draws of theta, shape (num_samples, d)."""
        z = np.asarray(random.normal(rng_key, (num_samples, len(self.mean))), np.float64)
        return self.mean + z @ np.linalg.cholesky(self.cov).T


def theta_conditional(S, z_hat, sigma_z, sigma_y2, prior: LinRegPrior) -> GaussianPosterior:
    """``theta | S, sigma_y2, z_hat`` (Alparslan 2023, Prop. 3), in float64.

    Precision ``sum_j S_j (sigma_y2 S_j + sigma_z^2 I)^-1 S_j + C^-1``; mean
    its inverse times ``sum_j S_j (sigma_y2 S_j + sigma_z^2 I)^-1 z_hat_j + C^-1 m``.
    """
    S, z_hat = np.asarray(S, np.float64), np.asarray(z_hat, np.float64)
    d = S.shape[-1]
    C_inv = np.linalg.inv(prior.cov)
    A = sigma_y2 * S + sigma_z**2 * np.eye(d)
    A_inv_S = np.linalg.solve(A, S)  # S_j symmetric: S_j A_j^-1 = (A_j^-1 S_j)^T
    prec = np.einsum("jki,jkl->il", A_inv_S, S) + C_inv
    lin = np.einsum("jki,jk->i", A_inv_S, z_hat) + C_inv @ prior.mean
    cov = np.linalg.inv(prec)
    return GaussianPosterior(cov @ lin, (cov + cov.T) / 2, float(sigma_y2))


def fast_posterior(
    release: LinRegRelease, prior: LinRegPrior | None = None, sigma_y2: float | None = None
) -> GaussianPosterior:
    """Bayes-fixedS-fast (Alparslan 2023, Alg. 18; its m_post corrected to the posterior mean).

    ``S_j`` fixed at :func:`nearest_psd` of the release and ``sigma_y2`` at a
    crude value, by default ``(y_bound / 3)^2`` (the paper writes
    ``||Y|| / 3``; we read it as the standard deviation, a three-sigma rule).
    """
    prior = LinRegPrior.default(release.S_hat.shape[-1]) if prior is None else prior
    _check_stats(release.S_hat, release.z_hat, psd=False)
    s2 = (release.y_bound / 3) ** 2 if sigma_y2 is None else sigma_y2
    return theta_conditional(nearest_psd(release.S_hat), release.z_hat, release.sigma, s2, prior)


# ------------------------------------------------------------------ adaSSP
def adassp(
    rng_key,
    X,
    y,
    *,
    x_bound: float,
    y_bound: float,
    epsilon: float,
    delta: float,
    neighbourhood: str = "substitute",
    max_rows: int | None = None,
    rho: float = 0.05,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> Release:
    """adaSSP (Wang 2018), distributed as in Alparslan (2023, eq. 7.2).

    ``X``, ``y``: one holder's rows or one array per holder, as in
    :func:`release_linreg_stats` (rows projected onto the bounds; ``max_rows``
    and the ``delta`` check likewise).  Each holder releases
    ``lambda_min(S_j)`` (sensitivity ``x_bound^2``),
    ``S_j`` (:func:`~numpyro_dp.releases.mechanisms.gram_sensitivity`) and ``z_j``
    (``X_j^T y_j``), three Gaussian releases with one noise multiplier whose
    tight composition spends (epsilon, delta); each sensitivity also covers
    its computation and grid rounding, the eigenvalue's with the bound
    ``(4 d + 2) u n x_bound^2`` on the float64 eigensolver and the rounding of
    ``S_j`` (backward stability with the modest constant ``4 d``, assumed of
    LAPACK's ``syevd``).  The regulariser is Wang's
    ``lambda_j = max(0, sigma_S sqrt(d log(2 d^2 / rho)) - lambda_min_tilde)``
    with ``lambda_min_tilde`` the released eigenvalue lowered by its
    ``1 - rho / 3`` noise quantile.  Wang splits the budget as (eps/3, delta/3)
    with the classic calibration; the tight split gives less noise for the
    same guarantee.  Returns ``theta_hat = (sum S_hat_j + sum lambda_j I)^-1
    sum z_hat_j`` as the release's value.  ``ledger`` and
    ``reproducible_noise`` as in
    :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism`.
    """
    holders = holder_rows(X, y)
    n = _holders_plan_rows(holders, neighbourhood, max_rows, delta)  # every bound grows with n
    holders = [(clip_rows(Xj, x_bound, "x"), clip_rows(yj, y_bound, "y")) for Xj, yj in holders]
    if not 0 < rho < 1:
        raise ValueError(f"rho={rho} (failure probability) must lie in (0, 1).")
    d = holders[0][0].shape[1]

    def event3(z):
        return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 3)

    z = calibrate_noise_multiplier(event3, epsilon, delta)
    bx, by = computed_bound(x_bound, d), computed_bound(y_bound, 1)
    S_plan = gram_plan(z, n, d, x_bound, neighbourhood)
    z_plan = grid_plan(z, sum_sensitivity(bx * by, neighbourhood), d,
                       magnitude=n * bx * by, error=row_product_error(n, bx, by, d))
    # lambda_min moves by at most x_bound^2 (Weyl); its error: S as computed,
    # S rounded to float64, and the eigensolver.
    lam_error = row_product_error(n, bx, bx, d * d) + (4 * d + 2) * U64 * n * bx**2
    lam_plan = grid_plan(z, bx**2, 1, magnitude=n * bx**2, error=lam_error)
    shift = lam_plan.scale * norm.ppf(1 - rho / 3)
    entry = release_entry("adaSSP", event3(z), reproducible_noise)

    def draw(key):
        S_sum, z_sum, lam_sum = np.zeros((d, d)), np.zeros(d), 0.0
        for j, (Xj, yj) in enumerate(holders):
            k_lam, k_S, k_z = random.split(random.fold_in(key, j), 3)
            S = row_product_sum(Xj, Xj)
            lam = np.linalg.eigvalsh(np.asarray(S[0] + S[1]))[0]
            lam_min = float(lam_plan.release(k_lam, lam)) - shift
            lam_sum += max(0.0, S_plan.scale * math.sqrt(d * math.log(2 * d**2 / rho))
                           - max(lam_min, 0.0))
            S_sum += symmetric_from_upper(S_plan.release(k_S, *upper_triangle(S)), d)
            z_sum += z_plan.release(k_z, *xty_statistic(Xj, yj))
        return np.linalg.solve(S_sum + lam_sum * np.eye(d), z_sum)

    theta = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger, what="adassp")
    return Release(theta, S_plan.scale, entry, neighbourhood)


# --------------------------------------------------------------- prediction
def posterior_predictive(rng_key, theta, sigma_y2, X_test) -> np.ndarray:
    """Draws of ``y* = x*^T theta + N(0, sigma_y2)``, shape (num_draws, m).

    ``theta`` (num_draws, d); ``sigma_y2`` scalar or (num_draws,).  The test
    MSE of the posterior predictive mean is that of ``X_test @ theta.mean(0)``.
    """
    theta = np.asarray(theta, np.float64)
    mean = theta @ np.asarray(X_test, np.float64).T
    s = np.sqrt(np.broadcast_to(np.asarray(sigma_y2, np.float64), (len(theta),)))[:, None]
    return mean + s * np.asarray(random.normal(rng_key, mean.shape), np.float64)
