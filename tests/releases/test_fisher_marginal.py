"""Fisher information of a release from its exact marginal (paper 002 s4.2.3, Algorithm 7).

:func:`marginal_release_fisher` is a Monte Carlo estimate; each check allows
4 of its own standard errors.  Against closed forms where the release's law
is exact (a sum of normal rows: Gaussian noise, Laplace noise), against the
central-limit closed form for a sum of ``|x|`` at moderate ``n``, and its two
forms (reparametrised rows; the thesis's score of the rows) against each
other on a median released with smooth-sensitivity Laplace noise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest
from jax.scipy.special import gammaln

from numpyro_dp.releases.fisher import (
    Statistic,
    gaussian_release_fisher,
    marginal_release_fisher,
)
from numpyro_dp.releases.smooth_sensitivity import (
    median_smooth_sensitivity,
    median_statistic,
    smooth_sensitivity_params,
)

N_ROWS = 20
COVARIATE = jnp.linspace(-1.0, 1.0, N_ROWS)  # public, fixed


def standard_normal_rows(key, theta):
    """The reparametrising noise: its law is free of theta."""
    return jax.random.normal(key, (N_ROWS,))


def regression_release(theta, z, noise_sd=3.0):
    """x_i = theta_0 + theta_1 c_i + z_i; release (sum x_i, sum c_i x_i) + N(0, noise_sd^2 I)."""
    x = theta[0] + theta[1] * COVARIATE + z
    return dist.Normal(jnp.stack([jnp.sum(x), jnp.sum(COVARIATE * x)]), noise_sd).to_event(1)


def within(estimate, expected, k=4.0):
    err = np.abs(np.asarray(estimate.fisher) - np.asarray(expected))
    assert np.all(err <= k * estimate.stderr), (estimate.fisher, expected, estimate.stderr)


def test_vector_theta_exact_gaussian_release():
    """Exact: the release is N(J theta, J + sigma^2 I), J = [[n, sum c], [sum c, sum c^2]],
    so F = J (J + sigma^2 I)^-1 J."""
    c = np.asarray(COVARIATE, np.float64)
    J = np.array([[N_ROWS, c.sum()], [c.sum(), (c**2).sum()]])
    expected = J @ np.linalg.inv(J + 9.0 * np.eye(2)) @ J
    est = marginal_release_fisher(jax.random.PRNGKey(0), standard_normal_rows,
                                  regression_release, jnp.array([0.3, -0.5]),
                                  num_releases=1000, num_particles=128)
    assert est.fisher.shape == est.stderr.shape == (2, 2)
    assert est.ess.shape == (1000,) and np.all((est.ess >= 1) & (est.ess <= 128))
    np.testing.assert_allclose(est.fisher, est.fisher.T)
    within(est, expected)


def normal_sum_fisher(n, noise_pdf, noise_width):
    """F of y = S + noise, S ~ N(n theta, n), by quadrature (numpy).

    The score is E[d log N(S; n theta, n) | y] = E[S - n theta | y]; with u = S - n theta,
    F = int p(y) E[u | y]^2 dy, whatever theta.
    """
    sd = np.sqrt(n)
    u = np.linspace(-12 * sd, 12 * sd, 2401)
    y = np.linspace(-12 * sd - noise_width, 12 * sd + noise_width, 4001)
    joint = (np.exp(-0.5 * u**2 / n) / np.sqrt(2 * np.pi * n))[None, :] * noise_pdf(
        y[:, None] - u[None, :])
    density = np.trapezoid(joint, u, axis=1)
    score = np.trapezoid(joint * u[None, :], u, axis=1) / density
    return np.trapezoid(density * score**2, y)


def normal_laplace_fisher(n, scale):
    return normal_sum_fisher(n, lambda v: np.exp(-np.abs(v) / scale) / (2 * scale), 40 * scale)


def test_the_quadrature_is_exact_for_gaussian_noise():
    """With N(0, 4) noise instead of Laplace: F = n^2 / (n + 4), in closed form."""
    gauss = normal_sum_fisher(5, lambda v: np.exp(-v**2 / 8) / np.sqrt(8 * np.pi), 30.0)
    assert gauss == pytest.approx(25 / 9, rel=1e-6)
    assert normal_laplace_fisher(5, 0.02) == pytest.approx(5.0, rel=0.01)  # little noise: F = n


def test_thesis_form_exact_laplace_release():
    """Rows x_i ~ N(theta, 1) drawn at theta, the score of the rows (Algorithm 7 as printed);
    the sum is exactly normal, so laplace_release_fisher is exact."""
    def rows(key, theta):
        return theta + jax.random.normal(key, (N_ROWS,))

    def rows_logpdf(theta, x):
        return jnp.sum(dist.Normal(theta, 1.0).log_prob(x))

    def release(theta, x):
        return dist.Laplace(jnp.sum(x), 3.0)

    exact = normal_laplace_fisher(N_ROWS, 3.0)
    est = marginal_release_fisher(jax.random.PRNGKey(1), rows, release, 0.7,
                                  latent_logpdf=rows_logpdf, num_releases=1000,
                                  num_particles=128)
    assert est.fisher.shape == (1, 1)
    within(est, exact)


def test_sum_of_abs_agrees_with_the_central_limit_closed_form():
    """s(x) = |x| under N(0, theta), n = 50, Gaussian noise: the CLT form (gaussian_release_fisher)
    is an approximation, off by O(1/n): 4 standard errors and 3%."""
    n = 50

    def g(k):
        return jnp.exp(gammaln((k + 1) / 2)) / jnp.sqrt(jnp.pi)

    abs_x = Statistic("|x|", lambda t: jnp.sqrt(2 * t) * g(1),
                      lambda t: 2 * t * (g(2) - g(1) ** 2), 10.0)

    def noise(key, theta):
        return jax.random.normal(key, (n,))

    def release(theta, z):
        return dist.Normal(jnp.sum(jnp.abs(jnp.sqrt(theta) * z)), 4.0)

    clt = gaussian_release_fisher(abs_x, 1.0, n, 4.0)
    est = marginal_release_fisher(jax.random.PRNGKey(2), noise, release, 1.0,
                                  num_releases=1500, num_particles=128)
    assert abs(est.fisher[0, 0] - clt[0, 0]) <= 4 * est.stderr[0, 0] + 0.03 * clt[0, 0]
    assert est.stderr[0, 0] < 0.06 * clt[0, 0]


def test_both_forms_agree_on_a_smooth_sensitivity_median():
    """The median of |x_i|, x_i ~ N(0, theta), n = 21, released with Laplace noise of scale
    S(x) / alpha (its smooth sensitivity at eps = 5): no closed form; the reparametrised
    score and the rows' score estimate the same F."""
    n, bound = 21, 10.0
    alpha, beta = smooth_sensitivity_params(5.0, 1 / n**2)

    def laplace_of_median(s):
        return dist.Laplace(median_statistic(s), median_smooth_sensitivity(s, bound, beta) / alpha)

    def noise(key, theta):
        return jax.random.normal(key, (n,))

    def rows(key, theta):
        return jnp.sqrt(theta) * jax.random.normal(key, (n,))

    def rows_logpdf(theta, x):
        return jnp.sum(dist.Normal(0.0, jnp.sqrt(theta)).log_prob(x))

    pathwise = marginal_release_fisher(
        jax.random.PRNGKey(3), noise, lambda t, z: laplace_of_median(jnp.abs(jnp.sqrt(t) * z)),
        1.0, num_releases=600, num_particles=128)
    thesis = marginal_release_fisher(
        jax.random.PRNGKey(4), rows, lambda t, x: laplace_of_median(jnp.abs(x)), 1.0,
        latent_logpdf=rows_logpdf, num_releases=600, num_particles=128)
    gap = abs(pathwise.fisher[0, 0] - thesis.fisher[0, 0])
    assert gap <= 4 * np.hypot(pathwise.stderr[0, 0], thesis.stderr[0, 0])
    # the median of 21 rows alone: F is at most n / (2 theta^2) = 10.5, the sufficient statistic's
    assert 0 < thesis.fisher[0, 0] < 10.5
    assert np.median(thesis.ess) > 10


def test_a_theta_dependent_latent_needs_its_log_density():
    def rows(key, theta):
        return jnp.sqrt(theta) * jax.random.normal(key, (5,))

    def release(theta, x):
        return dist.Normal(jnp.sum(x), 1.0)

    with pytest.raises(ValueError, match="latent_logpdf"):
        marginal_release_fisher(jax.random.PRNGKey(0), rows, release, 1.0)
    with pytest.raises(ValueError, match="num_particles"):
        marginal_release_fisher(jax.random.PRNGKey(0), standard_normal_rows, release, 1.0,
                                num_particles=1)
