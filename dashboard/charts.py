"""The dashboard's charts: the step metrics each one draws, named by ``proto/telemetry.py``'s keys.

The page asks for this table (``/api/charts``) and spells no metric key itself, so a key the charts read is
defined once, beside the code that writes it (``tests/test_telemetry_contract.py`` checks every one is produced).
A series is ``{"key": k}`` (one metric), ``{"pattern": re}`` (every metric whose name matches, a JavaScript
RegExp source), optionally only of one ``role`` and ``not`` matching a second pattern.
"""

from __future__ import annotations

import re
from typing import Any

from primerl.proto import telemetry as t


def _key(name: str) -> dict[str, str]:
    return {"key": name}


def _pattern(regex: str, role: str | None = None, exclude: str | None = None) -> dict[str, str]:
    series = {"pattern": regex}
    if role is not None:
        series["role"] = role
    if exclude is not None:
        series["not"] = f"^{re.escape(exclude)}$"
    return series


def _under(prefix: str, leaf: str) -> str:
    """A pattern for ``<prefix><anything>/<leaf>``: an environment's metric (``env/<id>/reward``)."""
    return f"^{re.escape(prefix)}.+/{re.escape(leaf)}$"


FILTER_DROPS = ("too_hard", "too_easy", "low_variance")  # orchestrator.filtering's reasons a group is dropped for

CHARTS: list[tuple[str, list[dict[str, str]]]] = [
    (
        "reward",
        [_key(t.TRAIN_REWARD), _pattern(_under(t.ENV_PREFIX, "reward")), _pattern(_under(t.EVAL_PREFIX, "reward"))],
    ),
    ("loss", [_key(t.TRAIN_LOSS)]),
    ("KL / mismatch", [_pattern(r"^train/.*(kl|mismatch).*$")]),
    ("entropy", [_key(t.TRAIN_ENTROPY)]),
    ("off-policy lag (versions)", [_key(t.ASYNC_OFF_POLICY_LAG_MEAN), _key(t.ASYNC_OFF_POLICY_LAG_MAX)]),
    ("rollouts/s", [_key(t.DERIVED_ROLLOUTS_PER_S)]),
    ("tokens/s", [_key(t.ROLLOUT_TOKENS_PER_S)]),
    ("step time (s)", [_key(t.PERF_STEP_TIME_S), _key(t.PERF_STEP_S)]),
    ("trainer phases (s)", [_pattern(r"^perf/.*_s$", role="trainer", exclude=t.PERF_STEP_TIME_S)]),
    ("orchestrator phases (s)", [_pattern(r"^perf/.*_s$", role="orchestrator", exclude=t.PERF_STEP_S)]),
    ("filter drops", [_key(t.FILTER_NUM_FILTERED), *(_key(t.FILTER_PREFIX + r) for r in FILTER_DROPS)]),
    ("rollout errors", [_pattern(rf"^{re.escape(t.ROLLOUT_ERRORS)}(/.*)?$")]),
]

DERIVED = [
    {
        "key": t.DERIVED_ROLLOUTS_PER_S,
        "role": "orchestrator",
        "numerator": t.BUFFER_NUM_ROLLOUTS,
        "denominator": t.PERF_STEP_S,
    }
]
"""Series the page computes per row: ``numerator / denominator`` of one role's row, when both are there."""


def chart_table() -> dict[str, Any]:
    """The body of ``/api/charts``."""
    return {"charts": [{"title": title, "series": series} for title, series in CHARTS], "derived": DERIVED}
