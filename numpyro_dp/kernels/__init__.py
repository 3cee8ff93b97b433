"""Differentially private MCMC kernels."""

from numpyro_dp.kernels.barker import DPBarker, DPBarkerState, dp_barker
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.kernels.hmc import DPHMC, DPHMCState, dp_hmc
from numpyro_dp.kernels.penalty import DPPenalty, DPPenaltyState, dp_penalty

__all__ = ["DPHMC", "DPHMCState", "DPKernel", "DPPenalty", "DPPenaltyState", "dp_hmc", "dp_penalty"]
__all__ += ["DPBarker", "DPBarkerState", "dp_barker"]
