"""The environment arguments eval and sft-data (and env install) share: `--env-args JSON`, the arguments of an
environment's `load_environment` (one parser, one message), and `--env-python PATH`, the environments' interpreter."""

from __future__ import annotations

import argparse
import json


def parse_env_args(text: str) -> dict:
    """The JSON object ``text`` as a dict; ``ValueError`` saying what is wrong and how to write it."""
    try:
        env_args = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--env-args is not JSON ({exc.msg}): give an object, e.g. '{{\"max_len\": 8}}'") from None
    if not isinstance(env_args, dict):
        raise ValueError(f"--env-args must be a JSON object, got {type(env_args).__name__}")
    return env_args


def add_env_python_argument(parser: argparse.ArgumentParser) -> None:
    """`--env-python PATH`: the interpreter the environments run in (resolved by ``envs.interpreters``)."""
    from primerl.orchestrator.envs.interpreters import ENV_PYTHON_VAR, ENV_VENV_NAME

    parser.add_argument(
        "--env-python",
        default=None,
        metavar="PATH",
        help=f"interpreter of the environments (default: ${ENV_PYTHON_VAR}, else {ENV_VENV_NAME} "
        "next to primerl's venv, else this one)",
    )
