"""PrivateMCMC: NumPyro's MCMC runner with a privacy budget and a ledger."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import Mesh
from numpyro.infer import MCMC

from numpyro_dp.accounting.ledger import PrivacyLedger, PrivacySpent
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.numpyro_compat import (
    guard_data,
    loops_compiled_once,
    warmup_state,
)
from numpyro_dp.primitives.secret import run_secret
from numpyro_dp.runner import chains, charging
from numpyro_dp.runner.budget import check_shares, resolve_budget
from numpyro_dp.runner.chains import check_chain_options
from numpyro_dp.runner.charging import RunPlan
from numpyro_dp.runner.mixing import (
    MixingReport,
    mixing_report,
    print_run_summary,
    warn_if_not_mixed,
)
from numpyro_dp.runner.tuning import (
    CLIP_SELECTION_SHARE,
    TuningResult,
)

#: Default of ``PrivateMCMC(max_noise_multiplier=)``: a calibrated run that would
#: need more noise than this is refused (its draws would be noise).
MAX_NOISE_MULTIPLIER = 1e4


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
        Ignored (NumPyro's): the rows are always arguments of the compiled sampler,
        never constants in it (JAX's compilation cache would write those to disk).
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
        A calibrated run that could pay for itself only with a larger per-iteration
        noise multiplier is refused (its draws would be noise), with what it needs.
    warm_start : float or "auto", optional
        Share of ``epsilon`` spent on a private warm start before the first
        call (:mod:`numpyro_dp.runner.warm_start`): noisy Newton steps from a prior
        draw, after which the chains start around the point it reaches
        (dispersed by its noise-aware Laplace approximation) instead of at
        the prior, where at an ordinary budget they would stay, and the
        kernel's mass matrix (proposal covariance) starts at its Laplace
        covariance.  Default ``"auto"`` when the noise is calibrated to
        ``epsilon``: 0.3, or 0.8 when the sampler could not travel far at 0.3
        (:func:`~numpyro_dp.runner.budget.auto_warm_start_share`: its draws then
        come from where the chains start); 0 for a kernel with a stated noise
        multiplier.  ``0`` turns it off (prior initialisation, as NumPyro).
        Skipped with ``init_params`` or after ``post_warmup_state``; needs ``epsilon``.
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
        :data:`~numpyro_dp.runner.warm_start.WARM_START_STEPS`, or
        :data:`~numpyro_dp.runner.warm_start.FOLLOWING_WARM_START_STEPS` where the data are
        many for the budget (:func:`~numpyro_dp.runner.warm_start.follows_curvature`).
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

    #: Whether ``warm_start="auto"`` may choose a warm start for a kernel that states
    #: no share of its own (:func:`~numpyro_dp.runner.budget.auto_warm_start_share`);
    #: False makes it 0 there, as for a stated noise multiplier (the test suite sets
    #: it: the warm start compiles for seconds).  A stated ``warm_start=`` applies
    #: either way.
    auto_warm_start: bool = True

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
        chains.check_sampler(sampler)
        epsilon, delta, accountant, calibrate = resolve_budget(
            sampler, epsilon, delta, accountant, ledger)
        check_chain_options(num_chains, chain_method, mesh, max_noise_multiplier)
        if warm_start is None:  # a kernel with stated noise is in manual mode
            warm_start = "auto" if calibrate else 0.0
        check_shares(warm_start, clip_selection, warm_start_steps)
        self._data = None  # (args, kwargs) of the call in progress, never kept after it
        # jit_model_args: the rows are arguments of the compiled program.
        super().__init__(sampler, num_warmup=num_warmup, num_samples=num_samples,
                         num_chains=num_chains, thinning=thinning, postprocess_fn=postprocess_fn,
                         chain_method=chain_method, progress_bar=progress_bar,
                         jit_model_args=True)
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
        self._ledger = ledger if ledger is not None else PrivacyLedger(
            delta, sampler.neighbourhood, accountant)

    # ----------------------------------------------------------- accounting
    @property
    def ledger(self) -> PrivacyLedger:
        """The ledger this runner charges."""
        return self._ledger

    def plan(self, *model_args, num_rows: int | None = None, row_layout: RowLayout | None = None,
             privacy_unit=None, **model_kwargs) -> RunPlan:
        """What :meth:`run` would cost now, computed from public facts only.

        Runs nothing and charges nothing; counts the clip selection and warm
        start the call would make.  Give the model's arguments (the model
        and data are validated as :meth:`run` would, but no value computed from
        the rows is used), or only ``num_rows`` (``n``) for kernels whose cost
        depends on it.  Calibrates the noise when the kernel has none, and says
        how many iterations per chain the budget affords (a lower bound, see
        :func:`~numpyro_dp.max_iterations`) and, for kernels whose batch size
        sets the cost (DPBarker), the largest batch size that fits.  This is
        the planning API of every kernel (``privacy_unit``: as in :meth:`run`).

        Examples
        --------
        >>> mcmc = ndp.PrivateMCMC(ndp.DPBarker(model, batch_size=1000), num_warmup=0,
        ...                        num_samples=20_000, epsilon=1.0, delta=1e-7)
        >>> p = mcmc.plan(num_rows=10**6)  # doctest: +SKIP
        >>> p.epsilon, p.max_iterations, p.max_batch_size  # doctest: +SKIP
        """
        return charging.plan_call(self, model_args, model_kwargs, num_rows, row_layout,
                                  privacy_unit)

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
        print_run_summary(self, prob, exclude_deterministic)

    def privacy_spent(self) -> PrivacySpent:
        """What all charged calls of this runner's ledger have spent together."""
        return self._ledger.spent()

    # ------------------------------------------------------------- running
    def run(self, rng_key, *args, extra_fields=(), init_params=None,
            row_layout: RowLayout | None = None, privacy_unit=None, **kwargs):
        """Charge the coming iterations to the ledger, then run as NumPyro does.

        ``privacy_unit`` (one id per row: a person, a firm) makes the guarantee one
        per unit with all its rows, ``n`` the units' number (:mod:`~numpyro_dp.model.units`;
        which rows share a unit is public, like ``n``; DPBarker refuses it).

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
        chains.check_call(self, rng_key, extra_fields)
        call = chains.prepare_call(self, args, kwargs, row_layout, privacy_unit)  # uncharged
        chains.check_init_params(self, init_params, call.model.param_shapes)
        iterations, phase = charging.iterations_this_call(self)
        tuning = charging.tuning_plan(self, init_params) if iterations > 0 else None
        if iterations > 0:
            charging.charge(self, iterations, phase, tuning)
        secret = run_secret(rng_key, self.reproducible_noise, "this PrivateMCMC run")
        if iterations > 0:
            chains.make_releases(self, call, tuning, rng_key, jnp.asarray(secret),
                                 charging.note)
        if init_params is None and warmup_state(self) is None and self.tuning is not None:
            init_params = chains.starts(self, rng_key)
        kernel.freeze()  # what was charged is what runs, in this call and every later one
        inputs = kernel.run_inputs(call.rows, secret)  # the clips as tuning chose them
        try:
            with kernel.armed(self), loops_compiled_once(), chains.on_mesh(self, call.mesh):
                super().run(rng_key, inputs, extra_fields=extra_fields, init_params=init_params)
        finally:
            self._data = None
        if self.check_mixing and "sample" in phase:
            # Post-processing of the released draws: free.  Latent sites only:
            # a deterministic site may be constant by design.
            draws = self.get_samples(group_by_chain=True)
            self.mixing = mixing_report(
                {k: draws[k] for k in call.model.latent_sites if k in draws})
            warn_if_not_mixed(self.mixing, stacklevel=2)

    @property
    def release(self):
        """What the kernel released once before sampling (``NoiseAwareNUTS``: a
        :class:`~numpyro_dp.releases.score_release.ScoreRelease`); None for other kernels."""
        return getattr(self.sampler, "release", None)

    def privacy_budget_left(self) -> float | None:
        """Epsilon left of the budget (None when no budget was stated)."""
        if self.epsilon is None:
            return None
        return max(0.0, self.epsilon - self.privacy_spent().epsilon)

    def __repr__(self) -> str:
        eps = self.privacy_spent().epsilon
        return f"PrivateMCMC({type(self.sampler).__name__}, epsilon spent={eps:.4g})"
