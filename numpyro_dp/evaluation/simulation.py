"""Simulation-based calibration (Talts et al. 2018) of a private inference route.

Draw ``theta_j`` from the prior and ``y_j`` from the model on fixed public
covariates, run the route on ``(X, y_j)`` and take the rank of each coordinate
of ``theta_j`` among the route's draws.  A calibrated route gives uniform ranks,
and its central 50% and 90% intervals cover ``theta_j`` at those rates; a
route that is too confident piles the ranks at both ends and covers too
rarely.  Every simulated data set is made up, so a route may use the
test-only reproducible noise here.

Examples
--------
>>> result = sbc(noise_aware_route(model, epsilon=3.0, delta=1e-6), model, X,
...              num_simulations=100)  # doctest: +SKIP
>>> result.passed, result.coverage  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import jax
import numpy as np
from jax.scipy.special import gammaincc
from numpyro.infer import Predictive

#: Central intervals whose coverage is reported.
LEVELS = (0.5, 0.9)
#: Coverage may miss its level by this many Monte Carlo standard errors.
COVERAGE_SES = 3.0
#: Smallest chi-square p-value of the rank histograms, after Bonferroni over coordinates.
MIN_P_VALUE = 0.01


@dataclasses.dataclass(frozen=True)
class SBCResult:
    """Ranks and coverage of one route over ``num_simulations`` simulated data sets.

    Attributes
    ----------
    names : tuple of str
        The coordinate of each column (``"w[1]"``).
    ranks : ndarray, shape (num_simulations, num_coordinates)
        Rank of the true value among the route's ``num_draws`` draws (0 to ``num_draws``).
    num_draws : int
        Draws per simulation the ranks are taken among.
    coverage : dict
        Level -> share of (simulation, coordinate) pairs whose central interval
        at that level holds the true value.
    coverage_se : dict
        Level -> its Monte Carlo standard error at the nominal rate.
    p_values : ndarray, shape (num_coordinates,)
        Chi-square p-value of each coordinate's rank histogram (``num_bins`` bins).
    num_bins : int
    refused : int
        Simulations the route refused (:class:`~numpyro_dp.UnusableReleaseError`
        after its charge): they have no draws, so the ranks and coverage are
        those of the runs that sampled, conditional on not being refused.
    warned : int
        Sampled simulations whose run emitted a
        :class:`~numpyro_dp.CalibrationWarning` (its release lies outside the
        regime it was shown calibrated in).  The ranks and coverage include them,
        as a user who ignores the warning gets them.
    unwarned_coverage : dict
        Level -> coverage over the sampled runs that did not warn (NaN: none).
    """

    names: tuple
    ranks: np.ndarray
    num_draws: int
    coverage: dict
    coverage_se: dict
    p_values: np.ndarray
    num_bins: int
    refused: int = 0
    warned: int = 0
    unwarned_coverage: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Ranks uniform (every p-value above :data:`MIN_P_VALUE` over the number of
        coordinates) and every coverage within :data:`COVERAGE_SES` standard errors."""
        uniform = bool(np.all(self.p_values > MIN_P_VALUE / len(self.names)))
        covered = all(abs(self.coverage[q] - q) <= COVERAGE_SES * self.coverage_se[q]
                      for q in self.coverage)
        return uniform and covered

    def __str__(self) -> str:
        cover = ", ".join(f"{q:.0%}: {c:.1%} (se {self.coverage_se[q]:.1%})"
                          for q, c in self.coverage.items())
        refused = f" ({self.refused} more refused)" if self.refused else ""
        if self.warned:
            unwarned = ", ".join(f"{q:.0%}: {c:.1%}" for q, c in self.unwarned_coverage.items())
            refused += (f", {self.warned} of them with a CalibrationWarning (coverage "
                        f"without them {unwarned})")
        return (f"SBC over {self.ranks.shape[0]} simulations{refused}, {len(self.names)} "
                f"coordinates: coverage {cover}; smallest rank p-value "
                f"{self.p_values.min():.3g} ({'passed' if self.passed else 'FAILED'})")


def sbc(
    route: Callable,
    model: Callable,
    *args,
    num_simulations: int = 100,
    num_bins: int = 5,
    rng_key: jax.Array | None = None,
    observed: str = "y",
    **kwargs,
) -> SBCResult:
    """Simulation-based calibration of ``route`` on ``model(*args, **kwargs)``.

    Parameters
    ----------
    route : callable
        ``route(key, *args, **kwargs_with_observed) -> dict`` of posterior draws by
        latent site (each of shape ``(num_draws, ...)``), e.g.
        :func:`noise_aware_route`.
    model : callable
        The NumPyro model; ``args`` and ``kwargs`` its public covariates.
    num_simulations : int
    num_bins : int
        Bins of the rank histograms (their chi-square test).
    rng_key : jax.Array, optional
        Key of the prior draws and of each run (default ``PRNGKey(0)``).
    observed : str
        The observed site, passed to the route as the keyword of that name.

    Returns
    -------
    SBCResult
        A simulation the route refuses (it raises
        :class:`~numpyro_dp.UnusableReleaseError`) is counted in ``refused`` and
        has no ranks.

    Raises
    ------
    ValueError
        If the route refused every simulation.
    """
    from numpyro_dp.releases.noise_aware import CalibrationWarning, UnusableReleaseError

    key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    key_prior, key_runs = jax.random.split(key)
    prior = Predictive(model, num_samples=num_simulations)(key_prior, *args, **kwargs)
    ranks, inside, names, refused, warned = [], {q: [] for q in LEVELS}, None, 0, []
    for j, key_run in enumerate(jax.random.split(key_runs, num_simulations)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CalibrationWarning)
            try:
                draws = route(key_run, *args,
                              **{**kwargs, observed: np.asarray(prior[observed][j])})
            except UnusableReleaseError:
                refused += 1
                continue
        for w in caught:  # the others go on to the caller
            if not issubclass(w.category, CalibrationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        warned.append(any(issubclass(w.category, CalibrationWarning) for w in caught))
        truth, flat, names = _flatten({k: prior[k][j] for k in draws}, draws)
        ranks.append(np.sum(flat < truth, axis=0))
        for q in LEVELS:
            lo, hi = np.quantile(flat, [(1 - q) / 2, (1 + q) / 2], axis=0)
            inside[q].append((lo <= truth) & (truth <= hi))
    if not ranks:
        raise ValueError(f"The route refused all {num_simulations} simulations.")
    ranks = np.asarray(ranks)
    num_draws = flat.shape[0]
    edges = np.linspace(0, num_draws + 1, num_bins + 1)
    p_values = np.array([_chi_square_p(np.histogram(ranks[:, i], bins=edges)[0])
                         for i in range(ranks.shape[1])])
    coverage = {q: float(np.mean(inside[q])) for q in LEVELS}
    quiet = ~np.asarray(warned)
    unwarned = {q: float(np.mean(np.asarray(inside[q])[quiet])) if quiet.any() else float("nan")
                for q in LEVELS}
    cells = ranks.size
    coverage_se = {q: float(np.sqrt(q * (1 - q) / cells)) for q in LEVELS}
    return SBCResult(tuple(names), ranks, num_draws, coverage, coverage_se, p_values, num_bins,
                     refused, int(sum(warned)), unwarned)


def _chi_square_p(counts: np.ndarray) -> float:
    """Pearson's chi-square test of equal bin probabilities: its p-value."""
    expected = counts.sum() / counts.size
    statistic = float(np.sum((counts - expected) ** 2) / expected)
    return float(gammaincc((counts.size - 1) / 2, statistic / 2))


def _flatten(truth: dict, draws: dict) -> tuple[np.ndarray, np.ndarray, list]:
    """The true values (flat), the draws ``(num_draws, coordinates)`` and the names."""
    values, columns, names = [], [], []
    for name in sorted(draws):
        x = np.asarray(draws[name])
        t = np.asarray(truth[name]).reshape(-1)
        values.append(t)
        columns.append(x.reshape(x.shape[0], -1))
        names += [name] if t.size == 1 else [f"{name}[{i}]" for i in range(t.size)]
    return np.concatenate(values), np.concatenate(columns, axis=1), names


def noise_aware_route(
    model: Callable,
    epsilon: float,
    delta: float,
    *,
    num_warmup: int = 300,
    num_samples: int = 300,
    **kernel_options,
) -> Callable:
    """:class:`~numpyro_dp.NoiseAwareNUTS` as an SBC route: one chain, reproducible
    noise (the data are simulated), warnings off but the release's own
    :class:`~numpyro_dp.CalibrationWarning` (which :func:`sbc` counts; the one that
    names a model's positive latents is the model's, the same in every run, and is
    left out); draws of the latent sites."""
    from numpyro_dp.releases.noise_aware import CalibrationWarning, NoiseAwareNUTS
    from numpyro_dp.runner.mcmc import PrivateMCMC

    def route(key, *args, **kwargs):
        mcmc = PrivateMCMC(NoiseAwareNUTS(model, **kernel_options), num_warmup=num_warmup,
                           num_samples=num_samples, epsilon=epsilon, delta=delta,
                           progress_bar=False, reproducible_noise=True, check_mixing=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", CalibrationWarning)
            warnings.filterwarnings("ignore", ".*positive latent", CalibrationWarning)
            mcmc.run(key, *args, **kwargs)
        samples = mcmc.get_samples()
        return {k: samples[k] for k in mcmc.sampler._private_model.latent_sites}

    return route


def nuts_route(model: Callable, *, num_warmup: int = 300, num_samples: int = 300) -> Callable:
    """NumPyro's NUTS on the rows themselves (not private) as an SBC route: the
    yardstick a private route is read against on the same simulations.  Its ranks are
    uniform in expectation, so where a finite set of simulations makes both cover
    too rarely, it is the simulations, not the private route.  One chain."""
    from numpyro.infer import MCMC, NUTS

    mcmc = MCMC(NUTS(model), num_warmup=num_warmup, num_samples=num_samples,
                progress_bar=False)

    def route(key, *args, **kwargs):
        mcmc.run(key, *args, **kwargs)
        samples = mcmc.get_samples()
        return {k: v for k, v in samples.items()
                if k in mcmc.last_state.z}  # the latents, not deterministic sites

    return route
