"""A score-and-curvature release (SPEC s12) and its noise-aware model.

:class:`ScoreRelease` holds what the releases of :mod:`~numpyro_dp.releases.score`
published -- the anchor, its whitening, the released score and curvature, their noise
and the model's public structure -- and public facts only: no exact count, no point
computed before noise, no row.  Post-processing of it: whether it is in the regime its
noise-aware model was shown calibrated in (:meth:`ScoreRelease.trusted`), that model's
log-likelihood (:meth:`ScoreRelease.log_likelihood`), which
:class:`~numpyro_dp.NoiseAwareNUTS` samples (:mod:`~numpyro_dp.releases.noise_aware`),
and its files (:meth:`ScoreRelease.save`, :meth:`ScoreRelease.load`).  The model's
public arguments it runs the surrogate on are stand-ins for the rows
(:meth:`~numpyro_dp.model.adapter.PrivateModel.stand_in_arguments`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.distributions import biject_to, constraints

from numpyro_dp.model.units import ROW
from numpyro_dp.runner.warm_start import spectral_noise

#: The quadratic model of the log-likelihood around the anchor is trusted only
#: within this many whitened units (about the anchor's posterior sds) of the
#: release's mode (:meth:`ScoreRelease.trusted`).
MAX_ANCHOR_DISTANCE = 3.0
#: Beyond this many whitened units (ten times :data:`MAX_ANCHOR_DISTANCE`) between
#: the anchor and the release's mode, the release is refused: its quadratic model
#: is extrapolated so far that the posterior may be confidently wrong (measured on
#: statsmodels' ``randhie`` at epsilon 1 to 1e7: means 4-43 private sds from NUTS's
#: in 4 of 5 runs with the anchor 43-194 sds off; within 2.3 in all 7 at 18-35).
MAX_MODEL_DISTANCE = 30.0
#: Version of the file format of :meth:`ScoreRelease.save`.
FORMAT = 3


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
        (:attr:`PrivateModel.likelihood_coordinates`,
        :func:`~numpyro_dp.releases.score.ordered_factor`): the likelihood depends on
        ``v[:k]`` alone, and the rest is the prior's.
    score : ndarray, shape (k,)
        ``g``: the released clipped sum of the rows' whitened scores at the
        anchor (its first ``k`` coordinates: the others are zero by construction),
        combined with the earlier stages' that lie near it
        (:func:`~numpyro_dp.releases.score.combine_scores`).
    curvature : ndarray, shape (k, k)
        ``K``: the released clipped sum of the rows' whitened negative Hessians,
        symmetrised (off-diagonal noise sd ``curvature_sd / sqrt 2``).
    score_covariance : ndarray, shape (k, k)
        The covariance of ``g``'s noise: ``score_sd^2 R^2`` for the last stage's
        score alone (``R`` the diagonal of
        :func:`~numpyro_dp.releases.score.score_room`), less where earlier stages'
        joined it.
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
        ``n`` (public): the number of rows, or of units with ``privacy_unit``.
    neighbourhood : str
        The neighbourhood the release is private under.
    privacy_unit : str
        What it protects: ``"row"``, or ``"unit:..."`` (one unit with all its rows,
        :class:`~numpyro_dp.model.units.Units`), as the ledger records it.
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
    privacy_unit: str = ROW

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

    def likelihood_terms(self) -> dict[str, np.ndarray]:
        """The arrays :func:`release_log_likelihood` reads: the released ``score``
        ``g``, the ``curvature`` ``K+`` (:func:`psd`), the lower Cholesky factor
        ``chol`` of :meth:`likelihood_covariance` and the Gaussian's ``log_normaliser``."""
        chol = np.linalg.cholesky(self.likelihood_covariance())
        log_normaliser = (-np.sum(np.log(np.diag(chol)))
                          - 0.5 * self.num_released * math.log(2 * math.pi))
        return {"score": self.score, "curvature": psd(self.curvature), "chol": chol,
                "log_normaliser": np.asarray(log_normaliser)}

    def log_likelihood(self, v: jax.Array) -> jax.Array:
        """The noise-aware log-likelihood of the release at whitened ``v``
        (:func:`release_log_likelihood`)."""
        return release_log_likelihood(self.likelihood_terms(), v)

    def __str__(self) -> str:
        return (
            f"ScoreRelease of {self.num_params} parameters ({self.num_released} read by the "
            f"likelihood) from n = {self.num_rows} "
            f"{'rows' if self.privacy_unit == ROW else 'units'} "
            f"({self.neighbourhood}): score noise sd {self.score_sd:.3g}, curvature noise sd "
            f"{self.curvature_sd:.3g} (whitened units; {self.stages_combined} stages' scores "
            f"combined); clips {self.clip:.3g} and "
            f"{self.curvature_clip:.3g}, cutting about {self.clipped_share:.1%} of "
            f"{'rows' if self.privacy_unit == ROW else 'units'}; "
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
            "clipped_share", "num_rows", "neighbourhood", "data_plate", "privacy_unit")}
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
    noise where the first exceeds the second
    (:func:`~numpyro_dp.runner.warm_start.spectral_noise`)."""
    return (float(np.linalg.eigvalsh(curvature).min()),
            spectral_noise(curvature_sd, curvature.shape[0]))


def release_log_likelihood(terms: dict, v: jax.Array) -> jax.Array:
    """The noise-aware log-likelihood of a release at whitened ``v``, of which it reads
    the first ``k`` coordinates; ``terms`` are :meth:`ScoreRelease.likelihood_terms`
    (arrays or the compiled sampler's arguments).

    Local asymptotic normality: the score at the anchor given the parameter is
    about ``N(K v, K)``; the release adds the score's noise and the curvature's
    (:meth:`ScoreRelease.likelihood_covariance`).  So ``g | v ~ N(K+ v, C)`` with
    ``C`` that covariance.
    """
    k = terms["score"].shape[0]
    v = v[:k]
    dtype = jnp.result_type(v)
    score, curvature, chol, log_normaliser = (
        jnp.asarray(terms[name], dtype) for name in ("score", "curvature", "chol",
                                                     "log_normaliser"))
    r = jax.scipy.linalg.solve_triangular(chol, score - curvature @ v, lower=True)
    return -0.5 * jnp.sum(r**2) + log_normaliser


def psd(matrix: np.ndarray) -> np.ndarray:
    """``matrix`` (symmetric) with its negative eigenvalues raised to 0."""
    w, vectors = np.linalg.eigh(np.asarray(matrix, float))
    return (vectors * np.maximum(w, 0.0)) @ vectors.T


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


def curvature_noise_covariance(v: np.ndarray, curvature_sd: float) -> np.ndarray:
    """Covariance of ``E v`` for ``E`` the symmetrised curvature noise (entries of sd
    ``curvature_sd`` before symmetrising): ``sigma_H^2 / 2 (|v|^2 I + v v^T)``."""
    v = np.asarray(v)
    return 0.5 * curvature_sd**2 * (np.sum(v**2) * np.eye(v.shape[0], dtype=v.dtype)
                                     + np.outer(v, v))
