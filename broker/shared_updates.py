"""Updates whose payload the trainer handed over in shared memory: the broker's side of the same-host road.

A trainer on the broker's host publishes a descriptor (``WeightUpdateHeader.shared_segment``) instead of the
bytes (``primerl.proto.shared_segment``). The broker maps the segment read-only, checks the update as it checks
bytes (header, version window, digest: ``WeightIntake``), and stores it with its payload viewing the segment. Then:

- an inference worker on the same host (``Hello.host_id``) is sent the descriptor, one small message, and reads the
  segment itself; it counts as a reader of the segment until it acknowledges any version at or above it, fails it,
  or the fan-out forgets it (declared gone);
- a worker on another host (or one that could not map the segment) is sent the bytes, from the broker's own
  mapping, cut into chunks, as for any stored update;
- the durable writer writes the chain from that mapping once the same-host readers are done (a copy of the whole
  payload would take the cores they load with), and the store then reads the payload from its file.

``SharedPayload.releasable`` says when the trainer may write the segment again: no reader left, and the broker no
longer needs the segment itself (its payload is on disk, or the update left the chain). Where the durable file does
not come (no durable directory, a failing disk) the plane copies the payload into its own memory first
(``COPY_AFTER_S`` after the last reader). Releasing writes the segment's ``released`` word and unmaps it.
"""

from __future__ import annotations

import time

from primerl.proto import framing
from primerl.proto.shared_segment import MappedSegment, mark_released
from primerl.proto.v1 import data_pb2

__all__ = ["COPY_AFTER_S", "SharedPayload"]

COPY_AFTER_S = 2.0
"""How long after its last reader a segment whose payload is not on disk waits before the broker copies it into
its own memory to release it."""


class SharedPayload:
    """The segment one stored update's payload lies in, and who reads it. Owned by the weight plane's IO thread."""

    def __init__(self, mapped: MappedSegment, descriptor: data_pb2.SharedSegment):
        self.mapped = mapped
        self.descriptor = descriptor
        self.readers: set[str] = set()
        self.readers_done_s: float | None = time.monotonic()
        self.released = False
        self._message: list | None = None

    @property
    def host_id(self) -> str:
        return self.descriptor.host_id

    def message(self, header: data_pb2.WeightUpdateHeader, envelope: dict[str, str]) -> list:
        """The frames of the descriptor message a same-host worker is sent (built once)."""
        if self._message is None:
            with_segment = data_pb2.WeightUpdateHeader()
            with_segment.CopyFrom(header)
            with_segment.shared_segment.CopyFrom(self.descriptor)
            self._message = framing.encode(data_pb2.WEIGHT_UPDATE, with_segment, [b""], **envelope)
        return self._message

    def add_reader(self, worker_id: str) -> None:
        self.readers.add(worker_id)
        self.readers_done_s = None

    def reader_done(self, worker_id: str) -> bool:
        """``worker_id`` reads the segment no more; True when it was the last reader."""
        if worker_id in self.readers:
            self.readers.discard(worker_id)
            if not self.readers:
                self.readers_done_s = time.monotonic()
                return True
        return False

    def release(self) -> None:
        """Every reader is done and the broker needs the segment no more: the trainer may write it again."""
        if not self.released:
            self.released = True
            mark_released(self.mapped)
            self.mapped.close()
