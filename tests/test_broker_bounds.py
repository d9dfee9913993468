"""Bounds at the broker's defaults that an adversarial fuzz found loose, each through a real broker on loopback:
the rollout socket's own message cap, a connection gate on the weight socket, open weight transfers that cannot
starve a publisher, and what a peer without the run token can make the broker hold."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from support.broker import BrokerHarness
from support.daemons import BrokerProcess

from primerl.client.rollouts import RolloutProducer, RolloutRefused, pack_batch
from primerl.client.weight_publisher import WeightBrokerLost, WeightPublisher
from primerl.client.weights import WeightPlaneError, WeightSubscriber
from primerl.configs.broker import BrokerConfig
from primerl.proto import chunked_transfer, framing
from primerl.proto import tensor_frames as tf
from primerl.proto.digests import payload_digest
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.runtime.wire_security import apply_run_token

TOKEN = "bounds-token"


def _raw_dealer(context: zmq.Context, endpoint: str, token: str | None = TOKEN) -> zmq.Socket:
    """A bare DEALER that presents ``token`` at the handshake (None: none) and sends whatever a test gives it."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 2000)
    if token is not None:
        apply_run_token(socket, token, "raw")
    socket.connect(endpoint)
    return socket


def test_the_rollout_cap_is_its_own_and_orchestrators_learn_it(tmp_path):
    assert BrokerConfig().resolved_max_rollout_message_bytes == 64 * MiB  # below the weight plane's 256 MiB
    assert BrokerConfig(max_message_bytes=8 * MiB).resolved_max_rollout_message_bytes == 8 * MiB
    broker = BrokerHarness(
        tmp_path / "spool", run_token=TOKEN, max_message_bytes=8 * MiB, max_rollout_message_bytes=2 * MiB
    )
    try:
        with broker.client(role="orchestrator", name="orch") as orchestrator:
            orchestrator.register()
            rollout_limits = orchestrator.limits
        with broker.client(role="trainer", name="trainer") as trainer:
            trainer.register()
            trainer_limits = trainer.limits
        assert rollout_limits.frames.max_frame_bytes == 2 * MiB
        assert trainer_limits.frames.max_frame_bytes == 8 * MiB == trainer_limits.weight_chunk_bytes
        with RolloutProducer(broker.rollout_endpoint, TOKEN, limits=rollout_limits.frames) as producer:
            big = pack_batch(1, 0, 0, 2, {"input_ids": np.zeros((3 * MiB) // 8, dtype=np.int64)})
            with pytest.raises(RolloutRefused, match="max_rollout_message_bytes"):
                producer.send_batch(*big, timeout_s=5)
            small = pack_batch(1, 0, 1, 2, {"input_ids": np.zeros(1024, dtype=np.int64)})
            assert producer.send_batch(*small, timeout_s=10).durable
        # A peer that ignores the cap loses its connection before the broker buffers the frame: no reply.
        context = zmq.Context()
        try:
            dealer = _raw_dealer(context, broker.rollout_endpoint)
            header, payload = pack_batch(2, 0, 0, 1, {"input_ids": np.zeros((3 * MiB) // 8, dtype=np.int64)})
            dealer.send_multipart(framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN))
            assert not dealer.poll(1500)
        finally:
            context.destroy(linger=0)
        assert broker.service.rollout_plane.status().queue.num_batches == 1
    finally:
        broker.stop()


def _weight_update(version: int, num_floats: int = 64) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs = tf.encode_tensors({"w": np.full(num_floats, version, dtype=np.float32)})
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
    return header, payload


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_the_weight_socket_admits_max_weight_connections_and_clients_retry(tmp_path):
    broker = BrokerHarness(tmp_path / "spool", run_token=TOKEN, max_weight_connections=1)
    context = zmq.Context()
    try:
        holder = _raw_dealer(context, broker.weight_endpoint)
        holder.send_multipart(framing.encode(data_pb2.HELLO, data_pb2.Hello(worker_id="holder"), auth_token=TOKEN))
        assert _wait_for(lambda: broker.service.weight_plane.status().num_connections == 1)
        header, payload = _weight_update(1)
        with pytest.raises(WeightBrokerLost, match="max_weight_connections"):
            broker.publish(header, payload, timeout_s=5)
        with WeightSubscriber(broker.weight_endpoint, TOKEN, "inference-0") as subscriber:
            subscriber.hello()
            assert subscriber.receive(timeout_s=1.5) is None and subscriber.broker_latest is None
            assert subscriber.num_handshake_refusals >= 1
            assert broker.service.weight_plane.status().num_connections_refused >= 2
            holder.close(linger=0)  # a place frees: the subscriber gets in on its own
            deadline = time.monotonic() + 10
            while subscriber.broker_latest is None and time.monotonic() < deadline:
                subscriber.receive(timeout_s=0.5)
            assert subscriber.broker_latest is not None
    finally:
        context.destroy(linger=0)
        broker.stop()


def test_a_publisher_refused_before_it_publishes_says_why(tmp_path):
    """The refusal can come while the publisher is not yet waiting (it connects when built, then hashes the
    payload): the publish must still end at once with the refusal, not as a connect timeout."""
    broker = BrokerHarness(tmp_path / "spool", run_token=TOKEN, max_weight_connections=1)
    context = zmq.Context()
    try:
        holder = _raw_dealer(context, broker.weight_endpoint)
        holder.send_multipart(framing.encode(data_pb2.HELLO, data_pb2.Hello(worker_id="holder"), auth_token=TOKEN))
        assert _wait_for(lambda: broker.service.weight_plane.status().num_connections == 1)
        header, payload = _weight_update(1)
        with WeightPublisher(broker.weight_endpoint, TOKEN, "trainer", broker.service.chunk_bytes) as publisher:
            assert _wait_for(lambda: broker.service.weight_plane.status().num_connections_refused >= 1)
            started_s = time.monotonic()
            with pytest.raises(WeightBrokerLost, match="max_weight_connections"):
                publisher.publish(header, payload, timeout_s=5)
            assert time.monotonic() - started_s < publisher.connect_timeout_s
    finally:
        context.destroy(linger=0)
        broker.stop()


def _first_chunks(header, payload, *, chunk_bytes: int, transfer_id: str, sender: str):
    return iter(
        chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE,
            header,
            payload,
            chunk_bytes=chunk_bytes,
            transfer_id=transfer_id,
            sender=sender,
            auth_token=TOKEN,
        )
    )


def test_half_open_transfers_from_many_connections_do_not_starve_a_publish(tmp_path):
    """8 connections each open a chunked transfer and go quiet, taking every place (a fuzz found they kept every
    publish out for the 30 s stall timeout): the publish is refused while they are fresh (a clear error, at once)
    and gets in once they have been quiet for ``transfer_evict_after_s``."""
    broker = BrokerHarness(tmp_path / "spool", run_token=TOKEN, max_message_bytes=MiB, transfer_evict_after_s=2.0)
    context = zmq.Context()
    try:
        header, payload = _weight_update(1, num_floats=(3 * MiB) // 4)  # 3 MiB: three chunks
        header.digest = payload_digest(payload)
        header.payload_bytes = len(payload)
        peers = [_raw_dealer(context, broker.weight_endpoint) for _ in range(8)]
        for index, peer in enumerate(peers):
            chunks = _first_chunks(header, payload, chunk_bytes=MiB, transfer_id=f"stall-{index}", sender=f"p{index}")
            peer.send_multipart(next(chunks))
        assert _wait_for(lambda: broker.service.weight_plane.status().num_open_transfers == 8)
        with pytest.raises(WeightUpdateRefused, match="too many open transfers"):
            broker.publish(header, payload, timeout_s=10)
        time.sleep(2.2)  # quiet for transfer_evict_after_s now
        started = time.monotonic()
        assert broker.publish(header, payload, timeout_s=10).applied
        assert time.monotonic() - started < 5 and broker.service.weight_store.latest_version == 1
    finally:
        context.destroy(linger=0)
        broker.stop()


def test_a_trickling_transfer_that_holds_the_open_bytes_gives_way(tmp_path):
    """One connection declares all of ``max_open_transfer_bytes`` and keeps its transfer alive with tiny chunks:
    the publish is told to retry while that transfer is young, and gets in once it is behind the pace that would
    finish it within the transfer timeout, though chunks still come."""
    broker = BrokerHarness(
        tmp_path / "spool",
        run_token=TOKEN,
        max_message_bytes=MiB,
        max_open_transfer_bytes=4 * MiB,
        transfer_evict_after_s=1.5,
    )
    context = zmq.Context()
    try:
        hog_header, hog_payload = _weight_update(7, num_floats=MiB - 64)  # all but 256 bytes of the 4 MiB
        hog_header.digest = payload_digest(hog_payload)
        hog_header.payload_bytes = len(hog_payload)
        hog = _raw_dealer(context, broker.weight_endpoint)
        chunks = _first_chunks(hog_header, hog_payload, chunk_bytes=16, transfer_id="hog", sender="hog")
        hog.send_multipart(next(chunks))
        assert _wait_for(lambda: broker.service.weight_plane.status().num_open_transfers == 1)
        header, payload = _weight_update(1, num_floats=(3 * MiB) // 4)
        with pytest.raises(WeightUpdateRefused) as busy:
            broker.publish(header, payload, timeout_s=10)
        assert busy.value.code == common_pb2.ERROR_CODE_BACKPRESSURE
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # 16 bytes every 0.2 s: never stalled, far behind pace
            hog.send_multipart(next(chunks))
            time.sleep(0.2)
        hog.send_multipart(next(chunks))
        assert broker.publish(header, payload, timeout_s=10).applied
    finally:
        context.destroy(linger=0)
        broker.stop()


@pytest.mark.slow
def test_large_unauthenticated_messages_leave_no_resident_memory_behind(tmp_path):
    """Messages of 4 x 16 MiB (and smaller) with a wrong token are refused after libzmq read them whole; the buffers
    go back to the OS (``broker.memory``): a broker at its defaults does not keep what such bursts took."""
    broker = BrokerProcess(tmp_path, tmp_path / "spool", "--run-token", TOKEN, "--prometheus.enabled", "false")
    context = zmq.Context()
    try:
        before_mib = broker.rss_bytes() / MiB
        for frame_mib in (16, 12, 8, 6, 4, 3, 2):  # glibc's default threshold would follow the largest freed block
            message = framing.encode(
                data_pb2.HELLO, data_pb2.Hello(), [b"x" * (frame_mib * MiB)] * 4, auth_token="wrong"
            )
            dealer = _raw_dealer(context, f"tcp://127.0.0.1:{broker.ports['rollout_port']}")
            for _ in range(4):
                dealer.send_multipart(message)
            for _ in range(4):
                assert dealer.poll(10_000), "every refused message is answered"
                reply = framing.decode(dealer.recv_multipart())
                assert reply.header.error.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
            dealer.close(linger=0)
        time.sleep(1.0)
        grown_mib = broker.rss_bytes() / MiB - before_mib
        assert grown_mib < 32, f"broker RSS grew by {grown_mib:.0f} MiB after the refused messages"
    finally:
        context.destroy(linger=0)
        assert broker.stop() == 0


@pytest.mark.slow
def test_a_peer_without_the_run_token_makes_the_broker_hold_nothing(tmp_path):
    """Peers with a wrong token or none are refused at the handshake, before libzmq reads a byte of what they send:
    4 x 16 MiB messages from each, on both planes, leave the broker's RSS where it was and get no answer."""
    broker = BrokerProcess(tmp_path, tmp_path / "spool", "--run-token", TOKEN, "--prometheus.enabled", "false")
    context = zmq.Context()
    try:
        before_mib = broker.rss_bytes() / MiB
        message = framing.encode(data_pb2.HELLO, data_pb2.Hello(), [b"x" * (16 * MiB)] * 4, auth_token=TOKEN)
        dealers = [
            _raw_dealer(context, f"tcp://127.0.0.1:{broker.ports[plane]}", token)
            for plane in ("rollout_port", "weight_port")
            for token in ("wrong", None)
        ]
        for dealer in dealers:
            for _ in range(4):
                try:
                    dealer.send_multipart(message, zmq.NOBLOCK)
                except zmq.Again:  # the refused connection's pipe is gone: nothing more can even be queued
                    break
        peak_mib = before_mib
        for dealer in dealers:
            assert not dealer.poll(1000), "a peer without the token got an answer"
            peak_mib = max(peak_mib, broker.rss_bytes() / MiB)
        assert peak_mib - before_mib < 8, f"broker RSS grew by {peak_mib - before_mib:.0f} MiB"
        with RolloutProducer(f"tcp://127.0.0.1:{broker.ports['rollout_port']}", TOKEN, "member") as producer:
            header, payload = pack_batch(1, 0, 0, 1, {"input_ids": np.zeros(8, dtype=np.int64)})
            assert producer.send_batch(header, payload, timeout_s=10).durable
    finally:
        context.destroy(linger=0)
        assert broker.stop() == 0


def test_the_weight_gate_checks_curve_keys(tmp_path):
    """With CURVE on, the weight socket's connection gate is also its key check: a known client publishes and
    subscribes, one with an unknown key is refused at the handshake and stops at once, saying which key to add."""
    import zmq.auth

    from primerl.runtime.wire_security import CurveClient

    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    zmq.auth.create_certificates(keys, "broker")
    zmq.auth.create_certificates(keys, "client")
    zmq.auth.create_certificates(keys, "stranger")
    (authorized / "client.key").write_bytes((keys / "client.key").read_bytes())
    broker = BrokerHarness(
        tmp_path / "spool",
        run_token=TOKEN,
        curve_secret_key_path=keys / "broker.key_secret",
        curve_authorized_keys_dir=authorized,
    )
    good = CurveClient.load(keys / "client.key_secret", keys / "broker.key")
    stranger = CurveClient.load(keys / "stranger.key_secret", keys / "broker.key")
    try:
        header, payload = _weight_update(1)
        with WeightPublisher(broker.weight_endpoint, TOKEN, "trainer", broker.service.chunk_bytes, curve=good) as pub:
            assert pub.publish(header, payload, timeout_s=10).applied
        with WeightSubscriber(broker.weight_endpoint, TOKEN, "intruder", curve=stranger) as subscriber:
            subscriber.hello()
            with pytest.raises(WeightPlaneError, match="curve_authorized_keys_dir") as refused:
                subscriber.receive(timeout_s=10)
            assert refused.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
            assert subscriber.broker_latest is None and subscriber.num_handshake_refusals == 0
        with WeightPublisher(
            broker.weight_endpoint, TOKEN, "intruder", broker.service.chunk_bytes, curve=stranger
        ) as publisher:
            with pytest.raises(WeightUpdateRefused, match="curve_authorized_keys_dir"):
                publisher.publish(header, payload, timeout_s=10)
        with WeightSubscriber(broker.weight_endpoint, TOKEN, "inference-0", curve=good) as subscriber:
            subscriber.hello()
            update = subscriber.receive(timeout_s=10)
            assert update is not None and update[0].policy_version == 1
    finally:
        broker.stop()
