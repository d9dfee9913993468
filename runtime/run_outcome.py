"""How a `primerl rl` run ended, read back from its run directory: ``read_run_outcome(run_dir) -> RunOutcome``, the
one reader `primerl status RUN_DIR` and the dashboard share; ``RunEndRecorder``, the launcher's writer of the record.

``RUN_DIR/run_end.json`` (format ``primerl.run_end/1``) is written atomically by the launcher once every role has
stopped, and removed when a new run starts in the directory:

    ======================= ===========================================================================================
    field                   meaning
    ======================= ===========================================================================================
    format                  ``"primerl.run_end/1"``; any other value: the file is not read
    outcome                 ``"finished"`` (the trainer finished its steps; exit status 0), ``"stopped"`` (Ctrl-C or
                            SIGTERM), ``"failed"`` (a role failed past its restarts, the preflight found a problem,
                            or the launcher raised)
    reason                  one line: why it ended
    exit_code               the launcher's exit status (null: it raised)
    ended_unix_ms           when every role had stopped
    launcher_pid            the `primerl rl` process that wrote it
    run_id                  the broker's run id ("" when the broker never answered)
    trainer_step            the trainer's step and the last one committed (checkpointed), as the broker last said;
    last_committed_step     ``max_steps`` its bound (0: none known)
    max_steps
    policy_version          the latest policy version the trainer published
    served_policy_version   the lowest version an inference worker held at the end (null: unknown)
    last_status             the last ``RunStatus`` the launcher read from the broker, as protobuf JSON (proto field
                            names): the workers and queues as last seen; null when it read none
    ======================= ===========================================================================================

How a run directory reads (``read_run_outcome``), first match wins:

1. ``run_end.json``: its outcome.
2. ``run.json`` whose ``launcher_pid`` is a live process that started before ``run.json`` was written (where
   ``/proc`` says; a pid taken again later is not the launcher): ``running``.
3. ``run.json`` whose launcher is gone without a record (killed with SIGKILL, or a launcher older than the record):
   the broker's run state in its spool directory (``broker.spool_dir`` of ``rl.toml``; ``run_state.json``):
   ``finished`` when it says the trainer finished ``max_steps``, else ``stopped`` (nothing on disk says whether a
   role failed: the logs under ``RUN_DIR/logs`` do); the workers from its run history's events.
4. Neither file (not a `primerl rl` run directory, one whose broker is not ready yet, or one unreadable to this
   user): ``unknown``.

Nothing here imports the wire contracts: the protobuf JSON is filled into the caller's ``RunStatus``
(``RunOutcome.fill_status``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from primerl.runtime.durable_files import write_atomically
from primerl.runtime.process_ids import pid_alive
from primerl.runtime.run_files import (
    BROKER_RUN_HISTORY_FILE,
    BROKER_RUN_HISTORY_FORMAT,
    BROKER_RUN_STATE_FILE,
    BROKER_RUN_STATE_FORMAT,
    RUN_CONFIG_FILE,
    RUN_END_FILE,
    RUN_FILE,
)

FORMAT = "primerl.run_end/1"
RUNNING, FINISHED, STOPPED, FAILED, UNKNOWN = "running", "finished", "stopped", "failed", "unknown"
ENDED = (FINISHED, STOPPED, FAILED)
MAX_RECORD_BYTES = 16 << 20
MAX_HISTORY_BYTES = 64 << 20  # a run history past this is not read for its events (the bound is 16 MiB by default)
SIGNAL_EXITS = {130: "SIGINT", 143: "SIGTERM"}  # 128 + the signal: the launcher's status after a stop
WORKER_STATES = {"joined": "WORKER_STATE_ALIVE", "left": "WORKER_STATE_LEFT", "lost": "WORKER_STATE_LOST"}
RATES = ("rollout_batches_per_s", "rollout_bytes_per_s", "weight_bytes_per_s")
START_SLACK_S = 2.0  # a process's start time from /proc is exact to the second only


@dataclass(frozen=True)
class RunOutcome:
    """What a run directory says of its run: ``state`` (``RUNNING``, ``FINISHED``, ``STOPPED``, ``FAILED`` or
    ``UNKNOWN``) and, for a run that ended, its last known facts; ``source`` names the file they came from."""

    state: str
    reason: str = ""
    source: str = ""
    exit_code: int | None = None
    ended_unix_ms: int | None = None
    launcher_pid: int | None = None
    run_id: str = ""
    trainer_step: int = 0
    last_committed_step: int = 0
    max_steps: int = 0
    policy_version: int = 0
    served_policy_version: int | None = None
    last_status: dict | None = field(default=None, repr=False)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def summary(self) -> str:
        """One line: ``finished at step 30 / 30, policy v30 (served v30), 2026-12-05 10:03:04 UTC: <reason>``."""
        if not self.ended:
            return self.state if not self.reason else f"{self.state}: {self.reason}"
        steps = f"step {self.trainer_step}" + (f" / {self.max_steps}" if self.max_steps else "")
        served = "" if self.served_policy_version is None else f" (served v{self.served_policy_version})"
        when = f", {_utc(self.ended_unix_ms)}" if self.ended_unix_ms else ""
        return f"{self.state} at {steps}, policy v{self.policy_version}{served}{when}" + (
            f": {self.reason}" if self.reason else ""
        )

    def to_json(self) -> dict[str, Any]:
        """The facts as JSON (the ``last_status`` snapshot left out: ``fill_status`` serves it)."""
        return {k: v for k, v in asdict(self).items() if k != "last_status"}

    def fill_status(self, status: Any) -> Any:
        """``status`` (an empty ``primerl.v1.RunStatus``) filled with the run as last known: the recorded snapshot,
        then the facts above where they say more; rates are 0 (the run no longer moves). Returns ``status``."""
        from google.protobuf.json_format import ParseDict, ParseError

        if self.last_status:
            try:
                ParseDict(self.last_status, status, ignore_unknown_fields=True)
            except (ParseError, ValueError, TypeError):
                status.Clear()  # a snapshot this version cannot read: the facts alone
        status.run_id = status.run_id or self.run_id
        status.trainer_step = max(status.trainer_step, self.trainer_step)
        status.last_committed_step = max(status.last_committed_step, self.last_committed_step)
        status.max_steps = status.max_steps or self.max_steps
        status.latest_policy_version = max(status.latest_policy_version, self.policy_version)
        for rate in RATES:
            setattr(status, rate, 0.0)
        return status


# ------------------------------------------------------------------------------------------------- reading
def read_run_outcome(run_dir: str | os.PathLike[str]) -> RunOutcome:
    """How the run in ``run_dir`` stands; see the module docstring. Never raises for what the files hold."""
    run_dir = Path(run_dir)
    record = _read_json(run_dir / RUN_END_FILE, MAX_RECORD_BYTES)
    if isinstance(record, dict) and record.get("format") == FORMAT and record.get("outcome") in ENDED:
        return _from_record(record)
    run = _read_json(run_dir / RUN_FILE, MAX_RECORD_BYTES)
    if not isinstance(run, dict):
        return RunOutcome(UNKNOWN, reason=f"no readable {RUN_END_FILE} or {RUN_FILE}")
    pid = _count(run.get("launcher_pid")) or None
    if pid is None:
        return RunOutcome(UNKNOWN, reason=f"{RUN_FILE} names no launcher", source=RUN_FILE)
    if launcher_alive(pid, _mtime_s(run_dir / RUN_FILE)):
        return RunOutcome(RUNNING, source=RUN_FILE, launcher_pid=pid, run_id=_text(run.get("run_id")))
    return _from_spool(run_dir, pid, _text(run.get("run_id")))


def launcher_alive(pid: int, wrote_run_file_s: float | None) -> bool:
    """Whether ``pid`` is the live launcher that wrote ``run.json`` at ``wrote_run_file_s`` (unix s): a live process
    that started before then (a pid taken again after the launcher died started later). Where ``/proc`` does not
    say when a process started, any live process with that pid counts."""
    if pid == os.getpid():
        return True
    if not pid_alive(pid):
        return False
    started_s = process_started_s(pid)
    return started_s is None or wrote_run_file_s is None or started_s <= wrote_run_file_s + START_SLACK_S


def process_started_s(pid: int) -> float | None:
    """When ``pid`` started (unix s, to the second: the boot time is whole seconds), from ``/proc``; None where
    there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot_line = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        ticks = stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime: clock ticks after boot
        return int(boot_line.split()[1]) + int(ticks) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def _from_record(record: dict) -> RunOutcome:
    code = record.get("exit_code")
    status = record.get("last_status")
    served = record.get("served_policy_version")
    return RunOutcome(
        record["outcome"],
        reason=_text(record.get("reason")),
        source=RUN_END_FILE,
        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        ended_unix_ms=_count(record.get("ended_unix_ms")) or None,
        launcher_pid=_count(record.get("launcher_pid")) or None,
        run_id=_text(record.get("run_id")),
        trainer_step=_count(record.get("trainer_step")),
        last_committed_step=_count(record.get("last_committed_step")),
        max_steps=_count(record.get("max_steps")),
        policy_version=_count(record.get("policy_version")),
        served_policy_version=_count(served) if served is not None else None,
        last_status=status if isinstance(status, dict) else None,
    )


def _from_spool(run_dir: Path, pid: int, run_id: str) -> RunOutcome:
    """A run whose launcher is gone without a record: what its broker persisted (see the module docstring)."""
    config = _read_config(run_dir)
    spool = _spool_dir(run_dir, config)
    state = _read_json(spool / BROKER_RUN_STATE_FILE, MAX_RECORD_BYTES) if spool is not None else None
    if not (isinstance(state, dict) and state.get("format") == BROKER_RUN_STATE_FORMAT):
        state = {}
    finished = state.get("finished") is True
    gone = f"its launcher (pid {pid}) is gone and left no {RUN_END_FILE}"
    reason = "the broker recorded the run as finished; " + gone if finished else gone + " (killed?)"
    updated = _count(state.get("updated_unix_ms")) or None
    last_status = {
        "run_id": _text(state.get("run_id")) or run_id,
        "trainer_step": _count(state.get("trainer_step")),
        "last_committed_step": _count(state.get("last_committed_step")),
        "orchestrator_step": _count(state.get("orchestrator_step")),
        "latest_policy_version": _count(state.get("latest_policy_version")),
        "last_metrics_step": _count(state.get("last_metrics_step")),
        "last_metrics": _finite_metrics(state.get("last_metrics")),
        "updated_unix_ms": updated or 0,
        "workers": _workers_from_history(spool) if spool is not None else [],
    }
    return RunOutcome(
        FINISHED if finished else STOPPED,
        reason=reason,
        source=f"the broker's {BROKER_RUN_STATE_FILE}" if state else RUN_FILE,
        ended_unix_ms=updated,
        launcher_pid=pid,
        run_id=last_status["run_id"],
        trainer_step=last_status["trainer_step"],
        last_committed_step=last_status["last_committed_step"],
        max_steps=_max_steps(config),
        policy_version=last_status["latest_policy_version"],
        last_status=last_status,
    )


def _workers_from_history(spool: Path) -> list[dict]:
    """The workers the broker's run history saw join, leave or be lost, each in its last known state (protobuf
    JSON of ``WorkerInfo``); the history is bounded, so a worker whose events were dropped is missing."""
    history = _read_json(spool / BROKER_RUN_HISTORY_FILE, MAX_HISTORY_BYTES)
    if not (isinstance(history, dict) and history.get("format") == BROKER_RUN_HISTORY_FORMAT):
        return []
    events = history.get("events", {}).get("items", []) if isinstance(history.get("events"), dict) else []
    workers: dict[str, dict] = {}
    for event in events if isinstance(events, list) else []:
        if not isinstance(event, dict) or event.get("kind") not in WORKER_STATES:
            continue
        name, when = _text(event.get("source")), _count(event.get("unix_ms"))
        worker = workers.setdefault(name, {"name": name, "registered_unix_ms": when})
        worker.update(state=WORKER_STATES[event["kind"]], last_heartbeat_unix_ms=when)
        if event["kind"] == "joined":  # "trainer registered from host-1"
            role = _text(event.get("message")).split(" ", 1)[0]
            worker["role"] = f"ROLE_{role.upper()}" if role.isidentifier() else "ROLE_UNSPECIFIED"
    return list(workers.values())


def _mtime_s(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _read_config(run_dir: Path) -> dict:
    try:
        return tomllib.loads((run_dir / RUN_CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}


def _spool_dir(run_dir: Path, config: dict) -> Path | None:
    """The broker's spool directory: ``broker.spool_dir`` of ``rl.toml``, an absolute path or one relative to where
    the run started; a relative one under the run's ``output_dir`` (the default, ``<output_dir>/broker/spool``) is
    found from ``run_dir`` wherever this runs; ``<run_dir>/broker/spool`` when the config does not say."""
    broker = config.get("broker") if isinstance(config.get("broker"), dict) else {}
    spool, output_dir = broker.get("spool_dir"), config.get("output_dir")
    if not isinstance(spool, str):
        return run_dir / "broker" / "spool"
    path = Path(spool)
    if path.is_absolute():
        return path
    if isinstance(output_dir, str) and path.is_relative_to(output_dir):
        return run_dir / path.relative_to(output_dir)
    return path if path.is_dir() else None


def _max_steps(config: dict) -> int:
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    return _count(config.get("max_steps")) or _count(trainer.get("max_steps"))


def _read_json(path: Path, max_bytes: int) -> Any:
    try:
        if path.stat().st_size > max_bytes:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _count(value: Any) -> int:
    """A count from a JSON value (protobuf JSON writes 64-bit integers as strings); 0 when it is none."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _text(value: Any) -> str:
    return value[:2000] if isinstance(value, str) else ""


def _finite_metrics(metrics: Any) -> dict[str, float]:
    if not isinstance(metrics, dict):
        return {}
    return {
        str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and abs(float(v)) < float("inf")
    }


def _utc(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_ms / 1000))


# ------------------------------------------------------------------------------------------------- writing
class RunEndRecorder:
    """The launcher's record of how its run ended: ``clear`` as the run starts (a former run's record goes),
    ``saw`` each ``RunStatus`` it reads from the broker (the last one is kept), ``failed_because`` with the line
    that ended a failed run, and ``write`` once every role stopped. Nothing is written for a launch that never
    reached ``clear`` (a config refused before the run directory was touched)."""

    def __init__(self, run_dir: str | os.PathLike[str], err: TextIO = sys.stderr):
        self.path = Path(run_dir) / RUN_END_FILE
        self._err = err
        self._armed = False
        self._last_status: Any = None
        self._failure = ""

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        self._armed = True

    def saw(self, status: Any) -> Any:
        """Keep ``status`` as the last one seen; returns it."""
        self._last_status = status
        return status

    def failed_because(self, reason: str) -> None:
        self._failure = reason.splitlines()[0][:2000] if reason else ""

    def record(self, exit_code: int | None, served_policy_version: int | None = None) -> dict[str, Any]:
        """The content of ``run_end.json`` for a launcher that ends with ``exit_code`` (None: it raised)."""
        from google.protobuf.json_format import MessageToDict

        status = self._last_status
        facts = {
            "run_id": status.run_id if status is not None else "",
            "trainer_step": status.trainer_step if status is not None else 0,
            "last_committed_step": status.last_committed_step if status is not None else 0,
            "max_steps": status.max_steps if status is not None else 0,
            "policy_version": status.latest_policy_version if status is not None else 0,
        }
        snapshot = None
        if status is not None:
            snapshot = MessageToDict(status, preserving_proto_field_name=True)
            for worker in snapshot.get("workers", []):
                worker.pop("worker_id", None)  # the broker's handle of a worker: of no use once the run ended
        if exit_code == 0:
            outcome, reason = FINISHED, f"the trainer finished step {facts['trainer_step']}"
        elif exit_code in SIGNAL_EXITS:
            outcome, reason = STOPPED, f"{SIGNAL_EXITS[exit_code]}: every role was stopped"
        else:
            outcome = FAILED
            reason = self._failure or (
                f"primerl rl exited with status {exit_code}" if exit_code is not None else "primerl rl raised an error"
            )
        return {
            "format": FORMAT,
            "outcome": outcome,
            "reason": reason,
            "exit_code": exit_code,
            "ended_unix_ms": int(time.time() * 1000),
            "launcher_pid": os.getpid(),
            **facts,
            "served_policy_version": served_policy_version,
            "last_status": snapshot,
        }

    def write(self, exit_code: int | None, served_policy_version: int | None = None) -> Path | None:
        """Write ``run_end.json`` atomically (``record``); a disk that refuses is a note on ``err``, never an
        error of the run. The path written, else None."""
        if not self._armed:
            return None
        data = json.dumps(self.record(exit_code, served_policy_version), indent=2, allow_nan=False) + "\n"
        try:
            write_atomically(self.path, [data.encode()], temp_path=self.path.with_name(f".{RUN_END_FILE}.tmp"))
        except OSError as err:
            print(f"primerl rl: note: cannot write {self.path}: {err.strerror or err}", file=self._err, flush=True)
            return None
        return self.path
