"""What every differentially private kernel shares.

A :class:`DPKernel` is a NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel`
that additionally

* declares the privacy cost of one iteration as a ``DpEvent``
  (:meth:`DPKernel.per_iteration_event`), next to its algorithm, so that
  sampling and accounting cannot drift apart;
* lists the state fields that are safe to publish (:attr:`private_safe_fields`);
* refuses to run unless a :class:`~numpyro_dp.PrivateMCMC` charges it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting as dpa
import jax
import jax.numpy as jnp
from jax import random, vmap
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import is_prng_key

from numpyro_dp.accounting import check_neighbourhood, sensitivity_factor
from numpyro_dp.model import PrivateModel


def check_positive(name: str, value: float, fix: str) -> float:
    """Reject a non-positive or non-finite tuning constant, naming the fix."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {fix}")
    return float(value)


def clip_ratios(ratio: jax.Array, clip: jax.Array) -> jax.Array:
    """Per-row log-likelihood ratios clipped to ``[-clip, clip]``.

    A NaN ratio (e.g. a proposal outside a row's support) counts as the worst
    case ``-clip``, so every row's contribution stays bounded by the clip.
    """
    return jnp.clip(jnp.where(jnp.isnan(ratio), -clip, ratio), -clip, clip)


def gaussian_release(key: jax.Array, value: jax.Array, sigma: jax.Array) -> jax.Array:
    """``value + N(0, sigma^2)``: every Gaussian mechanism of the kernels goes through here."""
    return value + sigma * random.normal(key, jnp.shape(value), jnp.result_type(value))


def release_llr(
    key: jax.Array,
    ratio: jax.Array,
    clip: jax.Array,
    *,
    temperature: float,
    noise_multiplier: float,
    sensitivity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """The full-data penalty release ``T sum_i clip_c(r_i) + N(0, sigma^2)`` and its sigma.

    ``sigma = z * Delta`` with ``Delta = sensitivity_factor * T * clip``: one row
    moves the clipped sum by at most that much.
    """
    sigma = noise_multiplier * sensitivity_factor * temperature * clip
    return gaussian_release(key, temperature * jnp.sum(clip_ratios(ratio, clip)), sigma), sigma


def penalty_test(
    key: jax.Array, noisy_log_ratio: jax.Array, sigma: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The penalty method's accept step: accept iff ``log u < lambda_hat - sigma^2 / 2``.

    ``noisy_log_ratio`` is the released (noisy) log acceptance ratio and
    ``sigma`` the standard deviation of its noise, symmetric in the two points.
    A non-finite ratio rejects.  Returns the noisy acceptance probability
    ``min(1, exp(lambda_hat - sigma^2 / 2))`` and the decision, both
    post-processing of the release.
    """
    log_accept = noisy_log_ratio - 0.5 * sigma**2
    log_accept = jnp.where(jnp.isfinite(log_accept), log_accept, -jnp.inf)
    accept_prob = jnp.exp(jnp.minimum(log_accept, 0.0))
    accepted = jnp.log(random.uniform(key, (), jnp.result_type(log_accept))) < log_accept
    return accept_prob, accepted


def phase_mean(mean: jax.Array, value: jax.Array, i: jax.Array, num_warmup: int) -> jax.Array:
    """Running mean of ``value`` over the current phase (restarted after warm-up)."""
    n = jnp.where(i < num_warmup, i, i - num_warmup)
    return mean + (value - mean) / (n + 1)


class DPKernel(MCMCKernel):
    """Base class of the differentially private kernels.

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    noise_multiplier : float, optional
        ``z = sigma / Delta`` of the kernel's Gaussian releases.  Leave it
        ``None`` to let :class:`~numpyro_dp.PrivateMCMC` calibrate it to an
        (epsilon, delta) budget.
    neighbourhood : {"substitute", "add_remove"}
        Which data sets count as neighbours (SPEC s0).
    temperature : float
        ``T`` in (0, 1]: every per-row log-likelihood is multiplied by it.
    data_plate : str, optional
        Name of the plate over rows (auto-detected when unambiguous).
    init_strategy : callable
        A NumPyro init strategy; it sees only the priors, never the data.
    """

    sample_field = "z"
    #: State fields that may leave the kernel (all post-processing of releases).
    private_safe_fields: tuple[str, ...] = ()
    #: Accountants that can charge this kernel (see ``PrivateMCMC(accountant=)``).
    accountants: tuple[str, ...] = ("pld", "rdp")
    #: False for kernels whose noise is fixed by their own parameters (batch size,
    #: step size): there is nothing to calibrate, and an epsilon is only a cap.
    calibrated_noise: bool = True

    def __init__(
        self,
        model: Callable,
        *,
        noise_multiplier: float | None = None,
        neighbourhood: str = "substitute",
        temperature: float = 1.0,
        data_plate: str | None = None,
        init_strategy: Callable = init_to_uniform,
    ):
        self._model = model
        if noise_multiplier is not None:
            check_positive(
                "noise_multiplier", noise_multiplier,
                "or leave it None and give PrivateMCMC an epsilon and delta.",
            )
        self.noise_multiplier = noise_multiplier
        self.neighbourhood = check_neighbourhood(neighbourhood)
        if not (isinstance(temperature, (int, float)) and 0 < temperature <= 1):
            raise ValueError(
                f"temperature={temperature!r} must lie in (0, 1]; 1 is the "
                "ordinary posterior."
            )
        self.temperature = float(temperature)
        self.data_plate = data_plate
        self._init_strategy = init_strategy
        self._private_model: PrivateModel | None = None
        self._sample_fn = None
        self._charged_by = None  # the PrivateMCMC that accounts for this kernel

    @property
    def model(self) -> Callable:
        return self._model

    @property
    def sensitivity_factor(self) -> float:
        """l2-sensitivity, in units of the clip bound, of a sum of clipped rows."""
        return sensitivity_factor(self.neighbourhood)

    def prepare(self, model_args: tuple, model_kwargs: dict) -> PrivateModel:
        """Analyse and validate the model and data (raises on bad input)."""
        self._private_model = PrivateModel(
            self._model, model_args, model_kwargs, data_plate=self.data_plate
        )
        self._sample_fn = None
        return self._private_model

    def per_iteration_event(self, noise_multiplier: float | None = None) -> dpa.DpEvent:
        """The privacy cost of one iteration of one chain."""
        raise NotImplementedError

    def run_event(
        self, num_iterations: int, start: int = 0, noise_multiplier: float | None = None
    ) -> dpa.DpEvent:
        """The privacy cost of one chain's iterations ``start, ..., start + num_iterations - 1``.

        The default composes :meth:`per_iteration_event`; kernels whose cost
        changes over time (decreasing step sizes) override it.
        """
        return dpa.SelfComposedDpEvent(self.per_iteration_event(noise_multiplier), num_iterations)

    def _require_runner(self, noise_multiplier: float | None) -> PrivateModel:
        if self._charged_by is None or self._private_model is None:
            raise RuntimeError(
                f"{type(self).__name__} must be run by numpyro_dp.PrivateMCMC, which "
                "charges every iteration to the privacy ledger; plain "
                "numpyro.infer.MCMC would release draws without accounting."
            )
        if noise_multiplier is None and self.calibrated_noise:
            raise RuntimeError(
                f"{type(self).__name__} has no noise multiplier: give PrivateMCMC an "
                "epsilon and delta to calibrate it, or pass noise_multiplier=."
            )
        return self._private_model

    def _init_chains(self, rng_key, init_params, model_args, model_kwargs, init_fn, sample_fn):
        """Initialise one chain or a batch of chains (one key each), as NumPyro does.

        ``init_fn(params, rng_key)`` builds a chain's state from unconstrained
        ``params``; those come from the user or from the prior, never the data.
        """
        pm = self._private_model

        def init_one(key, params):
            key_init, key_state = random.split(key)
            if params is None:
                params = pm.init_params(key_init, model_args, model_kwargs, self._init_strategy)
            return init_fn(params, key_state)

        if is_prng_key(rng_key):
            self._sample_fn = sample_fn
            return init_one(rng_key, init_params)
        self._sample_fn = vmap(sample_fn, in_axes=(0, None, None))
        return vmap(init_one)(rng_key, init_params)

    def sample(self, state, model_args, model_kwargs):
        return self._sample_fn(state, model_args, model_kwargs)

    def postprocess_fn(self, args: tuple, kwargs: dict) -> Callable:
        pm = self._private_model

        def constrain(z):
            return pm.constrain(z, args, kwargs)

        return constrain
