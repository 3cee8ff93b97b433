"""DPHMC (SPEC s5): exactness, privacy accounting, API, privacy invariants.

Statistical tests have fixed seeds; their tolerances come from the Monte Carlo
error, not from tuning: MMDs are compared with the spread of MMDs between
independent exact samples of the chain's effective size, moments with their
standard errors from effective sample sizes (ESS of the draws for means, ESS
of the squared deviations for standard deviations; ESS is capped at the number
of draws, since HMC's antithetic draws make larger estimates fragile).

"Negligible noise" means a tiny noise multiplier: sigma = z * sensitivity, so
z = 1e-8 with large clips is an (almost) noise-free HMC with fixed L.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import BANANA_N, BANANA_ROW_VAR, logistic_model, make_logistic_data
from _support.exactness import assert_exact_on_banana, assert_exact_on_spec_gaussian
from _support.releases import counting_release, patch_releases
from _support.running import NEGLIGIBLE, negligible_noise_warnings, run
from _support.stats import assert_moments_match
from numpyro.infer import MCMC, NUTS, init_to_median
from scipy.optimize import brentq
from scipy.special import erfc

import numpyro_dp as ndp
import numpyro_dp.primitives.release as gate
from numpyro_dp.evaluation.models import (
    banana_data,
    banana_model,
    gaussian_model,
)
from numpyro_dp.kernels.hmc import split_noise_multiplier


def nuts_reference(model, *args, num_samples=2000, seed=1, **kwargs):
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=num_samples, num_chains=2,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    return mcmc.get_samples(group_by_chain=True)


# ------------------------------------------- 1. negligible noise: exact draws
@pytest.mark.slow
@negligible_noise_warnings
def test_banana_negligible_noise_matches_exact_posterior():
    clip = 1e4
    kernel = ndp.DPHMC(banana_model, step_size=0.01, num_steps=10, grad_clip=clip,
                       llr_clip=clip, **NEGLIGIBLE)
    assert_exact_on_banana(kernel, 300, 1500, clip)


@pytest.mark.slow
@negligible_noise_warnings
def test_spec_gaussian_negligible_noise_matches_exact_posterior():
    """Dense mass matrix adapted in warm-up.  Step-size jitter avoids the resonance
    of a fixed-length trajectory on the adapted, nearly isotropic target (L eta ~ 2 pi
    gives ESS ~ 20 without it)."""
    clip = 1e6
    kernel = ndp.DPHMC(gaussian_model, step_size=0.01, num_steps=12, grad_clip=clip,
                       llr_clip=clip, dense_mass=True, step_size_jitter=0.5, **NEGLIGIBLE)
    assert_exact_on_spec_gaussian(kernel, 500, 1000, clip)


# ------------------------------------ 2. constrained scale: matches NUTS
def regression_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, sigma), obs=y)


def regression_data(n=500, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    y = X @ np.array([0.5, -1.0]) + 0.3 + 0.5 * rng.normal(size=n)
    return X.astype(np.float32), y.astype(np.float32)


def flat_draws(samples):
    """(chains, draws, dim) from a dict of constrained sites."""
    return np.concatenate(
        [np.asarray(v).reshape(v.shape[0], v.shape[1], -1) for _, v in sorted(samples.items())],
        axis=-1,
    )


@pytest.mark.slow
@negligible_noise_warnings
def test_regression_with_constrained_scale_matches_nuts():
    """sigma ~ HalfNormal is sampled as log sigma (prior with Jacobian).  Step-size
    jitter: without it the adapted trajectory length L eta comes out near 2 pi on
    this nearly Gaussian posterior and one coordinate has ESS ~ 15 of 6000."""
    X, y = regression_data()
    kernel = ndp.DPHMC(regression_model, step_size=0.01, num_steps=10, grad_clip=1e4,
                       llr_clip=1e4, step_size_jitter=0.5, **NEGLIGIBLE)
    mcmc = run(kernel, X, y=y, num_warmup=500, num_samples=1500)
    samples = mcmc.get_samples(group_by_chain=True)
    assert np.all(np.asarray(samples["sigma"]) > 0)
    reference = nuts_reference(regression_model, X, y=y)
    assert_moments_match(flat_draws(samples), flat_draws(reference))


# --------------------- 3. real gradient noise, no LLR clipping: still exact
@pytest.mark.slow
def test_real_gradient_noise_without_llr_clipping_is_exact_vs_nuts():
    """||x_i|| <= 1 gives |r_i| <= ||x_i|| h <= llr_clip h and ||grad l_i|| <= grad_clip:
    nothing is clipped, so whatever the gradient noise the chain is exact (paper 004
    Thm 3.3); the noise only lowers the acceptance rate.

    Fixed step size and identity mass so that the drop in acceptance is visible (an
    adapted step size would shrink instead).  The chains start from NUTS draws (a
    user-given init): from far away the LLR penalty sigma_l^2 / 2, which grows like
    h^2 with the long early trajectories, rejects almost everything for hundreds of
    iterations."""
    X, y = make_logistic_data(2000, 3)
    reference = np.asarray(nuts_reference(logistic_model, X, y=y)["w"])
    init = {"w": reference[:, -2:].reshape(4, 3)}  # two draws of each NUTS chain
    settings = {"step_size": 0.02, "num_steps": 10, "grad_clip": 1.0, "llr_clip": 1.0,
                "adapt_step_size": False, "adapt_mass_matrix": False}

    clean = run(ndp.DPHMC(logistic_model, **settings, **NEGLIGIBLE), X, y=y,
                num_warmup=0, num_samples=100, init_params=init, extra_fields=("accept_prob",))
    kernel = ndp.DPHMC(logistic_model, **settings, noise_multiplier_grad=10.0,
                       noise_multiplier_llr=1.0)
    mcmc = run(kernel, X, y=y, num_warmup=200, num_samples=1500, init_params=init,
               extra_fields=("accept_prob",))

    # sigma_g = 20: each kick adds N(0, (eta sigma_g)^2) = N(0, 0.4^2) to unit-sd momenta.
    accept_clean = float(np.mean(clean.get_extra_fields()["accept_prob"]))
    accept_noisy = float(np.mean(mcmc.get_extra_fields()["accept_prob"]))
    assert accept_noisy < accept_clean - 0.3, (accept_noisy, accept_clean)
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["w"])
    assert_moments_match(chains, reference)


# ------------------------------------------- 4. SPEC s2 check figure
def closed_form_epsilon(M, delta):
    """SPEC s2: epsilon of total zCDP M (tight Gaussian composition) at delta."""
    def log_delta_gap(eps):
        s = 2.0 * np.sqrt(M)
        return 0.5 * (erfc((eps - M) / s) - np.exp(eps) * erfc((eps + M) / s)) - delta

    return brentq(log_delta_gap, 0.0, 100.0, xtol=1e-10)


@pytest.mark.slow
def test_spec_check_figure_banana_reference_run():
    """SPEC s2/s8: DP-HMC on the reference banana, z_l = 31.6, z_g = 173.9, L = 25,
    4 chains x 620 iterations, no warm-up: epsilon = 12.00 at delta = 1e-6 (the
    reference's 0.1 / n).  Epsilon does not depend on n at a given delta, so the run
    uses the n = 1000 banana with the reference's posterior (100x cheaper)."""
    X = banana_data(jax.random.PRNGKey(1), BANANA_N, row_var=BANANA_ROW_VAR)
    kernel = ndp.DPHMC(banana_model, step_size=0.006, num_steps=25, grad_clip=0.05,
                       llr_clip=0.1, noise_multiplier_grad=173.9, noise_multiplier_llr=31.6)
    mcmc = run(kernel, X, row_var=BANANA_ROW_VAR, num_warmup=0, num_samples=620,
               epsilon=12.0, extra_fields=("accept_prob",))
    spent = mcmc.privacy_spent()
    assert spent.delta == 1e-6
    assert 11.95 <= spent.epsilon <= 12.00, spent
    iterations = 4 * 620
    assert spent.num_releases == iterations * (25 + 2)
    M = iterations * (1 / (2 * 31.6**2) + 26 / (2 * 173.9**2))
    assert abs(spent.epsilon - closed_form_epsilon(M, 1e-6)) < 1e-2
    assert [(e.num_chains, e.num_iterations) for e in spent.ledger] == [(4, 620)]
    # The run itself is a working sampler (not frozen, finite).
    theta = np.asarray(mcmc.get_samples()["theta"])
    assert theta.shape == (iterations, 2) and np.all(np.isfinite(theta))
    assert float(np.mean(mcmc.get_extra_fields()["accept_prob"])) > 0.1


# ------------------------------------------- 5. releases made == releases charged
@pytest.mark.slow
def test_releases_made_equal_releases_charged(monkeypatch):
    X, y = make_logistic_data(200, 2)
    L, z_g, z_l, b_g, b_l, T = 3, 2.0, 0.5, 0.5, 1.0, 0.5
    log = counting_release(monkeypatch)
    kernel = ndp.DPHMC(logistic_model, step_size=0.05, num_steps=L, grad_clip=b_g,
                       llr_clip=b_l, noise_multiplier_grad=z_g, noise_multiplier_llr=z_l,
                       temperature=T, init_strategy=init_to_median, adapt_step_size=False)
    chains, warmup, samples = 2, 3, 12
    mcmc = run(kernel, X, y=y, num_warmup=warmup, num_samples=samples, num_chains=chains,
               chain_method="sequential", extra_fields=("accepted",))
    iterations = chains * (warmup + samples)
    kinds = [k for k, _ in log]
    assert kinds.count(1) == iterations * (L + 1)
    assert kinds.count(0) == iterations
    assert mcmc.privacy_spent().num_releases == len(log)
    # Order within an iteration: L + 1 gradients, then the LLR.
    assert all(kinds[i * (L + 2): (i + 1) * (L + 2)] == [1] * (L + 1) + [0]
               for i in range(iterations))
    # Noise scales of the clipped sums (T multiplies after the release):
    # sigma_g = z_g 2 b_g, sigma_l = z_l 2 b_l h (h known when accepted), each up
    # to the rounding charged with it (clipped_sum_sensitivity: < 1e-5 here).
    sigmas = np.array([s for _, s in log])
    np.testing.assert_allclose(sigmas[np.array(kinds) == 1], z_g * 2 * b_g, rtol=1e-5)
    llr_sigma = sigmas[np.array(kinds) == 0].reshape(chains, warmup + samples)[:, warmup:]
    w = np.asarray(mcmc.get_samples(group_by_chain=True)["w"])
    accepted = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["accepted"])
    h = np.linalg.norm(np.diff(w, axis=1), axis=-1)
    moved = accepted[:, 1:]
    assert moved.sum() >= 5
    np.testing.assert_allclose(llr_sigma[:, 1:][moved], z_l * 2 * b_l * h[moved], rtol=1e-4)


# ------------------------------------------- 6. API and errors
def kernel_kwargs(**overrides):
    return {"grad_clip": 1.0, "llr_clip": 1.0, **overrides}


@pytest.mark.parametrize("bad, match", [
    ({"noise_multiplier_grad": 1.0}, "both"),
    ({"noise_multiplier_llr": 1.0}, "both"),
    ({"noise_multiplier_grad": 0.0, "noise_multiplier_llr": 1.0}, "noise_multiplier_grad"),
    ({"noise_multiplier_grad": 1.0, "noise_multiplier_llr": -1.0}, "noise_multiplier_llr"),
    ({"num_steps": 0}, "num_steps"),
    ({"num_steps": 2.5}, "num_steps"),
    ({"llr_budget_fraction": 0.0}, "llr_budget_fraction"),
    ({"llr_budget_fraction": 1.0}, "llr_budget_fraction"),
    ({"grad_clip": 0.0}, "grad_clip"),
    ({"grad_clip": float("inf")}, "grad_clip"),
    ({"llr_clip": -1.0}, "llr_clip"),
    ({"step_size": 0.0}, "step_size"),
    ({"step_size_jitter": 1.0}, "step_size_jitter"),
    ({"step_size_jitter": -0.1}, "step_size_jitter"),
    ({"target_accept_prob": 1.0}, "target_accept_prob"),
    ({"grad_route": "nope"}, "grad_route"),
    ({"dense_mass": [("w",)]}, "dense_mass"),
    ({"inverse_mass_matrix": {("w",): np.ones(3)}}, "inverse_mass_matrix"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        ndp.DPHMC(logistic_model, **kernel_kwargs(**bad))


@pytest.mark.parametrize("dense, shape", [(False, (2,)), (False, (3, 3)), (True, (3,))])
def test_bad_inverse_mass_matrix_shape_raises_before_charging(logistic_data, dense, shape):
    X, y = logistic_data  # 3 unconstrained parameters
    kernel = ndp.DPHMC(logistic_model, **kernel_kwargs(), inverse_mass_matrix=np.ones(shape),
                       dense_mass=dense, noise_multiplier_grad=1.0, noise_multiplier_llr=1.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=1, num_samples=1, delta=1e-6, progress_bar=False)
    expected = (3, 3) if dense else (3,)
    with pytest.raises(ValueError, match=r"inverse_mass_matrix.*" + re.escape(str(expected))):
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert mcmc.privacy_spent().num_releases == 0


def test_runner_calibration_splits_the_budget(logistic_data):
    X, y = logistic_data
    L, fraction = 5, 0.3
    kernel = ndp.DPHMC(logistic_model, step_size=0.02, num_steps=L, **kernel_kwargs(),
                       llr_budget_fraction=fraction, init_strategy=init_to_median)
    assert kernel.noise_multiplier is None
    mcmc = run(kernel, X, y=y, num_warmup=5, num_samples=10, num_chains=2, epsilon=4.0)
    assert mcmc.sampler is kernel
    z = kernel.noise_multiplier
    z_g, z_l = kernel.noise_multipliers()
    assert (z_g, z_l) == split_noise_multiplier(z, L, fraction)
    assert (kernel.noise_multiplier_grad, kernel.noise_multiplier_llr) == (z_g, z_l)
    np.testing.assert_allclose(1 / z_l**2, fraction / z**2, rtol=1e-12)
    np.testing.assert_allclose((L + 1) / z_g**2, (1 - fraction) / z**2, rtol=1e-12)
    spent = mcmc.privacy_spent()
    assert 4.0 - 1e-2 <= spent.epsilon <= 4.0
    assert spent.num_releases == 2 * 15 * (L + 2)
    assert set(spent.noise_multipliers) == {z_g, z_l}


def test_explicit_noise_multipliers_are_used_as_given():
    kernel = ndp.DPHMC(logistic_model, num_steps=4, **kernel_kwargs(),
                       noise_multiplier_grad=30.0, noise_multiplier_llr=3.0)
    assert kernel.noise_multipliers() == (30.0, 3.0)
    # The per-iteration multiplier has the zCDP of one LLR and L + 1 gradient releases.
    np.testing.assert_allclose(1 / kernel.noise_multiplier**2, 1 / 9 + 5 / 900)
    # The runner charges the stated pair, not the combined z split afresh (the ledger
    # once reported z_llr 0.82 and z_grad 1.15 for a stated 1 and 1; issue 36's audit).
    event = kernel.per_iteration_event(kernel.noise_multiplier)
    assert set(ndp.accounting.noise_multipliers(event)) == {30.0, 3.0}


@pytest.fixture(scope="module")
def small_run():
    X, y = make_logistic_data(300, 2)
    kernel = ndp.DPHMC(logistic_model, step_size=0.05, num_steps=5, grad_clip=1.0,
                       llr_clip=1.0, step_size_jitter=0.4, adapt_step_size=False,
                       noise_multiplier_grad=5.0, noise_multiplier_llr=1.0,
                       init_strategy=init_to_median)
    return run(kernel, X, y=y, num_warmup=20, num_samples=100, num_chains=2,
               extra_fields=("accept_prob", "step_size", "diverging"))


def test_extra_fields_summary_and_inference_data(small_run, capsys):
    mcmc = small_run
    fields = mcmc.get_extra_fields(group_by_chain=True)
    assert set(fields) >= {"accept_prob", "step_size", "diverging", "accepted"}
    accept = np.asarray(fields["accept_prob"])
    assert accept.shape == (2, 100) and np.all((accept >= 0) & (accept <= 1))
    assert np.asarray(fields["diverging"]).dtype == bool
    mcmc.print_summary()
    out = capsys.readouterr().out
    assert "w[0]" in out and "Number of divergences" in out
    idata = ndp.to_inference_data(mcmc)
    assert idata.posterior["w"].shape == (2, 100, 2)
    assert "acceptance_rate" in idata.sample_stats
    assert not hasattr(idata, "observed_data") and not hasattr(idata, "log_likelihood")
    assert idata.attrs["num_releases"] == 2 * 120 * 7
    with pytest.raises(ValueError, match="private-safe"):
        mcmc.run(jax.random.PRNGKey(1), extra_fields=("potential_energy",))


def test_step_size_jitter_stays_in_band(small_run):
    eta, j = 0.05, 0.4
    steps = np.asarray(small_run.get_extra_fields(group_by_chain=True)["step_size"])
    assert np.all(steps >= eta * (1 - j) * (1 - 1e-6))
    assert np.all(steps <= eta * (1 + j) * (1 + 1e-6))
    assert len(np.unique(steps[0])) == steps.shape[1]  # a new step every iteration
    assert not np.allclose(steps[0], steps[1])  # randomly shifted per chain
    # Halton points fill the band evenly: the mean step is eta up to O(log N / N).
    np.testing.assert_allclose(steps.mean(1), eta, rtol=0.05)


@pytest.mark.slow
@negligible_noise_warnings
def test_float64_run(x64, logistic_data):
    X, y = logistic_data
    kernel = ndp.DPHMC(logistic_model, step_size=0.02, num_steps=5, **kernel_kwargs(),
                       init_strategy=init_to_median, **NEGLIGIBLE)
    mcmc = run(kernel, X.astype(np.float64), y=y.astype(np.float64), num_warmup=50,
               num_samples=50, num_chains=2, extra_fields=("accept_prob",))
    w = mcmc.get_samples()["w"]
    assert w.dtype == jnp.float64 and np.all(np.isfinite(w))
    assert mcmc.last_state.accept_prob.dtype == jnp.float64
    assert float(np.mean(mcmc.get_extra_fields()["accept_prob"])) > 0.5


# ------------------------------------------- 7. privacy invariants of the state
def test_state_holds_only_private_safe_fields(small_run):
    state = small_run.last_state
    assert isinstance(state, ndp.DPHMCState)
    assert state._fields == ndp.DPHMCState._fields
    assert set(state._fields) <= set(ndp.DPHMC.private_safe_fields)
    assert not {"potential_energy", "z_grad", "energy", "r"} & set(state._fields)


@pytest.mark.slow
def test_everything_published_is_a_function_of_the_releases(monkeypatch):
    """With every Gaussian release replaced by a data-free constant, two different
    data sets of the same size must give bit-identical draws, extra fields and
    final state: nothing else derived from the data reaches the output (an exact
    potential energy or gradient in the state, or an accept test that used the
    un-noised LLR, would make them differ).  Control: with noise-free releases of
    the true values the outputs do differ."""
    original = gate.grid_release

    def outputs(release):
        patch_releases(monkeypatch, release)
        leaves = []
        for seed in (0, 1):
            X, y = make_logistic_data(100, 2, seed=seed)
            kernel = ndp.DPHMC(logistic_model, step_size=0.05, num_steps=3, **kernel_kwargs(),
                               noise_multiplier_grad=1.0, noise_multiplier_llr=1.0)
            mcmc = run(kernel, X, y=y, num_warmup=10, num_samples=10, num_chains=2,
                       extra_fields=("accept_prob", "step_size", "diverging", "adapt_state"))
            out = (mcmc.get_samples(), mcmc.get_extra_fields(), mcmc.last_state)
            leaves.append([np.asarray(x) for x in jax.tree_util.tree_leaves(out)])
        return leaves

    first, second = outputs(lambda key, hi, lo, sigma, quantum, noise="gaussian":
                            jnp.ones_like(hi))
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    first, second = outputs(lambda key, hi, lo, sigma, quantum, noise="gaussian":
                            original(key, hi, lo, 0.0 * sigma, quantum))
    assert not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
