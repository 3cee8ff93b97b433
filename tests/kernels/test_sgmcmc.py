"""DP-SGLD, DP-SGHMC, DP-SGNHT: samplers, accounting over time, statistical behaviour."""

import math

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from dp_accounting.pld import pld_privacy_accountant
from scipy import integrate, stats

import numpyro_dp as ndp
from numpyro_dp.accounting import epsilon_spent
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.batching import (
    poisson_batch,
    poisson_buffer_size,
    sample_without_replacement,
)
from numpyro_dp.primitives.gradients import clipped_grad_sum_fn

SIGMA = 1.0  # known row scale of the Gaussian model
PRIOR_SD = 10.0


def gaussian_model(X):
    th = numpyro.sample("th", dist.Normal(0, PRIOR_SD).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.Normal(th, SIGMA).to_event(1), obs=X)


def gaussian_data(n, d=2, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, d)) + 1.0).astype(np.float32)


def exact_posterior(X):
    precision = X.shape[0] / SIGMA**2 + 1 / PRIOR_SD**2
    return X.sum(0) / SIGMA**2 / precision, 1 / precision


def wor_gradient_noise_var(X, b):
    """Variance of (n/b) sum_B grad l_j per coordinate (finite-population, exact)."""
    n = X.shape[0]
    s2 = X.var(0, ddof=1) / SIGMA**4
    return n**2 / b * (1 - b / n) * s2


def run(kernel, X, num_warmup, num_samples, num_chains=4, seed=0, accountant="rdp"):
    mcmc = ndp.PrivateMCMC(
        kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
        delta=1e-5, accountant=accountant, progress_bar=False, chain_method="vectorized",
        reproducible_noise=True,  # a fixed seed fixes the noise (tests only)
    )
    mcmc.run(jax.random.PRNGKey(seed), X)
    return mcmc, np.asarray(mcmc.get_samples(group_by_chain=True)["th"])


def mean_and_se(chains):
    """Pooled mean and its ESS-based standard error, per coordinate."""
    ess = numpyro.diagnostics.effective_sample_size(chains)
    flat = chains.reshape(-1, chains.shape[-1])
    return flat.mean(0), flat.std(0) / np.sqrt(ess), ess


# ----------------------------------------------------------------- batching
def test_sample_without_replacement_is_uniform_and_distinct():
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    idx = np.asarray(jax.vmap(lambda k: sample_without_replacement(k, 20, 5))(keys))
    assert all(len(set(row)) == 5 for row in idx)
    counts = np.bincount(idx.ravel(), minlength=20)
    assert stats.chisquare(counts).pvalue > 1e-3


def test_poisson_batch_has_the_poisson_law():
    n, q = 50, 0.1
    buffer = poisson_buffer_size(n, q)
    assert stats.binom.sf(buffer, n, q) <= 1e-12
    keys = jax.random.split(jax.random.PRNGKey(1), 4000)
    idx, mask = jax.vmap(lambda k: poisson_batch(k, n, q, buffer))(keys)
    idx, mask = np.asarray(idx), np.asarray(mask).astype(bool)
    sizes = mask.sum(1)
    assert all(len(set(r[m])) == s for r, m, s in zip(idx, mask, sizes, strict=True))
    # Batch size ~ Binomial(n, q); every row included with probability q.
    assert abs(sizes.mean() - n * q) < 4 * math.sqrt(n * q * (1 - q) / len(keys))
    incl = np.bincount(idx[mask], minlength=n) / len(keys)
    assert np.all(np.abs(incl - q) < 5 * math.sqrt(q * (1 - q) / len(keys)))


def test_poisson_batch_overflow_keeps_a_full_buffer():
    idx, mask = poisson_batch(jax.random.PRNGKey(0), 100, 0.9, 10)
    assert int(mask.sum()) == 10 and len(set(np.asarray(idx).tolist())) == 10


@pytest.mark.slow
def test_masked_minibatch_gradient_equals_the_sum_over_its_rows():
    X = gaussian_data(40)
    pm = PrivateModel(gaussian_model, (X,))
    theta = jnp.array([0.3, -0.2])
    idx = jnp.array([3, 7, 11, 0])
    mask = jnp.array([1.0, 1.0, 0.0, 1.0])
    g = (X[[3, 7, 0]] - np.asarray(theta)) / SIGMA**2  # closed-form row gradients
    g *= np.minimum(1.0, 0.5 / np.linalg.norm(g, axis=1, keepdims=True))
    for route in ("jacobian", "auto"):
        fn, _ = clipped_grad_sum_fn(pm, route)
        got = sum(fn(theta, 0.5, (X,), {}, idx, mask))  # (hi, lo) -> hi + lo
        np.testing.assert_allclose(got, g.sum(0), rtol=1e-5)


# --------------------------------------------------------------- accounting
def table_6_3a_event(num_epochs=200):
    """Paper 001 Table 6.3a: q = 0.01, sigma_t = sqrt(2 C_f / (eta_t clip^2)), 10 steps each."""
    events = []
    for t in range(1, num_epochs + 1):
        eta = 3.0 * t ** (-1 / 3)
        z = math.sqrt(2 * 1.0 / (eta * 0.7**2))
        events.append(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(z)), 10
        ))
    return dpa.ComposedDpEvent(events)


@pytest.mark.slow
def test_spec_s7_check_figure_at_delta_1e_5():
    eps = epsilon_spent(table_6_3a_event(), 1e-5, "add_remove", "pld")
    assert eps == pytest.approx(0.763, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("delta, expected", [
    (1e-6, 0.881), (1e-4, 0.629), (1e-3, 0.473), (1e-2, 0.273),
])
def test_spec_s7_check_figure(delta, expected):
    assert epsilon_spent(table_6_3a_event(), delta, "add_remove", "pld") == pytest.approx(
        expected, rel=0.01
    )


def hockey_stick_replace(q, sigma, eps):
    """delta(eps) of one Poisson-subsampled Gaussian under substitution (rows at -1, +1).

    Independent numerical integral of max(0, P - e^eps Q) with
    P = (1-q) N(0, s^2) + q N(-1, s^2), Q = (1-q) N(0, s^2) + q N(1, s^2).
    """
    def gap(x):
        p = (1 - q) * stats.norm.pdf(x, 0, sigma) + q * stats.norm.pdf(x, -1, sigma)
        r = (1 - q) * stats.norm.pdf(x, 0, sigma) + q * stats.norm.pdf(x, 1, sigma)
        return max(0.0, p - math.exp(eps) * r)

    return integrate.quad(gap, -12 * sigma - 1, 12 * sigma + 1, limit=400, points=[0])[0]


@pytest.mark.parametrize("q", [1.0, 0.05])
def test_substitute_poisson_event_uses_sensitivity_two_c(q):
    # z = sigma / (2c) in the library's convention: sigma = 2 z for rows clipped to 1.
    z = 0.8
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    eps = epsilon_spent(event, 1e-5, "substitute", "pld")
    if q == 1.0:  # no sampling: the plain Gaussian mechanism with mu = 1 / z
        assert eps == pytest.approx(epsilon_spent(dpa.GaussianDpEvent(z), 1e-5), rel=1e-3)
    delta_at_eps = hockey_stick_replace(q, 2 * z, eps)
    assert delta_at_eps <= 1e-5 * 1.001  # never understated
    assert hockey_stick_replace(q, 2 * z, 0.98 * eps) > 1e-5  # and tight to 2%


def sgld(X, **kw):
    kw = {"batching": "poisson", "step_size": 1e-3, "batch_size": 10, "grad_clip": 1.0, **kw}
    return ndp.DPSGLD(gaussian_model, **kw)


@pytest.mark.slow
def test_decreasing_steps_compose_like_dp_accounting():
    X = gaussian_data(1000)
    kernel = sgld(X, step_schedule="decreasing")
    kernel.prepare((X,), {})
    got = epsilon_spent(kernel.run_event(15, start=100), 1e-5, "substitute")
    # Direct composition of the exact z_t: each step a Poisson-subsampled Gaussian.
    acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
    for t in range(101, 116):
        eta = 1e-3 * t ** (-1 / 3)
        z = math.sqrt(eta) / (0.5 * eta * 1000 / 10 * 2 * 1.0)
        acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(2 * z)))
    direct = acc.get_epsilon(1e-5)
    assert direct <= got <= direct * 1.02


@pytest.mark.slow
def test_ledger_charges_warmup_and_continuation_at_their_iterations():
    X = gaussian_data(500)
    kernel = sgld(X, step_schedule="decreasing", batch_size=50)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=30, num_samples=20, num_chains=2, delta=1e-5,
                           progress_bar=False, chain_method="vectorized")
    mcmc.warmup(jax.random.PRNGKey(0), X)
    mcmc.run(jax.random.PRNGKey(1), X)
    entries = mcmc.privacy_spent().ledger
    assert [(e.phase, e.num_iterations) for e in entries] == [("warmup", 30), ("sample", 20)]
    assert entries[1].chain_event == kernel.run_event(20, start=30)
    whole = dpa.SelfComposedDpEvent(kernel.run_event(50, start=0), 2)
    assert mcmc.privacy_spent().epsilon == pytest.approx(
        epsilon_spent(whole, 1e-5, "substitute"), rel=1e-3
    )


def test_budget_cap_refuses_before_the_first_unpaid_iteration():
    X = gaussian_data(500)
    kernel = sgld(X, batch_size=50)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=10_000, delta=1e-5,
                           reproducible_noise=True,
                           epsilon=1.0, progress_bar=False)
    with pytest.raises(ndp.PrivacyBudgetError, match="affords"):
        mcmc.run(jax.random.PRNGKey(0), X)
    assert mcmc.privacy_spent().ledger == ()


@pytest.mark.parametrize("bad, match", [
    ({"batching": "bootstrap"}, "batching"),
    ({"step_schedule": "cosine"}, "step_schedule"),
    ({"batch_size": 0}, "batch_size"),
    ({"grad_clip": -1.0}, "grad_clip"),
    ({"batching": "without_replacement", "neighbourhood": "add_remove"}, "substitute"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        sgld(None, **bad)


def test_pld_asked_for_batches_without_replacement_is_replaced_by_rdp_and_says_so():
    kernel = ndp.DPSGLD(gaussian_model, step_size=1e-4, batch_size=20, grad_clip=2.0,
                        batching="without_replacement")
    with pytest.warns(ndp.AccountantWarning, match="reports accountant='rdp'"):
        mcmc, _ = run(kernel, gaussian_data(200), 2, 2, num_chains=1, accountant="pld")
    assert mcmc.privacy_spent().accountant == "rdp"


@pytest.mark.parametrize("batching,other,used", [
    ("without_replacement", "pld", "rdp"), ("poisson", "rdp", "pld"),
])
def test_auto_picks_the_accountant_that_can_charge_the_batching(batching, other, used):
    kernel = sgld(None, batching=batching)
    event = kernel.run_event(10, num_rows=200)
    assert ndp.accounting.choose_accountant(event) == (used, None)
    replaced = ndp.accounting.choose_accountant(event, other)
    assert replaced.accountant == used and replaced.reason


# -------------------------------------------------------------- statistics
def sghmc_stationary_variance(eta, precision, noise_var, friction, num_steps):
    """Variance of theta at iteration ends of SGHMC on a Gaussian target (exact).

    Per step theta' = theta + eta p, p' = (1 - eta C_f) p - eta P theta' + eta nu
    + N(0, 2 C_f eta), nu the minibatch noise (variance V, independent of
    theta without replacement); p ~ N(0, 1) afresh each iteration.
    """
    A = np.array([[1.0, eta], [-eta * precision, 1 - eta * friction - eta**2 * precision]])
    Q = np.diag([0.0, eta**2 * noise_var + 2 * friction * eta])
    v = 1.0 / precision
    for _ in range(100_000):
        S = np.diag([v, 1.0])
        for _ in range(num_steps):
            S = A @ S @ A.T + Q
        if abs(S[0, 0] - v) < 1e-15:
            break
        v = S[0, 0]
    return v


def check_mean_and_variance(chains, X, predicted_var):
    """Mean at the exact posterior mean; variance at the predicted (biased) one.

    Tolerances from the ESS: 4 standard errors for the mean, and for the
    variance 4 x sqrt(2 / ESS) relative (Gaussian draws).
    """
    mean, var = exact_posterior(X)
    got_mean, se, ess = mean_and_se(chains)
    assert np.all(np.abs(got_mean - mean) < 4 * se)
    got_var = chains.reshape(-1, chains.shape[-1]).var(0)
    rel_tol = 4 * np.sqrt(2 / ess)
    np.testing.assert_array_less(np.abs(got_var / predicted_var - 1), rel_tol)
    # The bias is real: the exact variance is outside the same band.
    assert np.all(np.abs(var / predicted_var - 1) > rel_tol)


@pytest.mark.slow
def test_sgld_mean_exact_variance_biased_as_predicted():
    X = gaussian_data(1000)
    b, eta = 100, 2e-4
    precision = 1 / exact_posterior(X)[1]
    V = wor_gradient_noise_var(X, b)
    predicted = (eta + eta**2 * V / 4) / (1 - (1 - eta * precision / 2) ** 2)
    kernel = sgld(X, step_size=eta, batch_size=b, grad_clip=50.0,
                  batching="without_replacement")
    _, chains = run(kernel, X, 200, 5000)
    check_mean_and_variance(chains, X, predicted)


@pytest.mark.slow
def test_sghmc_mean_exact_variance_biased_as_predicted():
    X = gaussian_data(1000)
    b, eta, steps = 100, 0.01, 5
    precision = 1 / exact_posterior(X)[1]
    V = wor_gradient_noise_var(X, b)
    predicted = np.array([
        sghmc_stationary_variance(eta, precision, v, 1.0, steps) for v in V
    ])
    kernel = ndp.DPSGHMC(gaussian_model, step_size=eta, batch_size=b, grad_clip=50.0,
                         num_steps=steps,
                         batching="without_replacement")
    _, chains = run(kernel, X, 200, 3000)
    check_mean_and_variance(chains, X, predicted)


def test_sgnht_runs_to_the_posterior_mean():
    X = gaussian_data(1000)
    kernel = ndp.DPSGNHT(gaussian_model, step_size=0.01, batch_size=100, grad_clip=50.0,
                         num_steps=2,
                         batching="without_replacement")
    mcmc, chains = run(kernel, X, 500, 1500)
    mean, _ = exact_posterior(X)
    got_mean, se, _ = mean_and_se(chains)
    assert np.all(np.abs(got_mean - mean) < 4 * se)
    spent = mcmc.privacy_spent()
    assert spent.num_releases == 4 * 2000 * 2
