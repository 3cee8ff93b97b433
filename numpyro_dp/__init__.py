"""numpyro-dp: differentially private MCMC for NumPyro models."""

from numpyro_dp import diagnostics, linreg, mechanisms, mixing, models, secret
from numpyro_dp.accounting import (
    AccountantWarning,
    PrivacyBudgetError,
    calibrate_noise_multiplier,
    epsilon_spent,
    max_iterations,
)
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
    DPPenalty,
    DPPenaltyInfo,
    DPPenaltyState,
    DPSGInfo,
    DPSGState,
)
from numpyro_dp.kernels.barker import (
    barker_epsilon,
    barker_max_batch_size,
    barker_max_iterations,
)
from numpyro_dp.ledger import LedgerCorruptedError, PrivacyLedger, PrivacySpent
from numpyro_dp.mcmc import PrivateDataError, PrivateMCMC, RunPlan
from numpyro_dp.mixing import MixingReport, MixingWarning
from numpyro_dp.model import ModelSpecificationError, PrivateModel
from numpyro_dp.planner import Plan, plan
from numpyro_dp.tuning import TuningResult

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "TuningResult",
    "plan",
    "DPBarker",
    "DPBarkerInfo",
    "DPBarkerState",
    "barker_epsilon",
    "barker_max_batch_size",
    "barker_max_iterations",
    "DPHMC",
    "DPHMCInfo",
    "DPHMCState",
    "DPKernel",
    "DPMALA",
    "DPPenalty",
    "DPPenaltyInfo",
    "DPPenaltyState",
    "DPSGHMC",
    "DPSGLD",
    "DPSGNHT",
    "DPSGInfo",
    "DPSGState",
    "LedgerCorruptedError",
    "MixingReport",
    "MixingWarning",
    "ModelSpecificationError",
    "AccountantWarning",
    "PrivacyBudgetError",
    "PrivacyLedger",
    "PrivacySpent",
    "PrivateDataError",
    "PrivateMCMC",
    "RunPlan",
    "PrivateModel",
    "calibrate_noise_multiplier",
    "diagnostics",
    "epsilon_spent",
    "linreg",
    "max_iterations",
    "mechanisms",
    "mixing",
    "models",
    "secret",
    "to_datatree",
    "to_inference_data",
]
