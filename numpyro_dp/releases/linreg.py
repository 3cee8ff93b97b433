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
    release_entry,
    row_product_error,
    row_product_sum,
    secret_release,
    sum_sensitivity,
    symmetric_from_upper,
    upper_triangle,
)


# ------------------------------------------------------------------ release
def linreg_sensitivity(x_bound: float, y_bound: float, neighbourhood: str = "substitute") -> float:
    """l2-sensitivity of ``(upper triangle of X^T X, X^T y)``.

    Rows with ``||x|| <= x_bound`` and ``|y| <= y_bound``.  Add/remove:
    ``sqrt(x_bound^4 + x_bound^2 y_bound^2)`` (Alparslan 2023, eq. 5.12).
    Substitute: ``sqrt(2 x_bound^4 + 4 x_bound^2 y_bound^2)`` (see
    :func:`~numpyro_dp.releases.mechanisms.gram_sensitivity`; the ``X^T y`` part
    doubles), below the factor 2 of the triangle inequality.
    """
    bx, by = check_bound("x_bound", x_bound), check_bound("y_bound", y_bound)
    z_part = sum_sensitivity(bx * by, neighbourhood)
    return math.sqrt(gram_sensitivity(bx, neighbourhood) ** 2 + z_part**2)


def linreg_plan(
    noise_multiplier: float,
    num_rows: int,
    d: int,
    x_bound: float,
    y_bound: float,
    neighbourhood: str,
) -> GridPlan:
    """:class:`~numpyro_dp.releases.mechanisms.GridPlan` of :func:`linreg_statistic` for n rows.

    Sensitivity :func:`linreg_sensitivity` at the bounds as computed, plus the
    error bounds of both sums (:func:`~numpyro_dp.releases.mechanisms.row_product_error`)
    and the grid rounding.
    """
    bx, by = computed_bound(x_bound, d), computed_bound(y_bound, 1)
    error = row_product_error(num_rows, bx, bx, d * d) + row_product_error(num_rows, bx, by, d)
    return grid_plan(
        noise_multiplier, linreg_sensitivity(bx, by, neighbourhood), d * (d + 3) // 2,
        magnitude=num_rows * bx * max(bx, by), error=error,
    )


def xty_statistic(X, y) -> tuple:
    """``X^T y`` as computed for a release: a double-word pair of shape (d,)."""
    hi, lo = row_product_sum(X, y[:, None])
    return hi[:, 0], lo[:, 0]


def linreg_statistic(X, y) -> tuple:
    """``(upper triangle of X^T X, X^T y)`` as computed for a release: a double-word pair.

    Call under ``jax.enable_x64(True)``.
    """
    (s_hi, s_lo), (z_hi, z_lo) = upper_triangle(row_product_sum(X, X)), xty_statistic(X, y)
    return jnp.concatenate([s_hi, z_hi]), jnp.concatenate([s_lo, z_lo])


class LinRegRelease(NamedTuple):
    """Released statistics of J data holders (all fields public).

    Attributes
    ----------
    S_hat : ndarray (J, d, d)
        Noisy ``X_j^T X_j`` (symmetric, not necessarily PSD).
    z_hat : ndarray (J, d)
        Noisy ``X_j^T y_j``.
    n_rows : ndarray (J,)
        Rows per holder (public).
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
    num_holders: int = 1,
    neighbourhood: str = "substitute",
    clip: bool = False,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> LinRegRelease:
    """Release ``(S_hat_j, z_hat_j)`` for ``num_holders`` consecutive blocks of rows.

    Each holder would run this on its own rows with ``num_holders=1``; the
    blocks here simulate J holders (``np.array_split`` of the rows).  The noise
    is calibrated analytically (Balle & Wang 2018) to (epsilon, delta), or
    given as ``noise_multiplier``, for :func:`linreg_sensitivity` plus the
    computation's error bounds and the grid rounding (:func:`linreg_plan`, at
    the largest holder's row count); ``delta`` must be below ``1 / n``.

    ``x_bound`` and ``y_bound`` must be fixed a priori; rows beyond them are
    refused unless ``clip=True`` (see :func:`~numpyro_dp.releases.mechanisms.clip_rows`).
    ``ledger`` (charged before any noise is drawn) and ``reproducible_noise``
    (tests only) as in :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism`.
    """
    check_neighbourhood(neighbourhood)
    X = clip_rows(X, x_bound, clip, "x")
    y = clip_rows(y, y_bound, clip, "y")
    if X.ndim != 2 or y.shape != (len(X),):
        raise ValueError(f"X must be (n, d) and y (n,); got {X.shape} and {y.shape}.")
    if not (isinstance(num_holders, (int, np.integer)) and 1 <= num_holders <= len(X)):
        raise ValueError(f"num_holders={num_holders!r} must be an integer in 1..n.")
    check_delta_for_rows(delta, len(X))
    z = gaussian_noise_multiplier(epsilon, delta, noise_multiplier)
    d = X.shape[1]
    blocks = np.array_split(np.arange(len(X)), num_holders)
    plan = linreg_plan(z, len(blocks[0]), d, x_bound, y_bound, neighbourhood)
    entry = release_entry("LinRegStats", dpa.GaussianDpEvent(z), reproducible_noise)

    def draw(key):
        stats = [plan.release(random.fold_in(key, j), *linreg_statistic(X[b], y[b]))
                 for j, b in enumerate(blocks)]
        k = d * (d + 1) // 2
        return (np.stack([symmetric_from_upper(s[:k], d) for s in stats]),
                np.stack([s[k:] for s in stats]))

    S_hat, z_hat = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger,
                                  what="release_linreg_stats")
    return LinRegRelease(S_hat, z_hat, np.array([len(b) for b in blocks]), float(plan.scale),
                         float(x_bound), float(y_bound), entry, neighbourhood)


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
    num_holders: int = 1,
    neighbourhood: str = "substitute",
    rho: float = 0.05,
    clip: bool = False,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
) -> Release:
    """adaSSP (Wang 2018), distributed as in Alparslan (2023, eq. 7.2).

    Each holder releases ``lambda_min(S_j)`` (sensitivity ``x_bound^2``),
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
    sum z_hat_j`` as the release's value.  ``delta`` must be below ``1 / n``;
    ``ledger`` and ``reproducible_noise`` as in
    :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism`.
    """
    check_neighbourhood(neighbourhood)
    X = clip_rows(X, x_bound, clip, "x")
    y = clip_rows(y, y_bound, clip, "y")
    if not 0 < rho < 1:
        raise ValueError(f"rho={rho} (failure probability) must lie in (0, 1).")
    check_delta_for_rows(delta, len(X))
    d = X.shape[1]

    def event3(z):
        return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 3)

    z = calibrate_noise_multiplier(event3, epsilon, delta)
    blocks = np.array_split(np.arange(len(X)), num_holders)
    n = len(blocks[0])  # the largest holder: every bound grows with n
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
        for j, b in enumerate(blocks):
            k_lam, k_S, k_z = random.split(random.fold_in(key, j), 3)
            S = row_product_sum(X[b], X[b])
            lam = np.linalg.eigvalsh(np.asarray(S[0] + S[1]))[0]
            lam_min = float(lam_plan.release(k_lam, lam)) - shift
            lam_sum += max(0.0, S_plan.scale * math.sqrt(d * math.log(2 * d**2 / rho))
                           - max(lam_min, 0.0))
            S_sum += symmetric_from_upper(S_plan.release(k_S, *upper_triangle(S)), d)
            z_sum += z_plan.release(k_z, *xty_statistic(X[b], y[b]))
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
