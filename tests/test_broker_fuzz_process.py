"""Property-based fuzz of a `primerl-broker` *process*: both ZeroMQ sockets and every gRPC method.

Messages are built to get past the cheap checks (a valid run token and CRC, real header types) so that the
parsers behind them are what is fuzzed: hostile safetensors JSON, headers with out-of-range enums and huge
integers, impossible chunk fields, garbage and mutated protobuf bodies with the right, a wrong or no token.
After every batch the test checks that the process is alive and still serves a legitimate client (a rollout
round trip, a weight publish, GetRunStatus).

Cases: ``PRIMERL_FUZZ_CASES`` (the CI profile runs ~1,500 by default; ``make fuzz`` runs >= 10,000).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from support.daemons import BrokerProcess

from primerl.client.channel import create_channel
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, pack_batch
from primerl.client.weight_publisher import WeightPublisher
from primerl.proto import framing
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc, data_pb2
from primerl.runtime.wire_security import apply_run_token

TOKEN = "fuzz-token"
CI_CASES = 1500
NUM_CASES = int(os.environ.get("PRIMERL_FUZZ_CASES", CI_CASES))
NUM_BATCHES = max(3, min(12, NUM_CASES // 500))
TARGETS = ("rollout", "weight", "grpc")
BIG = st.one_of(st.integers(0, 16), st.integers(0, 2**64 - 1), st.sampled_from([2**32 - 1, 2**63, 2**64 - 1]))
ENUM = st.one_of(st.integers(0, 8), st.integers(0, 2**31 - 1))
TEXT = st.one_of(st.text(max_size=20), st.text(max_size=300))


# ------------------------------------------------------------------------------------------ strategies
@st.composite
def json_values(draw, depth: int = 0):
    """JSON-ish values that stress a safetensors header parser."""
    choices = ["int", "bigint", "str", "float", "null", "bool"] + (["list", "obj"] if depth < 4 else []) + ["deep"]
    kind = draw(st.sampled_from(choices))
    if kind == "int":
        return str(draw(st.integers(-(2**70), 2**70)))
    if kind == "bigint":
        return "9" * draw(st.integers(19, 6000))
    if kind == "str":
        return json.dumps(draw(st.sampled_from(list(tf.DTYPES)) | st.text(max_size=10)))
    if kind == "float":
        return draw(st.sampled_from(["1.5", "1e400", "NaN", "-Infinity", "-0.0"]))
    if kind == "null":
        return "null"
    if kind == "bool":
        return draw(st.sampled_from(["true", "false"]))
    if kind == "deep":
        levels = draw(st.integers(5, 3000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a": ', "}")]))
        return opener * levels + "1" + closer * levels
    items = [draw(json_values(depth + 1)) for _ in range(draw(st.integers(0, 3)))]
    if kind == "list":
        return "[" + ", ".join(items) + "]"
    keys = draw(
        st.lists(
            st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "x"]),
            max_size=len(items),
            min_size=len(items),
        )
    )
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in zip(keys, items)) + "}"


@st.composite
def safetensors_frames(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "entry", "whole", "length"]))
    if kind == "valid":
        data, _ = tf.encode_tensors({"t": np.zeros(draw(st.integers(0, 8)), np.float32)})
        return data
    if kind == "length":
        return struct.pack("<Q", draw(BIG)) + draw(st.binary(max_size=64))
    if kind == "entry":
        entry = {"dtype": draw(json_values(2)), "shape": draw(json_values(2)), "data_offsets": draw(json_values(2))}
        header = (
            "{"
            + json.dumps(draw(st.sampled_from(["t", "__metadata__"])))
            + ": {"
            + ", ".join(f"{json.dumps(k)}: {v}" for k, v in entry.items())
            + "}}"
        )
    else:
        header = draw(json_values())
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + draw(st.binary(max_size=64))


def _specs() -> st.SearchStrategy:
    return st.lists(
        st.builds(
            common_pb2.TensorSpec,
            name=st.sampled_from(["t", "u", ""]),
            dtype=st.sampled_from(["F32", "BF16", "X", ""]),
            shape=st.lists(st.integers(0, 2**63 - 1), max_size=4),
        ),
        max_size=3,
    )


HEADERS = {
    data_pb2.ROLLOUT_BATCH: st.builds(
        data_pb2.RolloutBatchHeader,
        batch_id=TEXT,
        step=BIG,
        rank=st.integers(0, 2**32 - 1),
        micro_batch_index=st.integers(0, 2**32 - 1),
        num_micro_batches=st.integers(0, 2**32 - 1),
        tensors=_specs(),
    ),
    data_pb2.ROLLOUT_REQUEST: st.builds(
        data_pb2.RolloutRequest, step=BIG, rank=st.integers(0, 2**32 - 1), credits=st.integers(0, 2**32 - 1)
    ),
    data_pb2.HELLO: st.builds(data_pb2.Hello, worker_id=TEXT, role=ENUM, rank=st.integers(0, 2**32 - 1)),
    data_pb2.WEIGHT_UPDATE: st.builds(
        data_pb2.WeightUpdateHeader,
        policy_version=BIG,
        kind=ENUM,
        tensors=_specs(),
        digest=st.one_of(st.just(""), st.text(max_size=70)),
        payload_bytes=BIG,
    ),
    data_pb2.WEIGHT_ACK: st.builds(
        data_pb2.WeightAck,
        policy_version=BIG,
        worker_id=TEXT,
        applied=st.booleans(),
        error=st.builds(common_pb2.ErrorDetail, code=ENUM, message=TEXT),
    ),
    data_pb2.ERROR: st.builds(
        data_pb2.ErrorReply, error=st.builds(common_pb2.ErrorDetail, code=ENUM, message=TEXT), refused_type=ENUM
    ),
    data_pb2.ROLLOUT_ACK: st.builds(data_pb2.RolloutAck, batch_id=TEXT, step=BIG),
    data_pb2.ROLLOUT_STEP_DONE: st.builds(data_pb2.RolloutStepDone, step=BIG, rank=st.integers(0, 2**32 - 1)),
}


@st.composite
def signed_messages(draw) -> list[bytes]:
    """Messages with a valid CRC and (mostly) the right token, so they reach the parsers behind decode."""
    message_type = draw(st.sampled_from(sorted(HEADERS)))
    header = draw(HEADERS[message_type])
    header_bytes = header.SerializeToString()
    if draw(st.integers(0, 9)) == 0:
        header_bytes = draw(st.binary(max_size=64))
    payload = draw(st.lists(st.one_of(safetensors_frames(), st.binary(max_size=64)), max_size=3))
    if message_type in (data_pb2.ROLLOUT_BATCH, data_pb2.WEIGHT_UPDATE) and draw(st.booleans()):
        payload = [draw(safetensors_frames())]
    chunk = None
    if draw(st.integers(0, 3)) == 0:
        chunk = data_pb2.Chunk(
            transfer_id=draw(st.sampled_from(["", "t1", "t2"])),
            index=draw(st.integers(0, 5)),
            count=draw(st.integers(0, 6)),
            total_bytes=draw(BIG),
        )
    token = draw(st.sampled_from([TOKEN] * 8 + ["", "wrong"]))
    frames = framing.encode_raw(
        message_type,
        header_bytes,
        payload,
        auth_token=token,
        chunk=chunk,
        sender=draw(st.sampled_from(["fuzz", "trainer", ""])),
    )
    return [bytes(memoryview(f)) for f in frames]


@st.composite
def raw_messages(draw) -> list[bytes]:
    frames = [bytearray(f) for f in draw(signed_messages())]
    kind = draw(st.sampled_from(["random", "flip", "truncate", "retype"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=6))
    if kind == "truncate":
        frames = frames[: draw(st.integers(1, len(frames)))]
    elif kind == "retype":
        frames[1] = bytearray([draw(st.integers(0, 255))])
    else:
        index = draw(st.integers(0, len(frames) - 1))
        if frames[index]:
            frames[index][draw(st.integers(0, len(frames[index]) - 1))] ^= draw(st.integers(1, 255))
    return [bytes(f) for f in frames] or [b""]


ZMQ_MESSAGES = st.one_of(signed_messages(), signed_messages(), raw_messages())

BROKER_METHODS = [m.name for m in control_pb2.DESCRIPTOR.services_by_name["Broker"].methods]
GRPC_METHODS = [f"/primerl.v1.Broker/{name}" for name in BROKER_METHODS] + [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/primerl.v1.Broker/Nope",
]
UNARY_STREAM = {"/primerl.v1.Broker/WatchRunStatus", "/grpc.health.v1.Health/Watch"}
STREAM_STREAM = {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}
VALID_REQUESTS = [
    control_pb2.RegisterRequest(role=common_pb2.ROLE_INFERENCE, name="fuzz", capabilities={"a": "b"}),
    control_pb2.HeartbeatRequest(worker_id="x", trainer_step=3, recent_errors=["e"]),
    control_pb2.ReportMetricsRequest(worker_id="x", step=1, metrics={"a": 1.0}),
    control_pb2.CommitStepRequest(worker_id="x", step=5),
    control_pb2.WatchRunStatusRequest(min_interval_ms=10),
]


@st.composite
def grpc_calls(draw) -> tuple[str, bytes, str | None]:
    method = draw(st.sampled_from(GRPC_METHODS))
    kind = draw(st.sampled_from(["random", "mutated", "valid"]))
    if kind == "random":
        body = draw(st.binary(max_size=300))
    else:
        body = bytearray(draw(st.sampled_from(VALID_REQUESTS)).SerializeToString())
        if kind == "mutated" and body:
            for _ in range(draw(st.integers(1, 3))):
                body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        body = bytes(body)
    token = draw(st.sampled_from([TOKEN, TOKEN, TOKEN, None, "wrong"]))
    return method, body, token


# ------------------------------------------------------------------------------------------ the broker
def start_broker(tmp_path: Path) -> BrokerProcess:
    """A ``primerl-broker`` child with a run token and small limits, so hostile sizes are cheap to reach."""
    broker = BrokerProcess(
        tmp_path,
        tmp_path / "spool",
        "--run-token",
        TOKEN,
        "--max-queue-batches",
        "100000",
        "--max-message-bytes",
        str(1 << 20),
        "--max-transfer-bytes",
        str(64 << 20),
        "--prometheus.enabled",
        "false",
    )
    time.sleep(0.1)
    return broker


def _raw_grpc(channels: dict, method: str, body: bytes, token: str | None) -> None:
    channel = channels[token]
    identity = lambda b: b  # noqa: E731
    try:
        if method in UNARY_STREAM:
            call = channel.unary_stream(method, request_serializer=identity, response_deserializer=identity)(
                body, timeout=2
            )
            for _ in call:
                break
            call.cancel()
        elif method in STREAM_STREAM:
            call = channel.stream_stream(method, request_serializer=identity, response_deserializer=identity)(
                iter([body]), timeout=2
            )
            for _ in call:
                break
            call.cancel()
        else:
            channel.unary_unary(method, request_serializer=identity, response_deserializer=identity)(body, timeout=2)
    except grpc.RpcError as err:
        # Any status is fine except one that says the broker broke (INTERNAL) or did not answer in time.
        assert err.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, body[:40], err.details())


def _check_serving(broker: BrokerProcess, channels: dict, check: int) -> None:
    assert broker.process.poll() is None, (
        f"broker exited with {broker.process.returncode}: {broker.log_path.read_text()[-3000:]}"
    )
    rollout = f"tcp://127.0.0.1:{broker.ports['rollout_port']}"
    tensors = {"input_ids": np.arange(32, dtype=np.int64) + check}
    rank = 100_000 + check
    with RolloutProducer(rollout, TOKEN, sender="legit") as producer:
        assert producer.send_batch(*pack_batch(1, rank, 0, 1, tensors, batch_id=f"legit-{check}"), timeout_s=20).durable
    with RolloutConsumer(rollout, TOKEN, worker_id=f"legit-{check}", rank=rank) as consumer:
        ((_, received),) = consumer.fetch_step(1, timeout_s=20)
        np.testing.assert_array_equal(received["input_ids"], tensors["input_ids"])
    stub = control_pb2_grpc.BrokerStub(channels[TOKEN])
    status = stub.GetRunStatus(control_pb2.GetRunStatusRequest(), timeout=10)
    weights = f"tcp://127.0.0.1:{broker.ports['weight_port']}"
    payload, specs = tf.encode_tensors({"w": np.full((16, 16), float(check), np.float32)})
    header = data_pb2.WeightUpdateHeader(
        policy_version=status.latest_policy_version + 1,
        kind=data_pb2.WEIGHT_UPDATE_KIND_FULL,
        tensors=specs,
        payload_bytes=len(payload),
        digest=hashlib.sha256(payload).hexdigest(),
    )
    with WeightPublisher(weights, TOKEN, f"legit-trainer-{check}", 512) as publisher:  # chunked
        assert publisher.publish(header, payload, timeout_s=20).applied


def _fuzz_socket(socket: zmq.Socket, target: str, counts: dict, num_cases: int, seed_value: int) -> None:
    @seed(seed_value)
    @settings(max_examples=num_cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message=ZMQ_MESSAGES)
    def fuzz(message):
        counts[target] += 1
        socket.send_multipart(message)
        while socket.poll(0):
            socket.recv_multipart()

    fuzz()


@pytest.mark.slow
def test_broker_process_survives_fuzzing_of_every_socket_and_method(tmp_path):
    broker = start_broker(tmp_path)
    context = zmq.Context()
    channels = {
        token: create_channel(f"127.0.0.1:{broker.ports['grpc_port']}", run_token=token)
        for token in (TOKEN, None, "wrong")
    }
    sockets = {}
    for name in ("rollout", "weight"):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, 5000)
        apply_run_token(socket, TOKEN, "fuzz")  # past the handshake: the fuzz is of what the broker reads after it
        socket.connect(f"tcp://127.0.0.1:{broker.ports[name + '_port']}")
        sockets[name] = socket
    counts = dict.fromkeys(TARGETS, 0)
    per_batch = -(-NUM_CASES // (NUM_BATCHES * len(TARGETS)))
    try:
        for batch in range(NUM_BATCHES):
            for target in ("rollout", "weight"):
                _fuzz_socket(sockets[target], target, counts, per_batch, batch * 10 + len(target))

            @seed(batch)
            @settings(max_examples=per_batch, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(call=grpc_calls())
            def fuzz_grpc(call):
                counts["grpc"] += 1
                _raw_grpc(channels, *call)

            fuzz_grpc()
            _check_serving(broker, channels, batch)
        total = sum(counts.values())
        print(f"fuzz cases: {total} {counts}; batches: {NUM_BATCHES}")
        assert total >= NUM_CASES * 0.9, counts
        log = broker.log_path.read_text()
        assert log.count("Traceback") <= 3 * len(TARGETS), "a traceback per bad request is not allowed"
    finally:
        for channel in channels.values():
            channel.close()
        context.destroy(linger=0)
        code = broker.stop()
    assert code == 0, f"broker exit status {code}: {broker.log_path.read_text()[-3000:]}"
