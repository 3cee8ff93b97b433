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
    log-likelihood), in equal blocks of at most :data:`ROW_BLOCK` rows; each
    block's rows are clipped and summed as ``J_B^T w_B``.  Works for every model the
    adapter accepts; costs about three passes through the likelihood
    whatever ``d`` (forward mode would cost ``d``), and holds one block's
    gradients and intermediates at a time, not ``n x d``.

    *Indexed blocks.*  A block of theta (one site's coordinates) that each
    row's program reads only through gathers at indices free of theta (a
    hierarchical model's ``a[g_i]``, ``ab[g_i, 0]``, ``ab[g_i]``) is not
    differentiated whole: the row's program is evaluated with the gathered
    numbers as inputs, so its gradient has the other coordinates plus the
    few numbers the row reads (for 50 groups, 9 numbers instead of 58); the
    norm is computed from those exactly (a position read twice holds the
    sum), and the block's sum is a sum per position
    (:func:`~numpyro_dp.primitives.rounding.exact_segment_sum`, the same
    grid as :func:`~numpyro_dp.primitives.rounding.exact_sum`).  The released
    sum is the dense route's, computed by a different program.

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
    (rows of a vmapped program are independent).  When the cut has a single
    row scalar (``m = 1``: logistic, Poisson or probit GLMs, a factor of a
    linear predictor) and its shared values, if any, depend on coordinates
    of theta of their own (a regression's scale and degrees of freedom,
    :func:`_shared_coordinates`), the two parts of a row's gradient lie on
    disjoint coordinates: the squared norms are
    ``u_i^2 ||A_i||^2 + ||C^T v_i||^2`` and the clipped sum is one
    contraction ``sum_i w_i u_i A_i`` plus a sum of ``q``-vectors, about the
    cost of an ordinary gradient; otherwise the ``n x d`` rows
    ``A_i^T u_i + C^T v_i`` are formed, clipped and summed.  Either way the
    norm of exactly the vector that is summed is clipped, so the sensitivity
    bound holds as for ``"jacobian"``.

    The contraction forms ``A_i`` only on the coordinates that reach the row
    value, and an indexed block's part only at the entries the row reads
    (as on the general route): a hierarchical model's ``a[g_i] + x_i w``
    has 5 + 1 numbers per row of its 58.

    Privacy does not rest on any structural conclusion: each row's clip
    weight comes from the norm of exactly the vector that is summed for it.
    Exactness (the general route's sum) rests on the chain rule through
    values the program actually computes -- the cut is verified to separate
    ``theta`` from the output (the evaluator of ``F`` is given no ``theta``),
    ``psi`` is evaluated without any row, the rows stay separate because one
    row's program is vmapped -- and on JAX's derivative of a value that a
    coordinate does not reach being an exact zero (which coordinates reach
    which values is read off the traced program).

Route selection (``"auto"``): the per-row program is traced with abstract
rows (shapes and dtypes only; the public non-row arguments as given).  Two
cuts are tried: the *linear* cut above and the *parameter* cut (``psi``
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
from numpyro_dp.primitives.rounding import dw_sum, exact_segment_sum, exact_sum, unit_roundoff
from numpyro_dp.primitives.sharding import over_row_shards, row_axis, rows_sharded

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


def row_squared_norms(rows: jax.Array) -> jax.Array:
    """``||r_i||^2`` of each row of an ``(n, d)`` array, as one matrix-vector product.

    For the indexed blocks' few numbers a row reads (an ``(n, width)`` array
    each): there XLA on CPU reduced over the short minor axes much slower than
    it multiplies by a vector of ones (a DPHMC iteration of the hierarchical
    model, 50 groups: 2.3x against 1.6x NumPyro HMC at n = 1e4, 1.8x against
    1.6x at 1e5).  The other coordinates are stored coordinate-major
    (:func:`column_squared_norms`).  ``HIGHEST``
    precision: an accelerator's default float32 product (TF32, bfloat16) would
    round the squares far beyond the error :func:`vector_clip_bound` allows;
    any order of summing d non-negative terms stays within it.
    """
    ones = jnp.ones(rows.shape[1], rows.dtype)
    return jnp.matmul(rows * rows, ones, precision=lax.Precision.HIGHEST)


#: Most coordinates whose squares :func:`column_squared_norms` adds one slice at a time.
UNROLLED_NORM = 64


def column_squared_norms(cols: jax.Array) -> jax.Array:
    """``||c_i||^2`` of each column of a ``(d, n)`` array (per-row vectors stored
    coordinate-major).

    With the ``d`` squares added slice by slice (an elementwise sum over ``n``)
    XLA on CPU fuses the norms, the clip weights and the weighted exact sum
    into passes over ``n`` that read each row's numbers where the gradient
    pass left them; a reduction over the minor axis of ``(n, d)`` rows made
    the gradients a separate array read twice.  A DPHMC iteration went from
    1.56x to 1.29x NumPyro HMC (hierarchical model, n = 1e5) and from 1.80x
    to 1.34x (1e6), the Student-t regression's from 1.53x to 1.33x (1e5)
    (``benchmarks/bench_hmc.py``).  Any order of adding the ``d`` squares
    stays within :func:`vector_clip_bound`.
    """
    if cols.shape[0] > UNROLLED_NORM:
        return jnp.sum(cols * cols, axis=0)
    return sum(c * c for c in cols)


def vector_clip_bound(clip, dim: int, dtype):
    """Norm bound of a vector clipped to ``clip`` in floating point.

    ``g * min(1, clip / ||g||)`` computed with rounding has norm at most
    ``clip (1 + (d + 8) u)`` (the norm's own error is below ``(d/2 + 1) u``).
    """
    return clip * (1.0 + (dim + 8) * unit_roundoff(dtype))


def _finite(x: jax.Array) -> jax.Array:
    """Non-finite entries as 0 (their rows have clip weight 0: see clip_weights)."""
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _masked(weights: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Clip weights of a padded minibatch: rows outside the mask count 0."""
    return weights if mask is None else weights * mask.astype(weights.dtype)


# ------------------------------------------------------------------ jacobian
#: Most rows per block of the general route: bounds the per-row gradients and
#: the backward pass's intermediates held at once, whatever n.  Blocks are
#: made equal (:func:`_map_blocks`): ``lax.map`` costs per iteration, and a
#: remainder block is a second program.  Against blocks of 65536 rows and a
#: remainder, a DPHMC iteration of the Student-t model went from 2.6x to 1.5x
#: NumPyro HMC at n = 1e5 (one block) and from 2.9x to 2.2x at 1e6 (eight);
#: the hierarchical one from 2.2x to 1.7x at 1e6 (``benchmarks/bench_hmc.py``).
ROW_BLOCK = 131072


def _map_blocks(fn: Callable, arrays: list, block: int) -> list:
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


def _summed_blocks(fn: Callable, arrays: list, block: int) -> tuple:
    """Block sums added up: ``fn`` returns a tuple of double-word pairs ``(hi, lo)``
    of its block; each pair's blocks are added exactly (:func:`dw_sum`)."""
    parts = _map_blocks(fn, arrays, block)
    return tuple(
        dw_sum(jnp.concatenate([x for p in parts for x in p[j]])) for j in range(len(parts[0]))
    )


def _jacobian_sum(pm: PrivateModel, plan, theta, clip, model_args, model_kwargs,
                  idx=None, mask=None, levels=1, num_terms=None):
    """The general route; with ``plan.indexed``, each row's gradient in compressed form."""
    loglik, rows = pm.one_row_loglik(model_args, model_kwargs)
    rows = [jnp.asarray(x) if idx is None else jnp.asarray(x)[idx] for x in rows]
    n, d = rows[0].shape[0], theta.shape[0]
    mask = jnp.ones(n, bool) if mask is None else mask
    n = n if num_terms is None else num_terms
    bound = vector_clip_bound(clip, d, theta.dtype)
    indexed = None if plan is None else plan.indexed

    def block_sum(block):  # rows of the per-row Jacobian, clipped and summed
        *block_rows, block_mask = block
        if indexed is None:  # coordinate-major: see column_squared_norms
            jac = jax.vmap(jax.grad(loglik), (None, 0), 1)(theta, block_rows)
            weights = _masked(clip_weights(jnp.sqrt(column_squared_norms(jac)), clip), block_mask)
            return exact_sum((weights.astype(jac.dtype) * _finite(jac)).T, bound, n, levels)
        _, rest, local, where = indexed.row_gradients(theta, block_rows)
        squares = column_squared_norms(rest) + sum(row_squared_norms(v) for v in local)
        weights = _masked(clip_weights(jnp.sqrt(squares), clip), block_mask).astype(theta.dtype)
        dense = exact_sum((weights * _finite(rest)).T, bound, n, levels)
        tables = [  # one term per (row, position): a row's vector rounded as a whole
            exact_segment_sum((weights[:, None] * _finite(v)).reshape(-1, 1), w.reshape(-1),
                              b.size, bound, n, levels)
            for b, v, w in zip(indexed.blocks, local, where, strict=True)
        ]
        return indexed.assemble(dense, [(hi[:, 0], lo[:, 0]) for hi, lo in tables])

    return _summed_blocks(lambda block: (block_sum(block),), rows + [mask], ROW_BLOCK)[0]


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
                if (self._linear(e) and all(_is_float(g.avals[o]) for o in e.outs)
                        and self._narrows(e)):
                    self.lin.update(o for o in e.outs if o in self.D)

    def _narrows(self, e: _Eqn) -> bool:
        """Whether ``e``, fed by theta only through shared values, makes a row value
        narrower than them (``x . w``, ``a[g]``).  One that does not (a dispersion
        ``c + y``) is better after the cut, with ``c`` a shared value: as a row
        value it would mix ``c``'s coordinate into the row values."""
        shared = [a for a in e.ins if self._t(a)]
        if any(a in self.D for a in shared):
            return True  # already a row value: e continues it
        return sum(_size(self.g.avals[a]) for a in shared) > sum(
            _size(self.g.avals[o]) for o in e.outs)

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


# ------------------------------------------------------------ indexed blocks
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


def _blocks_of_theta(g: _Graph, consumers: dict) -> list[tuple[int, int, int]] | None:
    """``(node, start, size)`` of the pieces theta is split into, or None.

    None when theta is used other than by ``split``/``slice`` into disjoint
    pieces: a coordinate read twice could not be moved into a compressed block.
    """
    pieces = []
    for k in consumers.get(g.theta, ()):
        e = g.eqns[k]
        name, params = e.eqn.primitive.name, e.eqn.params
        if name == "split" and params.get("axis", 0) == 0:
            start = 0
            for out, size in zip(e.outs, params["sizes"], strict=True):
                pieces.append((out, start, int(size)))
                start += int(size)
        elif name == "slice" and not params.get("strides"):
            (a,), (b,) = params["start_indices"], params["limit_indices"]
            pieces.append((e.outs[0], int(a), int(b) - int(a)))
        else:
            return None
    covered = sorted((a, a + n) for _, a, n in pieces)
    if any(b0 > a1 for (_, b0), (a1, _) in zip(covered, covered[1:], strict=False)):
        return None
    return pieces


def _read(g: _Graph, an, e: _Eqn, table: int) -> _Read | None:
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
        or _size(g.avals[e.outs[0]]) != int(np.prod(sizes, dtype=np.int64))
    ):
        return None
    return _Read(e.outs[0], index, tuple(dn.start_index_map), sizes)


def _indexed_blocks(g: _Graph, an) -> list[_Block]:
    """Blocks of theta of which each row reads only a few entries.

    A hierarchical model's group effects ``a[g_i]`` (or ``ab[g_i, 0]``,
    ``ab[g_i]``): row i's gradient is zero on the block but at the entries it
    reads, so the route computes it there alone (and sums it per entry)
    instead of ``n x J`` zeros.
    """
    consumers = _consumers(g, an)
    blocks = []
    for node, start, _ in _blocks_of_theta(g, consumers) or ():
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


def _consumers(g: _Graph, an) -> dict[int, list[int]]:
    """Node -> the live equations that read it."""
    out: dict[int, list[int]] = {}
    for k in an.live:
        for a in g.eqns[k].ins:
            if not isinstance(a, tuple):
                out.setdefault(a, []).append(k)
    return out


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


class _Indexed:
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

    def __init__(self, g: _Graph, an, blocks: list[_Block], d: int, target: int):
        self.g, self.blocks, self.d, self.target = g, blocks, d, target
        pieces = _blocks_of_theta(g, _consumers(g, an))
        starts = {b.start for b in blocks}
        if pieces is None:  # every coordinate outside the blocks
            taken = sorted((b.start, b.start + b.size) for b in blocks)
            edges = [0] + [x for ab in taken for x in ab] + [d]
            spans = zip(edges[::2], edges[1::2], strict=True)
        else:  # pieces outside the blocks that reach target (e.g. not a prior's mu, tau)
            spans = [(a, a + k) for node, a, k in pieces
                     if a not in starts and target in _reached(g, an, node)]
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


class RouteChoice(NamedTuple):
    """The route :func:`select_route` takes and why (all structural, public)."""

    route: str  # "jacobian" or "linear_predictor"
    reason: str
    cut: str | None = None  # "linear" or "parameter" for the linear_predictor route
    row_width: int | None = None  # m: cut values per row
    shared_width: int | None = None  # q: cut values shared by all rows
    indexed: int = 0  # coordinates in blocks each row reads at one entry (jacobian route)


class _Plan(NamedTuple):
    choice: RouteChoice
    graph: _Graph | None = None
    cut: _Cut | None = None
    order_row: list | None = None
    order_shared: list | None = None
    order_f: list | None = None
    indexed: _Indexed | None = None  # the general route's indexed blocks
    span: _Indexed | None = None  # the contraction's row value and where it has a gradient
    shared_coords: tuple | None = None  # theta coordinates of the shared values (disjoint)


def _reached(g: _Graph, an, node: int) -> set[int]:
    """The values of one row's program that ``node`` reaches (itself included)."""
    seen = {node}
    for k in an.live:
        if any(not isinstance(a, tuple) and a in seen for a in g.eqns[k].ins):
            seen.update(g.eqns[k].outs)
    return seen


def _shared_coordinates(g: _Graph, an, cut: _Cut) -> tuple | None:
    """Coordinates of theta that reach the cut's shared values, if no row value.

    ``grad l_i = A_i^T u_i + C^T v_i``: when no coordinate of theta reaches both
    a row value and a shared value, ``A_i`` is zero on these coordinates and
    ``C`` zero off them (structurally: JAX's derivative of a value a
    coordinate does not reach is an exact zero), so the two parts of a row's
    gradient lie on disjoint coordinates and its squared norm is the sum of
    theirs.  None when theta is not split into pieces or a piece reaches both.
    """
    pieces = _blocks_of_theta(g, _consumers(g, an))
    if pieces is None:
        return None
    row, shared, coords = set(cut.row), set(cut.shared), []
    for node, start, size in pieces:
        seen = _reached(g, an, node)
        if seen & shared:
            if seen & row:
                return None
            coords.extend(range(start, start + size))
    return tuple(coords)


def _admissible(c: _Cut, d: int) -> bool:
    return c.m <= max(1, d // 2) and c.m + c.q <= d


def _jacobian_plan(reason: str, indexed: _Indexed | None = None) -> _Plan:
    if indexed is None:
        return _Plan(RouteChoice("jacobian", reason))
    size = sum(b.size for b in indexed.blocks)
    return _Plan(RouteChoice(
        "jacobian",
        f"{reason}; {size} coordinate(s) in {len(indexed.blocks)} block(s) of which each "
        f"row reads a few entries, so each row's gradient has {indexed.width} numbers "
        f"of d = {indexed.d}",
        indexed=size,
    ), indexed=indexed)


def _plan(pm: PrivateModel, theta_shape, theta_dtype, model_args, model_kwargs,
          route: str = "auto") -> _Plan:
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
        g = _Graph(closed, len(rows))
        an = _Analysis(g)
    except Exception as err:  # noqa: BLE001 - any failure means: use the general route
        return _Plan(RouteChoice(
            "jacobian",
            f"one row's log-likelihood could not be analysed on abstract rows "
            f"({type(err).__name__})",
        ))
    try:
        blocks = _indexed_blocks(g, an)
        indexed = _Indexed(g, an, blocks, d, g.out) if blocks else None
    except _NotQualified:
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
        span = _Indexed(g, an, [] if indexed is None else indexed.blocks, d,
                        cut.row[0]) if contraction else None
    except _NotQualified as err:
        return _jacobian_plan(str(err), indexed)
    reason = (f"{cut.kind} cut with m={cut.m} value(s) per row and q={cut.q} shared "
              f"value(s) (d={d})")
    size = 0 if span is None else sum(b.size for b in span.blocks)
    if size:
        reason += (f"; {size} coordinate(s) in {len(span.blocks)} block(s) of which each row "
                   f"reads a few entries, so each row's predictor has a gradient of "
                   f"{span.width} numbers")
    choice = RouteChoice("linear_predictor", reason, cut.kind, cut.m, cut.q, indexed=size)
    return _Plan(choice, g, cut, order_row, order_shared, order_f, indexed, span,
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
    plan = _plan(pm, (pm.num_params,), jnp.result_type(float), model_args, model_kwargs, route)
    _check_forced(plan, route)
    return plan.choice


def _check_forced(plan: _Plan, route: str) -> None:
    if route == "linear_predictor" and plan.choice.route != "linear_predictor":
        raise ValueError(
            "grad_route='linear_predictor' does not apply to this model: "
            f"{plan.choice.reason}. Use grad_route='auto' or 'jacobian'."
        )


# --------------------------------------------------------- linear predictor
def _linear_predictor_sum(plan: _Plan, theta, clip, rows, mask=None, levels=1, num_terms=None):
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
    bound = vector_clip_bound(clip, theta.shape[0], dtype)
    if cut.q:  # C = d psi / d theta, (q, d)
        C = jax.jacrev(lambda t: ravel_pytree(shared(t)[0])[0])(theta).astype(dtype)
    row_grads = jax.vmap(jax.grad(f_row, argnums=(0, 1)), (0, None, 0))
    span = plan.span  # set by _plan for the single contraction only
    if span is not None:
        # One value per row, shared values on coordinates S of their own:
        # grad l_i = u_i a_i + C^T v_i, a_i zero on S and C zero off it, so
        # ||grad l_i||^2 = u_i^2 ||a_i||^2 + ||C_S^T v_i||^2 and the clipped sum
        # is one weighted contraction of the a_i plus a sum of q-vectors, never
        # an n x d array of gradients.  a_i comes as the general route's
        # gradients do (_Indexed.row_gradients): coordinate-major on the
        # coordinates that reach the row value, the few numbers a row reads of
        # an indexed block (a hierarchical model's a[g_i] + x_i w: 5 + 1
        # numbers of 58).  Every factor of the norm is computed from the very
        # arrays that are summed, with relative error below (d/2 + 3) u,
        # within vector_clip_bound.
        # Coordinate-major: a DPHMC iteration of the logistic regression went
        # from 1.2x to 0.65x NumPyro HMC at n = 1e4 and from 1.5x to 1.3x at
        # 1e6 (XLA moves the theta-free a_i out of the loop).  On the path
        # below, which forms the n x d gradients from A, it was 1.5-2.5x slower.
        # Not in blocks of rows as on the general route: in blocks of
        # ROW_BLOCK rows the GLM's clipped gradient took 2.3x NumPyro's at
        # n = 1e6, against 1.5x in one pass.
        phi, a, a_local, a_where = span.row_gradients(theta, rows)
        u, v = row_grads(phi.astype(dtype)[:, None], psi, rows)
        u = u[:, 0]
        squares = column_squared_norms(a) + sum(row_squared_norms(x) for x in a_local)
        squares = jnp.square(u) * squares
        if cut.q:  # (|S|, n), as q products fused with the norms (a dot of a
            # q x |S| matrix was a separate, slower call on CPU)
            where = np.asarray(plan.shared_coords, np.int32)
            cs = sum(ck[:, None] * vk for ck, vk in zip(C[:, where], v.T.astype(dtype),
                                                       strict=True))
            squares = squares + column_squared_norms(cs)
        weights = _masked(clip_weights(jnp.sqrt(squares), clip), mask).astype(dtype)
        coef = jnp.where(weights > 0, weights * u, 0.0).astype(dtype)
        # All on one grid (bound and n), each part on coordinates of its own.
        dense = exact_sum((coef * _finite(a)).T, bound, num_terms, levels)
        tables = [  # one term per (row, position), as on the general route
            exact_segment_sum((coef[:, None] * _finite(x)).reshape(-1, 1), w.reshape(-1),
                              blk.size, bound, num_terms, levels)
            for blk, x, w in zip(span.blocks, a_local, a_where, strict=True)
        ]
        shared_sum = (where, exact_sum((weights * _finite(cs)).T, bound, num_terms, levels)
                      ) if cut.q else None
        return span.assemble(dense, [(hi[:, 0], lo[:, 0]) for hi, lo in tables], shared_sum)
    if cut.m:
        jac_rows = jax.vmap(
            jax.jacrev(lambda t, row: (phi_row(t, row),) * 2, has_aux=True), (None, 0)
        )
        A, phi = jac_rows(theta, rows)  # (n, m, d), (n, m)
    else:
        A, phi = None, jnp.zeros((n, 0), dtype)
    u, v = row_grads(phi, psi, rows)
    rows_grad = v.astype(dtype) @ C if cut.q else jnp.zeros((n, theta.shape[0]), dtype)
    if cut.m:
        rows_grad = rows_grad + jnp.einsum("nm,nmd->nd", u.astype(dtype), A)
    weights = _masked(clip_weights(jnp.linalg.norm(rows_grad, axis=1), clip), mask)
    return exact_sum(weights.astype(dtype)[:, None] * _finite(rows_grad), bound, num_terms,
                     levels)


def _route(pm: PrivateModel, route: str) -> Callable:
    def clipped_sum(theta, clip, model_args, model_kwargs, idx=None, mask=None, levels=1):
        theta = jnp.asarray(theta)
        if idx is not None:  # a minibatch: each device sums the batch's rows it holds
            return minibatch(pm, lambda args, kwargs, positions, weights: rows_sum(
                theta, clip, args, kwargs, positions, weights, levels, None),
                model_args, model_kwargs, idx, mask)
        # Every row, padding weighted 0 and left out of n, each device summing its own.
        return full_data(pm, lambda args, kwargs, row_mask: rows_sum(
            theta, clip, args, kwargs, None, row_mask, levels, pm.num_rows),
            model_args, model_kwargs)

    def rows_sum(theta, clip, model_args, model_kwargs, idx, mask, levels, num_terms):
        plan = _plan(pm, theta.shape, theta.dtype, model_args, model_kwargs, route)
        _check_forced(plan, route)

        def general():
            args = (theta, clip, model_args, model_kwargs, idx, mask, levels, num_terms)
            if plan.indexed is None:
                return _jacobian_sum(pm, None, *args)
            try:
                return _jacobian_sum(pm, plan, *args)
            except Exception:  # noqa: BLE001 - a tracing failure (shapes only): dense rows
                return _jacobian_sum(pm, None, *args)

        if plan.choice.route == "jacobian":
            return general()
        rows = [jnp.asarray(x) for x in pm.one_row_loglik(model_args, model_kwargs)[1]]
        if idx is not None:
            rows = [x[idx] for x in rows]
        if route == "linear_predictor":
            return _linear_predictor_sum(plan, theta, clip, rows, mask, levels, num_terms)
        try:
            return _linear_predictor_sum(plan, theta, clip, rows, mask, levels, num_terms)
        except Exception:  # noqa: BLE001 - a tracing failure (shapes only): general route
            return general()

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
    taken = route
    if model_args is not None or model_kwargs is not None:
        taken = select_route(pm, model_args or (), model_kwargs, route).route
    return _route(pm, route), taken


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


def _row_blocks(fn: Callable, rows: list, block: int) -> jax.Array:
    """``fn`` (one value per row) over the rows in blocks of at most ``block`` rows."""
    return jnp.concatenate([out.reshape(-1) for out in _map_blocks(fn, rows, block)])


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
    (:mod:`numpyro_dp.tuning`); padded rows' values are meaningless (mask them
    with ``pm.row_mask()``).
    """
    return full_data(pm, lambda args, kwargs, _: _row_scales(
        pm, theta, args, kwargs, directions, whiten), model_args, model_kwargs, out_rows=True)


def _row_scales(pm, theta, model_args, model_kwargs, directions, whiten):
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
    score_room: jax.Array | None = None,
    expected: bool = False,
):
    """``sum_i clip_C(grad l_i)`` and ``sum_i clip_K(hess l_i)`` (flattened) at ``theta``.

    Each row's gradient is clipped to l2 norm ``C`` and its Hessian to
    Frobenius norm ``K``; with ``whiten`` a matrix ``L``, the row's gradient
    and Hessian in the coordinates ``theta = L phi`` (``L^T g``,
    ``L^T H L``) are clipped and summed instead.  With ``score_room`` a vector
    ``r`` (entries at least 1), the gradient's coordinates are divided by ``r``
    before the clip (the caller multiplies the released sum back, and its noise
    with it): a coordinate whose rows' scores have a long tail gets ``r`` times
    the clip's reach.  Both sums are
    :func:`~numpyro_dp.primitives.rounding.exact_sum` pairs of rows bounded by
    ``vector_clip_bound(C, d)`` and ``vector_clip_bound(K, d^2)``, so one row
    moves the first by ``C`` and the second by ``K`` (add/remove).  With
    ``hessian_clip=None`` no Hessian is computed and its sum is zeros; with
    ``expected``, each row's expected Hessian is summed instead of its observed
    one (:meth:`~numpyro_dp.model.adapter.PrivateModel.one_row_loglik`).
    Private values: for the private warm start's releases only.  Padded rows
    count 0, and the sums run where the rows live (:func:`full_data`).
    """
    return full_data(pm, lambda args, kwargs, mask: _grad_and_hessian_sums(
        pm, theta, clip, hessian_clip, args, kwargs, levels, whiten, score_room, expected,
        mask), model_args, model_kwargs)


def _grad_and_hessian_sums(pm, theta, clip, hessian_clip, model_args, model_kwargs, levels,
                           whiten, score_room, expected, mask):
    loglik, rows = pm.one_row_loglik(model_args, model_kwargs)
    curvature = pm.one_row_loglik(model_args, model_kwargs, True)[0] if expected else loglik
    rows = [jnp.asarray(x) for x in rows]
    n, d, dtype = pm.num_rows, theta.shape[0], theta.dtype
    if mask is None:
        mask = jnp.ones(rows[0].shape[0], bool)
    bound = vector_clip_bound(clip, d, dtype)
    with_hessian = hessian_clip is not None
    hess_bound = vector_clip_bound(hessian_clip, d * d, dtype) if with_hessian else None

    def block_sums(block):
        *block_rows, block_mask = block

        def clipped(values, limit):
            weights = _masked(clip_weights(jnp.linalg.norm(values, axis=1), limit), block_mask)
            return weights.astype(dtype)[:, None] * _finite(values)

        jac = jax.vmap(jax.grad(loglik), (None, 0))(theta, block_rows)
        if whiten is not None:
            jac = jac @ whiten
        if score_room is not None:
            jac = jac / score_room
        grad_sum = exact_sum(clipped(jac, clip), bound, n, levels)
        if not with_hessian:
            zeros = jnp.zeros(d * d, dtype)
            return grad_sum, (zeros, zeros)
        hess = jax.vmap(jax.hessian(curvature), (None, 0))(theta, block_rows)
        if whiten is not None:
            hess = jnp.einsum("ji,njk,kl->nil", whiten, hess, whiten)
        hess = clipped(hess.reshape(hess.shape[0], d * d), hessian_clip)
        return grad_sum, exact_sum(hess, hess_bound, n, levels)

    return _summed_blocks(block_sums, rows + [mask], HESSIAN_BLOCK)


def row_hessian_norms(
    pm: PrivateModel, theta: jax.Array, model_args: tuple, model_kwargs: dict,
    whiten: jax.Array | None = None,
    expected: bool = False,
) -> jax.Array:
    """``||hess l_i(theta)||_F`` per row, or ``||L^T hess l_i L||_F`` with ``whiten``
    a matrix ``L`` (private: for a DP quantile only; padded rows as in
    :func:`row_gradient_scales`); with ``expected``, of the row's expected Hessian."""
    return full_data(pm, lambda args, kwargs, _: _row_hessian_norms(
        pm, theta, args, kwargs, whiten, expected), model_args, model_kwargs, out_rows=True)


def _row_hessian_norms(pm, theta, model_args, model_kwargs, whiten, expected):
    loglik, rows = pm.one_row_loglik(model_args, model_kwargs, expected)

    def block_norms(block_rows):
        hess = jax.vmap(jax.hessian(loglik), (None, 0))(theta, block_rows)
        if whiten is not None:
            hess = jnp.einsum("ji,njk,kl->nil", whiten, hess, whiten)
        return jnp.linalg.norm(hess.reshape(hess.shape[0], -1), axis=1)

    return _row_blocks(block_norms, [jnp.asarray(x) for x in rows], HESSIAN_BLOCK)
