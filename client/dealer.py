"""``DealerClient``: one DEALER socket to one of the broker's ZeroMQ planes, what every data-plane client shares
(``RolloutProducer``, ``RolloutConsumer``, ``WeightPublisher``, ``WeightSubscriber``).

- Sizes: ``limits`` (``framing.Limits``, normally ``BrokerLimits.frames`` from the broker's ``RegisterResponse``)
  set the socket's ``MAXMSGSIZE`` and bound every reply ``framing.decode`` accepts.
- Auth: every message out carries the run token and the client's ``sender`` name; every reply must carry the run
  token too, except ERROR replies (a broker never sends its token to a peer that has not proved it knows it, and
  an error can only make a call fail).
- Bounded waits: ``_wait`` polls the socket (and the socket monitor, when the client watches ``MONITOR_EVENTS``)
  until a deadline; ``_send`` and ``_recv`` are built on it and return False / None at the deadline, so that each
  client raises its own typed error.
- Handshake: with ``curve`` (``runtime.wire_security.CurveClient``, from ``BrokerClientConfig.curve_client()``)
  the socket is a CURVE client; without it, a client with a run token presents it at the handshake (PLAIN), as a
  broker plane with a token requires. Every client watches its handshakes: the broker refusing its credentials
  (a wrong token, an unknown CURVE key) or a mismatch of mechanisms (a token or CURVE on one side only) raises at
  once, with what to fix (``_refused_at_handshake`` gives each client its own error type). libzmq reports a
  mismatch only when it parsed the broker's greeting before the broker closed the connection; on a loaded machine
  a client without credentials facing a broker that wants them can instead see every try end in a handshake
  closed without a reason (``HANDSHAKE_FAILED_NO_DETAIL``, a broken pipe or a reset). A broker closes a healthy
  client's handshake that way only when it dies in the middle of it, so ``CLOSED_HANDSHAKES_TO_REFUSE`` such
  closes before any handshake of the client succeeded count as the mismatch (for a CURVE client, or a wrong
  broker key: the broker cannot open its HELLO and closes the same way). Once connected, a client rides through
  closes as through any outage (a proxy in front of a restarting broker closes connections that way). A
  handshake that never completes still only shows as no answer: ``timeout_hint`` goes into every timeout error.
- Re-connecting: ``_reopen`` replaces the socket (``generation`` counts replacements: what was sent on an older
  socket never arrived). A client that watches monitor events reacts to them in ``_on_monitor_events``.

Sockets are not thread-safe: each client must be used from one thread.
"""

from __future__ import annotations

import errno
import hmac
import random
import time
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import (
    CREDENTIALS_REFUSED_STATUS,
    CurveClient,
    apply_run_token,
    timeout_hint,
)
from primerl.runtime.zmq_sockets import configure_socket

log = get_logger("primerl.client.dealer")

RECONNECT_INTERVAL_MS = 100
RECONNECT_INTERVAL_MAX_MS = 5000
REOPEN_PAUSE_S = 1.0
"""Most a client waits before connecting again after the broker refused it at the handshake."""
CLOSED_HANDSHAKES_TO_REFUSE = 3
"""Handshakes the broker closed without a reason, none succeeding first, that a client takes for a mismatch."""
_CLOSED_BY_PEER = (errno.EPIPE, errno.ECONNRESET)


class DealerClient:
    """One DEALER socket to ``endpoint``; see the module docstring. ``context``: None gives the client its own
    (terminated at ``close``)."""

    MONITOR_EVENTS = 0
    """Socket-monitor events the client reacts to (``_on_monitor_events``) besides the handshake failures that
    every client watches (``HANDSHAKE_EVENTS``)."""

    HANDSHAKE_EVENTS = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    plane = "data"
    """Which of the broker's planes the client talks to, in errors ("rollout", "weight")."""

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        sender: str,
        *,
        limits: framing.Limits,
        context: zmq.Context | None = None,
        curve: CurveClient | None = None,
    ):
        self.endpoint = endpoint
        self.curve = curve
        self.auth_token = auth_token or None
        self.sender = sender
        self.limits = limits
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self.generation = 0
        self.num_closed_handshakes = 0  # closed by the broker without a reason before any handshake succeeded
        self.handshake_succeeded = False  # some handshake of this client succeeded (on any of its sockets)
        self.num_handshake_refusals = 0  # refused at the handshake for want of room (`_reopen_after_refusal`)
        self._open()

    # ------------------------------------------------------------------------------------------ socket
    def _open(self) -> None:
        socket = configure_socket(self._context.socket(zmq.DEALER), max_message_bytes=self.limits.max_message_bytes)
        if self.curve is not None:
            self.curve.apply(socket)
        elif self.auth_token:
            apply_run_token(socket, self.auth_token, self.sender)
        socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_INTERVAL_MAX_MS)
        # The monitor starts before ``connect`` so that no connection event is missed.
        self._monitor = socket.get_monitor_socket(self.MONITOR_EVENTS | self.HANDSHAKE_EVENTS)
        socket.connect(self.endpoint)
        self._socket = socket

    def _close_socket(self) -> None:
        if self._socket is not None:
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = self._monitor = None

    def _reopen(self) -> None:
        """A new socket in place of the current one (whatever the old one still queued is dropped)."""
        self._close_socket()
        self._open()
        self.generation += 1

    def _reopen_after_refusal(self, deadline_s: float) -> None:
        """The broker refused this connection at the handshake: it has as many peers on this plane as it admits
        (broker.connection_gate) and libzmq does not try again. Wait a moment (within ``deadline_s``) and connect
        again on a new socket (what was sent on the old one is lost)."""
        self.num_handshake_refusals += 1
        if self.num_handshake_refusals == 1 or self.num_handshake_refusals % 20 == 0:
            log.warning(
                f"the broker refused this {self.plane} connection at the handshake: it has as many peers as "
                f"broker.max_{self.plane}_connections admits; retrying",
                endpoint=self.endpoint,
                refusals=self.num_handshake_refusals,
            )
        time.sleep(max(0.0, min(deadline_s - time.monotonic(), random.uniform(REOPEN_PAUSE_S / 2, REOPEN_PAUSE_S))))
        self._reopen()

    @property
    def timeout_hint(self) -> str:
        """What to check besides the broker being up when no answer comes (CURVE credentials)."""
        return timeout_hint(self.curve)

    @property
    def is_closed(self) -> bool:
        return self._socket is None

    def close(self) -> None:
        if self._socket is not None:
            self._close_socket()
            if self._own_context:
                self._context.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------- waiting
    def _read_monitor_events(self) -> list[int]:
        """The monitor events since the last read that the client watches (``MONITOR_EVENTS``); raises
        ``_refused_at_handshake`` when the broker refused this client's credentials or mechanism."""
        events = []
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            message = recv_monitor_message(self._monitor)
            event, value = message["event"], message["value"]
            refusal = self._handshake_refusal(event, value)
            if refusal is not None:
                raise self._refused_at_handshake(
                    common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_UNAUTHENTICATED, message=refusal)
                )
            if event & self.MONITOR_EVENTS:
                events.append(event)
        return events

    def _handshake_refusal(self, event: int, value: int) -> str | None:
        """What a handshake outcome says about this client's credentials (None: nothing, e.g. a full socket)."""
        where = f"the broker's {self.plane} plane at {self.endpoint}"
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshake_succeeded = True
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in _CLOSED_BY_PEER and not self.handshake_succeeded:
            self.num_closed_handshakes += 1
            if self.num_closed_handshakes < CLOSED_HANDSHAKES_TO_REFUSE:
                return None
            return (
                f"{where} closed this client's connection during the handshake {self.num_closed_handshakes} times "
                "without a reason and let none through, as a broker does when the two do not speak the same "
                f"handshake: "
                f"{self._mismatch_fix(closed=True)} (or the endpoint is not a primerl broker)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == CREDENTIALS_REFUSED_STATUS:
            if self.curve is not None:
                return (
                    f"{where} refused this client's CURVE key at the handshake: add its public key to "
                    "broker.curve_authorized_keys_dir"
                )
            return (
                f"{where} refused this client's run token at the handshake: give it the broker's run token "
                "([broker] run_token in its config, or PRIMERL_RUN_TOKEN)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return f"{where} and this client do not speak the same handshake: {self._mismatch_fix()}"
        return None

    def _mismatch_fix(self, closed: bool = False) -> str:
        """What to change when this client's handshake is not the broker's (``closed``: the broker closed it
        without a reason, which for a CURVE client is also what a wrong broker key looks like)."""
        if self.curve is not None:
            wrong_key = (
                "this client's curve_broker_key_path is not the broker's public key (copy the broker's), or "
                if closed
                else ""
            )
            return (
                f"{wrong_key}this client uses CURVE and the broker does not encrypt its planes: unset its "
                "curve_secret_key_path and curve_broker_key_path, or set broker.curve_secret_key_path"
            )
        if self.auth_token:
            return (
                "this client presents a run token and the broker wants none (it has no run_token) or encrypts "
                "its planes with CURVE: give both the same run token, or this client CURVE keys"
            )
        return (
            "the broker wants a run token or a CURVE key and this client has neither: set its [broker] "
            "run_token (or PRIMERL_RUN_TOKEN), or its CURVE keys"
        )

    def _refused_at_handshake(self, detail: common_pb2.ErrorDetail) -> Exception:
        """The error a client raises when the broker refuses its credentials at the handshake (a subclass gives its
        own type, the one it raises when the broker answers UNAUTHENTICATED)."""
        return PermissionError(detail.message)

    def _on_monitor_events(self, events: Sequence[int], deadline_s: float) -> bool:
        """React to socket-monitor events (may raise); True ends the current wait (e.g. the socket was replaced)."""
        return False

    def _wait(self, deadline_s: float, flags: int = zmq.POLLIN) -> bool:
        """Wait until the socket is ready for ``flags`` (True), or the deadline passes or a monitor event ends the
        wait (False)."""
        assert self._socket is not None, "the client is closed"
        return self._wait_any([self._socket], deadline_s, flags) is not None

    def _wait_any(self, sockets: Sequence[zmq.Socket], deadline_s: float, flags: int = zmq.POLLIN) -> zmq.Socket | None:
        """The first of ``sockets`` ready for ``flags``; None when the deadline passes or a monitor event ends the
        wait first."""
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, flags)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(max(0, int((deadline_s - time.monotonic()) * 1000))))
            if (
                self._monitor is not None
                and self._monitor in ready
                and self._on_monitor_events(self._read_monitor_events(), deadline_s)
            ):
                return None
            source = next((socket for socket in sockets if socket in ready), None)
            if source is not None:
                return source
            if time.monotonic() >= deadline_s:
                return None

    # ---------------------------------------------------------------------------------- sending, receiving
    def _encode(self, message_type: int, header: Any, payload: Sequence[Any] = (), **envelope: Any) -> list[Any]:
        """One message from this client (its run token and sender name)."""
        return framing.encode(
            message_type, header, list(payload), auth_token=self.auth_token or "", sender=self.sender, **envelope
        )

    def _send(self, frames: list[Any], deadline_s: float) -> bool:
        """Send one message (zero-copy) as soon as the socket takes it; False when it did not by the deadline."""
        while True:
            assert self._socket is not None, "the client is closed"
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if not self._wait(deadline_s, zmq.POLLOUT) and time.monotonic() >= deadline_s:
                    return False

    def _decode(self, frames: list[Any]) -> framing.Message | None:
        """A reply checked against the limits and the run token; None (logged) for anything else."""
        try:
            message = framing.decode(frames, limits=self.limits)
        except framing.FramingError as exc:
            log.warning("ignored an unreadable message from the broker", endpoint=self.endpoint, error=str(exc))
            return None
        if (
            self.auth_token
            and message.type != data_pb2.ERROR
            and not hmac.compare_digest(message.envelope.auth_token.encode(), self.auth_token.encode())
        ):
            log.warning(
                "ignored a message from the broker without the run token: is the broker's run token the same?",
                endpoint=self.endpoint,
                type=message.type_name,
            )
            return None
        return message

    def _recv(self, deadline_s: float) -> framing.Message | None:
        """The next valid reply by the deadline, or None (also when a monitor event ended the wait)."""
        while self._wait(deadline_s):
            assert self._socket is not None
            message = self._decode(self._socket.recv_multipart(copy=False))
            if message is not None:
                return message
        return None

    def _drain(self) -> None:
        """Drop every reply already received (answers to an abandoned call)."""
        assert self._socket is not None, "the client is closed"
        while self._socket.poll(0, zmq.POLLIN):
            self._socket.recv_multipart(copy=False)
