"""The accountants, and the one place that decides which of them charges an event.

Every accountant here is a ``dp_accounting.PrivacyAccountant`` that takes
events in this library's convention (``z = sigma / Delta`` under the
neighbourhood, see :mod:`numpyro_dp.accounting`):

* :class:`GaussianAccountant`: compositions of plain Gaussian releases,
  exactly (one Gaussian with ``mu = sqrt(sum 1 / z_i^2)``, Balle & Wang 2018);
* :class:`PureAccountant`: plain Gaussian, Laplace and randomized-response
  releases composed by dp-accounting's PLDs (the one-shot releases of
  :mod:`numpyro_dp.releases.mechanisms`);
* :class:`PldAccountant`: dp-accounting's ``PLDAccountant`` on a grid scaled to
  epsilon, with composed PLDs cached (subsampled releases);
* :class:`RdpAccountant`: dp-accounting's ``RdpAccountant``;
* :class:`numpyro_dp.accounting.rdp.WbkRdpAccountant`: fixed-size batches drawn without
  replacement and DP Barker (WBK amplification).

:func:`make_accountant` is the only place that maps an event and the user's
``accountant=`` ("auto", "pld" or "rdp") to one of them;
:func:`choose_accountant` says which family that is and, when it is not the
one asked for, why.  Every epsilon is rounded up (invariant 4).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from numpyro_dp.accounting.budget import (
    RELATIONS,
    check_budget,
    check_neighbourhood,
)
from numpyro_dp.accounting.events import (
    PURE_LEAVES,
    compose,
    gaussian_mu,
    has_randomized_response,
    pure_releases,
    releases,
    subsampled_releases,
    to_dp_accounting,
)
from numpyro_dp.accounting.gaussian import gaussian_epsilon
from numpyro_dp.accounting.rdp import WbkRdpAccountant, is_rdp_only

#: ``accountant=`` values: "auto" takes the tightest accountant that applies.
ACCOUNTANTS = ("auto", "pld", "rdp")


class AccountantWarning(UserWarning):
    """The accountant asked for cannot charge a run; another one does."""


class GaussianAccountant(dpa.PrivacyAccountant):
    """Plain Gaussian releases composed exactly, in the ``mu``-GDP closed form.

    ``k`` releases with noise multipliers ``z_i`` are one Gaussian mechanism
    with ``mu = sqrt(sum_i 1 / z_i^2)``; its epsilon is Balle & Wang's exact
    curve, evaluated analytically.  dp-accounting's discretised PLD gives the
    same curve up to its discretisation error, but needs memory that grows
    like ``mu^2`` and fails for the huge epsilons used to compare with
    non-private inference.  The relation does not matter: ``z`` is already
    relative to the neighbourhood's sensitivity.
    """

    def __init__(self, neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
        super().__init__(neighboring_relation)
        self._inverse_z2 = 0.0

    def _maybe_compose(self, event, count, do_compose):
        for leaf, _ in releases(event):
            if not isinstance(leaf, dpa.GaussianDpEvent):
                return self.CompositionErrorDetails(leaf, "not a plain Gaussian release")
        if do_compose and count:
            mu = gaussian_mu(event)
            self._inverse_z2 += count * mu**2
        return None

    @property
    def mu(self) -> float:
        return math.sqrt(self._inverse_z2)

    def get_epsilon(self, target_delta: float) -> float:
        return gaussian_epsilon(self.mu, target_delta)  # rounded up there


class PureAccountant(dpa.PrivacyAccountant):
    """Plain Gaussian, Laplace and randomized-response releases, by PLD.

    Noise multipliers are relative to the sensitivity under the ledger's
    neighbourhood, so Gaussian and Laplace losses do not depend on it and are
    built for sensitivity 1; randomized response changes one row's answer
    (``REPLACE_ONE``, the only relation its releases accept).  The plain
    Gaussians are first merged into one (tight).  dp-accounting's PLDs are
    pessimistic: they never understate epsilon.
    """

    def __init__(self, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE):
        super().__init__(neighboring_relation)
        self._releases: list[tuple[dpa.DpEvent, int]] = []

    def _maybe_compose(self, event, count, do_compose):
        for leaf, _ in releases(event):
            if not isinstance(leaf, PURE_LEAVES):
                return self.CompositionErrorDetails(
                    leaf, "not a Gaussian, Laplace or randomized-response release")
            if (isinstance(leaf, dpa.RandomizedResponseDpEvent)
                    and self.neighboring_relation is not dpa.NeighboringRelation.REPLACE_ONE):
                return self.CompositionErrorDetails(
                    leaf, "randomized response is accounted under 'substitute' only")
        if do_compose and count:
            self._releases += [(leaf, times * count) for leaf, times in releases(event)]
        return None

    def get_epsilon(self, target_delta: float) -> float:
        pld = privacy_loss_distribution
        inverse_z2 = sum(c / e.noise_multiplier**2 for e, c in self._releases
                         if isinstance(e, dpa.GaussianDpEvent))
        if any(isinstance(e, dpa.GaussianDpEvent) and e.noise_multiplier == 0
               for e, _ in self._releases):
            return math.inf
        parts = [pld.from_gaussian_mechanism(standard_deviation=1.0 / math.sqrt(inverse_z2))] \
            if inverse_z2 > 0 else []
        for e, c in self._releases:
            if isinstance(e, dpa.LaplaceDpEvent):
                parts.append(pld.from_laplace_mechanism(parameter=e.noise_multiplier)
                             .self_compose(c))
            elif isinstance(e, dpa.RandomizedResponseDpEvent):
                parts.append(pld.from_randomized_response(
                    noise_parameter=e.noise_parameter, num_buckets=e.num_buckets,
                    neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE).self_compose(c))
        if not parts:
            return 0.0
        total = parts[0]
        for p in parts[1:]:
            total = total.compose(p)
        return math.nextafter(float(total.get_epsilon_for_delta(target_delta)), math.inf)


class _ConvertingAccountant(dpa.PrivacyAccountant):
    """An accountant that hands events to dp-accounting in its noise convention
    (:func:`~numpyro_dp.accounting.events.to_dp_accounting`)."""

    def __init__(self, neighbourhood: str):
        super().__init__(RELATIONS[check_neighbourhood(neighbourhood)])
        self._neighbourhood = neighbourhood
        self._events: list[dpa.DpEvent] = []

    def _converted(self) -> dpa.DpEvent:
        return to_dp_accounting(dpa.ComposedDpEvent(self._events), self._neighbourhood)

    def _maybe_compose(self, event, count, do_compose):
        reference = self._reference()
        converted = to_dp_accounting(event, self._neighbourhood)
        if not reference.supports(converted):
            return self.CompositionErrorDetails(event, f"{type(reference).__name__} has no "
                                                "bound for it under this relation")
        if do_compose and count:
            self._events.append(event if count == 1 else dpa.SelfComposedDpEvent(event, count))
        return None

    def _reference(self) -> dpa.PrivacyAccountant:
        raise NotImplementedError


class RdpAccountant(_ConvertingAccountant):
    """dp-accounting's ``RdpAccountant``, on events in this library's convention."""

    def _reference(self):
        return rdp_privacy_accountant.RdpAccountant(neighboring_relation=self.neighboring_relation)

    def get_epsilon(self, target_delta: float) -> float:
        event = self._converted()
        mu = gaussian_mu(event)
        if mu is not None:  # plain Gaussians add up exactly as one: no rounding in a long sum
            event = dpa.GaussianDpEvent(1.0 / mu)
        acc = self._reference().compose(event)
        return math.nextafter(float(acc.get_epsilon(target_delta)), math.inf)


#: PLD grid of the first, coarse pass, which bounds epsilon cheaply.
COARSE_PLD_INTERVAL = 0.05
#: PLD grid of quick upper bounds (what a refusal quotes, a plan's first bracket):
#: composed in one pass, a few percent high, never below the charged figure.
QUICK_PLD_INTERVAL = 1e-2
#: Finest PLD grid (dp-accounting's default), and the grid relative to epsilon.
PLD_INTERVAL, PLD_RELATIVE_INTERVAL = 1e-4, 1e-5
#: Refinements after the coarse pass (two suffice in practice: each grid is set
#: from an upper bound, which the next pass tightens).
MAX_PLD_PASSES = 4
#: How many composed PLDs are kept (each holds its loss distribution, up to a
#: few MB on the finest grid).
PLD_CACHE_SIZE = 4
_pld_cache: dict[tuple, object] = {}
#: One iteration's PLD of each recently used subsampled Gaussian.
_leaf_pld_cache: dict[tuple, privacy_loss_distribution.PrivacyLossDistribution] = {}
LEAF_PLD_CACHE_SIZE = 8


class PldAccountant(_ConvertingAccountant):
    """dp-accounting's pessimistic PLD, on a grid scaled to epsilon.

    The PLD's support grows with epsilon, so on the default grid (1e-4) a run
    with a huge epsilon (tiny noise multipliers) needs gigabytes.  Starting
    from a coarse grid, each pass refines the grid to ``max(1e-4, 1e-5 eps)``
    for the epsilon just found, until that no longer refines it: every epsilon
    below 10 ends on dp-accounting's default grid.  Every grid gives an upper
    bound (the pessimistic PLD rounds losses up), so this never understates.

    ``interval``, if given, evaluates in a single pass on that grid: a fast
    upper bound for planning (e.g. ``1e-2`` is about 10x faster than the final
    figure and a few percent high), never below the figure a run is charged.
    """

    def __init__(self, neighbourhood: str, interval: float | None = None):
        super().__init__(neighbourhood)
        self._interval = interval

    def _reference(self):
        return pld_privacy_accountant.PLDAccountant(self.neighboring_relation)

    def get_epsilon(self, target_delta: float) -> float:
        event = self._converted()
        if self._interval is not None:
            eps = _composed_pld(event, self.neighboring_relation, self._interval).get_epsilon(
                target_delta)
            return math.nextafter(float(eps), math.inf)
        interval = COARSE_PLD_INTERVAL
        eps = _composed_pld(event, self.neighboring_relation, interval).get_epsilon(target_delta)
        for _ in range(MAX_PLD_PASSES):
            finer = max(PLD_INTERVAL, PLD_RELATIVE_INTERVAL * eps)
            if finer >= interval:
                break
            interval = finer
            eps = min(eps, _composed_pld(event, self.neighboring_relation, interval)
                      .get_epsilon(target_delta))
        return math.nextafter(float(eps), math.inf)


def _lru_put(cache: dict, key, value, size: int = PLD_CACHE_SIZE) -> None:
    cache[key] = value  # the most recently used last
    while len(cache) > size:
        del cache[next(iter(cache))]


def _composed_pld(event: dpa.DpEvent, relation, interval: float):
    """dp-accounting's PLD accountant with ``event`` (its convention) composed on a grid.

    The last few are kept, keyed by the event's repr (which spells out every
    field), so one run's epsilon at several deltas, or checked and then
    reported, is composed once.  ``get_epsilon`` does not change an accountant.
    Events made of subsampled Gaussians only are composed by
    :class:`SubsampledComposition`, the same PLD built from cached parts.
    """
    key = (repr(event), relation, interval)
    acc = _pld_cache.pop(key, None)
    if acc is None:
        leaves = subsampled_releases(event)
        if leaves is None:
            acc = pld_privacy_accountant.PLDAccountant(relation, interval).compose(event)
        else:
            acc = SubsampledComposition(leaves, relation, interval)
    _lru_put(_pld_cache, key, acc)
    return acc


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


class SubsampledComposition:
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


# ------------------------------------------------------------------ the choice
class AccountantChoice(NamedTuple):
    """Which accountant family charges an event, and why if not the one asked for."""

    accountant: str  # "pld" or "rdp"
    reason: str | None  # None when it is the one asked for (or "auto")


def choose_accountant(event: dpa.DpEvent, accountant: str = "auto",
                      neighbourhood: str = "substitute") -> AccountantChoice:
    """The accountant family that :func:`make_accountant` uses for ``event``.

    ``"auto"`` (and ``"pld"``) take the tight PLD family wherever it applies;
    ``"rdp"`` takes dp-accounting's RDP accountant.  A family that cannot
    interpret the event is replaced by the other one, and ``reason`` says so:
    fixed-size batches drawn without replacement and DP Barker have only the
    WBK RDP bound; Poisson-sampled Gaussians under ``"substitute"`` have no
    RDP bound in dp-accounting.  Raises ``ValueError`` when neither applies.
    """
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r}; use one of {ACCOUNTANTS}.")
    check_neighbourhood(neighbourhood)
    if has_randomized_response(event) and neighbourhood != "substitute":
        raise ValueError(
            "Randomized response is accounted under the 'substitute' "
            "neighbourhood only (one row's answer changes)."
        )
    if is_rdp_only(event):
        if neighbourhood != "substitute":
            raise ValueError(
                "Fixed-size batches drawn without replacement are accounted only for "
                "the 'substitute' neighbourhood (n is public); use "
                "neighbourhood='substitute'."
            )
        if not WbkRdpAccountant().supports(event):
            raise ValueError(
                "This run composes fixed-size batches drawn without replacement (or DP "
                "Barker) with releases the WBK RDP accountant cannot interpret, such as "
                "Poisson-sampled ones, and PLD has no bound for the former; keep them "
                "in separate ledgers or use one batching throughout."
            )
        reason = None if accountant != "pld" else (
            "dp-accounting's PLD has no bound for fixed-size batches drawn without "
            "replacement (or for DP Barker's test); they are accounted by RDP with "
            "Wang, Balle & Kasiviswanathan's amplification, an upper bound")
        return AccountantChoice("rdp", reason)
    wanted = "pld" if accountant == "auto" else accountant
    if gaussian_mu(event) is not None or pure_releases(event) is not None:
        return AccountantChoice(wanted, None)
    relation = RELATIONS[neighbourhood]
    converted = to_dp_accounting(event, neighbourhood)
    supported = {
        "pld": pld_privacy_accountant.PLDAccountant(relation).supports(converted),
        "rdp": rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
        .supports(converted),
    }
    if supported[wanted]:
        return AccountantChoice(wanted, None)
    other = "rdp" if wanted == "pld" else "pld"
    if supported[other]:
        return AccountantChoice(other, (
            f"dp-accounting's {wanted.upper()} accountant has no bound for one of its "
            f"releases under the {neighbourhood!r} neighbourhood; the "
            f"{other.upper()} accountant charges it"))
    raise ValueError(
        f"Neither accountant can account for this event under the {neighbourhood!r} "
        "neighbourhood (dp-accounting supports none of its releases there). Fixed-size "
        "minibatches (sampling without replacement) are accounted under 'substitute' "
        "only; Poisson minibatches by either accountant under 'add_remove', by PLD "
        "under 'substitute'."
    )


def make_accountant(event: dpa.DpEvent, accountant: str = "auto",
                    neighbourhood: str = "substitute",
                    pld_interval: float | None = None) -> dpa.PrivacyAccountant:
    """A fresh ``dp_accounting.PrivacyAccountant`` for events like ``event``.

    The one mapping from an event and ``accountant=`` to the accountant that
    charges it (see :func:`choose_accountant`).  Compose ``event`` into it and
    read ``get_epsilon(delta)``: every accountant here rounds up.
    """
    family = choose_accountant(event, accountant, neighbourhood).accountant
    mu = gaussian_mu(event)
    if mu is not None and (family == "pld" or mu == 0 or math.isinf(mu)):
        return GaussianAccountant()
    if pure_releases(event) is not None and family == "pld":
        return PureAccountant(RELATIONS[neighbourhood])
    if is_rdp_only(event):
        return WbkRdpAccountant()
    if family == "rdp":
        return RdpAccountant(neighbourhood)
    return PldAccountant(neighbourhood, pld_interval)


def epsilon_spent(
    event: dpa.DpEvent,
    delta: float,
    neighbourhood: str = "substitute",
    accountant: str = "auto",
    pld_interval: float | None = None,
) -> float:
    """Epsilon (rounded up) of ``event`` at ``delta``.

    ``pld_interval``, if given, evaluates dp-accounting's PLD (when one is
    needed) in a single pass on that grid: a fast upper bound for planning,
    never below the figure a run is charged.

    dp-accounting's numerical warnings (``divide by zero`` for events far from
    the budget, ...) are silenced: the answer is still an upper bound, and the
    warnings would only alarm (and clutter) the user.

    Parameters
    ----------
    event : DpEvent
        What was (or will be) released, in the conventions of
        :mod:`numpyro_dp.accounting`.
    delta : float
        Target delta in (0, 1).
    neighbourhood : {"substitute", "add_remove"}
        Passed to dp-accounting for events whose privacy depends on it.
    accountant : {"auto", "pld", "rdp"}
        ``"auto"`` (and ``"pld"``) are tight where PLD applies; ``"rdp"`` is
        looser.  An event the chosen family cannot interpret is charged by the
        other (:func:`choose_accountant` says which and why).
    """
    check_budget(None, delta)
    event = compose(releases(event))  # dp-accounting refuses parts composed 0 times
    acc = make_accountant(event, accountant, neighbourhood, pld_interval)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(acc.compose(event).get_epsilon(delta))
