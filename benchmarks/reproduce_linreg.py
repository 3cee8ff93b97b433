"""Reproduce paper 002 s7.2-7.3: DP Bayesian linear regression from released statistics.

Simulated (s7.2): n rows, d = 2 and 5, x ~ N(0, Sigma_x), Sigma_x ~ IW(V^T V, d + 1),
theta ~ N(0, I), sigma_y = 1; test MSE of the posterior predictive mean and MMD of
theta draws to the non-private posterior, for fixedS, normalX (NUTS), fast and
adaSSP over an epsilon grid.  Real (s7.3, Table 7.1): scikit-learn's bundled
diabetes data (stand-in for the UCI sets, which need a download), 80/20 splits,
epsilon = 1, J = 1 and 5 holders.

Every finished (experiment, setting, run, epsilon, method) row is appended to
``docs/results/linreg_{sim,real}.csv``; a restart skips the rows already there.
``--report`` only redraws the figures and tables from the CSVs.

    python benchmarks/reproduce_linreg.py            # the paper's size: 50 runs
    python benchmarks/reproduce_linreg.py --quick    # a few runs, short chains
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import time

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.infer import MCMC, NUTS
from scipy.stats import chi2, invwishart

from numpyro_dp import linreg as lr
from numpyro_dp.diagnostics import mmd

OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "results"
FIELDS = ["experiment", "setting", "run", "epsilon", "method", "test_mse", "mmd", "seconds"]
METHODS = ("fixedS", "normalX", "fast", "adaSSP")
# diabetes (Efron et al. 2004): a-priori ranges of the raw columns from clinical
# knowledge, not from the data: age, sex code, BMI, mean arterial pressure,
# total cholesterol, LDL, HDL, total/HDL ratio, log triglycerides, glucose; and
# the one-year progression score.
DIABETES_RANGES = [(0, 100), (1, 2), (10, 60), (40, 160), (50, 400), (0, 300), (0, 150),
                   (0, 15), (2, 7), (40, 200)]
DIABETES_Y_RANGE = (0, 400)


# -------------------------------------------------------------------- data
def simulate(rng, n, d, n_test):
    V = rng.normal(size=(d, d))
    sigma_x = invwishart.rvs(df=d + 1, scale=V.T @ V, random_state=rng)
    theta = rng.normal(size=d)
    X = rng.multivariate_normal(np.zeros(d), sigma_x, size=n + n_test)
    y = X @ theta + rng.normal(size=n + n_test)
    # a-priori bounds from the population (Sigma_x, theta), never the sample:
    # 99.9% quantiles of ||x|| (bounded via lambda_max) and of |y|
    x_bound = math.sqrt(chi2.ppf(0.999, d) * np.linalg.eigvalsh(sigma_x)[-1])
    y_bound = 3.3 * math.sqrt(theta @ sigma_x @ theta + 1.0)
    return X[:n], y[:n], X[n:], y[n:], x_bound, y_bound


def diabetes():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True, scaled=False)
    lo, hi = np.array(DIABETES_RANGES, float).T
    Xs = np.clip(2 * (X - lo) / (hi - lo) - 1, -1, 1)  # public ranges to [-1, 1]
    ys = np.clip(2 * (y - DIABETES_Y_RANGE[0]) / np.ptp(DIABETES_Y_RANGE) - 1, -1, 1)
    Xs = np.hstack([Xs, np.ones((len(Xs), 1))])  # intercept column
    return Xs, ys, math.sqrt(Xs.shape[1]) * 1.0001, 1.0001


# -------------------------------------------------------- non-private truth
def _exact_model(S, z, yy, n, prior):
    theta = numpyro.sample("theta", dist.MultivariateNormal(prior.mean, prior.cov))
    s2 = numpyro.sample("sigma_y2", dist.InverseGamma(prior.a, prior.b))
    rss = yy - 2 * theta @ z + theta @ S @ theta
    numpyro.factor("lik", -n / 2 * jnp.log(s2) - rss / (2 * s2))


def nonprivate_theta(key, X, y, prior, num_samples):
    mcmc = MCMC(NUTS(_exact_model), num_warmup=500, num_samples=num_samples, progress_bar=False)
    mcmc.run(key, X.T @ X, X.T @ y, y @ y, len(y), prior)
    return np.asarray(mcmc.get_samples()["theta"])


# -------------------------------------------------------------------- runs
def run_methods(key, X, y, X_test, y_test, x_bound, y_bound, eps, delta, J, prior, ref, args):
    """Yield (method, test_mse, mmd, seconds) for every method at one epsilon."""
    k_rel, k_fit, k_ada, k_draw = random.split(key, 4)
    rel = lr.release_linreg_stats(k_rel, X, y, x_bound=x_bound, y_bound=y_bound,
                                  epsilon=eps, delta=delta, num_holders=J, clip=True)
    for method in METHODS:
        t = time.perf_counter()
        if method == "adaSSP":
            theta = lr.adassp(k_ada, X, y, x_bound=x_bound, y_bound=y_bound, epsilon=eps,
                              delta=delta, num_holders=J, clip=True).value[None]
        elif method == "fast":
            theta = lr.fast_posterior(rel, prior).sample(k_draw, args.samples)
        else:
            mcmc = lr.fit(k_fit, rel, method, prior, num_warmup=args.warmup,
                          num_samples=args.samples)
            theta = np.asarray(mcmc.get_samples()["theta"])
        secs = time.perf_counter() - t
        mse = float(np.mean((X_test @ theta.mean(0) - y_test) ** 2))
        dist_ = mmd(theta, ref) if ref is not None and len(theta) > 1 else math.nan
        yield method, mse, dist_, secs


def done_keys(path):
    if not path.exists():
        return set()
    with path.open() as f:
        return {(r["setting"], r["run"], r["epsilon"]) for r in csv.DictReader(f)
                if r["method"] == METHODS[-1]}


def append(path, rows):
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)


def simulated(args):
    path = OUT / "linreg_sim.csv"
    done = done_keys(path)
    for d in args.dims:
        prior = lr.LinRegPrior.default(d)
        for run in range(args.runs):
            todo = [e for e in args.eps if (f"d={d}", str(run), str(e)) not in done]
            if not todo:
                continue
            rng = np.random.default_rng(1000 * d + run)
            X, y, Xt, yt, bx, by = simulate(rng, args.n, d, 2000)
            key = random.PRNGKey(1000 * d + run)
            ref = nonprivate_theta(key, X, y, prior, args.samples)
            for eps in todo:
                rows = [dict(experiment="sim", setting=f"d={d}", run=run, epsilon=eps,
                             method=m, test_mse=mse, mmd=dd, seconds=s)
                        for m, mse, dd, s in run_methods(
                            random.fold_in(key, int(eps * 1000)), X, y, Xt, yt, bx, by, eps,
                            0.1 / args.n, 1, prior, ref, args)]
                append(path, rows)
                print(f"sim d={d} run={run} eps={eps}: "
                      + ", ".join(f"{r['method']} {r['test_mse']:.4g}" for r in rows), flush=True)


def real(args):
    path = OUT / "linreg_real.csv"
    done = done_keys(path)
    X, y, bx, by = diabetes()
    prior = lr.LinRegPrior.default(X.shape[1])
    for J in args.holders:
        for run in range(args.runs):
            if (f"diabetes J={J}", str(run), "1.0") in done:
                continue
            rng = np.random.default_rng(run)
            perm = rng.permutation(len(X))
            tr, te = perm[: int(0.8 * len(X))], perm[int(0.8 * len(X)):]
            rows = [dict(experiment="real", setting=f"diabetes J={J}", run=run, epsilon=1.0,
                         method=m, test_mse=mse, mmd=dd, seconds=s)
                    for m, mse, dd, s in run_methods(
                        random.PRNGKey(run), X[tr], y[tr], X[te], y[te], bx, by, 1.0,
                        0.1 / len(tr), J, prior, None, args)]
            append(path, rows)
            print(f"real J={J} run={run}: "
                  + ", ".join(f"{r['method']} {r['test_mse']:.4g}" for r in rows), flush=True)


# ------------------------------------------------------------------ report
def load(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def figures():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(OUT / "linreg_sim.csv")
    settings = sorted({r["setting"] for r in rows})
    fig, axes = plt.subplots(2, len(settings), figsize=(5 * len(settings), 7), squeeze=False)
    for col, s in enumerate(settings):
        for m in METHODS:
            sel = [r for r in rows if r["setting"] == s and r["method"] == m]
            eps = sorted({float(r["epsilon"]) for r in sel})
            for row, metric in enumerate(("test_mse", "mmd")):
                vals = [[float(r[metric]) for r in sel if float(r["epsilon"]) == e] for e in eps]
                runs = min(len(v) for v in vals)
                if not all(math.isnan(x) for v in vals for x in v):
                    axes[row, col].plot(eps, [np.mean(v) for v in vals], "o-", label=m)
                axes[row, col].set(xscale="log", yscale="log", xlabel="epsilon", ylabel=metric,
                                   title=f"{s}, n = 1e5, {runs} runs")
        axes[0, col].legend()
    fig.tight_layout()
    fig.savefig(OUT / "linreg_sim.png", dpi=110)

    lines = ["| setting | method | runs | mean test MSE | 90% CI of the mean |",
             "|---|---|---|---|---|"]
    for r0 in sorted({(r["setting"], r["method"]) for r in load(OUT / "linreg_real.csv")}):
        v = np.array([float(r["test_mse"]) for r in load(OUT / "linreg_real.csv")
                      if (r["setting"], r["method"]) == r0])
        half = 1.645 * v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        lines.append(f"| {r0[0]} | {r0[1]} | {len(v)} | {v.mean():.4f} | "
                     f"[{v.mean() - half:.4f}, {v.mean() + half:.4f}] |")
    (OUT / "linreg_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 runs, short chains, 4 epsilons")
    p.add_argument("--report", action="store_true", help="only redraw figures and tables")
    p.add_argument("--runs", type=int)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--only", choices=("sim", "real"), help="run one experiment")
    p.add_argument("--dims", type=int, nargs="+", default=[2, 5])
    p.add_argument("--holders", type=int, nargs="+", default=[1, 5])
    args = p.parse_args()
    if args.quick:
        args.runs = args.runs or 3
        args.eps, args.warmup, args.samples = (0.1, 0.5, 2.0, 10.0), 300, 500
    else:
        args.runs = args.runs or 50
        args.eps, args.warmup, args.samples = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0), 1000, 1000
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.report:
        if args.only != "sim":
            real(args)
        if args.only != "real":
            simulated(args)
    figures()


if __name__ == "__main__":
    main()
