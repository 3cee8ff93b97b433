"""Simulation-based calibration of ``ndp.NoiseAwareNUTS`` over models, epsilons and n.

SPEC s12's calibration test as a grid: for each model (logistic, Poisson,
linear-Gaussian with sigma, random intercepts over 12 groups), epsilon and n,
``ndp.evaluation.sbc`` draws parameters from the prior and outcomes from the
model on fixed public covariates (uniform on [-1, 1]^2, group labels in turn),
runs the route on each simulated data set, and reports the rank histograms'
chi-square p-values (5 bins; passed when every one exceeds 0.01 / coordinates)
and the coverage of the 50% and 90% intervals with Monte Carlo standard errors
(passed within 3).  ``CalibrationWarning`` runs are counted (the coverage includes
them; a column gives the 90% coverage without them), and refused ones
(``UnusableReleaseError``: no draws, left out of the ranks).  With ``--nuts``, NUTS
on the same simulated rows (``ndp.evaluation.nuts_route``, not private) gives the
yardstick's 90% coverage: a finite set of simulations can make the exact
posterior cover too rarely as well.

Run (hours on two cores at the defaults; one cell takes 100 runs)::

    python benchmarks/sbc_grid.py --out docs/results/sbc_grid
    python benchmarks/sbc_grid.py --models logistic --n 2000 --epsilons 3 --simulations 40
    python benchmarks/sbc_grid.py --models linear --n 20000 --epsilons 10 --nuts
"""

from __future__ import annotations

import argparse
import csv
import time
from math import nan
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import numpyro_dp as ndp

DELTA = 1e-6
GROUPS = 12


def logistic(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + X @ w), obs=y)


def poisson(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 0.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b0 + X @ w)), obs=y)


def linear(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(b0 + X @ w, sigma), obs=y)


def intercepts(X, g, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("groups", GROUPS):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] + X @ w, sigma), obs=y)


MODELS = {"logistic": logistic, "poisson": poisson, "linear": linear,
          "intercepts": intercepts}


def covariates(model_name: str, n: int) -> tuple:
    X = np.random.default_rng(0).uniform(-1, 1, size=(n, 2)).astype(np.float32)
    if model_name == "intercepts":
        return X, np.arange(n) % GROUPS
    return (X,)


def write(rows: list, out: Path) -> None:
    """The grid's rows so far as ``out``.csv and a markdown table ``out``.md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def pct(x):
        return "-" if x != x else f"{x:.1%}"  # NaN: no run to count

    lines = [f"| {r['model']} | {r['n']} | {r['epsilon']:g} | {r['simulations']} | "
             f"{pct(r['coverage50'])} ({pct(r['se50'])}) | {pct(r['coverage90'])} "
             f"({pct(r['se90'])}) | {r['min_p_value']:.3g} ({r['coordinates']}) | "
             f"{r['warned']} | {pct(r['unwarned90'])} | {pct(r.get('nuts90', nan))} | "
             f"{r['refused']} | "
             f"{'refused' if r['passed'] is None else 'yes' if r['passed'] else 'NO'} |"
             for r in rows]
    out.with_suffix(".md").write_text(
        "| model | n | epsilon | simulations | 50% coverage (se) | 90% coverage (se) | "
        "smallest rank p (coordinates) | CalibrationWarnings | 90% coverage unwarned | "
        "NUTS 90% (same simulations) | refused | passed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/sbc_grid")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--n", type=int, nargs="*", default=[2000, 20000])
    parser.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 3.0, 10.0])
    parser.add_argument("--simulations", type=int, default=100)
    parser.add_argument("--nuts", action="store_true",
                        help="also NUTS's 90%% coverage on the same simulations")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        model = MODELS[name]
        for n in args.n:
            for eps in args.epsilons:
                route = ndp.evaluation.noise_aware_route(model, eps, DELTA)
                t0 = time.perf_counter()
                try:
                    result = ndp.evaluation.sbc(route, model, *covariates(name, n),
                                                num_simulations=args.simulations)
                except ValueError as err:  # every simulation refused (a budget too small)
                    print({"model": name, "n": n, "epsilon": eps, "refused": str(err)})
                    rows.append({"model": name, "n": n, "epsilon": eps,
                                 "simulations": args.simulations, "passed": None,
                                 "coverage50": nan, "se50": nan, "coverage90": nan,
                                 "se90": nan, "min_p_value": nan, "coordinates": 0,
                                 "warned": 0, "unwarned90": nan, "refused": args.simulations,
                                 "nuts90": nan, "wall_s": time.perf_counter() - t0})
                    write(rows, Path(args.out))
                    continue
                row = {"model": name, "n": n, "epsilon": eps,
                       "simulations": args.simulations, "passed": result.passed,
                       "coverage50": result.coverage[0.5], "se50": result.coverage_se[0.5],
                       "coverage90": result.coverage[0.9], "se90": result.coverage_se[0.9],
                       "min_p_value": float(result.p_values.min()),
                       "coordinates": len(result.names), "warned": result.warned,
                       "unwarned90": result.unwarned_coverage[0.9],
                       "refused": result.refused,
                       "nuts90": nan, "wall_s": time.perf_counter() - t0}
                if args.nuts:
                    row["nuts90"] = ndp.evaluation.sbc(
                        ndp.evaluation.nuts_route(model), model, *covariates(name, n),
                        num_simulations=args.simulations).coverage[0.9]
                print(row, flush=True)
                rows.append(row)
                write(rows, Path(args.out))  # each cell as it ends: a long grid can stop


if __name__ == "__main__":
    main()
