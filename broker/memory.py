"""How the broker process gives memory back: large buffers live in their own mappings.

The broker's large buffers (ZeroMQ frames of up to ``max_message_bytes``, rollout payloads, weight chunks) are
allocated by libzmq and CPython through glibc's malloc. By default glibc raises its mmap threshold to the size of
the largest mapped block freed so far (up to 32 MiB), after which blocks of that size come from the heap and stay
resident when freed: a broker that once read a few 16 MiB messages keeps hundreds of MiB it no longer uses, and
grows with each burst. ``pin_mmap_threshold`` fixes the threshold (``M_MMAP_THRESHOLD``), so every block of at
least ``MMAP_THRESHOLD_BYTES`` is its own mapping and goes back to the OS when freed. Process-wide; a no-op where
the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from primerl.proto.units import MiB
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.memory")

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``malloc.h``)."""
MMAP_THRESHOLD_BYTES = 1 * MiB
"""Blocks at least this large are mapped on their own and unmapped when freed."""


def pin_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes``; True when glibc took it."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    taken = bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
    if not taken:
        log.warning("could not pin the malloc mmap threshold: freed large buffers may stay resident")
    return taken
