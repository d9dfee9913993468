"""SIGTERM and SIGINT for the four role daemons: at once while a role starts, gracefully once it works.

While a role builds its model, connects to the broker or loads its environments, nothing is owed to anyone and
the work in hand (seconds to minutes of it) would only delay the stop: a signal then raises
``StoppedWhileStarting`` in the main thread, so model loading, ``wait_ready`` and environment loading give up where
they are and the runner's ``close()`` runs on the way out; a daemon whose start-up blocks the main thread for
seconds (vLLM's) gives ``exit_while_starting`` instead, which cleans up and the process exits at once. Once the role
is set up (``set_up()`` says so) a signal only sets ``stop_event``: the trainer finishes its step's publish,
checkpoint and commit, the orchestrator its send, the broker and inference their serving loop.

Before a handler is installed the default action applies (the process ends at once), and a daemon that cannot
clean up promptly after a start-up stop is ended ``STARTUP_EXIT_GRACE_S`` later all the same, so a launcher that
stops a run which never got under way (``primerl rl`` after an early failure) waits seconds, not its stop timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

STARTUP_EXIT_GRACE_S = 5.0
"""After a stop during start-up: the time the runner's clean-up may take before the process is ended."""
STARTUP_EXIT_STATUS = 0
"""A stop is not a failure (as for a stop once working)."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedWhileStarting(KeyboardInterrupt):
    """A stop signal came while the role was still starting. A ``KeyboardInterrupt`` so that no
    ``except Exception`` on the way out takes it for a fault of the role (none is reported to the broker)."""


class StopSignals:
    """The stop-signal handler of a role daemon; ``install()`` puts it in place.

    ``stop_event`` is set on every stop signal (a ``threading.Event``, or an ``asyncio.Event`` when the handler is
    installed on the event loop); ``set_up()`` tells whether the role is past its start-up (called from the
    handler, in the main thread: it must only read state); ``log_fields()`` adds fields to the stopping line;
    ``exit_while_starting()``, when given, replaces ``StoppedWhileStarting``: it cleans up and the process exits.
    """

    def __init__(
        self,
        log,
        stop_event: threading.Event | asyncio.Event,
        set_up: Callable[[], bool],
        *,
        stopping_message: str = "stopping on signal",
        exit_while_starting: Callable[[], None] | None = None,
        log_fields: Callable[[], dict[str, Any]] | None = None,
    ):
        self.log = log
        self.stop_event = stop_event
        self.set_up = set_up
        self.stopping_message = stopping_message
        self.exit_while_starting = exit_while_starting
        self.log_fields = log_fields
        self.raised = False
        self.working = False  # set_up() was true once: it stays so (a later signal never cuts a clean-up short)

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Handle SIGTERM and SIGINT from now on: in the main thread's signal handler, or as callbacks of
        ``loop`` (an asyncio daemon once its loop serves: the handler then runs in the loop, between tasks)."""
        for signum in SIGNALS:
            if loop is None:
                signal.signal(signum, self._handle)
            else:
                loop.add_signal_handler(signum, self._handle, signum, None)

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self.stop_event.set()
        if self.raised:
            return  # already on the way out (the watchdog bounds it)
        if self.working or self.set_up():
            self.working = True
            fields = self.log_fields() if self.log_fields is not None else {}
            self.log.info(self.stopping_message, signal=name, **fields)
            return
        self.raised = True
        self.log.info("stopping on signal during start-up: exiting now", signal=name)
        if self.exit_while_starting is not None:
            self.exit_while_starting()
            _flush_and_exit()
        watchdog = threading.Timer(STARTUP_EXIT_GRACE_S, _exit_now, args=(self.log,))
        watchdog.daemon = True
        watchdog.start()
        raise StoppedWhileStarting(name)


def _exit_now(log) -> None:
    log.warning("clean-up after a stop during start-up took too long; exiting now", grace_s=STARTUP_EXIT_GRACE_S)
    _flush_and_exit()


def _flush_and_exit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STARTUP_EXIT_STATUS)
