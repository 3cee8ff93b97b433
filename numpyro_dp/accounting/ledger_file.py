"""A ledger's file: JSON Lines, each line authenticated and chained, locked while charged.

The format and the guarantees are described in :mod:`numpyro_dp.accounting.ledger`;
this module reads (verifying every line), creates and appends to the file.
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import json
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from numpyro_dp.accounting.entry import LedgerEntry, event_from_json, event_to_json, stored_number
from numpyro_dp.accounting.keyring import LedgerKey, LedgerKeyError

try:
    import fcntl
except ImportError:  # not POSIX: only in-memory ledgers
    fcntl = None

#: Whether this platform locks files (POSIX ``fcntl``): file ledgers need it.
FILE_LOCKING = fcntl is not None

FORMAT, VERSION = "numpyro-dp-ledger", 3
_HEADER_KEYS = {"format", "version", "id", "key_id", "delta", "neighbourhood", "accountant",
                "epsilon", "created"}
_ENTRY_KEYS = {"id", "time", "kernel", "phase", "num_chains", "num_iterations", "per_iteration",
               "chain_event", "reproducible_noise", "label", "privacy_unit"}
_GENESIS = "0" * 64  # the "prev" of the header


class LedgerCorruptedError(ValueError):
    """A ledger file that was edited, damaged, cut short or rolled back after it was written."""


def entry_record(entry: LedgerEntry) -> dict:
    """The fields of ``entry``'s line in a ledger file, with a new id and time."""
    for name in ("kernel", "phase", "label", "privacy_unit"):
        if not isinstance(getattr(entry, name), str):
            raise ValueError(f"LedgerEntry.{name} must be a string to be stored")
    return {
        "id": str(uuid.uuid4()),
        "time": utc_now(),
        "kernel": entry.kernel,
        "phase": entry.phase,
        "num_chains": stored_number(entry.num_chains, "int", "num_chains"),
        "num_iterations": stored_number(entry.num_iterations, "int", "num_iterations"),
        "per_iteration": event_to_json(entry.per_iteration),
        "chain_event": None if entry.chain_event is None else event_to_json(entry.chain_event),
        "reproducible_noise": bool(entry.reproducible_noise),
        "label": entry.label,
        "privacy_unit": entry.privacy_unit,
    }


def entry_from_record(record: dict) -> LedgerEntry:
    """The entry an entry line holds; ValueError if the line is malformed."""
    if set(record) != _ENTRY_KEYS:
        raise ValueError(f"an entry with fields {sorted(record)}")
    kinds = {"id": str, "time": str, "kernel": str, "phase": str, "num_chains": int,
             "num_iterations": int, "reproducible_noise": bool, "label": str,
             "privacy_unit": str}
    for name, kind in kinds.items():
        if type(record[name]) is not kind:
            raise ValueError(f"{name}={record[name]!r} is not a {kind.__name__}")
    chain = record["chain_event"]
    return LedgerEntry(
        record["kernel"], record["phase"], record["num_chains"], record["num_iterations"],
        event_from_json(record["per_iteration"]),
        None if chain is None else event_from_json(chain),
        record["reproducible_noise"], record["label"], record["privacy_unit"],
    )


# --------------------------------------------------------------------- file
class _Contents(NamedTuple):
    header: dict
    entries: list[LedgerEntry]
    last_tag: str  # the "prev" of the next line
    lines: int  # complete lines, the header included
    end: int  # bytes up to the last newline; more is a torn last line


class LedgerFile:
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
                self.check_format(record)
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
                entries.append(entry_from_record(record))
            except (TypeError, ValueError) as err:
                raise self._corrupted(number, f"it cannot be read ({err})") from None
        self._check_seal(header["id"], tags)
        return _Contents(header, entries, prev, len(lines), end)

    def check_format(self, header) -> None:
        check_format(self.path, header)
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


def check_format(path: Path, header) -> None:
    """Raise unless ``header`` is the header of a ledger this version reads."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a numpyro-dp privacy ledger.")
    if header.get("version") != VERSION:
        raise ValueError(
            f"The privacy ledger {path} has format version {header.get('version')!r}; this "
            f"numpyro-dp reads version {VERSION} (lines authenticated by a key, each entry "
            "saying what it protects: a row or a unit). Ledgers of earlier versions, of "
            "development versions, cannot be converted: start a new ledger."
        )


def first_line(path: Path):
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


def utc_now() -> str:
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
