"""State that others can watch: one lock, a version counter that moves on every change, waits on it with a
bound, the recent errors shown in status, and a ``closed`` flag that wakes every watcher. The registry is one."""

from __future__ import annotations

import threading
from collections import deque

MAX_ERROR_CHARS = 500


class WatchedState:
    """Subclasses change their state under ``self._lock`` and call ``_bump_locked()``; watchers call
    ``wait_for_change(version, timeout_s)``."""

    def __init__(self, max_recent_errors: int = 32):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self._closed = False
        self._recent_errors: deque[str] = deque(maxlen=max_recent_errors)

    @property
    def version(self) -> int:
        """Counter that increases on every change of the state."""
        with self._lock:
            return self._version

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        """Wait until ``version > after_version``, the state closes, someone calls ``wake_waiters``, or
        ``timeout_s`` passes; returns the current version."""
        with self._changed:
            if self._version <= after_version and not self._closed:
                self._changed.wait(timeout=max(0.0, timeout_s))
            return self._version

    def wake_waiters(self) -> None:
        """Wake every ``wait_for_change`` without a change (a watcher was cancelled and should look)."""
        with self._changed:
            self._changed.notify_all()

    def _close(self) -> None:
        with self._changed:
            self._closed = True
            self._version += 1
            self._changed.notify_all()

    def record_error(self, source: str, message: str) -> None:
        """Add ``"<source>: <message>"`` (whitespace folded, at most ``MAX_ERROR_CHARS``) to the recent errors."""
        with self._lock:
            self._add_error_locked(source, message)
            self._bump_locked()

    def recent_errors(self) -> list[str]:
        with self._lock:
            return list(self._recent_errors)

    def _bump_locked(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _add_error_locked(self, source: str, message: str) -> None:
        message = " ".join(str(message).split())
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 3] + "..."
        self._recent_errors.append(f"{source}: {message}")
