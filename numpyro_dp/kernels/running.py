"""A kernel's side of NumPyro's MCMC contract: its inputs, its State, its chains.

What :class:`~numpyro_dp.PrivateMCMC` passes a kernel as its model arguments
(:class:`RunInputs`, refused unless the kernel is armed:
:func:`armed_inputs`); the State that carries the last transition's Info
(:func:`carries_info`); and one chain or a batch of chains initialised from
the prior or the user's values and stepped as NumPyro does
(:func:`init_chains`, :func:`chain_sampler`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
from jax import random, vmap
from numpyro.util import is_prng_key

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives.sharding import chains_split


class RunInputs(NamedTuple):
    """What :class:`~numpyro_dp.PrivateMCMC` passes to a kernel as its model arguments.

    All are arguments of the compiled sampler, never constants of it: the rows
    and the secret because JAX's persistent compilation cache would write
    constants to disk (neither is ever stored in a state); the public values
    (:meth:`~numpyro_dp.kernels.base.DPKernel.public_inputs`: a DP kernel's
    privately chosen clips, :class:`~numpyro_dp.NoiseAwareNUTS`'s release) so
    that a re-run on new ones runs the same program.  Build them with
    :meth:`~numpyro_dp.kernels.base.DPKernel.run_inputs`.
    """

    rows: tuple  # the model's row arrays (private), see PrivateModel.private_inputs
    secret: jax.Array  # uint32[2], the run secret (numpyro_dp.primitives.secret)
    public: dict  # released values by name (a kernel's tuned clips), the core's arguments


def carries_info(info_type: type) -> Callable[[type], type]:
    """Class decorator of a kernel's State whose ``info`` field holds an ``info_type``.

    Each Info field becomes a read-only attribute of the State
    (``state.accept_prob`` is ``state.info.accept_prob``), so
    ``extra_fields=("accept_prob",)`` reads the Info as NumPyro users expect;
    ``published_fields`` lists the State's fields and the Info's.
    """

    def decorate(state_type: type) -> type:
        clash = set(state_type._fields) & set(info_type._fields)
        if "info" not in state_type._fields or clash:
            raise TypeError(f"{state_type.__name__} needs an info field and no Info field "
                            f"names of its own ({sorted(clash)})")
        for name in info_type._fields:
            setattr(state_type, name, property(
                lambda state, name=name: getattr(state.info, name),
                doc=f"``info.{name}`` of the last transition ({info_type.__name__}).",
            ))
        state_type.info_type = info_type
        state_type.published_fields = state_type._fields + info_type._fields
        return state_type

    return decorate


def armed_inputs(kernel: str, armed: bool, model_args: tuple, model_kwargs: dict) -> RunInputs:
    """The :class:`RunInputs` of a run of ``kernel``, which only an ``armed`` kernel
    (:meth:`~numpyro_dp.kernels.base.DPKernel.armed`) given them alone accepts."""
    inputs = model_args[0] if len(model_args) == 1 else None
    if not armed or not isinstance(inputs, RunInputs) or model_kwargs:
        raise RuntimeError(
            f"{kernel} must be run by numpyro_dp.PrivateMCMC, which "
            "charges every iteration of every chain to the privacy ledger before "
            "it runs; numpyro.infer.MCMC or a direct call would release draws "
            "without accounting. Use ndp.PrivateMCMC(kernel, ...).run(key, *data)."
        )
    return inputs


def init_chains(pm: PrivateModel, init_strategy: Callable, rng_key, init_params,
                model_args: tuple, model_kwargs: dict, init_fn: Callable):
    """Initialise one chain or a batch of chains (one key each), as NumPyro does.

    ``init_fn(params, rng_key)`` builds a chain's state from unconstrained
    ``params``; those come from the user or, drawn by ``init_strategy``, from
    the prior, never the data.
    """

    def init_one(key, params):
        key_init, key_state = random.split(key)
        if params is None:
            params = pm.init_params(key_init, model_args, model_kwargs, init_strategy)
        return init_fn(params, key_state)

    if is_prng_key(rng_key):
        return init_one(rng_key, init_params)
    return vmap(init_one)(rng_key, init_params)


def chain_sampler(one: Callable, batched: bool) -> Callable:
    """``sample_fn(state, model_args, model_kwargs, secret, clips)`` of one chain or,
    ``batched``, of a batch of chains (:func:`init_chains`).

    ``one(state, model_args, model_kwargs, secret, **clips)`` steps one chain;
    ``clips`` (:attr:`RunInputs.public`) are the same for every chain.
    """

    def step(state, model_args, model_kwargs, secret, clips):
        return one(state, model_args, model_kwargs, secret, **clips)

    def sample_fn(state, model_args, model_kwargs, secret, clips):
        if not batched:
            return step(state, model_args, model_kwargs, secret, clips)
        # Chains split over a mesh axis stay on their devices (chains_split).
        chains = vmap(step, in_axes=(0, None, None, None, None))
        return chains_split(chains(chains_split(state), model_args, model_kwargs, secret,
                                   clips))

    return sample_fn
