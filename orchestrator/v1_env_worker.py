"""TEMP shim: the v1 env client lives in `primerl.orchestrator.envs.v1` (`V1EnvClient`). Deleted once no importer
is left."""

from primerl.orchestrator.envs.v1 import MAX_TASKS, sampling_params, task_prompt
from primerl.orchestrator.envs.v1 import V1EnvClient as V1EnvWorker

__all__ = ["MAX_TASKS", "V1EnvWorker", "sampling_params", "task_prompt"]
