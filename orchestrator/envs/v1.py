"""`V1EnvClient`: a verifiers v1 environment (verifiers 0.4: a Taskset/Harness package) as an `EnvClient`, so the
runner, the rollout scheduler and the evals drive it as they drive a classic one. Imports no verifiers.

    client = V1EnvClient(v1_python, "reverse-text-v1", {"num_examples": 2000}, api_key=run_token,
                         renderer_model=model_dir, version_of=lambda base_url: endpoint_version(base_url))
    info = client.start()        # the env server (V1ServerConnection) and the task listing, side by side
    futures = client.submit_rollouts([3, 17], num_rollouts=8, base_url=url, model=name, sampling={...})

Underneath, a `v1_server.V1ServerConnection`: the env server process and its ZeroMQ client. The tasks are listed
once at start (`remote/v1_bootstrap.py tasks`: the orchestrator owns the data; at most `MAX_TASKS`), and example
i is task i. A group's inference server is the `base_url` the scheduler chose for it (the env server builds a
client per run); its turns get the policy version that server reports (`version_of(base_url)`) at dispatch and
at the reply. `split` is ignored: a v1 environment's tasks are the ones its `args` give (an eval env table sets
its own, e.g. `split = "eval"`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from primerl.orchestrator.envs.base import EnvRequestError, EnvWorkerDied, OneExampleCalls, RolloutRequest
from primerl.orchestrator.envs.v1_server import V1ServerConnection
from primerl.orchestrator.trajectory import EnvInfo, Example, RolloutGroup, SamplingParams
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.v1_env")

MAX_TASKS = 100_000
"""Tasks listed from a taskset at start; a taskset with more (or an infinite one) is trained on its first ones."""
PLACEHOLDER_BASE_URL = "http://127.0.0.1:1"
"""The env server's default inference URL: never used, every group names the server the scheduler chose."""


def sampling_params(sampling: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """`[orchestrator.sampling]` as a dict (what the scheduler passes) -> `SamplingParams`."""
    if isinstance(sampling, SamplingParams):
        return sampling
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    values = {k: v for k, v in dict(sampling or {}).items() if k in names}
    if values.get("stop") is not None:
        values["stop"] = tuple(values["stop"])
    return SamplingParams(**values)


def task_prompt(task: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A task's prompt as chat messages (its system prompt, then its prompt), for prompt-length checks."""
    messages = [{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else []
    prompt = task.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif isinstance(prompt, list):
        messages.extend(m for m in prompt if isinstance(m, dict))
    return messages


class V1EnvClient(OneExampleCalls):
    """One verifiers v1 environment served by its env server (module docstring)."""

    def __init__(
        self,
        env_python: str,
        env_id: str,
        args: Mapping[str, Any] | None = None,
        *,
        v1_config: Mapping[str, Any] | None = None,
        api_key: str | None = None,
        renderer_model: str | None = None,
        version_of: Callable[[str], int | None] | None = None,
        max_workers: int = 1,
        request_timeout_s: float = 1800.0,
        start_timeout_s: float = 120.0,
        max_restarts: int = 3,
        max_tasks: int = MAX_TASKS,
        extra_env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.server = V1ServerConnection(
            env_python,
            env_id,
            args,
            base_url=PLACEHOLDER_BASE_URL,
            api_key=api_key,
            renderer_model=renderer_model,
            v1_config=v1_config,
            max_workers=max_workers,
            request_timeout_s=request_timeout_s,
            start_timeout_s=start_timeout_s,
            max_restarts=max_restarts,
            extra_env=extra_env,
            cwd=cwd,
        )
        self.env_python = env_python
        self.env_id = env_id
        self.args = dict(args or {})
        self.version_of = version_of
        self.max_tasks = max_tasks
        self.start_timeout_s = start_timeout_s
        self.info: EnvInfo | None = None
        self.tasks: list[dict[str, Any]] = []

    # lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> EnvInfo:
        """List the tasks (a one-shot bootstrap run) while the env server starts; `EnvInfo` with their number."""
        listed: concurrent.futures.Future = concurrent.futures.Future()

        def list_tasks() -> None:
            try:
                listed.set_result(self.server.tasks(0, self.max_tasks, timeout_s=self.start_timeout_s))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter below
                listed.set_exception(exc)

        threading.Thread(target=list_tasks, name=f"v1env-{self.env_id}-tasks", daemon=True).start()
        try:
            self.server.start()
            self.tasks = listed.result(timeout=self.start_timeout_s + 30.0)
        except BaseException:
            self.server.close()
            raise
        if len(self.tasks) >= self.max_tasks:
            log.warning(
                "the v1 taskset has more tasks than are listed (or is infinite); training on the first ones",
                env_id=self.env_id,
                num_tasks=len(self.tasks),
            )
        harnesses = ",".join(f"{role}={harness}" for role, harness in (self.server.info.harnesses or {}).items())
        self.info = EnvInfo(
            env_id=self.env_id,
            env_class=f"v1 ({harnesses or 'no harness'})",
            num_examples=len(self.tasks),
            num_eval_examples=len(self.tasks),
            has_eval_dataset=False,
        )
        return self.info

    def is_alive(self) -> bool:
        return self.server.is_alive()

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def num_restarts(self) -> int:
        return self.server.num_restarts

    @property
    def max_restarts(self) -> int:
        return self.server.max_restarts

    def ensure_alive(self) -> EnvInfo:
        """Restart a dead env server (its tasks stay listed); EnvWorkerDied once `max_restarts` are used up."""
        if self.info is None:
            return self.start()
        self.server.ensure_alive()
        return self.info

    def close(self, timeout_s: float = 10.0) -> int | None:
        return self.server.close(timeout_s)

    def stderr_tail(self) -> str:
        return self.server.stderr_tail()

    # requests ----------------------------------------------------------------------------------------------------
    def examples(self, split: str = "train", start: int = 0, count: int = 1) -> list[Example]:
        """Tasks `start .. start+count` as `Example`s (prompt as chat messages)."""
        return [
            Example(
                index=index,
                example_id=task.get("idx", index),
                prompt=task_prompt(task),
                answer=task.get("answer"),
                info={},
            )
            for index, task in enumerate(self.tasks[start : start + count], start)
        ]

    def submit_groups(
        self, example_indices: Sequence[int], request: RolloutRequest
    ) -> list[concurrent.futures.Future[RolloutGroup]]:
        """One group of `num_rollouts` runs per example, on the inference server `base_url`. A group that cannot
        be sent (the server died) gets a future failed with `EnvWorkerDied` (the scheduler reschedules it)."""
        params, base_url = sampling_params(request.sampling), request.base_url
        version_fn = (lambda: self.version_of(base_url)) if self.version_of is not None else None
        futures = []
        for index in example_indices:
            try:
                if not 0 <= index < len(self.tasks):
                    raise EnvRequestError(
                        "bad_request", f"example {index} is out of range: {self.env_id!r} has {len(self.tasks)} tasks"
                    )
                futures.append(
                    self.server.submit_group(
                        self.tasks[index],
                        example_index=index,
                        num_rollouts=request.num_rollouts,
                        model=request.model,
                        sampling=params,
                        timeout_s=request.timeout_s,
                        base_url=base_url,
                        policy_version_fn=version_fn,
                    )
                )
            except (EnvWorkerDied, EnvRequestError) as exc:
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(exc)
                futures.append(failed)
        return futures

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancel a group's runs in the env server (its future fails with EnvRequestError "cancelled")."""
        self.server.cancel(future)

    def num_pending(self) -> int:
        return self.server.num_pending()


__all__ = ["MAX_TASKS", "V1EnvClient", "sampling_params", "task_prompt"]
