"""A real SLURM cluster on this one machine, for end-to-end tests of `primerl slurm`: slurmctld (root network
namespace, bound to the bridge's address), one slurmd per network-namespace host of ``support.netns``, each in a
UTS namespace of its own whose host name is the node's name, and a munged of the cluster's own.

    with SlurmCluster.create(["n1", "n2", "n3"], tmp_path / "slurm") as cluster:
        cluster.run("srun", "-N3", "hostname")            # n1 n2 n3, in some order
        job_id = cluster.sbatch("--wrap", "hostname", "-o", tmp_path / "out")
        cluster.wait_job_state(job_id, {"COMPLETED"}, timeout_s=30)
        subprocess.run(["squeue"], env=cluster.env())     # any client: SLURM_CONF points at the cluster

Everything lives under ``state_dir`` (slurm.conf, cgroup.conf, state, spool, logs, the munge key) except munged's
socket: munged refuses a socket whose parent directories are not all searchable by everyone (pytest's tmp dirs are
0700), so it gets a 0755 directory of its own in /tmp, which ``close`` removes. Nothing touches /etc/slurm, /etc/munge
or a system munged (Debian's packages enable services, but with no systemd and policy-rc.d none is started).

What Debian's slurm-wlm 22.05 needs here (found by trying):
- ``cgroup.conf`` with ``CgroupPlugin=cgroup/v1``: `ip netns exec` mounts a fresh /sys, so slurmd in a namespace
  finds no cgroup filesystem and its autodetection fails ("slurmd initialization failed") even with
  ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``.
- ``SlurmdParameters=config_overrides``: nodes declare ``CPUs`` beyond the machine's (several single-CPU jobs per
  node on a 2-core machine) without being drained for "Low socket*core*thread count".
- ``AuthInfo=socket=...,cred_expire=N``: the socket reaches slurmctld, slurmd, slurmstepd and clients alike.
  ``cred_expire`` is also how long a requeued job waits (Reason=BeginTime, EligibleTime = requeue + N s); the least
  accepted is 5, a smaller value is refused with a log line and the default 120 s applies.
- ``SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1``: a requeued job that became eligible
  waits for the next periodic scheduler pass (60 s main, 30 s backfill by default). Requeue to running again:
  146 s with Debian's defaults, 6.0 s here. sbatch to running: ~2.7 s by default, ~0.6-1 s here.
- slurmctld runs only on the host SlurmctldHost names, so it runs in a UTS namespace named ``<tag>ctl``; ``-N NODE`` on
  slurmd is accepted but not needed (its host name already is the node's); %n in SlurmdSpoolDir and the pid and log
  files keeps the nodes apart. slurmstepd daemonizes and this machine's pid 1 reaps no orphans, so every daemon runs
  under a small subreaper (``REAPER``). A later line of ``extra_conf`` overrides an earlier one ("latest value used").

Signals, measured: `scancel JOB` sends SIGCONT then SIGTERM to every process of the batch step (the script and its
children: a bash ``trap ... TERM`` runs within ~10 ms when the script is in ``wait``, not in a foreground command) and
of every srun step (srun prints "waiting up to KillWait+2 s"), then SIGKILL after ``KillWait`` (5 s here).
`scontrol requeue` signals the batch script the same way (its trap runs) before the job goes back to PENDING.
`scancel --signal=SIG JOB` reaches the srun steps only, ``--batch`` the batch shell only, ``--full`` both.
`scancel --signal=KILL JOB.STEP` kills one step: srun fails, and so does the script (the job ends FAILED, not
requeued: ``JobRequeue=1`` only makes jobs requeueable; a script that wants to run again calls `scontrol requeue`).
``sbatch --signal=[B:]SIG@SECONDS`` (a signal before the time limit) is SLURM's documented way to warn a job; it is
not exercised here (the limit's granularity is a minute).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .netns import Host, Hosts, namespaces_available

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue", "sinfo", "unshare")
COMMAND_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


class SlurmClusterError(RuntimeError):
    """The cluster did not come up, or a client command failed; the message holds the command or the logs."""


def slurm_available() -> tuple[bool, str]:
    """Whether this machine can run a ``SlurmCluster``, and why not in one line."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return False, f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return False, "not root (slurmd runs jobs as their user and needs network namespaces)"
    ok, why = namespaces_available()
    return (True, "") if ok else (False, f"no network namespaces: {why}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@dataclass
class Daemon:
    """One daemon the cluster started, in the foreground (``popen``: the daemon itself, or its ``REAPER``), its
    output in ``log``."""

    label: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def child_alive(self, program: str) -> bool:
        """Whether ``program`` still runs as the reaper's child (orphans that came to the reaper do not count)."""
        try:
            children = psutil.Process(self.popen.pid).children()
            return any(c.name() == program and c.status() != psutil.STATUS_ZOMBIE for c in children)
        except psutil.Error:
            return False

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL to it and its descendants past ``grace_s``."""
        self.terminate()
        try:
            self.popen.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            family = [psutil.Process(self.popen.pid), *psutil.Process(self.popen.pid).children(recursive=True)]
        except psutil.Error:
            family = []
        for member in reversed(family):
            try:
                member.kill()
            except psutil.Error:
                pass
        self.popen.wait(grace_s)

    def tail(self, num_chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""


REAPER = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans below come to this process
child = os.fork()
if child == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
def forward(num, frame):
    try:
        os.kill(child, num)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        sys.exit(code)
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
"""
"""Runs a daemon as its child and reaps every orphan below it (slurmstepd daemonizes; this machine's pid 1 may
not reap), exits once none is left; SIGTERM and SIGINT go to the daemon."""


def _start(label: str, argv: list[str], log: Path, reap: bool = False) -> Daemon:
    if reap:
        argv = [sys.executable, "-c", REAPER, *argv]
    with open(log, "ab") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Daemon(label, popen, log)


@dataclass
class SlurmCluster:
    """A running cluster: ``nodes`` maps node names to their netns ``Host``; clients run with ``env()``."""

    state_dir: Path
    hosts: Hosts
    conf_path: Path
    munge_socket: Path
    controller: str
    daemons: list[Daemon] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        node_names: list[str],
        state_dir: Path,
        cpus_per_node: int = 4,
        memory_mb_per_node: int = 1000,
        cred_expire_s: int = 5,
        extra_conf: list[str] = (),
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> SlurmCluster:
        """A cluster of ``node_names`` (each a netns host), its files under ``state_dir``; up (every node idle) when
        this returns. ``cred_expire_s``: SLURM's job credential lifetime, also the delay before a requeued job may
        start again."""
        state_dir = Path(state_dir).resolve()
        state_dir.mkdir(parents=True, exist_ok=True)
        hosts = Hosts.create(node_names, mode="netns")
        tag = hosts.bridge.removesuffix("br") if hosts.bridge else secrets.token_hex(3)
        # munged wants every directory above its socket searchable by all (pytest's tmp dirs are not): a dir of
        # its own in /tmp, removed by close()
        socket_dir = Path(tempfile.mkdtemp(prefix="prl-munge-"))
        socket_dir.chmod(0o755)
        cluster = cls(state_dir, hosts, state_dir / "slurm.conf", socket_dir / "munge.socket", f"{tag}ctl")
        try:
            cluster._start_munged()
            cluster._write_conf(cpus_per_node, memory_mb_per_node, cred_expire_s, list(extra_conf))
            cluster._start_slurmctld(start_timeout_s)
            for name in node_names:
                cluster._start_slurmd(name)
            cluster.wait_nodes_idle(start_timeout_s)
        except BaseException:
            cluster.close()
            raise
        return cluster

    @property
    def nodes(self) -> dict[str, Host]:
        return self.hosts.hosts

    def _start_munged(self) -> None:
        """A munged of this cluster's own (own key, socket, pid, log and seed files), so that it never meets the
        system's munged or its key."""
        munge_dir = self.state_dir / "munge"
        munge_dir.mkdir(mode=0o700, exist_ok=True)
        key = munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        argv = [
            "munged",
            "--foreground",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ]
        daemon = _start("munged", argv, munge_dir / "munged.out")
        self.daemons.append(daemon)
        self._wait(lambda: self.munge_socket.exists(), START_TIMEOUT_S, "munged's socket", daemon)

    def _write_conf(self, cpus_per_node: int, memory_mb_per_node: int, cred_expire_s: int, extra: list[str]) -> None:
        state = self.state_dir
        for sub in ("ctld", "spool", "log", "run"):
            (state / sub).mkdir(exist_ok=True)
        lines = [
            f"ClusterName=prl{self.controller[3:9]}",
            f"SlurmctldHost={self.controller}({self.hosts.gateway})",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"AuthInfo=socket={self.munge_socket},cred_expire={cred_expire_s}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={state / 'ctld'}",
            f"SlurmdSpoolDir={state / 'spool' / '%n'}",
            f"SlurmctldPidFile={state / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={state / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={state / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={state / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobRequeue=1",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "MinJobAge=300",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1",
            *extra,
        ]
        for host in self.hosts.hosts.values():
            lines.append(
                f"NodeName={host.name} NodeAddr={host.address} CPUs={cpus_per_node} "
                f"RealMemory={memory_mb_per_node} State=UNKNOWN"
            )
        names = ",".join(self.hosts.hosts)
        lines.append(f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf_path.write_text("\n".join(lines) + "\n")
        (state / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        for name in self.hosts.hosts:
            (state / "spool" / name).mkdir(exist_ok=True)

    def _start_slurmctld(self, timeout_s: float) -> None:
        script = f"hostname {self.controller} && exec slurmctld -D -f {self.conf_path}"
        daemon = _start(
            "slurmctld", ["unshare", "--uts", "sh", "-c", script], self.state_dir / "log" / "slurmctld.out", reap=True
        )
        self.daemons.append(daemon)
        self._wait(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0, timeout_s, "slurmctld", daemon)

    def _start_slurmd(self, name: str) -> None:
        host = self.hosts[name]
        script = f"hostname {name} && exec slurmd -D -f {self.conf_path} -N {name}"
        argv = host.argv(["unshare", "--uts", "sh", "-c", script])
        self.daemons.append(_start(f"slurmd-{name}", argv, self.state_dir / "log" / f"slurmd-{name}.out", reap=True))

    def env(self) -> dict[str, str]:
        """The environment for SLURM's client commands (sbatch, srun, squeue, scontrol ...) on this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    def _run(self, argv: list[str], check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S):
        result = subprocess.run(argv, capture_output=True, text=True, env=self.env(), timeout=timeout_s)
        if check and result.returncode != 0:
            raise SlurmClusterError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
        return result

    def run(self, *argv: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """A client command's stdout (it must exit 0)."""
        return self._run(list(argv), timeout_s=timeout_s).stdout

    def sbatch(self, *args: str | Path) -> int:
        """Submits a batch job (``sbatch ARGS``: a script path or ``--wrap``); its job id."""
        out = self.run("sbatch", "--parsable", *[str(a) for a in args])
        return int(out.strip().split(";")[0])

    def squeue(self) -> dict[int, str]:
        """The state of every job slurmctld still knows (PENDING, RUNNING ...)."""
        out = self.run("squeue", "-h", "-t", "all", "-o", "%i %T")
        return {int(line.split()[0]): line.split()[1] for line in out.splitlines() if line.strip()}

    def scontrol(self, *args: str) -> str:
        return self.run("scontrol", *args)

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, NodeList, BatchHost ...)."""
        out = self.scontrol("show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job_state(self, job_id: int, states: set[str], timeout_s: float) -> dict[str, str]:
        """The job once its JobState is one of ``states``."""
        found: dict[str, str] = {}

        def reached() -> bool:
            found.update(self.job(job_id))
            return found.get("JobState") in states

        self._wait(reached, timeout_s, f"job {job_id} to be {'/'.join(sorted(states))}")
        return found

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        return {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}

    def wait_nodes_idle(self, timeout_s: float) -> None:
        """Until every node is idle (registered, nothing running)."""
        self._wait(lambda: list(self.node_states().values()) == ["idle"] * len(self.nodes), timeout_s, "nodes idle")

    def _wait(self, done, timeout_s: float, what: str, daemon: Daemon | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if daemon is not None and not daemon.alive():
                raise SlurmClusterError(f"{daemon.label} exited {daemon.popen.returncode}: {daemon.tail()}")
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {d.label}\n{d.tail(800)}" for d in self.daemons)
                raise SlurmClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{logs}")
            time.sleep(0.2)

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stops the slurmds, then whatever is left in the nodes' namespaces (slurmstepd, jobs), then slurmctld
        and munged, each by its pid: SIGTERM, then SIGKILL past ``grace_s``; removes the namespaces. Safe to call
        twice."""
        slurmds = [daemon for daemon in self.daemons if daemon.label.startswith("slurmd-")]
        for daemon in slurmds:
            daemon.terminate()
        deadline = time.monotonic() + grace_s
        while any(daemon.child_alive("slurmd") for daemon in slurmds) and time.monotonic() < deadline:
            time.sleep(0.1)
        # a job slurmd launched while it was being stopped is in no earlier list: ask the namespaces again
        for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
            self._signal_node_processes(sig, grace_s / 2)
        self.hosts.close()
        for daemon in reversed(self.daemons):
            daemon.stop(grace_s)
        self.daemons.clear()
        shutil.rmtree(self.munge_socket.parent, ignore_errors=True)

    def _signal_node_processes(self, sig: signal.Signals, wait_s: float) -> None:
        """``sig`` to every process in the nodes' namespaces; waits up to ``wait_s`` for them to be gone."""
        deadline = time.monotonic() + wait_s
        pids = [pid for host in self.nodes.values() for pid in self.hosts.pids(host)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        while time.monotonic() < deadline and any(self.hosts.pids(host) for host in self.nodes.values()):
            time.sleep(0.1)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
