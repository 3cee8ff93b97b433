"""What warm-up adapts and starts from: the step size and the mass matrix.

NumPyro's warm-up adapter with one change (:func:`warmup_adapter`), the
running means of a phase (:func:`phase_mean`), and the rules that choose a
run's initial inverse mass matrix (DPPenalty's proposal covariance) from
public numbers only: the stated matrix, the warm start's Laplace covariance
and the noise level (:func:`initial_mass`, :func:`moves_freely`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import hmc_util

#: One noise-limited step of at least this many unit-information posterior sds
#: lets warm-up re-estimate the mass matrix after a warm start (see
#: :func:`moves_freely`).
FREE_STEP_SDS = 10.0
#: Largest number of parameters for which the warm start's covariance is used
#: as a dense mass matrix (or proposal covariance) by default.
DENSE_PRECONDITIONER_MAX_DIM = 50


def phase_mean(mean: jax.Array, value: jax.Array, i: jax.Array, num_warmup: int) -> jax.Array:
    """Running mean of ``value`` over the current phase (restarted after warm-up)."""
    n = jnp.where(i < num_warmup, i, i - num_warmup)
    return mean + (value - mean) / (n + 1)


def warmup_adapter(
    num_warmup: int,
    *,
    adapt_step_size: bool,
    adapt_mass_matrix: bool,
    dense_mass: bool,
    target_accept_prob: float,
) -> tuple[Callable, Callable]:
    """NumPyro's :func:`~numpyro.infer.hmc_util.warmup_adapter`, with one change.

    Without mass-matrix adaptation the step size is tuned by *one* dual
    averaging over the whole warm-up, ending at its averaged iterate.
    NumPyro restarts dual averaging at ten times the step at the end of every
    mass-matrix window, whether or not the mass matrix is adapted; on a noisy
    acceptance the 50-iteration terminal window then ends with a step several
    times too large (measured: acceptance 0.06-0.2 after warm-up for a
    target of 0.234).
    """
    wa_init, wa_update = hmc_util.warmup_adapter(
        num_warmup, adapt_step_size=adapt_step_size, adapt_mass_matrix=adapt_mass_matrix,
        dense_mass=dense_mass, target_accept_prob=target_accept_prob,
    )
    if adapt_mass_matrix or not adapt_step_size:
        return wa_init, wa_update
    _, ss_update = hmc_util.dual_averaging()

    def update(t, accept_prob, z_info, state):
        ss_state = ss_update(target_accept_prob - accept_prob, state.ss_state)
        log_step, log_step_avg, *_ = ss_state
        step = jnp.exp(jnp.where(t == num_warmup - 1, log_step_avg, log_step))
        finfo = jnp.finfo(jnp.result_type(step))
        return state._replace(step_size=jnp.clip(step, finfo.tiny, finfo.max), ss_state=ss_state)

    return wa_init, update


def check_mass_arguments(kernel: str, inverse_mass_matrix, dense_mass: bool | None) -> None:
    """Refuse mass-matrix arguments that ``kernel`` (DPHMC, DPPenalty) cannot use."""
    if dense_mass not in (None, True, False):
        raise ValueError(
            f"dense_mass={dense_mass!r} must be True, False or None: "
            f"{kernel} uses one (diagonal or dense) mass matrix over all "
            "flattened unconstrained parameters; NumPyro's per-site blocks are not "
            "supported."
        )
    if isinstance(inverse_mass_matrix, dict):
        raise ValueError(
            "inverse_mass_matrix must be one array over the flattened unconstrained "
            "parameters (1-D for diagonal, 2-D with dense_mass=True), not a dict of "
            "per-site blocks."
        )


def initial_mass(
    stated, dense: bool | None, adapt: bool | None, warm, dim: int, free: bool
) -> tuple[bool, bool, np.ndarray | None]:
    """``(dense, adapt, inverse)``: a run's initial inverse mass matrix.

    For DPPenalty it is the proposal covariance.  A ``stated``
    ``inverse_mass_matrix`` wins (``dense`` follows its shape when None).
    Otherwise the warm start's Laplace covariance ``warm``, if any: dense
    (when ``dense`` is None) up to :data:`DENSE_PRECONDITIONER_MAX_DIM`
    parameters, and not re-estimated in warm-up (when ``adapt`` is None)
    unless the noise is light (``free``, :func:`moves_freely`): under heavy
    noise the chains move too little for their draws to estimate it, and
    NumPyro's estimate would shrink the steps instead.
    Otherwise the identity (None), adapted as in NumPyro.
    """
    warm = warm if stated is None else None
    # NumPy: public numbers, concrete even while a chain is traced
    dtype = np.dtype(jnp.result_type(float))
    if stated is not None:
        stated = np.asarray(stated, dtype)
        dense = stated.ndim == 2 if dense is None else dense
        expected = (dim, dim) if dense else (dim,)
        if stated.shape != expected:
            raise ValueError(
                f"inverse_mass_matrix has shape {stated.shape}; with dense_mass={dense} "
                f"and {dim} unconstrained parameters it must have shape {expected}."
            )
    if dense is None:
        dense = warm is not None and dim <= DENSE_PRECONDITIONER_MAX_DIM
    if adapt is None:
        adapt = warm is None or free
    inverse = stated
    if warm is not None:
        inverse = np.asarray(warm if dense else np.diag(warm), dtype)
    return dense, adapt, inverse


def moves_freely(num_rows: int, sensitivity_factor: float, noise_multiplier: float | None) -> bool:
    """Whether one noise-limited step spans :data:`FREE_STEP_SDS` unit-information sds.

    ``sqrt(n) / (Delta_factor z)`` (the planner's step, :mod:`numpyro_dp.runner.planning`):
    public.  Then the chains move enough for their warm-up draws to estimate
    a mass matrix (proposal covariance), which may also correct directions
    that the warm start's noisy curvature could not resolve.
    """
    if noise_multiplier is None:
        return False
    return math.sqrt(num_rows) / (sensitivity_factor * noise_multiplier) >= FREE_STEP_SDS


def metric_scales(inverse, dim: int) -> tuple[float, float]:
    """``(trace, largest diagonal entry)`` of an initial inverse metric (identity: None)."""
    if inverse is None:
        return float(dim), 1.0
    diag = np.diag(np.asarray(inverse)) if np.ndim(inverse) == 2 else np.asarray(inverse)
    return float(np.sum(diag)), float(np.max(diag))


class MassMatrix:
    """Mixin of the kernels with a mass matrix (DPHMC; DPPenalty's proposal covariance):
    NumPyro's ``inverse_mass_matrix``, ``dense_mass`` and ``adapt_mass_matrix``,
    checked when given and resolved against the warm start before a run."""

    def _set_mass(self, inverse_mass_matrix, dense_mass: bool | None,
                  adapt_mass_matrix: bool | None) -> None:
        check_mass_arguments(type(self).__name__, inverse_mass_matrix, dense_mass)
        self.inverse_mass_matrix = inverse_mass_matrix
        self.dense_mass = dense_mass
        self.adapt_mass_matrix = adapt_mass_matrix

    def _mass(self) -> tuple[bool, bool, np.ndarray | None]:
        """``(dense, adapt, inverse)``: the coming run's initial inverse mass matrix
        (:func:`initial_mass`)."""
        pm = self._private_model
        free = moves_freely(pm.num_rows, self.sensitivity_factor, self.noise_multiplier)
        return initial_mass(self.inverse_mass_matrix, self.dense_mass, self.adapt_mass_matrix,
                            self._preconditioner, pm.num_params, free)

    def prepare(self, model_args: tuple, model_kwargs: dict, row_layout=None,
                privacy_unit=None):
        pm = super().prepare(model_args, model_kwargs, row_layout, privacy_unit)
        if self.inverse_mass_matrix is not None:
            self._mass()  # a stated matrix's shape is checked before any charge
        return pm
