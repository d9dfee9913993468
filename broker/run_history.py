"""The broker's bounded run history: what the dashboard draws of a live run (``GetRunHistory``).

Three lists, oldest first, each item numbered from the run's start (a reader asks for the items after the index it
has): metric rows (every ``ReportMetrics``: role, step, time, metrics), events (workers joining, leaving or lost,
errors from heartbeats, the run finishing) and sample rollouts (``ReportRollouts``: JSON records). Memory is bounded
by ``max_bytes`` (``broker.history_max_bytes``): rows may take half, rollouts two fifths, events a tenth; past its
share a list drops its oldest items. Sizes are the items' serialized sizes (what the history holds and writes).

Persistence: ``to_json`` / ``restore`` (format ``primerl.run_history/1``) in ``<spool_dir>/run_history.json``
(``RunHistoryFile``, written atomically by a ``RunStateSaver`` every ``SAVE_INTERVAL_S`` when it changed), so a
restarted broker serves the history its predecessor had. A file that cannot be read is set aside with one
warning, as the run state is. Thread-safe.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from primerl.broker.registry_errors import InvalidRequest
from primerl.broker.run_state import set_aside
from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.durable_files import write_atomically
from primerl.runtime.log_setup import get_logger
from primerl.runtime.run_files import BROKER_RUN_HISTORY_FILE, BROKER_RUN_HISTORY_FORMAT

log = get_logger("primerl.broker.run_history")

FORMAT = BROKER_RUN_HISTORY_FORMAT
HISTORY_FILE = BROKER_RUN_HISTORY_FILE
DEFAULT_MAX_BYTES = 16 << 20
SAVE_INTERVAL_S = 5.0
MAX_REPLY_BYTES = 3 << 20  # one GetRunHistory reply, under a default gRPC client's 4 MiB
MAX_ROLLOUT_RECORD_BYTES = 256 << 10
MAX_ROLLOUTS_PER_REPORT = 64
MAX_EVENT_MESSAGE_CHARS = 1000
SHARES = {"rows": 0.5, "rollouts": 0.4, "events": 0.1}
ITEM_OVERHEAD_BYTES = 80  # per item: its str object header and deque slot, roughly


class BadRollouts(InvalidRequest):
    """A ``ReportRollouts`` whose records are not what the orchestrator sends (INVALID_ARGUMENT)."""


class _Bounded:
    """A list of (serialized size, item) numbered from 0, oldest dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.items: deque = deque()
        self.num_bytes = 0
        self.next = 0  # the index of the next item appended

    def append(self, item, size: int) -> None:
        self.items.append((size, item))
        self.num_bytes += size
        self.next += 1
        while self.num_bytes > self.max_bytes and len(self.items) > 1:
            old_size, _ = self.items.popleft()
            self.num_bytes -= old_size

    def since(self, index: int, max_bytes: int) -> tuple[list, int, bool]:
        """The items from ``index`` (or the oldest kept) up to ``max_bytes`` (one at least), the index after the
        last one returned, and whether items were left out for the bound."""
        first = self.next - len(self.items)
        start = max(index, first) - first
        taken, total = [], 0
        for size, item in itertools.islice(self.items, start, None):
            if taken and total + size > max_bytes:
                return taken, first + start + len(taken), True
            taken.append(item)
            total += size
        return taken, first + start + len(taken), False


@dataclass(frozen=True)
class HistorySlice:
    rows: list[dict]
    events: list[dict]
    rollouts: list[str]
    metrics_next: int
    events_next: int
    rollouts_next: int
    num_bytes: int
    max_bytes: int
    truncated: bool = False

    def to_proto(self) -> control_pb2.RunHistory:
        return control_pb2.RunHistory(
            rows=[
                control_pb2.MetricRow(
                    step=row["step"], role=row["role"], unix_ms=row["unix_ms"], metrics=row["metrics"]
                )
                for row in self.rows
            ],
            events=[control_pb2.RunEvent(**event) for event in self.events],
            rollouts=self.rollouts,
            metrics_next=self.metrics_next,
            events_next=self.events_next,
            rollouts_next=self.rollouts_next,
            num_bytes=self.num_bytes,
            max_bytes=self.max_bytes,
            truncated=self.truncated,
        )


class RunHistory:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, *, wall_clock: Callable[[], float] = time.time):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._clock = wall_clock
        self._lock = threading.Lock()
        self._lists = {name: _Bounded(int(max_bytes * share)) for name, share in SHARES.items()}
        self.revision = 0  # bumped on every change (the saver writes when it moved)

    # ------------------------------------------------------------------------------------------ intake
    def add_metrics(self, role: int, step: int, metrics: Mapping[str, float]) -> None:
        row = {
            "step": int(step),
            "role": int(role),
            "unix_ms": self._unix_ms(),
            "metrics": {k: float(v) for k, v in metrics.items() if math.isfinite(v)},
        }
        self._add("rows", _text(row))

    def add_event(self, kind: str, source: str, message: str, step: int = 0) -> None:
        event = {
            "unix_ms": self._unix_ms(),
            "step": int(step),
            "kind": kind,
            "source": source[:200],
            "message": message[:MAX_EVENT_MESSAGE_CHARS],
        }
        self._add("events", _text(event))

    def add_rollouts(self, step: int, records: list[str]) -> int:
        """Keep the step's sample rollouts; ``BadRollouts`` (nothing kept) when one is not a JSON object with this
        step, or is larger than ``MAX_ROLLOUT_RECORD_BYTES``, or there are too many. Returns how many were kept."""
        if len(records) > MAX_ROLLOUTS_PER_REPORT:
            raise BadRollouts(f"{len(records)} sample rollouts in one report; at most {MAX_ROLLOUTS_PER_REPORT}")
        checked = []
        for number, record in enumerate(records):
            size = len(record.encode())
            if size > MAX_ROLLOUT_RECORD_BYTES:
                raise BadRollouts(
                    f"sample rollout {number} is {size} bytes; at most {MAX_ROLLOUT_RECORD_BYTES} (the orchestrator "
                    "cuts its records to 64 KiB)"
                )
            try:
                parsed = json.loads(record)
            except ValueError as err:
                raise BadRollouts(f"sample rollout {number} is not JSON: {err}") from None
            if not isinstance(parsed, dict) or parsed.get("step") != step:
                raise BadRollouts(f'sample rollout {number} is not a JSON object with "step": {step}')
            checked.append((record, size))
        for record, _ in checked:
            self._add("rollouts", record)
        return len(checked)

    def _add(self, name: str, text: str) -> None:
        """Items are kept as their JSON text: what they take in memory is about what they count."""
        with self._lock:
            self._lists[name].append(text, len(text.encode()) + ITEM_OVERHEAD_BYTES)
            self.revision += 1

    # ------------------------------------------------------------------------------------------ reads
    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(part.num_bytes for part in self._lists.values())

    def since(
        self, metrics: int = 0, events: int = 0, rollouts: int = 0, max_reply_bytes: int = MAX_REPLY_BYTES
    ) -> HistorySlice:
        """The items after these indices, each list within its share of ``max_reply_bytes``."""
        with self._lock:
            parts = self._lists
            rows, metrics_next, cut_rows = parts["rows"].since(metrics, int(max_reply_bytes * SHARES["rows"]))
            events_, events_next, cut_events = parts["events"].since(events, int(max_reply_bytes * SHARES["events"]))
            records, rollouts_next, cut_rollouts = parts["rollouts"].since(
                rollouts, int(max_reply_bytes * SHARES["rollouts"])
            )
            return HistorySlice(
                rows=[json.loads(text) for text in rows],
                events=[json.loads(text) for text in events_],
                rollouts=records,
                metrics_next=metrics_next,
                events_next=events_next,
                rollouts_next=rollouts_next,
                num_bytes=sum(part.num_bytes for part in parts.values()),
                max_bytes=self.max_bytes,
                truncated=cut_rows or cut_events or cut_rollouts,
            )

    # ------------------------------------------------------------------------------------- persistence
    def snapshot(self) -> tuple[int, Callable[[], bytes]]:
        """The revision and how to serialize the history (``FORMAT``), for ``RunHistoryFile.write``: it serializes
        only a revision it has not written yet."""
        with self._lock:
            return self.revision, self.to_json

    def to_json(self) -> bytes:
        with self._lock:  # rows and events are JSON text already: joined as they are
            parts = [f'{{"format":{json.dumps(FORMAT)}']
            for name, part in self._lists.items():
                texts = [text for _, text in part.items]
                items = json.dumps(texts) if name == "rollouts" else "[" + ",".join(texts) + "]"
                parts.append(f',"{name}":{{"next":{part.next},"items":{items}}}')
            return ("".join(parts) + "}").encode()

    def restore(self, data: bytes) -> None:
        """Take back a history written by ``snapshot`` (``ValueError`` saying what is wrong; nothing changed)."""
        raw = json.loads(data.decode("utf-8"))
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a run history of format {FORMAT!r}")
        lists = {}
        for name, check in (("rows", _check_row), ("events", _check_event), ("rollouts", _check_rollout)):
            part = raw.get(name)
            if not isinstance(part, dict) or not isinstance(part.get("items"), list):
                raise ValueError(f"{name} is missing or not an object with items")
            items = part["items"]
            next_index = part.get("next")
            if not isinstance(next_index, int) or next_index < len(items):
                raise ValueError(f"{name}.next is {str(next_index)[:40]!r}, not a count >= its items")
            for item in items:
                check(item)
            lists[name] = (next_index, items)
        with self._lock:
            for name, (next_index, items) in lists.items():
                part = self._lists[name]
                part.items.clear()
                part.num_bytes = 0
                for item in items:
                    text = item if isinstance(item, str) else _text(item)
                    part.append(text, len(text.encode()) + ITEM_OVERHEAD_BYTES)
                part.next = next_index
            self.revision += 1

    def _unix_ms(self) -> int:
        return int(self._clock() * 1000)


def _text(item: dict) -> str:
    return json.dumps(item, allow_nan=False, separators=(",", ":"))


def _check_row(row) -> None:
    if not (
        isinstance(row, dict)
        and isinstance(row.get("step"), int)
        and row.get("role") in common_pb2.Role.values()
        and isinstance(row.get("unix_ms"), int)
        and isinstance(row.get("metrics"), dict)
        and all(isinstance(v, (int, float)) and math.isfinite(v) for v in row["metrics"].values())
    ):
        raise ValueError(f"a metric row is malformed: {str(row)[:100]}")


def _check_event(event) -> None:
    fields = {"unix_ms": int, "step": int, "kind": str, "source": str, "message": str}
    if not isinstance(event, dict) or set(event) != set(fields):
        raise ValueError(f"an event is malformed: {str(event)[:100]}")
    for name, kind in fields.items():
        if not isinstance(event[name], kind):
            raise ValueError(f"an event's {name} is not a {kind.__name__}")


def _check_rollout(record) -> None:
    if not isinstance(record, str):
        raise ValueError("a sample rollout is not a JSON string")


class RunHistoryFile:
    """``run_history.json`` in ``directory``: atomic writes of a revision newer than the last written, tolerant
    reads (a bad file is set aside as ``run_history.json.corrupt``). Fits ``RunStateSaver``'s ``store``."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self.path = self.directory / HISTORY_FILE
        self._lock = threading.Lock()
        self._written_revision = -1

    def load_into(self, history: RunHistory) -> bool:
        """Restore ``history`` from the file; False when there is none or it is unreadable (one warning)."""
        try:
            data = self.path.read_bytes()
            history.restore(data)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as err:
            set_aside(self.path, err, log, "run history unreadable: starting fresh")
            return False
        with self._lock:
            self._written_revision = history.revision
        log.info("run history loaded", path=str(self.path), num_bytes=history.num_bytes)
        return True

    def write(self, serialize: Callable[[], bytes], revision: int) -> bool:
        with self._lock:
            if revision <= self._written_revision:
                return False
            write_atomically(self.path, [serialize()], temp_path=self.directory / f".{HISTORY_FILE}.{os.getpid()}.tmp")
            self._written_revision = revision
            return True
