"""One RL run over several hosts (``support.netns``): the scenario of tests/test_multihost.py and
scripts/multihost_demo.py (`make multihost`).

Layout: host ``a`` runs `primerl-broker` (bound to a's address, with a run token) and `primerl-orchestrator`;
``b`` and ``c`` one trainer rank each under `torchrun --nnodes=2` (c10d rendezvous on b); ``d`` and ``e`` one
`primerl-infer` each; ``f`` a third worker that joins after ``d`` was stopped (SIGTERM) mid-run; ``g`` runs
`primerl status`. Each daemon reads its own config files: the role config `primerl rl --dry-run --write` makes
from examples/reverse_text_rl.toml (shortened: ``RUN_OVERRIDES``) and a host file with the addresses
(``{role}-{host}.toml``). The run token reaches every process in ``$PRIMERL_RUN_TOKEN`` only.

``MultihostRun.run()`` returns a ``Report``; ``Report.problems()`` lists what the run got wrong (empty: passed).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from .netns import Host, Hosts

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
BIN = Path(sys.executable).parent
HOST_NAMES = ["a", "b", "c", "d", "e", "f", "g"]
RUN_OVERRIDES = ["--orchestrator.batch-size", "16", "--orchestrator.rollouts-per-example", "4",
                 "--orchestrator.sampling.max-tokens", "12", "--seq-len", "128", "--trainer.ckpt.interval", "100",
                 "--log.format", "json"]
BROKER_READY_S = 60.0
INFER_READY_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Proc:
    """One process started on a host, its output in ``log``; stopped with SIGTERM (then SIGKILL, its
    descendants too: torchrun's ranks run in sessions of their own)."""

    def __init__(self, label: str, host: Host, argv: list, env: dict[str, str], log: Path, cwd: Path):
        self.label, self.host, self.log = label, host, log
        self.started_s = time.monotonic()
        with open(log, "w") as out:
            self.popen = subprocess.Popen(host.argv(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                          start_new_session=True)

    def poll(self) -> int | None:
        return self.popen.poll()

    def tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def events(self, name: str | None = None) -> list[dict]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if name is None or event.get("event") == name:
                    found.append(event)
        return found

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.popen.poll() is None:
            try:
                family = psutil.Process(self.popen.pid).children(recursive=True)
            except psutil.Error:
                family = []
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
            for child in family:
                try:
                    child.kill()
                except psutil.Error:
                    pass
        return self.popen.returncode


@dataclass
class Report:
    hosts: str = ""
    roles: dict[str, str] = field(default_factory=dict)  # label -> address
    max_steps: int = 0
    steps_done: list[int] = field(default_factory=list)  # rank 0's "step done" steps, in order
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    broker_status: dict = field(default_factory=dict)  # the test process's last RunStatus (JSON)
    g_status: dict = field(default_factory=dict)  # `primerl status --json` run on host g
    g_status_text: str = ""
    workers_left: list[str] = field(default_factory=list)
    workers_joined: list[str] = field(default_factory=list)
    stopped_at_step: int = 0
    joined_ready_at_step: int = 0
    join_ready_s: float = 0.0  # start of the joining worker's process -> its ready file
    join_serving_s: float = 0.0  # its ready file -> it serves the policy version current then
    rescheduled_events: int = 0
    rescheduled_rollouts: float = 0.0  # the orchestrator's rollout/rescheduled, summed over its metric rows
    metrics: dict[str, dict] = field(default_factory=dict)  # label -> the worker's scraped metrics
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        found = list(self.errors)
        want = list(range(1, self.max_steps + 1))
        if self.steps_done != want:
            found.append(f"the trainer's steps were {self.steps_done}, want each of {want} once")
        for label, code in self.exit_codes.items():
            if code not in (0, None):
                found.append(f"{label} exited {code}")
        status = self.g_status
        if int(status.get("last_committed_step", 0)) != self.max_steps:
            found.append(f"broker: last committed step {status.get('last_committed_step')} != {self.max_steps}")
        if int(status.get("latest_policy_version", 0)) != self.max_steps:
            found.append(f"broker: latest policy version {status.get('latest_policy_version')} != {self.max_steps}")
        infer = {w.get("address"): w for w in status.get("workers", []) if w.get("role") == "ROLE_INFERENCE"}
        for url in self.workers_left:
            state = infer.get(url, {}).get("state", "absent")
            if state == "WORKER_STATE_ALIVE":
                found.append(f"primerl status lists the stopped worker {url} as alive")
        for url, worker in infer.items():
            if worker.get("state") == "WORKER_STATE_ALIVE" and int(worker.get("policy_version", -1)) != self.max_steps:
                found.append(f"worker {url} serves v{worker.get('policy_version')}, not the final v{self.max_steps}")
        for label, values in self.metrics.items():
            if values.get("policy_version") != self.max_steps:
                found.append(f"{label}: primerl_inference_policy_version {values.get('policy_version')}")
        for url in self.workers_joined + [u for u in self.roles.values() if u.startswith("http") and
                                          u not in self.workers_left]:
            if infer.get(url, {}).get("state") != "WORKER_STATE_ALIVE":
                found.append(f"primerl status does not list {url} as alive: {infer.get(url, {}).get('state')}")
        if self.rescheduled_rollouts != self.rescheduled_events * self.rollouts_per_example:
            found.append(f"rollout/rescheduled {self.rescheduled_rollouts} != {self.rescheduled_events} rescheduled "
                         f"groups x {self.rollouts_per_example}")
        return found

    rollouts_per_example: int = 4

    def summary(self) -> str:
        roles = "\n".join(f"  {label:<22} {address}" for label, address in self.roles.items())
        return (f"{self.hosts}\nroles:\n{roles}\n"
                f"steps completed: {len(self.steps_done)} of {self.max_steps} ({self.steps_done})\n"
                f"workers left: {self.workers_left} (SIGTERM after step {self.stopped_at_step})\n"
                f"workers joined: {self.workers_joined} (ready {self.join_ready_s:.1f} s after its start, at step "
                f"{self.joined_ready_at_step}; serving the current version {self.join_serving_s:.1f} s after ready)\n"
                f"live workers' metrics: {self.metrics}\n"
                f"rollouts retried: {self.rescheduled_rollouts:g} ({self.rescheduled_events} groups rescheduled)\n"
                f"wall time: {self.wall_s:.0f} s\n"
                f"primerl status on host g:\n{self.g_status_text}")


class MultihostRun:
    """The scenario (module docstring) in ``run_dir`` on ``hosts`` with the model at ``model``."""

    def __init__(self, hosts: Hosts, run_dir: Path, model: Path, max_steps: int = 10, stop_at_step: int = 3,
                 timeout_s: float = 600.0, extra_role_files: dict[str, list[Path]] | None = None,
                 extra_env: dict[str, str] | None = None, say: Callable[[str], None] = print):
        self.hosts, self.run_dir, self.model = hosts, run_dir, model
        self.max_steps, self.stop_at_step, self.timeout_s = max_steps, stop_at_step, timeout_s
        self.extra_role_files = extra_role_files or {}
        self.extra_env = extra_env or {}
        self.say = say
        self.token = secrets.token_urlsafe(24)
        self.ports = {"grpc": free_port(), "rollout": free_port(), "weight": free_port(), "rdzv": free_port()}
        self.procs: dict[str, Proc] = {}
        self.report = Report(hosts=hosts.describe(), max_steps=max_steps)
        self.broker_address = hosts["a"].endpoint(self.ports["grpc"])

    # -------------------------------------------------------------------------------------------- configs
    def write_configs(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        subprocess.run([str(BIN / "primerl"), "rl", "@", str(EXAMPLE), "--model.name", str(self.model),
                        "--output-dir", str(self.run_dir), "--max-steps", str(self.max_steps),
                        "--trainer-gpu-ids", "[1,2]", *RUN_OVERRIDES, "--dry-run", "--write", str(self.run_dir)],
                       check=True, timeout=120, stdout=subprocess.DEVNULL, env=self.env())
        a = self.hosts["a"]
        self._write("broker-a.toml", f'host = "{a.address}"\ngrpc_port = {self.ports["grpc"]}\n'
                                     f'rollout_port = {self.ports["rollout"]}\nweight_port = {self.ports["weight"]}\n'
                                     f'heartbeat_interval_s = 0.5\n')
        client = f'[broker]\naddress = "{self.broker_address}"\n'
        self._write("orchestrator-a.toml", client)
        for name in ("b", "c"):
            self._write(f"trainer-{name}.toml", client)
        for name in ("d", "e", "f"):
            self._write(f"inference-{name}.toml", client + f'\n[server]\nhost = "{self.hosts[name].address}"\n')

    def _write(self, name: str, text: str) -> None:
        (self.run_dir / name).write_text(text)

    def config_args(self, role: str, host: str) -> list[str]:
        files = [self.run_dir / f"{role}.toml", self.run_dir / f"{role}-{host}.toml",
                 *self.extra_role_files.get(role, [])]
        return [arg for path in files for arg in ("@", str(path))]

    def env(self, role: str | None = None, host: Host | None = None) -> dict[str, str]:
        from primerl.runtime.cpu_budget import available_cpus, default_budgets, role_env

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1", **self.extra_env}
        env.pop("PRIMERL_RUN_TOKEN", None)
        env.setdefault("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
        if role is not None:
            env["PRIMERL_RUN_TOKEN"] = self.token
            budgets = default_budgets(available_cpus(), gpus=False, num_trainer_ranks=2)
            env.update(role_env(role, budgets[role]))
        if host is not None:
            env["GLOO_SOCKET_IFNAME"] = host.ifname
        return env

    # -------------------------------------------------------------------------------------------- starting
    def start(self, label: str, role: str, host_name: str, argv: list) -> Proc:
        host = self.hosts[host_name]
        proc = Proc(label, host, argv, self.env(role, host), self.run_dir / "logs" / f"{label}.log", self.run_dir)
        self.procs[label] = proc
        return proc

    def start_broker(self) -> None:
        ready = self.run_dir / "broker-ready.json"
        proc = self.start("broker@a", "broker", "a", [BIN / "primerl-broker", *self.config_args("broker", "a"),
                                                      "--ready-file", ready])
        self._wait_file(ready, proc, BROKER_READY_S)
        self.report.roles["broker@a (gRPC)"] = self.broker_address

    def start_inference(self, name: str) -> Proc:
        ready = self.run_dir / f"infer-{name}-ready.json"
        ready.unlink(missing_ok=True)
        proc = self.start(f"infer@{name}", "inference", name,
                          [BIN / "primerl-infer", *self.config_args("inference", name), "--ready-file", ready])
        proc.ready_file = ready  # type: ignore[attr-defined]
        return proc

    def wait_inference(self, proc: Proc) -> str:
        info = self._wait_file(proc.ready_file, proc, INFER_READY_S)  # type: ignore[attr-defined]
        self.report.roles[proc.label] = info["base_url"]
        return info["base_url"]

    def start_trainer_rank(self, name: str, is_host: bool) -> Proc:
        b = self.hosts["b"]
        argv = [BIN / "torchrun", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={0 if is_host else 1}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={b.endpoint(self.ports['rdzv'])}",
                f"--rdzv-id=multihost-{self.token[:8]}", f"--rdzv-conf=is_host={str(is_host).lower()}",
                f"--local-addr={self.hosts[name].address}", "--max-restarts=0",
                BIN / "primerl-trainer", *self.config_args("trainer", name)]
        self.report.roles[f"trainer@{name}"] = self.hosts[name].address + (
            f" (rendezvous {b.endpoint(self.ports['rdzv'])})" if is_host else "")
        return self.start(f"trainer@{name}", "trainer", name, argv)

    def _wait_file(self, path: Path, proc: Proc, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.label} did not become ready (exit {proc.poll()}):\n{proc.tail()}")
            time.sleep(0.2)

    # -------------------------------------------------------------------------------------------- watching
    def client(self):
        from primerl.client.control import ControlClient
        from primerl.runtime.config_common import BrokerClientConfig

        config = BrokerClientConfig(address=self.broker_address, run_token=self.token, connect_timeout_s=10.0)
        return ControlClient(config, role="client", name="multihost-test", rpc_timeout_s=10.0)

    def status(self, client) -> dict:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(client.get_run_status(), preserving_proto_field_name=True)

    def _check_alive(self, labels: list[str]) -> None:
        for label in labels:
            code = self.procs[label].poll()
            if code is not None:
                raise RuntimeError(f"{label} exited {code} mid-run:\n{self.procs[label].tail()}")

    def wait_until(self, client, what: str, predicate: Callable[[dict], bool], alive: list[str],
                   deadline: float) -> dict:
        while True:
            try:
                status = self.status(client)
            except Exception as err:  # the broker not answering for a moment: the deadline bounds it
                status = {"error": str(err)}
            if "error" not in status and predicate(status):
                return status
            self._check_alive(alive)
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; last status {json.dumps(status)[:1500]}")
            time.sleep(0.5)

    # -------------------------------------------------------------------------------------------- the run
    def run(self) -> Report:
        start_s = time.monotonic()
        deadline = start_s + self.timeout_s
        report = self.report
        try:
            self.write_configs()
            self.start_broker()
            self.say(f"broker up at {self.broker_address}")
            d, e = self.start_inference("d"), self.start_inference("e")
            self.start_trainer_rank("b", True)
            self.start_trainer_rank("c", False)
            url_d, url_e = self.wait_inference(d), self.wait_inference(e)
            self.say(f"inference up: {url_d}, {url_e}")
            orch = self.start("orchestrator@a", "orchestrator", "a",
                              [BIN / "primerl-orchestrator", *self.config_args("orchestrator", "a")])
            report.roles["orchestrator@a"] = self.hosts["a"].address
            running = ["broker@a", "infer@d", "infer@e", "trainer@b", "trainer@c", "orchestrator@a"]
            with self.client() as client:
                self.wait_until(client, f"trainer step {self.stop_at_step}",
                                lambda s: int(s.get("trainer_step", 0)) >= self.stop_at_step, running, deadline)
                report.stopped_at_step = int(self.status(client).get("trainer_step", 0))
                self.say(f"step {report.stopped_at_step}: stopping {url_d} (SIGTERM)")
                report.exit_codes["infer@d (SIGTERM)"] = d.stop()
                report.workers_left.append(url_d)
                running.remove("infer@d")
                f = self.start_inference("f")
                url_f = self.wait_inference(f)
                report.join_ready_s = time.monotonic() - f.started_s
                report.workers_joined.append(url_f)
                running.append("infer@f")
                ready_s = time.monotonic()
                status = self.status(client)
                report.joined_ready_at_step = int(status.get("trainer_step", 0))
                current = int(status.get("latest_policy_version", 0))
                self.say(f"{url_f} joined at step {report.joined_ready_at_step} (v{current})")
                self.wait_until(client, f"{url_f} serving v{current}",
                                lambda s: any(w.get("address") == url_f and int(w.get("policy_version", -1))
                                              >= current for w in s.get("workers", [])), running, deadline)
                report.join_serving_s = time.monotonic() - ready_s
                trainers = [self.procs["trainer@b"], self.procs["trainer@c"]]
                while any(t.poll() is None for t in trainers):
                    self._check_alive([r for r in running if not r.startswith("trainer@")])
                    if time.monotonic() > deadline:
                        raise RuntimeError("timed out waiting for the trainer to finish")
                    time.sleep(0.5)
                for t in trainers:
                    report.exit_codes[t.label] = t.poll()
                n = self.max_steps
                report.broker_status = self.wait_until(
                    client, f"every live worker serving v{n}",
                    lambda s: int(s.get("latest_policy_version", 0)) >= n and all(
                        int(w.get("policy_version", -1)) == n for w in s.get("workers", [])
                        if w.get("role") == "ROLE_INFERENCE" and w.get("state") == "WORKER_STATE_ALIVE"),
                    ["broker@a", "infer@e", "infer@f"], deadline)
            self.status_from_g()
            self.scrape_inference()
            report.exit_codes["orchestrator@a"] = orch.stop(60)
            self.collect()
        except Exception as err:
            report.errors.append(f"{type(err).__name__}: {err}")
        finally:
            self.stop_all()
            report.wall_s = time.monotonic() - start_s
        return report

    def status_from_g(self) -> None:
        g = self.hosts["g"]
        argv = [BIN / "primerl", "status", "--broker", self.broker_address, "--timeout-s", "10"]
        env = {**self.env(), "PRIMERL_RUN_TOKEN": self.token}
        text = subprocess.run(g.argv(argv), capture_output=True, text=True, timeout=120, env=env)
        as_json = subprocess.run(g.argv([*argv, "--json"]), capture_output=True, text=True, timeout=120, env=env)
        self.report.g_status_text = text.stdout or text.stderr
        self.report.roles["primerl status@g"] = g.address
        if as_json.returncode != 0:
            raise RuntimeError(f"primerl status on host g exited {as_json.returncode}: {as_json.stderr[-1000:]}")
        self.report.g_status = json.loads(as_json.stdout)

    def collect(self) -> None:
        report = self.report
        rank0 = [p for p in (self.procs["trainer@b"], self.procs["trainer@c"]) if p.events("step done")]
        report.steps_done = [int(e["step"]) for p in rank0 for e in p.events("step done")]
        orch = self.procs["orchestrator@a"]
        report.rescheduled_events = len(orch.events("rollout group rescheduled"))
        rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()
                if line.strip()] if (self.run_dir / "metrics.jsonl").exists() else []
        report.rescheduled_rollouts = sum(float(r.get("rollout/rescheduled", 0.0)) for r in rows)

    def scrape_inference(self) -> None:
        """Each live worker's Prometheus metrics (from this process, over the hosts' network): the policy
        version it serves (``primerl_inference_policy_version``) and the requests it answered (vLLM's)."""
        import httpx

        for label in ("infer@e", "infer@f"):
            url = self.report.roles.get(label)
            if not url:
                continue
            text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {self.token}"}, timeout=30).text
            values = {"policy_version": None, "requests": 0.0}
            for line in text.splitlines():
                if line.startswith("primerl_inference_policy_version"):
                    values["policy_version"] = float(line.split()[-1])
                elif line.startswith("vllm:request_success_total"):
                    values["requests"] += float(line.split()[-1])
            self.report.metrics[label] = values

    def stop_all(self) -> None:
        for label in ("orchestrator@a", "trainer@b", "trainer@c", "infer@d", "infer@e", "infer@f", "broker@a"):
            if label in self.procs:
                code = self.procs[label].stop(60)
                self.report.exit_codes.setdefault(label, code)
