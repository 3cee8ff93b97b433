"""A :class:`~numpyro_dp.PrivateMCMC` call against its ledger: charge it, refuse it, or
plan it.

Every function here takes the runner and reads what a call will be from it (the
kernel, the budget, NumPyro's phase); the decisions themselves (shares, noise,
entries) are :mod:`numpyro_dp.runner.budget`'s.  :func:`charge` is the only
function that writes to the ledger before a call runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator

import dp_accounting as dpa
import numpy as np

from numpyro_dp.accounting import (
    PrivacyBudgetError,
    check_delta_for_rows,
    epsilon_spent,
    max_iterations,
)
from numpyro_dp.accounting.entry import LedgerEntry
from numpyro_dp.accounting.lower_bound import epsilon_lower_bound
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.numpyro_compat import collection_params, warmup_state
from numpyro_dp.runner import budget, chains
from numpyro_dp.runner.mixing import MixingWarning
from numpyro_dp.runner.tuning import TuningPlan

#: PLD grid of a plan's epsilon (an upper bound on the charged epsilon).
PLANNING_PLD_INTERVAL = 1e-3

#: Rewrites of a call's sampling entry before it is checked and charged (none: the
#: entry as :func:`~numpyro_dp.runner.budget.call_entries` builds it).  Only
#: :func:`numpyro_dp.audit.fault` adds one, inside its block
#: (:func:`rewriting_entries`), to check an audit's power.
_ENTRY_REWRITES: list[Callable[[LedgerEntry], LedgerEntry]] = []


@contextlib.contextmanager
def rewriting_entries(rewrite: Callable[[LedgerEntry], LedgerEntry]) -> Iterator[None]:
    """Inside the block, every call charges ``rewrite(entry)`` for its sampling entry
    (a fault for :func:`numpyro_dp.audit.fault`: the runs are then not private)."""
    _ENTRY_REWRITES.append(rewrite)
    try:
        yield
    finally:
        _ENTRY_REWRITES.remove(rewrite)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a planned :meth:`PrivateMCMC.run` would cost, before anything runs.

    Attributes
    ----------
    kernel : str
    num_chains, iterations : int
        Chains and iterations per chain of the planned call (warm-up included).
    noise_multiplier : float or None
        The kernel's per-iteration noise multiplier, calibrated to the budget
        when the kernel has none (``None`` for kernels whose dynamics fix the
        noise).
    epsilon : float
        Epsilon of the ledger after the call (what it holds plus the call): a
        fast upper bound, never below what the run would be charged.
    budget : float or None
        The budget that applies.
    fits : bool
        Whether the call fits the budget (and the noise stays below
        ``max_noise_multiplier``).
    max_iterations : int or None
        Iterations per chain that the budget affords at this noise level (at
        least this many).
    advice : str
        What to change when it does not fit.
    noise_multipliers : tuple or None
        DPHMC and DPMALA: ``(z_grad, z_llr)``.
    max_batch_size : int or None
        Kernels whose batch size sets the cost (DPBarker): the largest batch
        size whose call fits the budget (0 when none does; needs ``num_rows``).
    """

    kernel: str
    num_chains: int
    iterations: int
    noise_multiplier: float | None
    epsilon: float
    budget: float | None
    fits: bool
    max_iterations: int | None
    advice: str
    noise_multipliers: tuple | None = None
    max_batch_size: int | None = None

    def __str__(self) -> str:
        z = "fixed by the dynamics" if self.noise_multiplier is None else (
            f"{self.noise_multiplier:.4g}")
        budget = "none" if self.budget is None else f"{self.budget:.4g}"
        if self.noise_multipliers is not None:
            z += " (gradients {:.4g}, log-likelihood ratio {:.4g})".format(
                *self.noise_multipliers)
        lines = [
            f"{self.kernel}: {self.num_chains} chain(s) x {self.iterations} iterations, "
            f"noise multiplier {z}",
            f"  epsilon after the run {self.epsilon:.4g} (budget {budget}): "
            + ("fits" if self.fits else "does NOT fit"),
        ]
        if self.max_iterations is not None:
            lines.append(f"  the budget affords {self.max_iterations} iterations per chain")
        if self.max_batch_size:
            lines.append(f"  the largest batch size that fits is {self.max_batch_size}")
        elif self.max_batch_size == 0:
            lines.append("  no batch size fits: run fewer iterations or chains, or state a "
                         "larger budget")
        if not self.fits:
            lines.append(f"  {self.advice}")
        return "\n".join(lines)


# ------------------------------------------------------------ the call's shape
def iterations_this_call(mcmc) -> tuple[int, str]:
    """Iterations per chain that the coming ``MCMC.run`` will perform, and its phase."""
    if warmup_state(mcmc) is not None:
        return mcmc.num_samples, "sample"
    params = collection_params(mcmc)
    phase = params["phase"] or ("warmup+sample" if mcmc.num_warmup else "sample")
    return params["upper"], phase


def planned_iterations(mcmc) -> int:
    """Iterations per chain of the whole planned run, which calibration pays for.

    A ``warmup()`` call is calibrated for warm-up and sampling together, so
    that the ``run()`` that follows fits what is left.
    """
    if warmup_state(mcmc) is not None:
        return mcmc.num_samples
    return mcmc.num_warmup + mcmc.num_samples


def start_iteration(mcmc) -> int:
    """Iterations each chain has done before this call (0 for a fresh start).

    A continuation from ``post_warmup_state`` resumes the kernel's counter
    ``i``; the smallest over chains is used (costs only fall over time).
    """
    i = getattr(warmup_state(mcmc), "i", None)
    return 0 if i is None else int(np.min(np.asarray(i)))


def warm_start_share(mcmc) -> float:
    """The warm start's share of epsilon; ``"auto"`` resolved from public facts
    (:func:`~numpyro_dp.runner.budget.warm_start_share`)."""
    kernel = mcmc.sampler
    pm = kernel._private_model
    facts = {} if mcmc.warm_start != "auto" or mcmc.epsilon is None or pm is None else dict(
        delta=mcmc.delta, num_rows=pm.num_rows, num_params=pm.num_params,
        iterations=planned_iterations(mcmc), num_chains=mcmc.num_chains,
        clip_selection=mcmc.clip_selection, warm_start_steps=mcmc.warm_start_steps,
        neighbourhood=kernel.neighbourhood, noise_scale=pm.likelihood_reads_scale)
    return budget.warm_start_share(mcmc.warm_start, mcmc.epsilon,
                                   kernel_share=kernel.warm_start_share,
                                   auto=mcmc.auto_warm_start, **facts)


def tuning_plan(mcmc, init_params) -> TuningPlan | None:
    """The tuning releases this call needs (None: none), from public facts only."""
    kernel = mcmc.sampler
    if warmup_state(mcmc) is not None:
        return None
    share = warm_start_share(mcmc)
    warm = share > 0 and init_params is None and mcmc.tuning is None and kernel.tunable
    return budget.tuning_plan(kernel, mcmc.epsilon, mcmc.delta, share=share if warm else 0.0,
                              clip_selection=mcmc.clip_selection,
                              warm_start_steps=mcmc.warm_start_steps)


# ------------------------------------------------------------------ the noise
def calibrated_noise(mcmc, iterations: int, start: int, run_event=None,
                     pending: tuple = ()) -> float:
    """The noise multiplier that makes this call spend what is left of the budget
    (:func:`~numpyro_dp.runner.budget.noise_for_budget`).

    ``run_event(k, z)`` is one chain's event (default: the kernel's);
    ``pending`` are entries charged before it (the tuning releases).
    """
    kernel, ledger = mcmc.sampler, mcmc.ledger
    run_event = run_event or (lambda k, z: kernel.run_event(k, start, z))
    spent = ledger.epsilon(pending) if ledger.entries or pending else 0.0
    cap = mcmc.max_noise_multiplier

    def refusal(needed):
        return PrivacyBudgetError(
            f"What is left of the budget cannot pay for this run at a useful noise "
            f"level: epsilon spent {spent:.4g} of {mcmc.epsilon:.4g}, and even at "
            f"noise multiplier {cap:.3g} (max_noise_multiplier) the run "
            f"({mcmc.num_chains} chain(s) x {iterations} iterations) would bring the "
            f"total to {needed:.4g}. Run fewer iterations or chains, or state a "
            "larger budget (a larger max_noise_multiplier gives draws that are "
            "mostly noise)."
        )

    event = budget.chains_event(run_event, iterations, mcmc.num_chains, kernel.release_entries)
    return budget.noise_for_budget(
        mcmc.epsilon, ledger.delta, event, spent=ledger.event(pending),
        neighbourhood=ledger.neighbourhood, accountant=ledger.accountant, cap=cap,
        refusal=refusal)


def warn_if_noise_caps_the_steps(mcmc, z: float, warm_start: bool) -> None:
    """Before anything is charged: warn when the planner would call the run infeasible."""
    pm = mcmc.sampler._private_model
    _, travel = budget.travel_sds(pm.num_rows, pm.num_params, z, planned_iterations(mcmc),
                                  mcmc.sampler.sensitivity_factor)
    if travel < budget.MARGINAL_TRAVEL:
        start = (
            f"the private warm start ({warm_start_share(mcmc):.0%} of epsilon): "
            "the draws will be close to its noise-aware Laplace approximation, not "
            "MCMC draws" if warm_start else "the prior: their draws will not be "
            "posterior draws"
        )
        warnings.warn(
            f"At noise multiplier {z:.3g} one chain can travel only about {travel:.2g} "
            "posterior standard deviations (ndp.plan's unit-information figure; "
            f"{budget.MARGINAL_TRAVEL:g} is marginal): the chains will stay near where they "
            f"start, {start}. The run is charged and goes ahead; "
            "ndp.plan(model, *data, epsilon=, delta=) checks a plan before anything is "
            "spent and says what would make it feasible.",
            MixingWarning, stacklevel=4,
        )


# ----------------------------------------------------------------- the charge
def fits(mcmc, entries: list[LedgerEntry]) -> tuple[bool, str]:
    """Whether ``entries`` fit the budget, and the epsilon after them as a refusal
    quotes it.

    A lower bound above the budget refuses at once, without composing a PLD
    (:func:`~numpyro_dp.accounting.lower_bound.epsilon_lower_bound`); else
    the figure the charge will be (composed once: the charge finds it cached).
    """
    ledger = mcmc.ledger
    lower = epsilon_lower_bound(ledger.event(entries), ledger.delta, ledger.neighbourhood)
    if lower > mcmc.epsilon:
        return False, f"at least {lower:.6g}"
    after = ledger.epsilon(entries)
    return after <= mcmc.epsilon, f"{after:.6g}"


def over_budget(mcmc, iterations: int, start: int, z, after: str) -> PrivacyBudgetError:
    kernel, ledger = mcmc.sampler, mcmc.ledger
    affordable = max_iterations(
        lambda k: kernel.run_event(k, start, z), mcmc.epsilon, mcmc.delta,
        mcmc.num_chains, ledger.neighbourhood, ledger.accountant,
        spent=ledger.event(), precision="coarse",
    )
    return PrivacyBudgetError(
        f"This call would run {mcmc.num_chains} chain(s) x {iterations} "
        f"iterations and bring the epsilon spent to {after} > budget "
        f"{mcmc.epsilon:.6g} (delta={mcmc.delta:.3g}; spent so far: "
        f"{ledger.spent_so_far()}). The budget affords at least {affordable} more "
        f"iterations per chain at this noise level (mcmc.plan() gives a closer figure): "
        f"{kernel.budget_advice()}."
    )


def note(mcmc, text: str) -> None:
    """Write ``text`` (post-processing of charged releases) into the ledger, at no cost."""
    mcmc.ledger.record(LedgerEntry(
        type(mcmc.sampler).__name__, "notes", 1, 0, dpa.NoOpDpEvent(),
        reproducible_noise=mcmc.reproducible_noise, label=text))


def charge(mcmc, iterations: int, phase: str, tuning: TuningPlan | None = None) -> None:
    """Charge the tuning releases (if any) and the coming iterations, or raise."""
    kernel = mcmc.sampler
    start = start_iteration(mcmc)
    calibrated = None
    if mcmc._calibrate and kernel.noise_multiplier is None:
        calibrated = calibrated_noise(mcmc, planned_iterations(mcmc), start,
                                      pending=budget.tuning_entries(kernel, tuning,
                                                                    mcmc.reproducible_noise))
    z = kernel.noise_multiplier if calibrated is None else calibrated
    if z is not None:
        kernel.check_noise_multiplier(z)
    pending, entry = budget.call_entries(
        kernel, tuning, z, num_chains=mcmc.num_chains, iterations=iterations, phase=phase,
        start=start, reproducible_noise=mcmc.reproducible_noise,
        privacy_unit=kernel._private_model.privacy_unit)
    for rewrite in _ENTRY_REWRITES:
        entry = rewrite(entry)
    if mcmc.check_mixing and kernel.calibrated_noise and not kernel.releases_once:
        warn_if_noise_caps_the_steps(mcmc, z, tuning is not None and tuning.warm_start_steps > 0)
    if mcmc.epsilon is not None:
        ok, after = fits(mcmc, [*pending, entry])
        if not ok:
            raise over_budget(mcmc, iterations, start, z, after)
    try:  # atomic check and append; on disk before the run for a file ledger
        for e in [*pending, entry]:
            mcmc.ledger.charge(e, budget=mcmc.epsilon)
    except PrivacyBudgetError as err:  # another process charged in the meantime
        after = f"{mcmc.ledger.epsilon([entry]):.6g}"
        raise over_budget(mcmc, iterations, start, z, after) from err
    # Bound only once something is charged: a refused run leaves the kernel free.
    kernel._charged_by = mcmc
    if calibrated is not None:
        kernel.configure(noise_multiplier=calibrated)


# ------------------------------------------------------------------- the plan
def plan_call(mcmc, model_args: tuple, model_kwargs: dict, num_rows: int | None,
              row_layout: RowLayout | None, privacy_unit=None) -> RunPlan:
    """:meth:`PrivateMCMC.plan <numpyro_dp.PrivateMCMC.plan>`: what the coming call
    would cost, from public facts only (nothing runs, nothing is charged)."""
    kernel = mcmc.sampler
    if model_args or model_kwargs:
        num_rows = chains.validated(kernel, *chains.converted(model_args, model_kwargs),
                                    row_layout, privacy_unit).num_rows
    if num_rows is not None:
        check_delta_for_rows(mcmc.delta, num_rows)
    iterations, _ = iterations_this_call(mcmc)
    start = start_iteration(mcmc)
    z, advice = kernel.noise_multiplier, kernel.budget_advice()
    fits_budget, affordable = True, None
    rows = {"num_rows": num_rows} if num_rows is not None else {}

    def run_event(k, z):
        return kernel.run_event(k, start, z, **rows)

    # The clip selection and warm start the call would make come first.
    tuning_pending = kernel.clip_requests() or (
        kernel.tunable and mcmc.warm_start != 0 and mcmc.epsilon is not None)
    if kernel._private_model is None and tuning_pending and warmup_state(mcmc) is None:
        raise ValueError(
            f"plan(num_rows=n) cannot plan the clip selection and warm start that this "
            f"run of {type(kernel).__name__} would make first: they depend on the "
            "model's parameters. Give plan the model's arguments, mcmc.plan(X, y=y) "
            "(no value computed from the rows is used), or state the clips and "
            "PrivateMCMC(warm_start=0)."
        )
    name, noisy = type(kernel).__name__, mcmc.reproducible_noise
    pending = budget.tuning_entries(kernel, tuning_plan(mcmc, None), noisy)
    if mcmc._calibrate and z is None:
        try:
            z = calibrated_noise(mcmc, planned_iterations(mcmc), start, run_event,
                                 pending=pending)
        except PrivacyBudgetError as err:
            z, fits_budget, advice = mcmc.max_noise_multiplier, False, str(err)
    ledger = mcmc.ledger
    if z is not None:
        pending += tuple(budget.once_entries(name, kernel.release_entries(z), noisy))
    event = dpa.SelfComposedDpEvent(run_event(iterations, z), mcmc.num_chains)
    after = epsilon_spent(dpa.ComposedDpEvent([ledger.event(pending), event]),
                          ledger.delta, ledger.neighbourhood, ledger.accountant,
                          PLANNING_PLD_INTERVAL)
    if mcmc.epsilon is not None:
        fits_budget = fits_budget and after <= mcmc.epsilon
    if mcmc.epsilon is not None and not kernel.releases_once:  # else iterations are free
        affordable = max_iterations(
            lambda k: run_event(k, z), mcmc.epsilon, mcmc.delta, mcmc.num_chains,
            ledger.neighbourhood, ledger.accountant, spent=ledger.event(pending),
        )
    zs = kernel.noise_multipliers(z) if hasattr(kernel, "noise_multipliers") and z else None
    largest_batch = None
    if mcmc.epsilon is not None and num_rows is not None:
        largest_batch = kernel.max_batch_size(
            num_rows, iterations, mcmc.epsilon, mcmc.delta, mcmc.num_chains,
            ledger.event(pending),
        )
    return RunPlan(
        name, mcmc.num_chains, iterations,
        None if not kernel.calibrated_noise else z, after, mcmc.epsilon, fits_budget,
        affordable, advice if fits_budget is False else "", zs, largest_batch,
    )
