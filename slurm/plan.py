"""What `primerl slurm` decided for a run, kept in ``RUN_DIR/slurm/plan.json`` for the job steps and for
`primerl slurm add-inference` to read back: the shape, how many nodes each role gets, the sbatch options, where the
commands live and the ports that must be fixed before any node is known (the trainer's rendezvous).

The run token is not in it: ``RUN_DIR/slurm/token`` holds it (mode 0600, like ``run.json``), and the job steps
hand it to the daemons in ``$PRIMERL_RUN_TOKEN`` only.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from primerl.runtime.durable_files import write_atomically, write_private_atomically

SLURM_DIR = "slurm"
PLAN_FILE = "plan.json"
TOKEN_FILE = "token"
JOBS_FILE = "jobs.jsonl"
"""One line per `sbatch`: ``{"role": ..., "job_id": ..., "nodes": ...}`` (`primerl slurm` and `add-inference`)."""
SHAPES = ("jobs", "one-job")
"""``jobs``: every role a job of its own, requeued alone when it fails (inference: one array element per node);
``one-job``: one allocation whose roles share their fate (prime-rl's: the first role to fail ends the job)."""
ROLES = ("broker", "trainer", "orchestrator", "inference")
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class PlanError(ValueError):
    """A `primerl slurm` option or a run directory that cannot make a plan; the message says what to change."""


@dataclass
class SlurmPlan:
    run_dir: str  # absolute: the jobs run from anywhere on the shared file system
    job_name: str  # every job of the run carries it: `scancel --name JOB_NAME` stops the run
    shape: str = "jobs"
    trainer_nodes: int = 1
    inference_nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU only (one trainer rank per node)
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    requeue_limit: int = 3  # per job (also bounded by the cluster's MaxBatchRequeue)
    sbatch_args: list[str] = field(default_factory=list)
    bin_dir: str = field(default_factory=lambda: str(Path(sys.executable).parent))
    rdzv_port: int = 0  # the trainer's c10d rendezvous on its first node
    broker_ports: dict[str, int] = field(default_factory=dict)  # 0: a free port at the broker's first start
    broker_wait_s: float = 600.0  # how long a role's step waits for the broker's address

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise PlanError(f"--shape {self.shape!r}: use one of {', '.join(SHAPES)}")
        for name in ("trainer_nodes", "inference_nodes"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} {getattr(self, name)}: give 1 or more nodes")
        if self.gpus_per_node < 0 or self.requeue_limit < 0:
            raise PlanError("--gpus-per-node and --requeue-limit must be 0 or more")
        if not JOB_NAME_RE.match(self.job_name):
            raise PlanError(f"--job-name {self.job_name!r}: use 1-64 letters, digits, '.', '_' or '-'")
        if not self.rdzv_port:
            self.rdzv_port = random.randint(20000, 29999)

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.trainer_nodes * self.ranks_per_node

    @property
    def slurm_dir(self) -> Path:
        return Path(self.run_dir) / SLURM_DIR

    def command(self, name: str) -> str:
        return str(Path(self.bin_dir) / name)


def write_plan(plan: SlurmPlan, token: str) -> Path:
    plan.slurm_dir.mkdir(parents=True, exist_ok=True)
    (plan.slurm_dir / "logs").mkdir(exist_ok=True)
    write_private_atomically(plan.slurm_dir / TOKEN_FILE, token.encode())
    path = plan.slurm_dir / PLAN_FILE
    write_atomically(path, [(json.dumps(asdict(plan), indent=2) + "\n").encode()])
    return path


def read_plan(run_dir: str | Path) -> SlurmPlan:
    path = Path(run_dir) / SLURM_DIR / PLAN_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path} does not exist: give the run directory of a `primerl slurm` run") from None
    except (OSError, ValueError) as err:
        raise PlanError(f"{path} is unreadable ({err}): submit the run again with `primerl slurm`") from None
    known = {f.name for f in fields(SlurmPlan)}
    return SlurmPlan(**{key: value for key, value in data.items() if key in known})


def read_token(run_dir: str | Path) -> str:
    return (Path(run_dir) / SLURM_DIR / TOKEN_FILE).read_text().strip()


def record_job(plan: SlurmPlan, role: str, job_id: str, nodes: int) -> None:
    """Append one submitted job to ``jobs.jsonl`` (a line is whole or absent: one write of a short line)."""
    line = json.dumps({"role": role, "job_id": job_id, "nodes": nodes}) + "\n"
    with open(plan.slurm_dir / JOBS_FILE, "a") as out:
        out.write(line)


def read_jobs(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / SLURM_DIR / JOBS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
