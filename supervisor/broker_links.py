"""What `primerl rl` opens on the running broker, each with the trainer's credentials: the status client of its
progress line, ``{run_dir}/run.json`` for ``primerl status``, and the run's web page."""

from __future__ import annotations

import os
from pathlib import Path

from primerl.runtime.config_common import BrokerClientConfig
from primerl.supervisor.run_file import RunFile

STATUS_TIMEOUT_S = 2.0


def status_client(address: str, token: str, broker: BrokerClientConfig):
    """A ``ControlClient`` that reads the run's status (answers bounded by ``STATUS_TIMEOUT_S``)."""
    from primerl.client.control import ControlClient

    return ControlClient(
        BrokerClientConfig(
            address=address,
            run_token=token,
            tls_ca_path=broker.tls_ca_path,
            tls_cert_path=broker.tls_cert_path,
            tls_key_path=broker.tls_key_path,
            tls_server_name=broker.tls_server_name,
        ),
        role="client",
        name="primerl-rl",
        rpc_timeout_s=STATUS_TIMEOUT_S,
    )


def run_file(address: str, token: str, run_id: str | None, broker: BrokerClientConfig) -> RunFile:
    """The run file's content: the broker's address, the token and absolute credential paths."""

    def absolute(path: Path | None) -> str | None:
        return str(Path(path).resolve()) if path else None

    return RunFile(
        broker_address=address,
        run_token=token,
        tls_ca_path=absolute(broker.tls_ca_path),
        run_id=run_id or None,
        launcher_pid=os.getpid(),
        tls_cert_path=absolute(broker.tls_cert_path),
        tls_key_path=absolute(broker.tls_key_path),
        tls_server_name=broker.tls_server_name,
    )


def dashboard_server(run_dir: Path, address: str, token: str, broker: BrokerClientConfig, port: int):
    """The run's web page (loopback, not yet serving), reading the run directory and the broker; ``OSError`` or
    ``ValueError`` when it cannot be served."""
    from primerl.dashboard.server import Dashboard, DashboardServer
    from primerl.dashboard.sources import RunDirSource, connect_broker

    source = connect_broker(
        address,
        token,
        tls_ca_path=broker.tls_ca_path and str(broker.tls_ca_path),
        tls_cert_path=broker.tls_cert_path and str(broker.tls_cert_path),
        tls_key_path=broker.tls_key_path and str(broker.tls_key_path),
        tls_server_name=broker.tls_server_name,
    )
    return DashboardServer(Dashboard(RunDirSource(run_dir), source), "127.0.0.1", port)


def new_metrics_urls(status, announced: set[str]) -> list[str]:
    """A line for each worker of the run ``status`` whose metrics URL (the `metrics_url` it registered with) is
    not yet in ``announced`` (its name is added)."""
    from primerl.proto.v1 import common_pb2

    lines = []
    for worker in status.workers:
        url = worker.capabilities.get("metrics_url")
        if url and worker.name not in announced:
            announced.add(worker.name)
            served = (common_pb2.ROLE_INFERENCE, common_pb2.ROLE_TEACHER)
            auth = " (with the run token as bearer token)" if worker.role in served else ""
            lines.append(f"  {worker.name} metrics at {url}{auth}")
    return lines
