"""Export a private run to ArviZ without leaking the data.

``arviz.from_numpyro`` (and ``arviz_base.from_numpyro``, its ArviZ 1.x
successor) re-runs the model on the data and stores ``observed_data`` and
``log_likelihood`` (exact per-row log-likelihoods): both publish the private
rows, and a :class:`~numpyro_dp.PrivateMCMC` refuses to hand its data to them
(:class:`~numpyro_dp.PrivateDataError`).  The exports here are built from the
private-safe parts of the run only:

* :func:`to_datatree` builds an ``xarray.DataTree`` through ``arviz_base``
  (ArviZ 1.x, or ``arviz-base`` / ``arviz-stats`` installed next to ArviZ
  0.x: ``pip install numpyro-dp[datatree]``);
* :func:`to_inference_data` builds an ``arviz.InferenceData`` on ArviZ 0.x
  and, on ArviZ 1.x (which has no ``InferenceData``), the same ``DataTree`` as
  :func:`to_datatree`.

Which fields are exported, under which names, and the privacy attributes are
decided once, in :func:`_private_safe_groups`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import arviz as az
import numpy as np
import xarray  # a dependency of both ArviZ lines; xarray.DataTree in the annotations

from numpyro_dp.numpyro_compat import has_draws
from numpyro_dp.runner.mcmc import PrivateMCMC

__all__ = ["ARVIZ_HAS_INFERENCE_DATA", "to_datatree", "to_inference_data"]

#: True on the ArviZ 0.x line (``arviz.InferenceData``); False on ArviZ 1.x,
#: where ``arviz`` re-exports ``arviz_base`` / ``arviz_stats`` / ``arviz_plots``
#: and the container is ``xarray.DataTree``.  Read off the version: ArviZ 1.x
#: answers ``arviz.InferenceData`` with ``xarray.DataTree`` and a
#: ``MigrationWarning``, so ``hasattr`` cannot tell the lines apart.
ARVIZ_HAS_INFERENCE_DATA: bool = int(az.__version__.split(".", 1)[0]) < 1

# NumPyro state field -> ArviZ sample_stats name
_STAT_NAMES = {"accept_prob": "acceptance_rate", "accepted": "accepted",
               "proposal_scale": "proposal_scale", "mean_accept_prob": "mean_acceptance_rate",
               "num_steps": "n_steps"}

#: The sample dimensions of the posterior and sample_stats groups.
_SAMPLE_DIMS = ["chain", "draw"]

_NO_ARVIZ_BASE = (
    "numpyro_dp.to_datatree needs arviz-base (and arviz-stats to summarise the result): "
    "pip install numpyro-dp[datatree]  (or: pip install arviz-base arviz-stats). "
    "ArviZ 1.x installs both; on ArviZ 0.x, ndp.to_inference_data(mcmc) returns an "
    "arviz.InferenceData without them."
)


def _private_safe_groups(
    mcmc: PrivateMCMC, caller: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """What a private run may publish: the one definition both exports share.

    Parameters
    ----------
    mcmc : PrivateMCMC
        A runner after :meth:`~PrivateMCMC.run`.
    caller : str
        The public function's name, for the error messages.

    Returns
    -------
    posterior : dict of str to numpy.ndarray
        The constrained draws (and data-free deterministic sites), each of
        shape ``(num_chains, num_draws, ...)``.
    sample_stats : dict of str to numpy.ndarray
        The collected extra fields that the kernel declares private-safe and
        that hold one scalar per draw, under their ArviZ names (``accept_prob``
        becomes ``acceptance_rate``, ...); empty when none was collected.
    attrs : dict of str to Any
        The privacy spent and the run's provenance; netCDF-safe values only
        (no booleans, no ``None``).

    Raises
    ------
    TypeError
        If ``mcmc`` is not a :class:`~numpyro_dp.PrivateMCMC`.
    RuntimeError
        If the runner has not run yet.
    """
    if not isinstance(mcmc, PrivateMCMC):
        raise TypeError(f"{caller} takes a numpyro_dp.PrivateMCMC")
    if not has_draws(mcmc):
        raise RuntimeError("Nothing to export: call mcmc.run(...) first.")
    posterior = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    safe = set(mcmc.sampler.private_safe_fields)
    collected = {}
    for field, value in mcmc.get_extra_fields(group_by_chain=True).items():
        if field == "info":  # extra_fields=("info",): every field of the transitions
            collected.update(value._asdict())
        elif field in safe:
            collected[field] = value
    stats = {_STAT_NAMES.get(field, field): np.asarray(value)
             for field, value in collected.items()
             if getattr(value, "ndim", None) == 2}  # a scalar per draw
    spent = mcmc.privacy_spent()
    attrs = {
        "epsilon": spent.epsilon,
        "delta": spent.delta,
        "neighbourhood": spent.neighbourhood,
        "privacy_unit": spent.privacy_unit,
        "accountant": spent.accountant,
        "num_releases": spent.num_releases,
        "noise_multipliers": list(spent.noise_multipliers),
        "privacy_ledger": spent.to_json(),
        # netCDF attributes hold no booleans
        "reproducible_noise": int(any(e.reproducible_noise for e in spent.ledger)),
        "inference_library": "numpyro_dp",
        "sampler": type(mcmc.sampler).__name__,
    }
    return posterior, stats, attrs


def _import_arviz_base() -> ModuleType:
    """``arviz_base``, or an ImportError that says what to install."""
    try:
        import arviz_base
    except ImportError as err:
        raise ImportError(_NO_ARVIZ_BASE) from err
    return arviz_base


def _build_datatree(
    posterior: dict[str, np.ndarray], stats: dict[str, np.ndarray], attrs: dict[str, Any]
) -> xarray.DataTree:
    """The ``DataTree`` of :func:`to_datatree` from the private-safe groups."""
    arviz_base = _import_arviz_base()
    groups = {"posterior": posterior}
    if stats:
        groups["sample_stats"] = stats
    # "/" is the root node: the privacy attrs go on the tree and on the
    # posterior group (a group written alone to netCDF / zarr keeps them).
    return arviz_base.from_dict(
        groups, sample_dims=_SAMPLE_DIMS, attrs={"/": dict(attrs), "posterior": dict(attrs)}
    )


def to_datatree(mcmc: PrivateMCMC) -> xarray.DataTree:
    """``xarray.DataTree`` with ``posterior``, private-safe ``sample_stats`` and the ledger.

    The ArviZ 1.x container (built with ``arviz_base.from_dict``); use it with
    ``arviz_stats.summary``, ``arviz_plots`` or, on ArviZ 1.x, ``arviz.summary``.
    Never call ``arviz_base.from_numpyro(mcmc)`` on a private run: it would store
    the data, and the runner refuses it with :class:`~numpyro_dp.PrivateDataError`.

    Parameters
    ----------
    mcmc : PrivateMCMC
        A runner after :meth:`~PrivateMCMC.run`.

    Returns
    -------
    xarray.DataTree
        Children ``posterior`` (the constrained draws and data-free
        deterministic sites, dims ``chain``, ``draw``, ...) and, when the run
        collected any, ``sample_stats`` (the noisy acceptance probability and
        other scalar fields the kernel declares safe, under ArviZ's names).
        ``attrs`` of the root and of ``posterior``: the privacy spent
        (``epsilon``, ``delta``, ``neighbourhood``, ``privacy_unit``, ``accountant``,
        ``num_releases``, ``noise_multipliers`` and the whole ledger as JSON in
        ``privacy_ledger``) and ``reproducible_noise`` (1 if any charged run
        drew its noise from the test-only reproducible source, which makes the
        draws not private; else 0).  There is no ``observed_data`` and no
        ``log_likelihood`` group.

    Raises
    ------
    ImportError
        If ``arviz_base`` is not installed (``pip install numpyro-dp[datatree]``).
    TypeError
        If ``mcmc`` is not a :class:`~numpyro_dp.PrivateMCMC`.
    RuntimeError
        If the runner has not run yet.
    """
    _import_arviz_base()  # fail on the missing package before any work
    return _build_datatree(*_private_safe_groups(mcmc, "to_datatree"))


def to_inference_data(mcmc: PrivateMCMC) -> az.InferenceData | xarray.DataTree:
    """ArviZ export of a private run: ``posterior``, private-safe ``sample_stats``, the ledger.

    On ArviZ 0.x this is an ``arviz.InferenceData``.  ArviZ 1.x has no
    ``InferenceData``: there it returns the ``xarray.DataTree`` of
    :func:`to_datatree`, which ``arviz.summary`` and the ArviZ 1.x plots take
    in its place.  Code that needs a ``DataTree`` on both lines calls
    :func:`to_datatree`.

    Parameters
    ----------
    mcmc : PrivateMCMC
        A runner after :meth:`~PrivateMCMC.run`.

    Returns
    -------
    arviz.InferenceData or xarray.DataTree
        ``posterior``: the constrained draws (and data-free deterministic
        sites); ``sample_stats``: the noisy acceptance probability and other
        collected scalar fields that the kernel declares safe; ``attrs``: the
        privacy spent (``epsilon``, ``delta``, ``neighbourhood``, ``privacy_unit``,
        ``accountant``, ``num_releases``, ``noise_multipliers`` and the whole
        ledger as JSON in ``privacy_ledger``) and ``reproducible_noise`` (1 if
        any charged run drew its noise from the test-only reproducible source,
        which makes the draws not private; else 0), on the object and on its
        ``posterior`` group.  There is no ``observed_data`` and no
        ``log_likelihood``.

    Raises
    ------
    TypeError
        If ``mcmc`` is not a :class:`~numpyro_dp.PrivateMCMC`.
    RuntimeError
        If the runner has not run yet.
    """
    posterior, stats, attrs = _private_safe_groups(mcmc, "to_inference_data")
    if not ARVIZ_HAS_INFERENCE_DATA:  # ArviZ 1.x: arviz_base is one of its dependencies
        return _build_datatree(posterior, stats, attrs)
    idata = az.from_dict(posterior=posterior, sample_stats=stats or None, attrs=attrs)
    idata.posterior.attrs.update(attrs)  # group attrs survive every netCDF round trip
    return idata
