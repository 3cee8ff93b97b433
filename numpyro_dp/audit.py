"""``ndp.audit``: empirical lower bounds on the epsilon that a kernel or a release delivers.

Proofs and accountants say what epsilon *should* be; an audit runs the code
and bounds from below what it *does* deliver.  Each audit plays a
distinguishing game between neighbouring data sets and turns the attacker's
success into a lower bound on epsilon that holds with a stated confidence.
A lower bound above the claimed epsilon is a bug: in the sampler, its clipping
or noise, or its accounting.  A lower bound below the claim says only that
this attacker found nothing; audits of Gaussian mechanisms at small ``delta``
are far from tight (the tails that drive epsilon(delta) are rare events), so
they have power against broken mechanisms, not as a proof of privacy.

* :func:`multi_run` (Jagielski, Ullman & Oprea 2020; Nasr et al. 2021): run a
  kernel many times on ``data`` (with the canary row) and on ``neighbour``
  (without it, or with it replaced), score each run's output, and bound
  epsilon from the false-positive and false-negative rates of the best
  threshold, with Clopper-Pearson intervals.  The claim is what the
  library's own ledger charged for one run.  The runs are the chains of one
  vectorized :class:`~numpyro_dp.PrivateMCMC` call, so thousands cost little.
* :func:`one_run` (Steinke, Nasr & Jagielski 2023): ``m`` canary rows, each
  included with probability 1/2, one run; the bound comes from how many
  inclusions the canaries' scores guess right.
* :func:`audit_kernel` (white box, end to end): runs a kernel through
  :class:`~numpyro_dp.PrivateMCMC` as a user would, records every release it
  makes at the noise gates (what was computed before the noise, and the noise
  actually drawn), replays the same path on the neighbour, and composes the
  releases as they were made into the epsilon they deliver, against what the
  ledger charged and how many releases it charged.
* :func:`fault` injects the bugs an audit must catch (the noise halved, the
  clip skipped for the canary row, a chain not charged, the noise multiplier
  divided inside a kernel after the charge), to check that an audit has the
  power to see them.
* :func:`clipped_sum_release` and :func:`batch_llr_release` (white-box): the
  library's Gaussian releases (of a clipped sum; of DPMinibatchPenalty's batch
  statistic), drawn many times on two neighbouring sets of rows; the realised
  sensitivity and noise standard deviation give the release's Gaussian
  privacy parameter ``mu`` and its epsilon, compared with the accountant's;
  :func:`barker_test`, DP Barker's accept test on a fixed batch.

The bounds themselves are computed by DeepMind's ``jax_privacy.auditing``
(``CanaryScoreAuditor``): the threshold is chosen on one half of the scores
and the bound computed on the other (``Split``), so choosing it costs no
confidence.  It is an optional dependency: ``pip install numpyro-dp[audit]``.

Audits run on data sets the auditor makes up (or public data); their outputs
are not charged to any user's ledger and are not private.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import log_likelihood
from scipy import stats
from scipy.special import log_ndtr, logsumexp

from numpyro_dp.accounting import epsilon_spent, sensitivity_factor
from numpyro_dp.accounting.events import compose, releases
from numpyro_dp.accounting.gaussian import gaussian_epsilon
from numpyro_dp.accounting.ledger import PrivacySpent
from numpyro_dp.accounting.rdp import ORDERS, BarkerDpEvent, barker_rdp, curve_epsilon, wbk_amplify
from numpyro_dp.kernels import barker, hmc, penalty, ratios, sg_dynamics
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.primitives import clipping, release, tap
from numpyro_dp.primitives.rounding import exact_sum
from numpyro_dp.primitives.secret import ReproducibleNoiseWarning, noise_key, run_secret

#: The threshold is chosen on this share of the scores; the bound uses the rest.
THRESHOLD_SHARE = 0.3


class Dataset:
    """A data set as a model takes it: ``Dataset(X, y=y)`` is ``model(X, y=y)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        shapes = [np.shape(a) for a in self.args] + [
            f"{k}={np.shape(v)}" for k, v in self.kwargs.items()]
        return f"Dataset({', '.join(map(str, shapes))})"


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What an audit found.

    Attributes
    ----------
    method : str
        ``"multi-run"``, ``"one-run"``, ``"white-box"`` or ``"white-box kernel"``.
    claimed_epsilon, delta : float
        The guarantee audited (for :func:`multi_run` and :func:`audit_kernel`,
        what the ledger charged for one run).
    epsilon_lower_bound : float
        Epsilon is at least this, with probability ``confidence`` over the
        audit's randomness, if the mechanism is what was run
        (:func:`audit_kernel`: the epsilon of the releases as they were made).
    confidence : float
        1 for :func:`audit_kernel`, whose bound is computed, not estimated.
    num_trials : int
        Runs per data set, canaries, release draws per data set, or (for
        :func:`audit_kernel`) releases made.
    details : str
        Figures behind the bound (e.g. the realised noise multiplier).
    violations : tuple of str
        Faults found apart from the bound (:func:`audit_kernel`: more releases
        made than charged, a noise key used twice, draws that depend on more
        than the releases); any fails the audit.
    """

    method: str
    claimed_epsilon: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    num_trials: int
    details: str = ""
    violations: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether the audit found nothing against the claim (bound <= claim, no violation)."""
        return not self.violations and self.epsilon_lower_bound <= self.claimed_epsilon

    def __str__(self) -> str:
        verdict = "consistent with the claim" if self.passed else "VIOLATES the claim"
        text = (f"{self.method} audit, {self.num_trials} trials: epsilon >= "
                f"{self.epsilon_lower_bound:.3g} at {self.confidence:.0%} confidence; "
                f"claimed ({self.claimed_epsilon:.3g}, {self.delta:g})-DP: {verdict}")
        lines = [text, *(f"  VIOLATION: {v}" for v in self.violations)]
        return "\n".join(lines + ([f"  {self.details}"] if self.details else []))


def _auditor(in_scores, out_scores):
    try:
        from jax_privacy.auditing import CanaryScoreAuditor, Split
    except ImportError as err:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "ndp.audit computes its bounds with jax_privacy.auditing: "
            "pip install 'numpyro-dp[audit]' (or jax-privacy>=2)."
        ) from err
    strategy = Split(threshold_estimation_frac=THRESHOLD_SHARE, seed=0)
    return CanaryScoreAuditor(np.asarray(in_scores, np.float64),
                              np.asarray(out_scores, np.float64)), strategy


def _check_confidence(confidence: float, delta: float) -> None:
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must lie in (0.5, 1), e.g. 0.95.")
    if not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r} must lie in [0, 1).")


def epsilon_lower_bound(
    scores: Any, neighbour_scores: Any, *, delta: float, confidence: float = 0.95
) -> float:
    """Multi-run lower bound on epsilon from the scores of runs on two neighbours.

    For every threshold ``t`` the test "score >= t means the data set was
    ``data``" has a true-positive rate at most ``exp(epsilon)`` times its
    false-positive rate plus ``delta``; with Clopper-Pearson bounds on both
    rates this gives a bound that holds with probability ``confidence``.  The
    threshold is chosen on :data:`THRESHOLD_SHARE` of the scores, the bound
    computed on the rest.  Scores must be higher on ``data`` (one-sided: a
    search over both directions overfits the threshold to the tails).

    Parameters
    ----------
    scores, neighbour_scores : array of shape (runs,)
        One number per run on ``data`` and on ``neighbour``.
    delta : float
        The ``delta`` of the claim audited.
    confidence : float
        E.g. 0.95.
    """
    _check_confidence(confidence, delta)
    auditor, strategy = _auditor(scores, neighbour_scores)
    return float(auditor.epsilon_clopper_pearson(
        1 - confidence, delta, one_sided=True, threshold_strategy=strategy))


def one_run_epsilon_lower_bound(
    scores: Any, included: Any, *, delta: float, confidence: float = 0.95
) -> float:
    """Steinke, Nasr & Jagielski's (2023) bound from one run with random canaries.

    ``scores[i]`` is canary ``i``'s score (higher: more likely included) and
    ``included[i]`` whether it was in the data (each with probability 1/2,
    independently).  The attacker guesses "in" above a threshold (chosen on
    half the canaries) and abstains below; an (epsilon, delta)-DP run lets no
    attacker guess right much more often than ``e^epsilon / (1 + e^epsilon)``.
    """
    _check_confidence(confidence, delta)
    scores, included = np.asarray(scores, np.float64), np.asarray(included, bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError("scores and included need one entry per canary.")
    auditor, strategy = _auditor(scores[included], scores[~included])
    return float(auditor.epsilon_one_run(1 - confidence, max(delta, 1e-300),
                                         threshold_strategy=strategy))


# --------------------------------------------------------------- kernel audits
def canary_log_likelihood(model: Callable, canary: Dataset) -> Callable:
    """The default score: the canary row's log-likelihood, averaged over a run's draws.

    The canary pulls the posterior towards parameters that fit it, so runs on
    data that hold it score higher.  Returns ``score(samples, extra)`` for
    :func:`multi_run`.
    """

    def score(samples: Mapping[str, np.ndarray], extra: Mapping[str, Any]) -> np.ndarray:
        leading = next(iter(samples.values())).shape[:3]  # runs, chains, draws
        flat = {k: np.reshape(v, (-1,) + v.shape[3:]) for k, v in samples.items()}
        sites = log_likelihood(model, flat, *canary.args, **canary.kwargs)
        total = sum(np.asarray(v).reshape(len(v), -1).sum(1) for v in sites.values())
        return total.reshape(leading).mean(axis=(1, 2))

    return score


def _runs_output(mcmc, runs: int, chains: int, extra_fields: tuple) -> tuple[dict, dict]:
    def split(x):
        x = np.asarray(x)
        return x.reshape((runs, chains) + x.shape[1:])

    samples = {k: split(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    extra = mcmc.get_extra_fields(group_by_chain=True) if extra_fields else {}
    return samples, {k: jax.tree_util.tree_map(split, v) for k, v in extra.items()}


def multi_run(
    kernel: DPKernel,
    data: Dataset,
    neighbour: Dataset,
    *,
    delta: float,
    score: Callable | None = None,
    canary: Dataset | None = None,
    epsilon: float | None = None,
    num_runs: int = 2000,
    chains_per_run: int = 1,
    num_warmup: int = 0,
    num_samples: int = 1,
    extra_fields: tuple[str, ...] = (),
    confidence: float = 0.95,
    seed: int = 0,
    **runner_options: Any,
) -> AuditResult:
    """Black-box audit of ``kernel`` by many runs on two neighbouring data sets.

    One run is a :class:`~numpyro_dp.PrivateMCMC` call of ``chains_per_run``
    chains.  The first run on ``data`` is charged by the library's own runner
    and ledger; what it charged is the claim.  Then ``num_runs`` runs on each
    data set (one vectorized call each, the kernel as that first run
    configured it) are scored, and :func:`epsilon_lower_bound` bounds epsilon.

    Parameters
    ----------
    kernel : DPKernel
        A kernel with its clips stated (an audit does not select them).  Its
        noise is calibrated to ``epsilon`` for a run when it has none.
    data, neighbour : Dataset
        Neighbours in the kernel's sense: ``neighbour`` lacks the canary row
        (``"add_remove"``) or holds another row in its place (``"substitute"``).
        Choose the canary extreme within the clip: the audit is only as strong
        as its canary and its score.
    delta : float
        The ``delta`` of the claim.
    score : callable, optional
        ``score(samples, extra) -> array (runs,)``: every site of ``samples`` and
        every field of ``extra`` has leading axes (runs, chains, draws).
        Higher scores should mean ``data``.  Default: the canary's
        log-likelihood averaged over the draws (:func:`canary_log_likelihood`),
        which needs ``canary``.
    canary : Dataset, optional
        The canary row alone, as the model takes a data set.
    epsilon : float, optional
        The budget of one run (calibrates a kernel without noise; a cap
        otherwise).
    num_runs, chains_per_run, num_warmup, num_samples : int
        Runs per data set and each run's shape.
    extra_fields : tuple of str
        Info fields the score reads (e.g. ``("accept_prob",)``).
    confidence : float
    seed : int
        Public keys of the runs; the noise is secret whatever the seed.
    **runner_options :
        Passed to :class:`~numpyro_dp.PrivateMCMC` (e.g. ``accountant``).

    Returns
    -------
    AuditResult
    """
    _check_confidence(confidence, delta)
    _check_clips_stated(kernel)
    if score is None:
        if canary is None:
            raise ValueError("Give score=, or canary= (the canary row as a Dataset) for "
                             "the default score, its log-likelihood at the draws.")
        score = canary_log_likelihood(kernel.model, canary)
    options = {"num_warmup": num_warmup, "num_samples": num_samples, "delta": delta,
               **runner_options}
    key = jax.random.PRNGKey(seed)
    claim = _runner(kernel, chains_per_run, epsilon, **options)
    claim.run(jax.random.fold_in(key, 0), *data.args, **data.kwargs)
    claimed = claim.privacy_spent().epsilon
    all_scores = []
    for side, dataset in enumerate((data, neighbour), start=1):
        mcmc = _runner(claim.sampler, num_runs * chains_per_run, None, **options)
        mcmc.run(jax.random.fold_in(key, side), *dataset.args, extra_fields=extra_fields,
                 **dataset.kwargs)
        samples, extra = _runs_output(mcmc, num_runs, chains_per_run, extra_fields)
        all_scores.append(np.asarray(score(samples, extra), np.float64).reshape(num_runs))
    bound = epsilon_lower_bound(*all_scores, delta=delta, confidence=confidence)
    return AuditResult("multi-run", claimed, delta, bound, confidence, num_runs,
                       f"{type(kernel).__name__}, {chains_per_run} chain(s) x "
                       f"{num_warmup + num_samples} iterations per run")


def one_run(
    kernel: DPKernel,
    data: Dataset,
    canaries: Dataset,
    *,
    delta: float,
    score: Callable,
    null_row: Dataset | None = None,
    epsilon: float | None = None,
    num_chains: int = 1,
    num_warmup: int = 0,
    num_samples: int = 100,
    confidence: float = 0.95,
    seed: int = 0,
    **runner_options: Any,
) -> AuditResult:
    """One-run audit: ``m`` canary rows each included with probability 1/2.

    The rows of ``canaries`` (``m`` of them, in the model's row layout) are
    appended to ``data``: included ones as they are, excluded ones replaced by
    ``null_row`` (``"substitute"``: n stays public) or dropped
    (``"add_remove"``, no ``null_row``).  One charged run of ``num_chains``
    chains; ``score(samples, canaries) -> array (m,)`` scores every canary
    (higher: more likely included), e.g. its log-likelihood at the draws.

    Returns
    -------
    AuditResult
        The claim is what the run's ledger charged.
    """
    _check_confidence(confidence, delta)
    _check_clips_stated(kernel)
    m = _num_rows(canaries)
    included = np.random.default_rng(seed).random(m) < 0.5
    rows = [_take(canaries, np.flatnonzero(included))]
    if null_row is not None:
        rows.append(_repeat(null_row, m - int(included.sum())))
    audited = _concatenate([data, *rows])
    mcmc = _runner(kernel, num_chains, epsilon, num_warmup=num_warmup,
                   num_samples=num_samples, delta=delta, **runner_options)
    mcmc.run(jax.random.PRNGKey(seed), *audited.args, **audited.kwargs)
    scores = np.asarray(score(mcmc.get_samples(), canaries), np.float64).reshape(m)
    bound = one_run_epsilon_lower_bound(scores, included, delta=delta, confidence=confidence)
    return AuditResult("one-run", mcmc.privacy_spent().epsilon, delta, bound, confidence, m,
                       f"{type(kernel).__name__}, {int(included.sum())} of {m} canaries in")


def _check_clips_stated(kernel: DPKernel) -> None:
    if kernel.clip_requests():
        raise ValueError(
            "State the kernel's clips for an audit (e.g. llr_clip=1.0): an audit runs "
            "the sampler, not the private clip selection, and its canary should be "
            "extreme within a known clip."
        )


def _runner(kernel: DPKernel, num_chains: int, epsilon: float | None, **options: Any):
    """A :class:`~numpyro_dp.PrivateMCMC` of an unbound copy of ``kernel`` for audit runs:
    vectorized chains, no warm start, no mixing check (``options`` may override)."""
    from numpyro_dp.runner.mcmc import PrivateMCMC  # the runner sits above this module's users

    options = {"chain_method": "vectorized", "progress_bar": False, "check_mixing": False,
               "warm_start": 0, **options}
    return PrivateMCMC(kernel.calibrated(), num_chains=num_chains, epsilon=epsilon, **options)


def _num_rows(dataset: Dataset) -> int:
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


def _take(dataset: Dataset, index: np.ndarray) -> Dataset:
    return _map_rows([dataset], lambda xs: np.asarray(xs[0])[index])


def _repeat(dataset: Dataset, count: int) -> Dataset:
    return _map_rows([dataset], lambda xs: np.repeat(np.asarray(xs[0])[:1], count, axis=0))


def _concatenate(datasets: list[Dataset]) -> Dataset:
    return _map_rows(datasets, lambda xs: np.concatenate([np.asarray(x) for x in xs]))


# ---------------------------------------------------------- white-box release
def clipped_sum_release(
    rows: Any,
    neighbour_rows: Any,
    *,
    row_bound: float,
    noise_multiplier: float,
    delta: float,
    neighbourhood: str = "substitute",
    num_draws: int = 20_000,
    confidence: float = 0.95,
    seed: int = 0,
    reproducible_noise: bool = False,
) -> AuditResult:
    """White-box audit of the Gaussian release of a sum of clipped rows.

    Clips every row as the kernels do (:func:`~numpyro_dp.kernels.ratios.clip_ratios`
    for scalar rows, :func:`~numpyro_dp.primitives.clipping.clip_weights` for
    vectors), sums, and releases
    through :func:`~numpyro_dp.primitives.release.release_clipped_sum` ``num_draws``
    times for each set of rows.  Along the difference of the two exact sums
    the releases are ``sum + N(0, sigma^2)``: the realised sensitivity
    ``Delta`` and a ``confidence`` upper bound on ``sigma`` (chi-square) give a
    lower bound on ``mu = Delta / sigma`` and so on epsilon (Dong, Roth & Su
    2022), against the accountant's epsilon for ``noise_multiplier``.  It
    assumes Gaussian noise, which is what the code draws.

    Parameters
    ----------
    rows, neighbour_rows : array of shape (n,) or (n, d)
        Per-row contributions (log-likelihood ratios or gradients) of two
        neighbouring data sets, before clipping.
    row_bound : float
        The clip.
    noise_multiplier : float
        The ``z`` the accountant charges.
    seed : int
        The draws' public keys.
    reproducible_noise : bool
        Derive the noise from ``seed`` (tests; warns), as ``PrivateMCMC`` does.
    """
    _check_confidence(confidence, delta)
    factor = sensitivity_factor(neighbourhood)
    sides = []
    for raw in (rows, neighbour_rows):
        clipped, bound = _clip_rows(jnp.asarray(raw), row_bound)
        total = exact_sum(clipped, bound)

        def draw(key, total=total, n=clipped.shape[0], bound=bound):
            return release.release_clipped_sum(key, total, n, bound,
                                               noise_multiplier=noise_multiplier,
                                               sensitivity_factor=factor)[0]

        exact = np.asarray(total[0], np.float64) + np.asarray(total[1], np.float64)
        sides.append((draw, exact))
    return _white_box(sides, factor * row_bound, noise_multiplier, delta, neighbourhood,
                      num_draws, confidence, seed, reproducible_noise)


def batch_llr_release(
    ratios: Any,
    neighbour_ratios: Any,
    *,
    clip: float,
    scale: float,
    noise_multiplier: float,
    delta: float,
    num_draws: int = 20_000,
    confidence: float = 0.95,
    seed: int = 0,
    reproducible_noise: bool = False,
) -> AuditResult:
    """White-box audit of DPMinibatchPenalty's release, as :func:`clipped_sum_release`.

    ``ratios`` and ``neighbour_ratios`` are the log-likelihood ratios of one
    batch of ``b`` rows that differ in one row (``"substitute"``), before
    clipping to ``clip``; ``scale = n T / b``.  The release is the batch's
    ``lambda* - sigma_b^2 / 2`` plus Gaussian noise
    (:func:`~numpyro_dp.kernels.penalty.release_batch_llr`).  The claim is one
    such release with noise multiplier ``z``, before any amplification by the
    sampling of the batch (the batch is fixed here).
    """
    _check_confidence(confidence, delta)
    factor = sensitivity_factor("substitute")
    sides = []
    for raw in (ratios, neighbour_ratios):
        r = jnp.asarray(raw)

        def draw(key, r=r):
            return penalty.release_batch_llr(key, r, clip, scale,
                                             noise_multiplier=noise_multiplier,
                                             sensitivity_factor=factor)[0]

        sides.append((draw, np.asarray(penalty.batch_llr(r, clip, scale, factor)[0],
                                       np.float64)))
    b = np.shape(ratios)[0]
    nominal = factor * (scale * clip + (b - 1) / b * scale**2 * clip**2)
    return _white_box(sides, nominal, noise_multiplier, delta, "substitute", num_draws,
                      confidence, seed, reproducible_noise)


def barker_test(
    ratios: Any,
    neighbour_ratios: Any,
    *,
    n0: float,
    delta: float,
    num_draws: int = 20_000,
    confidence: float = 0.95,
    seed: int = 0,
    reproducible_noise: bool = False,
) -> AuditResult:
    """White-box audit of one DP Barker test on a fixed batch (Heikkilä et al. 2019).

    ``ratios`` and ``neighbour_ratios``: the ``b`` log-likelihood ratios of one
    batch on two data sets that differ in one row, before the clip
    ``sqrt(b) / n0``.  The test's decision is drawn ``num_draws`` times on
    each, and :func:`epsilon_lower_bound` bounds epsilon from how often it
    accepts (the canary should raise the ratio on ``ratios``).  The claim is
    one test before any amplification by the sampling of the batch.
    """
    _check_confidence(confidence, delta)
    secret = run_secret(jax.random.PRNGKey(seed), reproducible_noise, "this audit")
    correction = barker.load_correction()
    decisions = []
    for side, raw in enumerate((ratios, neighbour_ratios)):
        r = jnp.asarray(raw)
        lam, var_b = barker.barker_statistics(r, barker.barker_clip(r.shape[0], n0, r.dtype), n0)
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), side), num_draws)
        accept = jax.vmap(lambda key, lam=lam, var_b=var_b: barker.barker_decision(
            noise_key(secret, key), lam, var_b, correction))(keys)
        decisions.append(np.asarray(accept, np.float64))
    b = np.shape(ratios)[0]
    claimed = epsilon_spent(barker.BarkerDpEvent(b), delta)
    bound = epsilon_lower_bound(*decisions, delta=delta, confidence=confidence)
    return AuditResult("white-box", claimed, delta, bound, confidence, num_draws,
                       f"accepted {decisions[0].mean():.3f} with the canary, "
                       f"{decisions[1].mean():.3f} without")


def _white_box(sides, nominal, noise_multiplier, delta, neighbourhood, num_draws, confidence,
               seed, reproducible_noise) -> AuditResult:
    """``mu`` of a Gaussian release from its draws on two neighbours, and its epsilon.

    ``sides``: ``(draw(key) -> release, exact value)`` per data set.  Along the
    difference of the exact values the releases are ``value + N(0, sigma^2)``:
    the realised sensitivity and a ``confidence`` upper bound on ``sigma``
    (chi-square) give a lower bound on ``mu``.
    """
    secret = run_secret(jax.random.PRNGKey(seed), reproducible_noise, "this audit")
    releases, exact = [], []
    for side, (draw, value) in enumerate(sides):
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), side), num_draws)
        released = jax.vmap(lambda key, draw=draw: draw(noise_key(secret, key)))(keys)
        releases.append(np.asarray(released, np.float64).reshape(num_draws, -1))
        exact.append(np.asarray(value, np.float64).reshape(-1))
    difference = exact[0] - exact[1]
    realised = float(np.linalg.norm(difference))
    direction = difference / realised if realised > 0 else np.eye(len(difference))[0]
    noise = np.concatenate([(r - v) @ direction for r, v in zip(releases, exact, strict=True)])
    dof = len(noise)
    sigma_hat = float(np.sqrt(np.mean(noise**2)))
    sigma_upper = sigma_hat * math.sqrt(dof / stats.chi2.ppf(1 - confidence, dof))
    mu_lower = realised / sigma_upper
    bound = gaussian_epsilon(mu_lower, delta) if mu_lower > 0 else 0.0
    claimed = epsilon_spent(dpa.GaussianDpEvent(noise_multiplier), delta, neighbourhood)
    details = (f"noise sd / nominal sensitivity = {sigma_hat / nominal:.4g} (z = "
               f"{noise_multiplier:g}); realised sensitivity / nominal = "
               f"{realised / nominal:.4g}")
    return AuditResult("white-box", claimed, delta, max(bound, 0.0), confidence, num_draws,
                       details)


def _clip_rows(rows: jax.Array, clip: float) -> tuple[jax.Array, float]:
    """Rows clipped as the kernels clip them, and the bound on their norms."""
    if rows.ndim == 1:
        return ratios.clip_ratios(rows, clip), clip
    weights = clipping.clip_weights(jnp.linalg.norm(rows, axis=1), clip)
    return rows * weights[:, None], clipping.vector_clip_bound(clip, rows.shape[1], rows.dtype)


# ------------------------------------------------------------ white-box kernel
#: Realised noise multipliers of subsampled releases are rounded up onto this
#: geometric grid (which can only lower their epsilon), so that equal ones compose at once.
REALISED_Z_GRID = 1.001


def audit_kernel(
    kernel: DPKernel,
    data: Dataset,
    neighbour: Dataset,
    *,
    delta: float,
    epsilon: float | None = None,
    num_chains: int = 2,
    num_warmup: int = 0,
    num_samples: int = 5,
    seed: int = 0,
    **runner_options: Any,
) -> AuditResult:
    """White-box audit of ``kernel``'s own release path, end to end.

    The black-box audits see a kernel through its draws, which show little of
    an accept/reject kernel's noisy releases, so a fault between the charge and
    the noise goes unseen there.  This audit reads the releases themselves.

    1. The kernel runs on ``data`` as a user runs it, through
       :class:`~numpyro_dp.PrivateMCMC` (``num_chains`` vectorised chains); what
       its ledger charged is the claim.  A tap at the noise gates
       (:mod:`numpyro_dp.primitives.tap`: ``grid_release`` for every Gaussian
       release, ``barker_decision`` for DP Barker's tests) records every
       release made: the statistic before the noise, and the noise scale drawn.
    2. The kernel runs on ``neighbour`` with the same public keys and secret,
       each gate returning the release recorded at the same noise key, so that
       the run follows the first one's path exactly while the tap records the
       neighbour's statistics at the same states.  Its draws must equal the
       first run's: otherwise something other than the releases carried the
       data into them.
    3. Release ``k`` moved by ``Delta_k = ||s_k(data) - s_k(neighbour)||`` under
       noise ``sigma_k``, and the releases are composed as they were made:

       * full-data Gaussian releases: ``mu = sqrt(sum_k (Delta_k / sigma_k)^2)``
         and the exact Gaussian epsilon of ``mu`` (Dong, Roth & Su 2022);
       * subsampled Gaussian releases (DPSGLD, DPSGHMC, DPSGNHT,
         DPMinibatchPenalty): the charged event's sampling around each
         release's realised noise multiplier ``sigma_k / Delta_k`` (a release
         whose batch missed the canary, ``Delta_k = 0``, takes the largest one
         realised: the least the canary was seen to move a release), by the
         ledger's accountant;
       * DP Barker's decisions: each step's two accept probabilities (its
         statistic under the logistic test's noise) give its binary channel's
         Renyi divergence at the orders where DP Barker's bound holds (a step
         that missed the canary takes the smallest one realised), amplified by
         the charged sampling as the ledger's accountant amplifies the bound.

    The audit fails when that epsilon exceeds the claim, and also, whatever
    the noise, when more releases were made than charged, when a noise key
    served two releases, or when the neighbour's run left the path.

    What the figure means.  For a canary that reaches the clip at every state
    (an extreme row against its opposite under ``"substitute"``, the row
    against nothing under ``"add_remove"``) every release moves by the same
    multiple of its noise on every path, so the adaptive composition is
    exactly the composition above: for full-data Gaussian releases the figure
    is the epsilon that the releases deliver on this pair of data sets, a lower
    bound on the kernel's epsilon, and tight against a correct charge (which
    exceeds it only by the rounding it charges).  For other canaries it is the
    epsilon of the recorded path.  For subsampled releases and DP Barker it is
    the ledger's accountant applied to the releases as they were made: above
    the claim exactly when the kernel released more often, or with less noise
    per unit of the canary's sensitivity, than it was charged for; but it
    keeps the accountant's slack (WBK's RDP bound for batches drawn without
    replacement, DP Barker's per-step bound), so there it is no certified
    lower bound.  Nothing is estimated: ``confidence`` is 1.

    Parameters
    ----------
    kernel : DPKernel
        A kernel with its clips stated (an audit does not select them).  Its
        noise is calibrated to ``epsilon`` for a run when it has none.
    data, neighbour : Dataset
        Neighbours in the kernel's sense.  A subsampled kernel draws its
        batches from the ``n`` rows, so its neighbour must hold as many rows
        (``"substitute"``): only the same batches replay the same path.
    delta : float
        The ``delta`` of the claim.
    epsilon : float, optional
        The budget of the run (calibrates a kernel without noise; a cap otherwise).
    num_chains, num_warmup, num_samples : int
        The audited run (every chain and iteration is charged and audited).
    seed : int
        The runs' public keys.  Both runs need the same secret, so the audit's
        noise is derived from ``seed`` (``reproducible_noise``): an audit is
        never private, whatever data it is given.
    **runner_options :
        Passed to :class:`~numpyro_dp.PrivateMCMC` (e.g. ``accountant``).

    Returns
    -------
    AuditResult
        ``method="white-box kernel"``, ``num_trials`` the releases made.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must lie in (0, 1).")
    _check_clips_stated(kernel)
    if getattr(kernel, "batch_size", None) is not None and _shapes(data) != _shapes(neighbour):
        raise ValueError(
            f"data {data!r} and neighbour {neighbour!r} differ in shape: "
            f"{type(kernel).__name__} draws its batches from the n rows, so a neighbour with "
            "another n draws other batches and cannot replay the audited path. Audit it under "
            "'substitute' (the canary replaced, n unchanged), or black-box with "
            "audit.multi_run."
        )
    options = {"num_warmup": num_warmup, "num_samples": num_samples, "delta": delta,
               **runner_options, "reproducible_noise": True}
    key = jax.random.PRNGKey(seed)
    recorded = tap.Tap()
    replayed = tap.Tap(replay=recorded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        claim = _runner(kernel, num_chains, epsilon, **options)
        with tap.tapped(recorded):
            claim.run(key, *data.args, **data.kwargs)
        other = _runner(claim.sampler, num_chains, None, **options)
        with tap.tapped(replayed):
            other.run(key, *neighbour.args, **neighbour.kwargs)
    jax.effects_barrier()
    spent = claim.privacy_spent()
    made = recorded.count
    bound, figures = _realised_epsilon(spent, recorded, replayed, delta)
    details = (f"{type(kernel).__name__}, {num_chains} chain(s) x {num_warmup + num_samples} "
               f"iterations: {made} releases made, {spent.num_releases} charged; {figures}")
    return AuditResult("white-box kernel", spent.epsilon, delta, bound, 1.0, made, details,
                       _violations(spent, recorded, replayed, claim, other))


def _shapes(dataset: Dataset) -> tuple:
    return ([np.shape(a) for a in dataset.args],
            {k: np.shape(v) for k, v in dataset.kwargs.items()})


def _violations(spent: PrivacySpent, recorded: tap.Tap, replayed: tap.Tap, claim,
                other) -> tuple[str, ...]:
    """What fails an audited run whatever its noise."""
    found = []
    made = recorded.count
    if made > spent.num_releases:
        found.append(f"{made} releases made but {spent.num_releases} charged: "
                     f"{made - spent.num_releases} were never paid for")
    if recorded.reused:
        found.append(f"{len(recorded.reused)} release(s) drew their noise with the key of "
                     "another (the same noise twice)")
    if replayed.unmatched or replayed.count != made:
        found.append("given the releases made on data, the run on the neighbour made other "
                     "releases: its path depended on more than the releases")
    elif not _same_draws(claim, other):
        found.append("given the same releases, the draws on the neighbour differ from those "
                     "on data: something other than the releases carried the data into them")
    return tuple(found)


def _same_draws(first, second) -> bool:
    a, b = (first.get_samples(group_by_chain=True), second.get_samples(group_by_chain=True))
    return a.keys() == b.keys() and all(
        np.array_equal(np.asarray(a[k]), np.asarray(b[k]), equal_nan=True) for k in a)


def _realised_epsilon(spent: PrivacySpent, recorded: tap.Tap, replayed: tap.Tap,
                      delta: float) -> tuple[float, str]:
    """The epsilon of the releases as they were made, and the figures behind it."""
    leaves = [leaf for entry in spent.ledger for leaf, _ in releases(entry.event)]
    pairs = [(made, replayed.releases[key]) for key, made in recorded.releases.items()
             if key in replayed.releases]
    if not leaves or not pairs:
        return 0.0, "no release to compose"
    if isinstance(getattr(leaves[0], "event", None), BarkerDpEvent):
        return _barker_epsilon(leaves, pairs, delta)
    if any(made.gate != "gaussian" for made, _ in pairs):
        raise ValueError("audit_kernel composes Gaussian releases and DP Barker's tests; this "
                         "kernel made another kind of release.")
    template = _with_noise(leaves[0], 1.0)
    if any(_with_noise(leaf, 1.0) != template for leaf in leaves):
        kinds = sorted({repr(leaf) for leaf in leaves})
        raise ValueError("audit_kernel composes releases of one kind (full data, or one "
                         f"sampling); this run was charged for {kinds}.")
    sigma = np.array([made.scale for made, _ in pairs])
    moved = np.array([np.linalg.norm(made.statistic - other.statistic) for made, other in pairs])
    seen = moved > 0
    if not seen.any():
        return 0.0, "no release moved with the canary"
    realised = sigma[seen] / moved[seen]
    charged = ", ".join(f"{z:.4g}" for z in spent.noise_multipliers)
    figures = f"smallest realised noise / sensitivity {realised.min():.4g} (charged z {charged})"
    if isinstance(template, dpa.GaussianDpEvent):
        return gaussian_epsilon(float(np.sqrt(np.sum(1.0 / realised**2))), delta), figures
    # A release whose batch missed the canary: the least the canary moved one that it was in.
    z = np.where(seen, sigma / np.where(seen, moved, 1.0), realised.max())
    cells = np.ceil(np.log(z) / math.log(REALISED_Z_GRID))
    values, counts = np.unique(cells, return_counts=True)
    event = compose([(_with_noise(leaves[0], float(REALISED_Z_GRID**c)), int(k))
                     for c, k in zip(values, counts, strict=True)])
    bound = epsilon_spent(event, delta, spent.neighbourhood, spent.accountant)
    return bound, f"the canary was in {seen.sum()} of {len(pairs)} batches; {figures}"


def _with_noise(leaf: dpa.DpEvent, z: float) -> dpa.DpEvent:
    """One Gaussian release ``leaf`` (plain or subsampled) with noise multiplier ``z``."""
    if isinstance(leaf, dpa.GaussianDpEvent):
        return dpa.GaussianDpEvent(z)
    if isinstance(leaf, dpa.TruncatedSubsampledGaussianDpEvent):
        return dpa.TruncatedSubsampledGaussianDpEvent(
            leaf.dataset_size, leaf.sampling_probability, leaf.truncated_batch_size, z)
    if isinstance(leaf, dpa.PoissonSampledDpEvent):
        return dpa.PoissonSampledDpEvent(leaf.sampling_probability, _with_noise(leaf.event, z))
    if isinstance(leaf, dpa.SampledWithoutReplacementDpEvent):
        return dpa.SampledWithoutReplacementDpEvent(leaf.source_dataset_size, leaf.sample_size,
                                                    _with_noise(leaf.event, z))
    raise ValueError(f"audit_kernel cannot compose a {type(leaf).__name__} from its releases.")


def _barker_epsilon(leaves, pairs, delta: float) -> tuple[float, str]:
    """DP Barker's decisions as made: each step's binary channel, amplified as charged."""
    n, b = leaves[0].source_dataset_size, leaves[0].sample_size
    if any(leaf != leaves[0] for leaf in leaves):
        raise ValueError("audit_kernel composes DP Barker tests of one batch size and n.")
    orders = ORDERS[np.isfinite(barker_rdp(b))]  # 2, 3, ...: where DP Barker's bound holds
    correction = barker.load_correction()
    curves = [_binary_rdp(_accept_logs(made, correction), _accept_logs(other, correction),
                          orders)
              for made, other in pairs if not np.array_equal(made.statistic, other.statistic)]
    if not curves:
        return 0.0, "the canary was in no batch"
    q = b / n
    unseen = len(pairs) - len(curves)
    total = sum(wbk_amplify(c, q, orders) for c in curves)
    total = total + unseen * wbk_amplify(np.min(curves, axis=0), q, orders)
    return curve_epsilon(total, delta, orders), (
        f"the canary was in {len(curves)} of {len(pairs)} batches; realised per-step RDP at "
        f"order 2 up to {max(c[0] for c in curves):.4g} (DP Barker's bound {barker_rdp(b)[0]:.4g})")


def _accept_logs(release: tap.Release, correction: dict) -> tuple[float, float]:
    """``(log P(accept), log P(reject))`` of a DP Barker test: ``lambda`` plus
    ``N(0, scale^2)`` plus the correction's Gaussian mixture, above 0."""
    lam = release.statistic[0]
    spread = np.sqrt(release.scale**2 + correction["scales"] ** 2)
    x = (lam + correction["means"]) / spread
    log_w = np.log(correction["weights"])
    return float(logsumexp(log_w + log_ndtr(x))), float(logsumexp(log_w + log_ndtr(-x)))


def _binary_rdp(first, second, orders: np.ndarray) -> np.ndarray:
    """Renyi divergence (both directions, the larger) of two Bernoulli laws given as
    ``(log p, log(1 - p))``, at ``orders``."""

    def divergence(p, q):
        return np.logaddexp(orders * p[0] + (1 - orders) * q[0],
                            orders * p[1] + (1 - orders) * q[1]) / (orders - 1)

    return np.maximum(divergence(first, second), divergence(second, first))


# ----------------------------------------------------------------- power checks
FAULTS = ("noise_halved", "canary_unclipped", "chain_not_charged", "kernel_noise_divided")


@contextlib.contextmanager
def fault(name: str, *, divisor: float = 3.0) -> Iterator[None]:
    """Break the library on purpose inside a ``with`` block, to check an audit's power.

    * ``"noise_halved"``: every Gaussian release draws half the noise that its
      accountant charges;
    * ``"canary_unclipped"``: the most extreme row of every clipped sum (the
      canary, wherever a minibatch puts it) escapes the clip, gradients and
      log-likelihood ratios alike;
    * ``"chain_not_charged"``: the runner charges one chain fewer than it runs;
    * ``"kernel_noise_divided"``: every kernel passes its Gaussian releases the
      noise multiplier it was charged for divided by ``divisor`` (the
      stochastic-gradient kernels, their noise ``sigma``): a fault between the
      charge and the noise gate.

    An audit that does not report a violation under a fault cannot vouch for
    the unbroken code either.  Never use it outside an audit: the runs inside
    the block are not private.
    """
    from numpyro_dp.runner import charging  # the runner sits above this module's users

    if name not in FAULTS:
        raise ValueError(f"fault={name!r}; use one of {FAULTS}.")
    if divisor != 3.0 and name != "kernel_noise_divided":
        raise ValueError(f"divisor= applies to 'kernel_noise_divided' only, not {name!r}.")
    hook = contextlib.nullcontext()
    # Every binding of the original, wherever a module imported it by name.
    owners = [m for n, m in list(sys.modules.items()) if n.startswith("numpyro_dp")]
    if name == "noise_halved":
        grid_release = release.grid_release
        replacements = {grid_release: lambda key, hi, lo, scale, *a, **k: grid_release(
            key, hi, lo, scale / 2, *a, **k)}
    elif name == "canary_unclipped":
        weights, clip_ratios = clipping.clip_weights, ratios.clip_ratios

        def extreme(values):  # the canary: the row furthest out, wherever a batch put it
            return jnp.arange(values.shape[0]) == jnp.argmax(jnp.abs(values))

        replacements = {
            weights: lambda norms, clip: jnp.where(extreme(norms), 1.0, weights(norms, clip)),
            clip_ratios: lambda r, clip: jnp.where(extreme(r), r, clip_ratios(r, clip)),
        }
    elif name == "chain_not_charged":  # the runner's hook, no function replaced
        hook = charging.rewriting_entries(lambda charged: dataclasses.replace(
            charged, num_chains=max(1, charged.num_chains - 1)))
        replacements, owners = {}, []
    else:
        replacements = {made: _divided_noise(made, divisor) for made in (
            release.release_clipped_sum, ratios.release_llr, penalty.release_batch_sums)}
        sum_with_noise = release.release_sum_with_noise
        replacements[sum_with_noise] = lambda key, total, num_terms, row_bound, sigma: (
            sum_with_noise(key, total, num_terms, row_bound, sigma / divisor))
        # The kernels' bindings only: ratios' own release_llr calls release_clipped_sum.
        owners = [penalty, hmc, sg_dynamics]
    saved = [(owner, attr, value) for owner in owners for attr, value in vars(owner).items()
             if any(value is original for original in replacements)]
    try:
        for owner, attr, original in saved:
            setattr(owner, attr, replacements[original])
        with hook:
            yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def _divided_noise(release: Callable, divisor: float) -> Callable:
    """``release`` called with ``noise_multiplier / divisor``."""

    def divided(*args, noise_multiplier, **kwargs):
        return release(*args, noise_multiplier=noise_multiplier / divisor, **kwargs)

    return divided
