"""Online difficulty filtering of rollout groups, the oversampling arithmetic, and batch assembly.

A group (the rollouts of one example) is dropped, checked in this order, when
- ``too_hard``: its mean reward is below ``min_reward``;
- ``too_easy``: its mean reward is above ``max_reward``;
- ``low_variance``: its reward variance (population, ddof=0) is below ``min_reward_variance``, or all its rewards
  are equal (zero advantages, nothing to learn; this is the filter's rule even with ``min_reward_variance = 0``).
The bounds are inclusive: a mean equal to ``min_reward`` or ``max_reward`` is kept. Rewards are read after
``zero_truncated_completions`` and without the length penalty (see ``advantages``).

Oversampling: ``num_groups_to_request = ceil(batch_size / rollouts_per_example * oversampling_factor)`` groups are
requested per step so that a batch of ``batch_size`` rollouts is likely full after filtering.

``BatchAssembler`` collects kept groups, oldest first, until they hold ``batch_size`` rollouts; the groups beyond
stay for the next step (the surplus), at most ``max_surplus_rollouts`` of them (the oldest beyond the bound are
dropped and counted). Groups are never split: a batch holds exactly ``batch_size`` rollouts when every group is
complete, and may exceed it by less than one group when some rollouts were lost.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from primerl.orchestrator.samples import Group, TrainingSample

if TYPE_CHECKING:
    from primerl.configs.orchestrator import BufferConfig

FILTER_REASONS = ("too_hard", "too_easy", "low_variance")


def filter_reason(
    group: Group, *, min_reward: float | None = None, max_reward: float | None = None, min_reward_variance: float = 0.0
) -> str | None:
    """Why the group is dropped (one of ``FILTER_REASONS``), or None when it is kept."""
    rewards = group.rollout_rewards()
    if rewards.size == 0:
        return "low_variance"
    mean = float(rewards.mean())
    if min_reward is not None and mean < min_reward:
        return "too_hard"
    if max_reward is not None and mean > max_reward:
        return "too_easy"
    if float(rewards.max()) == float(rewards.min()) or float(rewards.var()) < min_reward_variance:
        return "low_variance"
    return None


@dataclass
class FilterResult:
    kept: list[Group]
    dropped: dict[str, list[Group]]  # reason -> groups

    @property
    def counts(self) -> dict[str, int]:
        return {reason: len(self.dropped.get(reason, [])) for reason in FILTER_REASONS}

    @property
    def num_groups(self) -> int:
        return len(self.kept) + sum(len(groups) for groups in self.dropped.values())

    @property
    def num_filtered(self) -> int:
        return self.num_groups - len(self.kept)


def filter_groups(
    groups: Iterable[Group],
    *,
    min_reward: float | None = None,
    max_reward: float | None = None,
    min_reward_variance: float = 0.0,
) -> FilterResult:
    """Split groups into kept and dropped-by-reason (order preserved)."""
    result = FilterResult(kept=[], dropped={reason: [] for reason in FILTER_REASONS})
    for group in groups:
        reason = filter_reason(
            group, min_reward=min_reward, max_reward=max_reward, min_reward_variance=min_reward_variance
        )
        if reason is None:
            result.kept.append(group)
        else:
            result.dropped[reason].append(group)
    return result


@dataclass(frozen=True)
class DifficultyFilter:
    """``[orchestrator.buffer]`` as a filter; keeps every group when ``enabled`` is false."""

    enabled: bool = True
    min_reward: float | None = None
    max_reward: float | None = None
    min_reward_variance: float = 0.0

    @classmethod
    def from_config(cls, config: BufferConfig) -> DifficultyFilter:
        return cls(
            enabled=config.online_difficulty_filtering,
            min_reward=config.min_reward,
            max_reward=config.max_reward,
            min_reward_variance=config.min_reward_variance,
        )

    def __call__(self, groups: Iterable[Group]) -> FilterResult:
        if not self.enabled:
            return FilterResult(kept=list(groups), dropped={reason: [] for reason in FILTER_REASONS})
        return filter_groups(
            groups, min_reward=self.min_reward, max_reward=self.max_reward, min_reward_variance=self.min_reward_variance
        )


def num_groups_to_request(batch_size: int, rollouts_per_example: int, oversampling_factor: float = 1.0) -> int:
    """Groups to generate per step: ``ceil(batch_size / rollouts_per_example * oversampling_factor)``."""
    if batch_size < 1 or rollouts_per_example < 1:
        raise ValueError(f"batch_size ({batch_size}) and rollouts_per_example ({rollouts_per_example}) must be >= 1")
    if oversampling_factor < 1:
        raise ValueError(f"oversampling_factor must be >= 1, got {oversampling_factor}")
    # The small tolerance keeps float noise (e.g. 16 * 1.1 = 17.600000000000001) from adding a group.
    return max(1, math.ceil(batch_size / rollouts_per_example * oversampling_factor - 1e-9))


@dataclass
class AssembledBatch:
    """The groups of one training batch and the metrics of how it was assembled."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_rollouts(self) -> int:
        return sum(group.num_rollouts for group in self.groups)

    @property
    def samples(self) -> list[TrainingSample]:
        return [sample for group in self.groups for sample in group.samples]


class BatchAssembler:
    """Accumulates kept groups until a batch of ``batch_size`` rollouts is full; keeps a bounded surplus."""

    def __init__(
        self,
        batch_size: int,
        *,
        difficulty_filter: DifficultyFilter | None = None,
        max_surplus_rollouts: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.difficulty_filter = difficulty_filter or DifficultyFilter(enabled=False)
        self.max_surplus_rollouts = batch_size if max_surplus_rollouts is None else max_surplus_rollouts
        if self.max_surplus_rollouts < 0:
            raise ValueError(f"max_surplus_rollouts must be >= 0, got {max_surplus_rollouts}")
        self._pending: deque[Group] = deque()
        self._num_pending_rollouts = 0
        self._reset_stats()
        self.num_dropped_surplus_groups = 0  # over the whole run

    def _reset_stats(self) -> None:
        self._num_groups_seen = 0
        self._num_rollouts_seen = 0
        self._filtered = {reason: 0 for reason in FILTER_REASONS}
        self._num_stale_dropped = 0
        self._num_surplus_dropped = 0

    @property
    def num_pending_rollouts(self) -> int:
        return self._num_pending_rollouts

    @property
    def num_pending_groups(self) -> int:
        return len(self._pending)

    def is_full(self) -> bool:
        return self._num_pending_rollouts >= self.batch_size

    def add(self, groups: Sequence[Group]) -> FilterResult:
        """Filter ``groups`` and queue the kept ones (after the groups already waiting)."""
        result = self.difficulty_filter(groups)
        self._num_groups_seen += result.num_groups
        self._num_rollouts_seen += sum(group.num_rollouts for group in groups)
        for reason, count in result.counts.items():
            self._filtered[reason] += count
        for group in result.kept:
            self._pending.append(group)
            self._num_pending_rollouts += group.num_rollouts
        return result

    def pending_groups(self) -> list[Group]:
        """The groups waiting for a batch, oldest first (their samples may be changed in place, not removed)."""
        return list(self._pending)

    def drop_stale(self, min_policy_version: int) -> int:
        """Drop waiting groups holding a sample older than ``min_policy_version``; returns how many."""
        kept = deque(group for group in self._pending if group.min_policy_version >= min_policy_version)
        num_dropped = len(self._pending) - len(kept)
        self._pending = kept
        self._num_pending_rollouts = sum(group.num_rollouts for group in kept)
        self._num_stale_dropped += num_dropped
        return num_dropped

    def take(self, min_policy_version: int | None = None) -> AssembledBatch | None:
        """The next batch (oldest groups first), or None while fewer than ``batch_size`` rollouts wait. The
        metrics cover the groups added since the previous batch. With ``min_policy_version``, waiting groups
        older than it are dropped first, so a batch never holds one (even one filled by an earlier surplus)."""
        if min_policy_version is not None:
            self.drop_stale(min_policy_version)
        if not self.is_full():
            return None
        groups: list[Group] = []
        num_rollouts = 0
        while num_rollouts < self.batch_size:
            group = self._pending.popleft()
            groups.append(group)
            num_rollouts += group.num_rollouts
        self._num_pending_rollouts -= num_rollouts
        while self._num_pending_rollouts > self.max_surplus_rollouts:
            oldest = self._pending.popleft()
            self._num_pending_rollouts -= oldest.num_rollouts
            self._num_surplus_dropped += 1
            self.num_dropped_surplus_groups += 1
        metrics = self.metrics()
        metrics["buffer/num_rollouts"] = float(num_rollouts)
        self._reset_stats()
        return AssembledBatch(groups=groups, metrics=metrics)

    def metrics(self) -> dict[str, float]:
        """Filtered fractions (of the groups seen since the last batch) and buffer sizes."""
        seen = self._num_groups_seen
        num_filtered = sum(self._filtered.values())
        metrics = {
            "filter/num_groups": float(seen),
            "filter/num_filtered": float(num_filtered),
            "filter/filtered_fraction": num_filtered / seen if seen else 0.0,
        }
        for reason, count in self._filtered.items():
            metrics[f"filter/{reason}"] = float(count)
            metrics[f"filter/{reason}_fraction"] = count / seen if seen else 0.0
        metrics["buffer/num_surplus_rollouts"] = float(self._num_pending_rollouts)
        metrics["buffer/num_stale_groups_dropped"] = float(self._num_stale_dropped)
        metrics["buffer/num_surplus_groups_dropped"] = float(self._num_surplus_dropped)
        return metrics
