"""ZeroMQ socket factories with the settings every primerl socket shares.

- ``MAXMSGSIZE`` on every socket: libzmq drops the connection of a peer that sends a frame larger than the
  limit before buffering it, so an oversized message cannot exhaust memory;
- ``LINGER`` bounded, so closing never hangs on an unreachable peer;
- high-water marks bounded, so a slow peer makes senders wait (or fail to send) instead of growing queues;
- TCP keep-alive, so a peer that vanished without closing is noticed;
- CURVE encryption and authentication when keys are given, or the run token checked at the handshake (PLAIN)
  (``runtime.wire_security``).

Sockets are not thread-safe: create and use each one in the single thread that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from primerl.runtime.wire_security import CurveClient, CurveServer, RunTokenServer

DEFAULT_LINGER_MS = 1000
DEFAULT_HWM = 64


def configure_socket(
    socket: zmq.Socket, *, max_message_bytes: int, hwm: int = DEFAULT_HWM, linger_ms: int = DEFAULT_LINGER_MS
) -> zmq.Socket:
    # MAXMSGSIZE applies per frame of a multipart message in libzmq; chunking keeps frames under it.
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    return socket


def bind_router(
    context: zmq.Context,
    host: str,
    port: int,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    rcv_hwm: int | None = None,
    zap_domain: str | None = None,
    security: CurveServer | RunTokenServer | None = None,
) -> tuple[zmq.Socket, int]:
    """A ROUTER socket bound to ``tcp://host:port`` (port 0 picks a free one); returns (socket, port).

    ``hwm`` is the high-water mark of both directions, ``rcv_hwm`` (if given) of the inbound one. Both must be
    set before ``bind``: libzmq's listener copies the socket's options when it binds, and every connection it
    accepts gets that copy, so an option set afterwards never reaches an accepted peer's pipe (measured: with
    RCVHWM 2 set after bind, a peer still got 21 messages of 4 MiB buffered; set before, 7).
    ``ROUTER_MANDATORY`` makes a send to a peer that is gone raise instead of vanishing silently.
    ``zap_domain``: every new connection is first put to the ZAP handler of ``context`` (see
    ``broker.connection_gate``); like the high-water marks it only applies if set before ``bind``.
    ``security``: the socket is a CURVE server with these keys, or a PLAIN server that wants the run token
    (``runtime.wire_security``); also set before ``bind``, and a ZAP handler must exist in ``context`` by then, or
    libzmq admits any client.
    """
    socket = configure_socket(context.socket(zmq.ROUTER), max_message_bytes=max_message_bytes, hwm=hwm)
    if rcv_hwm is not None:
        socket.setsockopt(zmq.RCVHWM, rcv_hwm)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if zap_domain:
        socket.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())
    if security is not None:
        security.apply(socket)
    try:
        if port == 0:
            port = socket.bind_to_random_port(f"tcp://{_bind_host(host)}")
        else:
            socket.bind(f"tcp://{_bind_host(host)}:{port}")
    except zmq.ZMQError:
        socket.close(linger=0)
        raise
    return socket, port


def connect_dealer(
    context: zmq.Context,
    endpoint: str,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    identity: bytes | None = None,
    curve: CurveClient | None = None,
    run_token: str | None = None,
    sender: str = "",
) -> zmq.Socket:
    """A DEALER socket connected to ``endpoint`` (``tcp://host:port``); reconnects on its own. ``curve``: a CURVE
    client with these keys; else ``run_token``: presented at the handshake as ``sender`` (PLAIN), as a broker plane
    with a run token requires (``runtime.wire_security``)."""
    from primerl.runtime.wire_security import apply_run_token

    socket = configure_socket(context.socket(zmq.DEALER), max_message_bytes=max_message_bytes, hwm=hwm)
    if curve is not None:
        curve.apply(socket)
    elif run_token:
        apply_run_token(socket, run_token, sender)
    if identity:
        socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.RECONNECT_IVL, 100)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    socket.connect(endpoint)
    return socket


def _bind_host(host: str) -> str:
    return "*" if host in ("0.0.0.0", "::", "[::]") else host


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"
