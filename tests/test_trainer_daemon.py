"""`primerl-trainer` as users run it: a real process that pulls its batches from a real broker, publishes
every step's policy to it, checkpoints, commits, resumes on the same loss curve, and serves its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from primerl.broker.config import BrokerConfig
from primerl.client.rollouts import RolloutProducer, pack_batch
from primerl.broker.service import BrokerService
from primerl.proto.v1 import common_pb2
from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from train_ranks import samples  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model",
                            TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1))


class Broker:
    def __init__(self, tmp_path: Path, steps: range, num_micro_batches: int = 2):
        self.service = BrokerService(BrokerConfig(grpc_port=0, rollout_port=0, weight_port=0,
                                                  spool_dir=tmp_path / "spool", max_queue_batches=64, run_id="t"))
        self.endpoints = self.service.start()
        self.send(steps, num_micro_batches)

    def send(self, steps: range, num_micro_batches: int = 2) -> None:
        with RolloutProducer(f"tcp://127.0.0.1:{self.endpoints.rollout_port}") as producer:
            for step in steps:
                group = samples(step)
                per_batch = len(group) // num_micro_batches
                for index in range(num_micro_batches):
                    part = group[index * per_batch:(index + 1) * per_batch]
                    tensors = {name: np.concatenate([s[name] for s in part]) for name in part[0]}
                    producer.send_batch(*pack_batch(step, 0, index, num_micro_batches, tensors), timeout_s=20)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.endpoints.grpc_port}"

    def stop(self):
        self.service.stop(grace_s=1)


def run_trainer(model_dir: Path, broker: Broker, output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [str(BIN / "primerl-trainer"), "--model.name", str(model_dir), "--broker.address", broker.address,
            "--output-dir", str(output_dir), "--optim.lr", "1e-3", "--optim.weight-decay", "0",
            "--model.parallel", "ddp", "--log.format", "json", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def metrics(output_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["role"] == "trainer"]


@pytest.mark.slow
def test_trainer_trains_publishes_checkpoints_and_commits(model_dir, tmp_path):
    broker = Broker(tmp_path, range(1, 4))
    try:
        result = run_trainer(model_dir, broker, tmp_path / "out", "--max-steps", "3", "--ckpt.interval", "2")
        assert result.returncode == 0, result.stderr[-3000:]
        rows = metrics(tmp_path / "out")
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert [r["ckpt/saved"] for r in rows] == [0.0, 1.0, 1.0]
        assert all(np.isfinite(r["train/loss"]) and r["train/num_micro_batches"] == 2 for r in rows)
        assert broker.service.weight_store.latest_version == 3  # one policy version per step, all accepted
        status = broker.service.registry.run_status(broker.service.data_plane_status())
        assert status.last_committed_step == 3 and status.trainer_step == 3
        assert status.last_metrics["train/loss"] == pytest.approx(rows[-1]["train/loss"])
        rollouts = {q.name: q for q in status.queues}["rollouts"]
        assert rollouts.num_items == 0  # every batch released by the commits
        assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step_2", "step_3"]
        for step in (2, 3):  # Hugging Face weights of every checkpoint, for evals and vLLM
            assert (tmp_path / "out" / "weights" / f"step_{step}" / "STABLE").exists()
    finally:
        broker.stop()


@pytest.mark.slow
def test_lora_run_publishes_adapters_the_broker_accepts(model_dir, tmp_path):
    broker = Broker(tmp_path, range(1, 3))
    try:
        result = run_trainer(model_dir, broker, tmp_path / "out", "--max-steps", "2", "--model.lora.rank", "8",
                             "--model.lora.target-modules", '["q_proj", "v_proj"]')
        assert result.returncode == 0, result.stderr[-3000:]
        latest = broker.service.weight_store.latest()
        assert latest.policy_version == 2
        assert latest.kind == 2  # WEIGHT_UPDATE_KIND_LORA
    finally:
        broker.stop()


@pytest.mark.slow
def test_resume_continues_the_same_loss_curve(model_dir, tmp_path):
    straight_broker = Broker(tmp_path / "a", range(1, 5))
    try:
        straight = run_trainer(model_dir, straight_broker, tmp_path / "straight", "--max-steps", "4")
        assert straight.returncode == 0, straight.stderr[-3000:]
    finally:
        straight_broker.stop()
    broker = Broker(tmp_path / "b", range(1, 5))
    try:
        first = run_trainer(model_dir, broker, tmp_path / "resumed", "--max-steps", "2", "--ckpt.interval", "2")
        assert first.returncode == 0, first.stderr[-3000:]
        second = run_trainer(model_dir, broker, tmp_path / "resumed", "--max-steps", "4", "--ckpt.interval", "2")
        assert second.returncode == 0, second.stderr[-3000:]
    finally:
        broker.stop()
    expected = [r["train/loss"] for r in metrics(tmp_path / "straight")]
    resumed = [r["train/loss"] for r in metrics(tmp_path / "resumed")]
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert resumed == pytest.approx(expected, abs=1e-6)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.slow
def test_trainer_serves_its_metrics_over_http(model_dir, tmp_path):
    """Steps 1-2 are there, step 3 is not yet: the trainer waits for it while its /metrics (URL from the broker's
    worker list) shows the state after step 2; then step 3 arrives and the run finishes."""
    broker = Broker(tmp_path, range(1, 3))
    args = [str(BIN / "primerl-trainer"), "--model.name", str(model_dir), "--broker.address", broker.address,
            "--output-dir", str(tmp_path / "out"), "--optim.lr", "1e-3", "--model.parallel", "ddp",
            "--log.format", "json", "--max-steps", "3"]
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        samples: dict = {}
        while samples.get(("primerl_trainer_step", ())) != 2:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
            trainers = broker.service.registry.list_workers(common_pb2.ROLE_TRAINER)
            if trainers:
                url = trainers[0].capabilities["metrics_url"]
                samples = scrape(url)
        rows = metrics(tmp_path / "out")
        assert [r["step"] for r in rows] == [1, 2]
        print(f"\n{url}\n" + "\n".join(f"{name}{dict(labels) or ''} {value:g}" for (name, labels), value
                                       in sorted(samples.items()) if name.startswith("primerl_")))
        assert samples[("primerl_step", (("role", "trainer"),))] == 2
        assert samples[("primerl_trainer_loss", ())] == pytest.approx(rows[-1]["train/loss"])
        assert samples[("primerl_trainer_loss_tokens_total", ())] == sum(r["train/num_loss_tokens"] for r in rows)
        for name in ("train/loss", "train/learning_rate", "train/kl_divergence", "perf/step_time_s"):
            assert samples[("primerl_metric", (("name", name), ("role", "trainer")))] == pytest.approx(rows[-1][name])
        assert f'"metrics_url": "{url}"' in log_path.read_text()  # logged at start
        broker.send(range(3, 4))
        assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        assert [r["step"] for r in metrics(tmp_path / "out")] == [1, 2, 3]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        broker.stop()


@pytest.mark.slow
def test_a_taken_metrics_port_is_a_clear_error(model_dir, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([str(BIN / "primerl-trainer"), "--model.name", str(model_dir), "--output-dir",
                                 str(tmp_path / "out"), "--max-steps", "1", "--prometheus.port", str(port)],
                                capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


class TwoRankBroker(Broker):
    """The same samples as ``Broker`` for one rank, split for two: rank r gets samples r, r + 2, ..."""

    def __init__(self, tmp_path: Path, steps: range):
        self.service = BrokerService(BrokerConfig(grpc_port=0, rollout_port=0, weight_port=0,
                                                  spool_dir=tmp_path / "spool", max_queue_batches=64, run_id="t2"))
        self.endpoints = self.service.start()
        with RolloutProducer(f"tcp://127.0.0.1:{self.endpoints.rollout_port}") as producer:
            for step in steps:
                for rank in range(2):
                    part = samples(step)[rank::2]
                    tensors = {name: np.concatenate([s[name] for s in part]) for name in part[0]}
                    producer.send_batch(*pack_batch(step, rank, 0, 1, tensors), timeout_s=20)


@pytest.mark.slow
def test_two_trainer_ranks_under_torchrun_match_one(model_dir, tmp_path):
    one_broker = Broker(tmp_path / "one", range(1, 3), num_micro_batches=1)
    try:
        one = run_trainer(model_dir, one_broker, tmp_path / "one-out", "--max-steps", "2")
        assert one.returncode == 0, one.stderr[-3000:]
    finally:
        one_broker.stop()
    two_broker = TwoRankBroker(tmp_path / "two", range(1, 3))
    try:
        args = ["--model.name", str(model_dir), "--broker.address", two_broker.address, "--output-dir",
                str(tmp_path / "two-out"), "--optim.lr", "1e-3", "--optim.weight-decay", "0", "--model.parallel", "ddp",
                "--max-steps", "2"]
        two = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(BIN / "primerl-trainer"),
                              *args], capture_output=True, text=True, timeout=600)
        assert two.returncode == 0, two.stderr[-3000:]
        assert two_broker.service.weight_store.latest_version == 2
    finally:
        two_broker.stop()
    one_losses = [r["train/loss"] for r in metrics(tmp_path / "one-out")]
    two_losses = [r["train/loss"] for r in metrics(tmp_path / "two-out")]
    assert two_losses == pytest.approx(one_losses, abs=1e-5)


@pytest.mark.slow
def test_a_failed_checkpoint_write_stops_the_trainer_and_its_step_is_never_committed(model_dir, tmp_path):
    """The IO thread's checkpoint of step 2 fails (its directory is a file): the error stops the run, typed and
    with its cause; step 2 is published but never committed; step 3 never changes the weights."""
    broker = Broker(tmp_path, range(1, 4))
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoints should go")
    try:
        result = run_trainer(model_dir, broker, tmp_path / "out", "--max-steps", "3", "--ckpt.interval", "2",
                             "--ckpt.dir", str(blocker))
        assert result.returncode not in (0, None), result.stderr[-3000:]
        assert "TrainerIOError" in result.stderr and "checkpoint step 2" in result.stderr, result.stderr[-3000:]
        status = broker.service.registry.run_status(broker.service.data_plane_status())
        assert status.last_committed_step == 0  # exactly once: no commit without its durable checkpoint
        assert broker.service.weight_store.latest_version == 2
        assert [r["step"] for r in metrics(tmp_path / "out")] == [1]  # step 2's row comes after its checkpoint
    finally:
        broker.stop()
