"""`primerl-trainer` rides through a restart of the broker, and a resumed trainer records its resumed step once.

Real processes and sockets: a real trainer process, a real broker (stopped and started again on the same
ports and spool directory, as systemd restarts it), real rollout batches."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from support.trainer_runs import log_events, packed, samples, send_steps, trainer_args, trainer_rows

from primerl.proto import telemetry
from primerl.proto.step_digest import data_digest


@pytest.fixture
def model_dir(small_tiny_model):
    return small_tiny_model


@pytest.fixture
def broker(make_broker):
    """A broker that is stopped and started again on the same ports and spool directory (``restart``)."""
    return make_broker(max_queue_batches=64, run_id="ride-through", heartbeat_interval_s=0.5)


def step_tensors(step: int):
    """The one micro-batch ``send_steps(..., num_micro_batches=1)`` sends for ``step``."""
    return packed(samples(step))


def wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert process.poll() is None, (
            f"trainer exited ({process.returncode}) before {what}:\n" + log_path.read_text()[-3000:]
        )
        assert time.monotonic() < deadline_s, f"no {what} within {timeout_s} s:\n" + log_path.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_the_trainer_rides_through_a_broker_restart(model_dir, broker, tmp_path):
    """Step 1 trains; the broker goes down while the trainer waits for step 2 (it says so, and waits); the broker
    comes back on the same ports and spool, gets steps 2-3, and the run ends normally: every step trained once,
    on the data sent for it, checkpoints committed to the restarted broker."""
    out = tmp_path / "out"
    log_path = tmp_path / "trainer.log"
    send_steps(broker.rollout_endpoint, range(1, 2), num_micro_batches=1)
    args = trainer_args(
        model_dir, broker.grpc_address, out, "--max-steps", "3", "--ckpt.interval", "1", "--broker.outage-s", "60"
    )
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: [r["step"] for r in trainer_rows(out)] == [1], 240, "step 1", process, log_path)
        broker.stop()
        down_s = time.monotonic()
        wait_for(
            lambda: any(
                e.get("broker") == "unreachable"
                for e in log_events(log_path.read_text(), "waiting for the step's micro-batches")
            ),
            60,
            "a log line saying the trainer waits for an unreachable broker",
            process,
            log_path,
        )
        broker.restart()  # stopped already: starts it again on the same ports and spool
        print(f"\nbroker down {time.monotonic() - down_s:.1f} s")
        send_steps(broker.rollout_endpoint, range(2, 4), num_micro_batches=1)
        assert process.wait(timeout=180) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    text = log_path.read_text()
    assert [r["step"] for r in trainer_rows(out)] == [1, 2, 3]
    done = log_events(text, telemetry.STEP_DONE)
    assert [e["step"] for e in done] == [1, 2, 3]
    assert [e["data_digest"] for e in done] == [data_digest([step_tensors(step)]) for step in (1, 2, 3)]
    assert any(e.get("waiting_for") == "heartbeats" for e in log_events(text, telemetry.WAITING_FOR_THE_BROKER))
    committed = [e["step"] for e in log_events(text, "checkpoint committed")]
    assert committed == [1, 2, 3], committed


@pytest.mark.slow
def test_a_resumed_trainer_commits_its_step_and_writes_a_missing_record_once(model_dir, broker, tmp_path):
    """A trainer killed between its checkpoint and its commit left no metrics row and no "step done" line for
    that step (simulated here by removing them): restarted, it commits the step and writes both from the
    checkpoint; restarted once more, it writes nothing twice."""
    out = tmp_path / "out"
    send_steps(broker.rollout_endpoint, range(1, 3), num_micro_batches=1)
    args = trainer_args(model_dir, broker.grpc_address, out, "--max-steps", "2", "--ckpt.interval", "1")
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    original = trainer_rows(out)[-1]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if not (json.loads(line)["role"] == "trainer" and json.loads(line)["step"] == 2)]
    (out / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    for attempt in range(2):
        again = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        rows = trainer_rows(out)
        assert [r["step"] for r in rows] == [1, 2], rows
        assert rows[-1][telemetry.TRAIN_LOSS] == original[telemetry.TRAIN_LOSS]
        done = log_events(again.stdout + again.stderr, telemetry.STEP_DONE)
        assert len(done) == (1 if attempt == 0 else 0), done
        if done:
            assert done[0]["step"] == 2 and done[0]["from_checkpoint"] is True
            assert done[0]["data_digest"] == data_digest([step_tensors(2)])
        assert [e["step"] for e in log_events(again.stdout + again.stderr, "checkpoint committed")] == [2]
    assert broker.service.registry.last_committed_step == 2
