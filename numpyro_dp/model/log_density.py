"""A model's log-density at unconstrained parameters, split into its two parts.

* the prior term ``log p(theta)`` in NumPyro's unconstrained space, including
  the log-Jacobian of the transforms (:func:`constrained_trace`), and
* the per-row log-likelihoods ``l_i(theta)``: the log-probabilities of all
  observed sites and ``numpyro.factor`` sites inside the data plate, reduced
  over every dimension except the data-plate dimension (:func:`per_row`).

:func:`split_log_density` computes both from one run of the model;
:class:`~numpyro_dp.model.adapter.PrivateModel` runs it on one row at a time
so that ``l_i`` cannot read another row.  :func:`expected_log_prob` is the
expected-Hessian variant that Fisher scoring differentiates.  Every value
computed here is private: it is clipped and noised before it leaves a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.distributions.util import sum_rightmost

from numpyro_dp.model.tracing import in_plate


class LogDensityTerms(NamedTuple):
    """The two parts of the log-density at one point (private: never released)."""

    prior: jax.Array  # log p(theta) + log|J|, unconstrained space, data-free
    loglik_rows: jax.Array  # (n,) or (len(idx),) per-row log-likelihoods l_i


def constrained_trace(model: Callable, params: dict, model_args: tuple, model_kwargs: dict):
    """Run ``model`` at unconstrained ``params``; return trace and log-Jacobians."""
    log_dets = {}

    def constrain(site):
        name = site["name"]
        if site["type"] != "sample" or name not in params:
            return None
        u = params[name]
        t = biject_to(site["fn"].support)
        value = t(u)
        ld = t.log_abs_det_jacobian(u, value)
        ld = sum_rightmost(ld, jnp.ndim(ld) - jnp.ndim(value) + len(site["fn"].event_shape))
        if site["scale"] is not None:
            ld = site["scale"] * ld
        log_dets[name] = jnp.sum(ld)
        return value

    tr = handlers.trace(handlers.substitute(model, substitute_fn=constrain)).get_trace(
        *model_args, **model_kwargs
    )
    return tr, log_dets


def split_log_density(model: Callable, data_plate: str, plate_dim: int, params: dict,
                      model_args: tuple, model_kwargs: dict, expected: bool = False):
    """(prior, per-row log-likelihoods) of one run of the model (with
    ``expected``, the likelihood of :func:`expected_log_prob`)."""
    tr, log_dets = constrained_trace(model, params, model_args, model_kwargs)
    num_rows = plate_size(tr, data_plate)
    prior = sum(log_dets.values(), jnp.zeros(()))
    rows = jnp.zeros((num_rows,))
    for site in tr.values():
        if site["type"] != "sample":
            continue
        if not site["is_observed"]:
            prior = prior + jnp.sum(site_log_prob(site))
        elif in_plate(site, data_plate):
            lp = expected_log_prob(site) if expected else site_log_prob(site)
            rows = rows + per_row(lp, num_rows, plate_dim)
        else:  # a data-free factor outside the plate (checked at setup)
            prior = prior + jnp.sum(site_log_prob(site))
    return prior, rows


def plate_size(trace: dict, data_plate: str) -> int:
    """The size of the plate ``data_plate`` in ``trace``."""
    return trace[data_plate]["args"][0]


def per_row(log_prob: jax.Array, num_rows: int, dim: int) -> jax.Array:
    """Sum a site's log-prob over every dimension but the data-plate one (``dim``)."""
    missing = max(0, -dim - jnp.ndim(log_prob))
    log_prob = jnp.reshape(log_prob, (1,) * missing + jnp.shape(log_prob))
    log_prob = jnp.moveaxis(log_prob, dim, 0)
    log_prob = jnp.broadcast_to(log_prob, (num_rows,) + log_prob.shape[1:])
    return jnp.reshape(log_prob, (num_rows, -1)).sum(-1)


def site_log_prob(site: dict) -> jax.Array:
    """A sample site's log-probability at its value, times its scale."""
    if site.get("intermediates"):
        lp = site["fn"].log_prob(site["value"], site["intermediates"])
    else:
        lp = site["fn"].log_prob(site["value"])
    if site["scale"] is not None:
        lp = site["scale"] * lp
    return lp


def expected_log_prob(site: dict) -> jax.Array:
    """A log-probability whose Hessian in the parameters is, row by row, the expected
    Hessian (the Fisher information, negated) at the parameters it is evaluated at.

    The mean of the site's log-probability at ``y = mean +- sd`` of its own
    distribution, those values held constant (``stop_gradient``): exact where the
    log-probability is quadratic in ``y`` (a normal's, with its scale) or linear (a
    Bernoulli's, a Poisson's, a binomial's: their Hessian does not depend on ``y``);
    a two-point rule elsewhere.  The observed value stands in where a point is not
    finite or outside the support, or where the distribution has no mean or
    variance (a factor).  The Newton steps of Fisher scoring (iteratively
    reweighted least squares) use it: unlike the observed Hessian it is positive
    definite away from the mode, where a regression's coefficients and its noise
    scale couple (``(beta, log sigma)`` far from the least-squares fit).
    """
    fn, value = site["fn"], site["value"]
    try:
        mean, sd = fn.mean, jnp.sqrt(fn.variance)
    except NotImplementedError:
        return site_log_prob(site)
    total = 0.0
    for sign in (1.0, -1.0):
        point = jnp.broadcast_to(mean + sign * sd, jnp.shape(value))
        ok = jnp.isfinite(point) & fn.support(point)
        ok = jnp.reshape(ok, jnp.shape(ok) + (1,) * (jnp.ndim(point) - jnp.ndim(ok)))
        point = lax.stop_gradient(jnp.where(ok, point, value))
        lp = fn.log_prob(point)
        if site["scale"] is not None:
            lp = site["scale"] * lp
        total = total + 0.5 * lp
    return total
