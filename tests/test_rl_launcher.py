"""`primerl rl` end to end: the launcher starts broker, inference (vLLM), orchestrator and trainer from
`examples/reverse_text_rl.toml` on the tiny model, trains a few steps, and stops every role; a role that crashes
stops the run with its log lines shown and no process left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.probes import free_port
from support.proc_tree import descendants, running

from primerl.proto import telemetry
from primerl.runtime.config_base import ConfigWarning
from primerl.runtime.run_outcome import read_run_outcome
from primerl.supervisor.launcher import Launcher, LaunchOptions
from primerl.supervisor.role_configs import without_token
from primerl.supervisor.run_progress import Progress

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
ROLES = ("broker", "inference", "orchestrator", "trainer")
RUN_TIMEOUT_S = 600
CRASH_TIMEOUT_S = 300


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def tiny_model(tiny_model):
    """conftest's tiny model, where the env workers' interpreter is set up."""
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    return tiny_model


def primerl_rl(model: Path, run_dir: Path, *extra: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": ENV_PYTHON,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PRIMERL_RUN_TOKEN", None)
    args = [
        str(BIN / "primerl"),
        "rl",
        "@",
        str(EXAMPLE),
        "--model.name",
        str(model),
        "--output-dir",
        str(run_dir),
        "--broker.grpc-port",
        str(free_port()),
        *extra,
    ]
    started_s = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=run_dir.parent)
    return result, time.monotonic() - started_s


def assert_no_child_left(run_dir: Path) -> None:
    pids = json.loads((run_dir / "pids.json").read_text())
    assert sorted(pids) == sorted(ROLES)
    left = {role: pid for role, pid in pids.items() if not group_gone(pid)}
    assert not left, f"process groups still alive after primerl rl exited: {left}"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_short_run_trains_every_step_and_inference_serves_the_last_policy(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # An eval at the last step that outlasts the trainer's last step (the orchestrator runs it after sending that
    # step): it must not be cut by the end of the run (the launcher and the broker wait for the orchestrator).
    final_eval = '{interval = 3, num_examples = 200, rollouts_per_example = 8, env = [{id = "reverse-text"}]}'
    result, wall_s = primerl_rl(
        tiny_model, run_dir, "--max-steps", "3", "--orchestrator.eval", final_eval, timeout_s=RUN_TIMEOUT_S
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "run finished: 3 steps" in result.stdout, output[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["role"] == "trainer"] == [1, 2, 3]
    [final] = [r for r in rows if r["role"] == "orchestrator" and "eval/reverse-text/num_rollouts" in r]
    assert final["step"] == 3 and final["eval/reverse-text/num_rollouts"] == 1600, final
    assert final["eval/reverse-text/errors"] == 0, final
    assert [r["step"] for r in rows if r["role"] == "orchestrator"][:2] == [1, 2]
    # The async bound held: no batch trained on samples more than max_async_level (1) versions old.
    lags = [r[telemetry.ASYNC_OFF_POLICY_LAG_MAX] for r in rows if telemetry.ASYNC_OFF_POLICY_LAG_MAX in r]
    assert lags and max(lags) <= 1, lags
    # The run's curves, from the run directory as a user would draw them.
    plot = subprocess.run([str(BIN / "primerl"), "plot", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert all((run_dir / "plots" / f"{name}.png").stat().st_size > 0 for name in ("reward", "loss", "summary"))
    for role in ("broker", "trainer-rank0", "orchestrator"):  # every role's Prometheus URL was printed
        assert f"{role} metrics at http://127.0.0.1:" in result.stdout, output[-6000:]
    # The version inference served at the end, read from the broker before it was stopped.
    assert "policy version served by inference: 3 (trainer published 3)" in result.stdout, output[-6000:]
    # The run directory reads back as finished (run_end.json), with its last step, version and workers.
    outcome = read_run_outcome(run_dir)
    assert outcome.state == "finished" and outcome.exit_code == 0, outcome
    assert outcome.trainer_step == 3 and outcome.policy_version == outcome.served_policy_version == 3, outcome
    assert {"trainer", "inference"} <= {w.get("role", "")[5:].lower() for w in outcome.last_status["workers"]}
    for role in ROLES:
        assert (run_dir / "logs" / f"{role}.log").stat().st_size > 0
        assert (run_dir / f"{role}.toml").exists()
    assert "run_token" not in "".join(p.read_text() for p in run_dir.glob("*.toml"))  # only in the environment
    assert_no_child_left(run_dir)
    print(f"3-step run: {wall_s:.1f} s wall\n{result.stdout}")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_crashing_role_is_restarted_then_stops_the_run_and_shows_its_error(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # --no-preflight: the preflight would refuse the environment's bad argument before anything starts; this is about
    # a role that fails once started, with an error a restart might not hit again (exit 1: an environment that is
    # not installed at all is a configuration error, exit 2, never restarted: the test below).
    result, wall_s = primerl_rl(
        tiny_model,
        run_dir,
        "--max-steps",
        "3",
        "--orchestrator.env",
        '[{id = "reverse-text", args = {num_examples = 0}}]',
        "--no-preflight",
        "--stop-timeout-s",
        "10",
        "--restart-limit",
        "1",
        "--restart-delay-s",
        "0.5",
        timeout_s=CRASH_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-6000:]
    assert "restarting orchestrator after exit code 1 (restart 1 of 1 within 300 s) in 0.5 s" in result.stdout, output[
        -6000:
    ]
    assert re.search(
        r"orchestrator exited with status 1( while inference was starting)?; not restarted: it was "
        r"restarted 1 times within 300 s",
        result.stderr,
    ), output[-6000:]
    # the orchestrator's log lines
    assert "last 30 lines of" in result.stderr and "num_examples must be >= 1" in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "orchestrator's last error:" in line]
    assert error_lines and "num_examples must be >= 1" in error_lines[-1], output[-6000:]
    assert json.loads((run_dir / "pids.json").read_text())["orchestrator"] != 0
    outcome = read_run_outcome(run_dir)
    assert outcome.state == "failed" and outcome.reason.startswith("orchestrator exited with status 1"), outcome
    assert_no_child_left(run_dir)
    print(f"crash run: {wall_s:.1f} s wall\n{error_lines[-1]}")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_config_error_with_restart_never_stops_the_run_at_once(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    result, _ = primerl_rl(
        tiny_model,
        run_dir,
        "--max-steps",
        "3",
        "--orchestrator.env",
        '[{id = "no-such-env"}]',
        "--no-preflight",
        "--stop-timeout-s",
        "10",
        "--restart",
        "never",
        timeout_s=CRASH_TIMEOUT_S,
    )
    assert result.returncode == 1, (result.stdout + result.stderr)[-6000:]
    assert "restarting" not in result.stdout
    # an environment installed in neither env interpreter: a configuration error (exit 2), named with both
    assert re.search(
        r"orchestrator exited with status 2( while inference was starting)?; stopped the run", result.stderr
    ), result.stderr[-6000:]
    assert "is not an installed environment" in result.stderr, result.stderr[-6000:]
    assert_no_child_left(run_dir)


@pytest.mark.slow
@pytest.mark.vllm
def test_ctrl_c_mid_run_stops_every_role_without_killing_any(tiny_model, tmp_path):
    import signal

    run_dir = tmp_path / "run"
    env = {**os.environ, "PRIMERL_ENV_PYTHON": ENV_PYTHON, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PRIMERL_RUN_TOKEN", None)
    process = subprocess.Popen(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(EXAMPLE),
            "--model.name",
            str(tiny_model),
            "--output-dir",
            str(run_dir),
            "--broker.grpc-port",
            str(free_port()),
            "--max-steps",
            "200",
            "--stop-timeout-s",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=run_dir.parent,
    )
    try:
        deadline = time.monotonic() + CRASH_TIMEOUT_S
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"role": "trainer"' in metrics.read_text()):  # mid-run: a step trained
            assert process.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 1"
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        sent_s = time.monotonic()
        stdout, stderr = process.communicate(timeout=120)
        stop_s = time.monotonic() - sent_s
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGINT, stderr[-4000:]
    assert "SIGINT: stopping every role" in stderr and "primerl rl: stopped" in stderr
    assert "did not stop within" not in stderr, stderr[-4000:]  # every role stopped on SIGTERM, none killed
    assert read_run_outcome(run_dir).state == "stopped"
    assert_no_child_left(run_dir)
    print(f"Ctrl-C to all stopped: {stop_s:.1f} s")


# ---------------------------------------------------------------------------------------- fast, no daemons
class _Status:
    def __init__(self, step: int, version: int, metrics: dict[str, float]):
        from primerl.proto.v1 import common_pb2, control_pb2

        self.message = control_pb2.RunStatus(
            trainer_step=step, latest_policy_version=step, max_steps=10, last_metrics=metrics
        )
        self.message.workers.add(role=common_pb2.ROLE_INFERENCE, policy_version=version)


def test_progress_line_shows_step_reward_loss_lag_and_eta(monkeypatch):
    clock = iter([100.0, 110.0, 120.0])
    monkeypatch.setattr("primerl.supervisor.launcher.time.monotonic", lambda: next(clock))
    progress = Progress()
    progress.update(_Status(0, 0, {}).message)
    progress.update(
        _Status(
            1, 0, {telemetry.TRAIN_REWARD: 0.25, telemetry.TRAIN_LOSS: 0.5, telemetry.ROLLOUT_TOKENS_PER_S: 300}
        ).message
    )
    progress.update(_Status(2, 1, {telemetry.TRAIN_LOSS: 0.4}).message)
    line = progress.line()
    assert "step 2/10" in line and "reward 0.250" in line and "loss 0.4000" in line and "300 tok/s" in line
    assert "served v1 (lag 1)" in line
    assert "ETA 1m20s" in line  # 10 s per step, 8 steps left


def test_the_closing_summary_reads_the_runs_rows():
    from types import SimpleNamespace

    from primerl.supervisor.run_progress import run_summary

    rows = [
        {"step": 1, "role": "orchestrator", telemetry.TRAIN_REWARD: 0.25},
        {"step": 1, "role": "trainer"},
        {
            "step": 2,
            "role": "orchestrator",
            telemetry.TRAIN_REWARD: 0.5,
            telemetry.ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL: 3,
        },
        {"step": 2, "role": "trainer"},
    ]
    progress = Progress(served_version=2, published_version=2)
    children = [SimpleNamespace(name="broker", ready_s=1.25), SimpleNamespace(name="trainer", ready_s=None)]
    text = run_summary(rows, progress, children, 75.0, Path("/runs/x"))
    assert text.startswith("primerl rl: run finished: 2 steps in 1m15s (start-up broker 1.2 s)\n")
    assert (
        "reward (first -> last step): 0.250 -> 0.500" in text and "served by inference: 2 (trainer published 2)" in text
    )
    assert "run directory: /runs/x" in text and "interleave fallbacks: 3 multi-turn rollouts" in text
    assert "interleave" not in run_summary(rows[:2], Progress(), [], 1.0, Path("r"))


def test_configs_written_to_disk_hold_no_run_token():
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import dump_toml, load_config

    config = load_config(RLConfig, [EXAMPLE], {"broker": {"run_token": "secret-token"}})
    assert config.trainer.broker.run_token == "secret-token"
    texts = [dump_toml(without_token(config))]
    texts += [dump_toml(without_token(c)) for c in config.role_configs().values()]
    assert not any("secret-token" in text for text in texts)


def test_every_role_gets_a_free_metrics_port_unless_set():
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config

    roles = load_config(RLConfig, [EXAMPLE], {}).role_configs()
    assert [roles[role].prometheus.port for role in ("broker", "trainer", "orchestrator")] == [0, 0, 0]
    assert all(roles[role].prometheus.enabled for role in ("broker", "trainer", "orchestrator"))


def test_clashing_fixed_ports_warn_and_stop_the_launch_before_anything_starts(tmp_path):
    import io

    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config

    overrides = {
        "trainer": {"prometheus": {"port": 9400}},
        "orchestrator": {"prometheus": {"port": 9400}},
        "output_dir": str(tmp_path / "run"),
    }
    with pytest.warns(ConfigWarning, match="trainer.prometheus.port and orchestrator.prometheus.port are both 9400"):
        config = load_config(RLConfig, [EXAMPLE], overrides)
    out, err = io.StringIO(), io.StringIO()
    assert Launcher(config, LaunchOptions(), out=out, err=err).run() == 2
    assert "ports must differ" in err.getvalue() and "are both 9400" in err.getvalue()
    assert not (tmp_path / "run").exists()  # nor its run_end.json: nothing started


@pytest.mark.parametrize(("ends", "state"), [(0, "finished"), (130, "stopped"), (RuntimeError, "failed")])
def test_the_launcher_records_how_its_run_ended(tmp_path, monkeypatch, ends, state):
    """``run()`` writes RUN_DIR/run_end.json once every role stopped, from its exit status (an exception: failed)
    and the last status it read from the broker; the run itself is stood in for."""
    import io

    from primerl.configs.rl import RLConfig
    from primerl.proto.v1 import control_pb2
    from primerl.runtime.config_loader import load_config

    run_dir = tmp_path / "run"
    config = load_config(RLConfig, [EXAMPLE], {"output_dir": str(run_dir)})
    launcher = Launcher(config, LaunchOptions(dashboard=False), out=io.StringIO(), err=io.StringIO())

    def run_standing_in(started_s: float) -> int:
        run_dir.mkdir(parents=True)
        launcher.run_end.clear()  # as the run directory is prepared
        launcher.run_end.saw(control_pb2.RunStatus(run_id="run-x", trainer_step=4, latest_policy_version=4))
        launcher.progress.served_version = 4
        if ends is RuntimeError:
            raise RuntimeError("a bug")
        return ends

    monkeypatch.setattr(launcher, "_run", run_standing_in)
    if ends is RuntimeError:
        with pytest.raises(RuntimeError):
            launcher.run()
    else:
        assert launcher.run() == ends
    outcome = read_run_outcome(run_dir)
    assert outcome.state == state and outcome.trainer_step == 4 and outcome.served_policy_version == 4, outcome
    assert outcome.run_id == "run-x" and outcome.launcher_pid == os.getpid()


# ------------------------------------------------------------------------------- restarts and process hygiene
def _start_rl(tiny_model: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PRIMERL_ENV_PYTHON": ENV_PYTHON, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PRIMERL_RUN_TOKEN", None)
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(EXAMPLE),
            "--model.name",
            str(tiny_model),
            "--output-dir",
            str(run_dir),
            "--broker.grpc-port",
            str(free_port()),
            *extra,
        ],
        stdout=open(run_dir / "rl.stdout", "w"),
        stderr=open(run_dir / "rl.stderr", "w"),
        text=True,
        env=env,
        cwd=run_dir.parent,
    )


def _trainer_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("role") == "trainer":
            steps.append(row["step"])
    return steps


def _run_output(run_dir: Path, tail_chars: int = 3000) -> str:
    """What a failed run left: the launcher's stdout and stderr, and the end of each role's log."""
    parts = [
        f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail_chars:]}"
        for path in [run_dir / "rl.stdout", run_dir / "rl.stderr", *sorted((run_dir / "logs").glob("*.log"))]
        if path.exists()
    ]
    return "\n".join(parts)


def _wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while max(_trainer_steps(run_dir), default=0) < step:
        assert process.poll() is None, (run_dir / "rl.stderr").read_text()[-4000:]
        assert time.monotonic() < deadline, f"no trainer step {step} within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sigkilled_primerl_rl_leaves_no_process_behind(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    process = _start_rl(tiny_model, run_dir, "--max-steps", "200")
    tree: list[int] = []
    try:
        _wait_for_step(process, run_dir, 1, CRASH_TIMEOUT_S)
        tree = descendants(process.pid)
        roles = json.loads((run_dir / "pids.json").read_text())
        assert set(roles.values()) <= set(tree) and len(tree) > len(roles), tree  # roles, vLLM, env workers, reaper
        process.kill()
        killed_s = time.monotonic()
        process.wait(10)
        while any(running(pid) for pid in tree):
            assert time.monotonic() - killed_s < 5.0, (
                f"still running 5 s after primerl rl's SIGKILL: {[pid for pid in tree if running(pid)]}"
            )
            time.sleep(0.02)
        gone_s = time.monotonic() - killed_s
    finally:
        for pid in tree:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
    print(f"SIGKILLed primerl rl: all {len(tree)} processes it started gone in {gone_s:.2f} s")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_trainer_is_restarted_and_the_run_finishes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    process = _start_rl(
        tiny_model, run_dir, "--max-steps", "6", "--trainer.ckpt.interval", "1", "--restart-delay-s", "0.5"
    )
    try:
        _wait_for_step(process, run_dir, 2, CRASH_TIMEOUT_S)
        trainer = json.loads((run_dir / "pids.json").read_text())["trainer"]
        os.killpg(trainer, signal.SIGKILL)
        killed_s = time.monotonic()
        while json.loads((run_dir / "pids.json").read_text())["trainer"] == trainer:
            assert process.poll() is None and time.monotonic() - killed_s < 30, "the trainer was not restarted"
            time.sleep(0.05)
        restart_s = time.monotonic() - killed_s
        process.wait(RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(60)
    stdout, stderr = (run_dir / "rl.stdout").read_text(), (run_dir / "rl.stderr").read_text()
    assert process.returncode == 0, (stdout + stderr)[-6000:]
    assert "restarting trainer after signal SIGKILL (restart 1 of 5 within 300 s) in 0.5 s" in stdout
    assert "trainer started again" in stdout and "run finished: 6 steps" in stdout, stdout[-4000:]
    assert max(_trainer_steps(run_dir)) == 6
    assert_no_child_left(run_dir)
    print(f"trainer SIGKILLed after step 2: started again {restart_s:.2f} s later; the run finished")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_broker_comes_back_on_its_ports_and_the_run_finishes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    process = _start_rl(
        tiny_model, run_dir, "--max-steps", "6", "--trainer.ckpt.interval", "1", "--restart-delay-s", "0.5"
    )
    try:
        _wait_for_step(process, run_dir, 2, CRASH_TIMEOUT_S)
        first = json.loads((run_dir / "broker.ready.json").read_text())
        broker = json.loads((run_dir / "pids.json").read_text())["broker"]
        os.killpg(broker, signal.SIGKILL)
        killed_s = time.monotonic()
        ready = run_dir / "broker.ready.json"
        while not (ready.exists() and json.loads(ready.read_text())["pid"] != first["pid"]):
            assert process.poll() is None and time.monotonic() - killed_s < 60, "the broker did not come back"
            time.sleep(0.05)
        back_s = time.monotonic() - killed_s
        second = json.loads(ready.read_text())
        process.wait(RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(60)
    stdout, stderr = (run_dir / "rl.stdout").read_text(), (run_dir / "rl.stderr").read_text()
    # The same ports and run id: clients find it where it was.
    assert {k: second[k] for k in ("grpc_port", "rollout_port", "weight_port", "run_id")} == {
        k: first[k] for k in ("grpc_port", "rollout_port", "weight_port", "run_id")
    }
    assert "restarting broker after signal SIGKILL (restart 1 of 5 within 300 s) in 0.5 s" in stdout
    assert "broker back (start 2" in stdout
    assert process.returncode == 0, (stdout + stderr)[-6000:]
    assert "run finished: 6 steps" in stdout, stdout[-4000:]
    assert_no_child_left(run_dir)
    print(
        f"broker SIGKILLed after step 2: ready again {back_s:.2f} s later; the run finished\n"
        + "\n".join(line for line in stdout.splitlines() if "broker" in line)
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_inference_server_comes_back_on_its_port_and_the_run_finishes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    process = _start_rl(
        tiny_model, run_dir, "--max-steps", "5", "--trainer.ckpt.interval", "1", "--restart-delay-s", "0.5"
    )
    try:
        _wait_for_step(process, run_dir, 2, CRASH_TIMEOUT_S)
        first = json.loads((run_dir / "inference.ready.json").read_text())
        os.killpg(json.loads((run_dir / "pids.json").read_text())["inference"], signal.SIGKILL)
        killed_s = time.monotonic()
        ready = run_dir / "inference.ready.json"
        while not (ready.exists() and json.loads(ready.read_text())["pid"] != first["pid"]):
            assert process.poll() is None and time.monotonic() - killed_s < 180, (
                f"inference did not come back\n{_run_output(run_dir)}"
            )
            time.sleep(0.1)
        back_s = time.monotonic() - killed_s
        second = json.loads(ready.read_text())
        process.wait(RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(60)
    stdout, stderr = (run_dir / "rl.stdout").read_text(), (run_dir / "rl.stderr").read_text()
    assert second["http_port"] == first["http_port"]
    assert "restarting inference after signal SIGKILL (restart 1 of 5 within 300 s) in 0.5 s" in stdout
    assert process.returncode == 0, (stdout + stderr)[-6000:]
    assert "run finished: 5 steps" in stdout, stdout[-4000:]
    assert_no_child_left(run_dir)
    print(f"inference SIGKILLed after step 2: serving again {back_s:.1f} s later; the run finished")
