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

.PHONY: install test test-fast lint demo demo-quick bench clean test-compat test-compat-all test-compat-ci

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

# A spawned 2-rank test's rank sometimes aborts at interpreter exit, after its work ("terminate called without an
# active exception"; tests/spawn.py): such a test, and only such a test, runs once more.
RERUN_ABORTED_RANKS ?= --reruns 1 --only-rerun "terminated with signal SIGABRT"

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(RERUN_ABORTED_RANKS) tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

# `make lint`: the formatter and the linter, as configured in pyproject.toml ([tool.ruff]); ruff comes with `[dev]`.
# `$(VENV)/bin/ruff format $(LINT_PATHS)` fixes what `format --check` finds.
LINT_PATHS ?= lightning_lowmem tests benchmarks scripts examples

lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)

demo: $(DEMO_STAMP)
	$(VENV)/bin/lowmem demo

demo-quick: $(DEMO_STAMP)
	$(VENV)/bin/lowmem demo --quick

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) .venv-compat-* build *.egg-info lightning_logs demo_output

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

# Compatibility legs (docs/compatibility.md): `make test-compat COMPAT=<leg>` builds its own .venv-compat-<leg>
# (torch first, pinned, as above; then the package with the leg's pins), prints the versions it got and runs
# COMPAT_TESTS there: the HF zoo, the estimator, the quantization tests. Exits non-zero if any fails.
#   transformers-4  the last transformers 4.x, the rest as `make test` (CI runs a selection: make test-compat-ci)
#   floors          every other declared lower bound on TORCH_SPEC's torch: lightning, torchmetrics, jsonargparse,
#                   torchao, rich, psutil, transformers 4.x
#   torch-2.11      the floors on torch's own floor, 2.11 (PyPI's CUDA build, ~3 GB, runs on CPU; ~6 min to
#                   install here), + the FSDP estimate; without the one test that fakes a GPU (a CUDA build
#                   without a driver fails the first CUDA call the fake lets through)
# `make test-compat-all` runs every leg; `make test-compat-ci` the transformers-4 leg on COMPAT_CI_TESTS (CI, .ci/run).
COMPAT ?= transformers-4
COMPAT_LEGS := transformers-4 floors torch-2.11
COMPAT_PINS.transformers-4 := transformers==4.57.6
# LitGPT (the chunked loss's recipe, tests/functional/test_cross_entropy_litgpt.py; the zoo, tests/test_litgpt_zoo.py)
# resolves only beside transformers 4.x and pins jsonargparse<=4.41, below our floor; its model code imports neither:
# installed without its pins
COMPAT_NODEPS.transformers-4 := litgpt==0.5.13
COMPAT_PINS.floors := lightning==2.5.0 torchmetrics==1.4.0 jsonargparse[signatures]==4.51.0 torchao==0.18.0 \
	rich==13.0.0 psutil==5.9.0 transformers==4.57.6
COMPAT_TORCH.transformers-4 := $(TORCH_SPEC)
COMPAT_TORCH.floors := $(TORCH_SPEC)
COMPAT_EXTRA_TESTS.floors := tests/test_cli.py
COMPAT_PINS.torch-2.11 := $(COMPAT_PINS.floors) torch==2.11.0
COMPAT_TORCH.torch-2.11 := torch==2.11.0
COMPAT_EXTRA_TESTS.torch-2.11 := tests/test_cli.py tests/planning/test_sharding.py \
	--deselect "tests/test_cli.py::test_estimate_defaults_to_this_machines_device_and_says_so[with-gpu]"
COMPAT_TESTS ?= tests/test_hf_zoo.py tests/planning/test_estimate.py tests/planning/test_batch_values.py \
	tests/functional/test_checkpointing_hf.py tests/functional/quantization/test_quantization_hf.py \
	tests/callbacks/test_quantization_callbacks_hf.py tests/distillation/test_hf.py \
	tests/callbacks/test_chunked_cross_entropy.py tests/functional/test_cross_entropy_litgpt.py tests/test_litgpt_zoo.py
# CI's selection: every test that failed on transformers 4.57 before the fix (estimate vs measured per family, GPT-2's
# Conv1D / T5's tie under PTQ, QAT, int8_static, the int8 teacher) plus the batch-values tests and the LitGPT zoo
# (every feature on LitGPT's GPT, ~20 s: litgpt installs only in this leg)
COMPAT_CI_TESTS := tests/planning/test_batch_values.py tests/functional/test_checkpointing_hf.py \
	tests/functional/quantization/test_quantization_hf.py "tests/test_hf_zoo.py::test_every_feature_on_every_family[gpt2-ptq]" \
	tests/callbacks/test_quantization_callbacks_hf.py::test_int8_static_exports_gpt2_with_keyword_batches_and_conv1d \
	tests/callbacks/test_quantization_callbacks_hf.py::test_qat_on_gpt2_trains_conv1d_fake_quantized_and_converts_tied_head_once \
	tests/callbacks/test_quantization_callbacks_hf.py::test_qat_on_t5_converts_the_four_way_tie_once \
	"tests/callbacks/test_quantization_callbacks_hf.py::test_ptq_quantizes_every_family_timing_dict_batches[gpt2]" \
	"tests/distillation/test_hf.py::test_bf16_and_int8_hf_teachers_hold_fewer_bytes_and_stay_close[gpt2]" \
	tests/functional/test_cross_entropy_litgpt.py tests/test_litgpt_zoo.py \
	tests/callbacks/test_chunked_cross_entropy.py::test_same_weights_as_the_unchunked_loss_and_no_logits_in_training
COMPAT_VENV := .venv-compat-$(COMPAT)
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.lowmem-compat
COMPAT_DISTS := torch lightning torchmetrics jsonargparse torchao transformers rich psutil

$(COMPAT_STAMP): pyproject.toml Makefile
	@test -n "$(COMPAT_PINS.$(COMPAT))" || { echo "error: COMPAT=$(COMPAT) is not a leg; choose one of: $(COMPAT_LEGS)" >&2; exit 2; }
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet "$(COMPAT_TORCH.$(COMPAT))"
	$(COMPAT_PY) -m pip install --quiet -e ".[dev]" $(foreach pin,$(COMPAT_PINS.$(COMPAT)),"$(pin)")
	$(if $(COMPAT_NODEPS.$(COMPAT)),$(COMPAT_PY) -m pip install --quiet --no-deps $(COMPAT_NODEPS.$(COMPAT)))
	touch $@

test-compat: $(COMPAT_STAMP)
	@$(COMPAT_PY) -c "import importlib.metadata as m; print('leg $(COMPAT):', ', '.join(d + ' ' + m.version(d) for d in '$(COMPAT_DISTS)'.split()))"
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider $(COMPAT_TESTS) $(COMPAT_EXTRA_TESTS.$(COMPAT))

test-compat-ci:
	$(MAKE) test-compat COMPAT=transformers-4 COMPAT_TESTS='$(COMPAT_CI_TESTS)'

test-compat-all:
	set -e; for leg in $(COMPAT_LEGS); do $(MAKE) test-compat COMPAT=$$leg; done
