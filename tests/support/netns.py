"""Several "hosts" on one machine, for the multi-host test and `make multihost`.

``Hosts.create(["a", "b", ...])`` gives each name a host of its own:

- network namespaces (mode ``netns``, needs root or CAP_NET_ADMIN and `ip`): one namespace per host with ``lo``
  up and one end of a veth pair, named ``eth0`` inside, holding the host's address in a /24 (the first of
  10.231.0.0/24, 10.231.1.0/24 ... that is not routed here yet; host i gets .(i+2)); the other ends are ports of
  one Linux bridge, which holds .1 so that this process (the test) reaches every host too. A command runs on a
  host under `ip netns exec NAME ...` (``Host.argv``).
- distinct loopback addresses (mode ``loopback``, the fallback where namespaces cannot be made): host i is
  127.0.0.(i+2) (Linux answers all of 127/8 on ``lo``); commands run as they are.

Names are unique per run (``prl`` + 6 random hex digits + a host index), so that concurrent runs never meet and
teardown (``Hosts.close``, also on failure or from a context manager) removes only what this run created: the
processes left in its namespaces, the namespaces (which take their veth ends along), the bridge.

``Proc`` is one process started on a host, its output (JSON log lines: ``events``) in a file.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

DEFAULT_SUBNET = "10.231.0.0/24"
SUBNET_FORMAT = "10.231.{}.0/24"
COMMAND_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """An `ip` command of the harness failed; the message holds the command and its output."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can make network namespaces, and why not: tried for real (a namespace made and
    removed), since root in a container may still lack CAP_NET_ADMIN."""
    if shutil.which("ip") is None:
        return False, "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return False, "not root (`ip netns add` needs CAP_NET_ADMIN)"
    probe = f"prl{secrets.token_hex(3)}probe"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"`ip netns add` failed: {err}"
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def free_subnet() -> str:
    """A /24 of 10.231.0.0/16 that no route of this machine's network namespace covers."""
    routes = _ip("-4", "route", "show").stdout
    routed = [
        ipaddress.ip_network(line.split()[0], strict=False)
        for line in routes.splitlines()
        if line and line.split()[0][0].isdigit()
    ]
    order = [0] + random.sample(range(1, 256), 255)
    for third in order:
        candidate = ipaddress.ip_network(SUBNET_FORMAT.format(third))
        if not any(candidate.overlaps(net) for net in routed):
            return str(candidate)
    raise NetnsError("every /24 of 10.231.0.0/16 is routed here already; pass a subnet")


@dataclass
class Host:
    """One host: its name in the run (``a``, ``b``...), its address, the namespace its commands run in (None on
    loopback) and the name of its interface (for GLOO_SOCKET_IFNAME and the like)."""

    name: str
    address: str
    namespace: str | None
    ifname: str

    def argv(self, command: list[str | Path]) -> list[str]:
        """``command`` run on this host."""
        command = [str(part) for part in command]
        return ["ip", "netns", "exec", self.namespace, *command] if self.namespace else command

    def endpoint(self, port: int) -> str:
        return f"{self.address}:{port}"


@dataclass
class Hosts:
    """The hosts of one run and what was made for them (see the module docstring)."""

    mode: str  # netns | loopback
    hosts: dict[str, Host] = field(default_factory=dict)
    why_loopback: str = ""
    bridge: str | None = None
    gateway: str | None = None  # the bridge's address: this process's own address on the hosts' network
    _namespaces: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, names: list[str], subnet: str | None = None, mode: str = "auto") -> Hosts:
        """Hosts for ``names``; ``mode`` ``auto`` picks namespaces where they can be made, else loopback.
        ``subnet`` unset: the first of 10.231.0.0/24, 10.231.1.0/24 ... (random order after the first) that
        this machine has no route to, so that concurrent runs (whose bridges all live here) never share one."""
        why = ""
        if mode in ("auto", "netns"):
            ok, why = namespaces_available()
            if not ok and mode == "netns":
                raise NetnsError(f"network namespaces are not available here: {why}")
            mode = "netns" if ok else "loopback"
        if mode == "loopback":
            hosts = cls("loopback", why_loopback=why)
            for index, name in enumerate(names):
                hosts.hosts[name] = Host(name, f"127.0.0.{index + 2}", None, "lo")
            return hosts
        hosts = cls("netns")
        try:
            hosts._make_namespaces(names, ipaddress.ip_network(subnet or free_subnet()))
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _make_namespaces(self, names: list[str], network: ipaddress.IPv4Network) -> None:
        tag = f"prl{secrets.token_hex(3)}"  # ip link names stay within 15 characters: tag + "br" / tag + index
        if len(names) + 2 >= network.num_addresses:
            raise NetnsError(f"{network} is too small for {len(names)} hosts")
        addresses = list(network.hosts())
        self.bridge, self.gateway = f"{tag}br", str(addresses[0])
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{network.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, name in enumerate(names):
            namespace, outside = f"{tag}{name}"[:15], f"{tag}v{index}"
            _ip("netns", "add", namespace)
            self._namespaces.append(namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            address = str(addresses[index + 1])
            _ip("-n", namespace, "addr", "add", f"{address}/{network.prefixlen}", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            self.hosts[name] = Host(name, address, namespace, "eth0")
        self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Until every host's address is usable (IPv4 addresses are, at once; the bridge ports may take a moment
        to forward): a TCP connect from the first host to each of the others answers (refused counts)."""
        names = list(self.hosts)
        probe = (
            "import socket,sys\nfor a in sys.argv[1:]:\n s=socket.socket();s.settimeout(1)\n"
            " try: s.connect((a, 9))\n except ConnectionRefusedError: pass\n s.close()\n"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            first = self.hosts[names[0]]
            others = [self.hosts[n].address for n in names[1:]] + [self.gateway or first.address]
            result = subprocess.run(
                first.argv([sys.executable, "-c", probe, *others]),
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"the hosts' network did not come up: {result.stderr.strip()[-500:]}")
            time.sleep(0.2)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def pids(self, host: Host) -> list[int]:
        """Processes running in ``host``'s namespace (none on loopback: they are not told apart there)."""
        if not host.namespace:
            return []
        result = _ip("netns", "pids", host.namespace, check=False)
        return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []

    def close(self, grace_s: float = 10.0) -> None:
        """Remove what this run made; processes still left in its namespaces get SIGTERM, then SIGKILL past
        ``grace_s``. Safe to call twice."""
        live = [ns for ns in self._namespaces if ns]
        pids = [pid for host in self.hosts.values() if host.namespace in live for pid in self.pids(host)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while pids and time.monotonic() < deadline:
                pids = [pid for pid in pids if _alive(pid)]
                time.sleep(0.1)
        for namespace in live:
            _ip("netns", "del", namespace, check=False)
        self._namespaces.clear()
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
            self.bridge = None

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        rows = [
            f"{h.name}: {h.address}" + (f" (netns {h.namespace}, {h.ifname})" if h.namespace else " (lo)")
            for h in self.hosts.values()
        ]
        return f"mode {self.mode}" + (f" ({self.why_loopback})" if self.why_loopback else "") + "\n" + "\n".join(rows)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours is not running any more
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class Proc:
    """One process started on a host, its output in ``log``; stopped with SIGTERM (then SIGKILL, its
    descendants too: torchrun's ranks run in sessions of their own)."""

    def __init__(self, label: str, host: Host, argv: list, env: dict[str, str], log: Path, cwd: Path):
        self.label, self.host, self.log = label, host, log
        self.started_s = time.monotonic()
        with open(log, "w") as out:
            self.popen = subprocess.Popen(
                host.argv(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
            )

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

    def kill(self) -> int | None:
        """SIGKILL to the process and its descendants at once, as a machine that drops off would."""
        try:
            family = [psutil.Process(self.popen.pid), *psutil.Process(self.popen.pid).children(recursive=True)]
        except psutil.Error:
            family = []
        for member in family:
            try:
                member.kill()
            except psutil.Error:
                pass
        return self.popen.wait(30)

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
