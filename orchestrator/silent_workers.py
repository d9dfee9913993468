"""Inference workers that went silent: holding groups in flight without returning one for longer than a deadline
(``worker_silence_timeout_s``, else a multiple of the slowest recent groups) while another worker answers."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from primerl.orchestrator.dispatch_plan import InflightGroup
from primerl.orchestrator.endpoints import InferenceEndpoint

SILENCE_FACTOR = 4.0
"""Unset ``worker_silence_timeout_s``: this many times the slowest of the recent groups (``retry_silent``)..."""
SILENCE_MIN_S = 10.0
"""... and at least this long."""
SILENCE_BASIS_GROUPS = (8, 64)
"""... once this many groups came back, over at most the last this many."""


class SilenceDeadline:
    """How long a worker may hold groups without returning one: ``configured_s`` when set (0: no deadline), else
    judged from the durations of the groups that came back (``group_done``)."""

    def __init__(self, configured_s: float | None):
        self.configured_s = configured_s
        self._group_seconds: collections.deque[float] = collections.deque(maxlen=SILENCE_BASIS_GROUPS[1])

    def group_done(self, seconds: float) -> None:
        self._group_seconds.append(seconds)

    def timeout_s(self) -> float | None:
        """The deadline; None: none (off, or too few groups came back to judge)."""
        if self.configured_s is not None:
            return self.configured_s or None
        if len(self._group_seconds) < SILENCE_BASIS_GROUPS[0]:
            return None
        return max(SILENCE_MIN_S, SILENCE_FACTOR * max(self._group_seconds))


def silent_workers(
    inflight: Iterable[InflightGroup], endpoints: Iterable[InferenceEndpoint], now_s: float, timeout_s: float
) -> list[tuple[InferenceEndpoint, float]]:
    """(worker, seconds silent) of each worker whose oldest group in flight is older than ``timeout_s`` and which
    returned no rollout for as long, while another worker returned one within that time (when none does, the run
    is slow, not the worker)."""
    oldest: dict[int, InflightGroup] = {}
    for entry in inflight:
        first = oldest.get(id(entry.endpoint))
        if first is None or entry.started_s < first.started_s:
            oldest[id(entry.endpoint)] = entry
    answering = [e for e in endpoints if now_s - e.last_answer_s < timeout_s]
    silent = []
    for entry in oldest.values():
        endpoint = entry.endpoint
        silent_s = now_s - max(entry.started_s, endpoint.last_answer_s)  # holding work, returning nothing
        if silent_s >= timeout_s and any(other is not endpoint for other in answering):
            silent.append((endpoint, silent_s))
    return silent
