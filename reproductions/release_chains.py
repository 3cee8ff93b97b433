"""One chain per release, vectorised: the simulation studies of paper 002, chapter 6.

Each study draws many data sets at a true theta*, releases each with noise and
infers theta from every release alone.  ``numpyro.infer.MCMC`` runs chains on
one data set, so :class:`BatchedChains` calls a release kernel's own NumPyro
interface (``init``, ``sample``, ``postprocess_fn`` of ``ndp.MH``,
``ndp.PMMH`` or ``ndp.MHAAR``) under ``jax.vmap`` over the releases and a
``lax.scan`` over the iterations, compiled once per shape: a thousand
independent posteriors cost about as much as one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class BatchedChains:
    """One chain of ``kernel`` per release, each with its release as model arguments.

    Parameters
    ----------
    kernel : ndp.MH, ndp.PMMH or ndp.MHAAR
    num_warmup, num_samples : int
    site : str
        The parameter whose draws are returned (constrained).
    thin : int
        Keep every ``thin``-th post-warm-up draw.

    Calling it with ``(seed, z0, *args)`` (``z0`` the chains' unconstrained
    starts, one per release; each of ``args`` batched over the releases)
    returns the draws ``(releases, num_samples // thin)`` in float64 and each
    chain's mean acceptance over its run.
    """

    #: XLA options of every compilation (a ``--quick`` run sets the backend's
    #: optimisation to 0: half the compile time, for runs too short to matter).
    compiler_options: dict | None = None

    def __init__(self, kernel, num_warmup: int, num_samples: int, site: str = "theta",
                 thin: int = 1):
        self.kernel, self.num_warmup, self.num_samples = kernel, num_warmup, num_samples
        self.site, self.thin = site, thin
        self._run = jax.jit(jax.vmap(self._chain), compiler_options=self.compiler_options)

    def _chain(self, key, z0, args):
        kernel, warmup = self.kernel, self.num_warmup
        state = kernel.init(key, warmup, {self.site: z0}, args, {})
        constrain = kernel.postprocess_fn(args, {})

        def step(state, _):
            state = kernel.sample(state, args, {})
            return state, constrain(state.z)[self.site]

        state, draws = jax.lax.scan(step, state, None, length=warmup + self.num_samples)
        return draws[warmup:][:: self.thin], state.mean_accept_prob

    def __call__(self, seed: int, z0, *args) -> tuple[np.ndarray, np.ndarray]:
        keys = jax.random.split(jax.random.PRNGKey(seed), len(z0))
        draws, accept = self._run(keys, jnp.asarray(z0), tuple(jnp.asarray(a) for a in args))
        return np.asarray(draws, np.float64), np.asarray(accept, np.float64)
