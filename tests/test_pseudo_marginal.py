"""PMMH and MHAAR on releases (paper 002, Algorithms 10 and 11) against exact posteriors.

The posteriors are computed by quadrature: a Bernoulli proportion from a
Laplace-noised count (the count's binomial law summed exactly), and the
variance of a normal from the Laplace-noised sum of |x| under its central-limit
law (the normal-Laplace density in closed form).  Tolerances are 4 Monte Carlo
standard errors, from the chains' effective sample size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC
from scipy import stats

from numpyro_dp.releases.fisher import _normal_laplace_logpdf
from numpyro_dp.releases.pseudo_marginal import MHAAR, PMMH


def count_model(y, n, b):
    theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    count = numpyro.sample("count", dist.Binomial(n, theta))  # the latent statistic
    numpyro.sample("y", dist.Laplace(count, b), obs=y)  # the release's noise


def count_posterior(y, n, b):
    grid = np.linspace(1e-5, 1 - 1e-5, 20001)
    c = np.arange(n + 1)
    lik = (stats.binom.pmf(c[None, :], n, grid[:, None])
           * np.exp(-np.abs(y - c) / b)[None, :]).sum(1)
    return grid, lik


HALF_NORMAL_MEAN = np.sqrt(2 / np.pi)  # E|x| for x ~ N(0, 1)


def variance_model(y, n, b):
    """X ~ N(0, theta), s(x) = |x|: the sum's central-limit law, Laplace noise."""
    theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
    mean, var = HALF_NORMAL_MEAN * jnp.sqrt(theta), (1 - 2 / np.pi) * theta
    total = numpyro.sample("total", dist.Normal(n * mean, jnp.sqrt(n * var)))
    numpyro.sample("y", dist.Laplace(total, b), obs=y)


def variance_posterior(y, n, b):
    grid = np.linspace(0.2, 6.0, 20001)
    mean, var = n * HALF_NORMAL_MEAN * np.sqrt(grid), n * (1 - 2 / np.pi) * grid
    log_lik = np.asarray(_normal_laplace_logpdf(y, mean, var, b))
    log_post = log_lik + stats.lognorm.logpdf(grid, 1.0)
    return grid, np.exp(log_post - log_post.max())


def check_against(draws, grid, density):
    density = density / np.trapezoid(density, grid)
    mean = np.trapezoid(grid * density, grid)
    sd = np.sqrt(np.trapezoid((grid - mean) ** 2 * density, grid))
    ess = float(effective_sample_size(np.asarray(draws)))
    got = np.asarray(draws).ravel()
    assert ess > 400, ess  # the chains mixed
    assert abs(got.mean() - mean) < 4 * sd / np.sqrt(ess), (got.mean(), mean, ess)
    assert abs(got.std() - sd) < 4 * sd / np.sqrt(2 * ess), (got.std(), sd, ess)


def run(kernel, *args, num_samples=10_000, seed=0):
    mcmc = MCMC(kernel, num_warmup=1000, num_samples=num_samples, num_chains=4,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *args)
    return mcmc


@pytest.mark.parametrize("kernel, particles", [(PMMH, 1), (PMMH, 16), (MHAAR, 2), (MHAAR, 16)])
def test_a_proportion_from_a_noised_count(kernel, particles):
    """n = 100, epsilon = 0.1 (b = 10): 1 and many particles, the same posterior."""
    args = (31.7, 100, 10.0)
    mcmc = run(kernel(count_model, ["count"], num_particles=particles), *args)
    check_against(mcmc.get_samples(group_by_chain=True)["theta"], *count_posterior(*args))


@pytest.mark.parametrize("kernel, particles", [(PMMH, 32), (MHAAR, 8)])
def test_a_variance_from_a_noised_sum_of_absolute_values(kernel, particles):
    """n = 100, |x| in [0, 10] released with epsilon = 2 (b = 5), theta = 2."""
    rng = np.random.default_rng(3)
    x = rng.normal(0, np.sqrt(2.0), 100)
    y = float(np.sum(np.abs(x)) + rng.laplace(0, 5.0))
    mcmc = run(kernel(variance_model, ["total"], num_particles=particles), y, 100, 5.0)
    check_against(mcmc.get_samples(group_by_chain=True)["theta"],
                  *variance_posterior(y, 100, 5.0))


def test_mhaar_mixes_better_than_pmmh_at_the_same_particles():
    """The thesis's Table 6.1: MHAAR's autocorrelation is lower (a sharper release,
    epsilon = 0.5, where PMMH's estimate is noisy)."""
    args = (31.7, 100, 2.0)
    ess = {}
    for kernel in (PMMH, MHAAR):
        mcmc = run(kernel(count_model, ["count"], num_particles=4), *args, num_samples=5000)
        ess[kernel.__name__] = float(effective_sample_size(
            np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])))
    assert ess["MHAAR"] > 3 * ess["PMMH"], ess


def test_bad_models_and_arguments_are_refused():
    args = (31.7, 100, 10.0)
    with pytest.raises(ValueError, match="not sample sites"):
        run(PMMH(count_model, ["cnt"]), *args, num_samples=1)
    with pytest.raises(ValueError, match="Name the latent statistic"):
        PMMH(count_model, [])
    with pytest.raises(ValueError, match="num_particles >= 2"):
        MHAAR(count_model, ["count"], num_particles=1)

    def unobserved(y, n, b):
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        numpyro.sample("count", dist.Binomial(n, theta))

    with pytest.raises(ValueError, match="no observed site"):
        run(PMMH(unobserved, ["count"]), *args, num_samples=1)

    def discrete(y, n, b):
        k = numpyro.sample("k", dist.Poisson(3.0))
        count = numpyro.sample("count", dist.Binomial(n, 0.3))
        numpyro.sample("y", dist.Laplace(count + k, b), obs=y)

    with pytest.raises(ValueError, match="discrete"):
        run(PMMH(discrete, ["count"]), *args, num_samples=1)


def test_a_release_is_observed_through_its_likelihood():
    """Release.likelihood: the mechanism's noise law at the release's scale, so a model
    observes ``release.value`` without restating the noise."""
    import numpyro_dp as ndp

    key = jax.random.PRNGKey(0)
    laplace = ndp.mechanisms.laplace_mechanism(key, 12.0, 1.0, epsilon=0.5,
                                               reproducible_noise=True)
    law = laplace.likelihood(10.0)
    assert isinstance(law.base_dist if hasattr(law, "base_dist") else law, dist.Laplace)
    assert float(law.log_prob(laplace.value)) == pytest.approx(
        float(stats.laplace.logpdf(laplace.value, 10.0, laplace.scale)), rel=1e-6)
    gauss = ndp.mechanisms.gaussian_mechanism(key, np.array([3.0, 4.0]), 1.0, epsilon=1.0,
                                              delta=1e-6, reproducible_noise=True)
    law = gauss.likelihood(jnp.array([3.0, 4.0]))
    assert law.event_shape == (2,)
    assert float(law.log_prob(gauss.value)) == pytest.approx(
        float(stats.norm.logpdf(gauss.value, [3.0, 4.0], gauss.scale).sum()), rel=1e-6)
    gram = ndp.mechanisms.gram_mechanism(key, np.ones((5, 2)) / 2, 1.0, epsilon=1.0,
                                         delta=1e-6, reproducible_noise=True)
    with pytest.raises(ValueError, match="not a statistic plus independent noise"):
        gram.likelihood(jnp.eye(2))

    def model(n):  # the count example, the release observed through its likelihood
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        count = numpyro.sample("count", dist.Binomial(n, theta))
        numpyro.sample("y", laplace.likelihood(count), obs=laplace.value)

    mcmc = run(MHAAR(model, ["count"], num_particles=8), 100, num_samples=5000)
    check_against(mcmc.get_samples(group_by_chain=True)["theta"],
                  *count_posterior(float(laplace.value), 100, laplace.scale))
    # The draws are of the joint posterior (theta, count): ArviZ can replay the model.
    import arviz as az

    posterior = az.from_numpyro(mcmc).posterior
    assert {"theta", "count"} <= set(posterior.data_vars)
    assert np.all((posterior["count"] >= 0) & (posterior["count"] <= 100))
