"""The privacy ledger: what a data set has spent, run by run.

A :class:`PrivacyLedger` lives in memory, or in a file opened with
:meth:`PrivacyLedger.open`, which makes it an odometer: every charge is on disk
before the iterations it pays for start, so re-running a notebook cell or
restarting the kernel cannot spend a data set's budget again.

File format
-----------
UTF-8 JSON Lines, append-only.  Line 1 is the header ``{"format":
"numpyro-dp-ledger", "version": 3, "id" (uuid4 hex), "key_id", "delta",
"neighbourhood", "accountant", "epsilon" (the budget or null), "created" (ISO
time)}``; every later line is one :class:`LedgerEntry` with an ``id`` (uuid4), a
UTC ``time``, what it protects (``privacy_unit``: ``"row"`` or ``"unit:..."``) and
its events written field by field (:func:`event_to_json`), so that reading it back
rebuilds them exactly.  Every line also carries ``prev``,
the ``tag`` of the line before it (64 zeros for the header), and ``tag``, the
HMAC-SHA256 (hex) under the ledger key (:mod:`~numpyro_dp.accounting.keyring`)
of ``prev`` followed by the canonical JSON (sorted keys, compact separators) of
its other fields.  ``key_id`` names the key (a hash of it, public).

The chain is verified whenever the file is read: an edited, reordered, removed
or unreadable line raises :class:`LedgerCorruptedError`, even with its tags
recomputed, unless by someone holding the key.  The key's seals (what this user
last read of each ledger) reveal lines cut off the end, or a ledger rolled back
to a backup, once this user has read the longer one.  A last line without its
newline is a charge whose writer died mid-write and was never acknowledged: it
is ignored (with a warning) and cut off before the next append.

What it protects against: a budget spent again by accident (a re-run cell, a
restarted kernel, concurrent processes, an edited or restored file); not an
analyst who means to overspend, holds the data and can read the key.

Concurrency
-----------
A charge takes an exclusive ``flock`` on the file, re-reads and verifies it,
checks the budget against what it holds, appends, ``fsync`` s and only then
unlocks and returns; reads take a shared lock.  Processes sharing a ledger
never lose a charge or overspend.  File ledgers need POSIX (``fcntl``) and a
local file system.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

import dp_accounting as dpa

from numpyro_dp.accounting.accountants import (
    ACCOUNTANTS,
    QUICK_PLD_INTERVAL,
    AccountantWarning,
    choose_accountant,
    epsilon_spent,
)
from numpyro_dp.accounting.budget import PrivacyBudgetError, check_budget, check_neighbourhood
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.accounting.events import count_releases, noise_multipliers
from numpyro_dp.accounting.keyring import LedgerKey
from numpyro_dp.accounting.ledger_file import (
    FILE_LOCKING,
    FORMAT,
    VERSION,
    LedgerFile,
    check_format,
    entry_from_record,
    entry_record,
    first_line,
    utc_now,
)
from numpyro_dp.accounting.lower_bound import epsilon_lower_bound
from numpyro_dp.model.units import ROW, common_unit


@dataclasses.dataclass(frozen=True)
class PrivacySpent:
    """What a run has spent, as reported by :meth:`PrivateMCMC.privacy_spent`.

    Attributes
    ----------
    epsilon, delta : float
        The run is (epsilon, delta)-DP with respect to every privacy unit
        (epsilon rounded up).
    neighbourhood : str
        ``"substitute"`` or ``"add_remove"``: of one privacy unit.
    num_releases : int
        Number of Gaussian-mechanism releases composed.
    noise_multipliers : tuple of float
        Distinct noise multipliers ``z = sigma / Delta`` used.
    accountant : str
        The accountant that charged the entries: ``"pld"`` or ``"rdp"``
        (see :func:`~numpyro_dp.accounting.choose_accountant`).
    ledger : tuple of LedgerEntry
        Every charged call, in order.
    privacy_unit : str
        What the guarantee protects: ``"row"`` (one row), or ``"unit:"`` and a
        fingerprint of the units when every entry was charged for the same units
        (``PrivateMCMC.run(..., privacy_unit=ids)``: one unit with all its rows).
    """

    epsilon: float
    delta: float
    neighbourhood: str
    num_releases: int
    noise_multipliers: tuple[float, ...]
    accountant: str
    ledger: tuple[LedgerEntry, ...] = ()
    privacy_unit: str = ROW

    def to_dict(self) -> dict:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "neighbourhood": self.neighbourhood,
            "num_releases": self.num_releases,
            "noise_multipliers": list(self.noise_multipliers),
            "accountant": self.accountant,
            "privacy_unit": self.privacy_unit,
            "ledger": [e.to_dict() for e in self.ledger],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        zs = ", ".join(f"{z:.4g}" for z in self.noise_multipliers) or "none"
        lines = [
            f"({self.epsilon:.4g}, {self.delta:.3g})-DP per "
            f"{'row' if self.privacy_unit == ROW else 'unit (all its rows)'}, "
            f"{self.neighbourhood} neighbourhood, {self.accountant} accountant",
            f"  {self.num_releases} releases, noise multiplier(s) {zs}",
        ]
        for e in self.ledger:
            lines.append(
                f"  {e.kernel} {e.phase}: {e.label}" if e.num_iterations == 0 and e.label else
                f"  {e.kernel} {e.phase}: {e.num_chains} chain(s) x {e.num_iterations} iterations"
            )
        return "\n".join(lines)


class PrivacyLedger:
    """Accumulates charged runs and reports what they cost together.

    The constructor makes an in-memory ledger; :meth:`open` one kept in a
    file, which every method re-reads (other processes may append to it).

    Parameters
    ----------
    delta : float
        The delta at which epsilon is reported, in (0, 1).
    neighbourhood : {"substitute", "add_remove"}
    accountant : {"auto", "pld", "rdp"}
        ``"auto"`` (the default) charges each composition with the tightest
        accountant that can interpret it.  An explicit choice that cannot
        interpret an entry (PLD and fixed-size batches drawn without
        replacement, say) is replaced by one that can, with an
        :class:`~numpyro_dp.accounting.AccountantWarning` at the charge.
    epsilon : float, optional
        Total budget, enforced by :meth:`charge` (stored as ``budget``).

    Attributes
    ----------
    path : Path or None
        The ledger file (None in memory).
    """

    def __init__(
        self,
        delta: float,
        neighbourhood: str = "substitute",
        accountant: str = "auto",
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
        self.path: Path | None = None
        self._file: LedgerFile | None = None
        self._entries: list[LedgerEntry] = []
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        delta: float | None = None,
        neighbourhood: str | None = None,
        accountant: str | None = None,
        epsilon: float | None = None,
        key_file: str | os.PathLike | None = None,
    ) -> PrivacyLedger:
        """Open the ledger file at ``path``, creating it if there is none.

        Parameters
        ----------
        path : str or PathLike
        delta, neighbourhood, accountant, epsilon : optional
            Settings of a new ledger (``delta`` is then required; the others
            default to ``"substitute"``, ``"auto"`` and no budget).  For an
            existing file, each one given must equal what the file holds:
            pass none of them to reopen it.
        key_file : str or PathLike, optional
            The secret key that authenticates the file (see
            :mod:`~numpyro_dp.accounting.keyring`): by default
            ``$NUMPYRO_DP_KEY_FILE``, else ``$XDG_CONFIG_HOME/numpyro-dp/ledger.key``
            (``~/.config/numpyro-dp/ledger.key``), created with mode 0600 with
            the first ledger.  A ledger shared by several users needs the same
            key in each user's own key file (mode 0600), passed here.

        Raises
        ------
        LedgerCorruptedError
            If the file was edited, damaged, cut short or rolled back.
        LedgerKeyError
            If the key file is missing, readable by others, or not the key the
            ledger was written with.
        ValueError
            If a given setting differs from the file's.

        Notes
        -----
        The file is the only record of what the data set has spent: back it
        up.  Never delete it to reset the budget: a deleted ledger is not
        detected, and a new one at its place starts from nothing.
        """
        if not FILE_LOCKING:
            raise NotImplementedError(
                "File-backed privacy ledgers need POSIX file locking (fcntl), which this "
                "platform lacks; use an in-memory PrivacyLedger."
            )
        path = Path(path).absolute()
        if not path.exists():
            if delta is None:
                raise ValueError(
                    f"There is no ledger at {path}; to create one, pass delta= (and "
                    "optionally neighbourhood=, accountant= and epsilon=, the budget)."
                )
            new = cls(delta, "substitute" if neighbourhood is None else neighbourhood,
                      "auto" if accountant is None else accountant, epsilon=epsilon)
            key = LedgerKey.load(key_file, create=True)
            LedgerFile.create(path, key, {
                "format": FORMAT, "version": VERSION, "id": uuid.uuid4().hex,
                "key_id": key.id, "delta": float(new.delta),
                "neighbourhood": new.neighbourhood, "accountant": new.accountant,
                "epsilon": new.budget, "created": utc_now(),
            })
        else:
            header = first_line(path)
            if header is not None:  # what the file is, before asking for its key
                check_format(path, header)
            key = LedgerKey.load(key_file)
        file = LedgerFile(path, key)
        header = file.snapshot().header
        given = {"delta": delta, "neighbourhood": neighbourhood, "accountant": accountant,
                 "epsilon": epsilon}
        for name, value in given.items():
            if value is not None and value != header[name]:
                raise ValueError(
                    f"{name}={value!r} differs from what the ledger file {path} holds "
                    f"({name}={header[name]!r}); omit {name}= to reopen it as it is."
                )
        ledger = cls(header["delta"], header["neighbourhood"], header["accountant"],
                     epsilon=header["epsilon"])
        ledger.path, ledger._file = path, file
        return ledger

    @property
    def entries(self) -> list[LedgerEntry]:
        """Every charged entry, in order (a copy)."""
        return list(self._entries) if self._file is None else self._file.snapshot().entries

    def event(self, extra: Sequence[LedgerEntry] = ()) -> dpa.DpEvent:
        """The composition of every entry and then ``extra``."""
        return _compose([*self.entries, *extra])

    def epsilon(self, extra: Sequence[LedgerEntry] = ()) -> float:
        """Epsilon (rounded up) of every entry and ``extra`` together."""
        return self._epsilon_of([*self.entries, *extra])

    def spent_so_far(self, entries: Sequence[LedgerEntry] | None = None) -> str:
        """What ``entries`` (default: the ledger's) spent, as a refusal quotes it: a
        quick upper bound (a PLD, where one is needed, composed in one pass on a
        coarse grid), since the charged figure can take seconds to compose."""
        entries = self.entries if entries is None else entries
        return f"at most {self._epsilon_of(entries, quick=True):.4g}" if entries else "0"


    def record(self, entry: LedgerEntry) -> None:
        """Append ``entry`` without checking any budget."""
        if self._file is None:
            with self._lock:
                self._entries.append(entry)
        else:
            self._file.append(entry_record(entry), lambda entries: None)

    def charge(self, entry: LedgerEntry, *, budget: float | None = None) -> float:
        """Append ``entry`` if the budget affords it; return the epsilon then spent.

        The budget is the smaller of ``budget`` and the ledger's own (none if
        neither is set).  Checking and appending are one atomic step; in a
        file, the entry is on disk when this returns.

        Raises
        ------
        PrivacyBudgetError
            If the entries and ``entry`` together would exceed the budget;
            nothing is recorded.
        ValueError
            If a file ledger cannot store one of the entry's events.
        """
        limit = self._limit(budget)
        if self._file is None:
            with self._lock:
                after = self._check(self._entries, entry, limit)
                self._entries.append(entry)
            return after
        record = entry_record(entry)
        stored = entry_from_record(record)  # what reading the line back gives
        return self._file.append(record, lambda entries: self._check(entries, stored, limit))

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
            accountant=choose_accountant(ev, self.accountant, self.neighbourhood).accountant,
            ledger=tuple(entries),
            # Notes release nothing: they protect whatever the releases do.
            privacy_unit=common_unit(e.privacy_unit for e in entries
                                     if count_releases(e.event) > 0),
        )

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        path = None if self.path is None else str(self.path)
        return (
            f"PrivacyLedger(path={path!r}, delta={self.delta:.3g}, {self.neighbourhood}, "
            f"{self.accountant}, budget={self.budget}, spent={self.spent().epsilon:.6g})"
        )

    # ------------------------------------------------------------ helpers
    def _epsilon_of(self, entries: Sequence[LedgerEntry], quick: bool = False) -> float:
        return epsilon_spent(_compose(entries), self.delta, self.neighbourhood, self.accountant,
                             QUICK_PLD_INTERVAL if quick else None)

    def _limit(self, budget: float | None) -> float | None:
        check_budget(budget, None)
        limits = [b for b in (budget, self.budget) if b is not None]
        return min(limits) if limits else None

    def _check(
        self, entries: Sequence[LedgerEntry], entry: LedgerEntry, limit: float | None
    ) -> float:
        """Epsilon of ``entries`` and ``entry``; raise if it exceeds ``limit``."""
        total = [*entries, entry]
        choice = choose_accountant(_compose(total), self.accountant, self.neighbourhood)
        if choice.reason is not None:
            warnings.warn(
                f"accountant={self.accountant!r} cannot charge {entry.kernel} {entry.phase}: "
                f"{choice.reason}. The ledger reports accountant={choice.accountant!r}; "
                f"pass accountant={choice.accountant!r} or 'auto' to say so yourself.",
                AccountantWarning, stacklevel=4,
            )
        if limit is not None:  # a lower bound above the budget refuses before any PLD
            lower = epsilon_lower_bound(_compose(total), self.delta, self.neighbourhood)
            if lower > limit:
                raise self._refusal(entry, f"at least {lower:.6g}", limit, entries)
        after = self._epsilon_of(total)
        if limit is not None and after > limit:
            raise self._refusal(entry, f"{after:.6g}", limit, entries)
        return after

    def _refusal(self, entry: LedgerEntry, after: str, limit: float,
                 entries: Sequence[LedgerEntry]) -> PrivacyBudgetError:
        return PrivacyBudgetError(
            f"Charging {entry.kernel} {entry.phase} ({entry.num_chains} chain(s) x "
            f"{entry.num_iterations} iterations) would bring the epsilon spent to "
            f"{after} > budget {limit:.6g} (delta={self.delta:.3g}; spent so far: "
            f"{self.spent_so_far(entries)}). Nothing was recorded."
        )


def _compose(entries: Sequence[LedgerEntry]) -> dpa.DpEvent:
    return dpa.ComposedDpEvent([e.event for e in entries])


