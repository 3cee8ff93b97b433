"""Private tuning before sampling: clip selection and a warm start (SPEC s11).

A chain started from the prior on a real data set sits where it started: at
an ordinary budget the noise caps every step far below the distance to the
posterior.  :class:`~numpyro_dp.PrivateMCMC` therefore spends a small,
stated share of the budget, before the sampler, on

* **clip selection** -- a DP quantile of per-row gradient scales: one release
  of the histogram of the rows' scales over the public grid
  :data:`SCALE_GRID` (powers of two), with Gaussian noise.  One row moves
  one count by 1 (add/remove) or two counts by 1 (substitute), so the
  l2-sensitivity is 1 or sqrt(2); every quantile is post-processing of one
  release.  A clip the user states is public and costs nothing;
* **a warm start** -- noisy Newton steps on the log posterior from a prior
  draw: each step releases the clipped per-row gradient sum (exactly the
  release of a DP-HMC gradient) and the sum of the rows' Hessians, each
  clipped to Frobenius norm ``C^2``, both with Gaussian noise, and takes a
  Newton step on them plus the public prior's terms.  The average of the
  second half of the iterates is the start; the chains start around it,
  dispersed by the iterates' spread (post-processing).  (SPEC s11 describes
  noisy gradient descent: on real, ill-conditioned data it needs hundreds of
  paid steps to get near the mode, measured in ``benchmarks/``; scoring needs
  a few.)

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
import functools
import math
from collections.abc import Callable

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from numpyro_dp.accounting import calibrate_noise_multiplier, sensitivity_factor
from numpyro_dp.gradients import (
    clipped_grad_and_hessian_sums,
    row_gradient_scales,
    row_hessian_norms,
    vector_clip_bound,
)
from numpyro_dp.kernels.base import ClipRequest, release_clipped_sum
from numpyro_dp.model import PrivateModel
from numpyro_dp.rounding import grid_quantum, grid_release, grid_sensitivity, sum_levels
from numpyro_dp.secret import noise_key

#: Edges of the histogram of per-row scales: 2^-16 ... 2^24, a factor of
#: sqrt(2) apart (the clip's noise grows with it, its bias where it cuts rows).
SCALE_GRID = 2.0 ** (np.arange(-32, 49) / 2)
#: Default shares of the runner's epsilon (``PrivateMCMC(warm_start=, clip_selection=)``).
WARM_START_SHARE = 0.3
CLIP_SELECTION_SHARE = 0.05
#: Noisy Newton steps of the warm start (two releases each).
WARM_START_STEPS = 10
#: The warm start's stages: its clips are chosen afresh at the start of each
#: (a clip chosen at a prior draw far from the mode is far too loose there).
WARM_START_STAGES = 2
#: Quantile of the per-row gradient norms at the prior draw that clips the
#: warm start's gradients.  Not the median of DP-SGD (Andrew et al. 2021): the
#: warm start must reach the mode, and a clip that cuts many rows moves the
#: point where the clipped gradients balance (on statsmodels' ``fair``, 9
#: posterior sds at the 30% quantile of the mode's norms, none at the 99%).
WARM_START_QUANTILE = 0.9
#: Random public directions over which a row's LLR scale per unit step is
#: taken (its largest directional derivative): what a random-walk step sees.
NUM_DIRECTIONS = 8
#: Longest warm-start step, in prior standard deviations (the public prior's
#: curvature; unbounded along a flat prior): post-processing that keeps a noisy
#: step from throwing the iterate into the prior's tails.
MAX_WARM_START_STEP = 2.0
#: A warm start is made only when ``n / (Delta_factor z)``, the best signal-to-noise
#: ratio of its released gradient sums (every row's clipped gradient aligned,
#: against the noise), reaches this: below it the steps would follow the noise.
#: Its share then goes to sampling.
WARM_START_MIN_SNR = 10.0
#: Longest warm-start step along a coordinate with a flat (improper) prior, in
#: unconstrained units.
MAX_FLAT_STEP = 10.0
#: The released curvature's eigenvalues are raised to this many times
#: ``sigma_F sqrt(d)`` (about half the noise matrix's spectral norm).
CURVATURE_FLOOR = 1.0


def histogram_sensitivity(neighbourhood: str) -> float:
    """l2-sensitivity of a histogram of one value per row."""
    return math.sqrt(2.0) if neighbourhood == "substitute" else 1.0


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
    noise_multiplier_grad, noise_multiplier_histogram : float
        ``z`` of each warm-start release and of each histogram.
    """

    warm_start_steps: int
    warm_start_clip: float | None
    select_start_clip: bool
    requests: tuple[ClipRequest, ...]
    noise_multiplier_grad: float | None
    noise_multiplier_histogram: float | None

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
        if self.warm_start_steps:  # a gradient and a Hessian release per step
            out.append(("warm start", dpa.GaussianDpEvent(self.noise_multiplier_grad),
                        2 * self.warm_start_steps))
        return out

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
    warm_start_steps: int = WARM_START_STEPS,
    num_rows: int | None = None,
    neighbourhood: str = "substitute",
) -> TuningPlan | None:
    """Noise of the tuning releases for shares of ``epsilon`` (None: nothing to tune).

    With ``num_rows``, a warm start whose gradients the noise would swamp
    (:data:`WARM_START_MIN_SNR`) is dropped and its share left to sampling.
    """
    plan = _plan_tuning(epsilon, delta, warm_start, clip_selection, requests,
                        warm_start_clip, warm_start_steps)
    if (plan is not None and plan.warm_start_steps and num_rows is not None
            and num_rows / (sensitivity_factor(neighbourhood) * plan.noise_multiplier_grad)
            < WARM_START_MIN_SNR):
        plan = _plan_tuning(epsilon, delta, 0.0, clip_selection, requests, warm_start_clip,
                            warm_start_steps)
    return plan


def _plan_tuning(epsilon, delta, warm_start, clip_selection, requests, warm_start_clip,
                 warm_start_steps):
    steps = warm_start_steps if warm_start > 0 else 0
    select_start = bool(steps) and warm_start_clip is None
    plan = TuningPlan(steps, warm_start_clip, select_start, tuple(requests), None, None)
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
    z_all = calibrate_noise_multiplier(dpa.GaussianDpEvent, shares * epsilon, delta)
    mu2 = 1.0 / z_all**2
    z_hist = z_grad = None
    if plan.num_histograms:
        z_hist = math.sqrt(plan.num_histograms / (mu2 * clip_selection / shares))
    if steps:
        z_grad = math.sqrt(2 * steps / (mu2 * warm_start / shares))
    # Round up: the parts may not exceed the whole.
    z_hist = None if z_hist is None else z_hist * (1 + 1e-9)
    z_grad = None if z_grad is None else z_grad * (1 + 1e-9)
    return dataclasses.replace(
        plan, noise_multiplier_grad=z_grad, noise_multiplier_histogram=z_hist
    )


# ----------------------------------------------------------------- releases
def release_histogram(
    key: jax.Array, values: jax.Array, noise_multiplier: float, neighbourhood: str
) -> jax.Array:
    """Counts of ``values`` in the bins of :data:`SCALE_GRID`, plus Gaussian noise.

    Bin ``k`` holds the values in ``(edge[k-1], edge[k]]``; the last bin the
    values above the last edge and the non-finite ones.  Counts are exact
    integers; the noise is added on the grid of
    :func:`~numpyro_dp.rounding.grid_release`, whose rounding is charged in
    the sensitivity.
    """
    edges = jnp.asarray(SCALE_GRID, values.dtype)
    idx = jnp.where(jnp.isfinite(values), jnp.searchsorted(edges, values), edges.size)
    counts = jnp.zeros(edges.size + 1, values.dtype).at[idx].add(1.0)
    dim = edges.size + 1
    sigma0 = noise_multiplier * histogram_sensitivity(neighbourhood)
    quantum = grid_quantum(values.shape[0], sigma0, values.dtype)
    sensitivity = histogram_sensitivity(neighbourhood) + grid_sensitivity(quantum, dim)
    return grid_release(key, counts, jnp.zeros_like(counts), noise_multiplier * sensitivity,
                        quantum)


def histogram_quantile(counts: np.ndarray, num_rows: int, quantile: float) -> float:
    """Smallest grid edge that the noisy counts put at least ``quantile`` of the rows under.

    Post-processing of a released histogram: the noisy counts of the bins above
    each edge are summed from the top and made monotone.
    """
    counts = np.asarray(counts, float)
    # above[k]: noisy number of rows above edge k, made non-increasing in k
    # (upwards, so that noise can only raise the clip).
    above = np.cumsum(counts[::-1])[: SCALE_GRID.size][::-1]
    above = np.maximum.accumulate(above[::-1])[::-1]
    ok = np.nonzero(above <= (1.0 - quantile) * num_rows)[0]
    return float(SCALE_GRID[ok[0]] if ok.size else SCALE_GRID[-1])


def warm_start_fn(
    pm: PrivateModel,
    *,
    steps: int,
    noise_multiplier: float,
    neighbourhood: str,
    temperature: float,
) -> Callable:
    """``run(theta0, C, K, key, model_args, model_kwargs, secret) -> (start, spread, cov)``.

    Noisy Newton steps: each step releases the clipped gradient sum
    ``sum_i clip_C(grad l_i)`` and the clipped Hessian sum
    ``sum_i clip_K(hess l_i)`` (Frobenius norm; sensitivities ``C`` and
    ``K`` times the neighbourhood's factor, noise multiplier ``z`` each) and
    moves by ``(-T H + P)^-1 (T g + grad log p)``, with ``H`` the released
    Hessian sum (symmetrised, the eigenvalues of ``-T H + P`` raised to
    :data:`CURVATURE_FLOOR` times the noise's scale), ``P`` the public prior's
    negative Hessian, each step at most :data:`MAX_WARM_START_STEP` prior sds
    long.  Gradient descent alone needs hundreds of steps on a real,
    ill-conditioned problem, each paid for, and the empirical Fisher
    information (outer products of gradients) is hundreds of times the
    curvature where a scale parameter starts too small; Newton steps reach
    the mode in a few.  ``start`` is the mean of the second half of the
    iterates (their noise averages out), ``spread`` their standard deviation
    per coordinate, ``cov`` the mean of their ``(-T H + P)^-1``: a Laplace
    approximation of the posterior covariance, which the kernels take as their
    initial mass matrix or proposal covariance.
    """
    factor = sensitivity_factor(neighbourhood)

    def run(theta0, clip, hessian_clip, key, model_args, model_kwargs, secret):
        dim = theta0.shape[0]
        dtype = theta0.dtype
        levels = sum_levels(noise_multiplier * factor, dtype)
        bound = vector_clip_bound(clip, dim, dtype)

        def prior(theta):
            return pm.log_density_terms(pm.unravel(theta), model_args, model_kwargs).prior

        def step(theta, k):
            key_g, key_h = random.split(random.fold_in(key, k))
            total_g, total_h = clipped_grad_and_hessian_sums(
                pm, theta, clip, hessian_clip, model_args, model_kwargs, levels)
            grad, _ = release_clipped_sum(
                noise_key(secret, key_g), total_g, pm.num_rows, bound,
                noise_multiplier=noise_multiplier, sensitivity_factor=factor,
            )
            hessian, sigma_h = release_clipped_sum(
                noise_key(secret, key_h), total_h, pm.num_rows,
                vector_clip_bound(hessian_clip, dim * dim, dtype),
                noise_multiplier=noise_multiplier, sensitivity_factor=factor,
            )
            hessian = hessian.reshape(dim, dim)
            hessian = jnp.where(jnp.isfinite(hessian), hessian, 0.0)
            prior_precision = -jax.hessian(prior)(theta)
            precision = -temperature * 0.5 * (hessian + hessian.T) + prior_precision
            values, vectors = jnp.linalg.eigh(precision)
            floor = CURVATURE_FLOOR * temperature * sigma_h * jnp.sqrt(dim) + 1e-12
            values = jnp.maximum(values, floor)
            g = temperature * grad + jax.grad(prior)(theta)
            covariance = (vectors / values) @ vectors.T
            move = covariance @ g
            move = jnp.where(jnp.isfinite(move), move, 0.0)
            # Step length in prior standard deviations, and in unconstrained
            # units along flat priors.
            prior_sd2 = 1.0 / jnp.maximum(jnp.diag(prior_precision), 0.0)
            length = jnp.sqrt(jnp.sum(move**2 / prior_sd2))
            flat = jnp.sqrt(jnp.sum(jnp.where(jnp.isinf(prior_sd2), move**2, 0.0)))
            shrink = jnp.minimum(MAX_WARM_START_STEP / jnp.maximum(length, 1e-30),
                                 MAX_FLAT_STEP / jnp.maximum(flat, 1e-30))
            move = move * jnp.minimum(1.0, shrink)
            theta = theta + move.astype(dtype)
            return theta, (theta, covariance.astype(dtype))

        _, (path, covariances) = lax.scan(step, theta0, jnp.arange(steps))
        tail = path[steps // 2:]
        return tail.mean(0), tail.std(0), covariances[steps // 2:].mean(0)

    return run


def gradient_scales(pm: PrivateModel, scale: str, theta, key, model_args, model_kwargs):
    """One private value per row: the ``scale`` of :class:`ClipRequest` (or
    ``"hessian"``: the Frobenius norm of the row's Hessian) at ``theta``."""
    dim = theta.shape[0]
    if scale == "hessian":
        return row_hessian_norms(pm, theta, model_args, model_kwargs)
    directions = None
    if scale == "coordinate":
        directions = jnp.eye(dim, dtype=theta.dtype)
    elif scale == "directional":
        u = random.normal(key, (NUM_DIRECTIONS, dim), theta.dtype)
        directions = u / jnp.linalg.norm(u, axis=1, keepdims=True)
    return row_gradient_scales(pm, theta, model_args, model_kwargs, directions)


@dataclasses.dataclass(frozen=True)
class TuningResult:
    """What the tuning released (public: post-processing of charged releases).

    Attributes
    ----------
    clips : dict
        The privately chosen clips, by the kernel's attribute name.
    warm_start_clip : float or None
        The per-row gradient clip of the warm start.
    start : dict or None
        The warm start (unconstrained values by site), or None without one.
    dispersion : dict or None
        The chains start at ``start`` plus this (by site) times a standard
        normal: the spread of the warm start's second-half iterates and the
        posterior sd of its Laplace approximation, added in quadrature.
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
) -> TuningResult:
    """Run the releases of ``plan`` (already charged) from the prior draw ``theta0``.

    ``rows`` are the private row arrays (:meth:`PrivateModel.private_inputs`),
    arguments of every compiled function here, never constants of one;
    ``secret`` the run secret.  Each release's noise key is a PRF of the secret
    at a public key folded from ``rng_key``.
    """
    keys = iter(random.split(rng_key, 16))

    # Compiled once per call (the scale kind is static); rows and secret are arguments.
    @functools.partial(jax.jit, static_argnames="scale")
    def release(theta, key, rows, secret, scale):
        args, kwargs = pm.rebuild(rows)
        values = gradient_scales(pm, scale, theta, key, args, kwargs)
        return release_histogram(noise_key(secret, key), values,
                                 plan.noise_multiplier_histogram, neighbourhood)

    def histogram(theta, scale):
        return np.asarray(release(theta, next(keys), rows, secret, scale=scale))

    def quantile(theta, scale):
        return histogram_quantile(histogram(theta, scale), pm.num_rows, WARM_START_QUANTILE)

    start = dispersion = covariance = None
    clip = plan.warm_start_clip
    theta = theta0
    if plan.warm_start_steps:
        run = warm_start_fn(
            pm, steps=plan.warm_start_steps // WARM_START_STAGES,  # a multiple (PrivateMCMC)
            noise_multiplier=plan.noise_multiplier_grad, neighbourhood=neighbourhood,
            temperature=temperature,
        )

        @jax.jit
        def warm(theta, clip, hessian_clip, key, rows, secret):
            args, kwargs = pm.rebuild(rows)
            return run(theta, clip, hessian_clip, key, args, kwargs, secret)

        dtype = theta0.dtype
        for _ in range(WARM_START_STAGES):
            if plan.select_start_clip:
                clip = quantile(theta, "norm")
            hessian_clip = quantile(theta, "hessian")
            theta, spread, covariance = warm(
                theta, jnp.asarray(clip, dtype), jnp.asarray(hessian_clip, dtype), next(keys),
                rows, secret)
            if not bool(jnp.all(jnp.isfinite(theta)) & jnp.all(jnp.isfinite(covariance))):
                raise FloatingPointError(
                    "The private warm start diverged (a non-finite point). Run without it "
                    "(PrivateMCMC(warm_start=0)) or give the model tighter priors."
                )
        start = pm.unravel(theta)
        dispersion = pm.unravel(jnp.sqrt(spread**2 + jnp.diag(covariance)))
        covariance = np.asarray(covariance)
    clips = {}
    for scale in dict.fromkeys(r.scale for r in plan.requests):
        counts = histogram(theta, scale)
        for r in plan.requests:
            if r.scale == scale:
                clips[r.name] = histogram_quantile(counts, pm.num_rows, r.quantile)
    return TuningResult(clips, clip, start, dispersion, covariance)
