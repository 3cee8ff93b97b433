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
device, whatever their number.  A minibatch's sums likewise
(:func:`~numpyro_dp.primitives.row_blocks.minibatch`): every device draws the
same (public) row indices, takes those in its own block and sums them, so the
``psum`` carries d numbers whatever the batch size, never the batch's rows.
``shard_map`` rather than XLA's automatic partitioning because the latter
gathers the rows wherever a program reshapes them into blocks that straddle
devices (the exact sums' stages of 32 rows, the gradient routes' blocks of
131072, the warm start's of 4096) or indexes a minibatch out of them.  Row-wise
work outside those sums (each row's log-likelihood, the mask) is left to the
automatic partitioning, which keeps it on the rows' devices.

Chains split over a second mesh axis (``"chain"``) are a batch whose state is
constrained to lie split over it (:func:`chains_split`); the per-shard sums
leave that axis to the automatic partitioning, so each device works on its own
chains and its own block of rows, and the ``psum`` runs over ``"data"`` only.
(A ``shard_map`` over the chains, with the row sums' ``shard_map`` nested in
it, cannot close over the chains' values in JAX 0.10; ``vmap``'s
``spmd_axis_name`` fails likewise.)  With several processes each process
places its own rows on its own devices (:func:`shard_rows`); the programs are
the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from numpyro_dp.model.layout import RowLayout

#: Name of the mesh axis that rows are split over (jax_privacy's).
DATA_AXIS = "data"
#: Name of the mesh axis that chains are split over.
CHAIN_AXIS = "chain"


def automatic_mesh(mesh: Mesh) -> Mesh:
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
        if isinstance(sharding, NamedSharding):
            mesh = automatic_mesh(sharding.mesh)
            if mesh is not sharding.mesh:
                return jax.device_put(x, NamedSharding(mesh, sharding.spec))
        return x

    return jax.tree.map(move, tree)


def check_run_mesh(mesh) -> None:
    """Refuse a mesh that a run cannot use (the runner's ``mesh=``)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, e.g. jax.make_mesh((2, 4), "
            f"({CHAIN_AXIS!r}, {DATA_AXIS!r})); got {type(mesh).__name__}."
        )
    other = set(mesh.axis_names) - {CHAIN_AXIS, DATA_AXIS}
    if other:
        raise ValueError(
            f"The mesh has axes {sorted(other)} that a run does not use: name the axis "
            f"that chains are split over {CHAIN_AXIS!r} and the one that rows are split "
            f"over {DATA_AXIS!r}, e.g. jax.make_mesh((2, 4), ({CHAIN_AXIS!r}, {DATA_AXIS!r}))."
        )


def _data_axis_size(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise ValueError(
            f"The mesh has no axis {axis!r} (its axes: {tuple(mesh.shape)}). Name the axis "
            f"that rows are split over {axis!r}, e.g. jax.make_mesh((8,), ({axis!r},)), or "
            "pass axis= to shard_rows."
        )
    return int(mesh.shape[axis])


def _block_owners(mesh: Mesh, axis: str) -> list[int]:
    """The process that holds each block of rows (position on ``axis``), checking
    that each block lies in one process and each process's blocks are adjacent."""
    size = _data_axis_size(mesh, axis)
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0).reshape(size, -1)
    owners = []
    for k in range(size):
        processes = {d.process_index for d in devices[k]}
        if len(processes) > 1:
            raise ValueError(
                f"Block {k} of the {axis!r} axis lies on devices of processes "
                f"{sorted(processes)}; each process must hold whole blocks of rows: put "
                f"the processes along {axis!r} (jax.make_mesh orders devices so)."
            )
        owners.append(processes.pop())
    if owners != sorted(owners):
        raise ValueError(
            f"The processes' blocks along {axis!r} are interleaved ({owners}); each "
            "process's devices must be adjacent on the axis (jax.make_mesh orders them so)."
        )
    return owners


def _rows_per_process(local_rows: int) -> list[int]:
    """Every process's number of rows (public, like n: only the counts are sent)."""
    if jax.process_count() == 1:
        return [local_rows]
    counts = multihost_utils.process_allgather(np.asarray([local_rows], np.int64))
    return [int(c) for c in np.ravel(counts)]


def shard_rows(mesh: Mesh, *arrays, axis: str = DATA_AXIS):
    """Place row arrays on ``mesh``'s ``axis``, padding each device's block.

    Parameters
    ----------
    mesh : jax.sharding.Mesh
        A mesh with an axis named ``axis``; rows are split over it (and
        replicated over any other axis).
    *arrays : array_like
        The model's row arrays (covariates, outcomes, group indices, ...), all
        with the same number of rows on their leading axis.  With several
        processes (``jax.distributed.initialize``) each process passes only its
        own rows, which go to its devices: ``n`` is the total over the
        processes (their row counts are exchanged, nothing else), and the rows
        are numbered process by process.
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
        one more for the first ``n % D``; with several processes, each
        process's rows over its own devices), each block followed by its
        padding.
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
    mesh = automatic_mesh(mesh)
    owners = _block_owners(mesh, axis)
    local = [k for k, p in enumerate(owners) if p == jax.process_index()]
    counts_of = _rows_per_process(lengths.pop())
    counts = [0] * len(owners)
    for p, n_p in enumerate(counts_of):  # each process's rows, split evenly over its blocks
        blocks = [k for k, q in enumerate(owners) if q == p]
        for j, k in enumerate(blocks):
            counts[k] = n_p // len(blocks) + (j < n_p % len(blocks))
    if min(counts) < 1:
        raise ValueError(
            f"{sum(counts_of)} rows cannot be split over {len(owners)} devices so that each "
            f"holds at least one (rows per process: {counts_of}); use fewer devices."
        )
    layout = RowLayout(tuple(counts), max(counts))
    # This process's blocks, laid out as the global layout lays them out.
    mine = RowLayout(tuple(counts[k] for k in local), layout.block_size)
    where = np.asarray(mine.positions(np.arange(mine.num_rows)))
    sharding = NamedSharding(mesh, P(axis))
    placed = []
    for x in arrays:
        padded = np.zeros((mine.padded_rows,) + x.shape[1:], x.dtype)
        padded[where] = x
        placed.append(jax.make_array_from_process_local_data(
            sharding, padded, (layout.padded_rows,) + x.shape[1:]))
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
class RunMesh(NamedTuple):
    """Where a run's work lies: the mesh, the axis its rows are split over and the
    axis its chains are split over (either may be None)."""

    mesh: Mesh
    rows: str | None = None
    chains: str | None = None


#: The mesh of the run being traced: set by the runner, read by over_row_shards
#: and the kernels' chain batching.
_MESH: contextvars.ContextVar[RunMesh | None] = contextvars.ContextVar(
    "numpyro_dp_run_mesh", default=None)
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
def mesh_on(run_mesh: RunMesh | None) -> Iterator[None]:
    """Trace the programs of this block with ``run_mesh``'s rows and chains split."""
    token = _MESH.set(run_mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def chains_split(tree):
    """``tree`` (a batch of chains on the leading axis) constrained to lie split over
    the run's chain axis; unchanged when the chains are not split.

    Constraints on the chains' state, not a ``shard_map`` over them: the per-shard
    sums over rows inside (:func:`over_row_shards`) leave the chain axis to the
    automatic partitioning, which keeps each device's chains on it.
    """
    run_mesh = _MESH.get()
    if run_mesh is None or run_mesh.chains is None:
        return tree
    sharding = NamedSharding(run_mesh.mesh, P(run_mesh.chains))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def rows_sharded() -> bool:
    """Whether the program being traced has its rows on a mesh (and is not per shard yet)."""
    run_mesh = _MESH.get()
    return run_mesh is not None and run_mesh.rows is not None and _AXIS.get() is None


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
    mesh, axis = _MESH.get()[:2]

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
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis),), axis_names={axis},
                         out_specs=P(axis) if out_rows else P(), check_vma=False)(tuple(rows))
