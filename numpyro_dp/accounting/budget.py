"""Budgets, neighbourhoods and the checks that guard them."""

from __future__ import annotations

import math

import dp_accounting as dpa

NEIGHBOURHOODS = ("substitute", "add_remove")
#: dp-accounting's relation for each neighbourhood.
RELATIONS = {
    "substitute": dpa.NeighboringRelation.REPLACE_ONE,
    "add_remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
}


class PrivacyBudgetError(ValueError):
    """A run that the stated privacy budget cannot pay for."""


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
