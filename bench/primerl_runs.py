"""Running the real things for the benches: ``primerl rl`` as a user starts it, TRL in its own interpreter,
``primerl eval``, and the demo's prompts in primerl's order. Shared by rl_vs_trl.py and async_levels.py.

Every child runs in its own process group with a time limit; on timeout or Ctrl-C the group gets SIGTERM, then
SIGKILL after ``STOP_GRACE_S``. Nothing here fakes a result: a child that fails raises ``BenchRunError`` with
the tail of its log, and the caller writes "not run: <why>" instead of a number.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primerl.proto import telemetry

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
PRIMERL = VENV_BIN / "primerl"
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
ENV_PYTHON = Path(os.environ.get("PRIMERL_ENV_PYTHON") or ROOT / ".venv-envs" / "bin" / "python")
RL_CONFIG = ROOT / "examples" / "reverse_text_rl.toml"
ENV_ID = "reverse-text"
EVAL_ARGS = ["-n", "200", "-r", "1", "-t", "24", "-T", "1.0"]  # the demo's held-out eval (Makefile EVAL_ARGS)
STOP_GRACE_S = 30.0
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PRIMERL_ENV_PYTHON": str(ENV_PYTHON),
    "TOKENIZERS_PARALLELISM": "false",
}


class BenchRunError(RuntimeError):
    """A child (primerl rl, TRL, eval) failed or ran out of time; the message says which and shows its log tail."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    return env


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_child(
    cmd: list[str], log_path: Path, timeout_s: float, what: str, extra_env: dict[str, str] | None = None
) -> float:
    """Run ``cmd`` (own process group, output to ``log_path``) and return its launch time (Unix seconds).
    Raises BenchRunError on a non-zero exit or after ``timeout_s``; the group is stopped either way."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        launch = time.time()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**child_env(), **(extra_env or {})},
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            raise BenchRunError(
                f"{what}: no result within {timeout_s:.0f} s (stopped); log {log_path}:\n{log_tail(log_path)}"
            ) from None
        except BaseException:
            stop_group(proc)
            raise
    if rc != 0:
        raise BenchRunError(f"{what}: exit code {rc}; log {log_path}:\n{log_tail(log_path)}")
    return launch


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after STOP_GRACE_S (only the group this bench started)."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- prompts ---------------------------------------------------------------------------------------------------

_EXPORT_ROWS = """
import json, sys
import reverse_text
env = reverse_text.load_environment()
ds = env.get_dataset()
with open(sys.argv[1], "w") as out:
    for row in ds:
        out.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"]}) + "\\n")
"""


def write_prompts(path: Path, num_prompts: int, work_dir: Path) -> Path:
    """The environment's train split (exported by its own interpreter, ``.venv-envs``), in the order primerl's
    orchestrator draws it (``EnvSampler``, seed 0 = ``sampling.seed`` unset), repeated over epochs up to
    ``num_prompts`` lines."""
    from primerl.orchestrator.env_sampler import EnvSampler

    rows_path = work_dir / "train_rows.jsonl"
    if not rows_path.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [str(ENV_PYTHON), "-c", _EXPORT_ROWS, str(rows_path)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise BenchRunError(f"exporting the {ENV_ID} train split failed:\n{result.stderr[-2000:]}")
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    sampler = EnvSampler({ENV_ID: len(rows)}, {ENV_ID: 1.0}, seed=0)
    with open(path, "w") as out:
        for _ in range(num_prompts):
            _, index = sampler.next()
            out.write(json.dumps(rows[index]) + "\n")
    return path


# -- primerl rl -------------------------------------------------------------------------------------------------


@dataclass
class RunTimeline:
    """Wall-clock facts of one training run, all Unix seconds (``launch`` = the command was started)."""

    launch: float
    first_rollouts: float | None
    step_ends: list[float]
    step_rewards: list[float | None]
    end: float
    model_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.step_ends)

    @property
    def startup_to_rollouts_s(self) -> float | None:
        return None if self.first_rollouts is None else self.first_rollouts - self.launch

    @property
    def startup_to_first_step_s(self) -> float | None:
        return self.step_ends[0] - self.launch if self.step_ends else None

    @property
    def step_intervals_s(self) -> list[float]:
        """Wall time between consecutive step ends: the steady-state cost of a step (start-up excluded)."""
        return [b - a for a, b in zip(self.step_ends, self.step_ends[1:])]

    @property
    def steady_wall_per_step_s(self) -> float | None:
        if self.num_steps < 2:
            return None
        return (self.step_ends[-1] - self.step_ends[0]) / (self.num_steps - 1)

    def samples_per_s(self, samples_per_step: int) -> float | None:
        per_step = self.steady_wall_per_step_s
        return None if not per_step else samples_per_step / per_step

    def as_dict(self) -> dict[str, Any]:
        return {
            "launch": self.launch,
            "first_rollouts": self.first_rollouts,
            "step_ends": self.step_ends,
            "step_rewards": self.step_rewards,
            "end": self.end,
            "model_dir": self.model_dir,
            **self.extra,
        }


def run_primerl(
    model: str,
    out_dir: Path,
    max_steps: int,
    timeout_s: float,
    overrides: list[str] | None = None,
    what: str = "primerl rl",
) -> RunTimeline:
    """``primerl rl @ examples/reverse_text_rl.toml`` from ``model`` (the demo's config, a free broker port)."""
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    cmd = [
        str(PRIMERL),
        "rl",
        "@",
        str(RL_CONFIG),
        "--model.name",
        str(model),
        "--output-dir",
        str(out_dir),
        "--max-steps",
        str(max_steps),
        "--broker.grpc-port",
        str(free_port()),
        *(overrides or []),
    ]
    log_path = out_dir.parent / f"{out_dir.name}.log"
    launch = run_child(cmd, log_path, timeout_s, what)
    end = time.time()
    return read_primerl_timeline(out_dir, launch, end)


def read_primerl_timeline(run_dir: Path, launch: float, end: float) -> RunTimeline:
    """Step ends from the trainer's rows of ``metrics.jsonl``, first rollouts from the orchestrator's first row
    (its first batch sent), rewards from the orchestrator's ``train/reward`` of each batch."""
    from primerl.runtime.run_metrics import read_metrics_file

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise BenchRunError(f"{path} is missing: the run wrote no metrics")
    trainer: dict[int, float] = {}
    orchestrator: dict[int, tuple[float, float | None]] = {}
    extra: dict[str, list[float]] = {"step_time_s": [], "kl_divergence": []}
    for row in read_metrics_file(path, skip_bad_lines=True).rows:
        step, when = int(row.get("step", -1)), float(row.get("time", 0.0))
        if row.get("role") == "trainer" and step not in trainer:
            trainer[step] = when
            if telemetry.PERF_STEP_TIME_S in row:
                extra["step_time_s"].append(float(row[telemetry.PERF_STEP_TIME_S]))
            if telemetry.TRAIN_KL_DIVERGENCE in row:
                extra["kl_divergence"].append(float(row[telemetry.TRAIN_KL_DIVERGENCE]))
        elif row.get("role") == "orchestrator" and telemetry.TRAIN_REWARD in row and step not in orchestrator:
            orchestrator[step] = (when, float(row[telemetry.TRAIN_REWARD]))
    if not trainer:
        raise BenchRunError(f"{path} has no trainer rows")
    steps = sorted(trainer)
    first_rollouts = min(when for when, _ in orchestrator.values()) if orchestrator else None
    rewards = [reward for _, (_, reward) in sorted(orchestrator.items())]
    extra["reward_times"] = [when for _, (when, _) in sorted(orchestrator.items())]
    return RunTimeline(
        launch=launch,
        first_rollouts=first_rollouts,
        step_ends=[trainer[s] for s in steps],
        step_rewards=rewards,
        end=end,
        model_dir=str(run_dir),
        extra=extra,
    )


# -- TRL ----------------------------------------------------------------------------------------------------------


def run_trl(
    model: str,
    prompts: Path,
    out_dir: Path,
    max_steps: int,
    timeout_s: float,
    wall_budget_s: float | None = None,
    save: bool = True,
    what: str = "TRL GRPOTrainer",
) -> RunTimeline:
    if not BENCH_PYTHON.exists():
        raise BenchRunError(f"{BENCH_PYTHON} is missing: build the bench venv with `make bench` (or `make bench-venv`)")
    result_path = out_dir / "result.json"
    if result_path.exists():
        result_path.unlink()
    cmd = [
        str(BENCH_PYTHON),
        str(ROOT / "bench" / "trl_grpo.py"),
        "--model",
        str(model),
        "--data",
        str(prompts),
        "--output-dir",
        str(out_dir),
        "--result",
        str(result_path),
        "--max-steps",
        str(max_steps),
    ]
    if wall_budget_s is not None:
        cmd += ["--wall-budget-s", f"{wall_budget_s:.1f}"]
    if not save:
        cmd.append("--no-save")
    log_path = out_dir.parent / f"{out_dir.name}.log"
    # The launch time is taken here, just before the process starts, and handed to the child so that its
    # interpreter start-up and imports count, as they do for primerl.
    launch = time.time()
    cmd += ["--launch-time", f"{launch:.3f}"]
    run_child(cmd, log_path, timeout_s, what)
    end = time.time()
    data = json.loads(result_path.read_text())
    return RunTimeline(
        launch=data["launch_time"],
        first_rollouts=data["first_rollouts_time"],
        step_ends=data["step_end_times"],
        step_rewards=data["step_rewards"],
        end=end,
        model_dir=data.get("final_model"),
        extra={"num_threads": data.get("num_threads")},
    )


# -- eval -----------------------------------------------------------------------------------------------------------


@dataclass
class EvalResult:
    reward_mean: float
    reward_sem: float  # standard error of the mean over the rollouts (the eval's sampling noise)
    num_rollouts: int
    output: str


def run_eval(model: str, out_dir: Path, timeout_s: float, num_examples: int = 200) -> EvalResult:
    """The demo's held-out eval (``primerl eval reverse-text -m MODEL -n 200 -r 1 -t 24 -T 1.0``)."""
    args = list(EVAL_ARGS)
    args[1] = str(num_examples)
    cmd = [str(PRIMERL), "eval", ENV_ID, "-m", str(model), *args, "-o", str(out_dir)]
    run_child(cmd, out_dir.parent / f"{out_dir.name}.log", timeout_s, f"primerl eval of {model}")
    rewards = []
    for line in (out_dir / "results.jsonl").read_text().splitlines():
        reward = json.loads(line).get("reward")
        if reward is not None:
            rewards.append(float(reward))
    if len(rewards) < 2:
        raise BenchRunError(f"eval of {model}: {len(rewards)} rewards in {out_dir}/results.jsonl")
    mean = sum(rewards) / len(rewards)
    variance = sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)
    return EvalResult(mean, (variance / len(rewards)) ** 0.5, len(rewards), str(out_dir))


def python_version_of(python: Path, module: str) -> str:
    try:
        out = subprocess.run(
            [str(python), "-c", f"import {module}; print({module}.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


if __name__ == "__main__":
    sys.exit("a library of bench/rl_vs_trl.py and bench/async_levels.py; run those")
