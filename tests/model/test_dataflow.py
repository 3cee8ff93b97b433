"""What the likelihood reads of the data (:mod:`numpyro_dp.model.dataflow`):
dependence through jit, cond and loops, from shapes and structure only.

Reference values are written by hand with numpy/scipy in float64 (x64 is on
for every test of this module and restored afterwards).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.model_cases import (
    _close,
    _data,
    _rng,
    _terms,
)
from jax import lax
from scipy import stats
from scipy.special import logsumexp

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.dataflow import depends_on_private, inputs_read

pytestmark = pytest.mark.usefixtures("model_x64")


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
