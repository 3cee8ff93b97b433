"""Black-box audits of a kernel, from the draws of its runs alone.

:func:`multi_run` (Jagielski, Ullman & Oprea 2020; Nasr et al. 2021) scores
many runs on two neighbouring data sets; :func:`one_run` (Steinke, Nasr &
Jagielski 2023) scores the canaries of one run.  The default score is the
canary's log-likelihood at the draws (:func:`canary_log_likelihood`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from numpyro.infer import log_likelihood

from numpyro_dp.audit.bounds import (
    AuditResult,
    check_confidence,
    epsilon_lower_bound,
    one_run_epsilon_lower_bound,
)
from numpyro_dp.audit.runs import (
    Dataset,
    audit_runner,
    check_clips_stated,
    concatenate,
    num_rows,
    repeat_row,
    take_rows,
)
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.model.units import ROW


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
        as its canary and its score.  With ``privacy_unit`` (:class:`Dataset`)
        the runs are private per unit and the canary is a whole unit
        (:func:`~numpyro_dp.audit.runs.unit_neighbour`); without it they are
        private per row, whichever rows the two differ in.
    delta : float
        The ``delta`` of the claim.
    score : callable, optional
        ``score(samples, extra) -> array (runs,)``: every site of ``samples`` and
        every field of ``extra`` has leading axes (runs, chains, draws).
        Higher scores should mean ``data``.  Default: the canary's
        log-likelihood averaged over the draws (:func:`canary_log_likelihood`),
        which needs ``canary``.
    canary : Dataset, optional
        The canary row alone, as the model takes a data set (a canary unit: its
        rows, :func:`~numpyro_dp.audit.runs.unit_rows`).
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
    check_confidence(confidence, delta)
    check_clips_stated(kernel)
    if score is None:
        if canary is None:
            raise ValueError("Give score=, or canary= (the canary row as a Dataset) for "
                             "the default score, its log-likelihood at the draws.")
        score = canary_log_likelihood(kernel.model, canary)
    options = {"num_warmup": num_warmup, "num_samples": num_samples, "delta": delta,
               **runner_options}
    key = jax.random.PRNGKey(seed)
    claim = audit_runner(kernel, chains_per_run, epsilon, **options)
    claim.run(jax.random.fold_in(key, 0), *data.args, **data.run_kwargs)
    spent = claim.privacy_spent()
    all_scores = []
    for side, dataset in enumerate((data, neighbour), start=1):
        mcmc = audit_runner(claim.sampler, num_runs * chains_per_run, None, **options)
        mcmc.run(jax.random.fold_in(key, side), *dataset.args, extra_fields=extra_fields,
                 **dataset.run_kwargs)
        samples, extra = _runs_output(mcmc, num_runs, chains_per_run, extra_fields)
        all_scores.append(np.asarray(score(samples, extra), np.float64).reshape(num_runs))
    bound = epsilon_lower_bound(*all_scores, delta=delta, confidence=confidence)
    return AuditResult("multi-run", spent.epsilon, delta, bound, confidence, num_runs,
                       f"{type(kernel).__name__}, {chains_per_run} chain(s) x "
                       f"{num_warmup + num_samples} iterations per run; claimed per "
                       f"{'row' if spent.privacy_unit == ROW else 'unit'}")


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
    check_confidence(confidence, delta)
    check_clips_stated(kernel)
    if any(d.privacy_unit is not None for d in (data, canaries, null_row) if d is not None):
        raise ValueError("one_run includes canary rows one by one: it audits a guarantee "
                         "per row. Audit one per unit with multi_run or audit_kernel (a "
                         "whole unit as the canary: audit.unit_neighbour).")
    m = num_rows(canaries)
    included = np.random.default_rng(seed).random(m) < 0.5
    rows = [take_rows(canaries, np.flatnonzero(included))]
    if null_row is not None:
        rows.append(repeat_row(null_row, m - int(included.sum())))
    audited = concatenate([data, *rows])
    mcmc = audit_runner(kernel, num_chains, epsilon, num_warmup=num_warmup,
                   num_samples=num_samples, delta=delta, **runner_options)
    mcmc.run(jax.random.PRNGKey(seed), *audited.args, **audited.kwargs)
    scores = np.asarray(score(mcmc.get_samples(), canaries), np.float64).reshape(m)
    bound = one_run_epsilon_lower_bound(scores, included, delta=delta, confidence=confidence)
    return AuditResult("one-run", mcmc.privacy_spent().epsilon, delta, bound, confidence, m,
                       f"{type(kernel).__name__}, {int(included.sum())} of {m} canaries in")
