"""A vLLM engine inside a test (``primerl.inference.engine.create_llm``): ``engine_for_test`` shuts it down on leaving
and puts back what creating it changed in the process (its environment and ``tempfile.tempdir``, pointed at the
engine's work directory), so the tests after it run as before."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def engine_for_test(options: Any, env: dict[str, str] | None = None) -> Iterator[Any]:
    """The engine of ``options`` (an ``EngineOptions``), created with ``env`` added to the environment."""
    from primerl.inference.engine import create_llm, shutdown_llm

    saved_env, saved_tempdir = dict(os.environ), tempfile.tempdir
    try:
        os.environ.update(env or {})
        llm = create_llm(options)
        try:
            yield llm
        finally:
            shutdown_llm(llm)
            del llm
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = saved_tempdir
