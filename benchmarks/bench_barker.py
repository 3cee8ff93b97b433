"""Benchmark: a DPBarker iteration costs O(b), independent of n.

Heikkila et al.'s Gaussian mixture model (``tests/kernels/test_barker.py``), b = 1000,
float32.  Reports, for n = 1e5, 1e6 and 1e7 rows,

* DPBarker : the kernel's ``sample_fn`` (batch drawn without replacement,
  2 b row log-likelihoods, Barker test);

and, at n = 1e6,

* peer     : one jitted full-data log-likelihood
  ``sum_i log p(x_i | theta)`` through ``PrivateModel.log_density_terms``.

Every quantity is evaluated ``K`` times inside one jitted ``lax.scan`` whose
state changes every step (so XLA cannot hoist the work out of the loop), with
the data passed as jit arguments.  Each is compiled first, then timed
``--repeats`` times, interleaved across sizes so that load on a shared machine
hits all of them alike; the median per-iteration time is reported.

Usage::

    .venv/bin/python benchmarks/bench_barker.py [--repeats 7] [--json out.json]

Targets: max/min of the DPBarker times over n below 1.3; the ratio to the
full-data peer at n = 1e6 shows what subsampling saves.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, "tests")
from test_barker import mixture_model  # noqa: E402

from numpyro_dp.kernels.barker import dp_barker  # noqa: E402
from numpyro_dp.model.adapter import PrivateModel  # noqa: E402
from numpyro_dp.primitives.secret import draw_secret  # noqa: E402

SIZES = (10**5, 10**6, 10**7)
BATCH = 1000
K_KERNEL, K_PEER = 2000, 20
TARGET_SPREAD = 1.3


def data(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = np.where(rng.uniform(size=n) < 0.5, 0.0, 1.0) + np.sqrt(2.0) * rng.normal(size=n)
    return x.astype(np.float32)


#: The run secret the kernel's noise comes from (nothing leaves this benchmark).
SECRET = draw_secret()


def kernel_timer(x: np.ndarray):
    pm = PrivateModel(mixture_model, (x,), {})
    init_fn, sample_fn = dp_barker(pm, 0, batch_size=BATCH, n0=100.0, proposal_scale=0.1)
    params = {"theta1": jnp.array(0.0), "theta2": jnp.array(1.0)}
    state = init_fn(params, jax.random.PRNGKey(0))

    @jax.jit
    def run(state, x):
        def body(s, _):
            return sample_fn(s, (x,), {}, SECRET), None

        return lax.scan(body, state, None, length=K_KERNEL)[0]

    x = jnp.asarray(x)
    return lambda: run(state, x).z["theta1"].block_until_ready(), K_KERNEL


def peer_timer(x: np.ndarray):
    pm = PrivateModel(mixture_model, (x,), {})

    @jax.jit
    def run(t, x):
        def body(t, _):
            ll = jnp.sum(pm.log_density_terms({"theta1": t, "theta2": 1.0}, (x,), {}).loglik_rows)
            return t + 1e-6 * jnp.tanh(ll), None  # the next point depends on this one

        return lax.scan(body, t, None, length=K_PEER)[0]

    x = jnp.asarray(x)
    return lambda: run(jnp.array(0.0), x).block_until_ready(), K_PEER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

    timers = {f"DPBarker n={n:.0e}": kernel_timer(data(n)) for n in SIZES}
    timers["peer full log-lik n=1e+06"] = peer_timer(data(10**6))
    for fn, _ in timers.values():
        fn()  # compile
    times = {name: [] for name in timers}
    for _ in range(args.repeats):
        for name, (fn, k) in timers.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / k * 1e3)
    ms = {name: float(np.median(t)) for name, t in times.items()}
    kernel = [ms[f"DPBarker n={n:.0e}"] for n in SIZES]
    spread = max(kernel) / min(kernel)
    peer = ms["peer full log-lik n=1e+06"]
    for name, v in ms.items():
        print(f"{name:28s} {v:9.4f} ms per iteration/evaluation (median of {args.repeats})")
    print(f"DPBarker max/min over n: {spread:.3f} (target < {TARGET_SPREAD})")
    print(f"DPBarker iteration / full-data log-likelihood at n = 1e6: "
          f"{ms['DPBarker n=1e+06'] / peer:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": ms, "times_ms": times, "spread": spread,
                       "ratio_to_peer_1e6": ms["DPBarker n=1e+06"] / peer,
                       "machine": platform.platform(), "jax": jax.__version__}, f, indent=1)
    if spread >= TARGET_SPREAD:
        sys.exit(f"per-iteration time depends on n: max/min {spread:.3f} >= {TARGET_SPREAD}")


if __name__ == "__main__":
    main()
