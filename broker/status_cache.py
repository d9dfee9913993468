"""One run status shared by every ``WatchRunStatus`` stream (``SharedStatus``), so that the cost of watching is one
assembly per interval whatever the number of watchers, instead of one per watcher per change.

Assembling the status is linear in the fleet (one ``WorkerInfo`` per worker, ~130 bytes and ~5 us each), and with a
thousand workers heartbeating the registry's version moves a thousand times a second: each watcher used to assemble
(and serialize, to compare) its own status at every wake-up. Invariants:

- a snapshot says the registry version it was built from (read before the build, so it never claims a change it
  may have missed);
- a snapshot is rebuilt when asked for a newer version, at most once per ``min_age_s`` (the streams' floor), and
  after ``max_age_s`` whatever the version (the data plane's queues and rates move without it);
- one build at a time: a caller that finds one under way waits for it and takes its result.

``GetRunStatus`` (one call, ``primerl status``) does not use it: it always assembles a fresh status.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from primerl.proto.v1 import control_pb2

MIN_AGE_S = 0.2
"""A shared status is rebuilt for a newer registry version at most this often."""
MAX_AGE_S = 1.0
"""A shared status older than this is rebuilt even when the registry did not change (queues and rates move)."""


class StatusSnapshot(NamedTuple):
    status: control_pb2.RunStatus
    key: bytes  # the status without its timestamp, serialized: equal keys mean nothing new to stream
    version: int  # the registry version it was built from
    built_s: float


def status_key(status: control_pb2.RunStatus) -> bytes:
    """The status without its timestamp: equal keys mean nothing to stream."""
    copy = control_pb2.RunStatus()
    copy.CopyFrom(status)
    copy.updated_unix_ms = 0
    return copy.SerializeToString(deterministic=True)


class SharedStatus:
    """See the module docstring. ``build()`` assembles a status; ``version()`` is the registry's version."""

    def __init__(
        self,
        build: Callable[[], control_pb2.RunStatus],
        version: Callable[[], int],
        *,
        min_age_s: float = MIN_AGE_S,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 <= min_age_s <= max_age_s:
            raise ValueError(f"need 0 <= min_age_s <= max_age_s, got {min_age_s}, {max_age_s}")
        self._build = build
        self._version = version
        self.min_age_s = min_age_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()  # held during a build: one at a time
        self._snapshot: StatusSnapshot | None = None
        self.num_builds = 0

    def get(self, at_least_version: int = 0) -> StatusSnapshot:
        """The shared snapshot; rebuilt when it is older than ``max_age_s``, or built from a version below
        ``at_least_version`` and older than ``min_age_s`` (else the caller gets it as it is, and may ask again
        ``min_age_s`` later)."""
        with self._lock:
            snapshot = self._snapshot
            now = self._clock()
            if snapshot is not None:
                age_s = now - snapshot.built_s
                if age_s < self.min_age_s or (snapshot.version >= at_least_version and age_s < self.max_age_s):
                    return snapshot
            version = self._version()
            status = self._build()
            self._snapshot = StatusSnapshot(status, status_key(status), version, self._clock())
            self.num_builds += 1
            return self._snapshot
