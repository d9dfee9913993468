"""What a role's log says about why it failed: its last error line, for `primerl rl`'s console.

A role's log (``{run_dir}/logs/<role>.log``) mixes primerl's structlog lines (JSON, or the console renderer's
``... [error    ] event  key=value``), libraries' output and, when a Python process dies of an exception, the
interpreter's traceback. ``last_error_line`` returns the last of these, whichever comes last in the file:

- a JSON line with ``"level"`` error or critical: ``event: error`` (its ``error`` field), or ``event: <the
  exception's last line>`` when it carries a formatted ``exception``;
- a console-rendered line at level error or critical: from the level on;
- a traceback: its exception line (``ValueError: ...``), the line after the stack.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

MAX_LINE_CHARS = 400
TAIL_BYTES = 256 * 1024
_CONSOLE_ERROR = re.compile(r"\[(error|critical)\s*\]\s*(.*)$")
_ERROR_LEVELS = ("error", "critical", "exception")
_CONSOLE_NOISE = re.compile(r"\s+\[[\w.]+\](?=\s|$)|\s+(role|run_id)=\S*")
"""What every console line of a role carries (its logger's name, role and run id): left out of the summary."""


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_LINE_CHARS else text[: MAX_LINE_CHARS - 3] + "..."


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _json_error(line: str) -> str | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or str(record.get("level", "")).lower() not in _ERROR_LEVELS:
        return None
    event = str(record.get("event", "")).strip()
    detail = record.get("error")
    if detail is None and record.get("exception"):
        detail = _last_line(str(record["exception"]))
    return f"{event}: {detail}" if detail not in (None, "") else event


def _traceback_exception(lines: list[str], start: int) -> str | None:
    """The exception line of the traceback whose header is ``lines[start]``."""
    for line in lines[start + 1 :]:
        if not line.strip() or line[0].isspace():
            continue  # the stack: '  File "...", line N' and the source lines under it
        return line.strip()
    return None


def last_error_line(text: str) -> str | None:
    """The last error in a role's log text (see the module docstring), shortened to one line; None if none."""
    lines = text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index].strip()
        if not line:
            continue
        found = _json_error(line)
        if found is None:
            match = _CONSOLE_ERROR.search(line)
            if match:
                found = _CONSOLE_NOISE.sub("", f"[{match.group(1)}] {match.group(2)}")
        if found is None and line.startswith("Traceback (most recent call last)"):
            found = _traceback_exception(lines, index)
        if found:
            return _shorten(found)
    return None


_START_HEADER = re.compile(r"^=== \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", re.MULTILINE)
"""The line ``primerl.supervisor.process_supervisor`` writes before each start of a role into its log."""


def last_error_in_log(path: Path) -> str | None:
    """``last_error_line`` of the end of the log file at ``path`` (its last 256 KiB), from the latest start of
    the role on; None if unreadable or nothing is found."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - TAIL_BYTES))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return None
    starts = list(_START_HEADER.finditer(text))
    return last_error_line(text[starts[-1].start() :] if starts else text)
