"""Riding through an outage of the broker: wait, say what is awaited every few seconds, give up past a budget.

Every client of the broker (control, rollout producer and consumer, weight publisher and subscriber) uses one
``OutageWatch`` per thing it waits for. While calls fail with an error that can heal (the broker is restarting,
unreachable), the client calls ``failed(error)``; the first failure starts the clock, a line
``waiting for the broker`` goes to the log at once and then every ``log_every_s``, and once ``budget_s`` has
passed ``failed`` raises ``BrokerOutageExceeded``: one clear error that the daemon reports before it exits
non-zero. A success calls ``ok()``, which logs ``broker back`` with the outage's length and resets the clock.

Log events (an interface operators alert on): ``waiting for the broker`` (fields ``waiting_for``, ``outage_s``,
``budget_s``, ``error``), ``broker back`` (``waiting_for``, ``outage_s``), ``broker outage exceeded the budget``.

``retry_through_outage(call, watch)`` wraps one call: it retries with capped exponential backoff while the call
raises one of the healable errors, within the watch's budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

_log = get_logger("primerl.broker_outage")

LOG_EVERY_S = 5.0
"""How often a worker waiting through an outage says so."""
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0

T = TypeVar("T")


class BrokerOutageExceeded(RuntimeError):
    """The broker stayed unreachable for longer than the outage budget (``broker.outage_s``)."""


class OutageStopped(RuntimeError):
    """``retry_through_outage`` gave up because its stop event was set."""


class OutageWatch:
    """One thing a worker waits for from the broker (e.g. ``"CommitStep(12)"``); see the module docstring."""

    def __init__(
        self,
        waiting_for: str,
        budget_s: float,
        *,
        worker: str = "",
        log_every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        logger=None,
    ):
        if budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.waiting_for = waiting_for
        self.budget_s = budget_s
        self.worker = worker
        self.log_every_s = log_every_s
        self._clock = clock
        self._log = logger or _log
        self._lock = threading.Lock()
        self._started_s: float | None = None
        self._next_log_s = 0.0
        self.num_outages = 0
        self.last_error: BaseException | str = ""

    @property
    def in_outage(self) -> bool:
        with self._lock:
            return self._started_s is not None

    def elapsed_s(self) -> float:
        """Seconds since the current outage began (0 when none)."""
        with self._lock:
            return 0.0 if self._started_s is None else self._clock() - self._started_s

    def remaining_s(self) -> float:
        """Seconds of budget left in the current outage (the whole budget when none)."""
        return max(0.0, self.budget_s - self.elapsed_s())

    def failed(self, error: BaseException | str) -> None:
        """A call failed with a healable error: log (rate-limited); raise ``BrokerOutageExceeded`` past the budget."""
        now = self._clock()
        self.last_error = error
        with self._lock:
            if self._started_s is None:
                self._started_s = now
                self._next_log_s = now
                self.num_outages += 1
            elapsed_s = now - self._started_s
            due = now >= self._next_log_s
            if due:
                self._next_log_s = now + self.log_every_s
        if elapsed_s > self.budget_s:
            message = (
                f"the broker was unreachable for {elapsed_s:.0f} s while waiting for {self.waiting_for}, "
                f"longer than broker.outage_s = {self.budget_s:g} s; last error: {error}. Is the broker "
                "running and reachable? Raise broker.outage_s to wait longer."
            )
            self._log.error(
                "broker outage exceeded the budget",
                waiting_for=self.waiting_for,
                worker=self.worker,
                outage_s=round(elapsed_s, 1),
                budget_s=self.budget_s,
            )
            raise BrokerOutageExceeded(message)
        if due:
            self._log.warning(
                telemetry.WAITING_FOR_THE_BROKER,
                waiting_for=self.waiting_for,
                worker=self.worker,
                outage_s=round(elapsed_s, 1),
                budget_s=self.budget_s,
                error=str(error)[:300],
            )

    def ok(self) -> None:
        """A call succeeded: end the current outage (logged once)."""
        with self._lock:
            started_s, self._started_s = self._started_s, None
        if started_s is not None:
            self._log.info(
                telemetry.BROKER_BACK,
                waiting_for=self.waiting_for,
                worker=self.worker,
                outage_s=round(self._clock() - started_s, 1),
            )


def retry_through_outage(
    call: Callable[[], T],
    watch: OutageWatch,
    healable: tuple[type[BaseException], ...],
    *,
    stop_event: threading.Event | None = None,
    sleep: Callable[[float], None] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
) -> T:
    """``call()`` until it succeeds; while it raises one of ``healable``, back off (capped) and try again.

    Other errors propagate at once. ``BrokerOutageExceeded`` once the watch's budget is spent; ``OutageStopped``
    when ``stop_event`` is set. ``on_failure(error)`` runs after each healable failure (e.g. to re-register)."""
    backoff_s = BACKOFF_INITIAL_S
    while True:
        try:
            result = call()
        except healable as err:
            watch.failed(err)
            if on_failure is not None:
                on_failure(err)
            wait_s = min(backoff_s, max(0.01, watch.remaining_s()))
            if stop_event is not None:
                if stop_event.wait(wait_s):
                    raise OutageStopped(f"stopped while waiting for the broker ({watch.waiting_for})") from err
            else:
                (sleep or time.sleep)(wait_s)
            backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
            continue
        watch.ok()
        return result
