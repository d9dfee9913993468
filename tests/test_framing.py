"""Wire round-trips for every data-plane message, and each way decoding refuses a message."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from primerl.proto import chunked_transfer, framing
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, data_pb2


def rollout_tensors(n: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(0, 500, n, dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64),
        "loss_mask": rng.random(n) > 0.5,
        "advantages": rng.standard_normal(n).astype(np.float32),
        "inference_logprobs": -rng.random(n).astype(np.float32),
        "temperatures": np.full(n, 1.0, np.float32),
        "policy_versions": np.full(n, 3, np.int64),
    }


def rollout_message(**envelope_fields) -> tuple[list, dict[str, np.ndarray]]:
    tensors = rollout_tensors()
    data, specs = tf.encode_tensors(tensors)
    header = data_pb2.RolloutBatchHeader(
        step=7,
        rank=1,
        micro_batch_index=0,
        num_micro_batches=2,
        num_samples=3,
        num_tokens=12,
        min_policy_version=3,
        max_policy_version=3,
        tensors=specs,
        batch_id="7:1:0",
    )
    return framing.encode(data_pb2.ROLLOUT_BATCH, header, [data], **envelope_fields), tensors


def as_bytes(frames: list) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


# ---------------------------------------------------------------- round trips


def test_rollout_batch_round_trip_keeps_header_and_tensors():
    frames, tensors = rollout_message(sender="orchestrator", auth_token="secret")
    message = framing.decode(as_bytes(frames), auth_token="secret")
    assert message.type == data_pb2.ROLLOUT_BATCH
    assert (message.header.step, message.header.rank, message.header.batch_id) == (7, 1, "7:1:0")
    assert message.envelope.sender == "orchestrator"
    decoded = tf.decode_tensors(message.payload[0], message.header.tensors)
    assert decoded.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(decoded[name], array)
        assert decoded[name].dtype == array.dtype


@pytest.mark.parametrize(
    "message_type, header",
    [
        (data_pb2.ROLLOUT_ACK, data_pb2.RolloutAck(batch_id="1:0:0", step=1, durable=True)),
        (
            data_pb2.ROLLOUT_ACK,
            data_pb2.RolloutAck(
                batch_id="1:0:0",
                step=1,
                error=common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_BACKPRESSURE, retry_after_ms=50),
            ),
        ),
        (data_pb2.ROLLOUT_REQUEST, data_pb2.RolloutRequest(step=4, rank=1, credits=2)),
        (data_pb2.ROLLOUT_STEP_DONE, data_pb2.RolloutStepDone(step=4, rank=1, num_micro_batches=3)),
        (data_pb2.WEIGHT_ACK, data_pb2.WeightAck(policy_version=9, worker_id="w1", applied=True, apply_ms=12)),
        (data_pb2.HELLO, data_pb2.Hello(worker_id="w1", role=common_pb2.ROLE_INFERENCE)),
        (
            data_pb2.ERROR,
            data_pb2.ErrorReply(
                error=common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_OUT_OF_ORDER, message="x"),
                refused_type=data_pb2.WEIGHT_UPDATE,
            ),
        ),
    ],
)
def test_control_messages_round_trip(message_type, header):
    message = framing.decode(framing.encode(message_type, header, in_reply_to="abc"))
    assert message.type == message_type
    assert message.header == header
    assert message.envelope.in_reply_to == "abc"
    assert message.payload == []


@pytest.mark.parametrize(
    "kind", [data_pb2.WEIGHT_UPDATE_KIND_FULL, data_pb2.WEIGHT_UPDATE_KIND_LORA, data_pb2.WEIGHT_UPDATE_KIND_DELTA]
)
def test_weight_update_round_trip_in_chunks(kind):
    torch = pytest.importorskip("torch")
    weights = {"model.embed_tokens.weight": torch.randn(64, 32, dtype=torch.bfloat16), "lm_head.bias": torch.randn(64)}
    data, specs = tf.encode_tensors(weights)
    import hashlib

    header = data_pb2.WeightUpdateHeader(
        policy_version=5,
        kind=kind,
        base_version=4 if kind == data_pb2.WEIGHT_UPDATE_KIND_DELTA else 0,
        digest=hashlib.sha256(data).hexdigest(),
        tensors=specs,
        payload_bytes=len(data),
        adapter_config_json='{"r": 8}' if kind == data_pb2.WEIGHT_UPDATE_KIND_LORA else "",
    )
    messages = list(
        chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, header, data, chunk_bytes=1000, sender="trainer")
    )
    assert len(messages) == -(-len(data) // 1000) > 1
    assembler = chunked_transfer.ChunkAssembler()
    results = [assembler.add(framing.decode(as_bytes(frames))) for frames in messages]
    assert results[:-1] == [None] * (len(messages) - 1)
    whole = results[-1]
    assert whole.header == header
    assert hashlib.sha256(whole.payload[0]).hexdigest() == header.digest
    decoded = tf.decode_tensors(whole.payload[0], whole.header.tensors, as_torch=True)
    for name, tensor in weights.items():
        assert torch.equal(decoded[name], tensor)
    assert assembler.num_open_transfers == 0


def test_zmq_frames_decode_without_copy():
    zmq = pytest.importorskip("zmq")
    frames, tensors = rollout_message()
    ctx = zmq.Context()
    try:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart(frames, copy=False)
        assert pull.poll(5000), "message did not arrive within 5 s"
        message = framing.decode(pull.recv_multipart(copy=False))
        np.testing.assert_array_equal(tf.decode_tensors(message.payload[0])["input_ids"], tensors["input_ids"])
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------- refusals


def refusal(frames, **kwargs) -> framing.FramingError:
    with pytest.raises(framing.FramingError) as info:
        framing.decode(frames, **kwargs)
    return info.value


def test_truncated_messages_are_refused():
    frames = as_bytes(rollout_message()[0])
    assert isinstance(refusal(frames[:2]), framing.TruncatedMessage)
    assert isinstance(refusal(frames[:3]), framing.TruncatedMessage)  # payload frame missing
    short = frames[:3] + [frames[3][:-5]]
    assert isinstance(refusal(short), framing.TruncatedMessage)


def test_unknown_protocol_and_version_are_refused():
    frames = as_bytes(rollout_message()[0])
    assert isinstance(refusal([b"HTTP/"] + frames[1:]), framing.UnknownProtocol)
    error = refusal([framing.PROTOCOL_ID + bytes([2])] + frames[1:])
    assert isinstance(error, framing.UnsupportedVersion)
    assert error.code == common_pb2.ERROR_CODE_UNSUPPORTED_VERSION


def test_unknown_message_type_is_refused():
    frames = as_bytes(rollout_message()[0])
    assert isinstance(refusal([frames[0], bytes([200])] + frames[2:]), framing.UnknownMessageType)
    assert isinstance(refusal([frames[0], b"\x01\x01"] + frames[2:]), framing.UnknownMessageType)


def test_bad_checksum_is_refused():
    frames = as_bytes(rollout_message()[0])
    corrupted = bytearray(frames[3])
    corrupted[-1] ^= 0xFF
    error = refusal(frames[:3] + [bytes(corrupted)])
    assert isinstance(error, framing.ChecksumMismatch)
    # Retyping the message (same bytes, other type) breaks the checksum too.
    assert isinstance(
        refusal([frames[0], bytes([data_pb2.WEIGHT_UPDATE])] + frames[2:]),
        (framing.ChecksumMismatch, framing.MalformedHeader),
    )


def test_oversized_frames_and_messages_are_refused():
    frames = as_bytes(rollout_message()[0])
    small = framing.Limits(max_frame_bytes=100)
    error = refusal(frames, limits=small)
    assert isinstance(error, framing.OversizedFrame) and error.code == common_pb2.ERROR_CODE_OVERSIZED
    assert isinstance(refusal(frames, limits=framing.Limits(max_message_bytes=200)), framing.OversizedFrame)
    assert isinstance(refusal(frames + [b"x"] * 70), framing.OversizedFrame)  # too many payload frames


def test_malformed_envelope_is_refused():
    frames = as_bytes(rollout_message()[0])
    assert isinstance(refusal(frames[:2] + [b"\xff\xff\xff"] + frames[3:]), framing.MalformedHeader)


def test_wrong_token_is_refused():
    frames = as_bytes(rollout_message(auth_token="right")[0])
    assert isinstance(refusal(frames, auth_token="other"), framing.Unauthenticated)
    assert isinstance(refusal(as_bytes(rollout_message()[0]), auth_token="right"), framing.Unauthenticated)


def tensor_message_with(header_specs, payload: bytes) -> list:
    header = data_pb2.RolloutBatchHeader(step=1, tensors=header_specs)
    return framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload])


def test_tensor_dtype_or_shape_contradicting_header_is_refused():
    data, specs = tf.encode_tensors({"input_ids": np.arange(8, dtype=np.int64)})
    wrong_dtype = [common_pb2.TensorSpec(name="input_ids", dtype="I32", shape=[8])]
    wrong_shape = [common_pb2.TensorSpec(name="input_ids", dtype="I64", shape=[2, 4])]
    wrong_name = [common_pb2.TensorSpec(name="labels", dtype="I64", shape=[8])]
    for header_specs in (wrong_dtype, wrong_shape, wrong_name):
        error = refusal(tensor_message_with(header_specs, data))
        assert isinstance(error, framing.TensorMismatch), error
        assert error.code == common_pb2.ERROR_CODE_TENSOR_MISMATCH


def handmade_safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_safetensors_header_lies_are_refused():
    spec = [common_pb2.TensorSpec(name="x", dtype="F32", shape=[4])]
    # Byte count disagrees with the shape.
    lying = handmade_safetensors({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12)
    assert isinstance(refusal(tensor_message_with(spec, lying)), framing.TensorMismatch)
    # Offsets run past the end of the frame.
    past_end = handmade_safetensors({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    assert isinstance(refusal(tensor_message_with(spec, past_end)), framing.TruncatedMessage)
    # Header length prefix claims more than there is.
    assert isinstance(refusal(tensor_message_with(spec, struct.pack("<Q", 10_000) + b"{}")), framing.TruncatedMessage)
    # Not JSON, unknown dtype.
    assert isinstance(refusal(tensor_message_with(spec, struct.pack("<Q", 3) + b"{{{")), framing.MalformedHeader)
    unknown = handmade_safetensors({"x": {"dtype": "PICKLE", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16)
    assert isinstance(refusal(tensor_message_with(spec, unknown)), framing.MalformedHeader)


def test_chunk_errors_are_refused():
    data = bytes(range(256)) * 40
    header = data_pb2.WeightUpdateHeader(policy_version=1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL)
    messages = [
        framing.decode(f)
        for f in chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, header, data, chunk_bytes=1024)
    ]
    assert len(messages) == 10

    out_of_order = chunked_transfer.ChunkAssembler()
    assert out_of_order.add(messages[0]) is None
    with pytest.raises(framing.BadChunk, match="expected chunk 1, got 2"):
        out_of_order.add(messages[2])
    assert out_of_order.num_open_transfers == 0  # the broken transfer is dropped

    late_start = chunked_transfer.ChunkAssembler()
    with pytest.raises(framing.BadChunk, match="before chunk 0"):
        late_start.add(messages[3])

    duplicate = chunked_transfer.ChunkAssembler()
    duplicate.add(messages[0])
    with pytest.raises(framing.BadChunk):
        duplicate.add(messages[0])

    other_header = data_pb2.WeightUpdateHeader(policy_version=2, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL)
    swapped = [
        framing.decode(f)
        for f in chunked_transfer.encode_chunked(
            data_pb2.WEIGHT_UPDATE,
            other_header,
            data,
            chunk_bytes=1024,
            transfer_id=messages[0].envelope.chunk.transfer_id,
        )
    ]
    mixed = chunked_transfer.ChunkAssembler()
    mixed.add(messages[0])
    with pytest.raises(framing.BadChunk, match="different header"):
        mixed.add(swapped[1])


def test_chunked_transfers_are_bounded():
    data = b"\0" * 4096
    header = data_pb2.WeightUpdateHeader(policy_version=1)
    assembler = chunked_transfer.ChunkAssembler(max_open_transfers=2, timeout_s=10)
    for _ in range(2):
        first = next(chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, header, data, chunk_bytes=1024))
        assembler.add(framing.decode(first))
    third = next(chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, header, data, chunk_bytes=1024))
    with pytest.raises(framing.BadChunk, match="too many open transfers"):
        assembler.add(framing.decode(third))
    import time

    assert len(assembler.expire(now_s=time.monotonic() + 11)) == 2
    assert assembler.num_open_transfers == 0
    limited = framing.Limits(max_transfer_bytes=2048)
    with pytest.raises(framing.OversizedFrame):
        framing.decode(
            next(chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, header, data, chunk_bytes=1024)),
            limits=limited,
        )


def test_error_reply_carries_the_refusal():
    frames = as_bytes(rollout_message()[0])
    corrupted = frames[:3] + [frames[3][:-1] + b"\x00"]
    try:
        framing.decode(corrupted)
    except framing.FramingError as error:
        reply = framing.decode(framing.encode_error(error, refused_type=framing.peek_type(corrupted), in_reply_to="m1"))
    assert reply.type == data_pb2.ERROR
    assert reply.header.error.code == common_pb2.ERROR_CODE_BAD_CHECKSUM
    assert reply.header.refused_type == data_pb2.ROLLOUT_BATCH
    assert "checksum" in reply.header.error.message


def test_encode_checks_header_type():
    with pytest.raises(TypeError):
        framing.encode(data_pb2.ROLLOUT_BATCH, data_pb2.RolloutAck())
    with pytest.raises(ValueError):
        tf.encode_tensors({"x": np.array(["a"])})


# ---------------------------------------------------------------- fuzz

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VALID_FRAMES = as_bytes(rollout_message()[0])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frame_index=st.integers(0, len(VALID_FRAMES) - 1),
    position=st.integers(0, 10_000),
    new_byte=st.integers(0, 255),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    extra=st.lists(st.binary(max_size=64), max_size=3),
)
def test_any_mutation_is_refused_with_a_framing_error(frame_index, position, new_byte, cut, extra):
    frames = [bytearray(f) for f in VALID_FRAMES]
    target = frames[frame_index]
    if target:
        target[position % len(target)] = new_byte
    if cut is not None:
        frames[frame_index] = target[: cut % (len(target) + 1)]
    frames = [bytes(f) for f in frames] + extra
    try:
        message = framing.decode(frames)
    except framing.FramingError as error:
        assert error.code != common_pb2.ERROR_CODE_UNSPECIFIED and str(error)
    else:  # the mutation changed nothing that matters (e.g. same byte written back)
        assert message.type == data_pb2.ROLLOUT_BATCH
        tf.decode_tensors(message.payload[0], message.header.tensors)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_random_frames_never_crash_the_decoder(frames):
    with pytest.raises(framing.FramingError) as info:  # random bytes never make a valid message
        framing.decode(frames)
    assert info.value.code != common_pb2.ERROR_CODE_UNSPECIFIED


def test_encode_raw_with_a_known_checksum_makes_no_pass_and_is_checked_by_the_receiver():
    frames, tensors = rollout_message()
    sent = framing.decode(as_bytes(frames))
    relayed = framing.encode_raw(
        data_pb2.ROLLOUT_BATCH, sent.envelope.header, sent.payload, checksum=sent.envelope.checksum, sender="broker"
    )
    again = framing.decode(as_bytes(relayed))
    assert again.envelope.header == sent.envelope.header and again.envelope.checksum == sent.envelope.checksum
    assert bytes(again.payload[0]) == bytes(sent.payload[0])
    wrong = framing.encode_raw(
        data_pb2.ROLLOUT_BATCH, sent.envelope.header, sent.payload, checksum=sent.envelope.checksum ^ 1
    )
    assert isinstance(refusal(as_bytes(wrong)), framing.ChecksumMismatch)
