"""Config of the broker daemon (`primerl-broker`). Imports neither torch nor vLLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from primerl.proto.units import GiB, MiB
from primerl.runtime.addresses import check_advertise_host
from primerl.runtime.config_base import BaseConfig
from primerl.runtime.config_common import (
    DEFAULT_BROKER_GRPC_PORT,
    DEFAULT_BROKER_HOST,
    DEFAULT_OUTAGE_S,
    MAX_HANDSHAKE_TOKEN_BYTES,
    DaemonLog,
    MetricsEndpoint,
    is_loopback_host,
)

RUN_TOKEN_ENV = "PRIMERL_RUN_TOKEN"
"""The environment variable that gives the run token to every daemon and to `primerl rl` (no file holds it)."""


def physical_memory_bytes() -> int:
    """Physical memory of this machine (16 GiB when the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _port(default: int, description: str) -> Any:
    """A port field: 0 picks a free port."""
    return Field(default, ge=0, le=65535, description=description)


class BrokerConfig(BaseConfig):
    """The hub of a run: worker registry and run status (gRPC), rollout queue and weight fan-out (ZeroMQ)."""

    host: str = Field(
        DEFAULT_BROKER_HOST,
        min_length=1,
        description="Interface that the gRPC server and the ZeroMQ sockets bind (`0.0.0.0` for all interfaces).",
    )
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="Host that workers are told to dial for the ZeroMQ planes (the endpoints handed out at "
        "registration), when it differs from `host` (NAT, a wildcard bind). Unset: `host` when it is a concrete "
        "address; with a wildcard `host` the endpoints carry the wildcard and each worker dials the host it "
        "reached the broker's gRPC server at (its `broker.address`).",
    )
    grpc_port: int = _port(
        DEFAULT_BROKER_GRPC_PORT,
        "gRPC control-plane port (0: pick a free port). Under `primerl rl`, unset means a free port: the "
        "launcher tells the other roles the one bound.",
    )
    rollout_port: int = _port(
        50052,
        "ZeroMQ port for rollout batches (orchestrator in, trainer ranks out); workers learn it when they "
        "register. Under `primerl rl`, unset means a free port.",
    )
    weight_port: int = _port(
        50053,
        "ZeroMQ port for weight updates (trainer in, inference workers out); workers learn it when they "
        "register. Under `primerl rl`, unset means a free port.",
    )
    spool_dir: Path = Field(
        Path("outputs/broker/spool"),
        description="Directory where rollout batches are kept until the trainer commits the step that used them.",
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="Seconds between heartbeats that the broker and each worker send each other."
    )
    heartbeat_liveness: int = Field(
        5, ge=1, description="Missed heartbeats in a row after which a peer is declared lost."
    )
    heartbeat_budget_per_s: float = Field(
        500.0,
        ge=0,
        description="Heartbeats per second the broker asks of the whole fleet at most: with more than this times "
        "`heartbeat_interval_s` live workers, each is asked for a longer interval (live workers / this; every "
        "heartbeat's answer says it), so the broker's heartbeat load stays bounded, and a silent worker is marked "
        "lost after `heartbeat_liveness` of its own intervals. 0: always `heartbeat_interval_s`.",
    )
    max_workers: int = Field(
        4096,
        ge=1,
        le=65536,
        description="Live workers (every role) the broker admits at once, and inference workers its weight fan-out "
        "serves; a registration beyond it is refused (RESOURCE_EXHAUSTED). What one broker can carry: "
        'docs/performance.md, "One broker for a fleet". Raise `max_weight_connections` with it for more than '
        "~250 inference workers.",
    )
    max_queue_batches: int = Field(
        8, ge=1, description="Rollout batches held (in memory and spool) before the orchestrator is made to wait."
    )
    max_queue_bytes: int = Field(
        2 * GiB, ge=MiB, description="Bytes of rollout batches held before the orchestrator is made to wait."
    )
    max_message_bytes: int = Field(
        256 * MiB,
        ge=MiB,
        description="Largest message accepted on any socket; bigger payloads (weights) are sent in chunks. "
        "Workers learn it (and the chunk size that follows) when they register.",
    )
    weight_chunk_bytes: int = Field(
        8 * MiB,
        ge=MiB,
        description="Payload bytes per weight chunk, at most `max_message_bytes` (the smaller of the two holds): "
        "what the trainer sends and the broker forwards. Each relay hop and the broker's cut-through hold one chunk "
        "before passing it on, so a smaller chunk shortens a chain; 8 MiB keeps the per-chunk cost negligible. "
        "Workers learn it when they register.",
    )
    max_rollout_message_bytes: int = Field(
        64 * MiB,
        ge=MiB,
        description="Largest rollout micro-batch (one message on the rollout socket), at most `max_message_bytes` "
        "(the smaller of the two holds). libzmq drops a connection that sends a bigger frame before buffering it, "
        "so it bounds what the rollout socket can hold: `max_rollout_connections` x (`rollout_hwm` + 1) x this. "
        "Orchestrators learn it when they register and refuse a bigger micro-batch themselves.",
    )
    max_payload_frames: int = Field(
        8,
        ge=1,
        le=64,
        description="Most payload frames in one data-plane message (rollout batches and weight chunks carry 1).",
    )
    rollout_hwm: int = Field(
        4,
        ge=1,
        le=1024,
        description="ZeroMQ receive high-water mark of the rollout socket, in messages per peer: bounds what one "
        "producer can have buffered in the broker before it is read (each at most `max_message_bytes`).",
    )
    max_rollout_connections: int = Field(
        16,
        ge=1,
        le=4096,
        description="Peers (orchestrators and trainer ranks) the rollout socket admits at once; more are refused at "
        "the ZeroMQ handshake, before they can send anything, and their clients retry. Bounds what the socket can "
        "buffer whatever the number of peers: `max_rollout_connections` x (`rollout_hwm` + 1) messages.",
    )
    max_weight_connections: int = Field(
        256,
        ge=1,
        le=65536,
        description="Peers (trainer publishers and inference workers) the weight socket admits at once; more are "
        "refused at the ZeroMQ handshake, before they can send anything, and their clients retry. Bounds what the "
        "socket can buffer whatever the number of peers that try.",
    )
    weight_hwm: int = Field(
        16,
        ge=1,
        le=1024,
        description="ZeroMQ high-water mark of the weight socket, in messages per peer and direction.",
    )
    weight_fanout: Literal["star", "chain"] = Field(
        "star",
        description="How the broker pushes a weight update to the inference workers. `star`: it sends every byte to "
        "every worker. `chain` (relay): it sends each chunk once, to the first worker of a chain, and each worker "
        "forwards the chunks it receives to the next while it loads them; workers without a relay socket "
        "(`inference.weight_relay_host` unset, or a CURVE wire) are sent the update directly. The broker stays the "
        "origin: versions, acknowledgements, joins and refusals are unchanged.",
    )
    weight_relay_timeout_s: float = Field(
        20.0,
        gt=0,
        description='`weight_fanout = "chain"`: a worker that has not acknowledged an update this long after the '
        "chain's first worker received its last chunk (or a chain whose first worker took no chunk for this long) "
        "is sent the update by the broker; the worker the others waited on relays nothing more until it "
        "acknowledges one. Keep it above a worker's time to load an update.",
    )
    weight_relay_max_hops: int = Field(
        32,
        ge=2,
        le=4096,
        description='`weight_fanout = "chain"`: workers in one relay chain at most; more workers form more chains '
        "(the broker sends each chunk once per chain). Each hop holds one chunk before passing it on, so a long chain "
        "adds one chunk-time per hop: keep it below the number of chunks of an update (`weight_chunk_bytes`).",
    )
    history_max_bytes: int = Field(
        16 * MiB,
        ge=0,
        description="Memory bound of the run history the dashboard reads (`GetRunHistory`: per-step metric rows, "
        "events, sample rollouts; oldest dropped first), also kept in `<spool_dir>/run_history.json`.",
    )
    read_cache_bytes: int = Field(
        256 * MiB,
        ge=0,
        description="Bytes of recently spooled rollout batches kept in memory so a trainer gets them without a "
        "disk read (0: off).",
    )
    max_step_lead: int = Field(
        1024,
        ge=1,
        description="Steps beyond the highest step a trainer asked for (or committed) that a rollout request or "
        "batch may name; further ones are refused (OUT_OF_ORDER) so the queue bound cannot be switched off.",
    )
    max_transfer_bytes: int | None = Field(
        None,
        ge=MiB,
        description="Largest weight update (one chunked transfer), checked at its first chunk before any memory "
        "is set aside. Unset: a quarter of this machine's memory, at most 16 GiB.",
    )
    max_open_transfer_bytes: int | None = Field(
        None,
        ge=MiB,
        description="Bytes that all weight transfers still being received may declare together; a transfer that "
        "would exceed it is told to retry later (BACKPRESSURE). Unset: `max_transfer_bytes`.",
    )
    max_open_transfers_per_publisher: int = Field(
        1,
        ge=1,
        le=16,
        description="Weight transfers one publisher connection may have open; a new one beyond it replaces its "
        "oldest (a publisher that restarted a transfer abandoned the old one).",
    )
    transfer_stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A weight transfer with no chunk for this long is dropped, freeing its memory and its slot.",
    )
    transfer_evict_after_s: float = Field(
        5.0,
        gt=0,
        description="A weight transfer with no chunk for this long gives its place to a new transfer of another "
        "connection when the open transfers (their number or `max_open_transfer_bytes`) are at their bound, so "
        "half-open transfers cannot keep the trainer out for `transfer_stall_timeout_s`. Keep it above the time one "
        "chunk (`weight_chunk_bytes`) takes to arrive over the trainer's link.",
    )
    allow_remote_without_token: bool = Field(
        False,
        description="Let a broker without `run_token` bind a non-loopback `host` (anyone who can reach the ports "
        "can then feed or read the run). Without it, such a broker refuses to start; with it, it warns.",
    )
    run_token: str | None = Field(
        None,
        repr=False,
        description="Shared secret that every worker must present (at most 255 bytes): checked in every request and, "
        "on the ZeroMQ planes without CURVE, at the connection's handshake, so a peer without it cannot make the "
        "broker buffer anything. Required when `host` is not a loopback address.",
    )
    tls_cert_path: Path | None = Field(
        None, description="PEM certificate for TLS on the gRPC server (set together with `tls_key_path`)."
    )
    tls_key_path: Path | None = Field(
        None, description="PEM private key for TLS on the gRPC server (set together with `tls_cert_path`)."
    )
    tls_client_ca_path: Path | None = Field(
        None,
        description="PEM file of the CA that signs client certificates (mutual TLS): when set, the gRPC server "
        "requires every client to present a certificate signed by it (`<role>.broker.tls_cert_path` and "
        "`tls_key_path`). Needs `tls_cert_path`. `primerl certs` makes one.",
    )
    curve_secret_key_path: Path | None = Field(
        None,
        description="The broker's CURVE key pair (a ZeroMQ `.key_secret` certificate file, as `primerl certs` "
        "writes): when set, the rollout and weight planes are encrypted with CURVE and admit only the client keys in "
        "`curve_authorized_keys_dir` (set both, or neither).",
    )
    curve_authorized_keys_dir: Path | None = Field(
        None,
        description="Directory of the CURVE public keys (`*.key` files) of the clients the ZeroMQ planes admit; a "
        "client with another key is refused at the handshake. Read at start and again whenever a key file is added "
        "or removed: admitting or revoking a client needs no restart (connections already open stay).",
    )
    run_id: str | None = Field(
        None, min_length=1, description="Name of the run, shown in status and logs (unset: a fresh id at start)."
    )
    outage_s: float = Field(
        DEFAULT_OUTAGE_S,
        gt=0,
        description="How long the other roles wait through an outage of this broker (a restart) before they stop "
        "with an error. `primerl rl` hands it to every role (`<role>.broker.outage_s`).",
    )
    max_steps: int | None = Field(
        None, ge=1, description="Training steps of the run, shown in status (unset: no limit)."
    )
    log: DaemonLog
    prometheus: MetricsEndpoint

    @field_validator("advertise_host")
    @classmethod
    def _check_advertise_host(cls, host: str | None) -> str | None:
        return None if host is None else check_advertise_host(host, "broker.advertise_host")

    @model_validator(mode="after")
    def _check(self) -> BrokerConfig:
        problems = []
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            problems.append("set both `tls_cert_path` and `tls_key_path` for TLS, or neither")
        if self.tls_client_ca_path is not None and self.tls_cert_path is None:
            problems.append(
                "`tls_client_ca_path` (client certificates) needs TLS: set `tls_cert_path` and `tls_key_path` too"
            )
        if (self.curve_secret_key_path is None) != (self.curve_authorized_keys_dir is None):
            problems.append(
                "set both `curve_secret_key_path` and `curve_authorized_keys_dir` for CURVE on the ZeroMQ "
                "planes, or neither"
            )
        # $PRIMERL_RUN_TOKEN is how the daemons and `primerl rl` take the token without a file holding it
        token = self.run_token or os.environ.get(RUN_TOKEN_ENV)
        if token and len(token.encode()) > MAX_HANDSHAKE_TOKEN_BYTES:
            problems.append(
                f"`run_token` is {len(token.encode())} bytes long; the ZeroMQ handshake checks a token of at most "
                f"{MAX_HANDSHAKE_TOKEN_BYTES} bytes: use a shorter one (e.g. `openssl rand -hex 32`)"
            )
        if not is_loopback_host(self.host) and not token and not self.allow_remote_without_token:
            problems.append(
                f"host = {self.host!r} makes the broker reachable from other machines, so it needs credentials: "
                'set `run_token` (a shared secret that every worker also gets), or bind host = "127.0.0.1" '
                "(or, knowingly, set `allow_remote_without_token = true`)"
            )
        ports = {"grpc_port": self.grpc_port, "rollout_port": self.rollout_port, "weight_port": self.weight_port}
        if self.prometheus.enabled:
            ports["prometheus.port"] = self.prometheus.port
        used = [p for p in ports.values() if p != 0]
        if len(used) != len(set(used)):
            problems.append(f"{', '.join(ports)} must differ (or be 0), got {ports}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def resolved_max_transfer_bytes(self) -> int:
        """``max_transfer_bytes``, or its default for this machine: a quarter of physical memory, at most 16 GiB."""
        if self.max_transfer_bytes is not None:
            return self.max_transfer_bytes
        return max(MiB, min(16 * GiB, physical_memory_bytes() // 4))

    @property
    def resolved_max_rollout_message_bytes(self) -> int:
        """The rollout socket's message cap: ``max_rollout_message_bytes``, at most ``max_message_bytes``."""
        return min(self.max_rollout_message_bytes, self.max_message_bytes)

    @property
    def resolved_max_open_transfer_bytes(self) -> int:
        """``max_open_transfer_bytes``, or ``resolved_max_transfer_bytes`` when unset."""
        if self.max_open_transfer_bytes is not None:
            return self.max_open_transfer_bytes
        return self.resolved_max_transfer_bytes

    @property
    def client_host(self) -> str:
        """Host that clients on this machine use to reach the broker (a wildcard bind is reached on loopback)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host

    @property
    def endpoint_host(self) -> str:
        """Host put into the ZeroMQ endpoints handed to registering workers: ``advertise_host``, else ``host``
        (a wildcard stays a wildcard: ``primerl.runtime.addresses.dialable_endpoint`` makes each worker replace
        it with the host it dialed the broker at)."""
        return self.advertise_host or self.host

    @property
    def grpc_address(self) -> str:
        """``host:port`` of the gRPC server, as clients on this machine dial it."""
        return f"{self.client_host}:{self.grpc_port}"
