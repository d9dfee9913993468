"""Whether a process id names a live process: what the daemons use to tell their own leftovers (shared-memory files,
work directories named after a pid) from those of a process that died without cleaning up."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when ``pid`` names a live process (one of another user's counts: its pid is taken)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has that pid now
        return True
    return True
