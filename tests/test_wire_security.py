"""The encrypted, authenticated wire: a real broker on loopback with mutual TLS on gRPC and CURVE on both ZeroMQ
planes, credentials made by `primerl certs` (``primerl.cli.certs``). A client without the right credentials
(no client certificate, one from another CA; no CURVE keys, a key the broker does not know, a wrong broker key)
cannot register, read status (`primerl status` too), push a rollout batch, fetch one, push weights or fetch
them; with them, all of it works. Every wait is bounded: a refused ZeroMQ peer never connects."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq.auth
from cryptography import x509
from support.broker import BrokerHarness
from support.weight_plane import make_update

from primerl.cli.certs import CertPaths, CertsError, config_lines, make_certs, parse_clients
from primerl.client.broker_errors import BrokerError
from primerl.client.control import ControlClient
from primerl.client.outage import BrokerOutageExceeded
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, RolloutRefused, pack_batch
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightPlaneError, WeightSubscriber
from primerl.configs.broker import BrokerConfig
from primerl.proto.v1 import common_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.runtime.config_common import BrokerClientConfig
from primerl.runtime.wire_security import CurveClient
from primerl.supervisor.run_file import RunFile, write_run_file

TOKEN = "wire-secret"
REFUSED_S = 2.0  # how long a refused client tries before its (expected) timeout
OK_S = 20.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertPaths:
    return make_certs(
        tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"], ("trainer", "orchestrator", "inference", "status")
    )


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory) -> CertPaths:
    """Credentials of another run: another CA, CURVE keys the broker does not know."""
    return make_certs(tmp_path_factory.mktemp("other"), ["127.0.0.1"], ("trainer",))


@pytest.fixture(scope="module")
def broker(certs, tmp_path_factory):
    harness = BrokerHarness(tmp_path_factory.mktemp("spool"), run_token=TOKEN, **certs.broker_settings())
    yield harness
    harness.stop()


def client_config(broker: BrokerHarness, settings: dict, **more) -> BrokerClientConfig:
    return BrokerClientConfig(
        address=broker.grpc_address, run_token=TOKEN, connect_timeout_s=REFUSED_S, **{**settings, **more}
    )


def control(broker, settings, name: str, role: str = "trainer") -> ControlClient:
    client = ControlClient(client_config(broker, settings), role, name, rpc_timeout_s=REFUSED_S)
    client.outage_s = REFUSED_S
    client.rides_through = False  # fail at once instead of riding through an "outage"
    return client


def grpc_variants(certs: CertPaths, other: CertPaths) -> dict[str, dict]:
    good = certs.client_settings("trainer")
    return {
        "no TLS": {},
        "TLS without a client certificate": {"tls_ca_path": good["tls_ca_path"]},
        "a client certificate of another CA": {
            "tls_ca_path": good["tls_ca_path"],
            "tls_cert_path": other.client_settings("trainer")["tls_cert_path"],
            "tls_key_path": other.client_settings("trainer")["tls_key_path"],
        },
    }


def curve_variants(certs: CertPaths, other: CertPaths) -> dict[str, CurveClient | None]:
    good = certs.client_settings("trainer")
    stranger = other.client_settings("trainer")
    return {
        "no CURVE": None,
        "an unknown CURVE key": CurveClient.load(stranger["curve_secret_key_path"], good["curve_broker_key_path"]),
        "a wrong broker key": CurveClient.load(good["curve_secret_key_path"], stranger["curve_broker_key_path"]),
    }


# -------------------------------------------------------------------------------------------- primerl certs
def test_certs_output_verifies_and_is_private(tmp_path):
    paths = make_certs(tmp_path / "c", ["127.0.0.1", "broker.example", "10.0.0.5"], parse_clients("2"))
    assert paths.clients == ("client-1", "client-2")
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(paths.broker_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.5"]
    assert sans.get_values_for_type(x509.DNSName) == ["broker.example"]
    for name in paths.clients:
        x509.load_pem_x509_certificate(paths.client_cert(name).read_bytes()).verify_directly_issued_by(ca)
        public, secret = zmq.auth.load_certificate(paths.curve_client_secret(name))
        assert secret and zmq.auth.load_certificate(paths.curve_authorized / f"{name}.key")[0] == public
    assert zmq.auth.load_certificate(paths.curve_broker_secret)[1]
    secrets = [paths.ca_key, paths.broker_key, paths.curve_broker_secret]
    secrets += [p for name in paths.clients for p in (paths.client_key(name), paths.curve_client_secret(name))]
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(paths.ca_cert.stat().st_mode) == 0o644
    lines = config_lines(paths)
    assert f'curve_authorized_keys_dir = "{paths.curve_authorized}"' in lines and "[<role>.broker]" in lines
    # The printed [broker] table is a valid broker config.
    BrokerConfig(**paths.broker_settings())


def test_certs_refuses_to_replace_a_ca(tmp_path):
    make_certs(tmp_path, ["127.0.0.1"], ("trainer",))
    first = (tmp_path / "ca.pem").read_bytes()
    with pytest.raises(CertsError, match="exists already.*--force"):
        make_certs(tmp_path, ["127.0.0.1"], ("trainer",))
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli.main", "certs", "--out", str(tmp_path), "--host", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--force" in result.stderr
    assert (tmp_path / "ca.pem").read_bytes() == first
    make_certs(tmp_path, ["127.0.0.1"], ("trainer",), force=True)
    assert (tmp_path / "ca.pem").read_bytes() != first


def test_added_clients_are_admitted_by_a_running_broker_without_a_restart(broker, certs):
    """`primerl certs --add-clients` signs with the same CA and writes into curve/authorized/, which the broker reads
    again at the next handshake; revoking (removing the key file) works the same way."""
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli.main", "certs", "--out", str(certs.out), "--add-clients", "infer-node-7"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "[<role>.broker]" in result.stdout and "tls_client_ca_path" not in result.stdout  # no broker table
    assert stat.S_IMODE(certs.curve_client_secret("infer-node-7").stat().st_mode) == 0o600
    assert stat.S_IMODE(certs.client_key("infer-node-7").stat().st_mode) == 0o600
    settings = certs.client_settings("infer-node-7")
    with control(broker, settings, "infer-node-7", role="inference") as infer:
        infer.wait_ready(OK_S)
        registration = infer.register()
        with RolloutConsumer(
            registration.rollout_endpoint, TOKEN, registration.worker_id, 0, curve=infer.curve
        ) as consumer:
            consumer.hello(OK_S)  # admitted: the broker answers
        (certs.curve_authorized / "infer-node-7.key").unlink()
        time.sleep(0.05)  # a new directory mtime
        with RolloutConsumer(
            registration.rollout_endpoint, TOKEN, registration.worker_id, 0, curve=infer.curve
        ) as consumer:
            with pytest.raises(RolloutRefused, match="curve_authorized_keys_dir"):  # revoked: refused at once
                consumer.hello(REFUSED_S)
    again = subprocess.run(
        [sys.executable, "-m", "primerl.cli.main", "certs", "--out", str(certs.out), "--add-clients", "infer-node-7"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "exist already" in again.stderr


@pytest.mark.parametrize("spec", ["0", "a,a", "broker", "a b"])
def test_certs_rejects_bad_client_names(spec):
    with pytest.raises(CertsError):
        parse_clients(spec)


# ---------------------------------------------------------------------------------------------- primerl rl
REPO = Path(__file__).resolve().parents[1]


def dry_run(*configs: Path, write: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "primerl.cli.main",
            "rl",
            "@",
            str(REPO / "examples" / "reverse_text_rl.toml"),
            *[arg for config in configs for arg in ("@", str(config))],
            "--dry-run",
            "--write",
            str(write),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_primerl_rl_hands_each_role_its_credentials(certs, tmp_path):
    """The tables `primerl certs` prints, given to `primerl rl`, reach every role's config; a role left without
    them is refused before anything starts, naming the setting."""
    security = tmp_path / "security.toml"
    security.write_text("\n".join(line for line in config_lines(certs).splitlines() if not line.startswith("#")))
    result = dry_run(security, write=tmp_path / "roles")
    assert result.returncode == 0, result.stderr
    for role in ("trainer", "orchestrator", "inference"):
        written = (tmp_path / "roles" / f"{role}.toml").read_text()
        for value in certs.client_settings(role).values():
            assert f'"{value}"' in written, (role, value)
    broker = (tmp_path / "roles" / "broker.toml").read_text()
    assert all(f'"{value}"' in broker for value in certs.broker_settings().values())
    partial = tmp_path / "partial.toml"
    text = security.read_text()
    partial.write_text(text[: text.index("[orchestrator.broker]")] + text[text.index("[inference.broker]") :])
    refused = dry_run(partial, write=tmp_path / "refused")
    assert refused.returncode != 0
    assert "orchestrator.broker.curve_secret_key_path" in refused.stderr
    assert "orchestrator.broker.tls_cert_path" in refused.stderr


# ------------------------------------------------------------------------------------- misconfiguration
def test_half_configured_credentials_name_the_setting(certs, tmp_path):
    with pytest.raises(ValueError, match="curve_authorized_keys_dir"):
        BrokerConfig(curve_secret_key_path=certs.curve_broker_secret)
    with pytest.raises(ValueError, match="tls_client_ca_path"):
        BrokerConfig(tls_client_ca_path=certs.ca_cert)
    with pytest.raises(ValueError, match="tls_key_path"):
        BrokerClientConfig(tls_ca_path=certs.ca_cert, tls_cert_path=certs.client_cert("trainer"))
    with pytest.raises(ValueError, match="needs TLS"):
        BrokerClientConfig(tls_cert_path=certs.client_cert("trainer"), tls_key_path=certs.client_key("trainer"))
    with pytest.raises(ValueError, match="curve_broker_key_path"):
        BrokerClientConfig(curve_secret_key_path=certs.curve_client_secret("trainer"))
    missing = BrokerClientConfig(
        curve_secret_key_path=tmp_path / "nope.key_secret", curve_broker_key_path=certs.curve_broker_public
    )
    with pytest.raises(ValueError, match="curve_secret_key_path.*no such file"):
        missing.curve_client()
    public_only = BrokerClientConfig(
        curve_secret_key_path=certs.curve_broker_public, curve_broker_key_path=certs.curve_broker_public
    )
    with pytest.raises(ValueError, match="only a public key"):
        public_only.curve_client()
    with pytest.raises(ValueError, match="tls_key_path"):
        ControlClient(
            BrokerClientConfig(
                tls_ca_path=certs.ca_cert,
                tls_cert_path=certs.client_cert("trainer"),
                tls_key_path=tmp_path / "missing.key",
            ),
            "trainer",
            "t",
        )


def test_broker_refuses_to_start_with_a_bad_key_dir(certs, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="curve_authorized_keys_dir.*no `\\*.key`"):
        BrokerHarness(
            tmp_path / "spool",
            run_token=TOKEN,
            curve_secret_key_path=certs.curve_broker_secret,
            curve_authorized_keys_dir=tmp_path / "empty",
        )


# ---------------------------------------------------------------------------------- the control plane
def test_control_plane_refuses_clients_without_the_right_certificate(broker, certs, other_certs):
    for what, settings in grpc_variants(certs, other_certs).items():
        client = control(broker, settings, f"intruder-{len(what)}")
        try:
            with pytest.raises(BrokerError):
                client.wait_ready(REFUSED_S)
                client.register()
            with pytest.raises(BrokerError):
                client.get_run_status()
        finally:
            client.close()
    with control(broker, certs.client_settings("trainer"), "observer", role="client") as client:
        names = [worker.name for worker in client.list_workers()]
    assert not any(name.startswith("intruder") for name in names)


def run_status(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRIMERL_RUN_TOKEN": TOKEN}
    return subprocess.run(
        [sys.executable, "-m", "primerl.cli.main", "status", "--json", "--timeout-s", "3", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_primerl_status_needs_the_client_certificate(broker, certs, other_certs):
    address = ["--broker", broker.grpc_address]
    assert run_status(*address).returncode != 0
    assert run_status(*address, "--tls-ca", str(certs.ca_cert)).returncode != 0
    other = other_certs.client_settings("trainer")
    refused = run_status(
        *address,
        "--tls-ca",
        str(certs.ca_cert),
        "--tls-cert",
        other["tls_cert_path"],
        "--tls-key",
        other["tls_key_path"],
    )
    assert refused.returncode != 0 and refused.stdout == ""
    ok = run_status(
        *address,
        "--tls-ca",
        str(certs.ca_cert),
        "--tls-cert",
        str(certs.client_cert("status")),
        "--tls-key",
        str(certs.client_key("status")),
    )
    assert ok.returncode == 0, ok.stderr
    assert broker.service.run_id in ok.stdout


def test_primerl_status_reads_the_client_certificate_from_run_json(broker, certs, tmp_path):
    """`primerl rl` records the CA and the launcher's client certificate in run.json; `primerl status RUN_DIR`
    uses them."""
    run = RunFile(
        broker_address=broker.grpc_address,
        run_token=TOKEN,
        tls_ca_path=str(certs.ca_cert),
        tls_cert_path=str(certs.client_cert("trainer")),
        tls_key_path=str(certs.client_key("trainer")),
    )
    write_run_file(tmp_path, run)
    ok = run_status(str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    write_run_file(
        tmp_path, RunFile(broker_address=broker.grpc_address, run_token=TOKEN, tls_ca_path=str(certs.ca_cert))
    )
    assert run_status(str(tmp_path)).returncode != 0


def test_tls_server_name_checks_the_certificate_against_another_name(tmp_path):
    """A broker whose certificate names only broker.example, dialed at 127.0.0.1 (as through NAT)."""
    named = make_certs(tmp_path / "named", ["broker.example"], ("trainer", "status"))
    settings = {key: value for key, value in named.broker_settings().items() if key.startswith("tls")}
    harness = BrokerHarness(tmp_path / "spool", run_token=TOKEN, **settings)
    try:
        client_tls = {key: value for key, value in named.client_settings("trainer").items() if key.startswith("tls")}
        with control(harness, client_tls, "by-address") as client, pytest.raises(BrokerError):
            client.wait_ready(REFUSED_S)
        with control(harness, {**client_tls, "tls_server_name": "broker.example"}, "by-name", role="client") as client:
            client.wait_ready(OK_S)
            assert client.get_run_status().run_id == harness.service.run_id
        ok = run_status(
            "--broker",
            harness.grpc_address,
            "--tls-ca",
            str(named.ca_cert),
            "--tls-cert",
            str(named.client_cert("status")),
            "--tls-key",
            str(named.client_key("status")),
            "--tls-server-name",
            "broker.example",
        )
        assert ok.returncode == 0, ok.stderr
    finally:
        harness.stop()


# ------------------------------------------------------------------------------------- the data planes
def test_the_right_credentials_do_everything(broker, certs):
    settings = certs.client_settings("trainer")
    with control(broker, settings, "trainer-ok") as trainer:
        trainer.wait_ready(OK_S)
        registration = trainer.register()
        assert trainer.curve is not None
        assert trainer.get_run_status().run_id == broker.service.run_id
        limits = trainer.limits
        orchestrator_curve = BrokerClientConfig(**certs.client_settings("orchestrator")).curve_client()
        with RolloutProducer(
            registration.rollout_endpoint, TOKEN, "orchestrator", limits=limits.frames, curve=orchestrator_curve
        ) as producer:
            header, payload = pack_batch(0, 0, 0, 1, {"input_ids": np.arange(16, dtype=np.int64)})
            assert producer.send_batch(header, payload, timeout_s=OK_S).durable
        with RolloutConsumer(
            registration.rollout_endpoint, TOKEN, registration.worker_id, 0, limits=limits.frames, curve=trainer.curve
        ) as consumer:
            consumer.hello(OK_S)
            [(got, tensors)] = consumer.fetch_step(0, timeout_s=OK_S)
            assert got.batch_id == header.batch_id
            assert np.array_equal(np.asarray(tensors["input_ids"]), np.arange(16))
        update_header, update_payload = make_update(1)
        with WeightPublisher(
            registration.weight_endpoint,
            TOKEN,
            "trainer",
            limits.weight_chunk_bytes,
            limits=limits.frames,
            curve=trainer.curve,
        ) as publisher:
            ack = publisher.publish(update_header, update_payload, timeout_s=OK_S)
            assert ack.policy_version == 1 and not ack.HasField("error")
    inference_settings = certs.client_settings("inference")
    with control(broker, inference_settings, "infer-ok", role="inference") as infer:
        infer.wait_ready(OK_S)
        registration = infer.register()
        with WeightSubscriber(
            registration.weight_endpoint, TOKEN, registration.worker_id, limits=infer.limits.frames, curve=infer.curve
        ) as subscriber:
            subscriber.hello(None)
            update = subscriber.receive(OK_S)
            assert update is not None and update[0].policy_version == 1


def test_data_planes_refuse_clients_without_the_right_curve_keys(broker, certs, other_certs):
    """A client without CURVE, with an unknown key or with a wrong broker key is refused at the handshake and
    stops at once with UNAUTHENTICATED, the error naming what to set: the first two are told so by the broker
    (a mismatch, a 400), the last sees the broker close every handshake (it cannot open the client's HELLO), and
    ``CLOSED_HANDSHAKES_TO_REFUSE`` such closes in a row end it. Nothing arrives either way."""
    endpoints_of = {"rollout": broker.rollout_endpoint, "weight": broker.weight_endpoint}
    queued_before = broker.service.rollout_plane.status().queue.num_batches
    for what, curve in curve_variants(certs, other_certs).items():
        started_s = time.monotonic()
        with RolloutProducer(endpoints_of["rollout"], TOKEN, "orchestrator", curve=curve) as producer:
            header, payload = pack_batch(5, 0, 0, 1, {"input_ids": np.arange(8, dtype=np.int64)})
            with pytest.raises(RolloutRefused, match="CURVE|curve") as refused:
                producer.send_batch(header, payload, timeout_s=REFUSED_S)
            assert refused.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
            if what == "a wrong broker key":
                assert "curve_broker_key_path is not the broker's public key" in str(refused.value)
        with RolloutConsumer(endpoints_of["rollout"], TOKEN, "trainer-x", 0, curve=curve) as consumer:
            with pytest.raises(RolloutRefused, match="CURVE|curve"):
                consumer.hello(REFUSED_S)
        with WeightPublisher(
            endpoints_of["weight"], TOKEN, "trainer", 64 * 1024, curve=curve, connect_timeout_s=REFUSED_S
        ) as publisher:
            update_header, update_payload = make_update(7)
            with pytest.raises(WeightUpdateRefused, match="CURVE|curve"):
                publisher.publish(update_header, update_payload, timeout_s=REFUSED_S)
        with WeightSubscriber(endpoints_of["weight"], TOKEN, "infer-x", curve=curve) as subscriber:
            try:  # its HELLO is queued (libzmq queues before a handshake) or the refusal comes first
                subscriber.hello(None)
            except WeightPlaneError as exc:
                assert "CURVE" in str(exc) or "curve" in str(exc)
            else:
                with pytest.raises(WeightPlaneError, match="CURVE|curve"):
                    subscriber.receive(REFUSED_S)
        # The broker tells an unknown key at once (400); a mismatch or a wrong broker key may take
        # CLOSED_HANDSHAKES_TO_REFUSE closed handshakes (about 0.3 s of reconnects), longer than this outage budget.
        told = what == "an unknown CURVE key"
        with WeightSubscriber(
            endpoints_of["weight"], TOKEN, "infer-y", curve=curve, outage_s=0.5, liveness_s=0.5
        ) as subscriber:
            subscriber.hello(None)
            with pytest.raises(
                WeightPlaneError if told else (WeightPlaneError, BrokerOutageExceeded), match="CURVE|curve"
            ):
                subscriber.receive(REFUSED_S)
        elapsed_s = time.monotonic() - started_s
        # Refused at once: five calls in less than the time two of them would wait for their timeouts.
        assert elapsed_s < 2 * REFUSED_S, (what, elapsed_s)
    assert broker.service.rollout_plane.status().queue.num_batches == queued_before
    assert broker.service.weight_store.latest_version in (None, 1)  # never 7
