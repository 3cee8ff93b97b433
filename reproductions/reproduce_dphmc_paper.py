"""Reproduce the experiments of the DP-HMC paper (paper 004 s4; SPEC s8).

Two parts, each appending one CSV row per finished run to ``docs/results/``
(a restart skips what is there, so a long run can be stopped and resumed):

* ``comparison``: the banana (d = 2) and correlated Gaussian (d = 10) models,
  n = 1e5, delta = 0.1 / n, each kernel with the paper's fixed noise and as
  many iterations as the budget affords at eps in {2, 4, 6, 8, 10, 12, 15}
  (totals over 4 chains, split evenly); each repeat starts its 4 chains near
  the true parameter (sd = mean posterior sd, as the paper); the first half
  of each chain is discarded, the chains pooled, and the MMD and the mean
  error against 1000 exact draws recorded. -> ``dphmc_runs.csv``.
* ``clipping``: RWMH and HMC with LLR clipping and no noise over the paper's
  clip grids: MMD against exact draws and the fraction of per-row LLRs that
  the proposals clip. -> ``dphmc_clipping.csv``.

How runs are batched (documented in ``docs/results/README.md``):

* The R repeats of a (model, kernel) pair run as 4R vectorised chains of one
  ``PrivateMCMC`` call; the chains share nothing, so each group of 4 is
  exactly one run of the paper. Each run's (eps, delta) is computed by the
  library's accountant for 4 chains and written to the CSV.
* A kernel with a fixed noise multiplier has the same law for its first k
  iterations whatever the run length, so each repeat runs once for the
  largest eps of the grid and the run at a smaller eps is the prefix of the
  iterations that eps affords.
* The stochastic-gradient kernels afford 10^6-10^7 iterations per chain at
  these budgets: they are capped (``--sg-cap`` per chain) and thinned to at
  most 5000 draws per chain (the paper thinned to 5000 as well).

    python reproductions/reproduce_dphmc_paper.py            # full grid (hours on 2 cores)
    python reproductions/reproduce_dphmc_paper.py --quick    # a smoke test, n = 5000, < 5 min
    python reproductions/reproduce_dphmc_paper.py --figures-only
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import time
import zlib
from collections.abc import Callable

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from results_csv import append, load

import numpyro_dp as ndp
from numpyro_dp.evaluation import models
from numpyro_dp.evaluation.diagnostics import mean_error, mmd

OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "results"
EPSILONS = (2, 4, 6, 8, 10, 12, 15)
CHAINS = 4
RUN_FIELDS = ["model", "kernel", "epsilon", "repeat", "iterations_per_chain",
              "epsilon_spent", "delta", "draws_used", "mmd", "mean_error", "seconds"]
CLIP_FIELDS = ["model", "sampler", "llr_clip", "repeat", "iterations_per_chain",
               "fraction_clipped", "mmd", "mean_error"]
FLOOR_FIELDS = ["model", "n", "pair", "mmd"]
CLIP_GRIDS = {"banana": (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.5, 1.0, 10.0),
              "gaussian": (0.1, 0.2, 1.0, 5.0, 10.0, 15.0, 20.0, 50.0, 100.0)}


# ----------------------------------------------------------------- problems
@dataclasses.dataclass
class Problem:
    """One evaluation model: data, exact draws and the per-row log-likelihood."""

    name: str
    model: Callable
    args: tuple
    truth: np.ndarray
    exact_sampler: Callable  # (key, num) -> exact posterior draws
    loglik_rows: Callable  # theta -> (n,) per-row log-likelihoods

    def __post_init__(self):
        self.exact = self.exact_sampler(random.PRNGKey(self.exact_seed), 1000)

    @property
    def exact_seed(self) -> int:
        return {"banana": 56437, "gaussian": 434927}[self.name]  # the paper's code

    @property
    def n(self) -> int:
        return int(self.args[0].shape[0])

    @property
    def start_sd(self) -> float:
        # the paper: the mean of the componentwise sds of the reference sample
        return float(self.exact.std(0).mean())


def banana_problem(n: int) -> Problem:
    ref = models.BANANA_REFERENCE
    truth = np.asarray(ref["theta"])
    X = models.banana_data(random.PRNGKey(0), n, theta=truth, row_var=ref["row_var"])
    sd = jnp.sqrt(jnp.asarray(ref["row_var"]))

    def loglik_rows(theta):
        mean = models.banana_g_inv(theta, ref["a"], ref["b"], ref["m"])
        return dist.Normal(mean, sd).log_prob(X).sum(-1)

    def exact(key, num):
        return models.banana_posterior_sample(key, X, num, prior_var=ref["prior_var"],
                                              row_var=ref["row_var"])

    return Problem("banana", models.banana_model, (X,), truth, exact, loglik_rows)


def whitened_gaussian_model(Z, whitener, prior_sd=100.0):
    """``models.gaussian_model`` on whitened rows z_i = W x_i, W = chol(cov)^-1.

    Each row's log-likelihood is the same up to the constant log|W|, so LLRs,
    gradients, clip counts and the posterior are the same. It is 13x faster
    on CPU, where the MVN's triangular solve over 1e5 rows costs about 100 ms
    per evaluation against 8 ms for the matmul.
    """
    theta = numpyro.sample("theta", dist.Normal(jnp.zeros(Z.shape[1]), prior_sd).to_event(1))
    with numpyro.plate("data", Z.shape[0]):
        numpyro.sample("z", dist.Normal(whitener @ theta, 1.0).to_event(1), obs=Z)


def gaussian_problem(n: int) -> Problem:
    d = 10
    cov = models.gaussian_covariance(random.PRNGKey(1), d)
    truth = np.zeros(d)
    truth[1] = 3.0  # as the paper's code
    X = models.gaussian_data(random.PRNGKey(2), n, cov, truth)
    whitener = np.linalg.inv(np.linalg.cholesky(cov))
    Z = jnp.asarray(np.asarray(X, np.float64) @ whitener.T, X.dtype)
    whitener = jnp.asarray(whitener, X.dtype)

    def loglik_rows(theta):
        return dist.Normal(whitener @ theta, 1.0).to_event(1).log_prob(Z)

    def exact(key, num):
        return models.gaussian_posterior_sample(key, X, cov, num)

    return Problem("gaussian", whitened_gaussian_model, (Z, whitener), truth, exact,
                   loglik_rows)


PROBLEMS = {"banana": banana_problem, "gaussian": gaussian_problem}


# ------------------------------------------------------------------ kernels
# The paper's settings (SPEC s8; the reference code for the SG kernels, whose
# SGLD drift is eta rather than eta/2: our step is twice its step so that the
# drift matches and the posterior is the untempered one). Noise multipliers are
# tau * sqrt(n). DPHMC: the paper jitters eta u_t, u_t in [0, 1), so mean eta / 2
# with near-full jitter. DPMALA and DPSGHMC are not in the paper: their steps
# are ours (DPSGHMC holds SGNHT's friction fixed, momentum refreshed every 10 steps).
SETTINGS = {
    "banana": dict(
        tau_g=0.55, tau_l=0.10, tau_penalty=0.17,
        hmc=dict(step_size=0.003, num_steps=25, grad_clip=0.05, llr_clip=0.1),
        mala=dict(step_size=0.02, grad_clip=0.05, llr_clip=0.1),
        penalty=dict(llr_clip=0.15, proposal_scale=0.12),
        sgld=dict(step_size=2e-5, batch_size=1000, grad_clip=0.2),
        sgnht=dict(step_size=1e-3, batch_size=1000, grad_clip=0.2, diffusion=50.0),
        sghmc=dict(step_size=1e-3, batch_size=1000, grad_clip=0.2, friction=50.0),
    ),
    "gaussian": dict(
        tau_g=0.25, tau_l=0.10, tau_penalty=0.05,
        hmc=dict(step_size=0.000075, num_steps=12, grad_clip=10.0, llr_clip=6.0),
        mala=dict(step_size=0.0003, grad_clip=10.0, llr_clip=6.0),
        penalty=dict(llr_clip=10.0, proposal_scale=0.007),
        sgld=dict(step_size=1.6e-7, batch_size=1000, grad_clip=15.0),
        sgnht=dict(step_size=2e-6, batch_size=1000, grad_clip=12.0, diffusion=30.0),
        sghmc=dict(step_size=2e-6, batch_size=1000, grad_clip=12.0, friction=30.0),
    ),
}


def kernels(problem: Problem) -> dict[str, Callable[[], ndp.DPKernel]]:
    m, rn, s = problem.model, math.sqrt(problem.n), SETTINGS[problem.name]
    noise = dict(noise_multiplier_grad=s["tau_g"] * rn, noise_multiplier_llr=s["tau_l"] * rn)
    fixed = dict(adapt_step_size=False, adapt_mass_matrix=False)
    return {
        "DPHMC": lambda: ndp.DPHMC(m, **s["hmc"], **noise, **fixed, step_size_jitter=0.99),
        "DPPenalty": lambda: ndp.DPPenalty(
            m, **s["penalty"], noise_multiplier=s["tau_penalty"] * rn,
            adapt_step_size=False, adapt_mass_matrix=False),
        "DPMALA": lambda: ndp.DPMALA(m, **s["mala"], **noise, **fixed),
        "DPSGLD": lambda: ndp.DPSGLD(m, **s["sgld"]),
        "DPSGNHT": lambda: ndp.DPSGNHT(m, **s["sgnht"]),
        "DPSGHMC": lambda: ndp.DPSGHMC(m, **s["sghmc"], num_steps=10),
    }


SG_KERNELS = ("DPSGLD", "DPSGNHT", "DPSGHMC")


# ----------------------------------------------------------------- helpers
def starts(problem: Problem, repeats) -> np.ndarray:
    """(len(repeats) * CHAINS, d) start points: truth + N(0, start_sd^2)."""
    key = random.PRNGKey(4236482)  # the paper's code
    out = [problem.truth + problem.start_sd * np.asarray(
        random.normal(random.fold_in(key, r * CHAINS + c), problem.truth.shape))
        for r in repeats for c in range(CHAINS)]
    return np.stack(out)


def iterations(kernel: ndp.DPKernel, eps: float, delta: float, cap: int | None = None) -> int:
    """Iterations per chain that a run of CHAINS chains affords at (eps, delta), at most cap.

    The cap saves the bisection's PLD evaluations when the budget affords more.
    """
    if cap is not None and run_epsilon(kernel, cap, delta) <= eps:
        return cap
    return ndp.max_iterations(kernel.per_iteration_event(), eps, delta, num_chains=CHAINS,
                              neighbourhood=kernel.neighbourhood)


def run_epsilon(kernel: ndp.DPKernel, k: int, delta: float) -> float:
    event = dpa.SelfComposedDpEvent(kernel.per_iteration_event(), CHAINS * k)
    return ndp.epsilon_spent(event, delta, kernel.neighbourhood)


def run_chains(kernel, problem, init, num_samples, thinning, seed):
    """Run len(init) vectorised chains from ``init``; draws as (chains, draws, d).

    The runner's ledger covers all the chains together; each run's own
    (eps, delta) is computed per group of CHAINS by :func:`run_epsilon`.
    """
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=0, num_samples=num_samples,
                           num_chains=len(init), thinning=thinning,
                           chain_method="vectorized", progress_bar=False,
                           jit_model_args=True,  # the data as an argument, not a constant
                           delta=0.1 / problem.n)
    mcmc.run(random.PRNGKey(seed), *problem.args, init_params={"theta": jnp.asarray(init)})
    return np.asarray(mcmc.get_samples(group_by_chain=True)["theta"], np.float64)


def done_units(path: pathlib.Path, key_fields: tuple[str, ...]) -> set[tuple]:
    return {tuple(r[k] for k in key_fields) for r in load(path)}


def _median(rows: list[dict], field: str, **where) -> float:
    return float(np.median([float(r[field]) for r in rows
                            if all(r[k] == v for k, v in where.items())]))


def second_half_pooled(chains: np.ndarray) -> np.ndarray:
    keep = chains[:, chains.shape[1] // 2:]
    return keep.reshape(-1, keep.shape[-1])


# --------------------------------------------------------------- comparison
def comparison(args, problem: Problem) -> None:
    path = args.out / "dphmc_runs.csv"
    delta = 0.1 / problem.n
    done = done_units(path, ("model", "kernel", "repeat"))
    for name, make in kernels(problem).items():
        if name not in args.kernels:
            continue
        repeats = [r for r in range(args.repeats)
                   if (problem.name, name, str(r)) not in done]
        if not repeats:
            continue
        kernel = make()
        kernel.prepare(problem.args, {})  # the SG kernels' costs depend on n
        # the SG kernels afford 10^6+ iterations: capped, the cap counting gradient steps
        cap = args.sg_cap // getattr(kernel, "num_steps", 1) if name in SG_KERNELS else None
        budget = {eps: iterations(kernel, eps, delta, cap) for eps in args.eps}
        length = max(budget.values())
        thinning = max(1, length // 5000) if name in SG_KERNELS else 1
        t0 = time.perf_counter()
        draws = run_chains(kernel, problem, starts(problem, repeats), length, thinning,
                           seed=zlib.crc32(f"{problem.name} {name}".encode()) % 2**31)
        secs = time.perf_counter() - t0
        # a capped kernel runs the same k iterations at several eps: score each k once
        spent = {k: run_epsilon(kernel, k, delta) for k in set(budget.values())}
        rows = []
        for i, r in enumerate(repeats):
            run = draws[i * CHAINS:(i + 1) * CHAINS]
            scores = {}
            for eps, k in budget.items():
                pooled = second_half_pooled(run[:, : k // thinning])
                if k not in scores:
                    scores[k] = (
                        f"{mmd(pooled, problem.exact, rng=r):.6g}" if len(pooled) > 1 else "nan",
                        f"{np.linalg.norm(pooled.mean(0) - problem.exact.mean(0)):.6g}"
                        if len(pooled) else "nan")
                rows.append(dict(
                    model=problem.name, kernel=name, epsilon=eps, repeat=r,
                    iterations_per_chain=k, epsilon_spent=f"{spent[k]:.4f}",
                    delta=delta, draws_used=len(pooled), mmd=scores[k][0],
                    mean_error=scores[k][1], seconds=f"{secs / len(repeats):.2f}"))
        append(path, RUN_FIELDS, rows)
        print(f"{problem.name} {name}: {len(repeats)} repeats, {length} iterations per chain "
              f"(thinning {thinning}) in {secs:.1f} s; median MMD by eps: "
              + ", ".join(f"{e}: {_median(rows, 'mmd', epsilon=e):.3g}" for e in args.eps),
              flush=True)


# ----------------------------------------------------------------- clipping
def clip_settings(problem: Problem, scale: int):
    """(sampler, kernel factory, iterations per chain) of the clipping runs (paper's code).

    ``scale`` divides the paper's run lengths (``--clip-scale``).
    """
    tiny = 1e-9  # no noise: the experiment isolates the bias of LLR clipping
    if problem.name == "banana":
        rw, hmc = (0.3, 12000), (0.01, 100, 10.0, 1000)
    else:
        # the paper's code has HMC step 0.0005, above the leapfrog's stability limit
        # 2 / sqrt(n / lambda_min(cov)) = 0.00025 for our covariance draw (every
        # proposal diverged): 0.00015 instead
        rw, hmc = (0.0007, 25000), (0.00015, 12, 100.0, 1000)
    m = problem.model
    return [
        ("RWMH", rw[0], lambda c: ndp.DPPenalty(m, llr_clip=c, proposal_scale=rw[0],
                                                noise_multiplier=tiny, adapt_step_size=False,
                                                adapt_mass_matrix=False), rw[1] // scale),
        ("HMC", None, lambda c: ndp.DPHMC(m, step_size=hmc[0], num_steps=hmc[1], grad_clip=hmc[2],
                                          llr_clip=c, noise_multiplier_grad=tiny,
                                          noise_multiplier_llr=tiny, adapt_step_size=False,
                                          adapt_mass_matrix=False), hmc[3] // scale),
    ]


def fraction_clipped(problem: Problem, states: np.ndarray, proposals: np.ndarray, clip: float):
    """Share of per-row LLRs |l_i(theta') - l_i(theta)| above clip * ||theta' - theta||.

    The kernels never release their clip counts (they are private); this
    recomputes them outside, on proposals drawn from the same law as the
    kernel's, from the chain's own states.
    """
    f = jax.jit(jax.vmap(lambda a, b: jnp.mean(
        jnp.abs(problem.loglik_rows(b) - problem.loglik_rows(a))
        > clip * jnp.linalg.norm(b - a))))
    return float(jnp.mean(f(jnp.asarray(states), jnp.asarray(proposals))))


def hmc_proposals(problem: Problem, states, key, step_size, num_steps):
    """Leapfrog endpoints from ``states`` with fresh momenta and exact gradients."""
    def logp(t):
        return problem.loglik_rows(t).sum()  # the prior is negligible at n = 1e5

    grad = jax.grad(logp)

    def one(theta, k):
        p = random.normal(k, theta.shape)
        p = p + 0.5 * step_size * grad(theta)
        def body(_, tp):
            t, p = tp
            t = t + step_size * p
            return t, p + step_size * grad(t)
        theta, p = jax.lax.fori_loop(0, num_steps - 1, body, (theta, p))
        return theta + step_size * p

    keys = random.split(key, len(states))
    return np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(states), keys))


def clipping(args, problem: Problem) -> None:
    path = args.out / "dphmc_clipping.csv"
    done = done_units(path, ("model", "sampler", "llr_clip", "repeat"))
    grid = CLIP_GRIDS[problem.name]
    if args.quick:
        grid = (grid[0], grid[-1])
    for sampler, rw_scale, make, iters in clip_settings(problem, args.clip_scale):
        if sampler not in args.samplers:
            continue
        for clip in grid[::args.clip_stride]:
            repeats = [r for r in range(args.clip_repeats)
                       if (problem.name, sampler, str(clip), str(r)) not in done]
            if not repeats:
                continue
            kernel = make(clip)
            draws = run_chains(kernel, problem, starts(problem, repeats), iters, 1,
                               seed=7 + repeats[0])
            rows = []
            for i, r in enumerate(repeats):
                run = draws[i * CHAINS:(i + 1) * CHAINS]
                pooled = second_half_pooled(run)
                sub = pooled[np.random.default_rng(r).integers(0, len(pooled), 400)]
                key = random.PRNGKey(r)
                if rw_scale is not None:
                    prop = sub + rw_scale * np.asarray(random.normal(key, sub.shape))
                else:
                    prop = hmc_proposals(problem, sub, key, kernel.step_size, kernel.num_steps)
                rows.append(dict(
                    model=problem.name, sampler=sampler, llr_clip=clip, repeat=r,
                    iterations_per_chain=iters,
                    fraction_clipped=f"{fraction_clipped(problem, sub, prop, clip):.4f}",
                    mmd=f"{mmd(pooled, problem.exact, rng=r):.6g}",
                    mean_error=f"{mean_error(pooled, problem.exact):.6g}"))
            append(path, CLIP_FIELDS, rows)
            print(f"clipping {problem.name} {sampler} clip={clip}: MMD "
                  f"{_median(rows, 'mmd'):.3g}, clipped {_median(rows, 'fraction_clipped'):.3f}",
                  flush=True)


# ------------------------------------------------------------- noise floor
def exact_floor(args, problem: Problem, pairs: int = 20) -> None:
    """MMDs between the 1000 reference draws and independent exact samples.

    What an exact sampler scores: no kernel can be told apart from the
    posterior below this spread (about its 90% quantile).
    """
    path = args.out / "dphmc_floor.csv"
    if (problem.name, str(problem.n)) in done_units(path, ("model", "n")):
        return
    rows = []
    for i in range(pairs):
        other = problem.exact_sampler(random.PRNGKey(100 + i), 1000)
        rows.append(dict(model=problem.name, n=problem.n, pair=i,
                         mmd=f"{mmd(other, problem.exact, rng=i):.6g}"))
    append(path, FLOOR_FIELDS, rows)


def _draw_floor(ax, floors: list[dict], model: str) -> None:
    v = [float(r["mmd"]) for r in floors if r["model"] == model]
    if v:
        ax.axhline(np.percentile(v, 90), color="grey", ls="--",
                   label="exact vs exact, 90% quantile")


# ------------------------------------------------------------------ figures
def summary(out: pathlib.Path) -> str:
    """Markdown tables: median MMD and mean error per model, kernel and eps."""
    rows = load(out / "dphmc_runs.csv")
    lines = []
    for model in sorted({r["model"] for r in rows}):
        sel = [r for r in rows if r["model"] == model]
        eps = sorted({int(r["epsilon"]) for r in sel})
        for metric, label in (("mmd", "MMD"), ("mean_error", "mean error")):
            lines += [f"\n{model}: median {label} over repeats (their number) by epsilon\n",
                      "| kernel | " + " | ".join(f"eps {e}" for e in eps) + " |",
                      "|---" * (len(eps) + 1) + "|"]
            for k in sorted({r["kernel"] for r in sel}):
                cells = []
                for e in eps:
                    v = [float(r[metric]) for r in sel
                         if r["kernel"] == k and int(r["epsilon"]) == e]
                    cells.append(f"{np.median(v):.3g} ({len(v)})" if v else "-")
                lines.append(f"| {k} | " + " | ".join(cells) + " |")
    clip_rows = load(out / "dphmc_clipping.csv")
    for model in sorted({r["model"] for r in clip_rows}):
        lines += [f"\n{model}, clipping without noise: median fraction clipped / MMD\n",
                  "| sampler | LLR clip | iterations per chain | runs | fraction clipped | MMD |",
                  "|---|---|---|---|---|---|"]
        sel = [r for r in clip_rows if r["model"] == model]
        for sampler in sorted({r["sampler"] for r in sel}):
            for c in sorted({float(r["llr_clip"]) for r in sel if r["sampler"] == sampler}):
                runs = [r for r in sel if r["sampler"] == sampler and float(r["llr_clip"]) == c]
                lines.append(
                    f"| {sampler} | {c:g} | {runs[0]['iterations_per_chain']} | {len(runs)} | "
                    f"{_median(runs, 'fraction_clipped'):.3f} | {_median(runs, 'mmd'):.3g} |")
    return "\n".join(lines)


def figures(out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(out / "dphmc_runs.csv")
    floors = load(out / "dphmc_floor.csv")
    model_names = sorted({r["model"] for r in rows})
    for metric, label in (("mmd", "MMD"), ("mean_error", "mean error")):
        if not rows:
            break
        fig, axes = plt.subplots(1, len(model_names), figsize=(6 * len(model_names), 4.2),
                                 squeeze=False)
        for ax, model in zip(axes[0], model_names, strict=True):
            sel = [r for r in rows if r["model"] == model]
            kernel_names = sorted({r["kernel"] for r in sel})
            for j, k in enumerate(kernel_names):
                eps = sorted({int(r["epsilon"]) for r in sel if r["kernel"] == k})
                vals = [np.array([float(r[metric]) for r in sel
                                  if r["kernel"] == k and int(r["epsilon"]) == e]) for e in eps]
                x = np.array(eps) + 0.25 * (j - (len(kernel_names) - 1) / 2)
                med = [np.nanmedian(v) for v in vals]
                lo = [np.nanpercentile(v, 25) for v in vals]
                hi = [np.nanpercentile(v, 75) for v in vals]
                ax.errorbar(x, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)],
                            marker="o", capsize=2, label=k)
            reps = max(int(r["repeat"]) for r in sel) + 1
            if metric == "mmd":
                _draw_floor(ax, floors, model)
            ax.set(yscale="log", xlabel="epsilon (delta = 0.1 / n)", ylabel=label,
                   title=f"{model}: median and IQR over {reps} repeats")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"dphmc_{metric}.png", dpi=110)
        plt.close(fig)

    clip_rows = load(out / "dphmc_clipping.csv")
    floors = load(out / "dphmc_floor.csv")
    if clip_rows:
        model_names = sorted({r["model"] for r in clip_rows})
        fig, axes = plt.subplots(2, len(model_names), figsize=(6 * len(model_names), 8),
                                 squeeze=False)
        for col, model in enumerate(model_names):
            sel = [r for r in clip_rows if r["model"] == model]
            for sampler in sorted({r["sampler"] for r in sel}):
                s = [r for r in sel if r["sampler"] == sampler]
                clips = sorted({float(r["llr_clip"]) for r in s})
                med = [np.median([float(r["mmd"]) for r in s if float(r["llr_clip"]) == c])
                       for c in clips]
                axes[0, col].plot(clips, med, "o-", label=sampler)
                axes[1, col].scatter([float(r["fraction_clipped"]) for r in s],
                                     [float(r["mmd"]) for r in s], label=sampler, s=12)
            for ax in axes[:, col]:
                _draw_floor(ax, floors, model)
                ax.set(yscale="log", ylabel="MMD")
                ax.legend(fontsize=8)
            axes[0, col].set(xscale="log", xlabel="LLR clip bound", title=f"{model}: no noise")
            axes[1, col].set(xlabel="fraction of per-row LLRs clipped")
            axes[1, col].axvline(0.2, color="red", ls=":")
        fig.tight_layout()
        fig.savefig(out / "dphmc_clipping.png", dpi=110)
        plt.close(fig)
    text = summary(out)
    (out / "dphmc_summary.md").write_text(text + "\n")
    print(text)


# --------------------------------------------------------------------- main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke test (< 5 min on 2 cores): n = 5000, eps 4 and 15, 1 repeat, "
                        "DPHMC, DPPenalty and DPSGLD, short SG and clipping runs")
    p.add_argument("--figures-only", action="store_true", help="only redraw from the CSVs")
    p.add_argument("--parts", nargs="+", default=["comparison", "clipping"],
                   choices=["comparison", "clipping"])
    p.add_argument("--models", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    p.add_argument("--kernels", nargs="+",
                   choices=["DPHMC", "DPPenalty", "DPMALA", "DPSGLD", "DPSGNHT", "DPSGHMC"])
    p.add_argument("--eps", nargs="+", type=int, default=list(EPSILONS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--clip-repeats", type=int, default=10)
    p.add_argument("--clip-scale", type=int, default=1,
                   help="divide the clipping runs' lengths (HMC 1000, RWMH 12000/25000) by this")
    p.add_argument("--samplers", nargs="+", default=["RWMH", "HMC"], choices=["RWMH", "HMC"],
                   help="the clipping part's samplers")
    p.add_argument("--clip-stride", type=int, default=1,
                   help="every k-th bound of the clip grid (a coarser grid)")
    p.add_argument("--sg-cap", type=int, default=200_000,
                   help="gradient steps per chain at most for the SG kernels")
    p.add_argument("--n", type=int, help="rows of data (default 100000)")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.eps, args.repeats, args.clip_repeats, args.sg_cap = [4, 15], 1, 1, 2000
        args.clip_scale = 10
        args.n = args.n or 5000
        args.kernels = args.kernels or ["DPHMC", "DPPenalty", "DPSGLD"]
    args.n = args.n or 100_000
    args.kernels = args.kernels or ["DPHMC", "DPPenalty", "DPMALA", "DPSGLD", "DPSGNHT",
                                    "DPSGHMC"]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.figures_only:
        for name in args.models:
            problem = PROBLEMS[name](args.n)
            exact_floor(args, problem)
            if "comparison" in args.parts:
                comparison(args, problem)
            if "clipping" in args.parts:
                clipping(args, problem)
    figures(args.out)


if __name__ == "__main__":
    main()
