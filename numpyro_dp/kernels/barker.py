"""DP Barker: minibatch Metropolis with a noisy Barker acceptance test.

Heikkilä et al. (2019); Räisä (2020), s3.2.  The Barker test accepts
theta' iff ``lambda + V_log > 0`` with ``V_log ~ Logistic(0, 1)`` and
``lambda`` the log target ratio.  DP Barker estimates ``lambda`` on a batch
and lets the batch's own (CLT) noise stand in for part of the logistic noise.
Per iteration, from theta, with ``T = n0 / n``:

1. theta' = theta + s * N(0, I) (symmetric random walk, unconstrained space);
2. a batch B of ``b`` rows drawn without replacement; per-row ratios
   ``r_j = l_j(theta') - l_j(theta)`` clipped to ``|r_j| <= sqrt(b) / n0``;
3. ``lambda = (n T / b) sum_B r_j + log p(theta') - log p(theta)``;
4. ``sigma_b^2 = ((n T)^2 / b) Var_B(r)`` (biased), at most 1 by the clip;
5. accept iff ``lambda + N(0, C - sigma_b^2) + V_corr > 0`` with C = 2, where
   ``N(0, C) + V_corr`` is (nearly) Logistic(0, 1).

``lambda`` and ``sigma_b^2`` come from exact sums of the clipped ratios and
their squares (:func:`~numpyro_dp.kernels.ratios.ratio_sums`), so with the rows
on a mesh each device sums the batch's rows it holds and only integer totals
cross devices.  Only the accept decision leaves the kernel; ``lambda``,
``sigma_b^2``, the ratios and how many of them were clipped stay inside
``sample_fn``.  The cost
of one iteration is the per-step RDP of Heikkilä et al. (2019) amplified by sampling ``b`` of
``n`` rows without replacement (:mod:`numpyro_dp.accounting.rdp`); it depends on ``n``,
``b`` and the number of iterations only, so there is no noise to calibrate:
the budget decides how many iterations (or how large a batch) a run affords:
:meth:`PrivateMCMC.plan <numpyro_dp.PrivateMCMC.plan>` reports both, as for
every kernel (``max_iterations``, ``max_batch_size``).

The test is exact only up to the CLT for the batch mean and the fit of
``V_corr`` (sup CDF error < 1e-3); clipping biases it like any clipping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from importlib import resources
from typing import Any, NamedTuple

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.infer.initialization import init_to_uniform

from numpyro_dp.accounting import check_budget, epsilon_spent, max_iterations
from numpyro_dp.accounting.rdp import BarkerDpEvent
from numpyro_dp.kernels.adaptation import phase_mean
from numpyro_dp.kernels.arguments import check_positive, event_num_rows, keyword_arguments
from numpyro_dp.kernels.base import DPKernel
from numpyro_dp.kernels.ratios import batch_ratio_sums, log_prior, ratio_sums
from numpyro_dp.kernels.running import carries_info
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.model.layout import RowLayout
from numpyro_dp.primitives.batching import sample_without_replacement
from numpyro_dp.primitives.rounding import row_quantum, unit_roundoff
from numpyro_dp.primitives.secret import noise_key
from numpyro_dp.primitives.tap import barker_gate

#: Variance of the Gaussian part of the logistic noise; the privacy theorem needs C = 2.
BARKER_C = 2.0
#: The per-step RDP bound holds for integer orders 2 <= a < b / 5, so b > 10.
MIN_BATCH_SIZE = 11


def load_correction() -> dict[str, np.ndarray]:
    """The fitted V_corr mixture (package data, see scripts/fit_barker_correction.py)."""
    text = resources.files("numpyro_dp").joinpath("data/barker_correction.json").read_text()
    data = json.loads(text)
    if data["C"] != BARKER_C:
        raise RuntimeError("barker_correction.json was fitted for another C; refit it.")
    return {k: np.asarray(data[k], float) for k in ("weights", "means", "scales")}


def sample_correction(key: jax.Array, correction: dict, dtype) -> jax.Array:
    """One draw of V_corr (a Gaussian mixture) inside jit."""
    key_k, key_e = random.split(key)
    k = random.categorical(key_k, jnp.log(jnp.asarray(correction["weights"], dtype)))
    e = random.normal(key_e, (), dtype)
    means, scales = (jnp.asarray(correction[k_], dtype) for k_ in ("means", "scales"))
    return means[k] + scales[k] * e


def barker_decision(key: jax.Array, lam: jax.Array, var_b: jax.Array, correction: dict):
    """The release: accept iff lam + N(0, C - var_b) + V_corr > 0 (``var_b <= 1``).

    The Gaussian tops the batch estimate's own (CLT) noise up to variance C, so
    that with V_corr the total noise is Logistic(0, 1): Barker's test.
    """
    key_noise, key_corr = random.split(key)
    scale = jnp.sqrt(BARKER_C - var_b)
    noise = scale * random.normal(key_noise, (), lam.dtype)
    noise = noise + sample_correction(key_corr, correction, lam.dtype)
    # nan (e.g. -inf + inf) compares False: reject.  An audit's tap sees the decision here.
    return barker_gate(key, lam + noise > 0, scale, lam, var_b)


def barker_statistics(ratio: jax.Array, clip: float, n0: float) -> tuple[jax.Array, jax.Array]:
    """``(lambda, sigma_b^2)`` of a batch's ratios, clipped to ``clip``: the tempered
    log-likelihood ratio ``n0 * mean`` (prior excluded) and its CLT variance, capped at 1."""
    return batch_statistics(ratio_sums(ratio, clip), ratio.shape[0], n0)


def batch_statistics(sums, batch_size: int, n0: float) -> tuple[jax.Array, jax.Array]:
    """:func:`barker_statistics` from the batch's :func:`~numpyro_dp.kernels.ratios.ratio_sums`."""
    (total_hi, total_lo), (squares_hi, squares_lo) = sums
    mean = (total_hi + total_lo) / batch_size
    second = (squares_hi + squares_lo) / batch_size
    return n0 * mean, jnp.clip(n0**2 / batch_size * (second - mean * mean), 0.0, 1.0)


def barker_clip(batch_size: int, n0: float, dtype) -> float:
    """Per-row clip of the ratios: ``sqrt(b) / n0``, less a rounding margin.

    The privacy bound (Heikkilä et al. 2019) holds for rows clipped to ``sqrt(b) / n0`` in
    exact arithmetic.  The batch's sums round each row to the grid ``q`` of
    :func:`~numpyro_dp.primitives.rounding.exact_sum` (2^-20 of the clip in
    float32) and add them exactly; the mean and variance are then computed
    with a relative error below ``8 u``.  Clipping at ``(1 - 8 b u)`` of the
    bound, less ``q``, keeps the rounded rows within ``(1 - 8 b u)`` of it and
    so the computed statistics of two neighbouring batches as close as the exact
    ones at the full bound (a margin of 5e-4 at ``b = 1000`` in float32, 1e-12
    in float64).
    """
    bound = math.sqrt(batch_size) / n0 * (1.0 - 8.0 * batch_size * unit_roundoff(dtype))
    # A row moves by at most half the grid of a clip <= bound: q / 2 (and the
    # clip's own rounding to dtype, far below the other half).
    with jax.ensure_compile_time_eval():  # a constant, also while a sampler is traced
        return bound - float(row_quantum(bound, batch_size, dtype))


# ------------------------------------------------------------- accounting
#: An empty ledger.
NOTHING_SPENT = dpa.NoOpDpEvent()


def barker_event(num_rows: int, batch_size: int) -> dpa.DpEvent:
    """Privacy cost of one DP Barker iteration: one Barker test on a WOR batch."""
    return dpa.SampledWithoutReplacementDpEvent(num_rows, batch_size, BarkerDpEvent(batch_size))


def barker_epsilon(
    num_rows: int, batch_size: int, num_iterations: int, delta: float, num_chains: int = 1,
    spent: dpa.DpEvent = NOTHING_SPENT,
) -> float:
    """Epsilon (rounded up) of ``num_chains x num_iterations`` DP Barker iterations.

    ``spent``: what the ledger holds already, composed before the run.
    """
    check_batch_size(num_rows, batch_size)
    event = dpa.SelfComposedDpEvent(barker_event(num_rows, batch_size), num_chains * num_iterations)
    return epsilon_spent(dpa.ComposedDpEvent([spent, event]), delta)


def barker_max_iterations(
    num_rows: int, batch_size: int, epsilon: float, delta: float, num_chains: int = 1
) -> int:
    """Largest number of iterations per chain that (epsilon, delta) affords at this batch size."""
    check_batch_size(num_rows, batch_size)
    return max_iterations(barker_event(num_rows, batch_size), epsilon, delta, num_chains)


def barker_max_batch_size(
    num_rows: int, num_iterations: int, epsilon: float, delta: float, num_chains: int = 1,
    spent: dpa.DpEvent = NOTHING_SPENT,
) -> int:
    """Largest batch size whose run of ``num_iterations`` per chain fits (epsilon, delta).

    Epsilon is U-shaped in ``b``: small batches pay for a weak per-step bound
    (few valid orders), large ones for weak amplification (``q = b / n``).
    The minimum is located on a log grid; the largest affordable ``b`` above
    it is then found by bisection.  Returns 0 when no batch size fits.  For
    budgets so large that ``b`` reaches ``q = b / n`` of a few percent, epsilon
    stops increasing in ``b`` (the unamplified bound takes over) and the value
    returned, which always fits, may be below the largest that does.
    ``spent``: what the ledger holds already.
    """
    check_budget(epsilon, delta)

    def eps(b):
        return barker_epsilon(num_rows, b, num_iterations, delta, num_chains, spent)

    grid = np.unique(np.geomspace(MIN_BATCH_SIZE, num_rows, 60).astype(int))
    lo = int(grid[np.argmin([eps(int(b)) for b in grid])])
    if eps(lo) > epsilon:
        return 0
    hi = num_rows
    if eps(hi) <= epsilon:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= epsilon else (lo, mid)
    return lo


def check_batch_size(num_rows: int, batch_size: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < MIN_BATCH_SIZE:
        raise ValueError(
            f"batch_size={batch_size!r} must be an integer >= {MIN_BATCH_SIZE}: the DP "
            "Barker privacy bound holds for RDP orders 2 <= a < batch_size / 5, so "
            "batch_size must exceed 5 x 2. Use a larger batch (hundreds to thousands)."
        )
    if batch_size > num_rows:
        raise ValueError(
            f"batch_size={batch_size} exceeds the number of rows n={num_rows}; choose "
            "batch_size <= n (the batch is drawn without replacement)."
        )


# --------------------------------------------------------------- kernel
class DPBarkerInfo(NamedTuple):
    """One DP Barker transition; safe to publish.

    Attributes
    ----------
    accepted : bool
        The released accept decision.  (The Barker acceptance probability is
        a function of the exact lambda: it is never computed, so there is no
        ``accept_prob``.)
    """

    accepted: jax.Array


@carries_info(DPBarkerInfo)
class DPBarkerState(NamedTuple):
    """State of :class:`DPBarker`; every field is safe to publish.

    ``state.accepted`` is ``state.info.accepted``.

    Attributes
    ----------
    i : int
        Iteration counter (warm-up included).
    z : dict
        Current point in unconstrained space.
    info : DPBarkerInfo
        The last transition.
    mean_accept_prob : float
        Fraction of accepted proposals so far (reset after warm-up): a
        post-processing of the decisions.
    rng_key : jax.random key
    """

    i: jax.Array
    z: dict
    info: DPBarkerInfo
    mean_accept_prob: jax.Array
    rng_key: jax.Array


def dp_barker(
    private_model: PrivateModel,
    num_warmup: int,
    *,
    batch_size: int,
    n0: float,
    proposal_scale: float,
    correction: dict | None = None,
) -> tuple[Callable, Callable]:
    """Functional core of the DP Barker kernel.

    Returns
    -------
    init_fn(init_params, rng_key) -> DPBarkerState
    sample_fn(state, model_args, model_kwargs, secret) -> DPBarkerState
        The batch and the test's noise come from the run secret
        (:mod:`numpyro_dp.primitives.secret`), the proposal from the state's key.
    """
    pm = private_model
    num_rows = pm.num_rows
    check_batch_size(num_rows, batch_size)
    correction = load_correction() if correction is None else correction
    clip = barker_clip(batch_size, n0, jnp.result_type(float))

    def init_fn(init_params: dict, rng_key):
        theta = pm.ravel(init_params)
        zero = jnp.zeros((), theta.dtype)
        return DPBarkerState(jnp.array(0), init_params, DPBarkerInfo(jnp.array(False)), zero,
                             rng_key)

    def sample_fn(state: DPBarkerState, model_args: tuple, model_kwargs: dict, secret):
        rng_key, key_prop, key_batch, key_noise = random.split(state.rng_key, 4)
        key_batch, key_noise = noise_key(secret, key_batch), noise_key(secret, key_noise)
        theta = pm.ravel(state.z)
        step = proposal_scale * random.normal(key_prop, theta.shape, theta.dtype)
        z_new = pm.unravel(theta + step)
        batch = sample_without_replacement(key_batch, num_rows, batch_size)
        # The batch's sums where its rows live: only their integer totals cross devices.
        sums = batch_ratio_sums(pm, state.z, z_new, model_args, model_kwargs, batch, clip)
        prior_ratio = (log_prior(pm, z_new, model_args, model_kwargs)
                       - log_prior(pm, state.z, model_args, model_kwargs))

        # Private: lambda, sigma_b^2 and the ratios never leave this function.
        lam, var_b = batch_statistics(sums, batch_size, n0)
        accepted = barker_decision(key_noise, lam + prior_ratio, var_b, correction)

        z = jax.tree.map(lambda a, b: jnp.where(accepted, a, b), z_new, state.z)
        i = state.i
        rate = phase_mean(state.mean_accept_prob, accepted, i, num_warmup)
        return DPBarkerState(i + 1, z, DPBarkerInfo(accepted), rate, rng_key)

    return init_fn, sample_fn


class DPBarker(DPKernel):
    """Differentially private minibatch Metropolis with the Barker test (Heikkilä et al. 2019).

    Parameters
    ----------
    model : callable
        A NumPyro model with a plate over the data rows.
    batch_size : int
        ``b``: rows drawn without replacement per iteration (> 10, <= n).
        Larger batches clip less (the clip is ``sqrt(b) / n0``) but are
        amplified less; :meth:`PrivateMCMC.plan <numpyro_dp.PrivateMCMC.plan>`
        says the largest that fits the budget (``max_batch_size``).
    proposal_scale : float
        Standard deviation ``s`` of the Gaussian random walk in unconstrained
        space (fixed; not adapted in warm-up).
    n0 : float
        Tempering: the chain targets the posterior with every ``l_i``
        multiplied by ``T = n0 / n`` (as if there were ``n0`` rows), as the
        privacy bound requires.  ``n0 <= n``.
    data_plate : str, optional
    init_strategy : callable
        NumPyro init strategy (prior-based; default ``init_to_uniform``).

    Notes
    -----
    There is no noise multiplier: the privacy cost per iteration is fixed by
    ``n`` and ``b``, so :class:`~numpyro_dp.PrivateMCMC` does not calibrate
    anything; it refuses a run the budget cannot afford.  Only the
    ``"substitute"`` neighbourhood is supported (fixed-size batches).
    float32 suffices: the test compares ``lambda`` with O(1) noise, so
    rounding of the ratios (relative 1e-7) is far below the noise; float64
    doubles the cost of the row evaluations.
    """

    private_safe_fields = DPBarkerState.published_fields
    default_fields = ("z", "accepted")
    calibrated_noise = False

    @keyword_arguments
    def __init__(
        self,
        model: Callable,
        *,
        batch_size: int,
        proposal_scale: float = 0.1,
        n0: float = 100.0,
        data_plate: str | None = None,
        init_strategy: Callable = init_to_uniform,
    ):
        super().__init__(model, data_plate=data_plate, init_strategy=init_strategy)
        check_batch_size(math.inf, batch_size)
        self.batch_size = int(batch_size)
        self.proposal_scale = check_positive(
            "proposal_scale", proposal_scale,
            "it is the random-walk standard deviation in unconstrained space.",
        )
        self.n0 = check_positive(
            "n0", n0, "it is the effective number of rows of the tempered posterior (T = n0 / n).",
        )

    def prepare(self, model_args: tuple, model_kwargs: dict,
                row_layout: RowLayout | None = None, privacy_unit=None) -> PrivateModel:
        if privacy_unit is not None:
            raise ValueError(
                "DPBarker does not accept privacy_unit: its Barker test's correction "
                "assumes the batch's log-likelihood ratios are independent rows, and a "
                "unit's rows are not. For a guarantee per unit use DPPenalty, "
                "DPMinibatchPenalty, DPHMC, DPMALA, DPSGLD, DPSGHMC, DPSGNHT or "
                "NoiseAwareNUTS (each samples or clips whole units)."
            )
        pm = super().prepare(model_args, model_kwargs, row_layout)
        check_batch_size(pm.num_rows, self.batch_size)
        if self.n0 > pm.num_rows:
            raise ValueError(
                f"n0={self.n0} exceeds the number of rows n={pm.num_rows}: the "
                "temperature T = n0 / n must be <= 1. Choose n0 <= n (e.g. 100)."
            )
        self.configure(temperature=self.n0 / pm.num_rows)
        return pm

    def per_iteration_event(
        self, noise_multiplier: float | None = None, num_rows: int | None = None
    ) -> dpa.DpEvent:
        """One Barker test amplified by sampling ``b`` of ``n`` rows without replacement."""
        if noise_multiplier is not None:
            raise ValueError(
                "DPBarker has no noise multiplier: its noise is fixed by the Barker "
                "test, and its cost by n and batch_size."
            )
        return barker_event(event_num_rows(self, num_rows), self.batch_size)

    def budget_advice(self) -> str:
        return (
            "run fewer iterations or chains, or change batch_size "
            "(PrivateMCMC.plan(num_rows=n).max_batch_size says which fits; this kernel "
            "has no noise_multiplier), or state a larger budget"
        )

    def max_batch_size(
        self, num_rows: int, num_iterations: int, epsilon: float, delta: float,
        num_chains: int, spent: dpa.DpEvent,
    ) -> int:
        """The largest batch size whose run fits (see :func:`barker_max_batch_size`)."""
        return barker_max_batch_size(num_rows, num_iterations, epsilon, delta, num_chains, spent)

    def _core(self, num_warmup: int):
        return dp_barker(
            self._private_model, num_warmup, batch_size=self.batch_size, n0=self.n0,
            proposal_scale=self.proposal_scale,
        )

    def get_diagnostics_str(self, state: Any) -> str:
        return f"acc. rate={state.mean_accept_prob:.2f}"
