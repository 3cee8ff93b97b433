"""DP Bayesian linear regression from released sufficient statistics.

Alparslan, Yildirim & Birbil (2023); Alparslan (2023), s5.2.  Each of J data holders
releases, once, ``S_hat_j = X_j^T X_j + sigma M_j`` (``M_j`` symmetric, upper
triangle iid N(0, 1)), ``z_hat_j = X_j^T y_j + sigma v_j`` and, by default,
``u_hat_j = y_j^T y_j + sigma w_j`` (Bernstein & Sheldon 2019: without it the data
say nothing about ``sigma_y``, which stays the prior's) by one Gaussian mechanism on
the joint vector.  Everything after the release is post-processing and costs no
budget:

* :func:`fit` runs NumPyro's NUTS on a noise-aware model, ``"fixedS"``
  (:func:`fixed_s_model`, ``S_j`` fixed at the nearest PSD matrix to
  ``S_hat_j``) or ``"normalX"`` (:func:`normal_x_model`, ``x ~ N(0, Sigma_x)``
  and ``S_j`` latent);
* :func:`fast_posterior`: the closed-form "Bayes-fixedS-fast" posterior;
* :func:`adassp`: the adaSSP baseline (Wang 2018), a release of its own.

The model is ``y_i = x_i^T theta + e_i``, ``e_i ~ N(0, sigma_y^2)``, without
intercept (append a constant column inside the bound if one is wanted),
``theta ~ N(m, C)``, ``sigma_y^2`` from :attr:`LinRegPrior.noise_variance`, and, given
the holder's true ``S_j``, ``z_hat_j ~ N(S_j theta, sigma_y^2 S_j + sigma^2 I)``; with
``u_hat_j`` the pair ``(z_hat_j, u_hat_j)`` is normal with the exact first two
moments of ``(X_j^T y_j, y_j^T y_j)`` given ``S_j`` (:func:`observe_statistics`).

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
import warnings
from typing import NamedTuple

import dp_accounting as dpa
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints
from numpyro.distributions.transforms import PowerTransform
from numpyro.infer import MCMC, NUTS, init_to_value
from scipy.stats import norm

from numpyro_dp.accounting import (
    calibrate_noise_multiplier,
    check_delta_for_rows,
    check_neighbourhood,
)
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.accounting.ledger import PrivacyLedger
from numpyro_dp.primitives.release import GridPlan, grid_plan
from numpyro_dp.releases.mechanisms import (
    U64,
    Release,
    check_bound,
    clip_rows,
    computed_bound,
    gaussian_noise_multiplier,
    gram_plan,
    gram_sensitivity,
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


def linreg_sensitivity(x_bound: float, y_bound: float, neighbourhood: str = "substitute",
                       with_yty: bool = True) -> float:
    """l2-sensitivity of ``(upper triangle of X^T X, X^T y[, y^T y])``.

    Rows with ``||x|| <= x_bound`` and ``|y| <= y_bound``.  Without ``y^T y``,
    add/remove: ``sqrt(x_bound^4 + x_bound^2 y_bound^2)`` (Alparslan 2023, eq.
    5.12); substitute: ``sqrt(2 x_bound^4 + 4 x_bound^2 y_bound^2)`` (see
    :func:`~numpyro_dp.releases.mechanisms.gram_sensitivity`; the ``X^T y`` part
    doubles), below the factor 2 of the triangle inequality.  ``y^T y`` adds
    ``y_bound^4`` under the root in both neighbourhoods: a row's ``y^2`` lies in
    ``[0, y_bound^2]``, so a substitution moves it by ``y_bound^2`` at most.  Each
    part's bound holds whatever the others do, so the root of their squares bounds
    the joint vector.  Holders hold disjoint rows, so a row moves one holder's
    statistics only.
    """
    bx, by = check_bound("x_bound", x_bound), check_bound("y_bound", y_bound)
    z_part = sum_sensitivity(bx * by, neighbourhood)
    u_part = by**2 if with_yty else 0.0
    return math.sqrt(gram_sensitivity(bx, neighbourhood) ** 2 + z_part**2 + u_part**2)


def count_weight(x_bound: float, y_bound: float, neighbourhood: str,
                 with_yty: bool = True) -> float:
    """What one row adds to the released count coordinate: 0 (none) under ``"substitute"``,
    where the counts are public, else :data:`COUNT_WEIGHT` times the statistics' sensitivity."""
    if check_neighbourhood(neighbourhood) == "substitute":
        return 0.0
    return COUNT_WEIGHT * linreg_sensitivity(x_bound, y_bound, neighbourhood, with_yty)


def linreg_plan(
    noise_multiplier: float,
    num_rows: int,
    d: int,
    x_bound: float,
    y_bound: float,
    neighbourhood: str,
    with_yty: bool = True,
) -> GridPlan:
    """:class:`~numpyro_dp.primitives.release.GridPlan` of one holder's :func:`linreg_statistic`.

    ``num_rows`` is what the release is sized for
    (:func:`~numpyro_dp.releases.mechanisms.planned_rows`: n, or the public
    ``max_rows`` under add/remove).  Sensitivity :func:`linreg_sensitivity` at
    the bounds as computed, joined under add/remove by the count coordinate
    (:func:`count_weight`), plus the error bounds of the sums
    (:func:`~numpyro_dp.releases.mechanisms.row_product_error`), the count's
    rounding and the grid rounding.
    """
    bx, by = computed_bound(x_bound, d), computed_bound(y_bound, 1)
    w = count_weight(bx, by, neighbourhood, with_yty)
    error = (row_product_error(num_rows, bx, bx, d * d) + row_product_error(num_rows, bx, by, d)
             + (row_product_error(num_rows, by, by, 1) if with_yty else 0.0)
             + U64 * w * num_rows)
    sensitivity = math.hypot(linreg_sensitivity(bx, by, neighbourhood, with_yty), w)
    return grid_plan(
        noise_multiplier, sensitivity, d * (d + 3) // 2 + with_yty + (w > 0),
        magnitude=num_rows * max(bx * max(bx, by), by**2 if with_yty else 0.0, w),
        error=error,
    )


def xty_statistic(X, y) -> tuple:
    """``X^T y`` as computed for a release: a double-word pair of shape (d,)."""
    hi, lo = row_product_sum(X, y[:, None])
    return hi[:, 0], lo[:, 0]


def linreg_statistic(X, y, weight: float = 0.0, with_yty: bool = True) -> tuple:
    """``(upper triangle of X^T X, X^T y[, y^T y])`` as computed for a release: a
    double-word pair.

    With ``weight > 0`` the row count times ``weight`` is appended (add/remove,
    :func:`count_weight`).  Call under ``jax.enable_x64(True)``.
    """
    (s_hi, s_lo), (z_hi, z_lo) = upper_triangle(row_product_sum(X, X)), xty_statistic(X, y)
    parts_hi, parts_lo = [s_hi, z_hi], [s_lo, z_lo]
    if with_yty:
        u_hi, u_lo = row_product_sum(y[:, None], y[:, None])
        parts_hi.append(u_hi[0])
        parts_lo.append(u_lo[0])
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
    yty : ndarray (J,) or None
        Noisy ``y_j^T y_j``; None where it was not released (``with_yty=False``,
        paper 002's release).
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
    yty: np.ndarray | None
    n_rows: np.ndarray
    sigma: float
    x_bound: float
    y_bound: float
    entry: LedgerEntry
    neighbourhood: str


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
    with_yty: bool = True,
) -> LinRegRelease:
    """Release ``(S_hat_j, z_hat_j, u_hat_j)`` for each data holder's rows.

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
    with_yty : bool
        Release ``y_j^T y_j`` with the rest (default), so that the data inform
        ``sigma_y`` (Bernstein & Sheldon 2019); it raises the sensitivity by
        ``y_bound^4`` under the root (:func:`linreg_sensitivity`).  False makes
        paper 002's release, whose ``sigma_y`` is the prior's.

    The noise covers :func:`linreg_sensitivity` plus the computation's error
    bounds and the grid rounding (:func:`linreg_plan`); one Gaussian event,
    since a row moves one holder's statistics only.
    """
    holders = holder_rows(X, y)
    rows = _holders_plan_rows(holders, neighbourhood, max_rows, delta)
    holders = [(clip_rows(Xj, x_bound, "x"), clip_rows(yj, y_bound, "y")) for Xj, yj in holders]
    z = gaussian_noise_multiplier(epsilon, delta, noise_multiplier)
    d = holders[0][0].shape[1]
    plan = linreg_plan(z, rows, d, x_bound, y_bound, neighbourhood, with_yty)
    weight = count_weight(computed_bound(x_bound, d), computed_bound(y_bound, 1), neighbourhood,
                          with_yty)
    entry = release_entry("LinRegStats", dpa.GaussianDpEvent(z), reproducible_noise)
    k = d * (d + 1) // 2

    def draw(key):
        stats = np.stack([plan.release(random.fold_in(key, j),
                                       *linreg_statistic(Xj, yj, weight, with_yty))
                          for j, (Xj, yj) in enumerate(holders)])
        return np.stack([symmetric_from_upper(s[:k], d) for s in stats]), stats[:, k:]

    S_hat, rest = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger,
                                 what="release_linreg_stats")
    yty = rest[:, d] if with_yty else None
    if weight > 0:
        n_rows = np.maximum(rest[:, -1] / weight, 0.0)
    else:
        n_rows = np.array([len(Xj) for Xj, _ in holders])
    return LinRegRelease(S_hat, rest[:, :d], yty, n_rows, float(plan.scale), float(x_bound),
                         float(y_bound), entry, neighbourhood)


# -------------------------------------------------------------------- prior
class LinRegPrior(NamedTuple):
    """Hyperparameters: ``theta ~ N(mean, cov)``, ``sigma_y^2 ~ noise_variance`` (a
    NumPyro distribution on the positive reals), ``Sigma_x ~ IW(iw_scale, iw_df)``
    (normalX only)."""

    mean: np.ndarray
    cov: np.ndarray
    noise_variance: dist.Distribution
    iw_scale: np.ndarray
    iw_df: float

    @classmethod
    def default(cls, d: int, x_bound: float, y_bound: float) -> LinRegPrior:
        """Weakly informative, on the scale the public bounds set: ``theta_k ~ N(0, (2.5
        y_bound sqrt(d) / x_bound)^2)`` (a coefficient times a typical feature,
        ``x_bound / sqrt(d)``, reaches 2.5 times the largest ``|y|``) and
        ``sigma_y ~ HalfNormal(y_bound)`` (``|y| <= y_bound`` bounds ``sigma_y`` by about
        it; flat near 0, so small noise scales are not ruled out); ``IW(I, d + 1)``."""
        scale = 2.5 * check_bound("y_bound", y_bound) * math.sqrt(d) / check_bound(
            "x_bound", x_bound)
        noise = dist.TransformedDistribution(dist.HalfNormal(float(y_bound)),
                                             PowerTransform(2.0))
        return cls(np.zeros(d), scale**2 * np.eye(d), noise, np.eye(d), d + 1.0)

    @classmethod
    def paper(cls, d: int) -> LinRegPrior:
        """Alparslan (2023), s7.2: ``sigma_y^2 ~ IG(20, 0.5)``, ``m = 0``, ``C = (a - 1) / b
        I``, ``IW(I, d + 1)``.  Informative (``sigma_y`` about 0.16 whatever the data):
        for reproducing the paper."""
        a, b = 20.0, 0.5
        return cls(np.zeros(d), (a - 1) / b * np.eye(d), dist.InverseGamma(a, b), np.eye(d),
                   d + 1.0)


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
def observe_statistics(S, z_hat, sigma_z, theta, sigma_y2, yty=None, n_rows=None, S_hat=None):
    """The release's likelihood given each holder's ``S_j`` (J, d, d).

    Without ``yty``: ``z_hat_j ~ N(S_j theta, sigma_y2 S_j + sigma_z^2 I)``.  With it,
    ``(z_hat_j, u_hat_j)`` is normal with the exact first two moments of ``(X_j^T y_j,
    y_j^T y_j)`` given ``S_j`` and ``e ~ N(0, sigma_y2 I)``, plus the release's noise:
    ``E u = theta^T S_j theta + n_j sigma_y2``, ``Var u = 4 sigma_y2 theta^T S_j theta +
    2 n_j sigma_y2^2 + sigma_z^2``, ``Cov(z, u) = 2 sigma_y2 S_j theta`` (Bernstein &
    Sheldon 2019 make the same normal approximation; ``y^T y`` is a noncentral
    chi-square with ``n_j`` degrees of freedom, close to normal for the n at which a
    release is informative).

    ``S_hat`` given (the released ``S_j`` with its noise ``M``, of sd ``sigma_z`` in
    each upper-triangle entry): the means take ``S_hat_j`` and the covariance adds the
    noise ``-M theta`` and ``-theta^T M theta`` brings, both linear in ``M``, so exact:
    ``Cov(M theta) = sigma_z^2 (|theta|^2 I + theta theta^T - diag(theta^2))``,
    ``Var(theta^T M theta) = sigma_z^2 (2 |theta|^4 - sum theta^4)``,
    ``Cov(M theta, theta^T M theta) = sigma_z^2 theta (2 |theta|^2 - theta^2)``.
    Without it (paper 002's fixedS) ``S_j`` is taken as exact, and the posterior of
    ``theta`` is too narrow where ``M theta`` is not small beside ``X^T e``.
    """
    d = S.shape[-1]
    eye = jnp.eye(d)
    mean = (S if S_hat is None else S_hat) @ theta
    cov = sigma_y2 * S + sigma_z**2 * eye
    t2 = theta**2
    norm2 = jnp.sum(t2)
    if S_hat is not None:
        cov = cov + sigma_z**2 * (norm2 * eye + jnp.outer(theta, theta) - jnp.diag(t2))
    if yty is None:
        with numpyro.plate("holders", S.shape[0]):
            numpyro.sample("z_hat", dist.MultivariateNormal(mean, covariance_matrix=cov),
                           obs=z_hat)
        return
    quad = mean @ theta
    n = jnp.asarray(np.asarray(n_rows, np.float64))
    cross = 2 * sigma_y2 * (S @ theta)
    var_u = 4 * sigma_y2 * ((S @ theta) @ theta) + 2 * n * sigma_y2**2 + sigma_z**2
    if S_hat is not None:
        cross = cross + sigma_z**2 * theta * (2 * norm2 - t2)
        var_u = var_u + sigma_z**2 * (2 * norm2**2 - jnp.sum(t2**2))
    joint_cov = jnp.concatenate([
        jnp.concatenate([cov, cross[..., :, None]], axis=-1),
        jnp.concatenate([cross, var_u[..., None]], axis=-1)[..., None, :],
    ], axis=-2)
    joint_mean = jnp.concatenate([mean, (quad + n * sigma_y2)[..., None]], axis=-1)
    with numpyro.plate("holders", S.shape[0]):
        numpyro.sample("zu_hat", dist.MultivariateNormal(joint_mean,
                                                         covariance_matrix=joint_cov),
                       obs=jnp.concatenate([z_hat, jnp.asarray(yty)[:, None]], axis=-1))


def _theta_sigma(prior: LinRegPrior, sigma_y2):
    theta = numpyro.sample("theta", dist.MultivariateNormal(prior.mean, prior.cov))
    if sigma_y2 is None:
        sigma_y2 = numpyro.sample("sigma_y2", prior.noise_variance)
    return theta, sigma_y2


def fixed_s_model(S, z_hat, sigma_z, prior: LinRegPrior, sigma_y2=None, yty=None,
                  n_rows=None, S_hat=None):
    """MCMC-fixedS (Alparslan 2023, Alg. 17) as a NumPyro model.

    ``S`` (J, d, d) is PSD, e.g. :func:`nearest_psd` of the release; the
    release's likelihood is :func:`observe_statistics` with ``z_j`` integrated out
    (and ``y^T y`` where ``yty`` is given, with the rows ``n_rows``; ``S_hat``, the
    release's own, propagates its noise, which the paper's fixedS ignores).  A fixed
    ``sigma_y2`` replaces its prior.
    """
    if isinstance(S, np.ndarray):
        _check_stats(S, z_hat, psd=True)
    theta, sigma_y2 = _theta_sigma(prior, sigma_y2)
    observe_statistics(S, z_hat, sigma_z, theta, sigma_y2, yty, n_rows, S_hat)


def normal_x_model(S_hat, z_hat, n_rows, sigma, prior: LinRegPrior, sigma_y2=None, yty=None):
    """MCMC-normalX (Alparslan 2023, Alg. 16) as a NumPyro model.

    ``x ~ N(0, Sigma_x)``, ``Sigma_x ~ IW(iw_scale, iw_df)``, so
    ``S_j | Sigma_x ~ Wishart(n_j, Sigma_x)``; the upper triangle of ``S_hat_j``
    is ``N(S_j, sigma^2)``.  ``Sigma_x`` is integrated out in closed form
    (Wishart-inverse-Wishart conjugacy), which leaves the joint posterior of
    ``(theta, sigma_y2, S)`` unchanged and removes its correlation with S:
    ``log p(S_1:J) = sum_j (n_j - d - 1)/2 log|S_j| - (df + n)/2 log|Lambda + sum_j S_j|``
    up to a constant.  The release's likelihood given ``S``: :func:`observe_statistics`.
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
    observe_statistics(S, z_hat, sigma, theta, sigma_y2, yty, n_rows)


def exact_model(S, z, yty, n, prior: LinRegPrior):
    """The non-private posterior's model, the yardstick of the noise-aware ones: the rows'
    Gaussian likelihood through their exact sufficient statistics ``S = X^T X``, ``z =
    X^T y``, ``yty = y^T y`` and ``n`` rows (one holder; nothing released)."""
    theta, sigma_y2 = _theta_sigma(prior, None)
    rss = yty - 2 * theta @ z + theta @ S @ theta
    numpyro.factor("rows", -n / 2 * jnp.log(sigma_y2) - rss / (2 * sigma_y2))


#: A parameter whose posterior sd is at least this share of its prior's is reported
#: as informed by the prior alone (:class:`PriorDominatedWarning`).
PRIOR_DOMINATED_SHARE = 0.9


class PriorDominatedWarning(UserWarning):
    """The release hardly informs a parameter: its posterior sd is within 10% of its
    prior's, so what the posterior says of it is the prior's."""


def prior_dominated(prior: LinRegPrior, samples: dict) -> list[str]:
    """Names of the parameters in ``samples`` (``theta``, ``sigma_y2``) whose posterior sd
    is at least :data:`PRIOR_DOMINATED_SHARE` of the prior's (post-processing: the
    draws and the public prior; the prior's sd of ``sigma_y2`` from 20,000 of its
    draws, infinite where the prior has none)."""
    names = []
    theta_sd = np.sqrt(np.diag(np.asarray(prior.cov, np.float64)))
    post_sd = np.asarray(samples["theta"], np.float64).std(0)
    names += [f"theta[{k}]" for k in np.flatnonzero(post_sd >= PRIOR_DOMINATED_SHARE * theta_sd)]
    if "sigma_y2" in samples:
        draws = np.asarray(prior.noise_variance.sample(random.PRNGKey(0), (20_000,)), np.float64)
        if np.std(np.asarray(samples["sigma_y2"], np.float64)) >= (
                PRIOR_DOMINATED_SHARE * np.std(draws)):
            names.append("sigma_y2")
    return names


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
    ``sigma_y2`` and, for normalX, ``S``; ``arviz.from_numpyro`` works).  ``prior``:
    :meth:`LinRegPrior.default` at the release's bounds unless given.  Chains start
    from the fast estimate (``sigma_y2`` from the released ``y^T y`` where there is
    one) and ``nearest_psd(S_hat)``, functions of the release only.  A
    :class:`PriorDominatedWarning` names the parameters whose posterior sd is within
    10% of the prior's.
    """
    d = release.S_hat.shape[-1]
    prior = LinRegPrior.default(d, release.x_bound, release.y_bound) if prior is None else prior
    _check_stats(release.S_hat, release.z_hat, psd=False)
    S_psd = nearest_psd(release.S_hat)
    start = fast_posterior(release, prior, sigma_y2)
    init = {"theta": start.mean}
    if sigma_y2 is None:
        init["sigma_y2"] = start.sigma_y2
    if method == "fixedS":
        model = fixed_s_model
        args = (S_psd, release.z_hat, release.sigma, prior, sigma_y2, release.yty,
                release.n_rows, release.S_hat)
    elif method == "normalX":
        # start S strictly inside the cone: eigenvalues at least the noise scale
        w, V = np.linalg.eigh(S_psd)
        init["S"] = (V * np.maximum(w, release.sigma)[..., None, :]) @ np.swapaxes(V, 1, 2)
        model = normal_x_model
        args = (release.S_hat, release.z_hat, release.n_rows, release.sigma, prior, sigma_y2,
                release.yty)
    else:
        raise ValueError(f"method={method!r}; use 'fixedS' or 'normalX'.")
    kernel = NUTS(model, dense_mass=True,
                  init_strategy=init_to_value(values=init))
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                progress_bar=progress_bar, chain_method="sequential")
    mcmc.run(rng_key, *args)
    dominated = prior_dominated(prior, mcmc.get_samples())
    if dominated:
        warnings.warn(
            f"{', '.join(dominated)}: the posterior sd is within 10% of the prior's, so the "
            "release hardly informs them and what the posterior says of them is the prior's. "
            "A larger epsilon, tighter public bounds (x_bound, y_bound) or more rows inform "
            "them; otherwise report them as the prior's."
            + ("" if release.yty is not None or sigma_y2 is not None else
               " sigma_y2 is the prior's whenever y^T y is not released (with_yty=False)."),
            PriorDominatedWarning, stacklevel=2)
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


def noise_variance_estimate(release: LinRegRelease, theta) -> float:
    """``sigma_y^2`` from the released ``y^T y`` at ``theta`` (post-processing): the
    residual sum of squares ``sum_j u_hat_j - 2 theta^T z_hat_j + theta^T S_hat_j theta``
    over the rows, kept within ``[(y_bound / 1000)^2, y_bound^2]``; ``(y_bound / 3)^2``
    (paper 002's crude value, a three-sigma rule) where no ``y^T y`` was released."""
    if release.yty is None:
        return (release.y_bound / 3) ** 2
    theta = np.asarray(theta, np.float64)
    rss = np.sum(release.yty - 2 * release.z_hat @ theta
                 + np.einsum("i,jik,k->j", theta, release.S_hat, theta))
    s2 = rss / max(float(np.sum(release.n_rows)), 1.0)
    return float(np.clip(s2, (release.y_bound / 1000) ** 2, release.y_bound**2))


def fast_posterior(
    release: LinRegRelease, prior: LinRegPrior | None = None, sigma_y2: float | None = None
) -> GaussianPosterior:
    """Bayes-fixedS-fast (Alparslan 2023, Alg. 18; its m_post corrected to the posterior mean).

    ``S_j`` fixed at :func:`nearest_psd` of the release and ``sigma_y2``, unless given,
    at :func:`noise_variance_estimate`: from the released ``y^T y`` at the estimate
    made with paper 002's crude value, then once more at the new one.
    """
    d = release.S_hat.shape[-1]
    prior = LinRegPrior.default(d, release.x_bound, release.y_bound) if prior is None else prior
    _check_stats(release.S_hat, release.z_hat, psd=False)
    S = nearest_psd(release.S_hat)
    if sigma_y2 is not None:
        return theta_conditional(S, release.z_hat, release.sigma, sigma_y2, prior)
    post = theta_conditional(S, release.z_hat, release.sigma, (release.y_bound / 3) ** 2, prior)
    for _ in range(2):
        s2 = noise_variance_estimate(release, post.mean)
        post = theta_conditional(S, release.z_hat, release.sigma, s2, prior)
    return post


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
