"""Every process a launcher started ends with it, even when the launcher is SIGKILLed.

Marks: a launcher (``primerl rl``'s supervisor) puts ``PRIMERL_OWNER_<token>=<role>`` into the environment of
each child it starts. Environments are inherited through ``exec`` and ``fork``, so every descendant carries
the mark, including those that leave the child's process group or session (torchrun starts its ranks with
``start_new_session``) and those re-parented to init when their parent dies. ``marked_processes(token)`` reads
``/proc/<pid>/environ`` of this user's processes and returns ``{pid: role}``; nothing else is ever signalled.

The reaper: a small process the launcher starts first (``start_reaper``), in its own session (a Ctrl-C in the
terminal does not reach it) and without the mark. It waits on the launcher's pidfd (Linux >= 5.3; else it
polls its parent pid); when the launcher is gone, for whatever reason, it sends SIGTERM to every marked
process, SIGKILL to those left after ``grace_s``, removes the directories it was given, and exits. After a
clean stop it finds nothing to do. The launcher needs no thread and no pipe for it (a pipe's write end would
leak into forked grandchildren and the EOF would never come).

Signals go through a pidfd opened after the mark was read, so a pid reused in between is never hit.

    reaper = start_reaper(token, grace_s=2.0)           # before the first child
    env[mark_variable(token)] = "trainer"                # in every child's environment
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

MARK_PREFIX = "PRIMERL_OWNER_"
DEFAULT_GRACE_S = 2.0
"""From SIGTERM to SIGKILL of what a dead launcher left behind: short, since a launcher killed with SIGKILL
left nobody to finish the run in order (and the broker is being killed at the same moment)."""
POLL_S = 0.05
PARENT_POLL_S = 0.2


def mark_variable(token: str) -> str:
    """The environment variable that marks the descendants of the launcher with ``token``."""
    if not token or not token.replace("_", "").isalnum():
        raise ValueError(f"a reaper token must be letters, digits and underscores, got {token!r}")
    return MARK_PREFIX + token


def _environ_value(pid: int, variable: bytes) -> bytes | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
    except OSError:  # gone, another user's, or a kernel thread
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(variable):
            return entry[len(variable) :]
    return None


def marked_processes(token: str, *, exclude: Iterable[int] = ()) -> dict[int, str]:
    """``{pid: role}`` of the live processes whose environment carries the mark of ``token``."""
    variable = (mark_variable(token) + "=").encode()
    skip = {os.getpid(), *exclude}
    found: dict[int, str] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) in skip:
            continue
        value = _environ_value(int(entry), variable)
        if value is not None:
            found[int(entry)] = value.decode(errors="replace")
    return found


def signal_marked(
    token: str, signum: int, *, roles: Sequence[str] | None = None, exclude: Iterable[int] = ()
) -> list[int]:
    """Send ``signum`` to the marked processes (of ``roles`` only, when given); returns the pids signalled."""
    variable = (mark_variable(token) + "=").encode()
    signalled = []
    for pid, role in marked_processes(token, exclude=exclude).items():
        if roles is not None and role not in roles:
            continue
        if _signal_if_marked(pid, variable, signum):
            signalled.append(pid)
    return signalled


def _signal_if_marked(pid: int, variable: bytes, signum: int) -> bool:
    """Signal ``pid`` only if, once a pidfd pins it, it still carries the mark (no reused pid is hit)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        if pidfd is not None and _environ_value(pid, variable) is None:
            return False
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def marked_roles(token: str, *, roles: Iterable[str] | None = None) -> list[str]:
    """The roles (of ``roles`` only, when given) with a live marked process."""
    wanted = None if roles is None else set(roles)
    return sorted(
        {
            role
            for pid, role in marked_processes(token).items()
            if (wanted is None or role in wanted) and not _is_zombie(pid)
        }
    )


def live_marked(token: str, *, roles: Sequence[str] | None = None, exclude: Iterable[int] = ()) -> list[int]:
    """Marked processes that still run (zombies waiting for their parent's ``wait`` do not count)."""
    return [
        pid
        for pid, role in marked_processes(token, exclude=exclude).items()
        if (roles is None or role in roles) and not _is_zombie(pid)
    ]


def end_marked(
    token: str,
    grace_s: float,
    *,
    roles: Sequence[str] | None = None,
    exclude: Iterable[int] = (),
    kill_wait_s: float = 2.0,
) -> tuple[int, int]:
    """SIGTERM to the marked processes, SIGKILL after ``grace_s`` to those left; returns (terminated, killed).
    Bounded: at most ``grace_s + kill_wait_s`` seconds."""
    terminated = signal_marked(token, signal.SIGTERM, roles=roles, exclude=exclude)
    deadline = time.monotonic() + grace_s
    while live_marked(token, roles=roles, exclude=exclude) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    killed = (
        signal_marked(token, signal.SIGKILL, roles=roles, exclude=exclude)
        if live_marked(token, roles=roles, exclude=exclude)
        else []
    )
    deadline = time.monotonic() + kill_wait_s
    while killed and live_marked(token, roles=roles, exclude=exclude) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return len(terminated), len(killed)


# ---- the reaper process --------------------------------------------------------------------------------------------


def start_reaper(
    token: str, *, grace_s: float = DEFAULT_GRACE_S, remove: Sequence[Path] = (), log_path: Path | None = None
) -> subprocess.Popen:
    """Start the reaper of this process's marked descendants (see the module docstring); returns its Popen.
    It outlives this process by design: it exits by itself once this process is gone and the rest is ended."""
    mark_variable(token)  # validates
    env = {k: v for k, v in os.environ.items() if not k.startswith(MARK_PREFIX)}
    argv = [
        sys.executable,
        "-m",
        "primerl.supervisor.process_reaper",
        "--token",
        token,
        "--owner",
        str(os.getpid()),
        "--grace-s",
        str(grace_s),
        *[a for path in remove for a in ("--remove", str(path))],
    ]
    output = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        if log_path is not None:
            output.close()


def _wait_for_exit(owner: int) -> None:
    """Return once process ``owner`` (this process's parent at start) is gone."""
    try:
        pidfd = os.pidfd_open(owner)
    except (AttributeError, OSError):
        pidfd = None
    if os.getppid() != owner:  # it died before the pidfd was open
        if pidfd is not None:
            os.close(pidfd)
        return
    if pidfd is not None:
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
        return
    while os.getppid() == owner:
        time.sleep(PARENT_POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m primerl.supervisor.process_reaper",
        description="End a launcher's marked descendants once the launcher is gone.",
    )
    parser.add_argument("--token", required=True)
    parser.add_argument("--owner", type=int, required=True, help="pid of the launcher (this process's parent)")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S)
    parser.add_argument("--remove", type=Path, action="append", default=[], help="a directory to remove at the end")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # only the owner's end ends the reaper
    _wait_for_exit(args.owner)
    gone_s = time.monotonic()
    terminated, killed = end_marked(args.token, args.grace_s)
    for path in args.remove:
        shutil.rmtree(path, ignore_errors=True)
    if terminated or killed:
        print(
            f"primerl reaper: owner {args.owner} is gone; ended {terminated} processes it left "
            f"({killed} with SIGKILL) in {time.monotonic() - gone_s:.2f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
