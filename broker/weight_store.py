"""The broker's weight store (core logic, no sockets): the latest full snapshot and the deltas since it.

The trainer publishes policy updates of three kinds (``WeightUpdateHeader.kind``):

- FULL: every tensor of the policy. It becomes the new snapshot and clears the delta chain.
- LORA: a complete LoRA adapter (self-contained on top of the base model that every inference worker
  loads from disk). In a LoRA run it is the snapshot, exactly as a FULL update is in a full run.
- DELTA: a lossless delta against ``base_version``, which must be the latest version held.

Ordering: a FULL or LORA update must have ``policy_version`` above the latest version held (any version
when the store is empty); a DELTA must have ``base_version == latest`` and ``policy_version > base_version``.
The digest (``proto.digests``) of the payload must match. A refused update raises ``WeightUpdateRefused``
with the ``ErrorCode`` to send back, and changes nothing.

Delta chain bound (decision): the store keeps at most ``max_deltas`` deltas and ``max_delta_bytes`` bytes
of them after the snapshot, because a worker that joins late needs the snapshot plus every delta since.
When an accepted delta leaves no room for another delta of its size, ``put`` returns
``full_required=True``, which the broker copies into the trainer's WEIGHT_ACK (``full_required``): the
trainer's next update must be FULL (or LORA). A trainer that ignores it and sends one more delta that does
not fit gets that delta refused (``ERROR_CODE_BACKPRESSURE``, ``retry_after_ms=0``, ``full_required=True``);
it should resend the same version as FULL. Nothing is evicted silently: the chain always reconstructs the
latest version from the snapshot.

Lineage (a rollback is a first-class event): every update carries ``lineage``, the trainer incarnation that made
it (the ``policy_lineage`` the broker's registry gave it, ``registry._assign_lineage_locked``; 0: a sender that
predates lineages), and
``lineage_base_version``, the version it resumed from. A larger lineage supersedes every smaller one:

- a FULL or LORA update of a NEWER lineage is accepted whatever its version, even one not above the latest held:
  a trainer that resumed from a checkpoint older than the newest published version re-publishes those versions.
  The older lineage's snapshot and deltas are dropped (``PutResult.rolled_back_from`` names the latest version
  that was dropped when the new one is not above it), and the new lineage is what late joiners get;
- a DELTA of a newer lineage is refused (OUT_OF_ORDER): a lineage starts with a FULL (or LORA) update;
- any update of an OLDER lineage is refused (OUT_OF_ORDER, the message says it was superseded): e.g. a trainer
  that a restarted one replaced but that still runs. The sender reads the store's lineage in the refusal.
  "Older" counts the lineages the registry has handed out too (``refuse_lineages_below``), not only the ones
  published: a trainer cut off by a partition while its replacement registered is refused from then on, even
  before the replacement's first publish.
Lineage 0 on both sides is the ordering by version alone.

``plan_for(worker_version, worker_lineage)`` says what a worker must receive to reach the latest version: a
worker whose (known) lineage is older than the store's gets the snapshot even when its version number is the
same or higher (it serves weights of a rolled-back step).

Durability (``attach_durable``): with a ``WeightDurability`` (``weight_durable``) the store reloads the latest
chain at start and has every change written to disk by that writer thread, off the weight plane's IO thread.

Thread-safe: one lock guards all state; payloads are read-only views that are never mutated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from primerl.broker.stored_update import DELTA, FULL, LORA, SNAPSHOT_KINDS, StoredUpdate, kind_name
from primerl.proto.digests import hasher_for
from primerl.proto.units import GiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    from primerl.broker.weight_durable import WeightDurability

log = get_logger(__name__)


@dataclass(frozen=True)
class PutResult:
    update: StoredUpdate
    # The delta chain is full: the next update must be FULL or LORA.
    full_required: bool
    # A newer lineage replaced the one held (None: same lineage as before, or the store was empty).
    previous_lineage: int | None = None
    # The latest version of the replaced lineage when this update's version is not above it: a rollback.
    rolled_back_from: int | None = None
    # The update is the latest one held already (same version, lineage and digest: a resend after an outage).
    duplicate: bool = False


@dataclass(frozen=True)
class WeightStoreStatus:
    latest_version: int | None
    snapshot_version: int | None
    snapshot_kind: str | None
    num_deltas: int
    num_bytes: int
    num_accepted: int
    num_refused: int
    # The lineage held (0: none, or senders without lineages) and the version it resumed from.
    lineage: int = 0
    lineage_base_version: int = 0
    num_rollbacks: int = 0


class WeightStore:
    """The latest snapshot (FULL or LORA) and the DELTAs since it, bounded in count and bytes."""

    def __init__(self, *, max_deltas: int = 16, max_delta_bytes: int = 4 * GiB, verify_digest: bool = True):
        for name, bound in (("max_deltas", max_deltas), ("max_delta_bytes", max_delta_bytes)):
            if bound < 0:
                raise ValueError(f"{name} must be >= 0, got {bound}")
        self.max_deltas = max_deltas
        self.max_delta_bytes = max_delta_bytes
        self.verify_digest = verify_digest
        self._lock = threading.Lock()
        self._snapshot: StoredUpdate | None = None
        self._deltas: list[StoredUpdate] = []
        self._num_accepted = 0
        self._num_refused = 0
        self._lineage = 0
        self._lineage_base_version = 0
        # The newest lineage the registry handed out (``refuse_lineages_below``): updates of an older one are refused.
        self._lineage_floor = 0
        self._num_rollbacks = 0
        self._durable: WeightDurability | None = None

    def attach_durable(self, durable: WeightDurability) -> None:
        """Load the chain ``durable`` holds (after a broker restart: the latest snapshot and its deltas) and have
        every later change written by it. Call once, before any update arrives."""
        lineage, base_version, num_rollbacks, updates = durable.load()
        with self._lock:
            if self._snapshot is not None or self._durable is not None:
                raise RuntimeError("attach_durable() must be called once, on an empty store")
            self._lineage, self._lineage_base_version = lineage, base_version
            self._num_rollbacks = num_rollbacks
            if updates:
                self._snapshot = updates[0]
                self._deltas = list(updates[1:])
            self._durable = durable
        durable.start(self)
        if updates:
            log.info(
                "weight store reloaded",
                latest_version=updates[-1].policy_version,
                lineage=lineage,
                num_deltas=len(updates) - 1,
                num_bytes=sum(u.num_bytes for u in updates),
            )

    def notify_durable(self) -> None:
        """Ask the durable writer for a round (it postpones updates whose same-host readers are busy)."""
        if self._durable is not None:
            self._durable.notify()

    @property
    def has_durable(self) -> bool:
        """A durable writer mirrors the chain to disk (``attach_durable``)."""
        return self._durable is not None

    def durable_chain(self) -> tuple[int, list[StoredUpdate]]:
        """(lineage, [snapshot, *deltas]) as held now: what the durability writer mirrors to disk."""
        with self._lock:
            chain = [] if self._snapshot is None else [self._snapshot, *self._deltas]
            return self._lineage, chain

    # -- writes --------------------------------------------------------------------------------------

    def check_header(self, header: data_pb2.WeightUpdateHeader) -> None:
        """Refuse early (e.g. on the first chunk of a transfer) what ``put`` would refuse for its header alone."""
        with self._lock:
            try:
                self._check_header_locked(header, payload_bytes=None)
            except WeightUpdateRefused:
                self._num_refused += 1
                raise

    def put(
        self, header: data_pb2.WeightUpdateHeader, payload: Any, *, computed_digest: str | None = None
    ) -> PutResult:
        """Check and store one whole update; raises ``WeightUpdateRefused`` (store unchanged) when refused.

        ``payload`` is kept by reference (no copy): the caller must not mutate it afterwards.
        ``computed_digest``: the digest the caller already computed over exactly these bytes (e.g. chunk by chunk
        as they arrived); otherwise the store computes it (outside the lock).
        """
        return self.put_update(StoredUpdate.of(header, payload), computed_digest=computed_digest)

    def put_update(self, update: StoredUpdate, *, computed_digest: str | None = None) -> PutResult:
        """``put`` of an update built by the caller (its segments complete): the object itself is stored, so a plane
        that forwarded its chunks while they arrived keeps sending the same one."""
        header = update.header
        num_bytes = update.num_bytes
        if self.verify_digest and computed_digest is None:
            hasher = hasher_for(header.digest)
            for segment in update.segments:
                hasher.update(segment)
            computed_digest = hasher.hexdigest()
        digest_ok = not self.verify_digest or computed_digest == header.digest.lower()
        with self._lock:
            latest_update = self._latest_update_locked()
            if self._is_resend_locked(header) and digest_ok:
                assert latest_update is not None
                return PutResult(
                    update=latest_update, full_required=self._full_required_after_locked(latest_update), duplicate=True
                )
            try:
                self._check_header_locked(header, payload_bytes=num_bytes)
                if not header.digest:
                    raise WeightUpdateRefused(
                        common_pb2.ERROR_CODE_BAD_DIGEST,
                        "the header has no digest: set it to the digest of the payload",
                    )
                if not digest_ok:
                    raise WeightUpdateRefused(
                        common_pb2.ERROR_CODE_BAD_DIGEST,
                        f"digest of the {num_bytes}-byte payload does not match the header's "
                        f"{header.digest[:24]}... (payload corrupted, or digest computed over "
                        "other bytes)",
                    )
            except WeightUpdateRefused:
                self._num_refused += 1
                raise
            stored = update
            previous_lineage = rolled_back_from = None
            if header.lineage > self._lineage:
                latest = self._latest_locked()
                previous_lineage = self._lineage
                if latest is not None and header.policy_version <= latest:
                    rolled_back_from = latest
                    self._num_rollbacks += 1
                self._lineage, self._lineage_base_version = header.lineage, header.lineage_base_version
                if self._durable is not None:
                    # Before the ack: after a crash the disk never offers the replaced lineage's weights again.
                    self._durable.set_lineage(self._lineage, self._lineage_base_version, self._num_rollbacks)
            if stored.kind in SNAPSHOT_KINDS:
                self._snapshot = stored
                self._deltas = []
            else:
                self._deltas.append(stored)
            self._num_accepted += 1
            full_required = self._full_required_after_locked(stored)
        if self._durable is not None:
            self._durable.notify()
        return PutResult(
            update=stored,
            full_required=full_required,
            previous_lineage=previous_lineage,
            rolled_back_from=rolled_back_from,
        )

    def _full_required_after_locked(self, latest: StoredUpdate) -> bool:
        # For the next delta's size, the last delta's is the best guess there is.
        return (
            self.max_deltas == 0
            if latest.kind in SNAPSHOT_KINDS
            else self._chain_full_locked(next_delta_bytes=latest.num_bytes)
        )

    def _latest_update_locked(self) -> StoredUpdate | None:
        return self._deltas[-1] if self._deltas else self._snapshot

    def _is_resend_locked(self, header: data_pb2.WeightUpdateHeader, *, streamed: bool = False) -> bool:
        """``header`` is the latest update held, sent again (a publisher that lost the broker's ack); ``streamed``:
        or it opens a streamed transfer (its digest follows in the last chunk) of the latest update's version,
        lineage and kind, a resend unless its bytes differ (``put`` tells, with the digest)."""
        latest = self._latest_update_locked()
        same_update = (header.policy_version, header.lineage, header.kind)
        if latest is None or (latest.policy_version, latest.lineage, latest.kind) != same_update:
            return False
        return latest.header.digest.lower() == header.digest.lower() if header.digest else streamed

    def _check_header_locked(self, header: data_pb2.WeightUpdateHeader, *, payload_bytes: int | None) -> None:
        if payload_bytes is None and self._is_resend_locked(header, streamed=True):
            return  # a resend of the latest update: ``put`` acknowledges it once its bytes are checked
        kind = header.kind
        version = header.policy_version
        latest = self._latest_locked()
        if kind not in (FULL, LORA, DELTA):
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_MALFORMED_HEADER, f"weight update kind {kind} is not FULL, LORA or DELTA"
            )
        if payload_bytes is not None and header.payload_bytes and header.payload_bytes != payload_bytes:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_TRUNCATED,
                f"header says {header.payload_bytes} payload bytes but {payload_bytes} arrived",
            )
        if header.lineage < self._lineage:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"{kind_name(kind)} v{version} belongs to lineage {header.lineage}, which lineage {self._lineage} "
                f"(a trainer resumed at v{self._lineage_base_version}) superseded: this sender is a replaced trainer "
                "incarnation; stop it",
            )
        if 0 < header.lineage < self._lineage_floor:  # (lineage 0, a sender without lineages: by version alone)
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"{kind_name(kind)} v{version} belongs to lineage {header.lineage}, which lineage "
                f"{self._lineage_floor} superseded (a newer trainer incarnation registered with the broker): this "
                "sender is a replaced trainer incarnation; stop it",
            )
        new_lineage = header.lineage > self._lineage
        if kind in SNAPSHOT_KINDS:
            if header.base_version != 0:
                raise WeightUpdateRefused(
                    common_pb2.ERROR_CODE_MALFORMED_HEADER,
                    f"a {kind_name(kind)} update must have base_version 0, got {header.base_version}",
                )
            if not new_lineage and latest is not None and version <= latest:
                raise WeightUpdateRefused(
                    common_pb2.ERROR_CODE_OUT_OF_ORDER,
                    f"{kind_name(kind)} v{version} is not newer than the latest version v{latest} "
                    "held (a trainer that resumed from an older checkpoint publishes under a new "
                    "lineage)",
                )
            return
        # DELTA
        if new_lineage:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"DELTA v{version} starts lineage {header.lineage} (the broker holds lineage "
                f"{self._lineage}): a new lineage starts with a FULL (or LORA) update",
            )
        if latest is None:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"DELTA v{version} on v{header.base_version}: the broker holds no version yet; "
                "send a FULL (or LORA) update first",
            )
        if header.base_version != latest:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"DELTA v{version} applies to v{header.base_version} but the latest version held is "
                f"v{latest}; send a delta against v{latest} or a FULL update",
            )
        if version <= header.base_version:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_OUT_OF_ORDER,
                f"DELTA v{version} is not newer than its base v{header.base_version}",
            )
        if self._chain_full_locked(next_delta_bytes=payload_bytes or 0):
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_BACKPRESSURE,
                f"the delta chain since snapshot v{self._snapshot.policy_version} is full ({len(self._deltas)} of "
                f"{self.max_deltas} deltas, {self._delta_bytes_locked()} of {self.max_delta_bytes} bytes"
                f"{'' if payload_bytes is None else f', this delta {payload_bytes}'}): "
                f"send v{version} as a FULL update",
                full_required=True,
            )

    def _chain_full_locked(self, *, next_delta_bytes: int) -> bool:
        """No room for one more delta of ``next_delta_bytes``."""
        return (
            len(self._deltas) + 1 > self.max_deltas
            or self._delta_bytes_locked() + next_delta_bytes > self.max_delta_bytes
        )

    def release_written(self, busy: Callable[[StoredUpdate], bool]) -> int:
        """Memory: each update of the chain whose durable file is written, that is not ``busy`` (being sent) and
        still holds its received frames, keeps its payload from then on as a read-only mapping of that file (the
        page cache's pages, which the kernel may drop and read again), and its frames are freed. So the broker holds
        in its own memory little more than the update being received. Returns the bytes released.

        Caller: the weight plane's IO thread, which owns the updates' encoded chunks (``transit``): the chunks of a
        released update are dropped with its frames and made again, from the mapping, if a worker needs them."""
        durable = self._durable
        if durable is None:
            return 0
        released = 0
        for update in self.durable_chain()[1]:
            if update.transit.on_disk or busy(update):
                continue
            mapped = durable.payload_on_disk(update)
            if mapped is None:
                continue
            released += update.num_bytes
            update.transit.forward = None
            update.transit.received = None
            update.segments[:] = [mapped]
            update.transit.on_disk = True
        return released

    # -- reads ---------------------------------------------------------------------------------------

    def plan_for(self, worker_version: int | None, worker_lineage: int = 0) -> list[StoredUpdate]:
        """Updates that bring a worker holding ``worker_version`` (``None``: nothing) of ``worker_lineage`` (0:
        unknown) to the latest version.

        - of an older lineage than the store's (it serves a rolled-back or replaced lineage): the snapshot, then
          every delta since it, whatever its version number;
        - of a newer lineage (the broker restarted and lost it): nothing, never an older lineage's weights;
        - at the latest version, or ahead of it (the broker restarted and holds less): nothing;
        - at the snapshot version or a version on the delta chain: the deltas after that version;
        - anything else (new, far behind, off the chain): the snapshot, then every delta since it.
        A lineage of 0 on either side plans by version alone.
        """
        with self._lock:
            latest = self._latest_locked()
            if latest is None:
                return []
            assert self._snapshot is not None
            if worker_lineage and self._lineage and worker_lineage != self._lineage:
                return [self._snapshot, *self._deltas] if worker_lineage < self._lineage else []
            if worker_version is not None and worker_version >= latest:
                return []
            if worker_version == self._snapshot.policy_version:
                return list(self._deltas)
            for index, delta in enumerate(self._deltas):
                if delta.policy_version == worker_version:
                    return self._deltas[index + 1 :]
            return [self._snapshot, *self._deltas]

    @property
    def latest_version(self) -> int | None:
        with self._lock:
            return self._latest_locked()

    def latest(self) -> StoredUpdate | None:
        with self._lock:
            return self._latest_update_locked()

    def status(self) -> WeightStoreStatus:
        with self._lock:
            snapshot = self._snapshot
            return WeightStoreStatus(
                latest_version=self._latest_locked(),
                snapshot_version=None if snapshot is None else snapshot.policy_version,
                snapshot_kind=None if snapshot is None else kind_name(snapshot.kind),
                num_deltas=len(self._deltas),
                num_bytes=(0 if snapshot is None else snapshot.num_bytes) + self._delta_bytes_locked(),
                num_accepted=self._num_accepted,
                num_refused=self._num_refused,
                lineage=self._lineage,
                lineage_base_version=self._lineage_base_version,
                num_rollbacks=self._num_rollbacks,
            )

    def latest_policy(self) -> tuple[int | None, int, int, int]:
        """``(latest version or None, lineage, lineage_base_version, num_rollbacks)``: what ``status()`` says of the
        latest policy, without the rest (asked at every heartbeat and every subscriber's HELLO)."""
        with self._lock:
            return self._latest_locked(), self._lineage, self._lineage_base_version, self._num_rollbacks

    @property
    def lineage(self) -> int:
        with self._lock:
            return self._lineage

    @property
    def newest_lineage(self) -> int:
        """The newest lineage known: held, or handed out by the registry (what a refusal tells its sender)."""
        with self._lock:
            return max(self._lineage, self._lineage_floor)

    def refuse_lineages_below(self, lineage: int) -> None:
        """From now on refuse every update of a lineage below ``lineage`` (the registry handed it to a new trainer
        incarnation: the ones before it are replaced, whether or not the new one has published yet)."""
        with self._lock:
            self._lineage_floor = max(self._lineage_floor, lineage)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the durability writer (after it wrote the latest chain, within ``timeout_s``); True when done."""
        return True if self._durable is None else self._durable.stop(timeout_s)

    def _latest_locked(self) -> int | None:
        if self._deltas:
            return self._deltas[-1].policy_version
        return None if self._snapshot is None else self._snapshot.policy_version

    def _delta_bytes_locked(self) -> int:
        return sum(d.num_bytes for d in self._deltas)
