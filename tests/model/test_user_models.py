"""Models users actually write (issue 18, item 6): improper priors, pandas data,
sizes computed from the data, constant-size plates.  Each either runs under
``PrivateMCMC`` or is refused before anything is charged, with the fix."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from numpyro.infer import init_to_median, init_to_uniform
from scipy import stats

import numpyro_dp as ndp
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.checks import ModelSpecificationError

N = 200


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(N, 2))
    y = X @ np.array([0.5, -1.0]) + rng.normal(size=N)
    g = rng.integers(0, 4, size=N)
    return X, y, g


def flat_regression(X, y=None):
    """A flat prior on the coefficients and a half-Cauchy scale (Stan's defaults)."""
    w = numpyro.sample("w", dist.ImproperUniform(dist.constraints.real, (), (2,)))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def run(model, *args, **kwargs):
    kernel = ndp.DPPenalty(model, llr_clip=2.0, proposal_scale=0.05,
                           init_strategy=kwargs.pop("init_strategy", init_to_uniform))
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=3, num_samples=4, num_chains=2, epsilon=5.0,
                           delta=1e-5, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args, **kwargs)
    return mcmc


@pytest.mark.slow
def test_an_improper_flat_prior_is_accepted_and_contributes_nothing(data):
    X, y, _ = data
    pm = PrivateModel(flat_regression, (X,), {"y": y})
    params = {"w": np.array([0.3, -0.2]), "sigma": np.log(1.7)}  # unconstrained
    terms = pm.log_density_terms(params, (X,), {"y": y})
    # log p = log HalfCauchy(1.7) + log|d sigma / d log sigma|; the flat w adds 0
    expected = stats.halfcauchy(scale=2.5).logpdf(1.7) + np.log(1.7)
    np.testing.assert_allclose(float(terms.prior), expected, rtol=1e-5)
    for init in (init_to_uniform, init_to_median):
        mcmc = run(flat_regression, X, y=y, init_strategy=init)
        draws = mcmc.get_samples()
        assert draws["w"].shape == (8, 2) and np.all(np.asarray(draws["sigma"]) > 0)


def test_pandas_data_frames_and_series_are_read_as_their_arrays(data):
    X, y, _ = data
    df, series = pd.DataFrame(X, columns=["age", "income"]), pd.Series(y, name="y")
    params = {"w": np.array([0.3, -0.2])}
    pm = PrivateModel(regression, (X,), {"y": y})
    expected = pm.log_density_terms(params, (X,), {"y": y}).loglik_rows
    args, kwargs = ndp.model.tabular_to_numpy(((df,), {"y": series}))
    np.testing.assert_array_equal(pm.log_density_terms(params, args, kwargs).loglik_rows,
                                  expected)
    assert run(regression, df, y=series).privacy_spent().num_releases > 0


def test_mixed_and_nullable_pandas_columns_become_floats_and_missing_values_are_refused():
    frame = pd.DataFrame({"n": pd.array([1, 2, 3], dtype="Int64"), "b": [True, False, True],
                          "x": [0.5, 1.5, 2.5]})
    (values,) = ndp.model.tabular_to_numpy((frame,))
    np.testing.assert_array_equal(values, [[1, 1, 0.5], [2, 0, 1.5], [3, 1, 2.5]])
    assert values.dtype == np.float64
    missing = pd.Series(pd.array([1, None, 3], dtype="Int64"))
    (values,) = ndp.model.tabular_to_numpy((missing,))
    assert np.isnan(values[1])  # then refused by the data checks, as any NaN


@pytest.mark.parametrize("column", [
    lambda x: np.where(x > 0, "f", "m"),  # strings
    lambda x: np.where(x > 0, "1", "0"),  # numbers as text: never parsed
    lambda x: pd.Categorical(np.where(x > 0, "f", "m")),
    lambda x: pd.Timestamp("2020-01-01") + pd.to_timedelta(np.arange(len(x)), unit="D"),
    lambda x: pd.to_timedelta(np.arange(len(x)), unit="s"),
    lambda x: np.array(list(x), dtype=object),  # floats held as Python objects
], ids=["str", "numeric-text", "category", "datetime", "timedelta", "object"])
def test_non_numeric_pandas_columns_are_refused_with_the_fix(data, column):
    X, y, _ = data
    df = pd.DataFrame({"age": X[:, 0], "other": column(X[:, 1])})
    kernel = ndp.DPPenalty(regression, llr_clip=2.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=2, num_samples=2, epsilon=1.0, delta=1e-5,
                           progress_bar=False)
    with pytest.raises(ModelSpecificationError, match="get_dummies"):
        mcmc.run(jax.random.PRNGKey(0), df, y=y)
    with pytest.raises(ModelSpecificationError, match="get_dummies"):
        mcmc.plan(df, y=pd.Series(y))
    assert mcmc.privacy_spent().num_releases == 0


def test_a_size_computed_from_the_data_is_refused_before_any_charge(data):
    X, y, g = data

    def groups(g, y=None, num_groups=None):
        G = int(g.max()) + 1 if num_groups is None else num_groups
        a = numpyro.sample("a", dist.Normal(0.0, 1.0).expand([G]).to_event(1))
        with numpyro.plate("data", g.shape[0]):
            numpyro.sample("y", dist.Normal(a[g], 1.0), obs=y)

    kernel = ndp.DPPenalty(groups, llr_clip=2.0)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=2, num_samples=2, epsilon=1.0, delta=1e-5,
                           progress_bar=False)
    with pytest.raises(ModelSpecificationError, match="num_groups") as err:
        mcmc.run(jax.random.PRNGKey(0), g, y=y)
    assert "Tracer" not in str(err.value) and "4" not in str(err.value)
    assert mcmc.privacy_spent().num_releases == 0
    # The fix the message gives: the size as a public argument.
    assert run(groups, g, y=y, num_groups=4).get_samples()["a"].shape == (8, 4)


def test_a_constant_size_plate_gets_the_one_line_fix(data):
    X, y, _ = data

    def constant_plate(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("data", N):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    with pytest.raises(ModelSpecificationError, match=r"numpyro.plate\('data', X.shape\[0\]\)"):
        run(constant_plate, X, y=y)
