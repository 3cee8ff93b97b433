"""The one module that touches NumPyro's internals.

:class:`~numpyro_dp.PrivateMCMC` subclasses ``numpyro.infer.MCMC`` and needs
a few things that NumPyro keeps in private attributes.  They are named here
and nowhere else, and ``tests/test_numpyro_compat.py`` checks each of them
against the installed NumPyro, so a NumPyro release that moves one fails
that test instead of the privacy of a run:

* where ``MCMC`` keeps a run's model arguments (``_args``, ``_kwargs``):
  :func:`guard_data` shadows them so that nothing can read the private rows
  after (or outside) a run;
* the pending continuation (``_warmup_state``) and the coming call's phase
  and number of iterations (``_collection_params``);
* whether a run has produced draws (``_states``);
* that ``MCMC`` runs a chain's loop through the ``fori_collect`` of its module
  (:func:`loops_compiled_once` swaps in :func:`fori_collect`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpyro.infer.mcmc
import numpyro.util
from jax import lax
from numpyro.infer.mcmc import MCMC
from tqdm.auto import trange

from numpyro_dp.primitives.compiled import compile_once

#: MCMC attributes that hold a run's model arguments (the data).
DATA_ATTRIBUTES = ("_args", "_kwargs")


def warmup_state(mcmc: MCMC) -> Any:
    """The state a ``post_warmup_state`` continuation starts from, or None."""
    return mcmc._warmup_state


def collection_params(mcmc: MCMC) -> dict:
    """``{"phase": ..., "upper": ...}`` of the coming call (``MCMC.warmup`` sets them)."""
    return mcmc._collection_params


def has_draws(mcmc: MCMC) -> bool:
    """Whether a run has produced draws."""
    return mcmc._states is not None


def guard_data(error: Callable[[], Exception]) -> Callable[[type], type]:
    """Class decorator of an ``MCMC`` subclass: its data attributes live in ``_data``.

    While ``self._data`` is None (before and after every run), reading them
    raises ``error()``; NumPyro's own ``run`` sets and reads them as usual.
    """

    def attribute(index: int) -> property:
        def get(self):
            if self._data is None:
                raise error()
            return self._data[index]

        def set_(self, value):
            data = [(), {}] if self._data is None else list(self._data)
            data[index] = value
            self._data = tuple(data)

        return property(get, set_)

    def decorate(cls: type) -> type:
        for index, name in enumerate(DATA_ATTRIBUTES):
            setattr(cls, name, attribute(index))
        return cls

    return decorate


def fori_collect(
    lower: int,
    upper: int,
    body_fun: Callable,
    init_val: Any,
    transform: Callable = lambda x: x,
    progbar: bool = True,
    return_last_val: bool = False,
    collection_size: int | None = None,
    thinning: int = 1,
    **progbar_opts,
):
    """:func:`numpyro.util.fori_collect` with its loop compiled once per program.

    NumPyro jit-compiles a new closure on every ``MCMC.run``, so each run
    compiles the sampler again, and a runner that reuses a cached closure
    would run the program it traced first even where a public argument has
    changed since.  Here the loop is traced on every call and its executable
    looked up by what it computes (:func:`~numpyro_dp.primitives.compiled.compile_once`):
    a re-run of the same configuration on data of the same shapes compiles
    nothing, from the same runner or a new one.  The arguments and results
    are NumPyro's.  Inside a transform NumPyro's own loop runs: the transform
    compiles; so it does under ``jax.disable_jit()``, which compiles nothing.

    ``upper == 0`` (NumPyro's ``MCMC._compile``) compiles the loop and runs
    no iteration.
    """
    if numpyro.util._is_under_jax_transform() or jax.config.jax_disable_jit:
        return numpyro.util.fori_collect(
            lower, upper, body_fun, init_val, transform, progbar=progbar,
            return_last_val=return_last_val, collection_size=collection_size,
            thinning=thinning, **progbar_opts,
        )
    if not lower <= upper or thinning < 1:
        raise ValueError(f"fori_collect needs lower <= upper and thinning >= 1, got "
                         f"{lower}, {upper}, {thinning}.")
    size = (upper - lower) // thinning
    collection_size = size if collection_size is None else collection_size
    if collection_size < size:
        raise ValueError(f"collection_size={collection_size} holds fewer than the {size} "
                         "draws to collect.")
    progress_rate = progbar_opts.pop("progress_rate", None) or max(1, upper // 20)
    progbar_desc = progbar_opts.pop("progbar_desc", lambda i: "")
    diagnostics_fn = progbar_opts.pop("diagnostics_fn", None)
    collection = jax.tree.map(
        lambda x: jnp.zeros((collection_size,) + x.shape, x.dtype),
        jax.eval_shape(transform, init_val),
    )
    # Public loop indices as arguments, as NumPyro passes them.
    start_idx, thinning = jnp.asarray(lower + (upper - lower) % thinning), jnp.asarray(thinning)

    def step(i, val, collection, start_idx, thinning):
        val = body_fun(val)
        idx = (i - start_idx) // thinning
        new = transform(val)
        collection = jax.tree.map(
            lambda c, x: lax.cond(idx >= 0, lambda c: c.at[idx].set(x), lambda c: c, c),
            collection, new,
        )
        return val, collection, start_idx, thinning

    vals = (init_val, collection, start_idx, thinning)
    if not progbar:
        def loop(*vals):
            return lax.fori_loop(0, upper, lambda i, v: step(i, *v), vals)

        loop = compile_once(loop, *vals, donate_argnums=1)
        if upper > 0:
            vals = loop(*vals)
    else:
        one_step = compile_once(step, jnp.asarray(0), *vals, donate_argnums=2)
        if upper > 0:
            with trange(upper, miniters=progress_rate) as bar:
                for i in bar:
                    vals = one_step(jnp.asarray(i), *vals)
                    bar.set_description(progbar_desc(i), refresh=False)
                    if diagnostics_fn:
                        bar.set_postfix_str(diagnostics_fn(vals[0]), refresh=False)
    last_val, collection = vals[0], vals[1]
    return (collection, last_val) if return_last_val else collection


@contextlib.contextmanager
def loops_compiled_once() -> Iterator[None]:
    """Within: ``MCMC`` runs its chains' loops through :func:`fori_collect` (this module's).

    Swaps the ``fori_collect`` that ``numpyro.infer.mcmc`` calls, and restores
    it on exit.  Not meant for concurrent ``MCMC`` runs in other threads.
    """
    original = numpyro.infer.mcmc.fori_collect
    numpyro.infer.mcmc.fori_collect = fori_collect
    try:
        yield
    finally:
        numpyro.infer.mcmc.fori_collect = original
