"""The adapter's structure: data-free factors, deterministic sites, init_params,
ravel/unravel and attributes (:class:`numpyro_dp.PrivateModel`).

Reference values are written by hand with numpy/scipy in float64 (x64 is on
for every test of this module and restored afterwards).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.model_cases import (
    _close,
    _data,
    _minus_potential_energy,
    _pm,
    _stick_breaking,
    _terms,
    case_dirichlet,
    case_groups,
    case_linreg,
    case_logistic,
    case_matrix,
    linreg_model,
)
from numpyro.infer import init_to_median, init_to_uniform, init_to_value
from scipy import stats

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.checks import ModelSpecificationError

pytestmark = pytest.mark.usefixtures("model_x64")


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
def init_pm(model_x64):
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
