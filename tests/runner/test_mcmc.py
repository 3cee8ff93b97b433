"""PrivateMCMC behaves as numpyro.infer.MCMC, and bad arguments get clear errors."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import logistic_model
from _support.running import armed_init
from numpyro.infer import HMC, init_to_value

import numpyro_dp as ndp


@pytest.fixture(scope="module")
def data():
    from _support.data import make_logistic_data

    return make_logistic_data(500, 2, seed=1)


@pytest.mark.slow
def test_chain_methods_and_numpyro_api(data, capsys):
    X, y = data
    for chain_method in ("sequential", "vectorized", "parallel"):
        kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
        with pytest.warns(UserWarning) if chain_method == "parallel" else _nothing():
            mcmc = ndp.PrivateMCMC(kernel, num_warmup=20, num_samples=30, num_chains=2,
                                   epsilon=3.0, delta=1e-6, chain_method=chain_method,
                                   progress_bar=False, warm_start=0)
        mcmc.run(jax.random.PRNGKey(0), X, y=y, extra_fields=("proposal_scale",))
        assert mcmc.get_samples()["w"].shape == (60, 2)
        assert mcmc.get_samples(group_by_chain=True)["w"].shape == (2, 30, 2)
        assert mcmc.get_extra_fields()["proposal_scale"].shape == (60,)
        assert mcmc.privacy_spent().num_releases == 2 * 50
    mcmc.print_summary()
    out = capsys.readouterr().out
    assert "w[0]" in out and "r_hat" in out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_init_params_are_honoured_and_never_searched_on_data(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=1e6,
                           proposal_scale=1e-3, adapt_step_size=False)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=3, delta=1e-6, progress_bar=False)
    start = {"w": np.array([0.3, -0.2], np.float32)}
    mcmc.run(jax.random.PRNGKey(0), X, y=y, init_params=start)
    first = np.asarray(mcmc.get_samples()["w"][0])
    assert np.linalg.norm(first - start["w"]) < 0.05
    strategy = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=1e6,
                             init_strategy=init_to_value(values={"w": np.array([1.0, 1.0])}))
    state = armed_init(strategy, jax.random.PRNGKey(0), X, y=y)
    np.testing.assert_allclose(state.z["w"], [1.0, 1.0])


def test_constrained_latents_are_returned_in_their_support():
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0]) + 0.5 * rng.normal(size=300)).astype(np.float32)
    kernel = ndp.DPPenalty(model, llr_clip=20.0, proposal_scale=0.05)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=300, num_samples=300, epsilon=1e6, delta=1e-6,
                           reproducible_noise=True,
                           progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    sigma = np.asarray(mcmc.get_samples()["sigma"])
    assert np.all(sigma > 0)
    assert abs(np.median(sigma) - 0.5) < 0.15


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"llr_clip": 0.0}, "llr_clip"),
        ({"llr_clip": -1.0}, "llr_clip"),
        ({"llr_clip": float("nan")}, "llr_clip"),
        ({"llr_clip": 1.0, "proposal_scale": 0.0}, "proposal_scale"),
        ({"llr_clip": 1.0, "noise_multiplier": -2.0}, "noise_multiplier"),
        ({"llr_clip": 1.0, "temperature": 0.0}, "temperature"),
        ({"llr_clip": 1.0, "temperature": 1.5}, "temperature"),
        ({"llr_clip": 1.0, "neighbourhood": "replace"}, "neighbourhood"),
        ({"llr_clip": 1.0, "proposal": "hmc"}, "proposal"),
        ({"llr_clip": 1.0, "target_accept_prob": 1.0}, "target_accept_prob"),
    ],
)
def test_bad_kernel_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ndp.DPPenalty(logistic_model, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epsilon": 0.0, "delta": 1e-6}, "epsilon"),
        ({"epsilon": -1.0, "delta": 1e-6}, "epsilon"),
        ({"epsilon": float("inf"), "delta": 1e-6}, "epsilon"),
        ({"epsilon": 1.0, "delta": 0.0}, "delta"),
        ({"epsilon": 1.0, "delta": 1.0}, "delta"),
        ({"epsilon": 1.0}, "delta"),
        ({"delta": 1e-6}, "noise_multiplier"),
        ({"epsilon": 1.0, "delta": 1e-6, "accountant": "moments"}, "accountant"),
    ],
)
def test_bad_budgets(kwargs, match):
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0)
    with pytest.raises(ValueError, match=match):
        ndp.PrivateMCMC(kernel, num_warmup=10, num_samples=10, **kwargs)


def test_non_private_kernel_is_refused():
    with pytest.raises(TypeError, match="differentially private kernel"):
        ndp.PrivateMCMC(HMC(logistic_model), num_warmup=1, num_samples=1, epsilon=1.0,
                        delta=1e-6)


def test_bad_data_is_rejected_before_anything_is_charged(data):
    X, y = data
    X = X.copy()
    X[7, 0] = np.nan
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, epsilon=1.0, delta=1e-6,
                           progress_bar=False)
    with pytest.raises(ndp.ModelSpecificationError, match="NaN") as err:
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert "7" not in str(err.value)
    assert mcmc.privacy_spent().num_releases == 0


@pytest.mark.slow
def test_huge_and_tiny_epsilon_calibrate(data):
    X, y = data
    for epsilon in (0.01, 1e7):
        kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
        mcmc = ndp.PrivateMCMC(kernel, num_warmup=10, num_samples=10, num_chains=2,
                               epsilon=epsilon, delta=1e-6, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
        spent = mcmc.privacy_spent()
        assert epsilon * (1 - 1e-4) <= spent.epsilon <= epsilon
        assert str(spent).startswith(f"({spent.epsilon:.4g}, 1e-06)-DP")


@pytest.mark.slow
def test_float64_run(data, x64):
    X, y = (np.asarray(a, np.float64) for a in data)
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05,
                           proposal="guided")
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=50, num_samples=50, epsilon=5.0, delta=1e-6,
                           progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert mcmc.get_samples()["w"].dtype == np.float64
    assert mcmc.last_state.accept_prob.dtype == np.float64
