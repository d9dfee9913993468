"""The preflight's slow checks run beside the start (``cli.preflight.roles.BackgroundPreflight``) and the gate the
orchestrator's first rollout waits at (``runtime.start_gate``): opened once they pass, a finding stops the run."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from primerl.runtime.start_gate import open_gate
from primerl.supervisor import process_reaper
from primerl.supervisor.process_supervisor import Supervisor

PREFLIGHT_MARK = "preflight"
"""The reaper's mark of the background preflight's env workers: they end with the launcher, as the roles do."""
PREFLIGHT_WAIT_S = 180.0
"""How long a role's failure before the preflight's verdict waits for it (its checks are bounded by
``CHECK_TIMEOUT_S``, 150 s): a failed preflight explains the failure better than the role's log."""
WAIT_STEP_S = 0.2


class PreflightFailed(Exception):
    """The preflight's slow checks, run beside the start, found a problem: every role is stopped."""


class PreflightGate:
    """The background preflight (None: it ran before the start, or not at all) until its checks passed."""

    def __init__(self, preflight: object | None, supervisor: Supervisor, gate_path: Path):
        self.preflight = preflight
        self.supervisor = supervisor
        self.gate_path = gate_path

    def start(self) -> None:
        """The slow checks in a thread, once the reaper runs: the env workers they start carry its mark (set in
        this process's environment, which they inherit) and end with the launcher."""
        if self.preflight is None:
            return
        os.environ[self.supervisor.mark_variable] = PREFLIGHT_MARK
        self.preflight.start()

    def check(self) -> None:
        """Once the slow checks finished: open the gate, or raise ``PreflightFailed``."""
        if self.preflight is None or not self.preflight.done():
            return
        if self.preflight.result.errors:
            raise PreflightFailed()
        self.preflight.verdict()  # its warnings, if any
        self.preflight = None
        open_gate(self.gate_path)

    def explains_failure(self, interrupted: Callable[[], bool]) -> bool:
        """A role failed: True when the preflight (waited for, bounded; ``interrupted`` ends the wait) found a
        problem, which explains the failure better than the role's log."""
        if self.preflight is None:
            return False
        orchestrator = self.supervisor.children.get("orchestrator")
        if orchestrator is None or orchestrator.poll() is not None:  # its environments' report will not come now
            self.preflight.orchestrator_ended()
        deadline = time.monotonic() + PREFLIGHT_WAIT_S
        while not self.preflight.wait(WAIT_STEP_S) and time.monotonic() < deadline and not interrupted():
            pass
        try:
            self.check()
        except PreflightFailed:
            return True
        return False

    def verdict(self, stopped: list[str]) -> int:
        """The preflight's lines as when it runs first, naming the roles ``stopped``; its exit status (2)."""
        status = self.preflight.verdict(stopped=stopped)
        self.preflight = None
        return status or 2

    def end(self) -> None:
        """The run ends: the env workers of checks still running end with it."""
        if self.preflight is not None and not self.preflight.done():
            process_reaper.signal_marked(self.supervisor.token, signal.SIGTERM, roles=[PREFLIGHT_MARK])
