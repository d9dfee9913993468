"""Constant batch size through the user's path: `primerl-orchestrator` (prime-rl's default,
``constant_trainer_batch_size = true``) with a real env worker and a real `primerl-infer` daemon (vLLM, the tiny
model, whose rewards are often all 0 in a group): every step that reaches the broker holds ``batch_size``
rollouts, and each of them carries signal (a non-zero advantage on its loss tokens) unless the step says it was
filled with dropped groups; the waste metrics add up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.inference import TOKEN, start_broker, start_daemon
from support.orchestrator import ENV_PYTHON, metric_rows, orchestrator_args

from primerl.client.rollouts import RolloutConsumer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

NUM_STEPS = 2  # no trainer publishes: step 3 would wait for version 1 (max_async_level 1)
BATCH_SIZE = 8


def samples_with_signal(advantages: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor) -> list[bool]:
    """Per packed sample that has loss tokens: whether one of them has a non-zero advantage."""
    starts = [int(i) for i in torch.nonzero(position_ids == 0).flatten()] + [int(position_ids.shape[0])]
    result = []
    for start, end in zip(starts, starts[1:]):
        mask = loss_mask[start:end]
        if bool(mask.any()):
            result.append(bool((advantages[start:end][mask].abs() > 1e-8).any()))
    return result


def test_every_step_trains_batch_size_rollouts_that_carry_signal(tmp_path_factory, tiny_model):
    from primerl.trainer.batch import MicroBatch

    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    broker = start_broker(tmp_path_factory.mktemp("spool"))
    daemon = None
    try:
        daemon = start_daemon(tmp_path_factory.mktemp("infer"), tiny_model, broker)
        output_dir = tmp_path_factory.mktemp("orchestrator")
        args = orchestrator_args(tiny_model, broker, output_dir, "reverse-text")  # NUM_STEPS steps
        result = subprocess.run(
            args, capture_output=True, text=True, timeout=300, env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN}
        )
        assert result.returncode == 0, result.stderr[-4000:]
        rows = metric_rows(output_dir)
        assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
        endpoint = f"tcp://127.0.0.1:{broker.endpoints.rollout_port}"
        with RolloutConsumer(endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
            for row in rows:
                filled = int(row["batch/filled_with_dropped_rollouts"])
                assert row["buffer/num_rollouts"] == BATCH_SIZE
                assert row["batch/zero_advantage_rollouts"] <= filled  # only a fill (announced) lacks signal
                signal = []
                for _, tensors in consumer.fetch_step(int(row["step"]), timeout_s=60):
                    batch = MicroBatch.from_tensors(tensors)
                    signal += samples_with_signal(batch.advantages, batch.loss_mask, batch.position_ids)
                assert len(signal) == BATCH_SIZE  # single-turn: one sample per rollout
                assert sum(signal) >= BATCH_SIZE - filled
                reasons = sum(row[f"rollout/tokens_discarded/{w}"] for w in ("stale", "filtered", "failed"))
                reasons += row["rollout/tokens_discarded/cancelled"] + row["rollout/tokens_discarded/surplus"]
                assert row["rollout/tokens_discarded"] == reasons
                assert row["rollout/tokens_trained"] > 0
        generated = sum(r["rollout/tokens_generated"] for r in rows)
        accounted = sum(r["rollout/tokens_trained"] + r["rollout/tokens_discarded"] for r in rows)
        assert accounted <= generated  # the rest still waits (surplus) or was in flight at the end
    finally:
        if daemon is not None:
            daemon.stop()
        broker.stop()
