"""At most ``max_connections`` peers on one ROUTER socket, decided at the ZeroMQ handshake.

Why: libzmq buffers up to ``RCVHWM`` whole messages per connection (plus one being decoded) before the
application reads any of them, so what a ROUTER socket can hold grows with the number of peers, and the
application cannot refuse or throttle one peer. The only point where a peer can be turned away before it
sends a byte of payload is the handshake: with a ZAP domain set on the socket, libzmq asks the ZAP handler
(an inproc socket at ``inproc://zeromq.zap.01`` in the same context) about every new connection and closes
it unless the answer is "200". The gate is that handler. It first checks the peer's credentials with
``authorize`` (the run token or the CURVE key: ``runtime.wire_security``) and refuses a wrong one with status
400 (``CREDENTIALS_REFUSED_STATUS``); then it admits the connection while fewer than ``max_connections`` admitted
peers are connected and refuses it with status 500 (``GATE_FULL_STATUS``) otherwise. A refused peer is told
which (its monitor sees ``EVENT_HANDSHAKE_FAILED_AUTH`` with the status as its value) and libzmq does not
reconnect it: the clients (``primerl.client.dealer``) stop with a clear error after a 400 and open a new socket
after a short wait after a 500.

Counting: a ZAP request names neither the peer's port nor its file descriptor, so the gate counts from the
socket's monitor events. Every accepted connection ends its handshake with exactly one outcome event
(``HANDSHAKE_SUCCEEDED`` or a ``HANDSHAKE_FAILED_*``) and later closes with ``DISCONNECTED``, which names a
file descriptor but not whether its handshake had succeeded (a burst of refusals comes as all the failures,
then all their disconnects). So a disconnect is put down to a failed connection while any failure has not been
matched with one yet, and to an admitted peer otherwise: admitted = successes - max(0, disconnects - failures).
That errs on the side of counting a peer that already left (a refusal too many, retried by the client), never
of admitting one too many. Monitor events are drained before every decision, so a peer that left frees its
place for the next request.

One gate per context (libzmq has one ZAP endpoint per context). Sockets are not thread-safe: create the gate
and call ``handle`` in the thread that owns the gated socket, and bind the gate before the socket binds.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from primerl.broker.log_limits import RateLimitedLog
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import (
    CREDENTIALS_REFUSED_STATUS,
    GATE_FULL_STATUS,
    ZAP_ENDPOINT,
    zap_reply,
    zap_request,
)

log = get_logger("primerl.broker.connection_gate")
_REFUSED_STATUSES = (CREDENTIALS_REFUSED_STATUS, GATE_FULL_STATUS)
UNLIMITED_CONNECTIONS = 1 << 30
"""``max_connections`` of a gate that only checks credentials."""
_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED_EVENTS | zmq.EVENT_DISCONNECTED


class ConnectionGate:
    """ZAP handler that admits at most ``max_connections`` peers to the socket bound with ``domain``."""

    def __init__(
        self,
        context: zmq.Context,
        *,
        max_connections: int,
        domain: str,
        what: str = "connection",
        authorize: Callable[[bytes, list[bytes]], str | None] | None = None,
        refusal_hint: str = "",
    ):
        """``authorize(mechanism, credentials)``: a check of each peer's credentials first (the run token or CURVE
        keys: ``runtime.wire_security``); a string it returns refuses the peer (status 400) and is logged with
        ``refusal_hint`` (what to do about it)."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.domain = domain.encode()
        self.what = what
        self.authorize = authorize
        self.refusal_hint = refusal_hint
        self.num_refused = 0
        self.num_refused_credentials = 0
        self._admitted = 0
        self._approved_unconfirmed = 0  # approved, HANDSHAKE_SUCCEEDED not seen yet
        self._failed_open = 0  # failed handshakes not yet matched with a disconnect
        self._monitor: zmq.Socket | None = None
        self._refusal_log = RateLimitedLog(log)
        self._zap = context.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)

    @property
    def num_connected(self) -> int:
        """Peers admitted and still connected (as far as the monitor events read so far say)."""
        return self._admitted

    def watch(self, socket: zmq.Socket) -> None:
        """Start counting ``socket``'s connections; call right after it binds, before serving."""
        self._monitor = socket.get_monitor_socket(_EVENTS)

    def sockets(self) -> list[zmq.Socket]:
        """The sockets to poll for POLLIN; pass each readable one to ``handle``."""
        return [self._zap] + ([self._monitor] if self._monitor is not None else [])

    def handle(self, socket: zmq.Socket) -> None:
        if socket is self._zap:
            self._drain_monitor()
            while self._zap.poll(0):
                self._answer(self._zap.recv_multipart())
        else:
            self._drain_monitor()

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        self._zap.close(linger=0)

    def _drain_monitor(self) -> None:
        while self._monitor is not None and self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            self._count(event["event"], event["value"])

    def _count(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._admitted += 1
            self._approved_unconfirmed = max(0, self._approved_unconfirmed - 1)
        elif event & _FAILED_EVENTS:
            if not (event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value in _REFUSED_STATUSES):
                # An approved connection may still fail later in its handshake.
                self._approved_unconfirmed = max(0, self._approved_unconfirmed - 1)
            self._failed_open += 1
        elif event == zmq.EVENT_DISCONNECTED:
            if self._failed_open:
                self._failed_open -= 1
            else:
                self._admitted = max(0, self._admitted - 1)

    def _answer(self, frames: list[bytes]) -> None:
        request = zap_request(frames)
        if request is None:
            return
        _, domain, address, mechanism, credentials = request
        refusal = self.authorize(mechanism, credentials) if self.authorize is not None else None
        if refusal is not None:
            self.num_refused += 1
            self.num_refused_credentials += 1
            self._refusal_log.warning(
                ("credentials", self.what),
                f"{self.what} refused at the handshake: {refusal}",
                peer=address.decode(errors="replace"),
                **({"hint": self.refusal_hint} if self.refusal_hint else {}),
            )
            zap_reply(self._zap, frames, CREDENTIALS_REFUSED_STATUS, refusal)
            return
        admitted = domain == self.domain and self._admitted + self._approved_unconfirmed < self.max_connections
        if admitted:
            self._approved_unconfirmed += 1
            status, text = 200, "OK"
        else:
            self.num_refused += 1
            status, text = GATE_FULL_STATUS, "too many connections"
            self._refusal_log.warning(
                ("refused", self.what),
                f"{self.what} refused at the handshake: the broker has as many peers as it admits",
                peer=address.decode(errors="replace"),
                connected=self._admitted,
                max_connections=self.max_connections,
                hint="raise the limit if these peers are legitimate, or stop idle clients",
            )
        zap_reply(self._zap, frames, status, text)
