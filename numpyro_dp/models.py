"""Reference models with posteriors known in closed form (SPEC s8).

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


def banana_model(X, a=20.0, b=0.0, m=0.0, prior_var=1000.0, row_var=(2000.0, 2500.0)):
    """theta ~ Ban(0, prior_var I, a, b, m); row x_i ~ N(g^{-1}(theta), diag(row_var))."""
    d = X.shape[1]
    row_sd = jnp.sqrt(jnp.broadcast_to(jnp.asarray(row_var, dtype=X.dtype), (d,)))
    theta = numpyro.sample(
        "theta", Banana(jnp.zeros(d), jnp.full(d, np.sqrt(prior_var)), a, b, m)
    )
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.Normal(banana_g_inv(theta, a, b, m), row_sd).to_event(1), obs=X)


def banana_data(key, n, theta=(0.0, 3.0), a=20.0, b=0.0, m=0.0, row_var=(2000.0, 2500.0)):
    """n rows from the banana model's likelihood at ``theta``."""
    theta = jnp.asarray(theta)
    mean = banana_g_inv(theta, a, b, m)
    sd = jnp.sqrt(jnp.broadcast_to(jnp.asarray(row_var), mean.shape))
    return mean + sd * jax.random.normal(key, (n, mean.shape[0]))


def banana_posterior_sample(key, X, num_samples, temperature=1.0, a=20.0, b=0.0, m=0.0,
                            prior_var=1000.0, row_var=(2000.0, 2500.0)):
    """Exact draws from the (tempered) banana posterior (SPEC s8)."""
    X = np.asarray(X, dtype=np.float64)
    n, d = X.shape
    tau = 1.0 / np.broadcast_to(np.asarray(row_var, float), (d,))
    tau0 = 1.0 / prior_var
    prec = temperature * n * tau + tau0
    mu = temperature * n * tau * X.mean(0) / prec
    z = mu + np.sqrt(1.0 / prec) * np.asarray(jax.random.normal(key, (num_samples, d)))
    z[:, 1] -= a * (z[:, 0] - m) ** 2 + b
    return z


def gaussian_model(X, cov, prior_sd=100.0):
    """theta ~ N(0, prior_sd^2 I); rows x_i ~ N(theta, cov) with cov known."""
    d = X.shape[1]
    theta = numpyro.sample("theta", dist.Normal(jnp.zeros(d), prior_sd).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.MultivariateNormal(theta, covariance_matrix=cov), obs=X)


def gaussian_posterior(X, cov, prior_sd=100.0, temperature=1.0):
    """Mean and covariance of the conjugate (tempered) posterior of gaussian_model."""
    X = np.asarray(X, dtype=np.float64)
    n, d = X.shape
    cov_inv = np.linalg.inv(np.asarray(cov, np.float64))
    prec = np.eye(d) / prior_sd**2 + temperature * n * cov_inv
    post_cov = np.linalg.inv(prec)
    post_mean = post_cov @ (temperature * n * cov_inv @ X.mean(0))
    return post_mean, post_cov
