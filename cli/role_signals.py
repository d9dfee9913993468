"""SIGTERM and SIGINT for a role daemon: at once while it starts, gracefully once it works.

While a role builds its model, connects to the broker or loads its environments, nothing is owed to anyone
and the work in hand (seconds to minutes of it) would only delay the stop: a signal then raises
``StoppedWhileStarting`` in the main thread, so model loading, ``wait_ready`` and environment loading give up
where they are and the runner's ``close()`` runs on the way out. Once the role is set up (``set_up()`` says
so) a signal only sets ``stop_event``: the trainer finishes its step's publish, checkpoint and commit, the
orchestrator its send, as before.

Before any of this is installed the default action applies (the process ends at once), and a daemon that
cannot clean up promptly after a start-up stop is ended ``STARTUP_EXIT_GRACE_S`` later all the same, so a
launcher that stops a run which never got under way (``primerl rl`` after an early failure) waits seconds,
not its stop timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

STARTUP_EXIT_GRACE_S = 5.0
"""After a stop during start-up: the time the runner's clean-up may take before the process is ended."""
STARTUP_EXIT_STATUS = 0
"""A stop is not a failure (as for a stop once working); ``primerl-infer`` exits 0 the same way."""


class StoppedWhileStarting(KeyboardInterrupt):
    """A stop signal came while the role was still starting. A ``KeyboardInterrupt`` so that no
    ``except Exception`` on the way out takes it for a fault of the role (none is reported to the broker)."""


class StopSignals:
    """Install with ``install()``; ``set_up`` tells whether the role is past its start-up (called from the
    handler, in the main thread: it must only read state)."""

    def __init__(self, log, stop_event: threading.Event, set_up: Callable[[], bool], *,
                 stopping_message: str = "stopping on signal"):
        self.log = log
        self.stop_event = stop_event
        self.set_up = set_up
        self.stopping_message = stopping_message
        self.raised = False
        self.working = False  # set_up() was true once: it stays so (a later signal never cuts a clean-up short)

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self.stop_event.set()
        if self.raised:
            return  # already on the way out (the watchdog bounds it)
        if self.working or self.set_up():
            self.working = True
            self.log.info(self.stopping_message, signal=name)
            return
        self.raised = True
        self.log.info("stopping on signal during start-up: exiting now", signal=name)
        watchdog = threading.Timer(STARTUP_EXIT_GRACE_S, _exit_now, args=(self.log,))
        watchdog.daemon = True
        watchdog.start()
        raise StoppedWhileStarting(name)


def _exit_now(log) -> None:
    log.warning("clean-up after a stop during start-up took too long; exiting now",
                grace_s=STARTUP_EXIT_GRACE_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STARTUP_EXIT_STATUS)
