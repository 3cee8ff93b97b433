"""The persistent privacy ledger: round trips, budget, tamper evidence, concurrency."""

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import dp_accounting as dpa
import pytest
from _support.data import logistic_model, make_logistic_data
from jax import random

import numpyro_dp as ndp
from numpyro_dp import accounting as acc
from numpyro_dp.accounting import lower_bound
from numpyro_dp.accounting.entry import LedgerEntry, event_from_json, event_to_json
from numpyro_dp.accounting.keyring import LedgerKey, default_key_path
from numpyro_dp.accounting.ledger import PrivacyLedger
from numpyro_dp.accounting.rdp import BarkerDpEvent
from numpyro_dp.releases import mechanisms as mech

REPO = Path(__file__).resolve().parents[2]
DELTA = 1e-6


def gauss(z=32.0, iterations=1, **kwargs):
    """Iterations of DP-Penalty; 1 / z^2 is exact, so sums of them are too."""
    return LedgerEntry("DPPenalty", "sample", 1, iterations, dpa.GaussianDpEvent(z), **kwargs)


def pld_entries():
    """Entries of every event type the PLD accountant takes, with awkward floats."""
    hmc = dpa.ComposedDpEvent([
        dpa.GaussianDpEvent(0.1 + 0.2 + 40),
        dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(100 / 3), 5),
    ])
    sg = dpa.ComposedDpEvent([
        dpa.TruncatedSubsampledGaussianDpEvent(10**4, 0.01, 150, 10 / 3),
        dpa.TruncatedSubsampledGaussianDpEvent(10**4, 0.01, 150, 10 / 3 + 0.7),
    ])
    return [
        LedgerEntry("DPHMC", "warmup+sample", 2, 50, hmc, label="première"),
        LedgerEntry("DPSGLD", "sample", 1, 2, sg.events[0], sg, reproducible_noise=True),
        LedgerEntry("X", "release", 1, 1,
                    dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(7.1))),
        LedgerEntry("Y", "release", 1, 1, dpa.NoOpDpEvent()),
    ]


def rdp_entries():
    return [
        LedgerEntry("DPBarker", "sample", 1, 20,
                    dpa.SampledWithoutReplacementDpEvent(10**5, 500, BarkerDpEvent(500))),
        LedgerEntry("DPPenalty", "sample", 2, 30,
                    dpa.SampledWithoutReplacementDpEvent(10**5, 1000, dpa.GaussianDpEvent(3.3))),
    ]


def pure_entries():
    return [
        LedgerEntry("laplace", "release", 1, 1, dpa.LaplaceDpEvent(1 / 0.7)),
        LedgerEntry("rr", "release", 1, 1, dpa.RandomizedResponseDpEvent(0.3, 2)),
        gauss(7.0),
    ]


CASES = {"pld": pld_entries, "rdp": rdp_entries, "pure": pure_entries}


def run_python(code, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def lines(path):
    return Path(path).read_bytes().splitlines(keepends=True)


# ----------------------------------------------------------------- events
def test_every_stored_event_type_round_trips_exactly():
    events = [e for case in CASES.values() for entry in case()
              for e in (entry.per_iteration, entry.chain_event) if e is not None]
    types = {type(e) for e in events}
    for e in events:
        for inner in getattr(e, "events", ()):
            types.add(type(inner))
        types.add(type(getattr(e, "event", e)))
    assert len(types) == 10  # every type the ledger file stores
    for e in events:
        back = event_from_json(json.loads(json.dumps(event_to_json(e))))
        assert back == e and repr(back) == repr(e)


def test_unknown_events_are_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(path, delta=DELTA)
    before = path.read_bytes()
    for event in (dpa.ZCDpEvent(0.1), dpa.SelfComposedDpEvent(dpa.NonPrivateDpEvent(), 2)):
        with pytest.raises(ValueError, match="cannot store"):
            ledger.charge(LedgerEntry("K", "sample", 1, 1, event))
    with pytest.raises(ValueError, match="finite float"):
        ledger.record(gauss(float("nan")))
    assert path.read_bytes() == before
    # An in-memory ledger holds any event, as before.
    PrivacyLedger(DELTA).record(LedgerEntry("K", "sample", 1, 1, dpa.ZCDpEvent(0.1)))


# ------------------------------------------------------------- round trip
def test_round_trip_in_this_and_a_fresh_process(tmp_path):
    originals, reopened = {}, {}
    for name, make in CASES.items():
        path = tmp_path / f"{name}.jsonl"
        ledger = PrivacyLedger.open(path, delta=DELTA)
        assert ledger.path == path and ledger.budget is None and ledger.entries == []
        for entry in make():
            assert ledger.charge(entry) == ledger.epsilon()
        memory = PrivacyLedger(DELTA)
        for entry in make():
            memory.record(entry)
        again = PrivacyLedger.open(path)
        assert again.entries == ledger.entries == make()
        assert again.epsilon() == ledger.epsilon() == memory.epsilon()
        assert again.spent() == memory.spent()
        originals[name] = memory.epsilon()
        reopened[name] = repr(again.entries)
    proc = run_python(f"""
        import json
        from numpyro_dp import PrivacyLedger
        out = {{}}
        for name in {list(CASES)!r}:
            ledger = PrivacyLedger.open({str(tmp_path)!r} + "/" + name + ".jsonl")
            out[name] = [ledger.epsilon().hex(), repr(ledger.entries)]
        print(json.dumps(out))
    """)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    fresh = json.loads(stdout)
    for name in CASES:
        assert fresh[name] == [originals[name].hex(), reopened[name]]


def test_file_format(tmp_path):
    path = tmp_path / "ledger.jsonl"
    PrivacyLedger.open(path, delta=DELTA, neighbourhood="add_remove", epsilon=2.5).charge(
        gauss(label="first"))
    header, entry = (json.loads(line) for line in path.read_text("utf-8").splitlines())
    assert header["format"] == "numpyro-dp-ledger" and header["version"] == 3
    assert (header["delta"], header["neighbourhood"], header["accountant"],
            header["epsilon"]) == (DELTA, "add_remove", "auto", 2.5)
    assert len(header["id"]) == 32 and header["key_id"] == LedgerKey.load().id
    assert header["prev"] == "0" * 64 and entry["prev"] == header["tag"]
    assert len(entry["tag"]) == 64
    assert entry["per_iteration"] == {"type": "GaussianDpEvent", "noise_multiplier": 32.0}
    assert entry["label"] == "first" and entry["time"].endswith("+00:00")
    assert entry["privacy_unit"] == "row"
    assert len(entry["id"]) == 36


def test_settings_must_match_on_reopening(tmp_path):
    path = tmp_path / "ledger.jsonl"
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger.open(path)  # a new ledger needs delta
    with pytest.raises(ValueError, match="neighbourhood"):
        PrivacyLedger.open(path, delta=DELTA, neighbourhood="replace")
    assert not path.exists()
    PrivacyLedger.open(path, delta=DELTA, accountant="rdp", epsilon=3.0)
    for setting, value in [("delta", 1e-5), ("neighbourhood", "add_remove"),
                           ("accountant", "pld"), ("epsilon", 4.0)]:
        with pytest.raises(ValueError, match=f"{setting}=.*differs.*{setting}="):
            PrivacyLedger.open(path, **{setting: value})
    same = PrivacyLedger.open(path, delta=DELTA, neighbourhood="substitute", accountant="rdp",
                              epsilon=3)
    assert (same.delta, same.neighbourhood, same.accountant, same.budget) == (
        DELTA, "substitute", "rdp", 3.0)
    (tmp_path / "other.json").write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match="not a numpyro-dp privacy ledger"):
        PrivacyLedger.open(tmp_path / "other.json")


# ----------------------------------------------------------------- budget
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_charge_refuses_what_the_budget_cannot_pay(tmp_path, kind):
    budget = acc.epsilon_spent(gauss(iterations=25).event, DELTA)
    if kind == "memory":
        ledger = PrivacyLedger(DELTA, epsilon=budget)
    else:
        ledger = PrivacyLedger.open(tmp_path / "ledger.jsonl", delta=DELTA, epsilon=budget)
    assert ledger.charge(gauss(iterations=20)) < budget
    with pytest.raises(acc.PrivacyBudgetError, match="budget .*spent so far"):
        ledger.charge(gauss(iterations=6))
    with pytest.raises(acc.PrivacyBudgetError):  # a tighter budget for this call
        ledger.charge(gauss(iterations=5), budget=budget / 2)
    assert len(ledger.entries) == 1
    assert ledger.charge(gauss(iterations=5)) == ledger.epsilon() == budget
    with pytest.raises(acc.PrivacyBudgetError):
        ledger.charge(gauss(iterations=1))
    ledger.record(gauss(iterations=1))  # unchecked, as before
    assert len(ledger.entries) == 3
    assert "budget" in repr(ledger)


def test_a_charge_clearly_over_the_budget_is_refused_before_any_pld(tmp_path, monkeypatch):
    """Issue 36: the lower bound refuses under the lock without composing a PLD, and
    nothing is written; where it is inconclusive the charged figure decides."""
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(path, delta=1e-5, neighbourhood="add_remove", epsilon=8.0)
    ledger.charge(gauss(z=20.0))
    before = path.read_bytes()
    sampled = dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(2.0))
    sgd = LedgerEntry("DPSGLD", "sample", 4, 5000, sampled, dpa.SelfComposedDpEvent(sampled, 5000))

    def no_pld(*args):
        raise AssertionError("a PLD was composed")

    with monkeypatch.context() as patch:
        patch.setattr(acc.accountants, "_composed_pld", no_pld)
        with pytest.raises(acc.PrivacyBudgetError, match="to at least [0-9.]+ > budget 8 .*"
                           "spent so far: at most 0.16\\). Nothing was recorded"):
            ledger.charge(sgd)
    assert path.read_bytes() == before
    # 1000 releases: the bound (7.8) is below the budget, the charged figure (8.3) above.
    close = LedgerEntry("DPSGLD", "sample", 1, 1000, sampled,
                        dpa.SelfComposedDpEvent(sampled, 1000))
    assert lower_bound.epsilon_lower_bound(ledger.event([close]), 1e-5, "add_remove") < 8.0
    with pytest.raises(acc.PrivacyBudgetError, match="spent to 8.2[0-9]* > budget 8"):
        ledger.charge(close)
    assert path.read_bytes() == before


def test_a_stored_budget_holds_after_reopening(tmp_path):
    path = tmp_path / "ledger.jsonl"
    PrivacyLedger.open(path, delta=DELTA, epsilon=1.0).charge(gauss(z=5.0))
    ledger = PrivacyLedger.open(path)
    assert ledger.budget == 1.0 and str(path) in repr(ledger)
    before = path.read_bytes()
    with pytest.raises(acc.PrivacyBudgetError):
        ledger.charge(gauss(z=5.0))
    assert path.read_bytes() == before
    with pytest.raises(acc.PrivacyBudgetError):  # a larger budget cannot raise the stored one
        ledger.charge(gauss(z=5.0), budget=100.0)


# ------------------------------------------------------------- corruption
def edit_number(path):
    data = lines(path)
    data[2] = data[2].replace(b'"noise_multiplier":40.0', b'"noise_multiplier":400.0')
    return data, 3


def edit_header(path):
    data = lines(path)
    data[0] = data[0].replace(b'"epsilon":50.0', b'"epsilon":500.0')
    return data, 1


def delete_middle(path):
    data = lines(path)
    return data[:2] + data[3:], 3


def swap(path):
    data = lines(path)
    return [data[0], data[2], data[1], data[3]], 2


def append_garbage(path):
    return lines(path) + [b"not json\n"], 5


@pytest.mark.parametrize("tamper", [edit_number, edit_header, delete_middle, swap,
                                    append_garbage])
def test_tampering_is_detected(tmp_path, tamper):
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(path, delta=DELTA, epsilon=50.0)
    for z in (30.0, 40.0, 50.0):
        ledger.charge(gauss(z))
    data, line = tamper(path)
    assert data != lines(path)
    path.write_bytes(b"".join(data))
    message = f"line {line}: .*edited or corrupted.*restore it from a backup"
    with pytest.raises(ndp.LedgerCorruptedError, match=message):
        PrivacyLedger.open(path)
    with pytest.raises(ndp.LedgerCorruptedError, match=message):  # on every re-read
        ledger.epsilon()
    with pytest.raises(ndp.LedgerCorruptedError):
        ledger.charge(gauss())
    assert issubclass(ndp.LedgerCorruptedError, ValueError)


def test_a_torn_last_line_is_ignored_then_cut_off(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(path, delta=DELTA)
    ledger.charge(gauss(30.0))
    full = path.read_bytes()
    with open(path, "ab") as f:  # a writer killed mid-line
        f.write(lines(path)[1][:70])
    with pytest.warns(RuntimeWarning, match="incomplete line"):
        torn = PrivacyLedger.open(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        assert torn.entries == [gauss(30.0)]
        torn.charge(gauss(50.0))
        assert PrivacyLedger.open(path).entries == [gauss(30.0), gauss(50.0)]
    assert path.read_bytes().startswith(full) and path.read_bytes().endswith(b"\n")


def test_a_replaced_file_is_not_taken_for_the_opened_ledger(tmp_path):
    path, other = tmp_path / "ledger.jsonl", tmp_path / "other.jsonl"
    ledger = PrivacyLedger.open(path, delta=DELTA)
    PrivacyLedger.open(other, delta=DELTA)
    os.replace(other, path)
    with pytest.raises(ndp.LedgerCorruptedError, match="line 1: .*replaced"):
        ledger.charge(gauss())


# ------------------------------------------------- keys: edits with recomputed tags
def spent_ledger(path):
    """Budget 1: a release of epsilon 0.9 and a small run; what an analyst would edit."""
    ledger = PrivacyLedger.open(path, delta=DELTA, epsilon=1.0)
    mech.gaussian_mechanism(random.PRNGKey(0), 0.0, 1.0, epsilon=0.9, delta=DELTA, ledger=ledger)
    ledger.charge(gauss(z=50.0))
    assert 0.9 < ledger.epsilon() <= 1.0
    return ledger


def forge(path, tag):
    """Remove the 0.9 release, raise the budget to 100 and recompute every line's tag
    with ``tag(prev, canonical content)``: what a hand edit of the file can do."""
    records = [json.loads(line) for line in lines(path)]
    del records[1]
    records[0]["epsilon"] = 100.0
    prev, out = "0" * 64, []
    for record in records:
        content = {k: v for k, v in record.items() if k not in ("prev", "tag")}
        record = {**content, "prev": prev, "tag": tag(prev, json.dumps(
            content, sort_keys=True, separators=(",", ":"), ensure_ascii=False))}
        out.append(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
        prev = record["tag"]
    path.write_text("".join(out), "utf-8")


def sha256(prev, content):
    return hashlib.sha256((prev + content).encode("utf-8")).hexdigest()


def test_an_edit_with_recomputed_hashes_is_detected(tmp_path, ledger_keys):
    """The attack of issue 36 on the unkeyed chain: remove a 0.9-epsilon entry and raise
    the budget from 1 to 100, recomputing the SHA-256 chain.  It reopened without error;
    under a key it does not verify, whoever's tags were recomputed."""
    path = tmp_path / "ledger.jsonl"
    spent_ledger(path)
    original = path.read_bytes()
    forge(path, sha256)
    with pytest.raises(ndp.LedgerCorruptedError, match="line 1: its content does not match"):
        PrivacyLedger.open(path)
    # Tags under a key of the analyst's own: refused as edited, or as written with another key.
    other = LedgerKey.load(tmp_path / "other.key", create=True)
    path.write_bytes(original)
    forge(path, other.tag)
    with pytest.raises(ndp.LedgerCorruptedError, match="line 1: its content does not match"):
        PrivacyLedger.open(path)
    text = path.read_text("utf-8").replace(LedgerKey.load().id, other.id)
    path.write_text(text, "utf-8")
    forge(path, other.tag)
    with pytest.raises(ndp.LedgerKeyError, match=f"key id '{other.id}'.*has id "
                       f"'{LedgerKey.load().id}': pass the right key file"):
        PrivacyLedger.open(path)
    path.write_bytes(original)
    assert len(PrivacyLedger.open(path).entries) == 2


def test_with_the_key_the_seal_still_tells_then_nothing_does(tmp_path, ledger_keys):
    """The threat model's edge: the key forges tags, and this user's seal (what they
    last read) still reveals the edit; with the seals taken too, nothing does."""
    path = tmp_path / "ledger.jsonl"
    spent_ledger(path)
    ledger_id = json.loads(lines(path)[0])["id"]
    key = LedgerKey.load()
    forge(path, key.tag)
    with pytest.raises(ndp.LedgerCorruptedError, match="cut off its end"):
        PrivacyLedger.open(path)
    key.seal_path(ledger_id).unlink()
    forged = PrivacyLedger.open(path)  # undetectable: the analyst held the key
    assert forged.budget == 100.0 and forged.epsilon() < 0.1 and len(forged.entries) == 1


def test_lines_cut_off_or_a_restored_backup_are_detected(tmp_path, ledger_keys, monkeypatch):
    """Tags cannot reveal lines cut off the end; the seal of what this user last read can."""
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.open(path, delta=DELTA, epsilon=50.0)
    ledger.charge(gauss(30.0))
    backup = path.read_bytes()
    ledger.charge(gauss(40.0))
    latest = path.read_bytes()
    path.write_bytes(backup)  # cut short, or a backup restored over it: no key needed
    cut = "line 3: lines were cut off its end \\(it held 3 lines.*delete .*seals"
    with pytest.raises(ndp.LedgerCorruptedError, match=cut):
        PrivacyLedger.open(path)
    with pytest.raises(ndp.LedgerCorruptedError, match=cut):
        ledger.charge(gauss(40.0))
    # A copy charged by someone else (their own copy of the key, their own seals) is
    # as long as the ledger this user read, but its third line is another one.
    other = tmp_path / "other-user" / "ledger.key"
    other.parent.mkdir()
    shutil.copy2(ledger_keys / "ledger.key", other)
    monkeypatch.setenv("NUMPYRO_DP_KEY_FILE", str(other))
    PrivacyLedger.open(path).charge(gauss(50.0))
    monkeypatch.delenv("NUMPYRO_DP_KEY_FILE")
    with pytest.raises(ndp.LedgerCorruptedError, match="line 3: it is not the line this user "
                       "last read there .*rolled back"):
        PrivacyLedger.open(path)
    path.write_bytes(latest)
    assert PrivacyLedger.open(path).entries == [gauss(30.0), gauss(40.0)]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_key_others_can_read_or_write_is_refused(tmp_path, ledger_keys, mode):
    path = tmp_path / "ledger.jsonl"
    PrivacyLedger.open(path, delta=DELTA)
    key = ledger_keys / "ledger.key"
    os.chmod(key, mode)
    with pytest.raises(ndp.LedgerKeyError, match=f"mode {mode:04o}.*chmod 600 {key}"):
        PrivacyLedger.open(path)
    os.chmod(key, 0o600)
    PrivacyLedger.open(path)


def test_the_key_is_made_once_private_and_found_where_documented(tmp_path, ledger_keys,
                                                                  monkeypatch):
    assert default_key_path() == ledger_keys / "ledger.key"
    assert not ledger_keys.exists()  # made on first use
    first = PrivacyLedger.open(tmp_path / "a.jsonl", delta=DELTA)
    key = ledger_keys / "ledger.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(ledger_keys.stat().st_mode) == 0o700
    assert len(bytes.fromhex(key.read_text())) == 32
    before = key.read_bytes()
    PrivacyLedger.open(tmp_path / "b.jsonl", delta=DELTA)  # the same key, not a new one
    assert key.read_bytes() == before and repr(first._file.key).count(before.hex()[:8]) == 0
    # Made concurrently, one key wins and every caller reads it.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: LedgerKey.load(tmp_path / "race.key", create=True).id,
                           range(16)))
    assert len(ids) == 1
    # $NUMPYRO_DP_KEY_FILE, then key_file=, name other keys.
    monkeypatch.setenv("NUMPYRO_DP_KEY_FILE", str(tmp_path / "team.key"))
    team = PrivacyLedger.open(tmp_path / "team.jsonl", delta=DELTA)
    assert (tmp_path / "team.key").exists()
    monkeypatch.delenv("NUMPYRO_DP_KEY_FILE")
    with pytest.raises(ndp.LedgerKeyError, match="key id .* pass the right key file"):
        PrivacyLedger.open(team.path)
    again = PrivacyLedger.open(team.path, key_file=tmp_path / "team.key")
    assert again.entries == []
    with pytest.raises(ndp.LedgerKeyError, match="no ledger key at .*missing.key.*key_file="):
        PrivacyLedger.open(team.path, key_file=tmp_path / "missing.key")
    (tmp_path / "bad.key").write_text("not hex\n")
    os.chmod(tmp_path / "bad.key", 0o600)
    with pytest.raises(ndp.LedgerKeyError, match="not a numpyro-dp ledger key"):
        PrivacyLedger.open(team.path, key_file=tmp_path / "bad.key")


@pytest.mark.parametrize("version", [1, 2])
def test_a_ledger_of_an_earlier_version_is_refused_clearly(tmp_path, version):
    """Version 2 entries did not say what they protect (a row or a unit, issue 40)."""
    path = tmp_path / "old.jsonl"
    header = {"format": "numpyro-dp-ledger", "version": version, "delta": DELTA,
              "neighbourhood": "substitute", "accountant": "auto", "epsilon": None,
              "created": "2025-01-01T00:00:00+00:00", "prev": "0" * 64, "hash": "0" * 64}
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(ValueError,
                       match=f"format version {version}; .*reads version 3.*new ledger"):
        PrivacyLedger.open(path)


def test_runs_and_releases_pay_from_a_stored_budget_across_sessions(tmp_path):
    """PrivateMCMC charges a file ledger before running; a later session (a new
    ledger object, runner and kernel) cannot spend the budget again."""
    path = tmp_path / "ledger.jsonl"
    X, y = make_logistic_data(200, 2)

    def session(num_samples, epsilon=None):
        ledger = PrivacyLedger.open(path, delta=1e-5, epsilon=1.0)
        kernel = ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=30.0)
        mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=num_samples, ledger=ledger,
                               epsilon=epsilon, progress_bar=False)
        mcmc.run(random.PRNGKey(0), X, y)
        return ledger, mcmc

    ledger, mcmc = session(20)
    assert mcmc.epsilon == 1.0 and len(ledger.entries) == 1
    assert PrivacyLedger.open(path).epsilon() == mcmc.privacy_spent().epsilon < 1.0
    with pytest.raises(ndp.PrivacyBudgetError, match="affords"):
        session(200)
    with pytest.raises(ndp.PrivacyBudgetError):  # a tighter budget of this run
        session(20, epsilon=mcmc.privacy_spent().epsilon)
    with pytest.raises(ndp.PrivacyBudgetError):
        mech.gaussian_mechanism(random.PRNGKey(1), X.sum(0), mech.sum_sensitivity(1.0),
                                noise_multiplier=1.0, ledger=ledger)
    assert len(PrivacyLedger.open(path).entries) == 1


# ------------------------------------------------------------ concurrency
WORKER = """
    import sys
    from dp_accounting import GaussianDpEvent
    from numpyro_dp import PrivacyBudgetError, PrivacyLedger
    from numpyro_dp.accounting.entry import LedgerEntry
    ledgers = [PrivacyLedger.open(p) for p in sys.argv[1:]]
    print("ready", flush=True)
    sys.stdin.readline()
    refused = 0
    for i in range(10):
        for ledger in ledgers:
            try:
                ledger.charge(LedgerEntry("W", "sample", 1, 1, GaussianDpEvent(32.0)))
            except PrivacyBudgetError:
                refused += 1
    print(refused)
"""


@pytest.mark.slow  # make test-all: keeps make test under 10 minutes on 2 cores
def test_concurrent_writers_lose_nothing_and_never_overspend(tmp_path):
    free, capped = tmp_path / "free.jsonl", tmp_path / "capped.jsonl"
    affordable = 25
    budget = acc.epsilon_spent(gauss(iterations=affordable).event, DELTA)
    PrivacyLedger.open(free, delta=DELTA)
    PrivacyLedger.open(capped, delta=DELTA, epsilon=budget)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), str(free),
                               str(capped)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:
        assert p.stdout.readline() == "ready\n", p.stderr.read()
    for p in procs:  # start together
        p.stdin.write("go\n")
        p.stdin.flush()
    refused = 0
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        refused += int(stdout)
    ids = [json.loads(line)["id"] for line in lines(free)[1:]]
    assert len(ids) == len(set(ids)) == 40
    assert len(PrivacyLedger.open(free).entries) == 40
    capped_ledger = PrivacyLedger.open(capped)
    assert len(capped_ledger.entries) == affordable and refused == 40 - affordable
    assert capped_ledger.epsilon() == budget


def test_a_killed_process_leaves_its_charge_exactly_once(tmp_path):
    path = tmp_path / "ledger.jsonl"
    PrivacyLedger.open(path, delta=DELTA)
    proc = run_python(f"""
        import time
        from dp_accounting import GaussianDpEvent
        from numpyro_dp import PrivacyLedger
        from numpyro_dp.accounting.entry import LedgerEntry
        PrivacyLedger.open({str(path)!r}).charge(
            LedgerEntry("DPPenalty", "sample", 1, 1, GaussianDpEvent(32.0)))
        time.sleep(120)  # the iterations the charge paid for
    """)
    deadline = time.monotonic() + 120
    while not PrivacyLedger.open(path).entries:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert PrivacyLedger.open(path).entries == [gauss()]


# --------------------------------------------------------------- in memory
def test_in_memory_ledgers_are_as_before():
    ledger = PrivacyLedger(DELTA)
    assert (ledger.neighbourhood, ledger.accountant, ledger.budget, ledger.path) == (
        "substitute", "auto", None, None)
    entries = ledger.entries
    entries.append(gauss())  # a copy
    assert ledger.entries == [] and ledger.spent().epsilon == 0.0
    ledger.record(gauss())
    assert ledger.charge(gauss(z=20.0)) == ledger.epsilon()
    assert ledger.entries == [gauss(), gauss(z=20.0)]
    with pytest.raises(ValueError, match="epsilon"):
        PrivacyLedger(DELTA, epsilon=0.0)
    entry = gauss(label="x", reproducible_noise=True)
    assert entry.to_dict()["label"] == "x" and entry.to_dict()["reproducible_noise"] is True
    assert [f.name for f in dataclasses.fields(LedgerEntry)][:6] == [
        "kernel", "phase", "num_chains", "num_iterations", "per_iteration", "chain_event"]
    assert acc.PrivacyLedger is PrivacyLedger and acc.LedgerEntry is LedgerEntry


def test_ledgers_pickle_without_their_key(tmp_path, ledger_keys):
    memory = PrivacyLedger(DELTA, epsilon=2.0)
    memory.charge(gauss())
    file = PrivacyLedger.open(tmp_path / "ledger.jsonl", delta=DELTA)
    file.charge(gauss())
    secret = (ledger_keys / "ledger.key").read_text().strip()
    data = pickle.dumps(file)
    assert secret.encode() not in data and bytes.fromhex(secret) not in data
    assert secret not in repr(file) + repr(file._file.key)
    for ledger in (memory, file):
        copy = pickle.loads(pickle.dumps(ledger))
        assert copy.entries == ledger.entries and copy.path == ledger.path
        copy.charge(gauss())
    assert len(memory.entries) == 1 and len(file.entries) == 2  # the copy shares the file


def test_file_ledgers_need_posix_locks(tmp_path, monkeypatch):
    monkeypatch.setattr("numpyro_dp.accounting.ledger.FILE_LOCKING", False)
    with pytest.raises(NotImplementedError, match="fcntl"):
        PrivacyLedger.open(tmp_path / "ledger.jsonl", delta=DELTA)
    assert not (tmp_path / "ledger.jsonl").exists()
