"""Smooth sensitivity of the median and the maximum (Nissim, Raskhodnikova & Smith 2007).

A non-additive statistic such as the median or the maximum of ``n`` values in
``[0, A]`` has global sensitivity ``A`` whatever ``n``: noise calibrated to it
swamps the statistic.  Its *local* sensitivity ``LS(x)`` (the largest change
one substituted row can make at this data set) is usually far smaller, but
noise scaled to it leaks the data.  Nissim et al. (2007) scale the noise to
the *beta-smooth sensitivity* instead,

    S(x) = max_y LS(y) exp(-beta d(x, y)) = max_k exp(-k beta) A_k(x),

``d`` the Hamming distance between data sets of the same size (the
substitute neighbourhood) and ``A_k(x)`` the largest local sensitivity within
distance ``k`` of ``x``, and release ``f(x) + S(x) / alpha * Z``, ``Z ~
Laplace(0, 1)``, which is ``(epsilon, delta)``-DP for the ``(alpha, beta)`` of
:func:`smooth_sensitivity_params` (paper 002, Definition 7 and s6.3).

With ``s_1 <= ... <= s_n`` the sorted values and ``s_i = 0`` for ``i < 1``,
``s_i = A`` for ``i > n``:

* the order statistic of rank ``m`` (NRS's formula for the median, which
  holds for any rank):
  ``A_k = max_{t = 0..k+1} (s_{m+t} - s_{m+t-k-1})``;
* the maximum (rank ``n``): ``A_k = max(A - s_{n-k}, s_n - s_{n-k-1})``.

These are the thesis's formulas of s6.3, and they are right:
``tests/releases/test_smooth_sensitivity.py`` checks them against the definition
(the largest ``LS(y) exp(-beta d(x, y))`` over every data set ``y`` on a grid
finer than ``x``'s, ``LS`` over every substitution) for ``n <= 5``, both
parities of ``n`` and every rank.

**The median.**  NRS take ``n`` odd.  Here the median of ``n`` values is their
order statistic of rank ``m = ceil(n / 2) = (n + 1) // 2``: the middle value
for odd ``n``, the *lower* of the two middle values for even ``n`` (not their
average, whose smooth sensitivity is another formula).  Release
:func:`median_statistic` with :func:`median_smooth_sensitivity`.

**What the library does not offer (yet): the release itself.**  Everything
here is a function of values the caller already holds; nothing draws noise
or publishes anything.  The functions serve to write the likelihood of a
release made elsewhere, ``h(y | x_{1:n}) = Laplace(y; f(x), S(x) / alpha)``,
inside a NumPyro model (its latent rows integrated out by
:class:`~numpyro_dp.MHAAR`), to simulate such releases in studies, and to
compute their Fisher information
(:func:`~numpyro_dp.releases.fisher.marginal_release_fisher`).  A private
release must be charged to a ledger, and the library's ledgers account with
Google's dp-accounting, whose 0.6 events have no generic ``(epsilon,
delta)`` event that this mechanism could be charged as; it would also need
the secret noise and float64 rounding guarantees of
:mod:`~numpyro_dp.releases.mechanisms`.

The sensitivity functions are JAX functions of the values (``jit``/``vmap``-able,
``n`` static, any leading batch axes); values outside ``[0, bound]`` are clipped
into it, as a release with that a-priori bound must clip them.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp

__all__ = [
    "max_smooth_sensitivity",
    "median_rank",
    "median_smooth_sensitivity",
    "median_statistic",
    "order_statistic_smooth_sensitivity",
    "smooth_sensitivity_params",
]


def median_rank(num_values: int) -> int:
    """The rank (1-based) of the median among ``n`` sorted values: ``(n + 1) // 2``.

    The middle value for odd ``n``, the lower middle value for even ``n``.
    """
    if num_values < 1:
        raise ValueError(f"The median of {num_values} values is undefined.")
    return (num_values + 1) // 2


def median_statistic(values: jax.Array) -> jax.Array:
    """The median of the last axis as this module defines it (the lower median).

    Parameters
    ----------
    values : jax.Array
        ``(..., n)``.

    Returns
    -------
    jax.Array
        ``(...)``: the order statistic of rank :func:`median_rank` ``(n)``.
    """
    values = jnp.asarray(values)
    return jnp.sort(values, axis=-1)[..., median_rank(values.shape[-1]) - 1]


def _sorted_in_bounds(values, bound):
    values = jnp.asarray(values)
    if values.ndim < 1 or values.shape[-1] < 1:
        raise ValueError("values must have at least one value on its last axis.")
    return jnp.sort(jnp.clip(values, 0.0, bound), axis=-1)


def order_statistic_smooth_sensitivity(values: jax.Array, rank: int, bound: float,
                                       beta: float) -> jax.Array:
    """beta-smooth sensitivity of the order statistic of rank ``rank`` (Nissim et al. 2007).

    ``S(x) = max_{k=0..n} exp(-k beta) max_{t=0..k+1} (s_{m+t} - s_{m+t-k-1})``,
    ``m = rank``, ``s_i = 0`` for ``i < 1`` and ``bound`` for ``i > n``
    (NRS's formula, stated there for the median).  Computed as the
    equal maximum over pairs ``0 <= i <= m <= j <= n + 1`` of
    ``exp(-(j - i - 1) beta) (s_j - s_i)``: indices beyond ``0`` and ``n + 1``
    add nothing (the same difference at a larger ``k``), so ``(m + 1)(n - m +
    2)`` pairs instead of ``(n + 1)(n + 2)``.

    Parameters
    ----------
    values : jax.Array
        ``(..., n)`` values in ``[0, bound]`` (clipped into it).
    rank : int
        ``m`` in ``1..n`` (static).
    bound : float
        The a-priori bound ``A`` of the values.
    beta : float
        The smoothness ``beta > 0`` (:func:`smooth_sensitivity_params`).

    Returns
    -------
    jax.Array
        ``(...)``, the smooth sensitivity of each batch of values.
    """
    s = _sorted_in_bounds(values, bound)
    n = s.shape[-1]
    try:
        rank = operator.index(rank)
    except TypeError:
        raise ValueError(f"rank={rank!r} must be an integer in 1..{n}.") from None
    if not 1 <= rank <= n:
        raise ValueError(f"rank={rank!r} must be an integer in 1..{n}.")
    batch = s.shape[:-1]
    padded = jnp.concatenate([jnp.zeros(batch + (1,), s.dtype), s,
                              jnp.full(batch + (1,), bound, s.dtype)], axis=-1)  # s_0..s_{n+1}
    low = padded[..., : rank + 1]  # s_i, i = 0..m
    high = padded[..., rank:]  # s_j, j = m..n+1
    i = jnp.arange(rank + 1)
    j = jnp.arange(rank, n + 2)
    # k = j - i - 1 >= 0 except i = j = m, whose difference is 0 anyway.
    decay = jnp.exp(-(j[None, :] - i[:, None] - 1) * jnp.asarray(beta, s.dtype))
    gaps = high[..., None, :] - low[..., :, None]
    return jnp.max(decay * gaps, axis=(-2, -1))


def median_smooth_sensitivity(values: jax.Array, bound: float, beta: float) -> jax.Array:
    """beta-smooth sensitivity of the median (Nissim et al. 2007).

    ``S(x) = max_{k=0..n} exp(-k beta) b_k``, ``b_k = max_{t=0..k+1} (s_{m+t} -
    s_{m+t-k-1})`` with ``m = (n + 1) // 2`` (paper 002, s6.3): the median is
    the lower middle value for even ``n`` (:func:`median_statistic`).

    Parameters
    ----------
    values : jax.Array
        ``(..., n)`` values in ``[0, bound]`` (clipped into it).
    bound : float
        The a-priori bound ``A``.
    beta : float
        The smoothness ``beta > 0``.

    Returns
    -------
    jax.Array
        ``(...)``.
    """
    n = jnp.shape(values)[-1]
    return order_statistic_smooth_sensitivity(values, median_rank(n), bound, beta)


def max_smooth_sensitivity(values: jax.Array, bound: float, beta: float) -> jax.Array:
    """beta-smooth sensitivity of the maximum (Nissim et al. 2007; paper 002, s6.3).

    ``S(x) = max_{k=0..n} exp(-k beta) b_k``, ``b_k = max(A - s_{n-k}, s_n -
    s_{n-k-1})`` with ``s_i = 0`` for ``i < 1``: lowering the ``k`` largest
    values leaves the maximum one substitution from ``A``, or keeping the
    largest and lowering the ``k`` next ones opens the gap below it.  (The
    order statistic of rank ``n``, in ``O(n)``.)

    Parameters
    ----------
    values : jax.Array
        ``(..., n)`` values in ``[0, bound]`` (clipped into it).
    bound : float
        The a-priori bound ``A``.
    beta : float
        The smoothness ``beta > 0``.

    Returns
    -------
    jax.Array
        ``(...)``.
    """
    s = _sorted_in_bounds(values, bound)
    n = s.shape[-1]
    batch = s.shape[:-1]
    padded = jnp.concatenate([jnp.zeros(batch + (2,), s.dtype), s], axis=-1)  # s_{-1}..s_n
    k = jnp.arange(n + 1)
    top = s[..., -1:]  # s_n
    lowered = jnp.flip(padded[..., 1:], axis=-1)  # s_{n-k}, k = 0..n
    below = jnp.flip(padded[..., :-1], axis=-1)  # s_{n-k-1}, k = 0..n
    b = jnp.maximum(bound - lowered, top - below)
    return jnp.max(jnp.exp(-k * jnp.asarray(beta, s.dtype)) * b, axis=-1)


def smooth_sensitivity_params(epsilon: float, delta: float) -> tuple[float, float]:
    """``(alpha, beta)`` of Laplace noise scaled to the smooth sensitivity (Nissim et al. 2007).

    The release ``f(x) + S(x) / alpha * Z``, ``Z ~ Laplace(0, 1)`` and ``S`` the
    ``beta``-smooth sensitivity, is ``(epsilon, delta)``-DP under the
    substitute neighbourhood with NRS's constants for the Laplace
    distribution, ``alpha = epsilon / 2`` and ``beta = epsilon / (2 ln(2 /
    delta))``.

    NRS prove it from two properties of the noise (a shift by up to ``alpha``
    costs ``epsilon / 2``; a dilation by up to ``exp(beta)`` costs ``epsilon /
    2`` outside an event of probability ``delta / 2``).  For Laplace noise the
    second needs ``ln(2/delta) (exp(beta) - 1) - beta <= epsilon / 2``, which
    these constants meet only for ``epsilon`` up to about 3.75 (at ``delta =
    1e-4``; at ``epsilon = 5`` the left side is 2.59 > 2.5).
    The guarantee itself still holds there: the exact worst case, the
    largest hockey-stick divergence between ``Laplace(0, 1)`` and
    ``Laplace(mu, e^lam)`` over ``|lam| <= beta`` and ``|mu| <= alpha
    min(1, e^lam)`` (every pair of neighbours' output laws), is 7.7e-6 at
    ``(epsilon, delta) = (5, 1e-4)`` (``tests/releases/test_smooth_sensitivity.py``
    computes it for epsilon from 0.5 to 8).

    Parameters
    ----------
    epsilon : float
        > 0.
    delta : float
        In (0, 1).

    Returns
    -------
    (float, float)
        ``(alpha, beta)``: the noise's scale is ``S(x) / alpha``.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon={epsilon} must be a finite number > 0.")
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must lie in (0, 1): smooth sensitivity with "
                         "Laplace noise is (epsilon, delta)-DP with delta > 0.")
    return epsilon / 2, epsilon / (2 * math.log(2 / delta))
