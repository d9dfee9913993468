"""The broker as users run it: the `primerl-broker` process over loopback, with real gRPC and ZeroMQ.

Covers what only a whole process shows: batches survive a SIGKILL and a restart on the same spool,
a restarted trainer gets its batches again, a flooding producer gets backpressure while the broker's
memory stays bounded, and auth refusals on every socket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from primerl.broker.control_client import BrokerError, ControlClient
from primerl.broker.rollout_clients import RolloutConsumer, RolloutProducer, RolloutRefused, pack_batch
from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.config_common import BrokerClientConfig

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 30


class BrokerProcess:
    """One `primerl-broker` child; stopped (or killed) only by the test that started it."""

    def __init__(self, tmp_path: Path, spool_dir: Path, *extra: str):
        self.ready_file = tmp_path / f"ready-{time.monotonic_ns()}.json"
        self.log_path = tmp_path / f"broker-{time.monotonic_ns()}.log"
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(BIN / "primerl-broker"), "--grpc-port", "0", "--rollout-port", "0", "--weight-port", "0",
             "--spool-dir", str(spool_dir), "--heartbeat-interval-s", "0.2", "--ready-file", str(self.ready_file), *extra],
            stdout=self.log_file, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"broker did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        self.ports = json.loads(self.ready_file.read_text())

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc_port']}"

    @property
    def rollout_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['rollout_port']}"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.log_file.close()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log_file.close()
        return self.process.returncode


@pytest.fixture
def processes():
    started: list[BrokerProcess] = []
    yield started
    for broker in started:
        if broker.process.poll() is None:
            broker.stop()


def tensors_for(step: int, rank: int, index: int, n: int = 32) -> dict[str, np.ndarray]:
    seed = step * 100 + rank * 10 + index
    return {"input_ids": np.arange(seed, seed + n, dtype=np.int64), "advantages": np.full(n, seed, np.float32)}


def produce(endpoint: str, steps: range, ranks: int, num_micro_batches: int, token: str | None = None) -> None:
    with RolloutProducer(endpoint, auth_token=token) as producer:
        for step in steps:
            for rank in range(ranks):
                for index in range(num_micro_batches):
                    header, payload = pack_batch(step, rank, index, num_micro_batches, tensors_for(step, rank, index))
                    ack = producer.send_batch(header, payload, timeout_s=20)
                    assert ack.durable


def check_step(consumer: RolloutConsumer, step: int, rank: int, num_micro_batches: int) -> None:
    batches = consumer.fetch_step(step, timeout_s=20)
    assert [h.micro_batch_index for h, _ in batches] == list(range(num_micro_batches))
    for header, tensors in batches:
        expected = tensors_for(step, rank, header.micro_batch_index)
        for name, array in expected.items():
            np.testing.assert_array_equal(tensors[name], array)


@pytest.mark.slow
def test_spooled_batches_survive_sigkill_and_restart(tmp_path, processes):
    spool = tmp_path / "spool"
    broker = BrokerProcess(tmp_path, spool, "--max-queue-batches", "16")
    processes.append(broker)
    produce(broker.rollout_endpoint, range(1, 4), ranks=2, num_micro_batches=2)
    broker.kill()  # no chance to flush or clean up anything

    reborn = BrokerProcess(tmp_path, spool, "--max-queue-batches", "16")
    processes.append(reborn)
    for rank in range(2):
        with RolloutConsumer(reborn.rollout_endpoint, worker_id=f"trainer-{rank}", rank=rank) as consumer:
            for step in range(1, 4):
                check_step(consumer, step, rank, 2)
    client = ControlClient(BrokerClientConfig(address=reborn.grpc_address), "client", "checker")
    try:
        queues = {q.name: q for q in client.get_run_status().queues}
        assert queues["rollouts"].num_items == 12
    finally:
        client.close()
    assert reborn.stop() == 0


@pytest.mark.slow
def test_restarted_trainer_gets_its_batches_again_and_commits_release_them(tmp_path, processes):
    broker = BrokerProcess(tmp_path, tmp_path / "spool", "--max-queue-batches", "16")
    processes.append(broker)
    produce(broker.rollout_endpoint, range(1, 4), ranks=1, num_micro_batches=3)
    trainer = ControlClient(BrokerClientConfig(address=broker.grpc_address), "trainer", "trainer-0")
    try:
        trainer.register()
        with RolloutConsumer(broker.rollout_endpoint, worker_id="trainer-0", rank=0) as consumer:
            for step in (1, 2, 3):
                check_step(consumer, step, 0, 3)
        committed = trainer.commit_step(1)  # the checkpoint of step 1 is durable
        assert (committed.last_committed_step, committed.num_batches_released) == (1, 3)
        # The trainer dies after step 3 and resumes from its step-1 checkpoint: steps 2 and 3 come again.
        with RolloutConsumer(broker.rollout_endpoint, worker_id="trainer-0-restarted", rank=0) as consumer:
            check_step(consumer, 2, 0, 3)
            check_step(consumer, 3, 0, 3)
            with pytest.raises(RolloutRefused) as refused:
                consumer.fetch_step(1, timeout_s=10)
            assert refused.value.code == common_pb2.ERROR_CODE_NOT_FOUND
    finally:
        trainer.close()


@pytest.mark.slow
def test_flooding_producer_gets_backpressure_and_broker_memory_stays_bounded(tmp_path, processes):
    broker = BrokerProcess(tmp_path, tmp_path / "spool", "--max-queue-batches", "4")
    processes.append(broker)
    payload_tensors = {"input_ids": np.zeros(1 << 18, dtype=np.int64)}  # 2 MiB per batch
    context = zmq.Context()
    rss_before = broker.rss_bytes()
    num_sent, replies = 200, []
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(broker.rollout_endpoint)
        for index in range(num_sent):  # 400 MiB offered as fast as the socket takes it, never waiting for acks
            header, payload = pack_batch(1 + index, 0, 0, 1, payload_tensors)
            dealer.send_multipart(framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload]), copy=False)
        deadline = time.monotonic() + 60
        while len(replies) < num_sent and time.monotonic() < deadline:
            if dealer.poll(1000):
                replies.append(framing.decode(dealer.recv_multipart()).header)
        rss_peak = broker.rss_bytes()
    finally:
        context.destroy(linger=0)
    assert len(replies) == num_sent, "every batch gets an answer: accepted or told to wait"
    accepted = [r for r in replies if r.durable]
    told_to_wait = [r for r in replies if r.error.code == common_pb2.ERROR_CODE_BACKPRESSURE]
    assert len(accepted) == 4 and len(told_to_wait) == num_sent - 4
    assert all(r.error.retry_after_ms > 0 for r in told_to_wait)
    assert rss_peak - rss_before < 150 * (1 << 20), f"broker grew by {(rss_peak - rss_before) >> 20} MiB"


@pytest.mark.slow
def test_run_token_is_required_on_every_socket(tmp_path, processes):
    broker = BrokerProcess(tmp_path, tmp_path / "spool", "--run-token", "s3cret")
    processes.append(broker)
    outsider = ControlClient(BrokerClientConfig(address=broker.grpc_address), "trainer", "outsider")
    try:
        with pytest.raises(BrokerError) as refused:
            outsider.register()
        assert "UNAUTHENTICATED" in str(refused.value.code)
    finally:
        outsider.close()
    with RolloutProducer(broker.rollout_endpoint) as producer:
        header, payload = pack_batch(1, 0, 0, 1, tensors_for(1, 0, 0))
        with pytest.raises(RolloutRefused) as refused_batch:
            producer.send_batch(header, payload, timeout_s=10)
        assert refused_batch.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    member = ControlClient(BrokerClientConfig(address=broker.grpc_address, run_token="s3cret"), "trainer", "member")
    try:
        assert member.register().worker_id
    finally:
        member.close()
    produce(broker.rollout_endpoint, range(1, 2), ranks=1, num_micro_batches=1, token="s3cret")
    assert broker.stop() == 0
