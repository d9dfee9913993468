"""The ready file: the JSON a role daemon writes once it serves (``--ready-file PATH``), for whoever started it
(``primerl rl``, ``make chaos``, tests) to learn the ports it bound. One writer (``write_ready_file``, atomic: a
reader sees all of it or no file) and one reader (``read_ready_file``).

    key           written by          value
    role          broker, inference   "broker" | "inference" | "teacher" (``primerl-infer --role teacher``)
    pid           broker, inference   the daemon's process id
    grpc_port     broker              the control plane's port (``BrokerEndpoints``)
    rollout_port  broker              the rollout plane's port
    weight_port   broker              the weight plane's port
    run_id        broker              the run's id
    metrics_url   broker              its Prometheus /metrics URL, or null
    http_port     inference           the OpenAI-compatible server's port
    base_url      inference           its base URL (``http://host:port/v1``)
    advertised_url inference          the URL it registered with the broker (``server.advertise_host``)
    worker_id     inference           its worker id at the broker

In a ``primerl rl`` run directory the files are named by ``READY_FILE_NAMES``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

READY_FILE_NAMES = {"broker": "broker.ready.json", "inference": "inference.ready.json", "teacher": "teacher.ready.json"}
"""Role -> the name of its ready file in a run directory (the roles that write one)."""


def ready_file_path(run_dir: str | os.PathLike[str], role: str) -> Path:
    """Where ``role`` writes its ready file in a run directory."""
    return Path(run_dir) / READY_FILE_NAMES[role]


def write_ready_file(path: str | os.PathLike[str], role: str, info: dict[str, Any]) -> None:
    """Write ``info`` with the role and this process's pid as JSON to ``path``, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps({**info, "role": role, "pid": os.getpid()}))
    os.replace(temporary, path)


def read_ready_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ready file's JSON, or None while there is none (the daemon is not serving yet)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


__all__ = ["READY_FILE_NAMES", "read_ready_file", "ready_file_path", "write_ready_file"]
