"""A weight-update payload handed to vLLM's worker through one shared-memory file, not through ``collective_rpc``.

Why: in the server the engine core and its worker are separate processes, so bytes passed to ``collective_rpc``
are msgpack-encoded, sent over a socket, decoded, pickled into vLLM's broadcast queue and unpickled again: four
copies of the payload into freshly allocated memory. On this kind of machine (2 vCPUs, a VM) the first touch of
fresh memory costs more than the copy itself (measured: a 400 MiB copy into fresh memory 420-520 ms, into memory
touched before 30-180 ms). With this file the payload is written once, into pages that stay mapped from one
update to the next, and the worker reads it in place.

Protocol (one writer: the daemon's `PolicyUpdater`, under its lock; readers: the vLLM workers of that engine):

    staging = SharedPayload()                      # a private file in /dev/shm (or a given directory)
    view = staging.buffer(num_bytes)               # writable view of the first num_bytes (file grown as needed)
    view[:] = payload                              # or chunks written straight into it as they arrive
    llm.collective_rpc("primerl_load_full_file", args=(staging.path, num_bytes))
    staging.close()                                # removes the file

Invariants: the writer changes the file only while no worker call on it is running (the updater's lock; a call
returns after the worker copied what it needs into the model and its host copy); the file only grows; a worker
maps it once per size and keeps the mapping (``map_shared``), so later updates cost no page faults there either.
The bytes in the file are trusted as much as the bytes the caller passed: the file is created 0600 by the daemon,
under a random name, and its path is only ever passed through the engine's own RPC.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import uuid
from pathlib import Path

__all__ = ["SharedPayload", "map_shared", "default_staging_dir"]

_SHM_DIR = Path("/dev/shm")
_MAPS: dict[str, tuple[int, int, mmap.mmap]] = {}
_MAPS_LOCK = threading.Lock()


def default_staging_dir() -> Path:
    """/dev/shm when it is a writable directory (memory-backed), else the temporary directory."""
    if _SHM_DIR.is_dir() and os.access(_SHM_DIR, os.W_OK):
        return _SHM_DIR
    return Path(tempfile.gettempdir())


class SharedPayload:
    """A private file, memory-mapped and grown on demand, that carries one payload at a time."""

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        directory = Path(directory) if directory is not None else default_staging_dir()
        self.path = str(directory / f"primerl-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._map: mmap.mmap | None = None
        self._size = 0

    def holds(self, view: memoryview) -> bool:
        """Whether ``view`` is a view of this file's current mapping (a payload already in place)."""
        return self._map is not None and isinstance(view, memoryview) and view.obj is self._map

    @property
    def size_bytes(self) -> int:
        """Bytes the file holds now (its capacity; the payload is a prefix of it)."""
        return self._size

    def buffer(self, num_bytes: int) -> memoryview:
        """A writable view of the file's first ``num_bytes`` (grown first when smaller)."""
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
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
            self._size = size
        return memoryview(self._map)[:num_bytes]

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
    """A read-write view of the first ``num_bytes`` of ``path``, from a mapping kept for the next call (mapped
    again only when the file is replaced or grew beyond it). For the worker side of `SharedPayload`."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    with _MAPS_LOCK:
        stat = os.stat(path)
        if stat.st_size < num_bytes:
            raise ValueError(f"{path} holds {stat.st_size} bytes; {num_bytes} were announced")
        cached = _MAPS.get(path)
        if cached is None or cached[0] != stat.st_ino or cached[1] < num_bytes:
            if cached is not None:
                try:
                    cached[2].close()
                except BufferError:
                    pass  # tensors still view it: it is unmapped when they are gone
            with open(path, "r+b") as file:
                mapping = mmap.mmap(file.fileno(), stat.st_size)
            cached = (stat.st_ino, stat.st_size, mapping)
            _MAPS[path] = cached
        return memoryview(cached[2])[:num_bytes]
