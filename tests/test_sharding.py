"""Rows placed on a device mesh: every kernel's draws are those of one device.

The clipped sums are exact (integer sums on a grid, ``rounding.exact_sum``), so
they do not depend on how the rows are split: with reproducible noise the same
key must give bit-identical draws on 1, 2 and 8 simulated devices, and the same
charge.  This guards the sharding work of issue 22 (``ndp.shard_rows``, padding
and masks, ``shard_map``): n here is divisible by the device count.
"""

import textwrap

import pytest
from _support.running import run_on_devices

SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpyro_dp as ndp
    from _support.data import logistic_model, make_logistic_data

    assert jax.local_device_count() == 8
    X, y = make_logistic_data(800, 3, seed=5)
    kernels = {{
        "DPPenalty": lambda: ndp.DPPenalty(logistic_model, llr_clip=2.0, proposal_scale=0.05),
        "DPMinibatchPenalty": lambda: ndp.DPMinibatchPenalty(
            logistic_model, llr_clip=2.0, proposal_scale=0.05, batch_size=200),
        "DPBarker": lambda: ndp.DPBarker(logistic_model, proposal_scale=0.05, batch_size=400),
        "DPHMC": lambda: ndp.DPHMC(logistic_model, grad_clip=2.0, llr_clip=2.0,
                                   step_size=0.05, num_steps=3),
        "DPHMC-jacobian": lambda: ndp.DPHMC(logistic_model, grad_clip=2.0, llr_clip=2.0,
                                            step_size=0.05, num_steps=3,
                                            grad_route="jacobian"),
        "DPMALA": lambda: ndp.DPMALA(logistic_model, grad_clip=2.0, llr_clip=2.0,
                                     step_size=0.05),
        "DPSGLD": lambda: ndp.DPSGLD(logistic_model, grad_clip=2.0, step_size=1e-3,
                                     batch_size=200),
    }}
    for name, make in kernels.items():
        draws, releases = {{}}, set()
        for devices in (1, 2, 8):
            mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
            rows = NamedSharding(mesh, P("data"))
            mcmc = ndp.PrivateMCMC(make(), num_warmup=10, num_samples=10, num_chains=1,
                                   epsilon=5.0, delta=1e-6, progress_bar=False,
                                   reproducible_noise=True, check_mixing=False)
            Xs, ys = jax.device_put(X, rows), jax.device_put(y, rows)
            mcmc.run(jax.random.PRNGKey(0), Xs, y=ys)
            draws[devices] = np.asarray(mcmc.get_samples()["w"])
            releases.add(mcmc.privacy_spent().num_releases)
        assert np.all(np.isfinite(draws[1])), name
        assert np.array_equal(draws[1], draws[2]) and np.array_equal(draws[1], draws[8]), name
        assert len(releases) == 1, (name, releases)
        print(name, "identical on 1, 2, 8 devices;", releases.pop(), "releases", flush=True)
    print("done")
""")


@pytest.mark.slow  # make test-all: seven kernels, three meshes each
def test_draws_on_a_mesh_equal_one_device_for_every_kernel():
    assert "done" in run_on_devices(SCRIPT, 8, timeout=1200)
