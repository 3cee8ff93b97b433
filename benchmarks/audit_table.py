"""Audit every kernel (issues 20, 36): claimed epsilon against an empirical lower bound.

    python benchmarks/audit_table.py --runs 20000 > docs/results/audit.md

Every kernel of ``numpyro_dp.evaluation.canary.KERNELS`` is audited on the
canary problem there: a Gaussian-mean model on n = 20 rows, 19 at 0 and one
canary at +5, far outside a clip of 1; its neighbour replaces the canary by -5
(``substitute``) or drops it (``add_remove``).  Each run is one iteration of
one chain from theta = 0, scored by its draw.  The bound is
ndp.audit.multi_run's (Clopper-Pearson, 95% confidence, threshold chosen on
30% of the runs) at ``delta = 0.01``, where a few thousand runs can see what
sets epsilon.  The white-box rows audit the Gaussian release of a clipped sum
directly.  The rows under "broken" run with an ndp.audit.fault injected.

The last section audits every kernel end to end with ndp.audit.audit_kernel:
one run of ``--chains`` chains x ``--iterations`` iterations on each data set,
the canary at +-100 (``KERNEL_AUDIT_CANARY``, beyond the clip wherever the
chains go), and the faults against the kernels of ``FAULTED``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np

from numpyro_dp import audit
from numpyro_dp.evaluation.canary import (
    CANARY,
    DELTA,
    KERNEL_AUDIT_CANARY,
    KERNELS,
    ROWS,
    barker_batch,
    batch_ratios,
    canary_rows,
    draw_score,
    neighbours,
)

READING = """How to read it: every bound holds with 95% confidence, so a bound above its
claim is a bug.  An attacker that sees a Gaussian release directly gets close
to its claim: the white-box rows of the Gaussian releases, and the
stochastic-gradient kernels, whose draw is the noisy gradient step itself.
The accept/reject kernels (DPPenalty, DPHMC, DPMALA, DPBarker,
DPMinibatchPenalty) publish a draw that moved or did not, which shows little
of the noisy release, so their bounds sit far below their claims and a halved
noise goes unseen in their draws; the Gaussian releases of DPPenalty, DPHMC
and DPMALA all pass through the one gate that the white-box rows audit
(`release_clipped_sum`), and DPMinibatchPenalty's through its own
(`release_batch_llr`), where halving is caught; DP Barker's test is audited
white-box on a fixed batch, where a skipped clip is caught.  The claims of
DPBarker and of batches drawn without replacement are RDP upper bounds (Wang,
Balle & Kasiviswanathan's amplification), loose at n = 20.  DPSGHMC's second
step changes only the momentum that the next iteration redraws, so half of
what it is charged never reaches a draw.  The runs draw secret noise, as a
user's do, so the bounds vary between runs of this script: a fault whose bound
is near its claim may be caught in one run and missed in the next.  The last
section audits each kernel's own releases end to end, white box, where every
fault is caught.
"""


KERNEL_READING = """An end-to-end white-box audit (`ndp.audit.audit_kernel`): each kernel runs
through `PrivateMCMC` as a user runs it, a tap at the noise gates records every
release it makes (the statistic before the noise and the noise drawn), and a
second run on the neighbour replays those releases, so that it follows the same
path while the tap records the neighbour's statistics.  The realised epsilon
composes the releases as they were made: full-data Gaussian releases exactly
(`mu = sqrt(sum (Delta_k / sigma_k)^2)`, a lower bound, and tight: the canary
moves every release by its full sensitivity), subsampled ones and DP Barker's
tests by the ledger's own accountant around their realised noise per unit of
sensitivity (as loose as the claim there: WBK's RDP bound for fixed-size
batches, DP Barker's per-step bound).  Nothing is estimated: the figures are
the same on every run of this script.  A run that makes more releases than it
is charged for fails whatever its noise; so does a noise key used twice, or a
neighbour's run whose draws differ from the first run's given the same
releases.  Poisson batches under add/remove are not audited end to end: they
are drawn from the n rows, so a neighbour without the canary draws other
batches and cannot replay the path (the multi-run audit above covers them).
"""

#: (kernel, data) pairs audited end to end under every fault (noise faults skip DP Barker).
FAULTED = [("DPPenalty", "full"), ("DPHMC", "full"), ("DPMinibatchPenalty", "b = 10"),
           ("DPSGLD", "Poisson, b = 10"), ("DPBarker", "b = 11")]


def find(name, data):
    (found,) = [k for k in KERNELS if (k.name, k.data) == (name, data)]
    return found


def kernel_audit(kernel, neighbourhood, opts):
    return audit.audit_kernel(kernel.make(neighbourhood),
                              *neighbours(neighbourhood, KERNEL_AUDIT_CANARY), delta=DELTA,
                              num_chains=opts.chains, num_samples=opts.iterations)


def end_to_end(opts) -> None:
    print("\n## White box, end to end (`ndp.audit.audit_kernel`)\n")
    print(f"{opts.chains} chains x {opts.iterations} iterations per run, the canary at "
          f"+-{KERNEL_AUDIT_CANARY:g}.\n")
    print(KERNEL_READING)
    print("| kernel | data | neighbourhood | claimed epsilon | realised epsilon | verdict | "
          "releases made / charged | time |")
    print("|---|---|---|---|---|---|---|---|")
    for kernel in KERNELS:
        for nb in kernel.neighbourhoods:
            if nb == "add_remove" and "Poisson" in kernel.data:
                print(f"| {kernel.name} | {kernel.data} | {nb} | | | not audited (batches "
                      "depend on n) | | |", flush=True)
                continue
            start = time.perf_counter()
            result = kernel_audit(kernel, nb, opts)
            verdict = "ok" if result.passed else "**VIOLATED**"
            made = result.details.split(": ", 1)[1].split(";")[0]
            print(f"| {kernel.name} | {kernel.data} | {nb} | {result.claimed_epsilon:.4f} | "
                  f"{result.epsilon_lower_bound:.4f} | {verdict} | {made} | "
                  f"{time.perf_counter() - start:.0f} s |", flush=True)
    print("\n### Broken on purpose, end to end: every fault caught\n")
    print("| fault | audited | claimed epsilon | realised epsilon | verdict | violations | "
          "time |")
    print("|---|---|---|---|---|---|---|")
    for name, data in FAULTED:
        faults = [(f, {}) for f in audit.FAULTS] + [("kernel_noise_divided", {"divisor": 30.0})]
        if name == "DPBarker":  # its noise is the logistic test's, not a Gaussian release
            faults = [(f, k) for f, k in faults if "noise" not in f]
        for fault, options in faults:
            start = time.perf_counter()
            with audit.fault(fault, **options):
                result = kernel_audit(find(name, data), "substitute", opts)
            label = f"`{fault}`" + (f" (/{options['divisor']:g})" if options else
                                    " (/3)" if fault == "kernel_noise_divided" else "")
            verdict = "caught" if not result.passed else "missed"
            print(f"| {label} | {name}, {data} | {result.claimed_epsilon:.4f} | "
                  f"{result.epsilon_lower_bound:.4f} | {verdict} | "
                  f"{'; '.join(result.violations) or '-'} | "
                  f"{time.perf_counter() - start:.0f} s |", flush=True)


def row(name, data, neighbourhood, result, seconds):
    verdict = "ok" if result.passed else "**VIOLATED**"
    return (f"| {name} | {data} | {neighbourhood} | {result.claimed_epsilon:.3f} | "
            f"{result.epsilon_lower_bound:.3f} | {verdict} | {result.num_trials} | "
            f"{seconds:.0f} s |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000, help="runs per data set")
    parser.add_argument("--chains", type=int, default=2, help="chains of an end-to-end audit")
    parser.add_argument("--iterations", type=int, default=5,
                        help="iterations per chain of an end-to-end audit")
    opts = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print("# Audits: claimed epsilon against a lower bound\n")
    print(f"Command: `python benchmarks/audit_table.py --runs {opts.runs} --chains "
          f"{opts.chains} --iterations {opts.iterations} > docs/results/audit.md` (see the "
          f"script's docstring for the set-up); delta = {DELTA}, n = {ROWS} rows.\n")
    print(READING)
    print("| kernel | data | neighbourhood | claimed epsilon | lower bound | verdict | "
          "runs per data set | time |")
    print("|---|---|---|---|---|---|---|---|")
    rows = canary_rows()
    for nb in ("substitute", "add_remove"):
        start = time.perf_counter()
        other = -rows if nb == "substitute" else np.where(rows == CANARY, 0.0, rows)
        result = audit.clipped_sum_release(rows, other, row_bound=1.0, noise_multiplier=1.0,
                                           delta=DELTA, neighbourhood=nb)
        print(row("Gaussian release (white box)", "clipped sum, z = 1", nb, result,
                  time.perf_counter() - start), flush=True)
    start = time.perf_counter()
    result = audit.batch_llr_release(*batch_ratios(), clip=1.0, scale=2.0,
                                     noise_multiplier=1.0, delta=DELTA)
    print(row("DPMinibatchPenalty's release (white box)", "b = 10, z = 1", "substitute",
              result, time.perf_counter() - start), flush=True)
    start = time.perf_counter()
    result = audit.barker_test(barker_batch(), -barker_batch(), n0=50, delta=DELTA)
    print(row("DP Barker's test (white box)", "b = 50, n0 = 50", "substitute", result,
              time.perf_counter() - start), flush=True)
    for name, data, neighbourhoods, make in KERNELS:
        for nb in neighbourhoods:
            start = time.perf_counter()
            result = audit.multi_run(make(nb), *neighbours(nb), delta=DELTA, score=draw_score,
                                     num_runs=opts.runs)
            print(row(name, data, nb, result, time.perf_counter() - start), flush=True)
    print("\n## Broken on purpose (`ndp.audit.fault`): a caught fault's bound exceeds the "
          "claim\n")
    print("A missed fault means that this attacker (the draw after one iteration as the "
          "score) cannot see it, not that the fault is harmless.\n")
    print("| fault | audited | claimed epsilon | lower bound | verdict | trials | time |")
    print("|---|---|---|---|---|---|---|")
    cases = [("noise_halved", None, 1), ("canary_unclipped", None, 1),
             ("noise_halved", "batch", 1), ("canary_unclipped", "batch", 1),
             ("canary_unclipped", "barker", 1)]
    seen = set()
    for index, (name, *_) in enumerate(KERNELS):
        family = name.split(" (")[0]
        if family in seen:  # DPSGLD's batchings, guided DPPenalty: the first stands for all
            continue
        seen.add(family)
        cases.append(("canary_unclipped", index, 1))
        if name != "DPBarker":  # its noise is the logistic test's, not a Gaussian release
            cases.append(("noise_halved", index, 1))
    cases.append(("chain_not_charged", KERNELS.index(find("DPSGLD", "full (q = 1)")), 2))
    for fault, index, chains in cases:
        start = time.perf_counter()
        with audit.fault(fault):
            if index is None:
                what = "Gaussian release (white box)"
                result = audit.clipped_sum_release(rows, -rows, row_bound=1.0,
                                                   noise_multiplier=1.0, delta=DELTA)
            elif index == "barker":
                what = "DP Barker's test (white box)"
                result = audit.barker_test(barker_batch(), -barker_batch(), n0=50,
                                           delta=DELTA)
            elif index == "batch":
                what = "DPMinibatchPenalty's release (white box)"
                result = audit.batch_llr_release(*batch_ratios(), clip=1.0, scale=2.0,
                                                 noise_multiplier=1.0, delta=DELTA)
            else:
                name, data, _, make = KERNELS[index]
                what = f"{name}, {data}" + (f", {chains} chains per run" if chains > 1 else "")
                result = audit.multi_run(make("substitute"), *neighbours("substitute"),
                                         delta=DELTA, score=draw_score, num_runs=opts.runs,
                                         chains_per_run=chains)
        verdict = "caught" if not result.passed else "missed"
        print(f"| `{fault}` | {what} | {result.claimed_epsilon:.3f} | "
              f"{result.epsilon_lower_bound:.3f} | {verdict} | {result.num_trials} | "
              f"{time.perf_counter() - start:.0f} s |", flush=True)
    end_to_end(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
