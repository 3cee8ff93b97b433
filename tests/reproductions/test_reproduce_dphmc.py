"""Smoke test of reproductions/reproduce_dphmc_paper.py: its --quick mode."""

import csv
import importlib.util
import pathlib
import sys

import pytest

SCRIPT = (pathlib.Path(__file__).resolve().parents[2] / "reproductions"
          / "reproduce_dphmc_paper.py")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("reproduce_dphmc_paper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    sys.path.insert(0, str(SCRIPT.parent))  # as when run as a script: results_csv
    spec.loader.exec_module(module)
    return module


def rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # a reproduction run (about 80 s on 2 cores): make test-all
def test_quick_mode_writes_resumable_csvs_and_figures(script, tmp_path):
    argv = ["--quick", "--out", str(tmp_path)]
    comparison = ["--parts", "comparison", "--models", "gaussian", "--kernels", "DPHMC", "DPSGLD"]
    script.main(argv + comparison)
    script.main(argv + ["--parts", "clipping", "--models", "banana"])
    runs = rows(tmp_path / "dphmc_runs.csv")
    assert {(r["model"], r["kernel"]) for r in runs} == {("gaussian", "DPHMC"),
                                                         ("gaussian", "DPSGLD")}
    for r in runs:
        # every run is within its budget, by the library's own accountant
        assert float(r["epsilon_spent"]) <= float(r["epsilon"])
        assert int(r["iterations_per_chain"]) >= 1
        assert float(r["mmd"]) >= 0 and float(r["mean_error"]) >= 0
    hmc = {int(r["epsilon"]): int(r["iterations_per_chain"]) for r in runs
           if r["kernel"] == "DPHMC"}
    assert hmc[4] < hmc[15]  # a larger budget affords more iterations
    clip = rows(tmp_path / "dphmc_clipping.csv")
    fractions = {(r["sampler"], float(r["llr_clip"])): float(r["fraction_clipped"]) for r in clip}
    for sampler in ("RWMH", "HMC"):
        assert fractions[(sampler, 0.01)] > fractions[(sampler, 10.0)]
    for name in ("dphmc_mmd.png", "dphmc_mean_error.png", "dphmc_clipping.png",
                 "dphmc_summary.md"):
        assert (tmp_path / name).stat().st_size > 0
    # resumable: finished runs are skipped, nothing is appended twice
    script.main(argv + comparison)
    assert len(rows(tmp_path / "dphmc_runs.csv")) == len(runs)


def test_whitened_gaussian_has_the_library_models_llrs(script):
    # the reproduction runs the Gaussian model on whitened rows for speed:
    # per-row log-likelihood ratios (what the kernels clip and test) must agree
    import jax.numpy as jnp
    import numpy as np
    from jax import random
    from numpyro.infer.util import log_likelihood

    from numpyro_dp.evaluation import models

    problem = script.gaussian_problem(2000)
    cov = models.gaussian_covariance(random.PRNGKey(1), 10)
    X = models.gaussian_data(random.PRNGKey(2), 2000, cov, problem.truth)
    thetas = {"theta": jnp.asarray(problem.truth + np.array([[0.0] * 10, [0.01] * 10]))}
    ours = log_likelihood(problem.model, thetas, *problem.args, batch_ndims=1)["z"]
    ref = log_likelihood(models.gaussian_model, thetas, X, jnp.asarray(cov), batch_ndims=1)["x"]
    np.testing.assert_allclose(ours[1] - ours[0], ref[1] - ref[0], atol=1e-4)
    np.testing.assert_allclose(problem.loglik_rows(thetas["theta"][1]), ours[1], rtol=1e-6)
