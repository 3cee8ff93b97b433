"""Privacy per unit through the runner (issue 40): ``PrivateMCMC.run(..., privacy_unit=ids)``.

On a synthetic panel (one unit of 50 rows and 60 units of 1-5 rows, in random row
order under scattered ids; a logistic model), for a full-data kernel (DPPenalty), a
gradient kernel (DPHMC), minibatch kernels (DPSGLD, DPMinibatchPenalty) and
NoiseAwareNUTS:

* every release made is charged (the releases counted at run time, inside the
  compiled sampler, equal the ledger's count, as in ``test_conformance``);
* any order of the rows, and ids relabelled, give the same releases bit for bit
  (reproducible noise) and the same ledger: units are ordered by id and a unit's
  rows by their values, and exact sums do not depend on the order of their terms;
* the ledger says what it protects: ``privacy_spent().privacy_unit`` and its text,
  the ArviZ attributes, a row-level run after a unit-level one, a ledger file (and a
  file written before issue 40, whose entries protect rows);
* DPBarker refuses ``privacy_unit``; plans count units.

The unit-level sums themselves (every route against the rows' sums) are checked in
``tests/model/test_units.py``.
"""

import dataclasses
import json
import textwrap
import warnings

import jax
import numpy as np
import pandas as pd
import pytest
from _support.data import logistic_model, make_panel
from _support.releases import count_made_releases
from _support.running import run_on_devices

import numpyro_dp as ndp
from numpyro_dp.accounting.ledger import PrivacyLedger
from numpyro_dp.model.units import ROW, Units, UnitsError

#: name -> (kernel factory, releases per iteration)
KERNELS = {
    "DPPenalty": (lambda: ndp.DPPenalty(logistic_model, llr_clip=1.0, proposal_scale=0.05,
                                        noise_multiplier=2.0), 1),
    "DPHMC": (lambda: ndp.DPHMC(logistic_model, step_size=0.05, num_steps=2, grad_clip=1.0,
                                llr_clip=1.0, noise_multiplier_grad=3.0,
                                noise_multiplier_llr=2.0), 2 + 2),
    "DPSGLD": (lambda: ndp.DPSGLD(logistic_model, step_size=1e-3, batch_size=15,
                                  grad_clip=1.0), 1),
    "DPMinibatchPenalty": (lambda: ndp.DPMinibatchPenalty(
        logistic_model, llr_clip=1.0, proposal_scale=0.05, batch_size=20, temperature=0.3,
        noise_multiplier=2.0), 1),
}
NUM_UNITS = 61
DELTA = 1e-4


@pytest.fixture(scope="module")
def panel():
    """``X, y, ids``: 61 units, 233 rows; and the label the ledger gives these units."""
    X, y, ids = panel_data()
    units = Units.from_ids(ids, len(ids))
    assert units.num_units == NUM_UNITS and len(ids) > 3 * NUM_UNITS
    return X, y, ids, units.label


@pytest.fixture
def releases(monkeypatch):
    return count_made_releases(monkeypatch)


def runner(kernel, *, num_chains=2, epsilon=None, **kwargs):
    options = {"num_warmup": 2, "num_samples": 3, "delta": DELTA, "progress_bar": False,
               "reproducible_noise": True, "check_mixing": False, **kwargs}
    return ndp.PrivateMCMC(kernel, num_chains=num_chains, chain_method="vectorized",
                           epsilon=epsilon, **options)


def run(mcmc, X, y, ids, seed=0, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny runs' mixing and NUTS warnings
        mcmc.run(jax.random.PRNGKey(seed), X, y=y, privacy_unit=ids, **kwargs)
    return mcmc


def draws(mcmc):
    return [np.asarray(x) for x in jax.tree.leaves(mcmc.get_samples())]


def entries_but_unit(mcmc):
    """The ledger's entries with what they protect left out."""
    return [dataclasses.replace(e, privacy_unit="") for e in mcmc.privacy_spent().ledger]


# ------------------------------------------------------ releases made == charged
@pytest.mark.parametrize("name", list(KERNELS))
def test_releases_made_equal_releases_charged_per_unit(panel, releases, name):
    """2 chains, then a continuation from ``post_warmup_state``: each release made is
    charged, to the units; a refused run (budget, or ids that do not fit) makes none."""
    X, y, ids, label = panel
    make, per_iteration = KERNELS[name]
    mcmc = run(runner(make()), X, y, ids)
    assert len(releases) == mcmc.privacy_spent().num_releases == 2 * 5 * per_iteration
    assert mcmc.sampler._private_model.num_rows == NUM_UNITS
    mcmc.post_warmup_state = mcmc.last_state
    run(mcmc, X, y, ids, seed=1)
    spent = mcmc.privacy_spent()
    assert len(releases) == spent.num_releases == 2 * (5 + 3) * per_iteration
    assert [(e.phase, e.privacy_unit) for e in spent.ledger] == [
        ("warmup+sample", label), ("sample", label)]
    assert spent.privacy_unit == label

    start = len(releases)
    refused = runner(make(), num_warmup=50, num_samples=50, epsilon=1e-3)
    with pytest.raises(ndp.PrivacyBudgetError):
        run(refused, X, y, ids)
    with pytest.raises(UnitsError, match="one unit id per row"):
        run(refused, X, y, ids[:-1])
    assert len(releases) == start and refused.privacy_spent().num_releases == 0


def noise_aware_runs(panel):
    """NoiseAwareNUTS on the panel, its rows permuted, and with ids relabelled (in
    another order of the units)."""
    X, y, ids, _ = panel
    order = np.random.default_rng(2).permutation(len(ids))
    relabelled = np.char.add("person-", (10**7 - ids).astype(str))  # the units reversed
    return [(X, y, ids), (X[order], y[order], ids[order]),
            (X[order], y[order], relabelled[order])]


@pytest.mark.slow  # make test-all: NoiseAwareNUTS's tuning compiles for about 20 s
@pytest.mark.compile_bound
def test_noise_aware_releases_per_unit_are_charged_and_do_not_depend_on_the_rows_order(
        panel, releases):
    """NoiseAwareNUTS with units: its clip selection, warm start, anchor stage and score
    release are made as charged and protect the units; the release counts units; any
    order of the rows, and relabelled ids, give the same release and the same draws, bit
    for bit, and the same ledger but for the label (which fingerprints the ids' order)."""
    _, _, ids, label = panel
    runs = []
    for X, y, unit_ids in noise_aware_runs(panel):
        start = len(releases)
        mcmc = run(runner(ndp.NoiseAwareNUTS(logistic_model), num_warmup=5, num_samples=5,
                          epsilon=100.0), X, y, unit_ids)
        spent = mcmc.privacy_spent()
        assert len(releases) - start == spent.num_releases > 8
        assert [e.phase for e in spent.ledger] == [
            "clip selection", "warm start", "anchor stage 1", "score release",
            "warmup+sample", "notes"]
        unit = Units.from_ids(unit_ids, len(unit_ids)).label
        assert [e.privacy_unit for e in spent.ledger] == [unit] * 5 + [ROW]  # notes: free
        assert spent.privacy_unit == mcmc.release.privacy_unit == unit
        assert mcmc.release.num_rows == NUM_UNITS and "from n = 61 units" in str(mcmc.release)
        runs.append(mcmc)
    assert runs[0].privacy_spent().privacy_unit == label
    first = runs[0]
    for other in runs[1:]:
        for a, b in zip(draws(other), draws(first), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(other.release.score, first.release.score)
        np.testing.assert_array_equal(other.release.curvature, first.release.curvature)
        assert entries_but_unit(other) == entries_but_unit(first)
        assert other.privacy_spent().epsilon == first.privacy_spent().epsilon


# ------------------------------------------------------------ any order of the rows
@pytest.mark.slow  # about 20 s of compiling; the fast tier keeps the conformance tests
@pytest.mark.parametrize("name", ["DPPenalty", "DPHMC", "DPSGLD"])
def test_any_order_of_the_rows_gives_the_same_releases(panel, name):
    """The panel, its rows permuted, and with ids relabelled: the same draws bit for bit
    and the same ledger.  Relabelled as strings in the ids' order, the units and their
    label are the same.  For the full-data kernels, relabelled in the reverse order too
    (the unit blocks come in another order; their clipped sums are exact integer sums,
    which do not depend on it).  Minibatch kernels sample units in the ids' order, so
    ids relabelled in another order give other batches: another draw of the same law,
    not compared here."""
    X, y, ids, label = panel
    make, _ = KERNELS[name]
    order = np.random.default_rng(3).permutation(len(ids))
    same_order = np.char.add("p", np.char.zfill(ids.astype(str), 7))  # sorts as the ids do
    inputs = {"permuted": (X[order], y[order], ids[order]),
              "strings": (X, y, same_order),
              "permuted strings": (X[order], y[order], same_order[order]),
              "a pandas column": (X, y, pd.DataFrame({"person": same_order})["person"])}
    if name != "DPSGLD":
        inputs["reversed"] = (X[order], y[order], (10**7 - ids)[order])
    first = run(runner(make()), X, y, ids)
    assert first.privacy_spent().privacy_unit == label
    for case, (Xo, yo, io) in inputs.items():
        other = run(runner(make()), Xo, yo, io)
        for a, b in zip(draws(other), draws(first), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=case)
        assert entries_but_unit(other) == entries_but_unit(first), case
        unit = other.privacy_spent().privacy_unit
        assert unit == Units.from_ids(io, len(io)).label, case
        # The same ids in the same row order: the same label, the same ledger.
        assert (unit == label) == (case in ("strings", "a pandas column")), case
    # A row-level run on the same rows is another release (the units are clipped).
    rows = runner(make())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows.run(jax.random.PRNGKey(0), X, y=y)
    assert not all(np.array_equal(a, b) for a, b in zip(draws(rows), draws(first), strict=True))


# ------------------------------------------------------------------- the ledger
def test_the_ledger_and_arviz_say_what_they_protect(panel):
    """``privacy_spent()`` and its text, the ArviZ attributes and the ledger's JSON name
    the units; a second unit-level run on the same units keeps them; a row-level run
    after them makes the whole ledger's guarantee one per row, and so do units of
    another partition."""
    X, y, ids, label = panel
    mcmc = run(runner(KERNELS["DPPenalty"][0]()), X, y, ids)
    spent = mcmc.privacy_spent()
    assert spent.privacy_unit == label and label.startswith("unit:")
    assert "-DP per unit (all its rows), substitute neighbourhood" in str(spent)
    assert spent.to_dict()["privacy_unit"] == label
    assert spent.to_dict()["ledger"][0]["privacy_unit"] == label
    idata = ndp.to_inference_data(mcmc)
    assert idata.attrs["privacy_unit"] == idata.posterior.attrs["privacy_unit"] == label
    assert json.loads(idata.attrs["privacy_ledger"])["privacy_unit"] == label

    run(mcmc, X, y, ids, seed=1)  # the same units: still per unit
    assert mcmc.privacy_spent().privacy_unit == label
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(jax.random.PRNGKey(2), X, y=y)  # rows
    spent = mcmc.privacy_spent()
    assert [e.privacy_unit for e in spent.ledger] == [label, label, ROW]
    assert spent.privacy_unit == ROW and "-DP per row, substitute" in str(spent)
    assert ndp.to_inference_data(mcmc).attrs["privacy_unit"] == ROW

    other = run(runner(KERNELS["DPPenalty"][0]()), X, y, ids)
    run(other, X, y, np.roll(ids, 1), seed=1)  # another partition of the rows
    assert other.privacy_spent().privacy_unit == ROW
    assert len({e.privacy_unit for e in other.privacy_spent().ledger}) == 2


def test_a_ledger_file_stores_what_each_entry_protects(panel, tmp_path):
    X, y, ids, label = panel
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(path, delta=DELTA)
    mcmc = run(runner(KERNELS["DPPenalty"][0](), ledger=ledger), X, y, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(jax.random.PRNGKey(1), X, y=y)
    lines = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    assert [line["privacy_unit"] for line in lines[1:]] == [label, ROW]
    again = PrivacyLedger.open(path)
    assert again.entries == mcmc.ledger.entries == list(mcmc.privacy_spent().ledger)
    assert [e.privacy_unit for e in again.entries] == [label, ROW]
    assert again.spent() == mcmc.privacy_spent()
    assert again.spent().privacy_unit == ROW


# ------------------------------------------------------- refusals and plans
def test_dp_barker_refuses_privacy_unit_before_any_charge(panel, releases):
    X, y, ids, _ = panel
    mcmc = runner(ndp.DPBarker(logistic_model, batch_size=30, proposal_scale=0.05, n0=20))
    message = ("DPBarker does not accept privacy_unit: its Barker test's correction assumes "
               "the batch's log-likelihood ratios are independent rows.*For a guarantee per "
               "unit use DPPenalty, DPMinibatchPenalty, DPHMC, DPMALA, DPSGLD, DPSGHMC, "
               "DPSGNHT or NoiseAwareNUTS")
    with pytest.raises(ValueError, match=message):
        run(mcmc, X, y, ids)
    with pytest.raises(ValueError, match="DPBarker does not accept privacy_unit"):
        mcmc.plan(X, y=y, privacy_unit=ids)
    assert mcmc.privacy_spent().num_releases == 0 and len(releases) == 0


def test_rows_placed_on_a_mesh_are_refused_with_privacy_unit(panel):
    X, y, ids, _ = panel
    Xs, ys, layout = ndp.shard_rows(jax.make_mesh((1,), ("data",)), X, y)
    mcmc = runner(KERNELS["DPPenalty"][0]())
    with pytest.raises(ValueError, match="pass the rows unplaced"):
        run(mcmc, Xs, ys, ids, row_layout=layout)
    assert mcmc.privacy_spent().num_releases == 0


def test_plans_count_units(panel):
    """``ndp.plan`` with ``privacy_unit``: n is the number of units and the plan says so;
    ``PrivateMCMC.plan`` of a minibatch kernel prices batches of units, as the run then
    charges."""
    X, y, ids, label = panel
    per_unit = ndp.plan(logistic_model, X, y, epsilon=5.0, delta=DELTA, num_warmup=10,
                        num_samples=10, privacy_unit=ids)
    per_row = ndp.plan(logistic_model, X, y, epsilon=5.0, delta=DELTA, num_warmup=10,
                       num_samples=10)
    assert (per_unit.num_rows, per_unit.privacy_unit) == (NUM_UNITS, label)
    assert (per_row.num_rows, per_row.privacy_unit) == (len(ids), ROW)
    assert f"n = {NUM_UNITS} units (privacy_unit)" in str(per_unit)
    assert f"n = {len(ids)} rows" in str(per_row)
    names = pd.Series(ids.astype(str), dtype="string")  # a pandas column of strings
    assert ndp.plan(logistic_model, X, y, epsilon=5.0, delta=DELTA, num_warmup=10,
                    num_samples=10, privacy_unit=names).num_rows == NUM_UNITS

    make, _ = KERNELS["DPSGLD"]
    mcmc = runner(make())
    unit_plan = mcmc.plan(X, y=y, privacy_unit=ids)
    assert unit_plan.epsilon == mcmc.plan(num_rows=NUM_UNITS).epsilon
    # Batches of 15 of 61 units, not of 233 rows (the noise is the dynamics', which
    # scales with n too): another charge.
    assert unit_plan.epsilon != mcmc.plan(X, y=y).epsilon
    run(mcmc, X, y, ids)
    # (the plan's epsilon on a coarser grid, rounded up)
    assert unit_plan.epsilon * (1 - 1e-3) < mcmc.privacy_spent().epsilon <= unit_plan.epsilon


# -------------------------------------------------------------------- a mesh
MESH_SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    import numpyro_dp as ndp
    from privacy.test_privacy_unit import KERNELS, panel_data, runner, run
    from _support.data import logistic_model

    assert jax.local_device_count() == 4
    X, y, ids = panel_data()
    for name in ["DPHMC", "DPPenalty", "DPSGLD"]:
        one = run(runner(KERNELS[name][0]()), X, y, ids)
        mesh = jax.make_mesh((4,), ("data",))  # 61 units: 16 a device, 3 of them padding
        four = run(runner(KERNELS[name][0](), mesh=mesh), X, y, ids)
        for a, b in zip(jax.tree.leaves(four.get_samples()), jax.tree.leaves(one.get_samples())):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert np.all(np.isfinite(np.asarray(jax.tree.leaves(one.get_samples())[0])))
        assert four.privacy_spent() == one.privacy_spent(), name
        assert four.sampler._private_model.padded_rows == 64, name
        print(name, "same draws and ledger on 4 devices", flush=True)
    # Clip selection and warm start: per-unit values and sums over the devices' units
    # (the tuning's post-processing runs partitioned: the same draws to float rounding).
    tuned = lambda **kw: runner(ndp.DPHMC(logistic_model, num_steps=2), epsilon=50.0, **kw)
    one = run(tuned(), X, y, ids)
    four = run(tuned(mesh=jax.make_mesh((4,), ("data",))), X, y, ids)
    np.testing.assert_allclose(np.asarray(four.get_samples()["w"]),
                               np.asarray(one.get_samples()["w"]), rtol=1e-5, atol=1e-6)
    assert [e.phase for e in four.privacy_spent().ledger] == [
        "clip selection", "warm start", "warmup+sample"]
    assert four.privacy_spent() == one.privacy_spent()
    print("DPHMC tuned: the same draws on 4 devices", flush=True)
    print("done")
""")


def panel_data():
    """The module's panel, for the mesh script's interpreter (no fixtures there)."""
    X, y, ids, _ = make_panel(num_small=NUM_UNITS - 1, seed=11)
    return X.astype(np.float32), y.astype(np.float32), ids


@pytest.mark.slow  # make test-all: 4 emulated devices in a subprocess
@pytest.mark.compile_bound
def test_units_on_a_mesh_give_one_devices_releases():
    """``PrivateMCMC(mesh=)`` with ``privacy_unit``: the unit blocks are placed on the data
    axis (padded with empty units: 61 on 4 devices), and the draws and ledger are one
    device's, bit for bit with fixed clips (DPHMC, DPPenalty, DPSGLD; reproducible
    noise), to float rounding with the clip selection and warm start (DPHMC)."""
    assert "done" in run_on_devices(MESH_SCRIPT, 4, timeout=900)
