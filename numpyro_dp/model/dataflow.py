"""Structural data-dependence checks on traced JAX programs.

The model adapter uses these to prove, before any private value is computed,
that the prior, the parameter transforms and the returned deterministic sites
do not read the private rows.  The check looks only at the program (which
values flow into which), never at the values themselves, so it reveals
nothing about the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def depends_on_private(
    fn: Callable[[Any, Any], Any], public: Any, private: Any
) -> Any:
    """Which outputs of ``fn(public, private)`` can depend on ``private``.

    Parameters
    ----------
    fn : callable
        A JAX-traceable function of two pytrees.
    public, private : pytree
        Example inputs (only their shapes and dtypes are used).

    Returns
    -------
    pytree of bool
        Same structure as ``fn``'s output; ``True`` where the output leaf is
        reachable from a leaf of ``private`` in the traced program.  The
        analysis is conservative: an equation with any private input marks all
        of its outputs as private (so nested calls never hide a dependence).
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(public, private)
    jaxpr = closed.jaxpr
    n_public = len(jax.tree_util.tree_leaves(public))
    tainted = {id(v) for v in jaxpr.invars[n_public:]}
    for eqn in jaxpr.eqns:
        if any(id(v) in tainted for v in eqn.invars if hasattr(v, "aval")):
            tainted.update(id(v) for v in eqn.outvars)
    flags = [id(v) in tainted for v in jaxpr.outvars]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flags)


def inputs_read(fn: Callable[[Any], Any], inputs: Any) -> Any:
    """Which leaves of ``inputs`` some output of ``fn(inputs)`` can depend on.

    One trace for every leaf: :func:`depends_on_private` with each leaf in turn as
    the private one, by the same conservative rule (an equation passes every input's
    labels to all its outputs), without tracing the program once per leaf.

    Returns
    -------
    pytree of bool
        Same structure as ``inputs``.
    """
    closed = jax.make_jaxpr(fn)(inputs)
    jaxpr = closed.jaxpr
    labels = {id(v): 1 << i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        mask = 0
        for v in eqn.invars:
            if hasattr(v, "aval"):
                mask |= labels.get(id(v), 0)
        if mask:
            labels.update((id(v), labels.get(id(v), 0) | mask) for v in eqn.outvars)
    read = 0
    for v in jaxpr.outvars:
        read |= labels.get(id(v), 0)
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    return jax.tree_util.tree_unflatten(
        treedef, [bool(read >> i & 1) for i in range(len(leaves))])


def captured_shapes(fn: Callable, *example_args: Any) -> list[tuple[int, ...]]:
    """Shapes of the arrays that ``fn`` reads without receiving them as arguments.

    Arrays a traced program closes over (a global, a closure, a Python list
    turned into an array inside ``fn``) become constants of its jaxpr; nested
    calls carry constants of their own, and large literals count too.  Only the
    shapes are returned, never the values.
    """
    closed = jax.make_jaxpr(fn)(*example_args)
    shapes: list[tuple[int, ...]] = [tuple(getattr(c, "shape", ())) for c in closed.consts]

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if hasattr(v, "val") and hasattr(v.val, "shape"):
                    shapes.append(tuple(v.val.shape))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "consts") and hasattr(sub, "jaxpr"):  # ClosedJaxpr
                        shapes.extend(tuple(getattr(c, "shape", ())) for c in sub.consts)
                        walk(sub.jaxpr)
                    elif hasattr(sub, "eqns"):  # Jaxpr
                        walk(sub)

    walk(closed.jaxpr)
    return shapes
