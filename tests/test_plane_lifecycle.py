"""The lifecycle both broker data planes share (broker/plane_lifecycle.RouterPlane): bind in the IO thread,
report the port or the bind error to ``start``, retry a bind only on a port a plane of this process closed,
survive a message that breaks the handler, stop within a bound."""

from __future__ import annotations

import time

import pytest
import zmq

from primerl.broker import plane_lifecycle
from primerl.broker.plane_lifecycle import RouterPlane


class EchoPlane(RouterPlane):
    """Sends every message back; a message b"boom" makes the handler fail (the guard answers b"unexpected")."""

    name = "echo plane"
    thread_name = "echo-plane-io"

    def _bind(self) -> zmq.Socket:
        return self._bind_router(max_message_bytes=1 << 16, hwm=16)

    def _serve(self, socket: zmq.Socket) -> None:
        self._socket = socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while not self._stop_event.is_set():
            if poller.poll(20):
                self._handle_guarded(socket.recv_multipart())

    def _handle(self, frames: list[bytes]) -> None:
        if frames[1] == b"boom":
            raise RuntimeError("a bug a peer's bytes found")
        self._socket.send_multipart(frames)

    def _unexpected(self, frames: list[bytes], exc: Exception) -> None:
        self._socket.send_multipart([frames[0], b"unexpected"])


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_start_serve_guard_stop(context):
    plane = EchoPlane(context, "127.0.0.1", 0)
    port = plane.start()
    assert port == plane.port > 0 and plane.running
    with pytest.raises(RuntimeError, match="already called"):
        plane.start()
    peer = context.socket(zmq.DEALER)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        for sent, expected in ((b"hello", b"hello"), (b"boom", b"unexpected"), (b"again", b"again")):
            peer.send(sent)
            assert peer.poll(5000) and peer.recv() == expected
    finally:
        peer.close(linger=0)
    assert plane.running  # the failing message did not end the IO thread
    assert plane.stop(5.0) and not plane.running


def test_a_port_held_elsewhere_fails_at_once_and_one_this_process_closed_is_bound_again(context):
    holder = context.socket(zmq.ROUTER)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    plane_lifecycle._closed_ports.discard(port)  # the OS may hand out a port an earlier test's plane closed
    try:
        started_s = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"echo plane cannot bind 127.0.0.1:{port}"):
            EchoPlane(context, "127.0.0.1", port).start()
        assert time.monotonic() - started_s < 1.0  # no retry: nothing of this process's planes held it
    finally:
        holder.close(linger=0)
    first = EchoPlane(context, "127.0.0.1", 0)
    port = first.start()
    assert first.stop(5.0)
    again = EchoPlane(context, "127.0.0.1", port)  # libzmq may still hold it for a moment: retried
    assert again.start() == port
    assert again.stop(5.0)


def test_a_plane_never_started_stops_at_once(context):
    assert EchoPlane(context, "127.0.0.1", 0).stop(0.1)
