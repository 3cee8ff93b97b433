"""Privacy units (issue 40): ``Units`` and a unit playing the part of a row on every route.

:class:`~numpyro_dp.model.units.Units` is checked by hand on small ids (validation,
blocks, mask, string ids, row order).  Then, on a synthetic panel (one unit of 50
rows, the others of 1-5 rows, in random row order under scattered ids), a unit-level
``PrivateModel`` is compared with the row-level one on the same rows at the same
theta, for a linear-Gaussian and a logistic model: each unit's log-likelihood is the
sum of its rows'; the clipped gradient sum on each gradient route, the log-likelihood
ratio sums, the warm start's gradient and Hessian sums and a minibatch's sum are
those of the units' totals, each total clipped as a whole (a unit whose rows are each
under the clip is scaled down when their total is over it).  The references are
plain numpy loops over the row-level model's per-row values, in float64; the only
differences are the rounding grids of the exact sums (``row_quantum`` per term).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from _support.data import linear_model, logistic_model, make_panel

from numpyro_dp.kernels.ratios import batch_ratio_sums, clip_ratios, release_llr
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.model.units import ROW, Units, UnitsError, common_unit
from numpyro_dp.primitives import row_statistics
from numpyro_dp.primitives.batching import poisson_batch
from numpyro_dp.primitives.clipping import vector_clip_bound
from numpyro_dp.primitives.gradients import clipped_grad_sum_fn
from numpyro_dp.primitives.rounding import exact_sum, row_quantum
from numpyro_dp.primitives.route_choice import select_route

#: float64 throughout: the references are float64 loops (tests/model/conftest.py).
pytestmark = pytest.mark.usefixtures("model_x64")


# ------------------------------------------------------------------ Units itself
def small_units():
    """Six rows of three units (ids 7, 3, 9), the rows' values chosen to sort."""
    ids = np.array([7, 3, 7, 9, 7, 3])
    X = np.array([[5.0, 0.0], [2.0, 1.0], [1.0, 1.0], [4.0, 4.0], [3.0, 0.0], [0.0, 9.0]])
    y = np.array([10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    return ids, X, y


def test_from_ids_refuses_what_is_not_one_integer_or_string_id_per_row():
    ids, _, _ = small_units()
    for bad in (ids[:, None], ids[:5], np.concatenate([ids, ids]), np.array(7)):
        with pytest.raises(UnitsError, match=r"one unit id per row: an array of shape \(6,\)"):
            Units.from_ids(bad, 6)
    with pytest.raises(UnitsError, match="integers or strings, got dtype float64.*factorize"):
        Units.from_ids(ids.astype(float), 6)
    with pytest.raises(UnitsError, match="integers or strings, got dtype object"):
        Units.from_ids(np.array([1, "a", 2, 3, 4, 5], dtype=object), 6)
    assert issubclass(UnitsError, ValueError)


def test_a_unit_over_max_rows_per_unit_is_refused():
    ids, _, _ = small_units()  # unit 7 has 3 rows
    with pytest.raises(UnitsError, match=r"1 unit\(s\) have more rows than "
                                         r"max_rows_per_unit=2 \(the largest has 3"):
        Units.from_ids(ids, 6, max_rows_per_unit=2)
    with pytest.raises(UnitsError, match=r"2 unit\(s\) have more rows than max_rows_per_unit=1"):
        Units.from_ids(ids, 6, max_rows_per_unit=1)
    for bad in (0, -3, 2.5):
        with pytest.raises(UnitsError, match="max_rows_per_unit must be a positive integer"):
            Units.from_ids(ids, 6, max_rows_per_unit=bad)
    assert Units.from_ids(ids, 6, max_rows_per_unit=3).max_rows == 3


def test_blocks_hold_a_units_rows_by_value_then_copies_of_its_first_row():
    ids, X, y = small_units()
    units = Units.from_ids(ids, 6)
    assert (units.num_units, units.max_rows) == (3, 3)
    np.testing.assert_array_equal(units.codes, [1, 0, 1, 2, 1, 0])  # ids in order: 3, 7, 9
    np.testing.assert_array_equal(units.sizes, [2, 3, 1])
    np.testing.assert_array_equal(units.mask(), [[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    Xb, yb = units.block([X, y])
    assert Xb.shape == (3, 3, 2) and yb.shape == (3, 3)
    # Unit 3: rows 5 ([0, 9]) and 1 ([2, 1]) by value, then row 5 again.
    np.testing.assert_array_equal(Xb[0], [[0, 9], [2, 1], [0, 9]])
    np.testing.assert_array_equal(yb[0], [15, 11, 15])
    # Unit 7: rows 2, 4, 0 (first columns 1 < 3 < 5); unit 9: row 3 and two copies.
    np.testing.assert_array_equal(Xb[1], [[1, 1], [3, 0], [5, 0]])
    np.testing.assert_array_equal(yb[1], [12, 14, 10])
    np.testing.assert_array_equal(Xb[2], [[4, 4]] * 3)
    np.testing.assert_array_equal(yb[2], [13] * 3)
    # Ties in the first values are broken by the next ones, y last.
    ties = units.block([np.array([1.0, 0, 1, 0, 1, 0]), np.array([3.0, 2, 1, 0, 2, 1])])
    np.testing.assert_array_equal(ties[1][1], [1, 2, 3])
    # A public max_rows_per_unit sets the blocks' width: more padding, masked.
    wide = Units.from_ids(ids, 6, max_rows_per_unit=5)
    assert wide.block([X])[0].shape == (3, 5, 2)
    np.testing.assert_array_equal(wide.mask().sum(1), [2, 3, 1])
    np.testing.assert_array_equal(wide.block([X])[0][:, :3], Xb)
    assert units.label.startswith("unit:") and len(units.label) == len("unit:") + 16
    int(units.label[5:], 16)


def test_string_ids_give_the_units_of_integer_ids_in_the_same_order():
    ids, X, y = small_units()
    names = np.array(["carol", "al", "carol", "dora", "carol", "al"])  # al < carol < dora
    by_name, by_number = Units.from_ids(names, 6), Units.from_ids(ids, 6)
    np.testing.assert_array_equal(by_name.codes, by_number.codes)
    assert by_name.label == by_number.label  # the fingerprint is of the partition
    for a, b in zip(by_name.block([X, y]), by_number.block([X, y]), strict=True):
        np.testing.assert_array_equal(a, b)
    # bytes, pandas' string columns (object, "string", categories), an Index, lists and
    # object arrays of strings are the same labels; booleans are labels too
    assert Units.from_ids(names.astype("S"), 6).label == by_number.label
    for same in (pd.Series(names), pd.Series(names, dtype="string"),
                 pd.Series(names, dtype="category"), pd.Index(names), list(names),
                 names.astype(object), pd.Series(ids), pd.Series(ids, dtype="Int64")):
        assert Units.from_ids(same, 6).label == by_number.label, same
    with pytest.raises(UnitsError, match="integers or strings, got dtype float64"):
        Units.from_ids(pd.Series([7, None, 7, 9, 7, 3], dtype="Int64"), 6)  # a missing id
    assert Units.from_ids(np.array([True, False, True]), 3).num_units == 2


def test_any_order_of_the_rows_gives_the_same_blocks():
    X, y, ids, _ = make_panel(num_small=30)
    n = len(ids)
    units = Units.from_ids(ids, n)
    blocks = units.block([X, y])
    rng = np.random.default_rng(1)
    for _ in range(3):
        order = rng.permutation(n)
        again = Units.from_ids(ids[order], n)
        np.testing.assert_array_equal(again.sizes, units.sizes)
        np.testing.assert_array_equal(again.mask(), units.mask())
        for a, b in zip(again.block([X[order], y[order]]), blocks, strict=True):
            np.testing.assert_array_equal(a, b)
        # The label fingerprints which rows share a unit, in the rows' order: another
        # order of the ids is another label (a ledger with both reports "row").
        assert again.label != units.label
    # Rows reordered within their units (the ids' order unchanged): the same label.
    within = np.arange(n)
    for code in range(units.num_units):
        rows = np.flatnonzero(units.codes == code)
        within[rows] = rng.permutation(rows)
    np.testing.assert_array_equal(ids[within], ids)
    assert Units.from_ids(ids[within], n).label == units.label
    for a, b in zip(units.block([X[within], y[within]]), blocks, strict=True):
        np.testing.assert_array_equal(a, b)


def test_common_unit():
    assert common_unit(["unit:ab", "unit:ab"]) == "unit:ab"
    assert common_unit(["unit:ab", "unit:cd"]) == ROW == "row"
    assert common_unit(["unit:ab", ROW]) == ROW
    assert common_unit([ROW]) == ROW


# ------------------------------------------------------- a unit plays a row's part
MODELS = {"linear": linear_model, "logistic": logistic_model}


class Panel:
    """The unit-level and the row-level model of one panel, and per-row references."""

    def __init__(self, family):
        X, y, ids, big = make_panel(num_small=40, family=family)
        self.args, self.kwargs = (X,), {"y": y}
        model = MODELS[family]
        self.rows = PrivateModel(model, self.args, self.kwargs)
        self.pm = PrivateModel(model, self.args, self.kwargs, privacy_unit=ids)
        # What a compiled sampler gets: the unit blocks and mask, as model arguments.
        self.unit_args, self.unit_kwargs = self.pm.rebuild(
            self.pm.private_inputs(self.args, self.kwargs))
        self.codes = self.pm.units.codes
        self.big = int(np.searchsorted(np.unique(ids), big))  # the big unit's index
        d = self.rows.num_params
        self.theta = jnp.asarray(np.linspace(0.3, -0.2, d))

        def loglik(theta):
            return self.rows.log_density_terms(self.rows.unravel(theta), self.args,
                                               self.kwargs).loglik_rows

        self.row_loglik = jax.jit(loglik)
        # Rows are independent: the Jacobian's rows are the rows' gradients.
        self.row_grads = np.asarray(jax.jit(jax.jacfwd(loglik))(self.theta))
        self.row_hessians = np.asarray(jax.jit(jax.hessian(loglik))(self.theta))
        self.routes = ["jacobian"]
        try:  # a forced linear predictor, where the unit's program has an admissible cut
            select_route(self.pm, self.unit_args, self.unit_kwargs, "linear_predictor")
            self.routes.append("linear_predictor")
        except ValueError as err:
            self.refused = str(err)

    def terms(self, theta, **kwargs):
        """The unit model's log-density terms at ``theta`` (compiled)."""
        return jax.jit(lambda t: self.pm.log_density_terms(
            self.pm.unravel(t), self.unit_args, self.unit_kwargs, **kwargs))(theta)

    def per_unit(self, values):
        """Segment sums of per-row values over the units, in the units' order."""
        values = np.asarray(values)
        out = np.zeros((self.pm.num_rows,) + values.shape[1:])
        np.add.at(out, self.codes, values)
        return out


@pytest.fixture(scope="module", params=list(MODELS))
def panel(request, model_x64):
    return Panel(request.param)


def clipped(values, clip):
    """Each vector (row of ``values``, flattened) scaled to norm at most ``clip``."""
    flat = values.reshape(len(values), -1)
    norms = np.linalg.norm(flat, axis=1)
    return flat * np.minimum(1.0, clip / norms)[:, None]


def grid_tolerance(clip, d, terms):
    """What the exact sums' rounding grid may move a sum of ``terms`` terms by."""
    return terms * float(row_quantum(vector_clip_bound(clip, d, np.float64), terms, np.float64))


def test_a_unit_model_has_units_for_rows(panel):
    pm, rows = panel.pm, panel.rows
    assert pm.units is not None and rows.units is None
    assert pm.num_rows == pm.padded_rows == pm.units.num_units == 41 < rows.num_rows
    assert pm.units.max_rows == 50 and pm.units.sizes.max() == 50
    m = pm.units.max_rows
    assert [s.shape for s in pm.row_specs] == [(41, m, 2), (41, m), (41, m)]
    assert pm.row_specs[-1].dtype == np.dtype(bool)
    assert pm.latent_sites == rows.latent_sites and pm.num_params == rows.num_params
    # The model itself still sees rows: its structure and init are the row model's.
    key = jax.random.PRNGKey(3)
    np.testing.assert_array_equal(pm.ravel(pm.init_params(key, panel.args, panel.kwargs)),
                                  rows.ravel(rows.init_params(key, panel.args, panel.kwargs)))


def test_ids_that_do_not_fit_are_refused_by_the_model(panel):
    X, y = panel.args[0], panel.kwargs["y"]
    model = panel.pm.model
    with pytest.raises(UnitsError, match="one unit id per row"):
        PrivateModel(model, (X,), {"y": y}, privacy_unit=np.arange(len(y) - 1))
    with pytest.raises(ValueError, match="privacy_unit with rows already placed on a mesh"):
        PrivateModel(model, (X,), {"y": y}, privacy_unit=np.arange(len(y)),
                     row_layout=RowLayout((len(y),), len(y)))
    with pytest.raises(ValueError, match="with_layout places unit blocks"):
        panel.rows.with_layout(RowLayout((3,), 3))


def test_a_units_log_likelihood_is_the_sum_of_its_rows(panel):
    units = panel.terms(panel.theta)
    rows = jax.jit(lambda t: panel.rows.log_density_terms(
        panel.rows.unravel(t), panel.args, panel.kwargs))(panel.theta)
    assert units.loglik_rows.shape == (41,)
    np.testing.assert_allclose(units.loglik_rows, panel.per_unit(rows.loglik_rows),
                               rtol=1e-13, atol=1e-12)
    # The prior is data-free: the same, from stand-ins of the rows.
    np.testing.assert_allclose(units.prior, rows.prior, rtol=1e-14)
    # Minibatch positions are units: those units' totals.
    some = jnp.array([panel.big, 0, 7])
    np.testing.assert_allclose(panel.terms(panel.theta, idx=some).loglik_rows,
                               units.loglik_rows[np.asarray(some)], rtol=1e-14)


def unit_grads(panel):
    return panel.per_unit(panel.row_grads)


def test_clipped_gradient_sums_of_unclipped_units_are_the_sum_of_all_rows(panel):
    """A clip over every unit's total norm: each route gives the plain sum of the rows'
    gradients.  The linear-predictor analysis finds no value per row in a unit's
    program (a unit's rows run in a vmap), only shared values of theta (m = 0; q = 4
    > d = 3 for the linear model, whose scale adds values: a forced route is refused;
    q = d = 2 for the logistic model: accepted, a degenerate cut that sums the same
    gradients), so ``auto`` falls back to the general route, ``"jacobian"``."""
    pm, args, kwargs = panel.pm, panel.unit_args, panel.unit_kwargs
    d = pm.num_params
    clip = 1.5 * np.linalg.norm(unit_grads(panel), axis=1).max()
    want = panel.row_grads.sum(0)
    tol = grid_tolerance(clip, d, pm.num_rows) + 1e-12 * np.abs(want).max()
    choice = select_route(pm, args, kwargs)
    assert choice.route == "jacobian", choice
    if "linear_predictor" in panel.routes:
        assert d == 2 and "general route is cheaper" in choice.reason
        forced = select_route(pm, args, kwargs, "linear_predictor")
        assert (forced.row_width, forced.shared_width) == (0, d)
    else:
        assert d == 3 and "only through wide cuts" in choice.reason
        assert "linear cut: m=0, q=4" in panel.refused
    for route in ["auto", *panel.routes]:
        fn, taken = clipped_grad_sum_fn(pm, route, args, kwargs)
        assert taken == ("jacobian" if route == "auto" else route)
        got = sum(jax.jit(fn)(panel.theta, clip, args, kwargs))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=route)


def test_a_units_total_is_clipped_not_its_rows(panel):
    """A clip above every row's gradient norm but below the big unit's total: the row
    model clips nothing, the unit model scales the big unit's total down to the clip,
    on both routes."""
    pm, args, kwargs = panel.pm, panel.unit_args, panel.unit_kwargs
    d = pm.num_params
    totals = unit_grads(panel)
    norms = np.linalg.norm(totals, axis=1)
    row_max = np.linalg.norm(panel.row_grads, axis=1).max()
    clip = np.sqrt(row_max * norms[panel.big])
    assert row_max < clip < norms[panel.big] / 3  # every row under it, the unit well over
    want = clipped(totals, clip).sum(0)
    tol = grid_tolerance(clip, d, pm.num_rows) + 1e-12 * np.abs(want).max()
    for route in panel.routes:
        fn, _ = clipped_grad_sum_fn(pm, route, args, kwargs)
        got = sum(jax.jit(fn)(panel.theta, clip, args, kwargs))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=route)
    # Per row nothing is clipped: the rows' sum, far from the units'.
    fn, _ = clipped_grad_sum_fn(panel.rows, "jacobian", panel.args, panel.kwargs)
    by_rows = sum(jax.jit(fn)(panel.theta, clip, panel.args, panel.kwargs))
    np.testing.assert_allclose(by_rows, panel.row_grads.sum(0), rtol=1e-9, atol=1e-9)
    assert np.linalg.norm(by_rows - want) > 0.5 * (norms[panel.big] - clip)


def test_log_likelihood_ratio_sums_clip_a_units_total(panel):
    """DPPenalty's and DPHMC's LLR release (``release_llr`` of the units' ratios): each
    unit's ratio is the sum of its rows', clipped as a whole; the minibatch penalty's
    sums (``batch_ratio_sums``) over sampled units likewise."""
    pm, args, kwargs = panel.pm, panel.unit_args, panel.unit_kwargs
    theta_new = panel.theta + 0.2
    z, z_new = pm.unravel(panel.theta), pm.unravel(theta_new)
    row_ratios = np.asarray(panel.row_loglik(theta_new) - panel.row_loglik(panel.theta))
    want = panel.per_unit(row_ratios)
    ratio = panel.terms(theta_new).loglik_rows - panel.terms(panel.theta).loglik_rows
    np.testing.assert_allclose(ratio, want, rtol=1e-12, atol=1e-12)
    clip = np.sqrt(np.abs(row_ratios).max() * abs(want[panel.big]))
    assert np.abs(row_ratios).max() < clip < abs(want[panel.big]) / 3
    k = pm.num_rows
    tol = grid_tolerance(clip, 1, k)
    total = sum(jax.jit(lambda r: exact_sum(clip_ratios(r, clip), clip, k))(ratio))
    np.testing.assert_allclose(total, np.clip(want, -clip, clip).sum(), rtol=0, atol=tol)
    # The release itself: what the units' ratios give is what their totals give.
    key = jax.random.PRNGKey(5)
    options = {"temperature": 1.0, "noise_multiplier": 2.0, "sensitivity_factor": 2.0}
    got = release_llr(key, ratio, clip, **options)
    np.testing.assert_allclose(got, release_llr(key, jnp.asarray(want), clip, **options),
                               rtol=1e-12)
    # A minibatch of units (the big one among them), some slots masked out.
    idx = jnp.array([3, panel.big, 17, 0, 29])
    sums, squares = jax.jit(lambda i: batch_ratio_sums(pm, z, z_new, args, kwargs, i, clip))(idx)
    picked = np.clip(want[np.asarray(idx)], -clip, clip)
    tol = grid_tolerance(clip, 1, len(idx))
    np.testing.assert_allclose(sum(sums), picked.sum(), rtol=0, atol=tol)
    np.testing.assert_allclose(sum(squares), (picked**2).sum(), rtol=0,
                               atol=grid_tolerance(clip**2, 1, len(idx)))


def test_gradient_and_hessian_sums_of_the_warm_start_are_the_units(panel):
    """``row_statistics``: the sums the warm start and NoiseAwareNUTS's score release
    make, each unit's gradient and Hessian (the sums of its rows') clipped as wholes;
    the per-row values for the clip selection are per unit."""
    pm, args, kwargs, theta = panel.pm, panel.unit_args, panel.unit_kwargs, panel.theta
    d = pm.num_params
    grads, hessians = unit_grads(panel), panel.per_unit(panel.row_hessians)
    g_norms = np.linalg.norm(grads, axis=1)
    h_norms = np.linalg.norm(hessians.reshape(len(hessians), -1), axis=1)
    scales = jax.jit(lambda t: (row_statistics.row_gradient_scales(pm, t, args, kwargs),
                                row_statistics.row_hessian_norms(pm, t, args, kwargs)))(theta)
    np.testing.assert_allclose(scales[0], g_norms, rtol=1e-12)
    np.testing.assert_allclose(scales[1], h_norms, rtol=1e-12)
    sums = jax.jit(lambda t, c, k: row_statistics.clipped_grad_and_hessian_sums(
        pm, t, c, k, args, kwargs))
    for clip, h_clip in [(1.5 * g_norms.max(), 1.5 * h_norms.max()),  # nothing clipped
                         (0.5 * g_norms[panel.big], 0.5 * h_norms[panel.big])]:
        g, h = sums(theta, clip, h_clip)
        want_g, want_h = clipped(grads, clip).sum(0), clipped(hessians, h_clip).sum(0)
        np.testing.assert_allclose(sum(g), want_g, rtol=0,
                                   atol=grid_tolerance(clip, d, pm.num_rows) + 1e-12)
        np.testing.assert_allclose(sum(h), want_h, rtol=0,
                                   atol=grid_tolerance(h_clip, d * d, pm.num_rows) + 1e-12)
    # With the big clips, the plain sums of every row's gradient and Hessian.
    g, h = sums(theta, 2 * g_norms.max(), 2 * h_norms.max())
    np.testing.assert_allclose(sum(g), panel.row_grads.sum(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(sum(h), panel.row_hessians.sum(0).ravel(), rtol=1e-9, atol=1e-9)
    # The expected Hessians (NoiseAwareNUTS's curvature): a unit's is its rows' sum too.
    expected, rows = panel.rows.one_row_loglik(panel.args, panel.kwargs, True)
    per_row = jax.jit(jax.vmap(jax.hessian(expected), (None, 0)))(theta, rows)
    fisher = panel.per_unit(per_row)
    f_norms = np.linalg.norm(fisher.reshape(len(fisher), -1), axis=1)
    h_clip = 0.5 * f_norms[panel.big]
    _, h = jax.jit(lambda t: row_statistics.clipped_grad_and_hessian_sums(
        pm, t, g_norms.max(), h_clip, args, kwargs, expected=True))(theta)
    np.testing.assert_allclose(sum(h), clipped(fisher, h_clip).sum(0), rtol=0,
                               atol=grid_tolerance(h_clip, d * d, pm.num_rows) + 1e-12)
    if d == 3:  # the linear model's expected curvature is not its observed one
        assert not np.allclose(fisher, hessians)


def test_a_minibatch_sums_the_sampled_units(panel):
    """The minibatch kernels' gradient sum over a Poisson sample of *units* (indices into
    the units, a mask on the buffer): the clipped totals of the units sampled."""
    pm, args, kwargs = panel.pm, panel.unit_args, panel.unit_kwargs
    d = pm.num_params
    totals = unit_grads(panel)
    clip = 0.5 * np.linalg.norm(totals[panel.big])
    idx, mask = poisson_batch(jax.random.PRNGKey(4), pm.num_rows, 0.3, 24)
    idx = idx.at[0].set(panel.big)  # the big unit in the batch, clipped
    mask = mask.at[0].set(1.0)
    assert 0 < float(mask.sum()) < len(mask) and len(set(np.asarray(idx))) == len(idx)
    assert np.all(np.asarray(idx) < pm.num_rows)
    want = (clipped(totals[np.asarray(idx)], clip) * np.asarray(mask)[:, None]).sum(0)
    for route in panel.routes:
        fn, _ = clipped_grad_sum_fn(pm, route, args, kwargs)
        got = sum(jax.jit(lambda t, c, i, m, fn=fn: fn(t, c, args, kwargs, idx=i, mask=m))(
            panel.theta, clip, idx, mask))
        np.testing.assert_allclose(got, want, rtol=0,
                                   atol=grid_tolerance(clip, d, len(idx)) + 1e-12,
                                   err_msg=route)
