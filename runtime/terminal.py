"""The console of primerl's commands through ``rich``: styled output on a terminal, today's plain lines otherwise.

The plain lines are an interface (logs, CI scripts and tests read them), so every command keeps writing them when
its stream is not a terminal; ``rich_console(stream)`` gives a ``rich.console.Console`` on the stream only when
the stream is a terminal (``isatty``). ``NO_COLOR`` and ``TERM=dumb`` are honoured by rich itself.

Tests render the rich form with ``rich_console(StringIO(), force=True)``.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def rich_console(stream: TextIO, *, force: bool = False, width: int | None = None) -> Console | None:
    """A rich Console writing to ``stream`` when it is a terminal (or ``force``), else None: print the plain lines."""
    if not force and not is_terminal(stream):
        return None
    from rich.console import Console

    return Console(file=stream, force_terminal=True if force else None, highlight=False, width=width)


def render_ansi(renderable: Any, *, width: int, end: str = "") -> str:
    """``renderable`` as a string with the terminal's escape codes, for code that writes its own ``\\r`` lines."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, force_terminal=True, width=width, highlight=False).print(
        renderable, end=end, overflow="ellipsis", no_wrap=True, crop=True
    )
    return buffer.getvalue()
