"""One registered worker as the registry keeps it (``WorkerRecord``), the bounds on what a worker may send, and the
checks of its requests that need no registry state (``check_register_request``, ``gone_holders``,
``check_metrics_report``).

A worker that cannot serve now (its heartbeats carry a ``not_serving`` reason: an inference engine that stalled) is
listed with the capability ``serving = "false"`` (``WorkerRecord.not_serving``) until a heartbeat without it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from primerl.broker.registry_errors import InvalidRequest, LimitReached, NameTaken
from primerl.broker.run_status import role_name
from primerl.proto import telemetry
from primerl.proto.roles import role_names
from primerl.proto.v1 import common_pb2, control_pb2

ALIVE = control_pb2.WORKER_STATE_ALIVE
LOST = control_pb2.WORKER_STATE_LOST
LEFT = control_pb2.WORKER_STATE_LEFT

MAX_NAME_CHARS = 128
MAX_INSTANCE_ID_CHARS = 64
MAX_ERRORS_PER_HEARTBEAT = 8
MAX_METRICS_PER_REPORT = 1024
# Bounds that keep RunStatus far below the 4 MiB gRPC message limit of a default client (checked in tests).
MAX_METRIC_NAME_CHARS = 128
MAX_METRIC_NAMES_PER_WORKER = 512
MAX_METRIC_NAMES = 2048
MAX_LIVE_WORKERS = 4096
"""Live workers a broker admits by default (``broker.max_workers``); its run status stays ~1 MiB at this bound."""
MAX_CAPABILITIES = 32
MAX_CAPABILITY_CHARS = 256
MAX_ADDRESS_CHARS = 256
MAX_CAPABILITY_TOTAL_CHARS = 2048


@dataclass
class WorkerRecord:
    worker_id: str
    role: int
    name: str
    address: str
    capabilities: dict[str, str]
    rank: int
    world_size: int
    pid: int
    hostname: str
    registered_unix_ms: int
    last_seen: float  # registry clock (monotonic)
    last_heartbeat_unix_ms: int
    state: int = ALIVE
    trainer_step: int | None = None
    # The version the worker's own heartbeat says it serves; the weight fan-out's record wins where it has one.
    heartbeat_policy_version: int | None = None
    orchestrator_step: int | None = None
    num_inflight: int = 0
    # Why the worker cannot serve now (its engine stalled), from its latest heartbeat; "" while it can.
    not_serving: str = ""
    # Trainer rank 0: the policy lineage it was given (0 for every other worker).
    policy_lineage: int = 0
    # The heartbeat interval it was last asked for (it grows with the fleet): it is LOST past liveness times this.
    interval_s: float = 1.0
    # The registering client's own random id (``RegisterRequest.instance_id``; "" from older clients): the same
    # process registering again while this record is alive gets this record back, not ``NameTaken``.
    instance_id: str = ""

    @classmethod
    def registered(
        cls,
        request: control_pb2.RegisterRequest,
        name: str,
        worker_id: str,
        now: float,
        unix_ms: int,
        lineage: int,
        interval_s: float = 1.0,
    ) -> WorkerRecord:
        """The record of a worker that registers with ``request`` (``now``: the registry clock)."""
        return cls(
            worker_id=worker_id,
            role=request.role,
            name=name,
            address=request.address,
            capabilities=dict(request.capabilities),
            rank=request.rank,
            world_size=request.world_size,
            pid=request.pid,
            hostname=request.hostname,
            registered_unix_ms=unix_ms,
            last_seen=now,
            last_heartbeat_unix_ms=unix_ms,
            policy_lineage=lineage,
            interval_s=interval_s,
            instance_id=request.instance_id,
        )

    def snapshot(self) -> WorkerRecord:
        """A copy of the record as it is now (its fields are replaced, never changed in place, so a shallow copy is
        enough), to read outside the registry's lock."""
        copy = object.__new__(WorkerRecord)
        copy.__dict__.update(self.__dict__)
        return copy

    def take_heartbeat(self, request: control_pb2.HeartbeatRequest, unix_ms: int) -> bool:
        """The heartbeat's progress and load; True when one of the worker's steps moved."""
        self.last_heartbeat_unix_ms = unix_ms
        moved = False
        if request.HasField("trainer_step") and request.trainer_step != self.trainer_step:
            self.trainer_step, moved = request.trainer_step, True
        if request.HasField("orchestrator_step") and request.orchestrator_step != self.orchestrator_step:
            self.orchestrator_step, moved = request.orchestrator_step, True
        if request.HasField("policy_version"):
            self.heartbeat_policy_version = request.policy_version
        self.num_inflight = request.num_inflight
        return moved

    def reached(self, step: int) -> None:
        """The worker reported metrics of ``step``: the step is done, even if no heartbeat says so."""
        if self.role == common_pb2.ROLE_TRAINER:
            self.trainer_step = max(self.trainer_step or 0, step)
        elif self.role == common_pb2.ROLE_ORCHESTRATOR:
            self.orchestrator_step = max(self.orchestrator_step or 0, step)

    def note_serving(self, reason: str) -> str:
        """The heartbeat's ``not_serving`` is the worker's state, not an error: listed with ``serving = "false"``
        while its heartbeats carry a reason, back when one does not. Returns the recent-errors line of a change."""
        if reason == self.not_serving:
            return ""
        was, self.not_serving = self.not_serving, reason
        if not reason:
            return "back in rotation: serving again"
        return "" if was else f"out of rotation: {reason}"

    def info(self, applied_policy_version: int | None = None) -> control_pb2.WorkerInfo:
        """The record as ``WorkerInfo``; ``applied_policy_version``: what the weight fan-out saw it acknowledge."""
        info = control_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            name=self.name,
            address=self.address,
            capabilities=(
                {**self.capabilities, telemetry.SERVING_CAPABILITY: "false"} if self.not_serving else self.capabilities
            ),
            state=self.state,
            rank=self.rank,
            world_size=self.world_size,
            registered_unix_ms=self.registered_unix_ms,
            last_heartbeat_unix_ms=self.last_heartbeat_unix_ms,
            num_inflight=self.num_inflight,
            hostname=self.hostname,
            pid=self.pid,
        )
        if self.trainer_step is not None:
            info.trainer_step = self.trainer_step
        policy_version = applied_policy_version if applied_policy_version is not None else self.heartbeat_policy_version
        if policy_version is not None:
            info.policy_version = policy_version
        if self.orchestrator_step is not None:
            info.orchestrator_step = self.orchestrator_step
        return info


def gone_holders(
    holders: Iterable[WorkerRecord], name: str, timeout_s: float, num_alive: int, max_workers: int = MAX_LIVE_WORKERS
) -> list[WorkerRecord]:
    """The LOST or LEFT records among ``holders`` (the records of ``name``): a new worker may take the name and they
    go. ``LimitReached`` when ``num_alive`` reached ``max_workers``, ``NameTaken`` while a live worker holds it."""
    if num_alive >= max_workers:
        raise LimitReached(
            f"{num_alive} workers are registered, the broker's limit (broker.max_workers); deregister some first"
        )
    holders = list(holders)
    for old in holders:
        if old.state == ALIVE:
            raise NameTaken(
                f"a live worker is already registered as {name!r} (id {old.worker_id}, {role_name(old.role)}); "
                f"pick another name or wait up to {timeout_s:g} s for it to expire"
            )
    return holders


def check_register_request(request: control_pb2.RegisterRequest) -> str:
    """The worker's name (stripped), or ``InvalidRequest`` saying what is wrong with the request."""
    if request.role == common_pb2.ROLE_UNSPECIFIED or request.role not in common_pb2.Role.values():
        raise InvalidRequest(f"role must be one of {role_names()}, got {request.role}")
    name = request.name.strip()
    if not name:
        raise InvalidRequest("name must not be empty (e.g. 'infer-0', 'trainer-rank1')")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"name is {len(name)} characters long; at most {MAX_NAME_CHARS} are allowed")
    if request.world_size and request.rank >= request.world_size:
        raise InvalidRequest(f"rank {request.rank} is not below world_size {request.world_size}")
    if len(request.instance_id) > MAX_INSTANCE_ID_CHARS:
        raise InvalidRequest(
            f"instance_id is {len(request.instance_id)} characters long; at most {MAX_INSTANCE_ID_CHARS} are allowed"
        )
    if len(request.address) > MAX_ADDRESS_CHARS or len(request.hostname) > MAX_ADDRESS_CHARS:
        raise InvalidRequest(f"address and hostname must be at most {MAX_ADDRESS_CHARS} characters")
    if len(request.capabilities) > MAX_CAPABILITIES or any(
        len(k) > MAX_CAPABILITY_CHARS or len(v) > MAX_CAPABILITY_CHARS for k, v in request.capabilities.items()
    ):
        raise InvalidRequest(
            f"at most {MAX_CAPABILITIES} capabilities of at most {MAX_CAPABILITY_CHARS} characters each"
        )
    if sum(len(k) + len(v) for k, v in request.capabilities.items()) > MAX_CAPABILITY_TOTAL_CHARS:
        raise InvalidRequest(f"capabilities hold at most {MAX_CAPABILITY_TOTAL_CHARS} characters in all")
    return name


def check_metrics_report(metrics: Mapping[str, float]) -> None:
    """``InvalidRequest`` for a report that is too big, has non-finite values, or empty or overlong names."""
    if len(metrics) > MAX_METRICS_PER_REPORT:
        raise InvalidRequest(f"{len(metrics)} metrics in one report; at most {MAX_METRICS_PER_REPORT}")
    bad = sorted(name for name, value in metrics.items() if not math.isfinite(value))
    if bad:
        raise InvalidRequest(f"non-finite metric values are refused: {', '.join(bad[:10])}")
    if any(not name for name in metrics):
        raise InvalidRequest("metric names must not be empty")
    long_names = [name for name in metrics if len(name) > MAX_METRIC_NAME_CHARS]
    if long_names:
        raise InvalidRequest(f"metric names are at most {MAX_METRIC_NAME_CHARS} characters: {long_names[0][:40]!r}...")
