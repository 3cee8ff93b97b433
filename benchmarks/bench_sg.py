"""Benchmark: minibatch kernels cost per iteration independent of n.

Bayesian linear regression with d = 10 covariates (float32).  For
n = 1e5, 1e6, 1e7 rows and b = 1000 it times ``K`` iterations of the kernels'
``sample_fn`` inside one jitted ``lax.scan`` (data passed as jit arguments),
median of ``--repeats`` runs after compiling:

* DPSGLD (Poisson, buffer for overflow < 1e-12) and DPSGLD (without replacement);
* DPSGHMC (Poisson), reported per step (one gradient release each);
* peer: DPHMC on the same n, per gradient evaluation (``num_steps + 1`` per
  iteration, full data) -- the ratio "SG step / DPHMC gradient" is the
  saving of a minibatch gradient over a full-data one in the same run.

Target: the DPSGLD time at n = 1e7 is within 2x of n = 1e5 (cost O(b)).

Usage::

    .venv/bin/python benchmarks/bench_sg.py [--sizes 1e5 1e6 1e7] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import numpyro_dp as ndp
from numpyro_dp.primitives.secret import draw_secret


def model(X, y):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def per_iteration_seconds(kernel, args, iters, repeats):
    """Median seconds per iteration of ``kernel.sample`` in a jitted scan.

    Times the sampler alone: the kernel is armed by hand (nothing it computes
    leaves this function), with the inputs PrivateMCMC would pass it.
    """
    pm = kernel.prepare(args, {})
    inputs = kernel.run_inputs(pm.private_inputs(args, {}), draw_secret())
    with kernel.armed(object()):
        state = kernel.init(jax.random.PRNGKey(0), 0, None, (inputs,), {})

        @jax.jit
        def loop(state, inputs):
            return jax.lax.scan(lambda s, _: (kernel.sample(s, (inputs,), {}), None), state,
                                None, length=iters)[0]

        jax.block_until_ready(loop(state, inputs))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(loop(state, inputs))
            times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6, 1e7])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    b, d = 1000, 10
    print(f"{'n':>10} {'SGLD pois':>10} {'SGLD wor':>10} {'SGHMC/step':>11} "
          f"{'HMC/grad':>10} {'SGLD/HMCgrad':>12}   (ms)")
    for n in (int(s) for s in opts.sizes):
        X = rng.normal(size=(n, d)).astype(np.float32) / np.sqrt(d)
        y = (X @ np.linspace(1, -1, d) + rng.normal(size=n)).astype(np.float32)
        # On the device once: a NumPy argument would be copied in at every call, an
        # O(n) cost per timed loop that is not the kernel's.
        args = (jnp.asarray(X), jnp.asarray(y))
        sg = {"step_size": 1e-5, "batch_size": b, "grad_clip": 5.0}
        sgld_p = per_iteration_seconds(ndp.DPSGLD(model, **sg), args, opts.iters, opts.repeats)
        sgld_w = per_iteration_seconds(
            ndp.DPSGLD(model, **sg, batching="without_replacement"), args,
            opts.iters, opts.repeats)
        sghmc = per_iteration_seconds(ndp.DPSGHMC(model, **{**sg, "step_size": 1e-3},
                                                  num_steps=5), args,
                                      opts.iters, opts.repeats) / 5
        hmc_iters = max(2, opts.iters // max(1, n // 100_000))
        hmc = per_iteration_seconds(
            ndp.DPHMC(model, step_size=1e-3, num_steps=5, grad_clip=5.0, llr_clip=1.0,
                      noise_multiplier_grad=10.0, noise_multiplier_llr=10.0, adapt_step_size=False,
                      adapt_mass_matrix=False), args, hmc_iters, opts.repeats) / 6
        print(f"{n:>10} {1e3 * sgld_p:>10.3f} {1e3 * sgld_w:>10.3f} {1e3 * sghmc:>11.3f} "
              f"{1e3 * hmc:>10.3f} {sgld_p / hmc:>12.4f}", flush=True)


if __name__ == "__main__":
    main()
