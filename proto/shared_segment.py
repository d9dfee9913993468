"""Weight payloads handed over in shared memory on one host: the segment file, its writer's pool and its readers.

The same-host road of a weight update (docs/weight-updates.md): the trainer writes the payload once into a
segment (a file in ``/dev/shm``), the broker and the inference workers on its host are given a descriptor of it
(``data_pb2.SharedSegment``: path, host, generation) instead of its bytes, and read it where it lies. The broker
stays the authority: it checks the update as it checks bytes, keeps its durable copy, and says when every reader is
done with the segment, so that the trainer may write it again.

File layout: one page of control words (`CONTROL_BYTES`), then the payload. Each word is a 64-bit integer written
by one side only:

    word  writer   meaning
    0     trainer  MAGIC
    1     trainer  generation: which write the payload is (set once the payload is final, before the descriptor goes)
    2     trainer  payload_bytes of that generation
    3     broker   released: the last generation every reader of which is done (acknowledged, or declared gone)
    4     trainer  the writer's pid

Drain contract (``SegmentPool``): a segment is written again only once ``released`` reached the generation it
last published, or, when that does not come within ``drain_timeout_s`` (a reader hung, the broker restarted), it is
retired instead: unlinked (readers that mapped it keep their mapping and its bytes) and a new one made. So a
reader never sees the bytes under it change while the broker counts it as reading; a reader that maps a segment
after it was reused finds another generation in its control page and refuses it, and the payload digest, checked
before a byte is used, catches the rest.

Privacy and clean-up: segments are created 0600 under names ``primerl-seg-<run>-<pid>-<pool><n>``; a reader opens only
files of that prefix in the shared-memory directory, owned by its own user and private to it. The pool unlinks its
segments on close; ``remove_stale_segments`` removes those whose writer died (a SIGKILLed trainer): the broker
sweeps them, and a new trainer does at start.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import stat
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from primerl.proto.host_identity import host_id
from primerl.proto.v1 import data_pb2

__all__ = [
    "CONTROL_BYTES",
    "MappedSegment",
    "SEGMENT_PREFIX",
    "Segment",
    "SegmentError",
    "SegmentPool",
    "open_segment",
    "remove_stale_segments",
    "segment_directory",
    "stale_segments",
]

CONTROL_BYTES = mmap.ALLOCATIONGRANULARITY
"""Bytes before the payload (one page: the payload mapping starts at this offset)."""
SEGMENT_PREFIX = "primerl-seg-"
MAGIC = 0x31_67_65_73_6D_69_72_70  # "primseg1"
MAGIC_WORD, GENERATION, PAYLOAD_BYTES, RELEASED, WRITER_PID = range(5)
DRAIN_TIMEOUT_S = 10.0
"""Longest wait for a segment's readers to drain before the pool retires it and makes a new one (a reader applies
an update in seconds; a broker restarted meanwhile never releases what its predecessor was given)."""
DRAIN_POLL_S = 0.002
_SHM_DIR = Path("/dev/shm")
_FENCE = threading.Lock()


class SegmentError(ValueError):
    """A descriptor that names no usable segment here: another host's, a missing, foreign or reused file."""


def segment_directory() -> Path:
    """/dev/shm when it is a writable directory (memory-backed), else the temporary directory."""
    if _SHM_DIR.is_dir() and os.access(_SHM_DIR, os.W_OK):
        return _SHM_DIR
    return Path(tempfile.gettempdir())


def _run_tag(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "", run_id)[:24] or "run"


class _Words:
    """The control words of a mapped segment file (aligned 64-bit integers; a lock's acquire and release around
    each access is the memory fence, as in vLLM's shared-memory queues)."""

    def __init__(self, mapping: mmap.mmap, *, writable: bool = True):
        self._mapping = mapping
        self._words = (ctypes.c_uint64 * 8).from_buffer(mapping) if writable else None

    def read(self, word: int) -> int:
        with _FENCE:
            if self._words is None:  # a read-only mapping: one aligned 8-byte load
                return int(struct.unpack_from("<Q", self._mapping, 8 * word)[0])
            return int(self._words[word])

    def write(self, word: int, value: int) -> None:
        assert self._words is not None, "a read-only mapping"
        with _FENCE:
            self._words[word] = value

    def release(self) -> None:
        self._words = None


class Segment:
    """One segment file of a `SegmentPool`, mapped read-write by its writer."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._capacity = 0
        self._map: mmap.mmap | None = None
        os.ftruncate(self._fd, CONTROL_BYTES)
        self._control_map: mmap.mmap | None = mmap.mmap(self._fd, CONTROL_BYTES)
        self.control = _Words(self._control_map)
        self.control.write(MAGIC_WORD, MAGIC)
        self.control.write(WRITER_PID, os.getpid())
        self.generation = 0
        self.published_s: float | None = None  # when the current generation was handed out; None: not in use

    @property
    def capacity(self) -> int:
        return self._capacity

    def view(self, num_bytes: int) -> memoryview:
        """A writable view of the payload's first ``num_bytes`` (the file grown first when smaller). Only while the
        segment is drained (the pool's invariant)."""
        if num_bytes > self._capacity or self._map is None:
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # a view of it is still alive: the mapping goes when that view does
                    pass
            size = max(num_bytes, 1)
            os.ftruncate(self._fd, CONTROL_BYTES + size)
            self._map = mmap.mmap(self._fd, size, offset=CONTROL_BYTES)
            self._capacity = size
        return memoryview(self._map)[:num_bytes]

    def holds(self, view: memoryview) -> bool:
        return self._map is not None and isinstance(view, memoryview) and view.obj is self._map

    def publish(self, num_bytes: int) -> data_pb2.SharedSegment:
        """The payload's first ``num_bytes`` are final: a new generation, and its descriptor."""
        self.generation += 1
        self.control.write(PAYLOAD_BYTES, num_bytes)
        self.control.write(GENERATION, self.generation)
        self.published_s = time.monotonic()
        return data_pb2.SharedSegment(path=str(self.path), host_id=host_id(), generation=self.generation)

    def drained(self) -> bool:
        """Nobody reads the current generation any more (or it was never handed out)."""
        return self.published_s is None or self.control.read(RELEASED) >= self.generation

    def close(self) -> None:
        """Unmap and unlink (readers that mapped it keep their mapping)."""
        for mapping in (self._map, self._control_map):
            if mapping is not None:
                try:
                    mapping.close()
                except BufferError:
                    pass
        self._map = self._control_map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


class SegmentPool:
    """The trainer's segments, at most ``max_segments`` in use at once; see the module docstring's drain contract."""

    def __init__(
        self,
        run_id: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        max_segments: int = 2,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ):
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        if drain_timeout_s <= 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {drain_timeout_s}")
        self.directory = Path(directory) if directory is not None else segment_directory()
        # <run>-<pid>-<pool><n>: two pools of one process (tests, a re-created publisher) never share a name.
        self.prefix = f"{SEGMENT_PREFIX}{_run_tag(run_id)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.max_segments = max_segments
        self.drain_timeout_s = drain_timeout_s
        self._segments: list[Segment] = []
        self._busy: set[int] = set()  # ids of segments handed out by acquire and not yet given back
        self._count = 0
        self.num_retired = 0
        self.retired: list[str] = []
        """Paths of the segments retired undrained (the caller logs and clears it)."""
        remove_stale_segments(self.directory)

    @property
    def paths(self) -> list[str]:
        return [str(segment.path) for segment in self._segments]

    def acquire(self, num_bytes: int) -> Segment:
        """A segment nobody reads, with room for ``num_bytes``: a drained one, a new one while there are fewer than
        ``max_segments``, else the first to drain within ``drain_timeout_s``, else a new one in place of the oldest
        (which is retired: unlinked, its readers keep their mapping)."""
        deadline_s = time.monotonic() + self.drain_timeout_s
        while True:
            idle = [s for s in self._segments if id(s) not in self._busy]
            ready = [s for s in idle if s.drained()]
            if ready:
                segment = max(ready, key=lambda s: (s.capacity >= num_bytes, s.capacity))
                break
            if len(self._segments) < self.max_segments:
                segment = self._new()
                break
            if not idle or time.monotonic() >= deadline_s:
                oldest = min(idle or self._segments, key=lambda s: s.published_s or 0.0)
                self._retire(oldest)
                segment = self._new()
                break
            time.sleep(DRAIN_POLL_S)
        self._busy.add(id(segment))
        segment.published_s = None
        segment.view(num_bytes).release()
        return segment

    def give_back(self, segment: Segment, *, read: bool = True) -> None:
        """The caller is done with ``segment``: the pool picks it again once it drained; ``read=False``: nobody was
        handed its current generation (refused, never published), so it is free at once."""
        if not read:
            segment.published_s = None
        self._busy.discard(id(segment))

    def _new(self) -> Segment:
        self._count += 1
        segment = Segment(self.directory / f"{self.prefix}{self._count}")
        self._segments.append(segment)
        return segment

    def _retire(self, segment: Segment) -> None:
        self.retired.append(str(segment.path))
        self.num_retired += 1
        self._segments.remove(segment)
        self._busy.discard(id(segment))
        segment.close()

    def close(self) -> None:
        """Unlink every segment (readers that mapped one keep their mapping)."""
        for segment in self._segments:
            segment.close()
        self._segments = []
        self._busy.clear()


class MappedSegment:
    """A reader's read-only mapping of one generation of a segment; ``payload`` views it (no copy)."""

    def __init__(self, path: str, mapping: mmap.mmap, num_bytes: int, generation: int, *, writable: bool):
        self.path = path
        self.generation = generation
        self._map = mapping
        self._words: _Words | None = _Words(mapping, writable=writable)
        self.payload = memoryview(mapping)[CONTROL_BYTES : CONTROL_BYTES + num_bytes]

    def current(self) -> bool:
        """The segment still holds this generation (its writer has not started another)."""
        assert self._words is not None
        return self._words.read(GENERATION) == self.generation

    def close(self) -> None:
        self.payload.release()
        if self._words is not None:
            self._words.release()
            self._words = None
        try:
            self._map.close()
        except BufferError:  # a view is still exported (a tensor or a hasher): unmapped when it goes
            pass


def open_segment(
    descriptor: data_pb2.SharedSegment, num_bytes: int, *, writable_control: bool = False
) -> MappedSegment:
    """Map the generation ``descriptor`` names, ``num_bytes`` of payload, after checking that it is this host's, a
    segment file in the shared-memory directory, private to this user, and holds that generation. The payload's
    digest is the caller's to check before it uses a byte. ``writable_control``: the broker's mapping (it writes
    ``released``). Raises `SegmentError` saying why not."""
    if not descriptor.host_id or descriptor.host_id != host_id():
        raise SegmentError(f"segment {descriptor.path!r} is on another host ({descriptor.host_id or 'unknown'})")
    path = Path(descriptor.path)
    if path.parent != segment_directory() or not path.name.startswith(SEGMENT_PREFIX):
        raise SegmentError(f"{descriptor.path!r} is not a segment file of {segment_directory()}")
    try:
        fd = os.open(path, (os.O_RDWR if writable_control else os.O_RDONLY) | os.O_NOFOLLOW)
    except OSError as exc:
        raise SegmentError(f"cannot open segment {descriptor.path!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise SegmentError(f"segment {descriptor.path!r} is not a private file of this user")
        if info.st_size < CONTROL_BYTES + num_bytes:
            raise SegmentError(f"segment {descriptor.path!r} holds fewer than the {num_bytes} bytes announced")
        access = mmap.ACCESS_WRITE if writable_control else mmap.ACCESS_READ
        mapping = mmap.mmap(fd, CONTROL_BYTES + num_bytes, access=access)
    finally:
        os.close(fd)
    mapped = MappedSegment(str(path), mapping, num_bytes, descriptor.generation, writable=writable_control)
    assert mapped._words is not None
    words = mapped._words
    problem = None
    if words.read(MAGIC_WORD) != MAGIC:
        problem = "has no segment header"
    elif words.read(GENERATION) != descriptor.generation:
        problem = f"holds generation {words.read(GENERATION)}, not {descriptor.generation} (it was reused)"
    elif words.read(PAYLOAD_BYTES) != num_bytes:
        problem = f"holds {words.read(PAYLOAD_BYTES)} payload bytes, not {num_bytes}"
    if problem is not None:
        mapped.close()
        raise SegmentError(f"segment {descriptor.path!r} {problem}")
    return mapped


def mark_released(mapped: MappedSegment) -> None:
    """The broker's word: every reader of ``mapped``'s generation is done (the writer may reuse the segment)."""
    assert mapped._words is not None, "segment is closed"
    if mapped._words.read(RELEASED) < mapped.generation:
        mapped._words.write(RELEASED, mapped.generation)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_segments(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """This user's segments (``primerl-seg-<run>-<pid>-<pool><n>``) in ``directory`` whose writer is dead."""
    directory = Path(directory) if directory is not None else segment_directory()
    stale = []
    for path in directory.glob(f"{SEGMENT_PREFIX}*"):
        parts = path.name[len(SEGMENT_PREFIX) :].split("-")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            if path.lstat().st_uid != os.getuid() or pid == os.getpid() or _pid_alive(pid):
                continue
        except OSError:
            continue
        stale.append(path)
    return stale


def remove_stale_segments(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Unlink `stale_segments` (readers that still map one keep their mapping); returns those removed."""
    return unlink_each(stale_segments(directory))


def unlink_each(paths: Iterable[Path]) -> list[Path]:
    """Unlink each of ``paths`` that can be unlinked; returns those."""
    removed = []
    for path in paths:
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def main(argv: list[str] | None = None) -> int:
    """``python -m primerl.proto.shared_segment --remove-stale``: unlink this user's segments whose writer is dead
    (the trainer's systemd unit runs it after the trainer stopped)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m primerl.proto.shared_segment", description=main.__doc__)
    parser.add_argument("--remove-stale", action="store_true", required=True, help="remove dead writers' segments")
    parser.add_argument("--directory", default=None, help="where the segments are (default: /dev/shm)")
    args = parser.parse_args(argv)
    for path in remove_stale_segments(args.directory):
        print(f"removed {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
