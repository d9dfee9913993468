"""The rollout plane's replies: sends that never block on a peer (an unreachable one is logged once), the
ErrorDetail of a refusal, the message id it can still read from a message that failed to decode, and the log
that says each kind of refusal once, then sums it up at intervals."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from google.protobuf.message import DecodeError

from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.broker.rollout_plane")

REFUSAL_SUMMARY_INTERVAL_S = 10.0
MAX_REFUSAL_KEYS = 1024
STALE_NOTE = -1  # pseudo error code for the log of stale (already committed) batches
SUPERSEDED_NOTE = -2  # pseudo error code for the log of batches of a step held whole from another producer
RETRY_SLEEP_S = 0.0005


class RefusalLog:
    """One log line per kind of refusal (error code), then a summary at most every few seconds."""

    def __init__(self) -> None:
        self._seen: dict[int, list[float | int]] = {}  # code -> [last_logged_s, num_since]

    def note(self, peer: str, code: int, message: str) -> None:
        key = code  # one line per kind of refusal, whichever peer (a peer can make many identities)
        now_s = time.monotonic()
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= MAX_REFUSAL_KEYS:
                self._seen.clear()
            self._seen[key] = [now_s, 0]
            log.warning(
                "rollout plane refused a message" if code >= 0 else "rollout plane note",
                peer=peer,
                code=code_name(code),
                reason=message,
            )
            return
        seen[1] += 1
        if now_s - seen[0] >= REFUSAL_SUMMARY_INTERVAL_S:
            log.warning(
                "rollout plane keeps refusing messages",
                peer=peer,
                code=code_name(code),
                num_refused_since_last_line=seen[1],
                last_reason=message,
            )
            seen[0], seen[1] = now_s, 0


class PeerSender:
    """Sends to the peers of one ROUTER socket without blocking; a peer that is gone or not reading is logged once
    (until a send to it succeeds again) and the send returns False. IO thread only."""

    def __init__(self, on_disconnected: Callable[[bytes], None], peer_name: Callable[[bytes], str]):
        self._on_disconnected = on_disconnected  # a peer's connection is gone (EHOSTUNREACH)
        self._peer_name = peer_name
        self._unreachable: set[bytes] = set()

    def reachable_again(self, routing_id: bytes) -> None:
        """The peer said hello again: wait for room in its pipe again, and log it again if it is unreachable."""
        self._unreachable.discard(routing_id)

    def send(self, socket: zmq.Socket, routing_id: bytes, frames: Sequence[Any], *, wait_s: float = 0.0) -> bool:
        """Send without blocking; a peer that is gone or not reading is logged (once) and False returned.

        ``wait_s``: how long to keep retrying while the peer's pipe is full (for acks, which leave in
        bursts after a group commit); never for a peer already found unreachable, so a stuck peer costs
        the IO thread this wait once, not per message."""
        deadline_s = time.monotonic() + wait_s if wait_s > 0 and routing_id not in self._unreachable else 0.0
        try:
            while True:
                try:
                    socket.send_multipart([routing_id, *frames], flags=zmq.NOBLOCK, copy=False)
                    self._unreachable.discard(routing_id)
                    return True
                except zmq.Again:
                    if time.monotonic() >= deadline_s:
                        raise
                    time.sleep(RETRY_SLEEP_S)
        except zmq.Again:
            reason = "its receive queue is full (high-water mark)"
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                raise
            if exc.errno == zmq.EHOSTUNREACH:
                reason = "it is disconnected"
                self._on_disconnected(routing_id)
            else:
                reason = f"send failed: {exc}"
        if routing_id not in self._unreachable:
            if len(self._unreachable) > MAX_REFUSAL_KEYS:
                self._unreachable.clear()
            self._unreachable.add(routing_id)
            log.warning(
                "rollout plane dropped a reply: peer unreachable", peer=self._peer_name(routing_id), reason=reason
            )
        return False


def error_detail(code: int, message: str, retry_after_ms: int = 0) -> common_pb2.ErrorDetail:
    return common_pb2.ErrorDetail(code=code, message=message, retry_after_ms=retry_after_ms)


def code_name(code: int) -> str:
    if code == STALE_NOTE:
        return "STALE_BATCH_ACKED"
    if code == SUPERSEDED_NOTE:
        return "SUPERSEDED_BATCH_ACKED"
    return common_pb2.ErrorCode.Name(code) if code in common_pb2.ErrorCode.values() else str(code)


def try_message_id(body: Sequence[Any], limits: framing.Limits) -> str:
    """The message id of a message that failed to decode, if its envelope parses (for ``in_reply_to``)."""
    if len(body) < framing.NUM_FIXED_FRAMES:
        return ""
    raw = body[2]
    view = memoryview(getattr(raw, "buffer", raw))
    if view.nbytes > limits.max_envelope_bytes:
        return ""
    envelope = data_pb2.Envelope()
    try:
        envelope.ParseFromString(view.tobytes())
    except DecodeError:
        return ""
    return envelope.message_id[:128]
