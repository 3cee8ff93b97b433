"""ndp.audit (issues 20, 36): the audits are sound on the library's mechanisms and catch
broken ones.

Every configuration is small and seeded (``reproducible_noise``: the audit's own
made-up data, so the noise need not be secret).  An audit passes when its
lower bound is at most the claimed epsilon; each power test breaks one
mechanism the way a bug would (``audit.fault``: the noise halved, the clip
skipped for the canary row, a chain not charged, the noise multiplier divided
in a kernel after the charge) and requires the audit to fail.  ``delta =
0.01`` (n = 20 rows): Gaussian audits have power where epsilon(delta) is not
set by tail events that a few thousand runs never see.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import init_to_value

import numpyro_dp as ndp
from numpyro_dp import audit
from numpyro_dp.evaluation.canary import (
    CANARY,
    DELTA,
    KERNEL_AUDIT_CANARY,
    KERNELS,
    ROWS,
    barker_batch,
    batch_ratios,
    canary_rows,
    draw_score,
    mean_model,
    neighbours,
)
from numpyro_dp.kernels import hmc, penalty, ratios, sg_dynamics
from numpyro_dp.primitives import clipping, compiled, rounding, tap
from numpyro_dp.primitives import release as gate

#: An audit compiles its runs afresh and runs them briefly (conftest).
pytestmark = pytest.mark.compile_bound


def sgld(step_size=1.0):
    """One full-batch DP-SGLD step from theta = 0: theta_1 = (eta/2) G + N(0, eta), an
    exact Gaussian channel with mu = sqrt(eta) for a clip of 1 (z = 1 / sqrt(eta))."""
    return ndp.DPSGLD(mean_model, step_size=step_size, batch_size=ROWS, grad_clip=1.0,
                      init_strategy=init_to_value(values={"theta": 0.0}))


def sgld_audit(chains_per_run=1, num_runs=4000):
    data, neighbour = neighbours()
    return audit.multi_run(sgld(), data, neighbour, delta=DELTA, score=draw_score,
                           num_runs=num_runs, chains_per_run=chains_per_run,
                           reproducible_noise=True)


# ------------------------------------------------------------------ white box
def scalar_rows():
    return canary_rows(), -canary_rows()


def test_white_box_release_meets_its_claim():
    result = audit.clipped_sum_release(*scalar_rows(), row_bound=1.0, noise_multiplier=1.0,
                                       delta=DELTA, reproducible_noise=True)
    assert result.passed, result
    assert result.epsilon_lower_bound > 0.9 * result.claimed_epsilon  # and is nearly tight
    x = np.zeros((ROWS, 3), np.float32)
    x[-1] = [3.0, 4.0, 0.0]
    vector = audit.clipped_sum_release(x, -x, row_bound=1.0, noise_multiplier=2.0,
                                       delta=DELTA, reproducible_noise=True)
    assert vector.passed and vector.epsilon_lower_bound > 0.9 * vector.claimed_epsilon


@pytest.mark.parametrize("broken", ["noise_halved", "canary_unclipped"])
def test_white_box_release_catches_a_broken_release(broken):
    with audit.fault(broken):
        result = audit.clipped_sum_release(*scalar_rows(), row_bound=1.0,
                                           noise_multiplier=1.0, delta=DELTA,
                                           reproducible_noise=True)
    assert not result.passed, result
    assert "VIOLATES" in str(result)


@pytest.mark.parametrize("broken", [None, "noise_halved", "canary_unclipped"])
def test_white_box_audit_of_the_minibatch_penalty_release(broken):
    with audit.fault(broken) if broken else contextlib.nullcontext():
        result = audit.batch_llr_release(*batch_ratios(), clip=1.0, scale=2.0,
                                         noise_multiplier=1.0, delta=DELTA,
                                         reproducible_noise=True)
    assert result.passed == (broken is None), result
    if broken is None:  # the worst case is reached: the audit is nearly tight
        assert "realised sensitivity / nominal = 1" in result.details


@pytest.mark.parametrize("broken", [None, "canary_unclipped"])
def test_white_box_audit_of_the_barker_test(broken):
    with audit.fault(broken) if broken else contextlib.nullcontext():
        result = audit.barker_test(barker_batch(), -barker_batch(), n0=50, delta=DELTA,
                                   reproducible_noise=True)
    assert result.passed == (broken is None), result


# ----------------------------------------------------- white box, kernel end to end
def kernel(name, data="full", neighbourhood="substitute"):
    """The canary problem's kernel ``name`` on ``data`` (numpyro_dp.evaluation.canary.KERNELS)."""
    (found,) = [k for k in KERNELS if k.name == name and k.data.startswith(data)]
    return found.make(neighbourhood)


def kernel_audit(name, data="full", neighbourhood="substitute", **options):
    return audit.audit_kernel(kernel(name, data, neighbourhood),
                              *neighbours(neighbourhood, KERNEL_AUDIT_CANARY), delta=DELTA,
                              **options)


def test_kernel_audit_of_dppenalty_is_tight():
    """The canary reaches the clip at every state: the releases as made deliver the
    epsilon charged, up to the rounding that the charge adds."""
    result = kernel_audit("DPPenalty")
    assert result.passed, result
    assert result.method == "white-box kernel" and result.confidence == 1.0
    assert result.num_trials == 10 and "10 releases made, 10 charged" in result.details
    assert result.epsilon_lower_bound > 0.999 * result.claimed_epsilon


@pytest.mark.parametrize("divisor", [3, pytest.param(30, marks=pytest.mark.slow)])
def test_kernel_audit_catches_the_noise_divided_in_the_kernel(divisor):
    """Issue 36: DPPenalty's LLR release passed a third (or a thirtieth) of the charged
    noise multiplier; the multi-run audit's bound stayed at 0.51 against a claim of 3.99."""
    with audit.fault("kernel_noise_divided", divisor=divisor):
        result = kernel_audit("DPPenalty")
    assert not result.passed, result
    assert "VIOLATES" in str(result)
    assert f"smallest realised noise / sensitivity {1 / divisor:.4g}" in result.details


def test_kernel_audit_catches_a_chain_not_charged():
    """Issue 36: ``chain_not_charged`` with 2 chains per run, missed by the multi-run audit
    for DPPenalty: more releases made than charged fails on its own."""
    with audit.fault("chain_not_charged"):
        result = kernel_audit("DPPenalty", num_chains=2)
    assert not result.passed, result
    assert result.violations == ("10 releases made but 5 charged: 5 were never paid for",)


@pytest.mark.slow  # make test-all (an audit compiles its runs afresh: ~30 s)
def test_kernel_audit_catches_data_outside_the_releases(monkeypatch):
    """An attack on the replay: a kernel whose accept step reads the data other than
    through a release.  Given the same releases, the draws on two neighbours differ."""
    release = penalty.release_llr

    def leaky(key, ratio, clip, **kwargs):  # the noise sd used by the test depends on the rows
        value, sigma = release(key, ratio, clip, **kwargs)
        return value, jnp.where(jnp.sum(ratio) > 0, 0.0, 100.0) + sigma

    monkeypatch.setattr(penalty, "release_llr", leaky)
    result = kernel_audit("DPPenalty")
    assert not result.passed and "differ" in result.violations[0], result


@pytest.mark.slow  # make test-all (an audit compiles its runs afresh: ~30 s)
def test_kernel_audit_catches_a_noise_key_used_twice(monkeypatch):
    noise_key = penalty.noise_key
    monkeypatch.setattr(penalty, "noise_key",
                        lambda secret, key: noise_key(secret, jnp.zeros(2, jnp.uint32)))
    result = kernel_audit("DPPenalty", num_chains=1)
    assert any("the same noise twice" in v for v in result.violations), result


def test_kernel_audit_refuses_a_neighbour_with_other_batches():
    with pytest.raises(ValueError, match="differ in shape"):
        kernel_audit("DPSGLD", "Poisson", "add_remove")


#: Every kernel in each neighbourhood it supports, but Poisson batches under add/remove:
#: their batches depend on n, so a neighbour without the canary cannot replay the path.
AUDITED = [(k.name, k.data, nb) for k in KERNELS for nb in k.neighbourhoods
           if not (nb == "add_remove" and "Poisson" in k.data)]


@pytest.mark.slow  # make test-all: every kernel (the table is docs/results/audit.md)
@pytest.mark.parametrize("name, data, neighbourhood", AUDITED,
                         ids=[" ".join(case) for case in AUDITED])
def test_every_kernel_passes_its_kernel_audit(name, data, neighbourhood):
    result = kernel_audit(name, data, neighbourhood)
    assert result.passed, result
    if "b = " not in data:  # full data: the canary moves every release by its sensitivity
        assert result.epsilon_lower_bound > 0.99 * result.claimed_epsilon, result
    if data.startswith("Poisson"):  # the canary is in every batch the replay follows
        assert result.epsilon_lower_bound > 0.95 * result.claimed_epsilon, result


@pytest.mark.slow  # make test-all: every fault against both kernels the issue names
@pytest.mark.parametrize("broken", audit.FAULTS)
@pytest.mark.parametrize("name, data", [("DPPenalty", "full"), ("DPSGLD", "Poisson")])
def test_kernel_audit_catches_every_fault(broken, name, data):
    with audit.fault(broken):
        result = kernel_audit(name, data)
    assert not result.passed, result


# ---------------------------------------------------------------- the gate tap
def run_penalty():
    mcmc = ndp.PrivateMCMC(kernel("DPPenalty"), num_warmup=0, num_samples=3, delta=DELTA,
                           progress_bar=False, check_mixing=False)
    mcmc.run(jax.random.PRNGKey(0), canary_rows())
    return mcmc


def test_normal_runs_compile_the_same_shared_program_around_an_audit():
    """The tap adds nothing to a normal run's program: the program compiled before a
    tapped run is the one a run after it takes (a program that calls back into
    Python is never shared), and the tapped run itself compiles its own."""
    start = dict(compiled.stats)
    run_penalty()
    before = dict(compiled.stats)
    programs = sum(before[k] - start[k] for k in ("compiled", "reused"))  # one run's
    recorded = tap.Tap()
    with tap.tapped(recorded):
        run_penalty()
    tapped = dict(compiled.stats)
    assert recorded.count == 3 and tapped["compiled"] == before["compiled"] + 1
    run_penalty()  # every program of the first run, none compiled anew
    assert compiled.stats["compiled"] == tapped["compiled"]
    assert compiled.stats["reused"] == tapped["reused"] + programs


def test_the_tap_reaches_into_functions_jitted_outside_it():
    """``GridPlan.release`` jits ``grid_release``: a trace made outside a tap is not reused
    inside it, nor one made inside it after it."""
    release = jax.jit(rounding.grid_release, static_argnames="noise")
    args = (jax.random.PRNGKey(1), jnp.ones(2), jnp.zeros(2), 1.0, 2.0**-10)
    plain = release(*args)
    recorded = tap.Tap()
    with tap.tapped(recorded):
        tapped = release(*args)
    release(*args)
    (made,) = recorded.releases.values()
    assert recorded.count == 1 and made.gate == "gaussian" and made.scale == 1.0
    np.testing.assert_array_equal(made.statistic, [1.0, 1.0])
    np.testing.assert_array_equal(tapped, plain)


# ------------------------------------------------------------------ multi run
def test_multi_run_bound_on_known_gaussians():
    """The bound of N(mu, 1) against N(0, 1) stays below the exact epsilon(mu)."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000)
    exact = ndp.accounting.gaussian.gaussian_epsilon(1.0, DELTA)
    bound = audit.epsilon_lower_bound(a, b, delta=DELTA)
    assert 0.6 * exact < bound < exact
    assert audit.epsilon_lower_bound(a, rng.normal(1.0, 1.0, 20_000), delta=DELTA) < 0.2


@pytest.mark.slow  # make test-all (20 s): make test keeps the white-box audits
def test_multi_run_audit_of_dpsgld_is_sound():
    result = sgld_audit()
    assert result.passed, result
    assert result.epsilon_lower_bound > 0.3 * result.claimed_epsilon  # it sees the channel


@pytest.mark.slow  # make test-all: every kernel (the table is docs/results/audit.md)
@pytest.mark.parametrize("kernel, neighbourhood", [
    (k, nb) for k in KERNELS for nb in k.neighbourhoods
], ids=lambda x: x if isinstance(x, str) else f"{x.name}-{x.data}")
def test_every_kernel_passes_its_audit(kernel, neighbourhood):
    result = audit.multi_run(kernel.make(neighbourhood), *neighbours(neighbourhood),
                             delta=DELTA, score=draw_score, num_runs=4000,
                             reproducible_noise=True)
    assert result.passed, result


@pytest.mark.slow  # make test-all (20 s each): the white-box tests catch both faults in make test
@pytest.mark.parametrize("broken, chains", [
    ("noise_halved", 1),
    ("canary_unclipped", 1),
    ("chain_not_charged", 2),
])
def test_multi_run_audit_catches_a_broken_kernel(broken, chains):
    with audit.fault(broken):
        result = sgld_audit(chains_per_run=chains, num_runs=20_000)
    assert not result.passed, result


@pytest.mark.slow  # make test-all (30 s on 2 cores)
def test_multi_run_audit_of_dppenalty_catches_an_unclipped_canary():
    """Black box on the draws alone: with the canary unclipped its ratio decides every
    accept test, so a step's direction tells the data sets apart."""
    data, neighbour = neighbours()
    kernel = ndp.DPPenalty(mean_model, llr_clip=1.0, proposal_scale=0.5, noise_multiplier=1.0,
                           adapt_step_size=False,
                           init_strategy=init_to_value(values={"theta": 0.0}))
    run = {"delta": DELTA, "score": draw_score, "num_runs": 4000, "reproducible_noise": True}
    sound = audit.multi_run(kernel, data, neighbour, **run)
    assert sound.passed, sound
    with audit.fault("canary_unclipped"):
        assert not audit.multi_run(kernel, data, neighbour, **run).passed


@pytest.mark.slow  # make test-all
def test_default_score_is_the_canarys_log_likelihood():
    data, neighbour = neighbours()
    result = audit.multi_run(sgld(0.25), data, neighbour, delta=DELTA,
                             canary=audit.Dataset(np.array([CANARY], np.float32)),
                             num_runs=2000, reproducible_noise=True)
    assert result.passed and result.epsilon_lower_bound > 0


# -------------------------------------------------------------------- one run
def vector_model(x):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([8]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(theta, 1.0).to_event(1), obs=x)


@pytest.mark.slow  # make test-all
def test_one_run_audit_is_sound():
    """64 canaries, canary i at 3 s_i e_(i mod 8), each in with probability 1/2 (else a
    row at 0); a canary scores s_i times its coordinate's posterior mean.  (At these
    sizes a one-run audit of an MCMC kernel has no power: d = 8 directions for 64
    canaries.  Its power on known inputs is tested below.)"""
    index = np.arange(64)
    canaries = np.zeros((64, 8), np.float32)
    canaries[index, index % 8] = 3.0 * np.where(index % 2 == 0, 1.0, -1.0)

    def score(samples, canaries):
        x = canaries.args[0]
        return (samples["theta"].mean(0) * x).sum(1)

    kernel = ndp.DPPenalty(vector_model, llr_clip=3.0, noise_multiplier=2.0,
                           proposal="one_coordinate")
    result = audit.one_run(kernel, audit.Dataset(np.zeros((100, 8), np.float32)),
                           audit.Dataset(canaries), delta=1e-4, score=score,
                           null_row=audit.Dataset(np.zeros((1, 8), np.float32)),
                           num_warmup=100, num_samples=200, reproducible_noise=True)
    assert result.passed, result
    assert result.method == "one-run" and result.num_trials == 64


def test_one_run_bound_from_guesses():
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    perfect = audit.one_run_epsilon_lower_bound(included.astype(float), included, delta=1e-5)
    blind = audit.one_run_epsilon_lower_bound(rng.random(1000), included, delta=1e-5)
    assert perfect > 3 and blind < 0.5


# ------------------------------------------------------------------ bad input
def test_bad_audits_are_refused_with_the_fix():
    data, neighbour = neighbours()
    with pytest.raises(ValueError, match="State the kernel's clips"):
        audit.multi_run(ndp.DPPenalty(mean_model), data, neighbour, delta=DELTA,
                        score=draw_score)
    with pytest.raises(ValueError, match="canary="):
        audit.multi_run(sgld(), data, neighbour, delta=DELTA)
    with pytest.raises(ValueError, match="confidence"):
        audit.epsilon_lower_bound([1.0], [0.0], delta=DELTA, confidence=1.5)
    with pytest.raises(ValueError, match="use one of"):
        with audit.fault("noise_doubled"):
            pass
    with pytest.raises(ValueError, match="divisor= applies to 'kernel_noise_divided' only"):
        with audit.fault("noise_halved", divisor=2):
            pass
    with pytest.raises(ValueError, match="State the kernel's clips"):
        audit.audit_kernel(ndp.DPPenalty(mean_model), data, neighbour, delta=DELTA)


def test_a_fault_is_undone_when_its_block_ends():
    release, clip, clip_ratios = gate.grid_release, clipping.clip_weights, ratios.clip_ratios
    kernel_releases = (penalty.release_llr, penalty.release_batch_sums, hmc.release_clipped_sum,
                       hmc.release_llr, sg_dynamics.release_sum_with_noise)
    with audit.fault("noise_halved"), audit.fault("canary_unclipped"):
        assert gate.grid_release is not release and clipping.clip_weights is not clip
        assert ratios.clip_ratios is not clip_ratios  # what the penalty and Barker sums clip with
    assert gate.grid_release is release and clipping.clip_weights is clip
    assert ratios.clip_ratios is clip_ratios
    with audit.fault("kernel_noise_divided"):
        divided = (penalty.release_llr, penalty.release_batch_sums, hmc.release_clipped_sum,
                   hmc.release_llr, sg_dynamics.release_sum_with_noise)
        assert not any(a is b for a, b in zip(divided, kernel_releases, strict=True))
        assert ratios.release_llr is not penalty.release_llr  # ratios' own stay: divided once
    assert (penalty.release_llr, penalty.release_batch_sums, hmc.release_clipped_sum,
            hmc.release_llr, sg_dynamics.release_sum_with_noise) == kernel_releases


@pytest.mark.slow  # make test-all: the README's example, as a user would run it
def test_readme_example_runs_and_catches_the_fault(capsys):
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Auditing")[1].split("\n## ")[0]
    namespace = {}
    for block in section.split("```python\n")[1:]:  # the black-box and the white-box example
        exec(compile(block.split("```")[0], "README.md", "exec"), namespace)
        printed = capsys.readouterr().out
        assert "consistent with the claim" in printed and "VIOLATES the claim" in printed
