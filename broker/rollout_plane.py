"""The rollout plane: the ZeroMQ ROUTER socket of the rollout stream, owned by one IO thread.

Orchestrators (DEALER) send ROLLOUT_BATCH and get a ROLLOUT_ACK once the batch is spooled (or a refusal: BACKPRESSURE
with ``retry_after_ms``, or an error). Trainer ranks (DEALER) send HELLO, then ROLLOUT_REQUEST with credits, and get
ROLLOUT_BATCH messages and ROLLOUT_STEP_DONE. All decisions are the ``RolloutQueue``'s; this module only decodes, calls
it, and sends what it says.

Every received message goes through ``framing.decode`` with the configured limits and run token. A message that fails
gets an ERROR reply to its sender; if even that cannot be sent it is dropped with a log line. Error replies to messages
that did not decode never carry the run token (the sender may not know it). Libzmq itself drops the connection of a peer
that sends a frame above ``limits.max_message_bytes`` (socket option MAXMSGSIZE), before buffering it.

Memory: batches live in the spool, not here. What the socket may hold is bounded by ``rcv_hwm`` messages per peer
inbound and ``hwm`` outbound (each at most ``limits.max_message_bytes``); a consumer gets at most ``max_credits``
batches per request, and a send to a peer whose queue is full is not retried blindly: the batch is handed out again on
that consumer's next request.

Group commit: every message already waiting on the socket is drained (at most ``max_group_batches`` batches, never more
than ``hwm // 2`` since the group's acks leave in one burst, and ``max_group_bytes`` payload bytes per group); the
batches among them are decided and spooled together (``RolloutQueue.offer_many``: one directory fsync per group) and
only then acked, in arrival order. A request or HELLO ends the group before it is handled, so messages are still handled
in the order they came. An ack never precedes durability. A batch handed to a trainer is sent as spooled: its header
bytes and verified CRC are reused (``framing.encode_raw``) and its payload comes from the spool's read cache while
there, so a delivery costs neither a CRC pass nor a disk read.

Only the IO thread touches the socket. ``release_through`` and ``status`` are safe from any thread: they go to the queue
(its own lock) and to the throughput meters (their own lock). A commit frees space but needs no send: producers that
were told to wait resend on their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.plane_lifecycle import RouterPlane
from primerl.broker.rollout_queue import RolloutQueue
from primerl.broker.rollout_replies import (
    REFUSAL_SUMMARY_INTERVAL_S,
    STALE_NOTE,
    SUPERSEDED_NOTE,
    PeerSender,
    RefusalLog,
    error_detail,
    try_message_id,
)
from primerl.broker.rollout_results import (
    Accepted,
    Backpressure,
    Delivery,
    Duplicate,
    OfferItem,
    OfferResult,
    Refused,
    RolloutStreamStatus,
    Stale,
    Superseded,
)
from primerl.broker.spool import BatchGone, SpoolCorruption, SpoolError
from primerl.proto import framing
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.meters import RateMeter
from primerl.runtime.wire_security import CurveServer

log = get_logger("primerl.broker.rollout_plane")

ACCEPTED_TYPES = frozenset({data_pb2.ROLLOUT_BATCH, data_pb2.ROLLOUT_REQUEST, data_pb2.HELLO})
MAX_MESSAGES_PER_POLL = 256
DEFAULT_MAX_GROUP_BATCHES = 64
ACK_SEND_WAIT_S = 0.5  # bounded wait for room in a peer's pipe for an ack (see PeerSender.send)
DEFAULT_MAX_GROUP_BYTES = 256 * MiB

# on_error(code, message, peer): called in the IO thread for every refusal other than backpressure,
# and once if the IO thread dies. Keep it cheap; it must not block.
ErrorCallback = Callable[[int, str, str], None]


class RolloutPlane(RouterPlane):
    name = "rollout plane"
    thread_name = "rollout-plane-io"
    gate_domain = "primerl-rollout"
    connection_kind = "rollout connection"

    def __init__(
        self,
        queue: RolloutQueue,
        context: zmq.Context,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
        auth_token: str | None = None,
        on_error: ErrorCallback | None = None,
        *,
        max_credits: int = 8,
        hwm: int = 16,
        rcv_hwm: int | None = None,
        poll_interval_s: float = 0.05,
        throughput_window_s: float = 10.0,
        sender: str = "broker",
        max_group_batches: int = DEFAULT_MAX_GROUP_BATCHES,
        max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES,
        max_connections: int | None = None,
        curve: CurveServer | None = None,
    ):
        if max_credits < 1:
            raise ValueError(f"max_credits must be >= 1, got {max_credits}")
        if max_group_batches < 1 or max_group_bytes < 1:
            raise ValueError(
                f"max_group_batches ({max_group_batches}) and max_group_bytes ({max_group_bytes}) must be >= 1"
            )
        # The acks of a group leave in one burst into a pipe of ``hwm`` messages: keep a group under it.
        self.max_group_batches = min(max_group_batches, max(1, hwm // 2))
        self.max_group_bytes = max_group_bytes
        # Batches received but not yet spooled and acked: (routing id, message), arrival order.
        self._group: list[tuple[bytes, framing.Message]] = []
        self._group_bytes = 0
        # Peers admitted at the handshake (``ConnectionGate``); None: no limit. With it, what the socket may
        # buffer is bounded whatever the number of peers that try: max_connections x (rcv_hwm + 1) messages.
        super().__init__(context, host, port, max_connections, curve)
        self.queue = queue
        self.limits = limits
        self.auth_token = auth_token or None
        self.on_error = on_error
        self.max_credits = max_credits
        self.hwm = hwm
        # Receive side: messages one peer may have waiting in the broker before it is read (each at most
        # limits.max_message_bytes); the send side keeps ``hwm`` (acks leave in bursts).
        self.rcv_hwm = hwm if rcv_hwm is None else rcv_hwm
        if self.rcv_hwm < 1:
            raise ValueError(f"rcv_hwm must be >= 1, got {self.rcv_hwm}")
        self.poll_interval_s = poll_interval_s
        self.sender = sender
        self._in = RateMeter(throughput_window_s)
        self._out = RateMeter(throughput_window_s)
        self._counter_lock = threading.Lock()  # the refusal counters (read by ``status`` from any thread)
        self._num_refused = 0
        self._num_backpressure_replies = 0
        self._refusals = RefusalLog()
        self._guard_log = RateLimitedLog(log, interval_s=REFUSAL_SUMMARY_INTERVAL_S)
        self._backpressure_since_s: float | None = None
        self._replies = PeerSender(on_disconnected=self.queue.close_session, peer_name=self._peer)
        self._peer_names: dict[bytes, str] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 10.0) -> int:
        """Bind the socket (in the IO thread) and start serving; returns the port."""
        port = super().start(timeout_s)
        log.info("rollout plane listening", host=self.host, port=port, auth=self.auth_token is not None)
        return port

    # ------------------------------------------------------------------ any thread

    def release_through(self, step: int) -> int:
        """The trainer committed ``step``: delete its batches and all earlier ones. Returns how many."""
        return self.queue.release_through(step)

    def status(self) -> RolloutStreamStatus:
        now_s = time.monotonic()
        batches_in, bytes_in = self._in.rates(now_s)
        batches_out, bytes_out = self._out.rates(now_s)
        with self._counter_lock:
            num_refused, num_backpressure = self._num_refused, self._num_backpressure_replies
        num_connections, num_connections_refused = self.connection_counts()
        return RolloutStreamStatus(
            queue=self.queue.status(),
            port=self.port,
            running=self.running,
            batches_in_per_s=batches_in,
            bytes_in_per_s=bytes_in,
            batches_out_per_s=batches_out,
            bytes_out_per_s=bytes_out,
            num_refused=num_refused,
            num_backpressure_replies=num_backpressure,
            throughput_window_s=self._in.window_s,
            num_connections=num_connections,
            num_connections_refused=num_connections_refused,
        )

    # ------------------------------------------------------------------ IO thread

    def _serve(self, socket: zmq.Socket) -> None:
        poller, gate_sockets = self._gate_poller(socket)
        poll_ms = max(1, int(self.poll_interval_s * 1000))
        try:
            while not self._stop_event.is_set():
                ready = dict(poller.poll(poll_ms))
                if not ready:
                    continue
                self._serve_gate(ready, gate_sockets)
                if socket not in ready:
                    continue
                for _ in range(MAX_MESSAGES_PER_POLL):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle_guarded(socket, frames)
                    del frames  # a message's buffers go as soon as it is handled, not when the next one comes
                # Nothing more waiting: make the group durable and ack it.
                self._commit_group(socket)
        except Exception as exc:
            # A bug or a broken context: the plane is useless now. Log once with the traceback and report.
            log.exception("rollout plane IO thread failed; the rollout stream is down")
            self._report(common_pb2.ERROR_CODE_INTERNAL, f"rollout plane IO thread failed: {exc!r}", "")

    def _bind(self) -> zmq.Socket:
        """The bound socket, gated at the handshake (``_bind_gated``); rcv_hwm is set before the bind, or peers never
        get it."""
        return self._bind_gated(max_message_bytes=self.limits.max_message_bytes, hwm=self.hwm, rcv_hwm=self.rcv_hwm)

    def _unexpected(self, socket: zmq.Socket, frames: list[zmq.Frame], exc: Exception) -> None:
        routing_id = frames[0].bytes if frames else b""
        self._guard_log.exception(
            ("unexpected", type(exc).__name__),
            "rollout plane failed handling one message; serving on",
            peer=self._peer(routing_id),
            error=repr(exc)[:300],
        )
        with self._counter_lock:
            self._num_refused += 1
        try:
            body = frames[1:]
            self._replies.send(
                socket,
                routing_id,
                framing.encode_error(
                    error_detail(
                        common_pb2.ERROR_CODE_INTERNAL, f"broker failed handling this message: {type(exc).__name__}"
                    ),
                    refused_type=framing.peek_type(body),
                    in_reply_to=try_message_id(body, self.limits),
                    sender=self.sender,
                ),
            )
        except zmq.ZMQError as send_exc:
            if send_exc.errno == zmq.ETERM:
                raise

    def _handle(self, socket: zmq.Socket, frames: list[zmq.Frame]) -> None:
        routing_id = frames[0].bytes
        body = frames[1:]
        try:
            message = framing.decode(body, limits=self.limits, auth_token=self.auth_token)
            if message.type not in ACCEPTED_TYPES:
                raise framing.UnknownMessageType(
                    f"{message.type_name} is not accepted on the rollout socket; "
                    "it takes ROLLOUT_BATCH, ROLLOUT_REQUEST and HELLO"
                )
            if message.is_chunk:
                raise framing.BadChunk(
                    "rollout batches travel in one message each; chunked ROLLOUT_BATCH is not supported "
                    f"(keep a micro-batch under {self.limits.max_message_bytes} bytes)"
                )
        except framing.FramingError as exc:
            self._refuse(
                socket,
                routing_id,
                exc.detail(),
                refused_type=framing.peek_type(body),
                in_reply_to=try_message_id(body, self.limits),
            )
            return
        if message.type == data_pb2.ROLLOUT_BATCH:
            self._group.append((routing_id, message))
            self._group_bytes += message.payload[0].nbytes
            if len(self._group) >= self.max_group_batches or self._group_bytes >= self.max_group_bytes:
                self._commit_group(socket)
            return
        self._commit_group(socket)  # handle messages in the order they came
        try:
            if message.type == data_pb2.ROLLOUT_REQUEST:
                self._on_request(socket, routing_id, message)
            else:
                self._on_hello(socket, routing_id, message)
        except Exception as exc:  # a valid message that we failed to handle: tell the sender, keep serving
            log.exception(
                "rollout plane failed handling a message", peer=self._peer(routing_id), type=message.type_name
            )
            self._refuse_internal(socket, [(routing_id, message)], f"broker failed: {exc!r}")

    # ------------------------------------------------------------------ handlers

    def _commit_group(self, socket: zmq.Socket) -> None:
        """Spool the batches received so far together (group commit), then ack each, then deliver."""
        if not self._group:
            return
        group, self._group, self._group_bytes = self._group, [], 0
        # The spool keeps a CRC-32: reused when the batch arrived with one, else (another checksum kind) computed.
        items = [
            OfferItem(
                m.header,
                m.payload[0],
                m.envelope.header,
                m.envelope.checksum if m.envelope.checksum_kind == framing.CRC32 else None,
            )
            for _, m in group
        ]
        try:
            outcome = self.queue.offer_many(items)
        except SpoolError as exc:
            log.error("rollout plane cannot spool a group of batches", num_batches=len(group), error=str(exc))
            self._refuse_internal(socket, group, f"broker spool failed: {exc}")
            return
        except Exception as exc:  # a bug handling valid batches: tell the senders, keep serving
            log.exception("rollout plane failed handling a group of batches", num_batches=len(group))
            self._refuse_internal(socket, group, f"broker failed: {exc!r}")
            return
        for (routing_id, message), result in zip(group, outcome.results):
            self._ack_batch(socket, routing_id, message, result)
        for delivery in outcome.deliveries:
            self._deliver(socket, delivery)

    def _ack_batch(self, socket: zmq.Socket, routing_id: bytes, message: framing.Message, result: OfferResult) -> None:
        header = message.header
        payload = message.payload[0]
        ack = data_pb2.RolloutAck(batch_id=result.batch_id or header.batch_id, step=header.step)
        if isinstance(result, (Accepted, Duplicate, Stale, Superseded)):
            ack.durable = True
            if isinstance(result, Accepted):
                self._in.add(payload.nbytes)
                if self._backpressure_since_s is not None:
                    log.info(
                        "rollout queue accepts batches again",
                        waited_s=round(time.monotonic() - self._backpressure_since_s, 3),
                    )
                    self._backpressure_since_s = None
            elif isinstance(result, Stale):
                self._refusals.note(
                    self._peer(routing_id),
                    STALE_NOTE,
                    f"batch of step {result.step} arrived after step {result.committed_step} was committed; "
                    "acked, not kept",
                )
            elif isinstance(result, Superseded):
                self._refusals.note(
                    self._peer(routing_id),
                    SUPERSEDED_NOTE,
                    f"batch of step {result.step} from another producer incarnation than the one the step is held "
                    f"whole from ({result.owner}); acked, not kept",
                )
        elif isinstance(result, Backpressure):
            ack.error.CopyFrom(error_detail(common_pb2.ERROR_CODE_BACKPRESSURE, result.reason, result.retry_after_ms))
            with self._counter_lock:
                self._num_backpressure_replies += 1
            if self._backpressure_since_s is None:
                self._backpressure_since_s = time.monotonic()
                log.info("rollout queue full: producers are told to wait", reason=result.reason)
        else:
            assert isinstance(result, Refused)
            ack.error.CopyFrom(error_detail(result.code, result.message))
            self._note_refusal(routing_id, result.code, result.message)
        self._reply(socket, routing_id, data_pb2.ROLLOUT_ACK, ack, message.envelope.message_id, wait_s=ACK_SEND_WAIT_S)

    def _on_request(self, socket: zmq.Socket, routing_id: bytes, message: framing.Message) -> None:
        request = message.header
        credits = min(request.credits, self.max_credits)
        result = self.queue.request(routing_id, request.step, request.rank, credits)
        if isinstance(result, Refused):
            self._refuse(
                socket,
                routing_id,
                error_detail(result.code, result.message),
                refused_type=message.type,
                in_reply_to=message.envelope.message_id,
                authenticated=True,
            )
            return
        self._deliver(socket, result)

    def _on_hello(self, socket: zmq.Socket, routing_id: bytes, message: framing.Message) -> None:
        hello = message.header
        self._peer_names[routing_id] = hello.worker_id or routing_id.hex()
        if len(self._peer_names) > 4 * self.queue.max_sessions:
            self._peer_names = {routing_id: self._peer_names[routing_id]}
        self._replies.reachable_again(routing_id)
        self.queue.open_session(routing_id, hello.worker_id)
        log.info(
            "rollout peer said hello",
            worker_id=hello.worker_id[:128],
            role=framing.role_name(hello.role),
            rank=hello.rank,
        )
        reply = data_pb2.Hello(worker_id=self.sender, role=common_pb2.ROLE_BROKER)
        self._reply(socket, routing_id, data_pb2.HELLO, reply, message.envelope.message_id)

    def _deliver(self, socket: zmq.Socket, delivery: Delivery) -> None:
        routing_id = delivery.session_id
        pending = list(delivery.batch_ids)
        while pending:
            batch_id = pending.pop(0)
            try:
                header_bytes, payload, crc32 = self.queue.read_record(batch_id)
            except BatchGone:
                continue  # released by a commit meanwhile: nobody needs it any more
            except SpoolCorruption as exc:
                # The trainer would wait for this batch forever: tell it, and whoever watches the broker.
                self._refuse(
                    socket,
                    routing_id,
                    error_detail(
                        common_pb2.ERROR_CODE_INTERNAL,
                        f"spooled batch {batch_id!r} is damaged on the broker's disk and was quarantined: {exc}",
                    ),
                    refused_type=data_pb2.ROLLOUT_REQUEST,
                    in_reply_to="",
                    authenticated=True,
                )
                continue
            # As spooled: the header bytes and CRC the batch arrived with, verified then (no CRC pass here).
            frames = framing.encode_raw(
                data_pb2.ROLLOUT_BATCH,
                header_bytes,
                [payload],
                checksum=crc32,
                auth_token=self.auth_token or "",
                sender=self.sender,
            )
            if not self._replies.send(socket, routing_id, frames):
                for unsent in [batch_id, *pending]:
                    self.queue.forget_delivery(routing_id, unsent)
                return
            self._out.add(payload.nbytes)
        if delivery.step_done is not None:
            done = delivery.step_done
            reply = data_pb2.RolloutStepDone(step=done.step, rank=done.rank, num_micro_batches=done.num_micro_batches)
            self._reply(socket, routing_id, data_pb2.ROLLOUT_STEP_DONE, reply)

    # ------------------------------------------------------------------ replies

    def _reply(
        self, socket: zmq.Socket, routing_id: bytes, kind: int, reply: Any, in_reply_to: str = "", wait_s: float = 0.0
    ) -> None:
        """Send ``reply`` (a message of type ``kind``) with the run token: its peer proved it knows it."""
        token = self.auth_token or ""
        frames = framing.encode(kind, reply, auth_token=token, sender=self.sender, in_reply_to=in_reply_to)
        self._replies.send(socket, routing_id, frames, wait_s=wait_s)

    def _refuse(
        self,
        socket: zmq.Socket,
        routing_id: bytes,
        detail: common_pb2.ErrorDetail,
        *,
        refused_type: int,
        in_reply_to: str,
        authenticated: bool = False,
    ) -> None:
        self._note_refusal(routing_id, detail.code, detail.message)
        # The token goes only to a peer that proved it knows it.
        frames = framing.encode_error(
            detail,
            refused_type=refused_type,
            in_reply_to=in_reply_to,
            sender=self.sender,
            auth_token=(self.auth_token or "") if authenticated else "",
        )
        self._replies.send(socket, routing_id, frames)

    def _refuse_internal(self, socket: zmq.Socket, refused: list[tuple[bytes, framing.Message]], reason: str) -> None:
        """Refuse each (routing id, message) of ``refused``, valid messages the broker failed to handle, as INTERNAL
        with ``reason``."""
        detail = error_detail(common_pb2.ERROR_CODE_INTERNAL, reason)
        for routing_id, message in refused:
            self._refuse(
                socket,
                routing_id,
                detail,
                refused_type=message.type,
                in_reply_to=message.envelope.message_id,
                authenticated=True,
            )

    def _note_refusal(self, routing_id: bytes, code: int, message: str) -> None:
        with self._counter_lock:
            self._num_refused += 1
        peer = self._peer(routing_id)
        self._refusals.note(peer, code, message)
        self._report(code, message, peer)

    def _report(self, code: int, message: str, peer: str) -> None:
        if self.on_error is None:
            return
        try:
            self.on_error(code, message, peer)
        except Exception:
            log.exception("rollout plane on_error callback failed")

    def _peer(self, routing_id: bytes) -> str:
        return self._peer_names.get(routing_id) or routing_id.hex()
