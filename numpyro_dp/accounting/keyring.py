"""The secret that authenticates ledger files, and what this user has seen of each.

A ledger file's lines carry HMAC-SHA256 tags under a per-user key kept *outside*
the file, so an edited ledger whose tags were recomputed without the key does
not verify.  The key is 32 random bytes (``os.urandom``), stored in hex in
``$NUMPYRO_DP_KEY_FILE`` or else ``$XDG_CONFIG_HOME/numpyro-dp/ledger.key``
(``~/.config/numpyro-dp/ledger.key``), created on first use with mode 0600 in
a directory of mode 0700; a key file that others may read or write is refused.
A ledger's header records the key's public id (a hash of it, never the key).

Next to the key, ``seals/<ledger id>`` keeps the number of lines and the last
tag of each ledger this user has read or charged: a ledger that later holds
fewer lines, or other lines up to that point, was cut short, rolled back to a
backup or replaced by a copy that went its own way, which tags alone cannot
reveal.

Whoever holds the key (and the seals) can forge a ledger: this protects against
accidents (edits, restores, copies), not against the key's owner.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import stat
import uuid
from pathlib import Path

#: Environment variable naming the key file.
KEY_FILE_ENV = "NUMPYRO_DP_KEY_FILE"
KEY_BYTES = 32
_ID_DOMAIN = b"numpyro-dp ledger key id\x00"


class LedgerKeyError(ValueError):
    """A ledger key that is missing, unreadable, exposed or not the ledger's."""


def default_key_path() -> Path:
    """``$NUMPYRO_DP_KEY_FILE``, else the user's configuration directory's key."""
    named = os.environ.get(KEY_FILE_ENV)
    if named:
        return Path(named).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return base / "numpyro-dp" / "ledger.key"


class LedgerKey:
    """A ledger key read from its file: ``id`` is public, the secret never leaves.

    Pickles carry the path only; unpickling reads the key file again.
    """

    def __init__(self, path: Path, secret: bytes):
        self.path = path
        self._secret = secret
        self.id = hashlib.sha256(_ID_DOMAIN + secret).hexdigest()[:16]

    @classmethod
    def load(cls, key_file: str | os.PathLike | None = None, *,
             create: bool = False) -> LedgerKey:
        """The key at ``key_file`` (default :func:`default_key_path`).

        ``create=True`` makes one if there is none (for a new ledger).

        Raises
        ------
        LedgerKeyError
            If there is no key file (and ``create`` is false), or it is not a
            key file of mode 0600 (or stricter).
        """
        path = default_key_path() if key_file is None else Path(key_file).expanduser()
        path = path.absolute()
        if create and not path.exists():
            _create(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise LedgerKeyError(
                f"There is no ledger key at {path}. Pass key_file= the key file the ledger "
                f"was written with (or set {KEY_FILE_ENV}); a new ledger creates one."
            ) from None
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(4 * KEY_BYTES)
        if not stat.S_ISREG(mode):
            raise LedgerKeyError(f"The ledger key {path} is not a regular file.")
        if mode & 0o077:
            raise LedgerKeyError(
                f"The ledger key {path} may be read or written by other users (mode "
                f"{stat.S_IMODE(mode):04o}): whoever reads it can forge a ledger. Run "
                f"`chmod 600 {path}`; to share a ledger, give each user a copy of the key "
                "in a file only they can read."
            )
        try:
            secret = bytes.fromhex(text.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            secret = b""
        if len(secret) != KEY_BYTES:
            raise LedgerKeyError(
                f"{path} is not a numpyro-dp ledger key ({KEY_BYTES} bytes in hex)."
            )
        return cls(path, secret)

    def tag(self, prev: str, content: str) -> str:
        """HMAC-SHA256 (hex) of the line whose content is ``content`` after tag ``prev``."""
        return hmac.new(self._secret, (prev + content).encode("utf-8"), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------ seals
    def seal(self, ledger_id: str) -> tuple[int, str] | None:
        """``(lines, last tag)`` of the ledger as this user last saw it, or None."""
        try:
            data = json.loads(self.seal_path(ledger_id).read_text("utf-8"))
            lines, tag = data["lines"], data["tag"]
            if type(lines) is int and lines >= 1 and isinstance(tag, str):
                return lines, tag
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            pass
        raise LedgerKeyError(
            f"The seal {self.seal_path(ledger_id)} is damaged; delete it (the ledger is "
            "then checked by its tags alone until read again)."
        )

    def reseal(self, ledger_id: str, lines: int, tag: str) -> None:
        """Record that the ledger holds ``lines`` lines, the last tagged ``tag``.

        Called under the ledger's lock, so seals follow the file's order.
        """
        path = self.seal_path(ledger_id)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:
            raise LedgerKeyError(
                f"Cannot write the ledger's seal in {path.parent} ({err.strerror}): seals "
                "live next to the key, so keep the key in a directory you can write."
            ) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"lines": lines, "tag": tag}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def seal_path(self, ledger_id: str) -> Path:
        """Where the seal of the ledger ``ledger_id`` lives."""
        if not (len(ledger_id) == 32 and all(c in "0123456789abcdef" for c in ledger_id)):
            raise ValueError(f"not a ledger id: {ledger_id!r}")
        return self.path.parent / "seals" / ledger_id

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(LedgerKey.load(state["path"]).__dict__)

    def __repr__(self) -> str:
        return f"LedgerKey(path={str(self.path)!r}, id={self.id!r})"


def _create(path: Path) -> None:
    """Write a new random key at ``path`` (mode 0600) unless one appears meanwhile.

    Written to a temporary file, then hard-linked into place: a key file is
    always complete, and never replaced.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(os.urandom(KEY_BYTES).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process made one first
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
