"""Child processes of a launcher: one process group each, output to a log file, bounded waits and stops.

Knows nothing of primerl's roles: `primerl rl` (`primerl.supervisor.launcher`) builds the commands and decides the
order; this module starts them (and again, ``restart``), tells when one exits, and ends them (SIGTERM to the
whole group, then SIGKILL after a bound) so that grandchildren (vLLM's engine core, env workers) go with them.

Descendants that leave the group (torchrun starts its ranks in sessions of their own) are found by the mark
every child carries in its environment (``primerl.supervisor.process_reaper``): a child counts as running while
any process with its mark runs, and ending a child ends those too. The reaper the supervisor starts with its
first child ends every marked process within ``reaper_grace_s`` + ~1 s when the launcher dies without stopping
them (SIGKILL included); primerl's daemons among the children also get SIGTERM from PR_SET_PDEATHSIG at that
moment (they arm it themselves, ``runtime.parent_death.arm_from_environment``).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from primerl.proto.ready_file import read_ready_file
from primerl.runtime.parent_death import parent_environment
from primerl.supervisor import process_reaper

POLL_INTERVAL_S = 0.1


class ChildFailed(RuntimeError):
    """A child exited (or never became ready) when it should have been running."""

    def __init__(self, child: ChildProcess, message: str):
        super().__init__(message)
        self.child = child


def start_in_own_session(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str], cwd: Path | None = None
) -> subprocess.Popen:
    """Start ``argv`` with stdout and stderr appended to ``log_path``, after a ``=== <time> <argv>`` line (so a
    log splits into the starts of its role). ``start_new_session``: its own process group, out of the terminal's,
    so Ctrl-C reaches only the launcher, which then stops the children in order. A launcher killed with SIGKILL
    still ends them: a primerl daemon arms PDEATHSIG itself (``runtime.parent_death.arm_from_environment``, asked for
    in its environment), and the reaper ends every marked process. No ``preexec_fn``: Python then starts the child
    with vfork and exec and runs no library's at-fork handler in it (gRPC's aborted children: ``parent_death``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        log_file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        log_file.flush()
        return subprocess.Popen(
            list(argv),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**env, **parent_environment()},
            cwd=cwd,
            start_new_session=True,
        )


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
        self.num_starts = 0
        self.pids: list[int] = []  # of every start, oldest first

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} started while running"
        self.process = start_in_own_session(self.argv, self.log_path, self.env, self.cwd)
        self.started_s = time.monotonic()
        self.num_starts += 1
        self.pids.append(self.process.pid)

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
    """Children started in order and stopped together; ``interrupted`` (a callable) aborts any wait.

    With ``reap`` (the default) the first ``start`` also starts the reaper (module docstring); ``close()``
    ends it once every child is stopped."""

    def __init__(
        self,
        interrupted: Callable[[], bool] = lambda: False,
        *,
        reap: bool = True,
        reaper_grace_s: float = process_reaper.DEFAULT_GRACE_S,
        reaper_log: Path | None = None,
    ):
        self.children: dict[str, ChildProcess] = {}
        self.interrupted = interrupted
        self.reap = reap
        self.reaper_grace_s = reaper_grace_s
        self.reaper_log = reaper_log
        self.token = secrets.token_hex(8)
        self.reaper: subprocess.Popen | None = None

    @property
    def mark_variable(self) -> str:
        """The environment variable (value: the child's name) that every child and its descendants carry."""
        return process_reaper.mark_variable(self.token)

    def start(self, child: ChildProcess) -> ChildProcess:
        assert child.name not in self.children, f"two children named {child.name}"
        if self.reap and self.reaper is None:
            self.reaper = process_reaper.start_reaper(self.token, grace_s=self.reaper_grace_s, log_path=self.reaper_log)
        child.env[self.mark_variable] = child.name
        self.children[child.name] = child
        child.start()
        return child

    def restart(self, child: ChildProcess, timeout_s: float = 10.0) -> ChildProcess:
        """Start ``child`` again with the same command, once what is left of its previous start is ended
        (its group, and marked descendants that left it: SIGKILL, bounded by ``timeout_s``)."""
        assert self.children.get(child.name) is child, f"{child.name} is not a child of this supervisor"
        if self.alive(child):
            child.signal_group(signal.SIGKILL)
            process_reaper.signal_marked(self.token, signal.SIGKILL, roles=[child.name])
            deadline = time.monotonic() + timeout_s
            while self.alive(child) and time.monotonic() < deadline:
                time.sleep(POLL_INTERVAL_S)
            if self.alive(child):
                raise ChildFailed(
                    child,
                    f"{child.name}: processes of its previous start still run after SIGKILL "
                    f"and {timeout_s:g} s; not starting it again",
                )
        child.start()
        return child

    def alive(self, child: ChildProcess) -> bool:
        """True while any process of ``child`` runs: its group, or a descendant that left the group."""
        return bool(self._alive([child]))

    def _alive(self, children: Sequence[ChildProcess]) -> list[ChildProcess]:
        """Those of ``children`` with a process running (one scan of /proc for all of them)."""
        running = [c for c in children if c.group_alive()]
        rest = [c for c in children if c not in running]
        if rest and self.reap:
            names = {c.name for c in rest}
            marked = set(process_reaper.marked_roles(self.token, roles=names))
            running += [c for c in rest if c.name in marked]
        return running

    def wait_ready_file(
        self,
        child: ChildProcess,
        ready_file: Path,
        timeout_s: float,
        watch: Sequence[ChildProcess] = (),
        tick: Callable[[], None] | None = None,
    ) -> dict | None:
        """The JSON that ``child`` writes to ``ready_file`` once serving; None if interrupted. Raises
        ``ChildFailed`` when the child exits first or ``timeout_s`` passes, or when one of ``watch`` (children
        started alongside it, which must keep running meanwhile) exits. ``tick``, when given, is called at every
        poll (a launcher looks after its other children there; it may raise)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = read_ready_file(ready_file)
            if ready is not None:
                child.ready_s = time.monotonic() - child.started_s
                return ready
            if child.poll() is not None:
                raise ChildFailed(child, f"{child.name} {child.describe_exit()} before it was ready")
            for other in watch:
                if other.poll() is not None:
                    raise ChildFailed(other, f"{other.name} {other.describe_exit()} while {child.name} was starting")
            if tick is not None:
                tick()
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

    def stop(
        self,
        names: Sequence[str] | None = None,
        timeout_s: float = 30.0,
        on_kill: Callable[[ChildProcess], None] | None = None,
    ) -> None:
        """SIGTERM to the groups of ``names`` (default: all), then SIGKILL to what is left after ``timeout_s``
        (the groups and their marked descendants). Returns once all of it is gone (or, after SIGKILL, after a
        short bounded wait)."""
        names = list(self.children) if names is None else names
        targets = [self.children[name] for name in names if name in self.children]
        targets = self._alive(targets)
        left_behind: set[str] = set()  # children whose leftovers (outside their group) got SIGTERM
        for child in targets:
            if child.group_alive():
                child.signal_group(signal.SIGTERM)  # the leader passes it on (torchrun to its ranks)
            elif self.reap:  # the leader is gone: what it left behind
                process_reaper.signal_marked(self.token, signal.SIGTERM, roles=[child.name])
                left_behind.add(child.name)
        deadline = time.monotonic() + timeout_s
        while (alive := self._alive(targets)) and time.monotonic() < deadline:
            # A group that ended while processes it started in sessions of their own still run (an env worker
            # the role was starting when it stopped): they are told too, not waited for until the timeout.
            for child in alive:
                if self.reap and child.name not in left_behind and not child.group_alive():
                    process_reaper.signal_marked(self.token, signal.SIGTERM, roles=[child.name])
                    left_behind.add(child.name)
            time.sleep(POLL_INTERVAL_S)
        for child in self._alive(targets):
            if on_kill is not None:
                on_kill(child)
            self._kill(child)
        kill_deadline = time.monotonic() + 5.0
        while self._alive(targets) and time.monotonic() < kill_deadline:
            time.sleep(POLL_INTERVAL_S)

    def _kill(self, child: ChildProcess) -> None:
        child.signal_group(signal.SIGKILL)
        if self.reap:
            process_reaper.signal_marked(self.token, signal.SIGKILL, roles=[child.name])

    def kill_all(self) -> None:
        for child in self.children.values():
            self._kill(child)

    def close(self) -> None:
        """End the reaper (call after ``stop``: from then on nothing guards the children)."""
        if self.reaper is not None and self.reaper.poll() is None:
            self.reaper.kill()
            self.reaper.wait(5.0)
        self.reaper = None
