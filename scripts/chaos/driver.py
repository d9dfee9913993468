"""One chaos run from start to end: start the roles, follow their logs, fire the seeded kills at their moments,
poll the broker's run status (the RPC behind `primerl status --json`), wait for the trainer to finish, take the
final status, stop everything, and look for any process left. What it records is judged in ``checks``."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field

from primerl.proto import telemetry
from primerl.proto.shared_segment import stale_segments
from primerl.supervisor.fleet_view import annotate_json

from .logs import Event, LogFollower
from .plan import (
    CHECKPOINT_DISK,
    CLOCK,
    DISKS,
    ENGINE,
    HELD_FAULTS,
    INFERENCE_NET,
    LAUNCHER,
    MID_SEND,
    PARTITIONS,
    SPOOL_DISK,
    TRAINER_NET,
    TRAINER_RANK,
    KillSpec,
)
from .procs import Exit, describe, marked_processes
from .runs import (
    BIN,
    CHECKPOINT_DISK_MIB,
    CKPT_INTERVAL,
    RELAY_ROLE,
    ROLES,
    SPOOL_DISK_MIB,
    RlBackend,
    RunSpec,
    SeparateBackend,
    SmallDisk,
    base_env,
)

POLL_S = 0.02
STATUS_POLL_S = 0.5
RECOVERY_BOUND_S = 240.0  # a kill whose role is not back by then: the next kill is armed anyway
FINAL_VERSION_TIMEOUT_S = 60.0
STALL_RESUME_BOUND_S = 90.0  # a held fault (engine stopped, disk full) not reported for this long is released anyway
LEFTOVER_GRACE_S = 5.0
RECOVERED_BY = {  # killed role -> the (role, event) that says it is back
    "broker": ("broker", "broker serving"),
    "inference": ("inference", "inference worker ready"),
    "orchestrator": ("orchestrator", "registered with the broker"),
    "trainer": ("trainer", "registered with the broker"),
    RELAY_ROLE: (RELAY_ROLE, "relay worker ready"),
    LAUNCHER: ("trainer", "registered with the broker"),  # the relaunched `primerl rl` got as far as training
    TRAINER_RANK: ("trainer", "registered with the broker"),  # the restarted torchrun's ranks
    ENGINE: ("inference", telemetry.INFERENCE_ENGINE_RECOVERED),  # resumed, and its watchdog saw it answer
    SPOOL_DISK: ("broker", telemetry.SPOOL_ROOM_AGAIN),  # freed, and a batch was spooled again
    CHECKPOINT_DISK: ("trainer", telemetry.CHECKPOINT_SAVED),  # freed, and the restarted trainer saved one again
    CLOCK: ("trainer", "registered with the broker"),  # the trainer restarted with its clock skewed
    INFERENCE_NET: ("trainer", telemetry.STEP_DONE),  # healed, and steps come again (heal to full speed)
    TRAINER_NET: ("trainer", telemetry.STEP_DONE),
    MID_SEND: ("orchestrator", "registered with the broker"),  # the orchestrator restarted after its fault point
}
SEEN_BY = {  # held fault -> the (role, event) that says the system noticed it
    ENGINE: ("inference", telemetry.INFERENCE_ENGINE_STALLED),
    SPOOL_DISK: ("broker", telemetry.SPOOL_DISK_FULL),
    CHECKPOINT_DISK: ("trainer", telemetry.CHECKPOINT_DISK_FULL),
    # a partition longer than the liveness window: the broker marks the cut-off worker lost
    INFERENCE_NET: ("broker", "workers lost: no heartbeat"),
    TRAINER_NET: ("broker", "workers lost: no heartbeat"),
    MID_SEND: ("orchestrator", telemetry.FAULT_ORCHESTRATOR_EXIT),  # it sent k micro-batches and killed itself
}


def _held(spec: KillSpec) -> bool:
    """A fault the harness holds and then releases (an engine stopped, a disk full, a host cut off), not a kill."""
    return spec.role in HELD_FAULTS or spec.role in PARTITIONS


@dataclass
class Kill:
    spec: KillSpec
    pid: int | None = None
    at_s: float = 0.0
    trainer_step: int = 0  # the newest "step done" at the kill
    note: str = ""  # what the moment was (the version pushed, published)
    recovered_s: float | None = None  # the role registered (served) again, seconds after the kill
    next_step_s: float | None = None  # the trainer's next "step done" after the kill
    orphans: list[str] = field(default_factory=list)  # its descendants still alive 2 s after the kill
    # mid-relay: the version the relay was forwarding, and when the inference worker served it (or a later one)
    version: int = 0
    healed_s: float | None = None
    # held faults (stall of the engine, full spool disk): when the system reported the fault, and when the harness
    # released it (resumed the engine, deleted the filler), seconds after the fault
    stalled_s: float | None = None
    resumed_s: float | None = None
    filled_bytes: int = 0  # full: what the filler took

    @property
    def fired(self) -> bool:
        """The fault took place (a role not running when its kill came: nothing happened)."""
        return self.pid is not None or (self.spec.role in DISKS and self.filled_bytes > 0)


@dataclass
class RunRecord:
    spec: RunSpec
    kills: list[Kill] = field(default_factory=list)
    unfired: list[KillSpec] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)
    statuses: list[tuple[float, dict]] = field(default_factory=list)  # (wall s, RunStatus as a dict)
    final_status: dict | None = None
    final_status_error: str = ""
    status_errors: int = 0  # GetRunStatus polls that failed (an outage explains some)
    last_status_error: str = ""
    leftovers: list[str] = field(default_factory=list)
    aborted: str = ""  # why the run was given up (stall, timeout, a role given up by the restarter)
    started_s: float = 0.0  # wall clock
    wall_s: float = 0.0
    rl_exit_code: int | None = None


class StatusPoller(threading.Thread):
    """Polls GetRunStatus twice a second in its own thread (an RPC may wait through an outage: not on the loop)."""

    def __init__(self, spec: RunSpec, record: RunRecord):
        super().__init__(name="chaos-status", daemon=True)
        self.spec, self.record = spec, record
        self.halt = threading.Event()

    def run(self) -> None:
        from google.protobuf.json_format import MessageToDict

        from primerl.client.broker_errors import BrokerError
        from primerl.client.control import ControlClient
        from primerl.runtime.config_common import BrokerClientConfig

        client = ControlClient(
            BrokerClientConfig(address=self.spec.broker_address, run_token=self.spec.token),
            role="client",
            name="chaos-status",
            rpc_timeout_s=2.0,
        )
        try:
            while not self.halt.wait(STATUS_POLL_S):
                try:
                    status = client.get_run_status()
                except (BrokerError, ValueError, RuntimeError) as error:
                    self.record.status_errors += 1
                    self.record.last_status_error = f"{type(error).__name__}: {error}"[:300]
                    continue
                # as `primerl status --json` says it: each worker's condition (serving, lost...), which
                # ``served_final`` reads
                data = MessageToDict(
                    status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                )
                self.record.statuses.append((time.time(), annotate_json(status, data)))
        finally:
            client.close()


def primerl_status_json(spec: RunSpec) -> tuple[dict | None, str]:
    """`primerl status --json` against the run's broker."""
    env = {**base_env(spec.marker), "PRIMERL_RUN_TOKEN": spec.token}
    try:
        result = subprocess.run(
            [str(BIN / "primerl"), "status", "--broker", spec.broker_address, "--json", "--timeout-s", "10"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, "primerl status did not answer within 60 s"
    if result.returncode != 0:
        return None, f"primerl status exited {result.returncode}: {result.stderr.strip()[-300:]}"
    return json.loads(result.stdout), ""


def served_final(status: dict | None, max_steps: int) -> bool:
    """Every inference worker that is serving (``primerl status --json``'s ``condition``: a worker the harness killed
    and the broker marked lost, or one that left, serves nothing) holds the last version, and there is one."""
    if not status:
        return False
    workers = [
        w for w in status.get("workers", []) if w.get("role") == "ROLE_INFERENCE" and w.get("condition") == "serving"
    ]
    latest = int(status.get("latest_policy_version", 0))
    return latest == max_steps and bool(workers) and all(int(w.get("policy_version", -1)) == latest for w in workers)


class Driver:
    def __init__(self, spec: RunSpec, plan: list[KillSpec], *, timeout_s: float, stall_s: float, say=print):
        self.spec, self.plan = spec, list(plan)
        self.timeout_s, self.stall_s = timeout_s, stall_s
        self.say = say
        self.record = RunRecord(spec)
        self.backend = SeparateBackend(spec) if spec.mode == "separate" else RlBackend(spec)
        roles = (*ROLES, RELAY_ROLE) if spec.relay else ROLES
        self.followers = {r: LogFollower(r, spec.run_dir / "logs" / f"{r}.log") for r in roles}
        self.events: list[Event] = []
        self.last_step = 0
        self.last_step_s = time.time()
        self.trainer_finished = False
        self.disks: dict[str, SmallDisk] = {}  # fault role -> the tmpfs it fills
        if spec.disk:
            self.disks[SPOOL_DISK] = SmallDisk(spec.spool_dir, SPOOL_DISK_MIB)
        if spec.checkpoint_disk:
            self.disks[CHECKPOINT_DISK] = SmallDisk(spec.checkpoint_dir, CHECKPOINT_DISK_MIB)

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> RunRecord:
        record, spec = self.record, self.spec
        started_s = record.started_s = time.time()
        poller = StatusPoller(spec, record)
        try:
            for disk in self.disks.values():
                disk.mount()
            self.backend.start()
            poller.start()
            self._loop(started_s)
            if not record.aborted and spec.mode == "separate":
                self._final_status()
        except Exception as error:  # the harness's own failure: recorded, and everything is still stopped
            record.aborted = record.aborted or f"harness error: {type(error).__name__}: {error}"
            raise
        except KeyboardInterrupt:
            record.aborted = "interrupted"
            raise
        finally:
            for kill in record.kills:  # never leave a fault held: the roles could not stop
                if _held(kill.spec) and kill.fired and kill.resumed_s is None:
                    self._release(kill)
                    kill.resumed_s = time.time() - kill.at_s
            spec.mid_send_trigger.unlink(missing_ok=True)  # a fault point armed too late to fire
            poller.halt.set()
            if spec.mode == "rl":
                self.backend.trainer_finished = self.trainer_finished
            self.backend.stop()
            for disk in self.disks.values():
                disk.release()
            poller.join(5.0)
            self._drain_logs()
            for kill in record.kills:  # over every event now: a later kill's wait no longer hides one
                if kill.fired:
                    kill.recovered_s = kill.next_step_s = None
                    self._update_recovery(kill, self.events)
            record.exits = self.backend.exits()
            record.starts = self.backend.starts()
            record.unfired = self.plan
            if isinstance(self.backend, RlBackend):
                record.rl_exit_code = self.backend.exit_code()
                record.final_status = self._last_status_after_finish()
            record.leftovers = self._leftovers()
            self.backend.close()
            with open(spec.run_dir / "status_polls.jsonl", "w") as polls:  # what the checks of the status saw
                for at_s, status in record.statuses:
                    polls.write(json.dumps({"at_s": round(at_s, 3), **status}) + "\n")
            record.wall_s = time.time() - started_s
        return record

    def _loop(self, started_s: float) -> None:
        armed_at_step: int | None = None
        current: Kill | None = None
        fire_at_s: float | None = None
        note = ""
        while True:
            now = time.time()
            for ended in self.backend.poll():
                tag = "harness" if ended.planned else "not caused by the harness"
                self.say(f"    exit: {ended.role} pid {ended.pid} status {ended.code} ({tag})")
            new_events = self._drain_logs()
            if self.backend.finished():
                return
            given_up = self.backend.given_up()
            if given_up:
                self.record.aborted = f"the restarter gave up on {given_up} (start limit hit)"
                return
            if now - started_s > self.timeout_s:
                self.record.aborted = f"run timeout ({self.timeout_s:g} s) at trainer step {self.last_step}"
                return
            if now - self.last_step_s > self.stall_s:
                self.record.aborted = f"stalled: no trainer step done for {self.stall_s:g} s (at step {self.last_step})"
                return
            # the previous kill's recovery, then arming the next one
            if current is not None:
                self._update_recovery(current, new_events)
                self._tend_held(current, now)
                if current.recovered_s is not None or now - current.at_s > RECOVERY_BOUND_S:
                    current = None
            if current is None and self.plan and armed_at_step is None and self.last_step > 0:
                armed_at_step = self.last_step + self.plan[0].gap_steps
            if current is None and armed_at_step is not None and self.plan and not self.trainer_finished:
                spec = self.plan[0]
                moment = self._moment(spec, armed_at_step, new_events) if fire_at_s is None else None
                if moment is not None:  # a held fault's delay is how long it is held once seen, not a wait before it
                    fire_at_s, note = now + (0.0 if _held(spec) else spec.delay_s), moment
                if fire_at_s is not None and now >= fire_at_s:
                    current = self._kill(spec, note)
                    self.plan.pop(0)
                    armed_at_step, fire_at_s = None, None
            time.sleep(POLL_S)

    def _moment(self, spec: KillSpec, armed_at_step: int, new_events: list[Event]) -> str | None:
        """A note describing the moment when ``spec`` should fire now, else None."""
        if spec.moment in ("random", "skew", "mid-send"):
            return f"{spec.delay_s:.2f} s after step {self.last_step} done" if self.last_step >= armed_at_step else None
        if _held(spec):
            return f"after step {self.last_step} done" if self.last_step >= armed_at_step else None
        for event in new_events:
            if (
                spec.moment == "mid-relay"
                and event.role == RELAY_ROLE
                and event.name == "relay worker holding"
                and self.last_step >= armed_at_step - 1
            ):
                return f"relay holding v{event.get('policy_version')}"
            if (
                spec.moment == "push"
                and event.role == "broker"
                and event.name == telemetry.WEIGHT_UPDATE_STORED
                and self.last_step >= armed_at_step - 1
            ):
                return f"broker stored {event.get('update')}"
            if (
                spec.moment == "mapping"
                and event.role == "inference"
                and event.name == telemetry.WEIGHT_UPDATE_RECEIVED
                and self.last_step >= armed_at_step - 1
            ):
                return f"inference received v{event.get('policy_version')}"
            if (
                spec.moment == "publish-before-checkpoint"
                and event.role == "trainer"
                and event.name == telemetry.POLICY_PUBLISHED
            ):
                version = int(event.get("policy_version", 0))
                if version >= armed_at_step and version % CKPT_INTERVAL and version < self.spec.max_steps:
                    return f"trainer published v{version} (newest checkpoint older)"
        return None

    def _kill(self, spec: KillSpec, note: str) -> Kill:
        import psutil

        kill = Kill(spec, at_s=time.time(), trainer_step=self.last_step, note=note)
        if spec.moment == "mid-relay":
            stored = re.search(r"\bv(\d+)\b", note)
            kill.version = int(stored.group(1)) if stored else 0
            live = [e for e in self.events if e.role == "inference" and e.name == telemetry.WEIGHT_UPDATE_LIVE]
            served = int(live[-1].get("policy_version", 0)) if live else 0
            kill.note += f"; inference served v{served} at the kill"
        if spec.role == ENGINE:
            kill.pid = self.backend.stop_engine()
            self.record.kills.append(kill)
            self.say(f"    stall: {spec.describe()} engine core pid {kill.pid} at step {self.last_step}: {note}")
            if kill.pid is None:
                kill.note += " (no engine core found: nothing stopped)"
                kill.recovered_s = 0.0
            return kill
        if spec.role in PARTITIONS:
            kill.pid = self.backend.cut(PARTITIONS[spec.role])
            self.record.kills.append(kill)
            self.say(f"    partition: {spec.describe()} {PARTITIONS[spec.role]} pid {kill.pid} cut off: {note}")
            return kill
        if spec.role in DISKS:
            assert spec.role in self.disks, f"a {spec.role} fault in a run without its tmpfs"
            kill.filled_bytes = self.disks[spec.role].fill()
            self.record.kills.append(kill)
            self.say(
                f"    disk: {spec.describe()} {self.disks[spec.role].path.name} filesystem filled "
                f"({kill.filled_bytes / 2**20:.1f} MiB) at step {self.last_step}: {note}"
            )
            return kill
        pid = self.backend.pid({CLOCK: "trainer", MID_SEND: "orchestrator"}.get(spec.role, spec.role))
        children = []
        if pid is not None:
            try:
                children = psutil.Process(pid).children(recursive=True)
            except psutil.Error:
                children = []
        if spec.role == CLOCK:
            kill.pid = self.backend.skew_clock("trainer", spec.skew_s)
        elif spec.role == MID_SEND:
            kill.pid = self.backend.arm_mid_send(spec.acks)
        else:
            kill.pid = self.backend.kill(spec.role)
        self.record.kills.append(kill)
        self.say(f"    kill: {spec.describe()} pid {kill.pid} at trainer step {self.last_step}: {note}")
        if kill.pid is None:
            kill.note += " (role not running: nothing killed)"
            kill.recovered_s = 0.0
        elif children:
            time.sleep(2.0)
            kill.orphans = [describe(c) for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if spec.role == "broker" and spec.moment == "push":
            live = [e for e in self.events if e.role == "inference" and e.name == telemetry.WEIGHT_UPDATE_LIVE]
            kill.note += f"; inference had applied up to v{live[-1].get('policy_version') if live else '-'}"
        return kill

    def _tend_held(self, kill: Kill, now: float) -> None:
        """A held fault (a stopped engine core, a full spool disk) is released ``delay_s`` after the system reported
        it (or past a bound)."""
        if not _held(kill.spec) or not kill.fired or kill.resumed_s is not None:
            return
        if kill.spec.role in PARTITIONS:  # healed after its seeded length, seen or not
            if now >= kill.at_s + kill.spec.hold_s:
                self._release(kill)
                kill.resumed_s = now - kill.at_s
                self.say(f"    healed: {kill.spec.role} plugged back {kill.resumed_s:.1f} s after the cut")
            return
        if kill.spec.role in self.disks:  # space the role freed itself is taken too, until the release
            kill.filled_bytes += self.disks[kill.spec.role].fill()
        seen = kill.stalled_s is not None and now >= kill.at_s + kill.stalled_s + kill.spec.delay_s
        if seen or now - kill.at_s > STALL_RESUME_BOUND_S:
            if not seen:
                who, _ = SEEN_BY[kill.spec.role]
                kill.note += f"; its {who} reported no {kill.spec.moment} within {STALL_RESUME_BOUND_S:g} s"
            self._release(kill)
            kill.resumed_s = now - kill.at_s
            what = f"engine core pid {kill.pid} resumed" if kill.spec.role == ENGINE else f"{kill.spec.role} freed"
            self.say(f"    released: {what} {kill.resumed_s:.1f} s after the fault")

    def _release(self, kill: Kill) -> None:
        if kill.spec.role == ENGINE:
            assert kill.pid is not None
            self.backend.resume_engine(kill.pid)
        elif kill.spec.role in PARTITIONS:
            self.backend.heal(PARTITIONS[kill.spec.role])
        elif kill.spec.role in self.disks:
            self.disks[kill.spec.role].free()

    def _update_recovery(self, kill: Kill, new_events: list[Event]) -> None:
        for event in new_events:
            if event.at_s < kill.at_s:
                continue
            if (
                kill.spec.role in SEEN_BY
                and kill.stalled_s is None
                and (event.role, event.name) == SEEN_BY[kill.spec.role]
                # a host cut off is seen lost while it is cut (a later loss is another fault's)
                and (kill.spec.role not in PARTITIONS or event.at_s <= kill.at_s + kill.spec.hold_s + 1.0)
            ):
                kill.stalled_s = event.at_s - kill.at_s
            if _held(kill.spec) and (kill.resumed_s is None or event.at_s < kill.at_s + kill.resumed_s):
                continue  # "recovered" only counts once the harness released it
            if kill.spec.role == MID_SEND and (kill.stalled_s is None or event.at_s < kill.at_s + kill.stalled_s):
                continue  # back: registered after it hit its fault point
            if kill.recovered_s is None and (event.role, event.name) == RECOVERED_BY[kill.spec.role]:
                kill.recovered_s = event.at_s - kill.at_s
            if kill.next_step_s is None and event.role == "trainer" and event.name == telemetry.STEP_DONE:
                kill.next_step_s = event.at_s - kill.at_s
            if (
                kill.spec.moment == "mid-relay"
                and kill.healed_s is None
                and event.role == "inference"
                and event.name == telemetry.WEIGHT_UPDATE_LIVE
                and int(event.get("policy_version", 0)) >= kill.version
            ):
                kill.healed_s = event.at_s - kill.at_s

    def _drain_logs(self) -> list[Event]:
        new = []
        for follower in self.followers.values():
            new += follower.read()
        for event in new:
            if event.role == "trainer" and event.name == telemetry.STEP_DONE:
                self.last_step = max(self.last_step, int(event.get("step", 0)))
                self.last_step_s = time.time()
            if event.role == "trainer" and event.name == telemetry.TRAINING_FINISHED:
                self.trainer_finished = True
                if isinstance(self.backend, RlBackend):
                    self.backend.trainer_finished = True
        self.events += new
        # kills still waiting on a recovery see the events through the loop's new_events
        return new

    # ------------------------------------------------------------------------------------------------ end
    def _final_status(self) -> None:
        """Separate mode: the trainer is done; wait (bounded) for every inference worker to serve the final
        version, then keep what `primerl status --json` says."""
        deadline = time.time() + FINAL_VERSION_TIMEOUT_S
        status, error = primerl_status_json(self.spec)
        while not served_final(status, self.spec.max_steps) and time.time() < deadline:
            time.sleep(2.0)
            status, error = primerl_status_json(self.spec)
        self.record.final_status, self.record.final_status_error = status, error
        (self.spec.run_dir / "final_status.json").write_text(json.dumps(status, indent=2) if status else error)

    def _last_status_after_finish(self) -> dict | None:
        """Mode rl: `primerl rl` stops the broker itself; the last status polled once the trainer finished."""
        finished = [s for _, s in self.record.statuses if int(s.get("trainer_step", 0)) >= self.spec.max_steps]
        if not finished:
            self.record.final_status_error = (
                f"no run status polled after the trainer's last step ({len(self.record.statuses)} polls answered, "
                f"{self.record.status_errors} failed; last error: {self.record.last_status_error or '-'})"
            )
            return None
        best = next((s for s in reversed(finished) if served_final(s, self.spec.max_steps)), finished[-1])
        (self.spec.run_dir / "final_status.json").write_text(json.dumps(best, indent=2))
        return best

    def _leftovers(self) -> list[str]:
        import psutil

        deadline = time.time() + LEFTOVER_GRACE_S
        left = marked_processes(self.spec.marker)
        while left and time.time() < deadline:
            time.sleep(0.5)
            left = marked_processes(self.spec.marker)
        described = [describe(p) for p in left]
        for process in left:  # recorded; now end them: the next run must not share the machine with them
            try:
                process.kill()
            except psutil.Error:  # gone already
                pass
        # Shared weight segments of a killed trainer: the broker's sweep or the launcher must have removed them.
        segments = stale_segments()
        described += [f"shared weight segment {path.name} (its trainer is dead)" for path in segments]
        for path in segments:
            path.unlink(missing_ok=True)
        return described
