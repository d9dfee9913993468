"""`primerl eval ENV_ID -m MODEL`: evaluate a model or a run's weights on an environment, like `prime eval run`.

Without `--base-url`, the model is served by a vLLM server started in this process (127.0.0.1, a free port,
a fresh bearer token) and stopped at the end; with it, any OpenAI-compatible endpoint is used (e.g. a running
`primerl-infer`). The environment runs in an env worker with the environments' interpreter (`--env-python`,
else the default of `primerl.orchestrator.envs.interpreters`), exactly as in training. Results go to `--output` (default
`outputs/evals/<env>--<model>/<time>`): `results.jsonl` (one line per rollout) and `summary.json`; what vLLM
writes goes to `eval.log` there (`eval_console.py`), so the terminal shows eval's own lines only (`--verbose`:
everything on the terminal).

A verifiers v1 environment (a Taskset/Harness package in the v1 env venv; `--kind auto` finds it there) runs
through verifiers' own env server against the token route of the served model (`cli/v1_tools.py`): the same
flags, output files and console, with the taskset's reward and metrics; `-a` are the taskset's arguments.

Tool environments (a ToolEnv: its requests carry `tools`) need vLLM's auto tool choice and a tool-call parser,
else every request is refused with HTTP 400. They are turned on by themselves when the environment has tools
(`DEFAULT_TOOL_CALL_PARSER`, right for Qwen models), or by `--enable-auto-tool-choice` / `--tool-call-parser`.

    primerl eval reverse-text -m runs/demo/rl -n 200 -r 1 -t 16 -T 0
    primerl eval reverse-text-v1 -m runs/demo/rl -n 200 -r 1 -t 16 -T 0     # the v1 example
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from primerl.cli.command_args import add_env_python_argument, parse_command_args, parse_env_args
from primerl.cli.eval_console import Console, EvalProgress, print_summary
from primerl.cli.eval_server import LOG_NAME, EvalInputError, Served, announce_vllm, given_server, start_vllm
from primerl.cli.v1_tools import V1ToolError, add_kind_arguments, resolve_kind
from primerl.orchestrator.envs.interpreters import resolve_env_python

DEFAULT_OUTPUT_ROOT = Path("outputs/evals")
DEFAULT_TOOL_CALL_PARSER = "hermes"
"""vLLM's parser of `<tool_call>{json}</tool_call>`: the format of Qwen2/2.5/3 chat templates (and the tiny model's)."""
MAX_ERRORS_SHOWN = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl eval",
        description="Evaluate a model on an environment's eval split (the train split when it has none) and "
        "print the mean reward and the environment's metrics. Flags follow `prime eval run` / `vf-eval`.",
        epilog="MODEL may be a Hugging Face model directory, a run directory (its latest exported weights, "
        "RUN/weights/step_N) or, with --base-url, the model name the server knows.",
    )
    _add_task_arguments(parser)
    _add_sampling_arguments(parser)
    _add_server_and_output_arguments(parser)
    return parser


def _add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """What is evaluated: the environment, the model, the examples and rollouts."""
    parser.add_argument("env_id", metavar="ENV_ID", help="environment id (an installed verifiers environment)")
    parser.add_argument("-m", "--model", required=True, help="model directory, run directory, or served name")
    parser.add_argument(
        "-a",
        "--env-args",
        default="{}",
        metavar="JSON",
        help="arguments of load_environment, as a JSON object (e.g. '{\"max_len\": 8}')",
    )
    parser.add_argument(
        "-n",
        "--num-examples",
        type=int,
        default=5,
        metavar="N",
        help="examples to evaluate, from the first; -1 for all (default: %(default)s)",
    )
    parser.add_argument(
        "-r",
        "--rollouts-per-example",
        type=int,
        default=3,
        metavar="R",
        help="rollouts per example (default: %(default)s)",
    )


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """How the rollouts are sampled and run: tokens, temperature, seed, split, concurrency."""
    parser.add_argument(
        "-t",
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="completion tokens per model call (default: up to the context length)",
    )
    parser.add_argument(
        "-T",
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default: 1.0)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="sampling seed: each example's requests are seeded apart from it, so the same seed "
        "gives the same figures again (default: %(default)s)",
    )
    parser.add_argument(
        "--split",
        choices=("eval", "train"),
        default=None,
        help="dataset split (default: eval when the environment has one, else train)",
    )
    parser.add_argument(
        "-c",
        "--max-concurrent",
        type=int,
        default=16,
        metavar="N",
        help="examples in flight at once (default: %(default)s)",
    )


def _add_server_and_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The model server (one given, or the vLLM server started), the output, the environments' interpreter."""
    parser.add_argument(
        "-b",
        "--base-url",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible server to use instead of starting vLLM (e.g. http://host:8000/v1)",
    )
    parser.add_argument(
        "-k",
        "--api-key-var",
        default="PRIMERL_RUN_TOKEN",
        metavar="VAR",
        help="environment variable holding the server's API key, with --base-url "
        "(default: %(default)s; unset means no key)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="context length of the started vLLM server (default: the model's)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where results.jsonl and summary.json go (default: {DEFAULT_OUTPUT_ROOT}/<env>--<model>/<time>)",
    )
    add_env_python_argument(parser)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="deadline of one example's rollouts (default: %(default)g)",
    )
    add_kind_arguments(parser)
    parser.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the started vLLM server accept tool calls (default: on when the environment has tools)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help=f"vLLM tool-call parser of the started server (default: {DEFAULT_TOOL_CALL_PARSER}, "
        "for Qwen models; e.g. llama3_json, mistral)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"show vLLM's log on the terminal (default: warnings and errors go to OUTPUT/{LOG_NAME})",
    )


def resolve_model(model: str, *, served: bool) -> str:
    """The model directory to serve: a HF directory as is, a run directory's latest `weights/step_N`.
    With a server given (`served`), the name is passed through untouched."""
    if served:
        return model
    path = Path(model)
    if not path.exists():
        if model.count("/") == 1 and not model.startswith((".", "/")):
            return model  # a hub id: vLLM loads it from the local cache (no downloads here)
        raise EvalInputError(f"model {model!r} does not exist; give a model directory, a run directory or a hub id")
    if (path / "config.json").is_file():
        return str(path)
    steps = sorted(
        (int(m.group(1)), p)
        for p in (path / "weights").glob("step_*")
        if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / "config.json").is_file()
    )
    if steps:
        return str(steps[-1][1])
    if re.fullmatch(r"step_\d+", path.name) and path.parent.name == "checkpoints":
        raise EvalInputError(
            f"{path} is a training checkpoint (optimizer state, sharded); evaluate the exported "
            f"weights instead: {path.parent.parent / 'weights' / path.name}"
        )
    raise EvalInputError(f"{path} holds no config.json and no weights/step_N: not a model or run directory")


def _check(args: argparse.Namespace) -> dict[str, Any]:
    try:
        env_args = parse_env_args(args.env_args)
    except ValueError as exc:
        raise EvalInputError(str(exc)) from None
    if args.num_examples == 0 or args.num_examples < -1:
        raise EvalInputError(f"--num-examples must be >= 1 or -1 (all), got {args.num_examples}")
    for flag, value, low in (
        ("--rollouts-per-example", args.rollouts_per_example, 1),
        ("--max-concurrent", args.max_concurrent, 1),
        ("--max-tokens", args.max_tokens, 1),
        ("--max-model-len", args.max_model_len, 1),
    ):
        if value is not None and value < low:
            raise EvalInputError(f"{flag} must be >= {low}, got {value}")
    if args.temperature < 0:
        raise EvalInputError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise EvalInputError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.timeout_s <= 0:
        raise EvalInputError(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.tool_call_parser is not None and not args.tool_call_parser.strip():
        raise EvalInputError("--tool-call-parser is empty: give a vLLM parser name, e.g. hermes")
    try:
        args.kind, args.env_v1_python = resolve_kind(args.env_id, args.kind, args.env_v1_python)
    except V1ToolError as exc:
        raise EvalInputError(str(exc)) from None
    if args.kind == "v1":
        return env_args
    args.env_python = resolve_env_python(args.env_python)
    if not Path(args.env_python).exists():
        raise EvalInputError(
            f"env python {args.env_python} does not exist: install an environment with `primerl env "
            "install PATH|PACKAGE` (it creates the env venv) or pass --env-python"
        )
    return env_args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_command_args(parser, argv)
    if isinstance(args, int):
        return args
    try:
        env_args = _check(args)
        model = resolve_model(args.model, served=args.base_url is not None)
    except EvalInputError as exc:
        print(f"primerl eval: error: {exc}", file=sys.stderr)
        return 2
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from primerl.runtime.log_setup import configure_logging

    configure_logging("eval", level="warning" if not args.verbose else "info")
    console = Console()
    try:
        return asyncio.run(_evaluate(args, model, env_args, console))
    except EvalInputError as exc:
        print(f"primerl eval: error: {exc}", file=console.err, flush=True)
        return 2
    except (Exception, KeyboardInterrupt) as exc:
        if console.log_path is None:
            raise
        traceback.print_exc()  # into the log, with vLLM's lines around it
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        print(f"primerl eval: error: {what} (traceback in {console.log_path})", file=console.err, flush=True)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1


async def _evaluate(args: argparse.Namespace, model: str, env_args: dict[str, Any], console: Console) -> int:
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.classic import ClassicEnvClient

    if args.kind == "v1":
        from primerl.cli.v1_tools import evaluate_v1

        return await evaluate_v1(args, model, env_args, console)

    worker = ClassicEnvClient(args.env_python, args.env_id, env_args, request_timeout_s=args.timeout_s)
    try:
        info = await asyncio.to_thread(worker.start)
    except EnvWorkerError as exc:
        await asyncio.to_thread(worker.close)
        raise EvalInputError(f"environment {args.env_id!r} cannot be loaded: {exc}{_did_you_mean(args, exc)}") from None
    server = None
    try:
        split = args.split or ("eval" if info.has_eval_dataset else "train")
        size = info.num_eval_examples if split == "eval" else info.num_examples
        if size == 0:
            raise EvalInputError(f"environment {args.env_id!r} has no {split} examples")
        count = size if args.num_examples == -1 else min(args.num_examples, size)
        output = args.output or _default_output(args.env_id, model)
        tool_choice, tool_parser = _tool_settings(args, info, console)
        if args.base_url is not None:
            served = given_server(args, model)
        else:
            tools_note = f", auto tool choice with the {tool_parser} parser" if tool_choice else ""
            announce_vllm(args, console, output, f"{model}{tools_note}")
            server = await start_vllm(model, args.max_model_len, tool_choice, tool_parser, console)
            # the server refuses requests without its token
            served = Served(server.address.base_url + "/v1", server.served_model_name, server.config.broker.run_token)
        return await _run(args, worker, split, count, served, model, env_args, output, console)
    finally:
        await asyncio.to_thread(worker.close)
        if server is not None:
            await server.stop(grace_s=2.0)


def _did_you_mean(args: argparse.Namespace, exc: Exception) -> str:
    """For an environment that is not installed: the installed ids closest to it, or how to install it."""
    from primerl.orchestrator.envs.interpreters import EnvProbeError, installed_env_ids, suggest_env_ids

    if "Could not import" not in str(exc) and "No module named" not in str(exc):
        return ""
    try:
        installed = installed_env_ids(args.env_python)
    except EnvProbeError:
        return ""
    from primerl.cli.v1_tools import usable_v1_python, v1_env_ids

    installed = sorted({*installed, *v1_env_ids(usable_v1_python(args.env_v1_python))})
    close = suggest_env_ids(args.env_id, installed)
    if close:
        return f". Did you mean {' or '.join(repr(c) for c in close)}?"
    known = ", ".join(installed) if installed else "none"
    return f". Installed in {args.env_python}: {known}; install yours with `primerl env install PATH|PACKAGE`"


def _tool_settings(args: argparse.Namespace, info: Any, console: Console) -> tuple[bool, str | None]:
    """(auto tool choice, parser) for the vLLM server eval starts: the flags, else on when the env has tools."""
    if args.base_url is not None:
        if args.enable_auto_tool_choice is not None or args.tool_call_parser is not None:
            print(
                "primerl eval: warning: --enable-auto-tool-choice and --tool-call-parser have no effect with "
                "--base-url (the server's own settings apply)",
                file=console.err,
                flush=True,
            )
        return False, None
    enabled = args.enable_auto_tool_choice
    if enabled is None:
        enabled = args.tool_call_parser is not None or info.has_tools
    parser = (args.tool_call_parser or DEFAULT_TOOL_CALL_PARSER) if enabled else args.tool_call_parser
    return enabled, parser


async def _run(
    args,
    worker,
    split: str,
    count: int,
    served: Served,
    model: str,
    env_args: dict[str, Any],
    output: Path,
    console: Console,
    kind: str = "classic",
) -> int:
    from primerl.orchestrator.evaluation import run_eval_groups, summarize_groups

    output.mkdir(parents=True, exist_ok=True)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens, "seed": args.seed}
    started_s = time.monotonic()
    done = 0
    progress = EvalProgress(console.err, count)
    try:
        with (output / "results.jsonl").open("w") as results:

            def on_group(group) -> None:
                nonlocal done
                done += 1
                for rollout in group.rollouts:
                    results.write(json.dumps(_result_record(group.example_index, rollout)) + "\n")
                progress.advance(done)

            groups, failed = await asyncio.to_thread(
                run_eval_groups,
                worker,
                range(count),
                num_rollouts=args.rollouts_per_example,
                base_url=served.base_url,
                model=served.model,
                sampling=sampling,
                split=split,
                api_key=served.api_key,
                max_concurrent_groups=args.max_concurrent,
                timeout_s=args.timeout_s,
                on_group=on_group,
            )
    finally:
        progress.close()
    summary = summarize_groups(groups, failed, rollouts_per_group=args.rollouts_per_example)
    elapsed_s = time.monotonic() - started_s
    record = {
        "env_id": args.env_id,
        "env_kind": kind,
        "env_args": env_args,
        "model": model,
        "split": split,
        "num_examples": count,
        "rollouts_per_example": args.rollouts_per_example,
        "sampling": sampling,
        "time_s": elapsed_s,
        **summary.as_dict(),
    }
    (output / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    what = f"v1 env, {split}" if kind == "v1" else split
    print_summary(console.out, args.env_id, what, count, args.rollouts_per_example, model, summary, elapsed_s, output)
    _print_errors(summary.errors, output, console)
    return 1 if summary.num_rollouts == 0 else 0


def _result_record(example_index: int, rollout) -> dict[str, Any]:
    """One line of results.jsonl: a rollout of the example."""
    return {
        "example_index": example_index,
        "rollout_index": rollout.rollout_index,
        "reward": rollout.reward,
        "metrics": rollout.metrics,
        "prompt": rollout.prompt,
        "completion": rollout.completion,
        "num_completion_tokens": rollout.num_completion_tokens,
        "is_truncated": rollout.is_truncated,
        "error": rollout.error,
    }


def _print_errors(errors: list[str], output: Path, console: Console) -> None:
    """The first line of the first ``MAX_ERRORS_SHOWN`` errors, and how many more are in results.jsonl."""
    for error in errors[:MAX_ERRORS_SHOWN]:
        print(f"  error: {error.splitlines()[0]}", file=console.err)
    if len(errors) > MAX_ERRORS_SHOWN:
        print(f"  ... {len(errors) - MAX_ERRORS_SHOWN} more errors in {output / 'results.jsonl'}", file=console.err)
    console.err.flush()


def _default_output(env_id: str, model: str) -> Path:
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(Path(model).parts[-3:]))[:80]
    return DEFAULT_OUTPUT_ROOT / f"{env_id}--{tag}" / time.strftime("%Y%m%d-%H%M%S")


if __name__ == "__main__":
    raise SystemExit(main())
