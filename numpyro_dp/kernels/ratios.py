"""Log-likelihood ratios of a proposal and the penalty test on their release.

The pieces the accept/reject kernels share (DPPenalty, DPMinibatchPenalty,
DPHMC, DPMALA, DPBarker): per-row ratios clipped (:func:`clip_ratios`) and
summed exactly (:func:`ratio_sums`, :func:`batch_ratio_sums`), the full-data
release of their sum (:func:`release_llr`), the data-free prior term
(:func:`log_prior`) and the penalty method's accept step (:func:`penalty_test`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import random

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.release import release_clipped_sum
from numpyro_dp.primitives.rounding import exact_sum, sum_levels
from numpyro_dp.primitives.row_blocks import minibatch
from numpyro_dp.primitives.sharding import over_row_shards


def clip_ratios(ratio: jax.Array, clip: jax.Array) -> jax.Array:
    """Per-row log-likelihood ratios clipped to ``[-clip, clip]``.

    A NaN ratio (e.g. a proposal outside a row's support) counts as the worst
    case ``-clip``, so every row's contribution stays bounded by the clip.
    """
    return jnp.clip(jnp.where(jnp.isnan(ratio), -clip, ratio), -clip, clip)


def ratio_sums(ratio: jax.Array, clip, weights: jax.Array | None = None, levels: int = 1):
    """Exact sums of a batch's clipped ratios and of their squares: two ``(hi, lo)`` pairs.

    The ``b`` ratios are clipped (:func:`clip_ratios`) and summed by
    :func:`~numpyro_dp.primitives.rounding.exact_sum` (each rounded to
    ``q1 = row_quantum(clip, b)``, so at most ``clip + q1 / 2``), their squares
    ``fl(r^2)`` likewise on ``row_quantum(clip^2, b)``.  Exact integer sums,
    so the parts of one batch that several devices hold add up to one
    device's sums, bit for bit (:func:`~numpyro_dp.primitives.row_blocks.minibatch`;
    rows of ``weights`` 0 are zeros).  The statistics of the minibatch penalty
    and Barker tests are computed from these (the rounding is charged there).
    """
    r = clip_ratios(ratio, clip)
    if weights is not None:
        r = r * weights.astype(r.dtype)
    b = r.shape[0]
    return exact_sum(r, clip, b, levels), exact_sum(r * r, clip * clip, b, levels)


def batch_ratio_sums(pm: PrivateModel, z: dict, z_new: dict, model_args: tuple,
                     model_kwargs: dict, idx: jax.Array, clip, levels: int = 1):
    """:func:`ratio_sums` of ``l_j(z_new) - l_j(z)`` over the rows ``idx`` of a minibatch,
    computed where the rows live: with the rows on a mesh each device takes the
    batch's rows it holds, and only the sums' integer totals cross devices."""
    theta, theta_new = pm.ravel(z), pm.ravel(z_new)

    def sums(args, kwargs, positions, weights):
        # The points unravelled here, in the per-shard body: values closed over as they
        # are carry the automatic mesh's placement, which the body's operations refuse.
        old = pm.log_density_terms(pm.unravel(theta), args, kwargs, positions=positions)
        new = pm.log_density_terms(pm.unravel(theta_new), args, kwargs, positions=positions)
        return ratio_sums(new.loglik_rows - old.loglik_rows, clip, weights, levels)

    return minibatch(pm, sums, model_args, model_kwargs, idx)


def log_prior(pm: PrivateModel, z: dict, model_args: tuple, model_kwargs: dict) -> jax.Array:
    """``log p(z)`` with its Jacobian: data-free (the rows' terms, unused, are left out of
    the compiled program)."""
    return pm.log_density_terms(z, model_args, model_kwargs).prior


def release_llr(
    key: jax.Array,
    ratio: jax.Array,
    clip: jax.Array,
    *,
    temperature: float,
    noise_multiplier: float,
    sensitivity_factor: float,
    num_terms: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The full-data penalty release ``T (sum_i clip_c(r_i) + N(0, sigma^2))`` and ``T sigma``.

    ``sigma = z * Delta`` with ``Delta`` about ``sensitivity_factor * clip``:
    one row moves the clipped sum by at most that much (plus the rounding that
    :func:`~numpyro_dp.primitives.release.clipped_sum_sensitivity` charges).
    ``clip_ratios`` keeps every term within ``[-clip, clip]``.  ``num_terms`` is
    ``n`` when ``ratio`` holds padded rows (exact zeros,
    :class:`~numpyro_dp.model.layout.RowLayout`); the sum runs where the rows
    live (:func:`~numpyro_dp.primitives.sharding.over_row_shards`).
    """
    levels = sum_levels(noise_multiplier * sensitivity_factor, ratio.dtype)
    n = ratio.shape[0] if num_terms is None else num_terms
    total = over_row_shards(
        lambda rows: exact_sum(clip_ratios(rows[0], clip), clip, n, levels), (ratio,))
    value, sigma = release_clipped_sum(
        key, total, n, clip,
        noise_multiplier=noise_multiplier, sensitivity_factor=sensitivity_factor,
    )
    return temperature * value, temperature * sigma


def penalty_test(
    key: jax.Array, noisy_log_ratio: jax.Array, sigma: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The penalty method's accept step: accept iff ``log u < lambda_hat - sigma^2 / 2``.

    ``noisy_log_ratio`` is the released (noisy) log acceptance ratio and
    ``sigma`` the standard deviation of its noise, symmetric in the two points.
    A non-finite ratio rejects.  Returns the noisy acceptance probability
    ``min(1, exp(lambda_hat - sigma^2 / 2))`` and the decision, both
    post-processing of the release.
    """
    log_accept = noisy_log_ratio - 0.5 * sigma**2
    log_accept = jnp.where(jnp.isfinite(log_accept), log_accept, -jnp.inf)
    accept_prob = jnp.exp(jnp.minimum(log_accept, 0.0))
    accepted = jnp.log(random.uniform(key, (), jnp.result_type(log_accept))) < log_accept
    return accept_prob, accepted

