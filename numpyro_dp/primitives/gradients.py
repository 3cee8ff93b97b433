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
:func:`numpyro_dp.primitives.release.release_clipped_sum`, which charges the grid.

``"jacobian"`` (general)
    The rows of the per-row Jacobian ``J`` (rows x d), i.e. every row's
    gradient, by one backward pass per row (``vmap(grad)`` of one row's
    log-likelihood), in equal blocks of at most
    :data:`~numpyro_dp.primitives.row_blocks.ROW_BLOCK` rows; each block's rows
    are clipped and summed as ``J_B^T w_B``.  Works for every model the
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
    :func:`~numpyro_dp.primitives.route_choice._shared_coordinates`), the two
    parts of a row's gradient lie on disjoint coordinates: the squared norms are
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

Route selection (``"auto"``, a forced route's check):
:mod:`~numpyro_dp.primitives.route_choice`.

Non-finite per-row gradients contribute 0 on every route (see
:func:`~numpyro_dp.primitives.clipping.clip_weights`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives import row_blocks  # its ROW_BLOCK, read when traced
from numpyro_dp.primitives.clipping import (
    clip_weights,
    column_squared_norms,
    finite_or_zero,
    masked_weights,
    row_squared_norms,
    vector_clip_bound,
)
from numpyro_dp.primitives.rounding import exact_segment_sum, exact_sum
from numpyro_dp.primitives.route_choice import (
    ROUTES,
    Plan,
    check_forced_route,
    plan_route,
    select_route,
)
from numpyro_dp.primitives.row_blocks import full_data, minibatch, summed_blocks


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
            norms = jnp.sqrt(column_squared_norms(jac))
            weights = masked_weights(clip_weights(norms, clip), block_mask)
            return exact_sum((weights.astype(jac.dtype) * finite_or_zero(jac)).T, bound, n, levels)
        _, rest, local, where = indexed.row_gradients(theta, block_rows)
        squares = column_squared_norms(rest) + sum(row_squared_norms(v) for v in local)
        weights = masked_weights(clip_weights(jnp.sqrt(squares), clip), block_mask)
        weights = weights.astype(theta.dtype)
        dense = exact_sum((weights * finite_or_zero(rest)).T, bound, n, levels)
        tables = [  # one term per (row, position): a row's vector rounded as a whole
            exact_segment_sum((weights[:, None] * finite_or_zero(v)).reshape(-1, 1), w.reshape(-1),
                              b.size, bound, n, levels)
            for b, v, w in zip(indexed.blocks, local, where, strict=True)
        ]
        return indexed.assemble(dense, [(hi[:, 0], lo[:, 0]) for hi, lo in tables])

    return summed_blocks(lambda block: (block_sum(block),), rows + [mask], row_blocks.ROW_BLOCK)[0]


def _linear_predictor_sum(plan: Plan, theta, clip, rows, mask=None, levels=1, num_terms=None):
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
    span = plan.span  # set by plan_route for the single contraction only
    if span is not None:
        # One value per row, shared values on coordinates S of their own:
        # grad l_i = u_i a_i + C^T v_i, a_i zero on S and C zero off it, so
        # ||grad l_i||^2 = u_i^2 ||a_i||^2 + ||C_S^T v_i||^2 and the clipped sum
        # is one weighted contraction of the a_i plus a sum of q-vectors, never
        # an n x d array of gradients.  a_i comes as the general route's
        # gradients do (Indexed.row_gradients): coordinate-major on the
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
        weights = masked_weights(clip_weights(jnp.sqrt(squares), clip), mask).astype(dtype)
        coef = jnp.where(weights > 0, weights * u, 0.0).astype(dtype)
        # All on one grid (bound and n), each part on coordinates of its own.
        dense = exact_sum((coef * finite_or_zero(a)).T, bound, num_terms, levels)
        tables = [  # one term per (row, position), as on the general route
            exact_segment_sum((coef[:, None] * finite_or_zero(x)).reshape(-1, 1), w.reshape(-1),
                              blk.size, bound, num_terms, levels)
            for blk, x, w in zip(span.blocks, a_local, a_where, strict=True)
        ]
        shared_sum = (where, exact_sum((weights * finite_or_zero(cs)).T, bound, num_terms, levels)
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
    weights = masked_weights(clip_weights(jnp.linalg.norm(rows_grad, axis=1), clip), mask)
    return exact_sum(weights.astype(dtype)[:, None] * finite_or_zero(rows_grad), bound, num_terms,
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
        plan = plan_route(pm, theta.shape, theta.dtype, model_args, model_kwargs, route)
        check_forced_route(plan, route)

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
