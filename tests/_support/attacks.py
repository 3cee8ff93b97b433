"""The floating-point attacker of the release tests (Mironov 2012)."""

import numpy as np


def float32_noise(release, truth, scale) -> bool:
    """The floating-point attacker's test (Mironov 2012): is every coordinate of
    ``release - truth`` a float32 number, or ``scale`` times one (to 2^-12 of its
    spacing)?  It holds for the true value when ``release = truth + scale * noise``
    is computed in float64 from float32 noise (or from a float32 product)."""
    diff = np.asarray(release, np.float64) - np.asarray(truth, np.float64)

    def is_float32(v):
        v32 = v.astype(np.float32)
        return np.abs(v - v32) <= 2.0**-12 * np.spacing(np.abs(v32))

    return bool(np.all(is_float32(diff / scale) | is_float32(diff)))


def attack_success(releases, truth, truth_neighbour) -> float:
    """How often the attacker attributes a release on D to D rather than its neighbour.

    ``releases``: ``(value, scale)`` pairs released on D; ``truth`` and
    ``truth_neighbour``: the statistic on D and on D'.  The attacker guesses D when
    :func:`float32_noise` holds for D only, D' when for D' only, and counts as right
    half the time otherwise (so 0.5 is chance).
    """
    score = 0.0
    for value, scale in releases:
        on_d = float32_noise(value, truth, scale)
        on_neighbour = float32_noise(value, truth_neighbour, scale)
        score += 0.5 if on_d == on_neighbour else float(on_d)
    return score / len(releases)


def on_coarse_grid(value, scale) -> bool:
    """Is every coordinate of ``value`` a multiple of the power of two just below scale / 2^9?"""
    cell = 2.0 ** (np.floor(np.log2(scale)) - 9)
    units = np.asarray(value, np.float64) / cell
    return bool(np.all(units == np.round(units)))
