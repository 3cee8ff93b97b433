"""Secret noise: no published key may determine a release's noise.

The PRNG key a user passes to ``PrivateMCMC.run`` or to a mechanism is public
(notebooks print ``PRNGKey(0)``), and so is every key that NumPyro keeps in a
kernel's state.  If the noise of a release were a function of those keys,
anyone holding them could regenerate the noise and subtract it.  So:

* every run (and every one-shot release) draws a fresh 64-bit *run secret*
  from the operating system's CSPRNG (``os.urandom``);
* the key of each noise draw is a pseudo-random function of the secret,
  evaluated at the public per-iteration key (:func:`noise_key`): the public key
  still makes the draws of one run distinct, the secret makes them unknown;
* the secret is passed to the compiled sampler as an *argument* (never a
  constant, which JAX's persistent compilation cache would write to disk) and
  is never stored in a state, output, log, warning or ledger.

What stays public: proposals, momenta, the uniform of an accept test and the
user's initial point may use the public keys, because the releases alone carry
the privacy guarantee.  Minibatch membership is *not* public (amplification
by subsampling assumes that nobody knows which rows were drawn), so batch
keys come from :func:`noise_key` too.

Reproducible noise (``reproducible_noise=True`` on the runner or a mechanism)
derives the secret from the user's key instead.  It exists for tests and
debugging only: anyone with the key can then remove the noise.  It warns on
every use (:class:`ReproducibleNoiseWarning`) and is recorded in the ledger.

Limits: JAX's threefry generator keyed by a 64-bit secret is not a
cryptographically secure generator; it stops anyone who knows the published
keys, not an adversary able to search 2^64 secrets.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.experimental import multihost_utils

__all__ = [
    "ReproducibleNoiseWarning",
    "draw_secret",
    "noise_key",
    "run_secret",
]


class ReproducibleNoiseWarning(UserWarning):
    """A release's noise is a function of a public key: for tests only, not private."""


def draw_secret() -> np.ndarray:
    """A fresh run secret: 64 bits from the operating system's CSPRNG, as ``uint32[2]``.

    With several processes (``jax.distributed``) process 0 draws it and sends it
    to the others, so that every host adds the same noise (a collective: every
    process calls this at the same point of the program).
    """
    secret = np.frombuffer(os.urandom(8), dtype=np.uint32).copy()
    if jax.process_count() > 1:
        secret = np.asarray(multihost_utils.broadcast_one_to_all(secret), np.uint32)
    return secret


def _public_words(key) -> np.ndarray:
    """The raw ``uint32`` words of a (batch of) public key(s)."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = random.key_data(key)
    return np.asarray(key, dtype=np.uint32)


def run_secret(rng_key, reproducible: bool = False, what: str = "this run") -> np.ndarray:
    """The secret of one run: from the OS CSPRNG, or (tests only) from ``rng_key``.

    Parameters
    ----------
    rng_key : jax.random key or batch of keys
        The user's public key.  Used only when ``reproducible``.
    reproducible : bool
        Derive the secret from ``rng_key`` (a hash of its words), so that the
        same key gives the same noise.  Warns: the noise is then public.
    what : str
        Named in the warning.
    """
    if not reproducible:
        return draw_secret()
    warnings.warn(
        f"reproducible_noise=True: the noise of {what} is a function of the public "
        "PRNG key, so anyone who knows the key can remove it. The result is NOT "
        "differentially private; use this for tests and debugging only.",
        ReproducibleNoiseWarning,
        stacklevel=3,
    )
    digest = hashlib.sha256(b"numpyro-dp reproducible noise" + _public_words(rng_key).tobytes())
    return np.frombuffer(digest.digest()[:8], dtype=np.uint32).copy()


def noise_key(secret: jax.Array, public_key: jax.Array) -> jax.Array:
    """The key of one noise draw: a PRF of the run secret at a public key (jit-able).

    ``threefry(secret, .)`` is folded over the words of ``public_key``, so the
    result depends on every bit of both, and without the secret it cannot be
    computed from the public key.
    """
    key = random.wrap_key_data(jnp.asarray(secret, jnp.uint32), impl="threefry2x32")
    words = public_key
    if jnp.issubdtype(words.dtype, jax.dtypes.prng_key):
        words = random.key_data(words)
    for word in jnp.ravel(words.astype(jnp.uint32)):
        key = random.fold_in(key, word)
    return key
