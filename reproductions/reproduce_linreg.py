"""Reproduce paper 002 s7.2-7.3: DP Bayesian linear regression from released statistics.

Simulated (s7.2): n rows, d = 2 and 5, x ~ N(0, Sigma_x), Sigma_x ~ IW(V^T V, d + 1),
theta ~ N(0, I), sigma_y = 1; test MSE of the posterior predictive mean and MMD of
theta draws to the non-private posterior, for fixedS, normalX (NUTS), fast and
adaSSP over an epsilon grid.  Real (s7.3, Table 7.1): scikit-learn's bundled
diabetes data (stand-in for the UCI sets, which need a download), 80/20 splits,
epsilon = 1, J = 1 and 5 holders.

Every finished (experiment, setting, run, epsilon, method) row is appended to
``docs/results/linreg_{sim,real}.csv`` (with ``--shard I/K``: to
``linreg_{sim,real}.shard{I}.csv``); a restart skips the rows already in any of
them.  ``--report`` merges the shard files into ``linreg_{sim,real}.csv`` and
redraws the figures and tables.

Each NUTS model is compiled once per (method, d, J) configuration and process
(:class:`CompiledNUTS`): data, release and epsilon are traced arguments, so
later runs and epsilons reuse the executable.

    python reproductions/reproduce_linreg.py            # the paper's size: 50 runs
    python reproductions/reproduce_linreg.py --quick    # a few runs, short chains
    bash reproductions/run_linreg_sharded.sh 16         # 16 single-threaded shards
"""

from __future__ import annotations

import os
import sys

if any(a == "--shard" or a.startswith("--shard=") for a in sys.argv):
    # one shard = one core: set before jax is imported
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                       "intra_op_parallelism_threads=1")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax, random  # noqa: E402
from numpyro.distributions.transforms import biject_to  # noqa: E402
from numpyro.infer.hmc import hmc  # noqa: E402
from numpyro.infer.util import initialize_model  # noqa: E402
from results_csv import append, load  # noqa: E402
from scipy.stats import chi2, invwishart  # noqa: E402

from numpyro_dp.evaluation.diagnostics import mmd  # noqa: E402
from numpyro_dp.releases import linreg as lr  # noqa: E402

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


# ------------------------------------------------------- compiled NUTS
class CompiledNUTS:
    """NUTS on one model, jit-compiled once and reused for new data.

    ``MCMC.run`` with ``jit_model_args=True`` still recompiles its sampling
    loop on every call (numpyro 0.22 keys that cache on a fresh closure), so
    this runs NumPyro's functional ``hmc(..., algo="NUTS")`` kernel in one
    ``jax.jit``: warm-up (step size and mass matrix adaptation) and sampling,
    with the model arguments and the initial values traced.  Arguments whose
    shapes fix the program (d, J, the row counts) must be bound in ``model``.
    Sites missing from ``init`` start uniformly in (-2, 2) on the unconstrained
    scale (NumPyro's ``init_to_uniform``).
    """

    def __init__(self, model, example_args, num_warmup, num_samples, dense_mass=True,
                 max_tree_depth=10):
        _, pot_gen, _, trace = initialize_model(random.PRNGKey(0), model,
                                                model_args=example_args, dynamic_args=True)
        self.tf = {k: biject_to(s["fn"].support) for k, s in trace.items()
                   if s["type"] == "sample" and not s["is_observed"]}
        self.shape = {k: jnp.shape(t.inv(trace[k]["value"])) for k, t in self.tf.items()}
        init_kernel, sample_kernel = hmc(potential_fn_gen=pot_gen, algo="NUTS")

        def run(key, init, args):
            k_init, k_run = random.split(key)
            z = {}
            for i, (name, t) in enumerate(sorted(self.tf.items())):
                z[name] = (t.inv(init[name]) if name in init else random.uniform(
                    random.fold_in(k_init, i), self.shape[name], minval=-2.0, maxval=2.0))
            state = init_kernel(z, num_warmup, dense_mass=dense_mass, model_args=args,
                                max_tree_depth=max_tree_depth, rng_key=k_run)
            state = lax.fori_loop(0, num_warmup,
                                  lambda _, st: sample_kernel(st, model_args=args), state)

            def step(st, _):
                st = sample_kernel(st, model_args=args)
                return st, st.z

            _, zs = lax.scan(step, state, None, length=num_samples)
            return {name: jax.vmap(t)(zs[name]) for name, t in self.tf.items()}

        self._run = jax.jit(run)

    @staticmethod
    def _prepare(args, init):
        return jax.tree.map(jnp.asarray, args), jax.tree.map(jnp.asarray, init or {})

    def __call__(self, key, args, init=None):
        args, init = self._prepare(args, init)
        return {k: np.asarray(v) for k, v in self._run(key, init, args).items()}

    def compile(self, args, init=None):
        """Compile only (fills JAX's persistent cache when one is configured)."""
        args, init = self._prepare(args, init)
        self._run.lower(random.PRNGKey(0), init, args).compile()


class Samplers:
    """One :class:`CompiledNUTS` per (model, d, J, rows) configuration."""

    def __init__(self, args):
        self.args, self.cache = args, {}

    def get(self, config, model, example_args, num_warmup, num_samples, dense_mass=True,
            max_tree_depth=10):
        if config not in self.cache:
            self.cache[config] = CompiledNUTS(model, example_args, num_warmup, num_samples,
                                              dense_mass, max_tree_depth)
        return self.cache[config]


# -------------------------------------------------------- non-private truth
def exact_job(X, y, prior, samplers):
    args = (X.T @ X, X.T @ y, float(y @ y), float(len(y)), prior)
    nuts = samplers.get(("exact", X.shape[1]), lr.exact_model, args, 500, samplers.args.samples,
                        dense_mass=False)
    return nuts, args, None


def nonprivate_theta(key, X, y, prior, samplers):
    nuts, args, _ = exact_job(X, y, prior, samplers)
    return nuts(key, args)["theta"]


# -------------------------------------------------------------------- runs
def nuts_job(rel, method, prior, samplers):
    """``lr.fit``'s model, initial values and NUTS settings, compiled once per config.

    normalX may get shorter chains and a lower maximum tree depth
    (``--nx-warmup``, ``--nx-samples``, ``--nx-max-tree-depth``).
    """
    S_psd = lr.nearest_psd(rel.S_hat)
    init = {"theta": lr.fast_posterior(rel, prior).mean}
    J, d = rel.S_hat.shape[:2]
    if method == "fixedS":
        model, args = lr.fixed_s_model, (S_psd, rel.z_hat, rel.sigma, prior)
    else:
        w, V = np.linalg.eigh(S_psd)
        init["S"] = (V * np.maximum(w, rel.sigma)[..., None, :]) @ np.swapaxes(V, 1, 2)
        n_rows = rel.n_rows

        def model(S_hat, z_hat, sigma, prior):
            lr.normal_x_model(S_hat, z_hat, n_rows, sigma, prior)

        args = (rel.S_hat, rel.z_hat, rel.sigma, prior)
    a = samplers.args
    chains = ((a.warmup, a.samples, 10) if method == "fixedS"
              else (a.nx_warmup, a.nx_samples, a.nx_max_tree_depth))
    config = (method, d, J, tuple(int(r) for r in rel.n_rows))
    return samplers.get(config, model, args, *chains), args, init


def fit_nuts(key, rel, method, prior, samplers):
    nuts, args, init = nuts_job(rel, method, prior, samplers)
    return nuts(key, args, init)["theta"]


def real_split(X, run):
    perm = np.random.default_rng(run).permutation(len(X))
    return perm[: int(0.8 * len(X))], perm[int(0.8 * len(X)):]


def precompile(args):
    """Compile every NUTS configuration this invocation would run (every K-th with --shard).

    With ``JAX_COMPILATION_CACHE_DIR`` set the executables land in JAX's
    persistent cache, so the shards that follow load them instead of each
    compiling all ten (about 10-20 s each, single-threaded).
    """
    samplers, jobs = Samplers(args), []
    for exp, setting, _ in units(args, shard=False):
        if exp == "sim" and (exp, setting) not in {j[0] for j in jobs}:
            d = setting
            X, y, _, _, bx, by = simulate(np.random.default_rng(0), args.n, d, 1)
            prior, J, delta = lr.LinRegPrior.paper(d), 1, 0.1 / args.n
            jobs.append(((exp, setting), "exact", lambda X=X, y=y, p=prior: exact_job(
                X, y, p, samplers)))
        elif exp == "real" and (exp, setting) not in {j[0] for j in jobs}:
            X, y, bx, by = diabetes()
            tr, _ = real_split(X, 0)
            X, y, J = X[tr], y[tr], setting
            prior, delta = lr.LinRegPrior.paper(X.shape[1]), 0.1 / len(tr)
        else:
            continue
        rel = lr.release_linreg_stats(random.PRNGKey(0), *holders(X, y, J), x_bound=bx,
                                      y_bound=by, epsilon=1.0, delta=delta, with_yty=False)
        for m in ("fixedS", "normalX"):
            jobs.append(((exp, setting), m, lambda r=rel, m=m, p=prior: nuts_job(
                r, m, p, samplers)))
    for (exp, setting), m, job in jobs[args.shard_index::args.shard_count]:
        t = time.perf_counter()
        nuts, a, init = job()
        nuts.compile(a, init)
        print(f"compiled {exp} {setting} {m}: {time.perf_counter() - t:.1f}s", flush=True)


def holders(X, y, J):
    """The rows split into J data holders' consecutive blocks (lists of X_j and y_j)."""
    return list(np.array_split(X, J)), list(np.array_split(y, J))


def run_methods(key, X, y, X_test, y_test, x_bound, y_bound, eps, delta, J, prior, ref,
                samplers, methods=METHODS):
    """Yield (method, test_mse, mmd, seconds) for every method at one epsilon."""
    k_rel, k_fit, k_ada, k_draw = random.split(key, 4)
    # the paper's release: X^T X and X^T y only
    rel = lr.release_linreg_stats(k_rel, *holders(X, y, J), x_bound=x_bound, y_bound=y_bound,
                                  epsilon=eps, delta=delta, with_yty=False)
    for method in methods:
        t = time.perf_counter()
        if method == "adaSSP":
            theta = lr.adassp(k_ada, *holders(X, y, J), x_bound=x_bound, y_bound=y_bound,
                              epsilon=eps, delta=delta).value[None]
        elif method == "fast":
            theta = lr.fast_posterior(rel, prior).sample(k_draw, samplers.args.samples)
        else:
            theta = fit_nuts(k_fit, rel, method, prior, samplers)
        secs = time.perf_counter() - t
        mse = float(np.mean((X_test @ theta.mean(0) - y_test) ** 2))
        dist_ = mmd(theta, ref) if ref is not None and len(theta) > 1 else math.nan
        yield method, mse, dist_, secs


# ------------------------------------------------------------ bookkeeping
def csv_files(out, exp):
    """The merged CSV of one experiment and its shard files."""
    return [out / f"linreg_{exp}.csv", *sorted(out.glob(f"linreg_{exp}.shard*.csv"))]


def done_keys(out, exp):
    """(setting, run, epsilon) whose last method is in the merged or any shard CSV."""
    return {(r["setting"], r["run"], r["epsilon"]) for p in csv_files(out, exp)
            for r in load(p) if r["method"] == METHODS[-1]}



def units(args, shard=True):
    """All (experiment, setting, run) units in a fixed order; a shard takes every K-th.

    The units that run normalX (the first ``--nx-runs`` runs; by far the most
    expensive) come first, the costliest settings first (diabetes J = 5, then
    sim d = 5, J = 1, d = 2), so that dealing them out round-robin spreads
    them over the shards; then the rest in the same order.
    """
    configs = []
    if args.only != "sim":
        configs += [("real", J) for J in sorted(args.holders, reverse=True)]
    if args.only != "real":
        configs += [("sim", d) for d in sorted(args.dims, reverse=True)]
    configs.sort(key=lambda c: -c[1] * (3 if c[0] == "real" else 1))  # rough cost order
    out = [(e, s, r) for e, s in configs for r in range(min(args.nx_runs, args.runs))]
    out += [(e, s, r) for e, s in configs for r in range(args.nx_runs, args.runs)]
    return out[args.shard_index::args.shard_count] if shard else out


def out_path(args, exp):
    name = f"linreg_{exp}.csv" if args.shard_count == 1 and args.shard is None \
        else f"linreg_{exp}.shard{args.shard_index}.csv"
    return args.out / name


def methods_for(args, run):
    """normalX only in the first ``--nx-runs`` runs (the others all methods)."""
    return METHODS if run < args.nx_runs else tuple(m for m in METHODS if m != "normalX")


def run_sim(args, d, run, done, samplers):
    todo = [e for e in args.eps if (f"d={d}", str(run), str(e)) not in done]
    if not todo:
        return
    prior = lr.LinRegPrior.paper(d)
    rng = np.random.default_rng(1000 * d + run)
    X, y, Xt, yt, bx, by = simulate(rng, args.n, d, 2000)
    key = random.PRNGKey(1000 * d + run)
    ref = nonprivate_theta(key, X, y, prior, samplers)
    for eps in todo:
        rows = [dict(experiment="sim", setting=f"d={d}", run=run, epsilon=eps,
                     method=m, test_mse=mse, mmd=dd, seconds=s)
                for m, mse, dd, s in run_methods(
                    random.fold_in(key, int(eps * 1000)), X, y, Xt, yt, bx, by, eps,
                    0.1 / args.n, 1, prior, ref, samplers, methods_for(args, run))]
        append(out_path(args, "sim"), FIELDS, rows)
        print(f"sim d={d} run={run} eps={eps}: "
              + ", ".join(f"{r['method']} {r['test_mse']:.4g} ({r['seconds']:.2f}s)"
                          for r in rows), flush=True)


def run_real(args, J, run, done, samplers, data):
    if (f"diabetes J={J}", str(run), "1.0") in done:
        return
    X, y, bx, by = data
    prior = lr.LinRegPrior.paper(X.shape[1])
    tr, te = real_split(X, run)
    rows = [dict(experiment="real", setting=f"diabetes J={J}", run=run, epsilon=1.0,
                 method=m, test_mse=mse, mmd=dd, seconds=s)
            for m, mse, dd, s in run_methods(
                random.PRNGKey(run), X[tr], y[tr], X[te], y[te], bx, by, 1.0,
                0.1 / len(tr), J, prior, None, samplers, methods_for(args, run))]
    append(out_path(args, "real"), FIELDS, rows)
    print(f"real J={J} run={run}: "
          + ", ".join(f"{r['method']} {r['test_mse']:.4g} ({r['seconds']:.2f}s)" for r in rows),
          flush=True)


def run_units(args):
    samplers = Samplers(args)
    done = {exp: done_keys(args.out, exp) for exp in ("sim", "real")}
    todo = units(args)
    data = diabetes() if any(u[0] == "real" for u in todo) else None
    for exp, setting, run in todo:
        t, c = time.perf_counter(), time.process_time()
        if exp == "real":
            run_real(args, setting, run, done["real"], samplers, data)
        else:
            run_sim(args, setting, run, done["sim"], samplers)
        print(f"unit {exp} {setting} {run}: {time.perf_counter() - t:.1f}s wall, "
              f"{time.process_time() - c:.1f}s CPU", flush=True)


# ------------------------------------------------------------------ report
def merge(out):
    """Fold the shard CSVs into linreg_{sim,real}.csv (first copy of a row wins)."""
    order = {m: i for i, m in enumerate(METHODS)}
    for exp in ("sim", "real"):
        files = csv_files(out, exp)
        if len(files) == 1:
            continue
        rows = {}
        for p in files:
            for r in load(p):
                rows.setdefault((r["setting"], r["run"], r["epsilon"], r["method"]), r)
        merged = sorted(rows.values(), key=lambda r: (r["setting"], int(r["run"]),
                                                      float(r["epsilon"]), order[r["method"]]))
        tmp = out / f"linreg_{exp}.csv.tmp"
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(merged)
        tmp.replace(files[0])
        for p in files[1:]:
            p.unlink()
        print(f"merged {len(files) - 1} shard files into {files[0].name}: {len(merged)} rows")


def figures(out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(out / "linreg_sim.csv")
    settings = sorted({r["setting"] for r in rows})
    if settings:
        fig, axes = plt.subplots(2, len(settings), figsize=(5 * len(settings), 7),
                                 squeeze=False)
        for col, s in enumerate(settings):
            for m in METHODS:
                sel = [r for r in rows if r["setting"] == s and r["method"] == m]
                eps = sorted({float(r["epsilon"]) for r in sel})
                for row, metric in enumerate(("test_mse", "mmd")):
                    vals = [[float(r[metric]) for r in sel if float(r["epsilon"]) == e]
                            for e in eps]
                    runs = min(len(v) for v in vals)
                    if not all(math.isnan(x) for v in vals for x in v):
                        axes[row, col].plot(eps, [np.mean(v) for v in vals], "o-",
                                            label=f"{m} ({runs} runs)")
                    axes[row, col].set(xscale="log", yscale="log", xlabel="epsilon",
                                       ylabel=f"{metric} (mean over runs)", title=f"{s}, n = 1e5")
            axes[0, col].legend()
        fig.tight_layout()
        fig.savefig(out / "linreg_sim.png", dpi=110)

    real_rows = load(out / "linreg_real.csv")
    if not real_rows:
        return
    lines = ["| setting | method | runs | mean test MSE | 90% CI of the mean |",
             "|---|---|---|---|---|"]
    for r0 in sorted({(r["setting"], r["method"]) for r in real_rows}):
        v = np.array([float(r["test_mse"]) for r in real_rows
                      if (r["setting"], r["method"]) == r0])
        half = 1.645 * v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        lines.append(f"| {r0[0]} | {r0[1]} | {len(v)} | {v.mean():.4f} | "
                     f"[{v.mean() - half:.4f}, {v.mean() + half:.4f}] |")
    (out / "linreg_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_shard(text):
    try:
        i, k = (int(x) for x in text.split("/"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/K, e.g. 0/16") from e
    if not 0 <= i < k:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 0 <= I < K")
    return i, k


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 runs, short chains, 4 epsilons")
    p.add_argument("--report", action="store_true",
                   help="only merge shard CSVs and redraw figures and tables")
    p.add_argument("--runs", type=int)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--only", choices=("sim", "real"), help="run one experiment")
    p.add_argument("--dims", type=int, nargs="+", default=[2, 5])
    p.add_argument("--holders", type=int, nargs="+", default=[1, 5])
    p.add_argument("--warmup", type=int, help="NUTS warm-up iterations (override)")
    p.add_argument("--samples", type=int, help="NUTS draws (override)")
    p.add_argument("--nx-warmup", type=int, help="normalX warm-up (default: --warmup)")
    p.add_argument("--nx-samples", type=int, help="normalX draws (default: --samples)")
    p.add_argument("--nx-max-tree-depth", type=int, default=10,
                   help="normalX NUTS maximum tree depth (NumPyro's default: 10)")
    p.add_argument("--nx-runs", type=int, help="run normalX in the first NX_RUNS runs only")
    p.add_argument("--compile-only", action="store_true",
                   help="only compile the NUTS configurations (of this shard), e.g. to fill "
                        "JAX_COMPILATION_CACHE_DIR before the shards start")
    p.add_argument("--shard", type=parse_shard, metavar="I/K",
                   help="process I of K: every K-th (experiment, setting, run) unit, "
                        "rows to linreg_{sim,real}.shard{I}.csv, single-threaded")
    p.add_argument("--out", type=pathlib.Path, default=OUT, help="results folder")
    args = p.parse_args()
    if args.quick:
        args.runs = args.runs or 3
        args.eps, warmup, samples = (0.1, 0.5, 2.0, 10.0), 300, 500
    else:
        args.runs = args.runs or 50
        args.eps, warmup, samples = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0), 1000, 1000
    args.warmup = args.warmup or warmup
    args.samples = args.samples or samples
    args.nx_warmup = args.nx_warmup or args.warmup
    args.nx_samples = args.nx_samples or args.samples
    args.nx_runs = args.runs if args.nx_runs is None else args.nx_runs
    args.shard_index, args.shard_count = args.shard or (0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.compile_only:
        precompile(args)
        return
    if not args.report:
        t = time.perf_counter()
        run_units(args)
        print(f"shard {args.shard_index}/{args.shard_count} done in "
              f"{time.perf_counter() - t:.1f}s", flush=True)
        if args.shard is not None:
            return
    merge(args.out)
    figures(args.out)


if __name__ == "__main__":
    main()
