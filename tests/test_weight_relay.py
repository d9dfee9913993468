"""Relay (chain) fan-out of weight updates (``broker.weight_fanout = "chain"``): the fan-out core's chain planning and
healing, driven directly with a fake clock; then over real ZeroMQ on loopback, a real ``WeightPlane`` and four real
``WeightSubscriber``s that relay: every worker gets the update bit for bit while the broker sends each payload byte
once, and a worker that dies mid-relay is healed around within the relay timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.daemons import BrokerProcess
from support.probes import scrape_metrics, wait_until
from support.weight_plane import CHUNK_BYTES, RECEIVE_S, make_update

from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_relay import valid_relay_endpoint
from primerl.broker.weight_store import WeightStore
from primerl.client.weight_publisher import WeightPublisher
from primerl.proto import telemetry
from primerl.proto.digests import payload_digest

RELAY_TIMEOUT_S = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def chain_fanout(clock, **kwargs) -> WeightFanout:
    return WeightFanout(WeightStore(), fanout="chain", relay_timeout_s=RELAY_TIMEOUT_S, clock=clock, **kwargs)


def join(fanout: WeightFanout, *worker_ids: str, relay: bool = True) -> None:
    for worker_id in worker_ids:
        fanout.hello(worker_id, None, 0, relay_endpoint=f"tcp://127.0.0.1:{7000 + len(worker_id)}" if relay else "")


def publish(fanout: WeightFanout, version: int):
    header, data = make_update(version)
    header.digest, header.payload_bytes = payload_digest(data), len(data)
    fanout.put_update(StoredUpdate.of(header, data))
    return fanout.store.status().latest_version


def send_head(fanout: WeightFanout, worker_id: str):
    """Send the member its next update whole (one chunk); the step it was."""
    step = fanout.next_step(worker_id)
    assert step is not None and step.index == 0
    fanout.chunk_sent(worker_id, step.update, last=True)
    return step


# ------------------------------------------------------------------------------------------ planning
def test_members_that_relay_form_one_chain_and_only_its_head_is_sent_chunks(clock):
    fanout = chain_fanout(clock)
    join(fanout, "w2", "w0", "w1")
    join(fanout, "plain", relay=False)
    publish(fanout, 1)
    assert fanout.next_step("w1") is None, "w1 starts the update, in a chain headed by the first to join"
    step = fanout.next_step("w2")
    assert step is not None and step.chain is not None
    assert step.chain.hops == ("w2", "w0", "w1"), "the chain follows the order of joining"
    assert step.chain.endpoints[0].startswith("tcp://")
    assert fanout.next_step("w0") is None, "relayed members are sent nothing"
    plain = fanout.next_step("plain")
    assert plain is not None and plain.chain is None, "a member without a relay socket is sent the update itself"
    fanout.chunk_sent("w2", step.update, last=True)
    for worker_id in ("w0", "w1", "w2"):
        status = next(s for s in fanout.workers() if s.worker_id == worker_id)
        assert status.num_unacked == 1 and status.num_pending == 0, worker_id
    for worker_id in ("w0", "w1", "w2"):
        assert fanout.ack(worker_id, 1, 0, applied=True) is True
    assert fanout.worker_versions() == {"w0": 1, "w1": 1, "w2": 1, "plain": None}
    assert fanout.counts().num_relay_chains == 1


def test_begin_chains_the_members_an_arriving_update_starts(clock):
    fanout = chain_fanout(clock)
    join(fanout, "a", "b", "c")
    header, data = make_update(1)
    header.digest, header.payload_bytes = payload_digest(data), len(data)
    update = StoredUpdate.of(header, data)
    assert fanout.begin(update) == 3
    step = fanout.next_step("a")
    assert step.chain is not None and step.chain.hops == ("a", "b", "c")
    assert fanout.next_step("b") is None


def test_star_mode_ignores_relay_endpoints(clock):
    fanout = WeightFanout(WeightStore(), clock=clock)
    join(fanout, "w0", "w1")
    publish(fanout, 1)
    for worker_id in ("w0", "w1"):
        step = fanout.next_step(worker_id)
        assert step is not None and step.chain is None
    assert fanout.counts().num_relay_chains == 0


def test_a_single_relaying_member_is_sent_its_update_directly(clock):
    fanout = chain_fanout(clock)
    join(fanout, "w0")
    publish(fanout, 1)
    assert fanout.next_step("w0").chain is None


# ------------------------------------------------------------------------------------------ healing
def test_members_a_relay_did_not_reach_in_time_get_the_update_again_without_the_one_that_held_it_up(clock):
    fanout = chain_fanout(clock)
    join(fanout, "w0", "w1", "w2", "w3")
    publish(fanout, 1)
    send_head(fanout, "w0")
    assert fanout.ack("w0", 1, 0, applied=True)
    clock.now += RELAY_TIMEOUT_S - 0.1
    fanout.tick()
    assert fanout.counts().num_relay_heals == 0, "healed before the relay timeout"
    clock.now += 0.2
    fanout.tick()  # w1 (dead) never acknowledged, so neither did w2 and w3 behind it
    assert fanout.counts().num_relay_heals == 3
    step = fanout.next_step("w2")
    assert step is not None and step.update.policy_version == 1
    assert step.chain is not None and step.chain.hops == ("w2", "w3"), "the new chain must leave out w1"
    w1 = fanout.next_step("w1")
    assert w1 is not None and w1.chain is None, "the worker that held the chain up is sent the update alone"
    # once it acknowledges an update it relays again
    fanout.chunk_sent("w1", w1.update, last=True)
    assert fanout.ack("w1", 1, 0, applied=True)
    publish(fanout, 2)
    step = fanout.next_step("w0")
    assert step.chain is not None and step.chain.hops == ("w0", "w1")


def test_acknowledging_an_earlier_update_keeps_the_relay_deadline_of_a_later_one(clock):
    fanout = chain_fanout(clock)
    join(fanout, "w0", "w1")
    publish(fanout, 1)
    send_head(fanout, "w0")
    publish(fanout, 2)
    send_head(fanout, "w0")  # v2 relayed right behind v1
    assert fanout.ack("w1", 1, 0, applied=True)  # w1 got v1 through w0, which then died holding v2
    clock.now += RELAY_TIMEOUT_S + 0.1
    fanout.tick()
    assert fanout.counts().num_relay_heals >= 1, "w1 must get v2 again although it acknowledged v1"
    step = fanout.next_step("w1")
    assert step is not None and step.update.policy_version == 2


def test_a_chain_whose_head_leaves_is_dissolved_and_its_members_planned_again(clock):
    fanout = chain_fanout(clock)
    join(fanout, "w0", "w1", "w2")
    publish(fanout, 1)
    step = fanout.next_step("w0")
    fanout.chunk_sent("w0", step.update, last=False)
    fanout.forget("w0", reason="peer disconnected")
    assert fanout.counts().num_relay_heals == 2
    step = fanout.next_step("w1")
    assert step is not None and step.index == 0 and step.chain.hops == ("w1", "w2")


def test_a_chain_whose_head_takes_no_chunk_is_dissolved_after_the_relay_timeout(clock):
    fanout = chain_fanout(clock)
    join(fanout, "w0", "w1", "w2")
    publish(fanout, 1)
    head = fanout.next_step("w0")
    fanout.chunk_sent("w0", head.update, last=False)
    clock.now += RELAY_TIMEOUT_S + 1
    fanout.tick()
    assert fanout.counts().num_relay_heals == 2
    assert fanout.next_step("w1") is not None, "w1 waits no longer on the stalled head"
    still = fanout.next_step("w0")
    assert still.chain is head.chain and still.index == 1, "the head goes on with the chunks it was sent"


def test_relay_endpoints_are_checked():
    assert valid_relay_endpoint("tcp://10.0.0.5:4000") and valid_relay_endpoint("ipc:///tmp/x")
    for bad in ("", "http://x:1", "tcp://" + "x" * 300, "tcp://a\nb:1"):
        assert not valid_relay_endpoint(bad), bad
    with pytest.raises(ValueError, match="fanout must be one of"):
        WeightFanout(WeightStore(), fanout="tree")


# ------------------------------------------------------------------------------------------ over loopback
class Receiver:
    """A real WeightSubscriber with a relay socket, receiving in its own thread and acknowledging each update;
    ``die_after_chunks``: it stops dead (sockets closed, nothing acknowledged) once it has written that many."""

    class Died(Exception):
        pass

    def __init__(self, harness, worker_id: str, die_after_chunks: int | None = None):
        self.worker_id = worker_id
        self.die_after_chunks = die_after_chunks
        self.num_chunks = 0
        self.buffer = bytearray()
        self.got: dict[int, bytes] = {}
        self.got_s: dict[int, float] = {}
        self.dead = False
        self.sub = harness.subscriber(
            worker_id, payload_sink=self, relay_host="127.0.0.1", stall_timeout_s=2.0, hello_interval_s=0.5
        )
        self.sub.hello()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    # PayloadSink
    def begin_payload(self, header, num_bytes):
        self.buffer = bytearray(num_bytes)
        return memoryview(self.buffer)

    def payload_progress(self, num_bytes):
        self.num_chunks += 1
        if self.die_after_chunks is not None and self.num_chunks >= self.die_after_chunks:
            raise Receiver.Died()

    def end_payload(self, complete):
        pass

    def _run(self):
        try:
            while not self._stop.is_set():
                update = self.sub.receive(0.2)
                if update is None:
                    continue
                header, payload = update
                assert self.sub.received_digest == header.digest
                self.got[header.policy_version] = bytes(payload)
                self.got_s[header.policy_version] = time.monotonic()
                self.sub.ack(header.policy_version)
        except Receiver.Died:
            self.dead = True
            self.sub.close()

    def stop(self):
        self._stop.set()
        self.thread.join(5)


@pytest.fixture
def relay_plane(make_weight_plane):
    return make_weight_plane(fanout="chain", relay_timeout_s=2.0)


def test_four_relaying_workers_get_the_update_bit_for_bit_and_the_broker_sends_each_byte_once(relay_plane):
    h = relay_plane
    receivers = [Receiver(h, f"w{i}") for i in range(4)]
    wait_until(lambda: len(h.plane.worker_versions()) == 4)
    header, data = make_update(1, num_bytes=6 * CHUNK_BYTES)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    wait_until(lambda: all(1 in r.got for r in receivers), timeout_s=RECEIVE_S, what="every worker has v1")
    for receiver in receivers:
        assert receiver.got[1] == bytes(data), receiver.worker_id
    wait_until(lambda: sorted(h.applied) == [(f"w{i}", 1) for i in range(4)], what="every ack at the broker")
    status = h.plane.status()
    assert status.bytes_out_total == len(data), "the broker must send each payload byte once"
    assert status.num_relay_chains == 1 and status.num_relay_heals == 0
    forwarded = sorted(r.sub.relay.num_forwarded_bytes for r in receivers)
    assert forwarded == [0, len(data), len(data), len(data)], "three workers forward every byte, the last none"
    # a second update goes the same way
    header2, data2 = make_update(2, num_bytes=3 * CHUNK_BYTES + 17)
    h.publisher().publish(header2, data2, timeout_s=RECEIVE_S)
    wait_until(lambda: all(2 in r.got for r in receivers), timeout_s=RECEIVE_S, what="every worker has v2")
    assert all(r.got[2] == bytes(data2) for r in receivers)
    assert h.plane.status().bytes_out_total == len(data) + len(data2)
    for receiver in receivers:
        receiver.stop()


def test_a_worker_that_dies_mid_relay_is_healed_around_within_the_relay_timeout(relay_plane):
    h = relay_plane
    # w1 is the chain's second worker (chains follow the order of joining): it dies at its 2nd chunk.
    receivers = [Receiver(h, "w0"), Receiver(h, "w1", die_after_chunks=2), Receiver(h, "w2"), Receiver(h, "w3")]
    wait_until(lambda: len(h.plane.worker_versions()) == 4)
    header, data = make_update(1, num_bytes=8 * CHUNK_BYTES)
    sent_s = time.monotonic()
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    alive = [receivers[i] for i in (0, 2, 3)]
    wait_until(lambda: all(1 in r.got for r in alive), timeout_s=2.0 + 8.0, what="the live workers have v1")
    healed_s = max(r.got_s[1] for r in alive) - sent_s
    assert receivers[1].dead and 1 not in receivers[1].got
    for receiver in alive:
        assert receiver.got[1] == bytes(data), receiver.worker_id
    status = h.plane.status()
    assert status.num_relay_heals >= 2, status
    assert healed_s < 2.0 + 5.0, f"healing took {healed_s:.1f} s"
    # the broker sent w2 and w3 the update again (at most twice the payload in all: once to the first chain's
    # head, once to the new chain's), never once per worker
    assert status.bytes_out_total <= 3 * len(data), status.bytes_out_total
    for receiver in alive:
        receiver.stop()


# ------------------------------------------------------------------------------------------ a real broker process
RELAY_SUBSCRIBER = Path(__file__).resolve().parent / "scripts" / "relay_subscriber.py"
PROCESS_TOKEN = "relay-secret"


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_broker_process_relays_through_worker_processes_and_heals_around_a_killed_one(tmp_path):
    broker = BrokerProcess(
        tmp_path,
        tmp_path / "spool",
        "--run-token",
        PROCESS_TOKEN,
        "--weight-fanout",
        "chain",
        "--weight-relay-timeout-s",
        "2",
        "--log.level",
        "debug",
    )
    workers: dict[str, subprocess.Popen] = {}
    try:
        endpoint = f"tcp://127.0.0.1:{broker.ports['weight_port']}"
        for worker_id in ("w0", "w1", "w2", "w3"):
            delay = ["--chunk-delay-s", "0.3"] if worker_id == "w1" else []
            workers[worker_id] = subprocess.Popen(
                [
                    sys.executable,
                    str(RELAY_SUBSCRIBER),
                    endpoint,
                    PROCESS_TOKEN,
                    worker_id,
                    str(tmp_path / worker_id),
                    *delay,
                    "--run-s",
                    "60",
                    "--hello-when",
                    str(tmp_path / f"{worker_id}.go"),
                    "--grpc-address",
                    broker.grpc_address,
                ],
            )
        for number, worker_id in enumerate(workers, 1):
            (tmp_path / f"{worker_id}.go").touch()  # one after the other: the chain follows the order of joining
            wait_until(
                lambda: broker.log_path.read_text().count("weight subscriber joined") == number,  # noqa: B023
                timeout_s=30,
                what=f"{worker_id} joins",
            )
        metrics_url = broker.ready["metrics_url"]
        header, data = make_update(1, num_bytes=16 * CHUNK_BYTES)
        with WeightPublisher(endpoint, PROCESS_TOKEN, "trainer", CHUNK_BYTES) as publisher:
            publisher.publish(header, data, timeout_s=RECEIVE_S)
            # w1, second in the chain, is slow: kill it in the middle of its relay
            wait_until(lambda: any(e.get("chunk") == 2 for e in events(tmp_path / "w1")), timeout_s=10)
            workers["w1"].kill()
            killed_s = time.monotonic()
            alive = ("w0", "w2", "w3")
            got = wait_until(
                lambda: (
                    all(any(e.get("version") == 1 for e in events(tmp_path / w)) for w in alive)
                    and {w: next(e for e in events(tmp_path / w) if e.get("version") == 1) for w in alive}
                ),
                timeout_s=2.0 + 10.0,
                what="the live workers hold v1",
            )
            assert all(event["ok"] for event in got.values()), got
            healed_s = max(event["t"] for event in got.values()) - killed_s
            assert healed_s < 2.0 + 5.0, f"healing took {healed_s:.1f} s"
            assert not any("version" in e for e in events(tmp_path / "w1"))
            samples = scrape_metrics(metrics_url)
            assert samples[(f"{telemetry.BROKER_WEIGHT_RELAY_HEALS}_total", ())] >= 2
            pushed_v1 = samples[(f"{telemetry.BROKER_WEIGHT_BYTES_PUSHED}_total", ())]
            assert pushed_v1 <= 3 * len(data), "healing must not send the update once per worker"
            # the killed worker is forgotten once the broker finds its connection gone; the next update goes
            # through the healed chain, each byte sent once
            w1_id = events(tmp_path / "w1")[0]["worker_id"]  # registered: the broker relays only through those
            wait_until(
                lambda: any(
                    "weight subscriber forgotten" in line and f"worker_id={w1_id}" in line
                    for line in broker.log_path.read_text().splitlines()
                ),
                timeout_s=10,
                what="the broker forgets the killed worker",
            )
            header2, data2 = make_update(2, num_bytes=5 * CHUNK_BYTES)
            publisher.publish(header2, data2, timeout_s=RECEIVE_S)
            wait_until(
                lambda: all(any(e.get("version") == 2 and e["ok"] for e in events(tmp_path / w)) for w in alive),
                timeout_s=RECEIVE_S,
                what="the live workers hold v2",
            )
            samples = scrape_metrics(metrics_url)
            assert samples[(f"{telemetry.BROKER_WEIGHT_BYTES_PUSHED}_total", ())] - pushed_v1 == len(data2)
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.terminate()
            process.wait(10)
        broker.stop()


def test_a_relay_socket_admits_only_peers_with_the_run_token():
    """A worker's relay socket checks the run token at the handshake, as the broker's planes do: a peer with a
    wrong token is refused (400) and one without any fails on the mechanism; neither gets a byte in, while the
    worker before it in a chain (which presents the token) is heard."""
    import zmq
    from zmq.utils.monitor import parse_monitor_message

    from primerl.client.weight_transfer import ChunkRelay
    from primerl.runtime.wire_security import CREDENTIALS_REFUSED_STATUS, apply_run_token

    context = zmq.Context()
    relay = ChunkRelay(context, "127.0.0.1", "w-next", max_message_bytes=1 << 20, run_token="relay-secret")
    sockets = []

    def pusher(token: str | None) -> tuple[zmq.Socket, zmq.Socket]:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        if token is not None:
            apply_run_token(socket, token, "stranger")
        monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        socket.connect(relay.endpoint)
        sockets.extend([monitor, socket])
        return socket, monitor

    def outcome(monitor: zmq.Socket) -> tuple[int, int]:
        assert monitor.poll(10_000), "no handshake outcome"
        event = parse_monitor_message(monitor.recv_multipart())
        return event["event"], event["value"]

    try:
        wrong, wrong_monitor = pusher("not-the-token")
        assert outcome(wrong_monitor) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, CREDENTIALS_REFUSED_STATUS)
        tokenless, tokenless_monitor = pusher(None)
        assert outcome(tokenless_monitor)[0] in (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,  # the mechanism mismatch, or a close before libzmq saw it
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        )
        for socket in (wrong, tokenless):
            try:
                socket.send_multipart([b"chunk"] * 4, zmq.NOBLOCK)
            except zmq.Again:
                pass
        assert not relay.socket.poll(1000), "a peer without the run token got a message in"
        assert relay.num_refused == 1  # the tokenless peer never reaches the token check
        holder, holder_monitor = pusher("relay-secret")
        assert outcome(holder_monitor) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        holder.send_multipart([b"chunk"] * 4)
        assert relay.socket.poll(10_000) and relay.socket.recv_multipart() == [b"chunk"] * 4
    finally:
        for socket in sockets:
            socket.close(linger=0)
        relay.close()
        context.term()
