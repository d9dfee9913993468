"""The trained model is always saved, with or without `[trainer.ckpt]`: the last step's Hugging Face weights are
exported (on a clean stop, the last step trained), and without checkpoints every step is committed as it is trained,
so the broker's spool is released; a restarted trainer that cannot resume refuses with one line. `model.parallel`
defaults to what works for the ranks given."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w
from support.probes import free_port
from support.trainer_runs import BIN, run_trainer, send_steps, trainer_args, trainer_rows

from primerl.proto import telemetry
from primerl.trainer.distributed import resolve_parallel

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))


@pytest.fixture
def model_dir(small_tiny_model):
    return small_tiny_model


@pytest.fixture
def broker(make_broker):
    """An in-process broker (``run_id`` "t", room for 64 batches); stopped after the test."""
    return make_broker(max_queue_batches=64, run_id="t")


def test_parallel_defaults_to_what_works_for_the_ranks_given():
    assert resolve_parallel(None, 1) == "ddp" and resolve_parallel(None, 4) == "ddp"
    assert resolve_parallel("fsdp2", 1) == "fsdp2" and resolve_parallel("ddp", 2) == "ddp"
    with pytest.raises(ValueError, match='model.parallel = "fsdp2" with 2 ranks: .* set model.parallel = "ddp"'):
        resolve_parallel("fsdp2", 2)


@pytest.mark.slow
def test_without_ckpt_steps_are_committed_as_trained_and_the_last_step_is_exported(model_dir, broker, tmp_path):
    send_steps(broker.rollout_endpoint, range(1, 4))
    result = run_trainer(model_dir, broker.grpc_address, tmp_path / "out", "--max-steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    status = broker.service.registry.run_status(broker.service.data_plane_status())
    assert status.last_committed_step == 3
    assert {q.name: q for q in status.queues}["rollouts"].num_items == 0  # the spool is released
    assert not list((tmp_path / "spool").glob("*.rbatch"))
    assert sorted(p.name for p in (tmp_path / "out" / "weights").iterdir()) == ["step_3"]
    assert (tmp_path / "out" / "weights" / "step_3" / "STABLE").exists()
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert [r["step"] for r in trainer_rows(tmp_path / "out")] == [1, 2, 3]
    assert trainer_rows(tmp_path / "out")[-1]["perf/export_s"] > 0

    # A restart without checkpoints cannot resume: steps 1-3 are committed and their batches are gone.
    send_steps(broker.rollout_endpoint, range(4, 5))
    again = run_trainer(model_dir, broker.grpc_address, tmp_path / "out", "--max-steps", "4")
    assert again.returncode == 2, again.stderr[-3000:]
    assert (
        "the broker has committed steps 1-3 of this run and this trainer would start again at step 1: "
        "without [trainer.ckpt] there is no checkpoint to resume from" in again.stderr
    ), again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert [w.name for w in broker.service.registry.list_workers(include_gone=True)] == ["trainer-rank0"]


@pytest.mark.slow
def test_a_clean_stop_exports_the_last_step_trained(model_dir, broker, tmp_path):
    """Data for 2 of 5 steps; SIGTERM while the trainer waits for step 3: exit 0 with weights/step_2, not step_5."""
    send_steps(broker.rollout_endpoint, range(1, 3))
    args = trainer_args(model_dir, broker.grpc_address, tmp_path / "out", "--max-steps", "5")
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while broker.service.registry.last_committed_step < 2:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert sorted(p.name for p in (tmp_path / "out" / "weights").iterdir()) == ["step_2"]
    assert (tmp_path / "out" / "weights" / "step_2" / "config.json").is_file()
    assert "exporting the weights of the last step trained" in log_path.read_text()


@pytest.mark.slow
def test_fsdp2_with_two_trainer_ranks_is_refused_before_anything_loads(model_dir, tmp_path):
    """No broker at all: the refusal comes first, from each rank, with one line and exit 2."""
    result = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node=2",
            str(BIN / "primerl-trainer"),
            "--model.name",
            str(model_dir),
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "2",
            "--model.parallel",
            "fsdp2",
            "--broker.address",
            "127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "exitcode: 2" in output, output[-3000:]
    assert "trainer cannot continue" in output and 'model.parallel = "fsdp2" with 2 ranks' in output
    assert "Loading weights" not in output


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_without_ckpt_saves_the_model_and_releases_the_spool(tiny_model, tmp_path):
    """`primerl rl` on the example without its [trainer.ckpt] table: `primerl eval -m RUN_DIR` finds the trained
    model, and the broker's spool ends (nearly) empty (before: 136 batch files after 8 steps, growing)."""
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    from primerl.cli.eval import resolve_model

    model = tiny_model
    config = tomllib.loads(EXAMPLE.read_text())
    del config["trainer"]["ckpt"]
    config_path = tmp_path / "rl-no-ckpt.toml"
    config_path.write_text(tomli_w.dumps(config))
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": ENV_PYTHON,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PRIMERL_RUN_TOKEN", None)
    result = subprocess.run(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(config_path),
            "--model.name",
            str(model),
            "--output-dir",
            str(run_dir),
            "--broker.grpc-port",
            str(free_port()),
            "--max-steps",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert resolve_model(str(run_dir), served=False) == str(run_dir / "weights" / "step_4")
    assert (run_dir / "weights" / "step_4" / "config.json").is_file()
    spool = run_dir / "broker" / "spool"
    assert (spool / "COMMITTED").read_text().strip() == "4"
    left = sorted(spool.glob("*.rbatch"))
    # At most what the orchestrator made for steps after the last (max_async_level = 1 ahead): a step is ~17 files.
    assert len(left) <= 40, f"{len(left)} batch files left in {spool}"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count(telemetry.STEP_COMMITTED) == 4, trainer_log[-3000:]
    print(f"spool after 4 steps without [trainer.ckpt]: {len(left)} batch files")
