"""Which statistic to release: the Fisher information of a noisy release (paper 002, ch. 4).

Before spending a budget on one release of ``S = sum_i s(x_i)``, compare the
candidate statistics ``s`` by how much the *noisy* release tells about the
parameters: its Fisher information ``F(theta)``.  The best statistic without
noise (a sufficient one, say ``x^2`` for a normal variance) is often not the
best with it: a statistic of large range needs large noise (Alparslan 2023,
Examples 3-5; ``|x|`` beats ``x^2`` for the variance of N(0, theta) at
epsilon = 1 when x lies in (-10, 10)).

Everything here is public: it uses the model's moments of ``s`` at a guessed
``theta`` (or at draws of it from an earlier release, ch. 6.5), never data.

The sum is approximated by the central limit theorem, ``S ~ N(n mu_s(theta),
n Sigma_s(theta))``, ``mu_s`` and ``Sigma_s`` the mean and covariance of one
row's ``s(x)`` (:class:`Statistic`), and the release adds

* Gaussian noise ``N(0, sigma^2 I)``: the release is Gaussian and ``F`` is in
  closed form (:func:`gaussian_release_fisher`, section 4.2.1);
* Laplace noise of scale ``b`` (a scalar statistic): the release's density is
  the normal-Laplace convolution, in closed form, and ``F`` is its score's
  second moment by quadrature (:func:`laplace_release_fisher`, section 4.2.2;
  exact where the thesis's Algorithm 6 estimates it by importance sampling);
* each row's ``s(x_i)`` released on its own with Laplace noise (local DP, the
  sequential release of section 4.2.4): :func:`sequential_release_fisher`,
  ``n`` times the information of one noisy row, by quadrature over the row
  and the release (exact where Algorithm 8 estimates).

A statistic that is not a sum (a median, a maximum released with noise scaled
to its smooth sensitivity, s4.2.3) has no central-limit law: its release's
information comes from the rows themselves, by Monte Carlo
(:func:`marginal_release_fisher`, Algorithm 7: releases simulated from the
model, the score of each by self-normalised importance sampling over the
rows).

The thesis writes the release as the *mean* of ``s``; the sum with ``n`` times
the noise scale carries the same information.  Its Example 6's ``F_2`` and
``F_3`` (eqs. after 4.11) lack the 1/2 of the variance term, which
:func:`gaussian_release_fisher` has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.scipy.special import log_ndtr

from numpyro_dp.accounting import check_budget
from numpyro_dp.releases.mechanisms import check_bound, gaussian_sigma

__all__ = [
    "MarginalFisher",
    "Ranking",
    "Statistic",
    "gaussian_release_fisher",
    "laplace_release_fisher",
    "marginal_release_fisher",
    "rank_statistics",
    "sequential_release_fisher",
]

#: Points of the quadrature over the release in :func:`laplace_release_fisher`.
QUADRATURE_POINTS = 8001
#: The quadrature covers the release's mean +- this many of its sds.
QUADRATURE_SDS = 14.0
#: Largest grid of :func:`sequential_release_fisher` (points on the row and on
#: the release; memory grows as its square).
SEQUENTIAL_MAX_POINTS = 4001


class Statistic(NamedTuple):
    """A candidate additive statistic ``S = sum_i s(x_i)`` under a model.

    Attributes
    ----------
    name : str
        How the ranking names it (``"|x|"``, ``"x^2"``).
    mean : callable
        ``theta -> E_theta[s(X)]``, shape ``(d_s,)`` or scalar; differentiable
        by JAX (closed form, or an average over draws with fixed random numbers).
    cov : callable
        ``theta -> Var_theta[s(X)]``, shape ``(d_s, d_s)`` or scalar.
    sensitivity : float
        The sensitivity of the sum under your neighbourhood: l2 for Gaussian
        noise, l1 for Laplace (for ``s`` in ``[0, A]``: ``A`` add/remove, as
        :func:`~numpyro_dp.releases.mechanisms.sum_sensitivity` gives).  The
        noise each candidate needs grows with it.
    """

    name: str
    mean: Callable
    cov: Callable
    sensitivity: float


def _moments(stat: Statistic, theta, num_rows: int):
    """Mean and covariance of the sum ``S`` (CLT), as vector and matrix."""
    mean = jnp.atleast_1d(stat.mean(theta)) * num_rows
    cov = jnp.atleast_2d(stat.cov(theta)) * num_rows
    return mean, cov


def _as_matrix(fisher) -> np.ndarray:
    return np.atleast_2d(np.asarray(fisher, np.float64))


def _as_vector(theta):
    """``(theta as a vector, the map back)``: the derivatives are taken in vectors."""
    return jnp.atleast_1d(theta), (lambda t: t[0]) if jnp.ndim(theta) == 0 else (lambda t: t)


def _in_float64(fn: Callable) -> Callable:
    """``fn`` computed in float64 whatever JAX's setting: a public computation,
    where float32 would cost the quadrature and the small noise terms digits."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.enable_x64(True):
            return fn(*args, **kwargs)

    return wrapped


@_in_float64
def gaussian_release_fisher(stat: Statistic, theta, num_rows: int, noise_sd: float) -> np.ndarray:
    """Fisher information about ``theta`` of ``S + N(0, noise_sd^2 I)`` (section 4.2.1).

    With ``S ~ N(m(theta), V(theta))`` by the CLT, the release is
    ``N(m, H)``, ``H = V + noise_sd^2 I``, and

        F_ij = dm/dtheta_i^T H^-1 dm/dtheta_j + tr(H^-1 dH_i H^-1 dH_j) / 2.

    Parameters
    ----------
    stat : Statistic
    theta : array_like
        The parameter value (scalar or vector) at which to evaluate.
    num_rows : int
        ``n``, public.
    noise_sd : float
        The standard deviation of the noise added to the sum (``sigma`` of the
        Gaussian mechanism; :func:`rank_statistics` calibrates it).

    Returns
    -------
    numpy.ndarray
        ``(p, p)`` for a ``p``-dimensional ``theta`` (``(1, 1)`` for a scalar).
    """
    theta = jnp.asarray(theta, jnp.result_type(float))
    if noise_sd < 0 or not np.isfinite(noise_sd):
        raise ValueError(f"noise_sd={noise_sd} must be finite and >= 0.")

    def release_moments(t):
        mean, cov = _moments(stat, t, num_rows)
        return mean, cov + noise_sd**2 * jnp.eye(mean.shape[0], dtype=cov.dtype)

    flat, unflat = _as_vector(theta)
    H = release_moments(theta)[1]
    dm, dH = jax.jacfwd(lambda t: release_moments(unflat(t)))(flat)  # (k, p), (k, k, p)
    Hinv = jnp.linalg.inv(H)
    mean_term = dm.T @ Hinv @ dm
    A = jnp.einsum("kl,lmp->kmp", Hinv, dH)  # H^-1 dH_p
    cov_term = 0.5 * jnp.einsum("klp,lkq->pq", A, A)
    return _as_matrix(mean_term + cov_term)


#: Above this, exp(z^2/2) Phi(-z) comes from its continued fraction.
_MILLS_SWITCH = 8.0
#: Terms of the continued fraction (converged to float64 for z >= 8).
_MILLS_TERMS = 60


def _log_mills(z):
    """``log(exp(z^2 / 2) Phi(-z))``, stable for large ``|z|``.

    Below 8, ``z^2/2 + log_ndtr(-z)`` loses no more than 1e-14.  Above, that
    sum cancels, and its gradient with it (JAX's ``log_ndtr`` gradient is off
    by 1e-7 relative at z = 5e4, an error the small Laplace scales of large
    releases multiply; its ``erfcx`` returns 0 near 26.6), so the Mills ratio
    ``Phi(-z) / phi(z) = 1/(z + 1/(z + 2/(z + 3/(z + ...))))`` is used.
    """
    low = z < _MILLS_SWITCH
    # Each branch sees only its own side (a `where`: no NaN from the other one).
    zl = jnp.where(low, z, 0.0)
    direct = 0.5 * zl**2 + log_ndtr(-zl)
    zh = jnp.where(low, _MILLS_SWITCH, z)
    tail = zh
    for k in range(_MILLS_TERMS, 0, -1):
        tail = zh + k / tail
    fraction = -jnp.log(tail) - 0.5 * jnp.log(2 * jnp.pi)
    return jnp.where(low, direct, fraction)


def _normal_laplace_logpdf(y, mean, var, scale):
    """log density of ``N(mean, var) + Laplace(0, scale)`` at ``y`` (closed form).

    ``p(y) = N(y; m, v) sqrt(2 pi v) [M(z_-) + M(z_+)] / 2b``, ``M(z) = exp(z^2/2)
    Phi(-z)``, ``z_-+ = (v/b -+ (y - m)) / sqrt v`` (the noise below and above y).
    """
    sd = jnp.sqrt(var)
    below = _log_mills((var / scale - (y - mean)) / sd)
    above = _log_mills((var / scale + (y - mean)) / sd)
    return (-0.5 * (y - mean) ** 2 / var + jnp.logaddexp(below, above)
            - jnp.log(2 * scale))


@_in_float64
def laplace_release_fisher(stat: Statistic, theta, num_rows: int, noise_scale: float,
                           num_points: int = QUADRATURE_POINTS) -> np.ndarray:
    """Fisher information about ``theta`` of ``S + Laplace(0, noise_scale)`` (section 4.2.2).

    A scalar statistic: ``S ~ N(m(theta), v(theta))`` by the CLT, so the
    release has the normal-Laplace density in closed form; its score (by
    automatic differentiation) is squared and integrated over the release on
    a grid of ``num_points`` points spanning its mean +- 14 sds.  The thesis
    estimates the same integral by importance sampling (Algorithm 6).

    Parameters
    ----------
    stat : Statistic
        A scalar statistic.
    theta, num_rows :
        As in :func:`gaussian_release_fisher`.
    noise_scale : float
        The Laplace scale ``b`` of the noise on the sum (``sensitivity /
        epsilon`` for epsilon-DP).
    num_points : int
        Quadrature points.

    Returns
    -------
    numpy.ndarray
        ``(p, p)``.
    """
    check_bound("noise_scale", noise_scale)
    theta = jnp.asarray(theta, jnp.result_type(float))
    mean, var = (x.squeeze() for x in _moments(stat, theta, num_rows))
    if jnp.ndim(stat.mean(theta)) > 0 and jnp.size(stat.mean(theta)) > 1:
        raise ValueError(
            f"laplace_release_fisher needs a scalar statistic; {stat.name!r} has "
            f"{jnp.size(stat.mean(theta))} coordinates."
        )
    flat, unflat = _as_vector(theta)
    half_width = QUADRATURE_SDS * jnp.sqrt(var + 2 * noise_scale**2)
    y = jnp.linspace(mean - half_width, mean + half_width, num_points)

    def logpdf(t, y):
        m, v = (x.squeeze() for x in _moments(stat, unflat(t), num_rows))
        return _normal_laplace_logpdf(y, m, v, noise_scale)

    score = jax.vmap(jax.grad(logpdf), (None, 0))(flat, y)  # (num_points, p)
    density = jnp.exp(jax.vmap(logpdf, (None, 0))(flat, y))
    integrand = density[:, None, None] * score[:, :, None] * score[:, None, :]
    return _as_matrix(jnp.trapezoid(integrand, y, axis=0))


@_in_float64
def sequential_release_fisher(row_logpdf: Callable, statistic: Callable, theta,
                              num_rows: int, noise_scale: float, support: tuple,
                              num_points: int = 2001) -> np.ndarray:
    """Fisher information about ``theta`` of ``n`` releases ``s(x_i) + Laplace(0, b)``
    (section 4.2.4, each row released on its own).

    One release has density ``p(y | theta) = int p(x | theta) g_b(y - s(x)) dx``
    (eq. 4.10); its score is differentiated through that integral, computed by
    the trapezoid rule over ``x`` in ``support``, and its second moment is
    integrated over ``y``.  The ``n`` releases are independent: ``n`` times it.

    Parameters
    ----------
    row_logpdf : callable
        ``(x, theta) -> log p(x | theta)`` of one scalar row, JAX-differentiable
        in ``theta``.  It is renormalised over ``support`` (bounded data: a
        model truncated to the bounds that make ``s`` bounded).
    statistic : callable
        ``x -> s(x)``, scalar.
    theta : array_like
        Scalar or vector parameter.
    num_rows : int
        ``n``.
    noise_scale : float
        The Laplace scale ``b`` of each row's release (``sensitivity /
        epsilon``).
    support : (float, float)
        Finite bounds of a row.
    num_points : int
        Least quadrature points on ``x`` and on the release (more where the
        noise is narrow: 8 per noise scale over the statistic's range).

    Returns
    -------
    numpy.ndarray
        ``(p, p)``.
    """
    check_bound("noise_scale", noise_scale)
    lo, hi = (float(v) for v in support)
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(f"support={support!r} must be finite bounds (lo, hi) with lo < hi.")
    theta = jnp.asarray(theta, jnp.result_type(float))
    flat, unflat = _as_vector(theta)
    # The grids must resolve the noise: 8 points per noise scale over the statistic.
    s_coarse = jax.vmap(statistic)(jnp.linspace(lo, hi, num_points))
    s_range = float(jnp.max(s_coarse) - jnp.min(s_coarse)) + 60 * noise_scale
    points = max(num_points, int(np.ceil(8 * s_range / noise_scale)) + 1)
    if points > SEQUENTIAL_MAX_POINTS:
        raise ValueError(
            f"noise_scale={noise_scale} is too small beside the statistic's range "
            f"({s_range - 60 * noise_scale:.4g}) for the quadrature ({points} points, at "
            f"most {SEQUENTIAL_MAX_POINTS}). With so little noise each release is nearly the "
            "statistic itself: use the model's own Fisher information of s(X)."
        )
    x = jnp.linspace(lo, hi, points)
    log_dx = jnp.log(jnp.full(points, (hi - lo) / (points - 1)).at[jnp.array([0, -1])]
                     .multiply(0.5))  # trapezoid weights
    s = jax.vmap(statistic)(x)
    y = jnp.linspace(jnp.min(s) - 30 * noise_scale, jnp.max(s) + 30 * noise_scale, points)
    log_noise = -jnp.abs(y[:, None] - s[None, :]) / noise_scale - jnp.log(2 * noise_scale)

    def release_logpdf(t):  # log p(y | t) on the grid of y
        log_p = jax.vmap(lambda xi: row_logpdf(xi, unflat(t)))(x) + log_dx
        log_p = log_p - jax.scipy.special.logsumexp(log_p)  # renormalised on the support
        return jax.scipy.special.logsumexp(log_noise + log_p[None, :], axis=1)

    score = jax.jacfwd(release_logpdf)(flat)  # (num_points, p)
    density = jnp.exp(release_logpdf(flat))
    integrand = density[:, None, None] * score[:, :, None] * score[:, None, :]
    return _as_matrix(num_rows * jnp.trapezoid(integrand, y, axis=0))


class Ranking(NamedTuple):
    """One candidate's standing in :func:`rank_statistics` (best first).

    Attributes
    ----------
    name : str
    fisher : numpy.ndarray
        ``F(theta)``, ``(p, p)``; averaged over the draws when several are given.
    criterion : float
        ``tr(F^-1)`` averaged over the draws of ``theta``: the asymptotic
        posterior variance the release leaves (lower is better).
    noise : float
        The noise the budget requires for this candidate (Gaussian sd or
        Laplace scale on the sum).
    """

    name: str
    fisher: np.ndarray
    criterion: float
    noise: float


def _criterion(fisher: np.ndarray) -> float:
    """``tr(F^-1)``; inf where the release cannot identify every parameter."""
    if np.linalg.matrix_rank(fisher) < fisher.shape[0]:
        return float("inf")
    return float(np.trace(np.linalg.inv(fisher)))


def rank_statistics(
    candidates: Sequence[Statistic],
    theta=None,
    num_rows: int | None = None,
    *,
    epsilon: float,
    delta: float | None = None,
    noise: str = "gaussian",
    theta_draws=None,
) -> list[Ranking]:
    """Rank candidate statistics by the information their release would give.

    Each candidate's noise is calibrated to the same budget from its own
    sensitivity (the Gaussian mechanism's analytic calibration, as
    :func:`~numpyro_dp.releases.mechanisms.gaussian_mechanism` releases it, or
    ``b = sensitivity / epsilon`` for Laplace), then its Fisher information is
    computed and the candidates are sorted by ``tr(F^-1)``, the variance an
    efficient estimate from the release would have (for a scalar ``theta``:
    largest ``F`` first).

    Parameters
    ----------
    candidates : sequence of Statistic
    theta : array_like, optional
        A guess of the parameter (scalar or vector): public, never computed
        from the rows to be released.
    num_rows : int
        ``n`` of the release, public.
    epsilon, delta : float
        The budget of the one release.  ``delta`` is required for Gaussian noise.
    noise : {"gaussian", "laplace"}
    theta_draws : array_like, optional
        Instead of ``theta``: draws of it on the leading axis, e.g. from the
        posterior of an earlier release on *other* rows (the thesis's section
        6.5); the criterion is averaged over them.

    Returns
    -------
    list of Ranking
        Best first.
    """
    check_budget(epsilon, delta)
    if noise not in ("gaussian", "laplace"):
        raise ValueError(f"noise={noise!r}: use 'gaussian' or 'laplace'.")
    if not candidates:
        raise ValueError("rank_statistics needs at least one candidate Statistic.")
    if (theta is None) == (theta_draws is None):
        raise ValueError("Pass either theta (one guess) or theta_draws (draws of it).")
    if not (isinstance(num_rows, (int, np.integer)) and num_rows >= 1):
        raise ValueError(f"num_rows={num_rows!r} must be the public number of rows, >= 1.")
    draws = [theta] if theta_draws is None else list(np.asarray(theta_draws, np.float64))
    rankings = []
    for stat in candidates:
        if noise == "gaussian":
            scale = gaussian_sigma(epsilon, delta, stat.sensitivity)
            fishers = [gaussian_release_fisher(stat, t, num_rows, scale) for t in draws]
        else:
            scale = check_bound("sensitivity", stat.sensitivity) / epsilon
            fishers = [laplace_release_fisher(stat, t, num_rows, scale) for t in draws]
        criterion = float(np.mean([_criterion(f) for f in fishers]))
        rankings.append(Ranking(stat.name, np.mean(fishers, axis=0), criterion, scale))
    return sorted(rankings, key=lambda r: r.criterion)


class MarginalFisher(NamedTuple):
    """What :func:`marginal_release_fisher` returns.

    Attributes
    ----------
    fisher : numpy.ndarray
        ``(p, p)``: the estimate of ``F(theta)``.
    stderr : numpy.ndarray
        ``(p, p)``: its Monte Carlo standard error, from the spread over the
        simulated releases.
    ess : numpy.ndarray
        ``(num_releases,)``: for each simulated release, the smaller of the two
        importance-sampling effective sample sizes ``1 / sum w^2`` of its
        particle sets.  Where it is a handful, the score of that release is
        poorly estimated: add particles.
    """

    fisher: np.ndarray
    stderr: np.ndarray
    ess: np.ndarray


#: ``(draw_latent, theta's shape) -> whether its draws move with theta`` (checked once).
_LATENT_MOVES: dict = {}


def _check_latent_free_of_theta(draw_latent: Callable, theta) -> None:
    """Without ``latent_logpdf`` the latent law must not depend on ``theta``: a draw at a
    fixed key must have derivative 0 in ``theta`` (checked at the first ``theta`` seen
    for each sampler and shape)."""
    cache_key = (draw_latent, tuple(jnp.shape(theta)))
    if cache_key not in _LATENT_MOVES:
        jacobian = jax.jacfwd(lambda t: draw_latent(random.PRNGKey(0), t))(theta)
        _LATENT_MOVES[cache_key] = any(
            jnp.issubdtype(leaf.dtype, jnp.inexact) and bool(jnp.any(leaf != 0))
            for leaf in jax.tree.leaves(jacobian))
    if _LATENT_MOVES[cache_key]:
        raise ValueError(
            "draw_latent(key, theta) depends on theta, so the score needs the latent "
            "law's own score: pass latent_logpdf=(theta, latent) -> log p(latent | theta) "
            "(the thesis's Algorithm 7, latent = the rows), or reparametrise: draw "
            "theta-free noise z and map it to the rows inside release (x = phi(theta, z))."
        )


@functools.lru_cache(maxsize=32)
def _marginal_fisher_program(draw_latent: Callable, release: Callable,
                             latent_logpdf: Callable | None, scalar: bool, num_releases: int,
                             num_particles: int) -> Callable:
    """The jitted estimator for one model (compiled once per model and size)."""

    def unflat(t):
        return t[0] if scalar else t

    def log_joint(t, latent, y):
        """(log p(latent | t) + log h(y | latent, t), log h): the score's function, the weight."""
        log_h = jnp.sum(release(unflat(t), latent).log_prob(y))
        log_p = 0.0 if latent_logpdf is None else jnp.sum(latent_logpdf(unflat(t), latent))
        return log_p + log_h, log_h

    def score(key, flat, y):
        """Self-normalised importance sampling of E[d log p(y, latent | theta) | y]."""
        latents = jax.vmap(lambda k: draw_latent(k, unflat(flat)))(
            random.split(key, num_particles))
        (_, log_w), grads = jax.vmap(jax.value_and_grad(log_joint, has_aux=True),
                                     (None, 0, None))(flat, latents, y)
        grads = jnp.where(jnp.isfinite(log_w)[:, None], grads, 0.0)  # weight 0: no NaN
        w = jax.nn.softmax(log_w)
        return w @ grads, 1.0 / jnp.sum(w**2)

    @jax.jit
    def program(key, flat):
        def one_release(key):
            key_latent, key_y, key_sets = random.split(key, 3)
            theta = unflat(flat)
            y = release(theta, draw_latent(key_latent, theta)).sample(key_y)
            # two independent particle sets (one traced body, vectorised over the two)
            scores, ess = jax.vmap(score, (0, None, None))(random.split(key_sets), flat, y)
            return scores[0], scores[1], jnp.min(ess)

        # one release at a time: memory bounded by its 2 * num_particles latents, and
        # XLA compiles a vectorised batch of releases several times slower
        return jax.lax.map(one_release, random.split(key, num_releases))

    return program


@_in_float64
def marginal_release_fisher(key: jax.Array, draw_latent: Callable, release: Callable, theta,
                            *, latent_logpdf: Callable | None = None, num_releases: int = 256,
                            num_particles: int = 512) -> MarginalFisher:
    """Fisher information of a release from its exact marginal, by Monte Carlo (s4.2.3).

    For any statistic of the rows, additive or not (a median, a maximum with
    noise scaled to its smooth sensitivity): the release ``y`` has density
    ``p(y | theta) = E[h(y | latent, theta)]`` over the latent rows, and
    Fisher's identity gives its score as a posterior expectation,

        d log p(y | theta) = E[d log p(latent | theta) + d log h(y | latent, theta) | y, theta],

    estimated by self-normalised importance sampling with ``num_particles``
    latent draws from the model, weighted by ``h(y | latent, theta)``
    (Algorithm 7).  ``F(theta) = E_y[score score^T]`` averages over
    ``num_releases`` releases simulated from the model at ``theta``.  Each
    release's score is estimated twice, from two independent particle sets,
    and ``F`` averages their product: the thesis's square of one estimate is
    biased upward by that estimate's variance (about ``Var(score | y) /
    ESS``), the product of two independent ones is not (what remains is the
    importance sampler's own ``O(1 / num_particles)`` bias).

    Two ways to write the model:

    * **reparametrised** (``latent_logpdf=None``): ``draw_latent`` draws noise
      whose law does not depend on ``theta`` (``z ~ N(0, 1)`` per row) and
      ``release`` maps it to the rows (``x = sqrt(theta) z``); the score is
      ``E[d log h(y | phi(theta, z)) | y]``, differentiated through the
      rows (``h`` must be differentiable almost everywhere, as a Laplace
      density of a sorted statistic is).  Checked: a ``draw_latent`` that
      moves with ``theta`` is refused;
    * **the thesis's** (``latent_logpdf`` given): ``draw_latent`` draws the
      rows at ``theta`` and ``latent_logpdf`` is their log density; the score
      is ``E[sum_i d log p(x_i | theta) | y]``.  ``h`` need not be
      differentiable (``release`` may ignore ``theta``).

    Both estimate the same ``F``; which has the smaller Monte Carlo error
    depends on the release.  Everything here is simulated from the model
    (public): no data.

    Parameters
    ----------
    key : jax.Array
        A PRNG key (the simulation's; nothing private).
    draw_latent : callable
        ``(key, theta) -> latent``, a pytree (e.g. the ``n`` rows, or their
        reparametrising noise).
    release : callable
        ``(theta, latent) -> numpyro.distributions.Distribution``: the
        release's law given the latent rows (its ``log_prob`` is ``log h``,
        summed over the release's coordinates; its ``sample`` simulates the
        releases), e.g. ``dist.Laplace(median(x), S(x) / alpha)``.
    theta : array_like
        The parameter (scalar or vector) at which to evaluate.
    latent_logpdf : callable, optional
        ``(theta, latent) -> log p(latent | theta)`` (summed), JAX-differentiable
        in ``theta``; required when the latent law depends on ``theta``.
    num_releases : int
        Releases simulated (the outer Monte Carlo).
    num_particles : int
        Latent draws per particle set (two sets per release; memory holds the
        ``2 * num_particles`` latents of one release at a time).

    Returns
    -------
    MarginalFisher
        ``fisher`` ``(p, p)``, its Monte Carlo ``stderr`` and the importance
        samplers' ``ess`` per release.
    """
    for name, value, least in (("num_releases", num_releases, 2),
                               ("num_particles", num_particles, 2)):
        if not (isinstance(value, (int, np.integer)) and value >= least):
            raise ValueError(f"{name}={value!r} must be an integer >= {least}.")
    theta = jnp.asarray(theta, jnp.result_type(float))
    flat, _ = _as_vector(theta)
    if latent_logpdf is None:
        _check_latent_free_of_theta(draw_latent, theta)
    program = _marginal_fisher_program(draw_latent, release, latent_logpdf, jnp.ndim(theta) == 0,
                                       int(num_releases), int(num_particles))
    score_a, score_b, ess = (np.asarray(v, np.float64) for v in program(key, flat))
    products = 0.5 * (score_a[:, :, None] * score_b[:, None, :]
                      + score_b[:, :, None] * score_a[:, None, :])
    return MarginalFisher(products.mean(axis=0),
                          products.std(axis=0, ddof=1) / np.sqrt(num_releases), ess)
