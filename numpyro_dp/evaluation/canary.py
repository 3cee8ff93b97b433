"""The canary problem every kernel is audited on (:mod:`numpyro_dp.audit`).

The smallest data set that exercises a kernel's privacy: a Gaussian-mean model
on ``n = 20`` rows, 19 at 0 and one canary at +5, far outside a clip of 1, so
that the canary's clipped contribution sits at the clip.  Its neighbour
replaces the canary by -5 (``"substitute"``) or drops it (``"add_remove"``).
Each audited run is one iteration of one chain from ``theta = 0``, scored by
its draw (:func:`draw_score`): under the canary a step leans towards +5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import init_to_value

from numpyro_dp.audit import Dataset
from numpyro_dp.kernels import (
    DPHMC,
    DPMALA,
    DPSGHMC,
    DPSGLD,
    DPSGNHT,
    DPBarker,
    DPKernel,
    DPMinibatchPenalty,
    DPPenalty,
)

ROWS = 20
CANARY = 5.0
#: The canary of :func:`~numpyro_dp.audit.audit_kernel`'s runs of several iterations:
#: far enough out that it stays beyond the clip wherever the chains go (a canary at
#: 5 stops moving the clipped gradient once theta passes 4), so that every release
#: moves by its full sensitivity and the audit is tight.
KERNEL_AUDIT_CANARY = 100.0
#: The delta audited: with n = 20 rows, where a few thousand runs see what sets
#: epsilon (at 1e-5 the Gaussian's epsilon is set by tail events they never see).
DELTA = 0.01
START = {"init_strategy": init_to_value(values={"theta": 0.0})}


def mean_model(x):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(theta, 1.0), obs=x)


def canary_rows(canary: float = CANARY) -> np.ndarray:
    x = np.zeros(ROWS, np.float32)
    x[-1] = canary
    return x


def neighbours(neighbourhood: str = "substitute",
               canary: float = CANARY) -> tuple[Dataset, Dataset]:
    """``(data, neighbour)``: the canary (+5), against its opposite or no canary."""
    x = canary_rows(canary)
    other = -x if neighbourhood == "substitute" else x[:-1]
    return Dataset(x), Dataset(other)


def batch_ratios() -> tuple[np.ndarray, np.ndarray]:
    """A batch of 10 log-likelihood ratios, 9 beyond a clip of 1 and the canary at +5
    against -5: the worst case of DPMinibatchPenalty's statistic, whose half batch
    variance changes with the canary too."""
    ratios = np.full(10, 2.0, np.float32)
    ratios[-1] = CANARY
    neighbour = ratios.copy()
    neighbour[-1] = -CANARY
    return ratios, neighbour


def barker_batch() -> np.ndarray:
    """A batch of 50 log-likelihood ratios, 49 at 0 and the canary at +5 (its neighbour
    has -5): DP Barker's test with ``n0 = 50`` clips the canary to 0.14."""
    ratios = np.zeros(50, np.float32)
    ratios[-1] = CANARY
    return ratios


def draw_score(samples: dict, extra: dict) -> np.ndarray:
    """A run's draws summed: higher when the canary at +5 was in the data."""
    return samples["theta"].sum(axis=(1, 2))


class AuditedKernel(NamedTuple):
    name: str
    data: str  # "full" or the batching
    neighbourhoods: tuple[str, ...]
    make: Callable[[str], DPKernel]


_HMC = {"step_size": 0.5, "grad_clip": 1.0, "llr_clip": 1.0, "noise_multiplier_grad": 1.0,
        "noise_multiplier_llr": 1.0, "adapt_step_size": False, "adapt_mass_matrix": False,
        **START}
_PENALTY = {"llr_clip": 1.0, "proposal_scale": 0.5, "noise_multiplier": 1.0,
            "adapt_step_size": False, **START}
_SG = {"step_size": 1.0, "grad_clip": 1.0, **START}
_BOTH = ("substitute", "add_remove")

#: Every kernel, full data and minibatches, in each neighbourhood it supports
#: (the full-batch stochastic-gradient kernels need b <= n, so only their
#: Poisson minibatches are audited under add/remove).
KERNELS = (
    AuditedKernel("DPPenalty", "full", _BOTH,
                  lambda nb: DPPenalty(mean_model, neighbourhood=nb, **_PENALTY)),
    AuditedKernel("DPPenalty (guided)", "full", _BOTH,
                  lambda nb: DPPenalty(mean_model, neighbourhood=nb, proposal="guided",
                                       **_PENALTY)),
    AuditedKernel("DPMinibatchPenalty", "b = 10", ("substitute",),
                  lambda nb: DPMinibatchPenalty(mean_model, batch_size=10, **_PENALTY)),
    AuditedKernel("DPHMC", "full", _BOTH,
                  lambda nb: DPHMC(mean_model, num_steps=1, neighbourhood=nb, **_HMC)),
    AuditedKernel("DPMALA", "full", _BOTH,
                  lambda nb: DPMALA(mean_model, neighbourhood=nb, **_HMC)),
    AuditedKernel("DPBarker", "b = 11", ("substitute",),
                  lambda nb: DPBarker(mean_model, batch_size=11, proposal_scale=0.5, n0=20,
                                      **START)),
    AuditedKernel("DPSGLD", "full (q = 1)", ("substitute",),
                  lambda nb: DPSGLD(mean_model, batch_size=ROWS, **_SG)),
    AuditedKernel("DPSGLD", "Poisson, b = 10", _BOTH,
                  lambda nb: DPSGLD(mean_model, batch_size=10, neighbourhood=nb, **_SG)),
    AuditedKernel("DPSGLD", "without replacement, b = 10", ("substitute",),
                  lambda nb: DPSGLD(mean_model, batch_size=10, batching="without_replacement",
                                    **_SG)),
    # Two steps: after one, the momentum resampled at the next iteration carries the
    # only released gradient, and the draw does not depend on the data.
    AuditedKernel("DPSGHMC", "full (q = 1), 2 steps", ("substitute",),
                  lambda nb: DPSGHMC(mean_model, batch_size=ROWS, num_steps=2, **_SG)),
    AuditedKernel("DPSGNHT", "full (q = 1)", ("substitute",),
                  lambda nb: DPSGNHT(mean_model, batch_size=ROWS, **_SG)),
)
