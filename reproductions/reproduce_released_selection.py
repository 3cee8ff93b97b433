"""Paper 002, Figures 6.1, 6.2 and 6.5: does the statistic with the larger Fisher
information of its noisy release give the better estimate?

Three experiments of the thesis's chapter 6, each a simulation study: many
data sets are drawn at a true theta*, each is released with noise, theta is
inferred from the release alone, and the MSE of the posterior mean over the
data sets is set beside the Fisher information ``F(theta*)`` of the release.

* **6.1 (Figure 6.1).** x_i ~ N(0, theta*), theta* = 2, n = 100 rows in
  [-A, A], A = 10.  The sum of ``s(x) = |x|^a``, a in {1, 2}, is released by
  the Gaussian mechanism at noise sd ``A^a / epsilon`` on the sum (the
  thesis's ``Delta / (n epsilon)`` on the mean, its epsilon-GDP calibration of
  eq. 4.3), and theta is sampled by random-walk Metropolis (``ndp.MH``,
  Algorithm 9) on the closed-form likelihood of the central-limit normal plus
  noise.  ``F`` from ``gaussian_release_fisher``.
* **6.2 (Figure 6.2).** The same with the Laplace mechanism, scale
  ``A^a / epsilon`` on the sum, and PMMH (``ndp.PMMH``, Algorithm 10) with the
  sum's central-limit law as the latent statistic.  ``F`` from
  ``laplace_release_fisher``.
* **6.5 (Figure 6.5).** x_i ~ Unif(-theta*, theta*), theta* = 0.1..1.0,
  n = 100 rows in [-10, 10], split into the first n0 = 10 and the other 90.
  *With selection*: the first 10 rows' sum of s0 = |x| is released (Laplace,
  epsilon), theta's posterior given it is sampled, the candidates
  ``|x|^a``, a = 0.1..2.0, are ranked by the average of ``F_a(theta)^-1``
  over its draws (Example 5's moments; Laplace Fisher information of the
  90-row release), and the other 90 rows are released with the winner;
  theta is estimated from both releases.  *Without*: the 90 rows are released
  with s0 = |x| as well.  Each release is epsilon-DP on disjoint rows, so
  both schemes are epsilon-DP.  Inference by ``ndp.MHAAR`` (Algorithm 11),
  the two sums' central-limit laws as latent statistics.

Everything the library has is the library's: the releases
(``gaussian_mechanism``, ``laplace_mechanism``, with ``reproducible_noise=True``
as this is a simulation on synthetic data, never a private release), the
Fisher information, the ranking, and the kernels.  The script only drives
them: each kernel's ``init`` and ``sample`` run one chain per release,
vectorised over the releases with ``jax.vmap`` and compiled once
(``BatchedChains``), which runs a thousand independent posteriors as fast as
one.  Every chain starts at theta* and adapts its random-walk step toward
an acceptance of 0.3 during warm-up.

6.5's ranking.  ``rank_statistics(theta_draws=...)`` evaluates the Laplace
Fisher information of every candidate at every draw (about 0.3 s a call
here), which for 20 candidates, tens of draws and thousands of runs is hours.
The script therefore tabulates each candidate's ``F_a(theta)`` once with
``rank_statistics(theta=...)`` (the same library computation) on a log grid
of theta, and ranks each run by the average of ``F_a^-1`` over its draws,
with log F a cubic spline in log theta through that table.  A check in the run: on a few runs,
``rank_statistics(theta_draws=...)`` on the table's three best candidates and
s0, at a few of the run's draws, picks the same statistic as the table does
(CSV columns ``rank_check_*``).

Columns of the CSV besides the MSE and its Monte Carlo standard error (the sd
of the squared errors / sqrt(runs)): ``paired_diff`` (x^2 minus |x| on the
same data sets; selection minus none on the same runs) with its standard
error, ``stuck_chains`` (chains whose acceptance over the run stayed below
0.05: a pseudo-marginal chain that kept a lucky over-estimate), and for 6.5
the quartiles of the selected a and ``oracle_a``, the candidate the ranking
would pick knowing theta*.

Settings and scale (the thesis's in brackets; the full run takes 5 minutes
on two lightly loaded cores, 8 under a load of 5; ``--quick`` 25-45 s; the
seeds are fixed, ``--seed`` 0):

* 6.1: epsilon in {0.5, 1, 2, 5, 10, 20, 50, 100} (not stated); M = 1000 data
  sets (1000); 2000 warm-up + 10 000 MH iterations (10^5).
* 6.2: the same epsilons; M = 100 (100); PMMH (particles not stated) with
  about 2 sd(S) / b particles, the sum's central-limit sd over the Laplace
  scale, at least 20 and at most 200 (20 at epsilon <= 10, and for x^2 at
  20; 50-200 above: with a fixed 20 the likelihood estimate degenerates at a
  small noise scale and chains stick), 2000 warm-up + 10 000 iterations
  (not stated).
* 6.5: Laplace noise (the thesis asks for "epsilon-DP" releases, which the
  Gaussian mechanism is not); epsilon = 5 (not stated: the value the thesis
  fixes for its other single-epsilon experiments, s6.2.1 and s6.3); the same
  data and first release serve both schemes (paired); 300 runs per theta*
  (15 000); MHAAR with 16 particles, 1000 warm-up + 3000 iterations for each
  posterior, 40 thinned draws of the first for the ranking; the Fisher
  table on 12 points of theta, log-spaced over [0.01, 10] (a cubic spline of
  log F in log theta through them: within 2% of F at the midpoints, checked
  on the closed-form Gaussian-noise F of the same candidates).
* Priors: theta ~ Uniform(0, 20) in 6.1-6.2 (as in
  ``reproduce_released_iac.py``), Uniform(0, 10) in 6.5 (theta <= A); the
  thesis: "uninformative".  The same M data sets serve every epsilon and both
  statistics (paired comparisons); the noise is drawn anew for each release.

    python reproductions/reproduce_released_selection.py   # docs/results/released_selection.*
    python reproductions/reproduce_released_selection.py --quick --out-dir /tmp/sel
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import results_csv
from jax.scipy.special import gammaln
from numpyro.distributions import biject_to, constraints
from release_chains import BatchedChains
from scipy.interpolate import CubicSpline

import numpyro_dp as ndp
from numpyro_dp.releases.fisher import (
    Statistic,
    gaussian_release_fisher,
    laplace_release_fisher,
    rank_statistics,
)

OUT = Path(__file__).resolve().parent.parent / "docs" / "results"
A = 10.0  # rows lie in [-A, A]
N_ROWS = 100
THETA_NORMAL = 2.0  # theta* of 6.1-6.2
PRIOR_NORMAL = 20.0  # theta ~ Uniform(0, PRIOR_NORMAL) in 6.1-6.2
PRIOR_UNIFORM = A  # theta ~ Uniform(0, A) in 6.5
N_INITIAL = 10  # n0 of 6.5
S0_POWER = 1.0  # s0 = |x|
STUCK_ACCEPT = 0.05  # a chain accepting less than this over its run is counted as stuck
FIELDS = ["experiment", "method", "statistic", "epsilon", "theta_star", "runs", "particles",
          "mse", "mse_se", "mean_estimate", "fisher", "log_fisher", "inverse_fisher",
          "accept_prob", "stuck_chains", "paired_diff", "paired_diff_se", "selected_a_median",
          "selected_a_q25", "selected_a_q75", "oracle_a", "rank_check_agree", "rank_check_runs",
          "seconds"]


@dataclasses.dataclass(frozen=True)
class Settings:
    epsilons: tuple = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    releases_61: int = 1000
    releases_62: int = 100
    warmup: int = 2000
    samples: int = 10_000
    particles_62: int = 20
    epsilon_65: float = 5.0
    thetas_65: tuple = tuple(np.round(np.arange(0.1, 1.01, 0.1), 1))
    runs_65: int = 300
    powers_65: tuple = tuple(np.round(np.arange(0.1, 2.01, 0.1), 1))
    particles_65: int = 16
    warmup_65: int = 1000
    samples_65: int = 3000
    draws_65: int = 40  # thinned draws of theta | Y0 for the ranking
    grid_65: int = 12  # theta points of the Fisher table
    checks_65: tuple = (0.1, 0.5, 1.0)  # theta* whose first run is checked
    check_draws: int = 2


QUICK = Settings(epsilons=(1.0, 2.0), releases_61=40, releases_62=10, warmup=300,
                 samples=700, particles_62=8, thetas_65=(0.2, 0.8), runs_65=12,
                 powers_65=(0.3, 1.0), particles_65=8, warmup_65=200,
                 samples_65=400, draws_65=10, grid_65=4, checks_65=(0.2,), check_draws=1)


# ------------------------------------------------------------- statistics
def _g(k):
    """E|Z|^k / 2^(k/2) for Z ~ N(0, 1): Gamma((k + 1) / 2) / sqrt(pi)."""
    return jnp.exp(gammaln((k + 1) / 2)) / jnp.sqrt(jnp.pi)


def normal_moments(theta, a):
    """Mean and variance of |x|^a under N(0, theta) (Example 4; the bound ignored)."""
    return (2 * theta) ** (a / 2) * _g(a), (2 * theta) ** a * (_g(2 * a) - _g(a) ** 2)


def uniform_moments(theta, a):
    """Mean and variance of |x|^a under Unif(-theta, theta) (Example 5)."""
    return theta**a / (a + 1), theta ** (2 * a) * a**2 / ((a + 1) ** 2 * (2 * a + 1))


def abs_power(a, moments, bound=A):
    """The candidate ``s(x) = |x|^a`` (the README's helper): public moments,
    and the sum's sensitivity ``bound^a`` (s in [0, bound^a], add/remove)."""
    return Statistic(f"|x|^{a:g}", mean=lambda t: moments(t, a)[0],
                     cov=lambda t: moments(t, a)[1], sensitivity=float(bound**a))


def stat_label(a):
    return {1.0: "|x|", 2.0: "x^2"}.get(float(a), f"|x|^{a:g}")


# ----------------------------------------------------------------- models
def gaussian_release_model(y, a, noise_sd):
    """6.1: the sum of |x|^a plus Gaussian noise, in closed form (eq. 5.1)."""
    theta = numpyro.sample("theta", dist.Uniform(0.0, PRIOR_NORMAL))
    mean, var = normal_moments(theta, a)
    numpyro.sample("y", dist.Normal(N_ROWS * mean, jnp.sqrt(N_ROWS * var + noise_sd**2)), obs=y)


def laplace_release_model(y, a, scale):
    """6.2: the sum (latent, its central-limit law, eq. 4.5) plus Laplace noise."""
    theta = numpyro.sample("theta", dist.Uniform(0.0, PRIOR_NORMAL))
    mean, var = normal_moments(theta, a)
    total = numpyro.sample("total", dist.Normal(N_ROWS * mean, jnp.sqrt(N_ROWS * var)))
    numpyro.sample("y", dist.Laplace(total, scale), obs=y)


def _uniform_release(name, theta, rows, a, y, scale):
    mean, var = uniform_moments(theta, a)
    total = numpyro.sample(f"total{name}", dist.Normal(rows * mean, jnp.sqrt(rows * var)))
    numpyro.sample(f"y{name}", dist.Laplace(total, scale), obs=y)


def initial_model(y0, scale0):
    """6.5, first step: the first n0 rows' sum of s0 = |x|, Laplace noise."""
    theta = numpyro.sample("theta", dist.Uniform(0.0, PRIOR_UNIFORM))
    _uniform_release("0", theta, N_INITIAL, S0_POWER, y0, scale0)


def both_model(y0, scale0, y1, a1, scale1):
    """6.5, estimation: both releases (the second of |x|^a1 over the other rows)."""
    theta = numpyro.sample("theta", dist.Uniform(0.0, PRIOR_UNIFORM))
    _uniform_release("0", theta, N_INITIAL, S0_POWER, y0, scale0)
    _uniform_release("1", theta, N_ROWS - N_INITIAL, a1, y1, scale1)


# ---------------------------------------------------------- batched chains
def unconstrained(theta, upper, size):
    """theta as the kernels' walk sees it (logit of theta / upper), repeated."""
    return np.full(size, float(biject_to(constraints.interval(0.0, upper)).inv(theta)))


# ------------------------------------------------------------------ releases
def release_sums(sums, sensitivity, epsilon, noise, seed):
    """Each data set's sum released once, as a user would (reproducible noise:
    a simulation).  Returns the released values and the noise scale."""
    key = jax.random.PRNGKey(seed)
    values, scale = np.empty(len(sums)), None
    for i, total in enumerate(sums):
        k = jax.random.fold_in(key, i)
        if noise == "gaussian":  # epsilon-GDP: sd = sensitivity / epsilon (thesis eq. 4.3)
            r = ndp.mechanisms.gaussian_mechanism(
                k, float(total), sensitivity, noise_multiplier=1.0 / epsilon,
                neighbourhood="add_remove", reproducible_noise=True)
        else:
            r = ndp.mechanisms.laplace_mechanism(
                k, float(total), sensitivity, epsilon=epsilon, neighbourhood="add_remove",
                reproducible_noise=True)
        values[i], scale = float(r.value), float(r.scale)
    return values, scale


def mse_row(estimates, truth):
    err = (np.asarray(estimates) - truth) ** 2
    return float(err.mean()), float(err.std(ddof=1) / math.sqrt(len(err))), err


def stuck(accept, below=STUCK_ACCEPT):
    """Chains whose acceptance over the whole run stayed below ``below``: a
    pseudo-marginal chain that kept a lucky over-estimate of its likelihood."""
    return int(np.sum(np.asarray(accept) < below))


def paired(err, baseline):
    d = err - baseline
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


# ------------------------------------------------------------- 6.1 and 6.2
def pmmh_particles(stat, noise_scale, least):
    """PMMH's particles for a release: about 2 sd(S) / b, one of (least, 50, 100, 200).

    The particles are the sum's central-limit law at theta (Algorithm 10's
    q_theta(u) = f_Sn(u | theta)); about b / sd(S) of them land where the
    Laplace noise of scale b leaves any weight, so at a large epsilon (small b)
    a fixed number gives a degenerate, sticky likelihood estimate.  The
    number is set from the public theta* and the noise, never from data.
    """
    sd = math.sqrt(N_ROWS * float(stat.cov(THETA_NORMAL)))
    need, choices = 2.0 * sd / noise_scale, (least, 50, 100, 200)
    return next((c for c in choices if c >= need), choices[-1])


def additive_normal(cfg: Settings, noise: str, seed: int) -> list[dict]:
    """Figure 6.1 (noise="gaussian", MH) or 6.2 (noise="laplace", PMMH)."""
    experiment = "6.1" if noise == "gaussian" else "6.2"
    M = cfg.releases_61 if noise == "gaussian" else cfg.releases_62
    rng = np.random.default_rng(seed)
    x = np.clip(rng.normal(0.0, math.sqrt(THETA_NORMAL), (M, N_ROWS)), -A, A)
    chains = {}  # one compiled sampler per number of particles

    def sampler(particles):
        if particles not in chains:
            kernel = (ndp.MH(gaussian_release_model) if noise == "gaussian" else
                      ndp.PMMH(laplace_release_model, ["total"], num_particles=particles))
            chains[particles] = BatchedChains(kernel, cfg.warmup, cfg.samples)
        return chains[particles]

    z0 = unconstrained(THETA_NORMAL, PRIOR_NORMAL, M)
    rows, errors = [], {}
    for j, eps in enumerate(cfg.epsilons):
        for a in (1.0, 2.0):
            start = time.perf_counter()
            stat = abs_power(a, normal_moments)
            sums = (np.abs(x) ** a).sum(axis=1)
            y, scale = release_sums(sums, stat.sensitivity, eps, noise,
                                    seed=1000 * seed + 10 * j + int(a))
            particles = (0 if noise == "gaussian" else
                         pmmh_particles(stat, scale, cfg.particles_62))
            draws, accept = sampler(particles)(seed + j, z0, y, np.full(M, a),
                                               np.full(M, scale))
            means = draws.mean(axis=1)
            mse, se, err = mse_row(means, THETA_NORMAL)
            fisher_fn = gaussian_release_fisher if noise == "gaussian" else laplace_release_fisher
            fisher = float(fisher_fn(stat, THETA_NORMAL, N_ROWS, scale)[0, 0])
            row = {"experiment": experiment, "method": "MH" if noise == "gaussian" else "PMMH",
                   "statistic": stat_label(a), "epsilon": eps, "theta_star": THETA_NORMAL,
                   "runs": M, "mse": mse, "mse_se": se, "mean_estimate": float(means.mean()),
                   "fisher": fisher, "log_fisher": math.log(fisher),
                   "inverse_fisher": 1.0 / fisher, "accept_prob": float(accept.mean()),
                   "stuck_chains": stuck(accept),
                   "particles": particles or None}
            errors[a] = err
            if a == 2.0:  # x^2 minus |x|, paired by data set
                row["paired_diff"], row["paired_diff_se"] = paired(err, errors[1.0])
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(_short(row), flush=True)
    return rows


# ----------------------------------------------------------------------- 6.5
def fisher_table(cfg: Settings, thetas_grid):
    """log F_a(theta) of the 90-row Laplace release, every candidate, on the grid:
    ``rank_statistics(theta=...)``, Laplace scale sensitivity / epsilon."""
    candidates = [abs_power(a, uniform_moments) for a in cfg.powers_65]
    names = [c.name for c in candidates]
    table = np.empty((len(candidates), len(thetas_grid)))
    for k, theta in enumerate(thetas_grid):
        ranked = rank_statistics(candidates, theta=float(theta), num_rows=N_ROWS - N_INITIAL,
                                 epsilon=cfg.epsilon_65, noise="laplace")
        for r in ranked:
            table[names.index(r.name), k] = math.log(float(r.fisher[0, 0]))
    return candidates, table


def table_criteria(draws, log_grid, table):
    """Average of F_a^-1 over each run's draws, log F a cubic spline in log theta
    through the table (draws beyond the grid take its edge): (runs, candidates)."""
    log_t = np.log(np.clip(draws, np.exp(log_grid[0]), np.exp(log_grid[-1])))
    inv = np.stack([np.exp(-CubicSpline(log_grid, row)(log_t)) for row in table], axis=-1)
    return inv.mean(axis=-2)


def selection(cfg: Settings, seed: int) -> tuple[list[dict], dict]:
    """Figure 6.5: MSE with and without selection from the first n0 rows."""
    eps, R = cfg.epsilon_65, cfg.runs_65
    start = time.perf_counter()
    log_grid = np.linspace(math.log(0.01), math.log(PRIOR_UNIFORM), cfg.grid_65)
    candidates, table = fisher_table(cfg, np.exp(log_grid))
    powers = np.asarray(cfg.powers_65)
    print(f"6.5: Fisher table of {len(candidates)} candidates x {cfg.grid_65} theta points "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    first = BatchedChains(ndp.MHAAR(initial_model, ["total0"], num_particles=cfg.particles_65),
                          cfg.warmup_65, cfg.samples_65, thin=cfg.samples_65 // cfg.draws_65)
    second = BatchedChains(ndp.MHAAR(both_model, ["total0", "total1"],
                                     num_particles=cfg.particles_65),
                           cfg.warmup_65, cfg.samples_65)
    rows, chosen = [], {}
    for j, theta_star in enumerate(cfg.thetas_65):
        start = time.perf_counter()
        rng = np.random.default_rng(1000 * seed + j)
        x = np.clip(rng.uniform(-theta_star, theta_star, (R, N_ROWS)), -A, A)
        s0 = abs_power(S0_POWER, uniform_moments)
        y0, scale0 = release_sums(np.abs(x[:, :N_INITIAL]).sum(1), s0.sensitivity, eps,
                                  "laplace", seed=10_000 * seed + 100 * j)
        z0 = unconstrained(theta_star, PRIOR_UNIFORM, R)
        draws, acc0 = first(seed + 7 * j, z0, y0, np.full(R, scale0))
        draws = draws[:, : cfg.draws_65]
        best = np.argmin(table_criteria(draws, log_grid, table), axis=1)
        a_sel = powers[best]
        chosen[theta_star] = a_sel
        # the other 90 rows: the selected statistic, and s0 (no selection)
        y_sel, scale_sel = np.empty(R), np.empty(R)
        for a in np.unique(a_sel):
            idx = np.flatnonzero(a_sel == a)
            y_sel[idx], scale_sel[idx] = release_sums(
                (np.abs(x[idx, N_INITIAL:]) ** a).sum(1), float(A**a), eps, "laplace",
                seed=10_000 * seed + 100 * j + int(round(10 * a)))
        y_s0, scale_s0 = release_sums(np.abs(x[:, N_INITIAL:]).sum(1), s0.sensitivity, eps,
                                      "laplace", seed=10_000 * seed + 100 * j + 99)
        second_draws, acc = second(
            seed + 7 * j + 1, np.concatenate([z0, z0]), np.concatenate([y0, y0]),
            np.full(2 * R, scale0), np.concatenate([y_sel, y_s0]),
            np.concatenate([a_sel, np.full(R, S0_POWER)]), np.concatenate([scale_sel,
                                                                           np.full(R, scale_s0)]))
        means = second_draws.mean(axis=1)
        mse_sel, se_sel, err_sel = mse_row(means[:R], theta_star)
        mse_s0, se_s0, err_s0 = mse_row(means[R:], theta_star)
        agree, checked = _rank_check(cfg, theta_star, candidates, draws, log_grid, table)
        seconds = time.perf_counter() - start
        common = {"experiment": "6.5", "epsilon": eps, "theta_star": theta_star, "runs": R,
                  "seconds": seconds}
        q25, q50, q75 = np.percentile(a_sel, [25, 50, 75])
        # what the ranking would pick knowing theta* (the table at theta* itself)
        oracle = powers[int(np.argmin(table_criteria(np.array([[theta_star]]), log_grid,
                                                     table)[0]))]
        diff, diff_se = paired(err_sel, err_s0)
        rows.append({**common, "method": "selection", "statistic": "selected |x|^a",
                     "mse": mse_sel, "mse_se": se_sel, "mean_estimate": float(means[:R].mean()),
                     "accept_prob": float(acc[:R].mean()), "stuck_chains": stuck(acc[:R]),
                     "paired_diff": diff,
                     "paired_diff_se": diff_se, "selected_a_median": q50,
                     "selected_a_q25": q25, "selected_a_q75": q75, "oracle_a": oracle,
                     "rank_check_agree": agree, "rank_check_runs": checked})
        rows.append({**common, "method": "no_selection", "statistic": "|x|", "mse": mse_s0,
                     "mse_se": se_s0, "mean_estimate": float(means[R:].mean()),
                     "accept_prob": float(acc[R:].mean()), "stuck_chains": stuck(acc[R:])})
        print(_short(rows[-2]), f"| first-step acceptance {acc0.mean():.2f}", flush=True)
        print(_short(rows[-1]), flush=True)
    return rows, chosen


def _rank_check(cfg, theta_star, candidates, draws, log_grid, table):
    """On this theta*'s first run: ``rank_statistics(theta_draws=...)`` at a few of
    its draws, over the table's three best candidates and s0, picks what the
    table picks at the same draws."""
    if not any(math.isclose(theta_star, t) for t in cfg.checks_65):
        return None, None
    sub = draws[:1, :: max(1, draws.shape[1] // cfg.check_draws)][:, : cfg.check_draws]
    crit = table_criteria(sub, log_grid, table)[0]
    top = list(np.argsort(crit)[:3])
    s0 = [c.name for c in candidates].index(abs_power(S0_POWER, uniform_moments).name) \
        if any(math.isclose(a, S0_POWER) for a in cfg.powers_65) else None
    if s0 is not None and s0 not in top:
        top.append(s0)
    ranked = rank_statistics([candidates[i] for i in top], theta_draws=sub[0],
                             num_rows=N_ROWS - N_INITIAL, epsilon=cfg.epsilon_65,
                             noise="laplace")
    agree = ranked[0].name == candidates[int(np.argmin(crit))].name
    print(f"  rank check at theta*={theta_star}: rank_statistics picks {ranked[0].name}, "
          f"the table {candidates[int(np.argmin(crit))].name}", flush=True)
    return int(agree), 1


# -------------------------------------------------------------- output
def _short(row):
    keep = ("experiment", "method", "statistic", "epsilon", "theta_star", "mse", "mse_se",
            "fisher", "accept_prob", "selected_a_median", "seconds")
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
            if k in keep}


def plot(rows, chosen, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(11, 12))
    colours = {"|x|": "tab:blue", "x^2": "tab:red"}
    for r_i, (exp, noise) in enumerate((("6.1", "Gaussian"), ("6.2", "Laplace"))):
        mse_ax, f_ax = axes[r_i]
        for stat, colour in colours.items():
            sel = [r for r in rows if r["experiment"] == exp and r["statistic"] == stat]
            if not sel:
                continue
            eps = [r["epsilon"] for r in sel]
            mse_ax.errorbar(eps, [r["mse"] for r in sel], yerr=[2 * r["mse_se"] for r in sel],
                            marker="o", color=colours[stat], capsize=3,
                            label=f"s(x) = {stat}, MSE (+-2 se)")
            mse_ax.plot(eps, [r["inverse_fisher"] for r in sel], ls="--", color=colour,
                        alpha=0.6, label=f"{stat}: 1 / F(theta*)")
            f_ax.plot(eps, [r["log_fisher"] for r in sel], marker="o", color=colour,
                      label=f"s(x) = {stat}")
        runs = next((r["runs"] for r in rows if r["experiment"] == exp), 0)
        sampler = "MH (Alg. 9)" if exp == "6.1" else "PMMH (Alg. 10)"
        mse_ax.set(xscale="log", yscale="log", xlabel="epsilon", ylabel="MSE of posterior mean",
                   title=f"Fig. {exp}: {noise} noise, {sampler}, M = {runs}")
        f_ax.set(xscale="log", xlabel="epsilon", ylabel="log F(theta*)",
                 title=f"Fig. {exp}: log Fisher information at theta* = {THETA_NORMAL:g}")
        for ax in (mse_ax, f_ax):
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, which="both")
    mse_ax, a_ax = axes[2]
    sel65 = [r for r in rows if r["experiment"] == "6.5"]
    for method, colour, label in (("selection", "tab:green", "with selection"),
                                  ("no_selection", "tab:gray", "without (s0 = |x|)")):
        rs = [r for r in sel65 if r["method"] == method]
        if rs:
            mse_ax.errorbar([r["theta_star"] for r in rs], [r["mse"] for r in rs],
                            yerr=[2 * r["mse_se"] for r in rs], marker="o", color=colour,
                            capsize=3, label=label)
    eps65 = sel65[0]["epsilon"] if sel65 else float("nan")
    runs65 = sel65[0]["runs"] if sel65 else 0
    mse_ax.set(yscale="log", xlabel="theta*", ylabel="MSE of posterior mean",
               title=f"Fig. 6.5: Unif(-theta, theta), Laplace eps = {eps65:g}, {runs65} runs")
    mse_ax.legend(fontsize=8)
    mse_ax.grid(alpha=0.3, which="both")
    if chosen:
        thetas = sorted(chosen)
        a_ax.boxplot([chosen[t] for t in thetas], positions=range(len(thetas)),
                     showfliers=False)
        a_ax.set_xticks(range(len(thetas)), [f"{t:g}" for t in thetas])
        oracle = {r["theta_star"]: r["oracle_a"] for r in sel65 if r["method"] == "selection"}
        a_ax.plot(range(len(thetas)), [oracle[t] for t in thetas], "x", color="tab:red",
                  label="best a knowing theta* (F at theta*)")
        a_ax.legend(fontsize=8)
    a_ax.set(xlabel="theta*", ylabel="selected a", title="Fig. 6.5: selected a (outliers hidden)")
    a_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny subset (< 1 minute)")
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--parts", nargs="+", default=["6.1", "6.2", "6.5"],
                        choices=["6.1", "6.2", "6.5"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Settings()
    if args.quick:
        BatchedChains.compiler_options = {"xla_backend_optimization_level": 0}
    out = Path(args.out_dir)
    start = time.perf_counter()
    rows, chosen = [], {}
    if "6.1" in args.parts:
        rows += additive_normal(cfg, "gaussian", args.seed)
    if "6.2" in args.parts:
        rows += additive_normal(cfg, "laplace", args.seed + 1)
    if "6.5" in args.parts:
        more, chosen = selection(cfg, args.seed + 2)
        rows += more
    results_csv.write(out / "released_selection.csv", FIELDS, rows)
    plot(rows, chosen, out / "released_selection.png")
    print(f"wrote {out / 'released_selection.csv'} and .png in "
          f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
