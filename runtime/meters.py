"""Throughput meters: events and bytes per second over a sliding window, with totals since the start.

One ``RateMeter`` serves every data plane of the broker (rollout batches in and out, weight bytes in and
out). Memory is bounded by the window, not by the traffic: events fall into fixed time buckets
(``bucket_s``), and buckets older than ``window_s`` are dropped.
"""

from __future__ import annotations

import collections
import threading
import time


class RateMeter:
    """Events and bytes per second over the last ``window_s`` seconds (or since creation, when shorter, but
    never over less than one bucket). Thread-safe: ``add`` from an IO thread, read the rates from any."""

    def __init__(self, window_s: float = 10.0, bucket_s: float = 0.25):
        if window_s <= 0 or bucket_s <= 0 or bucket_s > window_s:
            raise ValueError(f"need 0 < bucket_s <= window_s, got bucket_s={bucket_s} and window_s={window_s}")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: collections.deque[list[float]] = collections.deque()  # [start_s, num_events, num_bytes]
        self._total_events = 0
        self._total_bytes = 0
        self._lock = threading.Lock()
        self._started_s = time.monotonic()

    def add(self, num_bytes: int, now_s: float | None = None) -> None:
        """Count one event of ``num_bytes``."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            self._total_events += 1
            self._total_bytes += num_bytes
            if self._buckets and now_s - self._buckets[-1][0] < self.bucket_s:
                bucket = self._buckets[-1]
                bucket[1] += 1
                bucket[2] += num_bytes
            else:
                self._buckets.append([now_s, 1, num_bytes])
            self._trim(now_s)

    def rates(self, now_s: float | None = None) -> tuple[float, float]:
        """(events per second, bytes per second) over the window."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            self._trim(now_s)
            span_s = min(self.window_s, max(now_s - self._started_s, self.bucket_s))
            num_events = sum(bucket[1] for bucket in self._buckets)
            num_bytes = sum(bucket[2] for bucket in self._buckets)
        return num_events / span_s, num_bytes / span_s

    def bytes_per_s(self, now_s: float | None = None) -> float:
        return self.rates(now_s)[1]

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total_bytes

    @property
    def total_events(self) -> int:
        with self._lock:
            return self._total_events

    def _trim(self, now_s: float) -> None:
        while self._buckets and now_s - self._buckets[0][0] > self.window_s:
            self._buckets.popleft()
