"""Processes that must not outlive the process that started them (vLLM's engine core under primerl-infer).

Linux's ``PR_SET_PDEATHSIG`` sends a signal to a process when its parent *thread* ends (the thread that called
``fork``), so it is only right for children forked from a thread that lives as long as the parent: the main
thread. For a child forked from another thread, a watcher thread in the child polls its parent pid instead.

``install_fork_hook()`` (primerl-infer calls it before vLLM starts) makes every child that this process forks
through Python (``os.fork``, multiprocessing's fork start method: vLLM's engine core on CPU) die with SIGKILL
when this process dies, SIGKILL included. ``die_with_parent(expected_parent)`` does the same from inside a child
that was spawned rather than forked (the vLLM plugin calls it in a spawned engine core).

``arm_from_environment()``: the same, asked for by the parent through ``PARENT_PID_VAR`` in the child's environment
(``parent_environment()``). The launcher starts its roles that way rather than arming the signal between fork and
exec: a ``preexec_fn`` makes Python run the at-fork handlers of every library in the child, and gRPC's restarts
its poller thread there, which aborts the child once the fds are closed before exec (grpc/grpc#43055: "epoll_wait
error: Bad file descriptor"). Without one, Python starts the child with vfork and exec, running no handler.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

from primerl.runtime.process_ids import pid_alive

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.2
PARENT_PID_VAR = "PRIMERL_DIE_WITH_PARENT"
"""``<pid>`` (started from that process's main thread) or ``<pid>:thread`` (from another thread): the child ends
with SIGTERM when that parent does (``arm_from_environment``)."""

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


def parent_environment() -> dict[str, str]:
    """The environment entry that makes a child started now by this thread call ``die_with_parent`` on this
    process (once the child runs ``arm_from_environment``)."""
    main = threading.current_thread() is threading.main_thread()
    return {PARENT_PID_VAR: f"{os.getpid()}" if main else f"{os.getpid()}:thread"}


TORCHRUN_RANK_VAR = "TORCHELASTIC_RUN_ID"  # set by torchrun in the environment of each rank it starts


def arm_from_environment(signum: int = signal.SIGTERM) -> bool:
    """In a child started with ``parent_environment()``: end with ``signum`` when that parent ends, at once if it
    already has. The entry is removed from the environment, so this process's own children do not inherit it.
    A process that inherited the entry through a program that kept it (its parent is another program, and the
    process named is alive) arms nothing: the launcher's reaper covers it. Except a rank under torchrun (the
    trainer role's process): torchrun starts each rank in a session of its own, out of reach of the signals to the
    role's process group, so a rank goes with torchrun instead: SIGKILL once torchrun is gone (torchrun stopping
    normally ends its ranks itself first; a rank left without it has no one to restart it and holds the rendezvous
    port the restarted role needs). Returns whether this process armed a signal."""
    value = os.environ.pop(PARENT_PID_VAR, "")
    pid_text, _, how = value.partition(":")
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if os.getppid() != pid and pid_alive(pid):
        if TORCHRUN_RANK_VAR not in os.environ:
            return False  # a grandchild of that process, not its child
        # torchrun starts its ranks from its agent's thread of choice: watch its pid rather than trust PDEATHSIG
        die_with_parent(os.getppid(), signum=signal.SIGKILL, from_main_thread=False)
        return True
    die_with_parent(pid, signum=signum, from_main_thread=how != "thread")
    return True
