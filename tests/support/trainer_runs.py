"""A `primerl-trainer` fed by a test: synthetic RL samples, the broker batches made of them, the trainer's command
line, and what a run leaves behind (its `metrics.jsonl` rows and JSON log events).

`samples(step)` is the one source of the synthetic data: `tests/scripts/train_ranks.py` (torchrun) trains on the
same samples, so one rank, two ranks and the daemon can be compared."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from primerl.client.rollouts import RolloutProducer, pack_batch

BIN = Path(sys.executable).parent
TRAINER = str(BIN / "primerl-trainer")
TRAINER_TIMEOUT_S = 300


def samples(step: int, count: int = 6) -> list[dict[str, np.ndarray]]:
    """``count`` synthetic RL samples of ``step`` (6 to 13 tokens, loss on all but the first 3), the same on
    every call."""
    rng = np.random.default_rng(1000 + step)
    out = []
    for _ in range(count):
        length = int(rng.integers(6, 14))
        out.append(
            {
                "input_ids": rng.integers(5, 500, length).astype(np.int64),
                "position_ids": np.arange(length, dtype=np.int64),
                "loss_mask": np.arange(length) >= 3,
                "advantages": np.full(length, rng.standard_normal(), np.float32),
                "inference_logprobs": -(rng.random(length) * 3 + 3).astype(np.float32),
                "temperatures": np.ones(length, np.float32),
            }
        )
    return out


def packed(group: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The samples of ``group`` packed into one micro-batch's tensors."""
    return {name: np.concatenate([sample[name] for sample in group]) for name in group[0]}


def send_steps(
    rollout_endpoint: str,
    steps: Iterable[int],
    num_micro_batches: int = 2,
    num_ranks: int = 1,
    auth_token: str | None = None,
) -> None:
    """Each step's samples to the broker as the orchestrator would send them: with one rank, in
    ``num_micro_batches`` consecutive parts; with several, rank r gets samples r, r + num_ranks, ... in one
    micro-batch (the same global batch, so any number of ranks trains on the same data). ``auth_token``: the
    broker's run token, where it has one."""
    with RolloutProducer(rollout_endpoint, auth_token) as producer:
        for step in steps:
            group = samples(step)
            if num_ranks > 1:
                for rank in range(num_ranks):
                    producer.send_batch(*pack_batch(step, rank, 0, 1, packed(group[rank::num_ranks])), timeout_s=20)
                continue
            per_batch = len(group) // num_micro_batches
            for index in range(num_micro_batches):
                part = group[index * per_batch : (index + 1) * per_batch]
                producer.send_batch(*pack_batch(step, 0, index, num_micro_batches, packed(part)), timeout_s=20)


def trainer_args(model_dir: Path, broker_address: str, output_dir: Path, *extra: str) -> list[str]:
    """``primerl-trainer`` on ``model_dir`` against the broker at ``broker_address`` (lr 1e-3, JSON logs;
    ``model.parallel`` left to its default, which is DDP for any number of ranks)."""
    return [
        TRAINER,
        "--model.name",
        str(model_dir),
        "--broker.address",
        broker_address,
        "--output-dir",
        str(output_dir),
        "--optim.lr",
        "1e-3",
        "--log.format",
        "json",
        *extra,
    ]


def run_trainer(model_dir: Path, broker_address: str, output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run ``trainer_args(...)`` (no weight decay) to its end; output captured."""
    args = trainer_args(model_dir, broker_address, output_dir, "--optim.weight-decay", "0", *extra)
    return subprocess.run(args, capture_output=True, text=True, timeout=TRAINER_TIMEOUT_S)


def trainer_rows(output_dir: Path) -> list[dict]:
    """The trainer's rows of ``{output_dir}/metrics.jsonl`` (none while it does not exist)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if row["role"] == "trainer"]


def log_events(text: str, event: str) -> list[dict]:
    """The JSON log records of ``text`` whose event is ``event`` (other lines skipped)."""
    events = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event:
            events.append(record)
    return events
