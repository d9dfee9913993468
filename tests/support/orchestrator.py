"""Helpers for tests that run the real `primerl-orchestrator` against an in-process broker
(`support.broker.BrokerHarness`) and a real `primerl-infer`: its command line, the env-worker interpreter, and
the rows it writes to metrics.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

from primerl.proto import telemetry
from support.broker import BrokerHarness
from support.daemons import BIN

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
"""The env workers' interpreter (`make setup` builds .venv-envs)."""

ENV_FIXTURES = REPO_ROOT / "tests" / "env_fixtures"
"""Environments made for the tests (put on the env workers' PYTHONPATH)."""


def orchestrator_args(model: Path, broker: BrokerHarness, output_dir: Path, env_id: str, *extra: str) -> list[str]:
    """A short run: 2 steps of 8 rollouts (4 per example), 12 tokens each, on env `env_id`."""
    return [
        str(BIN / "primerl-orchestrator"),
        "--model.name",
        str(model),
        "--env",
        f'[{{id = "{env_id}"}}]',
        "--batch-size",
        "8",
        "--rollouts-per-example",
        "4",
        "--max-steps",
        "2",
        "--seq-len",
        "512",
        "--sampling.max-tokens",
        "12",
        "--sampling.temperature",
        "1.0",
        "--broker.address",
        broker.grpc_address,
        "--output-dir",
        str(output_dir),
        "--env-python",
        ENV_PYTHON,
        *extra,
    ]


def metrics_jsonl_rows(output_dir: Path) -> list[dict]:
    """Every row of output_dir/metrics.jsonl."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def metric_rows(output_dir: Path) -> list[dict]:
    """The orchestrator's training rows of metrics.jsonl (eval rows apart: `eval_rows`)."""
    rows = metrics_jsonl_rows(output_dir)
    assert {row["role"] for row in rows} == {"orchestrator"}
    return [row for row in rows if telemetry.TRAIN_REWARD in row]


def eval_rows(output_dir: Path) -> list[dict]:
    """The orchestrator's eval rows of metrics.jsonl."""
    return [row for row in metrics_jsonl_rows(output_dir) if "eval/time_s" in row]
