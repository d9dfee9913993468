"""Processes that must not outlive the process that started them (vLLM's engine core under primerl-infer).

Linux's ``PR_SET_PDEATHSIG`` sends a signal to a process when its parent *thread* ends (the thread that called
``fork``), so it is only right for children forked from a thread that lives as long as the parent: the main
thread. For a child forked from another thread, a watcher thread in the child polls its parent pid instead.

``install_fork_hook()`` (primerl-infer calls it before vLLM starts) makes every child that this process forks
through Python (``os.fork``, multiprocessing's fork start method: vLLM's engine core on CPU) die with SIGKILL
when this process dies, SIGKILL included. ``die_with_parent(expected_parent)`` does the same from inside a child
that was spawned rather than forked (the vLLM plugin calls it in a spawned engine core).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.2

_state = {"installed": False, "main_thread_fork": False, "parent_pid": 0}


def _prctl_pdeathsig(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum)) == 0


def _watch_parent(parent_pid: int, signum: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(WATCH_INTERVAL_S)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="parent-death-watch", daemon=True).start()


def die_with_parent(expected_parent: int, *, signum: int = signal.SIGKILL, from_main_thread: bool = True) -> None:
    """End this process with ``signum`` when its parent (pid ``expected_parent``) dies; at once if it already
    has. ``from_main_thread``: the parent started this process from its main thread (then PDEATHSIG is exact;
    otherwise a thread polls the parent pid every 0.2 s)."""
    if from_main_thread and _prctl_pdeathsig(signum):
        pass
    else:
        _watch_parent(expected_parent, signum)
    if os.getppid() != expected_parent:  # it died before the signal was armed
        os.kill(os.getpid(), signum)


def _before_fork() -> None:
    _state["main_thread_fork"] = threading.current_thread() is threading.main_thread()
    _state["parent_pid"] = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_state["parent_pid"], from_main_thread=_state["main_thread_fork"])


def install_fork_hook() -> None:
    """From now on every child this process forks (through Python) dies with it. Idempotent."""
    if _state["installed"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _state["installed"] = True
