"""Every kernel releases exactly what it is charged for (issue 17).

Each release of every kernel goes through one of two gates: ``grid_release`` of
the release gate (:mod:`numpyro_dp.primitives.release`: the Gaussian releases
of the full-data, gradient and stochastic-gradient kernels, the subsampled
penalty, the tuning and the noise-aware route) and ``barker_decision`` (DP Barker).  The
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

Every kernel also keeps the State/Info contract (issue 19), refuses bad
input (NaN data, no data plate, a discrete latent) with an error that names
the problem, before anything is charged or released, keeps the leaks of the
privacy-holes issue closed (plain NumPyro, exact extra fields, ArviZ, rows held
by the runner, a replay from a published state), and, at negligible noise (or
the dynamics' own noise), samples the posterior of a conjugate Gaussian model:
exactly for the exact kernels, with the exact mean for the approximate ones.
"""

import functools
import textwrap

import arviz as az
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import linear_model, logistic_model, make_logistic_data
from _support.running import negligible_noise_warnings, run, run_on_devices
from _support.stats import assert_moments_match, moment_errors

import numpyro_dp as ndp
from numpyro_dp.kernels import barker
from numpyro_dp.primitives import release as gate

#: The slow tests of this module that run short chains, where compiling takes the time
#: (conftest); the statistical test at negligible noise is not one of them.
SHORT_RUNS = [pytest.mark.slow, pytest.mark.compile_bound]

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
    monkeypatch.setattr(gate, "grid_release", releases_counter(made, gate.grid_release))
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
#: The leak replay also leaves DPMinibatchPenalty (DPPenalty's runner path) to make
#: test-all, to keep make test under 10 minutes on 2 cores.
LEAK_REPLAY_SLOW = VARIANTS | {"DPMinibatchPenalty"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=SHORT_RUNS) if name in VARIANTS else name for name in KERNELS
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


@pytest.mark.parametrize("model,epsilon,warm_start", [
    (logistic_model, 100.0, 10 + 5 + 1),  # 5 + 5 steps, a Hessian at the first stage's
    # a noise scale: 8 + 8 steps with a Hessian at each (the first stage rescales by its
    # curvature's diagonal, too noisy to whiten by as a whole; the second follows it)
    pytest.param(linear_model, 300.0, 16 + 16, marks=pytest.mark.slow),  # 27 s
])
def test_noise_aware_releases_made_equal_releases_charged(data, releases, monkeypatch, model,
                                                          epsilon, warm_start):
    """NoiseAwareNUTS (issue 37): its warm start, clip histograms, anchor stage and
    score release are made as charged, once for all chains; NUTS on the surrogate
    makes none, in a second call neither (histograms 4; the warm start's steps and
    Hessians, whose number depends on whether its stages follow the curvature, which
    they do at this budget where the likelihood reads a noise scale; 2 stages of 2
    histograms, score and curvature); the ledger's notes about the release cost
    nothing."""
    X, y = data
    if model is linear_model:
        y = X @ np.array([0.5, -0.3]) + 0.3 * np.random.default_rng(0).normal(size=len(y))
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=5, num_samples=5,
                           num_chains=2, chain_method="vectorized", epsilon=epsilon, delta=1e-4,
                           progress_bar=False, check_mixing=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    spent = mcmc.privacy_spent()
    assert [e.phase for e in spent.ledger] == [
        "clip selection", "warm start", "anchor stage 1", "score release", "warmup+sample",
        "notes"]
    assert len(releases) == spent.num_releases == 4 + warm_start + 2 * 4
    mcmc.run(jax.random.PRNGKey(1), X, y=y)
    assert len(releases) == mcmc.privacy_spent().num_releases == 4 + warm_start + 2 * 4
    assert mcmc.privacy_spent().epsilon == spent.epsilon <= epsilon


ADD_REMOVE = [name for name, spec in KERNELS.items() if "add_remove" in spec[1]]


@pytest.mark.slow
@pytest.mark.compile_bound
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
    from numpyro_dp.kernels import barker
    from numpyro_dp.primitives import release
    from privacy import test_conformance as tc
    from _support.data import make_logistic_data

    class Made(list):
        def __len__(self):
            jax.effects_barrier()
            return super().__len__()

    made = Made()

    def counted(release_fn):
        def wrapper(key, *args, **kwargs):
            jax.debug.callback(lambda _: made.append(1), jax.random.key_data(key))
            return release_fn(key, *args, **kwargs)
        return wrapper

    release.grid_release = counted(release.grid_release)
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


def run_on_two_devices(script: str) -> None:
    """Run ``script`` (formatted with ``tests``, this directory) on 2 simulated devices."""
    assert "devices 2" in run_on_devices(script, 2)


@pytest.mark.slow  # make test-all: keeps make test under 10 minutes on 2 cores
@pytest.mark.compile_bound
def test_parallel_chains_on_two_devices_are_all_charged():
    run_on_two_devices(PARALLEL_SCRIPT)


PARALLEL_DEFAULTS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax
    import numpyro_dp as ndp
    from _support.data import linear_model, logistic_model, make_logistic_data
    X, y = make_logistic_data(600, 2, seed=3)
    for make in (lambda: ndp.DPPenalty(logistic_model), lambda: ndp.DPHMC(logistic_model)):
        mcmc = ndp.PrivateMCMC(make(), num_warmup=20, num_samples=20, num_chains=2,
                               epsilon=10.0, delta=1e-6, progress_bar=False,
                               check_mixing=False)
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
        assert [e.phase for e in mcmc.privacy_spent().ledger][:2] == [
            "clip selection", "warm start"], mcmc.privacy_spent().ledger
    print("devices", jax.local_device_count())
""")


@pytest.mark.slow
@pytest.mark.compile_bound
def test_parallel_chains_with_the_default_warm_start():
    # The warm start's mass matrix used to be made while the chains were traced
    # (pmap): a TracerArrayConversionError on 2 devices, found by a user trial.
    run_on_two_devices(PARALLEL_DEFAULTS)


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


# ----------------------------------------------------- the leaks of issue 17, replayed
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=SHORT_RUNS) if name in LEAK_REPLAY_SLOW else name
    for name in KERNELS
])
def test_the_privacy_holes_stay_closed(data, name):
    """The attacks of the privacy-holes issue, on every kernel: NumPyro's own MCMC,
    an exact extra field, ``az.from_numpyro`` and the rows it would read, and a
    replay of the continuation from the published state and key (with secret
    noise it never reproduces the published draws)."""
    X, y = data
    make = KERNELS[name][0]
    key = jax.random.PRNGKey(0)
    with pytest.raises(RuntimeError, match="PrivateMCMC"):
        numpyro.infer.MCMC(make("substitute"), num_warmup=2, num_samples=3,
                           progress_bar=False).run(key, X, y=y)
    mcmc = runner(name, "substitute", 1, "sequential", num_samples=20)
    with pytest.raises(ValueError, match="private-safe"):
        mcmc.run(key, X, y=y, extra_fields=("potential_energy",))
    assert mcmc.privacy_spent().num_releases == 0
    mcmc.run(key, X, y=y)
    with pytest.raises(ndp.PrivateDataError, match="to_inference_data"):
        az.from_numpyro(mcmc)
    with pytest.raises(ndp.PrivateDataError):
        _ = mcmc._args  # what Predictive / log_likelihood would be fed
    held = [vars(mcmc), vars(mcmc.sampler), vars(mcmc.sampler._private_model)]
    arrays = [x for x in jax.tree_util.tree_leaves(held) if isinstance(x, (np.ndarray, jax.Array))]
    assert not [x.shape for x in arrays if N in x.shape]
    idata = ndp.to_inference_data(mcmc)
    assert "observed_data" not in idata.groups() and "log_likelihood" not in idata.groups()

    def published(runner_):
        out = (runner_.get_samples(), runner_.get_extra_fields())
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]

    state = mcmc.last_state  # published, key and all
    continuations = []
    for attempt in range(2):  # the published continuation, then the attacker's replay
        again = mcmc if attempt == 0 else runner(name, "substitute", 1, "sequential",
                                                 num_samples=20)
        again.post_warmup_state = state
        again.run(state.rng_key, X, y=y, extra_fields=("info",))
        continuations.append(published(again))
    assert not all(np.array_equal(a, b) for a, b in zip(*continuations, strict=True))


# ------------------------------------------- the posterior at negligible noise
ROW_SD, PRIOR_SD, ROWS = 3.0, 10.0, 200


def mean_model(X):
    theta = numpyro.sample("theta", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.Normal(theta, ROW_SD).to_event(1), obs=X)


def mean_data():
    """Rows within 1.8 sds of (0.5, -1): every row's gradient norm, hence every
    log-likelihood ratio per unit step, stays below 1 near the posterior, so a
    clip of 2 clips nothing."""
    z = np.clip(np.random.default_rng(3).normal(size=(ROWS, 2)), -1.8, 1.8)
    return (np.array([0.5, -1.0]) + ROW_SD * z).astype(np.float32)


def tempered_posterior(X, temperature):
    """Mean and sd of the conjugate posterior with every row's likelihood to the power T."""
    precision = temperature * len(X) / ROW_SD**2 + 1 / PRIOR_SD**2
    return temperature * X.sum(0) / ROW_SD**2 / precision, np.full(2, precision**-0.5)


_QUIET = {"noise_multiplier": 1e-8}
#: name -> (kernel of mean_model, temperature, exact?, warm-up, samples). The
#: exact kernels run at negligible noise; the approximate ones (minibatch CLT
#: tests, stochastic gradients without an accept step) have the exact mean of
#: this Gaussian target (their drift is linear, or their test symmetric), and
#: their own tests bound their variance bias.
EXACTNESS = {
    "DPPenalty": (lambda: ndp.DPPenalty(mean_model, llr_clip=2.0, **_QUIET), 1.0, True,
                  400, 2000),
    "DPPenalty-guided": (lambda: ndp.DPPenalty(mean_model, llr_clip=2.0, proposal="guided",
                                               **_QUIET), 1.0, True, 400, 2000),
    "DPMinibatchPenalty": (lambda: ndp.DPMinibatchPenalty(
        mean_model, batch_size=100, temperature=0.5, llr_clip=2.0, **_QUIET), 0.5, False,
        400, 2000),
    "DPBarker": (lambda: ndp.DPBarker(mean_model, batch_size=100, proposal_scale=0.2, n0=50),
                 50 / ROWS, False, 400, 2000),
    "DPHMC": (lambda: ndp.DPHMC(mean_model, num_steps=3, grad_clip=2.0, llr_clip=2.0,
                                noise_multiplier_grad=1e-8, noise_multiplier_llr=1e-8),
              1.0, True, 300, 1000),
    "DPMALA": (lambda: ndp.DPMALA(mean_model, grad_clip=2.0, llr_clip=2.0,
                                  noise_multiplier_grad=1e-8, noise_multiplier_llr=1e-8),
               1.0, True, 300, 1500),
    "DPSGLD-poisson": (lambda: ndp.DPSGLD(mean_model, step_size=2e-3, batch_size=40,
                                          grad_clip=2.0), 1.0, False, 500, 3000),
    "DPSGLD-without-replacement": (lambda: ndp.DPSGLD(
        mean_model, step_size=2e-3, batch_size=40, grad_clip=2.0,
        batching="without_replacement"), 1.0, False, 500, 3000),
    "DPSGHMC": (lambda: ndp.DPSGHMC(mean_model, step_size=3e-2, batch_size=40, grad_clip=2.0,
                                    num_steps=5), 1.0, False, 500, 3000),
    "DPSGNHT-decreasing": (lambda: ndp.DPSGNHT(
        mean_model, step_size=0.1, batch_size=40, grad_clip=2.0, num_steps=3,
        step_schedule="decreasing"), 1.0, False, 500, 3000),
}


def test_every_kernel_has_an_exactness_check():
    assert set(EXACTNESS) == set(KERNELS)


@negligible_noise_warnings
@pytest.mark.slow  # statistical: make test-all
@pytest.mark.parametrize("name", list(EXACTNESS))
def test_the_posterior_at_negligible_noise(name):
    """Means (every kernel) and sds (exact kernels) within 4 Monte Carlo standard
    errors of the closed form; the approximate kernels' sds within a factor 1.5,
    which only says that the chains move and do not diverge."""
    make, temperature, exact, num_warmup, num_samples = EXACTNESS[name]
    X = mean_data()
    mean, sd = tempered_posterior(X, temperature)
    mcmc = run(make(), X, num_warmup=num_warmup, num_samples=num_samples)
    chains = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"], np.float64)
    if exact:
        exact_draws = mean + sd * np.random.default_rng(0).normal(size=(1, 20_000, 2))
        # The sd's error from the ESS of the squared deviations: HMC's draws are
        # antithetic, so the draws' own ESS (capped at the draws) understates it 3x.
        assert_moments_match(chains, exact_draws)
        return
    m, s, se_mean, _ = moment_errors(chains, log_sd="normal")
    np.testing.assert_array_less(np.abs(m - mean), 4 * se_mean)
    np.testing.assert_array_less(np.abs(np.log(s / sd)), np.log(1.5))
