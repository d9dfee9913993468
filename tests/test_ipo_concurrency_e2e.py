"""A prime-rl config naming IPO (`[trainer.loss] type = "ipo"`), adaptive concurrency (`[orchestrator.concurrency]`)
and the superseded `oversampling_factor` runs unchanged under `primerl rl` on the tiny model: every step trains
with IPO's metrics, and the orchestrator steers by the real `vllm:kv_cache_usage_perc` it reads from the
primerl-infer worker's /metrics (no warning that it could not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.probes import free_port

from primerl.proto import telemetry

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
RUN_TIMEOUT_S = 600

CONFIG = """
max_steps = 2
seq_len = 256
max_async_level = 1
inference_gpu_ids = [0]
trainer_gpu_ids = [1]

[model]
name = "{model}"

[orchestrator]
batch_size = 16
rollouts_per_example = 8
oversampling_factor = 2.0      # prime-rl users still write it: loads, superseded

[orchestrator.concurrency]
initial_inflight = 16
poll_interval_s = 0.05         # a step's rollouts last ~0.2 s here: read KV use several times while they run

[orchestrator.sampling]
max_tokens = 24
seed = 0

[[orchestrator.env]]
id = "reverse-text"

[trainer.loss]
type = "ipo"

[trainer.optim]
lr = 5e-4

[inference]
enable_lora = false

[inference.model]
max_model_len = 512

[inference.server]
port = 0
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_prime_rl_config_with_ipo_and_adaptive_concurrency_runs(tiny_model, tmp_path):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    config = tmp_path / "rl.toml"
    config.write_text(textwrap.dedent(CONFIG.format(model=tiny_model)))
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": ENV_PYTHON,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PRIMERL_RUN_TOKEN", None)
    args = [str(BIN / "primerl"), "rl", "@", str(config), "--output-dir", str(run_dir)]
    args += ["--broker.grpc-port", str(free_port()), "--no-dashboard"]
    started_s = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=tmp_path)
    wall_s = time.monotonic() - started_s
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "run finished: 2 steps" in result.stdout, output[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer = [r for r in rows if r["role"] == "trainer"]
    assert [r["step"] for r in trainer] == [1, 2]
    assert all("train/masked" in r and "train/is_truncated" not in r for r in trainer)  # IPO's metrics
    orchestrator = [r for r in rows if r["role"] == "orchestrator" and telemetry.CONCURRENCY_LIMIT in r]
    assert orchestrator, rows
    kv = [r[telemetry.CONCURRENCY_KV_USAGE_MAX] for r in orchestrator]
    assert max(kv) > 0, kv  # the worker's real vllm:kv_cache_usage_perc, read while rollouts ran
    assert all(r[telemetry.CONCURRENCY_PREEMPTIONS] == 0 for r in orchestrator)
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "adaptive concurrency" in log
    assert "cannot read an inference worker's /metrics" not in log and "has no vllm:kv_cache_usage_perc" not in log
    print(
        f"2-step IPO run with adaptive concurrency: {wall_s:.1f} s wall; "
        f"limit {[r[telemetry.CONCURRENCY_LIMIT] for r in orchestrator]}, KV use {kv}"
    )
