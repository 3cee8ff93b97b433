"""Private clip selection: DP quantiles of per-row scales from noisy histograms.

A clip is a DP quantile of the rows' scales (gradient norms, directional
derivatives, Hessian norms: :func:`gradient_scales`): one release of the histogram of
the rows' scales over the public grid :data:`SCALE_GRID` (powers of two), with
Gaussian noise (:func:`release_histogram`).  One row moves one count by 1
(add/remove) or two counts by 1 (substitute), so the l2-sensitivity is 1 or sqrt(2)
(:func:`histogram_sensitivity`); every quantile is post-processing of one release
(:func:`histogram_quantile`, which reads the bins the noise shows to be populated:
:func:`populated_top`), and cuts no more rows than the noise of the release it clips
warrants (:func:`clip_rows_above`).  A clip the user states is public and costs
nothing.

The runner's tuning (:mod:`~numpyro_dp.runner.tuning`: the kernel's clips and the
warm start's) and :class:`~numpyro_dp.NoiseAwareNUTS`'s release
(:mod:`~numpyro_dp.releases.score`) make their histograms here
(:func:`scale_histogram`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_dp.accounting import sensitivity_factor
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.primitives.release import release_on_grid
from numpyro_dp.primitives.row_statistics import (
    row_gradient_scales,
    row_hessian_norms,
)
from numpyro_dp.primitives.secret import noise_key

#: Edges of the histogram of per-row scales: 2^-16 ... 2^24, a factor of
#: sqrt(2) apart (the clip's noise grows with it, its bias where it cuts rows).
SCALE_GRID = 2.0 ** (np.arange(-32, 49) / 2)


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


def histogram_sensitivity(neighbourhood: str) -> float:
    """l2-sensitivity of a histogram of one value per row."""
    return math.sqrt(2.0) if neighbourhood == "substitute" else 1.0


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
    """One private value per row: the ``scale`` of :class:`~numpyro_dp.kernels.base.ClipRequest` (or
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
