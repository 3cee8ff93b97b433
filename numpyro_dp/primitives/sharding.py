"""Rows on a device mesh: placement, padding that counts for nothing, per-shard sums.

A user whose rows outgrow one device places them on a mesh axis (``"data"``)
with :func:`shard_rows`.  Each device then holds one *block* of rows: the
real rows first, then zero rows that pad the block to the common block size
(``jax.device_put`` refuses rows that do not divide evenly).  The padding is
public (it depends on ``n`` and the device count only) and is described by a
:class:`RowLayout`, which the runner hands to the kernels
(``PrivateMCMC.run(..., row_layout=layout)``): padded rows contribute exactly
zero to every sum (a ``where``, so a pad row whose log-likelihood is not
finite changes nothing either) and ``n`` is the number of real rows wherever
it enters (the accountant, the minibatch laws, the rounding grids).

Every full-data sum over rows is computed where the rows live
(:func:`over_row_shards`): each device runs the per-row work on its own block
under ``jax.shard_map``, and the rounding's *integer* totals
(:mod:`numpyro_dp.primitives.rounding`) are added across devices with one
``psum`` per release, d numbers each, never the rows.  Integer sums are exact,
so a release is the same function of the data on 1 or 8 devices, and the noise
is added once, after the ``psum``, from the run secret: the same draw on every
device, whatever their number.  ``shard_map`` rather than XLA's automatic
partitioning because the latter gathers the rows wherever a program reshapes
them into blocks that straddle devices (the exact sums' stages of 32 rows, the
gradient routes' blocks of 131072, the warm start's of 4096).  Row-wise work
outside those sums (each row's log-likelihood, the mask) is left to the
automatic partitioning, which keeps it on the rows' devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from numpyro_dp.model.layout import RowLayout

#: Name of the mesh axis that rows are split over (jax_privacy's and the issue's).
DATA_AXIS = "data"


def _auto(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis in JAX's automatic mode.

    ``jax.make_mesh`` makes *explicit* axes, under which indexing a row array
    (a minibatch, the model run on one row) must state its output's sharding.
    The kernels' programs leave per-row work to the automatic partitioning and
    put the sums in ``shard_map`` themselves, on the same devices.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def automatic(tree):
    """``tree`` with arrays placed on an explicit mesh moved to its automatic twin
    (same devices and layout: no copy of the data)."""
    def move(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh is not _auto(sharding.mesh):
            return jax.device_put(x, NamedSharding(_auto(sharding.mesh), sharding.spec))
        return x

    return jax.tree.map(move, tree)


def _data_axis_size(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise ValueError(
            f"The mesh has no axis {axis!r} (its axes: {tuple(mesh.shape)}). Name the axis "
            f"that rows are split over {axis!r}, e.g. jax.make_mesh((8,), ({axis!r},)), or "
            "pass axis= to shard_rows."
        )
    return int(mesh.shape[axis])


def shard_rows(mesh: Mesh, *arrays, axis: str = DATA_AXIS):
    """Place row arrays on ``mesh``'s ``axis``, padding each device's block.

    Parameters
    ----------
    mesh : jax.sharding.Mesh
        A mesh with an axis named ``axis``; rows are split over it (and
        replicated over any other axis).
    *arrays : array_like
        The model's row arrays (covariates, outcomes, group indices, ...), all
        with the same number ``n`` of rows on their leading axis.
    axis : str
        The mesh axis for rows.

    Returns
    -------
    tuple
        ``(*placed, layout)``: each array padded with zero rows to
        ``layout.padded_rows`` rows and placed with
        ``NamedSharding(mesh, P(axis))``, and the :class:`RowLayout` to pass to
        ``PrivateMCMC.run(..., row_layout=layout)``.  The ``n`` real rows are
        split as evenly as the devices allow (block ``k`` gets ``n // D`` rows,
        one more for the first ``n % D``), each block followed by its padding.
        The padding is zeros, never copies of real rows, and the kernels give it
        weight 0 and leave it out of ``n``.

    Examples
    --------
    >>> mesh = jax.make_mesh((8,), ("data",))  # doctest: +SKIP
    >>> X_s, y_s, layout = ndp.shard_rows(mesh, X, y)  # doctest: +SKIP
    >>> mcmc.run(key, X_s, y_s, row_layout=layout)  # doctest: +SKIP
    """
    if not arrays:
        raise ValueError("shard_rows needs at least one row array.")
    arrays = [np.asarray(x) for x in arrays]
    lengths = {x.shape[0] if x.ndim else None for x in arrays}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(
            "Every array given to shard_rows must have the rows on its leading axis and the "
            f"same number of them; got leading sizes {sorted(map(str, lengths))}. Pass only "
            "the per-row arrays; public arguments (hyperparameters, a number of groups) stay "
            "as they are."
        )
    n = lengths.pop()
    devices = _data_axis_size(mesh, axis)
    if n < devices:
        raise ValueError(f"{n} rows cannot be split over {devices} devices: use fewer devices.")
    counts = tuple(n // devices + (k < n % devices) for k in range(devices))
    layout = RowLayout(counts, max(counts))
    sharding = NamedSharding(_auto(mesh), P(axis))
    starts = np.concatenate([[0], np.cumsum(counts)])
    placed = []
    for x in arrays:
        padded = np.zeros((layout.padded_rows,) + x.shape[1:], x.dtype)
        for k, c in enumerate(counts):
            padded[k * layout.block_size: k * layout.block_size + c] = x[starts[k]: starts[k + 1]]
        placed.append(jax.device_put(padded, sharding))
    if layout.is_padded:
        for x in placed:
            _PADDED[id(x)] = weakref.ref(x)
    return (*placed, layout)


#: Arrays that shard_rows padded (by id, while they live): a run on them without
#: their layout would count the padding as rows.
_PADDED: dict[int, weakref.ref] = {}


def check_layout_given(rows, row_layout: RowLayout | None) -> None:
    """Refuse padded arrays from :func:`shard_rows` passed without their layout."""
    if row_layout is not None:
        return
    for x in jax.tree.leaves(rows):
        ref = _PADDED.get(id(x))
        if ref is not None and ref() is x:
            raise ValueError(
                "These row arrays were padded by ndp.shard_rows, and without their layout "
                "the padding would count as rows of data. Pass the layout it returned: "
                "`X_s, y_s, layout = ndp.shard_rows(mesh, X, y)`, then "
                "`mcmc.run(key, X_s, y_s, row_layout=layout)`."
            )


# ------------------------------------------------------- sums where rows live
#: (mesh, axis) of the run being traced: set by the runner, read by over_row_shards.
_MESH: contextvars.ContextVar[tuple[Mesh, str] | None] = contextvars.ContextVar(
    "numpyro_dp_row_mesh", default=None)
#: The mesh axis inside a per-shard body: the rounding adds its integers over it.
_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "numpyro_dp_row_axis", default=None)


def rows_mesh(rows) -> tuple[Mesh, str] | None:
    """``(mesh, axis)`` if the row arrays are split by rows over one mesh axis."""
    found = set()
    for x in jax.tree.leaves(rows):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or not sharding.spec:
            continue
        lead = sharding.spec[0]
        if isinstance(lead, str) and sharding.mesh.shape[lead] > 1:
            found.add((sharding.mesh, lead))
    if len(found) > 1:
        raise ValueError(
            "The row arrays are split over different meshes or axes; place them all with "
            "ndp.shard_rows(mesh, *arrays) (one mesh, one axis)."
        )
    return found.pop() if found else None


@contextlib.contextmanager
def rows_on(mesh_axis: tuple[Mesh, str] | None) -> Iterator[None]:
    """Trace the programs of this block with full-data sums per shard of ``mesh_axis``."""
    token = _MESH.set(mesh_axis)
    try:
        yield
    finally:
        _MESH.reset(token)


def rows_sharded() -> bool:
    """Whether the program being traced has its rows on a mesh (and is not per shard yet)."""
    return _MESH.get() is not None and _AXIS.get() is None


def row_axis() -> str | None:
    """The mesh axis the current per-shard body's rows are split over (None: one device)."""
    return _AXIS.get()


def row_axis_size() -> int:
    """How many blocks the rows are split into (1 outside a per-shard body)."""
    axis = _AXIS.get()
    return 1 if axis is None else jax.lax.axis_size(axis)


def over_row_shards(fn: Callable, rows: tuple, out_rows: bool = False):
    """``fn(rows)``, run on each device's block of ``rows`` when the run's rows are sharded.

    ``rows`` is a tuple of arrays of ``padded_rows`` rows (the model's row
    arrays, a mask).  Without a mesh (or outside a run) this is ``fn(rows)``.
    On a mesh, ``fn`` sees one block and every exact sum inside it adds its
    integers over the devices (:func:`row_axis`), so its results are the
    global ones: ``out_rows=False`` returns them once (every device computes
    the same values from the summed integers); ``out_rows=True`` returns
    per-row outputs, left split by rows.  Anything ``fn`` closes over is
    replicated.
    """
    if not rows_sharded():
        return fn(rows)
    mesh, axis = _MESH.get()

    def body(block):
        token = _AXIS.set(axis)
        try:
            return fn(block)
        finally:
            _AXIS.reset(token)

    # check_vma=False: with JAX's replication checks, the gradient of a row's
    # log-likelihood with respect to a replicated theta (closed over) would be
    # summed over the devices (the transpose of broadcasting theta to them),
    # adding row i of one device's block to row i of every other's.  Here every
    # value is per-row, local, until the rounding's explicit psum.
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis),),
                         out_specs=P(axis) if out_rows else P(), check_vma=False)(tuple(rows))
