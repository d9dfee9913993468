"""What the orchestrator knows of one verifiers v1 environment before its env server runs: the interpreter, the
verifiers `EnvConfig` data it is served with, the server's environment variables, and the one-shot bootstrap
runs (`remote/v1_bootstrap.py tasks`: the taskset's tasks, listed on the orchestrator's side). Used by
`v1_server.V1ServerConnection`; imports no verifiers.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primerl.orchestrator.envs.base import EnvRequestTimeout, EnvWorkerDied, EnvWorkerError
from primerl.orchestrator.trajectory import SamplingParams

BOOTSTRAP_SCRIPT = Path(__file__).parent / "remote" / "v1_bootstrap.py"
API_KEY_VAR = "PRIMERL_V1_API_KEY"
"""The env server reads the inference server's run token from this variable (its `client.api_key_var`)."""


class V1EnvConfigError(EnvWorkerError):
    """The environment cannot run here as configured; the message names the setting to change."""


@dataclass(frozen=True)
class V1EnvInfo:
    env_id: str
    address: str
    harnesses: dict[str, str]


def sampling_payload(sampling: SamplingParams) -> dict[str, Any]:
    """primerl's sampling as verifiers' `SamplingConfig` (extra keys pass through to vLLM's SamplingParams)."""
    payload = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
    if sampling.top_k != -1:
        payload["top_k"] = sampling.top_k
    if sampling.min_p:
        payload["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1.0:
        payload["repetition_penalty"] = sampling.repetition_penalty
    if sampling.stop:
        payload["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        payload["seed"] = sampling.seed
    return {k: v for k, v in payload.items() if v is not None}


def last_event(stdout: str) -> dict[str, Any] | None:
    """The last JSON event line the bootstrap printed."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            return event
    return None


@dataclass
class V1EnvSpec:
    """One v1 environment: `env_id` (its taskset package), the taskset `args`, and `v1_config` (the rest of the
    verifiers `EnvConfig`: roles, harness and runtime settings, timeouts)."""

    env_python: str
    env_id: str
    args: dict[str, Any] = field(default_factory=dict)
    v1_config: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None

    def env_config(self, taskset_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The verifiers `EnvConfig` data: `v1_config` with the taskset id and args."""
        config = json.loads(json.dumps(self.v1_config))
        taskset = config.setdefault("taskset", {})
        taskset.update({**self.args, **dict(taskset_args or {}), "id": self.env_id})
        return config

    def environ(self) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self.extra_env,
        }
        env[API_KEY_VAR] = self.api_key or "EMPTY"
        return env

    def check_python(self) -> None:
        if not Path(self.env_python).exists():
            raise EnvWorkerDied(
                f"v1 env python {self.env_python} does not exist: build the v1 env venv (make setup, "
                "or `primerl env install` of a v1 environment)"
            )

    def raise_error_event(self, event: dict[str, Any] | None, stderr_tail: str = "") -> None:
        """The typed error of a bootstrap error event: V1EnvConfigError (the setting to change) or
        EnvWorkerDied (the environment failed to load)."""
        if event is None or event.get("event") != "error":
            return
        message = f"v1 env {self.env_id!r}: {event.get('message')}"
        if event.get("kind") == "config":
            raise V1EnvConfigError(f"{message} (orchestrator.env id = {self.env_id!r})")
        tail = "\n".join(stderr_tail.strip().splitlines()[-10:])
        raise EnvWorkerDied(f"{message}\n{tail}" if tail else message)

    def run_bootstrap(self, mode: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Run the bootstrap once: its last event, or the typed error."""
        self.check_python()
        try:
            done = subprocess.run(
                [self.env_python, str(BOOTSTRAP_SCRIPT), mode],
                input=json.dumps(spec),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=self.environ(),
                cwd=self.cwd,
            )
        except subprocess.TimeoutExpired:
            raise EnvRequestTimeout(f"v1 env {self.env_id!r}: {mode} took over {timeout_s:g} s") from None
        event = last_event(done.stdout)
        self.raise_error_event(event, done.stderr)
        if done.returncode != 0 or event is None:
            raise EnvWorkerDied(
                f"v1 env {self.env_id!r}: {mode} exited {done.returncode}: "
                f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}"
            )
        return event

    def tasks(
        self, start: int = 0, count: int = 1, *, taskset_args: Mapping[str, Any] | None = None, timeout_s: float = 300.0
    ) -> list[dict[str, Any]]:
        """Task data `start .. start+count` of the taskset (what `run` sends); `taskset_args` override the args
        (e.g. an eval split). The env server never loads data: the orchestrator owns the tasks."""
        event = self.run_bootstrap(
            "tasks", {"env_config": self.env_config(taskset_args), "start": start, "count": count}, timeout_s
        )
        return list(event.get("tasks") or [])
