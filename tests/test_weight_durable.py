"""The weight store's chain on disk: reloaded after a restart (also through the real plane over loopback), a new
lineage withdraws the old chain before it is acknowledged, damaged files start the broker empty, not wrong."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import zmq

from primerl.broker.weight_durable import LINEAGE_FILE, MANIFEST_FILE, WeightDurability
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_plane import WeightPlane
from primerl.broker.weight_store import WeightStore
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.proto import tensor_frames as tf
from primerl.proto.data_plane_limits import BrokerLimits
from primerl.proto.v1 import data_pb2

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA
LIMITS = BrokerLimits.for_max_message_bytes(1 << 20).frames
CHUNK_BYTES = 64 * 1024


def make_update(version: int, lineage: int, kind: int = FULL, base: int = 0, num_bytes: int = 4096, seed: int = 0):
    rng = np.random.default_rng([version, lineage, seed])
    data, specs = tf.encode_tensors({"w": rng.integers(0, 255, num_bytes, dtype=np.uint8)})
    header = data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=kind,
        base_version=base,
        tensors=specs,
        digest=hashlib.sha256(data).hexdigest(),
        payload_bytes=len(data),
        lineage=lineage,
        lineage_base_version=0,
    )
    return header, data


def durable_store(directory: Path) -> tuple[WeightStore, WeightDurability]:
    store, durable = WeightStore(), WeightDurability(directory)
    store.attach_durable(durable)
    return store, durable


def chain_of(store: WeightStore) -> list[tuple[int, int, int, bytes]]:
    return [(u.policy_version, u.kind, u.lineage, bytes(u.payload)) for u in store.plan_for(None)]


def test_the_chain_is_reloaded_after_a_restart(tmp_path: Path) -> None:
    store, durable = durable_store(tmp_path)
    store.put(*make_update(1, 10))
    store.put(*make_update(2, 10, DELTA, base=1))
    store.put(*make_update(3, 10, DELTA, base=2))
    assert durable.flush(10.0)
    before = chain_of(store)
    assert store.close()
    again, _ = durable_store(tmp_path)
    assert chain_of(again) == before and again.lineage == 10 and again.latest_version == 3
    # The reloaded chain goes on: a worker on it gets the next delta, the trainer's resend is acknowledged.
    assert again.put(*make_update(3, 10, DELTA, base=2)).duplicate
    again.put(*make_update(4, 10, DELTA, base=3))
    assert [u.policy_version for u in again.plan_for(3, 10)] == [4]
    again.close()


def test_a_new_snapshot_replaces_the_files_of_the_old_one(tmp_path: Path) -> None:
    store, durable = durable_store(tmp_path)
    store.put(*make_update(1, 10))
    store.put(*make_update(2, 10, DELTA, base=1))
    store.put(*make_update(3, 10))
    assert durable.flush(10.0)
    assert sorted(p.name for p in tmp_path.glob("*.wupd")) == ["full-v3-l10.wupd"]
    assert json.loads((tmp_path / MANIFEST_FILE).read_text())["updates"] == ["full-v3-l10.wupd"]
    store.close()


def test_a_new_lineage_is_recorded_before_it_is_acknowledged(tmp_path: Path) -> None:
    """When lineage 20 replaces lineage 10 (a rollback to v2), the old chain is withdrawn from disk before ``put``
    returns: a crash right then restarts the broker with no snapshot, never with the rolled-back v3."""
    store, durable = durable_store(tmp_path)
    store.put(*make_update(3, 10))
    assert durable.flush(10.0)
    durable.stop()  # the writer is gone (as in a crash right after the put): only the synchronous part runs
    header, data = make_update(3, 20, seed=1)
    header.lineage_base_version = 2
    assert store.put(header, data).rolled_back_from == 3
    assert json.loads((tmp_path / LINEAGE_FILE).read_text()) == {
        "lineage": 20,
        "lineage_base_version": 2,
        "num_rollbacks": 1,
    }
    assert not (tmp_path / MANIFEST_FILE).exists()
    again, durable_again = durable_store(tmp_path)
    assert again.latest_version is None and again.lineage == 20
    # the rollback is still counted after the restart (run status said 1 before it; chaos saw 2 -> 0 after one)
    assert again.status().num_rollbacks == 1
    # The replaced trainer's late update is refused by the restarted broker too.
    assert again.status().lineage_base_version == 2
    try:
        again.put(*make_update(4, 10))
        raise AssertionError("an older lineage's update was accepted after a restart")
    except ValueError as exc:
        assert "superseded" in str(exc)
    again.put(header, data)
    assert durable_again.flush(10.0)
    third, _ = durable_store(tmp_path)
    assert chain_of(third) == [(3, FULL, 20, data)]
    for s in (again, third):
        s.close()


def test_a_lineage_file_from_before_the_rollback_count_loads_as_none_counted(tmp_path: Path) -> None:
    (tmp_path / LINEAGE_FILE).write_text(json.dumps({"lineage": 7, "lineage_base_version": 3}))
    store, _ = durable_store(tmp_path)
    assert store.lineage == 7 and store.status().num_rollbacks == 0
    store.close()


def test_a_damaged_file_starts_the_store_empty(tmp_path: Path) -> None:
    store, durable = durable_store(tmp_path)
    store.put(*make_update(1, 10, num_bytes=10_000))
    assert durable.flush(10.0)
    store.close()
    path = tmp_path / "full-v1-l10.wupd"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    again, _ = durable_store(tmp_path)
    assert again.latest_version is None and again.lineage == 10
    again.put(*make_update(2, 10))  # and it serves on
    again.close()


def test_a_worker_joining_a_restarted_plane_gets_the_current_policy(tmp_path: Path) -> None:
    """Through the real plane over loopback: publish v1 and a delta v2, stop the plane (a broker restart), start a
    new plane on the same directory: a late worker gets v1 + v2 at once, without the trainer."""
    context = zmq.Context()
    clients: list = []
    planes: list[WeightPlane] = []
    try:

        def plane() -> str:
            planes.append(
                WeightPlane(
                    WeightFanout(WeightStore()),
                    context,
                    "127.0.0.1",
                    0,
                    LIMITS,
                    None,
                    CHUNK_BYTES,
                    durable_dir=tmp_path / "weights",
                )
            )
            return f"tcp://127.0.0.1:{planes[-1].start()}"

        endpoint = plane()
        publisher = WeightPublisher(endpoint, None, "trainer", CHUNK_BYTES, context=context, limits=LIMITS)
        clients.append(publisher)
        updates = [make_update(1, 10, num_bytes=200_000), make_update(2, 10, DELTA, base=1)]
        for header, data in updates:
            assert publisher.publish(header, data, timeout_s=10).applied
        assert planes[0].stop(10.0)  # flushes the writer
        endpoint = plane()
        late = WeightSubscriber(endpoint, None, "late", context=context, limits=LIMITS)
        clients.append(late)
        late.hello()
        got = []
        for _ in updates:
            received = late.receive(10.0)
            assert received is not None
            got.append((received[0].policy_version, received[0].lineage, bytes(received[1])))
            late.ack(received[0].policy_version)
        assert got == [(h.policy_version, 10, d) for h, d in updates]
        assert late.broker_latest == (2, 10)  # the answer to HELLO says what the broker holds
    finally:
        for client in clients:
            client.close()
        for p in planes:
            p.stop(5.0)
        context.destroy(linger=0)


def test_a_restarted_broker_daemon_serves_the_policy_to_a_joining_worker(tmp_path: Path) -> None:
    """The broker daemon's core (``BrokerService``) with its spool directory: publish, stop (a restart), start on
    the same spool: a worker that joins gets the latest version before the trainer publishes anything."""
    from primerl.broker.service import BrokerService
    from primerl.configs.broker import BrokerConfig

    def start() -> tuple[BrokerService, str]:
        service = BrokerService(BrokerConfig(grpc_port=0, rollout_port=0, weight_port=0, spool_dir=tmp_path / "spool"))
        endpoints = service.start()
        return service, f"tcp://127.0.0.1:{endpoints.weight_port}"

    service, endpoint = start()
    try:
        with WeightPublisher(endpoint, None, "trainer", CHUNK_BYTES, limits=LIMITS) as publisher:
            for header, data in (make_update(1, 10), make_update(2, 10, DELTA, base=1)):
                assert publisher.publish(header, data, timeout_s=10).applied
    finally:
        service.stop(grace_s=0)
    service, endpoint = start()
    try:
        assert service.weight_store.status().latest_version == 2
        with WeightSubscriber(endpoint, None, "joiner", limits=LIMITS) as worker:
            worker.hello()
            got = [worker.receive(10.0) for _ in range(2)]
            assert [(g[0].policy_version, g[0].lineage) for g in got if g is not None] == [(1, 10), (2, 10)]
    finally:
        service.stop(grace_s=0)
