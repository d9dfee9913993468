"""Files that survive a crash whole: written to a temporary name beside them, fsynced, renamed over the old one,
and the directory fsynced, so that after a SIGKILL or a power loss a reader sees the old file or the new one,
never a mix. The broker's spool (``write_files_atomically``: a group of files, one directory fsync), run state
and weight chain use these; `primerl rl` writes the run's address and token (``run.json``, owner-only) with
``write_private_atomically``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, parts: Iterable[Any], *, temp_path: Path | None = None, mode: int = 0o666) -> None:
    """Write ``parts`` (bytes-like, in order) as the whole content of ``path``; see the module docstring.
    ``temp_path``: the temporary name (default ``<path>.tmp``); removed again when the write fails. ``mode``: of a
    newly created temporary file (less the umask), so the content is never readable more widely than that."""
    temp = temp_path or path.with_name(path.name + ".tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_private_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` as the whole content of ``path`` like ``write_atomically``, readable by the owner only
    (mode 0600): the temporary file is created with that mode, so the content is never readable by others,
    not even for a moment; a stale temporary file from an earlier crash is removed first (its mode could be
    wider)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)
    write_atomically(path, [data], temp_path=temp, mode=0o600)


def write_files_atomically(directory: Path, files: Sequence[tuple[str, Iterable[Any]]]) -> list[int]:
    """Write several files of ``directory`` (name, bytes-like parts) atomically with one directory fsync: write
    every temporary file (``.<name>.<pid>.<thread>.tmp``), fsync each, rename each, fsync the directory. Returns
    the bytes of each file. On an error no temporary file is left behind (files already renamed stay: each is
    whole)."""
    temps: list[tuple[Path, Path]] = []
    sizes: list[int] = []
    try:
        handles = []
        try:
            for name, parts in files:
                temp = directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
                handle = open(temp, "wb", buffering=0)
                handles.append(handle)
                temps.append((temp, directory / name))
                sizes.append(_write_parts(handle, parts))
            for handle in handles:
                os.fsync(handle.fileno())
        finally:
            for handle in handles:
                handle.close()
        for temp, final in temps:
            os.replace(temp, final)
    except BaseException:
        for temp, _ in temps:
            temp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return sizes


def _write_parts(handle: Any, parts: Iterable[Any]) -> int:
    """Write every byte of ``parts`` to an unbuffered file (whose writes may be short); returns the bytes."""
    num_bytes = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            written = handle.write(view)
            num_bytes += written
            view = view[written:]
    return num_bytes
