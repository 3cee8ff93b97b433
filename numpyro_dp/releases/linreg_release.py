"""The release of linear regression's sufficient statistics (Alparslan 2023, s5.2).

Alparslan, Yildirim & Birbil (2023); Alparslan (2023), s5.2.  Each of J data holders
releases, once, ``S_hat_j = X_j^T X_j + sigma M_j`` (``M_j`` symmetric, upper
triangle iid N(0, 1)), ``z_hat_j = X_j^T y_j + sigma v_j`` and, by default,
``u_hat_j = y_j^T y_j + sigma w_j`` (Bernstein & Sheldon 2019: without it the data
say nothing about ``sigma_y``, which stays the prior's) by one Gaussian mechanism on
the joint vector (:func:`release_linreg_stats`, a :class:`LinRegRelease`); under
``"add_remove"`` each holder's row count joins it (:data:`COUNT_WEIGHT`); with
``privacy_unit=ids`` it protects one unit (a person) with all its rows.
:func:`adassp` is the adaSSP baseline (Wang 2018), a release of its own.  Inference
from a release is post-processing and costs no budget: :mod:`numpyro_dp.releases.linreg`,
which also offers this module's user-facing names (``ndp.linreg.release_linreg_stats``).

Precision: the releases follow :mod:`numpyro_dp.releases.mechanisms` :
secret noise, statistics computed in float64 (blockwise products summed in
double-word arithmetic, :mod:`numpyro_dp.releases.row_products`) with their error
bounds and the grid rounding charged, noise added on a grid.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import dp_accounting as dpa
import jax.numpy as jnp
import numpy as np
from jax import random
from scipy.stats import norm

from numpyro_dp.accounting import (
    calibrate_noise_multiplier,
    check_delta_for_rows,
    check_neighbourhood,
)
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.accounting.ledger import PrivacyLedger
from numpyro_dp.model.units import ROW, Units, bound_and_label
from numpyro_dp.primitives.release import GridPlan, grid_plan
from numpyro_dp.releases.mechanisms import (
    Release,
    check_bound,
    clip_rows,
    gaussian_noise_multiplier,
    gram_plan,
    gram_sensitivity,
    planned_rows,
    release_entry,
    release_units,
    secret_release,
    sum_sensitivity,
)
from numpyro_dp.releases.row_products import (
    U64,
    computed_bound,
    row_product_error,
    row_product_sum,
    symmetric_from_upper,
    upper_triangle,
)

# ------------------------------------------------------------------ release
#: Under ``"add_remove"`` each holder's row count is private and is released
#: with its statistics: every row adds ``COUNT_WEIGHT`` times the statistics'
#: sensitivity to one more coordinate, so the noise grows by a factor
#: ``sqrt(1 + COUNT_WEIGHT^2)`` (3% at 1/4) and the count's noise is about
#: ``noise_multiplier / COUNT_WEIGHT`` rows.
COUNT_WEIGHT = 0.25


def linreg_sensitivity(x_bound: float, y_bound: float, neighbourhood: str = "substitute",
                       with_yty: bool = True, max_rows_per_unit: int = 1) -> float:
    """l2-sensitivity of ``(upper triangle of X^T X, X^T y[, y^T y])``.

    Rows with ``||x|| <= x_bound`` and ``|y| <= y_bound``.  Without ``y^T y``,
    add/remove: ``sqrt(x_bound^4 + x_bound^2 y_bound^2)`` (Alparslan 2023, eq.
    5.12); substitute: ``sqrt(2 x_bound^4 + 4 x_bound^2 y_bound^2)`` (see
    :func:`~numpyro_dp.releases.mechanisms.gram_sensitivity`; the ``X^T y`` part
    doubles), below the factor 2 of the triangle inequality.  ``y^T y`` adds
    ``y_bound^4`` under the root in both neighbourhoods: a row's ``y^2`` lies in
    ``[0, y_bound^2]``, so a substitution moves it by ``y_bound^2`` at most.  Each
    part's bound holds whatever the others do, so the root of their squares bounds
    the joint vector.  Holders hold disjoint rows, so a row moves one holder's
    statistics only.

    Privacy units (:class:`~numpyro_dp.model.units.Units`) of at most
    ``m = max_rows_per_unit`` rows: a unit's statistics are the sum of its rows',
    and each part moves by at most ``m`` times its bound for a row, so the joint
    bound is ``m`` times the above.  Add/remove: the unit brings
    ``sum_i ut(x_i x_i^T)`` of norm ``<= sum_i ||x_i||^2 <= m x_bound^2``,
    ``sum_i x_i y_i`` of norm ``<= m x_bound y_bound`` and ``sum_i y_i^2 <= m
    y_bound^2``.  Substitute (its rows ``(x_i, y_i)`` replaced by ``(x'_k, y'_k)``,
    at most ``m`` of each): ``A = sum_i x_i x_i^T`` and ``B = sum_k x'_k x'_k^T`` are
    positive semi-definite with ``||A||_F <= tr A <= m x_bound^2``, so
    ``||A - B||_F^2 = ||A||_F^2 + ||B||_F^2 - 2 tr(A B) <= 2 m^2 x_bound^4`` (``tr(A B)
    >= 0``); ``||sum_i x_i y_i - sum_k x'_k y'_k|| <= 2 m x_bound y_bound``; and both
    ``y^T y`` parts lie in ``[0, m y_bound^2]``.  With ``m = 1`` these are the bounds
    for a row.
    """
    bx, by = check_bound("x_bound", x_bound), check_bound("y_bound", y_bound)
    if not (isinstance(max_rows_per_unit, (int, np.integer)) and max_rows_per_unit >= 1):
        raise ValueError(f"max_rows_per_unit={max_rows_per_unit!r} must be a positive integer.")
    z_part = sum_sensitivity(bx * by, neighbourhood)
    u_part = by**2 if with_yty else 0.0
    return max_rows_per_unit * math.sqrt(gram_sensitivity(bx, neighbourhood) ** 2 + z_part**2
                                         + u_part**2)


def count_weight(x_bound: float, y_bound: float, neighbourhood: str,
                 with_yty: bool = True) -> float:
    """What one row adds to the released count coordinate: 0 (none) under ``"substitute"``,
    where the counts are public, else :data:`COUNT_WEIGHT` times the statistics' sensitivity
    for a row."""
    if check_neighbourhood(neighbourhood) == "substitute":
        return 0.0
    return COUNT_WEIGHT * linreg_sensitivity(x_bound, y_bound, neighbourhood, with_yty)


def linreg_plan(
    noise_multiplier: float,
    num_rows: int,
    d: int,
    x_bound: float,
    y_bound: float,
    neighbourhood: str,
    with_yty: bool = True,
    max_rows_per_unit: int = 1,
) -> GridPlan:
    """:class:`~numpyro_dp.primitives.release.GridPlan` of one holder's :func:`linreg_statistic`.

    ``num_rows`` is what the release is sized for
    (:func:`~numpyro_dp.releases.mechanisms.planned_rows`: n, or the public
    ``max_rows`` under add/remove).  Sensitivity :func:`linreg_sensitivity` at
    the bounds as computed, joined under add/remove by the count coordinate
    (:func:`count_weight`), plus the error bounds of the sums
    (:func:`~numpyro_dp.releases.row_products.row_product_error`), the count's
    rounding and the grid rounding.  With units of at most ``max_rows_per_unit =
    m`` rows both move ``m`` times as far (a unit adds or removes up to ``m``
    rows, hence ``m`` counts); the error bounds are per row and cover all
    ``num_rows`` rows, since the statistic is computed as the sum over rows
    whatever the units.
    """
    bx, by = computed_bound(x_bound, d), computed_bound(y_bound, 1)
    w = count_weight(bx, by, neighbourhood, with_yty)
    error = (row_product_error(num_rows, bx, bx, d * d) + row_product_error(num_rows, bx, by, d)
             + (row_product_error(num_rows, by, by, 1) if with_yty else 0.0)
             + U64 * w * num_rows)
    sensitivity = math.hypot(
        linreg_sensitivity(bx, by, neighbourhood, with_yty, max_rows_per_unit),
        max_rows_per_unit * w)
    return grid_plan(
        noise_multiplier, sensitivity, d * (d + 3) // 2 + with_yty + (w > 0),
        magnitude=num_rows * max(bx * max(bx, by), by**2 if with_yty else 0.0, w),
        error=error,
    )


def xty_statistic(X, y) -> tuple:
    """``X^T y`` as computed for a release: a double-word pair of shape (d,)."""
    hi, lo = row_product_sum(X, y[:, None])
    return hi[:, 0], lo[:, 0]


def linreg_statistic(X, y, weight: float = 0.0, with_yty: bool = True) -> tuple:
    """``(upper triangle of X^T X, X^T y[, y^T y])`` as computed for a release: a
    double-word pair.

    With ``weight > 0`` the row count times ``weight`` is appended (add/remove,
    :func:`count_weight`).  Call under ``jax.enable_x64(True)``.
    """
    (s_hi, s_lo), (z_hi, z_lo) = upper_triangle(row_product_sum(X, X)), xty_statistic(X, y)
    parts_hi, parts_lo = [s_hi, z_hi], [s_lo, z_lo]
    if with_yty:
        u_hi, u_lo = row_product_sum(y[:, None], y[:, None])
        parts_hi.append(u_hi[0])
        parts_lo.append(u_lo[0])
    if weight > 0:
        parts_hi.append(jnp.array([weight * len(X)], jnp.float64))
        parts_lo.append(jnp.zeros(1, jnp.float64))
    return jnp.concatenate(parts_hi), jnp.concatenate(parts_lo)


def holder_rows(X, y) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each data holder's rows ``(X_j, y_j)``: one pair of arrays, or one sequence of each.

    Holders are the user's own split of the rows (each holds its rows; no row
    moves between holders when another is added or removed).  Shapes are
    checked (public); a holder may hold no rows.
    """
    several = isinstance(X, (list, tuple))
    if several != isinstance(y, (list, tuple)) or (several and len(X) != len(y)):
        raise ValueError(
            "Pass X and y both as arrays (one data holder) or both as lists with one array "
            "per holder, e.g. X=[X1, X2], y=[y1, y2]."
        )
    pairs = list(zip(X, y, strict=True)) if several else [(X, y)]
    if not pairs:
        raise ValueError("No data holder given: pass at least one (X_j, y_j).")
    out = []
    d = np.shape(pairs[0][0])[-1] if np.ndim(pairs[0][0]) == 2 else None
    for j, (Xj, yj) in enumerate(pairs):
        Xj, yj = np.asarray(Xj, np.float64), np.asarray(yj, np.float64)
        if Xj.ndim != 2 or Xj.shape[1] != d or yj.shape != (len(Xj),):
            # Under add/remove a holder's row count is private: the message names the
            # other dimensions only.
            raise ValueError(
                f"Holder {j}: X must be (n_j, d) with the same d for every holder and y "
                f"(n_j,) with as many rows; got X with {Xj.ndim} axes and columns "
                f"{Xj.shape[1:]}, y with {yj.ndim} axes."
            )
        out.append((Xj, yj))
    return out


class LinRegRelease(NamedTuple):
    """Released statistics of J data holders (all fields public).

    Attributes
    ----------
    S_hat : ndarray (J, d, d)
        Noisy ``X_j^T X_j`` (symmetric, not necessarily PSD).
    z_hat : ndarray (J, d)
        Noisy ``X_j^T y_j``.
    yty : ndarray (J,) or None
        Noisy ``y_j^T y_j``; None where it was not released (``with_yty=False``,
        paper 002's release).
    n_rows : ndarray (J,)
        Rows per holder: exact under ``"substitute"`` (public), released with
        noise (about ``noise_multiplier / COUNT_WEIGHT`` rows, floored at 0)
        under ``"add_remove"``, where they are private.
    sigma : float
        Noise standard deviation of every released coordinate.
    x_bound, y_bound : float
        The a-priori bounds used.
    entry : LedgerEntry
        The cost: one Gaussian release (holders hold disjoint rows, or with
        ``privacy_unit`` disjoint units, so their releases compose in parallel).
    neighbourhood : str
    privacy_unit : str
        What the release protects: ``"row"``, or ``"unit:..."`` (one unit with all
        its rows, :class:`~numpyro_dp.model.units.Units`), as ``entry`` records it.
    """

    S_hat: np.ndarray
    z_hat: np.ndarray
    yty: np.ndarray | None
    n_rows: np.ndarray
    sigma: float
    x_bound: float
    y_bound: float
    entry: LedgerEntry
    neighbourhood: str
    privacy_unit: str = ROW


def _holders_plan_rows(holders, neighbourhood, max_rows, delta, units: Units | None) -> int:
    """The per-holder row count the releases are sized for, after the ``delta`` check
    against every row (or unit) of every holder (n, or ``J max_rows`` under add/remove)."""
    rows = planned_rows(max(len(Xj) for Xj, _ in holders), neighbourhood, max_rows)
    if neighbourhood == "add_remove":
        total = len(holders) * rows
    else:
        total = sum(len(Xj) for Xj, _ in holders) if units is None else units.num_units
    check_delta_for_rows(delta, total)
    return rows


def release_linreg_stats(
    rng_key,
    X,
    y,
    *,
    x_bound: float,
    y_bound: float,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    neighbourhood: str = "substitute",
    max_rows: int | None = None,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
    with_yty: bool = True,
    privacy_unit=None,
    max_rows_per_unit: int | None = None,
) -> LinRegRelease:
    """Release ``(S_hat_j, z_hat_j, u_hat_j)`` for each data holder's rows.

    Parameters
    ----------
    rng_key : jax.random key
        Public; the noise comes from a fresh OS secret.
    X, y : array (n, d) and (n,), or lists of them
        One data holder's rows, or one array per holder (``X=[X1, X2, X3]``,
        ``y=[y1, y2, y3]``; :func:`holder_rows`).  Each holder would run this on
        its own rows; the lists simulate J holders with the same noise scale.
    x_bound, y_bound : float
        A-priori bounds on ``||x||`` and ``|y|``, fixed without looking at the
        data.  Rows beyond them are projected onto them
        (:func:`~numpyro_dp.releases.mechanisms.clip_rows`).
    epsilon, delta, noise_multiplier : float, optional
        The budget (noise calibrated analytically, Balle & Wang 2018), or the
        noise multiplier.  ``delta`` must be below ``1 / n`` (all holders' rows,
        or units with ``privacy_unit``; under add/remove ``1 / (J max_rows)``).
    neighbourhood : {"substitute", "add_remove"}
        Under add/remove the row counts are private: the release is sized for
        ``max_rows`` (required) and each holder's count is released with noise
        in the same Gaussian release (:data:`COUNT_WEIGHT`), so nothing
        published depends on n except through the noise.
    max_rows : int, optional
        A public upper bound on each holder's rows
        (:func:`~numpyro_dp.releases.mechanisms.planned_rows`).
    ledger, reproducible_noise :
        As in :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism`.
    with_yty : bool
        Release ``y_j^T y_j`` with the rest (default), so that the data inform
        ``sigma_y`` (Bernstein & Sheldon 2019); it raises the sensitivity by
        ``y_bound^4`` under the root (:func:`linreg_sensitivity`).  False makes
        paper 002's release, whose ``sigma_y`` is the prior's.
    privacy_unit : array (n,), or a list of them, optional
        One unit id per row (a person, firm, household; integers or strings):
        the guarantee is then for substituting one unit with all its rows, not
        one row.  Rows are still projected onto the bounds, and a unit's
        statistics are the sum of its rows', so the sensitivity is
        ``max_rows_per_unit`` times a row's (:func:`linreg_sensitivity` derives
        it).  Which rows share a unit is public, like n
        (:mod:`~numpyro_dp.model.units`); the entry and ``privacy_unit`` of the
        release record the units' label.  With several holders pass one array
        per holder (``privacy_unit=[ids1, ids2]``); a unit id that appears in
        two holders is refused (:func:`~numpyro_dp.model.units.holder_units`).  Substitute
        neighbourhood only: under add/remove the ids would fix n, which this
        release keeps private there.
    max_rows_per_unit : int, optional
        A public bound on the rows of one unit (all holders share it); by
        default the largest unit's (public with the ids).  A unit with more
        rows is refused.

    The noise covers :func:`linreg_sensitivity` plus the computation's error
    bounds and the grid rounding (:func:`linreg_plan`); one Gaussian event,
    since a row (a unit) moves one holder's statistics only.
    """
    holders = holder_rows(X, y)
    units = release_units(privacy_unit, [len(Xj) for Xj, _ in holders],
                          isinstance(X, (list, tuple)), max_rows_per_unit, neighbourhood)
    rows = _holders_plan_rows(holders, neighbourhood, max_rows, delta, units)
    holders = [(clip_rows(Xj, x_bound, "x"), clip_rows(yj, y_bound, "y")) for Xj, yj in holders]
    z = gaussian_noise_multiplier(epsilon, delta, noise_multiplier)
    d = holders[0][0].shape[1]
    m, label = bound_and_label(units)
    plan = linreg_plan(z, rows, d, x_bound, y_bound, neighbourhood, with_yty, m)
    weight = count_weight(computed_bound(x_bound, d), computed_bound(y_bound, 1), neighbourhood,
                          with_yty)
    entry = release_entry("LinRegStats", dpa.GaussianDpEvent(z), reproducible_noise, label)
    k = d * (d + 1) // 2

    def draw(key):
        stats = np.stack([plan.release(random.fold_in(key, j),
                                       *linreg_statistic(Xj, yj, weight, with_yty))
                          for j, (Xj, yj) in enumerate(holders)])
        return np.stack([symmetric_from_upper(s[:k], d) for s in stats]), stats[:, k:]

    S_hat, rest = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger,
                                 what="release_linreg_stats")
    yty = rest[:, d] if with_yty else None
    if weight > 0:
        n_rows = np.maximum(rest[:, -1] / weight, 0.0)
    else:
        n_rows = np.array([len(Xj) for Xj, _ in holders])
    return LinRegRelease(S_hat, rest[:, :d], yty, n_rows, float(plan.scale), float(x_bound),
                         float(y_bound), entry, neighbourhood, label)


# ------------------------------------------------------------------ adaSSP
def adassp(
    rng_key,
    X,
    y,
    *,
    x_bound: float,
    y_bound: float,
    epsilon: float,
    delta: float,
    neighbourhood: str = "substitute",
    max_rows: int | None = None,
    rho: float = 0.05,
    ledger: PrivacyLedger | None = None,
    reproducible_noise: bool = False,
    privacy_unit=None,
    max_rows_per_unit: int | None = None,
) -> Release:
    """adaSSP (Wang 2018), distributed as in Alparslan (2023, eq. 7.2).

    ``X``, ``y``: one holder's rows or one array per holder, as in
    :func:`release_linreg_stats` (rows projected onto the bounds; ``max_rows``,
    ``privacy_unit``, ``max_rows_per_unit`` and the ``delta`` check likewise).
    Each holder releases
    ``lambda_min(S_j)`` (sensitivity ``x_bound^2``),
    ``S_j`` (:func:`~numpyro_dp.releases.mechanisms.gram_sensitivity`) and ``z_j``
    (``X_j^T y_j``), three Gaussian releases with one noise multiplier whose
    tight composition spends (epsilon, delta); each sensitivity also covers
    its computation and grid rounding, the eigenvalue's with the bound
    ``(4 d + 2) u n x_bound^2`` on the float64 eigensolver and the rounding of
    ``S_j`` (backward stability with the modest constant ``4 d``, assumed of
    LAPACK's ``syevd``).  The regulariser is Wang's
    ``lambda_j = max(0, sigma_S sqrt(d log(2 d^2 / rho)) - lambda_min_tilde)``
    with ``lambda_min_tilde`` the released eigenvalue lowered by its
    ``1 - rho / 3`` noise quantile.  Wang splits the budget as (eps/3, delta/3)
    with the classic calibration; the tight split gives less noise for the
    same guarantee.  Returns ``theta_hat = (sum S_hat_j + sum lambda_j I)^-1
    sum z_hat_j`` as the release's value.  ``ledger`` and
    ``reproducible_noise`` as in
    :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism`.

    With units of at most ``m = max_rows_per_unit`` rows each sensitivity is
    ``m`` times a row's: ``S_j`` and ``z_j`` by :func:`linreg_sensitivity`'s
    argument, and ``lambda_min(S_j)`` because a unit's part of ``S_j`` is
    positive semi-definite of norm at most ``m x_bound^2`` (Weyl; under
    substitution both ``lambda_min`` lie within that of ``S_j`` without the
    unit and ``m x_bound^2`` above it).
    """
    holders = holder_rows(X, y)
    units = release_units(privacy_unit, [len(Xj) for Xj, _ in holders],
                          isinstance(X, (list, tuple)), max_rows_per_unit, neighbourhood)
    n = _holders_plan_rows(holders, neighbourhood, max_rows, delta, units)  # bounds grow with n
    holders = [(clip_rows(Xj, x_bound, "x"), clip_rows(yj, y_bound, "y")) for Xj, yj in holders]
    if not 0 < rho < 1:
        raise ValueError(f"rho={rho} (failure probability) must lie in (0, 1).")
    d = holders[0][0].shape[1]

    def event3(z):
        return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 3)

    z = calibrate_noise_multiplier(event3, epsilon, delta)
    bx, by = computed_bound(x_bound, d), computed_bound(y_bound, 1)
    m, label = bound_and_label(units)
    S_plan = gram_plan(z, n, d, x_bound, neighbourhood, m)
    z_plan = grid_plan(z, m * sum_sensitivity(bx * by, neighbourhood), d,
                       magnitude=n * bx * by, error=row_product_error(n, bx, by, d))
    # lambda_min moves by at most m x_bound^2 (Weyl); its error: S as computed,
    # S rounded to float64, and the eigensolver.
    lam_error = row_product_error(n, bx, bx, d * d) + (4 * d + 2) * U64 * n * bx**2
    lam_plan = grid_plan(z, m * bx**2, 1, magnitude=n * bx**2, error=lam_error)
    shift = lam_plan.scale * norm.ppf(1 - rho / 3)
    entry = release_entry("adaSSP", event3(z), reproducible_noise, label)

    def draw(key):
        S_sum, z_sum, lam_sum = np.zeros((d, d)), np.zeros(d), 0.0
        for j, (Xj, yj) in enumerate(holders):
            k_lam, k_S, k_z = random.split(random.fold_in(key, j), 3)
            S = row_product_sum(Xj, Xj)
            lam = np.linalg.eigvalsh(np.asarray(S[0] + S[1]))[0]
            lam_min = float(lam_plan.release(k_lam, lam)) - shift
            lam_sum += max(0.0, S_plan.scale * math.sqrt(d * math.log(2 * d**2 / rho))
                           - max(lam_min, 0.0))
            S_sum += symmetric_from_upper(S_plan.release(k_S, *upper_triangle(S)), d)
            z_sum += z_plan.release(k_z, *xty_statistic(Xj, yj))
        return np.linalg.solve(S_sum + lam_sum * np.eye(d), z_sum)

    theta = secret_release(rng_key, entry, neighbourhood, draw, ledger=ledger, what="adassp")
    return Release(theta, S_plan.scale, entry, neighbourhood)
