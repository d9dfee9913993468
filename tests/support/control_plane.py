"""An in-process control plane for tests (no data planes): a `WorkerRegistry` behind a real gRPC server on a free
loopback port, with its heartbeat monitor, and control clients for it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from primerl.broker.control_service import BrokerServicer, HeartbeatMonitor, create_grpc_server
from primerl.broker.registry import WorkerRegistry
from primerl.broker.run_status import DataPlaneStatus, QueueDepth
from primerl.client.control import ControlClient
from primerl.runtime.config_common import BrokerClientConfig

INTERVAL_S = 0.1
LIVENESS = 3
TOKEN = "s3cret-token"


@dataclass
class Broker:
    """A running control plane; ``released``: the steps whose commits released batches."""

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
    heartbeat_budget_per_s: float = 0.0,
) -> Broker:
    """A control plane on ``127.0.0.1:port`` (0: a free port) whose fan-out holds policy v2."""
    released: list[int] = []

    def on_commit(step: int) -> int:
        released.append(step)
        return 1

    registry = WorkerRegistry(
        "test-run",
        interval_s,
        liveness,
        max_steps=20,
        on_commit=on_commit,
        heartbeat_budget_per_s=heartbeat_budget_per_s,
    )
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


def client_for(broker: Broker, name: str, role: str = "trainer", **config: Any) -> ControlClient:
    """A control client of ``broker`` (not registered yet)."""
    return ControlClient(BrokerClientConfig(address=broker.address, connect_timeout_s=5, **config), role, name)


@contextlib.contextmanager
def running_broker(**kwargs: Any) -> Iterator[Broker]:
    """``start_broker(**kwargs)``, stopped on leaving."""
    broker = start_broker(**kwargs)
    try:
        yield broker
    finally:
        broker.stop()
