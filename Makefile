# Developer tasks for numpyro-dp (GNU make).
#
#   make venv    create .venv and install the package with its test extras
#   make demo    run examples/demo.py (plan, the recommended route, NUTS beside it)
#   make test    run the fast tier of the test suite: everything but the
#                statistical tests marked slow (exits non-zero on failure);
#                extra pytest arguments: make test PYTEST_ARGS='-k accounting';
#                PYTEST_WORKERS=0 runs in this process
#   make test-all  run the whole suite (what CI runs)
#   make lint    run ruff on the repository
#   make bench   run benchmarks/bench_penalty.py, bench_hmc.py, bench_barker.py
#                and bench_sg.py
#   make clean   remove the virtual environment and caches

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers: the tests are mostly single-threaded compilation, so
# two workers nearly halve the wall time on CI's two cores.  Work stealing: a
# worker that runs out takes half the other's queue, so neither idles at the end
# behind a run of the slow tests (the 8-device ones take 3-7 minutes each).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist worksteal

.PHONY: venv demo test test-all lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install -e ".[test]"
	touch $@

demo: $(STAMP)
	$(VPY) examples/demo.py

test: $(STAMP)
	$(VPY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VPY) -m ruff check .

bench: $(STAMP)
	$(VPY) benchmarks/bench_penalty.py
	$(VPY) benchmarks/bench_hmc.py
	$(VPY) benchmarks/bench_barker.py
	$(VPY) benchmarks/bench_sg.py
	$(VPY) benchmarks/bench_noise_aware.py --out docs/results/bench_noise_aware

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
