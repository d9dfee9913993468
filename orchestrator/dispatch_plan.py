"""Which groups one dispatch round sends where: the environment each group goes to and the inference worker that
runs it, planned from the answering workers and each environment's deficit (no IO; the scheduler submits the plan).

Which environment a group goes to follows what the batches need, not a draw: each environment's deficit is the
rollouts its quotas of the batches a group dispatched now can still go into (``AsyncBound.last_step`` of the
worker's version: at most ``max_async_level + 1`` batches) need, less the rollouts waiting for it, in groups to
keep in flight (``groups_to_keep_in_flight``: over its keep rate, the groups not filtered so far, rounded down, so
that no group is dispatched only on the chance that another is filtered), less its groups in flight; the
environment furthest behind its share gets the next group, and none gets a group no batch it could reach needs.
So a slow environment keeps more groups in flight (its groups stay in flight longer), shares follow the weights,
and groups are not generated only to go stale.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.endpoints import InferenceEndpoint
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.filtering import BatchAssembler
from primerl.orchestrator.seeds import rollout_seed_base

GroupKey = tuple[str, str, int | None]
"""(env id, worker id, sampling seed): the groups handed to an environment in one write."""


@dataclass
class InflightGroup:
    """A rollout group dispatched to an env worker, not yet collected."""

    env_id: str
    example_index: int
    endpoint: InferenceEndpoint
    dispatched_version: int
    started_s: float = field(default_factory=time.monotonic)
    lineage_epoch: int = 0  # ``PolicyLineage.epoch`` at dispatch: rollbacks after it cap the samples' versions
    num_retries: int = 0  # times this example's group was dispatched again after an unreachable inference worker


def groups_to_keep_in_flight(missing: float, keep_rate: float) -> int:
    """Groups to have in flight for ``missing`` groups still needed when a fraction ``keep_rate`` of groups is kept
    (not filtered): as many as are expected to be kept without passing ``missing`` (``floor(missing /
    keep_rate)``), and never fewer than are missing. A group kept beyond what the batches it can reach need goes
    stale, so the expected count is rounded down: a group filtered is replaced when its result comes (one more
    round trip), where one dispatched on the chance would be discarded whenever none was filtered."""
    if missing <= 1e-9:
        return 0
    return max(math.ceil(missing - 1e-9), math.floor(missing / max(0.05, keep_rate) + 1e-9))


def env_deficits(
    assembler: BatchAssembler,
    bound: AsyncBound,
    step: int,
    policy_version: int,
    max_inflight: int,
    coming: Mapping[str, int],
) -> dict[str, float]:
    """Groups each environment still needs for the batches a group dispatched now with ``policy_version`` can go
    into, less the groups ``coming`` (in flight or being scored), before this dispatch round. Batches past what
    ``max_inflight`` rollouts could fill change no choice (every deficit is then larger than a round can dispatch),
    so at most that many are planned: a large ``max_async_level`` costs nothing per round."""
    num_batches = min(bound.last_step(policy_version), step + bound.max_async_level) - step + 1
    num_batches = min(num_batches, math.ceil(max_inflight / max(1, assembler.batch_size)) + 1)
    deficits = {}
    for env_id, rollouts in assembler.planned_rollouts(max(1, num_batches)).items():
        missing = max(0, rollouts - assembler.pending_rollouts(env_id)) / assembler.group_size
        deficits[env_id] = groups_to_keep_in_flight(missing, assembler.keep_rate(env_id)) - coming.get(env_id, 0)
    return deficits


def neediest(deficits: Mapping[str, float], shares: Mapping[str, float]) -> str | None:
    """The environment furthest behind its share (deficit over share), or None when none needs a group."""
    needing = [env_id for env_id, need in deficits.items() if need > 1e-9 and shares.get(env_id, 0) > 0]
    if not needing:
        return None
    return max(needing, key=lambda env_id: deficits[env_id] / shares[env_id])


def plan_round(
    num_groups: int,
    *,
    usable: Sequence[InferenceEndpoint],
    deficits_for: Callable[[int], dict[str, float]],
    shares: Mapping[str, float],
    rescheduled: collections.deque[tuple[str, int, int]],
    sampler: EnvSampler,
    seed: int | None,
    group_size: int,
    first_group_id: int,
    lineage_epoch: int,
    now_s: float,
) -> dict[GroupKey, list[InflightGroup]]:
    """Up to ``num_groups`` groups, each to the ``usable`` worker that answers (not backing off; probed one group at
    a time) with the fewest rollouts in flight, whose ``num_inflight`` the plan reserves. The ``rescheduled`` groups
    (lost with a dead environment or an unreachable inference worker, drawn already) go first; then each group goes
    to the environment furthest behind its share (``deficits_for(worker version)``, asked once per version), and
    none once every batch a group could go into is provided for. Group ids run on from ``first_group_id``: group
    g's rollout i gets seed ``rollout_seed_base(seed, g, group_size) + i``."""
    groups: dict[GroupKey, list[InflightGroup]] = collections.defaultdict(list)
    deficits: dict[int, dict[str, float]] = {}  # by the worker's version: groups each env still needs
    for group_id in range(first_group_id, first_group_id + num_groups):
        answering = [e for e in usable if e.may_take(now_s)]
        if not answering:
            break
        endpoint = min(answering, key=lambda e: e.num_inflight)
        if endpoint.policy_version not in deficits:
            deficits[endpoint.policy_version] = deficits_for(endpoint.policy_version)
        if rescheduled:
            env_id, example_index, num_retries = rescheduled.popleft()
        else:
            env_id = neediest(deficits[endpoint.policy_version], shares)
            if env_id is None:
                break
            env_id, example_index = sampler.next(env_id)
            num_retries = 0
        for needs in deficits.values():
            needs[env_id] -= 1
        group_seed = rollout_seed_base(seed, group_id, group_size)
        groups[(env_id, endpoint.worker_id, group_seed)].append(
            InflightGroup(
                env_id,
                example_index,
                endpoint,
                endpoint.policy_version,
                lineage_epoch=lineage_epoch,
                num_retries=num_retries,
            )
        )
        endpoint.num_inflight += group_size
    return groups
