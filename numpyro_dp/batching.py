"""Minibatches of rows for the subsampled kernels, drawn inside jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax, random


def sample_without_replacement(key: jax.Array, num_rows: int, batch_size: int) -> jax.Array:
    """A uniformly random set of ``batch_size`` distinct rows of ``num_rows``, in O(b log b).

    ``jax.random.choice(replace=False)`` permutes all ``n`` rows, so its cost
    grows with ``n``.  Here, for ``b <= n / 2``: draw ``2 b`` row indices with
    replacement and keep the first ``b`` distinct ones in draw order; if fewer
    than ``b`` are distinct, draw again.  The law is exactly uniform over the
    ``C(n, b)`` subsets: both the accepted event and the kept set are invariant
    under relabelling the rows, so the kept set is uniform given acceptance.
    With ``2 b`` draws and ``b <= n / 2``, about ``0.63 n >= 1.26 b`` distinct
    values are expected, so redraws are rare except for tiny ``n``.  For
    ``b > n / 2`` a permutation of all rows costs O(n) = O(b) anyway.

    Parameters
    ----------
    key : jax.random key
    num_rows, batch_size : int
        Public and static: ``1 <= batch_size <= num_rows``.

    Returns
    -------
    int array of shape (batch_size,)
        Distinct row indices, in uniformly random order.
    """
    if not 1 <= batch_size <= num_rows:
        raise ValueError(f"batch_size={batch_size} must lie in [1, num_rows={num_rows}]")
    if 2 * batch_size > num_rows:
        return random.permutation(key, num_rows)[:batch_size]
    num_draws = 2 * batch_size

    def draw(key):
        draws = random.randint(key, (num_draws,), 0, num_rows)
        order = jnp.argsort(draws, stable=True)
        ranked = draws[order]
        first_in_sorted = jnp.concatenate([jnp.array([True]), ranked[1:] != ranked[:-1]])
        # stable sort: the first of equal values in sorted order is the first drawn
        is_first = jnp.zeros(num_draws, bool).at[order].set(first_in_sorted)
        return draws, is_first

    def redraw(carry):
        key, _, _ = carry
        key, sub = random.split(key)
        return (key, *draw(sub))

    def too_few(carry):
        return jnp.sum(carry[2]) < batch_size

    key, sub = random.split(key)
    _, draws, is_first = lax.while_loop(too_few, redraw, (key, *draw(sub)))
    keep = jnp.nonzero(is_first, size=batch_size)[0]
    return draws[keep]
