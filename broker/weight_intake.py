"""The trainer's side of the weight plane, without sockets: WEIGHT_UPDATE transfers in, WEIGHT_ACKs out.

``WeightIntake.receive(publisher, message)`` takes one decoded WEIGHT_UPDATE message (a whole update or one chunk
of a transfer) and answers an ``IntakeReply``: the WEIGHT_ACK to send back (None while a transfer is unfinished,
and for later chunks of a refused one) and the update the message belongs to, whose chunks the plane may forward.

- chunks are kept as they arrived (``ChunkAssembler(zero_copy=True)``: no reassembly, no copy) and hashed
  (``proto.digests``, XXH3-128) as they arrive, so the store never makes a second pass over the payload; the header
  bytes and the verified checksum of each chunk are kept with the update (``cache["received"]``), so forwarding
  reuses them;
- cut-through: at a transfer's first chunk the update already exists (``StoredUpdate`` with a growing list of
  segments) and ``WeightFanout.begin`` has the members for whom it is the next step receive its chunks as they
  come; the last chunk is forwarded only once the whole update is stored, so a worker never holds an update the
  broker refused, and a refused, abandoned or expired one is ``WeightFanout.abort``ed;
- a transfer whose header is refusable (``WeightStore.check_header``, or a version more than
  ``max_version_lead`` past the latest) is refused at its first chunk;
- a whole update goes to ``WeightFanout.put_update`` (stored, every worker planned again); the ack says
  ``applied=true`` (stored, or held already: a resend), or ``applied=false`` with an ``ErrorDetail`` (refused,
  nothing changed); ``full_required``: the next update must be FULL.

Run by the plane's IO thread only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_store import StoredUpdate, copy_header
from primerl.proto import chunked_transfer, framing, telemetry
from primerl.proto.digests import PayloadHasher, hasher_for
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


class WeightIntake:
    """See the module docstring. The transfer limits are checked at a first chunk, before memory is set aside:
    declared size, total declared bytes of open transfers, open transfers per publisher connection (a new one
    replaces the oldest), and a short stall timeout, so one peer cannot block another's publishing for long."""

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
        self._assembler = chunked_transfer.ChunkAssembler(
            limits=limits,
            max_open_transfers=bounds.max_open_transfers,
            timeout_s=bounds.transfer_timeout_s,
            stall_timeout_s=bounds.transfer_stall_timeout_s,
            max_open_bytes=bounds.max_open_transfer_bytes,
            max_open_per_publisher=bounds.max_open_transfers_per_publisher,
            zero_copy=True,
        )
        self._hashers: dict[tuple[str, str], PayloadHasher] = {}
        # The update each open transfer is becoming (its chunks may be on their way to members already).
        self._incoming: dict[tuple[str, str], StoredUpdate] = {}
        # Transfers refused at one chunk: their later chunks are dropped without replies (bounded memory).
        self._refused_transfers: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._guard_log = RateLimitedLog(log)

    def receive(self, publisher: bytes, message: framing.Message) -> IntakeReply:
        """One WEIGHT_UPDATE message from ``publisher`` (its connection); see the module docstring."""
        envelope = message.envelope
        chunk = envelope.chunk
        header: data_pb2.WeightUpdateHeader = message.header
        if chunk.count <= 1:
            update = StoredUpdate.of(header, message.payload[0])
            update.cache["received"] = ReceivedChunks(
                envelope.header,
                [(framing.envelope_checksum(envelope), message.payload[0].nbytes)],
                1,
                message.payload[0].nbytes,
            )
            return self._store(update, None)
        key = (envelope.sender, chunk.transfer_id)
        if key in self._refused_transfers:
            return IntakeReply(None, refused=False)
        try:
            if chunk.index == 0:
                self._check_version_window(header)
                self.store.check_header(header)
            whole = self._assembler.add(message, publisher=publisher)
            if chunk.index == 0:
                self._hashers[key] = hasher_for(header.digest)
                segments = self._assembler.received(key) if whole is None else whole.payload
                update = StoredUpdate(header=copy_header(header), segments=segments)
                update.cache["received"] = ReceivedChunks(envelope.header, [], chunk.count, chunk.total_bytes)
                self._incoming[key] = update
            update = self._incoming[key]
            update.cache["received"].checksums.append((framing.envelope_checksum(envelope), message.payload[0].nbytes))
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
        return self._store(update, digest)

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
                    num_workers=self.fanout.num_workers,
                )
        ack = data_pb2.WeightAck(
            policy_version=header.policy_version,
            worker_id=BROKER_SENDER,
            applied=True,
            full_required=result.full_required,
            lineage=self.store.lineage,
        )
        return IntakeReply(ack, refused=False, update=update)

    def expire(self, now_s: float) -> None:
        """Drop transfers that stalled or ran out of time, with their running hashes; members that were receiving
        them stop (``WeightFanout.abort``)."""
        for transfer_id in self._assembler.expire(now_s):
            self._guard_log.warning(
                "transfer expired", "incomplete weight transfer expired", transfer_id=transfer_id[:64]
            )
            for key in [k for k in self._hashers if k[1] == transfer_id]:
                self._drop(key)
        # Transfers replaced by a newer one of the same publisher: drop them too.
        for key in [k for k in self._hashers if not self._assembler.is_open(k)]:
            self._drop(key)

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

    def _refusal(self, header: data_pb2.WeightUpdateHeader, exc: Exception) -> IntakeReply:
        if isinstance(exc, WeightUpdateRefused):
            detail, full_required = exc.detail(), exc.full_required
        else:
            assert isinstance(exc, framing.FramingError)
            detail, full_required = exc.detail(), False
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
                lineage=self.store.lineage,
            ),
            refused=True,
        )

    def _remember_refused(self, key: tuple[str, str]) -> None:
        self._refused_transfers[key] = None
        while len(self._refused_transfers) > MAX_REMEMBERED_REFUSALS:
            self._refused_transfers.popitem(last=False)
