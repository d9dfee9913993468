"""What the commands do with their arguments: parse them, turning argparse's exits into an exit status; show the
config's warnings as ``warning: ...`` lines on stderr; and the environment arguments eval, sft-data and env install
share (`--env-args JSON`, one parser and one message; `--env-python PATH`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Iterator, Sequence


def parse_command_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """``parser.parse_args(argv)`` (``sys.argv[1:]`` when None), or the exit status when argparse exits instead:
    0 after ``--help``, 2 after a usage error (both already printed by argparse)."""
    try:
        return parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)


@contextlib.contextmanager
def config_warnings_printed() -> Iterator[None]:
    """Collect the ``ConfigWarning``s raised inside (each, even a repeat) and print them on stderr once the block
    succeeded (a ``ConfigError`` out of it is the message to show instead)."""
    from primerl.runtime.config_base import ConfigWarning  # pydantic: only for the commands that load a config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        yield
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)


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
