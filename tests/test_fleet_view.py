"""What each worker is doing, said plainly (``supervisor/fleet_view.py``): serving, not serving, alive, lost since
its last heartbeat, gone; the counts per role in `primerl status` and its ``--json``, from a real broker's status."""

from __future__ import annotations

import io
import json
import time

from primerl.cli.status import _show
from primerl.client.control import ControlClient
from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.config_common import BrokerClientConfig
from primerl.supervisor.fleet_view import annotate_json, condition, fleet_counts, fleet_line


def info(role: int, state: int, address: str = "http://h:8000", **capabilities: str) -> control_pb2.WorkerInfo:
    return control_pb2.WorkerInfo(name="w", role=role, state=state, address=address, capabilities=capabilities)


def test_each_condition():
    alive, lost, left = control_pb2.WORKER_STATE_ALIVE, control_pb2.WORKER_STATE_LOST, control_pb2.WORKER_STATE_LEFT
    assert condition(info(common_pb2.ROLE_INFERENCE, alive)) == "serving"
    assert condition(info(common_pb2.ROLE_TEACHER, alive)) == "serving"
    assert condition(info(common_pb2.ROLE_INFERENCE, alive, serving="false")) == "not_serving"
    assert condition(info(common_pb2.ROLE_TRAINER, alive)) == "alive"
    assert condition(info(common_pb2.ROLE_INFERENCE, alive, address="")) == "alive"  # a weight relay, no server
    assert condition(info(common_pb2.ROLE_INFERENCE, lost)) == "lost"
    assert condition(info(common_pb2.ROLE_ORCHESTRATOR, left)) == "gone"


def test_a_fleet_read_from_a_real_broker(make_broker):
    broker = make_broker(heartbeat_interval_s=0.2, heartbeat_liveness=3)
    config = BrokerClientConfig(address=f"127.0.0.1:{broker.endpoints.grpc_port}")
    clients = [
        ControlClient(config, "inference", f"infer-{i}", address=f"http://127.0.0.1:{8000 + i}") for i in range(3)
    ]
    clients.append(ControlClient(config, "trainer", "trainer-0"))
    for client in clients:
        client.register()
    clients[2].deregister("job ended")  # infer-2 gone
    silent = time.monotonic()
    while True:  # infer-1 falls silent; the others heartbeat on
        for client in (clients[0], clients[3]):
            client.heartbeat()
        status = broker.service.registry.run_status()
        if fleet_counts(status)["inference"].get("lost"):
            break
        assert time.monotonic() - silent < 15, "infer-1 was never marked lost"
        time.sleep(0.1)
    assert fleet_counts(status) == {"inference": {"serving": 1, "lost": 1, "gone": 1}, "trainer": {"alive": 1}}
    assert fleet_line(status) == "inference: 1 serving, 1 lost, 1 gone; trainer: 1 alive"

    out = io.StringIO()
    _show(status, True, out, clear=False)
    data = json.loads(out.getvalue())
    assert data["fleet"] == fleet_counts(status)
    by_name = {w["name"]: w for w in data["workers"]}
    assert [by_name[f"infer-{i}"]["condition"] for i in range(3)] == ["serving", "lost", "gone"]
    lost = next(w for w in status.workers if w.name == "infer-1")
    assert by_name["infer-1"]["lost_since_unix_ms"] == lost.last_heartbeat_unix_ms
    assert "lost_since_unix_ms" not in by_name["infer-0"]

    text = io.StringIO()
    _show(status, False, text, clear=False)
    assert "workers    inference: 1 serving, 1 lost, 1 gone; trainer: 1 alive" in text.getvalue()


def test_annotating_a_status_without_workers():
    data: dict = {}
    assert annotate_json(control_pb2.RunStatus(), data) == {"fleet": {}}
