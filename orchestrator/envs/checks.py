"""The checks of the environments that the preflight runs: the env interpreter imports verifiers, each environment
loads with its args (an unknown id gets a did-you-mean among the installed ones), and a sample of its prompts,
after the model's chat template, fits `seq_len` and the inference server's `max_model_len`. Each problem is a
`runtime.findings.Finding`: one line saying what to change.

`check_environments` loads each environment with ``load``: in an env worker of its own (`load_env`, the same
`ClassicEnvClient` training uses, closed afterwards: `primerl rl --check`, `--preflight-first`, a daemon started
alone), or from the env workers the orchestrator started for the run (`orchestrator.env_preflight`, under
`primerl rl`). All environments load at once, and the tokenizer loads meanwhile."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primerl.runtime.findings import Finding, error, warning

ENV_START_TIMEOUT_S = 120.0
"""An env worker that has not loaded its environment by then is reported: the bound the orchestrator's own env
workers start under. The preflight runs beside the roles' start (sharing the cores), so a shorter bound failed
runs on a loaded machine that the orchestrator would have started."""
NUM_SAMPLED_PROMPTS = 8
"""Prompts per environment measured against seq_len, spread evenly over its dataset."""
INSTALL_HINT = "Install yours with `primerl env install PATH`."


@dataclass(frozen=True)
class EnvUse:
    """One environment of the config: ``setting`` names its table (``orchestrator.env[0]``)."""

    setting: str
    id: str
    args: dict[str, Any]
    split: str  # where its prompts come from: "train" for training envs, "eval" for eval envs
    kind: str = "classic"  # "auto" until resolved (`primerl.orchestrator.envs.kinds`), then "classic" or "v1"
    v1_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    python: str | None = None  # the interpreter that runs it (None: the one given to check_environments)


@dataclass
class LoadedEnv:
    use: EnvUse
    prompts: list[Any]  # chat messages (list of dicts) or a plain string, as the environment gives them
    num_examples: int
    error: BaseException | None = None
    stderr: str = ""


def env_uses(orchestrator, prefix: str) -> list[EnvUse]:
    uses = [
        EnvUse(f"{prefix}env[{i}]", env.id, dict(env.args), "train", env.kind, dict(env.v1_config))
        for i, env in enumerate(orchestrator.env)
    ]
    if orchestrator.eval is not None:
        uses += [
            EnvUse(f"{prefix}eval.env[{i}]", env.id, dict(env.args), "eval", env.kind, dict(env.v1_config))
            for i, env in enumerate(orchestrator.eval.env)
        ]
    return uses


def resolve_uses(uses: list[EnvUse], classic: Any, v1: Any, probe: Callable | None = None) -> list[EnvUse]:
    """Each use with its kind and interpreter (`envs.kinds.resolve_env_kinds`, listing the interpreters with
    ``probe`` if given; ValueError: a v1 package installed only in the classic interpreter)."""
    from primerl.orchestrator.envs.kinds import resolve_env_kinds

    kwargs = {"probe": probe} if probe is not None else {}
    resolved = resolve_env_kinds([(use.setting, use) for use in uses], classic=classic, v1=v1, **kwargs)
    return [dataclasses.replace(item.env, kind=item.kind, python=item.python) for item in resolved]


def env_plan(orchestrator, prefix: str, probe: Callable | None = None) -> tuple[list[EnvUse], Any, list[Finding]]:
    """The environments of an orchestrator config resolved to their kinds and interpreters (``probe``: how to list
    an interpreter's environments), with the classic interpreter (`EnvPython`); or the findings that stop before
    any loads (an id listed twice, an interpreter that does not exist, a v1 package installed only in the classic
    one)."""
    from primerl.orchestrator.envs.interpreters import find_env_python, find_v1_env_python

    env_python = find_env_python(orchestrator.env_python)
    v1_python = find_v1_env_python(orchestrator.env_v1_python)
    problem = None
    first: dict[str, str] = {}
    for use in env_uses(orchestrator, prefix):
        if use.split == "train" and first.setdefault(use.id, use.setting) != use.setting:
            problem = (
                f'{use.setting}.id "{use.id}" is listed twice (also {first[use.id]}); keep one table per '
                "environment (its weight sets how often it is sampled)"
            )
            return [], env_python, [error(problem)]
    try:
        uses = resolve_uses(env_uses(orchestrator, prefix), env_python, v1_python, probe)
    except ValueError as exc:
        return [], env_python, [error(str(exc))]
    if any(use.kind == "classic" for use in uses) and not Path(env_python.path).exists():
        problem = (
            f"the env interpreter {env_python.describe()} does not exist: build it (`make setup`, or "
            f"`primerl env install PATH` creates it) or set {prefix}env_python"
        )
    elif any(use.kind == "v1" for use in uses) and not Path(v1_python.path).exists():
        problem = (
            f"the verifiers v1 env interpreter {v1_python.describe()} does not exist: build it (`make "
            f"setup`, or `primerl env install PATH` of a v1 environment) or set {prefix}env_v1_python"
        )
    return ([], env_python, [error(problem)]) if problem else (uses, env_python, [])


def check_planned(
    orchestrator,
    plan: tuple[list[EnvUse], Any, list[Finding]],
    *,
    prefix: str,
    tokenizer: str | None,
    max_model_len: int | None,
    load: Callable[[EnvUse, str], LoadedEnv] | None = None,
    loaded_tokenizer: concurrent.futures.Future | None = None,
) -> list[Finding]:
    """`check_environments` of an orchestrator config's environments as `env_plan` resolved them (its findings
    alone when it found some), with the config's ``seq_len`` and ``sampling.max_tokens``."""
    uses, env_python, findings = plan
    if findings:
        return findings
    return check_environments(
        uses,
        env_python.path,
        env_python.describe(),
        setting=f"{prefix}env_python",
        tokenizer=tokenizer,
        seq_len=orchestrator.seq_len,
        max_model_len=max_model_len,
        max_tokens=orchestrator.sampling.max_tokens,
        prefix=prefix,
        load=load,
        loaded_tokenizer=loaded_tokenizer,
    )


def check_environments(
    uses: list[EnvUse],
    env_python: str,
    described: str,
    *,
    setting: str,
    tokenizer: str | None,
    seq_len: int,
    max_model_len: int | None,
    max_tokens: int | None,
    prefix: str,
    load: Callable[[EnvUse, str], LoadedEnv] | None = None,
    loaded_tokenizer: concurrent.futures.Future | None = None,
) -> list[Finding]:
    """The findings of the environments ``uses``: each loaded by ``load(use, interpreter)`` (default: in an env
    worker of its own, `load_env`), a sample of its prompts measured with ``tokenizer`` (loaded meanwhile, or the
    future of `load_tokenizer` given as ``loaded_tokenizer``)."""
    load = load or load_env
    unique: dict[tuple[str, str, str], EnvUse] = {}
    for use in uses:
        unique.setdefault((use.id, repr(sorted(use.args.items())), use.split), use)
    if loaded_tokenizer is None and tokenizer is not None:
        loaded_tokenizer = in_daemon_thread(load_tokenizer, tokenizer)
    with concurrent.futures.ThreadPoolExecutor(len(unique), thread_name_prefix="preflight-env") as pool:
        loads = {key: pool.submit(load, use, use.python or env_python) for key, use in unique.items()}
        results = {key: future.result() for key, future in loads.items()}
    tok, tokenizer_error = None, None
    if loaded_tokenizer is not None and any(r.error is None for r in results.values()):
        try:  # not waited for when no environment loaded
            tok, tokenizer_error = loaded_tokenizer.result(timeout=ENV_START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            tokenizer_error = f"TimeoutError: not loaded within {ENV_START_TIMEOUT_S:g} s"

    if any(_no_verifiers(r.error) for r in results.values()):
        detail = next(r.stderr for r in results.values() if _no_verifiers(r.error))
        return [
            error(
                f"the env interpreter {described} cannot import verifiers: install it there "
                f"(`{env_python} -m pip install verifiers==0.3.1`, or `primerl env install PATH` with the "
                f"default interpreter) or set {setting} to an interpreter that has it",
                detail,
            )
        ]
    failed = [(use, results[key]) for key, use in unique.items() if results[key].error is not None]
    findings = _load_findings(failed, env_python) if failed else []
    for key, use in unique.items():
        if results[key].error is None and results[key].num_examples == 0:
            split = "training" if use.split == "train" else "eval"
            findings.append(
                error(
                    f'{use.setting} "{use.id}" has no {split} examples: load_environment('
                    f"{_args(use.args)}) gave an empty dataset; check {use.setting}.args"
                )
            )
    if tokenizer_error is not None:
        findings.append(
            warning(
                f"prompt lengths not checked: the tokenizer {tokenizer!r} did not load "
                f"({tokenizer_error.splitlines()[-1]})",
                tokenizer_error,
            )
        )
    elif tok is not None:
        for key, use in unique.items():
            if results[key].error is None:
                findings.extend(
                    length_findings(
                        use,
                        results[key].prompts,
                        tok,
                        seq_len=seq_len,
                        max_model_len=max_model_len,
                        max_tokens=max_tokens,
                        prefix=prefix,
                    )
                )
    return findings


def _load_findings(failed: list[tuple[EnvUse, LoadedEnv]], env_python: str) -> list[Finding]:
    """The environments that did not load, each with the installed ids closest to it (probed only now: they are
    for did-you-mean; none when the probe fails, and the line points at `primerl env list` instead)."""
    from primerl.orchestrator.envs.interpreters import EnvProbeError, probe_env_python

    try:
        installed_ids = [env.id for env in probe_env_python(env_python, timeout_s=ENV_START_TIMEOUT_S).envs]
        v1_pythons = {use.python for use, _ in failed if use.kind == "v1" and use.python}
        installed_ids += [
            env.id for python in v1_pythons for env in probe_env_python(python, timeout_s=ENV_START_TIMEOUT_S).envs
        ]
    except EnvProbeError:
        installed_ids = None
    return [load_finding(use, result, installed_ids) for use, result in failed]


def in_daemon_thread(function: Any, *args: Any) -> concurrent.futures.Future:
    """``function(*args)`` in a daemon thread: a result nobody waits for does not hold up the exit."""
    import threading

    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            future.set_exception(exc)

    threading.Thread(target=run, name="preflight-tokenizer", daemon=True).start()
    return future


def load_env(use: EnvUse, env_python: str) -> LoadedEnv:
    """Load the environment in an env worker and read a sample of its prompts; errors come back in the result."""
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.classic import ClassicEnvClient

    if use.kind == "v1":
        return load_v1_env(use, env_python)
    worker = ClassicEnvClient(
        env_python,
        use.id,
        use.args,
        start_timeout_s=ENV_START_TIMEOUT_S,
        request_timeout_s=ENV_START_TIMEOUT_S,
        max_restarts=0,
        stderr_tail_lines=200,
    )
    try:
        return sampled_prompts(use, worker, worker.start())
    except EnvWorkerError as exc:
        failure = exc
    finally:
        worker.close()  # joins its stderr reader: the tail below holds the worker's traceback
    return LoadedEnv(use, [], 0, failure, worker.stderr_tail())


def sampled_prompts(use: EnvUse, client: Any, info: Any) -> LoadedEnv:
    """A sample of the prompts of an environment whose client (`EnvClient`) has loaded it (``info``), spread over
    the split the run takes them from (eval envs without an eval split use the training one)."""
    split = use.split if use.split == "train" or info.has_eval_dataset else "train"
    size = info.num_examples if split == "train" else info.num_eval_examples
    indices = sorted({i * size // NUM_SAMPLED_PROMPTS for i in range(min(size, NUM_SAMPLED_PROMPTS))})
    prompts = [example.prompt for i in indices for example in client.examples(split, i, 1)]
    return LoadedEnv(use, prompts, size)


def load_v1_env(use: EnvUse, env_python: str) -> LoadedEnv:
    """A v1 environment: its first tasks, listed by the bootstrap in the v1 interpreter (which also refuses a
    sandbox runtime or an installing harness, naming the setting); errors come back in the result."""
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.v1 import task_prompt
    from primerl.orchestrator.envs.v1_spec import V1EnvSpec

    spec = V1EnvSpec(env_python, use.id, dict(use.args), dict(use.v1_config))
    try:
        tasks = spec.tasks(0, NUM_SAMPLED_PROMPTS, timeout_s=ENV_START_TIMEOUT_S)
    except EnvWorkerError as exc:
        return LoadedEnv(use, [], 0, exc, str(exc))
    return LoadedEnv(use, [task_prompt(task) for task in tasks], len(tasks))


def _no_verifiers(exc: BaseException | None) -> bool:
    return exc is not None and "verifiers is not importable" in str(exc)


def load_finding(use: EnvUse, result: LoadedEnv, installed_ids: list[str] | None) -> Finding:
    """The one line for an environment that did not load: an unknown id, or its `load_environment` failing."""
    from primerl.orchestrator.envs.base import EnvRequestError, EnvRequestTimeout
    from primerl.orchestrator.envs.interpreters import suggest_env_ids

    exc = result.error
    detail = f"{type(exc).__name__}: {exc}\n--- env worker stderr ---\n{result.stderr}"
    if use.kind == "v1":
        return v1_load_finding(use, exc, detail)
    module = use.id.replace("-", "_").split("/")[-1]  # verifiers' rule: id reverse-text is module reverse_text
    if isinstance(exc, EnvRequestError) and f"No module named '{module}'" in str(exc):
        suggestions = suggest_env_ids(use.id, installed_ids or [])
        if installed_ids is None:
            hint = f"`primerl env list` shows the installed ones. {INSTALL_HINT}"
        elif suggestions:
            hint = "did you mean " + " or ".join(f'"{s}"' for s in suggestions) + f"? {INSTALL_HINT}"
        elif installed_ids:
            hint = f"installed: {', '.join(installed_ids)}. {INSTALL_HINT}"
        else:
            hint = f"none is installed there. {INSTALL_HINT}"
        return error(f'{use.setting}.id "{use.id}" is not an installed environment; {hint}', detail)
    if isinstance(exc, EnvRequestTimeout):
        return error(
            f'{use.setting} "{use.id}" did not load within {ENV_START_TIMEOUT_S:g} s; see what its '
            "load_environment waits for (the log has its output)",
            detail,
        )
    if isinstance(exc, EnvRequestError):
        cause = str(exc).split(" <- ")[-1]  # the innermost exception of the chain the worker sends
        return error(
            f'{use.setting} "{use.id}": load_environment({_args(use.args)}) raised {cause}; fix the '
            f"environment or its args ({use.setting}.args); the traceback is in the log",
            detail,
        )
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return error(f'{use.setting} "{use.id}": its env worker failed: {first_line}', detail)


def v1_load_finding(use: EnvUse, exc: BaseException | None, detail: str) -> Finding:
    """The one line for a v1 environment whose tasks could not be listed."""
    from primerl.orchestrator.envs.base import EnvRequestTimeout
    from primerl.orchestrator.envs.v1_spec import V1EnvConfigError

    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "ModuleNotFoundError" in str(exc):
        return error(
            f'{use.setting}.id "{use.id}" is not installed in the verifiers v1 env interpreter '
            f"{use.python}; {INSTALL_HINT} (a v1 package goes there), or set {use.setting}.kind",
            detail,
        )
    if isinstance(exc, EnvRequestTimeout):
        return error(f'{use.setting} "{use.id}": its tasks were not listed within {ENV_START_TIMEOUT_S:g} s', detail)
    if isinstance(exc, V1EnvConfigError):
        return error(f"{use.setting}: {first_line}; fix {use.setting}.args or {use.setting}.v1_config", detail)
    return error(f'{use.setting} "{use.id}": the v1 environment failed to load: {first_line}', detail)


def _args(args: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return text if len(text) <= 80 else text[:77] + "..."


def load_tokenizer(name: str) -> tuple[Any, str | None]:
    """(tokenizer, None), or (None, the traceback) when it does not load (the model check says why): a model
    directory's `tokenizer.json` and chat template (`runtime.tokenizer_files`), else transformers'."""
    import traceback

    try:
        from primerl.runtime.tokenizer_files import FileTokenizer

        tokenizer = FileTokenizer.load(name)  # a model directory's own files: no transformers import
        if tokenizer is not None:
            return tokenizer, None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name), None
    except Exception:  # noqa: BLE001 - handed back as a warning with its traceback
        return None, traceback.format_exc()


def prompt_tokens(tokenizer: Any, prompt: Any) -> int:
    """Tokens of a prompt as the inference server sees it: chat messages through the chat template with the
    generation prompt, a plain string as is."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt)["input_ids"])
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def length_findings(
    use: EnvUse,
    prompts: list[Any],
    tokenizer: Any,
    *,
    seq_len: int,
    max_model_len: int | None,
    max_tokens: int | None,
    prefix: str,
) -> list[Finding]:
    """A prompt that leaves no room for a completion within seq_len, or that vLLM would refuse with max_tokens."""
    if not prompts:
        return []
    try:
        longest = max(prompt_tokens(tokenizer, prompt) for prompt in prompts)
    except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer without a chat template
        import traceback

        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return [
            error(
                f'{use.setting} "{use.id}": its prompts cannot be put through the tokenizer\'s chat template '
                f"({message}); use a model with a chat template (an instruct model)",
                traceback.format_exc(),
            )
        ]
    what = (
        f'{use.setting} "{use.id}": prompts are up to {longest} tokens after the chat template ({len(prompts)} sampled)'
    )
    room = f" + {prefix}sampling.max_tokens ({max_tokens})" if max_tokens else ""
    if longest >= seq_len:
        return [
            error(
                f"{what}, which leaves no room for a completion within {prefix}seq_len = {seq_len}; raise "
                f"seq_len above {longest}{room}, or shorten the prompts ({use.setting}.args)"
            )
        ]
    if max_model_len is not None and longest + (max_tokens or 1) > max_model_len:
        return [
            error(
                f"{what}{room} > inference.model.max_model_len = {max_model_len}: vLLM would refuse them; "
                f"raise max_model_len (and seq_len) to {longest + (max_tokens or 1)} or more, or lower "
                f"{prefix}sampling.max_tokens"
            )
        ]
    return []
