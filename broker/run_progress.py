"""The run's position as the registry keeps it: the last committed step, the trainer's and the orchestrator's
steps, and whether the run is over. Not thread-safe: the registry holds its lock around every call.

Steps never go back: a step is the highest any worker of that role reported, and the steps of records the registry
no longer lists (dropped, or known only from an earlier broker's run state) stay as floors under it.

End of run: rank 0 of the trainer deregistering with reason ``"training finished"`` once the run's trainer step
reached ``max_steps`` finishes the run (``WorkerRegistry.request_shutdown``): heartbeats answer
``shutdown_requested`` from ``end_of_run_grace_s`` later on, and the run state says so, so that a restarted broker
still tells late workers to stop (after the same grace, counted from its restart). The grace lets the last policy
reach the inference workers and lets a supervisor that ends the run itself (``primerl rl`` stops the roles once the
trainer has exited) have the first word; the broker's request is what ends roles that nobody else stops (separate
daemons, systemd).
"""

from __future__ import annotations

from collections.abc import Iterable

from primerl.broker.run_state import RunState
from primerl.broker.worker_record import WorkerRecord
from primerl.proto.v1 import common_pb2


class RunProgress:
    def __init__(self) -> None:
        self.last_committed_step = 0
        self.finished = False  # the run is over: heartbeats tell workers to stop (from ``stop_workers_at``)
        self.finished_step = 0  # the run's trainer step when it finished
        self.stop_workers_at = 0.0  # registry clock from which heartbeats say shutdown_requested
        self._trainer_step_floor = 0
        self._orchestrator_step_floor = 0

    def trainer_step(self, workers: Iterable[WorkerRecord]) -> int:
        steps = [w.trainer_step for w in workers if w.role == common_pb2.ROLE_TRAINER and w.trainer_step is not None]
        return max([self._trainer_step_floor, *steps])

    def orchestrator_step(self, workers: Iterable[WorkerRecord]) -> int:
        steps = [
            w.orchestrator_step
            for w in workers
            if w.role == common_pb2.ROLE_ORCHESTRATOR and w.orchestrator_step is not None
        ]
        return max([self._orchestrator_step_floor, *steps])

    def keep_steps_of(self, worker: WorkerRecord) -> None:
        """The registry drops ``worker``'s record: its progress stays in the run's steps."""
        if worker.trainer_step is not None:
            self._trainer_step_floor = max(self._trainer_step_floor, worker.trainer_step)
        if worker.orchestrator_step is not None:
            self._orchestrator_step_floor = max(self._orchestrator_step_floor, worker.orchestrator_step)

    def restore(self, state: RunState, *, committed_step: int, max_steps: int | None, stop_workers_at: float) -> None:
        """An earlier broker's run state; ``committed_step``: the spool's own commit marker (the higher wins).
        ``finished`` is kept only while it still holds: with ``max_steps`` raised since (a run extended), the run
        goes on; kept, its workers are told to stop from ``stop_workers_at``."""
        self.last_committed_step = max(state.last_committed_step, committed_step)
        self._trainer_step_floor = state.trainer_step
        self._orchestrator_step_floor = state.orchestrator_step
        if state.finished and max_steps is not None and state.finished_step >= max_steps:
            self.finished, self.finished_step, self.stop_workers_at = True, state.finished_step, stop_workers_at

    def finish(self, trainer_step: int, stop_workers_at: float) -> bool:
        """The run is over (once): True when this call finished it."""
        if self.finished:
            return False
        self.finished, self.stop_workers_at = True, stop_workers_at
        self.finished_step = max(trainer_step, self.last_committed_step)
        return True

    def tells_workers_to_stop(self, now_s: float) -> bool:
        return self.finished and now_s >= self.stop_workers_at
