"""Running a kernel under PrivateMCMC as the statistical tests do."""

import os
import socket
import subprocess
import sys
import tempfile
import time
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


class BackendCompiles:
    """Counts XLA compilations (JAX's backend-compile events) while active."""

    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event, secs, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc):
        self.active = False


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


def run_on_devices(script: str, devices: int, timeout: int = 900,
                   processes: int = 1) -> str | list[str]:
    """Run ``script`` in fresh interpreters on ``devices`` simulated CPU devices each.

    ``script`` is formatted with ``tests`` (the tests directory, for imports
    of ``_support``); a failure shows the ends of its output.  With
    ``processes > 1`` it runs as that many processes of one JAX program on
    localhost and is formatted with ``port`` (the coordinator's) and ``pid``
    too; they are killed if one fails or all outlive ``timeout`` (a process
    whose peer died waits forever).  Returns each process's stdout (a single
    string for one process).
    """
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "PYTHONWARNINGS": "ignore"}
    tests = str(Path(__file__).parents[1])
    if processes == 1:
        out = subprocess.run([sys.executable, "-c", script.format(tests=tests)], env=env,
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(Path(logs) / f"{p}.out", "w+"), open(Path(logs) / f"{p}.err", "w+"))
                 for p in range(processes)]
        procs = [subprocess.Popen(
            [sys.executable, "-c", script.format(tests=tests, port=port, pid=p)],
            env=env, stdout=out, stderr=err, text=True) for p, (out, err) in enumerate(files)]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = any(p.poll() not in (None, 0) for p in procs)
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = []
        for p, (out, err) in zip(procs, files, strict=True):
            out.seek(0), err.seek(0)
            text, errors = out.read(), err.read()
            out.close(), err.close()
            assert p.returncode == 0, f"process {len(outputs)}: " + text[-2000:] + errors[-3000:]
            outputs.append(text)
    return outputs
