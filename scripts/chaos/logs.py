"""Reading the roles' logs: JSON lines (``--log.format json``), one file per role, one ``=== ...`` header line per
start of the role (written by the restarter here and by `primerl rl`'s supervisor), so a file splits into
incarnations. Lines that are not JSON (vLLM's own prints, tracebacks) are kept as text for error excerpts.

An incarnation started with its clock skewed (``runs.faketime_prefix``: its header shows ``FAKETIME=<s>``) writes
timestamps that far off; its events' ``at_s`` are set back to the true time, so that every role's events stay in
one order."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from primerl.runtime.run_metrics import read_metrics_file


@dataclass
class Event:
    role: str
    incarnation: int  # 1 for the first start of the role
    at_s: float  # wall clock from the line's timestamp (0.0 when it has none)
    fields: dict

    @property
    def name(self) -> str:
        return str(self.fields.get("event", ""))

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


@dataclass
class Incarnation:
    role: str
    number: int
    events: list[Event] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the lines that are not JSON

    def named(self, name: str) -> list[Event]:
        return [e for e in self.events if e.name == name]

    def last_error(self) -> str:
        """The last error-level event or traceback line of this incarnation: what an operator would look at."""
        errors = [e for e in self.events if e.get("level") in ("error", "critical", "exception")]
        if errors:
            event = errors[-1]
            extra = {
                k: v
                for k, v in event.fields.items()
                if k not in ("event", "level", "logger", "timestamp", "run_id", "role", "exception")
            }
            exception = str(event.get("exception", "")).strip().splitlines()
            tail = f" | {exception[-1]}" if exception else ""
            return f"{event.name} {json.dumps(extra, default=str)[:300]}{tail}"[:500]
        tracebacks = [line for line in self.text if "Error" in line or "Exception" in line]
        return tracebacks[-1][:300] if tracebacks else "(no error line)"


def parse_timestamp(value: object) -> float:
    if not isinstance(value, str):
        return 0.0
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


def clock_skew_of(header: str) -> float:
    """The clock skew a role's log header line (``=== <time> <argv>``) shows for that incarnation, else 0."""
    match = re.search(r"\bFAKETIME=([+-]?\d+)(?=\s)", header)
    return float(match.group(1)) if match else 0.0


class LogFollower:
    """Reads the complete lines a role's log file gained since the last call."""

    def __init__(self, role: str, path: Path):
        self.role = role
        self.path = Path(path)
        self.offset = 0
        self.incarnation = 0
        self.partial = b""
        self.skew_s = 0.0  # the clock skew of the current incarnation

    def read(self) -> list[Event]:
        try:
            with open(self.path, "rb") as log_file:
                log_file.seek(self.offset)
                data = log_file.read(1 << 22)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        events = []
        for raw in lines:
            event = self._parse(raw.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        return events

    def _parse(self, line: str) -> Event | None:
        if line.startswith("=== "):
            self.incarnation += 1
            self.skew_s = clock_skew_of(line)
            return Event(self.role, self.incarnation, 0.0, {"event": "=== start", "line": line})
        if not line.startswith("{"):
            return Event(self.role, self.incarnation, 0.0, {"event": "", "text": line})
        try:
            fields = json.loads(line)
        except json.JSONDecodeError:
            return Event(self.role, self.incarnation, 0.0, {"event": "", "text": line})
        if not isinstance(fields, dict):
            return None
        at_s = parse_timestamp(fields.get("timestamp"))
        return Event(self.role, self.incarnation, at_s - self.skew_s if at_s else 0.0, fields)


def read_incarnations(role: str, path: Path) -> list[Incarnation]:
    """The whole log of a role, split at its start headers (lines before the first header: incarnation 0)."""
    follower = LogFollower(role, path)
    incarnations: dict[int, Incarnation] = {}
    while True:
        events = follower.read()
        if not events:
            break
        for event in events:
            incarnation = incarnations.setdefault(event.incarnation, Incarnation(role, event.incarnation))
            if "text" in event.fields:
                incarnation.text.append(event.fields["text"])
            elif event.name != "=== start":
                incarnation.events.append(event)
    return [incarnations[n] for n in sorted(incarnations) if n > 0 or incarnations[n].events]


def read_metrics_rows(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` at ``path`` (none when it is missing), a row cut short by a kill skipped."""
    try:
        return read_metrics_file(path, skip_bad_lines=True).rows
    except OSError:
        return []
