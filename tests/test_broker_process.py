"""The broker as users run it: the `primerl-broker` process over loopback, with real gRPC and ZeroMQ.

Covers what only a whole process shows: batches survive a SIGKILL and a restart on the same spool,
a restarted trainer gets its batches again, a flooding producer gets backpressure while the broker's
memory stays bounded, and auth refusals on every socket.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from support.daemons import BIN, BrokerProcess

from primerl.broker.service import END_OF_RUN_GRACE_S
from primerl.client.broker_errors import BrokerError
from primerl.client.control import ControlClient
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, RolloutRefused, pack_batch
from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.config_common import BrokerClientConfig


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


# ------------------------------------------------------------------------------------------- run state
STATUS_FACTS = (
    "run_id",
    "trainer_step",
    "last_committed_step",
    "latest_policy_version",
    "orchestrator_step",
    "last_metrics",
    "last_metrics_step",
    "max_steps",
)


def status_json(address: str) -> dict:
    """`primerl status --json`, the way an operator runs it."""
    result = subprocess.run(
        [str(BIN / "primerl"), "status", "--broker", address, "--json"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def publish_full(endpoint: str, version: int) -> None:
    from primerl.client.weight_publisher import WeightPublisher
    from primerl.proto import tensor_frames

    data, specs = tensor_frames.encode_tensors({"w": np.arange(256, dtype=np.float32)})
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
    publisher = WeightPublisher(endpoint, None, "trainer-0", 1 << 20)
    try:
        assert publisher.publish(header, data, timeout_s=20).applied
    finally:
        publisher.close()


def wait_for_file_state(path: Path, predicate, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = json.loads(path.read_text()) if path.exists() else {}
        if state and predicate(state):
            return state
        assert time.monotonic() < deadline, f"run state never matched: {state}"
        time.sleep(0.1)


@pytest.mark.slow
def test_run_state_survives_sigkill_and_restart_and_the_end_of_the_run_too(tmp_path, processes):
    spool = tmp_path / "spool"
    args = ("--max-queue-batches", "16", "--max-steps", "3")
    broker = BrokerProcess(tmp_path, spool, *args)
    processes.append(broker)
    produce(broker.rollout_endpoint, range(1, 3), ranks=1, num_micro_batches=1)
    trainer = ControlClient(BrokerClientConfig(address=broker.grpc_address), "trainer", "trainer-0")
    orchestrator = ControlClient(BrokerClientConfig(address=broker.grpc_address), "orchestrator", "orchestrator")
    try:
        trainer.register()
        orchestrator.register()
        with RolloutConsumer(broker.rollout_endpoint, worker_id="trainer-0", rank=0) as consumer:
            for step in (1, 2):
                check_step(consumer, step, 0, 1)
                trainer.report_metrics(step, {"train/loss": 1.0 / step})
        publish_full(f"tcp://127.0.0.1:{broker.ports['weight_port']}", 2)
        assert trainer.commit_step(2).num_batches_released == 2
        orchestrator.report_metrics(3, {"reward/mean": 0.375})
        before = trainer.get_run_status()
        before_json = status_json(broker.grpc_address)
    finally:
        trainer.close()
        orchestrator.close()
    assert (before.trainer_step, before.last_committed_step, before.latest_policy_version) == (2, 2, 2)
    assert (before.orchestrator_step, before.last_metrics_step) == (3, 3)
    # The commit was written before it answered; the metrics since within about a second.
    wait_for_file_state(spool / "run_state.json", lambda state: state["last_metrics_step"] == 3)
    broker.kill()  # no chance to write anything more

    reborn = BrokerProcess(tmp_path, spool, *args)
    processes.append(reborn)
    checker = ControlClient(BrokerClientConfig(address=reborn.grpc_address), "client", "checker")
    trainer = ControlClient(BrokerClientConfig(address=reborn.grpc_address), "trainer", "trainer-0")
    late = ControlClient(BrokerClientConfig(address=reborn.grpc_address), "inference", "infer-0")
    try:
        after = checker.get_run_status()
        for name in STATUS_FACTS:
            assert getattr(after, name) == getattr(before, name), name
        assert {q.name: q.num_items for q in after.queues}["weights"] == 1  # the FULL v2 is back (weight_durable)
        after_json = status_json(reborn.grpc_address)
        for name in STATUS_FACTS:
            assert after_json[name] == before_json[name], name
        assert after_json["last_metrics"] == {"train/loss": 0.5, "reward/mean": 0.375}
        assert late.register().latest_policy_version == 2
        assert late.heartbeat().last_committed_step == 2

        # The trainer's commit of step 2 sent again to the restarted broker (its answer was lost): a success.
        trainer.register()
        again = trainer.commit_step(2)
        assert (again.last_committed_step, again.num_batches_released) == (2, 0)
        # The last step, then the end of the run: late workers are told to stop, before and after a restart.
        trainer.report_metrics(3, {"train/loss": 0.25})
        assert trainer.commit_step(3).last_committed_step == 3
        assert not late.heartbeat().shutdown_requested
        assert trainer.deregister("training finished")
        finished_s = time.monotonic()
        assert not late.heartbeat().shutdown_requested  # the grace: the last policy, a supervisor's own stop
        while not late.heartbeat().shutdown_requested:
            assert time.monotonic() - finished_s < END_OF_RUN_GRACE_S + 5, "never told to stop"
            time.sleep(0.1)
        assert time.monotonic() - finished_s >= END_OF_RUN_GRACE_S - 0.5
    finally:
        for client in (checker, trainer, late):
            client.close()
    reborn.kill()

    third = BrokerProcess(tmp_path, spool, *args)
    processes.append(third)
    straggler = ControlClient(BrokerClientConfig(address=third.grpc_address), "orchestrator", "orchestrator")
    try:
        straggler.register()
        restarted_s = time.monotonic()
        while not straggler.heartbeat().shutdown_requested:  # after the grace, counted from the restart
            assert time.monotonic() - restarted_s < END_OF_RUN_GRACE_S + 5, "never told to stop"
            time.sleep(0.1)
        assert straggler.shutdown_requested.is_set()
        final = straggler.get_run_status()
        assert (final.trainer_step, final.last_committed_step, final.run_id) == (3, 3, before.run_id)
        shown = subprocess.run(
            [str(BIN / "primerl"), "status", "--broker", third.grpc_address], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        assert "trainer step 3 (committed 3) / 3" in shown.stdout and "run finished" in shown.stdout, shown.stdout
    finally:
        straggler.close()
    assert third.stop() == 0
