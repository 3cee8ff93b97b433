"""Fisher information of noisy releases and the ranking of statistics (paper 002, ch. 4).

Each closed form is checked against an independent numerical computation:
the Gaussian release against the finite-difference Hessian of the Gaussian KL
divergence (which equals F at h = 0), the Laplace release against a score by
finite differences of a density integrated numerically over the sum.  The
rankings reproduce the thesis's claims for its Examples 3-6.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaln

from numpyro_dp.releases.fisher import (
    Statistic,
    gaussian_release_fisher,
    laplace_release_fisher,
    rank_statistics,
    sequential_release_fisher,
)


def abs_power(a, bound=10.0):
    """s = |x|^a under X ~ N(0, theta) (theta the variance; Example 4), x in (-bound, bound)."""
    def g(k):
        return jnp.exp(gammaln((k + 1) / 2)) / jnp.sqrt(jnp.pi)

    return Statistic(f"|x|^{a}", lambda t: (2 * t) ** (a / 2) * g(a),
                     lambda t: (2 * t) ** a * (g(2 * a) - g(a) ** 2), bound**a)


def uniform_abs_power(a, bound=10.0):
    """s = |x|^a under X ~ Unif(-theta, theta) (Example 5)."""
    return Statistic(f"|x|^{a}", lambda t: t**a / (a + 1),
                     lambda t: t ** (2 * a) * a**2 / ((a + 1) ** 2 * (2 * a + 1)), bound**a)


def normal_power(a, bound=10.0):
    """s = x^a, a in {1, 3}, under X ~ N(theta, 1) (Example 3)."""
    if a == 1:
        return Statistic("x", lambda t: t, lambda t: 1.0 + 0 * t, bound)
    return Statistic("x^3", lambda t: t**3 + 3 * t, lambda t: 9 * t**4 + 36 * t**2 + 15, bound**3)


def gaussian_kl(m0, H0, m1, H1):
    """KL(N(m0, H0) || N(m1, H1)), numpy."""
    k = len(m0)
    H1inv = np.linalg.inv(H1)
    diff = m1 - m0
    return 0.5 * (np.trace(H1inv @ H0) + diff @ H1inv @ diff - k
                  + np.log(np.linalg.det(H1) / np.linalg.det(H0)))


def test_gaussian_release_fisher_is_the_curvature_of_the_kl_divergence():
    """A 2-parameter model and a 2-d statistic: X ~ N(mu, s2), s(x) = (x, x^2)."""
    def mean(t):
        return jnp.stack([t[0], t[0] ** 2 + t[1]])

    def cov(t):
        mu, s2 = t
        return jnp.array([[s2, 2 * mu * s2], [2 * mu * s2, 4 * mu**2 * s2 + 2 * s2**2]])

    stat = Statistic("(x, x^2)", mean, cov, 1.0)
    theta, n, sd = np.array([0.7, 1.3]), 50, 4.0
    got = gaussian_release_fisher(stat, theta, n, sd)

    def moments(t):  # numpy, float64
        mu, s2 = t
        return (n * np.array([mu, mu**2 + s2]),
                n * np.array([[s2, 2 * mu * s2], [2 * mu * s2, 4 * mu**2 * s2 + 2 * s2**2]])
                + sd**2 * np.eye(2))

    m0, H0 = moments(theta)
    h = 1e-4
    want = np.zeros((2, 2))
    for i in range(2):
        for j in range(2):
            def kl(di, dj, i=i, j=j):
                t = theta.copy()
                t[i] += di
                t[j] += dj
                return gaussian_kl(m0, H0, *moments(t))

            want[i, j] = (kl(h, h) - kl(h, -h) - kl(-h, h) + kl(-h, -h)) / (4 * h * h)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got, got.T)


def test_laplace_release_fisher_against_a_numerical_density():
    """The closed-form normal-Laplace density and its quadrature, against the density
    integrated over the sum by the trapezoid rule and a finite-difference score."""
    stat, n, theta = abs_power(1), 100, 2.0
    b = 10.0 / 2.0  # Laplace scale on the sum, epsilon = 2
    got = laplace_release_fisher(stat, theta, n, b)[0, 0]

    def moments(t):
        return n * float(stat.mean(t)), n * float(stat.cov(t))

    m, v = moments(theta)
    width = 12 * np.sqrt(v + 2 * b**2)
    y = np.linspace(m - width, m + width, 3001)
    u = np.linspace(m - 12 * np.sqrt(v), m + 12 * np.sqrt(v), 4001)

    def density(t):
        mt, vt = moments(t)
        normal = np.exp(-0.5 * (u - mt) ** 2 / vt) / np.sqrt(2 * np.pi * vt)
        laplace = np.exp(-np.abs(y[:, None] - u[None, :]) / b) / (2 * b)
        return np.trapezoid(normal[None, :] * laplace, u, axis=1)

    h = 1e-4
    p = density(theta)
    score = (np.log(density(theta + h)) - np.log(density(theta - h))) / (2 * h)
    want = np.trapezoid(p * score**2, y)
    assert got == pytest.approx(want, rel=2e-3)


def test_laplace_noise_vanishing_leaves_the_sums_information():
    stat = abs_power(2)
    without_noise = gaussian_release_fisher(stat, 2.0, 100, 0.0)[0, 0]
    assert laplace_release_fisher(stat, 2.0, 100, 1e-3)[0, 0] == pytest.approx(
        without_noise, rel=1e-3)
    # Noise only takes information away.
    assert laplace_release_fisher(stat, 2.0, 100, 10.0)[0, 0] < without_noise


@pytest.mark.parametrize("noise_variance, printed, corrected", [
    (lambda n, eps: n / eps**2, 86.47, 86.34),  # (3.2): each row noised, N(0, 1/eps^2)
    (lambda n, eps: 1 / eps**2, 600.7, 594.46),  # (3.3): the mean noised, N(0, 1/(n eps)^2)
])
def test_bernoulli_releases_have_the_corrected_variance_term(noise_variance, printed,
                                                             corrected):
    """Example 6: X ~ Bernoulli(theta), n = 100, theta = 0.2, eps = 1.  With v the
    release's variance per row, F = [n v + (1 - 2 theta)^2 / 2] / v^2; the thesis prints
    F_2 and F_3 without the 1/2 (its values are ``printed``)."""
    stat = Statistic("x", lambda t: t, lambda t: t * (1 - t), 1.0)
    theta, n, eps = 0.2, 100, 1.0
    sd = np.sqrt(noise_variance(n, eps))  # on the sum
    got = gaussian_release_fisher(stat, theta, n, sd)[0, 0]
    v = theta * (1 - theta) + noise_variance(n, eps) / n
    assert got == pytest.approx((n * v + (1 - 2 * theta) ** 2 / 2) / v**2, rel=1e-10)
    assert got == pytest.approx(corrected, abs=0.01)
    assert (n * v + (1 - 2 * theta) ** 2) / v**2 == pytest.approx(printed, abs=0.01)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_the_thesis_rankings(noise):
    """Examples 3-5: without noise the sufficient statistic wins; at epsilon = 1 the
    statistic of smaller range does (for x^3, only far from 0)."""
    def best(cands, theta, eps):
        return rank_statistics(cands, theta, 100, epsilon=eps, delta=1e-5, noise=noise)[0].name

    variance = [abs_power(1), abs_power(2)]  # Example 4 with A = 10, theta = 2
    assert best(variance, 2.0, 1.0) == "|x|^1"
    assert best(variance, 2.0, 1000.0) == "|x|^2"
    uniform = [uniform_abs_power(a) for a in (0.1, 0.5, 1, 2)]  # Example 5
    assert best(uniform, 1.0, 1.0) == "|x|^0.5"
    assert best(uniform, 1.0, 1000.0) == "|x|^2"
    location = [normal_power(1), normal_power(3)]  # Example 3
    assert best(location, 2.0, 1.0) == "x"
    assert best(location, 8.0, 1.0) == "x^3"


def test_rank_statistics_averages_over_draws_and_reports_the_noise():
    cands = [abs_power(1), abs_power(2)]
    draws = np.array([1.5, 2.0, 2.5])
    ranked = rank_statistics(cands, num_rows=100, epsilon=1.0, delta=1e-5, theta_draws=draws)
    one = {r.name: r for r in rank_statistics(cands, 2.0, 100, epsilon=1.0, delta=1e-5)}
    for r in ranked:
        inverse = [1 / gaussian_release_fisher(
            next(c for c in cands if c.name == r.name), t, 100, one[r.name].noise)[0, 0]
            for t in draws]
        assert r.criterion == pytest.approx(np.mean(inverse), rel=1e-9)
        assert r.noise == one[r.name].noise > 0
    assert [r.name for r in ranked] == ["|x|^1", "|x|^2"]


def test_a_release_that_cannot_identify_every_parameter_ranks_last():
    """A statistic that sees only theta_0 + theta_1 cannot identify both: tr(F^-1) is
    infinite."""
    scalar = Statistic("x", lambda t: t[0] + t[1], lambda t: 1.0 + 0 * t[0], 1.0)
    pair = Statistic("(x, x^2)", lambda t: jnp.stack([t[0], t[0] ** 2 + t[1]]),
                     lambda t: jnp.array([[t[1], 2 * t[0] * t[1]],
                                          [2 * t[0] * t[1], 4 * t[0] ** 2 * t[1]
                                           + 2 * t[1] ** 2]]), 2.0)
    ranked = rank_statistics([scalar, pair], np.array([0.5, 1.0]), 1000, epsilon=3.0,
                             delta=1e-6)
    assert [r.name for r in ranked] == ["(x, x^2)", "x"] and ranked[1].criterion == np.inf


@pytest.mark.parametrize("b", [0.3, 3.0])
def test_sequential_release_of_a_normal_row_is_the_normal_laplace_release(b):
    """X ~ N(theta, 1) (truncated at +-10, which changes nothing here), s(x) = x: each
    noisy row is normal-Laplace, whose closed form the quadrature over x must match."""
    got = sequential_release_fisher(lambda x, t: -0.5 * (x - t) ** 2, lambda x: x, 0.3, 100,
                                    b, (-10.0, 10.0))[0, 0]
    one_row = Statistic("x", lambda t: t, lambda t: 1.0 + 0 * t, 1.0)
    assert got == pytest.approx(100 * laplace_release_fisher(one_row, 0.3, 1, b)[0, 0],
                                rel=1e-4)


def test_sequential_release_of_the_variance_prefers_the_smaller_range():
    """Section 6.4: rows of N(0, theta) in (-10, 10), each released with Laplace
    noise; |x| (range 10) tells more than x^2 (range 100) at epsilon 1 and 20."""
    def fisher(a, eps):
        return sequential_release_fisher(
            lambda x, t: -0.5 * x**2 / t - 0.5 * jnp.log(t), lambda x: jnp.abs(x) ** a,
            2.0, 100, 10.0**a / eps, (-10.0, 10.0))[0, 0]

    for eps in (1.0, 20.0):
        assert fisher(1, eps) > fisher(2, eps) > 0
    assert fisher(1, 1.0) < fisher(1, 20.0)


def test_bad_arguments_are_refused():
    stat = abs_power(1)
    with pytest.raises(ValueError, match="either theta"):
        rank_statistics([stat], num_rows=100, epsilon=1.0, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        rank_statistics([stat], 2.0, 100, epsilon=1.0)
    with pytest.raises(ValueError, match="noise="):
        rank_statistics([stat], 2.0, 100, epsilon=1.0, delta=1e-5, noise="exponential")
    with pytest.raises(ValueError, match="num_rows"):
        rank_statistics([stat], 2.0, 0, epsilon=1.0, delta=1e-5)
    vector = Statistic("v", lambda t: jnp.stack([t, t]), lambda t: jnp.eye(2), 1.0)
    with pytest.raises(ValueError, match="scalar statistic"):
        laplace_release_fisher(vector, 1.0, 10, 1.0)
    row = (lambda x, t: -0.5 * (x - t) ** 2, lambda x: x, 0.0, 10)
    with pytest.raises(ValueError, match="too small beside the statistic's range"):
        sequential_release_fisher(*row, 1e-4, (-10.0, 10.0))
    with pytest.raises(ValueError, match="finite bounds"):
        sequential_release_fisher(*row, 1.0, (-np.inf, 10.0))
