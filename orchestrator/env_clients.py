"""TEMP shim: `EnvClients` lives in `primerl.orchestrator.envs.factory`. Deleted once no importer is left."""

from primerl.orchestrator.envs.factory import ENV_WORKER_MAX_RESTARTS, EnvClients, endpoint_version_fn, strip_v1

__all__ = ["ENV_WORKER_MAX_RESTARTS", "EnvClients", "endpoint_version_fn", "strip_v1"]
