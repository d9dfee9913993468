"""TEMP shim: the env interpreters' rule lives in `primerl.orchestrator.envs.interpreters`. Deleted once no importer
is left."""

from primerl.orchestrator.envs.interpreters import (
    ENV_PYTHON_VAR,
    ENV_VENV_NAME,
    V1_ENV_PYTHON_VAR,
    V1_ENV_VENV_NAME,
    VERIFIERS_V1_VERSION,
    VERIFIERS_VERSION,
    EnvInterpreterInfo,
    EnvProbeError,
    EnvPython,
    InstalledEnv,
    find_env_python,
    find_v1_env_python,
    installed_env_ids,
    probe_env_python,
    resolve_env_python,
    suggest_env_ids,
)

__all__ = [
    "ENV_PYTHON_VAR",
    "ENV_VENV_NAME",
    "V1_ENV_PYTHON_VAR",
    "V1_ENV_VENV_NAME",
    "VERIFIERS_V1_VERSION",
    "VERIFIERS_VERSION",
    "EnvInterpreterInfo",
    "EnvProbeError",
    "EnvPython",
    "InstalledEnv",
    "find_env_python",
    "find_v1_env_python",
    "installed_env_ids",
    "probe_env_python",
    "resolve_env_python",
    "suggest_env_ids",
]
