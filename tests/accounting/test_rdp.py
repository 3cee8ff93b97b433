"""RDP accounting of minibatch kernels (SPEC s2, s4) against closed forms and dp-accounting."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

import numpyro_dp as ndp
from numpyro_dp.accounting import PrivacyLedger, epsilon_spent
from numpyro_dp.accounting.rdp import (
    ORDERS,
    BarkerDpEvent,
    barker_rdp,
    rdp_curve,
    rdp_epsilon,
    wbk_amplify,
)
from numpyro_dp.kernels.barker import (
    barker_epsilon,
    barker_event,
    barker_max_batch_size,
    barker_max_iterations,
)


def barker_closed_form(a, b):
    return 5 / (2 * b) + math.log(2 * b / (b - 5 * a)) / (2 * (a - 1)) + 2 * a / (b - 5 * a)


def wbk_closed_form(eps, q, a):
    """WBK Thm 9 term by term in plain floats (eps: callable order -> base RDP)."""
    s = 1 + q**2 * math.comb(a, 2) * min(4 * (math.exp(eps(2)) - 1), 2 * math.exp(eps(2)))
    s += 2 * sum(q**j * math.comb(a, j) * math.exp((j - 1) * eps(j)) for j in range(3, a + 1))
    return math.log(s) / (a - 1)


def test_barker_curve_matches_spec_and_is_inf_outside_valid_orders():
    curve = barker_rdp(1000)
    for a in (2, 3, 10, 199):
        assert curve[a - 2] == pytest.approx(barker_closed_form(a, 1000), rel=1e-12)
    assert np.all(np.isinf(curve[ORDERS >= 200]))
    assert np.isfinite(barker_rdp(11)[0]) and np.all(np.isinf(barker_rdp(10)))


@pytest.mark.parametrize("q", [1e-3, 0.05, 0.5])
def test_wbk_matches_term_by_term_formula(q):
    z = 1.3
    ours = wbk_amplify(ORDERS / (2 * z**2), q)
    for a in (2, 3, 7, 30):
        assert ours[a - 2] == pytest.approx(wbk_closed_form(lambda j: j / (2 * z**2), q, a),
                                            rel=1e-10)
    b = 1000
    ours = wbk_amplify(barker_rdp(b), q)
    for a in (2, 5, 40):
        # capped at the unsampled mechanism (binding for large q)
        expect = min(wbk_closed_form(lambda j: barker_closed_form(j, b), q, a),
                     barker_closed_form(a, b))
        assert ours[a - 2] == pytest.approx(expect, rel=1e-10)
    np.testing.assert_array_equal(wbk_amplify(barker_rdp(b), 1.0), barker_rdp(b))
    assert np.all(wbk_amplify(barker_rdp(b), 0.99) <= barker_rdp(b))  # capped at the base


def test_check_figure_spec_s4():
    """n = 1e6, b = 1000, 20000 steps, delta = 1e-6: eps ~ 0.84 (SPEC s4)."""
    eps = barker_epsilon(10**6, 1000, 20000, 1e-6)
    # SPEC: dp-accounting's conversion over orders 3..(b/5 - 1) on the same curve.
    event = dpa.SelfComposedDpEvent(barker_event(10**6, 1000), 20000)
    orders = np.arange(3, 200)
    spec = rdp_privacy_accountant.compute_epsilon(orders, rdp_curve(event)[1:198], 1e-6)[0]
    assert eps == pytest.approx(0.84, abs=0.005)
    assert spec <= eps <= spec * (1 + 1e-9)  # order 2 and orders >= b/5 do not help here


@pytest.mark.parametrize("n, b, z, steps", [
    (10**6, 1000, 1.0, 20000), (10**5, 100, 2.0, 1000), (1000, 100, 0.8, 50),
    (10**4, 1000, 5.0, 1000),
])
def test_wbk_never_below_dp_accounting_sampled_without_replacement(n, b, z, steps):
    """dp-accounting uses WBK's Gaussian-specific refinement (Thm 27): ours is >= it.
    Both converted over orders 2..64 (dp-accounting's bound is slow at high orders)."""
    event = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(n, b, dpa.GaussianDpEvent(z)), steps)
    orders = ORDERS[:63]
    acc = rdp_privacy_accountant.RdpAccountant(
        orders=list(orders), neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(event)
    theirs = acc.get_epsilon(1e-6)
    ours = rdp_privacy_accountant.compute_epsilon(orders, rdp_curve(event)[:63], 1e-6)[0]
    assert ours >= theirs
    if b / n <= 0.01:  # small q: the generic and the Gaussian bound nearly agree
        assert ours <= 1.01 * theirs
    assert epsilon_spent(event, 1e-6) <= ours * (1 + 1e-9)  # more orders only help (+ round-up)


def test_large_sampling_fraction_is_capped_at_the_unsampled_mechanism():
    """For q near 1 WBK exceeds the mechanism on all rows, which also bounds it."""
    event = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(1000, 900, dpa.GaussianDpEvent(3.0)), 10)
    unsampled = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(3.0), 10)
    assert epsilon_spent(event, 1e-6) == pytest.approx(rdp_epsilon(unsampled, 1e-6), rel=1e-12)


def test_routing_pld_falls_back_to_rdp_and_composes_with_gaussians():
    barker = dpa.SelfComposedDpEvent(barker_event(10**5, 500), 300)
    mixed = dpa.ComposedDpEvent([barker, dpa.GaussianDpEvent(20.0)])
    direct = rdp_privacy_accountant.compute_epsilon(
        ORDERS, rdp_curve(barker) + ORDERS / (2 * 20.0**2), 1e-6)[0]
    for accountant in ("pld", "rdp"):
        assert epsilon_spent(mixed, 1e-6, accountant=accountant) == pytest.approx(direct, rel=1e-9)
        assert epsilon_spent(mixed, 1e-6, accountant=accountant) >= direct
    with pytest.raises(ValueError, match="substitute"):
        epsilon_spent(barker, 1e-6, neighbourhood="add_remove")
    ledger = PrivacyLedger(1e-6, "substitute", "pld")
    ledger.record(ndp.accounting.LedgerEntry("DPBarker", "sample", 1, 10, barker_event(10**5, 500)))
    assert ledger.spent().accountant == "rdp"


def test_no_valid_order_is_infinite_epsilon():
    assert rdp_epsilon(BarkerDpEvent(10), 1e-6) == math.inf


def test_max_iterations_and_max_batch_size_helpers():
    n, b, eps, delta = 10**6, 1000, 1.0, 1e-6
    k = barker_max_iterations(n, b, eps, delta)
    assert barker_epsilon(n, b, k, delta) <= eps < barker_epsilon(n, b, k + 1, delta)
    assert barker_max_iterations(n, b, eps, delta, num_chains=4) == pytest.approx(k / 4, abs=1)
    best = barker_max_batch_size(n, 20000, eps, delta)
    assert barker_epsilon(n, best, 20000, delta) <= eps < barker_epsilon(
        n, best + 1, 20000, delta)
    assert best > 1000  # the check figure's run (eps 0.84) has room for a larger batch
    # epsilon is U-shaped in b: decreasing then increasing (what the helper relies on),
    # up to q ~ 0.01 here, beyond which the unamplified bound (eps > 100) takes over
    grid = np.unique(np.geomspace(11, n / 100, 40).astype(int))
    e = np.array([barker_epsilon(n, int(bb), 20000, delta) for bb in grid])
    m = int(np.argmin(e))
    assert np.all(np.diff(e[: m + 1]) <= 1e-9) and np.all(np.diff(e[m:]) >= -1e-9)
    assert barker_max_batch_size(n, 10**7, 0.01, delta) == 0


@pytest.mark.parametrize("b, match", [(10, ">= 11"), (2000, "exceeds")])
def test_helpers_reject_bad_batch_size(b, match):
    with pytest.raises(ValueError, match=match):
        barker_epsilon(1000, b, 10, 1e-6)
