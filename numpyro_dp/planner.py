"""``ndp.plan``: what a private run can do on this data, before anything is spent.

The planner reads only public facts -- the number of rows ``n``, the number
of unconstrained parameters ``d``, the model's structure, the budget and the
run's shape -- and charges nothing.  It calibrates the noise as
:class:`~numpyro_dp.PrivateMCMC` would (tuning shares included) and turns it
into one figure a user can judge: how far a chain can travel under that
noise, in posterior standard deviations.

The figure rests on a stated assumption.  A one-coordinate step of length
``h`` releases a log-likelihood ratio clipped to ``b h`` per row with noise
``z Delta_factor b h``; keeping that noise at one standard deviation allows
``h = 1 / (z Delta_factor b)``.  If each row's slope is about the clip ``b``
(*unit information*: the posterior sd is about ``1 / (b sqrt(n))``), one step
is ``sqrt(n) / (Delta_factor z)`` posterior sds, whatever ``b``, and a chain
of ``T`` iterations that moves each of ``d`` coordinates about ``T / d`` times
at random travels ``sqrt(T / d)`` steps.  Real rows carry less information than
the clip allows, so real posteriors are wider and chains travel fewer real
sds: on statsmodels' ``fair`` (logistic, ``n = 6366``) the posterior sd is
about 5 unit-information sds, and a chain must cross the posterior several
times to be worth reading.  The thresholds are set by that data set, 4
chains of 600 iterations with the defaults: at a travel of 60 (epsilon = 100)
DPPenalty's means were within 0.3 NUTS sds and its sds within 0.72-1.07 of
NUTS's; at 31 (epsilon = 39) DPHMC's were 3 sds off, and DPHMC needed about
ten times the epsilon of DPPenalty throughout.  The verdict is therefore

* ``"feasible"`` when the travel is at least :data:`FEASIBLE_TRAVEL` unit sds,
* ``"marginal"`` from :data:`MARGINAL_TRAVEL`,
* ``"infeasible"`` below: the planner then says what would do (the epsilon
  that would make it feasible, fewer parameters or chains, released
  statistics for a linear model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import dp_accounting as dpa
import numpyro.distributions as dist

from numpyro_dp.accounting import (
    PrivacyBudgetError,
    calibrate_noise_multiplier,
    check_budget,
    check_delta_for_rows,
    gaussian_mu,
    sensitivity_factor,
)
from numpyro_dp.model import PrivateModel, _structure_trace, tabular_to_numpy
from numpyro_dp.tuning import (
    CLIP_SELECTION_SHARE,
    WARM_START_MIN_SNR,
    WARM_START_SHARE,
    WARM_START_STEPS,
    plan_tuning,
)

#: Travel (unit-information posterior sds) from which a run is called feasible.
FEASIBLE_TRAVEL = 60.0
#: Travel from which it is called marginal (below: infeasible).
MARGINAL_TRAVEL = 20.0
#: Largest epsilon the planner searches when it says what would be feasible.
MAX_ADVISED_EPSILON = 1e4


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's plan from public facts; ``str(plan)`` reads as a report.

    Attributes
    ----------
    num_rows, num_params : int
        ``n`` and ``d`` (unconstrained parameters).
    epsilon, delta : float
        The budget.
    num_chains, num_warmup, num_samples : int
        The run's shape.
    warm_start, clip_selection : float
        The tuning shares of epsilon (:class:`~numpyro_dp.PrivateMCMC`).
    noise_multiplier : float
        The sampler's per-iteration noise multiplier after the tuning.
    warm_start_noise_multiplier : float or None
        Of each warm-start release.
    step_sds : float
        One noise-limited one-coordinate step, in unit-information posterior
        sds (module docstring).
    travel_sds : float
        How far one chain can travel at random, in the same units.
    verdict : {"feasible", "marginal", "infeasible"}
    epsilon_feasible : float or None
        The smallest epsilon (to 2 significant digits) at which the same run
        would be feasible (None above :data:`MAX_ADVISED_EPSILON`).
    advice : tuple of str
        What to change.
    """

    num_rows: int
    num_params: int
    epsilon: float
    delta: float
    num_chains: int
    num_warmup: int
    num_samples: int
    warm_start: float
    clip_selection: float
    noise_multiplier: float
    warm_start_noise_multiplier: float | None
    step_sds: float
    travel_sds: float
    verdict: str
    epsilon_feasible: float | None
    advice: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return self.verdict == "feasible"

    def __str__(self) -> str:
        iterations = self.num_warmup + self.num_samples
        lines = [
            f"Private MCMC plan: n = {self.num_rows} rows, d = {self.num_params} parameters, "
            f"({self.epsilon:g}, {self.delta:g})-DP",
            f"  run: {self.num_chains} chains x {iterations} iterations "
            f"({self.num_warmup} warm-up)",
            f"  budget: {self.warm_start:.0%} warm start, {self.clip_selection:.0%} clip "
            f"selection, the rest sampling (noise multiplier {self.noise_multiplier:.3g} per "
            "iteration)",
            f"  one step under that noise: {self.step_sds:.3g} posterior sds "
            "(unit information); a chain travels about "
            f"{self.travel_sds:.3g}",
            f"  verdict: {self.verdict.upper()}",
        ]
        lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def travel_sds(num_rows: int, num_params: int, z: float, iterations: int, factor: float):
    """``(step, travel)`` in unit-information posterior sds (module docstring)."""
    step = math.sqrt(num_rows) / (factor * z)
    return step, step * math.sqrt(iterations / num_params)


def _sampler_noise(epsilon, delta, tuning_event, iterations, num_chains) -> float:
    """The sampler's per-iteration ``z`` after the tuning: Gaussian events compose in ``mu^2``."""
    mu2 = calibrate_noise_multiplier(dpa.GaussianDpEvent, epsilon, delta) ** -2
    tuning_mu2 = 0.0 if tuning_event is None else gaussian_mu(tuning_event) ** 2
    return math.sqrt(iterations * num_chains / (mu2 - tuning_mu2)) * (1 + 1e-9)


def _linear_gaussian(model: Callable, model_args: tuple, model_kwargs: dict) -> bool:
    """Whether an observed site is Normal (where released statistics may serve)."""
    trace = _structure_trace(model, model_args, model_kwargs)
    return any(
        s["type"] == "sample" and s["is_observed"] and isinstance(s["fn"], dist.Normal)
        for s in trace.values()
    )


def plan(
    model: Callable,
    *model_args,
    epsilon: float,
    delta: float,
    num_warmup: int = 500,
    num_samples: int = 500,
    num_chains: int = 4,
    warm_start: float = WARM_START_SHARE,
    clip_selection: float = CLIP_SELECTION_SHARE,
    warm_start_steps: int = WARM_START_STEPS,
    neighbourhood: str = "substitute",
    data_plate: str | None = None,
    **model_kwargs,
) -> Plan:
    """Plan a private run of ``model`` on its data: public facts only, nothing charged.

    Parameters
    ----------
    model : callable
        The NumPyro model, as given to a kernel.
    *model_args, **model_kwargs :
        Its arguments, as given to :meth:`PrivateMCMC.run` (validated as a run
        would; only ``n``, the shapes and the structure are used).
    epsilon, delta : float
        The budget of the whole run (``delta`` below ``1 / n``).
    num_warmup, num_samples, num_chains : int
        The run's shape (``PrivateMCMC``'s arguments).
    warm_start, clip_selection, warm_start_steps :
        As for :class:`~numpyro_dp.PrivateMCMC`.
    neighbourhood : {"substitute", "add_remove"}
    data_plate : str, optional

    Returns
    -------
    Plan
        Print it for the report; ``plan.verdict`` and ``plan.advice`` for code.

    Examples
    --------
    >>> print(ndp.plan(model, X, y, epsilon=3.0, delta=1e-6))  # doctest: +SKIP
    """
    check_budget(epsilon, delta)
    if epsilon is None or delta is None:
        raise ValueError("plan needs epsilon= and delta=, the budget of the whole run.")
    model_args, model_kwargs = tabular_to_numpy((model_args, model_kwargs))
    pm = PrivateModel(model, model_args, model_kwargs, data_plate=data_plate)
    n, d = pm.num_rows, pm.num_params
    check_delta_for_rows(delta, n)
    iterations = num_warmup + num_samples
    factor = sensitivity_factor(neighbourhood)

    def figures(eps):
        tuning = plan_tuning(eps, delta, warm_start=warm_start, clip_selection=clip_selection,
                             requests=(), warm_start_clip=None,
                             warm_start_steps=warm_start_steps, num_rows=n,
                             neighbourhood=neighbourhood)
        z = _sampler_noise(eps, delta, None if tuning is None else tuning.event(), iterations,
                           num_chains)
        return tuning, z, *travel_sds(n, d, z, iterations, factor)

    try:
        tuning, z, step, travel = figures(epsilon)
    except PrivacyBudgetError:
        tuning, z, step, travel = None, math.inf, 0.0, 0.0
    verdict = (
        "feasible" if travel >= FEASIBLE_TRAVEL
        else "marginal" if travel >= MARGINAL_TRAVEL else "infeasible"
    )
    eps_ok = None
    if verdict != "feasible":
        lo, hi = epsilon, epsilon
        while figures(hi)[3] < FEASIBLE_TRAVEL and hi < MAX_ADVISED_EPSILON:
            lo, hi = hi, hi * 2
        if figures(hi)[3] >= FEASIBLE_TRAVEL:
            while hi / lo > 1.02:
                mid = math.sqrt(lo * hi)
                lo, hi = (lo, mid) if figures(mid)[3] >= FEASIBLE_TRAVEL else (mid, hi)
            scale = 10.0 ** (math.floor(math.log10(hi)) - 1)
            eps_ok = math.ceil(hi / scale) * scale  # two digits, rounded up: still feasible
    advice = []
    warm_start_made = tuning is not None and tuning.warm_start_steps > 0
    if warm_start > 0 and not warm_start_made:
        advice.append(
            "No warm start: at this n and budget its noisy gradients would swamp the "
            f"signal (n / (Delta_factor z) below {WARM_START_MIN_SNR:g}); the chains start "
            "from the prior and its share goes to sampling."
        )
    if verdict == "feasible":
        advice.append(
            "Run it: DPPenalty(model) with the default clips and steps, "
            f"PrivateMCMC(kernel, num_warmup={num_warmup}, num_samples={num_samples}, "
            f"num_chains={num_chains}, epsilon={epsilon:g}, delta={delta:g}); check "
            "mcmc.mixing after the run. DPHMC's gradients carry more noise: it needed "
            "about ten times the epsilon on the benchmark data."
        )
    else:
        what = "will hardly move" if verdict == "infeasible" else "may not mix"
        advice.append(
            f"At this budget the chains {what}: their draws would say more about where they "
            "started than about the posterior. Nothing has been spent."
        )
        if eps_ok is not None:
            advice.append(f"epsilon >= {eps_ok:g} would make this run feasible.")
        advice.append(
            f"Fewer parameters help (travel grows like 1/sqrt(d), d = {d}), as do fewer "
            "chains (each gets more of the budget; keep at least 2 for R-hat)."
        )
        if _linear_gaussian(model, model_args, model_kwargs):
            advice.append(
                "For a linear regression, ndp.linreg releases the sufficient statistics "
                "once and NUTS runs on the release at no further cost: far less noise than "
                "thousands of MCMC releases."
            )
    return Plan(
        n, d, float(epsilon), float(delta), num_chains, num_warmup, num_samples,
        float(warm_start) if warm_start_made else 0.0, float(clip_selection), z,
        None if tuning is None else tuning.noise_multiplier_grad,
        step, travel, verdict, eps_ok, tuple(advice),
    )
