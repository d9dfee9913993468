"""The broker's worker registry, driven directly (no sockets) with an injected clock."""

from __future__ import annotations

import math
import threading
import time

import pytest
from support.weight_updates import publish

from primerl.broker.registry import WorkerRegistry
from primerl.broker.registry_errors import (
    BrokerStopping,
    CommitResult,
    InvalidRequest,
    NameTaken,
    StepOutOfOrder,
    WorkerNotFound,
)
from primerl.broker.run_status import DataPlaneStatus, QueueDepth
from primerl.proto.roles import role_from_name
from primerl.proto.v1 import common_pb2, control_pb2

TRAINER, INFER, ORCH = common_pb2.ROLE_TRAINER, common_pb2.ROLE_INFERENCE, common_pb2.ROLE_ORCHESTRATOR
ALIVE, LOST, LEFT = control_pb2.WORKER_STATE_ALIVE, control_pb2.WORKER_STATE_LOST, control_pb2.WORKER_STATE_LEFT


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def registry(clock):
    return WorkerRegistry("run-1", heartbeat_interval_s=1.0, liveness=3, clock=clock, max_steps=10)


def register(registry, name, role=TRAINER, **fields):
    return registry.register(control_pb2.RegisterRequest(role=role, name=name, **fields)).worker_id


def heartbeat(registry, worker_id, **fields):
    return registry.heartbeat(control_pb2.HeartbeatRequest(worker_id=worker_id, **fields))


def test_register_returns_the_run_settings(registry):
    registry.set_endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    publish(registry.policy, 4)
    response = registry.register(
        control_pb2.RegisterRequest(role=INFER, name="infer-0", address="http://h:8000", capabilities={"lora": "true"})
    )
    assert len(response.worker_id) == 32 and response.run_id == "run-1"
    assert (response.heartbeat_interval_ms, response.liveness) == (1000, 3)
    assert (response.rollout_endpoint, response.weight_endpoint) == ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    assert response.latest_policy_version == 4
    [info] = registry.list_workers()
    assert (info.name, info.role, info.state, info.address) == ("infer-0", INFER, ALIVE, "http://h:8000")
    assert dict(info.capabilities) == {"lora": "true"}


@pytest.mark.parametrize(
    "request_fields, match",
    [
        (dict(role=common_pb2.ROLE_UNSPECIFIED, name="x"), "role"),
        (dict(role=TRAINER, name="  "), "name must not be empty"),
        (dict(role=TRAINER, name="x", rank=2, world_size=2), "rank 2"),
        (dict(role=TRAINER, name="x", instance_id="i" * 65), "instance_id is 65 characters long"),
    ],
)
def test_register_refuses_bad_requests(registry, request_fields, match):
    with pytest.raises(InvalidRequest, match=match) as info:
        registry.register(control_pb2.RegisterRequest(**request_fields))
    assert info.value.status_code == "INVALID_ARGUMENT"


def test_duplicate_live_name_is_refused_but_a_lost_or_left_name_is_reused(registry, clock):
    first = register(registry, "trainer-0")
    with pytest.raises(NameTaken, match="trainer-0") as info:
        register(registry, "trainer-0")
    assert info.value.status_code == "ALREADY_EXISTS"

    registry.deregister(first)
    second = register(registry, "trainer-0")
    assert second != first
    clock.advance(3.5)
    third = register(registry, "trainer-0")  # second went silent past the bound: LOST, name free
    workers = registry.list_workers(include_gone=True)
    assert [(w.worker_id, w.state) for w in workers] == [(third, ALIVE)]  # the old records of the name are replaced


def test_the_same_client_registering_again_gets_its_registration_back(registry, clock):
    """A Register whose answer missed its deadline, tried again: the same client (instance_id) is answered with the
    registration it already has, never ALREADY_EXISTS; another client asking for the live name is still refused."""
    first = register(registry, "infer-0", role=INFER, instance_id="a" * 32)
    clock.advance(2.0)
    assert register(registry, "infer-0", role=INFER, instance_id="a" * 32) == first
    clock.advance(2.0)  # 4 s after the first call but 2 s after the second: the second one counted as traffic
    assert [(w.worker_id, w.state) for w in registry.list_workers(include_gone=True)] == [(first, ALIVE)]
    for other in ("b" * 32, ""):
        with pytest.raises(NameTaken, match="infer-0"):
            register(registry, "infer-0", role=INFER, instance_id=other)
    registry.deregister(first)
    again = register(registry, "infer-0", role=INFER, instance_id="a" * 32)  # gone: a new registration
    assert again != first


def test_a_worker_a_read_marked_lost_is_still_reported_lost_once_to_the_heartbeat_monitor(registry, clock):
    """Reads expire first (a silent worker is never listed alive): the worker they mark LOST must still reach the
    monitor's log line once (a partitioned worker was marked lost by the orchestrator's ListWorkers, and the
    broker's log never said so)."""
    worker_id = register(registry, "infer-0", INFER)
    clock.advance(3.01)
    assert registry.list_workers() == []  # the read marked it LOST
    [lost] = registry.expire()
    assert (lost.worker_id, lost.state) == (worker_id, LOST)
    assert registry.expire() == []
    clock.advance(3.01)
    registry.run_status()
    assert registry.expire() == []  # not lost twice


def test_heartbeat_resets_liveness_and_expiry_marks_lost_within_the_bound(registry, clock):
    worker_id = register(registry, "infer-0", INFER)
    for _ in range(5):  # heartbeats every 2.5 s keep it alive although 5 * 2.5 > 3 s
        clock.advance(2.5)
        heartbeat(registry, worker_id)
        assert registry.expire() == []
    clock.advance(3.0)
    assert registry.expire() == []  # exactly at the bound: still alive
    clock.advance(0.01)
    [lost] = registry.expire()
    assert (lost.name, lost.state) == ("infer-0", LOST)
    assert registry.expire() == []  # newly lost only once
    assert registry.list_workers() == []
    assert [w.state for w in registry.list_workers(include_gone=True)] == [LOST]
    status = registry.run_status()
    assert [w.state for w in status.workers] == [LOST]
    assert status.recent_errors[-1].startswith("broker: worker infer-0 lost")
    with pytest.raises(WorkerNotFound, match="register again"):
        heartbeat(registry, worker_id)


def test_reads_apply_expiry_without_the_monitor(registry, clock):
    register(registry, "orch", ORCH)
    clock.advance(10)
    assert registry.run_status().workers[0].state == LOST


def test_heartbeat_unknown_id_is_not_found(registry):
    with pytest.raises(WorkerNotFound) as info:
        heartbeat(registry, "nope")
    assert info.value.status_code == "NOT_FOUND"


def test_heartbeat_stores_progress_and_errors(registry):
    worker_id = register(registry, "trainer-0")
    response = heartbeat(registry, worker_id, trainer_step=7, num_inflight=2, recent_errors=["oom", "retry"])
    assert response.last_committed_step == 0 and not response.shutdown_requested
    [info] = registry.list_workers()
    assert info.trainer_step == 7 and info.num_inflight == 2
    assert not info.HasField("policy_version") and not info.HasField("orchestrator_step")
    assert registry.recent_errors() == ["trainer-0: oom", "trainer-0: retry"]
    heartbeat(registry, worker_id)  # unset optional fields keep the last value
    assert registry.list_workers()[0].trainer_step == 7


def test_recent_errors_ring_is_bounded_newest_last(clock):
    registry = WorkerRegistry("r", 1.0, 3, clock=clock, max_recent_errors=4)
    for i in range(10):
        registry.record_error("rollout-plane", f"error {i}\nsecond line")
    assert registry.recent_errors() == [f"rollout-plane: error {i} second line" for i in range(6, 10)]
    registry.record_error("x", "y" * 2000)
    assert len(registry.recent_errors()[-1]) < 600


def test_deregister_marks_left_and_unknown_is_not_found(registry):
    worker_id = register(registry, "infer-0", INFER)
    registry.deregister(worker_id, "shutdown")
    registry.deregister(worker_id)  # twice is harmless
    assert registry.list_workers() == []
    assert [w.state for w in registry.list_workers(include_gone=True)] == [LEFT]
    with pytest.raises(WorkerNotFound):
        registry.deregister("unknown")
    with pytest.raises(WorkerNotFound, match="deregistered"):
        heartbeat(registry, worker_id)


def test_list_workers_filters_by_role(registry):
    register(registry, "trainer-0")
    register(registry, "infer-0", INFER)
    register(registry, "infer-1", INFER)
    assert [w.name for w in registry.list_workers(INFER)] == ["infer-0", "infer-1"]
    assert len(registry.list_workers()) == 3


def test_metrics_merge_later_wins_and_non_finite_is_refused(registry):
    trainer = register(registry, "trainer-0")
    orch = register(registry, "orch", ORCH)
    registry.report_metrics(trainer, 3, {"train/loss": 1.5, "train/reward": 0.1})
    registry.report_metrics(orch, 4, {"rollout/mean_length": 12.0, "train/reward": 0.2})
    status = registry.run_status()
    assert dict(status.last_metrics) == {"train/loss": 1.5, "train/reward": 0.2, "rollout/mean_length": 12.0}
    assert status.last_metrics_step == 4
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidRequest, match="train/loss") as info:
            registry.report_metrics(trainer, 5, {"train/loss": bad, "ok": 1.0})
        assert info.value.status_code == "INVALID_ARGUMENT"
    assert registry.run_status().last_metrics["train/loss"] == 1.5  # nothing of a refused report is kept
    with pytest.raises(WorkerNotFound):
        registry.report_metrics("unknown", 1, {"a": 1.0})


def test_commit_calls_the_release_callback_and_is_idempotent(clock):
    released: list[int] = []

    def on_commit(step: int) -> int:
        released.append(step)
        return 2

    registry = WorkerRegistry("r", 1.0, 3, clock=clock, on_commit=on_commit)
    trainer = register(registry, "trainer-0")
    assert registry.commit_step(trainer, 3) == CommitResult(3, 2, already_committed=False)
    # A retry of the same step (its answer lost) or of an older one (sent again to a restarted broker that had
    # kept it): success, nothing released, nothing changed.
    assert registry.commit_step(trainer, 3) == CommitResult(3, 0, already_committed=True)
    assert registry.commit_step(trainer, 2) == CommitResult(3, 0, already_committed=True)
    assert released == [3]
    assert registry.last_committed_step == 3
    assert registry.commit_step(trainer, 4) == CommitResult(4, 2, already_committed=False)
    assert released == [3, 4]
    assert registry.last_committed_step == 4
    assert heartbeat(registry, trainer).last_committed_step == 4
    orch = register(registry, "orch", ORCH)
    with pytest.raises(StepOutOfOrder, match="only trainer"):
        registry.commit_step(orch, 4)


def test_a_failing_release_does_not_commit(clock):
    def on_commit(step: int) -> int:
        raise OSError("disk gone")

    registry = WorkerRegistry("r", 1.0, 3, clock=clock, on_commit=on_commit)
    trainer = register(registry, "trainer-0")
    with pytest.raises(Exception, match="disk gone") as info:
        registry.commit_step(trainer, 1)
    assert info.value.status_code == "INTERNAL"
    assert registry.last_committed_step == 0


def test_status_aggregates_every_role(registry):
    t0 = register(registry, "trainer-0", rank=0, world_size=2)
    t1 = register(registry, "trainer-1", rank=1, world_size=2)
    i0, i1, i2 = (register(registry, f"infer-{i}", INFER) for i in range(3))
    orch = register(registry, "orch", ORCH)
    heartbeat(registry, t0, trainer_step=5)
    heartbeat(registry, t1, trainer_step=6)
    heartbeat(registry, i0, policy_version=1)
    heartbeat(registry, i1, policy_version=1)
    registry.policy.hello(i1, 3, 0)  # the weight fan-out's record wins over the heartbeat
    assert registry.record_weight_ack(i1)
    heartbeat(registry, i1, policy_version=2)
    heartbeat(registry, orch, orchestrator_step=9)
    registry.commit_step(t0, 4)
    publish(registry.policy, 5)

    data_plane = DataPlaneStatus(
        queues=[QueueDepth("rollouts", 2, 2048, 8, 1 << 30), control_pb2.QueueStatus(name="weights", num_items=1)],
        rollout_batches_per_s=1.5,
        rollout_bytes_per_s=1e6,
        weight_bytes_per_s=2e6,
    )
    status = registry.run_status(data_plane)
    assert (status.run_id, status.max_steps) == ("run-1", 10)
    assert (status.trainer_step, status.last_committed_step, status.orchestrator_step) == (6, 4, 9)
    assert status.latest_policy_version == 5  # the weight fan-out's, read without any status getter writing
    versions = {
        w.name: (w.policy_version if w.HasField("policy_version") else None) for w in status.workers if w.role == INFER
    }
    assert versions == {"infer-0": 1, "infer-1": 3, "infer-2": None}
    assert [(q.name, q.num_items, q.capacity_items) for q in status.queues] == [("rollouts", 2, 8), ("weights", 1, 0)]
    assert (status.rollout_batches_per_s, status.weight_bytes_per_s) == (1.5, 2e6)
    assert status.updated_unix_ms >= status.broker_started_unix_ms > 0
    assert registry.record_weight_ack("unknown") is False


def test_version_counts_changes_and_wait_for_change_wakes(registry):
    v0 = registry.version
    worker_id = register(registry, "infer-0", INFER)
    v1 = registry.version
    assert v1 > v0
    assert registry.wait_for_change(v1, timeout_s=0.05) == v1  # nothing changed: times out with the same version
    registry.list_workers()
    registry.run_status()
    assert registry.version == v1  # reads are not changes

    woke: list[int] = []
    waiter = threading.Thread(target=lambda: woke.append(registry.wait_for_change(v1, timeout_s=5.0)))
    waiter.start()
    time.sleep(0.05)
    started = time.monotonic()
    heartbeat(registry, worker_id, policy_version=1)
    waiter.join(5.0)
    assert woke and woke[0] > v1 and time.monotonic() - started < 1.0


def test_close_releases_waiters_and_refuses_as_unavailable_without_a_shutdown_request(registry):
    worker_id = register(registry, "infer-0", INFER)
    version = registry.version
    registry.close()  # the broker process is stopping, maybe for a restart: workers must retry, not stop
    started = time.monotonic()
    registry.wait_for_change(version + 100, timeout_s=5.0)
    assert time.monotonic() - started < 1.0
    with pytest.raises(BrokerStopping) as refused:
        heartbeat(registry, worker_id)
    assert refused.value.status_code == "UNAVAILABLE"
    with pytest.raises(BrokerStopping):
        register(registry, "infer-1", INFER)


def test_request_shutdown_tells_heartbeating_workers_to_stop(registry):
    worker_id = register(registry, "infer-0", INFER)
    assert not heartbeat(registry, worker_id).shutdown_requested
    registry.request_shutdown()
    assert heartbeat(registry, worker_id).shutdown_requested


def test_at_the_end_of_a_run_inference_is_kept_while_the_orchestrator_is_still_at_work(clock):
    """The orchestrator's eval at the last step runs after the trainer took that step: its inference and teacher
    workers are told to stop only once it left, was lost, or ``orchestrator_finish_s`` passed."""

    def ended(*names):
        registry = WorkerRegistry("r", 1.0, 3, clock=clock, end_of_run_grace_s=10.0, orchestrator_finish_s=100.0)
        ids = [register(registry, name, role) for name, role in names]
        registry.request_shutdown(grace_s=10.0)
        return registry, ids

    def beat_for(registry, seconds, *ids):  # every second, as workers do (liveness: 3 s)
        for _ in range(int(seconds)):
            clock.advance(1.0)
            answers = [heartbeat(registry, worker_id).shutdown_requested for worker_id in ids]
        return answers

    registry, (infer, teacher, orchestrator) = ended(
        ("infer-0", INFER), ("teacher-0", common_pb2.ROLE_TEACHER), ("orchestrator", ORCH)
    )
    assert beat_for(registry, 10, infer, teacher, orchestrator) == [False, False, True]  # the orchestrator: told
    registry.deregister(orchestrator, "stopped")  # its last step's eval done, it leaves
    assert beat_for(registry, 1, infer, teacher) == [True, True]

    registry, (infer, orchestrator) = ended(("infer-0", INFER), ("orchestrator", ORCH))
    assert beat_for(registry, 10, infer, orchestrator) == [False, True]
    assert beat_for(registry, 3, infer) == [False]
    assert beat_for(registry, 1, infer) == [True]  # the orchestrator has not heartbeated for 4 s: lost

    registry, (infer, orchestrator) = ended(("infer-0", INFER), ("orchestrator", ORCH))
    assert beat_for(registry, 109, infer, orchestrator) == [False, True]
    assert beat_for(registry, 1, infer, orchestrator) == [True, True]  # held 100 s past the grace at most


def test_gone_workers_are_bounded(clock):
    registry = WorkerRegistry("r", 1.0, 1, clock=clock, max_gone_workers=3)
    for i in range(10):
        registry.deregister(register(registry, f"w{i}", INFER))
    assert [w.name for w in registry.list_workers(include_gone=True)][-3:] == ["w7", "w8", "w9"]
    assert len(registry.list_workers(include_gone=True)) <= 4


def test_concurrent_registrations_give_unique_names(registry):
    results: list[str] = []
    errors: list[Exception] = []

    def worker(i: int) -> None:
        try:
            results.append(register(registry, f"w{i % 10}", INFER))
        except NameTaken as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5.0)
    assert len(results) == 10 and len(errors) == 40


def test_role_from_name():
    assert role_from_name("trainer") == TRAINER
    assert role_from_name("infer") == INFER
    assert role_from_name("ROLE_ORCHESTRATOR") == ORCH
    assert role_from_name(INFER) == INFER
    with pytest.raises(ValueError, match="unknown role"):
        role_from_name("bogus")
