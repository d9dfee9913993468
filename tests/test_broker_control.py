"""The broker's gRPC control plane over loopback (port 0): RPCs, watch, expiry, health, reflection, auth, TLS,
the worker client's re-registration, and `primerl status`."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from primerl.client.channel import create_channel
from primerl.client.control import BrokerError, BrokerUnavailable, ControlClient
from primerl.broker.control_service import BrokerServicer, HeartbeatMonitor, create_grpc_server
from primerl.broker.registry import WorkerRegistry
from primerl.broker.run_status import DataPlaneStatus, QueueDepth
from primerl.cli import status as status_cli
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc
from primerl.runtime.config_common import BrokerClientConfig
from primerl.runtime.log_setup import configure_logging

REPO_ROOT = Path(__file__).resolve().parents[1]
INTERVAL_S = 0.1
LIVENESS = 3
TOKEN = "s3cret-token"


@pytest.fixture(autouse=True, scope="module")
def _logging_to_stderr():
    """Broker and client log lines go to stderr, so that `primerl status --json` output stays parseable."""
    configure_logging("test", level="info")


@dataclass
class Broker:
    registry: WorkerRegistry
    servicer: BrokerServicer
    server: grpc.Server
    monitor: HeartbeatMonitor
    port: int
    released: list[int]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.servicer.shutdown()
        self.monitor.stop()
        self.server.stop(0.5).wait(5)


def start_broker(
    port: int = 0,
    *,
    run_token: str | None = None,
    tls: tuple[Path, Path] | None = None,
    interval_s: float = INTERVAL_S,
    liveness: int = LIVENESS,
    max_concurrent_watches: int = 8,
) -> Broker:
    released: list[int] = []

    def on_commit(step: int) -> int:
        released.append(step)
        return 1

    registry = WorkerRegistry("test-run", interval_s, liveness, max_steps=20, on_commit=on_commit)
    registry.policy.restore_latest(2)  # the weight fan-out's latest version (as a restarted broker restores it)
    servicer = BrokerServicer(
        registry,
        lambda: DataPlaneStatus(queues=[QueueDepth("rollouts", 1, 4096, 8, 1 << 20)]),
        watch_poll_s=0.2,
        max_concurrent_watches=max_concurrent_watches,
    )
    cert, key = tls if tls else (None, None)
    server, bound = create_grpc_server(
        servicer, "127.0.0.1", port, run_token=run_token, tls_cert_path=cert, tls_key_path=key
    )
    monitor = HeartbeatMonitor(registry)
    server.start()
    monitor.start()
    return Broker(registry, servicer, server, monitor, bound, released)


@pytest.fixture
def broker():
    broker = start_broker()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def stub(broker):
    channel = grpc.insecure_channel(broker.address)
    try:
        yield control_pb2_grpc.BrokerStub(channel)
    finally:
        channel.close()


def client_for(broker: Broker, name: str, role="trainer", **config) -> ControlClient:
    return ControlClient(BrokerClientConfig(address=broker.address, connect_timeout_s=5, **config), role, name)


def wait_until(predicate, timeout_s: float = 5.0, what: str = "condition") -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


# ------------------------------------------------------------------------------------------------ auth
@pytest.fixture
def auth_broker():
    broker = start_broker(run_token=TOKEN)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_calls_without_the_right_token_are_unauthenticated(auth_broker, token):
    channel = create_channel(auth_broker.address, run_token=token)
    try:
        stub = control_pb2_grpc.BrokerStub(channel)
        for call in (
            lambda: stub.GetRunStatus(control_pb2.GetRunStatusRequest(), timeout=5),
            lambda: stub.Register(control_pb2.RegisterRequest(role=common_pb2.ROLE_TRAINER, name="t"), timeout=5),
            lambda: next(stub.WatchRunStatus(control_pb2.WatchRunStatusRequest(), timeout=5)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ("missing" if token is None else "wrong") in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health stays open for probes
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
    assert auth_broker.registry.list_workers() == []


def test_calls_with_the_token_succeed(auth_broker):
    with client_for(auth_broker, "trainer-0", run_token=TOKEN) as client:
        client.register()
        client.heartbeat({"trainer_step": 1})
        assert client.get_run_status().trainer_step == 1
        assert next(client.watch_run_status(timeout_s=5)).run_id == "test-run"
    channel = create_channel(auth_broker.address, run_token=TOKEN)
    try:
        assert "primerl.v1.Broker" in set(ProtoReflectionDescriptorDatabase(channel).get_services())
    finally:
        channel.close()


# ------------------------------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "primerl-test-broker")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    cert_path, key_path = folder / "broker.crt", folder / "broker.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_tls_works_and_a_plaintext_client_fails(tls_files):
    cert_path, _ = tls_files
    broker = start_broker(tls=tls_files, run_token=TOKEN)
    try:
        with client_for(broker, "infer-0", "inference", tls_ca_path=cert_path, run_token=TOKEN) as client:
            client.wait_ready(5)
            assert client.register().run_id == "test-run"
            assert status_cli.main(["--broker", broker.address, "--tls-ca", str(cert_path), "--token", TOKEN]) == 0
        plain = client_for(broker, "infer-1", "inference", run_token=TOKEN, outage_s=1.0)
        try:
            with pytest.raises(BrokerUnavailable, match="within 1 s"):
                plain.wait_ready(1)
            with pytest.raises(BrokerUnavailable, match="broker.outage_s"):
                plain.register()
        finally:
            plain.close()
    finally:
        broker.stop()


# ------------------------------------------------------------------------------------------ primerl status
@pytest.fixture
def calm_broker():
    """Workers registered by `_populate` never heartbeat: a long interval keeps them alive during a test."""
    broker = start_broker(interval_s=30.0)
    try:
        yield broker
    finally:
        broker.stop()


def _populate(broker: Broker) -> None:
    registry = broker.registry
    trainer = registry.register(control_pb2.RegisterRequest(
        role=common_pb2.ROLE_TRAINER, name="trainer-0", capabilities={"metrics_url": "http://127.0.0.1:9311/metrics"},
    )).worker_id
    infer = registry.register(
        control_pb2.RegisterRequest(role=common_pb2.ROLE_INFERENCE, name="infer-0", address="http://127.0.0.1:8000")
    ).worker_id
    registry.heartbeat(control_pb2.HeartbeatRequest(worker_id=trainer, trainer_step=3))
    registry.policy.hello(infer, 2, 0)  # the weight fan-out hears infer-0 say it holds v2
    registry.report_metrics(trainer, 3, {"train/loss": 0.25})
    registry.record_error("rollout-plane", "bad digest from trainer-0")


def test_status_cli_table_and_json(calm_broker, capsys):
    _populate(calm_broker)
    assert status_cli.main(["--broker", calm_broker.address]) == 0
    table = capsys.readouterr().out
    for text in ("run test-run", "trainer step 3 (committed 0) / 20", "policy version 2", "rollouts",
                 "trainer-0", "infer-0", "http://127.0.0.1:8000", "policy v2", "alive", "train/loss",
                 "rollout-plane: bad digest", "METRICS", "http://127.0.0.1:9311/metrics"):
        assert text in table, f"{text!r} missing from:\n{table}"

    assert status_cli.main(["--broker", calm_broker.address, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run_id"] == "test-run" and int(data["trainer_step"]) == 3
    assert {w["name"] for w in data["workers"]} == {"trainer-0", "infer-0"}


def test_status_cli_watch_json_lines(calm_broker, capsys):
    _populate(calm_broker)
    # Ctrl-C arrives as KeyboardInterrupt from the stream; simulate it after the first update.
    original = status_cli._show
    shown: list[int] = []

    def show_then_interrupt(*args, **kwargs):
        original(*args, **kwargs)
        shown.append(1)
        raise KeyboardInterrupt

    status_cli._show = show_then_interrupt
    try:
        assert status_cli.main(["--broker", calm_broker.address, "--json", "--watch"]) == 0
    finally:
        status_cli._show = original
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["run_id"] == "test-run"


def test_status_subprocess_json(calm_broker):
    _populate(calm_broker)
    result = subprocess.run(
        [sys.executable, "-m", "primerl", "status", "--broker", calm_broker.address, "--json"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["run_id"] == "test-run"


def test_status_unreachable_broker_exits_1_with_a_message(capsys):
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert status_cli.main(["--broker", address, "--timeout-s", "0.5"]) == 1
    assert time.monotonic() - started < 5
    captured = capsys.readouterr()
    assert f"cannot reach the broker at {address}" in captured.err and "Traceback" not in captured.err


def test_status_wrong_token_exits_1_with_a_hint(auth_broker, capsys, monkeypatch):
    monkeypatch.delenv("PRIMERL_RUN_TOKEN", raising=False)
    assert status_cli.main(["--broker", auth_broker.address]) == 1
    assert "--token" in capsys.readouterr().err
    monkeypatch.setenv("PRIMERL_RUN_TOKEN", TOKEN)
    assert status_cli.main(["--broker", auth_broker.address, "--json"]) == 0


def test_status_bad_address_exits_2(capsys):
    assert status_cli.main(["--broker", "no-port"]) == 2
    assert "host:port" in capsys.readouterr().err
