"""Read a run's ``metrics.jsonl`` and turn it into per-metric series (no matplotlib here).

Each line is one JSON object ``{"step": int, "role": str, "time": float, "<metric>": float, ...}``; roles
interleave and one step may appear for several roles. A run still in progress may have a half-written last
line: it is dropped with a note, while a bad line anywhere else is a :class:`MetricsFileError`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from primerl.runtime.metrics_sink import METRICS_FILE_NAME, ROW_FIELDS  # the writer's format  # noqa: F401

EVAL_REWARD_PATTERN = re.compile(r"^eval/(?P<env_id>.+)/reward$")


class MetricsFileError(ValueError):
    """metrics.jsonl cannot be read; the message says where and why."""


@dataclass(frozen=True)
class MetricsFile:
    rows: list[dict]
    # Why the last line was dropped (half-written by a running daemon), or None when every line was read.
    dropped_last_line: str | None = None


@dataclass(frozen=True)
class Series:
    """One metric over steps: ``steps`` strictly increasing, ``values`` aligned with them."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)


def read_metrics_file(path: Path) -> MetricsFile:
    """All rows of ``path``. Raises :class:`MetricsFileError` naming the 1-based line of the first bad row
    that is not the last line, and ``OSError`` when the file cannot be opened."""
    with Path(path).open("r", encoding="utf-8", errors="replace") as handle:
        lines = handle.read().split("\n")
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    rows: list[dict] = []
    dropped_last_line = None
    for index, (number, line) in enumerate(numbered):
        try:
            rows.append(parse_row(line))
        except ValueError as err:
            if index == len(numbered) - 1:
                dropped_last_line = f"line {number} (the last) is incomplete, ignored: {err}"
                break
            raise MetricsFileError(f"{path}: line {number} is malformed: {err}") from None
    return MetricsFile(rows=rows, dropped_last_line=dropped_last_line)


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


def extract_series(rows: list[dict]) -> dict[str, Series]:
    """Every numeric metric in ``rows`` as a series sorted by step. When a step repeats for a metric (a
    resumed run writes it again), the row written last wins. Non-numeric values (null, strings) are skipped."""
    by_metric: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row["step"]
        for name, value in row.items():
            if name in ROW_FIELDS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            by_metric.setdefault(name, {})[step] = float(value)
    series = {}
    for name, values_by_step in by_metric.items():
        steps = sorted(values_by_step)
        series[name] = Series(np.array(steps, dtype=np.int64), np.array([values_by_step[s] for s in steps]))
    return series


def eval_reward_names(series: dict[str, Series]) -> dict[str, str]:
    """``{env_id: metric name}`` for every ``eval/<env_id>/reward`` series, sorted by env id."""
    found = {}
    for name in series:
        match = EVAL_REWARD_PATTERN.match(name)
        if match:
            found[match["env_id"]] = name
    return dict(sorted(found.items()))


def ratio_series(numerator: Series, denominator: Series) -> Series:
    """``numerator / denominator`` on the steps both have, where the denominator is > 0."""
    common, num_index, den_index = np.intersect1d(numerator.steps, denominator.steps, return_indices=True)
    num, den = numerator.values[num_index], denominator.values[den_index]
    keep = den > 0
    return Series(common[keep], num[keep] / den[keep])


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points (fewer at the start), same length as ``values``. NaNs
    are left out of each mean; a window of only NaNs gives NaN."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    values = np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    window_sums = sums - _lagged(sums, window)
    window_counts = counts - _lagged(counts, window)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(window_counts > 0, window_sums / np.maximum(window_counts, 1), math.nan)


def _lagged(cumulative: np.ndarray, window: int) -> np.ndarray:
    """``cumulative`` shifted right by ``window`` places, zeros coming in from the left."""
    shifted = np.zeros(len(cumulative), dtype=float)
    if window < len(cumulative):
        shifted[window:] = cumulative[:-window]
    return shifted
