"""Who the end of the run stops, and when: the law the registry's deregistrations and heartbeats follow. Pure (the
registry holds its lock around the calls); the end itself and its grace are ``run_progress.RunProgress``'s."""

from __future__ import annotations

from collections.abc import Iterable

from primerl.broker.run_progress import RunProgress
from primerl.broker.worker_record import ALIVE, WorkerRecord
from primerl.proto.roles import TRAINING_FINISHED_REASON
from primerl.proto.v1 import common_pb2


def ends_the_run(leaving: WorkerRecord, reason: str, run_step: int, max_steps: int | None, finished: bool) -> bool:
    """Whether ``leaving`` deregistering with ``reason`` ends the run: trainer rank 0 leaving with
    ``TRAINING_FINISHED_REASON`` once the run's step (``run_step``: trainer or committed) reached ``max_steps``."""
    return (
        leaving.role == common_pb2.ROLE_TRAINER
        and leaving.rank == 0
        and reason == TRAINING_FINISHED_REASON
        and max_steps is not None
        and run_step >= max_steps
        and not finished
    )


def tells_to_stop(
    worker: WorkerRecord,
    workers: Iterable[WorkerRecord],
    progress: RunProgress,
    now: float,
    *,
    timeout_s: float,
    orchestrator_finish_s: float,
) -> bool:
    """Whether ``worker``'s heartbeat answers ``shutdown_requested``: from the end-of-run grace on, except that
    an inference or teacher worker is kept while an orchestrator is still at work (its eval at the last step
    uses them), for at most ``orchestrator_finish_s`` more."""
    if not progress.tells_workers_to_stop(now):
        return False
    if worker.role not in (common_pb2.ROLE_INFERENCE, common_pb2.ROLE_TEACHER):
        return True
    if now >= progress.stop_workers_at + orchestrator_finish_s:
        return True
    return not any(
        w.role == common_pb2.ROLE_ORCHESTRATOR and w.state == ALIVE and now - w.last_seen <= timeout_s for w in workers
    )
