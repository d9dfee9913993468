"""The broker's weight plane: one ZMQ ROUTER socket, owned by one IO thread.

Peers (all DEALER sockets, see ``primerl.client.weights``):

- the trainer sends WEIGHT_UPDATE transfers (chunked); the plane reassembles them (``ChunkAssembler``,
  bounded), hashes them as the chunks arrive, hands them to the ``WeightStore`` and answers WEIGHT_ACK
  (``applied=true``: stored; ``applied=false`` with an ``ErrorDetail``: refused, nothing changed;
  ``full_required``: the next update must be FULL). A transfer whose header is refusable is refused at its
  first chunk; its later chunks are dropped without further replies.
- inference workers send HELLO (role INFERENCE, optionally the version they hold), then WEIGHT_ACK for
  each update they applied. The plane pushes each worker the updates of ``store.plan_for(version)``:
  nothing when current, the missing deltas when on the chain, else the latest snapshot then the deltas.

Fan-out never lets one worker hold up the others: every send is ``NOBLOCK`` with ``ROUTER_MANDATORY``; a
full pipe (high-water mark) leaves the message in that worker's outbox for the next round; a gone peer
(``EHOSTUNREACH``) is forgotten with one log line. The chunk messages of an update are encoded once and
sent to every worker as zero-copy views of the stored payload; when the update arrived in chunks of the
size this plane sends, the header bytes and the CRC-32 of each chunk, verified on arrival, are reused, so
forwarding makes no pass over the payload (the SHA-256 is computed once, as the chunks arrive). A worker that
does not acknowledge within ``ack_timeout_s`` is sent its plan again, at most ``max_retries`` times in a
row; then it is forgotten until it says HELLO again (``WeightSubscriber`` does so on its own).

Lineage (a rollback, ``weight_store``): the plane tracks the (version, lineage) each worker holds. When a newer
lineage's FULL replaces the store's chain (a trainer resumed from an older checkpoint, ``policy rolled back`` in
the log when its version is not above the latest), every worker is re-planned: one of an older lineage gets the
new snapshot even when it "already has" that version number. Each HELLO is answered with a WEIGHT_ACK from
``broker`` carrying the latest version and lineage held: the subscriber's sign that the broker is there.

Durability: with ``durable_dir`` the store's chain is kept on disk there (``weight_durable``), reloaded by
``start()`` before the socket binds, so a worker that joins after a broker restart gets the current policy.

Every input goes through ``framing.decode`` with the limits and the run token: a malformed, oversized or
unauthenticated message gets an ERROR reply and is logged; the plane keeps serving.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.plane_lifecycle import RouterPlane
from primerl.broker.weight_durable import WeightDurability
from primerl.broker.weight_store import StoredUpdate, WeightStore, WeightStoreStatus
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.proto import framing
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.meters import RateMeter
from primerl.runtime.zmq_sockets import DEFAULT_HWM

log = get_logger(__name__)

# Room for the fixed frames and the envelope next to one chunk of payload.
ENVELOPE_ALLOWANCE_BYTES = 1 * MiB
BROKER_SENDER = "broker"

OnApplied = Callable[[str, int], None]


def weight_limits(max_message_bytes: int, *, max_transfer_bytes: int = framing.DEFAULT_LIMITS.max_transfer_bytes) -> tuple[framing.Limits, int]:
    """(limits, chunk_bytes) for a plane and its clients from the config's ``max_message_bytes``.

    A chunk is one payload frame of at most ``max_message_bytes`` (libzmq's ``MAXMSGSIZE`` applies per frame);
    a whole message may exceed it by the envelope.
    """
    limits = framing.Limits(
        max_frame_bytes=max_message_bytes,
        max_message_bytes=max_message_bytes + ENVELOPE_ALLOWANCE_BYTES,
        max_envelope_bytes=ENVELOPE_ALLOWANCE_BYTES,
        max_transfer_bytes=max_transfer_bytes,
    )
    return limits, max_message_bytes


@dataclass(frozen=True)
class WeightWorkerStatus:
    worker_id: str
    # Last version the worker acknowledged as applied (or declared in HELLO); None: nothing yet.
    policy_version: int | None
    # Updates queued or being sent to it, and sent but not yet acknowledged.
    num_pending: int
    num_unacked: int
    num_retries: int
    # The lineage of ``policy_version`` (0: unknown).
    lineage: int = 0


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


class _Gone(Exception):
    """The peer of a ROUTER send is no longer connected."""


@dataclass
class _Transfer:
    """An update being sent to one worker: its pre-encoded chunk messages and the next one to send."""

    update: StoredUpdate
    messages: list[list[Any]]
    next_index: int = 0


@dataclass
class _Worker:
    identity: bytes
    worker_id: str
    acked_version: int | None
    # The version the worker will hold once it applied everything already sent to it.
    sent_version: int | None
    # The lineages of those two versions (0: unknown).
    acked_lineage: int = 0
    sent_lineage: int = 0
    current: _Transfer | None = None
    queue: list[StoredUpdate] = field(default_factory=list)
    # (version, lineage) of each update sent and not acknowledged yet, in order.
    unacked: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    last_progress_s: float = field(default_factory=time.monotonic)
    retries: int = 0

    @property
    def has_sends(self) -> bool:
        return self.current is not None or bool(self.queue)


class WeightPlane(RouterPlane):
    """Weight fan-out over one ROUTER socket. ``start()`` binds and runs the IO thread; ``stop()`` ends it
    (``RouterPlane``).

    ``on_applied(worker_id, policy_version)`` is called from the IO thread whenever a worker acknowledges
    an applied version (or declares one in HELLO); it must be quick and thread-safe.
    """

    def __init__(
        self,
        store: WeightStore,
        context: zmq.Context,
        host: str,
        port: int,
        limits: framing.Limits,
        auth_token: str | None,
        chunk_bytes: int,
        on_applied: OnApplied | None = None,
        *,
        ack_timeout_s: float = 30.0,
        max_retries: int = 3,
        max_workers: int = 1024,
        hwm: int = DEFAULT_HWM,
        max_open_transfers: int = 8,
        transfer_timeout_s: float = 300.0,
        transfer_stall_timeout_s: float = 30.0,
        max_open_transfer_bytes: int | None = None,
        max_open_transfers_per_publisher: int = 1,
        max_version_lead: int = 1024,
        max_pending_replies: int = 4096,
        poll_interval_s: float = 0.05,
        durable_dir: str | Path | None = None,
    ):
        if chunk_bytes <= 0 or chunk_bytes > limits.max_frame_bytes:
            raise ValueError(f"chunk_bytes must be in 1..limits.max_frame_bytes ({limits.max_frame_bytes}), got {chunk_bytes}")
        if ack_timeout_s <= 0 or max_retries < 0:
            raise ValueError("ack_timeout_s must be > 0 and max_retries >= 0")
        super().__init__(context, host, port)
        self.store = store
        self.limits = limits
        self.auth_token = auth_token
        self.chunk_bytes = chunk_bytes
        self.on_applied = on_applied
        self.ack_timeout_s = ack_timeout_s
        self.max_retries = max_retries
        self.max_workers = max_workers
        self.hwm = hwm
        self.poll_interval_s = poll_interval_s
        self.max_pending_replies = max_pending_replies
        self.max_version_lead = max_version_lead
        # Transfer limits (checked at a first chunk, before memory is set aside): declared size, total declared
        # bytes of open transfers, open transfers per publisher connection (a new one replaces the oldest), and
        # a short stall timeout, so one peer cannot block another's publishing for long.
        self._assembler = framing.ChunkAssembler(
            limits=limits, max_open_transfers=max_open_transfers, timeout_s=transfer_timeout_s,
            stall_timeout_s=transfer_stall_timeout_s, max_open_bytes=max_open_transfer_bytes,
            max_open_per_publisher=max_open_transfers_per_publisher)
        self._hashers: dict[tuple[str, str], Any] = {}
        # Verified CRC-32 and size of each chunk received so far, per open transfer (see ``_encoded``).
        self._chunk_crcs: dict[tuple[str, str], list[tuple[int, int]]] = {}
        # Transfers refused at one chunk: their later chunks are dropped without replies (bounded memory).
        self._refused_transfers: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._workers: dict[bytes, _Worker] = {}
        self._replies: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self._guard_log = RateLimitedLog(log)
        self._rate_in = RateMeter()
        self._rate_out = RateMeter()
        self._lock = threading.Lock()  # guards the published copies below (read by other threads)
        self._versions: dict[str, WeightWorkerStatus] = {}
        self._num_errors_sent = 0
        self._num_forgotten = 0
        self.durable_dir = None if durable_dir is None else Path(durable_dir)

    # -- lifecycle (any thread) ----------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> int:
        """Bind and start the IO thread; returns the bound port (also ``self.port``)."""
        if self._thread is None and self.durable_dir is not None:
            self.store.attach_durable(WeightDurability(self.durable_dir))
        return super().start(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the IO thread to end and wait up to ``timeout_s``; True once it has ended and the store closed."""
        return super().stop(timeout_s) and self.store.close(timeout_s)

    # -- status (any thread) -------------------------------------------------------------------------

    def worker_versions(self) -> dict[str, int | None]:
        """worker_id -> the policy version it last acknowledged (None: none yet), for every known worker."""
        with self._lock:
            return {worker_id: s.policy_version for worker_id, s in self._versions.items()}

    def status(self) -> WeightPlaneStatus:
        with self._lock:
            workers = tuple(self._versions.values())
            errors, forgotten = self._num_errors_sent, self._num_forgotten
        return WeightPlaneStatus(
            store=self.store.status(),
            workers=workers,
            bytes_in_per_s=self._rate_in.bytes_per_s(),
            bytes_out_per_s=self._rate_out.bytes_per_s(),
            bytes_in_total=self._rate_in.total_bytes,
            bytes_out_total=self._rate_out.total_bytes,
            num_errors_sent=errors,
            num_workers_forgotten=forgotten,
        )

    # -- IO thread -----------------------------------------------------------------------------------

    name = "weight plane"
    thread_name = "weight-plane-io"

    def _bind(self) -> zmq.Socket:
        socket = self._bind_router(max_message_bytes=self.limits.max_frame_bytes, hwm=self.hwm)
        log.info("weight plane listening", host=self.host, port=self.port)
        return socket

    def _serve(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        next_tick_s = 0.0
        try:
            while not self._stop_event.is_set():
                sent_any, blocked = self._flush(socket)
                if sent_any:
                    timeout_ms = 0
                elif blocked:
                    timeout_ms = 2
                else:
                    timeout_ms = int(self.poll_interval_s * 1000)
                if poller.poll(timeout_ms):
                    self._receive_some(socket)
                now_s = time.monotonic()
                if now_s >= next_tick_s:
                    self._tick(now_s)
                    next_tick_s = now_s + min(0.1, self.ack_timeout_s / 4)
        except Exception:
            log.exception("weight plane IO thread failed")
            raise
        finally:
            log.info("weight plane stopped")

    def _receive_some(self, socket: zmq.Socket, max_messages: int = 64) -> None:
        for _ in range(max_messages):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            self._handle_guarded(identity, frames[1:])

    def _unexpected(self, identity: bytes, frames: list[Any], exc: Exception) -> None:
        self._guard_log.exception(("unexpected", type(exc).__name__), "weight plane failed handling one message; serving on",
                                  peer=identity.hex(), error=repr(exc)[:300])
        self._send_error(identity, common_pb2.ErrorDetail(
            code=common_pb2.ERROR_CODE_INTERNAL, message=f"broker failed handling this message: {type(exc).__name__}"),
            framing.peek_type(frames))

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        self._rate_in.add(sum(len(f) for f in frames))
        try:
            message = framing.decode(frames, limits=self.limits, auth_token=self.auth_token)
        except framing.FramingError as exc:
            self._guard_log.warning(("refused", exc.code), "refused a message on the weight socket", error=str(exc)[:300],
                                    code=framing.error_code_name(exc.code), peer=identity.hex())
            self._send_error(identity, exc.detail(), framing.peek_type(frames))
            return
        if message.type == data_pb2.WEIGHT_UPDATE:
            self._on_update(identity, message)
        elif message.type == data_pb2.HELLO:
            self._on_hello(identity, message)
        elif message.type == data_pb2.WEIGHT_ACK:
            self._on_worker_ack(identity, message)
        elif message.type == data_pb2.ERROR:
            self._guard_log.warning(("peer error", message.header.error.code), "peer reported an error",
                                    peer=message.envelope.sender[:128] or identity.hex(),
                                    code=framing.error_code_name(message.header.error.code),
                                    message=message.header.error.message[:300])
        else:
            self._send_error(identity, common_pb2.ErrorDetail(
                code=common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                message=f"{message.type_name} is not accepted on the weight socket (send rollouts to the rollout port)"),
                message.type, in_reply_to=message.envelope.message_id)

    # -- trainer side --------------------------------------------------------------------------------

    def _on_update(self, identity: bytes, message: framing.Message) -> None:
        envelope = message.envelope
        chunk = envelope.chunk
        header: data_pb2.WeightUpdateHeader = message.header
        reply_to = chunk.transfer_id or envelope.message_id
        if identity in self._workers:
            self._send_error(identity, common_pb2.ErrorDetail(
                code=common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                message="an inference worker may not publish weight updates"), message.type, in_reply_to=reply_to)
            return
        whole: framing.Message | None = message
        digest: str | None = None
        if chunk.count > 1:
            key = (envelope.sender, chunk.transfer_id)
            if key in self._refused_transfers:
                return
            try:
                if chunk.index == 0:
                    self._check_version_window(header)
                    self.store.check_header(header)
                    self._hashers[key] = hashlib.sha256()
                    self._chunk_crcs[key] = []
                whole = self._assembler.add(message, publisher=identity)
                if key in self._chunk_crcs:
                    self._chunk_crcs[key].append((envelope.checksum, message.payload[0].nbytes))
                hasher = self._hashers.get(key)
                if hasher is not None:
                    hasher.update(message.payload[0])
            except (WeightUpdateRefused, framing.FramingError) as exc:
                self._hashers.pop(key, None)
                self._chunk_crcs.pop(key, None)
                self._remember_refused(key)
                self._refuse_update(identity, header, exc, reply_to)
                return
            if whole is None:
                return
            hasher = self._hashers.pop(key, None)
            digest = None if hasher is None else hasher.hexdigest()
            chunk_crcs = self._chunk_crcs.pop(key, None)
        else:
            chunk_crcs = [(envelope.checksum, whole.payload[0].nbytes)]
        assert whole is not None
        try:
            self._check_version_window(header)
            result = self.store.put(header, whole.payload[0], computed_digest=digest)
        except WeightUpdateRefused as exc:
            self._refuse_update(identity, header, exc, reply_to)
            return
        if result.duplicate:
            log.info("weight update already held; acknowledged again", update=result.update.describe())
            ack = data_pb2.WeightAck(policy_version=header.policy_version, worker_id=BROKER_SENDER, applied=True,
                                     full_required=result.full_required, lineage=self.store.lineage)
            self._queue_reply(identity, framing.encode(data_pb2.WEIGHT_ACK, ack, **self._envelope(reply_to)))
            return
        if chunk_crcs is not None:
            # The exact header bytes and verified chunk CRCs it arrived with: forwarding costs no CRC pass.
            result.update.cache["received"] = (envelope.header, chunk_crcs)
        log.info("weight update stored", update=result.update.describe(), full_required=result.full_required)
        if result.previous_lineage is not None and result.previous_lineage:
            event = "policy rolled back" if result.rolled_back_from is not None else "policy lineage replaced"
            log.warning(event, policy_version=header.policy_version, rolled_back_from=result.rolled_back_from,
                        lineage=header.lineage, previous_lineage=result.previous_lineage,
                        lineage_base_version=header.lineage_base_version, num_workers=len(self._workers))
        ack = data_pb2.WeightAck(policy_version=header.policy_version, worker_id=BROKER_SENDER, applied=True,
                                 full_required=result.full_required, lineage=self.store.lineage)
        self._queue_reply(identity, framing.encode(data_pb2.WEIGHT_ACK, ack, **self._envelope(reply_to)))
        for worker in self._workers.values():
            self._replan(worker)

    def _check_version_window(self, header: data_pb2.WeightUpdateHeader) -> None:
        """A version more than ``max_version_lead`` past the latest stored one is refused: accepted, it would
        make every later update of the real trainer look out of order."""
        latest = self.store.latest_version
        if latest is not None and header.policy_version > latest + self.max_version_lead:
            raise WeightUpdateRefused(common_pb2.ERROR_CODE_OUT_OF_ORDER,
                                      f"policy_version {header.policy_version} is more than {self.max_version_lead} "
                                      f"versions past the latest stored one ({latest})")

    def _refuse_update(self, identity: bytes, header: data_pb2.WeightUpdateHeader, exc: Exception, reply_to: str) -> None:
        if isinstance(exc, WeightUpdateRefused):
            detail, full_required = exc.detail(), exc.full_required
        else:
            assert isinstance(exc, framing.FramingError)
            detail, full_required = exc.detail(), False
        self._guard_log.warning(("update refused", detail.code), "weight update refused", policy_version=header.policy_version,
                                code=framing.error_code_name(detail.code), error=detail.message[:300])
        ack = data_pb2.WeightAck(policy_version=header.policy_version, worker_id=BROKER_SENDER, applied=False, error=detail,
                                 full_required=full_required, lineage=self.store.lineage)
        self._queue_reply(identity, framing.encode(data_pb2.WEIGHT_ACK, ack, **self._envelope(reply_to)))
        with self._lock:
            self._num_errors_sent += 1

    def _remember_refused(self, key: tuple[str, str], max_remembered: int = 256) -> None:
        self._refused_transfers[key] = None
        while len(self._refused_transfers) > max_remembered:
            self._refused_transfers.popitem(last=False)

    # -- worker side ---------------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, message: framing.Message) -> None:
        hello: data_pb2.Hello = message.header
        if hello.role != common_pb2.ROLE_INFERENCE:
            log.debug("hello from a non-inference peer", role=framing.role_name(hello.role), worker_id=hello.worker_id[:128])
            return
        if not hello.worker_id:
            self._send_error(identity, common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_MALFORMED_HEADER,
                                                              message="HELLO needs a worker_id"), message.type,
                             in_reply_to=message.envelope.message_id)
            return
        version = hello.policy_version if hello.HasField("policy_version") else None
        lineage = hello.lineage if version is not None else 0
        self._answer_hello(identity, message)
        worker = self._workers.get(identity)
        if (worker is not None and worker.worker_id == hello.worker_id and worker.acked_version == version
                and worker.acked_lineage == lineage):
            return  # a repeated HELLO (the subscriber's keep-alive): nothing changed
        if worker is None:
            for other in [w for w in self._workers.values() if w.worker_id == hello.worker_id]:
                log.info("weight subscriber reconnected; dropping its old connection", worker_id=hello.worker_id)
                self._forget(other, count=False)
            if len(self._workers) >= self.max_workers:
                self._send_error(identity, common_pb2.ErrorDetail(
                    code=common_pb2.ERROR_CODE_BACKPRESSURE, retry_after_ms=5000,
                    message=f"the broker serves at most {self.max_workers} weight subscribers"), message.type)
                return
            worker = _Worker(identity=identity, worker_id=hello.worker_id, acked_version=version, sent_version=version,
                             acked_lineage=lineage, sent_lineage=lineage)
            self._workers[identity] = worker
            log.info("weight subscriber joined", worker_id=worker.worker_id, policy_version=version, lineage=lineage)
        else:
            worker.worker_id = hello.worker_id
            self._declare_version(worker, version, lineage)
        if version is not None:
            self._notify_applied(worker, version)
        self._replan(worker)
        self._publish_worker(worker)

    def _answer_hello(self, identity: bytes, message: framing.Message) -> None:
        """Every HELLO gets a WEIGHT_ACK from the broker with the latest version and lineage held: the
        subscriber's keep-alive doubles as its check that the broker is there."""
        status = self.store.status()
        ack = data_pb2.WeightAck(policy_version=status.latest_version or 0, worker_id=BROKER_SENDER, applied=True,
                                 lineage=status.lineage)
        self._queue_reply(identity, framing.encode(data_pb2.WEIGHT_ACK, ack,
                                                   **self._envelope(message.envelope.message_id)))

    def _on_worker_ack(self, identity: bytes, message: framing.Message) -> None:
        ack: data_pb2.WeightAck = message.header
        worker = self._workers.get(identity)
        if worker is None:
            self._send_error(identity, common_pb2.ErrorDetail(
                code=common_pb2.ERROR_CODE_UNKNOWN_WORKER,
                message="WEIGHT_ACK from a peer that has not said HELLO (or was forgotten): send HELLO first"),
                message.type, in_reply_to=message.envelope.message_id)
            return
        version, lineage = ack.policy_version, ack.lineage
        worker.last_progress_s = time.monotonic()
        if ack.applied:
            sent = next((entry for entry in worker.unacked
                         if entry[0] == version and (lineage == entry[1] or not lineage)), None)
            if sent is not None:
                worker.retries = 0
                while worker.unacked and worker.unacked.popleft() != sent:
                    pass
                worker.acked_version, worker.acked_lineage = sent
            elif any(entry[0] == version for entry in worker.unacked):
                # Sent (v, new lineage), acknowledged (v, another lineage): it kept the weights it had.
                worker.retries += 1
                log.warning("weight subscriber kept another lineage's weights of the version it was sent",
                            worker_id=worker.worker_id, policy_version=version, lineage=lineage,
                            sent_lineage=next(entry[1] for entry in worker.unacked if entry[0] == version),
                            attempt=worker.retries)
                if worker.retries > self.max_retries:
                    self._forget(worker, reason=f"did not load lineage {self.store.lineage} after {worker.retries} tries")
                    return
                self._declare_version(worker, version, lineage)
                self._replan(worker)
            else:
                worker.retries = 0
                self._declare_version(worker, version, lineage)
                self._replan(worker)
            self._notify_applied(worker, version)
        else:
            detail = ack.error
            log.warning("weight subscriber failed to apply an update; it will get the full snapshot",
                        worker_id=worker.worker_id, policy_version=version, code=framing.error_code_name(detail.code),
                        error=detail.message[:300])
            worker.retries += 1
            if worker.retries > self.max_retries:
                self._forget(worker, reason=f"failed to apply updates {worker.retries} times in a row")
                return
            worker.unacked.clear()
            worker.sent_version, worker.sent_lineage = None, 0  # unknown state: start again from the snapshot
            self._replan(worker)
        self._publish_worker(worker)

    def _declare_version(self, worker: _Worker, version: int | None, lineage: int) -> None:
        """The worker says it holds ``version`` of ``lineage`` (not one we sent it): plan from there."""
        worker.acked_version = worker.sent_version = version
        worker.acked_lineage = worker.sent_lineage = lineage
        worker.unacked.clear()

    def _replan(self, worker: _Worker) -> None:
        if worker.current is not None:
            basis, lineage = worker.current.update.policy_version, worker.current.update.lineage
        else:
            basis, lineage = worker.sent_version, worker.sent_lineage
        worker.queue = self.store.plan_for(basis, lineage)
        self._publish_worker(worker)

    def _notify_applied(self, worker: _Worker, version: int) -> None:
        if self.on_applied is None:
            return
        try:
            self.on_applied(worker.worker_id, version)
        except Exception:
            log.exception("on_applied callback failed", worker_id=worker.worker_id, policy_version=version)

    def _forget(self, worker: _Worker, *, reason: str = "", count: bool = True) -> None:
        self._workers.pop(worker.identity, None)
        with self._lock:
            current = self._versions.get(worker.worker_id)
            if current is not None and not any(w.worker_id == worker.worker_id for w in self._workers.values()):
                del self._versions[worker.worker_id]
            if count:
                self._num_forgotten += 1
        if reason:
            log.warning("weight subscriber forgotten", worker_id=worker.worker_id, reason=reason,
                        policy_version=worker.acked_version)

    def _publish_worker(self, worker: _Worker) -> None:
        with self._lock:
            self._versions[worker.worker_id] = WeightWorkerStatus(
                worker_id=worker.worker_id, policy_version=worker.acked_version,
                num_pending=len(worker.queue) + (worker.current is not None), num_unacked=len(worker.unacked),
                num_retries=worker.retries, lineage=worker.acked_lineage)

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
            for worker in list(self._workers.values()):
                if budget <= 0:
                    break
                if not worker.has_sends:
                    continue
                if worker.current is None:
                    worker.current = _Transfer(worker.queue[0], self._encoded(worker.queue[0]))
                    del worker.queue[0]
                transfer = worker.current
                frames = transfer.messages[transfer.next_index]
                try:
                    if not self._try_send(socket, worker.identity, frames):
                        blocked = True
                        continue
                except _Gone:
                    self._forget(worker, reason="peer disconnected")
                    continue
                budget -= 1
                progressed = sent_any = True
                self._rate_out.add(frames[-1].nbytes)
                transfer.next_index += 1
                if transfer.next_index == len(transfer.messages):
                    worker.current = None
                    worker.sent_version = transfer.update.policy_version
                    worker.sent_lineage = transfer.update.lineage
                    worker.unacked.append((transfer.update.policy_version, transfer.update.lineage))
                    worker.last_progress_s = time.monotonic()
                    self._publish_worker(worker)
            if not progressed:
                break
        return sent_any, blocked

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

    def _encoded(self, update: StoredUpdate) -> list[list[Any]]:
        """The chunk messages of ``update`` (payload slices are zero-copy views), built once per update.

        When the update arrived in chunks of the size this plane sends, their header bytes and verified
        CRC-32s are reused (``framing.encode_raw``): no pass over the payload at all. Otherwise the CRC of
        each chunk is computed once here."""
        messages = update.cache.get("chunks")
        if messages is not None:
            return messages
        received = update.cache.pop("received", None)
        total = update.payload.nbytes
        count = max(1, -(-total // self.chunk_bytes))
        if received is not None and [size for _, size in received[1]] == [
                min(self.chunk_bytes, total - index * self.chunk_bytes) for index in range(count)]:
            header_bytes, crcs = received
            transfer_id = uuid.uuid4().hex
            messages = [framing.encode_raw(
                data_pb2.WEIGHT_UPDATE, header_bytes, [update.payload[index * self.chunk_bytes:(index + 1) * self.chunk_bytes]],
                checksum=crc, chunk=data_pb2.Chunk(transfer_id=transfer_id, index=index, count=count, total_bytes=total),
                **self._envelope("")) for index, (crc, _) in enumerate(crcs)]
        else:
            messages = list(framing.encode_chunked(data_pb2.WEIGHT_UPDATE, update.header, update.payload,
                                                   chunk_bytes=self.chunk_bytes, **self._envelope("")))
        update.cache["chunks"] = messages
        return messages

    def _queue_reply(self, identity: bytes, frames: list[Any]) -> None:
        if len(self._replies) >= self.max_pending_replies:
            self._guard_log.warning("reply queue full", "reply queue full; dropping a reply", peer=identity.hex())
            return
        self._replies.append((identity, frames))

    def _send_error(self, identity: bytes, detail: common_pb2.ErrorDetail, refused_type: int, *, in_reply_to: str = "") -> None:
        with self._lock:
            self._num_errors_sent += 1
        # No run token on ERROR replies: the peer may be one that failed to authenticate.
        self._queue_reply(identity, framing.encode_error(detail, refused_type=refused_type, sender=BROKER_SENDER,
                                                         in_reply_to=in_reply_to))

    def _envelope(self, in_reply_to: str) -> dict[str, str]:
        return {"sender": BROKER_SENDER, "auth_token": self.auth_token or "", "in_reply_to": in_reply_to}

    # -- timers --------------------------------------------------------------------------------------

    def _tick(self, now_s: float) -> None:
        for transfer_id in self._assembler.expire(now_s):
            self._guard_log.warning("transfer expired", "incomplete weight transfer expired", transfer_id=transfer_id[:64])
            for key in [k for k in self._hashers if k[1] == transfer_id]:
                del self._hashers[key]
                self._chunk_crcs.pop(key, None)
        # Transfers replaced by a newer one of the same publisher: drop their running hashes too.
        for key in [k for k in self._hashers if not self._assembler.is_open(k)]:
            del self._hashers[key]
            self._chunk_crcs.pop(key, None)
        for worker in list(self._workers.values()):
            if worker.unacked and worker.current is None and now_s - worker.last_progress_s > self.ack_timeout_s:
                worker.retries += 1
                if worker.retries > self.max_retries:
                    self._forget(worker, reason=f"no WEIGHT_ACK for v{worker.unacked[-1][0]} after {worker.retries} tries")
                    continue
                log.warning("no WEIGHT_ACK in time; sending the plan again", worker_id=worker.worker_id,
                            awaited_version=worker.unacked[-1][0], acked_version=worker.acked_version, attempt=worker.retries)
                worker.unacked.clear()
                worker.sent_version, worker.sent_lineage = worker.acked_version, worker.acked_lineage
                worker.last_progress_s = now_s
                self._replan(worker)
                self._publish_worker(worker)
