"""`Periodic`: a daemon thread that runs one callable every interval until it is stopped.

A failing call is logged with its traceback and the next one runs on time: a background duty of a daemon (expiring
silent workers, saving state) must be visible when it breaks, never fatal to the daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Periodic"]


class Periodic:
    """Calls ``tick()`` every ``interval_s`` on a daemon thread named ``name``, from `start` until `stop`.
    ``log``: where a failed tick (``failed_event``) and a thread that does not stop in time (``slow_stop_event``)
    are logged."""

    def __init__(
        self,
        name: str,
        interval_s: float,
        tick: Callable[[], Any],
        *,
        log: Any,
        failed_event: str,
        slow_stop_event: str,
    ):
        self.name = name
        self.interval_s = interval_s
        self._tick = tick
        self._log = log
        self._failed_event, self._slow_stop_event = failed_event, slow_stop_event
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the thread to end and wait up to ``timeout_s``; False (logged) when it is still running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._log.warning(self._slow_stop_event, timeout_s=timeout_s)
                return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception:  # the next tick runs on time
                self._log.exception(self._failed_event)
