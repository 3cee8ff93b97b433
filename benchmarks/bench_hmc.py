"""Benchmark: cost of one DPHMC iteration relative to one NumPyro HMC iteration.

Logistic regression, d = 10, float32, L = 10 leapfrog steps, fixed step size,
no adaptation.  Two parts, every configuration in its own subprocess:

(a) ratio at n = 100000: time per DPHMC iteration for each gradient route
    (``auto``, which takes ``linear_predictor`` here, and forced ``jacobian``)
    divided by the time per iteration of NumPyro's ``HMC`` with the same step
    size and ``num_steps`` and ``adapt_step_size=adapt_mass_matrix=False``,
    measured in the same process, interleaved.
(b) scaling over n = 1e4, 1e5, 1e6: time per iteration and peak memory of
    both routes (and of NumPyro HMC for reference), one subprocess each.

How it is timed.  DPHMC runs through its functional core
``numpyro_dp.kernels.hmc.dp_hmc`` (``num_warmup=0``) with fixed noise
multipliers (``z_grad = z_llr = 2``) and ``grad_clip = llr_clip = 3`` (no row
has ``||x_i|| > 2.1`` here, so neither bound binds and the acceptance rate
reflects the noise only; the work per iteration does not depend on them);
NumPyro through ``HMC.init`` / ``HMC.sample``.  For both, K iterations of the
kernel's sample function run inside one jitted ``lax.fori_loop`` that takes
the data as jit arguments; the loop is compiled first (not timed), then timed
``--repeats`` times with ``block_until_ready``; the median per-iteration time
is reported.  Same starting point, step size and loop for both.

Peak memory (part b): ``ru_maxrss`` of the worker process at the end (peak
resident set size, which includes the Python interpreter, JAX, the data and
XLA compilation), and the same figure minus ``ru_maxrss`` measured just
after the data were created and copied to the device ("added"): the
memory that compiling and running the sampler needed on top of the data.

Per iteration, NumPyro HMC evaluates the potential's gradient L times (it
reuses the last gradient of the previous trajectory) and the potential once;
DPHMC evaluates L + 1 clipped per-row gradient sums (fresh noise each) and the
per-row log-likelihoods at two points (the penalty test).

Usage::

    .venv/bin/python benchmarks/bench_hmc.py                  # (a) and (b), ~3 min
    .venv/bin/python benchmarks/bench_hmc.py --json out.json
    .venv/bin/python benchmarks/bench_hmc.py --part ratio     # only (a)

Issue target: DPHMC (auto route) time per iteration / NumPyro HMC time per
iteration <= 2.0; goal <= 1.2.
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

TARGET_RATIO = 2.0
GOAL_RATIO = 1.2
MARKER = "BENCH_HMC_RESULT "
SAMPLERS = ("numpyro_hmc", "dphmc_auto", "dphmc_jacobian")


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


# --------------------------------------------------------------------- worker
def _worker(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from jax import lax, random
    from numpyro.infer import HMC

    from numpyro_dp.kernels.hmc import dp_hmc
    from numpyro_dp.model.adapter import PrivateModel
    from numpyro_dp.primitives.gradients import select_route
    from numpyro_dp.primitives.secret import draw_secret

    n, d, L, K, repeats = args.n, args.d, args.num_steps, args.K, args.repeats

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    rng = np.random.default_rng(0)
    X_np = (rng.normal(size=(n, d)) / np.sqrt(d)).astype(np.float32)
    w_true = rng.normal(size=d).astype(np.float32)
    y_np = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-X_np @ w_true))).astype(np.float32)
    X, y = jnp.asarray(X_np), jnp.asarray(y_np)
    del X_np, y_np
    jax.block_until_ready((X, y))
    rss_data = _maxrss_mb()
    w0 = jnp.asarray(w_true)
    # Step size ~ a fifth of the posterior sd (~ 2 / sqrt(n var(x))): HMC accepts.
    step_size = float(args.step_size if args.step_size else 0.4 * np.sqrt(d / n))

    def looped(sample_fn):
        @jax.jit
        def run(state, X, y):
            return lax.fori_loop(0, K, lambda i, s: sample_fn(s, (X,), {"y": y}), state)

        return run

    benches = {}
    if "numpyro_hmc" in args.samplers:
        # NumPyro's HMC uses trajectory_length / num_steps as its step size when a
        # trajectory length is set (default 2 pi): set it so the step is step_size.
        hmc = HMC(model, step_size=step_size, num_steps=L, trajectory_length=step_size * L,
                  adapt_step_size=False, adapt_mass_matrix=False)
        state = hmc.init(random.PRNGKey(1), 0, {"w": w0}, (X,), {"y": y})
        benches["numpyro_hmc"] = (looped(hmc.sample), state)
    pm = None
    routes = {}
    for name in args.samplers:
        if not name.startswith("dphmc_"):
            continue
        route = name[len("dphmc_"):]
        pm = pm or PrivateModel(model, (X,), {"y": y})
        routes[name] = select_route(pm, (X,), {"y": y}, route)._asdict()
        init_fn, sample_fn = dp_hmc(
            pm, 0, num_steps=L, grad_clip=3.0, llr_clip=3.0,
            noise_multiplier_grad=2.0, noise_multiplier_llr=2.0, sensitivity_factor=2.0,
            adapt_step_size=False, adapt_mass_matrix=False, grad_route=route,
        )
        step = functools.partial(sample_fn, secret=draw_secret())  # the run's secret
        benches[name] = (looped(step), init_fn({"w": w0}, step_size, None, random.PRNGKey(2)))

    results = {}
    for name, (run, state) in benches.items():
        t0 = time.perf_counter()
        out = jax.block_until_ready(run(state, X, y))
        results[name] = {"first_call_s": time.perf_counter() - t0, "times_s": []}
        if hasattr(out, "mean_accept_prob"):
            results[name]["mean_accept_prob"] = float(out.mean_accept_prob)
        if args.verbose:
            print(f"  [n={n}] compiled+ran {name} in {results[name]['first_call_s']:.2f} s",
                  file=sys.stderr, flush=True)
    for _ in range(repeats):  # interleaved, so load changes hit every sampler alike
        for name, (run, state) in benches.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, X, y))
            results[name]["times_s"].append(time.perf_counter() - t0)
    for r in results.values():
        r["ms_per_iter"] = 1e3 * float(np.median(r["times_s"])) / K
        r["ms_per_iter_min"] = 1e3 * float(np.min(r["times_s"])) / K
    rss_end = _maxrss_mb()
    return {
        "n": n, "d": d, "num_steps": L, "K": K, "repeats": repeats, "step_size": step_size,
        "samplers": list(args.samplers), "routes": routes, "timings": results,
        "peak_rss_mb": rss_end, "rss_after_data_mb": rss_data,
        "peak_rss_added_mb": rss_end - rss_data, "machine": _machine_info(),
    }


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
def _iters(n: int, sampler: str, budget: float) -> int:
    """Iterations per timed call: about `budget` seconds at a rough rate."""
    per_row_ms = {"numpyro_hmc": 7e-5, "dphmc_auto": 9e-5, "dphmc_jacobian": 4e-4}[sampler]
    return int(max(2, min(200, budget * 1e3 / (per_row_ms * n))))


def _run(samplers, n, K, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--n", str(n),
           "--d", str(args.d), "--num-steps", str(args.num_steps), "-K", str(K),
           "--repeats", str(args.repeats), "--samplers", *samplers]
    if args.step_size:
        cmd += ["--step-size", str(args.step_size)]
    if args.verbose:
        cmd.append("--verbose")
        print(" ".join(cmd[2:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker {samplers} n={n} failed (exit {proc.returncode}):\n{proc.stdout}")
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise SystemExit(f"worker printed no result:\n{proc.stdout}")


def _print(ratio: dict | None, scaling: list[dict]) -> None:
    first = ratio or scaling[0]
    m = first["machine"]
    print(f"jax {m['jax']}, numpyro {m['numpyro']}, backend {m['backend']}, "
          f"CPUs {m['cpu_count']}, python {m['python']}, {m['platform']}")
    print(f"logistic regression d={first['d']}, float32, L={first['num_steps']} leapfrog "
          "steps, fixed step size, no adaptation; DPHMC via dp_hmc (z_grad = z_llr = 2, clips 3)\n")
    if ratio:
        t = ratio["timings"]
        base = t["numpyro_hmc"]
        print(f"(a) n={ratio['n']}: {ratio['K']} iterations per jitted fori_loop, median "
              f"of {ratio['repeats']} interleaved repeats (step size {ratio['step_size']:.2e})")
        hdr = (f"{'sampler':16s} {'route taken':18s} {'ms/iter':>9s} {'ratio':>6s} "
               f"{'ratio(min)':>10s} {'accept':>6s}")
        print(hdr)
        print("-" * len(hdr))
        for name in SAMPLERS:
            r = t[name]
            route = ratio["routes"].get(name, {}).get("route", "-")
            print(f"{name:16s} {route:18s} {r['ms_per_iter']:9.3f} "
                  f"{r['ms_per_iter'] / base['ms_per_iter']:6.2f} "
                  f"{r['ms_per_iter_min'] / base['ms_per_iter_min']:10.2f} "
                  f"{r.get('mean_accept_prob', float('nan')):6.2f}")
        q = t["dphmc_auto"]["ms_per_iter"] / base["ms_per_iter"]
        verdict = "GOAL MET" if q <= GOAL_RATIO else ("OK" if q <= TARGET_RATIO else "ABOVE TARGET")
        print("  accept = mean acceptance probability over the first (compiling) call")
        print(f"  DPHMC(auto)/HMC = {q:.2f}: target <= {TARGET_RATIO}, goal <= {GOAL_RATIO} "
              f"[{verdict}]; ratio(min) compares the fastest repeats\n")
    if scaling:
        print("(b) scaling (one subprocess per row; peak = ru_maxrss at the end of the worker, "
              "added = peak minus ru_maxrss right after the data were created)")
        hdr = (f"{'sampler':16s} {'n':>8s} {'K':>4s} {'ms/iter':>10s} {'us/iter/1e3rows':>15s} "
               f"{'peak MB':>8s} {'added MB':>8s}")
        print(hdr)
        print("-" * len(hdr))
        for r in scaling:
            (name,) = r["samplers"]
            ms = r["timings"][name]["ms_per_iter"]
            per_rows = 1e3 * ms / (r["n"] / 1e3)
            print(f"{name:16s} {r['n']:8d} {r['K']:4d} {ms:10.3f} {per_rows:15.3f} "
                  f"{r['peak_rss_mb']:8.0f} {r['peak_rss_added_mb']:8.0f}")
        print("  us/iter/1e3rows = time per iteration per thousand rows: constant if the cost "
              "is linear in n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "ratio", "scaling"), default="all")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=list(SAMPLERS))
    p.add_argument("--n", type=int, default=100_000, help="rows for part (a)")
    p.add_argument("--scaling-n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--d", type=int, default=10)
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--step-size", type=float, default=None,
                   help="default 0.4 sqrt(d / n), about a fifth of the posterior sd")
    p.add_argument("-K", type=int, default=None, help="iterations per timed call (default: by n)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="rough seconds per timed call when -K is not given")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = p.parse_args(argv)

    if args.worker:
        print(MARKER + json.dumps(_worker(args)), flush=True)
        return

    ratio, scaling = None, []
    if args.part in ("all", "ratio"):
        K = args.K or _iters(args.n, "dphmc_jacobian", 2 * args.budget)
        ratio = _run(list(SAMPLERS), args.n, K, args)
    if args.part in ("all", "scaling"):
        for n in args.scaling_n:
            for name in SAMPLERS:
                scaling.append(_run([name], n, args.K or _iters(n, name, args.budget), args))
    _print(ratio, scaling)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_ratio": TARGET_RATIO, "goal_ratio": GOAL_RATIO,
                       "ratio": ratio, "scaling": scaling}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
