"""A `primerl slurm` run on a ``SlurmCluster``, as tests/test_slurm.py and bench/slurm_run.py drive it, and the same
run under `primerl rl` on one host for the scheduler's overhead.

``jobs_scenario``: the ``jobs`` shape over the cluster's nodes, the trainer's two ranks on two of them. Once step 1
is done: `primerl slurm add-inference --nodes 1`, and at once the broker's node lost (drained, and the broker's job
step killed with SIGKILL, `scancel --signal=KILL JOB.0`): its job must be requeued onto another node and every role
must follow it there (``primerl.slurm.step``), a step done after that; the added worker must serve, is cancelled
(`scancel`) and must leave while the run goes on; the run ends by itself (the trainer's job cancels what is left).
Returns a ``SlurmRunReport``: timings, the steps trained, the requeues.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from primerl.proto import telemetry
from primerl.slurm.step import current_broker

from .multihost_report import parse_ts
from .slurm_cluster import SlurmCluster

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
BIN = Path(sys.executable).parent
RUN_OVERRIDES = [
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.rollouts-per-example",
    "4",
    "--orchestrator.sampling.max-tokens",
    "16",
    "--trainer.ckpt.interval",
    "2",
    "--log.format",
    "json",
]
RUN_TIMEOUT_S = 420.0


@dataclass
class SlurmRunReport:
    max_steps: int
    steps: list[int] = field(default_factory=list)  # the lineage of the final weights (``step_timing``)
    retrained: int = 0  # steps trained again after a trainer resumed from its checkpoint
    first_step_s: float = 0.0  # launch (the submitting command) -> step 1 done
    step_s: float = 0.0  # median time between two steps
    add_serving_s: float = 0.0  # `add-inference` -> the new worker registered and alive
    left_at_step: int = 0  # the trainer's step once the cancelled worker was gone
    broker_back_s: float = 0.0  # the broker's node drained and its step killed -> the broker ready on another node
    roles_back_s: float = 0.0  # ... -> every role started again with its address, and a step done after that
    restarts: int = 0  # of the broker's job
    broker_nodes: str = ""  # "OLD -> NEW"
    orchestrator_back_s: float = 0.0  # (fault ``orchestrator``) its step killed -> its job requeued, registered again
    total_s: float = 0.0
    trainer_nodes: str = ""
    outcome: dict = field(default_factory=dict)  # run_end.json

    def fault_summary(self) -> str:
        if self.broker_nodes:
            return (
                f"broker's node lost ({self.broker_nodes}): broker back {self.broker_back_s:.1f} s, every role "
                f"with it and a step done {self.roles_back_s:.1f} s"
            )
        return (
            f"orchestrator step killed: requeued and registered {self.orchestrator_back_s:.1f} s, a step done "
            f"{self.roles_back_s:.1f} s"
        )

    def summary(self) -> str:
        return (
            f"trainer on {self.trainer_nodes}; launch -> step 1 {self.first_step_s:.1f} s; step {self.step_s:.2f} s "
            f"(median); add-inference -> serving {self.add_serving_s:.1f} s (cancelled, gone by step "
            f"{self.left_at_step}); {self.fault_summary()}; "
            f"{self.max_steps} steps in {self.total_s:.1f} s"
        )


def run_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        **os.environ,
        **extra,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
    env.pop("PRIMERL_RUN_TOKEN", None)
    return env


def trainer_events(run_dir: Path, names: tuple[str, ...]) -> list[dict]:
    events = []
    for line in (run_dir / "logs" / "trainer.log").read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") in names:
            events.append(event)
    return events


def step_timing(run_dir: Path, launched_unix_s: float) -> tuple[list[int], int, float, float]:
    """The lineage of the final weights (the steps each trainer incarnation trained, cut back to the checkpoint
    the next one resumed from, as the chaos checks read it), the steps trained again after such a resume, launch ->
    step 1 done (s), and the median time between steps (s)."""
    lineage: list[int] = []
    retrained, times = 0, []
    for event in trainer_events(run_dir, (telemetry.STEP_DONE, telemetry.RESUMED_FROM_CHECKPOINT)):
        if event["event"] == telemetry.RESUMED_FROM_CHECKPOINT:
            kept = [s for s in lineage if s <= int(event["step"])]
            retrained += len(lineage) - len(kept)
            lineage = kept
            continue
        lineage.append(int(event["step"]))
        times.append(parse_ts(event))
    gaps = [b - a for a, b in zip(times, times[1:])]
    first = times[0] - launched_unix_s if times else 0.0
    return lineage, retrained, first, statistics.median(gaps) if gaps else 0.0


class Watch:
    """The run from outside: `primerl status RUN_DIR --json` (the broker's status), within ``RUN_TIMEOUT_S``."""

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
            self.check_time(what, status)
            time.sleep(0.5)

    def check_time(self, what: str, status: dict | None = None) -> None:
        if time.monotonic() > self.deadline:
            jobs = self.cluster.run("squeue", "-h", "-o", "%i %j %k %T %R")
            raise AssertionError(f"timed out waiting for {what}; jobs:\n{jobs}\nlast status {str(status)[:1500]}")

    def jobs_gone(self) -> None:
        """Until SLURM holds no job: the trainer's job ends the run and cancels what is left."""
        while self.cluster.run("squeue", "-h", "-o", "%i"):
            self.check_time("every job of the run to end")
            time.sleep(1.0)


def serving(status: dict) -> list[dict]:
    return [
        w
        for w in status.get("workers", [])
        if w.get("role") == "ROLE_INFERENCE" and w.get("state") == "WORKER_STATE_ALIVE"
    ]


def orchestrator_since(status: dict, unix_ms: float) -> bool:
    """An orchestrator registered after ``unix_ms`` is alive."""
    return any(
        w.get("role") == "ROLE_ORCHESTRATOR"
        and w.get("state") == "WORKER_STATE_ALIVE"
        and int(w.get("registered_unix_ms", 0)) > unix_ms
        for w in status.get("workers", [])
    )


def trainer_step(status: dict) -> int:
    return int(status.get("trainer_step", 0))


def primerl(*argv: str, env: dict[str, str], timeout_s: float = 120.0) -> str:
    result = subprocess.run([str(BIN / "primerl"), *argv], capture_output=True, text=True, env=env, timeout=timeout_s)
    if result.returncode != 0:
        raise AssertionError(f"`primerl {' '.join(argv)}` exited {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


def submit(model: Path, run_dir: Path, max_steps: int, env: dict[str, str], *options: str) -> None:
    """`primerl slurm` of the example run (``RUN_OVERRIDES``) with ``options``."""
    primerl("slurm", "@", str(EXAMPLE), "--model.name", str(model), "--run-dir", str(run_dir), *RUN_OVERRIDES,
            "--max-steps", str(max_steps), *options, env=env)  # fmt: skip


def jobs_scenario(
    cluster: SlurmCluster, model: Path, run_dir: Path, max_steps: int, fault: str = "node"
) -> SlurmRunReport:
    """``fault``: ``node`` (the broker's node lost, ``lose_the_brokers_node``) or ``orchestrator`` (its step killed,
    ``kill_the_orchestrator``), at the moment a worker is added."""
    report = SlurmRunReport(max_steps)
    env = run_env(cluster.env())
    launched, started = time.time(), time.monotonic()
    submit(model, run_dir, max_steps, env, "--trainer-nodes", "2", "--requeue-limit", "2")
    jobs = {line["role"]: str(line["job_id"]) for line in map(json.loads, open(run_dir / "slurm" / "jobs.jsonl"))}
    watch = Watch(cluster, run_dir, env)
    watch.until("step 1", lambda s: trainer_step(s) >= 1)
    report.trainer_nodes = cluster.job(int(jobs["trainer"]))["NodeList"]

    added_at = time.monotonic()
    added = primerl("slurm", "add-inference", str(run_dir), "--nodes", "1", env=env).split("job ")[1].split()[0]
    if fault == "node":
        report.broker_nodes = lose_the_brokers_node(cluster, watch, jobs["broker"], report)
    else:
        kill_the_orchestrator(cluster, watch, jobs["orchestrator"], report)
    at_add = watch.until("two workers serving", lambda s: len(serving(s)) >= 2 or trainer_step(s) >= max_steps)
    report.add_serving_s = time.monotonic() - added_at
    if len(serving(at_add)) < 2:
        raise AssertionError("the run ended before the added worker served: make the run longer")
    cluster.run("scancel", added)
    report.left_at_step = trainer_step(watch.until("the added worker gone", lambda s: len(serving(s)) == 1))

    watch.jobs_gone()
    report.total_s = time.monotonic() - started
    report.steps, report.retrained, report.first_step_s, report.step_s = step_timing(run_dir, launched)
    report.outcome = json.loads((run_dir / "run_end.json").read_text())
    return report


def kill_the_orchestrator(cluster: SlurmCluster, watch: Watch, job: str, report: SlurmRunReport) -> None:
    """The orchestrator's step killed (SIGKILL): its job is requeued and it registers again; a step after that."""
    killed_at, killed_unix_ms = time.monotonic(), time.time() * 1000
    cluster.run("scancel", "--signal=KILL", f"{job}.0")
    back = watch.until("the orchestrator registered again", lambda s: orchestrator_since(s, killed_unix_ms))
    report.orchestrator_back_s = time.monotonic() - killed_at
    watch.until("a step after the orchestrator came back", lambda s: trainer_step(s) > trainer_step(back))
    report.roles_back_s = time.monotonic() - killed_at
    report.restarts = int(cluster.job(int(job)).get("Restarts", 0))


def lose_the_brokers_node(cluster: SlurmCluster, watch: Watch, job: str, report: SlurmRunReport) -> str:
    """The broker's node drained (no new job lands there) and the broker's step killed: its job is requeued onto
    another node, and every role must follow it there. Returns "OLD -> NEW" (nodes)."""
    old_node, old_address = cluster.job(int(job))["NodeList"], current_broker(watch.run_dir)
    cluster.run("scontrol", "update", f"nodename={old_node}", "state=drain", "reason=primerl test: a node lost")
    killed_at, killed_unix_ms = time.monotonic(), time.time() * 1000
    cluster.run("scancel", "--signal=KILL", f"{job}.0")
    while current_broker(watch.run_dir) in (None, old_address):
        watch.check_time("the broker's job requeued onto another node")
        time.sleep(0.2)
    report.broker_back_s = time.monotonic() - killed_at
    cluster.run("scontrol", "update", f"nodename={old_node}", "state=resume")
    back = watch.until(
        "the orchestrator registered with the moved broker", lambda s: orchestrator_since(s, killed_unix_ms)
    )
    watch.until("a step after the move", lambda s: trainer_step(s) > trainer_step(back))
    report.roles_back_s = time.monotonic() - killed_at
    report.restarts = int(cluster.job(int(job)).get("Restarts", 0))
    return f"{old_node} -> {cluster.job(int(job))['NodeList']}"


def local_run(model: Path, run_dir: Path, max_steps: int) -> SlurmRunReport:
    """The same run under `primerl rl` on this host (two trainer ranks, as on the cluster): launch -> step 1 and
    the median step time."""
    report = SlurmRunReport(max_steps, trainer_nodes="this host (2 ranks)")
    launched, started = time.time(), time.monotonic()
    primerl("rl", "@", str(EXAMPLE), "--model.name", str(model), "--run-dir", str(run_dir), *RUN_OVERRIDES,
            "--max-steps", str(max_steps), "--trainer-gpu-ids", "[1,2]", "--no-dashboard",
            env=run_env({}), timeout_s=RUN_TIMEOUT_S)  # fmt: skip
    report.total_s = time.monotonic() - started
    report.steps, report.retrained, report.first_step_s, report.step_s = step_timing(run_dir, launched)
    return report


def one_job_scenario(cluster: SlurmCluster, model: Path, run_dir: Path, max_steps: int) -> SlurmRunReport:
    """The ``one-job`` shape (fate shared) over 4 nodes, run to its end: the job must complete by itself."""
    report = SlurmRunReport(max_steps)
    env = run_env(cluster.env())
    launched, started = time.time(), time.monotonic()
    submit(model, run_dir, max_steps, env, "--trainer-nodes", "2", "--shape", "one-job")
    [job] = [json.loads(line)["job_id"] for line in open(run_dir / "slurm" / "jobs.jsonl")]
    watch = Watch(cluster, run_dir, env)
    watch.jobs_gone()
    report.total_s = time.monotonic() - started
    report.outcome = {"job": cluster.job(int(job)), **json.loads((run_dir / "run_end.json").read_text())}
    report.steps, report.retrained, report.first_step_s, report.step_s = step_timing(run_dir, launched)
    return report


def add_inference_cycles(cluster: SlurmCluster, model: Path, run_dir: Path, cycles: int) -> list[float]:
    """A long `jobs` run and nothing else going on: ``cycles`` times `add-inference --nodes 1`, timed until the
    new worker serves, then `scancel` of it until it left; the run is stopped with `scancel --name` after. Returns
    the add -> serving times (s)."""
    env = run_env(cluster.env())
    submit(model, run_dir, 100000, env, "--job-name", "primerl-cycles")
    watch = Watch(cluster, run_dir, env)
    watch.until("step 1", lambda s: trainer_step(s) >= 1)
    times = []
    for _ in range(cycles):
        added_at = time.monotonic()
        added = primerl("slurm", "add-inference", str(run_dir), "--nodes", "1", env=env).split("job ")[1].split()[0]
        watch.until("the added worker serving", lambda s: len(serving(s)) >= 2)
        times.append(time.monotonic() - added_at)
        cluster.run("scancel", added)
        watch.until("the added worker gone", lambda s: len(serving(s)) == 1)
    cluster.run("scancel", "--name", "primerl-cycles")
    watch.jobs_gone()
    return times
