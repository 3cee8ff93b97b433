"""Per-row clipping: clip weights, squared norms of per-row vectors, and the
norm bound of a vector clipped in floating point.

Every clipped sum of per-row vectors (the gradient routes of
:mod:`~numpyro_dp.primitives.gradients`, the warm start's sums of
:mod:`~numpyro_dp.primitives.row_statistics`) weights each row by
:func:`clip_weights` of the norm of exactly the vector that is summed for it,
and bounds the clipped vector's norm by :func:`vector_clip_bound`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_dp.primitives.rounding import unit_roundoff


def clip_weights(norms: jax.Array, clip: jax.Array) -> jax.Array:
    """``min(1, clip / norm)`` per row; rows with a non-finite gradient get 0.

    A row whose gradient is NaN or infinite contributes nothing (its clipped
    norm, 0, is within the bound), so one pathological row can neither poison
    the sum nor reveal itself through it.
    """
    finite = jnp.isfinite(norms)
    safe = jnp.where(finite & (norms > 0), norms, 1.0)
    return jnp.where(finite, jnp.minimum(1.0, clip / safe), 0.0)


def row_squared_norms(rows: jax.Array) -> jax.Array:
    """``||r_i||^2`` of each row of an ``(n, d)`` array, as one matrix-vector product.

    For the indexed blocks' few numbers a row reads (an ``(n, width)`` array
    each): there XLA on CPU reduced over the short minor axes much slower than
    it multiplies by a vector of ones (a DPHMC iteration of the hierarchical
    model, 50 groups: 2.3x against 1.6x NumPyro HMC at n = 1e4, 1.8x against
    1.6x at 1e5).  The other coordinates are stored coordinate-major
    (:func:`column_squared_norms`).  ``HIGHEST``
    precision: an accelerator's default float32 product (TF32, bfloat16) would
    round the squares far beyond the error :func:`vector_clip_bound` allows;
    any order of summing d non-negative terms stays within it.
    """
    ones = jnp.ones(rows.shape[1], rows.dtype)
    return jnp.matmul(rows * rows, ones, precision=lax.Precision.HIGHEST)


#: Most coordinates whose squares :func:`column_squared_norms` adds one slice at a time.
UNROLLED_NORM = 64


def column_squared_norms(cols: jax.Array) -> jax.Array:
    """``||c_i||^2`` of each column of a ``(d, n)`` array (per-row vectors stored
    coordinate-major).

    With the ``d`` squares added slice by slice (an elementwise sum over ``n``)
    XLA on CPU fuses the norms, the clip weights and the weighted exact sum
    into passes over ``n`` that read each row's numbers where the gradient
    pass left them; a reduction over the minor axis of ``(n, d)`` rows made
    the gradients a separate array read twice.  A DPHMC iteration went from
    1.56x to 1.29x NumPyro HMC (hierarchical model, n = 1e5) and from 1.80x
    to 1.34x (1e6), the Student-t regression's from 1.53x to 1.33x (1e5)
    (``benchmarks/bench_hmc.py``).  Any order of adding the ``d`` squares
    stays within :func:`vector_clip_bound`.
    """
    if cols.shape[0] > UNROLLED_NORM:
        return jnp.sum(cols * cols, axis=0)
    return sum(c * c for c in cols)


def vector_clip_bound(clip, dim: int, dtype):
    """Norm bound of a vector clipped to ``clip`` in floating point.

    ``g * min(1, clip / ||g||)`` computed with rounding has norm at most
    ``clip (1 + (d + 8) u)`` (the norm's own error is below ``(d/2 + 1) u``).
    """
    return clip * (1.0 + (dim + 8) * unit_roundoff(dtype))


def finite_or_zero(x: jax.Array) -> jax.Array:
    """Non-finite entries as 0 (their rows have clip weight 0: see clip_weights)."""
    return jnp.where(jnp.isfinite(x), x, 0.0)


def masked_weights(weights: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Clip weights of a padded minibatch: rows outside the mask count 0."""
    return weights if mask is None else weights * mask.astype(weights.dtype)
