"""The release gate: every Gaussian or Laplace release of the library is sized and made here.

A release adds noise of scale ``z * Delta`` to a statistic rounded to a grid
(:func:`~numpyro_dp.primitives.rounding.grid_release`), where ``z`` is the
noise multiplier its ``DpEvent`` declares (``GaussianDpEvent(z)``,
``LaplaceDpEvent(z)``) and ``Delta`` the sensitivity *as computed*: the rows'
bound, the rounding of their sum, and what the grid itself adds
(:func:`sensitivity_on_grid`).  One recipe -- grid, sensitivity, scale, noise --
for every release, in the kernels' chains (:func:`release_on_grid`,
:func:`release_clipped_sum`), in the tuning's histograms and warm start, and
in the one-shot mechanisms (:func:`grid_plan`), so that what is drawn and what
is charged cannot drift apart; the white-box audit and the conformance test
tap this module's ``grid_release``.

The charge itself is the caller's, before the release is made: the runner's
ledger for a chain (:class:`~numpyro_dp.PrivateMCMC`), ``ledger=`` for a
one-shot release (:func:`numpyro_dp.releases.mechanisms.secret_release`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dp.primitives.rounding import (
    as_numpy_float64,
    exact_sum_error,
    grid_quantum,
    grid_release,
    grid_sensitivity,
    noise_scale,
    row_quantum,
)


def sensitivity_on_grid(sensitivity, dim: int, magnitude, grid_sigma, dtype, norm: str = "l2"):
    """``(Delta, q)``: a release's sensitivity with its grid's rounding, and the grid step.

    Parameters
    ----------
    sensitivity : float
        l2 (Gaussian) or l1 (Laplace) sensitivity of the statistic as computed,
        before it is rounded to the grid.
    dim : int
        Number of released coordinates.
    magnitude : float
        Public bound on ``|coordinate|`` of the statistic (0 for a float64 value).
    grid_sigma : float
        The noise scale the grid is sized for
        (:func:`~numpyro_dp.primitives.rounding.grid_quantum`).
    """
    quantum = grid_quantum(magnitude, grid_sigma, dtype)
    return sensitivity + grid_sensitivity(quantum, dim, norm), quantum


def release_on_grid(key: jax.Array, hi, lo, *, noise_multiplier, sensitivity, dim: int,
                    magnitude, grid_sigma=None) -> tuple[jax.Array, jax.Array]:
    """The Gaussian release of ``hi + lo`` with noise ``z * Delta``, and its standard deviation.

    ``Delta`` is ``sensitivity`` with the grid's rounding
    (:func:`sensitivity_on_grid`; the grid is sized for ``grid_sigma``, by
    default ``z * sensitivity``), ``z`` the ``noise_multiplier`` the
    accountant charges.  ``key`` is a secret noise key
    (:func:`numpyro_dp.primitives.secret.noise_key`).  Traceable.
    """
    hi = jnp.asarray(hi)
    dtype = hi.dtype
    if grid_sigma is None:
        grid_sigma = noise_multiplier * sensitivity
    computed, quantum = sensitivity_on_grid(sensitivity, dim, magnitude, grid_sigma, dtype)
    sigma = noise_scale(noise_multiplier, computed, dtype)
    return grid_release(key, hi, lo, sigma, quantum), sigma


# ------------------------------------------------- sums of clipped rows (in chains)
def _rows_sensitivity(num_terms: int, row_bound, sensitivity_factor: float, dim: int, dtype):
    """What one row moves a sum of ``num_terms`` clipped rows by, as computed (before the grid).

    Rows are rounded one by one to :func:`~numpyro_dp.primitives.rounding.row_quantum`
    (a row then has norm at most ``row_bound + sqrt(dim) q_row / 2``) and summed by
    :func:`~numpyro_dp.primitives.rounding.exact_sum` (error at most ``E``,
    :func:`~numpyro_dp.primitives.rounding.exact_sum_error`, on both data sets).
    """
    q_row = row_quantum(row_bound, num_terms, dtype)
    rows = sensitivity_factor * (row_bound + math.sqrt(dim) * q_row / 2)
    return rows + 2.0 * exact_sum_error(num_terms, row_bound, dtype)


def clipped_sum_sensitivity(
    num_terms: int, row_bound, sensitivity_factor: float, dim: int, sigma, dtype
):
    """``(Delta, q)``: sensitivity of a released sum of clipped rows *as computed*, and its grid.

    ``num_terms`` rows of l2 norm at most ``row_bound``, summed as
    :func:`_rows_sensitivity` says, then rounded to the grid ``q`` of
    :func:`~numpyro_dp.primitives.rounding.grid_quantum` (the sum's magnitude and a
    noise of standard deviation about ``sigma``), which adds at most ``sqrt(dim) q``.
    So ``Delta = factor (row_bound + sqrt(dim) q_row / 2) + 2 E + sqrt(dim) q``.
    The one formula that both a release and its accountant use.
    """
    return sensitivity_on_grid(
        _rows_sensitivity(num_terms, row_bound, sensitivity_factor, dim, dtype), dim,
        num_terms * row_bound, sigma, dtype,
    )


def release_clipped_sum(
    key: jax.Array,
    total: tuple[jax.Array, jax.Array],
    num_terms: int,
    row_bound,
    *,
    noise_multiplier,
    sensitivity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """The Gaussian release of a sum of clipped rows, and its noise standard deviation.

    Parameters
    ----------
    key : jax.random key
        A secret noise key (:func:`numpyro_dp.primitives.secret.noise_key`).
    total : (hi, lo)
        :func:`~numpyro_dp.primitives.rounding.exact_sum` of ``num_terms`` rows (zeros for
        padded rows), each of l2 norm at most ``row_bound``.
    noise_multiplier : float
        ``z``: the noise is ``sigma = z * Delta`` with ``Delta`` the
        sensitivity as computed (:func:`clipped_sum_sensitivity`), rounded up.

    Every Gaussian mechanism of the full-data and gradient kernels, of the
    warm start and of the noise-aware route's score release goes through here
    (the stochastic-gradient kernels' noise is fixed by their dynamics:
    :func:`release_sum_with_noise`).
    """
    hi, lo = total
    dim = max(1, hi.size)
    return release_on_grid(
        key, hi, lo, noise_multiplier=noise_multiplier,
        sensitivity=_rows_sensitivity(num_terms, row_bound, sensitivity_factor, dim, hi.dtype),
        dim=dim, magnitude=num_terms * row_bound,
        grid_sigma=noise_multiplier * sensitivity_factor * row_bound,
    )


def release_sum_with_noise(
    key: jax.Array, total: tuple[jax.Array, jax.Array], num_terms: int, row_bound, sigma
) -> jax.Array:
    """:func:`release_clipped_sum` for a noise ``sigma`` fixed by other means.

    Its noise multiplier is ``sigma / Delta`` with ``Delta`` from
    :func:`clipped_sum_sensitivity` at the same ``sigma`` (the accountant's side).
    """
    hi, lo = total
    _, quantum = clipped_sum_sensitivity(num_terms, row_bound, 1.0, 1, sigma, hi.dtype)
    return grid_release(key, hi, lo, sigma, quantum)


# ------------------------------------------------------- one-shot releases (host)
class GridPlan(NamedTuple):
    """How one statistic is released on a grid (``grid_release``).

    Attributes
    ----------
    scale : float
        Noise standard deviation (Gaussian) or scale ``b`` (Laplace):
        ``noise_multiplier * sensitivity``, rounded up.
    quantum : float
        The power-of-two grid step ``q`` the statistic is rounded to.
    noise : {"gaussian", "laplace"}
    """

    scale: float
    quantum: float
    noise: str

    def release(self, key: jax.Array, hi, lo=None) -> np.ndarray:
        """The release of the statistic ``hi + lo`` (a double-word pair; ``lo`` 0 by default).

        Call under ``jax.enable_x64(True)``
        (:func:`numpyro_dp.releases.mechanisms.secret_release` does).
        """
        hi = jnp.asarray(hi, jnp.float64)
        lo = jnp.zeros_like(hi) if lo is None else jnp.asarray(lo, jnp.float64)
        release = jax.jit(grid_release, static_argnames="noise")  # compiled once per shape
        return as_numpy_float64(release(key, hi, lo, self.scale, self.quantum, noise=self.noise))


def grid_plan(
    noise_multiplier: float,
    sensitivity: float,
    dim: int,
    *,
    magnitude: float = 0.0,
    error: float = 0.0,
    noise: str = "gaussian",
) -> GridPlan:
    """The grid and noise scale of a one-shot release whose sensitivity holds as computed.

    Parameters
    ----------
    noise_multiplier : float
        ``z``: the noise scale is ``z`` times the sensitivity as computed, so
        that the ledger's ``GaussianDpEvent(z)`` (``LaplaceDpEvent(z)``) is
        exactly what the release spends.
    sensitivity : float
        l2 (Gaussian) or l1 (Laplace) sensitivity of the exact statistic, for
        rows within the bounds *as computed*
        (:func:`numpyro_dp.releases.row_products.computed_bound`).
    dim : int
        Number of released coordinates.
    magnitude : float
        Public bound on ``|coordinate|`` of a double-word statistic (from the
        a-priori bounds and n, never from the data).  0 for a float64 value
        (``lo = 0``), whose rounding and noise addition are exact at any size.
    error : float
        Bound on the norm of (statistic as computed - exact statistic).
    noise : {"gaussian", "laplace"}

    Returns
    -------
    GridPlan
        With ``q = grid_quantum(magnitude, z * sensitivity, float64)`` and
        scale ``z`` times the sensitivity as computed, ``sensitivity + 2 error
        + grid_sensitivity(q, dim)`` (l2 or l1), times ``1 + 8u`` for the
        rounding of these products.
    """
    norm = "l2" if noise == "gaussian" else "l1"
    with jax.enable_x64(True):
        computed, quantum = sensitivity_on_grid(
            sensitivity + 2.0 * error, dim, magnitude, noise_multiplier * sensitivity,
            jnp.float64, norm)
        scale = noise_scale(noise_multiplier, float(computed), np.float64)
        return GridPlan(float(scale), float(quantum), noise)
