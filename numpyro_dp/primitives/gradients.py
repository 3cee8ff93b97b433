"""Sums of per-row clipped log-likelihood gradients.

Gradient-based kernels release ``sum_i clip_c(grad l_i(theta)) + noise``.  The
sum of clipped rows is the only data-dependent quantity of such a release and
has l2-sensitivity ``2 c`` (substitute) or ``c`` (add/remove) *because every
row is clipped on its own*: clipping the summed gradient would not bound a
row's influence.

This module builds, once per model, a function
``clipped_sum(theta, clip, model_args, model_kwargs) -> (hi, lo)`` by one of two
exact routes.  The clipped rows are summed by
:func:`numpyro_dp.primitives.rounding.exact_sum` (each rounded to a fine grid, then added
without rounding) instead of in floating point, whose error grows like ``n u``
of the sum's size; the pair ``(hi, lo)`` goes to
:func:`numpyro_dp.kernels.base.release_clipped_sum`, which charges the grid.

``"jacobian"`` (general)
    The rows of the per-row Jacobian ``J`` (rows x d), i.e. every row's
    gradient, by one backward pass per row (``vmap(grad)`` of one row's
    log-likelihood), in blocks of :data:`ROW_BLOCK` rows; each block's rows
    are clipped and summed as ``J_B^T w_B``.  Works for every model the
    adapter accepts; costs about three passes through the likelihood
    whatever ``d`` (forward mode would cost ``d``), and holds one block's
    gradients and intermediates at a time, not ``n x d``.

``"linear_predictor"`` (per-row chain rule through a narrow cut)
    The program of one row's log-likelihood ``l(theta, x)`` (traced once on
    *abstract* rows, so no data value is seen) is split at a set of
    intermediate values, the *cut*, that every path from ``theta`` to ``l``
    crosses:

    * row values ``phi(theta, x)`` (``m`` numbers per row): everything computed
      from ``theta`` and the row by operations linear in their
      ``theta``-dependent operand (``X @ w + b``, ``y - loc``, a row's
      covariates times a data-free vector, ...) -- typically the linear
      predictors of the observed sites;
    * shared values ``psi(theta)`` (``q`` numbers, the same for every row):
      data-free functions of ``theta`` (a scale ``exp(u)``, the banana's
      ``g^{-1}(theta)``, ...).

    With ``l_i = F(phi_i, psi, x_i)`` the chain rule gives every row's
    gradient exactly::

        grad l_i = A_i^T u_i + C^T v_i,
        A_i = d phi_i / d theta (m x d),  C = d psi / d theta (q x d),
        (u_i, v_i) = gradient of F with respect to (phi_i, psi) at row i,

    where ``A_i`` and ``C`` are the Jacobians *at the current theta* (reverse
    mode, ``m`` passes per row; for an affine ``phi`` the computation of
    ``A_i`` does not involve ``theta`` at all, so XLA hoists it out of the
    leapfrog loop) and ``(u_i, v_i)`` come from one batched backward pass
    (rows of a vmapped program are independent).  When the cut is a single
    row scalar (``m = 1, q = 0``: logistic, Poisson or probit GLMs, a factor
    of a linear predictor) the norms are ``|u_i| ||A_i||`` and the clipped sum
    is one contraction ``sum_i w_i u_i A_i``, about the cost of an ordinary
    gradient; otherwise the ``n x d`` rows ``A_i^T u_i + C^T v_i`` are formed,
    clipped and summed.  Either way the norm of exactly the vector that is
    summed is clipped, so the sensitivity bound holds as for ``"jacobian"``.

    Exactness does not rest on any structural conclusion: the decomposition
    is the chain rule through values the program actually computes, the cut
    is verified to separate ``theta`` from the output (the evaluator of ``F``
    is given no ``theta``), ``psi`` is evaluated without any row, and the
    rows stay separate because one row's program is vmapped.  Structure only
    decides whether the route is worthwhile.

Route selection (``"auto"``): the per-row program is traced with abstract
rows (shapes and dtypes only; the public non-row arguments as given), and two
cuts are tried: the *linear* cut above and the *parameter* cut (``psi`` only:
every data-free value that meets the data).  A cut qualifies when
``m <= max(1, d // 2)`` and ``m + q <= d``; the qualifying cut with the
smallest ``2 m + q`` is used, else the ``"jacobian"`` route.  The choice
depends on the model's program and the shapes of the data, never on the data's
values, so the choice itself reveals nothing.  Forcing
``route="linear_predictor"`` on a model without a qualifying cut raises a
``ValueError`` that says why.

Non-finite per-row gradients contribute 0 on every route (see
:func:`clip_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal
from jax.flatten_util import ravel_pytree

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.rounding import dw_sum, exact_sum, unit_roundoff

ROUTES = ("auto", "jacobian", "linear_predictor")


def clip_weights(norms: jax.Array, clip: jax.Array) -> jax.Array:
    """``min(1, clip / norm)`` per row; rows with a non-finite gradient get 0.

    A row whose gradient is NaN or infinite contributes nothing (its clipped
    norm, 0, is within the bound), so one pathological row can neither poison
    the sum nor reveal itself through it.
    """
    finite = jnp.isfinite(norms)
    safe = jnp.where(finite & (norms > 0), norms, 1.0)
    return jnp.where(finite, jnp.minimum(1.0, clip / safe), 0.0)


def vector_clip_bound(clip, dim: int, dtype):
    """Norm bound of a vector clipped to ``clip`` in floating point.

    ``g * min(1, clip / ||g||)`` computed with rounding has norm at most
    ``clip (1 + (d + 8) u)`` (the norm's own error is below ``(d/2 + 1) u``).
    """
    return clip * (1.0 + (dim + 8) * unit_roundoff(dtype))


def _masked(weights: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Clip weights of a padded minibatch: rows outside the mask count 0."""
    return weights if mask is None else weights * mask.astype(weights.dtype)


# ------------------------------------------------------------------ jacobian
#: Rows per block of the general route: bounds the per-row gradients and the
#: backward pass's intermediates held at once, whatever n.
ROW_BLOCK = 65536


def _jacobian_route(pm: PrivateModel) -> Callable:
    def clipped_sum(theta, clip, model_args, model_kwargs, idx=None, mask=None, levels=1):
        loglik, rows = pm.one_row_loglik(model_args, model_kwargs)
        rows = [jnp.asarray(x) if idx is None else jnp.asarray(x)[idx] for x in rows]
        n = rows[0].shape[0]
        mask = jnp.ones(n, bool) if mask is None else mask

        bound = vector_clip_bound(clip, theta.shape[0], theta.dtype)

        def block_sum(block):  # rows of the per-row Jacobian, clipped and summed
            *block_rows, block_mask = block
            jac = jax.vmap(jax.grad(loglik), (None, 0))(theta, block_rows)
            weights = _masked(clip_weights(jnp.linalg.norm(jac, axis=1), clip), block_mask)
            jac = jnp.where(jnp.isfinite(jac), jac, 0.0)
            return exact_sum(weights.astype(jac.dtype)[:, None] * jac, bound, n, levels)

        arrays = rows + [mask]
        full = n - n % ROW_BLOCK
        parts = []
        if full:
            blocks = [x[:full].reshape((-1, ROW_BLOCK) + x.shape[1:]) for x in arrays]
            parts += list(lax.map(block_sum, blocks))
        if full < n:
            parts += [x[None] for x in block_sum([x[full:] for x in arrays])]
        return dw_sum(jnp.concatenate(parts))

    return clipped_sum


# ------------------------------------------------------- one row's program
# Primitives whose outputs are linear in all their inputs jointly.
_LINEAR = frozenset({
    "add", "add_any", "sub", "neg", "reduce_sum", "broadcast_in_dim", "reshape",
    "squeeze", "expand_dims", "transpose", "slice", "concatenate", "copy", "copy_p",
    "rev", "split", "pad", "cumsum",
})
# Linear in their theta-dependent operands provided this test on the
# operands' theta-dependence holds (``t[k]``: operand k depends on theta).
_LINEAR_IF = {
    "mul": lambda t: sum(t) <= 1,
    "dot_general": lambda t: sum(t) <= 1,
    "div": lambda t: not t[1],
    "triangular_solve": lambda t: not t[0],
    "select_n": lambda t: not t[0],  # the predicate
    "dynamic_slice": lambda t: not any(t[1:]),  # the indices
    "dynamic_update_slice": lambda t: not any(t[2:]),
    "gather": lambda t: not t[1],
}
# Shape-only operations a shared cut value may be moved back across when
# their input is no larger (e.g. a scalar broadcast to a row's shape).
_STRUCTURAL = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p",
    "convert_element_type",
})
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})


class _NotQualified(Exception):
    """The linear-predictor route does not apply (the message says why)."""


class _Eqn(NamedTuple):
    eqn: Any  # the original JaxprEqn (primitive, params, context)
    ins: tuple  # node ids, or ("lit", value)
    outs: tuple  # node ids


class _Graph:
    """One row's log-likelihood program with every nested jit call inlined."""

    def __init__(self, closed, n_rows: int):
        self.avals: list = []
        self.consts: dict[int, Any] = {}
        self.eqns: list[_Eqn] = []
        self.producer: dict[int, int] = {}
        self.theta = self._new(closed.jaxpr.invars[0].aval)
        self.rows = tuple(self._new(v.aval) for v in closed.jaxpr.invars[1:1 + n_rows])
        (self.out,) = self._inline(
            closed.jaxpr, closed.consts, (self.theta,) + self.rows
        )

    def _new(self, aval) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def _const(self, value, aval) -> int:
        node = self._new(aval)
        self.consts[node] = value
        return node

    def _inline(self, jaxpr, consts, in_nodes) -> list[int]:
        env: dict = {}

        def read(a):
            return ("lit", a.val) if isinstance(a, Literal) else env[a]

        def as_node(a):
            r = read(a)
            return self._const(r[1], a.aval) if isinstance(r, tuple) else r

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self._const(c, v.aval)
        for v, n in zip(jaxpr.invars, in_nodes, strict=True):
            env[v] = n
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if name in _INLINE and sub is not None and hasattr(sub, "consts"):
                outs = self._inline(sub.jaxpr, sub.consts, [as_node(a) for a in eqn.invars])
            else:
                outs = [self._new(v.aval) for v in eqn.outvars]
                self.eqns.append(_Eqn(eqn, tuple(read(a) for a in eqn.invars), tuple(outs)))
                for o in outs:
                    self.producer[o] = len(self.eqns) - 1
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [as_node(v) for v in jaxpr.outvars]

    # ------------------------------------------------------------ evaluation
    def schedule(self, targets, given) -> list[int]:
        """Indices of the equations computing ``targets`` from ``given`` + constants.

        Raises ``_NotQualified`` if that needs any other input of the program
        (e.g. theta for the part after the cut, or a row for a shared value).
        """
        given = set(given)
        needed, stack, seen = set(), list(targets), set()
        while stack:
            node = stack.pop()
            if node in seen or node in given or node in self.consts:
                continue
            seen.add(node)
            if node not in self.producer:
                raise _NotQualified("the cut does not separate theta from the rows' terms")
            k = self.producer[node]
            if k not in needed:
                needed.add(k)
                stack.extend(a for a in self.eqns[k].ins if not isinstance(a, tuple))
        return sorted(needed)

    def evaluate(self, order, env: dict, targets) -> list:
        env = dict(env)

        def read(a):
            if isinstance(a, tuple):
                return a[1]
            return env[a] if a in env else self.consts[a]

        for k in order:
            e = self.eqns[k]
            params = e.eqn.primitive.get_bind_params(e.eqn.params)
            with e.eqn.ctx.manager:
                ans = e.eqn.primitive.bind(*[read(a) for a in e.ins], **params)
            if not e.eqn.primitive.multiple_results:
                ans = [ans]
            env.update(zip(e.outs, ans, strict=True))
        return [read(t) for t in targets]


def _size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


class _Cut(NamedTuple):
    kind: str  # "linear" or "parameter"
    row: tuple  # node ids of phi (row values, float)
    shared: tuple  # node ids of psi (shared values, float)
    aux: tuple  # shared non-float values (no derivative, as in JAX)
    m: int
    q: int


class _Analysis:
    """Dependence and linearity of every value of one row's program."""

    def __init__(self, g: _Graph):
        self.g = g
        live = set(g.schedule([g.out], [g.theta, *g.rows]))
        self.live = [k for k in range(len(g.eqns)) if k in live]
        self.T = {g.theta}  # depends on theta
        self.D = set(g.rows)  # depends on a row
        self.lin = set()  # T, D, float and linear in its theta-dependent inputs
        for k in self.live:
            e = g.eqns[k]
            nodes = [a for a in e.ins if not isinstance(a, tuple)]
            if any(a in self.D for a in nodes):
                self.D.update(e.outs)
            if any(a in self.T for a in nodes):
                self.T.update(e.outs)
                if self._linear(e) and all(_is_float(g.avals[o]) for o in e.outs):
                    self.lin.update(o for o in e.outs if o in self.D)

    def _t(self, a) -> bool:
        return not isinstance(a, tuple) and a in self.T

    def _stage1_input(self, a) -> bool:
        return not self._t(a) or a not in self.D or a in self.lin

    def _linear(self, e: _Eqn) -> bool:
        name = e.eqn.primitive.name
        ins = e.ins
        if not all(self._stage1_input(a) for a in ins):
            return False
        if name == "convert_element_type":
            return _is_float(self.g.avals[ins[0]]) if not isinstance(ins[0], tuple) else True
        if name in _LINEAR:
            return True
        test = _LINEAR_IF.get(name)
        return test is not None and bool(test([self._t(a) for a in ins]))

    def cut(self, kind: str) -> _Cut:
        g = self.g

        def stage1(node) -> bool:
            if node not in self.T:
                return False
            return node not in self.D or (kind == "linear" and node in self.lin)

        cut = set()
        for k in self.live:
            e = g.eqns[k]
            if all(stage1(o) for o in e.outs):
                continue
            cut.update(a for a in e.ins if not isinstance(a, tuple) and stage1(a))
        if stage1(g.out):
            cut.add(g.out)
        # A shared value that is only a reshaped/broadcast/cast copy of a narrower
        # shared value: cut before the copy (the copy then runs after the cut).
        changed = True
        while changed:
            changed = False
            for node in sorted(cut):
                if node in self.D or node not in g.producer:
                    continue
                e = g.eqns[g.producer[node]]
                nodes = [a for a in e.ins if not isinstance(a, tuple)]
                if (
                    e.eqn.primitive.name in _STRUCTURAL
                    and len(e.outs) == 1
                    and len(nodes) == 1
                    and nodes[0] in self.T
                    and _is_float(g.avals[nodes[0]]) == _is_float(g.avals[node])
                    and _size(g.avals[nodes[0]]) <= _size(g.avals[node])
                ):
                    cut.discard(node)
                    cut.add(nodes[0])
                    changed = True
        cut = sorted(cut)
        row = tuple(n for n in cut if n in self.D)
        shared = tuple(n for n in cut if n not in self.D and _is_float(g.avals[n]))
        aux = tuple(n for n in cut if n not in self.D and not _is_float(g.avals[n]))
        return _Cut(
            kind, row, shared, aux,
            sum(_size(g.avals[n]) for n in row), sum(_size(g.avals[n]) for n in shared),
        )


class RouteChoice(NamedTuple):
    """The route :func:`select_route` takes and why (all structural, public)."""

    route: str  # "jacobian" or "linear_predictor"
    reason: str
    cut: str | None = None  # "linear" or "parameter" for the linear_predictor route
    row_width: int | None = None  # m: cut values per row
    shared_width: int | None = None  # q: cut values shared by all rows


class _Plan(NamedTuple):
    choice: RouteChoice
    graph: _Graph | None = None
    cut: _Cut | None = None
    order_row: list | None = None
    order_shared: list | None = None
    order_f: list | None = None


def _admissible(c: _Cut, d: int) -> bool:
    return c.m <= max(1, d // 2) and c.m + c.q <= d


def _plan(pm: PrivateModel, theta_shape, theta_dtype, model_args, model_kwargs) -> _Plan:
    """Analyse one row's program (abstract rows: no data value is read)."""
    one_row, rows = pm.one_row_loglik(model_args, model_kwargs)

    d = int(np.prod(theta_shape, dtype=np.int64))
    row_avals = [
        jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in rows
    ]
    try:
        closed = jax.make_jaxpr(one_row)(
            jax.ShapeDtypeStruct(tuple(theta_shape), theta_dtype), row_avals
        )
        g = _Graph(closed, len(rows))
        an = _Analysis(g)
        cuts = [an.cut("linear"), an.cut("parameter")]
    except Exception as err:  # noqa: BLE001 - any failure means: use the general route
        return _Plan(RouteChoice(
            "jacobian",
            f"one row's log-likelihood could not be analysed on abstract rows "
            f"({type(err).__name__})",
        ))
    good = [c for c in cuts if _admissible(c, d)]
    if not good:
        widths = "; ".join(f"{c.kind} cut: m={c.m}, q={c.q}" for c in cuts)
        return _Plan(RouteChoice(
            "jacobian",
            f"theta reaches each row's log-likelihood only through wide cuts ({widths}; "
            f"m values per row, q shared values), but the route needs "
            f"m <= {max(1, d // 2)} and m + q <= d = {d}",
        ))
    cut = min(good, key=lambda c: (2 * c.m + c.q, c.m))
    try:
        order_row = g.schedule(cut.row, [g.theta, *g.rows])
        order_shared = g.schedule(cut.shared + cut.aux, [g.theta])
        order_f = g.schedule([g.out], [*cut.row, *cut.shared, *cut.aux, *g.rows])
    except _NotQualified as err:
        return _Plan(RouteChoice("jacobian", str(err)))
    choice = RouteChoice(
        "linear_predictor",
        f"{cut.kind} cut with m={cut.m} value(s) per row and q={cut.q} shared value(s) "
        f"(d={d})",
        cut.kind, cut.m, cut.q,
    )
    return _Plan(choice, g, cut, order_row, order_shared, order_f)


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
    if route == "jacobian":
        return RouteChoice("jacobian", "forced")
    model_kwargs = {} if model_kwargs is None else model_kwargs
    plan = _plan(pm, (pm.num_params,), jnp.result_type(float), model_args, model_kwargs)
    _check_forced(plan, route)
    return plan.choice


def _check_forced(plan: _Plan, route: str) -> None:
    if route == "linear_predictor" and plan.choice.route != "linear_predictor":
        raise ValueError(
            "grad_route='linear_predictor' does not apply to this model: "
            f"{plan.choice.reason}. Use grad_route='auto' or 'jacobian'."
        )


# --------------------------------------------------------- linear predictor
def _linear_predictor_sum(plan: _Plan, theta, clip, rows, mask=None, levels=1):
    g, cut = plan.graph, plan.cut
    dtype = theta.dtype

    def phi_row(t, row):  # the cut's row values, flattened: (m,)
        env = {g.theta: t, **dict(zip(g.rows, row, strict=True))}
        vals = g.evaluate(plan.order_row, env, cut.row)
        return jnp.concatenate([jnp.ravel(v).astype(dtype) for v in vals])

    def shared(t):  # the cut's shared values (no row is available here)
        vals = g.evaluate(plan.order_shared, {g.theta: t}, cut.shared + cut.aux)
        return vals[: len(cut.shared)], vals[len(cut.shared):]

    psi_vals, aux = shared(theta)
    psi, unravel_psi = ravel_pytree(psi_vals)
    row_shapes = [(g.avals[n].shape, g.avals[n].dtype) for n in cut.row]

    def split_phi(flat):
        out, start = [], 0
        for shape, dt in row_shapes:
            size = int(np.prod(shape, dtype=np.int64))
            out.append(jnp.reshape(flat[start:start + size], shape).astype(dt))
            start += size
        return out

    def f_row(phi_flat, psi_flat, row):
        env = dict(zip(g.rows, row, strict=True))
        env.update(zip(cut.row, split_phi(phi_flat), strict=True))
        env.update(zip(cut.shared, unravel_psi(psi_flat), strict=True))
        env.update(zip(cut.aux, aux, strict=True))
        return g.evaluate(plan.order_f, env, [g.out])[0]

    n = rows[0].shape[0]
    if cut.m:
        jac_rows = jax.vmap(
            jax.jacrev(lambda t, row: (phi_row(t, row),) * 2, has_aux=True), (None, 0)
        )
        A, phi = jac_rows(theta, rows)  # (n, m, d), (n, m)
    else:
        A, phi = None, jnp.zeros((n, 0), dtype)
    u, v = jax.vmap(jax.grad(f_row, argnums=(0, 1)), (0, None, 0))(phi, psi, rows)

    if cut.m == 1 and cut.q == 0:
        # One value per row: grad l_i = u_i a_i, ||grad l_i|| = |u_i| ||a_i||.
        a = A[:, 0, :]
        weights = _masked(clip_weights(jnp.abs(u[:, 0]) * jnp.linalg.norm(a, axis=1), clip), mask)
        coef = jnp.where(weights > 0, weights * u[:, 0], 0.0).astype(dtype)
        return exact_sum(coef[:, None] * jnp.where(jnp.isfinite(a), a, 0.0),
                         vector_clip_bound(clip, theta.shape[0], dtype), levels=levels)
    rows_grad = v.astype(dtype) @ jax.jacrev(lambda t: ravel_pytree(shared(t)[0])[0])(theta) \
        if cut.q else jnp.zeros((n, theta.shape[0]), dtype)
    if cut.m:
        rows_grad = rows_grad + jnp.einsum("nm,nmd->nd", u.astype(dtype), A)
    weights = _masked(clip_weights(jnp.linalg.norm(rows_grad, axis=1), clip), mask)
    rows_grad = jnp.where(jnp.isfinite(rows_grad), rows_grad, 0.0)
    return exact_sum(weights.astype(dtype)[:, None] * rows_grad,
                     vector_clip_bound(clip, theta.shape[0], dtype), levels=levels)


def _linear_predictor_route(pm: PrivateModel, route: str) -> Callable:
    def clipped_sum(theta, clip, model_args, model_kwargs, idx=None, mask=None, levels=1):
        theta = jnp.asarray(theta)
        plan = _plan(pm, theta.shape, theta.dtype, model_args, model_kwargs)
        _check_forced(plan, route)
        if plan.choice.route == "jacobian":
            return _jacobian_route(pm)(theta, clip, model_args, model_kwargs, idx, mask, levels)
        rows = [jnp.asarray(x) for x in pm.one_row_loglik(model_args, model_kwargs)[1]]
        if idx is not None:
            rows = [x[idx] for x in rows]
        if route == "linear_predictor":
            return _linear_predictor_sum(plan, theta, clip, rows, mask, levels)
        try:
            return _linear_predictor_sum(plan, theta, clip, rows, mask, levels)
        except Exception:  # noqa: BLE001 - a tracing failure (shapes only): general route
            return _jacobian_route(pm)(theta, clip, model_args, model_kwargs, idx, mask, levels)

    return clipped_sum


def clipped_grad_sum_fn(
    pm: PrivateModel,
    route: str = "auto",
    model_args: tuple | None = None,
    model_kwargs: dict | None = None,
) -> tuple[Callable, str]:
    """The function ``(theta, clip, model_args, model_kwargs) -> sum_i clip_c(grad l_i)``.

    The sum is returned as a double-word pair ``(hi, lo)`` (see the module
    docstring); ``hi + lo`` is the sum in the working precision.

    The returned function also takes ``idx`` (row indices: sum over those rows
    only, at a cost independent of ``n``), ``mask`` (per-index weights in
    {0, 1}: padded slots of a minibatch buffer contribute 0) and ``levels``
    (of :func:`~numpyro_dp.primitives.rounding.exact_sum`, see
    :func:`~numpyro_dp.primitives.rounding.sum_levels`).

    Parameters
    ----------
    pm : PrivateModel
        The analysed model.
    route : {"auto", "jacobian", "linear_predictor"}
        Which exact route computes the clipped sum (see the module docstring).
        ``"auto"`` decides from the model's program and the data's shapes each
        time the function is traced.
    model_args, model_kwargs : optional
        Example arguments; only their shapes (and the public non-row values)
        are used, to resolve ``"auto"`` and to check a forced
        ``"linear_predictor"`` now rather than at the first call.

    Returns
    -------
    clipped_sum : callable
        jit- and vmap-able; ``clip`` may be a traced scalar.
    route : str
        The route taken: ``"jacobian"`` or ``"linear_predictor"``, or
        ``"auto"`` when ``route="auto"`` and no example arguments were given.
    """
    if route not in ROUTES:
        raise ValueError(f"grad_route={route!r}; use one of {ROUTES}.")
    if route == "jacobian":
        return _jacobian_route(pm), "jacobian"
    taken = route
    if model_args is not None or model_kwargs is not None:
        taken = select_route(pm, model_args or (), model_kwargs, route).route
    return _linear_predictor_route(pm, route), taken


def _row_blocks(fn: Callable, rows: list, block: int) -> jax.Array:
    """``fn`` (one value per row) over the rows in blocks of ``block`` rows."""
    n = rows[0].shape[0]
    full = n - n % block
    parts = []
    if full:
        blocks = [x[:full].reshape((-1, block) + x.shape[1:]) for x in rows]
        parts.append(lax.map(fn, blocks).reshape(-1))
    if full < n:
        parts.append(fn([x[full:] for x in rows]))
    return jnp.concatenate(parts)


def row_gradient_scales(
    pm: PrivateModel,
    theta: jax.Array,
    model_args: tuple,
    model_kwargs: dict,
    directions: jax.Array | None = None,
    whiten: jax.Array | None = None,
) -> jax.Array:
    """One scale per row: ``||grad l_i(theta)||``, or ``max_k |grad l_i . u_k|``.

    ``directions`` holds unit vectors ``u_k`` (rows); ``whiten`` a matrix
    ``L``: the norm of ``L^T grad l_i`` (the gradient in the coordinates
    ``theta = L phi``).  Private values, for a DP quantile only
    (:mod:`numpyro_dp.tuning`).
    """
    loglik, rows = pm.one_row_loglik(model_args, model_kwargs)

    def block_scales(block_rows):
        jac = jax.vmap(jax.grad(loglik), (None, 0))(theta, block_rows)
        if whiten is not None:
            jac = jac @ whiten
        if directions is None:
            return jnp.linalg.norm(jac, axis=1)
        return jnp.max(jnp.abs(jac @ directions.T), axis=1)

    return _row_blocks(block_scales, [jnp.asarray(x) for x in rows], ROW_BLOCK)


#: Rows per block of :func:`clipped_grad_and_hessian_sums` (it holds d^2 numbers a row).
HESSIAN_BLOCK = 4096


def clipped_grad_and_hessian_sums(
    pm: PrivateModel,
    theta: jax.Array,
    clip,
    hessian_clip,
    model_args: tuple,
    model_kwargs: dict,
    levels: int = 1,
    whiten: jax.Array | None = None,
):
    """``sum_i clip_C(grad l_i)`` and ``sum_i clip_K(hess l_i)`` (flattened) at ``theta``.

    Each row's gradient is clipped to l2 norm ``C`` and its Hessian to
    Frobenius norm ``K``; with ``whiten`` a matrix ``L``, the row's gradient
    and Hessian in the coordinates ``theta = L phi`` (``L^T g``,
    ``L^T H L``) are clipped and summed instead.  Both sums are
    :func:`~numpyro_dp.primitives.rounding.exact_sum` pairs of rows bounded by
    ``vector_clip_bound(C, d)`` and ``vector_clip_bound(K, d^2)``, so one row
    moves the first by ``C`` and the second by ``K`` (add/remove).  With
    ``hessian_clip=None`` no Hessian is computed and its sum is zeros.
    Private values: for the private warm start's releases only.
    """
    loglik, rows = pm.one_row_loglik(model_args, model_kwargs)
    rows = [jnp.asarray(x) for x in rows]
    n, d, dtype = rows[0].shape[0], theta.shape[0], theta.dtype
    bound = vector_clip_bound(clip, d, dtype)
    with_hessian = hessian_clip is not None
    hess_bound = vector_clip_bound(hessian_clip, d * d, dtype) if with_hessian else None

    def clipped(values, limit):
        weights = clip_weights(jnp.linalg.norm(values, axis=1), limit)
        return weights.astype(dtype)[:, None] * jnp.where(jnp.isfinite(values), values, 0.0)

    def block_sums(block_rows):
        jac = jax.vmap(jax.grad(loglik), (None, 0))(theta, block_rows)
        if whiten is not None:
            jac = jac @ whiten
        grad_sum = exact_sum(clipped(jac, clip), bound, n, levels)
        if not with_hessian:
            zeros = jnp.zeros(d * d, dtype)
            return grad_sum, (zeros, zeros)
        hess = jax.vmap(jax.hessian(loglik), (None, 0))(theta, block_rows)
        if whiten is not None:
            hess = jnp.einsum("ji,njk,kl->nil", whiten, hess, whiten)
        hess = clipped(hess.reshape(hess.shape[0], d * d), hessian_clip)
        return grad_sum, exact_sum(hess, hess_bound, n, levels)

    full = n - n % HESSIAN_BLOCK
    grads, hessians = [], []
    if full:
        blocks = [x[:full].reshape((-1, HESSIAN_BLOCK) + x.shape[1:]) for x in rows]
        g, h = lax.map(block_sums, blocks)
        grads += list(g)
        hessians += list(h)
    if full < n:
        g, h = block_sums([x[full:] for x in rows])
        grads += [x[None] for x in g]
        hessians += [x[None] for x in h]
    return dw_sum(jnp.concatenate(grads)), dw_sum(jnp.concatenate(hessians))


def row_hessian_norms(
    pm: PrivateModel, theta: jax.Array, model_args: tuple, model_kwargs: dict,
    whiten: jax.Array | None = None,
) -> jax.Array:
    """``||hess l_i(theta)||_F`` per row, or ``||L^T hess l_i L||_F`` with ``whiten``
    a matrix ``L`` (private: for a DP quantile only)."""
    loglik, rows = pm.one_row_loglik(model_args, model_kwargs)

    def block_norms(block_rows):
        hess = jax.vmap(jax.hessian(loglik), (None, 0))(theta, block_rows)
        if whiten is not None:
            hess = jnp.einsum("ji,njk,kl->nil", whiten, hess, whiten)
        return jnp.linalg.norm(hess.reshape(hess.shape[0], -1), axis=1)

    return _row_blocks(block_norms, [jnp.asarray(x) for x in rows], HESSIAN_BLOCK)
