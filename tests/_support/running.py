"""Running a kernel under PrivateMCMC as the statistical tests do."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import numpyro_dp as ndp

#: A tiny noise multiplier: sigma = z * sensitivity, so z = 1e-8 with large clips
#: is an (almost) noise-free sampler.
NEGLIGIBLE = {"noise_multiplier_grad": 1e-8, "noise_multiplier_llr": 1e-8}
#: An epsilon whose noise is negligible: checks the sampler, not the privacy.
HUGE_EPSILON = 1e7
# The accountant's epsilon of a noise-free run overflows inside dp-accounting.
negligible_noise_warnings = pytest.mark.filterwarnings(
    "ignore:divide by zero encountered in log1p:RuntimeWarning"
)


def run(kernel, *args, num_warmup, num_samples, num_chains=4, seed=0, epsilon=None,
        delta=1e-6, chain_method="vectorized", reproducible_noise=True, **kwargs):
    """``kernel`` run by PrivateMCMC with a fixed seed; ``kwargs`` go to ``run``.

    The noise comes from the seed (``reproducible_noise``: tests only) and the
    warm start is off unless the test is marked ``warm_start`` (conftest).
    """
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=num_warmup, num_samples=num_samples,
                           num_chains=num_chains, epsilon=epsilon, delta=delta,
                           chain_method=chain_method, progress_bar=False,
                           reproducible_noise=reproducible_noise)
    mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    return mcmc


#: A fixed run secret for tests that call a kernel's functional core directly
#: (PrivateMCMC draws a fresh one from the OS at every run).
TEST_SECRET = np.array([2718281828, 3141592653], np.uint32)


def armed_init(kernel, rng_key, *args, init_params=None, num_warmup=0, **kwargs):
    """``kernel.init`` as PrivateMCMC calls it: armed, with the run's inputs.

    Tests only: nothing is charged.
    """
    pm = kernel.prepare(args, kwargs)
    inputs = kernel.run_inputs(pm.private_inputs(args, kwargs), TEST_SECRET)
    with kernel.armed(object()):
        return kernel.init(rng_key, num_warmup, init_params, (inputs,), {})


def run_on_devices(script: str, devices: int, timeout: int = 900) -> str:
    """Run ``script`` in a fresh interpreter on ``devices`` simulated CPU devices.

    ``script`` is formatted with ``tests`` (the tests directory, for imports
    of ``_support``); a failure shows the ends of its output.  Returns stdout.
    """
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "PYTHONWARNINGS": "ignore"}
    script = script.format(tests=str(Path(__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout
