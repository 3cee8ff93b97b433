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

from numpyro_dp.kernels.arguments import check_positive, extends, keyword_arguments
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
    proposal_variance_factor : float
        ``a`` of Räisä (2020, s4.2): the proposal variance is ``a s^2`` (1 is plain MALA).
        Larger ``a`` moves further for the same drift.
    target_accept_prob : float
        Target of the step-size adaptation; 0.574 is optimal for MALA
        (Roberts & Rosenthal 1998).
    **hmc_arguments :
        Every other keyword of :class:`~numpyro_dp.DPHMC` but ``num_steps``
        (``grad_clip``, ``llr_clip``, the noise multipliers, the mass matrix
        and its adaptation, ``grad_route``, ...), with the same meaning; the
        signature lists them.

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

    @keyword_arguments
    @extends(DPHMC, drop=("num_steps",))
    def __init__(
        self,
        model: Callable,
        *,
        step_size: float | None = None,
        proposal_variance_factor: float = 1.0,
        target_accept_prob: float = 0.574,
        **hmc_arguments: Any,
    ):
        if "num_steps" in hmc_arguments:
            raise TypeError(
                "DPMALA makes exactly one leapfrog step per iteration; use "
                "DPHMC(model, num_steps=...) for more."
            )
        super().__init__(
            model, step_size=step_size, num_steps=1,
            target_accept_prob=target_accept_prob, **hmc_arguments,
        )
        self.proposal_variance_factor = check_positive(
            "proposal_variance_factor", proposal_variance_factor,
            "it is a, the proposal variance a s^2 in units of s^2 (1 for plain MALA).",
        )
