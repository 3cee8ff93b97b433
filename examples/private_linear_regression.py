"""Private linear regression: raw data -> one DP release -> NUTS posterior -> ArviZ plots.

Three hospitals (J = 3) each hold 20000 patients.  Each releases its noisy
X^T X and X^T y once at epsilon = 1; the analyst runs NumPyro's NUTS on the
noise-aware fixedS model (post-processing: no further privacy cost) and
compares with the non-private least-squares fit.

    python examples/private_linear_regression.py   # writes private_linreg.png
"""

import arviz as az
import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from jax import random  # noqa: E402

import numpyro_dp as ndp  # noqa: E402

rng = np.random.default_rng(0)
n, d = 60_000, 3
X = rng.uniform(-1, 1, size=(n, d))  # covariates measured on [-1, 1] scales
y = X @ np.array([0.8, -0.5, 0.2]) + 0.3 * rng.normal(size=n)

# 1. release: bounds fixed a priori (|x_k| <= 1 by design, |y| <= 3 by protocol)
# (charged to the ledger before any noise is drawn; the noise comes from an OS secret)
ledger = ndp.PrivacyLedger(delta=1e-6, neighbourhood="substitute")
# three data holders (e.g. hospitals), each with its own rows; rows beyond the bounds
# are projected onto them as part of the mechanism
Xs, ys = np.array_split(X, 3), np.array_split(y, 3)
release = ndp.linreg.release_linreg_stats(
    random.PRNGKey(0), Xs, ys, x_bound=np.sqrt(d), y_bound=3.0,
    epsilon=1.0, delta=1e-6, ledger=ledger,
)
print(ledger.spent())

# 2. posterior from the release alone
mcmc = ndp.linreg.fit(random.PRNGKey(1), release, "fixedS", num_warmup=500, num_samples=1000)
idata = az.from_numpyro(mcmc)
print(az.summary(idata, var_names=["theta", "sigma_y2"]))
print("least squares on the raw data:", np.linalg.lstsq(X, y, rcond=None)[0].round(3))

# 3. posterior predictive for new patients
X_new = np.array([[0.5, 0.5, 0.5], [-1.0, 0.0, 1.0]])
draws = ndp.linreg.posterior_predictive(
    random.PRNGKey(2), mcmc.get_samples()["theta"], mcmc.get_samples()["sigma_y2"], X_new
)
print("predictive mean", draws.mean(0).round(3), "sd", draws.std(0).round(3))

az.plot_posterior(idata, var_names=["theta", "sigma_y2"])
matplotlib.pyplot.savefig("private_linreg.png", dpi=100)
