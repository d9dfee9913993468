"""Setting up one chaos run and running its roles: mode ``separate`` (the four daemons as separate processes, each
under the systemd-like restarter of ``procs``) or mode ``rl`` (`primerl rl --restart on-failure`, which restarts
the roles itself; the harness kills the role processes it lists in ``pids.json``).

Config: the example run (``examples/reverse_text_rl.toml``) on the tiny model, shortened (``RUN_OVERRIDES``),
checkpoints every 2 steps, JSON logs. Mode ``separate`` pushes weights in relay fan-out (``RELAY_OVERRIDES``): a
relay worker (``relay_worker.py``, no vLLM, a slow link to the next worker) joins before the inference worker,
so each update goes broker -> relay -> inference, as bytes (``transport = "socket"``); mode ``rl`` keeps the
default same-host road (shared memory: the inference worker is sent descriptors of the trainer's segments). Mode
``separate`` writes the role configs with
`primerl rl ... --dry-run --write DIR` and fixes the broker's three ports (as a deployment would); each role gets
the run token as ``$PRIMERL_RUN_TOKEN`` and `primerl rl`'s default CPU thread budget as environment variables.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from primerl.proto.ready_file import read_ready_file, ready_file_path
from primerl.supervisor.process_supervisor import start_in_own_session

from .plan import LAUNCHER, TRAINER_RANK
from .procs import MARKER_ENV, Exit, Unit, engine_core_pid, find_descendant, signal_quietly

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
BIN = Path(sys.executable).parent
ROLES = ("broker", "inference", "orchestrator", "trainer")
DAEMONS = {
    "broker": "primerl-broker",
    "inference": "primerl-infer",
    "orchestrator": "primerl-orchestrator",
    "trainer": "primerl-trainer",
}
CKPT_INTERVAL = 2
ENGINE_STALL_TIMEOUT_S = 4.0  # runs with a stall: the inference watchdog's bound (default 60 s)
RUN_OVERRIDES = [
    "--orchestrator.batch-size",
    "16",
    "--orchestrator.rollouts-per-example",
    "4",
    "--orchestrator.sampling.max-tokens",
    "16",
    "--trainer.ckpt.interval",
    str(CKPT_INTERVAL),
    "--log.format",
    "json",
]
RELAY_ROLE = "relay"
RELAY_TIMEOUT_S = 5.0
RELAY_FORWARD_DELAY_S = 1.0
RELAY_SLOW_UNTIL_VERSION = 5  # the relay kill is the plan's first: it fires on one of the first updates
RELAY_OVERRIDES = [
    "--broker.weight-fanout",
    "chain",
    "--broker.weight-relay-timeout-s",
    str(RELAY_TIMEOUT_S),
    "--inference.weight-relay-host",
    "127.0.0.1",
    # The relay chain is the road of bytes across hosts: on this one host the trainer would hand the workers its
    # updates in shared memory instead, and nothing would be relayed (mode rl runs that road).
    "--trainer.weight-broadcast.transport",
    "socket",
]
RELAY_READY_TIMEOUT_S = 60.0
DEFAULT_RESTART_SEC = {"broker": 2.0, "inference": 5.0, "orchestrator": 5.0, "trainer": 5.0}
BROKER_READY_TIMEOUT_S = 60.0
RL_STOP_TIMEOUT_S = 90.0
LAUNCHER_ROLES_GONE_S = 15.0  # after `primerl rl`'s SIGKILL, how long its roles may take to go (its reaper: ~2 s)
SPOOL_DISK_MIB = 64  # the tmpfs of the broker's spool dir (batches: KiBs a step; the weight chain: ~3 MiB a version)
# the tmpfs of the trainer's checkpoints: ~7 MiB a checkpoint of the tiny model, one every CKPT_INTERVAL steps, all kept
CHECKPOINT_DISK_MIB = 512
MID_SEND_TRIGGER = ".chaos-orchestrator-fault"  # in the run dir: the orchestrator's fault point reads k from it
FILLER_DIR = ".chaos-disk-filler"  # a directory: neither the spool nor the checkpoint listing reads it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shipped_restart_sec() -> dict[str, float]:
    """``RestartSec`` of the shipped systemd units (deploy/systemd), per role."""
    found = dict(DEFAULT_RESTART_SEC)
    for role, daemon in DAEMONS.items():
        unit = REPO_ROOT / "deploy" / "systemd" / f"{daemon}.service"
        match = re.search(r"^RestartSec=([0-9.]+)\s*$", unit.read_text(), re.M) if unit.exists() else None
        if match:
            found[role] = float(match.group(1))
    return found


def base_env(marker: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        MARKER_ENV: marker,
    }
    env.setdefault("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
    env.pop("PRIMERL_RUN_TOKEN", None)
    return env


def build_tiny_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        subprocess.run(
            [str(BIN / "primerl"), "init-tiny-model", str(path)], check=True, timeout=300, stdout=subprocess.DEVNULL
        )
    return path


def rl_has_restart_option() -> bool:
    result = subprocess.run([str(BIN / "primerl"), "rl", "--help"], capture_output=True, text=True, timeout=120)
    return "--restart" in result.stdout


@dataclass
class RunSpec:
    mode: str  # separate | rl
    seed: int
    run_dir: Path
    model: Path
    max_steps: int
    restart_sec: dict[str, float]
    grpc_port: int
    token: str
    marker: str
    relay: bool = False  # a relay worker in the weight chain (mode separate)
    trainer_ranks: int = 1  # mode rl: 2 (torchrun under `primerl rl`, `trainer_gpu_ids = [1, 2]`)
    stall: bool = False  # the plan stops the engine core once: the inference watchdog gets a short timeout
    disk: bool = False  # the plan fills the spool's filesystem once: the spool gets a small tmpfs of its own
    checkpoint_disk: bool = False  # the plan fills the checkpoints' filesystem once: a tmpfs of their own
    partitions: bool = False  # mode separate: inference and trainer on hosts of their own, cut off once each
    broker_host: str = "127.0.0.1"  # with partitions: the bridge's address (set once the hosts are made)

    @classmethod
    def create(
        cls,
        mode: str,
        seed: int,
        run_dir: Path,
        model: Path,
        max_steps: int,
        restart_sec: dict[str, float],
        *,
        stall: bool = False,
        disk: bool = False,
        checkpoint_disk: bool = False,
        partitions: bool = False,
    ) -> RunSpec:
        return cls(
            mode,
            seed,
            run_dir,
            model,
            max_steps,
            restart_sec,
            free_port(),
            secrets.token_urlsafe(24),
            f"chaos-{os.getpid()}-{mode}-{seed}-{secrets.token_hex(4)}",
            relay=mode == "separate",
            trainer_ranks=2 if mode == "rl" else 1,
            stall=stall,
            disk=disk,
            checkpoint_disk=checkpoint_disk,
            partitions=partitions,
        )

    @property
    def spool_dir(self) -> Path:
        return self.run_dir / "broker" / "spool"

    @property
    def mid_send_trigger(self) -> Path:
        return self.run_dir / MID_SEND_TRIGGER

    def fault_env(self) -> dict[str, str]:
        """The orchestrator's test-only fault point, armed only once the harness writes the trigger file."""
        from primerl.orchestrator.step_send import FAULT_EXIT_AFTER_ACKS_FILE_ENV

        return {FAULT_EXIT_AFTER_ACKS_FILE_ENV: str(self.mid_send_trigger)}

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def broker_address(self) -> str:
        return f"{self.broker_host}:{self.grpc_port}"

    def rl_args(self) -> list[str]:
        return [
            "@",
            str(EXAMPLE),
            "--model.name",
            str(self.model),
            "--output-dir",
            str(self.run_dir),
            "--max-steps",
            str(self.max_steps),
            "--broker.grpc-port",
            str(self.grpc_port),
            *RUN_OVERRIDES,
            *(["--trainer-gpu-ids", str(list(range(1, self.trainer_ranks + 1)))] if self.trainer_ranks > 1 else []),
            *(["--inference.engine-stall-timeout-s", str(ENGINE_STALL_TIMEOUT_S)] if self.stall else []),
        ]


class SeparateBackend:
    """The four daemons, each a ``Unit`` under the restarter."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.units: dict[str, Unit] = {}
        self.plain_argv: dict[str, list[str]] = {}  # a role's command before its clock was skewed
        self.hosts = None  # with partitions: ``support.netns.Hosts`` of the roles on hosts of their own

    def start(self) -> None:
        from primerl.runtime.cpu_budget import available_cpus, default_budgets, role_env

        spec = self.spec
        weight_port = free_port()
        fixed_ports = ["--broker.rollout-port", str(free_port()), "--broker.weight-port", str(weight_port)]
        relay = RELAY_OVERRIDES if spec.relay else []
        subprocess.run(
            [
                str(BIN / "primerl"),
                "rl",
                *spec.rl_args(),
                *fixed_ports,
                *relay,
                "--dry-run",
                "--write",
                str(spec.run_dir),
            ],
            check=True,
            timeout=120,
            stdout=subprocess.DEVNULL,
            env=base_env(spec.marker),
        )
        if spec.partitions:
            self._make_hosts()
        budgets = default_budgets(available_cpus(), gpus=False)
        for role in ROLES:
            env = {**base_env(spec.marker), "PRIMERL_RUN_TOKEN": spec.token, **role_env(role, budgets[role])}
            if role == "orchestrator":
                env.update(spec.fault_env())
            argv = [BIN / DAEMONS[role], "@", spec.run_dir / f"{role}.toml"]
            if spec.partitions:
                argv += ["@", spec.run_dir / f"{role}-{NETWORK_FILE}"]
                if role in PARTITIONED_ROLES:
                    argv = self.hosts[role].argv(argv)
            if role == "broker":
                argv += ["--ready-file", ready_file_path(spec.run_dir, "broker")]
            self.units[role] = Unit(
                role, argv, env, spec.run_dir / "logs" / f"{role}.log", spec.restart_sec[role], cwd=spec.run_dir
            )
        if spec.relay:
            env = {**base_env(spec.marker), "PRIMERL_RUN_TOKEN": spec.token}
            argv = [sys.executable, Path(__file__).resolve().parent / "relay_worker.py"]
            argv += [f"tcp://{spec.broker_host}:{weight_port}", "chaos-relay", "--relay-host", spec.broker_host]
            argv += ["--grpc-address", spec.broker_address]  # a broker relays only through registered workers
            argv += ["--forward-delay-s", str(RELAY_FORWARD_DELAY_S)]
            argv += ["--slow-until-version", str(RELAY_SLOW_UNTIL_VERSION)]
            log = spec.run_dir / "logs" / f"{RELAY_ROLE}.log"
            self.units[RELAY_ROLE] = Unit(RELAY_ROLE, argv, env, log, spec.restart_sec["inference"], cwd=spec.run_dir)
        self.units["broker"].start()
        deadline = time.monotonic() + BROKER_READY_TIMEOUT_S
        while read_ready_file(ready_file_path(spec.run_dir, "broker")) is None:
            if time.monotonic() > deadline or self.units["broker"].poll() is not None:
                raise RuntimeError(f"the broker did not become ready; see {spec.run_dir / 'logs' / 'broker.log'}")
            time.sleep(0.1)
        if spec.relay:  # it joins the weight plane before the inference worker: the head of the chain
            self.units[RELAY_ROLE].start()
            deadline = time.monotonic() + RELAY_READY_TIMEOUT_S
            log = spec.run_dir / "logs" / f"{RELAY_ROLE}.log"
            while "relay worker ready" not in (log.read_text(errors="replace") if log.exists() else ""):
                if time.monotonic() > deadline or self.units[RELAY_ROLE].poll() is not None:
                    raise RuntimeError(f"the relay worker did not become ready; see {log}")
                time.sleep(0.1)
        for role in ("inference", "trainer", "orchestrator"):
            self.units[role].start()

    def _make_hosts(self) -> None:
        """The inference worker and the trainer on network namespaces of their own, joined by a bridge whose
        address the broker (and the orchestrator, the relay worker, the harness) use; each role gets a config
        file more (``<role>-network.toml``) with the addresses."""
        spec = self.spec
        self.hosts = make_hosts(list(PARTITIONED_ROLES))
        spec.broker_host = self.hosts.gateway
        client = f'[broker]\naddress = "{spec.broker_address}"\n'
        files = {
            "broker": f'host = "{spec.broker_host}"\n',
            "orchestrator": client,
            "trainer": client,
            "inference": f'weight_relay_host = "{self.hosts["inference"].address}"\n\n{client}\n'
            f'[server]\nhost = "{self.hosts["inference"].address}"\n',
        }
        for role, text in files.items():
            (spec.run_dir / f"{role}-{NETWORK_FILE}").write_text(text)

    def cut(self, role: str) -> int | None:
        """Take the host of ``role`` off the bridge (its packets dropped silently, both ways); the role's pid."""
        self._cable(role, "nomaster")
        return self.pid(role)

    def heal(self, role: str) -> None:
        self._cable(role, "master", self.hosts.bridge)

    def _cable(self, role: str, *args: str) -> None:
        assert self.hosts is not None, "a partition in a run without hosts"
        port = f"{self.hosts.bridge[:-2]}v{list(self.hosts.hosts).index(role)}"  # support.netns's veth names
        subprocess.run(["ip", "link", "set", port, *args], check=True, capture_output=True, timeout=20)

    def poll(self) -> list[Exit]:
        return [e for e in (unit.poll() for unit in self.units.values()) if e is not None]

    def pid(self, role: str) -> int | None:
        return self.units[role].pid

    def kill(self, role: str) -> int | None:
        return self.units[role].kill()

    def stop_engine(self) -> int | None:
        return _stop_engine(self.pid("inference"))

    def resume_engine(self, pid: int) -> None:
        signal_quietly(pid, signal.SIGCONT)

    def arm_mid_send(self, acks: int) -> int | None:
        """Arm the orchestrator's fault point: it dies after ``acks`` micro-batches of its next step (its exit is
        the harness's). The orchestrator's pid."""
        pid = self.pid("orchestrator")
        if pid is not None:
            self.units["orchestrator"].pending_kill_pid = pid
            write_trigger(self.spec.mid_send_trigger, acks)
        return pid

    def skew_clock(self, role: str, skew_s: float) -> int | None:
        """SIGKILL ``role``; its restarter starts it again with its clock ``skew_s`` off, and keeps it so (the
        host's clock stays wrong): the unit's command runs under `env` with libfaketime preloaded, so that the
        role's log header (``=== ... FAKETIME=...``) says which incarnations ran skewed. The killed pid."""
        unit = self.units[role]
        plain = self.plain_argv.setdefault(role, list(unit.argv))
        unit.argv = [*faketime_prefix(skew_s), *plain]
        return unit.kill()

    def finished(self) -> bool:
        return self.units["trainer"].state == "done"

    def given_up(self) -> list[str]:
        return [role for role, unit in self.units.items() if unit.state == "failed"]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Like `primerl rl` at the end: the others first, the broker last."""
        for role in ("trainer", "orchestrator", "inference", RELAY_ROLE, "broker"):
            if role in self.units:
                self.units[role].stop(timeout_s)

    def close(self) -> None:
        """Remove the hosts (after the check for processes left behind, which would find none in them)."""
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None

    def exits(self) -> list[Exit]:
        return [e for unit in self.units.values() for e in unit.exits]

    def starts(self) -> dict[str, int]:
        return {role: len(unit.starts) for role, unit in self.units.items()}


class RlBackend:
    """`primerl rl --restart on-failure`; its roles' pids come from ``pids.json``."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.process: subprocess.Popen | None = None
        self.seen: dict[str, list[int]] = {role: [] for role in ROLES}
        self.ended: set[int] = set()
        self.killed: set[int] = set()
        self._exits: list[Exit] = []
        self.trainer_finished = False  # set by the driver once the trainer logged "training finished"
        self.killed_launchers: list[int] = []  # `primerl rl` processes the harness killed (and started again)

    def start(self) -> None:
        spec = self.spec
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**base_env(spec.marker), **spec.fault_env()}
        # `primerl rl` takes the run token from its config only (it makes one up otherwise): a file only we can
        # read, removed at the end (``stop``), so that the harness can ask the broker for the run status.
        self.token_file = spec.run_dir / ".chaos-run-token.toml"
        self.token_file.touch(mode=0o600)
        self.token_file.write_text(f'[broker]\nrun_token = "{spec.token}"\n')
        self.log_path = spec.run_dir / "logs" / "primerl-rl.log"
        argv = [str(BIN / "primerl"), "rl", *spec.rl_args(), "@", str(self.token_file), "--restart", "on-failure"]
        self.process = start_in_own_session(argv, self.log_path, env, spec.run_dir.parent)

    def _pids(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads((self.spec.run_dir / "pids.json").read_text()).items()}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def poll(self) -> list[Exit]:
        for role, pid in self._pids().items():
            if role in self.seen and pid not in self.seen[role]:
                self.seen[role].append(pid)
        new = []
        for role, pids in self.seen.items():
            for pid in pids:
                if pid in self.ended or self._alive(pid):
                    continue
                self.ended.add(pid)
                ending = self.process is not None and self.process.poll() is not None
                planned = (
                    pid in self.killed
                    or ending
                    or (role == "trainer" and self.trainer_finished)
                    or (self.trainer_finished and role != "trainer")
                )
                new.append(Exit(role, pid, -signal.SIGKILL if pid in self.killed else None, time.time(), planned))
        self._exits += new
        return new

    def pid(self, role: str) -> int | None:
        if role == LAUNCHER:
            process = self.process
            return process.pid if process is not None and process.poll() is None else None
        pid = self._pids().get(role)
        return pid if pid is not None and self._alive(pid) else None

    def rank_pid(self, rank: int) -> int | None:
        """The trainer rank ``rank`` that torchrun (the trainer role's process) runs, if alive."""
        return find_descendant(
            self.pid("trainer"),
            lambda p: p.environ().get("RANK") == str(rank) and "primerl-trainer" in " ".join(p.cmdline()),
        )

    def kill(self, role: str) -> int | None:
        if role == LAUNCHER:
            return self._kill_launcher()
        if role == TRAINER_RANK:
            pid, leader = self.rank_pid(1), self.pid("trainer")
            if pid is None or leader is None:
                return None
            self.killed.update((pid, leader))  # torchrun exits because of this kill: planned
            os.kill(pid, signal.SIGKILL)
            return pid
        pid = self.pid(role)
        if pid is None:
            return None
        self.killed.add(pid)
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop_engine(self) -> int | None:
        return _stop_engine(self.pid("inference"))

    def resume_engine(self, pid: int) -> None:
        signal_quietly(pid, signal.SIGCONT)

    def arm_mid_send(self, acks: int) -> int | None:
        """As ``SeparateBackend.arm_mid_send``; `primerl rl` restarts the orchestrator."""
        pid = self.pid("orchestrator")
        if pid is not None:
            self.killed.add(pid)
            write_trigger(self.spec.mid_send_trigger, acks)
        return pid

    def _kill_launcher(self) -> int | None:
        """SIGKILL `primerl rl`; once its roles are gone (its reaper ends them; bounded), start it again as a
        supervisor would: the run resumes from its directory. Its roles' exits are the harness's (planned)."""
        process = self.process
        if process is None or process.poll() is not None:
            return None
        self.poll()  # the roles' current pids are seen, so that their exits are counted as planned
        roles = [pid for pids in self.seen.values() for pid in pids if pid not in self.ended]
        self.killed.update(roles)
        self.killed_launchers.append(process.pid)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10.0)
        deadline = time.monotonic() + LAUNCHER_ROLES_GONE_S
        while any(self._alive(pid) for pid in roles) and time.monotonic() < deadline:
            time.sleep(0.05)
        (self.spec.run_dir / "pids.json").unlink(missing_ok=True)  # the next launcher writes its own
        self.start()
        return process.pid

    def finished(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def given_up(self) -> list[str]:
        return []

    def stop(self, timeout_s: float = RL_STOP_TIMEOUT_S) -> None:
        if self.process is None:
            return
        self.token_file.unlink(missing_ok=True)
        try:
            self.process.wait(timeout_s if self.trainer_finished else 0.1)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(10.0)
        self.poll()

    def exits(self) -> list[Exit]:
        return list(self._exits)

    def starts(self) -> dict[str, int]:
        starts = {role: len(pids) for role, pids in self.seen.items()}
        if self.killed_launchers:
            starts[LAUNCHER] = len(self.killed_launchers) + 1
        return starts

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def close(self) -> None:
        pass


def write_trigger(path: Path, acks: int) -> None:
    """Whole or not at all: the orchestrator may read it at any moment."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(f"{acks}\n")
    os.replace(temporary, path)


def _stop_engine(daemon_pid: int | None) -> int | None:
    """SIGSTOP the engine core of the inference worker ``daemon_pid``; its pid, or None when there is none."""
    pid = engine_core_pid(daemon_pid)
    if pid is not None:
        signal_quietly(pid, signal.SIGSTOP)
    return pid


FAKETIME_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def faketime_library() -> str | None:
    """libfaketime's shared library (Debian: `apt install libfaketime`), or None."""
    return next((path for path in FAKETIME_LIBRARIES if os.path.exists(path)), None)


def faketime_refusal() -> str | None:
    """Why the skewed-clock fault cannot run on this machine (None: it can)."""
    return None if faketime_library() else "libfaketime is not installed (Debian: apt install libfaketime)"


def faketime_prefix(skew_s: float) -> list[str]:
    """`env ...` that runs a command with every wall-clock read ``skew_s`` off (the monotonic clock left true)."""
    library = faketime_library()
    assert library is not None, faketime_refusal()
    # the log header shows it (``logs.clock_skew_of`` reads it back)
    return ["env", f"LD_PRELOAD={library}", f"FAKETIME={int(skew_s):+d}", "DONT_FAKE_MONOTONIC=1"]


PARTITIONED_ROLES = ("inference", "trainer")  # with partitions: the roles on hosts of their own
NETWORK_FILE = "network.toml"  # with partitions: ``<role>-network.toml``, the addresses on the hosts' network


def _netns_module():
    """tests/support/netns.py (the multi-host tests' hosts), as scripts/multihost_demo.py uses it."""
    tests = str(REPO_ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from support import netns

    return netns


def partition_refusal() -> str | None:
    """Why the partition faults cannot run on this machine (None: they can)."""
    ok, why = _netns_module().namespaces_available()
    return None if ok else why


def make_hosts(names: list[str]):
    return _netns_module().Hosts.create(names, mode="netns")


def tmpfs_refusal() -> str | None:
    """Why the disk faults cannot run on this machine (None: they can)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    missing = [tool for tool in ("mount", "umount") if shutil.which(tool) is None]
    return f"no {' or '.join(missing)} command" if missing else None


class SmallDisk:
    """A directory of the run (the broker's spool, the trainer's checkpoints) on a small tmpfs of its own for a run
    (``mount`` before its role starts, ``release`` once every role stopped: the content is copied back onto the run
    directory, so the checks and a reader of the run directory find it there). ``fill`` takes every free byte with
    a filler file, ``free`` deletes it."""

    def __init__(self, path: Path, size_mib: int):
        self.path, self.size_mib = path, size_mib
        self.filler = path / FILLER_DIR

    def mount(self) -> None:
        unmount_leftover(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m", "tmpfs", str(self.path)],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def fill(self) -> int:
        """Writes until the filesystem is full (ENOSPC); the bytes written. Called again, it takes what was freed
        since (the broker deletes the weight snapshots it replaced): the disk stays full while it is held."""
        self.filler.mkdir(exist_ok=True)
        written = 0
        with open(self.filler / "fill", "ab", buffering=0) as out:
            for block in (1 << 20, 4096, 1):
                try:
                    while True:
                        written += out.write(b"\0" * block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        return written

    def free(self) -> None:
        shutil.rmtree(self.filler, ignore_errors=True)

    def release(self) -> None:
        if not os.path.ismount(self.path):
            return
        self.free()
        saved = self.path.with_name(self.path.name + ".tmpfs-copy")
        shutil.rmtree(saved, ignore_errors=True)
        shutil.copytree(self.path, saved, symlinks=True)
        unmount_leftover(self.path)
        shutil.copytree(saved, self.path, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(saved)


def unmount_leftover(path: Path) -> None:
    """Unmount ``path`` if something is mounted there (lazily when a process still holds a file in it)."""
    if os.path.ismount(path):
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True, timeout=30)
