"""Prometheus HTTP service discovery at the broker: ``GET /discovery`` on its metrics port lists the metrics target
of every live daemon of the run, in the format of Prometheus' ``http_sd_configs``:

    [{"targets": ["trainer-host:41871"],
      "labels": {"role": "trainer", "worker": "trainer-0", "host": "trainer-host", "run_id": "run-1a2b3c4d",
                 "__scheme__": "http", "__metrics_path__": "/metrics"}},
     ...]

A target is what a daemon registered as its ``metrics_url`` capability (the inference worker's is vLLM's own
``/metrics``, which carries primerl's inference families too), and the broker itself. A worker marked lost or gone
leaves the list at once: its silence is the broker's to report (``primerl_broker_workers_lost``), not a target's.
With a run token the route answers 401 without ``Authorization: Bearer <token>`` (compared in constant time); with
TLS it is HTTPS like the rest of the broker's metrics port (``runtime.prometheus.TlsFiles``).
``deploy/prometheus/prometheus.yml`` is the scrape config that reads it.
"""

from __future__ import annotations

import hmac
import json
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from primerl.broker.metrics import ROLES
from primerl.broker.worker_record import ALIVE
from primerl.proto.v1 import control_pb2

DISCOVERY_PATH = "/discovery"
METRICS_URL_CAPABILITY = "metrics_url"
JSON = "application/json"


def target_group(url: str, labels: dict[str, str]) -> dict | None:
    """One ``http_sd`` group for the metrics ``url``; None when it is not an http(s) URL with a host and port."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port out of range
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        return None
    labels = {**labels, "__scheme__": parts.scheme, "__metrics_path__": parts.path or "/metrics"}
    return {"targets": [parts.netloc], "labels": labels}


def target_groups(workers: Iterable[control_pb2.WorkerInfo], run_id: str, broker_url: str | None) -> list[dict]:
    """The groups of the broker (``broker_url``: its own metrics URL) and every live worker with a metrics URL."""
    groups = []
    if broker_url:
        broker = {"role": "broker", "worker": "broker", "host": socket.gethostname(), "run_id": run_id}
        groups.append(target_group(broker_url, broker))
    for worker in workers:
        url = worker.capabilities.get(METRICS_URL_CAPABILITY)
        if worker.state != ALIVE or not url:
            continue
        labels = {
            "role": ROLES.get(worker.role, "unknown"),
            "worker": worker.name,
            "host": worker.hostname or urlsplit(url).hostname or "",
            "run_id": run_id,
        }
        groups.append(target_group(url, labels))
    return [group for group in groups if group is not None]


def discovery_route(
    run_token: str | None, workers: Callable[[], list[control_pb2.WorkerInfo]], run_id: str, broker_url: Callable
) -> Callable[[str], tuple[str, str, bytes]]:
    """The ``/discovery`` handler for ``runtime.prometheus.MetricsExporter.route``: the live workers' targets, read
    at every request; 401 without the run token (when the broker has one)."""
    expected = f"Bearer {run_token}".encode() if run_token else None

    def discovery(authorization: str) -> tuple[str, str, bytes]:
        if expected is not None and not hmac.compare_digest(authorization.encode(), expected):
            reason = (
                "missing or wrong run token: send `Authorization: Bearer <run token>` (in Prometheus: "
                "`authorization: {credentials_file: <file holding the token>}` in the http_sd_configs entry)"
            )
            return "401 Unauthorized", JSON, json.dumps({"error": reason}).encode()
        groups = target_groups(workers(), run_id, broker_url())
        return "200 OK", JSON, json.dumps(groups).encode()

    return discovery
