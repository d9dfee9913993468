"""Processes the chaos harness starts: a systemd-like restarter per role, and a scan for every process it started.

``Unit`` behaves like a systemd service with ``Restart=on-failure`` and ``RestartSec``: an exit with a non-zero
status or by a signal (a kill) restarts the command after ``restart_sec``; an exit with status 0 ends the unit.
Like systemd's ``KillMode=control-group``, what is left of the process group when the main process dies is
killed before the restart (and recorded first: a role that leaves children behind is a finding).
``StartLimitBurst`` / ``StartLimitIntervalSec`` (systemd's defaults, 5 starts in 10 s) stop a unit that keeps dying.

Every process started here carries ``MARKER_ENV`` in its environment, inherited by all its descendants (vLLM's
engine core, env workers, torchrun's ranks), so ``marked_processes(marker)`` finds each one still alive even
after it was re-parented away from its role.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from primerl.supervisor.process_supervisor import start_in_own_session

MARKER_ENV = "PRIMERL_CHAOS_MARKER"
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 10.0


@dataclass
class Exit:
    """One end of one started process."""

    role: str
    pid: int
    code: int | None  # negative: killed by that signal; None: not known (not the harness's child)
    at_s: float  # wall clock (time.time())
    planned: bool  # caused by the harness (a chaos kill, or the stop at the end)
    survivors: list[str] = field(default_factory=list)  # processes of its group still alive when it ended


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def find_descendant(pid: int | None, matches: Callable[[psutil.Process], bool]) -> int | None:
    """The first descendant of ``pid`` for which ``matches`` holds (searched among its descendants only, never
    machine-wide), if alive."""
    if pid is None:
        return None
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            if matches(child):
                return child.pid
        except psutil.Error:
            continue
    return None


def engine_core_pid(daemon_pid: int | None) -> int | None:
    """The vLLM engine-core child of the `primerl-infer` process ``daemon_pid``, if alive."""
    return find_descendant(daemon_pid, lambda p: "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name())


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {' '.join(process.cmdline()).strip()[:120]}"
    except psutil.Error:
        return str(process.pid)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Every live process (not a zombie) whose environment holds ``MARKER_ENV=marker``."""
    found = []
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get(MARKER_ENV) == marker:
                found.append(process)
        except psutil.Error:
            continue
    return found


class Unit:
    """One role under the restarter (module docstring). ``poll()`` often; ``kill()`` for a chaos kill."""

    def __init__(
        self,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        restart_sec: float,
        cwd: Path | None = None,
    ):
        self.role = role
        self.argv = [str(a) for a in argv]
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.restart_sec = restart_sec
        self.cwd = cwd
        self.process: subprocess.Popen | None = None
        self.starts: list[float] = []  # wall clock of each start
        self.exits: list[Exit] = []
        self.pending_kill_pid: int | None = None
        self.stopping = False
        self.restart_at_s: float | None = None
        self.state = "inactive"  # running | restarting | done (exit 0) | failed (start limit) | stopped

    @property
    def pid(self) -> int | None:
        return None if self.process is None or self.process.poll() is not None else self.process.pid

    def start(self) -> None:
        now = time.time()
        recent = [s for s in self.starts if now - s < START_LIMIT_INTERVAL_S]
        if len(recent) >= START_LIMIT_BURST:
            self.state = "failed"
            return
        self.process = start_in_own_session(self.argv, self.log_path, self.env, self.cwd)
        self.starts.append(now)
        self.state = "running"
        self.restart_at_s = None

    def kill(self) -> int | None:
        """SIGKILL the main process (only it, as an OOM kill or `kill -9 MAINPID` would); returns its pid."""
        pid = self.pid
        if pid is None:
            return None
        self.pending_kill_pid = pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def poll(self) -> Exit | None:
        """Reap an exit (and restart later if due); returns the exit when one happened now."""
        if self.state == "restarting" and self.restart_at_s is not None and time.time() >= self.restart_at_s:
            self.start()
            return None
        if self.process is None or self.state != "running":
            return None
        code = self.process.poll()
        if code is None:
            return None
        pgid = self.process.pid
        survivors = [describe(p) for p in group_members(pgid)]
        planned = self.stopping or self.pending_kill_pid == self.process.pid
        ended = Exit(self.role, self.process.pid, code, time.time(), planned, survivors)
        self.exits.append(ended)
        self.pending_kill_pid = None
        self._kill_group(pgid)  # systemd's KillMode=control-group before a restart
        if self.stopping:
            self.state = "stopped"
        elif code == 0:
            self.state = "done"
        else:
            self.state = "restarting"
            self.restart_at_s = time.time() + self.restart_sec
        return ended

    @staticmethod
    def _kill_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout_s: float) -> None:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; no restart afterwards."""
        self.stopping = True
        if self.state == "restarting":
            self.state = "stopped"
        if self.process is None or self.process.poll() is not None:
            self.poll()
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group(self.process.pid)
            self.process.wait(10.0)
        self.poll()
