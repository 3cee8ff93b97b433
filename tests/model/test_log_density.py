"""The model adapter's per-row log-likelihoods and prior (SPEC s1): against
hand computation, against NumPyro's potential energy, under jit and vmap.

Reference values are written by hand with numpy/scipy in float64 (x64 is on
for every test of this module and restored afterwards).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support.model_cases import (
    CASES,
    _close,
    _minus_potential_energy,
    _pm,
    _stick_breaking,
    _terms,
    case_linreg,
)
from scipy import stats

pytestmark = pytest.mark.usefixtures("model_x64")


# -------------------------------------------------------- 1. per-row log-likelihoods
def test_loglik_rows_match_hand_computation(case):
    terms = _terms(case.pm, case.params, case.args, case.kwargs)
    assert terms.loglik_rows.shape == (len(case.rows),)
    assert terms.loglik_rows.dtype == jnp.float64
    _close(terms.loglik_rows, case.rows)


def test_prior_includes_log_jacobian(case):
    terms = _terms(case.pm, case.params, case.args, case.kwargs)
    assert jnp.shape(terms.prior) == ()
    _close(terms.prior, case.prior)


def test_idx_subsetting_matches_full_vector(case):
    pm = case.pm
    full = _terms(pm, case.params, case.args, case.kwargs).loglik_rows
    n = pm.num_rows
    for idx in (jnp.array([3, 7, 1, 0, n - 1, 30]), jnp.array([5, 5, 2, 40, 11, 12])):
        sub = _terms(pm, case.params, case.args, case.kwargs, idx=idx)
        assert sub.loglik_rows.shape == idx.shape
        _close(sub.loglik_rows, full[idx])
        # the prior does not depend on which rows are evaluated
        _close(sub.prior, case.prior)


def test_linreg_prior_term_by_term():
    """The HalfNormal sigma contributes its log-density at exp(u) plus u (the Jacobian)."""
    c = case_linreg()
    pm = _pm(c)
    w = np.asarray(c.params["w"])
    for u in (-1.5, 0.0, 0.9):
        params = {"w": c.params["w"], "sigma": jnp.asarray(u)}
        prior = _terms(pm, params, c.args, c.kwargs).prior
        expected = (
            stats.norm.logpdf(w).sum() + stats.halfnorm.logpdf(np.exp(u), scale=2.0) + u
        )
        _close(prior, expected)


def test_stick_breaking_reference_is_a_simplex():
    """Sanity check of the hand-written transform used as reference above."""
    u = np.array([0.3, -0.8, 1.1])
    p, log_det = _stick_breaking(u)
    assert np.all(p > 0) and np.isclose(p.sum(), 1.0)
    p0, _ = _stick_breaking(np.zeros(3))
    _close(p0, np.full(4, 0.25), rtol=1e-12)
    # log|det J| of the first K-1 coordinates by central differences
    eps = 1e-6
    jac = np.stack(
        [
            (_stick_breaking(u + eps * e)[0][:-1] - _stick_breaking(u - eps * e)[0][:-1])
            / (2 * eps)
            for e in np.eye(3)
        ],
        axis=1,
    )
    _close(np.log(abs(np.linalg.det(jac))), log_det, rtol=1e-7, atol=1e-7)


# -------------------------------------------- 2. rows + prior = -potential_energy
def test_sum_equals_minus_potential_energy(case):
    pm = case.pm
    points = [case.params]
    for k in jax.random.split(jax.random.PRNGKey(11), 3):
        theta = pm.ravel(case.params) + 0.5 * jax.random.normal(k, (pm.num_params,))
        points.append(pm.unravel(theta))
    expected = _minus_potential_energy(case.model, case.args, case.kwargs, points)
    for params, lp in zip(points, expected, strict=True):
        terms = _terms(pm, params, case.args, case.kwargs)
        _close(terms.prior + terms.loglik_rows.sum(), lp, rtol=1e-10, atol=1e-8)
    # and NumPyro agrees with the hand-written reference at the first point
    _close(expected[0], case.prior + case.rows.sum(), rtol=1e-10, atol=1e-8)


# --------------------------------------------------------------- 7. jit and vmap
def test_log_density_terms_vmap_matches_jit(case):
    pm = case.pm
    theta0 = pm.ravel(case.params)
    thetas = theta0 + 0.3 * jax.random.normal(jax.random.PRNGKey(2), (3, pm.num_params))

    def terms_at(theta):
        return pm.log_density_terms(pm.unravel(theta), case.args, case.kwargs)

    batched = jax.jit(jax.vmap(terms_at))(thetas)
    assert batched.prior.shape == (3,)
    assert batched.loglik_rows.shape == (3, pm.num_rows)
    for i in range(3):
        single = _terms(pm, pm.unravel(thetas[i]), case.args, case.kwargs)
        _close(batched.prior[i], single.prior, rtol=1e-12, atol=1e-10)
        _close(batched.loglik_rows[i], single.loglik_rows, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("name", ["linreg_halfnormal", "plate_dim_minus2"])
def test_log_density_terms_eager_matches_jit_and_vmap(name):
    c = CASES[name]()
    pm = _pm(c)
    eager = pm.log_density_terms(c.params, c.args, c.kwargs)
    _close(eager.loglik_rows, c.rows)
    _close(eager.prior, c.prior)
    jitted = _terms(pm, c.params, c.args, c.kwargs)
    _close(jitted.prior, eager.prior, rtol=1e-12, atol=1e-10)
    _close(jitted.loglik_rows, eager.loglik_rows, rtol=1e-12, atol=1e-10)
    # idx subsetting, eagerly
    idx = jnp.array([10, 2, 59, 40])
    sub = pm.log_density_terms(c.params, c.args, c.kwargs, idx=idx)
    _close(sub.loglik_rows, c.rows[np.asarray(idx)])
    _close(sub.prior, c.prior)


def test_loglik_rows_differentiable():
    """Per-row gradients via jacrev agree with the hand-written linear-regression gradient."""
    c = case_linreg()
    pm = _pm(c)
    X, y = c.args

    def rows(theta):
        return pm.log_density_terms(pm.unravel(theta), c.args, c.kwargs).loglik_rows

    theta = pm.ravel(c.params)
    jac = jax.jit(jax.jacrev(rows))(theta)
    assert jac.shape == (pm.num_rows, pm.num_params)
    # ravel order follows the sorted dict keys: "sigma" then "w"
    w, u = np.asarray(c.params["w"]), float(c.params["sigma"])
    r = y - X @ w
    s2 = np.exp(2 * u)
    expected = np.concatenate([(r**2 / s2 - 1.0)[:, None], X * (r / s2)[:, None]], axis=1)
    _close(jac, expected, rtol=1e-9, atol=1e-9)
