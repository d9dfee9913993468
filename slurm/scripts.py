"""The batch scripts `primerl slurm` submits, rendered from a ``SlurmPlan``.

Shape ``jobs`` (``role_script``): one job per role. The script runs the role as one job step
(`primerl slurm step ROLE RUN_DIR` on each of its nodes), then hands the step's exit status to `primerl slurm settle`,
which requeues the job when the step failed (``scontrol requeue``; at most ``requeue_limit`` times) and finishes the
run when the trainer is done. A stop signal to the batch shell (``scancel``) is remembered: a cancelled role is
never requeued. Inference is a job array, one element (one worker) per node: each worker is requeued on its own
and `scancel ARRAY_JOB` removes the array's workers.

Shape ``one-job`` (``one_job_script``): prime-rl's fate-sharing. One allocation; the broker and the orchestrator
share its first node, the trainer ranks and the inference workers take the next ones; the first role that ends
with a non-zero status stops every other one and ends the job with that status.
"""

from __future__ import annotations

import shlex

from primerl.slurm.plan import SlurmPlan

STOP_GRACE_S = 15
"""One-job shape: how long the roles may take to stop once one failed or the trainer finished (a trainer rank blocked
in a collective with a rank that died would otherwise wait for its timeout)."""

STEP_LOOP = """\
cancelled=0
trap 'cancelled=1' TERM INT
srun --kill-on-bad-exit=1 --job-name={role} {primerl} slurm step {role} {run_dir} &
step=$!
while :; do wait "$step"; status=$?; kill -0 "$step" 2>/dev/null || break; done
exec {primerl} slurm settle {role} {run_dir} --status "$status" --cancelled "$cancelled"
"""

ONE_JOB_BODY = """\
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
declare -A role_of
start() {{  # ROLE NODE,NODE...: one task per node
  local role=$1 list=$2 count
  count=$(tr ',' '\\n' <<< "$list" | wc -l)
  srun --overlap --kill-on-bad-exit=1 --nodes="$count" --ntasks="$count" --ntasks-per-node=1 --nodelist="$list" \\
    --job-name="$role" {primerl} slurm step "$role" {run_dir} &
  role_of[$!]=$role
}}
join() {{ local IFS=,; echo "$*"; }}
start broker "${{nodes[0]}}"
start orchestrator "${{nodes[0]}}"
start trainer "$(join "${{nodes[@]:1:{trainer_nodes}}}")"
start inference "$(join "${{nodes[@]:{first_inference}:{inference_nodes}}}")"
stop_all() {{  # SIGTERM to every step's tasks; past {stop_grace_s} s the job ends and SLURM kills what is left
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null
  for _ in $(seq {stop_grace_s}); do [ -z "$(jobs -rp)" ] && break; sleep 1; done
}}
trap ':' TERM INT  # scancel: SLURM signals the steps itself; wait for them
while [ "${{#role_of[@]}}" -gt 0 ]; do
  done_pid=
  wait -n -p done_pid "${{!role_of[@]}}"; status=$?
  [ -n "$done_pid" ] || continue  # a stop signal: the steps got it too; wait for them
  role=${{role_of[$done_pid]}}; unset "role_of[$done_pid]"
  if [ "$status" -ne 0 ]; then
    echo "primerl slurm: $role ended with status $status: stopping every role (one-job shape: fate shared)"
    stop_all; exit "$status"
  fi
  if [ "$role" = trainer ]; then
    {primerl} slurm settle trainer {run_dir} --status 0
    stop_all; exit 0
  fi
done
"""


def _header(plan: SlurmPlan, role: str, nodes: int, output: str, gpus: bool) -> list[str]:
    options = [
        f"--job-name={plan.job_name}",
        f"--comment=primerl:{role}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--output={plan.slurm_dir / 'logs' / output}",
        "--open-mode=append",
    ]
    options += [f"--partition={plan.partition}"] if plan.partition else []
    options += [f"--account={plan.account}"] if plan.account else []
    options += [f"--time={plan.time_limit}"] if plan.time_limit else []
    options += [f"--gpus-per-node={plan.gpus_per_node}"] if gpus and plan.gpus_per_node else []
    options += plan.sbatch_args
    return ["#!/bin/bash", *(f"#SBATCH {option}" for option in options)]


def role_script(plan: SlurmPlan, role: str) -> str:
    """The batch script of ``role`` in the ``jobs`` shape (inference: one element of an array, one node each)."""
    nodes = plan.trainer_nodes if role == "trainer" else 1
    output = f"{role}-%A_%a.out" if role == "inference" else f"{role}-%j.out"
    lines = _header(plan, role, nodes, output, gpus=role in ("trainer", "inference"))
    lines += [
        "#SBATCH --requeue",
        f"# primerl {role} of the run in {plan.run_dir}: a failed step requeues this job alone "
        f"(at most {plan.requeue_limit} times).",
    ]
    body = STEP_LOOP.format(role=role, primerl=shlex.quote(plan.command("primerl")), run_dir=_quote(plan))
    return "\n".join(lines) + "\n" + body


def one_job_script(plan: SlurmPlan) -> str:
    """The batch script of the ``one-job`` shape: every role in one allocation, fate shared."""
    nodes = 1 + plan.trainer_nodes + plan.inference_nodes
    lines = _header(plan, "run", nodes, "run-%j.out", gpus=True)
    lines += [
        "#SBATCH --no-requeue",
        f"# primerl run in {plan.run_dir}: broker and orchestrator on the first node, {plan.trainer_nodes} trainer "
        f"node(s), {plan.inference_nodes} inference node(s); the first role to fail ends the job.",
        "set -u",
    ]
    body = ONE_JOB_BODY.format(
        primerl=shlex.quote(plan.command("primerl")),
        run_dir=_quote(plan),
        trainer_nodes=plan.trainer_nodes,
        first_inference=1 + plan.trainer_nodes,
        inference_nodes=plan.inference_nodes,
        stop_grace_s=STOP_GRACE_S,
    )
    return "\n".join(lines) + "\n" + body


def _quote(plan: SlurmPlan) -> str:
    return shlex.quote(plan.run_dir)
