"""A run's metrics as per-metric series over steps, for ``primerl plot`` (no matplotlib here): rows from
``runtime.run_metrics``, series sorted by step, eval rewards by env, ratios and moving averages."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from primerl.proto import telemetry
from primerl.runtime.metrics_sink import ROW_FIELDS

EVAL_REWARD_PATTERN = re.compile(rf"^{re.escape(telemetry.EVAL_PREFIX)}(?P<env_id>.+)/reward$")


@dataclass(frozen=True)
class Series:
    """One metric over steps: ``steps`` strictly increasing, ``values`` aligned with them."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)


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
