"""Benchmark: cost of one DPHMC iteration relative to one NumPyro HMC iteration.

Four model classes, float32, L = 10 leapfrog steps, fixed step size, no
adaptation:

``glm``
    logistic regression, d = 10 covariates (one linear predictor per row);
``student_t``
    robust regression ``y ~ StudentT(nu, b0 + X w, sigma)`` with d = 10
    covariates: per-row values feeding shared parameters (scale, degrees of
    freedom), 13 parameters;
``hierarchical``
    random intercepts by group, ``y ~ Normal(a[g] + X w, sigma)``, 50 groups,
    5 covariates: each row reads one group's coordinate, 58 parameters;
``mixture``
    a three-component Gaussian mixture of one value per row
    (``MixtureSameFamily``): every row touches every parameter, 8 parameters.

Three parts, every configuration in its own subprocess:

(a) ratios at n = 1e4, 1e5, 1e6 (``--ratio-n``): time per DPHMC iteration for
    each gradient route (``auto`` and the forced ``jacobian``, plus
    ``linear_predictor`` where the model admits it) divided by the time per
    iteration of NumPyro's ``HMC`` with the same step size and ``num_steps``
    and ``adapt_step_size=adapt_mass_matrix=False``, all in one process,
    interleaved; also the route ``auto`` took, and whether it is within 5% of
    the fastest route.
(b) memory and scaling of the GLM over n (one process per sampler and n).
(c) compile time per ``PrivateMCMC.run``: a notebook cell that builds a
    DPHMC and a ``PrivateMCMC`` and runs 100 + 100 iterations at n = 1e4,
    executed twice in one process, in two versions: ``stated`` (clips and
    step size stated, no warm start) and ``defaults`` (private clip selection
    and warm start); wall time and XLA compile seconds (JAX's backend-compile
    events) of each run.  A second run should compile nothing.

How (a) and (b) time.  DPHMC runs through its functional core
``numpyro_dp.kernels.hmc.dp_hmc`` (``num_warmup=0``) with fixed noise
multipliers (``z_grad = z_llr = 2``) and ``grad_clip = llr_clip = 3``; NumPyro
through ``HMC.init`` / ``HMC.sample``.  For both, K iterations of the kernel's
sample function run inside one jitted ``lax.fori_loop`` that takes the data as
jit arguments; the loop is compiled first (not timed), then timed ``--repeats``
times with ``block_until_ready``; the ratios use each sampler's fastest repeat
(the least disturbed by other load on the machine; the medians are in the JSON).
Same starting point (the data's generating parameters), step size and loop for
both.  Per iteration NumPyro HMC evaluates the potential's gradient L times and
the potential once; DPHMC evaluates L + 1 clipped per-row gradient sums (fresh
noise each) and the per-row log-likelihoods at two points (the penalty test).

Usage::

    .venv/bin/python benchmarks/bench_hmc.py                       # all, ~25 min
    .venv/bin/python benchmarks/bench_hmc.py --part ratio --ratio-n 100000
    .venv/bin/python benchmarks/bench_hmc.py --models hierarchical --json out.json

Issue target: DPHMC (auto route) / NumPyro HMC <= 1.2 on every class (goal 1.1);
``auto`` within 5% of the best route.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import time

GOAL_RATIO = 1.2
AUTO_SLACK = 1.05
MARKER = "BENCH_HMC_RESULT "
MODELS = ("glm", "student_t", "hierarchical", "mixture")
ROUTES = ("auto", "jacobian", "linear_predictor")
NUM_GROUPS = 50


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


# --------------------------------------------------------------------- models
def _model_and_data(name: str, n: int):
    """``(model, args, kwargs, true params (unconstrained), step size)`` for class ``name``."""
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist

    rng = np.random.default_rng(0)
    f32 = np.float32

    def covariates(d):
        return (rng.normal(size=(n, d)) / np.sqrt(d)).astype(f32)

    if name == "glm":
        def model(X, y=None):
            w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
            with numpyro.plate("data", X.shape[0]):
                numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

        X, w = covariates(10), rng.normal(size=10).astype(f32)
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ w))).astype(f32)
        return model, (jnp.asarray(X),), {"y": jnp.asarray(y)}, {"w": w}, 0.4 * np.sqrt(10 / n)
    if name == "student_t":
        def model(X, y=None):
            b0 = numpyro.sample("b0", dist.Normal(0, 5))
            w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
            sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
            nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
            with numpyro.plate("data", X.shape[0]):
                numpyro.sample("y", dist.StudentT(nu, b0 + X @ w, sigma), obs=y)

        X, w = covariates(10), rng.normal(size=10).astype(f32)
        y = (X @ w + 0.5 + rng.standard_t(5, size=n)).astype(f32)
        init = {"b0": f32(0.5), "w": w, "sigma": f32(0.0), "nu": f32(np.log(5.0))}
        return model, (jnp.asarray(X),), {"y": jnp.asarray(y)}, init, 0.2 * np.sqrt(10 / n)
    if name == "hierarchical":
        def model(X, g, y=None):
            w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
            mu = numpyro.sample("mu", dist.Normal(0, 5))
            tau = numpyro.sample("tau", dist.HalfNormal(1.0))
            with numpyro.plate("groups", NUM_GROUPS):
                a = numpyro.sample("a", dist.Normal(mu, tau))
            sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
            with numpyro.plate("data", X.shape[0]):
                numpyro.sample("y", dist.Normal(a[g] + X @ w, sigma), obs=y)

        X, w = covariates(5), rng.normal(size=5).astype(f32)
        g = rng.integers(0, NUM_GROUPS, size=n).astype(np.int32)
        a = rng.normal(size=NUM_GROUPS).astype(f32)
        y = (a[g] + X @ w + rng.normal(size=n)).astype(f32)
        init = {"w": w, "mu": f32(0.0), "tau": f32(0.0), "a": a, "sigma": f32(0.0)}
        return (model, (jnp.asarray(X), jnp.asarray(g)), {"y": jnp.asarray(y)}, init,
                0.2 * np.sqrt(NUM_GROUPS / n))
    if name == "mixture":
        def model(y=None):
            weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
            locs = numpyro.sample("locs", dist.Normal(0, 5).expand([3]).to_event(1))
            scales = numpyro.sample("scales", dist.HalfNormal(2).expand([3]).to_event(1))
            with numpyro.plate("data", y.shape[0]):
                mix = dist.MixtureSameFamily(dist.Categorical(weights), dist.Normal(locs, scales))
                numpyro.sample("y", mix, obs=y)

        locs = np.array([-3.0, 0.0, 3.0], f32)
        y = (locs[rng.integers(0, 3, size=n)] + rng.normal(size=n)).astype(f32)
        init = {"weights": np.zeros(2, f32), "locs": locs, "scales": np.zeros(3, f32)}
        return model, (), {"y": jnp.asarray(y)}, init, 0.2 * np.sqrt(3 / n)
    raise KeyError(name)


# --------------------------------------------------------------------- worker
def _worker(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax, random
    from numpyro.infer import HMC

    from numpyro_dp.kernels.hmc import dp_hmc
    from numpyro_dp.model.adapter import PrivateModel
    from numpyro_dp.primitives.route_choice import select_route
    from numpyro_dp.primitives.secret import draw_secret

    n, L, K, repeats = args.n, args.num_steps, args.K, args.repeats
    model, margs, mkwargs, truth, step_size = _model_and_data(args.model, n)
    jax.block_until_ready((margs, mkwargs))
    rss_data = _maxrss_mb()
    step_size = float(args.step_size or step_size)
    truth = {k: jnp.asarray(v) for k, v in truth.items()}

    def looped(sample_fn):
        @jax.jit
        def run(state, margs, mkwargs):
            return lax.fori_loop(0, K, lambda i, s: sample_fn(s, margs, mkwargs), state)

        return run

    benches, routes = {}, {}
    if "numpyro_hmc" in args.samplers:
        # NumPyro's HMC uses trajectory_length / num_steps as its step size when a
        # trajectory length is set (default 2 pi): set it so the step is step_size.
        hmc = HMC(model, step_size=step_size, num_steps=L, trajectory_length=step_size * L,
                  adapt_step_size=False, adapt_mass_matrix=False)
        state = hmc.init(random.PRNGKey(1), 0, truth, margs, mkwargs)
        benches["numpyro_hmc"] = (looped(hmc.sample), state)
    pm = None
    for name in args.samplers:
        if not name.startswith("dphmc_"):
            continue
        route = name[len("dphmc_"):]
        pm = pm or PrivateModel(model, margs, mkwargs)
        try:
            routes[name] = select_route(pm, margs, mkwargs, route)._asdict()
        except ValueError:  # linear_predictor forced on a model without a narrow cut
            continue
        init_fn, sample_fn = dp_hmc(
            pm, 0, num_steps=L,
            noise_multiplier_grad=2.0, noise_multiplier_llr=2.0, sensitivity_factor=2.0,
            adapt_step_size=False, adapt_mass_matrix=False, grad_route=route,
        )
        step = functools.partial(sample_fn, secret=draw_secret(),  # the run's secret
                                 grad_clip=3.0, llr_clip=3.0)
        benches[name] = (looped(step), init_fn(truth, step_size, None, random.PRNGKey(2)))

    results = {}
    for name, (run, state) in benches.items():
        t0 = time.perf_counter()
        out = jax.block_until_ready(run(state, margs, mkwargs))
        results[name] = {"first_call_s": time.perf_counter() - t0, "times_s": []}
        if hasattr(out, "mean_accept_prob"):
            results[name]["mean_accept_prob"] = float(out.mean_accept_prob)
        if args.verbose:
            print(f"  [{args.model} n={n}] compiled+ran {name} in "
                  f"{results[name]['first_call_s']:.2f} s", file=sys.stderr, flush=True)
    for _ in range(repeats):  # interleaved, so load changes hit every sampler alike
        for name, (run, state) in benches.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, margs, mkwargs))
            results[name]["times_s"].append(time.perf_counter() - t0)
    for r in results.values():
        r["ms_per_iter"] = 1e3 * float(np.median(r["times_s"])) / K
        r["ms_per_iter_min"] = 1e3 * float(np.min(r["times_s"])) / K
    rss_end = _maxrss_mb()
    return {
        "model": args.model, "n": n, "num_params": None if pm is None else pm.num_params,
        "num_steps": L, "K": K, "repeats": repeats, "step_size": step_size,
        "samplers": list(results), "routes": routes, "timings": results,
        "peak_rss_mb": rss_end, "peak_rss_added_mb": rss_end - rss_data,
        "machine": _machine_info(),
    }


def _rerun_worker(args: argparse.Namespace) -> dict:
    """Part (c): two notebook cells, each run twice; wall and compile seconds of each run."""
    import jax
    import jax.monitoring

    import numpyro_dp as ndp

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    model, margs, mkwargs, truth, step_size = _model_and_data(args.model, args.n)
    cells = {
        # Stated clips and step size, no warm start: the sampler alone.
        "stated": lambda: ndp.PrivateMCMC(
            ndp.DPHMC(model, num_steps=args.num_steps, step_size=float(step_size),
                      grad_clip=3.0, llr_clip=3.0),
            num_warmup=100, num_samples=100, epsilon=10.0, delta=1e-6, warm_start=0,
            progress_bar=False, check_mixing=False),
        # The defaults: private clip selection and warm start, then the sampler.
        "defaults": lambda: ndp.PrivateMCMC(
            ndp.DPHMC(model, num_steps=args.num_steps), num_warmup=100, num_samples=100,
            epsilon=10.0, delta=1e-6, progress_bar=False, check_mixing=False),
    }
    runs = []
    for cell, make in cells.items():
        for k in range(2):
            before = len(compiles)
            t0 = time.perf_counter()
            mcmc = make()
            init = truth if cell == "stated" else None
            mcmc.run(jax.random.PRNGKey(k), *margs, init_params=init, **mkwargs)
            jax.block_until_ready(mcmc.get_samples())
            runs.append({"cell": cell, "wall_s": time.perf_counter() - t0,
                         "compile_s": float(sum(compiles[before:])),
                         "num_compiles": len(compiles) - before})
    return {"model": args.model, "n": args.n, "runs": runs, "machine": _machine_info()}


def _machine_info() -> dict:
    import jax
    import numpyro

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "backend": jax.default_backend(),
        "devices": [str(dv) for dv in jax.devices()],
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg") else None,
    }


# --------------------------------------------------------------------- driver
#: Rough ms per iteration per 1000 rows, to size K (iterations per timed call).
_RATE = {"glm": 0.15, "student_t": 0.3, "hierarchical": 0.4, "mixture": 0.6}


def _iters(model: str, n: int, budget: float) -> int:
    return int(max(2, min(200, budget * 1e3 / (_RATE[model] * n / 1e3) / 3)))


def _run(args, model, n, samplers=(), K=None, rerun=False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
           "--n", str(n), "--num-steps", str(args.num_steps), "--repeats", str(args.repeats)]
    cmd += ["--rerun"] if rerun else ["-K", str(K), "--samplers", *samplers]
    if args.step_size:
        cmd += ["--step-size", str(args.step_size)]
    if args.verbose:
        cmd.append("--verbose")
        print(" ".join(cmd[2:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker {model} n={n} failed (exit {proc.returncode}):\n{proc.stdout}")
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise SystemExit(f"worker printed no result:\n{proc.stdout}")


def _print(ratios: list, scaling: list, reruns: list) -> None:
    first = (ratios or scaling or reruns)[0]
    m = first["machine"]
    print(f"jax {m['jax']}, numpyro {m['numpyro']}, backend {m['backend']} "
          f"({', '.join(m['devices'])}), CPUs {m['cpu_count']}, python {m['python']}")
    if ratios:
        print(f"\n(a) DPHMC / NumPyro HMC per iteration (float32, L = {first['num_steps']}, "
              f"fastest of {first['repeats']} interleaved repeats; DPHMC z = 2, clips 3)")
        hdr = (f"{'model':13s} {'d':>3s} {'n':>8s} {'HMC ms/it':>10s} {'auto':>6s} "
               f"{'jacobian':>8s} {'lin.pred':>8s} {'auto took':18s} {'auto/best':>9s}")
        print(hdr)
        print("-" * len(hdr))
        for r in ratios:
            t = r["timings"]
            base = t["numpyro_hmc"]["ms_per_iter_min"]

            def ratio(route, t=t, base=base):
                x = t.get(f"dphmc_{route}")
                return x["ms_per_iter_min"] / base if x else float("nan")

            best = min(ratio(x) for x in ROUTES[1:] if f"dphmc_{x}" in t)
            took = r["routes"]["dphmc_auto"]["route"]
            flag = "" if ratio("auto") <= AUTO_SLACK * best else "  (slower than best)"
            print(f"{r['model']:13s} {r['num_params']:3d} {r['n']:8d} {base:10.3f} "
                  f"{ratio('auto'):6.2f} {ratio('jacobian'):8.2f} "
                  f"{ratio('linear_predictor'):8.2f} {took:18s} "
                  f"{ratio('auto') / best:9.2f}{flag}")
        print(f"  goal: auto <= {GOAL_RATIO}; auto within {AUTO_SLACK:.2f}x of the best route "
              "(auto and the route it takes run the same program: their gap is the noise)")
    if scaling:
        print("\n(b) GLM scaling (one subprocess per row; peak = ru_maxrss at the end, "
              "added = peak minus ru_maxrss once the data were made)")
        hdr = (f"{'sampler':16s} {'n':>8s} {'ms/iter':>10s} {'us/iter/1e3rows':>15s} "
               f"{'peak MB':>8s} {'added MB':>8s}")
        print(hdr)
        print("-" * len(hdr))
        for r in scaling:
            (name,) = r["samplers"]
            ms = r["timings"][name]["ms_per_iter"]
            print(f"{name:16s} {r['n']:8d} {ms:10.3f} {1e3 * ms / (r['n'] / 1e3):15.3f} "
                  f"{r['peak_rss_mb']:8.0f} {r['peak_rss_added_mb']:8.0f}")
    if reruns:
        print("\n(c) a notebook cell (new DPHMC + PrivateMCMC, 100 + 100 iterations) run twice; "
              "'stated': clips and step size stated, no warm start; 'defaults': private clip "
              "selection and warm start")
        print(f"{'model':13s} {'n':>6s} {'cell':>8s} {'run':>3s} {'wall s':>7s} "
              f"{'compile s':>9s} {'compiles':>8s}")
        for r in reruns:
            for k, run in enumerate(r["runs"]):
                print(f"{r['model']:13s} {r['n']:6d} {run['cell']:>8s} {k % 2 + 1:3d} "
                      f"{run['wall_s']:7.2f} {run['compile_s']:9.2f} {run['num_compiles']:8d}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "ratio", "scaling", "rerun"), default="all")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--ratio-n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--scaling-n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--step-size", type=float, default=None,
                   help="default: about a fifth of the posterior sd of the model class")
    p.add_argument("-K", type=int, default=None, help="iterations per timed call (default: by n)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="rough seconds per timed call when -K is not given")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rerun", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--samplers", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        result = _rerun_worker(args) if args.rerun else _worker(args)
        print(MARKER + json.dumps(result), flush=True)
        return

    samplers = ["numpyro_hmc"] + [f"dphmc_{r}" for r in ROUTES]
    ratios, scaling, reruns = [], [], []
    if args.part in ("all", "ratio"):
        for model in args.models:
            for n in args.ratio_n:
                ratios.append(_run(args, model, n, samplers,
                                   args.K or _iters(model, n, args.budget)))
    if args.part in ("all", "scaling") and "glm" in args.models:
        for n in args.scaling_n:
            for name in ("numpyro_hmc", "dphmc_auto"):
                scaling.append(_run(args, "glm", n, [name], args.K or _iters("glm", n, 1.0)))
    if args.part in ("all", "rerun"):
        reruns = [_run(args, model, 10_000, rerun=True) for model in args.models]
    _print(ratios, scaling, reruns)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"goal_ratio": GOAL_RATIO, "ratios": ratios, "scaling": scaling,
                       "reruns": reruns}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
