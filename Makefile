# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv if missing, installs, runs the main job on the
#               CPU-sized default config and prints/plots its results
#   make test   creates .venv if missing, installs, runs every test
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= workdirs/demo
# Tests use 2 workers (the reference machine has 2 cores).
PYTEST_WORKERS ?= 2

.PHONY: demo test venv clean bench

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

$(STAMP): $(PY) setup.py requirements.txt requirements-test.txt
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.demo --workdir=$(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --durations=25 tests

# Every CPU benchmark at its default sizes (~10-15 min on 2 cores); tables
# printed, JSON under benchmark_results/. BENCH_ARGS=--quick for smoke sizes.
bench: $(STAMP)
	$(PY) -m experiments.benchmarks.run_all $(BENCH_ARGS)

# Hand-written mutants of the core math against their tests (~20-40 min on
# 2 cores; not in CI). Table printed and written to benchmark_results/mutants.json.
.PHONY: mutants
mutants: $(STAMP)
	$(PY) tools/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) workdirs .pytest_cache
