"""How a run directory reads back (``primerl.runtime.run_outcome``): finished, stopped and failed runs from the
launcher's ``run_end.json``, a running one from its live launcher, a killed launcher's run from its broker's spool,
and a directory that says nothing; the record as the launcher writes it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
from support.run_dirs import MAX_STEPS, RUN_ID, dead_pid, write_ended_run, write_run_dir, write_spool

from primerl.proto.v1 import control_pb2
from primerl.runtime.run_files import RUN_END_FILE
from primerl.runtime.run_outcome import RunEndRecorder, launcher_alive, read_run_outcome


def test_a_finished_run_reads_back_with_its_last_step_version_workers_and_queues(tmp_path):
    run_dir = write_ended_run(tmp_path / "run", 0)
    outcome = read_run_outcome(run_dir)
    assert outcome.state == "finished" and outcome.ended and outcome.source == RUN_END_FILE
    assert (outcome.trainer_step, outcome.last_committed_step, outcome.max_steps) == (MAX_STEPS, MAX_STEPS, MAX_STEPS)
    assert outcome.policy_version == outcome.served_policy_version == MAX_STEPS and outcome.exit_code == 0
    assert outcome.run_id == RUN_ID and outcome.reason == f"the trainer finished step {MAX_STEPS}"
    summary = outcome.summary()
    assert summary.startswith(f"finished at step {MAX_STEPS} / {MAX_STEPS}, policy v{MAX_STEPS} (served v{MAX_STEPS})")
    assert summary.endswith(f"UTC: the trainer finished step {MAX_STEPS}")
    status = outcome.fill_status(control_pb2.RunStatus())
    assert [w.name for w in status.workers] == ["trainer-rank0", "infer-0"]
    assert [w.worker_id for w in status.workers] == ["", ""]  # the broker's handles are not recorded
    assert status.workers[1].policy_version == MAX_STEPS and status.workers[1].address == "http://127.0.0.1:8000"
    assert [(q.name, q.num_items) for q in status.queues] == [("rollouts", 2)]
    assert status.rollout_batches_per_s == 0.0  # an ended run does not move
    assert status.last_metrics["train/loss"] == 0.25
    record = json.loads((run_dir / RUN_END_FILE).read_text())
    assert record["format"] == "primerl.run_end/1" and record["outcome"] == "finished"
    assert "last_status" not in outcome.to_json() and outcome.to_json()["state"] == "finished"


def test_a_stopped_run_and_a_failed_one_say_why(tmp_path):
    stopped = read_run_outcome(write_ended_run(tmp_path / "stopped", 130, step=7))
    assert stopped.state == "stopped" and stopped.exit_code == 130
    assert stopped.reason == "SIGINT: every role was stopped"
    assert stopped.summary().startswith(f"stopped at step 7 / {MAX_STEPS}, policy v7")
    assert read_run_outcome(write_ended_run(tmp_path / "terminated", 143)).reason.startswith("SIGTERM")
    failure = "orchestrator exited with status 1; not restarted: it was restarted 1 times within 300 s\nmore"
    failed = read_run_outcome(write_ended_run(tmp_path / "failed", 1, failure=failure, step=3))
    assert failed.state == "failed" and failed.exit_code == 1 and failed.trainer_step == 3
    assert failed.reason == failure.splitlines()[0]
    raised = read_run_outcome(write_ended_run(tmp_path / "raised", None))
    assert raised.state == "failed" and raised.exit_code is None and raised.reason == "primerl rl raised an error"
    bare = read_run_outcome(write_ended_run(tmp_path / "bare", 2))
    assert bare.state == "failed" and bare.reason == "primerl rl exited with status 2"


def test_a_run_whose_launcher_lives_is_running(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir = write_run_dir(tmp_path / "run", launcher_pid=launcher.pid)  # written after it started
        outcome = read_run_outcome(run_dir)
        assert outcome.state == "running" and not outcome.ended and outcome.launcher_pid == launcher.pid
        assert outcome.run_id == RUN_ID and outcome.summary() == "running"
        # a pid taken by a process that started after run.json was written is not the launcher
        assert not launcher_alive(launcher.pid, time.time() - 60)
    finally:
        launcher.kill()
        launcher.wait(30)
    assert read_run_outcome(run_dir).state == "stopped"  # gone, and no record
    assert read_run_outcome(write_run_dir(tmp_path / "own", launcher_pid=os.getpid())).state == "running"


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "killed-mid-run"])
def test_a_killed_launcher_s_run_reads_from_its_broker_spool(tmp_path, finished):
    run_dir = write_run_dir(tmp_path / "run", launcher_pid=dead_pid())
    write_spool(run_dir, finished=finished, step=MAX_STEPS if finished else 12, updated_unix_ms=90_000)
    outcome = read_run_outcome(run_dir)
    assert outcome.state == ("finished" if finished else "stopped") and outcome.ended
    assert outcome.source == "the broker's run_state.json" and "left no run_end.json" in outcome.reason
    assert outcome.policy_version == outcome.trainer_step == (MAX_STEPS if finished else 12)
    assert outcome.max_steps == MAX_STEPS and outcome.ended_unix_ms == 90_000
    status = outcome.fill_status(control_pb2.RunStatus())
    workers = {w.name: (control_pb2.WorkerState.Name(w.state), w.role) for w in status.workers}
    assert workers == {
        "trainer-rank0": ("WORKER_STATE_LEFT", 2),  # ROLE_TRAINER
        "infer-0": ("WORKER_STATE_LOST", 3),  # ROLE_INFERENCE
    }
    assert status.last_metrics["train/loss"] == 0.5 and status.run_id == RUN_ID


def test_a_spool_dir_elsewhere_is_found_from_the_config(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", launcher_pid=dead_pid())
    spool = write_spool(tmp_path / "elsewhere", finished=True)
    (run_dir / "rl.toml").write_text(f'max_steps = 30\noutput_dir = "x"\n[broker]\nspool_dir = "{spool}"\n')
    assert read_run_outcome(run_dir).state == "finished"
    (run_dir / "rl.toml").unlink()  # no config: the default spool under the run directory, here none
    outcome = read_run_outcome(run_dir)
    assert outcome.state == "stopped" and outcome.trainer_step == 0 and outcome.source == "run.json"


def test_a_directory_that_says_nothing_reads_unknown(tmp_path):
    assert read_run_outcome(tmp_path).state == "unknown"
    (tmp_path / RUN_END_FILE).write_text('{"format": "primerl.run_end/9", "outcome": "finished"}')
    assert read_run_outcome(tmp_path).state == "unknown"  # a record of another format is not read
    (tmp_path / RUN_END_FILE).write_text("{not json")
    assert read_run_outcome(tmp_path).state == "unknown"
    (tmp_path / "run.json").write_text('{"broker_address": "127.0.0.1:1"}')
    assert read_run_outcome(tmp_path).state == "unknown"  # no launcher named: daemons started on their own


def test_the_recorder_writes_only_for_a_run_it_cleared_and_notes_a_refused_write(tmp_path):
    (tmp_path / RUN_END_FILE).write_text("{}")
    err = io.StringIO()
    recorder = RunEndRecorder(tmp_path, err)
    assert recorder.write(0) is None and (tmp_path / RUN_END_FILE).read_text() == "{}"  # a launch refused early
    recorder.clear()
    assert not (tmp_path / RUN_END_FILE).exists()  # a former run's record goes as a new run starts
    assert recorder.write(2) == tmp_path / RUN_END_FILE
    record = json.loads((tmp_path / RUN_END_FILE).read_text())
    assert record["outcome"] == "failed" and record["last_status"] is None and record["run_id"] == ""
    assert record["launcher_pid"] == os.getpid() and [p.name for p in tmp_path.iterdir()] == [RUN_END_FILE]
    gone = RunEndRecorder(tmp_path / "no-such-dir", err)
    gone.clear()
    assert gone.write(0) is None and "cannot write" in err.getvalue()
