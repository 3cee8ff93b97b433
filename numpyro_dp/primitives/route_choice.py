"""Which gradient route computes a model's clipped gradient sum, and the plan it follows.

The routes are those of :mod:`~numpyro_dp.primitives.gradients`: ``"jacobian"``
(general) and ``"linear_predictor"`` (per-row chain rule through a narrow cut).
:func:`plan_route` analyses one row's program
(:mod:`~numpyro_dp.primitives.row_program`, with the indexed blocks of
:mod:`~numpyro_dp.primitives.indexed_blocks`) and returns the route's
:class:`Plan`; :func:`select_route` says which route it takes and why.

Route selection (``"auto"``): the per-row program is traced with abstract
rows (shapes and dtypes only; the public non-row arguments as given).  Two
cuts are tried: the *linear* cut (the ``"linear_predictor"`` route's in
:mod:`~numpyro_dp.primitives.gradients`) and the *parameter* cut (``psi``
only: every data-free value that meets the data); a cut qualifies when
``m <= max(1, d // 2)`` and ``m + q <= d``.  ``"auto"`` takes the
linear-predictor route only for the single contraction (a linear cut with
``m = 1`` and shared values on coordinates of their own: a GLM, a
regression with a learned scale or degrees of freedom, random intercepts
or slopes entering the linear predictor).  Every other cut forms each
row's Jacobian of the cut *and* its gradient, and was
slower than the general route on every model class measured
(``benchmarks/bench_hmc.py``).  A forced ``route="linear_predictor"`` takes
the narrowest qualifying cut, and raises a ``ValueError`` that says why on a
model without one.  The choice depends on the model's program and the
shapes of the data, never on the data's values, so the choice itself
reveals nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.indexed_blocks import Indexed, find_indexed_blocks
from numpyro_dp.primitives.row_program import (
    Analysis,
    Cut,
    Graph,
    NotQualified,
    blocks_of_theta,
    live_consumers,
    reached,
)

ROUTES = ("auto", "jacobian", "linear_predictor")


class RouteChoice(NamedTuple):
    """The route :func:`select_route` takes and why (all structural, public)."""

    route: str  # "jacobian" or "linear_predictor"
    reason: str
    cut: str | None = None  # "linear" or "parameter" for the linear_predictor route
    row_width: int | None = None  # m: cut values per row
    shared_width: int | None = None  # q: cut values shared by all rows
    indexed: int = 0  # coordinates in blocks each row reads at one entry (jacobian route)


class Plan(NamedTuple):
    """What :func:`plan_route` found: the route taken, and what its sum evaluates."""

    choice: RouteChoice
    graph: Graph | None = None
    cut: Cut | None = None
    order_row: list | None = None
    order_shared: list | None = None
    order_f: list | None = None
    indexed: Indexed | None = None  # the general route's indexed blocks
    span: Indexed | None = None  # the contraction's row value and where it has a gradient
    shared_coords: tuple | None = None  # theta coordinates of the shared values (disjoint)


def _shared_coordinates(g: Graph, an, cut: Cut) -> tuple | None:
    """Coordinates of theta that reach the cut's shared values, if no row value.

    ``grad l_i = A_i^T u_i + C^T v_i``: when no coordinate of theta reaches both
    a row value and a shared value, ``A_i`` is zero on these coordinates and
    ``C`` zero off them (structurally: JAX's derivative of a value a
    coordinate does not reach is an exact zero), so the two parts of a row's
    gradient lie on disjoint coordinates and its squared norm is the sum of
    theirs.  None when theta is not split into pieces or a piece reaches both.
    """
    pieces = blocks_of_theta(g, live_consumers(g, an))
    if pieces is None:
        return None
    row, shared, coords = set(cut.row), set(cut.shared), []
    for node, start, size in pieces:
        seen = reached(g, an, node)
        if seen & shared:
            if seen & row:
                return None
            coords.extend(range(start, start + size))
    return tuple(coords)


def _admissible(c: Cut, d: int) -> bool:
    return c.m <= max(1, d // 2) and c.m + c.q <= d


def _jacobian_plan(reason: str, indexed: Indexed | None = None) -> Plan:
    if indexed is None:
        return Plan(RouteChoice("jacobian", reason))
    size = sum(b.size for b in indexed.blocks)
    return Plan(RouteChoice(
        "jacobian",
        f"{reason}; {size} coordinate(s) in {len(indexed.blocks)} block(s) of which each "
        f"row reads a few entries, so each row's gradient has {indexed.width} numbers "
        f"of d = {indexed.d}",
        indexed=size,
    ), indexed=indexed)


def plan_route(pm: PrivateModel, theta_shape, theta_dtype, model_args, model_kwargs,
          route: str = "auto") -> Plan:
    """Analyse one row's program (abstract rows: no data value is read) and pick a route.

    Cost model of ``"auto"`` (per row, in numbers written and summed): the
    single-contraction linear-predictor path forms the gradient of the row
    value on the coordinates that reach it, with indexed blocks reduced to
    the entries the row reads, plus ``q`` shared values on their own
    coordinates: at most ``w``; the general route a backward pass and the
    gradient's ``w`` numbers (``w = d`` less what indexed blocks save), about
    ``2 w``.  Every other linear-predictor path forms the ``n x d`` rows *and*
    Jacobians of its cut, more than the general route: measured slower on
    every model class of ``benchmarks/bench_hmc.py``, so ``"auto"`` never
    takes it.
    """
    one_row, rows = pm.one_row_loglik(model_args, model_kwargs)

    d = int(np.prod(theta_shape, dtype=np.int64))
    row_avals = [
        jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in rows
    ]
    try:
        closed = jax.make_jaxpr(one_row)(
            jax.ShapeDtypeStruct(tuple(theta_shape), theta_dtype), row_avals
        )
        g = Graph(closed, len(rows))
        an = Analysis(g)
    except Exception as err:  # noqa: BLE001 - any failure means: use the general route
        return Plan(RouteChoice(
            "jacobian",
            f"one row's log-likelihood could not be analysed on abstract rows "
            f"({type(err).__name__})",
        ))
    try:
        blocks = find_indexed_blocks(g, an)
        indexed = Indexed(g, an, blocks, d, g.out) if blocks else None
    except NotQualified:
        indexed = None
    if route == "jacobian":
        return _jacobian_plan("forced", indexed)
    cuts = [an.cut("linear"), an.cut("parameter")]
    good = [c for c in cuts if _admissible(c, d)]
    if not good:
        widths = "; ".join(f"{c.kind} cut: m={c.m}, q={c.q}" for c in cuts)
        return _jacobian_plan(
            f"theta reaches each row's log-likelihood only through wide cuts ({widths}; "
            f"m values per row, q shared values), but the linear-predictor route needs "
            f"m <= {max(1, d // 2)} and m + q <= d = {d}", indexed,
        )
    cut = min(good, key=lambda c: (2 * c.m + c.q, c.m))
    shared_coords = (
        _shared_coordinates(g, an, cut) if (cut.kind, cut.m) == ("linear", 1) and cut.q else None
    )
    contraction = (cut.kind, cut.m) == ("linear", 1) and (not cut.q or shared_coords is not None)
    if route == "auto" and not contraction:
        why = (" (a coordinate of theta reaches both the row value and a shared value)"
               if (cut.kind, cut.m) == ("linear", 1) else "")
        return _jacobian_plan(
            f"the narrowest cut ({cut.kind}, m={cut.m}, q={cut.q}) needs each row's "
            f"Jacobian of the cut as well as its gradient{why}: the general route is cheaper",
            indexed,
        )
    try:
        order_row = g.schedule(cut.row, [g.theta, *g.rows])
        order_shared = g.schedule(cut.shared + cut.aux, [g.theta])
        order_f = g.schedule([g.out], [*cut.row, *cut.shared, *cut.aux, *g.rows])
        # the contraction's row value, from the numbers each row reads of the blocks
        span = Indexed(g, an, [] if indexed is None else indexed.blocks, d,
                        cut.row[0]) if contraction else None
    except NotQualified as err:
        return _jacobian_plan(str(err), indexed)
    reason = (f"{cut.kind} cut with m={cut.m} value(s) per row and q={cut.q} shared "
              f"value(s) (d={d})")
    size = 0 if span is None else sum(b.size for b in span.blocks)
    if size:
        reason += (f"; {size} coordinate(s) in {len(span.blocks)} block(s) of which each row "
                   f"reads a few entries, so each row's predictor has a gradient of "
                   f"{span.width} numbers")
    choice = RouteChoice("linear_predictor", reason, cut.kind, cut.m, cut.q, indexed=size)
    return Plan(choice, g, cut, order_row, order_shared, order_f, indexed, span,
                 shared_coords)


def select_route(
    pm: PrivateModel, model_args: tuple = (), model_kwargs: dict | None = None,
    route: str = "auto",
) -> RouteChoice:
    """The route ``clipped_grad_sum_fn(pm, route)`` takes for arguments shaped like these.

    Only the shapes and dtypes of the rows (and the public non-row arguments)
    are used.  Raises ``ValueError`` for ``route="linear_predictor"`` on a
    model that does not qualify.
    """
    if route not in ROUTES:
        raise ValueError(f"grad_route={route!r}; use one of {ROUTES}.")
    model_kwargs = {} if model_kwargs is None else model_kwargs
    plan = plan_route(pm, (pm.num_params,), jnp.result_type(float), model_args, model_kwargs, route)
    check_forced_route(plan, route)
    return plan.choice


def check_forced_route(plan: Plan, route: str) -> None:
    if route == "linear_predictor" and plan.choice.route != "linear_predictor":
        raise ValueError(
            "grad_route='linear_predictor' does not apply to this model: "
            f"{plan.choice.reason}. Use grad_route='auto' or 'jacobian'."
        )
