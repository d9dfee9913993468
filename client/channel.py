"""The gRPC channel to the broker's control plane: TLS when a CA is given (mutual TLS with a client certificate),
the run token on every call, and reconnect and keepalive settings that notice a restarted or silently dead broker
within seconds; the jittered backoff of the clients' retries (``jittered``)."""

from __future__ import annotations

import random
from pathlib import Path

import grpc

from primerl.runtime.wire_security import read_pem

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0


def jittered(backoff_s: float) -> float:
    """A wait drawn uniformly from ``[BACKOFF_INITIAL_S, backoff_s]`` ("full jitter"): a fleet that lost its broker
    at the same moment comes back spread over the backoff instead of all in the same instant (a thousand workers
    re-register over ~5 s, not in one burst)."""
    return random.uniform(BACKOFF_INITIAL_S, max(BACKOFF_INITIAL_S, backoff_s))


CHANNEL_OPTIONS = [
    # gRPC's own reconnect backoff defaults to 1 s growing to 120 s: far too slow to notice a restarted broker.
    ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000)),
    ("grpc.min_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX_S * 1000)),
    # Detect a silently dead connection (e.g. during a long WatchRunStatus) within ~30 s.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),
]


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, run_token: str):
        self._metadata = ("authorization", f"Bearer {run_token}")

    def _with_token(self, details):
        metadata = list(details.metadata or ()) + [self._metadata]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def create_channel(
    address: str,
    *,
    run_token: str | None = None,
    tls_ca_path: str | Path | None = None,
    tls_cert_path: str | Path | None = None,
    tls_key_path: str | Path | None = None,
    tls_server_name: str | None = None,
) -> grpc.Channel:
    """A channel to the broker: TLS when ``tls_ca_path`` is given (with this client's certificate when
    ``tls_cert_path`` and ``tls_key_path`` are: mutual TLS; the broker's certificate checked against
    ``tls_server_name`` instead of the address's host when given), the run token on every call when set. Raises
    ``ValueError`` naming the setting when a file cannot be read."""
    if (tls_cert_path is None) != (tls_key_path is None):
        raise ValueError("broker.tls_cert_path and broker.tls_key_path (a client certificate) go together")
    if tls_ca_path is not None:
        root_certificates = read_pem(tls_ca_path, "broker.tls_ca_path (the CA of the broker's TLS certificate)")
        private_key = certificate_chain = None
        if tls_cert_path is not None:
            certificate_chain = read_pem(tls_cert_path, "broker.tls_cert_path (this client's certificate)")
            private_key = read_pem(tls_key_path, "broker.tls_key_path (this client's private key)")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
        )
        options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else [])
        channel = grpc.secure_channel(address, credentials, options=options)
    elif tls_cert_path is not None:
        raise ValueError("broker.tls_cert_path (a client certificate) needs TLS: set broker.tls_ca_path too")
    else:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if run_token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(run_token))
    return channel
