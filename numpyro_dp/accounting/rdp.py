"""Renyi-DP accounting for fixed-size batches drawn without replacement.

The minibatch kernels (``DPBarker``, ``DPPenalty(batch_size=b)``) release, at
every iteration, a mechanism applied to a batch of ``b`` of the ``n`` rows
drawn uniformly without replacement.  Their cost is declared as
``dpa.SampledWithoutReplacementDpEvent(n, b, base)`` with ``base`` either a
``dpa.GaussianDpEvent(z)`` (RDP ``a / (2 z^2)``) or a :class:`BarkerDpEvent`
(the per-step curve of Heikkilä et al. 2019, which is not a Gaussian mechanism and so has
no built-in dp-accounting event).

This module turns such events into an RDP curve on integer orders:

* a base curve ``eps'(a)`` per mechanism (``inf`` at orders where its bound
  does not hold: DP Barker needs ``2 <= a < b / 5``);
* the amplification of Wang, Balle & Kasiviswanathan (2019, Thm 9) for
  sampling without replacement with ``q = b / n``, valid for integer orders
  and the substitute (replace-one) neighbourhood; it needs ``eps'(j)`` at every
  ``j <= a``, so an order above the base's range stays ``inf``;
* composition by summing curves;
* conversion with dp-accounting's ``compute_epsilon`` over the finite orders
  only.

The generic WBK bound is used for the Gaussian too (dp-accounting's
``SampledWithoutReplacementDpEvent`` uses a Gaussian-specific refinement of it,
Thm 27, which is never larger: the tests check that ours is the same or above).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.special import gammaln, logsumexp

from numpyro_dp.accounting.events import releases

#: Integer RDP orders 2..512 (WBK needs every integer order up to the one evaluated).
ORDERS = np.arange(2, 513, dtype=float)


@dataclasses.dataclass(frozen=True)
class BarkerDpEvent(dpa.DpEvent):
    """One DP Barker acceptance test on a batch of ``batch_size`` rows (Heikkilä et al. 2019).

    The cost of the test itself, before amplification by subsampling: wrap it
    in ``dpa.SampledWithoutReplacementDpEvent(n, batch_size, ...)``.
    """

    batch_size: int


def barker_rdp(batch_size: int, orders: np.ndarray = ORDERS) -> np.ndarray:
    """Per-step RDP of the DP Barker test (Heikkilä et al. 2019); ``inf`` outside 2 <= a < b/5.

    eps'(a) = 5/(2b) + ln(2b / (b - 5a)) / (2(a - 1)) + 2a / (b - 5a).
    """
    b = float(batch_size)
    a = np.asarray(orders, float)
    valid = (a >= 2) & (5 * a < b)
    a_ok = np.where(valid, a, 2.0)
    gap = np.where(valid, b - 5 * a_ok, 1.0)
    eps = 5 / (2 * b) + np.log(2 * b / gap) / (2 * (a_ok - 1)) + 2 * a_ok / gap
    return np.where(valid, eps, np.inf)


def gaussian_rdp(noise_multiplier: float, orders: np.ndarray = ORDERS) -> np.ndarray:
    """RDP a / (2 z^2) of a Gaussian release with noise multiplier z."""
    return np.asarray(orders, float) / (2.0 * noise_multiplier**2)


def wbk_amplify(base: np.ndarray, q: float, orders: np.ndarray = ORDERS) -> np.ndarray:
    """RDP of the mechanism with base curve ``base`` on a without-replacement sample.

    Wang, Balle & Kasiviswanathan (2019, Thm 9), for integer orders a >= 2:
    eps(a) = ln(1 + q^2 C(a,2) min{4(e^{eps'(2)} - 1), 2 e^{eps'(2)}}
                 + 2 sum_{j=3}^a q^j C(a,j) e^{(j-1) eps'(j)}) / (a - 1).
    ``orders`` must be the integers 2, 3, ..., A (the bound at ``a`` needs
    eps'(j) at every ``j <= a``); ``base`` gives eps' there.  The result is
    capped at ``base`` itself: running the mechanism on a subsample is never
    less private than on the full data (neighbouring data sets give batches
    that differ in at most one row), while the bound is loose for q near 1.
    """
    orders = np.asarray(orders, float)
    base = np.asarray(base, float)
    if not 0 < q <= 1:
        raise ValueError(f"sampling fraction q={q} must lie in (0, 1]")
    if not np.array_equal(orders, np.arange(2, len(orders) + 2)):
        raise ValueError("WBK amplification needs the integer orders 2, 3, ..., A")
    if q == 1:
        return base.copy()
    e2 = base[0]
    # log min{4 (e^{e2} - 1), 2 e^{e2}}, stable for small and large e2
    log_m2 = min(math.log(4) + e2 + math.log(-math.expm1(-e2)), math.log(2) + e2)
    a = orders[:, None]
    j = orders[None, 1:]  # 3..A
    with np.errstate(invalid="ignore"):  # inf * 0 never occurs: masked below
        terms = math.log(2) + j * math.log(q) + _log_comb(a, j) + (j - 1) * base[None, 1:]
    terms = np.where(j <= a, terms, -np.inf)
    first = 2 * math.log(q) + _log_comb(orders, 2) + log_m2
    log_sum = logsumexp(np.concatenate([first[:, None], terms], axis=1), axis=1)
    return np.minimum(np.logaddexp(0.0, log_sum) / (orders - 1), base)


def _log_comb(n: int, k) -> np.ndarray:
    return gammaln(n + 1) - gammaln(np.asarray(k) + 1) - gammaln(n - np.asarray(k) + 1)


# ----------------------------------------------------------------- events
def is_rdp_only(event: dpa.DpEvent) -> bool:
    """Whether ``event`` contains a release that only this module can account."""
    return any(isinstance(leaf, (BarkerDpEvent, dpa.SampledWithoutReplacementDpEvent))
               for leaf, _ in releases(event))


def _leaf_curve(leaf: dpa.DpEvent, orders: np.ndarray) -> np.ndarray:
    if isinstance(leaf, dpa.GaussianDpEvent):
        if leaf.noise_multiplier == 0:
            return np.full(len(orders), np.inf)
        return gaussian_rdp(leaf.noise_multiplier, orders)
    if isinstance(leaf, BarkerDpEvent):
        return barker_rdp(leaf.batch_size, orders)
    if isinstance(leaf, dpa.SampledWithoutReplacementDpEvent):
        if orders is ORDERS and isinstance(leaf.event, (dpa.GaussianDpEvent, BarkerDpEvent)):
            return _amplified_curve(leaf)
        q = leaf.sample_size / leaf.source_dataset_size
        return wbk_amplify(rdp_curve(leaf.event, orders), q, orders)
    raise ValueError(
        f"The RDP accountant for minibatch kernels cannot interpret {type(leaf).__name__}; "
        "it handles Gaussian, DP Barker and without-replacement sampled events."
    )


#: WBK curves kept (4 KiB each at :data:`ORDERS`): more than one batch-size search
#: visits (:func:`~numpyro_dp.kernels.barker.barker_max_batch_size`: a 60-point grid,
#: then bisection), so a plan followed by the same search, or a budget check, finds
#: every curve computed (with 64 a second pass over 81 batch sizes missed every time).
AMPLIFIED_CURVES = 1024


@functools.lru_cache(maxsize=AMPLIFIED_CURVES)
def _amplified_curve(leaf: dpa.SampledWithoutReplacementDpEvent) -> np.ndarray:
    """The WBK curve of ``leaf`` at :data:`ORDERS`, computed once (read-only): a budget
    check or a plan asks for the same iteration at many counts, and dp-accounting's
    ``compose`` asks twice for each event (``supports``, then the composition).  The
    key is the event: public sizes and the base mechanism's parameters, no data."""
    q = leaf.sample_size / leaf.source_dataset_size
    curve = wbk_amplify(rdp_curve(leaf.event, ORDERS), q, ORDERS)
    curve.flags.writeable = False
    return curve


def rdp_curve(event: dpa.DpEvent, orders: np.ndarray = ORDERS) -> np.ndarray:
    """RDP of ``event`` at ``orders`` (substitute neighbourhood)."""
    return sum((times * _leaf_curve(leaf, orders) for leaf, times in releases(event)),
               np.zeros(len(orders)))


def curve_epsilon(rdp: np.ndarray, delta: float, orders: np.ndarray = ORDERS) -> float:
    """Epsilon (rounded up) of the RDP curve ``rdp`` at ``delta``, over its finite orders."""
    finite = np.isfinite(rdp)
    if not finite.any():
        return math.inf
    eps, _ = rdp_privacy_accountant.compute_epsilon(orders[finite], rdp[finite], delta)
    # Round up by more than the floating-point error of the sums above.
    return math.nextafter(float(eps) * (1 + 1e-12), math.inf)


def rdp_epsilon(event: dpa.DpEvent, delta: float, orders: np.ndarray = ORDERS) -> float:
    """Epsilon (rounded up) of ``event`` at ``delta``, over the finite orders only."""
    return curve_epsilon(rdp_curve(event, orders), delta, orders)


class WbkRdpAccountant(dpa.PrivacyAccountant):
    """RDP accountant of the minibatch kernels, as a dp-accounting accountant.

    Interprets plain Gaussians, :class:`BarkerDpEvent` and
    ``SampledWithoutReplacementDpEvent`` of either (WBK amplification), under
    the substitute neighbourhood only (``REPLACE_ONE``: n is public).
    """

    def __init__(self, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE,
                 orders: np.ndarray = ORDERS):
        super().__init__(neighboring_relation)
        self._orders = orders
        self._rdp = np.zeros(len(orders))

    def _maybe_compose(self, event, count, do_compose):
        if self.neighboring_relation is not dpa.NeighboringRelation.REPLACE_ONE:
            return self.CompositionErrorDetails(
                event, "fixed-size batches drawn without replacement are accounted "
                "under the substitute neighbourhood (REPLACE_ONE) only")
        try:
            curve = rdp_curve(event, self._orders)
        except ValueError as err:
            return self.CompositionErrorDetails(event, str(err))
        if do_compose and count:
            self._rdp = self._rdp + count * curve
        return None

    def get_epsilon(self, target_delta: float) -> float:
        return curve_epsilon(self._rdp, target_delta, self._orders)
