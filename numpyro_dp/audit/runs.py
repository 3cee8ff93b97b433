"""The audited runs: data sets as a model takes them and the runner that runs a kernel.

:class:`Dataset` holds a model's arguments; its rows can be counted, taken,
repeated and concatenated (the one-run audit builds its data so).
:func:`audit_runner` runs an unbound copy of a kernel, whose clips must be
stated (:func:`check_clips_stated`), through :class:`~numpyro_dp.PrivateMCMC`
as a user would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from numpyro_dp.kernels.base import DPKernel


class Dataset:
    """A data set as a model takes it: ``Dataset(X, y=y)`` is ``model(X, y=y)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        shapes = [np.shape(a) for a in self.args] + [
            f"{k}={np.shape(v)}" for k, v in self.kwargs.items()]
        return f"Dataset({', '.join(map(str, shapes))})"


def check_clips_stated(kernel: DPKernel) -> None:
    if kernel.clip_requests():
        raise ValueError(
            "State the kernel's clips for an audit (e.g. llr_clip=1.0): an audit runs "
            "the sampler, not the private clip selection, and its canary should be "
            "extreme within a known clip."
        )


def audit_runner(kernel: DPKernel, num_chains: int, epsilon: float | None, **options: Any):
    """A :class:`~numpyro_dp.PrivateMCMC` of an unbound copy of ``kernel`` for audit runs:
    vectorized chains, no warm start, no mixing check (``options`` may override)."""
    from numpyro_dp.runner.mcmc import PrivateMCMC  # the runner sits above this module's users

    options = {"chain_method": "vectorized", "progress_bar": False, "check_mixing": False,
               "warm_start": 0, **options}
    return PrivateMCMC(kernel.calibrated(), num_chains=num_chains, epsilon=epsilon, **options)


def num_rows(dataset: Dataset) -> int:
    sizes = {np.shape(x)[0] for x in (*dataset.args, *dataset.kwargs.values())
             if np.ndim(x) > 0}
    if len(sizes) != 1:
        raise ValueError(f"{dataset!r}: every array needs the same number of rows.")
    return sizes.pop()


def _map_rows(datasets: list[Dataset], fn: Callable) -> Dataset:
    first = datasets[0]
    args = [fn([d.args[i] for d in datasets]) for i in range(len(first.args))]
    kwargs = {k: fn([d.kwargs[k] for d in datasets]) for k in first.kwargs}
    return Dataset(*args, **kwargs)


def take_rows(dataset: Dataset, index: np.ndarray) -> Dataset:
    return _map_rows([dataset], lambda xs: np.asarray(xs[0])[index])


def repeat_row(dataset: Dataset, count: int) -> Dataset:
    return _map_rows([dataset], lambda xs: np.repeat(np.asarray(xs[0])[:1], count, axis=0))


def concatenate(datasets: list[Dataset]) -> Dataset:
    return _map_rows(datasets, lambda xs: np.concatenate([np.asarray(x) for x in xs]))
