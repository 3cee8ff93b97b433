"""Statistical checks with tolerances from the Monte Carlo error.

MMDs are compared with the spread of MMDs between independent exact samples
of the chain's effective size; moments with their standard errors from
effective sample sizes (ESS of the draws for means, ESS of the squared
deviations for standard deviations; ESS is capped at the number of draws,
since HMC's antithetic draws make larger estimates fragile).
"""

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.diagnostics import effective_sample_size

import numpyro_dp as ndp
from numpyro_dp.evaluation.diagnostics import mmd


def ess(chains):
    """Per-coordinate ESS of (chains, draws, dim), capped at the number of draws.

    Strongly antithetic draws can also make the estimate negative (its
    autocorrelation sum goes below -1/2); that too is capped at the draws.
    """
    draws = chains.shape[0] * chains.shape[1]
    estimate = effective_sample_size(np.asarray(chains, np.float64))
    return np.where(estimate > 0, np.minimum(estimate, draws), draws)


def effective_draws(chains, cap=1000, spacing=1):
    """Thin pooled draws to ``1 / spacing`` of the effective sample size, at most
    ``cap`` of them (None: no cap).

    With ``spacing=1`` the draws are one integrated autocorrelation time
    ``tau = N / ESS`` apart; a random walk's draws are still correlated at that
    lag (about 0.13 for an AR(1) with tau = 50), which inflates an MMD against
    independent draws; ``spacing=2`` puts them ``2 tau`` apart (about 0.02).
    """
    size = np.min(ess(chains)) / spacing
    size = int(size if cap is None else min(size, cap))
    flat = chains.reshape(-1, chains.shape[-1])
    return flat[:: max(1, len(flat) // size)][:size]


def assert_mmd_within_exact_spread(chains, exact_sampler, replicates=40, min_size=200,
                                   cap=1000, spacing=1):
    """MMD(chain, exact) <= the largest of ``replicates`` MMD(exact, exact) of the
    same size: an exact sampler fails this with probability 1 / (replicates + 1)
    if its thinned draws are independent (see :func:`effective_draws`)."""
    draws = effective_draws(chains, cap, spacing)
    size = len(draws)
    assert size >= min_size, f"chain mixed too poorly to test: effective size {size}"
    observed = mmd(draws, exact_sampler(0, size), rng=0)
    spread = [mmd(exact_sampler(2 * i + 1, size), exact_sampler(2 * i + 2, size), rng=i)
              for i in range(replicates)]
    assert observed <= max(spread), (observed, sorted(spread)[-5:])


def moment_errors(chains, log_sd="fourth_moment"):
    """Means, sds and the standard errors of the mean and of log sd.

    ``log_sd="fourth_moment"``: from the variance and the ESS of the squared
    deviations (any target); ``"normal"``: ``1 / sqrt(2 ESS)`` with the ESS of
    the draws, the normal-theory value (near-Gaussian targets).
    """
    flat = chains.reshape(-1, chains.shape[-1])
    mean, var = flat.mean(0), flat.var(0)
    n_eff = ess(chains)
    se_mean = np.sqrt(var / n_eff)
    if log_sd == "normal":
        se_log_sd = np.sqrt(1 / (2 * n_eff))
    else:
        sq = (chains - mean) ** 2
        se_log_sd = 0.5 * np.sqrt(sq.reshape(len(flat), -1).var(0) / ess(sq)) / var
    return mean, np.sqrt(var), se_mean, se_log_sd


def assert_moments_match(chains, reference_chains, z=4.0, log_sd="fourth_moment"):
    """Means and sds agree within z combined standard errors (see :func:`moment_errors`)."""
    m, s, se_m, se_s = moment_errors(chains, log_sd)
    mr, sr, se_mr, se_sr = moment_errors(reference_chains, log_sd)
    np.testing.assert_array_less(np.abs(m - mr), z * np.hypot(se_m, se_mr))
    np.testing.assert_array_less(np.abs(np.log(s / sr)), z * np.hypot(se_s, se_sr))


def max_row_grad_norm(model, args, kwargs, draws):
    """max_i ||grad l_i(theta)|| over ``draws`` (unconstrained points)."""
    pm = ndp.PrivateModel(model, args, kwargs)

    def norms(theta):
        rows = lambda t: pm.log_density_terms(pm.unravel(t), args, kwargs).loglik_rows  # noqa: E731
        return jnp.linalg.norm(jax.jacfwd(rows)(theta), axis=1).max()

    return float(jax.lax.map(norms, jnp.asarray(draws, jnp.float32)).max())
