"""The broker's gRPC control plane over loopback (port 0): RPCs, watch, liveness and expiry, the worker client's
re-registration, health and reflection. Auth and TLS: `test_broker_control_auth.py`; `primerl status`:
`test_status_cli.py`."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support.control_plane import INTERVAL_S, LIVENESS, client_for, running_broker, start_broker
from support.probes import wait_until

from primerl.broker.control_service import BrokerServicer, create_grpc_server
from primerl.broker.registry import WorkerRegistry
from primerl.client.broker_errors import BrokerError, BrokerUnavailable
from primerl.client.control import ControlClient
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc
from primerl.runtime.config_common import BrokerClientConfig


@pytest.fixture
def broker():
    with running_broker() as broker:
        yield broker


@pytest.fixture
def stub(broker):
    channel = grpc.insecure_channel(broker.address)
    try:
        yield control_pb2_grpc.BrokerStub(channel)
    finally:
        channel.close()


# ----------------------------------------------------------------------------------------------- RPCs
def test_register_heartbeat_status_and_list(broker, stub):
    response = stub.Register(
        control_pb2.RegisterRequest(role=common_pb2.ROLE_INFERENCE, name="infer-0", address="http://x:1"), timeout=5
    )
    assert response.run_id == "test-run" and response.heartbeat_interval_ms == 100 and response.liveness == LIVENESS
    trainer = stub.Register(control_pb2.RegisterRequest(role=common_pb2.ROLE_TRAINER, name="trainer-0"), timeout=5)
    beat = stub.Heartbeat(control_pb2.HeartbeatRequest(worker_id=trainer.worker_id, trainer_step=4), timeout=5)
    assert beat.last_committed_step == 0 and not beat.shutdown_requested

    status = stub.GetRunStatus(control_pb2.GetRunStatusRequest(), timeout=5)
    assert status.trainer_step == 4 and status.latest_policy_version == 2 and status.max_steps == 20
    assert [q.name for q in status.queues] == ["rollouts"]
    assert {w.name for w in status.workers} == {"infer-0", "trainer-0"}

    listed = stub.ListWorkers(control_pb2.ListWorkersRequest(role=common_pb2.ROLE_INFERENCE), timeout=5)
    assert [w.address for w in listed.workers] == ["http://x:1"]

    commit = stub.CommitStep(control_pb2.CommitStepRequest(worker_id=trainer.worker_id, step=3), timeout=5)
    assert (commit.last_committed_step, commit.num_batches_released) == (3, 1) and broker.released == [3]


@pytest.mark.parametrize(
    "call, code",
    [
        (lambda s: s.Register(control_pb2.RegisterRequest(name="x"), timeout=5), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda s: s.Heartbeat(control_pb2.HeartbeatRequest(worker_id="nope"), timeout=5), grpc.StatusCode.NOT_FOUND),
        (lambda s: s.Deregister(control_pb2.DeregisterRequest(worker_id="nope"), timeout=5), grpc.StatusCode.NOT_FOUND),
        (lambda s: s.CommitStep(control_pb2.CommitStepRequest(worker_id="nope"), timeout=5), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_refusals_carry_status_codes_and_messages(stub, call, code):
    with pytest.raises(grpc.RpcError) as info:
        call(stub)
    assert info.value.code() == code and info.value.details()


def test_client_errors_are_typed(broker):
    with client_for(broker, "trainer-0") as client, client_for(broker, "trainer-0", outage_s=1.0) as twin:
        client.register()
        client.start_heartbeats()  # keeps the name held: the twin waits out its outage budget, then gives up
        started_s = time.monotonic()
        with pytest.raises(BrokerError, match="already registered") as info:
            twin.register()
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert 1.0 <= time.monotonic() - started_s < 5.0
        with pytest.raises(BrokerError) as info:
            client.report_metrics(1, {"train/loss": float("nan")})
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        client.report_metrics(1, {"train/loss": 0.5})
        assert client.commit_step(2).last_committed_step == 2
        # Committing an already committed step again (a retry) succeeds and releases nothing.
        for step in (2, 1):
            again = client.commit_step(step)
            assert (again.last_committed_step, again.num_batches_released) == (2, 0)
        assert client.get_run_status().last_metrics["train/loss"] == 0.5
        assert [w.name for w in client.list_workers("trainer")] == ["trainer-0"]
    assert broker.registry.list_workers() == []  # the context manager deregistered it


def test_a_register_answered_past_its_deadline_is_taken_back_on_the_retry():
    """The broker takes a Register but answers after the client's deadline (its lock held here, as a busy broker
    would): the client's retry gets the same registration back (its instance_id), not ALREADY_EXISTS until the
    first one expires, and the broker holds one record of the name."""
    with running_broker(interval_s=2.0) as broker:  # a name held for liveness x 2 s = 6 s
        client = ControlClient(
            BrokerClientConfig(address=broker.address, connect_timeout_s=5, outage_s=30.0), "trainer", "trainer-0"
        )
        client.rpc_timeout_s = 0.3
        client.wait_ready()
        broker.registry._lock.acquire()
        try:
            registering = threading.Thread(target=client.register)
            started_s = time.monotonic()
            registering.start()
            time.sleep(0.6)  # the first call's deadline passed while the broker held it
        finally:
            broker.registry._lock.release()
        registering.join(timeout=10)
        assert not registering.is_alive() and client.worker_id is not None
        assert time.monotonic() - started_s < 5.0  # not the name's expiry (liveness x interval) nor outage_s
        [record] = broker.registry.list_workers(include_gone=True)
        assert (record.name, record.worker_id) == ("trainer-0", client.worker_id)
        client.close()


def test_client_retries_once_after_the_broker_forgot_it(broker):
    with client_for(broker, "trainer-0") as client:
        old_id = client.register().worker_id
        broker.registry.deregister(old_id)
        client.report_metrics(1, {"x": 1.0})  # NOT_FOUND -> register again -> retry
        assert client.worker_id != old_id and client.num_registrations == 2


# ---------------------------------------------------------------------------------------------- watch
def test_watch_streams_at_once_then_after_a_heartbeat(broker):
    with client_for(broker, "trainer-0") as client:
        worker_id = client.register().worker_id
        stream = client.watch_run_status(timeout_s=10)
        first = next(stream)
        assert [w.name for w in first.workers] == ["trainer-0"]
        beat_at = time.monotonic()
        threading.Timer(0.1, lambda: client.heartbeat({"trainer_step": 5})).start()
        for status in stream:
            if status.trainer_step == 5:
                break
        assert time.monotonic() - beat_at < 2.0
        stream.cancel()
        assert list(stream) == []
        assert worker_id


def test_watch_respects_min_interval(broker):
    with client_for(broker, "orch", "orchestrator") as client:
        client.register()
        stream = client.watch_run_status(min_interval_ms=300, timeout_s=10)
        next(stream)
        stop = threading.Event()

        def beat() -> None:
            step = 0
            while not stop.wait(0.02):
                step += 1
                client.heartbeat({"orchestrator_step": step})

        beater = threading.Thread(target=beat)
        beater.start()
        try:
            times = []
            for _ in range(3):
                next(stream)
                times.append(time.monotonic())
        finally:
            stop.set()
            beater.join(5)
            stream.cancel()
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(gap >= 0.2 for gap in gaps), gaps  # 0.3 s on the server; slack for delivery jitter


def test_watch_ends_promptly_when_the_server_stops():
    broker = start_broker()
    try:
        with client_for(broker, "client", "client") as client:
            stream = client.watch_run_status(timeout_s=10)
            next(stream)
            ended: list[float] = []

            def drain() -> None:
                try:
                    for _ in stream:
                        pass
                except BrokerError:
                    pass
                ended.append(time.monotonic())

            reader = threading.Thread(target=drain)
            reader.start()
            stopped_at = time.monotonic()
            broker.servicer.shutdown()
            reader.join(5)
            assert ended and ended[0] - stopped_at < 2.0
    finally:
        broker.stop()


# -------------------------------------------------------------------------------------------- liveness
def test_silent_worker_is_marked_lost_within_the_bound(broker, stub):
    stream = stub.WatchRunStatus(control_pb2.WatchRunStatusRequest(), timeout=10)
    next(stream)
    registered_at = time.monotonic()
    stub.Register(control_pb2.RegisterRequest(role=common_pb2.ROLE_INFERENCE, name="infer-0"), timeout=5)
    for status in stream:  # the monitor's expiry notifies watchers: no read is needed to notice
        if status.workers and status.workers[0].state == control_pb2.WORKER_STATE_LOST:
            break
    elapsed = time.monotonic() - registered_at
    stream.cancel()
    bound = LIVENESS * INTERVAL_S
    assert bound <= elapsed < bound + INTERVAL_S / 2 + 1.0  # the monitor checks every interval / 2; slack for load
    assert "infer-0 lost" in status.recent_errors[-1]
    assert stub.ListWorkers(control_pb2.ListWorkersRequest(), timeout=5).workers == []
    assert len(stub.ListWorkers(control_pb2.ListWorkersRequest(include_gone=True), timeout=5).workers) == 1


def test_heartbeating_client_stays_alive():
    broker = start_broker(liveness=10)  # 1 s of tolerance for a loaded test machine; heartbeats every 0.1 s
    try:
        with client_for(broker, "infer-0", "inference") as client:
            client.start_heartbeats(lambda: {"policy_version": 1, "num_inflight": 3})
            wait_until(lambda: client.last_heartbeat is not None, what="first heartbeat")
            version = broker.registry.version
            time.sleep(1.5)
            assert broker.registry.version >= version + 5  # it kept heartbeating, every interval
            [worker] = broker.registry.list_workers()
            assert worker.state == control_pb2.WORKER_STATE_ALIVE and worker.policy_version == 1
            assert worker.num_inflight == 3 and client.num_registrations == 1
    finally:
        broker.stop()


def test_watchers_are_bounded():
    broker = start_broker(max_concurrent_watches=1)
    try:
        with client_for(broker, "c", "client") as client:
            first = client.watch_run_status(timeout_s=5)
            next(first)
            with pytest.raises(BrokerError) as info:
                next(client.watch_run_status(timeout_s=5))
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
            wait_until(lambda: _can_watch(client), what="the slot to be released")
    finally:
        broker.stop()


def _can_watch(client: ControlClient) -> bool:
    stream = client.watch_run_status(timeout_s=5)
    try:
        next(stream)
        return True
    except BrokerError:
        return False
    finally:
        stream.cancel()


def test_client_reregisters_after_the_broker_restarts_on_the_same_port():
    first = start_broker(liveness=10)
    port = first.port
    client = ControlClient(BrokerClientConfig(address=first.address), "trainer", "trainer-0")
    second = None
    try:
        client.start_heartbeats(lambda: {"trainer_step": 7})
        wait_until(lambda: client.last_heartbeat is not None, what="first heartbeat")
        first.stop()
        time.sleep(0.3)  # the client now meets an unreachable broker and backs off
        second = start_broker(port, liveness=10)
        wait_until(lambda: client.num_registrations == 2, timeout_s=10, what="re-registration")
        [worker] = second.registry.list_workers()
        assert worker.name == "trainer-0" and worker.worker_id == client.worker_id
        beats = second.registry.version
        wait_until(lambda: second.registry.version > beats + 2, what="heartbeats to the new broker")
        assert second.registry.run_status().trainer_step == 7
    finally:
        client.close()
        if second is not None:
            second.stop()


def test_a_stopping_broker_never_asks_workers_to_shut_down():
    """A broker stopping for a restart (SIGTERM, service stop) answers UNAVAILABLE during its grace window, so
    that workers retry and ride through the restart; only an explicit end of run sets ``shutdown_requested``."""
    broker = start_broker()
    client = client_for(broker, "infer-0", role="inference")
    channel = grpc.insecure_channel(broker.address)
    try:
        client.register()
        assert not client.heartbeat().shutdown_requested
        broker.servicer.shutdown()  # what BrokerService.stop does first; the server still answers meanwhile
        with pytest.raises(BrokerUnavailable):
            client.heartbeat()
        stub = control_pb2_grpc.BrokerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(control_pb2.RegisterRequest(role=common_pb2.ROLE_INFERENCE, name="infer-1"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not client.shutdown_requested.is_set()
    finally:
        channel.close()
        client.close()
        broker.stop()


# ------------------------------------------------------------------------------------ health, reflection
def test_health_serving_then_not_serving_on_shutdown():
    broker = start_broker()
    channel = grpc.insecure_channel(broker.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "primerl.v1.Broker"):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        broker.servicer.shutdown()
        response = health.Check(health_pb2.HealthCheckRequest(service="primerl.v1.Broker"), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        channel.close()
        broker.stop()


def test_reflection_lists_the_service(broker):
    channel = grpc.insecure_channel(broker.address)
    try:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"primerl.v1.Broker", "grpc.health.v1.Health"} <= services
    finally:
        channel.close()


def test_second_server_on_a_taken_port_fails_clearly(broker):
    registry = WorkerRegistry("other", 1.0, 3)
    with pytest.raises(OSError, match="cannot bind"):
        create_grpc_server(BrokerServicer(registry), "127.0.0.1", broker.port)
