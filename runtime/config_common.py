"""Config sections that several roles share: logging, the broker client, Weights & Biases, Prometheus."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from primerl.runtime.config_base import BaseConfig

DEFAULT_BROKER_HOST = "127.0.0.1"
DEFAULT_BROKER_GRPC_PORT = 50051


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class LogConfig(BaseConfig):
    """How a role logs."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level that is logged.")
    format: Literal["console", "json"] = Field(
        "console", description="`console`: readable lines for a terminal; `json`: one JSON object per line."
    )


MAX_HANDSHAKE_TOKEN_BYTES = 255
"""The longest run token the ZeroMQ handshake can carry (ZMTP's PLAIN password is at most 255 bytes)."""

DEFAULT_OUTAGE_S = 120.0
"""Default ``outage_s``: a broker restart under systemd (RestartSec plus start-up) fits well inside it."""


class BrokerClientConfig(BaseConfig):
    """How a worker (trainer, orchestrator, inference) reaches the broker."""

    address: str = Field(
        f"{DEFAULT_BROKER_HOST}:{DEFAULT_BROKER_GRPC_PORT}",
        description="gRPC address of the broker, as `host:port`.",
    )
    run_token: str | None = Field(
        None,
        repr=False,
        description="Shared secret of the run, sent with every request and, without CURVE, presented at the "
        "ZeroMQ handshake; must match `broker.run_token`.",
    )
    tls_ca_path: Path | None = Field(
        None, description="PEM file of the CA (or self-signed certificate) that signed the broker's TLS certificate."
    )
    tls_cert_path: Path | None = Field(
        None,
        description="PEM client certificate for mutual TLS (set with `tls_key_path` and `tls_ca_path`), for a "
        "broker that sets `tls_client_ca_path`.",
    )
    tls_key_path: Path | None = Field(None, description="PEM private key of `tls_cert_path` (mutual TLS).")
    tls_server_name: str | None = Field(
        None,
        min_length=1,
        description="Name to check the broker's TLS certificate against instead of the host in `address` (one of "
        "the `--host` names given to `primerl certs`), e.g. when dialing it through NAT or a tunnel.",
    )
    curve_secret_key_path: Path | None = Field(
        None,
        description="This client's CURVE key pair (a ZeroMQ `.key_secret` file, as `primerl certs` writes), for a "
        "broker that sets `curve_secret_key_path`: the rollout and weight planes are then encrypted. Set together "
        "with `curve_broker_key_path`.",
    )
    curve_broker_key_path: Path | None = Field(
        None, description="The broker's CURVE public key file (`.key`), with `curve_secret_key_path`."
    )
    connect_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the broker at start-up before giving up."
    )
    outage_s: float = Field(
        DEFAULT_OUTAGE_S,
        gt=0,
        description="How long a running worker waits through a broker outage (a restart, a lost network) before it "
        "stops with an error; it logs what it waits for every few seconds meanwhile.",
    )

    @model_validator(mode="after")
    def _check_credentials(self) -> BrokerClientConfig:
        problems = []
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            problems.append("set both `tls_cert_path` and `tls_key_path` (a client certificate), or neither")
        if self.tls_cert_path is not None and self.tls_ca_path is None:
            problems.append(
                "a client certificate (`tls_cert_path`) needs TLS: set `tls_ca_path` to the CA of the "
                "broker's certificate too"
            )
        if self.tls_server_name is not None and self.tls_ca_path is None:
            problems.append("`tls_server_name` needs TLS: set `tls_ca_path` too")
        if (self.curve_secret_key_path is None) != (self.curve_broker_key_path is None):
            problems.append("set both `curve_secret_key_path` and `curve_broker_key_path` for CURVE, or neither")
        if self.run_token and len(self.run_token.encode()) > MAX_HANDSHAKE_TOKEN_BYTES:
            problems.append(
                f"`run_token` is {len(self.run_token.encode())} bytes long; the ZeroMQ handshake carries a token of "
                f"at most {MAX_HANDSHAKE_TOKEN_BYTES} bytes"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def curve_client(self):
        """This client's CURVE credentials (``runtime.wire_security.CurveClient``), loaded now; None without CURVE.
        Raises ``ValueError`` naming the setting when a file is missing or wrong."""
        if self.curve_secret_key_path is None or self.curve_broker_key_path is None:
            return None
        from primerl.runtime.wire_security import CurveClient

        return CurveClient.load(self.curve_secret_key_path, self.curve_broker_key_path)

    @field_validator("address")
    @classmethod
    def _check_address(cls, address: str) -> str:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address must be `host:port` with a port in 1..65535, got {address!r}")
        return address


class WandbConfig(BaseConfig):
    """Weights & Biases logging; present means enabled."""

    project: str = Field("primerl", min_length=1, description="W&B project.")
    name: str | None = Field(None, description="Run name shown in W&B (W&B picks one when unset).")
    entity: str | None = Field(None, description="W&B team or user that owns the project.")
    offline: bool = Field(False, description="Log to local files only; sync later with `wandb sync`.")


class PrometheusConfig(BaseConfig):
    """The daemon's Prometheus endpoint: `GET http://host:port/metrics` (its URL is logged at start and shown by
    `primerl status`)."""

    enabled: bool = Field(True, description="Serve `/metrics` over HTTP.")
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Interface the metrics server binds; use `0.0.0.0` for scraping from other machines.",
    )
    port: int = Field(0, ge=0, le=65535, description="Port of the metrics server (0: a free port, logged at start).")


# The tables a daemon's config declares the same way in every role (the field, its default and its description).
BrokerConnection = Annotated[
    BrokerClientConfig, Field(default_factory=BrokerClientConfig, description="Broker connection.")
]
DaemonLog = Annotated[LogConfig, Field(default_factory=LogConfig, description="Logging of this daemon.")]
MetricsEndpoint = Annotated[
    PrometheusConfig,
    Field(default_factory=PrometheusConfig, description="Prometheus `/metrics` of this daemon (the trainer's rank 0)."),
]
WandbLogging = Annotated[WandbConfig | None, Field(None, description="Weights & Biases logging; off when absent.")]
