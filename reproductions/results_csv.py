"""Append-only CSV result files shared by the reproduction scripts (resumable runs)."""

from __future__ import annotations

import csv
import pathlib


def load(path: pathlib.Path) -> list[dict]:
    """The rows of ``path`` as dicts of strings ([] if it does not exist yet)."""
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def append(path: pathlib.Path, fields: list[str], rows: list[dict]) -> None:
    """Append ``rows`` to ``path``, writing the header first if the file is new."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fields)
        if new:
            w.writeheader()
        w.writerows(rows)


def write(path: pathlib.Path, fields: list[str], rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` anew: floats to 6 significant digits, a missing or
    ``None`` value as an empty cell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row.get(k) is None else
                        (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k])
                        for k in fields})
