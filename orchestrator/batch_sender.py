"""The orchestrator's send thread: packed steps go to the broker in step order while collection goes on.

    sender = BatchSender(send_step)          # send_step(step, item) sends one step's batches, blocking
    waited_s = sender.put(step, item, on_sent=lambda send_s: ...)   # blocks only while `max_pending` wait
    sender.check()                           # raises the send thread's error, if any, in the caller's thread
    sender.flush(timeout_s)                  # every step put so far is sent (its on_sent has run)
    sender.close(timeout_s)

Invariants:
- Steps are sent one at a time, in the order they were put (one thread, a FIFO queue).
- A step's ``on_sent`` runs on the send thread after ``send_step`` returned for it (its batches are durable at the
  broker) and before the next step is sent: the orchestrator saves its state there, so the state file never names
  a step whose batches are not all spooled.
- At most ``max_pending`` steps wait in the queue besides the one being sent: ``put`` blocks (back-pressure from
  the broker reaches the main loop only then), and the time it blocked is returned.
- The first error of ``send_step`` or ``on_sent`` stops the thread; steps still queued are not sent. The error is
  raised (once, as is) by the next ``put``, ``check`` or ``flush`` in the caller's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.sender")

PUT_POLL_S = 0.1  # how often a blocked `put` looks for a send error (the thread may have died meanwhile)


class BatchSenderClosed(RuntimeError):
    """The sender was closed (or its thread stopped) while steps were still to be sent."""


class SendInterrupted(RuntimeError):
    """``put`` gave up waiting for room because its stop event was set (the step was not queued)."""


ItemT = TypeVar("ItemT")


class BatchSender(Generic[ItemT]):
    def __init__(self, send_step: Callable[[int, ItemT], None], *, max_pending: int = 1, name: str = "batch-sender"):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._send_step = send_step
        self._queue: queue.Queue[tuple[int, ItemT, Callable[[float], None]] | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._error_raised = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._num_put = 0
        self._num_done = 0
        self.last_send_s = 0.0  # duration of the latest completed send_step
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------------------

    def put(
        self,
        step: int,
        item: ItemT,
        on_sent: Callable[[float], None],
        timeout_s: float,
        should_stop: Callable[[], bool] | None = None,
    ) -> float:
        """Queue one step; returns the seconds this call waited for room. Raises the send thread's error,
        ``TimeoutError`` when no room came within ``timeout_s``, or ``SendInterrupted`` once ``should_stop()`` is
        true while it waits (looked at every ``PUT_POLL_S``)."""
        self.check()
        started = time.monotonic()
        deadline = started + timeout_s
        with self._lock:
            self._num_put += 1
        while True:
            try:
                self._queue.put((step, item, on_sent), timeout=min(PUT_POLL_S, max(0.0, deadline - time.monotonic())))
                return time.monotonic() - started
            except queue.Full:
                self.check()
                if not self._thread.is_alive():
                    raise BatchSenderClosed("the send thread is not running") from None
                if should_stop is not None and should_stop():
                    with self._lock:
                        self._num_put -= 1
                    raise SendInterrupted(f"stopped while step {step} waited for room in the send queue") from None
                if time.monotonic() >= deadline:
                    with self._lock:
                        self._num_put -= 1
                    raise TimeoutError(f"step {step} found no room in the send queue within {timeout_s} s") from None

    def check(self) -> None:
        """Raise the send thread's error in the caller's thread (once; later calls raise BatchSenderClosed)."""
        with self._lock:
            error, raised = self._error, self._error_raised
            self._error_raised = self._error_raised or error is not None
        if error is not None:
            if raised:
                raise BatchSenderClosed("the send thread stopped after an earlier error")
            raise error

    def flush(self, timeout_s: float) -> None:
        """Wait until every step put so far is sent; raises its error, or TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._num_done < self._num_put and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self._num_put - self._num_done} step(s) not sent within {timeout_s} s")
                self._idle.wait(remaining)
        self.check()

    @property
    def num_unsent(self) -> int:
        with self._lock:
            return self._num_put - self._num_done

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread after the steps already queued; True when it ended within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=min(PUT_POLL_S, max(0.0, deadline - time.monotonic())))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    # -- the send thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            step, item, on_sent = entry
            try:
                started = time.monotonic()
                self._send_step(step, item)
                self.last_send_s = time.monotonic() - started
                on_sent(self.last_send_s)
            except BaseException as exc:  # noqa: BLE001 - handed to the main loop by check()
                log.error("sending a step failed; the send thread stops", step=step, error=str(exc))
                with self._lock:
                    self._error = exc
                    self._idle.notify_all()
                return
            with self._lock:
                self._num_done += 1
                self._idle.notify_all()


__all__ = ["BatchSender", "BatchSenderClosed", "SendInterrupted"]
