"""Differentially private MCMC kernels."""

from numpyro_dp.kernels.barker import DPBarker, DPBarkerInfo, DPBarkerState, dp_barker
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.kernels.hmc import DPHMC, DPHMCInfo, DPHMCState, dp_hmc
from numpyro_dp.kernels.mala import DPMALA
from numpyro_dp.kernels.penalty import (
    DPMinibatchPenalty,
    DPPenalty,
    DPPenaltyInfo,
    DPPenaltyState,
    dp_penalty,
)
from numpyro_dp.kernels.sg_dynamics import DPSGInfo, DPSGNHTState, DPSGState
from numpyro_dp.kernels.sgmcmc import DPSGHMC, DPSGLD, DPSGNHT

__all__ = [
    "DPHMC",
    "DPMALA",
    "DPSGHMC",
    "DPSGLD",
    "DPSGNHT",
    "DPBarker",
    "DPBarkerInfo",
    "DPBarkerState",
    "DPHMCInfo",
    "DPHMCState",
    "DPKernel",
    "DPMinibatchPenalty",
    "DPPenalty",
    "DPPenaltyInfo",
    "DPPenaltyState",
    "DPSGInfo",
    "DPSGNHTState",
    "DPSGState",
    "dp_barker",
    "dp_hmc",
    "dp_penalty",
]
