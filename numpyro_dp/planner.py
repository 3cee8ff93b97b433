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

Chains that cannot travel are still useful when they start close to the
posterior: the private warm start (:mod:`numpyro_dp.tuning`) places them
around a noise-aware Laplace approximation, and its centre's noise per
direction, in the same units (:func:`start_error_sds`), makes a run feasible
up to :data:`FEASIBLE_START_ERROR` and marginal up to
:data:`MARGINAL_START_ERROR` whatever the travel -- for observations with
bounded support only (Bernoulli, Binomial): counts and continuous responses
have rows far out that bias the warm start's clipped gradients.  On ``fair`` at epsilon = 10
(start noise 0.27, travel 6) DPPenalty's means came within 0.5-0.9 NUTS sds;
at epsilon = 3 (0.79) 1.7-2.4.
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
from numpyro_dp.model.adapter import ObservedSite, PrivateModel, tabular_to_numpy
from numpyro_dp.tuning import (
    CLIP_SELECTION_SHARE,
    WARM_START_MIN_SNR,
    WARM_START_SHARE,
    plan_tuning,
)

#: Travel (unit-information posterior sds) from which a run is called feasible.
FEASIBLE_TRAVEL = 60.0
#: Travel from which it is called marginal (below: infeasible).
MARGINAL_TRAVEL = 20.0
#: The warm start's noise (:func:`start_error_sds`) up to which a run is called
#: feasible whatever the chains' travel, and marginal.
FEASIBLE_START_ERROR = 0.3
MARGINAL_START_ERROR = 0.6
#: Largest epsilon the planner searches when it says what would be feasible.
MAX_ADVISED_EPSILON = 1e4
#: The warm start's final clip over the root-mean-square norm of the rows'
#: whitened gradients, ``sqrt(d / n)`` at unit information (on statsmodels'
#: ``fair``, a clip of 0.125 at sqrt(d / n) = 0.0376).
START_CLIP_RMS = 3.3
#: The warm start's share of epsilon (``warm_start="auto"``, the default) when
#: the sampler at the usual share (:data:`~numpyro_dp.tuning.WARM_START_SHARE`)
#: would travel less than :data:`MARGINAL_TRAVEL`: its chains then stay near
#: where they start, so the start, a noise-aware Laplace approximation, gets
#: most of the budget.  On statsmodels' ``fair`` at epsilon = 3 the start's
#: largest error was 1.5-3.5 NUTS sds over three seeds at 0.9 and 2-8 at 0.3.
STUCK_WARM_START_SHARE = 0.8


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
        Of the gradient releases of the warm start's final stage.
    start_error_sds : float
        The warm start's noise per direction, in unit-information posterior
        sds (:func:`start_error_sds`; infinite without a warm start).
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
    start_error_sds: float
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
            f"  warm start: its centre's noise is about {self.start_error_sds:.2g} posterior "
            "sds per direction (unit information)" if self.warm_start else "  no warm start",
            f"  one step under that noise: {self.step_sds:.3g} posterior sds "
            "(unit information); a chain travels about "
            f"{self.travel_sds:.3g}",
            f"  verdict: {self.verdict.upper()}",
        ]
        lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def start_error_sds(num_rows: int, num_params: int, tuning, factor: float) -> float:
    """Noise of the warm start per direction, in unit-information posterior sds.

    The final stage works where the posterior is white; there each row's
    gradient has root-mean-square norm ``sqrt(d / n)`` (unit information) and
    the clip is :data:`START_CLIP_RMS` times that; the start averages ``m`` of
    the stage's iterates, each carrying noise ``Delta_factor z C``.  Infinite
    without a warm start.
    """
    if tuning is None or not tuning.warm_start_steps:
        return math.inf
    m = tuning.stage_steps - tuning.stage_steps // 2
    z = tuning.warm_start_noise[-1][0]
    return factor * z * START_CLIP_RMS * math.sqrt(num_params / num_rows) / math.sqrt(m)


def travel_sds(num_rows: int, num_params: int, z: float, iterations: int, factor: float):
    """``(step, travel)`` in unit-information posterior sds (module docstring)."""
    step = math.sqrt(num_rows) / (factor * z)
    return step, step * math.sqrt(iterations / num_params)


def _sampler_noise(epsilon, delta, tuning_event, iterations, num_chains) -> float:
    """The sampler's per-iteration ``z`` after the tuning: Gaussian events compose in ``mu^2``."""
    mu2 = calibrate_noise_multiplier(dpa.GaussianDpEvent, epsilon, delta) ** -2
    tuning_mu2 = 0.0 if tuning_event is None else gaussian_mu(tuning_event) ** 2
    return math.sqrt(iterations * num_chains / (mu2 - tuning_mu2)) * (1 + 1e-9)


def auto_warm_start_share(
    epsilon: float,
    delta: float,
    num_rows: int,
    num_params: int,
    iterations: int,
    num_chains: int,
    *,
    clip_selection: float,
    warm_start_steps: int | None,
    neighbourhood: str,
    noise_scale: bool = False,
) -> float:
    """``warm_start="auto"``: the usual share, or :data:`STUCK_WARM_START_SHARE`
    when the sampler could not travel :data:`MARGINAL_TRAVEL` at the usual one.

    Public facts only (``n``, ``d``, the budget, the run's shape, and whether the
    likelihood reads a noise scale).
    """
    try:
        tuning = plan_tuning(epsilon, delta, warm_start=WARM_START_SHARE,
                             clip_selection=clip_selection, requests=(), warm_start_clip=None,
                             warm_start_steps=warm_start_steps, num_rows=num_rows,
                             num_params=num_params, neighbourhood=neighbourhood,
                             noise_scale=noise_scale)
        z = _sampler_noise(epsilon, delta, None if tuning is None else tuning.event(),
                           iterations, num_chains)
    except (PrivacyBudgetError, ValueError):  # the run itself will say why it cannot be paid
        return WARM_START_SHARE
    _, travel = travel_sds(num_rows, num_params, z, iterations, sensitivity_factor(neighbourhood))
    if travel >= MARGINAL_TRAVEL:
        return WARM_START_SHARE
    # Leave the sampler a share: (warm_start + clip_selection) < 1.
    return min(STUCK_WARM_START_SHARE, 0.9 - clip_selection)


def _verdict(travel: float, start_error: float) -> str:
    """Feasible when the chains travel far enough to mix, or start close enough."""
    if travel >= FEASIBLE_TRAVEL or start_error <= FEASIBLE_START_ERROR:
        return "feasible"
    if travel >= MARGINAL_TRAVEL or start_error <= MARGINAL_START_ERROR:
        return "marginal"
    return "infeasible"


def _bounded_observations(observed: tuple[ObservedSite, ...]) -> bool:
    """Whether every observed site has bounded support (Bernoulli, Binomial, ...).

    The warm start's noise figure (:func:`start_error_sds`) assumes rows whose
    gradients have light tails; counts and continuous responses can have rows
    far out that its clips must either cut (a biased start) or pay for.
    """
    unbounded_counts = (type(dist.constraints.nonnegative_integer),
                        type(dist.constraints.positive_integer))
    return bool(observed) and all(
        site.discrete and not issubclass(site.support, unbounded_counts)
        or issubclass(site.support, type(dist.constraints.unit_interval))
        for site in observed
    )


def _linear_gaussian(observed: tuple[ObservedSite, ...]) -> bool:
    """Whether an observed site is Normal (where released statistics may serve)."""
    return any(issubclass(site.family, dist.Normal) for site in observed)


def plan(
    model: Callable,
    *model_args,
    epsilon: float,
    delta: float,
    num_warmup: int = 500,
    num_samples: int = 500,
    num_chains: int = 4,
    warm_start: float | str = "auto",
    clip_selection: float = CLIP_SELECTION_SHARE,
    warm_start_steps: int | None = None,
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

    def share(eps):
        if warm_start != "auto":
            return warm_start
        return auto_warm_start_share(eps, delta, n, d, iterations, num_chains,
                                     clip_selection=clip_selection,
                                     warm_start_steps=warm_start_steps,
                                     neighbourhood=neighbourhood,
                                     noise_scale=pm.likelihood_reads_scale)

    def figures(eps):
        tuning = plan_tuning(eps, delta, warm_start=share(eps), clip_selection=clip_selection,
                             requests=(), warm_start_clip=None,
                             warm_start_steps=warm_start_steps, num_rows=n, num_params=d,
                             neighbourhood=neighbourhood, noise_scale=pm.likelihood_reads_scale)
        z = _sampler_noise(eps, delta, None if tuning is None else tuning.event(), iterations,
                           num_chains)
        step, travel = travel_sds(n, d, z, iterations, factor)
        return tuning, z, step, travel, start_error_sds(n, d, tuning, factor)

    # The start's figure counts towards the verdict only for bounded observations.
    bounded = _bounded_observations(pm.observed)

    def _verdict_here(travel, start_error):
        return _verdict(travel, start_error if bounded else math.inf)

    def feasible(eps):
        return _verdict_here(*figures(eps)[3:]) == "feasible"

    warm_share = share(epsilon)
    try:
        tuning, z, step, travel, start_error = figures(epsilon)
    except PrivacyBudgetError:
        tuning, z, step, travel, start_error = None, math.inf, 0.0, 0.0, math.inf
    verdict = _verdict_here(travel, start_error)
    eps_ok = None
    if verdict != "feasible":
        lo, hi = epsilon, epsilon
        while not feasible(hi) and hi < MAX_ADVISED_EPSILON:
            lo, hi = hi, hi * 2
        if feasible(hi):
            while hi / lo > 1.02:
                mid = math.sqrt(lo * hi)
                lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
            scale = 10.0 ** (math.floor(math.log10(hi)) - 1)
            eps_ok = math.ceil(hi / scale) * scale  # two digits, rounded up: still feasible
    advice = []
    warm_start_made = tuning is not None and tuning.warm_start_steps > 0
    if warm_share > 0 and not warm_start_made:
        advice.append(
            "No warm start: at this n and budget its noisy gradients would swamp the "
            f"signal (n / (Delta_factor z) below {WARM_START_MIN_SNR:g}); the chains start "
            "from the prior and its share goes to sampling."
        )
    if verdict == "feasible":
        if travel < MARGINAL_TRAVEL:
            advice.append(
                "The chains will move little: the draws will be close to the warm start's "
                "noise-aware Laplace approximation, and R-hat will say that they did not mix."
            )
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
        if warm_start_made and verdict == "infeasible":
            advice.append(
                f"The warm start takes {warm_share:.0%} of epsilon (PrivateMCMC's "
                'warm_start="auto" when the chains cannot travel): the draws will be close '
                "to its noise-aware Laplace approximation, whose centre carries noise of "
                f"about {start_error:.2g} posterior sds per direction (unit information); "
                "R-hat will say that the chains did not mix."
            )
        if not bounded and start_error <= MARGINAL_START_ERROR:
            advice.append(
                "The verdict rests on the chains' travel alone: the warm start's noise "
                "figure assumes observations with bounded support (Bernoulli, Binomial), "
                "and counts or continuous responses can have rows far out that bias its "
                "clipped gradients (statsmodels' randhie visit counts: 77-115 NUTS sds)."
            )
        if eps_ok is not None:
            advice.append(f"epsilon >= {eps_ok:g} would make this run feasible.")
        advice.append(
            f"Fewer parameters help (travel grows like 1/sqrt(d), d = {d}), as do fewer "
            "chains (each gets more of the budget; keep at least 2 for R-hat)."
        )
        if _linear_gaussian(pm.observed):
            advice.append(
                "For a linear regression, ndp.linreg releases the sufficient statistics "
                "once and NUTS runs on the release at no further cost: far less noise than "
                "thousands of MCMC releases."
            )
    return Plan(
        n, d, float(epsilon), float(delta), num_chains, num_warmup, num_samples,
        float(warm_share) if warm_start_made else 0.0, float(clip_selection), z,
        None if not warm_start_made else tuning.warm_start_noise[-1][0],
        start_error, step, travel, verdict, eps_ok, tuple(advice),
    )
