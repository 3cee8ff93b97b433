"""MH, PMMH and MHAAR on releases (paper 002, Algorithms 9-11 and 13) against exact posteriors.

The posteriors are computed by quadrature: a Bernoulli proportion from a
Laplace-noised count (the count's binomial law summed exactly), the variance
of a normal from the Laplace- or Gauss-noised sum of |x| under its
central-limit law (the normal-Laplace density in closed form), and the same
variance from rows released one by one with Laplace noise (one integral per
row).  Tolerances are 4 Monte Carlo standard errors, from the chains'
effective sample size.
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
from numpyro_dp.releases.pseudo_marginal import MH, MHAAR, PMMH


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


@pytest.mark.parametrize("kernel, particles", [
    (PMMH, 1), pytest.param(PMMH, 16, marks=pytest.mark.slow), (MHAAR, 2), (MHAAR, 16)])
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


def gaussian_release_model(y, n, sd):
    """The same sum released with Gaussian noise: its likelihood in closed form (eq. 5.1)."""
    theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
    mean, var = n * HALF_NORMAL_MEAN * jnp.sqrt(theta), n * (1 - 2 / np.pi) * theta
    numpyro.sample("y", dist.Normal(mean, jnp.sqrt(var + sd**2)), obs=y)


def test_mh_samples_a_release_with_a_closed_form_likelihood():
    """Algorithm 9 (s5.1.1): n = 100, |x| in [0, 10], Gaussian noise of sd 20."""
    y, n, sd = 118.0, 100, 20.0
    grid = np.linspace(0.05, 8.0, 20001)
    log_post = (stats.norm.logpdf(y, n * HALF_NORMAL_MEAN * np.sqrt(grid),
                                  np.sqrt(n * (1 - 2 / np.pi) * grid + sd**2))
                + stats.lognorm.logpdf(grid, 1.0))
    mcmc = run(MH(gaussian_release_model), y, n, sd)
    check_against(mcmc.get_samples(group_by_chain=True)["theta"], grid,
                  np.exp(log_post - log_post.max()))
    assert set(mcmc.get_samples()) == {"theta"}


def rows_model(y, b):
    """Rows released one by one (s5.1.4): y_t = |x_t| + Laplace(b), x_t ~ N(0, theta),
    the latent rows reparametrised (x_t = sqrt(theta) z_t) as in Algorithm 13."""
    theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Laplace(jnp.abs(z) * jnp.sqrt(theta), b), obs=y)


def rows_model_direct(y, b):
    """The same, with the latent rows drawn at theta (their law depends on it)."""
    theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("rows", y.shape[0]):
        x = numpyro.sample("x", dist.Normal(0.0, jnp.sqrt(theta)))
        numpyro.sample("y", dist.Laplace(jnp.abs(x), b), obs=y)


def rows_posterior(y, b):
    grid = np.linspace(1e-3, 30.0, 6000)
    half = np.linspace(0.0, 9.0, 3001)  # |z| for z ~ N(0, 1), by the trapezoid rule
    weight = 2 * stats.norm.pdf(half) * np.gradient(half)
    log_lik = sum(np.log(stats.laplace.pdf(t, np.sqrt(grid)[:, None] * half, b) @ weight)
                  for t in y)
    log_post = log_lik + stats.lognorm.logpdf(grid, 1.0)
    return grid, np.exp(log_post - log_post.max())


@pytest.mark.parametrize("kernel, model, particles", [
    pytest.param(PMMH, rows_model, 16, marks=pytest.mark.slow), (MHAAR, rows_model, 2),
    pytest.param(MHAAR, rows_model, 16, marks=pytest.mark.slow),
    pytest.param(MHAAR, rows_model_direct, 8, marks=pytest.mark.slow)])
def test_rows_released_one_by_one(kernel, model, particles):
    """n = 20 rows, each |x_t| released with epsilon = 10 (b = 1; |x| bounded by 10):
    the particles are averaged per row (the model's plate), every row keeps its own."""
    rng = np.random.default_rng(0)
    y = np.abs(rng.normal(0, np.sqrt(2.0), 20)) + rng.laplace(0, 1.0, 20)
    site = "z" if model is rows_model else "x"
    mcmc = run(kernel(model, [site], num_particles=particles), jnp.asarray(y), 1.0)
    check_against(mcmc.get_samples(group_by_chain=True)["theta"], *rows_posterior(y, 1.0))
    assert mcmc.get_samples()[site].shape == (40_000, 20)  # a draw of every latent row


def init(kernel, *args):
    return kernel.init(jax.random.PRNGKey(0), 10, None, args, {})


def test_the_row_plate_is_found_or_named():
    y = jnp.ones(5)
    kernel = MHAAR(rows_model, ["z"], num_particles=4)
    init(kernel, y, 1.0)
    assert kernel._split.rows.name == "rows" and kernel._split.rows.size == 5
    kernel = MHAAR(rows_model, ["z"], num_particles=4, row_plate=None)
    init(kernel, y, 1.0)
    assert kernel._split.rows is None
    with pytest.raises(ValueError, match="does not hold every latent and observed"):
        init(MHAAR(rows_model, ["z"], row_plate="data"), y, 1.0)

    def two_plates(y, b):
        theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("groups", 2, dim=-2), numpyro.plate("rows", y.shape[-1]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Laplace(jnp.abs(z) * jnp.sqrt(theta), b), obs=y)

    with pytest.raises(ValueError, match="share the plates"):
        init(MHAAR(two_plates, ["z"]), jnp.ones((2, 5)), 1.0)
    kernel = PMMH(two_plates, ["z"], num_particles=4, row_plate="groups")
    mcmc = run(kernel, jnp.ones((2, 5)), 1.0, num_samples=10)
    assert kernel._split.rows.dim == -2
    assert mcmc.get_samples()["z"].shape == (40, 2, 5)

    def vector_rows(y, b):  # a latent row with an event dimension, picked whole
        theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            numpyro.sample("y", dist.Laplace(jnp.sqrt(theta) * jnp.abs(z).sum(-1), b), obs=y)

    particles = {"z": jnp.arange(3 * 5 * 2.0).reshape(3, 5, 2)}
    kernel = MHAAR(vector_rows, ["z"], num_particles=3)
    init(kernel, jnp.ones(5), 1.0)
    picked = kernel._split.select(particles, jnp.array([0, 2, 1, 1, 0]))
    np.testing.assert_array_equal(picked["z"], particles["z"][jnp.array([0, 2, 1, 1, 0]),
                                                              jnp.arange(5)])


@pytest.mark.slow  # make test-all: a mixing comparison (18 s)
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
    with pytest.raises(ValueError, match="Name the latent statistic.*use ndp.MH"):
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
