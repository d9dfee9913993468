"""The rollout plane over real ZeroMQ on loopback: produce, consume, backpressure, refusals, recovery."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primerl.broker.rollout_plane import RolloutPlane
from primerl.broker.rollout_queue import RolloutQueue
from primerl.broker.spool import RolloutSpool
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, RolloutRefused, RolloutTimeout, pack_batch
from primerl.proto import chunked_transfer, framing
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.wire_security import apply_run_token

TOKEN = "run-secret"


def tensors_for(step: int, rank: int, index: int, n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step * 1000 + rank * 100 + index)
    return {
        "input_ids": rng.integers(0, 50_000, n, dtype=np.int64),
        "loss_mask": rng.random(n) > 0.3,
        "advantages": rng.standard_normal(n).astype(np.float32),
        "inference_logprobs": -rng.random(n).astype(np.float32),
        "policy_versions": np.full(n, step, np.int64),
    }


class Harness:
    """Planes, clients and sockets made by one test; all closed at the end (only what it started)."""

    def __init__(self, tmp_path):
        self.context = zmq.Context()
        self.spool_dir = tmp_path / "spool"
        self.planes: list[RolloutPlane] = []
        self.closables: list = []
        self.errors: list[tuple[int, str, str]] = []

    def plane(
        self,
        *,
        max_batches: int = 64,
        max_bytes: int = 1 << 30,
        port: int = 0,
        token: str | None = TOKEN,
        limits: framing.Limits | None = None,
        retry_after_ms: int = 20,
    ) -> RolloutPlane:
        queue = RolloutQueue(RolloutSpool(self.spool_dir), max_batches, max_bytes, retry_after_ms=retry_after_ms)
        plane = RolloutPlane(
            queue,
            self.context,
            "127.0.0.1",
            port,
            limits or framing.Limits(max_message_bytes=8 * MiB, max_frame_bytes=4 * MiB),
            token,
            on_error=lambda *e: self.errors.append(e),
        )
        plane.start()
        self.planes.append(plane)
        return plane

    def endpoint(self, plane: RolloutPlane) -> str:
        return f"tcp://127.0.0.1:{plane.port}"

    def producer(self, plane, token: str | None = TOKEN, **kwargs) -> RolloutProducer:
        client = RolloutProducer(self.endpoint(plane), token, "orchestrator", context=self.context, **kwargs)
        self.closables.append(client)
        return client

    def consumer(self, plane, rank: int = 0, token: str | None = TOKEN, **kwargs) -> RolloutConsumer:
        kwargs.setdefault("credits", 2)
        client = RolloutConsumer(self.endpoint(plane), token, f"trainer-{rank}", rank, context=self.context, **kwargs)
        self.closables.append(client)
        return client

    def dealer(self, plane) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        if plane.auth_token:
            apply_run_token(socket, plane.auth_token, "raw")
        socket.connect(self.endpoint(plane))
        self.closables.append(socket)
        return socket

    def close(self):
        for plane in self.planes:
            assert plane.stop(5.0)
            plane.queue.close()
        for client in self.closables:
            client.close()
        self.context.term()


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path)
    yield h
    h.close()


def recv(socket: zmq.Socket, timeout_s: float = 5.0) -> framing.Message:
    assert socket.poll(int(timeout_s * 1000)), "no reply from the rollout plane"
    return framing.decode(socket.recv_multipart())


def produce(producer: RolloutProducer, steps, ranks, num_micro_batches: int) -> None:
    for step in steps:
        for rank in ranks:
            for index in range(num_micro_batches):
                header, payload = pack_batch(step, rank, index, num_micro_batches, tensors_for(step, rank, index))
                ack = producer.send_batch(header, payload, timeout_s=10)
                assert ack.durable and ack.batch_id == f"{step}:{rank}:{index}"


def check_step(batches, step: int, rank: int, num_micro_batches: int) -> None:
    assert [h.micro_batch_index for h, _ in batches] == list(range(num_micro_batches))
    for header, tensors in batches:
        assert (header.step, header.rank) == (step, rank)
        expected = tensors_for(step, rank, header.micro_batch_index)
        assert tensors.keys() == expected.keys()
        for name, array in expected.items():
            assert tensors[name].dtype == array.dtype and tensors[name].tobytes() == array.tobytes()


# ---------------------------------------------------------------------------------------------------


def test_produce_and_consume_two_ranks_two_steps(harness):
    plane = harness.plane()
    produce(harness.producer(plane), steps=(1, 2), ranks=(0, 1), num_micro_batches=3)
    consumers = [harness.consumer(plane, rank) for rank in (0, 1)]
    for step in (1, 2):
        for rank, consumer in enumerate(consumers):
            check_step(consumer.fetch_step(step, timeout_s=10), step, rank, 3)
    status = plane.status()
    assert status.queue.num_batches == 12 and status.queue.num_accepted == 12
    assert status.batches_in_per_s > 0 and status.bytes_out_per_s > 0 and status.running
    assert plane.release_through(2) == 12
    assert plane.status().queue.num_batches == 0
    assert not list(harness.spool_dir.glob("*.rbatch"))
    assert harness.errors == []


def test_consumer_waits_for_batches_that_arrive_later(harness):
    plane = harness.plane()
    consumer = harness.consumer(plane, rank=1, credits=1)
    producer = harness.producer(plane)
    thread = threading.Thread(target=lambda: (time.sleep(0.2), produce(producer, (5,), (0, 1), 4)))
    thread.start()
    try:
        check_step(consumer.fetch_step(5, timeout_s=10), 5, 1, 4)
    finally:
        thread.join(10)


def test_resend_is_acked_without_a_second_copy(harness):
    plane = harness.plane()
    producer = harness.producer(plane)
    header, payload = pack_batch(1, 0, 0, 1, tensors_for(1, 0, 0))
    assert producer.send_batch(header, payload, 5).durable
    assert producer.send_batch(header, payload, 5).durable
    status = plane.status().queue
    assert (status.num_batches, status.num_accepted, status.num_duplicates) == (1, 1, 1)


def test_backpressure_under_a_flooding_producer(harness):
    bound = 4
    plane = harness.plane(max_batches=bound, retry_after_ms=30)
    flood = harness.dealer(plane)
    num_sent = 20
    for index in range(num_sent):  # no waiting for acks: a flood
        header, payload = pack_batch(1, 0, index, num_sent, tensors_for(1, 0, index))
        flood.send_multipart(framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN))
    acks = [recv(flood).header for _ in range(num_sent)]
    durable = [a for a in acks if a.durable]
    refused = [a for a in acks if not a.durable]
    assert len(durable) == bound and len(refused) == num_sent - bound
    assert all(a.error.code == common_pb2.ERROR_CODE_BACKPRESSURE and a.error.retry_after_ms == 30 for a in refused)
    assert plane.status().queue.num_batches == bound
    assert len(list(harness.spool_dir.glob("*.rbatch"))) == bound

    # A well-behaved producer waits; the queue never exceeds the bound; a commit lets it through.
    producer = harness.producer(plane)
    header, payload = pack_batch(2, 0, 0, 1, tensors_for(2, 0, 0))
    with pytest.raises(RolloutTimeout) as timed_out:
        producer.send_batch(header, payload, timeout_s=0.3)
    assert timed_out.value.code == common_pb2.ERROR_CODE_BACKPRESSURE and producer.num_backpressure_waits >= 2
    sizes = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            sizes.append(plane.status().queue.num_batches)
            time.sleep(0.005)

    def commit_later():
        time.sleep(0.2)
        plane.release_through(1)

    threads = [threading.Thread(target=watch), threading.Thread(target=commit_later)]
    for thread in threads:
        thread.start()
    try:
        ack = producer.send_batch(header, payload, timeout_s=10)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
    assert ack.durable and max(sizes) <= bound
    assert plane.status().queue.num_batches == 1 and plane.status().num_backpressure_replies >= num_sent - bound
    assert harness.errors == []  # backpressure is flow control, not an error


def test_backpressure_by_bytes(harness):
    header, payload = pack_batch(1, 0, 0, 3, tensors_for(1, 0, 0, n=4096))
    one_batch = 24 + len(header.SerializeToString()) + len(payload)
    plane = harness.plane(max_bytes=2 * one_batch + 100)
    producer = harness.producer(plane)
    for index in range(2):
        h, p = pack_batch(1, 0, index, 3, tensors_for(1, 0, index, n=4096))
        assert producer.send_batch(h, p, 5).durable
    h, p = pack_batch(1, 0, 2, 3, tensors_for(1, 0, 2, n=4096))
    with pytest.raises(RolloutTimeout):
        producer.send_batch(h, p, timeout_s=0.2)
    assert plane.status().queue.num_bytes <= 2 * one_batch + 100


def bad_messages():
    header, payload = pack_batch(1, 0, 0, 1, tensors_for(1, 0, 0))
    good = framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN)
    as_bytes = [bytes(memoryview(f)) for f in good]
    bad_checksum = list(as_bytes)
    bad_checksum[3] = as_bytes[3][:-1] + bytes([as_bytes[3][-1] ^ 1])
    wrong_tensors = pack_batch(1, 0, 0, 1, {"other": np.zeros(3, np.float32)})[1]
    mismatch = framing.encode(data_pb2.ROLLOUT_BATCH, header, [wrong_tensors], auth_token=TOKEN)
    weight_ack = framing.encode(data_pb2.WEIGHT_ACK, data_pb2.WeightAck(policy_version=1), auth_token=TOKEN)
    ack = framing.encode(data_pb2.ROLLOUT_ACK, data_pb2.RolloutAck(batch_id="x"), auth_token=TOKEN)
    chunked = next(
        chunked_transfer.encode_chunked(data_pb2.ROLLOUT_BATCH, header, payload, chunk_bytes=64, auth_token=TOKEN)
    )
    big = framing.encode(data_pb2.ROLLOUT_BATCH, header, [b"\0" * (5 * MiB)], auth_token=TOKEN)
    bad_index = data_pb2.RolloutBatchHeader()
    bad_index.CopyFrom(header)
    bad_index.micro_batch_index = 7
    return {
        "one frame": ([b"junk"], common_pb2.ERROR_CODE_TRUNCATED),
        "wrong protocol": ([b"HTTP/", b"\x01", b""], common_pb2.ERROR_CODE_UNKNOWN_PROTOCOL),
        "future version": ([framing.PROTOCOL_ID + b"\x09", b"\x01", b""], common_pb2.ERROR_CODE_UNSUPPORTED_VERSION),
        "unknown type": ([framing.PROTOCOL_FRAME, b"\x63", b""], common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE),
        "garbage envelope": (
            [framing.PROTOCOL_FRAME, b"\x01", b"\xff\xff\xff"],
            common_pb2.ERROR_CODE_MALFORMED_HEADER,
        ),
        "bad checksum": (bad_checksum, common_pb2.ERROR_CODE_BAD_CHECKSUM),
        "tensor mismatch": (mismatch, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
        "weight message on the rollout socket": (weight_ack, common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE),
        "ack sent to the broker": (ack, common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE),
        "chunked batch": (chunked, common_pb2.ERROR_CODE_BAD_CHUNK),
        "oversized frame": (big, common_pb2.ERROR_CODE_OVERSIZED),
        "index beyond count": (
            framing.encode(data_pb2.ROLLOUT_BATCH, bad_index, [payload], auth_token=TOKEN),
            common_pb2.ERROR_CODE_MALFORMED_HEADER,
        ),
    }


def test_malformed_messages_get_error_replies_and_the_plane_keeps_serving(harness):
    plane = harness.plane()
    socket = harness.dealer(plane)
    for name, (frames, code) in bad_messages().items():
        socket.send_multipart(frames, copy=False)
        reply = recv(socket)
        if reply.type == data_pb2.ROLLOUT_ACK:  # refused by the queue: an ack that carries the error
            error = reply.header.error
        else:
            assert reply.type == data_pb2.ERROR, name
            error = reply.header.error
        assert error.code == code, (name, error)
        assert error.message
    assert plane.running and plane.status().num_refused == len(bad_messages())
    assert len(harness.errors) == len(bad_messages())
    produce(harness.producer(plane), (1,), (0,), 2)
    check_step(harness.consumer(plane).fetch_step(1, timeout_s=10), 1, 0, 2)


def test_wrong_or_missing_token_is_refused(harness):
    plane = harness.plane()
    header, payload = pack_batch(1, 0, 0, 1, tensors_for(1, 0, 0))
    for token in ("wrong", None):
        with pytest.raises(RolloutRefused) as refused:
            harness.producer(plane, token=token).send_batch(header, payload, timeout_s=5)
        assert refused.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
        with pytest.raises(RolloutRefused) as refused:
            harness.consumer(plane, token=token).hello(timeout_s=5)
        assert refused.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    # The refusal does not hand the run token to the peer that lacked it.
    socket = harness.dealer(plane)
    socket.send_multipart(framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload], auth_token="guess"))
    reply = recv(socket)
    assert reply.header.error.code == common_pb2.ERROR_CODE_UNAUTHENTICATED and reply.envelope.auth_token == ""
    assert plane.status().queue.num_batches == 0


def test_request_for_a_committed_step_is_not_found(harness):
    plane = harness.plane()
    produce(harness.producer(plane), (1, 2), (0,), 1)
    plane.release_through(1)
    consumer = harness.consumer(plane)
    with pytest.raises(RolloutRefused) as refused:
        consumer.fetch_step(1, timeout_s=5)
    assert refused.value.code == common_pb2.ERROR_CODE_NOT_FOUND
    check_step(consumer.fetch_step(2, timeout_s=5), 2, 0, 1)


def test_redelivery_after_a_trainer_restart(harness):
    plane = harness.plane()
    produce(harness.producer(plane), (1, 2, 3), (0,), 2)
    first = harness.consumer(plane)
    for step in (1, 2, 3):
        first.fetch_step(step, timeout_s=5)
    plane.release_through(1)  # checkpoint after step 1, then the trainer dies
    first.close()
    restarted = harness.consumer(plane)
    for step in (2, 3):
        check_step(restarted.fetch_step(step, timeout_s=5), step, 0, 2)


def test_spool_recovery_after_the_plane_stops(harness):
    plane = harness.plane()
    port = plane.port
    produce(harness.producer(plane), (1, 2, 3), (0, 1), 2)
    consumer = harness.consumer(plane, rank=0, request_interval_s=0.2)
    check_step(consumer.fetch_step(1, timeout_s=5), 1, 0, 2)  # delivered but never committed
    plane.release_through(1)
    assert plane.stop(5.0)  # the broker goes away; the spool stays as it is
    plane.queue.close()  # what the kernel does for a process that dies: the spool lock is released

    reborn = harness.plane(port=port)
    assert reborn.status().queue.num_batches == 8  # steps 2 and 3, both ranks
    # The same consumer (its socket reconnects on its own) and a fresh one both get everything uncommitted.
    for step in (2, 3):
        check_step(consumer.fetch_step(step, timeout_s=10), step, 0, 2)
        check_step(harness.consumer(reborn, rank=1).fetch_step(step, timeout_s=10), step, 1, 2)
    # A producer resending a batch it never saw acked is told it is already durable.
    header, payload = pack_batch(2, 0, 0, 2, tensors_for(2, 0, 0))
    assert harness.producer(reborn).send_batch(header, payload, 5).durable
    assert reborn.status().queue.num_batches == 8


def test_stop_is_prompt(harness):
    plane = harness.plane()
    started = time.monotonic()
    assert plane.stop(2.0)
    assert time.monotonic() - started < 1.0 and not plane.running


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=64), min_size=0, max_size=6), keep_prefix=st.integers(0, 2))
def test_fuzzed_frames_never_break_the_plane(fuzz_plane, frames, keep_prefix):
    plane, socket = fuzz_plane
    prefix = [framing.PROTOCOL_FRAME, bytes([data_pb2.ROLLOUT_BATCH])][:keep_prefix]
    message = (prefix + frames) or [b""]
    socket.send_multipart(message)
    reply = recv(socket)
    assert reply.type in (data_pb2.ERROR, data_pb2.ROLLOUT_ACK)
    assert plane.running


@pytest.fixture(scope="module")
def fuzz_plane(tmp_path_factory):
    harness = Harness(tmp_path_factory.mktemp("fuzz"))
    plane = harness.plane()
    socket = harness.dealer(plane)
    yield plane, socket
    # Still serving after the fuzz.
    produce(harness.producer(plane), (1,), (0,), 1)
    check_step(harness.consumer(plane).fetch_step(1, timeout_s=5), 1, 0, 1)
    harness.close()


# ---------------------------------------------------------------------------------------------------
# pipelined producer and group commit


def batches_of(step: int, rank: int, num: int, n: int = 64):
    return [pack_batch(step, rank, index, num, tensors_for(step, rank, index, n)) for index in range(num)]


def test_windowed_producer_gets_every_ack_in_order_and_no_ack_precedes_durability(harness):
    plane = harness.plane()
    spool = plane.queue.spool
    durable: set[str] = set()
    real_put_many = spool.put_many
    group_sizes = []

    def slow_put_many(records):
        time.sleep(0.02)  # a slow disk: acks must still wait for the write
        written = real_put_many(records)
        group_sizes.append(len(records))
        durable.update(batch_id for batch_id, *_ in records)
        return written

    spool.put_many = slow_put_many
    producer = harness.producer(plane)
    received_while_durable = []
    real_recv = producer._recv

    def checking_recv(timeout_s):
        message = real_recv(timeout_s)
        if message is not None and message.type == data_pb2.ROLLOUT_ACK:
            received_while_durable.append(message.header.batch_id in durable)
        return message

    producer._recv = checking_recv
    batches = batches_of(1, 0, 12)
    acks = producer.send_batches(batches, window=6, timeout_s=10)
    assert [a.batch_id for a in acks] == [f"1:0:{i}" for i in range(12)] and all(a.durable for a in acks)
    assert received_while_durable and all(received_while_durable)
    assert max(group_sizes) > 1, "with a window, the plane spools several batches per group commit"
    consumer = harness.consumer(plane, credits=8)
    check_step(consumer.fetch_step(1, timeout_s=10), 1, 0, 12)


def test_windowed_producer_waits_through_backpressure(harness):
    plane = harness.plane(max_batches=3, retry_after_ms=10)
    producer = harness.producer(plane)
    consumer = harness.consumer(plane, credits=8)
    result = {}

    def consume():
        result["step1"] = consumer.fetch_step(1, timeout_s=10)  # moves the frontier: step 2 may come in
        result["step2"] = consumer.fetch_step(2, timeout_s=10)

    thread = threading.Thread(target=consume)
    thread.start()
    acks = producer.send_batches(batches_of(1, 0, 4) + batches_of(2, 0, 4), window=8, timeout_s=10)
    thread.join(10)
    assert len(acks) == 8 and all(a.durable for a in acks)
    check_step(result["step1"], 1, 0, 4)
    check_step(result["step2"], 2, 0, 4)


def test_windowed_producer_refuses_clearly_and_times_out_under_a_full_queue(harness):
    plane = harness.plane(max_batches=2, retry_after_ms=10)
    producer = harness.producer(plane)
    header, payload = pack_batch(1, 0, 0, 2, tensors_for(1, 0, 0))
    bad = data_pb2.RolloutBatchHeader()
    bad.CopyFrom(header)
    bad.num_micro_batches = 3  # disagrees with the batch before it
    bad.micro_batch_index = 1
    bad.batch_id = "1:0:1"
    with pytest.raises(RolloutRefused) as refused:
        producer.send_batches([(header, payload), (bad, payload)], window=2, timeout_s=5)
    assert "1:0:1" in str(refused.value) and refused.value.code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    with pytest.raises(RolloutTimeout) as timed_out:  # step 2 and 3 are ahead of any trainer: only 2 fit
        producer.send_batches(batches_of(2, 0, 2) + batches_of(3, 0, 2), window=4, timeout_s=0.3)
    assert timed_out.value.code == common_pb2.ERROR_CODE_BACKPRESSURE
    with pytest.raises(ValueError):
        producer.send_batches([], window=0)


def test_a_batch_sent_with_an_xxh3_checksum_is_spooled_with_its_own_crc(harness):
    """The spool stores a CRC-32 with each batch: one that arrived with another checksum kind gets one computed (not
    the envelope's empty CRC field), so it survives a restart."""
    plane = harness.plane()
    port = plane.port
    header, payload = pack_batch(1, 0, 0, 1, tensors_for(1, 0, 0))
    raw = harness.dealer(plane)
    raw.send_multipart(
        framing.encode(
            data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN, sender="orch", checksum_kind=framing.XXH3_64
        )
    )
    ack = recv(raw)
    assert ack.type == data_pb2.ROLLOUT_ACK and ack.header.durable
    assert plane.stop(5.0)
    plane.queue.close()
    reborn = harness.plane(port=port)
    assert reborn.status().queue.num_batches == 1
    check_step(harness.consumer(reborn).fetch_step(1, timeout_s=10), 1, 0, 1)
