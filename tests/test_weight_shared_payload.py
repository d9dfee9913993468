"""The inference side of a weight update without copies: the shared payload file (`SharedPayload`, `map_shared`,
its control words), the subscriber writing chunks straight into it (its digest computed on the way, a transfer
whose chunks stop dropped), and the worker extension reading tensors in place."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
import torch
import zmq
from support.probes import wait_until
from support.weight_plane import CHUNK_BYTES, LIMITS, RECEIVE_S, TOKEN, FakeBroker, make_update

from primerl.inference.shared_payload import (
    PayloadControl,
    SharedPayload,
    map_control,
    map_shared,
    remove_stale_files,
)
from primerl.inference.weight_tensors import torch_views
from primerl.proto import chunked_transfer, framing
from primerl.proto import tensor_frames as tf
from primerl.proto.digests import payload_digest
from primerl.proto.v1 import data_pb2


def test_shared_payload_grows_is_reused_and_is_read_in_place(tmp_path):
    with SharedPayload(tmp_path) as staging:
        assert os.stat(staging.path).st_mode & 0o777 == 0o600
        first = staging.buffer(10)
        first[:] = b"0123456789"
        assert staging.holds(first) and not staging.holds(memoryview(b"0123456789"))
        assert bytes(map_shared(staging.path, 10)) == b"0123456789"
        first.release()
        staging.write(b"x" * 100)  # grows
        assert staging.size_bytes == 100 and bytes(map_shared(staging.path, 100)) == b"x" * 100
        staging.write(b"abc")  # fits: same file, same mapping
        assert staging.size_bytes == 100 and bytes(map_shared(staging.path, 3)) == b"abc"
        with pytest.raises(ValueError, match="were announced"):
            map_shared(staging.path, 101)
        path = staging.path
    assert not os.path.exists(path)


def test_control_words_say_how_much_of_the_payload_is_final(tmp_path):
    """The daemon publishes each transfer's progress in the file; the worker reads it there (`map_control`) and
    reports its staged load and whether its host copy views the payload."""
    with SharedPayload(tmp_path) as staging:
        control = map_control(staging.path)
        view = staging.buffer(1000)
        staging.begin(7)
        assert (control.read(PayloadControl.SEQ), control.read(PayloadControl.BYTES_READY)) == (7, 0)
        view[:600] = b"a" * 600
        staging.publish(600)
        assert control.read(PayloadControl.BYTES_READY) == 600
        assert control.read(PayloadControl.WRITER_STATE) == PayloadControl.RECEIVING
        staging.finish(complete=False)
        assert control.read(PayloadControl.WRITER_STATE) == PayloadControl.ABORTED
        staging.begin(8)
        assert control.read(PayloadControl.BYTES_READY) == 0 and staging.control.stage(8) is None
        control.write(PayloadControl.STAGE_STATE, PayloadControl.LOADING)
        control.write(PayloadControl.STAGE_SEQ, 8)
        assert staging.control.stage(8) == PayloadControl.LOADING and staging.control.stage(7) is None
        control.write(PayloadControl.HOST_VIEWS, 1)
        assert staging.control.read(PayloadControl.HOST_VIEWS) == 1
        staging.buffer(5000)  # grown: the control words stay where they are
        assert control.read(PayloadControl.SEQ) == 8 and bytes(map_shared(staging.path, 600)) == b"a" * 600
    with SharedPayload(tmp_path) as mine:  # a file of a live process (this one) stays; one of a dead process goes
        dead = tmp_path / "primerl-weights-999999999-abc"
        dead.write_bytes(b"x")
        assert remove_stale_files(tmp_path) == [dead] and os.path.exists(mine.path)
    with pytest.raises(ValueError, match="not a shared payload file"):
        (tmp_path / "other").write_bytes(b"\0" * 8192)
        map_control(str(tmp_path / "other"))


def test_torch_views_read_the_frame_without_copying():
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "empty": torch.zeros(0),
    }
    payload, _ = tf.encode_tensors(tensors)
    buffer = bytearray(payload)
    views = torch_views(memoryview(buffer))
    assert set(views) == set(tensors)
    for name, tensor in tensors.items():
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor)
    entry = tf.parse_header(buffer)["a"]
    buffer[entry.start : entry.start + 4] = np.float32(42.0).tobytes()  # a view: sees the change
    assert views["a"][0, 0].item() == 42.0
    with pytest.raises(tf.TensorFrameError):
        torch_views(memoryview(bytearray(b"\x00" * 4)))


@pytest.fixture
def harness(make_weight_plane):
    """`harness(**WeightPlane keyword arguments)`: a weight plane on loopback (conftest's `make_weight_plane`)."""
    return make_weight_plane


def test_subscriber_assembles_chunks_in_the_given_buffer(harness, tmp_path):
    h = harness()
    staging = SharedPayload(tmp_path)
    buffers: list[memoryview] = []

    def payload_buffer(num_bytes: int) -> memoryview:
        buffers.append(staging.buffer(num_bytes))
        return buffers[-1]

    subscriber = h.subscriber("infer-0", payload_buffer=payload_buffer)
    subscriber.hello()
    for version in (1, 2):
        header, data = make_update(version, num_bytes=5 * CHUNK_BYTES + 123)
        h.publisher().publish(header, data, timeout_s=RECEIVE_S)
        got = subscriber.receive(RECEIVE_S)
        assert got is not None
        received_header, payload = got
        assert received_header.policy_version == version and staging.holds(payload)
        assert bytes(payload) == data and bytes(map_shared(staging.path, len(data))) == data
        subscriber.ack(version, apply_ms=1)
    assert len(buffers) == 2  # one buffer per update, both in the same file
    # An update small enough for one message needs no assembly: it is the received frame itself.
    header, data = make_update(3, num_bytes=100)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and bytes(got[1]) == data and len(buffers) == 2
    staging.close()


class RecordingSink:
    """A `PayloadSink` over a `SharedPayload` that records what the subscriber told it."""

    def __init__(self, staging: SharedPayload):
        self.staging = staging
        self.events: list[tuple] = []

    def begin_payload(self, header: data_pb2.WeightUpdateHeader, num_bytes: int) -> memoryview:
        self.events.append(("begin", header.policy_version, num_bytes))
        return self.staging.buffer(num_bytes)

    def payload_progress(self, num_bytes: int) -> None:
        self.events.append(("progress", num_bytes))

    def end_payload(self, complete: bool) -> None:
        self.events.append(("end", complete))


def test_the_sink_hears_of_each_chunk_and_the_digest_is_computed_on_the_way(harness, tmp_path):
    h = harness()
    sink = RecordingSink(SharedPayload(tmp_path))
    subscriber = h.subscriber("infer-0", payload_sink=sink)
    subscriber.hello()
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 5)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and bytes(got[1]) == data and sink.staging.holds(got[1])
    assert subscriber.received_digest == got[0].digest == payload_digest(data)
    progress = [e[1] for e in sink.events if e[0] == "progress"]
    assert sink.events[0] == ("begin", 1, len(data)) and sink.events[-1] == ("end", True)
    assert progress == sorted(progress) and progress[-1] == len(data) and len(progress) >= 4
    sink.staging.close()


def test_a_transfer_whose_chunks_stop_is_dropped_after_a_bounded_stall(harness, tmp_path):
    """The trainer (or the broker) dies midway: the chunks already forwarded are never returned, the sink is told
    the transfer ended incomplete once no chunk came for ``stall_timeout_s``, and the next update arrives whole (once
    the broker, later, dropped the stalled transfer too)."""
    h = harness(transfer_stall_timeout_s=1.5)
    sink = RecordingSink(SharedPayload(tmp_path))
    subscriber = h.subscriber("infer-0", payload_sink=sink, stall_timeout_s=0.5)
    subscriber.hello()
    wait_until(lambda: "infer-0" in h.plane.worker_versions())
    header, data = make_update(1, num_bytes=4 * CHUNK_BYTES)
    header.digest, header.payload_bytes = payload_digest(data), len(data)
    publisher = h.dealer()
    for frames in list(
        chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE,
            header,
            data,
            chunk_bytes=CHUNK_BYTES,
            transfer_id="t1",
            auth_token=TOKEN,
            sender="trainer",
            checksum_kind=framing.XXH3_64,
        )
    )[:2]:
        publisher.send_multipart(frames, copy=False)
    start_s = time.monotonic()
    assert subscriber.receive(0.3) is None
    assert sink.events[0][:2] == ("begin", 1) and ("end", False) not in sink.events
    while time.monotonic() - start_s < 3.0 and ("end", False) not in sink.events:
        assert subscriber.receive(0.2) is None
    assert sink.events[-1] == ("end", False), sink.events  # dropped, with no further message from the broker
    assert time.monotonic() - start_s < 2.0
    header, data = make_update(2, num_bytes=4 * CHUNK_BYTES)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and got[0].policy_version == 2 and bytes(got[1]) == data
    sink.staging.close()


@pytest.mark.parametrize("digest_kind", ["xxh3-128", "sha256"])
def test_the_received_digest_is_of_the_bytes_that_arrived(tmp_path, digest_kind):
    """A peer that forwards chunks before checking the whole update (cut-through) may hand on bytes that do not
    match the header's digest: the subscriber returns the update with the digest of what arrived (in the header's
    algorithm), and the worker's updater refuses it (BAD_DIGEST, ``test_policy_updater``)."""
    from primerl.client.weights import WeightSubscriber

    context = zmq.Context()
    fake = FakeBroker(context, "infer-0")
    router, port = fake.router, fake.port
    sink = RecordingSink(SharedPayload(tmp_path))
    subscriber = WeightSubscriber(
        f"tcp://127.0.0.1:{port}", TOKEN, "infer-0", context=context, limits=LIMITS, payload_sink=sink
    )
    try:
        subscriber.hello()
        assert router.poll(5000)
        identity = router.recv_multipart()[0]
        header, data = make_update(1, num_bytes=3 * CHUNK_BYTES)
        sent = bytearray(data)
        sent[-1] ^= 0xFF  # corrupted after the digest was computed
        header.digest = payload_digest(data) if digest_kind == "xxh3-128" else hashlib.sha256(data).hexdigest()
        header.payload_bytes = len(data)
        for frames in chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE,
            header,
            bytes(sent),
            chunk_bytes=CHUNK_BYTES,
            transfer_id="t1",
            auth_token=TOKEN,
            sender="broker",
            checksum_kind=framing.XXH3_64,
        ):
            router.send_multipart([identity, *frames])
        got = subscriber.receive(RECEIVE_S)
        assert got is not None and bytes(got[1]) == bytes(sent)
        expected = payload_digest(sent) if digest_kind == "xxh3-128" else hashlib.sha256(sent).hexdigest()
        assert subscriber.received_digest == expected != header.digest
    finally:
        subscriber.close()
        fake.close()
        context.term()
        sink.staging.close()
