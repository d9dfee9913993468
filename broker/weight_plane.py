"""The broker's weight plane: one ZMQ ROUTER socket, owned by one IO thread.

Peers (all DEALER sockets, see ``primerl.client.weights``):

- the trainer sends WEIGHT_UPDATE transfers (chunked); ``WeightIntake`` (``weight_intake``, no sockets)
  keeps their chunks as they arrived (no reassembly) and hashes them, hands whole ones to the fan-out core and says
  which WEIGHT_ACK to answer.
- inference workers send HELLO (role INFERENCE, optionally the version they hold), then WEIGHT_ACK for
  each update they applied. ``WeightFanout`` (``weight_fanout``, no sockets) owns which version each worker
  holds, the latest version, and what to push next: nothing when current, the missing deltas when on the
  chain, else the latest snapshot then the deltas. This module maps ROUTER identities to worker ids, feeds
  the core those events, and sends what it says.

Fan-out never lets one worker hold up the others: every send is ``NOBLOCK`` with ``ROUTER_MANDATORY``; a
full pipe (high-water mark) leaves the message in that worker's outbox for the next round; a gone peer
(``EHOSTUNREACH``) leaves the fan-out with one log line. Forwarding is cut-through and zero-copy: a chunk goes
out to the workers for whom the update is the next step as soon as it arrived and passed its checksum, as the
very frame received, with the header bytes and checksum it came with (no pass over the payload); the update's
last chunk goes out only once the whole update is stored (digest checked), so no worker ever holds an update
the broker refused. Every worker gets the same encoded messages (one transfer id per update). A worker that
does not acknowledge within ``ack_timeout_s`` is sent its plan again, at most ``max_retries`` times in a
row; then it is forgotten until it says HELLO again (``WeightSubscriber`` does so on its own). A worker the
registry marks LOST (or that deregistered) leaves the fan-out for good (``WeightFanout.leave``): its HELLOs are
still answered, but it gets no pushes until it registers again under a new id.

Relay (``WeightFanout(fanout="chain")``): the chunks of an update a chain receives go to its head only, each as the
message the star fan-out sends plus the chain (``Envelope.relay_hops``) and a transfer id of its own (appended to
the envelope bytes: protobuf merges them, and the checksum does not cover the envelope), so every hop receives and
forwards the same frames and the broker sends each byte once per chain. ``bytes_out_total``
(``primerl_broker_weight_bytes_pushed_total``) counts the payload bytes the broker itself sent.

Lineage (a rollback, ``weight_store``): the core tracks the (version, lineage) each worker holds. When a newer
lineage's FULL replaces the store's chain (a trainer resumed from an older checkpoint, ``policy rolled back`` in
the log when its version is not above the latest), every worker is re-planned: one of an older lineage gets the
new snapshot even when it "already has" that version number. Each HELLO is answered with a WEIGHT_ACK from
``broker`` carrying the latest version and lineage (``WeightFanout.latest``): the subscriber's sign that the
broker is there.

Same host (``broker.shared_updates``): a trainer on the broker's host publishes a descriptor of a shared-memory
segment instead of the bytes; a worker on that host (``Hello.host_id``) is sent the descriptor, one small message,
and reads the segment itself (``bytes_out_total`` does not grow), the others get the bytes. The plane releases the
segment to the trainer once its readers are done and the payload is on disk (or copied), and removes the segments of
dead trainers (``remove_stale_segments``) every ``SEGMENT_SWEEP_S``.

Durability: with ``durable_dir`` the store's chain is kept on disk there (``weight_durable``), reloaded by
``start()`` before the socket binds, so a worker that joins after a broker restart gets the current policy. Once
an update's file is written and no worker is in the middle of it, its received frames are freed and its payload
is read from the file when needed (``WeightStore.release_written``): the broker's memory holds little more than
the update being received.

Every input goes through ``framing.decode`` with the limits and the run token: a malformed, oversized or
unauthenticated message gets an ERROR reply and is logged; the plane keeps serving.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.plane_lifecycle import RouterPlane
from primerl.broker.shared_updates import COPY_AFTER_S
from primerl.broker.weight_durable import WeightDurability
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_intake import BROKER_SENDER, IntakeBounds, WeightIntake
from primerl.broker.weight_members import Joined, WeightWorkerStatus
from primerl.broker.weight_messages import chunk_messages, relayed_messages
from primerl.broker.weight_relay import valid_relay_endpoint
from primerl.broker.weight_store import StoredUpdate, WeightStoreStatus
from primerl.proto import framing
from primerl.proto.shared_segment import remove_stale_segments
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.meters import RateMeter
from primerl.runtime.zmq_sockets import DEFAULT_HWM

log = get_logger(__name__)


OnApplied = Callable[[str, int], None]
FORWARD_AFTER_BYTES = 1 << 20
"""A received message at least this large ends a receive round, so its chunk is forwarded before the next is read."""
SEGMENT_SWEEP_S = 5.0
"""How often the plane removes the shared weight segments of trainers that died (SIGKILL) without removing them."""


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


class _Gone(Exception):
    """The peer of a ROUTER send is no longer connected."""


class WeightPlane(RouterPlane):
    """Weight fan-out over one ROUTER socket. ``start()`` binds and runs the IO thread; ``stop()`` ends it
    (``RouterPlane``).

    ``on_applied(worker_id, policy_version)`` is called from the IO thread whenever a worker acknowledges
    an applied version (or declares one in HELLO); it must be quick and thread-safe.

    ``fanout``: the fan-out core over ``store`` (the broker shares it with its registry); None: one of its own,
    with ``ack_timeout_s``, ``max_retries`` and ``max_workers``.
    """

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
    ):
        """``fanout``: the fan-out core over the plane's ``WeightStore`` (``fanout.store``); ``intake_bounds``: the
        limits on the trainer's transfers in flight; ``durable_dir``: where the store's chain is kept on disk;
        ``max_connections``: peers admitted at the ZeroMQ handshake (``ConnectionGate``; None: every peer)."""
        if chunk_bytes <= 0 or chunk_bytes > limits.max_frame_bytes:
            raise ValueError(
                f"chunk_bytes must be in 1..limits.max_frame_bytes ({limits.max_frame_bytes}), got {chunk_bytes}"
            )
        super().__init__(context, host, port, max_connections)
        self.store = fanout.store
        self.fanout = fanout
        self.limits = limits
        self.auth_token = auth_token or None
        self._forward_envelope = self._envelope("")  # of every chunk message the plane builds (weight_messages)
        self.chunk_bytes = chunk_bytes
        self.on_applied = on_applied
        self.hwm = hwm
        self.poll_interval_s = poll_interval_s
        self.max_pending_replies = max_pending_replies
        self._intake = WeightIntake(self.fanout, limits, intake_bounds, forward_chunk_bytes=chunk_bytes)
        # The connection each subscribed worker said HELLO on last, and the worker id of each such connection.
        self._peers: dict[str, bytes] = {}
        self._worker_ids: dict[bytes, str] = {}
        self._replies: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self._guard_log = RateLimitedLog(log)
        self._rate_in = RateMeter()
        self._rate_out = RateMeter()
        self._lock = threading.Lock()  # guards the counter below (read by other threads)
        self._num_errors_sent = 0
        self._forward_lag: tuple[int, float] = (0, 0.0)
        self.durable_dir = None if durable_dir is None else Path(durable_dir)
        # Stored updates whose payload still views a trainer's shared-memory segment (not released yet).
        self._shared: list[StoredUpdate] = []
        self._num_descriptors_sent = 0
        self._num_segments_released = 0
        self._next_sweep_s = 0.0

    # -- lifecycle (any thread) ----------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> int:
        """Bind and start the IO thread; returns the bound port (also ``self.port``)."""
        if self._thread is None and self.durable_dir is not None:
            self.store.attach_durable(WeightDurability(self.durable_dir))
            self.fanout.store_reloaded()
        return super().start(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the IO thread to end and wait up to ``timeout_s``; True once it has ended and the store closed."""
        return super().stop(timeout_s) and self.store.close(timeout_s)

    # -- status (any thread) -------------------------------------------------------------------------

    def worker_versions(self) -> dict[str, int | None]:
        """worker_id -> the policy version it last acknowledged (None: none yet), for every subscribed worker."""
        return self.fanout.worker_versions()

    def status(self) -> WeightPlaneStatus:
        with self._lock:
            errors = self._num_errors_sent
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
            num_errors_sent=errors,
            num_workers_forgotten=counts.num_forgotten,
            forward_lag_version=lag_version,
            forward_lag_s=lag_s,
            num_connections=num_connections,
            num_connections_refused=num_connections_refused,
            num_open_transfers=self._intake.num_open_transfers,
            num_relay_chains=counts.num_relay_chains,
            num_relay_heals=counts.num_relay_heals,
            num_descriptors_sent=self._num_descriptors_sent,
            num_segments_released=self._num_segments_released,
        )

    # -- IO thread -----------------------------------------------------------------------------------

    name = "weight plane"
    thread_name = "weight-plane-io"
    gate_domain = "primerl-weight"
    connection_kind = "weight connection"

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
        self._send_error(
            identity,
            common_pb2.ErrorDetail(
                code=common_pb2.ERROR_CODE_INTERNAL,
                message=f"broker failed handling this message: {type(exc).__name__}",
            ),
            framing.peek_type(frames),
        )

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
            self._send_error(identity, exc.detail(), framing.peek_type(frames))
            return
        if message.type == data_pb2.WEIGHT_UPDATE:
            self._on_update(identity, message)
        elif message.type == data_pb2.HELLO:
            self._on_hello(identity, message)
        elif message.type == data_pb2.WEIGHT_ACK:
            self._on_worker_ack(identity, message)
        elif message.type == data_pb2.ERROR:
            self._guard_log.warning(
                ("peer error", message.header.error.code),
                "peer reported an error",
                peer=message.envelope.sender[:128] or identity.hex(),
                code=framing.error_code_name(message.header.error.code),
                message=message.header.error.message[:300],
            )
        else:
            self._send_error(
                identity,
                common_pb2.ErrorDetail(
                    code=common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                    message=f"{message.type_name} is not accepted on the weight socket "
                    "(send rollouts to the rollout port)",
                ),
                message.type,
                in_reply_to=message.envelope.message_id,
            )

    # -- trainer side --------------------------------------------------------------------------------

    def _on_update(self, identity: bytes, message: framing.Message) -> None:
        envelope = message.envelope
        reply_to = envelope.chunk.transfer_id or envelope.message_id
        if identity in self._worker_ids:
            self._send_error(
                identity,
                common_pb2.ErrorDetail(
                    code=common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                    message="an inference worker may not publish weight updates",
                ),
                message.type,
                in_reply_to=reply_to,
            )
            return
        reply = self._intake.receive(identity, message)
        if reply.ack is not None and not reply.refused and reply.update is not None:
            transit = reply.update.transit
            if transit.stored_s is None:
                transit.stored_s, transit.receivers = time.monotonic(), self.fanout.next_receivers(reply.update)
        if reply.refused:
            with self._lock:
                self._num_errors_sent += 1
        if reply.ack is not None:
            self._queue_reply(identity, framing.encode(data_pb2.WEIGHT_ACK, reply.ack, **self._envelope(reply_to)))

    def _verify_shared(self) -> None:
        """The broker's digest check of the updates in shared memory just received, once their same-host readers
        were sent the descriptor; then stored (or refused) and answered as any update."""
        for arrival, reply in self._intake.verify_shared():
            update = arrival.update
            if reply.update is not None and update not in self._shared:
                self._shared.append(update)
                update.transit.stored_s = time.monotonic()
                update.transit.receivers = self.fanout.next_receivers(update)
            if reply.refused:
                with self._lock:
                    self._num_errors_sent += 1
            if reply.ack is not None:
                ack = framing.encode(data_pb2.WEIGHT_ACK, reply.ack, **self._envelope(arrival.reply_to))
                self._queue_reply(arrival.publisher, ack)

    # -- worker side ---------------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, message: framing.Message) -> None:
        hello: data_pb2.Hello = message.header
        if hello.role != common_pb2.ROLE_INFERENCE:
            log.debug(
                "hello from a non-inference peer", role=framing.role_name(hello.role), worker_id=hello.worker_id[:128]
            )
            return
        if not hello.worker_id:
            self._send_error(
                identity,
                common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_MALFORMED_HEADER, message="HELLO needs a worker_id"),
                message.type,
                in_reply_to=message.envelope.message_id,
            )
            return
        worker_id = hello.worker_id
        version = hello.policy_version if hello.HasField("policy_version") else None
        lineage = hello.lineage if version is not None else 0
        self._answer_hello(identity, message)
        previous_id = self._worker_ids.get(identity)
        if previous_id is not None and previous_id != worker_id:  # this connection now speaks for another worker
            self._drop_peer(previous_id)
            self.fanout.forget(previous_id, reason="", count=False)
        reconnected = self._peers.get(worker_id, identity) != identity
        relay_endpoint = hello.relay_endpoint
        if relay_endpoint and not valid_relay_endpoint(relay_endpoint):
            self._guard_log.warning(
                "bad relay endpoint",
                "HELLO names a relay endpoint that is not tcp://host:port or ipc://path (at most 256 characters); "
                "the broker sends this worker its updates itself",
                worker_id=worker_id[:128],
                relay_endpoint=relay_endpoint[:128],
            )
            relay_endpoint = ""
        outcome = self.fanout.hello(
            worker_id,
            version,
            lineage,
            reconnected=reconnected,
            relay_endpoint=relay_endpoint,
            host_id=hello.host_id[:64],
        )
        if outcome is Joined.FULL:
            self._send_error(
                identity,
                common_pb2.ErrorDetail(
                    code=common_pb2.ERROR_CODE_BACKPRESSURE,
                    retry_after_ms=5000,
                    message=f"the broker serves at most {self.fanout.max_workers} weight subscribers",
                ),
                message.type,
            )
            return
        if outcome is Joined.GONE:
            self._guard_log.warning(
                "gone worker",
                "HELLO from a worker the registry lost or saw leave: no pushes until it registers again",
                worker_id=worker_id[:128],
            )
            return
        self._drop_peer(worker_id)
        self._peers[worker_id], self._worker_ids[identity] = identity, worker_id
        if outcome is not Joined.REPEATED and version is not None:
            self._notify_applied(worker_id, version)

    def _answer_hello(self, identity: bytes, message: framing.Message) -> None:
        """Every HELLO gets a WEIGHT_ACK from the broker with the latest version and lineage: the subscriber's
        keep-alive doubles as its check that the broker is there."""
        latest = self.fanout.latest()
        ack = data_pb2.WeightAck(
            policy_version=latest.version, worker_id=BROKER_SENDER, applied=True, lineage=latest.lineage
        )
        self._queue_reply(
            identity, framing.encode(data_pb2.WEIGHT_ACK, ack, **self._envelope(message.envelope.message_id))
        )

    def _on_worker_ack(self, identity: bytes, message: framing.Message) -> None:
        ack: data_pb2.WeightAck = message.header
        worker_id = self._worker_ids.get(identity)
        taken = (
            None
            if worker_id is None
            else self.fanout.ack(worker_id, ack.policy_version, ack.lineage, applied=ack.applied, error=ack.error)
        )
        if taken is None:
            self._send_error(
                identity,
                common_pb2.ErrorDetail(
                    code=common_pb2.ERROR_CODE_UNKNOWN_WORKER,
                    message="WEIGHT_ACK from a peer that has not said HELLO (or was forgotten): send HELLO first",
                ),
                message.type,
                in_reply_to=message.envelope.message_id,
            )
            return
        if taken is not None:
            for update in self._shared:  # it read every segment up to this version (or gave up on it)
                if (not ack.applied or update.policy_version <= ack.policy_version) and update.shared.reader_done(
                    worker_id
                ):
                    self.store.notify_durable()  # its durable file was postponed while they loaded
        if taken and ack.applied:
            self._notify_applied(worker_id, ack.policy_version)

    def _notify_applied(self, worker_id: str, version: int) -> None:
        if self.on_applied is None:
            return
        try:
            self.on_applied(worker_id, version)
        except Exception:
            log.exception("on_applied callback failed", worker_id=worker_id, policy_version=version)

    def _drop_peer(self, worker_id: str) -> None:
        """Forget the connection ``worker_id`` said HELLO on (the fan-out decides about the worker itself)."""
        identity = self._peers.pop(worker_id, None)
        if identity is not None and self._worker_ids.get(identity) == worker_id:
            del self._worker_ids[identity]

    # -- sending -------------------------------------------------------------------------------------

    def _flush(self, socket: zmq.Socket, max_messages: int = 64) -> tuple[bool, bool]:
        """Send pending replies, then chunks round-robin over workers; returns (sent any, some blocked)."""
        sent_any = blocked = False
        for _ in range(len(self._replies)):
            identity, frames = self._replies[0]
            try:
                if not self._try_send(socket, identity, frames):
                    blocked = True
                    break
            except _Gone:
                log.warning("reply dropped: peer is gone", peer=identity.hex())
            self._replies.popleft()
            sent_any = True
        budget = max_messages
        while budget > 0:
            progressed = False
            for worker_id, identity in list(self._peers.items()):
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
                    if not self._try_send(socket, identity, frames):
                        blocked = True
                        continue
                except _Gone:
                    self._drop_peer(worker_id)
                    self.fanout.forget(worker_id, reason="peer disconnected")
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
            if not self._try_send(socket, identity, shared.message(update.header, self._envelope(""))):
                return False
        except _Gone:
            self._drop_peer(worker_id)
            self.fanout.forget(worker_id, reason="peer disconnected")
            return False
        shared.add_reader(worker_id)
        self._num_descriptors_sent += 1
        self.fanout.chunk_sent(worker_id, update, last=True)
        self._note_forward(worker_id, update, 0, 1)
        return True

    def _release_segments(self, now_s: float) -> None:
        """Release the trainer's segments nobody reads any more and the broker no longer needs (see
        ``broker.shared_updates``); remove those of dead trainers now and then."""
        if self._shared:
            chain = self.store.durable_chain()[1]
            for update in list(self._shared):
                shared = update.shared
                assert shared is not None
                for worker_id in [w for w in shared.readers if not self.fanout.is_member(w)]:
                    if shared.reader_done(worker_id):  # declared gone: it reads nothing more
                        self.store.notify_durable()
                if shared.readers or self.fanout.is_sending(update):
                    continue
                held = any(u is update for u in chain)
                if held and not update.transit.on_disk:
                    done_s = shared.readers_done_s or now_s
                    if self.store.has_durable and now_s - done_s < COPY_AFTER_S:
                        continue  # its durable file comes soon: the store then reads it from there
                    update.transit.forward = None
                    update.segments[:] = [memoryview(bytes(update.payload)).toreadonly()]
                elif not held:
                    update.segments.clear()
                shared.release()
                self._shared.remove(update)
                self._num_segments_released += 1
                log.debug("shared weight segment released", policy_version=update.policy_version, held=held)
        if now_s >= self._next_sweep_s:
            self._next_sweep_s = now_s + SEGMENT_SWEEP_S
            removed = remove_stale_segments()
            if removed:
                log.info("removed shared weight segments of dead trainers", paths=[str(p) for p in removed])

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

    def _try_send(self, socket: zmq.Socket, identity: bytes, frames: list[Any]) -> bool:
        """Send without blocking; False when the peer's pipe is full; raises ``_Gone`` for a vanished peer."""
        try:
            socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise _Gone() from None
            raise
        return True

    def _queue_reply(self, identity: bytes, frames: list[Any]) -> None:
        if len(self._replies) >= self.max_pending_replies:
            self._guard_log.warning("reply queue full", "reply queue full; dropping a reply", peer=identity.hex())
            return
        self._replies.append((identity, frames))

    def _send_error(
        self, identity: bytes, detail: common_pb2.ErrorDetail, refused_type: int, *, in_reply_to: str = ""
    ) -> None:
        with self._lock:
            self._num_errors_sent += 1
        # No run token on ERROR replies: the peer may be one that failed to authenticate.
        self._queue_reply(
            identity,
            framing.encode_error(detail, refused_type=refused_type, sender=BROKER_SENDER, in_reply_to=in_reply_to),
        )

    def _envelope(self, in_reply_to: str) -> dict[str, str]:
        return {"sender": BROKER_SENDER, "auth_token": self.auth_token or "", "in_reply_to": in_reply_to}

    # -- timers --------------------------------------------------------------------------------------

    def _tick(self, now_s: float) -> None:
        self._intake.expire(now_s)
        self.fanout.tick(now_s)
        released = self.store.release_written(self.fanout.is_sending)
        if released:
            log.debug("weight payloads now read from their durable files", num_bytes=released)
        self._release_segments(now_s)
        # Connections of workers the fan-out no longer holds (forgotten, gone): their next HELLO maps them again.
        for worker_id in [w for w in self._peers if not self.fanout.is_member(w)]:
            self._drop_peer(worker_id)
