"""DP penalty: Metropolis-Hastings with a noisy, clipped log-likelihood ratio.

Yildirim & Ermis (2019); Räisä (2020), s3.1.  Per iteration, from theta:

1. propose theta' (random walk, one coordinate, or guided random walk);
   h = ||theta' - theta||_2;
2. R = T sum_i clip_c(l_i(theta') - l_i(theta)) with c = llr_clip * h;
3. release R + xi, xi ~ N(0, sigma^2), sigma = z * Delta, Delta = 2 T c
   (substitute) or T c (add/remove);
4. accept iff log u < R + xi + log p(theta') - log p(theta) - sigma^2 / 2.

Each iteration is one Gaussian release with noise multiplier ``z``
(zCDP rho = 1 / (2 z^2)).  If no ratio is clipped, the chain targets the exact
tempered posterior despite the noise (the penalty method); clipping more than
about 10-20% of the ratios biases it.

:class:`DPMinibatchPenalty` (Räisä 2020, s4.1) uses in step 2 a batch B of
``b`` rows drawn without replacement: ``lambda* = (n T / b) sum_B clip_c(r_j)``
and the CLT correction ``sigma_b^2 = (n T / b)^2 (sum_B r_j^2 - R_B^2 / b)``
(clipped ratios); the release is ``lambda* - sigma_b^2 / 2 + N(0, sigma^2)``
with ``sigma = z (Delta_lambda + Delta_half_var)``, ``Delta_lambda = 2 n T c / b``
and ``Delta_half_var = 2 ((b - 1) / b) (n T / b)^2 c^2``.  Its cost is the
Gaussian's RDP amplified by the sampling (WBK, :mod:`numpyro_dp.accounting.rdp`).
The batch's two sums (ratios and squares) are exact integer sums of the rows
rounded to a fine grid (:func:`~numpyro_dp.kernels.ratios.ratio_sums`; the
rounding is charged), so with the rows on a mesh each device sums the batch's
rows it holds and only the integer totals cross devices.

Warm-up adapts the proposal scale (dual averaging on the noisy acceptance
probability) and the proposal covariance (Welford over the chain's own draws),
with NumPyro's windowed schedule.  Both are post-processing of releases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import dp_accounting as dpa
import jax
import jax.numpy as jnp
from jax import lax, random
from numpyro.infer.hmc_util import HMCAdaptState
from numpyro.infer.initialization import init_to_uniform
from numpyro.util import identity

from numpyro_dp.kernels.adaptation import MassMatrix, metric_scales, phase_mean, warmup_adapter
from numpyro_dp.kernels.arguments import (
    check_positive,
    event_noise_multiplier,
    event_num_rows,
    extends,
    keyword_arguments,
)
from numpyro_dp.kernels.base import ClipRequest, DPKernel
from numpyro_dp.kernels.ratios import (
    batch_ratio_sums,
    log_prior,
    penalty_test,
    ratio_sums,
    release_llr,
)
from numpyro_dp.kernels.running import carries_info
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.primitives.batching import sample_without_replacement
from numpyro_dp.primitives.release import release_on_grid
from numpyro_dp.primitives.rounding import (
    exact_sum_error,
    row_quantum,
    sum_levels,
    unit_roundoff,
)
from numpyro_dp.primitives.secret import noise_key

PROPOSALS = ("random_walk", "one_coordinate", "guided")
#: Quantile of the rows' slopes that a privately chosen ``llr_clip`` covers:
#: a clipped ratio biases the target, a larger clip only adds noise.
LLR_CLIP_QUANTILE = 0.95
#: Cap of the noise-derived initial proposal scale (unconstrained units): at
#: negligible noise the prior's scale, not the noise, limits a step.
MAX_DEFAULT_SCALE = 1.0


class DPPenaltyInfo(NamedTuple):
    """One DP penalty transition; every field is safe to publish.

    Attributes
    ----------
    accept_prob : float
        Noisy acceptance probability min(1, exp(lambda_hat - sigma^2 / 2)), a
        post-processing of the Gaussian release.
    accepted : bool
        Whether the proposal was accepted.
    proposal_scale : float
        The proposal scale ``s`` after this transition's adaptation.
    """

    accept_prob: jax.Array
    accepted: jax.Array
    proposal_scale: jax.Array


@carries_info(DPPenaltyInfo)
class DPPenaltyState(NamedTuple):
    """State of :class:`DPPenalty`; every field is safe to publish.

    The fields of ``info`` (:class:`DPPenaltyInfo`) are readable on the state
    too: ``state.accept_prob``, ``extra_fields=("accept_prob",)``.

    Attributes
    ----------
    i : int
        Iteration counter (warm-up included).
    z : dict
        Current point in unconstrained space.
    info : DPPenaltyInfo
        The last transition.
    mean_accept_prob : float
        Running mean of the noisy ``accept_prob`` (reset after warm-up).
    adapt_state : HMCAdaptState
        NumPyro's adaptation state: ``step_size`` is ``s`` and
        ``inverse_mass_matrix`` is the proposal covariance (both from draws
        and noisy decisions only).
    direction : array
        Guided random walk: direction (+1/-1) per coordinate.
    rng_key : jax.random key
    """

    i: jax.Array
    z: dict
    info: DPPenaltyInfo
    mean_accept_prob: jax.Array
    adapt_state: HMCAdaptState
    direction: jax.Array
    rng_key: jax.Array


def batch_llr(
    ratio: jax.Array, clip: jax.Array, scale: float, sensitivity_factor: float, levels: int = 1
) -> tuple[jax.Array, jax.Array]:
    """Subsampled LLR with the CLT correction (Räisä 2020, s4.1), and its sensitivity as computed.

    ``ratio`` holds the ``b`` ratios of a batch (clipped here to ``clip``),
    ``scale = n T / b``: :func:`batch_llr_value` of their
    :func:`~numpyro_dp.kernels.ratios.ratio_sums`.
    """
    sums = ratio_sums(ratio, clip, levels=levels)
    return batch_llr_value(sums, ratio.shape[0], clip, scale, sensitivity_factor)


def batch_llr_value(sums, b: int, clip, scale: float, sensitivity_factor: float):
    """``lambda* - sigma_b^2 / 2`` (prior and proposal terms excluded) from a batch's
    :func:`~numpyro_dp.kernels.ratios.ratio_sums`, and its sensitivity as computed.

    The sums are of the rows as rounded: ratios ``r~`` within ``c1 = c + q1 / 2``
    and squares within ``eta = q2 / 2 + u c^2 + c q1 + q1^2 / 4`` of ``r~^2``
    (``q1``, ``q2`` the grids of the ratios and the squares).  Substituting one
    row moves the exact statistic of the rounded rows by at most
    ``Delta_lambda + Delta_half_var`` (Räisä 2020, s4.1) at the clip ``c1``,
    plus ``scale^2 eta`` (that row's ``eta``, both data sets); twice a bound on
    the error of the computed value is added: the sums' (exact up to
    :func:`~numpyro_dp.primitives.rounding.exact_sum_error`) and ``10 u`` of
    each term's magnitude for the rest (about ``2 b u`` of the sensitivity:
    1e-4 at ``b = 1000`` in float32).
    """
    (total_hi, total_lo), (squares_hi, squares_lo) = sums
    dtype = total_hi.dtype
    u = unit_roundoff(dtype)
    total_f, squares_f = total_hi + total_lo, squares_hi + squares_lo
    value = scale * total_f - 0.5 * scale**2 * (squares_f - total_f * total_f / b)
    q1, q2 = row_quantum(clip, b, dtype), row_quantum(clip * clip, b, dtype)
    c1 = clip + q1 / 2  # a ratio as summed; its square as summed is below c1^2 (1 + u)
    eta = q2 / 2 + u * clip**2 + clip * q1 + q1**2 / 4
    linear, quadratic = scale * b * c1, scale**2 * b * c1**2 * (1 + u)  # |terms| of the value
    sum_error = exact_sum_error(b, c1, dtype)
    error = (
        10.0 * u * (linear + 2.0 * quadratic)
        + scale * sum_error
        + scale**2 * (exact_sum_error(b, c1**2 * (1 + u), dtype) + 2.0 * c1 * sum_error)
    )
    exact = sensitivity_factor * (scale * c1 + (b - 1) / b * scale**2 * c1**2
                                  + 0.5 * scale**2 * eta)
    return value, exact + 2.0 * error


def release_batch_llr(
    key: jax.Array,
    ratio: jax.Array,
    clip: jax.Array,
    scale: float,
    *,
    noise_multiplier: float,
    sensitivity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """The release ``batch_llr + N(0, sigma^2)`` on the grid of :func:`grid_release`, and sigma."""
    levels = sum_levels(noise_multiplier * sensitivity_factor, ratio.dtype)
    return release_batch_sums(
        key, ratio_sums(ratio, clip, levels=levels), ratio.shape[0], clip, scale,
        noise_multiplier=noise_multiplier, sensitivity_factor=sensitivity_factor,
    )


def release_batch_sums(
    key: jax.Array, sums, b: int, clip: jax.Array, scale: float, *,
    noise_multiplier: float, sensitivity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """:func:`release_batch_llr` from the batch's :func:`~numpyro_dp.kernels.ratios.ratio_sums`
    (with ``sum_levels(noise_multiplier * sensitivity_factor)`` levels)."""
    value, sensitivity = batch_llr_value(sums, b, clip, scale, sensitivity_factor)
    c1 = clip + row_quantum(clip, b, value.dtype) / 2
    magnitude = scale * b * c1 + scale**2 * b * c1**2
    return release_on_grid(key, value, jnp.zeros_like(value), noise_multiplier=noise_multiplier,
                           sensitivity=sensitivity, dim=1, magnitude=magnitude)


def dp_penalty(
    private_model: PrivateModel,
    num_warmup: int,
    *,
    noise_multiplier: float,
    sensitivity_factor: float,
    temperature: float = 1.0,
    proposal: str = "random_walk",
    adapt_step_size: bool = True,
    adapt_mass_matrix: bool = True,
    dense_mass: bool = False,
    target_accept_prob: float = 0.234,
    batch_size: int | None = None,
) -> tuple[Callable, Callable]:
    """Functional core of the DP penalty kernel (full data, or batches of ``batch_size``).

    Returns
    -------
    init_fn(init_params, proposal_scale, covariance, rng_key) -> DPPenaltyState
        ``covariance``: the initial proposal covariance (None: identity).
    sample_fn(state, model_args, model_kwargs, secret, *, llr_clip) -> DPPenaltyState
        ``secret`` is the run secret (:mod:`numpyro_dp.primitives.secret`): the noise and
        the batch come from it, proposals and the accept test from the state's
        public key.  ``llr_clip`` is the clip, given at every call (BlackJAX
        style: the core is built once from its settings, tuned numbers arrive
        as arguments and may be traced).
    """
    pm = private_model
    dim = pm.num_params
    wa_init, wa_update = warmup_adapter(
        num_warmup,
        adapt_step_size=adapt_step_size,
        adapt_mass_matrix=adapt_mass_matrix,
        dense_mass=dense_mass,
        target_accept_prob=target_accept_prob,
    )

    def init_fn(init_params: dict, proposal_scale: float, covariance, rng_key):
        rng_key, key_wa = random.split(rng_key)
        theta = pm.ravel(init_params)
        adapt_state = wa_init((theta,), key_wa, proposal_scale, inverse_mass_matrix=covariance,
                              mass_matrix_size=dim)
        zero = jnp.zeros((), theta.dtype)
        return DPPenaltyState(
            i=jnp.array(0),
            z=init_params,
            info=DPPenaltyInfo(zero, jnp.array(False), adapt_state.step_size),
            mean_accept_prob=zero,
            adapt_state=adapt_state,
            direction=jnp.ones(dim, theta.dtype),
            rng_key=rng_key,
        )

    def _propose(state, theta, key):
        key_e, key_j = random.split(key)
        a = state.adapt_state
        e = random.normal(key_e, (dim,), theta.dtype)
        if proposal == "random_walk":
            root = a.mass_matrix_sqrt_inv  # root^T root = proposal covariance
            step = root.T @ e if dense_mass else root * e
            return a.step_size * step, 0
        var = jnp.diag(a.inverse_mass_matrix) if dense_mass else a.inverse_mass_matrix
        j = random.randint(key_j, (), 0, dim)
        size = a.step_size * jnp.sqrt(var[j]) * e[0]
        if proposal == "guided":
            size = state.direction[j] * jnp.abs(size)
        return jnp.zeros(dim, theta.dtype).at[j].set(size), j

    levels = sum_levels(noise_multiplier * sensitivity_factor, jnp.result_type(float))

    def release(z, z_new, clip, model_args, model_kwargs, key, key_batch):
        """The noisy (clipped, possibly subsampled) log-likelihood ratio, its sigma, and
        the prior's log ratio."""
        if batch_size is None:
            old = pm.log_density_terms(z, model_args, model_kwargs)
            new = pm.log_density_terms(z_new, model_args, model_kwargs)
            return *release_llr(
                key, new.loglik_rows - old.loglik_rows, clip, temperature=temperature,
                noise_multiplier=noise_multiplier, sensitivity_factor=sensitivity_factor,
                num_terms=pm.num_rows,
            ), new.prior - old.prior
        # The batch's sums where its rows live: only their integer totals cross devices.
        batch = sample_without_replacement(key_batch, pm.num_rows, batch_size)
        sums = batch_ratio_sums(pm, z, z_new, model_args, model_kwargs, batch, clip, levels)
        prior_ratio = (log_prior(pm, z_new, model_args, model_kwargs)
                       - log_prior(pm, z, model_args, model_kwargs))
        return *release_batch_sums(
            key, sums, batch_size, clip, pm.num_rows * temperature / batch_size,
            noise_multiplier=noise_multiplier, sensitivity_factor=sensitivity_factor,
        ), prior_ratio

    def sample_fn(state: DPPenaltyState, model_args: tuple, model_kwargs: dict, secret, *,
                  llr_clip):
        rng_key, key_prop, key_noise, key_u, key_batch = random.split(state.rng_key, 5)
        key_noise, key_batch = noise_key(secret, key_noise), noise_key(secret, key_batch)
        theta = pm.ravel(state.z)
        step, j = _propose(state, theta, key_prop)
        z_new = pm.unravel(theta + step)

        # The only data-dependent quantity: a clipped sum, released with noise.
        clip = llr_clip * jnp.linalg.norm(step)
        noisy_llr, sigma, prior_ratio = release(state.z, z_new, clip, model_args, model_kwargs,
                                                key_noise, key_batch)

        accept_prob, accepted = penalty_test(key_u, noisy_llr + prior_ratio, sigma)
        z = jax.tree.map(lambda a, b: jnp.where(accepted, a, b), z_new, state.z)
        direction = state.direction
        if proposal == "guided":  # keep the direction on accept, flip it on reject
            direction = direction.at[j].multiply(jnp.where(accepted, 1.0, -1.0))

        i = state.i
        adapt_state = state.adapt_state
        if num_warmup > 0:
            adapt_state = lax.cond(
                i < num_warmup,
                lambda a: wa_update(i, accept_prob, (pm.ravel(z),), a),
                identity,
                adapt_state,
            )
        mean_accept_prob = phase_mean(state.mean_accept_prob, accept_prob, i, num_warmup)
        info = DPPenaltyInfo(accept_prob, accepted, adapt_state.step_size)
        return DPPenaltyState(i + 1, z, info, mean_accept_prob, adapt_state, direction, rng_key)

    return init_fn, sample_fn


class DPPenalty(MassMatrix, DPKernel):
    """Differentially private Metropolis-Hastings by the penalty method.

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    llr_clip : float, optional
        ``b_l``: each per-row log-likelihood ratio is clipped to
        ``[-b_l h, b_l h]`` with ``h`` the proposal's step length.  Choose it so
        that few ratios are clipped (bias) but not much larger (noise).  A
        stated bound is public and costs nothing; when omitted,
        :class:`~numpyro_dp.PrivateMCMC` chooses it privately before the run
        (a DP quantile of the rows' log-likelihood slopes along the proposal's
        directions at the warm start, ``PrivateMCMC(clip_selection=)``).
    proposal_scale : float, optional
        Initial scale ``s`` in unconstrained space.  By default it is derived
        from the calibrated noise: the step length ``h`` whose released ratio
        carries noise of standard deviation 1 (``h = 1 / (z Delta_factor b_l
        T)``; ``s = h / sqrt(d)`` for the random walk), the largest step whose
        acceptance the noise does not swamp.
    proposal : {"random_walk", "one_coordinate", "guided"}
        Gaussian random walk in all coordinates; in one random coordinate
        (smaller ``h``, less noise); or the guided random walk (one coordinate,
        a persistent direction per coordinate that flips on rejection).
    noise_multiplier : float, optional
        ``z = sigma / Delta``; calibrated by :class:`~numpyro_dp.PrivateMCMC` when
        ``None``.
    temperature : float
        Multiplies every per-row log-likelihood.
    neighbourhood : {"substitute", "add_remove"}
    data_plate : str, optional
    init_strategy : callable
        NumPyro init strategy (prior-based; default ``init_to_uniform``).
    adapt_step_size : bool
        Tune the proposal scale ``s`` (the random walk's step size) in warm-up
        by dual averaging on the noisy acceptance probability towards
        ``target_accept_prob``.
    inverse_mass_matrix : array, optional
        Initial proposal covariance over the flattened unconstrained
        parameters (1-D for diagonal, 2-D for dense), NumPyro's name for it.
        By default the covariance of the private warm start's Laplace
        approximation when there is one, else the identity.
    adapt_mass_matrix : bool, optional
        Estimate the proposal covariance from warm-up draws (NumPyro's
        windows).  By default only when there is no private warm start: its
        Laplace covariance is the initial proposal covariance, and chains that
        noise keeps from moving would estimate one that shrinks every step.
    dense_mass : bool, optional
        Dense rather than diagonal proposal covariance; by default dense for
        the warm start's covariance up to 50 parameters, else diagonal.
    target_accept_prob : float, optional
        Defaults to 0.234 (random walk) or 0.44 (one coordinate, guided).

    Notes
    -----
    In float32 the per-row ratios are differences of two float32
    log-likelihoods, so ratios smaller than about 1e-7 |l_i| are lost; for very
    small steps or large |l_i| enable ``jax.config.update("jax_enable_x64", True)``
    (about twice the cost per iteration).  The privacy guarantee does not depend
    on the precision: clipping bounds every row's contribution in either case.
    """

    private_safe_fields = DPPenaltyState.published_fields
    default_fields = ("z", "accept_prob", "accepted")
    tunable = True
    #: Rows per test; ``None``: all ``n`` (:class:`DPMinibatchPenalty` sets it).
    batch_size: int | None = None

    @keyword_arguments
    def __init__(
        self,
        model: Callable,
        *,
        llr_clip: float | None = None,
        proposal_scale: float | None = None,
        proposal: str = "random_walk",
        noise_multiplier: float | None = None,
        temperature: float = 1.0,
        neighbourhood: str = "substitute",
        data_plate: str | None = None,
        init_strategy: Callable = init_to_uniform,
        adapt_step_size: bool = True,
        inverse_mass_matrix: Any = None,
        adapt_mass_matrix: bool | None = None,
        dense_mass: bool | None = None,
        target_accept_prob: float | None = None,
    ):
        super().__init__(
            model,
            noise_multiplier=noise_multiplier,
            neighbourhood=neighbourhood,
            temperature=temperature,
            data_plate=data_plate,
            init_strategy=init_strategy,
        )
        self.llr_clip = None if llr_clip is None else check_positive(
            "llr_clip", llr_clip,
            "it bounds each row's log-likelihood ratio per unit step (e.g. 0.1 to 10), "
            "or leave it None to have it chosen privately.",
        )
        self.proposal_scale = None if proposal_scale is None else check_positive(
            "proposal_scale", proposal_scale,
            "it is the random-walk standard deviation in unconstrained space, or leave "
            "it None to derive it from the noise.",
        )
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal={proposal!r}; use one of {PROPOSALS}.")
        self.proposal = proposal
        if target_accept_prob is None:
            target_accept_prob = 0.234 if proposal == "random_walk" else 0.44
        if not 0 < target_accept_prob < 1:
            raise ValueError(f"target_accept_prob={target_accept_prob} must lie in (0, 1).")
        self.target_accept_prob = target_accept_prob
        self.adapt_step_size = adapt_step_size
        self._set_mass(inverse_mass_matrix, dense_mass, adapt_mass_matrix)

    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """One Gaussian release of the clipped log-likelihood ratio (``noise_multiplier``
        defaults to the kernel's)."""
        return dpa.GaussianDpEvent(event_noise_multiplier(self, noise_multiplier))

    def clip_requests(self) -> tuple[ClipRequest, ...]:
        if self.llr_clip is not None:
            return ()
        scale = "directional" if self.proposal == "random_walk" else "coordinate"
        return (ClipRequest("llr_clip", LLR_CLIP_QUANTILE, scale),)

    def initial_proposal_scale(self) -> float:
        """``proposal_scale`` as stated, or derived from the calibrated noise (see above)."""
        if self.proposal_scale is not None:
            return self.proposal_scale
        pm = self._private_model
        trace, largest = metric_scales(self._mass()[2], pm.num_params)
        noise_per_unit_step = (
            event_noise_multiplier(self, None) * self.sensitivity_factor * self.llr_clip
            * self.temperature
        )
        if self.batch_size is not None:  # the batch sum is scaled by n / b
            noise_per_unit_step *= pm.num_rows / self.batch_size
        # A step s e has length about s sqrt(tr Sigma) (random walk) or
        # s sqrt(Sigma_jj) (one coordinate) under the proposal covariance Sigma.
        h = 1.0 / noise_per_unit_step
        reach = math.sqrt(trace if self.proposal == "random_walk" else largest)
        return min(h / reach, MAX_DEFAULT_SCALE)

    def tuned_clips(self) -> dict[str, float | None]:
        return {"llr_clip": self.llr_clip}

    def _core(self, num_warmup: int):
        if self.llr_clip is None:
            raise RuntimeError(
                "DPPenalty has no llr_clip: state one, or run it through PrivateMCMC "
                "with a budget (it chooses the clip privately)."
            )
        dense, adapt, covariance = self._mass()
        init_fn, sample_fn = dp_penalty(
            self._private_model,
            num_warmup,
            noise_multiplier=self.noise_multiplier,
            sensitivity_factor=self.sensitivity_factor,
            temperature=self.temperature,
            proposal=self.proposal,
            adapt_step_size=self.adapt_step_size,
            adapt_mass_matrix=adapt,
            dense_mass=dense,
            target_accept_prob=self.target_accept_prob,
            batch_size=self.batch_size,
        )
        scale = self.initial_proposal_scale()
        return (lambda params, key: init_fn(params, scale, covariance, key)), sample_fn

    def get_diagnostics_str(self, state: Any) -> str:
        return f"acc. prob={state.mean_accept_prob:.2f}, scale={state.proposal_scale:.2e}"


class DPMinibatchPenalty(DPPenalty):
    """The DP penalty test on a minibatch: Räisä (2020, s4.1).

    Each test uses ``b`` rows drawn without replacement instead of all ``n``:
    the released ratio is ``(n T / b) sum_B clip_c(r_j)`` less half its CLT
    batch variance, plus Gaussian noise (module docstring).  Its cost is the
    Gaussian's RDP amplified by the sampling (WBK,
    :mod:`numpyro_dp.accounting.rdp`), ``"substitute"`` neighbourhood only.

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    batch_size : int
        ``b``, at least 2 (the CLT correction needs a batch variance) and at
        most ``n``.  The noise grows like ``n / b``, so use a temperature
        ``T`` of order ``n0 / n`` (e.g. ``n0 = 100``).
    **penalty_arguments :
        Every other keyword of :class:`~numpyro_dp.DPPenalty`, with the same
        meaning; the signature lists them.

    Notes
    -----
    Approximate: the CLT correction makes the test exact only as the batch's
    log-likelihood ratio becomes Gaussian.
    """

    @keyword_arguments
    @extends(DPPenalty)
    def __init__(self, model: Callable, *, batch_size: int, **penalty_arguments: Any):
        super().__init__(model, **penalty_arguments)
        if not isinstance(batch_size, int) or batch_size < 2:
            raise ValueError(
                f"batch_size={batch_size!r} must be an integer >= 2 (the CLT correction "
                "needs a batch variance); use DPPenalty for the full data."
            )
        if self.neighbourhood != "substitute":
            raise ValueError(
                "DPMinibatchPenalty needs neighbourhood='substitute': fixed-size batches "
                "drawn without replacement are accounted for a public n."
            )
        self.batch_size = batch_size

    def prepare(self, model_args: tuple, model_kwargs: dict,
                row_layout: RowLayout | None = None, privacy_unit=None) -> PrivateModel:
        pm = super().prepare(model_args, model_kwargs, row_layout, privacy_unit)
        if self.batch_size > pm.num_rows:
            raise ValueError(
                f"batch_size={self.batch_size} exceeds the number of "
                f"{'units' if pm.units else 'rows'} n={pm.num_rows}; "
                "choose batch_size <= n, or DPPenalty for the full data."
            )
        return pm

    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """The batch release, amplified by sampling ``b`` of ``n`` rows without replacement.

        ``num_rows`` (n) is needed before the kernel has seen the data.
        """
        return dpa.SampledWithoutReplacementDpEvent(
            event_num_rows(self, num_rows), self.batch_size,
            super().per_iteration_event(noise_multiplier),
        )
