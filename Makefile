# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv if missing, installs, runs a one-seed cut of the
#               strong toy world (experiments/demo.py), prints/plots its results
#               and the claims it shows
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

# tunix's logit-distillation step on the OPD-step benchmark's model and batch,
# in its own venv (never the main requirements); writes
# benchmark_results/tunix_opd_step.json, which experiments.benchmarks.opd_step
# merges (or runs in the same run when .venv-tunix exists).
# BENCH_ARGS=--quick for smoke sizes.
# Pins: tunix 0.1.7 with this repo's jax/flax/optax/numpy (checked 2026-12-01).
.PHONY: bench-tunix
bench-tunix:
	test -f .venv-tunix/.installed || { $(PYTHON) -m venv .venv-tunix && \
	  .venv-tunix/bin/python -m pip install --quiet --upgrade pip && \
	  .venv-tunix/bin/python -m pip install --quiet google-tunix==0.1.7 jax==0.10.2 \
	    jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 numpy==2.4.6 && \
	  touch .venv-tunix/.installed; }
	.venv-tunix/bin/python -m experiments.benchmarks.tunix_opd_step $(BENCH_ARGS)

# Hand-written mutants of the core math against their tests (~20-40 min on
# 2 cores; not in CI). Table printed and written to benchmark_results/mutants.json.
.PHONY: mutants
mutants: $(STAMP)
	$(PY) tools/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) workdirs .pytest_cache
