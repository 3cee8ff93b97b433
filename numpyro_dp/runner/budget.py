"""A run's budget decisions, from public facts only: nothing here charges or runs.

One module decides, for :meth:`PrivateMCMC.run <numpyro_dp.PrivateMCMC.run>`,
:meth:`PrivateMCMC.plan <numpyro_dp.PrivateMCMC.plan>` and :func:`ndp.plan
<numpyro_dp.plan>` alike:

* the shares of epsilon: :func:`check_shares`, and the warm start's share
  (:func:`warm_start_share`; ``"auto"`` is :func:`auto_warm_start_share`);
* the tuning releases a call makes first (:func:`tuning_plan`);
* the sampler's noise for what is left of the budget (:func:`noise_for_budget`,
  the one formula of the three callers);
* the ledger entries a call will charge (:func:`call_entries`).

The budget's own checks and closed forms are in :mod:`numpyro_dp.accounting`;
what happens to the ledger (the charge, refusals, plans) in
:mod:`numpyro_dp.runner.charging`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting as dpa

from numpyro_dp.accounting import (
    PrivacyBudgetError,
    calibrate_gaussian,
    calibrate_noise_multiplier,
    check_budget,
    epsilon_spent,
    gaussian_mu,
    make_accountant,
    sensitivity_factor,
)
from numpyro_dp.accounting.accountants import GaussianAccountant
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.model.units import ROW
from numpyro_dp.runner.tuning import WARM_START_SHARE, TuningPlan, plan_tuning
from numpyro_dp.runner.warm_start import WARM_START_STAGES

#: Travel (unit-information posterior sds, :func:`travel_sds`) below which the warm
#: start takes most of a per-iteration run's budget (:data:`STUCK_WARM_START_SHARE`),
#: and a calibrated run warns that its chains will stay near where they start.
MARGINAL_TRAVEL = 20.0
#: The warm start's share of epsilon (``warm_start="auto"``, the default) when
#: the sampler at the usual share (:data:`~numpyro_dp.runner.tuning.WARM_START_SHARE`)
#: would travel less than :data:`MARGINAL_TRAVEL`: its chains then stay near
#: where they start, so the start, a noise-aware Laplace approximation, gets
#: most of the budget.  On statsmodels' ``fair`` at epsilon = 3 the start's
#: largest error was 1.5-3.5 NUTS sds over three seeds at 0.9 and 2-8 at 0.3.
STUCK_WARM_START_SHARE = 0.8
#: Relative margin of the closed-form noise (:func:`noise_for_budget`) above the
#: exact solution: the sums of ``1 / z^2`` round, the answer must still fit.
CLOSED_FORM_MARGIN = 1e-9


# ------------------------------------------------------------------ the noise
def noise_for_budget(
    epsilon: float,
    delta: float,
    event: Callable[[float], dpa.DpEvent],
    *,
    spent: dpa.DpEvent | None = None,
    neighbourhood: str = "substitute",
    accountant: str = "auto",
    cap: float | None = None,
    refusal: Callable[[float], Exception] | None = None,
) -> float:
    """The smallest noise multiplier ``z`` at which ``spent`` and ``event(z)`` fit
    ``epsilon``: the sampler's noise, for the runner and both planners.

    ``event(z)`` is what the call releases at noise ``z`` (its chains, and releases
    made once); ``spent`` what comes before it (the ledger, the tuning releases).
    Where the accountant of the whole is the exact Gaussian one
    (:class:`~numpyro_dp.accounting.accountants.GaussianAccountant`: plain Gaussian
    releases whose noise scales with ``z``), ``mu^2`` is additive and the answer is
    closed-form (``mu^2`` of the budget less what ``spent`` took); elsewhere it is
    dp-accounting's search (:func:`~numpyro_dp.accounting.calibrate_noise_multiplier`).

    ``cap``: the largest noise allowed; a call that would need more raises
    ``refusal(epsilon at cap)`` (a :class:`PrivacyBudgetError` by default).
    Without a cap, a budget that ``spent`` already exhausts raises
    :class:`PrivacyBudgetError`.
    """
    spent = dpa.NoOpDpEvent() if spent is None else spent

    def total(z):
        return dpa.ComposedDpEvent([spent, event(z)])

    if cap is not None:
        needed = epsilon_spent(total(cap), delta, neighbourhood, accountant)
        if needed > epsilon:
            raise (refusal or _refused)(needed)
    closed = _closed_form(epsilon, delta, event, spent, neighbourhood, accountant)
    if closed is not None:
        if cap is not None and closed > cap:  # the cap fits: round-off at its edge
            return cap
        return closed
    return calibrate_noise_multiplier(total, epsilon, delta, neighbourhood, accountant,
                                      upper=cap)


def _refused(needed: float) -> PrivacyBudgetError:
    return PrivacyBudgetError(f"At its largest noise the run would spend epsilon {needed:.4g}.")


def _closed_form(epsilon, delta, event, spent, neighbourhood, accountant) -> float | None:
    """:func:`noise_for_budget` where plain Gaussian releases compose in ``mu^2``
    (None elsewhere)."""
    if not isinstance(make_accountant(dpa.ComposedDpEvent([spent, event(1.0)]), accountant,
                                      neighbourhood), GaussianAccountant):
        return None
    spent_mu = gaussian_mu(spent)
    one, two = gaussian_mu(event(1.0)), gaussian_mu(event(2.0))
    if spent_mu is None or not one or two is None or not math.isclose(
            one, 2 * two, rel_tol=1e-12):  # the noise must scale with z
        return None
    left = calibrate_gaussian(epsilon, delta) ** -2 - spent_mu**2
    if left <= 0:
        raise PrivacyBudgetError(
            f"Nothing of epsilon={epsilon:g} is left for sampling at delta={delta:g}.")
    return one / math.sqrt(left) * (1 + CLOSED_FORM_MARGIN)


def chains_event(run_event: Callable[[int, float], dpa.DpEvent], iterations: int,
                 num_chains: int, release_entries: Callable[[float], list] = lambda z: ()):
    """``z -> `` the event of a call: the releases made once (``(phase, event,
    releases)``), then ``num_chains`` chains of ``run_event(iterations, z)``."""

    def event(z):
        once = [dpa.SelfComposedDpEvent(e, k) for _, e, k in release_entries(z)]
        return dpa.ComposedDpEvent(
            [*once, dpa.SelfComposedDpEvent(run_event(iterations, z), num_chains)])

    return event


def gaussian_run_noise(epsilon: float, delta: float, tuning: TuningPlan | None,
                       iterations: int, num_chains: int) -> float:
    """The planners' sampler: ``num_chains x iterations`` Gaussian releases of noise
    ``z`` after the tuning releases (:func:`noise_for_budget`)."""
    return noise_for_budget(
        epsilon, delta, lambda z: dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z),
                                                          iterations * num_chains),
        spent=None if tuning is None else tuning.event())


def resolve_budget(sampler, epsilon: float | None, delta: float | None, accountant: str,
                   ledger) -> tuple[float | None, float, str, bool]:
    """``(epsilon, delta, accountant, calibrate)`` of a runner of ``sampler``: a ledger's
    delta, accountant and budget apply (the smaller budget wins); ``calibrate`` says
    whether the sampler's noise is calibrated to the budget."""
    check_budget(epsilon, delta)
    if ledger is not None:
        if delta not in (None, ledger.delta):
            raise ValueError(
                f"delta={delta} differs from the ledger's delta={ledger.delta}; "
                "omit delta= to use the ledger's."
            )
        if ledger.neighbourhood != sampler.neighbourhood:
            raise ValueError(
                f"The ledger is kept under the {ledger.neighbourhood!r} "
                f"neighbourhood but the kernel uses {sampler.neighbourhood!r}; "
                "build the kernel with the ledger's neighbourhood."
            )
        delta, accountant = ledger.delta, ledger.accountant
        if ledger.budget is not None:
            epsilon = ledger.budget if epsilon is None else min(epsilon, ledger.budget)
    if delta is None:
        raise ValueError(
            "PrivateMCMC needs delta, the delta of the (epsilon, delta) "
            "guarantee; choose it well below 1/n, e.g. delta=0.1/n."
        )
    calibrate = sampler.calibrated_noise and sampler.noise_multiplier is None
    if calibrate and epsilon is None:
        raise ValueError(
            f"{type(sampler).__name__} has no noise_multiplier and no epsilon "
            "was given: pass epsilon= (and delta=) to calibrate the noise to a "
            "budget, or set noise_multiplier= on the kernel."
        )
    return epsilon, delta, accountant, calibrate


# -------------------------------------------------------------- the warm start
def travel_sds(num_rows: int, num_params: int, z: float, iterations: int, factor: float):
    """``(step, travel)`` in unit-information posterior sds: one noise-limited
    one-coordinate step, ``sqrt(n) / (Delta_factor z)``, and ``sqrt(T / d)`` of them
    (:mod:`numpyro_dp.runner.planning`'s docstring)."""
    step = math.sqrt(num_rows) / (factor * z)
    return step, step * math.sqrt(iterations / num_params)


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
        z = gaussian_run_noise(epsilon, delta, tuning, iterations, num_chains)
    except (PrivacyBudgetError, ValueError):  # the run itself will say why it cannot be paid
        return WARM_START_SHARE
    _, travel = travel_sds(num_rows, num_params, z, iterations, sensitivity_factor(neighbourhood))
    if travel >= MARGINAL_TRAVEL:
        return WARM_START_SHARE
    # Leave the sampler a share: (warm_start + clip_selection) < 1.
    return min(STUCK_WARM_START_SHARE, 0.9 - clip_selection)


def warm_start_share(warm_start: float | str, epsilon: float | None, *,
                     kernel_share: float | None, auto: bool, **facts) -> float:
    """The warm start's share of epsilon: ``warm_start``, or for ``"auto"`` the
    kernel's own share (``kernel_share``), else :func:`auto_warm_start_share` of
    ``facts`` (0 where ``auto`` is False, or without a budget)."""
    if warm_start != "auto":
        return warm_start
    if epsilon is None:
        return 0.0
    if kernel_share is not None:
        return kernel_share
    return auto_warm_start_share(epsilon, **facts) if auto else 0.0


def check_shares(warm_start: float | str, clip_selection: float,
                 warm_start_steps: int | None) -> None:
    """Refuse shares of epsilon that leave nothing to sample with."""
    shares = [("clip_selection", clip_selection)]
    if warm_start != "auto":
        shares.append(("warm_start", warm_start))
    for name, share in shares:
        if not (isinstance(share, (int, float)) and 0 <= share < 1):
            raise ValueError(
                f"{name}={share!r} must be a share of epsilon in [0, 1) (0 turns it off"
                + (', "auto" chooses it' if name == "warm_start" else "") + ")."
            )
    if warm_start != "auto" and warm_start + clip_selection >= 1:
        raise ValueError(
            f"warm_start + clip_selection = {warm_start + clip_selection} leaves "
            "nothing of epsilon for sampling; keep their sum well below 1."
        )
    if warm_start_steps is not None and not (
            isinstance(warm_start_steps, int) and warm_start_steps >= 2
            and warm_start_steps % WARM_START_STAGES == 0):
        raise ValueError(
            f"warm_start_steps={warm_start_steps!r} must be a positive multiple of "
            f"{WARM_START_STAGES} (the warm start's stages, each choosing its clips)."
        )


# ------------------------------------------------------------ what is charged
def tuning_plan(kernel, epsilon: float | None, delta: float, *, share: float,
                clip_selection: float, warm_start_steps: int | None) -> TuningPlan | None:
    """The tuning releases a fresh call of ``kernel`` makes first (None: none):
    clips it was built without, and a warm start of ``share`` of epsilon (0: none)."""
    requests = kernel.clip_requests()
    if not requests and not share:
        return None
    if epsilon is None:
        if requests:
            raise ValueError(
                f"{type(kernel).__name__} has no {', '.join(r.name for r in requests)} "
                "and this PrivateMCMC has no epsilon to choose it privately from: "
                "state the clip(s) on the kernel, or give PrivateMCMC an epsilon."
            )
        return None
    pm = kernel._private_model
    return plan_tuning(
        epsilon, delta, warm_start=share, clip_selection=clip_selection, requests=requests,
        warm_start_clip=kernel.warm_start_clip, warm_start_steps=warm_start_steps,
        num_rows=pm.num_rows, num_params=pm.num_params, neighbourhood=kernel.neighbourhood,
        noise_scale=pm.likelihood_reads_scale,
    )


def once_entries(kernel_name: str, entries, reproducible_noise: bool,
                 privacy_unit: str = ROW) -> list[LedgerEntry]:
    """Ledger entries of releases made once per call: ``(phase, event, releases)``."""
    return [LedgerEntry(kernel_name, phase, 1, releases, event,
                        reproducible_noise=reproducible_noise, privacy_unit=privacy_unit)
            for phase, event, releases in entries]


def tuning_entries(kernel, tuning: TuningPlan | None, reproducible_noise: bool,
                   privacy_unit: str = ROW) -> tuple[LedgerEntry, ...]:
    """Ledger entries of the tuning releases (none without a tuning plan)."""
    entries = [] if tuning is None else tuning.entries()
    return tuple(once_entries(type(kernel).__name__, entries, reproducible_noise,
                              privacy_unit))


def call_entries(kernel, tuning: TuningPlan | None, z, *, num_chains: int, iterations: int,
                 phase: str, start: int, reproducible_noise: bool, privacy_unit: str = ROW):
    """``(pending, entry)``: the ledger entries a call charges at noise ``z``, the
    releases made once (tuning, then the kernel's own) and its chains' iterations;
    ``privacy_unit`` is what they protect (a row, or the call's units)."""
    name = type(kernel).__name__
    pending = [*tuning_entries(kernel, tuning, reproducible_noise, privacy_unit)]
    pending += once_entries(name, kernel.release_entries(z), reproducible_noise, privacy_unit)
    entry = LedgerEntry(name, phase, num_chains, iterations, kernel.per_iteration_event(z),
                        kernel.run_event(iterations, start, z),
                        reproducible_noise=reproducible_noise, privacy_unit=privacy_unit)
    return pending, entry
