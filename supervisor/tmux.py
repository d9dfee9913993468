"""`primerl rl --tmux`: a tmux session with one pane per role, each following the role's log, titled with it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path


def open_tmux(run_dir: Path, logs_dir: Path, roles: list[str]) -> str:
    """Open the session (detached); returns its name. ``SystemExit`` when tmux is not installed."""
    tmux = shutil.which("tmux")
    if tmux is None:
        raise SystemExit(
            "primerl rl: --tmux needs tmux, which is not installed (e.g. `apt-get install tmux`); "
            "or run without --tmux and read the logs under " + str(logs_dir)
        )
    session = re.sub(r"[^A-Za-z0-9_-]", "-", f"primerl-{run_dir.resolve().name}-{os.getpid()}")
    for role in roles:
        (logs_dir / f"{role}.log").touch()
    commands = [f"tail -n +1 -F {shlex.quote(str(logs_dir.resolve() / f'{role}.log'))}" for role in roles]
    pane_ids = []
    for index, command in enumerate(commands):
        # -P -F: print the new pane's id, to title it with its role (tmux's default title is the host name).
        start = (
            [tmux, "new-session", "-d", "-s", session, "-n", "roles"]
            if index == 0
            else [tmux, "split-window", "-t", f"{session}:roles"]
        )
        created = subprocess.run(
            [*start, "-P", "-F", "#{pane_id}", command], check=True, capture_output=True, text=True
        )
        pane_ids.append(created.stdout.strip())
        subprocess.run([tmux, "select-layout", "-t", f"{session}:roles", "tiled"], check=True)
    for role, pane_id in zip(roles, pane_ids):
        subprocess.run([tmux, "select-pane", "-t", pane_id, "-T", role], check=True)
    for option, value in (("pane-border-status", "top"), ("pane-border-format", " #{pane_title} ")):
        subprocess.run([tmux, "set-option", "-w", "-t", f"{session}:roles", option, value], check=True)
    return session


def close_tmux(session: str) -> None:
    subprocess.run(
        ["tmux", "kill-session", "-t", session], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
