"""TEMP shim: the env kinds live in `primerl.orchestrator.envs.kinds`. Deleted once no importer is left."""

from primerl.orchestrator.envs.kinds import (
    INSTALL_COMMAND,
    ResolvedEnv,
    is_missing_module,
    normalize_env_id,
    not_installed_message,
    resolve_env_kinds,
)

__all__ = [
    "INSTALL_COMMAND",
    "ResolvedEnv",
    "is_missing_module",
    "normalize_env_id",
    "not_installed_message",
    "resolve_env_kinds",
]
