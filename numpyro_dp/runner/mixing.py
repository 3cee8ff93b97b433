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

__all__ = ["MixingReport", "MixingWarning", "mixing_report", "print_summary",
           "rank_diagnostics", "warn_if_not_mixed"]

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


def rank_diagnostics(samples_by_chain: Mapping[str, np.ndarray]) -> dict | None:
    """Per coordinate: ArviZ's rank-normalised split R-hat and bulk ESS (what
    ``az.summary`` shows), by site, each of the site's shape past ``(chain, draw)``.

    One chain's R-hat is that of its two halves.  A coordinate that never moved has R-hat
    inf and ESS 0.  None when there are fewer than 4 draws per chain (split R-hat needs 4).
    """
    sites = {k: np.asarray(v, dtype=np.float64) for k, v in samples_by_chain.items()}
    shapes = {k: v.shape[2:] for k, v in sites.items() if v.size}
    sites = {k: v.reshape(v.shape[:2] + (-1,)) for k, v in sites.items() if v.size}
    if not sites or next(iter(sites.values())).shape[1] < 4:
        return None

    # A plain Dataset works on both ArviZ lines (0.x and the DataTree-based 1.x, whose
    # from_dict takes other arguments).
    def dataset(sites):
        return xr.Dataset({k: (("chain", "draw", f"{k}_dim_0"), v) for k, v in sites.items()})

    halves = {k: v[:, : v.shape[1] // 2 * 2].reshape(2, v.shape[1] // 2, -1)
              for k, v in sites.items()}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        one = next(iter(sites.values())).shape[0] == 1
        rhats = az.rhat(dataset(halves if one else sites), method="rank")
        esses = az.ess(dataset(sites), method="bulk")
    out = {}
    for name, x in sites.items():
        r, e = np.asarray(rhats[name]), np.asarray(esses[name])
        frozen = np.ptp(x, axis=(0, 1)) == 0
        out[name] = (np.where(frozen | ~np.isfinite(r), np.inf, r).reshape(shapes[name]),
                     np.where(frozen | ~np.isfinite(e), 0.0, e).reshape(shapes[name]))
    return out


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
        None when there are fewer than 4 draws per chain (split R-hat needs 4).  R-hat
        and ESS: :func:`rank_diagnostics` (the largest and the least).
    """
    diagnostics = rank_diagnostics(samples_by_chain)
    if diagnostics is None:
        return None
    rhat = {k: float(np.max(r)) for k, (r, _) in diagnostics.items()}
    ess = {k: float(np.min(e)) for k, (_, e) in diagnostics.items()}
    draws = np.concatenate([np.asarray(samples_by_chain[k], np.float64).reshape(
        np.shape(samples_by_chain[k])[:2] + (-1,)) for k in diagnostics], axis=-1)
    changed = np.any(draws[:, 1:] != draws[:, :-1], axis=-1)
    worst_rhat = max(rhat, key=rhat.get)
    worst_ess = min(ess, key=ess.get)
    return MixingReport(rhat[worst_rhat], worst_rhat, ess[worst_ess], worst_ess,
                        changed.mean(axis=1), changed.shape[1] + 1)


def print_summary(samples_by_chain: Mapping[str, np.ndarray], prob: float = 0.9) -> None:
    """NumPyro's summary table (``numpyro.diagnostics.print_summary``: mean, sd, median,
    the ``prob`` HPDI, n_eff, r_hat), with ``n_eff`` and ``r_hat`` from
    :func:`rank_diagnostics`, so that it reports the R-hat that :func:`mixing_report`
    and ``az.summary`` report (NumPyro's own split R-hat, without the rank
    normalisation, read 96 where they read 4.5 on the same frozen chains)."""
    from itertools import product

    from numpyro.diagnostics import summary

    samples = {k: np.asarray(v) for k, v in samples_by_chain.items()}
    table = summary(samples, prob, group_by_chain=True)
    diagnostics = rank_diagnostics(samples)
    if not table:
        return
    for name, stats in table.items():
        if diagnostics is not None and name in diagnostics:
            stats["r_hat"], stats["n_eff"] = diagnostics[name]
    width = max(max(len(k) + 2 + 3 * max(len(v.shape) - 2, 0) for k, v in samples.items()),
                10)
    name_format = "{:>" + str(width) + "}"
    columns = [""] + list(next(iter(table.values())).keys())
    print()
    print((name_format + " {:>9}" * (len(columns) - 1)).format(*columns))
    row_format = name_format + " {:>9.2f}" * (len(columns) - 1)
    for name, stats in table.items():
        shape = np.shape(stats["mean"])
        for idx in product(*map(range, shape)):
            label = name + ("[{}]".format(",".join(map(str, idx))) if shape else "")
            print(row_format.format(label, *[np.asarray(v)[idx] for v in stats.values()]))
    print()


def print_run_summary(mcmc, prob: float = 0.9, exclude_deterministic: bool = True) -> None:
    """:meth:`PrivateMCMC.print_summary <numpyro_dp.PrivateMCMC.print_summary>`: the
    draws' table (:func:`print_summary`; deterministic sites left out as NumPyro
    does), then the number of divergences where the kernel reports them."""
    sites = mcmc.get_samples(group_by_chain=True)
    latent = getattr(mcmc._last_state, mcmc._sample_field, None)
    if exclude_deterministic and isinstance(latent, dict):
        sites = {k: v for k, v in sites.items() if k in latent}
    print_summary(sites, prob)
    extra = mcmc.get_extra_fields()
    if "diverging" in extra:
        print(f"Number of divergences: {int(np.sum(np.asarray(extra['diverging'])))}")


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
