"""`primerl slurm settle ROLE RUN_DIR --status N [--cancelled 0|1]`: what a role's job does once its step ended.

- cancelled (``scancel``: the batch shell got the stop signal, or SLURM already marks the job cancelled): nothing;
- status 0: done. The trainer's ends the run: it waits (``END_WAIT_S`` at most) for the workers the broker tells to
  stop at the end of the run, writes ``RUN_DIR/run_end.json`` from the broker's last status (`primerl status
  RUN_DIR` then shows the ended run), and cancels what is left of the run's jobs (the broker's, a worker's that
  did not stop);
- status 2 (a configuration or data error, as under `primerl rl`): not requeued, the job fails;
- anything else: ``scontrol requeue`` of this job, unless it was requeued ``requeue_limit`` times already
  (``$SLURM_RESTART_COUNT``): the role comes back as a new run of the same job, and rejoins the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from primerl.slurm.plan import SlurmPlan, read_plan

END_WAIT_S = 40.0  # the broker asks the workers to stop 10 s after the last step (END_OF_RUN_GRACE_S)
CONFIG_ERROR = 2


def say(text: str) -> None:
    print(f"primerl slurm: {text}", flush=True)


def job_state(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=30
    ).stdout
    return next((item.split("=", 1)[1] for item in out.split() if item.startswith("JobState=")), "")


def run_jobs(plan: SlurmPlan) -> list[str]:
    """The run's jobs SLURM still holds (pending or running), by job id (an array once)."""
    out = subprocess.run(
        ["squeue", "--noheader", f"--name={plan.job_name}", "--format=%A"], capture_output=True, text=True, timeout=30
    ).stdout
    return sorted(set(out.split()))


def settle(role: str, run_dir: str, status: int, cancelled: bool) -> int:
    plan = read_plan(run_dir)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if cancelled or (job_id and job_state(job_id) == "CANCELLED"):
        say(f"{role} stopped (the job was cancelled); step status {status}")
        return 0
    if status == 0:
        say(f"{role} ended with status 0")
        if role == "trainer":
            finish_run(plan, job_id)
        return 0
    if status == CONFIG_ERROR:
        say(f"{role} ended with status 2 (a configuration or data error): not requeued; see {run_dir}/logs")
        return status
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if not job_id or restarts >= plan.requeue_limit:
        say(f"{role} ended with status {status}; requeued {restarts} times already (limit {plan.requeue_limit})")
        return status
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        say(f"{role} ended with status {status}; `scontrol requeue {job_id}` failed: {result.stderr.strip()}")
        return status
    say(f"{role} ended with status {status}: job {job_id} requeued ({restarts + 1} of {plan.requeue_limit})")
    return 0


def finish_run(plan: SlurmPlan, own_job: str) -> None:
    """The trainer finished: record how the run ended, then cancel the run's remaining jobs."""
    status = wait_workers_gone(plan)
    try:
        from primerl.runtime.run_outcome import RunEndRecorder

        recorder = RunEndRecorder(plan.run_dir)
        recorder.clear()
        if status is not None:
            recorder.saw(status)
        from primerl.proto.v1 import common_pb2

        workers = status.workers if status is not None else []
        served = [w.policy_version for w in workers if w.role == common_pb2.ROLE_INFERENCE]
        recorder.write(0, min(served) if served else None)
    except Exception as err:  # the record is a convenience: the run itself is over and done
        say(f"note: cannot write run_end.json: {err}")
    others = [job for job in run_jobs(plan) if job != own_job]
    if others:
        subprocess.run(["scancel", *others], timeout=30)
        say(f"run finished: cancelled the run's remaining jobs {', '.join(others)}")


def wait_workers_gone(plan: SlurmPlan):
    """The broker's last status once no inference worker or orchestrator is registered (``END_WAIT_S`` at most);
    None when the broker cannot be asked."""
    from primerl.client.control import ControlClient
    from primerl.proto.v1 import common_pb2, control_pb2
    from primerl.runtime.config_common import BrokerClientConfig
    from primerl.supervisor.run_file import read_run_file

    try:
        run = read_run_file(plan.run_dir)
        config = BrokerClientConfig(address=run.broker_address, run_token=run.run_token, tls_ca_path=run.tls_ca_path)
        client = ControlClient(config, role="client", name="primerl-slurm-settle", rpc_timeout_s=10.0)
    except Exception as err:
        say(f"note: cannot reach the broker for the run's end: {err}")
        return None
    leaving = (common_pb2.ROLE_INFERENCE, common_pb2.ROLE_ORCHESTRATOR)
    deadline, status = time.monotonic() + END_WAIT_S, None
    with client:
        while time.monotonic() < deadline:
            try:
                status = client.get_run_status()
            except Exception:
                break
            if not any(w.role in leaving and w.state == control_pb2.WORKER_STATE_ALIVE for w in status.workers):
                break
            time.sleep(1.0)
    return status


def main(role: str, run_dir: str, status: int, cancelled: bool) -> int:
    try:
        return settle(role, run_dir, status, cancelled)
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        print(f"primerl slurm settle {role}: {err}", file=sys.stderr, flush=True)
        return status or 1
