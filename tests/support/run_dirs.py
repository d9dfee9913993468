"""Run directories of `primerl rl` runs as they look at their end, built without running anything: ``rl.toml``,
``metrics.jsonl``, ``run.json`` and ``run_end.json`` (through the launcher's own ``RunEndRecorder``), and a broker
spool for a launcher that died without a record."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.run_files import BROKER_RUN_HISTORY_FILE, BROKER_RUN_STATE_FILE, RUN_END_FILE
from primerl.runtime.run_outcome import RunEndRecorder
from primerl.supervisor.run_file import RunFile, write_run_file

MAX_STEPS = 30
RUN_ID = "run-1a2b3c4d"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(30)
    return process.pid


def last_status(step: int = MAX_STEPS) -> control_pb2.RunStatus:
    """A broker's answer near the end of a run at ``step``: a trainer, an inference worker serving v``step``, the
    rollout queue."""
    status = control_pb2.RunStatus(
        run_id=RUN_ID,
        broker_started_unix_ms=1_000,
        updated_unix_ms=61_000,
        trainer_step=step,
        last_committed_step=step,
        latest_policy_version=step,
        orchestrator_step=step,
        max_steps=MAX_STEPS,
        rollout_batches_per_s=1.5,
        last_metrics={"train/loss": 0.25},
        last_metrics_step=step,
    )
    status.workers.add(worker_id="w-1", role=common_pb2.ROLE_TRAINER, name="trainer-rank0", state=1, trainer_step=step)
    status.workers.add(
        worker_id="w-2",
        role=common_pb2.ROLE_INFERENCE,
        name="infer-0",
        address="http://127.0.0.1:8000",
        state=1,
        policy_version=step,
        last_heartbeat_unix_ms=60_500,
    )
    status.queues.add(name="rollouts", num_items=2, num_bytes=4096, capacity_items=8, capacity_bytes=1 << 20)
    return status


def write_run_dir(run_dir: Path, *, launcher_pid: int, broker_address: str = "127.0.0.1:1") -> Path:
    """A run directory as `primerl rl` leaves it once its broker was ready: config, metrics, logs, ``run.json``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "rl.toml").write_text(
        f'max_steps = {MAX_STEPS}\noutput_dir = "runs/demo/rl"\n\n[broker]\nspool_dir = "runs/demo/rl/broker/spool"\n'
        f"\n[trainer]\nmax_steps = {MAX_STEPS}\n"
    )
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in (1, 2, 3):
            out.write(
                json.dumps({"step": step, "role": "trainer", "time": 100.0 + step, "train/loss": 1 / step}) + "\n"
            )
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "trainer.log").write_text("2026-11-27T19:52:29.8Z [info     ] fine [x]\n")
    write_run_file(run_dir, RunFile(broker_address, "tok", run_id=RUN_ID, launcher_pid=launcher_pid))
    return run_dir


def write_ended_run(run_dir: Path, exit_code: int | None, *, failure: str = "", step: int = MAX_STEPS) -> Path:
    """A run that ended with the launcher's ``exit_code`` (0 finished, 130 Ctrl-C, 1 a failed role) and its
    ``run_end.json``, written as the launcher writes it; its broker address answers nothing."""
    write_run_dir(run_dir, launcher_pid=dead_pid())
    recorder = RunEndRecorder(run_dir, io.StringIO())
    recorder.clear()
    recorder.saw(last_status(step))
    if failure:
        recorder.failed_because(failure)
    assert recorder.write(exit_code, served_policy_version=step) == run_dir / RUN_END_FILE
    return run_dir


def write_spool(run_dir: Path, *, finished: bool, step: int = MAX_STEPS, updated_unix_ms: int = 0) -> Path:
    """The broker's spool of a run whose launcher was killed: its run state (written at ``updated_unix_ms``, default
    now) and a run history with worker events of the minute before."""
    spool = run_dir / "broker" / "spool"
    end_ms = updated_unix_ms or int(time.time() * 1000)
    spool.mkdir(parents=True)
    state = {
        "format": "primerl.run_state/1",
        "run_id": RUN_ID,
        "last_committed_step": step,
        "trainer_step": step,
        "orchestrator_step": step,
        "latest_policy_version": step,
        "policy_lineage": 1,
        "last_metrics": {"train/loss": 0.5},
        "last_metrics_step": step,
        "finished": finished,
        "finished_step": step if finished else 0,
        "updated_unix_ms": end_ms,
    }
    (spool / BROKER_RUN_STATE_FILE).write_text(json.dumps(state))

    def event(before_end_ms: int, kind: str, source: str, message: str) -> dict:
        return {"unix_ms": end_ms - before_end_ms, "step": step, "kind": kind, "source": source, "message": message}

    events = [
        event(60_000, "joined", "trainer-rank0", "trainer registered from host-1"),
        event(59_000, "joined", "infer-0", "inference registered from host-1"),
        event(9_000, "error", "infer-0", "slow"),
        event(5_000, "left", "trainer-rank0", "training finished"),
        event(4_000, "lost", "infer-0", "no heartbeat for 10 s"),
    ]
    history = {
        "format": "primerl.run_history/1",
        "rows": {"next": 0, "items": []},
        "events": {"next": len(events), "items": events},
        "rollouts": {"next": 0, "items": []},
    }
    (spool / BROKER_RUN_HISTORY_FILE).write_text(json.dumps(history))
    return spool
