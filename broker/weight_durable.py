"""The latest policy on disk: the weight store's snapshot and deltas survive a broker restart.

The broker keeps its latest chain (snapshot + deltas) durable in the spool directory, so that a worker that joins
after a broker restart gets the current policy even while the trainer is down. The writes happen on this module's
writer thread after the trainer was acknowledged, never on the weight plane's IO thread, and coalesce (a version
superseded while an older one is written is never written). The one synchronous write is ``LINEAGE`` (a few
bytes), when a trainer incarnation replaces another, before that update is acknowledged.

Layout of the directory (``<spool_dir>/weights``; the rollout spool ignores sub-directories, its lock covers it):

    LINEAGE     JSON {"lineage": int, "lineage_base_version": int, "num_rollbacks": int}: the newest lineage
                accepted, and the rollbacks counted so far (run status keeps them over a restart). Written
                atomically before a new lineage's first update is acknowledged, and MANIFEST removed, so after a
                crash the disk never offers a replaced lineage's weights as current (a restarted broker refuses
                the replaced trainer's late updates too).
    MANIFEST    JSON {"lineage": int, "updates": [file names]}: the snapshot, then its deltas in order. Written
                atomically after every file it names is durable; the files it no longer names are then deleted.
    <name>.wupd one accepted update (format below), named ``<kind>-v<version>-l<lineage>.wupd``.

File format of an update (integers little-endian), as the rollout spool's batch files::

    offset  size  field
    0       8     magic  b"PRMLWU01"
    8       4     header_len   uint32: bytes of the WeightUpdateHeader protobuf
    12      8     payload_len  uint64
    20      4     crc32        zlib CRC-32 over the header (the payload is checked by the header's digest)
    24      h     WeightUpdateHeader, serialized
    24+h    p     payload (safetensors bytes, exactly as published)

Every file is written to a temporary name, fsynced, renamed, and the directory fsynced: no pass over the payload but the
write (the digest that the broker verified on arrival covers it). At load, a chain that fails any check (the CRC, the
header's digest of the payload, a delta that does not continue the chain, a lineage other than the manifest's) is
dropped with one error line: the broker starts without a snapshot, and the trainer's next publish (a FULL, since its
delta is refused) restores one.
"""

from __future__ import annotations

import json
import mmap
import struct
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.broker.stored_update import DELTA, SNAPSHOT_KINDS, InTransit, StoredUpdate, kind_name
from primerl.proto.digests import digest_matches
from primerl.proto.v1 import data_pb2
from primerl.runtime.durable_files import fsync_dir, write_atomically
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    from primerl.broker.weight_store import WeightStore

log = get_logger(__name__)

MAGIC = b"PRMLWU01"
PREFIX = struct.Struct("<8sIQI")
LINEAGE_FILE = "LINEAGE"
MANIFEST_FILE = "MANIFEST"
UPDATE_SUFFIX = ".wupd"
TEMP_SUFFIX = ".tmp"
WRITER_IDLE_S = 1.0
"""The writer thread checks for a stop request at least this often."""


class DurableWeightsError(RuntimeError):
    """A durable weight file is damaged or does not continue the chain."""


def update_file_name(update: StoredUpdate) -> str:
    return f"{kind_name(update.kind).lower()}-v{update.policy_version}-l{update.lineage}{UPDATE_SUFFIX}"


class WeightDurability:
    """Mirrors a ``WeightStore``'s chain to ``directory`` on a writer thread; see the module docstring."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()  # orders LINEAGE changes against MANIFEST writes
        self._lineage = 0
        self._written: set[str] = set()
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._requested = 0  # changes notified, and the count the last finished write covered
        self._done = 0
        self._store: WeightStore | None = None
        self._thread: threading.Thread | None = None
        self.num_files_written = 0
        self.num_bytes_written = 0
        self.last_error: str | None = None

    # -- start-up ------------------------------------------------------------------------------------

    def load(self) -> tuple[int, int, int, list[StoredUpdate]]:
        """(lineage, lineage_base_version, num_rollbacks, [snapshot, *deltas]) from the directory (created if
        missing); a LINEAGE from before the rollback count says 0 rollbacks."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(f"*{TEMP_SUFFIX}"):
            leftover.unlink(missing_ok=True)
        lineage, base_version, num_rollbacks = 0, 0, 0
        lineage_path = self.directory / LINEAGE_FILE
        if lineage_path.exists():
            try:
                record = json.loads(lineage_path.read_text())
                lineage, base_version = int(record["lineage"]), int(record["lineage_base_version"])
                num_rollbacks = int(record.get("num_rollbacks", 0))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("durable weights: LINEAGE unreadable; ignoring it", path=str(lineage_path), error=str(exc))
        self._lineage = lineage
        updates: list[StoredUpdate] = []
        manifest_path = self.directory / MANIFEST_FILE
        if manifest_path.exists():
            try:
                updates = self._load_chain(manifest_path, lineage)
            except (DurableWeightsError, OSError, ValueError, KeyError, TypeError) as exc:
                log.error(
                    "durable weights: the saved chain is unusable; starting without a snapshot",
                    directory=str(self.directory),
                    error=str(exc),
                )
                manifest_path.unlink(missing_ok=True)
                updates = []
        self._written = {update_file_name(u) for u in updates}
        return lineage, base_version, num_rollbacks, updates

    def _load_chain(self, manifest_path: Path, lineage: int) -> list[StoredUpdate]:
        manifest = json.loads(manifest_path.read_text())
        if int(manifest["lineage"]) != lineage:
            raise DurableWeightsError(f"MANIFEST is of lineage {manifest['lineage']} but LINEAGE says {lineage}")
        updates: list[StoredUpdate] = []
        for name in manifest["updates"]:
            update = _read_update(self.directory / str(name))
            if update.lineage != lineage:
                raise DurableWeightsError(f"{name}: lineage {update.lineage}, the manifest's is {lineage}")
            if not updates:
                if update.kind not in SNAPSHOT_KINDS:
                    raise DurableWeightsError(f"{name}: a chain starts with a FULL or LORA update")
            elif update.kind != DELTA or update.base_version != updates[-1].policy_version:
                raise DurableWeightsError(f"{name} does not continue the chain at v{updates[-1].policy_version}")
            updates.append(update)
        return updates

    def start(self, store: WeightStore) -> None:
        """Start the writer thread mirroring ``store`` (``WeightStore.attach_durable`` calls this)."""
        if self._thread is not None:
            raise RuntimeError("WeightDurability.start() called twice")
        self._store = store
        self._thread = threading.Thread(target=self._run, name="weight-durable-writer", daemon=True)
        self._thread.start()

    # -- called by the store -------------------------------------------------------------------------

    def set_lineage(self, lineage: int, base_version: int, num_rollbacks: int = 0) -> None:
        """A new lineage was accepted: record it (with the rollbacks counted so far) and withdraw the old chain,
        durably, before returning."""
        with self._lock:
            (self.directory / MANIFEST_FILE).unlink(missing_ok=True)
            record = {"lineage": lineage, "lineage_base_version": base_version, "num_rollbacks": num_rollbacks}
            _write_atomic(self.directory / LINEAGE_FILE, json.dumps(record).encode())
            self._lineage = lineage
        log.info("durable weights: new lineage recorded", lineage=lineage, lineage_base_version=base_version)

    def notify(self) -> None:
        """The store changed: the writer writes its chain soon."""
        with self._idle:
            self._requested += 1
        self._wanted.set()

    # -- the writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._store is not None
        while True:
            self._wanted.wait(WRITER_IDLE_S)
            self._wanted.clear()
            with self._idle:
                target = self._requested
            if target > self._done:
                lineage, chain = self._store.durable_chain()
                if not self._stop.is_set() and self._readers_busy(chain):
                    continue  # the plane notifies again once they are done (or gone); at stop it is written anyway
                try:
                    self._write_chain(lineage, chain)
                    self.last_error = None
                except OSError as exc:  # a full or failing disk: serving goes on from memory; said once per error
                    if str(exc) != self.last_error:
                        log.error(
                            "durable weights: could not write the latest chain; a broker restart would lose it",
                            directory=str(self.directory),
                            error=str(exc),
                        )
                    self.last_error = str(exc)
                with self._idle:
                    self._done = target
                    self._idle.notify_all()
            if self._stop.is_set():
                with self._idle:
                    if self._done >= self._requested:
                        return

    def _readers_busy(self, chain: list[StoredUpdate]) -> bool:
        """An update of ``chain`` not written yet lies in a trainer's shared segment that same-host workers are
        loading from now: its file waits until they are done, so that writing it (a copy of the whole payload) does
        not take the cores they load with (``broker.shared_updates``)."""
        return any(
            update.shared is not None and update.shared.readers and update_file_name(update) not in self._written
            for update in chain
        )

    def _write_chain(self, lineage: int, chain: list[StoredUpdate]) -> None:
        names = []
        for update in chain:
            name = update_file_name(update)
            names.append(name)
            if name not in self._written:
                _write_update(self.directory / name, update)
                self._written.add(name)
                self.num_files_written += 1
                self.num_bytes_written += update.num_bytes
        with self._lock:
            if lineage != self._lineage:
                return  # a newer lineage arrived meanwhile: its own round writes its chain
            if chain:
                manifest = json.dumps({"lineage": lineage, "updates": names}).encode()
                _write_atomic(self.directory / MANIFEST_FILE, manifest)
            keep = set(names)
            removed = False
            for path in self.directory.glob(f"*{UPDATE_SUFFIX}"):
                if path.name not in keep:
                    path.unlink(missing_ok=True)
                    self._written.discard(path.name)
                    removed = True
            if removed:
                fsync_dir(self.directory)
        if chain:
            log.debug(
                "durable weights written",
                latest_version=chain[-1].policy_version,
                lineage=lineage,
                num_updates=len(chain),
            )

    def payload_on_disk(self, update: StoredUpdate) -> memoryview | None:
        """A read-only view of ``update``'s payload mapped from its durable file (pages of the page cache, not of
        this process's heap), or None when that file is not written (yet, or any more) or does not match."""
        name = update_file_name(update)
        with self._lock:
            if name not in self._written:
                return None
            try:
                with open(self.directory / name, "rb") as handle:
                    mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                return None
        view = memoryview(mapped)
        if view.nbytes < PREFIX.size:
            return None
        magic, header_len, payload_len, _ = PREFIX.unpack_from(view)
        if magic != MAGIC or payload_len != update.num_bytes or view.nbytes != PREFIX.size + header_len + payload_len:
            return None
        return view[PREFIX.size + header_len :]

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything the store held when called is written (tests, shutdown); True when done."""
        with self._idle:
            target = self._requested
            return self._idle.wait_for(lambda: self._done >= target, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Write what is pending, then end the writer thread within ``timeout_s``; True when it ended."""
        self._stop.set()
        self._wanted.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("durable weights: the writer did not finish in time", timeout_s=timeout_s)
            return False
        return True


def _write_update(path: Path, update: StoredUpdate) -> None:
    header = update.header.SerializeToString()
    crc = zlib.crc32(header)
    write_atomically(
        path,
        [PREFIX.pack(MAGIC, len(header), update.num_bytes, crc), header, *update.segments],
        temp_path=path.with_name(path.name + TEMP_SUFFIX),
    )


def _read_update(path: Path) -> StoredUpdate:
    with open(path, "rb") as handle:  # mapped, not read: the payload stays in the page cache, not in the heap
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    if len(data) < PREFIX.size:
        raise DurableWeightsError(f"{path.name}: {len(data)} bytes, shorter than its prefix")
    magic, header_len, payload_len, crc = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise DurableWeightsError(f"{path.name}: not a durable weight update (magic {magic!r})")
    if len(data) != PREFIX.size + header_len + payload_len:
        raise DurableWeightsError(
            f"{path.name}: {len(data)} bytes, the prefix says {PREFIX.size + header_len + payload_len}"
        )
    view = memoryview(data)
    header_bytes = view[PREFIX.size : PREFIX.size + header_len]
    payload = view[PREFIX.size + header_len :].toreadonly()
    if zlib.crc32(header_bytes) != crc:
        raise DurableWeightsError(f"{path.name}: CRC-32 of the header mismatch (the file is damaged)")
    header = data_pb2.WeightUpdateHeader.FromString(bytes(header_bytes))
    if not digest_matches(payload, header.digest):
        raise DurableWeightsError(f"{path.name}: the payload does not match the header's digest")
    return StoredUpdate(header=header, segments=[payload], transit=InTransit(on_disk=True))


def _write_atomic(path: Path, data: bytes) -> None:
    write_atomically(path, [data], temp_path=path.with_name(path.name + TEMP_SUFFIX))
