"""Gray failures: an engine that makes no progress while its daemon still heartbeats.

A vLLM engine core can stop answering while the API process around it (the HTTP server, the heartbeat thread)
goes on: the engine-core process stopped (SIGSTOP, a debugger), a model step that never returns (a hung kernel or
collective). Requests sent to such a worker wait until their clients give up. The watchdog finds it with a cheap
probe: one utility call to the engine core at a time (``AsyncLLM.is_sleeping``, answered by the engine core's busy
loop between two model steps). A probe unanswered for ``stall_timeout_s`` marks the engine *stalled*; its answer
marks it *recovered*.

    watchdog = EngineWatchdog(engine.is_sleeping, stall_timeout_s=30, on_change=report, busy=lambda: update_began_s)
    task = loop.create_task(watchdog.run(stop_event))
    watchdog.stalled_for_s   # None while serving

Invariants:
- At most one probe is in flight; the next is sent ``interval_s`` after an answer.
- ``busy()`` (when the busy spell under way began, e.g. a weight update, which holds the engine core; None when
  idle) restarts the stall clock of a probe sent during the spell for up to the spell's limit; past that the
  clock runs, so an engine that stops in the middle of an update (its update never returns) is found stalled
  ``stall_timeout_s`` later. Busy spells shorter than the limit never count. The limit is ``busy_limit()`` when
  it gives one (the daemon's: a few times its longest recent update, at least ``stall_timeout_s``), else
  ``BUSY_LIMIT_FACTOR`` x ``stall_timeout_s``, and never more than the latter.
- A probe sent before the spell began keeps its clock: the engine core takes its input in order, so a probe sent
  before an update is answered before the update holds the engine. An engine already stopped when an update comes
  is found ``stall_timeout_s`` after its unanswered probe, not after the busy limit.
- A probe that raises is an answer (the engine is not stalled; a dead engine is reported elsewhere:
  ``InferenceServer.check_running``).
- ``on_change(stalled, seconds)`` runs once per transition: ``(True, unanswered_s)`` when it stalls,
  ``(False, stalled_s)`` when it recovers.

The daemon (``InferenceService``) logs ``inference engine stalled`` / ``inference engine recovered``, serves
``primerl_inference_engine_stalled`` and ``primerl_inference_engine_stalls_total``, answers ``GET /health`` with
503 while stalled, and sends the reason as ``not_serving`` with every heartbeat (control.proto): the broker then
lists the worker with the capability ``serving = "false"`` and the orchestrator takes it out of rotation (its groups in
flight go to other workers) until it recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.inference.watchdog")

MIN_INTERVAL_S = 0.1
BUSY_LIMIT_FACTOR = 10.0
"""A busy spell (a weight update holding the engine core) stops the stall clock for at most this many stall timeouts."""
MAX_INTERVAL_S = 2.0


def probe_interval_s(stall_timeout_s: float) -> float:
    """Pause between two probes: a tenth of the stall timeout, within [0.1, 2] s."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, stall_timeout_s / 10))


class StallClock:
    """The watchdog's state, without IO (module docstring): fed when a probe is sent and answered."""

    def __init__(self, stall_timeout_s: float):
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self.busy_limit_s = BUSY_LIMIT_FACTOR * stall_timeout_s
        self.waiting_since: float | None = None  # the probe in flight was sent (or the engine stopped being busy)
        self.stalled_since: float | None = None
        self.busy_since: float | None = None  # the busy spell under way began

    def sent(self, now: float) -> None:
        self.waiting_since = now

    def busy(self, now: float, since: float | None = None, limit_s: float | None = None) -> None:
        """Busy at ``now``, in a spell that began at ``since`` (None: unknown, taken as now when first seen) and
        may last ``limit_s`` (None, or more than ``busy_limit_s``: ``busy_limit_s``)."""
        if self.waiting_since is None:
            return
        if since is not None and self.waiting_since < since:
            return  # the probe in flight was sent before the spell: it is answered before the spell holds the engine
        if self.busy_since is None:
            self.busy_since = now if since is None else min(since, now)
        limit_s = self.busy_limit_s if limit_s is None else min(limit_s, self.busy_limit_s)
        if now - self.busy_since < limit_s:
            self.waiting_since = now

    def idle(self) -> None:
        """Not busy (any more): the next busy spell gets its whole limit."""
        self.busy_since = None

    def answered(self, now: float) -> float | None:
        """The probe answered; returns the seconds stalled when this ends a stall."""
        self.waiting_since = None
        self.busy_since = None
        if self.stalled_since is None:
            return None
        stalled_s, self.stalled_since = now - self.stalled_since, None
        return stalled_s

    def check(self, now: float) -> float | None:
        """Returns the seconds the probe has waited when this starts a stall."""
        if self.stalled_since is not None or self.waiting_since is None:
            return None
        waited_s = now - self.waiting_since
        if waited_s < self.stall_timeout_s:
            return None
        self.stalled_since = now
        return waited_s


class EngineWatchdog:
    """Probes an engine and says when it stalls and recovers (module docstring)."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[object]],
        *,
        stall_timeout_s: float,
        on_change: Callable[[bool, float], None],
        busy: Callable[[], float | None] = lambda: None,
        busy_limit: Callable[[], float | None] = lambda: None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._probe = probe
        self._clock = clock
        self._state = StallClock(stall_timeout_s)
        self._on_change = on_change
        self._busy = busy
        self._busy_limit = busy_limit
        self.interval_s = probe_interval_s(stall_timeout_s) if interval_s is None else interval_s
        self.num_stalls = 0

    @property
    def stall_timeout_s(self) -> float:
        return self._state.stall_timeout_s

    @property
    def stalled_for_s(self) -> float | None:
        """Seconds since the engine was found stalled; None while it serves."""
        since = self._state.stalled_since
        return None if since is None else self._clock() - since

    async def run(self, stop: asyncio.Event) -> None:
        """Probe until ``stop`` is set; the probe in flight is cancelled then."""
        probe: asyncio.Task | None = None
        try:
            while not stop.is_set():
                now = self._clock()
                if probe is None:
                    probe = asyncio.ensure_future(self._probe())
                    self._state.sent(now)
                if probe.done():
                    with contextlib.suppress(BaseException):
                        probe.result()  # an error is an answer: a dead engine is reported elsewhere
                    probe = None
                    stalled_s = self._state.answered(self._clock())
                    if stalled_s is not None:
                        self._on_change(False, stalled_s)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval_s)
                    continue
                busy_since = self._busy()
                if busy_since is not None:
                    self._state.busy(now, busy_since, self._busy_limit())
                else:
                    self._state.idle()
                waited_s = self._state.check(now)
                if waited_s is not None:
                    self.num_stalls += 1
                    self._on_change(True, waited_s)
                await asyncio.wait([probe], timeout=min(self.interval_s, self.stall_timeout_s / 4))
        finally:
            if probe is not None and not probe.done():
                probe.cancel()
                with contextlib.suppress(BaseException):
                    await probe


__all__ = ["BUSY_LIMIT_FACTOR", "EngineWatchdog", "StallClock", "probe_interval_s"]
