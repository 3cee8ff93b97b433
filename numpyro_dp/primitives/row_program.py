"""One row's log-likelihood program as a graph, and what each of its values depends on.

The gradient routes (:mod:`~numpyro_dp.primitives.route_choice`) trace one
row's log-likelihood once on *abstract* rows (shapes and dtypes only: no data
value is seen) and read the program as a graph (:class:`Graph`, every nested
jit call inlined): which values depend on theta and on the row, and which are
linear in their theta-dependent inputs (:class:`Analysis`); where a *cut*
separates theta from the output (:meth:`Analysis.cut`); how theta is split
into pieces (:func:`blocks_of_theta`) and which values a piece reaches
(:func:`reached`).  The graph also evaluates any part of the program
(:meth:`Graph.schedule`, :meth:`Graph.evaluate`): that is how the routes
compute the values on either side of a cut.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

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


class NotQualified(Exception):
    """The linear-predictor route does not apply (the message says why)."""


class Eqn(NamedTuple):
    eqn: Any  # the original JaxprEqn (primitive, params, context)
    ins: tuple  # node ids, or ("lit", value)
    outs: tuple  # node ids


class Graph:
    """One row's log-likelihood program with every nested jit call inlined."""

    def __init__(self, closed, n_rows: int):
        self.avals: list = []
        self.consts: dict[int, Any] = {}
        self.eqns: list[Eqn] = []
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
                self.eqns.append(Eqn(eqn, tuple(read(a) for a in eqn.invars), tuple(outs)))
                for o in outs:
                    self.producer[o] = len(self.eqns) - 1
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [as_node(v) for v in jaxpr.outvars]

    # ------------------------------------------------------------ evaluation
    def schedule(self, targets, given) -> list[int]:
        """Indices of the equations computing ``targets`` from ``given`` + constants.

        Raises ``NotQualified`` if that needs any other input of the program
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
                raise NotQualified("the cut does not separate theta from the rows' terms")
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


def aval_size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


class Cut(NamedTuple):
    kind: str  # "linear" or "parameter"
    row: tuple  # node ids of phi (row values, float)
    shared: tuple  # node ids of psi (shared values, float)
    aux: tuple  # shared non-float values (no derivative, as in JAX)
    m: int
    q: int


class Analysis:
    """Dependence and linearity of every value of one row's program."""

    def __init__(self, g: Graph):
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

    def _narrows(self, e: Eqn) -> bool:
        """Whether ``e``, fed by theta only through shared values, makes a row value
        narrower than them (``x . w``, ``a[g]``).  One that does not (a dispersion
        ``c + y``) is better after the cut, with ``c`` a shared value: as a row
        value it would mix ``c``'s coordinate into the row values."""
        shared = [a for a in e.ins if self._t(a)]
        if any(a in self.D for a in shared):
            return True  # already a row value: e continues it
        return sum(aval_size(self.g.avals[a]) for a in shared) > sum(
            aval_size(self.g.avals[o]) for o in e.outs)

    def _t(self, a) -> bool:
        return not isinstance(a, tuple) and a in self.T

    def _stage1_input(self, a) -> bool:
        return not self._t(a) or a not in self.D or a in self.lin

    def _linear(self, e: Eqn) -> bool:
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

    def cut(self, kind: str) -> Cut:
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
                    and aval_size(g.avals[nodes[0]]) <= aval_size(g.avals[node])
                ):
                    cut.discard(node)
                    cut.add(nodes[0])
                    changed = True
        cut = sorted(cut)
        row = tuple(n for n in cut if n in self.D)
        shared = tuple(n for n in cut if n not in self.D and _is_float(g.avals[n]))
        aux = tuple(n for n in cut if n not in self.D and not _is_float(g.avals[n]))
        return Cut(
            kind, row, shared, aux,
            sum(aval_size(g.avals[n]) for n in row), sum(aval_size(g.avals[n]) for n in shared),
        )


def live_consumers(g: Graph, an) -> dict[int, list[int]]:
    """Node -> the live equations that read it."""
    out: dict[int, list[int]] = {}
    for k in an.live:
        for a in g.eqns[k].ins:
            if not isinstance(a, tuple):
                out.setdefault(a, []).append(k)
    return out


def reached(g: Graph, an, node: int) -> set[int]:
    """The values of one row's program that ``node`` reaches (itself included)."""
    seen = {node}
    for k in an.live:
        if any(not isinstance(a, tuple) and a in seen for a in g.eqns[k].ins):
            seen.update(g.eqns[k].outs)
    return seen


def blocks_of_theta(g: Graph, consumers: dict) -> list[tuple[int, int, int]] | None:
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
