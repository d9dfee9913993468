"""The trainer's shared-memory segments that stored updates still view (``broker.shared_updates``), kept by the weight
plane until it may release them to the trainer; segments of dead trainers are removed every ``SEGMENT_SWEEP_S``."""

from __future__ import annotations

from primerl.broker.shared_updates import COPY_AFTER_S
from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_fanout import WeightFanout
from primerl.proto.shared_segment import remove_stale_segments
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)

SEGMENT_SWEEP_S = 5.0
"""How often the plane removes the shared weight segments of trainers that died (SIGKILL) without removing them."""


class SharedSegments:
    """Stored updates whose payload still views a trainer's segment. One is released once nobody reads it or is being
    sent it and, if the store still holds it, its payload is on disk (or, when its durable file does not come within
    ``COPY_AFTER_S``, copied into the broker's memory). Run by the plane's IO thread; the counts are read by others."""

    def __init__(self, fanout: WeightFanout):
        self.fanout = fanout
        self.store = fanout.store
        self._updates: list[StoredUpdate] = []
        self._next_sweep_s = 0.0
        self.num_descriptors_sent = 0
        self.num_released = 0

    def track(self, update: StoredUpdate) -> None:
        """``update`` (its payload in a shared segment) was stored."""
        if update not in self._updates:
            self._updates.append(update)

    def sent_descriptor(self, worker_id: str, update: StoredUpdate) -> None:
        """``worker_id`` was sent ``update``'s descriptor: it reads the segment until it acknowledges."""
        assert update.shared is not None
        update.shared.add_reader(worker_id)
        self.num_descriptors_sent += 1

    def acknowledged(self, worker_id: str, version: int, applied: bool) -> None:
        """``worker_id`` read every segment up to ``version`` (or, not ``applied``, gave up on them)."""
        for update in self._updates:
            if (not applied or update.policy_version <= version) and update.shared.reader_done(worker_id):
                self.store.notify_durable()  # its durable file was postponed while they loaded

    def release(self, now_s: float) -> None:
        """Release the segments nobody reads any more and the broker no longer needs; remove those of dead trainers
        now and then."""
        if self._updates:
            chain = self.store.durable_chain()[1]
            for update in list(self._updates):
                shared = update.shared
                assert shared is not None
                for worker_id in [w for w in shared.readers if not self.fanout.is_member(w)]:
                    if shared.reader_done(worker_id):  # declared gone: it reads nothing more
                        self.store.notify_durable()
                if shared.readers or self.fanout.is_sending(update):
                    continue
                held = any(u is update for u in chain)
                if held and not update.transit.on_disk:
                    done_s = shared.readers_done_s or now_s
                    if self.store.has_durable and now_s - done_s < COPY_AFTER_S:
                        continue  # its durable file comes soon: the store then reads it from there
                    update.transit.forward = None
                    update.segments[:] = [memoryview(bytes(update.payload)).toreadonly()]
                elif not held:
                    update.segments.clear()
                shared.release()
                self._updates.remove(update)
                self.num_released += 1
                log.debug("shared weight segment released", policy_version=update.policy_version, held=held)
        if now_s >= self._next_sweep_s:
            self._next_sweep_s = now_s + SEGMENT_SWEEP_S
            removed = remove_stale_segments()
            if removed:
                log.info("removed shared weight segments of dead trainers", paths=[str(p) for p in removed])
