"""The trainer's client of the broker's weight plane: ``WeightPublisher`` sends one update and waits for the broker
to store it. It owns one DEALER socket (``client.dealer.DealerClient``) and must be used from one thread.

Broker outages: the publisher watches its connection (a ZMQ socket monitor): a publish fails at once, with
``WeightBrokerLost`` (a ``WeightPublishTimeout``), when the connection drops while it waits or when no connection is
up within ``connect_timeout_s``; the caller (``primerl.trainer.publish``) retries it through the outage. Chunk sizes
must fit ``limits`` (the broker's, ``BrokerLimits.frames`` of its ``RegisterResponse``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from primerl.client.dealer import DealerClient
from primerl.proto import chunked_transfer, framing
from primerl.proto.data_plane_limits import DEFAULT_BROKER_LIMITS
from primerl.proto.digests import new_hasher, payload_digest
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import LineageSuperseded, WeightUpdateRefused
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import CurveClient

log = get_logger(__name__)

CONNECT_TIMEOUT_S = 2.0
"""How long a publish waits for a connection to the broker before it fails as ``WeightBrokerLost``."""


class WeightPublishTimeout(TimeoutError):
    """No WEIGHT_ACK from the broker within the timeout (the transfer is abandoned)."""


class WeightBrokerLost(WeightPublishTimeout):
    """The connection to the broker dropped during a publish, or none came up in time (the transfer is abandoned;
    the broker may be restarting: send it again once it is back)."""


def _to_view(payload: Any) -> memoryview:
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _header_to_send(
    header: data_pb2.WeightUpdateHeader,
    view: memoryview,
    *,
    streamed: bool,
    shared: data_pb2.SharedSegment | None,
) -> data_pb2.WeightUpdateHeader:
    """A copy of ``header`` as `WeightPublisher.publish` sends it: digest and size filled in (a streamed payload's
    digest follows it), the shared segment set."""
    out = data_pb2.WeightUpdateHeader()
    out.CopyFrom(header)
    if shared is not None:
        if streamed:
            raise ValueError("a payload handed over in shared memory must be complete before it is published")
        out.shared_segment.CopyFrom(shared)
    if streamed:
        if out.digest:
            raise ValueError("a streamed payload's digest follows it: leave header.digest empty")
    elif not out.digest:
        out.digest = payload_digest(view)
    if not out.payload_bytes:
        out.payload_bytes = view.nbytes
    return out


class WeightPublisher(DealerClient):
    """The trainer's side: ``publish()`` one update and wait for the broker to store it. ``chunk_bytes``: payload
    bytes per chunk, at most ``limits.max_frame_bytes`` (the broker's ``weight_chunk_bytes``)."""

    # The connection is watched: a publish fails at once when it drops or the broker refuses it at the handshake
    # (module docstring). It counts as up once its handshake succeeded, not at the TCP connect: a connection that
    # closes during the handshake (e.g. the broker closed it first on a mechanism mismatch, which the handshake
    # watch of ``DealerClient`` then reports on the next attempt) is one libzmq retries, not a dropped one.
    MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    plane = "weight"

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        sender: str,
        chunk_bytes: int,
        *,
        context: zmq.Context | None = None,
        limits: framing.Limits = DEFAULT_BROKER_LIMITS.frames,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        curve: CurveClient | None = None,
    ):
        if chunk_bytes <= 0 or chunk_bytes > limits.max_frame_bytes:
            raise ValueError(f"chunk_bytes must be in 1..{limits.max_frame_bytes}, got {chunk_bytes}")
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self.chunk_bytes = chunk_bytes
        self.connect_timeout_s = connect_timeout_s
        self._connected = False
        self._dropped = False  # the connection dropped since the current publish began
        self._refused = False  # the broker refused the connection at the handshake
        super().__init__(endpoint, auth_token, sender, limits=limits, context=context, curve=curve)

    def _open(self) -> None:
        super()._open()
        self._connected, self._dropped, self._refused = False, False, False

    def _track_connection(self, events: Sequence[int]) -> None:
        for event in events:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected, self._dropped = False, True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._connected, self._dropped, self._refused = False, True, True

    def _on_monitor_events(self, events: Sequence[int], deadline_s: float) -> bool:
        """Raises ``WeightBrokerLost`` as soon as the connection drops (or is refused at the handshake) during a
        wait; libzmq does not retry a refused connection, the next publish opens a new one."""
        self._track_connection(events)
        if self._refused:
            raise self._refusal()
        if self._dropped:
            raise WeightBrokerLost(f"the connection to the broker at {self.endpoint} dropped{self.timeout_hint}")
        return False

    def _refusal(self) -> WeightBrokerLost:
        return WeightBrokerLost(
            f"the broker at {self.endpoint} refused this connection at the handshake: it has as many weight "
            "peers as broker.max_weight_connections admits"
        )

    def _refused_at_handshake(self, detail: common_pb2.ErrorDetail) -> Exception:
        return WeightUpdateRefused.from_detail(detail)

    def _await_connection(self, deadline_s: float) -> None:
        self._track_connection(self._read_monitor_events())
        connect_deadline_s = min(deadline_s, time.monotonic() + self.connect_timeout_s)
        while not self._connected:
            if self._refused:  # the refusal may have come before this wait began (e.g. while hashing the payload)
                raise self._refusal()
            assert self._monitor is not None
            if not self._monitor.poll(max(0, int((connect_deadline_s - time.monotonic()) * 1000)), zmq.POLLIN):
                raise WeightBrokerLost(
                    f"no connection to the broker at {self.endpoint} within "
                    f"{self.connect_timeout_s:g} s (is it running?){self.timeout_hint}"
                )
            self._track_connection(self._read_monitor_events())
        self._dropped = False

    def publish(
        self,
        header: data_pb2.WeightUpdateHeader,
        payload: Any,
        timeout_s: float = 120.0,
        *,
        ready: Callable[[int], None] | None = None,
        shared: data_pb2.SharedSegment | None = None,
    ) -> data_pb2.WeightAck:
        """Send one update (chunked, zero-copy) and return the broker's WEIGHT_ACK once it is stored.

        ``shared``: the payload lies whole in that shared-memory segment (``proto.shared_segment``; ``payload`` is a
        view of it): one message with the descriptor and no payload bytes goes instead of the chunks. A broker
        that cannot map it refuses it (``WeightUpdateRefused`` with ``ERROR_CODE_NOT_FOUND``): send the bytes then.

        Fills ``digest`` (``proto.digests``: XXH3-128) and ``payload_bytes`` when empty. Each chunk carries an XXH3-64
        checksum (``framing.XXH3_64``). Raises ``WeightUpdateRefused`` (with
        ``code`` and ``full_required``) when the broker refuses it (``LineageSuperseded`` when the broker holds a
        newer lineage than the header's), ``WeightPublishTimeout`` when no answer comes within ``timeout_s``, and
        ``WeightBrokerLost`` (a ``WeightPublishTimeout``) when the connection drops or is not up within
        ``connect_timeout_s``: sending the same update again is then safe (the broker acknowledges a resend of the
        latest update it holds). ``payload`` must not change until this returns.

        ``ready``: the payload is still being written (``trainer.payload_stream``): ``ready(end)`` returns once its
        first ``end`` bytes are final, and is called before each chunk is cut. The header's digest must then be
        empty: it is computed in the pass of each chunk's checksum and sent with the last chunk
        (``Chunk.payload_digest``).
        """
        assert not self.is_closed, "publisher is closed"
        deadline_s = time.monotonic() + timeout_s
        view = _to_view(payload)
        header_out = _header_to_send(header, view, streamed=ready is not None, shared=shared)
        streamed_digest = new_hasher() if ready is not None else None
        self._drain()
        transfer_id = uuid.uuid4().hex
        try:
            self._await_connection(deadline_s)
            for frames in chunked_transfer.encode_chunked(
                data_pb2.WEIGHT_UPDATE,
                header_out,
                view if shared is None else memoryview(b""),
                chunk_bytes=self.chunk_bytes,
                transfer_id=transfer_id,
                sender=self.sender,
                auth_token=self.auth_token or "",
                checksum_kind=framing.XXH3_64,
                ready=ready,
                digest=streamed_digest,
            ):
                # The broker refuses a bad transfer at its first chunk: stop sending the rest then.
                if self._socket.poll(0, zmq.POLLIN):
                    ack = self._read_reply(transfer_id, header_out.policy_version, deadline_s, header_out.lineage)
                    if ack is not None:
                        return ack
                if not self._send(frames, deadline_s):
                    raise WeightPublishTimeout(
                        f"could not send weight update v{header_out.policy_version} to "
                        f"{self.endpoint} within {timeout_s} s (broker unreachable?)"
                        f"{self.timeout_hint}"
                    )
            while True:
                ack = self._read_reply(transfer_id, header_out.policy_version, deadline_s, header_out.lineage)
                if ack is not None:
                    return ack
        except WeightBrokerLost:
            self._reopen()  # drop the chunks still queued so that the broker never completes an abandoned transfer
            raise
        except (WeightPublishTimeout, zmq.Again):
            self._reopen()
            raise WeightPublishTimeout(
                f"no WEIGHT_ACK for v{header_out.policy_version} from {self.endpoint} "
                f"within {timeout_s} s{self.timeout_hint}"
            ) from None

    def _read_reply(
        self, transfer_id: str, policy_version: int, deadline_s: float, lineage: int = 0
    ) -> data_pb2.WeightAck | None:
        """Read one reply (waiting until the deadline); the ack of this transfer, or None for anything else."""
        assert self._socket is not None
        if not self._wait(deadline_s, zmq.POLLIN):
            raise WeightPublishTimeout()
        message = self._decode(self._socket.recv_multipart(copy=False))
        if message is None:
            return None
        if message.type == data_pb2.ERROR:
            raise WeightUpdateRefused.from_detail(message.header.error)
        if message.type != data_pb2.WEIGHT_ACK or message.envelope.in_reply_to != transfer_id:
            log.debug("ignored a stale reply", type=message.type_name, in_reply_to=message.envelope.in_reply_to)
            return None
        ack: data_pb2.WeightAck = message.header
        if not ack.applied:
            if lineage and ack.lineage > lineage:
                raise LineageSuperseded.from_detail(ack.error, broker_lineage=ack.lineage)
            raise WeightUpdateRefused.from_detail(
                ack.error, full_required=ack.full_required, broker_lineage=ack.lineage
            )
        if ack.policy_version != policy_version:
            raise WeightUpdateRefused(
                common_pb2.ERROR_CODE_INTERNAL,
                f"broker acknowledged v{ack.policy_version} for a transfer of v{policy_version}",
            )
        return ack
