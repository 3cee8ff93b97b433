"""Privacy accounting on Google's ``dp-accounting`` (SPEC s2).

Conventions
-----------
Kernels declare the privacy cost of one iteration as a
:class:`dp_accounting.DpEvent` next to their algorithm.  A
``GaussianDpEvent(z)`` declared by a kernel carries the SPEC's noise
multiplier ``z = sigma / Delta``, where ``Delta`` is the l2-sensitivity of the
released sum *under the kernel's neighbourhood* (``2 c`` for
``"substitute"``, ``c`` for ``"add_remove"``, for per-row terms clipped to
``c``).  A release with noise multiplier ``z`` is then ``mu``-GDP with
``mu = 1 / z`` under either neighbourhood (zCDP ``rho = 1 / (2 z^2)``).

Composition of plain Gaussian releases is tight: ``k`` releases with noise
multipliers ``z_i`` compose to one Gaussian mechanism with
``mu = sqrt(sum_i 1 / z_i^2)``.  For such events the ``"pld"`` accountant
evaluates the exact privacy-loss distribution of that Gaussian analytically
(``dp_accounting.gaussian_mechanism``, Balle & Wang 2018): dp-accounting's
discretised ``PLDAccountant`` gives the same curve up to its discretisation
error, but needs memory that grows like ``mu^2`` and fails for the huge
epsilons used to compare with non-private inference.  Every other event goes
to dp-accounting's ``PLDAccountant`` or ``RdpAccountant`` unchanged, except
events of the minibatch kernels (fixed-size batches without replacement, DP
Barker): whatever the accountant asked for, those go to the RDP accountant of
:mod:`numpyro_dp.rdp` (WBK amplification; PLD cannot interpret them), and the
ledger reports ``"rdp"``.

Subsampled releases (``PoissonSampledDpEvent``,
``TruncatedSubsampledGaussianDpEvent``, ``SampledWithoutReplacementDpEvent``)
carry the same ``z = sigma / Delta``.  dp-accounting's PLD measures the noise of
a sampled Gaussian in units of the per-row clip ``c`` instead, for either
relation (its REPLACE_ONE puts the two rows at ``-c`` and ``+c``), so under
``"substitute"`` such events are handed to it with ``2 z``
(:func:`to_dp_accounting`); its RDP bound for sampling without replacement
already uses ``sigma / Delta``.

Every epsilon returned here is rounded up: the reported figure is never below
the true one (DEVELOPERS.md invariant 4).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import dp_accounting as dpa
import numpy as np
from dp_accounting import gaussian_mechanism
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.special import log_ndtr

from numpyro_dp.rdp import is_rdp_only, rdp_epsilon

NEIGHBOURHOODS = ("substitute", "add_remove")
ACCOUNTANTS = ("pld", "rdp")
_RELATION = {
    "substitute": dpa.NeighboringRelation.REPLACE_ONE,
    "add_remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
}


class PrivacyBudgetError(ValueError):
    """A run that the stated privacy budget cannot pay for."""


# --------------------------------------------------------------- validation
def check_neighbourhood(neighbourhood: str) -> str:
    if neighbourhood not in NEIGHBOURHOODS:
        raise ValueError(
            f"neighbourhood={neighbourhood!r} is not supported; use 'substitute' "
            "(replace one row, the default) or 'add_remove' (add or remove one row)."
        )
    return neighbourhood


def check_budget(epsilon: float | None, delta: float | None) -> None:
    if epsilon is not None and not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(
            f"epsilon={epsilon} is not a valid budget; pass a finite epsilon > 0 "
            "(e.g. 1e7 to compare with non-private inference)."
        )
    if delta is not None and not 0 < delta < 1:
        raise ValueError(
            f"delta={delta} must lie in (0, 1); a common choice is well below 1/n, "
            "e.g. delta = 0.1 / n."
        )


def check_delta_for_rows(delta: float | None, num_rows: int) -> None:
    """Refuse a ``delta`` that is not below ``1 / n`` for a data set of ``n`` rows.

    A mechanism that publishes one randomly chosen row exactly is
    ``(0, 1/n)``-DP, so such a delta protects nobody.  ``None`` (no delta
    stated) passes.
    """
    if delta is not None and delta * num_rows >= 1.0:
        raise ValueError(
            f"delta={delta:.3g} is not below 1/n = {1.0 / num_rows:.3g}: a "
            "mechanism that publishes one randomly chosen row exactly is "
            f"(0, 1/n)-DP, so such a delta protects nobody. Choose delta well "
            f"below 1/n, e.g. {0.1 / num_rows:.2g}."
        )


def sensitivity_factor(neighbourhood: str) -> float:
    """l2-sensitivity of a sum of per-row terms clipped to norm 1."""
    return 2.0 if check_neighbourhood(neighbourhood) == "substitute" else 1.0


# ----------------------------------------------------------- closed forms
def gaussian_log_delta(epsilon: float, mu: float) -> float:
    """log delta(eps) of a mu-GDP Gaussian mechanism (SPEC s2, tight).

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), evaluated in
    log space so that it stays accurate for eps up to ~1e8.
    """
    if mu == 0:
        return -math.inf
    a = float(log_ndtr(-epsilon / mu + mu / 2))
    b = epsilon + float(log_ndtr(-epsilon / mu - mu / 2))
    return a + math.log1p(-math.exp(b - a)) if b < a else -math.inf


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon (rounded up) at which a mu-GDP mechanism is (eps, delta)-DP."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    eps = gaussian_mechanism.get_epsilon_gaussian(1.0 / mu, delta)
    # gaussian_log_delta is off by up to ~2e-13 / mu + 3e-17 * eps in log delta
    # (cancellation between its two terms; measured against 80-digit mpmath for
    # mu in [1e-9, 1e6]).  Aim below log(delta) by >= 40x that, so that the
    # exact delta(eps) never exceeds delta.
    log_delta = math.log(delta) - (1e-11 / mu + 1e-15 * eps + 1e-12)
    step = 1e-12 * (1.0 + eps)
    while gaussian_log_delta(eps, mu) > log_delta:  # brentq may land just below
        eps += step
        step *= 2
    return float(eps)


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """Loose (eps, delta) of rho-zCDP: rho + 2 sqrt(rho ln(1/delta)). Cross-check only."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def epsilon_to_zcdp(epsilon: float, delta: float) -> float:
    """Inverse of :func:`zcdp_to_epsilon`."""
    ld = math.log(1.0 / delta)
    return (math.sqrt(epsilon + ld) - math.sqrt(ld)) ** 2


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    """Classic conversion min_a eps_RDP(a) + ln(1/delta) / (a - 1). Cross-check only."""
    orders, rdp = np.asarray(orders, float), np.asarray(rdp, float)
    return float(np.min(rdp + math.log(1.0 / delta) / (orders - 1.0)))


# ------------------------------------------------------------------ events
def gaussian_releases(event: dpa.DpEvent) -> list[tuple[float, int]] | None:
    """``[(z, count), ...]`` if ``event`` composes only plain Gaussian releases.

    Returns ``None`` for any other event (subsampled, Laplace, ...).
    """
    if isinstance(event, dpa.NoOpDpEvent):
        return []
    if isinstance(event, dpa.GaussianDpEvent):
        return [(float(event.noise_multiplier), 1)]
    if isinstance(event, dpa.SelfComposedDpEvent):
        inner = gaussian_releases(event.event)
        return None if inner is None else [(z, c * event.count) for z, c in inner]
    if isinstance(event, dpa.ComposedDpEvent):
        out = []
        for e in event.events:
            inner = gaussian_releases(e)
            if inner is None:
                return None
            out += inner
        return out
    return None


def gaussian_mu(event: dpa.DpEvent) -> float | None:
    """mu of the single Gaussian equivalent to ``event`` (tight), or None."""
    releases = gaussian_releases(event)
    if releases is None:
        return None
    if any(z == 0 for z, c in releases if c > 0):
        return math.inf
    return math.sqrt(sum(c / z**2 for z, c in releases if c > 0))


def count_releases(event: dpa.DpEvent) -> int:
    """Number of mechanism releases (leaves times their composition counts)."""
    if isinstance(event, dpa.NoOpDpEvent):
        return 0
    if isinstance(event, dpa.SelfComposedDpEvent):
        return event.count * count_releases(event.event)
    if isinstance(event, dpa.ComposedDpEvent):
        return sum(count_releases(e) for e in event.events)
    return 1


def noise_multipliers(event: dpa.DpEvent) -> tuple[float, ...]:
    """Distinct noise multipliers of the mechanisms in ``event``, sorted."""
    out = set()

    def walk(e):
        if isinstance(e, (dpa.SelfComposedDpEvent, dpa.PoissonSampledDpEvent,
                          dpa.SampledWithoutReplacementDpEvent)):
            walk(e.event)
        elif isinstance(e, dpa.ComposedDpEvent):
            for x in e.events:
                walk(x)
        elif hasattr(e, "noise_multiplier"):
            out.add(float(e.noise_multiplier))

    walk(event)
    return tuple(sorted(out))


def pure_releases(event: dpa.DpEvent) -> list[tuple[dpa.DpEvent, int]] | None:
    """``[(leaf, count), ...]`` if ``event`` composes only plain Gaussian,
    Laplace and randomized-response releases, at least one of them not
    Gaussian (one-shot releases of :mod:`numpyro_dp.mechanisms`); else None.
    """
    leaves = (dpa.GaussianDpEvent, dpa.LaplaceDpEvent, dpa.RandomizedResponseDpEvent)

    def walk(e, count):
        if isinstance(e, dpa.NoOpDpEvent):
            return []
        if isinstance(e, leaves):
            return [(e, count)]
        if isinstance(e, dpa.SelfComposedDpEvent):
            return walk(e.event, count * e.count)
        if isinstance(e, dpa.ComposedDpEvent):
            out = []
            for x in e.events:
                inner = walk(x, count)
                if inner is None:
                    return None
                out += inner
            return out
        return None

    out = walk(event, 1)
    if out is None or all(isinstance(e, dpa.GaussianDpEvent) for e, _ in out):
        return None
    return out


def _pure_epsilon(releases: list[tuple[dpa.DpEvent, int]], delta: float) -> float:
    """Epsilon of Gaussian, Laplace and randomized-response releases composed (PLD).

    Noise multipliers are relative to the sensitivity under the ledger's
    neighbourhood, so Gaussian and Laplace losses do not depend on it and are
    built for sensitivity 1; randomized response changes one row's answer
    (``"substitute"``, the only neighbourhood its releases accept).  The
    plain Gaussians are first merged into one (tight, SPEC s2).  dp-accounting's
    PLDs are pessimistic (they never understate epsilon).
    """
    pld = privacy_loss_distribution
    inv_z2 = sum(c / e.noise_multiplier**2 for e, c in releases
                 if isinstance(e, dpa.GaussianDpEvent))
    parts = [pld.from_gaussian_mechanism(standard_deviation=1.0 / math.sqrt(inv_z2))] \
        if inv_z2 > 0 else []
    for e, c in releases:
        if isinstance(e, dpa.LaplaceDpEvent):
            parts.append(pld.from_laplace_mechanism(parameter=e.noise_multiplier)
                         .self_compose(c))
        elif isinstance(e, dpa.RandomizedResponseDpEvent):
            parts.append(pld.from_randomized_response(
                noise_parameter=e.noise_parameter, num_buckets=e.num_buckets,
                neighboring_relation=_RELATION["substitute"]).self_compose(c))
    total = parts[0]
    for p in parts[1:]:
        total = total.compose(p)
    return math.nextafter(float(total.get_epsilon_for_delta(delta)), math.inf)


def to_dp_accounting(event: dpa.DpEvent, neighbourhood: str) -> dpa.DpEvent:
    """``event`` in dp-accounting's noise convention for ``neighbourhood``.

    Only Poisson-sampled Gaussians under ``"substitute"`` change: their noise
    multiplier is doubled (see the module docstring).
    """
    if check_neighbourhood(neighbourhood) == "add_remove":
        return event
    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(to_dp_accounting(event.event, neighbourhood), event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([to_dp_accounting(e, neighbourhood) for e in event.events])
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        return dpa.PoissonSampledDpEvent(
            event.sampling_probability, dpa.GaussianDpEvent(2.0 * event.event.noise_multiplier)
        )
    if isinstance(event, dpa.TruncatedSubsampledGaussianDpEvent):
        return dpa.TruncatedSubsampledGaussianDpEvent(
            event.dataset_size, event.sampling_probability, event.truncated_batch_size,
            2.0 * event.noise_multiplier,
        )
    return event


def epsilon_spent(
    event: dpa.DpEvent,
    delta: float,
    neighbourhood: str = "substitute",
    accountant: str = "pld",
    pld_interval: float | None = None,
) -> float:
    """Epsilon (rounded up) of ``event`` at ``delta``.

    ``pld_interval``, if given, evaluates dp-accounting's PLD (when one is
    needed) in a single pass on that grid: a fast upper bound for planning
    (e.g. ``1e-2`` is about 10x faster than the final figure and a few percent
    high), never below the figure a run is charged.

    dp-accounting's numerical warnings (``divide by zero`` for events far from
    the budget, ...) are silenced: the answer is still an upper bound, and the
    warnings would only alarm (and clutter) the user.

    Parameters
    ----------
    event : DpEvent
        What was (or will be) released, in the conventions of this module.
    delta : float
        Target delta in (0, 1).
    neighbourhood : {"substitute", "add_remove"}
        Passed to dp-accounting for events whose privacy depends on it.
    accountant : {"pld", "rdp"}
        ``"pld"`` is tight; ``"rdp"`` is looser but supports more events.
    """
    check_budget(None, delta)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r}; use one of {ACCOUNTANTS}.")
    check_neighbourhood(neighbourhood)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return _epsilon_spent(event, delta, neighbourhood, accountant, pld_interval)


def _epsilon_spent(event, delta, neighbourhood, accountant, pld_interval):
    relation = _RELATION[neighbourhood]
    pure = pure_releases(event)
    if pure is not None:
        if accountant != "pld":
            raise ValueError(
                "Laplace and randomized-response releases are accounted with "
                "accountant='pld'; use it for a ledger that holds them."
            )
        if neighbourhood != "substitute" and any(
            isinstance(e, dpa.RandomizedResponseDpEvent) for e, _ in pure
        ):
            raise ValueError(
                "Randomized response is accounted under the 'substitute' "
                "neighbourhood only (one row's answer changes)."
            )
        return _pure_epsilon(pure, delta)
    if is_rdp_only(event):
        if neighbourhood != "substitute":
            raise ValueError(
                "Fixed-size batches drawn without replacement are accounted only for "
                "the 'substitute' neighbourhood (n is public); use "
                "neighbourhood='substitute'."
            )
        return rdp_epsilon(event, delta)
    mu = gaussian_mu(event)
    if mu is not None and (accountant == "pld" or mu == 0):  # mu == 0: nothing released
        return gaussian_epsilon(mu, delta)
    if mu is not None:  # plain Gaussians: relation-free by our convention
        event, relation = dpa.GaussianDpEvent(1.0 / mu), _RELATION["add_remove"]
    event = to_dp_accounting(event, neighbourhood)
    if accountant == "pld" and pld_interval is not None:
        eps = float(_composed_pld(event, relation, pld_interval, neighbourhood).get_epsilon(delta))
    elif accountant == "pld":
        eps = _pld_epsilon(event, relation, delta, neighbourhood)
    else:
        acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
        _check_supported(acc, event, accountant, neighbourhood)
        acc.compose(event)
        eps = float(acc.get_epsilon(delta))
    return math.nextafter(eps, math.inf)


#: PLD grid of the first, coarse pass, which bounds epsilon cheaply.
COARSE_PLD_INTERVAL = 0.05
#: Finest PLD grid (dp-accounting's default), and the grid relative to epsilon.
PLD_INTERVAL, PLD_RELATIVE_INTERVAL = 1e-4, 1e-5
#: Refinements after the coarse pass (two suffice in practice: each grid is set
#: from an upper bound, which the next pass tightens).
MAX_PLD_PASSES = 4


#: How many composed PLDs are kept (each holds its loss distribution, up to a
#: few MB on the finest grid).
PLD_CACHE_SIZE = 4
_pld_cache: dict[tuple, pld_privacy_accountant.PLDAccountant] = {}


def _composed_pld(event: dpa.DpEvent, relation, interval: float, neighbourhood: str):
    """dp-accounting's PLD accountant with ``event`` composed on the given grid.

    The last few are kept, keyed by the event's repr (which spells out every
    field), so one run's epsilon at several deltas, or checked and then
    reported, is composed once.  ``get_epsilon`` does not change an accountant.
    Events made of subsampled Gaussians only are composed by
    :class:`_SubsampledComposition`, the same PLD built from cached parts.
    """
    key = (repr(event), relation, interval)
    acc = _pld_cache.pop(key, None)
    if acc is None:
        acc = pld_privacy_accountant.PLDAccountant(relation, interval)
        _check_supported(acc, event, "pld", neighbourhood)
        leaves = _subsampled_leaves(event)
        if leaves is None:
            acc.compose(event)
        else:
            acc = _SubsampledComposition(leaves, relation, interval)
    _lru_put(_pld_cache, key, acc)
    return acc


#: One iteration's PLD of each recently used subsampled Gaussian.
_leaf_pld_cache: dict[tuple, privacy_loss_distribution.PrivacyLossDistribution] = {}
LEAF_PLD_CACHE_SIZE = 8


def _lru_put(cache: dict, key, value, size: int = PLD_CACHE_SIZE) -> None:
    cache[key] = value  # the most recently used last
    while len(cache) > size:
        del cache[next(iter(cache))]


def _subsampled_leaves(event: dpa.DpEvent, count: int = 1):
    """``[(leaf, times), ...]`` in composition order if ``event`` composes only
    Poisson-subsampled or truncated-subsampled Gaussians with positive noise and
    rates (and no-ops); otherwise None."""
    if isinstance(event, dpa.NoOpDpEvent):
        return []
    if isinstance(event, dpa.SelfComposedDpEvent):
        return _subsampled_leaves(event.event, count * event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        parts = [_subsampled_leaves(e, count) for e in event.events]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    if (isinstance(event, dpa.PoissonSampledDpEvent)
            and isinstance(event.event, dpa.GaussianDpEvent)
            and event.sampling_probability > 0 and event.event.noise_multiplier > 0):
        return [(event, count)]
    if (isinstance(event, dpa.TruncatedSubsampledGaussianDpEvent)
            and event.sampling_probability > 0 and event.truncated_batch_size > 0
            and event.dataset_size > 0 and event.noise_multiplier > 0):
        return [(event, count)]
    return None


def _leaf_pld(leaf: dpa.DpEvent, relation, interval: float):
    """One ``leaf``'s PLD, built with the arguments ``PLDAccountant`` uses."""
    key = (repr(leaf), relation, interval)
    pld = _leaf_pld_cache.pop(key, None)
    if pld is None:
        if isinstance(leaf, dpa.PoissonSampledDpEvent):
            pld = privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=leaf.event.noise_multiplier,
                value_discretization_interval=interval,
                sampling_prob=leaf.sampling_probability,
                neighboring_relation=relation,
            )
        else:
            pld = privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
                dataset_size=leaf.dataset_size,
                sampling_probability=leaf.sampling_probability,
                truncated_batch_size=leaf.truncated_batch_size,
                noise_multiplier=leaf.noise_multiplier,
                value_discretization_interval=interval,
                neighboring_relation=relation,
            )
    _lru_put(_leaf_pld_cache, key, pld, LEAF_PLD_CACHE_SIZE)
    return pld


class _SubsampledComposition:
    """``PLDAccountant.compose`` of subsampled Gaussians, step for step (identity,
    then each leaf's PLD self-composed and composed in order), with each leaf's
    PLD built once: planning asks about the same iteration at many counts, and
    building it is most of the cost.  Tested equal to ``PLDAccountant``."""

    def __init__(self, leaves, relation, interval: float):
        pld = privacy_loss_distribution.identity(value_discretization_interval=interval)
        for leaf, count in leaves:
            pld = pld.compose(_leaf_pld(leaf, relation, interval).self_compose(count))
        self._pld = pld

    def get_epsilon(self, target_delta: float) -> float:
        return self._pld.get_epsilon_for_delta(target_delta)


def _pld_epsilon(event: dpa.DpEvent, relation, delta: float, neighbourhood: str) -> float:
    """Epsilon by dp-accounting's pessimistic PLD on a grid scaled to epsilon.

    The PLD's support grows with epsilon, so on the default grid (1e-4) a run
    with a huge epsilon (tiny noise multipliers) needs gigabytes.  Starting
    from a coarse grid, each pass refines the grid to ``max(1e-4, 1e-5 eps)``
    for the epsilon just found, until that no longer refines it: every epsilon
    below 10 ends on dp-accounting's default grid.  Every grid gives an upper
    bound (the pessimistic PLD rounds losses up), so this never understates.
    """
    def epsilon_on(interval: float) -> float:
        return float(_composed_pld(event, relation, interval, neighbourhood).get_epsilon(delta))

    interval = COARSE_PLD_INTERVAL
    eps = epsilon_on(interval)
    for _ in range(MAX_PLD_PASSES):
        finer = max(PLD_INTERVAL, PLD_RELATIVE_INTERVAL * eps)
        if finer >= interval:
            break
        interval = finer
        eps = min(eps, epsilon_on(interval))
    return eps


def _check_supported(acc, event: dpa.DpEvent, accountant: str, neighbourhood: str) -> None:
    if not acc.supports(event):
        raise ValueError(
            f"The {accountant!r} accountant cannot account for this run under the "
            f"{neighbourhood!r} neighbourhood (dp-accounting does not support one of its "
            "events). Fixed-size minibatches (sampling without replacement) are "
            "accounted by accountant='rdp' under 'substitute' only; Poisson "
            "minibatches by either accountant ('pld' is tight)."
        )


# ------------------------------------------------------------- calibration
def calibrate_noise_multiplier(
    make_event: Callable[[float], dpa.DpEvent],
    epsilon: float,
    delta: float,
    neighbourhood: str = "substitute",
    accountant: str = "pld",
    rtol: float = 1e-6,
    upper: float | None = None,
) -> float:
    """Smallest noise multiplier (to ``rtol``) whose event fits the budget.

    ``make_event(z)`` builds the event of the whole planned run from a noise
    multiplier; epsilon must decrease in ``z``.  The returned ``z`` is the
    upper end of the final bisection bracket, so its epsilon is <= target.
    ``upper``, if given, is a noise multiplier known to fit (the search stays
    below it).
    """
    check_budget(epsilon, delta)

    def eps(z):
        return epsilon_spent(make_event(z), delta, neighbourhood, accountant)

    if upper is not None:
        lo, hi = upper, upper
    else:
        lo, hi = 1.0, 1.0
        while eps(hi) > epsilon:
            lo, hi = hi, hi * 10.0
            if hi > 1e30:
                raise PrivacyBudgetError(
                    f"No noise multiplier reaches epsilon={epsilon} at delta={delta}; "
                    "the mechanism is not private enough at any noise level."
                )
    if lo == hi:
        while eps(lo) <= epsilon and lo > 1e-30:
            lo, hi = lo / 10.0, lo
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


#: PLD grids of :func:`max_iterations`: a fast bracket, then a close one.
PLANNING_PLD_INTERVALS = (1e-2, 1e-3)


def max_iterations(
    per_iteration_event: dpa.DpEvent | Callable[[int], dpa.DpEvent],
    epsilon: float,
    delta: float,
    num_chains: int = 1,
    neighbourhood: str = "substitute",
    accountant: str = "pld",
    spent: dpa.DpEvent | None = None,
    exact: bool = False,
) -> int:
    """Largest number of iterations per chain that the budget affords.

    ``per_iteration_event`` is one iteration's event, or a function ``k ->``
    event of a chain's next ``k`` iterations (costs that change over time).
    ``spent`` is what the ledger holds already.  Returns 0 when not even one
    iteration fits.

    By default the answer is a fast *lower bound* (never more than affordable):
    epsilon is evaluated by dp-accounting's PLD on a 1e-2 grid to bracket the
    answer, then on a 1e-3 grid (both upper bounds on the charged epsilon), so
    it takes well under a second where each final-precision evaluation can take
    seconds; it is usually within a fraction of a percent of the exact answer.
    ``exact=True`` uses the final precision throughout.  Events that need no
    PLD (plain Gaussians, RDP) are exact either way.
    """
    check_budget(epsilon, delta)
    spent = dpa.NoOpDpEvent() if spent is None else spent
    if callable(per_iteration_event):
        chain_event = per_iteration_event
    else:
        def chain_event(k):
            return dpa.SelfComposedDpEvent(per_iteration_event, k)

    def fits(k, interval):
        ev = dpa.ComposedDpEvent(
            [spent, dpa.SelfComposedDpEvent(chain_event(k), num_chains)]
        )
        return epsilon_spent(ev, delta, neighbourhood, accountant, interval) <= epsilon

    cap = 2**62

    def largest(interval, lo, hi=None):
        """Largest k >= lo that fits on this grid (``lo`` known to fit, ``hi`` not)."""
        hi = 2 * lo if hi is None else hi
        while hi <= cap and fits(hi, interval):
            lo, hi = hi, hi * 2
        if hi > cap:
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, interval) else (lo, mid)
        return lo

    if exact:
        return largest(None, 1) if fits(1, None) else 0
    coarse, close = PLANNING_PLD_INTERVALS
    if not fits(1, close):
        return 0
    lo = largest(coarse, 1) if fits(1, coarse) else 1
    if not fits(lo, close):  # grids need not be nested: start again on the close one
        return largest(close, 1)
    # The close grid's answer lies between the coarse one and a few percent above.
    return largest(close, lo, max(lo + 1, int(lo * 1.25) + 1))


# The ledger lives in numpyro_dp.ledger, which imports from this module: the
# re-export comes last, once everything it needs is defined.
from numpyro_dp.ledger import LedgerEntry, PrivacyLedger, PrivacySpent  # noqa: E402, F401
