"""The console of `primerl eval`: its own lines on the terminal, everything else the process writes in a log file.

vLLM writes to this process's stdout and stderr from many places: its loggers, the engine-core process it
spawns (which inherits the file descriptors), C++ libraries (NUMA, torch), progress bars, and the interpreter's
exit (`Exception ignored in AsyncLLM.__del__`, nanobind's leak report, both after `main` has returned). Only
moving file descriptors 1 and 2 reaches them all: `divert(log_path)` points them at the log file for the rest of
the process's life, and eval's own lines go to copies of the original descriptors (`out`, `err`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO


class Console:
    """Where eval's own output goes: `out` (results) and `err` (progress, errors); the terminal until and after
    `divert`, which sends everything else the process writes to `log_path`."""

    def __init__(self) -> None:
        self.out: TextIO = sys.stdout
        self.err: TextIO = sys.stderr
        self.log_path: Path | None = None

    def divert(self, log_path: Path) -> None:
        """From now on file descriptors 1 and 2 (this process and the processes it starts) write to `log_path`;
        `out` and `err` keep writing to the terminal. Not undone: the interpreter's exit writes too."""
        assert self.log_path is None, "already diverted"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        self.err = os.fdopen(os.dup(2), "w", buffering=1)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
        finally:
            os.close(log_fd)
        self.log_path = log_path
