"""TEMP shim: the v1 env server's connection lives in `primerl.orchestrator.envs.v1_server` (`V1ServerConnection`).
Deleted once no importer is left."""

from primerl.orchestrator.envs.v1_server import API_KEY_VAR, V1EnvConfigError, V1EnvInfo
from primerl.orchestrator.envs.v1_server import V1ServerConnection as V1EnvServer

__all__ = ["API_KEY_VAR", "V1EnvConfigError", "V1EnvInfo", "V1EnvServer"]
