"""Rollbacks as the orchestrator sees them: samples made with rolled-back weights count as the base version and
the async bound then drops them like stale ones (``primerl.orchestrator.lineage``)."""

from __future__ import annotations

from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.filtering import BatchAssembler
from primerl.orchestrator.lineage import PolicyLineage, cap_versions
from primerl.orchestrator.samples import Group, TrainingSample


def sample(version: int, rollout_id: int = 0) -> TrainingSample:
    return TrainingSample(
        [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [1.0] * 3, [version] * 3, rollout_id=rollout_id
    )


def group(group_id: int, version: int, num_rollouts: int = 2) -> Group:
    return Group(
        group_id=group_id,
        example_id=group_id,
        env_id="toy",
        samples=[sample(version, rollout_id=r) for r in range(num_rollouts)],
    )


def test_the_first_lineage_is_no_rollback_a_newer_one_is_and_an_older_one_is_ignored():
    lineage = PolicyLineage()
    assert lineage.observe(0, 0) is None and lineage.epoch == 0  # nothing published yet
    assert lineage.observe(1000, 0) is None and lineage.epoch == 0  # the run's first trainer
    assert lineage.observe(1000, 0) is None
    assert lineage.observe(2000, 2) == 2 and lineage.epoch == 1  # resumed from checkpoint 2
    assert lineage.observe(1500, 1) is None and lineage.epoch == 1  # an older answer arriving late
    assert lineage.observe(3000, 5) == 5 and lineage.epoch == 2
    assert lineage.ceiling_since(0) == 2  # dispatched before both rollbacks: the lowest base
    assert lineage.ceiling_since(1) == 5
    assert lineage.ceiling_since(2) is None


def test_capped_samples_are_dropped_by_the_async_bound_like_stale_ones():
    """Old lineage published v1..v4, the trainer resumed from checkpoint 2. Groups of v3 and v4 waiting for
    step 5's batch are capped to v2; with max_async_level 1 step 5 needs v3 or newer, so only new ones count."""
    bound = AsyncBound(max_async_level=1)
    assembler = BatchAssembler(4)
    assembler.add([group(1, 3), group(2, 4)])
    changed = cap_versions((s for g in assembler.pending_groups() for s in g.samples), 2)
    assert changed == 4
    assert [g.min_policy_version for g in assembler.pending_groups()] == [2, 2]
    assert assembler.take(min_policy_version=bound.min_policy_version(5)) is None  # both dropped as stale
    assembler.add([group(3, 3), group(4, 4)])  # made by the new lineage after the rollback: kept
    batch = assembler.take(min_policy_version=bound.min_policy_version(5))
    assert batch is not None and sorted(g.group_id for g in batch.groups) == [3, 4]


def test_cap_leaves_older_tokens_alone():
    mixed = TrainingSample([1, 2, 3, 4], [False, True, True, True], [0.0] * 4, [1.0] * 4, [1, 1, 3, 4])
    assert cap_versions([mixed], 2) == 1
    assert list(mixed.policy_versions) == [1, 1, 2, 2]
    assert cap_versions([mixed], 2) == 0
