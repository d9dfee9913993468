"""`--env-args JSON`, the arguments of an environment's `load_environment`, as eval, sft-data and env install take
them: one parser, one message."""

from __future__ import annotations

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
