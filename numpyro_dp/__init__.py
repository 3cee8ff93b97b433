"""numpyro-dp: differentially private MCMC for NumPyro models.

The package in layers (each imports only from the ones above it):

* :mod:`~numpyro_dp.model`: the model adapter (``PrivateModel``);
* :mod:`~numpyro_dp.primitives`: the release gate
  (:mod:`~numpyro_dp.primitives.release`: every release's grid, sensitivity and
  noise), clipped sums, minibatches, the secret noise;
* :mod:`~numpyro_dp.accounting`: events, accountants, calibration, the ledger;
* :mod:`~numpyro_dp.kernels`: the DP kernels, each declaring its cost as a
  ``DpEvent``;
* :mod:`~numpyro_dp.runner`: :mod:`~numpyro_dp.runner.mcmc` (``PrivateMCMC``),
  :mod:`~numpyro_dp.runner.chains`, :mod:`~numpyro_dp.runner.charging` (the ledger),
  :mod:`~numpyro_dp.runner.budget` (the budget's decisions),
  :mod:`~numpyro_dp.runner.tuning` (the private tuning: planned and run),
  :mod:`~numpyro_dp.runner.clip_selection` (private clip selection),
  :mod:`~numpyro_dp.runner.warm_start` (the private warm start),
  :mod:`~numpyro_dp.runner.planning` (``plan``), :mod:`~numpyro_dp.runner.mixing`;
  then :mod:`~numpyro_dp.inference_data` (ArviZ exports) and
  :mod:`~numpyro_dp.numpyro_compat` (the only module that touches NumPyro's
  internals);
* :mod:`~numpyro_dp.releases`: one-shot releases of statistics, which one to
  release, and inference from them (``mechanisms``, ``fisher``, ``linreg``,
  ``MH``, ``PMMH``, ``MHAAR``);
* :mod:`~numpyro_dp.evaluation`: reference models and sample-quality metrics;
  :mod:`~numpyro_dp.audit`: empirical lower bounds on the epsilon a kernel or a
  release delivers.
"""

from numpyro_dp import audit
from numpyro_dp.accounting import (
    AccountantWarning,
    PrivacyBudgetError,
    calibrate_noise_multiplier,
    epsilon_spent,
    max_iterations,
)
from numpyro_dp.accounting.keyring import LedgerKeyError
from numpyro_dp.accounting.ledger import PrivacyLedger, PrivacySpent
from numpyro_dp.accounting.ledger_file import LedgerCorruptedError
from numpyro_dp.evaluation import diagnostics, models
from numpyro_dp.inference_data import to_datatree, to_inference_data
from numpyro_dp.kernels import (
    DPHMC,
    DPMALA,
    DPSGHMC,
    DPSGLD,
    DPSGNHT,
    DPBarker,
    DPBarkerInfo,
    DPBarkerState,
    DPHMCInfo,
    DPHMCState,
    DPKernel,
    DPMinibatchPenalty,
    DPPenalty,
    DPPenaltyInfo,
    DPPenaltyState,
    DPSGInfo,
    DPSGNHTState,
    DPSGState,
)
from numpyro_dp.model import ModelSpecificationError, PrivateModel, RowLayout
from numpyro_dp.primitives import secret
from numpyro_dp.primitives.sharding import shard_rows
from numpyro_dp.releases import fisher, linreg, mechanisms, smooth_sensitivity
from numpyro_dp.releases.noise_aware import (
    CalibrationWarning,
    NoiseAwareNUTS,
    UnusableReleaseError,
)
from numpyro_dp.releases.pseudo_marginal import MH, MHAAR, PMMH
from numpyro_dp.releases.score_release import ScoreRelease
from numpyro_dp.runner import mixing
from numpyro_dp.runner.mcmc import PrivateDataError, PrivateMCMC, RunPlan
from numpyro_dp.runner.mixing import MixingReport, MixingWarning
from numpyro_dp.runner.planning import Plan, plan
from numpyro_dp.runner.tuning import TuningResult

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "TuningResult",
    "plan",
    "DPBarker",
    "DPBarkerInfo",
    "DPBarkerState",
    "DPHMC",
    "DPHMCInfo",
    "DPHMCState",
    "DPKernel",
    "DPMALA",
    "DPMinibatchPenalty",
    "DPPenalty",
    "DPPenaltyInfo",
    "DPPenaltyState",
    "DPSGHMC",
    "DPSGLD",
    "DPSGNHT",
    "DPSGInfo",
    "DPSGNHTState",
    "DPSGState",
    "LedgerCorruptedError",
    "LedgerKeyError",
    "MH",
    "MHAAR",
    "MixingReport",
    "MixingWarning",
    "ModelSpecificationError",
    "NoiseAwareNUTS",
    "PMMH",
    "AccountantWarning",
    "CalibrationWarning",
    "UnusableReleaseError",
    "PrivacyBudgetError",
    "PrivacyLedger",
    "PrivacySpent",
    "PrivateDataError",
    "PrivateMCMC",
    "RunPlan",
    "PrivateModel",
    "RowLayout",
    "ScoreRelease",
    "audit",
    "calibrate_noise_multiplier",
    "diagnostics",
    "epsilon_spent",
    "fisher",
    "linreg",
    "max_iterations",
    "mechanisms",
    "mixing",
    "models",
    "secret",
    "shard_rows",
    "smooth_sensitivity",
    "to_datatree",
    "to_inference_data",
]
