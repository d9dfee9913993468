"""A daemon's Prometheus endpoint: its own registry, served over HTTP at ``http://host:port/metrics``.

    exporter = start_exporter("trainer", config.prometheus)    # None when prometheus.enabled = false
    exporter.url                                                # logged; sent to the broker as `metrics_url`
    exporter.gauge("primerl_trainer_loss", "Loss of the latest step").set(0.3)
    exporter.record_row("trainer", step, metrics)               # what MetricsSink.log does with every row
    exporter.stop()

Families of every exporter (set by ``record_row``, i.e. from every row of ``metrics.jsonl``):

- ``primerl_step{role}``: the step of the role's latest metrics row;
- ``primerl_metric{role,name}``: each value of that row, ``name`` being its ``metrics.jsonl`` key
  (``train/loss``, ``rollout/mean_length``, ...);
- ``process_*`` (prometheus_client's ``ProcessCollector``): the daemon's CPU seconds, resident memory, open files
  and start time, what an operator charts per role and alerts a restart on.

Beside ``/metrics`` a daemon may serve a few JSON routes of its own on the same port (``route``; the broker's
Prometheus service discovery, ``primerl.broker.metrics_discovery``). With ``tls`` the server speaks HTTPS only (and
asks for a client certificate signed by ``TlsFiles.client_ca`` when one is given), and the URL says ``https``.

Role-specific live families are made where their values are known (``primerl.broker.metrics``, the trainer
and orchestrator runners, ``primerl.inference.metrics``). Each exporter has its own ``CollectorRegistry``,
not prometheus_client's global one, so several daemons in one process (tests) never collide. The server is
prometheus_client's threaded WSGI server in a daemon thread: a scrape never touches the compute loop.
"""

from __future__ import annotations

import math
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from primerl.runtime.config_common import PrometheusConfig
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.prometheus")

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


Route = Callable[[str], tuple[str, str, bytes]]
"""A JSON route: the request's ``Authorization`` header -> (HTTP status line, content type, body)."""


class TlsFiles(NamedTuple):
    """The certificate and key an exporter serves HTTPS with, and the CA client certificates must be signed by."""

    cert: Path
    key: Path
    client_ca: Path | None = None


def metrics_url(host: str, port: int, scheme: str = "http") -> str:
    """The URL a scraper uses: a wildcard bind is named by this machine's host name."""
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    host = host.strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/metrics"


def _with_routes(metrics_app: Callable, routes: Mapping[str, Route]) -> Callable:
    """A WSGI app serving ``routes`` by exact path and everything else as prometheus_client's ``metrics_app``. A
    route that raises answers 500 with the reason: the daemon serves on."""

    def app(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return metrics_app(environ, start_response)
        try:
            status, content_type, body = route(environ.get("HTTP_AUTHORIZATION", ""))
        except Exception as exc:  # noqa: BLE001 - one bad answer, never the server
            log.exception("metrics route failed", path=environ.get("PATH_INFO"))
            status, content_type, body = "500 Internal Server Error", "text/plain", f"{exc}\n".encode()
        start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return app


def disk_families(purpose: str, path: Path | str, free_name: str, size_name: str) -> Iterable[Metric]:
    """The free bytes (``free_name``) and size (``size_name``) of the file system holding ``path``, labelled
    ``purpose``; nothing while it cannot be read (the directory is not made yet, or gone)."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return []
    free = GaugeMetricFamily(free_name, "Free bytes of the file system holding the directory.", labels=["purpose"])
    free.add_metric([purpose], usage.free)
    size = GaugeMetricFamily(size_name, "Size of the file system holding the directory.", labels=["purpose"])
    size.add_metric([purpose], usage.total)
    return [free, size]


class DiskCollector:
    """A collector of ``disk_families`` read at every scrape (``MetricsExporter.register``)."""

    def __init__(self, purpose: str, path: Path | str, free_name: str, size_name: str):
        self.args = (purpose, path, free_name, size_name)

    def collect(self) -> Iterable[Metric]:
        return disk_families(*self.args)


class MetricsExporter:
    """One daemon's metrics: a registry with the generic families, and the HTTP server that serves it."""

    def __init__(self, role: str, config: PrometheusConfig, tls: TlsFiles | None = None):
        self.role = role
        self.config = config
        self.tls = tls
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self._routes: dict[str, Route] = {}
        self._step = Gauge("primerl_step", "Step of the role's latest metrics row.", ["role"], registry=self.registry)
        self._metric = Gauge(
            "primerl_metric",
            "Each value of the role's latest metrics row (name: its metrics.jsonl key).",
            ["role", "name"],
            registry=self.registry,
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- families ------------------------------------------------------------------------------------

    def gauge(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, documentation, labelnames, registry=self.registry)

    def counter(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Counter:
        """A counter; Prometheus shows it as ``<name>_total``."""
        return Counter(name, documentation, labelnames, registry=self.registry)

    def register(self, collector: Any) -> None:
        """A custom collector whose ``collect()`` reads live values at scrape time."""
        self.registry.register(collector)

    def route(self, path: str, handler: Route) -> None:
        """Serve ``handler`` at ``path`` beside ``/metrics`` (set before ``start``)."""
        self._routes[path] = handler

    def record_row(self, role: str, step: int, metrics: Mapping[str, float]) -> None:
        self._step.labels(role=role).set(step)
        for name, value in metrics.items():
            if math.isfinite(value):
                self._metric.labels(role=role, name=name).set(value)

    # -- serving -------------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and serve; returns the URL. ``ValueError`` saying what to change when the port cannot be bound."""
        from prometheus_client import start_http_server

        host, port, tls = self.config.host, self.config.port, self.tls
        certificates: dict[str, Any] = {}
        if tls is not None:
            certificates = {"certfile": str(tls.cert), "keyfile": str(tls.key)}
            if tls.client_ca is not None:
                certificates.update(client_cafile=str(tls.client_ca), client_auth_required=True)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry, **certificates)
        except OSError as exc:  # port taken, no such interface, permission denied (ports < 1024)
            reason = exc.strerror or str(exc)
            in_rl = (
                f"; {self.role}.prometheus.port in a `primerl rl` config"
                if self.role in ("broker", "trainer", "orchestrator")
                else ""
            )
            raise ValueError(
                f"cannot serve Prometheus metrics on {host}:{port}: {reason}. Set prometheus.port to a free port "
                f"(0, the default, picks one{in_rl}), prometheus.host to an interface of this machine, or "
                "prometheus.enabled = false"
            ) from None
        if self._routes:
            self._server.set_app(_with_routes(self._server.get_app(), dict(self._routes)))
        self.url = metrics_url(host, self._server.server_port, "https" if tls is not None else "http")
        log.info("serving Prometheus metrics", role=self.role, metrics_url=self.url)
        return self.url

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.server_port

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._server = self._thread = None


def start_exporter(
    role: str, config: PrometheusConfig, tls: TlsFiles | None = None, routes: Mapping[str, Route] | None = None
) -> MetricsExporter | None:
    """A started exporter serving ``routes`` beside ``/metrics``, or None when ``config.enabled`` is false."""
    if not config.enabled:
        return None
    exporter = MetricsExporter(role, config, tls)
    for path, handler in (routes or {}).items():
        exporter.route(path, handler)
    exporter.start()
    return exporter
