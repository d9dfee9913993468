"""The one logging set-up every role calls at start: structlog over the standard library.

Output is JSON lines (``fmt="json"``, for production and log shippers) or aligned, readable lines
(``fmt="console"``, for a terminal). ``role`` and ``run_id`` are bound on every line, ``step`` and
``policy_version`` wherever a caller binds them (``bind_context(step=3)``). Records from libraries that use
the standard ``logging`` module (vLLM, grpc, transformers) go through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO

import structlog

LogFormat = Literal["console", "json"]
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    role: str,
    run_id: str = "",
    *,
    level: str = "info",
    fmt: LogFormat = "console",
    stream: TextIO | None = None,
) -> structlog.stdlib.BoundLogger:
    """Configure structlog and the root logger for this process; returns a logger bound to role and run id.

    Calling it again replaces the previous set-up (tests do this).
    """
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {sorted(LEVELS)}")
    if fmt not in ("console", "json"):
        raise ValueError(f"log format {fmt!r} is not 'console' or 'json'")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        # Plain tracebacks: rich ones print local variables, which may hold run tokens.
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])

    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, run_id=run_id)
    return structlog.stdlib.get_logger(f"primerl.{role}")


def bind_context(**values: Any) -> None:
    """Bind values (``step``, ``policy_version``, ...) onto every later log line of this context."""
    structlog.contextvars.bind_contextvars(**values)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)
