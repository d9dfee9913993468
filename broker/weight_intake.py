"""The trainer's side of the weight plane, without sockets: WEIGHT_UPDATE transfers in, WEIGHT_ACKs out.

``WeightIntake.receive(publisher, message)`` takes one decoded WEIGHT_UPDATE message (a whole update or one chunk
of a transfer) and answers the WEIGHT_ACK to send back, or None (a chunk of an unfinished transfer, or a later
chunk of a refused one, which gets no further reply):

- chunks are reassembled by a bounded ``chunked_transfer.ChunkAssembler`` and hashed (SHA-256) as they arrive, so
  the store never makes a second pass over the payload; the header bytes and the verified CRC-32 of each chunk
  are kept with the stored update (``cache["received"]``), so forwarding can reuse them;
- a transfer whose header is refusable (``WeightStore.check_header``, or a version more than
  ``max_version_lead`` past the latest) is refused at its first chunk;
- a whole update goes to ``WeightFanout.put`` (stored, every worker planned again); the ack says
  ``applied=true`` (stored, or held already: a resend), or ``applied=false`` with an ``ErrorDetail`` (refused,
  nothing changed); ``full_required``: the next update must be FULL.

Run by the plane's IO thread only.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.weight_fanout import WeightFanout
from primerl.proto import chunked_transfer, framing
from primerl.proto.digests import hasher_for
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)

BROKER_SENDER = "broker"
"""``envelope.sender`` and ``WeightAck.worker_id`` of everything the broker's weight plane sends."""
MAX_REMEMBERED_REFUSALS = 256


class IntakeReply(NamedTuple):
    """The WEIGHT_ACK to send the publisher, and whether it refuses the update."""

    ack: data_pb2.WeightAck
    refused: bool


class WeightIntake:
    """See the module docstring. The transfer limits are checked at a first chunk, before memory is set aside:
    declared size, total declared bytes of open transfers, open transfers per publisher connection (a new one
    replaces the oldest), and a short stall timeout, so one peer cannot block another's publishing for long."""

    def __init__(self, fanout: WeightFanout, limits: framing.Limits, *, max_open_transfers: int = 8,
                 transfer_timeout_s: float = 300.0, transfer_stall_timeout_s: float = 30.0,
                 max_open_transfer_bytes: int | None = None, max_open_transfers_per_publisher: int = 1,
                 max_version_lead: int = 1024):
        self.fanout = fanout
        self.store = fanout.store
        self.max_version_lead = max_version_lead
        self._assembler = chunked_transfer.ChunkAssembler(
            limits=limits, max_open_transfers=max_open_transfers, timeout_s=transfer_timeout_s,
            stall_timeout_s=transfer_stall_timeout_s, max_open_bytes=max_open_transfer_bytes,
            max_open_per_publisher=max_open_transfers_per_publisher)
        self._hashers: dict[tuple[str, str], Any] = {}
        # Verified CRC-32 and size of each chunk received so far, per open transfer.
        self._chunk_crcs: dict[tuple[str, str], list[tuple[int, int]]] = {}
        # Transfers refused at one chunk: their later chunks are dropped without replies (bounded memory).
        self._refused_transfers: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._guard_log = RateLimitedLog(log)

    def receive(self, publisher: bytes, message: framing.Message) -> IntakeReply | None:
        """One WEIGHT_UPDATE message from ``publisher`` (its connection); the reply to send, or None."""
        envelope = message.envelope
        chunk = envelope.chunk
        header: data_pb2.WeightUpdateHeader = message.header
        whole: framing.Message | None = message
        digest: str | None = None
        if chunk.count > 1:
            key = (envelope.sender, chunk.transfer_id)
            if key in self._refused_transfers:
                return None
            try:
                if chunk.index == 0:
                    self._check_version_window(header)
                    self.store.check_header(header)
                    self._hashers[key] = hasher_for(header.digest)
                    self._chunk_crcs[key] = []
                whole = self._assembler.add(message, publisher=publisher)
                if key in self._chunk_crcs:
                    self._chunk_crcs[key].append((framing.envelope_checksum(envelope), message.payload[0].nbytes))
                hasher = self._hashers.get(key)
                if hasher is not None:
                    hasher.update(message.payload[0])
            except (WeightUpdateRefused, framing.FramingError) as exc:
                self._hashers.pop(key, None)
                self._chunk_crcs.pop(key, None)
                self._remember_refused(key)
                return self._refusal(header, exc)
            if whole is None:
                return None
            hasher = self._hashers.pop(key, None)
            digest = None if hasher is None else hasher.hexdigest()
            chunk_crcs = self._chunk_crcs.pop(key, None)
        else:
            chunk_crcs = [(framing.envelope_checksum(envelope), whole.payload[0].nbytes)]
        try:
            self._check_version_window(header)
            result = self.fanout.put(header, whole.payload[0], computed_digest=digest)
        except WeightUpdateRefused as exc:
            return self._refusal(header, exc)
        if result.duplicate:
            log.info("weight update already held; acknowledged again", update=result.update.describe())
        else:
            if chunk_crcs is not None:
                # The exact header bytes and verified chunk CRCs it arrived with: forwarding costs no CRC pass.
                result.update.cache["received"] = (envelope.header, chunk_crcs)
            log.info("weight update stored", update=result.update.describe(), full_required=result.full_required)
            if result.previous_lineage:
                event = "policy rolled back" if result.rolled_back_from is not None else "policy lineage replaced"
                log.warning(event, policy_version=header.policy_version, rolled_back_from=result.rolled_back_from,
                            lineage=header.lineage, previous_lineage=result.previous_lineage,
                            lineage_base_version=header.lineage_base_version, num_workers=self.fanout.num_workers)
        return IntakeReply(data_pb2.WeightAck(policy_version=header.policy_version, worker_id=BROKER_SENDER,
                                              applied=True, full_required=result.full_required,
                                              lineage=self.store.lineage), refused=False)

    def expire(self, now_s: float) -> None:
        """Drop transfers that stalled or ran out of time, with their running hashes."""
        for transfer_id in self._assembler.expire(now_s):
            self._guard_log.warning("transfer expired", "incomplete weight transfer expired", transfer_id=transfer_id[:64])
            for key in [k for k in self._hashers if k[1] == transfer_id]:
                del self._hashers[key]
                self._chunk_crcs.pop(key, None)
        # Transfers replaced by a newer one of the same publisher: drop their running hashes too.
        for key in [k for k in self._hashers if not self._assembler.is_open(k)]:
            del self._hashers[key]
            self._chunk_crcs.pop(key, None)

    def _check_version_window(self, header: data_pb2.WeightUpdateHeader) -> None:
        """A version more than ``max_version_lead`` past the latest stored one is refused: accepted, it would
        make every later update of the real trainer look out of order."""
        latest = self.store.latest_version
        if latest is not None and header.policy_version > latest + self.max_version_lead:
            raise WeightUpdateRefused(common_pb2.ERROR_CODE_OUT_OF_ORDER,
                                      f"policy_version {header.policy_version} is more than {self.max_version_lead} "
                                      f"versions past the latest stored one ({latest})")

    def _refusal(self, header: data_pb2.WeightUpdateHeader, exc: Exception) -> IntakeReply:
        if isinstance(exc, WeightUpdateRefused):
            detail, full_required = exc.detail(), exc.full_required
        else:
            assert isinstance(exc, framing.FramingError)
            detail, full_required = exc.detail(), False
        self._guard_log.warning(("update refused", detail.code), "weight update refused",
                                policy_version=header.policy_version, code=framing.error_code_name(detail.code),
                                error=detail.message[:300])
        return IntakeReply(data_pb2.WeightAck(policy_version=header.policy_version, worker_id=BROKER_SENDER,
                                              applied=False, error=detail, full_required=full_required,
                                              lineage=self.store.lineage), refused=True)

    def _remember_refused(self, key: tuple[str, str]) -> None:
        self._refused_transfers[key] = None
        while len(self._refused_transfers) > MAX_REMEMBERED_REFUSALS:
            self._refused_transfers.popitem(last=False)
