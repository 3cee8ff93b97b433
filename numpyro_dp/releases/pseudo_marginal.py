"""Exact MCMC from a release whose likelihood is intractable: PMMH and MHAAR (paper 002, s5.1.2).

A release ``y = S + noise`` of a statistic ``S`` has the likelihood
``p(y | theta) = int f(u | theta) g(y | u) du``, with ``f`` the statistic's law
under the model (its central-limit normal for an additive statistic, eq. 4.5,
or an exact law such as a binomial count) and ``g`` the noise's density.
Under Gaussian noise and the central-limit ``f`` the likelihood is in closed
form and :class:`MH`, a random-walk Metropolis (Algorithm 9, s5.1.1), samples
the posterior.  Under non-Gaussian noise (Laplace) the integral has no closed
form for a general ``f``.  The two kernels below sample the exact posterior of
``theta`` all the same, by estimating the integral with ``num_particles``
draws of ``u``:

* :class:`PMMH` (Algorithm 10, Andrieu & Roberts 2009): draws ``u`` from
  ``f(. | theta')`` and keeps the current point's likelihood estimate;
* :class:`MHAAR` (Algorithm 11, MHAAR-RB of Andrieu et al. 2020): draws ``u``
  from ``f(. | (theta + theta') / 2)`` (a proposal symmetric in the two
  points, in the unconstrained space), keeps one ``u`` in the state and
  refreshes the estimate of both points at every step, which makes it far
  less sticky than PMMH at the same ``num_particles`` (the thesis's Table 6.1).

Rows released one by one (the sequential release of s5.1.4, ``y_t = s(x_t) +
noise``, each row its own latent ``x_t``) are written with the latent rows and
the releases in one ``numpyro.plate``.  The plate says that, given ``theta``,
the pairs ``(x_t, y_t)`` are independent, so both kernels average the
particles row by row: ``p(y | theta)`` is estimated by the product over rows
of each row's particle average, and each row keeps its own particle
(Algorithm 13).  Averaging all rows as one particle would also be exact, but
its weights degenerate as ``n`` grows (Algorithm 12, the right form when the
release is one function of all rows, such as their median).

The user writes an ordinary NumPyro model of the release: the parameters,
the latent statistic (named in ``latent_sites``) and the release as an
observed site whose distribution is the noise's.  The kernels see only the
release, which was charged when it was made
(:mod:`~numpyro_dp.releases.mechanisms`); the MCMC is post-processing and
costs no budget, so they are plain NumPyro kernels, run by
``numpyro.infer.MCMC``.

>>> def model(y, n, b):                       # doctest: +SKIP
...     theta = numpyro.sample("theta", dist.Beta(1, 1))
...     count = numpyro.sample("count", dist.Binomial(n, theta))      # the latent statistic
...     numpyro.sample("y", dist.Laplace(count, b), obs=y)           # the release's noise
>>> mcmc = MCMC(ndp.MHAAR(model, latent_sites=["count"]), num_warmup=1000, num_samples=5000)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import is_prng_key

__all__ = ["MH", "MHAAR", "PMMH", "PseudoMarginalState"]

#: Default target acceptance rate of the step-size adaptation during warm-up.
TARGET_ACCEPT_PROB = 0.3
#: The warm-up adapts the step size within this factor of the one given.
STEP_ADAPTATION_RANGE = 10.0


class PseudoMarginalState(NamedTuple):
    """State of :class:`PMMH` and :class:`MHAAR` (everything in it is post-processing
    of the release: safe to publish).

    Attributes
    ----------
    i : int
    z : dict
        The ``sample_field``: the unconstrained parameters and a draw of the
        latent statistic (MHAAR's kept particle; PMMH's chosen by weight among
        the accepted point's particles), so that the draws are of the joint
        posterior and ``arviz.from_numpyro`` can replay the model.
    log_likelihood : float
        PMMH: the current point's likelihood estimate ``log Z_hat`` (kept, not
        recomputed: what makes the chain exact).  MHAAR: the estimate at the
        last step.
    accept_prob, mean_accept_prob : float
    step_size : float
        The random walk's scale, adapted during warm-up.
    rng_key : jax.Array
    """

    i: jax.Array
    z: dict
    log_likelihood: jax.Array
    accept_prob: jax.Array
    mean_accept_prob: jax.Array
    step_size: jax.Array
    rng_key: jax.Array


class _ReleaseModel:
    """The model split into parameters, latent statistic and release (observed sites).

    ``rows`` is the plate over which latent and observed sites pair up row by
    row (``None``: the latent sites are one particle): its frame's ``dim``
    indexes the rows in each site's batch shape.
    """

    def __init__(self, model: Callable, latent_sites: Sequence[str], args, kwargs, key,
                 row_plate: str | None = "auto"):
        self.model = model
        self.latent_sites = tuple(latent_sites)
        trace = handlers.trace(handlers.seed(model, key)).get_trace(*args, **kwargs)
        samples = {k: s for k, s in trace.items() if s["type"] == "sample"}
        missing = set(self.latent_sites) - set(samples)
        if missing:
            raise ValueError(
                f"latent_sites {sorted(missing)} are not sample sites of the model (its "
                f"sample sites: {sorted(samples)}); name the sites of the latent statistic."
            )
        observed = [k for k, s in samples.items() if s["is_observed"]]
        if not observed:
            raise ValueError(
                "The model has no observed site: make the release observed, e.g. "
                "numpyro.sample('y', dist.Laplace(count, b), obs=release.value)."
            )
        if any(k in observed for k in self.latent_sites):
            raise ValueError("A latent site cannot be observed: latent_sites are integrated out.")
        self.params = [k for k, s in samples.items()
                       if not s["is_observed"] and k not in self.latent_sites]
        if not self.params:
            raise ValueError("The model has no parameter to sample besides latent_sites.")
        for k in self.params:
            if samples[k]["fn"].support.is_discrete:
                raise ValueError(
                    f"Parameter {k!r} is discrete; the random walk needs continuous "
                    "parameters (list discrete latent statistics in latent_sites)."
                )
        self.transforms = {k: biject_to(samples[k]["fn"].support) for k in self.params}
        self.observed = observed
        self.rows = _row_frame(samples, self.latent_sites, observed, row_plate)
        self.event_dims = {k: len(samples[k]["fn"].event_shape) for k in self.latent_sites}
        z0 = {k: self.transforms[k].inv(samples[k]["value"]) for k in self.params}
        self.flat0, self.unravel = ravel_pytree(z0)

    def constrain(self, z: dict) -> dict:
        """Constrained parameters (and the latent draw, when ``z`` holds one)."""
        latent = {k: z[k] for k in self.latent_sites if k in z}
        return {**{k: self.transforms[k](z[k]) for k in self.params}, **latent}

    def flat(self, z: dict) -> jax.Array:
        """The unconstrained parameters of ``z`` as one vector (what the walk moves)."""
        return ravel_pytree({k: z[k] for k in self.params})[0]

    def state_z(self, z_flat, latent: dict) -> dict:
        return {**self.unravel(z_flat), **latent}

    def latent(self, z: dict) -> dict:
        return {k: z[k] for k in self.latent_sites}

    def _log_terms(self, z_flat, latent: dict, args, kwargs):
        """(log prior + log |J|, log f(latent | theta), log g(y | latent)).

        The last two are per row, of shape ``(rows,)``, when the model has a row
        plate; scalars otherwise.
        """
        z = self.unravel(z_flat)
        params = {k: self.transforms[k](z[k]) for k in self.params}
        logdet = sum(jnp.sum(self.transforms[k].log_abs_det_jacobian(z[k], params[k]))
                     for k in self.params)
        trace = handlers.trace(handlers.substitute(self.model, data={**params, **latent}))
        trace = trace.get_trace(*args, **kwargs)

        def total(names, rows=None):
            out = 0.0
            for k in names:
                site = trace[k]
                lp = site["fn"].log_prob(site["value"])
                lp = jnp.sum(lp) if rows is None else _sum_per_row(lp, rows, k)
                out = out + (lp if site["scale"] is None else site["scale"] * lp)
            return out

        return (total(self.params) + logdet, total(self.latent_sites, self.rows),
                total(self.observed, self.rows))

    def select(self, particles: dict, k) -> dict:
        """The particle ``k`` of each latent site, or with a row plate row ``t``'s
        particle ``k[t]`` (``particles`` lead with the particle axis)."""
        if self.rows is None:
            return jax.tree.map(lambda u: u[k], particles)
        rows = jnp.arange(self.rows.size)
        out = {}
        for name, u in particles.items():
            axis = self.rows.dim - self.event_dims[name]  # the rows, from the right
            picked = jnp.moveaxis(u, u.ndim + axis, 1)[k, rows]
            out[name] = jnp.moveaxis(picked, 0, picked.ndim + axis)
        return out

    def draw_latent(self, z_flat, key, args, kwargs) -> dict:
        """The latent statistic drawn from its law at ``theta`` (the model's)."""
        params = self.constrain(self.unravel(z_flat))
        trace = handlers.trace(handlers.seed(handlers.substitute(self.model, data=params), key))
        trace = trace.get_trace(*args, **kwargs)
        return {k: trace[k]["value"] for k in self.latent_sites}


def _row_frame(samples: dict, latent_sites, observed, row_plate):
    """The plate frame holding every latent and observed site (see :class:`PMMH`)."""
    if row_plate is None or not latent_sites:
        return None
    frames = [{f.name: f for f in samples[k]["cond_indep_stack"]}
              for k in (*latent_sites, *observed)]
    shared = sorted(set.intersection(*(set(f) for f in frames)))
    if row_plate == "auto":
        if len(shared) > 1:
            raise ValueError(
                f"The latent and observed sites share the plates {shared}: name the one "
                "over the released rows, row_plate=..., or row_plate=None to average "
                "all rows as one particle."
            )
        return frames[0][shared[0]] if shared else None
    if row_plate not in shared:
        raise ValueError(
            f"row_plate={row_plate!r} does not hold every latent and observed site (the "
            f"plates they all sit in: {shared or 'none'})."
        )
    return frames[0][row_plate]


def _sum_per_row(log_prob, rows, name: str) -> jax.Array:
    """A site's log density summed over everything but the row plate: shape (rows,)."""
    if log_prob.ndim < -rows.dim or log_prob.shape[rows.dim] != rows.size:
        raise ValueError(
            f"Site {name!r} has log-density shape {log_prob.shape}, without the "
            f"{rows.size} rows of plate {rows.name!r} at dim {rows.dim}."
        )
    moved = jnp.moveaxis(log_prob, log_prob.ndim + rows.dim, 0)
    return moved.reshape(rows.size, -1).sum(1)


def _log_mean(log_w) -> jax.Array:
    """``log`` of the particle average of ``exp(log_w)`` (axis 0), times over the rows."""
    return jnp.sum(jax.nn.logsumexp(log_w, axis=0) - jnp.log(log_w.shape[0]))


class _PseudoMarginal(MCMCKernel):
    """The shared part: model split, initialisation, step-size adaptation, constraints."""

    sample_field = "z"
    #: Whether the kernel integrates a latent statistic out (all but MH).
    _needs_latent = True

    def __init__(self, model: Callable, latent_sites: Sequence[str], num_particles: int = 16,
                 step_size: float = 0.1, adapt_step_size: bool = True,
                 target_accept_prob: float = TARGET_ACCEPT_PROB,
                 row_plate: str | None = "auto"):
        if self._needs_latent and not latent_sites:
            raise ValueError(
                "Name the latent statistic's sites: latent_sites=['count'] (a model whose "
                "release likelihood is in closed form has none: use ndp.MH)."
            )
        if not (isinstance(num_particles, (int, np.integer)) and num_particles >= 1):
            raise ValueError(f"num_particles={num_particles!r} must be a positive integer.")
        if not step_size > 0:
            raise ValueError(f"step_size={step_size!r} must be > 0.")
        if not 0 < target_accept_prob < 1:
            raise ValueError(f"target_accept_prob={target_accept_prob!r} must lie in (0, 1).")
        self._model = model
        self.latent_sites = tuple(latent_sites)
        self.num_particles = int(num_particles)
        self.step_size = float(step_size)
        self.adapt_step_size = bool(adapt_step_size)
        self.target_accept_prob = float(target_accept_prob)
        self.row_plate = row_plate
        self._split = None
        self._num_warmup = 0

    @property
    def model(self):
        return self._model

    def get_diagnostics_str(self, state: PseudoMarginalState) -> str:
        return f"step size {state.step_size:.2e}. acc. prob={state.mean_accept_prob:.2f}"

    def postprocess_fn(self, args, kwargs):
        def constrain(z):
            return self._split.constrain(z)

        return constrain

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        self._num_warmup = int(num_warmup)
        key0 = rng_key if is_prng_key(rng_key) else rng_key[0]
        self._split = _ReleaseModel(self._model, self.latent_sites, model_args, model_kwargs,
                                    random.fold_in(key0, 1), self.row_plate)
        split = self._split

        def init_one(key, params):
            key_init, key_latent, key_state = random.split(key, 3)
            if params is None:  # a draw from the prior, as NumPyro's init_to_sample
                trace = handlers.trace(handlers.seed(self._model, key_init)).get_trace(
                    *model_args, **model_kwargs)
                params = {k: split.transforms[k].inv(trace[k]["value"]) for k in split.params}
            z_flat = ravel_pytree(params)[0]
            latent, log_likelihood = self._estimate(key_latent, z_flat, model_args,
                                                    model_kwargs)
            zero = jnp.zeros((), z_flat.dtype)
            return PseudoMarginalState(
                jnp.zeros((), jnp.int32), split.state_z(z_flat, latent), log_likelihood,
                zero, zero, jnp.asarray(self.step_size, z_flat.dtype), key_state)

        if is_prng_key(rng_key):
            state = init_one(rng_key, init_params)
        else:
            state = jax.vmap(init_one)(rng_key, init_params)
        return state

    def _adapt(self, state: PseudoMarginalState, accept_prob) -> jax.Array:
        """Robbins-Monro on log step size toward the target acceptance, warm-up only.

        Bounded to a factor ``STEP_ADAPTATION_RANGE`` either way of ``step_size``:
        where the likelihood estimate is noisy (PMMH with few particles) the
        acceptance stays low however small the step, and unbounded adaptation
        would shrink it to nothing.
        """
        if not self.adapt_step_size:
            return state.step_size
        gain = 1.0 / jnp.sqrt(state.i + 1.0)
        adapted = state.step_size * jnp.exp(gain * (accept_prob - self.target_accept_prob))
        adapted = jnp.clip(adapted, self.step_size / STEP_ADAPTATION_RANGE,
                           self.step_size * STEP_ADAPTATION_RANGE)
        return jnp.where(state.i < self._num_warmup, adapted, state.step_size)

    def sample(self, state, model_args, model_kwargs):
        if jnp.ndim(state.i) > 0:
            return jax.vmap(lambda s: self._step(s, model_args, model_kwargs))(state)
        return self._step(state, model_args, model_kwargs)

    def _step(self, state, model_args, model_kwargs):
        raise NotImplementedError

    def _finish(self, state, key, accept_prob, z_flat, latent, log_likelihood):
        n = state.i + 1
        mean = state.mean_accept_prob + (accept_prob - state.mean_accept_prob) / n
        return PseudoMarginalState(
            n, self._split.state_z(z_flat, latent), log_likelihood, accept_prob, mean,
            self._adapt(state, accept_prob), key)

    def _particles(self, key, z_flat, args, kwargs) -> dict:
        keys = random.split(key, self.num_particles)
        return jax.vmap(lambda k: self._split.draw_latent(z_flat, k, args, kwargs))(keys)

    def _estimate(self, key, z_flat, args, kwargs):
        """``(u, log p_hat(y | theta))``: particles from the model at ``theta``, the mean
        of their release likelihoods (per row and multiplied, with a row plate),
        and one particle drawn by its weight (per row; with ``theta``, a draw of
        the joint posterior)."""
        key_u, key_pick = random.split(key)
        particles = self._particles(key_u, z_flat, args, kwargs)
        log_lik = jax.vmap(lambda u: self._split._log_terms(z_flat, u, args, kwargs)[2])(
            particles)
        pick = random.categorical(key_pick, log_lik, axis=0)
        return self._split.select(particles, pick), _log_mean(log_lik)


class PMMH(_PseudoMarginal):
    """Pseudo-marginal Metropolis-Hastings on a release (paper 002, Algorithm 10).

    Each step proposes ``theta' = theta + step_size * N(0, I)`` (unconstrained),
    draws ``num_particles`` values of the latent statistic from the model at
    ``theta'`` and estimates ``p(y | theta')`` by the mean of ``g(y | u)``; the
    current point keeps its estimate.  Exact for any ``num_particles >= 1``;
    more particles make it less sticky.

    Parameters
    ----------
    model : callable
        A NumPyro model of the release: parameters, the latent statistic, the
        release observed.
    latent_sites : sequence of str
        The latent statistic's sample sites (integrated out by particles).
    num_particles : int
    step_size : float
        Initial scale of the random walk.
    adapt_step_size : bool
        Adapt it during warm-up toward ``target_accept_prob``, within a factor
        10 of ``step_size`` (a noisy estimate caps the acceptance whatever the
        step: PMMH with few particles).
    target_accept_prob : float
    row_plate : str or None
        The plate over the released rows, when each row is released on its own
        (the sequential release of s5.1.4): the particles are averaged per row
        and the estimate is the product over rows.  ``"auto"`` (default) takes
        the one plate that holds every latent and observed site, if any (a
        plate declares the rows independent given the parameters, which is
        what makes the product exact); ``None`` averages all rows as one
        particle (Algorithm 12: needed when the release is one function of all
        rows, which the model then writes outside the plate).
    """

    def _step(self, state, args, kwargs):
        split = self._split
        key, key_prop, key_u, key_acc = random.split(state.rng_key, 4)
        z_flat, kept = split.flat(state.z), split.latent(state.z)
        proposal = z_flat + state.step_size * random.normal(key_prop, z_flat.shape, z_flat.dtype)
        latent_new, log_z_new = self._estimate(key_u, proposal, args, kwargs)
        log_prior_new = split._log_terms(proposal, latent_new, args, kwargs)[0]
        log_prior_old = split._log_terms(z_flat, kept, args, kwargs)[0]
        log_ratio = log_prior_new + log_z_new - log_prior_old - state.log_likelihood
        accept_prob = jnp.clip(jnp.exp(jnp.minimum(log_ratio, 0.0)), 0.0, 1.0)
        accept_prob = jnp.where(jnp.isnan(log_ratio), 0.0, accept_prob)
        accepted = random.uniform(key_acc) < accept_prob
        latent = jax.tree.map(lambda new, old: jnp.where(accepted, new, old), latent_new, kept)
        return self._finish(state, key, accept_prob, jnp.where(accepted, proposal, z_flat),
                            latent, jnp.where(accepted, log_z_new, state.log_likelihood))


class MH(PMMH):
    """Random-walk Metropolis on a release whose likelihood is in closed form (Algorithm 9).

    The exact MH of paper 002 s5.1.1: an additive statistic released with
    Gaussian noise, under its central-limit law, has the Gaussian likelihood
    ``N(y; n mu_s(theta), n Sigma_s(theta) + sigma^2 I)`` (eq. 5.1), and the
    model observes the release through it, with no latent site.  This is
    :class:`PMMH` with the likelihood computed instead of estimated, so it
    shares its random walk, warm-up adaptation and state.  NumPyro's NUTS
    samples the same posterior; MH is the thesis's sampler and needs no
    gradient.

    >>> def model(y, n, sd):                     # doctest: +SKIP
    ...     theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
    ...     mean, var = n * 0.798 * jnp.sqrt(theta), n * 0.363 * theta   # sum of |x|
    ...     numpyro.sample("y", dist.Normal(mean, jnp.sqrt(var + sd**2)), obs=y)
    >>> mcmc = MCMC(ndp.MH(model), num_warmup=1000, num_samples=10000)

    Parameters
    ----------
    model : callable
        A NumPyro model: parameters and the release observed under its
        closed-form likelihood.
    step_size, adapt_step_size, target_accept_prob
        As in :class:`PMMH`.
    """

    _needs_latent = False

    def __init__(self, model: Callable, step_size: float = 0.1, adapt_step_size: bool = True,
                 target_accept_prob: float = TARGET_ACCEPT_PROB):
        super().__init__(model, (), 1, step_size, adapt_step_size, target_accept_prob)

    def _estimate(self, key, z_flat, args, kwargs):
        return {}, self._split._log_terms(z_flat, {}, args, kwargs)[2]


class MHAAR(_PseudoMarginal):
    """MH with averaged acceptance ratios, Rao-Blackwellised (paper 002, Algorithm 11).

    Each step proposes ``theta'``, keeps the current latent draw as the first of
    ``num_particles`` and draws the others from the model at the midpoint
    ``(theta + theta') / 2`` (unconstrained; symmetric in the two points, as
    the method requires), weighs each draw at both points and accepts with
    the ratio of the weights' sums; the next latent draw is chosen among the
    particles by the weights of the point returned.  Exact for any
    ``num_particles >= 2`` (with 1 it never refreshes the latent draw).

    With a row plate (see :class:`PMMH`), the averages and the choice of the
    kept draw are per row (Algorithm 13, the sequential release); the
    midpoint proposal then draws every row's particles, which is Algorithm 13
    itself when the latent rows are written reparametrised (``z ~ N(0, 1)``,
    ``x = phi(theta, z)`` in the model, so their law does not depend on
    ``theta``).

    Parameters are those of :class:`PMMH`.
    """

    def __init__(self, model: Callable, latent_sites: Sequence[str], num_particles: int = 16,
                 **kwargs):
        if isinstance(num_particles, (int, np.integer)) and num_particles < 2:
            raise ValueError(
                f"MHAAR needs num_particles >= 2 (got {num_particles}): the first particle "
                "is the kept draw, the others refresh it."
            )
        super().__init__(model, latent_sites, num_particles, **kwargs)

    def _step(self, state, args, kwargs):
        split = self._split
        key, key_prop, key_u, key_acc, key_pick = random.split(state.rng_key, 5)
        z_flat, kept = split.flat(state.z), split.latent(state.z)
        proposal = z_flat + state.step_size * random.normal(key_prop, z_flat.shape, z_flat.dtype)
        middle = 0.5 * (z_flat + proposal)
        fresh = self._particles(key_u, middle, args, kwargs)
        particles = jax.tree.map(lambda old, new: new.at[0].set(old), kept, fresh)

        def weights(u):
            # The release's likelihood is taken at both points: it depends on theta
            # when the model writes the latent rows reparametrised (x = phi(theta, z)).
            prior_old, f_old, lik_old = split._log_terms(z_flat, u, args, kwargs)
            prior_new, f_new, lik_new = split._log_terms(proposal, u, args, kwargs)
            _, f_mid, _ = split._log_terms(middle, u, args, kwargs)
            return prior_old, prior_new, f_old + lik_old - f_mid, f_new + lik_new - f_mid

        prior_old, prior_new, log_w, log_w_new = jax.vmap(weights)(particles)
        log_ratio = prior_new[0] + _log_mean(log_w_new) - prior_old[0] - _log_mean(log_w)
        accept_prob = jnp.clip(jnp.exp(jnp.minimum(log_ratio, 0.0)), 0.0, 1.0)
        accept_prob = jnp.where(jnp.isnan(log_ratio), 0.0, accept_prob)
        accepted = random.uniform(key_acc) < accept_prob
        k = random.categorical(key_pick, jnp.where(accepted, log_w_new, log_w), axis=0)
        latent = split.select(particles, k)
        log_likelihood = jnp.where(accepted, _log_mean(log_w_new), _log_mean(log_w))
        return self._finish(state, key, accept_prob, jnp.where(accepted, proposal, z_flat),
                            latent, log_likelihood)
