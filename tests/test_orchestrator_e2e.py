"""`primerl-orchestrator` end to end: a real env worker (verifiers, its own interpreter) rolls out against a real
`primerl-infer` daemon (vLLM), and the batches that reach the broker are what a trainer needs: tokens, masks and
inference logprobs aligned (a transformers forward pass on the same tokens gives the same logprobs)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.broker import BrokerHarness
from support.daemons import BIN
from support.inference import TOKEN, start_broker, start_daemon
from support.orchestrator import ENV_PYTHON, eval_rows, metric_rows, orchestrator_args
from support.probes import scrape_metrics as scrape

from primerl.client.rollouts import RolloutConsumer
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    model = tiny_model
    broker = start_broker(tmp_path_factory.mktemp("spool"))
    daemon = None
    try:
        daemon = start_daemon(tmp_path_factory.mktemp("infer"), model, broker)
        yield model, broker, daemon
    finally:
        if daemon is not None:
            daemon.stop()
        broker.stop()


def run_orchestrator(
    model: Path, broker: BrokerHarness, output_dir: Path, env_id: str, *extra: str, pythonpath: str | None = None
) -> subprocess.CompletedProcess:
    args = orchestrator_args(model, broker, output_dir, env_id, *extra)
    env = {**os.environ, "PRIMERL_RUN_TOKEN": TOKEN}
    if pythonpath:  # inherited by the env workers: environments outside the installed packages
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


def check_batches(model: Path, broker: BrokerHarness, steps: range) -> None:
    from transformers import AutoModelForCausalLM

    from primerl.trainer.batch import MicroBatch, packed_token_logprobs

    reference = AutoModelForCausalLM.from_pretrained(model).eval()
    endpoint = f"tcp://127.0.0.1:{broker.endpoints.rollout_port}"
    with RolloutConsumer(endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
        for step in steps:
            batches = consumer.fetch_step(step, timeout_s=60)
            assert batches, f"no micro-batches for step {step}"
            for header, tensors in batches:
                batch = MicroBatch.from_tensors(tensors)
                assert batch.num_loss_tokens > 0
                assert header.num_loss_tokens_global >= batch.num_loss_tokens
                logprobs, _ = packed_token_logprobs(reference, batch, with_entropy=False)
                mask = batch.loss_mask
                served = batch.inference_logprobs[mask]
                assert bool((served <= 0).all()) and bool((served > -30).all())
                assert float((logprobs.detach()[mask] - served).abs().max()) <= 1e-3
                assert bool((batch.inference_logprobs[~mask] == 0).all())
                assert bool((batch.policy_versions == 0).all())  # no update was published


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("orchestrator")


def test_single_turn_rollouts_reach_the_broker_aligned(stack, output_dir):
    model, broker, _ = stack
    result = run_orchestrator(
        model,
        broker,
        output_dir,
        "reverse-text",
        "--eval",
        '{interval = 2, num_examples = 4, env = [{id = "reverse-text"}]}',
    )
    assert result.returncode == 0, result.stderr[-4000:]
    evals = eval_rows(output_dir)
    assert [e["step"] for e in evals] == [2]  # eval every 2 steps, logged apart from training
    assert evals[0]["eval/reverse-text/num_rollouts"] == 4 and 0 <= evals[0]["eval/reverse-text/reward"] <= 1
    rows = metric_rows(output_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row[telemetry.TRAIN_REWARD] <= 1.0 and row[telemetry.ROLLOUT_MEAN_LENGTH] > 0
        assert row[telemetry.ROLLOUT_GENERATION_TIME] > 0
    check_batches(model, broker, range(1, 3))
    state = json.loads((output_dir / "orchestrator_state.json").read_text())
    assert state["step"] == 2


def test_multi_turn_rollouts_reach_the_broker_aligned(stack, output_dir):
    """The same run resumed (its state in output_dir) with a multi-turn environment: steps 3 and 4. Nothing is
    published in these tests, so the async bound is lifted to let steps 3-4 use the base policy."""
    model, broker, _ = stack
    result = run_orchestrator(
        model,
        broker,
        output_dir,
        "reverse-text-multiturn",
        "--max-steps",
        "4",
        "--max-async-level",
        "8",
        "--trajectory-strategy",
        "interleaved",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metric_rows(output_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    check_batches(model, broker, range(3, 5))


def test_a_refused_batch_is_a_clear_error(stack, tmp_path):
    """A new run pointed at a broker whose spool holds another run's step 1, packed differently (one sample per
    micro-batch here), is refused by the broker; the orchestrator stops with an explanation, not a traceback."""
    model, broker, _ = stack
    result = run_orchestrator(
        model, broker, tmp_path / "fresh", "reverse-text", "--max-steps", "1", "--batch-size", "4", "--seq-len", "80"
    )
    assert result.returncode == 2
    assert "refused the batches of step 1" in result.stderr and "Traceback" not in result.stderr


def test_failing_environment_rollouts_are_counted_not_fatal(stack, output_dir):
    """The run resumed once more (steps 5-6) with an environment whose scoring raises for some rollouts: those
    are counted and reported as errors, the others are trained on, and the orchestrator finishes its steps."""
    model, broker, _ = stack
    result = run_orchestrator(
        model,
        broker,
        output_dir,
        "sometimes_broken_env",
        "--max-steps",
        "6",
        "--max-async-level",
        "8",
        pythonpath=str(Path(__file__).parent / "env_fixtures"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metric_rows(output_dir)
    assert [r["step"] for r in rows][-2:] == [5, 6]
    assert sum(r[telemetry.ROLLOUT_ERRORS] for r in rows[-2:]) > 0
    assert all(r["buffer/num_rollouts"] > 0 for r in rows[-2:])
    check_batches(model, broker, range(5, 7))


def test_metrics_over_http_and_wandb_offline_while_waiting_for_the_trainer(stack, output_dir):
    """The run resumed once more (the environment whose scoring fails for some rollouts): step 7 may use policy
    v0 (max_async_level 6), step 8 may not, and nothing is published, so the orchestrator waits at step 8.
    Meanwhile its /metrics (URL from the broker's worker list) shows step 7's row and live gauges; SIGTERM then
    stops it and finishes its offline W&B run."""
    model, broker, _ = stack
    args = orchestrator_args(
        model,
        broker,
        output_dir,
        "sometimes_broken_env",
        "--max-steps",
        "8",
        "--max-async-level",
        "6",
        "--wandb.project",
        "primerl-e2e",
        "--wandb.name",
        "orch",
        "--wandb.offline",
    )
    log_path = output_dir / "waiting.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN, "PYTHONPATH": str(Path(__file__).parent / "env_fixtures")},
        )
    try:
        deadline = time.monotonic() + 300
        samples: dict = {}
        while (
            samples.get(("primerl_step", (("role", "orchestrator"),))) != 7
            or samples.get((telemetry.ORCHESTRATOR_INFLIGHT_ROLLOUTS, ())) != 0
        ):  # step 8's stale groups cancelled
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
            with broker.client() as client:
                workers = client.list_workers(role=common_pb2.ROLE_ORCHESTRATOR)
            if workers:
                url = workers[0].capabilities["metrics_url"]
                samples = scrape(url)
        row = metric_rows(output_dir)[-1]
        assert row["step"] == 7
        print(
            f"\n{url}\n"
            + "\n".join(
                f"{name}{dict(labels) or ''} {value:g}"
                for (name, labels), value in sorted(samples.items())
                if name.startswith("primerl_")
            )
        )
        assert samples[(telemetry.ORCHESTRATOR_STEP_GAUGE, ())] == 7
        for name in (
            telemetry.TRAIN_REWARD,
            telemetry.ROLLOUT_MEAN_LENGTH,
            telemetry.ROLLOUT_GENERATION_TIME,
            telemetry.ROLLOUT_ERRORS,
        ):
            assert samples[("primerl_metric", (("name", name), ("role", "orchestrator")))] == pytest.approx(row[name])
        # every failure so far: step 7's, and those of groups that finished while waiting at step 8
        assert samples[(f"{telemetry.ORCHESTRATOR_ROLLOUT_ERRORS}_total", ())] >= row[telemetry.ROLLOUT_ERRORS] > 0
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert process.returncode == 0, log_path.read_text()[-4000:]
    assert "wandb:" not in log_path.read_text()  # W&B wrote nothing into the daemon's log
    # The daemon froze what its start-up left alive (PRIMERL_ORCHESTRATOR_GC_FREEZE unset: on).
    frozen = re.search(r"start-up heap frozen\s.*num_objects=(\d+)", log_path.read_text())
    assert frozen and int(frozen[1]) > 10_000, log_path.read_text()[-4000:]

    run_dirs = list((output_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    inspect = subprocess.run(
        [str(BIN / "wandb"), "leet", "inspect", "--json", str(run_dirs[0])], capture_output=True, text=True, timeout=120
    )
    assert inspect.returncode == 0, inspect.stderr
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.strip()]
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == "orch-orchestrator" and run["run_group"] == "orch" and run["project"] == "primerl-e2e"
    assert TOKEN not in inspect.stdout
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h[telemetry.ORCHESTRATOR_STEP] for h in history] == [7]
    assert history[0][telemetry.TRAIN_REWARD] == pytest.approx(row[telemetry.TRAIN_REWARD])
    assert history[0][telemetry.ROLLOUT_MEAN_LENGTH] == pytest.approx(row[telemetry.ROLLOUT_MEAN_LENGTH])
