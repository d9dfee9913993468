"""Directories that appear whole or not at all: checkpoints (``primerl.trainer.checkpoint``) and exported weights
(``primerl.trainer.weights_export``).

The protocol: everything is written into ``{name}.tmp-<pid>`` beside the final directory, each file fsynced; the
``STABLE`` marker is written and fsynced last; ``commit_dir`` fsyncs the temp directory, renames it to ``{name}``
(an existing one is first renamed to ``{name}.trash-<pid>``, then removed) and fsyncs the parent. A reader takes
a directory as valid only once its ``STABLE`` marker exists. A process killed at any point leaves the previous
directory as it was plus a temp (or trash) directory, which ``remove_leftovers`` deletes at the next write.
``writing_committed_dir`` runs the whole protocol for a directory one process writes (the weight export); a
checkpoint, written by several ranks between barriers, takes the steps one by one.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from primerl.runtime.durable_files import fsync_dir

__all__ = [
    "STABLE_FILE",
    "commit_dir",
    "fsync_file",
    "remove_leftovers",
    "temp_dir_of",
    "write_new_file",
    "writing_committed_dir",
]

STABLE_FILE = "STABLE"
"""The marker written last: a directory without it is not committed."""


def temp_dir_of(final_dir: Path) -> Path:
    """Where this process writes ``final_dir`` before committing it: ``{name}.tmp-<pid>`` beside it."""
    return final_dir.parent / f"{final_dir.name}.tmp-{os.getpid()}"


def remove_leftovers(parent: Path, name_pattern: str) -> list[str]:
    """Delete the temp and trash directories under ``parent`` of interrupted writes of the directories whose names
    match the regular expression ``name_pattern``; returns the names removed (sorted)."""
    if not parent.is_dir():
        return []
    leftover = re.compile(rf"^(?:{name_pattern})\.(tmp|trash)-[0-9A-Za-z]+$")
    removed = sorted(path.name for path in parent.iterdir() if leftover.match(path.name))
    for name in removed:
        shutil.rmtree(parent / name, ignore_errors=True)
    if removed:
        fsync_dir(parent)
    return removed


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) with ``data``, fsynced."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def commit_dir(tmp_dir: Path, final_dir: Path) -> None:
    """fsync ``tmp_dir``, rename it to ``final_dir`` (replacing an existing one) and fsync the parent."""
    fsync_dir(tmp_dir)
    parent = final_dir.parent
    if final_dir.exists():
        trash = parent / f"{final_dir.name}.trash-{os.getpid()}"
        os.rename(final_dir, trash)
        os.rename(tmp_dir, final_dir)
        fsync_dir(parent)
        shutil.rmtree(trash)
    else:
        os.rename(tmp_dir, final_dir)
    fsync_dir(parent)


@contextmanager
def writing_committed_dir(final_dir: Path) -> Iterator[Path]:
    """The whole protocol for one process: yields the temp directory to write ``final_dir``'s files into; when the
    block ends normally, fsyncs them, writes ``STABLE`` and commits; when it raises, removes the temp directory."""
    tmp_dir = temp_dir_of(final_dir)
    tmp_dir.mkdir()
    try:
        yield tmp_dir
        for path in sorted(tmp_dir.rglob("*")):
            if path.is_file():
                fsync_file(path)
        write_new_file(tmp_dir / STABLE_FILE, b"")
        commit_dir(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
