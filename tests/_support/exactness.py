"""Exactness of a gradient kernel at negligible noise, on the two reference models
of Räisä, Koskela & Honkela (2021): the banana and the correlated Gaussian."""

import jax
import numpy as np

from _support.data import BANANA_N, BANANA_ROW_VAR
from _support.running import run
from _support.stats import (
    assert_mmd_within_exact_spread,
    assert_moments_match,
    max_row_grad_norm,
    moment_errors,
)
from numpyro_dp.evaluation.models import (
    banana_data,
    banana_model,
    banana_posterior_sample,
    gaussian_model,
    gaussian_posterior,
)


def assert_exact_on_banana(kernel, num_warmup, num_samples, clip):
    """The banana with n = 1000 rows and row variances scaled by n / 1e5: the
    posterior (precision n / s_j^2, xbar ~ N(., s_j^2 / n)) has exactly the law of
    the reference n = 1e5 one, at 1 % of the cost per gradient."""
    X = banana_data(jax.random.PRNGKey(1), BANANA_N, row_var=BANANA_ROW_VAR)
    mcmc = run(kernel, X, row_var=BANANA_ROW_VAR, num_warmup=num_warmup,
               num_samples=num_samples)
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])

    def exact(seed, size):
        return banana_posterior_sample(jax.random.PRNGKey(1000 + seed), X, size,
                                       row_var=BANANA_ROW_VAR)

    # Nothing is clipped: |r_i| <= h max ||grad l_i|| on the segment, far below llr_clip h.
    assert max_row_grad_norm(banana_model, (X,), {"row_var": BANANA_ROW_VAR},
                             exact(99, 50)) < clip / 100
    assert_mmd_within_exact_spread(chains, exact)
    assert_moments_match(chains, exact(98, 20_000)[None])


def spec_gaussian_problem(n, d=10, seed=0):
    """Sigma = Q diag(lambda) Q^T, lambda ~ Gamma(0.5, 1), Q orthonormalised U(0,1)."""
    rng = np.random.default_rng(seed)
    lam = rng.gamma(0.5, 1.0, size=d)
    Q, _ = np.linalg.qr(rng.uniform(size=(d, d)))
    cov = (Q * lam) @ Q.T
    X = rng.multivariate_normal(rng.normal(size=d), cov, size=n)
    return X.astype(np.float32), cov.astype(np.float32)


def assert_exact_on_spec_gaussian(kernel, num_warmup, num_samples, clip):
    """The correlated Gaussian, d = 10, with n = 200: the posterior N(~xbar, ~Sigma / n)
    is the n = 1e5 one rescaled (the N(0, 100^2) prior is negligible either way), so
    the condition number (about 800 for this Sigma) is that of the reference.  The
    chains start at the posterior mean (a user-given init; from init_to_uniform the
    step size shrinks to the smallest scale before the mass matrix is learnt)."""
    X, cov = spec_gaussian_problem(200)
    mean, post_cov = gaussian_posterior(X, cov)
    init = {"theta": np.tile(mean.astype(np.float32), (4, 1))}
    mcmc = run(kernel, X, cov, num_warmup=num_warmup, num_samples=num_samples,
               init_params=init)
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    root = np.linalg.cholesky(post_cov)

    def exact(seed, size):
        return mean + np.random.default_rng(seed).normal(size=(size, len(mean))) @ root.T

    assert max_row_grad_norm(gaussian_model, (X, cov), {}, exact(99, 50)) < clip / 100
    assert_mmd_within_exact_spread(chains, exact)
    # The MMD is weak in 10-D; the whitened draws must also have mean 0, variance 1.
    white = (chains - mean) @ np.linalg.inv(root).T
    _, sd, se_mean, se_log_sd = moment_errors(white)
    np.testing.assert_array_less(np.abs(white.reshape(-1, 10).mean(0)), 4 * se_mean)
    np.testing.assert_array_less(np.abs(np.log(sd)), 4 * se_log_sd)
