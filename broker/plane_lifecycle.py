"""The lifecycle of a broker data plane: one ZeroMQ ROUTER socket, bound and served by one IO thread.

``RouterPlane`` is the part the rollout plane and the weight plane share: ``start()`` runs the IO thread, which
binds the socket (retrying briefly while a port this process just closed is still held) and reports the bound
port or the bind error back to ``start()``; ``stop()`` ends the thread within a bound; ``running`` says whether
it still runs; ``_handle_guarded`` keeps one bad message from ending the thread. A plane supplies ``_bind``
(the socket, with whatever it needs around it: ``_bind_gated`` binds it behind the plane's connection gate) and
``_serve`` (its loop, which returns once ``_stop_event`` is set; ``_gate_poller`` registers the gate's sockets
beside the plane's, ``_serve_gate`` answers them), and ``_handle``/``_unexpected`` for the guard.

Connection gate: with ``max_connections`` (peers admitted at the ZeroMQ handshake) or a handshake check, the
socket is bound behind a ``ConnectionGate``, the ZAP handler of the plane's ``gate_domain``.

Handshake credentials: with ``auth_token`` set and CURVE off, the socket is a PLAIN server and admits only
clients that present the run token (``runtime.wire_security.RunTokenServer``); the plane's connection gate, its
ZAP handler, asks ``handshake_check``. A plane with a token must therefore have a gate.

Encryption: with ``curve`` (``runtime.wire_security.CurveServer``, given at construction) the socket is a CURVE
server and admits only the client keys ``curve`` authorizes (the run token is then checked in every message
only). libzmq asks the ZAP handler of the socket's context
(one per context) about every connection, and without a handler it admits any key: a plane that brings its own
handler (a plane's connection gate, which asks ``curve_authorize``) says so with ``zap_domain``; for
any other, ``_bind_router`` starts a ZAP authenticator thread on the context before binding. So each plane needs
a context of its own when CURVE is on.

Only the IO thread touches the socket.
"""

from __future__ import annotations

import abc
import contextvars
import functools
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from primerl.broker.connection_gate import UNLIMITED_CONNECTIONS, ConnectionGate
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import RunTokenServer
from primerl.runtime.zmq_sockets import bind_router

if TYPE_CHECKING:
    from primerl.runtime.wire_security import CurveServer

log = get_logger("primerl.broker.plane_lifecycle")

BIND_RETRY_S = 2.0
BIND_RETRY_SLEEP_S = 0.05
MAX_CLOSED_PORTS = 256

# Ports a plane of this process closed: binding one again may meet libzmq still holding it (see _bind_router).
_closed_ports: set[int] = set()
_closed_ports_lock = threading.Lock()


class RouterPlane(abc.ABC):
    """Start, bind, serve and stop one ROUTER socket in one IO thread. ``name`` says which plane in logs and errors."""

    name = "router plane"
    thread_name = "router-plane-io"
    gate_domain = "primerl-router"
    """The ZAP domain of the plane's socket when its connections are gated."""
    connection_kind = "connection"
    """What the gate calls one connection in its logs and refusals."""

    def __init__(
        self,
        context: zmq.Context,
        host: str,
        port: int,
        max_connections: int | None = None,
        curve: CurveServer | None = None,
    ):
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self._gate: ConnectionGate | None = None
        self.context = context
        self.host = host
        self._requested_port = port
        self.port = 0  # the bound port, once ``start`` returned
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.curve = curve  # CURVE on the socket; None: plain, or the run token's PLAIN
        self.auth_token: str | None = None  # a plane with a run token sets it (checked at the handshake too)
        self._authenticator: Any = None

    # -- any thread ----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 10.0) -> int:
        """Bind the socket (in the IO thread) and start serving; returns the bound port (also ``self.port``)."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start() was already called")
        context = contextvars.copy_context()  # the IO thread logs with the caller's bound fields
        self._thread = threading.Thread(target=context.run, args=(self._run,), name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self._stop_event.set()
            raise TimeoutError(f"{self.name} did not bind {self.host}:{self._requested_port} within {timeout_s} s")
        if self._start_error is not None:
            raise RuntimeError(
                f"{self.name} cannot bind {self.host}:{self._requested_port}: {self._start_error}"
            ) from self._start_error
        return self.port

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the IO thread to end and wait up to ``timeout_s``; True once it has ended (or never started)."""
        self._stop_event.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error(f"{self.name} IO thread did not stop in time", timeout_s=timeout_s)
            return False
        return True

    @property
    def handshake_check(self) -> CurveServer | RunTokenServer | None:
        """What the plane's ZAP handler checks of a peer's credentials: its CURVE key, else the run token (None:
        neither is set)."""
        if self.curve is not None:
            return self.curve
        if self.auth_token:
            return self._token_server
        return None

    def connection_counts(self) -> tuple[int | None, int]:
        """(peers admitted at the handshake and connected now, connections refused there); (None, 0) when the plane
        admits every peer. Plain reads of counters the IO thread updates: a status may be one event behind."""
        gate = self._gate
        return (gate.num_connected, gate.num_refused) if gate is not None else (None, 0)

    @functools.cached_property
    def _token_server(self) -> RunTokenServer:
        assert self.auth_token
        return RunTokenServer(self.auth_token)

    # -- IO thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            socket = self._bind()
        except Exception as exc:  # reported to start(), which raises it
            self._start_error = exc
            self._release()
            self._stop_authenticator()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(socket)
        finally:
            socket.close(linger=0)
            with _closed_ports_lock:
                if len(_closed_ports) >= MAX_CLOSED_PORTS:
                    _closed_ports.clear()
                _closed_ports.add(self.port)
            self._release()
            self._stop_authenticator()

    def _stop_authenticator(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    def _bind_router(self, **options: Any) -> zmq.Socket:
        """``bind_router`` on this plane's host and port. A port that a plane of this process closed is released
        by libzmq asynchronously, so an in-process restart on the same port may briefly see EADDRINUSE: retry
        within a short bound then, and only then (a port another process holds fails at once)."""
        if self.curve is not None:
            options["security"] = self.curve
            if not options.get("zap_domain") and self._authenticator is None:
                self._authenticator = self.curve.start_authenticator(self.context)
        elif self.auth_token:
            if not options.get("zap_domain"):
                raise RuntimeError(f"{self.name}: a run token is checked at the handshake by a connection gate")
            options["security"] = self._token_server
        deadline_s = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                socket, self.port = bind_router(self.context, self.host, self._requested_port, **options)
                return socket
            except zmq.ZMQError as exc:
                with _closed_ports_lock:
                    closed_here = self._requested_port in _closed_ports
                if exc.errno != zmq.EADDRINUSE or not closed_here or time.monotonic() >= deadline_s:
                    raise
                time.sleep(BIND_RETRY_SLEEP_S)

    def _bind_gated(self, **options: Any) -> zmq.Socket:
        """``_bind_router(**options)``, behind the connection gate when ``max_connections`` or a handshake check is
        set. The gate's ZAP endpoint must exist before the socket binds (without a handler libzmq admits every
        NULL-mechanism peer), and the socket's monitor before any handshake can end (none can before the gate
        answers, in this thread)."""
        check = self.handshake_check
        if (self.max_connections is not None or check is not None) and self._gate is None:
            self._gate = ConnectionGate(
                self.context,
                max_connections=self.max_connections or UNLIMITED_CONNECTIONS,
                domain=self.gate_domain,
                what=self.connection_kind,
                authorize=check.authorize if check is not None else None,
                refusal_hint=check.refusal_hint if check is not None else "",
            )
        socket = self._bind_router(zap_domain=self.gate_domain if self._gate is not None else None, **options)
        if self._gate is not None:
            self._gate.watch(socket)
        return socket

    def _gate_poller(self, socket: zmq.Socket) -> tuple[zmq.Poller, list[zmq.Socket]]:
        """A poller of the plane's socket and of its gate's sockets (returned: pass them to ``_serve_gate``)."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        gate_sockets = self._gate.sockets() if self._gate is not None else []
        for gate_socket in gate_sockets:
            poller.register(gate_socket, zmq.POLLIN)
        return poller, gate_sockets

    def _serve_gate(self, ready: dict[Any, int], gate_sockets: list[zmq.Socket]) -> None:
        """Answer the gate's sockets that ``ready`` (a poll's result) names."""
        for gate_socket in gate_sockets:
            if gate_socket in ready:
                self._gate.handle(gate_socket)  # type: ignore[union-attr]

    def _handle_guarded(self, *args: Any) -> None:
        """The per-message guard: no single message can end the IO thread.

        A failure handling one message (a bug that a peer's bytes found) goes to ``_unexpected(*args, exc)``,
        which logs it (rate-limited) and tells the sender INTERNAL; serving goes on. Only a broken context
        (``ETERM``) or ``stop`` ends the loop."""
        try:
            self._handle(*args)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                raise
            self._unexpected(*args, exc)
        except Exception as exc:
            self._unexpected(*args, exc)

    # -- what a plane supplies -----------------------------------------------------------------------

    @abc.abstractmethod
    def _bind(self) -> zmq.Socket:
        """The bound socket (use ``_bind_router``)."""

    @abc.abstractmethod
    def _serve(self, socket: zmq.Socket) -> None:
        """The IO loop; returns once ``_stop_event`` is set. The socket is closed after it."""

    def _release(self) -> None:
        """Free what ``_bind`` set up beside the socket (after a failed bind, or after serving): the gate."""
        if self._gate is not None:
            self._gate.close()
            self._gate = None

    @abc.abstractmethod
    def _handle(self, *args: Any) -> None:
        """One message from a peer (called through ``_handle_guarded``)."""

    @abc.abstractmethod
    def _unexpected(self, *args: Any) -> None:
        """A failure ``_handle`` did not expect: log it (rate-limited) and answer the peer if it can."""
