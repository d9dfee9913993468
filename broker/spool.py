"""The rollout spool: one file per rollout batch, kept on disk until the trainer commits its step.

A batch file is written atomically: to a temporary file in the same directory, fsynced, renamed to its
final name, and the directory fsynced, so after a crash (even SIGKILL or power loss) a batch is either
wholly present under its final name or absent. Leftover temporary files are removed on ``load``. A CRC
over the whole record catches a file that is torn or damaged anyway (a disk that lied about fsync); such
a file is moved to ``quarantine/`` with one log line, never parsed further and never deleted.

File format of ``<sha256(batch_id)[:40]>.rbatch`` (all integers little-endian)::

    offset  size  field
    0       8     magic  b"PRMLRB01" (format version 01)
    8       4     header_len   uint32: bytes of the RolloutBatchHeader protobuf
    12      8     payload_len  uint64: bytes of the safetensors payload
    20      4     crc32        uint32: zlib CRC-32 over bytes([ROLLOUT_BATCH]) + header + payload
    24      h     RolloutBatchHeader, serialized (its batch_id names the batch)
    24+h    p     payload: one safetensors blob, exactly as the producer sent it

The CRC is the data plane's envelope checksum of the same header and payload
(``framing.compute_checksum``), so a batch that arrived with a verified checksum is spooled without
computing it again. The file is exactly ``24 + h + p`` bytes. Nothing here unpickles anything.

``LOCK`` is held with ``flock`` by the one process that uses the directory (released by the kernel when
that process dies, even by SIGKILL), so two brokers never share a spool.

Group commit (``put_many``): the batches of one group are each written to their temporary file, then
every file is fsynced, renamed, and the directory fsynced once; ``put_many`` returns only after that, so
a caller that acks after it never acks a batch that a crash could lose. A crash in the middle leaves each
batch of the group wholly present or absent, exactly as ``put`` does.

Read cache (decision): the payloads of recently spooled batches stay in memory, as the read-only buffers
they arrived in, up to ``cache_max_bytes`` (oldest evicted first), so handing a batch to a trainer shortly
after it arrived costs neither a disk read nor a CRC pass. A cached record is the same bytes whose CRC was
verified on arrival and that are on disk. ``cache_max_bytes=0`` turns the cache off.

A write that fails for lack of space raises ``SpoolFull`` (a ``SpoolError``) with nothing of it kept: the rollout
queue answers the batches with back-pressure.

A third file, ``COMMITTED``, holds the highest step the trainer has committed (decimal text), written
atomically the same way. Batches of steps at or below it are deleted.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primerl.broker.spool_format import (
    BATCH_SUFFIX,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    DamagedBatchFile,
    as_byte_view,
    batch_file_name,
    parse_header,
    read_batch_file,
)
from primerl.proto.framing import compute_checksum
from primerl.proto.units import MiB
from primerl.proto.v1 import data_pb2
from primerl.runtime.durable_files import fsync_dir, write_files_atomically
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.spool")

TEMP_SUFFIX = ".tmp"  # of the temporary files of atomic writes (``write_files_atomically``)
QUARANTINE_DIR = "quarantine"
COMMITTED_FILE = "COMMITTED"
LOCK_FILE = "LOCK"
DEFAULT_CACHE_MAX_BYTES = 256 * MiB


class SpoolError(RuntimeError):
    """The spool cannot do what was asked (a disk error, or a batch file that is damaged)."""


class SpoolFull(SpoolError):
    """A write failed for lack of space on the spool's filesystem (ENOSPC or EDQUOT); nothing of it was kept."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a filesystem out of space (or out of quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class SpoolCorruption(SpoolError):
    """A batch file failed its checks; it has been moved to the quarantine directory."""


class BatchGone(KeyError):
    """The batch is not (or no longer) in the spool, e.g. released by a commit meanwhile."""


@dataclass(frozen=True)
class SpoolEntry:
    """What the index keeps in memory per batch: the parsed header and sizes, never the payload."""

    batch_id: str
    header: data_pb2.RolloutBatchHeader
    path: Path
    payload_bytes: int
    file_bytes: int


class RolloutSpool:
    """Rollout batches on disk, with an in-memory index of headers and sizes.

    Thread-safe: the index has its own lock; file reads (``get``) happen outside it, so a reader only
    ever sees a batch that is wholly written, or ``BatchGone`` if it was deleted meanwhile.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        verify_on_read: bool = True,
        cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES,
    ):
        if cache_max_bytes < 0:
            raise ValueError(f"cache_max_bytes must be >= 0, got {cache_max_bytes}")
        self.directory = Path(directory)
        self.verify_on_read = verify_on_read
        self.cache_max_bytes = cache_max_bytes
        # batch id -> (header bytes, payload view, crc32) of recently spooled batches, oldest first
        self._cache: OrderedDict[str, tuple[bytes, memoryview, int]] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        self._entries: dict[str, SpoolEntry] = {}
        self._num_file_bytes = 0
        self._committed_step: int | None = None
        self._loaded = False
        self._lock_fd: int | None = None

    def load(self) -> dict[str, SpoolEntry]:
        """Lock the directory for this process, create it if needed, remove temporary leftovers, quarantine
        damaged files, delete batches of committed steps, and index the rest. Returns the index
        (batch id -> entry). Raises ``SpoolError`` if another spool (another broker) holds the directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_directory()
        committed = self._read_committed()
        entries: dict[str, SpoolEntry] = {}
        removed_any = False
        for path in sorted(self.directory.iterdir()):
            if not path.is_file():
                continue
            if path.name.endswith(TEMP_SUFFIX):
                log.warning("spool: removing a partly written file left by a crash", path=str(path))
                path.unlink(missing_ok=True)
                removed_any = True
                continue
            if not path.name.endswith(BATCH_SUFFIX):
                continue
            try:
                entry = self._read_file(path, verify=True)[0]
            except SpoolCorruption:
                continue  # quarantined and logged by _read_file
            if entry.batch_id in entries or batch_file_name(entry.batch_id) != path.name:
                self._quarantine(path, f"file name does not match batch id {entry.batch_id!r}")
                continue
            if committed is not None and entry.header.step <= committed:
                path.unlink(missing_ok=True)  # released before a crash finished deleting it
                removed_any = True
                continue
            entries[entry.batch_id] = entry
        if removed_any:
            fsync_dir(self.directory)
        with self._lock:
            self._entries = entries
            self._num_file_bytes = sum(e.file_bytes for e in entries.values())
            self._committed_step = committed
            self._loaded = True
        log.info(
            "spool loaded",
            directory=str(self.directory),
            num_batches=len(entries),
            num_bytes=self._num_file_bytes,
            committed_step=committed,
        )
        return dict(entries)

    def put(self, batch_id: str, header_bytes: bytes, payload: Any, *, crc32: int | None = None) -> bool:
        """Write one batch durably. Returns False (and writes nothing) if ``batch_id`` is already spooled.

        ``header_bytes`` is the serialized RolloutBatchHeader whose ``batch_id`` equals ``batch_id``;
        ``payload`` any bytes-like object (a received zmq frame's buffer works). ``crc32``, when given, is
        the already verified envelope checksum of exactly these bytes (see the module docstring).
        """
        return self.put_many([(batch_id, header_bytes, payload, crc32)])[0]

    def put_many(self, records: Sequence[tuple[str, bytes, Any, int | None]]) -> list[bool]:
        """Write a group of batches ``(batch_id, header_bytes, payload, crc32)`` durably together (group
        commit: one fsync per file, one directory fsync); returns, per record, whether it was written
        (False: already spooled, or a repeat of an earlier record of the group). Every record is checked
        before anything is written; raises ``ValueError`` for a bad record and ``SpoolError`` on a disk
        failure (then none of the group is indexed)."""
        self._check_loaded()
        prepared: list[tuple[str, data_pb2.RolloutBatchHeader, bytes, memoryview, int] | None] = []
        seen: set[str] = set()
        for batch_id, header_bytes, payload, crc32 in records:
            if not batch_id:
                raise ValueError("batch_id must not be empty")
            if len(header_bytes) > MAX_HEADER_BYTES:
                raise ValueError(f"batch header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
            header = parse_header(header_bytes)
            if header is None or header.batch_id != batch_id:
                raise ValueError(f"header_bytes must be a RolloutBatchHeader with batch_id {batch_id!r}")
            with self._lock:
                known = batch_id in self._entries
            if known or batch_id in seen:
                prepared.append(None)
                continue
            seen.add(batch_id)
            view = as_byte_view(payload).toreadonly()
            if crc32 is None:
                crc32 = compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [view])
            prepared.append((batch_id, header, bytes(header_bytes), view, crc32))
        files = [
            (batch_file_name(p[0]), [PREFIX.pack(MAGIC, len(p[2]), p[3].nbytes, p[4]), p[2], p[3]])
            for p in prepared
            if p is not None
        ]
        if not files:
            return [False] * len(prepared)
        try:
            sizes = iter(write_files_atomically(self.directory, files))
        except OSError as exc:
            if is_disk_full(exc):
                raise SpoolFull(
                    f"no space left for {len(files)} batch(es) in {self.directory} ({exc.strerror})"
                ) from exc
            raise SpoolError(f"cannot write {len(files)} batch(es) to {self.directory}: {exc}") from exc
        written: list[bool] = []
        with self._lock:
            for item in prepared:
                if item is None:
                    written.append(False)
                    continue
                batch_id, header, header_bytes, view, crc32 = item
                file_bytes = next(sizes)
                if batch_id in self._entries:  # a concurrent put of the same batch won; same bytes on disk
                    written.append(False)
                    continue
                self._entries[batch_id] = SpoolEntry(
                    batch_id, header, self.directory / batch_file_name(batch_id), view.nbytes, file_bytes
                )
                self._num_file_bytes += file_bytes
                self._cache_put_locked(batch_id, header_bytes, view, crc32)
                written.append(True)
        return written

    def get_record(self, batch_id: str) -> tuple[bytes, memoryview, int]:
        """(header bytes, payload view, crc32) of a spooled batch, exactly as spooled: what a relay needs to
        send it on without re-serializing the header or computing the CRC again (``framing.encode_raw``).
        From the read cache when there, else from disk (checked like ``get``)."""
        with self._lock:
            cached = self._cache.get(batch_id)
            entry = self._entries.get(batch_id)
        if entry is None:
            raise BatchGone(batch_id)
        if cached is not None:
            return cached
        header, payload, crc32, header_bytes = self._read_entry(batch_id, entry)
        return header_bytes, payload, crc32

    def get(self, batch_id: str) -> tuple[data_pb2.RolloutBatchHeader, memoryview]:
        """The header and payload of a spooled batch. The payload is a view of one buffer read from disk
        (send it with ``copy=False``). Raises ``BatchGone`` or ``SpoolCorruption`` (file quarantined)."""
        with self._lock:
            entry = self._entries.get(batch_id)
        if entry is None:
            raise BatchGone(batch_id)
        header, payload, _, _ = self._read_entry(batch_id, entry)
        return header, payload

    def _read_entry(
        self, batch_id: str, entry: SpoolEntry
    ) -> tuple[data_pb2.RolloutBatchHeader, memoryview, int, bytes]:
        try:
            read_entry, payload, crc32, header_bytes = self._read_file(entry.path, verify=self.verify_on_read)
        except FileNotFoundError:
            raise BatchGone(batch_id) from None
        except SpoolCorruption:
            with self._lock:
                if self._entries.pop(batch_id, None) is not None:
                    self._num_file_bytes -= entry.file_bytes
                self._cache_drop_locked(batch_id)
            raise
        return read_entry.header, payload, crc32, header_bytes

    def delete(self, batch_ids: Iterable[str]) -> int:
        """Delete batches (missing ones are skipped); returns how many were deleted."""
        self._check_loaded()
        deleted = 0
        with self._lock:
            entries = [self._entries.pop(b) for b in batch_ids if b in self._entries]
            for entry in entries:
                self._num_file_bytes -= entry.file_bytes
                self._cache_drop_locked(entry.batch_id)
        for entry in entries:
            try:
                entry.path.unlink(missing_ok=True)
            except OSError as exc:
                log.error("spool: cannot delete a released batch file", path=str(entry.path), error=str(exc))
                continue
            deleted += 1
        if entries:
            fsync_dir(self.directory)
        return deleted

    def entries(self) -> list[SpoolEntry]:
        """A snapshot of the index."""
        with self._lock:
            return list(self._entries.values())

    def entry(self, batch_id: str) -> SpoolEntry | None:
        with self._lock:
            return self._entries.get(batch_id)

    def __contains__(self, batch_id: object) -> bool:
        with self._lock:
            return batch_id in self._entries

    @property
    def num_batches(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Bytes of all batch files (prefix + header + payload)."""
        with self._lock:
            return self._num_file_bytes

    @property
    def committed_step(self) -> int | None:
        with self._lock:
            return self._committed_step

    def set_committed_step(self, step: int) -> None:
        """Record durably that every step up to ``step`` is committed (written before batches are deleted)."""
        self._check_loaded()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        write_files_atomically(self.directory, [(COMMITTED_FILE, [f"{step}\n".encode()])])
        with self._lock:
            self._committed_step = step

    @property
    def num_cached_bytes(self) -> int:
        """Payload bytes held by the read cache (at most ``cache_max_bytes``)."""
        with self._lock:
            return self._cache_bytes

    def close(self) -> None:
        """Release the directory lock (the files stay). The process exiting, even killed, does the same."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._loaded = False

    def _cache_put_locked(self, batch_id: str, header_bytes: bytes, payload: memoryview, crc32: int) -> None:
        if payload.nbytes > self.cache_max_bytes:
            return
        self._cache[batch_id] = (header_bytes, payload, crc32)
        self._cache_bytes += payload.nbytes
        while self._cache_bytes > self.cache_max_bytes:
            _, (_, evicted, _) = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.nbytes

    def _cache_drop_locked(self, batch_id: str) -> None:
        dropped = self._cache.pop(batch_id, None)
        if dropped is not None:
            self._cache_bytes -= dropped[1].nbytes

    def _lock_directory(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolError(
                f"spool directory {self.directory} is in use by another broker (or another spool in this "
                "process); give each broker its own spool_dir"
            ) from None
        self._lock_fd = fd

    def _check_loaded(self) -> None:
        if not self._loaded:
            raise SpoolError("call RolloutSpool.load() before using the spool")

    def _read_committed(self) -> int | None:
        path = self.directory / COMMITTED_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            step = int(text.strip())
            if step < 0:
                raise ValueError(step)
        except ValueError:
            self._quarantine(path, f"commit marker holds {text[:40]!r}, not a step number")
            return None
        return step

    def _read_file(self, path: Path, *, verify: bool) -> tuple[SpoolEntry, memoryview, int, bytes]:
        try:
            header, header_bytes, payload, crc, file_bytes = read_batch_file(path, verify=verify)
        except DamagedBatchFile as exc:
            self._quarantine(path, str(exc))
        entry = SpoolEntry(header.batch_id, header, path, payload.nbytes, file_bytes)
        return entry, payload, crc, header_bytes

    def _quarantine(self, path: Path, reason: str) -> None:
        """Move a damaged file aside (kept for inspection) and raise SpoolCorruption."""
        target_dir = self.directory / QUARANTINE_DIR
        try:
            target_dir.mkdir(exist_ok=True)
            target = target_dir / f"{path.name}.{time.time_ns()}"
            os.replace(path, target)
            fsync_dir(self.directory)
        except OSError as exc:
            target = None
            log.error("spool: cannot quarantine a damaged file", path=str(path), error=str(exc))
        log.error(
            "spool: damaged batch file quarantined",
            path=str(path),
            reason=reason,
            moved_to=str(target) if target else None,
        )
        raise SpoolCorruption(f"{path}: {reason}")
