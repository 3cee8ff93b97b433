"""A tap on the release gates, for :func:`numpyro_dp.audit.audit_kernel` (a white-box audit).

Every release a kernel or the tuning makes leaves through one of two gates:
the Gaussian releases through :func:`~numpyro_dp.primitives.rounding.grid_release`,
DP Barker's accept decisions through :func:`~numpyro_dp.kernels.barker.barker_decision`.
Each gate hands its release to :func:`grid_gate` or :func:`barker_gate` and
returns what they return.

Outside an audit they return the release itself and add nothing to the traced
program: a normal run compiles the same program as without this module, and
shares it (:mod:`numpyro_dp.primitives.compiled`) as before.  Inside
``with tapped(tap):`` every release calls back into Python (``io_callback``,
once per chain under ``vmap``) with its secret noise key, what the gate
computed before the noise, and the noise scale it drew, and the callback's
return value *is* the release.  A recording tap returns the release unchanged;
a replaying tap returns the release recorded at the same noise key by an
earlier run, so that a run on a neighbouring data set (with the same public
keys and secret) follows the recorded run's path exactly, while the tap
records the neighbour's own values before the noise at every state of it.

Why the tap can be neither missed nor leaked into a normal run: whether a gate
is tapped is decided while it is traced, from :data:`_ACTIVE`, a
``jax.make_user_context`` whose value is part of every ``jax.jit`` cache key.
A function that some caller jitted and traced outside the block is traced
again inside it (``GridPlan.release`` jits ``grid_release``, say), and one
traced inside is traced again after it; and
:func:`~numpyro_dp.primitives.compiled.compile_once` never shares a program
that calls back into Python.

The records hold private values (the statistics before the noise): a tap is
for audits on data the auditor made up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

#: The tap of the enclosing :func:`tapped` block (None: none); part of every jit cache key.
_ACTIVE = jax.make_user_context(default_value=None)


@dataclasses.dataclass(frozen=True)
class Release:
    """One release, as a gate made it.

    Attributes
    ----------
    gate : str
        ``"gaussian"`` or ``"laplace"`` (``grid_release``'s noise), or ``"barker"``.
    statistic : np.ndarray
        What the noise was added to (float64): ``grid_release``'s statistic on
        its grid; DP Barker's ``(lambda, sigma_b^2)``.
    scale : float
        The noise scale drawn: ``grid_release``'s standard deviation (or Laplace
        scale); for DP Barker, the standard deviation of its Gaussian part.
    value : np.ndarray
        The release.
    """

    gate: str
    statistic: np.ndarray
    scale: float
    value: np.ndarray


class Tap:
    """The releases of the runs inside a :func:`tapped` block, by noise key.

    Parameters
    ----------
    replay : Tap, optional
        A tap that recorded an earlier run: each release then returns that
        run's release at the same noise key (when it has one).

    Attributes
    ----------
    releases : dict
        ``{noise key (bytes): Release}`` of every release made.
    reused : list of bytes
        Noise keys that served more than one release (their noise was the same).
    unmatched : list of bytes
        In replay: noise keys the replayed run made no release with (this run left its path).
    """

    def __init__(self, replay: Tap | None = None):
        self.releases: dict[bytes, Release] = {}
        self.reused: list[bytes] = []
        self.unmatched: list[bytes] = []
        self._replay = replay
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Releases made (a reused key's counted each time)."""
        return len(self.releases) + len(self.reused)

    def _observe(self, key: bytes, release: Release) -> np.ndarray:
        with self._lock:
            if key in self.releases:
                self.reused.append(key)
            self.releases[key] = release
            if self._replay is None:
                return release.value
            recorded = self._replay.releases.get(key)
            if recorded is None:
                self.unmatched.append(key)
                return release.value
            return recorded.value


@contextlib.contextmanager
def tapped(tap: Tap) -> Iterator[Tap]:
    """Route every release traced inside the block through ``tap``."""
    with _ACTIVE(tap):
        yield tap


def _key_words(key: jax.Array) -> jax.Array:
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def _through(tap: Tap, gate: str, key, value, scale, statistic, parts) -> jax.Array:
    """``value`` as ``tap`` returns it; ``statistic(*parts)`` gives the host's float64 statistic."""

    def observe(words, scale, value, *parts):
        value = np.asarray(value)
        out = tap._observe(np.asarray(words).tobytes(),
                           Release(gate, statistic(*parts), float(scale), value))
        return np.asarray(out, value.dtype)

    shape = jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value))
    return io_callback(observe, shape, _key_words(key), scale, value, *parts, ordered=False)


def grid_gate(key, value, scale, noise: str, stat_hi, stat_lo, quantum) -> jax.Array:
    """``grid_release``'s ``value``, tapped inside a :func:`tapped` block.

    The statistic before the noise is ``quantum (stat_hi + stat_lo)`` (on the
    release's grid); ``scale`` is the noise scale drawn.
    """
    tap = _ACTIVE.value
    if tap is None:
        return value

    def statistic(hi, lo, q):
        return (np.asarray(hi, np.float64) + np.asarray(lo, np.float64)) * np.float64(q)

    return _through(tap, noise, key, value, scale, statistic, (stat_hi, stat_lo, quantum))


def barker_gate(key, accepted, scale, lam, var_b) -> jax.Array:
    """DP Barker's decision ``accepted``, tapped inside a :func:`tapped` block
    (``lam`` and ``var_b`` its statistic, ``scale`` its Gaussian noise's sd)."""
    tap = _ACTIVE.value
    if tap is None:
        return accepted

    def statistic(lam, var_b):
        return np.array([lam, var_b], np.float64)

    return _through(tap, "barker", key, accepted, scale, statistic, (lam, var_b))
