"""Did the chains move and mix?  R-hat, bulk ESS and movement of the draws.

A DP chain can sit at its start while its progress bar looks healthy: under
heavy noise the adapted step shrinks until nearly every proposal is accepted
and nothing moves.  These checks read only the released draws, so they are
free post-processing (no privacy cost).  They cannot tell that a chain
converged to the wrong place (clipping bias); compare with exact draws for
that (:mod:`numpyro_dp.evaluation.diagnostics`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import NamedTuple

import arviz as az
import numpy as np
import xarray as xr

__all__ = ["MixingReport", "MixingWarning", "mixing_report", "warn_if_not_mixed"]

#: Split R-hat above this means the chains (or the halves of one chain) disagree.
RHAT_LIMIT = 1.05
#: Bulk ESS below this is too few draws for reliable means, sds or R-hat
#: (Vehtari et al. 2021 ask for about 100 per chain before trusting R-hat).
ESS_LIMIT = 100.0
#: A chain whose state changed in fewer than this share of its draws is stuck.
MOVED_LIMIT = 0.05


class MixingWarning(UserWarning):
    """The draws did not move or mix; their summaries are not the posterior's."""


class MixingReport(NamedTuple):
    """Mixing of a run's draws, computed from the released draws only.

    Attributes
    ----------
    max_rhat : float
        Largest rank-normalised split R-hat (ArviZ's, as in ``az.summary``)
        over every coordinate of every site (``inf`` if a coordinate never
        moved).
    max_rhat_site : str
        The site where it occurs.
    min_ess : float
        Smallest bulk effective sample size (ArviZ's; all chains together).
    min_ess_site : str
        The site where it occurs.
    moved : numpy.ndarray
        Per chain, the share of draws at which the state differs from the
        previous draw.
    num_draws : int
        Draws per chain.
    """

    max_rhat: float
    max_rhat_site: str
    min_ess: float
    min_ess_site: str
    moved: np.ndarray
    num_draws: int

    @property
    def problems(self) -> list[str]:
        """What is wrong, one sentence each (empty when the draws look mixed)."""
        out = []
        stuck = np.flatnonzero(self.moved < MOVED_LIMIT)
        if stuck.size:
            shares = ", ".join(f"chain {c}: {self.moved[c]:.1%}" for c in stuck)
            out.append(f"chains that hardly moved (share of draws that changed: {shares})")
        if not self.max_rhat <= RHAT_LIMIT:
            out.append(f"split R-hat {self.max_rhat:.3f} at {self.max_rhat_site!r} "
                       f"(above {RHAT_LIMIT}: the chains disagree)")
        if not self.min_ess >= ESS_LIMIT:
            out.append(f"bulk ESS {self.min_ess:.0f} at {self.min_ess_site!r} "
                       f"(below {ESS_LIMIT:g})")
        return out

    def __str__(self) -> str:
        head = (f"max split R-hat {self.max_rhat:.3f} ({self.max_rhat_site}), "
                f"min bulk ESS {self.min_ess:.0f} ({self.min_ess_site}), "
                f"least-moving chain changed at {self.moved.min():.1%} of "
                f"{self.num_draws} draws")
        problems = self.problems
        return head + ("; " + "; ".join(problems) if problems else "; looks mixed")


def mixing_report(samples_by_chain: Mapping[str, np.ndarray]) -> MixingReport | None:
    """Split R-hat, bulk ESS and movement of draws grouped by chain.

    Parameters
    ----------
    samples_by_chain : dict of arrays
        ``mcmc.get_samples(group_by_chain=True)``: each of shape
        ``(num_chains, num_draws, ...)``.

    Returns
    -------
    MixingReport or None
        None when there are fewer than 4 draws per chain (split R-hat needs 4).
    """
    sites = {k: np.asarray(v, dtype=np.float64) for k, v in samples_by_chain.items()}
    sites = {k: v.reshape(v.shape[:2] + (-1,)) for k, v in sites.items() if v.size}
    if not sites or next(iter(sites.values())).shape[1] < 4:
        return None
    # ArviZ's rank-normalised split R-hat and bulk ESS: what az.summary shows.  A
    # plain Dataset works on both ArviZ lines (0.x and the DataTree-based 1.x,
    # whose from_dict takes other arguments).
    def dataset(sites):
        return xr.Dataset({k: (("chain", "draw", f"{k}_dim_0"), v) for k, v in sites.items()})

    # One chain: ArviZ's R-hat needs two; split R-hat of one chain is its halves'.
    halves = {k: v[:, : v.shape[1] // 2 * 2].reshape(2, v.shape[1] // 2, -1)
              for k, v in sites.items()}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        one = next(iter(sites.values())).shape[0] == 1
        rhats = az.rhat(dataset(halves if one else sites), method="rank")
        esses = az.ess(dataset(sites), method="bulk")
    rhat, ess = {}, {}
    for name, x in sites.items():
        r, e = np.asarray(rhats[name]), np.asarray(esses[name])
        # A coordinate that never moved has no variance: R-hat inf, ESS 0.
        frozen = np.ptp(x, axis=(0, 1)) == 0
        rhat[name] = float(np.max(np.where(frozen | ~np.isfinite(r), np.inf, r)))
        ess[name] = float(np.min(np.where(frozen | ~np.isfinite(e), 0.0, e)))
    draws = np.concatenate(list(sites.values()), axis=-1)  # (chains, draws, coordinates)
    changed = np.any(draws[:, 1:] != draws[:, :-1], axis=-1)
    worst_rhat = max(rhat, key=rhat.get)
    worst_ess = min(ess, key=ess.get)
    return MixingReport(rhat[worst_rhat], worst_rhat, ess[worst_ess], worst_ess,
                        changed.mean(axis=1), changed.shape[1] + 1)


def warn_if_not_mixed(report: MixingReport | None, stacklevel: int = 2) -> None:
    """Warn with a :class:`MixingWarning` when ``report`` lists a problem."""
    if report is None or not report.problems:
        return
    warnings.warn(
        "The draws do not represent the posterior yet: " + "; ".join(report.problems)
        + ". Under DP noise this usually means steps too small to move (plan the run: "
        "fewer iterations carry less noise each, a larger proposal scale or step size, "
        "or a larger epsilon) or chains that have not left their starts (a longer "
        "warm-up). Summaries of these draws are not posterior summaries. "
        "`mcmc.mixing` holds the figures; `check_mixing=False` turns this check off.",
        MixingWarning,
        stacklevel=stacklevel + 1,
    )
