"""The trainer's side of the weight plane, without sockets: WEIGHT_UPDATE transfers in, WEIGHT_ACKs out.

``WeightIntake.receive(publisher, message)`` takes one decoded WEIGHT_UPDATE message (a whole update or one chunk
of a transfer) and answers an ``IntakeReply``: the WEIGHT_ACK to send back (None while a transfer is unfinished,
and for later chunks of a refused one) and the update the message belongs to, whose chunks the plane may forward.

- chunks are kept as they arrived (``ChunkAssembler(zero_copy=True)``: no reassembly, no copy) and hashed
  (``proto.digests``, XXH3-128) as they arrive, in the same pass as their checksum (``digest_tee``, given to
  ``framing.decode``), so the payload is read once on its way in and the store makes no second pass; the header
  bytes and the verified checksum of each chunk are kept with the update (``transit.received``), so forwarding
  reuses them;
- cut-through: at a transfer's first chunk the update already exists (``StoredUpdate`` with a growing list of
  segments) and ``WeightFanout.begin`` has the members for whom it is the next step receive its chunks as they
  come; the last chunk is forwarded only once the whole update is stored, so a worker never holds an update the
  broker refused, and a refused, abandoned or expired one is ``WeightFanout.abort``ed;
- a transfer whose header is refusable (``WeightStore.check_header``, or a version more than
  ``max_version_lead`` past the latest) is refused at its first chunk;
- open transfers are bounded in number and declared bytes over all publisher connections, and each connection has
  its own ``ChunkAssembler`` (at most ``max_open_transfers_per_publisher``, a new one replacing its oldest). When a
  first chunk finds the bounds reached, transfers of other connections give their place, the most idle first, once
  they are stalled (no chunk for ``evictable_after_s``) or behind pace (open that long and fewer bytes received than
  would finish within ``transfer_timeout_s``): half-open or trickling transfers cannot keep a publisher out;
- a streamed transfer (``WeightUpdateHeader.digest`` empty) takes the digest its last chunk carries
  (``Chunk.payload_digest``) into the stored update's header before it is checked;
- a whole update goes to ``WeightFanout.put_update`` (stored, every worker planned again); the ack says
  ``applied=true`` (stored, or held already: a resend), or ``applied=false`` with an ``ErrorDetail`` (refused,
  nothing changed); ``full_required``: the next update must be FULL.

Run by the plane's IO thread only.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import NamedTuple

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.shared_updates import SharedPayload
from primerl.broker.stored_update import StoredUpdate, copy_header
from primerl.broker.weight_fanout import WeightFanout
from primerl.proto import chunked_transfer, framing, telemetry
from primerl.proto.digests import PayloadHasher, hasher_for
from primerl.proto.shared_segment import SegmentError, open_segment
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)

BROKER_SENDER = "broker"
"""``envelope.sender`` and ``WeightAck.worker_id`` of everything the broker's weight plane sends."""
MAX_REMEMBERED_REFUSALS = 256


class IntakeReply(NamedTuple):
    """The WEIGHT_ACK to send the publisher (None: nothing to answer yet), whether it refuses the update, and the
    update whose chunks may be forwarded now (None: nothing to forward)."""

    ack: data_pb2.WeightAck | None
    refused: bool
    update: StoredUpdate | None = None


class ReceivedChunks(NamedTuple):
    """What an update arrived as: the serialized header, the verified checksum and size of each chunk so far, the
    number of chunks and the total bytes declared."""

    header_bytes: bytes
    checksums: list[tuple[framing.Checksum, int]]
    num_chunks: int
    total_bytes: int
    digest_follows: bool = False
    """A streamed transfer: ``header_bytes`` carry no digest; its last chunk goes on with ``Chunk.payload_digest``."""


class SharedArrival(NamedTuple):
    """An update in shared memory received and not yet verified: its publisher connection, the id its WEIGHT_ACK
    answers, and the update."""

    publisher: bytes
    reply_to: str
    update: StoredUpdate


@dataclass(frozen=True)
class IntakeBounds:
    """The bounds on the trainer's transfers in flight, checked at a first chunk before memory is set aside."""

    max_open_transfers: int = 8
    """Transfers being received at once, over all publishers."""
    transfer_timeout_s: float = 300.0
    """Longest a transfer may take from its first chunk to its last."""
    transfer_stall_timeout_s: float = 30.0
    """Longest a transfer may wait for its next chunk."""
    max_open_transfer_bytes: int | None = None
    """Declared bytes of all open transfers together (None: the frame limits' bound)."""
    max_open_transfers_per_publisher: int = 1
    """Open transfers per publisher connection; a new one replaces the oldest."""
    max_version_lead: int = 1024
    """How far ahead of the latest stored version an update may be."""
    evictable_after_s: float = 5.0
    """A transfer with no chunk for this long (or open this long and behind the pace that finishes it within
    ``transfer_timeout_s``) gives its place to a new transfer of another publisher connection when the bounds are
    reached (a publisher streams its chunks back to back)."""


@dataclass
class _OpenTransfer:
    """What the intake knows of one transfer being received: whose it is, what it declared, when it last moved."""

    publisher: bytes
    total_bytes: int
    started_s: float
    last_chunk_s: float
    received_bytes: int = 0

    def evictable(self, now_s: float, after_s: float, timeout_s: float) -> bool:
        """Stalled (no chunk for ``after_s``), or open that long and behind the pace that finishes it in time."""
        if now_s - self.last_chunk_s >= after_s:
            return True
        open_s = now_s - self.started_s
        return open_s >= after_s and self.received_bytes < self.total_bytes * min(1.0, open_s / timeout_s)


class WeightIntake:
    """See the module docstring (the bounds on open transfers are checked at a first chunk, before memory is kept)."""

    def __init__(
        self,
        fanout: WeightFanout,
        limits: framing.Limits,
        bounds: IntakeBounds = IntakeBounds(),
        *,
        forward_chunk_bytes: int | None = None,
    ):
        """``forward_chunk_bytes``: the largest chunk the plane forwards as it is; a transfer whose chunks are
        larger is forwarded once stored (re-chunked), not cut through."""
        self.fanout = fanout
        self.store = fanout.store
        self.max_version_lead = bounds.max_version_lead
        self.forward_chunk_bytes = forward_chunk_bytes or limits.max_frame_bytes
        self.limits = limits
        self.bounds = bounds
        self.max_open_bytes = (
            limits.max_transfer_bytes if bounds.max_open_transfer_bytes is None else bounds.max_open_transfer_bytes
        )
        # One assembler per publisher connection with open transfers; the intake holds the bounds over all of them.
        self._assemblers: dict[bytes, chunked_transfer.ChunkAssembler] = {}
        self._open: dict[tuple[str, str], _OpenTransfer] = {}
        self._hashers: dict[tuple[str, str], PayloadHasher] = {}
        # The update each open transfer is becoming (its chunks may be on their way to members already).
        self._incoming: dict[tuple[str, str], StoredUpdate] = {}
        # Transfers refused at one chunk: their later chunks are dropped without replies (bounded memory).
        self._refused_transfers: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._guard_log = RateLimitedLog(log)
        # The chunk ``digest_tee`` fed to a hasher in its checksum pass: (transfer key, chunk index, hasher).
        self._teed: tuple[tuple[str, str], int, PayloadHasher] | None = None
        # Updates in shared memory whose digest the broker has not checked yet, in arrival order.
        self._unverified: list[SharedArrival] = []

    def digest_tee(self, message_type: int, envelope: data_pb2.Envelope) -> PayloadHasher | None:
        """``framing.decode``'s ``tee``: the running content digest of the transfer a weight chunk belongs to, fed
        in the pass of the chunk's checksum (one read of the bytes for both); ``receive`` then skips its own
        update. None for anything else (single messages, transfers not open or refused)."""
        self._teed = None
        chunk = envelope.chunk
        if message_type != data_pb2.WEIGHT_UPDATE or chunk.count <= 1:
            return None
        key = (envelope.sender, chunk.transfer_id)
        if key in self._refused_transfers:
            return None
        if chunk.index == 0:
            header = data_pb2.WeightUpdateHeader.FromString(envelope.header)
            hasher = hasher_for(header.digest)
        else:
            hasher = self._hashers.get(key)
            if hasher is None:
                return None
        self._teed = (key, chunk.index, hasher)
        return hasher

    def forget_tee(self) -> None:
        """Before the next message is decoded: whatever ``digest_tee`` fed last was used or dropped."""
        self._teed = None

    def discard_tee(self) -> None:
        """The chunk ``digest_tee`` fed was refused (e.g. its checksum): its transfer's running digest is void."""
        if self._teed is not None:
            key, _, _ = self._teed
            self._teed = None
            self._drop(key)
            self._remember_refused(key)

    def receive(self, publisher: bytes, message: framing.Message) -> IntakeReply:
        """One WEIGHT_UPDATE message from ``publisher`` (its connection); see the module docstring."""
        envelope = message.envelope
        chunk = envelope.chunk
        header: data_pb2.WeightUpdateHeader = message.header
        if header.HasField("shared_segment"):
            return self._receive_shared(publisher, message)
        if chunk.count <= 1:
            payload = message.payload[0]
            checksums = [(framing.envelope_checksum(envelope), payload.nbytes)]
            update = StoredUpdate.of(header, payload)
            update.transit.received = ReceivedChunks(envelope.header, checksums, 1, payload.nbytes)
            return self._store(update, None)
        key = (envelope.sender, chunk.transfer_id)
        teed, self._teed = self._teed, None
        hashed = teed[1] == chunk.index and teed[0] == key if teed is not None else False
        if key in self._refused_transfers:
            return IntakeReply(None, refused=False)
        try:
            if chunk.index == 0:
                self._check_version_window(header)
                self.store.check_header(header)
                if chunk.total_bytes > self.limits.max_transfer_bytes:
                    raise framing.OversizedFrame(
                        f"transfer of {chunk.total_bytes} bytes exceeds the limit of {self.limits.max_transfer_bytes}"
                    )
                self._make_room(publisher, chunk.total_bytes)
            assembler = self._assemblers.get(publisher)
            if assembler is None:
                if chunk.index != 0:
                    raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} arrived before chunk 0")
                assembler = self._assemblers[publisher] = self._new_assembler()
            try:
                whole = assembler.add(message, publisher=publisher)
            finally:
                self._forget_closed(publisher, current=key)
            if whole is None:
                now_s = time.monotonic()
                if chunk.index == 0:
                    self._open[key] = _OpenTransfer(publisher, chunk.total_bytes, now_s, now_s)
                transfer = self._open[key]
                transfer.last_chunk_s = now_s
                transfer.received_bytes += message.payload[0].nbytes
            if chunk.index == 0:
                self._hashers[key] = teed[2] if hashed and teed is not None else hasher_for(header.digest)
                segments = assembler.received(key) if whole is None else whole.payload
                update = StoredUpdate(header=copy_header(header), segments=segments)
                update.transit.received = ReceivedChunks(
                    envelope.header, [], chunk.count, chunk.total_bytes, digest_follows=not header.digest
                )
                self._incoming[key] = update
            update = self._incoming[key]
            update.transit.received.checksums.append((framing.envelope_checksum(envelope), message.payload[0].nbytes))
            if not hashed:
                self._hashers[key].update(message.payload[0])
            if chunk.index == 0 and message.payload[0].nbytes <= self.forward_chunk_bytes:
                self.fanout.begin(update)
        except (WeightUpdateRefused, framing.FramingError) as exc:
            self._drop(key)
            self._remember_refused(key)
            return self._refusal(header, exc)
        if whole is None:
            return IntakeReply(None, refused=False, update=update)
        digest = self._hashers.pop(key).hexdigest()
        del self._incoming[key]
        # A streamed transfer's digest follows in its last chunk: from here on the update carries it.
        chunked_transfer.settle_payload_digest(update.header, chunk)
        return self._store(update, digest)

    def _receive_shared(self, publisher: bytes, message: framing.Message) -> IntakeReply:
        """An update whose payload lies in the trainer's shared-memory segment (``broker.shared_updates``): its
        header is checked as for bytes (order, lineage, version window, size) and the segment mapped read-only; the
        members on the segment's host for whom it is the next step start it at once (``WeightFanout.begin_in_place``:
        each checks the digest itself before serving). The broker's own digest pass, the store and the
        acknowledgement follow in ``verify_shared``, once the plane has sent them the descriptor: the same cut-
        through as chunks (a worker on another host gets nothing before the update is stored). A segment this broker
        cannot map (another host, a missing or foreign file) is refused with ``ERROR_CODE_NOT_FOUND``: the
        publisher sends the bytes."""
        header = copy_header(message.header)
        descriptor = data_pb2.SharedSegment()
        descriptor.CopyFrom(header.shared_segment)
        header.ClearField("shared_segment")
        try:
            if message.payload and message.payload[0].nbytes:
                raise framing.MalformedHeader("an update in shared memory carries no payload bytes")
            if not header.digest:
                raise framing.MalformedHeader("an update in shared memory needs its digest in the header")
            self._check_version_window(header)
            self.store.check_header(header)
            if header.payload_bytes > self.limits.max_transfer_bytes:
                raise framing.OversizedFrame(
                    f"update of {header.payload_bytes} bytes exceeds the limit of {self.limits.max_transfer_bytes}"
                )
            try:
                mapped = open_segment(descriptor, header.payload_bytes, writable_control=True)
            except SegmentError as exc:
                raise WeightUpdateRefused(common_pb2.ERROR_CODE_NOT_FOUND, f"{exc}; send the bytes") from None
        except (WeightUpdateRefused, framing.FramingError) as exc:
            return self._refusal(header, exc)
        update = StoredUpdate(
            header=header, segments=[mapped.payload.toreadonly()], shared=SharedPayload(mapped, descriptor)
        )
        self.fanout.begin_in_place(update)
        envelope = message.envelope
        self._unverified.append(SharedArrival(publisher, envelope.chunk.transfer_id or envelope.message_id, update))
        return IntakeReply(None, refused=False, update=update)

    @property
    def num_unverified(self) -> int:
        """Updates in shared memory waiting for ``verify_shared``."""
        return len(self._unverified)

    def verify_shared(self) -> list[tuple[SharedArrival, IntakeReply]]:
        """The broker's digest pass over each update in shared memory received since the last call, then the store
        (or the refusal): [(arrival, reply to send its publisher)]. A refused update, or a resend of one held
        already, releases its segment at once (nobody reads that generation through the broker)."""
        done = []
        pending, self._unverified = self._unverified, []
        for arrival in pending:
            update = arrival.update
            hasher = hasher_for(update.header.digest)
            for segment in update.segments:
                hasher.update(segment)
            reply = self._store(update, hasher.hexdigest())
            shared = update.shared
            assert shared is not None
            if reply.refused or not any(held is update for held in self.store.durable_chain()[1]):
                self.fanout.abort(update)
                update.segments.clear()
                shared.release()
                reply = reply._replace(update=None)
            done.append((arrival, reply))
        return done

    def _store(self, update: StoredUpdate, digest: str | None) -> IntakeReply:
        header = update.header
        try:
            self._check_version_window(header)
            result = self.fanout.put_update(update, computed_digest=digest)
        except WeightUpdateRefused as exc:
            self.fanout.abort(update)
            return self._refusal(header, exc)
        if result.duplicate:
            log.info("weight update already held; acknowledged again", update=result.update.describe())
        else:
            log.info(telemetry.WEIGHT_UPDATE_STORED, update=update.describe(), full_required=result.full_required)
            if result.previous_lineage:
                event = "policy rolled back" if result.rolled_back_from is not None else "policy lineage replaced"
                log.warning(
                    event,
                    policy_version=header.policy_version,
                    rolled_back_from=result.rolled_back_from,
                    lineage=header.lineage,
                    previous_lineage=result.previous_lineage,
                    lineage_base_version=header.lineage_base_version,
                    num_workers=self.fanout.counts().num_workers,
                )
        ack = data_pb2.WeightAck(
            policy_version=header.policy_version,
            worker_id=BROKER_SENDER,
            applied=True,
            full_required=result.full_required,
            lineage=self.store.lineage,
        )
        return IntakeReply(ack, refused=False, update=update)

    @property
    def num_open_transfers(self) -> int:
        """Transfers being received now, over all publisher connections."""
        return len(self._open)

    def expire(self, now_s: float) -> None:
        """Drop transfers that stalled or ran out of time, with their running hashes; members that were receiving
        them stop (``WeightFanout.abort``)."""
        for publisher, assembler in list(self._assemblers.items()):
            for transfer_id in assembler.expire(now_s):
                self._guard_log.warning(
                    "transfer expired", "incomplete weight transfer expired", transfer_id=transfer_id[:64]
                )
            self._forget_closed(publisher)

    def _new_assembler(self) -> chunked_transfer.ChunkAssembler:
        per_publisher = self.bounds.max_open_transfers_per_publisher
        return chunked_transfer.ChunkAssembler(
            limits=self.limits,
            max_open_transfers=per_publisher,
            timeout_s=self.bounds.transfer_timeout_s,
            stall_timeout_s=self.bounds.transfer_stall_timeout_s,
            max_open_bytes=self.max_open_bytes,
            max_open_per_publisher=per_publisher,
            zero_copy=True,
        )

    def _make_room(self, publisher: bytes, total_bytes: int) -> None:
        """Before a new transfer of ``publisher`` opens: make the bounds hold with it, evicting quiet transfers of
        other publishers (the quietest first), or raise ``BadChunk`` (too many open) / ``Busy`` (too many bytes)."""
        now_s = time.monotonic()
        own = [key for key, t in self._open.items() if t.publisher == publisher]
        # The publisher's own assembler replaces its oldest transfers beyond the per-publisher bound.
        replaced = set(own[: max(0, len(own) - self.bounds.max_open_transfers_per_publisher + 1)])
        while True:
            staying = {key: t for key, t in self._open.items() if key not in replaced}
            num_open = len(staying)
            open_bytes = sum(t.total_bytes for t in staying.values())
            too_many = num_open >= self.bounds.max_open_transfers
            too_big = open_bytes + total_bytes > self.max_open_bytes
            if not too_many and not too_big:
                return
            quiet = [
                (t.last_chunk_s, key)
                for key, t in staying.items()
                if t.publisher != publisher
                and t.evictable(now_s, self.bounds.evictable_after_s, self.bounds.transfer_timeout_s)
            ]
            if not quiet:
                if too_many:
                    raise framing.BadChunk(f"too many open transfers ({num_open}); finish or abandon one first")
                raise framing.Busy(
                    f"transfers being received already declare {open_bytes} bytes; {total_bytes} more would "
                    f"exceed the broker's {self.max_open_bytes} (max_open_transfer_bytes): retry later",
                    retry_after_ms=1000,
                )
            last_chunk_s, victim = min(quiet)
            self._guard_log.warning(
                "transfer evicted",
                "a stalled or slow weight transfer gave its place to a new one",
                transfer_id=victim[1][:64],
                quiet_s=round(now_s - last_chunk_s, 3),
            )
            self._evict(self._open[victim].publisher)

    def _evict(self, publisher: bytes) -> None:
        """Drop every open transfer of ``publisher`` (its assembler with them)."""
        self._assemblers.pop(publisher, None)
        self._forget_closed(publisher)

    def _forget_closed(self, publisher: bytes, current: tuple[str, str] | None = None) -> None:
        """Drop the intake's state of ``publisher``'s transfers that its assembler no longer holds (finished,
        refused, expired, replaced, evicted), and the assembler once it holds none. The ``current`` transfer (the
        one ``receive`` is handling) leaves ``_open`` only: ``receive`` finishes or drops its update itself."""
        assembler = self._assemblers.get(publisher)
        for key in [k for k, t in self._open.items() if t.publisher == publisher]:
            if assembler is None or not assembler.is_open(key):
                del self._open[key]
                if key != current:
                    self._drop(key)
        if assembler is not None and assembler.num_open_transfers == 0:
            del self._assemblers[publisher]

    def _drop(self, key: tuple[str, str]) -> None:
        self._hashers.pop(key, None)
        update = self._incoming.pop(key, None)
        if update is not None:
            self.fanout.abort(update)

    def _check_version_window(self, header: data_pb2.WeightUpdateHeader) -> None:
        """A version more than ``max_version_lead`` past the latest stored one is refused: accepted, it would
        make every later update of the real trainer look out of order."""
        latest = self.store.latest_version
        if latest is not None and header.policy_version > latest + self.max_version_lead:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"policy_version {header.policy_version} is more than {self.max_version_lead} "
                f"versions past the latest stored one ({latest})",
            )

    def _refusal(
        self, header: data_pb2.WeightUpdateHeader, exc: WeightUpdateRefused | framing.FramingError
    ) -> IntakeReply:
        detail, full_required = exc.detail(), isinstance(exc, WeightUpdateRefused) and exc.full_required
        self._guard_log.warning(
            ("update refused", detail.code),
            "weight update refused",
            policy_version=header.policy_version,
            code=framing.error_code_name(detail.code),
            error=detail.message[:300],
        )
        return IntakeReply(
            data_pb2.WeightAck(
                policy_version=header.policy_version,
                worker_id=BROKER_SENDER,
                applied=False,
                error=detail,
                full_required=full_required,
                lineage=self.store.newest_lineage,
            ),
            refused=True,
        )

    def _remember_refused(self, key: tuple[str, str]) -> None:
        self._refused_transfers[key] = None
        while len(self._refused_transfers) > MAX_REMEMBERED_REFUSALS:
            self._refused_transfers.popitem(last=False)
