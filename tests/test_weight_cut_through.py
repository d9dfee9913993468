"""Cut-through forwarding on the weight plane over real ZMQ on loopback: a chunk leaves the broker for the workers as
soon as it arrived, the last one only once the whole update is stored, and a refused or abandoned update never
reaches a worker whole."""

from __future__ import annotations

import time

import pytest
from support.probes import wait_until
from support.weight_plane import CHUNK_BYTES, RECEIVE_S, TOKEN, make_update

from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_store import WeightStore
from primerl.proto import chunked_transfer, framing
from primerl.proto.digests import new_hasher, payload_digest
from primerl.proto.v1 import common_pb2, data_pb2

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA


def chunks_of(header, data, transfer_id="t1", *, streamed=False):
    """The chunk messages a publisher sends for ``data``; ``streamed``: as a streaming publisher does (the header
    without a digest, which follows in the last chunk)."""
    header.digest = "" if streamed else header.digest or payload_digest(data)
    header.payload_bytes = len(data)
    return list(
        chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE,
            header,
            data,
            chunk_bytes=CHUNK_BYTES,
            transfer_id=transfer_id,
            auth_token=TOKEN,
            sender="trainer",
            checksum_kind=framing.XXH3_64,
            ready=(lambda end: None) if streamed else None,
            digest=new_hasher() if streamed else None,
        )
    )


def raw_worker(h, worker_id="infer-0"):
    """A DEALER that said HELLO as an inference worker (its answer read), once the plane lists it."""
    socket = h.dealer()
    socket.send_multipart(
        framing.encode(
            data_pb2.HELLO, data_pb2.Hello(worker_id=worker_id, role=common_pb2.ROLE_INFERENCE), auth_token=TOKEN
        )
    )
    wait_until(lambda: worker_id in h.plane.worker_versions())
    return socket


def chunks_received(socket, timeout_s=0.5):
    """The WEIGHT_UPDATE chunks that arrive within ``timeout_s`` of quiet (HELLO answers skipped)."""
    got = []
    while socket.poll(int(timeout_s * 1000)):
        message = framing.decode(socket.recv_multipart(), auth_token=TOKEN)
        if message.type == data_pb2.WEIGHT_UPDATE:
            got.append(message)
    return got


def publisher_ack(socket, timeout_s=RECEIVE_S):
    assert socket.poll(int(timeout_s * 1000)), "no answer from the broker"
    message = framing.decode(socket.recv_multipart(), auth_token=TOKEN)
    assert message.type == data_pb2.WEIGHT_ACK, message.type_name
    return message.header


def test_chunks_reach_a_worker_before_the_publisher_sent_the_last_one(make_weight_plane):
    h = make_weight_plane()
    worker = raw_worker(h)
    header, data = make_update(1, num_bytes=4 * CHUNK_BYTES + 100)
    chunks = chunks_of(header, data)
    assert len(chunks) == 5
    publisher = h.dealer()
    for frames in chunks[:-1]:
        publisher.send_multipart(frames, copy=False)
    early = chunks_received(worker)
    assert [m.envelope.chunk.index for m in early] == [0, 1, 2, 3], "the first chunks were held back"
    assert not publisher.poll(0), "the broker acknowledged an unfinished transfer"
    publisher.send_multipart(chunks[-1], copy=False)
    ack = publisher_ack(publisher)
    assert ack.applied and ack.policy_version == 1
    late = chunks_received(worker)
    assert [m.envelope.chunk.index for m in late] == [4]
    forwarded = early + late
    assert b"".join(bytes(m.payload[0]) for m in forwarded) == data
    assert {m.envelope.chunk.transfer_id for m in forwarded} == {forwarded[0].envelope.chunk.transfer_id}
    assert all(m.envelope.checksum_kind == framing.XXH3_64 for m in forwarded)
    assert forwarded[0].header.digest == payload_digest(data)


def test_a_refused_update_never_reaches_a_worker_whole(make_weight_plane):
    h = make_weight_plane()
    worker = raw_worker(h)
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 7)
    header.digest = payload_digest(data + b"x")  # the publisher hashed other bytes
    publisher = h.dealer()
    for frames in chunks_of(header, data):
        publisher.send_multipart(frames, copy=False)
    ack = publisher_ack(publisher)
    assert not ack.applied and ack.error.code == common_pb2.ERROR_CODE_BAD_DIGEST
    partial = chunks_received(worker)
    assert [m.envelope.chunk.index for m in partial] == list(range(len(partial)))
    assert len(partial) < 4, "the last chunk of a refused update went out"
    assert h.store.latest_version is None
    # The next, good, update arrives whole, as a new transfer.
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 7)
    for frames in chunks_of(header, data, transfer_id="t2"):
        publisher.send_multipart(frames, copy=False)
    assert publisher_ack(publisher).applied
    whole = chunks_received(worker)
    assert [m.envelope.chunk.index for m in whole] == [0, 1, 2, 3]
    assert not partial or whole[0].envelope.chunk.transfer_id != partial[0].envelope.chunk.transfer_id
    assert b"".join(bytes(m.payload[0]) for m in whole) == data


def test_an_abandoned_transfer_expires_and_the_next_update_arrives_whole(make_weight_plane):
    h = make_weight_plane(transfer_stall_timeout_s=0.3)
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    wait_until(lambda: "infer-0" in h.plane.worker_versions())
    header, data = make_update(1, num_bytes=4 * CHUNK_BYTES)
    publisher = h.dealer()
    for frames in chunks_of(header, data)[:2]:  # the trainer dies after two chunks
        publisher.send_multipart(frames, copy=False)
    assert subscriber.receive(1.0) is None  # two chunks of four: nothing whole
    time.sleep(0.6)  # past the stall timeout: the broker drops the transfer
    header, data = make_update(2, num_bytes=4 * CHUNK_BYTES)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and got[0].policy_version == 2 and bytes(got[1]) == data


def test_several_workers_each_get_every_chunk_once(make_weight_plane):
    h = make_weight_plane()
    workers = [raw_worker(h, f"infer-{i}") for i in range(3)]
    header, data = make_update(1, num_bytes=6 * CHUNK_BYTES + 1)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    for worker in workers:
        got = chunks_received(worker)
        assert [m.envelope.chunk.index for m in got] == list(range(7))
        assert b"".join(bytes(m.payload[0]) for m in got) == data
    assert h.plane.status().bytes_out_total == 3 * len(data)


# -- the fan-out core: who starts receiving an update before it is stored ---------------------------------------


def incoming(version, kind=FULL, base=0, lineage=0):
    header, data = make_update(version, kind=kind, base=base, lineage=lineage)
    header.digest = payload_digest(data)
    return StoredUpdate.of(header, data), data


@pytest.fixture
def fanout():
    return WeightFanout(WeightStore(), ack_timeout_s=30.0)


def test_begin_starts_idle_members_for_whom_the_update_is_next(fanout):
    first, _ = incoming(1)
    fanout.hello("fresh", None, 0)
    assert fanout.begin(first) == 1
    assert fanout.next_step("fresh") == (first, 0, None)
    fanout.chunk_sent("fresh", first, last=True)
    fanout.put_update(first)
    assert fanout.ack("fresh", 1, 0, applied=True)
    fanout.hello("ahead", 5, 0)  # declares a newer version than the update (the broker restarted)
    delta, _ = incoming(2, kind=DELTA, base=1)
    off_chain, _ = incoming(2, kind=DELTA, base=0)
    assert fanout.begin(off_chain) == 0  # nobody holds v0
    assert fanout.begin(delta) == 1  # "fresh" holds v1; "ahead" does not take a delta on v1
    assert fanout.next_step("fresh") == (delta, 0, None)
    assert fanout.next_step("ahead") is None


def test_abort_stops_members_and_a_refused_put_aborts(fanout):
    update, _ = incoming(1)
    fanout.hello("w", None, 0)
    fanout.begin(update)
    fanout.abort(update)
    assert fanout.next_step("w") is None
    bad, _ = incoming(2)
    bad.header.digest = payload_digest(b"other bytes")
    fanout.begin(bad)
    with pytest.raises(Exception, match="digest"):
        fanout.put_update(bad)
    assert fanout.next_step("w") is None and fanout.store.latest_version is None


def test_a_member_busy_with_another_update_gets_the_new_one_once_stored(fanout):
    first, _ = incoming(1)
    fanout.put_update(first)
    fanout.hello("w", None, 0)
    assert fanout.next_step("w") == (first, 0, None)  # sending v1 from the store
    second, _ = incoming(2)
    assert fanout.begin(second) == 0
    fanout.chunk_sent("w", first, last=True)
    fanout.put_update(second)
    assert fanout.next_step("w") == (second, 0, None)


def test_a_written_update_frees_its_frames_and_is_served_from_its_durable_file(make_weight_plane, tmp_path):
    h = make_weight_plane(durable_dir=tmp_path / "weights")
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    wait_until(lambda: "infer-0" in h.plane.worker_versions())
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 5)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and bytes(got[1]) == data
    subscriber.ack(1, apply_ms=1)
    wait_until(lambda: h.store.latest().transit.on_disk)
    stored = h.store.latest()
    assert len(stored.segments) == 1 and stored.transit.forward is None
    late = h.subscriber("infer-1")  # joins later: gets the snapshot, read from the file
    late.hello()
    got = late.receive(RECEIVE_S)
    assert got is not None and got[0].policy_version == 1 and bytes(got[1]) == data


def test_the_plane_reports_what_it_adds_to_a_transfer(make_weight_plane):
    h = make_weight_plane()
    worker = raw_worker(h)
    header, data = make_update(3, num_bytes=4 * CHUNK_BYTES)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    assert b"".join(bytes(m.payload[0]) for m in chunks_received(worker)) == data
    status = h.plane.status()
    assert status.forward_lag_version == 3 and 0 <= status.forward_lag_s < RECEIVE_S
