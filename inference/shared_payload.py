"""A weight-update payload handed to vLLM's worker through a shared-memory file, not through ``collective_rpc``.

Bytes passed to ``collective_rpc`` are copied four times into fresh memory between the engine core and its worker
processes; through this file the payload is written once, into pages that stay mapped from one update to the
next, and the worker reads it in place, even while it is still being written.

File layout: one page of control words (`CONTROL_BYTES`), then the payload. The control words are 64-bit
integers, each written by one side only and read by the other after a memory fence:

    word  writer  meaning
    0     daemon  MAGIC
    1     daemon  seq: the transfer the payload belongs to (a new number per `begin`)
    2     daemon  bytes_ready: payload bytes [0, n) are final for seq
    3     daemon  writer_state: RECEIVING, COMPLETE (all bytes final), ABORTED (never complete)
    4     worker  stage_seq: the transfer the worker's staged load works on
    5     worker  stage_state: LOADING, LOADED (ready to switch to), FAILED, DISCARDED
    6     worker  host_views: 1 while the worker's host copy of the weights views this payload (do not write it)

Protocol (one writer: the daemon's `PolicyUpdater`, under its lock or on its weight thread; readers: the vLLM
workers of that engine):

    staging = SharedPayload()                      # a private file in /dev/shm (or a given directory)
    view = staging.buffer(num_bytes)               # writable view of the payload's first num_bytes (grown as needed)
    staging.begin(seq)                             # then, as chunks land: view[a:b] = chunk; staging.publish(b)
    staging.finish(complete=True)
    llm.collective_rpc("primerl_load_full_file", args=(staging.path, num_bytes))   # or a staged load
    staging.close()                                # removes the file

Invariants: within a transfer, payload bytes below ``bytes_ready`` never change; the writer writes a payload only
while no worker call that reads it (other than a staged load of the current transfer) is running, and never while
its ``host_views`` is 1; the file only grows; a worker maps it once per size and keeps the mapping (``map_shared``),
so later updates cost no page faults there either, and tensors viewing it stay valid. The bytes in the file are
trusted as much as the bytes the caller passed: the file is created 0600 by the daemon, under a random name, and
its path is only ever passed through the engine's own RPC.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import uuid
from pathlib import Path

from primerl.proto.shared_segment import segment_directory, unlink_each
from primerl.runtime.process_ids import pid_alive

__all__ = [
    "CONTROL_BYTES",
    "PayloadControl",
    "SharedPayload",
    "default_staging_dir",
    "map_control",
    "forget_stale_maps",
    "map_shared",
    "remove_stale_files",
    "unmap_shared",
]

CONTROL_BYTES = mmap.ALLOCATIONGRANULARITY
"""Bytes before the payload (one page: the payload mapping starts at this offset)."""
MAGIC = 0x31_64_61_6F_6C_79_61_70  # "payload1"
FILE_PREFIX = "primerl-weights-"
"""Shared payload files are named ``primerl-weights-<pid of their creator>-<random>``."""

_MAPS: dict[str, tuple[int, int, mmap.mmap]] = {}
_CONTROLS: dict[str, tuple[int, PayloadControl]] = {}
_MAPS_LOCK = threading.Lock()
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release), as vLLM's shared-memory queues use."""
    with _FENCE:
        pass


class PayloadControl:
    """The control words of a shared payload file (see the module docstring). Each word is read and written as one
    aligned 64-bit integer."""

    SEQ, BYTES_READY, WRITER_STATE, STAGE_SEQ, STAGE_STATE, HOST_VIEWS = 1, 2, 3, 4, 5, 6
    RECEIVING, COMPLETE, ABORTED = 1, 2, 3
    LOADING, LOADED, FAILED, DISCARDED = 1, 2, 3, 4

    def __init__(self, fd: int):
        self._map = mmap.mmap(fd, CONTROL_BYTES)
        self._words = (ctypes.c_uint64 * 8).from_buffer(self._map)

    def read(self, word: int) -> int:
        value = int(self._words[word])
        _fence()
        return value

    def write(self, word: int, value: int) -> None:
        _fence()
        self._words[word] = value

    def stage(self, seq: int) -> int | None:
        """The worker's stage_state for transfer ``seq``; None while it has not taken that transfer up."""
        if self.read(self.STAGE_SEQ) != seq:
            return None
        state = self.read(self.STAGE_STATE)
        return state if self.read(self.STAGE_SEQ) == seq else None


default_staging_dir = segment_directory
"""/dev/shm when it is a writable directory (memory-backed), else the temporary directory."""


def remove_stale_files(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the shared payload files (``primerl-weights-<pid>-*``) in ``directory`` whose creator is dead (a
    daemon killed before it closed them; in /dev/shm they hold memory); returns them. A worker that still maps one
    keeps its mapping."""
    directory = Path(directory) if directory is not None else default_staging_dir()
    pids = {path: path.name[len(FILE_PREFIX) :].split("-", 1)[0] for path in directory.glob(f"{FILE_PREFIX}*")}
    return unlink_each(
        path for path, pid in pids.items() if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid))
    )


class SharedPayload:
    """A private file, memory-mapped and grown on demand, that carries one payload at a time."""

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        directory = Path(directory) if directory is not None else default_staging_dir()
        self.path = str(directory / f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self._fd, CONTROL_BYTES)
        self.control = PayloadControl(self._fd)
        self.control.write(0, MAGIC)
        self._map: mmap.mmap | None = None
        self._size = 0
        self.seq = 0

    def holds(self, view: memoryview) -> bool:
        """Whether ``view`` is a view of this file's current mapping (a payload already in place)."""
        return self._map is not None and isinstance(view, memoryview) and view.obj is self._map

    @property
    def size_bytes(self) -> int:
        """Payload bytes the file holds now (its capacity; the payload is a prefix of it)."""
        return self._size

    def buffer(self, num_bytes: int) -> memoryview:
        """A writable view of the payload's first ``num_bytes`` (the file grown first when smaller)."""
        if self._fd < 0:
            raise RuntimeError("the shared payload file is closed")
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        if num_bytes > self._size or self._map is None:
            size = max(num_bytes, 1)
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # a view of it is still alive: the mapping goes when that view does
                    pass
            os.ftruncate(self._fd, CONTROL_BYTES + size)
            self._map = mmap.mmap(self._fd, size, offset=CONTROL_BYTES)
            self._size = size
        return memoryview(self._map)[:num_bytes]

    def begin(self, seq: int) -> None:
        """A new transfer ``seq`` starts: no byte of it is final yet."""
        self.seq = seq
        self.control.write(PayloadControl.WRITER_STATE, PayloadControl.RECEIVING)
        self.control.write(PayloadControl.BYTES_READY, 0)
        self.control.write(PayloadControl.SEQ, seq)

    def publish(self, bytes_ready: int) -> None:
        """Payload bytes [0, ``bytes_ready``) of the current transfer are final (written before this call)."""
        self.control.write(PayloadControl.BYTES_READY, bytes_ready)

    def finish(self, complete: bool) -> None:
        """The current transfer is complete (every byte final) or ABORTED (it never will be)."""
        self.control.write(PayloadControl.WRITER_STATE, PayloadControl.COMPLETE if complete else PayloadControl.ABORTED)

    def write(self, payload: bytes | bytearray | memoryview) -> int:
        """Copy ``payload`` into the file; returns its size in bytes."""
        source = memoryview(payload)
        if source.format != "B" or source.ndim != 1:
            source = source.cast("B")
        view = self.buffer(source.nbytes)
        view[:] = source
        view.release()
        return source.nbytes

    def close(self) -> None:
        """Remove the file (workers that mapped it keep their mapping until they unmap it)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still exported: the mapping goes when it does
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_shared(path: str, num_bytes: int) -> memoryview:
    """A read-write view of the first ``num_bytes`` of the payload in ``path``, from a mapping kept for the next
    call (mapped again only when the file is replaced or grew beyond it). For the worker side of `SharedPayload`."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    with _MAPS_LOCK:
        stat = os.stat(path)
        capacity = stat.st_size - CONTROL_BYTES
        if capacity < num_bytes:
            raise ValueError(f"{path} holds {max(capacity, 0)} payload bytes; {num_bytes} were announced")
        cached = _MAPS.get(path)
        if cached is None or cached[0] != stat.st_ino or cached[1] < num_bytes:
            if cached is not None:
                try:
                    cached[2].close()
                except BufferError:
                    pass  # tensors still view it: it is unmapped when they are gone
            with open(path, "r+b") as file:
                mapping = mmap.mmap(file.fileno(), capacity, offset=CONTROL_BYTES)
            cached = (stat.st_ino, capacity, mapping)
            _MAPS[path] = cached
            _forget_oldest_foreign_maps()
        return memoryview(cached[2])[:num_bytes]


MAX_FOREIGN_MAPS = 4
"""Mappings of files that are not this module's own (a trainer's shared segments: the same-host road) kept at once;
beyond it the oldest is dropped (a trainer keeps two segments, a restarted one makes new ones)."""


def _forget_oldest_foreign_maps() -> None:
    """Called under ``_MAPS_LOCK`` after a mapping was added: drop the foreign mappings whose file is gone or was
    replaced (a trainer's segment it retired, or a dead trainer's, removed), then keep at most `MAX_FOREIGN_MAPS`."""
    foreign = [path for path in _MAPS if not Path(path).name.startswith(FILE_PREFIX)]
    stale = []
    for path in foreign:
        try:
            if os.stat(path).st_ino != _MAPS[path][0]:
                stale.append(path)
        except OSError:
            stale.append(path)
    live = [path for path in foreign if path not in stale]
    for path in stale + live[: max(0, len(live) - MAX_FOREIGN_MAPS)]:  # dicts keep insertion order: oldest first
        try:
            _MAPS.pop(path)[2].close()
        except BufferError:
            pass  # tensors still view it: it is unmapped when they are gone


def forget_stale_maps() -> None:
    """Unmap the foreign files (trainers' segments) that are gone or were replaced; see `map_shared`."""
    with _MAPS_LOCK:
        _forget_oldest_foreign_maps()


def unmap_shared(path: str) -> None:
    """Forget the mapping `map_shared` keeps of ``path`` (a file this worker reads no more, e.g. a trainer's segment
    its host copy stopped viewing); the pages go once no tensor views them."""
    with _MAPS_LOCK:
        cached = _MAPS.pop(path, None)
    if cached is not None:
        try:
            cached[2].close()
        except BufferError:
            pass  # tensors still view it: it is unmapped when they are gone


def map_control(path: str) -> PayloadControl:
    """The control words of the shared payload file ``path`` (mapped once per file). For the worker side."""
    with _MAPS_LOCK:
        inode = os.stat(path).st_ino
        cached = _CONTROLS.get(path)
        if cached is None or cached[0] != inode:
            fd = os.open(path, os.O_RDWR)
            try:
                control = PayloadControl(fd)
            finally:
                os.close(fd)
            if control.read(0) != MAGIC:
                raise ValueError(f"{path} is not a shared payload file")
            cached = (inode, control)
            _CONTROLS[path] = cached
        return cached[1]
