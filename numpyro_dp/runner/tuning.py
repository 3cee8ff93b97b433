"""Private tuning before sampling: its releases planned, charged and run.

A chain started from the prior on a real data set sits where it started: at
an ordinary budget the noise caps every step far below the distance to the
posterior.  :class:`~numpyro_dp.PrivateMCMC` therefore spends a small,
stated share of the budget, before the sampler, on

* **clip selection** (:mod:`~numpyro_dp.runner.clip_selection`) -- a DP quantile
  of per-row gradient scales from one noisy histogram per scale kind; a clip the
  user states is public and costs nothing;
* **a warm start** (:mod:`~numpyro_dp.runner.warm_start`) -- noisy Fisher scoring
  steps on the log posterior from the prior's median, in two stages, each
  choosing its clips by histograms.

This module plans those releases from public facts (:func:`plan_tuning`: a
:class:`TuningPlan`, their noise and ledger entries) and runs them
(:func:`run_tuning`: a :class:`TuningResult`, the clips and the start).

Every release is declared here as a :class:`dp_accounting.DpEvent` and
charged to the runner's ledger under its own phase before it is computed.
The shares: ``warm_start`` and ``clip_selection`` are fractions of the
runner's epsilon; the tuning releases are Gaussian, so together they are one
Gaussian mechanism with ``mu^2 = sum 1 / z_i^2``, calibrated to spend
``(warm_start + clip_selection) * epsilon`` at the runner's delta and split
between the two phases in proportion to their shares (``mu^2`` is additive).
The sampler is then calibrated to what is left.
"""

from __future__ import annotations

import dataclasses
import math

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_dp.accounting import calibrate_gaussian, sensitivity_factor
from numpyro_dp.kernels.base import ClipRequest
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.runner.clip_selection import (
    clip_rows_above,
    histogram_quantile,
    histogram_sensitivity,
    scale_histogram,
)
from numpyro_dp.runner.warm_start import (
    ADAPT_CODES,
    FOLLOWING_WARM_START_STEPS,
    HESSIAN_SHARE,
    TYPICAL_CLIPS,
    WARM_START_QUANTILE,
    WARM_START_STAGE_SHARES,
    WARM_START_STAGES,
    WARM_START_STEPS,
    follows_curvature,
    prior_point,
    warm_start_fn,
)

#: Default shares of the runner's epsilon (``PrivateMCMC(warm_start=, clip_selection=)``).
WARM_START_SHARE = 0.3
CLIP_SELECTION_SHARE = 0.05
#: A warm start is made only when ``n / (Delta_factor z)``, the best signal-to-noise
#: ratio of its released gradient sums (every row's clipped gradient aligned,
#: against the noise), reaches this: below it the steps would follow the noise.
#: Its share then goes to sampling.
WARM_START_MIN_SNR = 10.0


@dataclasses.dataclass(frozen=True)
class TuningPlan:
    """The tuning releases of a run, from public facts only.

    Attributes
    ----------
    warm_start_steps : int
        Steps of the warm start (0: none), two releases each.
    warm_start_clip : float or None
        The clip of those releases when known in advance (a stated clip).
    select_start_clip : bool
        Whether histograms choose the warm start's gradient clip (its
        Hessian clip is always chosen so, at the start of each stage).
    requests : tuple of ClipRequest
        Clips the kernel needs chosen (one histogram per scale kind).
    warm_start_noise : tuple of (float, float)
        ``z`` of each warm-start stage's gradient and Hessian releases.
    noise_multiplier_histogram : float
        ``z`` of each histogram.
    follow_curvature : tuple of str or None
        How each warm-start stage follows the curvature its last step released:
        whitened by it (``"full"``), rescaled by its diagonal (``"diagonal"``) or not
        (None; :func:`~numpyro_dp.runner.warm_start.follows_curvature`); a final
        stage that follows it releases it at every step, not once.
    """

    warm_start_steps: int
    warm_start_clip: float | None
    select_start_clip: bool
    requests: tuple[ClipRequest, ...]
    warm_start_noise: tuple[tuple[float, float], ...]
    noise_multiplier_histogram: float | None
    follow_curvature: tuple[str | None, ...] = ()

    @property
    def num_histograms(self) -> int:
        # Each warm-start stage chooses its Hessian clip (and its gradient clip
        # unless one is stated); the kernel's clips need one per scale kind.
        per_stage = (1 + int(self.select_start_clip)) if self.warm_start_steps else 0
        return WARM_START_STAGES * per_stage + len({r.scale for r in self.requests})

    def entries(self) -> list[tuple[str, dpa.DpEvent, int]]:
        """``(phase, per-release event, releases)`` of each phase, in the order run."""
        out = []
        if self.num_histograms:
            out.append(("clip selection", dpa.GaussianDpEvent(self.noise_multiplier_histogram),
                        self.num_histograms))
        if self.warm_start_noise:  # one ledger entry: each stage's gradient and Hessian releases
            out.append(("warm start", dpa.ComposedDpEvent([
                dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), k)
                for stage, (z_grad, z_hess) in enumerate(self.warm_start_noise)
                for z, k in ((z_grad, self.stage_steps), (z_hess, self.hessian_releases(stage)))
            ]), 1))
        return out

    @property
    def stage_steps(self) -> int:
        """Newton steps (gradient releases) of each warm-start stage."""
        return self.warm_start_steps // WARM_START_STAGES

    def hessian_releases(self, stage: int) -> int:
        """Hessian releases of a warm-start stage: one a step, one in a final stage
        that does not follow the curvature."""
        final = stage == WARM_START_STAGES - 1
        return 1 if final and not self.follow_curvature[stage] else self.stage_steps

    def event(self) -> dpa.DpEvent:
        return dpa.ComposedDpEvent(
            [dpa.SelfComposedDpEvent(e, k) for _, e, k in self.entries()]
        )


def plan_tuning(
    epsilon: float,
    delta: float,
    *,
    warm_start: float,
    clip_selection: float,
    requests: tuple[ClipRequest, ...],
    warm_start_clip: float | None,
    warm_start_steps: int | None = None,
    num_rows: int | None = None,
    num_params: int | None = None,
    neighbourhood: str = "substitute",
    noise_scale: bool = False,
) -> TuningPlan | None:
    """Noise of the tuning releases for shares of ``epsilon`` (None: nothing to tune).

    With ``num_rows``, a warm start whose gradients the noise would swamp
    (:data:`WARM_START_MIN_SNR`) is dropped and its share left to sampling; with
    ``num_params`` too, its stages follow the curvature where its noise allows and the
    likelihood reads a noise scale (``noise_scale``,
    :func:`~numpyro_dp.runner.warm_start.follows_curvature`).  ``warm_start_steps=None``:
    :data:`~numpyro_dp.runner.warm_start.FOLLOWING_WARM_START_STEPS` where the first stage
    follows the curvature, :data:`~numpyro_dp.runner.warm_start.WARM_START_STEPS` elsewhere.
    """
    size = (num_rows, num_params, sensitivity_factor(neighbourhood), noise_scale)
    if warm_start_steps is None:
        plan = _plan_tuning(epsilon, delta, warm_start, clip_selection, requests,
                            warm_start_clip, FOLLOWING_WARM_START_STEPS, size)
        following = plan is not None and bool(plan.follow_curvature
                                               and plan.follow_curvature[0])
        warm_start_steps = FOLLOWING_WARM_START_STEPS if following else WARM_START_STEPS
    plan = _plan_tuning(epsilon, delta, warm_start, clip_selection, requests,
                        warm_start_clip, warm_start_steps, size)
    # The first stage, which must find its way from the prior, is the noisiest.
    if (plan is not None and plan.warm_start_steps and num_rows is not None
            and num_rows / (sensitivity_factor(neighbourhood) * plan.warm_start_noise[0][0])
            < WARM_START_MIN_SNR):
        plan = _plan_tuning(epsilon, delta, 0.0, clip_selection, requests, warm_start_clip,
                            warm_start_steps, size)
    return plan


def _plan_tuning(epsilon, delta, warm_start, clip_selection, requests, warm_start_clip,
                 warm_start_steps, size):
    steps = warm_start_steps if warm_start > 0 else 0
    select_start = bool(steps) and warm_start_clip is None
    plan = TuningPlan(steps, warm_start_clip, select_start, tuple(requests), (), None)
    if not plan.entries():
        return None
    if plan.num_histograms and clip_selection <= 0:
        names = ", ".join(sorted({r.name for r in requests} | (
            {"a gradient clip for the warm start"} if select_start else set())))
        raise ValueError(
            f"clip_selection=0 but the run needs {names} chosen privately: state the "
            "clip(s) on the kernel (public bounds cost nothing) or give clip_selection "
            "a share of the budget."
        )
    shares = (clip_selection if plan.num_histograms else 0.0) + (warm_start if steps else 0.0)
    # One Gaussian mechanism spending the tuning's share: mu^2 is additive.
    z_all = calibrate_gaussian(shares * epsilon, delta)
    mu2 = 1.0 / z_all**2
    # Round up (1 + 1e-9): the parts may not exceed the whole.
    z_hist = None
    if plan.num_histograms:
        z_hist = math.sqrt(plan.num_histograms / (mu2 * clip_selection / shares)) * (1 + 1e-9)
    noise = ()
    if steps:
        mu2_warm = mu2 * warm_start / shares

        def z(releases, share):
            return math.sqrt(releases / (mu2_warm * share)) * (1 + 1e-9)

        # A stated clip is in the model's own coordinates: they stay.
        follow = tuple(follows_curvature(
            z(plan.stage_steps, share * HESSIAN_SHARE), *size, first=not stage)
            if select_start else None for stage, share in enumerate(WARM_START_STAGE_SHARES))
        plan = dataclasses.replace(plan, follow_curvature=follow)
        noise = tuple(
            (z(plan.stage_steps, stage_share * (1.0 - HESSIAN_SHARE)),
             z(plan.hessian_releases(stage), stage_share * HESSIAN_SHARE))
            for stage, stage_share in enumerate(WARM_START_STAGE_SHARES)
        )
    return dataclasses.replace(plan, warm_start_noise=noise, noise_multiplier_histogram=z_hist)


@dataclasses.dataclass(frozen=True)
class TuningResult:
    """What the tuning released (public: post-processing of charged releases).

    Attributes
    ----------
    clips : dict
        The privately chosen clips, by the kernel's attribute name.
    warm_start_clip : float or None
        The per-row gradient clip of the warm start's final stage (in the
        coordinates whitened by the first stage's Laplace covariance when
        chosen privately; a stated clip is used as it is, in the model's).
    start : dict or None
        The warm start (unconstrained values by site), or None without one.
    dispersion : dict or None
        The chains start at ``start`` plus this (by site) times a standard
        normal: the standard error of the warm start (what the noise leaves
        of it) and the posterior sd of its Laplace approximation, added in
        quadrature: a noise-aware approximation of the posterior.
    covariance : array or None
        The Laplace approximation's covariance over the flattened
        unconstrained parameters (``(d, d)``).
    """

    clips: dict
    warm_start_clip: float | None
    start: dict | None
    dispersion: dict | None
    covariance: np.ndarray | None


def run_tuning(
    plan: TuningPlan,
    pm: PrivateModel,
    *,
    rng_key: jax.Array,
    rows: tuple,
    secret: jax.Array,
    theta0: jax.Array,
    neighbourhood: str,
    temperature: float,
    sampler_noise_multiplier: float | None = None,
) -> TuningResult:
    """Run the releases of ``plan`` (already charged) from ``theta0``
    (:data:`~numpyro_dp.runner.warm_start.PRIOR_MEDIAN`).

    ``sampler_noise_multiplier``, the kernel's calibrated ``z``, caps how many rows
    its privately chosen clips may cut
    (:func:`~numpyro_dp.runner.clip_selection.clip_rows_above`).

    ``rows`` are the private row arrays (:meth:`PrivateModel.private_inputs`),
    arguments of every compiled function here, never constants of one;
    ``secret`` the run secret.  Each release's noise key is a PRF of the secret
    at a public key folded from ``rng_key``.
    """
    keys = iter(random.split(rng_key, 16))
    releases = {}
    dtype = theta0.dtype

    def histogram(theta, scale, whiten=None):
        whiten = jnp.eye(theta0.shape[0], dtype=dtype) if whiten is None else whiten
        if scale not in releases:
            releases[scale] = scale_histogram(pm, scale, neighbourhood)
        return np.asarray(releases[scale](
            theta, whiten, jnp.asarray(plan.noise_multiplier_histogram, dtype), next(keys),
            rows, secret))

    def quantile(counts, q, noise_multiplier=None):
        """The ``q`` quantile, cutting no more rows than the release's noise warrants."""
        noise_sd = plan.noise_multiplier_histogram * histogram_sensitivity(neighbourhood)
        cut = None if noise_multiplier is None else clip_rows_above(noise_multiplier,
                                                                    neighbourhood)
        return histogram_quantile(counts, pm.num_rows, q, noise_sd, cut)

    start = dispersion = covariance = None
    clip = plan.warm_start_clip
    theta = theta0
    if plan.warm_start_steps:
        run = warm_start_fn(
            pm, steps=plan.warm_start_steps // WARM_START_STAGES,  # a multiple (PrivateMCMC)
            min_noise_multiplier=min(min(z) for z in plan.warm_start_noise),
            neighbourhood=neighbourhood, temperature=temperature,
        )

        @jit_once
        def warm(theta, clips, hessian_clips, whiten, z_grad, z_hess, refresh, adapt,
                 prior_sd2, key, rows, secret):
            args, kwargs = pm.rebuild(rows)
            return run(theta, clips, hessian_clips, whiten, z_grad, z_hess, refresh, adapt,
                       prior_sd2, key, args, kwargs, secret)

        prior_sd2 = jnp.asarray(prior_point(pm, next(keys), rows)[1], dtype)
        steps = plan.stage_steps
        d, n = theta0.shape[0], pm.num_rows
        typical = (TYPICAL_CLIPS * math.sqrt(d / n), TYPICAL_CLIPS * d / n)
        whiten = jnp.eye(d, dtype=dtype)
        for stage, (z_grad, z_hess) in enumerate(plan.warm_start_noise):
            final = stage == WARM_START_STAGES - 1
            adapt = plan.follow_curvature[stage]
            if stage and plan.select_start_clip:
                whiten = jnp.linalg.cholesky(jnp.asarray(covariance, dtype))
            if plan.select_start_clip:
                # The final stage's fixed point is the start: its clip cuts no
                # more rows than its noise warrants.
                clip = quantile(histogram(theta, "norm", whiten), WARM_START_QUANTILE,
                                z_grad if final else None)
            # So does its Hessian's: a curvature clipped low makes every Newton step
            # too long (on statsmodels' randhie counts the heaviest tenth of the rows
            # carry most of it, and the final stage's iterates swung by 20 posterior
            # sds at epsilon 1e7), and the Laplace covariance too wide.
            hessian_clip = quantile(histogram(theta, "fisher", whiten), WARM_START_QUANTILE,
                                    z_hess if final else None)
            clips = np.full(steps, clip, float)
            hessian_clips = np.full(steps, hessian_clip, float)
            if adapt and stage:  # whitened: a few rows' typical values
                clips = np.maximum(clips, typical[0])
                hessian_clips = np.maximum(hessian_clips, typical[1])
            elif adapt:  # after its first step the first stage is whitened too
                clips[1:], hessian_clips[1:] = typical
            theta, error, covariance = warm(
                theta, jnp.asarray(clips, dtype), jnp.asarray(hessian_clips, dtype), whiten,
                jnp.asarray(z_grad, dtype), jnp.asarray(z_hess, dtype),
                jnp.asarray(plan.hessian_releases(stage) > 1),
                jnp.asarray(ADAPT_CODES[adapt]),
                prior_sd2, next(keys), rows, secret)
            if not bool(jnp.all(jnp.isfinite(theta)) & jnp.all(jnp.isfinite(covariance))):
                raise FloatingPointError(
                    "The private warm start diverged (a non-finite point). Run without it "
                    "(PrivateMCMC(warm_start=0)) or give the model tighter priors."
                )
        start = pm.unravel(theta)
        dispersion = pm.unravel(jnp.sqrt(error**2 + jnp.diag(covariance)))
        covariance = np.asarray(covariance)
    clips = {}
    for scale in dict.fromkeys(r.scale for r in plan.requests):
        counts = histogram(theta, scale)
        for r in plan.requests:
            if r.scale == scale:
                clips[r.name] = quantile(counts, r.quantile, sampler_noise_multiplier)
    return TuningResult(clips, clip, start, dispersion, covariance)
