"""Public runs of a model: structure traces with abstract rows, and stand-in rows.

Nothing here reads the private rows' values.  A structure trace runs the model
with the rows as abstract values (shapes and dtypes only), as the compiled
sampler sees them, so plate sizes, sites and any exception raised are public
facts (:func:`abstract_trace`).  Runs that need numbers use stand-in rows made
by a public rule (:func:`stand_ins`), with NumPyro's validation off and
warnings ignored (:func:`quietly`).  The helpers that read a trace's sites and
plates (:func:`plates`, :func:`in_plate`, :func:`is_factor`) live here too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.infer.initialization import init_to_uniform


def is_array(x: Any) -> bool:
    """Whether ``x`` is a NumPy or JAX array with at least one axis."""
    return isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) >= 1


def plates(trace: dict) -> dict[str, tuple[int, int]]:
    """Plate name -> (dim, size) for every plate a sample site sits in."""
    out = {}
    for site in trace.values():
        if site["type"] == "sample":
            for frame in site["cond_indep_stack"]:
                out[frame.name] = (frame.dim, frame.size)
    return out


def in_plate(site: dict, plate: str) -> bool:
    """Whether ``site`` sits in the plate named ``plate``."""
    return any(f.name == plate for f in site["cond_indep_stack"])


def is_factor(site: dict) -> bool:
    """Whether ``site`` is a ``numpyro.factor`` site."""
    return (
        site["type"] == "sample"
        and site["is_observed"]
        and site["infer"].get("is_auxiliary", False)
    )


def structure_trace(
    model: Callable,
    model_args: tuple,
    model_kwargs: dict,
    rng_key: jax.Array | int = 0,
    init_strategy: Callable = init_to_uniform,
) -> dict:
    """A trace of ``model`` whose latent values come from ``init_strategy``.

    No latent is drawn from its prior by the default strategy, so priors
    without a sampler (NumPyro's ``ImproperUniform``, common in models
    translated from Stan) are accepted.
    """
    seeded = handlers.seed(model, rng_key)
    return handlers.trace(handlers.substitute(seeded, substitute_fn=init_strategy)).get_trace(
        *model_args, **model_kwargs
    )


def replace_leaves(leaves: list, treedef, index: tuple[int, ...], values) -> tuple[tuple, dict]:
    """``(model_args, model_kwargs)`` with ``leaves[index]`` replaced by ``values``."""
    leaves = list(leaves)
    for i, x in zip(index, values, strict=True):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of ``x`` as the compiled sampler receives it (public)."""
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def abstract_trace(model: Callable, with_rows: Callable, specs: list) -> tuple[dict, dict]:
    """The structure trace of ``model`` on ``with_rows(rows)``, the arguments built
    around abstract ``rows`` (``specs``: their shapes and dtypes).

    What the compiled sampler sees: the rows have no values, so nothing in
    the trace -- plate sizes, sites, NumPyro's checks of the other arguments,
    an exception the model raises -- can depend on theirs.  Returns the trace
    (read its structure only: its values are abstract) and the shapes of the
    continuous latents' unconstrained values.
    """
    found = {}

    def run(rows):
        trace = found["trace"] = structure_trace(model, *with_rows(rows))
        return {
            name: biject_to(site["fn"].support).inv(site["value"])
            for name, site in trace.items()
            if site["type"] == "sample" and not site["is_observed"] and not site["fn"].is_discrete
        }

    shapes = jax.eval_shape(run, specs)
    return found["trace"], shapes


#: Seed of the stand-in rows (public: they say nothing about the data).
STAND_IN_SEED = 0


def stand_ins(specs: list) -> list[jax.Array]:
    """Public rows of the given shapes and dtypes: uniform on (0, 1) for floats, 0 or 1
    otherwise, from :data:`STAND_IN_SEED`.

    Values inside the support of most likelihoods (Bernoulli, Poisson, Beta,
    Exponential, ...) and different from row to row, so that a check on them
    sees a model that mixes rows.
    """
    rng = np.random.default_rng(STAND_IN_SEED)
    return [
        jnp.asarray(
            rng.uniform(size=s.shape) if jnp.issubdtype(s.dtype, jnp.inexact)
            else rng.integers(0, 2, size=s.shape),
            dtype=s.dtype,
        )
        for s in specs
    ]


@contextmanager
def quietly():
    """NumPyro's validation off and warnings ignored: for runs of the model on
    stand-in rows, whose made-up values may lie outside a likelihood's support."""
    with numpyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
