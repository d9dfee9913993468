"""`primerl status` against a control plane over loopback: table, JSON, watch, a subprocess, and its exit codes
when the broker is unreachable, refuses the token or the address is bad."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.control_plane import TOKEN, Broker, running_broker
from support.probes import free_port

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
