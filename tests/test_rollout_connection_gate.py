"""The rollout socket admits at most ``max_connections`` peers, at the ZeroMQ handshake (broker.connection_gate),
over real ZeroMQ on loopback: refused peers never get a message in, clients retry and get in once a place
frees up, and the count of admitted peers stays right through bursts and churn. A peer without the run token is
refused at the handshake before anything else, takes no place, and a client told so stops with what to fix."""

from __future__ import annotations

import errno
import socket as socket_module
import struct
import threading
import time

import numpy as np
import pytest
import zmq
from support.probes import wait_until
from zmq.utils.monitor import parse_monitor_message

from primerl.broker.rollout_plane import RolloutPlane
from primerl.broker.rollout_queue import RolloutQueue
from primerl.broker.spool import RolloutSpool
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, RolloutRefused, RolloutTimeout, pack_batch
from primerl.proto import framing
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.wire_security import CREDENTIALS_REFUSED_STATUS, GATE_FULL_STATUS, apply_run_token

TOKEN = "gate-secret"


@pytest.fixture
def gated(tmp_path):
    """A plane that admits ``max_connections`` peers (set by the test through ``make``), its own client context."""
    server_context, client_context = zmq.Context(), zmq.Context()
    made: list = []

    def make(max_connections: int) -> RolloutPlane:
        queue = RolloutQueue(RolloutSpool(tmp_path / "spool"), 64, 1 << 30)
        plane = RolloutPlane(
            queue,
            server_context,
            "127.0.0.1",
            0,
            framing.Limits(max_message_bytes=8 * MiB, max_frame_bytes=4 * MiB),
            TOKEN,
            max_connections=max_connections,
        )
        plane.start()
        made.append(plane)
        return plane

    make.client_context = client_context
    make.closables = []
    yield make
    for closable in make.closables:
        closable.close()
    for plane in made:
        assert plane.stop(5.0)
        plane.queue.close()
    client_context.term()
    server_context.term()


def batch(step: int, index: int):
    return pack_batch(step, 0, index, 100, {"input_ids": np.arange(32, dtype=np.int64) + index})


def producer(gated, plane: RolloutPlane, name: str) -> RolloutProducer:
    client = RolloutProducer(f"tcp://127.0.0.1:{plane.port}", TOKEN, name, context=gated.client_context)
    gated.closables.append(client)
    return client


def raw_dealers(
    gated, plane: RolloutPlane, count: int, token: str | None = TOKEN
) -> list[tuple[zmq.Socket, zmq.Socket]]:
    """``count`` plain DEALER sockets connecting at once, each presenting ``token`` at the handshake (None: no
    token, the NULL mechanism) and with a monitor of its handshake outcome."""
    pairs = []
    for index in range(count):
        socket = gated.client_context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        if token is not None:
            apply_run_token(socket, token, f"raw-{index}")
        monitor = socket.get_monitor_socket(_HANDSHAKE_OUTCOMES | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        socket.connect(f"tcp://127.0.0.1:{plane.port}")
        pairs.append((socket, monitor))
        gated.closables.extend([monitor, socket])
    return pairs


_HANDSHAKE_OUTCOMES = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
CLOSED_IN_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, -1)
"""What ``outcomes`` gives a connection the broker closed during its handshake without a reason."""


def outcomes(pairs, timeout_s: float = 10.0, closed_is_an_outcome: bool = False) -> list[tuple[int, int]]:
    """The handshake outcome (event, value) of each raw dealer. A handshake the broker closed without a reason
    (libzmq retries it) is skipped, or gives ``CLOSED_IN_HANDSHAKE`` with ``closed_is_an_outcome``."""
    results = []
    for _, monitor in pairs:
        deadline_s = time.monotonic() + timeout_s
        while True:
            wait_ms = int(max(0.0, deadline_s - time.monotonic()) * 1000)
            assert monitor.poll(wait_ms), "a connection got no handshake outcome"
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] & _HANDSHAKE_OUTCOMES:
                results.append((event["event"], event["value"]))
                break
            if closed_is_an_outcome:
                results.append(CLOSED_IN_HANDSHAKE)
                break
    return results


def wait_for(predicate) -> None:
    wait_until(predicate, timeout_s=10.0)


def test_a_burst_of_connections_admits_exactly_the_limit(gated):
    plane = gated(3)
    results = outcomes(raw_dealers(gated, plane, 8))
    assert sorted(event for event, _ in results).count(zmq.EVENT_HANDSHAKE_SUCCEEDED) == 3
    refused = [value for event, value in results if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH]
    assert refused == [GATE_FULL_STATUS] * 5
    wait_for(lambda: plane._gate.num_connected == 3 and plane._gate.num_refused == 5)


def test_a_refused_peer_gets_nothing_in_and_the_admitted_ones_are_served(gated):
    plane = gated(1)
    first = producer(gated, plane, "first")
    assert first.send_batch(*batch(1, 0), timeout_s=10).durable
    ((socket, monitor),) = raw_dealers(gated, plane, 1)
    assert outcomes([(socket, monitor)]) == [(zmq.EVENT_HANDSHAKE_FAILED_AUTH, GATE_FULL_STATUS)]
    header, payload = batch(1, 1)
    # Either the DEALER still queues it locally, or its pipe is gone already (EAGAIN): libzmq never connects it again.
    try:
        socket.send_multipart(framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN), zmq.NOBLOCK)
    except zmq.Again:
        pass
    assert not socket.poll(1000), "a refused peer got an answer"
    assert first.send_batch(*batch(1, 2), timeout_s=10).durable
    assert plane.queue.status().num_batches == 2
    assert plane._gate.num_connected == 1


def test_a_client_refused_at_the_handshake_says_why_and_gets_in_once_a_place_frees(gated):
    plane = gated(1)
    first = producer(gated, plane, "first")
    assert first.send_batch(*batch(1, 0), timeout_s=10).durable
    second = producer(gated, plane, "second")
    with pytest.raises(RolloutTimeout, match="max_rollout_connections"):
        second.send_batch(*batch(1, 1), timeout_s=2.5)
    assert second.num_handshake_refusals >= 1
    first.close()
    assert second.send_batch(*batch(1, 1), timeout_s=15).durable
    consumer = RolloutConsumer(f"tcp://127.0.0.1:{plane.port}", TOKEN, "trainer-0", 0, context=gated.client_context)
    gated.closables.append(consumer)
    second.close()  # a trainer rank counts as a peer too: it takes the freed place
    consumer.hello(timeout_s=15)
    wait_for(lambda: plane._gate.num_connected == 1)


def test_the_count_follows_peers_that_leave(gated):
    plane = gated(2)
    for round_number in range(6):
        pairs = raw_dealers(gated, plane, 3)
        results = outcomes(pairs)
        assert [event for event, _ in results].count(zmq.EVENT_HANDSHAKE_SUCCEEDED) == 2, round_number
        for socket, monitor in pairs:
            gated.closables.remove(socket)
            gated.closables.remove(monitor)
            monitor.close(linger=0)
            socket.close(linger=0)
        wait_for(lambda: plane._gate.num_connected == 0 and not plane._gate._approved_unconfirmed)


def test_peers_without_the_run_token_are_refused_first_and_take_no_place(gated):
    """A wrong token is refused (400) and no token at all fails on the mechanism, even on a full socket; neither
    counts against the limit, nothing they send gets in, and peers with the token still fill the places."""
    plane = gated(2)
    wrong = raw_dealers(gated, plane, 3, token="not-the-token")
    assert outcomes(wrong) == [(zmq.EVENT_HANDSHAKE_FAILED_AUTH, CREDENTIALS_REFUSED_STATUS)] * 3
    tokenless = raw_dealers(gated, plane, 2, token=None)
    # libzmq reports the mismatch only when it parsed the broker's greeting before the broker closed the
    # connection; on a loaded machine every try of a peer can end in a close without a reason instead.
    mismatch = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    assert set(outcomes(tokenless, closed_is_an_outcome=True)) <= {mismatch, CLOSED_IN_HANDSHAKE}
    for socket, _ in wrong + tokenless:
        try:
            header, payload = batch(1, 0)
            socket.send_multipart(
                framing.encode(data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN), zmq.NOBLOCK
            )
        except zmq.Again:
            pass
    admitted = outcomes(raw_dealers(gated, plane, 3))
    assert [event for event, _ in admitted].count(zmq.EVENT_HANDSHAKE_SUCCEEDED) == 2
    assert plane._gate.num_refused_credentials == 3  # the tokenless ones never reach the gate
    wait_for(lambda: plane._gate.num_connected == 2)
    assert plane.queue.status().num_batches == 0


@pytest.mark.parametrize("token", ["not-the-token", None])
def test_a_client_without_the_run_token_stops_at_once_and_says_what_to_fix(gated, token):
    """Producer and consumer raise ``RolloutRefused`` (UNAUTHENTICATED) within the first wait, long before their
    timeout, naming the setting to fix; they do not retry as they do for a full socket."""
    plane = gated(4)
    endpoint = f"tcp://127.0.0.1:{plane.port}"
    client = RolloutProducer(endpoint, token, "stranger", context=gated.client_context)
    gated.closables.append(client)
    with pytest.raises(RolloutRefused, match="run_token") as info:
        client.send_batch(*batch(1, 0), timeout_s=30)
    assert info.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    assert ("refused this client's run token" if token else "do not speak the same handshake") in str(info.value)
    consumer = RolloutConsumer(endpoint, token, "trainer-0", 0, context=gated.client_context)
    gated.closables.append(consumer)
    with pytest.raises(RolloutRefused, match="run_token"):
        consumer.hello(timeout_s=30)
    assert plane.queue.status().num_batches == 0


@pytest.fixture
def resetting_listener():
    """A TCP port that resets every connection right after reading the start of the peer's greeting, as a broker
    does when it closes a handshake it cannot speak before the client parsed its greeting."""
    listener = socket_module.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.recv(10)
            connection.setsockopt(socket_module.SOL_SOCKET, socket_module.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    thread.join(5.0)


def test_a_client_whose_handshakes_are_closed_without_a_reason_stops_and_says_what_to_fix(resetting_listener):
    started_s = time.monotonic()
    with RolloutProducer(resetting_listener, None, "stranger") as client:
        with pytest.raises(RolloutRefused, match="3 times") as info:
            client.send_batch(*batch(1, 0), timeout_s=30)
    assert time.monotonic() - started_s < 15
    assert info.value.code == common_pb2.ERROR_CODE_UNAUTHENTICATED
    assert "set its [broker] run_token" in str(info.value)


def test_closed_handshakes_count_only_before_the_first_handshake_succeeds():
    """Closes before any handshake succeeded count (a failure with another cause, a timeout, does not); once a
    handshake succeeded, closes are an outage (a proxy in front of a restarting broker) and never a refusal."""
    closed = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.EPIPE)
    reset = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.ECONNRESET)
    timed_out = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.ETIMEDOUT)
    with RolloutProducer("tcp://127.0.0.1:9", "a-token", "first-contact") as client:
        for event in [closed, timed_out, reset, timed_out]:
            assert client._handshake_refusal(*event) is None
        refusal = client._handshake_refusal(*closed)
    assert refusal is not None and "3 times" in refusal and "presents a run token" in refusal
    with RolloutProducer("tcp://127.0.0.1:9", "a-token", "was-connected") as client:
        assert client._handshake_refusal(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None
        assert all(client._handshake_refusal(*closed) is None for _ in range(10))
