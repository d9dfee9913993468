"""Where the dashboard's facts come from: a run directory (what a run wrote: ``rl.toml``, ``metrics.jsonl``,
``rollouts.jsonl``, ``logs/*.log``, and how it ended: ``run_end.json`` and the rest that
``primerl.runtime.run_outcome`` reads) and a live broker (``GetRunStatus``: the run, workers, queues, recent
errors), read with the run's credentials (``client/channel.py``, TLS included).

Everything a source returns is plain JSON data for ``/api/...``; nothing here writes anywhere. Files are read
incrementally (from the byte offset already read, a rewritten or shrunk file from the start) and kept bounded
(``MAX_ROWS`` metric rows, ``MAX_ROLLOUTS`` sample rollouts, ``MAX_EVENTS`` log events), so a long run costs the
dashboard a bounded memory.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.runtime.run_files import LOGS_DIR, METRICS_FILE, ROLLOUTS_FILE, RUN_CONFIG_FILE, RUN_END_FILE, RUN_FILE
from primerl.runtime.run_metrics import parse_row
from primerl.runtime.run_outcome import RunOutcome, read_run_outcome

if TYPE_CHECKING:
    from primerl.proto.v1 import control_pb2

MAX_ROWS = 20_000
MAX_ROLLOUTS = 400
MAX_EVENTS = 300
MAX_CONFIG_BYTES = 256 << 10
MAX_READ_BYTES = 64 << 20  # one poll reads at most this much of a file
STATUS_CACHE_S = 0.5
RETRY_S = 5.0  # a broker that did not answer is asked again after this long
MAX_HISTORY_READS = 16
OUTCOME_CACHE_S = 2.0  # how the run stands is read again after this long (an ended run: when its files change)

# `2026-11-27T19:52:30.627595Z [warning  ] message   [logger] key=value ...` (structlog's console renderer).
_LOG_LINE = re.compile(r"^(?P<time>\S+)\s+\[(?P<level>warning|error|critical)\s*\]\s+(?P<message>.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a file, None when there is none: whether it changed."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _read_at(path: Path, offset: int) -> bytes | None:
    """Up to ``MAX_READ_BYTES`` of ``path`` from ``offset``; None when it cannot be read."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read(MAX_READ_BYTES)
    except OSError:
        return None


class JsonlTail:
    """The parsed lines of a growing JSONL file, read from where the last read stopped; at most ``max_items``
    kept (the newest). A half-written last line is read again next time; a bad line is skipped and counted."""

    def __init__(self, path: Path, max_items: int, parse: Callable[[str], Any]):
        self.path = path
        self.items: deque = deque(maxlen=max_items)
        self.num_read = 0  # items ever read (the index of the next one)
        self.num_bad_lines = 0
        self._parse = parse
        self._offset = 0
        self._identity: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            try:
                stat = self.path.stat()
            except OSError:
                return
            identity = (stat.st_dev, stat.st_ino)
            if identity != self._identity or stat.st_size < self._offset:  # a new or rewritten file
                self.items.clear()  # indexes start again at 0: a reader past them reads it all again
                self._offset, self._identity, self.num_read = 0, identity, 0
            if stat.st_size == self._offset:
                return
            data = _read_at(self.path, self._offset)
            if data is None:
                return
            end = data.rfind(b"\n")
            if end < 0:
                return
            for line in data[: end + 1].split(b"\n"):
                if not line.strip():
                    continue
                try:
                    item = self._parse(line.decode("utf-8", "replace"))
                except ValueError:
                    self.num_bad_lines += 1
                    continue
                self.items.append(item)
                self.num_read += 1
            self._offset += end + 1

    def since(self, index: int) -> tuple[list, int]:
        """Items with an index >= ``index`` (those still kept) and the index of the next item."""
        self.refresh()
        with self._lock:
            first = self.num_read - len(self.items)
            start = max(index, first) - first
            return list(self.items)[start:], self.num_read


def parse_rollout_line(line: str) -> dict:
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError("a rollout sample needs an integer step")
    return record


class RunDirSource:
    """What a run directory holds: its config, metric rows, sample rollouts, the warnings and errors in its logs,
    and how the run stands (``outcome``)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise ValueError(f"{self.run_dir} is not a directory: give the output_dir of a `primerl rl` run")
        self.metrics = JsonlTail(self.run_dir / METRICS_FILE, MAX_ROWS, parse_row)
        self.rollouts = JsonlTail(self.run_dir / ROLLOUTS_FILE, MAX_ROLLOUTS, parse_rollout_line)
        self._log_offsets: dict[str, int] = {}
        self._events: deque = deque(maxlen=MAX_EVENTS)
        self._events_lock = threading.Lock()
        self._outcome_lock = threading.Lock()
        self._outcome: tuple[RunOutcome, float, tuple] | None = None  # the outcome, when read, its files' identity

    def outcome(self) -> RunOutcome:
        """How the run stands (``read_run_outcome``): read again every ``OUTCOME_CACHE_S``; once it has ended, only
        when ``run_end.json`` or ``run.json`` changes (a new run in the directory)."""
        with self._outcome_lock:
            files = tuple(_identity(self.run_dir / name) for name in (RUN_END_FILE, RUN_FILE))
            if self._outcome is not None:
                outcome, read_s, read_files = self._outcome
                if read_files == files and (outcome.ended or time.monotonic() - read_s < OUTCOME_CACHE_S):
                    return outcome
            outcome = read_run_outcome(self.run_dir)
            self._outcome = (outcome, time.monotonic(), files)
            return outcome

    def config_text(self) -> str:
        path = self.run_dir / RUN_CONFIG_FILE
        try:
            with path.open("rb") as handle:
                return handle.read(MAX_CONFIG_BYTES).decode("utf-8", "replace")
        except OSError as err:
            return f"# {path} cannot be read: {err.strerror or err}"

    def events(self) -> list[dict]:
        """Warnings and errors of every role's log, oldest first (the newest ``MAX_EVENTS``)."""
        with self._events_lock:
            for path in sorted((self.run_dir / LOGS_DIR).glob("*.log")):
                self._read_log(path)
            return sorted(self._events, key=lambda event: event["time"])

    def _read_log(self, path: Path) -> None:
        offset = self._log_offsets.get(path.name, 0)
        try:
            size = path.stat().st_size
        except OSError:
            return
        offset = 0 if size < offset else offset
        data = _read_at(path, max(offset, size - MAX_READ_BYTES)) if size != offset else None
        if data is None:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._log_offsets[path.name] = max(offset, size - MAX_READ_BYTES) + end + 1
        for raw in data[: end + 1].decode("utf-8", "replace").splitlines():
            match = _LOG_LINE.match(_ANSI.sub("", raw))
            if match:
                self._events.append(
                    {
                        "time": match["time"],
                        "source": path.stem,
                        "level": match["level"],
                        "message": match["message"].strip()[:2000],
                    }
                )


class _Kept:
    """Items numbered as the broker numbers them; the newest ``max_items`` kept. Thread-safe."""

    def __init__(self, max_items: int):
        self.items: deque = deque(maxlen=max_items)
        self.next = 0
        self._lock = threading.Lock()

    def take(self, items: list, next_index: int) -> None:
        with self._lock:
            if next_index < self.next:  # a broker that lost its history (a fresh spool): start again
                self.items.clear()
            self.items.extend(items)
            self.next = next_index

    def since(self, index: int) -> tuple[list, int]:
        with self._lock:
            first = self.next - len(self.items)
            return list(self.items)[max(index, first) - first :], self.next


class BrokerSource:
    """The live run as the broker sees it: ``GetRunStatus`` and the run history (``GetRunHistory``: metric rows,
    events, sample rollouts, read incrementally and kept bounded here), through a read-only client. Answers are
    cached for ``STATUS_CACHE_S`` so that many open pages cost the broker one call of each per interval."""

    def __init__(self, client):
        self.client = client
        self._lock = threading.Lock()
        self._status: control_pb2.RunStatus | None = None
        self._error = ""
        self._read_s = 0.0
        self._asking = False  # a request is asking the broker for the status now
        self._history_lock = threading.Lock()  # held by the request reading the history
        self._history_read_s = 0.0
        self.rows = _Kept(MAX_ROWS)
        self.events = _Kept(MAX_EVENTS)
        self.rollouts = _Kept(MAX_ROLLOUTS)
        self.history_bytes = (0, 0)  # what the broker's history holds, and its bound

    def status(self) -> tuple[control_pb2.RunStatus | None, str]:
        """The broker's run status (None when it cannot be reached) and the error, if any. One request at a time
        asks the broker; the others meanwhile get the last answer (a slow broker never queues them)."""
        from primerl.client.broker_errors import BrokerError

        with self._lock:
            fresh = time.monotonic() - self._read_s < (STATUS_CACHE_S if self._status is not None else RETRY_S)
            if fresh or self._asking:
                return self._status, self._error
            self._asking = True
        try:
            status = self.client.get_run_status()
        except BrokerError as err:
            answer, error = None, str(err).splitlines()[0][:500]
        except Exception as err:  # never leave `_asking` set: the next request asks again
            answer, error = None, f"reading the broker failed: {type(err).__name__}: {err}"[:500]
        else:
            answer, error = status, ""
        with self._lock:
            self._status, self._error, self._read_s, self._asking = answer, error, time.monotonic(), False
            return self._status, self._error

    def refresh_history(self) -> None:
        """Read what the broker's history has beyond what is kept here (at most once per ``STATUS_CACHE_S``)."""
        import grpc

        from primerl.client.broker_errors import BrokerError

        if not self._history_lock.acquire(blocking=False):  # another request is reading it: use what is kept
            return
        try:
            if time.monotonic() - self._history_read_s < STATUS_CACHE_S:
                return
            self._history_read_s = time.monotonic()
            for _ in range(MAX_HISTORY_READS):  # a long history comes in replies of at most 3 MiB
                try:
                    history = self.client.get_run_history(self.rows.next, self.events.next, self.rollouts.next)
                except BrokerError as err:
                    if err.code == grpc.StatusCode.UNIMPLEMENTED:  # a broker before the run history
                        self._history_read_s = float("inf")
                    else:  # gone (a finished run) or unreachable: try again later, the page must not wait on it
                        self._history_read_s = time.monotonic() + RETRY_S
                    return
                self.rows.take([_row(row) for row in history.rows], history.metrics_next)
                self.events.take([_event(event) for event in history.events], history.events_next)
                records = []
                for record in history.rollouts:
                    try:
                        records.append(parse_rollout_line(record))
                    except ValueError:
                        continue
                self.rollouts.take(records, history.rollouts_next)
                self.history_bytes = (history.num_bytes, history.max_bytes)
                if not history.truncated:
                    return
        finally:
            self._history_lock.release()

    def close(self) -> None:
        self.client.close()


def _row(row) -> dict:
    from primerl.proto.v1 import common_pb2

    role = common_pb2.Role.Name(row.role).removeprefix("ROLE_").lower() if row.role in common_pb2.Role.values() else ""
    return {"step": int(row.step), "role": role, "time": row.unix_ms / 1000, **dict(row.metrics)}


def _event(event) -> dict:
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(event.unix_ms / 1000)) + f".{event.unix_ms % 1000:03d}Z"
    level = "error" if event.kind in ("error", "lost") else "info"
    return {
        "time": when,
        "source": event.source,
        "level": level,
        "kind": event.kind,
        "step": int(event.step),
        "message": event.message,
    }


def connect_broker(
    address: str,
    token: str | None,
    *,
    tls_ca_path: str | None = None,
    tls_cert_path: str | None = None,
    tls_key_path: str | None = None,
    tls_server_name: str | None = None,
    timeout_s: float = 2.0,
) -> BrokerSource:
    """A ``BrokerSource`` over a read-only client (role ``client``: it never registers). ``ValueError`` for a bad
    address or TLS file."""
    from pydantic import ValidationError

    from primerl.client.control import ControlClient
    from primerl.runtime.config_common import BrokerClientConfig

    try:
        config = BrokerClientConfig(
            address=address,
            run_token=token,
            connect_timeout_s=timeout_s,
            tls_ca_path=tls_ca_path,
            tls_cert_path=tls_cert_path,
            tls_key_path=tls_key_path,
            tls_server_name=tls_server_name,
        )
    except ValidationError as err:
        raise ValueError("; ".join(e["msg"] for e in err.errors())) from None
    return BrokerSource(ControlClient(config, role="client", name="primerl-dashboard", rpc_timeout_s=timeout_s))
