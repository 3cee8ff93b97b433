"""Where, and in what blocks of rows, a per-row computation runs.

On one device the rows are taken in equal blocks of at most a given number of
rows (:func:`map_blocks`, :func:`summed_blocks`, :func:`map_rows`), which
bounds the per-row values and intermediates held at once, whatever ``n``.
With the run's rows on a device mesh, a computation runs on each device's
block of rows (:func:`full_data` for every row, :func:`minibatch` for a
minibatch's), its exact sums added over the devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.rounding import dw_sum
from numpyro_dp.primitives.sharding import over_row_shards, row_axis, rows_sharded

#: Most rows per block of the general route: bounds the per-row gradients and
#: the backward pass's intermediates held at once, whatever n.  Blocks are
#: made equal (:func:`map_blocks`): ``lax.map`` costs per iteration, and a
#: remainder block is a second program.  Against blocks of 65536 rows and a
#: remainder, a DPHMC iteration of the Student-t model went from 2.6x to 1.5x
#: NumPyro HMC at n = 1e5 (one block) and from 2.9x to 2.2x at 1e6 (eight);
#: the hierarchical one from 2.2x to 1.7x at 1e6 (``benchmarks/bench_hmc.py``).
ROW_BLOCK = 131072


def map_blocks(fn: Callable, arrays: list, block: int) -> list:
    """``fn`` over the rows of ``arrays`` in ``k = ceil(n / block)`` equal blocks.

    Returns ``fn``'s outputs with a leading block axis: one entry for the ``k``
    blocks (a ``lax.map``; a direct call when ``k = 1``), and one for the
    fewer than ``k`` rows left over, if any (their own call).  Equal blocks
    keep ``lax.map``'s iterations few and the program to two copies of ``fn``.
    """
    n = arrays[0].shape[0]
    k = max(1, -(-n // block))
    size = n // k
    if k == 1:
        return [jax.tree.map(lambda x: x[None], fn(arrays))]
    full = k * size
    parts = [lax.map(fn, [x[:full].reshape((k, size) + x.shape[1:]) for x in arrays])]
    if full < n:
        parts.append(jax.tree.map(lambda x: x[None], fn([x[full:] for x in arrays])))
    return parts


def summed_blocks(fn: Callable, arrays: list, block: int) -> tuple:
    """Block sums added up: ``fn`` returns a tuple of double-word pairs ``(hi, lo)``
    of its block; each pair's blocks are added exactly (:func:`dw_sum`)."""
    parts = map_blocks(fn, arrays, block)
    return tuple(
        dw_sum(jnp.concatenate([x for p in parts for x in p[j]])) for j in range(len(parts[0]))
    )


def map_rows(fn: Callable, rows: list, block: int) -> jax.Array:
    """``fn`` (one value per row) over the rows in blocks of at most ``block`` rows."""
    return jnp.concatenate([out.reshape(-1) for out in map_blocks(fn, rows, block)])


def full_data(pm: PrivateModel, fn: Callable, model_args: tuple, model_kwargs: dict,
              out_rows: bool = False):
    """``fn(model_args, model_kwargs, row_mask)`` on every row, where the rows live.

    ``row_mask`` marks the real rows of padded arrays (None: all are real).  On
    one device this is the call itself; with the run's rows on a mesh, ``fn``
    runs on each device's block (:func:`~numpyro_dp.primitives.sharding.over_row_shards`),
    its exact sums added over the devices.
    """
    mask = pm.row_mask()
    if not rows_sharded():
        return fn(model_args, model_kwargs, mask)
    rows = pm.private_inputs(model_args, model_kwargs)

    def block(parts):
        if mask is None:
            return fn(*pm.rebuild(parts), None)
        return fn(*pm.rebuild(parts[:-1]), parts[-1])

    return over_row_shards(block, rows if mask is None else (*rows, mask), out_rows)


def minibatch(pm: PrivateModel, fn: Callable, model_args: tuple, model_kwargs: dict,
              idx: jax.Array, mask: jax.Array | None = None):
    """``fn(model_args, model_kwargs, positions, weights)`` on the rows ``idx``, where they live.

    ``fn`` evaluates the rows at ``positions`` of the arrays it is given, each
    counted with its weight (None: all count), and returns exact sums over them
    (:func:`~numpyro_dp.primitives.rounding.exact_sum`) in which a row of weight
    0 is zeros.  On one device that is the arrays as given at
    ``pm.positions(idx)``, weighted by ``mask``.  With the run's rows on a mesh,
    ``fn`` runs on each device's block
    (:func:`~numpyro_dp.primitives.sharding.over_row_shards`) and gathers the
    batch's rows from that block alone: a row that another device holds gets
    weight 0 (at a position clamped into the block), so every row counts on
    the one device that holds it.  The exact sums' integer totals are then
    added over the devices (d numbers a sum, whatever the batch size, instead
    of the ``b`` rows) and equal one device's bit for bit.  Every device does
    the batch's work once (O(b), not O(b / D)).  The indices are public
    (drawn from the key and the public n, b, q), the same on every device.
    """
    positions = pm.positions(idx)
    if not rows_sharded():
        return fn(model_args, model_kwargs, positions, mask)

    def block(parts):  # this device's block of rows: positions [k size, (k + 1) size)
        size = parts[0].shape[0]
        local = positions - lax.axis_index(row_axis()) * size
        held = (local >= 0) & (local < size)
        weights = held if mask is None else held.astype(mask.dtype) * mask
        return fn(*pm.rebuild(parts), jnp.clip(local, 0, size - 1), weights)

    return over_row_shards(block, pm.private_inputs(model_args, model_kwargs))
