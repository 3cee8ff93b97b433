"""Choose a statistic, release it once, infer from it, plot (paper 002, ch. 4-5).

The private rows are measurements x_i ~ N(0, theta) whose variance theta we
want, known by protocol to lie in (-10, 10).  Which sum should we release at
epsilon = 1: of x^2 (sufficient) or of |x|?  The Fisher information of each
noisy release says |x| (x^2's range is 10 times larger, and so is its noise).
One Laplace release of sum |x_i| is charged; MHAAR then samples the exact
posterior of theta given it, at no further cost.

    python examples/released_statistic.py   # writes released_statistic.png
"""

import arviz as az
import matplotlib

matplotlib.use("Agg")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from jax.scipy.special import gammaln  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

import numpyro_dp as ndp  # noqa: E402

BOUND, N, EPSILON = 10.0, 1000, 1.0  # public: the protocol's range, n, the budget
x = np.clip(np.random.default_rng(0).normal(0.0, np.sqrt(2.0), N), -BOUND, BOUND)  # private


def abs_power(a):
    """s(x) = |x|^a under N(0, theta): its public mean and variance per row."""
    g = lambda k: jnp.exp(gammaln((k + 1) / 2)) / jnp.sqrt(jnp.pi)  # noqa: E731
    return ndp.fisher.Statistic(f"|x|^{a}", mean=lambda t: (2 * t) ** (a / 2) * g(a),
                                cov=lambda t: (2 * t) ** a * (g(2 * a) - g(a) ** 2),
                                sensitivity=BOUND**a)  # l1, add/remove: one row's range


# 1. choose (public: a guess of theta, no row is read)
ranked = ndp.fisher.rank_statistics([abs_power(1), abs_power(2)], theta=2.0, num_rows=N,
                                    epsilon=EPSILON, noise="laplace")
best = ranked[0]
print("Fisher information:", {r.name: round(float(r.fisher[0, 0]), 2) for r in ranked})

# 2. release once (charged before any noise is drawn)
ledger = ndp.PrivacyLedger(delta=1e-6, neighbourhood="add_remove")
a = 1 if best.name == "|x|^1" else 2
release = ndp.mechanisms.laplace_mechanism(
    jax.random.PRNGKey(0), np.sum(np.abs(x) ** a), BOUND**a, epsilon=EPSILON,
    neighbourhood="add_remove", ledger=ledger)


# 3. infer: the sum's central-limit law, the release observed under its own noise
def model(n):
    theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
    stat = abs_power(a)
    total = numpyro.sample("total", dist.Normal(n * stat.mean(theta),
                                                jnp.sqrt(n * stat.cov(theta))))
    numpyro.sample("release", release.likelihood(total), obs=release.value)


mcmc = MCMC(ndp.MHAAR(model, latent_sites=["total"], num_particles=8), num_warmup=1000,
            num_samples=5000, num_chains=4, chain_method="vectorized", progress_bar=False)
mcmc.run(jax.random.PRNGKey(1), N)  # post-processing of the release: costs nothing

# 4. plot (safe: the model saw only the release)
idata = az.from_numpyro(mcmc)
print(az.summary(idata, var_names=["theta"]))
print(f"epsilon spent: {ledger.spent().epsilon:.3f} (one release)")
az.plot_posterior(idata, var_names=["theta"], ref_val=2.0)
matplotlib.pyplot.savefig("released_statistic.png", dpi=100)
