"""The inference worker's client of the broker's weight plane: ``WeightSubscriber`` receives updates and
acknowledges each one. It owns one DEALER socket (``client.dealer.DealerClient``: bounded waits, reply checks, the
run token on every message) and must be used from one thread; every wait has a timeout.

Broker outages: the subscriber says HELLO every ``hello_interval_s``; the broker answers each with a WEIGHT_ACK, so a
subscriber given ``outage_s`` knows when it has heard nothing for ``liveness_s``: it logs ``waiting for the broker``
(``OutageWatch``) and raises ``BrokerOutageExceeded`` once the outage outlasts ``outage_s``. It must accept the
chunks the broker sends: ``limits`` are the broker's (``BrokerLimits.frames`` of its ``RegisterResponse``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from primerl.client.dealer import DealerClient
from primerl.client.outage import OutageWatch
from primerl.client.weight_transfer import BufferSink, ChunkRelay, InPlaceTransfer, PayloadSink
from primerl.proto import chunked_transfer, framing
from primerl.proto.data_plane_limits import DEFAULT_BROKER_LIMITS
from primerl.proto.digests import hasher_for
from primerl.proto.host_identity import host_id
from primerl.proto.shared_segment import MappedSegment, SegmentError, open_segment
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import CurveClient

log = get_logger(__name__)

__all__ = ["WeightPlaneError", "WeightSubscriber"]

BROKER_WORKER_ID = "broker"
"""``WeightAck.worker_id`` of the broker's own acks (``weight_plane.BROKER_SENDER``)."""
SEND_TIMEOUT_S = 5.0
"""How long a subscriber's HELLO or ACK may wait for the socket to take it."""
STALL_TIMEOUT_S = 30.0
"""How long a subscriber keeps an unfinished chunked update that gets no chunk (the broker's default too)."""


class WeightPlaneError(RuntimeError):
    """The broker answered with an ERROR that the client cannot recover from (e.g. UNAUTHENTICATED)."""

    def __init__(self, detail: common_pb2.ErrorDetail):
        super().__init__(f"{common_pb2.ErrorCode.Name(detail.code)}: {detail.message}")
        self.code = detail.code
        self.detail = detail


class WeightSubscriber(DealerClient):
    """The inference worker's side: ``hello()``, then ``receive()`` updates and ``ack()`` each one.

    ``receive`` returns whole updates (chunks reassembled, each chunk's envelope checksum checked by
    ``framing.decode``) and says HELLO again every ``hello_interval_s`` and when the broker no longer knows this
    worker (e.g. after a broker restart). It passes on every update it receives: whether one is newer than what the
    worker serves (its version and lineage) and whether its bytes match its digest is for the worker's one checker
    to say (``primerl.inference.policy_updates.PolicyUpdater``), which the caller asks before it acknowledges.
    ``ack`` reports the lineage with the version, so the broker knows which weights the worker holds.

    ``outage_s``: when set, ``receive`` raises ``BrokerOutageExceeded`` once the broker has answered nothing (no
    update, no answer to a HELLO) for ``liveness_s`` plus ``outage_s``, having logged ``waiting for the broker``
    every few seconds from ``liveness_s`` on; None: wait for the broker forever, saying nothing.

    ``payload_sink`` (``weight_transfer.PayloadSink``, e.g. the inference worker's ``PolicyUpdater``): where a
    chunked update is written as its chunks arrive (the worker's shared payload file), told of each chunk, so it can
    start loading the update before the last one; ``payload_buffer(num_bytes) -> memoryview``: the same, given only
    the buffer. The payload ``receive`` returns is then a view of that buffer, valid until the next ``receive``,
    and ``received_digest`` its digest, computed as the chunks arrived. One chunked transfer is received at a time
    (the broker sends a worker's updates one after the other): a new one replaces an unfinished one, and an
    unfinished one that gets no chunk for ``stall_timeout_s`` (the trainer or the broker stopped sending it midway),
    or is open longer than ``transfer_timeout_s``, is dropped; a dropped update is never returned, in part or whole.

    ``relay_host``: take part in relay chains (broker ``weight_fanout = "chain"``): a ``ChunkRelay`` bound on that
    host (an address the other workers reach) is announced in HELLO, chunks arrive from the broker or from the
    worker before this one, and each chunk whose message names a next worker is forwarded to it, unchanged, before
    it is written here. None (and with CURVE, which the relay sockets do not speak): the broker sends every chunk.
    """

    MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH  # a full broker refuses at the handshake: reopen after a pause
    plane = "weight"

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        worker_id: str,
        *,
        context: zmq.Context | None = None,
        limits: framing.Limits = DEFAULT_BROKER_LIMITS.frames,
        hello_interval_s: float = 5.0,
        transfer_timeout_s: float = 300.0,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        payload_buffer: Callable[[int], memoryview] | None = None,
        payload_sink: PayloadSink | None = None,
        outage_s: float | None = None,
        liveness_s: float | None = None,
        curve: CurveClient | None = None,
        relay_host: str | None = None,
        shared_memory: bool = True,
    ):
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        if outage_s is not None and outage_s <= 0:
            raise ValueError(f"outage_s must be > 0 (or None), got {outage_s}")
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        if payload_buffer is not None and payload_sink is not None:
            raise ValueError("give payload_buffer or payload_sink, not both")
        self.worker_id = worker_id
        self.hello_interval_s = hello_interval_s
        self.current_version: int | None = None
        self.current_lineage = 0
        # The latest version and lineage the broker said it holds (its answer to HELLO); None: no answer yet.
        self.broker_latest: tuple[int, int] | None = None
        # (version, lineage, version not above the one held) of the update ``receive`` returned last.
        self._last_update: tuple[int, int, bool] | None = None
        self.liveness_s = 3 * hello_interval_s if liveness_s is None else liveness_s
        self._watch = (
            None if outage_s is None else OutageWatch(f"weight updates for {worker_id}", outage_s, worker=worker_id)
        )
        self._last_heard_s = time.monotonic()
        self._assembler = chunked_transfer.ChunkAssembler(
            limits=limits, max_open_transfers=2, timeout_s=transfer_timeout_s
        )
        self.transfer_timeout_s = transfer_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._sink = BufferSink(payload_buffer) if payload_buffer is not None else payload_sink
        self._in_place: InPlaceTransfer | None = None
        self._received_digest: str | None = None
        self._hello_sent_s: float | None = None
        # The host whose shared memory this worker maps (announced in HELLO; "": every update comes as bytes).
        self.host_id = host_id() if shared_memory and curve is None else ""
        self.num_shared_updates = 0
        self._segment: MappedSegment | None = None  # the last update's segment, read in place until the next one
        super().__init__(endpoint, auth_token, worker_id, limits=limits, context=context, curve=curve)
        self.relay: ChunkRelay | None = None
        if relay_host and curve is not None:
            log.warning(
                "weight relay is off on an encrypted (CURVE) wire: the broker sends this worker every chunk",
                worker_id=worker_id,
            )
        elif relay_host:
            try:
                self.relay = ChunkRelay(
                    self._context,
                    relay_host,
                    worker_id,
                    max_message_bytes=limits.max_message_bytes,
                    run_token=self.auth_token,
                )
            except ValueError:
                super().close()
                raise

    def _on_monitor_events(self, events: Sequence[int], deadline_s: float) -> bool:
        """Refused at the handshake: reopen (``_reopen_after_refusal``) and say HELLO on the new socket."""
        if not events:
            return False
        self._reopen_after_refusal(deadline_s)
        if self._hello_sent_s is not None:
            self._send_hello()
        return True

    def _refused_at_handshake(self, detail: common_pb2.ErrorDetail) -> Exception:
        return WeightPlaneError(detail)

    @property
    def received_digest(self) -> str | None:
        """The digest of the payload ``receive`` returned last, computed (with the algorithm of its header's
        ``digest``) as its chunks were written to the payload sink; None when it was not assembled there."""
        return self._received_digest

    def hello(self, current_version: int | None = None, lineage: int = 0) -> None:
        """Tell the broker who this worker is and which version it holds (None: none), of which lineage (0:
        unknown; pass ``PolicyUpdater.lineage``, else a worker holding a rolled-back version is not told)."""
        self.current_version = current_version
        self.current_lineage = lineage if current_version is not None else 0
        self._last_heard_s = time.monotonic()
        self._send_hello()

    def _send_hello(self) -> None:
        hello = data_pb2.Hello(
            worker_id=self.worker_id,
            role=common_pb2.ROLE_INFERENCE,
            relay_endpoint=self.relay.endpoint if self.relay is not None else "",
            host_id=self.host_id,
        )
        if self.current_version is not None:
            hello.policy_version = self.current_version
            hello.lineage = self.current_lineage
        self._send_within(self._encode(data_pb2.HELLO, hello))
        self._hello_sent_s = time.monotonic()

    def receive(self, timeout_s: float) -> tuple[data_pb2.WeightUpdateHeader, memoryview] | None:
        """The next whole update as (header, payload view), or None when none arrives within ``timeout_s``.

        Raises ``WeightPlaneError`` when the broker refuses this worker (e.g. a wrong run token).
        """
        assert not self.is_closed, "subscriber is closed"
        deadline_s = time.monotonic() + timeout_s
        while True:
            now_s = time.monotonic()
            if self._hello_sent_s is not None and now_s - self._hello_sent_s >= self.hello_interval_s:
                self._send_hello()
            self._check_liveness(now_s)
            self._expire_in_place(now_s)
            remaining_s = deadline_s - now_s
            if remaining_s <= 0:
                return None
            wait_s = remaining_s if self._hello_sent_s is None else min(remaining_s, self.hello_interval_s)
            if self._in_place is not None:
                wait_s = min(wait_s, self._in_place.stall_timeout_s / 2)
            if self._watch is not None:
                wait_s = min(wait_s, max(0.05, self.liveness_s / 2))
            message = self._recv_relaying(time.monotonic() + wait_s)
            if message is None:
                continue
            update = self._handle(message)
            if update is not None:
                return update

    def _recv_relaying(self, deadline_s: float) -> framing.Message | None:
        """The next valid message from the broker or (relay on) from the worker before this one in a chain, or None
        by the deadline; a chunk for the next worker of a chain is forwarded to it first."""
        relay = self.relay
        if relay is None:
            return self._recv(deadline_s)
        assert self._socket is not None, "subscriber is closed"
        while True:
            source = self._wait_any([self._socket, relay.socket], deadline_s)
            if source is None:
                return None
            frames = source.recv_multipart(copy=False)
            message = self._decode(frames)
            if message is None:
                continue
            if source is relay.socket and (message.type != data_pb2.WEIGHT_UPDATE or not message.envelope.relay_hops):
                log.warning("ignored a message on the weight relay socket", type=message.type_name)
                continue
            relay.forward(message, frames)
            return message

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self._close_segment()
        super().close()

    def _check_liveness(self, now_s: float) -> None:
        """With ``outage_s``: nothing heard from the broker for ``liveness_s`` is an outage (logged, bounded)."""
        silent_s = now_s - self._last_heard_s
        if self._watch is not None and self._hello_sent_s is not None and silent_s > self.liveness_s:
            self._watch.failed(f"no answer from the broker at {self.endpoint} for {silent_s:.0f} s{self.timeout_hint}")

    def _heard(self) -> None:
        self._last_heard_s = time.monotonic()
        if self._watch is not None:
            self._watch.ok()

    def _handle(self, message: framing.Message) -> tuple[data_pb2.WeightUpdateHeader, memoryview] | None:
        self._heard()
        if message.type == data_pb2.WEIGHT_ACK and message.header.worker_id == BROKER_WORKER_ID:
            self.broker_latest = (message.header.policy_version, message.header.lineage)
            return None
        if message.type == data_pb2.ERROR:
            detail = message.header.error
            if detail.code == common_pb2.ERROR_CODE_UNKNOWN_WORKER:
                log.info("broker does not know this worker; saying hello again", worker_id=self.worker_id)
                self._send_hello()
                return None
            raise WeightPlaneError(detail)
        if message.type != data_pb2.WEIGHT_UPDATE:
            log.debug("ignored a message", type=message.type_name)
            return None
        if message.header.HasField("shared_segment"):
            return self._take_shared(message)
        if self._sink is not None and message.is_chunk:
            finished = self._add_in_place(message)
            if finished is None:
                return None
            whole, digest = finished
        else:
            self._replace_in_place()  # a whole update comes after an unfinished one: that one is abandoned
            whole = self._assemble(message)
            if whole is None:
                return None
            digest = None
        return self._received(whole.header, whole.payload[0], digest)

    def _received(
        self, header: data_pb2.WeightUpdateHeader, payload: memoryview, digest: str | None
    ) -> tuple[data_pb2.WeightUpdateHeader, memoryview]:
        """The update ``receive`` returns, noted for ``ack`` and ``received_digest``."""
        self._received_digest = digest
        self._last_update = (
            header.policy_version,
            header.lineage,
            self.current_version is not None and header.policy_version <= self.current_version,
        )
        return header, payload

    def _take_shared(self, message: framing.Message) -> tuple[data_pb2.WeightUpdateHeader, memoryview] | None:
        """An update handed over in shared memory (the same-host road): the trainer's segment is mapped read-only
        and given to the payload sink, which reads it in place (``PayloadSink.adopt_payload``); its digest is
        computed here, over the bytes the sink will read. The mapping is kept until the next update. A segment this
        worker cannot map is acknowledged as failed with ``ERROR_CODE_NOT_FOUND``: the broker sends this worker
        bytes from then on."""
        header = data_pb2.WeightUpdateHeader()
        header.CopyFrom(message.header)
        descriptor = data_pb2.SharedSegment()
        descriptor.CopyFrom(header.shared_segment)
        header.ClearField("shared_segment")
        num_bytes = header.payload_bytes
        if self._in_place is not None:
            self._in_place.drop()
            self._in_place = None
        self._close_segment()
        try:
            if num_bytes > self.limits.max_transfer_bytes:
                raise SegmentError(f"a {num_bytes}-byte update exceeds {self.limits.max_transfer_bytes} bytes")
            mapped = open_segment(descriptor, num_bytes)
        except (SegmentError, OSError, ValueError) as exc:
            log.warning("cannot map a shared weight segment; asking the broker for bytes", error=str(exc))
            self.ack(
                header.policy_version,
                applied=False,
                error=common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_NOT_FOUND, message=str(exc)),
            )
            return None
        self._segment = mapped
        payload = (
            mapped.payload if self._sink is None else self._sink.adopt_payload(header, mapped.path, mapped.payload)
        )
        hasher = hasher_for(header.digest)
        hasher.update(payload)
        self.num_shared_updates += 1
        return self._received(header, payload, hasher.hexdigest())

    def _replace_in_place(self) -> None:
        """A new update replaces the unfinished chunked one (if any): that one is dropped."""
        transfer, self._in_place = self._in_place, None
        if transfer is not None:
            log.warning(
                "an unfinished weight transfer was replaced by a new one",
                transfer_id=transfer.key[1],
                received_bytes=transfer.num_bytes,
                total_bytes=transfer.buffer.nbytes,
            )
            transfer.drop()

    def _close_segment(self) -> None:
        """Drop the mapping of the last update's segment (it was applied, refused or replaced by now)."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _expire_in_place(self, now_s: float) -> None:
        transfer = self._in_place
        reason = None if transfer is None else transfer.expired(now_s)
        if transfer is not None and reason is not None:
            log.warning(
                "dropped an incomplete weight transfer",
                transfer_id=transfer.key[1],
                reason=reason,
                received_bytes=transfer.num_bytes,
                total_bytes=transfer.buffer.nbytes,
            )
            self._in_place = None
            transfer.drop()

    def _add_in_place(self, message: framing.Message) -> tuple[framing.Message, str | None] | None:
        """A chunk of an update assembled in the payload sink: the whole message and its payload's digest, or None
        (incomplete or dropped)."""
        assert self._sink is not None
        chunk = message.envelope.chunk
        self._expire_in_place(time.monotonic())
        transfer = self._in_place
        try:
            if chunk.index == 0:
                # A new transfer (or one resent under its id) replaces an unfinished one: the broker sends one at
                # a time.
                self._replace_in_place()
                if chunk.total_bytes > self.limits.max_transfer_bytes:
                    raise framing.OversizedFrame(
                        f"transfer of {chunk.total_bytes} bytes exceeds {self.limits.max_transfer_bytes}"
                    )
                transfer = self._in_place = InPlaceTransfer(
                    message, self._sink, self.transfer_timeout_s, self.stall_timeout_s
                )
            elif transfer is None or transfer.key != (message.envelope.sender, chunk.transfer_id):
                log.warning("dropped a chunk of an abandoned transfer", transfer_id=chunk.transfer_id)
                return None
            whole = transfer.add(message)  # drops the transfer itself when the chunk breaks it
        except framing.FramingError as exc:
            self._in_place = None
            log.warning("dropped a weight transfer", error=str(exc))
            return None
        if whole is None:
            return None
        self._in_place = None
        return whole, transfer.digest

    def _assemble(self, message: framing.Message) -> framing.Message | None:
        try:
            whole = self._assembler.add(message)
        except framing.BadChunk:
            if message.envelope.chunk.index != 0:
                log.warning("dropped a chunk of an abandoned transfer", transfer_id=message.envelope.chunk.transfer_id)
                return None
            # A resent transfer reuses its id: the stale partial one is gone now, start again.
            whole = self._assembler.add(message)
        except framing.FramingError as exc:
            log.warning("dropped a weight transfer", error=str(exc))
            return None
        return whole

    def ack(
        self,
        version: int,
        applied: bool = True,
        error: common_pb2.ErrorDetail | None = None,
        apply_ms: int = 0,
        lineage: int | None = None,
    ) -> None:
        """Report an update as applied (the worker now serves ``version``) or failed (``applied=False``).

        ``lineage``: of the version served (pass ``PolicyUpdater.lineage``); None: the lineage of the update
        ``receive`` returned last when ``version`` is its version and it was above the version held, else the
        lineage held before (so a caller that acknowledges a re-published version without loading it, the way it
        acknowledges a resend, never claims the new lineage: the broker sees the worker kept its weights).
        After a failure the worker's state counts as unknown: the broker resends the full snapshot and the
        deltas after it, and this subscriber passes them all on (it skips nothing until the next applied ack).
        """
        if lineage is None:
            last = self._last_update
            lineage = last[1] if last is not None and last[0] == version and not last[2] else self.current_lineage
        ack = data_pb2.WeightAck(
            policy_version=version,
            worker_id=self.worker_id,
            applied=applied,
            apply_ms=apply_ms,
            lineage=lineage if applied else 0,
        )
        if error is not None:
            ack.error.CopyFrom(error)
        self.current_version = version if applied else None
        self.current_lineage = lineage if applied else 0
        self._send_within(self._encode(data_pb2.WEIGHT_ACK, ack))

    def _send_within(self, frames: list[Any], timeout_s: float = SEND_TIMEOUT_S) -> None:
        assert not self.is_closed, "subscriber is closed"
        if not self._send(frames, time.monotonic() + timeout_s):
            raise TimeoutError(
                f"could not send to the broker at {self.endpoint} within {timeout_s} s{self.timeout_hint}"
            )
