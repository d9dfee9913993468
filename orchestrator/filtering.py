"""Online difficulty filtering of rollout groups, and batch assembly.

A group (the rollouts of one example) is dropped, checked in this order, when
- ``too_hard``: its mean reward is below ``min_reward``;
- ``too_easy``: its mean reward is above ``max_reward``;
- ``low_variance``: its reward variance (population, ddof=0) is below ``min_reward_variance``, or all its rewards
  are equal (zero advantages, nothing to learn; this is the filter's rule even with ``min_reward_variance = 0``).
The bounds are inclusive: a mean equal to ``min_reward`` or ``max_reward`` is kept. Rewards are read after
``zero_truncated_completions`` and without the length penalty (see ``advantages``).

``BatchAssembler`` collects kept groups, oldest first, until they hold ``batch_size`` rollouts; the groups beyond
stay for the next step (the surplus), at most ``max_surplus_rollouts`` of them (the oldest beyond the bound are
dropped and counted). Groups are never split: a batch holds exactly ``batch_size`` rollouts when every group is
complete, and may exceed it by less than one group when some rollouts were lost.

With ``shares`` (env id -> share of the batch, the normalized env weights) each batch takes from each environment
its quota, ``batch_size x share`` in whole groups (the fractions carried from batch to batch, so that the shares
hold over the run), whatever the order in which groups finish: a fast environment's groups wait for a slow one's.
With ``constant_batch_size`` (``orchestrator.constant_trainer_batch_size``) a group whose advantages are all 0 is
dropped before counting (``filter/zero_advantage``), so a batch holds ``batch_size`` rollouts that carry signal.
An environment that dropped ``FILL_BOUND_ROUNDS`` batches' worth of groups since the last batch without filling
its quota gets its quota filled with its latest dropped groups (``batch/filled_with_dropped_rollouts``; the
scheduler logs a warning naming the settings): a step never waits forever on groups that carry no signal.

Waste: the completion tokens of the groups dropped here, by reason (``filtered``, ``stale``, ``surplus``) and
environment, since the last batch, come with the batch (``AssembledBatch.discarded_tokens``).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from primerl.orchestrator.samples import Group, TrainingSample
from primerl.proto import telemetry

if TYPE_CHECKING:
    from primerl.configs.orchestrator import BufferConfig

DIFFICULTY_REASONS = ("too_hard", "too_easy", "low_variance")
FILTER_REASONS = (*DIFFICULTY_REASONS, "zero_advantage")
"""Why a group is dropped: the difficulty filter's reasons (``filter_reason``), and ``zero_advantage`` (every
advantage 0: no policy gradient), dropped before counting with ``constant_trainer_batch_size``."""

FILL_BOUND_ROUNDS = 8
"""A step whose environment dropped this many batches' worth of groups (filtered or zero-advantage) without
filling its share is filled with its latest dropped groups (``BatchAssembler``), with a warning, instead of
waiting on."""


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
        return {reason: len(groups) for reason, groups in self.dropped.items()}

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
    result = FilterResult(kept=[], dropped={reason: [] for reason in DIFFICULTY_REASONS})
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
            return FilterResult(kept=list(groups), dropped={reason: [] for reason in DIFFICULTY_REASONS})
        return filter_groups(
            groups, min_reward=self.min_reward, max_reward=self.max_reward, min_reward_variance=self.min_reward_variance
        )


@dataclass
class AssembledBatch:
    """The groups of one training batch and the metrics of how it was assembled."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    discarded_tokens: Counter = field(default_factory=Counter)  # (reason, env id) -> completion tokens
    filled_rollouts: dict[str, int] = field(default_factory=dict)  # env id -> rollouts of dropped groups trained

    @property
    def num_rollouts(self) -> int:
        return sum(group.num_rollouts for group in self.groups)

    @property
    def samples(self) -> list[TrainingSample]:
        return [sample for group in self.groups for sample in group.samples]


class BatchAssembler:
    """Accumulates kept groups until a batch of ``batch_size`` rollouts is full (each environment's quota with
    ``shares``); keeps a bounded surplus (module docstring)."""

    def __init__(
        self,
        batch_size: int,
        *,
        difficulty_filter: DifficultyFilter | None = None,
        max_surplus_rollouts: int | None = None,
        shares: Mapping[str, float] | None = None,
        group_size: int = 1,
        constant_batch_size: bool = False,
        fill_bound_groups: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.batch_size = batch_size
        self.group_size = group_size
        self.difficulty_filter = difficulty_filter or DifficultyFilter(enabled=False)
        self.max_surplus_rollouts = batch_size if max_surplus_rollouts is None else max_surplus_rollouts
        if self.max_surplus_rollouts < 0:
            raise ValueError(f"max_surplus_rollouts must be >= 0, got {max_surplus_rollouts}")
        self.constant_batch_size = constant_batch_size
        if fill_bound_groups is None:
            fill_bound_groups = FILL_BOUND_ROUNDS * math.ceil(batch_size / group_size)
        self.fill_bound_groups = fill_bound_groups
        if shares is not None:
            total = sum(shares.values())
            if not shares or total <= 0 or any(share < 0 for share in shares.values()):
                raise ValueError(f"shares must be >= 0 and sum to more than 0, got {dict(shares)}")
            if batch_size % group_size:
                raise ValueError(f"batch_size ({batch_size}) must be a multiple of group_size ({group_size})")
            self.shares = {env_id: share / total for env_id, share in shares.items()}
        else:
            self.shares = {"": 1.0}  # one pool: every group counts toward the one quota
        self._by_env = shares is not None
        self._credit = {pool: 0.0 for pool in self.shares}
        self._quotas: dict[str, int] | None = None  # rollouts per pool of the next batch, fixed once computed
        self._pending: deque[Group] = deque()
        self._pending_rollouts: Counter = Counter()  # by pool
        self._dropped: dict[str, deque[Group]] = {pool: deque() for pool in self.shares}  # since the last batch
        self._dropped_since_batch: Counter = Counter()  # groups, by pool
        self._groups_seen: Counter = Counter()  # over the run, by pool: what ``keep_rate`` reads
        self._groups_kept: Counter = Counter()
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._num_groups_seen = 0
        self._filtered = {reason: 0 for reason in FILTER_REASONS}
        self._num_stale_dropped = 0
        self._num_surplus_dropped = 0
        self.discarded_tokens: Counter = Counter()  # (reason, env id) -> completion tokens, since the last batch

    def pool(self, group: Group) -> str:
        """The quota a group counts toward: its environment with ``shares``, else the one pool."""
        if not self._by_env:
            return ""
        if group.env_id not in self.shares:
            raise ValueError(f"group of unknown environment {group.env_id!r}; known: {', '.join(self.shares)}")
        return group.env_id

    @property
    def num_pending_rollouts(self) -> int:
        return sum(self._pending_rollouts.values())

    def pending_rollouts(self, pool: str = "") -> int:
        """Rollouts of kept groups waiting in ``pool`` (an env id with ``shares``, else "")."""
        return self._pending_rollouts[pool]

    def keep_rate(self, pool: str = "") -> float:
        """The fraction of ``pool``'s groups kept so far over the run (1 before any): what dispatch divides by."""
        return (self._groups_kept[pool] + 1) / (self._groups_seen[pool] + 1)

    # -- quotas ----------------------------------------------------------------------------------------

    def _apportion(self, credit: dict[str, float]) -> dict[str, int]:
        """One batch's quota per pool in rollouts (whole groups), from the carried fractions ``credit`` (updated)."""
        if not self._by_env:
            return {"": self.batch_size}
        num_groups = self.batch_size // self.group_size
        for pool, share in self.shares.items():
            credit[pool] += num_groups * share
        groups = {pool: math.floor(credit[pool] + 1e-9) for pool in self.shares}
        by_fraction = sorted(self.shares, key=lambda pool: (groups[pool] - credit[pool], pool))
        for pool in by_fraction[: max(0, num_groups - sum(groups.values()))]:
            groups[pool] += 1
        for pool in self.shares:
            credit[pool] -= groups[pool]
        return {pool: count * self.group_size for pool, count in groups.items()}

    def quotas(self) -> dict[str, int]:
        """Rollouts per pool of the next batch (fixed until that batch is taken)."""
        if self._quotas is None:
            self._quotas = self._apportion(self._credit)
        return dict(self._quotas)

    def planned_rollouts(self, num_batches: int) -> dict[str, int]:
        """Rollouts per pool of the next ``num_batches`` batches (the next one's quota included)."""
        planned = Counter(self.quotas())
        credit = dict(self._credit)
        for _ in range(max(0, num_batches - 1)):
            planned.update(self._apportion(credit))
        return {pool: planned[pool] for pool in self.shares}

    # -- groups in ---------------------------------------------------------------------------------------

    def add(self, groups: Sequence[Group]) -> FilterResult:
        """Filter ``groups`` and queue the kept ones (after the groups already waiting); with
        ``constant_batch_size`` a group with no signal is dropped as ``zero_advantage``."""
        result = self.difficulty_filter(groups)
        if self.constant_batch_size:
            silent = [group for group in result.kept if not group.has_signal]
            if silent:
                result.kept = [group for group in result.kept if group.has_signal]
                result.dropped.setdefault("zero_advantage", []).extend(silent)
        self._num_groups_seen += result.num_groups
        for reason, count in result.counts.items():
            self._filtered[reason] += count
        for dropped in result.dropped.values():
            for group in dropped:
                pool = self.pool(group)
                self._groups_seen[pool] += 1
                self._dropped_since_batch[pool] += 1
                self.discarded_tokens["filtered", group.env_id] += group.num_completion_tokens
                recent = self._dropped[pool]
                recent.append(group)
                while sum(g.num_rollouts for g in recent) - recent[0].num_rollouts >= self.batch_size:
                    recent.popleft()  # the latest batch's worth is all a fill could use
        for group in result.kept:
            pool = self.pool(group)
            self._groups_seen[pool] += 1
            self._groups_kept[pool] += 1
            self._pending.append(group)
            self._pending_rollouts[pool] += group.num_rollouts
        return result

    def pending_groups(self) -> list[Group]:
        """The groups waiting for a batch, oldest first, then the dropped ones a fill may still use (their
        samples may be changed in place, not removed)."""
        return [*self._pending, *(group for recent in self._dropped.values() for group in recent)]

    def waiting_groups(self) -> list[Group]:
        """The kept groups waiting for a batch, oldest first."""
        return list(self._pending)

    def drop_stale(self, min_policy_version: int) -> int:
        """Drop waiting groups holding a sample older than ``min_policy_version``; returns how many."""
        kept: deque[Group] = deque()
        for group in self._pending:
            if group.min_policy_version >= min_policy_version:
                kept.append(group)
                continue
            self._pending_rollouts[self.pool(group)] -= group.num_rollouts
            self.discarded_tokens["stale", group.env_id] += group.num_completion_tokens
        num_dropped = len(self._pending) - len(kept)
        self._pending = kept
        for pool, recent in self._dropped.items():
            self._dropped[pool] = deque(g for g in recent if g.min_policy_version >= min_policy_version)
        self._num_stale_dropped += num_dropped
        return num_dropped

    # -- batches out ---------------------------------------------------------------------------------------

    def _fillable(self, pool: str) -> bool:
        return self._dropped_since_batch[pool] >= self.fill_bound_groups and bool(self._dropped[pool])

    def is_full(self) -> bool:
        """Whether every pool holds its quota (or may be filled: ``FILL_BOUND_ROUNDS``)."""
        for pool, quota in self.quotas().items():
            if self._pending_rollouts[pool] >= quota:
                continue
            have = self._pending_rollouts[pool] + sum(g.num_rollouts for g in self._dropped[pool])
            if not (self._fillable(pool) and have >= quota):
                return False
        return True

    def take(self, min_policy_version: int | None = None) -> AssembledBatch | None:
        """The next batch (each pool's groups of the oldest policy versions first, then the earliest to arrive),
        or None while a pool holds fewer rollouts than its
        quota. The metrics cover the groups added since the previous batch. With ``min_policy_version``, waiting
        groups older than it are dropped first, so a batch never holds one (even one filled by an earlier
        surplus)."""
        if min_policy_version is not None:
            self.drop_stale(min_policy_version)
        if not self.is_full():
            return None
        quotas = self.quotas()
        taken: Counter = Counter()
        chosen: set[int] = set()
        # each pool's oldest policy versions first (they go stale first), in arrival order among equals
        for group in sorted(self._pending, key=lambda g: g.min_policy_version):
            pool = self.pool(group)
            if taken[pool] < quotas[pool]:
                chosen.add(id(group))
                taken[pool] += group.num_rollouts
        groups = [group for group in self._pending if id(group) in chosen]
        self._pending = deque(group for group in self._pending if id(group) not in chosen)
        for pool in quotas:
            self._pending_rollouts[pool] -= taken[pool]
        filled: dict[str, int] = {}
        for pool, quota in quotas.items():
            recent = self._dropped[pool]
            while taken[pool] < quota and recent:  # the pool's latest dropped groups (``_fillable``)
                group = recent.pop()
                groups.append(group)
                taken[pool] += group.num_rollouts
                filled[group.env_id] = filled.get(group.env_id, 0) + group.num_rollouts
                self.discarded_tokens["filtered", group.env_id] -= group.num_completion_tokens
        num_rollouts = sum(taken.values())
        self._drop_surplus()
        metrics = self.metrics()
        metrics[telemetry.BUFFER_NUM_ROLLOUTS] = float(num_rollouts)
        metrics[telemetry.BATCH_FILLED_WITH_DROPPED_ROLLOUTS] = float(sum(filled.values()))
        batch = AssembledBatch(
            groups=groups, metrics=metrics, discarded_tokens=+self.discarded_tokens, filled_rollouts=filled
        )
        self._reset_stats()
        self._quotas = None
        self._dropped_since_batch.clear()
        for recent in self._dropped.values():
            recent.clear()
        return batch

    def _drop_surplus(self) -> None:
        """Each pool keeps at most its share of ``max_surplus_rollouts`` (whole groups; the oldest policy versions
        go first)."""
        for pool, share in self.shares.items():
            bound = self.max_surplus_rollouts if not self._by_env else math.ceil(self.max_surplus_rollouts * share)
            while self._pending_rollouts[pool] > bound:
                oldest = min((g for g in self._pending if self.pool(g) == pool), key=lambda g: g.min_policy_version)
                self._pending.remove(oldest)
                self._pending_rollouts[pool] -= oldest.num_rollouts
                self.discarded_tokens["surplus", oldest.env_id] += oldest.num_completion_tokens
                self._num_surplus_dropped += 1

    def metrics(self) -> dict[str, float]:
        """Filtered fractions (of the groups seen since the last batch) and buffer sizes."""
        seen = self._num_groups_seen
        num_filtered = sum(self._filtered.values())
        metrics = {
            telemetry.FILTER_NUM_GROUPS: float(seen),
            telemetry.FILTER_NUM_FILTERED: float(num_filtered),
            telemetry.FILTER_FILTERED_FRACTION: num_filtered / seen if seen else 0.0,
        }
        for reason, count in self._filtered.items():
            metrics[f"{telemetry.FILTER_PREFIX}{reason}"] = float(count)
            metrics[f"{telemetry.FILTER_PREFIX}{reason}_fraction"] = count / seen if seen else 0.0
        metrics[telemetry.BUFFER_NUM_SURPLUS_ROLLOUTS] = float(self.num_pending_rollouts)
        metrics[telemetry.BUFFER_NUM_STALE_GROUPS_DROPPED] = float(self._num_stale_dropped)
        metrics[telemetry.BUFFER_NUM_SURPLUS_GROUPS_DROPPED] = float(self._num_surplus_dropped)
        return metrics
