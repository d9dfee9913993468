"""A daemon's Prometheus endpoint: its own registry, served over HTTP at ``http://host:port/metrics``.

    exporter = start_exporter("trainer", config.prometheus)    # None when prometheus.enabled = false
    exporter.url                                                # logged; sent to the broker as `metrics_url`
    exporter.gauge("primerl_trainer_loss", "Loss of the latest step").set(0.3)
    exporter.record_row("trainer", step, metrics)               # what MetricsSink.log does with every row
    exporter.stop()

Families of every exporter (set by ``record_row``, i.e. from every row of ``metrics.jsonl``):

- ``primerl_step{role}``: the step of the role's latest metrics row;
- ``primerl_metric{role,name}``: each value of that row, ``name`` being its ``metrics.jsonl`` key
  (``train/loss``, ``rollout/mean_length``, ...).

Role-specific live families are made where their values are known (``primerl.broker.metrics``, the trainer
and orchestrator runners, ``primerl.inference.metrics``). Each exporter has its own ``CollectorRegistry``,
not prometheus_client's global one, so several daemons in one process (tests) never collide. The server is
prometheus_client's threaded WSGI server in a daemon thread: a scrape never touches the compute loop.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from primerl.runtime.config_common import PrometheusConfig
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.prometheus")

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def metrics_url(host: str, port: int) -> str:
    """The URL a scraper uses: a wildcard bind is named by this machine's host name."""
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    host = host.strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


class MetricsExporter:
    """One daemon's metrics: a registry with the generic families, and the HTTP server that serves it."""

    def __init__(self, role: str, config: PrometheusConfig):
        self.role = role
        self.config = config
        self.registry = CollectorRegistry()
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

    def record_row(self, role: str, step: int, metrics: Mapping[str, float]) -> None:
        self._step.labels(role=role).set(step)
        for name, value in metrics.items():
            if math.isfinite(value):
                self._metric.labels(role=role, name=name).set(value)

    # -- serving -------------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and serve; returns the URL. ``ValueError`` saying what to change when the port cannot be bound."""
        from prometheus_client import start_http_server

        host, port = self.config.host, self.config.port
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
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
        self.url = metrics_url(host, self._server.server_port)
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


def start_exporter(role: str, config: PrometheusConfig) -> MetricsExporter | None:
    """A started exporter, or None when ``config.enabled`` is false."""
    if not config.enabled:
        return None
    exporter = MetricsExporter(role, config)
    exporter.start()
    return exporter
