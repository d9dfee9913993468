"""The weight plane over real ZMQ on loopback (port 0): fan-out, late joiners, refusals, auth, hardening."""

from __future__ import annotations

import hashlib
import time

import pytest
import zmq
from support.probes import wait_until as wait_for
from support.weight_plane import CHUNK_BYTES, LIMITS, RECEIVE_S, TOKEN, FakeBroker, make_update

from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_plane import WeightPlane
from primerl.broker.weight_store import WeightStore
from primerl.client.weights import WeightPlaneError, WeightSubscriber
from primerl.proto import chunked_transfer, framing
from primerl.proto.digests import payload_digest
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
LORA = data_pb2.WEIGHT_UPDATE_KIND_LORA
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA


@pytest.fixture
def harness(make_weight_plane):
    """`harness(**WeightPlane keyword arguments)`: a weight plane on loopback (conftest's `make_weight_plane`)."""
    return make_weight_plane


def receive_and_ack(subscriber: WeightSubscriber) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    got = subscriber.receive(RECEIVE_S)
    assert got is not None, f"{subscriber.worker_id} received nothing"
    header, payload = got
    subscriber.ack(header.policy_version, apply_ms=1)
    return header, bytes(payload)


def test_full_update_fans_out_to_three_subscribers(harness):
    h = harness()
    subscribers = [h.subscriber(f"infer-{i}") for i in range(3)]
    for subscriber in subscribers:
        subscriber.hello()
    wait_for(lambda: len(h.plane.worker_versions()) == 3)
    assert h.plane.worker_versions() == {f"infer-{i}": None for i in range(3)}
    header, data = make_update(1, num_bytes=100_000)
    ack = h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    assert ack.applied and ack.policy_version == 1 and not ack.full_required
    for subscriber in subscribers:
        got_header, payload = receive_and_ack(subscriber)
        assert got_header.policy_version == 1 and payload == data
        assert got_header.digest == payload_digest(data)
    wait_for(lambda: h.plane.worker_versions() == {f"infer-{i}": 1 for i in range(3)})
    assert sorted(h.applied) == [(f"infer-{i}", 1) for i in range(3)]
    status = h.plane.status()
    assert status.store.latest_version == 1 and status.bytes_out_total >= 3 * len(data)
    assert status.bytes_out_per_s > 0 and status.bytes_in_per_s > 0


def test_late_subscriber_gets_snapshot_then_deltas_and_chain_member_gets_the_rest(harness):
    h = harness()
    publisher = h.publisher()
    updates = [make_update(1), make_update(2, DELTA, base=1), make_update(3, DELTA, base=2)]
    for header, data in updates:
        assert publisher.publish(header, data, timeout_s=RECEIVE_S).applied
    late = h.subscriber("late")
    late.hello()
    received = [receive_and_ack(late) for _ in range(3)]
    assert [(hd.policy_version, hd.kind) for hd, _ in received] == [(1, FULL), (2, DELTA), (3, DELTA)]
    assert [payload for _, payload in received] == [data for _, data in updates]
    on_chain = h.subscriber("on-chain")
    on_chain.hello(current_version=2)
    header, _ = receive_and_ack(on_chain)
    assert (header.policy_version, header.kind, header.base_version) == (3, DELTA, 2)
    current = h.subscriber("current")
    current.hello(current_version=3)
    assert current.receive(0.3) is None
    wait_for(lambda: h.plane.worker_versions() == {"late": 3, "on-chain": 3, "current": 3})
    # A new delta reaches all of them.
    publisher.publish(*make_update(4, DELTA, base=3), timeout_s=RECEIVE_S)
    for subscriber in (late, on_chain, current):
        assert receive_and_ack(subscriber)[0].policy_version == 4


def test_bad_digest_and_out_of_order_are_refused_and_change_nothing(harness):
    h = harness()
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    publisher = h.publisher()
    publisher.publish(*make_update(5), timeout_s=RECEIVE_S)
    assert receive_and_ack(subscriber)[0].policy_version == 5
    before = h.store.status()

    header, data = make_update(6, num_bytes=300_000)  # several chunks
    header.digest = "ab" * 32
    with pytest.raises(WeightUpdateRefused) as info:
        publisher.publish(header, data, timeout_s=RECEIVE_S)
    assert info.value.code == common_pb2.ERROR_CODE_BAD_DIGEST

    for header, data in (
        make_update(5, num_bytes=5000),
        make_update(4, num_bytes=300_000),
        make_update(7, DELTA, base=6),
        make_update(6, DELTA, base=4),
    ):
        with pytest.raises(WeightUpdateRefused) as info:
            publisher.publish(header, data, timeout_s=RECEIVE_S)
        assert info.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER, header

    after = h.store.status()
    assert (after.latest_version, after.num_deltas, after.num_bytes) == (
        before.latest_version,
        before.num_deltas,
        before.num_bytes,
    )
    assert after.num_refused == 5
    assert subscriber.receive(0.3) is None
    # The plane still takes a good update afterwards.
    assert publisher.publish(*make_update(6, DELTA, base=5), timeout_s=RECEIVE_S).applied
    assert receive_and_ack(subscriber)[0].policy_version == 6


def test_lora_update_flows_with_its_adapter_config(harness):
    h = harness()
    subscriber = h.subscriber("infer-lora")
    subscriber.hello()
    config = '{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}'
    header, data = make_update(1, LORA, adapter_config_json=config, policy_name="policy-v1")
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got, payload = receive_and_ack(subscriber)
    assert (got.kind, got.adapter_config_json, got.policy_name, payload) == (LORA, config, "policy-v1", data)
    assert h.store.status().snapshot_kind == "LORA"
    wait_for(lambda: h.plane.worker_versions() == {"infer-lora": 1})


def read_error(socket: zmq.Socket) -> data_pb2.ErrorReply:
    assert socket.poll(5000), "no reply from the plane"
    message = framing.decode(socket.recv_multipart())
    assert message.type == data_pb2.ERROR
    assert message.envelope.auth_token == ""  # an ERROR never carries the run token
    return message.header


def test_malformed_frames_get_errors_and_the_plane_keeps_serving(harness):
    h = harness()
    raw = h.dealer()
    hello = framing.encode(
        data_pb2.HELLO, data_pb2.Hello(worker_id="x", role=common_pb2.ROLE_INFERENCE), auth_token=TOKEN
    )
    cases = [
        ([b"garbage"], common_pb2.ERROR_CODE_TRUNCATED),
        ([b"HTTP/1.1", b"\x07", b""], common_pb2.ERROR_CODE_UNKNOWN_PROTOCOL),
        ([b"PRML\x09", b"\x07", b""], common_pb2.ERROR_CODE_UNSUPPORTED_VERSION),
        ([framing.PROTOCOL_FRAME, b"\xff", b""], common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE),
        ([framing.PROTOCOL_FRAME, b"\x07", b"\xff\xff\xff"], common_pb2.ERROR_CODE_MALFORMED_HEADER),
        ([*hello[:2], hello[2][:-3]], None),  # truncated envelope: some framing error
        ([*hello, b"extra frame"], common_pb2.ERROR_CODE_MALFORMED_HEADER),
        (
            framing.encode(data_pb2.ROLLOUT_REQUEST, data_pb2.RolloutRequest(step=1), auth_token=TOKEN),
            common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
        ),
        (
            framing.encode(data_pb2.WEIGHT_ACK, data_pb2.WeightAck(policy_version=1, applied=True), auth_token=TOKEN),
            common_pb2.ERROR_CODE_UNKNOWN_WORKER,
        ),
    ]
    # A WEIGHT_UPDATE whose tensors contradict its header.
    header, data = make_update(1)
    header.tensors[0].shape[0] += 1
    cases.append(
        (
            framing.encode(data_pb2.WEIGHT_UPDATE, header, [data], auth_token=TOKEN),
            common_pb2.ERROR_CODE_TENSOR_MISMATCH,
        )
    )
    # A chunk that arrives without its transfer's first chunk.
    header, data = make_update(1, num_bytes=200_000)
    chunks = list(
        chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE, header, data, chunk_bytes=CHUNK_BYTES, auth_token=TOKEN, sender="t"
        )
    )
    cases.append((chunks[1], common_pb2.ERROR_CODE_BAD_CHUNK))
    for frames, code in cases:
        raw.send_multipart(frames)
        reply = read_error(raw) if code != common_pb2.ERROR_CODE_BAD_CHUNK else None
        if reply is None:  # refused chunks are answered with a WEIGHT_ACK(applied=false)
            assert raw.poll(5000)
            ack = framing.decode(raw.recv_multipart(), auth_token=TOKEN)
            assert ack.type == data_pb2.WEIGHT_ACK and not ack.header.applied and ack.header.error.code == code
        elif code is not None:
            assert reply.error.code == code, (frames[:2], reply)
        else:
            assert reply.error.code != common_pb2.ERROR_CODE_UNSPECIFIED
    assert h.plane.running and h.plane.status().num_errors_sent == len(cases)
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    h.publisher().publish(*make_update(1, num_bytes=200_000), timeout_s=RECEIVE_S)
    assert receive_and_ack(subscriber)[0].policy_version == 1


def test_wrong_or_missing_token_is_unauthenticated(harness):
    h = harness()
    with pytest.raises(WeightUpdateRefused) as info:
        h.publisher(token="wrong").publish(*make_update(1, num_bytes=200_000), timeout_s=RECEIVE_S)
    assert info.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    with pytest.raises(WeightUpdateRefused) as info:
        h.publisher(token=None).publish(*make_update(1), timeout_s=RECEIVE_S)
    assert info.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    intruder = h.subscriber("intruder", token="wrong")
    with pytest.raises(WeightPlaneError) as plane_error:  # the refusal may land on the hello's send or after it
        intruder.hello()
        intruder.receive(RECEIVE_S)
    assert plane_error.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    assert h.store.status().latest_version is None and h.plane.worker_versions() == {}
    # An authenticated worker does not accept pushes lacking the token (mutual check on the client side).
    assert h.publisher().publish(*make_update(1), timeout_s=RECEIVE_S).applied


def test_gone_and_stuck_subscribers_do_not_block_the_others(harness):
    h = harness()
    gone = h.subscriber("gone")
    stuck = h.subscriber("stuck")  # never reads: its pipe fills up to the high-water mark
    healthy = [h.subscriber(f"ok-{i}") for i in range(2)]
    for subscriber in (gone, stuck, *healthy):
        subscriber.hello()
    wait_for(lambda: len(h.plane.worker_versions()) == 4)
    gone.close()
    time.sleep(0.2)  # let the broker see the disconnect
    header, data = make_update(1, num_bytes=24 << 20)  # 384 chunks: more than both high-water marks
    start = time.monotonic()
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    for subscriber in healthy:
        got, payload = receive_and_ack(subscriber)
        assert got.policy_version == 1 and payload == data
    assert time.monotonic() - start < RECEIVE_S
    wait_for(lambda: "gone" not in h.plane.worker_versions())
    versions = h.plane.worker_versions()
    assert versions["ok-0"] == versions["ok-1"] == 1 and versions["stuck"] is None
    assert h.plane.status().num_workers_forgotten >= 1
    # The stuck worker gets the whole update once it reads.
    got, payload = receive_and_ack(stuck)
    assert got.policy_version == 1 and payload == data


def test_unacknowledged_update_is_resent_then_worker_forgotten_and_rejoins(harness):
    h = harness(ack_timeout_s=0.3, max_retries=1)
    subscriber = h.subscriber("silent", hello_interval_s=60)
    subscriber.hello()
    h.publisher().publish(*make_update(1), timeout_s=RECEIVE_S)
    first = subscriber.receive(RECEIVE_S)
    assert first is not None and first[0].policy_version == 1  # no ack
    again = subscriber.receive(RECEIVE_S)
    assert again is not None and again[0].policy_version == 1  # resent after the ack timeout
    wait_for(lambda: "silent" not in h.plane.worker_versions())  # second timeout: forgotten
    # Its late ack is answered with UNKNOWN_WORKER; the subscriber says hello again on its own.
    subscriber.ack(1)
    assert subscriber.receive(0.5) is None
    wait_for(lambda: h.plane.worker_versions() == {"silent": 1})


def test_worker_that_fails_to_apply_gets_the_full_snapshot(harness):
    h = harness()
    publisher = h.publisher()
    publisher.publish(*make_update(1), timeout_s=RECEIVE_S)
    subscriber = h.subscriber("infer-0")
    subscriber.hello(current_version=1)
    publisher.publish(*make_update(2, DELTA, base=1), timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and got[0].kind == DELTA
    subscriber.ack(2, applied=False, error=common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_INTERNAL, message="boom"))
    received = [receive_and_ack(subscriber)[0] for _ in range(2)]
    assert [(u.policy_version, u.kind) for u in received] == [(1, FULL), (2, DELTA)]
    wait_for(lambda: h.plane.worker_versions() == {"infer-0": 2})


def test_full_delta_chain_sets_full_required(harness):
    h = harness(max_deltas=1)
    publisher = h.publisher()
    assert not publisher.publish(*make_update(1), timeout_s=RECEIVE_S).full_required
    assert publisher.publish(*make_update(2, DELTA, base=1), timeout_s=RECEIVE_S).full_required
    with pytest.raises(WeightUpdateRefused) as info:
        publisher.publish(*make_update(3, DELTA, base=2), timeout_s=RECEIVE_S)
    assert info.value.full_required and info.value.code == common_pb2.ERROR_CODE_BACKPRESSURE
    assert publisher.publish(*make_update(3), timeout_s=RECEIVE_S).applied


def test_large_update_in_many_chunks_and_a_resend_after_a_forgetful_hello(harness):
    h = harness()
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    header, data = make_update(1, num_bytes=3 << 20)
    assert len(data) > 40 * CHUNK_BYTES
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got, payload = receive_and_ack(subscriber)
    assert payload == data and got.payload_bytes == len(data)
    # A repeated hello with the same version changes nothing; one that forgets the version gets the snapshot again,
    # passed on whole: the worker's PolicyUpdater.holds says it serves v1 already, and the worker re-acknowledges.
    subscriber.hello(current_version=1)
    assert subscriber.receive(0.3) is None
    subscriber.hello(current_version=None)
    again, payload = receive_and_ack(subscriber)
    assert again.policy_version == 1 and payload == data
    wait_for(lambda: h.plane.worker_versions() == {"infer-0": 1})


def test_plane_rejects_bad_chunk_size_and_reports_bind_errors():
    context = zmq.Context()
    try:
        with pytest.raises(ValueError):
            WeightPlane(WeightFanout(WeightStore()), context, "127.0.0.1", 0, LIMITS, None, LIMITS.max_frame_bytes + 1)
        first = WeightPlane(WeightFanout(WeightStore()), context, "127.0.0.1", 0, LIMITS, None, CHUNK_BYTES)
        port = first.start()
        second = WeightPlane(WeightFanout(WeightStore()), context, "127.0.0.1", port, LIMITS, None, CHUNK_BYTES)
        with pytest.raises(RuntimeError, match="cannot bind"):
            second.start()
        assert first.stop(5.0) and second.stop(5.0)
    finally:
        context.destroy(linger=0)


def test_subscriber_checks_the_token_and_passes_the_digest_check_on():
    """Against a fake broker (a bare ROUTER): a push without the run token is ignored; an update is returned as
    received, a bad digest too (the inference worker's ``PolicyUpdater`` is its one digest checker)."""
    context = zmq.Context()
    fake = FakeBroker(context, "infer-0")
    router, port = fake.router, fake.port
    subscriber = WeightSubscriber(f"tcp://127.0.0.1:{port}", TOKEN, "infer-0", context=context, limits=LIMITS)
    try:
        subscriber.hello()
        assert router.poll(5000)
        identity, *frames = router.recv_multipart()
        assert framing.decode(frames, auth_token=TOKEN).header.worker_id == "infer-0"
        header, data = make_update(1)
        header.digest = "00" * 32
        router.send_multipart([identity, *framing.encode(data_pb2.WEIGHT_UPDATE, header, [data], auth_token=TOKEN)])
        got = subscriber.receive(RECEIVE_S)
        assert got is not None and got[0].digest == "00" * 32 and bytes(got[1]) == data
        assert not router.poll(200)  # no ack of its own: the caller acknowledges
        header.digest = hashlib.sha256(data).hexdigest()
        router.send_multipart([identity, *framing.encode(data_pb2.WEIGHT_UPDATE, header, [data], auth_token="other")])
        assert subscriber.receive(0.3) is None
        router.send_multipart([identity, *framing.encode(data_pb2.WEIGHT_UPDATE, header, [data], auth_token=TOKEN)])
        got = subscriber.receive(RECEIVE_S)
        assert got is not None and bytes(got[1]) == data
    finally:
        subscriber.close()
        fake.close()
        context.destroy(linger=0)


def test_forwarded_chunks_reuse_the_verified_crcs_when_chunk_sizes_match(harness, monkeypatch):
    h = harness()
    subscriber = h.subscriber("infer-0")
    subscriber.hello()
    wait_for(lambda: len(h.plane.worker_versions()) == 1)
    passes = []
    real_checksum = framing.compute_checksum

    def counting_checksum(message_type, header_bytes, payload, kind=framing.CRC32, *, also=None):
        assert kind == framing.XXH3_64 or not payload, "weight chunks carry XXH3-64 checksums"
        passes.append(sum(len(memoryview(x)) for x in payload))
        return real_checksum(message_type, header_bytes, payload, kind, also=also)

    monkeypatch.setattr(framing, "compute_checksum", counting_checksum)
    header, data = make_update(1, num_bytes=5 * CHUNK_BYTES + 17)  # several chunks, the last one short
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got, payload = receive_and_ack(subscriber)
    assert payload == data and got.policy_version == 1 and got.digest == payload_digest(data)
    # publisher encodes (1 pass), broker decodes (1), subscriber decodes (1): the broker's forwarding adds none
    assert sum(passes) == 3 * len(data)
