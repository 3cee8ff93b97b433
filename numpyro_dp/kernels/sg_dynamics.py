"""The functional core of the stochastic-gradient kernels (:mod:`numpyro_dp.kernels.sgmcmc`).

Their State and Info; the released minibatch gradient estimate
(:func:`noisy_gradient_fn`, one subsampled Gaussian release per step); the
step-size schedule (:func:`step_size_at`); and the loop the three dynamics
share, with each one's step: :func:`dp_sgld`, :func:`dp_sghmc`,
:func:`dp_sgnht` return ``(init_fn, sample_fn)`` of a chain.  The kernel
classes, their argument checks and their accounting are in
:mod:`~numpyro_dp.kernels.sgmcmc`, whose docstring states the updates and
their noise multipliers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax, random

from numpyro_dp.kernels.running import carries_info
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.batching import (
    poisson_batch,
    poisson_buffer_size,
    sample_without_replacement,
)
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.gradients import clipped_grad_sum_fn
from numpyro_dp.primitives.release import release_sum_with_noise
from numpyro_dp.primitives.rounding import sum_levels
from numpyro_dp.primitives.secret import noise_key


class DPSGInfo(NamedTuple):
    """One iteration of a stochastic-gradient kernel; safe to publish.

    Attributes
    ----------
    step_size : float
        Step size ``eta_t`` of the iteration (public: the schedule's).
    """

    step_size: jax.Array


@carries_info(DPSGInfo)
class DPSGState(NamedTuple):
    """State of DP-SGLD and DP-SGHMC; every field is safe to publish.

    ``state.step_size`` is ``state.info.step_size``.  Neither carries a
    momentum between iterations (DP-SGHMC draws it afresh each time).

    Attributes
    ----------
    i : int
        Iteration counter (warm-up included); iteration ``t = i + 1`` is next.
    z : dict
        Current point in unconstrained space.
    info : DPSGInfo
        The last iteration.
    rng_key : jax.random key
    """

    i: jax.Array
    z: dict
    info: DPSGInfo
    rng_key: jax.Array


@carries_info(DPSGInfo)
class DPSGNHTState(NamedTuple):
    """State of DP-SGNHT; every field is safe to publish.

    Attributes
    ----------
    i : int
        Iteration counter (warm-up included); iteration ``t = i + 1`` is next.
    z : dict
        Current point in unconstrained space.
    info : DPSGInfo
        The last iteration.
    momentum : array
        Momentum after the last step (post-processing of the releases).
    thermostat : float
        Nose-Hoover thermostat ``xi``.
    rng_key : jax.random key
    """

    i: jax.Array
    z: dict
    info: DPSGInfo
    momentum: jax.Array
    thermostat: jax.Array
    rng_key: jax.Array


def step_size_at(step_size: float, schedule: str, t):
    """``eta_t``: ``step_size`` or ``step_size * t^(-1/3)`` (``t`` from 1)."""
    return step_size if schedule == "constant" else step_size * t ** (-1.0 / 3.0)


def noisy_gradient_fn(
    pm: PrivateModel,
    *,
    batch_size: int,
    batching: str,
    grad_clip: float,
    temperature: float,
    grad_route: str,
    sum_noise: Callable,
    step_size: float,
) -> Callable:
    """``(theta, eta, key, secret, model_args, model_kwargs) -> G_hat``: the released estimate.

    ``G_hat = T (n / b) (sum_{j in B} clip_C(grad l_j) + N(0, s^2))`` with
    ``s = sum_noise(eta)``: the dynamics' own noise, moved in front of the
    factor that multiplies ``G`` in the update, so ``c(eta) G_hat`` has exactly
    the update's ``N(0, noise_scale(eta)^2)``.  One subsampled Gaussian release
    (:func:`~numpyro_dp.primitives.release.release_sum_with_noise`); batch and noise
    come from the run secret.  Its cost per call depends on ``batch_size``
    (Poisson: the buffer), not on ``n``.
    """
    n = pm.num_rows
    clipped_sum, _ = clipped_grad_sum_fn(pm, grad_route)
    scale = temperature * n / batch_size
    num_terms = summed_rows(n, batch_size, batching)
    # The first iteration's step is the largest, so its noise is the smallest.
    levels = sum_levels(float(sum_noise(step_size)) / grad_clip, jnp.result_type(float))

    def noisy_gradient(theta, eta, key, secret, model_args, model_kwargs):
        key_batch, key_noise = random.split(key)
        key_batch, key_noise = noise_key(secret, key_batch), noise_key(secret, key_noise)
        if batching == "poisson":
            idx, mask = poisson_batch(key_batch, n, batch_size / n, num_terms)
        else:
            idx, mask = sample_without_replacement(key_batch, n, batch_size), None
        total = clipped_sum(theta, grad_clip, model_args, model_kwargs, idx, mask, levels)
        row_bound = vector_clip_bound(grad_clip, pm.num_params, theta.dtype)
        released = release_sum_with_noise(key_noise, total, num_terms, row_bound, sum_noise(eta))
        return scale * released

    return noisy_gradient


def summed_rows(num_rows: int, batch_size: int, batching: str) -> int:
    """Rows a minibatch sum adds up: ``b``, or the Poisson buffer (padded slots are 0)."""
    if batching == "poisson":
        return poisson_buffer_size(num_rows, batch_size / num_rows)
    return batch_size


def _sg_core(
    private_model: PrivateModel,
    move: Callable,
    *,
    step_size: float,
    schedule: str,
    num_steps: int,
    momentum: str,
    grad_kwargs: dict,
    thermostat: float = 0.0,
) -> tuple[Callable, Callable]:
    """Shared loop of the three kernels; ``move`` is one step of the dynamics.

    ``move(theta, p, xi, eta, key, grad, prior_grad) -> (theta, p, xi)`` with
    ``grad(theta, key)`` the released minibatch estimate ``G_hat``.  ``momentum``:
    ``"none"`` (DP-SGLD), ``"fresh"`` (drawn each iteration: DP-SGHMC) or
    ``"carried"`` between iterations with the thermostat, which starts at
    ``thermostat`` (DP-SGNHT: :class:`DPSGNHTState`).
    """
    pm = private_model
    dim = pm.num_params
    noisy_gradient = noisy_gradient_fn(pm, step_size=step_size, **grad_kwargs)
    carried = momentum == "carried"

    def init_fn(init_params: dict, rng_key):
        theta = pm.ravel(init_params)
        rng_key, key_p = random.split(rng_key)
        info = DPSGInfo(jnp.asarray(step_size, theta.dtype))
        if carried:
            return DPSGNHTState(jnp.array(0), init_params, info,
                                random.normal(key_p, (dim,), theta.dtype),
                                jnp.asarray(thermostat, theta.dtype), rng_key)
        return DPSGState(jnp.array(0), init_params, info, rng_key)

    def sample_fn(state, model_args: tuple, model_kwargs: dict, secret):
        rng_key, key_p, key_steps = random.split(state.rng_key, 3)
        theta = pm.ravel(state.z)
        eta = step_size_at(step_size, schedule, (state.i + 1).astype(theta.dtype))
        eta = jnp.asarray(eta, theta.dtype)

        def prior_grad(t):
            return jax.grad(
                lambda u: pm.log_density_terms(pm.unravel(u), model_args, model_kwargs).prior
            )(t)

        def grad(t, key):
            return noisy_gradient(t, eta, key, secret, model_args, model_kwargs)

        if carried:
            p, xi = state.momentum, state.thermostat
        else:
            p = (random.normal(key_p, (dim,), theta.dtype) if momentum == "fresh"
                 else jnp.zeros(dim, theta.dtype))
            xi = jnp.zeros((), theta.dtype)
        keys = random.split(key_steps, num_steps)

        def step(s, carry):
            return move(*carry, eta, keys[s], grad, prior_grad)

        theta, p, xi = lax.fori_loop(0, num_steps, step, (theta, p, xi))
        info = DPSGInfo(eta)
        if carried:
            return DPSGNHTState(state.i + 1, pm.unravel(theta), info, p, xi, rng_key)
        return DPSGState(state.i + 1, pm.unravel(theta), info, rng_key)

    return init_fn, sample_fn


def dp_sgld(private_model: PrivateModel, *, step_size, schedule, **grad_kwargs):
    """Functional core of DP-SGLD: ``(init_fn, sample_fn)`` as in :func:`_sg_core`.

    ``theta + (eta/2)(grad log p + G_hat)``: ``G_hat``'s noise is the Langevin
    noise ``N(0, eta I)``.
    """

    def move(theta, p, xi, eta, key, grad, prior_grad):
        return theta + 0.5 * eta * (prior_grad(theta) + grad(theta, key)), p, xi

    return _sg_core(
        private_model, move, step_size=step_size, schedule=schedule, num_steps=1,
        momentum="none", grad_kwargs=grad_kwargs,
    )


def dp_sghmc(private_model: PrivateModel, *, step_size, schedule, num_steps, friction,
             **grad_kwargs):
    """Functional core of DP-SGHMC (identity mass, momentum resampled per iteration).

    ``G_hat``'s noise is the friction noise ``N(0, 2 C_f eta I)`` of the kick.
    """

    def move(theta, p, xi, eta, key, grad, prior_grad):
        theta = theta + eta * p
        return theta, p + eta * (prior_grad(theta) + grad(theta, key)) - eta * friction * p, xi

    return _sg_core(
        private_model, move, step_size=step_size, schedule=schedule, num_steps=num_steps,
        momentum="fresh", grad_kwargs=grad_kwargs,
    )


def dp_sgnht(private_model: PrivateModel, *, step_size, schedule, num_steps, diffusion,
             **grad_kwargs):
    """Functional core of DP-SGNHT (Ding et al. 2014, Algorithm 1; thermostat starts at A).

    ``G_hat``'s noise is the injected ``N(0, 2 A eta I)``.
    """
    dim = private_model.num_params

    def move(theta, p, xi, eta, key, grad, prior_grad):
        p = p - xi * eta * p + eta * (prior_grad(theta) + grad(theta, key))
        theta = theta + eta * p
        return theta, p, xi + eta * (jnp.dot(p, p) / dim - 1.0)

    return _sg_core(
        private_model, move, step_size=step_size, schedule=schedule, num_steps=num_steps,
        momentum="carried", thermostat=diffusion, grad_kwargs=grad_kwargs,
    )
