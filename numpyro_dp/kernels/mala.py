"""DP-MALA: a Langevin proposal on a noisy clipped gradient, then the penalty test.

Räisä (2020), s4.2.  Per iteration, from theta:

1. release the noisy gradient
   ``g(theta) = T sum_i clip_{b_g}(grad l_i(theta)) + N(0, sigma_g^2 I) + grad log p(theta)``
   (``sigma_g = z_g * Delta_g`` as in DP-HMC) and propose
   ``theta' ~ N(theta + (s^2 / 2) M^-1 g(theta), a s^2 M^-1)``;
2. release ``g(theta')`` with fresh noise; the proposal ratio
   ``log q(theta | theta') - log q(theta' | theta)`` uses the two released
   gradients, so it is post-processing;
3. the penalty test on ``T sum_i clip_c(r_i) + N(0, sigma_l^2)``, ``c = b_l ||theta' - theta||``,
   plus the prior and proposal ratios: accept iff ``log u < lambda_hat - sigma_l^2 / 2``.

Cost per iteration: two gradient releases and one LLR release.

With ``a = 1`` this is exactly one leapfrog step of HMC with step size ``s``
(momentum ``p ~ N(0, M)``; the proposal ratio is ``K(p_0) - K(p_1)``), so the
kernel runs :func:`~numpyro_dp.kernels.hmc.dp_hmc` with one step and momentum
``N(0, a M)``.  It targets the exact tempered posterior when no ratio is
clipped: the gradient noise is fresh at both points and independent of the
state, so swapping the two noise draws maps a move onto its reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numpyro.infer.initialization import init_to_uniform

from numpyro_dp.kernels.base import check_positive
from numpyro_dp.kernels.hmc import DPHMC


class DPMALA(DPHMC):
    """Differentially private Metropolis-adjusted Langevin algorithm (DP-MALA).

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    step_size : float, optional
        ``s``: the proposal is ``N(theta + (s^2/2) M^-1 g(theta), a s^2 M^-1)``
        (initial value when ``adapt_step_size``); derived from the noise by
        default, as for :class:`~numpyro_dp.DPHMC`.
    grad_clip : float, optional
        ``b_g``: every row's log-likelihood gradient is clipped to this l2 norm.
    llr_clip : float, optional
        ``b_l``: every row's log-likelihood ratio is clipped to ``b_l h`` with
        ``h = ||theta' - theta||``.  If no ratio is clipped the chain is exact.
        Omitted clips are chosen privately, as for :class:`~numpyro_dp.DPHMC`.
    proposal_variance_factor : float
        ``a`` of Räisä (2020, s4.2): the proposal variance is ``a s^2`` (1 is plain MALA).
        Larger ``a`` moves further for the same drift.
    noise_multiplier_grad, noise_multiplier_llr : float, optional
        ``z_g`` and ``z_l``.  Give both, or neither and let
        :class:`~numpyro_dp.PrivateMCMC` calibrate them to a budget.
    llr_budget_fraction : float
        When calibrated: the fraction of each iteration's zCDP spent on the LLR
        release; the rest is split equally between the two gradient releases.
    temperature, neighbourhood, data_plate :
        As for every kernel (:class:`~numpyro_dp.kernels.base.DPKernel`).
    inverse_mass_matrix : array, optional
        Preconditioner ``M^-1`` over the flattened unconstrained parameters
        (1-D diagonal, 2-D dense); by default the warm start's Laplace
        covariance, else the identity (as for :class:`~numpyro_dp.DPHMC`).
    dense_mass : bool, optional
        Dense rather than diagonal preconditioner (default as for DPHMC).
    adapt_step_size : bool
        Dual averaging of ``s`` in warm-up on the noisy acceptance probability.
    adapt_mass_matrix : bool, optional
        Estimate ``M^-1`` from warm-up draws (NumPyro's windows); by default
        only without the warm start's covariance.
    target_accept_prob : float
        Target of the step-size adaptation; 0.574 is optimal for MALA
        (Roberts & Rosenthal 1998).
    step_size_jitter : float, optional
        As for :class:`~numpyro_dp.DPHMC` (0 keeps ``s`` fixed).
    grad_route : {"auto", "jacobian"}
        How the per-row clipped gradient sum is computed (all exact).
    init_strategy : callable
        NumPyro init strategy (prior-based; default ``init_to_uniform``).

    Notes
    -----
    The state is a :class:`~numpyro_dp.DPHMCState` with ``num_steps = 1``:
    DP-MALA with ``a = 1`` is DP-HMC with one leapfrog step, and its privacy
    cost is that of DP-HMC with ``num_steps=1`` (two gradient releases and one
    LLR release per iteration).  Räisä (2020)'s version, which adds the noise of
    the gradient release to the proposal itself and puts the data-dependent
    proposal ratio inside the noised ``lambda``, needs a larger LLR sensitivity
    and is not implemented.
    """

    def __init__(
        self,
        model: Callable,
        step_size: float | None = None,
        *,
        grad_clip: float | None = None,
        llr_clip: float | None = None,
        proposal_variance_factor: float = 1.0,
        noise_multiplier_grad: float | None = None,
        noise_multiplier_llr: float | None = None,
        llr_budget_fraction: float = 0.5,
        temperature: float = 1.0,
        neighbourhood: str = "substitute",
        data_plate: str | None = None,
        inverse_mass_matrix: Any = None,
        dense_mass: bool | None = None,
        adapt_step_size: bool = True,
        adapt_mass_matrix: bool | None = None,
        target_accept_prob: float = 0.574,
        step_size_jitter: float | None = None,
        grad_route: str = "auto",
        init_strategy: Callable = init_to_uniform,
    ):
        super().__init__(
            model, step_size, 1,
            grad_clip=grad_clip, llr_clip=llr_clip,
            noise_multiplier_grad=noise_multiplier_grad,
            noise_multiplier_llr=noise_multiplier_llr,
            llr_budget_fraction=llr_budget_fraction, temperature=temperature,
            neighbourhood=neighbourhood, data_plate=data_plate,
            inverse_mass_matrix=inverse_mass_matrix, dense_mass=dense_mass,
            adapt_step_size=adapt_step_size, adapt_mass_matrix=adapt_mass_matrix,
            target_accept_prob=target_accept_prob, step_size_jitter=step_size_jitter,
            grad_route=grad_route, init_strategy=init_strategy,
        )
        self.proposal_variance_factor = check_positive(
            "proposal_variance_factor", proposal_variance_factor,
            "it is a, the proposal variance a s^2 in units of s^2 (1 for plain MALA).",
        )
