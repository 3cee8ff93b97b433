"""What every kernel shares (numpyro_dp.kernels): one calling convention, one planning API."""

import copy
import inspect
import pickle

import numpy as np
import pytest
from _support.data import logistic_model, make_logistic_data

import numpyro_dp as ndp
from numpyro_dp.kernels.barker import barker_epsilon, barker_max_batch_size

KERNELS = [ndp.DPPenalty, ndp.DPMinibatchPenalty, ndp.DPHMC, ndp.DPMALA, ndp.DPBarker,
           ndp.DPSGLD, ndp.DPSGHMC, ndp.DPSGNHT]

#: Each kernel's leading keywords, and a value for each.
KEYWORDS = {
    ndp.DPPenalty: {"llr_clip": 1.0, "proposal_scale": 0.05},
    ndp.DPHMC: {"step_size": 0.01, "num_steps": 3},
    ndp.DPMALA: {"step_size": 0.01},
    ndp.DPBarker: {"batch_size": 100, "proposal_scale": 0.1, "n0": 50.0},
    ndp.DPSGLD: {"step_size": 1e-3, "batch_size": 10, "grad_clip": 1.0},
    ndp.DPSGHMC: {"step_size": 1e-3, "batch_size": 10, "grad_clip": 1.0},
    ndp.DPSGNHT: {"step_size": 1e-3, "batch_size": 10, "grad_clip": 1.0},
}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_the_model_is_the_only_positional_argument(kernel):
    parameters = list(inspect.signature(kernel).parameters.values())
    assert parameters[0].name == "model"
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters[1:]), kernel
    assert "self" not in inspect.signature(kernel).parameters


@pytest.mark.parametrize("kernel", list(KEYWORDS), ids=lambda k: k.__name__)
def test_a_positional_argument_after_the_model_is_refused_with_the_keyword_form(kernel):
    values = KEYWORDS[kernel]
    with pytest.raises(TypeError, match="keyword arguments only") as err:
        kernel(logistic_model, *values.values())
    assert f"{kernel.__name__}(model, " in str(err.value)
    assert all(f"{name}=" in str(err.value) for name in list(values)[:1])
    kernel(logistic_model, **values)  # the keyword form is accepted


def test_dpmala_takes_dphmc_arguments_without_relisting_them():
    mala = inspect.signature(ndp.DPMALA).parameters
    hmc = inspect.signature(ndp.DPHMC).parameters
    assert set(mala) == (set(hmc) - {"num_steps"}) | {"proposal_variance_factor"}
    assert mala["target_accept_prob"].default == 0.574
    kernel = ndp.DPMALA(logistic_model, grad_clip=2.0, grad_route="jacobian", dense_mass=True)
    assert (kernel.num_steps, kernel.grad_clip, kernel.grad_route) == (1, 2.0, "jacobian")
    with pytest.raises(TypeError, match="exactly one leapfrog step"):
        ndp.DPMALA(logistic_model, num_steps=3)


def test_the_minibatch_penalty_is_its_own_kernel():
    kernel = ndp.DPMinibatchPenalty(logistic_model, batch_size=50, llr_clip=1.0,
                                    temperature=0.1)
    assert isinstance(kernel, ndp.DPPenalty) and kernel.batch_size == 50
    assert ndp.DPPenalty(logistic_model, llr_clip=1.0).batch_size is None
    with pytest.raises(TypeError, match="DPPenalty has no argument 'batch_size'"):
        ndp.DPPenalty(logistic_model, batch_size=50, llr_clip=1.0)
    assert type(copy.copy(kernel)) is ndp.DPMinibatchPenalty
    event = kernel.per_iteration_event(2.0, num_rows=1000)
    assert (event.sampling_probability if hasattr(event, "sampling_probability")
            else event.sample_size) == 50
    with pytest.raises(ValueError, match="integer >= 2"):
        ndp.DPMinibatchPenalty(logistic_model, batch_size=1)
    with pytest.raises(TypeError):
        ndp.DPMinibatchPenalty(logistic_model)  # batch_size is required


def test_every_kernel_plans_through_the_runner_and_barker_reports_its_largest_batch():
    n, delta = 10**6, 1e-8
    X, y = make_logistic_data(200, 2, seed=0)
    for kernel in (ndp.DPPenalty(logistic_model, llr_clip=1.0),
                   ndp.DPSGLD(logistic_model, step_size=1e-4, batch_size=10, grad_clip=1.0)):
        plan = ndp.PrivateMCMC(kernel, num_warmup=10, num_samples=10, epsilon=3.0,
                               delta=delta, warm_start=0).plan(X, y=y)
        assert plan.max_batch_size is None and plan.max_iterations >= 20
    kernel = ndp.DPBarker(logistic_model, batch_size=500, n0=100)
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=100, num_samples=900, num_chains=2,
                           epsilon=1.0, delta=delta, chain_method="vectorized")
    plan = mcmc.plan(num_rows=n)
    assert plan.max_batch_size == barker_max_batch_size(n, 1000, 1.0, delta, num_chains=2)
    assert plan.max_batch_size > 500
    assert barker_epsilon(n, plan.max_batch_size, 1000, delta, 2) <= 1.0
    assert "largest batch size that fits" in str(plan)
    with pytest.raises(ValueError, match="Pass num_rows=n"):
        mcmc.plan()


@pytest.mark.parametrize("name", ["barker_epsilon", "barker_max_iterations",
                                  "barker_max_batch_size"])
def test_barker_planners_live_in_their_kernel_module_only(name):
    assert callable(getattr(ndp.kernels.barker, name))
    assert name not in ndp.__all__ and not hasattr(ndp, name)
    assert np.isfinite(barker_epsilon(10**5, 500, 10, 1e-6))


def test_a_misspelt_argument_names_the_kernel_and_the_fix():
    with pytest.raises(TypeError, match=r"DPSGLD has no argument 'grad_clp'; did you mean grad_c"):
        ndp.DPSGLD(logistic_model, step_size=1e-3, batch_size=10, grad_clp=1.0)
    with pytest.raises(TypeError, match=r"DPMALA has no argument 'grad_clp'; did you mean"):
        ndp.DPMALA(logistic_model, grad_clp=1.0)


def test_a_calibrated_copy_samples_what_its_runner_charges():
    """A DPHMC built with a stated (z_grad, z_llr) pair and copied with another
    noise multiplier must draw the copy's noise (the runner charges that one)."""
    kernel = ndp.DPHMC(logistic_model, num_steps=3, grad_clip=1.0, llr_clip=1.0,
                       noise_multiplier_grad=5.0, noise_multiplier_llr=5.0)
    copy_ = kernel.calibrated(noise_multiplier=100.0)
    assert copy_.noise_multipliers() == copy_.noise_multipliers(100.0)
    assert kernel.noise_multipliers() == (5.0, 5.0)
    with pytest.raises(ValueError, match=r"no clip named \['llr_clp'\]"):
        kernel.calibrated(clips={"llr_clp": 2.0})
    with pytest.raises(ValueError, match="no noise multiplier to set"):
        ndp.DPSGLD(logistic_model, step_size=1e-3, batch_size=10,
                   grad_clip=1.0).calibrated(noise_multiplier=3.0)


def test_a_charged_kernel_refuses_reconfiguration_and_pickles():
    import jax

    X, y = make_logistic_data(100, 2, seed=0)
    mcmc = ndp.PrivateMCMC(ndp.DPPenalty(logistic_model, llr_clip=1.0, noise_multiplier=3.0),
                           num_warmup=2, num_samples=2, delta=1e-4, progress_bar=False,
                           check_mixing=False)
    mcmc.run(jax.random.PRNGKey(0), X, y=y)
    with pytest.raises(AttributeError, match="cannot change"):
        mcmc.sampler.configure(noise_multiplier=5.0)
    mcmc.sampler.configure(noise_multiplier=3.0)  # what it already is: nothing changes
    restored = pickle.loads(pickle.dumps(mcmc.sampler))
    assert restored.noise_multiplier == 3.0 and restored._sample_fn is None


def test_planning_by_row_count_says_when_it_needs_the_models_arguments():
    mcmc = ndp.PrivateMCMC(ndp.DPPenalty(logistic_model), num_warmup=10, num_samples=10,
                           epsilon=5.0, delta=1e-6)
    with pytest.raises(ValueError, match=r"mcmc.plan\(X, y=y\)"):
        mcmc.plan(num_rows=2000)
    X, y = make_logistic_data(2000, 2, seed=0)
    assert mcmc.plan(X, y=y).fits
