"""PrivateMCMC: NumPyro's MCMC runner with a privacy budget and a ledger."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from numpyro.infer import MCMC
from numpyro.util import is_prng_key

from numpyro_dp.accounting import (
    PrivacyBudgetError,
    calibrate_noise_multiplier,
    check_budget,
    check_delta_for_rows,
    epsilon_spent,
    max_iterations,
)
from numpyro_dp.accounting.ledger import LedgerEntry, PrivacyLedger, PrivacySpent
from numpyro_dp.accounting.lower_bound import epsilon_lower_bound
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.model.adapter import tabular_to_numpy
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.numpyro_compat import (
    collection_params,
    guard_data,
    loops_compiled_once,
    warmup_state,
)
from numpyro_dp.primitives.secret import run_secret
from numpyro_dp.primitives.sharding import (
    CHAIN_AXIS,
    DATA_AXIS,
    RunMesh,
    automatic,
    automatic_mesh,
    check_layout_given,
    check_run_mesh,
    mesh_on,
    rows_mesh,
    shard_rows,
)
from numpyro_dp.runner.mixing import (
    MixingReport,
    MixingWarning,
    mixing_report,
    warn_if_not_mixed,
)
from numpyro_dp.runner.mixing import print_summary as print_draws_summary
from numpyro_dp.runner.planning import MARGINAL_TRAVEL, auto_warm_start_share, travel_sds
from numpyro_dp.runner.tuning import (
    CLIP_SELECTION_SHARE,
    PRIOR_MEDIAN,
    WARM_START_STAGES,
    TuningPlan,
    TuningResult,
    plan_tuning,
    run_tuning,
)

#: Default of ``PrivateMCMC(max_noise_multiplier=)``: a calibrated run that would
#: need more noise than this is refused (its draws would be noise).
MAX_NOISE_MULTIPLIER = 1e4
#: PLD grid of a plan's epsilon (an upper bound on the charged epsilon).
PLANNING_PLD_INTERVAL = 1e-3
#: Folded into the user's key to give the tuning releases their own public keys.
TUNING_KEY_TAG = 0x74756E65
#: Chains start at the warm start plus this many times its dispersion (per
#: coordinate, :class:`~numpyro_dp.TuningResult`) times a standard normal, in
#: antithetic pairs: spread like its noise-aware Laplace approximation, so that
#: R-hat can tell chains that stayed apart and frozen chains still pool to a
#: sensible approximation.
CHAIN_DISPERSION = 1.0


class PrivateDataError(RuntimeError):
    """Something asked a private run for its data (e.g. ``arviz.from_numpyro``)."""


_NO_DATA = (
    "A PrivateMCMC does not hand out the data it ran on. arviz.from_numpyro (and "
    "anything else that re-runs the model on the runner's data, such as "
    "numpyro.infer.log_likelihood or Predictive fed mcmc._args) would publish the "
    "private rows as observed_data and their exact per-row log-likelihoods; so would "
    "arviz_base.from_numpyro. Use ndp.to_inference_data(mcmc) (or ndp.to_datatree(mcmc) "
    "for an xarray.DataTree): the posterior, private-safe sample stats and the privacy "
    "ledger."
)


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


@guard_data(lambda: PrivateDataError(_NO_DATA))
class PrivateMCMC(MCMC):
    """Run a differentially private kernel under a privacy budget.

    A drop-in subclass of :class:`numpyro.infer.MCMC` (progress bar, chain
    methods, ``get_samples``, ``extra_fields``, ``print_summary``,
    ``warmup``/``post_warmup_state`` all work) that charges every iteration of
    every chain, warm-up included, to a privacy ledger *before* running it.

    Parameters
    ----------
    sampler : DPKernel
        A kernel of this library (``DPPenalty``, ...).  The runner completes
        its configuration once, before the first charged iteration (the
        noise multiplier it calibrates, the clips and preconditioner it
        chooses privately), and then freezes it: every later run is charged
        for exactly that configuration, and setting one of the kernel's
        parameters raises.  ``kernel.calibrated(...)`` gives an unbound copy
        to change.
    num_warmup, num_samples, num_chains, thinning, chain_method, progress_bar,
    postprocess_fn :
        As in :class:`numpyro.infer.MCMC`.  Thinning does not reduce the cost.
    jit_model_args : bool
        Accepted for NumPyro compatibility and ignored: the data rows are
        always arguments of the compiled sampler, never constants baked into
        it (JAX's persistent compilation cache would write those to disk).
    epsilon : float, optional
        Privacy budget.  If the kernel has no ``noise_multiplier``, the noise is
        calibrated so that the whole planned run (``num_chains x (num_warmup +
        num_samples)`` iterations) spends at most ``epsilon``.  If it has one,
        ``epsilon`` is a cap: a call that would exceed it raises
        :class:`PrivacyBudgetError` before its first iteration.
    delta : float
        The delta of the (epsilon, delta) guarantee; required, and below
        ``1 / n``.
    accountant : {"auto", "pld", "rdp"}
        Privacy accountant.  ``"auto"`` (the default) takes dp-accounting's
        tight PLD wherever it applies and RDP where only RDP has a bound
        (fixed-size batches drawn without replacement, DP Barker).  An
        explicit choice that cannot charge the kernel is replaced by one that
        can, with an :class:`~numpyro_dp.accounting.AccountantWarning`; the
        accountant used is in :meth:`privacy_spent`.
    ledger : PrivacyLedger, optional
        An existing ledger to charge: a persistent one
        (:meth:`PrivacyLedger.open`, the way to work in a notebook: it survives
        restarts and re-run cells) or one that already holds a one-shot release
        of :mod:`numpyro_dp.releases.mechanisms` on the same data.  ``epsilon`` is then
        the budget of everything in it together: calibration and the budget
        check count what it holds; a budget stored in the ledger applies too
        (the smaller one wins, and it stands for ``epsilon`` when that is
        omitted).  Its delta, neighbourhood and accountant apply (``delta``
        may be omitted; a different one is refused).
    reproducible_noise : bool
        For tests and debugging only: derive the noise from ``rng_key`` so that
        a run can be repeated exactly.  Anyone who knows the key can then remove
        the noise: the run is *not* private.  Warns on every run and is recorded
        in the ledger and by :func:`~numpyro_dp.to_inference_data`.  By default
        the noise comes from a secret drawn from the operating system at each
        run (see :mod:`numpyro_dp.primitives.secret`).
    max_noise_multiplier : float
        A calibrated run whose budget left could pay for it only with a larger
        per-iteration noise multiplier is refused (its draws would be noise),
        with what is left and what the run would need.
    warm_start : float or "auto", optional
        Share of ``epsilon`` spent on a private warm start before the first
        call (:mod:`numpyro_dp.runner.tuning`): noisy Newton steps from a prior
        draw, after which the chains start around the point it reaches
        (dispersed by its noise-aware Laplace approximation) instead of at
        the prior, where at an ordinary budget they would stay, and the
        kernel's mass matrix (proposal covariance) starts at its Laplace
        covariance.  Default ``"auto"`` when the noise is calibrated to
        ``epsilon``: 0.3, or 0.8 when the sampler could not travel far at 0.3
        (:func:`~numpyro_dp.runner.planning.auto_warm_start_share`: its draws then
        come from where the chains start); 0 for a kernel with a stated noise
        multiplier.  ``0`` turns it off (prior initialisation, as NumPyro).
        Skipped when ``init_params`` is given or a run continues from
        ``post_warmup_state``; needs ``epsilon``.
    clip_selection : float
        Share of ``epsilon`` spent choosing the clips the kernel was built
        without (a DP quantile of the rows' gradient scales; also the warm
        start's clip unless the kernel states a ``grad_clip``).  The two shares
        together form one Gaussian mechanism that spends
        ``(warm_start + clip_selection) * epsilon`` alone; the sampler's noise
        is calibrated to what is left, so the total never exceeds ``epsilon``.
    warm_start_steps : int, optional
        Noisy Newton steps of the warm start, a multiple of its 2 stages (each
        step two charged releases; the share is split among them).  By default
        :data:`~numpyro_dp.runner.tuning.WARM_START_STEPS`, or
        :data:`~numpyro_dp.runner.tuning.FOLLOWING_WARM_START_STEPS` where the data are
        many for the budget (:func:`~numpyro_dp.runner.tuning.follows_curvature`).
    check_mixing : bool
        After each call that draws samples, compute split R-hat, bulk ESS and
        how often each chain moved from its draws (free post-processing, kept
        in :attr:`mixing`) and warn with a :class:`~numpyro_dp.MixingWarning`
        when the chains hardly moved or did not mix (:mod:`numpyro_dp.runner.mixing`);
        before a calibrated call, warn likewise when the noise lets one chain
        travel fewer posterior sds than the planner calls marginal
        (:func:`~numpyro_dp.plan`).
    mesh : jax.sharding.Mesh, optional
        Devices to run on, with an axis ``"chain"`` (chains are split over it:
        ``num_chains`` a multiple of its size), an axis ``"data"`` (each chain's
        rows are split over it, padded by :func:`~numpyro_dp.shard_rows`, and
        every release's clipped sum is added over it once), or both, e.g.
        ``jax.make_mesh((2, 4), ("chain", "data"))``.  Without it, rows the user
        placed with :func:`~numpyro_dp.shard_rows` set the mesh, and
        ``chain_method="parallel"`` splits the chains over ``num_chains``
        devices (NumPyro uses ``pmap``).

    Attributes
    ----------
    mixing : MixingReport or None
        The mixing figures of the last call's draws (None before a call that
        drew at least 4 samples per chain, or with ``check_mixing=False``).
    tuning : TuningResult or None
        What the warm start and clip selection released (the chosen clips, the
        warm start and its spread); None before them or without them.

    Notes
    -----
    Every call of :meth:`run` or :meth:`warmup` is charged, and the ledger
    accumulates: a second run (or a continuation from ``post_warmup_state``)
    is paid from what is left of the budget.  The runner keeps no reference to
    the data after a call: ``arviz.from_numpyro(mcmc)`` raises
    :class:`PrivateDataError` (use :func:`~numpyro_dp.to_inference_data`).
    """

    def __init__(
        self,
        sampler: DPKernel,
        *,
        num_warmup: int,
        num_samples: int,
        num_chains: int = 1,
        thinning: int = 1,
        postprocess_fn: Callable | None = None,
        chain_method: str = "parallel",
        progress_bar: bool = True,
        jit_model_args: bool = False,
        epsilon: float | None = None,
        delta: float | None = None,
        accountant: str = "auto",
        ledger: PrivacyLedger | None = None,
        reproducible_noise: bool = False,
        max_noise_multiplier: float = MAX_NOISE_MULTIPLIER,
        warm_start: float | None = None,
        clip_selection: float = CLIP_SELECTION_SHARE,
        warm_start_steps: int | None = None,
        check_mixing: bool = True,
        mesh: Mesh | None = None,
    ):
        if not isinstance(sampler, DPKernel):
            raise TypeError(
                f"PrivateMCMC needs a differentially private kernel (DPPenalty, ...), "
                f"got {type(sampler).__name__}; for non-private inference use "
                "numpyro.infer.MCMC."
            )
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
        if sampler._charged_by is not None:
            raise ValueError(
                f"This {type(sampler).__name__} is already accounted by another "
                "PrivateMCMC. Keep using that runner (its ledger accumulates over "
                "runs) or build a new kernel: a second runner would start a second, "
                "separate ledger for the same data."
            )
        if not isinstance(num_chains, int) or num_chains < 1:
            raise ValueError("num_chains must be a positive integer")
        if chain_method not in ("parallel", "sequential", "vectorized"):
            raise ValueError(
                f"chain_method={chain_method!r}: use 'parallel', 'sequential' or "
                "'vectorized'. A custom chain method could run other chains than "
                "the num_chains that are charged."
            )
        if mesh is not None:
            check_run_mesh(mesh)
        if not (isinstance(max_noise_multiplier, (int, float)) and max_noise_multiplier > 0):
            raise ValueError(f"max_noise_multiplier={max_noise_multiplier!r} must be > 0.")
        calibrate = sampler.calibrated_noise and sampler.noise_multiplier is None
        if warm_start is None:  # a kernel with stated noise is in manual mode
            warm_start = "auto" if calibrate else 0.0
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
        self._data = None  # (args, kwargs) of the call in progress, never kept after it
        super().__init__(
            sampler,
            num_warmup=num_warmup,
            num_samples=num_samples,
            num_chains=num_chains,
            thinning=thinning,
            postprocess_fn=postprocess_fn,
            chain_method=chain_method,
            progress_bar=progress_bar,
            jit_model_args=True,  # the rows are arguments of the compiled program
        )
        self.epsilon = epsilon
        self.delta = delta
        self.reproducible_noise = bool(reproducible_noise)
        self.max_noise_multiplier = float(max_noise_multiplier)
        self.check_mixing = bool(check_mixing)
        self.mesh = mesh
        self.mixing: MixingReport | None = None
        self.warm_start = warm_start if warm_start == "auto" else float(warm_start)
        self.clip_selection = float(clip_selection)
        self.warm_start_steps = warm_start_steps
        self.tuning: TuningResult | None = None
        self._calibrate = calibrate
        self._ledger = (
            PrivacyLedger(delta, sampler.neighbourhood, accountant) if ledger is None else ledger
        )

    # ----------------------------------------------------------- accounting
    @property
    def ledger(self) -> PrivacyLedger:
        """The ledger this runner charges."""
        return self._ledger

    def _iterations_this_call(self) -> tuple[int, str]:
        """Iterations per chain that the coming ``MCMC.run`` will perform."""
        if warmup_state(self) is not None:
            return self.num_samples, "sample"
        params = collection_params(self)
        phase = params["phase"] or ("warmup+sample" if self.num_warmup else "sample")
        return params["upper"], phase

    def _planned_iterations(self) -> int:
        """Iterations per chain of the whole planned run, which calibration pays for.

        A ``warmup()`` call is calibrated for warm-up and sampling together, so
        that the ``run()`` that follows fits what is left.
        """
        if warmup_state(self) is not None:
            return self.num_samples
        return self.num_warmup + self.num_samples

    def _start_iteration(self) -> int:
        """Iterations each chain has done before this call (0 for a fresh start).

        A continuation from ``post_warmup_state`` resumes the kernel's counter
        ``i``; the smallest over chains is used (costs only fall over time).
        """
        i = getattr(warmup_state(self), "i", None)
        return 0 if i is None else int(np.min(np.asarray(i)))

    def _calibrated_noise(
        self, iterations: int, start: int, run_event=None, pending: tuple = ()
    ) -> float:
        """The noise multiplier that makes this call spend what is left of the budget.

        ``run_event(k, z)`` is one chain's event (default: the kernel's);
        ``pending`` are entries charged before it (the tuning releases).
        """
        kernel = self.sampler
        run_event = run_event or (lambda k, z: kernel.run_event(k, start, z))
        ledger = self._ledger
        spent = ledger.epsilon(pending) if ledger.entries or pending else 0.0
        cap = self.max_noise_multiplier

        def total(z):
            event = dpa.SelfComposedDpEvent(run_event(iterations, z), self.num_chains)
            once = [dpa.SelfComposedDpEvent(e, k) for _, e, k in kernel.release_entries(z)]
            return dpa.ComposedDpEvent([ledger.event(pending), *once, event])

        needed = epsilon_spent(total(cap), ledger.delta, ledger.neighbourhood, ledger.accountant)
        if needed > self.epsilon:
            raise PrivacyBudgetError(
                f"What is left of the budget cannot pay for this run at a useful noise "
                f"level: epsilon spent {spent:.4g} of {self.epsilon:.4g}, and even at "
                f"noise multiplier {cap:.3g} (max_noise_multiplier) the run "
                f"({self.num_chains} chain(s) x {iterations} iterations) would bring the "
                f"total to {needed:.4g}. Run fewer iterations or chains, or state a "
                "larger budget (a larger max_noise_multiplier gives draws that are "
                "mostly noise)."
            )
        return calibrate_noise_multiplier(
            total, self.epsilon, self.delta, ledger.neighbourhood, ledger.accountant, upper=cap
        )

    def _fits(self, entries: list[LedgerEntry]) -> tuple[bool, str]:
        """Whether ``entries`` fit the budget, and the epsilon after them as a refusal
        quotes it.

        A lower bound above the budget refuses at once, without composing a PLD
        (:func:`~numpyro_dp.accounting.lower_bound.epsilon_lower_bound`); else
        the figure the charge will be (composed once: the charge finds it cached).
        """
        ledger = self._ledger
        lower = epsilon_lower_bound(ledger.event(entries), ledger.delta, ledger.neighbourhood)
        if lower > self.epsilon:
            return False, f"at least {lower:.6g}"
        after = ledger.epsilon(entries)
        return after <= self.epsilon, f"{after:.6g}"

    def _over_budget(self, iterations: int, start: int, z, after: str) -> PrivacyBudgetError:
        kernel = self.sampler
        affordable = max_iterations(
            lambda k: kernel.run_event(k, start, z), self.epsilon, self.delta,
            self.num_chains, self._ledger.neighbourhood, self._ledger.accountant,
            spent=self._ledger.event(), precision="coarse",
        )
        return PrivacyBudgetError(
            f"This call would run {self.num_chains} chain(s) x {iterations} "
            f"iterations and bring the epsilon spent to {after} > budget "
            f"{self.epsilon:.6g} (delta={self.delta:.3g}; spent so far: "
            f"{self._ledger.spent_so_far()}). The budget affords at least {affordable} more "
            f"iterations per chain at this noise level (mcmc.plan() gives a closer figure): "
            f"{kernel.budget_advice()}."
        )

    def _entry(self, iterations: int, phase: str, start: int, z) -> LedgerEntry:
        kernel = self.sampler
        return LedgerEntry(
            type(kernel).__name__, phase, self.num_chains, iterations,
            kernel.per_iteration_event(z), kernel.run_event(iterations, start, z),
            reproducible_noise=self.reproducible_noise,
        )

    def _note(self, text: str) -> None:
        """Write ``text`` (post-processing of charged releases) into the ledger, at no cost."""
        self._ledger.record(LedgerEntry(
            type(self.sampler).__name__, "notes", 1, 0, dpa.NoOpDpEvent(),
            reproducible_noise=self.reproducible_noise, label=text))

    def _warn_if_noise_caps_the_steps(self, z: float, warm_start: bool) -> None:
        """Before anything is charged: warn when the planner would call the run infeasible."""
        pm = self.sampler._private_model
        _, travel = travel_sds(pm.num_rows, pm.num_params, z, self._planned_iterations(),
                               self.sampler.sensitivity_factor)
        if travel < MARGINAL_TRAVEL:
            start = (
                f"the private warm start ({self._warm_start_share():.0%} of epsilon): "
                "the draws will be close to its noise-aware Laplace approximation, not "
                "MCMC draws" if warm_start else "the prior: their draws will not be "
                "posterior draws"
            )
            warnings.warn(
                f"At noise multiplier {z:.3g} one chain can travel only about {travel:.2g} "
                "posterior standard deviations (ndp.plan's unit-information figure; "
                f"{MARGINAL_TRAVEL:g} is marginal): the chains will stay near where they "
                f"start, {start}. The run is charged and goes ahead; "
                "ndp.plan(model, *data, epsilon=, delta=) checks a plan before anything is "
                "spent and says what would make it feasible.",
                MixingWarning, stacklevel=4,
            )

    def _tuning_entries(self, plan: TuningPlan | None) -> list[LedgerEntry]:
        return [] if plan is None else self._once(plan.entries())

    def _once(self, entries: list) -> list[LedgerEntry]:
        """Ledger entries of releases made once per run: ``(phase, event, releases)``."""
        name = type(self.sampler).__name__
        return [LedgerEntry(name, phase, 1, releases, event,
                            reproducible_noise=self.reproducible_noise)
                for phase, event, releases in entries]

    def _tuning_plan(self, init_params) -> TuningPlan | None:
        """The tuning releases this call needs (None: none), from public facts only."""
        kernel = self.sampler
        if warmup_state(self) is not None:
            return None
        requests = kernel.clip_requests()
        share = self._warm_start_share()
        warm = share > 0 and init_params is None and self.tuning is None and kernel.tunable
        if not requests and not warm:
            return None
        if self.epsilon is None:
            if requests:
                raise ValueError(
                    f"{type(kernel).__name__} has no {', '.join(r.name for r in requests)} "
                    "and this PrivateMCMC has no epsilon to choose it privately from: "
                    "state the clip(s) on the kernel, or give PrivateMCMC an epsilon."
                )
            return None
        return plan_tuning(
            self.epsilon, self.delta, warm_start=share if warm else 0.0,
            clip_selection=self.clip_selection, requests=requests,
            warm_start_clip=kernel.warm_start_clip, warm_start_steps=self.warm_start_steps,
            num_rows=kernel._private_model.num_rows,
            num_params=kernel._private_model.num_params, neighbourhood=kernel.neighbourhood,
            noise_scale=kernel._private_model.likelihood_reads_scale,
        )

    def _warm_start_share(self) -> float:
        """The warm start's share of epsilon; ``"auto"`` resolved from public facts."""
        if self.warm_start != "auto":
            return self.warm_start
        if self.epsilon is None:
            return 0.0
        if self.sampler.warm_start_share is not None:
            return self.sampler.warm_start_share
        pm = self.sampler._private_model
        return auto_warm_start_share(
            self.epsilon, self.delta, pm.num_rows, pm.num_params, self._planned_iterations(),
            self.num_chains, clip_selection=self.clip_selection,
            warm_start_steps=self.warm_start_steps, neighbourhood=self.sampler.neighbourhood,
            noise_scale=pm.likelihood_reads_scale,
        )

    def _charge(self, iterations: int, phase: str, tuning: TuningPlan | None = None) -> None:
        """Charge the tuning releases (if any) and the coming iterations, or raise."""
        kernel = self.sampler
        start = self._start_iteration()
        pending = self._tuning_entries(tuning)
        calibrated = None
        if self._calibrate and kernel.noise_multiplier is None:
            calibrated = self._calibrated_noise(self._planned_iterations(), start,
                                                pending=tuple(pending))
        z = kernel.noise_multiplier if calibrated is None else calibrated
        if z is not None:
            kernel.check_noise_multiplier(z)
        pending += self._once(kernel.release_entries(z))
        entry = self._entry(iterations, phase, start, z)
        if self.check_mixing and kernel.calibrated_noise and not kernel.releases_once:
            self._warn_if_noise_caps_the_steps(
                z, tuning is not None and tuning.warm_start_steps > 0)
        if self.epsilon is not None:
            fits, after = self._fits([*pending, entry])
            if not fits:
                raise self._over_budget(iterations, start, z, after)
        try:  # atomic check and append; on disk before the run for a file ledger
            for e in [*pending, entry]:
                self._ledger.charge(e, budget=self.epsilon)
        except PrivacyBudgetError as err:  # another process charged in the meantime
            after = f"{self._ledger.epsilon([entry]):.6g}"
            raise self._over_budget(iterations, start, z, after) from err
        # Bound only once something is charged: a refused run leaves the kernel free.
        kernel._charged_by = self
        if calibrated is not None:
            kernel.configure(noise_multiplier=calibrated)

    def plan(self, *model_args, num_rows: int | None = None, row_layout: RowLayout | None = None,
             **model_kwargs) -> RunPlan:
        """What :meth:`run` would cost now, computed from public facts only.

        Runs nothing and charges nothing; counts the clip selection and warm
        start the call would make.  Give the model's arguments (the model
        and data are validated as :meth:`run` would, but no value computed from
        the rows is used), or only ``num_rows`` (``n``) for kernels whose cost
        depends on it.  Calibrates the noise when the kernel has none, and says
        how many iterations per chain the budget affords (a lower bound, see
        :func:`~numpyro_dp.max_iterations`) and, for kernels whose batch size
        sets the cost (DPBarker), the largest batch size that fits.  This is
        the planning API of every kernel.

        Examples
        --------
        >>> mcmc = ndp.PrivateMCMC(ndp.DPBarker(model, batch_size=1000), num_warmup=0,
        ...                        num_samples=20_000, epsilon=1.0, delta=1e-7)
        >>> p = mcmc.plan(num_rows=10**6)  # doctest: +SKIP
        >>> p.epsilon, p.max_iterations, p.max_batch_size  # doctest: +SKIP
        """
        kernel = self.sampler
        if model_args or model_kwargs:
            model_args, model_kwargs = automatic(tabular_to_numpy((model_args, model_kwargs)))
            check_layout_given((model_args, model_kwargs), row_layout)
            num_rows = kernel.prepare(model_args, model_kwargs, row_layout).num_rows
        if num_rows is not None:
            check_delta_for_rows(self.delta, num_rows)
        iterations, _ = self._iterations_this_call()
        start = self._start_iteration()
        z, advice = kernel.noise_multiplier, kernel.budget_advice()
        fits, after, affordable = True, None, None
        rows = {"num_rows": num_rows} if num_rows is not None else {}

        def run_event(k, z):
            return kernel.run_event(k, start, z, **rows)

        # The clip selection and warm start the call would make come first.
        tuning_pending = kernel.clip_requests() or (
            kernel.tunable and self.warm_start != 0 and self.epsilon is not None)
        if kernel._private_model is None and tuning_pending and warmup_state(self) is None:
            raise ValueError(
                f"plan(num_rows=n) cannot plan the clip selection and warm start that this "
                f"run of {type(kernel).__name__} would make first: they depend on the "
                "model's parameters. Give plan the model's arguments, mcmc.plan(X, y=y) "
                "(no value computed from the rows is used), or state the clips and "
                "PrivateMCMC(warm_start=0)."
            )
        pending = tuple(self._tuning_entries(self._tuning_plan(None)))
        if self._calibrate and z is None:
            try:
                z = self._calibrated_noise(self._planned_iterations(), start, run_event,
                                           pending=pending)
            except PrivacyBudgetError as err:
                z, fits, advice = self.max_noise_multiplier, False, str(err)
        ledger = self._ledger
        if z is not None:
            pending += tuple(self._once(kernel.release_entries(z)))
        event = dpa.SelfComposedDpEvent(run_event(iterations, z), self.num_chains)
        after = epsilon_spent(dpa.ComposedDpEvent([ledger.event(pending), event]),
                              ledger.delta, ledger.neighbourhood, ledger.accountant,
                              PLANNING_PLD_INTERVAL)
        if self.epsilon is not None:
            fits = fits and after <= self.epsilon
        if self.epsilon is not None and not kernel.releases_once:  # else iterations are free
            affordable = max_iterations(
                lambda k: run_event(k, z), self.epsilon, self.delta, self.num_chains,
                ledger.neighbourhood, ledger.accountant, spent=ledger.event(pending),
            )
        zs = kernel.noise_multipliers(z) if hasattr(kernel, "noise_multipliers") and z else None
        largest_batch = None
        if self.epsilon is not None and num_rows is not None:
            largest_batch = kernel.max_batch_size(
                num_rows, iterations, self.epsilon, self.delta, self.num_chains,
                ledger.event(pending),
            )
        return RunPlan(
            type(kernel).__name__, self.num_chains, iterations,
            None if not kernel.calibrated_noise else z, after, self.epsilon, fits,
            affordable, advice if fits is False else "", zs, largest_batch,
        )

    def print_summary(self, prob: float = 0.9, exclude_deterministic: bool = True) -> None:
        """NumPyro's summary table of the draws (free: post-processing), with ``n_eff``
        and ``r_hat`` as :attr:`mixing` and ``az.summary`` compute them (ArviZ's
        rank-normalised split R-hat and bulk ESS, :func:`~numpyro_dp.runner.mixing.print_summary`),
        so that the three agree on the same draws; then the number of divergences where
        the kernel reports them.

        Parameters
        ----------
        prob : float
            Mass of the highest posterior density interval shown.
        exclude_deterministic : bool
            Leave out deterministic sites, as NumPyro does.
        """
        sites = self.get_samples(group_by_chain=True)
        latent = getattr(self._last_state, self._sample_field, None)
        if exclude_deterministic and isinstance(latent, dict):
            sites = {k: v for k, v in sites.items() if k in latent}
        print_draws_summary(sites, prob)
        extra = self.get_extra_fields()
        if "diverging" in extra:
            print(f"Number of divergences: {int(np.sum(np.asarray(extra['diverging'])))}")

    def privacy_spent(self) -> PrivacySpent:
        """What all charged calls of this runner's ledger have spent together."""
        return self._ledger.spent()

    # ------------------------------------------------------------ checks
    def _check_keys(self, rng_key) -> None:
        """One key, or exactly ``num_chains`` keys: the number of chains charged."""
        if is_prng_key(rng_key):
            return
        shape = jnp.shape(rng_key)
        typed = jnp.issubdtype(jnp.asarray(rng_key).dtype, jax.dtypes.prng_key)
        batch = shape[:-1] if not typed else shape
        if self.num_chains > 1 and batch == (self.num_chains,):
            return
        raise ValueError(
            f"rng_key must be one PRNG key or a batch of exactly num_chains="
            f"{self.num_chains} keys (one per chain); got a batch of shape {batch}. "
            "Each chain is charged to the privacy budget, so the number of chains run "
            "must be the number planned: pass one key, or set num_chains."
        )

    def _check_init_params(self, init_params, param_shapes: dict) -> None:
        if init_params is None:
            return
        if not isinstance(init_params, dict) or set(init_params) != set(param_shapes):
            raise ValueError(
                f"init_params must be a dict of unconstrained values for the latent "
                f"sites {sorted(param_shapes)}."
            )
        lead = (self.num_chains,) if self.num_chains > 1 else ()
        for name, shape in param_shapes.items():
            if tuple(jnp.shape(init_params[name])) != lead + shape:
                raise ValueError(
                    f"init_params[{name!r}] has shape {tuple(jnp.shape(init_params[name]))}; "
                    f"with num_chains={self.num_chains} it must be {lead + shape} "
                    "(one value per chain: each chain is charged)."
                )

    def _check_post_warmup_state(self) -> None:
        state = warmup_state(self)
        if state is None:
            return
        lead = (self.num_chains,) if self.num_chains > 1 else ()
        if tuple(jnp.shape(getattr(state, "i", ()))) != lead:
            raise ValueError(
                f"post_warmup_state holds {jnp.shape(getattr(state, 'i', ()))[:1] or 1} "
                f"chain(s) but num_chains={self.num_chains}: continue the chains the "
                "state holds (each chain run is charged)."
            )

    # ------------------------------------------------------------- running
    def run(self, rng_key, *args, extra_fields=(), init_params=None,
            row_layout: RowLayout | None = None, **kwargs):
        """Charge the coming iterations to the ledger, then run as NumPyro does.

        Rows placed on a device mesh (``jax.device_put`` with
        ``NamedSharding(mesh, P("data"))``, or :func:`~numpyro_dp.shard_rows`,
        whose ``row_layout`` must then be passed) are worked on where they
        live: each release's clipped sum is added over the devices once and its
        noise drawn once; the chains are a batch on the mesh, split over its
        ``"chain"`` axis if it has one (see ``mesh``).  With several processes
        (``jax.distributed``) every process calls ``run`` with its own rows.

        Raises
        ------
        PrivacyBudgetError
            Before any iteration, if the call would exceed the budget.
        ValueError
            If an ``extra_fields`` entry is not safe to publish, or the keys,
            ``init_params`` or ``post_warmup_state`` hold another number of
            chains than ``num_chains`` (everything is checked before any charge).
        """
        kernel = self.sampler
        for field in extra_fields:
            top = field.lstrip("~").split(".")[0]
            if top not in kernel.private_safe_fields:
                raise ValueError(
                    f"extra field {field!r} is not a private-safe field of "
                    f"{type(kernel).__name__}; allowed: {kernel.private_safe_fields}."
                )
        self._check_keys(rng_key)
        self._check_post_warmup_state()
        args, kwargs = automatic(tabular_to_numpy((args, kwargs)))
        check_layout_given((args, kwargs), row_layout)
        pm = kernel.prepare(args, kwargs, row_layout)  # validates model and data before any charge
        args, kwargs, pm, run_mesh = self._place(args, kwargs, pm, row_layout)
        check_delta_for_rows(self.delta, pm.num_rows)
        self._check_init_params(init_params, pm.param_shapes)
        iterations, phase = self._iterations_this_call()
        tuning = self._tuning_plan(init_params) if iterations > 0 else None
        if iterations > 0:
            self._charge(iterations, phase, tuning)
        secret = run_secret(rng_key, self.reproducible_noise, "this PrivateMCMC run")
        rows = pm.private_inputs(args, kwargs)
        if tuning is not None:
            with mesh_on(run_mesh):
                self._tune(tuning, rng_key, pm, args, kwargs, rows, jnp.asarray(secret))
        if iterations > 0 and kernel.releases_once and kernel.release_entries():
            # Charged with the tuning; public keys apart from the tuning's and the chains'.
            key = jax.random.fold_in(rng_key if is_prng_key(rng_key) else rng_key[0],
                                     TUNING_KEY_TAG + 2)
            with mesh_on(run_mesh):
                kernel.make_release(pm, self.tuning, rng_key=key, rows=rows,
                                    secret=jnp.asarray(secret), note=self._note)
        if init_params is None and warmup_state(self) is None and self.tuning is not None:
            init_params = self._chain_starts(rng_key)
        kernel.freeze()  # what was charged is what runs, in this call and every later one
        inputs = kernel.run_inputs(rows, secret)  # the clips as tuning chose them
        chain_method = self.chain_method
        if run_mesh is not None and self.num_chains > 1:
            # The chains are a batch on the mesh (split over its chain axis, if any).
            self.chain_method = "vectorized"
        try:
            with kernel.armed(self), loops_compiled_once(), mesh_on(run_mesh):
                super().run(rng_key, inputs, extra_fields=extra_fields, init_params=init_params)
        finally:
            self.chain_method = chain_method
            self._data = None
        if self.check_mixing and "sample" in phase:
            # Post-processing of the released draws: free.  Latent sites only:
            # a deterministic site may be constant by design.
            draws = self.get_samples(group_by_chain=True)
            self.mixing = mixing_report({k: draws[k] for k in pm.latent_sites if k in draws})
            warn_if_not_mixed(self.mixing, stacklevel=2)

    def _place(self, args: tuple, kwargs: dict, pm, row_layout: RowLayout | None):
        """The run's mesh (:class:`RunMesh`, None for one device), with the rows
        placed on its data axis (padded by :func:`shard_rows`) if they are not yet.

        Returns ``(args, kwargs, pm, run_mesh)``.
        """
        rows = pm.private_inputs(args, kwargs)
        placed = rows_mesh(rows)
        mesh = None if self.mesh is None else automatic_mesh(self.mesh)
        if placed is None and mesh is not None and mesh.shape.get(DATA_AXIS, 1) > 1:
            if row_layout is not None:
                raise ValueError(
                    "row_layout was given for rows that are not on the mesh; pass the "
                    "unpadded rows (PrivateMCMC(mesh=) places and pads them) or the "
                    "arrays that ndp.shard_rows(mesh, ...) returned."
                )
            *rows, row_layout = shard_rows(mesh, *rows)
            args, kwargs = pm.rebuild(rows)
            pm = self.sampler.prepare(args, kwargs, row_layout)
            placed = rows_mesh(rows)
        if placed is not None and mesh not in (None, placed[0]):
            raise ValueError(
                f"The rows lie on a mesh of axes {dict(placed[0].shape)}, not on "
                f"PrivateMCMC's mesh {dict(mesh.shape)}: place them with "
                "ndp.shard_rows(mesh, ...) on the runner's mesh, or pass them unplaced "
                "(the runner places them)."
            )
        if placed is not None:
            mesh = placed[0]
        elif mesh is None and self.chain_method == "parallel" and self.num_chains > 1:
            # NumPyro pmaps the chains over num_chains devices (it has switched to
            # "sequential" where there are fewer): a chain axis over them instead.
            devices = np.asarray(jax.local_devices()[: self.num_chains])
            mesh = automatic_mesh(Mesh(devices, (CHAIN_AXIS,)))
        if mesh is None:
            return args, kwargs, pm, None
        chains = CHAIN_AXIS if mesh.shape.get(CHAIN_AXIS, 1) > 1 else None
        if chains is not None and jax.process_count() > 1:
            raise ValueError(
                f"With {jax.process_count()} processes, split the rows over the hosts and "
                f"run the chains as a batch: a mesh without a {CHAIN_AXIS!r} axis, e.g. "
                f"jax.make_mesh((jax.device_count(),), ({DATA_AXIS!r},))."
            )
        if chains is not None and self.num_chains % mesh.shape[CHAIN_AXIS]:
            raise ValueError(
                f"num_chains={self.num_chains} cannot be split evenly over the mesh's "
                f"{CHAIN_AXIS!r} axis of {mesh.shape[CHAIN_AXIS]} devices: run a multiple "
                f"of {mesh.shape[CHAIN_AXIS]} chains, or make the axis smaller."
            )
        return args, kwargs, pm, RunMesh(mesh, placed and placed[1], chains)

    def _tune(self, plan: TuningPlan, rng_key, pm, args, kwargs, rows: tuple, secret) -> None:
        """Run the charged tuning releases; adopt the clips; keep the warm start."""
        kernel = self.sampler
        key = rng_key if is_prng_key(rng_key) else rng_key[0]
        # Public keys of the tuning's noise draws, apart from every chain's.
        key = jax.random.fold_in(key, TUNING_KEY_TAG)
        key_init, key_tune = jax.random.split(key)
        theta0 = pm.ravel(pm.init_params(key_init, args, kwargs, PRIOR_MEDIAN))
        result = run_tuning(
            plan, pm, rng_key=key_tune, rows=rows, secret=secret, theta0=theta0,
            neighbourhood=kernel.neighbourhood, temperature=kernel.temperature,
            sampler_noise_multiplier=kernel.noise_multiplier,
        )
        if result.start is None and self.tuning is not None:  # keep an earlier warm start
            result = dataclasses.replace(result, start=self.tuning.start,
                                         dispersion=self.tuning.dispersion,
                                         covariance=self.tuning.covariance)
        kernel.configure(clips=result.clips, preconditioner=result.covariance)
        self.tuning = result

    def _chain_starts(self, rng_key) -> dict | None:
        """Each chain's start: the warm start plus its spread times a standard normal.

        Post-processing of the warm start with public randomness; dispersed so
        that R-hat can tell chains that did not leave their starts apart.
        """
        if self.tuning is None or self.tuning.start is None:
            return None
        key = rng_key if is_prng_key(rng_key) else rng_key[0]
        key = jax.random.fold_in(key, TUNING_KEY_TAG + 1)
        lead = (self.num_chains,) if self.num_chains > 1 else ()
        starts = {}
        pairs = (self.num_chains + 1) // 2
        for name, value in self.tuning.start.items():
            key, sub = jax.random.split(key)
            noise = jax.random.normal(sub, (pairs,) + jnp.shape(value), jnp.result_type(value))
            # Antithetic pairs: where the chains cannot move, their pooled mean
            # is the warm start's, not that plus the chains' random offsets.
            noise = jnp.stack([noise, -noise], axis=1).reshape((2 * pairs,) + jnp.shape(value))
            noise = noise[: self.num_chains]
            jitter = 0.0 if not lead else CHAIN_DISPERSION * self.tuning.dispersion[name] * noise
            starts[name] = value + jitter
        return starts

    @property
    def release(self):
        """What the kernel released once before sampling (``NoiseAwareNUTS``: a
        :class:`~numpyro_dp.releases.score.ScoreRelease`); None for other kernels."""
        return getattr(self.sampler, "release", None)

    def privacy_budget_left(self) -> float | None:
        """Epsilon left of the budget (None when no budget was stated)."""
        if self.epsilon is None:
            return None
        return max(0.0, self.epsilon - self.privacy_spent().epsilon)

    def __repr__(self) -> str:
        eps = self.privacy_spent().epsilon
        return f"PrivateMCMC({type(self.sampler).__name__}, epsilon spent={eps:.4g})"
