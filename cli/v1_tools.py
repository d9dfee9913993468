"""`primerl eval` and `primerl sft-data` on verifiers v1 environments (verifiers 0.4: a Taskset and a Harness,
installed by `primerl env install` into the v1 env venv, `cli/env_v1.py`).

Which kind an id is (`--kind auto`, the default): the v1 env interpreter (`--env-v1-python`, else
`$PRIMERL_ENV_V1_PYTHON`, else `.venv-envs-v1` beside primerl's venv) is asked which v1 environments it holds
(`envs/remote/probe.py`: package metadata, nothing imported); an id it holds is a v1 environment, any other id
goes the classic way (an env worker in the classic env interpreter). `--kind v1|classic` skips the question.

Tasks: the bootstrap lists the taskset's tasks on primerl's side (`V1EnvSpec.run_bootstrap("tasks")`; the env
server never loads data). Splits: v1 has none in general; `--split eval` sets the taskset's own `split` setting
(`examples/reverse_text_v1` has one) and is refused, with what to do, for a taskset without it. Without `--split`,
eval takes split="eval" when the taskset accepts it, else the taskset's tasks as configured (reported as "train").
`-a/--env-args` are the taskset's arguments (a `split` there wins).

eval: the tasks run through a `V1ServerConnection` (verifiers' own env server in the v1 interpreter) against the model
served by primerl-infer's token route; `V1EvalEnv` gives the server an env worker's `submit_rollout`, so
`evaluation.run_eval_groups` (the in-flight bound, per-example seeds) and eval's output files and console are the
classic ones: reward = `Rollout.reward` (the root trace's weighted rewards), metrics = the taskset's metrics, the
reply = the rollout's completion messages.

sft-data: each task's prompt (its `system_prompt` as a system message, then its `prompt`) with its text `answer`
as the assistant's reply; a taskset whose task data hold no text `answer` is refused with the reason.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from primerl.orchestrator.envs.interpreters import (
    V1_ENV_PYTHON_VAR,
    V1_ENV_VENV_NAME,
    EnvProbeError,
    find_v1_env_python,
    probe_env_python,
)

KINDS = ("auto", "classic", "v1")
ALL_TASKS_FIRST = 10_000
"""`-n -1`: the first listing asks for this many tasks; a bounded taskset with more is listed again in full, an
infinite one is refused (give -n)."""
LIST_TIMEOUT_S = 300.0
KIND_HELP = (
    "environment kind: classic (load_environment, verifiers 0.3) or v1 (Taskset/Harness, verifiers 0.4); "
    "auto: v1 when the v1 env interpreter has the id (default: %(default)s)"
)
V1_PYTHON_HELP = (
    f"interpreter of v1 environments (default: ${V1_ENV_PYTHON_VAR}, else {V1_ENV_VENV_NAME} next to primerl's venv)"
)


class V1ToolError(ValueError):
    """Bad input or an environment the command cannot use: the message says why and what to do."""


def add_kind_arguments(parser: Any) -> None:
    """`--kind` and `--env-v1-python`, as eval and sft-data take them."""
    parser.add_argument("--kind", choices=KINDS, default="auto", help=KIND_HELP)
    parser.add_argument("--env-v1-python", default=None, metavar="PATH", help=V1_PYTHON_HELP)


def v1_env_ids(v1_python: str | None) -> list[str]:
    """The v1 environments installed in `v1_python` ([] when it cannot be asked)."""
    if v1_python is None or not Path(v1_python).exists():
        return []
    try:
        return [env.id for env in probe_env_python(v1_python).envs if env.kind == "v1"]
    except EnvProbeError:
        return []


def usable_v1_python(explicit: str | None) -> str | None:
    """The v1 env interpreter by the rule when it exists (never primerl's own interpreter unless given)."""
    found = find_v1_env_python(explicit)
    return found.path if found.source != "this_interpreter" and Path(found.path).exists() else None


def resolve_kind(env_id: str, kind: str, v1_python_explicit: str | None) -> tuple[str, str | None]:
    """("classic" | "v1", the v1 interpreter or None) for `env_id` (see the module docstring)."""
    if kind == "classic":
        return "classic", None
    if v1_python_explicit is not None and not Path(v1_python_explicit).exists():
        raise V1ToolError(f"--env-v1-python {v1_python_explicit} does not exist")
    v1_python = usable_v1_python(v1_python_explicit)
    if kind == "v1":
        if v1_python is None:
            raise V1ToolError(
                f"no v1 env interpreter ({find_v1_env_python(v1_python_explicit).describe()} does "
                "not exist or is primerl's own): `make setup` builds .venv-envs-v1, `primerl env "
                "install PATH` of a v1 environment creates it, or pass --env-v1-python"
            )
        return "v1", v1_python
    if v1_python is not None and env_id in v1_env_ids(v1_python):
        return "v1", v1_python
    return "classic", None


def _taskset_has_no_split(exc: Exception) -> bool:
    text = str(exc)  # pydantic: "taskset.split\n  Extra inputs are not permitted [type=extra_forbidden, ...]"
    return "taskset.split" in text and ("extra_forbidden" in text or "Extra inputs" in text)


def list_tasks(spec: Any, *, split: str | None, count: int | None) -> tuple[list[dict[str, Any]], str]:
    """The first `count` tasks (None: all) of `spec`'s taskset in `split`, and the split they are.

    `split` None: "eval" when the taskset accepts split="eval", else its tasks as configured ("train")."""
    from primerl.orchestrator.envs.v1_spec import V1EnvConfigError

    if "split" in spec.args:  # the taskset's own argument decides
        return _list(spec, {}, count), str(spec.args["split"])
    if split == "train":
        return _list(spec, {}, count), "train"
    try:
        return _list(spec, {"split": "eval"}, count), "eval"
    except V1EnvConfigError as exc:
        if not _taskset_has_no_split(exc):
            raise
        if split == "eval":
            raise V1ToolError(
                f"v1 taskset {spec.env_id!r} has no `split` setting, so it has no eval split: leave "
                "--split out (its tasks as configured), or give the taskset's own arguments that "
                "select held-out tasks with -a/--env-args"
            ) from None
    return _list(spec, {}, count), "train"


def _list(spec: Any, taskset_args: Mapping[str, Any], count: int | None) -> list[dict[str, Any]]:
    def run(want: int) -> dict[str, Any]:
        return spec.run_bootstrap(
            "tasks", {"env_config": spec.env_config(taskset_args), "start": 0, "count": want}, LIST_TIMEOUT_S
        )

    if count is not None:
        return list(run(count).get("tasks") or [])
    event = run(ALL_TASKS_FIRST)
    tasks = list(event.get("tasks") or [])
    if len(tasks) < ALL_TASKS_FIRST:
        return tasks
    if not event.get("bounded"):
        raise V1ToolError(
            f"v1 taskset {spec.env_id!r} is infinite (its tasks never end): give how many to use with -n/--num-examples"
        )
    return list(run(1 << 62).get("tasks") or [])


def with_split(env_args: Mapping[str, Any], split: str) -> dict[str, Any]:
    """The taskset arguments the listed tasks came from (`list_tasks`'s split), for the env server's config."""
    return dict(env_args) if split != "eval" or "split" in env_args else {**env_args, "split": "eval"}


class V1EvalEnv:
    """A `V1ServerConnection` with its listed tasks, answering an env worker's `submit_rollout` (what
    `evaluation.run_eval_groups` calls): example `index` is `tasks[index]`, a group of N concurrent runs."""

    def __init__(self, server: Any, tasks: list[dict[str, Any]]) -> None:
        self.server = server
        self.tasks = tasks

    def submit_rollout(
        self,
        index: int,
        *,
        split: str,
        num_rollouts: int,
        base_url: str,
        model: str,
        api_key: str,
        sampling: Mapping[str, Any],
        timeout_s: float,
    ) -> concurrent.futures.Future:
        from primerl.orchestrator.envs.v1 import sampling_params

        del split, api_key  # the tasks are the split's; the key is the env server's (V1ServerConnection(api_key=...))
        task, params = self.tasks[index], sampling_params(sampling)
        return self.server.submit_group(
            task,
            example_index=index,
            num_rollouts=num_rollouts,
            model=model,
            sampling=params,
            timeout_s=timeout_s,
            base_url=base_url,
        )


# ------------------------------------------------------------------------------------------------ sft-data
def sft_row(task: Mapping[str, Any], env_id: str) -> dict[str, Any]:
    """One SFT sample of a listed task: {"prompt": messages, "completion": [assistant: answer]}."""
    answer = task.get("answer")
    if not isinstance(answer, str) or not answer:
        fields = ", ".join(sorted(k for k, v in task.items() if v not in (None, [], {}, ""))) or "none"
        raise V1ToolError(
            f"task {task.get('idx')} of v1 taskset {env_id!r} has no text `answer` (its task data hold: {fields}): "
            "sft-data writes a taskset's reference answers as the completions, and this one's rewards judge the "
            "rollout instead. Make SFT data from a model's rollouts: `primerl eval "
            f"{env_id} -m MODEL -n N -r R`, then keep the high-reward completions of its results.jsonl"
        )
    messages: list[dict[str, Any]] = []
    if task.get("system_prompt"):
        messages.append({"role": "system", "content": task["system_prompt"]})
    prompt = task.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif isinstance(prompt, list) and prompt:
        messages.extend(dict(message) for message in prompt)
    else:
        raise V1ToolError(
            f"task {task.get('idx')} of v1 taskset {env_id!r} has no prompt (the user opens the "
            "conversation in the harness): it cannot be written as an SFT sample"
        )
    return {"prompt": messages, "completion": [{"role": "assistant", "content": answer}]}


def sft_data_v1(
    env_id: str, v1_python: str, env_args: dict[str, Any], *, split: str, num_examples: int, output: Path
) -> tuple[int, str]:
    """Write the SFT samples of a v1 taskset to `output` (atomically); (samples written, split)."""
    import json

    from primerl.orchestrator.envs.v1_spec import V1EnvSpec

    spec = V1EnvSpec(v1_python, env_id, env_args)
    tasks, used = list_tasks(spec, split=split, count=None if num_examples == -1 else num_examples)
    if not tasks:
        raise V1ToolError(f"v1 taskset {env_id!r} lists no {used} tasks with these arguments")
    rows = [sft_row(task, env_id) for task in tasks]
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp")
    with temporary.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    temporary.replace(output)
    return len(rows), used


# ---------------------------------------------------------------------------------------------------- eval
async def _list_eval_tasks(args: Any, env_args: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The tasks `primerl eval` runs and their split; ``EvalInputError`` when there are none."""
    import asyncio

    from primerl.cli.eval_server import EvalInputError
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.v1_spec import V1EnvSpec

    where = f"(v1, {args.env_v1_python})"
    try:
        tasks, split = await asyncio.to_thread(
            list_tasks,
            V1EnvSpec(args.env_v1_python, args.env_id, env_args),
            split=args.split,
            count=None if args.num_examples == -1 else args.num_examples,
        )
    except V1ToolError as exc:
        raise EvalInputError(str(exc)) from None
    except EnvWorkerError as exc:
        raise EvalInputError(f"environment {args.env_id!r} {where} cannot be used: {exc}") from None
    if not tasks:
        raise EvalInputError(f"environment {args.env_id!r} {where} lists no {split} tasks")
    return tasks, split


async def evaluate_v1(args: Any, model: str, env_args: dict[str, Any], console: Any) -> int:
    """`primerl eval` on a v1 environment: list the tasks, start the env server (beside vLLM's start when eval
    serves the model itself), run the groups, write and print what eval writes for a classic environment."""
    import asyncio
    import secrets

    from primerl.cli import eval as cli_eval
    from primerl.cli import eval_server
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.v1_server import V1ServerConnection
    from primerl.orchestrator.envs.v1_spec import V1EnvConfigError

    tasks, split = await _list_eval_tasks(args, env_args)
    output = args.output or cli_eval._default_output(args.env_id, model)
    token = secrets.token_urlsafe(24)
    served = eval_server.given_server(args, model) if args.base_url is not None else None
    # Every group names its inference server (submit_rollout's base_url); the constructor's is only a default.
    server = V1ServerConnection(
        args.env_v1_python,
        args.env_id,
        with_split(env_args, split),
        base_url=served.base_url if served is not None else "http://127.0.0.1",
        api_key=served.api_key if served is not None else token,
        renderer_model=model,
        request_timeout_s=args.timeout_s,
        max_restarts=0,
    )
    starting = asyncio.ensure_future(asyncio.to_thread(server.start))
    vllm = None
    try:
        if served is None:
            eval_server.announce_vllm(args, console, output, f"{model} and the v1 env server of {args.env_id}")
            vllm = await eval_server.start_vllm(
                model,
                args.max_model_len,
                bool(args.enable_auto_tool_choice),
                args.tool_call_parser,
                console,
                token=token,
            )
            served = eval_server.Served(vllm.address.base_url + "/v1", vllm.served_model_name, token)
        try:
            await starting
        except V1EnvConfigError as exc:
            raise eval_server.EvalInputError(str(exc)) from None
        except EnvWorkerError as exc:
            raise eval_server.EvalInputError(f"the v1 env server of {args.env_id!r} did not start: {exc}") from None
        eval_env = V1EvalEnv(server, tasks)
        return await cli_eval._run(
            args, eval_env, split, len(tasks), served, model, env_args, output, console, kind="v1"
        )
    finally:
        await asyncio.wait([starting])
        if not starting.cancelled():
            starting.exception()  # retrieved: raised above where it mattered
        await asyncio.to_thread(server.close)
        if vllm is not None:
            await vllm.stop(grace_s=2.0)
