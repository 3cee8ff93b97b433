"""What an audit found (:class:`AuditResult`) and the statistics of its lower bound.

The bounds are computed by DeepMind's ``jax_privacy.auditing``
(``CanaryScoreAuditor``): the threshold is chosen on :data:`THRESHOLD_SHARE`
of the scores and the bound computed on the rest (``Split``), so choosing it
costs no confidence.  :func:`epsilon_lower_bound` bounds epsilon from many
runs' scores on two neighbours, :func:`one_run_epsilon_lower_bound` from one
run's canaries (Steinke, Nasr & Jagielski 2023).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

#: The threshold is chosen on this share of the scores; the bound uses the rest.
THRESHOLD_SHARE = 0.3


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


def check_confidence(confidence: float, delta: float) -> None:
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
    check_confidence(confidence, delta)
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
    check_confidence(confidence, delta)
    scores, included = np.asarray(scores, np.float64), np.asarray(included, bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError("scores and included need one entry per canary.")
    auditor, strategy = _auditor(scores[included], scores[~included])
    return float(auditor.epsilon_one_run(1 - confidence, max(delta, 1e-300),
                                         threshold_strategy=strategy))
