"""Privacy invariants (DEVELOPERS.md): what leaves a kernel, and what is charged."""

import functools
import json

import arviz as az
import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import logistic_model, make_logistic_data
from _support.running import TEST_SECRET, armed_init

import numpyro_dp as ndp
from numpyro_dp.kernels.penalty import dp_penalty
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.gradients import clipped_grad_sum_fn
from numpyro_dp.primitives.route_choice import ROUTES

N = 1009  # prime: no public array has this length by accident


def mean_model(x):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(theta, 1.0), obs=x)


@pytest.fixture(scope="module")
def data():
    return make_logistic_data(N, 3, seed=3)


def neighbour(X, row=0, shift=1e6):
    X2 = np.array(X, copy=True)
    X2[row] += shift
    return X2


def leaves_with_row_dimension(tree):
    return [np.shape(x) for x in jax.tree_util.tree_leaves(tree) if N in np.shape(x)]


@pytest.mark.slow
def test_one_step_release_moves_by_at_most_the_sensitivity(data):
    """Same state and randomness on neighbouring data sets (one row moved by 1e6):
    the released log-acceptance differs by at most Delta = 2 T c per iteration."""
    X, y = data
    X2 = neighbour(X)
    pm = PrivateModel(logistic_model, (X,), {"y": y})
    llr_clip, temperature = 1.0, 0.7
    init_fn, sample_fn = dp_penalty(pm, 0, noise_multiplier=1.0, sensitivity_factor=2.0,
                                    temperature=temperature, adapt_step_size=False,
                                    adapt_mass_matrix=False)
    keys = jax.random.split(jax.random.PRNGKey(0), 512)
    params = {"w": jax.random.normal(jax.random.PRNGKey(1), (3,))}
    states = jax.vmap(lambda k: init_fn(params, 0.05, None, k))(keys)
    step = jax.vmap(functools.partial(sample_fn, llr_clip=llr_clip),
                    in_axes=(0, None, None, None))
    a = step(states, (X,), {"y": y}, TEST_SECRET)  # same secret: same noise on both sides
    b = step(states, (X2,), {"y": y}, TEST_SECRET)
    # Where both sides accepted, z is the (shared) proposal, which gives h.
    h = jnp.linalg.norm(a.z["w"] - params["w"], axis=-1)
    both = (a.accept_prob < 1) & (b.accept_prob < 1) & a.accepted & b.accepted
    assert int(both.sum()) >= 20
    gap = jnp.abs(jnp.log(a.accept_prob) - jnp.log(b.accept_prob))
    # Delta = 2 T c, plus the release's rounding: its output cell is at most
    # sigma / 2^8 (sigma = z Delta with z = 1 here).
    delta_bound = 2 * temperature * llr_clip * h
    assert bool(jnp.all(jnp.where(both, gap <= delta_bound * (1 + 2.0**-7) + 1e-5, True)))
    # the exact, unclipped ratio would have moved by orders of magnitude more
    exact_a = pm.log_density_terms(params, (X,), {"y": y}).loglik_rows[0]
    exact_b = pm.log_density_terms(params, (X2,), {"y": y}).loglik_rows[0]
    assert abs(float(exact_a - exact_b)) > 1e3


def test_changing_one_row_by_1e6_does_not_move_the_posterior():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, size=N).astype(np.float32)
    x2 = neighbour(x[:, None])[:, 0]
    means = []
    for values in (x, x2):
        kernel = ndp.DPPenalty(mean_model, llr_clip=5.0, proposal_scale=0.05)
        mcmc = ndp.PrivateMCMC(kernel, num_warmup=500, num_samples=1500, num_chains=2,
                               reproducible_noise=True,
                               epsilon=50.0, delta=1e-5, progress_bar=False,
                               chain_method="vectorized")
        mcmc.run(jax.random.PRNGKey(0), values)
        means.append(float(mcmc.get_samples()["theta"].mean()))
    # Non-private inference would move by 1e6 / N ~ 990; the posterior sd is ~0.03
    # and the Monte Carlo error of each mean ~0.005.
    assert abs(means[0] - means[1]) < 0.1
    assert abs(means[0] - x.mean()) < 0.1


def test_nothing_per_row_leaves_the_kernel(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=50, num_samples=50, num_chains=2,
                           epsilon=10.0, delta=1e-6, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y, extra_fields=ndp.DPPenaltyState._fields)
    assert leaves_with_row_dimension(mcmc.last_state) == []
    assert leaves_with_row_dimension(mcmc.get_extra_fields()) == []
    assert leaves_with_row_dimension(mcmc.get_samples()) == []
    fields = " ".join(ndp.DPPenaltyState._fields).lower()
    for word in ("potential", "energy", "loglik", "grad", "clip", "ratio", "variance"):
        assert word not in fields
    idata = ndp.to_inference_data(mcmc)
    assert set(idata.groups()) == {"posterior", "sample_stats"}
    for group in idata.groups():
        for var in idata[group].data_vars.values():
            assert N not in var.shape


def test_deterministic_sites_that_read_data_are_not_returned(data):
    X, y = data

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        numpyro.deterministic("w_norm", jnp.linalg.norm(w))
        numpyro.deterministic("fit", jnp.sum(X @ w))  # a function of the private rows
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    kernel = ndp.DPPenalty(model, llr_clip=1.0, proposal_scale=0.05)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=10, num_samples=20, epsilon=10.0, delta=1e-6,
                           progress_bar=False)
    with pytest.warns(UserWarning, match="fit"):
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert set(mcmc.get_samples()) == {"w", "w_norm"}


def test_initial_point_does_not_depend_on_the_data(data):
    X, y = data
    states = []
    for values in (X, neighbour(X)):
        kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=5.0)
        states.append(armed_init(kernel, jax.random.PRNGKey(5), values, y=y))
    np.testing.assert_array_equal(states[0].z["w"], states[1].z["w"])


@pytest.mark.parametrize("chain_method", [
    pytest.param("sequential", marks=pytest.mark.slow), "vectorized"])  # sequential: test-all
def test_warmup_and_every_chain_are_charged(data, chain_method):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=50.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=30, num_samples=20, num_chains=3, thinning=2,
                           delta=1e-6, progress_bar=False, chain_method=chain_method)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    spent = mcmc.privacy_spent()
    assert spent.num_releases == 3 * (30 + 20)  # thinning does not reduce the cost
    expected = ndp.epsilon_spent(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(50.0), 150), 1e-6)
    assert spent.epsilon == pytest.approx(expected, rel=1e-12)
    assert spent.noise_multipliers == (50.0,)


def test_calibrated_run_spends_the_budget_and_refuses_a_second_run(data, monkeypatch):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=20, num_samples=30, num_chains=2, epsilon=0.5,
                           delta=1e-6, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    spent = mcmc.privacy_spent()
    assert 0.5 * (1 - 1e-4) <= spent.epsilon <= 0.5
    calls = []
    monkeypatch.setattr(type(kernel), "init", lambda *a, **k: calls.append(1))
    with pytest.raises(ndp.PrivacyBudgetError, match="budget"):
        mcmc.run(jax.random.PRNGKey(1), X, y=y)
    assert calls == []  # refused before the kernel was even initialised
    assert mcmc.privacy_spent() == spent  # nothing charged for the refused run


def test_over_budget_run_is_refused_before_any_iteration(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=2.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=100, num_samples=100, num_chains=2,
                           epsilon=1.0, delta=1e-6, progress_bar=False)
    affordable = ndp.max_iterations(kernel.per_iteration_event(), 1.0, 1e-6, num_chains=2)
    with pytest.raises(ndp.PrivacyBudgetError, match=f"affords at least {affordable} more"):
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert mcmc._states is None
    assert mcmc.privacy_spent().num_releases == 0


def test_budget_too_small_for_one_iteration(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=0.5)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=10, epsilon=0.1, delta=1e-6,
                           progress_bar=False)
    with pytest.raises(ndp.PrivacyBudgetError, match="affords at least 0 more"):
        mcmc.run(jax.random.PRNGKey(0), X, y=y)


def test_explicit_noise_with_a_cap_accumulates_until_the_cap(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=20.0)
    per_call = ndp.epsilon_spent(dpa.SelfComposedDpEvent(kernel.per_iteration_event(), 40), 1e-6)
    # eps grows like sqrt(iterations): a second call would bring it to ~1.41 x per_call
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=40, epsilon=1.3 * per_call,
                           delta=1e-6, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert mcmc.privacy_spent().epsilon == pytest.approx(per_call, rel=1e-9)
    with pytest.raises(ndp.PrivacyBudgetError):
        mcmc.run(jax.random.PRNGKey(1), X, y=y)
    assert len(mcmc.privacy_spent().ledger) == 1


# NumPyro's own MCMC and exact extra fields are refused for every kernel in
# test_conformance.py::test_the_privacy_holes_stay_closed.


def test_add_remove_neighbourhood_halves_the_noise(data):
    X, y = data
    pm = PrivateModel(logistic_model, (X,), {"y": y})
    params = {"w": jnp.zeros(3)}
    outs = []
    for factor in (2.0, 1.0):
        init_fn, sample_fn = dp_penalty(pm, 0, noise_multiplier=3.0, sensitivity_factor=factor,
                                        adapt_step_size=False, adapt_mass_matrix=False)
        state = init_fn(params, 0.01, None, jax.random.PRNGKey(0))
        outs.append(sample_fn(state, (X,), {"y": y}, TEST_SECRET, llr_clip=1.0))
    add_remove = ndp.DPPenalty(logistic_model, llr_clip=1.0, neighbourhood="add_remove")
    assert add_remove.sensitivity_factor == 1
    assert ndp.DPPenalty(logistic_model, llr_clip=1.0).sensitivity_factor == 2
    # same randomness, different sigma: the releases differ
    assert float(outs[0].accept_prob) != float(outs[1].accept_prob)


def test_inference_data_carries_the_ledger_and_no_data(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=20, num_samples=30, num_chains=2, epsilon=2.0,
                           delta=1e-6, progress_bar=False, warm_start=0)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    idata = ndp.to_inference_data(mcmc)
    assert "observed_data" not in idata.groups() and "log_likelihood" not in idata.groups()
    assert idata.posterior["w"].shape == (2, 30, 3)
    assert set(idata.sample_stats.data_vars) == {"acceptance_rate", "accepted"}
    assert idata.attrs["epsilon"] == idata.posterior.attrs["epsilon"]
    attrs = idata.posterior.attrs
    assert attrs["epsilon"] == mcmc.privacy_spent().epsilon <= 2.0
    assert attrs["delta"] == 1e-6 and attrs["neighbourhood"] == "substitute"
    ledger = json.loads(attrs["privacy_ledger"])
    assert ledger["num_releases"] == 2 * 50
    assert ledger["ledger"][0]["phase"] == "warmup+sample"
    summary = az.summary(idata)
    assert list(summary.index) == ["w[0]", "w[1]", "w[2]"]


def test_to_inference_data_before_run_is_an_error(data):
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=5.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, delta=1e-6)
    with pytest.raises(RuntimeError, match="run"):
        ndp.to_inference_data(mcmc)


def test_a_kernel_cannot_be_accounted_by_two_ledgers(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=5.0)
    first = ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, delta=1e-6, progress_bar=False)
    ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, delta=1e-6)  # nothing charged yet
    first.run(jax.random.PRNGKey(0), X, y=y)
    with pytest.raises(ValueError, match="already accounted"):
        ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, delta=1e-6)


# ------------------------------------------------------------------- DP-HMC
@pytest.mark.parametrize("route", [
    pytest.param(r, marks=pytest.mark.slow) if r == "jacobian" else r  # 24 s: make test-all
    for r in ROUTES if r != "auto"
])
def test_clipped_gradient_sum_moves_by_at_most_the_sensitivity(data, route, x64):
    """On neighbouring data sets (one row moved by 1e6) the sum of clipped per-row
    gradients, the only data-dependent part of a gradient release, moves by at
    most 2 b_g in l2 norm, for every route and at every theta."""
    X, y = (np.asarray(a, np.float64) for a in data)
    X2 = neighbour(X)
    pm = PrivateModel(logistic_model, (X,), {"y": y})
    fn, _ = clipped_grad_sum_fn(pm, route)
    thetas = jax.random.normal(jax.random.PRNGKey(2), (64, 3)) * 3
    grad_clip = 0.3
    a = jax.vmap(lambda t: sum(fn(t, grad_clip, (X,), {"y": y})))(thetas)
    b = jax.vmap(lambda t: sum(fn(t, grad_clip, (X2,), {"y": y})))(thetas)
    gap = jnp.linalg.norm(a - b, axis=1)
    assert float(gap.max()) <= 2 * grad_clip * (1 + 1e-12)
    assert float(gap.max()) > grad_clip  # the moved row is clipped, not dropped


@pytest.mark.slow  # make test-all: keeps make test under 10 minutes on 2 cores
def test_dphmc_state_and_outputs_hold_nothing_per_row(data):
    X, y = data
    kernel = ndp.DPHMC(logistic_model, step_size=0.02, num_steps=3, grad_clip=1.0,
                       llr_clip=1.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=20, num_samples=20, num_chains=2,
                           epsilon=10.0, delta=1e-6, progress_bar=False, warm_start=0)
    mcmc.run(jax.random.PRNGKey(0), X, y=y, extra_fields=ndp.DPHMCState._fields)
    assert leaves_with_row_dimension(mcmc.last_state) == []
    assert leaves_with_row_dimension(mcmc.get_extra_fields()) == []
    fields = " ".join(ndp.DPHMCState._fields).lower()
    for word in ("potential", "energy", "loglik", "grad", "clip", "ratio", "variance"):
        assert word not in fields
    # warm-up included, every chain, L + 1 gradient releases and one LLR release
    assert mcmc.privacy_spent().num_releases == 2 * 40 * (3 + 2)


def test_dphmc_initial_point_does_not_depend_on_the_data(data):
    X, y = data
    states = []
    for values in (X, neighbour(X)):
        kernel = ndp.DPHMC(logistic_model, grad_clip=1.0, llr_clip=1.0,
                           noise_multiplier_grad=5.0, noise_multiplier_llr=5.0)
        states.append(armed_init(kernel, jax.random.PRNGKey(5), values, y=y))
    for a, b in zip(jax.tree_util.tree_leaves(states[0]), jax.tree_util.tree_leaves(states[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)
