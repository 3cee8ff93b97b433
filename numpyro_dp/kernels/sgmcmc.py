"""Stochastic-gradient MCMC with differential privacy: DP-SGLD, DP-SGHMC, DP-SGNHT.

Welling & Teh (2011), Chen, Fox & Guestrin (2014), Ding et al. (2014);
Räisä, Koskela & Honkela (2021, s4.1), and the SG-HMC thesis of
docs/references.md (chapters 3 and 5).  Every step draws a minibatch
``B`` (Poisson with rate ``q = b / n``, or exactly ``b`` rows without
replacement) and estimates the log-likelihood gradient by

    ``G = T (n / b) sum_{j in B} clip_C(grad l_j(theta))``

(rows clipped one by one).  The step's Gaussian noise is the Gaussian
mechanism that privatises ``G``: no extra noise is added, and the kernels have
no accept/reject step, so they are *approximate* (see the class notes for the
bias of constant steps).  With ``Delta = 2`` (substitute) or ``1``
(add/remove) the noise multiplier of one step with step size ``eta`` is

* DP-SGLD:  ``theta <- theta + (eta/2)(grad log p + G) + N(0, eta I)``,
  ``z = sqrt(eta) / ((eta/2) T (n/b) Delta C)``;
* DP-SGHMC: ``theta <- theta + eta p``;
  ``p <- p + eta (grad log p + G) - eta C_f p + N(0, 2 C_f eta I)``,
  ``z = sqrt(2 C_f eta) / (eta T (n/b) Delta C)`` (correcting the SG-HMC thesis's
  friction sign, noise scale and aggregate clipping; the update here carries
  the n/b factor and is charged with it);
* DP-SGNHT: ``p <- p - xi eta p + eta (grad log p + G) + N(0, 2 A eta I)``;
  ``theta <- theta + eta p``; ``xi <- xi + eta (p^T p / d - 1)``,
  ``z = sqrt(2 A eta) / (eta T (n/b) Delta C)``.

Each step is one subsampled Gaussian release: ``num_steps`` per iteration.
Step sizes are constant or ``eta_t = step_size * t^(-1/3)`` (iteration
``t = 1, 2, ...``, warm-up included), so ``z_t`` grows with ``t`` and
:meth:`run_event` charges iterations ``start .. start + k - 1`` at their own
``z_t``.  The state holds only the parameters (and DP-SGNHT's momentum and
thermostat, the only dynamics that carry them over), which are
post-processing of the released noisy updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_uniform

from numpyro_dp.kernels.arguments import check_positive, event_num_rows, extends, keyword_arguments
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.kernels.sg_dynamics import (
    DPSGNHTState,
    DPSGState,
    dp_sghmc,
    dp_sgld,
    dp_sgnht,
    step_size_at,
    summed_rows,
)
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.primitives.batching import (
    poisson_buffer_size,
)
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.release import clipped_sum_sensitivity
from numpyro_dp.primitives.route_choice import ROUTES

BATCHINGS = ("poisson", "without_replacement")
SCHEDULES = ("constant", "decreasing")
#: Decreasing schedules are charged with z_t rounded down onto this geometric
#: grid, so that a long run composes few distinct events (epsilon <= ~1% high).
Z_GRID_RATIO = 1.01
#: Relative margin on every accounted z for the rounding of eta and of the noise
#: scale inside the compiled sampler (float32: relative errors of a few 1e-7).
Z_ROUNDING_MARGIN = 1e-5


#: :func:`~numpyro_dp.primitives.release.clipped_sum_sensitivity` for the accountant, on the
#: host: compiled once per public configuration (its jnp operations one by one took
#: 0.1 s a call, and a budget check makes a dozen).
_host_sensitivity = jax.jit(clipped_sum_sensitivity, static_argnums=(0, 2, 3, 5))


def check_num_steps(num_steps: int) -> int:
    if not (isinstance(num_steps, int) and num_steps >= 1):
        raise ValueError(
            f"num_steps={num_steps!r} must be a positive integer: each step is a "
            "charged release."
        )
    return num_steps


class _StochasticGradientKernel(DPKernel):
    """What DPSGLD, DPSGHMC and DPSGNHT share: batching, schedule, accounting."""

    private_safe_fields = DPSGState.published_fields
    default_fields = ("z",)
    calibrated_noise = False
    num_steps = 1

    @keyword_arguments
    def __init__(
        self,
        model: Callable,
        *,
        step_size: float,
        batch_size: int,
        grad_clip: float,
        batching: str = "poisson",
        step_schedule: str = "constant",
        temperature: float = 1.0,
        neighbourhood: str = "substitute",
        data_plate: str | None = None,
        grad_route: str = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        super().__init__(
            model, neighbourhood=neighbourhood, temperature=temperature,
            data_plate=data_plate, init_strategy=init_strategy,
        )
        self.step_size = check_positive(
            "step_size", step_size, "it is eta, the (initial) step size of the dynamics."
        )
        self.grad_clip = check_positive(
            "grad_clip", grad_clip, "every row's gradient is clipped to this l2 norm."
        )
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer.")
        self.batch_size = batch_size
        if batching not in BATCHINGS:
            raise ValueError(f"batching={batching!r}; use one of {BATCHINGS}.")
        if batching == "without_replacement" and neighbourhood != "substitute":
            raise ValueError(
                "Fixed-size batches (batching='without_replacement') are accounted "
                "under neighbourhood='substitute' only (n must stay public); use "
                "batching='poisson' for 'add_remove'."
            )
        self.batching = batching
        if step_schedule not in SCHEDULES:
            raise ValueError(f"step_schedule={step_schedule!r}; use one of {SCHEDULES}.")
        self.step_schedule = step_schedule
        if grad_route not in ROUTES:
            raise ValueError(f"grad_route={grad_route!r}; use one of {ROUTES}.")
        self.grad_route = grad_route

    # ------------------------------------------------------------ privacy
    def _noise_scale(self, eta):
        """Standard deviation of one step's noise at step size ``eta`` (floats or traced)."""
        raise NotImplementedError

    def _gradient_coefficient(self, eta):
        """Factor in front of ``G`` in the released quantity."""
        return eta

    def sum_noise(self, eta, num_rows: int | None = None):
        """Noise standard deviation of one step's released clipped sum, at step size ``eta``.

        The dynamics' noise divided by the factor in front of the sum in the
        update, ``c(eta) T n / b``.  The sampler adds exactly this noise, and
        :meth:`step_noise_multiplier` charges it: one formula for both.
        """
        n = event_num_rows(self, num_rows)
        return self._noise_scale(eta) / (
            self._gradient_coefficient(eta) * self.temperature * n / self.batch_size
        )

    def step_noise_multiplier(self, eta: float, num_rows: int | None = None) -> float:
        """``z`` of one step with step size ``eta`` (rounded down: never understated).

        ``sigma / Delta`` with ``Delta`` the sensitivity of the sum as computed
        (:func:`~numpyro_dp.primitives.release.clipped_sum_sensitivity`: clipping,
        summation and grid rounding), in the working precision.
        """
        n = event_num_rows(self, num_rows)
        dtype = jnp.result_type(float)
        dim = None if self._private_model is None else self._private_model.num_params
        sigma = float(self.sum_noise(eta, n))
        delta, _ = _host_sensitivity(
            summed_rows(n, self.batch_size, self.batching),
            vector_clip_bound(self.grad_clip, dim or 1, dtype),
            self.sensitivity_factor, dim or 1, sigma, dtype,
        )
        return sigma / float(delta) * (1.0 - Z_ROUNDING_MARGIN)

    def _step_event(self, z: float, n: int) -> dpa.DpEvent:
        if self.batching == "without_replacement":
            return dpa.SampledWithoutReplacementDpEvent(n, self.batch_size, dpa.GaussianDpEvent(z))
        q = self.batch_size / n
        return dpa.TruncatedSubsampledGaussianDpEvent(n, q, poisson_buffer_size(n, q), z)

    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """The first iteration's cost: ``num_steps`` subsampled Gaussian releases."""
        return self.run_event(1, 0, noise_multiplier, num_rows)

    def run_event(
        self,
        num_iterations: int,
        start: int = 0,
        noise_multiplier: float | None = None,
        num_rows: int | None = None,
    ) -> dpa.DpEvent:
        """Iterations ``t = start + 1 .. start + num_iterations``, each at its own ``z_t``.

        ``noise_multiplier`` is not accepted: the step size, clip and batch size
        fix the noise.
        """
        if noise_multiplier is not None:
            raise ValueError(
                f"{type(self).__name__}'s noise is fixed by step_size, grad_clip and "
                "batch_size (the dynamics' own noise is the mechanism); it has no "
                "noise_multiplier to plan with."
            )
        n = event_num_rows(self, num_rows)
        if self.step_schedule == "constant":
            z = self.step_noise_multiplier(self.step_size, n)
            return dpa.SelfComposedDpEvent(self._step_event(z, n), num_iterations * self.num_steps)
        t = np.arange(start + 1, start + num_iterations + 1, dtype=np.float64)
        z = np.array([self.step_noise_multiplier(e, n)
                      for e in step_size_at(self.step_size, "decreasing", t)])
        # Round z down onto a geometric grid so that equal cells compose at once.
        cells = np.floor(np.log(z) / math.log(Z_GRID_RATIO)).astype(np.int64)
        grid = Z_GRID_RATIO ** cells.astype(np.float64)
        cells = np.where(grid > z, cells - 1, cells)
        values, counts = np.unique(cells, return_counts=True)
        return dpa.ComposedDpEvent([
            dpa.SelfComposedDpEvent(
                self._step_event(float(Z_GRID_RATIO ** float(c)), n), int(k) * self.num_steps
            )
            for c, k in zip(values, counts, strict=True)
        ])

    def budget_advice(self) -> str:
        return (
            "run fewer iterations or chains, or raise the noise through the "
            "dynamics: a smaller step_size, grad_clip or batch_size (this kernel has "
            "no noise_multiplier), or state a larger budget"
        )

    # ----------------------------------------------------------- sampling
    def _grad_kwargs(self) -> dict:
        return {
            "batch_size": self.batch_size, "batching": self.batching,
            "grad_clip": self.grad_clip, "temperature": self.temperature,
            "grad_route": self.grad_route, "sum_noise": self.sum_noise,
        }

    def prepare(self, model_args: tuple, model_kwargs: dict,
                row_layout: RowLayout | None = None, privacy_unit=None) -> PrivateModel:
        pm = super().prepare(model_args, model_kwargs, row_layout, privacy_unit)
        if self.batch_size > pm.num_rows:
            raise ValueError(
                f"batch_size={self.batch_size} exceeds the number of "
                f"{'units' if pm.units else 'rows'} n={pm.num_rows}."
            )
        return pm

    def get_diagnostics_str(self, state: Any) -> str:
        return f"step size={state.step_size:.2e}"


_SG_PARAMETERS = """
    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    step_size : float
        ``eta`` (constant), or ``beta`` of ``eta_t = beta t^(-1/3)``.
    batch_size : int
        ``b``: rows per minibatch (expected size for Poisson sampling).
    grad_clip : float
        ``C``: every row's log-likelihood gradient is clipped to this l2 norm.
    batching : {"poisson", "without_replacement"}
        Poisson sampling with rate ``q = b / n`` (accounted by dp-accounting's
        PLD, tight), or exactly ``b`` rows without replacement (RDP bound of
        Wang, Balle & Kasiviswanathan, substitute only); the default
        ``PrivateMCMC(accountant="auto")`` picks the accountant.  Poisson gives the tighter
        epsilon for the same noise.
    step_schedule : {"constant", "decreasing"}
        Constant ``eta`` or ``eta_t = step_size * t^(-1/3)``.
    temperature, neighbourhood, data_plate :
        As for every kernel (:class:`~numpyro_dp.kernels.base.DPKernel`).
    grad_route : {"auto", "jacobian", "linear_predictor"}
        How the clipped per-row gradient sum is computed (all exact).
    init_strategy : callable
        NumPyro init strategy (prior-based; default ``init_to_uniform``).
"""


class DPSGLD(_StochasticGradientKernel):
    __doc__ = """Differentially private stochastic-gradient Langevin dynamics (DP-SGLD).

    ``theta <- theta + (eta/2)(grad log p(theta) + G) + N(0, eta I)``: the
    Langevin noise is the Gaussian mechanism, with noise multiplier
    ``z = sqrt(eta) / ((eta/2) T (n/b) Delta C)`` (``Delta = 2`` substitute,
    ``1`` add/remove) per iteration (one release).
""" + _SG_PARAMETERS + """
    Notes
    -----
    Approximate: without an accept step, a constant step size biases the
    draws.  On a Gaussian posterior with precision ``P`` the stationary
    variance is ``(eta + eta^2 V / 4) / (1 - (1 - eta P / 2)^2)`` instead of
    ``1/P``, with ``V`` the variance of the minibatch gradient estimate: too
    wide, more so for small batches.  Float32 and float64 are both private
    (rows are clipped before summing); float64 costs about twice as much.
"""

    def _noise_scale(self, eta):
        return eta**0.5

    def _gradient_coefficient(self, eta):
        return 0.5 * eta

    def _core(self, num_warmup: int):
        return dp_sgld(self._private_model, step_size=self.step_size,
                       schedule=self.step_schedule, **self._grad_kwargs())


class DPSGHMC(_StochasticGradientKernel):
    __doc__ = """Differentially private stochastic-gradient HMC (Chen, Fox & Guestrin 2014).

    Per iteration the momentum is drawn afresh, ``p ~ N(0, I)``, then
    ``num_steps`` steps of ``theta <- theta + eta p;
    p <- p + eta (grad log p(theta) + G) - eta C_f p + N(0, 2 C_f eta I)``
    (``B_hat = 0``).  Each step is one release with noise multiplier
    ``z = sqrt(2 C_f eta) / (eta T (n/b) Delta C)``.
""" + _SG_PARAMETERS + """
    num_steps : int
        Steps per iteration; each is a charged release.
    friction : float
        ``C_f``.

    Notes
    -----
    Approximate (no accept step): with a constant step size the stationary
    variance of a Gaussian posterior exceeds the exact one (the tests compute
    it from the linear recursion).  The SG-HMC thesis's version has the friction sign,
    the noise scale and the clipping wrong, and charges the release without the
    ``n/b`` factor that its update applies; this kernel charges the update it
    performs.
"""

    @keyword_arguments
    @extends(_StochasticGradientKernel)
    def __init__(self, model: Callable, *, num_steps: int = 10, friction: float = 1.0,
                 **sg_arguments):
        super().__init__(model, **sg_arguments)
        self.num_steps = check_num_steps(num_steps)
        self.friction = check_positive("friction", friction, "it is C_f, e.g. 1.0.")

    def _noise_scale(self, eta):
        return (2.0 * self.friction * eta) ** 0.5

    def _core(self, num_warmup: int):
        return dp_sghmc(self._private_model, step_size=self.step_size,
                        schedule=self.step_schedule, num_steps=self.num_steps,
                        friction=self.friction, **self._grad_kwargs())


class DPSGNHT(_StochasticGradientKernel):
    __doc__ = """Differentially private stochastic-gradient Nose-Hoover thermostat (DP-SGNHT).

    Ding et al. (2014), as compared by Räisä, Koskela & Honkela (2021, s4.1).  Per step
    ``p <- p - xi eta p + eta (grad log p(theta) + G) + N(0, 2 A eta I)``,
    ``theta <- theta + eta p``, ``xi <- xi + eta (p^T p / d - 1)``; momentum
    and thermostat carry over between iterations.  Each step is one release
    with noise multiplier ``z = sqrt(2 A eta) / (eta T (n/b) Delta C)``.
""" + _SG_PARAMETERS + """
    num_steps : int
        Steps per iteration; each is a charged release.
    diffusion : float
        ``A``, the injected noise; the thermostat starts at ``xi = A``.

    Notes
    -----
    Approximate (no accept step); the thermostat absorbs the unknown
    minibatch-gradient noise only as ``eta -> 0``.
"""

    private_safe_fields = DPSGNHTState.published_fields

    @keyword_arguments
    @extends(_StochasticGradientKernel)
    def __init__(self, model: Callable, *, num_steps: int = 1, diffusion: float = 1.0,
                 **sg_arguments):
        super().__init__(model, **sg_arguments)
        self.num_steps = check_num_steps(num_steps)
        self.diffusion = check_positive("diffusion", diffusion, "it is A, e.g. 1.0.")

    def _noise_scale(self, eta):
        return (2.0 * self.diffusion * eta) ** 0.5

    def _core(self, num_warmup: int):
        return dp_sgnht(self._private_model, step_size=self.step_size,
                        schedule=self.step_schedule, num_steps=self.num_steps,
                        diffusion=self.diffusion, **self._grad_kwargs())
