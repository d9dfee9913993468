"""`primerl slurm step ROLE RUN_DIR`: one role's daemon inside a SLURM job step, run by the batch scripts.

The step finds its node's address where SLURM keeps it (``NodeAddr`` of ``scontrol show node``), hands the daemon
the run token (``$PRIMERL_RUN_TOKEN``, from ``RUN_DIR/slurm/token``), its CPU thread budget and the interface its
address is on (``GLOO_SOCKET_IFNAME``), runs it with its log in ``RUN_DIR/logs`` and passes stop signals on:

- ``broker``: bound to the node's address; once ready, writes ``RUN_DIR/run.json`` (the address and the token, as
  `primerl rl` does: `primerl status RUN_DIR` and `primerl dashboard RUN_DIR` read it) and the ports it bound
  (``slurm/broker-endpoints.json``), which a requeued broker on the same node binds again, with the same run id;
- ``trainer``: `torchrun` with one node per task, the c10d rendezvous on the step's first node;
- ``orchestrator``, ``inference``: wait for ``run.json`` and dial the broker it names; a worker serves on its
  node's address.

A role that dials the broker is stopped and started again with the new address when ``run.json`` names another one
(the broker's job requeued onto another node, after a node failure).

The exit status is the daemon's (128 + N when a signal N ended it): the batch script gives it to
`primerl slurm settle`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from primerl.runtime.run_files import LOGS_DIR, RUN_FILE
from primerl.slurm.plan import SlurmPlan, read_plan, read_token

BROKER_READY_S = 120.0
POLL_S = 2.0  # how often a role's step looks whether the broker moved
STOP_S = 30.0  # how long a role may take to stop before it is started again with the broker's new address
ENDPOINTS_FILE = "broker-endpoints.json"
PORT_KEYS = ("grpc_port", "rollout_port", "weight_port")


class StepError(RuntimeError):
    """The step cannot start its role (not in a SLURM step, no broker address in time); the message says why."""


def node_address(node: str) -> str:
    """The address SLURM reaches ``node`` at (``NodeAddr``; the node's name when SLURM has no other)."""
    out = subprocess.run(
        ["scontrol", "show", "node", "--oneliner", node], capture_output=True, text=True, timeout=30
    ).stdout
    for item in out.split():
        if item.startswith("NodeAddr="):
            return item.split("=", 1)[1]
    raise StepError(f"`scontrol show node {node}` names no NodeAddr: is this a SLURM node?")


def step_nodes() -> list[str]:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def interface_of(address: str) -> str | None:
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def role_env(plan: SlurmPlan, role: str, address: str) -> dict[str, str]:
    from primerl.runtime.cpu_budget import available_cpus, default_budgets
    from primerl.runtime.cpu_budget import role_env as budget_env

    env = {**os.environ, "PRIMERL_RUN_TOKEN": read_token(plan.run_dir), "PYTHONUNBUFFERED": "1"}
    budgets = default_budgets(available_cpus(), gpus=plan.gpus_per_node > 0, num_trainer_ranks=plan.ranks_per_node)
    env.update(budget_env(role, budgets[role]))
    ifname = interface_of(address)
    if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def run_child(argv: list[str], env: dict[str, str], log_path: Path, on_start=None, restart_when=None) -> int | None:
    """Run ``argv`` with its output appended to ``log_path``; SIGTERM, SIGINT and SIGHUP are passed on. Returns
    its exit status (128 + N for a signal N). ``on_start(process)`` runs once it started (the broker's step);
    ``restart_when()``, asked every ``POLL_S``, stops it (SIGTERM, SIGKILL past ``STOP_S``) and returns None."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        child = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda sig, _frame: child.poll() is None and child.send_signal(sig))
    if on_start is not None:
        on_start(child)
    while True:
        try:
            code = child.wait(POLL_S)
            return 128 - code if code < 0 else code
        except subprocess.TimeoutExpired:
            if restart_when is None or not restart_when():
                continue
        child.terminate()
        try:
            child.wait(STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        return None


def current_broker(run_dir: str | Path) -> str | None:
    """The broker address ``RUN_DIR/run.json`` names, or None while there is none."""
    try:
        return json.loads((Path(run_dir) / RUN_FILE).read_text())["broker_address"]
    except (OSError, ValueError, KeyError):
        return None


def wait_for_broker(plan: SlurmPlan) -> str:
    deadline = time.monotonic() + plan.broker_wait_s
    while (broker := current_broker(plan.run_dir)) is None:
        if time.monotonic() > deadline:
            raise StepError(
                f"no broker address in {Path(plan.run_dir) / RUN_FILE} after {plan.broker_wait_s:g} s: is the broker "
                "job running?"
            )
        time.sleep(1.0)
    return broker


def broker_argv(plan: SlurmPlan, node: str, address: str, ready: Path) -> list[str]:
    ports = {key: plan.broker_ports.get(key, 0) for key in PORT_KEYS}
    pinned: dict = {}
    try:
        pinned = json.loads((plan.slurm_dir / ENDPOINTS_FILE).read_text())
    except (OSError, ValueError):
        pass
    if pinned.get("node") == node:  # requeued on the node it ran on: the same ports
        ports.update({key: int(pinned[key]) for key in PORT_KEYS if pinned.get(key)})
    argv = [plan.command("primerl-broker"), "@", str(Path(plan.run_dir) / "broker.toml"), "--host", address]
    for key, port in ports.items():
        argv += [f"--{key.replace('_', '-')}", str(port)]
    if pinned.get("run_id"):
        argv += ["--run-id", str(pinned["run_id"])]
    return argv + ["--ready-file", str(ready)]


def publish_broker(plan: SlurmPlan, node: str, address: str, ready: Path, child: subprocess.Popen) -> None:
    """Once the broker wrote its ready file: its ports for a requeue, and ``run.json`` for everyone else."""
    from primerl.configs.trainer import TrainerConfig
    from primerl.runtime.config_loader import load_config
    from primerl.supervisor.broker_links import run_file
    from primerl.supervisor.run_file import write_run_file

    deadline = time.monotonic() + BROKER_READY_S
    while not ready.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            return  # its exit status tells the batch script
        time.sleep(0.2)
    endpoints = json.loads(ready.read_text())
    pinned = {key: endpoints.get(key) for key in (*PORT_KEYS, "run_id")}
    (plan.slurm_dir / ENDPOINTS_FILE).write_text(json.dumps({"node": node, **pinned}) + "\n")
    trainer = load_config(TrainerConfig, [Path(plan.run_dir) / "trainer.toml"], {})
    record = run_file(f"{address}:{endpoints['grpc_port']}", read_token(plan.run_dir), pinned["run_id"], trainer.broker)
    write_run_file(Path(plan.run_dir), replace(record, launcher_pid=None))
    print(f"primerl slurm: broker on {node} at {address}:{endpoints['grpc_port']}", flush=True)


def trainer_argv(plan: SlurmPlan, address: str, broker: str) -> list[str]:
    nodes = step_nodes()
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    first = node_address(nodes[0]) if nodes else address
    job = os.environ.get("SLURM_JOB_ID", "0")
    return [
        plan.command("torchrun"),
        f"--nnodes={len(nodes) or 1}",
        f"--nproc-per-node={plan.ranks_per_node}",
        f"--node-rank={rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={first}:{plan.rdzv_port}",
        f"--rdzv-id={plan.job_name}-{job}",
        f"--rdzv-conf=is_host={str(rank == 0).lower()}",
        f"--local-addr={address}",
        "--max-restarts=0",
        plan.command("primerl-trainer"),
        "@",
        str(Path(plan.run_dir) / "trainer.toml"),
        "--broker.address",
        broker,
    ]


def run_step(role: str, run_dir: str) -> int:
    plan = read_plan(run_dir)
    node = os.environ.get("SLURMD_NODENAME")
    if not node:
        raise StepError("not inside a SLURM job step ($SLURMD_NODENAME unset): the batch scripts run this")
    address = node_address(node)
    env = role_env(plan, role, address)
    logs = Path(plan.run_dir) / LOGS_DIR
    if role == "broker":
        ready = plan.slurm_dir / "broker-ready.json"
        ready.unlink(missing_ok=True)
        argv = broker_argv(plan, node, address, ready)
        return run_child(argv, env, logs / "broker.log", lambda c: publish_broker(plan, node, address, ready, c))
    broker = wait_for_broker(plan)
    while True:  # a broker requeued onto another node has a new address: start again with it
        argv, log = client_argv(plan, role, node, address, broker)
        print(f"primerl slurm: {role} on {node} ({address}), broker {broker}", flush=True)
        code = run_child(argv, env, logs / log, restart_when=lambda: current_broker(plan.run_dir) not in (None, broker))
        if code is not None:
            return code
        broker = current_broker(plan.run_dir) or broker
        print(f"primerl slurm: the broker moved to {broker}: starting {role} again", flush=True)


def client_argv(plan: SlurmPlan, role: str, node: str, address: str, broker: str) -> tuple[list[str], str]:
    """The command of a role that dials the broker at ``broker``, and its log's name."""
    config = str(Path(plan.run_dir) / f"{role}.toml")
    if role == "trainer":
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        return trainer_argv(plan, address, broker), "trainer.log" if rank == 0 else f"trainer-{node}.log"
    if role == "inference":
        job = os.environ.get("SLURM_JOB_ID", "0")  # an array element's own id: two workers may share a node
        argv = [plan.command("primerl-infer"), "@", config, "--broker.address", broker, "--server.host", address]
        return argv, f"inference-{node}-{job}.log"
    return [plan.command(f"primerl-{role}"), "@", config, "--broker.address", broker], f"{role}.log"


def main(role: str, run_dir: str) -> int:
    try:
        return run_step(role, run_dir)
    except (StepError, OSError, ValueError) as err:
        print(f"primerl slurm step {role}: {err}", file=sys.stderr, flush=True)
        return 1
