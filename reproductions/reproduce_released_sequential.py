"""Paper 002, s6.4 / Figure 6.4: rows released one by one (local DP), |x| against x^2.

The setting of Example 4 and s6.4: x_t ~ N(0, theta*), theta* = 2, n = 100
rows clipped to [-A, A], A = 10.  Each row's statistic is released on its own
with Laplace noise (the sequential release of s4.2.4, eq. 4.9),

    y_t = s(x_t) + Laplace(b),   s(x) = |x| (in [0, 10], b = 10 / epsilon)
                                 or s(x) = x^2 (in [0, 100], b = 100 / epsilon),

so that each row's release is epsilon-DP on its own (local DP).  theta is
inferred from the n releases alone by ``ndp.MHAAR`` on a NumPyro model whose
latent rows are reparametrised (z_t ~ N(0, 1), x_t = clip(sqrt(theta) z_t,
-A, A)) inside one plate, which the kernel detects: it averages its particles
row by row and keeps one particle per row (Algorithm 13).  Over M simulated
data sets and releases, the MSE of the posterior mean of theta (left panel)
is set beside the Fisher information F(theta*) of the n releases (right
panel), from ``numpyro_dp.releases.fisher.sequential_release_fisher``
(quadrature, exact where the thesis's Algorithm 8 estimates it).  The thesis's
claim (Figure 6.4, text): the statistic with the larger F has the smaller MSE;
its Example 4 finds |x| the more informative under privacy.

The releases are made with ``ndp.mechanisms.laplace_mechanism`` on the vector
of the n rows' statistics, sensitivity A_s (= 10 or 100: one row substituted
moves one coordinate by at most A_s), which adds independent Laplace(A_s /
epsilon) noise to every coordinate: the same noise, row by row, as n separate
epsilon-DP local releases (its scale, ``Release.scale``, carries the
mechanism's rounding allowance, a relative 1e-15).  ``reproducible_noise=True``:
this is a simulation on synthetic data, never a private release.

The chains: one MHAAR chain per release, the kernel's own ``init`` and
``sample`` vectorised over the M releases with ``jax.vmap`` inside a
``lax.scan`` and compiled once (statistic, noise scale and release are
arguments), every chain started at theta*, its random-walk step on
logit(theta / 20) starting at 0.3 and adapted toward an acceptance of 0.3
during warm-up.  The left panel's references: 1 / F(theta*) per statistic,
the MSE of the prior mean 10 as the estimate (what no information gives), and
the MSE of the noise-free MLE mean(x^2) on the same data sets (CSV
``no_noise_mse``; 2 theta*^2 / n = 0.08 in expectation).

Differences from the thesis (its settings in brackets):

* epsilon in {0.5, 1, 2, 5, 10, 20, 50} (the thesis does not state its
  figure's x-axis values; the same grid as ``reproduce_released_selection.py``
  up to 50).
* M = 30 data sets per (statistic, epsilon) cell (M = 10^4); MHAAR with
  N = 32 particles per row (10^4); 1000 warm-up + 2000 iterations per chain
  (not stated).  The MSE's Monte Carlo standard error is in the CSV.
* The prior is theta ~ Uniform(0, 20) ("uninformative"); at small epsilon the
  releases say little and the posterior mean is pulled toward the prior's
  mean 10, so the MSE there measures the prior as much as the statistic.
* The right panel is F(theta*) against epsilon at theta* = 2, the x-axis of
  the left panel (the thesis's panel is "F(theta)", axis not stated).  Its
  F treats a row as N(0, theta) truncated to [-A, A] (the quadrature
  renormalises on the support); the data and the model clip instead, which
  differs by P(|x| > 10) = 2e-12 at theta = 2.
* The same M data sets x serve every epsilon and both statistics, and the
  Laplace noise of data set i comes from one key at every epsilon (paired
  comparisons: CSV ``paired_diff`` is x^2's squared error minus |x|'s, per
  data set, averaged).

    python reproductions/reproduce_released_sequential.py   # docs/results/released_sequential.*
    python reproductions/reproduce_released_sequential.py --quick --out-dir /tmp/seq
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import results_csv
from jax.scipy.stats import norm
from numpyro.diagnostics import effective_sample_size
from numpyro.distributions import biject_to, constraints
from release_chains import BatchedChains

import numpyro_dp as ndp
from numpyro_dp.primitives.secret import ReproducibleNoiseWarning
from numpyro_dp.releases.fisher import sequential_release_fisher

OUT = Path(__file__).resolve().parent.parent / "docs" / "results"
#: The thesis's s6.4 settings (Figure 6.4 has no table of numbers to copy).
A = 10.0  # rows lie in [-A, A]
N_ROWS = 100  # n
THETA_STAR = 2.0  # theta* (as in s6.1-6.3; s6.4 "the same structure")
THESIS_DATA_SETS = 10_000  # M
THESIS_PARTICLES = 10_000  # N latent particles
PRIOR_UPPER = 20.0  # theta ~ Uniform(0, PRIOR_UPPER) here ("uninformative" there)
POWERS = {"|x|": 1.0, "x^2": 2.0}  # s(x) = |x|^a
#: The random walk's initial step on logit(theta / 20); warm-up adapts it within x10 either way
#: (up to 3: at small epsilon the posterior is nearly the prior, and 1 is too short a step).
STEP_SIZE = 0.3
FIELDS = ["statistic", "epsilon", "noise_scale", "data_sets", "particles", "warmup",
          "samples", "mse", "mse_se", "bias", "sd_estimate", "fisher", "inverse_fisher",
          "paired_diff", "paired_diff_se", "no_noise_mse", "mcmc_var", "ess_median", "ess_min",
          "accept_prob", "seconds"]


@dataclasses.dataclass(frozen=True)
class Settings:
    epsilons: tuple = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
    data_sets: int = 30
    particles: int = 32
    warmup: int = 1000
    samples: int = 2000
    fisher_grid: int = 25  # epsilons of the right panel's curves


QUICK = Settings(epsilons=(2.0, 20.0), data_sets=4, particles=8, warmup=150, samples=250,
                 fisher_grid=0)


def model(y, b, power):
    """Algorithm 13's target (eq. 5.6): the rows reparametrised in one plate."""
    theta = numpyro.sample("theta", dist.Uniform(0.0, PRIOR_UPPER))
    with numpyro.plate("rows", y.shape[0]):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        x = jnp.clip(jnp.sqrt(theta) * z, -A, A)  # the data are clipped the same way
        numpyro.sample("y", dist.Laplace(jnp.abs(x) ** power, b), obs=y)


def release_rows(stats, bound, epsilon, seed):
    """Each data set's rows released one by one (local DP), as a user would:
    Laplace(bound / epsilon) on every row's statistic.  Returns (releases, scale)."""
    key = jax.random.PRNGKey(seed)
    values, scale = np.empty_like(stats), None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)  # a simulation
        for i, row_stats in enumerate(stats):
            r = ndp.mechanisms.laplace_mechanism(
                jax.random.fold_in(key, i), row_stats, bound, epsilon=epsilon,
                neighbourhood="substitute", reproducible_noise=True)
            values[i], scale = r.value, float(r.scale)
    return values, scale


def row_logpdf(x, theta):
    return norm.logpdf(x, 0.0, jnp.sqrt(theta))


def fisher(power, epsilon):
    """F(theta*) of the n releases of |x|^power at epsilon (b = A^power / epsilon)."""
    return float(sequential_release_fisher(
        row_logpdf, lambda x: jnp.abs(x) ** power, THETA_STAR, N_ROWS,
        A**power / epsilon, (-A, A))[0, 0])


def run(cfg: Settings, seed: int) -> list[dict]:
    M = cfg.data_sets
    rng = np.random.default_rng(seed)
    x = np.clip(rng.normal(0.0, math.sqrt(THETA_STAR), (M, N_ROWS)), -A, A)
    kernel = ndp.MHAAR(model, ["z"], num_particles=cfg.particles, step_size=STEP_SIZE)
    chains = BatchedChains(kernel, cfg.warmup, cfg.samples)
    z0 = np.full(M, float(biject_to(constraints.interval(0.0, PRIOR_UPPER)).inv(THETA_STAR)))
    # The reference without noise: the MLE mean(x^2) on the same data sets (its MSE
    # is 2 theta*^2 / n = 0.08 in expectation).
    no_noise_mse = float(np.mean(((x**2).mean(axis=1) - THETA_STAR) ** 2))
    rows = []
    for j, eps in enumerate(cfg.epsilons):
        errors = {}
        for name, power in POWERS.items():
            start = time.perf_counter()
            y, scale = release_rows(np.abs(x) ** power, A**power, eps, seed=1000 + seed)
            draws, accept = chains(100 * seed + j, z0, y, np.full(M, scale),
                                   np.full(M, power))
            means = draws.mean(axis=1)
            err = (means - THETA_STAR) ** 2
            ess = np.array([float(effective_sample_size(d[None])) for d in draws])
            f = fisher(power, eps)
            row = {"statistic": name, "epsilon": eps, "noise_scale": scale, "data_sets": M,
                   "particles": cfg.particles, "warmup": cfg.warmup, "samples": cfg.samples,
                   "mse": err.mean(), "mse_se": err.std(ddof=1) / math.sqrt(M),
                   "bias": means.mean() - THETA_STAR, "sd_estimate": means.std(ddof=1),
                   "fisher": f, "inverse_fisher": 1.0 / f, "no_noise_mse": no_noise_mse,
                   # the MCMC's own share of the MSE: posterior variance / ESS, averaged
                   "mcmc_var": float(np.mean(draws.var(axis=1) / ess)),
                   "ess_median": float(np.median(ess)), "ess_min": float(ess.min()),
                   "accept_prob": float(accept.mean())}
            errors[name] = err
            if name == "x^2":  # paired by data set (and noise key)
                d = err - errors["|x|"]
                row["paired_diff"] = d.mean()
                row["paired_diff_se"] = d.std(ddof=1) / math.sqrt(M)
            row["seconds"] = time.perf_counter() - start
            rows.append({k: (float(v) if isinstance(v, np.floating) else v)
                         for k, v in row.items()})
            print(short(rows[-1]), flush=True)
    return rows


def short(row):
    keys = ("statistic", "epsilon", "mse", "mse_se", "inverse_fisher", "paired_diff",
            "ess_min", "accept_prob", "seconds")
    return {k: (round(row[k], 4) if isinstance(row[k], float) else row[k])
            for k in keys if k in row}


def plot(rows, cfg: Settings, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"|x|": "tab:blue", "x^2": "tab:red"}
    fig, (mse_ax, f_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    eps_all = sorted({r["epsilon"] for r in rows})
    if cfg.fisher_grid:
        grid = np.geomspace(min(eps_all), max(eps_all) * 2, cfg.fisher_grid)
    else:
        grid = np.asarray(eps_all)
    for name, colour in colours.items():
        sel = [r for r in rows if r["statistic"] == name]
        eps = [r["epsilon"] for r in sel]
        mse_ax.errorbar(eps, [r["mse"] for r in sel], yerr=[2 * r["mse_se"] for r in sel],
                        marker="o", color=colour, capsize=3, label=f"s(x) = {name}: MSE (+-2 se)")
        mse_ax.plot(eps, [r["inverse_fisher"] for r in sel], ls="--", color=colour, alpha=0.6,
                    label=f"{name}: 1 / F(theta*)")
        curve = [fisher(POWERS[name], e) for e in grid] if cfg.fisher_grid else \
            [r["fisher"] for r in sel]
        f_ax.plot(grid, curve, color=colour, label=f"s(x) = {name}")
        f_ax.plot(eps, [r["fisher"] for r in sel], "o", color=colour)
    mse_ax.axhline((PRIOR_UPPER / 2 - THETA_STAR) ** 2, color="grey", ls="-.", lw=1,
                   label="prior mean as the estimate")
    mse_ax.axhline(rows[0]["no_noise_mse"], color="grey", ls=":",
                   label="no noise: MLE mean(x^2), same data sets")
    f_ax.axhline(N_ROWS / (2 * THETA_STAR**2), color="grey", ls=":",
                 label="no noise: n / (2 theta*^2)")
    M = rows[0]["data_sets"]
    mse_ax.set(xscale="log", yscale="log", xlabel="epsilon (each row's release)",
               ylabel="MSE of the posterior mean",
               title=f"MHAAR (Alg. 13), N = {rows[0]['particles']}, M = {M} per point")
    f_ax.set(xscale="log", yscale="log", xlabel="epsilon (each row's release)",
             ylabel="F(theta*)", title=f"Fisher information of the n = {N_ROWS} releases, "
             f"theta* = {THETA_STAR:g}")
    for ax in (mse_ax, f_ax):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("Paper 002, Fig. 6.4: sequential release with Laplace noise, "
                 "x ~ N(0, theta) in [-10, 10]", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny subset (< 1 minute)")
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Settings()
    out = Path(args.out_dir)
    start = time.perf_counter()
    rows = run(cfg, args.seed)
    results_csv.write(out / "released_sequential.csv", FIELDS, rows)
    plot(rows, cfg, out / "released_sequential.png")
    print(f"wrote {out / 'released_sequential.csv'} and .png in "
          f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
