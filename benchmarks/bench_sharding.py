"""Benchmark: one chain's rows sharded over a device mesh (issue 22).

For each device count (a fresh interpreter each; on CPU simulated devices,
``XLA_FLAGS=--xla_force_host_platform_device_count``; the real ones elsewhere),
the logistic regression's rows are placed with ``ndp.shard_rows`` and three
samplers run ``K`` iterations in one jitted loop on the same mesh:

* ``numpyro_hmc``: NumPyro's HMC (step size fixed, ``num_steps`` leapfrog steps);
* ``dphmc``: DPHMC's functional core, same step size and ``num_steps``
  (``num_steps + 1`` gradient releases and one LLR release per iteration);
* ``dppenalty``: the full-data DP penalty kernel (one LLR release).

Reported per cell: ms per iteration (median of ``--repeats`` interleaved
runs), the ratio to NumPyro HMC, and the collectives of each compiled loop
(read from its optimised HLO): their kinds and the bytes of their operands.
Every collective of the DP loops should be an all-reduce of d-sized integer
pairs per release, whatever n; an ``all-gather`` would mean rows move.

On a CPU with simulated devices only the correctness and the communication
volume mean anything: the "devices" share the same cores.  On a GPU machine
the times are the device's (named in the output).

Run: ``python benchmarks/bench_sharding.py --rows 100000 1000000 --devices 1 2 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from jax import lax, random
    from numpyro.infer import HMC

    import numpyro_dp as ndp
    from numpyro_dp.kernels.hmc import dp_hmc
    from numpyro_dp.kernels.penalty import dp_penalty
    from numpyro_dp.model.adapter import PrivateModel
    from numpyro_dp.primitives.compiled import collectives
    from numpyro_dp.primitives.secret import draw_secret
    from numpyro_dp.primitives.sharding import RunMesh, mesh_on, rows_mesh

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    n, d, L, K = args.n, args.dim, args.num_steps, args.K
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, d)).astype(np.float32) / np.sqrt(d)
    w = rng.normal(size=d).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ w))).astype(np.float32)
    devices = args.devices[0]  # one count per worker
    mesh = jax.make_mesh((devices,), ("data",))
    Xs, ys, layout = ndp.shard_rows(mesh, X, y)
    margs, mkwargs = (Xs,), {"y": ys}
    pm = PrivateModel(model, margs, mkwargs, row_layout=layout)
    start = {"w": jnp.asarray(w)}
    step_size = 0.5 / np.sqrt(n)

    def looped(sample_fn):
        @jax.jit
        def run(state, margs, mkwargs):
            return lax.fori_loop(0, K, lambda i, s: sample_fn(s, margs, mkwargs), state)
        return run

    secret = draw_secret()
    benches = {}
    hmc = HMC(model, step_size=step_size, num_steps=L, trajectory_length=step_size * L,
              adapt_step_size=False, adapt_mass_matrix=False)
    benches["numpyro_hmc"] = (looped(hmc.sample), hmc.init(random.PRNGKey(1), 0, start, margs,
                                                            mkwargs))
    placed = rows_mesh((Xs, ys))  # None on one device
    with mesh_on(placed and RunMesh(*placed)):  # as PrivateMCMC.run traces its programs
        init_h, sample_h = dp_hmc(pm, 0, num_steps=L, noise_multiplier_grad=2.0,
                                  noise_multiplier_llr=2.0, sensitivity_factor=2.0,
                                  adapt_step_size=False, adapt_mass_matrix=False)
        benches["dphmc"] = (looped(lambda s, a, k: sample_h(s, a, k, secret, grad_clip=3.0,
                                                            llr_clip=3.0)),
                            init_h(start, step_size, None, random.PRNGKey(2)))
        init_p, sample_p = dp_penalty(pm, 0, noise_multiplier=2.0, sensitivity_factor=2.0,
                                      adapt_step_size=False, adapt_mass_matrix=False)
        benches["dppenalty"] = (looped(lambda s, a, k: sample_p(s, a, k, secret,
                                                                llr_clip=3.0)),
                                init_p(start, step_size, None, random.PRNGKey(3)))
        results = {}
        for name, (run, state) in benches.items():
            text = run.lower(state, margs, mkwargs).compile().as_text()
            found = collectives(text)
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, margs, mkwargs))
            results[name] = {"first_call_s": time.perf_counter() - t0, "times_s": [],
                             "collectives": sorted({c["kind"] for c in found}),
                             "collective_bytes": sum(c["bytes"] for c in found)}
    for _ in range(args.repeats):
        for name, (run, state) in benches.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, margs, mkwargs))
            results[name]["times_s"].append(time.perf_counter() - t0)
    for r in results.values():
        r["ms_per_iter"] = 1e3 * float(np.median(r["times_s"])) / K
    return {"n": n, "d": d, "devices": devices, "num_steps": L, "K": K,
            "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
            "padded_rows": layout.padded_rows, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--K", type=int, default=20, help="iterations per timed loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    cells = []
    for n in args.rows:
        for devices in args.devices:
            env = dict(os.environ)
            import jax  # the parent only asks which platform it is on
            if jax.default_backend() == "cpu":
                env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
            cmd = [sys.executable, __file__, "--worker", "--n", str(n), "--devices", str(devices),
                   "--dim", str(args.dim), "--num-steps", str(args.num_steps), "--K", str(args.K),
                   "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            cell = json.loads(out.stdout.strip().splitlines()[-1])
            cells.append(cell)
            base = cell["results"]["numpyro_hmc"]["ms_per_iter"]
            for name, r in cell["results"].items():
                print(f"n={n:>9} devices={devices} {name:<12} {r['ms_per_iter']:9.2f} ms/iter "
                      f"({r['ms_per_iter'] / base:5.2f}x NumPyro HMC)  collectives="
                      f"{','.join(r['collectives']) or 'none'} {r['collective_bytes']} B "
                      f"[{cell['platform']}: {cell['device']}]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
