"""The chains of a :class:`~numpyro_dp.PrivateMCMC` call: how many (checked against
what is charged, before any charge), on which devices, and where they start (the
tuning releases, already charged, then the warm start dispersed).

Functions of the runner; the budget's decisions are :mod:`numpyro_dp.runner.budget`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from numpyro.util import is_prng_key

from numpyro_dp.accounting import check_delta_for_rows
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.model.adapter import PrivateModel, tabular_to_numpy
from numpyro_dp.model.checks import row_leaves
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.numpyro_compat import warmup_state
from numpyro_dp.primitives.sharding import (
    CHAIN_AXIS,
    DATA_AXIS,
    RunMesh,
    automatic,
    automatic_mesh,
    check_layout_given,
    check_run_mesh,
    mesh_on,
    rows_mesh,
    shard_rows,
)
from numpyro_dp.runner.tuning import TuningPlan, run_tuning
from numpyro_dp.runner.warm_start import prior_point

#: Folded into the user's key to give the tuning releases their own public keys.
TUNING_KEY_TAG = 0x74756E65
#: Chains start at the warm start plus this many times its dispersion (per
#: coordinate, :class:`~numpyro_dp.TuningResult`) times a standard normal, in
#: antithetic pairs: spread like its noise-aware Laplace approximation, so that
#: R-hat can tell chains that stayed apart and frozen chains still pool to a
#: sensible approximation.
CHAIN_DISPERSION = 1.0


def first_key(rng_key):
    """The call's key, or the first chain's of a batch of keys."""
    return rng_key if is_prng_key(rng_key) else rng_key[0]


# ------------------------------------------------------------------ checks
def check_chain_options(num_chains, chain_method: str, mesh, max_noise_multiplier) -> None:
    """``PrivateMCMC``'s chain options: the chains run are the chains charged."""
    if not isinstance(num_chains, int) or num_chains < 1:
        raise ValueError("num_chains must be a positive integer")
    if chain_method not in ("parallel", "sequential", "vectorized"):
        raise ValueError(
            f"chain_method={chain_method!r}: use 'parallel', 'sequential' or "
            "'vectorized'. A custom chain method could run other chains than "
            "the num_chains that are charged."
        )
    if mesh is not None:
        check_run_mesh(mesh)
    if not (isinstance(max_noise_multiplier, (int, float)) and max_noise_multiplier > 0):
        raise ValueError(f"max_noise_multiplier={max_noise_multiplier!r} must be > 0.")


def check_sampler(sampler) -> None:
    """Refuse a kernel that is not private, or one another runner already accounts."""
    if not isinstance(sampler, DPKernel):
        raise TypeError(
            f"PrivateMCMC needs a differentially private kernel (DPPenalty, ...), "
            f"got {type(sampler).__name__}; for non-private inference use "
            "numpyro.infer.MCMC."
        )
    if sampler._charged_by is not None:
        raise ValueError(
            f"This {type(sampler).__name__} is already accounted by another "
            "PrivateMCMC. Keep using that runner (its ledger accumulates over "
            "runs) or build a new kernel: a second runner would start a second, "
            "separate ledger for the same data."
        )


def check_call(mcmc, rng_key, extra_fields) -> None:
    """What a call asks of the chains (fields, keys, a continued state), before any charge."""
    check_extra_fields(mcmc.sampler, extra_fields)
    check_keys(mcmc, rng_key)
    check_post_warmup_state(mcmc)


def check_extra_fields(kernel, extra_fields) -> None:
    """Only the kernel's private-safe fields may be published with the draws."""
    for field in extra_fields:
        top = field.lstrip("~").split(".")[0]
        if top not in kernel.private_safe_fields:
            raise ValueError(
                f"extra field {field!r} is not a private-safe field of "
                f"{type(kernel).__name__}; allowed: {kernel.private_safe_fields}."
            )


def check_keys(mcmc, rng_key) -> None:
    """One key, or exactly ``num_chains`` keys: the number of chains charged."""
    if is_prng_key(rng_key):
        return
    shape = jnp.shape(rng_key)
    typed = jnp.issubdtype(jnp.asarray(rng_key).dtype, jax.dtypes.prng_key)
    batch = shape[:-1] if not typed else shape
    if mcmc.num_chains > 1 and batch == (mcmc.num_chains,):
        return
    raise ValueError(
        f"rng_key must be one PRNG key or a batch of exactly num_chains="
        f"{mcmc.num_chains} keys (one per chain); got a batch of shape {batch}. "
        "Each chain is charged to the privacy budget, so the number of chains run "
        "must be the number planned: pass one key, or set num_chains."
    )


def check_init_params(mcmc, init_params, param_shapes: dict) -> None:
    if init_params is None:
        return
    if not isinstance(init_params, dict) or set(init_params) != set(param_shapes):
        raise ValueError(
            f"init_params must be a dict of unconstrained values for the latent "
            f"sites {sorted(param_shapes)}."
        )
    lead = (mcmc.num_chains,) if mcmc.num_chains > 1 else ()
    for name, shape in param_shapes.items():
        if tuple(jnp.shape(init_params[name])) != lead + shape:
            raise ValueError(
                f"init_params[{name!r}] has shape {tuple(jnp.shape(init_params[name]))}; "
                f"with num_chains={mcmc.num_chains} it must be {lead + shape} "
                "(one value per chain: each chain is charged)."
            )


def check_post_warmup_state(mcmc) -> None:
    state = warmup_state(mcmc)
    if state is None:
        return
    lead = (mcmc.num_chains,) if mcmc.num_chains > 1 else ()
    if tuple(jnp.shape(getattr(state, "i", ()))) != lead:
        raise ValueError(
            f"post_warmup_state holds {jnp.shape(getattr(state, 'i', ()))[:1] or 1} "
            f"chain(s) but num_chains={mcmc.num_chains}: continue the chains the "
            "state holds (each chain run is charged)."
        )


# ----------------------------------------------------------------- devices
def place_rows(mcmc, args: tuple, kwargs: dict, row_layout: RowLayout | None):
    """``(args, kwargs, row_layout)`` with the rows on the runner's mesh's data axis,
    padded by :func:`shard_rows`, where it has one and they are not placed yet (the
    rows found from the model's structure alone, :func:`row_leaves`)."""
    mesh = None if mcmc.mesh is None else automatic_mesh(mcmc.mesh)
    if mesh is None or mesh.shape.get(DATA_AXIS, 1) <= 1:
        return args, kwargs, row_layout
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    index = row_leaves(mcmc.sampler.model, args, kwargs, mcmc.sampler.data_plate)
    if rows_mesh([leaves[i] for i in index]) is not None:
        return args, kwargs, row_layout
    if row_layout is not None:
        raise ValueError(
            "row_layout was given for rows that are not on the mesh; pass the "
            "unpadded rows (PrivateMCMC(mesh=) places and pads them) or the "
            "arrays that ndp.shard_rows(mesh, ...) returned."
        )
    *rows, row_layout = shard_rows(mesh, *(leaves[i] for i in index))
    for i, row in zip(index, rows, strict=True):
        leaves[i] = row
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    return args, kwargs, row_layout


def run_mesh(mcmc, rows: tuple) -> RunMesh | None:
    """The call's mesh (None for one device): where its rows lie, else the runner's, else
    a chain axis over ``num_chains`` devices for ``chain_method="parallel"``."""
    placed = rows_mesh(rows)
    mesh = None if mcmc.mesh is None else automatic_mesh(mcmc.mesh)
    if placed is not None and mesh not in (None, placed[0]):
        raise ValueError(
            f"The rows lie on a mesh of axes {dict(placed[0].shape)}, not on "
            f"PrivateMCMC's mesh {dict(mesh.shape)}: place them with "
            "ndp.shard_rows(mesh, ...) on the runner's mesh, or pass them unplaced "
            "(the runner places them)."
        )
    if placed is not None:
        mesh = placed[0]
    elif mesh is None and mcmc.chain_method == "parallel" and mcmc.num_chains > 1:
        # NumPyro pmaps the chains over num_chains devices (it has switched to
        # "sequential" where there are fewer): a chain axis over them instead.
        devices = np.asarray(jax.local_devices()[: mcmc.num_chains])
        mesh = automatic_mesh(Mesh(devices, (CHAIN_AXIS,)))
    if mesh is None:
        return None
    chains = CHAIN_AXIS if mesh.shape.get(CHAIN_AXIS, 1) > 1 else None
    if chains is not None and jax.process_count() > 1:
        raise ValueError(
            f"With {jax.process_count()} processes, split the rows over the hosts and "
            f"run the chains as a batch: a mesh without a {CHAIN_AXIS!r} axis, e.g. "
            f"jax.make_mesh((jax.device_count(),), ({DATA_AXIS!r},))."
        )
    if chains is not None and mcmc.num_chains % mesh.shape[CHAIN_AXIS]:
        raise ValueError(
            f"num_chains={mcmc.num_chains} cannot be split evenly over the mesh's "
            f"{CHAIN_AXIS!r} axis of {mesh.shape[CHAIN_AXIS]} devices: run a multiple "
            f"of {mesh.shape[CHAIN_AXIS]} chains, or make the axis smaller."
        )
    return RunMesh(mesh, placed and placed[1], chains)


# ------------------------------------------------------------------ the rows
class PreparedCall(NamedTuple):
    """A call's data, converted, validated and placed once: all the chains see of it.

    Attributes
    ----------
    args, kwargs : tuple, dict
        The model's arguments as the kernel runs on them (NumPy or placed arrays).
    model : PrivateModel
        The kernel's analysis of the model on them (:meth:`DPKernel.prepare`).
    rows : tuple
        The private row arrays (:meth:`PrivateModel.private_inputs`).
    mesh : RunMesh or None
        Where the chains run (None: one device).
    """

    args: tuple
    kwargs: dict
    model: PrivateModel
    rows: tuple
    mesh: RunMesh | None


def converted(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments as the kernel takes them: tables as arrays, placed rows on an
    automatic mesh."""
    return automatic(tabular_to_numpy((args, kwargs)))


def validated(kernel, args: tuple, kwargs: dict, row_layout: RowLayout | None,
              privacy_unit=None) -> PrivateModel:
    """The kernel's analysis of the model on :func:`converted` arguments, which validates
    model and data before any charge: the one preparation of
    :meth:`PrivateMCMC.run <numpyro_dp.PrivateMCMC.run>` and
    :meth:`PrivateMCMC.plan <numpyro_dp.PrivateMCMC.plan>` (which uses no value of the
    rows)."""
    check_layout_given((args, kwargs), row_layout)
    return kernel.prepare(args, kwargs, row_layout, privacy_unit)


def prepare_call(mcmc, args: tuple, kwargs: dict, row_layout: RowLayout | None,
                 privacy_unit=None) -> PreparedCall:
    """Convert the call's data, place its rows (:func:`place_rows`; with
    ``privacy_unit``, its unit blocks: :func:`place_units`), validate them once
    (:func:`validated`), settle the mesh (:func:`run_mesh`) and check ``delta`` against
    the rows' (units') number: everything before the charge."""
    args, kwargs = converted(args, kwargs)
    if privacy_unit is None:
        args, kwargs, row_layout = place_rows(mcmc, args, kwargs, row_layout)
    pm = validated(mcmc.sampler, args, kwargs, row_layout, privacy_unit)
    if privacy_unit is not None and rows_mesh(jax.tree_util.tree_leaves((args, kwargs))):
        raise ValueError(
            "privacy_unit with rows already placed on a mesh: pass the rows unplaced; "
            "PrivateMCMC(mesh=...) places whole units on the mesh's data axis."
        )
    rows = pm.private_inputs(args, kwargs)
    if privacy_unit is not None:
        rows = place_units(mcmc, pm, rows)
    check_delta_for_rows(mcmc.delta, pm.num_rows)
    return PreparedCall(args, kwargs, pm, rows, run_mesh(mcmc, rows))


def place_units(mcmc, pm: PrivateModel, rows: tuple) -> tuple:
    """The unit blocks (:meth:`PrivateModel.private_inputs`) on the runner's mesh's data
    axis, where it has one: :func:`shard_rows` of the blocks, so a unit's rows never
    straddle devices and its total needs no communication."""
    mesh = None if mcmc.mesh is None else automatic_mesh(mcmc.mesh)
    if mesh is None or mesh.shape.get(DATA_AXIS, 1) <= 1:
        return rows
    *rows, layout = shard_rows(mesh, *rows)
    pm.with_layout(layout)
    return tuple(rows)


def make_releases(mcmc, call: PreparedCall, tuning: TuningPlan | None, rng_key, secret,
                  note) -> None:
    """The releases made once before the chains, already charged: the tuning (clips, warm
    start) and the kernel's own (``NoiseAwareNUTS``'s score release)."""
    kernel = mcmc.sampler
    if tuning is not None:
        with mesh_on(call.mesh):
            tune(mcmc, tuning, rng_key, call.model, call.rows, secret)
    if kernel.releases_once and kernel.release_entries():
        # Charged with the tuning; public keys apart from the tuning's and the chains'.
        key = jax.random.fold_in(first_key(rng_key), TUNING_KEY_TAG + 2)
        with mesh_on(call.mesh):
            kernel.make_release(call.model, mcmc.tuning, rng_key=key, rows=call.rows,
                                secret=secret, note=functools.partial(note, mcmc))


@contextlib.contextmanager
def on_mesh(mcmc, run_mesh: RunMesh | None) -> Iterator[None]:
    """Run the call's chains on its mesh: as one batch there (split over its chain
    axis, if any) instead of NumPyro's chain method, which is restored after."""
    chain_method = mcmc.chain_method
    if run_mesh is not None and mcmc.num_chains > 1:
        mcmc.chain_method = "vectorized"
    try:
        with mesh_on(run_mesh):
            yield
    finally:
        mcmc.chain_method = chain_method


# ------------------------------------------------------------------ starts
def tune(mcmc, plan: TuningPlan, rng_key, pm, rows: tuple, secret) -> None:
    """Run the charged tuning releases; adopt the clips; keep the warm start."""
    kernel = mcmc.sampler
    key = first_key(rng_key)
    # Public keys of the tuning's noise draws, apart from every chain's.
    key = jax.random.fold_in(key, TUNING_KEY_TAG)
    key_init, key_tune = jax.random.split(key)
    theta0 = prior_point(pm, key_init, rows)[0]
    result = run_tuning(
        plan, pm, rng_key=key_tune, rows=rows, secret=secret, theta0=theta0,
        neighbourhood=kernel.neighbourhood, temperature=kernel.temperature,
        sampler_noise_multiplier=kernel.noise_multiplier,
    )
    if result.start is None and mcmc.tuning is not None:  # keep an earlier warm start
        result = dataclasses.replace(result, start=mcmc.tuning.start,
                                     dispersion=mcmc.tuning.dispersion,
                                     covariance=mcmc.tuning.covariance)
    kernel.configure(clips=result.clips, preconditioner=result.covariance)
    mcmc.tuning = result


def starts(mcmc, rng_key) -> dict | None:
    """Each chain's start: the warm start plus its spread times a standard normal.

    Post-processing of the warm start with public randomness; dispersed so
    that R-hat can tell chains that did not leave their starts apart.
    """
    if mcmc.tuning is None or mcmc.tuning.start is None:
        return None
    key = first_key(rng_key)
    key = jax.random.fold_in(key, TUNING_KEY_TAG + 1)
    lead = (mcmc.num_chains,) if mcmc.num_chains > 1 else ()
    starts = {}
    pairs = (mcmc.num_chains + 1) // 2
    for name, value in mcmc.tuning.start.items():
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, (pairs,) + jnp.shape(value), jnp.result_type(value))
        # Antithetic pairs: where the chains cannot move, their pooled mean
        # is the warm start's, not that plus the chains' random offsets.
        noise = jnp.stack([noise, -noise], axis=1).reshape((2 * pairs,) + jnp.shape(value))
        noise = noise[: mcmc.num_chains]
        jitter = 0.0 if not lead else CHAIN_DISPERSION * mcmc.tuning.dispersion[name] * noise
        starts[name] = value + jitter
    return starts
