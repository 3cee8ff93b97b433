"""PrivateMCMC: NumPyro's MCMC runner with a privacy budget and a ledger."""

from __future__ import annotations

from collections.abc import Callable

import dp_accounting as dpa
import numpy as np
from numpyro.infer import MCMC

from numpyro_dp.accounting import (
    PrivacyBudgetError,
    calibrate_noise_multiplier,
    check_budget,
    max_iterations,
)
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.ledger import LedgerEntry, PrivacyLedger, PrivacySpent


class PrivateMCMC(MCMC):
    """Run a differentially private kernel under a privacy budget.

    A drop-in subclass of :class:`numpyro.infer.MCMC` (progress bar, chain
    methods, ``get_samples``, ``extra_fields``, ``print_summary``,
    ``warmup``/``post_warmup_state`` all work) that charges every iteration of
    every chain, warm-up included, to a privacy ledger *before* running it.

    Parameters
    ----------
    sampler : DPKernel
        A kernel of this library (``DPPenalty``, ...).
    num_warmup, num_samples, num_chains, thinning, chain_method, progress_bar,
    jit_model_args, postprocess_fn :
        As in :class:`numpyro.infer.MCMC`.  Thinning does not reduce the cost.
    epsilon : float, optional
        Privacy budget.  If the kernel has no ``noise_multiplier``, the noise is
        calibrated so that the whole planned run (``num_chains x (num_warmup +
        num_samples)`` iterations) spends at most ``epsilon``.  If it has one,
        ``epsilon`` is a cap: a call that would exceed it raises
        :class:`PrivacyBudgetError` before its first iteration.
    delta : float
        The delta of the (epsilon, delta) guarantee; required.
    accountant : {"pld", "rdp"}
        Privacy accountant (``"pld"`` is tight).
    ledger : PrivacyLedger, optional
        An existing ledger to charge, e.g. one that already holds a one-shot
        release of :mod:`numpyro_dp.mechanisms` on the same data, or a file
        ledger (:meth:`PrivacyLedger.open`) that persists across sessions.
        ``epsilon`` is then the budget of everything in it together:
        calibration and the budget check count what it holds; a budget stored
        in the ledger applies too (the smaller one wins, and it stands for
        ``epsilon`` when that is omitted).  Its delta, neighbourhood and
        accountant apply (``delta`` may be omitted; a different one is refused).

    Notes
    -----
    Every call of :meth:`run` or :meth:`warmup` is charged, and the ledger
    accumulates: a second run (or a continuation from ``post_warmup_state``)
    is paid from what is left of the budget.
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
        accountant: str = "pld",
        ledger: PrivacyLedger | None = None,
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
        if accountant not in sampler.accountants:
            raise ValueError(
                f"accountant={accountant!r} cannot charge this {type(sampler).__name__}: "
                f"dp-accounting supports its events with {sampler.accountants} only; pass "
                f"accountant={sampler.accountants[0]!r} (or change the kernel's batching)."
            )
        if not isinstance(num_chains, int) or num_chains < 1:
            raise ValueError("num_chains must be a positive integer")
        super().__init__(
            sampler,
            num_warmup=num_warmup,
            num_samples=num_samples,
            num_chains=num_chains,
            thinning=thinning,
            postprocess_fn=postprocess_fn,
            chain_method=chain_method,
            progress_bar=progress_bar,
            jit_model_args=jit_model_args,
        )
        self.epsilon = epsilon
        self.delta = delta
        self._calibrate = calibrate
        self._ledger = (
            PrivacyLedger(delta, sampler.neighbourhood, accountant) if ledger is None else ledger
        )
        sampler._charged_by = self

    # ----------------------------------------------------------- accounting
    def _iterations_this_call(self) -> tuple[int, str]:
        """Iterations per chain that the coming ``MCMC.run`` will perform."""
        if self._warmup_state is not None:
            return self.num_samples, "sample"
        params = self._collection_params
        phase = params["phase"] or ("warmup+sample" if self.num_warmup else "sample")
        return params["upper"], phase

    def _start_iteration(self) -> int:
        """Iterations each chain has done before this call (0 for a fresh start).

        A continuation from ``post_warmup_state`` resumes the kernel's counter
        ``i``; the smallest over chains is used (costs only fall over time).
        """
        i = getattr(self._warmup_state, "i", None)
        return 0 if i is None else int(np.min(np.asarray(i)))

    def _planned_event(self, noise_multiplier: float):
        per_chain = self.num_warmup + self.num_samples
        plan = dpa.SelfComposedDpEvent(
            self.sampler.run_event(per_chain, 0, noise_multiplier), self.num_chains
        )
        # With what a shared ledger holds already (e.g. a one-shot release).
        return dpa.ComposedDpEvent([self._ledger.event(), plan])

    def _charge(self, iterations: int, phase: str) -> None:
        kernel = self.sampler
        if self._calibrate and kernel.noise_multiplier is None:
            kernel.noise_multiplier = calibrate_noise_multiplier(
                self._planned_event, self.epsilon, self.delta,
                self._ledger.neighbourhood, self._ledger.accountant,
            )
        start = self._start_iteration()
        entry = LedgerEntry(
            type(kernel).__name__, phase, self.num_chains, iterations,
            kernel.per_iteration_event(), kernel.run_event(iterations, start),
        )
        try:
            self._ledger.charge(entry, budget=self.epsilon)  # on disk for a file ledger
        except PrivacyBudgetError as err:
            after = self._ledger.epsilon([entry])
            spent = self._ledger.epsilon() if self._ledger.entries else 0.0
            affordable = max_iterations(
                lambda k: kernel.run_event(k, start), self.epsilon, self.delta, self.num_chains,
                self._ledger.neighbourhood, self._ledger.accountant,
                spent=self._ledger.event(),
            )
            raise PrivacyBudgetError(
                f"This call would run {self.num_chains} chain(s) x {iterations} "
                f"iterations and bring the total to epsilon={after:.4g} > budget "
                f"{self.epsilon:.4g} (delta={self.delta:.3g}; spent so far: "
                f"{spent:.4g}). The budget affords {affordable} more iterations per "
                "chain at this noise level: run fewer iterations or chains, raise "
                "noise_multiplier, or state a larger budget."
            ) from err

    def privacy_spent(self) -> PrivacySpent:
        """What all charged calls of this runner have spent together."""
        return self._ledger.spent()

    # ------------------------------------------------------------- running
    def run(self, rng_key, *args, extra_fields=(), init_params=None, **kwargs):
        """Charge the coming iterations to the ledger, then run as NumPyro does.

        Raises
        ------
        PrivacyBudgetError
            Before any iteration, if the call would exceed the budget.
        ValueError
            If an ``extra_fields`` entry is not safe to publish.
        """
        kernel = self.sampler
        for field in extra_fields:
            top = field.lstrip("~").split(".")[0]
            if top not in kernel.private_safe_fields:
                raise ValueError(
                    f"extra field {field!r} is not a private-safe field of "
                    f"{type(kernel).__name__}; allowed: {kernel.private_safe_fields}."
                )
        kernel.prepare(args, kwargs)  # validates model and data before any charge
        iterations, phase = self._iterations_this_call()
        if iterations > 0:
            self._charge(iterations, phase)
        super().run(rng_key, *args, extra_fields=extra_fields, init_params=init_params, **kwargs)

    def privacy_budget_left(self) -> float | None:
        """Epsilon left of the budget (None when no budget was stated)."""
        if self.epsilon is None:
            return None
        return max(0.0, self.epsilon - self.privacy_spent().epsilon)

    def __repr__(self) -> str:
        eps = self.privacy_spent().epsilon
        return f"PrivateMCMC({type(self.sampler).__name__}, epsilon spent={eps:.4g})"
