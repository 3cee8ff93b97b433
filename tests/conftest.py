"""Shared fixtures; shared helpers are in ``tests/_support``."""

import gc

import jax
import pytest
from _support.data import make_logistic_data

import numpyro_dp as ndp
from numpyro_dp.primitives import compiled


@pytest.fixture(autouse=True)
def no_default_warm_start(request, monkeypatch):
    """Most tests are about something else than the private warm start (issue 18),
    and it compiles for seconds: it is off by default here (a stated
    ``warm_start=`` still applies).  Tests marked ``warm_start`` run with the
    library's default, as a user would."""
    if request.node.get_closest_marker("warm_start") is None:
        monkeypatch.setattr(ndp.PrivateMCMC, "auto_warm_start", False)


@pytest.fixture(autouse=True)
def fewer_compiler_optimisations(request, monkeypatch):
    """Compile with XLA's cheaper optimisation (``jax_disable_most_optimizations``)
    where compiling, not running, takes the time: every test but the statistical ones
    (marked ``slow``), whose long chains ran 1.4-1.8 times slower so; slow tests
    marked ``compile_bound`` (short runs of many programs) take it too.  It saved
    13-22% of such tests' time (a conformance test 82 -> 64 s, the 8-device sharding
    test 358 -> 309 s, an audit 21 -> 17 s); the interpreters a test starts inherit it
    (the environment).  Both settings compute the same functions: the tests compare
    runs compiled alike."""
    marked = request.node.get_closest_marker
    less = marked("slow") is None or marked("compile_bound") is not None
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", str(less))
    jax.config.update("jax_disable_most_optimizations", less)


@pytest.fixture(autouse=True)
def ledger_keys(tmp_path_factory, monkeypatch):
    """Ledger keys and seals in a fresh directory of each test, never the user's own
    (``~/.config/numpyro-dp``); subprocesses inherit it.  Returns the directory."""
    config = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.delenv("NUMPYRO_DP_KEY_FILE", raising=False)
    return config / "numpyro-dp"


@pytest.fixture(scope="session")
def logistic_data():
    return make_logistic_data(2000, 3)


@pytest.fixture
def x64():
    """Run a test in float64 and restore the previous setting afterwards."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


#: Memory maps above which a worker frees its compiled programs (Linux's
#: vm.max_map_count is 65530 by default).
MAX_MEMORY_MAPS = 20_000


def memory_maps() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Free the worker's compiled programs after a module once they hold many memory maps.

    Every XLA CPU executable holds memory maps: 5 conformance tests leave a worker
    with about 6900 (/proc/self/maps), and a worker that kept every program of the
    whole suite neared Linux's vm.max_map_count (65530), where XLA's compiler
    crashed with a segmentation fault (2 of 4 full runs, late in a worker, in
    test_sgmcmc and test_conformance).  Clearing JAX's caches brings the count
    back to about 1500; doing it after every module cost 70 s of make test's
    wall time (recompiled programs), so only past :data:`MAX_MEMORY_MAPS`.
    """
    yield
    if memory_maps() > MAX_MEMORY_MAPS:
        jax.clear_caches()
        compiled.clear()
        gc.collect()


def pytest_collection_modifyitems(config, items):
    """Schedule the slow tests first (a stable sort).

    Under pytest-xdist each worker takes the next test as it finishes one: a
    test of ten minutes taken last kept one of CI's two workers busy long after
    the other had finished (the slowest, the sharding tests over every kernel,
    run for 5-14 minutes each).  Taken first, the short tests fill in around them.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
