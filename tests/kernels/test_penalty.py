"""DPPenalty targets the right posterior (SPEC s3).

Tolerances come from the Monte Carlo error: MMDs are compared with the spread
of MMDs between independent exact samples of the chain's effective size, and
moments with their standard errors from the effective sample size.
"""

import functools

import jax
import numpy as np
import pytest
from _support.data import BANANA_N, BANANA_ROW_VAR, logistic_model, make_logistic_data
from _support.running import HUGE_EPSILON, negligible_noise_warnings
from _support.running import run as run_private
from _support.stats import assert_mmd_within_exact_spread, assert_moments_match, max_row_grad_norm
from numpyro.infer import MCMC, NUTS

import numpyro_dp as ndp
from numpyro_dp.evaluation.models import (
    banana_data,
    banana_model,
    banana_posterior_sample,
    gaussian_model,
    gaussian_posterior,
)

#: Noise negligible unless a test says otherwise: checks the sampler, not the privacy.
run = functools.partial(run_private, epsilon=HUGE_EPSILON)

#: DPPenalty's random walk mixes slower than HMC: fewer effective draws suffice, and
#: they are thinned to 2 autocorrelation times (a random walk's draws one time apart
#: are still correlated, which inflates the MMD: both conjugate Gaussian runs failed
#: at spacing 1 after the calibrated noise changed in its 7th digit).
mmd_check = functools.partial(assert_mmd_within_exact_spread, replicates=20, min_size=50,
                              cap=None, spacing=2)


@pytest.mark.slow
@negligible_noise_warnings
def test_banana_negligible_noise_matches_exact_posterior():
    """The n = 1000 banana whose posterior is the reference n = 1e5 one (see test_hmc),
    with a clip above every row's ratio and so a noise multiplier fixed near 0."""
    X = banana_data(jax.random.PRNGKey(1), BANANA_N, row_var=BANANA_ROW_VAR)
    llr_clip = 1000.0
    kernel = ndp.DPPenalty(banana_model, llr_clip=llr_clip, proposal_scale=0.05,
                           noise_multiplier=1e-8)
    mcmc = run(kernel, X, row_var=BANANA_ROW_VAR, num_warmup=500, num_samples=3000,
               epsilon=None)
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])

    def exact(seed, size):
        return banana_posterior_sample(jax.random.PRNGKey(1000 + seed), X, size,
                                       row_var=BANANA_ROW_VAR)

    # Nothing is clipped: |r_i| <= max ||grad l_i|| ||theta' - theta||, far below the clip.
    assert max_row_grad_norm(banana_model, (X,), {"row_var": BANANA_ROW_VAR},
                             exact(99, 50)) < llr_clip / 10
    mmd_check(chains, exact)


def gaussian_problem(n=2000, d=4, seed=0):
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(d, d))
    cov = A @ A.T / d + 0.5 * np.eye(d)
    X = rng.multivariate_normal(np.arange(d, dtype=float), cov, size=n)
    return X.astype(np.float32), cov.astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("proposal", ["random_walk", "one_coordinate", "guided"])
def test_conjugate_gaussian_negligible_noise_matches_exact_posterior(proposal):
    X, cov = gaussian_problem()
    kernel = ndp.DPPenalty(gaussian_model, llr_clip=50.0, proposal_scale=0.05,
                           proposal=proposal)
    mcmc = run(kernel, X, cov, num_warmup=500, num_samples=4000)
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    mean, post_cov = gaussian_posterior(X, cov)
    root = np.linalg.cholesky(post_cov)

    def exact(seed, size):
        return mean + np.random.default_rng(seed).normal(size=(size, len(mean))) @ root.T

    mmd_check(chains, exact)


@pytest.mark.slow
def test_real_noise_without_clipping_is_exact_vs_nuts():
    """||x_i|| <= 1 bounds every ratio by h = llr_clip * h: nothing is clipped, so
    the penalty method is exact although the noise is real (sigma ~ 1-3)."""
    X, y = make_logistic_data(2000, 3)
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
    mcmc = run(kernel, X, y=y, epsilon=20.0, num_warmup=1500, num_samples=6000)
    kernel = mcmc.sampler  # calibrated
    assert kernel.noise_multiplier > 20  # the noise is not negligible
    sigma_over_h = kernel.noise_multiplier * 2 * kernel.llr_clip
    accept = float(np.mean(mcmc.get_extra_fields()["accept_prob"]))
    assert 0.02 < accept < 0.9, accept
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["w"])

    nuts = MCMC(NUTS(logistic_model), num_warmup=500, num_samples=2000, num_chains=2,
                chain_method="vectorized", progress_bar=False)
    nuts.run(jax.random.PRNGKey(1), X, y=y)
    reference = np.asarray(nuts.get_samples(group_by_chain=True)["w"])
    assert sigma_over_h > 40
    assert_moments_match(chains, reference, log_sd="normal")


def test_proposal_scale_adapts_in_warmup_then_freezes(logistic_data):
    X, y = logistic_data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=1.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=300, num_samples=200, epsilon=1e3, delta=1e-6,
                           reproducible_noise=True, warm_start=0,
                           progress_bar=False)
    mcmc.warmup(jax.random.PRNGKey(0), X, y=y, collect_warmup=True,
                extra_fields=("proposal_scale",))
    warm = np.asarray(mcmc.get_extra_fields()["proposal_scale"])
    assert len(np.unique(warm)) > 100  # tuned throughout warm-up
    adapted = mcmc.post_warmup_state.adapt_state
    proposal_sd = adapted.step_size * np.sqrt(adapted.inverse_mass_matrix)
    posterior_sd = np.asarray(mcmc.get_samples()["w"])[150:].std(0)
    # the poor initial sd 1.0 shrank to the posterior's scale (2.38/sqrt(d) x sd is optimal)
    assert np.all(proposal_sd < 10 * posterior_sd) and np.all(proposal_sd > 0.1 * posterior_sd)
    mcmc.run(jax.random.PRNGKey(1), X, y=y, extra_fields=("proposal_scale",))
    after = np.asarray(mcmc.get_extra_fields()["proposal_scale"])
    assert np.all(after == after[0])


def test_a_stated_proposal_covariance_is_the_initial_one_in_numpyros_names(logistic_data):
    """DPPenalty speaks NumPyro's vocabulary (issue 39): ``inverse_mass_matrix`` is the
    initial proposal covariance, kept when ``adapt_mass_matrix=False``; a wrong shape
    is refused before anything is charged."""
    X, y = logistic_data  # 3 unconstrained parameters
    covariance = np.array([[0.04, 0.01, 0.0], [0.01, 0.09, 0.0], [0.0, 0.0, 0.01]])
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.5,
                           inverse_mass_matrix=covariance, adapt_mass_matrix=False,
                           adapt_step_size=False)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, epsilon=10.0, delta=1e-6,
                           warm_start=0, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    adapted = mcmc.last_state.adapt_state
    np.testing.assert_allclose(adapted.inverse_mass_matrix, covariance, rtol=1e-6)
    assert float(adapted.step_size) == pytest.approx(0.5)
    bad = ndp.PrivateMCMC(
        ndp.DPPenalty(logistic_model, llr_clip=1.0, inverse_mass_matrix=np.ones(2)),
        num_warmup=1, num_samples=1, epsilon=10.0, delta=1e-6, progress_bar=False)
    with pytest.raises(ValueError, match=r"inverse_mass_matrix.*\(3,\)"):
        bad.run(jax.random.PRNGKey(0), X, y=y)
    assert bad.privacy_spent().num_releases == 0


def test_guided_walk_keeps_direction_on_accept_and_flips_on_reject(logistic_data):
    X, y = logistic_data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05,
                           proposal="guided")
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=300, epsilon=1e3, delta=1e-6,
                           progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y, extra_fields=("direction",))
    direction = np.asarray(mcmc.get_extra_fields()["direction"])
    accepted = np.asarray(mcmc.get_extra_fields()["accepted"])
    changed = (direction[1:] != direction[:-1]).sum(1)
    assert np.all(changed[accepted[1:]] == 0)
    assert np.all(changed[~accepted[1:]] == 1)
    w = np.asarray(mcmc.get_samples()["w"])
    moved = (w[1:] != w[:-1]).sum(1)
    assert np.all(moved <= 1)  # one coordinate at a time
