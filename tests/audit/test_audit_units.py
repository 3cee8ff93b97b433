"""ndp.audit of privacy units (issue 40): the row-level guarantee does not protect a
person with many rows, the unit-level guarantee does.

A synthetic panel: one canary unit of 50 rows at +5 (its neighbour holds them at
-5: the whole unit substituted) and 9 other units of 1-5 rows each, drawn from
N(0, 1), so n = 56-95 rows (``delta = 0.01`` stays below 1/n) in 10 units.  The
model is the canary problem's Gaussian mean (:mod:`numpyro_dp.evaluation.canary`)
and the release one full-batch DP-SGLD step from theta = 0: its draw is the
released clipped gradient sum plus the dynamics' Gaussian noise, an exact Gaussian
channel (noise multiplier z = 1 for a clip of 1 and step size 1, claimed
(2.32, 0.01)-DP per row or per unit alike).

Per row each of the canary unit's 50 rows is clipped alone, so the substitution
moves the released sum by 50 times the sensitivity the row-level claim is charged
for; per unit the unit's total is clipped, and it moves by one sensitivity.

How decisive the verdicts are, from the audit's 95% confidence alone (nothing tuned):
the bound is computed on 70% of the runs (:data:`~numpyro_dp.audit.THRESHOLD_SHARE`
picks the threshold on the rest), m = 700 per side.  At mu = 50 the two sides'
scores do not overlap (50 noise sds apart), and the largest bound that m runs can
give is then reached: the Clopper-Pearson bounds, at 0.025 each, put the
false-positive rate below 1 - 0.025^(1/m) = 0.0053 and the true-positive rate above
0.025^(1/m) = 0.9947, so epsilon >= ln((0.9947 - delta) / 0.0053) = 5.23, far above
the claim of 2.32 (perfectly separated scores exceed it from 60 runs per side on).
An unclipped canary unit (a fault) is as separated.  At mu = 1 a sound mechanism's
bound stays below its claim with probability at least 95% over the noise, whatever
the number of runs; the seeds are fixed, so the verdict is too.
"""

import jax
import numpy as np
import pytest
from numpyro.infer import init_to_value

import numpyro_dp as ndp
from numpyro_dp import audit
from numpyro_dp.evaluation.canary import (
    CANARY,
    DELTA,
    KERNEL_AUDIT_CANARY,
    draw_score,
    mean_model,
)

#: An audit compiles its runs afresh and runs them briefly (conftest).
pytestmark = pytest.mark.compile_bound

CANARY_UNIT, CANARY_ROWS, OTHER_UNITS = 0, 50, 9
#: Runs per data set: decisive at mu = 50 (module docstring) and at an unclipped unit.
NUM_RUNS = 1000


def panel(canary: float = CANARY, seed: int = 0):
    """``(data, neighbour)`` with ``privacy_unit``: unit 0's 50 rows at ``+canary``, then
    against ``-canary``; 9 other units of 1-5 rows from N(0, 1)."""
    rng = np.random.default_rng(seed)
    sizes = np.concatenate([[CANARY_ROWS], rng.integers(1, 6, OTHER_UNITS)])
    ids = np.repeat(np.arange(OTHER_UNITS + 1), sizes)
    x = rng.normal(0.0, 1.0, len(ids)).astype(np.float32)
    x[ids == CANARY_UNIT] = canary
    data = audit.Dataset(x, privacy_unit=ids)
    replaced = audit.Dataset(np.full(CANARY_ROWS, -canary, np.float32))
    return data, audit.unit_neighbour(data, CANARY_UNIT, replaced)


def per_row(dataset):
    """The same rows without ids: runs private per row."""
    return audit.Dataset(*dataset.args, **dataset.kwargs)


def sgld(dataset):
    """One full-batch DP-SGLD step from theta = 0 (q = 1: the batch is every row, or
    every unit)."""
    ids = dataset.privacy_unit
    n = len(dataset.args[0]) if ids is None else len(np.unique(ids))
    return ndp.DPSGLD(mean_model, step_size=1.0, batch_size=n, grad_clip=1.0,
                      init_strategy=init_to_value(values={"theta": 0.0}))


def multi_run(data, neighbour):
    return audit.multi_run(sgld(data), data, neighbour, delta=DELTA, score=draw_score,
                           num_runs=NUM_RUNS, reproducible_noise=True)


# ------------------------------------------------------------------ black box
def test_the_row_level_guarantee_does_not_protect_a_unit_of_50_rows():
    """(a) The runs are private per row; the canary is a whole unit of 50 rows."""
    data, neighbour = panel()
    result = multi_run(per_row(data), per_row(neighbour))
    assert not result.passed, result
    assert "claimed per row" in result.details
    assert "VIOLATES the claim" in str(result)


def test_the_unit_level_guarantee_holds():
    """(b) The same panel and canary, the runs private per unit (``privacy_unit=ids``)."""
    data, neighbour = panel()
    result = multi_run(data, neighbour)
    assert result.passed, result
    assert "claimed per unit" in result.details


def test_the_unit_level_audit_catches_a_unit_left_unclipped():
    """Power at the same number of runs: with the canary unit's total escaping the clip
    (its 250 against -250), the audit of the unit-level run reports a violation."""
    data, neighbour = panel()
    with audit.fault("canary_unclipped"):
        result = multi_run(data, neighbour)
    assert not result.passed, result


# ---------------------------------------------------- white box, kernel end to end
def penalty_audit(data, neighbour):
    kernel = ndp.DPPenalty(mean_model, llr_clip=1.0, proposal_scale=0.5, noise_multiplier=1.0,
                           adapt_step_size=False,
                           init_strategy=init_to_value(values={"theta": 0.0}))
    return audit.audit_kernel(kernel, data, neighbour, delta=DELTA, num_chains=2)


@pytest.mark.slow  # 10 s; the fast tier keeps the black-box canary audit
def test_kernel_audit_of_dppenalty_per_row_and_per_unit():
    """DPPenalty's log-likelihood-ratio releases as made, the canary unit at +-100
    (beyond the clip wherever the chains go): per row each of its 50 rows' ratios
    reaches the clip, so a release moves by 50 sensitivities (realised noise per unit
    of sensitivity z / 50); per unit the unit's total ratio is clipped, the releases
    move by one sensitivity and deliver the epsilon charged (computed, not estimated)."""
    data, neighbour = panel(KERNEL_AUDIT_CANARY)
    rows = penalty_audit(per_row(data), per_row(neighbour))
    assert not rows.passed, rows
    assert "smallest realised noise / sensitivity 0.02" in rows.details, rows
    units = penalty_audit(data, neighbour)
    assert units.passed, units
    assert units.epsilon_lower_bound > 0.999 * units.claimed_epsilon, units
    assert units.claimed_epsilon == rows.claimed_epsilon  # the same charge, per unit


# ------------------------------------------------------------------- the data
def test_unit_neighbours_and_the_canary_unit():
    x = np.arange(6.0, dtype=np.float32)
    ids = np.array(["a", "b", "a", "c", "a", "b"])
    data = audit.Dataset(x, y=2 * x, privacy_unit=ids)
    assert "3 units" in repr(data)
    canary = audit.unit_rows(data, "a")
    np.testing.assert_array_equal(canary.args[0], [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(canary.kwargs["y"], [0.0, 4.0, 8.0])
    assert canary.privacy_unit is None
    removed = audit.unit_neighbour(data, "a")
    np.testing.assert_array_equal(removed.args[0], [1.0, 3.0, 5.0])
    np.testing.assert_array_equal(removed.privacy_unit, ["b", "c", "b"])
    other = audit.Dataset(np.array([9.0], np.float32), y=np.array([0.0], np.float32))
    replaced = audit.unit_neighbour(data, "a", other)
    np.testing.assert_array_equal(replaced.args[0], [1.0, 3.0, 5.0, 9.0])
    np.testing.assert_array_equal(replaced.kwargs["y"], [2.0, 6.0, 10.0, 0.0])
    np.testing.assert_array_equal(replaced.privacy_unit, ["b", "c", "b", "a"])
    assert data.run_kwargs["privacy_unit"] is data.privacy_unit
    assert "privacy_unit" not in per_row(data).run_kwargs
    with pytest.raises(ValueError, match="has no unit 'z'"):
        audit.unit_neighbour(data, "z")
    with pytest.raises(ValueError, match="names no units"):
        audit.unit_rows(per_row(data), "a")
    with pytest.raises(ValueError, match="one_run includes canary rows one by one"):
        audit.one_run(ndp.DPPenalty(mean_model, llr_clip=1.0), data, canary, delta=DELTA,
                      score=draw_score)


def test_a_unit_level_run_of_the_panel_is_charged_per_unit():
    """What the audits above take as the claim: the ledger of a run of the panel with
    ``privacy_unit`` protects units (10 of them), and charges what a row-level run does."""
    data, _ = panel()
    spent = []
    for dataset in (data, per_row(data)):
        mcmc = ndp.PrivateMCMC(sgld(dataset), num_warmup=0, num_samples=1, delta=DELTA,
                               progress_bar=False, check_mixing=False, warm_start=0,
                               reproducible_noise=True)
        mcmc.run(jax.random.PRNGKey(0), *dataset.args, **dataset.run_kwargs)
        spent.append(mcmc.privacy_spent())
    assert spent[0].privacy_unit.startswith("unit:") and spent[1].privacy_unit == "row"
    assert spent[0].epsilon == spent[1].epsilon
