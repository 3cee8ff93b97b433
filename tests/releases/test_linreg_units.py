"""Linear regression's releases with a guarantee per unit, not per row (issue 40)."""

import itertools

import numpy as np
import pytest
from _support.data import make_linreg_data as make_data
from jax import random

import numpyro_dp as ndp
from numpyro_dp.model.units import ROW, Units, UnitsError
from numpyro_dp.releases import linreg as lr

KEY = random.PRNGKey(0)
BOUNDS = dict(x_bound=1.2, y_bound=2.5)


def unit_ids(sizes, start=0):
    """One id per row for units of ``sizes`` rows, shuffled (row order does not matter)."""
    ids = np.repeat(np.arange(start, start + len(sizes)), sizes)
    return np.random.default_rng(start).permutation(ids)


def test_unit_sensitivity_is_m_times_a_rows_and_holds():
    """Each part of a unit of at most m rows moves by at most m times a row's, whatever
    the rows (on the bounds, where the bounds are attained) and their number."""
    bx, by = 1.2, 2.5
    for neighbourhood, with_yty, m in itertools.product(("substitute", "add_remove"),
                                                        (False, True), (1, 2, 5)):
        assert lr.linreg_sensitivity(bx, by, neighbourhood, with_yty, m) == pytest.approx(
            m * lr.linreg_sensitivity(bx, by, neighbourhood, with_yty), rel=1e-15)
    rng, iu, m = np.random.default_rng(0), np.triu_indices(3), 3

    def stat(rows):
        x, y = rows
        return np.concatenate([(x.T @ x)[iu], x.T @ y, [y @ y]])

    def unit():
        k = rng.integers(1, m + 1)
        x = rng.normal(size=(k, 3))
        return bx * x / np.linalg.norm(x, axis=1, keepdims=True), rng.choice([-by, by], k)

    sub = lr.linreg_sensitivity(bx, by, max_rows_per_unit=m)
    add = lr.linreg_sensitivity(bx, by, "add_remove", max_rows_per_unit=m)
    for _ in range(500):
        a, b = unit(), unit()
        assert np.linalg.norm(stat(a) - stat(b)) <= sub + 1e-12
        assert np.linalg.norm(stat(a)) <= add + 1e-12
    # m rows alike attain the add/remove bound: the factor m is needed
    x = np.tile([bx, 0.0, 0.0], (m, 1))
    assert np.linalg.norm(stat((x, np.full(m, by)))) == pytest.approx(add)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="positive integer"):
            lr.linreg_sensitivity(bx, by, max_rows_per_unit=bad)


def test_unit_release_is_the_row_release_with_m_times_the_noise():
    """Two holders, units of 1-3 rows: the same statistics (the sum of the units' sums
    is the sum of the rows) and, with reproducible noise, the same standard normal
    draws; only the noise scale grows, by m (the largest unit, or max_rows_per_unit)."""
    X, y = make_data(600, 3)
    Xs, ys = [X[:300], X[300:]], [y[:300], y[300:]]
    ids = [unit_ids(np.tile([1, 2, 3], 50)), unit_ids(np.tile([3, 2, 1], 50), start=500)]
    exact = []
    for Xj, yj, idj in zip(Xs, ys, ids, strict=True):
        unit_sums = [(Xj[idj == u].T @ Xj[idj == u], Xj[idj == u].T @ yj[idj == u],
                      yj[idj == u] @ yj[idj == u]) for u in np.unique(idj)]
        S, z, u = (sum(parts) for parts in zip(*unit_sums, strict=True))
        exact.append(np.concatenate([S[np.triu_indices(3)], z, [u]]))

    def standardised(rel):
        got = [np.concatenate([rel.S_hat[j][np.triu_indices(3)], rel.z_hat[j], [rel.yty[j]]])
               for j in range(2)]
        return (np.stack(got) - np.stack(exact)) / rel.sigma

    kw = dict(**BOUNDS, noise_multiplier=2.0, reproducible_noise=True)
    rows = lr.release_linreg_stats(KEY, Xs, ys, **kw)
    nominal = lr.linreg_sensitivity(1.2, 2.5)
    for m, extra in ((3, {}), (5, {"max_rows_per_unit": 5})):
        units = lr.release_linreg_stats(KEY, Xs, ys, **kw, privacy_unit=ids, **extra)
        charged = units.sigma / units.entry.per_iteration.noise_multiplier
        assert m * nominal < charged < m * nominal * (1 + 1e-8)
        assert units.sigma / rows.sigma == pytest.approx(m, rel=1e-8)
        # the release grid is about sigma / 2^8: the draws agree to that
        assert np.allclose(standardised(units), standardised(rows), atol=0.01)
        assert list(units.n_rows) == [300, 300]  # rows, as the models read them
        assert rows.privacy_unit == ROW and units.privacy_unit.startswith("unit:")


def test_unit_release_charges_the_ledger_per_unit():
    X, y = make_data(300, 2)
    ids = unit_ids(np.full(100, 3))
    ledger = ndp.PrivacyLedger(delta=1e-6)
    rel = lr.release_linreg_stats(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1e-6, ledger=ledger,
                                  privacy_unit=ids)
    label = Units.from_ids(ids, 300).label
    assert rel.privacy_unit == rel.entry.privacy_unit == label
    spent = ledger.spent()
    assert spent.privacy_unit == label and "per unit" in str(spent)
    # adaSSP: the same units, so the ledger still reports them; its noise grows by m = 3
    base = lr.adassp(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1e-6)
    ada = lr.adassp(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1e-6, privacy_unit=ids,
                    ledger=ledger)
    assert base.entry.privacy_unit == ROW and ada.entry.privacy_unit == label
    assert ada.scale / base.scale == pytest.approx(3, rel=1e-8)
    assert ledger.spent().privacy_unit == label
    # a row-level charge on top: the common guarantee is per row
    lr.release_linreg_stats(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1e-6, ledger=ledger)
    assert ledger.spent().privacy_unit == ROW


def test_unit_refusals_are_clear():
    X, y = make_data(60, 2)
    ok = dict(**BOUNDS, epsilon=1.0, delta=1e-6)
    ids = unit_ids(np.tile([1, 2, 3], 10))
    with pytest.raises(UnitsError, match="more rows than max_rows_per_unit=2"):
        lr.release_linreg_stats(KEY, X, y, **ok, privacy_unit=ids, max_rows_per_unit=2)
    with pytest.raises(UnitsError, match="pass privacy_unit="):
        lr.release_linreg_stats(KEY, X, y, **ok, max_rows_per_unit=2)
    with pytest.raises(UnitsError, match=r"one unit id per row: an array of shape \(60,\)"):
        lr.release_linreg_stats(KEY, X, y, **ok, privacy_unit=ids[:-1])
    with pytest.raises(UnitsError, match="neighbourhood='substitute'"):
        lr.adassp(KEY, X, y, **ok, neighbourhood="add_remove", max_rows=100, privacy_unit=ids)
    Xs, ys = [X[:30], X[30:]], [y[:30], y[30:]]
    with pytest.raises(UnitsError, match="one array of unit ids per holder"):
        lr.release_linreg_stats(KEY, Xs, ys, **ok, privacy_unit=ids)
    with pytest.raises(UnitsError, match="of holder 1"):
        lr.release_linreg_stats(KEY, Xs, ys, **ok, privacy_unit=[ids[:30], ids[:20]])
    with pytest.raises(UnitsError, match="more than one holder"):
        lr.release_linreg_stats(KEY, Xs, ys, **ok, privacy_unit=[ids[:30], ids[30:]])
    with pytest.raises(UnitsError, match="one type"):
        lr.release_linreg_stats(KEY, Xs, ys, **ok,
                                privacy_unit=[np.arange(30), np.arange(30).astype(str)])
    with pytest.raises(UnitsError, match="integers or strings"):
        lr.release_linreg_stats(KEY, X, y, **ok, privacy_unit=ids.astype(float))


@pytest.mark.parametrize("name", ["release_linreg_stats", "adassp"])
def test_delta_is_checked_against_the_units(name):
    """300 rows in 100 units: delta = 1/200 protects units, not rows."""
    X, y = make_data(300, 2)
    ids = unit_ids(np.full(100, 3))
    release = getattr(lr, name)
    with pytest.raises(ValueError, match=r"1/n = 0\.00333"):
        release(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1 / 200)
    release(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1 / 200, privacy_unit=ids)
    with pytest.raises(ValueError, match=r"1/n = 0\.01"):
        release(KEY, X, y, **BOUNDS, epsilon=1.0, delta=1 / 100, privacy_unit=ids)


def test_gram_mechanism_per_unit():
    """``gram_mechanism`` per unit: m times a row's noise, the units in the ledger, delta
    against the units, substitute only."""
    X, _ = make_data(300, 2)
    ids = unit_ids(np.full(100, 3))
    gram = ndp.mechanisms.gram_mechanism
    rows = gram(KEY, X, x_bound=1.2, noise_multiplier=1.0)
    unit = gram(KEY, X, x_bound=1.2, noise_multiplier=1.0, privacy_unit=ids)
    assert unit.scale / rows.scale == pytest.approx(3, rel=1e-8)
    assert rows.entry.privacy_unit == ROW
    assert unit.entry.privacy_unit == Units.from_ids(ids, 300).label
    gram(KEY, X, x_bound=1.2, epsilon=1.0, delta=1 / 200, privacy_unit=ids)
    with pytest.raises(ValueError, match=r"1/n = 0\.01"):
        gram(KEY, X, x_bound=1.2, epsilon=1.0, delta=1 / 100, privacy_unit=ids)
    with pytest.raises(UnitsError, match="neighbourhood='substitute'"):
        gram(KEY, X, x_bound=1.2, noise_multiplier=1.0, neighbourhood="add_remove",
             max_rows=300, privacy_unit=ids)
