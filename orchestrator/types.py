"""Values and interfaces the orchestrator's components hand each other: the rollout scheduler's step report, the
events it raises, and the slice of an environment client it drives.

A ``StepReport`` belongs to its reader once taken: the scheduler starts the next step's counts afresh.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from primerl.orchestrator.step_metrics import StepTimers


class EnvClientLike(Protocol):
    """What the orchestrator asks of an environment client: submit groups, cancel one, keep it alive, close it."""

    @property
    def num_restarts(self) -> int: ...

    @property
    def max_restarts(self) -> int: ...

    def submit_rollouts(
        self,
        example_indices: Sequence[int],
        *,
        num_rollouts: int,
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        sampling: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[concurrent.futures.Future]: ...

    def cancel(self, future: concurrent.futures.Future) -> None: ...

    def is_alive(self) -> bool: ...

    def ensure_alive(self) -> None: ...

    def close(self, timeout_s: float = 10.0) -> int | None: ...


def _ignore(*_args: Any) -> None:
    return None


@dataclass(frozen=True)
class SchedulerEvents:
    """What the scheduler tells its owner as it happens: ``inflight_changed(num_rollouts)`` when the rollouts in
    flight change, ``rollout_failed()`` for each failed rollout or rollout group."""

    inflight_changed: Callable[[int], None] = _ignore
    rollout_failed: Callable[[], None] = _ignore


@dataclass
class StepReport:
    """What the rollout scheduler counted during one step: ``counters`` (rollouts, tokens, errors by kind,
    rescheduled, retried, stale groups ...), ``fallbacks`` (interleaved trajectories trained as branching samples,
    by reason), the phase ``timers``, the trailing generation throughput and the ``rollout/retried``,
    ``inference/*`` and ``teacher/*`` metrics (``RolloutScheduler.worker_metrics``)."""

    counters: collections.Counter = field(default_factory=collections.Counter)
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    timers: StepTimers = field(default_factory=StepTimers)
    tokens_per_s: float = 0.0
    worker_metrics: dict[str, float] = field(default_factory=dict)


__all__ = ["EnvClientLike", "SchedulerEvents", "StepReport"]
