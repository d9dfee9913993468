"""Control-plane bounds (issue 13): auth before deserialization, total request parsing, metric names
bounded, status always under a default client's 4 MiB, commits and requests inside the run's window."""

from __future__ import annotations

import grpc
import pytest

from primerl.broker.run_status import MAX_STATUS_BYTES
from primerl.broker.service import BrokerService
from primerl.broker.worker_record import MAX_METRIC_NAMES, MAX_METRIC_NAMES_PER_WORKER
from primerl.client.channel import create_channel
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc

TOKEN = "bounds-token"
GARBAGE = [b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\x80" * 20, b"\x12\x05abc"]
METHODS = [f"/primerl.v1.Broker/{m.name}" for m in control_pb2.DESCRIPTOR.services_by_name["Broker"].methods]
STREAMING = {"/primerl.v1.Broker/WatchRunStatus"}


@pytest.fixture
def broker(make_broker) -> tuple[BrokerService, str]:
    harness = make_broker(run_token=TOKEN, run_id="bounds")
    with grpc.insecure_channel(harness.grpc_address) as probe:  # the server answers before the first checked call
        grpc.channel_ready_future(probe).result(timeout=30)
    return harness.service, harness.grpc_address


def _raw_call(channel: grpc.Channel, method: str, body: bytes) -> grpc.StatusCode:
    identity = lambda b: b  # noqa: E731 - raw bytes on the wire
    try:
        if method in STREAMING:
            call = channel.unary_stream(method, request_serializer=identity, response_deserializer=identity)
            for _ in call(body, timeout=5):
                break
        else:
            channel.unary_unary(method, request_serializer=identity, response_deserializer=identity)(body, timeout=5)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("token", [None, "wrong"])
def test_garbage_with_a_bad_token_is_unauthenticated_for_every_method(broker, token):
    _, address = broker
    channel = create_channel(address, run_token=token)
    try:
        for method in METHODS + ["/primerl.v1.Broker/NoSuchMethod"]:
            for body in GARBAGE:
                code = _raw_call(channel, method, body)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, body, code)
    finally:
        channel.close()


def test_garbage_with_the_token_is_invalid_argument_not_internal(broker):
    _, address = broker
    channel = create_channel(address, run_token=TOKEN)
    try:
        for method in METHODS:
            codes = {_raw_call(channel, method, body) for body in GARBAGE}
            assert grpc.StatusCode.INTERNAL not in codes, (method, codes)
            assert grpc.StatusCode.INVALID_ARGUMENT in codes, (method, codes)
    finally:
        channel.close()


@pytest.fixture
def stub(broker):
    """A stub of the broker's control plane that authenticates with the run token."""
    _, address = broker
    channel = create_channel(address, run_token=TOKEN)
    try:
        yield control_pb2_grpc.BrokerStub(channel)
    finally:
        channel.close()


def test_metric_names_are_bounded_and_status_stays_readable(stub):
    refused = 0
    for index in range(8):
        worker_id = stub.Register(
            control_pb2.RegisterRequest(role=common_pb2.ROLE_ORCHESTRATOR, name=f"w{index}"), timeout=5
        ).worker_id
        for batch in range(5):
            metrics = {f"m{index}/{batch}/{i:04d}/" + "x" * 100: 1.0 for i in range(1024)}
            try:
                stub.ReportMetrics(
                    control_pb2.ReportMetricsRequest(worker_id=worker_id, step=1, metrics=metrics), timeout=5
                )
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "metric names" in err.details()
                refused += 1
    assert refused > 0
    status = stub.GetRunStatus(control_pb2.GetRunStatusRequest(), timeout=5)  # default 4 MiB client limit
    assert len(status.last_metrics) <= MAX_METRIC_NAMES
    assert status.ByteSize() <= MAX_STATUS_BYTES
    assert MAX_METRIC_NAMES_PER_WORKER < 1024 * 5


def test_commit_far_beyond_the_run_is_refused(stub):
    worker_id = stub.Register(control_pb2.RegisterRequest(role=common_pb2.ROLE_TRAINER, name="t"), timeout=5).worker_id
    with pytest.raises(grpc.RpcError) as info:
        stub.CommitStep(control_pb2.CommitStepRequest(worker_id=worker_id, step=2**64 - 1), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "max_step_lead" in info.value.details()
    assert (
        stub.CommitStep(control_pb2.CommitStepRequest(worker_id=worker_id, step=3), timeout=5).last_committed_step == 3
    )


def test_rollout_request_far_beyond_the_run_is_refused(tmp_path):
    from primerl.broker.rollout_queue import RolloutQueue
    from primerl.broker.rollout_results import Refused
    from primerl.broker.spool import RolloutSpool

    queue = RolloutQueue(RolloutSpool(tmp_path / "spool"), 8, 1 << 30)
    try:
        result = queue.request(b"s", 2**64 - 1, 0, 4)
        assert isinstance(result, Refused) and result.code == common_pb2.ERROR_CODE_OUT_OF_ORDER
        assert queue.status().frontier_step in (None, -1)
        assert not isinstance(queue.request(b"s", 5, 0, 4), Refused)
    finally:
        queue.close()
