"""The rollout queue: which spooled batch goes to which trainer session, and when producers must wait.

Pure logic over a ``RolloutSpool`` (no sockets), so tests drive it directly and the IO layer
(``rollout_plane.py``) only translates messages into calls and results into messages.

Rules:
- ``offer`` spools a batch durably and returns ``Accepted``, or ``Duplicate`` (already spooled: ack again,
  no second copy), or ``Stale`` (its step is already committed: nothing to keep, ack again), or
  ``Backpressure`` (queue full by count or bytes: nothing kept, resend later), or ``Refused`` (the batch
  can never be accepted: a clear error). Nothing is dropped without the producer being told.
- A consumer *session* (one trainer rank connection) asks for its batches of one (step, rank) with
  credits; it gets at most ``credits`` batches it has not been given yet in this step, in
  micro_batch_index order, and a ``StepDone`` once all ``num_micro_batches`` were given. What cannot be
  served now is remembered (one pending request per session) and served by later ``offer`` calls.
- Asking again for a step the session already finished starts the session over (a trainer that restarted
  from a checkpoint); so does ``open_session`` (a HELLO). A new session gets every batch still spooled.
- Batches leave the spool only through ``release_through(step)`` (the trainer committed ``step``).
- The bounds (``max_batches``, ``max_bytes``) count the batches *ahead of the trainers*: those no session has
  been given yet, other than batches of a step a session is asking for now. Batches already given stay on disk
  until the commit (a checkpoint, maybe many steps later) without blocking producers, so the bound limits
  how far the orchestrator runs ahead, and disk use is bounded by the checkpoint interval times one step. The
  bound holds however the requested steps move: a batch counts until a session is given it, so requests that
  jump ahead (and leave batches behind that nobody asks for) do not make room.

Atomic steps: a batch whose id names its producer incarnation (``proto.batch_ids.producer_batch_id``, what the
orchestrator sends) is kept per (step, producer) and served only once that producer's set of the step is whole
(every rank, every micro-batch). The first incarnation whose set is whole owns the step: the other incarnations'
partial sets of it are deleted from the spool, and their batches of it are acked ``Superseded`` and not kept. So a
step is trained on exactly one orchestrator incarnation's rollouts, even when one was killed half-way through
sending it and the next one made the step again. Ownership needs no file of its own: after a broker restart it is
found again from the spool (the one whole set of a step). Batches with other ids (``default_batch_id``) are served
as they come, as before, and a step takes one kind or the other. A batch of a step held whole from another
incarnation but packed otherwise (other rank count, or micro-batch count for its rank) is refused, as a batch that
disagreed with the spooled step always was: it is most likely another run's spool.

Disk full: a group whose spool write fails for lack of space (ENOSPC, EDQUOT) keeps nothing and each of its
batches is answered ``Backpressure`` with the reason, so producers wait and resend; nothing on disk changes (the
temporary files go) and the broker serves on. A commit on a full disk deletes the released batches before it
writes its marker when the marker cannot be written first.

Group commit: ``offer_many`` decides a group of batches in order (each sees the ones before it, as if
offered one by one), spools the accepted ones together (``RolloutSpool.put_many``: one fsync per file, one
directory fsync) and only then returns; the caller acks after that, so no ack precedes durability. If the
spool write fails, none of the group is kept and the error is raised for the whole group.

Thread-safety: one lock around all state; the IO thread calls ``offer``/``offer_many``/``request``, gRPC
threads call ``release_through`` and ``status``. Spool writes happen under the lock, spool reads for
sending (``read``, ``read_record``) outside it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    StepDone,
    Superseded,
)
from primerl.broker.spool import RolloutSpool, SpoolCorruption, SpoolFull, is_disk_full
from primerl.broker.spool_format import PREFIX_BYTES
from primerl.proto import telemetry
from primerl.proto.batch_ids import ProducerBatchId, default_batch_id, parse_producer_batch_id
from primerl.proto.micro_batch import tensor_spec_problem
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.rollout_queue")
_Read = TypeVar("_Read")

DEFAULT_RETRY_AFTER_MS = 100
DEFAULT_MAX_SESSIONS = 256
# Steps beyond the run's position (the highest step a trainer asked for, or the committed step) that a
# request or a batch may name. Without it one request for step 2**64-1 would move the frontier so far that
# every batch counts as "asked for" and the queue bound stops holding.
DEFAULT_MAX_STEP_LEAD = 1024
# Producers wait at least this long before resending into a full disk.
DISK_FULL_RETRY_AFTER_MS = 1000


# ---------------------------------------------------------------------- state


@dataclass
class _Slot:
    """The batches of one (step, rank), by micro_batch_index."""

    num_micro_batches: int
    batch_ids: dict[int, str] = field(default_factory=dict)


@dataclass
class _Candidate:
    """One producer incarnation's batches of one step, not served until the set is whole."""

    num_ranks: int
    slots: dict[int, _Slot] = field(default_factory=dict)  # rank -> its batches

    def whole(self) -> bool:
        return len(self.slots) == self.num_ranks and all(
            len(slot.batch_ids) == slot.num_micro_batches for slot in self.slots.values()
        )

    def batch_ids(self) -> list[str]:
        return [batch_id for slot in self.slots.values() for batch_id in slot.batch_ids.values()]


@dataclass
class _PendingRequest:
    step: int
    rank: int
    credits: int


@dataclass
class _Session:
    worker_id: str = ""
    # (step, rank) -> micro_batch_indices already given in this session
    delivered: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    # rank -> highest step whose StepDone this session was given
    finished_step: dict[int, int] = field(default_factory=dict)
    pending: _PendingRequest | None = None
    last_active_s: float = field(default_factory=time.monotonic)


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
        self._slots: dict[tuple[int, int], _Slot] = {}  # what sessions are served from
        # Batches with a producer id: step -> producer -> its set, until one producer's set is whole ...
        self._candidates: dict[int, dict[str, _Candidate]] = {}
        # ... then step -> that producer (its slots moved to ``_slots``).
        self._sealed: dict[int, str] = {}
        self._disk_full_since_s: float | None = None
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._counts = {
            "accepted": 0,
            "duplicates": 0,
            "backpressured": 0,
            "released": 0,
            "superseded": 0,
            "disk_full": 0,
        }
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
        """Decide a group of batches in order, spool the accepted ones durably together (group commit),
        then serve pending requests with them. Raises ``SpoolError`` (nothing of the group kept) when the
        spool cannot write."""
        prepared = []
        for item in items:
            header, header_bytes, crc32 = item.header, item.header_bytes, item.crc32
            if not _check_header(header) and not header.batch_id:
                header = _with_default_batch_id(header)
                header_bytes = crc32 = None
            if header_bytes is None:
                header_bytes = header.SerializeToString(deterministic=True)
            prepared.append((header, item.payload, header_bytes, crc32))
        with self._lock:
            results: list[OfferResult] = []
            accepted: list[tuple[data_pb2.RolloutBatchHeader, Any, bytes, int | None]] = []
            group_ids: set[str] = set()
            newly_sealed: list[tuple[int, str]] = []
            num_ahead, bytes_ahead = self._ahead()
            asked_steps = self._asked_steps()
            for header, payload, header_bytes, crc32 in prepared:
                result = self._decide_locked(
                    header, payload, header_bytes, group_ids, num_ahead, bytes_ahead, asked_steps
                )
                results.append(result)
                if isinstance(result, Accepted):
                    sealed = self._index(header)
                    if sealed is not None:  # later batches of the group see the step's owner
                        newly_sealed.append(sealed)
                    group_ids.add(header.batch_id)
                    accepted.append((header, payload, header_bytes, crc32))
                    if header.step not in asked_steps:
                        num_ahead += 1
                        bytes_ahead += spooled_size_bytes(header_bytes, payload)
            if not accepted:
                return GroupResult(tuple(results))
            try:
                self.spool.put_many(
                    [(h.batch_id, hb, p, crc) for h, p, hb, crc in accepted]
                )  # SpoolError on disk failure
            except BaseException as exc:
                for step, _ in newly_sealed:
                    del self._sealed[step]
                for header, *_ in accepted:
                    self._unindex(header)
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
            deliveries = tuple(
                d
                for d in (
                    self._serve(sid, s)
                    for sid, s in self._sessions.items()
                    if s.pending and (s.pending.step, s.pending.rank) in keys
                )
                if d
            )
        return GroupResult(tuple(results), deliveries)

    def _decide_locked(
        self,
        header: data_pb2.RolloutBatchHeader,
        payload: Any,
        header_bytes: bytes,
        group_ids: set[str],
        num_ahead: int,
        bytes_ahead: int,
        asked_steps: set[int],
    ) -> OfferResult:
        problem = _check_header(header) or tensor_spec_problem(header.tensors)
        if problem:
            return Refused(common_pb2.ERROR_CODE_MALFORMED_HEADER, problem, header.batch_id, header.step)
        batch_id, step, rank, index = header.batch_id, header.step, header.rank, header.micro_batch_index
        size_bytes = spooled_size_bytes(header_bytes, payload)
        committed = self.spool.committed_step
        too_far = self._beyond_window_locked(step)
        if too_far:
            return Refused(common_pb2.ERROR_CODE_OUT_OF_ORDER, f"batch {batch_id!r}: {too_far}", batch_id, step)
        if batch_id in group_ids or batch_id in self.spool:
            self._counts["duplicates"] += 1
            return Duplicate(batch_id, step)
        if committed is not None and step <= committed:
            self._counts["duplicates"] += 1
            return Stale(batch_id, step, committed)
        tag = parse_producer_batch_id(batch_id)
        problem = self._step_kind_problem(header, tag)
        if problem:
            return Refused(common_pb2.ERROR_CODE_MALFORMED_HEADER, problem, batch_id, step)
        owner = self._sealed.get(step)
        if tag is not None and owner is not None and owner != tag.producer:
            owned = self._candidate_slot(step, rank, owner)  # a candidate still, when sealed earlier in this group
            pending_owner = self._candidates.get(step, {}).get(owner)
            num_ranks = (
                pending_owner.num_ranks
                if pending_owner is not None
                else sum(1 for key in self._slots if key[0] == step)
            )
            if owned is None or owned.num_micro_batches != header.num_micro_batches or num_ranks != tag.num_ranks:
                # Packed otherwise than the set the step is held whole from: most likely another run's spool.
                return Refused(
                    common_pb2.ERROR_CODE_MALFORMED_HEADER,
                    f"batch {batch_id!r} says step {step} has {tag.num_ranks} ranks and rank {rank} "
                    f"{header.num_micro_batches} micro-batches; the step is already held whole from producer "
                    f"{owner!r} with {num_ranks} ranks and "
                    f"{owned.num_micro_batches if owned is not None else 'no'} micro-batches for rank {rank}",
                    batch_id,
                    step,
                )
            self._counts["superseded"] += 1
            return Superseded(batch_id, step, owner)
        slot = self._slots.get((step, rank)) if tag is None else self._candidate_slot(step, rank, tag.producer)
        if tag is not None:
            candidate = self._candidates.get(step, {}).get(tag.producer)
            if candidate is not None and candidate.num_ranks != tag.num_ranks:
                return Refused(
                    common_pb2.ERROR_CODE_MALFORMED_HEADER,
                    f"batch {batch_id!r} says step {step} has {tag.num_ranks} ranks; earlier batches of its producer "
                    f"said {candidate.num_ranks}",
                    batch_id,
                    step,
                )
        if slot is not None:
            if slot.num_micro_batches != header.num_micro_batches:
                return Refused(
                    common_pb2.ERROR_CODE_MALFORMED_HEADER,
                    f"batch {batch_id!r} says step {step} rank {rank} has {header.num_micro_batches} "
                    f"micro-batches; earlier batches of it said {slot.num_micro_batches}",
                    batch_id,
                    step,
                )
            other = slot.batch_ids.get(index)
            if other is not None:
                return Refused(
                    common_pb2.ERROR_CODE_MALFORMED_HEADER,
                    f"micro-batch {index} of step {step} rank {rank} is already spooled as batch "
                    f"{other!r}; a different batch {batch_id!r} cannot take its place",
                    batch_id,
                    step,
                )
        if size_bytes > self.max_bytes:
            return Refused(
                common_pb2.ERROR_CODE_OVERSIZED,
                f"batch {batch_id!r} ({size_bytes} bytes spooled) can never fit in max_queue_bytes = "
                f"{self.max_bytes}; raise it or send smaller micro-batches",
                batch_id,
                step,
            )
        # Only a batch ahead of the trainers counts against the bounds: one of a step a trainer asks for now is
        # always taken, or later steps filling the queue first would keep that step from ever completing.
        ahead = step not in asked_steps
        if ahead and (num_ahead >= self.max_batches or bytes_ahead + size_bytes > self.max_bytes):
            self._counts["backpressured"] += 1
            reason = (
                f"{num_ahead} of {self.max_batches} batches"
                if num_ahead >= self.max_batches
                else f"{bytes_ahead} + {size_bytes} of {self.max_bytes} bytes"
            )
            return Backpressure(
                batch_id,
                step,
                self.retry_after_ms,
                f"rollout queue full ({reason} ahead of the trainers); wait until a trainer asks for the next step",
            )
        return Accepted(batch_id, step)

    # ------------------------------------------------------------------ consumer side

    def open_session(self, session_id: bytes, worker_id: str = "") -> None:
        """Start ``session_id`` afresh (a HELLO). Other sessions of the same worker id are closed: they
        belong to a connection of that worker that is gone."""
        with self._lock:
            if worker_id:
                for other in [
                    sid for sid, s in self._sessions.items() if s.worker_id == worker_id and sid != session_id
                ]:
                    del self._sessions[other]
            self._sessions.pop(session_id, None)
            self._session(session_id).worker_id = worker_id

    def close_session(self, session_id: bytes) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

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
            session = self._session(session_id)
            if step <= session.finished_step.get(rank, -1):
                # The trainer went back (restarted from a checkpoint): this is a new session for it.
                worker_id = session.worker_id
                session = _Session(worker_id=worker_id)
                self._sessions[session_id] = session
            session.pending = _PendingRequest(step, rank, max(0, credits))
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
            session = self._sessions.get(session_id)
            entry = self.spool.entry(batch_id)
            if session is None or entry is None:
                return
            self._given.discard(batch_id)
            key = (entry.header.step, entry.header.rank)
            session.delivered.get(key, set()).discard(entry.header.micro_batch_index)
            if session.finished_step.get(key[1], -1) == key[0]:
                del session.finished_step[key[1]]

    def read(self, batch_id: str) -> tuple[data_pb2.RolloutBatchHeader, memoryview]:
        """Header and payload of a batch, from the spool (outside the lock). Raises ``BatchGone`` if it was
        released meanwhile; a damaged file is quarantined, dropped from the index and ``SpoolCorruption``
        raised."""
        return self._read_from_spool(self.spool.get, batch_id)

    def read_record(self, batch_id: str) -> tuple[bytes, memoryview, int]:
        """(header bytes, payload, crc32) of a batch as spooled, for sending on with ``framing.encode_raw``
        (no header re-serialization, no CRC pass; no disk read while the spool's read cache holds it).
        Raises like ``read``."""
        return self._read_from_spool(self.spool.get_record, batch_id)

    def _read_from_spool(self, read: Callable[[str], _Read], batch_id: str) -> _Read:
        try:
            return read(batch_id)
        except SpoolCorruption:  # quarantined by the spool: forget it here too
            with self._lock:
                self._given.discard(batch_id)
                for slot in self._slots.values():
                    for index, other in list(slot.batch_ids.items()):
                        if other == batch_id:
                            del slot.batch_ids[index]
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
            for key in [key for key in self._slots if key[0] <= step]:
                del self._slots[key]
            for old in [s for s in self._candidates if s <= step]:
                del self._candidates[old]
            for old in [s for s in self._sealed if s <= step]:
                del self._sealed[old]
            num_released += self.spool.delete(released)
            self._given.difference_update(released)
            for session in self._sessions.values():
                for key in [k for k in session.delivered if k[0] <= step]:
                    del session.delivered[key]
                if session.pending and session.pending.step <= step:
                    session.pending = None
            self._counts["released"] += num_released
        log.info("rollout batches released", committed_step=step, num_released=num_released)
        return num_released

    def status(self) -> RolloutQueueStatus:
        with self._lock:
            steps = [key[0] for key, slot in self._slots.items() if slot.batch_ids] + list(self._candidates)
            num_ahead_batches, num_ahead_bytes = self._ahead()
            return RolloutQueueStatus(
                num_batches=self.spool.num_batches,
                num_bytes=self.spool.num_bytes,
                max_batches=self.max_batches,
                max_bytes=self.max_bytes,
                num_pending_requests=sum(1 for s in self._sessions.values() if s.pending and s.pending.credits > 0),
                num_sessions=len(self._sessions),
                committed_step=self.spool.committed_step,
                lowest_step=min(steps, default=None),
                highest_step=max(steps, default=None),
                num_accepted=self._counts["accepted"],
                num_duplicates=self._counts["duplicates"],
                num_backpressured=self._counts["backpressured"],
                num_released=self._counts["released"],
                num_ahead_batches=num_ahead_batches,
                num_ahead_bytes=num_ahead_bytes,
                frontier_step=self._frontier_step if self._frontier_step >= 0 else None,
                num_superseded=self._counts["superseded"],
                num_disk_full=self._counts["disk_full"],
            )

    def close(self) -> None:
        """Release the spool directory (its files stay for the next start)."""
        with self._lock:
            self.spool.close()

    # ------------------------------------------------------------------ internals (lock held)

    def _asked_steps(self) -> set[int]:
        """The steps some session is asking for now (its pending request)."""
        return {s.pending.step for s in self._sessions.values() if s.pending is not None}

    def _ahead(self) -> tuple[int, int]:
        """(batches, bytes) spooled and not given to any session, other than those of a step a session asks for
        now: what the queue bounds count."""
        asked_steps = self._asked_steps()
        ahead = [e for e in self.spool.entries() if e.batch_id not in self._given and e.header.step not in asked_steps]
        return len(ahead), sum(e.file_bytes for e in ahead)

    def _load(self) -> None:
        for batch_id, entry in sorted(self.spool.load().items(), key=lambda item: _order_key(item[1].header)):
            header = entry.header
            tag = parse_producer_batch_id(batch_id)
            problem = _check_header(header) or self._step_kind_problem(header, tag)
            slot = (
                self._slots.get((header.step, header.rank))
                if tag is None
                else self._candidate_slot(header.step, header.rank, tag.producer)
            )
            if not problem and tag is not None:
                candidate = self._candidates.get(header.step, {}).get(tag.producer)
                if candidate is not None and candidate.num_ranks != tag.num_ranks:
                    problem = f"num_ranks {tag.num_ranks} disagrees with {candidate.num_ranks}"
            if not problem and slot is not None:
                if slot.num_micro_batches != header.num_micro_batches:
                    problem = f"num_micro_batches {header.num_micro_batches} disagrees with {slot.num_micro_batches}"
                elif header.micro_batch_index in slot.batch_ids:
                    problem = f"micro-batch slot taken by {slot.batch_ids[header.micro_batch_index]!r}"
            if problem:
                # Never silently dropped: it stays in the spool (counted against capacity) until its step is committed.
                log.error(
                    "spool: batch cannot be served and waits for its step's commit", batch_id=batch_id, problem=problem
                )
                continue
            self._index(header)
        # A step whose set is whole from one producer is that producer's, as before the restart; the others'
        # partial sets of it go. (Two whole sets only if the broker died between spooling the second and deleting
        # it; no batch of the step was served then, so either may stay.)
        for step in sorted(self._candidates):
            whole = sorted(producer for producer, c in self._candidates[step].items() if c.whole())
            if whole:
                self._sealed[step] = whole[0]
                self._seal_locked(step, whole[0])

    def _index(self, header: data_pb2.RolloutBatchHeader) -> tuple[int, str] | None:
        """Index an accepted batch; returns (step, producer) when it made its producer's set of the step whole and
        the step had no owner yet (it is now that producer's: ``_seal_locked`` once the batches are durable)."""
        tag = parse_producer_batch_id(header.batch_id)
        if tag is None:
            slot = self._slots.setdefault((header.step, header.rank), _Slot(header.num_micro_batches))
            slot.batch_ids[header.micro_batch_index] = header.batch_id
            return None
        candidate = self._candidates.setdefault(header.step, {}).setdefault(tag.producer, _Candidate(tag.num_ranks))
        slot = candidate.slots.setdefault(header.rank, _Slot(header.num_micro_batches))
        slot.batch_ids[header.micro_batch_index] = header.batch_id
        if header.step not in self._sealed and candidate.whole():
            self._sealed[header.step] = tag.producer
            return header.step, tag.producer
        return None

    def _seal_locked(self, step: int, producer: str) -> set[tuple[int, int]]:
        """``producer`` owns ``step``: serve its set, delete the other producers' sets of the step from the spool.
        Returns the (step, rank) keys now served."""
        candidates = self._candidates.pop(step, {})
        owned = candidates.pop(producer)
        for rank, slot in owned.slots.items():
            self._slots[(step, rank)] = slot
        dropped = [batch_id for candidate in candidates.values() for batch_id in candidate.batch_ids()]
        if dropped:
            num_deleted = self.spool.delete(dropped)
            self._given.difference_update(dropped)
            self._counts["superseded"] += len(dropped)
            log.warning(
                telemetry.ROLLOUT_STEP_HELD_WHOLE,
                step=step,
                producer=producer,
                dropped_producers=sorted(candidates),
                num_dropped=num_deleted,
            )
        return set((step, rank) for rank in owned.slots)

    def _candidate_slot(self, step: int, rank: int, producer: str) -> _Slot | None:
        candidate = self._candidates.get(step, {}).get(producer)
        if candidate is None:
            return self._slots.get((step, rank)) if self._sealed.get(step) == producer else None
        return candidate.slots.get(rank)

    def _step_kind_problem(self, header: data_pb2.RolloutBatchHeader, tag: ProducerBatchId | None) -> str:
        """Why the batch cannot join its step ("" if it can): a producer id that disagrees with the header, or a
        step that holds batches of the other kind (with and without a producer id)."""
        step = header.step
        legacy = step not in self._sealed and any(key[0] == step for key in self._slots)
        if tag is None:
            if step in self._candidates or step in self._sealed:
                return (
                    f"batch {header.batch_id!r} has no producer id but step {step} holds batches with one; "
                    "a step is sent by orchestrators of one version"
                )
            return ""
        if (tag.step, tag.rank, tag.micro_batch_index) != (step, header.rank, header.micro_batch_index):
            return (
                f"batch id {header.batch_id!r} names step {tag.step} rank {tag.rank} micro-batch "
                f"{tag.micro_batch_index}, the header step {step} rank {header.rank} micro-batch "
                f"{header.micro_batch_index}"
            )
        if header.rank >= tag.num_ranks:
            return f"batch {header.batch_id!r}: rank {header.rank} is not below its num_ranks {tag.num_ranks}"
        if legacy:
            return (
                f"batch {header.batch_id!r} has a producer id but step {step} holds batches without one; "
                "a step is sent by orchestrators of one version"
            )
        return ""

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

    def _unindex(self, header: data_pb2.RolloutBatchHeader) -> None:
        tag = parse_producer_batch_id(header.batch_id)
        if tag is not None:
            candidate = self._candidates.get(header.step, {}).get(tag.producer)
            slot = candidate.slots.get(header.rank) if candidate is not None else None
            if slot is not None and slot.batch_ids.get(header.micro_batch_index) == header.batch_id:
                del slot.batch_ids[header.micro_batch_index]
                if not slot.batch_ids:
                    del candidate.slots[header.rank]  # type: ignore[union-attr]
                if candidate is not None and not candidate.slots:
                    del self._candidates[header.step][tag.producer]
                    if not self._candidates[header.step]:
                        del self._candidates[header.step]
            return
        key = (header.step, header.rank)
        slot = self._slots.get(key)
        if slot is not None and slot.batch_ids.get(header.micro_batch_index) == header.batch_id:
            del slot.batch_ids[header.micro_batch_index]
            if not slot.batch_ids:
                del self._slots[key]

    def _session(self, session_id: bytes) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                evicted, old = self._sessions.popitem(last=False)
                log.warning(
                    "rollout queue: too many consumer sessions, forgetting the least recently active one",
                    max_sessions=self.max_sessions,
                    worker_id=old.worker_id,
                    session=evicted.hex(),
                )
            session = self._sessions[session_id] = _Session()
        self._sessions.move_to_end(session_id)
        session.last_active_s = time.monotonic()
        return session

    def _serve(self, session_id: bytes, session: _Session) -> Delivery:
        pending = session.pending
        if pending is None:
            return Delivery(session_id)
        key = (pending.step, pending.rank)
        slot = self._slots.get(key)
        if slot is None:
            return Delivery(session_id)
        delivered = session.delivered.setdefault(key, set())
        batch_ids = []
        for index in sorted(slot.batch_ids):
            if pending.credits <= 0:
                break
            if index not in delivered:
                delivered.add(index)
                batch_ids.append(slot.batch_ids[index])
                self._given.add(slot.batch_ids[index])
                pending.credits -= 1
        step_done = None
        if len(delivered) >= slot.num_micro_batches and session.finished_step.get(pending.rank, -1) < pending.step:
            step_done = StepDone(pending.step, pending.rank, slot.num_micro_batches)
            session.finished_step[pending.rank] = pending.step
            session.pending = None
        return Delivery(session_id, tuple(batch_ids), step_done)


def _check_header(header: data_pb2.RolloutBatchHeader) -> str:
    if header.num_micro_batches < 1:
        return f"batch {header.batch_id!r}: num_micro_batches must be >= 1, got {header.num_micro_batches}"
    if header.micro_batch_index >= header.num_micro_batches:
        return (
            f"batch {header.batch_id!r}: micro_batch_index {header.micro_batch_index} is not below "
            f"num_micro_batches {header.num_micro_batches}"
        )
    return ""


def _with_default_batch_id(header: data_pb2.RolloutBatchHeader) -> data_pb2.RolloutBatchHeader:
    named = data_pb2.RolloutBatchHeader()
    named.CopyFrom(header)
    named.batch_id = default_batch_id(header.step, header.rank, header.micro_batch_index)
    return named


def _order_key(header: data_pb2.RolloutBatchHeader) -> tuple[int, int, int, str]:
    return (header.step, header.rank, header.micro_batch_index, header.batch_id)


def spooled_size_bytes(header_bytes: bytes, payload: Any) -> int:
    """Bytes a batch takes in the spool (what ``max_bytes`` counts): file prefix + header + payload."""
    return PREFIX_BYTES + len(header_bytes) + memoryview(getattr(payload, "buffer", payload)).nbytes
