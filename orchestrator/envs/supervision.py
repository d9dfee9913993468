"""What both environment clients supervise the same way: the child process and its pending requests.

`ChildProcess` spawns one process in its own session, reads its stderr into a bounded tail on a reader thread,
runs the owner's other threads against it, and ends it in three steps: the owner's polite request, SIGTERM, then
SIGKILL, each to the process group the child leads (never anything else), joining every thread it started.
`PendingRequests` holds the requests in flight under one lock: each entry has a `future` and a `deadline`
(`time.monotonic()`); expired entries are taken out exactly once, and `fail_all` fails every entry still there.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, Protocol, Self, TypeVar

STREAM_JOIN_TIMEOUT_S = 2.0
KILL_WAIT_S = 5.0


class ChildProcess:
    """One child process (module docstring); `name` prefixes its threads' names."""

    def __init__(
        self, name: str, *, stderr_tail_lines: int = 40, on_stderr_line: Callable[[str], None] | None = None
    ) -> None:
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self._on_stderr_line = on_stderr_line
        self._tail: collections.deque[str] = collections.deque(maxlen=stderr_tail_lines)
        self._threads: list[threading.Thread] = []
        self._stderr_reader: threading.Thread | None = None

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None) -> subprocess.Popen[bytes]:
        """Start the process with pipes on stdin, stdout and stderr, and its stderr reader."""
        if self.running():
            raise RuntimeError(f"{self.name} is already running")
        self._tail.clear()
        self._threads = []
        self.process = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
        self._stderr_reader = self.start_thread(self._read_stderr, "err")
        return self.process

    def start_thread(self, target: Callable[[subprocess.Popen[bytes]], None], suffix: str) -> threading.Thread:
        """Run `target(process)` on a daemon thread that `stop` joins."""
        assert self.process is not None, "spawn first"
        thread = threading.Thread(target=target, args=(self.process,), name=f"{self.name}-{suffix}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def exit_code(self) -> int | None:
        """The exit code once it ended (None while it runs, or before `spawn`)."""
        return self.process.poll() if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def note(self, line: str) -> None:
        """Add a line to the tail (a stdout line that is not protocol, say)."""
        self._tail.append(line)

    def stderr_tail(self, last: int | None = None) -> str:
        lines = list(self._tail)
        return "\n".join(lines[-last:] if last else lines)

    def join_stderr(self, timeout_s: float = STREAM_JOIN_TIMEOUT_S) -> None:
        """Wait for the stderr reader to read the last lines of an ended process."""
        reader = self._stderr_reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout_s)

    def stop(self, timeout_s: float, polite: Callable[[subprocess.Popen[bytes]], None] | None = None) -> int | None:
        """End the process: `polite(process)` and half of `timeout_s` to exit, then SIGTERM and the rest of it,
        then SIGKILL; then join the threads and close the pipes. Its exit code (None: never spawned)."""
        process = self.process
        if process is None:
            return None
        deadline = time.monotonic() + timeout_s
        if process.poll() is None and polite is not None:
            polite(process)
            self._wait(process, max(0.1, timeout_s / 2))
        if process.poll() is None:
            self._signal(process, signal.SIGTERM)
            self._wait(process, max(0.1, deadline - time.monotonic()))
        if process.poll() is None:
            self._signal(process, signal.SIGKILL)
            self._wait(process, KILL_WAIT_S)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(STREAM_JOIN_TIMEOUT_S)
        for stream in (process.stdin, process.stdout, process.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        return process.returncode

    @staticmethod
    def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> None:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass

    @staticmethod
    def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
        """`signum` to the process group the child leads (its own session), else to the child alone."""
        try:
            os.killpg(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass

    def _read_stderr(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stderr is not None
        for raw in process.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self._tail.append(line)
            if self._on_stderr_line is not None:
                self._on_stderr_line(line)


class SupervisedChild(abc.ABC):
    """What a client of one supervised child process (``_child``) offers besides its requests: a context manager
    (``start`` on entry, ``close`` on exit) and the tail of the child's stderr."""

    _child: ChildProcess

    @abc.abstractmethod
    def start(self) -> Any:
        """Start the child process (and whatever it serves)."""

    @abc.abstractmethod
    def close(self, timeout_s: float = 10.0) -> int | None:
        """End the child process; its exit code."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stderr_tail(self) -> str:
        return self._child.stderr_tail()


class Pending(Protocol):
    """An entry of `PendingRequests`."""

    @property
    def future(self) -> concurrent.futures.Future: ...

    @property
    def deadline(self) -> float: ...


K = TypeVar("K", bound=Hashable)
P = TypeVar("P", bound=Pending)


class PendingRequests(Generic[K, P]):
    """Requests in flight by request id (module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[K, P] = {}
        self._lock = threading.Lock()

    def add(self, key: K, entry: P) -> None:
        with self._lock:
            self._entries[key] = entry

    def get(self, key: K) -> P | None:
        with self._lock:
            return self._entries.get(key)

    def pop(self, key: K) -> P | None:
        with self._lock:
            return self._entries.pop(key, None)

    def pop_where(self, predicate: Callable[[P], bool]) -> list[tuple[K, P]]:
        with self._lock:
            taken = [(key, entry) for key, entry in self._entries.items() if predicate(entry)]
            for key, _ in taken:
                del self._entries[key]
        return taken

    def pop_expired(self, now: float | None = None) -> list[tuple[K, P]]:
        """The entries whose deadline has passed, taken out."""
        now = time.monotonic() if now is None else now
        return self.pop_where(lambda entry: entry.deadline <= now)

    def fail_all(self, exc: BaseException) -> None:
        """Fail the future of every entry (once per future) and forget them all."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(exc)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


__all__ = ["ChildProcess", "Pending", "PendingRequests", "SupervisedChild"]
