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


class Made(list):
    """Releases recorded at run time; ``len`` waits for pending callbacks first."""

    def __len__(self):
        jax.effects_barrier()  # callbacks run asynchronously (pmap in particular)
        return super().__len__()


def count_made_releases(monkeypatch) -> Made:
    """Count every release made at run time, once per chain under vmap, at both gates:
    the release gate's ``grid_release`` and DP Barker's ``barker_decision``."""
    from numpyro_dp.kernels import barker

    made = Made()

    def counted(release_fn):
        @functools.wraps(release_fn)
        def wrapper(key, *args, **kwargs):
            # The (secret, per-chain) key is batched under vmap: one call per chain.
            jax.debug.callback(lambda _: made.append(1), jax.random.key_data(key))
            return release_fn(key, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(gate, "grid_release", counted(gate.grid_release))
    monkeypatch.setattr(barker, "barker_decision", counted(barker.barker_decision))
    return made
