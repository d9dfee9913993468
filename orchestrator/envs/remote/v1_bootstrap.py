"""Run by the v1 env interpreter (verifiers 0.4; not imported by primerl): serves one verifiers v1 environment
with verifiers' own env server, or lists its taskset's tasks. Started by `primerl.orchestrator.envs.v1_server` and
`primerl.orchestrator.envs.v1_spec`.

    <v1 python> v1_bootstrap.py serve  < spec.json
    <v1 python> v1_bootstrap.py tasks  < spec.json

spec: {"env_config": {"taskset": {"id": "reverse-text-v1", ...args}, ...}, "address": "tcp://127.0.0.1:0",
       "max_workers": 1, "start": 0, "count": 100}

stdout, one JSON object per line:
  serve: {"event": "ready", "address": "tcp://127.0.0.1:PORT", "taskset": ID, "harnesses": {role: harness id}}
         once the env is loaded and the server bound; then verifiers' `EnvServer` serves the ZeroMQ protocol
         (`[request_id, method, msgpack]` -> deltas, then one reply) until SIGTERM.
  tasks: {"event": "tasks", "tasks": [task data dumped as JSON, ...], "bounded": bool}
  both:  {"event": "error", "kind": "config" | "load", "message": ...} and exit 2 (config) or 1 (load).

Offline and local only (the rules `check_local` enforces, each refusal naming the setting to change):
every role runs in the `subprocess` runtime (set when the environment does not choose one; a sandbox runtime it
asks for is refused), and its harness must not need a container nor be one of verifiers' built-in harnesses,
which install their program (uv, packages) at the first rollout.
"""

from __future__ import annotations

import os
import sys

# `python v1_bootstrap.py` puts this file's folder first on sys.path: its siblings must not shadow modules.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json
import logging

LOCAL_RUNTIME = "subprocess"
BUILTIN_HARNESS_PACKAGE = "verifiers.v1.harnesses."
EXIT_CONFIG = 2
EXIT_LOAD = 1


class LocalOnlyError(ValueError):
    """The environment asks for something this machine cannot give (a sandbox, an install at rollout time)."""


def emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def resolve_local_config(raw: dict):
    """The env config with every role on the local runtime; LocalOnlyError when it asks for another one."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    raw = json.loads(json.dumps(raw))
    config = resolve_env_config(raw)
    for role in agent_config_fields(config):
        role_raw = raw.setdefault(role, {})
        runtime = role_raw.get("runtime") if isinstance(role_raw, dict) else None
        if runtime is None:
            role_raw["runtime"] = {"type": LOCAL_RUNTIME}
        elif isinstance(runtime, dict) and runtime.get("type", LOCAL_RUNTIME) != LOCAL_RUNTIME:
            raise LocalOnlyError(
                f"role {role!r} asks for the {runtime.get('type')!r} runtime (a sandbox); primerl runs v1 "
                f"environments locally only: remove `{role}.runtime` from the environment's `v1_config` (or set "
                f"its type to {LOCAL_RUNTIME!r})"
            )
    return resolve_env_config(raw)


def check_local(config) -> dict[str, str]:
    """Refuse harnesses that need a container or install a program at the first rollout; {role: harness id}."""
    from verifiers.v1.utils.loaders import harness_class, task_type

    task_cls = task_type(config.taskset.id)
    if getattr(task_cls, "NEEDS_CONTAINER", False):
        raise LocalOnlyError(
            f"taskset {config.taskset.id!r}'s tasks need a container (NEEDS_CONTAINER); primerl "
            "runs v1 environments locally only (no sandbox runtime here)"
        )
    harnesses = {}
    for role, harness in config.agent_harnesses().items():
        cls = harness_class(harness.id)
        if cls.__module__.startswith(BUILTIN_HARNESS_PACKAGE):
            raise LocalOnlyError(
                f"role {role!r} uses verifiers' built-in harness {harness.id!r}, which installs its program (uv, "
                "packages) at the first rollout or needs a sandbox: ship an in-process harness in the environment "
                "package (a Harness subclass in its __all__, see examples/reverse_text_v1) or set "
                f"`{role}.harness.id` in the environment's `v1_config` to one"
            )
        if getattr(cls, "NEEDS_CONTAINER", False):
            raise LocalOnlyError(
                f"role {role!r}'s harness {harness.id!r} needs a container (NEEDS_CONTAINER); "
                "primerl runs v1 environments locally only"
            )
        harnesses[role] = harness.id
    return harnesses


def list_tasks(config, start: int, count: int) -> dict:
    """Tasks `start .. start+count` of the taskset, dumped as the env server's `run` expects them."""
    import itertools

    from verifiers.v1.utils.loaders import load_taskset

    taskset = load_taskset(config.taskset)
    tasks = [
        task.data.model_dump(mode="json", serialize_as_any=True, exclude_none=True)
        for task in itertools.islice(iter(taskset), start, start + count)
    ]
    return {"event": "tasks", "tasks": tasks, "bounded": bool(taskset.bounded)}


class _ReadyLine:
    """The `address_queue` of `serve_env`: it puts the bound address once the env is loaded."""

    def __init__(self, ready: dict) -> None:
        self.ready = ready

    def put(self, address: str) -> None:
        emit({**self.ready, "address": address})


def serve(config, spec: dict, harnesses: dict[str, str]) -> None:
    from verifiers.v1.serve import serve_env

    ready = {"event": "ready", "taskset": config.taskset.id, "harnesses": harnesses, "pid": os.getpid()}
    serve_env(
        max_workers=int(spec.get("max_workers", 1)),
        address=spec.get("address", "tcp://127.0.0.1:0"),
        address_queue=_ReadyLine(ready),
        config=config,
    )


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=os.environ.get("PRIMERL_V1_LOG_LEVEL", "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if len(argv) != 1 or argv[0] not in ("serve", "tasks"):
        emit({"event": "error", "kind": "config", "message": "usage: v1_bootstrap.py serve|tasks < spec.json"})
        return EXIT_CONFIG
    try:
        spec = json.loads(sys.stdin.read() or "{}")
        config = resolve_local_config(spec.get("env_config") or {})
        harnesses = check_local(config)
    except LocalOnlyError as exc:
        emit({"event": "error", "kind": "config", "message": str(exc)})
        return EXIT_CONFIG
    except (ValueError, TypeError, ImportError, AttributeError) as exc:  # pydantic's ValidationError is a ValueError
        emit({"event": "error", "kind": "config", "message": f"{type(exc).__name__}: {exc}"})
        return EXIT_CONFIG
    if argv[0] == "tasks":
        emit(list_tasks(config, int(spec.get("start", 0)), int(spec.get("count", 1))))
        return 0
    try:
        serve(config, spec, harnesses)
    except Exception as exc:  # the env failed to load or the server to bind: one line for the client, then exit
        logging.getLogger("primerl.v1_env_bootstrap").exception("env server failed")
        emit({"event": "error", "kind": "load", "message": f"{type(exc).__name__}: {exc}"})
        return EXIT_LOAD
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
