"""Publish the policy to the broker after each optimizer step: full weights, a LoRA adapter, or a lossless delta.

``publish`` = ``build`` (``UpdateBuilder``, ``primerl.trainer.update_builder``, which says what goes on the wire: it
reads the parameters, in the trainer daemon on its IO thread, before the next optimizer step may change them) +
``send`` (socket I/O: a ``PreparedUpdate`` owns its bytes, valid until ``send`` returns). A delta pays or not at the
rate of this publisher's last ``send`` (payload bytes over the time from the start of ``send`` to the broker's ack).

Lineage: every update carries ``lineage`` (one per trainer incarnation: the ``policy_lineage`` the broker gave
trainer rank 0 when it registered, ``RegisterResponse.policy_lineage``) and ``lineage_base_version`` (the version
the trainer resumed from). The broker hands lineages out from a counter in its durable run state, each above every
one before, so a restarted trainer's lineage supersedes its predecessors' whatever the hosts' clocks say. A trainer
resumed from an older checkpoint re-publishes versions under a newer lineage: the broker accepts its first FULL even
at a version it holds and drops the rolled-back updates; a replaced incarnation's next update is refused with
``LineageSuperseded``, which ends it. Only without a lineage from the broker (a broker before
``policy_lineage``) does a publisher take the unix microseconds of its start, ordered by the hosts' clocks.

Broker outages: ``send`` retries a publish lost to a missing connection or ack through
``primerl.client.outage.retry_through_outage`` until the role's ``broker.outage_s``; a resend is safe (the broker
acknowledges an update it already stored). ``PublishResult.phases_ms``: ``read``, ``snapshot``, ``estimate``,
``encode``, ``digest``, ``send``; a streamed FULL: ``read``, ``layout``, ``send`` (its copies overlap the send).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from primerl.client.outage import OutageWatch, retry_through_outage
from primerl.client.weight_publisher import WeightPublisher, WeightPublishTimeout
from primerl.proto import telemetry
from primerl.proto.shared_segment import SegmentPool
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import LineageSuperseded, WeightUpdateRefused
from primerl.runtime.config_common import DEFAULT_OUTAGE_S
from primerl.runtime.log_setup import get_logger
from primerl.trainer.prepared_update import PayloadPlaces, PreparedUpdate, PublishKind
from primerl.trainer.update_builder import DeltaEncodingChoice, DeltaPolicy, UpdateBuilder

if TYPE_CHECKING:
    import torch

__all__ = ["PolicyPublisher", "PublishResult"]

log = get_logger(__name__)

Transport = Literal["auto", "socket"]


@dataclass(frozen=True)
class PublishResult:
    """What one ``publish`` did. ``kind`` is what was sent (a delta publisher sends "full" when it must);
    ``fallback`` says why it sent FULL instead of DELTA (None when it sent what was asked)."""

    ack: data_pb2.WeightAck
    kind: PublishKind
    policy_version: int
    base_version: int
    payload_bytes: int
    num_tensors: int
    build_ms: float
    send_ms: float
    fallback: str | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    # How its bytes went: "shared_memory" (a segment the broker and same-host workers read) or "socket".
    transport: str = "socket"


class PolicyPublisher:
    """Sends the policy of each step to the broker's weight plane. One per trainer (rank 0).

    Not thread-safe: ``build`` and ``send`` may run on different threads (the trainer daemon runs both on its IO
    thread), but a delta's ``build`` needs the previous ``send`` to have finished (its result is the delta's base)."""

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        sender: str,
        chunk_bytes: int,
        kind: PublishKind,
        policy_name: str,
        *,
        serving_dtype: torch.dtype | None = None,
        delta_level: int = 1,
        delta_policy: DeltaPolicy = "auto",
        delta_encoding: DeltaEncodingChoice = "auto",
        publisher: WeightPublisher | None = None,
        outage_s: float = DEFAULT_OUTAGE_S,
        stop_event: threading.Event | None = None,
        lineage: int | None = None,
        curve: Any = None,
        stream: bool | None = None,
        transport: Transport = "auto",
        run_id: str = "",
    ):
        """``serving_dtype``: cast floating-point FULL/DELTA tensors to this dtype (None: the model's own).
        ``delta_level``: zlib level of XOR_ZLIB deltas. ``delta_policy``: "auto" sends FULL when a delta would not
        pay (module docstring), "always" sends every possible delta. ``delta_encoding``: "sparse", "xor_zlib", or
        "auto" (SPARSE for mostly 16-bit float weights, else XOR_ZLIB). ``publisher``: an existing ``WeightPublisher``
        to use (tests). ``outage_s``: how long a publish waits through a broker outage (the role's
        ``broker.outage_s``); ``stop_event``: ends that wait early (``OutageStopped``). ``lineage``: this trainer
        incarnation's lineage, the broker's ``RegisterResponse.policy_lineage`` (None: now, in unix microseconds:
        for a broker that hands out none; tests pass their own). ``stream``: send a FULL update of a "full"
        publisher larger than one chunk while it is still written (``payload_stream``; its digest follows in the
        last chunk); False: write and hash the whole payload first; None: stream when the weights are on a GPU.
        ``transport``: "auto" hands each update over in shared memory (``proto.shared_segment``, segments named
        after ``run_id``) while the broker can map it (a broker on this host), else as bytes; "socket": always
        bytes. An encrypted (CURVE) wire always sends bytes."""
        if outage_s <= 0:
            raise ValueError(f"outage_s must be > 0, got {outage_s}")
        if transport not in ("auto", "socket"):
            raise ValueError(f'transport must be "auto" or "socket", got {transport!r}')
        self.lineage = time.time_ns() // 1000 if lineage is None else lineage
        # The same-host road: payloads written into shared-memory segments (None: bytes over the socket).
        self._places = PayloadPlaces(SegmentPool(run_id or sender) if transport == "auto" and curve is None else None)
        self._builder = UpdateBuilder(
            kind,
            policy_name,
            self.lineage,
            chunk_bytes,
            serving_dtype=serving_dtype,
            delta_level=delta_level,
            delta_policy=delta_policy,
            delta_encoding=delta_encoding,
            stream=stream,
            places=self._places,
        )
        self._last_transport = self._places.transport  # how the last update went
        self._wire_bytes_per_s: float | None = None
        # ``curve``: CURVE credentials (``BrokerClientConfig.curve_client()``) for a broker that encrypts its planes.
        self._publisher = publisher or WeightPublisher(endpoint, auth_token, sender, chunk_bytes, curve=curve)
        self.outage_s = outage_s
        self.sender = sender
        self._stop_event = stop_event

    @property
    def base_version(self) -> int | None:
        """The version the next delta would apply to (None: the next update is FULL)."""
        return self._builder.base_version

    @property
    def transport(self) -> str:
        """How the next update goes: "shared_memory" (the same-host road) or "socket" (bytes)."""
        return self._places.transport

    def publish(self, model: torch.nn.Module, version: int, timeout_s: float = 120.0) -> PublishResult:
        """Build and send ``model`` as ``version``; returns once the broker stored it.

        Raises ``WeightUpdateRefused`` with the broker's error (e.g. OUT_OF_ORDER for a version not newer than
        the latest it holds) and ``WeightPublishTimeout``; after any failure the next publish is FULL.
        """
        kind = self._builder.kind
        fallback = self._builder.why_full() if kind == "delta" else None
        if fallback is not None:
            kind = "full"
        prepared = self.build(model, version, kind=kind)
        fallback = prepared.fallback or fallback
        try:
            ack, send_ms = self.send(prepared, timeout_s)
        except WeightUpdateRefused as exc:
            if (
                isinstance(exc, LineageSuperseded)
                or prepared.kind != "delta"
                or not (exc.full_required or exc.code == common_pb2.ERROR_CODE_OUT_OF_ORDER)
            ):
                raise
            fallback = f"delta refused: {exc}"
            log.warning("delta refused; sending the version as FULL", policy_version=version, error=str(exc))
            prepared = self._builder.full_of(prepared)
            ack, send_ms = self.send(prepared, timeout_s)
        header = prepared.header
        num_tensors = len(header.decoded_tensors) if prepared.kind == "delta" else len(header.tensors)
        return PublishResult(
            ack=ack,
            kind=prepared.kind,
            policy_version=version,
            base_version=header.base_version,
            payload_bytes=header.payload_bytes,
            num_tensors=num_tensors,
            build_ms=prepared.build_ms,
            send_ms=send_ms,
            fallback=fallback,
            phases_ms={**prepared.phases_ms, "send": send_ms},
            transport=self._last_transport,
        )

    def build(self, model: torch.nn.Module, version: int, *, kind: PublishKind | None = None) -> PreparedUpdate:
        """Read the model and encode one update of ``kind`` (`UpdateBuilder.build`); runs between optimizer steps."""
        return self._builder.build(model, version, kind=kind, wire_bytes_per_s=self._wire_bytes_per_s)

    def send(self, prepared: PreparedUpdate, timeout_s: float = 120.0) -> tuple[data_pb2.WeightAck, float]:
        """Send a built update; returns (ack, send ms). Keeps the delta base in step with what the broker holds:
        a stored update becomes the base; a failed send leaves none (the next publish is FULL)."""
        start_s = time.perf_counter()
        lost = self._builder.lose_base()
        try:
            try:
                shared = self._places.shared_descriptor(prepared)
                try:
                    ack = self._publish_through_outage(prepared, timeout_s, shared)
                except WeightUpdateRefused as exc:
                    if shared is None or exc.code != common_pb2.ERROR_CODE_NOT_FOUND:
                        raise
                    self._places.leave_road(str(exc))
                    shared = None
                    ack = self._publish_through_outage(prepared, timeout_s, None)
            finally:
                prepared.settle_stream()
        except WeightUpdateRefused as exc:
            self._places.release(prepared, read=False)  # refused: the broker holds none of it (the buffer aside)
            if not prepared.owns_snapshot:
                self._places.release(prepared)  # nothing else reads it
            if isinstance(exc, LineageSuperseded):
                log.error(
                    "policy lineage superseded: a newer trainer incarnation publishes; this one must stop",
                    policy_version=prepared.policy_version,
                    lineage=self.lineage,
                    broker_lineage=exc.broker_lineage,
                )
            raise
        except Exception:
            self._places.abandon(prepared)
            raise
        send_ms = (time.perf_counter() - start_s) * 1000.0
        self._last_transport = "shared_memory" if shared is not None else "socket"
        if send_ms > 0:
            self._wire_bytes_per_s = prepared.header.payload_bytes / (send_ms / 1000.0)
        self._builder.stored(prepared, ack.full_required, lost)
        self._places.release(prepared)
        log.info(
            telemetry.POLICY_PUBLISHED,
            policy_version=prepared.policy_version,
            kind=prepared.kind,
            base_version=prepared.header.base_version or None,
            payload_bytes=prepared.header.payload_bytes,
            build_ms=round(prepared.build_ms, 2),
            send_ms=round(send_ms, 2),
            full_required=ack.full_required,
            transport=self._last_transport,
            reason=prepared.fallback,
        )
        self._places.close_if_left()  # left the same-host road during this send
        return ack, send_ms

    def _publish_through_outage(
        self, prepared: PreparedUpdate, timeout_s: float, shared: data_pb2.SharedSegment | None = None
    ) -> data_pb2.WeightAck:
        """One publish, sent again while the broker is unreachable or lost (within ``outage_s``)."""
        watch = OutageWatch(f"the broker to store policy v{prepared.policy_version}", self.outage_s, worker=self.sender)
        return retry_through_outage(
            lambda: self._publisher.publish(
                prepared.header,
                prepared.payload,
                timeout_s,
                ready=None if prepared.stream is None else prepared.stream.wait_for,
                shared=shared,
            ),
            watch,
            (WeightPublishTimeout,),
            stop_event=self._stop_event,
        )

    def close(self) -> None:
        self._publisher.close()
        self._places.close()

    def __enter__(self) -> PolicyPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
