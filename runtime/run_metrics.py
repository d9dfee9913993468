"""The one reader of a run's ``metrics.jsonl`` (the format is ``metrics_sink``'s, which writes it).

Each line is one JSON object ``{"step": int, "role": str, "time": float, "<metric>": float, ...}``; roles
interleave and one step may appear for several roles. A run still in progress may have a half-written last
line: it is dropped with a note. A bad line anywhere else is a :class:`MetricsFileError`, unless the caller
reads what is there whatever happened to the run (``skip_bad_lines``: a launcher's closing summary, a chaos
check, a benchmark), which skips and counts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from primerl.runtime.metrics_sink import ROW_FIELDS  # the writer's format  # noqa: F401
from primerl.runtime.run_files import METRICS_FILE


class MetricsFileError(ValueError):
    """metrics.jsonl cannot be read; the message says where and why."""


@dataclass(frozen=True)
class MetricsFile:
    rows: list[dict]
    # Why the last line was dropped (half-written by a running daemon), or None when every line was read.
    dropped_last_line: str | None = None
    # Bad lines before the last that were skipped (only with ``skip_bad_lines``).
    num_skipped_lines: int = 0


def read_metrics_file(path: Path, *, skip_bad_lines: bool = False) -> MetricsFile:
    """All rows of ``path``. Raises :class:`MetricsFileError` naming the 1-based line of the first bad row
    that is not the last line (unless ``skip_bad_lines``), and ``OSError`` when the file cannot be opened."""
    with Path(path).open("r", encoding="utf-8", errors="replace") as handle:
        lines = handle.read().split("\n")
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    rows: list[dict] = []
    dropped_last_line = None
    num_skipped_lines = 0
    for index, (number, line) in enumerate(numbered):
        try:
            rows.append(parse_row(line))
        except ValueError as err:
            if index == len(numbered) - 1:
                dropped_last_line = f"line {number} (the last) is incomplete, ignored: {err}"
                break
            if skip_bad_lines:
                num_skipped_lines += 1
                continue
            raise MetricsFileError(f"{path}: line {number} is malformed: {err}") from None
    return MetricsFile(rows=rows, dropped_last_line=dropped_last_line, num_skipped_lines=num_skipped_lines)


def read_run_rows(*output_dirs: Path) -> list[dict]:
    """The rows of the ``metrics.jsonl`` files of these output directories (each file once, a missing or
    unreadable one skipped), in file order, bad lines skipped: what a run left, whatever happened to it."""
    rows: list[dict] = []
    for path in dict.fromkeys(Path(d).resolve() / METRICS_FILE for d in output_dirs):
        try:
            rows.extend(read_metrics_file(path, skip_bad_lines=True).rows)
        except OSError:
            continue
    return rows


def parse_row(line: str) -> dict:
    """One line as a row; ``ValueError`` saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f'"step" must be an integer, got {step!r}')
    if not isinstance(row.get("role"), str):
        raise ValueError(f'"role" must be a string, got {row.get("role")!r}')
    return row
