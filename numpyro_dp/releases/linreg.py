"""DP Bayesian linear regression: inference from released sufficient statistics.

Alparslan, Yildirim & Birbil (2023); Alparslan (2023), s5.2.  Each of J data holders
releases, once, noisy ``X_j^T X_j``, ``X_j^T y_j`` and, by default, ``y_j^T y_j``
(:func:`release_linreg_stats`; the release and the adaSSP baseline :func:`adassp`
are made by :mod:`numpyro_dp.releases.linreg_release`, and offered here as part of
``ndp.linreg``).  Everything after the release is post-processing and costs no
budget:

* :func:`fit` runs NumPyro's NUTS on a noise-aware model, ``"fixedS"``
  (:func:`fixed_s_model`, ``S_j`` fixed at the nearest PSD matrix to
  ``S_hat_j``) or ``"normalX"`` (:func:`normal_x_model`, ``x ~ N(0, Sigma_x)``
  and ``S_j`` latent);
* :func:`fast_posterior`: the closed-form "Bayes-fixedS-fast" posterior;
* :func:`posterior_predictive`: draws of new responses given posterior draws.

The model is ``y_i = x_i^T theta + e_i``, ``e_i ~ N(0, sigma_y^2)``, without
intercept (append a constant column inside the bound if one is wanted),
``theta ~ N(m, C)``, ``sigma_y^2`` from :attr:`LinRegPrior.noise_variance`, and, given
the holder's true ``S_j``, ``z_hat_j ~ N(S_j theta, sigma_y^2 S_j + sigma^2 I)``; with
``u_hat_j`` the pair ``(z_hat_j, u_hat_j)`` is normal with the exact first two
moments of ``(X_j^T y_j, y_j^T y_j)`` given ``S_j`` (:func:`observe_statistics`).

Precision: the releases are computed in float64
(:mod:`numpyro_dp.releases.linreg_release`).  The NUTS models run in JAX's default
dtype.  ``S_j`` grows like ``n_j``, so for n around 1e5 and more float32 loses about
7 of ~12 significant digits in ``z_hat - S theta``; enable float64
(``jax.config.update("jax_enable_x64", True)``) when the noise is small relative to
``S``.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints
from numpyro.distributions.transforms import PowerTransform
from numpyro.infer import MCMC, NUTS, init_to_value

from numpyro_dp.releases.linreg_release import (
    COUNT_WEIGHT,
    LinRegRelease,
    adassp,
    linreg_sensitivity,
    release_linreg_stats,
)
from numpyro_dp.releases.mechanisms import check_bound

__all__ = [
    "COUNT_WEIGHT",
    "PRIOR_DOMINATED_SHARE",
    "GaussianPosterior",
    "LinRegPrior",
    "LinRegRelease",
    "PriorDominatedWarning",
    "adassp",
    "exact_model",
    "fast_posterior",
    "fit",
    "fixed_s_model",
    "linreg_sensitivity",
    "nearest_psd",
    "noise_variance_estimate",
    "normal_x_model",
    "observe_statistics",
    "posterior_predictive",
    "prior_dominated",
    "release_linreg_stats",
    "theta_conditional",
]


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
