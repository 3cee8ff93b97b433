"""A cheap, provable *lower* bound on an event's epsilon, for refusing at once.

A run is refused when the epsilon its charge would bring exceeds the budget.
Every accountant's figure is an upper bound on the true epsilon of the
mechanism an event describes, so a lower bound on that true epsilon above the
budget proves the refusal right before any PLD is composed (composing
thousands of subsampled Gaussians took seconds).  An upper bound, such as a PLD
on a coarse grid, proves nothing here: it only ever refuses too much.

The argument, for the Gaussian releases of an event (the others, and DP
Barker's test, are left out, which only lowers the bound):

1. *Fewer releases.* A composition's output contains any sub-composition's,
   so its epsilon is at least theirs: the bound is the largest of the bounds
   of groups of releases.
2. *More noise.* A Gaussian release with noise multiplier ``z`` is a
   post-processing of one with ``z' <= z`` (add independent noise): releases
   sampled at the same rate are bounded together at their largest ``z``.
3. *One pair of neighbours.*  The event's mechanism adds Gaussian noise to a
   sum whose sensitivity ``Delta`` is attained: in units of ``Delta``, rows
   whose terms are 0 and a row whose term is ``-1/2`` (``+1/2`` in its
   neighbour: ``"substitute"``), or absent (``0`` and ``1``:
   ``"add_remove"``).  Each release is then ``y_i = s B_i + z N_i`` with
   ``B_i ~ Bernoulli(q)`` the row's inclusion (``q = 1`` unsampled, ``b / n``
   for a fixed-size batch drawn without replacement), ``s`` the row's term.
4. *One test.*  For any set ``S`` of outcomes,
   ``delta(eps) >= Q(S) - e^eps P(S)``, so ``eps(delta) >= log((Q(S) - delta)
   / P(S))``.  With ``S = {sum_i y_i > t}`` and ``J ~ Binomial(k, q)`` the
   inclusions, ``P(S) = E[Phi_bar((t - s_P J) / (z sqrt k))]``: ``J`` is
   grouped into at most :data:`BINS` ranges of exact binomial mass, and
   within each the least (``Q``) or most (``P``) favourable ``J`` is taken.
5. *Truncated batches.*  A Poisson batch cut to ``B`` rows differs from the
   uncut one only when more than ``B`` rows are drawn, so over ``k`` releases
   the probabilities of ``S`` move by at most ``k`` times that chance.

Plain Gaussian releases are bounded together exactly (``mu``-GDP, rounded
down).  Probabilities are widened by a relative :data:`MARGIN`, far above the
float64 error of scipy's normal and binomial tails.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
from scipy import stats
from scipy.special import log_ndtr, logsumexp

from numpyro_dp.accounting.budget import check_budget, check_neighbourhood
from numpyro_dp.accounting.events import compose, gaussian_mu, releases
from numpyro_dp.accounting.gaussian import gaussian_epsilon

#: Ranges the number of inclusions ``J`` is grouped into, and thresholds ``t`` tried.
BINS, THRESHOLDS = 512, 512
#: ``J`` beyond this many standard deviations of its mean forms two tail ranges.
WINDOW_SDS = 12.0
#: Relative widening of every computed probability (float64 error is ~1e-13).
MARGIN = 1e-9


def epsilon_lower_bound(event: dpa.DpEvent, delta: float,
                        neighbourhood: str = "substitute") -> float:
    """A lower bound on the epsilon of ``event`` at ``delta`` (0.0 when none is known).

    Never above the figure any sound accountant gives ``event``: an epsilon
    budget below it cannot pay for ``event`` (see the module's argument).
    Costs milliseconds whatever the number of releases.
    """
    check_budget(None, delta)
    check_neighbourhood(neighbourhood)
    mu = gaussian_mu(compose([(leaf, times) for leaf, times in releases(event)
                              if isinstance(leaf, dpa.GaussianDpEvent)]))
    bounds = [0.0]
    if mu:
        bounds.append(gaussian_epsilon(mu, delta, rounding="down"))
    for q, (z, count) in _sampled_groups(event, neighbourhood).items():
        bounds.append(_sampled_bound(q, z, count, delta, neighbourhood))
    return max(bounds)


def _sampled_groups(event: dpa.DpEvent, neighbourhood: str) -> dict[float, tuple[float, int]]:
    """``{q: (largest z, releases)}`` of the subsampled Gaussian releases of ``event``,
    ``q`` the chance that the row that differs is in a release's batch (at least)."""
    groups: dict[float, tuple[float, int]] = {}
    for leaf, times in releases(event):
        if isinstance(leaf, dpa.PoissonSampledDpEvent):
            q, base = leaf.sampling_probability, leaf.event
        elif (isinstance(leaf, dpa.SampledWithoutReplacementDpEvent)
              and neighbourhood == "substitute"):  # n is public: one row's inclusion
            q, base = leaf.sample_size / leaf.source_dataset_size, leaf.event
        elif isinstance(leaf, dpa.TruncatedSubsampledGaussianDpEvent):
            # In the batch whenever drawn with at most B - 1 of the other n - 1 rows.
            q = leaf.sampling_probability * float(stats.binom.cdf(
                leaf.truncated_batch_size - 1, leaf.dataset_size - 1, leaf.sampling_probability))
            base = dpa.GaussianDpEvent(leaf.noise_multiplier)
        else:
            continue
        if isinstance(base, dpa.GaussianDpEvent) and base.noise_multiplier > 0 and q > 0:
            z, count = groups.get(q, (0.0, 0))
            groups[q] = (max(z, base.noise_multiplier), count + times)
    return groups


def _sampled_bound(q: float, z: float, count: int, delta: float, neighbourhood: str) -> float:
    """Point 4 of the module's argument for ``count`` releases at rate ``q``, noise ``z``."""
    lo, hi, log_mass, last = _inclusions(count, min(q, 1.0))
    if neighbourhood == "substitute":  # the row's term is -1/2 in P, +1/2 in Q
        pairs = [(-0.5, 0.5)]
    else:  # absent in P, present in Q; and the reverse (the test then looks below t)
        pairs = [(0.0, 1.0), (-1.0, 0.0)]
    scale = z * math.sqrt(count)
    # Q(S) > delta needs t below about s_q J + scale * Phi_bar^-1(delta).
    reach = scale * (math.sqrt(2 * math.log(1 / delta)) + 3)

    def bound(s_p: float, s_q: float, t: np.ndarray) -> np.ndarray:
        t = t[:, None]
        # Q at each range's fewest inclusions (s_q >= 0), P at its most favourable end.
        log_q = logsumexp(log_mass + log_ndtr((s_q * lo - t) / scale), axis=1)
        log_p = logsumexp(log_mass + log_ndtr((s_p * (lo if s_p <= 0 else hi) - t) / scale),
                          axis=1)
        q_low = np.exp(log_q) * (1 - MARGIN)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(q_low > delta, np.log(q_low - delta) - (log_p + MARGIN), -np.inf)

    best = 0.0
    for s_p, s_q in pairs:
        # From the lower of the two means (below it eps < log 2) to where Q(S) < delta.
        t = np.linspace(min(s_p, s_q) * count * q, s_q * last + reach, THRESHOLDS)
        eps = bound(s_p, s_q, t)
        i = int(np.argmax(eps))  # refine around the best threshold
        finer = np.linspace(t[max(i - 1, 0)], t[min(i + 1, len(t) - 1)], THRESHOLDS // 8)
        best = max(best, float(np.max(eps)), float(np.max(bound(s_p, s_q, finer))))
    return best * (1 - MARGIN)


def _inclusions(count: int, q: float):
    """Ranges ``[lo, hi]`` of ``J ~ Binomial(count, q)``, their log masses, and the
    last ``J`` not in the upper tail range."""
    mean, sd = count * q, math.sqrt(count * q * (1 - q))
    first = max(0, math.floor(mean - WINDOW_SDS * sd))
    last = min(count, math.ceil(mean + WINDOW_SDS * sd))
    edges = np.unique(np.linspace(first, last + 1, BINS + 1).astype(np.int64))
    starts, stops = list(edges[:-1]), list(edges[1:] - 1)
    if first > 0:
        starts, stops = [0, *starts], [first - 1, *stops]
    if last < count:
        starts, stops = [*starts, last + 1], [*stops, count]
    starts, stops = np.array(starts), np.array(stops)
    # P(lo <= J <= hi), from whichever tail keeps it accurate.
    mass = np.where(
        starts > mean,
        stats.binom.sf(starts - 1, count, q) - stats.binom.sf(stops, count, q),
        stats.binom.cdf(stops, count, q) - stats.binom.cdf(starts - 1, count, q),
    )
    with np.errstate(divide="ignore"):
        log_mass = np.log(np.clip(mass, 0.0, None))
    return starts.astype(float), stops.astype(float), log_mass, last
