"""Quick start: DP penalty MCMC on a logistic regression with 100000 rows.

Run with ``make demo`` (or ``.venv/bin/python examples/quickstart.py``).  It
prints the privacy spent, the posterior summary, and how far the private
posterior is from NumPyro's (non-private) NUTS on the same data.
"""

import time

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, init_to_median

import numpyro_dp as ndp
from numpyro_dp.metrics import mmd

N, D = 100_000, 2
EPSILON, DELTA = 1.0, 1e-6


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def simulate(seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, D))
    # Rows of norm <= 1: a row's log-likelihood ratio is then bounded by
    # |l_i(w') - l_i(w)| <= ||x_i|| ||w' - w|| <= h, so with llr_clip = 1 no ratio
    # is ever clipped and the penalty method targets the exact posterior.
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    w_true = np.array([1.5, -1.0])
    y = rng.uniform(size=N) < 1.0 / (1.0 + np.exp(-X @ w_true))
    return X.astype(np.float32), y.astype(np.float32)


def private_posterior(X, y, epsilon, progress_bar=True):
    # The private chain moves in small steps (the noise grows with the step), so
    # the warm-up must be long enough to walk from the prior median to the
    # posterior; every warm-up iteration is charged like a sampling iteration.
    kernel = ndp.DPPenalty(model, llr_clip=1.0, proposal_scale=0.002, proposal="guided",
                           init_strategy=init_to_median, adapt_covariance=False)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=4000, num_samples=2000, num_chains=4,
                           epsilon=epsilon, delta=DELTA, chain_method="vectorized",
                           progress_bar=progress_bar)
    start = time.time()
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    draws = np.asarray(mcmc.get_samples()["w"])
    print(f"DPPenalty at epsilon = {epsilon:g}: {time.time() - start:.1f} s")
    return mcmc, draws


def compare(draws, reference):
    """Distance between posterior means in NUTS sds, and the MMD."""
    distance = np.linalg.norm((draws.mean(0) - reference.mean(0)) / reference.std(0))
    return distance, mmd(draws[:: len(draws) // 1000], reference[:: len(reference) // 1000])


def main():
    X, y = simulate()
    mcmc, draws = private_posterior(X, y, EPSILON)

    print("Privacy spent:")
    print(mcmc.privacy_spent(), "\n")
    print("Private posterior:")
    mcmc.print_summary()

    start = time.time()
    nuts = MCMC(NUTS(model), num_warmup=500, num_samples=2000, num_chains=4,
                chain_method="vectorized", progress_bar=False)
    nuts.run(jax.random.PRNGKey(1), X, y=y)
    reference = np.asarray(nuts.get_samples()["w"])
    print(f"Non-private NUTS reference: {time.time() - start:.1f} s")

    mean, sd = reference.mean(0), reference.std(0)
    print(f"{'':6}{'DP mean':>10}{'DP sd':>10}{'NUTS mean':>12}{'NUTS sd':>10}")
    for j in range(D):
        print(f"w[{j}]  {draws[:, j].mean():10.4f}{draws[:, j].std():10.4f}"
              f"{mean[j]:12.4f}{sd[j]:10.4f}")
    distance, discrepancy = compare(draws, reference)
    print(f"distance between posterior means: {distance:.2f} NUTS posterior sds")
    print(f"MMD(DP, NUTS) = {discrepancy:.3f} (0 = same distribution)\n")

    # The price of privacy: the same run with a 10x larger budget.
    _, looser = private_posterior(X, y, 10 * EPSILON, progress_bar=False)
    distance, discrepancy = compare(looser, reference)
    print(f"  distance {distance:.2f} NUTS sds, MMD {discrepancy:.3f}\n")

    idata = ndp.to_inference_data(mcmc)
    print("InferenceData groups:", idata.groups(),
          "(no observed_data, no log_likelihood)")
    print(f"epsilon in attrs: {idata.attrs['epsilon']:.4f}")


if __name__ == "__main__":
    main()
