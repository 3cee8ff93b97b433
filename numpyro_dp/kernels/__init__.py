"""Differentially private MCMC kernels."""

from numpyro_dp.kernels.barker import DPBarker, DPBarkerState, dp_barker
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.kernels.hmc import DPHMC, DPHMCState, dp_hmc
from numpyro_dp.kernels.mala import DPMALA
from numpyro_dp.kernels.penalty import DPPenalty, DPPenaltyState, dp_penalty
from numpyro_dp.kernels.sgmcmc import DPSGHMC, DPSGLD, DPSGNHT, DPSGState

__all__ = [
    "DPHMC",
    "DPMALA",
    "DPSGHMC",
    "DPSGLD",
    "DPSGNHT",
    "DPBarker",
    "DPBarkerState",
    "DPHMCState",
    "DPKernel",
    "DPPenalty",
    "DPPenaltyState",
    "DPSGState",
    "dp_barker",
    "dp_hmc",
    "dp_penalty",
]
