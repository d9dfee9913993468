"""The broker's gRPC control plane with a run token (every call, through the client's channel) and with TLS."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support.control_plane import TOKEN, client_for, running_broker, start_broker

from primerl.cli import status as status_cli
from primerl.client.broker_errors import BrokerUnavailable
from primerl.client.channel import create_channel
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc


# ------------------------------------------------------------------------------------------------ auth
@pytest.fixture
def auth_broker():
    with running_broker(run_token=TOKEN) as broker:
        yield broker


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
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
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
