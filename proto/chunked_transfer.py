"""Chunked transfers of the data plane: one payload split into several messages, and their reassembly.

A payload larger than a sender's chunk size travels as one transfer: ``encode_chunked`` yields messages of
at most ``chunk_bytes`` payload each, every one carrying the same header and an ``Envelope.chunk`` with the
transfer id, its index, the count and the transfer's total bytes. A receiver decodes each message with
``framing.decode`` and hands it to a ``ChunkAssembler``, which joins the chunks again, in order, within
bounds on bytes, open transfers and time, and checks the whole tensor payload once it is complete.

A ``ChunkAssembler(zero_copy=True)`` joins nothing: it keeps the received chunk frames as they are (read-only
views, in order) and hands the whole message back with one payload frame per chunk. That is what a relay wants
(the broker forwards the frames it received, and stores them), where a copy into one buffer would cost a pass
over the payload and a second copy of it in memory.

The wire format of each message is ``framing``'s; this module only adds the split and the reassembly.
"""

from __future__ import annotations

import mmap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message as ProtoMessage

from primerl.proto.digests import PayloadHasher
from primerl.proto.framing import (
    DEFAULT_LIMITS,
    TENSOR_MESSAGE_TYPES,
    BadChunk,
    Busy,
    FramingError,
    Limits,
    MalformedHeader,
    Message,
    OversizedFrame,
    TensorMismatch,
    TruncatedMessage,
    check_tensor_payload,
    encode,
)
from primerl.proto.tensor_frames import MAX_HEADER_BYTES, TensorFrameError, byte_view, check_tensor_frame
from primerl.proto.v1 import data_pb2


def encode_chunked(
    message_type: int,
    header: ProtoMessage,
    payload: Any,
    *,
    chunk_bytes: int,
    transfer_id: str | None = None,
    ready: Callable[[int], None] | None = None,
    digest: PayloadHasher | None = None,
    **envelope_fields: Any,
) -> Iterator[list[Any]]:
    """Split one payload (bytes-like) into messages of at most ``chunk_bytes`` payload each.

    Yields the frames of each message; every chunk repeats the header so a receiver can refuse a
    transfer at its first chunk. Slices are views: nothing is copied here.

    A streamed payload (still being written while its first chunks go out): ``ready(end)`` is called before a
    chunk is cut and returns once the payload's first ``end`` bytes are final; ``digest`` is fed each chunk in the
    pass of its checksum, and its ``hexdigest()`` goes with the last chunk as ``Chunk.payload_digest`` (the digest
    that follows; the header's is left empty).
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = byte_view(payload)
    total = view.nbytes
    count = max(1, -(-total // chunk_bytes))
    transfer_id = transfer_id or uuid.uuid4().hex
    if digest is not None and count == 1:
        # One message is no transfer, and has no last chunk for a digest to follow in: it waits for its bytes.
        if ready is not None:
            ready(total)
        digest.update(view)
        header = type(header).FromString(header.SerializeToString())
        header.digest = digest.hexdigest()  # type: ignore[attr-defined]
        ready = digest = None
    for index in range(count):
        start, end = min(total, index * chunk_bytes), min(total, (index + 1) * chunk_bytes)
        if ready is not None:
            ready(end)
        piece = view[start:end]
        chunk = data_pb2.Chunk(transfer_id=transfer_id, index=index, count=count, total_bytes=total)
        frames = encode(message_type, header, [piece], chunk=chunk, also=digest, **envelope_fields)
        if digest is not None and index == count - 1:
            frames = _with_payload_digest(frames, digest.hexdigest())
        yield frames


def _with_payload_digest(frames: list[Any], digest: str) -> list[Any]:
    """``frames`` of a last chunk with ``Chunk.payload_digest`` set (the envelope is not covered by the checksum)."""
    envelope = data_pb2.Envelope.FromString(frames[2])
    envelope.chunk.payload_digest = digest
    return [frames[0], frames[1], envelope.SerializeToString(), *frames[3:]]


def settle_payload_digest(header: ProtoMessage, last_chunk: data_pb2.Chunk) -> None:
    """A streamed WEIGHT_UPDATE transfer (its header's digest empty) takes the digest its last chunk carries
    (``Chunk.payload_digest``). Headers without a ``digest`` field, or with one set, are left as they are."""
    if isinstance(header, data_pb2.WeightUpdateHeader) and not header.digest and last_chunk.payload_digest:
        header.digest = last_chunk.payload_digest


@dataclass
class _Transfer:
    first: Message
    total_bytes: int
    # bytearray, or an anonymous mmap whose pages are only touched as chunks arrive; None when zero-copy
    buffer: Any = None
    # zero-copy: the chunks' payload frames as received, in order
    segments: list[memoryview] | None = None
    publisher: Any = None
    next_index: int = 0
    num_bytes: int = 0
    started_s: float = field(default_factory=time.monotonic)
    last_chunk_s: float = field(default_factory=time.monotonic)


LAZY_BUFFER_MIN_BYTES = 1 << 20


def segments_head(segments: list[memoryview], num_bytes: int) -> memoryview:
    """The first ``num_bytes`` of a payload held as ``segments`` (fewer if it is shorter): a view of the first
    segment when it holds them, else a copy of just those bytes."""
    if not segments or segments[0].nbytes >= num_bytes:
        return segments[0][:num_bytes] if segments else memoryview(b"")
    head = bytearray()
    for segment in segments:
        head += segment[: num_bytes - len(head)]
        if len(head) >= num_bytes:
            break
    return memoryview(bytes(head))


def check_segmented_tensor_payload(message: Message) -> None:
    """``framing.check_tensor_payload`` for a whole message whose payload frames are the segments of one
    safetensors blob (a zero-copy transfer)."""
    segments = message.payload
    total = sum(segment.nbytes for segment in segments)
    if not segments:
        raise MalformedHeader(f"{message.type_name} carries no payload")
    prefix = segments_head(segments, 8)
    header_len = int.from_bytes(prefix, "little") if prefix.nbytes == 8 else 0
    try:
        head = segments_head(segments, 8 + min(header_len, MAX_HEADER_BYTES + 1))
        check_tensor_frame(head, message.header.tensors, total_bytes=total)
    except TensorFrameError as exc:
        error_class = TruncatedMessage if exc.truncated else (TensorMismatch if exc.mismatch else MalformedHeader)
        raise error_class(f"{message.type_name}: {exc}") from None


def _transfer_buffer(num_bytes: int) -> Any:
    """A writable buffer of ``num_bytes``; above 1 MiB an anonymous mmap, so memory is committed only as
    chunks are written into it (a first chunk that declares 1 GiB costs nothing until the bytes come)."""
    if num_bytes < LAZY_BUFFER_MIN_BYTES:
        return bytearray(num_bytes)
    return mmap.mmap(-1, num_bytes)


class ChunkAssembler:
    """Joins the chunks of transfers, in order, within bounds on bytes, open transfers and time.

    ``add`` returns the whole message once its last chunk arrives (payload = one frame with all bytes),
    ``None`` while chunks are missing, and raises ``BadChunk`` (dropping the transfer) on a chunk that is
    out of order, duplicated or inconsistent with the first one.

    Bounds, all checked at a transfer's first chunk, before any memory is set aside:
    - its declared ``total_bytes`` <= ``limits.max_transfer_bytes`` (``OversizedFrame``);
    - one publisher (``add(..., publisher=)``, e.g. the ZeroMQ routing id) has at most
      ``max_open_per_publisher`` transfers open: a new one replaces that publisher's oldest;
    - at most ``max_open_transfers`` open in all (``BadChunk``) and their declared bytes together at most
      ``max_open_bytes`` (``Busy``: retry later), so total reassembly memory is bounded;
    - a transfer with no chunk for ``stall_timeout_s`` (or open longer than ``timeout_s``) is dropped by
      ``expire`` (also called at each new transfer), so a stalled peer cannot hold a slot for long.

    ``zero_copy``: keep the chunk frames instead of joining them (module docstring); the whole message has one
    payload frame per chunk, and ``received(key)`` gives the frames received so far of an open transfer.
    """

    def __init__(
        self,
        *,
        limits: Limits = DEFAULT_LIMITS,
        max_open_transfers: int = 4,
        timeout_s: float = 60.0,
        stall_timeout_s: float | None = None,
        max_open_bytes: int | None = None,
        max_open_per_publisher: int | None = None,
        zero_copy: bool = False,
    ):
        self.limits = limits
        self.max_open_transfers = max_open_transfers
        self.timeout_s = timeout_s
        self.stall_timeout_s = timeout_s if stall_timeout_s is None else stall_timeout_s
        self.max_open_bytes = limits.max_transfer_bytes if max_open_bytes is None else max_open_bytes
        self.max_open_per_publisher = max_open_per_publisher
        self.zero_copy = zero_copy
        self._transfers: dict[tuple[str, str], _Transfer] = {}

    def is_open(self, key: tuple[str, str]) -> bool:
        """Whether the transfer ``(sender, transfer_id)`` is still being assembled."""
        return key in self._transfers

    @property
    def num_open_transfers(self) -> int:
        return len(self._transfers)

    def received(self, key: tuple[str, str]) -> list[memoryview]:
        """The payload frames received so far of the open zero-copy transfer ``key`` (empty: none open)."""
        transfer = self._transfers.get(key)
        return [] if transfer is None or transfer.segments is None else transfer.segments

    def add(self, message: Message, publisher: Any = None) -> Message | None:
        chunk = message.envelope.chunk
        if chunk.count <= 1:
            return message
        key = (message.envelope.sender, chunk.transfer_id)
        publisher = message.envelope.sender if publisher is None else publisher
        transfer = self._transfers.get(key)
        if transfer is None:
            if chunk.index != 0:
                raise BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} arrived before chunk 0")
            if chunk.total_bytes > self.limits.max_transfer_bytes:
                raise OversizedFrame(
                    f"transfer of {chunk.total_bytes} bytes exceeds the limit of {self.limits.max_transfer_bytes}"
                )
            self.expire()
            if self.max_open_per_publisher is not None:
                own = [k for k, t in self._transfers.items() if t.publisher == publisher]
                for old in own[: max(0, len(own) - self.max_open_per_publisher + 1)]:
                    del self._transfers[old]  # insertion order: the oldest first
            if len(self._transfers) >= self.max_open_transfers:
                raise BadChunk(f"too many open transfers ({len(self._transfers)}); finish or abandon one first")
            open_bytes = sum(t.total_bytes for t in self._transfers.values())
            if open_bytes + chunk.total_bytes > self.max_open_bytes:
                raise Busy(
                    f"transfers being received already declare {open_bytes} bytes; {chunk.total_bytes} more would "
                    f"exceed the broker's {self.max_open_bytes} (max_open_transfer_bytes): retry later",
                    retry_after_ms=1000,
                )
            if self.zero_copy:
                transfer = _Transfer(first=message, total_bytes=chunk.total_bytes, segments=[], publisher=publisher)
            else:
                transfer = _Transfer(
                    first=message,
                    total_bytes=chunk.total_bytes,
                    buffer=_transfer_buffer(chunk.total_bytes),
                    publisher=publisher,
                )
            self._transfers[key] = transfer
        first = transfer.first.envelope
        try:
            if chunk.index != transfer.next_index:
                raise BadChunk(f"transfer {chunk.transfer_id}: expected chunk {transfer.next_index}, got {chunk.index}")
            if chunk.count != first.chunk.count or chunk.total_bytes != first.chunk.total_bytes:
                raise BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} changes the count or total size")
            if message.type != transfer.first.type or message.envelope.header != first.header:
                raise BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} carries a different header")
            piece = message.payload[0]
            end = transfer.num_bytes + piece.nbytes
            if end > transfer.total_bytes:
                raise BadChunk(f"transfer {chunk.transfer_id}: chunks exceed the declared {transfer.total_bytes} bytes")
            if transfer.segments is not None:
                transfer.segments.append(piece.toreadonly())
            else:
                transfer.buffer[transfer.num_bytes : end] = piece
        except FramingError:
            del self._transfers[key]
            raise
        transfer.num_bytes = end
        transfer.next_index += 1
        transfer.last_chunk_s = time.monotonic()
        if transfer.next_index < chunk.count:
            return None
        del self._transfers[key]
        if transfer.num_bytes != transfer.total_bytes:
            raise TruncatedMessage(
                f"transfer {chunk.transfer_id}: {transfer.num_bytes} of {transfer.total_bytes} bytes arrived"
            )
        settle_payload_digest(transfer.first.header, chunk)
        if transfer.segments is not None:
            whole = Message(type=message.type, header=transfer.first.header, envelope=first, payload=transfer.segments)
            if whole.type in TENSOR_MESSAGE_TYPES:
                check_segmented_tensor_payload(whole)
            return whole
        whole = Message(
            type=message.type, header=transfer.first.header, envelope=first, payload=[memoryview(transfer.buffer)]
        )
        if whole.type in TENSOR_MESSAGE_TYPES:
            check_tensor_payload(whole)
        return whole

    def expire(self, now_s: float | None = None) -> list[str]:
        """Drop transfers open longer than ``timeout_s`` or without a chunk for ``stall_timeout_s``; returns
        their transfer ids."""
        now_s = time.monotonic() if now_s is None else now_s
        stale = [
            key
            for key, t in self._transfers.items()
            if now_s - t.started_s > self.timeout_s or now_s - t.last_chunk_s > self.stall_timeout_s
        ]
        for key in stale:
            del self._transfers[key]
        return [transfer_id for _, transfer_id in stale]
