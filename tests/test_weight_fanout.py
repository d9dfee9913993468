"""The weight fan-out core (``broker/weight_fanout.py``): the one owner of the latest policy version and of the
version each inference worker holds. Driven directly (no sockets), with the registry reading it, then over
loopback through a real broker: Heartbeat answers the latest version after a publish with no status read, and a
worker the registry marks LOST gets no push until it registers again."""

from __future__ import annotations

import grpc
import pytest
from support.probes import wait_until
from support.weight_updates import DELTA, publish, tiny_update

from primerl.broker.registry import WorkerRegistry
from primerl.broker.weight_fanout import LatestPolicy, WeightFanout
from primerl.broker.weight_members import Joined
from primerl.broker.weight_store import WeightStore
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc

INFER = common_pb2.ROLE_INFERENCE


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fanout(clock) -> WeightFanout:
    return WeightFanout(WeightStore(), ack_timeout_s=5.0, max_retries=2, max_workers=3, clock=clock)


def send_all(fanout: WeightFanout, worker_id: str) -> list[int]:
    """Send the worker everything planned (one chunk per update); the versions sent, in order."""
    sent = []
    while (step := fanout.next_step(worker_id)) is not None:
        update, index, _ = step
        assert index == 0
        fanout.chunk_sent(worker_id, update, last=True)
        sent.append(update.policy_version)
    return sent


def deliver(fanout: WeightFanout, worker_id: str) -> list[int]:
    """Send everything planned and have the worker acknowledge each update."""
    sent = send_all(fanout, worker_id)
    for version in sent:
        assert fanout.ack(worker_id, version, 0, applied=True) is True
    return sent


# ------------------------------------------------------------------------------------------ the latest policy
def test_the_latest_policy_is_the_stores_head_or_else_the_restored_version(fanout):
    changes: list[LatestPolicy] = []
    fanout.watch(lambda: changes.append(fanout.latest()))
    assert fanout.latest() == LatestPolicy(0, 0, 0, 0)
    fanout.restore_latest(7)  # an earlier broker's run state; the store is empty
    assert fanout.latest().version == 7 and changes == []
    publish(fanout, 3, lineage=20, lineage_base=2)  # a trainer resumed from an older checkpoint
    assert fanout.latest() == LatestPolicy(3, 20, 2, 0)
    publish(fanout, 3, lineage=20, lineage_base=2)  # a resend: nothing changes, nobody is told
    publish(fanout, 4, DELTA, base=3, lineage=20, lineage_base=2)
    assert [latest.version for latest in changes] == [3, 4]


def test_members_get_the_plan_for_what_they_hold_and_every_put_plans_again(fanout):
    publish(fanout, 1)
    publish(fanout, 2, DELTA, base=1)
    assert fanout.hello("new", None, 0) is Joined.JOINED
    assert fanout.hello("on-chain", 1, 0) is Joined.JOINED
    assert fanout.hello("current", 2, 0) is Joined.JOINED
    assert (deliver(fanout, "new"), deliver(fanout, "on-chain"), deliver(fanout, "current")) == ([1, 2], [2], [])
    assert fanout.worker_versions() == {"new": 2, "on-chain": 2, "current": 2}
    assert fanout.hello("current", 2, 0) is Joined.REPEATED  # the keep-alive
    publish(fanout, 3, DELTA, base=2)
    assert [deliver(fanout, w) for w in ("new", "on-chain", "current")] == [[3], [3], [3]]
    assert fanout.worker_version("new") == 3 and fanout.worker_version("stranger") is None


def test_a_full_fanout_refuses_and_a_reconnection_is_not_counted_as_forgotten(fanout):
    for worker_id in ("a", "b", "c"):
        assert fanout.hello(worker_id, None, 0) is Joined.JOINED
    assert fanout.hello("d", None, 0) is Joined.FULL
    assert fanout.hello("a", 1, 0, reconnected=True) is Joined.JOINED
    assert fanout.counts()[:2] == (3, 0)


def test_overdue_acks_replan_and_then_forget(fanout, clock):
    publish(fanout, 1)
    fanout.hello("slow", None, 0)
    assert send_all(fanout, "slow") == [1]
    for _ in range(fanout.max_retries):  # each overdue ack plans the snapshot again
        clock.now += fanout.ack_timeout_s + 1
        fanout.tick()
        assert send_all(fanout, "slow") == [1]
    clock.now += fanout.ack_timeout_s + 1
    fanout.tick()
    assert not fanout.is_member("slow") and fanout.counts().num_forgotten == 1
    assert fanout.ack("slow", 1, 0, applied=True) is None  # it must say HELLO again
    assert fanout.hello("slow", None, 0) is Joined.JOINED


def test_failed_applies_resend_the_snapshot_then_forget(fanout):
    publish(fanout, 1)
    publish(fanout, 2, DELTA, base=1)
    fanout.hello("w", 1, 0)
    assert send_all(fanout, "w") == [2]
    assert (
        fanout.ack("w", 2, 0, applied=False, error=common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_TENSOR_MISMATCH))
        is True
    )
    assert send_all(fanout, "w") == [1, 2]  # its state is unknown now: from the snapshot
    assert fanout.ack("w", 1, 0, applied=False) is True
    assert fanout.ack("w", 1, 0, applied=False) is False  # max_retries failures in a row
    assert not fanout.is_member("w")


def test_a_worker_that_left_gets_nothing_more_and_is_not_taken_back(fanout):
    publish(fanout, 1)
    fanout.hello("lost", None, 0)
    update, _, _ = fanout.next_step("lost")
    fanout.leave("lost", reason="the registry marked it lost")
    assert fanout.next_step("lost") is None
    fanout.chunk_sent("lost", update, last=True)  # a send that was under way changes nothing
    assert fanout.hello("lost", None, 0) is Joined.GONE and not fanout.is_member("lost")
    assert fanout.hello("registered-again", None, 0) is Joined.JOINED


# ------------------------------------------------------------------------------------------ with the registry
def test_the_registry_reads_the_fanout_and_a_lost_worker_leaves_it(clock):
    fanout = WeightFanout(WeightStore())
    registry = WorkerRegistry("run-1", 1.0, 2, clock=clock, policy=fanout)
    worker_id = registry.register(control_pb2.RegisterRequest(role=INFER, name="infer-0")).worker_id
    revision, _ = registry.run_state()
    publish(fanout, 1)
    # No status read anywhere: the answers and the run state follow the fan-out.
    beat = registry.heartbeat(control_pb2.HeartbeatRequest(worker_id=worker_id))
    assert beat.latest_policy_version == 1
    assert registry.run_state()[0] > revision and registry.run_state()[1].latest_policy_version == 1
    fanout.hello(worker_id, None, 0)
    assert deliver(fanout, worker_id) == [1]
    assert registry.get_worker(worker_id).policy_version == 1
    clock.now += 3  # past liveness * interval
    assert [w.worker_id for w in registry.expire()] == [worker_id]
    publish(fanout, 2, DELTA, base=1)
    assert not fanout.is_member(worker_id) and fanout.next_step(worker_id) is None
    assert fanout.hello(worker_id, 1, 0) is Joined.GONE
    again = registry.register(control_pb2.RegisterRequest(role=INFER, name="infer-0")).worker_id
    assert fanout.hello(again, 1, 0) is Joined.JOINED and deliver(fanout, again) == [2]


def test_a_deregistered_inference_worker_leaves_the_fanout(clock):
    registry = WorkerRegistry("run-1", 1.0, 2, clock=clock)
    worker_id = registry.register(control_pb2.RegisterRequest(role=INFER, name="infer-0")).worker_id
    registry.policy.hello(worker_id, None, 0)
    registry.deregister(worker_id, "stopping")
    assert not registry.policy.is_member(worker_id)


# ------------------------------------------------------------------------------------------ over loopback
@pytest.fixture
def broker(make_broker):
    harness = make_broker(run_id="fanout", heartbeat_interval_s=0.2, heartbeat_liveness=2)
    channel = grpc.insecure_channel(harness.grpc_address)
    try:
        yield harness, control_pb2_grpc.BrokerStub(channel)
    finally:
        channel.close()


def publish_over_the_wire(harness, version: int, **kwargs) -> None:
    header, payload = tiny_update(version, **kwargs)
    with WeightPublisher(harness.weight_endpoint, None, "trainer", harness.service.chunk_bytes) as publisher:
        assert publisher.publish(header, payload, timeout_s=20).applied


def test_heartbeat_and_register_say_the_latest_version_after_a_publish_with_no_status_read(broker):
    harness, stub = broker
    registered = stub.Register(control_pb2.RegisterRequest(role=INFER, name="infer-0"), timeout=5)
    assert registered.latest_policy_version == 0
    publish_over_the_wire(harness, 1)
    beat = stub.Heartbeat(control_pb2.HeartbeatRequest(worker_id=registered.worker_id), timeout=5)
    assert beat.latest_policy_version == 1
    assert stub.Register(control_pb2.RegisterRequest(role=INFER, name="infer-1"), timeout=5).latest_policy_version == 1


def test_a_lost_worker_gets_no_push_until_it_registers_again(broker):
    harness, stub = broker
    registry = harness.service.registry
    publish_over_the_wire(harness, 1)
    worker_id = stub.Register(control_pb2.RegisterRequest(role=INFER, name="infer-0"), timeout=5).worker_id
    with WeightSubscriber(harness.weight_endpoint, None, worker_id, hello_interval_s=0.2) as subscriber:
        subscriber.hello(None)
        received = subscriber.receive(10.0)
        assert received is not None and received[0].policy_version == 1
        subscriber.ack(1)
        # No heartbeat: the registry marks it LOST within liveness * interval (0.4 s), while its subscriber keeps
        # saying HELLO.
        wait_until(lambda: registry.list_workers(include_gone=True)[0].state == control_pb2.WORKER_STATE_LOST, 10)
        publish_over_the_wire(harness, 2, kind=DELTA, base=1)
        assert subscriber.receive(1.5) is None
        assert worker_id not in harness.service.weight_plane.worker_versions()
    again = stub.Register(control_pb2.RegisterRequest(role=INFER, name="infer-0"), timeout=5).worker_id
    with WeightSubscriber(harness.weight_endpoint, None, again) as subscriber:
        subscriber.hello(1)
        received = subscriber.receive(10.0)
        assert received is not None and received[0].policy_version == 2
