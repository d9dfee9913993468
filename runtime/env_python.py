"""Which interpreter runs the environments (the env workers): one rule for every command that starts them."""

from __future__ import annotations

import os
import sys

ENV_PYTHON_VAR = "PRIMERL_ENV_PYTHON"


def resolve_env_python(explicit: object = None) -> str:
    """`explicit` when given, else $PRIMERL_ENV_PYTHON, else this interpreter."""
    if explicit is not None:
        return str(explicit)
    return os.environ.get(ENV_PYTHON_VAR) or sys.executable
