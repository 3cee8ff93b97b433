"""A model's arguments as the compiled sampler takes them, and back.

The private inputs of a run are the model's row arrays (every array argument
whose leading dimension is the data plate's size), or with privacy units
(:class:`~numpyro_dp.model.units.Units`) the unit blocks and their mask;
:meth:`ModelInputs.private_inputs` makes them from the call's arguments and
:meth:`ModelInputs.rebuild` makes the model's arguments from them (possibly
traced), with the public arguments as given.  The mask travels in the rebuilt
keyword arguments under :data:`UNIT_MASK`, which the adapter strips before the
model runs: the model sees rows, never unit blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dp.model.layout import RowLayout
from numpyro_dp.model.tracing import replace_leaves
from numpyro_dp.model.units import bound_and_label

#: The keyword under which :meth:`ModelInputs.rebuild` carries the units' mask
#: (never passed to the model).
UNIT_MASK = "__numpyro_dp_unit_mask__"


def unit_sum(row_fn: Callable) -> Callable:
    """``fn(theta, unit)``: the sum of ``row_fn(theta, row)`` over a unit block's real
    rows (each row run alone; the padding's terms are exactly 0, by ``where``)."""
    def unit_fn(theta, unit):
        *block, mask = unit
        values = jax.vmap(lambda row: row_fn(theta, row))(block)
        return jnp.sum(jnp.where(mask, values, 0.0))

    return unit_fn


class ModelInputs:
    """The mapping between a model's arguments and a run's private inputs (a base of
    :class:`~numpyro_dp.model.adapter.PrivateModel`, which sets the attributes it
    reads: ``units``, ``layout``, ``row_specs``, ``padded_rows`` and the row leaves'
    places among the public arguments)."""

    def with_layout(self, row_layout: RowLayout) -> ModelInputs:
        """This model with its unit blocks padded and placed as ``row_layout`` says (units
        are placed after the model is analysed: ``ndp.shard_rows`` of
        :meth:`private_inputs`)."""
        if self.units is None or row_layout.num_rows != self.units.num_units:
            raise ValueError("with_layout places unit blocks: give a layout of the units")
        self.layout = row_layout
        self.padded_rows = row_layout.padded_rows
        self.row_specs = [jax.ShapeDtypeStruct((row_layout.padded_rows,) + s.shape[1:],
                                               s.dtype) for s in self.row_specs]
        return self

    # ------------------------------------------------------------- inputs
    def row_mask(self) -> jax.Array | None:
        """``True`` on the real rows of padded arrays (None when nothing is padded)."""
        return None if self.layout is None else self.layout.mask()

    def positions(self, idx: jax.Array) -> jax.Array:
        """Where rows ``idx`` of ``[0, num_rows)`` lie in the (possibly padded) arrays."""
        return idx if self.layout is None else self.layout.positions(idx)

    def private_inputs(self, model_args: tuple, model_kwargs: dict) -> tuple:
        """The row arrays of ``(model_args, model_kwargs)``: what a compiled sampler takes.

        With units: the unit blocks and their mask, from the call's arguments (the
        rows as the user gave them) or from arguments :meth:`rebuild` made.
        """
        if self.units is not None and UNIT_MASK not in model_kwargs:
            leaves = jax.tree_util.tree_leaves((model_args, model_kwargs))
            rows = self.units.block([leaves[i] for i in self._row_leaf_index])
            return tuple(jnp.asarray(x) for x in rows) + (jnp.asarray(self.units.mask()),)
        leaves, _, mask = self._leaves(model_args, model_kwargs)
        rows = tuple(jnp.asarray(leaves[i]) for i in self._row_leaf_index)
        return rows if mask is None else rows + (jnp.asarray(mask),)

    def rebuild(self, rows) -> tuple[tuple, dict]:
        """``(model_args, model_kwargs)`` from :meth:`private_inputs` (possibly traced)
        and the public arguments given at construction."""
        if self.units is None:
            return self._with_rows(self._public_leaves, self._treedef, rows)
        args, kwargs = self._with_rows(self._public_leaves, self._treedef, rows[:-1])
        return args, {**kwargs, UNIT_MASK: rows[-1]}

    def _leaves(self, model_args: tuple, model_kwargs: dict):
        """``(leaves, treedef, unit mask or None)`` of the model's arguments."""
        mask = model_kwargs.get(UNIT_MASK)
        if mask is not None:
            model_kwargs = {k: v for k, v in model_kwargs.items() if k != UNIT_MASK}
        leaves, treedef = jax.tree_util.tree_flatten((model_args, model_kwargs))
        return leaves, treedef, mask

    def stand_in_arguments(self, num_rows: int = 1) -> tuple[tuple, dict]:
        """The public arguments with ``num_rows`` zero rows in place of each row array
        (as the model takes them: rows, never unit blocks)."""
        rows = [np.zeros((num_rows,) + tuple(s.shape[1:]), s.dtype)
                for s in self._model_row_specs]
        return self._with_rows(self._public_leaves, self._treedef, rows)

    def _model_arguments(self, model_args: tuple, model_kwargs: dict) -> tuple[tuple, dict]:
        """Arguments to run the whole model on for its data-free parts (the prior, the
        deterministic sites): the rows as given, or with units zero stand-ins of the
        rows' shapes (the model never sees unit blocks; n stays the rows' number)."""
        if self.units is None:
            return model_args, model_kwargs
        leaves, treedef, _ = self._leaves(model_args, model_kwargs)
        zeros = [jnp.zeros(s.shape, s.dtype) for s in self._model_row_specs]
        return self._with_rows(leaves, treedef, zeros)

    @property
    def privacy_unit(self) -> str:
        """What a release from these inputs protects: ``"row"``, or the units' label."""
        return bound_and_label(self.units)[1]

    def _with_rows(self, leaves, treedef, row_leaves):
        return replace_leaves(leaves, treedef, self._row_leaf_index, row_leaves)
