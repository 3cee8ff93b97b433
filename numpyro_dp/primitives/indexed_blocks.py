"""Blocks of theta of which each row reads only a few entries, and the rows'
gradients reduced to those entries.

A hierarchical model's group effects ``a[g_i]`` (or ``ab[g_i, 0]``,
``ab[g_i]``) are read by each row through gathers at indices free of theta:
row i's gradient is zero on the block but at the entries it reads.
:func:`find_indexed_blocks` finds such blocks in one row's program
(:mod:`~numpyro_dp.primitives.row_program`); :class:`Indexed` computes each
row's gradient of a value with every block reduced to the entries the row
reads, and assembles the sums per position into the full sum (the compressed
form of :mod:`~numpyro_dp.primitives.gradients`' routes).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_dp.primitives.row_program import (
    Eqn,
    Graph,
    aval_size,
    blocks_of_theta,
    live_consumers,
    reached,
)

# Shape-only operations between a block of theta and the table a row reads.
_RESHAPES = frozenset({"reshape", "squeeze", "expand_dims"})
# Gathers that clamp the start index into the table (XLA's CPU/GPU behaviour).
_CLAMPED = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


class _Read(NamedTuple):
    """One gather by which a row reads a slice of a block's table."""

    out: int  # node id of the gather's output (the slice's values)
    index: int  # node id of its start indices (a function of the row, never of theta)
    start_index_map: tuple  # table axis of each index component
    slice_sizes: tuple


class _Block(NamedTuple):
    """A block of theta of which each row reads only a few entries (gathers)."""

    start: int  # first coordinate of the block in theta
    table_shape: tuple  # the block as the model indexes it, e.g. (J,) or (J, k)
    reads: tuple  # _Read per gather of the table

    @property
    def size(self) -> int:
        return int(np.prod(self.table_shape, dtype=np.int64))

    @property
    def width(self) -> int:  # numbers of the block one row reads
        return sum(int(np.prod(r.slice_sizes, dtype=np.int64)) for r in self.reads)


def _read(g: Graph, an, e: Eqn, table: int) -> _Read | None:
    """``e`` as a _Read of ``table``: one slice at a clamped index free of theta, or None."""
    if e.eqn.primitive.name != "gather" or len(e.ins) != 2 or e.ins[0] != table:
        return None
    index = e.ins[1]
    if isinstance(index, tuple) or index in an.T:
        return None
    dn, params = e.eqn.params["dimension_numbers"], e.eqn.params
    index_shape = g.avals[index].shape
    sizes = tuple(int(x) for x in params["slice_sizes"])
    if (
        tuple(getattr(dn, "operand_batching_dims", ()))
        or params["mode"] not in _CLAMPED
        or not index_shape
        or int(np.prod(index_shape[:-1], dtype=np.int64)) != 1  # one slice per row
        or aval_size(g.avals[e.outs[0]]) != int(np.prod(sizes, dtype=np.int64))
    ):
        return None
    return _Read(e.outs[0], index, tuple(dn.start_index_map), sizes)


def find_indexed_blocks(g: Graph, an) -> list[_Block]:
    """Blocks of theta of which each row reads only a few entries.

    A hierarchical model's group effects ``a[g_i]`` (or ``ab[g_i, 0]``,
    ``ab[g_i]``): row i's gradient is zero on the block but at the entries it
    reads, so the route computes it there alone (and sums it per entry)
    instead of ``n x J`` zeros.
    """
    consumers = live_consumers(g, an)
    blocks = []
    for node, start, _ in blocks_of_theta(g, consumers) or ():
        table = node
        while len(consumers.get(table, ())) == 1:  # through reshapes to the table
            e = g.eqns[consumers[table][0]]
            if e.eqn.primitive.name not in _RESHAPES:
                break
            table = e.outs[0]
        reads = [_read(g, an, g.eqns[k], table) for k in consumers.get(table, ())]
        block = _Block(start, tuple(g.avals[table].shape), tuple(reads))
        if reads and table != g.out and None not in reads and 2 * block.width <= block.size:
            blocks.append(block)
    return blocks


def _positions(read: _Read, table_shape: tuple, index: jax.Array) -> jax.Array:
    """Flat positions in the table of the slice ``read`` takes at ``index`` (rows, width).

    The start is clamped into the table as XLA's gather clamps it.
    """
    n, ndim = index.shape[0], len(table_shape)
    start = [jnp.zeros(n, jnp.int32)] * ndim
    vec = index.reshape(n, -1).astype(jnp.int32)
    for k, axis in enumerate(read.start_index_map):
        start[axis] = jnp.clip(vec[:, k], 0, table_shape[axis] - read.slice_sizes[axis])
    offsets = np.indices(read.slice_sizes).reshape(ndim, -1)  # (ndim, width)
    strides = np.cumprod((1,) + tuple(table_shape[:0:-1]))[::-1]
    flat = sum(start[k][:, None] * int(strides[k]) for k in range(ndim))
    return flat + jnp.asarray((offsets * strides[:, None]).sum(0), jnp.int32)[None, :]


class Indexed:
    """A scalar of each row's program (``target``: its log-likelihood, or the linear
    predictor) with its gradient on the coordinates that reach it, and every
    indexed block reduced to the entries the row reads.

    ``row_gradients`` gives, per row, the gradient on the pieces of theta
    outside the blocks that reach ``target`` (``rest``) and, per block, on the
    numbers the row reads (``local``), with their positions in the block
    (``where``); a position read twice holds the sum and then zeros.  The
    row's full gradient is ``rest`` and ``local`` scattered to their places
    and zeros elsewhere (the row's program reads nothing else of a block, and
    JAX's derivative of a value a coordinate does not reach is an exact zero),
    so its norm is computed from the compressed form exactly, and every
    coordinate appears once, as in the dense row.
    """

    def __init__(self, g: Graph, an, blocks: list[_Block], d: int, target: int):
        self.g, self.blocks, self.d, self.target = g, blocks, d, target
        pieces = blocks_of_theta(g, live_consumers(g, an))
        starts = {b.start for b in blocks}
        if pieces is None:  # every coordinate outside the blocks
            taken = sorted((b.start, b.start + b.size) for b in blocks)
            edges = [0] + [x for ab in taken for x in ab] + [d]
            spans = zip(edges[::2], edges[1::2], strict=True)
        else:  # pieces outside the blocks that reach target (e.g. not a prior's mu, tau)
            spans = [(a, a + k) for node, a, k in pieces
                     if a not in starts and target in reached(g, an, node)]
        self.rest = sorted((a, b) for a, b in spans if b > a)
        self.reads = [r for b in blocks for r in b.reads]
        self.order_local = g.schedule(
            [r.out for r in self.reads] + [r.index for r in self.reads], [g.theta, *g.rows]
        )
        self.order = g.schedule([target], [g.theta, *g.rows, *(r.out for r in self.reads)])
        self.width = sum(b - a for a, b in self.rest) + sum(b.width for b in blocks)

    def _full(self, rest: jax.Array, theta: jax.Array) -> jax.Array:
        """theta with ``rest`` in its places (the other coordinates reach no one)."""
        pieces, at, end = [], 0, 0
        for a, b in self.rest:
            pieces += [theta[end:a], rest[at:at + b - a]]
            at, end = at + b - a, b
        return jnp.concatenate(pieces + [theta[end:]])

    def row_gradients(self, theta: jax.Array, rows: list):
        """``(value, rest, local, where)``: per row, ``target``'s value (n,) and its
        gradient, ``rest`` coordinate-major (see column_squared_norms), and per
        block ``local`` (n, numbers read) and ``where`` (their positions)."""
        g, reads = self.g, self.reads

        def local_values(t, row):  # the numbers each read takes, and its indices
            env = {g.theta: t, **dict(zip(g.rows, row, strict=True))}
            vals = g.evaluate(self.order_local, env, [r.out for r in reads]
                              + [r.index for r in reads])
            return [jnp.ravel(v) for v in vals[:len(reads)]], vals[len(reads):]

        def value(rest, local, row):
            env = {g.theta: self._full(rest, theta), **dict(zip(g.rows, row, strict=True))}
            for r, v in zip(reads, local, strict=True):
                env[r.out] = v.reshape(g.avals[r.out].shape)
            return jnp.reshape(g.evaluate(self.order, env, [self.target])[0], ())

        local, index = jax.vmap(local_values, (None, 0))(theta, rows)
        rest = jnp.concatenate([theta[a:b] for a, b in self.rest])
        # the rest coordinate-major, the few read numbers per row
        val, (grad_rest, grad_local) = jax.vmap(
            jax.value_and_grad(value, (0, 1)), (None, 0, 0), (0, (1, 0))
        )(rest, local, rows)
        values, where, at = [], [], 0
        for b in self.blocks:
            k = len(b.reads)
            pos = jnp.concatenate([_positions(r, b.table_shape, i)
                                   for r, i in zip(b.reads, index[at:at + k], strict=True)], 1)
            v = jnp.concatenate(grad_local[at:at + k], 1)
            at += k
            if pos.shape[1] > 1:  # a position read twice: its sum, once
                same = pos[:, :, None] == pos[:, None, :]
                first = ~jnp.any(jnp.tril(same, -1), axis=2)
                v = jnp.where(first, jnp.einsum("nij,nj->ni", same.astype(v.dtype), v), 0)
            values.append(v)
            where.append(pos)
        return val, grad_rest, values, where

    def assemble(self, dense, tables, shared=None):
        """The full ``(hi, lo)`` sum from the rest's sum, the blocks' per-position sums
        and, optionally, ``(coordinates, (hi, lo))`` on coordinates of neither."""
        parts, at = [], 0  # (first coordinate, (hi, lo)) of each part
        for a, b in self.rest:
            parts.append((a, tuple(x[at:at + b - a] for x in dense)))
            at += b - a
        parts += [(x.start, t) for x, t in zip(self.blocks, tables, strict=True)]
        if shared is not None:
            parts += [(int(c), tuple(x[k:k + 1] for x in shared[1]))
                      for k, c in enumerate(shared[0])]
        out, end = ([], []), 0
        for a, part in sorted(parts, key=lambda p: p[0]):
            for k in range(2):  # zeros for the coordinates no part has
                out[k].extend([jnp.zeros(a - end, dense[k].dtype), part[k]])
            end = a + part[0].shape[0]
        return tuple(jnp.concatenate(x + [jnp.zeros(self.d - end, x[0].dtype)]) for x in out)
