"""How a kernel takes its arguments, and the checks they pass.

One calling convention for every kernel: the model positionally, everything
else by keyword (:func:`keyword_arguments`), a subclass listing only its own
keywords (:func:`extends`); tuning constants that must be positive
(:func:`check_positive`) and a temperature (:func:`check_temperature`); what
:meth:`~numpyro_dp.kernels.base.DPKernel.configure` may set
(:func:`check_settable`); and the noise multiplier and row count that a
privacy event is declared at (:func:`event_noise_multiplier`,
:func:`event_num_rows`), with errors that say what to pass.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable

import numpy as np


def check_positive(name: str, value: float, fix: str) -> float:
    """Reject a non-positive or non-finite tuning constant, naming the fix."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {fix}")
    return float(value)


def check_temperature(temperature: float) -> float:
    """Reject a temperature outside (0, 1]."""
    if not (isinstance(temperature, (int, float)) and 0 < temperature <= 1):
        raise ValueError(
            f"temperature={temperature!r} must lie in (0, 1]; 1 is the "
            "ordinary posterior."
        )
    return float(temperature)


def keyword_arguments(init: Callable) -> Callable:
    """Decorator of a kernel's ``__init__(self, model, *, ...)``: one calling convention.

    Every kernel takes the model positionally and everything else by keyword
    (``DPSGLD(model, step_size=1e-3, batch_size=100, grad_clip=1.0)``): clips,
    steps and batch sizes read the same in every kernel and cannot be swapped
    silently.  A positional argument after the model, or a misspelt keyword,
    raises a ``TypeError`` that shows the keyword form or the closest name.
    """

    @functools.wraps(init)
    def __init__(self, model, *args, **kwargs):
        kernel = type(self).__name__
        accepted = inspect.signature(init).parameters  # as extends() shows them
        for name in kwargs.keys() - accepted.keys() - getattr(init, "fixed", set()):
            close = difflib.get_close_matches(name, list(accepted), n=1)
            hint = f"; did you mean {close[0]}=?" if close else ""
            raise TypeError(f"{kernel} has no argument {name!r}{hint} Its arguments: "
                            f"{', '.join(list(accepted)[2:])}.")
        if args:
            keywords = ", ".join(f"{name}=..." for name in list(accepted)[2:5])
            raise TypeError(
                f"{kernel} takes the model and then keyword arguments only "
                f"({len(args) + 1} positional arguments given): write "
                f"{kernel}(model, {keywords})."
            )
        init(self, model, **kwargs)

    return __init__


def extends(base: type, *, drop: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator of ``__init__(self, model, *, own..., **base_arguments)`` of a subclass.

    The subclass lists only its own arguments and passes the rest on to
    ``base``; its signature (``help()``, an IDE's completion) shows its own
    keywords and then ``base``'s, less those in ``drop`` (arguments the
    subclass fixes, such as DPMALA's one leapfrog step).
    """

    def decorate(init: Callable) -> Callable:
        own = inspect.signature(init).parameters
        inherited = [
            parameter for name, parameter in inspect.signature(base.__init__).parameters.items()
            if parameter.kind is parameter.KEYWORD_ONLY and name not in own and name not in drop
        ]
        init.__signature__ = inspect.Signature(
            [p for p in own.values() if p.kind is not p.VAR_KEYWORD] + inherited
        )
        init.fixed = set(drop)  # refused by the subclass itself, with its reason
        return init

    return decorate


def check_settable(kernel, noise_multiplier: float | None, clips: dict | None) -> None:
    """Refuse to configure what ``kernel`` does not have: a noise multiplier where its
    noise is fixed by its own parameters, a clip it lacks
    (:meth:`~numpyro_dp.kernels.base.DPKernel.configure`)."""
    if noise_multiplier is not None and not kernel.calibrated_noise:
        raise ValueError(
            f"{type(kernel).__name__} has no noise multiplier to set: its noise is fixed "
            "by its own parameters (step size, batch size)."
        )
    clip_names = [n for n in vars(kernel) if n.endswith("_clip") and not n.startswith("_")]
    unknown = sorted(set(clips or {}) - set(clip_names))
    if unknown:
        raise ValueError(f"{type(kernel).__name__} has no clip named {unknown}; its clips "
                         f"are {sorted(clip_names)}.")


def event_noise_multiplier(kernel, noise_multiplier: float | None) -> float:
    """The noise multiplier to declare ``kernel``'s event at (``noise_multiplier``, else
    the kernel's own), with a clear error if there is none."""
    z = kernel.noise_multiplier if noise_multiplier is None else noise_multiplier
    if z is None:
        raise ValueError(
            f"This {type(kernel).__name__} has no noise multiplier yet: PrivateMCMC "
            "calibrates it to the budget when a run starts. To plan before a run, "
            "ask the runner (PrivateMCMC(...).plan(num_rows=n) gives the calibrated "
            "noise and what the budget affords) or pass one: "
            "kernel.per_iteration_event(noise_multiplier=z)."
        )
    return check_positive("noise_multiplier", z, "it is sigma / Delta of each release.")


def event_num_rows(kernel, num_rows: int | None) -> int:
    """``n`` for kernels whose cost depends on it (``num_rows``, else the rows of the
    model ``kernel`` has prepared), with a clear error if unknown."""
    if num_rows is None and kernel._private_model is not None:
        num_rows = kernel._private_model.num_rows
    if num_rows is None:
        raise ValueError(
            f"The privacy cost of {type(kernel).__name__} depends on the number of rows "
            "n (the sampling rate is batch_size / n). Pass num_rows=n to plan before "
            "the kernel has seen the data."
        )
    if not (isinstance(num_rows, (int, np.integer)) and num_rows >= 1):
        raise ValueError(f"num_rows={num_rows!r} must be a positive integer.")
    return int(num_rows)
