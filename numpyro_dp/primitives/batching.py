"""Minibatch samplers that run inside jit at a cost independent of ``n``.

Two sampling schemes, each with the law that its privacy accounting assumes:

``"poisson"``
    Every row independently with probability ``q``.  Drawn as
    ``K ~ Binomial(n, q)`` and then ``K`` distinct rows uniformly, which is
    exactly the law of Poisson sampling.  The rows go into a fixed-size buffer
    of ``buffer_size`` slots with a mask.  If ``K`` exceeds the buffer, a
    uniformly random ``buffer_size``-subset of the sampled rows is kept: that is
    *truncated* Poisson sampling, and the kernels account for it as such
    (dp-accounting's ``TruncatedSubsampledGaussianDpEvent``), so overflow never
    changes the privacy analysis.  :func:`poisson_buffer_size` picks a buffer
    whose overflow probability is below ``1e-12``.
``"without_replacement"``
    A uniformly random subset of exactly ``b`` rows (:func:`sample_without_replacement`).

The row indices depend only on the random key and the public ``n``, ``q``,
``b``: never on the data.

Both draw their rows with :func:`sample_without_replacement` (O(b log b),
no O(n) array while ``b <= n / 2``).  The laws are exact up to the floating-point
resolution of the underlying uniform and binomial draws (float32 unless
``jax_enable_x64``), as in every DP-SGD implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax, random
from scipy import stats

#: Overflow probability per draw that :func:`poisson_buffer_size` allows.
OVERFLOW_PROBABILITY = 1e-12


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


def poisson_buffer_size(num_rows: int, rate: float, tail: float = OVERFLOW_PROBABILITY) -> int:
    """Smallest buffer ``B`` with ``P(Binomial(num_rows, rate) > B) <= tail``."""
    if not 0 < rate <= 1:
        raise ValueError(f"sampling rate q={rate} must lie in (0, 1].")
    return int(min(num_rows, max(1, stats.binom.isf(tail, num_rows, rate) + 1)))


def poisson_batch(
    key: jax.Array, num_rows: int, rate: float, buffer_size: int
) -> tuple[jax.Array, jax.Array]:
    """Truncated Poisson sample: ``(indices, mask)`` of shape ``(buffer_size,)``.

    Each row is in the sample independently with probability ``rate``; if more
    than ``buffer_size`` rows are sampled, a uniformly random ``buffer_size``
    of them are kept.  ``mask`` is 1.0 for the slots that hold a sampled row.
    """
    key_k, key_rows = random.split(key)
    k = random.binomial(key_k, num_rows, rate).astype(jnp.int32)
    k = jnp.minimum(k, buffer_size)
    # A uniform buffer_size-subset in uniformly random order: its first k rows
    # are a uniform k-subset, the law of Poisson sampling given its count.
    idx = sample_without_replacement(key_rows, num_rows, buffer_size)
    return idx, (jnp.arange(buffer_size) < k).astype(jnp.result_type(float))
