"""What the weight fan-out keeps per inference worker (``WeightMember``, changed only under ``WeightFanout``'s lock)
and the values it answers about its members: a HELLO's outcome, the next step to send, a worker's status, counts."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from primerl.broker.stored_update import StoredUpdate
from primerl.proto.v1 import data_pb2

if TYPE_CHECKING:
    from primerl.broker.weight_relay import RelayChain


class FanoutStep(NamedTuple):
    """What to send a member next: chunk ``index`` of ``update``, to be relayed along ``chain`` (None: to it alone)."""

    update: StoredUpdate
    index: int
    chain: RelayChain | None


class FanoutCounts(NamedTuple):
    """Members now and forgotten so far; relay chains formed, and members sent an update again because their relay
    did not reach them in time."""

    num_workers: int
    num_forgotten: int
    num_relay_chains: int
    num_relay_heals: int


class Joined(Enum):
    """What a HELLO did."""

    JOINED = "joined"  # a new member (or one that reconnected)
    DECLARED = "declared"  # a member said it holds another version than we knew
    REPEATED = "repeated"  # a keep-alive: nothing changed
    FULL = "full"  # refused: ``max_workers`` members already
    GONE = "gone"  # refused: the registry said this worker is gone (it must register again)


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


@dataclass
class WeightMember:
    """The (version, lineage) a worker acknowledged and the one it will hold once it applied everything sent
    (planning starts there), the updates planned for it (``queue``), the one being sent and its next chunk, and the
    updates sent but not acknowledged yet."""

    worker_id: str
    acked_version: int | None
    # The version the worker will hold once it applied everything already sent to it.
    sent_version: int | None
    # The lineages of those two versions (0: unknown).
    acked_lineage: int = 0
    sent_lineage: int = 0
    sending: StoredUpdate | None = None
    next_chunk: int = 0
    queue: list[StoredUpdate] = field(default_factory=list)
    # (version, lineage) of each update sent and not acknowledged yet, in order.
    unacked: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    last_progress_s: float = 0.0
    retries: int = 0
    # Where it takes relayed chunks ("": it relays nothing); False after it held up a chain, until it acknowledges.
    relay_endpoint: str = ""
    relay_ok: bool = True
    # The chain it receives ``sending`` through (as its head, the plane sends it the chunks; else nothing).
    chain: RelayChain | None = None
    # While its last update arrived by relay: when its acknowledgement is overdue, and (chain number, its place).
    relay_deadline_s: float | None = None
    relay_place: tuple[int, int] = (0, 0)
    # The host whose shared memory it maps (``Hello.host_id``; "": none), and False once it could not map a segment.
    host_id: str = ""
    shared_ok: bool = True

    @property
    def can_relay(self) -> bool:
        return bool(self.relay_endpoint) and self.relay_ok

    def reads_in_place(self, update: StoredUpdate) -> bool:
        """It is sent ``update`` as a shared-memory descriptor (same host as the trainer's segment), not as bytes."""
        shared = update.shared
        return shared is not None and not shared.released and self.shared_ok and self.host_id == shared.host_id

    def relays(self, update: StoredUpdate) -> bool:
        """It may take ``update`` through a relay chain (it relays, and is not sent a descriptor)."""
        return self.can_relay and not self.reads_in_place(update)

    def is_next_step(self, header: data_pb2.WeightUpdateHeader) -> bool:
        """A FULL or LORA update newer than what it will hold (or of a newer lineage); a DELTA on exactly the version
        and lineage it will hold."""
        version, lineage = self.sent_version, self.sent_lineage
        if header.kind == data_pb2.WEIGHT_UPDATE_KIND_DELTA:
            return version == header.base_version and (lineage == header.lineage or not lineage or not header.lineage)
        if lineage and header.lineage and header.lineage != lineage:
            return header.lineage > lineage
        return version is None or header.policy_version > version

    def stop_sending(self) -> None:
        self.sending, self.next_chunk, self.chain = None, 0, None

    def sent_whole(self, update: StoredUpdate, now_s: float) -> None:
        """It was sent (or relayed) ``update``'s last chunk: due to acknowledge it."""
        self.sending, self.chain = None, None
        self.sent_version, self.sent_lineage = update.policy_version, update.lineage
        self.unacked.append((update.policy_version, update.lineage))
        self.last_progress_s = now_s

    def declare(self, version: int | None, lineage: int) -> None:
        """The worker says it holds ``version`` of ``lineage`` (not one we sent it): plan from there."""
        self.acked_version = self.sent_version = version
        self.acked_lineage = self.sent_lineage = lineage
        self.unacked.clear()

    def resend_from_acked(self) -> None:
        """What was sent and not acknowledged counts as lost: plan again from what it acknowledged."""
        self.unacked.clear()
        self.sent_version, self.sent_lineage = self.acked_version, self.acked_lineage

    def acknowledged(self, version: int, lineage: int) -> bool:
        """An applied acknowledgement of ``version`` (of ``lineage``; 0: any) of an update sent to it: it holds that
        one, and the ones sent before it are settled. False: it was sent no such update."""
        sent = next(
            (entry for entry in self.unacked if entry[0] == version and (lineage == entry[1] or not lineage)), None
        )
        if sent is None:
            return False
        self.retries = 0
        while self.unacked and self.unacked.popleft() != sent:
            pass
        self.acked_version, self.acked_lineage = sent
        return True

    def status(self) -> WeightWorkerStatus:
        return WeightWorkerStatus(
            worker_id=self.worker_id,
            policy_version=self.acked_version,
            num_pending=len(self.queue) + (self.sending is not None),
            num_unacked=len(self.unacked),
            num_retries=self.retries,
            lineage=self.acked_lineage,
        )
