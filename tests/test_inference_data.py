"""The ArviZ exports of a private run: ``to_datatree`` and ``to_inference_data``.

Both ArviZ lines: 0.x (``arviz.InferenceData``) and the DataTree line of
``arviz-base`` / ``arviz-stats`` (ArviZ 1.x, or 0.8 next to ArviZ 0.x on
Python 3.11).  One small run serves every test.
"""

import importlib.util
import json
import subprocess
import sys

import arviz as az
import jax
import numpy as np
import pytest
from _support.data import logistic_model, make_logistic_data

import numpyro_dp as ndp
from numpyro_dp import inference_data

N = 601
PRIVACY_ATTRS = ("epsilon", "delta", "neighbourhood", "accountant", "num_releases",
                 "privacy_ledger", "reproducible_noise", "sampler")


@pytest.fixture(scope="module")
def data():
    return make_logistic_data(N, 3, seed=5)


@pytest.fixture(scope="module")
def mcmc(data):
    X, y = data
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05)
    runner = ndp.PrivateMCMC(kernel, num_warmup=10, num_samples=10, num_chains=2,
                             epsilon=1.0, delta=1e-5, progress_bar=False,
                             chain_method="vectorized", warm_start=0, check_mixing=False)
    runner.run(jax.random.PRNGKey(0), X, y=y, extra_fields=("info",))  # every Info field
    return runner


@pytest.fixture(scope="module")
def tree(mcmc):
    pytest.importorskip("arviz_base")
    return ndp.to_datatree(mcmc)


def no_row_dimension(datasets):
    return all(N not in var.shape for ds in datasets for var in ds.data_vars.values())


# ------------------------------------------------------------- to_datatree
def test_datatree_holds_posterior_sample_stats_and_the_ledger_only(mcmc, tree):
    import xarray as xr

    assert isinstance(tree, xr.DataTree)
    assert set(tree.children) == {"posterior", "sample_stats"}  # no observed_data, log_likelihood
    w = tree.posterior["w"]
    assert w.dims == ("chain", "draw", "w_dim_0") and w.shape == (2, 10, 3)
    np.testing.assert_array_equal(w.values, np.asarray(mcmc.get_samples(group_by_chain=True)["w"]))
    stats = tree.sample_stats
    # The default fields and, through extra_fields=("info",), every DPPenaltyInfo field.
    assert set(stats.data_vars) == {"acceptance_rate", "accepted", "proposal_scale"}
    assert all(v.dims == ("chain", "draw") for v in stats.data_vars.values())
    spent = mcmc.privacy_spent()
    for attrs in (tree.attrs, tree.posterior.attrs):
        assert attrs["epsilon"] == spent.epsilon <= 1.0
        assert attrs["delta"] == 1e-5 and attrs["neighbourhood"] == "substitute"
        assert attrs["reproducible_noise"] == 0 and attrs["sampler"] == "DPPenalty"
        ledger = json.loads(attrs["privacy_ledger"])
        assert ledger["num_releases"] == attrs["num_releases"] == 2 * 20
    assert no_row_dimension([node.dataset for node in tree.subtree])


def test_arviz_stats_summary_of_the_datatree(tree):
    arviz_stats = pytest.importorskip("arviz_stats")
    summary = arviz_stats.summary(tree)
    assert list(summary.index) == ["w[0]", "w[1]", "w[2]"]
    assert np.allclose(summary["mean"].to_numpy(np.float64),
                       tree.posterior["w"].mean(("chain", "draw")).values, atol=0.01)


def test_datatree_attrs_survive_a_netcdf_round_trip(tree, tmp_path):
    pytest.importorskip("h5netcdf")
    import xarray as xr

    path = tmp_path / "private.nc"
    tree.to_netcdf(path, engine="h5netcdf")
    with xr.open_datatree(path, engine="h5netcdf") as back:
        for name in PRIVACY_ATTRS:
            assert back.attrs[name] == tree.attrs[name]
            assert back.posterior.attrs[name] == tree.attrs[name]
        np.testing.assert_array_equal(back.posterior["w"].values, tree.posterior["w"].values)


def test_to_datatree_needs_a_run_private_mcmc(data):
    pytest.importorskip("arviz_base")
    kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=5.0)
    runner = ndp.PrivateMCMC(kernel, num_warmup=5, num_samples=5, delta=1e-6)
    with pytest.raises(RuntimeError, match="run"):
        ndp.to_datatree(runner)
    with pytest.raises(TypeError, match="to_datatree takes a numpyro_dp.PrivateMCMC"):
        ndp.to_datatree({"w": np.zeros((2, 10, 3))})


def test_to_datatree_without_arviz_base_says_what_to_install(mcmc, monkeypatch):
    monkeypatch.setitem(sys.modules, "arviz_base", None)  # makes `import arviz_base` fail
    with pytest.raises(ImportError, match=r"pip install numpyro-dp\[datatree\]"):
        ndp.to_datatree(mcmc)


@pytest.mark.skipif(not inference_data.ARVIZ_HAS_INFERENCE_DATA,
                    reason="ArviZ 1.x itself imports arviz_base")
def test_numpyro_dp_imports_on_arviz_0x_without_the_datatree_packages():
    code = ("import sys; sys.modules['arviz_base'] = sys.modules['arviz_stats'] = None; "
            "import numpyro_dp as ndp; print(ndp.to_datatree.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "to_datatree"


# ------------------------------------------------------- to_inference_data
@pytest.mark.skipif(not inference_data.ARVIZ_HAS_INFERENCE_DATA, reason="ArviZ 1.x")
def test_inference_data_on_arviz_0x_matches_the_datatree(mcmc):
    idata = ndp.to_inference_data(mcmc)
    assert isinstance(idata, az.InferenceData)
    assert set(idata.groups()) == {"posterior", "sample_stats"}
    assert idata.posterior["w"].shape == (2, 10, 3)
    assert set(idata.sample_stats.data_vars) == {"acceptance_rate", "accepted", "proposal_scale"}
    for name in PRIVACY_ATTRS:
        assert idata.attrs[name] == idata.posterior.attrs[name]
    assert list(az.summary(idata).index) == ["w[0]", "w[1]", "w[2]"]
    if importlib.util.find_spec("arviz_base") is not None:  # one definition of the export
        tree = ndp.to_datatree(mcmc)
        for group in ("posterior", "sample_stats"):
            assert set(idata[group].data_vars) == set(tree[group].data_vars)
            for name in idata[group].data_vars:
                np.testing.assert_array_equal(idata[group][name].values, tree[group][name].values)
        for name in PRIVACY_ATTRS:
            assert idata.attrs[name] == tree.attrs[name]


def test_inference_data_on_arviz_1x_is_the_datatree(mcmc, tree, monkeypatch):
    """ArviZ 1.x has no InferenceData: to_inference_data returns to_datatree's tree
    (simulated here on ArviZ 0.x)."""
    monkeypatch.setattr(inference_data, "ARVIZ_HAS_INFERENCE_DATA", False)
    out = ndp.to_inference_data(mcmc)
    assert type(out) is type(tree) and set(out.children) == set(tree.children)
    for group in tree.children:
        ours, theirs = out[group].dataset, tree[group].dataset
        assert set(ours.data_vars) == set(theirs.data_vars)
        for name in theirs.data_vars:
            np.testing.assert_array_equal(ours[name].values, theirs[name].values)
    for name in PRIVACY_ATTRS:
        assert out.attrs[name] == tree.attrs[name] == out.posterior.attrs[name]


# ------------------------------------------------------ nothing reads the data
def test_arviz_base_from_numpyro_cannot_read_the_data(mcmc):
    """arviz_base.from_numpyro reads mcmc._args / _kwargs to re-run the model
    (observed_data, log_likelihood, dims): the runner refuses them."""
    arviz_base = pytest.importorskip("arviz_base")
    with pytest.raises(ndp.PrivateDataError, match="to_inference_data"):
        arviz_base.from_numpyro(mcmc)
    with pytest.raises(ndp.PrivateDataError):
        arviz_base.from_numpyro(mcmc, log_likelihood=False, dims={"w": ["coef"]})
    # The generic converters do not recognise a PrivateMCMC at all.
    with pytest.raises(ValueError, match="PrivateMCMC"):
        arviz_base.convert_to_datatree(mcmc)
    arviz_stats = pytest.importorskip("arviz_stats")
    with pytest.raises(ValueError, match="PrivateMCMC"):
        arviz_stats.summary(mcmc)
