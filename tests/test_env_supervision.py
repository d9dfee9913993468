"""The supervision both environment clients share (`primerl.orchestrator.envs.supervision`), on real child
processes: the stderr tail, the stop that escalates to SIGKILL within its bound, the pending requests' deadlines."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from dataclasses import dataclass

import pytest

from primerl.orchestrator.envs.base import EnvClient, EnvWorkerDied
from primerl.orchestrator.envs.classic import ClassicEnvClient
from primerl.orchestrator.envs.supervision import ChildProcess, PendingRequests
from primerl.orchestrator.envs.v1 import V1EnvClient

STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for i in range(60):
    print(f"line {i}", file=sys.stderr, flush=True)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_child_that_ignores_sigterm_is_killed_within_the_bound_and_its_stderr_tail_kept() -> None:
    lines: list[str] = []
    child = ChildProcess("stubborn", stderr_tail_lines=5, on_stderr_line=lines.append)
    process = child.spawn([sys.executable, "-c", STUBBORN], env=dict(os.environ), cwd=None)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    child.join_stderr(0.5)
    polite_calls = []
    started = time.monotonic()
    code = child.stop(1.0, polite=polite_calls.append)
    assert time.monotonic() - started < 5.0
    assert code == -9 and not child.running() and polite_calls == [process]
    assert child.stderr_tail() == "\n".join(f"line {i}" for i in range(55, 60))
    assert child.stderr_tail(last=2) == "line 58\nline 59"
    assert len(lines) == 60


def test_a_child_that_exits_is_seen_and_cannot_be_spawned_twice_while_running() -> None:
    child = ChildProcess("quick")
    child.spawn([sys.executable, "-c", "import time; time.sleep(30)"], env=dict(os.environ), cwd=None)
    with pytest.raises(RuntimeError, match="already running"):
        child.spawn([sys.executable, "-c", "pass"], env=dict(os.environ), cwd=None)
    assert child.stop(5.0) == -15 and child.exit_code == -15
    child.spawn([sys.executable, "-c", "raise SystemExit(3)"], env=dict(os.environ), cwd=None)
    assert child.process is not None and child.process.wait(10) == 3 and child.exit_code == 3
    assert child.stop(1.0) == 3


@dataclass
class Entry:
    future: concurrent.futures.Future
    deadline: float


def test_pending_requests_expire_once_and_fail_all_fails_each_future_once() -> None:
    pending: PendingRequests[int, Entry] = PendingRequests()
    now = time.monotonic()
    shared: concurrent.futures.Future = concurrent.futures.Future()
    pending.add(1, Entry(concurrent.futures.Future(), now - 1))
    pending.add(2, Entry(shared, now + 60))
    pending.add(3, Entry(shared, now + 60))
    assert [key for key, _ in pending.pop_expired(now)] == [1]
    assert pending.pop_expired(now) == [] and len(pending) == 2
    pending.fail_all(EnvWorkerDied("gone"))
    assert len(pending) == 0
    with pytest.raises(EnvWorkerDied, match="gone"):
        shared.result(0)


def test_both_clients_are_env_clients() -> None:
    """What the scheduler and the runner read of a client, on both implementations (nothing started)."""
    clients: list[EnvClient] = [ClassicEnvClient(sys.executable, "x"), V1EnvClient(sys.executable, "x")]
    for client in clients:
        assert (client.env_id, client.info, client.num_restarts, client.max_restarts) == ("x", None, 0, 3)
        assert not client.is_alive() and client.num_pending() == 0 and client.stderr_tail() == ""
        assert client.close() is None
