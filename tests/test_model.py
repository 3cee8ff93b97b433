"""Tests for the model adapter (:mod:`numpyro_dp.model`): adapter and dataflow.

SPEC s1: the adapter splits a NumPyro model into a data-free prior (in the
unconstrained space, Jacobian included) and per-row log-likelihoods, and rejects
models that cannot be privatised with an error naming the problem.

Reference values are written by hand with numpy/scipy in float64 (x64 is switched
on for every test of this module and restored afterwards).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import lax
from numpyro.infer import init_to_median, init_to_uniform, init_to_value
from numpyro.infer.util import potential_energy
from scipy import stats
from scipy.special import expit, logsumexp

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.checks import ModelSpecificationError
from numpyro_dp.model.dataflow import depends_on_private, inputs_read

RTOL = 1e-10
ATOL = 1e-10


@pytest.fixture(scope="module", autouse=True)
def x64():
    """Float64 for exact comparisons with the hand-written references (module-wide)."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- models
def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def linreg_model(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def two_obs_model(X, y, counts):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    log_rate = numpyro.sample("log_rate", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
        numpyro.sample("counts", dist.Poisson(jnp.exp(log_rate)), obs=counts)


MVN_COV = np.array([[1.0, 0.3, 0.1], [0.3, 2.0, -0.4], [0.1, -0.4, 0.5]])


def mvn_model(Y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0).expand([Y.shape[1]]).to_event(1))
    with numpyro.plate("data", Y.shape[0]):
        numpyro.sample("Y", dist.MultivariateNormal(mu, covariance_matrix=MVN_COV), obs=Y)


def factor_model(X, y, z):
    """A robust (Laplace-type) loss via a factor next to an ordinary observed site."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    m = numpyro.sample("m", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.factor("robust", -jnp.abs(y - X @ w))
        numpyro.sample("z", dist.Normal(m, 1.0), obs=z)


def factor_only_model(X, y):
    """The whole likelihood written with ``numpyro.factor`` inside the data plate."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.factor("loglik", -jnp.abs(y - X @ w))


DIRICHLET_ALPHA = np.array([1.5, 2.0, 3.0, 0.7])


def dirichlet_model(y, num_categories):
    p = numpyro.sample("p", dist.Dirichlet(jnp.asarray(DIRICHLET_ALPHA)))
    assert p.shape == (num_categories,)
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Categorical(probs=p), obs=y)


def matrix_model(Y, z):
    """Rows at dim=-2, an inner plate over the columns at dim=-1."""
    with numpyro.plate("cols", Y.shape[1], dim=-1):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.LogNormal(0.0, 0.5))
    with numpyro.plate("rows", Y.shape[0], dim=-2):
        numpyro.sample("z", dist.Normal(a, 1.0), obs=z[:, None])
        with numpyro.plate("cols", Y.shape[1], dim=-1):
            numpyro.sample("Y", dist.Normal(mu + a, tau), obs=Y)


def auto_dims_model(Y):
    """Plates without explicit dims: the outer data plate gets dim=-1, 'cols' dim=-2."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([Y.shape[1], 1]).to_event(2))
    with numpyro.plate("rows", Y.shape[0]):
        numpyro.sample("row_mean", dist.Normal(mu.mean(), 2.0), obs=Y.mean(axis=1))
        with numpyro.plate("cols", Y.shape[1]):
            numpyro.sample("Yt", dist.Normal(mu, 1.0), obs=Y.T)  # shape (cols, rows)


def nested_only_model(Y):
    """Every observed site sits in both 'rows' and 'cols': ambiguous data plate."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", Y.shape[0], dim=-2):
        with numpyro.plate("cols", Y.shape[1], dim=-1):
            numpyro.sample("Y", dist.Normal(mu, 1.0), obs=Y)


def groups_model(g, y, num_groups):
    """Group effects in a plate over groups outside the data plate."""
    sd = numpyro.sample("sd", dist.HalfNormal(1.0))
    with numpyro.plate("groups", num_groups):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, sd))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(alpha[g], 1.0), obs=y)


# ---------------------------------------------------------------------- test cases
@dataclass
class Case:
    model: Callable
    args: tuple
    params: dict  # unconstrained
    rows: np.ndarray  # expected per-row log-likelihoods
    prior: float  # expected prior + log-Jacobian
    kwargs: dict = field(default_factory=dict)
    data_plate: str | None = None
    pm: PrivateModel | None = None


def case_logistic():
    rng = _rng(1)
    n, d = 60, 3
    X = rng.normal(size=(n, d))
    y = (rng.uniform(size=n) < 0.4).astype(np.float64)
    w, b = np.array([0.5, -1.2, 0.3]), -0.4
    z = X @ w + b
    rows = y * z - np.logaddexp(0.0, z)  # log sigmoid(z) or log(1 - sigmoid(z))
    prior = stats.norm.logpdf(w).sum() + stats.norm.logpdf(b, 0.0, 2.0)
    return Case(logistic_model, (X,), {"w": jnp.asarray(w), "b": jnp.asarray(b)}, rows, prior,
                kwargs={"y": y})


def case_linreg():
    rng = _rng(2)
    n, d = 60, 3
    X = rng.normal(size=(n, d))
    y = X @ np.array([1.0, -0.5, 2.0]) + 0.7 * rng.normal(size=n)
    w, u = np.array([0.9, -0.4, 1.8]), np.log(0.8)
    sigma = np.exp(u)
    rows = stats.norm.logpdf(y, X @ w, sigma)
    # log|d sigma / d u| = u for sigma = exp(u)
    prior = stats.norm.logpdf(w).sum() + stats.halfnorm.logpdf(sigma, scale=2.0) + u
    return Case(linreg_model, (X, y), {"w": jnp.asarray(w), "sigma": jnp.asarray(u)}, rows, prior)


def case_two_obs():
    rng = _rng(3)
    n, d = 60, 3
    X = rng.normal(size=(n, d))
    y = X @ np.array([0.3, 0.8, -0.2]) + rng.normal(size=n)
    counts = rng.poisson(2.0, size=n).astype(np.float64)
    w, log_rate = np.array([0.2, 0.9, -0.1]), 0.6
    rows = stats.norm.logpdf(y, X @ w, 1.0) + stats.poisson.logpmf(counts, np.exp(log_rate))
    prior = stats.norm.logpdf(w).sum() + stats.norm.logpdf(log_rate)
    params = {"w": jnp.asarray(w), "log_rate": jnp.asarray(log_rate)}
    return Case(two_obs_model, (X, y, counts), params, rows, prior)


def case_mvn():
    rng = _rng(4)
    n = 60
    Y = rng.multivariate_normal([1.0, -1.0, 0.5], MVN_COV, size=n)
    mu = np.array([0.8, -0.7, 0.4])
    rows = stats.multivariate_normal.logpdf(Y, mu, MVN_COV)
    prior = stats.norm.logpdf(mu, 0.0, 3.0).sum()
    return Case(mvn_model, (Y,), {"mu": jnp.asarray(mu)}, rows, prior)


def case_factor():
    rng = _rng(5)
    n, d = 60, 3
    X = rng.normal(size=(n, d))
    y = X @ np.array([1.0, -1.0, 0.5]) + rng.laplace(size=n)
    z = rng.normal(0.5, 1.0, size=n)
    w, m = np.array([0.7, -1.3, 0.4]), 0.2
    rows = -np.abs(y - X @ w) + stats.norm.logpdf(z, m, 1.0)
    prior = stats.norm.logpdf(w).sum() + stats.norm.logpdf(m)
    return Case(factor_model, (X, y, z), {"w": jnp.asarray(w), "m": jnp.asarray(m)}, rows, prior)


def case_factor_only():
    rng = _rng(6)
    n, d = 60, 3
    X = rng.normal(size=(n, d))
    y = X @ np.array([1.0, -1.0, 0.5]) + rng.laplace(size=n)
    w = np.array([0.7, -1.3, 0.4])
    rows = -np.abs(y - X @ w)
    prior = stats.norm.logpdf(w).sum()
    return Case(factor_only_model, (X, y), {"w": jnp.asarray(w)}, rows, prior)


def _stick_breaking(u):
    """Hand-written stick-breaking map R^{K-1} -> simplex and its log|det J|."""
    k1 = u.shape[-1]
    x = u - np.log(k1 - np.arange(k1))  # offset so that u = 0 maps to the centre
    z = expit(x)
    remaining = np.concatenate([[1.0], np.cumprod(1.0 - z)])
    p = np.concatenate([z, [1.0]]) * remaining
    # y_k = z_k prod_{j<k} (1 - z_j): triangular Jacobian, diagonal y_k (1 - z_k)
    log_det = np.sum(np.log(p[:-1]) + np.log1p(-z))
    return p, log_det


def case_dirichlet():
    rng = _rng(7)
    n, k = 60, len(DIRICHLET_ALPHA)
    y = rng.choice(k, size=n, p=[0.1, 0.2, 0.3, 0.4])
    u = np.array([0.3, -0.8, 1.1])
    p, log_det = _stick_breaking(u)
    rows = np.log(p[y])
    prior = stats.dirichlet.logpdf(p, DIRICHLET_ALPHA) + log_det
    return Case(dirichlet_model, (y, k), {"p": jnp.asarray(u)}, rows, prior)


def case_matrix():
    rng = _rng(8)
    n, d = 60, 4
    Y = rng.normal(size=(n, d)) + np.arange(d)
    z = rng.normal(0.3, 1.0, size=n)
    mu, a, u = np.array([0.1, 0.9, 2.1, 2.8]), 0.25, np.log(1.3)
    tau = np.exp(u)
    rows = stats.norm.logpdf(Y, mu + a, tau).sum(axis=1) + stats.norm.logpdf(z, a, 1.0)
    prior = (
        stats.norm.logpdf(mu).sum()
        + stats.norm.logpdf(a)
        + stats.lognorm.logpdf(tau, s=0.5)
        + u
    )
    params = {"mu": jnp.asarray(mu), "a": jnp.asarray(a), "tau": jnp.asarray(u)}
    return Case(matrix_model, (Y, z), params, rows, prior)


def case_auto_dims():
    rng = _rng(10)
    n, d = 60, 4
    Y = rng.normal(size=(n, d)) + np.arange(d)
    mu = np.array([0.2, 0.8, 2.2, 3.1])
    rows = stats.norm.logpdf(Y, mu, 1.0).sum(axis=1) + stats.norm.logpdf(
        Y.mean(axis=1), mu.mean(), 2.0
    )
    prior = stats.norm.logpdf(mu).sum()
    return Case(auto_dims_model, (Y,), {"mu": jnp.asarray(mu[:, None])}, rows, prior)


def case_matrix_explicit_plate():
    c = case_matrix()
    c.data_plate = "rows"
    return c


def case_groups():
    rng = _rng(9)
    n, num_groups = 60, 5
    g = rng.integers(num_groups, size=n)
    y = rng.normal(size=n) + g * 0.5
    alpha, u = np.array([0.0, 0.4, 1.1, 1.4, 2.2]), np.log(1.5)
    sd = np.exp(u)
    rows = stats.norm.logpdf(y, alpha[g], 1.0)
    prior = stats.halfnorm.logpdf(sd) + u + stats.norm.logpdf(alpha, 0.0, sd).sum()
    params = {"sd": jnp.asarray(u), "alpha": jnp.asarray(alpha)}
    return Case(groups_model, (g, y, num_groups), params, rows, prior)


CASES = {
    "logistic": case_logistic,
    "linreg_halfnormal": case_linreg,
    "two_observed_sites": case_two_obs,
    "multivariate_obs": case_mvn,
    "factor_in_plate": case_factor,
    "factor_only_likelihood": case_factor_only,
    "dirichlet_latent": case_dirichlet,
    "plate_dim_minus2": case_matrix,
    "plate_dim_minus2_explicit": case_matrix_explicit_plate,
    "data_plate_outer_auto_dims": case_auto_dims,
    "group_effects": case_groups,
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, x64):
    """Each case is built once per module (model construction traces the model)."""
    c = CASES[request.param]()
    c.pm = _pm(c)
    return c


def _pm(c: Case) -> PrivateModel:
    if c.pm is None:
        c.pm = PrivateModel(c.model, c.args, c.kwargs, data_plate=c.data_plate)
    return c.pm


_JITTED: dict = {}


def _terms(pm: PrivateModel, params: dict, args: tuple, kwargs: dict | None = None, idx=None):
    """``pm.log_density_terms`` under ``jax.jit``, compiled once per model and signature.

    The data arrays are traced arguments (never baked into the program); other
    arguments (plate sizes such as ``num_groups``) stay static.  Eager evaluation
    of a NumPyro model compiles every primitive for every new shape, which is far
    slower than one compilation; eager results are compared with these in section 7.
    """
    kwargs = {} if kwargs is None else kwargs
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = tuple(isinstance(x, (np.ndarray, jax.Array)) for x in leaves)
    static = tuple(None if a else x for a, x in zip(is_array, leaves, strict=True))
    key = (pm, treedef, is_array, static)
    if key not in _JITTED:

        @jax.jit
        def fn(params, arrays, idx):
            it = iter(arrays)
            full = [next(it) if a else x for a, x in zip(is_array, static, strict=True)]
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return pm.log_density_terms(params, a, k, idx=idx)

        _JITTED[key] = fn
    arrays = [x for a, x in zip(is_array, leaves, strict=True) if a]
    return _JITTED[key](params, arrays, idx)


def _minus_potential_energy(model, args, kwargs, params_list):
    """-potential_energy (NumPyro's own log-density plus Jacobian) at each point."""
    pe = jax.jit(lambda p: potential_energy(model, args, kwargs, p))
    return [-pe(p) for p in params_list]


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


# ------------------------------------------------------------------------- 3. errors
def _data(n=60, d=3, seed=0):
    rng = _rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ np.ones(d) + rng.normal(size=n)
    return X, y


def test_error_no_observed_site():
    def model(X):
        numpyro.sample("w", dist.Normal(0.0, 1.0))

    X, _ = _data()
    with pytest.raises(ModelSpecificationError, match="no observed sample site"):
        PrivateModel(model, (X,))


def test_error_only_factor_outside_plates():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.factor("loglik", -jnp.sum((y - X @ w) ** 2))

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="no observed sample site"):
        PrivateModel(model, (X, y))


def test_invalid_model_error_is_not_masked():
    """An exception the model raises while traced on abstract rows is public: it is
    raised as it is."""

    def model(X, y):
        s = numpyro.sample("s", dist.HalfNormal(-1.0))  # invalid hyperparameter
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    X, y = _data()
    with pytest.raises(ValueError, match="scale") as info:
        PrivateModel(model, (X, y))
    assert not isinstance(info.value, ModelSpecificationError)


def test_error_forgotten_obs_hints_obs():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0))  # obs=y forgotten

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="obs="):
        PrivateModel(model, (X, y))


def test_error_observed_site_outside_any_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"\['y'\] lie outside every plate"):
        PrivateModel(model, (X, y))


def _model_with_outside_obs(X, y, s):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    numpyro.sample("summary", dist.Normal(w.sum(), 1.0), obs=s)


def test_error_observed_site_outside_given_data_plate():
    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"\['summary'\].*outside the data plate"):
        PrivateModel(_model_with_outside_obs, (X, y, 1.5), data_plate="data")


def test_error_observed_site_outside_detected_plate():
    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"'summary'"):
        PrivateModel(_model_with_outside_obs, (X, y, 1.5))


def test_error_observed_site_in_another_plate():
    def model(X, y, y_other):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
        with numpyro.plate("other", y_other.shape[0]):
            numpyro.sample("y_other", dist.Normal(w[0], 1.0), obs=y_other)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"\['y_other'\].*outside the data plate"):
        PrivateModel(model, (X, y, np.zeros(7)), data_plate="data")
    with pytest.raises(ModelSpecificationError, match="no single plate holds every observed"):
        PrivateModel(model, (X, y, np.zeros(7)))


def test_error_two_candidate_plates_lists_both():
    Y = _rng().normal(size=(60, 4))
    with pytest.raises(ModelSpecificationError, match="data_plate=") as info:
        PrivateModel(nested_only_model, (Y,))
    msg = str(info.value)
    assert "'rows'" in msg and "'cols'" in msg
    # naming the plate resolves the ambiguity
    pm = PrivateModel(nested_only_model, (Y,), data_plate="rows")
    assert pm.data_plate == "rows" and pm.num_rows == 60


def test_error_unknown_data_plate():
    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="'rows' is not a plate") as info:
        PrivateModel(linreg_model, (X, y), data_plate="rows")
    assert "'data'" in str(info.value)  # the plates found are listed


def test_error_latent_site_inside_data_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            u = numpyro.sample("u", dist.Normal(0.0, 1.0))  # per-row random effect
            numpyro.sample("y", dist.Normal(X @ w + u, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"Latent site 'u'.*inside the data plate"):
        PrivateModel(model, (X, y))


def test_error_second_observed_site_missing_obs():
    def model(X, y, z):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
            numpyro.sample("z", dist.Normal(0.0, 1.0))  # obs=z forgotten

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"(?s)Latent site 'z'.*obs="):
        PrivateModel(model, (X, y, y))


def test_error_discrete_latent():
    def model(X, y):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w + k, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"Latent site 'k' is discrete"):
        PrivateModel(model, (X, y))


def test_error_subsampled_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=10) as ind:
            numpyro.sample("y", dist.Normal(X[ind] @ w, 1.0), obs=y[ind])

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="subsample"):
        PrivateModel(model, (X, y))


def _assert_no_private_numbers(msg: str, numbers):
    """Neither the bad rows' indices nor their count appear in the message.

    The only number allowed is the public position of the argument ("#1").
    """
    for k in numbers:
        assert str(k) not in msg, (k, msg)
    assert not re.search(r"\d", re.sub(r"#\d+", "", msg)), msg


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_error_nonfinite_covariates(bad):
    X, y = _data()
    bad_rows = [17, 29, 53]
    X[bad_rows, 1] = bad
    with pytest.raises(ModelSpecificationError, match="NaN or infinite") as info:
        PrivateModel(linreg_model, (X, y))
    msg = str(info.value)
    assert "model argument" in msg
    _assert_no_private_numbers(msg, bad_rows + [len(bad_rows)])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_error_nonfinite_observations(bad):
    X, y = _data()
    bad_rows = [23, 41]
    y[bad_rows] = bad
    with pytest.raises(ModelSpecificationError, match="NaN or infinite") as info:
        PrivateModel(logistic_model, (X,), {"y": y})
    _assert_no_private_numbers(str(info.value), bad_rows + [len(bad_rows)])


def test_error_nonfinite_single_row_names_no_index():
    X, y = _data()
    y[37] = np.nan
    with pytest.raises(ModelSpecificationError, match="NaN or infinite") as info:
        PrivateModel(linreg_model, (X, y))
    _assert_no_private_numbers(str(info.value), [37])


def test_error_plate_size_differs_from_data():
    def model(y_t):  # rows along the second axis: the plate matches no leading size
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", y_t.shape[1]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y_t[0])

    y_t = _rng().normal(size=(1, 45))
    with pytest.raises(ModelSpecificationError, match=r"not the number of rows of any") as info:
        PrivateModel(model, (y_t,))
    assert "45" not in str(info.value)  # a plate size may be computed from the data


def test_error_plate_size_given_as_number():
    def model(y, n):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", n):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = list(_rng().normal(size=12))  # a Python list: its rows would count as public
    with pytest.raises(ModelSpecificationError, match="Python list or tuple with one item"):
        PrivateModel(model, (y, 12))


def test_as_many_rows_as_arguments_is_not_a_list_of_rows():
    """The arguments tuple itself is not a list of rows (n = 2 was refused)."""
    X, y = _data(n=2)
    assert PrivateModel(linreg_model, (X, y)).num_rows == 2


def test_error_prior_depends_on_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(X.mean(), 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"prior.*'w'"):
        PrivateModel(model, (X, y))


def test_error_prior_depends_on_observations():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.sample("s", dist.HalfNormal(jnp.std(y)))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, s), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"prior.*'s'") as info:
        PrivateModel(model, (X, y))
    assert "'w'" not in str(info.value)


def test_error_support_depends_on_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.sample("s", dist.Uniform(0.0, jnp.max(jnp.abs(y))))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, s), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"prior.*'s'"):
        PrivateModel(model, (X, y))


def test_error_factor_outside_plate_uses_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.factor("penalty", -jnp.sum((X @ w) ** 2))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"factor 'penalty'"):
        PrivateModel(model, (X, y))


# ------------------------------------------------- 4. data-free factor, deterministic
def test_data_free_factor_outside_plate_counts_in_prior():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.factor("shrink", -2.0 * jnp.sum(w**2))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    pm = PrivateModel(model, (X, y))
    assert pm.latent_sites == ("w",)
    w = np.array([0.3, -0.6, 0.1])
    terms = _terms(pm, {"w": jnp.asarray(w)}, (X, y))
    _close(terms.prior, stats.norm.logpdf(w).sum() - 2.0 * np.sum(w**2))
    _close(terms.loglik_rows, stats.norm.logpdf(y, X @ w, 1.0))
    (lp,) = _minus_potential_energy(model, (X, y), {}, [{"w": jnp.asarray(w)}])
    _close(terms.prior + terms.loglik_rows.sum(), lp)


def test_deterministic_sites():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        numpyro.deterministic("w2", 2 * w)
        numpyro.deterministic("sigma_sq", sigma**2)
        mu = numpyro.deterministic("mu", X @ w)
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(mu, sigma), obs=y)

    X, y = _data()
    with pytest.warns(UserWarning, match=r"\['mu'\]") as record:
        pm = PrivateModel(model, (X, y))
    msgs = [str(r.message) for r in record]
    assert not any("w2" in m or "sigma_sq" in m for m in msgs)
    params = {"w": jnp.array([0.5, -1.0, 0.25]), "sigma": jnp.asarray(np.log(2.0))}
    out = pm.constrain(params, (X, y), {})
    assert set(out) == {"w", "sigma", "w2", "sigma_sq"}
    _close(out["w"], [0.5, -1.0, 0.25])
    _close(out["sigma"], 2.0)
    _close(out["w2"], [1.0, -2.0, 0.5])
    _close(out["sigma_sq"], 4.0)


def test_no_warning_without_data_dependent_deterministic():
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrivateModel(linreg_model, (X, y))


def test_constrain_dirichlet_returns_simplex():
    c = case_dirichlet()
    pm = _pm(c)
    out = pm.constrain(c.params, c.args, c.kwargs)
    assert set(out) == {"p"}
    _close(out["p"], _stick_breaking(np.asarray(c.params["p"]))[0])


# ----------------------------------------------------------------- 5. init_params
def init_model(X, y):
    w = numpyro.sample("w", dist.Normal(1.5, 0.5).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.3, 0.2))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


@pytest.fixture(scope="module")
def init_pm(x64):
    X, y = _data()
    return PrivateModel(init_model, (X, y)), (X, y)


def _jit_init(pm, args, kwargs=None, strategy=init_to_uniform):
    return jax.jit(lambda k: pm.init_params(k, args, {} if kwargs is None else kwargs, strategy))


def test_init_params_shapes(init_pm):
    pm, args = init_pm
    assert pm.latent_sites == ("w", "sigma")
    init_fn = _jit_init(pm, args)
    init = init_fn(jax.random.PRNGKey(0))
    assert set(init) == {"w", "sigma"}
    assert init["w"].shape == (3,) and init["sigma"].shape == ()
    # default strategy is init_to_uniform: uniform on (-2, 2) in unconstrained space
    theta = pm.ravel(init)
    assert theta.shape == (pm.num_params,) == (4,)
    assert jnp.all(jnp.abs(theta) <= 2.0)
    # deterministic given the key, different for another key
    _close(pm.ravel(init_fn(jax.random.PRNGKey(0))), theta, rtol=0, atol=0)
    assert not np.allclose(pm.ravel(init_fn(jax.random.PRNGKey(1))), theta)
    # eager call (default strategy) agrees with the jitted one
    eager = pm.init_params(jax.random.PRNGKey(0), args, {})
    _close(pm.ravel(eager), theta, rtol=1e-12, atol=1e-12)


def test_init_params_shapes_simplex_and_plates():
    for c in (case_dirichlet(), case_groups(), case_matrix()):
        pm = _pm(c)
        init = _jit_init(pm, c.args, c.kwargs)(jax.random.PRNGKey(0))
        assert set(init) == set(c.params)
        for name, value in c.params.items():
            assert init[name].shape == jnp.shape(value), name


def test_init_to_median_is_transformed_prior_median(init_pm):
    pm, args = init_pm
    init = _jit_init(pm, args, strategy=init_to_median(num_samples=4001))(
        jax.random.PRNGKey(3)
    )
    _close(init["w"], np.full(3, 1.5), atol=0.05, rtol=0)  # sd of the median ~ 0.01
    _close(init["sigma"], 0.3, atol=0.02, rtol=0)  # log of the LogNormal median


def test_init_to_value_is_unconstrained():
    c = case_dirichlet()
    pm = _pm(c)
    values = {"p": jnp.array([0.2, 0.5, 0.1, 0.2])}
    init = _jit_init(pm, c.args, strategy=init_to_value(values=values))(jax.random.PRNGKey(0))
    assert init["p"].shape == (3,)
    _close(pm.constrain(init, c.args, c.kwargs)["p"], values["p"])
    c = case_linreg()
    pm = _pm(c)
    values = {"w": jnp.array([1.0, 2.0, 3.0]), "sigma": jnp.asarray(2.5)}
    init = _jit_init(pm, c.args, strategy=init_to_value(values=values))(jax.random.PRNGKey(0))
    _close(init["w"], [1.0, 2.0, 3.0])
    _close(init["sigma"], np.log(2.5))


def test_init_params_does_not_read_data(init_pm):
    """The initial point depends on the key only, not on the data values."""
    pm, (X, y) = init_pm

    @jax.jit
    def init_at(key, X, y):
        return pm.init_params(key, (X, y), {}, init_to_median(num_samples=5))

    key = jax.random.PRNGKey(5)
    a = init_at(key, X, y)
    b = init_at(key, X * 3.0 + 1.0, -y)
    _close(pm.ravel(a), pm.ravel(b), rtol=0, atol=0)


def test_init_params_under_vmap(init_pm):
    pm, args = init_pm
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    # plain vmap, default strategy: equals the one-key calls
    batched = jax.vmap(lambda k: pm.init_params(k, args, {}))(keys)
    assert batched["w"].shape == (3, 3) and batched["sigma"].shape == (3,)
    single_fn = _jit_init(pm, args)
    for i, k in enumerate(keys):
        single = single_fn(k)
        for name in pm.latent_sites:
            _close(batched[name][i], single[name], rtol=1e-12, atol=1e-12)
    assert not np.allclose(batched["w"][0], batched["w"][1])
    # jit of vmap with init_to_median
    med = jax.jit(jax.vmap(lambda k: pm.init_params(k, args, {}, init_to_median(num_samples=9))))(
        keys
    )
    assert med["w"].shape == (3, 3) and med["sigma"].shape == (3,)
    assert np.all(np.isfinite(pm.ravel(med)))
    assert not np.allclose(med["w"][0], med["w"][1])


# -------------------------------------------------------- 6. ravel and attributes
def test_ravel_unravel_round_trip(case):
    pm = _pm(case)
    theta = pm.ravel(case.params)
    assert theta.shape == (pm.num_params,)
    assert pm.num_params == sum(int(np.size(v)) for v in case.params.values())
    back = pm.unravel(theta)
    assert set(back) == set(case.params)
    for name, value in case.params.items():
        assert back[name].shape == jnp.shape(value)
        _close(back[name], value, rtol=0, atol=0)
    theta2 = jnp.arange(pm.num_params, dtype=theta.dtype)
    _close(pm.ravel(pm.unravel(theta2)), theta2, rtol=0, atol=0)


def test_attributes(case):
    pm = _pm(case)
    assert pm.num_rows == len(case.rows)
    assert set(pm.latent_sites) == set(case.params)
    assert len(pm.latent_sites) == len(case.params)


@pytest.mark.parametrize(
    ("builder", "plate", "latents", "num_params"),
    [
        (case_logistic, "data", ("w", "b"), 4),
        (case_linreg, "data", ("w", "sigma"), 4),
        (case_dirichlet, "data", ("p",), 3),
        (case_matrix, "rows", ("mu", "a", "tau"), 6),
        (case_groups, "data", ("sd", "alpha"), 6),
    ],
)
def test_attribute_values(builder, plate, latents, num_params):
    c = builder()
    pm = PrivateModel(c.model, c.args, c.kwargs)  # auto-detected plate
    assert pm.data_plate == plate
    assert pm.latent_sites == latents
    assert pm.num_params == num_params
    assert pm.num_rows == len(c.rows)


def test_auto_detects_data_plate_next_to_parameter_plate():
    c = case_groups()
    pm = PrivateModel(c.model, c.args, c.kwargs)
    assert pm.data_plate == "data"
    assert pm.num_rows == 60
    assert pm.unravel(pm.ravel(c.params))["alpha"].shape == (5,)
    explicit = PrivateModel(c.model, c.args, c.kwargs, data_plate="data")
    _close(
        _terms(explicit, c.params, c.args, c.kwargs).loglik_rows,
        _terms(pm, c.params, c.args, c.kwargs).loglik_rows,
        rtol=0,
        atol=0,
    )


def test_groups_plate_cannot_be_data_plate():
    c = case_groups()
    with pytest.raises(ModelSpecificationError, match="outside the data plate"):
        PrivateModel(c.model, c.args, c.kwargs, data_plate="groups")


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


# ----------------------------------------------------------------------- 8. dataflow
def test_dataflow_direct_dependence():
    def fn(pub, priv):
        return {
            "a": pub["w"] * 2.0,
            "b": pub["w"] + priv["x"].sum(),
            "c": priv["x"] * 0.0,  # conservative: still reads the value
            "d": pub["v"],
            "e": priv["x"],
        }

    pub = {"w": jnp.ones(3), "v": jnp.zeros(2)}
    priv = {"x": jnp.ones((5, 3))}
    flags = depends_on_private(fn, pub, priv)
    assert flags == {"a": False, "b": True, "c": True, "d": False, "e": True}


def test_dataflow_through_jit():
    @jax.jit
    def inner(a, b):
        return a * 2.0, a + b.mean()

    def fn(pub, priv):
        clean, dirty = inner(pub, priv)
        return clean, dirty

    flags = depends_on_private(fn, jnp.ones(3), jnp.ones((4, 3)))
    # the analysis is conservative at call boundaries: a jitted call with a private
    # input taints all its outputs; what must never happen is a missed dependence
    assert flags[1] is True

    def fn_clean(pub, priv):
        return inner(pub, pub)[1], inner(pub, priv)[1]

    assert depends_on_private(fn_clean, jnp.ones(3), jnp.ones((4, 3))) == (False, True)


def test_dataflow_through_nested_jit():
    @jax.jit
    def leaf(b):
        return jnp.log1p(b**2).sum()

    @jax.jit
    def middle(a, b):
        return a + leaf(b)

    flags = depends_on_private(lambda p, q: (middle(p, q), middle(p, p)), jnp.ones(2), jnp.ones(6))
    assert flags == (True, False)


def test_inputs_read_agrees_with_one_trace_per_input():
    """``inputs_read`` (one trace, a label per input) marks exactly the inputs that
    ``depends_on_private`` finds, taking each in turn as the private one: through a
    jitted call, a cond's predicate, and an input read by nothing."""
    @jax.jit
    def inner(a, b):
        return a * b.sum()

    def fn(p):
        x = inner(p["a"], p["b"])
        y = lax.cond(p["c"] > 0, lambda w: w + 1.0, lambda w: w - 1.0, x.sum())
        return y + 0.0 * jnp.sum(p["unused"].shape[0])

    inputs = {"a": jnp.ones(3), "b": jnp.ones(2), "c": jnp.ones(()), "unused": jnp.ones(4)}
    read = inputs_read(fn, inputs)
    for name in inputs:
        others = {k: v for k, v in inputs.items() if k != name}
        one = depends_on_private(lambda o, x, name=name: fn({**o, name: x}), others,
                                 inputs[name])
        assert read[name] == bool(one), name
    assert read == {"a": True, "b": True, "c": True, "unused": False}


def test_dataflow_through_cond():
    def fn(pub, priv):
        # the predicate reads private data, the branches do not: implicit flow
        by_pred = lax.cond(priv.sum() > 0, lambda w: w + 1.0, lambda w: w - 1.0, pub)
        # the operand is private, the predicate public
        by_operand = lax.cond(pub.sum() > 0, lambda x: x.mean(), lambda x: 0.0 * x.sum(), priv)
        # neither predicate nor operands private
        clean = lax.cond(pub.sum() > 0, lambda w: w * 2.0, lambda w: w, pub)
        return by_pred, by_operand, clean

    assert depends_on_private(fn, jnp.ones(3), jnp.ones(5)) == (True, True, False)


def test_dataflow_through_closure_in_cond_and_loops():
    def fn(pub, priv):
        closed = lax.cond(pub.sum() > 0, lambda: priv.mean(), lambda: 0.0)
        looped = lax.fori_loop(0, 3, lambda i, acc: acc + priv[i], 0.0)
        scanned = lax.scan(lambda c, x: (c + x, None), pub.sum(), priv)[0]
        return closed, looped, scanned

    assert depends_on_private(fn, jnp.ones(3), jnp.ones(5)) == (True, True, True)


def test_dataflow_shape_only_is_not_private():
    def fn(pub, priv):
        n = priv.shape[0]
        return {
            "scaled": pub * n,
            "zeros": jnp.zeros(priv.shape),
            "like": jnp.ones_like(priv) * pub.sum(),
            "mean_of_index": pub / jnp.arange(priv.shape[0]).sum(),
            "size": jnp.asarray(priv.size, dtype=pub.dtype),
            "used": priv.sum() + pub.sum(),
        }

    flags = depends_on_private(fn, jnp.ones(3), jnp.ones((7, 2)))
    assert flags == {
        "scaled": False,
        "zeros": False,
        "like": False,
        "mean_of_index": False,
        "size": False,
        "used": True,
    }


def test_dataflow_pytree_structure_and_multiple_private_leaves():
    def fn(pub, priv):
        a, b = priv
        return [pub + a.sum(), (pub * 2, b.max())], pub

    flags = depends_on_private(fn, jnp.ones(2), (jnp.ones(4), jnp.ones(4)))
    assert flags == ([True, (False, True)], False)


def test_dataflow_uses_no_values():
    """Only shapes matter: the answer is the same for any values of the private input."""

    def fn(pub, priv):
        return lax.cond(priv[0] > 0, lambda: pub, lambda: pub * 0.0)

    for priv in (jnp.ones(3), -jnp.ones(3), jnp.full(3, jnp.nan)):
        assert depends_on_private(fn, jnp.ones(2), priv) is True


def test_model_check_uses_shapes_of_data_not_values():
    """A prior using only the number of rows (public) is accepted."""

    def model(X, y):
        n = X.shape[0]
        w = numpyro.sample("w", dist.Normal(0.0, 1.0 / np.sqrt(n)).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", n):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    pm = PrivateModel(model, (X, y))
    w = np.array([0.05, -0.1, 0.2])
    _close(_terms(pm, {"w": jnp.asarray(w)}, (X, y)).prior,
           stats.norm.logpdf(w, 0.0, 1.0 / np.sqrt(60)).sum())


def test_public_hyperparameter_array_is_not_data():
    """An array argument whose length is not n is public configuration."""

    def model(X, y, prior_mean):
        w = numpyro.sample("w", dist.Normal(prior_mean, 1.0).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    prior_mean = np.array([0.5, -0.5, 1.0])
    pm = PrivateModel(model, (X, y, prior_mean))
    w = np.array([0.1, 0.2, 0.3])
    terms = _terms(pm, {"w": jnp.asarray(w)}, (X, y, prior_mean), idx=jnp.arange(5))
    _close(terms.prior, stats.norm.logpdf(w, prior_mean, 1.0).sum())
    _close(terms.loglik_rows, stats.norm.logpdf(y[:5], X[:5] @ w, 1.0))


def test_logsumexp_mixture_likelihood():
    """A marginalised two-component mixture (the fix the latent-in-plate error suggests)."""

    def model(y):
        loc = numpyro.sample("loc", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        mix = dist.MixtureSameFamily(dist.Categorical(probs=jnp.array([0.3, 0.7])),
                                     dist.Normal(loc, 1.0))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", mix, obs=y)

    y = np.concatenate([_rng(1).normal(-2, 1, 20), _rng(2).normal(2, 1, 40)])
    pm = PrivateModel(model, (y,))
    loc = np.array([-1.8, 2.1])
    rows = _terms(pm, {"loc": jnp.asarray(loc)}, (y,)).loglik_rows
    expected = logsumexp(
        np.stack([np.log(0.3) + stats.norm.logpdf(y, loc[0]),
                  np.log(0.7) + stats.norm.logpdf(y, loc[1])]),
        axis=0,
    )
    _close(rows, expected)


def test_error_likelihood_reads_other_rows():
    """Standardising X inside the model makes every l_i depend on every row."""

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        Xs = (X - X.mean(0)) / 2.0
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(Xs @ w, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="reads other rows"):
        PrivateModel(model, (X + 1.0, y))


def test_error_hard_coded_plate_size():
    X, y = _data()
    n = X.shape[0]

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", n):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    with pytest.raises(ModelSpecificationError, match=r"X\.shape\[0\]"):
        PrivateModel(model, (X, y))


def test_row_terms_are_computed_from_each_row_alone():
    """Even a model that would mix rows in a way the setup check misses cannot: the
    kernel-facing l_i is the model run on row i alone."""

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w + 0.0 * X.sum(), 1.0), obs=y)

    X, y = _data()
    pm = PrivateModel(model, (X, y))
    jac = jax.jacfwd(lambda X: pm.log_density_terms({"w": jnp.ones(3)}, (X, y), {}).loglik_rows)(
        jnp.asarray(X))  # (n, n, d): d l_i / d X_j
    off_diagonal = jac.at[jnp.arange(len(X)), jnp.arange(len(X))].set(0.0)
    assert float(jnp.abs(off_diagonal).max()) == 0.0
