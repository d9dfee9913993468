"""Values and interfaces the orchestrator's components hand each other: the rollout scheduler's step report, the
events it raises, the cap on rollouts in flight it reads (``InflightLimit``).

A ``StepReport`` belongs to its reader once taken: the scheduler starts the next step's counts afresh.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from primerl.orchestrator.step_metrics import StepTimers


def _ignore(*_args: Any) -> None:
    return None


@dataclass(frozen=True)
class SchedulerEvents:
    """What the scheduler tells its owner as it happens: ``inflight_changed(num_rollouts)`` when the rollouts in
    flight change, ``rollout_failed()`` for each failed rollout or rollout group."""

    inflight_changed: Callable[[int], None] = _ignore
    rollout_failed: Callable[[], None] = _ignore


@runtime_checkable
class InflightLimit(Protocol):
    """How many rollouts the scheduler may keep in flight, over all inference workers, read before each dispatch
    (``primerl.orchestrator.concurrency``: a fixed cap, or one steered by the workers' load)."""

    def limit(self) -> int: ...


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


__all__ = ["InflightLimit", "SchedulerEvents", "StepReport"]
