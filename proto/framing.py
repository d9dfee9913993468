"""The one module that reads and writes primerl's ZMQ multipart messages (the data plane).

Layout of one message (DESIGN.md, "Wire contracts"; headers in proto/primerl/v1/data.proto):

    frame 0   PROTOCOL_ID + one version byte
    frame 1   message type, one byte (a ``MessageType`` value)
    frame 2   ``Envelope`` protobuf; its ``header`` field holds the type-specific header
    frame 3+  payload frames: safetensors bytes, or chunks of one safetensors blob

Decoding never unpickles and never trusts a length it has not checked: every refusal is a
``FramingError`` subclass carrying the ``ErrorCode`` to send back in an ERROR reply.
Payloads larger than a sender's chunk size travel as several messages of one transfer: the split and the
reassembly are ``chunked_transfer``'s (``encode_chunked``, ``ChunkAssembler``); here each chunk is one message.
"""

from __future__ import annotations

import hmac
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import xxhash
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from primerl.proto.tensor_frames import TensorFrameError, byte_view, check_tensor_frame
from primerl.proto.units import GiB, MiB
from primerl.proto.v1 import common_pb2, data_pb2

PROTOCOL_ID = b"PRML"
PROTOCOL_VERSION = 1
PROTOCOL_FRAME = PROTOCOL_ID + bytes([PROTOCOL_VERSION])
NUM_FIXED_FRAMES = 3

MessageType = data_pb2.MessageType
ErrorCode = common_pb2.ErrorCode
CRC32 = data_pb2.CHECKSUM_KIND_CRC32
XXH3_64 = data_pb2.CHECKSUM_KIND_XXH3_64

HEADER_TYPES: dict[int, type[ProtoMessage]] = {
    data_pb2.ROLLOUT_BATCH: data_pb2.RolloutBatchHeader,
    data_pb2.ROLLOUT_ACK: data_pb2.RolloutAck,
    data_pb2.ROLLOUT_REQUEST: data_pb2.RolloutRequest,
    data_pb2.ROLLOUT_STEP_DONE: data_pb2.RolloutStepDone,
    data_pb2.WEIGHT_UPDATE: data_pb2.WeightUpdateHeader,
    data_pb2.WEIGHT_ACK: data_pb2.WeightAck,
    data_pb2.ERROR: data_pb2.ErrorReply,
    data_pb2.HELLO: data_pb2.Hello,
}
# Types whose payload is one safetensors blob described by the header's `tensors` field.
TENSOR_MESSAGE_TYPES = frozenset({data_pb2.ROLLOUT_BATCH, data_pb2.WEIGHT_UPDATE})


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts; anything larger is refused with ERROR_CODE_OVERSIZED."""

    max_frame_bytes: int = 256 * MiB
    max_message_bytes: int = 512 * MiB
    max_envelope_bytes: int = 1 * MiB
    max_payload_frames: int = 64
    # A chunked transfer may be larger than one message, up to this.
    max_transfer_bytes: int = 16 * GiB


DEFAULT_LIMITS = Limits()


class FramingError(ValueError):
    """A message that breaks the protocol. ``code`` goes into the ERROR reply; each subclass names its code
    (``class X(FramingError, code=...)``)."""

    code: int = common_pb2.ERROR_CODE_MALFORMED_HEADER

    def __init_subclass__(cls, code: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code

    def detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(code=self.code, message=str(self))


class TruncatedMessage(FramingError, code=common_pb2.ERROR_CODE_TRUNCATED): ...


class UnknownProtocol(FramingError, code=common_pb2.ERROR_CODE_UNKNOWN_PROTOCOL): ...


class UnsupportedVersion(FramingError, code=common_pb2.ERROR_CODE_UNSUPPORTED_VERSION): ...


class UnknownMessageType(FramingError, code=common_pb2.ERROR_CODE_UNKNOWN_MESSAGE_TYPE): ...


class ChecksumMismatch(FramingError, code=common_pb2.ERROR_CODE_BAD_CHECKSUM): ...


class OversizedFrame(FramingError, code=common_pb2.ERROR_CODE_OVERSIZED): ...


class MalformedHeader(FramingError, code=common_pb2.ERROR_CODE_MALFORMED_HEADER): ...


class TensorMismatch(FramingError, code=common_pb2.ERROR_CODE_TENSOR_MISMATCH): ...


class BadChunk(FramingError, code=common_pb2.ERROR_CODE_BAD_CHUNK): ...


class Unauthenticated(FramingError, code=common_pb2.ERROR_CODE_UNAUTHENTICATED): ...


class Busy(FramingError, code=common_pb2.ERROR_CODE_BACKPRESSURE):
    """Not now: the receiver is at a memory bound; the sender may retry after ``retry_after_ms``."""

    def __init__(self, message: str, retry_after_ms: int = 1000):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

    def detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(code=self.code, message=str(self), retry_after_ms=self.retry_after_ms)


@dataclass
class Message:
    """A decoded message. ``payload`` frames are zero-copy views of the received frames."""

    type: int
    header: Any
    envelope: data_pb2.Envelope
    payload: list[memoryview] = field(default_factory=list)

    @property
    def type_name(self) -> str:
        return data_pb2.MessageType.Name(self.type)

    @property
    def is_chunk(self) -> bool:
        return self.envelope.chunk.count > 1


class Checksum(NamedTuple):
    """An envelope checksum: its kind (``CRC32`` or ``XXH3_64``) and value."""

    kind: int
    value: int


FUSED_BLOCK_BYTES = 256 * 1024
"""Block size of a fused pass (``compute_checksum(also=...)``): two hashes read each block while it is in L2, so the
payload leaves memory once, not twice (XXH3-64 + XXH3-128 over 1 GiB here: 0.12 s fused, 0.19 s as two passes)."""


class PayloadTee(Protocol):
    """A second hasher fed the payload frames in the checksum's own pass (e.g. a transfer's content digest)."""

    def update(self, data: Any, /) -> None: ...


TeeFor = Callable[[int, data_pb2.Envelope], PayloadTee | None]
"""``decode``'s ``tee``: the hasher, if any, to feed a message's payload in its checksum pass."""


def compute_checksum(
    message_type: int, header_bytes: bytes, payload: Sequence[Any], kind: int = CRC32, *, also: PayloadTee | None = None
) -> int:
    """The envelope checksum of ``kind`` over the type byte, the serialized header and every payload frame.

    ``also``: fed every payload frame's bytes in the same pass, block by block (``FUSED_BLOCK_BYTES``)."""
    if kind == XXH3_64:
        state = xxhash.xxh3_64(bytes([message_type]))
        state.update(header_bytes)
        for frame in payload:
            _fused_update(byte_view(frame), state.update, also)
        return state.intdigest()
    if kind != CRC32:
        raise ValueError(f"unknown checksum kind {kind}")
    crc = zlib.crc32(bytes([message_type]))
    crc = zlib.crc32(header_bytes, crc)
    for frame in payload:
        view = byte_view(frame)
        crc = zlib.crc32(view, crc)
        if also is not None:
            also.update(view)
    return crc


def _fused_update(view: memoryview, update: Any, also: PayloadTee | None) -> None:
    if also is None or view.nbytes <= FUSED_BLOCK_BYTES:
        update(view)
        if also is not None:
            also.update(view)
        return
    for start in range(0, view.nbytes, FUSED_BLOCK_BYTES):
        block = view[start : start + FUSED_BLOCK_BYTES]
        update(block)
        also.update(block)


def envelope_checksum(envelope: data_pb2.Envelope) -> Checksum:
    """The checksum an envelope declares (of the kind its sender chose)."""
    kind = envelope.checksum_kind
    return Checksum(kind, envelope.checksum64 if kind == XXH3_64 else envelope.checksum)


def encode(message_type: int, header: ProtoMessage, payload: Sequence[Any] = (), **options: Any) -> list[Any]:
    """Frames of one message, ready for ``socket.send_multipart(frames, copy=False)``; ``options`` are
    ``encode_raw``'s (``auth_token``, ``sender``, ``chunk``, ``checksum``, ...).

    Payload frames are passed through untouched (no copy); the caller must not mutate them until sent.
    ``checksum``: the checksum of exactly this type, serialized header and payload, when the caller already
    has it (see ``encode_raw``); else one of ``checksum_kind`` is computed.
    """
    expected = HEADER_TYPES.get(message_type)
    if expected is None:
        raise ValueError(f"unknown message type {message_type}")
    if not isinstance(header, expected):
        raise TypeError(
            f"{MessageType.Name(message_type)} needs a {expected.__name__} header, got {type(header).__name__}"
        )
    return encode_raw(message_type, header.SerializeToString(deterministic=True), payload, **options)


def encode_raw(
    message_type: int,
    header_bytes: bytes,
    payload: Sequence[Any] = (),
    *,
    auth_token: str = "",
    sender: str = "",
    in_reply_to: str = "",
    message_id: str | None = None,
    chunk: data_pb2.Chunk | None = None,
    checksum: Checksum | int | None = None,
    checksum_kind: int = CRC32,
    also: PayloadTee | None = None,
) -> list[Any]:
    """``encode`` for a header that is already serialized, e.g. one received or spooled earlier.

    With ``checksum`` (the verified checksum of this type, ``header_bytes`` and ``payload``, e.g. the one a
    batch arrived or was spooled with; a plain int is a CRC-32) no pass over the payload is made: relaying and
    resending a message costs no checksum pass. The caller vouches that the checksum belongs to exactly these
    bytes; a wrong one makes the receiver refuse the message (ERROR_CODE_BAD_CHECKSUM), never accept other bytes.
    Without it, one of ``checksum_kind`` is computed: ``XXH3_64`` (~8x faster than CRC-32 here) for large
    payloads such as weights, ``CRC32`` (the default) where a receiver keeps the CRC (the rollout spool).
    ``also``: a hasher fed the payload in the same pass as that checksum (``compute_checksum``); with ``checksum``
    given it is fed the payload on its own.
    """
    if message_type not in HEADER_TYPES:
        raise ValueError(f"unknown message type {message_type}")
    payload_sizes = [byte_view(frame).nbytes for frame in payload]
    if checksum is None:
        checksum = Checksum(
            checksum_kind, compute_checksum(message_type, header_bytes, payload, checksum_kind, also=also)
        )
    else:
        for frame in payload if also is not None else ():
            also.update(byte_view(frame))
    if not isinstance(checksum, Checksum):
        checksum = Checksum(CRC32, checksum)
    envelope = data_pb2.Envelope(
        message_id=message_id or uuid.uuid4().hex,
        sent_unix_ms=int(time.time() * 1000),
        header=header_bytes,
        chunk=chunk or data_pb2.Chunk(index=0, count=1, total_bytes=sum(payload_sizes)),
        num_payload_frames=len(payload),
        payload_frame_bytes=payload_sizes,
        checksum=checksum.value if checksum.kind == CRC32 else 0,
        checksum_kind=checksum.kind,
        checksum64=checksum.value if checksum.kind == XXH3_64 else 0,
        auth_token=auth_token,
        in_reply_to=in_reply_to,
        sender=sender,
    )
    return [PROTOCOL_FRAME, bytes([message_type]), envelope.SerializeToString(), *payload]


def decode(
    frames: Sequence[Any],
    *,
    limits: Limits = DEFAULT_LIMITS,
    auth_token: str | None = None,
    tee: TeeFor | None = None,
) -> Message:
    """Parse and check one received multipart message, or raise the ``FramingError`` that says why not.

    Total: whatever the bytes, the only exception that leaves is a ``FramingError`` (a parser bug that
    raises anything else becomes ``MalformedHeader``), so a receiver's per-message guard never sees a
    peer's bytes take its IO thread down.

    Order of checks (cheapest first, nothing large kept before the sender is known): frame count and
    sizes, protocol and type frames, envelope, run token (``auth_token`` set: constant-time comparison),
    declared payload sizes, checksum, header, chunk fields, tensor payload.
    Tensor payloads of unchunked ROLLOUT_BATCH and WEIGHT_UPDATE messages are checked against the
    header's tensor specs; chunked ones are checked by ``chunked_transfer.ChunkAssembler`` once complete.

    ``tee(message_type, envelope)``: called once the sender is known and the sizes are checked, just before the
    checksum pass; a hasher it returns is fed the payload in that same pass (a transfer's running content digest,
    without a second pass over the bytes). When the checksum then does not match, that hasher has been fed bytes
    that are refused: its owner must drop it (the transfer cannot complete anyway).
    """
    try:
        return _decode(frames, limits, auth_token, tee)
    except FramingError:
        raise
    except (RecursionError, MemoryError) as exc:
        raise MalformedHeader(f"message could not be parsed: {type(exc).__name__}") from None
    except Exception as exc:  # totality: a peer's bytes never raise anything but a FramingError
        raise MalformedHeader(f"message could not be parsed: {type(exc).__name__}: {str(exc)[:200]}") from None


def _decode(frames: Sequence[Any], limits: Limits, auth_token: str | None, tee: TeeFor | None) -> Message:
    views = _sized_views(frames, limits)
    protocol = views[0][: len(PROTOCOL_FRAME) + 1].tobytes()  # never copy a large first frame
    if len(protocol) != len(PROTOCOL_FRAME) or not protocol.startswith(PROTOCOL_ID):
        raise UnknownProtocol(
            f"first frame {protocol[:16]!r} is not the primerl protocol id {PROTOCOL_ID!r} + version byte"
        )
    if protocol[-1] != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {protocol[-1]} is not supported; this peer speaks version {PROTOCOL_VERSION}"
        )

    type_frame = views[1][:8].tobytes()
    if len(type_frame) != 1 or type_frame[0] not in HEADER_TYPES:
        raise UnknownMessageType(f"unknown message type frame {type_frame[:8]!r}")
    message_type = type_frame[0]

    if views[2].nbytes > limits.max_envelope_bytes:
        raise OversizedFrame(f"envelope is {views[2].nbytes} bytes; the limit is {limits.max_envelope_bytes}")
    envelope = data_pb2.Envelope()
    try:
        envelope.ParseFromString(views[2].tobytes())
    except DecodeError as exc:
        raise MalformedHeader(f"envelope frame is not a valid Envelope protobuf: {exc}") from None

    # The token is checked before anything is done with the payload: an unauthenticated peer costs no CRC pass.
    if auth_token is not None and not hmac.compare_digest(envelope.auth_token.encode(), auth_token.encode()):
        raise Unauthenticated("missing or wrong run token: configure the same run token on every daemon of the run")

    payload = _declared_payload(views[NUM_FIXED_FRAMES:], envelope)

    declared = envelope_checksum(envelope)
    if declared.kind not in (CRC32, XXH3_64):
        raise MalformedHeader(f"unknown checksum kind {declared.kind}: this peer checks CRC-32 and XXH3-64")
    also = None if tee is None else tee(message_type, envelope)
    if compute_checksum(message_type, envelope.header, payload, declared.kind, also=also) != declared.value:
        raise ChecksumMismatch("checksum over header and payload does not match the envelope (corrupted in transit?)")

    header = HEADER_TYPES[message_type]()
    try:
        header.ParseFromString(envelope.header)
    except DecodeError as exc:
        raise MalformedHeader(f"{MessageType.Name(message_type)} header is not a valid protobuf: {exc}") from None

    chunk = envelope.chunk
    if chunk.count == 0 or chunk.index >= chunk.count:
        raise BadChunk(f"chunk index {chunk.index} of count {chunk.count} is impossible")
    if chunk.count > 1 and (len(payload) != 1 or not chunk.transfer_id):
        raise BadChunk("a chunk must carry exactly one payload frame and a transfer id")
    if chunk.total_bytes > limits.max_transfer_bytes:
        raise OversizedFrame(f"transfer of {chunk.total_bytes} bytes exceeds the limit of {limits.max_transfer_bytes}")

    message = Message(type=message_type, header=header, envelope=envelope, payload=payload)
    if message_type in TENSOR_MESSAGE_TYPES and chunk.count == 1:
        check_tensor_payload(message)
    return message


def _sized_views(frames: Sequence[Any], limits: Limits) -> list[memoryview]:
    """The frames as byte views, once their number and sizes are within ``limits``."""
    if len(frames) < NUM_FIXED_FRAMES:
        raise TruncatedMessage(f"message has {len(frames)} frame(s); at least {NUM_FIXED_FRAMES} are required")
    if len(frames) - NUM_FIXED_FRAMES > limits.max_payload_frames:
        raise OversizedFrame(
            f"message has {len(frames) - NUM_FIXED_FRAMES} payload frames; the limit is {limits.max_payload_frames}"
        )
    views = [byte_view(frame) for frame in frames]
    total_bytes = 0
    for index, view in enumerate(views):
        if view.nbytes > limits.max_frame_bytes:
            raise OversizedFrame(f"frame {index} is {view.nbytes} bytes; the limit is {limits.max_frame_bytes}")
        total_bytes += view.nbytes
    if total_bytes > limits.max_message_bytes:
        raise OversizedFrame(f"message is {total_bytes} bytes; the limit is {limits.max_message_bytes}")
    return views


def _declared_payload(payload: list[memoryview], envelope: data_pb2.Envelope) -> list[memoryview]:
    """The payload frames, as many and as large as the envelope declares."""
    if len(payload) < envelope.num_payload_frames:
        raise TruncatedMessage(
            f"envelope declares {envelope.num_payload_frames} payload frame(s); {len(payload)} arrived"
        )
    if len(payload) > envelope.num_payload_frames or len(envelope.payload_frame_bytes) != len(payload):
        raise MalformedHeader(
            f"{len(payload)} payload frame(s) arrived but the envelope declares {envelope.num_payload_frames} "
            f"with {len(envelope.payload_frame_bytes)} sizes"
        )
    for index, (view, declared) in enumerate(zip(payload, envelope.payload_frame_bytes)):
        if view.nbytes < declared:
            raise TruncatedMessage(f"payload frame {index} has {view.nbytes} bytes; the envelope declares {declared}")
        if view.nbytes != declared:
            raise MalformedHeader(f"payload frame {index} has {view.nbytes} bytes; the envelope declares {declared}")
    return payload


def enum_name(enum: Any, value: int) -> str:
    """``enum.Name(value)`` that never raises: a value outside the known set (a newer peer, or a hostile
    one) reads as ``<ENUM>_<value>``, e.g. ``ErrorCode(999)``. For logs and messages."""
    try:
        return enum.Name(value)
    except (ValueError, TypeError):
        return f"{getattr(enum, '_enum_type', None) and enum._enum_type.name or 'enum'}({value})"


def error_code_name(code: int) -> str:
    return enum_name(common_pb2.ErrorCode, code)


def role_name(role: int) -> str:
    return enum_name(common_pb2.Role, role)


def check_tensor_payload(message: Message) -> None:
    """A ROLLOUT_BATCH / WEIGHT_UPDATE payload must be one safetensors blob matching ``header.tensors``; a
    WEIGHT_UPDATE whose payload lies in shared memory (``header.shared_segment``) carries one empty frame instead
    (its reader checks the segment's bytes against the digest)."""
    if message.type == data_pb2.WEIGHT_UPDATE and message.header.HasField("shared_segment"):
        if len(message.payload) != 1 or message.payload[0].nbytes:
            raise MalformedHeader("a WEIGHT_UPDATE in shared memory carries one empty payload frame")
        return
    if len(message.payload) != 1:
        raise MalformedHeader(
            f"{message.type_name} carries {len(message.payload)} payload frames; "
            "exactly 1 safetensors frame is required"
        )
    try:
        check_tensor_frame(message.payload[0], message.header.tensors)
    except TensorFrameError as exc:
        error_class = TruncatedMessage if exc.truncated else (TensorMismatch if exc.mismatch else MalformedHeader)
        raise error_class(f"{message.type_name}: {exc}") from None


def encode_error(
    error: FramingError | common_pb2.ErrorDetail,
    *,
    refused_type: int = data_pb2.MESSAGE_TYPE_UNSPECIFIED,
    in_reply_to: str = "",
    sender: str = "",
    auth_token: str = "",
) -> list[Any]:
    detail = error.detail() if isinstance(error, FramingError) else error
    reply = data_pb2.ErrorReply(error=detail, refused_type=refused_type)
    return encode(data_pb2.ERROR, reply, in_reply_to=in_reply_to, sender=sender, auth_token=auth_token)


def peek_type(frames: Sequence[Any]) -> int:
    """The message type of frames that may not decode, for error replies; UNSPECIFIED if unreadable."""
    if len(frames) >= 2:
        raw = byte_view(frames[1])
        if raw.nbytes == 1 and raw[0] in HEADER_TYPES:
            return raw[0]
    return data_pb2.MESSAGE_TYPE_UNSPECIFIED
