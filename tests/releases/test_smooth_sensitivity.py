"""Smooth sensitivity of order statistics and the maximum (Nissim et al. 2007; paper 002 s6.3).

The closed forms are checked against the definition, computed by brute
force: on a grid of values, the local sensitivity of every data set (every
substitution of one value) and the smooth sensitivity
``max_y LS(y) exp(-beta d(x, y))`` over every data set ``y`` of the grid.
The grid of ``y`` is finer than the one of ``x`` and holds 0 and the bound,
so a formula that only looked at ``x``'s own values and the bounds could not
pass by construction.  The Laplace constants ``(alpha, beta)`` are checked by
the exact worst-case ``delta`` of the mechanism.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_dp.releases.smooth_sensitivity import (
    max_smooth_sensitivity,
    median_rank,
    median_smooth_sensitivity,
    median_statistic,
    order_statistic_smooth_sensitivity,
    smooth_sensitivity_params,
)

BOUND = 4.0
X_GRID = np.array([0.0, 1.0, 2.5, 4.0])
Y_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.5, 3.0, 4.0])  # finer: holds X_GRID, 0 and BOUND
BETAS = (0.15, 0.7, 2.0)


def local_sensitivity(ys, f):
    """LS(y) = max over one substituted value (anywhere in [0, BOUND]) of |f(y') - f(y)|.

    The statistics here are monotone in each value, so the extremes are at
    substitutions by 0 and BOUND; the whole grid is tried anyway.
    """
    base = f(ys)
    out = np.zeros(len(ys))
    for i in range(ys.shape[1]):
        for v in Y_GRID:
            other = ys.copy()
            other[:, i] = v
            out = np.maximum(out, np.abs(f(other) - base))
    return out


def brute_force(n, f):
    """{beta: smooth sensitivity of every sorted x on X_GRID}, by the definition."""
    ys = np.array(list(itertools.product(Y_GRID, repeat=n)))
    ls = local_sensitivity(ys, f)
    xs = np.array(list(itertools.combinations_with_replacement(X_GRID, n)))
    distance = (xs[:, None, :] != ys[None, :, :]).sum(-1)  # Hamming, (num x, num y)
    return xs, {beta: np.max(ls[None, :] * np.exp(-beta * distance), axis=1) for beta in BETAS}


def thesis_order_statistic(x, m, bound, beta):
    """s6.3's formula as printed, with loops:
    max_k e^{-k beta} max_{t=0..k+1} (s_{m+t} - s_{m+t-k-1})."""
    s = np.sort(np.clip(x, 0, bound))
    n = len(s)

    def at(i):
        return 0.0 if i < 1 else (bound if i > n else s[i - 1])

    return max(math.exp(-k * beta) * max(at(m + t) - at(m + t - k - 1) for t in range(k + 2))
               for k in range(n + 1))


def thesis_max(x, bound, beta):
    """s6.3's formula for the maximum: max_k e^{-k beta} max(A - s_{n-k}, s_n - s_{n-k-1})."""
    s = np.sort(np.clip(x, 0, bound))
    n = len(s)

    def at(i):
        return 0.0 if i < 1 else s[i - 1]

    return max(math.exp(-k * beta) * max(bound - at(n - k), at(n) - at(n - k - 1))
               for k in range(n + 1))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_order_statistics_match_the_definition(n):
    for m in range(1, n + 1):
        xs, expected = brute_force(n, lambda y, m=m: np.sort(y, axis=1)[:, m - 1])
        for beta, brute in expected.items():
            fast = np.asarray(order_statistic_smooth_sensitivity(jnp.asarray(xs), m, BOUND, beta))
            thesis = np.array([thesis_order_statistic(x, m, BOUND, beta) for x in xs])
            np.testing.assert_allclose(thesis, brute, atol=1e-12, err_msg=f"n={n} m={m}")
            np.testing.assert_allclose(fast, brute, rtol=1e-5, atol=1e-6,
                                       err_msg=f"n={n} m={m} beta={beta}")
            if m == median_rank(n):
                median = np.asarray(median_smooth_sensitivity(jnp.asarray(xs), BOUND, beta))
                np.testing.assert_allclose(median, brute, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_maximum_matches_the_definition(n):
    xs, expected = brute_force(n, lambda y: y.max(axis=1))
    for beta, brute in expected.items():
        fast = np.asarray(max_smooth_sensitivity(jnp.asarray(xs), BOUND, beta))
        thesis = np.array([thesis_max(x, BOUND, beta) for x in xs])
        np.testing.assert_allclose(thesis, brute, atol=1e-12)
        np.testing.assert_allclose(fast, brute, rtol=1e-5, atol=1e-6)


def test_median_convention_is_the_lower_middle_value():
    assert [median_rank(n) for n in (1, 2, 3, 4, 100, 101)] == [1, 1, 2, 2, 50, 51]
    assert float(median_statistic(jnp.array([3.0, 1.0, 2.0]))) == 2.0
    assert float(median_statistic(jnp.array([4.0, 1.0, 3.0, 2.0]))) == 2.0  # not 2.5
    with pytest.raises(ValueError, match="undefined"):
        median_rank(0)


@pytest.mark.parametrize("n", [100, 101])
def test_large_n_agrees_with_the_thesis_formula_and_with_rank_n(n):
    """The pair restriction (indices 0..n+1 only) loses nothing at the thesis's n."""
    rng = np.random.default_rng(n)
    x = np.abs(rng.normal(0, 1.5, size=(4, n)))
    x[0, :5] = 12.0  # some values beyond the bound: clipped
    bound, beta = 10.0, smooth_sensitivity_params(5.0, 1 / n**2)[1]
    for rows in x:
        med = float(median_smooth_sensitivity(jnp.asarray(rows), bound, beta))
        assert med == pytest.approx(thesis_order_statistic(rows, median_rank(n), bound, beta),
                                    rel=1e-5)
        top = float(max_smooth_sensitivity(jnp.asarray(rows), bound, beta))
        assert top == pytest.approx(thesis_max(rows, bound, beta), rel=1e-5)
        assert top == pytest.approx(
            float(order_statistic_smooth_sensitivity(jnp.asarray(rows), n, bound, beta)), rel=1e-5)


def test_batches_jit_and_vmap():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(0, 10, size=(3, 2, 9)))
    for fn in (median_smooth_sensitivity, max_smooth_sensitivity):
        batched = fn(x, 10.0, 0.3)
        assert batched.shape == (3, 2)
        one_by_one = jax.vmap(jax.vmap(jax.jit(lambda v, fn=fn: fn(v, 10.0, 0.3))))(x)
        np.testing.assert_allclose(batched, one_by_one, rtol=1e-6)
        # beta and the bound may be traced
        traced = jax.jit(fn)(x[0, 0], 10.0, 0.3)
        np.testing.assert_allclose(traced, batched[0, 0], rtol=1e-6)
    with pytest.raises(ValueError, match="rank"):
        order_statistic_smooth_sensitivity(x, 0, 10.0, 0.3)


def test_smooth_sensitivity_is_smooth_and_bounds_the_local_sensitivity():
    """The two defining properties on random neighbours at n = 30."""
    rng = np.random.default_rng(1)
    n, bound, beta = 30, 10.0, 0.2
    for _ in range(50):
        x = rng.uniform(0, 3, n)
        y = x.copy()
        y[rng.integers(n)] = rng.choice([0.0, bound, rng.uniform(0, bound)])
        for fn, stat in ((median_smooth_sensitivity, lambda v: np.sort(v)[median_rank(n) - 1]),
                         (max_smooth_sensitivity, np.max)):
            sx, sy = float(fn(jnp.asarray(x), bound, beta)), float(fn(jnp.asarray(y), bound, beta))
            assert sx <= math.exp(beta) * sy * (1 + 1e-6)
            assert abs(stat(x) - stat(y)) <= sx * (1 + 1e-6) + 1e-9


def laplace_hockey_stick(epsilon, mu, scale):
    """Exact sup_S P(S) - e^eps Q(S) for P = Laplace(0, 1), Q = Laplace(mu, scale), mu >= 0.

    log p - log q is piecewise linear with kinks at 0 and mu: on each piece the
    set where it exceeds epsilon is an interval, integrated by the CDFs.
    """
    def cdf(z, loc, b):
        u = (z - loc) / b
        return np.where(u < 0, 0.5 * np.exp(np.minimum(u, 0)), 1 - 0.5 * np.exp(-np.maximum(u, 0)))

    def log_ratio(z):
        return -abs(z) + abs(z - mu) / scale + math.log(scale) - epsilon

    total = 0.0
    for lo, hi in ((-np.inf, 0.0), (0.0, mu), (mu, np.inf)):
        if hi <= lo:
            continue
        # the linear function on this piece: value at a finite point and slope
        point = 0.0 if np.isinf(lo) else lo
        slope = {(-np.inf, 0.0): 1 - 1 / scale, (0.0, mu): -1 - 1 / scale,
                 (mu, np.inf): 1 / scale - 1}[(lo, hi)]
        value = log_ratio(point)
        if slope == 0:
            a, b = (lo, hi) if value > 0 else (0.0, 0.0)
        elif slope > 0:
            a, b = max(lo, point - value / slope), hi
        else:
            a, b = lo, min(hi, point - value / slope)
        if b > a:
            p = cdf(b, 0.0, 1.0) - cdf(a, 0.0, 1.0)
            q = cdf(b, mu, scale) - cdf(a, mu, scale)
            total += max(float(p - math.exp(epsilon) * q), 0.0)
    return total


def worst_case_delta(epsilon, alpha, beta):
    """Largest delta(epsilon) over every pair of neighbours' output laws.

    Neighbours x, y have |f(x) - f(y)| <= min(S(x), S(y)) (S bounds LS at both)
    and |ln S(x) / S(y)| <= beta; in units of x's noise scale S(x) / alpha the
    laws are Laplace(0, 1) and Laplace(mu, e^lam), |mu| <= alpha min(1, e^lam).
    """
    worst = 0.0
    for lam in np.linspace(-beta, beta, 41):
        for mu in np.linspace(0.0, alpha * min(1.0, math.exp(lam)), 81):
            worst = max(worst, laplace_hockey_stick(epsilon, mu, math.exp(lam)))
    return worst


def test_laplace_hockey_stick_against_quadrature():
    z = np.linspace(-80, 80, 1_600_001)
    for mu, scale in ((0.7, 0.8), (1.9, 1.3), (0.0, 0.9)):
        p = 0.5 * np.exp(-np.abs(z))
        q = 0.5 / scale * np.exp(-np.abs(z - mu) / scale)
        numeric = np.trapezoid(np.maximum(p - math.exp(2.0) * q, 0), z)
        assert laplace_hockey_stick(2.0, mu, scale) == pytest.approx(numeric, rel=1e-4, abs=1e-12)


@pytest.mark.parametrize("epsilon,delta", [(0.5, 1e-5), (1.0, 1e-4), (2.0, 1e-4), (5.0, 1e-4),
                                           (5.0, 1e-6), (8.0, 1e-4)])
def test_laplace_constants_give_the_stated_delta(epsilon, delta):
    alpha, beta = smooth_sensitivity_params(epsilon, delta)
    assert alpha == epsilon / 2
    assert beta == pytest.approx(epsilon / (2 * math.log(2 / delta)))
    assert worst_case_delta(epsilon, alpha, beta) <= delta
    # NRS's sufficient dilation condition, which their proof uses, holds only up to eps ~ 3.75
    z0 = math.log(2 / delta)
    assert (z0 * math.expm1(beta) - beta <= epsilon / 2) == (epsilon < 3.75)


def test_params_validation():
    with pytest.raises(ValueError, match="delta"):
        smooth_sensitivity_params(1.0, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        smooth_sensitivity_params(-1.0, 1e-4)
