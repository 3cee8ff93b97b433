"""Benchmark: ``ndp.NoiseAwareNUTS`` end to end against NumPyro's NUTS on the same data.

Issue 37's speed target: for n >= 10,000 the private route, end to end (the tuning and
score releases, a few passes over the rows each, then NUTS on the surrogate, which never
touches them), takes at most NUTS's wall time on the same model and data.

Each (model, n) runs in its own process: NumPyro's ``MCMC(NUTS(model))`` and
``PrivateMCMC(NoiseAwareNUTS(model), epsilon=3, delta=1e-6)`` with the same
``num_warmup``, ``num_samples``, ``num_chains`` and ``chain_method="vectorized"``,
interleaved, each twice: the first run (``cold``) is what a notebook cell costs, XLA
compilation included; the second (``warm``, a new ``MCMC`` / ``PrivateMCMC`` on the same
model and data, with a new release: NumPyro's NUTS compiles its loop again, the private
route's programs take the release's numbers as arguments and compile nothing) is a re-run.
The ratio is the private route's wall time over NUTS's in the same process.

Models (``utility_real_data``'s, with its priors; float32, covariates in [-1, 1],
simulated: the cost does not depend on the values):

``logistic``
    ``y ~ Bernoulli(logit = b0 + X w)``, 10 covariates;
``linear``
    ``y ~ Normal(b0 + X w, sigma)``, 5 covariates, ``sigma ~ HalfNormal(2)``.

Usage::

    .venv/bin/python benchmarks/bench_noise_aware.py --out docs/results/bench_noise_aware
    .venv/bin/python benchmarks/bench_noise_aware.py --models logistic --n 10000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

EPSILON, DELTA = 3.0, 1e-6


def data(model: str, n: int):
    import numpy as np
    from utility_real_data import linear, logistic  # the real-data benchmark's priors

    rng = np.random.default_rng(0)
    d = 10 if model == "logistic" else 5
    X = rng.uniform(-1.0, 1.0, (n, d)).astype(np.float32)
    w = rng.normal(0.0, 1.0, d)
    if model == "logistic":
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(0.3 + X @ w)))).astype(np.float32)
        return logistic, X, y
    y = (0.3 + X @ w + rng.normal(0.0, 0.5, n)).astype(np.float32)
    return linear, X, y


def run_one(model_name: str, n: int, num_warmup: int, num_samples: int,
            num_chains: int) -> dict:
    """One (model, n): NUTS and the private route, interleaved, cold then warm."""
    import jax
    from numpyro.infer import MCMC, NUTS

    import numpyro_dp as ndp

    model, X, y = data(model_name, n)
    settings = dict(num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                    chain_method="vectorized", progress_bar=False)

    def nuts(seed):
        mcmc = MCMC(NUTS(model), **settings)
        t0 = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(seed), X, y)
        jax.block_until_ready(mcmc.get_samples())
        return time.perf_counter() - t0

    def private(seed):
        # reproducible: a release refused after the charge (secret noise can draw one)
        # would end the run before sampling, and its time would not be the route's
        mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), epsilon=EPSILON, delta=DELTA,
                               reproducible_noise=True, **settings)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc.run(jax.random.PRNGKey(seed), X, y)
        jax.block_until_ready(mcmc.get_samples())
        return time.perf_counter() - t0

    out = {"model": model_name, "n": n, "num_warmup": num_warmup,
           "num_samples": num_samples, "num_chains": num_chains}
    for phase, seed in (("cold", 0), ("warm", 1)):
        out[f"nuts_{phase}_s"] = nuts(seed)
        out[f"private_{phase}_s"] = private(seed)
        out[f"ratio_{phase}"] = out[f"private_{phase}_s"] / out[f"nuts_{phase}_s"]
    return out


def write(rows: list[dict], out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| model | n | NUTS (s) | NoiseAwareNUTS (s) | ratio | NUTS, re-run (s) | "
             "NoiseAwareNUTS, re-run (s) | ratio, re-run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['n']:,} | {r['nuts_cold_s']:.1f} | "
                     f"{r['private_cold_s']:.1f} | {r['ratio_cold']:.2f} | "
                     f"{r['nuts_warm_s']:.1f} | {r['private_warm_s']:.1f} | "
                     f"{r['ratio_warm']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["logistic", "linear"])
    parser.add_argument("--n", nargs="+", type=int, default=[10_000, 100_000])
    parser.add_argument("--num-warmup", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--num-chains", type=int, default=4)
    parser.add_argument("--out", default="bench_noise_aware")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # model n: child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.num_warmup,
                                 args.num_samples, args.num_chains)))
        return
    rows = []
    for model in args.models:
        for n in args.n:
            child = subprocess.run(
                [sys.executable, __file__, "--one", model, str(n),
                 "--num-warmup", str(args.num_warmup), "--num-samples", str(args.num_samples),
                 "--num-chains", str(args.num_chains)],
                capture_output=True, text=True)
            if child.returncode:
                sys.exit(f"{model} at n = {n} failed:\n{child.stderr}")
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    write(rows, Path(args.out))


if __name__ == "__main__":
    main()
