"""The model server of `primerl eval`: an OpenAI-compatible one given by `--base-url`, or primerl-infer's vLLM
server started in this process (its output diverted to `OUTPUT/eval.log` unless `--verbose`)."""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import NamedTuple

from primerl.cli.eval_console import Console

LOG_NAME = "eval.log"


class EvalInputError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""


async def start_vllm(
    model: str,
    max_model_len: int | None,
    tool_choice: bool,
    tool_parser: str | None,
    console: Console,
    token: str | None = None,
):
    """primerl-infer's vLLM server in this process on a free loopback port, serving ``model`` behind ``token`` (a
    fresh one when None); ``EvalInputError`` when it cannot serve it."""
    from primerl.configs.inference import InferenceConfig
    from primerl.inference.server import InferenceServer

    token = token or secrets.token_urlsafe(24)
    config = InferenceConfig.model_validate(
        {
            "model": {
                "name": model,
                "max_model_len": max_model_len,
                "enable_auto_tool_choice": tool_choice,
                "tool_call_parser": tool_parser,
            },
            "server": {"host": "127.0.0.1", "port": 0},
            "broker": {"run_token": token},
        }
    )
    server = InferenceServer(config, version_fn=lambda: 0, worker_extension_cls=None)
    try:
        await server.start()
        await server.wait_healthy(60.0)
    except (Exception, SystemExit) as exc:  # vLLM's argument parser exits on a bad value (e.g. a parser name)
        where = f"; its log: {console.log_path}" if console.log_path else ""
        raise EvalInputError(f"vLLM could not serve {model}: {type(exc).__name__}: {exc}{where}") from None
    return server


class Served(NamedTuple):
    """The OpenAI-compatible server the rollouts go to, the model name it knows, and its API key."""

    base_url: str
    model: str
    api_key: str


def given_server(args: argparse.Namespace, model: str) -> Served:
    """``--base-url``, with the key of ``--api-key-var`` (``EMPTY`` when unset)."""
    return Served(args.base_url.rstrip("/"), model, os.environ.get(args.api_key_var) or "EMPTY")


def announce_vllm(args: argparse.Namespace, console: Console, output: Path, what: str) -> None:
    """The line that says vLLM starts on ``what``; without ``--verbose`` its output goes to ``OUTPUT/eval.log``."""
    log_note = ""
    if not args.verbose:
        console.divert(output / LOG_NAME)
        log_note = f" (its log: {console.log_path})"
    print(f"primerl eval: starting vLLM on {what} ...{log_note}", file=console.err, flush=True)
