"""The rollout queue's admission law: what an offered batch is answered, decided from the batch, the step index
and the bounds. Pure: no lock, no disk, no counters (``RolloutQueue`` holds the lock, counts and spools).

In order: a malformed header is ``Refused``; so is a step too far ahead of the run; a batch already spooled (or
earlier in its group) is a ``Duplicate``; one of a committed step is ``Stale``; one that cannot join its step (the
other kind of id, another packing) is ``Refused``; one of a step held whole from another producer incarnation is
``Superseded``; one larger than ``max_bytes`` is ``Refused``; one ahead of the trainers that would overfill the
queue is told to wait (``Backpressure``); any other is ``Accepted``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from primerl.broker.rollout_results import Accepted, Backpressure, Duplicate, OfferResult, Refused, Stale, Superseded
from primerl.broker.rollout_steps import StepIndex
from primerl.broker.spool_format import PREFIX_BYTES
from primerl.proto.batch_ids import parse_producer_batch_id
from primerl.proto.micro_batch import tensor_spec_problem
from primerl.proto.v1 import common_pb2, data_pb2

MALFORMED = common_pb2.ERROR_CODE_MALFORMED_HEADER


@dataclass
class QueueRoom:
    """What the bounds see when a group's batches are decided: the batches and bytes ahead of the trainers
    (``RolloutQueue``'s module docstring), the steps sessions ask for now, and the bounds."""

    num_ahead: int
    bytes_ahead: int
    asked_steps: set[int]
    max_batches: int
    max_bytes: int
    retry_after_ms: int

    def fill(self, step: int, size_bytes: int) -> None:
        """A batch of ``step`` was accepted: the later batches of the group see it."""
        if step not in self.asked_steps:
            self.num_ahead += 1
            self.bytes_ahead += size_bytes


def admit(
    header: data_pb2.RolloutBatchHeader,
    size_bytes: int,
    steps: StepIndex,
    room: QueueRoom,
    *,
    known: bool,
    committed_step: int | None,
    too_far: str,
) -> OfferResult:
    """The answer to one offered batch (module docstring). ``known``: its id is spooled or earlier in its group;
    ``too_far``: why its step is beyond the run's window ("" when within)."""
    batch_id, step = header.batch_id, header.step
    problem = check_header(header) or tensor_spec_problem(header.tensors)
    if problem:
        return Refused(MALFORMED, problem, batch_id, step)
    if too_far:
        return Refused(common_pb2.ERROR_CODE_OUT_OF_ORDER, f"batch {batch_id!r}: {too_far}", batch_id, step)
    if known:
        return Duplicate(batch_id, step)
    if committed_step is not None and step <= committed_step:
        return Stale(batch_id, step, committed_step)
    tag = parse_producer_batch_id(batch_id)
    owner = steps.sealed.get(step)
    superseded = tag is not None and owner is not None and owner != tag.producer
    problem = steps.kind_problem(header, tag) or (
        steps.owner_problem(header, tag, owner) if superseded else steps.placement_problem(header, tag)
    )
    if problem:
        return Refused(MALFORMED, problem, batch_id, step)
    if superseded:
        return Superseded(batch_id, step, owner)
    if size_bytes > room.max_bytes:
        return Refused(
            common_pb2.ERROR_CODE_OVERSIZED,
            f"batch {batch_id!r} ({size_bytes} bytes spooled) can never fit in max_queue_bytes = "
            f"{room.max_bytes}; raise it or send smaller micro-batches",
            batch_id,
            step,
        )
    # Only a batch ahead of the trainers counts against the bounds: one of a step a trainer asks for now is
    # always taken, or later steps filling the queue first would keep that step from ever completing.
    if step in room.asked_steps:
        return Accepted(batch_id, step)
    if room.num_ahead >= room.max_batches:
        reason = f"{room.num_ahead} of {room.max_batches} batches"
    elif room.bytes_ahead + size_bytes > room.max_bytes:
        reason = f"{room.bytes_ahead} + {size_bytes} of {room.max_bytes} bytes"
    else:
        return Accepted(batch_id, step)
    return Backpressure(
        batch_id,
        step,
        room.retry_after_ms,
        f"rollout queue full ({reason} ahead of the trainers); wait until a trainer asks for the next step",
    )


def check_header(header: data_pb2.RolloutBatchHeader) -> str:
    if header.num_micro_batches < 1:
        return f"batch {header.batch_id!r}: num_micro_batches must be >= 1, got {header.num_micro_batches}"
    if header.micro_batch_index >= header.num_micro_batches:
        return (
            f"batch {header.batch_id!r}: micro_batch_index {header.micro_batch_index} is not below "
            f"num_micro_batches {header.num_micro_batches}"
        )
    return ""


def spooled_size_bytes(header_bytes: bytes, payload: Any) -> int:
    """Bytes a batch takes in the spool (what ``max_bytes`` counts): file prefix + header + payload."""
    return PREFIX_BYTES + len(header_bytes) + memoryview(getattr(payload, "buffer", payload)).nbytes
