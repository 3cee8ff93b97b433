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


@pytest.fixture(autouse=True)
def no_default_warm_start(request, monkeypatch):
    """Most tests are about something else than the private warm start (issue 18),
    and it compiles for seconds: it is off by default here (a stated
    ``warm_start=`` still applies).  Tests marked ``warm_start`` run with the
    library's default, as a user would."""
    if request.node.get_closest_marker("warm_start") is None:
        import numpyro_dp.mcmc

        monkeypatch.setattr(numpyro_dp.mcmc, "auto_warm_start_share", lambda *a, **k: 0.0)


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


def float32_noise(release, truth, scale) -> bool:
    """The floating-point attacker's test (Mironov 2012): is every coordinate of
    ``release - truth`` a float32 number, or ``scale`` times one (to 2^-12 of its
    spacing)?  It holds for the true value when ``release = truth + scale * noise``
    is computed in float64 from float32 noise (or from a float32 product)."""
    diff = np.asarray(release, np.float64) - np.asarray(truth, np.float64)

    def is_float32(v):
        v32 = v.astype(np.float32)
        return np.abs(v - v32) <= 2.0**-12 * np.spacing(np.abs(v32))

    return bool(np.all(is_float32(diff / scale) | is_float32(diff)))


def attack_success(releases, truth, truth_neighbour) -> float:
    """How often the attacker attributes a release on D to D rather than its neighbour.

    ``releases``: ``(value, scale)`` pairs released on D; ``truth`` and
    ``truth_neighbour``: the statistic on D and on D'.  The attacker guesses D when
    :func:`float32_noise` holds for D only, D' when for D' only, and counts as right
    half the time otherwise (so 0.5 is chance).
    """
    score = 0.0
    for value, scale in releases:
        on_d = float32_noise(value, truth, scale)
        on_neighbour = float32_noise(value, truth_neighbour, scale)
        score += 0.5 if on_d == on_neighbour else float(on_d)
    return score / len(releases)


def on_coarse_grid(value, scale) -> bool:
    """Is every coordinate of ``value`` a multiple of the power of two just below scale / 2^9?"""
    cell = 2.0 ** (np.floor(np.log2(scale)) - 9)
    units = np.asarray(value, np.float64) / cell
    return bool(np.all(units == np.round(units)))
