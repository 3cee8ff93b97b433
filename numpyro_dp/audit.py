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
* :func:`fault` injects the bugs an audit must catch (the noise halved, the
  clip skipped for the canary row, a chain not charged), to check that an
  audit has the power to see them.
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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import log_likelihood
from scipy import stats

from numpyro_dp.accounting import epsilon_spent, sensitivity_factor
from numpyro_dp.accounting.gaussian import gaussian_epsilon
from numpyro_dp.kernels import barker, base, penalty
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.primitives import gradients
from numpyro_dp.primitives.rounding import exact_sum
from numpyro_dp.primitives.secret import noise_key, run_secret

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
        ``"multi-run"``, ``"one-run"`` or ``"white-box"``.
    claimed_epsilon, delta : float
        The guarantee audited (for :func:`multi_run`, what the ledger charged
        for one run).
    epsilon_lower_bound : float
        Epsilon is at least this, with probability ``confidence`` over the
        audit's randomness, if the mechanism is what was run.
    confidence : float
    num_trials : int
        Runs per data set, canaries, or release draws per data set.
    details : str
        Figures behind the bound (e.g. the realised noise multiplier).
    """

    method: str
    claimed_epsilon: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    num_trials: int
    details: str = ""

    @property
    def passed(self) -> bool:
        """Whether the audit found nothing against the claim (bound <= claim)."""
        return self.epsilon_lower_bound <= self.claimed_epsilon

    def __str__(self) -> str:
        verdict = "consistent with the claim" if self.passed else "VIOLATES the claim"
        text = (f"{self.method} audit, {self.num_trials} trials: epsilon >= "
                f"{self.epsilon_lower_bound:.3g} at {self.confidence:.0%} confidence; "
                f"claimed ({self.claimed_epsilon:.3g}, {self.delta:g})-DP: {verdict}")
        return text + (f"\n  {self.details}" if self.details else "")


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
    from numpyro_dp.mcmc import PrivateMCMC  # the runner sits above this module's users

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

    Clips every row as the kernels do (:func:`~numpyro_dp.kernels.base.clip_ratios`
    for scalar rows, :func:`~numpyro_dp.primitives.gradients.clip_weights` for
    vectors), sums, and releases
    through :func:`~numpyro_dp.kernels.base.release_clipped_sum` ``num_draws``
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
            return base.release_clipped_sum(key, total, n, bound,
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
        return base.clip_ratios(rows, clip), clip
    weights = gradients.clip_weights(jnp.linalg.norm(rows, axis=1), clip)
    return rows * weights[:, None], gradients.vector_clip_bound(clip, rows.shape[1], rows.dtype)


# ----------------------------------------------------------------- power checks
FAULTS = ("noise_halved", "canary_unclipped", "chain_not_charged")


@contextlib.contextmanager
def fault(name: str) -> Iterator[None]:
    """Break the library on purpose inside a ``with`` block, to check an audit's power.

    * ``"noise_halved"``: every Gaussian release draws half the noise that its
      accountant charges;
    * ``"canary_unclipped"``: the most extreme row of every clipped sum (the
      canary, wherever a minibatch puts it) escapes the clip, gradients and
      log-likelihood ratios alike;
    * ``"chain_not_charged"``: the runner charges one chain fewer than it runs.

    An audit that does not report a violation under a fault cannot vouch for
    the unbroken code either.  Never use it outside an audit: the runs inside
    the block are not private.
    """
    from numpyro_dp import mcmc

    if name not in FAULTS:
        raise ValueError(f"fault={name!r}; use one of {FAULTS}.")
    if name == "noise_halved":
        release = base.grid_release
        replacements = {release: lambda key, hi, lo, scale, *a, **k: release(
            key, hi, lo, scale / 2, *a, **k)}
    elif name == "canary_unclipped":
        weights, ratios = gradients.clip_weights, base.clip_ratios

        def extreme(values):  # the canary: the row furthest out, wherever a batch put it
            return jnp.arange(values.shape[0]) == jnp.argmax(jnp.abs(values))

        replacements = {
            weights: lambda norms, clip: jnp.where(extreme(norms), 1.0, weights(norms, clip)),
            ratios: lambda r, clip: jnp.where(extreme(r), r, ratios(r, clip)),
        }
    else:
        entry = mcmc.PrivateMCMC._entry

        def short(self, *args):
            charged = entry(self, *args)
            return dataclasses.replace(charged, num_chains=max(1, charged.num_chains - 1))

        replacements = {entry: short}
    # Every binding of the original, wherever a module imported it by name.
    owners = [m for n, m in list(sys.modules.items()) if n.startswith("numpyro_dp")]
    owners.append(mcmc.PrivateMCMC)
    saved = [(owner, attr, value) for owner in owners for attr, value in vars(owner).items()
             if any(value is original for original in replacements)]
    try:
        for owner, attr, original in saved:
            setattr(owner, attr, replacements[original])
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
