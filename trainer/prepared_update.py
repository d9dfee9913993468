"""A built weight update (`PreparedUpdate`) and the memory its payload lies in (`PayloadPlaces`): pooled buffers or,
on the same-host road, shared-memory segments a broker on this host maps instead of receiving bytes. Each part goes
back once, when nothing reads it any more."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from primerl.proto.shared_segment import Segment, SegmentPool
from primerl.proto.v1 import data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.trainer.payload_writer import PayloadPool

if TYPE_CHECKING:
    import torch

    from primerl.trainer.payload_stream import PayloadStream

__all__ = ["PayloadMemory", "PayloadPlaces", "PreparedUpdate", "PublishKind"]

log = get_logger(__name__)

PublishKind = Literal["full", "lora", "delta"]


@dataclass(eq=False)
class PayloadMemory:
    """Where a prepared payload lies, each part given back once: the pooled ``buffer`` (None: the payload owns its
    bytes, or it went back) and the shared-memory ``segment`` (the same-host road; None: none, or it went back)."""

    buffer: bytearray | None = None
    segment: Segment | None = None

    def take_buffer(self) -> bytearray | None:
        """The buffer, once: later calls return None."""
        buffer, self.buffer = self.buffer, None
        return buffer

    def take_segment(self) -> Segment | None:
        """The segment, once: later calls return None."""
        segment, self.segment = self.segment, None
        return segment


@dataclass(frozen=True)
class PreparedUpdate:
    """A built update: ``header`` (digest and sizes set) and ``payload``; ``snapshot`` is the full host state
    it encodes (FULL/DELTA of a delta publisher), kept as the base of the next delta once this one is stored."""

    kind: PublishKind
    header: data_pb2.WeightUpdateHeader
    payload: bytes | memoryview
    build_ms: float
    snapshot: dict[str, torch.Tensor] | None = None
    # The pooled buffer and the shared segment under ``payload``: back to the pool (or the writer) once stored.
    memory: PayloadMemory = field(default_factory=PayloadMemory)
    phases_ms: dict[str, float] = field(default_factory=dict)
    fallback: str | None = None
    # ``snapshot`` views ``buffer`` (a FULL of a delta publisher): the buffer lives as long as that base.
    owns_snapshot: bool = False
    # A streamed FULL (``payload_stream``): ``payload`` is still being written; the header has no digest (it follows
    # in the last chunk).
    stream: PayloadStream | None = None

    @property
    def policy_version(self) -> int:
        return self.header.policy_version

    def settle_stream(self) -> None:
        """A streamed payload's writer is done reading the parameters (whatever came of the send): the optimizer
        may change them once ``send`` returns. Its failure, if any, was raised to the sender already."""
        if self.stream is not None:
            try:
                self.stream.done()
            except Exception:  # noqa: BLE001 - raised from wait_for during the send; the buffer is then never reused
                self.memory.take_buffer()


class PayloadPlaces:
    """The pooled buffers and the same-host road's shared segments of one publisher's payloads. The road is left
    for good once the broker cannot map its segments (`leave_road`); they close once the update then being sent was
    stored (`close_if_left`), as its payload may lie in one."""

    def __init__(self, segments: SegmentPool | None):
        self._pool = PayloadPool()
        self._segments = segments
        self._on_road = segments is not None

    @property
    def transport(self) -> str:
        """How updates go: "shared_memory" (segments of the same-host road) or "socket" (bytes)."""
        return "shared_memory" if self._on_road else "socket"

    def buffer(self, num_bytes: int, *, pinned: bool = False) -> bytearray:
        """A pooled buffer of at least ``num_bytes`` (``pinned``: page-locked, for copies from a GPU)."""
        return self._pool.acquire(num_bytes, pinned=pinned)

    def give_back_buffer(self, buffer: bytearray) -> None:
        self._pool.release(buffer)

    def segment(self, num_bytes: int) -> Segment | None:
        """A drained shared segment for a payload of ``num_bytes`` (None: updates go as bytes). Logs the segments the
        pool retired because their readers did not drain in time."""
        if self._segments is None:
            return None
        segment = self._segments.acquire(num_bytes)
        for path in self._segments.retired:
            log.warning(
                "a shared weight segment was not released in time; a new one replaces it",
                path=path,
                drain_timeout_s=self._segments.drain_timeout_s,
            )
        self._segments.retired.clear()
        return segment

    def shared_descriptor(self, prepared: PreparedUpdate) -> data_pb2.SharedSegment | None:
        """The descriptor of ``prepared``'s payload in a shared segment, copied there first when it was built
        elsewhere (a LoRA adapter, a delta, a FULL the next delta's base views); None: it goes as bytes."""
        if not self._on_road or prepared.stream is not None:
            return None
        source = memoryview(prepared.payload).cast("B")
        segment = prepared.memory.segment
        if segment is None:
            segment = self.segment(source.nbytes)
            assert segment is not None
            segment.view(source.nbytes)[:] = source
            prepared.memory.segment = segment
        return segment.publish(source.nbytes)

    def leave_road(self, reason: str) -> None:
        """The broker cannot map this trainer's segments (another host, another /dev/shm): bytes from now on."""
        log.warning("the broker cannot read this trainer's shared memory; weight updates go as bytes", error=reason)
        self._on_road = False

    def release(self, prepared: PreparedUpdate, *, read: bool = True) -> None:
        """Give back ``prepared``'s shared segment (``read``: it was handed out, and is written again only once its
        readers drained) and, with ``read``, its pooled buffer."""
        segment = prepared.memory.take_segment()
        if segment is not None and self._segments is not None:
            self._segments.give_back(segment, read=read)
        if not read:
            return
        prepared.settle_stream()  # the writer must be finished with the buffer before it is reused
        buffer = prepared.memory.take_buffer()  # released once, even if send is called again
        if buffer is not None:
            self._pool.release(buffer)

    def abandon(self, prepared: PreparedUpdate) -> None:
        """A send failed without an answer (e.g. a timeout): the payload may still be referenced by the socket (its
        buffer is never reused) and its segment read by the broker and its workers (written again once drained)."""
        segment = prepared.memory.take_segment()
        if segment is not None and self._segments is not None:
            self._segments.give_back(segment)

    def close_if_left(self) -> None:
        """Close the segments once the road was left (`leave_road`) and no payload lies in one."""
        if not self._on_road:
            self.close()

    def close(self) -> None:
        if self._segments is not None:
            self._segments.close()
            self._segments = None
