"""``make demo``: plan, run the recommended route, and hold it up against NUTS.

statsmodels' ``fair`` survey (n = 6,366 women; did she have an affair?), a logistic
regression on eight answers scaled by the code book's ranges (public constants), at
epsilon = 3 and delta = 1e-6:

1. ``ndp.plan`` reads public facts only and recommends a route (at this size and
   budget: ``NoiseAwareNUTS``, one release of the score and curvature, then NUTS for
   free) with the error it expects;
2. ``PrivateMCMC(plan.kernel, ...)`` makes the release, charged to the budget, and
   samples the noise-aware posterior;
3. NUTS on the same public benchmark (never on private data) is the yardstick: each
   parameter's error in NUTS sds, its sd ratio and whether NUTS's mean lies inside the
   private 90% interval.

CPU only; about 40 seconds on two cores.  Run it with ``make demo``.
"""

import time
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import statsmodels.api as sm

import numpyro_dp as ndp

EPSILON, DELTA = 3.0, 1e-6
RANGES = {"rate_marriage": (1, 5), "age": (17.5, 42), "yrs_married": (0.5, 23),
          "children": (0, 5.5), "religious": (1, 4), "educ": (9, 20),
          "occupation": (1, 6), "occupation_husb": (1, 6)}  # the code book

df = sm.datasets.fair.load_pandas().data
X = np.stack([(df[c] - (a + b) / 2) / ((b - a) / 2) for c, (a, b) in RANGES.items()],
             axis=1).astype(np.float32)
y = (df["affairs"] > 0).to_numpy(np.float32)


def model(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0, 5))
    w = numpyro.sample("w", dist.Normal(0, 2.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + X @ w), obs=y)


def flat(samples):
    return np.concatenate([np.asarray(samples["b0"])[:, None], np.asarray(samples["w"])],
                          axis=1)


if __name__ == "__main__":
    plan = ndp.plan(model, X, y, epsilon=EPSILON, delta=DELTA, num_warmup=500,
                    num_samples=1000)
    print(plan, end="\n\n")

    t0 = time.perf_counter()
    mcmc = ndp.PrivateMCMC(plan.kernel, num_warmup=500, num_samples=1000, num_chains=4,
                           chain_method="vectorized", epsilon=EPSILON, delta=DELTA,
                           progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ndp.CalibrationWarning)
        mcmc.run(jax.random.PRNGKey(0), X, y)
    private_wall = time.perf_counter() - t0
    for w in caught:
        print(f"{w.category.__name__}: {w.message}\n")
    print(mcmc.privacy_spent(), end="\n\n")
    print(mcmc.mixing, end="\n\n")

    t0 = time.perf_counter()
    nuts = numpyro.infer.MCMC(numpyro.infer.NUTS(model), num_warmup=500, num_samples=1000,
                              num_chains=4, chain_method="vectorized", progress_bar=False)
    nuts.run(jax.random.PRNGKey(1), X, y)
    nuts_wall = time.perf_counter() - t0

    private, exact = flat(mcmc.get_samples()), flat(nuts.get_samples())
    mu, sd = exact.mean(0), exact.std(0)
    err = (private.mean(0) - mu) / sd
    lo, hi = np.quantile(private, 0.05, axis=0), np.quantile(private, 0.95, axis=0)
    names = ["b0"] + [f"w[{k}] {c}" for k, c in enumerate(RANGES)]
    print(f"{'parameter':24s} {'NUTS':>8s} {'private':>8s} {'error':>7s} {'sd ratio':>9s} "
          f"{'NUTS in private 90%':>20s}")
    for k, name in enumerate(names):
        print(f"{name:24s} {mu[k]:8.3f} {private[:, k].mean():8.3f} {err[k]:7.2f} "
              f"{private[:, k].std() / sd[k]:9.2f} {str(bool(lo[k] <= mu[k] <= hi[k])):>20s}")
    inside = np.mean((lo <= mu) & (mu <= hi))
    print(f"\nRMS error {np.sqrt(np.mean(err**2)):.2f} NUTS sds (the planner expected about "
          f"{plan.expected_error_sds:.2f}); NUTS's mean inside the private 90% interval for "
          f"{inside:.0%} of the parameters; wall time {private_wall:.1f} s private, "
          f"{nuts_wall:.1f} s NUTS.")
