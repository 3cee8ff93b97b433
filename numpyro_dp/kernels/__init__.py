"""Differentially private MCMC kernels."""

from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.kernels.penalty import DPPenalty, DPPenaltyState, dp_penalty

__all__ = ["DPKernel", "DPPenalty", "DPPenaltyState", "dp_penalty"]
