"""``ndp.plan``: what a private run can do on this data, before anything is spent.

The planner reads only public facts -- the number of rows ``n``, the number
of unconstrained parameters ``d``, the model's structure, the budget and the
run's shape -- and charges nothing.  It compares the two routes a
:class:`~numpyro_dp.PrivateMCMC` run can take, each with its noise calibrated as
the run would calibrate it (tuning shares included), and recommends one
(:attr:`Plan.kernel`, built and ready):

* the per-iteration kernels (``DPPenalty``), recommended only where their chains can
  mix: a chain travels at least :data:`FEASIBLE_TRAVEL` posterior sds (below);
  they then target the posterior itself, and their error is Monte Carlo error;
* ``NoiseAwareNUTS``, one release of the score and curvature and NUTS on a model of
  it (SPEC s12), elsewhere: its expected error per direction in posterior sds
  (:func:`noise_aware_error_sds`) makes the verdict, ``"feasible"`` up to
  :data:`FEASIBLE_ERROR`, ``"marginal"`` up to :data:`MARGINAL_ERROR`; and a budget
  whose release would be lost in its noise, which the run refuses before anything
  is spent, is ``"infeasible"``.

Both figures fall as epsilon grows, so the verdict, the better of the two, never
gets worse with more budget.

The per-iteration figure is how far a chain can travel under its noise, in
posterior standard deviations.

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

the per-iteration route is recommended when the travel is at least
:data:`FEASIBLE_TRAVEL` unit sds.  (Chains that travel less stay near the private
warm start's noise-aware Laplace approximation, whose centre's noise per direction
:func:`start_error_sds` reports: on ``fair`` at epsilon = 10, start noise 0.27 and
travel 6, DPPenalty's means came within 0.5-0.9 NUTS sds, and R-hat said that the
chains had not mixed; ``NoiseAwareNUTS`` came within 0.06-0.19 there.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpyro.distributions as dist

from numpyro_dp.accounting import (
    PrivacyBudgetError,
    check_budget,
    check_delta_for_rows,
    sensitivity_factor,
)
from numpyro_dp.kernels.penalty import DPPenalty
from numpyro_dp.model.adapter import ObservedSite, PrivateModel, tabular_to_numpy
from numpyro_dp.model.units import ROW
from numpyro_dp.releases.noise_aware import NoiseAwareNUTS
from numpyro_dp.releases.score_budget import (
    MAX_CURVATURE_NOISE,
    RELEASE_CURVATURE_SHARES,
    STAGE_SHARES,
    curvature_noise,
    release_noise,
)
from numpyro_dp.runner.budget import auto_warm_start_share, gaussian_run_noise, travel_sds
from numpyro_dp.runner.tuning import CLIP_SELECTION_SHARE, plan_tuning
from numpyro_dp.runner.warm_start import TYPICAL_CLIPS

#: Travel (unit-information posterior sds) from which the per-iteration route is
#: recommended (its chains can mix).
FEASIBLE_TRAVEL = 60.0
#: ``NoiseAwareNUTS``'s expected error per direction (:func:`noise_aware_error_sds`,
#: posterior sds) up to which a plan is feasible, and marginal: its intervals are
#: then about ``sqrt(1 + e^2)``, 1.12 and 1.8 times as wide as the rows alone allow.
FEASIBLE_ERROR = 0.5
MARGINAL_ERROR = 1.5
#: Largest epsilon the planner searches when it says what would be feasible.
MAX_ADVISED_EPSILON = 1e4
#: The warm start's final clip over the root-mean-square norm of the rows'
#: whitened gradients, ``sqrt(d / n)`` at unit information (on statsmodels'
#: ``fair``, a clip of 0.125 at sqrt(d / n) = 0.0376).
START_CLIP_RMS = 3.3


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
        Of the recommended route (module docstring).
    epsilon_feasible : float or None
        The smallest epsilon (to 2 significant digits) at which the same run
        would be feasible (None above :data:`MAX_ADVISED_EPSILON`).
    advice : tuple of str
        What to change.
    route : {"DPPenalty", "NoiseAwareNUTS"}
        The recommended route.
    kernel : DPKernel
        Its kernel, built for the model and ready for :class:`~numpyro_dp.PrivateMCMC`.
    release_noise_multiplier : float
        ``NoiseAwareNUTS``'s release phase's noise multiplier at this budget.
    expected_error_sds : float
        ``NoiseAwareNUTS``'s expected error per direction in posterior sds
        (:func:`noise_aware_error_sds`); 0 where the per-iteration route is
        recommended (its chains target the posterior).
    sd_ratio : float
        The recommended route's expected posterior sd over the rows' alone:
        ``sqrt(1 + expected_error_sds^2)``.
    release_refused : bool
        Whether ``NoiseAwareNUTS`` would refuse this budget before spending it.
    privacy_unit : str
        What the plan protects: ``"row"``, or ``"unit:..."`` with ``privacy_unit=``
        (``num_rows`` is then the number of units).
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
    route: str
    kernel: object
    release_noise_multiplier: float
    expected_error_sds: float
    sd_ratio: float
    release_refused: bool
    privacy_unit: str = ROW

    @property
    def feasible(self) -> bool:
        return self.verdict == "feasible"

    def __str__(self) -> str:
        iterations = self.num_warmup + self.num_samples
        if self.release_refused:
            release = ("its release would be lost in its noise (refused before anything "
                       "is spent)")
        else:
            release = (f"expected error about {self.expected_error_sds:.2g} posterior sds "
                       "per direction, posterior sds about "
                       f"{math.sqrt(1 + self.expected_error_sds**2):.2g} times the rows' alone")
        lines = [
            f"Private plan: n = {self.num_rows} "
            f"{'rows' if self.privacy_unit == ROW else 'units (privacy_unit)'}, "
            f"d = {self.num_params} parameters, "
            f"({self.epsilon:g}, {self.delta:g})-DP, {self.num_chains} chains x "
            f"{iterations} iterations ({self.num_warmup} warm-up)",
            f"  route: {self.route}",
            "  NoiseAwareNUTS (one release of the score and curvature, then NUTS for free): "
            f"noise multiplier {self.release_noise_multiplier:.3g}; {release}",
            f"  per-iteration kernels (DPPenalty): {self.warm_start:.0%} warm start, "
            f"{self.clip_selection:.0%} clip selection, noise multiplier "
            f"{self.noise_multiplier:.3g} per iteration; one step {self.step_sds:.3g} "
            f"posterior sds (unit information), a chain travels about {self.travel_sds:.3g} "
            f"({FEASIBLE_TRAVEL:g} to mix)",
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


def noise_aware_error_sds(noise_multiplier: float, num_released: int, num_rows: int,
                          factor: float) -> float:
    """``NoiseAwareNUTS``'s expected error per direction, in posterior sds, from public
    facts: the noise of its score release in whitened coordinates (where the posterior's
    sds are 1) at the least clip it takes, :data:`~numpyro_dp.runner.warm_start.TYPICAL_CLIPS` rows'
    typical whitened score ``sqrt(k / n)``, with the release phase's noise multiplier
    ``z`` split as the run splits it (:func:`~numpyro_dp.releases.score_budget.release_noise`).
    A lower bound: heavier tails raise the clip, and an anchor far from the mode adds
    its own error (on statsmodels' ``fair``, d = 9, delta = 1e-6, it gives 1.8, 0.49 and
    0.17 at epsilon 1, 3 and 10; the benchmark's runs erred by 1.6-3.8, 0.33-0.85 and
    0.06-0.19 NUTS sds)."""
    _, z_score, _ = release_noise(noise_multiplier, len(STAGE_SHARES) - 1, num_released,
                                  num_rows, factor)
    return factor * z_score * TYPICAL_CLIPS * math.sqrt(num_released / num_rows)


def _verdict(per_iteration_mixes: bool, error: float, refused: bool, bounded: bool) -> str:
    """The better route's verdict (module docstring); ``NoiseAwareNUTS`` is at best
    marginal where the observations are unbounded (``bounded`` False): its figure is a
    lower bound that heavy tails exceed."""
    if per_iteration_mixes or (bounded and not refused and error <= FEASIBLE_ERROR):
        return "feasible"
    if not refused and error <= MARGINAL_ERROR:
        return "marginal"
    return "infeasible"


def _bounded_observations(observed: tuple[ObservedSite, ...]) -> bool:
    """Whether every observed site has bounded support (Bernoulli, Binomial, ...).

    Elsewhere (counts, continuous responses) rows can lie far out, and
    :func:`noise_aware_error_sds`, which assumes rows of about the typical size, is a
    lower bound: on statsmodels' ``randhie`` visit counts it said 0.10-0.29 posterior sds
    at epsilon 3-10 where the runs erred by 1.0-4.2 NUTS sds, on ggplot2's ``diamonds``
    (log price) 0.05-0.14 where they erred by 0.25-1.3.
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
    privacy_unit=None,
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
    privacy_unit : array, optional
        One unit id per row, as for :meth:`PrivateMCMC.run`: the plan is then for
        a guarantee per unit, with ``n`` the number of units.

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
    pm = PrivateModel(model, model_args, model_kwargs, data_plate=data_plate,
                      privacy_unit=privacy_unit)
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
        z = gaussian_run_noise(eps, delta, tuning, iterations, num_chains)
        step, travel = travel_sds(n, d, z, iterations, factor)
        return tuning, z, step, travel, start_error_sds(n, d, tuning, factor)

    k = int(pm.likelihood_coordinates.sum())
    noise_scale = pm.likelihood_reads_scale
    bounded = _bounded_observations(pm.observed)

    def per_iteration_mixes(eps):
        try:
            return figures(eps)[3] >= FEASIBLE_TRAVEL
        except PrivacyBudgetError:
            return False

    def release(eps):
        """``(z, expected error, refused)`` of NoiseAwareNUTS at ``eps``."""
        warm = NoiseAwareNUTS.warm_start_share if warm_start == "auto" else warm_start
        tuning = plan_tuning(eps, delta, warm_start=warm,
                             clip_selection=clip_selection, requests=(), warm_start_clip=None,
                             warm_start_steps=warm_start_steps, num_rows=n, num_params=d,
                             neighbourhood=neighbourhood, noise_scale=noise_scale)
        try:
            z = gaussian_run_noise(eps, delta, tuning, 1, 1)
        except (PrivacyBudgetError, ValueError):
            return math.inf, math.inf, True
        refused = curvature_noise(z, k, n, factor, RELEASE_CURVATURE_SHARES[1]) > (
            MAX_CURVATURE_NOISE)
        return z, noise_aware_error_sds(z, k, n, factor), refused

    def verdict_at(eps):
        return _verdict(per_iteration_mixes(eps), *release(eps)[1:], bounded)

    warm_share = share(epsilon)
    try:
        tuning, z, step, travel, start_error = figures(epsilon)
    except PrivacyBudgetError:
        tuning, z, step, travel, start_error = None, math.inf, 0.0, 0.0, math.inf
    mixes = travel >= FEASIBLE_TRAVEL
    z_release, error, refused = release(epsilon)
    verdict = _verdict(mixes, error, refused, bounded)
    eps_ok = None
    if verdict != "feasible":
        lo, hi = epsilon, epsilon
        while verdict_at(hi) != "feasible" and hi < MAX_ADVISED_EPSILON:
            lo, hi = hi, hi * 2
        if verdict_at(hi) == "feasible":
            while hi / lo > 1.02:
                mid = math.sqrt(lo * hi)
                lo, hi = (lo, mid) if verdict_at(mid) == "feasible" else (mid, hi)
            scale = 10.0 ** (math.floor(math.log10(hi)) - 1)
            eps_ok = math.ceil(hi / scale) * scale  # two digits, rounded up: still feasible
    route = "DPPenalty" if mixes else "NoiseAwareNUTS"
    kernel = (DPPenalty(model, neighbourhood=neighbourhood, data_plate=data_plate) if mixes
              else NoiseAwareNUTS(model, neighbourhood=neighbourhood, data_plate=data_plate))
    run = (f"PrivateMCMC(plan.kernel, num_warmup={num_warmup}, num_samples={num_samples}, "
           f'num_chains={num_chains}, chain_method="vectorized", epsilon={epsilon:g}, '
           f"delta={delta:g})")
    warm_start_made = tuning is not None and tuning.warm_start_steps > 0
    advice = []
    if verdict != "feasible" and refused:
        advice.append(
            "At this budget NoiseAwareNUTS's release would be lost in its noise (it "
            "refuses such a budget before anything is spent), and the per-iteration "
            "kernels' chains would hardly move. Nothing has been spent."
        )
    elif verdict != "feasible" and error > FEASIBLE_ERROR:
        advice.append(
            "At this budget the posterior will be markedly wider than the rows alone "
            f"allow (about {math.sqrt(1 + error**2):.2g} times). Nothing has been spent."
        )
    if mixes:
        advice.append(
            f"Run it: {run}, plan.kernel being DPPenalty(model) with the default clips and "
            "steps: its chains can travel far enough to mix, and then target the posterior "
            "itself. Check mcmc.mixing after the run. DPHMC's gradients carry more noise: "
            "it needed about ten times the epsilon on the benchmark data."
        )
    elif not refused:
        advice.append(
            f"Run it: {run}, plan.kernel being NoiseAwareNUTS(model): the per-iteration "
            f"kernels' chains would travel only about {travel:.2g} posterior sds (unit "
            f"information; {FEASIBLE_TRAVEL:g} to mix), while one release carries noise of "
            f"about {error:.2g} posterior sds per direction, which its posterior includes "
            "(a lower bound: heavy tails and a far anchor add to it). A CalibrationWarning "
            "after the run says when the release lies outside the regime its model was "
            "shown calibrated in."
        )
    if not mixes and not refused and not bounded:
        advice.append(
            "The observations are unbounded (counts or a continuous response): rows far "
            "out raise the release's clip, and its error can be several times the figure "
            "above (statsmodels' randhie visit counts: 1.0-4.2 NUTS sds where it says "
            "0.1-0.3), so the verdict is at best marginal: read mcmc.release and the "
            "CalibrationWarning after the run."
        )
    if verdict != "feasible":
        if eps_ok is not None:
            advice.append(f"epsilon >= {eps_ok:g} would make this run feasible.")
        advice.append(
            f"Fewer parameters help (the release's noise grows like d^1.5 / n, d = {d}), "
            "as does a neighbourhood of add/remove (half the sensitivity) where it fits "
            "the guarantee you need."
        )
        if _linear_gaussian(pm.observed):
            advice.append(
                "For a linear regression, ndp.linreg releases the sufficient statistics "
                "(X^T X, X^T y, y^T y) once and NUTS runs on the release at no further cost."
            )
    return Plan(
        n, d, float(epsilon), float(delta), num_chains, num_warmup, num_samples,
        float(warm_share) if warm_start_made else 0.0, float(clip_selection), z,
        None if not warm_start_made else tuning.warm_start_noise[-1][0],
        start_error, step, travel, verdict, eps_ok, tuple(advice), route, kernel,
        z_release, 0.0 if mixes else error,
        1.0 if mixes else math.sqrt(1 + error**2), refused,
        pm.privacy_unit,
    )
