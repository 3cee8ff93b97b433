"""DP-HMC: Hamiltonian Monte Carlo on noisy clipped gradients with a penalty test.

Räisä, Koskela & Honkela (2021), Algorithm 1.  Per
iteration, from theta_0 with momentum p_0 ~ N(0, M):

1. leapfrog with the noisy gradient
   ``g(theta) = T sum_i clip_{b_g}(grad l_i(theta)) + N(0, sigma_g^2 I) + grad log p(theta)``,
   ``sigma_g = z_g * Delta_g``, ``Delta_g = 2 T b_g`` (substitute) or ``T b_g``
   (add/remove): half kick, L - 1 (drift, full kick), drift, half kick, i.e.
   L + 1 gradient releases, each with fresh noise;
2. h = ||theta_L - theta_0||, c = b_l h,
   ``R = T sum_i clip_c(l_i(theta_L) - l_i(theta_0))``, released as
   ``R + xi``, ``xi ~ N(0, sigma_l^2)``, ``sigma_l = z_l * Delta_l`` with
   ``Delta_l = 2 T c`` (substitute) or ``T c``;
3. ``Delta_H = R + xi + log p(theta_L) - log p(theta_0) + K(p_0) - K(p_L)``;
   accept iff ``log u < Delta_H - sigma_l^2 / 2``.

Privacy cost of one iteration: one Gaussian release with noise multiplier
``z_l`` and L + 1 with ``z_g`` (zCDP ``rho = 1/(2 z_l^2) + (L+1)/(2 z_g^2)``),
declared by :meth:`DPHMC.per_iteration_event`.  If no log-likelihood ratio is
clipped, the chain targets the exact tempered posterior whatever the gradient
noise and clipping (Räisä, Koskela & Honkela 2021, Thm 3.3): those only lower the acceptance rate.

Everything a state carries is a post-processing of the releases: the
trajectory is a function of the released noisy gradients and the (public)
prior, the acceptance probability of the released ``R + xi``.  The exact
potential energy and gradient, which NumPyro's ``HMCState`` carries, are never
stored.
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
from numpyro_dp.kernels.arguments import check_positive, event_noise_multiplier, keyword_arguments
from numpyro_dp.kernels.base import ClipRequest, DPKernel
from numpyro_dp.kernels.ratios import penalty_test, release_llr
from numpyro_dp.kernels.running import carries_info
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.gradients import clipped_grad_sum_fn
from numpyro_dp.primitives.release import release_clipped_sum
from numpyro_dp.primitives.rounding import sum_levels
from numpyro_dp.primitives.route_choice import ROUTES
from numpyro_dp.primitives.secret import noise_key

#: Quantiles of the rows' gradient norms that privately chosen clips cover.  A
#: clipped ratio biases the target; clipped gradients do not, but they steer
#: every trajectory towards where the clipped gradients balance, which on real
#: data lies posterior sds away from the mode (9 sds on statsmodels' ``fair``
#: with a quarter of the rows clipped): proposals then miss and chains stick.
GRAD_CLIP_QUANTILE = 0.95
LLR_CLIP_QUANTILE = 0.95
#: Default step-size jitter with the warm start's mass matrix.
WARM_START_JITTER = 0.5
#: Cap of the noise-derived initial step size (unconstrained units).
MAX_DEFAULT_STEP_SIZE = 1.0


class DPHMCInfo(NamedTuple):
    """One DP-HMC transition; every field is safe to publish.

    Attributes
    ----------
    accept_prob : float
        Noisy acceptance probability ``min(1, exp(Delta_H - sigma_l^2 / 2))``.
    accepted : bool
        Whether the proposal was accepted.
    diverging : bool
        The trajectory left the finite numbers or the noisy energy error
        exceeded 1000 (computed from released values only).
    step_size : float
        Step size used in this iteration (after jitter).
    num_steps : int
        Leapfrog steps per iteration (fixed: each one is a charged release).
    """

    accept_prob: jax.Array
    accepted: jax.Array
    diverging: jax.Array
    step_size: jax.Array
    num_steps: jax.Array


@carries_info(DPHMCInfo)
class DPHMCState(NamedTuple):
    """State of :class:`DPHMC`; every field is safe to publish.

    The fields of ``info`` (:class:`DPHMCInfo`) are readable on the state too:
    ``state.accept_prob``, ``extra_fields=("accept_prob", "diverging")``.

    Attributes
    ----------
    i : int
        Iteration counter (warm-up included).
    z : dict
        Current point in unconstrained space.
    info : DPHMCInfo
        The last transition.
    mean_accept_prob : float
        Running mean of the noisy ``accept_prob`` (reset after warm-up).
    adapt_state : HMCAdaptState
        NumPyro's adaptation state (step size by dual averaging on the noisy
        acceptance probability, mass matrix from the chain's draws).
    halton_shift : float
        Random shift of this chain's Halton sequence (step-size jitter).
    rng_key : jax.random key
    """

    i: jax.Array
    z: dict
    info: DPHMCInfo
    mean_accept_prob: jax.Array
    adapt_state: HMCAdaptState
    halton_shift: jax.Array
    rng_key: jax.Array


def van_der_corput(i: jax.Array) -> jax.Array:
    """Base-2 radical inverse of the integer ``i`` (the 1-D Halton sequence)."""
    bits = (i.astype(jnp.uint32) >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return jnp.sum(bits * 0.5 ** jnp.arange(1, 33, dtype=jnp.float32))


def split_noise_multiplier(
    noise_multiplier: float, num_steps: int, llr_budget_fraction: float
) -> tuple[float, float]:
    """``(z_grad, z_llr)`` whose iteration has zCDP ``1 / (2 noise_multiplier^2)``.

    A fraction ``llr_budget_fraction`` of the per-iteration zCDP goes to the
    LLR release, the rest is shared equally by the ``num_steps + 1`` gradient
    releases.
    """
    z_llr = noise_multiplier / math.sqrt(llr_budget_fraction)
    z_grad = noise_multiplier * math.sqrt((num_steps + 1) / (1.0 - llr_budget_fraction))
    return z_grad, z_llr


def dp_hmc(
    private_model: PrivateModel,
    num_warmup: int,
    *,
    num_steps: int,
    noise_multiplier_grad: float,
    noise_multiplier_llr: float,
    sensitivity_factor: float,
    temperature: float = 1.0,
    step_size_jitter: float = 0.0,
    adapt_step_size: bool = True,
    adapt_mass_matrix: bool = True,
    dense_mass: bool = False,
    target_accept_prob: float = 0.8,
    grad_route: str = "auto",
    proposal_variance_factor: float = 1.0,
) -> tuple[Callable, Callable]:
    """Functional core of DP-HMC (and of DP-MALA, its one-step case).

    ``proposal_variance_factor`` ``a`` draws the momentum from ``N(0, a M)``
    and uses the kinetic energy ``p^T M^-1 p / (2 a)``; with one step this is
    the MALA proposal ``N(theta + (eta^2/2) M^-1 g, a eta^2 M^-1)``.  ``a = 1``
    is ordinary HMC.

    Returns
    -------
    init_fn(init_params, step_size, inverse_mass_matrix, rng_key) -> DPHMCState
    sample_fn(state, model_args, model_kwargs, secret, *, grad_clip, llr_clip) -> DPHMCState
        ``secret`` is the run secret (:mod:`numpyro_dp.primitives.secret`): every noise
        draw comes from it; momenta and the accept test use the state's key.
        ``grad_clip`` (``b_g``) and ``llr_clip`` (``b_l``) are the clips, given
        at every call (BlackJAX style: the core is built once from its
        settings, tuned numbers arrive as arguments and may be traced).
    """
    pm = private_model
    dim = pm.num_params
    clipped_sum, _ = clipped_grad_sum_fn(pm, grad_route)
    levels = sum_levels(noise_multiplier_grad * sensitivity_factor, jnp.result_type(float))
    wa_init, wa_update = warmup_adapter(
        num_warmup,
        adapt_step_size=adapt_step_size,
        adapt_mass_matrix=adapt_mass_matrix,
        dense_mass=dense_mass,
        target_accept_prob=target_accept_prob,
    )

    def init_fn(init_params: dict, step_size: float, inverse_mass_matrix, rng_key):
        rng_key, key_wa, key_shift = random.split(rng_key, 3)
        theta = pm.ravel(init_params)
        adapt_state = wa_init(
            (theta,), key_wa, step_size, inverse_mass_matrix=inverse_mass_matrix,
            mass_matrix_size=dim,
        )
        zero = jnp.zeros((), theta.dtype)
        return DPHMCState(
            i=jnp.array(0),
            z=init_params,
            info=DPHMCInfo(zero, jnp.array(False), jnp.array(False), adapt_state.step_size,
                           jnp.array(num_steps)),
            mean_accept_prob=zero,
            adapt_state=adapt_state,
            halton_shift=random.uniform(key_shift, (), theta.dtype),
            rng_key=rng_key,
        )

    def sample_fn(state: DPHMCState, model_args: tuple, model_kwargs: dict, secret, *,
                  grad_clip, llr_clip) -> DPHMCState:
        rng_key, key_p, key_grads, key_llr, key_u = random.split(state.rng_key, 5)
        a = state.adapt_state
        inv_mass = a.inverse_mass_matrix
        theta0 = pm.ravel(state.z)

        def velocity(p):
            return inv_mass @ p if dense_mass else inv_mass * p

        def kinetic(p):
            return 0.5 * jnp.dot(velocity(p), p) / proposal_variance_factor

        def prior(theta):
            return pm.log_density_terms(pm.unravel(theta), model_args, model_kwargs).prior

        def noisy_grad(theta, key):  # one Gaussian release (plus the public prior)
            total = clipped_sum(theta, grad_clip, model_args, model_kwargs, levels=levels)
            released, _ = release_clipped_sum(
                noise_key(secret, key), total, pm.num_rows,
                vector_clip_bound(grad_clip, dim, theta.dtype),
                noise_multiplier=noise_multiplier_grad, sensitivity_factor=sensitivity_factor,
            )
            return temperature * released + jax.grad(prior)(theta)

        # Step-size jitter by a randomised Halton sequence (Räisä, Koskela & Honkela
        # 2021, s3): constant within a trajectory, so the invariant distribution
        # is unchanged.
        u = jnp.mod(van_der_corput(state.i + 1).astype(theta0.dtype) + state.halton_shift, 1.0)
        eta = a.step_size * (1.0 + step_size_jitter * (2.0 * u - 1.0))

        eps = random.normal(key_p, (dim,), theta0.dtype)
        root = a.mass_matrix_sqrt
        p0 = math.sqrt(proposal_variance_factor) * (root @ eps if dense_mass else root * eps)
        keys = random.split(key_grads, num_steps + 1)
        p = p0 + 0.5 * eta * noisy_grad(theta0, keys[0])

        def leapfrog(s, carry):
            theta, p = carry
            theta = theta + eta * velocity(p)
            kick = jnp.where(s < num_steps, eta, 0.5 * eta)
            return theta, p + kick * noisy_grad(theta, keys[s])

        theta1, p1 = lax.fori_loop(1, num_steps + 1, leapfrog, (theta0, p))

        # The penalty test on the clipped log-likelihood ratio.
        old = pm.log_density_terms(pm.unravel(theta0), model_args, model_kwargs)
        new = pm.log_density_terms(pm.unravel(theta1), model_args, model_kwargs)
        clip = llr_clip * jnp.linalg.norm(theta1 - theta0)
        noisy_llr, sigma_llr = release_llr(
            noise_key(secret, key_llr), new.loglik_rows - old.loglik_rows, clip,
            temperature=temperature,
            noise_multiplier=noise_multiplier_llr, sensitivity_factor=sensitivity_factor,
            num_terms=pm.num_rows,
        )
        delta_h = noisy_llr + new.prior - old.prior + kinetic(p0) - kinetic(p1)
        delta_h = jnp.where(jnp.all(jnp.isfinite(theta1)), delta_h, jnp.nan)
        diverging = ~jnp.isfinite(delta_h) | (delta_h < -1000.0)
        accept_prob, accepted = penalty_test(key_u, delta_h, sigma_llr)
        theta = jnp.where(accepted, theta1, theta0)

        i = state.i
        if num_warmup > 0:
            a = lax.cond(
                i < num_warmup,
                lambda a: wa_update(i, accept_prob, (theta,), a),
                identity,
                a,
            )
        mean_accept_prob = phase_mean(state.mean_accept_prob, accept_prob, i, num_warmup)
        info = DPHMCInfo(accept_prob, accepted, diverging, eta, state.info.num_steps)
        return DPHMCState(i + 1, pm.unravel(theta), info, mean_accept_prob, a,
                          state.halton_shift, rng_key)

    return init_fn, sample_fn


class DPHMC(MassMatrix, DPKernel):
    """Differentially private Hamiltonian Monte Carlo (DP-HMC).

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    step_size : float, optional
        Leapfrog step size ``eta`` in unconstrained space (initial value when
        ``adapt_step_size``).  By default derived from the calibrated noise:
        the largest ``eta`` at which neither the LLR noise over a trajectory
        (length about ``L eta sqrt(d)``) nor the energy error of the noisy
        kicks (about ``eta sigma_g sqrt(L d)``) exceeds one standard deviation,
        capped at 1.
    num_steps : int
        Leapfrog steps ``L`` per iteration; each iteration makes ``L + 1``
        gradient releases, so ``L`` is part of the privacy cost.
    grad_clip : float, optional
        ``b_g``: every row's log-likelihood gradient is clipped to this l2 norm.
    llr_clip : float, optional
        ``b_l``: every row's log-likelihood ratio is clipped to ``b_l h`` with
        ``h = ||theta_L - theta_0||``.  If no ratio is clipped the chain is exact.
        Stated clips are public and cost nothing; an omitted one is chosen
        privately by :class:`~numpyro_dp.PrivateMCMC` before the run (a DP
        quantile of the rows' gradient norms at the warm start,
        ``PrivateMCMC(clip_selection=)``).
    noise_multiplier_grad, noise_multiplier_llr : float, optional
        ``z_g`` and ``z_l``.  Give both, or neither and let
        :class:`~numpyro_dp.PrivateMCMC` calibrate them to a budget.
    llr_budget_fraction : float
        When calibrated: the fraction of each iteration's zCDP spent on the LLR
        release; the rest is split equally among the ``L + 1`` gradient
        releases, so that ``1/z_l^2 = f / z^2`` and ``(L + 1)/z_g^2 = (1 - f) / z^2``
        for the calibrated per-iteration multiplier ``z``.  The reference
        settings of the DP-HMC paper spend about 0.54 on the LLR.
    temperature, neighbourhood, data_plate :
        As for every kernel (:class:`~numpyro_dp.kernels.base.DPKernel`).
    inverse_mass_matrix : array, optional
        Initial inverse mass matrix over the flattened unconstrained parameters
        (1-D for diagonal, 2-D for dense).  By default the covariance of the
        private warm start's Laplace approximation when there is one
        (``PrivateMCMC(warm_start=)``), else the identity.
    dense_mass : bool, optional
        Dense rather than diagonal mass matrix.  By default dense for the warm
        start's covariance up to 50 parameters, else diagonal.
    adapt_step_size : bool
        Dual averaging of ``eta`` in warm-up on the noisy acceptance probability.
    adapt_mass_matrix : bool, optional
        Estimate the mass matrix from warm-up draws (NumPyro's windows).  By
        default only when there is no warm start's covariance (chains that
        noise keeps from moving would estimate a mass matrix that shrinks
        every step).
    target_accept_prob : float
        Target of the step-size adaptation (as in NumPyro).
    step_size_jitter : float, optional
        ``j`` in [0, 1): each iteration uses ``eta (1 + j (2 u_t - 1))`` with
        ``u_t`` a randomised Halton sequence (van der Corput, random shift per
        chain).  ``0`` keeps ``eta`` fixed, as NumPyro's HMC does; the default
        is 0 with the identity or a stated mass matrix and
        :data:`WARM_START_JITTER` with the warm start's, which makes the target
        nearly isotropic, so that trajectories of fixed length would be nearly
        periodic (antithetic draws, misleading R-hat).
        The DP-HMC paper's code uses ``eta u_t``, i.e. ``j = 1`` with half its
        nominal step size.
    grad_route : {"auto", "jacobian", "linear_predictor"}
        How the per-row clipped gradient sum is computed (see
        :mod:`numpyro_dp.primitives.gradients`); all routes are exact.
        ``"auto"`` picks from the model's program and the data's shapes
        (:func:`numpyro_dp.primitives.route_choice.select_route` says which and
        why); a forced ``"linear_predictor"`` raises on a model without a
        narrow cut.
    init_strategy : callable
        NumPyro init strategy (prior-based; default ``init_to_uniform``).

    Notes
    -----
    Float32 and float64 are both correct for privacy (every row is clipped
    before summing, whatever the rounding).  In float32 a log-likelihood ratio
    is a difference of two float32 sums and loses about 1e-7 |l_i| per row;
    enable ``jax_enable_x64`` when the per-row ratios are tiny, at about twice
    the cost per iteration.
    """

    private_safe_fields = DPHMCState.published_fields
    default_fields = ("z", "accept_prob", "accepted", "diverging")
    tunable = True
    #: Momentum variance factor ``a`` (1 for HMC; :class:`~numpyro_dp.DPMALA` sets it).
    proposal_variance_factor = 1.0

    @keyword_arguments
    def __init__(
        self,
        model: Callable,
        *,
        step_size: float | None = None,
        num_steps: int = 10,
        grad_clip: float | None = None,
        llr_clip: float | None = None,
        noise_multiplier_grad: float | None = None,
        noise_multiplier_llr: float | None = None,
        llr_budget_fraction: float = 0.5,
        temperature: float = 1.0,
        neighbourhood: str = "substitute",
        data_plate: str | None = None,
        inverse_mass_matrix: Any = None,
        dense_mass: bool | None = None,
        adapt_step_size: bool = True,
        adapt_mass_matrix: bool | None = None,
        target_accept_prob: float = 0.8,
        step_size_jitter: float | None = None,
        grad_route: str = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        if not (isinstance(num_steps, int) and num_steps >= 1):
            raise ValueError(
                f"num_steps={num_steps!r} must be a positive integer: each leapfrog "
                "step is a charged gradient release."
            )
        if not 0 < llr_budget_fraction < 1:
            raise ValueError(
                f"llr_budget_fraction={llr_budget_fraction!r} must lie in (0, 1): both "
                "the gradients and the log-likelihood ratio need some of the budget."
            )
        if (noise_multiplier_grad is None) != (noise_multiplier_llr is None):
            raise ValueError(
                "Give both noise_multiplier_grad and noise_multiplier_llr, or neither "
                "(PrivateMCMC then calibrates them to the budget, splitting it by "
                "llr_budget_fraction)."
            )
        self.num_steps = num_steps
        self.llr_budget_fraction = float(llr_budget_fraction)
        noise_multiplier = None
        if noise_multiplier_grad is not None:
            for name, z in (("noise_multiplier_grad", noise_multiplier_grad),
                            ("noise_multiplier_llr", noise_multiplier_llr)):
                check_positive(name, z, "or leave both None and give PrivateMCMC a budget.")
            # The single Gaussian multiplier with the same per-iteration zCDP.
            noise_multiplier = 1.0 / math.sqrt(
                1.0 / noise_multiplier_llr**2 + (num_steps + 1) / noise_multiplier_grad**2
            )
        self._explicit = (
            None if noise_multiplier_grad is None
            else (float(noise_multiplier_grad), float(noise_multiplier_llr))
        )
        super().__init__(
            model,
            noise_multiplier=noise_multiplier,
            neighbourhood=neighbourhood,
            temperature=temperature,
            data_plate=data_plate,
            init_strategy=init_strategy,
        )
        self.step_size = None if step_size is None else check_positive(
            "step_size", step_size,
            "it is the leapfrog step in unconstrained space (None: derived from the noise).",
        )
        self.grad_clip = None if grad_clip is None else check_positive(
            "grad_clip", grad_clip,
            "it bounds the l2 norm of each row's log-likelihood gradient (None: chosen "
            "privately).",
        )
        self.llr_clip = None if llr_clip is None else check_positive(
            "llr_clip", llr_clip,
            "it bounds each row's log-likelihood ratio per unit of trajectory length "
            "(None: chosen privately).",
        )
        if step_size_jitter is not None and not 0 <= step_size_jitter < 1:
            raise ValueError(f"step_size_jitter={step_size_jitter!r} must lie in [0, 1).")
        if not 0 < target_accept_prob < 1:
            raise ValueError(f"target_accept_prob={target_accept_prob} must lie in (0, 1).")
        self.step_size_jitter = None if step_size_jitter is None else float(step_size_jitter)
        self.target_accept_prob = target_accept_prob
        self._set_mass(inverse_mass_matrix, dense_mass, adapt_mass_matrix)
        self.adapt_step_size = adapt_step_size
        if grad_route not in ROUTES:
            raise ValueError(f"grad_route={grad_route!r}; use one of {ROUTES}.")
        self.grad_route = grad_route

    # ------------------------------------------------------------ privacy
    def configure(self, *, noise_multiplier: float | None = None, **settings) -> None:
        previous = self.noise_multiplier
        super().configure(noise_multiplier=noise_multiplier, **settings)
        if noise_multiplier is not None and noise_multiplier != previous:
            # A new per-iteration z replaces a stated (z_grad, z_llr) pair: the
            # sampler must draw the noise that the runner charges.
            self._explicit = None

    def noise_multipliers(self, noise_multiplier: float | None = None) -> tuple[float, float]:
        """``(z_grad, z_llr)``: explicit, or split from the per-iteration ``noise_multiplier``."""
        # The runner charges the kernel's own (combined) z: the stated pair is what runs.
        if self._explicit is not None and noise_multiplier in (None, self.noise_multiplier):
            return self._explicit
        z = event_noise_multiplier(self, noise_multiplier)
        return split_noise_multiplier(z, self.num_steps, self.llr_budget_fraction)

    @property
    def noise_multiplier_grad(self) -> float | None:
        return None if self.noise_multiplier is None else self.noise_multipliers()[0]

    @property
    def noise_multiplier_llr(self) -> float | None:
        return None if self.noise_multiplier is None else self.noise_multipliers()[1]

    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """One LLR release and ``num_steps + 1`` gradient releases (``num_rows`` unused)."""
        z_grad, z_llr = self.noise_multipliers(noise_multiplier)
        return dpa.ComposedDpEvent([
            dpa.GaussianDpEvent(z_llr),
            dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z_grad), self.num_steps + 1),
        ])

    # ------------------------------------------------------------ sampling
    def _jitter(self) -> float:
        if self.step_size_jitter is not None:
            return self.step_size_jitter
        warm = self._preconditioner is not None and self.inverse_mass_matrix is None
        return WARM_START_JITTER if warm else 0.0

    def clip_requests(self) -> tuple[ClipRequest, ...]:
        wanted = (("grad_clip", GRAD_CLIP_QUANTILE), ("llr_clip", LLR_CLIP_QUANTILE))
        return tuple(ClipRequest(name, q) for name, q in wanted if getattr(self, name) is None)

    @property
    def warm_start_clip(self) -> float | None:
        return self.grad_clip

    def initial_step_size(self) -> float:
        """``step_size`` as stated, or derived from the calibrated noise (see above)."""
        if self.step_size is not None:
            return self.step_size
        z_grad, z_llr = self.noise_multipliers()
        # With inverse mass Sigma the velocity has norm about sqrt(tr Sigma): the
        # trajectory is about L eta sqrt(tr Sigma) long, and the noisy kicks move
        # the energy by about eta sigma_g sqrt(L tr Sigma).
        trace, _ = metric_scales(self._mass()[2], self._private_model.num_params)
        steps = self.num_steps
        unit = self.sensitivity_factor * self.temperature
        by_llr = 1.0 / (z_llr * unit * self.llr_clip * steps * math.sqrt(trace))
        by_grad = 1.0 / (z_grad * unit * self.grad_clip * math.sqrt(steps * trace))
        return min(by_llr, by_grad, MAX_DEFAULT_STEP_SIZE)

    def tuned_clips(self) -> dict[str, float | None]:
        return {"grad_clip": self.grad_clip, "llr_clip": self.llr_clip}

    def _core(self, num_warmup: int):
        if self.grad_clip is None or self.llr_clip is None:
            raise RuntimeError(
                f"{type(self).__name__} has no grad_clip or llr_clip: state them, or run "
                "it through PrivateMCMC with a budget (it chooses them privately)."
            )
        z_grad, z_llr = self.noise_multipliers()
        dense, adapt, inv_mass = self._mass()
        init_fn, sample_fn = dp_hmc(
            self._private_model,
            num_warmup,
            num_steps=self.num_steps,
            noise_multiplier_grad=z_grad,
            noise_multiplier_llr=z_llr,
            sensitivity_factor=self.sensitivity_factor,
            temperature=self.temperature,
            step_size_jitter=self._jitter(),
            adapt_step_size=self.adapt_step_size,
            adapt_mass_matrix=adapt,
            dense_mass=dense,
            target_accept_prob=self.target_accept_prob,
            grad_route=self.grad_route,
            proposal_variance_factor=self.proposal_variance_factor,
        )
        step_size = self.initial_step_size()
        return (lambda params, key: init_fn(params, step_size, inv_mass, key)), sample_fn

    def get_diagnostics_str(self, state: Any) -> str:
        return f"acc. prob={state.mean_accept_prob:.2f}, step size={state.step_size:.2e}"
