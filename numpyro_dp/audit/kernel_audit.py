"""The white-box, end-to-end audit of a kernel (:func:`audit_kernel`).

It runs the kernel through :class:`~numpyro_dp.PrivateMCMC`, records every
release at the noise gates, replays the same path on the neighbour and
composes the releases as they were made into the epsilon they deliver, against
what the ledger charged and how many releases it charged.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import dp_accounting as dpa
import jax
import numpy as np
from scipy.special import log_ndtr, logsumexp

from numpyro_dp.accounting import epsilon_spent
from numpyro_dp.accounting.events import compose, releases
from numpyro_dp.accounting.gaussian import gaussian_epsilon
from numpyro_dp.accounting.ledger import PrivacySpent
from numpyro_dp.accounting.rdp import ORDERS, BarkerDpEvent, barker_rdp, curve_epsilon, wbk_amplify
from numpyro_dp.audit.bounds import (
    AuditResult,
)
from numpyro_dp.audit.runs import (
    Dataset,
    audit_runner,
    check_clips_stated,
)
from numpyro_dp.kernels import barker
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.primitives import tap
from numpyro_dp.primitives.secret import ReproducibleNoiseWarning

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
        (``"substitute"``): only the same batches replay the same path.  With
        ``privacy_unit`` (:class:`Dataset`) the run is private per unit, the
        canary a whole unit, and ``n`` counts units.
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
    check_clips_stated(kernel)
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
        claim = audit_runner(kernel, num_chains, epsilon, **options)
        with tap.tapped(recorded):
            claim.run(key, *data.args, **data.run_kwargs)
        other = audit_runner(claim.sampler, num_chains, None, **options)
        with tap.tapped(replayed):
            other.run(key, *neighbour.args, **neighbour.run_kwargs)
    jax.effects_barrier()
    spent = claim.privacy_spent()
    made = recorded.count
    bound, figures = _realised_epsilon(spent, recorded, replayed, delta)
    details = (f"{type(kernel).__name__}, {num_chains} chain(s) x {num_warmup + num_samples} "
               f"iterations: {made} releases made, {spent.num_releases} charged; {figures}")
    return AuditResult("white-box kernel", spent.epsilon, delta, bound, 1.0, made, details,
                       _violations(spent, recorded, replayed, claim, other))


def _shapes(dataset: Dataset) -> tuple:
    """What fixes the batches: the rows' shapes, or with units their number."""
    if dataset.privacy_unit is not None:
        return len(np.unique(dataset.privacy_unit))
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
