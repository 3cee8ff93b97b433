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

Both samplers draw a uniform subset by Floyd's algorithm (O(size^2)
comparisons, no O(n) array).  The laws are exact up to the floating-point
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


def _floyd_subset(key: jax.Array, num_rows: int, size: int, count: jax.Array) -> jax.Array:
    """A uniform random ``count``-subset of ``range(num_rows)`` in the first slots.

    Floyd's algorithm: for ``j = n - count, ..., n - 1`` draw ``t`` uniform in
    ``[0, j]`` and take ``t``, or ``j`` if ``t`` was taken already.  Slots from
    ``count`` on are left at 0 (callers mask them).
    """
    keys = random.split(key, size)
    start = num_rows - count

    def step(s, chosen):
        j = start + s
        t = random.randint(keys[s], (), 0, jnp.maximum(j, 0) + 1)
        pick = jnp.where(jnp.any(chosen == t), j, t)  # empty slots hold -1
        return chosen.at[s].set(jnp.where(s < count, pick, -1))

    chosen = lax.fori_loop(0, size, step, jnp.full((size,), -1, jnp.int32))
    return jnp.maximum(chosen, 0)


def sample_without_replacement(key: jax.Array, num_rows: int, batch_size: int) -> jax.Array:
    """Indices of a uniformly random subset of ``batch_size`` distinct rows.

    Parameters
    ----------
    key : jax.random key
    num_rows, batch_size : int
        Public sizes, ``1 <= batch_size <= num_rows``.

    Returns
    -------
    (batch_size,) int32 array of distinct row indices (in no particular order).
    """
    if not 1 <= batch_size <= num_rows:
        raise ValueError(
            f"batch_size={batch_size} must lie in [1, num_rows={num_rows}]."
        )
    return _floyd_subset(key, num_rows, batch_size, jnp.asarray(batch_size))


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
    idx = _floyd_subset(key_rows, num_rows, buffer_size, k)
    return idx, (jnp.arange(buffer_size) < k).astype(jnp.result_type(float))
