"""Writing a run's files and submitting its jobs with `sbatch` (or printing them: ``--dry-run``).

``prepare_run`` writes what every job step reads from the run directory: ``rl.toml`` and one ``<role>.toml`` per
role (without the run token, as `primerl rl` writes them), ``slurm/plan.json``, ``slurm/token`` and the batch
scripts ``slurm/<role>.sbatch``. ``submit_run`` submits them: in the ``jobs`` shape the broker first, then the
trainer, the inference array and the orchestrator, each ``--dependency=after:BROKER`` (they start once the
broker's job has started, and wait for its address); in the ``one-job`` shape the one script.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TextIO

from primerl.runtime.config_loader import write_toml
from primerl.runtime.run_files import RUN_CONFIG_FILE, RUN_END_FILE, RUN_FILE
from primerl.slurm.plan import SlurmPlan, record_job, write_plan
from primerl.slurm.scripts import one_job_script, role_script
from primerl.supervisor.role_configs import without_token

SBATCH_TIMEOUT_S = 60.0


class SubmitError(RuntimeError):
    """`sbatch` is missing or refused a job; the message holds its words."""


def scripts_of(plan: SlurmPlan) -> dict[str, str]:
    """Script name -> text, in the order they are submitted."""
    if plan.shape == "one-job":
        return {"run": one_job_script(plan)}
    return {role: role_script(plan, role) for role in ("broker", "trainer", "inference", "orchestrator")}


def prepare_run(config, plan: SlurmPlan, token: str) -> dict[str, Path]:
    """Write the run's configs, plan, token and scripts; returns script name -> path."""
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (RUN_FILE, RUN_END_FILE):  # a former run's: the new broker writes its own
        (run_dir / stale).unlink(missing_ok=True)
    (plan.slurm_dir / "broker-endpoints.json").unlink(missing_ok=True)
    write_toml(without_token(config), run_dir / RUN_CONFIG_FILE)
    for role, role_config in config.role_configs().items():
        write_toml(without_token(role_config), run_dir / f"{role}.toml")
    write_plan(plan, token)
    paths = {}
    for name, text in scripts_of(plan).items():
        paths[name] = plan.slurm_dir / f"{name}.sbatch"
        paths[name].write_text(text)
    return paths


def sbatch_argv(plan: SlurmPlan, name: str, script: Path, broker_job: str | None, array: int | None = None) -> list:
    argv = ["sbatch", "--parsable"]
    if name != "broker" and broker_job:
        argv.append(f"--dependency=after:{broker_job}")
    if name == "inference":
        argv.append(f"--array=0-{(array or plan.inference_nodes) - 1}")
    return [*argv, str(script)]


def sbatch(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        raise SubmitError("no `sbatch` on this machine's PATH: run `primerl slurm` on a SLURM login node")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)
    if result.returncode != 0:
        raise SubmitError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip().split(";")[0]  # --parsable: "JOBID" or "JOBID;CLUSTER"


def submit_run(plan: SlurmPlan, paths: dict[str, Path], out: TextIO) -> dict[str, str]:
    """Submit the scripts; returns script name -> job id."""
    jobs: dict[str, str] = {}
    for name, path in paths.items():
        jobs[name] = sbatch(sbatch_argv(plan, name, path, jobs.get("broker")))
        nodes = {"trainer": plan.trainer_nodes, "inference": plan.inference_nodes}.get(name, 1)
        if name == "run":
            nodes = 1 + plan.trainer_nodes + plan.inference_nodes
        record_job(plan, name, jobs[name], nodes)
        out.write(f"submitted {name}: job {jobs[name]}\n")
    return jobs


def add_inference(plan: SlurmPlan, nodes: int, dry_run: bool, out: TextIO) -> int:
    """Submit ``nodes`` more inference workers (an array of its own) to the running run."""
    if nodes < 1:
        raise SubmitError(f"--nodes {nodes}: give 1 or more")
    path = plan.slurm_dir / "inference.sbatch"
    if not path.exists():  # a one-job run has no inference script of its own
        path.write_text(role_script(plan, "inference"))
    argv = sbatch_argv(plan, "inference", path, None, array=nodes)
    if dry_run:
        out.write(" ".join(argv) + "\n\n" + path.read_text())
        return 0
    job = sbatch(argv)
    record_job(plan, "inference", job, nodes)
    out.write(f"submitted {nodes} inference worker(s): job {job} (`scancel {job}` takes them out again)\n")
    return 0
