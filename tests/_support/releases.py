"""Watching a kernel's Gaussian releases at run time."""

import functools

import jax
import jax.numpy as jnp

import numpyro_dp.primitives.release as gate


def patch_releases(monkeypatch, release):
    """Route every Gaussian release of the full-data kernels through ``release``.

    ``grid_release(key, hi, lo, sigma, quantum)`` adds the noise of every
    release, at the release gate (:mod:`numpyro_dp.primitives.release`).
    """
    monkeypatch.setattr(gate, "grid_release", release)


def counting_release(monkeypatch):
    """Patch grid_release to log (kind, sigma) at run time; kind 0 = LLR, 1 = gradient.

    sigma is in units of the released sum (before the temperature multiplies it).
    """
    log = []
    original = gate.grid_release

    def record(kind, sigma):
        log.append((kind, float(sigma)))

    def release(key, hi, lo, sigma, quantum, noise="gaussian"):
        jax.debug.callback(functools.partial(record, jnp.ndim(hi)), sigma, ordered=True)
        return original(key, hi, lo, sigma, quantum, noise)

    patch_releases(monkeypatch, release)
    return log
