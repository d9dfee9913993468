"""The weight fan-out core: the latest policy version, which version each inference worker holds, and what to send
it next. No sockets: ``WeightPlane`` drives it with socket events, the registry reads it.

One owner per fact:

- the latest policy is the head of the ``WeightStore``'s chain, which only ``put`` here changes (the plane hands it
  every whole update it received); before any update arrives after a broker restart it is the version the run
  state restored (``restore_latest``). ``latest()`` is what Register, Heartbeat, run status, the run state and the
  Prometheus gauge all answer; ``watch(callback)`` is told (outside the lock) whenever it changes.
- the version a worker holds is what it acknowledged (or declared in HELLO); ``worker_version(worker_id)`` is what
  ``RunStatus.workers[].policy_version`` shows.

Membership: a worker joins with HELLO and is forgotten when its peer disconnects, after ``max_retries`` missed or
failed acknowledgements in a row (it rejoins with its next HELLO), or when the registry says it is gone (LOST or
deregistered: ``leave``). A gone worker id never joins again: a LOST worker registers again under a new id, and its
new subscriber says HELLO with that id.

Per worker the core keeps a ``WeightMember`` (``weight_members``), planned with ``store.plan_for``. A worker that
does not acknowledge within ``ack_timeout_s`` is planned again from what it acknowledged.

Relay (``fanout="chain"``): members that start the same update at the same time form ``RelayChain``s (of at most
``relay_max_hops``); the plane sends each chunk to their heads only. ``weight_relay.RelayChains`` forms the chains
and heals them.

Thread-safe: one lock guards the state; callbacks (``watch``) run outside it, so a caller may hold its own lock
(the registry does) while it reads or calls ``leave``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from primerl.broker import weight_relay
from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_members import FanoutCounts, FanoutStep, Joined, WeightMember, WeightWorkerStatus
from primerl.broker.weight_store import PutResult, WeightStore
from primerl.proto import framing
from primerl.proto.v1 import common_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)

MAX_GONE_WORKERS = 4096
"""Ids of gone workers remembered (refused at HELLO); the oldest are dropped beyond this."""
FANOUT_MODES = ("star", "chain")
"""``star``: the broker sends every chunk to every worker; ``chain``: to the first worker of a relay chain."""


class LatestPolicy(NamedTuple):
    """The run's latest policy: its version (0: none yet), lineage, the version its lineage resumed from, and the
    number of rollbacks the store has seen."""

    version: int = 0
    lineage: int = 0
    lineage_base_version: int = 0
    num_rollbacks: int = 0


class WeightFanout:
    """See the module docstring."""

    def __init__(
        self,
        store: WeightStore,
        *,
        ack_timeout_s: float = 30.0,
        max_retries: int = 3,
        max_workers: int = 1024,
        fanout: str = "star",
        relay_timeout_s: float = 20.0,
        relay_max_hops: int = weight_relay.DEFAULT_MAX_HOPS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if ack_timeout_s <= 0 or max_retries < 0:
            raise ValueError("ack_timeout_s must be > 0 and max_retries >= 0")
        if fanout not in FANOUT_MODES:
            raise ValueError(f"fanout must be one of {', '.join(FANOUT_MODES)}, got {fanout!r}")
        if relay_timeout_s <= 0:
            raise ValueError(f"relay_timeout_s must be > 0, got {relay_timeout_s}")
        self.fanout = fanout
        self.relay_timeout_s = relay_timeout_s
        self._relays = weight_relay.RelayChains(fanout == "chain", relay_timeout_s, clock, relay_max_hops)
        self.store = store
        self.ack_timeout_s = ack_timeout_s
        self.max_retries = max_retries
        self.max_workers = max_workers
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, WeightMember] = {}
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._restored_version = 0
        self._num_forgotten = 0
        self._watchers: list[Callable[[], None]] = []

    def latest(self) -> LatestPolicy:
        """The run's latest policy (see the module docstring)."""
        version, lineage, lineage_base_version, num_rollbacks = self.store.latest_policy()
        if version is None:
            with self._lock:
                version = self._restored_version
        return LatestPolicy(version, lineage, lineage_base_version, num_rollbacks)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (no lock held) whenever ``latest()`` changes; it must be quick and thread-safe."""
        self._watchers.append(callback)

    def refuse_lineages_below(self, lineage: int) -> None:
        """The registry handed ``lineage`` to a new trainer incarnation: the store refuses older ones from now on."""
        self.store.refuse_lineages_below(lineage)

    def restore_latest(self, version: int) -> None:
        """The run state of an earlier broker says ``version`` was the latest: answered until the store holds one.
        Watchers are not told (the registry calls this while it restores that run state)."""
        with self._lock:
            self._restored_version = version

    def put_update(self, update: StoredUpdate, *, computed_digest: str | None = None) -> PutResult:
        """Store a whole update (``WeightStore.put_update``) and, unless it is one held already, plan every member
        again; ``latest()`` says the new version before this returns (before the publisher's ack is sent). Members
        may be receiving its chunks already (``begin``): they go on. A refused update is ``abort``ed, then the
        refusal (``WeightUpdateRefused``) is raised."""
        try:
            result = self.store.put_update(update, computed_digest=computed_digest)
        except WeightUpdateRefused:
            self.abort(update)
            raise
        if result.duplicate:
            return result
        with self._lock:
            for member in self._members.values():
                self._replan_locked(member)
        self._announce()
        return result

    def begin(self, update: StoredUpdate) -> int:
        """An update started arriving (its header passed ``store.check_header``): members with nothing else to send
        for whom it is the next step (``WeightMember.is_next_step``) start receiving it now, chunk by chunk as the
        chunks arrive, instead of after the last one (the plane sends only chunks that are in). Members busy with
        another update get it by the plan made when it is stored. Returns how many members started."""
        return self._begin(update, in_place_only=False)

    def begin_in_place(self, update: StoredUpdate) -> int:
        """``begin`` for the members that read ``update`` in place (``WeightMember.reads_in_place``) only: they are
        sent its descriptor before the broker's own digest check (each checks the digest before serving); the others
        get it once it is stored. Returns how many started."""
        return self._begin(update, in_place_only=True)

    def _begin(self, update: StoredUpdate, *, in_place_only: bool) -> int:
        with self._lock:
            starting = [
                member
                for member in self._members.values()
                if member.sending is None
                and not member.queue
                and (not in_place_only or member.reads_in_place(update))
                and member.is_next_step(update.header)
            ]
            self._relays.start(starting, update)
        return len(starting)

    def abort(self, update: StoredUpdate) -> None:
        """An update ``begin`` announced will not be stored (refused, abandoned, expired): members sending it stop
        (the plane never sent them its last chunk, so none holds it whole) and are planned again."""
        with self._lock:
            for member in self._members.values():
                if member.sending is update:
                    member.stop_sending()
                    self._replan_locked(member)

    def next_receivers(self, update: StoredUpdate) -> set[str]:
        """Members receiving ``update`` now, or next (nothing else before it)."""
        with self._lock:
            return {
                worker_id
                for worker_id, member in self._members.items()
                if member.sending is update or (member.sending is None and member.queue[:1] == [update])
            }

    def is_sending(self, update: StoredUpdate) -> bool:
        """Whether some member is in the middle of receiving ``update``."""
        with self._lock:
            return any(member.sending is update for member in self._members.values())

    def store_reloaded(self) -> None:
        """The store took back a durable chain (``WeightStore.attach_durable``): its head is the latest now."""
        self._announce()

    def _announce(self) -> None:
        for callback in self._watchers:
            try:
                callback()
            except Exception:
                log.exception("policy watcher failed")

    def hello(
        self,
        worker_id: str,
        version: int | None,
        lineage: int,
        *,
        reconnected: bool = False,
        relay_endpoint: str = "",
        host_id: str = "",
    ) -> Joined:
        """A worker says HELLO holding ``version`` (None: nothing) of ``lineage``; ``reconnected``: from another
        connection than the one it joined on (the old one is dropped); ``relay_endpoint``: where it takes relayed
        chunks (checked by ``valid_relay_endpoint``; "": none)."""
        with self._lock:
            if worker_id in self._gone:
                return Joined.GONE
            member = self._members.get(worker_id)
            if member is not None and not reconnected:
                member.relay_endpoint, member.host_id = relay_endpoint, host_id
                if member.acked_version == version and member.acked_lineage == lineage:
                    return Joined.REPEATED
                member.declare(version, lineage)
                self._replan_locked(member)
                return Joined.DECLARED
            if member is not None:
                log.info("weight subscriber reconnected; dropping its old connection", worker_id=worker_id)
                self._forget_locked(member, count=False)
            if len(self._members) >= self.max_workers:
                return Joined.FULL
            member = self._members[worker_id] = WeightMember(
                worker_id,
                acked_version=version,
                sent_version=version,
                acked_lineage=lineage,
                sent_lineage=lineage,
                last_progress_s=self._clock(),
                relay_endpoint=relay_endpoint,
                host_id=host_id,
            )
            log.info(
                "weight subscriber joined",
                worker_id=worker_id,
                policy_version=version,
                lineage=lineage,
                relay_endpoint=relay_endpoint or None,
            )
            self._replan_locked(member)
            return Joined.JOINED

    def leave(self, worker_id: str, reason: str) -> None:
        """The registry says the worker is gone (LOST, deregistered): no more pushes, and no HELLO of this id is
        taken again."""
        with self._lock:
            self._gone[worker_id] = None
            while len(self._gone) > MAX_GONE_WORKERS:
                self._gone.popitem(last=False)
            member = self._members.get(worker_id)
            if member is not None:
                self._forget_locked(member, reason=reason)

    def forget(self, worker_id: str, reason: str, *, count: bool = True) -> None:
        """Drop a member (its peer disconnected: ``reason`` is logged; ``count``: in ``num_forgotten``); it rejoins
        with its next HELLO."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is not None:
                self._forget_locked(member, reason=reason, count=count)

    def reads_in_place(self, worker_id: str, update: StoredUpdate) -> bool:
        """``worker_id`` is sent ``update`` as a shared-memory descriptor (``WeightMember.reads_in_place``)."""
        with self._lock:
            member = self._members.get(worker_id)
            return member is not None and member.reads_in_place(update)

    def member_ids(self) -> list[str]:
        with self._lock:
            return list(self._members)

    def is_member(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._members

    def ack(
        self, worker_id: str, version: int, lineage: int, *, applied: bool, error: common_pb2.ErrorDetail | None = None
    ) -> bool | None:
        """A member acknowledged ``version`` (``applied``) or failed to apply it. None: not a member (it must say
        HELLO); False: it was forgotten (too many failures in a row); True: taken."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                return None
            member.last_progress_s = self._clock()
            if applied:
                member.relay_ok = True
                taken = self._applied_locked(member, version, lineage)
                if not member.unacked:  # a relayed update still unacknowledged keeps its deadline
                    member.relay_deadline_s = None
                return taken
            member.relay_deadline_s = None
            detail = error or common_pb2.ErrorDetail()
            if detail.code == common_pb2.ERROR_CODE_NOT_FOUND and member.shared_ok:
                member.shared_ok = False  # it cannot map the trainer's segments: bytes from now on
                log.warning(
                    "weight subscriber cannot map shared memory; it is sent bytes from now on",
                    worker_id=worker_id,
                    error=detail.message[:300],
                )
                member.resend_from_acked()
            else:
                log.warning(
                    "weight subscriber failed to apply an update; it will get the full snapshot",
                    worker_id=worker_id,
                    policy_version=version,
                    code=framing.error_code_name(detail.code),
                    error=detail.message[:300],
                )
                member.retries += 1
                if member.retries > self.max_retries:
                    self._forget_locked(member, reason=f"failed to apply updates {member.retries} times in a row")
                    return False
                member.unacked.clear()
                member.sent_version, member.sent_lineage = None, 0  # unknown state: start again from the snapshot
            self._replan_locked(member)
            return True

    def _applied_locked(self, member: WeightMember, version: int, lineage: int) -> bool:
        if member.acknowledged(version, lineage):
            return True
        if any(entry[0] == version for entry in member.unacked):
            # Sent (v, new lineage), acknowledged (v, another lineage): it kept the weights it had.
            member.retries += 1
            log.warning(
                "weight subscriber kept another lineage's weights of the version it was sent",
                worker_id=member.worker_id,
                policy_version=version,
                lineage=lineage,
                sent_lineage=next(entry[1] for entry in member.unacked if entry[0] == version),
                attempt=member.retries,
            )
            if member.retries > self.max_retries:
                self._forget_locked(
                    member, reason=f"did not load lineage {self.store.lineage} after {member.retries} tries"
                )
                return False
        else:
            member.retries = 0
        member.declare(version, lineage)
        self._replan_locked(member)
        return True

    def with_something_to_send(self) -> list[str]:
        """The members that ``next_step`` may name something for (an update planned or being sent), in one pass
        under the lock: the plane asks only them, not every member at every turn of its loop."""
        with self._lock:
            return [worker_id for worker_id, member in self._members.items() if member.queue or member.sending]

    def next_step(self, worker_id: str) -> FanoutStep | None:
        """What to send the member next, or None (nothing to send, not a member, or it receives by relay). A member
        that starts its next planned update takes along, in chain mode, every idle member whose next planned
        update is the same: they form one chain, in the order they joined (its head may be another member)."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                return None
            if member.sending is None:
                if not member.queue:
                    return None
                update = member.queue[0]
                together = [member]
                if self._relays.enabled:
                    together = weight_relay.starting_together(member, self._members.values(), update)
                for starting in together:
                    starting.queue.pop(0)
                self._relays.start(together, update)
            chain = member.chain
            if chain is not None and chain.hops[0] != member.worker_id:
                return None  # its chunks come from the member before it
            return FanoutStep(member.sending, member.next_chunk, chain)

    def chunk_sent(self, worker_id: str, update: StoredUpdate, *, last: bool) -> None:
        """The chunk ``next_step`` named went out; ``last``: it was the update's last one (for a chain's head: every
        member of the chain now counts as sent it, each due to acknowledge within ``relay_timeout_s``)."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is None or member.sending is not update:
                return
            member.next_chunk += 1
            chain, now_s = member.chain, self._clock()
            if chain is not None:
                chain.last_progress_s = now_s
            if not last:
                return
            relayed = [] if chain is None else [self._members.get(hop) for hop in chain.hops[1:]]
            for place, done in enumerate([member, *relayed]):
                if done is None or done.sending is not update or done.chain is not chain:
                    continue
                done.sent_whole(update, now_s)
                if chain is not None and not chain.dissolved:
                    done.relay_deadline_s = now_s + self.relay_timeout_s
                    done.relay_place = (chain.number, place)

    def tick(self, now_s: float | None = None) -> None:
        """Members whose acknowledgement is overdue are planned again from what they acknowledged (at most
        ``max_retries`` times in a row; then forgotten until their next HELLO)."""
        now_s = self._clock() if now_s is None else now_s
        with self._lock:
            for member in self._relays.heal(self._members, now_s):
                self._replan_locked(member)
            for member in list(self._members.values()):
                if not (
                    member.unacked and member.sending is None and now_s - member.last_progress_s > self.ack_timeout_s
                ):
                    continue
                member.retries += 1
                if member.retries > self.max_retries:
                    self._forget_locked(
                        member, reason=f"no WEIGHT_ACK for v{member.unacked[-1][0]} after {member.retries} tries"
                    )
                    continue
                log.warning(
                    "no WEIGHT_ACK in time; sending the plan again",
                    worker_id=member.worker_id,
                    awaited_version=member.unacked[-1][0],
                    acked_version=member.acked_version,
                    attempt=member.retries,
                )
                member.resend_from_acked()
                member.last_progress_s = now_s
                self._replan_locked(member)

    def worker_version(self, worker_id: str) -> int | None:
        """The version the member acknowledged (or declared); None: not a member, or nothing yet."""
        with self._lock:
            member = self._members.get(worker_id)
            return None if member is None else member.acked_version

    def worker_versions(self) -> dict[str, int | None]:
        """worker_id -> the policy version it last acknowledged (None: none yet), for every member."""
        with self._lock:
            return {worker_id: member.acked_version for worker_id, member in self._members.items()}

    def workers(self) -> tuple[WeightWorkerStatus, ...]:
        with self._lock:
            return tuple(member.status() for member in self._members.values())

    def counts(self) -> FanoutCounts:
        with self._lock:
            relays = self._relays
            return FanoutCounts(len(self._members), self._num_forgotten, relays.num_chains, relays.num_heals)

    def _replan_locked(self, member: WeightMember) -> None:
        sending = member.sending  # plan from the update being sent, else from what it will hold
        if sending is not None:
            member.queue = self.store.plan_for(sending.policy_version, sending.lineage)
        else:
            member.queue = self.store.plan_for(member.sent_version, member.sent_lineage)

    def _forget_locked(self, member: WeightMember, *, reason: str = "", count: bool = True) -> None:
        chain = member.chain
        del self._members[member.worker_id]
        if chain is not None and not chain.dissolved and member.sending is not None:
            for stopped in self._relays.dissolve(chain, self._members, reason=f"{member.worker_id} left it"):
                self._replan_locked(stopped)
        if count:
            self._num_forgotten += 1
        if reason:
            log.warning(
                "weight subscriber forgotten",
                worker_id=member.worker_id,
                reason=reason,
                policy_version=member.acked_version,
            )
