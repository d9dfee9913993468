"""The teacher stage of the rollout pipeline: collected groups wait here for the teacher's logprobs before they get
their advantages (``[orchestrator.teacher]``, online distillation).

    stage = TeacherStage(TeacherScorer(config.teacher, run_token=...))
    stage.submit(group)                  # the group's samples go to the teacher
    stage.futures()                      # waited on by the scheduler together with its rollout futures
    result = stage.finish(future)        # ScoredGroup: samples with teacher_logprobs, or the TeacherError
    stage.refresh(watcher)               # the teacher workers the broker lists (no teacher.base_url)

Invariants: a group is in the stage from ``submit`` until ``finish`` of its future; ``finish`` sets every sample's
``teacher_logprobs`` or returns the error and leaves the samples as they were; ``close`` fails every scoring under
way at once. The stage counts nothing: the scheduler counts what ``finish`` returns.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

from primerl.orchestrator.endpoints import EndpointWatcher
from primerl.orchestrator.samples import Group
from primerl.orchestrator.teacher_client import TeacherError
from primerl.orchestrator.teacher_scoring import TeacherScorer
from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator")


@dataclass(frozen=True)
class ScoredGroup:
    """A group whose teacher scoring ended: scored (``error`` None) or not, and its number of rollouts."""

    group: Group
    num_rollouts: int
    error: TeacherError | None = None


class TeacherStage:
    """Groups being scored by the teacher (module docstring)."""

    def __init__(self, scorer: TeacherScorer):
        self.scorer = scorer
        self._scoring: dict[concurrent.futures.Future, tuple[Group, float]] = {}  # -> (group, submitted_s)
        self._teachers_generation = -1

    def __len__(self) -> int:
        return len(self._scoring)

    def submit(self, group: Group) -> None:
        self._scoring[self.scorer.submit(group.samples)] = (group, time.monotonic())

    def futures(self) -> list[concurrent.futures.Future]:
        return list(self._scoring)

    def holds(self, future: concurrent.futures.Future) -> bool:
        return future in self._scoring

    def groups(self) -> list[Group]:
        """The groups being scored (a rollback caps their samples' versions too)."""
        return [group for group, _ in self._scoring.values()]

    def finish(self, future: concurrent.futures.Future) -> ScoredGroup:
        """A scoring that ended (``future`` done): the group with its samples' ``teacher_logprobs``, or the error."""
        group, submitted_s = self._scoring.pop(future)
        num_rollouts = len({sample.rollout_id for sample in group.samples})
        try:
            logprobs = future.result()
        except TeacherError as exc:
            return ScoredGroup(group, num_rollouts, exc)
        for sample, values in zip(group.samples, logprobs, strict=True):
            sample.teacher_logprobs = values
        log.debug(
            "teacher scored group",
            group_id=group.group_id,
            num_samples=len(group.samples),
            seconds=round(time.monotonic() - submitted_s, 3),
        )
        return ScoredGroup(group, num_rollouts)

    def refresh(self, watcher: EndpointWatcher) -> None:
        """Take the teacher workers the broker lists (``watcher``: an ``EndpointWatcher`` of ROLE_TEACHER)."""
        watcher.check()
        generation, workers = watcher.snapshot()
        if generation == self._teachers_generation:
            return
        self._teachers_generation = generation
        before = set(self.scorer.endpoints.endpoints)
        self.scorer.set_endpoints({worker_id: info.base_url for worker_id, info in workers.items()})
        for worker_id in set(workers) - before:
            log.info(telemetry.TEACHER_WORKER_JOINED, worker_id=worker_id, url=workers[worker_id].base_url)
        for worker_id in before - set(workers):
            log.info("teacher worker left", worker_id=worker_id)

    def take_metrics(self) -> dict[str, float]:
        """``teacher/*`` since the last call (``TeacherScorer.take_metrics``)."""
        return self.scorer.take_metrics()

    def close(self) -> None:
        """Fail every scoring under way and forget the groups (on stop)."""
        self.scorer.close()
        self._scoring.clear()


__all__ = ["ScoredGroup", "TeacherStage"]
