"""How the real rows of padded row arrays lie (public, like ``n``).

Padding rows to a common block per device (:func:`numpyro_dp.primitives.sharding.shard_rows`)
must change nothing: :class:`RowLayout` says which rows are real, so that the
model adapter and the kernels give the others weight 0 and leave them out of
``n``.  It depends on ``n`` and the device count only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where the real rows of a padded, sharded data set lie (public).

    Block ``k`` (device ``k`` of the mesh axis) holds ``counts[k]`` real rows
    followed by ``block_size - counts[k]`` padded ones.

    Attributes
    ----------
    counts : tuple of int
        Real rows per block.
    block_size : int
        Rows per block, padding included.
    """

    counts: tuple[int, ...]
    block_size: int

    def __post_init__(self):
        if not self.counts or min(self.counts) < 0 or max(self.counts) > self.block_size:
            raise ValueError(f"counts {self.counts} must lie in [0, block_size={self.block_size}]")

    @property
    def num_rows(self) -> int:
        """``n``: the real rows (public)."""
        return int(sum(self.counts))

    @property
    def padded_rows(self) -> int:
        """The rows of the padded arrays."""
        return len(self.counts) * self.block_size

    @property
    def is_padded(self) -> bool:
        return self.num_rows < self.padded_rows

    def mask(self) -> jax.Array | None:
        """``True`` on real rows, ``(padded_rows,)``; None when nothing is padded."""
        if not self.is_padded:
            return None
        position = jnp.arange(self.padded_rows)
        counts = jnp.asarray(self.counts, position.dtype)
        return position % self.block_size < counts[position // self.block_size]

    def positions(self, idx: jax.Array) -> jax.Array:
        """Where real row ``idx`` (in ``[0, n)``, the order of the unpadded data) lies."""
        if not self.is_padded:
            return idx
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        block = jnp.searchsorted(jnp.asarray(np.cumsum(self.counts)), idx, side="right")
        return block * self.block_size + idx - jnp.asarray(starts)[block]
