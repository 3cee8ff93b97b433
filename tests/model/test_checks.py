"""Models that cannot be privatised are refused with an error that names the
problem (SPEC s1, :mod:`numpyro_dp.model.checks`).

Reference values are written by hand with numpy/scipy in float64 (x64 is on
for every test of this module and restored afterwards).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.model_cases import (
    _data,
    _rng,
    linreg_model,
    logistic_model,
    nested_only_model,
)

from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.checks import ModelSpecificationError

pytestmark = pytest.mark.usefixtures("model_x64")


def test_error_no_observed_site():
    def model(X):
        numpyro.sample("w", dist.Normal(0.0, 1.0))

    X, _ = _data()
    with pytest.raises(ModelSpecificationError, match="no observed sample site"):
        PrivateModel(model, (X,))


def test_error_only_factor_outside_plates():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.factor("loglik", -jnp.sum((y - X @ w) ** 2))

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="no observed sample site"):
        PrivateModel(model, (X, y))


def test_invalid_model_error_is_not_masked():
    """An exception the model raises while traced on abstract rows is public: it is
    raised as it is."""

    def model(X, y):
        s = numpyro.sample("s", dist.HalfNormal(-1.0))  # invalid hyperparameter
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    X, y = _data()
    with pytest.raises(ValueError, match="scale") as info:
        PrivateModel(model, (X, y))
    assert not isinstance(info.value, ModelSpecificationError)


def test_error_forgotten_obs_hints_obs():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0))  # obs=y forgotten

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="obs="):
        PrivateModel(model, (X, y))


def test_error_observed_site_outside_any_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"\['y'\] lie outside every plate"):
        PrivateModel(model, (X, y))


def _model_with_outside_obs(X, y, s):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    numpyro.sample("summary", dist.Normal(w.sum(), 1.0), obs=s)


def test_error_observed_site_outside_given_data_plate():
    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"\['summary'\].*outside the data plate"):
        PrivateModel(_model_with_outside_obs, (X, y, 1.5), data_plate="data")


def test_error_observed_site_outside_detected_plate():
    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"'summary'"):
        PrivateModel(_model_with_outside_obs, (X, y, 1.5))


def test_error_observed_site_in_another_plate():
    def model(X, y, y_other):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
        with numpyro.plate("other", y_other.shape[0]):
            numpyro.sample("y_other", dist.Normal(w[0], 1.0), obs=y_other)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"\['y_other'\].*outside the data plate"):
        PrivateModel(model, (X, y, np.zeros(7)), data_plate="data")
    with pytest.raises(ModelSpecificationError, match="no single plate holds every observed"):
        PrivateModel(model, (X, y, np.zeros(7)))


def test_error_two_candidate_plates_lists_both():
    Y = _rng().normal(size=(60, 4))
    with pytest.raises(ModelSpecificationError, match="data_plate=") as info:
        PrivateModel(nested_only_model, (Y,))
    msg = str(info.value)
    assert "'rows'" in msg and "'cols'" in msg
    # naming the plate resolves the ambiguity
    pm = PrivateModel(nested_only_model, (Y,), data_plate="rows")
    assert pm.data_plate == "rows" and pm.num_rows == 60


def test_error_unknown_data_plate():
    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="'rows' is not a plate") as info:
        PrivateModel(linreg_model, (X, y), data_plate="rows")
    assert "'data'" in str(info.value)  # the plates found are listed


def test_error_latent_site_inside_data_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            u = numpyro.sample("u", dist.Normal(0.0, 1.0))  # per-row random effect
            numpyro.sample("y", dist.Normal(X @ w + u, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"Latent site 'u'.*inside the data plate"):
        PrivateModel(model, (X, y))


def test_error_second_observed_site_missing_obs():
    def model(X, y, z):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
            numpyro.sample("z", dist.Normal(0.0, 1.0))  # obs=z forgotten

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"(?s)Latent site 'z'.*obs="):
        PrivateModel(model, (X, y, y))


def test_error_discrete_latent():
    def model(X, y):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w + k, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"Latent site 'k' is discrete"):
        PrivateModel(model, (X, y))


def test_error_subsampled_plate():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=10) as ind:
            numpyro.sample("y", dist.Normal(X[ind] @ w, 1.0), obs=y[ind])

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="subsample"):
        PrivateModel(model, (X, y))


def _assert_no_private_numbers(msg: str, numbers):
    """Neither the bad rows' indices nor their count appear in the message.

    The only number allowed is the public position of the argument ("#1").
    """
    for k in numbers:
        assert str(k) not in msg, (k, msg)
    assert not re.search(r"\d", re.sub(r"#\d+", "", msg)), msg


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_error_nonfinite_covariates(bad):
    X, y = _data()
    bad_rows = [17, 29, 53]
    X[bad_rows, 1] = bad
    with pytest.raises(ModelSpecificationError, match="NaN or infinite") as info:
        PrivateModel(linreg_model, (X, y))
    msg = str(info.value)
    assert "model argument" in msg
    _assert_no_private_numbers(msg, bad_rows + [len(bad_rows)])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_error_nonfinite_observations(bad):
    X, y = _data()
    bad_rows = [23, 41]
    y[bad_rows] = bad
    with pytest.raises(ModelSpecificationError, match="NaN or infinite") as info:
        PrivateModel(logistic_model, (X,), {"y": y})
    _assert_no_private_numbers(str(info.value), bad_rows + [len(bad_rows)])


def test_error_nonfinite_single_row_names_no_index():
    X, y = _data()
    y[37] = np.nan
    with pytest.raises(ModelSpecificationError, match="NaN or infinite") as info:
        PrivateModel(linreg_model, (X, y))
    _assert_no_private_numbers(str(info.value), [37])


def test_error_plate_size_differs_from_data():
    def model(y_t):  # rows along the second axis: the plate matches no leading size
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", y_t.shape[1]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y_t[0])

    y_t = _rng().normal(size=(1, 45))
    with pytest.raises(ModelSpecificationError, match=r"not the number of rows of any") as info:
        PrivateModel(model, (y_t,))
    assert "45" not in str(info.value)  # a plate size may be computed from the data


def test_error_plate_size_given_as_number():
    def model(y, n):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", n):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = list(_rng().normal(size=12))  # a Python list: its rows would count as public
    with pytest.raises(ModelSpecificationError, match="Python list or tuple with one item"):
        PrivateModel(model, (y, 12))


def test_as_many_rows_as_arguments_is_not_a_list_of_rows():
    """The arguments tuple itself is not a list of rows (n = 2 was refused)."""
    X, y = _data(n=2)
    assert PrivateModel(linreg_model, (X, y)).num_rows == 2


def test_error_prior_depends_on_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(X.mean(), 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"prior.*'w'"):
        PrivateModel(model, (X, y))


def test_error_prior_depends_on_observations():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.sample("s", dist.HalfNormal(jnp.std(y)))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, s), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"prior.*'s'") as info:
        PrivateModel(model, (X, y))
    assert "'w'" not in str(info.value)


def test_error_support_depends_on_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.sample("s", dist.Uniform(0.0, jnp.max(jnp.abs(y))))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, s), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"prior.*'s'"):
        PrivateModel(model, (X, y))


def test_error_factor_outside_plate_uses_data():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        numpyro.factor("penalty", -jnp.sum((X @ w) ** 2))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match=r"factor 'penalty'"):
        PrivateModel(model, (X, y))


def test_error_likelihood_reads_other_rows():
    """Standardising X inside the model makes every l_i depend on every row."""

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        Xs = (X - X.mean(0)) / 2.0
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(Xs @ w, 1.0), obs=y)

    X, y = _data()
    with pytest.raises(ModelSpecificationError, match="reads other rows"):
        PrivateModel(model, (X + 1.0, y))


def test_error_hard_coded_plate_size():
    X, y = _data()
    n = X.shape[0]

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", n):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    with pytest.raises(ModelSpecificationError, match=r"X\.shape\[0\]"):
        PrivateModel(model, (X, y))
