"""``RunStatus`` assembled from the registry's run facts and workers (``assemble_run_status``) and the parts that
are not the registry's own: the data plane's queues and rates (``DataPlaneStatus``, filled on demand by the broker
service), the bound that keeps the message under a default gRPC client's 4 MiB limit (``trim_status``), and worker
lists for log lines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from primerl.broker.run_state import RunState
from primerl.proto.v1 import common_pb2, control_pb2

if TYPE_CHECKING:
    from primerl.broker.weight_fanout import LatestPolicy

# RunStatus is trimmed (capabilities, then departed workers, then the rest) to stay under this.
MAX_STATUS_BYTES = 3 * 2**20


class QueueDepth(NamedTuple):
    """One queue of the data plane, as ``RunStatus.queues`` shows it."""

    name: str
    num_items: int
    num_bytes: int
    capacity_items: int = 0
    capacity_bytes: int = 0


@dataclass
class DataPlaneStatus:
    """What the data plane (rollout queue, weight store) contributes to ``RunStatus``; filled on demand. The
    latest policy version is not here: the registry reads it from the weight fan-out (``WeightFanout.latest``)."""

    queues: Sequence[QueueDepth | control_pb2.QueueStatus] = field(default_factory=list)
    rollout_batches_per_s: float = 0.0
    rollout_bytes_per_s: float = 0.0
    weight_bytes_per_s: float = 0.0


def queue_proto(queue: QueueDepth | control_pb2.QueueStatus | tuple) -> control_pb2.QueueStatus:
    if isinstance(queue, control_pb2.QueueStatus):
        return queue
    depth = QueueDepth(*queue)
    return control_pb2.QueueStatus(
        name=depth.name,
        num_items=depth.num_items,
        num_bytes=depth.num_bytes,
        capacity_items=depth.capacity_items,
        capacity_bytes=depth.capacity_bytes,
    )


def assemble_run_status(
    state: RunState,
    latest: LatestPolicy,
    workers: Sequence[control_pb2.WorkerInfo],
    data_plane: DataPlaneStatus,
    *,
    started_unix_ms: int,
    updated_unix_ms: int,
    recent_errors: Iterable[str],
    max_steps: int,
    max_metric_names: int,
) -> control_pb2.RunStatus:
    """The run status: the run's facts (``state``, the registry's), its latest policy, workers and data plane,
    trimmed to ``MAX_STATUS_BYTES``."""
    status = control_pb2.RunStatus(
        run_id=state.run_id,
        broker_started_unix_ms=started_unix_ms,
        updated_unix_ms=updated_unix_ms,
        trainer_step=state.trainer_step,
        last_committed_step=state.last_committed_step,
        latest_policy_version=latest.version,
        orchestrator_step=state.orchestrator_step,
        workers=workers,
        queues=[queue_proto(q) for q in data_plane.queues],
        rollout_batches_per_s=data_plane.rollout_batches_per_s,
        rollout_bytes_per_s=data_plane.rollout_bytes_per_s,
        weight_bytes_per_s=data_plane.weight_bytes_per_s,
        last_metrics=state.last_metrics,
        last_metrics_step=state.last_metrics_step,
        recent_errors=recent_errors,
        max_steps=max_steps,
        policy_lineage=latest.lineage,
        lineage_base_version=latest.lineage_base_version,
        num_rollbacks=latest.num_rollbacks,
    )
    if status.ByteSize() > MAX_STATUS_BYTES:
        trim_status(status, MAX_STATUS_BYTES, max_metric_names)
    return status


def trim_status(status: control_pb2.RunStatus, max_bytes: int, max_metric_names: int) -> None:
    """Cut ``status`` to at most ``max_bytes`` serialized: worker capabilities go first, then departed workers, then
    live workers beyond what fits, then metrics (alphabetical order kept; a quarter of ``max_metric_names``); a line in
    ``recent_errors`` says it was trimmed. The limits on the inputs make this a last resort."""
    original = status.ByteSize()
    for worker in status.workers:
        worker.capabilities.clear()
    if status.ByteSize() > max_bytes:
        alive = [w for w in status.workers if w.state == control_pb2.WORKER_STATE_ALIVE]
        del status.workers[:]
        status.workers.extend(alive)
    while status.ByteSize() > max_bytes and len(status.workers) > 1:
        del status.workers[len(status.workers) // 2 :]
    if status.ByteSize() > max_bytes:
        kept = dict(sorted(status.last_metrics.items())[: max_metric_names // 4])
        status.last_metrics.clear()
        status.last_metrics.update(kept)
    status.recent_errors.append(
        f"broker: run status trimmed from {original} to {status.ByteSize()} bytes to fit a client's 4 MiB limit"
    )


def role_name(role: int) -> str:
    try:
        return common_pb2.Role.Name(role)
    except ValueError:
        return f"role {role}"


def format_workers(workers: Iterable[control_pb2.WorkerInfo]) -> str:
    """``name (ROLE, STATE)`` list, for log lines."""
    return ", ".join(f"{w.name} ({role_name(w.role)}, {control_pb2.WorkerState.Name(w.state)})" for w in workers)
