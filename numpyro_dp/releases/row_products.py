"""Sums of row products in float64, for releases, with their error bounds.

The statistics that :mod:`~numpyro_dp.releases.mechanisms` and
:mod:`~numpyro_dp.releases.linreg_release` release from rows (``X^T X``,
``X^T y``, ``y^T y``) are computed here, in float64 whatever JAX's global
setting: sums over rows as float64 products of blocks of :data:`BLOCK_ROWS`
rows added in double-word arithmetic (:func:`row_product_sum`), with a bound
on the computation's error (:func:`row_product_error`) that the release gate
(:func:`~numpyro_dp.primitives.release.grid_plan`) adds, twice, to the
charged sensitivity.  Also the norm bound of a projected row as computed
(:func:`computed_bound`) and the packing of a symmetric matrix into its
upper triangle (:func:`upper_triangle`, :func:`symmetric_from_upper`).

The error bound assumes a standard dot-product kernel (any summation order,
no fast approximate arithmetic).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.rounding import (
    dw_sum,
    dw_sum_error,
    unit_roundoff,
)

#: Rows per block of :func:`row_product_sum`: each block is one float64 BLAS
#: product (error ``gamma_B``), the blocks are summed in double-word arithmetic.
BLOCK_ROWS = 1024
#: float64 unit roundoff, 2^-53.
U64 = unit_roundoff(np.float64)


def computed_bound(bound: float, dim: int) -> float:
    """Norm bound of a row of ``dim`` coordinates within ``bound`` as
    :func:`~numpyro_dp.releases.mechanisms.clip_rows` returns it.

    A projected row's norm exceeds the bound by rounding, and the check of an
    unprojected row's norm is itself rounded: both stay below
    ``bound (1 + (dim + 8) u)``.
    """
    return vector_clip_bound(bound, dim, np.float64)


@jax.jit
def row_product_sum(a, b) -> tuple[jax.Array, jax.Array]:
    """``sum_i a_i b_i^T`` over the rows of ``a`` (n, k) and ``b`` (n, m), as a double-word pair.

    Blocks of :data:`BLOCK_ROWS` rows are multiplied in float64 (one BLAS
    product each), and the block products are summed by
    :func:`~numpyro_dp.primitives.rounding.dw_sum`; memory ``O(k m n / BLOCK_ROWS)``.
    Error bound: :func:`row_product_error`.  Call under ``jax.enable_x64(True)``.
    """
    a, b = jnp.asarray(a, jnp.float64), jnp.asarray(b, jnp.float64)
    n = a.shape[0]
    block = min(BLOCK_ROWS, max(n, 1))
    num_blocks = -(-n // block)
    pad = ((0, num_blocks * block - n), (0, 0))
    a = jnp.pad(a, pad).reshape(num_blocks, block, a.shape[1])
    b = jnp.pad(b, pad).reshape(num_blocks, block, b.shape[1])
    products = jnp.einsum("rbk,rbm->rkm", a, b, precision=jax.lax.Precision.HIGHEST)
    return dw_sum(products)


def row_product_error(num_rows: int, a_bound: float, b_bound: float, num_entries: int) -> float:
    """Frobenius bound on the error of :func:`row_product_sum`.

    For rows with ``||a_i|| <= a_bound`` and ``||b_i|| <= b_bound``; ``num_entries``
    is ``k m``, the size of one product ``a_i b_i^T``.

    A block product sums ``B`` terms per entry in some order: entry error
    ``<= gamma_B sum |a_ik b_il|`` with ``gamma_B = B u / (1 - B u)`` (Higham
    2002, eq. 3.5), in Frobenius norm ``<= gamma_B sum_i ||a_i|| ||b_i||
    <= gamma_B n a_bound b_bound``.  The double-word sum of the blocks adds
    at most ``dw_sum_error`` per entry, ``sqrt(num_entries)`` of it in norm.
    """
    block = min(BLOCK_ROWS, max(num_rows, 1))
    num_blocks = -(-num_rows // block)
    gamma = block * U64 / (1.0 - block * U64)
    total = num_rows * a_bound * b_bound
    dw = dw_sum_error(num_blocks, total * (1.0 + gamma), np.float64)
    return gamma * total + math.sqrt(num_entries) * dw


def upper_triangle(pair: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The upper triangle (with the diagonal, row-major) of a double-word matrix pair."""
    iu = np.triu_indices(pair[0].shape[-1])
    return pair[0][iu], pair[1][iu]


def symmetric_from_upper(upper: np.ndarray, d: int) -> np.ndarray:
    """The symmetric ``d x d`` matrix whose upper triangle (row-major) is ``upper``."""
    out = np.zeros((d, d))
    out[np.triu_indices(d)] = upper
    return out + np.triu(out, 1).T

