"""DPMinibatchPenalty (Räisä 2020, s4.1): sensitivity, target, accounting, errors."""

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.stats import assert_moments_match

import numpyro_dp as ndp
from numpyro_dp.accounting import epsilon_spent
from numpyro_dp.kernels.penalty import batch_llr


def mean_model(x):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(theta, 1.0), obs=x)


def test_release_moves_by_at_most_the_combined_sensitivity_and_attains_it():
    """Substituting one row moves one clipped ratio anywhere in [-c, c]; the release
    lambda* - sigma_b^2 / 2 moves by at most Delta_lambda + Delta_half_var (SPEC s3.1),
    with equality at R* = (b - 1) c, x: -c -> c."""
    b, c, scale = 50, 0.3, 7.0
    rng = np.random.default_rng(0)
    value = jax.jit(lambda r: batch_llr(r, c, scale, 2.0))
    bound = float(value(jnp.zeros(b))[1])
    # SPEC s3.1's sensitivity plus twice the bound on float32 rounding (~2 b u of it)
    assert bound == pytest.approx(2 * scale * c + 2 * (b - 1) / b * scale**2 * c**2, rel=1e-4)
    worst = value(jnp.full(b, c))[0] - value(jnp.full(b, c).at[0].set(-c))[0]
    assert abs(float(worst)) == pytest.approx(bound, rel=1e-4)  # attained, up to rounding
    for _ in range(200):
        r = jnp.asarray(rng.uniform(-c, c, b) * rng.choice([0.2, 1.0]))
        r2 = r.at[rng.integers(b)].set(rng.uniform(-c, c))
        assert abs(float(value(r)[0] - value(r2)[0])) <= bound * (1 + 1e-5)


@pytest.mark.slow
def test_tempered_gaussian_mean_matches_closed_form():
    """x ~ N(theta, 1), prior N(0, 10^2), T = n0 / n: tempered posterior
    N(n0 xbar / (n0 + 0.01), 1 / (n0 + 0.01)).  llr_clip = 8 clips no ratio
    (|r_j| <= h (|x_j - theta| + h) and |x| < 6); the noise is negligible, so
    this checks the batch estimate with its CLT correction."""
    n, n0, b = 20_000, 100.0, 500
    x = np.random.default_rng(0).normal(1.0, 1.0, n).astype(np.float32)
    kernel = ndp.DPMinibatchPenalty(mean_model, llr_clip=8.0, proposal_scale=0.1, batch_size=b,
                           temperature=n0 / n, noise_multiplier=1e-3)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=500, num_samples=2000, num_chains=4, delta=1e-6,
                           reproducible_noise=True,
                           chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), x)
    draws = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])[..., None]
    precision = n0 + 1e-2
    exact = np.random.default_rng(1).normal(n0 * x.mean() / precision, precision**-0.5,
                                            (4, 20000, 1))
    assert_moments_match(draws, exact, log_sd="normal")


def test_calibrated_run_is_charged_with_wbk_amplification():
    n, b = 5000, 100
    x = np.random.default_rng(0).normal(size=n).astype(np.float32)
    kernel = ndp.DPMinibatchPenalty(mean_model, llr_clip=8.0, proposal_scale=0.05, batch_size=b,
                           temperature=100 / n)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=30, num_samples=70, num_chains=2, epsilon=1.0,
                           delta=1e-6, progress_bar=False, chain_method="vectorized",
                           warm_start=0)
    mcmc.run(jax.random.PRNGKey(0), x)
    spent = mcmc.privacy_spent()
    z = mcmc.sampler.noise_multiplier
    event = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(n, b, dpa.GaussianDpEvent(z)), 200)
    assert spent.epsilon == epsilon_spent(event, 1e-6) and 0.99 < spent.epsilon <= 1.0
    assert spent.accountant == "rdp"
    # the same z without subsampling would cost far more
    assert epsilon_spent(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 200), 1e-6) > 3


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 1}, "integer >= 2"),
    ({"batch_size": 10, "neighbourhood": "add_remove"}, "substitute"),
    ({"batch_size": 6000}, "exceeds the number of rows"),
])
def test_bad_batch_size_raises_clear_errors(kwargs, match):
    x = np.zeros(5000, np.float32)
    with pytest.raises(ValueError, match=match):
        kernel = ndp.DPMinibatchPenalty(mean_model, llr_clip=1.0, **kwargs)
        ndp.PrivateMCMC(kernel, num_warmup=1, num_samples=1, epsilon=1.0, delta=1e-6,
                        progress_bar=False).run(jax.random.PRNGKey(0), x)


def test_float64_run(x64):
    x = np.random.default_rng(0).normal(1.0, 1.0, 5000)
    kernel = ndp.DPMinibatchPenalty(mean_model, llr_clip=8.0, proposal_scale=0.05, batch_size=200,
                           temperature=100 / 5000, noise_multiplier=1e-3)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=100, num_samples=200, num_chains=2, delta=1e-6,
                           reproducible_noise=True,
                           chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), x)
    draws = np.asarray(mcmc.get_samples()["theta"])
    assert draws.dtype == np.float64 and np.all(np.isfinite(draws))
    assert abs(draws.mean() - x.mean()) < 0.5
