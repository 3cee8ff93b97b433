"""Bugs injected on purpose (:func:`fault`), to check that an audit has the power to see them.

A fault replaces a function by identity wherever a ``numpyro_dp`` module
binds it (or, for ``"chain_not_charged"``, hooks the runner's charge), and
undoes it when its ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator

import jax.numpy as jnp

from numpyro_dp.kernels import hmc, penalty, ratios, sg_dynamics
from numpyro_dp.primitives import clipping, release

FAULTS = ("noise_halved", "canary_unclipped", "chain_not_charged", "kernel_noise_divided")


@contextlib.contextmanager
def fault(name: str, *, divisor: float = 3.0) -> Iterator[None]:
    """Break the library on purpose inside a ``with`` block, to check an audit's power.

    * ``"noise_halved"``: every Gaussian release draws half the noise that its
      accountant charges;
    * ``"canary_unclipped"``: the most extreme row of every clipped sum (the
      canary, wherever a minibatch puts it) escapes the clip, gradients and
      log-likelihood ratios alike;
    * ``"chain_not_charged"``: the runner charges one chain fewer than it runs;
    * ``"kernel_noise_divided"``: every kernel passes its Gaussian releases the
      noise multiplier it was charged for divided by ``divisor`` (the
      stochastic-gradient kernels, their noise ``sigma``): a fault between the
      charge and the noise gate.

    An audit that does not report a violation under a fault cannot vouch for
    the unbroken code either.  Never use it outside an audit: the runs inside
    the block are not private.
    """
    from numpyro_dp.runner import charging  # the runner sits above this module's users

    if name not in FAULTS:
        raise ValueError(f"fault={name!r}; use one of {FAULTS}.")
    if divisor != 3.0 and name != "kernel_noise_divided":
        raise ValueError(f"divisor= applies to 'kernel_noise_divided' only, not {name!r}.")
    hook = contextlib.nullcontext()
    # Every binding of the original, wherever a module imported it by name.
    owners = [m for n, m in list(sys.modules.items()) if n.startswith("numpyro_dp")]
    if name == "noise_halved":
        grid_release = release.grid_release
        replacements = {grid_release: lambda key, hi, lo, scale, *a, **k: grid_release(
            key, hi, lo, scale / 2, *a, **k)}
    elif name == "canary_unclipped":
        weights, clip_ratios = clipping.clip_weights, ratios.clip_ratios

        def extreme(values):  # the canary: the row furthest out, wherever a batch put it
            return jnp.arange(values.shape[0]) == jnp.argmax(jnp.abs(values))

        replacements = {
            weights: lambda norms, clip: jnp.where(extreme(norms), 1.0, weights(norms, clip)),
            clip_ratios: lambda r, clip: jnp.where(extreme(r), r, clip_ratios(r, clip)),
        }
    elif name == "chain_not_charged":  # the runner's hook, no function replaced
        hook = charging.rewriting_entries(lambda charged: dataclasses.replace(
            charged, num_chains=max(1, charged.num_chains - 1)))
        replacements, owners = {}, []
    else:
        replacements = {made: _divided_noise(made, divisor) for made in (
            release.release_clipped_sum, ratios.release_llr, penalty.release_batch_sums)}
        sum_with_noise = release.release_sum_with_noise
        replacements[sum_with_noise] = lambda key, total, num_terms, row_bound, sigma: (
            sum_with_noise(key, total, num_terms, row_bound, sigma / divisor))
        # The kernels' bindings only: ratios' own release_llr calls release_clipped_sum.
        owners = [penalty, hmc, sg_dynamics]
    saved = [(owner, attr, value) for owner in owners for attr, value in vars(owner).items()
             if any(value is original for original in replacements)]
    try:
        for owner, attr, original in saved:
            setattr(owner, attr, replacements[original])
        with hook:
            yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def _divided_noise(release: Callable, divisor: float) -> Callable:
    """``release`` called with ``noise_multiplier / divisor``."""

    def divided(*args, noise_multiplier, **kwargs):
        return release(*args, noise_multiplier=noise_multiplier / divisor, **kwargs)

    return divided
