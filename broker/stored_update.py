"""One weight update as the broker holds it: its header and payload segments (``StoredUpdate``, frozen) and what the
planes keep beside it while they forward it (``InTransit``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from primerl.proto.v1 import data_pb2

if TYPE_CHECKING:
    from primerl.broker.shared_updates import SharedPayload
    from primerl.broker.weight_intake import ReceivedChunks
    from primerl.broker.weight_messages import ForwardMessages

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
LORA = data_pb2.WEIGHT_UPDATE_KIND_LORA
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA
SNAPSHOT_KINDS = frozenset({FULL, LORA})


def kind_name(kind: int) -> str:
    return data_pb2.WeightUpdateKind.Name(kind).removeprefix("WEIGHT_UPDATE_KIND_")


@dataclass(eq=False)
class InTransit:
    """What the broker keeps beside a stored update while it forwards it (the update itself is frozen)."""

    received: ReceivedChunks | None = None
    """The chunks as the trainer sent them (``broker.weight_intake``): forwarded as they are."""
    forward: ForwardMessages | None = None
    """The chunk messages sent to workers (``broker.weight_messages``), built as the chunks arrive."""
    stored_s: float | None = None
    """When the store took it (monotonic): the start of the forward lag."""
    receivers: Collection[str] = ()
    """The workers receiving it, or having it next, when it was stored (whose forward lag is measured)."""
    on_disk: bool = False
    """Its payload is read from its durable file now (the received frames are freed)."""


@dataclass(frozen=True, eq=False)
class StoredUpdate:
    """One update. ``segments`` are read-only views of its payload, in order, as it arrived (one per chunk: the
    frames the broker received, never joined); ``transit`` what the broker keeps beside it while forwarding it.

    An update being received (``incoming``) already exists so that the plane can forward its chunks as they come
    (cut-through): its ``segments`` list grows until the last chunk is in, then the store takes it or refuses it.
    """

    header: data_pb2.WeightUpdateHeader
    segments: list[memoryview]
    transit: InTransit = field(default_factory=InTransit, repr=False)
    # The trainer's shared-memory segment ``segments`` view (the same-host road, ``broker.shared_updates``); None:
    # the payload arrived as bytes.
    shared: SharedPayload | None = field(default=None, repr=False)

    @classmethod
    def of(cls, header: data_pb2.WeightUpdateHeader, payload: Any) -> StoredUpdate:
        """An update whose payload is one bytes-like object (kept by reference, not copied)."""
        return cls(header=copy_header(header), segments=[_readonly_bytes(payload)])

    @property
    def payload(self) -> memoryview:
        """The whole payload as one view: the segment itself when there is one, else a joined COPY (for tests and
        tools; the broker's planes and its durable writer use ``segments``)."""
        if len(self.segments) == 1:
            return self.segments[0]
        return memoryview(b"".join(self.segments)).toreadonly()

    @property
    def policy_version(self) -> int:
        return self.header.policy_version

    @property
    def kind(self) -> int:
        return self.header.kind

    @property
    def base_version(self) -> int:
        return self.header.base_version

    @property
    def lineage(self) -> int:
        return self.header.lineage

    @property
    def num_bytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)

    def describe(self) -> str:
        base = f" on v{self.base_version}" if self.kind == DELTA else ""
        lineage = f" lineage {self.lineage}" if self.lineage else ""
        return f"{kind_name(self.kind)} v{self.policy_version}{base}{lineage} ({self.num_bytes} bytes)"


def _readonly_bytes(payload: Any) -> memoryview:
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view.toreadonly()


def copy_header(header: data_pb2.WeightUpdateHeader) -> data_pb2.WeightUpdateHeader:
    copy = data_pb2.WeightUpdateHeader()
    copy.CopyFrom(header)
    return copy
