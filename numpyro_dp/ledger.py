"""The privacy ledger: what a data set has spent, run by run (SPEC s2)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import dp_accounting as dpa

from numpyro_dp.accounting import (
    ACCOUNTANTS,
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
    is then the first iteration's).
    """

    kernel: str
    phase: str
    num_chains: int
    num_iterations: int
    per_iteration: dpa.DpEvent
    chain_event: dpa.DpEvent | None = None

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
    """Accumulates charged runs and reports what they cost together."""

    def __init__(self, delta: float, neighbourhood: str, accountant: str = "pld"):
        check_budget(None, delta)
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant={accountant!r}; use one of {ACCOUNTANTS}.")
        self.delta = delta
        self.neighbourhood = check_neighbourhood(neighbourhood)
        self.accountant = accountant
        self.entries: list[LedgerEntry] = []

    def event(self, extra: Sequence[LedgerEntry] = ()) -> dpa.DpEvent:
        entries = list(self.entries) + list(extra)
        return dpa.ComposedDpEvent([e.event for e in entries])

    def epsilon(self, extra: Sequence[LedgerEntry] = ()) -> float:
        return epsilon_spent(self.event(extra), self.delta, self.neighbourhood, self.accountant)

    def record(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)

    def spent(self) -> PrivacySpent:
        ev = self.event()
        return PrivacySpent(
            epsilon=self.epsilon() if self.entries else 0.0,
            delta=self.delta,
            neighbourhood=self.neighbourhood,
            num_releases=count_releases(ev),
            noise_multipliers=noise_multipliers(ev),
            accountant="rdp" if is_rdp_only(ev) else self.accountant,
            ledger=tuple(self.entries),
        )
