"""The local SLURM cluster of ``support.slurm_cluster`` (real slurmctld, slurmd and munged; one node per network
namespace): a step runs on every node under the node's own name, a batch job sees its node's name and address, a
requeued job runs again, and scancel delivers SIGTERM to the batch script. Prints the timings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NODES = ["n1", "n2", "n3"]
TIMEOUT_S = 30.0


# one test on one cluster (the checks below run in order), so that a machine that cannot run it skips with one line
def test_a_local_slurm_cluster_runs_steps_and_batch_jobs_requeues_and_cancels(tmp_path: Path):
    from support.slurm_cluster import SlurmCluster, slurm_available

    ok, why = slurm_available()
    if not ok:
        pytest.skip(f"no local SLURM cluster: {why}")
    started = time.monotonic()
    with SlurmCluster.create(NODES, tmp_path / "slurm") as cluster:
        print(f"\ncluster of {len(NODES)} nodes up in {time.monotonic() - started:.2f} s")
        for check in (
            a_step_runs_on_every_node_under_its_own_name,
            a_batch_job_runs_on_a_node_with_its_name_and_address,
            a_requeued_job_runs_again,
            scancel_delivers_sigterm_to_the_batch_script,
        ):
            work = tmp_path / check.__name__
            work.mkdir()
            check(cluster, work)


def wait_for(path: Path, timeout_s: float = TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} not written within {timeout_s:.0f} s"
        time.sleep(0.05)
    return path.read_text()


def a_step_runs_on_every_node_under_its_own_name(cluster, tmp_path: Path):
    started = time.monotonic()
    names = cluster.run("srun", "-N3", "hostname").split()
    print(f"srun -N3 hostname: {time.monotonic() - started:.2f} s")
    assert sorted(names) == NODES


def a_batch_job_runs_on_a_node_with_its_name_and_address(cluster, tmp_path: Path):
    # the address this node's traffic to the controller leaves from (no name service knows the node names)
    probe = (
        "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
        f"s.connect(('{cluster.hosts.gateway}', 9)); print(s.getsockname()[0])"
    )
    out = tmp_path / "job.out"
    started = time.monotonic()
    job_id = cluster.sbatch("--wrap", f'hostname; python3 -c "{probe}"', "-o", out)
    info = cluster.wait_job_state(job_id, {"COMPLETED", "FAILED"}, TIMEOUT_S)
    print(f"sbatch --wrap to completed: {time.monotonic() - started:.2f} s")
    assert info["JobState"] == "COMPLETED", out.read_text()
    node = info["NodeList"]
    assert out.read_text().split() == [node, cluster.nodes[node].address]


def a_requeued_job_runs_again(cluster, tmp_path: Path):
    starts = tmp_path / "starts.txt"
    submitted = time.monotonic()
    job_id = cluster.sbatch(
        "--wrap", f"echo start ${{SLURM_RESTART_COUNT:-0}} >> {starts}; sleep 300", "-o", "/dev/null"
    )
    cluster.wait_job_state(job_id, {"RUNNING"}, TIMEOUT_S)
    wait_for(starts)
    running = time.monotonic()
    cluster.scontrol("requeue", str(job_id))
    pending = cluster.wait_job_state(job_id, {"PENDING"}, TIMEOUT_S)
    again = cluster.wait_job_state(job_id, {"RUNNING"}, TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while len(starts.read_text().splitlines()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(
        f"sbatch to running: {running - submitted:.2f} s; requeue to running again: "
        f"{time.monotonic() - running:.2f} s (pending with reason {pending.get('Reason')})"
    )
    cluster.run("scancel", str(job_id))
    assert again["Restarts"] == "1"
    assert starts.read_text().splitlines() == ["start 0", "start 1"]


def scancel_delivers_sigterm_to_the_batch_script(cluster, tmp_path: Path):
    ready, termed = tmp_path / "ready", tmp_path / "termed"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ntrap 'date +%s.%N > {termed}; exit 0' TERM\necho up > {ready}\nsleep 300 & wait\n")
    job_id = cluster.sbatch("-o", "/dev/null", script)
    wait_for(ready)
    cancelled_at = time.time()
    cluster.run("scancel", str(job_id))
    delivered_at = float(wait_for(termed, TIMEOUT_S))
    info = cluster.wait_job_state(job_id, {"CANCELLED", "COMPLETED"}, TIMEOUT_S)
    print(f"scancel to SIGTERM in the batch script: {delivered_at - cancelled_at:.3f} s")
    assert info["JobState"] == "CANCELLED"
