"""The privacy ledger: what a data set has spent, run by run (SPEC s2)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence

import dp_accounting as dpa

from numpyro_dp.accounting import (
    ACCOUNTANTS,
    PrivacyBudgetError,
    check_budget,
    check_neighbourhood,
    count_releases,
    epsilon_spent,
    noise_multipliers,
)
from numpyro_dp.rdp import is_rdp_only


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One charged call of a kernel: ``num_chains x num_iterations`` iterations.

    ``chain_event``, when given, is the event of one chain's ``num_iterations``
    iterations (for kernels whose cost changes over time; ``per_iteration``
    is then the first iteration's).  ``reproducible_noise`` marks a run that
    drew its noise from the test-only reproducible source (so released
    nothing private); ``label`` is free text naming the charge.
    """

    kernel: str
    phase: str
    num_chains: int
    num_iterations: int
    per_iteration: dpa.DpEvent
    chain_event: dpa.DpEvent | None = None
    reproducible_noise: bool = False
    label: str = ""

    @property
    def event(self) -> dpa.DpEvent:
        if self.chain_event is not None:
            return dpa.SelfComposedDpEvent(self.chain_event, self.num_chains)
        return dpa.SelfComposedDpEvent(self.per_iteration, self.num_chains * self.num_iterations)

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel,
            "phase": self.phase,
            "num_chains": self.num_chains,
            "num_iterations": self.num_iterations,
            "releases": count_releases(self.event),
            "noise_multipliers": list(noise_multipliers(self.event)),
            "per_iteration_event": repr(self.per_iteration),
            "reproducible_noise": self.reproducible_noise,
            "label": self.label,
        }


@dataclasses.dataclass(frozen=True)
class PrivacySpent:
    """What a run has spent, as reported by :meth:`PrivateMCMC.privacy_spent`.

    Attributes
    ----------
    epsilon, delta : float
        The run is (epsilon, delta)-DP with respect to every row (epsilon
        rounded up).
    neighbourhood : str
        ``"substitute"`` or ``"add_remove"``.
    num_releases : int
        Number of Gaussian-mechanism releases composed.
    noise_multipliers : tuple of float
        Distinct noise multipliers ``z = sigma / Delta`` used.
    accountant : str
        ``"pld"`` or ``"rdp"``.
    ledger : tuple of LedgerEntry
        Every charged call, in order.
    """

    epsilon: float
    delta: float
    neighbourhood: str
    num_releases: int
    noise_multipliers: tuple[float, ...]
    accountant: str
    ledger: tuple[LedgerEntry, ...] = ()

    def to_dict(self) -> dict:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "neighbourhood": self.neighbourhood,
            "num_releases": self.num_releases,
            "noise_multipliers": list(self.noise_multipliers),
            "accountant": self.accountant,
            "ledger": [e.to_dict() for e in self.ledger],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        zs = ", ".join(f"{z:.4g}" for z in self.noise_multipliers) or "none"
        lines = [
            f"({self.epsilon:.4g}, {self.delta:.3g})-DP, {self.neighbourhood} "
            f"neighbourhood, {self.accountant} accountant",
            f"  {self.num_releases} releases, noise multiplier(s) {zs}",
        ]
        for e in self.ledger:
            lines.append(
                f"  {e.kernel} {e.phase}: {e.num_chains} chain(s) x "
                f"{e.num_iterations} iterations"
            )
        return "\n".join(lines)


class PrivacyLedger:
    """Accumulates charged runs and reports what they cost together.

    Parameters
    ----------
    delta : float
        The delta at which epsilon is reported, in (0, 1).
    neighbourhood : {"substitute", "add_remove"}
    accountant : {"pld", "rdp"}
    epsilon : float, optional
        Total budget, enforced by :meth:`charge` (stored as ``budget``).
    """

    def __init__(
        self,
        delta: float,
        neighbourhood: str = "substitute",
        accountant: str = "pld",
        *,
        epsilon: float | None = None,
    ):
        check_budget(epsilon, delta)
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant={accountant!r}; use one of {ACCOUNTANTS}.")
        self.delta = delta
        self.neighbourhood = check_neighbourhood(neighbourhood)
        self.accountant = accountant
        self.budget = None if epsilon is None else float(epsilon)
        self._entries: list[LedgerEntry] = []
        self._lock = threading.Lock()

    @property
    def entries(self) -> list[LedgerEntry]:
        """Every charged entry, in order (a copy)."""
        return list(self._entries)

    def event(self, extra: Sequence[LedgerEntry] = ()) -> dpa.DpEvent:
        """The composition of every entry and then ``extra``."""
        return _compose([*self.entries, *extra])

    def epsilon(self, extra: Sequence[LedgerEntry] = ()) -> float:
        """Epsilon (rounded up) of every entry and ``extra`` together."""
        return self._epsilon_of([*self.entries, *extra])

    def record(self, entry: LedgerEntry) -> None:
        """Append ``entry`` without checking any budget."""
        with self._lock:
            self._entries.append(entry)

    def charge(self, entry: LedgerEntry, *, budget: float | None = None) -> float:
        """Append ``entry`` if the budget affords it; return the epsilon then spent.

        The budget is the smaller of ``budget`` and the ledger's own (none if
        neither is set).  Checking and appending are one atomic step.

        Raises
        ------
        PrivacyBudgetError
            If the entries and ``entry`` together would exceed the budget;
            nothing is recorded.
        """
        limit = self._limit(budget)
        with self._lock:
            after = self._check(self._entries, entry, limit)
            self._entries.append(entry)
        return after

    def spent(self) -> PrivacySpent:
        """What the entries have spent together."""
        entries = self.entries
        ev = _compose(entries)
        return PrivacySpent(
            epsilon=self._epsilon_of(entries) if entries else 0.0,
            delta=self.delta,
            neighbourhood=self.neighbourhood,
            num_releases=count_releases(ev),
            noise_multipliers=noise_multipliers(ev),
            accountant="rdp" if is_rdp_only(ev) else self.accountant,
            ledger=tuple(entries),
        )

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(delta={self.delta:.3g}, {self.neighbourhood}, {self.accountant}, "
            f"budget={self.budget}, spent={self.spent().epsilon:.6g})"
        )

    # ------------------------------------------------------------ helpers
    def _epsilon_of(self, entries: Sequence[LedgerEntry]) -> float:
        return epsilon_spent(_compose(entries), self.delta, self.neighbourhood, self.accountant)

    def _limit(self, budget: float | None) -> float | None:
        check_budget(budget, None)
        limits = [b for b in (budget, self.budget) if b is not None]
        return min(limits) if limits else None

    def _check(
        self, entries: Sequence[LedgerEntry], entry: LedgerEntry, limit: float | None
    ) -> float:
        """Epsilon of ``entries`` and ``entry``; raise if it exceeds ``limit``."""
        after = self._epsilon_of([*entries, entry])
        if limit is not None and after > limit:
            raise PrivacyBudgetError(
                f"Charging {entry.kernel} {entry.phase} ({entry.num_chains} chain(s) x "
                f"{entry.num_iterations} iterations) would bring the epsilon spent to "
                f"{after:.6g} > budget {limit:.6g} (delta={self.delta:.3g}; spent so far: "
                f"{self._epsilon_of(entries) if entries else 0.0:.6g}). Nothing was recorded."
            )
        return after


def _compose(entries: Sequence[LedgerEntry]) -> dpa.DpEvent:
    return dpa.ComposedDpEvent([e.event for e in entries])
