"""The broker's data-plane limits reach the clients (``RegisterResponse.limits``) and every client sizes itself from
them: a weight update larger than ``broker.max_message_bytes`` crosses a real broker below and above the clients'
defaults (16 MiB: the trainer's 64 MiB chunks would cost its connection; 512 MiB: the broker's chunks exceed the
256 MiB a default subscriber accepts), and a rollout batch near the limit goes through, one over it is refused at once.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.broker import BrokerHarness

from primerl.client.control import ControlClient
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, RolloutRefused, pack_batch
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.proto import tensor_frames
from primerl.proto.data_plane_limits import DEFAULT_BROKER_LIMITS, ENVELOPE_ALLOWANCE_BYTES
from primerl.proto.digests import payload_digest
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.config_common import BrokerClientConfig

TRAINER_CHUNK_BYTES = 64 * MiB  # what the trainer asks for (trainer/runner.py), capped by the broker's chunk size


def _register(broker: BrokerHarness, role: str, name: str) -> ControlClient:
    client = ControlClient(
        BrokerClientConfig(address=broker.grpc_address),
        role,
        name,
        address="http://127.0.0.1:8000" if role == "inference" else "",
    )
    client.register()
    client.start_heartbeats()  # as a role does: a worker the registry marks lost gets no weight pushes
    return client


def _publish_and_receive(broker: BrokerHarness, payload_bytes: int) -> None:
    """Publish one FULL update of ``payload_bytes`` as the trainer would, and receive and verify it as an inference
    worker would, each client sized only from its registration."""
    trainer, infer = _register(broker, "trainer", "trainer-rank0"), _register(broker, "inference", "infer-0")
    limits = trainer.limits
    assert limits == infer.limits == broker.service.data_plane_limits
    weights = np.random.default_rng(0).integers(0, 255, payload_bytes, dtype=np.uint8)
    payload, specs = tensor_frames.encode_tensors({"w": weights})
    header = data_pb2.WeightUpdateHeader(policy_version=1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
    try:
        subscriber = WeightSubscriber(
            infer.registration.weight_endpoint, None, infer.worker_id, limits=infer.limits.frames
        )
        with (
            subscriber,
            WeightPublisher(
                trainer.registration.weight_endpoint,
                None,
                "trainer-rank0",
                min(TRAINER_CHUNK_BYTES, limits.weight_chunk_bytes),
                limits=limits.frames,
            ) as publisher,
        ):
            subscriber.hello(None)
            assert publisher.publish(header, payload, timeout_s=120).applied
            deadline_s = time.monotonic() + 120
            received = None
            while received is None and time.monotonic() < deadline_s:
                received = subscriber.receive(5.0)
            assert received is not None, "the subscriber got no update"
            received_header, received_payload = received
            assert received_header.policy_version == 1 and received_payload.nbytes == len(payload) > payload_bytes
            assert payload_digest(received_payload) == payload_digest(payload) == received_header.digest
            subscriber.ack(1)
    finally:
        trainer.close()
        infer.close()


def test_registration_carries_the_limits_of_the_broker(tmp_path):
    broker = BrokerHarness(
        tmp_path / "spool", max_message_bytes=16 * MiB, max_payload_frames=4, max_transfer_bytes=64 * MiB
    )
    try:
        client = _register(broker, "orchestrator", "orchestrator")
        limits = client.limits
        assert limits.frames.max_frame_bytes == limits.weight_chunk_bytes == 16 * MiB
        assert limits.frames.max_message_bytes == 16 * MiB + ENVELOPE_ALLOWANCE_BYTES
        assert limits.frames.max_payload_frames == 4 and limits.frames.max_transfer_bytes == 64 * MiB
        client.close()
    finally:
        broker.stop()


def test_the_weight_chunk_size_is_the_brokers_and_at_most_its_frame(tmp_path):
    for fields, chunk_bytes in (({}, 8 * MiB), ({"max_message_bytes": 4 * MiB}, 4 * MiB)):
        broker = BrokerHarness(tmp_path / f"spool-{chunk_bytes}", **fields)
        try:
            client = _register(broker, "trainer", "trainer-rank0")
            assert client.limits.weight_chunk_bytes == broker.service.chunk_bytes == chunk_bytes
            client.close()
        finally:
            broker.stop()


def test_a_client_of_a_broker_that_sends_no_limits_keeps_the_defaults():
    client = ControlClient(BrokerClientConfig(address="127.0.0.1:1"), "trainer", "t")
    try:
        assert client.limits == DEFAULT_BROKER_LIMITS
        assert DEFAULT_BROKER_LIMITS.weight_chunk_bytes == DEFAULT_BROKER_LIMITS.frames.max_frame_bytes == 256 * MiB
    finally:
        client.close()


def test_weights_and_rollouts_cross_a_broker_with_small_messages(tmp_path):
    broker = BrokerHarness(tmp_path / "spool", max_message_bytes=16 * MiB)
    try:
        _publish_and_receive(broker, 40 * MiB)  # three chunks of at most 16 MiB, where the trainer asks for 64 MiB

        orchestrator = _register(broker, "orchestrator", "orchestrator")
        trainer = _register(broker, "trainer", "trainer-rank0")
        limits = orchestrator.limits.frames
        near_limit = {"input_ids": np.arange((16 * MiB - 64 * 1024) // 8, dtype=np.int64)}
        over_limit = {"input_ids": np.arange(16 * MiB // 8 + 1, dtype=np.int64)}
        with RolloutProducer(orchestrator.registration.rollout_endpoint, limits=limits) as producer:
            assert producer.send_batch(*pack_batch(1, 0, 0, 1, near_limit), timeout_s=30).durable
            started_s = time.monotonic()
            with pytest.raises(RolloutRefused) as refused:
                producer.send_batch(*pack_batch(2, 0, 0, 1, over_limit), timeout_s=30)
            assert refused.value.code == common_pb2.ERROR_CODE_OVERSIZED and time.monotonic() - started_s < 5
        with RolloutConsumer(
            trainer.registration.rollout_endpoint, worker_id=trainer.worker_id, rank=0, limits=trainer.limits.frames
        ) as consumer:
            [(_, tensors)] = consumer.fetch_step(1, timeout_s=30)
            assert np.array_equal(tensors["input_ids"], near_limit["input_ids"])
        orchestrator.close()
        trainer.close()
    finally:
        broker.stop()


@pytest.mark.slow
def test_a_weight_update_crosses_a_broker_with_large_messages(tmp_path):
    broker = BrokerHarness(tmp_path / "spool", max_message_bytes=512 * MiB, weight_chunk_bytes=512 * MiB)
    try:
        _publish_and_receive(broker, 512 * MiB + 8 * MiB)  # the broker re-chunks it into 512 MiB chunks
    finally:
        broker.stop()
