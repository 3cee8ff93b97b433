"""Honest diagnostics (issue 18, item 5): a run whose chains did not move or mix
warns, from its released draws only."""

import contextlib
import io
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from _support.data import logistic_model, make_logistic_data

import numpyro_dp as ndp
from numpyro_dp.runner.mixing import ESS_LIMIT, RHAT_LIMIT, mixing_report


def test_independent_draws_look_mixed():
    rng = np.random.default_rng(0)
    report = mixing_report({"a": rng.normal(size=(4, 500)), "b": rng.normal(size=(4, 500, 3))})
    assert report.problems == []
    assert report.max_rhat < RHAT_LIMIT and report.min_ess > ESS_LIMIT
    np.testing.assert_array_equal(report.moved, 1.0)
    assert report.num_draws == 500 and "looks mixed" in str(report)


def test_frozen_separated_and_slow_chains_are_named():
    rng = np.random.default_rng(1)
    frozen = np.zeros((4, 200))
    report = mixing_report({"w": frozen})
    assert report.max_rhat == np.inf and report.min_ess == 0.0
    np.testing.assert_array_equal(report.moved, 0.0)
    assert len(report.problems) == 3 and "chain 0: 0.0%" in report.problems[0]

    apart = rng.normal(size=(4, 200)) + np.arange(4)[:, None] * 5.0  # each chain elsewhere
    report = mixing_report({"w": apart})
    assert report.max_rhat > 2 and any("R-hat" in p for p in report.problems)

    walk = np.cumsum(rng.normal(size=(4, 200)) * 0.01, axis=1)  # moving, but tiny steps
    report = mixing_report({"mu": rng.normal(size=(4, 200)), "w": walk})
    assert (report.min_ess_site, report.max_rhat_site) == ("w", "w")
    assert report.min_ess < ESS_LIMIT


def test_too_few_draws_give_no_report():
    assert mixing_report({"w": np.zeros((2, 3))}) is None


def frozen_run(**kwargs):
    """The README's first snippet at n = 600, epsilon = 1: the noise leaves the
    adapted random walk too small a step to leave the starts."""
    X, y = make_logistic_data(600, 3, seed=2)
    kernel = ndp.DPPenalty(logistic_model, llr_clip=0.5, proposal_scale=0.01)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=100, num_samples=300, num_chains=4, epsilon=1.0,
                           delta=1e-6, progress_bar=False, chain_method="vectorized", **kwargs)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    return mcmc


def test_a_run_that_did_not_mix_warns_and_keeps_the_figures():
    with pytest.warns(ndp.MixingWarning, match="do not represent the posterior") as caught:
        mcmc = frozen_run()
    assert mcmc.mixing.problems and mcmc.mixing.max_rhat > RHAT_LIMIT
    messages = [str(w.message) for w in caught]
    # Warned before the run (the planner's travel figure) and after it (the draws).
    assert "travel only about" in messages[0]
    assert any("R-hat" in m for m in messages[1:])
    # The figures are those of the released draws: anyone can recompute them.
    again = mixing_report(mcmc.get_samples(group_by_chain=True))
    assert again[:4] == mcmc.mixing[:4] and np.array_equal(again.moved, mcmc.mixing.moved)
    # print_summary reports the same R-hat (issue 38, item 5: NumPyro's own read 96
    # where mcmc.mixing read 4.5 on such draws)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        mcmc.print_summary()
    rows = [line.split() for line in out.getvalue().splitlines()
            if line.strip().startswith(("b", "w"))]
    assert max(float(r[-1]) for r in rows) == pytest.approx(mcmc.mixing.max_rhat, abs=0.005)
    assert min(float(r[-2]) for r in rows) == pytest.approx(mcmc.mixing.min_ess, abs=0.005)


def test_a_constant_deterministic_site_is_not_a_frozen_chain():
    X, y = make_logistic_data(300, 3, seed=4)

    def model(X, y=None):
        numpyro.deterministic("num_features", jnp.asarray(X.shape[1]))
        logistic_model(X, y)

    # A fixed random-walk scale near the optimum (acceptance about 0.3, ESS about 650):
    # this test is about the constant site, not about warm-up tuning.
    kernel = ndp.DPPenalty(model, llr_clip=1.0, proposal_scale=0.3, noise_multiplier=1e-3,
                           adapt_step_size=False, adapt_mass_matrix=False)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=500, num_samples=4000, num_chains=2, delta=1e-5,
                           progress_bar=False, chain_method="vectorized")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ndp.MixingWarning)
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert mcmc.mixing.max_rhat_site == "w" and np.all(mcmc.mixing.moved > 0.05)


def test_the_check_can_be_turned_off():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ndp.MixingWarning)
        mcmc = frozen_run(check_mixing=False)
    assert mcmc.mixing is None


def test_one_chain_has_a_split_rhat():
    """ArviZ needs two chains for R-hat: one chain's split R-hat is that of its halves."""
    draws = np.random.default_rng(0).normal(size=(1, 400, 2))
    report = mixing_report({"x": draws})
    assert 0.98 < report.max_rhat < 1.03 and report.min_ess > 300
    stuck = np.concatenate([draws[:, :200], draws[:, 200:] + 5.0], axis=1)
    assert mixing_report({"x": stuck}).max_rhat > 1.5
