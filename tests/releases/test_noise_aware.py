"""ndp.NoiseAwareNUTS (issue 37): releases once, charged first; then NUTS on the
surrogate for free, as NumPyro's MCMC runs; the release is a public object that
can be saved, loaded and sampled again without the rows."""

import dataclasses
import itertools
import math
import warnings

import arviz as az
import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import make_logistic_data
from _support.running import BackendCompiles
from numpyro.infer import MCMC, NUTS, Predictive

import numpyro_dp as ndp
from numpyro_dp.model.adapter import PrivateModel
from numpyro_dp.primitives import row_statistics
from numpyro_dp.releases import noise_aware, score, score_budget, score_release
from numpyro_dp.runner import clip_selection, warm_start

N, D = 2000, 2
EPSILON, DELTA = 3.0, 1e-6


def model(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    scale = numpyro.deterministic("scale", jnp.exp(b0))  # data-free: kept
    with numpyro.plate("data", X.shape[0]):
        numpyro.deterministic("eta", b0 + X @ w)  # per row: left out
        numpyro.sample("y", dist.Bernoulli(logits=b0 + X @ w), obs=y)
    return scale


@pytest.fixture(scope="module")
def data():
    return make_logistic_data(N, D, seed=3, w_true=[1.0, -0.5])


@pytest.fixture(scope="module")
def fitted(data):
    X, y = data
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=300, num_samples=300,
                           num_chains=2, chain_method="vectorized", epsilon=EPSILON,
                           delta=DELTA, progress_bar=False,
                           reproducible_noise=True)  # a fixed seed: the tests' one release
    with pytest.warns(UserWarning, match="eta"):
        mcmc.run(jax.random.PRNGKey(0), X, y=y, extra_fields=("diverging", "num_steps"))
    return mcmc


def test_charges_the_releases_once_then_samples_for_free(fitted, data):
    spent = fitted.privacy_spent()
    phases = [(e.phase, e.num_chains, e.num_iterations) for e in spent.ledger]
    assert phases == [("clip selection", 1, 4), ("warm start", 1, 1),
                      ("anchor stage 1", 1, 1), ("score release", 1, 1),
                      ("warmup+sample", 2, 600), ("notes", 1, 0)]
    assert 0.999 * EPSILON < spent.epsilon <= EPSILON
    # The ledger's notes say where the anchor lay (post-processing of the release, free).
    notes = spent.ledger[-1]
    assert notes.per_iteration == dpa.NoOpDpEvent() and notes.label == str(fitted.release)
    assert f"{fitted.release.anchor_distance():.2g} posterior sds" in str(spent)
    sampling = spent.ledger[-2]
    assert sampling.per_iteration == ndp.NoiseAwareNUTS(model).per_iteration_event()
    assert fitted.get_extra_fields()["diverging"].shape == (600,)
    # A second call draws more: nothing is charged, the release is the same object.
    release = fitted.release
    X, y = data
    fitted.run(jax.random.PRNGKey(1), X, y=y)
    assert fitted.privacy_spent().epsilon == spent.epsilon
    assert fitted.release is release


def test_draws_work_as_numpyros(fitted, data):
    X, _ = data
    samples = fitted.get_samples()
    assert set(samples) == {"b0", "w", "scale"}  # the per-row deterministic is left out
    assert samples["w"].shape == (600, D)
    np.testing.assert_allclose(samples["scale"], np.exp(samples["b0"]), rtol=1e-5)
    assert fitted.mixing.max_rhat < 1.05
    idata = ndp.to_inference_data(fitted)
    assert az.summary(idata, var_names=["w"]).shape[0] == D
    pred = Predictive(model, fitted.get_samples())(jax.random.PRNGKey(2), X)
    assert pred["y"].shape == (600, N)


def test_posterior_is_near_nuts_and_calibrated(fitted, data):
    """Against NUTS on the same data: within a few private sds (the release's noise
    at epsilon 3, n = 2000, is about half a posterior sd), and about as wide."""
    X, y = data
    ref = MCMC(NUTS(model), num_warmup=300, num_samples=600, progress_bar=False)
    ref.run(jax.random.PRNGKey(3), X, y=y)
    for name in ("b0", "w"):
        private, exact = np.asarray(fitted.get_samples()[name]), np.asarray(ref.get_samples()[name])
        z = np.abs(private.mean(0) - exact.mean(0)) / private.std(0)
        assert np.all(z < 3.0), (name, z)
        assert np.all((private.std(0) / exact.std(0) > 0.8) & (private.std(0) / exact.std(0) < 2))


def test_release_holds_released_values_and_public_facts_only(fitted, data):
    release = fitted.release
    X, _ = data
    assert release.num_rows == N and release.neighbourhood == "substitute"
    assert release.param_shapes == {"b0": (), "w": (D,)}
    # The stand-in arguments: one zero row, nothing of the data.
    (x_stand_in,), kwargs = release.model_args, release.model_kwargs
    assert x_stand_in.shape == (1, D) and not np.any(x_stand_in)
    assert not np.any(kwargs["y"])
    for field in dataclasses.fields(release):
        value = getattr(release, field.name)
        assert not (np.ndim(value) and np.shape(value)[0] == N), field.name
    assert 0.0 <= release.clipped_share <= 1.0
    assert "posterior sds from the release's mode" in str(release)


def test_neighbours_differ_only_through_the_noise(data):
    """An attacker's comparison: with the same (test-only) noise, the public facts of
    two neighbours' releases are identical, and every released number moves when only
    the noise changes (none is an exact function of the rows)."""
    X, y = data
    y2 = y.copy()
    y2[0] = 1 - y2[0]

    def release(rows_y, seed):
        mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=5, num_samples=5,
                               epsilon=EPSILON, delta=DELTA, progress_bar=False,
                               reproducible_noise=True, check_mixing=False)
        with pytest.warns(UserWarning):
            mcmc.run(jax.random.PRNGKey(seed), X, y=rows_y)
        return mcmc.release

    a, b, c = release(y, 0), release(y2, 0), release(y, 1)
    for name in ("num_rows", "neighbourhood", "param_shapes", "data_plate"):
        assert getattr(a, name) == getattr(b, name)
    jax.tree.map(np.testing.assert_array_equal, (a.model_args, a.model_kwargs),
                 (b.model_args, b.model_kwargs))
    for name in ("anchor", "whiten", "score", "curvature"):
        assert not np.allclose(getattr(a, name), getattr(c, name)), name


def test_a_release_is_saved_loaded_and_sampled_without_the_rows(fitted, data, tmp_path):
    fitted.release.save(tmp_path / "release")
    loaded = ndp.ScoreRelease.load(tmp_path / "release")
    for field in ("anchor", "whiten", "score", "curvature"):
        np.testing.assert_array_equal(getattr(loaded, field), getattr(fitted.release, field))
    assert loaded.param_shapes == fitted.release.param_shapes
    # A new runner on the loaded release charges nothing and reads no row: rows of
    # zeros give the draws that the data give.
    X, y = data
    draws = []
    for rows in ((X, y), (np.zeros_like(X), np.zeros_like(y))):
        mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model, release=loaded), num_warmup=100,
                               num_samples=100, epsilon=1.0, delta=DELTA, progress_bar=False)
        with pytest.warns(UserWarning, match="eta"):
            mcmc.run(jax.random.PRNGKey(5), rows[0], y=rows[1])
        assert mcmc.privacy_spent().epsilon == 0.0
        draws.append(mcmc.get_samples()["w"])
    np.testing.assert_array_equal(*draws)
    # The surrogate is an ordinary NumPyro model.
    plain = MCMC(NUTS(noise_aware.surrogate_model(model, loaded)), num_warmup=100,
                 num_samples=100, progress_bar=False)
    plain.run(jax.random.PRNGKey(6))
    assert noise_aware.RELEASE_SITE not in plain.get_samples()
    assert abs(plain.get_samples()["w"].mean(0) - draws[0].mean(0)).max() < 0.1


def test_the_chains_start_in_one_program_shared_by_every_release(fitted, data):
    """NumPyro's init of the surrogate's chains, run op by op, compiled a program per
    operation on a run's first call; compiled, it is one.  The release's numbers are
    arguments of the programs: another release of the model compiles nothing."""
    X, y = data
    other = dataclasses.replace(fitted.release, score=fitted.release.score + 0.1,
                                anchor=fitted.release.anchor - 0.01)
    compiles = BackendCompiles()
    draws = []
    for release, expected in ((fitted.release, 12), (other, 0)):  # 3 chains: new shapes
        with compiles, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model, release=release),
                                   num_warmup=10, num_samples=10, num_chains=3,
                                   chain_method="vectorized", epsilon=1.0, delta=DELTA,
                                   progress_bar=False)
            mcmc.run(jax.random.PRNGKey(7), X, y=y)
        assert compiles.count <= expected  # op by op: 40 the first time (8 compiled)
        draws.append(np.asarray(mcmc.get_samples()["w"]))
    assert not np.array_equal(*draws)  # the program read the new release


def test_a_surrogate_finite_nowhere_its_chains_start_is_a_clear_error(fitted, data):
    X, y = data
    # An anchor far out: the surrogate's likelihood, quadratic in the distance from
    # it, overflows at the anchor and at the prior's median alike.
    anchor = fitted.release.anchor.copy()
    anchor[:] = 1e30
    broken = dataclasses.replace(fitted.release, anchor=anchor)
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model, release=broken), num_warmup=10,
                           num_samples=10, epsilon=1.0, delta=DELTA, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="not finite at the release's anchor"):
            mcmc.run(jax.random.PRNGKey(8), X, y=y)


def test_refused_where_it_cannot_run(data):
    X, y = data

    def discrete(X, y=None):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=k * X[:, 0]), obs=y)

    with pytest.raises(ndp.ModelSpecificationError, match="discrete"):
        ndp.PrivateMCMC(ndp.NoiseAwareNUTS(discrete), num_warmup=5, num_samples=5,
                        epsilon=EPSILON, delta=DELTA).run(jax.random.PRNGKey(0), X, y=y)
    # Plain NumPyro cannot run it: nothing would be charged.
    with pytest.raises(RuntimeError, match="PrivateMCMC"):
        MCMC(ndp.NoiseAwareNUTS(model), num_warmup=5, num_samples=5,
             progress_bar=False).run(jax.random.PRNGKey(0), X, y=y)
    # A budget that cannot pay is refused before anything is charged.
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=5, num_samples=5,
                           epsilon=1e-4, delta=DELTA, progress_bar=False)
    with pytest.raises(ndp.PrivacyBudgetError):
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    assert mcmc.privacy_spent().num_releases == 0


def test_a_budget_whose_release_would_drown_is_refused_before_anything_is_spent(data):
    """200 rows at epsilon 0.3: the last curvature's noise would be about 7 times the
    curvature (public facts: d, n and the noise multiplier); the run is refused before
    any release is charged, with an error that says what to change."""
    X, y = data
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(model), num_warmup=50, num_samples=50,
                           epsilon=0.3, delta=DELTA, progress_bar=False, check_mixing=False)
    with pytest.raises(ndp.UnusableReleaseError, match="Nothing was spent.*larger epsilon"):
        mcmc.run(jax.random.PRNGKey(0), X[:200], y=y[:200])
    assert mcmc.privacy_spent().num_releases == 0 and mcmc.release is None


def test_a_release_too_noisy_for_its_model_is_flagged(fitted):
    """A release whose curvature does not stand out of its noise is sampled with a
    CalibrationWarning that says why (here the fitted release with its curvature's
    noise sd raised: what a release near the refusal threshold looks like)."""
    noisy = dataclasses.replace(fitted.release, curvature_sd=10 * fitted.release.curvature_sd
                                + float(np.abs(fitted.release.curvature).max()))
    assert not noisy.trusted()[0]
    with pytest.warns(ndp.CalibrationWarning, match="too noisy"):
        ndp.NoiseAwareNUTS(model, release=noisy)


def test_stage_noise_adds_up_to_the_phase():
    """The stages' Gaussian releases form one mechanism of the phase's noise multiplier."""
    for z, d, n in [(3.7, 9, 6366), (3.7, 30, 500), (0.5, 9, 10**5)]:
        mu2 = 0.0
        for stage in range(len(score_budget.STAGE_SHARES)):
            z_hist, z_score, z_curv = score_budget.release_noise(z, stage, d, n, 2.0)
            mu2 += 2 / z_hist**2 + 1 / z_score**2 + 1 / z_curv**2
        assert mu2 <= 1 / z**2 and mu2 == pytest.approx(1 / z**2, rel=1e-8)


def test_the_last_curvature_takes_more_where_its_noise_would_drown_it():
    """The last stage's curvature share grows with the noise and the dimension and
    shrinks with the rows, between its bounds, from public facts only; where it is
    raised, its noise's spectral scale is the target."""
    least, largest = score_budget.RELEASE_CURVATURE_SHARES
    share = score_budget.release_curvature_share
    assert share(0.5, 9, 10**5, 2.0) == least
    assert share(50.0, 9, 100, 2.0) == largest
    shares = [share(z, 9, 6366, 2.0) for z in (1.0, 2.0, 4.0, 6.0, 8.0)]
    assert shares == sorted(shares) and least < shares[2] < largest
    assert share(4.0, 9, 6366, 1.0) < shares[2] and share(4.0, 9, 20000, 2.0) < shares[2]
    z, d, n = 4.0, 9, 6366
    z_curv = score_budget.release_noise(z, 1, d, n, 2.0)[2]
    sigma_h = z_curv * 2.0 * warm_start.TYPICAL_CLIPS * d / n
    assert 2 * sigma_h * math.sqrt(d) == pytest.approx(score_budget.CURVATURE_NOISE_TARGET,
                                                       rel=1e-6)


def test_an_earlier_stage_that_clipped_many_rows_does_not_join():
    """An anchor stage whose clip cut more than COMBINE_MAX_CLIPPED of the rows (its
    score biased by the tail it cut) is left out of the combination; one that cut
    fewer joins; the last stage always stays."""
    stages = ["anchor", "last"]
    cap = score.COMBINE_MAX_CLIPPED
    assert score.joinable(stages, [2 * cap, 0.5]) == ["last"]
    assert score.joinable(stages, [cap / 2, 0.5]) == stages
    assert score.joinable(["last"], [0.3]) == ["last"]


def test_combined_scores_are_unbiased_with_the_stated_covariance():
    """On a cubic log-likelihood (closed form), an earlier stage's score moved to the
    last anchor by the trapezoid rule observes the same score: the GLS combination is
    unbiased (the one-sided move by the last curvature alone would err by
    T[u, u] / 2, here over 10 standard errors), its noise covariance is the one
    stated, and smaller than the last stage's alone; a stage farther than
    COMBINE_RADIUS, or whose curvature does not stand out of its noise, is left out."""
    rng = np.random.default_rng(0)
    d, draws = 3, 20_000
    a = rng.normal(size=(d, d))
    k = np.eye(d) + 0.1 * (a + a.T)  # the whitened curvature at the last anchor (exact)
    t = rng.normal(size=(d, d, d))
    t = 0.05 * sum(t.transpose(p) for p in itertools.permutations(range(3)))  # symmetric
    s = rng.normal(size=d)  # the exact score at the last anchor
    last_whiten = np.linalg.cholesky(np.eye(d) + 0.2 * np.ones((d, d)))
    whiten_1 = last_whiten @ np.diag([1.3, 0.8, 1.1])  # stage 1's whitening
    u = np.array([1.2, -1.5, 0.9])  # stage 1's anchor, in the last stage's whitened units
    m = np.linalg.solve(last_whiten, whiten_1)
    score_1 = s - k @ u - 0.5 * np.einsum("ijk,j,k->i", t, u, u)  # the score at u
    curvature_1 = m.T @ (k + np.einsum("ijk,k->ij", t, u)) @ m  # stage 1's, its coordinates
    sd_1, sd_2 = 1.5, 1.0
    estimates = np.empty((draws, d))
    for i in range(draws):
        g_1 = m.T @ score_1 + sd_1 * rng.normal(size=d)
        g_2 = s + sd_2 * rng.normal(size=d)
        stages = [(last_whiten @ u, whiten_1, g_1, sd_1, curvature_1, 0.0),
                  (np.zeros(d), last_whiten, g_2, sd_2, k, 0.0)]
        estimates[i], covariance, combined = score.combine_scores(stages)
    assert combined == 2
    standard_error = np.sqrt(np.diag(covariance) / draws)
    np.testing.assert_array_less(np.abs(estimates.mean(0) - s), 4 * standard_error)
    one_sided_bias = covariance @ np.linalg.inv(sd_1**2 * np.linalg.inv(m @ m.T)) @ (
        0.5 * np.einsum("ijk,j,k->i", t, u, u))
    assert np.max(np.abs(one_sided_bias) / standard_error) > 10
    # The covariance estimate's relative error is about sqrt(2 / draws) = 1%.
    np.testing.assert_allclose(np.cov(estimates, rowvar=False), covariance, atol=0.05 * sd_2**2)
    assert np.all(np.linalg.eigvalsh(sd_2**2 * np.eye(d) - covariance) > 0)
    far = [(last_whiten @ (u * 5), whiten_1, g_1, sd_1, curvature_1, 0.0),
           (np.zeros(d), last_whiten, g_2, sd_2, k, 0.0)]
    noisy = [stages[0][:5] + (1.0,), stages[1]]  # margin 2 sqrt(3) > its eigenvalues
    for left_out in (far, noisy):
        g, covariance, combined = score.combine_scores(left_out)
        assert combined == 1
        np.testing.assert_allclose(g, g_2)
        np.testing.assert_allclose(covariance, sd_2**2 * np.eye(d))
    roomy = np.array([1.0, 2.0, 1.0])  # a score with room: its noise sd per coordinate
    g, covariance, _ = score.combine_scores([far[0], far[1][:3] + (sd_2 * roomy,) + far[1][4:]])
    np.testing.assert_allclose(g, g_2)
    np.testing.assert_allclose(covariance, np.diag((sd_2 * roomy) ** 2))


def test_curvature_noise_enters_the_combination_as_stated():
    """With noisy curvatures (the last stage's and the earlier stage's), the combined
    score's spread matches the stated covariance (first order in the noise)."""
    rng = np.random.default_rng(1)
    d, draws = 3, 20_000
    k = np.eye(d)
    s = rng.normal(size=d)
    whiten_1 = np.diag([1.2, 0.9, 1.0])
    m = whiten_1  # the last whitening is the identity
    u = np.array([1.0, -1.2, 0.5])
    sd_1, sd_2, sd_h1, sd_h = 1.0, 1.0, 0.05, 0.04

    def noise(sd):
        e = sd * rng.normal(size=(d, d))
        return (e + e.T) / 2

    estimates = np.empty((draws, d))
    for i in range(draws):
        g_1 = m.T @ (s - k @ u) + sd_1 * rng.normal(size=d)
        g_2 = s + sd_2 * rng.normal(size=d)
        k_last = k + noise(sd_h)
        stages = [(u, whiten_1, g_1, sd_1, m.T @ k @ m + noise(sd_h1), sd_h1),
                  (np.zeros(d), np.eye(d), g_2, sd_2, k_last, sd_h)]
        estimates[i], covariance, _ = score.combine_scores(stages)
    np.testing.assert_allclose(np.cov(estimates, rowvar=False), covariance, atol=0.05 * sd_2**2)


def test_the_surrogate_likelihood_is_gaussian_with_the_noise_at_the_mode(fitted):
    """The release's likelihood in ``v`` is ``N(g; K+ v, C)`` with one covariance ``C``,
    the curvature noise's taken at the release's mode: its Hessian is the same at every
    ``v``, so with a flat prior the posterior is ``N(K+^-1 g, K+^-1 C K+^-1)``, the
    one-step estimator's sampling law (SPEC s12)."""
    release = dataclasses.replace(fitted.release, curvature_sd=0.05)
    d = release.num_params
    k, g = score_release.psd(release.curvature), release.score
    mode = release.whitened_mode()
    covariance = release.likelihood_covariance()
    np.testing.assert_allclose(
        covariance, k + release.score_covariance
        + 0.5 * 0.05**2 * (mode @ mode * np.eye(d) + np.outer(mode, mode)), rtol=1e-12)
    precision = k @ np.linalg.solve(covariance, k)
    for v in (np.zeros(d), mode, 3.0 * np.ones(d)):
        r = g - k @ v
        want = -0.5 * (r @ np.linalg.solve(covariance, r) + np.linalg.slogdet(covariance)[1]
                       + d * math.log(2 * math.pi))
        np.testing.assert_allclose(float(release.log_likelihood(jnp.asarray(v))), want,
                                   rtol=1e-5)
        hessian = jax.hessian(release.log_likelihood)(jnp.asarray(v, jnp.float32))
        np.testing.assert_allclose(hessian, -precision, rtol=1e-4, atol=1e-4)


def linear_model(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(b0 + X @ w, sigma), obs=y)


def test_positive_latents_are_warned_of(fitted):
    """Simulation-based calibration (docs/results/sbc_grid.md) found the intervals of
    models with a noise scale too narrow with no other warning (a linear model at
    n = 20,000): a model with a positive latent is warned of, from its structure
    alone; the logistic model, which has none, is not."""
    assert noise_aware.positive_latents(model, fitted.release) == []
    release = dataclasses.replace(
        fitted.release, param_shapes={**fitted.release.param_shapes, "sigma": ()})
    assert noise_aware.positive_latents(linear_model, release) == ["sigma"]
    with pytest.warns(ndp.CalibrationWarning,
                      match="sigma: positive latent .* private sds from the private one"):
        noise_aware.check_release(fitted.release, refuse=False, scales=["sigma"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noise_scale_gets_room_in_the_score_clip(seed):
    """sigma's score per row, ``r^2 / sigma^2 - 1``, has a chi-square tail: at the clip
    the release takes (TYPICAL_CLIPS times a row's typical whitened score), the clipped
    sum of the whitened log-sigma scores at the true parameters falls 0.25-0.5
    posterior sds short of the unclipped sum (n = 2000); with SCALE_SCORE_ROOM its
    shortfall is below 0.2, and the other coordinates, which have no room, hardly move."""
    n, sigma = 2000, 0.7
    rng = np.random.default_rng(seed)
    X = rng.uniform(-1, 1, (n, 2))
    y = 0.3 + X @ np.array([1.0, -0.5]) + sigma * rng.normal(size=n)
    pm = PrivateModel(linear_model, (X,), {"y": y})
    room = score.score_room(pm)
    np.testing.assert_array_equal(room, pm.ravel(
        {"b0": 1.0, "w": jnp.ones(2), "sigma": score.SCALE_SCORE_ROOM}))
    theta = pm.ravel({"b0": 0.3, "w": jnp.array([1.0, -0.5]), "sigma": jnp.log(sigma)})
    whiten = jnp.diag(pm.ravel({  # about the posterior sds
        "b0": sigma / np.sqrt(n), "w": jnp.full(2, sigma / np.sqrt(n / 3)),
        "sigma": 1 / np.sqrt(2 * n)}))
    clip = warm_start.TYPICAL_CLIPS * np.sqrt(4 / n)

    def total(clip, room=None):
        hi, lo = row_statistics.clipped_grad_and_hessian_sums(
            pm, theta, clip, None, (X,), {"y": y}, 1, whiten, room)[0]
        return (np.asarray(hi, float) + np.asarray(lo, float)) * (1.0 if room is None
                                                                  else room)

    exact = total(10.0)
    short = total(clip) - exact
    roomy = total(clip, jnp.asarray(room)) - exact
    s = int(np.argmax(room))
    assert -0.5 < short[s] < -0.25 and -0.2 < roomy[s] < 0, (short, roomy)
    assert np.max(np.abs(np.delete(roomy - short, s))) < 0.1


def test_a_clip_is_never_below_a_rows_typical_whitened_value():
    """Where the histogram's noise hides the rows, its quantile is far below where they
    lie (turnout, n = 2000 at epsilon 1: 15-55% of the rows cut); the clip is then
    TYPICAL_CLIPS times a row's typical whitened value. Where the histogram sees rows
    above that, they set it."""
    n, d = 2000, 5
    typical = np.sqrt(d / n)
    edges = clip_selection.SCALE_GRID
    counts = np.zeros(edges.size + 1)
    counts[np.searchsorted(edges, typical / 2)] = n  # all rows, one bin, no noise
    low = score.release_clip(counts, n, 0.0, 10.0, typical)
    assert low == warm_start.TYPICAL_CLIPS * typical
    counts[np.searchsorted(edges, 100 * typical)] = 500  # heavy rows the histogram sees
    assert score.release_clip(counts, n, 0.0, 10.0, typical) > 100 * typical


def test_a_release_whose_anchor_is_far_from_its_mode_is_refused(fitted):
    """A release whose mode lies more than MAX_MODEL_DISTANCE anchor sds away is refused
    after its charge (post-processing: it says how far); passed back explicitly, it is
    sampled with a CalibrationWarning, the user's choice."""
    release = fitted.release
    k = score_release.psd(release.curvature)
    far = dataclasses.replace(release, score=k @ np.full(release.num_params, 40.0))
    assert far.anchor_distance() > score_release.MAX_MODEL_DISTANCE
    with pytest.raises(ndp.UnusableReleaseError, match="anchor lies 40"):
        noise_aware.check_release(far, refuse=True)
    with pytest.warns(ndp.CalibrationWarning, match="40"):
        ndp.NoiseAwareNUTS(model, release=far)
    noise_aware.check_release(release, refuse=True)  # the fitted one: usable


def intercepts_model(X, g, y=None):
    """Random intercepts: mu and tau reach the rows only through the groups' a."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("groups", 6):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] + X @ w, sigma), obs=y)


def test_a_whitening_puts_the_likelihoods_coordinates_first():
    """ordered_factor: a factor of the covariance whose leading columns alone reach the
    likelihood's coordinates, so a row's whitened score is zero past them."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 5))
    cov = a @ a.T + np.eye(5)
    order = np.array([1, 3, 4, 0, 2])
    L = score.ordered_factor(cov, order)
    np.testing.assert_allclose(L @ L.T, cov, rtol=1e-10)
    np.testing.assert_array_equal(np.triu(L[order], 1), 0.0)
    grad = np.zeros(5)
    grad[[1, 3, 4]] = rng.normal(size=3)  # a score on the first three of the order
    assert np.all((L.T @ grad)[3:] == 0.0)


@pytest.mark.slow  # make test-all
def test_a_hierarchical_model_releases_only_what_its_likelihood_reads():
    """A group mean and sd that only the prior reads get no noise: the release covers
    the other coordinates (k = d - 2), its curvature stands out of its noise (before,
    the noise along mu and tau made it untrustworthy in every run and refused most:
    docs/results/sbc_grid.md), and the posterior is NUTS's within the release's noise."""
    n, groups = 6000, 6
    rng = np.random.default_rng(4)
    X = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    g = np.arange(n) % groups
    a = 0.5 + 0.7 * rng.normal(size=groups)
    y = (a[g] + X @ np.array([1.0, -0.5]) + 0.8 * rng.normal(size=n)).astype(np.float32)
    pm = PrivateModel(intercepts_model, (X, g), {"y": y})
    read = pm.unravel(jnp.asarray(pm.likelihood_coordinates, float))
    assert {k: bool(np.all(v)) for k, v in read.items()} == {
        "w": True, "mu": False, "tau": False, "a": True, "sigma": True}
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(intercepts_model), num_warmup=500,
                           num_samples=1000, num_chains=2, chain_method="vectorized",
                           epsilon=10.0, delta=DELTA, progress_bar=False,
                           reproducible_noise=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(0), X, g, y=y)
    release = mcmc.release
    assert release.num_released == release.num_params - 2 == groups + 2 + 1
    assert release.trusted()[0], release.trusted()[1]
    assert not [w for w in caught if issubclass(w.category, ndp.CalibrationWarning)
                and "positive latent" not in str(w.message)]
    ref = MCMC(NUTS(intercepts_model), num_warmup=500, num_samples=2000, progress_bar=False)
    ref.run(jax.random.PRNGKey(1), X, g, y=y)
    for name in ("w", "a", "sigma", "mu", "tau"):
        private = np.asarray(mcmc.get_samples()[name]).reshape(2000, -1)
        exact = np.asarray(ref.get_samples()[name]).reshape(2000, -1)
        z = np.abs(private.mean(0) - exact.mean(0)) / private.std(0)
        ratio = private.std(0) / exact.std(0)
        assert np.all(z < 3.0), (name, z)
        assert np.all((ratio > 0.8) & (ratio < 1.5)), (name, ratio)


@pytest.mark.slow  # make test-all: n = 5,000 against the truth (30 s)
def test_an_improper_flat_prior_is_served():
    """Issue 37, item 6: the models the gradient kernels accept, improper priors
    included: NoiseAwareNUTS never draws from the prior (its anchor is constrained
    without a draw, its positive latents read off the structure), and the posterior
    lies near the truth (n = 5,000, epsilon 10)."""
    def flat(X, y=None):
        w = numpyro.sample("w", dist.ImproperUniform(dist.constraints.real, (), (2,)))
        sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    rng = np.random.default_rng(0)
    X = rng.normal(size=(5000, 2)).astype(np.float32)
    y = (X @ np.array([0.5, -0.3]) + 0.7 * rng.normal(size=5000)).astype(np.float32)
    mcmc = ndp.PrivateMCMC(ndp.NoiseAwareNUTS(flat), num_warmup=200, num_samples=200,
                           num_chains=2, chain_method="vectorized", epsilon=10.0, delta=1e-6,
                           progress_bar=False, reproducible_noise=True)
    with pytest.warns(ndp.CalibrationWarning, match="sigma: positive latent"):
        mcmc.run(jax.random.PRNGKey(0), X, y=y)
    draws = mcmc.get_samples()
    for value, truth in ((draws["w"], np.array([0.5, -0.3])), (draws["sigma"], 0.7)):
        value = np.asarray(value)
        assert np.all(np.abs(value.mean(0) - truth) < 4 * value.std(0))
