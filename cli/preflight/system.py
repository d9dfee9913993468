"""Preflight checks of the machine: fixed ports that are free, W&B without a login (logged offline instead), and
memory for the vLLM engines of a CPU run (inference, and the teacher of online distillation: a second engine).

All are checked by binding and by reading files only: no network."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from primerl.cli.preflight.base import Check, Finding, error, warning


@dataclass(frozen=True)
class PortUse:
    """A fixed port a role will bind: ``setting`` names the port's key, ``host_setting`` the interface's."""

    setting: str
    host_setting: str
    host: str
    port: int


def broker_ports(broker, prefix: str = "broker.") -> list[PortUse]:
    host_setting = f"{prefix}host"
    uses = [
        PortUse(f"{prefix}{name}", host_setting, broker.host, getattr(broker, name))
        for name in ("grpc_port", "rollout_port", "weight_port")
    ]
    if broker.prometheus.enabled:
        uses.append(
            PortUse(
                f"{prefix}prometheus.port", f"{prefix}prometheus.host", broker.prometheus.host, broker.prometheus.port
            )
        )
    return uses


def rl_ports(config) -> list[PortUse]:
    """Every port of a `primerl rl` run (all roles on this machine)."""
    uses = broker_ports(config.broker)
    for role in ("inference", "teacher"):
        if getattr(config, role, None) is None:
            continue
        server = getattr(config, role).server
        uses.append(PortUse(f"{role}.server.port", f"{role}.server.host", server.host, server.port))
    for role in ("trainer", "orchestrator"):
        prometheus = getattr(config, role).prometheus
        if prometheus.enabled:
            uses.append(PortUse(f"{role}.prometheus.port", f"{role}.prometheus.host", prometheus.host, prometheus.port))
    return uses


def port_problem(use: PortUse) -> str | None:
    """Why ``use`` cannot be bound now, as the line to print; None when it can (0 always can: a free port)."""
    if use.port == 0:
        return None
    try:
        infos = socket.getaddrinfo(use.host, use.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return (
            f"{use.host_setting} = {use.host!r} is not a known host ({exc.strerror}); set it to an address of "
            "this machine (127.0.0.1, or 0.0.0.0 for all interfaces)"
        )
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # as the servers do: a port left in TIME_WAIT by a run that just ended is free, a listening one is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            where = f"{use.host}:{use.port}"
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"{use.setting} = {use.port}: {where} is already in use by another process (another run?); "
                    f"set {use.setting} to a free port, or 0 to pick one"
                )
            if exc.errno == errno.EACCES:
                return (
                    f"{use.setting} = {use.port}: binding {where} needs privileges (ports below 1024); "
                    f"set {use.setting} to a port >= 1024, or 0 to pick one"
                )
            if exc.errno == errno.EADDRNOTAVAIL:
                return (
                    f"{use.host_setting} = {use.host!r} is not an address of this machine; set it to one "
                    "(127.0.0.1, or 0.0.0.0 for all interfaces)"
                )
            return f"{use.setting} = {use.port}: {where} cannot be bound ({exc.strerror}); set {use.setting} to 0"
    return None


def port_check(uses: list[PortUse]) -> Check:
    def check() -> list[Finding]:
        seen: set[str] = set()
        findings = []
        for use in uses:
            problem = port_problem(use)
            if problem is not None and problem not in seen:
                seen.add(problem)
                findings.append(error(problem))
        return findings

    return check


def wandb_check(role_configs: Mapping[str, object]) -> Check:
    """W&B as each role will start it (``metrics_sink.wandb_plan``): a warning when it falls back to offline (no
    login) or off (no wandb package); one line for all roles, they share the fallback."""

    def check() -> list[Finding]:
        from primerl.runtime.metrics_sink import wandb_plan

        notes: dict[str, list[str]] = {}
        for role, config in role_configs.items():
            wandb_config = getattr(config, "wandb", None)
            if wandb_config is None:
                continue
            plan = wandb_plan(wandb_config, config.output_dir)
            if plan.note:
                notes.setdefault(plan.note, []).append(role)
        return [warning(f"W&B ({' and '.join(roles)}): {note}") for note, roles in notes.items()]

    return check


ENGINE_OVERHEAD_BYTES = 2 * 2**30
"""Memory of one vLLM engine on CPU besides its KV cache: the server and its engine-core process with the weights
of a small model (~2.1 GB measured for the tiny model, multiprocess mode); a larger model adds its weights."""


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def engine_memory_check(engines: Mapping[str, object], *, gpus: bool, available_bytes: int | None = None) -> Check:
    """On a CPU machine, a warning when the vLLM engines (``{role: InferenceConfig}``) need more memory than is
    available: each holds its KV cache (``kv_cache_memory_bytes``, the CPU default when unset) plus about
    ``ENGINE_OVERHEAD_BYTES``. On GPUs the KV cache is GPU memory: nothing to check here."""

    def check() -> list[Finding]:
        from primerl.inference.engine import CPU_DEFAULT_KV_CACHE_BYTES

        available = available_memory_bytes() if available_bytes is None else available_bytes
        if gpus or available is None:
            return []
        caches = {
            role: getattr(config, "kv_cache_memory_bytes", None) or CPU_DEFAULT_KV_CACHE_BYTES
            for role, config in engines.items()
        }
        needed = sum(caches.values()) + ENGINE_OVERHEAD_BYTES * len(engines)
        if needed <= available:
            return []
        gib = 2**30
        parts = " + ".join(f"{role} KV cache {size / gib:.2f} GiB" for role, size in caches.items())
        settings = " and ".join(f"{role}.kv_cache_memory_bytes" for role in engines)
        return [
            warning(
                f"{len(engines)} vLLM engine(s) need about {needed / gib:.1f} GiB ({parts}, ~"
                f"{ENGINE_OVERHEAD_BYTES / gib:.0f} GiB each for the engine) but {available / gib:.1f} GiB "
                f"are available; lower {settings} (e.g. 67108864 = 64 MiB for a small model)"
            )
        ]

    return check
