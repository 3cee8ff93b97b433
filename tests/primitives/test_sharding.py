"""Rows on a device mesh (issue 22): padding that counts for nothing, sums per shard.

In-process tests pad rows by hand with a :class:`~numpyro_dp.RowLayout` (one
device): the padded run must give the unpadded run's draws, bit for bit, for
every kernel, whatever the model makes of a zero row.  The mesh tests run in a
fresh interpreter on 8 simulated CPU devices (``XLA_FLAGS``): ``ndp.shard_rows``
with n not divisible by the device count gives one device's draws on 2 and 8
devices (bit for bit with fixed clips: the clipped sums are integer sums, added
over the devices with ``psum``; to float rounding where the tuning's
post-processing runs partitioned), the same charge, and no compiled program
moves rows between devices (no ``all-gather``); for the minibatch kernels what
moves does not grow with the batch: at twice the batch size the compiled
programs' collectives are the same, operand for operand.  On 2-D meshes (chains x rows) and
with ``chain_method="parallel"`` each chain device holds its own chains and the draws
are one device's to float rounding.  Two processes on localhost (``jax.distributed``,
each loading only its rows) give one process's draws bit for bit.
"""

import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from _support.data import logistic_model, make_logistic_data
from _support.running import run_on_devices

import numpyro_dp as ndp
from numpyro_dp.runner.clip_selection import release_histogram

#: Short runs (10 + 10 iterations) of many programs: compiling takes the time (conftest).
pytestmark = pytest.mark.compile_bound

KERNELS = {
    "DPPenalty": lambda m: ndp.DPPenalty(m, llr_clip=2.0, proposal_scale=0.05),
    "DPMinibatchPenalty": lambda m: ndp.DPMinibatchPenalty(
        m, llr_clip=2.0, proposal_scale=0.05, batch_size=200),
    "DPBarker": lambda m: ndp.DPBarker(m, proposal_scale=0.05, batch_size=50),
    "DPHMC": lambda m: ndp.DPHMC(m, grad_clip=2.0, llr_clip=2.0, step_size=0.05, num_steps=3),
    "DPHMC-jacobian": lambda m: ndp.DPHMC(m, grad_clip=2.0, llr_clip=2.0, step_size=0.05,
                                          num_steps=3, grad_route="jacobian"),
    "DPMALA": lambda m: ndp.DPMALA(m, grad_clip=2.0, llr_clip=2.0, step_size=0.05),
    "DPSGLD": lambda m: ndp.DPSGLD(m, grad_clip=2.0, step_size=1e-3, batch_size=200),
    "DPHMC-tuned": lambda m: ndp.DPHMC(m, num_steps=3),  # clip selection and warm start
}


def _pad(layout, *arrays):
    """The arrays laid out as ``layout`` says, zeros in the padding (what shard_rows does)."""
    out = []
    for x in arrays:
        padded = np.zeros((layout.padded_rows,) + x.shape[1:], x.dtype)
        padded[np.asarray(layout.positions(jnp.arange(layout.num_rows)))] = x
        out.append(padded)
    return out


def _draws(kernel, *args, num_chains=2, chain_method="vectorized", mesh=None, state=False,
           **kwargs):
    """Draws and releases of a short reproducible run (and its last state)."""
    mcmc = ndp.PrivateMCMC(kernel, num_warmup=10, num_samples=10, num_chains=num_chains,
                           epsilon=50.0, delta=1e-6, progress_bar=False, chain_method=chain_method,
                           reproducible_noise=True, check_mixing=False, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(jax.random.PRNGKey(0), *args, **kwargs)
    out = mcmc.get_samples(), mcmc.privacy_spent().num_releases
    return (*out, mcmc.last_state) if state else out


def test_row_layout_marks_real_rows_and_finds_them():
    layout = ndp.RowLayout((3, 2, 2), 3)
    assert (layout.num_rows, layout.padded_rows, layout.is_padded) == (7, 9, True)
    np.testing.assert_array_equal(layout.mask(), [1, 1, 1, 1, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(layout.positions(jnp.arange(7)), [0, 1, 2, 3, 4, 6, 7])
    full = ndp.RowLayout((3, 3), 3)
    assert full.mask() is None and full.positions(5) == 5


@pytest.mark.parametrize("name", list(KERNELS))
def test_padded_rows_count_for_nothing(name):
    """Padding in the middle and at the end: the unpadded run's draws and charge."""
    X, y = make_logistic_data(301, 3, seed=5)
    layout = ndp.RowLayout((101, 100, 100), 104)
    Xp, yp = _pad(layout, X, y)
    want, releases = _draws(KERNELS[name](logistic_model), X, y=y)
    got, padded_releases = _draws(KERNELS[name](logistic_model), Xp, y=yp, row_layout=layout)
    np.testing.assert_array_equal(got["w"], want["w"])
    assert padded_releases == releases


def lognormal_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.LogNormal(X @ w, 1.0), obs=y)


@pytest.mark.parametrize("route", ["auto", "jacobian"])
def test_zero_rows_the_model_cannot_score_change_nothing(route):
    """A zero row has log-likelihood -inf and NaN gradients under a LogNormal: as padding
    it must still contribute exactly nothing."""
    X, _ = make_logistic_data(201, 3, seed=2)
    y = np.exp(X @ np.array([0.5, -0.5, 0.2]) + np.random.default_rng(1).normal(size=201))
    layout = ndp.RowLayout((101, 100), 103)
    Xp, yp = _pad(layout, X, y.astype(np.float32))
    kernel = lambda: ndp.DPHMC(lognormal_model, grad_clip=2.0, llr_clip=2.0,  # noqa: E731
                               step_size=0.05, num_steps=3, grad_route=route)
    want, _ = _draws(kernel(), X, y=y.astype(np.float32))
    got, _ = _draws(kernel(), Xp, y=yp, row_layout=layout)
    assert np.all(np.isfinite(got["w"]))
    np.testing.assert_array_equal(got["w"], want["w"])


def test_a_layout_for_other_arrays_is_refused():
    X, y = make_logistic_data(300, 3)
    with pytest.raises(ndp.ModelSpecificationError, match="row_layout describes 312"):
        ndp.PrivateModel(logistic_model, (X,), {"y": y}, row_layout=ndp.RowLayout((100,) * 3, 104))


def test_shard_rows_refuses_what_it_cannot_place():
    mesh = jax.make_mesh((1,), ("data",))
    X, y = make_logistic_data(30, 3)
    with pytest.raises(ValueError, match="same number of them"):
        ndp.shard_rows(mesh, X, y[:-1])
    with pytest.raises(ValueError, match="no axis 'data'"):
        ndp.shard_rows(jax.make_mesh((1,), ("rows",)), X, y)
    Xs, ys, layout = ndp.shard_rows(mesh, X, y)  # one device: nothing to pad
    assert layout == ndp.RowLayout((30,), 30) and Xs.shape == (30, 3)


def test_a_mesh_with_other_axes_is_refused():
    kernel = KERNELS["DPPenalty"](logistic_model)
    with pytest.raises(ValueError, match="name the axis that chains are split over 'chain'"):
        ndp.PrivateMCMC(kernel, num_warmup=1, num_samples=1, epsilon=1.0, delta=1e-6,
                        mesh=jax.make_mesh((1,), ("batch",)))
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        ndp.PrivateMCMC(kernel, num_warmup=1, num_samples=1, epsilon=1.0, delta=1e-6,
                        mesh=("chain", "data"))


def test_padding_is_in_no_histogram_bin():
    values = jnp.asarray([0.1, 0.5, 2.0, 50.0, 0.0, 0.0, 7.0])
    mask = jnp.asarray([1, 1, 1, 1, 0, 0, 1], bool)
    key = jax.random.PRNGKey(0)
    padded = release_histogram(key, values, 1e-9, "add_remove", mask, 5)
    real = release_histogram(key, values[np.asarray(mask)], 1e-9, "add_remove")
    np.testing.assert_array_equal(padded, real)
    assert float(padded.sum()) == 5


MESH_SCRIPT = textwrap.dedent("""
    import re, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np
    import numpyro_dp as ndp
    from numpyro_dp.primitives import compiled, sharding
    from primitives.test_sharding import KERNELS, _draws
    from _support.data import logistic_model, make_logistic_data

    assert jax.local_device_count() == 8
    X, y = make_logistic_data(801, 3, seed=5)

    # The gradient of one row's log-likelihood in a per-shard body is that row's
    # (JAX's replication checks would sum it over the devices' blocks).
    mesh = jax.make_mesh((8,), ("data",))
    Xs, ys, layout = ndp.shard_rows(mesh, X, y)
    per_row = lambda rows: jax.vmap(jax.grad(lambda w, x: jnp.dot(x, w) ** 2), (None, 0))(
        jnp.ones(3), rows[0])
    with sharding.mesh_on(sharding.RunMesh(*sharding.rows_mesh(Xs))):
        got = jax.jit(lambda r: sharding.over_row_shards(per_row, r, out_rows=True))((Xs,))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(per_row((jnp.asarray(Xs),))))

    try:  # padded arrays without their layout would count the padding as rows
        _draws(KERNELS["DPPenalty"](logistic_model), Xs, y=ys)
        raise AssertionError("padded arrays ran without their layout")
    except ValueError as err:
        assert "row_layout=layout" in str(err)

    def moved(kernel):  # a run on the last mesh, and its programs' collectives (kind, bytes)
        compiled.clear()
        samples, charged = _draws(kernel, Xs, y=ys, row_layout=layout)
        texts = [p.as_text() for p in compiled._programs.values()]
        assert texts and not any(re.search("all-gather|all-to-all", t) for t in texts), name
        found = sorted((c["kind"], c["bytes"]) for t in texts for c in compiled.collectives(t))
        return samples, charged, found

    for name in {names!r}:
        draws, releases = {{}}, set()
        for devices in {devices!r}:
            if devices == 1:
                samples, charged = _draws(KERNELS[name](logistic_model), X, y=y)
            else:
                mesh = jax.make_mesh((devices,), ("data",))
                Xs, ys, layout = ndp.shard_rows(mesh, X, y)
                samples, charged, found = moved(KERNELS[name](logistic_model))
            draws[devices] = np.asarray(samples["w"])
            releases.add(charged)
        batch_size = getattr(KERNELS[name](logistic_model), "batch_size", None)
        if batch_size:  # a minibatch's rows stay where they live: what moves is the same at 2b
            kernel = KERNELS[name](logistic_model)
            kernel.batch_size = 2 * batch_size
            assert moved(kernel)[2] == found, (name, found)
        assert np.all(np.isfinite(draws[1])), name
        for devices in {devices!r}[1:]:
            if name.endswith("tuned"):
                np.testing.assert_allclose(draws[devices], draws[1], rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(draws[devices], draws[1], err_msg=name)
        assert len(releases) == 1, (name, releases)
        print(name, "same draws on", {devices!r}, "devices;", releases.pop(),
              "releases; collectives", found, flush=True)
    print("done")
""")


def _on_8_devices(script: str, names: list, timeout: int, **lists) -> None:
    """Run ``script`` on 8 CPU devices with ``{names!r}`` (and each ``{key!r}`` of
    ``lists``) filled in."""
    for key, value in {"names": names, **lists}.items():
        script = script.replace("{" + key + "!r}", repr(value))
    assert "done" in run_on_devices(script, 8, timeout)


def _the_rest(names: list) -> list:
    """The kernels the fast test of a script leaves out: its slow twin runs only those."""
    return [name for name in KERNELS if name not in names]


#: Three kernels (full data, both gradient routes, minibatches) and the tuning.
MESH_FAST = ["DPPenalty", "DPHMC", "DPSGLD", "DPHMC-tuned"]
#: Besides DPHMC, a kernel of each kind: the minibatch kernels' batches and the tuning.
#: DPHMC's Jacobian route and DPMALA take DPHMC's chain state and sum their rows as it
#: does; DPPenalty's LLR sums are DPHMC's (``release_llr`` on the rows' log-likelihood
#: differences), and MESH_FAST runs it on 8 devices.
OTHER_KINDS = ["DPMinibatchPenalty", "DPBarker", "DPSGLD", "DPHMC-tuned"]


@pytest.mark.slow  # make test-all: 8 emulated devices in a subprocess (90-140 s on 2 cores)
def test_sharded_rows_give_one_devices_draws():
    _on_8_devices(MESH_SCRIPT, MESH_FAST, 900, devices=(1, 2, 8))


@pytest.mark.slow  # make test-all: with the test above, every kernel
def test_sharded_rows_give_one_devices_draws_for_every_kernel():
    """The other kernels on 8 devices (padded: 801 rows); 2 devices go the same way
    (the fast test runs both for a kernel of each kind)."""
    _on_8_devices(MESH_SCRIPT, _the_rest(MESH_FAST), 1500, devices=(1, 8))


MESH_2D_SCRIPT = textwrap.dedent("""
    import re, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    import numpyro_dp as ndp
    from numpyro_dp.primitives import compiled
    from primitives.test_sharding import KERNELS, _draws
    from _support.data import logistic_model, make_logistic_data

    X, y = make_logistic_data(801, 3, seed=5)
    try:  # 4 chains do not split over 3 devices
        _draws(KERNELS["DPPenalty"](logistic_model), X, y=y, num_chains=4,
               mesh=jax.make_mesh((3,), ("chain",), devices=jax.devices()[:3]))
        raise AssertionError("4 chains ran on 3 chain devices")
    except ValueError as err:
        assert "cannot be split evenly" in str(err), err

    for name in {names!r}:
        want, charged = _draws(KERNELS[name](logistic_model), X, y=y, num_chains=4)
        runs = {{
            # the runner places and pads the rows on the data axis
            "mesh (2, 4)": dict(mesh=jax.make_mesh((2, 4), ("chain", "data"))),
            "mesh (4, 2)": dict(mesh=jax.make_mesh((4, 2), ("chain", "data"))),
            # rows placed by the user on a 2-D mesh: the chains take its chain axis
            "shard_rows (2, 4)": "placed",
            # NumPyro's chain_method="parallel" (pmap): chains over 4 devices
            "parallel": dict(chain_method="parallel"),
        }}
        for label in {configs!r}:
            options = runs[label]
            compiled.clear()
            if options == "placed":
                mesh = jax.make_mesh((2, 4), ("chain", "data"))
                Xs, ys, layout = ndp.shard_rows(mesh, X, y)
                got, releases, state = _draws(KERNELS[name](logistic_model), Xs, y=ys,
                                              row_layout=layout, num_chains=4, state=True)
            else:
                got, releases, state = _draws(KERNELS[name](logistic_model), X, y=y,
                                              num_chains=4, state=True, **options)
            # each device of the chain axis holds its own chains
            spec = jax.tree.leaves(state)[0].sharding.spec
            assert spec[0] == "chain", (name, label, spec)
            texts = [p.as_text() for p in compiled._programs.values()]
            assert not any(re.search("all-gather|all-to-all", t) for t in texts), (name, label)
            # The state's arithmetic is compiled for fewer chains per device, so it may
            # round differently in the last bit; where that moves a row's clipped value
            # across a point of the rounding grid, a clipped sum moves by one grid step
            # (measured: at most 6e-5 after 20 DPHMC iterations; posterior sd ~0.1).
            np.testing.assert_allclose(got["w"], want["w"], rtol=1e-3, atol=1e-4,
                                       err_msg=name + " " + label)
            moved = lambda w: np.any(np.diff(w, axis=0) != 0, axis=-1)  # noqa: E731
            np.testing.assert_array_equal(moved(got["w"]), moved(want["w"]))
            assert releases == charged, (name, label)
        print(name, "same draws on 2-D meshes and parallel chains", flush=True)
    print("done")
""")


#: Where the chains and rows go: the runner's two 2-D meshes, the user's placed rows,
#: and NumPyro's pmap.
MESH_2D_RUNS = ["mesh (2, 4)", "mesh (4, 2)", "shard_rows (2, 4)", "parallel"]


@pytest.mark.slow  # make test-all: 8 emulated devices in a subprocess (90-140 s on 2 cores)
def test_chains_and_rows_split_over_a_2d_mesh():
    _on_8_devices(MESH_2D_SCRIPT, ["DPHMC"], 900, configs=MESH_2D_RUNS)


@pytest.mark.slow  # make test-all: with the test above, a kernel of every kind
def test_chains_and_rows_split_over_a_2d_mesh_for_every_kernel():
    """A kernel of each other kind on the runner's (2, 4) mesh, rows padded: where chains
    and rows are placed does not depend on the kernel, and the test above runs all four
    placements (with all four for every kernel this one took 802 s on a 2-core machine).
    DPMALA's and DPHMC's Jacobian route's row sums are checked on 8 devices by
    test_sharded_rows_give_one_devices_draws_for_every_kernel."""
    _on_8_devices(MESH_2D_SCRIPT, OTHER_KINDS, 1200, configs=MESH_2D_RUNS[:1])


PROCESS_SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    import jax
    jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={pid})
    import numpy as np
    import numpyro_dp as ndp
    from primitives.test_sharding import KERNELS, _draws
    from _support.data import logistic_model, make_logistic_data

    X, y = make_logistic_data(801, 3, seed=5)
    rows = slice(0, 401) if {pid} == 0 else slice(401, None)  # each loads its own rows
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    Xs, ys, layout = ndp.shard_rows(mesh, X[rows], y[rows])
    assert layout.num_rows == 801 and len(layout.counts) == jax.device_count(), layout
    for name in {names!r}:
        samples, charged = _draws(KERNELS[name](logistic_model), Xs, y=ys, row_layout=layout)
        print(name, charged, np.asarray(samples["w"]).tobytes().hex(), flush=True)
    # Secret noise, the runner placing each process's rows: one draw, on both hosts.
    mcmc = ndp.PrivateMCMC(KERNELS["DPHMC"](logistic_model), num_warmup=5, num_samples=5,
                           num_chains=2, epsilon=50.0, delta=1e-6, progress_bar=False,
                           check_mixing=False, mesh=mesh)
    mcmc.run(jax.random.PRNGKey(1), X[rows], y=y[rows])
    print("secret", mcmc.privacy_spent().num_releases,
          np.asarray(mcmc.get_samples()["w"]).tobytes().hex(), flush=True)
""")


def _two_processes_give_one_processes_draws(names):
    outputs = run_on_devices(PROCESS_SCRIPT.replace("{names!r}", repr(names)), 2,
                             timeout=1500, processes=2)
    lines = [dict(line.split(" ", 1) for line in out.splitlines()
                  if line.split(" ")[0] in [*names, "secret"]) for out in outputs]
    assert lines[0] == lines[1]  # both hosts hold the same draws, secret noise included
    assert "secret" in lines[0]
    # One process on one device with every row (same script, same defaults).
    one = PROCESS_SCRIPT.replace("{names!r}", repr(names)).replace(
        'jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={pid})',
        "").replace("slice(0, 401) if {pid} == 0 else slice(401, None)", "slice(None)")
    want = dict(line.split(" ", 1) for line in run_on_devices(one, 1, timeout=1500).splitlines()
                if line.split(" ")[0] in names)
    for name in names:
        (charged, got), (one_charged, one_draws) = (
            (int(c), np.frombuffer(bytes.fromhex(w), np.float32))
            for c, w in (lines[0][name].split(), want[name].split()))
        assert charged == one_charged, name
        if name.endswith("tuned"):  # the tuning's post-processing runs partitioned
            np.testing.assert_allclose(got, one_draws, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, one_draws, err_msg=name)


@pytest.mark.slow  # make test-all: two processes on localhost (90 s on 2 cores)
def test_two_processes_give_one_processes_draws():
    """Two hosts on localhost (2 CPU devices each), each loading only its rows (401 and
    400): the draws of one process on one device, bit for bit, and the same charge."""
    _two_processes_give_one_processes_draws(["DPHMC"])


@pytest.mark.slow  # make test-all: with the test above, a kernel of every kind
def test_two_processes_give_one_processes_draws_for_every_kind_of_kernel():
    """The minibatch kernels' batches and the tuning over two hosts (DPHMC's gradient
    routes and DPMALA sum their rows as DPHMC does, DPPenalty its LLRs)."""
    _two_processes_give_one_processes_draws(OTHER_KINDS)
