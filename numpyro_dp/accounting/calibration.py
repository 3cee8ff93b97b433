"""Planning against a budget: the noise that fits, the iterations that fit.

Both searches are dp-accounting's ``calibrate_dp_mechanism`` (Brent's method
with a guaranteed feasible answer) over fresh accountants from
:func:`~numpyro_dp.accounting.accountants.make_accountant`, so a plan and the
charge of the run it plans come from the same accountant.  This module only
brackets the answer: noise multipliers span 1e-30 to 1e30 (a search in
``log z``), iteration counts up to 2^62.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import dp_accounting as dpa
import numpy as np
from dp_accounting import mechanism_calibration as mc

from numpyro_dp.accounting.accountants import QUICK_PLD_INTERVAL, epsilon_spent, make_accountant
from numpyro_dp.accounting.budget import PrivacyBudgetError, check_budget

#: Noise multipliers searched.
NOISE_RANGE = (1e-30, 1e30)


def _calibrate(make_event, epsilon, delta, neighbourhood, accountant, lo, hi, *,
               discrete=False, tol=None, pld_interval=None):
    """dp-accounting's search for the parameter in [lo, hi] at the budget's edge."""
    probe = make_event(hi)

    def fresh():
        return make_accountant(probe, accountant, neighbourhood, pld_interval)

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return mc.calibrate_dp_mechanism(
            fresh, make_event, epsilon, delta, mc.ExplicitBracketInterval(lo, hi),
            discrete=discrete, tol=tol,
        )


def calibrate_noise_multiplier(
    make_event: Callable[[float], dpa.DpEvent],
    epsilon: float,
    delta: float,
    neighbourhood: str = "substitute",
    accountant: str = "auto",
    rtol: float = 1e-6,
    upper: float | None = None,
) -> float:
    """Smallest noise multiplier (to ``rtol``) whose event fits the budget.

    ``make_event(z)`` builds the event of the whole planned run from a noise
    multiplier; epsilon must decrease in ``z``.  The returned ``z``'s epsilon
    is <= ``epsilon`` (dp-accounting's search guarantees the feasible side).
    ``upper``, if given, is a noise multiplier known to fit (the search stays
    below it).
    """
    check_budget(epsilon, delta)

    def fits(z):
        return epsilon_spent(make_event(z), delta, neighbourhood, accountant) <= epsilon

    lo_z, hi_z = NOISE_RANGE
    if upper is not None:
        hi = upper
    else:  # decades up from 1 until one fits
        hi = 1.0
        while not fits(hi):
            hi *= 10.0
            if hi > hi_z:
                raise PrivacyBudgetError(
                    f"No noise multiplier reaches epsilon={epsilon} at delta={delta}; "
                    "the mechanism is not private enough at any noise level."
                )
    lo = hi / 10.0  # decades down until one does not fit
    while fits(lo):
        hi, lo = lo, lo / 10.0
        if lo < lo_z:
            return hi
    t = _calibrate(lambda t: make_event(math.exp(t)), epsilon, delta, neighbourhood,
                   accountant, math.log(lo), math.log(hi), tol=math.log1p(rtol))
    return math.exp(t) if fits(math.exp(t)) else hi


@functools.lru_cache(maxsize=4096)
def calibrate_gaussian(epsilon: float, delta: float) -> float:
    """:func:`calibrate_noise_multiplier` of one Gaussian mechanism (``dp_accounting``'s
    ``GaussianDpEvent``; its epsilon is the same in both neighbourhoods), memoised: the
    planner and the tuning plan ask for the same ones many times over (a plan that
    searches the epsilon it needs asked 138 times for 15)."""
    return calibrate_noise_multiplier(dpa.GaussianDpEvent, epsilon, delta)


#: PLD grids of :func:`max_iterations`: a fast bracket, then a close one.
PLANNING_PLD_INTERVALS = (QUICK_PLD_INTERVAL, 1e-3)
#: Largest number of iterations planned.
MAX_PLANNED = 2**62


def max_iterations(
    per_iteration_event: dpa.DpEvent | Callable[[int], dpa.DpEvent],
    epsilon: float,
    delta: float,
    num_chains: int = 1,
    neighbourhood: str = "substitute",
    accountant: str = "auto",
    spent: dpa.DpEvent | None = None,
    precision: str = "close",
) -> int:
    """Largest number of iterations per chain that the budget affords.

    ``per_iteration_event`` is one iteration's event, or a function ``k ->``
    event of a chain's next ``k`` iterations (costs that change over time).
    ``spent`` is what the ledger holds already.  Returns 0 when not even one
    iteration fits.

    The answer is never more than affordable; ``precision`` says how close it
    is.  ``"close"`` (the default) evaluates epsilon by dp-accounting's PLD on
    a 1e-2 grid to bracket the answer, then on a 1e-3 grid (both upper bounds
    on the charged epsilon): well under a second where each final-precision
    evaluation can take seconds, usually within a fraction of a percent of the
    exact answer.  ``"coarse"`` stops after the 1e-2 grid (up to ~15% below,
    and never composes a PLD on a finer grid: what a refused run quotes).  ``"exact"`` uses
    the final precision throughout.  Events that need no PLD (plain
    Gaussians, RDP) are exact either way.
    """
    check_budget(epsilon, delta)
    if precision not in ("coarse", "close", "exact"):
        raise ValueError(f"precision={precision!r}; use 'coarse', 'close' or 'exact'.")
    spent = dpa.NoOpDpEvent() if spent is None else spent
    if callable(per_iteration_event):
        chain_event = per_iteration_event
    else:
        def chain_event(k):
            return dpa.SelfComposedDpEvent(per_iteration_event, k)

    def total(k):
        return dpa.ComposedDpEvent([spent, dpa.SelfComposedDpEvent(chain_event(k), num_chains)])

    def fits(k, interval):
        return epsilon_spent(total(k), delta, neighbourhood, accountant, interval) <= epsilon

    def largest(interval, lo, hi=None):
        """Largest k >= lo that fits on this grid (``lo`` known to fit, ``hi`` not)."""
        hi = 2 * lo if hi is None else hi
        while hi <= MAX_PLANNED and fits(hi, interval):  # double until one does not fit
            lo, hi = hi, hi * 2
        if hi > MAX_PLANNED:
            return lo
        if hi - lo <= 1:
            return lo
        k = _calibrate(total, epsilon, delta, neighbourhood, accountant, lo, hi,
                       discrete=True, pld_interval=interval)
        while k + 1 < hi and fits(k + 1, interval):  # the search stops within 1 of it
            k += 1
        return k

    if precision == "exact":
        return largest(None, 1) if fits(1, None) else 0
    coarse, close = PLANNING_PLD_INTERVALS
    if precision == "coarse":
        return largest(coarse, 1) if fits(1, coarse) else 0
    if not fits(1, close):
        return 0
    lo = largest(coarse, 1) if fits(1, coarse) else 1
    if not fits(lo, close):  # grids need not be nested: start again on the close one
        return largest(close, 1)
    # The close grid's answer lies between the coarse one and a few percent above.
    return largest(close, lo, max(lo + 1, int(lo * 1.25) + 1))
