"""Clients of the broker's weight plane: ``WeightPublisher`` (trainer) and ``WeightSubscriber`` (inference).

Each owns one DEALER socket and must be used from one thread. Every wait has a timeout.

Auth: messages to the broker carry the run token; messages from the broker must carry it too, except ERROR
replies (the broker never puts its token in an ERROR, since the peer may be one that failed to authenticate).
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from primerl.broker.weight_store import WeightUpdateRefused, payload_digest
from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.zmq_sockets import connect_dealer

log = get_logger(__name__)

__all__ = ["WeightPublisher", "WeightSubscriber", "WeightPlaneError", "WeightPublishTimeout", "WeightUpdateRefused"]


class WeightPlaneError(RuntimeError):
    """The broker answered with an ERROR that the client cannot recover from (e.g. UNAUTHENTICATED)."""

    def __init__(self, detail: common_pb2.ErrorDetail):
        super().__init__(f"{common_pb2.ErrorCode.Name(detail.code)}: {detail.message}")
        self.code = detail.code
        self.detail = detail


class WeightPublishTimeout(TimeoutError):
    """No WEIGHT_ACK from the broker within the timeout (the transfer is abandoned)."""


def _decode(frames: list[Any], limits: framing.Limits, auth_token: str | None) -> framing.Message:
    message = framing.decode(frames, limits=limits, auth_token=None)
    if (message.type != data_pb2.ERROR and auth_token is not None
            and not hmac.compare_digest(message.envelope.auth_token.encode(), auth_token.encode())):
        raise framing.Unauthenticated("a message from the broker lacks the run token: is the broker's run token the same?")
    return message


def _to_view(payload: Any) -> memoryview:
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class WeightPublisher:
    """The trainer's side: ``publish()`` one update and wait for the broker to store it."""

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        sender: str,
        chunk_bytes: int,
        *,
        context: zmq.Context | None = None,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
    ):
        if chunk_bytes <= 0 or chunk_bytes > limits.max_frame_bytes:
            raise ValueError(f"chunk_bytes must be in 1..{limits.max_frame_bytes}, got {chunk_bytes}")
        self.endpoint = endpoint
        self.auth_token = auth_token
        self.sender = sender
        self.chunk_bytes = chunk_bytes
        self.limits = limits
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        self._socket = connect_dealer(self._context, self.endpoint, max_message_bytes=self.limits.max_frame_bytes)

    def publish(self, header: data_pb2.WeightUpdateHeader, payload: Any, timeout_s: float = 120.0) -> data_pb2.WeightAck:
        """Send one update (chunked, zero-copy) and return the broker's WEIGHT_ACK once it is stored.

        Fills ``digest`` (SHA-256 hex) and ``payload_bytes`` when empty. Raises ``WeightUpdateRefused`` (with
        ``code`` and ``full_required``) when the broker refuses it, ``WeightPublishTimeout`` when no answer
        comes within ``timeout_s``. ``payload`` must not change until this returns.
        """
        assert self._socket is not None, "publisher is closed"
        deadline_s = time.monotonic() + timeout_s
        view = _to_view(payload)
        header_out = data_pb2.WeightUpdateHeader()
        header_out.CopyFrom(header)
        if not header_out.digest:
            header_out.digest = payload_digest(view)
        if not header_out.payload_bytes:
            header_out.payload_bytes = view.nbytes
        self._drain_stale()
        transfer_id = uuid.uuid4().hex
        try:
            for frames in framing.encode_chunked(data_pb2.WEIGHT_UPDATE, header_out, view, chunk_bytes=self.chunk_bytes,
                                                 transfer_id=transfer_id, sender=self.sender,
                                                 auth_token=self.auth_token or ""):
                # The broker refuses a bad transfer at its first chunk: stop sending the rest then.
                if self._socket.poll(0, zmq.POLLIN):
                    ack = self._read_reply(transfer_id, header_out.policy_version, deadline_s)
                    if ack is not None:
                        return ack
                if not self._socket.poll(self._remaining_ms(deadline_s), zmq.POLLOUT):
                    raise WeightPublishTimeout(f"could not send weight update v{header_out.policy_version} to "
                                               f"{self.endpoint} within {timeout_s} s (broker unreachable?)")
                self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            while True:
                ack = self._read_reply(transfer_id, header_out.policy_version, deadline_s)
                if ack is not None:
                    return ack
        except (WeightPublishTimeout, zmq.Again):
            self._reset()  # drop the chunks still queued so that the broker never completes an abandoned transfer
            raise WeightPublishTimeout(f"no WEIGHT_ACK for v{header_out.policy_version} from {self.endpoint} "
                                       f"within {timeout_s} s") from None

    def _read_reply(self, transfer_id: str, policy_version: int, deadline_s: float) -> data_pb2.WeightAck | None:
        """Read one reply (waiting until the deadline); the ack of this transfer, or None for anything else."""
        assert self._socket is not None
        if not self._socket.poll(self._remaining_ms(deadline_s), zmq.POLLIN):
            raise WeightPublishTimeout()
        frames = self._socket.recv_multipart(copy=False)
        try:
            message = _decode(frames, self.limits, self.auth_token)
        except framing.FramingError as exc:
            log.warning("ignored an unreadable reply from the broker", error=str(exc))
            return None
        if message.type == data_pb2.ERROR:
            raise WeightUpdateRefused.from_detail(message.header.error)
        if message.type != data_pb2.WEIGHT_ACK or message.envelope.in_reply_to != transfer_id:
            log.debug("ignored a stale reply", type=message.type_name, in_reply_to=message.envelope.in_reply_to)
            return None
        ack: data_pb2.WeightAck = message.header
        if not ack.applied:
            raise WeightUpdateRefused.from_detail(ack.error, full_required=ack.full_required)
        if ack.policy_version != policy_version:
            raise WeightUpdateRefused(common_pb2.ERROR_CODE_INTERNAL,
                                      f"broker acknowledged v{ack.policy_version} for a transfer of v{policy_version}")
        return ack

    def _drain_stale(self) -> None:
        assert self._socket is not None
        while self._socket.poll(0, zmq.POLLIN):
            self._socket.recv_multipart(copy=False)

    def _reset(self) -> None:
        self.close()
        self._connect()

    @staticmethod
    def _remaining_ms(deadline_s: float) -> int:
        return max(0, int((deadline_s - time.monotonic()) * 1000))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _InPlaceTransfer:
    """The one chunked update being received straight into a caller's buffer (``WeightSubscriber`` with
    ``payload_buffer``): the same checks as ``framing.ChunkAssembler`` (chunks in order, one header, the declared
    size, a time bound), without its intermediate ``bytearray``."""

    def __init__(self, first: framing.Message, buffer: memoryview, timeout_s: float):
        chunk = first.envelope.chunk
        if buffer.nbytes != chunk.total_bytes:
            raise ValueError(f"payload_buffer gave {buffer.nbytes} bytes for a {chunk.total_bytes}-byte transfer")
        self.first = first
        self.key = (first.envelope.sender, chunk.transfer_id)
        self.buffer = buffer
        self.num_bytes = 0
        self.next_index = 0
        self.deadline_s = time.monotonic() + timeout_s

    def add(self, message: framing.Message) -> framing.Message | None:
        """Write one chunk; the whole message once the last one is in, else None. ``BadChunk`` when it does not
        continue this transfer."""
        chunk, first = message.envelope.chunk, self.first.envelope
        if chunk.index != self.next_index:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: expected chunk {self.next_index}, got {chunk.index}")
        if chunk.count != first.chunk.count or chunk.total_bytes != first.chunk.total_bytes:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} changes the count or total size")
        if message.type != self.first.type or message.envelope.header != first.header:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} carries a different header")
        piece = message.payload[0]
        end = self.num_bytes + piece.nbytes
        if end > self.buffer.nbytes:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunks exceed the declared {self.buffer.nbytes} bytes")
        self.buffer[self.num_bytes:end] = piece
        self.num_bytes = end
        self.next_index += 1
        if self.next_index < chunk.count:
            return None
        if self.num_bytes != self.buffer.nbytes:
            raise framing.TruncatedMessage(f"transfer {chunk.transfer_id}: {self.num_bytes} of {self.buffer.nbytes} "
                                           "bytes arrived")
        whole = framing.Message(type=message.type, header=self.first.header, envelope=first, payload=[self.buffer])
        framing.check_tensor_payload(whole)
        return whole


class WeightSubscriber:
    """The inference worker's side: ``hello()``, then ``receive()`` updates and ``ack()`` each one.

    ``receive`` returns whole updates (chunks reassembled, digest checked when ``verify_digest``), skips
    (and re-acknowledges) updates not newer than the version held, and says HELLO again every
    ``hello_interval_s`` and when the broker no longer knows this worker (e.g. after a broker restart).

    ``verify_digest`` is off by default: the broker checked the SHA-256 of exactly the bytes it forwards
    (a read-only view), and every chunk carries a CRC-32 that ``framing.decode`` checks, so a second SHA-256
    here (~0.6 ms per MiB on this CPU) only guards against a faulty broker; turn it on where that matters.

    ``payload_buffer(num_bytes) -> memoryview``: where a chunked update is assembled (e.g. the inference worker's
    shared payload file), instead of a new ``bytearray`` per update; the payload ``receive`` returns is then a view
    of it, valid until the next ``receive``. One chunked transfer is received at a time (the broker sends a
    worker's updates one after the other); a new one replaces an unfinished one.
    """

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None,
        worker_id: str,
        *,
        context: zmq.Context | None = None,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
        verify_digest: bool = False,
        hello_interval_s: float = 5.0,
        transfer_timeout_s: float = 300.0,
        payload_buffer: Callable[[int], memoryview] | None = None,
    ):
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        self.endpoint = endpoint
        self.auth_token = auth_token
        self.worker_id = worker_id
        self.limits = limits
        self.verify_digest = verify_digest
        self.hello_interval_s = hello_interval_s
        self.current_version: int | None = None
        self._assembler = framing.ChunkAssembler(limits=limits, max_open_transfers=2, timeout_s=transfer_timeout_s)
        self.transfer_timeout_s = transfer_timeout_s
        self._payload_buffer = payload_buffer
        self._in_place: _InPlaceTransfer | None = None
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket | None = connect_dealer(self._context, endpoint, max_message_bytes=limits.max_frame_bytes)
        self._hello_sent_s: float | None = None

    def hello(self, current_version: int | None = None) -> None:
        """Tell the broker who this worker is and which version it holds (None: none)."""
        self.current_version = current_version
        self._send_hello()

    def _send_hello(self) -> None:
        hello = data_pb2.Hello(worker_id=self.worker_id, role=common_pb2.ROLE_INFERENCE)
        if self.current_version is not None:
            hello.policy_version = self.current_version
        self._send(framing.encode(data_pb2.HELLO, hello, sender=self.worker_id, auth_token=self.auth_token or ""))
        self._hello_sent_s = time.monotonic()

    def receive(self, timeout_s: float) -> tuple[data_pb2.WeightUpdateHeader, memoryview] | None:
        """The next whole update as (header, payload view), or None when none arrives within ``timeout_s``.

        Raises ``WeightPlaneError`` when the broker refuses this worker (e.g. a wrong run token).
        """
        assert self._socket is not None, "subscriber is closed"
        deadline_s = time.monotonic() + timeout_s
        while True:
            now_s = time.monotonic()
            if self._hello_sent_s is not None and now_s - self._hello_sent_s >= self.hello_interval_s:
                self._send_hello()
            remaining_s = deadline_s - now_s
            if remaining_s <= 0:
                return None
            wait_s = remaining_s if self._hello_sent_s is None else min(remaining_s, self.hello_interval_s)
            if not self._socket.poll(max(1, int(wait_s * 1000)), zmq.POLLIN):
                continue
            update = self._handle(self._socket.recv_multipart(copy=False))
            if update is not None:
                return update

    def _handle(self, frames: list[Any]) -> tuple[data_pb2.WeightUpdateHeader, memoryview] | None:
        try:
            message = _decode(frames, self.limits, self.auth_token)
        except framing.FramingError as exc:
            log.warning("ignored an unreadable message from the broker", error=str(exc))
            return None
        if message.type == data_pb2.ERROR:
            detail = message.header.error
            if detail.code == common_pb2.ERROR_CODE_UNKNOWN_WORKER:
                log.info("broker does not know this worker; saying hello again", worker_id=self.worker_id)
                self._send_hello()
                return None
            raise WeightPlaneError(detail)
        if message.type != data_pb2.WEIGHT_UPDATE:
            log.debug("ignored a message", type=message.type_name)
            return None
        if self._payload_buffer is not None and message.is_chunk:
            whole = self._add_in_place(message)
            if whole is None:
                return None
        else:
            whole = self._assemble(message)
            if whole is None:
                return None
        header: data_pb2.WeightUpdateHeader = whole.header
        payload = whole.payload[0]
        if self.current_version is not None and header.policy_version <= self.current_version:
            log.debug("skipped an update not newer than the version held", policy_version=header.policy_version,
                      current_version=self.current_version)
            self.ack(self.current_version)
            return None
        if self.verify_digest and payload_digest(payload) != header.digest.lower():
            log.warning("weight update failed its digest check", policy_version=header.policy_version)
            self.ack(header.policy_version, applied=False, error=common_pb2.ErrorDetail(
                code=common_pb2.ERROR_CODE_BAD_DIGEST, message="SHA-256 of the received payload does not match the header"))
            return None
        return header, payload

    def _add_in_place(self, message: framing.Message) -> framing.Message | None:
        """A chunk of an update assembled in ``payload_buffer``: the whole message, or None (incomplete or dropped)."""
        chunk = message.envelope.chunk
        transfer = self._in_place
        if transfer is not None and time.monotonic() > transfer.deadline_s:
            log.warning("incomplete weight transfer expired", transfer_id=transfer.key[1])
            transfer = self._in_place = None
        try:
            if chunk.index == 0:
                # A new transfer (or one resent under its id) replaces an unfinished one: the broker sends one at a time.
                if chunk.total_bytes > self.limits.max_transfer_bytes:
                    raise framing.OversizedFrame(f"transfer of {chunk.total_bytes} bytes exceeds "
                                                 f"{self.limits.max_transfer_bytes}")
                self._in_place = None
                transfer = self._in_place = _InPlaceTransfer(message, self._payload_buffer(chunk.total_bytes),
                                                             self.transfer_timeout_s)
            elif transfer is None or transfer.key != (message.envelope.sender, chunk.transfer_id):
                log.warning("dropped a chunk of an abandoned transfer", transfer_id=chunk.transfer_id)
                return None
            whole = transfer.add(message)
        except framing.FramingError as exc:
            self._in_place = None
            log.warning("dropped a weight transfer", error=str(exc))
            return None
        if whole is not None:
            self._in_place = None
        return whole

    def _assemble(self, message: framing.Message) -> framing.Message | None:
        try:
            whole = self._assembler.add(message)
        except framing.BadChunk:
            if message.envelope.chunk.index != 0:
                log.warning("dropped a chunk of an abandoned transfer", transfer_id=message.envelope.chunk.transfer_id)
                return None
            # A resent transfer reuses its id: the stale partial one is gone now, start again.
            whole = self._assembler.add(message)
        except framing.FramingError as exc:
            log.warning("dropped a weight transfer", error=str(exc))
            return None
        return whole

    def ack(self, version: int, applied: bool = True, error: common_pb2.ErrorDetail | None = None, apply_ms: int = 0) -> None:
        """Report an update as applied (the worker now serves ``version``) or failed (``applied=False``).

        After a failure the worker's state counts as unknown: the broker resends the full snapshot and the
        deltas after it, and this subscriber passes them all on (it skips nothing until the next applied ack).
        """
        ack = data_pb2.WeightAck(policy_version=version, worker_id=self.worker_id, applied=applied, apply_ms=apply_ms)
        if error is not None:
            ack.error.CopyFrom(error)
        self.current_version = version if applied else None
        self._send(framing.encode(data_pb2.WEIGHT_ACK, ack, sender=self.worker_id, auth_token=self.auth_token or ""))

    def _send(self, frames: list[Any], timeout_s: float = 5.0) -> None:
        assert self._socket is not None, "subscriber is closed"
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise TimeoutError(f"could not send to the broker at {self.endpoint} within {timeout_s} s")
        self._socket.send_multipart(frames, zmq.NOBLOCK)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
