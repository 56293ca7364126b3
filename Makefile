# hal: `make demo` and `make test` work on a fresh machine; both reuse .venv and re-run cheaply.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# hal-cuda is optional at every step: installed when its pyproject exists (it also installs on a GPU-less host).
CUDA_PYPROJECT := $(wildcard plugins/hal_cuda/pyproject.toml)
CUDA_EDITABLE  := $(if $(CUDA_PYPROJECT),-e plugins/hal_cuda)
PYPROJECTS     := pyproject.toml plugins/hal_cpu/pyproject.toml $(CUDA_PYPROJECT)

# Test-only: torch for the DLPack interop tests (the CPU build), NVRTC for the offline CUDA compile checks,
# cuobjdump/nvdisasm for the SASS budget of the tensor-core kernels.
TEST_DEPS := pytest hypothesis ruff "torch==2.13.0" \
             "cuda-bindings>=13,<14" "nvidia-cuda-nvrtc>=13,<14" "nvidia-cuda-runtime>=13,<14" \
             "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14"

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamps: re-install only when a pyproject (or this Makefile) changed.
$(VENV)/.stamp-demo: $(PYPROJECTS) | $(BIN)/python
	$(BIN)/python -m pip install -q -e . -e plugins/hal_cpu $(CUDA_EDITABLE)
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-demo Makefile
	$(BIN)/python -m pip install -q -e '.[test]' -e plugins/hal_cpu $(CUDA_EDITABLE) $(TEST_DEPS)
	touch $@

demo: $(VENV)/.stamp-demo  ## run a checked decode loop on the best available backend
	$(BIN)/hal demo

test: $(VENV)/.stamp-test  ## ruff, then every test (hal-core, hal-cpu, hal-cuda); fails if either fails
	@lint=0; $(BIN)/ruff check . || lint=$$?; \
	$(BIN)/python -m pytest -q || exit $$?; \
	if [ $$lint -ne 0 ]; then echo "make test: ruff found problems (see above)"; exit $$lint; fi

lint: $(VENV)/.stamp-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
