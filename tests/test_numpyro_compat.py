"""NumPyro's internals that numpyro_dp.numpyro_compat relies on, checked on the installed NumPyro.

If one of these fails after a NumPyro upgrade, numpyro_compat is the one
module to adapt; PrivateMCMC's privacy (no data after a run, every iteration
charged) depends on it.
"""


import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import numpyro.infer.mcmc
import numpyro.util
import pytest
from numpyro.infer import MCMC, NUTS

from numpyro_dp import numpyro_compat


def model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)


X = np.linspace(-1.0, 1.0, 20)


def test_mcmc_keeps_what_the_compat_module_reads():
    mcmc = MCMC(NUTS(model), num_warmup=5, num_samples=5, progress_bar=False)
    assert numpyro_compat.warmup_state(mcmc) is None
    assert not numpyro_compat.has_draws(mcmc)
    mcmc.warmup(jax.random.PRNGKey(0), X)
    assert numpyro_compat.warmup_state(mcmc) is not None
    params = numpyro_compat.collection_params(mcmc)
    assert {"phase", "upper"} <= set(params)
    mcmc.run(jax.random.PRNGKey(1), X)
    assert numpyro_compat.has_draws(mcmc)
    # The model arguments of a run are where guard_data shadows them.
    for name in numpyro_compat.DATA_ATTRIBUTES:
        assert hasattr(mcmc, name)
    assert mcmc._args[0] is X


def test_mcmc_runs_its_chains_through_its_modules_fori_collect(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[:2])
        return numpyro.util.fori_collect(*args, **kwargs)

    monkeypatch.setattr(numpyro.infer.mcmc, "fori_collect", spy)
    MCMC(NUTS(model), num_warmup=5, num_samples=5, progress_bar=False).run(
        jax.random.PRNGKey(0), X)
    assert calls == [(5, 10)]  # collect from the end of warm-up


def test_guard_data_refuses_to_read_outside_a_run():
    @numpyro_compat.guard_data(lambda: RuntimeError("no data here"))
    class Guarded:
        _data = None

    g = Guarded()
    with pytest.raises(RuntimeError, match="no data here"):
        _ = g._args
    g._args = (1, 2)
    g._kwargs = {"y": 3}
    assert (g._args, g._kwargs) == ((1, 2), {"y": 3})
    g._data = None
    with pytest.raises(RuntimeError):
        _ = g._kwargs
