"""The broker's run state on disk: what ``primerl status`` shows survives a broker restart.

A broker keeps its workers in memory only (they re-register after a restart); the facts about the *run* are
written to ``run_state.json`` in the spool directory (whose ``LOCK`` already keeps one broker per directory;
the spool's loader ignores the file, and removes a ``.tmp`` leftover of a crash mid-write):

    ====================== ==============================================================================
    field                  meaning
    ====================== ==============================================================================
    format                 ``"primerl.run_state/1"``; any other value: the file is not read
    run_id                 the run's id (a restarted broker without ``run_id`` in its config keeps it)
    last_committed_step    highest step the trainer committed (its checkpoint is durable)
    trainer_step           highest step any trainer rank reported
    orchestrator_step      highest step the orchestrator reported
    latest_policy_version  latest policy version the broker's weight store accepted
    policy_lineage         the largest policy lineage handed out to a trainer or held by the weight store: the
                           next trainer incarnation is given one above it (0 in a file from before the field:
                           the counter then starts above the weight store's lineage)
    last_metrics           the merged last metrics (name -> finite float), ``last_metrics_step`` their step
    finished               the run is complete (the trainer finished ``max_steps``): late workers are told
                           to stop; ``finished_step`` is the trainer step it finished at
    updated_unix_ms        wall-clock time of the write
    ====================== ==============================================================================

Writes are atomic (temporary file, fsync, rename, directory fsync): after a crash the file is the old or the
new state, never a mix. ``RunStateFile.write`` drops a snapshot older than the one already written (the
registry numbers its snapshots), so a slow periodic write never overwrites a newer commit's.

A file that cannot be read or parsed is never fatal: ``load`` logs one warning that says what is wrong, moves
the file aside to ``run_state.json.corrupt`` (kept for inspection, replaced by a later corrupt one) and the
broker starts fresh. Nothing here unpickles anything.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from primerl.runtime.durable_files import write_atomically
from primerl.runtime.log_setup import get_logger
from primerl.runtime.periodic import Periodic
from primerl.runtime.run_files import BROKER_RUN_STATE_FILE, BROKER_RUN_STATE_FORMAT

log = get_logger("primerl.broker.run_state")

RUN_STATE_FILE = BROKER_RUN_STATE_FILE
CORRUPT_SUFFIX = ".corrupt"
FORMAT = BROKER_RUN_STATE_FORMAT
MAX_FILE_BYTES = 16 << 20  # 2048 metric names of 128 characters are ~0.3 MiB; more is not a run state
DEFAULT_SAVE_INTERVAL_S = 1.0


class RunStateCorrupt(ValueError):
    """The run-state file does not hold a run state of this format (the message says what is wrong)."""


@dataclass
class RunState:
    """The run's facts that a restarted broker must still know (workers excepted: they re-register)."""

    run_id: str
    last_committed_step: int = 0
    trainer_step: int = 0
    orchestrator_step: int = 0
    latest_policy_version: int = 0
    policy_lineage: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    last_metrics_step: int = 0
    finished: bool = False
    finished_step: int = 0

    def to_json(self, updated_unix_ms: int) -> bytes:
        return json.dumps(
            {"format": FORMAT, **asdict(self), "updated_unix_ms": updated_unix_ms}, sort_keys=True, allow_nan=False
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RunState:
        """Parse and check every field; ``RunStateCorrupt`` says which one is wrong."""
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RunStateCorrupt(f"not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise RunStateCorrupt(f"a JSON {type(raw).__name__}, not an object")
        if raw.get("format") != FORMAT:
            raise RunStateCorrupt(f"format is {str(raw.get('format'))[:40]!r}, expected {FORMAT!r}")
        run_id = raw.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            raise RunStateCorrupt("run_id is missing or not a non-empty string")
        counts = {}
        for name in (
            "last_committed_step",
            "trainer_step",
            "orchestrator_step",
            "latest_policy_version",
            "policy_lineage",
            "last_metrics_step",
            "finished_step",
        ):
            value = raw.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RunStateCorrupt(f"{name} is {str(value)[:40]!r}, not a count >= 0")
            counts[name] = value
        metrics = raw.get("last_metrics", {})
        if not isinstance(metrics, dict):
            raise RunStateCorrupt("last_metrics is not an object")
        for name, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise RunStateCorrupt(f"metric {name[:40]!r} is {str(value)[:40]!r}, not a finite number")
        finished = raw.get("finished", False)
        if not isinstance(finished, bool):
            raise RunStateCorrupt("finished is not true or false")
        return cls(run_id=run_id, last_metrics={k: float(v) for k, v in metrics.items()}, finished=finished, **counts)


class RunStateFile:
    """``run_state.json`` in ``directory``: atomic writes, tolerant reads. Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], *, wall_clock: Callable[[], float] = time.time):
        self.directory = Path(directory)
        self.path = self.directory / RUN_STATE_FILE
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._written_revision = -1
        self._written: RunState | None = None

    @property
    def written_revision(self) -> int:
        """The revision of the last snapshot written (-1: none)."""
        with self._lock:
            return self._written_revision

    def load(self) -> RunState | None:
        """The state written by an earlier broker, or None: no file, or (one warning, file moved aside) a file
        that cannot be read or parsed."""
        try:
            size = self.path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise RunStateCorrupt(f"{size} bytes, more than the {MAX_FILE_BYTES} a run state can take")
            state = RunState.from_json(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, RunStateCorrupt) as err:
            set_aside(self.path, err, log, "run state unreadable: starting fresh")
            return None
        log.info(
            "run state loaded",
            path=str(self.path),
            run_id=state.run_id,
            last_committed_step=state.last_committed_step,
            trainer_step=state.trainer_step,
            policy_version=state.latest_policy_version,
            finished=state.finished,
        )
        return state

    def write(self, state: RunState, revision: int) -> bool:
        """Write ``state`` durably unless a snapshot of the same or a later ``revision`` is already written, or
        the state is the one on disk. Returns True when it wrote. ``OSError`` when the disk refuses."""
        with self._lock:
            if revision <= self._written_revision:
                return False
            if state == self._written:
                self._written_revision = revision
                return False
            data = state.to_json(int(self._wall_clock() * 1000))
            write_atomically(self.path, [data], temp_path=self.directory / f".{RUN_STATE_FILE}.{os.getpid()}.tmp")
            self._written_revision = revision
            self._written = replace(state, last_metrics=dict(state.last_metrics))
            return True


def set_aside(path: Path, err: Exception, logger: Any, event: str) -> None:
    """``path`` cannot be read (``err``): move it to ``<name>.corrupt`` (kept for inspection, replacing an older
    one) and log ``event`` once."""
    aside = path.with_name(path.name + CORRUPT_SUFFIX)
    try:
        os.replace(path, aside)
        where = f"moved to {aside.name}"
    except OSError as move_err:
        where = f"left in place ({move_err.strerror or move_err})"
    logger.warning(event, path=str(path), error=str(err)[:300], file=where)


class RunStateSaver(Periodic):
    """A background thread that writes the registry's run state at most every ``interval_s`` when it changed.

    Commits do not wait for it: the registry writes their state itself before answering (``persist`` hook).
    ``stop`` writes once more, so a clean stop (SIGTERM) loses nothing. A failed write is logged (once per
    distinct error, with the recovery when it heals) and retried at the next interval; never fatal here.
    """

    def __init__(
        self,
        snapshot: Callable[[], tuple[int, RunState]],
        store: RunStateFile,
        interval_s: float = DEFAULT_SAVE_INTERVAL_S,
        on_error: Callable[[str], None] | None = None,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._snapshot = snapshot
        self.store = store
        self._on_error = on_error
        self._last_error = ""
        self.num_writes = 0
        super().__init__(
            "broker-run-state",
            interval_s,
            self.save_once,
            log=log,
            failed_event="run state save failed",
            slow_stop_event="run state saver did not stop in time",
        )

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread, then write once more (not when the thread is still running)."""
        if not super().stop(timeout_s):
            return False
        self.save_once()
        return True

    def save_once(self) -> bool:
        """Write the current state if it changed since the last write; True when it wrote."""
        revision, state = self._snapshot()
        try:
            wrote = self.store.write(state, revision)
        except OSError as err:
            message = f"writing {self.store.path} failed: {err}"
            if message != self._last_error:
                self._last_error = message
                log.error("run state not saved", path=str(self.store.path), error=str(err))
                if self._on_error is not None:
                    self._on_error(message)
            return False
        if self._last_error:
            log.info("run state saved again", path=str(self.store.path))
            self._last_error = ""
        self.num_writes += wrote
        return wrote
