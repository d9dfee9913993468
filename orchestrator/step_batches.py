"""Taking a step's batch from the assembler: once it is full, held a little for groups in flight that can go into no
later step, so that newer groups taken now do not leave them to go stale."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.dispatch_plan import InflightGroup
from primerl.orchestrator.filtering import FILL_BOUND_ROUNDS, AssembledBatch, BatchAssembler
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator")

LAST_CHANCE_HOLD_MIN_S = 1.0
"""The least a ready step waits for groups in flight that can go into no later step (``StepBatches.take``)."""


class StepBatches:
    """The batch of the step asked for, from ``assembler`` within ``bound``, and since when it could be taken."""

    def __init__(self, assembler: BatchAssembler, bound: AsyncBound):
        self.assembler = assembler
        self.bound = bound
        self._step_started, self._step_started_s = 0, 0.0  # the step ``take`` is asked for, since when
        self._full_since_s: float | None = None  # when its batch could first be taken

    def take(self, step: int, inflight: Iterable[InflightGroup]) -> AssembledBatch | None:
        """The step's batch once enough groups recent enough for it are assembled, else None. A batch filled with
        dropped groups (an environment whose groups carried no signal for ``FILL_BOUND_ROUNDS`` batches' worth)
        is said in one warning line."""
        now_s = time.monotonic()
        if self._step_started != step:
            self._step_started, self._step_started_s, self._full_since_s = step, now_s, None
        if self._hold_for_last_chance(step, now_s, inflight):
            return None
        batch = self.assembler.take(min_policy_version=self.bound.min_policy_version(step))
        if batch is not None and batch.filled_rollouts:
            log.warning(
                "step filled with groups that carry no signal or were filtered: the environment dropped "
                f"{FILL_BOUND_ROUNDS} batches' worth of groups without filling its share; set "
                "orchestrator.constant_trainer_batch_size = false to count them, or loosen [orchestrator.buffer] "
                "(or check the environment's rewards)",
                step=step,
                filled_rollouts=dict(batch.filled_rollouts),
            )
        return batch

    def _hold_for_last_chance(self, step: int, now_s: float, inflight: Iterable[InflightGroup]) -> bool:
        """Whether to wait a little before taking ``step``'s batch although it could be taken: some environment's
        groups in flight can go into no later step (``AsyncBound.last_step``) and fit in its quota with the
        waiting groups of that kind; taking newer groups now would let them go stale. Held at most as long as the
        step took to become ready (at least ``LAST_CHANCE_HOLD_MIN_S``), so a straggler never holds a step for
        long."""
        assembler, bound = self.assembler, self.bound
        assembler.drop_stale(bound.min_policy_version(step))
        if not assembler.is_full():
            return False
        if self._full_since_s is None:
            self._full_since_s = now_s
        if now_s - self._full_since_s > max(LAST_CHANCE_HOLD_MIN_S, self._full_since_s - self._step_started_s):
            return False
        last_chance = collections.Counter(e.env_id for e in inflight if bound.last_step(e.dispatched_version) <= step)
        if not last_chance:
            return False
        waiting = collections.Counter(
            g.env_id for g in assembler.waiting_groups() if bound.last_step(g.min_policy_version) <= step
        )
        quotas = assembler.quotas()
        return any(
            waiting[env_id] + count <= quotas.get(env_id, 0) // assembler.group_size
            for env_id, count in last_chance.items()
        )
