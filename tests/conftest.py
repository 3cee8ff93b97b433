"""Shared fixtures: small data sets and models with known structure."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def make_logistic_data(n, d, seed=0, w_true=None):
    """Covariates with ||x_i|| <= 1, so |l_i(w') - l_i(w)| <= ||w' - w||: with
    llr_clip >= 1 no log-likelihood ratio is ever clipped."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    w = np.linspace(1.0, -1.0, d) if w_true is None else np.asarray(w_true)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-X @ w))).astype(np.float32)
    return X.astype(np.float32), y


@pytest.fixture(scope="session")
def logistic_data():
    return make_logistic_data(2000, 3)


@pytest.fixture
def x64():
    """Run a test in float64 and restore the previous setting afterwards."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


#: A fixed run secret for tests that call a kernel's functional core directly
#: (PrivateMCMC draws a fresh one from the OS at every run).
TEST_SECRET = np.array([2718281828, 3141592653], np.uint32)


def armed_init(kernel, rng_key, *args, init_params=None, num_warmup=0, **kwargs):
    """``kernel.init`` as PrivateMCMC calls it: armed, with the run's inputs.

    Tests only: nothing is charged.
    """
    from numpyro_dp.kernels.base import RunInputs

    pm = kernel.prepare(args, kwargs)
    inputs = RunInputs(pm.private_inputs(args, kwargs), TEST_SECRET)
    with kernel.armed(object()):
        return kernel.init(rng_key, num_warmup, init_params, (inputs,), {})
