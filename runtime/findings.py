"""What a preflight check finds: one line saying what is wrong and how to fix it, an error (the start stops with
exit status 2) or a warning (printed, the start goes on). Shared by the checks of `primerl.cli.preflight` and the
environment checks the orchestrator runs on its own env workers (`primerl.orchestrator.envs.checks`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a check found. ``message`` is one line: what is wrong and how to fix it; ``detail`` (a traceback, an
    env worker's stderr) goes to the log only."""

    message: str
    error: bool = True
    detail: str = ""


def error(message: str, detail: str = "") -> Finding:
    return Finding(message, True, detail)


def warning(message: str, detail: str = "") -> Finding:
    return Finding(message, False, detail)
