"""The rollout queue: which spooled batch goes to which trainer session, and when producers must wait.

Pure logic over a ``RolloutSpool`` (no sockets), so tests drive it directly and the IO layer (``rollout_plane.py``)
only translates messages into calls and results into messages. What an offered batch is answered is the admission
law (``rollout_admission``): ``Accepted`` once spooled durably, ``Duplicate``/``Stale``/``Superseded`` (acked again,
nothing kept), ``Backpressure`` (nothing kept, resend later) or ``Refused`` (a clear error). Nothing is dropped
without the producer being told. What a trainer session is given: ``rollout_sessions``; which producer incarnation's
set of a step is served (atomic steps): ``rollout_steps``.

- Batches leave the spool only through ``release_through(step)`` (the trainer committed ``step``).
- The bounds (``max_batches``, ``max_bytes``) count the batches *ahead of the trainers*: those no session has been
  given yet, other than batches of a step a session is asking for now. Batches already given stay on disk until the
  commit (a checkpoint, maybe many steps later) without blocking producers, so the bound limits how far the
  orchestrator runs ahead, and disk use is bounded by the checkpoint interval times one step. The bound holds however
  the requested steps move: a batch counts until a session is given it, so requests that jump ahead (and leave
  batches behind that nobody asks for) do not make room.

Disk full: a group whose spool write fails for lack of space (ENOSPC, EDQUOT) keeps nothing and each of its batches
is answered ``Backpressure`` with the reason, so producers wait and resend; nothing on disk changes (the temporary
files go) and the broker serves on. A commit on a full disk deletes the released batches before it writes its marker
when the marker cannot be written first.

Group commit: ``offer_many`` decides a group of batches in order (each sees the ones before it, as if offered one by
one), spools the accepted ones together (``RolloutSpool.put_many``: one fsync per file, one directory fsync) and only
then returns; the caller acks after that, so no ack precedes durability. If the spool write fails, none of the group
is kept and the error is raised for the whole group.

Thread-safety: one lock around all state; the IO thread calls ``offer``/``offer_many``/``request``, gRPC threads
call ``release_through`` and ``status``. Spool writes happen under the lock, spool reads for sending (``read_record``)
outside it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from primerl.broker.rollout_admission import QueueRoom, admit, check_header, spooled_size_bytes
from primerl.broker.rollout_results import (
    Accepted,
    Backpressure,
    Delivery,
    Duplicate,
    GroupResult,
    OfferItem,
    OfferResult,
    Refused,
    RolloutQueueStatus,
    Stale,
    Superseded,
)
from primerl.broker.rollout_sessions import ConsumerSessions, Session
from primerl.broker.rollout_steps import StepIndex
from primerl.broker.spool import RolloutSpool, SpoolCorruption, SpoolFull, is_disk_full
from primerl.proto import telemetry
from primerl.proto.batch_ids import default_batch_id, parse_producer_batch_id
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.rollout_queue")

DEFAULT_RETRY_AFTER_MS = 100
DEFAULT_MAX_SESSIONS = 256
# Steps beyond the run's position (the highest step a trainer asked for, or the committed step) that a
# request or a batch may name. Without it one request for step 2**64-1 would move the frontier so far that
# every batch counts as "asked for" and the queue bound stops holding.
DEFAULT_MAX_STEP_LEAD = 1024
# Producers wait at least this long before resending into a full disk.
DISK_FULL_RETRY_AFTER_MS = 1000
# The count each answer moves (``Accepted`` is counted once its group is durable).
_COUNTED = {Duplicate: "duplicates", Stale: "duplicates", Superseded: "superseded", Backpressure: "backpressured"}


class RolloutQueue:
    def __init__(
        self,
        spool: RolloutSpool,
        max_batches: int,
        max_bytes: int,
        *,
        retry_after_ms: int = DEFAULT_RETRY_AFTER_MS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_step_lead: int = DEFAULT_MAX_STEP_LEAD,
    ):
        if max_batches < 1 or max_bytes < 1:
            raise ValueError(f"max_batches ({max_batches}) and max_bytes ({max_bytes}) must be >= 1")
        if max_step_lead < 1:
            raise ValueError(f"max_step_lead must be >= 1, got {max_step_lead}")
        self.max_step_lead = max_step_lead
        self.spool = spool
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.retry_after_ms = retry_after_ms
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._steps = StepIndex()
        self._disk_full_since_s: float | None = None
        self._sessions = ConsumerSessions(max_sessions)
        self._counts = dict.fromkeys(
            ("accepted", "duplicates", "backpressured", "released", "superseded", "disk_full"), 0
        )
        # Highest step any consumer session asked for (-1: none yet, e.g. right after a broker restart).
        self._frontier_step = -1
        # Spooled batches handed to a session at least once: they no longer count against the bounds.
        self._given: set[str] = set()
        self._load()

    # ------------------------------------------------------------------ producer side

    def offer(
        self,
        header: data_pb2.RolloutBatchHeader,
        payload: Any,
        *,
        header_bytes: bytes | None = None,
        crc32: int | None = None,
    ) -> OfferResult:
        """Spool one batch and serve pending requests with it; see the module docstring for the outcomes.

        ``header_bytes``/``crc32``: the exact serialized header the payload's verified envelope checksum
        covers, to spool without recomputing the CRC (only used when the header needs no change).
        """
        group = self.offer_many([OfferItem(header, payload, header_bytes, crc32)])
        result = group.results[0]
        if isinstance(result, Accepted):
            return Accepted(result.batch_id, result.step, group.deliveries)
        return result

    def offer_many(self, items: list[OfferItem]) -> GroupResult:
        """Decide a group of batches in order, spool the accepted ones durably together (group commit), then serve
        pending requests with them. Raises ``SpoolError`` (nothing of the group kept) when the spool cannot write."""
        prepared = [_named(item) for item in items]
        with self._lock:
            results: list[OfferResult] = []
            accepted: list[tuple[data_pb2.RolloutBatchHeader, Any, bytes, int | None]] = []
            group_ids: set[str] = set()
            newly_sealed: list[tuple[int, str]] = []
            room = self._room()
            for header, payload, header_bytes, crc32 in prepared:
                size_bytes = spooled_size_bytes(header_bytes, payload)
                result = admit(
                    header,
                    size_bytes,
                    self._steps,
                    room,
                    known=header.batch_id in group_ids or header.batch_id in self.spool,
                    committed_step=self.spool.committed_step,
                    too_far=self._beyond_window_locked(header.step),
                )
                results.append(result)
                if type(result) in _COUNTED:
                    self._counts[_COUNTED[type(result)]] += 1
                if isinstance(result, Accepted):
                    sealed = self._steps.add(header)
                    if sealed is not None:  # later batches of the group see the step's owner
                        newly_sealed.append(sealed)
                    group_ids.add(header.batch_id)
                    accepted.append((header, payload, header_bytes, crc32))
                    room.fill(header.step, size_bytes)
            if not accepted:
                return GroupResult(tuple(results))
            try:
                self.spool.put_many(
                    [(h.batch_id, hb, p, crc) for h, p, hb, crc in accepted]
                )  # SpoolError on disk failure
            except BaseException as exc:
                for step, _ in newly_sealed:
                    self._steps.unseal(step)
                for header, *_ in accepted:
                    self._steps.remove(header)
                if isinstance(exc, SpoolFull):
                    return GroupResult(self._disk_full_locked(results, exc, {step for step, _ in newly_sealed}))
                raise
            if self._disk_full_since_s is not None:
                log.info(telemetry.SPOOL_ROOM_AGAIN, waited_s=round(time.monotonic() - self._disk_full_since_s, 3))
                self._disk_full_since_s = None
            self._counts["accepted"] += len(accepted)
            keys = {(h.step, h.rank) for h, *_ in accepted if parse_producer_batch_id(h.batch_id) is None}
            for step, producer in newly_sealed:
                keys.update(self._seal_locked(step, producer))
            deliveries = tuple(d for d in (self._serve(sid, s) for sid, s in self._sessions.waiting_on(keys)) if d)
        return GroupResult(tuple(results), deliveries)

    # ------------------------------------------------------------------ consumer side

    def open_session(self, session_id: bytes, worker_id: str = "") -> None:
        """Start ``session_id`` afresh (a HELLO). Other sessions of the same worker id are closed: they
        belong to a connection of that worker that is gone."""
        with self._lock:
            self._sessions.open(session_id, worker_id)

    def close_session(self, session_id: bytes) -> None:
        with self._lock:
            self._sessions.close(session_id)

    def request(self, session_id: bytes, step: int, rank: int, credits: int) -> Delivery | Refused:
        """Batches of (step, rank) to send to this session now (at most ``credits``); the remaining
        credit waits as the session's pending request (replacing any earlier one)."""
        with self._lock:
            committed = self.spool.committed_step
            if committed is not None and step <= committed:
                return Refused(
                    common_pb2.ERROR_CODE_NOT_FOUND,
                    f"step {step} is already committed (through step {committed}) and its batches are "
                    "deleted; ask for a later step (a new run needs a fresh spool_dir)",
                    step=step,
                )
            too_far = self._beyond_window_locked(step)
            if too_far:
                return Refused(common_pb2.ERROR_CODE_OUT_OF_ORDER, f"request refused: {too_far}", step=step)
            session = self._sessions.ask(session_id, step, rank, credits)
            self._frontier_step = max(self._frontier_step, step)
            return self._serve(session_id, session)

    def step_window(self, step: int) -> str:
        """Why ``step`` is too far ahead of the run for a request, a batch or a commit ("" when within
        ``max_step_lead``); thread-safe (the registry asks it for commits)."""
        with self._lock:
            return self._beyond_window_locked(step)

    def _beyond_window_locked(self, step: int) -> str:
        """Why ``step`` is too far ahead of the run (more than ``max_step_lead`` past the highest step asked
        for or committed), or "" when it is within the window."""
        committed = self.spool.committed_step
        anchor = max(self._frontier_step, -1 if committed is None else committed)
        if step - anchor <= self.max_step_lead:
            return ""
        return (
            f"step {step} is more than {self.max_step_lead} steps beyond the run's position (step {anchor}: the "
            "highest step a trainer asked for or committed); raise the broker's `max_step_lead` if this is intended"
        )

    def forget_delivery(self, session_id: bytes, batch_id: str) -> None:
        """A batch handed out by ``request``/``offer`` could not be sent: give it again on the next request."""
        with self._lock:
            entry = self.spool.entry(batch_id)
            if entry is not None and self._sessions.forget_delivery(
                session_id, entry.header.step, entry.header.rank, entry.header.micro_batch_index
            ):
                self._given.discard(batch_id)

    def read_record(self, batch_id: str) -> tuple[bytes, memoryview, int]:
        """(header bytes, payload, crc32) of a batch as spooled (outside the lock), for sending on with
        ``framing.encode_raw`` (no header re-serialization, no CRC pass; no disk read while the spool's read cache
        holds it). Raises ``BatchGone`` if it was released meanwhile; a damaged file is quarantined, dropped from the
        index and ``SpoolCorruption`` raised."""
        try:
            return self.spool.get_record(batch_id)
        except SpoolCorruption:  # quarantined by the spool: forget it here too
            with self._lock:
                self._given.discard(batch_id)
                self._steps.forget_served(batch_id)
            raise

    # ------------------------------------------------------------------ commit

    def release_through(self, step: int) -> int:
        """The trainer committed ``step``: delete every batch of steps <= ``step``; returns how many."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        with self._lock:
            committed = self.spool.committed_step
            if committed is not None and step <= committed:
                return 0
            # From the spool, not the index: batches that could not be indexed at load go too.
            released = [e.batch_id for e in self.spool.entries() if e.header.step <= step]
            num_released = 0
            try:
                self.spool.set_committed_step(step)  # first, so a crash mid-delete finishes on the next load
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                # No room even for the marker: free the released batches' space first. The trainer never asks for
                # a committed step again, so a crash before the marker only leaves it to the next commit.
                log.error(
                    telemetry.SPOOL_COMMIT_ON_FULL_DISK,
                    committed_step=step,
                    error=str(exc),
                )
                num_released = self.spool.delete(released)
                self.spool.set_committed_step(step)
            self._steps.release_through(step)
            num_released += self.spool.delete(released)
            self._given.difference_update(released)
            self._sessions.release_through(step)
            self._counts["released"] += num_released
        log.info("rollout batches released", committed_step=step, num_released=num_released)
        return num_released

    def status(self) -> RolloutQueueStatus:
        with self._lock:
            steps = self._steps.steps()
            room = self._room()
            return RolloutQueueStatus(
                num_batches=self.spool.num_batches,
                num_bytes=self.spool.num_bytes,
                max_batches=self.max_batches,
                max_bytes=self.max_bytes,
                num_pending_requests=self._sessions.num_pending(),
                num_sessions=len(self._sessions),
                committed_step=self.spool.committed_step,
                lowest_step=min(steps, default=None),
                highest_step=max(steps, default=None),
                num_accepted=self._counts["accepted"],
                num_duplicates=self._counts["duplicates"],
                num_backpressured=self._counts["backpressured"],
                num_released=self._counts["released"],
                num_ahead_batches=room.num_ahead,
                num_ahead_bytes=room.bytes_ahead,
                frontier_step=self._frontier_step if self._frontier_step >= 0 else None,
                num_superseded=self._counts["superseded"],
                num_disk_full=self._counts["disk_full"],
            )

    def close(self) -> None:
        """Release the spool directory (its files stay for the next start)."""
        with self._lock:
            self.spool.close()

    # ------------------------------------------------------------------ internals (lock held)

    def _room(self) -> QueueRoom:
        """The bounds and what they count: the batches spooled and not given to any session, other than those of a
        step a session asks for now."""
        asked = self._sessions.asked_steps()
        ahead = [e for e in self.spool.entries() if e.batch_id not in self._given and e.header.step not in asked]
        return QueueRoom(
            len(ahead), sum(e.file_bytes for e in ahead), asked, self.max_batches, self.max_bytes, self.retry_after_ms
        )

    def _load(self) -> None:
        for batch_id, entry in sorted(self.spool.load().items(), key=lambda item: _order_key(item[1].header)):
            header = entry.header
            tag = parse_producer_batch_id(batch_id)
            problem = (
                check_header(header)
                or self._steps.kind_problem(header, tag)
                or self._steps.placement_problem(header, tag)
            )
            if problem:
                # Never silently dropped: it stays in the spool (counted against capacity) until its step is committed.
                log.error(
                    "spool: batch cannot be served and waits for its step's commit", batch_id=batch_id, problem=problem
                )
                continue
            self._steps.add(header)
        # A step whose set is whole from one producer is that producer's, as before the restart; the others'
        # partial sets of it go.
        for step, producer in self._steps.whole_sets():
            self._seal_locked(step, producer)

    def _seal_locked(self, step: int, producer: str) -> set[tuple[int, int]]:
        """``producer`` owns ``step``: serve its set, delete the other producers' sets of the step from the spool.
        Returns the (step, rank) keys now served."""
        served, others = self._steps.seal(step, producer)
        dropped = [batch_id for candidate in others.values() for batch_id in candidate.batch_ids()]
        if dropped:
            num_deleted = self.spool.delete(dropped)
            self._given.difference_update(dropped)
            self._counts["superseded"] += len(dropped)
            log.warning(
                telemetry.ROLLOUT_STEP_HELD_WHOLE,
                step=step,
                producer=producer,
                dropped_producers=sorted(others),
                num_dropped=num_deleted,
            )
        return served

    def _disk_full_locked(
        self, results: list[OfferResult], exc: SpoolFull, unsealed: set[int]
    ) -> tuple[OfferResult, ...]:
        """The group's accepted batches could not be spooled for lack of space: each is told to wait instead, and
        so is each batch superseded by a set of the group that is not kept now (``unsealed`` steps)."""
        reason = (
            f"broker spool disk full: {exc}; free space on the spool's filesystem (or let the trainer commit "
            "steps); the batch is resent"
        )
        now_s = time.monotonic()
        if self._disk_full_since_s is None:
            self._disk_full_since_s = now_s
            log.error(telemetry.SPOOL_DISK_FULL, error=str(exc))
        answered: list[OfferResult] = []
        for result in results:
            if isinstance(result, Superseded) and result.step in unsealed:
                self._counts["superseded"] -= 1
            if isinstance(result, Accepted) or (isinstance(result, Superseded) and result.step in unsealed):
                self._counts["backpressured"] += 1
                self._counts["disk_full"] += 1
                result = Backpressure(
                    result.batch_id, result.step, max(self.retry_after_ms, DISK_FULL_RETRY_AFTER_MS), reason
                )
            answered.append(result)
        return tuple(answered)

    def _serve(self, session_id: bytes, session: Session) -> Delivery:
        pending = session.pending
        delivery = session.take(session_id, self._steps.slots.get((pending.step, pending.rank)) if pending else None)
        self._given.update(delivery.batch_ids)
        return delivery


def _named(item: OfferItem) -> tuple[data_pb2.RolloutBatchHeader, Any, bytes, int | None]:
    """(header, payload, header bytes, crc32) of an offered batch, its header given a default batch id when it
    has none (then serialized again: the envelope's checksum no longer covers it)."""
    header, header_bytes, crc32 = item.header, item.header_bytes, item.crc32
    if not check_header(header) and not header.batch_id:
        named = data_pb2.RolloutBatchHeader()
        named.CopyFrom(header)
        named.batch_id = default_batch_id(header.step, header.rank, header.micro_batch_index)
        header, header_bytes, crc32 = named, None, None
    if header_bytes is None:
        header_bytes = header.SerializeToString(deterministic=True)
    return header, item.payload, header_bytes, crc32


def _order_key(header: data_pb2.RolloutBatchHeader) -> tuple[int, int, int, str]:
    return (header.step, header.rank, header.micro_batch_index, header.batch_id)
