"""Weight clients and the plane through rollbacks and broker restarts, over real ZMQ on loopback.

- a rollback: workers that hold v3 of the old lineage load the re-published v3; late joiners get it; the replaced
  publisher is told it was superseded;
- the publisher: fails fast when the connection drops or none comes up, and ``PolicyPublisher`` waits through a
  broker restart in the middle of a push (the restarted plane reloads its durable chain), then goes on;
- the subscriber: says ``waiting for the broker`` and gives up with ``BrokerOutageExceeded`` past its budget, or
  gets the broker back, says HELLO again and receives what it missed.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from support.probes import wait_until

from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_plane import WeightPlane
from primerl.broker.weight_store import WeightStore
from primerl.client.outage import BrokerOutageExceeded
from primerl.client.weight_publisher import WeightBrokerLost, WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.proto import tensor_frames as tf
from primerl.proto.data_plane_limits import BrokerLimits
from primerl.proto.v1 import data_pb2
from primerl.proto.weight_refusals import LineageSuperseded

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA
TOKEN = "run-secret"
CHUNK_BYTES = 64 * 1024
LIMITS = BrokerLimits.for_max_message_bytes(1 << 20).frames
RECEIVE_S = 10.0


def make_update(
    version: int,
    lineage: int,
    kind: int = FULL,
    base: int = 0,
    num_bytes: int = 4096,
    seed: int = 0,
    lineage_base: int = 0,
):
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
        lineage_base_version=lineage_base,
    )
    return header, data


class Mesh:
    """Real planes (restartable on one port, one durable directory) and the clients of a test."""

    def __init__(self, tmp_path: Path):
        self.context = zmq.Context()
        self.durable_dir = tmp_path / "weights"
        self.planes: list[WeightPlane] = []
        self.clients: list = []
        self.port = 0

    def start_plane(self, store: WeightStore | None = None) -> WeightPlane:
        plane = WeightPlane(
            WeightFanout(store or WeightStore(), ack_timeout_s=5.0),
            self.context,
            "127.0.0.1",
            self.port,
            LIMITS,
            TOKEN,
            CHUNK_BYTES,
            durable_dir=self.durable_dir,
        )
        self.port = plane.start()
        self.planes.append(plane)
        return plane

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def publisher(self, **kwargs) -> WeightPublisher:
        publisher = WeightPublisher(
            self.endpoint, TOKEN, "trainer", CHUNK_BYTES, context=self.context, limits=LIMITS, **kwargs
        )
        self.clients.append(publisher)
        return publisher

    def subscriber(self, worker_id: str, **kwargs) -> WeightSubscriber:
        subscriber = WeightSubscriber(self.endpoint, TOKEN, worker_id, context=self.context, limits=LIMITS, **kwargs)
        self.clients.append(subscriber)
        return subscriber

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for plane in self.planes:
            plane.stop(5.0)
        self.context.destroy(linger=0)


@pytest.fixture
def mesh(tmp_path: Path):
    mesh = Mesh(tmp_path)
    yield mesh
    mesh.close()


def receive_and_ack(subscriber: WeightSubscriber, timeout_s: float = RECEIVE_S):
    got = subscriber.receive(timeout_s)
    assert got is not None, f"{subscriber.worker_id} received nothing"
    header, payload = got
    subscriber.ack(header.policy_version, apply_ms=1, lineage=header.lineage)  # as the worker does once it applied it
    return header, bytes(payload)


def wait_for(predicate) -> None:
    wait_until(predicate, timeout_s=10.0)


def test_a_rollback_reaches_every_worker_and_late_joiners(mesh: Mesh) -> None:
    plane = mesh.start_plane()
    old = mesh.publisher()
    workers = [mesh.subscriber(f"infer-{i}") for i in range(2)]
    for worker in workers:
        worker.hello()
    chain = [make_update(1, 10), make_update(2, 10, DELTA, base=1), make_update(3, 10, DELTA, base=2)]
    for header, data in chain:
        assert old.publish(header, data, timeout_s=RECEIVE_S).applied
    for worker in workers:
        assert [receive_and_ack(worker)[0].policy_version for _ in chain] == [1, 2, 3]
    wait_for(lambda: plane.worker_versions() == {"infer-0": 3, "infer-1": 3})

    # The trainer resumed from checkpoint 2 and re-trains step 3: FULL v3 of lineage 20, other bytes.
    new_header, new_data = make_update(3, 20, seed=1, num_bytes=200_000, lineage_base=2)
    ack = mesh.publisher().publish(new_header, new_data, timeout_s=RECEIVE_S)
    assert ack.applied and ack.lineage == 20
    for worker in workers:
        header, payload = receive_and_ack(worker)
        assert (header.policy_version, header.lineage, payload) == (3, 20, new_data)
        assert (worker.current_version, worker.current_lineage) == (3, 20)
    wait_for(
        lambda: (
            {w.worker_id: (w.policy_version, w.lineage) for w in plane.status().workers}
            == {"infer-0": (3, 20), "infer-1": (3, 20)}
        )
    )
    status = plane.status().store
    assert (status.latest_version, status.lineage, status.num_rollbacks) == (3, 20, 1)
    assert plane.store.latest().header.digest == new_header.digest

    # A late joiner, and a worker that comes back saying it holds the old lineage's v3: both get the new v3.
    late = mesh.subscriber("late")
    late.hello()
    back = mesh.subscriber("back")
    back.hello(3, lineage=10)
    for subscriber in (late, back):
        header, payload = receive_and_ack(subscriber)
        assert (header.policy_version, header.lineage, payload) == (3, 20, new_data)

    # The replaced trainer's late v4 is refused and tells it so; nothing reaches the workers.
    with pytest.raises(LineageSuperseded) as info:
        old.publish(*make_update(4, 10, DELTA, base=3), timeout_s=RECEIVE_S)
    assert info.value.broker_lineage == 20
    assert workers[0].receive(0.3) is None and plane.store.latest_version == 3


def test_publish_fails_fast_when_the_broker_is_gone(mesh: Mesh) -> None:
    plane = mesh.start_plane()
    publisher = mesh.publisher(connect_timeout_s=0.5)
    assert publisher.publish(*make_update(1, 10), timeout_s=RECEIVE_S).applied
    assert plane.stop(5.0)
    start = time.monotonic()
    with pytest.raises(WeightBrokerLost):
        publisher.publish(*make_update(2, 10), timeout_s=60.0)
    assert time.monotonic() - start < 5.0, "a publish to a stopped broker must not wait for its whole timeout"
    # The broker comes back on its port (with its durable chain): the same publisher goes on.
    mesh.start_plane()
    assert publisher.publish(*make_update(2, 10), timeout_s=RECEIVE_S).applied


def test_policy_publisher_rides_through_a_broker_restart_during_a_push(mesh: Mesh, tmp_path: Path) -> None:
    """The broker is stopped as the first chunk of a 16 MiB FULL arrives and restarted 1.5 s later: the trainer's
    publish waits (logging), resends, and returns; the restarted broker holds the version and the next one."""
    from primerl.trainer.publish import PolicyPublisher

    first_chunk = threading.Event()

    class TrippedStore(WeightStore):  # the real store; tells the test when a transfer begins
        def check_header(self, header):
            first_chunk.set()
            return super().check_header(header)

    plane = mesh.start_plane(TrippedStore())
    model = torch.nn.Linear(2048, 2048, bias=False)  # 16 MiB of fp32 weights
    publisher = PolicyPublisher(mesh.endpoint, TOKEN, "trainer", CHUNK_BYTES, "full", "tiny", outage_s=30.0, lineage=10)
    mesh.clients.append(publisher)

    def restart() -> None:
        assert first_chunk.wait(30.0)
        plane.stop(10.0)
        time.sleep(1.5)
        mesh.start_plane()

    restarter = threading.Thread(target=restart)
    restarter.start()
    with torch.no_grad():
        model.weight.normal_()
    result = publisher.publish(_Wrapped(model), 1, timeout_s=60.0)
    restarter.join(30.0)
    assert result.ack.applied and result.kind == "full"
    restarted = mesh.planes[-1]
    assert restarted.store.latest_version == 1 and restarted.store.latest().header.digest
    with torch.no_grad():
        model.weight.add_(1.0)
    assert publisher.publish(_Wrapped(model), 2, timeout_s=60.0).ack.applied
    assert restarted.store.latest_version == 2


class _Wrapped(torch.nn.Module):
    """A minimal Hugging Face-like model (what ``hf_state_dict`` reads) around one linear layer."""

    _keys_to_ignore_on_save = None
    _tied_weights_keys = None

    def __init__(self, linear):
        super().__init__()
        self.linear = linear
        self.config = type("Config", (), {"tie_word_embeddings": False})()


def test_subscriber_waits_through_an_outage_then_gives_up(mesh: Mesh, caplog) -> None:
    plane = mesh.start_plane()
    subscriber = mesh.subscriber("infer-0", outage_s=1.0, hello_interval_s=0.2, liveness_s=0.5)
    subscriber.hello()
    assert subscriber.receive(0.5) is None and subscriber.broker_latest == (0, 0)  # the broker answered
    assert plane.stop(5.0)
    start = time.monotonic()
    with pytest.raises(BrokerOutageExceeded) as info:
        while time.monotonic() - start < 10.0:
            subscriber.receive(0.5)
    assert 1.0 <= time.monotonic() - start < 5.0
    assert "broker.outage_s" in str(info.value)


def test_subscriber_gets_the_broker_back_and_what_it_missed(mesh: Mesh) -> None:
    plane = mesh.start_plane()
    subscriber = mesh.subscriber("infer-0", outage_s=20.0, hello_interval_s=0.2, liveness_s=0.5)
    subscriber.hello()
    publisher = mesh.publisher()
    publisher.publish(*make_update(1, 10), timeout_s=RECEIVE_S)
    assert receive_and_ack(subscriber)[0].policy_version == 1
    assert plane.stop(5.0)
    assert subscriber.receive(1.5) is None  # in the outage: waits, logs, does not fail
    mesh.start_plane()  # reloads v1 from its durable directory
    header, data = make_update(2, 10, DELTA, base=1)
    assert publisher.publish(header, data, timeout_s=RECEIVE_S).applied
    got, payload = receive_and_ack(subscriber)
    assert (got.policy_version, payload) == (2, data)
    wait_for(lambda: mesh.planes[-1].worker_versions() == {"infer-0": 2})


def test_a_worker_that_keeps_the_rolled_back_weights_is_retried_then_forgotten(mesh: Mesh) -> None:
    """A worker that answers the re-published v3 by acknowledging v3 without loading it (the way it acknowledges a
    resend) keeps its old lineage in the broker's view: sent again, then forgotten, never counted as current."""
    plane = WeightPlane(
        WeightFanout(WeightStore(), max_retries=1), mesh.context, "127.0.0.1", 0, LIMITS, TOKEN, CHUNK_BYTES
    )
    mesh.port = plane.start()
    mesh.planes.append(plane)
    publisher = mesh.publisher()
    worker = mesh.subscriber("stubborn", hello_interval_s=60.0)
    worker.hello()
    publisher.publish(*make_update(3, 10), timeout_s=RECEIVE_S)
    receive_and_ack(worker)
    mesh.publisher().publish(*make_update(3, 20, seed=1, lineage_base=2), timeout_s=RECEIVE_S)
    for _ in range(2):
        got = worker.receive(RECEIVE_S)
        assert got is not None and (got[0].policy_version, got[0].lineage) == (3, 20)
        worker.ack(3)  # "already serving v3": no lineage given, so the subscriber does not claim lineage 20
        if _ == 0:
            wait_for(lambda: [(w.policy_version, w.lineage) for w in plane.status().workers] == [(3, 10)])
    wait_for(lambda: plane.status().num_workers_forgotten == 1 and plane.worker_versions() == {})
