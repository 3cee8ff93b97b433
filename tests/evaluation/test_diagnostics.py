"""ndp.diagnostics: MMD and mean error against a direct computation (SPEC s8)."""

import arviz as az
import numpy as np
import pytest

from numpyro_dp.evaluation.diagnostics import draws_matrix, mean_error, median_bandwidth, mmd


def naive_mmd(x, y, width):
    def k(a, b):
        return np.exp(-((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / (2 * width**2))

    n, m = len(x), len(y)
    kxx, kyy = k(x, x), k(y, y)
    mmd2 = ((kxx.sum() - np.trace(kxx)) / (n * (n - 1))
            + (kyy.sum() - np.trace(kyy)) / (m * (m - 1)) - 2 * k(x, y).mean())
    return np.sqrt(max(mmd2, 0.0))


@pytest.mark.parametrize("block_size", [1, 7, 512])
def test_mmd_equals_direct_computation(block_size):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3)) + 100.0  # far from the origin: centring matters in float32
    y = rng.normal(size=(33, 3)) * 1.3 + 100.2
    width = median_bandwidth(x, y, rng=4)
    expected = naive_mmd(x, y, width)
    assert expected > 0.05
    assert mmd(x, y, rng=4, block_size=block_size) == pytest.approx(expected, rel=1e-4)
    assert mmd(x, y, bandwidth=0.7, block_size=block_size) == pytest.approx(
        naive_mmd(x, y, 0.7), rel=1e-4)


def test_median_bandwidth_is_the_median_distance_of_a_resample():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(40, 2)), rng.normal(size=(60, 2))
    both = np.concatenate([x, y])
    sub = both[np.random.default_rng(3).integers(0, 100, 500)]
    d = np.linalg.norm(sub[:, None] - sub[None], axis=-1)[np.triu_indices(500, 1)]
    assert median_bandwidth(x, y, rng=3) == pytest.approx(np.median(d))


def test_mmd_separates_and_is_shift_invariant():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(2000, 2)), rng.normal(size=(2000, 2))
    same, shifted = mmd(x, y), mmd(x, y + [0.5, 0.0])
    assert same < 0.05 < shifted
    assert mmd(x + 1e3, y + 1e3) == pytest.approx(same, abs=1e-3)


def test_mmd_memory_safe_for_ten_thousand_points():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(10_000, 2)), rng.normal(size=(10_000, 2)) + [0.1, 0.0]
    # tiles of 512 x 512 points: a few MB whatever the sample sizes
    value = mmd(x, y)
    assert 0.02 < value < 0.1


def test_inputs_dicts_and_inference_data():
    rng = np.random.default_rng(4)
    a = {"mu": rng.normal(size=(4, 100)), "tau": rng.normal(size=(4, 100, 2))}
    b = {"mu": rng.normal(size=(4, 100)) + 0.3, "tau": rng.normal(size=(4, 100, 2))}
    flat = {k: v.reshape(400, *v.shape[2:]) for k, v in a.items()}
    m = draws_matrix(flat)
    assert m.shape == (400, 3)
    np.testing.assert_array_equal(m[:, 0], flat["mu"])
    idata_a, idata_b = az.from_dict(posterior=a), az.from_dict(posterior=b)
    np.testing.assert_allclose(draws_matrix(idata_a), m)
    expected = mmd(draws_matrix(idata_a), draws_matrix(idata_b))
    assert mmd(idata_a, idata_b) == pytest.approx(expected)
    assert mean_error(idata_a, idata_b, var_names=["mu"]) == pytest.approx(
        abs(a["mu"].mean() - b["mu"].mean()))
    flat_b = {k: v.reshape(400, *v.shape[2:]) for k, v in b.items()}
    expected = np.linalg.norm(draws_matrix(idata_a).mean(0) - draws_matrix(idata_b).mean(0))
    assert mean_error(flat, flat_b) == pytest.approx(expected)


def test_bad_inputs_are_named():
    x = np.zeros((10, 2))
    with pytest.raises(ValueError, match="different dimensions"):
        mmd(x, np.zeros((10, 3)))
    with pytest.raises(ValueError, match="NaN"):
        mmd(x, np.full((10, 2), np.nan))
    with pytest.raises(ValueError, match="explicit bandwidth"):
        mmd(x, x)
    with pytest.raises(ValueError, match="positive"):
        mmd(x, x + 1, bandwidth=0.0)
    with pytest.raises(ValueError, match="'median'"):
        mmd(x, x + 1, bandwidth="silverman")
    with pytest.raises(KeyError, match="sites"):
        mmd({"a": x}, {"a": x}, var_names=["b"])
