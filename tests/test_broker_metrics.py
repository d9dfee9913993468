"""The broker's Prometheus endpoint, scraped over HTTP from a real broker (in process and as `primerl-broker`) while
real clients register, send rollout batches, publish and receive weights; bad Prometheus settings are clear
errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.probes import scrape_metrics as scrape

from primerl.broker.service import BrokerService
from primerl.client.control import ControlClient
from primerl.client.rollouts import RolloutProducer, pack_batch
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.configs.broker import BrokerConfig
from primerl.proto import telemetry, tensor_frames
from primerl.proto.v1 import data_pb2
from primerl.runtime.config_common import BrokerClientConfig

BIN = Path(sys.executable).parent


def workers(samples: dict, role: str) -> float:
    return samples[(telemetry.BROKER_WORKERS, (("role", role),))]


@pytest.fixture
def broker(make_broker) -> BrokerService:
    return make_broker(run_id="metrics-test", heartbeat_interval_s=0.2).service


def test_metrics_follow_registrations_rollouts_weights_and_commits(broker):
    url = broker.endpoints.metrics_url
    assert url == f"http://127.0.0.1:{broker.exporter.port}/metrics"
    samples = scrape(url)
    assert [workers(samples, role) for role in ("trainer", "orchestrator", "inference")] == [0, 0, 0]
    assert samples[(telemetry.BROKER_LATEST_POLICY_VERSION, ())] == 0

    client_config = BrokerClientConfig(address=f"127.0.0.1:{broker.endpoints.grpc_port}")
    trainer = ControlClient(client_config, "trainer", "trainer-rank0")
    infer = ControlClient(client_config, "inference", "infer-0", address="http://127.0.0.1:8000")
    try:
        trainer.register()
        infer.register()
        with RolloutProducer(f"tcp://127.0.0.1:{broker.endpoints.rollout_port}") as producer:
            for index in range(2):
                tensors = {"input_ids": np.arange(64, dtype=np.int64) + index}
                producer.send_batch(*pack_batch(1, 0, index, 2, tensors), timeout_s=20)
            connected = scrape(url)
            assert connected[(telemetry.BROKER_ROLLOUT_CONNECTIONS, ())] == 1
            assert connected[(f"{telemetry.BROKER_ROLLOUT_CONNECTIONS_REFUSED}_total", ())] == 0
        payload, specs = tensor_frames.encode_tensors({"w": np.ones(4096, dtype=np.float32)})
        header = data_pb2.WeightUpdateHeader(policy_version=1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
        weight_endpoint = f"tcp://127.0.0.1:{broker.endpoints.weight_port}"
        with WeightPublisher(weight_endpoint, None, "trainer", broker.chunk_bytes) as publisher:
            assert publisher.publish(header, payload, timeout_s=30).applied
        subscriber = WeightSubscriber(weight_endpoint, None, infer.worker_id)
        try:
            subscriber.hello(0)
            received = subscriber.receive(20.0)
            assert received is not None and received[0].policy_version == 1
            subscriber.ack(1, apply_ms=3)
        finally:
            subscriber.close()

        samples = scrape(url)
        print(
            "\n"
            + "\n".join(
                f"{name}{dict(labels) or ''} {value:g}"
                for (name, labels), value in sorted(samples.items())
                if name.startswith("primerl_")
            )
        )
        assert [workers(samples, role) for role in ("trainer", "orchestrator", "inference")] == [1, 0, 1]
        assert samples[(telemetry.BROKER_LATEST_POLICY_VERSION, ())] == 1
        assert samples[(telemetry.BROKER_ROLLOUT_BATCHES_QUEUED, ())] == 2
        assert samples[(telemetry.BROKER_ROLLOUT_BYTES_SPOOLED, ())] > 64 * 8 * 2
        assert samples[(f"{telemetry.BROKER_ROLLOUT_BATCHES_RECEIVED}_total", ())] == 2
        assert samples[(f"{telemetry.BROKER_WEIGHT_BYTES_RECEIVED}_total", ())] >= 4096 * 4
        assert samples[(telemetry.BROKER_WEIGHT_UPDATES_STORED, ())] == 1
        # the push to the subscriber is counted once the broker's IO thread sent it: done by now (it was received)
        assert samples[(f"{telemetry.BROKER_WEIGHT_BYTES_PUSHED}_total", ())] >= 4096 * 4
        assert samples[(telemetry.BROKER_COMMITTED_STEP, ())] == 0

        trainer.commit_step(1)  # releases step 1's batches
        trainer.deregister("done")
        samples = scrape(url)
        assert samples[(telemetry.BROKER_COMMITTED_STEP, ())] == 1
        assert samples[(telemetry.BROKER_ROLLOUT_BATCHES_QUEUED, ())] == 0
        assert samples[(telemetry.BROKER_ROLLOUT_BYTES_SPOOLED, ())] == 0
        assert workers(samples, "trainer") == 0 and workers(samples, "inference") == 1
    finally:
        trainer.close()
        infer.close()


def test_disabled_prometheus_serves_nothing(tmp_path):
    service = BrokerService(
        BrokerConfig(
            grpc_port=0, rollout_port=0, weight_port=0, spool_dir=tmp_path / "spool", prometheus={"enabled": False}
        )
    )
    try:
        assert service.start().metrics_url is None and service.exporter is None
    finally:
        service.stop(grace_s=0)


def test_taken_port_fails_start_and_leaves_nothing_bound(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = BrokerService(
            BrokerConfig(
                grpc_port=0, rollout_port=0, weight_port=0, spool_dir=tmp_path / "spool", prometheus={"port": port}
            )
        )
        with pytest.raises(ValueError, match=f"cannot serve Prometheus metrics on 127.0.0.1:{port}"):
            service.start()
        assert service.exporter is None and service.rollout_plane is None


def test_prometheus_port_clashing_with_a_broker_port_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="grpc_port, rollout_port, weight_port, prometheus.port must differ"):
        BrokerConfig(grpc_port=9400, prometheus={"port": 9400})


# ---------------------------------------------------------------------------------------------- the process
def run_broker(
    tmp_path: Path, *extra: str, timeout_s: float = 30, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(BIN / "primerl-broker"),
            "--grpc-port",
            "0",
            "--rollout-port",
            "0",
            "--weight-port",
            "0",
            "--spool-dir",
            str(tmp_path / "spool"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def test_process_with_a_port_out_of_range_says_so(tmp_path):
    result = run_broker(tmp_path, "--prometheus.port", "70000")
    assert result.returncode == 2
    assert "prometheus.port" in result.stderr and "65535" in result.stderr and "Traceback" not in result.stderr


def test_process_with_a_taken_port_says_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        checked = run_broker(tmp_path, "--prometheus.port", str(port))
        # past the preflight (a port taken between the check and the bind): the daemon's own bind error
        unchecked = run_broker(
            tmp_path, "--prometheus.port", str(port), env={**os.environ, "PRIMERL_SKIP_PREFLIGHT": "1"}
        )
    output = checked.stdout + checked.stderr
    assert checked.returncode == 2, output  # the preflight: nothing started
    assert f"prometheus.port = {port}: 127.0.0.1:{port} is already in use" in output
    assert "set prometheus.port to a free port, or 0 to pick one" in output and "Traceback" not in output
    output = unchecked.stdout + unchecked.stderr
    assert unchecked.returncode == 1, output
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{port}: Address already in use" in output
    assert "Set prometheus.port to a free port" in output and "Traceback" not in output


def test_process_writes_its_metrics_url_to_the_ready_file(tmp_path):
    ready_file = tmp_path / "ready.json"
    log_path = tmp_path / "broker.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            [
                str(BIN / "primerl-broker"),
                "--grpc-port",
                "0",
                "--rollout-port",
                "0",
                "--weight-port",
                "0",
                "--spool-dir",
                str(tmp_path / "spool"),
                "--ready-file",
                str(ready_file),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while not ready_file.exists():
                assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.05)
            url = json.loads(ready_file.read_text())["metrics_url"]
            samples = scrape(url)
            assert workers(samples, "trainer") == 0 and (telemetry.BROKER_COMMITTED_STEP, ()) in samples
            assert f"metrics_url={url}" in log_path.read_text()  # logged at start
        finally:
            process.terminate()
            process.wait(timeout=15)
    assert process.returncode == 0
