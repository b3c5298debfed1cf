# Two set-up commands work on a fresh machine with only Python: `make demo` and `make test`.
# `make demo` installs only what the demo needs (the package + `[examples]`: scikit-learn, matplotlib);
# `make test` (and `make install`) everything the suite needs (`[dev]`: + transformers, torch-pruning, ...).
# torch is installed *before* the package, pinned to TORCH_SPEC, so pip picks the CPU build that lies
# on disk here instead of resolving the package's `torch>=...` range to a multi-GB CUDA build.
# On a GPU machine: `make TORCH_SPEC="torch==2.13.0" ...` with whatever index your CUDA build lives on.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.lowmem-installed
DEMO_STAMP := $(VENV)/.lowmem-demo
TORCH_STAMP := $(VENV)/.lowmem-torch

.PHONY: install test test-fast demo demo-quick bench clean

install: $(STAMP)

$(TORCH_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	touch $(TORCH_STAMP)

$(STAMP): $(TORCH_STAMP)
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

$(DEMO_STAMP): $(TORCH_STAMP)
	$(PIP) install --quiet -e ".[examples]"
	touch $(DEMO_STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

demo: $(DEMO_STAMP)
	$(VENV)/bin/lowmem demo

demo-quick: $(DEMO_STAMP)
	$(VENV)/bin/lowmem demo --quick

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info lightning_logs demo_output

# GPU check (docs/gpu.md). Here: `make gpu-wheels` fetches the wheels the GPU machine lacks (scripts/gpu_wheels.txt)
# into .gpu-wheels/. There (its python3 holds torch; no venv, no registry): `make gpu-check` installs them with
# --no-index --no-deps into a scratch folder on PYTHONPATH, runs the cuda-marked tests and
# `python -m benchmarks --device cuda --quick`, and writes benchmarks/results/*_cuda.* and $OUT.
# `make gpu-check-dry`: the same parts on CPU with tiny settings, outputs to a scratch folder: under a minute on
# 2 cores; CI runs it after `make test` (.ci/run). `make gpu-check-dry DRY_FLAGS=--per-bench`: one process per
# benchmark, as the GPU run (about a minute more).
GPU_PYTHON ?= python3
DRY_FLAGS ?=

.PHONY: gpu-wheels gpu-check gpu-check-dry

gpu-wheels:
	$(GPU_PYTHON) scripts/gpu_wheels.py download

gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

gpu-check-dry: $(STAMP)
	$(PY) scripts/gpu_check.py --dry-run $(DRY_FLAGS)
