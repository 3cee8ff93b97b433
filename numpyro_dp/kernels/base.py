"""What every differentially private kernel shares.

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
  it, and :func:`carries_info` makes each Info field readable on the state, so
  NumPyro's ``extra_fields`` work as for its own kernels;
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
import difflib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax import random, vmap
from numpyro.infer import hmc_util
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import is_prng_key

from numpyro_dp.accounting import check_neighbourhood, sensitivity_factor
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.primitives.release import release_clipped_sum
from numpyro_dp.primitives.rounding import (
    exact_sum,
    sum_levels,
)
from numpyro_dp.primitives.row_blocks import minibatch
from numpyro_dp.primitives.sharding import chains_split, over_row_shards

#: One noise-limited step of at least this many unit-information posterior sds
#: lets warm-up re-estimate the mass matrix after a warm start (see
#: ``DPKernel._moves_freely``).
FREE_STEP_SDS = 10.0
#: Largest number of parameters for which the warm start's covariance is used
#: as a dense mass matrix (or proposal covariance) by default.
DENSE_PRECONDITIONER_MAX_DIM = 50


class RunInputs(NamedTuple):
    """What :class:`~numpyro_dp.PrivateMCMC` passes to a kernel as its model arguments.

    All are arguments of the compiled sampler, never constants of it: the rows
    and the secret because JAX's persistent compilation cache would write
    constants to disk (neither is ever stored in a state); the public values
    so that a re-run whose privately chosen clips differ runs the same program
    (:data:`DPKernel.traced_parameters`).  Build them with
    :meth:`DPKernel.run_inputs`.
    """

    rows: tuple  # the model's row arrays (private), see PrivateModel.private_inputs
    secret: jax.Array  # uint32[2], the run secret (numpyro_dp.primitives.secret)
    public: dict | None = None  # traced_parameters by name (None: the attributes' values)


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


def check_positive(name: str, value: float, fix: str) -> float:
    """Reject a non-positive or non-finite tuning constant, naming the fix."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {fix}")
    return float(value)


def clip_ratios(ratio: jax.Array, clip: jax.Array) -> jax.Array:
    """Per-row log-likelihood ratios clipped to ``[-clip, clip]``.

    A NaN ratio (e.g. a proposal outside a row's support) counts as the worst
    case ``-clip``, so every row's contribution stays bounded by the clip.
    """
    return jnp.clip(jnp.where(jnp.isnan(ratio), -clip, ratio), -clip, clip)


def ratio_sums(ratio: jax.Array, clip, weights: jax.Array | None = None, levels: int = 1):
    """Exact sums of a batch's clipped ratios and of their squares: two ``(hi, lo)`` pairs.

    The ``b`` ratios are clipped (:func:`clip_ratios`) and summed by
    :func:`~numpyro_dp.primitives.rounding.exact_sum` (each rounded to
    ``q1 = row_quantum(clip, b)``, so at most ``clip + q1 / 2``), their squares
    ``fl(r^2)`` likewise on ``row_quantum(clip^2, b)``.  Exact integer sums,
    so the parts of one batch that several devices hold add up to one
    device's sums, bit for bit (:func:`~numpyro_dp.primitives.row_blocks.minibatch`;
    rows of ``weights`` 0 are zeros).  The statistics of the minibatch penalty
    and Barker tests are computed from these (the rounding is charged there).
    """
    r = clip_ratios(ratio, clip)
    if weights is not None:
        r = r * weights.astype(r.dtype)
    b = r.shape[0]
    return exact_sum(r, clip, b, levels), exact_sum(r * r, clip * clip, b, levels)


def batch_ratio_sums(pm: PrivateModel, z: dict, z_new: dict, model_args: tuple,
                     model_kwargs: dict, idx: jax.Array, clip, levels: int = 1):
    """:func:`ratio_sums` of ``l_j(z_new) - l_j(z)`` over the rows ``idx`` of a minibatch,
    computed where the rows live: with the rows on a mesh each device takes the
    batch's rows it holds, and only the sums' integer totals cross devices."""
    theta, theta_new = pm.ravel(z), pm.ravel(z_new)

    def sums(args, kwargs, positions, weights):
        # The points unravelled here, in the per-shard body: values closed over as they
        # are carry the automatic mesh's placement, which the body's operations refuse.
        old = pm.log_density_terms(pm.unravel(theta), args, kwargs, positions=positions)
        new = pm.log_density_terms(pm.unravel(theta_new), args, kwargs, positions=positions)
        return ratio_sums(new.loglik_rows - old.loglik_rows, clip, weights, levels)

    return minibatch(pm, sums, model_args, model_kwargs, idx)


def log_prior(pm: PrivateModel, z: dict, model_args: tuple, model_kwargs: dict) -> jax.Array:
    """``log p(z)`` with its Jacobian: data-free (the rows' terms, unused, are left out of
    the compiled program)."""
    return pm.log_density_terms(z, model_args, model_kwargs).prior


def release_llr(
    key: jax.Array,
    ratio: jax.Array,
    clip: jax.Array,
    *,
    temperature: float,
    noise_multiplier: float,
    sensitivity_factor: float,
    num_terms: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The full-data penalty release ``T (sum_i clip_c(r_i) + N(0, sigma^2))`` and ``T sigma``.

    ``sigma = z * Delta`` with ``Delta`` about ``sensitivity_factor * clip``:
    one row moves the clipped sum by at most that much (plus the rounding that
    :func:`~numpyro_dp.primitives.release.clipped_sum_sensitivity` charges).
    ``clip_ratios`` keeps every term within ``[-clip, clip]``.  ``num_terms`` is
    ``n`` when ``ratio`` holds padded rows (exact zeros,
    :class:`~numpyro_dp.model.layout.RowLayout`); the sum runs where the rows
    live (:func:`~numpyro_dp.primitives.sharding.over_row_shards`).
    """
    levels = sum_levels(noise_multiplier * sensitivity_factor, ratio.dtype)
    n = ratio.shape[0] if num_terms is None else num_terms
    total = over_row_shards(
        lambda rows: exact_sum(clip_ratios(rows[0], clip), clip, n, levels), (ratio,))
    value, sigma = release_clipped_sum(
        key, total, n, clip,
        noise_multiplier=noise_multiplier, sensitivity_factor=sensitivity_factor,
    )
    return temperature * value, temperature * sigma


def penalty_test(
    key: jax.Array, noisy_log_ratio: jax.Array, sigma: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The penalty method's accept step: accept iff ``log u < lambda_hat - sigma^2 / 2``.

    ``noisy_log_ratio`` is the released (noisy) log acceptance ratio and
    ``sigma`` the standard deviation of its noise, symmetric in the two points.
    A non-finite ratio rejects.  Returns the noisy acceptance probability
    ``min(1, exp(lambda_hat - sigma^2 / 2))`` and the decision, both
    post-processing of the release.
    """
    log_accept = noisy_log_ratio - 0.5 * sigma**2
    log_accept = jnp.where(jnp.isfinite(log_accept), log_accept, -jnp.inf)
    accept_prob = jnp.exp(jnp.minimum(log_accept, 0.0))
    accepted = jnp.log(random.uniform(key, (), jnp.result_type(log_accept))) < log_accept
    return accept_prob, accepted


def phase_mean(mean: jax.Array, value: jax.Array, i: jax.Array, num_warmup: int) -> jax.Array:
    """Running mean of ``value`` over the current phase (restarted after warm-up)."""
    n = jnp.where(i < num_warmup, i, i - num_warmup)
    return mean + (value - mean) / (n + 1)


def warmup_adapter(
    num_warmup: int,
    *,
    adapt_step_size: bool,
    adapt_mass_matrix: bool,
    dense_mass: bool,
    target_accept_prob: float,
) -> tuple[Callable, Callable]:
    """NumPyro's :func:`~numpyro.infer.hmc_util.warmup_adapter`, with one change.

    Without mass-matrix adaptation the step size is tuned by *one* dual
    averaging over the whole warm-up, ending at its averaged iterate.
    NumPyro restarts dual averaging at ten times the step at the end of every
    mass-matrix window, whether or not the mass matrix is adapted; on a noisy
    acceptance the 50-iteration terminal window then ends with a step several
    times too large (measured: acceptance 0.06-0.2 after warm-up for a
    target of 0.234).
    """
    wa_init, wa_update = hmc_util.warmup_adapter(
        num_warmup, adapt_step_size=adapt_step_size, adapt_mass_matrix=adapt_mass_matrix,
        dense_mass=dense_mass, target_accept_prob=target_accept_prob,
    )
    if adapt_mass_matrix or not adapt_step_size:
        return wa_init, wa_update
    _, ss_update = hmc_util.dual_averaging()

    def update(t, accept_prob, z_info, state):
        ss_state = ss_update(target_accept_prob - accept_prob, state.ss_state)
        log_step, log_step_avg, *_ = ss_state
        step = jnp.exp(jnp.where(t == num_warmup - 1, log_step_avg, log_step))
        finfo = jnp.finfo(jnp.result_type(step))
        return state._replace(step_size=jnp.clip(step, finfo.tiny, finfo.max), ss_state=ss_state)

    return wa_init, update


def carries_info(info_type: type) -> Callable[[type], type]:
    """Class decorator of a kernel's State whose ``info`` field holds an ``info_type``.

    Each Info field becomes a read-only attribute of the State
    (``state.accept_prob`` is ``state.info.accept_prob``), so
    ``extra_fields=("accept_prob",)`` reads the Info as NumPyro users expect;
    ``published_fields`` lists the State's fields and the Info's.
    """

    def decorate(state_type: type) -> type:
        clash = set(state_type._fields) & set(info_type._fields)
        if "info" not in state_type._fields or clash:
            raise TypeError(f"{state_type.__name__} needs an info field and no Info field "
                            f"names of its own ({sorted(clash)})")
        for name in info_type._fields:
            setattr(state_type, name, property(
                lambda state, name=name: getattr(state.info, name),
                doc=f"``info.{name}`` of the last transition ({info_type.__name__}).",
            ))
        state_type.info_type = info_type
        state_type.published_fields = state_type._fields + info_type._fields
        return state_type

    return decorate


def keyword_arguments(init: Callable) -> Callable:
    """Decorator of a kernel's ``__init__(self, model, *, ...)``: one calling convention.

    Every kernel takes the model positionally and everything else by keyword
    (``DPSGLD(model, step_size=1e-3, batch_size=100, grad_clip=1.0)``): clips,
    steps and batch sizes read the same in every kernel and cannot be swapped
    silently.  A positional argument after the model, or a misspelt keyword,
    raises a ``TypeError`` that shows the keyword form or the closest name.
    """

    @functools.wraps(init)
    def __init__(self, model, *args, **kwargs):
        kernel = type(self).__name__
        accepted = inspect.signature(init).parameters  # as extends() shows them
        for name in kwargs.keys() - accepted.keys() - getattr(init, "fixed", set()):
            close = difflib.get_close_matches(name, list(accepted), n=1)
            hint = f"; did you mean {close[0]}=?" if close else ""
            raise TypeError(f"{kernel} has no argument {name!r}{hint} Its arguments: "
                            f"{', '.join(list(accepted)[2:])}.")
        if args:
            keywords = ", ".join(f"{name}=..." for name in list(accepted)[2:5])
            raise TypeError(
                f"{kernel} takes the model and then keyword arguments only "
                f"({len(args) + 1} positional arguments given): write "
                f"{kernel}(model, {keywords})."
            )
        init(self, model, **kwargs)

    return __init__


def extends(base: type, *, drop: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator of ``__init__(self, model, *, own..., **base_arguments)`` of a subclass.

    The subclass lists only its own arguments and passes the rest on to
    ``base``; its signature (``help()``, an IDE's completion) shows its own
    keywords and then ``base``'s, less those in ``drop`` (arguments the
    subclass fixes, such as DPMALA's one leapfrog step).
    """

    def decorate(init: Callable) -> Callable:
        own = inspect.signature(init).parameters
        inherited = [
            parameter for name, parameter in inspect.signature(base.__init__).parameters.items()
            if parameter.kind is parameter.KEYWORD_ONLY and name not in own and name not in drop
        ]
        init.__signature__ = inspect.Signature(
            [p for p in own.values() if p.kind is not p.VAR_KEYWORD] + inherited
        )
        init.fixed = set(drop)  # refused by the subclass itself, with its reason
        return init

    return decorate


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
    #: Public parameters the compiled sampler takes as arguments rather than
    #: constants: the clips PrivateMCMC chooses privately are new numbers on
    #: every run, and as constants they would make every re-run compile anew.
    traced_parameters: tuple[str, ...] = ()

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
            check_positive(
                "noise_multiplier", noise_multiplier,
                "or leave it None and give PrivateMCMC an epsilon and delta.",
            )
        self.noise_multiplier = noise_multiplier
        self.neighbourhood = check_neighbourhood(neighbourhood)
        if not (isinstance(temperature, (int, float)) and 0 < temperature <= 1):
            raise ValueError(
                f"temperature={temperature!r} must lie in (0, 1]; 1 is the "
                "ordinary posterior."
            )
        self.temperature = float(temperature)
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
                row_layout: RowLayout | None = None) -> PrivateModel:
        """Analyse and validate the model and data (raises on bad input);
        ``row_layout`` says which rows of padded arrays are real (:func:`ndp.shard_rows`)."""
        self._private_model = PrivateModel(
            self._model, model_args, model_kwargs, data_plate=self.data_plate,
            row_layout=row_layout,
        )
        self._sample_fn = None
        if getattr(self, "inverse_mass_matrix", None) is not None:
            self._mass()  # a stated matrix's shape is checked before any charge
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
        if noise_multiplier is not None and not self.calibrated_noise:
            raise ValueError(
                f"{type(self).__name__} has no noise multiplier to set: its noise is fixed "
                "by its own parameters (step size, batch size)."
            )
        clip_names = [n for n in vars(self) if n.endswith("_clip") and not n.startswith("_")]
        unknown = sorted(set(clips or {}) - set(clip_names))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no clip named {unknown}; its clips "
                             f"are {sorted(clip_names)}.")
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

    def _set_mass(self, inverse_mass_matrix, dense_mass: bool | None,
                  adapt_mass_matrix: bool | None) -> None:
        """Check and keep the mass-matrix arguments (DPHMC's; DPPenalty's proposal covariance)."""
        if dense_mass not in (None, True, False):
            raise ValueError(
                f"dense_mass={dense_mass!r} must be True, False or None: "
                f"{type(self).__name__} uses one (diagonal or dense) mass matrix over all "
                "flattened unconstrained parameters; NumPyro's per-site blocks are not "
                "supported."
            )
        if isinstance(inverse_mass_matrix, dict):
            raise ValueError(
                "inverse_mass_matrix must be one array over the flattened unconstrained "
                "parameters (1-D for diagonal, 2-D with dense_mass=True), not a dict of "
                "per-site blocks."
            )
        self.inverse_mass_matrix = inverse_mass_matrix
        self.dense_mass = dense_mass
        self.adapt_mass_matrix = adapt_mass_matrix

    def _mass(self) -> tuple[bool, bool, np.ndarray | None]:
        """``(dense, adapt, inverse)``: the coming run's initial inverse mass matrix.

        For DPPenalty it is the proposal covariance.  A stated
        ``inverse_mass_matrix`` wins (``dense_mass`` follows its shape when
        None).  Otherwise the warm start's Laplace covariance, if any: dense
        (when ``dense`` is None) up to :data:`DENSE_PRECONDITIONER_MAX_DIM`
        parameters, and not re-estimated in warm-up (when ``adapt`` is None)
        unless the noise is light (:meth:`_moves_freely`): under heavy noise the
        chains move too little for their draws to estimate it, and NumPyro's
        estimate would shrink the steps instead.
        Otherwise the identity (None), adapted as in NumPyro.
        """
        dense, adapt, stated = self.dense_mass, self.adapt_mass_matrix, self.inverse_mass_matrix
        dim = self._private_model.num_params
        warm = self._preconditioner if stated is None else None
        # NumPy: public numbers, concrete even while a chain is traced
        dtype = np.dtype(jnp.result_type(float))
        if stated is not None:
            stated = np.asarray(stated, dtype)
            dense = stated.ndim == 2 if dense is None else dense
            expected = (dim, dim) if dense else (dim,)
            if stated.shape != expected:
                raise ValueError(
                    f"inverse_mass_matrix has shape {stated.shape}; with dense_mass={dense} "
                    f"and {dim} unconstrained parameters it must have shape {expected}."
                )
        if dense is None:
            dense = warm is not None and dim <= DENSE_PRECONDITIONER_MAX_DIM
        if adapt is None:
            adapt = warm is None or self._moves_freely()
        inverse = stated
        if warm is not None:
            inverse = np.asarray(warm if dense else np.diag(warm), dtype)
        return dense, adapt, inverse

    def _moves_freely(self) -> bool:
        """Whether one noise-limited step spans :data:`FREE_STEP_SDS` unit-information sds.

        ``sqrt(n) / (Delta_factor z)`` (the planner's step, :mod:`numpyro_dp.runner.planning`):
        public.  Then the chains move enough for their warm-up draws to estimate
        a mass matrix (proposal covariance), which may also correct directions
        that the warm start's noisy curvature could not resolve.
        """
        z = self.noise_multiplier
        if z is None:
            return False
        return math.sqrt(self._private_model.num_rows) / (self.sensitivity_factor * z) \
            >= FREE_STEP_SDS

    @staticmethod
    def _metric_scales(inverse, dim: int) -> tuple[float, float]:
        """``(trace, largest diagonal entry)`` of an initial inverse metric (identity: None)."""
        if inverse is None:
            return float(dim), 1.0
        diag = np.diag(np.asarray(inverse)) if np.ndim(inverse) == 2 else np.asarray(inverse)
        return float(np.sum(diag)), float(np.max(diag))

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

    def _noise_for_event(self, noise_multiplier: float | None) -> float:
        """The noise multiplier to declare an event at, with a clear error if there is none."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if z is None:
            raise ValueError(
                f"This {type(self).__name__} has no noise multiplier yet: PrivateMCMC "
                "calibrates it to the budget when a run starts. To plan before a run, "
                "ask the runner (PrivateMCMC(...).plan(num_rows=n) gives the calibrated "
                "noise and what the budget affords) or pass one: "
                "kernel.per_iteration_event(noise_multiplier=z)."
            )
        return check_positive("noise_multiplier", z, "it is sigma / Delta of each release.")

    def _rows_for_event(self, num_rows: int | None) -> int:
        """``n`` for kernels whose cost depends on it, with a clear error if unknown."""
        if num_rows is None and self._private_model is not None:
            num_rows = self._private_model.num_rows
        if num_rows is None:
            raise ValueError(
                f"The privacy cost of {type(self).__name__} depends on the number of rows "
                "n (the sampling rate is batch_size / n). Pass num_rows=n to plan before "
                "the kernel has seen the data."
            )
        if not (isinstance(num_rows, (int, np.integer)) and num_rows >= 1):
            raise ValueError(f"num_rows={num_rows!r} must be a positive integer.")
        return int(num_rows)

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

    def run_inputs(self, rows: tuple, secret) -> RunInputs:
        """The inputs of a run on ``rows`` (:meth:`PrivateModel.private_inputs`)."""
        dtype = jnp.result_type(float)
        public = {name: jnp.asarray(getattr(self, name), dtype)
                  for name in self.traced_parameters if getattr(self, name) is not None}
        return RunInputs(rows, jnp.asarray(secret), public)

    def _parameters(self, public: dict | None) -> dict:
        """The :data:`traced_parameters`: ``public``'s (traced) values, else the attributes."""
        public = public or {}
        return {name: public.get(name, getattr(self, name)) for name in self.traced_parameters}

    def _unpack(self, model_args: tuple, model_kwargs: dict):
        """``(model_args, model_kwargs, secret, public)`` of an armed run's inputs."""
        inputs = model_args[0] if len(model_args) == 1 else None
        if self._armed_by is None or not isinstance(inputs, RunInputs) or model_kwargs:
            raise RuntimeError(
                f"{type(self).__name__} must be run by numpyro_dp.PrivateMCMC, which "
                "charges every iteration of every chain to the privacy ledger before "
                "it runs; numpyro.infer.MCMC or a direct call would release draws "
                "without accounting. Use ndp.PrivateMCMC(kernel, ...).run(key, *data)."
            )
        args, kwargs = self._private_model.rebuild(inputs.rows)
        return args, kwargs, inputs.secret, inputs.public

    def _init_chains(self, rng_key, init_params, model_args, model_kwargs, init_fn, num_warmup):
        """Initialise one chain or a batch of chains (one key each), as NumPyro does.

        ``init_fn(params, rng_key)`` builds a chain's state from unconstrained
        ``params``; those come from the user or from the prior, never the data.
        The sampler kept for :meth:`sample` builds the algorithm's
        ``sample_fn(state, model_args, model_kwargs, secret)`` while it is
        traced, from the run's public values (:data:`traced_parameters`).
        """
        pm = self._private_model

        def init_one(key, params):
            key_init, key_state = random.split(key)
            if params is None:
                params = pm.init_params(key_init, model_args, model_kwargs, self._init_strategy)
            return init_fn(params, key_state)

        batched = not is_prng_key(rng_key)

        def sample_fn(state, model_args, model_kwargs, secret, public):
            one = self._core(num_warmup, public)[1]
            if not batched:
                return one(state, model_args, model_kwargs, secret)
            # Chains split over a mesh axis stay on their devices (chains_split).
            one = vmap(one, in_axes=(0, None, None, None))
            return chains_split(one(chains_split(state), model_args, model_kwargs, secret))

        self._sample_fn = sample_fn
        return vmap(init_one)(rng_key, init_params) if batched else init_one(rng_key, init_params)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_args, model_kwargs, _, _ = self._unpack(model_args, model_kwargs)
        if self.calibrated_noise and self.noise_multiplier is None:
            raise RuntimeError(
                f"{type(self).__name__} has no noise multiplier: give PrivateMCMC an "
                "epsilon and delta to calibrate it, or pass noise_multiplier=."
            )
        init_fn, _ = self._core(num_warmup)
        return self._init_chains(
            rng_key, init_params, model_args, model_kwargs, init_fn, num_warmup
        )

    def _core(self, num_warmup: int, public: dict | None = None) -> tuple[Callable, Callable]:
        """``(init_fn(params, key), sample_fn(state, args, kwargs, secret))`` of the algorithm.

        ``public`` holds (possibly traced) values of :data:`traced_parameters`
        for ``sample_fn`` to use instead of the attributes
        (:meth:`_parameters`); given, only ``sample_fn`` is needed (``init_fn``
        may be None, and nothing that only ``init_fn`` uses need be computed).
        """
        raise NotImplementedError

    def sample(self, state, model_args, model_kwargs):
        model_args, model_kwargs, secret, public = self._unpack(model_args, model_kwargs)
        return self._sample_fn(state, model_args, model_kwargs, secret, public)

    def postprocess_fn(self, args: tuple, kwargs: dict) -> Callable:
        args, kwargs, _, _ = self._unpack(args, kwargs)
        pm = self._private_model

        def constrain(z):
            return pm.constrain(z, args, kwargs)

        return constrain
