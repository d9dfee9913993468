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
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from primerl.proto import telemetry

from .multihost_report import (
    BATCH_SIZE,
    ROLLOUTS_PER_EXAMPLE,
    Report,
    num_alive_inference,
    parse_ts,
    served,
)
from .netns import Host, Hosts, Proc

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
BIN = Path(sys.executable).parent
HOST_NAMES = ["a", "b", "c", "d", "e", "f", "g"]
RUN_OVERRIDES = [
    "--orchestrator.batch-size",
    str(BATCH_SIZE),
    "--orchestrator.rollouts-per-example",
    str(ROLLOUTS_PER_EXAMPLE),
    "--orchestrator.sampling.max-tokens",
    "24",
    "--trainer.ckpt.interval",
    "100",
    "--log.format",
    "json",
]
"""The example's batch (8 prompts x 8 rollouts of at most 24 tokens): a step takes a few seconds here, so that the
run is still going when the joining worker is up (~15-40 s after its start)."""
BROKER_READY_S = 60.0
INFER_READY_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MultihostRun:
    """The scenario (module docstring) in ``run_dir`` on ``hosts`` with the model at ``model``."""

    def __init__(
        self,
        hosts: Hosts,
        run_dir: Path,
        model: Path,
        max_steps: int = 40,
        stop_at_step: int = 1,
        timeout_s: float = 600.0,
        encrypted: bool = False,
        stop_signal: str = "TERM",
        extra_env: dict[str, str] | None = None,
        say: Callable[[str], None] = print,
    ):
        self.hosts, self.run_dir, self.model = hosts, run_dir, model
        self.max_steps, self.stop_at_step, self.timeout_s = max_steps, stop_at_step, timeout_s
        self.encrypted = encrypted
        self.stop_signal = stop_signal  # TERM: a clean stop of host d's worker; KILL: it vanishes mid-request
        self.extra_env = extra_env or {}
        self.say = say
        self.token = secrets.token_urlsafe(24)
        self.ports = {"grpc": free_port(), "rollout": free_port(), "weight": free_port(), "rdzv": free_port()}
        self.procs: dict[str, Proc] = {}
        self.report = Report(
            hosts=hosts.describe()
            + ("\nwire: mutual TLS (gRPC) + CURVE (ZeroMQ)" if encrypted else "\nwire: plain (run token only)"),
            max_steps=max_steps,
        )
        self.broker_address = hosts["a"].endpoint(self.ports["grpc"])

    # -------------------------------------------------------------------------------------------- configs
    def write_configs(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        subprocess.run(
            [
                str(BIN / "primerl"),
                "rl",
                "@",
                str(EXAMPLE),
                "--model.name",
                str(self.model),
                "--output-dir",
                str(self.run_dir),
                "--max-steps",
                str(self.max_steps),
                "--trainer-gpu-ids",
                "[1,2]",
                *RUN_OVERRIDES,
                "--dry-run",
                "--write",
                str(self.run_dir),
            ],
            check=True,
            timeout=120,
            stdout=subprocess.DEVNULL,
            env=self.env(),
        )
        a = self.hosts["a"]
        self._write(
            "broker-a.toml",
            f'host = "{a.address}"\ngrpc_port = {self.ports["grpc"]}\n'
            f"rollout_port = {self.ports['rollout']}\nweight_port = {self.ports['weight']}\n"
            f"heartbeat_interval_s = 0.5\n",
        )
        client = f'[broker]\naddress = "{self.broker_address}"\n'
        self._write("orchestrator-a.toml", client)
        for name in ("b", "c"):
            self._write(f"trainer-{name}.toml", client)
        for name in ("d", "e", "f"):
            self._write(f"inference-{name}.toml", client + f'\n[server]\nhost = "{self.hosts[name].address}"\n')

        if self.encrypted:
            self.write_credentials()

    def write_credentials(self) -> None:
        """`primerl certs` for the broker's address (a CA, server and client certificates, CURVE key pairs) and
        a ``secure-{role}.toml`` per role: mutual TLS on gRPC, CURVE on both ZeroMQ planes."""
        certs = self.run_dir / "certs"
        subprocess.run(
            [
                str(BIN / "primerl"),
                "certs",
                "--out",
                str(certs),
                "--host",
                self.hosts["a"].address,
                "--clients",
                "trainer,orchestrator,inference,status",
            ],
            check=True,
            timeout=120,
            stdout=subprocess.DEVNULL,
            env=self.env(),
        )
        self._write(
            "secure-broker.toml",
            f'tls_cert_path = "{certs}/broker.pem"\ntls_key_path = "{certs}/broker.key"\n'
            f'tls_client_ca_path = "{certs}/ca.pem"\n'
            f'curve_secret_key_path = "{certs}/curve/broker.key_secret"\n'
            f'curve_authorized_keys_dir = "{certs}/curve/authorized"\n',
        )
        for role in ("trainer", "orchestrator", "inference"):
            self._write(f"secure-{role}.toml", f"[broker]\n{self.client_credentials(role)}")

    def client_credentials(self, client: str) -> str:
        certs = self.run_dir / "certs"
        return (
            f'tls_ca_path = "{certs}/ca.pem"\ntls_cert_path = "{certs}/clients/{client}.pem"\n'
            f'tls_key_path = "{certs}/clients/{client}.key"\n'
            f'curve_secret_key_path = "{certs}/curve/clients/{client}.key_secret"\n'
            f'curve_broker_key_path = "{certs}/curve/broker.key"\n'
        )

    def status_tls_args(self) -> list[str]:
        certs = self.run_dir / "certs"
        return (
            [
                "--tls-ca",
                str(certs / "ca.pem"),
                "--tls-cert",
                str(certs / "clients" / "status.pem"),
                "--tls-key",
                str(certs / "clients" / "status.key"),
            ]
            if self.encrypted
            else []
        )

    def _write(self, name: str, text: str) -> None:
        (self.run_dir / name).write_text(text)

    def config_args(self, role: str, host: str) -> list[str]:
        files = [self.run_dir / f"{role}.toml", self.run_dir / f"{role}-{host}.toml"]
        if self.encrypted:
            files.append(self.run_dir / f"secure-{role}.toml")
        return [arg for path in files for arg in ("@", str(path))]

    def env(self, role: str | None = None, host: Host | None = None) -> dict[str, str]:
        from primerl.runtime.cpu_budget import available_cpus, default_budgets, role_env

        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
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
        proc = self.start(
            "broker@a", "broker", "a", [BIN / "primerl-broker", *self.config_args("broker", "a"), "--ready-file", ready]
        )
        self._wait_file(ready, proc, BROKER_READY_S)
        self.report.roles["broker@a (gRPC)"] = self.broker_address

    def start_inference(self, name: str) -> Proc:
        ready = self.run_dir / f"infer-{name}-ready.json"
        ready.unlink(missing_ok=True)
        proc = self.start(
            f"infer@{name}",
            "inference",
            name,
            [BIN / "primerl-infer", *self.config_args("inference", name), "--ready-file", ready],
        )
        proc.ready_file = ready  # type: ignore[attr-defined]
        return proc

    def wait_inference(self, proc: Proc) -> str:
        info = self._wait_file(proc.ready_file, proc, INFER_READY_S)  # type: ignore[attr-defined]
        self.report.roles[proc.label] = info["base_url"]
        return info["base_url"]

    def start_trainer_rank(self, name: str, is_host: bool) -> Proc:
        b = self.hosts["b"]
        argv = [
            BIN / "torchrun",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={0 if is_host else 1}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={b.endpoint(self.ports['rdzv'])}",
            f"--rdzv-id=multihost-{self.token[:8]}",
            f"--rdzv-conf=is_host={str(is_host).lower()}",
            f"--local-addr={self.hosts[name].address}",
            "--max-restarts=0",
            BIN / "primerl-trainer",
            *self.config_args("trainer", name),
        ]
        self.report.roles[f"trainer@{name}"] = self.hosts[name].address + (
            f" (rendezvous {b.endpoint(self.ports['rdzv'])})" if is_host else ""
        )
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

        certs = self.run_dir / "certs"
        tls = (
            {
                "tls_ca_path": str(certs / "ca.pem"),
                "tls_cert_path": str(certs / "clients" / "status.pem"),
                "tls_key_path": str(certs / "clients" / "status.key"),
            }
            if self.encrypted
            else {}
        )
        config = BrokerClientConfig(address=self.broker_address, run_token=self.token, connect_timeout_s=10.0, **tls)
        return ControlClient(config, role="client", name="multihost-test", rpc_timeout_s=10.0)

    def status(self, client) -> dict:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(client.get_run_status(), preserving_proto_field_name=True)

    def _check_alive(self, labels: list[str]) -> None:
        """Each of ``labels`` still runs; the orchestrator may also have finished (exit 0): it ends once it
        produced the last step."""
        for label in labels:
            code = self.procs[label].poll()
            if code is not None and not (label == "orchestrator@a" and code == 0):
                raise RuntimeError(f"{label} exited {code} mid-run:\n{self.procs[label].tail()}")

    def wait_until(
        self, client, what: str, predicate: Callable[[dict], bool], alive: list[str], deadline: float
    ) -> dict:
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
            self.watch_from_g()
            d, e = self.start_inference("d"), self.start_inference("e")
            self.start_trainer_rank("b", True)
            self.start_trainer_rank("c", False)
            url_d, url_e = self.wait_inference(d), self.wait_inference(e)
            self.say(f"inference up: {url_d}, {url_e}")
            orch = self.start(
                "orchestrator@a",
                "orchestrator",
                "a",
                [BIN / "primerl-orchestrator", *self.config_args("orchestrator", "a")],
            )
            report.roles["orchestrator@a"] = self.hosts["a"].address
            running = ["broker@a", "infer@e", "trainer@b", "trainer@c", "orchestrator@a"]
            with self.client() as client:
                self.wait_until(
                    client,
                    f"trainer step {self.stop_at_step}",
                    lambda s: int(s.get("trainer_step", 0)) >= self.stop_at_step,
                    running + ["infer@d"],
                    deadline,
                )
                busy = self.wait_busy(client, url_d, time.monotonic() + 30.0)
                report.d_inflight_at_stop = int(busy.get("num_inflight", 0))
                report.stopped_at_step = int(self.status(client).get("trainer_step", 0))
                self.say(
                    f"step {report.stopped_at_step}: stopping {url_d} (SIG{self.stop_signal}; "
                    f"{report.d_inflight_at_stop} requests in flight at its last heartbeat)"
                )
                report.stop_signal = self.stop_signal
                if self.stop_signal == "KILL":
                    d.kill()
                else:
                    report.exit_codes["infer@d (SIGTERM)"] = d.stop()
                report.workers_left.append(url_d)
                f = self.start_inference("f")
                url_f = self.wait_inference(f)
                report.join_ready_s = time.monotonic() - f.started_s
                report.workers_joined.append(url_f)
                ready_s = time.monotonic()
                status = self.status(client)
                report.joined_ready_at_step = int(status.get("trainer_step", 0))
                current = int(status.get("latest_policy_version", 0))
                self.say(f"{url_f} joined after step {report.joined_ready_at_step} (v{current} current)")
                # (on a slow machine the run may be over before f is up: then the broker tells it to stop at once)
                self.wait_until(
                    client,
                    f"{url_f} serving v{current}",
                    lambda s: (
                        int(s.get("last_committed_step", 0)) >= self.max_steps
                        or any(
                            w.get("address") == url_f and int(w.get("policy_version", -1)) >= current
                            for w in s.get("workers", [])
                        )
                    ),
                    [r for r in running if r != "infer@e"],
                    deadline,
                )
                report.join_seen_serving_s = time.monotonic() - ready_s
                report.join_version = current
                trainers = [self.procs["trainer@b"], self.procs["trainer@c"]]
                while any(t.poll() is None for t in trainers):
                    self._check_alive([r for r in running if not r.startswith("trainer@")])
                    if time.monotonic() > deadline:
                        raise RuntimeError("timed out waiting for the trainer to finish")
                    time.sleep(0.2)
                for t in trainers:
                    report.exit_codes[t.label] = t.poll()
                n = self.max_steps
                # The broker asks the workers to stop END_OF_RUN_GRACE_S (10 s) after the last step: look now.
                report.broker_status = self.wait_until(
                    client, f"every live worker serving v{n}", served(n), ["broker@a"], deadline
                )
                self.say(f"step {n} done; every live worker serves v{n}")
                self.scrape_inference()
            report.exit_codes["orchestrator@a"] = self.wait_exit(orch, 60.0)
            for label in ("infer@e", "infer@f"):  # they stop when the broker tells them the run is over
                report.exit_codes[label] = self.wait_exit(self.procs[label], 60.0)
            self.collect()
        except Exception as err:
            report.errors.append(f"{type(err).__name__}: {err}")
        finally:
            self.stop_all()
            self.read_g_statuses()
            report.wall_s = time.monotonic() - start_s
        return report

    def wait_busy(self, client, url: str, until: float) -> dict:
        """The worker at ``url`` as the broker lists it once it has requests in flight (its last heartbeat), so
        that stopping it catches rollouts mid-request; as it is at ``until`` when it never has."""
        worker: dict = {}
        while True:
            try:
                workers = self.status(client).get("workers", [])
            except Exception:  # the broker not answering for a moment: ``until`` bounds it
                workers = []
            worker = next((w for w in workers if w.get("address") == url), worker)
            if int(worker.get("num_inflight", 0)) > 0 or time.monotonic() > until:
                return worker
            time.sleep(0.1)

    @staticmethod
    def wait_exit(proc: Proc, timeout_s: float) -> int | None:
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return proc.stop(30.0)

    def watch_from_g(self) -> None:
        """`primerl status --watch --json` on host g for the whole run: the worker list is read from what it
        printed once the last step was done (``read_g_statuses``), before the workers are told to stop."""
        g = self.hosts["g"]
        argv = [
            BIN / "primerl",
            "status",
            "--broker",
            self.broker_address,
            "--json",
            "--watch",
            "--interval-ms",
            "300",
            "--timeout-s",
            "30",
            *self.status_tls_args(),
        ]
        proc = Proc(
            "status@g",
            g,
            argv,
            {**self.env(), "PRIMERL_RUN_TOKEN": self.token},
            self.run_dir / "logs" / "status@g.jsonl",
            self.run_dir,
        )
        self.procs["status@g"] = proc
        self.report.roles["primerl status@g"] = g.address

    def read_g_statuses(self) -> None:
        """The last status host g's `primerl status` printed with the last step committed, every live worker
        serving it and the most workers alive (else the last it printed with the step committed), as JSON and as
        the table it shows."""
        from google.protobuf.json_format import ParseDict

        from primerl.proto.v1 import control_pb2
        from primerl.supervisor.status_view import render_status

        proc = self.procs.get("status@g")
        if proc is None:
            return
        statuses = []
        for line in proc.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"run_id"' in line:
                try:
                    statuses.append(json.loads(line))
                except ValueError:
                    pass
        n = self.max_steps
        done = [s for s in statuses if int(s.get("last_committed_step", 0)) >= n]
        good = [s for s in done if served(n)(s)]
        # the workers leave one by one once the broker tells them the run is over: the last status before any did
        most = max((num_alive_inference(s) for s in good), default=0)
        good = [s for s in good if num_alive_inference(s) == most]
        chosen = good[-1] if good else (done[-1] if done else (statuses[-1] if statuses else {}))
        self.report.g_status = chosen
        self.report.g_status_lines = len(statuses)
        if chosen:
            message = ParseDict(chosen, control_pb2.RunStatus(), ignore_unknown_fields=True)
            self.report.g_status_text = render_status(message)

    def collect(self) -> None:
        """From the roles' logs and metrics rows: the trainer's steps, the orchestrator's retried rollouts and
        the workers it saw join, serve and leave."""
        report = self.report
        rank0 = [p for p in (self.procs["trainer@b"], self.procs["trainer@c"]) if p.events(telemetry.STEP_DONE)]
        report.steps_done = [int(e["step"]) for p in rank0 for e in p.events(telemetry.STEP_DONE)]
        orch = self.procs["orchestrator@a"]
        # rank 0's batch of each step as the orchestrator sent it and as the trainer trained it
        report.sent_digests = {
            int(e["step"]): str(e.get("data_digest"))
            for e in orch.events(telemetry.STEP_SENT)
            if int(e.get("rank", 0)) == 0
        }
        report.trained_digests = {
            int(e["step"]): str(e.get("data_digest")) for p in rank0 for e in p.events(telemetry.STEP_DONE)
        }
        report.retried_events = len(orch.events(telemetry.ROLLOUT_GROUP_RETRIED))
        report.rescheduled_events = len(orch.events(telemetry.ROLLOUT_GROUP_RESCHEDULED))
        rows = (
            [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            if (self.run_dir / "metrics.jsonl").exists()
            else []
        )
        report.retried_rollouts = sum(float(r.get("rollout/retried", 0.0)) for r in rows)
        report.rescheduled_rollouts = sum(float(r.get("rollout/rescheduled", 0.0)) for r in rows)
        report.orchestrator_rows = len([r for r in rows if "rollout/retried" in r or "rollout/rescheduled" in r])
        joiner = self.procs.get("infer@f")
        if joiner is not None:
            registered = [parse_ts(e) for e in joiner.events(telemetry.REGISTERED_WITH_THE_BROKER)]
            live = [
                parse_ts(e)
                for e in joiner.events(telemetry.WEIGHT_UPDATE_LIVE)
                if int(e.get("policy_version", 0)) >= report.join_version
            ]
            if registered and live:
                report.join_serving_s = live[0] - registered[0]
            caught_up = joiner.events(telemetry.INFERENCE_WORKER_CAUGHT_UP)
            if caught_up:
                report.join_caught_up_s = float(caught_up[0].get("join_to_serving_s", 0.0))
        for name, key in (
            (telemetry.INFERENCE_WORKER_JOINED, "joined"),
            (telemetry.INFERENCE_WORKER_LEFT, "left"),
            (telemetry.INFERENCE_WORKER_SERVING, "serving"),
        ):
            report.orchestrator_saw[key] = [
                {
                    k: e.get(k)
                    for k in (
                        "url",
                        "step",
                        "policy_version",
                        "current_version",
                        "join_to_serving_s",
                        "num_inflight_rollouts",
                    )
                    if k in e
                }
                for e in orch.events(name)
            ]

    def scrape_inference(self) -> None:
        """Each live worker's Prometheus metrics (from this process, over the hosts' network): the policy
        version it serves (``primerl_inference_policy_version``) and the requests it answered (vLLM's)."""
        import httpx

        for label in ("infer@e", "infer@f"):
            url = self.report.roles.get(label)
            if not url:
                continue
            try:
                text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {self.token}"}, timeout=30).text
            except httpx.HTTPError as err:
                self.report.metrics[label] = {"error": f"{type(err).__name__}: {err}"}
                continue
            values = {"policy_version": None, "requests": 0.0}
            for line in text.splitlines():
                if line.startswith(telemetry.INFERENCE_POLICY_VERSION):
                    values["policy_version"] = float(line.split()[-1])
                elif line.startswith("vllm:request_success_total"):
                    values["requests"] += float(line.split()[-1])
            self.report.metrics[label] = values

    def stop_all(self) -> None:
        for label in (
            "orchestrator@a",
            "trainer@b",
            "trainer@c",
            "infer@d",
            "infer@e",
            "infer@f",
            "status@g",
            "broker@a",
        ):
            if label in self.procs:
                code = self.procs[label].stop(60)
                if label != "status@g" and not (label == "infer@d" and self.stop_signal == "KILL"):
                    self.report.exit_codes.setdefault(label, code)
