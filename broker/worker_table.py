"""The registry's worker records and the indexes that keep every call O(1) whatever the fleet's size.

``WorkerTable`` holds the ``WorkerRecord`` of every registered worker in registration order, with:

- the ids under each name (a name is reused once its holder is LOST or LEFT; the same process asking again is
  recognised by its ``instance_id``, ``live_holder``);
- the number of live workers (the admission bound ``max_workers`` and the heartbeat budget read it);
- the gone (LOST or LEFT) ids in the order they went, of which at most ``max_gone_workers`` are kept;
- the earliest moment a live worker can expire, so ``expire`` sweeps the records only when a deadline passed (a
  heartbeat only moves a deadline later): one sweep per deadline, not one per call.

Not thread-safe: ``registry.WorkerRegistry`` calls it under its lock. ``on_forget`` runs for each record dropped
(the run's progress keeps the steps it reached).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from primerl.broker.worker_record import ALIVE, LOST, WorkerRecord, gone_holders


class WorkerTable:
    """See the module docstring."""

    def __init__(
        self,
        liveness: int,
        *,
        max_workers: int,
        max_gone_workers: int,
        on_forget: Callable[[WorkerRecord], None] = lambda record: None,
    ):
        self.liveness = liveness
        self.max_workers = max_workers
        self.max_gone_workers = max_gone_workers
        self._on_forget = on_forget
        self._records: dict[str, WorkerRecord] = {}  # insertion order = registration order
        self._ids_by_name: dict[str, list[str]] = {}
        self._gone_ids: dict[str, None] = {}
        self._next_expiry_s = float("inf")
        self.num_alive = 0
        self.num_expiry_sweeps = 0  # sweeps over every record: one per deadline passed, not one per call

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def live_holder(self, name: str, instance_id: str) -> WorkerRecord | None:
        """The live record of ``name`` registered by the same client instance (``RegisterRequest.instance_id``), if
        any: that process asking again, e.g. after its earlier answer missed the call's deadline."""
        if not instance_id:
            return None
        for worker_id in self._ids_by_name.get(name, ()):
            record = self._records[worker_id]
            if record.state == ALIVE and record.instance_id == instance_id:
                return record
        return None

    def make_room(self, name: str, timeout_s: float) -> None:
        """Before registering ``name``: drop its gone holders; ``LimitReached`` at ``max_workers`` live workers,
        ``NameTaken`` while a live worker holds it."""
        holders = [self._records[worker_id] for worker_id in self._ids_by_name.get(name, ())]
        for old in gone_holders(holders, name, timeout_s, self.num_alive, self.max_workers):
            self.forget(old)

    def add(self, record: WorkerRecord, now: float) -> None:
        """A live worker that just registered (``make_room`` first)."""
        self._records[record.worker_id] = record
        self._ids_by_name.setdefault(record.name, []).append(record.worker_id)
        self.num_alive += 1
        self.note_deadline(now + self.liveness * record.interval_s)
        while len(self._gone_ids) > self.max_gone_workers:  # the gone workers that went first
            self.forget(self._records[next(iter(self._gone_ids))])

    def note_deadline(self, deadline_s: float) -> None:
        """A live worker expires at ``deadline_s`` unless heard from before."""
        self._next_expiry_s = min(self._next_expiry_s, deadline_s)

    def mark_gone(self, record: WorkerRecord, state: int) -> None:
        """``record`` is LOST or LEFT now (a LOST one may still deregister: LEFT)."""
        if record.state == ALIVE:
            self.num_alive -= 1
        record.state = state
        self._gone_ids[record.worker_id] = None

    def forget(self, record: WorkerRecord) -> None:
        """Drop a record (``on_forget`` first)."""
        self._on_forget(record)
        del self._records[record.worker_id]
        self._gone_ids.pop(record.worker_id, None)
        if record.state == ALIVE:
            self.num_alive -= 1
        ids = self._ids_by_name.get(record.name, [])
        if record.worker_id in ids:
            ids.remove(record.worker_id)
        if not ids:
            self._ids_by_name.pop(record.name, None)

    def expire(self, now: float) -> list[WorkerRecord]:
        """Mark the live workers silent past ``liveness`` times their interval LOST and return them. O(1) until the
        earliest deadline passes, then one sweep that also finds the next earliest deadline."""
        if now <= self._next_expiry_s:
            return []
        self.num_expiry_sweeps += 1
        lost = []
        next_expiry_s = float("inf")
        for record in self._records.values():
            if record.state != ALIVE:
                continue
            deadline_s = record.last_seen + self.liveness * record.interval_s
            if now <= deadline_s:
                next_expiry_s = min(next_expiry_s, deadline_s)
                continue
            self.mark_gone(record, LOST)
            lost.append(record)
        self._next_expiry_s = next_expiry_s
        return lost
