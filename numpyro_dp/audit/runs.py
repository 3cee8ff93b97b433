"""The audited runs: data sets as a model takes them and the runner that runs a kernel.

:class:`Dataset` holds a model's arguments (and, for a guarantee per unit, each
row's unit); its rows can be counted, taken, repeated and concatenated (the
one-run audit builds its data so), and a unit's rows taken (:func:`unit_rows`:
the canary of an audit per unit) or removed or replaced at once
(:func:`unit_neighbour`).
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
    """A data set as a model takes it: ``Dataset(X, y=y)`` is ``model(X, y=y)``.

    Parameters
    ----------
    *args, **kwargs
        The model's arguments.
    privacy_unit : array, optional
        One unit id per row (keyword only): the audited runs are then private
        per unit, ``PrivateMCMC.run(..., privacy_unit=ids)``
        (:mod:`~numpyro_dp.model.units`), and what the ledger charges, the claim,
        is per unit.  Without it the runs are private per row, whichever rows
        ``data`` and ``neighbour`` differ in: an audit of the row-level guarantee
        against a whole unit as the canary (:func:`unit_neighbour`).
    """

    def __init__(self, *args: Any, privacy_unit: Any = None, **kwargs: Any):
        self.args, self.kwargs = args, kwargs
        self.privacy_unit = None if privacy_unit is None else np.asarray(privacy_unit)

    @property
    def run_kwargs(self) -> dict:
        """The keyword arguments of ``PrivateMCMC.run``: the model's, and ``privacy_unit``."""
        if self.privacy_unit is None:
            return dict(self.kwargs)
        return {**self.kwargs, "privacy_unit": self.privacy_unit}

    def __repr__(self) -> str:
        shapes = [np.shape(a) for a in self.args] + [
            f"{k}={np.shape(v)}" for k, v in self.kwargs.items()]
        if self.privacy_unit is not None:
            shapes.append(f"privacy_unit: {len(np.unique(self.privacy_unit))} units")
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


def _unit_index(data: Dataset, unit: Any) -> np.ndarray:
    """Whether each row of ``data`` belongs to unit ``unit`` (which must have rows)."""
    if data.privacy_unit is None:
        raise ValueError(f"{data!r} names no units: give it privacy_unit= (one id per row).")
    if np.shape(data.privacy_unit) != (num_rows(data),):
        raise ValueError(f"{data!r}: privacy_unit needs one id per row.")
    index = data.privacy_unit == unit
    if not index.any():
        raise ValueError(f"{data!r} has no unit {unit!r}.")
    return index


def unit_rows(data: Dataset, unit: Any) -> Dataset:
    """The rows of unit ``unit`` of ``data``, without ids: a whole unit as the canary.

    Parameters
    ----------
    data : Dataset
        A data set with ``privacy_unit``.
    unit
        The canary unit's id.

    Returns
    -------
    Dataset
        Its rows as the model takes them, e.g. :func:`multi_run`'s ``canary=``
        (whose default score, the canary's log-likelihood, then sums the unit's rows).
    """
    return take_rows(data, np.flatnonzero(_unit_index(data, unit)))


def unit_neighbour(data: Dataset, unit: Any, replacement: Dataset | None = None) -> Dataset:
    """``data``'s neighbour in which unit ``unit`` differs, all its rows at once.

    Parameters
    ----------
    data : Dataset
        A data set with ``privacy_unit``.
    unit
        The canary unit's id.
    replacement : Dataset, optional
        Rows that take the unit's place, with its id (``"substitute"``: the
        number of units stays public; as many rows or not).  Without it the
        unit's rows are removed (``"add_remove"``).

    Returns
    -------
    Dataset
        The neighbour, with ``privacy_unit``: the other units' rows in their
        order, then the replacement's.  For an audit of the row-level guarantee
        pass both data sets without ids (``Dataset(*d.args, **d.kwargs)``).
    """
    index = _unit_index(data, unit)
    rest = take_rows(data, np.flatnonzero(~index))
    ids = data.privacy_unit[~index]
    if replacement is not None:
        rest = concatenate([rest, replacement])
        ids = np.concatenate([ids, np.repeat(data.privacy_unit[index][:1],
                                             num_rows(replacement))])
    return Dataset(*rest.args, privacy_unit=ids, **rest.kwargs)
