"""Models and cases of the model adapter's tests (``tests/model``): each case a
model, its data and its per-row log-likelihoods written by hand with numpy/scipy in
float64."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.util import potential_energy
from scipy import stats
from scipy.special import expit

from numpyro_dp.model.adapter import PrivateModel

RTOL = 1e-10
ATOL = 1e-10


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


def _data(n=60, d=3, seed=0):
    rng = _rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ np.ones(d) + rng.normal(size=n)
    return X, y
