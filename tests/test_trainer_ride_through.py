"""`primerl-trainer` rides through a restart of the broker, and a resumed trainer records its resumed step once.

Real processes and sockets: a real trainer process, a real broker (stopped and started again on the same
ports and spool directory, as systemd restarts it), real rollout batches."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from primerl.broker.config import BrokerConfig
from primerl.client.rollouts import RolloutProducer, pack_batch
from primerl.broker.service import BrokerService
from primerl.proto.step_digest import data_digest
from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from train_ranks import samples  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model",
                            TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1))


def step_tensors(step: int) -> dict[str, np.ndarray]:
    group = samples(step)
    return {name: np.concatenate([s[name] for s in group]) for name in group[0]}


class RestartableBroker:
    """A broker that can be stopped and started again on the same ports and spool directory."""

    def __init__(self, spool_dir: Path):
        self.spool_dir = spool_dir
        self.ports = {"grpc_port": 0, "rollout_port": 0, "weight_port": 0}
        self.service: BrokerService | None = None
        self.start()

    def start(self) -> None:
        self.service = BrokerService(BrokerConfig(**self.ports, spool_dir=self.spool_dir, max_queue_batches=64,
                                                  run_id="ride-through", heartbeat_interval_s=0.5))
        endpoints = self.service.start()
        self.ports = {"grpc_port": endpoints.grpc_port, "rollout_port": endpoints.rollout_port,
                      "weight_port": endpoints.weight_port}

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop(grace_s=1)
            self.service = None

    def send(self, steps: range) -> None:
        with RolloutProducer(f"tcp://127.0.0.1:{self.ports['rollout_port']}") as producer:
            for step in steps:
                producer.send_batch(*pack_batch(step, 0, 0, 1, step_tensors(step)), timeout_s=20)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc_port']}"


def trainer_args(model_dir: Path, broker: RestartableBroker, output_dir: Path, *extra: str) -> list[str]:
    return [str(BIN / "primerl-trainer"), "--model.name", str(model_dir), "--broker.address", broker.address,
            "--output-dir", str(output_dir), "--optim.lr", "1e-3", "--model.parallel", "ddp", "--log.format", "json",
            *extra]


def trainer_rows(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if row["role"] == "trainer"]


def log_events(text: str, event: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event:
            events.append(record)
    return events


def wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert process.poll() is None, f"trainer exited ({process.returncode}) before {what}:\n" + log_path.read_text()[-3000:]
        assert time.monotonic() < deadline_s, f"no {what} within {timeout_s} s:\n" + log_path.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_the_trainer_rides_through_a_broker_restart(model_dir, tmp_path):
    """Step 1 trains; the broker goes down while the trainer waits for step 2 (it says so, and waits); the broker
    comes back on the same ports and spool, gets steps 2-3, and the run ends normally: every step trained once,
    on the data sent for it, checkpoints committed to the restarted broker."""
    broker = RestartableBroker(tmp_path / "spool")
    out = tmp_path / "out"
    log_path = tmp_path / "trainer.log"
    broker.send(range(1, 2))
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(trainer_args(model_dir, broker, out, "--max-steps", "3", "--ckpt.interval", "1",
                                                "--broker.outage-s", "60"), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: [r["step"] for r in trainer_rows(out)] == [1], 240, "step 1", process, log_path)
        broker.stop()
        down_s = time.monotonic()
        wait_for(lambda: any(e.get("broker") == "unreachable"
                             for e in log_events(log_path.read_text(), "waiting for the step's micro-batches")),
                 60, "a log line saying the trainer waits for an unreachable broker", process, log_path)
        broker.start()
        print(f"\nbroker down {time.monotonic() - down_s:.1f} s")
        broker.send(range(2, 4))
        assert process.wait(timeout=180) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        broker.stop()
    text = log_path.read_text()
    assert [r["step"] for r in trainer_rows(out)] == [1, 2, 3]
    done = log_events(text, "step done")
    assert [e["step"] for e in done] == [1, 2, 3]
    assert [e["data_digest"] for e in done] == [data_digest([step_tensors(step)]) for step in (1, 2, 3)]
    assert any(e.get("waiting_for") == "heartbeats" for e in log_events(text, "waiting for the broker"))
    committed = [e["step"] for e in log_events(text, "checkpoint committed")]
    assert committed == [1, 2, 3], committed


@pytest.mark.slow
def test_a_resumed_trainer_commits_its_step_and_writes_a_missing_record_once(model_dir, tmp_path):
    """A trainer killed between its checkpoint and its commit left no metrics row and no "step done" line for
    that step (simulated here by removing them): restarted, it commits the step and writes both from the
    checkpoint; restarted once more, it writes nothing twice."""
    broker = RestartableBroker(tmp_path / "spool")
    out = tmp_path / "out"
    try:
        broker.send(range(1, 3))
        args = trainer_args(model_dir, broker, out, "--max-steps", "2", "--ckpt.interval", "1")
        first = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-3000:]
        original = trainer_rows(out)[-1]
        lines = (out / "metrics.jsonl").read_text().splitlines()
        kept = [line for line in lines if not (json.loads(line)["role"] == "trainer" and json.loads(line)["step"] == 2)]
        (out / "metrics.jsonl").write_text("\n".join(kept) + "\n")
        for attempt in range(2):
            again = subprocess.run(args, capture_output=True, text=True, timeout=300)
            assert again.returncode == 0, again.stderr[-3000:]
            rows = trainer_rows(out)
            assert [r["step"] for r in rows] == [1, 2], rows
            assert rows[-1]["train/loss"] == original["train/loss"]
            done = log_events(again.stdout + again.stderr, "step done")
            assert len(done) == (1 if attempt == 0 else 0), done
            if done:
                assert done[0]["step"] == 2 and done[0]["from_checkpoint"] is True
                assert done[0]["data_digest"] == data_digest([step_tensors(2)])
            assert [e["step"] for e in log_events(again.stdout + again.stderr, "checkpoint committed")] == [2]
        assert broker.service.registry.last_committed_step == 2
    finally:
        broker.stop()
