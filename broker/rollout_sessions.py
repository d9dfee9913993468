"""The rollout queue's consumer sessions, one per trainer rank connection. No lock and no disk: ``RolloutQueue``
holds them under its lock.

A session asks for its batches of one (step, rank) with credits; it gets at most ``credits`` batches it has not been
given yet in this step, in micro_batch_index order, and a ``StepDone`` once all ``num_micro_batches`` were given. What
cannot be served now is remembered (one pending request per session) and served when batches come. Asking again for
a step the session already finished starts the session over (a trainer that restarted from a checkpoint); so does
``open`` (a HELLO). A new session gets every batch still spooled. At most ``max_sessions`` are kept: the least
recently active one goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from primerl.broker.rollout_results import Delivery, StepDone
from primerl.broker.rollout_steps import Slot
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.rollout_queue")


@dataclass
class PendingRequest:
    step: int
    rank: int
    credits: int


@dataclass
class Session:
    worker_id: str = ""
    # (step, rank) -> micro_batch_indices already given in this session
    delivered: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    # rank -> highest step whose StepDone this session was given
    finished_step: dict[int, int] = field(default_factory=dict)
    pending: PendingRequest | None = None

    def take(self, session_id: bytes, slot: Slot | None) -> Delivery:
        """What the pending request gets now from ``slot``, its (step, rank)'s batches (module docstring)."""
        pending = self.pending
        if pending is None or slot is None:
            return Delivery(session_id)
        delivered = self.delivered.setdefault((pending.step, pending.rank), set())
        batch_ids = []
        for index in sorted(slot.batch_ids):
            if pending.credits <= 0:
                break
            if index not in delivered:
                delivered.add(index)
                batch_ids.append(slot.batch_ids[index])
                pending.credits -= 1
        step_done = None
        if len(delivered) >= slot.num_micro_batches and self.finished_step.get(pending.rank, -1) < pending.step:
            step_done = StepDone(pending.step, pending.rank, slot.num_micro_batches)
            self.finished_step[pending.rank] = pending.step
            self.pending = None
        return Delivery(session_id, tuple(batch_ids), step_done)


class ConsumerSessions:
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def waiting_on(self, keys: set[tuple[int, int]]) -> list[tuple[bytes, Session]]:
        """The sessions whose pending request is for one of ``keys`` ((step, rank))."""
        return [(sid, s) for sid, s in self._sessions.items() if s.pending and (s.pending.step, s.pending.rank) in keys]

    def open(self, session_id: bytes, worker_id: str) -> None:
        """Start ``session_id`` afresh; other sessions of the same worker id are closed."""
        if worker_id:
            for other in [sid for sid, s in self._sessions.items() if s.worker_id == worker_id and sid != session_id]:
                del self._sessions[other]
        self._sessions.pop(session_id, None)
        self._touch(session_id).worker_id = worker_id

    def close(self, session_id: bytes) -> None:
        self._sessions.pop(session_id, None)

    def ask(self, session_id: bytes, step: int, rank: int, credits: int) -> Session:
        """The session, its pending request now (step, rank) with ``credits``. Asking for a step it already finished
        starts it over (the trainer went back: restarted from a checkpoint)."""
        session = self._touch(session_id)
        if step <= session.finished_step.get(rank, -1):
            session = self._sessions[session_id] = Session(worker_id=session.worker_id)
        session.pending = PendingRequest(step, rank, max(0, credits))
        return session

    def forget_delivery(self, session_id: bytes, step: int, rank: int, index: int) -> bool:
        """Micro-batch ``index`` of (step, rank) was not sent after all: give it again. False: no such session."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.delivered.get((step, rank), set()).discard(index)
        if session.finished_step.get(rank, -1) == step:
            del session.finished_step[rank]
        return True

    def asked_steps(self) -> set[int]:
        """The steps some session is asking for now (its pending request)."""
        return {s.pending.step for s in self._sessions.values() if s.pending is not None}

    def num_pending(self) -> int:
        return sum(1 for s in self._sessions.values() if s.pending and s.pending.credits > 0)

    def release_through(self, step: int) -> None:
        """Steps through ``step`` are committed: nothing of them is asked for or remembered."""
        for session in self._sessions.values():
            for key in [k for k in session.delivered if k[0] <= step]:
                del session.delivered[key]
            if session.pending and session.pending.step <= step:
                session.pending = None

    def _touch(self, session_id: bytes) -> Session:
        """The session, created if new (forgetting the least recently active one beyond ``max_sessions``), now the
        most recently active."""
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
            session = self._sessions[session_id] = Session()
        self._sessions.move_to_end(session_id)
        return session
