"""`primerl slurm` on a real SLURM cluster (``support.slurm_cluster``: slurmctld, munged and one slurmd per
network-namespace node, Debian's slurm-wlm), with the demo's tiny model: the scenario of ``support.slurm_run`` (the
``jobs`` shape over 4 nodes, the trainer's two ranks on two of them; mid-run a worker added with `primerl slurm
add-inference` serves and is cancelled, and the orchestrator's job step is killed with SIGKILL and its job
requeued), then a short run in the ``one-job`` shape. Each run must finish with every step trained once, its jobs
ending by themselves, and ``run_end.json`` saying so (`primerl status RUN_DIR` reads it). Skipped with one line
where the machine cannot run a cluster (not root, no netns, no slurm-wlm). The broker's node lost (every role
following it to another node) is bench/slurm_run.py's scenario, not this test's: a broker killed right after a
step can come back with an older policy than the trainer resumes from, and the run then stalls (docs/slurm.md,
Limits)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from support.slurm_cluster import SlurmCluster, slurm_available
from support.slurm_run import jobs_scenario, one_job_scenario

pytestmark = pytest.mark.slow

MAX_STEPS = 40


def test_a_run_as_slurm_jobs_grows_loses_a_role_and_finishes(tiny_model: Path, tmp_path: Path) -> None:
    ok, why = slurm_available()
    if not ok:
        pytest.skip(f"no local SLURM cluster here: {why}")
    state = Path(tempfile.mkdtemp(prefix="prl-slurm-"))  # munged wants every directory above its socket searchable
    state.chmod(0o755)
    try:
        with SlurmCluster.create(["n1", "n2", "n3", "n4"], state / "cluster") as cluster:
            report = jobs_scenario(cluster, tiny_model, tmp_path / "run", MAX_STEPS, fault="orchestrator")
            one_job = one_job_scenario(cluster, tiny_model, tmp_path / "one-job", 5)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    print(f"\nslurm run: {report.summary()}; {report.retrained} step(s) trained again after a resume")
    assert report.steps == list(range(1, MAX_STEPS + 1)), f"every step trained once: {report.steps}"
    assert report.retrained <= 2, f"{report.retrained} steps trained again: more than the checkpoint interval"
    assert report.restarts == 1, f"the orchestrator's job was requeued {report.restarts} times"
    assert report.left_at_step < MAX_STEPS, "the run ended before the added worker left: make the run longer"
    assert report.outcome["outcome"] == "finished" and report.outcome["trainer_step"] == MAX_STEPS
    # the one-job shape (fate shared), on the same cluster: the job completes by itself once the trainer is done
    print(f"one-job run: 5 steps in {one_job.total_s:.1f} s, launch -> step 1 {one_job.first_step_s:.1f} s")
    assert one_job.steps == [1, 2, 3, 4, 5], f"every step trained once: {one_job.steps}"
    assert one_job.outcome["job"]["JobState"] == "COMPLETED", one_job.outcome["job"]
    assert one_job.outcome["outcome"] == "finished"
