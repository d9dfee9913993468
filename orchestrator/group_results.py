"""What a finished rollout group becomes: its samples (capped to the base version after a rollback), its rollouts
counted (tokens generated and discarded, truncations, failures by kind) into the step's counters it is given, and
each environment's tokens per rollout over the run, the estimate of a cancelled group's tokens."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.dispatch_plan import InflightGroup
from primerl.orchestrator.endpoints import InferenceEndpoint
from primerl.orchestrator.lineage import PolicyLineage, cap_versions
from primerl.orchestrator.rollout_failures import RolloutFailures, is_unreachable, kind_name
from primerl.orchestrator.samples import Group, MalformedTrajectory, rollout_to_samples
from primerl.orchestrator.trajectory import RolloutGroup
from primerl.orchestrator.types import SchedulerEvents


class GroupResults:
    """Turns finished groups into ``Group``s and counts what their rollouts cost; with a teacher, a rollout ends a
    streak of failures only once its group is scored (``with_teacher``)."""

    def __init__(
        self,
        config: OrchestratorConfig,
        failures: RolloutFailures,
        events: SchedulerEvents,
        lineage: PolicyLineage,
        *,
        with_teacher: bool,
    ):
        self.config = config
        self.failures = failures
        self.events = events
        self.lineage = lineage
        self.with_teacher = with_teacher
        self._tokens_per_rollout: dict[str, tuple[int, int]] = {}  # env -> (tokens, rollouts) over the run

    def count_cancelled(self, counters: collections.Counter, entry: InflightGroup) -> None:
        """A group cancelled in flight: its tokens never come back; counted at the environment's mean tokens per
        rollout so far (generated and discarded as ``cancelled``)."""
        tokens, rollouts = self._tokens_per_rollout.get(entry.env_id, (0, 0))
        estimate = round(tokens / rollouts * self.config.rollouts_per_example) if rollouts else 0
        counters[f"tokens_generated/{entry.env_id}"] += estimate
        counters[f"tokens_discarded/cancelled/{entry.env_id}"] += estimate

    def count_error(
        self,
        counters: collections.Counter,
        kind: str,
        failure_kind: str,
        error: str,
        endpoint: InferenceEndpoint,
        num_rollouts: int = 1,
    ) -> None:
        """A failed rollout (``rollout_errors``) or rollout group (``env_errors``): both add to rollout/errors;
        ``failure_kind`` (the error's class) is counted apart and reported (``RolloutFailures``). A failure that
        says the inference worker could not be reached pauses dispatch to it (it may be restarting)."""
        counters[kind] += 1
        counters[f"errors/{kind_name(failure_kind)}"] += num_rollouts
        self.events.rollout_failed()
        if self.failures.failed(failure_kind, error, num_rollouts):
            endpoint.unreachable(time.monotonic())

    def to_group(
        self,
        rollout_group: RolloutGroup,
        entry: InflightGroup,
        group_id: str,
        counters: collections.Counter,
        fallbacks: collections.Counter,
        retry_unreachable: Callable[[InflightGroup, str], bool],
    ) -> Group | None:
        """The group's samples, or None: none came out of it, or a rollout says its inference worker could not be
        reached and ``retry_unreachable`` dispatches the whole group again."""
        config = self.config
        generated = sum(r.num_completion_tokens for r in rollout_group.rollouts)
        counters[f"tokens_generated/{entry.env_id}"] += generated
        tokens, rollouts = self._tokens_per_rollout.get(entry.env_id, (0, 0))
        self._tokens_per_rollout[entry.env_id] = (tokens + generated, rollouts + len(rollout_group.rollouts))
        unreachable = next(
            (r for r in rollout_group.rollouts if not r.ok and is_unreachable(r.error_type or "", r.error or "")), None
        )
        if unreachable is not None and retry_unreachable(
            entry, f"{unreachable.error_type or 'RolloutError'}: {unreachable.error}"
        ):
            counters[f"tokens_discarded/failed/{entry.env_id}"] += generated
            return None  # the whole group again, elsewhere: its other rollouts are not counted either
        kept_tokens = 0
        samples = []
        for rollout in rollout_group.rollouts:
            if not rollout.ok or rollout.reward is None:
                error = f"{entry.env_id}: {rollout.error}"
                self.count_error(
                    counters, "rollout_errors", rollout.error_type or "RolloutError", error, entry.endpoint
                )
                continue
            entry.endpoint.answered(time.monotonic())
            try:
                samples += rollout_to_samples(
                    rollout,
                    config.trajectory_strategy,
                    temperature=config.sampling.temperature,
                    default_policy_version=entry.dispatched_version,
                    fallback_counts=fallbacks,
                    group_id=group_id,
                    example_id=entry.example_index,
                    env_id=entry.env_id,
                )
                kept_tokens += rollout.num_completion_tokens
            except MalformedTrajectory as exc:
                counters[f"malformed_{exc.reason}"] += 1
                error = f"{entry.env_id}: {exc}"
                self.count_error(counters, "rollout_errors", f"malformed_{exc.reason}", error, entry.endpoint)
            else:
                if not self.with_teacher:  # with a teacher: once the teacher scored the group
                    self.failures.succeeded()
            counters["rollouts"] += 1
            counters["completion_tokens"] += rollout.num_completion_tokens
            counters["truncated"] += int(rollout.is_truncated)
        counters[f"tokens_discarded/failed/{entry.env_id}"] += generated - kept_tokens
        if not samples:
            return None
        ceiling = self.lineage.ceiling_since(entry.lineage_epoch)
        if ceiling is not None:  # made by weights a rollback since its dispatch removed
            cap_versions(samples, ceiling)
        return Group(
            group_id=group_id,
            example_id=entry.example_index,
            env_id=entry.env_id,
            samples=samples,
            generated_tokens=kept_tokens,
        )
