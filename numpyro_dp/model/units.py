"""Privacy units: the rows of one person (or firm, household, ...) taken together.

With ``privacy_unit=ids`` (one id per row) a guarantee holds for adding,
removing or substituting one *unit* with all its rows, not one row.  Every
full-data route then treats a unit as it treats a row without ids: the unit's
contribution (log-likelihood, gradient, log-likelihood ratio, curvature,
statistic) is the sum of its rows' contributions, and that total is what is
clipped, so the sensitivity is the clip as before, with ``n`` the number of
units.  :class:`Units` arranges the rows as unit *blocks*: an array of shape
``(num_units, max_rows, ...)`` per row array, a unit's rows first and then
copies of its first row that a mask gives weight exactly 0.

What is public, like ``n`` for rows: which rows share a unit (the ids), hence
the number of units and each unit's number of rows.  The values in a unit's
rows are private.  (If how many rows a person has is itself sensitive, pad
every unit to a public number of rows before the call.)

The order of the rows does not matter: units are ordered by id and a unit's
rows by their values (:meth:`Units.block`), so any order of the same rows gives
the same blocks, bit for bit, and so the same releases.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

#: What the ledger records for a guarantee per row.
ROW = "row"


class UnitsError(ValueError):
    """``privacy_unit`` or ``max_rows_per_unit`` cannot be used (the message says why)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Units:
    """Which rows form each unit (public), as unit blocks.

    Attributes
    ----------
    codes : ndarray of int, shape (n,)
        Each row's unit, numbered ``0 .. num_units - 1`` in the order of the ids.
    sizes : ndarray of int, shape (num_units,)
        Rows per unit.
    max_rows : int
        Rows per block: the public ``max_rows_per_unit``, else the largest unit.
    label : str
        What the ledger records: ``"unit:"`` and a fingerprint of the partition,
        so that a ledger can tell whether its entries protect the same units.
    """

    codes: np.ndarray
    sizes: np.ndarray
    max_rows: int
    label: str

    @classmethod
    def from_ids(cls, ids, num_rows: int, max_rows_per_unit: int | None = None) -> Units:
        """The units of ``ids`` (one per row, any integer or string labels: an array, a
        list, a pandas Series or Index).

        Raises
        ------
        UnitsError
            If ``ids`` is not one label per row, or a unit has more rows than
            ``max_rows_per_unit``.
        """
        ids = np.asarray(ids.to_numpy() if _is_pandas(ids) else ids)
        if ids.dtype == object and all(isinstance(v, str) for v in ids.flat):
            ids = ids.astype(str)  # pandas' string columns (and categories of strings)
        if ids.ndim != 1 or ids.shape[0] != num_rows:
            raise UnitsError(
                f"privacy_unit must give one unit id per row: an array of shape "
                f"({num_rows},), got shape {ids.shape}. Pass the column that names each "
                "row's person (or firm, household), e.g. `privacy_unit=df['person_id']`."
            )
        if ids.dtype.kind not in "iuUSb":
            raise UnitsError(
                f"privacy_unit ids must be integers or strings, got dtype {ids.dtype}; "
                "encode them, e.g. `pd.factorize(df['person'])[0]`."
            )
        labels, codes = np.unique(ids, return_inverse=True)
        codes = codes.reshape(-1).astype(np.int64)
        sizes = np.bincount(codes, minlength=len(labels))
        largest = int(sizes.max()) if len(sizes) else 0
        if max_rows_per_unit is None:
            max_rows = largest
        else:
            max_rows = int(max_rows_per_unit)
            if max_rows < 1 or max_rows != max_rows_per_unit:
                raise UnitsError(f"max_rows_per_unit must be a positive integer, got "
                                 f"{max_rows_per_unit!r}.")
            if largest > max_rows:
                raise UnitsError(
                    f"{int(np.sum(sizes > max_rows))} unit(s) have more rows than "
                    f"max_rows_per_unit={max_rows} (the largest has {largest}; the ids are "
                    "public). Raise max_rows_per_unit, or keep at most that many rows per "
                    "unit before the call (a documented contribution bound)."
                )
        digest = hashlib.sha256(np.ascontiguousarray(codes).tobytes()).hexdigest()[:16]
        return cls(codes, sizes, max_rows, f"unit:{digest}")

    @property
    def num_units(self) -> int:
        """The number of units (public): ``n`` wherever a route counts rows."""
        return len(self.sizes)

    def mask(self) -> np.ndarray:
        """``(num_units, max_rows)``: True on each unit's real rows."""
        return np.arange(self.max_rows)[None, :] < self.sizes[:, None]

    def positions(self, rows: list) -> np.ndarray:
        """``(num_units, max_rows)`` row positions: a unit's rows ordered by their values
        (all of ``rows``' arrays), then its first row again as padding."""
        keys = [np.asarray(x).reshape(len(self.codes), -1) for x in rows]
        columns = np.concatenate(keys, axis=1) if keys else np.zeros((len(self.codes), 0))
        # np.lexsort sorts by its last key first: the unit, then the values.
        order = np.lexsort(tuple(columns.T[::-1]) + (self.codes,))
        starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        slot = np.arange(self.max_rows)[None, :]
        slot = np.where(slot < self.sizes[:, None], slot, 0)  # padding: the first row again
        return order[starts[:, None] + slot]

    def block(self, rows: list) -> list[np.ndarray]:
        """Each row array as unit blocks ``(num_units, max_rows, ...)`` (host arrays)."""
        where = self.positions(rows)
        return [np.asarray(x)[where] for x in rows]


def bound_and_label(units: Units | None) -> tuple[int, str]:
    """``(rows one unit may hold, what the ledger records)`` of ``units``: ``(1, "row")``
    for a guarantee per row."""
    return (1, ROW) if units is None else (units.max_rows, units.label)


def _is_pandas(x) -> bool:
    return type(x).__module__.split(".")[0] == "pandas" and hasattr(x, "to_numpy")


def common_unit(labels) -> str:
    """The privacy unit that entries with these labels protect together: their unit if
    they all share one, else a row (a unit-level guarantee implies the row-level one,
    since one row lies in one unit; guarantees over different units compose only
    for rows)."""
    labels = set(labels)
    return labels.pop() if len(labels) == 1 else ROW


def holder_units(privacy_unit, holder_rows: list[int], several: bool,
                 max_rows_per_unit: int | None = None) -> Units:
    """The units of the rows of one data holder, or of several (``several``).

    ``privacy_unit`` is one id per row of the one holder, or, for several, a
    list with one such array per holder (``holder_rows`` their row counts).  A
    unit must lie within one holder: a holder releases from its own rows, so only
    it can sum a unit's rows, and the holders' releases compose in parallel only
    if no unit moves two of them.

    Raises
    ------
    UnitsError
        If the ids do not match the holders' rows, mix integers and strings, or a
        unit's rows lie with two holders.
    """
    if several and not (isinstance(privacy_unit, (list, tuple))
                        and len(privacy_unit) == len(holder_rows)):
        raise UnitsError("With X and y as lists (one array per holder), pass privacy_unit as a "
                         "list with one array of unit ids per holder, e.g. "
                         "privacy_unit=[ids1, ids2].")
    ids = [np.asarray(i) for i in (privacy_unit if several else [privacy_unit])]
    for j, (ids_j, rows) in enumerate(zip(ids, holder_rows, strict=True)):
        if ids_j.shape != (rows,):
            raise UnitsError(
                f"privacy_unit must give one unit id per row{f' of holder {j}' if several else ''}"
                f": an array of shape ({rows},), got shape {ids_j.shape}."
            )
    if len({i.dtype.kind in "US" for i in ids}) > 1:
        raise UnitsError("privacy_unit: give every holder's unit ids one type, all integers "
                         "or all strings.")
    units = Units.from_ids(np.concatenate(ids), sum(holder_rows), max_rows_per_unit)
    if sum(len(np.unique(i)) for i in ids) != units.num_units:
        raise UnitsError(
            "A unit id appears in more than one holder: a holder releases from its own rows "
            "only, so each unit's rows must all lie with one holder. Move every unit's rows "
            "to one holder (or give units of different holders different ids)."
        )
    return units
