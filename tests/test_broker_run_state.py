"""The broker's run state: the file (atomic, tolerant), the registry's snapshot/restore, idempotent commits,
the end of the run, the periodic saver, and an in-process BrokerService restarted on the same spool."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import structlog
from support.weight_updates import publish

from primerl.broker.registry import WorkerRegistry
from primerl.broker.registry_errors import CommitFailed, CommitResult
from primerl.broker.run_state import (
    CORRUPT_SUFFIX,
    FORMAT,
    RUN_STATE_FILE,
    RunState,
    RunStateFile,
    RunStateSaver,
)
from primerl.broker.service import BrokerService
from primerl.client.weight_publisher import WeightPublisher
from primerl.configs.broker import BrokerConfig
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, control_pb2, data_pb2

TRAINER, INFER, ORCH = common_pb2.ROLE_TRAINER, common_pb2.ROLE_INFERENCE, common_pb2.ROLE_ORCHESTRATOR


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_registry(**kwargs) -> WorkerRegistry:
    return WorkerRegistry("run-1", 1.0, 3, clock=FakeClock(), **kwargs)


def register(registry, name, role=TRAINER, **fields):
    return registry.register(control_pb2.RegisterRequest(role=role, name=name, **fields)).worker_id


def heartbeat(registry, worker_id, **fields):
    return registry.heartbeat(control_pb2.HeartbeatRequest(worker_id=worker_id, **fields))


def sample_state(**fields) -> RunState:
    values = dict(
        run_id="run-7",
        last_committed_step=4,
        trainer_step=5,
        orchestrator_step=6,
        latest_policy_version=5,
        last_metrics={"train/loss": 0.125, "reward/mean": -1.5e-3},
        last_metrics_step=5,
    )
    return RunState(**{**values, **fields})


# ------------------------------------------------------------------------------------------------ the file
def test_file_round_trip_is_atomic_and_exact(tmp_path):
    store = RunStateFile(tmp_path)
    assert store.load() is None  # no file: a fresh run, no warning
    state = sample_state()
    assert store.write(state, revision=1)
    assert [p.name for p in tmp_path.iterdir()] == [RUN_STATE_FILE]  # no temporary file left
    assert json.loads((tmp_path / RUN_STATE_FILE).read_text())["format"] == FORMAT
    assert RunStateFile(tmp_path).load() == state


def test_file_keeps_the_newest_revision_and_skips_unchanged_states(tmp_path):
    store = RunStateFile(tmp_path)
    assert store.write(sample_state(last_committed_step=7), revision=5)
    assert not store.write(sample_state(last_committed_step=6), revision=4)  # a slower, older snapshot
    assert not store.write(sample_state(last_committed_step=7), revision=6)  # same content: no fsync
    assert store.written_revision == 6
    assert RunStateFile(tmp_path).load().last_committed_step == 7


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\x00\xffgarbage", "not JSON"),
        (b"", "not JSON"),
        (b"[1, 2]", "not an object"),
        (json.dumps({"format": "other/9", "run_id": "r"}).encode(), "format"),
        (json.dumps({"format": FORMAT}).encode(), "run_id"),
        (json.dumps({"format": FORMAT, "run_id": "r", "last_committed_step": -1}).encode(), "last_committed_step"),
        (json.dumps({"format": FORMAT, "run_id": "r", "trainer_step": "7"}).encode(), "trainer_step"),
        (b'{"format": "%s", "run_id": "r", "last_metrics": {"loss": NaN}}' % FORMAT.encode(), "finite"),
        (json.dumps({"format": FORMAT, "run_id": "r", "finished": "yes"}).encode(), "finished"),
    ],
)
def test_a_corrupt_file_warns_is_set_aside_and_starts_fresh(tmp_path, content, problem):
    (tmp_path / RUN_STATE_FILE).write_bytes(content)
    with structlog.testing.capture_logs() as logs:
        assert RunStateFile(tmp_path).load() is None
    [warning] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["event"] == "run state unreadable: starting fresh" and problem in warning["error"]
    assert not (tmp_path / RUN_STATE_FILE).exists()
    assert (tmp_path / (RUN_STATE_FILE + CORRUPT_SUFFIX)).read_bytes() == content  # kept for inspection


def test_an_unreadable_file_warns_and_starts_fresh(tmp_path):
    (tmp_path / RUN_STATE_FILE).mkdir()  # reading it fails with an OSError (IsADirectoryError)
    with structlog.testing.capture_logs() as logs:
        assert RunStateFile(tmp_path).load() is None
    assert any(entry["event"] == "run state unreadable: starting fresh" for entry in logs)


# ---------------------------------------------------------------------------------------- the registry
def test_snapshot_and_restore_give_the_same_status_and_worker_answers():
    before = make_registry(max_steps=10)
    trainer = register(before, "trainer-0")
    orch = register(before, "orch", ORCH)
    heartbeat(before, trainer, trainer_step=3)
    before.report_metrics(trainer, 3, {"train/loss": 0.5})
    before.report_metrics(orch, 4, {"reward/mean": 0.25})
    before.commit_step(trainer, 3)
    publish(before.policy, 3)
    _, state = before.run_state()
    assert state == RunState(
        run_id="run-1",
        last_committed_step=3,
        trainer_step=3,
        orchestrator_step=4,
        latest_policy_version=3,
        policy_lineage=1,  # trainer-0 (rank 0) was given the run's first lineage
        last_metrics={"train/loss": 0.5, "reward/mean": 0.25},
        last_metrics_step=4,
    )

    after = WorkerRegistry("fresh-id", 1.0, 3, clock=FakeClock(), max_steps=10)
    after.restore(state)
    old, new = before.run_status(), after.run_status()
    for name in (
        "run_id",
        "trainer_step",
        "last_committed_step",
        "latest_policy_version",
        "orchestrator_step",
        "last_metrics",
        "last_metrics_step",
        "max_steps",
    ):
        assert getattr(new, name) == getattr(old, name), name
    assert list(new.workers) == []  # workers are not kept: they register again
    registration = after.register(control_pb2.RegisterRequest(role=INFER, name="infer-0"))
    assert (registration.run_id, registration.latest_policy_version) == ("run-1", 3)
    beat = heartbeat(after, registration.worker_id)
    assert (beat.last_committed_step, beat.latest_policy_version, beat.shutdown_requested) == (3, 3, False)
    # A re-registered trainer that reports a lower step (resumed from an older checkpoint) does not move the
    # run's step back; a higher one does.
    trainer = register(after, "trainer-0")
    heartbeat(after, trainer, trainer_step=2)
    assert after.run_status().trainer_step == 3
    heartbeat(after, trainer, trainer_step=4)
    assert after.run_status().trainer_step == 4


def test_restore_takes_the_spools_commit_marker_when_it_is_ahead():
    registry = make_registry()
    registry.restore(sample_state(last_committed_step=4), committed_step=6)
    assert registry.last_committed_step == 6
    trainer = register(registry, "trainer-0")
    assert registry.commit_step(trainer, 6) == CommitResult(6, 0, already_committed=True)


def test_the_revision_moves_with_run_facts_not_with_plain_heartbeats():
    registry = make_registry()
    worker = register(registry, "trainer-0")
    revision, _ = registry.run_state()
    for _ in range(5):
        heartbeat(registry, worker, num_inflight=3)
    assert registry.run_state()[0] == revision  # no write (no fsync) per heartbeat
    heartbeat(registry, worker, trainer_step=1)
    assert registry.run_state()[0] > revision
    revision, _ = registry.run_state()
    heartbeat(registry, worker, trainer_step=1)
    assert registry.run_state()[0] == revision


def test_a_commit_is_written_before_it_answers_and_a_failed_write_is_retried():
    written: list[tuple[int, RunState]] = []
    fail = [False]

    def persist(revision: int, state: RunState) -> None:
        if fail[0]:
            raise OSError(28, "No space left on device")
        written.append((revision, state))

    registry = make_registry(persist=persist)
    trainer = register(registry, "trainer-0")  # its policy lineage is written before the answer
    assert [state.policy_lineage for _, state in written] == [1]
    written.clear()
    fail[0] = True
    with pytest.raises(CommitFailed, match="No space left") as info:
        registry.commit_step(trainer, 1)
    assert info.value.status_code == "INTERNAL"
    fail[0] = False
    # The retry is answered as already committed (the release happened) and writes the state this time.
    assert registry.commit_step(trainer, 1) == CommitResult(1, 0, already_committed=True)
    assert [state.last_committed_step for _, state in written] == [1]
    assert registry.commit_step(trainer, 2) == CommitResult(2, 0)
    assert [state.last_committed_step for _, state in written] == [1, 2]


# ---------------------------------------------------------------------------------------- end of the run
def finish_run(registry, rank: int = 0, reason: str = "training finished", step: int = 10) -> bool:
    trainer = register(registry, f"trainer-{rank}", rank=rank, world_size=2)
    registry.report_metrics(trainer, step, {"train/loss": 0.1})
    return registry.deregister(trainer, reason)


@pytest.mark.parametrize(
    "max_steps, rank, reason, step, ends",
    [
        (10, 0, "training finished", 10, True),
        (10, 0, "training finished", 9, False),  # stopped early (a signal): the run is not over
        (10, 1, "training finished", 10, False),  # only rank 0 speaks for the trainer
        (10, 0, "trainer IO failed", 10, False),
        (None, 0, "training finished", 10, False),  # no max_steps: no known end
    ],
)
def test_the_run_ends_only_when_trainer_rank0_finishes_max_steps(max_steps, rank, reason, step, ends):
    registry = make_registry(max_steps=max_steps)
    infer = register(registry, "infer-0", INFER)
    assert finish_run(registry, rank, reason, step) is ends
    assert registry.shutdown_requested is ends
    assert heartbeat(registry, infer).shutdown_requested is ends


def test_a_finished_run_is_persisted_and_a_restarted_broker_tells_late_workers_to_stop(tmp_path):
    store = RunStateFile(tmp_path)
    registry = make_registry(max_steps=10, persist=lambda revision, state: store.write(state, revision))
    assert finish_run(registry)
    state = RunStateFile(tmp_path).load()  # written before Deregister answered
    assert state.finished and state.finished_step == 10

    restarted = make_registry(max_steps=10)
    restarted.restore(state)
    late = register(restarted, "infer-1", INFER)
    assert heartbeat(restarted, late).shutdown_requested

    extended = make_registry(max_steps=20)  # the same run, resumed with more steps: it goes on
    extended.restore(state)
    assert not extended.shutdown_requested
    assert not heartbeat(extended, register(extended, "infer-1", INFER)).shutdown_requested


def test_workers_are_told_to_stop_after_the_grace_also_by_a_restarted_broker():
    clock = FakeClock()
    registry = WorkerRegistry("run-1", 1.0, 100, clock=clock, max_steps=10, end_of_run_grace_s=10.0)
    infer = register(registry, "infer-0", INFER)
    assert finish_run(registry)
    assert registry.shutdown_requested and registry.run_state()[1].finished
    clock.now += 9.9
    assert not heartbeat(registry, infer).shutdown_requested  # the last policy may still be on its way
    clock.now += 0.1
    assert heartbeat(registry, infer).shutdown_requested

    restarted_clock = FakeClock()
    restarted = WorkerRegistry("run-1", 1.0, 100, clock=restarted_clock, max_steps=10, end_of_run_grace_s=10.0)
    restarted.restore(registry.run_state()[1])
    late = register(restarted, "infer-0", INFER)
    assert restarted.shutdown_requested and not heartbeat(restarted, late).shutdown_requested
    restarted_clock.now += 10.0
    assert heartbeat(restarted, late).shutdown_requested


# ------------------------------------------------------------------------------------------ the saver
def test_the_saver_writes_changes_at_most_once_per_interval_and_flushes_at_stop(tmp_path):
    registry = make_registry()
    store = RunStateFile(tmp_path)
    saver = RunStateSaver(registry.run_state, store, interval_s=0.2)
    trainer = register(registry, "trainer-0")
    saver.start()
    try:
        started = time.monotonic()
        for step in range(1, 200):  # ~1 s of changes, far more often than the interval
            registry.report_metrics(trainer, step, {"train/loss": 1.0 / step})
            time.sleep(0.005)
        elapsed_s = time.monotonic() - started
        assert 1 <= saver.num_writes <= elapsed_s / 0.2 + 2
        deadline = time.monotonic() + 10  # the last change saved (a write of an earlier state may still be under way)
        while RunStateFile(tmp_path).load().last_metrics_step != 199 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.05)  # the write that saved it is counted
        idle_writes = saver.num_writes
        time.sleep(0.6)  # three intervals with nothing changed: nothing written
        assert saver.num_writes == idle_writes
        registry.report_metrics(trainer, 500, {"train/loss": 0.001})
    finally:
        saver.stop()
    state = RunStateFile(tmp_path).load()
    assert (state.trainer_step, state.last_metrics_step, state.last_metrics) == (500, 500, {"train/loss": 0.001})


def test_the_saver_reports_a_failing_disk_once(tmp_path):
    registry = make_registry()
    store = RunStateFile(tmp_path / "missing")  # its directory does not exist: every write fails
    errors: list[str] = []
    saver = RunStateSaver(registry.run_state, store, interval_s=10, on_error=errors.append)
    trainer = register(registry, "trainer-0")
    with structlog.testing.capture_logs() as logs:
        for step in (1, 2, 3):
            registry.report_metrics(trainer, step, {"x": 1.0})
            assert not saver.save_once()
    assert len(errors) == 1 and "missing" in errors[0]
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == ["run state not saved"]


# ------------------------------------------------------------------------------- the service, restarted
def broker_config(spool_dir: Path, **fields) -> BrokerConfig:
    return BrokerConfig(grpc_port=0, rollout_port=0, weight_port=0, spool_dir=spool_dir, max_steps=10, **fields)


def publish_full(endpoint: str, version: int) -> None:
    data, specs = tf.encode_tensors({"w": np.arange(64, dtype=np.float32)})
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
    publisher = WeightPublisher(endpoint, None, "trainer-0", 1 << 20)
    try:
        assert publisher.publish(header, data, timeout_s=10).applied
    finally:
        publisher.close()


def test_a_restarted_service_shows_the_status_it_showed_before(tmp_path):
    spool_dir = tmp_path / "spool"
    service = BrokerService(broker_config(spool_dir))
    try:
        endpoints = service.start()
        registry = service.registry
        trainer = register(registry, "trainer-0")
        publish_full(f"tcp://127.0.0.1:{endpoints.weight_port}", 2)
        # The accepted version reaches the registry with the ack, not at the next status read.
        assert registry.register(control_pb2.RegisterRequest(role=INFER, name="i")).latest_policy_version == 2
        registry.report_metrics(trainer, 2, {"train/loss": 0.75})
        assert registry.commit_step(trainer, 2) == CommitResult(2, 0)
        assert RunStateFile(spool_dir).load().last_committed_step == 2  # on disk before the answer
        registry.report_metrics(register(registry, "orch", ORCH), 3, {"reward/mean": 0.5})
        before = service.servicer.run_status()
        run_id = service.run_id
    finally:
        service.stop(grace_s=0)  # writes what changed since the last periodic write

    again = BrokerService(broker_config(spool_dir))
    try:
        assert again.start().run_id == run_id
        after = again.servicer.run_status()
        for name in (
            "run_id",
            "trainer_step",
            "last_committed_step",
            "latest_policy_version",
            "orchestrator_step",
            "last_metrics",
            "last_metrics_step",
        ):
            assert getattr(after, name) == getattr(before, name), name
        assert (after.last_committed_step, after.latest_policy_version, after.trainer_step) == (2, 2, 2)
        assert after.orchestrator_step == 3 and dict(after.last_metrics) == {"train/loss": 0.75, "reward/mean": 0.5}
        assert again.weight_store.latest_version == 2  # the policy itself came back too (weight_durable)
    finally:
        again.stop(grace_s=0)


def test_a_service_with_a_corrupt_run_state_starts_fresh(tmp_path):
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (spool_dir / RUN_STATE_FILE).write_bytes(b'{"format": "primerl.run_state/1", "run_id": ')
    service = BrokerService(broker_config(spool_dir, run_id="new-run"))
    try:
        with structlog.testing.capture_logs() as logs:
            service.start()
        assert any(entry["event"] == "run state unreadable: starting fresh" for entry in logs)
        status = service.servicer.run_status()
        assert (status.run_id, status.last_committed_step, status.trainer_step) == ("new-run", 0, 0)
    finally:
        service.stop(grace_s=0)
    assert RunStateFile(spool_dir).load().run_id == "new-run"


def test_a_state_of_another_named_run_is_not_taken(tmp_path):
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    RunStateFile(spool_dir).write(sample_state(run_id="old-run"), revision=1)
    service = BrokerService(broker_config(spool_dir, run_id="new-run"))
    try:
        service.start()
        status = service.servicer.run_status()
        assert (status.run_id, status.trainer_step, status.latest_policy_version) == ("new-run", 0, 0)
    finally:
        service.stop(grace_s=0)
    assert os.path.exists(spool_dir / RUN_STATE_FILE)


def test_primerl_status_says_when_every_step_is_committed():
    from primerl.supervisor.status_view import render_status

    status = control_pb2.RunStatus(run_id="r", trainer_step=3, last_committed_step=2, max_steps=3)
    assert "run finished" not in render_status(status)
    status.last_committed_step = 3
    assert "trainer step 3 (committed 3) / 3" in render_status(status) and "run finished" in render_status(status)
    assert "run finished" not in render_status(control_pb2.RunStatus(run_id="r", last_committed_step=3))  # no max
