"""The broker's Prometheus HTTP service discovery (``GET /discovery`` on its metrics port): the groups' shape, the
run token and TLS in front of it, and workers joining, getting lost and leaving, against a real broker and real
registrations over gRPC."""

from __future__ import annotations

import ssl
import time

import httpx
import pytest
from support.probes import scrape_metrics as scrape

from primerl.broker.metrics_discovery import DISCOVERY_PATH, target_group, target_groups
from primerl.broker.worker_record import ALIVE, LOST
from primerl.cli.certs import make_certs
from primerl.client.control import ControlClient
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.config_common import BrokerClientConfig

TOKEN = "discovery-token"


def discovery_url(broker) -> str:
    return broker.endpoints.metrics_url.removesuffix("/metrics") + DISCOVERY_PATH


def discover(broker, token: str | None = TOKEN, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(discovery_url(broker), headers=headers, timeout=10, **kwargs)


def by_worker(groups: list[dict]) -> dict[str, dict]:
    return {group["labels"]["worker"]: group for group in groups}


# ------------------------------------------------------------------------------------------------- the groups
def test_a_group_names_the_target_its_scheme_and_path():
    group = target_group("https://node-3:9400/metrics", {"role": "inference"})
    assert group == {
        "targets": ["node-3:9400"],
        "labels": {"role": "inference", "__scheme__": "https", "__metrics_path__": "/metrics"},
    }
    assert target_group("http://[::1]:8000/v1/metrics", {})["targets"] == ["[::1]:8000"]


@pytest.mark.parametrize(
    "url", ["", "node-3:9400", "ftp://node-3:21/metrics", "http://node-3/metrics", "http://node-3:99999/metrics"]
)
def test_a_metrics_url_that_is_no_scrape_target_is_left_out(url):
    assert target_group(url, {}) is None


def test_only_live_workers_with_a_metrics_url_are_targets():
    def worker(name: str, state: int, url: str | None) -> control_pb2.WorkerInfo:
        capabilities = {"metrics_url": url} if url else {}
        return control_pb2.WorkerInfo(
            name=name, role=common_pb2.ROLE_INFERENCE, state=state, hostname="gpu-7", capabilities=capabilities
        )

    workers = [
        worker("infer-0", ALIVE, "http://gpu-7:8000/metrics"),
        worker("infer-1", LOST, "http://gpu-7:8001/metrics"),
        worker("infer-2", ALIVE, None),
        worker("infer-3", ALIVE, "not a url"),
    ]
    groups = by_worker(target_groups(workers, "run-x", "http://broker-host:9100/metrics"))
    assert set(groups) == {"broker", "infer-0"}
    assert groups["infer-0"]["labels"] == {
        "role": "inference",
        "worker": "infer-0",
        "host": "gpu-7",
        "run_id": "run-x",
        "__scheme__": "http",
        "__metrics_path__": "/metrics",
    }
    assert groups["broker"]["labels"]["role"] == "broker"


# ------------------------------------------------------------------------------------------ a real broker
@pytest.fixture
def broker(make_broker):
    return make_broker(run_id="discovery-test", run_token=TOKEN, heartbeat_interval_s=0.2, heartbeat_liveness=3)


def control(broker, role: str, name: str, metrics_port: int) -> ControlClient:
    config = BrokerClientConfig(address=f"127.0.0.1:{broker.endpoints.grpc_port}", run_token=TOKEN)
    capabilities = {"metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}
    return ControlClient(config, role, name, capabilities=capabilities)


def wait_for(predicate, timeout_s: float = 15.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s} s")


def test_discovery_wants_the_run_token(broker):
    for token in (None, "wrong"):
        answer = discover(broker, token)
        assert answer.status_code == 401
        assert "Authorization: Bearer" in answer.json()["error"]
    # the broker answers on, and /metrics is unchanged beside the route
    assert discover(broker).status_code == 200
    assert scrape(broker.endpoints.metrics_url)[(telemetry.BROKER_DISCOVERY_TARGETS, ())] == 1


def test_workers_appear_when_they_register_and_leave_when_lost_or_gone(broker):
    trainer = control(broker, "trainer", "trainer-0", 9101)
    infer = control(broker, "inference", "infer-0", 9102)
    trainer.register()
    infer.register()
    groups = by_worker(discover(broker).json())
    assert set(groups) == {"broker", "trainer-0", "infer-0"}
    assert groups["infer-0"]["targets"] == ["127.0.0.1:9102"]
    assert {g["labels"]["run_id"] for g in groups.values()} == {"discovery-test"}
    assert groups["trainer-0"]["labels"]["role"] == "trainer"

    # the trainer goes silent: marked lost, it leaves the list and the broker counts it lost
    deadline = time.monotonic() + 15
    while "trainer-0" in by_worker(discover(broker).json()):
        infer.heartbeat()
        assert time.monotonic() < deadline, "a silent trainer stayed a target"
        time.sleep(0.1)
    samples = scrape(broker.endpoints.metrics_url)
    assert samples[(telemetry.BROKER_WORKERS_LOST, (("role", "trainer"),))] == 1
    assert samples[(telemetry.BROKER_DISCOVERY_TARGETS, ())] == 2
    assert samples[(telemetry.BROKER_RUN_FINISHED, ())] == 0
    assert samples[(telemetry.DISK_FREE_BYTES, (("purpose", "spool"),))] > 0

    infer.deregister("done")
    assert set(by_worker(discover(broker).json())) == {"broker"}


def test_process_families_are_served_by_every_exporter(broker):
    samples = scrape(broker.endpoints.metrics_url)
    names = {name for name, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"} <= names


def test_with_tls_the_metrics_port_and_its_discovery_are_https(make_broker, tmp_path):
    certs = make_certs(tmp_path / "certs", ["127.0.0.1", "localhost"], ("prometheus",))
    broker = make_broker(run_token=TOKEN, **certs.broker_settings())
    assert broker.endpoints.metrics_url.startswith("https://127.0.0.1:")
    client = certs.client_settings("prometheus")
    context = ssl.create_default_context(cafile=str(client["tls_ca_path"]))
    if "tls_cert_path" in client:  # mutual TLS: the scraper presents a client certificate too
        context.load_cert_chain(str(client["tls_cert_path"]), str(client["tls_key_path"]))
    groups = discover(broker, verify=context).json()
    assert groups[0]["labels"]["__scheme__"] == "https"
    with pytest.raises(httpx.HTTPError):  # no plain HTTP on that port
        httpx.get(discovery_url(broker).replace("https://", "http://"), timeout=5)
