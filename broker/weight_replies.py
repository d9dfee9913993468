"""The weight plane's replies to its peers: queued by the handlers (at most ``max_pending``), sent by the IO thread
without blocking (``try_send``, the plane's one ROUTER send), ERROR replies counted."""

from __future__ import annotations

import collections
from typing import Any

import zmq

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.weight_intake import BROKER_SENDER
from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)


class PeerGone(Exception):
    """The peer of a ROUTER send is no longer connected."""


def try_send(socket: zmq.Socket, identity: bytes, frames: list[Any]) -> bool:
    """Send without blocking; False when the peer's pipe is full; raises ``PeerGone`` for a vanished peer."""
    try:
        socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            raise PeerGone() from None
        raise
    return True


class WeightReplies:
    """Replies waiting for the IO thread, in order. Used by the IO thread only (others may read the count)."""

    def __init__(self, auth_token: str | None, max_pending: int):
        self.auth_token = auth_token or None
        self.max_pending = max_pending
        self._pending: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self._guard_log = RateLimitedLog(log)
        self.num_errors_sent = 0

    def envelope(self, in_reply_to: str) -> dict[str, str]:
        """The envelope fields of what the plane sends (sender ``broker``, the run token)."""
        return {"sender": BROKER_SENDER, "auth_token": self.auth_token or "", "in_reply_to": in_reply_to}

    def queue(self, identity: bytes, frames: list[Any]) -> None:
        if len(self._pending) >= self.max_pending:
            self._guard_log.warning("reply queue full", "reply queue full; dropping a reply", peer=identity.hex())
            return
        self._pending.append((identity, frames))

    def ack(self, identity: bytes, ack: data_pb2.WeightAck, in_reply_to: str) -> None:
        self.queue(identity, framing.encode(data_pb2.WEIGHT_ACK, ack, **self.envelope(in_reply_to)))

    def count_error(self) -> None:
        """An ERROR went out in another form (a WEIGHT_ACK that refuses an update)."""
        self.num_errors_sent += 1

    def error(
        self, identity: bytes, detail: common_pb2.ErrorDetail, refused_type: int, *, in_reply_to: str = ""
    ) -> None:
        self.count_error()
        # No run token on ERROR replies: the peer may be one that failed to authenticate.
        self.queue(
            identity,
            framing.encode_error(detail, refused_type=refused_type, sender=BROKER_SENDER, in_reply_to=in_reply_to),
        )

    def refuse(
        self,
        identity: bytes,
        message: framing.Message,
        code: int,
        text: str,
        *,
        in_reply_to: str | None = None,
        retry_after_ms: int = 0,
    ) -> None:
        """Answer ``message`` with an ERROR (in reply to its message id unless ``in_reply_to`` says otherwise)."""
        detail = common_pb2.ErrorDetail(code=code, message=text, retry_after_ms=retry_after_ms)
        reply_to = message.envelope.message_id if in_reply_to is None else in_reply_to
        self.error(identity, detail, message.type, in_reply_to=reply_to)

    def flush(self, socket: zmq.Socket) -> tuple[bool, bool]:
        """Send what is pending, in order, until a peer's pipe is full; returns (sent any, blocked)."""
        sent_any = False
        for _ in range(len(self._pending)):
            identity, frames = self._pending[0]
            try:
                if not try_send(socket, identity, frames):
                    return sent_any, True
            except PeerGone:
                log.warning("reply dropped: peer is gone", peer=identity.hex())
            self._pending.popleft()
            sent_any = True
        return sent_any, False
