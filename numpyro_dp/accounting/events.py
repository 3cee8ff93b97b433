"""What a run released, read off its ``DpEvent``: one walker and its views.

Kernels declare their cost as dp-accounting events; everything the library
asks of an event (how many releases, which noise multipliers, which
accountant can interpret it, the event in dp-accounting's own noise
convention) is a view of :func:`releases`, the single walk of the event tree.
"""

from __future__ import annotations

import math

import dp_accounting as dpa

from numpyro_dp.accounting.budget import check_neighbourhood

#: Events whose cost does not depend on the neighbourhood in our convention
#: and that compose with plain Gaussians in one PLD (one-shot releases).
PURE_LEAVES = (dpa.GaussianDpEvent, dpa.LaplaceDpEvent, dpa.RandomizedResponseDpEvent)


def releases(event: dpa.DpEvent) -> list[tuple[dpa.DpEvent, int]]:
    """``[(mechanism, times), ...]`` released by ``event``, in composition order.

    Compositions (``ComposedDpEvent``, ``SelfComposedDpEvent``) are
    flattened, multiplying counts; ``NoOpDpEvent`` and anything composed zero
    times release nothing and are left out.  Every other event is one
    mechanism (a subsampled Gaussian is one, with its sampling inside).
    """
    if isinstance(event, dpa.NoOpDpEvent):
        return []
    if isinstance(event, dpa.SelfComposedDpEvent):
        if event.count == 0:
            return []
        return [(leaf, times * event.count) for leaf, times in releases(event.event)]
    if isinstance(event, dpa.ComposedDpEvent):
        return [pair for e in event.events for pair in releases(e)]
    return [(event, 1)]


def gaussian_releases(event: dpa.DpEvent) -> list[tuple[float, int]] | None:
    """``[(z, count), ...]`` if ``event`` composes only plain Gaussian releases.

    Returns ``None`` for any other event (subsampled, Laplace, ...).
    """
    out = releases(event)
    if not all(isinstance(leaf, dpa.GaussianDpEvent) for leaf, _ in out):
        return None
    return [(float(leaf.noise_multiplier), times) for leaf, times in out]


def gaussian_mu(event: dpa.DpEvent) -> float | None:
    """mu of the single Gaussian equivalent to ``event`` (tight), or None."""
    out = gaussian_releases(event)
    if out is None:
        return None
    if any(z == 0 for z, _ in out):
        return math.inf
    return math.sqrt(sum(times / z**2 for z, times in out))


def count_releases(event: dpa.DpEvent) -> int:
    """Number of mechanism releases (mechanisms times their composition counts)."""
    return sum(times for _, times in releases(event))


def _base(leaf: dpa.DpEvent) -> dpa.DpEvent:
    """The mechanism inside a subsampled event."""
    while isinstance(leaf, (dpa.PoissonSampledDpEvent, dpa.SampledWithoutReplacementDpEvent)):
        leaf = leaf.event
    return leaf


def noise_multipliers(event: dpa.DpEvent) -> tuple[float, ...]:
    """Distinct noise multipliers of the mechanisms in ``event``, sorted."""
    return tuple(sorted({
        float(_base(leaf).noise_multiplier) for leaf, _ in releases(event)
        if hasattr(_base(leaf), "noise_multiplier")
    }))


def pure_releases(event: dpa.DpEvent) -> list[tuple[dpa.DpEvent, int]] | None:
    """``[(leaf, count), ...]`` if ``event`` composes only plain Gaussian,
    Laplace and randomized-response releases, at least one of them not
    Gaussian (one-shot releases of :mod:`numpyro_dp.releases.mechanisms`); else None.
    """
    out = releases(event)
    if not all(isinstance(leaf, PURE_LEAVES) for leaf, _ in out):
        return None
    if all(isinstance(leaf, dpa.GaussianDpEvent) for leaf, _ in out):
        return None
    return out


def subsampled_releases(event: dpa.DpEvent) -> list[tuple[dpa.DpEvent, int]] | None:
    """``releases(event)`` if they are all Poisson- or truncated-subsampled
    Gaussians with positive noise and rates; otherwise None."""
    out = releases(event)
    for leaf, _ in out:
        poisson = (isinstance(leaf, dpa.PoissonSampledDpEvent)
                   and isinstance(leaf.event, dpa.GaussianDpEvent)
                   and leaf.sampling_probability > 0 and leaf.event.noise_multiplier > 0)
        truncated = (isinstance(leaf, dpa.TruncatedSubsampledGaussianDpEvent)
                     and leaf.sampling_probability > 0 and leaf.truncated_batch_size > 0
                     and leaf.dataset_size > 0 and leaf.noise_multiplier > 0)
        if not (poisson or truncated):
            return None
    return out


def has_randomized_response(event: dpa.DpEvent) -> bool:
    return any(isinstance(leaf, dpa.RandomizedResponseDpEvent) for leaf, _ in releases(event))


def compose(pairs: list[tuple[dpa.DpEvent, int]]) -> dpa.DpEvent:
    """The event of ``releases`` (the inverse of :func:`releases`, up to structure)."""
    parts = [leaf if times == 1 else dpa.SelfComposedDpEvent(leaf, times) for leaf, times in pairs]
    if not parts:
        return dpa.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dpa.ComposedDpEvent(parts)


def to_dp_accounting(event: dpa.DpEvent, neighbourhood: str) -> dpa.DpEvent:
    """``event`` in dp-accounting's noise convention for ``neighbourhood``.

    Our subsampled Gaussians carry ``z = sigma / Delta`` with ``Delta`` the
    sensitivity under the neighbourhood (``2 c`` for ``"substitute"``);
    dp-accounting's PLD measures their noise in units of the clip ``c`` for
    either relation (its REPLACE_ONE puts the two rows at ``-c`` and ``+c``).
    So under ``"substitute"`` Poisson-sampled and truncated-subsampled
    Gaussians are handed over with ``2 z``; every other event is unchanged.
    """
    if check_neighbourhood(neighbourhood) == "add_remove":
        return event
    return compose([(_doubled(leaf), times) for leaf, times in releases(event)])


def _doubled(leaf: dpa.DpEvent) -> dpa.DpEvent:
    if isinstance(leaf, dpa.PoissonSampledDpEvent) and isinstance(leaf.event, dpa.GaussianDpEvent):
        return dpa.PoissonSampledDpEvent(
            leaf.sampling_probability, dpa.GaussianDpEvent(2.0 * leaf.event.noise_multiplier)
        )
    if isinstance(leaf, dpa.TruncatedSubsampledGaussianDpEvent):
        return dpa.TruncatedSubsampledGaussianDpEvent(
            leaf.dataset_size, leaf.sampling_probability, leaf.truncated_batch_size,
            2.0 * leaf.noise_multiplier,
        )
    return leaf
