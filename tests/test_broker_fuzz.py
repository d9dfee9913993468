"""Property-based fuzz of the broker's ZeroMQ sockets: thousands of malformed, mutated and hostile
messages, after which the same broker still relays rollouts, fans out weights and answers gRPC."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primerl.broker.service import BrokerService
from primerl.client.control import ControlClient
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, pack_batch
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.configs.broker import BrokerConfig
from primerl.proto import chunked_transfer, framing
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.config_common import BrokerClientConfig

NUM_EXAMPLES = 2500


def valid_messages() -> list[list[bytes]]:
    """One well-formed message of each kind a peer may send, to mutate."""
    rollout_header, rollout_payload = pack_batch(3, 0, 0, 1, {"input_ids": np.arange(16, dtype=np.int64)})
    weights, specs = tf.encode_tensors({"w": np.ones((4, 4), np.float32)})
    weight_header = data_pb2.WeightUpdateHeader(
        policy_version=1,
        kind=data_pb2.WEIGHT_UPDATE_KIND_FULL,
        digest=hashlib.sha256(weights).hexdigest(),
        tensors=specs,
        payload_bytes=len(weights),
    )
    chunked = list(chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, weight_header, weights, chunk_bytes=40))
    messages = [
        framing.encode(data_pb2.ROLLOUT_BATCH, rollout_header, [rollout_payload]),
        framing.encode(data_pb2.ROLLOUT_REQUEST, data_pb2.RolloutRequest(step=3, rank=0, credits=2)),
        framing.encode(data_pb2.HELLO, data_pb2.Hello(worker_id="fuzz", role=common_pb2.ROLE_INFERENCE)),
        framing.encode(data_pb2.WEIGHT_UPDATE, weight_header, [weights]),
        framing.encode(data_pb2.WEIGHT_ACK, data_pb2.WeightAck(policy_version=7, applied=True)),
        framing.encode(data_pb2.ERROR, data_pb2.ErrorReply()),
        chunked[1],  # a chunk without its first chunk
    ]
    return [[bytes(memoryview(frame)) for frame in message] for message in messages]


@st.composite
def hostile_messages(draw) -> list[bytes]:
    kind = draw(st.sampled_from(["mutated", "random", "truncated", "retyped"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=300), min_size=0, max_size=6))
    frames = [bytearray(f) for f in draw(st.sampled_from(VALID))]
    if kind == "truncated":
        keep = draw(st.integers(0, len(frames)))
        frames = frames[:keep]
        if frames and draw(st.booleans()):
            frames[-1] = frames[-1][: draw(st.integers(0, len(frames[-1])))]
    elif kind == "retyped":
        frames[1] = bytearray([draw(st.integers(0, 255))])
    else:
        for _ in range(draw(st.integers(1, 4))):
            index = draw(st.integers(0, len(frames) - 1))
            if frames[index]:
                position = draw(st.integers(0, len(frames[index]) - 1))
                frames[index][position] = draw(st.integers(0, 255))
    return [bytes(f) for f in frames]


VALID = valid_messages()


@pytest.mark.slow
def test_broker_survives_hostile_frames_and_still_serves(tmp_path):
    config = BrokerConfig(
        grpc_port=0,
        rollout_port=0,
        weight_port=0,
        spool_dir=tmp_path / "spool",
        max_queue_batches=1000,
        max_message_bytes=1 << 20,
        run_id="fuzz",
    )
    service = BrokerService(config)
    endpoints = service.start()
    context = zmq.Context()
    sockets = []
    try:
        for port in (endpoints.rollout_port, endpoints.weight_port):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDTIMEO, 2000)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            sockets.append(dealer)
        replies = {"count": 0, "sent": 0}

        @settings(
            max_examples=NUM_EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(message=hostile_messages(), target=st.integers(0, 1))
        def send_hostile(message, target):
            socket = sockets[target]
            replies["sent"] += 1
            if message:
                socket.send_multipart(message)
            while socket.poll(0):
                socket.recv_multipart()
                replies["count"] += 1

        send_hostile()
        assert replies["sent"] >= 2000, f"only {replies['sent']} hostile messages were generated"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(s.poll(100) for s in sockets):
            for socket in sockets:
                while socket.poll(0):
                    socket.recv_multipart()
                    replies["count"] += 1
        assert replies["count"] > NUM_EXAMPLES // 2, "the broker answers bad messages with errors"
        assert service.rollout_plane.running and service.weight_plane.running

        # Still serves: a rollout round trip, a weight fan-out, and gRPC status.
        rollout_endpoint = f"tcp://127.0.0.1:{endpoints.rollout_port}"
        tensors = {"input_ids": np.arange(64, dtype=np.int64)}
        with RolloutProducer(rollout_endpoint) as producer:
            assert producer.send_batch(*pack_batch(900, 1, 0, 1, tensors), timeout_s=10).durable
        with RolloutConsumer(rollout_endpoint, worker_id="checker", rank=1) as consumer:
            ((header, received),) = consumer.fetch_step(900, timeout_s=10)
            np.testing.assert_array_equal(received["input_ids"], tensors["input_ids"])

        weight_endpoint = f"tcp://127.0.0.1:{endpoints.weight_port}"
        payload, specs = tf.encode_tensors({"w": np.full((8, 8), 2.0, np.float32)})
        latest = service.weight_store.latest_version or 0
        header = data_pb2.WeightUpdateHeader(
            policy_version=latest + 1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs, payload_bytes=len(payload)
        )
        with (
            WeightSubscriber(weight_endpoint, None, "checker-worker") as subscriber,
            WeightPublisher(weight_endpoint, None, "checker-trainer", 1 << 20) as publisher,
        ):
            subscriber.hello(current_version=None)
            assert publisher.publish(header, payload, timeout_s=10).applied
            deadline = time.monotonic() + 10
            got = None
            while got is None and time.monotonic() < deadline:
                got = subscriber.receive(timeout_s=1)
                if got is not None and got[0].policy_version != latest + 1:
                    subscriber.ack(got[0].policy_version)
                    got = None
            assert got is not None and bytes(got[1]) == payload

        client = ControlClient(BrokerClientConfig(address=f"127.0.0.1:{endpoints.grpc_port}"), "client", "checker")
        try:
            status = client.get_run_status()
            assert status.run_id == "fuzz"
        finally:
            client.close()
    finally:
        context.destroy(linger=0)
        service.stop(grace_s=1)
