"""Clipped per-row gradient sums: every route equals a plain loop over rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import logistic_model
from _support.running import TEST_SECRET

from numpyro_dp.evaluation.models import banana_data, banana_model, gaussian_model
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives import clipping, gradients, route_choice, row_blocks, row_statistics
from numpyro_dp.primitives.clipping import clip_weights
from numpyro_dp.primitives.gradients import clipped_grad_sum_fn
from numpyro_dp.primitives.route_choice import ROUTES, select_route

N, K = 24, 3  # rows, covariates


def clipped_grad_sum(*args, **kwargs):
    """``clipped_grad_sum_fn`` with its double-word result added up (``hi + lo``)."""
    fn, taken = clipped_grad_sum_fn(*args, **kwargs)
    return (lambda *a: sum(fn(*a))), taken


def linreg_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 3))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, sigma), obs=y)


def student_model(X, y=None):
    # Rows feed the shared scale and degrees of freedom as well as x . w + b.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 3))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(nu, X @ w + b, sigma), obs=y)


def negbin_model(X, y=None):
    # Overdispersed counts: the rate c / mean meets the row as c + y, not a row value.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    c = numpyro.sample("c", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(X @ w), c), obs=y)


def entangled_model(X, y=None):
    # b reaches the row value and the shared scale: no coordinates of their own.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, jnp.exp(b)), obs=y)


def poisson_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)


def two_sites_model(X, y=None, z=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    v = numpyro.sample("v", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
        numpyro.sample("z", dist.Bernoulli(logits=X @ v), obs=z)


def factor_model(X, y=None):
    # Student-t-like robust regression written with a factor in the plate.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.factor("robust", -jnp.log1p((y - X @ w) ** 2))


def wide_model(X, Y=None):
    # The covariates meet the parameters elementwise before a nonlinearity and
    # the scales are per column: no cut narrower than theta itself.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("Y", dist.Normal(jnp.sin(X * w), jnp.exp(w)).to_event(1), obs=Y)


def nan_model(X, y=None):
    # sqrt of a linear predictor: rows with X @ w < 0 have a NaN gradient.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.factor("f", jnp.sqrt(X @ w))


def nan_shared_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.factor("f", jnp.sqrt(X @ w) * s - s**2)


J = 5  # groups of the hierarchical models


def hierarchical_model(X, g, y=None):
    # Centred group effects: each row reads one entry of ``a``.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0, 3))
    a = numpyro.sample("a", dist.Normal(mu, 1.0).expand([J]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] + X @ w, sigma), obs=y)


def hier_logistic_model(X, g, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    a = numpyro.sample("a", dist.Normal(0, 1).expand([3 * J]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=a[g] + X @ w), obs=y)


def slopes_model(x, g, y=None):
    # Random intercepts and slopes: each row reads two numbers of ``ab``, one twice.
    ab = numpyro.sample("ab", dist.Normal(0, 1).expand([J, 2]).to_event(2))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", x.shape[0]):
        loc = ab[g, 0] + ab[g, 1] * x + 0.1 * ab[g, 0] ** 2
        numpyro.sample("y", dist.Normal(loc, sigma), obs=y)


def two_reads_model(X, g, h, y=None):
    # Two reads of one block, at the same entry for about one row in J.
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    a = numpyro.sample("a", dist.Normal(0, 1).expand([J]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] - 0.5 * a[h] + X @ w, sigma), obs=y)


def linear_slopes_model(x, g, y=None):
    # Random intercepts and slopes entering linearly: a table of J x 2.
    ab = numpyro.sample("ab", dist.Normal(0, 1).expand([J, 2]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0, 1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b + ab[g, 0] + ab[g, 1] * x)), obs=y)


def non_centred_model(X, g, y=None):
    # a = mu + tau z: the rows read a function of the block, not the block.
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    z = numpyro.sample("z", dist.Normal(0, 1).expand([J]).to_event(1))
    a = 0.5 + tau * z
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] + X[:, 0], 1.0), obs=y)


def _data(name):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(N, K))
    if name == "logistic":
        return logistic_model, (X,), {"y": (rng.uniform(size=N) < 0.5).astype(float)}
    if name == "linreg":
        return linreg_model, (X,), {"y": 1.0 + X @ [1.0, -2.0, 0.5] + rng.normal(size=N)}
    if name == "student":
        return student_model, (X,), {"y": 1.0 + X @ [1.0, -2.0, 0.5] + rng.standard_t(3, size=N)}
    if name == "negbin":
        return negbin_model, (X,), {"y": rng.poisson(3.0, size=N).astype(float)}
    if name == "entangled":
        return entangled_model, (X,), {"y": X @ [1.0, -2.0, 0.5] + rng.normal(size=N)}
    if name == "poisson":
        return poisson_model, (X,), {"y": rng.poisson(2.0, size=N).astype(float)}
    if name == "banana":
        return banana_model, (np.asarray(banana_data(jax.random.PRNGKey(0), N)),), {}
    if name == "gaussian":
        A = rng.uniform(size=(K, K))
        return gaussian_model, (rng.normal(size=(N, K)), A @ A.T + np.eye(K)), {}
    if name == "two_sites":
        return two_sites_model, (X,), {
            "y": rng.normal(size=N), "z": (rng.uniform(size=N) < 0.5).astype(float)
        }
    if name == "factor":
        return factor_model, (X,), {"y": rng.standard_t(3, size=N)}
    if name == "wide":
        return wide_model, (X,), {"Y": rng.normal(size=(N, K))}
    if name == "nan":
        return nan_model, (X,), {}
    if name == "nan_shared":
        return nan_shared_model, (X,), {}
    g = rng.integers(0, J, size=N)
    if name == "hierarchical":
        return hierarchical_model, (X, g), {"y": rng.normal(size=N) + g}
    if name == "hier_logistic":
        return hier_logistic_model, (X, 3 * g), {"y": (rng.uniform(size=N) < 0.5).astype(float)}
    if name == "slopes":
        return slopes_model, (X[:, 0], g), {"y": rng.normal(size=N) * g}
    if name == "non_centred":
        return non_centred_model, (X, g), {"y": rng.normal(size=N) + g}
    if name == "two_reads":
        h = np.where(rng.uniform(size=N) < 0.3, g, rng.integers(0, J, size=N))
        return two_reads_model, (X, g, h), {"y": rng.normal(size=N) + g}
    if name == "linear_slopes":
        return linear_slopes_model, (X[:, 0], g), {"y": rng.poisson(2.0, size=N).astype(float)}
    raise KeyError(name)


# name -> (route auto takes, cut, m, q, coordinates in indexed blocks).  Only the
# single contraction of the linear predictor (m=1, and the q shared values on
# coordinates of their own) beats the general route.
GENERAL = ("jacobian", None, None, None, 0)
CONTRACTION = ("linear_predictor", "linear", 1, 0, 0)
EXPECTED = {
    "logistic": CONTRACTION,
    "linreg": ("linear_predictor", "linear", 1, 2, 0),  # sigma: log and square
    "student": ("linear_predictor", "linear", 1, 4, 0),
    "negbin": ("linear_predictor", "linear", 1, 2, 0),
    "entangled": GENERAL,
    "poisson": CONTRACTION,
    "banana": GENERAL,
    "gaussian": GENERAL,
    "two_sites": GENERAL,
    "factor": CONTRACTION,
    "wide": GENERAL,
    # The contraction with the group effects compressed: 3 + 1 + 2 numbers per row, not d.
    "hierarchical": ("linear_predictor", "linear", 1, 2, J),
    "hier_logistic": ("linear_predictor", "linear", 1, 0, 3 * J),
    "two_reads": ("linear_predictor", "linear", 1, 2, J),
    "linear_slopes": ("linear_predictor", "linear", 1, 0, 2 * J),
    # ab[g, 0] ** 2 is no linear predictor: the general route, compressed.
    "slopes": ("jacobian", None, None, None, 2 * J),
    "non_centred": CONTRACTION,
}


@functools.cache
def _setup(name):
    # Cached: building a PrivateModel runs its checks eagerly (~2 s per model).
    # Every caller runs under the x64 fixture, so the cached float64 values fit.
    model, args, kwargs = _data(name)
    pm = PrivateModel(model, args, kwargs)
    theta = pm.ravel(pm.init_params(jax.random.PRNGKey(2), args, kwargs))
    return pm, args, kwargs, theta


@functools.cache
def _row_grad_fn(name):
    pm, args, kwargs, _ = _setup(name)
    return jax.jit(jax.grad(
        lambda t, i: pm.log_density_terms(pm.unravel(t), args, kwargs, idx=i[None]).loglik_rows[0]
    ))


def _loop_reference(name, theta, clip=None):
    """Grad of each row's log-likelihood, clipped, summed: a plain Python loop."""
    row_grad = _row_grad_fn(name)
    num_rows = _setup(name)[0].num_rows
    grads = np.stack([np.asarray(row_grad(theta, jnp.asarray(i))) for i in range(num_rows)])
    norms = np.linalg.norm(grads, axis=1)
    finite = np.isfinite(norms)
    if clip is None:  # clip about half of the rows
        clip = float(np.median(norms[finite]))
    total = np.zeros(grads.shape[1])
    for g, nrm, ok in zip(grads, norms, finite, strict=True):
        if ok:
            total += g * min(1.0, clip / nrm)
    return total, clip, norms


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_routes_equal_loop_over_rows(x64, name):
    pm, args, kwargs, theta = _setup(name)
    ref, clip, norms = _loop_reference(name, theta)
    assert 0 < np.sum(norms > clip) < pm.num_rows  # the clip bites on some rows only
    route, cut, m, q, indexed = EXPECTED[name]
    choice = select_route(pm, args, kwargs)
    assert (choice.route, choice.cut, choice.row_width, choice.shared_width,
            choice.indexed) == (route, cut, m, q, indexed)
    routes = ["auto", "jacobian"]
    try:  # a forced linear predictor, where the model has a narrow cut
        select_route(pm, args, kwargs, "linear_predictor")
        routes.append("linear_predictor")
    except ValueError:
        assert name in ("wide", "banana", "gaussian", "two_sites", "slopes")
    for r in routes:
        fn, taken = clipped_grad_sum(pm, r, args, kwargs)
        assert taken == (route if r == "auto" else r)
        out = jax.jit(fn)(theta, clip, args, kwargs)
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10 * (1 + np.abs(ref).max()))


@pytest.mark.parametrize("block", [5, 8, N])  # 5 blocks of 4 + 4 rows; 3 blocks of 8; one
@pytest.mark.parametrize("name", ["linreg", "nan", "hierarchical"])
def test_general_route_in_blocks_equals_loop_over_rows(x64, monkeypatch, name, block):
    monkeypatch.setattr(row_blocks, "ROW_BLOCK", block)
    pm, args, kwargs, theta = _setup(name)
    ref, clip, _ = _loop_reference(name, theta)
    fn, _ = clipped_grad_sum(pm, "jacobian")
    out = jax.jit(fn)(theta, clip, args, kwargs)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10 * (1 + np.abs(ref).max()))


@pytest.mark.slow  # make test-all: float64 sums in every block size (23 s)
def test_tuning_sums_and_row_values_in_blocks_equal_one_block(x64, monkeypatch):
    pm, args, kwargs, theta = _setup("linreg")
    whole = (row_statistics.clipped_grad_and_hessian_sums(pm, theta, 0.7, 2.0, args, kwargs),
             row_statistics.row_gradient_scales(pm, theta, args, kwargs),
             row_statistics.row_hessian_norms(pm, theta, args, kwargs))
    for module, name in ((row_blocks, "ROW_BLOCK"), (row_statistics, "HESSIAN_BLOCK")):
        monkeypatch.setattr(module, name, 5)  # 5 blocks of 4 rows and 4 rows left over
    blocked = (row_statistics.clipped_grad_and_hessian_sums(pm, theta, 0.7, 2.0, args, kwargs),
               row_statistics.row_gradient_scales(pm, theta, args, kwargs),
               row_statistics.row_hessian_norms(pm, theta, args, kwargs))
    assert blocked[1].shape == blocked[2].shape == (N,)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12),
                 whole, blocked)


@pytest.mark.parametrize("name", ["poisson", "linreg", "two_reads"])
def test_vmap_over_thetas_and_traced_clip(x64, name):
    pm, args, kwargs, theta = _setup(name)
    thetas = theta + 0.3 * jax.random.normal(jax.random.PRNGKey(3), (3,) + theta.shape)
    fn, _ = clipped_grad_sum(pm, "auto")
    batched = jax.jit(jax.vmap(fn, (0, None, None, None)))(thetas, 0.7, args, kwargs)
    for t, out in zip(thetas, batched, strict=True):
        ref, _, _ = _loop_reference(name, t, clip=0.7)
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)
    # A clip that is itself vmapped (e.g. per chain) is a traced scalar.
    clips = jnp.array([0.1, 0.7, 5.0])
    per_clip = jax.jit(jax.vmap(fn, (None, 0, None, None)))(theta, clips, args, kwargs)
    for c, out in zip(clips, per_clip, strict=True):
        ref, _, _ = _loop_reference(name, theta, clip=float(c))
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["nan", "nan_shared"])
def test_nonfinite_rows_contribute_zero(x64, name):
    pm, args, kwargs, theta = _setup(name)
    ref, clip, norms = _loop_reference(name, theta)
    assert 0 < np.sum(~np.isfinite(norms)) < pm.num_rows
    for r in ("auto", "linear_predictor", "jacobian"):
        fn, _ = clipped_grad_sum(pm, r)
        out = jax.jit(fn)(theta, clip, args, kwargs)
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)


def test_forced_routes(x64):
    pm, args, kwargs, theta = _setup("poisson")
    ref, clip, _ = _loop_reference("poisson", theta)
    fn, taken = clipped_grad_sum(pm, "linear_predictor", args, kwargs)
    assert taken == "linear_predictor"
    np.testing.assert_allclose(jax.jit(fn)(theta, clip, args, kwargs), ref, rtol=1e-10)


def test_forced_linear_predictor_on_unsuitable_model_raises(x64):
    pm, args, kwargs, theta = _setup("wide")
    with pytest.raises(ValueError, match="does not apply to this model.*m <="):
        clipped_grad_sum(pm, "linear_predictor", args, kwargs)
    fn, taken = clipped_grad_sum(pm, "linear_predictor")  # no example: checked when traced
    assert taken == "linear_predictor"
    with pytest.raises(ValueError, match="does not apply"):
        fn(theta, 1.0, args, kwargs)
    with pytest.raises(ValueError, match="grad_route"):
        clipped_grad_sum(pm, "fast")
    assert clipped_grad_sum(pm, "auto")[1] == "auto"
    assert ROUTES == ("auto", "jacobian", "linear_predictor")


@pytest.mark.parametrize("d", [3, clipping.UNROLLED_NORM + 1])  # slices added; one reduction
def test_column_squared_norms_are_those_of_the_rows(x64, d):
    rows = jax.random.normal(jax.random.PRNGKey(0), (50, d)).at[7, 1].set(jnp.nan)
    norms = jnp.sqrt(clipping.column_squared_norms(rows.T))
    np.testing.assert_allclose(norms, jnp.linalg.norm(rows, axis=1), rtol=1e-14)
    assert np.isnan(norms[7]) and clip_weights(norms, 1.0)[7] == 0


def test_clip_weights():
    w = clip_weights(jnp.array([0.5, 2.0, 0.0, jnp.nan, jnp.inf]), 1.0)
    np.testing.assert_allclose(w, [1.0, 0.5, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("name", ["linreg", "hierarchical"])
def test_dp_hmc_routes_agree(x64, name):
    """The kernel's trajectories do not depend on the route (same keys, same noise)."""
    from numpyro_dp.kernels.hmc import dp_hmc

    pm, args, kwargs, _ = _setup(name)
    states = {}
    for route in ("linear_predictor", "jacobian"):
        init_fn, sample_fn = dp_hmc(
            pm, 0, num_steps=2, noise_multiplier_grad=2.0, noise_multiplier_llr=2.0,
            sensitivity_factor=2.0, adapt_step_size=False, adapt_mass_matrix=False,
            grad_route=route,
        )
        state = init_fn(pm.init_params(jax.random.PRNGKey(0), args, kwargs), 0.05, None,
                        jax.random.PRNGKey(1))
        step = functools.partial(sample_fn, model_args=args, model_kwargs=kwargs,
                                 secret=TEST_SECRET, grad_clip=1.0, llr_clip=1.0)
        state = jax.jit(lambda s, step=step: jax.lax.fori_loop(0, 3, lambda i, s: step(s), s))(
            state
        )
        states[route] = pm.ravel(state.z)
    np.testing.assert_allclose(states["linear_predictor"], states["jacobian"], rtol=1e-9,
                               atol=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["hierarchical", "slopes", "two_reads", "linear_slopes"])
def test_indexed_blocks_give_the_dense_sum(request, dtype, name):
    """Compressing the group effects, on the general route and in the linear
    predictor's contraction, gives the dense route's sum (same grid), with
    minibatch indices and masks; the per-row gradients are computed by different
    programs, so in float32 they agree to a few units in the last place."""
    if dtype == np.float64:
        request.getfixturevalue("x64")
    model, _, _ = _data(name)
    rng = np.random.default_rng(5)
    n = 3000
    X = rng.normal(size=(n, K)).astype(dtype)
    g = rng.integers(0, J, size=n)
    args = {"slopes": (X[:, 0], g), "linear_slopes": (X[:, 0], g),
            "two_reads": (X, g, np.where(rng.uniform(size=n) < 0.3, g, rng.integers(0, J, n)))
            }.get(name, (X, g))
    y = rng.poisson(2.0, size=n) if name == "linear_slopes" else rng.normal(size=n) * 3 + g
    kwargs = {"y": y.astype(dtype)}
    pm = PrivateModel(model, args, kwargs)
    theta = pm.ravel(pm.init_params(jax.random.PRNGKey(2), args, kwargs)).astype(dtype)
    plan = route_choice.plan_route(pm, theta.shape, theta.dtype, args, kwargs, "jacobian")
    assert plan.indexed is not None
    auto, taken = clipped_grad_sum_fn(pm, "auto", args, kwargs)
    assert taken == ("jacobian" if name == "slopes" else "linear_predictor")
    idx, mask = jnp.arange(0, n, 3), jnp.arange(n // 3) % 4 > 0
    for kw in ({}, {"idx": idx, "mask": mask}):
        dense = sum(jax.jit(lambda t, c, kw=kw: gradients._jacobian_sum(
            pm, None, t, c, args, kwargs, **kw))(theta, 1.5))
        compressed = jax.jit(lambda t, c, kw=kw: gradients._jacobian_sum(
            pm, plan, t, c, args, kwargs, **kw))(theta, 1.5)
        fast = jax.jit(lambda t, c, kw=kw: auto(t, c, args, kwargs, **kw))(theta, 1.5)
        tol = 1e-12 if dtype == np.float64 else 1e-5
        for out in (compressed, fast):
            np.testing.assert_allclose(sum(out), dense, rtol=tol,
                                       atol=tol * float(jnp.abs(dense).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["student", "linreg", "nan_shared"])
def test_shared_value_contraction_gives_the_dense_sum(request, dtype, name):
    """The linear predictor's contraction with shared values on their own
    coordinates gives the general route's sum (same grid), also with minibatch
    indices and masks; different programs, so float32 agrees to a few ulps."""
    if dtype == np.float64:
        request.getfixturevalue("x64")
    model, _, _ = _data(name)
    rng = np.random.default_rng(6)
    n = 3000
    X = rng.normal(size=(n, K)).astype(dtype)
    kwargs = {} if name == "nan_shared" else {
        "y": (X @ [1.0, -2.0, 0.5] + rng.standard_t(3, size=n)).astype(dtype)}
    pm = PrivateModel(model, (X,), kwargs)
    theta = pm.ravel(pm.init_params(jax.random.PRNGKey(2), (X,), kwargs)).astype(dtype)
    plan = route_choice.plan_route(pm, theta.shape, theta.dtype, (X,), kwargs)
    assert plan.choice.route == "linear_predictor" and plan.shared_coords
    auto, _ = clipped_grad_sum_fn(pm, "auto")
    general, _ = clipped_grad_sum_fn(pm, "jacobian")
    idx, mask = jnp.arange(0, n, 3), jnp.arange(n // 3) % 4 > 0
    for kw in ({}, {"idx": idx, "mask": mask}):
        fast = sum(jax.jit(lambda t, c, kw=kw: auto(t, c, (X,), kwargs, **kw))(theta, 1.5))
        dense = sum(jax.jit(lambda t, c, kw=kw: general(t, c, (X,), kwargs, **kw))(theta, 1.5))
        assert np.all(np.isfinite(fast))
        tol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(fast, dense, rtol=tol, atol=tol * float(jnp.abs(dense).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, entries, width", [(1000, 7, 1), (300_000, 13, 3), (3_000_000, 5, 1)])
def test_exact_segment_sum_is_exact_sum_of_the_scattered_rows(request, dtype, n, entries, width):
    """Bit for bit, also when a segment's total needs more bits than the integer type
    (3e6 one-signed rows in float32: three chunks), and at the second level."""
    from numpyro_dp.primitives.rounding import exact_segment_sum, exact_sum

    if dtype == np.float64:
        request.getfixturevalue("x64")
    rng = np.random.default_rng(n)
    values = rng.normal(size=(n, width)).astype(dtype)
    values /= np.maximum(1, np.linalg.norm(values, axis=1, keepdims=True))
    values[: n // 2] = np.abs(values[: n // 2])
    ids = rng.integers(0, entries, size=n)
    dense = np.zeros((n, entries, width), dtype)
    dense[np.arange(n), ids] = values
    dense = jnp.asarray(dense.reshape(n, entries * width))
    for levels in (1, 2):
        sparse = exact_segment_sum(jnp.asarray(values), jnp.asarray(ids), entries, 1.0,
                                   levels=levels)
        for a, b in zip(sparse, exact_sum(dense, 1.0, levels=levels), strict=True):
            np.testing.assert_array_equal(np.asarray(a).ravel(), b)
