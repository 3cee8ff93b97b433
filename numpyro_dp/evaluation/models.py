"""Reference models with posteriors known in closed form (Räisä, Koskela & Honkela 2021).

Used to check that a kernel targets the right posterior: each model comes
with a data simulator and an exact posterior sampler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints


class Banana(dist.Distribution):
    """Ban(mu, diag(scale^2), a, b, m): the law of g(Z), Z ~ N(mu, diag(scale^2)).

    g(z) = (z1, z2 - a (z1 - m)^2 - b, z3, ..., zd) has unit Jacobian, so the
    density is that of N(mu, diag(scale^2)) at g^{-1}(theta).
    """

    arg_constraints = {"loc": constraints.real_vector, "scale": constraints.positive}
    support = constraints.real_vector
    reparametrized_params = ["loc", "scale"]

    def __init__(self, loc, scale, a=20.0, b=0.0, m=0.0, *, validate_args=None):
        self.loc, self.scale = jnp.asarray(loc), jnp.asarray(scale)
        self.a, self.b, self.m = a, b, m
        batch_shape = jnp.shape(self.loc)[:-1]
        super().__init__(batch_shape, jnp.shape(self.loc)[-1:], validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        shape = sample_shape + self.batch_shape + self.event_shape
        z = self.loc + self.scale * jax.random.normal(key, shape)
        return banana_g(z, self.a, self.b, self.m)

    def log_prob(self, value):
        z = banana_g_inv(value, self.a, self.b, self.m)
        return dist.Normal(self.loc, self.scale).log_prob(z).sum(-1)


def banana_g(z, a, b, m):
    return z.at[..., 1].add(-a * (z[..., 0] - m) ** 2 - b)


def banana_g_inv(theta, a, b, m):
    return theta.at[..., 1].add(a * (theta[..., 0] - m) ** 2 + b)


BANANA_REFERENCE = {"a": 20.0, "b": 0.0, "m": 0.0, "prior_var": 1000.0,
                    "row_var": (2000.0, 2500.0), "theta": (0.0, 3.0)}


def banana_model(X, a=20.0, b=0.0, m=0.0, prior_var=1000.0, row_var=(2000.0, 2500.0),
                 temperature=1.0):
    """The banana model of Räisä, Koskela & Honkela (2021), for any dimension d = X.shape[1] >= 2.

    theta ~ Ban(0, s0^2 I, a, b, m) and row x_i ~ N(g^{-1}(theta), diag(s_j^2)),
    so the (tempered) posterior is Ban(mu, Sigma, a, b, m) in closed form
    (:func:`banana_posterior_sample`).

    Parameters
    ----------
    X : array, shape (n, d)
        The rows (the data plate is named ``"data"``).
    a, b, m : float
        Curvature, offset and centre of the banana transform g.
    prior_var : float
        s0^2, the prior variance of every coordinate before the transform.
    row_var : float or array of length d
        s_j^2, the variance of each column of a row (broadcast to d).
    temperature : float
        T in (0, 1]: each row's log-likelihood is multiplied by T (through
        ``numpyro.handlers.scale``). Meant for NUTS references of tempered
        posteriors; with a DP kernel prefer the kernel's own ``temperature``
        argument, which scales the rows *after* clipping, so the clip bounds
        keep their meaning.
    """
    d = X.shape[1]
    if d < 2:
        raise ValueError(f"the banana model needs d >= 2 columns, got {d}")
    row_sd = jnp.sqrt(jnp.broadcast_to(jnp.asarray(row_var, dtype=X.dtype), (d,)))
    theta = numpyro.sample(
        "theta", Banana(jnp.zeros(d), jnp.full(d, np.sqrt(prior_var)), a, b, m)
    )
    with numpyro.plate("data", X.shape[0]), numpyro.handlers.scale(scale=temperature):
        numpyro.sample("x", dist.Normal(banana_g_inv(theta, a, b, m), row_sd).to_event(1), obs=X)


def banana_data(key, n, theta=(0.0, 3.0), a=20.0, b=0.0, m=0.0, row_var=(2000.0, 2500.0)):
    """n rows from the banana model's likelihood at ``theta``."""
    theta = jnp.asarray(theta)
    mean = banana_g_inv(theta, a, b, m)
    sd = jnp.sqrt(jnp.broadcast_to(jnp.asarray(row_var), mean.shape))
    return mean + sd * jax.random.normal(key, (n, mean.shape[0]))


def banana_posterior_sample(key, X, num_samples, temperature=1.0, a=20.0, b=0.0, m=0.0,
                            prior_var=1000.0, row_var=(2000.0, 2500.0)):
    """Exact draws from the (tempered) banana posterior."""
    X = np.asarray(X, dtype=np.float64)
    n, d = X.shape
    tau = 1.0 / np.broadcast_to(np.asarray(row_var, float), (d,))
    tau0 = 1.0 / prior_var
    prec = temperature * n * tau + tau0
    mu = temperature * n * tau * X.mean(0) / prec
    z = mu + np.sqrt(1.0 / prec) * np.asarray(jax.random.normal(key, (num_samples, d)))
    z[:, 1] -= a * (z[:, 0] - m) ** 2 + b
    return z


def gaussian_model(X, cov, prior_sd=100.0, temperature=1.0):
    """The correlated Gaussian model of Räisä, Koskela & Honkela (2021).

    theta ~ N(0, prior_sd^2 I); rows x_i ~ N(theta, cov) with ``cov`` known
    (:func:`gaussian_covariance` draws the paper's). ``temperature``
    multiplies each row's log-likelihood, as in :func:`banana_model`.
    """
    d = X.shape[1]
    theta = numpyro.sample("theta", dist.Normal(jnp.zeros(d), prior_sd).to_event(1))
    with numpyro.plate("data", X.shape[0]), numpyro.handlers.scale(scale=temperature):
        numpyro.sample("x", dist.MultivariateNormal(theta, covariance_matrix=cov), obs=X)


def gaussian_covariance(key, d=10):
    """Sigma = Q diag(lambda) Q^T with lambda_j ~ Gamma(0.5, 1) and Q from
    orthonormalising (QR) a d x d matrix of U(0, 1) entries (Räisä, Koskela & Honkela 2021, s4)."""
    k_lam, k_q = jax.random.split(key)
    lam = np.asarray(jax.random.gamma(k_lam, 0.5, (d,)), np.float64)
    q, _ = np.linalg.qr(np.asarray(jax.random.uniform(k_q, (d, d)), np.float64))
    return (q * lam) @ q.T


def gaussian_data(key, n, cov, theta=None):
    """n rows x_i ~ N(theta, cov) (theta = 0 by default)."""
    cov = np.asarray(cov, np.float64)
    theta = np.zeros(len(cov)) if theta is None else np.asarray(theta, np.float64)
    chol = np.linalg.cholesky(cov)
    z = np.asarray(jax.random.normal(key, (n, len(cov))), np.float64)
    return jnp.asarray(theta + z @ chol.T)


def gaussian_posterior(X, cov, prior_sd=100.0, temperature=1.0):
    """Mean and covariance of the conjugate (tempered) posterior of gaussian_model."""
    X = np.asarray(X, dtype=np.float64)
    n, d = X.shape
    cov_inv = np.linalg.inv(np.asarray(cov, np.float64))
    prec = np.eye(d) / prior_sd**2 + temperature * n * cov_inv
    post_cov = np.linalg.inv(prec)
    post_mean = post_cov @ (temperature * n * cov_inv @ X.mean(0))
    return post_mean, post_cov


def gaussian_posterior_sample(key, X, cov, num_samples, prior_sd=100.0, temperature=1.0):
    """Exact draws from the (tempered) posterior of gaussian_model."""
    mean, post_cov = gaussian_posterior(X, cov, prior_sd, temperature)
    z = np.asarray(jax.random.normal(key, (num_samples, len(mean))), np.float64)
    return mean + z @ np.linalg.cholesky(post_cov).T
