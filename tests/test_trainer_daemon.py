"""`primerl-trainer` as users run it: a real process that pulls its batches from a real broker, publishes
every step's policy to it, checkpoints, commits, resumes on the same loss curve, and serves its metrics."""

from __future__ import annotations

import socket
import subprocess
import time

import numpy as np
import pytest
from support.numerics import RL_LOSS_ATOL, machine_description
from support.probes import scrape_metrics
from support.trainer_runs import BIN, run_trainer, send_steps, trainer_args, trainer_rows

from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2


@pytest.fixture
def model_dir(small_tiny_model):
    return small_tiny_model


@pytest.fixture
def broker(make_broker):
    """``broker(steps, num_micro_batches=2, num_ranks=1)``: an in-process broker holding those steps' batches
    (``support.trainer_runs.send_steps``); stopped after the test."""

    def start(steps: range, num_micro_batches: int = 2, num_ranks: int = 1):
        harness = make_broker(max_queue_batches=64, run_id="t")
        send_steps(harness.rollout_endpoint, steps, num_micro_batches, num_ranks)
        return harness

    return start


@pytest.mark.slow
def test_trainer_trains_publishes_checkpoints_and_commits(model_dir, broker, tmp_path):
    broker = broker(range(1, 4))
    result = run_trainer(model_dir, broker.grpc_address, tmp_path / "out", "--max-steps", "3", "--ckpt.interval", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = trainer_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["ckpt/saved"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(np.isfinite(r[telemetry.TRAIN_LOSS]) and r[telemetry.TRAIN_NUM_MICRO_BATCHES] == 2 for r in rows)
    assert broker.service.weight_store.latest_version == 3  # one policy version per step, all accepted
    assert broker.service.weight_store.lineage == 1  # the lineage the broker gave it, not its clock's microseconds
    status = broker.service.registry.run_status(broker.service.data_plane_status())
    assert status.last_committed_step == 3 and status.trainer_step == 3
    assert status.last_metrics[telemetry.TRAIN_LOSS] == pytest.approx(rows[-1][telemetry.TRAIN_LOSS])
    rollouts = {q.name: q for q in status.queues}["rollouts"]
    assert rollouts.num_items == 0  # every batch released by the commits
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step_2", "step_3"]
    for step in (2, 3):  # Hugging Face weights of every checkpoint, for evals and vLLM
        assert (tmp_path / "out" / "weights" / f"step_{step}" / "STABLE").exists()


@pytest.mark.slow
def test_lora_run_publishes_adapters_the_broker_accepts(model_dir, broker, tmp_path):
    broker = broker(range(1, 3))
    result = run_trainer(
        model_dir,
        broker.grpc_address,
        tmp_path / "out",
        "--max-steps",
        "2",
        "--model.lora.rank",
        "8",
        "--model.lora.target-modules",
        '["q_proj", "v_proj"]',
    )
    assert result.returncode == 0, result.stderr[-3000:]
    latest = broker.service.weight_store.latest()
    assert latest.policy_version == 2
    assert latest.kind == 2  # WEIGHT_UPDATE_KIND_LORA


@pytest.mark.slow
def test_resume_continues_the_same_loss_curve(model_dir, make_broker, tmp_path):
    straight_broker = make_broker(tmp_path / "a" / "spool", max_queue_batches=64, run_id="t")
    send_steps(straight_broker.rollout_endpoint, range(1, 5))
    straight = run_trainer(model_dir, straight_broker.grpc_address, tmp_path / "straight", "--max-steps", "4")
    assert straight.returncode == 0, straight.stderr[-3000:]
    straight_broker.stop()
    broker = make_broker(tmp_path / "b" / "spool", max_queue_batches=64, run_id="t")
    send_steps(broker.rollout_endpoint, range(1, 5))
    first = run_trainer(
        model_dir, broker.grpc_address, tmp_path / "resumed", "--max-steps", "2", "--ckpt.interval", "2"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_trainer(
        model_dir, broker.grpc_address, tmp_path / "resumed", "--max-steps", "4", "--ckpt.interval", "2"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert broker.service.weight_store.lineage == 2  # the resumed incarnation was given the next lineage
    expected = [r[telemetry.TRAIN_LOSS] for r in trainer_rows(tmp_path / "straight")]
    resumed = [r[telemetry.TRAIN_LOSS] for r in trainer_rows(tmp_path / "resumed")]
    assert [r["step"] for r in trainer_rows(tmp_path / "resumed")] == [1, 2, 3, 4]
    # One rank, the same thread count and the same batches on the same machine: float32 CPU kernels are
    # deterministic for a given shape and thread count, so the curves are equal in fact (checkpoints hold the
    # exact float32 state); 1e-6 is ~8 eps32 of the loss terms' scale (`support.numerics.RL_LOSS_ATOL`).
    print(f"resumed - straight: {np.subtract(resumed, expected).tolist()}; {machine_description()}")
    assert resumed == pytest.approx(expected, abs=1e-6), machine_description()


@pytest.mark.slow
def test_trainer_serves_its_metrics_over_http(model_dir, broker, tmp_path):
    """Steps 1-2 are there, step 3 is not yet: the trainer waits for it while its /metrics (URL from the broker's
    worker list) shows the state after step 2; then step 3 arrives and the run finishes."""
    broker = broker(range(1, 3))
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            trainer_args(model_dir, broker.grpc_address, tmp_path / "out", "--max-steps", "3"),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 240
        samples: dict = {}
        while samples.get((telemetry.TRAINER_STEP, ())) != 2:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
            trainers = broker.service.registry.list_workers(common_pb2.ROLE_TRAINER)
            if trainers:
                url = trainers[0].capabilities["metrics_url"]
                samples = scrape_metrics(url)
        rows = trainer_rows(tmp_path / "out")
        assert [r["step"] for r in rows] == [1, 2]
        print(
            f"\n{url}\n"
            + "\n".join(
                f"{name}{dict(labels) or ''} {value:g}"
                for (name, labels), value in sorted(samples.items())
                if name.startswith("primerl_")
            )
        )
        assert samples[("primerl_step", (("role", "trainer"),))] == 2
        assert samples[(telemetry.TRAINER_LOSS, ())] == pytest.approx(rows[-1][telemetry.TRAIN_LOSS])
        assert samples[(f"{telemetry.TRAINER_LOSS_TOKENS}_total", ())] == sum(
            r[telemetry.TRAIN_NUM_LOSS_TOKENS] for r in rows
        )
        for name in (
            telemetry.TRAIN_LOSS,
            telemetry.TRAIN_LEARNING_RATE,
            telemetry.TRAIN_KL_DIVERGENCE,
            telemetry.PERF_STEP_TIME_S,
        ):
            assert samples[("primerl_metric", (("name", name), ("role", "trainer")))] == pytest.approx(rows[-1][name])
        assert f'"metrics_url": "{url}"' in log_path.read_text()  # logged at start
        send_steps(broker.rollout_endpoint, range(3, 4))
        assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        assert [r["step"] for r in trainer_rows(tmp_path / "out")] == [1, 2, 3]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_a_taken_metrics_port_is_a_clear_error(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                str(BIN / "primerl-trainer"),
                "--model.name",
                str(model_dir),
                "--output-dir",
                str(tmp_path / "out"),
                "--max-steps",
                "1",
                "--prometheus.port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 2
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_two_trainer_ranks_under_torchrun_match_one(model_dir, make_broker, tmp_path):
    """The same global batch: one rank gets it whole, two ranks get samples r, r + 2, ... each."""
    one_broker = make_broker(tmp_path / "one" / "spool", max_queue_batches=64, run_id="t")
    send_steps(one_broker.rollout_endpoint, range(1, 3), num_micro_batches=1)
    one = run_trainer(model_dir, one_broker.grpc_address, tmp_path / "one-out", "--max-steps", "2")
    assert one.returncode == 0, one.stderr[-3000:]
    one_broker.stop()
    two_broker = make_broker(tmp_path / "two" / "spool", max_queue_batches=64, run_id="t2")
    send_steps(two_broker.rollout_endpoint, range(1, 3), num_ranks=2)
    args = trainer_args(
        model_dir, two_broker.grpc_address, tmp_path / "two-out", "--optim.weight-decay", "0", "--max-steps", "2"
    )
    two = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two_broker.service.weight_store.latest_version == 2
    assert two_broker.service.weight_store.lineage == 1  # only rank 0 (the publisher) was given a lineage
    one_losses = [r[telemetry.TRAIN_LOSS] for r in trainer_rows(tmp_path / "one-out")]
    two_losses = [r[telemetry.TRAIN_LOSS] for r in trainer_rows(tmp_path / "two-out")]
    print(f"two - one rank: {np.subtract(two_losses, one_losses).tolist()}; {machine_description()}")
    assert two_losses == pytest.approx(one_losses, abs=RL_LOSS_ATOL), machine_description()


@pytest.mark.slow
def test_a_failed_checkpoint_write_stops_the_trainer_and_its_step_is_never_committed(model_dir, broker, tmp_path):
    """The IO thread's checkpoint of step 2 fails (its directory is a file): the error stops the run, typed and
    with its cause; step 2 is published but never committed; step 3 never changes the weights."""
    broker = broker(range(1, 4))
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoints should go")
    result = run_trainer(
        model_dir,
        broker.grpc_address,
        tmp_path / "out",
        "--max-steps",
        "3",
        "--ckpt.interval",
        "2",
        "--ckpt.dir",
        str(blocker),
    )
    assert result.returncode not in (0, None), result.stderr[-3000:]
    assert "TrainerIOError" in result.stderr and "checkpoint step 2" in result.stderr, result.stderr[-3000:]
    status = broker.service.registry.run_status(broker.service.data_plane_status())
    assert status.last_committed_step == 0  # exactly once: no commit without its durable checkpoint
    assert broker.service.weight_store.latest_version == 2
    assert [r["step"] for r in trainer_rows(tmp_path / "out")] == [1]  # step 2's row comes after its checkpoint
