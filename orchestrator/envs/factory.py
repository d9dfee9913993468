"""`EnvClients`: each `[[orchestrator.env]]` (and `[[orchestrator.eval.env]]`) table becomes a `ClassicEnvClient`
(in `env_python`) or a `V1EnvClient` (in `env_v1_python`), as `kinds.resolve_env_kinds` decides; both are
`EnvClient`s, so the rollout scheduler and the evals drive them alike. They start side by side (a v1 env server
takes 5-20 s: verifiers' imports). Errors that a restart cannot fix are `ValueError`s naming the setting (the
orchestrator exits 2): an id installed nowhere, a v1 environment configured for a sandbox, an empty environment.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from primerl.orchestrator.envs.base import EnvClient, EnvRequestError
from primerl.orchestrator.envs.classic import ClassicEnvClient
from primerl.orchestrator.envs.interpreters import EnvPython, find_env_python, find_v1_env_python
from primerl.orchestrator.envs.kinds import ResolvedEnv, is_missing_module, not_installed_message, resolve_env_kinds
from primerl.orchestrator.envs.v1 import V1EnvClient
from primerl.orchestrator.envs.v1_spec import V1EnvConfigError
from primerl.orchestrator.trajectory import EnvInfo
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator")

ENV_WORKER_MAX_RESTARTS = 3  # restarts of each env worker (or v1 env server) before the orchestrator gives up


def strip_v1(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def endpoint_version_fn(inference: Any) -> Callable[[str], int | None]:
    """`version_of(base_url)`: the policy version the inference worker at `base_url` serves, as last listed by the
    broker (``endpoints.InferenceWorkers``); None for one no longer listed. Read from the v1 client's IO thread."""

    def version_of(base_url: str) -> int | None:
        wanted = strip_v1(base_url)
        for endpoint in list(inference.endpoints.values()):
            if strip_v1(endpoint.base_url) == wanted:
                return int(endpoint.policy_version)
        return None

    return version_of


class EnvClients:
    """Builds and starts the environments of one orchestrator config (module docstring)."""

    def __init__(
        self,
        config: Any,
        *,
        env_python: str,
        version_of: Callable[[str], int | None] | None = None,
        probe: Callable[[str], Any] | None = None,
    ) -> None:
        self.config = config
        found = find_env_python(config.env_python)
        self.classic = found if found.path == env_python else EnvPython(env_python, "explicit")
        self.v1 = find_v1_env_python(config.env_v1_python)
        self.version_of = version_of
        self.probe = probe

    def resolve(self, envs: Sequence[Any], prefix: str) -> list[ResolvedEnv]:
        kwargs = {"probe": self.probe} if self.probe is not None else {}
        return resolve_env_kinds(
            [(f"{prefix}[{i}]", env) for i, env in enumerate(envs)], classic=self.classic, v1=self.v1, **kwargs
        )

    def build(self, resolved: ResolvedEnv) -> EnvClient:
        """The client of one env table, not started."""
        config, env = self.config, resolved.env
        if resolved.kind == "classic":
            return ClassicEnvClient(
                resolved.python,
                env.id,
                env.args,
                request_timeout_s=config.rollout_timeout_s,
                max_restarts=ENV_WORKER_MAX_RESTARTS,
            )
        return V1EnvClient(
            resolved.python,
            env.id,
            env.args,
            v1_config=env.v1_config,
            api_key=config.broker.run_token or "EMPTY",
            renderer_model=config.model.name,
            version_of=self.version_of,
            max_workers=config.v1_max_workers,
            request_timeout_s=config.rollout_timeout_s,
            max_restarts=ENV_WORKER_MAX_RESTARTS,
        )

    def start_all(
        self, envs: Sequence[Any], prefix: str, workers: MutableMapping[str, EnvClient]
    ) -> list[tuple[ResolvedEnv, EnvInfo]]:
        """Build every environment of `envs` (`prefix`: their setting, e.g. `orchestrator.env`) into `workers`
        (env id -> client; there first, so that closing `workers` ends them whatever happens) and start them side
        by side; their infos in config order. The first error is raised once all starts ended."""
        return self.start_groups([(envs, prefix, workers)])[0]

    def start_groups(
        self,
        groups: Sequence[tuple[Sequence[Any], str, MutableMapping[str, EnvClient]]],
        outcomes: MutableMapping[str, tuple[EnvClient, EnvInfo | BaseException]] | None = None,
    ) -> list[list[tuple[ResolvedEnv, EnvInfo]]]:
        """`start_all` of several lists of environments (training and eval) at once, all side by side; each
        start's outcome (its client and its info, or the error it raised) also goes into ``outcomes`` by setting
        (`orchestrator.env[0]`) before any error is raised."""
        planned = []
        for envs, prefix, workers in groups:
            for item in self.resolve(envs, prefix):
                if item.env.id in workers:
                    raise ValueError(
                        f"environment {item.env.id!r} is listed twice in {prefix}; keep one table per "
                        "environment (its weight sets how often it is sampled)"
                    )
                workers[item.env.id] = self.build(item)
                planned.append((len(planned), item, workers[item.env.id]))
        with concurrent.futures.ThreadPoolExecutor(max(1, len(planned)), thread_name_prefix="env-start") as pool:
            starts = [pool.submit(worker.start) for _, _, worker in planned]
            concurrent.futures.wait(starts)
        if outcomes is not None:
            for (_, item, worker), future in zip(planned, starts):
                outcomes[item.setting] = (worker, future.exception() or future.result())
        results: list[list[tuple[ResolvedEnv, EnvInfo]]] = [[] for _ in groups]
        group_of = [index for index, (envs, _, _) in enumerate(groups) for _ in envs]
        for (position, item, _), future in zip(planned, starts):
            try:
                info = future.result()
            except V1EnvConfigError as exc:  # the setting to change is in the message: no restart fixes it
                raise ValueError(f"{item.setting}: {exc}") from None
            except EnvRequestError as exc:
                if item.kind == "classic" and not item.listed and is_missing_module(exc, item.env.id):
                    raise ValueError(
                        not_installed_message(item.setting, item.env.id, classic=self.classic, v1=self.v1)
                    ) from None
                raise
            results[group_of[position]].append((item, info))
        return results


__all__ = ["ENV_WORKER_MAX_RESTARTS", "EnvClients", "endpoint_version_fn", "strip_v1"]
