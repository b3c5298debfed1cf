# Two set-up commands work on a fresh machine with only Python: `make demo` and `make test`.
# torch is installed *before* the package, pinned to TORCH_SPEC, so pip picks the CPU build that lies
# on disk here instead of resolving the package's `torch>=...` range to a multi-GB CUDA build.
# On a GPU machine: `make TORCH_SPEC="torch==2.13.0" ...` with whatever index your CUDA build lives on.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.lowmem-installed

.PHONY: install test test-fast demo demo-quick bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

demo: $(STAMP)
	$(VENV)/bin/lowmem demo

demo-quick: $(STAMP)
	$(VENV)/bin/lowmem demo --quick

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info lightning_logs demo_output
