"""Simulation-based calibration (issue 37): the harness tells a calibrated route from
an overconfident one, and NoiseAwareNUTS is calibrated on a logistic model."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_dp as ndp

SIGMA = 1.0  # the rows' noise sd in the conjugate model


def normal_mean(n, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", n):
        numpyro.sample("y", dist.Normal(mu, SIGMA), obs=y)


def exact_route(shrink=1.0):
    """Draws of the conjugate posterior of ``normal_mean`` (``shrink`` < 1: too narrow)."""
    def route(key, n, y):
        precision = 1.0 + n / SIGMA**2
        mean = jnp.sum(y) / SIGMA**2 / precision
        return {"mu": mean + shrink * jax.random.normal(key, (200,)) / jnp.sqrt(precision)}
    return route


def test_harness_passes_the_exact_posterior_and_fails_an_overconfident_one():
    """Power: 200 simulations of one coordinate, coverage se 2.1% at 90%: draws a third
    too narrow (coverage about 68%) fail by 10 standard errors."""
    exact = ndp.evaluation.sbc(exact_route(), normal_mean, 30, num_simulations=200)
    assert exact.passed, exact
    assert exact.ranks.shape == (200, 1) and exact.names == ("mu",)
    narrow = ndp.evaluation.sbc(exact_route(shrink=2 / 3), normal_mean, 30, num_simulations=200)
    assert not narrow.passed and narrow.coverage[0.9] < 0.8, narrow
    assert "FAILED" in str(narrow)


@pytest.mark.slow  # make test-all: NUTS compiles once per simulation (about a minute)
def test_nuts_is_the_yardstick_on_the_same_simulations():
    """nuts_route: NumPyro's NUTS on the simulated rows passes where the exact
    posterior does (40 simulations; its draws are the latents only)."""
    route = ndp.evaluation.nuts_route(normal_mean, num_warmup=100, num_samples=200)
    result = ndp.evaluation.sbc(route, normal_mean, 30, num_simulations=40)
    assert result.passed, result
    assert result.names == ("mu",) and result.num_draws == 200


def test_refused_simulations_are_counted_not_ranked():
    """A route that refuses a simulated data set (UnusableReleaseError after its charge)
    leaves it out of the ranks and counts it; refusing all of them is an error."""
    def sometimes(key, n, y):
        if float(jnp.mean(y)) > 0.5:
            raise ndp.UnusableReleaseError("anchor too far")
        return exact_route()(key, n, y)

    result = ndp.evaluation.sbc(sometimes, normal_mean, 30, num_simulations=40)
    assert 0 < result.refused < 40 and result.ranks.shape == (40 - result.refused, 1)
    assert f"({result.refused} more refused)" in str(result)

    def never(key, n, y):
        raise ndp.UnusableReleaseError("anchor too far")

    with pytest.raises(ValueError, match="refused all 5"):
        ndp.evaluation.sbc(never, normal_mean, 30, num_simulations=5)


def test_calibration_warnings_are_counted_and_coverage_given_without_them():
    """A run that warns (CalibrationWarning) is ranked, as a user who ignores the warning
    gets it, and counted; the coverage of the runs that did not warn is given apart
    (here the warned runs are a third too narrow, the others exact).  Other warnings
    reach the caller."""
    def warns(key, n, y):
        wide = float(jnp.mean(y)) <= 0.0
        if not wide:
            warnings.warn("anchor far from the mode", ndp.CalibrationWarning, stacklevel=1)
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
        return exact_route(1.0 if wide else 2 / 3)(key, n, y)

    with pytest.warns(RuntimeWarning, match="something else"):
        result = ndp.evaluation.sbc(warns, normal_mean, 30, num_simulations=200)
    assert 50 < result.warned < 150 and result.ranks.shape == (200, 1)
    assert abs(result.unwarned_coverage[0.9] - 0.9) < 0.08
    assert result.coverage[0.9] < result.unwarned_coverage[0.9]
    assert f"{result.warned} of them with a CalibrationWarning" in str(result)


def logistic(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + X @ w), obs=y)


@pytest.mark.slow  # make test-all: 24 private runs (about 4 minutes on one core)
def test_noise_aware_nuts_is_calibrated():
    """24 simulations x 3 coordinates at epsilon = 3, n = 2000: coverage se 3.5% at 90%
    and 5.9% at 50%; an interval that covers 75% or less at the 90% level fails with
    probability about 0.8, one at 70% with probability 0.96 (binomial, 72 cells)."""
    X = np.random.default_rng(0).uniform(-1, 1, size=(2000, 2)).astype(np.float32)
    route = ndp.evaluation.noise_aware_route(logistic, 3.0, 1e-6, num_warmup=200,
                                             num_samples=200)
    result = ndp.evaluation.sbc(route, logistic, X, num_simulations=24)
    assert result.passed, result
