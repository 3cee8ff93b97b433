"""Per-row statistics of the log-likelihood's gradient and Hessian, for the
private warm start and its clips.

:func:`row_gradient_scales` and :func:`row_hessian_norms` give one private
value per row (for a DP quantile only: :mod:`numpyro_dp.runner.clip_selection`);
:func:`clipped_grad_and_hessian_sums` the sums of the rows' clipped gradients
and Hessians that the private warm start releases.  All run where the rows
live (:func:`~numpyro_dp.primitives.row_blocks.full_data`), in blocks of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives import row_blocks  # its ROW_BLOCK, read when traced
from numpyro_dp.primitives.clipping import (
    clip_weights,
    finite_or_zero,
    masked_weights,
    vector_clip_bound,
)
from numpyro_dp.primitives.rounding import exact_sum
from numpyro_dp.primitives.row_blocks import full_data, map_rows, summed_blocks


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
    (:mod:`numpyro_dp.runner.clip_selection`); padded rows' values are meaningless (mask them
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

    return map_rows(block_scales, [jnp.asarray(x) for x in rows], row_blocks.ROW_BLOCK)


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
    count 0, and the sums run where the rows live
    (:func:`~numpyro_dp.primitives.row_blocks.full_data`).
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
            norms = jnp.linalg.norm(values, axis=1)
            weights = masked_weights(clip_weights(norms, limit), block_mask)
            return weights.astype(dtype)[:, None] * finite_or_zero(values)

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

    return summed_blocks(block_sums, rows + [mask], HESSIAN_BLOCK)


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

    return map_rows(block_norms, [jnp.asarray(x) for x in rows], HESSIAN_BLOCK)
