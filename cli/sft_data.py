"""`primerl sft-data ENV_ID -o samples.jsonl`: SFT samples from an environment's reference answers.

Each example of the split becomes `{"prompt": [...], "completion": [{"role": "assistant", "content": answer}]}`,
the shape `primerl sft` reads. Only for environments whose `answer` is the text the model should write (like
`reverse-text`); the prompt is the environment's own (system prompt included), so SFT and RL see the same one.
A verifiers v1 environment (`--kind auto` finds it in the v1 env venv) gives its taskset's listed tasks: the task's
`system_prompt` and `prompt`, its text `answer` as the reply; a taskset without reference answers is refused with
the reason (`cli/v1_tools.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from primerl.cli.command_args import add_env_python_argument, parse_command_args, parse_env_args
from primerl.cli.v1_tools import V1ToolError, add_kind_arguments, resolve_kind
from primerl.orchestrator.envs.interpreters import resolve_env_python

BATCH = 500


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl sft-data",
        description="Write an environment's examples with their reference answers as SFT samples (JSONL).",
    )
    parser.add_argument("env_id", metavar="ENV_ID", help="environment id (an installed verifiers environment)")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the JSONL file to write")
    parser.add_argument("-a", "--env-args", default="{}", metavar="JSON", help="load_environment arguments (JSON)")
    parser.add_argument(
        "-n",
        "--num-examples",
        type=int,
        default=-1,
        metavar="N",
        help="examples to write, from the first; -1 for all (default)",
    )
    parser.add_argument("--split", choices=("train", "eval"), default="train", help="dataset split (default: train)")
    add_env_python_argument(parser)
    add_kind_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_command_args(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        env_args = parse_env_args(args.env_args)
    except ValueError as exc:
        print(f"primerl sft-data: error: {exc}", file=sys.stderr)
        return 2
    if args.num_examples == 0 or args.num_examples < -1:
        print(f"primerl sft-data: error: --num-examples must be >= 1 or -1, got {args.num_examples}", file=sys.stderr)
        return 2
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.classic import ClassicEnvClient
    from primerl.runtime.log_setup import configure_logging

    configure_logging("sft-data", level="warning")
    try:
        kind, v1_python = resolve_kind(args.env_id, args.kind, args.env_v1_python)
        if kind == "v1":
            from primerl.cli.v1_tools import sft_data_v1

            written, split = sft_data_v1(
                args.env_id, v1_python, env_args, split=args.split, num_examples=args.num_examples, output=args.output
            )
            print(f"wrote {written} samples of {args.env_id} (v1 env, {split}) to {args.output}")
            return 0
    except V1ToolError as exc:
        print(f"primerl sft-data: error: {exc}", file=sys.stderr)
        return 2
    except EnvWorkerError as exc:
        print(f"primerl sft-data: error: {exc}", file=sys.stderr)
        return 1

    env_python = resolve_env_python(args.env_python)
    worker = ClassicEnvClient(env_python, args.env_id, env_args)
    try:
        info = worker.start()
        size = info.num_examples if args.split == "train" else info.num_eval_examples
        count = size if args.num_examples == -1 else min(size, args.num_examples)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.output.with_name(f".{args.output.name}.tmp")
        written = 0
        with temporary.open("w") as handle:
            for start in range(0, count, BATCH):
                for example in worker.examples(args.split, start, min(BATCH, count - start)):
                    if not isinstance(example.answer, str) or not example.answer:
                        raise EnvWorkerError(
                            f"example {example.index} has no text answer; this environment's "
                            "answers cannot serve as SFT targets"
                        )
                    completion = [{"role": "assistant", "content": example.answer}]
                    handle.write(json.dumps({"prompt": example.prompt, "completion": completion}) + "\n")
                    written += 1
        temporary.replace(args.output)
    except EnvWorkerError as exc:
        print(f"primerl sft-data: error: {exc}", file=sys.stderr)
        return 1
    finally:
        worker.close()
    print(f"wrote {written} samples of {args.env_id} ({args.split}) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
