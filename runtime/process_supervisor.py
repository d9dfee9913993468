"""Child processes of a launcher: one process group each, output to a log file, bounded waits and stops.

Knows nothing of primerl's roles: `primerl rl` (`primerl.cli.launcher`) builds the commands and decides the
order; this module starts them, tells when one exits, and ends them (SIGTERM to the whole group, then SIGKILL
after a bound) so that grandchildren (vLLM's engine core, env workers, torchrun's ranks) go with them.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

POLL_INTERVAL_S = 0.1
PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """A child exited (or never became ready) when it should have been running."""

    def __init__(self, child: ChildProcess, message: str):
        super().__init__(message)
        self.child = child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    """One command in its own process group (its own session), stdout and stderr appended to ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str], cwd: Path | None = None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env)
        self.cwd = cwd
        self.process: subprocess.Popen | None = None
        self.started_s = 0.0
        self.ready_s: float | None = None  # seconds from start to ready, once known

    def start(self) -> None:
        assert self.process is None, f"{self.name} started twice"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log_file.flush()
            # start_new_session: own process group, and out of the terminal's, so Ctrl-C reaches only the launcher,
            # which then stops the children in order. PDEATHSIG: a launcher killed with SIGKILL still ends them.
            self.process = subprocess.Popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        self.started_s = time.monotonic()

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} not started"
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def group_alive(self) -> bool:
        """True while any process of the child's group exists (the leader may have exited already)."""
        if self.process is None:
            return False
        self.process.poll()  # reap the leader if it exited
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # the pgid was reused by someone else's process: ours are gone
            return False
        return True

    def signal_group(self, signum: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - 256 * 1024))
                lines = handle.read().decode("utf-8", "replace").splitlines()
        except OSError as err:
            return f"(cannot read {self.log_path}: {err})"
        return "\n".join(lines[-num_lines:])

    def describe_exit(self) -> str:
        code = self.poll()
        if code is None:
            return "is running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


class Supervisor:
    """Children started in order and stopped together; ``interrupted`` (a callable) aborts any wait."""

    def __init__(self, interrupted: Callable[[], bool] = lambda: False):
        self.children: dict[str, ChildProcess] = {}
        self.interrupted = interrupted

    def start(self, child: ChildProcess) -> ChildProcess:
        assert child.name not in self.children, f"two children named {child.name}"
        self.children[child.name] = child
        child.start()
        return child

    def wait_ready_file(self, child: ChildProcess, ready_file: Path, timeout_s: float,
                        watch: Sequence[ChildProcess] = ()) -> dict | None:
        """The JSON that ``child`` writes to ``ready_file`` once serving; None if interrupted. Raises
        ``ChildFailed`` when the child exits first or ``timeout_s`` passes, or when one of ``watch`` (children
        started alongside it, which must keep running meanwhile) exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            if ready_file.exists():
                child.ready_s = time.monotonic() - child.started_s
                return json.loads(ready_file.read_text())
            if child.poll() is not None:
                raise ChildFailed(child, f"{child.name} {child.describe_exit()} before it was ready")
            for other in watch:
                if other.poll() is not None:
                    raise ChildFailed(other, f"{other.name} {other.describe_exit()} while {child.name} was starting")
            if time.monotonic() > deadline:
                raise ChildFailed(child, f"{child.name} was not ready within {timeout_s:g} s")
            if self.interrupted():
                return None
            time.sleep(POLL_INTERVAL_S)

    def exited(self) -> list[ChildProcess]:
        return [c for c in self.children.values() if c.poll() is not None]

    def write_pids(self, path: Path) -> None:
        """``{role: pid}`` of every child (each pid is also its process group id), for tests and operators."""
        pids = {name: child.pid for name, child in self.children.items() if child.process is not None}
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(pids, indent=2) + "\n")
        os.replace(temporary, path)

    def stop(self, names: Sequence[str] | None = None, timeout_s: float = 30.0,
             on_kill: Callable[[ChildProcess], None] | None = None) -> None:
        """SIGTERM to the groups of ``names`` (default: all), then SIGKILL to what is left after ``timeout_s``.
        Returns once every group is gone (or, after SIGKILL, after a short bounded wait)."""
        names = list(self.children) if names is None else names
        targets = [self.children[name] for name in names if name in self.children]
        targets = [c for c in targets if c.group_alive()]
        for child in targets:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(c.group_alive() for c in targets) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        for child in targets:
            if child.group_alive():
                if on_kill is not None:
                    on_kill(child)
                child.signal_group(signal.SIGKILL)
        kill_deadline = time.monotonic() + 5.0
        while any(c.group_alive() for c in targets) and time.monotonic() < kill_deadline:
            time.sleep(POLL_INTERVAL_S)

    def kill_all(self) -> None:
        for child in self.children.values():
            child.signal_group(signal.SIGKILL)
