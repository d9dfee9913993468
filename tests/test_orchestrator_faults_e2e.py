"""The orchestrator's faults through the real path: the real `primerl-orchestrator` daemon, real env
workers (verifiers, their own interpreter), a real `primerl-infer` (vLLM, the tiny model) and an in-process broker.

- every rollout failing (seq_len 16, shorter than the prompts) ends the orchestrator within 60 s with one error
  line naming the cause and the fix, the cause in the broker's status;
- an env worker that dies mid-step is restarted and its groups are rolled out again;
- a broker restart mid-run is waited through, and every step's data reaches the broker (the `step sent` digests
  match what a trainer rank fetches);
- SIGTERM to a training orchestrator ends it gracefully: its pending step is flushed, exit code 0;
- the broker ending the run stops the orchestrator within 10 s, exit code 0.
"""

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
from support.daemons import InferenceDaemon
from support.inference import TOKEN, start_broker, start_daemon
from support.orchestrator import ENV_FIXTURES, ENV_PYTHON, metric_rows, orchestrator_args

from primerl.client.rollouts import RolloutConsumer
from primerl.proto import telemetry

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

ALL_FAIL_LIMIT_S = 60.0
SHUTDOWN_LIMIT_S = 10.0


@pytest.fixture(scope="module", autouse=True)
def env_python() -> None:
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")


def start_orchestrator(
    model: Path,
    broker: BrokerHarness,
    output_dir: Path,
    env: str,
    log_path: Path,
    *extra: str,
    env_table: str | None = None,
    preflight: bool = True,
) -> subprocess.Popen:
    args = orchestrator_args(model, broker, output_dir, env, "--max-async-level", "50", *extra)
    if env_table is not None:
        args[args.index("--env") + 1] = f"[{env_table}]"
    log_file = open(log_path, "a")
    try:
        skip = {} if preflight else {"PRIMERL_SKIP_PREFLIGHT": "1"}
        return subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN, "PYTHONPATH": str(ENV_FIXTURES), **skip},
        )
    finally:
        log_file.close()


def finish(process: subprocess.Popen, timeout_s: float) -> int:
    """Wait for the orchestrator we started; kill it (ours only) if it overstays."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        raise


def wait_for_line(process: subprocess.Popen, log_path: Path, pattern: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, log_path.read_text(errors="replace")):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait(10)
            pytest.fail(f"no {pattern!r} in the orchestrator's log:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)
    return time.monotonic()


def step_sent_digests(log_text: str) -> dict[int, str]:
    """{step: data_digest} of the `step sent` lines (one rank here)."""
    digests = {}
    for line in log_text.splitlines():
        if telemetry.STEP_SENT in line:
            step = int(re.search(r"\bstep=(\d+)", line).group(1))
            digests[step] = re.search(r"data_digest=(\w+)", line).group(1)
    return digests


def test_all_rollouts_failing_stop_the_orchestrator_with_the_cause(tiny_model, tmp_path):
    broker = start_broker(tmp_path / "spool")
    daemon = None
    try:
        # what `primerl rl` starts for `seq_len = 16`
        daemon = start_daemon(tmp_path, tiny_model, broker, lora=False, max_model_len=16)
        log_path = tmp_path / "orchestrator.log"
        started_s = time.monotonic()
        # past the preflight (which refuses seq_len 16 at once: prompts are 41 tokens): the run-time guard
        process = start_orchestrator(
            tiny_model,
            broker,
            tmp_path / "out",
            "reverse-text",
            log_path,
            "--seq-len",
            "16",
            "--max-steps",
            "4",
            preflight=False,
        )
        returncode = finish(process, 300)
        elapsed_s = time.monotonic() - started_s
        text = log_path.read_text(errors="replace")
        print(f"\nall rollouts failing: the orchestrator exited {returncode} after {elapsed_s:.1f} s")
        with broker.client() as client:
            status = client.get_run_status()
    finally:
        if daemon is not None:
            daemon.stop()
        broker.stop()
    assert returncode == 2, text[-4000:]  # a configuration problem: `primerl rl` does not restart it
    assert elapsed_s <= ALL_FAIL_LIMIT_S, text[-4000:]
    errors = [line for line in text.splitlines() if telemetry.ORCHESTRATOR_CANNOT_CONTINUE in line]
    assert len(errors) == 1, text[-4000:]
    assert "rollouts in a row failed" in errors[0] and "raise seq_len" in errors[0]
    assert re.search(r"maximum context length|max_model_len|maximum model length", errors[0], re.I), errors[0]
    failed_lines = [line for line in text.splitlines() if telemetry.ROLLOUT_FAILED in line]
    assert len(failed_lines) == len({re.search(r"kind=(\S+)", line).group(1) for line in failed_lines}) >= 1
    assert "Traceback" not in text
    assert any(telemetry.ROLLOUT_FAILED in error for error in status.recent_errors), list(status.recent_errors)
    assert any("orchestrator stopped" in error for error in status.recent_errors), list(status.recent_errors)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """The tiny model, the broker and a list holding the current `primerl-infer` (a test may replace it)."""
    # no trainer takes this run's batches (a test fetches a few): room for all of them, so that the orchestrator is
    # never held by the broker's bound on batches nobody was given
    broker = start_broker(tmp_path_factory.mktemp("spool"), max_queue_batches=64)
    daemons: list[InferenceDaemon] = []
    try:
        daemons.append(start_daemon(tmp_path_factory.mktemp("infer"), tiny_model, broker))
        yield tiny_model, broker, daemons
    finally:
        for daemon in daemons:
            daemon.stop()
        broker.stop()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One run, resumed by each of the tests below (the broker's spool holds its steps)."""
    return tmp_path_factory.mktemp("run")


def test_a_crashed_env_worker_is_restarted_and_its_rollouts_done_again(stack, run_dir, tmp_path):
    model, broker, _ = stack
    log_path = run_dir / "crash.log"
    marker = tmp_path / "crashed"
    process = start_orchestrator(
        model,
        broker,
        run_dir,
        "crash_once_env",
        log_path,
        "--max-steps",
        "2",
        env_table=f'{{id = "crash_once_env", args = {{marker = "{marker}"}}}}',
    )
    returncode = finish(process, 300)
    text = log_path.read_text(errors="replace")
    assert returncode == 0, text[-4000:]
    assert marker.exists()  # the worker did die once
    restarts = [line for line in text.splitlines() if telemetry.RESTARTING_ENV_WORKER in line]
    assert len(restarts) == 1 and "exit_code=3" in restarts[0] and "num_restarts=1" in restarts[0], text[-4000:]
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["rollout/rescheduled"] for r in rows) >= 4  # at least one group of 4 rollouts done again
    assert all(r["buffer/num_rollouts"] > 0 for r in rows)
    assert sorted(step_sent_digests(text)) == [1, 2]


def test_a_broker_restart_mid_run_is_waited_through(stack, run_dir):
    model, broker, _ = stack
    log_path = run_dir / "restart.log"
    process = start_orchestrator(model, broker, run_dir, "reverse-text", log_path, "--max-steps", "5")
    wait_for_line(process, log_path, rf"{telemetry.STEP_SENT} .*step=3", 300)
    broker.stop()
    time.sleep(6.0)  # long enough for the orchestrator to say it waits
    broker.restart()
    returncode = finish(process, 300)
    text = log_path.read_text(errors="replace")
    assert returncode == 0, text[-4000:]
    assert telemetry.WAITING_FOR_THE_BROKER in text and telemetry.BROKER_BACK in text, text[-4000:]
    assert [r["step"] for r in metric_rows(run_dir)][-3:] == [3, 4, 5]
    digests = step_sent_digests(text)
    assert sorted(digests) == [3, 4, 5]
    from primerl.proto.step_digest import data_digest

    with RolloutConsumer(broker.rollout_endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
        for step, digest in digests.items():  # what a trainer rank gets is what was logged as sent
            fetched = consumer.fetch_step(step, timeout_s=60)
            assert data_digest([tensors for _, tensors in fetched]) == digest


def test_a_killed_inference_server_is_waited_for(stack, run_dir, tmp_path):
    """The only inference server is SIGKILLed mid-run (its registration stays until it expires) and a new one
    starts: the rollouts refused meanwhile are counted but do not stop the run; the orchestrator waits, saying
    so, and finishes its steps on the new server."""
    model, broker, daemons = stack
    log_path = run_dir / "infer-restart.log"
    process = start_orchestrator(model, broker, run_dir, "reverse-text", log_path, "--max-steps", "9")
    wait_for_line(process, log_path, rf"{telemetry.STEP_SENT} .*step=6", 300)
    killed = daemons.pop()
    killed.kill()
    killed_s = time.monotonic()
    daemons.append(start_daemon(tmp_path, model, broker))
    print(f"\nprimerl-infer killed; a new one serves {time.monotonic() - killed_s:.1f} s later")
    returncode = finish(process, 300)
    text = log_path.read_text(errors="replace")
    assert returncode == 0, text[-4000:]
    waits = (telemetry.WAITING_FOR_AN_INFERENCE_WORKER, telemetry.NO_INFERENCE_WORKER_ALIVE)
    assert any(event in text for event in waits), text[-4000:]
    assert [r["step"] for r in metric_rows(run_dir)][-3:] == [7, 8, 9]


def test_sigterm_to_a_training_orchestrator_stops_it_gracefully(stack, run_dir):
    """SIGTERM once the orchestrator trains: the step loop ends (`stopping` with its reason), the step handed to
    the send thread is flushed (its `step sent` line, its batches at the broker, the state saved past it) and the
    process exits 0 on its own, not by the start-up path's forced exit."""
    model, broker, _ = stack
    log_path = run_dir / "sigterm.log"
    process = start_orchestrator(model, broker, run_dir, "reverse-text", log_path, "--max-steps", "1000")
    wait_for_line(process, log_path, telemetry.STEP_SENDING, 300)
    process.send_signal(signal.SIGTERM)
    returncode = finish(process, 60)
    text = log_path.read_text(errors="replace")
    assert returncode == 0, text[-4000:]
    assert "during start-up" not in text, text[-4000:]
    stopping = [line for line in text.splitlines() if re.search(rf"\b{telemetry.STOPPING}\b.*reason=", line)]
    assert len(stopping) == 1 and "stop requested (signal)" in stopping[0], text[-4000:]
    sending = {
        int(re.search(r"\bstep=(\d+)", line).group(1)) for line in text.splitlines() if telemetry.STEP_SENDING in line
    }
    digests = step_sent_digests(text)
    assert sending and sending <= set(digests), text[-4000:]  # every step handed to the send thread was sent
    state = json.loads((run_dir / "orchestrator_state.json").read_text())
    assert state["step"] == max(digests), state
    from primerl.proto.step_digest import data_digest

    with RolloutConsumer(broker.rollout_endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
        step = max(digests)
        fetched = consumer.fetch_step(step, timeout_s=60)
        assert data_digest([tensors for _, tensors in fetched]) == digests[step]


def test_the_broker_ending_the_run_stops_the_orchestrator(stack, run_dir):
    model, broker, _ = stack
    log_path = run_dir / "shutdown.log"
    process = start_orchestrator(model, broker, run_dir, "reverse-text", log_path, "--max-steps", "40")
    wait_for_line(process, log_path, telemetry.STEP_SENT, 300)
    requested_s = time.monotonic()
    broker.service.registry.request_shutdown()
    returncode = finish(process, 60)
    stop_s = time.monotonic() - requested_s
    text = log_path.read_text(errors="replace")
    print(f"\nthe orchestrator stopped {stop_s:.1f} s after the broker ended the run")
    assert returncode == 0, text[-4000:]
    assert stop_s <= SHUTDOWN_LIMIT_S, text[-4000:]
    assert "the broker asked the orchestrator to shut down" in text
