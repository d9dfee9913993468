"""A simulated fleet against a real `primerl-broker` process: many light workers that speak the real protocols through
the project's own clients (`ControlClient`, `WeightSubscriber`, `WeightPublisher`), no mock of the broker.

- `FleetBroker`: the broker process (ports chosen by the OS at the first start, the same ports and spool after a
  SIGKILL), with its CPU seconds and RSS read from /proc (psutil).
- `member_process`: the body of one simulator process (multiprocessing, spawn). It runs many simulated members: each
  a `ControlClient` heartbeating in its own thread through the real retry, backoff and re-registration path; an
  inference member also has a `WeightSubscriber` thread that says HELLO under its current worker id, acknowledges
  every update it receives, and starts over under the new id after the broker forgot it (a restart). Each process
  sends `MemberReport`s on a queue: heartbeat round trips, acknowledgements (wall clock), registrations.
- `Fleet`: the driver side: starts the processes, drains their reports, counts who is registered.
- `RunDriver`: trainer rank 0 (commits each step, reports its metrics, publishes its policy) and an observer
  (`primerl status`: the live workers, the run history's LOST events).

The simulator shares the machine with the broker: on 2 cores its processes, not the broker, bound how many members
can heartbeat on time (each heartbeat costs the simulator about what it costs the broker).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from support.daemons import BIN, BROKER_START_TIMEOUT_S, DaemonProcess

REPORT_EVERY_S = 1.0
"""How often a simulator process sends what it measured."""


# ------------------------------------------------------------------------------------------------ the broker
class FleetBroker:
    """`primerl-broker` on 127.0.0.1: free ports at the first start, the same ports and spool dir after `kill()`."""

    def __init__(self, tmp: Path, *extra: str, heartbeat_interval_s: float = 1.0, run_token: str = "fleet-token"):
        self.tmp = tmp
        self.spool_dir = tmp / "spool"
        self.extra = list(extra)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.run_token = run_token
        self.ports = {"grpc_port": 0, "rollout_port": 0, "weight_port": 0}
        self.daemon: DaemonProcess | None = None
        self.num_starts = 0
        self.start()

    def start(self) -> None:
        self.num_starts += 1
        ready_file = self.tmp / f"broker-{self.num_starts}-ready.json"
        args = [str(BIN / "primerl-broker"), "--spool-dir", str(self.spool_dir), "--ready-file", str(ready_file)]
        for key, port in self.ports.items():
            args += [f"--{key.replace('_', '-')}", str(port)]
        args += ["--heartbeat-interval-s", str(self.heartbeat_interval_s), "--log.level", "warning", *self.extra]
        env = {"PRIMERL_RUN_TOKEN": self.run_token}
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        while True:  # the old sockets may hold the ports for a moment after a SIGKILL
            try:
                self.daemon = DaemonProcess(
                    args, self.tmp / f"broker-{self.num_starts}.log", ready_file, BROKER_START_TIMEOUT_S, env=env
                )
                break
            except BaseException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.ports = {key: self.daemon.ready[key] for key in self.ports}
        self._proc = psutil.Process(self.daemon.pid)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc_port']}"

    @property
    def weight_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['weight_port']}"

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.daemon is not None
        self.daemon.kill()

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop(timeout_s=20)

    def cpu_s(self) -> float:
        times = self._proc.cpu_times()
        return times.user + times.system

    def rss_bytes(self) -> int:
        return self._proc.memory_info().rss

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.daemon.log_tail(num_chars) if self.daemon is not None else ""


# ------------------------------------------------------------------------------------------ simulator side
@dataclass(frozen=True)
class MemberSpec:
    """One simulated member: its role, name and (trainer) rank."""

    role: str
    name: str
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class ProcessSpec:
    """What one simulator process runs."""

    address: str
    run_token: str
    members: tuple[MemberSpec, ...]
    weights: bool = True  # inference members subscribe to the weight plane and acknowledge
    relay: bool = False  # ...and bind a relay socket (broker `weight_fanout = "chain"`)
    hello_interval_s: float = 5.0
    outage_s: float = 600.0
    start_spread_s: float = 2.0  # members start spread over this long (a fleet does not boot in one instant)
    # niceness of the member processes (not the probe): > 0 keeps the simulated fleet from taking the CPU from the
    # broker it measures (a real fleet runs on other machines)
    nice: int = 0


@dataclass
class MemberReport:
    """What a simulator process measured since its last report."""

    process: int
    heartbeat_s: list[float] = field(default_factory=list)  # round trips of heartbeats that succeeded
    acks: list[tuple[str, int, float]] = field(default_factory=list)  # (member name, policy version, unix time)
    registrations: dict[str, int] = field(default_factory=dict)  # member name -> registrations so far
    registered: dict[str, str] = field(default_factory=dict)  # member name -> current worker id ("" none)
    errors: list[str] = field(default_factory=list)
    final: bool = False
    probe_s: list[float] = field(default_factory=list)  # round trips of the lone latency probe


def _timed_client_class():
    from primerl.client.control import ControlClient

    class TimedControlClient(ControlClient):
        """A `ControlClient` that keeps the round trip of each heartbeat its thread sends."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.round_trips: list[float] = []

        def _heartbeat_as(self, worker_id: str, progress: Mapping[str, Any]):
            started = time.monotonic()
            response = super()._heartbeat_as(worker_id, progress)
            self.round_trips.append(time.monotonic() - started)
            return response

    return TimedControlClient


def _subscribe(
    client, spec: ProcessSpec, context, stop: threading.Event, acks: list, errors: list, lock: threading.Lock
) -> None:
    """An inference member's weight thread: HELLO under the current worker id, acknowledge every update, start over
    under a new id when the member registered again."""
    from primerl.client.weights import WeightSubscriber

    version: int | None = None
    while not stop.is_set():
        worker_id = client.worker_id
        registration = client.registration
        if worker_id is None or registration is None:
            stop.wait(0.2)
            continue
        subscriber = WeightSubscriber(
            registration.weight_endpoint,
            spec.run_token,
            worker_id,
            context=context,
            limits=client.limits.frames,
            hello_interval_s=spec.hello_interval_s,
            relay_host="127.0.0.1" if spec.relay else None,
            shared_memory=False,
        )
        try:
            subscriber.hello(version)
            while not stop.is_set() and client.worker_id == worker_id:
                got = subscriber.receive(1.0)
                if got is None:
                    continue
                header = got[0]
                subscriber.ack(header.policy_version, lineage=header.lineage)
                version = header.policy_version
                with lock:
                    acks.append((client.name, version, time.time()))
        except Exception as err:  # a simulated member keeps going; the driver sees the error
            with lock:
                errors.append(f"{client.name}: weight subscriber failed: {err!r}"[:300])
            stop.wait(0.5)
        finally:
            subscriber.close()


def member_process(index: int, spec: ProcessSpec, reports: mp.Queue, stop: Any, step: Any) -> None:
    """One simulator process (see the module docstring); runs until `stop` (an `mp.Event`) is set."""
    import zmq

    from primerl.runtime.config_common import BrokerClientConfig
    from primerl.runtime.log_setup import configure_logging

    configure_logging("fleet-sim", "fleet", level="error")
    if spec.nice:
        os.nice(spec.nice)
    client_class = _timed_client_class()
    config = BrokerClientConfig(address=spec.address, run_token=spec.run_token, outage_s=spec.outage_s)
    context = zmq.Context()
    local_stop = threading.Event()
    lock = threading.Lock()
    acks: list[tuple[str, int, float]] = []
    errors: list[str] = []
    clients, threads = [], []
    pause_s = spec.start_spread_s / max(1, len(spec.members))
    for member in spec.members:
        client = client_class(config, member.role, member.name, rank=member.rank, world_size=member.world_size)
        client.start_heartbeats(_progress_fn(member.role, step))
        clients.append(client)
        if spec.weights and member.role == "inference":
            thread = threading.Thread(
                target=_subscribe, args=(client, spec, context, local_stop, acks, errors, lock), daemon=True
            )
            thread.start()
            threads.append(thread)
        time.sleep(pause_s)
    while not stop.wait(REPORT_EVERY_S):
        reports.put(_report(index, clients, acks, errors, lock))
    local_stop.set()
    for thread in threads:
        thread.join(5)
    reports.put(_report(index, clients, acks, errors, lock, final=True))
    for client in clients:
        client.close(timeout_s=1)
    context.destroy(linger=0)


def probe_process(spec: ProcessSpec, reports: mp.Queue, stop: Any, interval_s: float = 0.1) -> None:
    """A lone heartbeating worker in a quiet process of its own, heartbeating every `interval_s` through the public
    `heartbeat()`: the broker's latency without the simulator's own contention (its hundreds of threads)."""
    from primerl.runtime.config_common import BrokerClientConfig
    from primerl.runtime.log_setup import configure_logging

    configure_logging("fleet-probe", "fleet", level="error")
    client_class = _timed_client_class()
    config = BrokerClientConfig(address=spec.address, run_token=spec.run_token, outage_s=spec.outage_s)
    client = client_class(config, "inference", "latency-probe")
    client.register()
    trips: list[float] = []
    while not stop.wait(interval_s):
        started = time.monotonic()
        try:
            client.heartbeat()
        except Exception:  # a broker restart: the driver sees it in the other reports
            client.register()
            continue
        trips.append(time.monotonic() - started)
        if len(trips) >= 50:
            reports.put(MemberReport(-1, probe_s=trips))
            trips = []
    reports.put(MemberReport(-1, probe_s=trips))
    client.close(timeout_s=1)


def _progress_fn(role: str, step: Any):
    if role == "trainer":
        return lambda: {"trainer_step": step.value}
    if role == "orchestrator":
        return lambda: {"orchestrator_step": step.value}
    return None


def _report(
    index: int, clients: list, acks: list, errors: list, lock: threading.Lock, final: bool = False
) -> MemberReport:
    report = MemberReport(index, final=final)
    for client in clients:
        trips, client.round_trips = client.round_trips, []
        report.heartbeat_s.extend(trips)
        report.registrations[client.name] = client.num_registrations
        report.registered[client.name] = client.worker_id or ""
    with lock:
        report.acks, acks[:] = list(acks), []
        report.errors, errors[:] = list(errors), []
    return report


# -------------------------------------------------------------------------------------------- driver side
def fleet_members(num_inference: int, num_trainer_ranks: int, num_orchestrators: int) -> list[MemberSpec]:
    """The fleet's members; trainer rank 0 is left to the driver (it publishes and commits)."""
    members = [MemberSpec("inference", f"infer-{i}") for i in range(num_inference)]
    members += [MemberSpec("trainer", f"trainer-{r}", r, num_trainer_ranks) for r in range(1, num_trainer_ranks)]
    members += [MemberSpec("orchestrator", f"orch-{k}") for k in range(num_orchestrators)]
    return members


class Fleet:
    """Simulator processes over `members` (round-robin), and what they report, merged."""

    def __init__(self, members: list[MemberSpec], num_processes: int, *, probe: bool = False, **spec_fields: Any):
        ctx = mp.get_context("spawn")
        self.reports: mp.Queue = ctx.Queue()
        self.stop_event = ctx.Event()
        self.step = ctx.Value("i", 0)
        self.members = members
        self.heartbeat_s: list[float] = []
        self.probe_s: list[float] = []
        self.acks: dict[int, dict[str, float]] = {}  # version -> member -> first ack time
        self.registrations: dict[str, int] = {}
        self.registered: dict[str, str] = {}
        self.errors: list[str] = []
        self.num_final = 0
        self.processes = []
        for index in range(num_processes):
            spec = ProcessSpec(members=tuple(members[index::num_processes]), **spec_fields)
            process = ctx.Process(
                target=member_process, args=(index, spec, self.reports, self.stop_event, self.step), daemon=True
            )
            process.start()
            self.processes.append(process)
        self.probe = None
        if probe:
            spec = ProcessSpec(members=(), **spec_fields)
            self.probe = ctx.Process(
                target=probe_process, args=(spec, self.reports, self.stop_event), daemon=True, name="fleet-probe"
            )
            self.probe.start()

    def drain(self, timeout_s: float = 0.0) -> None:
        """Merge the reports waiting (waiting up to `timeout_s` for the first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                report: MemberReport = self.reports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            self.heartbeat_s.extend(report.heartbeat_s)
            self.probe_s.extend(report.probe_s)
            for name, version, unix_s in report.acks:
                self.acks.setdefault(version, {}).setdefault(name, unix_s)
            self.registrations.update(report.registrations)
            self.registered.update(report.registered)
            self.errors.extend(report.errors)
            self.num_final += report.final
            deadline = time.monotonic()  # take the rest without waiting

    def take_heartbeats(self) -> tuple[list[float], list[float]]:
        """The heartbeat round trips the members and the probe saw since the last call."""
        taken, self.heartbeat_s = self.heartbeat_s, []
        probed, self.probe_s = self.probe_s, []
        return taken, probed

    def num_registered(self) -> int:
        return sum(1 for worker_id in self.registered.values() if worker_id)

    def wait_acked(self, version: int, names: set[str], timeout_s: float) -> float | None:
        """The unix time the last of `names` acknowledged `version` (None: not all of them within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.drain(0.2)
            acked = self.acks.get(version, {})
            if names <= acked.keys():
                return max(acked[name] for name in names)
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        self.stop_event.set()
        deadline = time.monotonic() + timeout_s
        while self.num_final < len(self.processes) and time.monotonic() < deadline:
            self.drain(0.5)
        for process in self.processes + ([self.probe] if self.probe is not None else []):
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)


class RunDriver:
    """Trainer rank 0 of the simulated run (it commits, reports metrics and publishes a small FULL update per step)
    and an observer client, against `broker`."""

    def __init__(self, broker: FleetBroker, num_trainer_ranks: int):
        from primerl.client.control import ControlClient
        from primerl.runtime.config_common import BrokerClientConfig

        config = BrokerClientConfig(address=broker.address, run_token=broker.run_token, outage_s=600)
        self.broker = broker
        self.step = 0
        self.trainer = ControlClient(config, "trainer", "trainer-0", rank=0, world_size=num_trainer_ranks)
        self.trainer.start_heartbeats(lambda: {"trainer_step": self.step})
        self.observer = ControlClient(config, "client", "fleet-observer")

    def num_alive(self) -> int:
        """Live workers the broker lists (-1: it did not answer)."""
        from primerl.client.broker_errors import BrokerError

        try:
            return len(self.observer.list_workers())
        except BrokerError:
            return -1

    def wait_registered(self, fleet: Fleet, expected: int, timeout_s: float) -> float | None:
        """Seconds until the broker lists `expected` live workers (None: not within `timeout_s`)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            fleet.drain(0.5)
            if self.num_alive() >= expected:
                return time.monotonic() - started
        return None

    def take_step(self, fleet: Fleet, names: set[str], timeout_s: float = 60.0) -> float | None:
        """Commit the next step, report its metrics, publish its policy; seconds from the publish until all of
        `names` acknowledged it (None: not within `timeout_s`)."""
        from primerl.client.weight_publisher import WeightPublisher
        from support.weight_updates import tiny_update

        self.step += 1
        fleet.step.value = self.step
        self.trainer.commit_step(self.step)
        self.trainer.report_metrics(self.step, {"loss": 1.0 / self.step, "reward": 0.5})
        header, payload = tiny_update(self.step, lineage=self.trainer.policy_lineage, num_values=1024)
        started = time.time()
        with WeightPublisher(
            self.broker.weight_endpoint, self.broker.run_token, "trainer-0", 1 << 20, connect_timeout_s=30
        ) as publisher:
            publisher.publish(header, payload, timeout_s=30)
        done = fleet.wait_acked(self.step, names, timeout_s)
        return None if done is None else done - started

    def lost_events(self, since_unix_s: float = 0.0) -> list[str]:
        """The workers the run history says were marked LOST from `since_unix_s` on."""
        lost, events_since = [], 0
        for _ in range(1000):  # a long history comes in parts (replies of at most 3 MiB)
            history = self.observer.get_run_history(events_since=events_since, timeout_s=10)
            lost += [e.source for e in history.events if e.kind == "lost" and e.unix_ms / 1000 >= since_unix_s]
            if not history.truncated or history.events_next <= events_since:
                break
            events_since = history.events_next
        return lost

    def close(self) -> None:
        self.trainer.close(timeout_s=2)
        self.observer.close()
