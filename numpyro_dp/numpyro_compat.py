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
* how ``chain_method="parallel"`` maps the chains: a ``functools.partial``
  whose keywords hold ``args`` and ``kwargs`` (:func:`parallel_with_arguments`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jax import pmap
from numpyro.infer.mcmc import MCMC

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


def parallel_with_arguments(map_fn: functools.partial) -> Callable:
    """NumPyro's ``chain_method="parallel"`` with the model arguments as ``pmap`` inputs.

    NumPyro pmaps a ``functools.partial`` that closes over the arguments, which
    would make the private rows and the run secret constants of the compiled
    program (and of JAX's persistent compilation cache).  Here they are
    broadcast inputs instead.
    """
    keywords = dict(map_fn.keywords)
    args, kwargs = keywords.pop("args"), keywords.pop("kwargs")

    def chains(map_args):
        def one(map_arg, a, kw):
            return map_fn.func(map_arg, args=a, kwargs=kw, **keywords)

        return pmap(one, in_axes=(0, None, None))(map_args, args, kwargs)

    return chains
