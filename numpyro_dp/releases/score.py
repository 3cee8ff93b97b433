"""Score-and-curvature releases at private anchors (SPEC s12).

:class:`~numpyro_dp.NoiseAwareNUTS` spends its budget here, before sampling,
and then samples a model of the last release
(:mod:`numpyro_dp.releases.noise_aware`) for free.  The releases are
:data:`STAGE_SHARES` stages of noisy Newton steps from the prior's median,
each in the coordinates ``v = L^-1 (theta - theta_k)`` whitened by the previous
stage's posterior covariance (the prior's at the first).  A stage releases

* two histograms of the rows' whitened gradient norms and Hessian norms at
  its anchor ``theta_k``, which choose its clips
  (:func:`~numpyro_dp.runner.tuning.histogram_quantile` with the bias-balanced cap
  :func:`~numpyro_dp.runner.tuning.clip_rows_above`: a clip cuts no more rows than its
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
anchor lands within :data:`COMBINE_RADIUS` of the last one's is not wasted:
its score, moved to the last anchor by the two stages' curvatures (the
trapezoid rule), is a second noisy observation of the same score, and the two
are combined by generalised least squares (:func:`combine_scores`).

Every release is Gaussian, so the phase is one Gaussian mechanism of ``mu^2 =
sum 1 / z_i^2``: its noise multiplier ``z = 1 / mu`` is what the runner
calibrates, split over the stages by :data:`STAGE_SHARES` and within each by
:data:`ANCHOR_STAGE_SHARES`, and in the last by :data:`RELEASE_HISTOGRAM_SHARE`
and :func:`release_curvature_share`.
Each stage is charged, with all the others, before the first is computed.  A
:class:`ScoreRelease` holds the released values and public facts only: no
exact count, no point computed before noise, no row.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro import handlers
from numpyro.distributions import biject_to, constraints

from numpyro_dp.accounting import sensitivity_factor
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.primitives.release import release_clipped_sum
from numpyro_dp.primitives.rounding import sum_levels
from numpyro_dp.primitives.row_statistics import clipped_grad_and_hessian_sums
from numpyro_dp.primitives.secret import noise_key
from numpyro_dp.runner.tuning import (
    SCALE_GRID,
    TYPICAL_CLIPS,
    clip_rows_above,
    histogram_quantile,
    histogram_sensitivity,
    scale_histogram,
    spectral_noise,
)

#: Shares of the phase's ``mu^2`` of the stages; the last is the release modelled.
#: Each earlier stage has about half the next one's: its Newton step need only
#: bring the anchor within reach of the next, whose noise is smaller.
STAGE_SHARES = (0.3, 0.7)
#: Shares of an anchor stage's ``mu^2``: the two clip histograms, the score and
#: the curvature.  An anchor stage's curvature whitens the next stage (a direction
#: it underestimates stays far off).
ANCHOR_STAGE_SHARES = (0.05, 0.55, 0.4)
#: Share of the last stage's ``mu^2`` of its two clip histograms; the curvature takes
#: :func:`release_curvature_share` of it, and the score, which sets where the
#: posterior lies, the remainder.
RELEASE_HISTOGRAM_SHARE = 0.05
#: Least and largest share of the last stage's ``mu^2`` of its curvature.  Where the
#: noise is small the least is taken and the score gets the rest: at 0.1 against 0.2
#: (reproducible noise, same 6 seeds, release and the surrogate's Laplace
#: approximation) statsmodels' ``fair`` went from mean RMS 0.40 to 0.37 NUTS sds at
#: epsilon 3 and 0.16 to 0.15 at 10 (every seed as close or closer; floor 0.32 and
#: 0.13), R's ``turnout`` stayed at 0.64 and 0.32 (floor 0.54 and 0.25).
RELEASE_CURVATURE_SHARES = (0.1, 0.5)
#: The last curvature's share is raised until its noise's spectral scale
#: ``2 sigma_H sqrt(d)`` is at most this fraction of its whitened eigenvalues (about
#: 1): a curvature lost in its noise bends the surrogate's mean by the noise times
#: the anchor's distance, and keeps the anchor stage's score out of the combination.
#: At epsilon 1 (share 0.5 here, against 0.2 before; reproducible noise, release and
#: the surrogate's Laplace approximation): statsmodels' ``fair``, median RMS 2.50 ->
#: 2.00 NUTS sds (5 seeds); R's ``turnout``, 3.36 -> 2.69, two of 6 releases refused
#: instead of 4.3 and 11.4 sds off.  At epsilon 3 and 10 both keep 0.2.
CURVATURE_NOISE_TARGET = 0.35
#: A run whose last curvature, at the largest share, would carry noise of more than this
#: many times its whitened eigenvalues (about 1) is refused before anything is charged
#: (:func:`curvature_noise`): its release is lost in the noise, its mode can lie
#: anywhere, and its posterior can be confidently wrong.  Measured before this gate,
#: 3 seeds a cell (``benchmarks/utility_real_data.py --noise-aware``): where it is
#: above 1 (sklearn's breast cancer, d = 9 and n = 569, at epsilon 1 and 3; its
#: diabetes, d = 12 and 15, n = 442, at 1-10; statsmodels' anes96, d = 7 and n = 944,
#: at 1: 1.1-11) 17 of 27 releases were refused after they were paid for and the other
#: 10 sampled 1.3-9.4 private sds off (5 beyond 2.8); at 0.4-0.5 (``fair`` and
#: ``turnout`` at epsilon 1) the runs were wide, within 3.5.
MAX_CURVATURE_NOISE = 1.0
#: The released curvature's eigenvalues are raised to this many times
#: ``sigma_H sqrt(d)`` (about half the noise matrix's spectral norm) for a
#: Newton step: a direction the noise flattened would otherwise send it far.
CURVATURE_FLOOR = 1.0
#: Longest Newton step, in the whitened units of its stage, over ``sqrt(d)``: a
#: trust region.  Where an earlier stage's noisy curvature made the whitening
#: too narrow along a direction, the released curvature there is small and
#: noisy, and the full step would overshoot by far; the next stage corrects.
MAX_STEP = 3.0
#: Quantile of the rows' whitened scales below which the clips lie at most
#: (fewer rows cut where the noise is small: :func:`~numpyro_dp.runner.tuning.clip_rows_above`).
RELEASE_QUANTILE = 0.99
#: The quadratic model of the log-likelihood around the anchor is trusted only
#: within this many whitened units (about the anchor's posterior sds) of the
#: release's mode (:meth:`ScoreRelease.trusted`).
MAX_ANCHOR_DISTANCE = 3.0
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
#: Beyond this many whitened units (ten times :data:`MAX_ANCHOR_DISTANCE`) between
#: the anchor and the release's mode, the release is refused: its quadratic model
#: is extrapolated so far that the posterior may be confidently wrong (measured on
#: statsmodels' ``randhie`` at epsilon 1 to 1e7: means 4-43 private sds from NUTS's
#: in 4 of 5 runs with the anchor 43-194 sds off; within 2.3 in all 7 at 18-35).
MAX_MODEL_DISTANCE = 30.0
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
#: Version of the file format of :meth:`ScoreRelease.save`.
FORMAT = 2


def curvature_noise(noise_multiplier: float, num_params: int, num_rows: int, factor: float,
                    share: float) -> float:
    """Spectral scale ``2 sigma_H sqrt(d)`` of the last curvature's noise, relative to the
    whitened curvature (eigenvalues about 1), at the smallest clip a stage takes
    (:data:`TYPICAL_CLIPS` ``d / n``) and ``share`` of the last stage's ``mu^2``: a
    function of public facts (``factor``: the neighbourhood's sensitivity factor)."""
    clip = TYPICAL_CLIPS * num_params / num_rows
    sigma = factor * noise_multiplier * clip / math.sqrt(STAGE_SHARES[-1] * share)
    return spectral_noise(sigma, num_params)


def release_curvature_share(noise_multiplier: float, num_params: int, num_rows: int,
                            factor: float) -> float:
    """Share of the last stage's ``mu^2`` of its curvature, from public facts: the
    least of :data:`RELEASE_CURVATURE_SHARES`, raised (to the largest at most) until
    :func:`curvature_noise` is :data:`CURVATURE_NOISE_TARGET`.

    On statsmodels' ``fair`` (d = 9, n = 6,366, substitute) the share is raised at
    epsilon below about 2.5, where the curvature's noise at the least share would
    exceed the target.
    """
    need = (curvature_noise(noise_multiplier, num_params, num_rows, factor, 1.0)
            / CURVATURE_NOISE_TARGET) ** 2
    least, largest = RELEASE_CURVATURE_SHARES
    return min(max(need, least), largest)


def release_noise(noise_multiplier: float, stage: int, num_params: int, num_rows: int,
                  factor: float) -> tuple[float, float, float]:
    """``(z_histogram, z_score, z_curvature)`` of a stage of a phase of total ``z``
    for a model of ``num_params`` parameters on ``num_rows`` rows (``factor``: the
    neighbourhood's sensitivity factor).

    The phase is one Gaussian mechanism of noise multiplier ``z``
    (``1 / z^2 = sum 1 / z_i^2``), split by the shares; rounded up so the
    parts never exceed the whole.
    """
    mu2 = STAGE_SHARES[stage] / noise_multiplier**2
    if stage == len(STAGE_SHARES) - 1:
        histogram = RELEASE_HISTOGRAM_SHARE
        curvature = release_curvature_share(noise_multiplier, num_params, num_rows, factor)
        score = 1 - histogram - curvature
    else:
        histogram, score, curvature = ANCHOR_STAGE_SHARES
    up = 1 + 1e-9
    return (math.sqrt(2 / (mu2 * histogram)) * up, math.sqrt(1 / (mu2 * score)) * up,
            math.sqrt(1 / (mu2 * curvature)) * up)


def release_entries(noise_multiplier: float, num_params: int, num_rows: int,
                    neighbourhood: str) -> list[tuple[str, dpa.DpEvent, int]]:
    """``(phase, per-release event, releases)`` of the phase at ``z`` for a model whose
    likelihood reads ``num_params`` unconstrained coordinates
    (:attr:`PrivateModel.likelihood_coordinates`) on ``num_rows`` rows: one entry a
    stage, its two histograms, score and curvature."""
    factor = sensitivity_factor(neighbourhood)
    entries = []
    for stage in range(len(STAGE_SHARES)):
        z_hist, z_score, z_curv = release_noise(noise_multiplier, stage, num_params, num_rows,
                                                factor)
        last = stage == len(STAGE_SHARES) - 1
        entries.append((
            "score release" if last else f"anchor stage {stage + 1}",
            dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z_hist), 2),
                                 dpa.GaussianDpEvent(z_score), dpa.GaussianDpEvent(z_curv)]),
            1))
    return entries


@dataclasses.dataclass(frozen=True)
class ScoreRelease:
    """What one score-and-curvature release published (public: post-processing only).

    Attributes
    ----------
    anchor : ndarray, shape (d,)
        ``theta_a``, the private anchor (flattened unconstrained parameters,
        in the order of :meth:`PrivateModel.ravel`): a released warm start.
    whiten : ndarray, shape (d, d)
        ``L``: ``theta = theta_a + L v``; the anchor's Laplace covariance is ``L L^T``.
        Its first ``k`` columns span the coordinates the likelihood reads
        (:attr:`PrivateModel.likelihood_coordinates`, :func:`ordered_factor`): the
        likelihood depends on ``v[:k]`` alone, and the rest is the prior's.
    score : ndarray, shape (k,)
        ``g``: the released clipped sum of the rows' whitened scores at the
        anchor (its first ``k`` coordinates: the others are zero by construction),
        combined with the earlier stages' that lie near it (:func:`combine_scores`).
    curvature : ndarray, shape (k, k)
        ``K``: the released clipped sum of the rows' whitened negative Hessians,
        symmetrised (off-diagonal noise sd ``curvature_sd / sqrt 2``).
    score_covariance : ndarray, shape (k, k)
        The covariance of ``g``'s noise: ``score_sd^2 R^2`` for the last stage's
        score alone (``R`` the diagonal of :func:`score_room`), less where earlier
        stages' joined it.
    score_sd, curvature_sd : float
        The noise sds of the last stage's score (along a coordinate without room)
        and of each entry of its curvature before symmetrising.
    stages_combined : int
        How many stages' scores ``g`` combines (1: the last stage's alone).
    clip, curvature_clip : float
        The per-row clips (whitened gradient norm, Frobenius norm of the whitened Hessian).
    clipped_share : float
        The share of rows whose whitened gradient the clip cut, read off the
        released histogram (the noisy sum of its bins above the clip: unbiased
        but noisy, its sd the histogram's noise sd times the root of the number
        of bins above).  Clipping bias is the one error the surrogate does not
        model.
    num_rows : int
        ``n`` (public).
    neighbourhood : str
        The neighbourhood the release is private under.
    param_shapes : dict
        Unconstrained shape of each latent site (public structure).
    data_plate : str
        The model's plate over rows.
    model_args, model_kwargs : tuple, dict
        The model's public arguments with one zero stand-in row in place of the
        rows: what the surrogate runs the model on.
    """

    anchor: np.ndarray
    whiten: np.ndarray
    score: np.ndarray
    curvature: np.ndarray
    score_covariance: np.ndarray
    score_sd: float
    curvature_sd: float
    stages_combined: int
    clip: float
    curvature_clip: float
    clipped_share: float
    num_rows: int
    neighbourhood: str
    param_shapes: dict
    data_plate: str
    model_args: tuple
    model_kwargs: dict

    @property
    def num_params(self) -> int:
        """``d``, the model's unconstrained parameters."""
        return int(self.anchor.size)

    @property
    def num_released(self) -> int:
        """``k``, the whitened coordinates the release covers (those the likelihood reads)."""
        return int(self.score.size)

    def whitened_mode(self) -> np.ndarray:
        """``v`` where the release's likelihood peaks under a flat prior:
        ``K^-1 g`` (the one-step Newton estimate), in anchor posterior sds; a
        pseudo-inverse where the released curvature is flat."""
        return np.linalg.pinv(psd(self.curvature)) @ self.score

    def anchor_distance(self) -> float:
        """How far the anchor lies from the release's mode: the largest
        ``|K^-1 g|`` coordinate, in the anchor's posterior sds (whitened units).

        Small (about 1 or less) is the regime where the quadratic model of the
        log-likelihood around the anchor is accurate.
        """
        return float(np.max(np.abs(self.whitened_mode())))

    def trusted(self) -> tuple[bool, str]:
        """Whether the release is in the regime its noise-aware model was shown
        calibrated in, and why not (post-processing of the release only).

        The curvature must stand out of its noise in every direction (each
        eigenvalue above ``2 sigma_H sqrt(d)``, about the noise matrix's spectral
        norm), and the anchor must lie within :data:`MAX_ANCHOR_DISTANCE` of the
        release's mode.  Outside it the quadratic model is extrapolated and the
        posterior may be too narrow or off centre (measured on small data sets:
        scikit-learn's breast cancer, n = 569, and diabetes, n = 442).
        """
        smallest, noise = curvature_margin(self.curvature, self.curvature_sd)
        if not smallest > noise:
            return False, (f"the released curvature's smallest eigenvalue, {smallest:.3g}, "
                           f"does not stand out of its noise ({noise:.3g})")
        distance = self.anchor_distance()
        if not distance <= MAX_ANCHOR_DISTANCE:
            return False, (f"the anchor lies {distance:.3g} posterior sds from the release's "
                           f"mode (the quadratic model is trusted within "
                           f"{MAX_ANCHOR_DISTANCE:g})")
        return True, ""

    def likelihood_covariance(self) -> np.ndarray:
        """Covariance of the released score given the parameter, in the
        surrogate's likelihood: ``K+ + S + sigma_H^2 / 2 (|v^|^2 I + v^ v^^T)`` with
        ``v^`` the release's mode (:meth:`whitened_mode`).

        ``K+`` is the released curvature with its negative eigenvalues raised to 0
        (a direction the noise made negative carries no information), ``S`` the
        score's noise covariance (:attr:`score_covariance`); the curvature's noise
        ``E`` moves ``K v`` by ``E v``, of covariance ``sigma_H^2 / 2 (|v|^2 I +
        v v^T)`` for symmetrised noise (:func:`curvature_noise_covariance`), taken
        at ``v^``.  Taken at each ``v`` instead, the covariance grows with ``|v|``,
        and its log-determinant pulls the posterior towards the anchor and gives it
        heavy tails; at the mode it keeps the width near the posterior's bulk (same
        6 seeds, reproducible noise, NUTS on the surrogate: statsmodels' ``fair``
        mean RMS 0.39 -> 0.37 NUTS sds at epsilon 3 and 1.95 -> 1.79 at 1, R's
        ``turnout`` 3.89 -> 3.26 at 1, with every NUTS mean within 1.7 private sds
        both ways).
        """
        return (psd(self.curvature) + self.score_covariance
                + curvature_noise_covariance(self.whitened_mode(), self.curvature_sd))

    def log_likelihood(self, v: jax.Array) -> jax.Array:
        """The noise-aware log-likelihood of the release at whitened ``v`` (of which it
        reads the first :attr:`num_released` coordinates).

        Local asymptotic normality: the score at the anchor given the parameter
        is about ``N(K v, K)``; the release adds the score's noise and the
        curvature's (:meth:`likelihood_covariance`).  So ``g | v ~ N(K+ v, C)``
        with ``C`` that covariance.
        """
        v = v[:self.num_released]
        dtype = jnp.result_type(v)
        chol = np.linalg.cholesky(self.likelihood_covariance())
        k = jnp.asarray(psd(self.curvature), dtype)
        r = jax.scipy.linalg.solve_triangular(jnp.asarray(chol, dtype),
                                              jnp.asarray(self.score, dtype) - k @ v, lower=True)
        return (-0.5 * jnp.sum(r**2) - float(np.sum(np.log(np.diag(chol))))
                - 0.5 * self.num_released * math.log(2 * math.pi))

    def __str__(self) -> str:
        return (
            f"ScoreRelease of {self.num_params} parameters ({self.num_released} read by the "
            f"likelihood) from n = {self.num_rows} rows "
            f"({self.neighbourhood}): score noise sd {self.score_sd:.3g}, curvature noise sd "
            f"{self.curvature_sd:.3g} (whitened units; {self.stages_combined} stages' scores "
            f"combined); clips {self.clip:.3g} and "
            f"{self.curvature_clip:.3g}, cutting about {self.clipped_share:.1%} of rows; "
            f"the anchor lies {self.anchor_distance():.2g} posterior sds from the release's mode"
        )

    # ---------------------------------------------------------------- files
    def save(self, path: str | Path) -> None:
        """Write the release to ``path`` (a directory): arrays in ``release.npz``, public
        facts in ``release.json``, the stand-in arguments in ``arguments.pickle``.

        Everything written is public; load only files you wrote (pickle).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        arrays = {k: getattr(self, k) for k in ("anchor", "whiten", "score", "curvature",
                                                 "score_covariance")}
        np.savez(path / "release.npz", **arrays)
        facts = {k: getattr(self, k) for k in (
            "score_sd", "curvature_sd", "stages_combined", "clip", "curvature_clip",
            "clipped_share", "num_rows", "neighbourhood", "data_plate")}
        facts["param_shapes"] = {k: list(v) for k, v in self.param_shapes.items()}
        facts["format"] = FORMAT
        (path / "release.json").write_text(json.dumps(facts, indent=1))
        with open(path / "arguments.pickle", "wb") as f:
            pickle.dump(jax.tree.map(np.asarray, (self.model_args, self.model_kwargs)), f)

    @classmethod
    def load(cls, path: str | Path) -> ScoreRelease:
        """Read a release written by :meth:`save`."""
        path = Path(path)
        facts = json.loads((path / "release.json").read_text())
        if facts.pop("format") != FORMAT:
            raise ValueError(f"{path} holds a release of another format than {FORMAT}.")
        facts["param_shapes"] = {k: tuple(v) for k, v in facts["param_shapes"].items()}
        with np.load(path / "release.npz") as arrays:
            facts.update({k: arrays[k] for k in arrays.files})
        with open(path / "arguments.pickle", "rb") as f:
            facts["model_args"], facts["model_kwargs"] = pickle.load(f)
        return cls(**facts)


def curvature_margin(curvature: np.ndarray, curvature_sd: float) -> tuple[float, float]:
    """``(smallest eigenvalue, noise)`` of a released curvature: it stands out of its
    noise where the first exceeds the second (:func:`spectral_noise`)."""
    return (float(np.linalg.eigvalsh(curvature).min()),
            spectral_noise(curvature_sd, curvature.shape[0]))


def psd(matrix: np.ndarray) -> np.ndarray:
    """``matrix`` (symmetric) with its negative eigenvalues raised to 0."""
    w, vectors = np.linalg.eigh(np.asarray(matrix, float))
    return (vectors * np.maximum(w, 0.0)) @ vectors.T


def stand_in_arguments(pm: PrivateModel) -> tuple[tuple, dict]:
    """The model's public arguments with one zero row in place of each row array."""
    rows = [np.zeros((1,) + tuple(s.shape[1:]), s.dtype) for s in pm.row_specs]
    return pm.rebuild(rows)


def positive_sites(model, model_args: tuple, model_kwargs: dict, names) -> list[str]:
    """Which of the latent sites ``names`` have positive support (noise scales, group
    sds): public structure, traced on the public arguments given (stand-ins for the
    rows)."""
    def stand_in(site):  # no draw: an improper prior has none
        if (site["type"] == "sample" and not site["is_observed"]
                and not site["fn"].is_discrete):
            return biject_to(site["fn"].support)(jnp.zeros(site["fn"].shape()))
        return None

    with handlers.block(), handlers.seed(rng_seed=0):
        trace = handlers.trace(handlers.substitute(model, substitute_fn=stand_in)).get_trace(
            *model_args, **model_kwargs)
    return sorted(n for n in names if trace[n]["fn"].support is constraints.positive)


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
        stages_made.append((np.asarray(theta, float), np.asarray(whiten, float), g,
                            float(g_sd) * room[:k], curvature, float(h_sd)))
        if stage == stages - 1:
            break
        theta, whiten = _newton_step(theta, whiten, g, curvature, float(h_sd), prior_grad,
                                     prior_hess)
    args, kwargs = stand_in_arguments(pm)
    score, score_covariance, combined = combine_scores(stages_made)
    return ScoreRelease(
        anchor=np.asarray(theta, float), whiten=np.asarray(whiten, float), score=score,
        curvature=curvature, score_covariance=score_covariance, score_sd=float(g_sd),
        curvature_sd=float(h_sd), stages_combined=combined, clip=float(clip),
        curvature_clip=float(curvature_clip),
        clipped_share=min(1.0, rows_above(counts[0], clip) / pm.num_rows),
        num_rows=pm.num_rows, neighbourhood=neighbourhood, param_shapes=dict(pm.param_shapes),
        data_plate=pm.data_plate, model_args=args, model_kwargs=kwargs,
    )


def release_order(pm: PrivateModel) -> tuple[np.ndarray, int]:
    """``(order, k)``: the flattened coordinates with the ``k`` the likelihood reads
    first (:attr:`PrivateModel.likelihood_coordinates`, public structure).  Every
    whitening of the release is lower-triangular in that order (:func:`ordered_factor`),
    so the rows' whitened scores and curvatures are zero past the first ``k``: only
    those are kept, the noise past them dropped (post-processing), and the budget's
    split (:func:`release_entries`) counts ``k``."""
    mask = pm.likelihood_coordinates
    return np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)]), int(mask.sum())


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
    (:func:`curvature_noise_covariance`). The noises are independent, so
    generalised least squares combines them.  A stage joins only when its anchor
    lies within :data:`COMBINE_RADIUS` of the last one in every coordinate and both
    curvatures stand out of their noise (:func:`curvature_margin`): where one does
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


def curvature_noise_covariance(v: np.ndarray, curvature_sd: float) -> np.ndarray:
    """Covariance of ``E v`` for ``E`` the symmetrised curvature noise (entries of sd
    ``curvature_sd`` before symmetrising): ``sigma_H^2 / 2 (|v|^2 I + v v^T)``."""
    v = np.asarray(v)
    return 0.5 * curvature_sd**2 * (np.sum(v**2) * np.eye(v.shape[0], dtype=v.dtype)
                                     + np.outer(v, v))


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
    :data:`RELEASE_QUANTILE` quantile of :func:`~numpyro_dp.runner.tuning.histogram_quantile`,
    cutting at most ``max_rows_above`` rows, and at least :data:`TYPICAL_CLIPS` times
    ``typical``, a row's typical whitened value from public facts.

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
