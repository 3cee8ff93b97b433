"""The privacy ledger: what a data set has spent, run by run.

A :class:`PrivacyLedger` lives in memory, or in a file opened with
:meth:`PrivacyLedger.open`, which makes it an odometer: every charge is on disk
before the iterations it pays for start, so re-running a notebook cell or
restarting the kernel cannot spend a data set's budget again.

File format
-----------
UTF-8 JSON Lines, append-only.  Line 1 is the header ``{"format":
"numpyro-dp-ledger", "version": 2, "id" (uuid4 hex), "key_id", "delta",
"neighbourhood", "accountant", "epsilon" (the budget or null), "created" (ISO
time)}``; every later line is one :class:`LedgerEntry` with an ``id`` (uuid4), a
UTC ``time`` and its events written field by field (:func:`event_to_json`), so
that reading it back rebuilds them exactly.  Every line also carries ``prev``,
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

import contextlib
import dataclasses
import datetime
import hmac
import json
import math
import operator
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import dp_accounting as dpa

from numpyro_dp.accounting import (
    ACCOUNTANTS,
    AccountantWarning,
    PrivacyBudgetError,
    check_budget,
    check_neighbourhood,
    choose_accountant,
    count_releases,
    epsilon_spent,
    noise_multipliers,
)
from numpyro_dp.accounting.accountants import QUICK_PLD_INTERVAL
from numpyro_dp.accounting.keyring import LedgerKey, LedgerKeyError
from numpyro_dp.accounting.lower_bound import epsilon_lower_bound
from numpyro_dp.accounting.rdp import BarkerDpEvent

try:
    import fcntl
except ImportError:  # not POSIX: only in-memory ledgers
    fcntl = None

FORMAT, VERSION = "numpyro-dp-ledger", 2
_HEADER_KEYS = {"format", "version", "id", "key_id", "delta", "neighbourhood", "accountant",
                "epsilon", "created"}
_ENTRY_KEYS = {"id", "time", "kernel", "phase", "num_chains", "num_iterations", "per_iteration",
               "chain_event", "reproducible_noise", "label"}
_GENESIS = "0" * 64  # the "prev" of the header


class LedgerCorruptedError(ValueError):
    """A ledger file that was edited, damaged, cut short or rolled back after it was written."""


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
        The accountant that charged the entries: ``"pld"`` or ``"rdp"``
        (see :func:`~numpyro_dp.accounting.choose_accountant`).
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
        self._file: _LedgerFile | None = None
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
        if fcntl is None:
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
            _LedgerFile.create(path, key, {
                "format": FORMAT, "version": VERSION, "id": uuid.uuid4().hex,
                "key_id": key.id, "delta": float(new.delta),
                "neighbourhood": new.neighbourhood, "accountant": new.accountant,
                "epsilon": new.budget, "created": _now(),
            })
        else:
            header = _first_line(path)
            if header is not None:  # what the file is, before asking for its key
                _check_format(path, header)
            key = LedgerKey.load(key_file)
        file = _LedgerFile(path, key)
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
            self._file.append(_entry_record(entry), lambda entries: None)

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
        record = _entry_record(entry)
        stored = _entry_from_record(record)  # what reading the line back gives
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


# ------------------------------------------------------------ serialisation
#: The events a ledger file stores, with each field's kind: "float", "int",
#: "event" (a nested event) or "events" (a list of them).
_EVENT_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {
    dpa.NoOpDpEvent: (),
    dpa.GaussianDpEvent: (("noise_multiplier", "float"),),
    dpa.LaplaceDpEvent: (("noise_multiplier", "float"),),
    dpa.RandomizedResponseDpEvent: (("noise_parameter", "float"), ("num_buckets", "int")),
    dpa.SelfComposedDpEvent: (("event", "event"), ("count", "int")),
    dpa.ComposedDpEvent: (("events", "events"),),
    dpa.PoissonSampledDpEvent: (("sampling_probability", "float"), ("event", "event")),
    dpa.SampledWithoutReplacementDpEvent: (
        ("source_dataset_size", "int"), ("sample_size", "int"), ("event", "event"),
    ),
    dpa.TruncatedSubsampledGaussianDpEvent: (
        ("dataset_size", "int"), ("sampling_probability", "float"),
        ("truncated_batch_size", "int"), ("noise_multiplier", "float"),
    ),
    BarkerDpEvent: (("batch_size", "int"),),
}
_EVENT_TYPES = {cls.__name__: cls for cls in _EVENT_FIELDS}


def event_to_json(event: dpa.DpEvent) -> dict:
    """``event`` as ``{"type": class name, field: value, ...}`` (floats exact).

    Raises
    ------
    ValueError
        For an event type that a ledger file does not store, or a value that
        is not a finite number of its field's kind.
    """
    fields = _EVENT_FIELDS.get(type(event))
    if fields is None:
        raise ValueError(
            f"A ledger file cannot store a {type(event).__name__}; it stores "
            f"{', '.join(sorted(_EVENT_TYPES))}. Use an in-memory PrivacyLedger."
        )
    out = {"type": type(event).__name__}
    for name, kind in fields:
        value = getattr(event, name)
        if kind == "event":
            out[name] = event_to_json(value)
        elif kind == "events":
            out[name] = [event_to_json(e) for e in value]
        else:
            out[name] = _number(value, kind, f"{type(event).__name__}.{name}")
    return out


def _number(value, kind: str, name: str) -> int | float:
    """``value`` as a Python int or finite float; ValueError if it is not one."""
    number = None
    if not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError):
            number = operator.index(value) if kind == "int" else float(value)
    if number is None or (kind == "float" and not math.isfinite(number)):
        raise ValueError(f"{name}={value!r} is not a finite {kind}; a ledger file cannot store it.")
    return number


def event_from_json(data: dict) -> dpa.DpEvent:
    """The event that :func:`event_to_json` wrote as ``data``.

    Raises
    ------
    ValueError
        If ``data`` is not something :func:`event_to_json` writes.
    """
    cls = _EVENT_TYPES.get(data.get("type")) if isinstance(data, dict) else None
    if cls is None:
        raise ValueError(f"not a stored event: {data!r}")
    fields = _EVENT_FIELDS[cls]
    if set(data) != {"type", *(name for name, _ in fields)}:
        raise ValueError(f"{cls.__name__} with fields {sorted(data)}")
    kwargs = {}
    for name, kind in fields:
        value = data[name]
        if kind == "event":
            kwargs[name] = event_from_json(value)
        elif kind == "events" and isinstance(value, list):
            kwargs[name] = [event_from_json(e) for e in value]
        elif kind == "int" and type(value) is int:
            kwargs[name] = value
        elif kind == "float" and type(value) is float and math.isfinite(value):
            kwargs[name] = value
        else:
            raise ValueError(f"{cls.__name__}.{name}={value!r} is not of kind {kind}")
    return cls(**kwargs)


def _entry_record(entry: LedgerEntry) -> dict:
    """The fields of ``entry``'s line in a ledger file, with a new id and time."""
    for name in ("kernel", "phase", "label"):
        if not isinstance(getattr(entry, name), str):
            raise ValueError(f"LedgerEntry.{name} must be a string to be stored")
    return {
        "id": str(uuid.uuid4()),
        "time": _now(),
        "kernel": entry.kernel,
        "phase": entry.phase,
        "num_chains": _number(entry.num_chains, "int", "num_chains"),
        "num_iterations": _number(entry.num_iterations, "int", "num_iterations"),
        "per_iteration": event_to_json(entry.per_iteration),
        "chain_event": None if entry.chain_event is None else event_to_json(entry.chain_event),
        "reproducible_noise": bool(entry.reproducible_noise),
        "label": entry.label,
    }


def _entry_from_record(record: dict) -> LedgerEntry:
    """The entry an entry line holds; ValueError if the line is malformed."""
    if set(record) != _ENTRY_KEYS:
        raise ValueError(f"an entry with fields {sorted(record)}")
    kinds = {"id": str, "time": str, "kernel": str, "phase": str, "num_chains": int,
             "num_iterations": int, "reproducible_noise": bool, "label": str}
    for name, kind in kinds.items():
        if type(record[name]) is not kind:
            raise ValueError(f"{name}={record[name]!r} is not a {kind.__name__}")
    chain = record["chain_event"]
    return LedgerEntry(
        record["kernel"], record["phase"], record["num_chains"], record["num_iterations"],
        event_from_json(record["per_iteration"]),
        None if chain is None else event_from_json(chain),
        record["reproducible_noise"], record["label"],
    )


# --------------------------------------------------------------------- file
class _Contents(NamedTuple):
    header: dict
    entries: list[LedgerEntry]
    last_tag: str  # the "prev" of the next line
    lines: int  # complete lines, the header included
    end: int  # bytes up to the last newline; more is a torn last line


class _LedgerFile:
    """The JSON Lines file of a ledger: locking, reading with verification, appending."""

    def __init__(self, path: Path, key: LedgerKey):
        self.path = path
        self.key = key
        self._header_tag: str | None = None  # pinned by the first read
        self._warned_at: int | None = None  # offset of the torn line last warned about

    @staticmethod
    def create(path: Path, key: LedgerKey, header: dict) -> None:
        """Write a ledger holding ``header`` at ``path`` unless a file is there already.

        The header goes to a temporary file first, then is hard-linked into
        place: a file at ``path`` is always complete, and never replaced.
        """
        line, tag = _line(key, _GENESIS, header)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):  # another process created it
                os.link(tmp, path)
                _fsync_dir(path.parent)
                key.reseal(header["id"], 1, tag)
        finally:
            os.unlink(tmp)

    def snapshot(self) -> _Contents:
        """The verified contents, read under a shared lock."""
        with self._locked(exclusive=False) as fd:
            return self._read(fd)

    def append(self, record: dict, check: Callable[[list[LedgerEntry]], float | None]):
        """Append ``record`` as a line if ``check(entries)`` does not raise.

        Under an exclusive lock: re-read and verify, call ``check`` on the
        entries the file holds, cut off a torn last line, append, fsync, seal.
        Returns what ``check`` returned.
        """
        with self._locked(exclusive=True) as fd:
            contents = self._read(fd)
            result = check(contents.entries)
            if os.fstat(fd).st_size > contents.end:
                os.ftruncate(fd, contents.end)
            line, tag = _line(self.key, contents.last_tag, record)
            _write_all(fd, line)
            os.fsync(fd)
            self.key.reseal(contents.header["id"], contents.lines + 1, tag)
        return result

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """A descriptor of the file at ``path``, flock-ed shared or exclusive."""
        flags = os.O_RDWR | os.O_APPEND if exclusive else os.O_RDONLY
        while True:
            try:
                fd = os.open(self.path, flags)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"The privacy ledger {self.path} no longer exists: restore it from a "
                    "backup (never delete a ledger to reset its budget)."
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                if _same_file(fd, self.path):  # not replaced while we waited
                    yield fd
                    return
            finally:
                os.close(fd)  # releases the lock

    def _read(self, fd: int) -> _Contents:
        os.lseek(fd, 0, os.SEEK_SET)
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data) and self._warned_at != end:
            self._warned_at = end
            warnings.warn(
                f"The privacy ledger {self.path} ends with an incomplete line "
                f"({len(data) - end} bytes), a charge interrupted while being written and "
                "never acknowledged: it is ignored, and cut off before the next charge.",
                RuntimeWarning,
                stacklevel=4,
            )
        lines = data[:end].split(b"\n")[:-1]
        if not lines:
            raise self._corrupted(1, "the header is missing")
        prev, header, entries, tags = _GENESIS, {}, [], []
        for number, raw in enumerate(lines, 1):
            try:
                record = json.loads(raw.decode("utf-8"), parse_constant=_not_json)
            except ValueError:
                raise self._corrupted(number, "it is not valid JSON") from None
            if number == 1:
                self._check_format(record)
            if not isinstance(record, dict) or not {"prev", "tag"} <= set(record):
                raise self._corrupted(number, "it is not a ledger line")
            line_prev, line_tag = record.pop("prev"), record.pop("tag")
            if line_prev != prev:
                raise self._corrupted(
                    number, "it does not follow the line before it (lines were removed, "
                    "reordered or inserted)"
                )
            if not (isinstance(line_tag, str)
                    and hmac.compare_digest(line_tag, self.key.tag(prev, _canonical(record)))):
                raise self._corrupted(number, "its content does not match its tag")
            prev = line_tag
            tags.append(line_tag)
            if number == 1:
                header = self._check_header(record, line_tag)
                continue
            try:
                entries.append(_entry_from_record(record))
            except (TypeError, ValueError) as err:
                raise self._corrupted(number, f"it cannot be read ({err})") from None
        self._check_seal(header["id"], tags)
        return _Contents(header, entries, prev, len(lines), end)

    def _check_format(self, header) -> None:
        _check_format(self.path, header)
        if header.get("key_id") != self.key.id:
            raise LedgerKeyError(
                f"The privacy ledger {self.path} was written with key id "
                f"{header.get('key_id')!r}; the key at {self.key.path} has id {self.key.id!r}: "
                "pass the right key file (PrivacyLedger.open(..., key_file=) or "
                "$NUMPYRO_DP_KEY_FILE)."
            )

    def _check_header(self, header: dict, line_tag: str) -> dict:
        kinds = {"id": (str,), "key_id": (str,), "delta": (float,), "neighbourhood": (str,),
                 "accountant": (str,), "epsilon": (float, type(None)), "created": (str,)}
        if set(header) != _HEADER_KEYS or any(
            type(header[k]) not in kind for k, kind in kinds.items()
        ):
            raise self._corrupted(1, "the header is malformed")
        if self._header_tag is None:
            self._header_tag = line_tag
        elif line_tag != self._header_tag:
            raise self._corrupted(
                1, "the header differs from the one this ledger was opened with (the file "
                "was replaced by another ledger)"
            )
        return header

    def _check_seal(self, ledger_id: str, tags: list[str]) -> None:
        """Compare with what this user last read of the ledger; record what it holds now."""
        seal = self.key.seal(ledger_id)
        if seal is not None:
            lines, tag = seal
            lost = (f"; if no copy holds the lines this user read, the budget they charged "
                    f"was spent all the same: note it, then delete "
                    f"{self.key.seal_path(ledger_id)} to accept the file as it is")
            if len(tags) < lines:
                raise self._corrupted(
                    len(tags) + 1, f"lines were cut off its end (it held {lines} lines when "
                    f"this user last read it: a backup restored over it?){lost}"
                )
            if not hmac.compare_digest(tags[lines - 1], tag):
                raise self._corrupted(
                    lines, "it is not the line this user last read there (the ledger was "
                    "rolled back and charged again, or replaced by a copy that went its own "
                    f"way){lost}"
                )
        if seal is None or len(tags) > seal[0]:
            self.key.reseal(ledger_id, len(tags), tags[-1])

    def _corrupted(self, number: int, what: str) -> LedgerCorruptedError:
        return LedgerCorruptedError(
            f"Privacy ledger {self.path}, line {number}: {what}. The file was edited or "
            "corrupted and must not be trusted: restore it from a backup. Never delete or "
            "truncate a ledger to reset its budget."
        )


def _check_format(path: Path, header) -> None:
    """Raise unless ``header`` is the header of a ledger this version reads."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a numpyro-dp privacy ledger.")
    if header.get("version") != VERSION:
        raise ValueError(
            f"The privacy ledger {path} has format version {header.get('version')!r}; this "
            f"numpyro-dp reads version {VERSION} (lines authenticated by a key). Version 1 "
            "ledgers, of development versions, cannot be converted: start a new ledger."
        )


def _first_line(path: Path):
    """The header line of the file at ``path``, unverified (None if it is not JSON)."""
    with open(path, "rb") as f:
        line = f.readline()
    try:
        return json.loads(line.decode("utf-8"), parse_constant=_not_json)
    except ValueError:
        return None


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _line(key: LedgerKey, prev: str, content: dict) -> tuple[bytes, str]:
    """The line holding ``content`` after a line tagged ``prev``, and its tag."""
    tag = key.tag(prev, _canonical(content))
    return (_canonical({**content, "prev": prev, "tag": tag}) + "\n").encode("utf-8"), tag


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
