"""DPMALA (SPEC s6): exactness, privacy accounting, API.

DP-MALA with ``a = 1`` is DP-HMC with one leapfrog step, so it shares DPHMC's
core; these tests check what is MALA's own: the equivalence, the proposal
variance factor ``a`` (its proposal ratio), exactness with fixed step size
and real gradient noise, and the cost of two gradient releases and one LLR
release per iteration.  Tolerances come from the Monte Carlo error as in
``test_hmc.py``, with the helpers both use from ``tests/_support``.
"""

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import logistic_model
from _support.exactness import assert_exact_on_banana, assert_exact_on_spec_gaussian
from _support.releases import counting_release
from _support.running import NEGLIGIBLE, negligible_noise_warnings, run
from _support.stats import moment_errors
from numpyro.infer import init_to_median

import numpyro_dp as ndp
from numpyro_dp.evaluation.models import banana_model, gaussian_model, gaussian_posterior


# ------------------------------------------- 1. exact draws
@pytest.mark.slow
@negligible_noise_warnings
def test_banana_negligible_noise_matches_exact_posterior():
    """SPEC s8 banana (as in test_hmc), adapted step size and diagonal preconditioner.
    MALA follows the curved ridge slowly: the ESS of theta_2 was 0.05-0.2% of
    4 x 40 000 draws (83 to 311 over seeds 0-2, below the 200 the MMD test needs
    for some), hence 4 x 160 000."""
    clip = 1e4
    kernel = ndp.DPMALA(banana_model, step_size=0.01, grad_clip=clip, llr_clip=clip,
                        **NEGLIGIBLE)
    assert_exact_on_banana(kernel, 2000, 160_000, clip)


@pytest.mark.slow
@negligible_noise_warnings
def test_spec_gaussian_negligible_noise_matches_exact_posterior():
    """SPEC s8 Gaussian, d = 10 (condition number ~800), dense preconditioner.

    4000 warm-up iterations: with 1000 the dense mass matrix was learnt too
    roughly for this conditioning, and under jax 0.10.2 / numpyro 0.22 the
    chains' effective size fell to 57 (below the MMD check's 200) at this seed,
    also at c40d0e3, where it had passed."""
    clip = 1e6
    kernel = ndp.DPMALA(gaussian_model, step_size=0.01, grad_clip=clip, llr_clip=clip,
                        dense_mass=True, **NEGLIGIBLE)
    assert_exact_on_spec_gaussian(kernel, 4000, 4000, clip)


def unit_gaussian_model(X):
    """theta ~ N(0, 100^2 I); rows x_i ~ N(theta, I)."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 100.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.Normal(theta, 1.0).to_event(1), obs=X)


@pytest.mark.slow
@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_real_gradient_noise_fixed_step_is_exact(factor):
    """Rows x_i ~ N(theta, I) in 2-D with n = 500: the conjugate posterior is
    N(~xbar, I / n).  |r_i| <= h ||x_i - (theta + theta') / 2|| <= 10 h for every
    row near the posterior, so llr_clip = 10 clips nothing (checked); the gradient
    clip of 1 clips most rows and z_g = 20 adds noise of sd 40 to each gradient.
    With a fixed step size the chain must still target the exact posterior, for
    plain MALA and for a proposal variance factor a != 1 (whose proposal ratio
    K(p_0) / a - K(p_1) / a this checks); the noise lowers the acceptance rate."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(500, 2)).astype(np.float32) + np.float32([0.5, -1.0])
    mean, post_cov = gaussian_posterior(X, np.eye(2))
    assert np.max(np.linalg.norm(X - mean, axis=1)) < 9.0  # nothing clipped near theta
    settings = {"step_size": 0.04 / np.sqrt(factor), "grad_clip": 1.0, "llr_clip": 10.0,
                "proposal_variance_factor": factor, "adapt_step_size": False,
                "adapt_mass_matrix": False}
    init = {"theta": np.tile(mean.astype(np.float32), (4, 1))}
    clean = run(ndp.DPMALA(unit_gaussian_model, **settings, **NEGLIGIBLE), X,
                num_warmup=0, num_samples=200, init_params=init, extra_fields=("accept_prob",))
    kernel = ndp.DPMALA(unit_gaussian_model, **settings, noise_multiplier_grad=20.0,
                        noise_multiplier_llr=1.0)
    mcmc = run(kernel, X, num_warmup=0, num_samples=4000, init_params=init,
               extra_fields=("accept_prob",))
    accept_clean = float(np.mean(clean.get_extra_fields()["accept_prob"]))
    accept_noisy = float(np.mean(mcmc.get_extra_fields()["accept_prob"]))
    assert accept_noisy < accept_clean - 0.1, (accept_noisy, accept_clean)

    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    white = (chains - mean) / np.sqrt(np.diag(post_cov))
    _, sd, se_mean, se_log_sd = moment_errors(white)
    np.testing.assert_array_less(np.abs(white.reshape(-1, 2).mean(0)), 4 * se_mean)
    np.testing.assert_array_less(np.abs(np.log(sd)), 4 * se_log_sd)


@pytest.mark.slow
@negligible_noise_warnings
def test_mala_is_hmc_with_one_step(logistic_data):
    """With a = 1, DPMALA and DPHMC(num_steps=1) are the same chain, bit for bit."""
    X, y = logistic_data
    common = {"grad_clip": 1.0, "llr_clip": 1.0, "noise_multiplier_grad": 3.0,
              "noise_multiplier_llr": 1.0, "init_strategy": init_to_median,
              "target_accept_prob": 0.6}
    # Same key, same noise: reproducible noise (tests only) makes the runs comparable.
    mala = run(ndp.DPMALA(logistic_model, step_size=0.1, **common), X, y=y, num_warmup=20,
               num_samples=30, num_chains=2, reproducible_noise=True)
    hmc = run(ndp.DPHMC(logistic_model, step_size=0.1, num_steps=1, **common), X, y=y,
              num_warmup=20, num_samples=30, num_chains=2, reproducible_noise=True)
    np.testing.assert_array_equal(mala.get_samples()["w"], hmc.get_samples()["w"])
    assert mala.privacy_spent().epsilon == hmc.privacy_spent().epsilon


# ------------------------------------------- 2. privacy accounting
@pytest.mark.slow  # make test-all; test_conformance counts DPMALA's releases in make test
def test_releases_made_equal_releases_charged(monkeypatch, logistic_data):
    """Two gradient releases and one LLR release per iteration, warm-up and every
    chain included; sigma_g = z_g * 2 b_g (in units of the clipped sum)."""
    X, y = logistic_data
    log = counting_release(monkeypatch)
    z_g, z_l, b_g, T = 4.0, 0.5, 0.5, 0.25
    kernel = ndp.DPMALA(logistic_model, step_size=0.05, grad_clip=b_g, llr_clip=1.0,
                        proposal_variance_factor=2.0, noise_multiplier_grad=z_g,
                        noise_multiplier_llr=z_l, temperature=T,
                        init_strategy=init_to_median)
    mcmc = run(kernel, X, y=y, num_warmup=3, num_samples=7, num_chains=2,
               chain_method="sequential")
    kinds = [k for k, _ in log]
    iterations = 2 * (3 + 7)
    assert kinds == [1, 1, 0] * iterations
    assert mcmc.privacy_spent().num_releases == len(log) == 3 * iterations
    sigmas = np.array([s for k, s in log if k == 1])
    np.testing.assert_allclose(sigmas, z_g * 2 * b_g, rtol=1e-5)
    # The same cost as DP-HMC with one leapfrog step.
    hmc = ndp.DPHMC(logistic_model, step_size=0.05, num_steps=1, grad_clip=b_g, llr_clip=1.0,
                    noise_multiplier_grad=z_g, noise_multiplier_llr=z_l)
    assert kernel.per_iteration_event() == hmc.per_iteration_event()


def test_calibration_to_a_budget(logistic_data):
    X, y = logistic_data
    kernel = ndp.DPMALA(logistic_model, step_size=0.05, grad_clip=1.0, llr_clip=1.0,
                        llr_budget_fraction=0.4, init_strategy=init_to_median)
    mcmc = run(kernel, X, y=y, num_warmup=10, num_samples=20, num_chains=2, epsilon=2.0)
    spent = mcmc.privacy_spent()
    assert 2.0 - 1e-2 <= spent.epsilon <= 2.0
    z_g, z_l = mcmc.sampler.noise_multipliers()
    np.testing.assert_allclose(1 / z_l**2 + 2 / z_g**2, 1 / mcmc.sampler.noise_multiplier**2)
    assert spent.num_releases == 2 * 30 * 3
    state = mcmc.last_state
    assert set(state._fields) <= set(ndp.DPMALA.private_safe_fields)
    assert int(state.num_steps[0]) == 1


# ------------------------------------------- 3. API and errors
@pytest.mark.parametrize("bad, match", [
    ({"proposal_variance_factor": 0.0}, "proposal_variance_factor"),
    ({"proposal_variance_factor": float("nan")}, "proposal_variance_factor"),
    ({"grad_clip": -1.0}, "grad_clip"),
    ({"llr_clip": 0.0}, "llr_clip"),
    ({"step_size": 0.0}, "step_size"),
    ({"noise_multiplier_grad": 1.0}, "both"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    kwargs = {"grad_clip": 1.0, "llr_clip": 1.0, **bad}
    with pytest.raises(ValueError, match=match):
        ndp.DPMALA(logistic_model, **kwargs)


def test_num_steps_is_not_an_argument():
    with pytest.raises(TypeError, match="num_steps"):
        ndp.DPMALA(logistic_model, grad_clip=1.0, llr_clip=1.0, num_steps=3)
