"""Private tuning before sampling: clip selection and a warm start.

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
* **a warm start** -- noisy Fisher scoring steps on the log posterior from the
  prior's median (:data:`PRIOR_MEDIAN`), in two stages: each step releases the
  clipped per-row gradient sum (exactly the release of a DP-HMC gradient) and
  the sum of the rows' expected Hessians (the Fisher information), each
  clipped to a Frobenius norm, both with Gaussian noise, and takes a Newton step on them plus the
  public prior's terms (at most :data:`MAX_WARM_START_STEP` of the prior's sds
  at its median).  The expected Hessian, unlike the observed one, stays
  positive definite far from the mode, where a regression's coefficients and
  its noise scale couple.  The second stage works in the coordinates where
  the first stage's Laplace approximation is white, clips so that (almost) no
  row is cut, and releases its Hessian once; where the data are many for the
  budget (:func:`follows_curvature`) each stage instead whitens every step by
  the curvature released at the last, with clips of a few rows' typical
  values there, and takes :data:`FOLLOWING_WARM_START_STEPS`.  The average of
  its last iterates is the start; the chains start around it, dispersed by
  its Laplace covariance and its standard error (post-processing).  (Noisy
  gradient descent, the obvious alternative, needs hundreds of paid steps to
  get near the mode on real, ill-conditioned data, measured in
  ``benchmarks/``; Newton steps need a few.)

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
from collections.abc import Callable

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro.infer import init_to_median

from numpyro_dp.accounting import calibrate_gaussian, sensitivity_factor
from numpyro_dp.kernels.base import ClipRequest
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.primitives.release import release_clipped_sum, release_on_grid
from numpyro_dp.primitives.rounding import (
    sum_levels,
)
from numpyro_dp.primitives.row_statistics import (
    clipped_grad_and_hessian_sums,
    row_gradient_scales,
    row_hessian_norms,
)
from numpyro_dp.primitives.secret import noise_key

#: Edges of the histogram of per-row scales: 2^-16 ... 2^24, a factor of
#: sqrt(2) apart (the clip's noise grows with it, its bias where it cuts rows).
SCALE_GRID = 2.0 ** (np.arange(-32, 49) / 2)
#: Default shares of the runner's epsilon (``PrivateMCMC(warm_start=, clip_selection=)``).
WARM_START_SHARE = 0.3
#: Where the warm start begins, and where :func:`prior_variances` reads the prior's
#: scales: the prior's median, from 1001 draws (public).  Not the kernel's
#: ``init_strategy``, which disperses chains: NumPyro's default, a uniform draw on
#: (-2, 2) in unconstrained units, put a Poisson regression's rates at up to
#: ``e^14`` on COUNT's ``mdvis`` (6 covariates in [-1, 1]), where the rows' curvatures
#: spread over 2^10 and the first stage's clips were meaningless; the warm start's
#: largest error fell from 101 and 13 posterior sds to 18 and 11 at epsilon 1 (seeds 0, 1).
PRIOR_MEDIAN = init_to_median(num_samples=1001)
CLIP_SELECTION_SHARE = 0.05
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
#: Quantile of the per-row gradient norms (and Hessian norms) that clips the
#: warm start (the final stage's gradients and Hessian cut fewer rows where
#: their noise is small: :func:`clip_rows_above`).  Not the median of DP-SGD
#: (Andrew et al. 2021): a clip that cuts many rows moves the point where the
#: clipped gradients balance (on statsmodels' ``fair``, 9 posterior sds at the
#: 30% quantile of the mode's norms, 2.3 at the 90%).
WARM_START_QUANTILE = 0.9


def clip_rows_above(noise_multiplier: float, neighbourhood: str) -> float:
    """How many rows a clip may cut when its release has this noise multiplier.

    A clip ``C`` on a sum of rows adds noise ``z Delta_factor C`` and moves the
    sum by ``sum_i (|g_i| - C)_+`` (the clipped rows' excess); the first grows
    by ``z Delta_factor`` per unit of ``C``, the second shrinks by the number
    of rows above ``C``, so their sum is least where about ``z Delta_factor``
    rows lie above the clip.  Little noise: no row is cut, and the target is
    exact (on statsmodels' ``randhie`` counts, a 95% quantile biased even a
    noiseless run by 40-90 posterior sds); much noise: at most the quantile's
    share.
    """
    return noise_multiplier * sensitivity_factor(neighbourhood)


#: A histogram bin counts as populated when its noisy count is this many noise
#: sds above zero (a bin of pure noise does so with probability 3e-5).
DETECTION_SDS = 4.0
#: Longest run of adjacent bins whose summed count may reveal rows spread too
#: thinly for any one bin to stand out of the noise (:func:`populated_top`): at a
#: prior draw far from the mode a Hessian's row norms spanned 20 bins on COUNT's
#: ``mdvis`` (n = 2,227, epsilon 1), no bin was detected, the clip went to the
#: grid's top (2^24), and the warm start's floored curvature froze it 101 posterior
#: sds from the mode.
DETECTION_RUN = 32
#: Noise sds by which a quantile's count of rows above the clip is read
#: upwards (:func:`histogram_quantile`).
QUANTILE_MARGIN_SDS = 2.0
#: Random public directions over which a row's LLR scale per unit step is
#: taken (its largest directional derivative): what a random-walk step sees.
NUM_DIRECTIONS = 8
#: Longest warm-start step, in prior standard deviations (the public prior's
#: curvature at its median, :func:`prior_variances`; unbounded along a flat prior):
#: post-processing that keeps a noisy step from throwing the iterate into the
#: prior's tails.
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
    warm_start_noise : tuple of (float, float)
        ``z`` of each warm-start stage's gradient and Hessian releases.
    noise_multiplier_histogram : float
        ``z`` of each histogram.
    follow_curvature : tuple of bool
        Whether each warm-start stage whitens every step by the curvature its
        last step released (:func:`follows_curvature`); the final stage then
        releases its curvature at every step, not once.
    """

    warm_start_steps: int
    warm_start_clip: float | None
    select_start_clip: bool
    requests: tuple[ClipRequest, ...]
    warm_start_noise: tuple[tuple[float, float], ...]
    noise_multiplier_histogram: float | None
    follow_curvature: tuple[bool, ...] = ()

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
    likelihood reads a noise scale (``noise_scale``, :func:`follows_curvature`).
    ``warm_start_steps=None``: :data:`FOLLOWING_WARM_START_STEPS` where the first stage
    follows the curvature, :data:`WARM_START_STEPS` elsewhere.
    """
    size = (num_rows, num_params, sensitivity_factor(neighbourhood), noise_scale)
    if warm_start_steps is None:
        plan = _plan_tuning(epsilon, delta, warm_start, clip_selection, requests,
                            warm_start_clip, FOLLOWING_WARM_START_STEPS, size)
        following = plan is not None and plan.follow_curvature[:1] == (True,)
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


def spectral_noise(curvature_sd: float, dim: int) -> float:
    """``2 sigma_H sqrt(d)``: about the spectral norm of a ``d x d`` curvature's
    symmetrised noise of entry sd ``sigma_H``."""
    return 2.0 * curvature_sd * math.sqrt(dim)


def follows_curvature(noise_multiplier: float, num_rows: int | None, num_params: int | None,
                      factor: float, noise_scale: bool) -> bool:
    """Whether a warm-start stage whose Hessian releases have this noise multiplier
    whitens every step by the curvature its last step released (public facts only).

    In coordinates white under the curvature, a clip of :data:`TYPICAL_CLIPS` rows'
    typical values keeps its meaning wherever the steps go (a clip chosen at the
    stage's start does not: as a noise scale shrinks its rows' gradients grow, the
    clip cuts them all, and the steps overshoot).  That needs a likelihood that reads a
    noise scale (``noise_scale``: :attr:`PrivateModel.likelihood_reads_scale`); without
    one the clip of a few typical rows only cuts a heavy tail (on statsmodels'
    ``randhie`` counts, epsilon 10, 3 seeds: the anchor 13-170 posterior sds from the
    release's mode with it, 2-4 without).  And it takes a curvature out of its
    noise at every step: the noise's spectral scale ``2 factor z TYPICAL_CLIPS (d / n)
    sqrt(d)`` at most :data:`FOLLOW_CURVATURE_NOISE` of the whitened curvature (about 1).
    """
    if not (num_rows and num_params and noise_scale):
        return False
    sd = factor * noise_multiplier * TYPICAL_CLIPS * num_params / num_rows
    return spectral_noise(sd, num_params) <= FOLLOW_CURVATURE_NOISE


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
        follow = tuple(select_start and follows_curvature(
            z(plan.stage_steps, share * HESSIAN_SHARE), *size)
            for share in WARM_START_STAGE_SHARES)
        plan = dataclasses.replace(plan, follow_curvature=follow)
        noise = tuple(
            (z(plan.stage_steps, stage_share * (1.0 - HESSIAN_SHARE)),
             z(plan.hessian_releases(stage), stage_share * HESSIAN_SHARE))
            for stage, stage_share in enumerate(WARM_START_STAGE_SHARES)
        )
    return dataclasses.replace(plan, warm_start_noise=noise, noise_multiplier_histogram=z_hist)


# ----------------------------------------------------------------- releases
def release_histogram(
    key: jax.Array, values: jax.Array, noise_multiplier: float, neighbourhood: str,
    mask: jax.Array | None = None, num_rows: int | None = None,
) -> jax.Array:
    """Counts of ``values`` in the bins of :data:`SCALE_GRID`, plus Gaussian noise.

    Bin ``k`` holds the values in ``(edge[k-1], edge[k]]``; the last bin the
    values above the last edge and the non-finite ones.  Rows outside ``mask``
    (padding) are in no bin; ``num_rows`` (default: all values) is the real
    rows' number.  Counts are exact integers; the noise is added on the grid of
    :func:`~numpyro_dp.primitives.release.release_on_grid`, whose rounding is charged in
    the sensitivity.
    """
    edges = jnp.asarray(SCALE_GRID, values.dtype)
    idx = jnp.where(jnp.isfinite(values), jnp.searchsorted(edges, values), edges.size)
    if mask is not None:
        idx = jnp.where(mask, idx, edges.size + 1)  # past the last bin: dropped
    counts = jnp.zeros(edges.size + 1, values.dtype).at[idx].add(1.0, mode="drop")
    dim = edges.size + 1
    sigma0 = noise_multiplier * histogram_sensitivity(neighbourhood)
    n = values.shape[0] if num_rows is None else num_rows
    return release_on_grid(key, counts, jnp.zeros_like(counts), noise_multiplier=noise_multiplier,
                           sensitivity=histogram_sensitivity(neighbourhood), dim=dim,
                           magnitude=n, grid_sigma=sigma0)[0]


def histogram_quantile(
    counts: np.ndarray,
    num_rows: int,
    quantile: float,
    noise_sd: float = 0.0,
    max_rows_above: float | None = None,
) -> float:
    """Smallest grid edge below which the noisy counts put, confidently, ``quantile`` of the rows.

    With ``max_rows_above``, at most that many rows (if fewer than
    ``(1 - quantile) n``) may lie above the edge: :func:`clip_rows_above`.

    Post-processing of a released histogram whose counts carry noise of
    standard deviation ``noise_sd``.  Bins above the highest one the counts
    show to be populated (:func:`populated_top`) are taken as empty: summed,
    their pure noise would make the count above every edge a random walk over
    the grid's empty top (at n in the thousands it pushed a 95% quantile to
    2^20).  An edge qualifies when the noisy count of the rows above it, plus
    :data:`QUANTILE_MARGIN_SDS` standard deviations of that sum's noise, is at
    most ``(1 - quantile) n``: where the counts cannot tell, the clip errs
    upwards (more noise) rather than downwards (clipped rows bias the
    target); the edge above the highest populated bin always qualifies.  No
    bin out of the noise: the grid's top edge.
    """
    counts = np.asarray(counts, float)
    top = populated_top(counts, noise_sd)
    if top is None:
        return float(SCALE_GRID[-1])
    top = min(top, SCALE_GRID.size)  # the last bin holds the rows above the grid
    counts = np.where(np.arange(counts.size) <= top, counts, 0.0)
    # above[k]: noisy number of rows above edge k, summed over bins k+1..top.
    above = np.cumsum(counts[::-1])[: SCALE_GRID.size][::-1]
    summed = np.clip(top - np.arange(SCALE_GRID.size), 0, None)
    upper = above + QUANTILE_MARGIN_SDS * noise_sd * np.sqrt(summed)
    allowed = (1.0 - quantile) * num_rows
    if max_rows_above is not None:
        allowed = min(allowed, max_rows_above)
    ok = np.nonzero((upper <= allowed) | (summed == 0))[0]
    return float(SCALE_GRID[ok[0]] if ok.size else SCALE_GRID[-1])


def populated_top(counts: np.ndarray, noise_sd: float) -> int | None:
    """The highest bin that the noisy counts show to be populated (``None``: none).

    Runs of 1 to :data:`DETECTION_RUN` adjacent bins count as populated when
    their summed count stands :data:`DETECTION_SDS` sds of its noise out.  The top
    starts at the highest single bin that does (where none does, at the end of the
    run that stands out most) and is raised to the end of the shortest such run
    right above it, again and again: rows spread too thinly for any one bin to
    stand out are found where enough of them lie together, a heavy tail above the
    bulk included.  The shortest: a longer run would put the top further above the
    rows it found.  Runs of pure noise above the rows raise it in about 0.2% of
    histograms (1.4% at 3 sds, where one draw in 20 of a test's put a clip 28 times
    too high).
    """
    lengths = np.arange(1, DETECTION_RUN + 1)
    threshold = DETECTION_SDS * noise_sd * np.sqrt(lengths)
    single = np.nonzero(counts >= threshold[0])[0]
    if single.size:
        top = int(single[-1])
    else:  # rows spread thinly: the run that stands out most, if any does
        padded = np.concatenate([counts, np.zeros(DETECTION_RUN - 1)])
        runs = np.cumsum(np.lib.stride_tricks.sliding_window_view(padded, lengths.size), 1)
        score = runs / threshold
        start, length = np.unravel_index(np.argmax(score), score.shape)
        if score[start, length] < 1.0:
            return None
        top = min(int(start + length), counts.size - 1)
    while top + 1 < counts.size:
        runs = np.cumsum(counts[top + 1: top + 1 + DETECTION_RUN])
        found = np.nonzero(runs >= threshold[: runs.size])[0]
        if not found.size:
            break
        top += int(found[0]) + 1
    return top


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
    ``adapt``, after each step ``L`` becomes a factor of that step's Laplace
    covariance, post-processing).  ``C`` and ``K`` hold each step's clips;
    ``refresh`` false releases the Hessian at the first step only, and
    ``prior_sd2`` is :func:`prior_variances`.
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
            theta, whiten, kept_hessian, kept_sigma_h = carry
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
            grad, _ = release(total_g, clip, dim, z_grad, key_g)
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
            covariance = whiten @ ((vectors / values) @ vectors.T) @ whiten.T
            move = whiten @ ((vectors / values) @ (vectors.T @ g))
            move = jnp.where(jnp.isfinite(move), move, 0.0)
            # Step length in prior standard deviations, and in unconstrained
            # units along flat priors.
            length = jnp.sqrt(jnp.sum(move**2 / prior_sd2))
            flat = jnp.sqrt(jnp.sum(jnp.where(jnp.isinf(prior_sd2), move**2, 0.0)))
            shrink = jnp.minimum(MAX_WARM_START_STEP / jnp.maximum(length, 1e-30),
                                 MAX_FLAT_STEP / jnp.maximum(flat, 1e-30))
            move = move * jnp.minimum(1.0, shrink)
            theta = theta + move.astype(dtype)
            # The next step's coordinates: white under this step's Laplace
            # approximation, where the clips stay a few rows' typical values.
            adapted = whiten @ (vectors / jnp.sqrt(values))
            whiten = jnp.where(adapt & jnp.all(jnp.isfinite(adapted)), adapted, whiten)
            return (theta, whiten, *kept), (theta, covariance.astype(dtype))

        zeros = (jnp.zeros(dim * dim, dtype), jnp.zeros((), dtype))
        _, (path, covariances) = lax.scan(
            step, (theta0, whiten, *zeros), (jnp.arange(steps), clips, hessian_clips))
        tail = path[steps // 2:]
        m = tail.shape[0]
        error = tail.std(0, ddof=min(1, m - 1)) / math.sqrt(m)
        return tail.mean(0), error, covariances[steps // 2:].mean(0)

    return run


def prior_variances(pm: PrivateModel, rng_key: jax.Array, rows: tuple) -> np.ndarray:
    """The prior's variance along each unconstrained coordinate, from its curvature at
    the prior's median (``inf`` along a flat prior): the fixed scale of the warm
    start's steps.  Taken at the iterate instead, a noise scale's variance in log
    units grows without bound as the scale shrinks (a half-normal's log density is
    ``-sigma^2 / 2 s^2 + log sigma``), so one noisy step could throw it from 0.2 to
    1e-27 or 1e27.  Public: the prior alone, the rows replaced by zeros."""
    args, kwargs = pm.rebuild(tuple(jnp.zeros_like(r) for r in rows))
    theta = pm.ravel(pm.init_params(rng_key, args, kwargs, PRIOR_MEDIAN))

    def prior(theta):
        return pm.log_density_terms(pm.unravel(theta), args, kwargs).prior

    precision = -np.diag(np.asarray(jax.hessian(prior)(theta), float))
    return np.where(precision > 0, 1.0 / np.maximum(precision, 1e-300), np.inf)


def scale_histogram(pm: PrivateModel, scale: str, neighbourhood: str) -> Callable:
    """The compiled release of the histogram of one private value per row, the
    ``scale`` of :func:`gradient_scales`: ``run(theta, whiten, noise_multiplier, key,
    rows, secret)`` (:func:`release_histogram`; its noise key a PRF of ``secret``
    at ``key``).

    One program per model and scale, compiled once per process (a re-run
    compiles nothing); the rows and the secret are its arguments, never
    constants.  The warm start's and clip selection's histograms and
    :class:`~numpyro_dp.NoiseAwareNUTS`'s are all made here.
    """
    def release(theta, whiten, noise_multiplier, key, rows, secret):
        args, kwargs = pm.rebuild(rows)
        values = gradient_scales(pm, scale, theta, key, args, kwargs, whiten)
        return release_histogram(noise_key(secret, key), values, noise_multiplier,
                                 neighbourhood, pm.row_mask(), pm.num_rows)

    return jit_once(release)


def gradient_scales(pm: PrivateModel, scale: str, theta, key, model_args, model_kwargs,
                    whiten=None):
    """One private value per row: the ``scale`` of :class:`ClipRequest` (or
    ``"hessian"``: the Frobenius norm of the row's Hessian) at ``theta``; the
    ``"norm"`` and ``"hessian"`` in the coordinates ``theta = L phi`` with
    ``whiten`` a matrix ``L``."""
    dim = theta.shape[0]
    if scale in ("hessian", "fisher"):
        return row_hessian_norms(pm, theta, model_args, model_kwargs, whiten,
                                 expected=scale == "fisher")
    if scale == "norm":
        return row_gradient_scales(pm, theta, model_args, model_kwargs, whiten=whiten)
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
    """Run the releases of ``plan`` (already charged) from ``theta0`` (:data:`PRIOR_MEDIAN`).

    ``sampler_noise_multiplier``, the kernel's calibrated ``z``, caps how
    many rows its privately chosen clips may cut (:func:`clip_rows_above`).

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

        prior_sd2 = jnp.asarray(prior_variances(pm, next(keys), rows), dtype)
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
                jnp.asarray(plan.hessian_releases(stage) > 1), jnp.asarray(adapt),
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
