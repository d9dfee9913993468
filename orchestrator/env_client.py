"""TEMP shim: the classic env client lives in `primerl.orchestrator.envs.classic` (`ClassicEnvClient`), the errors in
`primerl.orchestrator.envs.base`. Deleted once no importer is left."""

from primerl.orchestrator.envs.base import EnvRequestError, EnvRequestTimeout, EnvWorkerDied, EnvWorkerError
from primerl.orchestrator.envs.classic import WORKER_SCRIPT
from primerl.orchestrator.envs.classic import ClassicEnvClient as EnvWorker

__all__ = ["EnvRequestError", "EnvRequestTimeout", "EnvWorker", "EnvWorkerDied", "EnvWorkerError", "WORKER_SCRIPT"]
