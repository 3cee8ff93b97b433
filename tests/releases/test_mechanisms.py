"""One-shot mechanisms: calibration against dp-accounting and closed forms, the
shared budget with PrivateMCMC, refusal of bad or data-derived inputs, and the
floating-point and secret-noise guarantees (SPEC s11)."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from _support.attacks import attack_success, on_coarse_grid
from _support.data import logistic_model, make_logistic_data
from _support.data import make_linreg_data as linreg_data
from dp_accounting import gaussian_mechanism as dpa_gaussian
from dp_accounting.pld import pld_privacy_accountant
from jax import random
from scipy.stats import norm

import numpyro_dp as ndp
from numpyro_dp.accounting import epsilon_spent
from numpyro_dp.primitives import release as gate
from numpyro_dp.primitives.secret import ReproducibleNoiseWarning
from numpyro_dp.releases import linreg as lr
from numpyro_dp.releases import mechanisms as mech

KEY = random.PRNGKey(0)
ADD_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


def balle_wang_delta(eps, sigma, sens):
    """Exact delta(eps) of the Gaussian mechanism (Balle & Wang 2018, Thm 8)."""
    a = sens / (2 * sigma)
    b = eps * sigma / sens
    return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)


def pld_epsilon(events, delta, relation=ADD_REMOVE):
    acc = pld_privacy_accountant.PLDAccountant(relation)
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("eps,delta", [(0.1, 1e-5), (1.0, 1e-6), (4.0, 1e-5), (20.0, 1e-8)])
def test_analytic_gaussian_matches_dp_accounting(eps, delta):
    sigma = mech.gaussian_sigma(eps, delta, sensitivity=2.5)
    assert sigma == pytest.approx(2.5 * dpa_gaussian.get_sigma_gaussian(eps, delta), rel=1e-3)
    # rounded towards privacy: the exact curve at sigma is within the budget
    assert balle_wang_delta(eps, sigma, 2.5) <= delta


def test_classic_gaussian_is_the_textbook_bound_and_looser():
    sigma = mech.gaussian_sigma(0.5, 1e-5, 3.0, method="classic")
    assert sigma == pytest.approx(3.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5)
    assert sigma > mech.gaussian_sigma(0.5, 1e-5, 3.0)
    with pytest.raises(ValueError, match="epsilon < 1"):
        mech.gaussian_sigma(1.0, 1e-5, method="classic")


def test_gaussian_release_is_charged_as_calibrated():
    rel = mech.gaussian_mechanism(KEY, np.zeros(3), 2.0, epsilon=1.5, delta=1e-6)
    assert rel.entry.per_iteration.noise_multiplier == pytest.approx(rel.scale / 2.0)
    eps = epsilon_spent(rel.entry.event, 1e-6)
    assert eps <= 1.5 and eps == pytest.approx(1.5, rel=1e-5)


def test_laplace_epsilon_matches_closed_form_and_dp_accounting():
    rel = mech.laplace_mechanism(KEY, np.zeros(4), 3.0, epsilon=0.7)
    assert rel.scale == pytest.approx(3.0 / 0.7)
    eps = epsilon_spent(rel.entry.event, 1e-9)
    assert eps == pytest.approx(0.7, abs=1e-3)  # pure DP: 1 / noise multiplier
    assert eps >= pld_epsilon([rel.entry.event], 1e-9) - 1e-9


def test_randomized_response_epsilon_and_flip_rate():
    values = np.zeros(20000, dtype=int)
    rel = mech.randomized_response(KEY, values, 4, epsilon=1.0, reproducible_noise=True)
    p = 4 / (math.e - 1 + 4)
    assert rel.scale == pytest.approx(p)
    # P(output != input) = p (k - 1) / k, within 4 binomial standard errors
    q = p * 3 / 4
    assert abs(np.mean(rel.value != 0) - q) < 4 * math.sqrt(q * (1 - q) / len(values))
    eps = epsilon_spent(rel.entry.event, 1e-9)
    assert eps == pytest.approx(1.0, abs=1e-3)
    assert eps >= pld_epsilon([rel.entry.event], 1e-9, dpa.NeighboringRelation.REPLACE_ONE) - 1e-9
    with pytest.raises(ValueError, match="substitute"):
        epsilon_spent(rel.entry.event, 1e-9, neighbourhood="add_remove")


def test_gram_release_is_symmetric_with_the_right_sensitivity():
    X = make_logistic_data(50, 3)[0].astype(np.float64)
    rel = mech.gram_mechanism(KEY, X, 1.5, noise_multiplier=2.0)
    assert np.allclose(rel.value, rel.value.T)
    assert rel.scale == pytest.approx(2.0 * math.sqrt(2) * 1.5**2)
    assert mech.gram_sensitivity(1.5, "add_remove") == pytest.approx(1.5**2)
    # brute force: substitute pairs never exceed the stated sensitivity
    rng = np.random.default_rng(1)
    iu = np.triu_indices(3)
    for _ in range(2000):
        x, x2 = rng.normal(size=(2, 3))
        x, x2 = 1.5 * x / np.linalg.norm(x), 1.5 * x2 / np.linalg.norm(x2)
        diff = (np.outer(x, x) - np.outer(x2, x2))[iu]
        assert np.linalg.norm(diff) <= mech.gram_sensitivity(1.5) + 1e-12


def test_release_and_private_mcmc_share_one_budget():
    """A release charged to a ledger and a PrivateMCMC run on the same ledger:
    the calibrated run fills the rest of the budget and the reported epsilon is
    dp-accounting's PLD composition of both."""
    X, y = make_logistic_data(300, 2)
    ledger = ndp.PrivacyLedger(delta=1e-5, neighbourhood="substitute")
    rel = mech.gaussian_mechanism(KEY, X.sum(0), mech.sum_sensitivity(1.0),
                                  epsilon=1.0, delta=1e-5, ledger=ledger)
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.1)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=20, num_samples=30, epsilon=3.0,
                           ledger=ledger, progress_bar=False, warm_start=0)
    mcmc.run(random.PRNGKey(1), X, y)
    spent = mcmc.privacy_spent()
    assert len(spent.ledger) == 2 and spent.ledger[0].phase == "release"
    assert spent.epsilon <= 3.0 and spent.epsilon == pytest.approx(3.0, rel=1e-4)
    reference = pld_epsilon(
        [rel.entry.event, dpa.SelfComposedDpEvent(kernel.per_iteration_event(), 50)], 1e-5
    )
    assert spent.epsilon == pytest.approx(reference, abs=1e-2)
    # a Laplace release on the same ledger: mixed composition, never below the parts
    lap = mech.laplace_mechanism(KEY, np.zeros(1), 1.0, epsilon=0.5, ledger=ledger)
    mixed = ledger.epsilon()
    assert mixed >= spent.epsilon and mixed <= spent.epsilon + 0.5 + 1e-3
    assert mixed == pytest.approx(pld_epsilon(
        [rel.entry.event, dpa.SelfComposedDpEvent(kernel.per_iteration_event(), 50),
         lap.entry.event], 1e-5), abs=1e-2)
    with pytest.raises(ndp.PrivacyBudgetError):
        mcmc.run(random.PRNGKey(2), X, y)  # the Laplace release used the rest


def test_shared_ledger_must_agree():
    ledger = ndp.PrivacyLedger(delta=1e-5, neighbourhood="add_remove")
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0)
    with pytest.raises(ValueError, match="neighbourhood"):
        ndp.PrivateMCMC(kernel, num_warmup=1, num_samples=1, epsilon=1.0, ledger=ledger)
    with pytest.raises(ValueError, match="delta"):
        ndp.PrivateMCMC(ndp.DPPenalty(logistic_model, llr_clip=1.0, neighbourhood="add_remove"),
                        num_warmup=1, num_samples=1, epsilon=1.0, delta=1e-3, ledger=ledger)
    with pytest.raises(ValueError, match="neighbourhood"):
        mech.gaussian_mechanism(KEY, 0.0, 1.0, epsilon=1.0, delta=1e-5, ledger=ledger)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=0.0, delta=1e-5), "epsilon"),
    (dict(epsilon=-1.0, delta=1e-5), "epsilon"),
    (dict(epsilon=1.0, delta=None), "delta"),
    (dict(epsilon=1.0, delta=1e-5, noise_multiplier=1.0), "either"),
])
def test_bad_budgets_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mech.gaussian_mechanism(KEY, 0.0, 1.0, **kwargs)


def test_bad_bounds_are_refused():
    X = np.array([[0.3, 0.4], [1.0, 0.0]])
    with pytest.raises(ValueError, match="finite number > 0"):
        mech.sum_sensitivity(-1.0)
    with pytest.raises(ValueError, match="not an array"):
        mech.clip_rows(X, np.linalg.norm(X, axis=1))
    for bound, norms in ((0.8, [0.5, 0.8]), (1.0, [0.5, 1.0]), (2.0, [0.5, 1.0])):
        assert np.allclose(np.linalg.norm(mech.clip_rows(X, bound), axis=1), norms)
    with pytest.raises(ValueError, match="outside the data domain"):
        mech.clip_rows(np.array([0.1, np.inf]), 1.0)
    with pytest.raises(ValueError, match="integer category codes"):
        mech.randomized_response(KEY, np.array([0.0, 2.0]), 3, epsilon=1.0)


# ------------------------------------------------------------ floating point
#: Noise multiplier of a Gaussian release at epsilon = 0.1, delta = 1e-5.
Z_TENTH = mech.gaussian_sigma(0.1, 1e-5)


def neighbours(n=50, d=3, seed=0):
    """D and D' (row 0 replaced), rows of norm < 1, with generic float64 statistics."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(-0.5, 0.5, size=(n, d))
    X2 = X.copy()
    X2[0] = rng.uniform(-0.5, 0.5, size=d)
    return X, X2


ATTACKED = {
    "gaussian": (lambda key, X: mech.gaussian_mechanism(
        key, X.sum(0), mech.sum_sensitivity(1.0), noise_multiplier=Z_TENTH),
        lambda X: X.sum(0)),
    "laplace": (lambda key, X: mech.laplace_mechanism(key, X.sum(0), 2.0 * 3, epsilon=0.1),
                lambda X: X.sum(0)),
    "gram": (lambda key, X: mech.gram_mechanism(key, X, 1.0, noise_multiplier=Z_TENTH),
             lambda X: X.T @ X),
}


@pytest.mark.parametrize("name", sorted(ATTACKED))
def test_float_bits_do_not_tell_neighbours_apart(name):
    """Mironov-style attack at a claimed epsilon = 0.1: with float32 noise added in
    float64, ``release - f(D)`` is sigma times a float32 number only for the true D
    (the attack won 200 of 200 trials).  On the grid it must be near chance."""
    release, statistic = ATTACKED[name]
    X, X2 = neighbours()
    rels = [release(random.PRNGKey(t), X) for t in range(200)]
    assert attack_success([(r.value, r.scale) for r in rels], statistic(X), statistic(X2)) <= 0.6
    assert all(on_coarse_grid(r.value, r.scale) for r in rels)


def two_holders():
    """300 rows split between two data holders (lists of X_j and y_j)."""
    X, y = linreg_data(300, 2)
    return [X[:150], X[150:]], [y[:150], y[150:]]


RELEASES = {
    "gaussian": lambda key, **kw: mech.gaussian_mechanism(
        key, np.arange(3.0), 1.0, epsilon=1.0, delta=1e-5, **kw),
    "laplace": lambda key, **kw: mech.laplace_mechanism(key, np.arange(3.0), 1.0, epsilon=1.0,
                                                        **kw),
    "gram": lambda key, **kw: mech.gram_mechanism(
        key, neighbours()[0], 1.0, epsilon=1.0, delta=1e-5, **kw),
    "randomized_response": lambda key, **kw: mech.randomized_response(
        key, np.arange(1000) % 3, 3, epsilon=1.0, **kw),
    "release_linreg_stats": lambda key, **kw: lr.release_linreg_stats(
        key, *two_holders(), x_bound=1.2, y_bound=2.5, epsilon=1.0, delta=1e-5, **kw),
    "adassp": lambda key, **kw: lr.adassp(
        key, *two_holders(), x_bound=1.2, y_bound=2.5, epsilon=1.0, delta=1e-5, **kw),
}


def released(rel):
    """A release's published numbers (linreg releases hold two statistics)."""
    if hasattr(rel, "S_hat"):
        return np.concatenate([rel.S_hat.ravel(), rel.z_hat.ravel()])
    return np.asarray(rel.value)


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_noise_is_secret_unless_reproducible(name):
    release = RELEASES[name]
    first, second = release(KEY), release(KEY)
    assert not np.array_equal(released(first), released(second))  # the key does not fix it
    assert not first.entry.reproducible_noise
    with pytest.warns(ReproducibleNoiseWarning, match="NOT differentially private"):
        again = [release(KEY, reproducible_noise=True) for _ in range(2)]
    assert np.array_equal(released(again[0]), released(again[1]))
    assert again[0].entry.reproducible_noise


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_ledger_is_charged_before_anything_is_drawn(name, monkeypatch):
    release = RELEASES[name]
    ledger = ndp.PrivacyLedger(delta=1e-5, epsilon=0.5)

    def refuse(*args, **kwargs):
        raise AssertionError("a secret or noise was drawn before the charge")

    with monkeypatch.context() as patched:
        patched.setattr(mech, "run_secret", refuse)
        patched.setattr(gate, "grid_release", refuse)
        patched.setattr(mech, "row_product_sum", refuse)
        with pytest.raises(ndp.PrivacyBudgetError):
            release(KEY, ledger=ledger)  # epsilon = 1 > 0.5
    assert ledger.entries == []
    roomy = ndp.PrivacyLedger(delta=1e-5, epsilon=2.0)
    rel = release(KEY, ledger=roomy)
    assert roomy.entries == [rel.entry]


def test_delta_must_be_below_one_over_n():
    X = neighbours(n=50)[0]
    with pytest.raises(ValueError, match=r"1/n = 0\.02.*0\.002"):
        mech.gram_mechanism(KEY, X, 1.0, epsilon=1.0, delta=0.02)
    mech.gram_mechanism(KEY, X, 1.0, epsilon=1.0, delta=0.002)


def test_gram_sensitivity_holds_as_computed(monkeypatch):
    """The released triangle without noise (grid_release at scale 0, rounding to the
    grid kept) moves by at most the charged sensitivity between neighbours whose
    change attains the nominal one, sqrt(2) x_bound^2, exactly; on this data the
    float64 block products alone move it by ~3e-14 of it more."""
    grid_release = gate.grid_release
    monkeypatch.setattr(gate, "grid_release", lambda key, hi, lo, scale, quantum, noise:
                        grid_release(key, hi, lo, 0.0, quantum, noise))
    rng, bx, iu = np.random.default_rng(0), 1.1, np.triu_indices(3)
    for _ in range(20):
        X = rng.normal(size=(3000, 3))
        X *= 2 * bx / np.linalg.norm(X, axis=1, keepdims=True)  # projected onto bx
        X[0] = 2 * bx * np.eye(3)[0]
        X2 = X.copy()
        X2[0] = 2 * bx * np.eye(3)[1]
        rel, rel2 = (mech.gram_mechanism(KEY, A, bx, noise_multiplier=1.0)
                     for A in (X, X2))
        charged = rel.scale / rel.entry.per_iteration.noise_multiplier
        assert mech.gram_sensitivity(bx) < charged < mech.gram_sensitivity(bx) * (1 + 1e-8)
        assert np.linalg.norm((rel.value - rel2.value)[iu]) <= charged
