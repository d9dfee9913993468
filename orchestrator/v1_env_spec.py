"""TEMP shim: the v1 env spec lives in `primerl.orchestrator.envs.v1_spec`. Deleted once no importer is left."""

from primerl.orchestrator.envs.v1_spec import API_KEY_VAR, BOOTSTRAP_SCRIPT, V1EnvConfigError, V1EnvInfo, V1EnvSpec

__all__ = ["API_KEY_VAR", "BOOTSTRAP_SCRIPT", "V1EnvConfigError", "V1EnvInfo", "V1EnvSpec"]
