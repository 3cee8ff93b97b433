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
* Privacy units (:mod:`~numpyro_dp.model.units`): a :class:`Dataset` with
  ``privacy_unit=ids`` is run private per unit, and :func:`unit_neighbour`
  makes its neighbour with one whole unit removed or replaced (its rows,
  :func:`unit_rows`, are the canary).  The same pair without ids audits the
  row-level guarantee against a unit of many rows, which it does not protect.
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

The package's modules, one job each: :mod:`~numpyro_dp.audit.bounds` (the
result and the statistics of the lower bound), :mod:`~numpyro_dp.audit.runs`
(data sets and the audited runner), :mod:`~numpyro_dp.audit.black_box`
(:func:`multi_run`, :func:`one_run`), :mod:`~numpyro_dp.audit.release_audits`
(the white-box release audits), :mod:`~numpyro_dp.audit.kernel_audit`
(:func:`audit_kernel`) and :mod:`~numpyro_dp.audit.faults` (:func:`fault`).
"""

from numpyro_dp.audit.black_box import canary_log_likelihood, multi_run, one_run
from numpyro_dp.audit.bounds import (
    THRESHOLD_SHARE,
    AuditResult,
    epsilon_lower_bound,
    one_run_epsilon_lower_bound,
)
from numpyro_dp.audit.faults import FAULTS, fault
from numpyro_dp.audit.kernel_audit import REALISED_Z_GRID, audit_kernel
from numpyro_dp.audit.release_audits import barker_test, batch_llr_release, clipped_sum_release
from numpyro_dp.audit.runs import Dataset, unit_neighbour, unit_rows

__all__ = [
    "FAULTS",
    "REALISED_Z_GRID",
    "THRESHOLD_SHARE",
    "AuditResult",
    "Dataset",
    "audit_kernel",
    "barker_test",
    "batch_llr_release",
    "canary_log_likelihood",
    "clipped_sum_release",
    "epsilon_lower_bound",
    "fault",
    "multi_run",
    "one_run",
    "one_run_epsilon_lower_bound",
    "unit_neighbour",
    "unit_rows",
]
