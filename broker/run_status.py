"""The parts of ``RunStatus`` that are not the registry's own: the data plane's queues and rates
(``DataPlaneStatus``, filled on demand by the broker service), the bound that keeps the message under a default
gRPC client's 4 MiB limit (``trim_status``), and worker lists for log lines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from primerl.proto.v1 import common_pb2, control_pb2

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


def trim_status(status: control_pb2.RunStatus, max_bytes: int, max_metric_names: int) -> None:
    """Cut ``status`` to at most ``max_bytes`` serialized: worker capabilities go first, then departed
    workers, then live workers beyond what fits, then metrics (alphabetical order kept; a quarter of
    ``max_metric_names``); a line in ``recent_errors`` says it was trimmed. The limits on the inputs make this a
    last resort."""
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
