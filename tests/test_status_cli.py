"""`primerl status` against a control plane over loopback: table, JSON, watch, a subprocess, and its exit codes
when the broker is unreachable, refuses the token or the address is bad; a `primerl rl` run that ended, from its
run directory (finished, stopped, failed), and one still running whose broker does not answer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.control_plane import TOKEN, Broker, running_broker
from support.probes import free_port
from support.run_dirs import MAX_STEPS, RUN_ID, write_ended_run, write_run_dir

from primerl.cli import status as status_cli
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.log_setup import configure_logging

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _logging_to_stderr():
    """Broker and client log lines go to stderr, so that `primerl status --json` output stays parseable."""
    configure_logging("test", level="info")


# ------------------------------------------------------------------------------------------ primerl status
@pytest.fixture
def auth_broker():
    with running_broker(run_token=TOKEN) as broker:
        yield broker


@pytest.fixture
def calm_broker():
    """Workers registered by `_populate` never heartbeat: a long interval keeps them alive during a test."""
    with running_broker(interval_s=30.0) as broker:
        yield broker


def _populate(broker: Broker) -> None:
    registry = broker.registry
    trainer = registry.register(
        control_pb2.RegisterRequest(
            role=common_pb2.ROLE_TRAINER,
            name="trainer-0",
            capabilities={"metrics_url": "http://127.0.0.1:9311/metrics"},
        )
    ).worker_id
    infer = registry.register(
        control_pb2.RegisterRequest(role=common_pb2.ROLE_INFERENCE, name="infer-0", address="http://127.0.0.1:8000")
    ).worker_id
    registry.heartbeat(control_pb2.HeartbeatRequest(worker_id=trainer, trainer_step=3))
    registry.policy.hello(infer, 2, 0)  # the weight fan-out hears infer-0 say it holds v2
    registry.report_metrics(trainer, 3, {telemetry.TRAIN_LOSS: 0.25})
    registry.record_error("rollout-plane", "bad digest from trainer-0")


def test_status_cli_table_and_json(calm_broker, capsys):
    _populate(calm_broker)
    assert status_cli.main(["--broker", calm_broker.address]) == 0
    table = capsys.readouterr().out
    for text in (
        "run test-run",
        "trainer step 3 (committed 0) / 20",
        "policy version 2",
        "rollouts",
        "trainer-0",
        "infer-0",
        "http://127.0.0.1:8000",
        "policy v2",
        "alive",
        telemetry.TRAIN_LOSS,
        "rollout-plane: bad digest",
        "METRICS",
        "http://127.0.0.1:9311/metrics",
    ):
        assert text in table, f"{text!r} missing from:\n{table}"

    assert status_cli.main(["--broker", calm_broker.address, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run_id"] == "test-run" and int(data["trainer_step"]) == 3
    assert {w["name"] for w in data["workers"]} == {"trainer-0", "infer-0"}
    assert data["run_state"] == "running" and data["run_end"] is None


def test_status_cli_watch_json_lines(calm_broker, capsys):
    _populate(calm_broker)
    # Ctrl-C arrives as KeyboardInterrupt from the stream; simulate it after the first update.
    original = status_cli._show
    shown: list[int] = []

    def show_then_interrupt(*args, **kwargs):
        original(*args, **kwargs)
        shown.append(1)
        raise KeyboardInterrupt

    status_cli._show = show_then_interrupt
    try:
        assert status_cli.main(["--broker", calm_broker.address, "--json", "--watch"]) == 0
    finally:
        status_cli._show = original
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["run_id"] == "test-run"


def test_status_subprocess_json(calm_broker):
    _populate(calm_broker)
    result = subprocess.run(
        [sys.executable, "-m", "primerl", "status", "--broker", calm_broker.address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["run_id"] == "test-run"


def test_status_unreachable_broker_exits_1_with_a_message(capsys):
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert status_cli.main(["--broker", address, "--timeout-s", "0.5"]) == 1
    assert time.monotonic() - started < 5
    captured = capsys.readouterr()
    assert f"cannot reach the broker at {address}" in captured.err and "Traceback" not in captured.err


def test_status_wrong_token_exits_1_with_a_hint(auth_broker, capsys, monkeypatch):
    monkeypatch.delenv("PRIMERL_RUN_TOKEN", raising=False)
    assert status_cli.main(["--broker", auth_broker.address]) == 1
    assert "--token" in capsys.readouterr().err
    monkeypatch.setenv("PRIMERL_RUN_TOKEN", TOKEN)
    assert status_cli.main(["--broker", auth_broker.address, "--json"]) == 0


def test_status_bad_address_exits_2(capsys):
    assert status_cli.main(["--broker", "no-port"]) == 2
    assert "host:port" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ a run that ended
def test_a_finished_run_dir_shows_its_final_state_without_a_broker(tmp_path, capsys):
    run_dir = write_ended_run(tmp_path / "run", 0)
    started = time.monotonic()
    assert status_cli.main([str(run_dir)]) == 0
    assert time.monotonic() - started < 5  # its dead broker is not waited for
    captured = capsys.readouterr()
    table = captured.out
    for text in (
        f"run {RUN_ID}    finished at step {MAX_STEPS} / {MAX_STEPS}, policy v{MAX_STEPS} (served v{MAX_STEPS})",
        f"the trainer finished step {MAX_STEPS}",
        f"trainer step {MAX_STEPS} (committed {MAX_STEPS}) / {MAX_STEPS}",
        "run finished",
        "ended (read from run_end.json); workers and queues as last seen before the end",
        "trainer-rank0",
        "infer-0",
        f"policy v{MAX_STEPS}",
        "rollouts (spooled until committed)",
        "train/loss",
    ):
        assert text in table, f"{text!r} missing from:\n{table}"
    assert "cannot reach" not in captured.err and "advice" not in table

    assert status_cli.main([str(run_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run_state"] == "finished" and data["run_end"]["state"] == "finished"
    assert data["run_end"]["exit_code"] == 0 and data["run_end"]["source"] == "run_end.json"
    assert data["run_id"] == RUN_ID and int(data["trainer_step"]) == MAX_STEPS
    assert int(data["latest_policy_version"]) == MAX_STEPS and data["rollout_batches_per_s"] == 0
    assert [w["name"] for w in data["workers"]] == ["trainer-rank0", "infer-0"]
    for key in ("broker_started_unix_ms", "queues", "last_metrics", "recent_errors", "max_steps", "num_rollbacks"):
        assert key in data  # every key of a live status is there

    assert status_cli.main([str(run_dir), "--watch"]) == 0  # nothing will change: shown once
    assert "finished at step" in capsys.readouterr().out


def test_stopped_and_failed_run_dirs_say_so(tmp_path, capsys):
    assert status_cli.main([str(write_ended_run(tmp_path / "stopped", 130, step=7))]) == 0
    assert f"stopped at step 7 / {MAX_STEPS}, policy v7" in capsys.readouterr().out
    failed = write_ended_run(tmp_path / "failed", 1, failure="orchestrator exited with status 1; stopped the run")
    assert status_cli.main([str(failed), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run_state"] == "failed" and data["run_end"]["reason"].startswith("orchestrator exited with status 1")


def test_a_running_run_whose_broker_does_not_answer_exits_1_saying_it_runs(tmp_path, capsys):
    import os

    run_dir = write_run_dir(tmp_path / "run", launcher_pid=os.getpid(), broker_address=f"127.0.0.1:{free_port()}")
    assert status_cli.main([str(run_dir), "--timeout-s", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the broker" in err and f"is still running: its launcher, pid {os.getpid()}" in err


def test_status_subprocess_json_of_a_finished_run(tmp_path):
    run_dir = write_ended_run(tmp_path / "run", 0)
    result = subprocess.run(
        [sys.executable, "-m", "primerl", "status", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["run_state"] == "finished" and int(data["latest_policy_version"]) == MAX_STEPS
