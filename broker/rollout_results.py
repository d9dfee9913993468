"""What the rollout queue answers: the outcome of an offered batch (``Accepted``, ``Duplicate``, ``Stale``,
``Superseded``, ``Backpressure``, ``Refused``), the batches to send to a trainer session (``Delivery``, ``StepDone``), a
group's outcome, and the status of the queue and of the rollout stream around it. Plain data; ``rollout_queue`` decides,
``rollout_plane`` turns them into messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from primerl.proto.v1 import data_pb2


@dataclass(frozen=True)
class StepDone:
    step: int
    rank: int
    num_micro_batches: int


@dataclass(frozen=True)
class Delivery:
    """Batches to send to one session now (in order), then ``step_done`` if set."""

    session_id: bytes
    batch_ids: tuple[str, ...] = ()
    step_done: StepDone | None = None

    def __bool__(self) -> bool:
        return bool(self.batch_ids) or self.step_done is not None


@dataclass(frozen=True)
class Accepted:
    batch_id: str
    step: int
    deliveries: tuple[Delivery, ...] = ()


@dataclass(frozen=True)
class Duplicate:
    batch_id: str
    step: int


@dataclass(frozen=True)
class Stale:
    """The batch's step is already committed (e.g. a resend whose ack was lost): acked, not stored."""

    batch_id: str
    step: int
    committed_step: int


@dataclass(frozen=True)
class Superseded:
    """The broker holds the batch's step whole from another producer incarnation (``owner``), and serves the step
    only from that one: acked (nothing to resend), not stored."""

    batch_id: str
    step: int
    owner: str


@dataclass(frozen=True)
class Backpressure:
    batch_id: str
    step: int
    retry_after_ms: int
    reason: str


@dataclass(frozen=True)
class Refused:
    """A message that can never succeed as sent; ``code`` is an ErrorCode."""

    code: int
    message: str
    batch_id: str = ""
    step: int = 0


OfferResult = Accepted | Duplicate | Stale | Superseded | Backpressure | Refused


@dataclass(frozen=True)
class OfferItem:
    """One batch of a group for ``offer_many``. ``header_bytes``/``crc32``: the exact serialized header the
    payload's verified envelope checksum covers, to spool without recomputing the CRC."""

    header: data_pb2.RolloutBatchHeader
    payload: Any
    header_bytes: bytes | None = None
    crc32: int | None = None


@dataclass(frozen=True)
class GroupResult:
    """The outcome of each batch of a group (in order), and the deliveries the accepted ones made possible
    (send them after the acks)."""

    results: tuple[OfferResult, ...]
    deliveries: tuple[Delivery, ...] = ()


@dataclass(frozen=True)
class RolloutQueueStatus:
    num_batches: int
    num_bytes: int
    max_batches: int
    max_bytes: int
    num_pending_requests: int
    num_sessions: int
    committed_step: int | None
    lowest_step: int | None
    highest_step: int | None
    num_accepted: int
    num_duplicates: int
    num_backpressured: int
    num_released: int
    # Batches and bytes no trainer session has been given yet, other than those of a step a session asks for now:
    # what the bounds count. ``frontier_step``: the highest step a trainer asked for.
    num_ahead_batches: int = 0
    num_ahead_bytes: int = 0
    frontier_step: int | None = None
    # Batches not kept because their step is held whole from another producer incarnation, sent or spooled
    # (a partial set dropped when another incarnation completed the step).
    num_superseded: int = 0
    # Batches told to wait because the spool's disk was full (ENOSPC), counted in num_backpressured too.
    num_disk_full: int = 0


@dataclass(frozen=True)
class RolloutStreamStatus:
    """What the control plane reports about the rollout stream."""

    queue: RolloutQueueStatus
    port: int
    running: bool
    batches_in_per_s: float
    bytes_in_per_s: float
    batches_out_per_s: float
    bytes_out_per_s: float
    num_refused: int
    num_backpressure_replies: int
    throughput_window_s: float
    # Peers admitted at the handshake and connected now, and connections refused there (``max_connections``);
    # None and 0 when the plane admits every peer.
    num_connections: int | None = None
    num_connections_refused: int = 0
