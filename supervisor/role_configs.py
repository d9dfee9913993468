"""The role configs `primerl rl` writes for its children: each role's CPU thread budget filled in, without the
run token (it reaches them in their environment only), and pinned to what a role bound at its first start, so
that a restart with the same command comes back where the others look for it. `RoleFiles` holds each role's
config with the file its command reads; the file always holds the config held."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from primerl.runtime.config_loader import write_toml
from primerl.runtime.cpu_budget import ThreadsConfig, available_cpus, default_budgets, fill_budget


def thread_budgets(run_config: Any, roles: dict, *, gpus: bool) -> dict[str, ThreadsConfig]:
    """Fill each role's unset ``threads`` fields (in ``roles``) from the default budgets of this process's CPUs
    (``primerl.runtime.cpu_budget``, shared or split by ``run_config.cpu_sharing``); returns every role's budget,
    the broker's included (its config has no ``threads`` table: environment only)."""
    cpus = available_cpus()
    defaults = default_budgets(
        cpus, gpus=gpus, num_trainer_ranks=len(run_config.trainer_gpu_ids), sharing=run_config.cpu_sharing
    )
    budgets = {"broker": defaults["broker"]}
    for role in ("trainer", "orchestrator", "inference", "teacher"):
        if role not in roles:
            continue  # no teacher in this run
        explicit = roles[role].threads
        default = defaults[role]
        if role == "teacher" and "cpus" not in explicit.model_fields_set and budgets["inference"].cpus:
            default = default.model_copy(update={"cpus": budgets["inference"].cpus})  # inference's, as set
        if (
            role in ("inference", "teacher")
            and explicit.num_threads is not None
            and explicit.cpus is None
            and default.cpus
        ):
            # vLLM runs one thread per bound CPU: a thread count asked for binds that many CPUs.
            default = default.model_copy(update={"cpus": cpus[: explicit.num_threads]})
        budgets[role] = fill_budget(explicit, default)
        roles[role] = roles[role].model_copy(update={"threads": budgets[role]})
    return budgets


def without_token(config: Any) -> Any:
    """A copy of a role config (or of the run config) with every run token removed, for writing to disk."""
    fields = type(config).model_fields
    if "run_token" in fields:
        return config.model_copy(update={"run_token": None})
    sections = ("broker", "trainer", "orchestrator", "inference", "teacher")
    updates = {
        name: without_token(getattr(config, name))
        for name in sections
        if name in fields and getattr(config, name) is not None
    }
    return config.model_copy(update=updates)


def pinned_broker(broker: Any, endpoints: dict) -> Any:
    """The broker's config with the ports and run id it bound (from its ready file): a restarted broker comes
    back with them (its spool dir is the config's already)."""
    update = {
        key: endpoints[key]
        for key in ("grpc_port", "rollout_port", "weight_port", "run_id")
        if endpoints.get(key) not in (None, "")
    }
    port = url_port(endpoints.get("metrics_url"))
    if port is not None and broker.prometheus.enabled:
        update["prometheus"] = broker.prometheus.model_copy(update={"port": port})
    return broker.model_copy(update=update)


def pinned_inference(inference: Any, served: dict) -> Any | None:
    """The inference (or teacher) config with the HTTP port it bound (from its ready file), or None when it has it
    already."""
    if served.get("http_port") and inference.server.port != served["http_port"]:
        server = inference.server.model_copy(update={"port": int(served["http_port"])})
        return inference.model_copy(update={"server": server})
    return None


def url_port(url: str | None) -> int | None:
    match = re.match(r"^[a-z]+://[^/]*:(\d+)(/|$)", url or "")
    return int(match.group(1)) if match else None


def has_gpus() -> bool:
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


class RoleFiles:
    """Each role's config and its file ``{run_dir}/<role>.toml`` (without the run token): a config set here is
    written at once, so a role started (or restarted) with its command reads the config held."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.configs: dict[str, Any] = {}
        self.paths: dict[str, Path] = {}

    def __contains__(self, role: str) -> bool:
        return role in self.configs

    def __getitem__(self, role: str) -> Any:
        return self.configs[role]

    def set(self, role: str, config: Any) -> Path:
        """Hold ``config`` as ``role``'s and write it to the role's file; returns the file."""
        self.configs[role] = config
        self.paths[role] = write_toml(without_token(config), self.run_dir / f"{role}.toml")
        return self.paths[role]
