"""Streamed weight updates (``weight_broadcast.stream``): the publisher sends a payload's first chunks while it still
writes the rest, and the content digest follows in the last chunk (``Chunk.payload_digest``). Over real ZMQ on
loopback with the broker's ``WeightPlane``, real subscribers (star and relay chain), and the trainer's
``PolicyPublisher`` against an in-process broker."""

from __future__ import annotations

import threading

import pytest
import torch
from support.probes import wait_until
from support.weight_plane import CHUNK_BYTES, RECEIVE_S, TOKEN, make_update
from test_weight_cut_through import chunks_of, chunks_received, publisher_ack, raw_worker

from primerl.proto import chunked_transfer, framing
from primerl.proto.digests import new_hasher, payload_digest
from primerl.proto.v1 import common_pb2, data_pb2


def streamed_chunks(header, data, transfer_id="s1"):
    return chunks_of(header, data, transfer_id, streamed=True)


def with_trailer(frames, digest):
    envelope = data_pb2.Envelope.FromString(bytes(frames[2]))
    envelope.chunk.payload_digest = digest
    return [frames[0], frames[1], envelope.SerializeToString(), *frames[3:]]


# ------------------------------------------------------------------------------------------------ the wire


def test_the_digest_follows_in_the_last_chunk_only():
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 5)
    messages = [framing.decode(frames, auth_token=TOKEN) for frames in streamed_chunks(header, data)]
    assert [m.envelope.chunk.index for m in messages] == [0, 1, 2, 3]
    assert all(m.header.digest == "" for m in messages)
    assert [m.envelope.chunk.payload_digest for m in messages[:-1]] == ["", "", ""]
    assert messages[-1].envelope.chunk.payload_digest == payload_digest(data)
    whole = None
    assembler = chunked_transfer.ChunkAssembler()
    for message in messages:
        whole = assembler.add(message)
    assert whole is not None and bytes(whole.payload[0]) == data
    assert whole.header.digest == payload_digest(data), "the assembled header takes the digest that followed"


def test_a_streamed_payload_of_one_chunk_waits_for_its_bytes_and_carries_its_digest_in_the_header():
    header, data = make_update(1, num_bytes=CHUNK_BYTES // 2)
    asked = []
    frames = list(
        chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE,
            header,
            data,
            chunk_bytes=CHUNK_BYTES,
            ready=asked.append,
            digest=new_hasher(),
            checksum_kind=framing.XXH3_64,
        )
    )
    assert asked == [len(data)] and len(frames) == 1
    assert framing.decode(frames[0]).header.digest == payload_digest(data)


def test_the_fused_checksum_pass_gives_both_hashes_of_a_separate_pass():
    data = bytes(range(256)) * (3 * framing.FUSED_BLOCK_BYTES // 256 + 7)  # several blocks, the last short
    header = b"header"
    tee = new_hasher()
    fused = framing.compute_checksum(
        data_pb2.WEIGHT_UPDATE, header, [data[:1000], data[1000:]], framing.XXH3_64, also=tee
    )
    assert fused == framing.compute_checksum(data_pb2.WEIGHT_UPDATE, header, [data], framing.XXH3_64)
    assert tee.hexdigest() == payload_digest(data)
    crc_tee = new_hasher()
    framing.compute_checksum(data_pb2.ROLLOUT_BATCH, header, [data], framing.CRC32, also=crc_tee)
    assert crc_tee.hexdigest() == payload_digest(data)


# ------------------------------------------------------------------------------------- the broker, over ZMQ


def test_a_streamed_update_is_stored_and_forwarded_with_the_digest_that_followed(make_weight_plane):
    h = make_weight_plane()
    worker = raw_worker(h)
    header, data = make_update(1, num_bytes=4 * CHUNK_BYTES + 9)
    publisher = h.dealer()
    for frames in streamed_chunks(header, data):
        publisher.send_multipart(frames, copy=False)
    ack = publisher_ack(publisher)
    assert ack.applied, ack.error.message
    assert h.store.latest().header.digest == payload_digest(data), "the stored update carries the digest"
    forwarded = chunks_received(worker)
    assert [m.envelope.chunk.index for m in forwarded] == [0, 1, 2, 3, 4]
    assert b"".join(bytes(m.payload[0]) for m in forwarded) == data
    assert [m.envelope.chunk.payload_digest for m in forwarded] == [""] * 4 + [payload_digest(data)]


@pytest.mark.parametrize("trailer", ["wrong", "missing"])
def test_a_streamed_update_whose_digest_is_wrong_or_missing_is_refused_and_never_reaches_a_worker_whole(
    make_weight_plane, trailer
):
    h = make_weight_plane()
    worker = raw_worker(h)
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 1)
    chunks = streamed_chunks(header, data)
    chunks[-1] = with_trailer(chunks[-1], payload_digest(data + b"x") if trailer == "wrong" else "")
    publisher = h.dealer()
    for frames in chunks:
        publisher.send_multipart(frames, copy=False)
    ack = publisher_ack(publisher)
    assert not ack.applied and ack.error.code == common_pb2.ERROR_CODE_BAD_DIGEST
    assert len(chunks_received(worker)) < len(chunks), "the last chunk of a refused update went out"
    assert h.store.latest_version is None


def test_a_publisher_sends_chunks_before_the_payload_is_written_and_subscribers_get_it_whole(make_weight_plane):
    """The point of streaming: the first chunks reach the worker while the last bytes do not exist yet."""
    h = make_weight_plane()
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    wait_until(lambda: "infer-0" in h.plane.worker_versions())
    watcher = raw_worker(h, "infer-watch")
    header, data = make_update(1, num_bytes=4 * CHUNK_BYTES + 100)
    header.digest = ""
    payload = bytearray(len(data))
    written = [0]
    last_chunk_asked = threading.Event()
    release = threading.Event()

    def ready(end: int) -> None:  # the writer: bytes up to the last chunk at once, the rest when the test says so
        if end == len(data):
            last_chunk_asked.set()
            assert release.wait(RECEIVE_S)
        payload[written[0] : end] = data[written[0] : end]
        written[0] = end

    publisher = h.publisher()
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(ack=publisher.publish(header, payload, RECEIVE_S, ready=ready))
    )
    thread.start()
    assert last_chunk_asked.wait(RECEIVE_S)
    early = chunks_received(watcher)
    assert [m.envelope.chunk.index for m in early] == [0, 1, 2, 3], "chunks waited for the whole payload"
    assert payload[-100:] == bytes(100), "the last bytes were not written yet"
    release.set()
    thread.join(RECEIVE_S)
    assert result["ack"].applied
    got = subscriber.receive(RECEIVE_S)
    assert got is not None
    got_header, got_payload = got
    assert bytes(got_payload) == data and got_header.digest == payload_digest(data)


def test_a_streamed_update_goes_through_a_relay_chain_with_its_digest(make_weight_plane):
    from test_weight_relay import Receiver

    h = make_weight_plane(fanout="chain", relay_timeout_s=2.0)
    receivers = [Receiver(h, f"w{i}") for i in range(3)]
    wait_until(lambda: len(h.plane.worker_versions()) == 3)
    header, data = make_update(1, num_bytes=5 * CHUNK_BYTES + 3)
    header.digest = ""
    ack = h.publisher().publish(header, data, RECEIVE_S, ready=lambda end: None)
    assert ack.applied
    wait_until(lambda: all(1 in r.got for r in receivers), timeout_s=RECEIVE_S, what="every worker has v1")
    assert all(r.got[1] == bytes(data) for r in receivers)  # each Receiver asserts the digest it computed
    assert h.plane.status().bytes_out_total == len(data), "relayed: the broker sent each byte once"
    for receiver in receivers:
        receiver.stop()


# ------------------------------------------------------------------------------------- the trainer's publisher


def test_the_policy_publisher_streams_a_full_update_that_equals_the_whole_payload_build(tiny_model, make_broker):
    from primerl.configs.trainer import ModelConfig
    from primerl.trainer.model import load_model
    from primerl.trainer.publish import PolicyPublisher

    harness = make_broker(stop_grace_s=0)
    model = load_model(ModelConfig(name=str(tiny_model)))
    payloads = {}
    # None ("auto"): streamed only when the weights are on a GPU; these are on the CPU.
    for version, stream, streamed in ((1, True, True), (2, False, False), (3, None, False)):
        with PolicyPublisher(
            harness.weight_endpoint,
            None,
            "trainer-0",
            1 << 20,
            "full",
            "tiny",
            stream=stream,
            serving_dtype=torch.bfloat16,
            lineage=1,
        ) as publisher:
            result = publisher.publish(model, version, timeout_s=30)
        assert result.ack.applied
        assert ("layout" in result.phases_ms) == streamed and ("digest" in result.phases_ms) != streamed
        update = harness.service.weight_store.latest()
        assert update.header.digest == payload_digest(update.payload)
        payloads[version] = bytes(update.payload)
    assert payloads[1] == payloads[2] == payloads[3], "streamed and whole builds send the same bytes"


@pytest.mark.parametrize("streamed", [False, True], ids=["digest-in-header", "digest-follows"])
def test_the_broker_computes_the_digest_in_the_checksum_pass_of_each_chunk(make_weight_plane, monkeypatch, streamed):
    """One read of each payload byte on the broker for both hashes: every byte its content digest is fed arrives
    while the chunk's checksum is being computed (``framing.decode``'s tee), none in a pass of its own."""
    from primerl.broker import weight_intake

    inside = threading.local()
    fed = {"in_pass": 0, "apart": 0}
    real_checksum, real_hasher_for = framing.compute_checksum, weight_intake.hasher_for

    def checksum(*args, **kwargs):
        inside.active = True
        try:
            return real_checksum(*args, **kwargs)
        finally:
            inside.active = False

    class Counting:
        def __init__(self, expected):
            self.inner = real_hasher_for(expected)

        def update(self, data):
            fed["in_pass" if getattr(inside, "active", False) else "apart"] += memoryview(data).nbytes
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    monkeypatch.setattr(framing, "compute_checksum", checksum)
    monkeypatch.setattr(weight_intake, "hasher_for", Counting)
    h = make_weight_plane()
    header, data = make_update(1, num_bytes=5 * CHUNK_BYTES + 3)
    publisher = h.dealer()
    chunks = chunks_of(header, data, streamed=streamed)
    for frames in chunks:
        publisher.send_multipart(frames, copy=False)
    assert publisher_ack(publisher).applied
    assert fed == {"in_pass": len(data), "apart": 0}


def test_a_streamed_update_sent_again_is_acknowledged_and_other_bytes_under_its_version_are_refused(make_weight_plane):
    """A publisher that lost the broker's ack sends the same update again: a streamed one names no digest in its
    first chunk, so the broker lets it in and compares the digest that follows (same bytes: acknowledged as held;
    other bytes under the same version: OUT_OF_ORDER)."""
    h = make_weight_plane()
    header, data = make_update(1, num_bytes=3 * CHUNK_BYTES + 5)
    publisher = h.dealer()
    for transfer_id in ("s1", "s2"):  # the second: the resend
        for frames in chunks_of(
            data_pb2.WeightUpdateHeader.FromString(header.SerializeToString()), data, transfer_id, streamed=True
        ):
            publisher.send_multipart(frames, copy=False)
        ack = publisher_ack(publisher)
        assert ack.applied, (transfer_id, ack.error.message)
    other = bytes(b ^ 1 for b in data[-64:])
    changed = data[:-64] + other
    for frames in chunks_of(
        data_pb2.WeightUpdateHeader.FromString(header.SerializeToString()), changed, "s3", streamed=True
    ):
        publisher.send_multipart(frames, copy=False)
    ack = publisher_ack(publisher)
    assert not ack.applied and ack.error.code == common_pb2.ERROR_CODE_OUT_OF_ORDER, ack.error.message
    assert h.store.latest().header.digest == payload_digest(data)
