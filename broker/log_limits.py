"""Rate-limited logging for what peers can trigger at will: refusals and unexpected per-message failures.

A peer that sends a million bad messages must not write a million log lines (or tracebacks). Each *kind*
(a short key such as ``("refused", "ERROR_CODE_MALFORMED_HEADER")``) is logged once in full, then at
most once every ``interval_s`` as a summary line with the number of occurrences since the last line.
The traceback of an unexpected exception is logged only the first time its kind is seen.
Memory is bounded: at most ``max_kinds`` kinds are remembered (the table is cleared when full, which
can only cause one extra line per kind).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any

DEFAULT_INTERVAL_S = 10.0
DEFAULT_MAX_KINDS = 1024


class RateLimitedLog:
    """One full line per kind, then a summary at most every ``interval_s``. Thread-safe."""

    def __init__(self, logger: Any, *, interval_s: float = DEFAULT_INTERVAL_S, max_kinds: int = DEFAULT_MAX_KINDS):
        self._log = logger
        self.interval_s = interval_s
        self.max_kinds = max_kinds
        self._seen: dict[Hashable, list[float]] = {}  # kind -> [last_logged_s, num_since_last_line]
        self._lock = threading.Lock()

    def _should_log(self, kind: Hashable) -> tuple[bool, int, bool]:
        """(log now, occurrences not yet logged, first time)."""
        now_s = time.monotonic()
        with self._lock:
            seen = self._seen.get(kind)
            if seen is None:
                if len(self._seen) >= self.max_kinds:
                    self._seen.clear()
                self._seen[kind] = [now_s, 0]
                return True, 1, True
            seen[1] += 1
            if now_s - seen[0] >= self.interval_s:
                count = int(seen[1])
                seen[0], seen[1] = now_s, 0
                return True, count, False
            return False, 0, False

    def warning(self, kind: Hashable, event: str, **fields: Any) -> bool:
        """Log ``event`` (a warning) unless this kind was logged less than ``interval_s`` ago."""
        log_now, count, first = self._should_log(kind)
        if log_now:
            if not first:
                fields["num_since_last_line"] = count
            self._log.warning(event, **fields)
        return log_now

    def exception(self, kind: Hashable, event: str, **fields: Any) -> bool:
        """Inside ``except``: the traceback the first time ``kind`` is seen, one-line summaries after."""
        log_now, count, first = self._should_log(kind)
        if log_now:
            if first:
                self._log.exception(event, **fields)
            else:
                self._log.error(event, num_since_last_line=count, **fields)
        return log_now
