"""Export a private run to ArviZ without leaking the data.

``arviz.from_numpyro`` re-runs the model on the data and stores
``observed_data`` and ``log_likelihood`` (exact per-row log-likelihoods):
both publish the private rows.  :func:`to_inference_data` builds the
``InferenceData`` from the private-safe parts of the run only.
"""

from __future__ import annotations

import arviz as az
import numpy as np

from numpyro_dp.mcmc import PrivateMCMC

# NumPyro state field -> ArviZ sample_stats name
_STAT_NAMES = {"accept_prob": "acceptance_rate", "accepted": "accepted",
               "proposal_scale": "proposal_scale", "mean_accept_prob": "mean_acceptance_rate",
               "num_steps": "n_steps"}


def to_inference_data(mcmc: PrivateMCMC) -> az.InferenceData:
    """``InferenceData`` with ``posterior``, private-safe ``sample_stats`` and the ledger.

    Parameters
    ----------
    mcmc : PrivateMCMC
        A runner after :meth:`~PrivateMCMC.run`.

    Returns
    -------
    arviz.InferenceData
        ``posterior``: the constrained draws (and data-free deterministic
        sites); ``sample_stats``: the noisy acceptance probability and other
        collected scalar fields that the kernel declares safe; ``attrs``: the
        privacy spent (``epsilon``, ``delta``, ``neighbourhood``,
        ``accountant``, ``num_releases``, ``noise_multipliers`` and the whole
        ledger as JSON in ``privacy_ledger``) and ``reproducible_noise`` (1 if
        any charged run drew its noise from the test-only reproducible source,
        which makes the draws not private; else 0), on the ``InferenceData``
        and on its ``posterior`` group.  There is no ``observed_data`` and no
        ``log_likelihood``.
    """
    if not isinstance(mcmc, PrivateMCMC):
        raise TypeError("to_inference_data takes a numpyro_dp.PrivateMCMC")
    if mcmc._states is None:
        raise RuntimeError("Nothing to export: call mcmc.run(...) first.")
    posterior = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    safe = set(mcmc.sampler.private_safe_fields)
    stats = {}
    for field, value in mcmc.get_extra_fields(group_by_chain=True).items():
        if field in safe and getattr(value, "ndim", None) == 2:  # a scalar per draw
            stats[_STAT_NAMES.get(field, field)] = np.asarray(value)
    spent = mcmc.privacy_spent()
    attrs = {
        "epsilon": spent.epsilon,
        "delta": spent.delta,
        "neighbourhood": spent.neighbourhood,
        "accountant": spent.accountant,
        "num_releases": spent.num_releases,
        "noise_multipliers": list(spent.noise_multipliers),
        "privacy_ledger": spent.to_json(),
        # netCDF attributes hold no booleans
        "reproducible_noise": int(any(e.reproducible_noise for e in spent.ledger)),
        "inference_library": "numpyro_dp",
        "sampler": type(mcmc.sampler).__name__,
    }
    idata = az.from_dict(posterior=posterior, sample_stats=stats or None, attrs=attrs)
    idata.posterior.attrs.update(attrs)  # group attrs survive every netCDF round trip
    return idata
