"""`primerl slurm` on a real SLURM cluster (``support.slurm_cluster``: slurmctld, munged and one slurmd per
network-namespace node, Debian's slurm-wlm): the demo's tiny model, a run in the ``jobs`` shape over 4 nodes with
the trainer's two ranks on two of them. Mid-run, `primerl slurm add-inference` adds a worker as a job of its own,
which serves and is then cancelled (`scancel`); the orchestrator's job step is killed (SIGKILL) and its job is
requeued; the run finishes with every step trained once, the jobs end by themselves, and `primerl status RUN_DIR`
shows the finished run. Skipped with one line where the machine cannot run a cluster (not root, no netns, no
slurm-wlm). The timings it prints are the figures of docs/slurm.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.slurm_cluster import SlurmCluster, slurm_available

from primerl.proto import telemetry

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
BIN = Path(sys.executable).parent
MAX_STEPS = 30
RUN_OVERRIDES = [
    "--max-steps",
    str(MAX_STEPS),
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.rollouts-per-example",
    "4",
    "--orchestrator.sampling.max-tokens",
    "16",
    "--trainer.ckpt.interval",
    "100",
    "--log.format",
    "json",
]
RUN_TIMEOUT_S = 420.0


class Watch:
    """The run from outside: the broker's status through `primerl status RUN_DIR --json`, and SLURM's jobs."""

    def __init__(self, cluster: SlurmCluster, run_dir: Path, env: dict[str, str]):
        self.cluster, self.run_dir, self.env = cluster, run_dir, env
        self.deadline = time.monotonic() + RUN_TIMEOUT_S

    def status(self) -> dict:
        argv = [str(BIN / "primerl"), "status", str(self.run_dir), "--json", "--timeout-s", "5"]
        result = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=60)
        try:
            return json.loads(result.stdout) if result.returncode == 0 else {}
        except ValueError:
            return {}

    def until(self, what: str, predicate) -> dict:
        while True:
            status = self.status() if (self.run_dir / "run.json").exists() else {}
            if status and predicate(status):
                return status
            if time.monotonic() > self.deadline:
                logs = self.cluster.run("squeue", "-h", "-o", "%i %j %k %T %R")
                raise AssertionError(f"timed out waiting for {what}; jobs:\n{logs}\nlast status {str(status)[:1500]}")
            time.sleep(0.5)


def serving(status: dict) -> list[dict]:
    return [
        w
        for w in status.get("workers", [])
        if w.get("role") == "ROLE_INFERENCE" and w.get("state") == "WORKER_STATE_ALIVE"
    ]


def step(status: dict) -> int:
    return int(status.get("trainer_step", 0))


def trainer_steps(run_dir: Path) -> list[int]:
    steps = []
    for line in (run_dir / "logs" / "trainer.log").read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == telemetry.STEP_DONE:
            steps.append(int(event["step"]))
    return steps


def test_a_run_as_slurm_jobs_grows_loses_a_role_and_finishes(tiny_model: Path, tmp_path: Path) -> None:
    ok, why = slurm_available()
    if not ok:
        pytest.skip(f"no local SLURM cluster here: {why}")
    run_dir = tmp_path / "run"
    state = Path(tempfile.mkdtemp(prefix="prl-slurm-"))  # munged wants every directory above its socket searchable
    state.chmod(0o755)
    with SlurmCluster.create(["n1", "n2", "n3", "n4"], state / "cluster") as cluster:
        env = {
            **cluster.env(),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PRIMERL_ENV_PYTHON": os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs/bin/python")),
        }
        env.pop("PRIMERL_RUN_TOKEN", None)
        launch = [str(BIN / "primerl"), "slurm", "@", str(EXAMPLE), "--model.name", str(tiny_model)]
        launch += ["--run-dir", str(run_dir), *RUN_OVERRIDES, "--trainer-nodes", "2", "--requeue-limit", "2"]
        started = time.monotonic()
        result = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        jobs = {line["role"]: str(line["job_id"]) for line in map(json.loads, open(run_dir / "slurm/jobs.jsonl"))}
        assert set(jobs) == {"broker", "trainer", "inference", "orchestrator"}
        watch = Watch(cluster, run_dir, env)
        watch.until("step 1", lambda s: step(s) >= 1)
        first_step_s = time.monotonic() - started
        trainer_nodes = cluster.job(int(jobs["trainer"]))["NodeList"]

        # Mid-run, at once: more inference as a job of its own, and the orchestrator's step killed (its job is
        # requeued; the run waits for it). The added worker's vLLM starts meanwhile.
        added_at = time.monotonic()
        result = subprocess.run(
            [str(BIN / "primerl"), "slurm", "add-inference", str(run_dir), "--nodes", "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        added = result.stdout.split("job ")[1].split()[0]
        before = step(watch.status())
        killed_at = time.monotonic()
        cluster.run("scancel", "--signal=KILL", f"{jobs['orchestrator']}.0")
        watch.until("two steps after the requeue", lambda s: step(s) >= before + 2)
        back_s = time.monotonic() - killed_at
        restarts = int(cluster.job(int(jobs["orchestrator"])).get("Restarts", 0))
        at_add = watch.until("two workers serving", lambda s: len(serving(s)) >= 2 or step(s) >= MAX_STEPS)
        add_serving_s = time.monotonic() - added_at
        assert len(serving(at_add)) == 2, "the run ended before the added worker served: make the run longer"
        cluster.run("scancel", added)
        watch.until("the added worker gone", lambda s: len(serving(s)) == 1)
        left_at_step = step(watch.status())
        assert left_at_step < MAX_STEPS, "the run ended before the added worker left: make the run longer"

        wait_all_jobs_gone(cluster, watch)
        total_s = time.monotonic() - started
    shutil.rmtree(state, ignore_errors=True)

    steps = trainer_steps(run_dir)
    assert steps == list(range(1, MAX_STEPS + 1)), f"every step trained once: {steps}"
    assert restarts == 1, f"the orchestrator's job was requeued {restarts} times"
    outcome = json.loads((run_dir / "run_end.json").read_text())
    assert outcome["outcome"] == "finished" and outcome["trainer_step"] == MAX_STEPS
    print(
        f"\nslurm run: trainer on {trainer_nodes}; launch -> step 1 {first_step_s:.1f} s; add-inference -> "
        f"serving {add_serving_s:.1f} s (cancelled, gone by step {left_at_step}); orchestrator step killed -> "
        f"requeued, 2 steps later {back_s:.1f} s; "
        f"{MAX_STEPS} steps in {total_s:.1f} s"
    )


def wait_all_jobs_gone(cluster: SlurmCluster, watch: Watch) -> None:
    """Until SLURM holds no job of the run: the trainer's job ends it and cancels what is left."""
    while cluster.run("squeue", "-h", "-o", "%i"):
        if time.monotonic() > watch.deadline:
            jobs = cluster.run("squeue", "-h", "-o", "%i %j %k %T %R")
            raise AssertionError(f"the run's jobs did not end:\n{jobs}")
        time.sleep(1.0)
