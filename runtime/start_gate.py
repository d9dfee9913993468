"""The preflight's gate: under `primerl rl` the slow preflight checks (loading the environments, the tokenizer)
run while the roles start, so a role must not do what a failed preflight should have prevented before the
verdict. The launcher names a file in ``$PRIMERL_START_GATE`` for the orchestrator and creates it once the
checks pass; the orchestrator loads its environments meanwhile and waits for the file before its first rollout.
On a failed preflight the launcher stops every role instead, so no rollout is ever generated. Without the
variable (a daemon started on its own, `--no-preflight`, `--preflight-first`) nothing waits.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

GATE_VAR = "PRIMERL_START_GATE"
GATE_FILE_NAME = "preflight.passed"
"""The launcher's gate file, in the run directory."""
POLL_S = 0.05


def gate_path() -> Path | None:
    value = os.environ.get(GATE_VAR, "").strip()
    return Path(value) if value else None


def open_gate(path: Path) -> None:
    """The launcher's side: the preflight passed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def wait_for_gate(stop_event: threading.Event, log=None) -> bool:
    """The role's side: True once the gate (if any) is open; False when ``stop_event`` is set first."""
    path = gate_path()
    if path is None or path.exists():
        return True
    if log is not None:
        log.info("waiting for the preflight", gate=str(path))
    while not path.exists():
        if stop_event.wait(POLL_S):
            return False
    if log is not None:
        log.info("preflight passed", gate=str(path))
    return True
