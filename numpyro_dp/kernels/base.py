"""The base class of the differentially private kernels: what every kernel declares.

A :class:`DPKernel` is a NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel`
that additionally

* declares the privacy cost of one iteration as a ``DpEvent``
  (:meth:`DPKernel.per_iteration_event`), next to its algorithm, so that
  sampling and accounting cannot drift apart;
* keeps its carry (``State``, what the next iteration needs) apart from the
  diagnostics of the last transition (``Info``: the noisy acceptance
  probability, the decision, divergence, step size).  BlackJAX returns the two
  side by side; NumPyro's kernel contract (``sample`` returns one state)
  forces the Info inside the State instead: the state's ``info`` field holds
  it, and :func:`~numpyro_dp.kernels.running.carries_info` makes each Info
  field readable on the state, so NumPyro's ``extra_fields`` work as for its
  own kernels;
* is private-safe by construction: State and Info hold only released values
  and their post-processing (never an exact log-density, gradient, clip count
  or batch statistic), and :attr:`DPKernel.private_safe_fields` is exactly
  their fields;
* refuses to run unless a :class:`~numpyro_dp.PrivateMCMC` charges it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import is_prng_key

from numpyro_dp.accounting import check_neighbourhood, sensitivity_factor
from numpyro_dp.kernels.arguments import check_positive, check_settable, check_temperature
from numpyro_dp.kernels.running import RunInputs, armed_inputs, chain_sampler, init_chains
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout


@dataclasses.dataclass(frozen=True)
class ClipRequest:
    """A clip a kernel was built without, to be chosen privately
    (:mod:`numpyro_dp.runner.clip_selection`).

    Attributes
    ----------
    name : str
        The kernel's attribute (``"grad_clip"``, ``"llr_clip"``).
    quantile : float
        Fraction of the rows whose scale the clip should cover.
    scale : {"norm", "coordinate", "directional"}
        Which scale of a row's log-likelihood gradient ``g_i`` at the warm
        start: ``||g_i||`` (a gradient, or a ratio along a trajectory),
        ``max_j |g_ij|`` (a one-coordinate step's ratio per unit length), or
        the largest ``|g_i . u|`` over random unit directions ``u`` (a
        random-walk step's).
    """

    name: str
    quantile: float
    scale: str = "norm"


class DPKernel(MCMCKernel):
    """Base class of the differentially private kernels.

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    noise_multiplier : float, optional
        ``z = sigma / Delta`` of the kernel's Gaussian releases.  Leave it
        ``None`` to let :class:`~numpyro_dp.PrivateMCMC` calibrate it to an
        (epsilon, delta) budget.
    neighbourhood : {"substitute", "add_remove"}
        Which data sets count as neighbours.
    temperature : float
        ``T`` in (0, 1]: every per-row log-likelihood is multiplied by it.
    data_plate : str, optional
        Name of the plate over rows (auto-detected when unambiguous).
    init_strategy : callable
        A NumPyro init strategy; it sees only the priors, never the data.
    """

    sample_field = "z"
    #: What may leave the kernel: its State's and Info's fields (``published_fields``
    #: of the State), all post-processing of releases.
    private_safe_fields: tuple[str, ...] = ()
    #: False for kernels whose noise is fixed by their own parameters (batch size,
    #: step size): there is nothing to calibrate, and an epsilon is only a cap.
    calibrated_noise: bool = True
    #: Whether PrivateMCMC may start the chains at a private warm start.
    tunable: bool = False
    #: True for kernels that spend the budget on releases made once before sampling
    #: (:meth:`release_entries`, :meth:`make_release`), whose iterations cost nothing.
    releases_once: bool = False
    #: The warm start's share of epsilon when ``PrivateMCMC(warm_start="auto")``
    #: (None: the runner's, :func:`~numpyro_dp.runner.budget.auto_warm_start_share`).
    warm_start_share: float | None = None

    def __init__(
        self,
        model: Callable,
        *,
        noise_multiplier: float | None = None,
        neighbourhood: str = "substitute",
        temperature: float = 1.0,
        data_plate: str | None = None,
        init_strategy: Callable = init_to_uniform,
    ):
        self._model = model
        if noise_multiplier is not None:
            check_positive("noise_multiplier", noise_multiplier,
                           "or leave it None and give PrivateMCMC an epsilon and delta.")
        self.noise_multiplier = noise_multiplier
        self.neighbourhood = check_neighbourhood(neighbourhood)
        self.temperature = check_temperature(temperature)
        self.data_plate = data_plate
        self._init_strategy = init_strategy
        self._private_model: PrivateModel | None = None
        self._sample_fn = None
        self._preconditioner = None  # the warm start's Laplace covariance (public)
        self._charged_by = None  # the PrivateMCMC whose ledger accounts for this kernel
        self._armed_by = None  # the PrivateMCMC running a charged call right now

    @property
    def model(self) -> Callable:
        return self._model

    @property
    def sensitivity_factor(self) -> float:
        """l2-sensitivity, in units of the clip bound, of a sum of clipped rows."""
        return sensitivity_factor(self.neighbourhood)

    def prepare(self, model_args: tuple, model_kwargs: dict,
                row_layout: RowLayout | None = None, privacy_unit=None) -> PrivateModel:
        """Analyse and validate the model and data (raises on bad input);
        ``row_layout`` says which rows of padded arrays are real (:func:`ndp.shard_rows`),
        ``privacy_unit`` each row's unit (:class:`~numpyro_dp.model.units.Units`)."""
        self._private_model = PrivateModel(self._model, model_args, model_kwargs,
                                           data_plate=self.data_plate, row_layout=row_layout,
                                           privacy_unit=privacy_unit)
        self._sample_fn = None
        return self._private_model

    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """The privacy cost of one iteration of one chain.

        Parameters
        ----------
        noise_multiplier : float, optional
            Plan at this noise multiplier instead of the kernel's (required
            before calibration for a kernel built without one).
        num_rows : int, optional
            ``n``; needed by minibatch kernels before they have seen the data.
        """
        raise NotImplementedError

    def run_event(
        self,
        num_iterations: int,
        start: int = 0,
        noise_multiplier: float | None = None,
        num_rows: int | None = None,
    ) -> dpa.DpEvent:
        """The privacy cost of one chain's iterations ``start, ..., start + num_iterations - 1``.

        The default composes :meth:`per_iteration_event`; kernels whose cost
        changes over time (decreasing step sizes) override it.
        """
        return dpa.SelfComposedDpEvent(
            self.per_iteration_event(noise_multiplier, num_rows), num_iterations
        )

    def release_entries(self, noise_multiplier: float | None = None) -> list:
        """``(phase, per-release event, releases)`` of the releases a run makes once,
        before sampling, at this noise multiplier (charged once, not per chain)."""
        return []

    def make_release(self, pm: PrivateModel, tuning, *, rng_key, rows: tuple,
                     secret, note: Callable[[str], None]) -> None:
        """Make the releases of :meth:`release_entries` (already charged) on ``rows``,
        after the run's tuning (``tuning``: its :class:`~numpyro_dp.TuningResult`);
        ``note(text)`` writes post-processing of them into the ledger's notes."""
        raise NotImplementedError

    def clip_requests(self) -> tuple[ClipRequest, ...]:
        """The clips this kernel was built without (chosen privately before a run)."""
        return ()

    @property
    def warm_start_clip(self) -> float | None:
        """A stated per-row gradient clip the warm start can use (None: choose one)."""
        return None

    def __setattr__(self, name: str, value) -> None:
        if not name.startswith("_") and self.__dict__.get("_frozen", False):
            raise AttributeError(
                f"{type(self).__name__}.{name} cannot change: a PrivateMCMC has charged runs "
                "of this kernel as it is configured, and every later run must be what "
                f"was charged. Build a new kernel, or take kernel.calibrated({name}=...) "
                "for an unbound copy."
            )
        super().__setattr__(name, value)

    def configure(
        self,
        *,
        noise_multiplier: float | None = None,
        clips: dict[str, float] | None = None,
        preconditioner=None,
        temperature: float | None = None,
    ) -> None:
        """Complete the configuration before the first charged run (the runner's step).

        :class:`~numpyro_dp.PrivateMCMC` sets what it calibrates and chooses
        here, then :meth:`freeze` s the kernel.  All of it is public: the noise
        multiplier is calibrated from public facts; the clips and the warm
        start's Laplace covariance are post-processing of charged releases;
        DP Barker's temperature is ``n0 / n``.  A frozen kernel refuses any
        change (its runs were charged as they are).
        """
        check_settable(self, noise_multiplier, clips)
        changes = {"noise_multiplier": noise_multiplier, "temperature": temperature,
                   **(clips or {})}
        changed = sorted(name for name, value in changes.items()
                         if value is not None and value != getattr(self, name))
        if self.__dict__.get("_frozen", False) and (changed or preconditioner is not None):
            raise AttributeError(
                f"{type(self).__name__} cannot change {changed or 'its preconditioner'}: a "
                "PrivateMCMC has charged runs of this kernel as it is configured. Take "
                "kernel.calibrated(...) for an unbound copy."
            )
        if noise_multiplier is not None:
            object.__setattr__(self, "noise_multiplier", check_positive(
                "noise_multiplier", noise_multiplier, "it scales the noise."))
        for name, value in (clips or {}).items():
            object.__setattr__(self, name, check_positive(name, value, "it is a clip bound."))
        if preconditioner is not None:
            self._preconditioner = np.asarray(preconditioner)
        if temperature is not None:
            object.__setattr__(self, "temperature", float(temperature))
        self._sample_fn = None  # built afresh for the new configuration

    def freeze(self) -> None:
        """Refuse every later change of a public parameter (see :meth:`__setattr__`)."""
        self._frozen = True

    def __getstate__(self) -> dict:
        # As NumPyro's HMC: the compiled sampler is a closure, rebuilt on the next run.
        return {**self.__dict__, "_sample_fn": None}

    def calibrated(
        self, *, noise_multiplier: float | None = None, clips: dict[str, float] | None = None
    ) -> DPKernel:
        """An unbound, unfrozen copy of this kernel with another noise multiplier or clips.

        The way to vary a kernel that a runner has charged and frozen; what is
        not given (the calibrated noise, the privately chosen clips) is kept.
        The copy is not bound to any runner: a new :class:`~numpyro_dp.PrivateMCMC`
        charges it afresh.
        """
        new = copy.copy(self)
        new._frozen, new._charged_by, new._armed_by = False, None, None
        new.configure(noise_multiplier=noise_multiplier, clips=clips)
        return new

    def max_batch_size(
        self, num_rows: int, num_iterations: int, epsilon: float, delta: float,
        num_chains: int, spent: dpa.DpEvent,
    ) -> int | None:
        """The largest batch size whose run fits the budget, for kernels whose cost is
        set by their batch size (DPBarker); ``None`` for the others, whose noise
        multiplier is the knob."""
        return None

    def check_noise_multiplier(self, noise_multiplier: float) -> None:
        """Raise, before anything is charged, where the kernel cannot use releases at
        ``noise_multiplier`` (public facts only); every noise level is usable here."""

    def budget_advice(self) -> str:
        """What a user can change when a run does not fit the budget."""
        return (
            "run fewer iterations or chains, raise noise_multiplier, or state a "
            "larger budget"
        )

    # ------------------------------------------------------------ running
    @contextlib.contextmanager
    def armed(self, runner) -> Iterator[None]:
        """Allow sampling for the duration of one charged call of ``runner``.

        Only :class:`~numpyro_dp.PrivateMCMC` arms a kernel, after charging the
        call to its ledger; outside that window :meth:`init`, :meth:`sample` and
        :meth:`postprocess_fn` refuse to run, whoever calls them (plain
        ``numpyro.infer.MCMC`` included).
        """
        self._armed_by = runner
        try:
            yield
        finally:
            self._armed_by = None

    def tuned_clips(self) -> dict[str, float | None]:
        """The clips the algorithm's ``sample_fn`` takes at every call, by name
        (:meth:`_core`; none by default): the kernel's :meth:`public_inputs`."""
        return {}

    def public_inputs(self) -> dict[str, jax.Array]:
        """Released values the compiled sampler takes at every call, by name (by
        default the :meth:`tuned_clips` that are set): a run passes them as arguments
        (:attr:`RunInputs.public`), never as constants, since what PrivateMCMC releases
        is new numbers on every run, and as constants they would make every re-run
        compile anew."""
        dtype = jnp.result_type(float)
        return {name: jnp.asarray(value, dtype)
                for name, value in self.tuned_clips().items() if value is not None}

    def run_inputs(self, rows: tuple, secret) -> RunInputs:
        """The inputs of a run on ``rows`` (:meth:`PrivateModel.private_inputs`)."""
        return RunInputs(rows, jnp.asarray(secret), self.public_inputs())

    def _unpack(self, model_args: tuple, model_kwargs: dict):
        """``(model_args, model_kwargs, secret, public)`` of an armed run's inputs."""
        inputs = armed_inputs(type(self).__name__, self._armed_by is not None, model_args,
                              model_kwargs)
        args, kwargs = self._private_model.rebuild(inputs.rows)
        return args, kwargs, inputs.secret, inputs.public

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_args, model_kwargs, _, _ = self._unpack(model_args, model_kwargs)
        if self.calibrated_noise and self.noise_multiplier is None:
            raise RuntimeError(
                f"{type(self).__name__} has no noise multiplier: give PrivateMCMC an "
                "epsilon and delta to calibrate it, or pass noise_multiplier=."
            )
        init_fn, sample_fn = self._core(num_warmup)
        self._sample_fn = chain_sampler(sample_fn, batched=not is_prng_key(rng_key))
        return init_chains(self._private_model, self._init_strategy, rng_key, init_params,
                           model_args, model_kwargs, init_fn)

    def _core(self, num_warmup: int) -> tuple[Callable, Callable]:
        """``(init_fn(params, key), sample_fn(state, args, kwargs, secret, **clips))`` of
        the algorithm, built once from the kernel's settings.

        ``clips`` are the :meth:`tuned_clips` by name, given at every call
        (possibly traced): they are not read from the attributes here.
        """
        raise NotImplementedError

    def sample(self, state, model_args, model_kwargs):
        model_args, model_kwargs, secret, clips = self._unpack(model_args, model_kwargs)
        return self._sample_fn(state, model_args, model_kwargs, secret, clips)

    def postprocess_fn(self, args: tuple, kwargs: dict) -> Callable:
        args, kwargs, _, _ = self._unpack(args, kwargs)
        pm = self._private_model

        def constrain(z):
            return pm.constrain(z, args, kwargs)

        return constrain
