"""Quickstart: differentially private Bayesian logistic regression with numpyro-dp.

Fits a NumPyro logistic regression to n = 100000 simulated rows with the DP
penalty kernel at epsilon = 1, delta = 0.1 / n, then compares the private
posterior with a non-private NumPyro NUTS run on the same data.  CPU only;
about a minute on two cores.  Run it with ``make demo`` or
``.venv/bin/python examples/quickstart.py``.

Why these settings (see the comments below for the details)
-----------------------------------------------------------
At epsilon = 1 every iteration's log-likelihood ratio is released with a lot
of noise: the noise multiplier z grows like sqrt(total iterations over all
chains), and to keep the noise affordable the proposal steps must shrink like
1/z.  The chain then needs a number of iterations proportional to z^2 to
relax, so the number of relaxation times a run gets does not grow with more
iterations; it grows with n and epsilon^2 and shrinks with the number of
parameters (about like 1/d^2) and of chains.  With n = 1e5 and 4 chains this
leaves room for about 10 relaxation times when d = 2: enough to walk from the
prior median (about 80 posterior sds away) to the posterior during warm-up and
then sample it, but with only ~5-20 effective draws per coordinate, so the
distance to NUTS varies from run to run (0.1 to 0.8 posterior sds in our
trials).  With d = 3 or 4 the chains are still on their way at the end.
"""

import os
import time

import dp_accounting as dpa
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS, init_to_median

import numpyro_dp as ndp
from numpyro_dp.evaluation.diagnostics import mmd

if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")  # the example is meant for CPU

# ------------------------------------------------------------------ data
N, D = 100_000, 2
B = 0.5  # bound on the covariate norms: ||x_i|| <= B
W_TRUE = np.array([1.5, -1.0])
EPSILON, DELTA = 1.0, 0.1 / N  # delta = 0.1 / n = 1e-6

rng = np.random.default_rng(20240501)
X = rng.normal(size=(N, D))
# Rows with ||x_i|| > B are scaled onto the sphere of radius B.
X *= B / np.maximum(B, np.linalg.norm(X, axis=1, keepdims=True))
y = (rng.uniform(size=N) < 1.0 / (1.0 + np.exp(-X @ W_TRUE))).astype(np.float32)
X = X.astype(np.float32)


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


# ------------------------------------------------------- private sampling
# Clipping.  Row i's log-likelihood l_i(w) = y_i x_i.w - log(1 + exp(x_i.w)) is
# ||x_i||-Lipschitz in w, so |l_i(w') - l_i(w)| <= ||x_i|| ||w' - w|| <= B h for
# a step of length h.  With llr_clip = B no ratio is ever clipped, and then the
# penalty method is exact: the Gaussian noise on the log-likelihood ratio is
# corrected for in the acceptance (the -sigma^2/2 term), so the chain targets
# the ordinary posterior; the noise only slows it down.
LLR_CLIP = B

# Iterations.  Every iteration of every chain, warm-up included, is one
# Gaussian release charged to the budget.  The chains start at the prior
# median, far (~80 posterior sds) from the posterior, and walk there slowly, so
# most of the run is warm-up.
NUM_WARMUP, NUM_SAMPLES, NUM_CHAINS = 3000, 2000, 4
TOTAL = NUM_CHAINS * (NUM_WARMUP + NUM_SAMPLES)

# Proposal scale.  A step of length h releases the clipped ratio with noise
# sigma = z * Delta, Delta = 2 * LLR_CLIP * h (substitute-one neighbours), and the
# acceptance pays sigma^2 / 2.  Near the posterior the drift of the chain is
# largest for sigma ~ 2.4 (it maximises h^2 Phi(-sigma/2); the acceptance rate is
# then ~0.23 for a random walk, ~0.44 for the guided walk).  The noise
# multiplier z depends only on the budget and TOTAL, never on the data, so the
# scale can be set before the run instead of being adapted: the kernel's
# warm-up adaptation tunes it from nearly binary noisy acceptance decisions and
# lands far from this value (see the report).  PrivateMCMC calibrates exactly
# this z below.
z = ndp.calibrate_noise_multiplier(
    lambda z: dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), TOTAL), EPSILON, DELTA
)
SIGMA_TARGET = 2.4
proposal_scale = SIGMA_TARGET / (2.0 * z * LLR_CLIP)

kernel = ndp.DPPenalty(
    model,
    llr_clip=LLR_CLIP,
    proposal_scale=proposal_scale,
    # One coordinate per step, keeping its direction while proposals are
    # accepted: moves ballistically towards the posterior during warm-up.
    proposal="guided",
    adapt_step_size=False,
    adapt_mass_matrix=False,  # warm-up draws are mostly transit: a poor covariance
    # Data-free start: the median of 1000 prior draws (~ the prior median, 0).
    init_strategy=init_to_median(num_samples=1000),
)
mcmc = ndp.PrivateMCMC(
    kernel,
    num_warmup=NUM_WARMUP,
    num_samples=NUM_SAMPLES,
    num_chains=NUM_CHAINS,
    epsilon=EPSILON,
    delta=DELTA,
    chain_method="vectorized",  # all chains in one process (CPU)
    progress_bar=False,
)
t0 = time.perf_counter()
mcmc.run(jax.random.PRNGKey(0), X, y=y, extra_fields=("accept_prob",))
dp_draws = np.asarray(mcmc.get_samples()["w"])
t_dp = time.perf_counter() - t0

print("=" * 72)
print(f"DP penalty kernel: n={N}, d={D}, ||x_i|| <= {B}, llr_clip={LLR_CLIP}")
print(
    f"{NUM_CHAINS} chains x ({NUM_WARMUP} warm-up + {NUM_SAMPLES}) iterations, "
    f"noise multiplier z={mcmc.sampler.noise_multiplier:.1f} (planned {z:.1f}), "
    f"proposal_scale={proposal_scale:.3g}, {t_dp:.1f} s"
)
spent = mcmc.privacy_spent()
print("\nPrivacy spent:")
print(spent)
print("\nPrivate posterior:")
mcmc.print_summary()

# ------------------------------------------------ non-private reference
t0 = time.perf_counter()
nuts = MCMC(
    NUTS(model),
    num_warmup=500,
    num_samples=2000,
    num_chains=4,
    chain_method="vectorized",
    progress_bar=False,
)
nuts.run(jax.random.PRNGKey(1), X, y=y)
ref_draws = np.asarray(nuts.get_samples()["w"])
t_nuts = time.perf_counter() - t0

m_dp, s_dp = dp_draws.mean(0), dp_draws.std(0)
m_ref, s_ref = ref_draws.mean(0), ref_draws.std(0)
print("=" * 72)
print(f"Comparison with non-private NUTS (4 x 2000 draws, {t_nuts:.1f} s), true w = {W_TRUE}")
print(f"{'':6s} {'DP mean':>9s} {'DP sd':>8s} {'NUTS mean':>10s} {'NUTS sd':>8s} {'diff/sd':>8s}")
for j in range(D):
    print(
        f"w[{j}]   {m_dp[j]:9.4f} {s_dp[j]:8.4f} {m_ref[j]:10.4f} {s_ref[j]:8.4f} "
        f"{(m_dp[j] - m_ref[j]) / s_ref[j]:8.2f}"
    )
distance = float(np.linalg.norm((m_dp - m_ref) / s_ref))
print(f"Distance between posterior means: {distance:.2f} NUTS posterior sds")
# The private chains mix slowly (see the top of this file), so their posterior
# mean carries a Monte Carlo error of about sd / sqrt(ESS) per coordinate.
ess = effective_sample_size(np.asarray(mcmc.get_samples(group_by_chain=True)["w"]))
expected = float(np.sqrt(np.sum((s_dp / s_ref) ** 2 / ess)))
print(
    f"  (DP effective sample size per coordinate {np.round(ess, 1)}: Monte Carlo error "
    f"alone gives a distance of about {expected:.2f} sds)"
)


def thin(draws, size=1000):
    return draws[:: max(1, len(draws) // size)][:size]


distance_mmd = mmd(thin(dp_draws), thin(ref_draws))
print(f"MMD(DP draws, NUTS draws), 1000 thinned draws each: {distance_mmd:.3f}")
half = len(ref_draws) // 2  # NUTS draws are grouped by chain: chains 1-2 vs 3-4
floor = mmd(thin(ref_draws[:half]), thin(ref_draws[half:]))
print(f"  (for scale: MMD between NUTS chains 1-2 and 3-4: {floor:.3f})")

# ------------------------------------------------------------ ArviZ export
idata = ndp.to_inference_data(mcmc)
groups = list(idata.groups())
print("=" * 72)
print(
    f"InferenceData groups: {groups}; observed_data: {'observed_data' in groups}, "
    f"log_likelihood: {'log_likelihood' in groups}"
)
print(f"idata.attrs epsilon={idata.attrs['epsilon']:.4g}, delta={idata.attrs['delta']:.3g}")
