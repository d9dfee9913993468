"""The six messages that used to end the broker (issue 13), each with a valid run token and CRC: each must
now get a clear refusal (or be ignored where the protocol sends no reply) while both planes keep serving."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
import zmq

from primerl.broker.service import BrokerService
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, pack_batch
from primerl.proto import framing
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.wire_security import apply_run_token

TOKEN = "regression-token"


def safetensors_frame(header_json: str, data: bytes = b"") -> bytes:
    raw = header_json.encode()
    return struct.pack("<Q", len(raw)) + raw + data


NESTED = '{"__metadata__": ' + '{"a": ' * 1000 + '"x"' + "}" * 1000 + "}"
HUGE_INT = '{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + "1" * 4400 + "]}}"
LIST_DTYPE = json.dumps({"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}})
BAD_HEADERS = {"nested": NESTED, "huge_int": HUGE_INT, "list_dtype": LIST_DTYPE}


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
def test_parse_header_refuses_hostile_json(name):
    with pytest.raises(tf.TensorFrameError):
        tf.parse_header(safetensors_frame(BAD_HEADERS[name], b"\0" * 4))


@pytest.fixture
def broker(make_broker):
    harness = make_broker(run_token=TOKEN, run_id="regressions", max_message_bytes=8 << 20)
    context = zmq.Context()
    try:
        yield harness.service, harness.endpoints, context
    finally:
        context.destroy(linger=0)


def _dealer(context: zmq.Context, port: int) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    apply_run_token(socket, TOKEN, "regressions")
    socket.connect(f"tcp://127.0.0.1:{port}")
    return socket


def _reply(socket: zmq.Socket, timeout_s: float = 5.0) -> framing.Message | None:
    if not socket.poll(int(timeout_s * 1000)):
        return None
    return framing.decode(socket.recv_multipart())


def _spec_list() -> list[common_pb2.TensorSpec]:
    return [common_pb2.TensorSpec(name="t", dtype="F32", shape=[1])]


def _assert_serving(service: BrokerService, endpoints) -> None:
    time.sleep(0.3)  # the broker used to exit ~1 s after such a message; its IO thread died at once
    assert service.rollout_plane.running and service.weight_plane.running
    endpoint = f"tcp://127.0.0.1:{endpoints.rollout_port}"
    tensors = {"input_ids": np.arange(8, dtype=np.int64)}
    step = int(time.monotonic_ns() % 500) + 1
    with RolloutProducer(endpoint, TOKEN) as producer:
        assert producer.send_batch(*pack_batch(step, 0, 0, 1, tensors), timeout_s=10).durable
    with RolloutConsumer(endpoint, TOKEN, worker_id=f"check-{step}", rank=0) as consumer:
        ((_, received),) = consumer.fetch_step(step, timeout_s=10)
        np.testing.assert_array_equal(received["input_ids"], tensors["input_ids"])


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
def test_hostile_safetensors_header_is_refused_on_both_sockets(broker, name):
    service, endpoints, context = broker
    payload = safetensors_frame(BAD_HEADERS[name], b"\0" * 4)
    rollout_header = data_pb2.RolloutBatchHeader(
        batch_id="b", step=1, rank=0, micro_batch_index=0, num_micro_batches=1, tensors=_spec_list()
    )
    weight_header = data_pb2.WeightUpdateHeader(
        policy_version=1,
        kind=data_pb2.WEIGHT_UPDATE_KIND_FULL,
        tensors=_spec_list(),
        payload_bytes=len(payload),
        digest="0" * 64,
    )
    for port, message_type, header in (
        (endpoints.rollout_port, data_pb2.ROLLOUT_BATCH, rollout_header),
        (endpoints.weight_port, data_pb2.WEIGHT_UPDATE, weight_header),
    ):
        socket = _dealer(context, port)
        socket.send_multipart(framing.encode(message_type, header, [payload], auth_token=TOKEN))
        reply = _reply(socket)
        assert reply is not None and reply.type == data_pb2.ERROR
        assert reply.header.error.code == common_pb2.ERROR_CODE_MALFORMED_HEADER, reply.header.error.message
        assert reply.header.refused_type == message_type
    _assert_serving(service, endpoints)


def test_unknown_enum_values_on_the_weight_socket_keep_it_serving(broker):
    service, endpoints, context = broker
    socket = _dealer(context, endpoints.weight_port)
    # 4. HELLO with a role outside the enum; 5. ERROR with an unknown code.
    socket.send_multipart(framing.encode(data_pb2.HELLO, data_pb2.Hello(role=6), auth_token=TOKEN))
    socket.send_multipart(
        framing.encode(data_pb2.ERROR, data_pb2.ErrorReply(error=common_pb2.ErrorDetail(code=255)), auth_token=TOKEN)
    )
    # 6. A known worker's WEIGHT_ACK that carries an unknown error code.
    worker = _dealer(context, endpoints.weight_port)
    worker.send_multipart(
        framing.encode(data_pb2.HELLO, data_pb2.Hello(role=common_pb2.ROLE_INFERENCE, worker_id="w"), auth_token=TOKEN)
    )
    time.sleep(0.2)
    worker.send_multipart(
        framing.encode(
            data_pb2.WEIGHT_ACK,
            data_pb2.WeightAck(applied=False, error=common_pb2.ErrorDetail(code=999)),
            auth_token=TOKEN,
        )
    )
    # Same enum values on the rollout socket.
    rollout = _dealer(context, endpoints.rollout_port)
    rollout.send_multipart(framing.encode(data_pb2.HELLO, data_pb2.Hello(role=6, worker_id="r"), auth_token=TOKEN))
    reply = _reply(rollout)
    assert reply is not None and reply.type == data_pb2.HELLO
    _assert_serving(service, endpoints)
    assert service.weight_plane.status().workers  # the worker is still known: the ack was handled


def test_enum_names_never_raise():
    assert framing.error_code_name(999) == "ErrorCode(999)"
    assert framing.role_name(99) == "Role(99)"
    assert framing.role_name(common_pb2.ROLE_TRAINER) == "ROLE_TRAINER"


def test_decode_is_total_on_a_header_that_breaks_the_parser():
    """Whatever the bytes, decode raises only FramingError."""
    payload = safetensors_frame(NESTED)
    header = data_pb2.RolloutBatchHeader(batch_id="b", step=1, num_micro_batches=1, tensors=_spec_list())
    with pytest.raises(framing.FramingError):
        framing.decode(framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload]))
