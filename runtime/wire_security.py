"""Credentials of an encrypted, authenticated wire, read from files: TLS for the gRPC control plane (server
certificate, client certificates signed by a CA the broker names) and CURVE for the ZeroMQ planes.

Opt-in. A run without any of these settings keeps plain TCP; the run token stays the application-level credential
either way (checked on every gRPC call and every ZeroMQ message).

CURVE (ZeroMQ's elliptic-curve encryption and authentication, RFC 26):

- the broker holds a key pair (``broker.curve_secret_key_path``, a ``.key_secret`` file of ``zmq.auth``'s
  certificate format) and a directory of the public keys it admits (``broker.curve_authorized_keys_dir``: ``*.key``
  files, read again when files are added or removed: ``AuthorizedKeys``). A client whose public key is not there is
  refused at the handshake by the ZAP handler of the socket's context (``CurveServer.authorize``), before it can send a
  byte of application data;
- a client holds its own key pair (``<role>.broker.curve_secret_key_path``) and the broker's public key
  (``<role>.broker.curve_broker_key_path``): without the right broker key its handshake fails too.

A ZeroMQ peer whose handshake fails never "connects". The clients watch their handshakes and stop on a refusal, a
mechanism mismatch or handshakes the broker keeps closing (``primerl.client.dealer``); any other failure only shows
as a timeout, so every client timeout of the data plane still says that missing or wrong CURVE credentials are
one possible cause (``CurveClient.timeout_hint``).

Every loader raises ``ValueError`` naming the setting when a file is missing, unreadable or of the wrong kind.
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from primerl.runtime.config_common import MAX_HANDSHAKE_TOKEN_BYTES
from primerl.runtime.log_setup import get_logger

CURVE_MECHANISM = b"CURVE"
PLAIN_MECHANISM = b"PLAIN"

# The ZAP status codes a broker plane's handshake gate (``broker.connection_gate``) answers with. A client sees
# them as the value of its socket's ``EVENT_HANDSHAKE_FAILED_AUTH`` and libzmq does not reconnect it after either.
CREDENTIALS_REFUSED_STATUS = 400
"""The peer's credentials are wrong (a wrong run token, an unknown CURVE key): trying again will not help."""
GATE_FULL_STATUS = 500
"""The socket has as many peers as it admits: a client connects again after a pause."""
REFUSAL_LOG_INTERVAL_S = 10.0
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about each new connection of a socket with a ZAP domain (one per
context)."""

log = get_logger("primerl.runtime.wire_security")


def _load_certificate(path: Path, setting: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise ValueError(f"{setting} = {str(path)!r}: no such file (make one with `primerl certs`)")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{setting} = {str(path)!r} is not a ZeroMQ CURVE certificate file: {exc}") from exc


def load_curve_key_pair(path: str | Path, setting: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``.key_secret`` file; ``setting`` names the config key in errors."""
    public, secret = _load_certificate(Path(path), setting)
    if not secret:
        raise ValueError(
            f"{setting} = {str(path)!r} holds only a public key: name the `.key_secret` file of the key pair instead"
        )
    return public, secret


def load_curve_public_key(path: str | Path, setting: str) -> bytes:
    """The Z85 public key of a ``.key`` (or ``.key_secret``) file."""
    public, _ = _load_certificate(Path(path), setting)
    return public


def load_authorized_keys(directory: str | Path, setting: str) -> frozenset[bytes]:
    """The Z85 public keys of every ``*.key`` file in ``directory`` (secret files are not read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{setting} = {str(directory)!r}: no such directory (make one with `primerl certs`)")
    keys = set()
    for path in sorted(directory.glob("*.key")):
        keys.add(load_curve_public_key(path, f"{setting} (file {path.name})"))
    if not keys:
        raise ValueError(
            f"{setting} = {str(directory)!r} holds no `*.key` public key files: every client would be "
            "refused; copy each client's public key file there"
        )
    return frozenset(keys)


def read_pem(path: str | Path, setting: str) -> bytes:
    """The bytes of a PEM file (certificate or key) named by ``setting``."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {setting} = {str(path)!r}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting} = {str(path)!r} is not a PEM file")
    return data


class AuthorizedKeys:
    """The client public keys in a directory, read again whenever the directory changes (a key file added or
    removed: ``st_mtime_ns`` of the directory), so that a client can be admitted or revoked without restarting the
    broker. Checked at every handshake; thread-safe (the two planes' ZAP handlers run in different threads). A
    directory that becomes unreadable or empty keeps the keys read last (logged)."""

    def __init__(self, directory: str | Path, setting: str):
        self.directory = Path(directory)
        self.setting = setting
        self._lock = threading.Lock()
        self._keys = load_authorized_keys(self.directory, setting)
        self._mtime_ns = self._stat()

    def _stat(self) -> int | None:
        try:
            return self.directory.stat().st_mtime_ns
        except OSError:
            return None

    def _refresh(self) -> None:
        mtime_ns = self._stat()
        if mtime_ns is None or mtime_ns == self._mtime_ns:
            return
        self._mtime_ns = mtime_ns
        try:
            keys = load_authorized_keys(self.directory, self.setting)
        except ValueError as exc:
            log.warning("authorized CURVE keys changed but cannot be read; the previous ones stay", error=str(exc))
            return
        if keys != self._keys:
            log.info(
                "authorized CURVE keys reloaded",
                num_keys=len(keys),
                num_added=len(keys - self._keys),
                num_removed=len(self._keys - keys),
                directory=str(self.directory),
            )
            self._keys = keys

    def __contains__(self, z85_key: object) -> bool:
        with self._lock:
            self._refresh()
            return z85_key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


@dataclass(frozen=True)
class CurveServer:
    """The broker's side of CURVE: its key pair and the client public keys it admits."""

    public_key: bytes
    secret_key: bytes
    authorized_keys: AuthorizedKeys

    @classmethod
    def load(cls, secret_key_path: str | Path, authorized_keys_dir: str | Path, prefix: str = "broker.") -> CurveServer:
        public, secret = load_curve_key_pair(secret_key_path, f"{prefix}curve_secret_key_path")
        authorized = AuthorizedKeys(authorized_keys_dir, f"{prefix}curve_authorized_keys_dir")
        return cls(public, secret, authorized)

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a CURVE server (before it binds)."""
        socket.curve_server = True
        socket.curve_publickey = self.public_key
        socket.curve_secretkey = self.secret_key

    refusal_hint = "add the client's public key to broker.curve_authorized_keys_dir"

    def authorize(self, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """A ZAP decision: None admits the peer, a string is why it is refused (only CURVE with a known key)."""
        if mechanism != CURVE_MECHANISM:
            return f"mechanism {mechanism.decode(errors='replace')} instead of CURVE"
        if not credentials or len(credentials[0]) != 32:
            return "no CURVE public key"
        if z85.encode(credentials[0]) not in self.authorized_keys:
            return "unknown CURVE public key"
        return None

    def start_authenticator(self, context: zmq.Context):
        """A ZAP handler thread on ``context`` (its one ZAP endpoint) that admits the authorized keys only; stop it
        with ``.stop()`` after the sockets it guards are closed. Use it for a context without another handler."""
        from zmq.auth.thread import ThreadAuthenticator

        authenticator = ThreadAuthenticator(context, log=_quiet_log())
        authenticator.start()
        authenticator.configure_curve_callback(domain="*", credentials_provider=_KeySet(self.authorized_keys))
        return authenticator


class _KeySet:
    """``configure_curve_callback``'s provider: admits a client public key found in the set; logs refusals (at
    most one line per ``REFUSAL_LOG_INTERVAL_S``, with the count since the last)."""

    def __init__(self, keys: AuthorizedKeys):
        self._keys = keys
        self._num_refused = 0
        self._next_log_s = 0.0

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key in self._keys:
            return True
        self._num_refused += 1
        now_s = time.monotonic()
        if now_s >= self._next_log_s:
            log.warning(
                "weight connection refused at the handshake: unknown CURVE public key",
                public_key=z85_key.decode(errors="replace"),
                num_refused=self._num_refused,
                hint="add the client's public key to broker.curve_authorized_keys_dir",
            )
            self._next_log_s = now_s + REFUSAL_LOG_INTERVAL_S
        return False


def _quiet_log():
    import logging

    logger = logging.getLogger("primerl.runtime.wire_security.zap")
    logger.setLevel(logging.WARNING)
    return logger


@dataclass(frozen=True)
class CurveClient:
    """A client's side of CURVE: its key pair and the broker's public key."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    @classmethod
    def load(cls, secret_key_path: str | Path, broker_key_path: str | Path, prefix: str = "broker.") -> CurveClient:
        public, secret = load_curve_key_pair(secret_key_path, f"{prefix}curve_secret_key_path")
        server = load_curve_public_key(broker_key_path, f"{prefix}curve_broker_key_path")
        return cls(public, secret, server)

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a CURVE client of the broker (before it connects)."""
        socket.curve_publickey = self.public_key
        socket.curve_secretkey = self.secret_key
        socket.curve_serverkey = self.server_key


@dataclass(frozen=True)
class RunTokenServer:
    """The run token checked at the ZeroMQ handshake, for a broker plane without CURVE.

    The socket is a PLAIN server: a client presents the run token as its PLAIN password (``apply_run_token``) and
    the plane's ZAP handler (its connection gate) admits it only if the token is right. A peer without the token
    is refused before it can send a byte of application data, so it cannot make the broker buffer anything nor
    hold one of the plane's connection places. PLAIN sends the token in clear, as every message does anyway; off
    a trusted network, CURVE encrypts both (and then the key is the handshake's credential, the token is still
    checked in every message)."""

    run_token: str

    refusal_hint = "give the client the broker's run token ([broker] run_token in its config, or PRIMERL_RUN_TOKEN)"

    def __post_init__(self) -> None:
        check_handshake_token(self.run_token, "run_token")

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a PLAIN server (before it binds)."""
        socket.plain_server = True

    def authorize(self, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """A ZAP decision: None admits the peer, a string is why it is refused."""
        if mechanism != PLAIN_MECHANISM:
            return f"mechanism {mechanism.decode(errors='replace')} instead of PLAIN with the run token"
        if len(credentials) < 2 or not credentials[1]:
            return "no run token"
        if not hmac.compare_digest(credentials[1], self.run_token.encode()):
            return "wrong run token"
        return None


def zap_request(frames: list[bytes]) -> tuple[bytes, bytes, bytes, bytes, list[bytes]] | None:
    """``(request id, domain, peer address, mechanism, credentials)`` of a ZAP request read from a ROUTER bound at
    ``ZAP_ENDPOINT`` (None: not a ZAP request; libzmq never sends one)."""
    # [zap routing id, b"", version, request id, domain, address, identity, mechanism, credentials...]
    if len(frames) < 8:
        return None
    return frames[3], frames[4], frames[5], frames[7], frames[8:]


def zap_reply(zap: zmq.Socket, frames: list[bytes], status: int, text: str) -> None:
    """Answer the ZAP request ``frames`` (as read from ``zap``): status 200 admits the peer."""
    zap.send_multipart([frames[0], b"", b"1.0", frames[3], str(status).encode(), text.encode(), b"", b""])


def check_handshake_token(run_token: str, setting: str) -> None:
    """``ValueError`` naming ``setting`` when the token is too long for the ZeroMQ handshake."""
    size = len(run_token.encode())
    if size > MAX_HANDSHAKE_TOKEN_BYTES:
        raise ValueError(
            f"{setting} is {size} bytes long; the ZeroMQ handshake checks tokens of at most "
            f"{MAX_HANDSHAKE_TOKEN_BYTES} bytes: use a shorter one (e.g. `openssl rand -hex 32`)"
        )


def apply_run_token(socket: zmq.Socket, run_token: str, sender: str) -> None:
    """Make ``socket`` a PLAIN client that presents ``run_token`` (and ``sender`` as its user name, which the broker
    logs when it refuses it), before it connects."""
    check_handshake_token(run_token, "run_token")
    socket.plain_username = sender.encode()[:MAX_HANDSHAKE_TOKEN_BYTES]
    socket.plain_password = run_token.encode()


def timeout_hint(curve: CurveClient | None) -> str:
    """What to check when a data-plane connection never comes up: a CURVE mismatch looks like no answer at all."""
    if curve is None:
        return (
            "; if the broker encrypts its ZeroMQ planes (broker.curve_secret_key_path), this client needs "
            "curve_secret_key_path and curve_broker_key_path in its [broker] table"
        )
    return (
        "; with CURVE on, also check that the broker encrypts its planes, that this client's public key is in "
        "broker.curve_authorized_keys_dir and that curve_broker_key_path is the broker's public key"
    )
