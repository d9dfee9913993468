"""Which host's shared memory a process can map: an identity two daemons compare before they hand bytes over
through ``/dev/shm`` instead of a socket.

A hostname is not enough: containers on one machine may share a hostname but not their ``/dev/shm``, and the
network-namespace "hosts" of ``make multihost`` share one kernel and one ``/dev/shm`` yet stand for machines of
their own. The identity is a digest of the kernel's boot id, the network namespace and the device of the
shared-memory mount: equal only for processes of one boot, one network namespace and one ``/dev/shm``.

It is a hint, never trusted alone: a reader still opens the segment it is given, checks the file and the payload's
digest, and says so when it cannot (then the bytes travel as across hosts).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

__all__ = ["host_id"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_NET_NAMESPACE = Path("/proc/self/ns/net")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _namespace(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _shm_device(directory: Path) -> str:
    try:
        return str(os.stat(directory).st_dev)
    except OSError:
        return ""


@functools.cache
def host_id(shm_dir: str = "/dev/shm") -> str:
    """This process's host identity (32 hex digits); empty when it cannot be told (no /proc: the bytes travel)."""
    parts = [_read(_BOOT_ID), _namespace(_NET_NAMESPACE), _shm_device(Path(shm_dir))]
    if not all(parts):
        return ""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
