"""The broker's weight plane: one ZMQ ROUTER socket, owned by one IO thread.

Peers (all DEALER sockets, see ``primerl.client.weights``):

- the trainer sends WEIGHT_UPDATE transfers (chunked); ``WeightIntake`` (``weight_intake``, no sockets)
  keeps their chunks as they arrived (no reassembly) and hashes them, hands whole ones to the fan-out core and says
  which WEIGHT_ACK to answer.
- inference workers send HELLO (role INFERENCE, optionally the version they hold), then WEIGHT_ACK for
  each update they applied; ``WeightSubscribers`` (``weight_subscribers``) maps ROUTER identities to worker ids
  and feeds those to ``WeightFanout`` (``weight_fanout``, no sockets), which says what to push next.

Fan-out never lets one worker hold up the others: every send is ``NOBLOCK`` with ``ROUTER_MANDATORY``; a
full pipe (high-water mark) leaves the message in that worker's outbox for the next round; a gone peer
(``EHOSTUNREACH``) leaves the fan-out with one log line. Forwarding is cut-through and zero-copy: a chunk goes
out to the workers for whom the update is the next step as soon as it arrived and passed its checksum, as the
very frame received, with the header bytes and checksum it came with (no pass over the payload); the update's
last chunk goes out only once the whole update is stored (digest checked), so no worker ever holds an update
the broker refused. Every worker gets the same encoded messages (one transfer id per update).

Relay (``WeightFanout(fanout="chain")``): the chunks of an update a chain receives go to its head only, with the
chain in their envelope (``weight_messages.relayed_messages``), so the broker sends each byte once per chain.
``bytes_out_total`` (``primerl_broker_weight_bytes_pushed_total``) counts the payload bytes the broker itself sent.

Lineage (a rollback, ``weight_store``): every worker is planned again when a newer lineage replaces the store's chain.
Each HELLO is answered with a WEIGHT_ACK from ``broker`` carrying the latest version and lineage
(``WeightFanout.latest``): the subscriber's sign that the broker is there.

Same host (``broker.shared_updates``): a worker on the trainer's host (``Hello.host_id``) is sent the descriptor of
the trainer's shared-memory segment, one small message, and reads the segment itself (``bytes_out_total`` does not
grow); the others get the bytes. ``SharedSegments`` (``weight_segments``) says when a segment goes back.

Durability: with ``durable_dir`` the store's chain is kept on disk there (``weight_durable``), reloaded by
``start()`` before the socket binds; the tick frees the frames of updates written there
(``WeightStore.release_written``).

Every input goes through ``framing.decode`` with the limits and the run token: a malformed, oversized or
unauthenticated message gets an ERROR reply and is logged; the plane keeps serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.plane_lifecycle import RouterPlane
from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_durable import WeightDurability
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_intake import IntakeBounds, IntakeReply, WeightIntake
from primerl.broker.weight_members import WeightWorkerStatus
from primerl.broker.weight_messages import chunk_messages, relayed_messages
from primerl.broker.weight_replies import PeerGone, WeightReplies, try_send
from primerl.broker.weight_segments import SharedSegments
from primerl.broker.weight_store import WeightStoreStatus
from primerl.broker.weight_subscribers import IsRegistered, OnApplied, WeightSubscribers
from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.meters import RateMeter
from primerl.runtime.wire_security import CurveServer
from primerl.runtime.zmq_sockets import DEFAULT_HWM

log = get_logger(__name__)


FORWARD_AFTER_BYTES = 1 << 20
"""A received message at least this large ends a receive round, so its chunk is forwarded before the next is read."""


@dataclass(frozen=True)
class WeightPlaneStatus:
    store: WeightStoreStatus
    workers: tuple[WeightWorkerStatus, ...]
    bytes_in_per_s: float
    bytes_out_per_s: float
    bytes_in_total: int
    bytes_out_total: int
    num_errors_sent: int
    num_workers_forgotten: int
    # The latest update forwarded: its version, and the seconds from its last byte into the broker (stored) to its
    # last byte out to the last of the workers that were receiving it or had it next (what the broker adds).
    forward_lag_version: int = 0
    forward_lag_s: float = 0.0
    # Peers admitted at the handshake and connected now, and connections refused there (``max_connections``);
    # None and 0 when the plane admits every peer.
    num_connections: int | None = None
    num_connections_refused: int = 0
    # Weight transfers being received now (chunked updates whose last chunk has not come).
    num_open_transfers: int = 0
    # Relay fan-out: chains formed, and workers sent an update again because their relay did not reach them in time.
    num_relay_chains: int = 0
    num_relay_heals: int = 0
    # Same host: updates sent as shared-memory descriptors (no payload bytes), and trainer segments released.
    num_descriptors_sent: int = 0
    num_segments_released: int = 0


class WeightPlane(RouterPlane):
    """Weight fan-out over one ROUTER socket. ``start()`` binds and runs the IO thread; ``stop()`` ends it
    (``RouterPlane``).

    ``on_applied(worker_id, policy_version)``: see ``WeightSubscribers``.
    """

    name = "weight plane"
    thread_name = "weight-plane-io"
    gate_domain = "primerl-weight"
    connection_kind = "weight connection"

    def __init__(
        self,
        fanout: WeightFanout,
        context: zmq.Context,
        host: str,
        port: int,
        limits: framing.Limits,
        auth_token: str | None,
        chunk_bytes: int,
        on_applied: OnApplied | None = None,
        *,
        intake_bounds: IntakeBounds = IntakeBounds(),
        hwm: int = DEFAULT_HWM,
        max_pending_replies: int = 4096,
        poll_interval_s: float = 0.05,
        durable_dir: str | Path | None = None,
        max_connections: int | None = None,
        curve: CurveServer | None = None,
        is_registered: IsRegistered | None = None,
    ):
        """``fanout``: the fan-out core over the plane's ``WeightStore`` (``fanout.store``); ``intake_bounds``: the
        limits on the trainer's transfers in flight; ``durable_dir``: where the store's chain is kept on disk;
        ``max_connections``: peers admitted at the ZeroMQ handshake (``ConnectionGate``; None: every peer);
        ``curve``: CURVE on the socket (None: plain, or the run token's PLAIN); ``is_registered``: see
        ``WeightSubscribers``."""
        if chunk_bytes <= 0 or chunk_bytes > limits.max_frame_bytes:
            raise ValueError(
                f"chunk_bytes must be in 1..limits.max_frame_bytes ({limits.max_frame_bytes}), got {chunk_bytes}"
            )
        super().__init__(context, host, port, max_connections, curve)
        self.store = fanout.store
        self.fanout = fanout
        self.limits = limits
        self.auth_token = auth_token or None
        self._replies = WeightReplies(self.auth_token, max_pending_replies)
        self._forward_envelope = self._replies.envelope("")  # of every chunk message the plane sends
        self.chunk_bytes = chunk_bytes
        self.hwm = hwm
        self.poll_interval_s = poll_interval_s
        self._intake = WeightIntake(self.fanout, limits, intake_bounds, forward_chunk_bytes=chunk_bytes)
        self._segments = SharedSegments(fanout)
        self._subscribers = WeightSubscribers(fanout, self._replies, self._segments, on_applied, is_registered)
        self._guard_log = RateLimitedLog(log)
        self._rate_in = RateMeter()
        self._rate_out = RateMeter()
        self._lock = threading.Lock()  # guards the forward lag (read by other threads)
        self._forward_lag: tuple[int, float] = (0, 0.0)
        self.durable_dir = None if durable_dir is None else Path(durable_dir)

    def start(self, timeout_s: float = 10.0) -> int:
        """Bind and start the IO thread; returns the bound port (also ``self.port``)."""
        if self._thread is None and self.durable_dir is not None:
            self.store.attach_durable(WeightDurability(self.durable_dir))
            self.fanout.store_reloaded()
        return super().start(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the IO thread to end and wait up to ``timeout_s``; True once it has ended and the store closed."""
        return super().stop(timeout_s) and self.store.close(timeout_s)

    def worker_versions(self) -> dict[str, int | None]:
        """worker_id -> the policy version it last acknowledged (None: none yet), for every subscribed worker."""
        return self.fanout.worker_versions()

    def status(self) -> WeightPlaneStatus:
        with self._lock:
            lag_version, lag_s = self._forward_lag
        num_connections, num_connections_refused = self.connection_counts()
        counts = self.fanout.counts()
        return WeightPlaneStatus(
            store=self.store.status(),
            workers=self.fanout.workers(),
            bytes_in_per_s=self._rate_in.bytes_per_s(),
            bytes_out_per_s=self._rate_out.bytes_per_s(),
            bytes_in_total=self._rate_in.total_bytes,
            bytes_out_total=self._rate_out.total_bytes,
            num_errors_sent=self._replies.num_errors_sent,
            num_workers_forgotten=counts.num_forgotten,
            forward_lag_version=lag_version,
            forward_lag_s=lag_s,
            num_connections=num_connections,
            num_connections_refused=num_connections_refused,
            num_open_transfers=self._intake.num_open_transfers,
            num_relay_chains=counts.num_relay_chains,
            num_relay_heals=counts.num_relay_heals,
            num_descriptors_sent=self._segments.num_descriptors_sent,
            num_segments_released=self._segments.num_released,
        )

    def _bind(self) -> zmq.Socket:
        """The bound socket, gated at the handshake (``_bind_gated``)."""
        socket = self._bind_gated(max_message_bytes=self.limits.max_frame_bytes, hwm=self.hwm)
        log.info("weight plane listening", host=self.host, port=self.port)
        return socket

    def _serve(self, socket: zmq.Socket) -> None:
        poller, gate_sockets = self._gate_poller(socket)
        next_tick_s = 0.0
        try:
            while not self._stop_event.is_set():
                sent_any, blocked = self._flush(socket)
                if self._intake.num_unverified:  # after their descriptors went out (the flush above)
                    self._verify_shared()
                    sent_any = True
                if sent_any:
                    timeout_ms = 0
                elif blocked:
                    timeout_ms = 2
                else:
                    timeout_ms = int(self.poll_interval_s * 1000)
                ready = dict(poller.poll(timeout_ms))
                self._serve_gate(ready, gate_sockets)
                if socket in ready:
                    self._receive_some(socket)
                now_s = time.monotonic()
                if now_s >= next_tick_s:
                    self._tick(now_s)
                    next_tick_s = now_s + min(0.1, self.fanout.ack_timeout_s / 4)
        except Exception:
            log.exception("weight plane IO thread failed")
            raise
        finally:
            log.info("weight plane stopped")

    def _receive_some(self, socket: zmq.Socket, max_messages: int = 64) -> None:
        """Handle up to ``max_messages`` waiting messages; back to sending after a large one (a weight chunk), so a
        chunk is forwarded while the next one is still arriving."""
        for _ in range(max_messages):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            self._handle_guarded(identity, frames[1:])
            if len(frames[-1]) >= FORWARD_AFTER_BYTES:
                return

    def _unexpected(self, identity: bytes, frames: list[Any], exc: Exception) -> None:
        self._guard_log.exception(
            ("unexpected", type(exc).__name__),
            "weight plane failed handling one message; serving on",
            peer=identity.hex(),
            error=repr(exc)[:300],
        )
        detail = common_pb2.ErrorDetail(
            code=common_pb2.ERROR_CODE_INTERNAL, message=f"broker failed handling this message: {type(exc).__name__}"
        )
        self._replies.error(identity, detail, framing.peek_type(frames))

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        self._rate_in.add(sum(len(f) for f in frames))
        self._intake.forget_tee()
        try:
            message = framing.decode(
                frames, limits=self.limits, auth_token=self.auth_token, tee=self._intake.digest_tee
            )
        except framing.FramingError as exc:
            self._intake.discard_tee()
            self._guard_log.warning(
                ("refused", exc.code),
                "refused a message on the weight socket",
                error=str(exc)[:300],
                code=framing.error_code_name(exc.code),
                peer=identity.hex(),
            )
            self._replies.error(identity, exc.detail(), framing.peek_type(frames))
            return
        if message.type == data_pb2.WEIGHT_UPDATE:
            self._on_update(identity, message)
        elif message.type == data_pb2.HELLO:
            self._subscribers.hello(identity, message)
        elif message.type == data_pb2.WEIGHT_ACK:
            self._subscribers.ack(identity, message)
        elif message.type == data_pb2.ERROR:
            self._guard_log.warning(
                ("peer error", message.header.error.code),
                "peer reported an error",
                peer=message.envelope.sender[:128] or identity.hex(),
                code=framing.error_code_name(message.header.error.code),
                message=message.header.error.message[:300],
            )
        else:
            self._replies.refuse(
                identity,
                message,
                common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                f"{message.type_name} is not accepted on the weight socket (send rollouts to the rollout port)",
            )

    def _on_update(self, identity: bytes, message: framing.Message) -> None:
        envelope = message.envelope
        reply_to = envelope.chunk.transfer_id or envelope.message_id
        if self._subscribers.is_worker(identity):
            self._replies.refuse(
                identity,
                message,
                common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                "an inference worker may not publish weight updates",
                in_reply_to=reply_to,
            )
            return
        self._answer_publisher(identity, reply_to, self._intake.receive(identity, message))

    def _verify_shared(self) -> None:
        """The broker's digest check of the updates in shared memory just received, once their same-host readers
        were sent the descriptor; then stored (or refused) and answered as any update."""
        for arrival, reply in self._intake.verify_shared():
            if reply.update is not None:
                self._segments.track(arrival.update)
            self._answer_publisher(arrival.publisher, arrival.reply_to, reply)

    def _answer_publisher(self, publisher: bytes, reply_to: str, reply: IntakeReply) -> None:
        """Send the trainer its WEIGHT_ACK, if there is one yet; a stored update's forward lag starts now."""
        update = reply.update
        if reply.ack is not None and not reply.refused and update is not None and update.transit.stored_s is None:
            update.transit.stored_s, update.transit.receivers = time.monotonic(), self.fanout.next_receivers(update)
        if reply.refused:
            self._replies.count_error()
        if reply.ack is not None:
            self._replies.ack(publisher, reply.ack, reply_to)

    def _flush(self, socket: zmq.Socket, max_messages: int = 64) -> tuple[bool, bool]:
        """Send pending replies, then chunks round-robin over workers; returns (sent any, some blocked)."""
        sent_any, blocked = self._replies.flush(socket)
        budget = max_messages
        peers = self._subscribers.peers
        while budget > 0:
            progressed = False
            for worker_id in self.fanout.with_something_to_send():
                identity = peers.get(worker_id)
                if identity is None:
                    continue
                if budget <= 0:
                    break
                step = self.fanout.next_step(worker_id)
                if step is None:
                    continue
                update, index, chain = step
                if chain is None and update.shared is not None and self.fanout.reads_in_place(worker_id, update):
                    if self._send_descriptor(socket, worker_id, identity, update):
                        budget -= 1
                        progressed = sent_any = True
                    else:
                        blocked = True
                    continue
                messages, num_chunks = chunk_messages(update, self.chunk_bytes, self._forward_envelope)
                if chain is not None:
                    messages = relayed_messages(messages, update, chain)
                if index >= len(messages):
                    continue  # cut-through: that chunk has not arrived yet
                frames = messages[index]
                try:
                    if not try_send(socket, identity, frames):
                        blocked = True
                        continue
                except PeerGone:
                    self._subscribers.gone(worker_id)
                    continue
                budget -= 1
                progressed = sent_any = True
                self._rate_out.add(frames[-1].nbytes)
                self.fanout.chunk_sent(worker_id, update, last=index + 1 == num_chunks)
                self._note_forward(worker_id, update, index, num_chunks)
            if not progressed:
                break
        return sent_any, blocked

    def _send_descriptor(self, socket: zmq.Socket, worker_id: str, identity: bytes, update: StoredUpdate) -> bool:
        """Send a same-host worker the descriptor of ``update``'s shared segment instead of its bytes; False when its
        pipe is full (tried again next round)."""
        shared = update.shared
        assert shared is not None
        try:
            if not try_send(socket, identity, shared.message(update.header, self._forward_envelope)):
                return False
        except PeerGone:
            self._subscribers.gone(worker_id)
            return False
        self._segments.sent_descriptor(worker_id, update)
        self.fanout.chunk_sent(worker_id, update, last=True)
        self._note_forward(worker_id, update, 0, 1)
        return True

    def _note_forward(self, worker_id: str, update: StoredUpdate, index: int, num_chunks: int) -> None:
        """Track what the broker adds to a transfer: for the workers that were receiving an update, or had it next,
        when it was stored, the time from its last byte in to its last byte out to them."""
        transit = update.transit
        if index + 1 != num_chunks or worker_id not in transit.receivers or transit.stored_s is None:
            return
        lag_s = time.monotonic() - transit.stored_s
        with self._lock:
            version, previous_s = self._forward_lag
            same = version == update.policy_version
            self._forward_lag = (update.policy_version, max(lag_s, previous_s) if same else lag_s)
        log.debug(
            "weight update forwarded",
            worker_id=worker_id,
            policy_version=update.policy_version,
            forward_lag_ms=round(lag_s * 1000, 1),
        )

    def _tick(self, now_s: float) -> None:
        self._intake.expire(now_s)
        self.fanout.tick(now_s)
        released = self.store.release_written(self.fanout.is_sending)
        if released:
            log.debug("weight payloads now read from their durable files", num_bytes=released)
        self._segments.release(now_s)
        self._subscribers.drop_departed()
