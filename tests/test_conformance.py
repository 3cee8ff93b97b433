"""Every kernel releases exactly what it is charged for (issue 17).

Each release of every kernel goes through one of three gates: ``grid_release``
(the Gaussian releases of the full-data, gradient and stochastic-gradient
kernels, and the subsampled penalty) and ``barker_decision`` (DP Barker).  The
tests route them through a counter that runs *inside* the compiled sampler
(``jax.debug.callback``, once per chain under ``vmap``), and compare the count
with what the ledger charged, for every kernel and configuration (full data
and minibatches): 1 chain (``warmup()`` then ``run()``), 4 chains vectorized
with a continuation from ``post_warmup_state``, a refused run, and 2 chains
with ``chain_method="parallel"`` in a subprocess with two forced host devices
(on one device NumPyro falls back to sequential chains).  ``make test-all``
adds 2 chains run sequentially (twice: a second run without ``post_warmup_state``
warms up again), the add/remove neighbourhood, the parallel chains and the
variants of each family (guided DPPenalty, Poisson DPSGLD, DPSGHMC, DPSGNHT).

Every kernel also keeps the State/Info contract (issue 19) and refuses bad
input (NaN data, no data plate, a discrete latent) with an error that names
the problem, before anything is charged or released.
"""

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import logistic_model, make_logistic_data

import numpyro_dp as ndp
from numpyro_dp.kernels import barker, base, penalty

N = 120

#: name -> (kernel factory(neighbourhood, m=model), neighbourhoods, accountant,
#: releases per iteration)
KERNELS = {
    "DPPenalty": (
        lambda nb, m=logistic_model: ndp.DPPenalty(m, llr_clip=1.0, proposal_scale=0.05,
                                 noise_multiplier=2.0, neighbourhood=nb),
        ("substitute", "add_remove"), "pld", 1),
    "DPPenalty-guided": (
        lambda nb, m=logistic_model: ndp.DPPenalty(m, llr_clip=1.0, proposal_scale=0.05,
                                 proposal="guided", noise_multiplier=2.0, neighbourhood=nb),
        ("substitute",), "pld", 1),
    "DPMinibatchPenalty": (
        lambda nb, m=logistic_model: ndp.DPMinibatchPenalty(m, llr_clip=1.0, proposal_scale=0.05,
                                 batch_size=40, temperature=0.3, noise_multiplier=2.0),
        ("substitute",), "rdp", 1),
    "DPBarker": (
        lambda nb, m=logistic_model: ndp.DPBarker(m, batch_size=60, proposal_scale=0.05, n0=30),
        ("substitute",), "rdp", 1),
    "DPHMC": (
        lambda nb, m=logistic_model: ndp.DPHMC(m, step_size=0.05, num_steps=2, grad_clip=1.0,
                             llr_clip=1.0, noise_multiplier_grad=3.0,
                             noise_multiplier_llr=2.0, neighbourhood=nb),
        ("substitute", "add_remove"), "pld", 2 + 2),
    "DPMALA": (
        lambda nb, m=logistic_model: ndp.DPMALA(m, step_size=0.05, grad_clip=1.0, llr_clip=1.0,
                              noise_multiplier_grad=3.0, noise_multiplier_llr=2.0,
                              neighbourhood=nb),
        ("substitute", "add_remove"), "pld", 3),
    "DPSGLD-poisson": (
        lambda nb, m=logistic_model: ndp.DPSGLD(m, step_size=1e-3, batch_size=30, grad_clip=1.0,
                              neighbourhood=nb),
        ("substitute", "add_remove"), "pld", 1),
    "DPSGLD-without-replacement": (
        lambda nb, m=logistic_model: ndp.DPSGLD(m, step_size=1e-3, batch_size=30, grad_clip=1.0,
                              batching="without_replacement"),
        ("substitute",), "rdp", 1),
    "DPSGHMC": (
        lambda nb, m=logistic_model: ndp.DPSGHMC(m, step_size=1e-3, batch_size=30, grad_clip=1.0,
                               num_steps=2, neighbourhood=nb),
        ("substitute", "add_remove"), "pld", 2),
    "DPSGNHT-decreasing": (
        lambda nb, m=logistic_model: ndp.DPSGNHT(m, step_size=1e-3, batch_size=30, grad_clip=1.0,
                               num_steps=2, step_schedule="decreasing", neighbourhood=nb),
        ("substitute",), "pld", 2),
}
@pytest.fixture(scope="module")
def data():
    return make_logistic_data(N, 2, seed=11)


class Made(list):
    """Releases recorded at run time; ``len`` waits for pending callbacks first."""

    def __len__(self):
        jax.effects_barrier()  # callbacks run asynchronously (pmap in particular)
        return super().__len__()


@pytest.fixture
def releases(monkeypatch):
    """Count the releases made at run time (one per chain under vmap)."""
    made = Made()
    for module in (base, penalty):
        monkeypatch.setattr(module, "grid_release", releases_counter(made, module.grid_release))
    monkeypatch.setattr(barker, "barker_decision",
                        releases_counter(made, barker.barker_decision))
    return made


def releases_counter(made, gate):
    """``gate`` that appends to ``made`` once per call (per chain under vmap)."""
    @functools.wraps(gate)
    def wrapper(key, *args, **kwargs):
        # The (secret, per-chain) key is batched under vmap: one call per chain.
        jax.debug.callback(lambda _: made.append(1), jax.random.key_data(key))
        return gate(key, *args, **kwargs)
    return wrapper


def check_state_and_info(mcmc):
    """The state carries the last transition's Info; each Info field reads on the
    state; ``extra_fields=("info",)`` collects them; and what may leave the
    kernel is exactly the State's and the Info's fields."""
    state, kernel = mcmc.last_state, mcmc.sampler
    assert isinstance(state.info, type(state).info_type)
    assert kernel.private_safe_fields == type(state).published_fields
    assert set(kernel.private_safe_fields) == set(state._fields) | set(state.info._fields)
    for field in state.info._fields:
        assert getattr(state, field) is getattr(state.info, field)
    info = mcmc.get_extra_fields(group_by_chain=True)["info"]
    assert info._fields == state.info._fields
    assert all(v.shape[:2] == (4, 3) for v in info)


def runner(name, nb, chains, method, **kwargs):
    make, _, accountant, _ = KERNELS[name]
    options = {"num_warmup": 2, "num_samples": 3, "delta": 1e-4, "progress_bar": False,
               "accountant": accountant, **kwargs}
    return ndp.PrivateMCMC(make(nb), num_chains=chains, chain_method=method, **options)


#: One kernel of each family in make test; the variants in make test-all (DPMALA is
#: DPHMC's core with one leapfrog step).
VARIANTS = {"DPPenalty-guided", "DPMALA", "DPSGLD-poisson", "DPSGHMC", "DPSGNHT-decreasing"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in VARIANTS else name for name in KERNELS
])
def test_releases_made_equal_releases_charged(data, releases, name):
    X, y = data
    per_iteration = KERNELS[name][3]
    key = jax.random.PRNGKey(0)

    # 1 chain: warmup() then run()
    mcmc = runner(name, "substitute", 1, "sequential")
    mcmc.warmup(key, X, y=y)
    assert (len(releases), mcmc.privacy_spent().num_releases) == (2 * per_iteration,) * 2
    mcmc.run(key, X, y=y)
    assert len(releases) == mcmc.privacy_spent().num_releases == 5 * per_iteration

    # 4 chains, vectorized: a run, then a continuation from post_warmup_state
    mcmc = runner(name, "substitute", 4, "vectorized")
    start = len(releases)
    mcmc.run(key, X, y=y, extra_fields=("info",))
    check_state_and_info(mcmc)
    mcmc.post_warmup_state = mcmc.last_state
    mcmc.run(mcmc.post_warmup_state.rng_key, X, y=y)
    made = len(releases) - start
    assert made == mcmc.privacy_spent().num_releases == 4 * (5 + 3) * per_iteration
    assert [(e.phase, e.num_chains, e.num_iterations) for e in mcmc.privacy_spent().ledger] == [
        ("warmup+sample", 4, 5), ("sample", 4, 3)]

    # A refused run releases nothing and charges nothing.
    refused = runner(name, "substitute", 2, "vectorized", num_warmup=50, num_samples=50,
                     epsilon=1e-3)
    start = len(releases)
    with pytest.raises(ndp.PrivacyBudgetError):
        refused.run(key, X, y=y)
    assert len(releases) == start and refused.privacy_spent().num_releases == 0


@pytest.mark.warm_start
@pytest.mark.parametrize("make", [
    lambda: ndp.DPPenalty(logistic_model),
    lambda: ndp.DPHMC(logistic_model, num_steps=2),
], ids=["DPPenalty", "DPHMC"])
def test_tuning_releases_made_equal_releases_charged(data, releases, monkeypatch, make):
    """Clip selection and the warm start (issue 18) release what they are charged."""
    from numpyro_dp import tuning

    monkeypatch.setattr(tuning, "grid_release", releases_counter(releases, tuning.grid_release))
    X, y = data
    # n = 120: an epsilon large enough for the warm start to be made (WARM_START_MIN_SNR).
    mcmc = ndp.PrivateMCMC(make(), num_warmup=2, num_samples=3, num_chains=2,
                           chain_method="vectorized", epsilon=100.0, delta=1e-4,
                           progress_bar=False, check_mixing=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    spent = mcmc.privacy_spent()
    assert [e.phase for e in spent.ledger] == ["clip selection", "warm start", "warmup+sample"]
    assert len(releases) == spent.num_releases
    assert spent.epsilon <= 100.0


ADD_REMOVE = [name for name, spec in KERNELS.items() if "add_remove" in spec[1]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_two_sequential_chains_and_add_remove(data, releases, name):
    """The rest of the matrix (make test-all): 2 chains run one after the other
    (NumPyro's lax.map path), and the add/remove neighbourhood where supported."""
    X, y = data
    per_iteration = KERNELS[name][3]
    for nb in ("substitute",) + (("add_remove",) if name in ADD_REMOVE else ()):
        mcmc = runner(name, nb, 2, "sequential")
        start = len(releases)
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
        assert len(releases) - start == mcmc.privacy_spent().num_releases == 2 * 5 * per_iteration
        assert mcmc.privacy_spent().neighbourhood == nb
    mcmc.run(jax.random.PRNGKey(1), X, y=y)  # no post_warmup_state: warm-up and samples again
    assert len(releases) - start == mcmc.privacy_spent().num_releases == 2 * 2 * 5 * per_iteration


PARALLEL_SCRIPT = textwrap.dedent("""
    import functools, sys
    sys.path.insert(0, {tests!r})
    import jax
    import numpyro_dp as ndp
    from numpyro_dp.kernels import barker, base, penalty
    import test_conformance as tc
    from _support.data import make_logistic_data

    class Made(list):
        def __len__(self):
            jax.effects_barrier()
            return super().__len__()

    made = Made()

    def counted(gate):
        def wrapper(key, *args, **kwargs):
            jax.debug.callback(lambda _: made.append(1), jax.random.key_data(key))
            return gate(key, *args, **kwargs)
        return wrapper

    for module in (base, penalty):
        module.grid_release = counted(module.grid_release)
    barker.barker_decision = counted(barker.barker_decision)
    X, y = make_logistic_data(tc.N, 2, seed=11)
    for name in tc.KERNELS:
        start = len(made)
        mcmc = tc.runner(name, "substitute", 2, "parallel")
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
        charged = mcmc.privacy_spent().num_releases
        print(name, len(made) - start, charged, flush=True)
        assert len(made) - start == charged == 2 * 5 * tc.KERNELS[name][3], name
    print("devices", jax.local_device_count())
""")


@pytest.mark.slow  # make test-all: keeps make test under 10 minutes on 2 cores
def test_parallel_chains_on_two_devices_are_all_charged():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONWARNINGS": "ignore"}
    script = PARALLEL_SCRIPT.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "devices 2" in out.stdout


def plateless_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)


def discrete_latent_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    k = numpyro.sample("k", dist.Bernoulli(0.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + k), obs=y)


@pytest.mark.parametrize("name", list(KERNELS))
def test_bad_input_is_refused_with_its_fix_before_anything_is_charged(data, releases, name):
    """Every kernel: NaN data, a model without a data plate and a discrete latent
    are refused with an error that names the problem, before any charge or release."""
    X, y = data
    nan_X = X.copy()
    nan_X[7, 1] = np.nan
    cases = [
        (logistic_model, nan_X, "NaN or infinite"),
        (plateless_model, X, "plate"),
        (discrete_latent_model, X, "discrete"),
    ]
    make = KERNELS[name][0]
    for model, features, message in cases:
        mcmc = ndp.PrivateMCMC(make("substitute", m=model), num_warmup=2, num_samples=3,
                               delta=1e-4, progress_bar=False, epsilon=10.0)
        with pytest.raises(ValueError, match=message):
            mcmc.run(jax.random.PRNGKey(0), features, y=y)
        assert mcmc.privacy_spent().num_releases == 0
    assert len(releases) == 0
