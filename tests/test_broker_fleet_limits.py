"""What keeps one broker's cost per worker constant at fleet scale (docs/performance.md, "One broker for a fleet"),
each pinned without sockets: expiry sweeps only when a deadline passed, registration in constant time with a
configurable bound, one status shared by every watch stream, the clients' jittered backoff, and relay chains of
bounded length."""

from __future__ import annotations

import statistics
import time

import pytest
from support.control_plane import client_for, start_broker
from support.probes import wait_until
from support.weight_updates import publish
from test_broker_registry import INFER, LOST, FakeClock, heartbeat, register

from primerl.broker.registry import WorkerRegistry
from primerl.broker.registry_errors import LimitReached, NameTaken
from primerl.broker.status_cache import SharedStatus
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_members import Joined
from primerl.broker.weight_store import WeightStore
from primerl.client.channel import BACKOFF_INITIAL_S, jittered
from primerl.proto.v1 import control_pb2

NUM_WORKERS = 1000


def test_heartbeats_of_a_large_fleet_do_not_sweep_the_registry_each_time():
    clock = FakeClock()
    registry = WorkerRegistry("r", heartbeat_interval_s=1.0, liveness=5, clock=clock)
    ids = [register(registry, f"infer-{i}", INFER) for i in range(NUM_WORKERS)]
    for _ in range(3):  # three rounds of heartbeats, 1 s apart: nobody is near its 5 s bound
        clock.advance(1.0)
        for worker_id in ids:
            heartbeat(registry, worker_id)
    # 3000 heartbeats: a sweep only when the earliest deadline passed (it had not), not one per call
    assert registry.num_expiry_sweeps <= 3
    silent = ids[0]
    clock.advance(1.0)
    for worker_id in ids[1:]:
        heartbeat(registry, worker_id)
    clock.advance(4.5)  # the silent one is 5.5 s past its last heartbeat; the others 4.5 s
    lost = registry.expire()
    assert [w.worker_id for w in lost] == [silent]  # still exact: the one past its bound, at the first read after
    assert registry.get_worker(silent).state == LOST
    assert len(registry.list_workers()) == NUM_WORKERS - 1


def test_the_worker_bound_is_the_brokers_setting_and_names_stay_unique():
    registry = WorkerRegistry("r", 1.0, 3, clock=FakeClock(), max_workers=2)
    first = register(registry, "a", INFER)
    register(registry, "b", INFER)
    with pytest.raises(LimitReached, match="broker.max_workers"):
        register(registry, "c", INFER)
    registry.deregister(first)
    register(registry, "a", INFER)  # the name of a departed worker is free again, and so is its place
    with pytest.raises(LimitReached):
        register(registry, "d", INFER)
    big = WorkerRegistry("r", 1.0, 3, clock=FakeClock())
    for i in range(600):  # above the old fixed bound of 512
        register(big, f"w{i}", INFER)
    with pytest.raises(NameTaken):
        register(big, "w7", INFER)


class Builds:
    def __init__(self) -> None:
        self.num = 0

    def __call__(self) -> control_pb2.RunStatus:
        self.num += 1
        return control_pb2.RunStatus(run_id=f"build-{self.num}", updated_unix_ms=self.num)


def test_status_streams_share_one_status_per_interval():
    clock, build, version = FakeClock(), Builds(), [1]
    shared = SharedStatus(build, lambda: version[0], min_age_s=0.2, max_age_s=1.0, clock=clock)
    first = shared.get(1)
    for _ in range(50):  # fifty watchers wake up for the same version: one build
        assert shared.get(1) is first
    version[0] = 2  # a change (a heartbeat)...
    assert shared.get(2) is first  # ...younger than the floor: the caller asks again later
    clock.advance(0.25)
    second = shared.get(2)
    assert second.version == 2 and build.num == 2 and second.key != first.key
    clock.advance(0.9)
    assert shared.get(2) is second  # no change, younger than max_age
    clock.advance(0.2)
    assert shared.get(2).status.run_id == "build-3"  # the data plane moves without a version: rebuilt past max_age


def test_the_clients_backoff_is_jittered():
    waits = [jittered(5.0) for _ in range(2000)]
    assert min(waits) >= BACKOFF_INITIAL_S and max(waits) <= 5.0
    assert 2.0 < statistics.mean(waits) < 3.1 and statistics.pstdev(waits) > 1.0  # spread over the whole backoff
    assert jittered(0.05) == BACKOFF_INITIAL_S


def test_relay_chains_are_bounded_in_length():
    fanout = WeightFanout(WeightStore(), fanout="chain", relay_max_hops=32)
    ids = [f"w{i}" for i in range(70)]
    for i, worker_id in enumerate(ids):
        assert fanout.hello(worker_id, None, 0, relay_endpoint=f"tcp://127.0.0.1:{20000 + i}") is Joined.JOINED
    publish(fanout, 1)
    steps = [fanout.next_step(worker_id) for worker_id in ids]
    chains = {id(step.chain): step.chain for step in steps if step is not None}
    # 70 workers: 3 chains of 23-24 (one send of each chunk per chain), not one chain of 70 hops
    assert sorted(len(chain.hops) for chain in chains.values()) == [23, 23, 24]
    assert sorted(hop for chain in chains.values() for hop in chain.hops) == sorted(ids)
    assert all(steps[ids.index(chain.hops[0])].chain is chain for chain in chains.values())  # sent to each head


def test_the_weight_plane_asks_only_members_with_something_to_send():
    fanout = WeightFanout(WeightStore())
    publish(fanout, 1)
    for i in range(100):
        fanout.hello(f"w{i}", 1 if i else None, 0)  # w0 holds nothing yet: it is sent version 1
    assert fanout.with_something_to_send() == ["w0"]  # the plane's loop visits one member, not a hundred
    publish(fanout, 2)
    assert len(fanout.with_something_to_send()) == 100


def test_the_heartbeat_interval_grows_with_the_fleet_and_so_does_the_liveness_bound():
    clock = FakeClock()
    registry = WorkerRegistry("r", heartbeat_interval_s=1.0, liveness=3, clock=clock, heartbeat_budget_per_s=10)
    first = registry.register(control_pb2.RegisterRequest(role=INFER, name="infer-0"))
    assert first.heartbeat_interval_ms == 1000  # a small fleet: the configured interval
    ids = [register(registry, f"infer-{i}", INFER) for i in range(1, 30)]
    assert heartbeat(registry, first.worker_id).heartbeat_interval_ms == 3000  # 30 workers at <= 10 beats/s
    assert {heartbeat(registry, worker_id).heartbeat_interval_ms for worker_id in ids} == {3000}
    clock.advance(5.0)  # past 3 x 1 s, within 3 x 3 s
    assert registry.expire() == [] and len(registry.list_workers()) == 30
    clock.advance(4.5)
    assert len(registry.expire()) == 30  # past 3 x 3 s: all lost, as each was told


def test_a_client_heartbeats_at_the_interval_the_broker_asks_for():
    broker = start_broker(interval_s=0.1, liveness=10, heartbeat_budget_per_s=20)
    try:
        for i in range(9):  # ten workers at <= 20 beats/s: every 0.5 s
            register(broker.registry, f"other-{i}", INFER)
        with client_for(broker, "infer-0", "inference") as client:
            client.start_heartbeats()
            wait_until(lambda: client.heartbeat_interval_s == 0.5, what="the interval of a ten-worker fleet")
            version = broker.registry.version
            time.sleep(1.6)
            assert broker.registry.version - version <= 5  # ~3 beats (one per 0.5 s), not 16 (one per 0.1 s)
    finally:
        broker.stop()
