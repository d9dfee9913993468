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

A third file, ``COMMITTED``, holds the highest step the trainer has committed (decimal text), written
atomically the same way. Batches of steps at or below it are deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from primerl.proto.framing import compute_checksum
from primerl.proto.v1 import data_pb2
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.spool")

MAGIC = b"PRMLRB01"
PREFIX = struct.Struct("<8sIQI")  # magic, header_len, payload_len, crc32
PREFIX_BYTES = PREFIX.size  # 24
BATCH_SUFFIX = ".rbatch"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"
COMMITTED_FILE = "COMMITTED"
LOCK_FILE = "LOCK"
MAX_HEADER_BYTES = 16 << 20


class SpoolError(RuntimeError):
    """The spool cannot do what was asked (a disk error, or a batch file that is damaged)."""


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


def batch_file_name(batch_id: str) -> str:
    """Fixed-length, filesystem-safe name of a batch's file (the batch id itself is inside the file)."""
    return hashlib.sha256(batch_id.encode()).hexdigest()[:40] + BATCH_SUFFIX


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(directory: Path, name: str, parts: Iterable[Any]) -> int:
    """Write ``parts`` to ``directory/name`` via temp file + fsync + rename + directory fsync; returns bytes."""
    final = directory / name
    temp = directory / f".{name}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
    num_bytes = 0
    try:
        with open(temp, "wb", buffering=0) as handle:
            for part in parts:
                view = memoryview(part).cast("B")
                while view.nbytes:
                    written = handle.write(view)
                    num_bytes += written
                    view = view[written:]
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return num_bytes


def _as_view(data: Any) -> memoryview:
    view = memoryview(getattr(data, "buffer", data))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class RolloutSpool:
    """Rollout batches on disk, with an in-memory index of headers and sizes.

    Thread-safe: the index has its own lock; file reads (``get``) happen outside it, so a reader only
    ever sees a batch that is wholly written, or ``BatchGone`` if it was deleted meanwhile.
    """

    def __init__(self, directory: str | os.PathLike[str], *, verify_on_read: bool = True):
        self.directory = Path(directory)
        self.verify_on_read = verify_on_read
        self._lock = threading.Lock()
        self._entries: dict[str, SpoolEntry] = {}
        self._num_file_bytes = 0
        self._committed_step: int | None = None
        self._loaded = False
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ start-up

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
                entry, _ = self._read_file(path, verify=True)
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
            _fsync_dir(self.directory)
        with self._lock:
            self._entries = entries
            self._num_file_bytes = sum(e.file_bytes for e in entries.values())
            self._committed_step = committed
            self._loaded = True
        log.info("spool loaded", directory=str(self.directory), num_batches=len(entries),
                 num_bytes=self._num_file_bytes, committed_step=committed)
        return dict(entries)

    # ------------------------------------------------------------------ batches

    def put(self, batch_id: str, header_bytes: bytes, payload: Any, *, crc32: int | None = None) -> bool:
        """Write one batch durably. Returns False (and writes nothing) if ``batch_id`` is already spooled.

        ``header_bytes`` is the serialized RolloutBatchHeader whose ``batch_id`` equals ``batch_id``;
        ``payload`` any bytes-like object (a received zmq frame's buffer works). ``crc32``, when given, is
        the already verified envelope checksum of exactly these bytes (see the module docstring).
        """
        self._check_loaded()
        if not batch_id:
            raise ValueError("batch_id must not be empty")
        if len(header_bytes) > MAX_HEADER_BYTES:
            raise ValueError(f"batch header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
        header = _parse_header(header_bytes)
        if header is None or header.batch_id != batch_id:
            raise ValueError(f"header_bytes must be a RolloutBatchHeader with batch_id {batch_id!r}")
        with self._lock:
            if batch_id in self._entries:
                return False
        view = _as_view(payload)
        if crc32 is None:
            crc32 = compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [view])
        prefix = PREFIX.pack(MAGIC, len(header_bytes), view.nbytes, crc32)
        name = batch_file_name(batch_id)
        try:
            file_bytes = _write_atomic(self.directory, name, [prefix, header_bytes, view])
        except OSError as exc:
            raise SpoolError(f"cannot write batch {batch_id!r} to {self.directory}: {exc}") from exc
        entry = SpoolEntry(batch_id, header, self.directory / name, view.nbytes, file_bytes)
        with self._lock:
            if batch_id in self._entries:  # a concurrent put of the same batch won; same bytes on disk
                return False
            self._entries[batch_id] = entry
            self._num_file_bytes += file_bytes
        return True

    def get(self, batch_id: str) -> tuple[data_pb2.RolloutBatchHeader, memoryview]:
        """The header and payload of a spooled batch. The payload is a view of one buffer read from disk
        (send it with ``copy=False``). Raises ``BatchGone`` or ``SpoolCorruption`` (file quarantined)."""
        with self._lock:
            entry = self._entries.get(batch_id)
        if entry is None:
            raise BatchGone(batch_id)
        try:
            read_entry, payload = self._read_file(entry.path, verify=self.verify_on_read)
        except FileNotFoundError:
            raise BatchGone(batch_id) from None
        except SpoolCorruption:
            with self._lock:
                if self._entries.pop(batch_id, None) is not None:
                    self._num_file_bytes -= entry.file_bytes
            raise
        return read_entry.header, payload

    def delete(self, batch_ids: Iterable[str]) -> int:
        """Delete batches (missing ones are skipped); returns how many were deleted."""
        self._check_loaded()
        deleted = 0
        with self._lock:
            entries = [self._entries.pop(b) for b in batch_ids if b in self._entries]
            for entry in entries:
                self._num_file_bytes -= entry.file_bytes
        for entry in entries:
            try:
                entry.path.unlink()
                deleted += 1
            except FileNotFoundError:
                deleted += 1
            except OSError as exc:
                log.error("spool: cannot delete a released batch file", path=str(entry.path), error=str(exc))
        if entries:
            _fsync_dir(self.directory)
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

    # ------------------------------------------------------------------ commit marker

    @property
    def committed_step(self) -> int | None:
        with self._lock:
            return self._committed_step

    def set_committed_step(self, step: int) -> None:
        """Record durably that every step up to ``step`` is committed (written before batches are deleted)."""
        self._check_loaded()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        _write_atomic(self.directory, COMMITTED_FILE, [f"{step}\n".encode()])
        with self._lock:
            self._committed_step = step

    def close(self) -> None:
        """Release the directory lock (the files stay). The process exiting, even killed, does the same."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._loaded = False

    # ------------------------------------------------------------------ internals

    def _lock_directory(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolError(f"spool directory {self.directory} is in use by another broker (or another spool in this "
                             "process); give each broker its own spool_dir") from None
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

    def _read_file(self, path: Path, *, verify: bool) -> tuple[SpoolEntry, memoryview]:
        with open(path, "rb", buffering=0) as handle:
            file_bytes = os.fstat(handle.fileno()).st_size
            if file_bytes < PREFIX_BYTES:
                self._quarantine(path, f"file of {file_bytes} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
            magic, header_len, payload_len, crc = PREFIX.unpack(handle.read(PREFIX_BYTES))
            if magic != MAGIC:
                self._quarantine(path, f"magic {magic!r} is not {MAGIC!r}")
            if header_len > MAX_HEADER_BYTES or PREFIX_BYTES + header_len + payload_len != file_bytes:
                self._quarantine(path, f"lengths (header {header_len}, payload {payload_len}) do not add up to the file size {file_bytes}")
            buffer = bytearray(header_len + payload_len)
            view = memoryview(buffer)
            filled = 0
            while filled < len(buffer):
                num = handle.readinto(view[filled:])
                if not num:
                    self._quarantine(path, "file ended early")
                filled += num
        header_bytes = bytes(view[:header_len])
        payload = view[header_len:]
        if verify and compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [payload]) != crc:
            self._quarantine(path, "CRC-32 does not match (torn or damaged write)")
        header = _parse_header(header_bytes)
        if header is None or not header.batch_id:
            self._quarantine(path, "header is not a RolloutBatchHeader with a batch id")
        entry = SpoolEntry(header.batch_id, header, path, payload_len, file_bytes)
        return entry, payload

    def _quarantine(self, path: Path, reason: str) -> None:
        """Move a damaged file aside (kept for inspection) and raise SpoolCorruption."""
        target_dir = self.directory / QUARANTINE_DIR
        try:
            target_dir.mkdir(exist_ok=True)
            target = target_dir / f"{path.name}.{time.time_ns()}"
            os.replace(path, target)
            _fsync_dir(self.directory)
        except OSError as exc:
            target = None
            log.error("spool: cannot quarantine a damaged file", path=str(path), error=str(exc))
        log.error("spool: damaged batch file quarantined", path=str(path), reason=reason,
                  moved_to=str(target) if target else None)
        raise SpoolCorruption(f"{path}: {reason}")


def _parse_header(header_bytes: bytes) -> data_pb2.RolloutBatchHeader | None:
    header = data_pb2.RolloutBatchHeader()
    try:
        header.ParseFromString(header_bytes)
    except DecodeError:
        return None
    return header
