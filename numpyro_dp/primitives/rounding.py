"""Floating-point-safe releases: exact-enough sums and noise on a grid (Mironov 2012).

A Gaussian mechanism is private for the values *as computed*.  Two things of
ordinary floating point break that:

1. **Rounding changes the sensitivity.**  A float32 sum of ``n`` clipped rows
   is off the exact sum by up to about ``n u`` of its size, and the errors of
   two neighbouring data sets differ: at ``n = 3e7`` the computed sums moved by
   twice the charged sensitivity.
2. **The low-order bits of ``value + noise`` betray the value** (Mironov 2012):
   the set of floats a sampler can return is sparse, so ``release - value`` is a
   possible noise draw for the true value only.

This module fixes both, for any working precision (float32 or float64):

* :func:`exact_sum` sums per-row terms *exactly*: each row's term is first
  rounded to a grid ``q`` about ``2^-20`` (float32) or ``2^-40`` (float64) of
  its bound, which changes that row alone (privacy-free; the norm bound grows
  by ``sqrt(d) q / 2``, charged), then the integers are summed in blocks in
  ``int32``/``int64`` and the block totals in double-word arithmetic, both
  without rounding.  It costs a few passes over the terms, fused by XLA.
* :func:`dw_sum` sums floats pairwise in *double-word* arithmetic (each partial
  sum an unevaluated pair ``hi + lo``; Joldes, Muller & Popescu 2017, Alg. 6),
  with the error bound :func:`dw_sum_error` ``<= 4 (ceil(log2 n) + 2) u^2 sum
  |x_i|`` (``u = 2^-24`` or ``2^-53``).  It is slow on long arrays (strided
  levels) and is used for short ones: batch statistics, block totals, one-shot
  releases.
* :func:`grid_release` rounds the statistic to a grid of step ``q`` (a power of
  two far below its sensitivity; the rounding is charged too) and adds noise
  rounded to the same grid, ``q round(sigma N / q)``, in exact integer
  arithmetic.  Since the statistic is on the grid,
  ``S + q round(sigma N / q) = q round((S + sigma N) / q)``: the result is a
  function of ``S + sigma N``, the Gaussian mechanism itself.  It is then
  rounded to a coarser grid ``g`` (about ``sigma / 2^8``; post-processing), so
  that every output cell holds at least ~2^13 (float32) or ~2^11 (float64,
  within 7 sigma) distinct values of the noise sampler and the cell
  probabilities follow the Gaussian's, not the sampler's granularity.
* :func:`fine_normal` draws N by inverting the normal CDF at a uniform with
  64 random bits and full relative precision near 0, so its tails reach 9
  sigma; JAX's float32 ``normal`` stops at 5.3 sigma.

What is not covered (documented in the README): the sampler approximates the
Gaussian only to its floating-point resolution (relative cell probabilities
off by ~1e-4 in float32, ~1e-8 in float64, tails beyond 9 sigma missing);
the accountant does not charge that.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.scipy.special import ndtri

from numpyro_dp.primitives.sharding import row_axis, row_axis_size
from numpyro_dp.primitives.tap import grid_gate

#: Bits of the output cell below sigma: g = 2^(floor(log2 sigma) - GRID_BITS).
GRID_BITS = 8
#: Statistics and noise, in units of the grid step q, stay below 2^(2p - HEADROOM)
#: so that their double-word sum is exact (p = 24 or 53 significand bits).
HEADROOM = 6


def significand_bits(dtype) -> int:
    """p: 24 for float32, 53 for float64."""
    return int(jnp.finfo(dtype).nmant) + 1


def unit_roundoff(dtype) -> float:
    """u = 2^-p."""
    return 2.0 ** -significand_bits(dtype)


def noise_scale(noise_multiplier, sensitivity, dtype):
    """The noise sd ``z Delta`` of a release charged at noise multiplier ``z``, rounded up.

    ``z`` may reach here cast into ``dtype`` (a float32 cast can round it down by a unit
    roundoff) and the product rounds once or twice more; 8 unit roundoffs of ``dtype``
    cover all of them, so the noise drawn is never below what the accountant charged.
    Every Gaussian and Laplace release's scale is computed here.
    """
    return noise_multiplier * sensitivity * (1.0 + 8 * unit_roundoff(dtype))


# --------------------------------------------------------- double-word sums
def two_sum(a, b):
    """``s + e == a + b`` exactly, ``s = fl(a + b)`` (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fast_two_sum(a, b):
    """``two_sum`` for ``|a| >= |b|`` (Dekker)."""
    s = a + b
    return s, b - (s - a)


def dw_add(a_hi, a_lo, b_hi, b_lo):
    """Double-word sum, relative error <= 3 u^2 (Joldes, Muller & Popescu 2017, Alg. 6)."""
    s, t = two_sum(a_hi, b_hi)
    s2, t2 = two_sum(a_lo, b_lo)
    vh, vl = fast_two_sum(s, t + s2)
    return fast_two_sum(vh, t2 + vl)


def dw_sum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pairwise double-word sum of ``x`` over its leading axis: ``(hi, lo)``.

    Error at most :func:`dw_sum_error` of ``sum |x_i|``.  Cost: about 10 flops
    per element, ``ceil(log2 n)`` vectorised levels.
    """
    x = jnp.asarray(x)
    hi, lo = x, jnp.zeros_like(x)
    while hi.shape[0] > 1:
        if hi.shape[0] % 2:
            pad = [(0, 1)] + [(0, 0)] * (hi.ndim - 1)
            hi, lo = jnp.pad(hi, pad), jnp.pad(lo, pad)
        hi, lo = dw_add(hi[0::2], lo[0::2], hi[1::2], lo[1::2])
    if hi.shape[0] == 0:
        return jnp.zeros(x.shape[1:], x.dtype), jnp.zeros(x.shape[1:], x.dtype)
    return hi[0], lo[0]


def dw_sum_error(num_terms: int, abs_sum_bound, dtype) -> float:
    """Bound on ``|dw_sum(x) - sum(x)|`` for ``sum |x_i| <= abs_sum_bound``.

    ``4 ceil(log2 n) u^2 abs_sum_bound`` (each level adds at most 3u^2/(1 - 4u)
    of the sum of its inputs' magnitudes), plus ``n`` times the smallest normal
    number for arithmetic that flushes subnormals to zero.
    """
    # +2 levels: a sum of blockwise sums (the gradient routes) is one level deeper.
    levels = math.ceil(math.log2(max(num_terms, 2))) + 2
    u = unit_roundoff(dtype)
    tiny = float(jnp.finfo(dtype).tiny)
    return 4.0 * levels * u * u * abs_sum_bound + 8.0 * num_terms * tiny


def dw_round(hi, lo):
    """Nearest integer of ``hi + lo``, as a double-word ``(hi, lo)`` (exact)."""
    r = jnp.round(hi)
    frac = jnp.round((hi - r) + lo)  # hi - r is exact (Sterbenz)
    return two_sum(r, frac)


#: Per working precision (significand bits p): the bits of a row's bound that
#: one integer level of :func:`exact_sum` keeps (at most) and the integer type
#: of its block sums.
ROW_GRID = {24: (20, jnp.int32), 53: (40, jnp.int64)}


def _level_bits(num_terms: int, dtype) -> int:
    """Bits per level: at most ROW_GRID's, and few enough that the sum of ``n``
    rows in units of a level's grid stays below 2^45, where double-word
    arithmetic on integers is exact (float32; float64 has room to spare)."""
    p = significand_bits(dtype)
    room = 2 * p - 3 - math.ceil(math.log2(max(num_terms, 2)))
    return min(ROW_GRID[p][0], room)


def row_quantum(row_bound, num_terms: int, dtype):
    """Grid every row's term is rounded to by :func:`exact_sum` (at its first level).

    ``2^(ceil(log2 row_bound) - bits)``, ``bits = 20`` (float32, up to
    ``n = 2^25``) or ``40`` (float64): a row's norm grows by at most
    ``sqrt(d) q / 2``.  Further levels only make the rounding finer.  Depends
    on the public bound and ``n`` only.
    """
    dtype = jnp.dtype(dtype).type
    bound = jnp.maximum(row_bound, jnp.finfo(dtype).tiny)
    return _exp2(_ceil_log2(bound, dtype) - _level_bits(num_terms, dtype), dtype)


def sum_levels(relative_noise: float, dtype) -> int:
    """Levels :func:`exact_sum` needs so that its rounding is far below the noise.

    One level rounds a row to ``2^-20`` of its bound in float32, below
    ``2^-10`` of noise whose standard deviation is at least ``2^-10`` of the
    bound (``relative_noise``, a public number: the noise multiplier times the
    sensitivity factor).  Smaller noise (non-private checks at huge epsilon)
    gets a second level (``2^-40``).  float64 needs one.
    """
    bits = ROW_GRID[significand_bits(dtype)][0]
    return 1 if relative_noise >= 2.0 ** (10 - bits) else 2


def exact_sum_error(num_terms: int, row_bound, dtype):
    """Bound on ``|exact_sum - (sum of the rounded rows)|`` (l2, rows of norm <= row_bound).

    Each level's sum is exact; adding the levels' double-word sums rounds by at
    most ``3 u^2`` of ``n row_bound`` each, and adding partial results of one
    release (blocks of rows) pairwise at most :func:`dw_sum_error`: about
    ``4 (log2 n + 4) u^2 n row_bound`` in all (1e-5 of the bound at n = 3e7 in
    float32).
    """
    magnitude = num_terms * row_bound
    u = unit_roundoff(dtype)
    return dw_sum_error(num_terms, magnitude, dtype) + 8.0 * u * u * magnitude


def _block_totals(units: jax.Array, itype, bits: int) -> jax.Array:
    """Exact sums of blocks of rows of integers below ``2^bits`` (two stages).

    Two small segment sums are much faster in XLA on CPU than one large one;
    each total stays below ``2^(integer bits - 1)``.  The rows left after the
    full blocks make a block of their own, padded with zeros.  Summed on their
    own, XLA computed those rows inside the kernel that consumed the sum (on
    one device, a sampler's update), whose products and sums the CPU backend
    then contracted into FMAs otherwise than on a mesh, where the sum comes
    from an all-reduce: DPSGLD's draws on one device and on a mesh differed by
    one ulp for batches that are not a multiple of the block.
    """
    stage = 2 ** ((jnp.iinfo(itype).bits - 2 - bits) // 2)
    totals = units.astype(itype)
    for _ in range(2):
        n = totals.shape[0]
        full = n - n % stage
        parts = []
        if full:
            parts.append(totals[:full].reshape((-1, stage) + totals.shape[1:]).sum(1))
        if full < n or not n:
            pad = [(0, full + stage - n)] + [(0, 0)] * (totals.ndim - 1)
            parts.append(jnp.pad(totals[full:], pad).reshape((1, stage) + totals.shape[1:]).sum(1))
        totals = jnp.concatenate(parts)
    return totals


def _to_dw(values: jax.Array, dtype):
    """Integers (int32/int64) as exact double-word floats ``(hi, lo)``."""
    hi = values.astype(dtype)
    return hi, (values - hi.astype(values.dtype)).astype(dtype)


def _integer_total(totals: jax.Array, dtype):
    """The exact sum over the leading axis of block totals, as a double-word pair.

    Each total (below ``2^(b - 1)`` for a b-bit integer type) is split into its
    high and low halves, whose column sums cannot overflow while there are fewer
    than ``2^(b/2)`` blocks; the two sums are then joined in double-word
    arithmetic, exactly.  Two reductions instead of a pairwise tree of many
    small operations (each a kernel launch on CPU).  More blocks (``n`` beyond
    ``6.7e7`` rows in float32): a pairwise double-word sum of the totals, also
    exact.
    """
    half = jnp.iinfo(totals.dtype).bits // 2 - 1
    axis = row_axis()
    if totals.shape[0] * row_axis_size() >= 2**half:
        if axis is not None:  # every block's totals, d numbers each, in device order
            totals = jax.lax.all_gather(totals, axis, tiled=True)
        return dw_sum(jnp.concatenate(_to_dw(totals, dtype)))
    high = (totals >> half).sum(0)  # floor division by 2^half, also for negatives
    low = (totals & (2**half - 1)).sum(0)
    if axis is not None:  # rows on a mesh (sharding.over_row_shards): exact integer sums
        high, low = jax.lax.psum((high, low), axis)
    scale = jnp.asarray(2.0**half, dtype)
    high_hi, high_lo = _to_dw(high, dtype)
    return dw_add(high_hi * scale, high_lo * scale, *_to_dw(low, dtype))


def _segment_total(units: jax.Array, segment_ids: jax.Array, num_segments: int, itype,
                   bits: int, num_terms: int, dtype):
    """Exact per-segment sums of integers ``|units| <= 2^bits``, as double-word pairs.

    A segment may collect every row, so its total can need ``bits + log2 n`` bits,
    more than the integer type holds.  Each integer is split into ``c``-bit
    chunks (``units = sum_k chunk_k 2^(c k)``; the lower chunks non-negative, the
    top one signed), with ``c`` small enough that a chunk's segment sum over all
    ``n`` rows cannot overflow; the chunk totals are then joined from the top in
    double-word arithmetic, exactly (every partial value is an integer below
    ``2^(2p - 3)``, as in :func:`_integer_total`).
    """
    room = jnp.iinfo(itype).bits - 2 - math.ceil(math.log2(max(num_terms, 2)))
    chunk = max(1, min(bits + 1, room))
    num_chunks = -(-(bits + 1) // chunk)
    rest = units.astype(itype)
    chunks = []
    for _ in range(num_chunks - 1):
        chunks.append(rest & (2**chunk - 1))
        rest = rest >> chunk  # floor division by 2^chunk, also for negatives
    chunks.append(rest)
    totals = [jax.ops.segment_sum(c, segment_ids, num_segments) for c in chunks]
    if row_axis() is not None:  # rows on a mesh: chunk sums over all rows, exact
        totals = jax.lax.psum(totals, row_axis())
    scale = jnp.asarray(2.0**chunk, dtype)
    hi, lo = _to_dw(totals[-1], dtype)
    for t in reversed(totals[:-1]):
        hi, lo = dw_add(hi * scale, lo * scale, *_to_dw(t, dtype))
    return hi, lo


def _rounded_sum(terms, row_bound, num_terms, levels, integer_total):
    """The levels of :func:`exact_sum`: round to the grid, add the integers exactly.

    ``integer_total(units, itype, bits, n, dtype)`` adds one level's integers
    (``|units| <= 2^bits``) exactly and returns them as a double-word pair.
    """
    terms = jnp.asarray(terms)
    dtype = terms.dtype
    n = terms.shape[0] if num_terms is None else num_terms
    bits, itype = _level_bits(n, dtype), ROW_GRID[significand_bits(dtype)][1]
    quantum = row_quantum(row_bound, n, dtype)
    rest, total = terms, None
    for _ in range(levels):
        units = jnp.round(rest / quantum)  # |units| <= 2^bits
        rest = rest - units * quantum  # exact (Sterbenz), |rest| <= quantum / 2
        level = integer_total(units, itype, bits, n, dtype)
        level = (level[0] * quantum, level[1] * quantum)
        total = level if total is None else dw_add(*total, *level)
        quantum = quantum * dtype.type(2.0**-bits)
    return total


def exact_segment_sum(
    terms: jax.Array, segment_ids: jax.Array, num_segments: int, row_bound,
    num_terms: int | None = None, levels: int = 1,
):
    """:func:`exact_sum` of rows that each land in one segment: a sum per segment.

    ``terms[i]`` is the part of row ``i``'s vector that lies in the block of
    coordinates ``segment_ids[i]`` (the row is zero elsewhere in the block), so
    that summing rows of ``n x num_segments`` mostly-zero vectors needs only
    the ``n`` values.  The rounding is exactly :func:`exact_sum`'s (the same grid
    for the same ``row_bound`` and ``num_terms``; a zero rounds to zero), so the
    result equals :func:`exact_sum` of the scattered rows: ``(hi, lo)`` of shape
    ``(num_segments,) + terms.shape[1:]``.  Segment ids must lie in
    ``[0, num_segments)``; rows whose ``terms`` are zero may carry any id.
    """
    return _rounded_sum(
        terms, row_bound, num_terms, levels,
        lambda units, itype, bits, n, dtype: _segment_total(
            units, segment_ids, num_segments, itype, bits, n, dtype),
    )


def exact_sum(terms: jax.Array, row_bound, num_terms: int | None = None, levels: int = 1):
    """Sum over the leading axis of ``terms``, each row rounded to a fine grid.

    ``(hi, lo)``: the sum of the rounded rows as a double-word pair, exact up to
    :func:`exact_sum_error`.  Every row must have norm at most ``row_bound``.
    The first level rounds each row to :func:`row_quantum`; each further level
    rounds what is left to a grid ``2^-bits`` finer (:func:`sum_levels`).  Each
    level sums its integers in blocks (``int32``/``int64``) and the block totals
    in double-word arithmetic, exactly.  On CPU, about a plain float32 sum per
    level for terms already in memory; terms computed on the fly (a product
    that a plain sum would fuse) are written out first.  ``num_terms`` (default: the
    rows given) sets the grid: pass the total when partial sums of one release
    are added up, so that their grids agree.
    """
    return _rounded_sum(
        terms, row_bound, num_terms, levels,
        lambda units, itype, bits, n, dtype: _integer_total(
            _block_totals(units, itype, bits), dtype),
    )


# ------------------------------------------------------------------ noise
def _fine_uniform_half(key: jax.Array, shape, dtype):
    """``(u, sign)``: u in (0, 1/2) on a 2^-64 grid with full relative precision."""
    bits = random.bits(key, (*shape, 2), jnp.uint32)
    hi, lo = bits[..., 0], bits[..., 1]
    sign = (hi >> 31).astype(bool)
    hi31 = (hi & jnp.uint32(0x7FFFFFFF)).astype(dtype)
    u = (hi31 * dtype(2.0**32) + (lo.astype(dtype) + dtype(0.5))) * dtype(2.0**-64)
    return u, sign


def fine_normal(key: jax.Array, shape=(), dtype=None) -> jax.Array:
    """Standard normal draws by inversion at a 64-bit uniform (tails to 9 sigma)."""
    dtype = jnp.dtype(dtype or jnp.result_type(float)).type
    u, sign = _fine_uniform_half(key, shape, dtype)
    magnitude = -ndtri(u)
    return jnp.where(sign, -magnitude, magnitude)


def fine_laplace(key: jax.Array, shape=(), dtype=None) -> jax.Array:
    """Standard Laplace draws (scale 1) by inversion at a 64-bit uniform."""
    dtype = jnp.dtype(dtype or jnp.result_type(float)).type
    u, sign = _fine_uniform_half(key, shape, dtype)
    magnitude = -jnp.log(2 * u)
    return jnp.where(sign, -magnitude, magnitude)


# ---------------------------------------------------------------- release
def _exp2(e, dtype):
    """``2^e`` for integer-valued ``e``, exactly."""
    return jnp.ldexp(jnp.ones((), dtype), jnp.asarray(e).astype(jnp.int32))


def _ceil_log2(x, dtype):
    """Smallest integer ``e`` with ``2^e >= x`` (``x > 0``), robust to log2 rounding."""
    e = jnp.ceil(jnp.log2(x))
    return jnp.where(_exp2(e, dtype) < x, e + 1, e)


def noise_quantum(sigma, dtype):
    """Smallest grid step on which noise of scale ``sigma`` (``|N| <= 9.1``) is an
    exact double-word integer: ``2^(ceil(log2 sigma) - (2p - HEADROOM - 5))``."""
    dtype = jnp.dtype(dtype).type
    room = 2 * significand_bits(dtype) - HEADROOM - 5
    return _exp2(_ceil_log2(jnp.maximum(sigma, jnp.finfo(dtype).tiny), dtype) - room, dtype)


def grid_quantum(magnitude_bound, sigma, dtype):
    """Step ``q`` of the grid a statistic is rounded to (a power of two).

    Small enough that rounding costs nothing measurable, large enough that the
    statistic (``|S| <= magnitude_bound``) and the noise are exact integers in
    double-word arithmetic: the larger of ``2^(ceil(log2 B) - (2p - HEADROOM))``
    and :func:`noise_quantum`.
    """
    dtype = jnp.dtype(dtype).type
    room = 2 * significand_bits(dtype) - HEADROOM
    bound = jnp.maximum(magnitude_bound, jnp.finfo(dtype).tiny)
    return jnp.maximum(_exp2(_ceil_log2(bound, dtype) - room, dtype), noise_quantum(sigma, dtype))


def grid_release(key, hi, lo, scale, quantum, noise: str = "gaussian") -> jax.Array:
    """``hi + lo`` plus noise of ``scale``, on the grid ``quantum`` (see module docstring).

    Parameters
    ----------
    key : jax.random key
        A *secret* key (:func:`numpyro_dp.primitives.secret.noise_key`).
    hi, lo : array
        The statistic as a double-word pair; it is rounded to ``quantum``, which
        changes it by at most ``quantum / 2`` per coordinate (the caller charges
        that in the sensitivity, see :func:`grid_sensitivity`).
    scale : float
        Noise standard deviation (Gaussian) or scale ``b`` (Laplace); 0 gives
        the statistic rounded to the grid.
    quantum : float
        ``grid_quantum(magnitude_bound, scale, dtype)``.
    noise : {"gaussian", "laplace"}

    Returns
    -------
    array
        The release, rounded to the working precision (post-processing).
    """
    hi = jnp.asarray(hi)
    dtype = hi.dtype.type
    sampler = fine_normal if noise == "gaussian" else fine_laplace
    draw = sampler(key, hi.shape, dtype)
    stat_hi, stat_lo = dw_round(hi / quantum, lo / quantum)  # exact scaling by 2^-e
    noise_units = jnp.round(draw * (scale / quantum))
    v_hi, v_lo = dw_add(stat_hi, stat_lo, noise_units, jnp.zeros_like(noise_units))
    # Output cell g = quantum 2^j with g <= scale 2^-GRID_BITS (j >= 0).
    ratio = jnp.maximum(scale / quantum, 1.0)
    j = jnp.maximum(jnp.floor(jnp.log2(ratio)) - GRID_BITS, 0.0)
    cell = _exp2(j, dtype)
    r_hi, r_lo = dw_round(v_hi / cell, v_lo / cell)
    # An audit's tap sees the release here (primitives.tap); otherwise a no-op.
    return grid_gate(key, (r_hi + r_lo) * (cell * quantum), scale, noise, stat_hi, stat_lo,
                     quantum)


def grid_sensitivity(quantum, dim: int, norm: str = "l2"):
    """What rounding to the grid adds to a sensitivity: ``q`` per coordinate, both sets."""
    return quantum * (math.sqrt(dim) if norm == "l2" else dim)


def as_numpy_float64(x) -> np.ndarray:
    """A host copy in float64 (releases computed in x64 mode)."""
    return np.asarray(x, np.float64)
